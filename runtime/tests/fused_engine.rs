//! The engine on the CPU backend gives the same greedy tokens and the same
//! logits, bit for bit, from a plan compiled with the `fuse-matmul` pass as
//! from one compiled without it: batched decode, prefill chunks and
//! speculative keys, replayed graphs, bf16 and f32 weights. (The fused op's
//! CPU reference is the unfused sequence; a plan where the fusion changed
//! the function, or the planner misplaced a fused op's operand, differs.)

mod common;

use common::*;
use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::passes::{Pass, DEFAULT_PIPELINE};
use kiln_ir::plan::Plan;
use kiln_ir::{DType, Op};
use kiln_runtime::{GraphMode, SeqOptions};
use std::path::Path;

fn compile(model: &TinyModel, dir: &Path, fuse: bool) -> Plan {
    let opts = CompileOptions {
        keys: model.keys.clone(),
        logits: true,
        kv: KvOptions {
            block_size: model.block_size,
            kv_blocks: Some(model.num_blocks - 1),
            max_context: Some(model.max_context),
            ..KvOptions::default()
        },
        passes: DEFAULT_PIPELINE
            .iter()
            .copied()
            .filter(|p| fuse || *p != Pass::FuseMatMul)
            .collect(),
        ..CompileOptions::default()
    };
    compile_dir(dir, &opts, &mut |_, _| {})
        .unwrap_or_else(|e| panic!("compiling the tiny model: {e}"))
        .plan
}

/// Tokens and logits of three concurrent sequences of different prompt
/// lengths, `n` new tokens each, graphs on.
fn run(plan: &Plan, dir: &Path, prompts: &[Vec<u32>], n: u32) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    let (mut e, stats) = engine_with(plan, dir, options(GraphMode::On));
    let ids: Vec<_> = prompts
        .iter()
        .map(|p| {
            e.add_sequence_with(
                p,
                SeqOptions {
                    max_new_tokens: n,
                    stop_on_eos: false,
                },
            )
            .unwrap()
        })
        .collect();
    let mut out = vec![(Vec::new(), Vec::new()); ids.len()];
    while e.has_work() {
        for (id, new) in e.step().unwrap() {
            let i = ids.iter().position(|x| *x == id).unwrap();
            out[i].0.extend(new);
            out[i].1.push(e.last_logits(id).unwrap().to_vec());
        }
    }
    assert!(
        stats.replays.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "no graph was replayed"
    );
    out
}

#[test]
fn fused_and_unfused_plans_pick_the_same_tokens_with_the_same_logits() {
    let mut rng = Rng::new(1517);
    for file_dtype in [DType::BF16, DType::F32] {
        let model = TinyModel {
            file_dtype,
            ..TinyModel::default()
        };
        let dir = tempfile::tempdir().unwrap();
        model.write_weights(dir.path()).unwrap();
        let fused = compile(&model, dir.path(), true);
        let plain = compile(&model, dir.path(), false);
        let fused_ops = |p: &Plan| {
            p.keys
                .iter()
                .flat_map(|k| &k.ops)
                .filter(|o| matches!(o.op, Op::FusedMatMul { .. }))
                .count()
        };
        assert!(fused_ops(&fused) > 0 && fused_ops(&plain) == 0);
        assert!(fused.keys[0].ops.len() < plain.keys[0].ops.len());
        let prompts: Vec<Vec<u32>> = [1, 5, 9]
            .iter()
            .map(|&len| prompt(&mut rng, model.vocab, len))
            .collect();
        let a = run(&fused, dir.path(), &prompts, 8);
        let b = run(&plain, dir.path(), &prompts, 8);
        assert_eq!(a, b, "{file_dtype}");
        // Different prompts give different continuations (not vacuous).
        assert!(a.iter().any(|s| s.0 != a[0].0), "{file_dtype}");
    }
}
