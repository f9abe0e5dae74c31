//! The memory and workspace planner, checked two ways: the independent
//! checker on every plan, and executing plans at their planned addresses
//! against the graph's value semantics.

mod planner_support;

use kiln_compiler::compile::{efficiency, kv_layout, CompileError, CompileOptions, KvOptions};
use kiln_compiler::passes::synth::{SynthFamily, SynthSpec};
use kiln_compiler::planner::check::{check_key, check_plan};
use kiln_compiler::planner::workspace::MIB;
use kiln_compiler::planner::{plan_key, PlanContext, PlanError};
use kiln_ir::plan::{GemmKind, Lowering, Region, Target, ARENA_ALIGN};
use kiln_ir::{Key, Op, ValueDef};
use planner_support::*;

const FAMILIES: [SynthFamily; 3] = [SynthFamily::Llama, SynthFamily::Qwen2, SynthFamily::Qwen3];

fn opts(keys_: &str, logits: bool, fuse: bool) -> CompileOptions {
    CompileOptions {
        keys: keys(keys_),
        logits,
        passes: if fuse {
            kiln_compiler::passes::DEFAULT_PIPELINE.to_vec()
        } else {
            vec![kiln_compiler::passes::Pass::Dce]
        },
        ..CompileOptions::default()
    }
}

const KEYS: &str = "b1q1s0,b3q1s0,b2q3s2,b2q4s0,b5q2s1";

/// The fusions without `fuse-matmul`, for tests about plain matmuls (GEMM
/// workspace) and about the unfused step's buffers.
fn without_fused_matmul(mut o: CompileOptions) -> CompileOptions {
    o.passes
        .retain(|p| *p != kiln_compiler::passes::Pass::FuseMatMul);
    o
}

#[test]
fn every_compiled_plan_passes_the_independent_checker() {
    for fam in FAMILIES {
        for logits in [false, true] {
            for fuse in [false, true] {
                for target in ["cpu", "cuda:sm_90", "cuda:sm_80", "hip:gfx1100"] {
                    let mut o = opts(KEYS, logits, fuse);
                    o.target = target.parse().unwrap();
                    let c = compile_synth(&SynthSpec::tiny(fam), &o);
                    check_plan(&c.plan).unwrap_or_else(|e| panic!("{fam:?} {target}: {e:#?}"));
                    assert_eq!(c.plan.keys.len(), 5);
                }
            }
        }
    }
}

#[test]
fn executing_the_plan_at_its_addresses_matches_the_graph() {
    let mut rng = Rng::new(99);
    for fam in FAMILIES {
        for (logits, fuse) in [(false, true), (true, true), (false, false), (true, false)] {
            let spec = SynthSpec::tiny(fam);
            let c = compile_synth(&spec, &opts(KEYS, logits, fuse));
            let ck = random_checkpoint(&spec.manifest(), &mut rng);
            for kp in &c.plan.keys {
                let inp = random_inputs(kp.key, &c.plan.kv, spec.vocab, 64, &mut rng);
                let want = eval_graph(&kp.graph, &c.plan.manifest, &ck, &inp);
                let got = exec_plan(
                    kp,
                    &c.plan.manifest,
                    &c.plan.kv,
                    c.plan.arena_bytes,
                    &ck,
                    &inp,
                );
                assert!(
                    got == want,
                    "{fam:?} {} (logits {logits}, fused {fuse}): planned execution differs",
                    kp.key
                );
            }
        }
    }
}

#[test]
fn a_plan_with_two_live_buffers_sharing_bytes_is_caught_by_the_checker_and_computes_wrong_tokens() {
    let spec = SynthSpec::tiny(SynthFamily::Qwen3);
    let c = compile_synth(&spec, &opts("b2q1s0", true, true));
    let mut plan = c.plan.clone();
    let kp = &mut plan.keys[0];
    // The attention output and the residual stream it is added to are alive
    // together; put one on top of the other.
    let attn = kp
        .ops
        .iter()
        .position(|o| matches!(o.op, Op::PagedAttention(..)))
        .unwrap();
    let a = kp.graph.nodes[kp.ops[attn].node.index()].results[0];
    // The residual stream entering the layer: the embedding's output.
    let emb = kp
        .graph
        .nodes
        .iter()
        .find(|n| n.op == Op::Embedding)
        .unwrap()
        .results[0];
    let target = kp.buffers[emb.index()].buf;
    assert_eq!(target.region, Region::Arena);
    kp.buffers[a.index()].buf.offset = target.offset;
    for op in kp.ops.iter_mut() {
        let node = &kp.graph.nodes[op.node.index()];
        for (o, v) in op
            .args
            .iter_mut()
            .zip(&node.args)
            .chain(op.results.iter_mut().zip(&node.results))
        {
            if *v == a {
                o.buf.offset = target.offset;
            }
        }
    }
    let errs = check_key(&plan.keys[0], &plan.manifest, &plan.kv);
    assert!(
        errs.iter().any(|e| e.contains("share arena bytes")),
        "{errs:#?}"
    );
    // And it matters: executing it gives different logits.
    let mut rng = Rng::new(5);
    let ck = random_checkpoint(&spec.manifest(), &mut rng);
    let inp = random_inputs(plan.keys[0].key, &plan.kv, spec.vocab, 64, &mut rng);
    let want = eval_graph(&plan.keys[0].graph, &plan.manifest, &ck, &inp);
    let got = exec_plan(
        &plan.keys[0],
        &plan.manifest,
        &plan.kv,
        plan.arena_bytes,
        &ck,
        &inp,
    );
    assert_ne!(got.outputs, want.outputs);
}

#[test]
fn the_checker_rejects_buffers_outside_the_arena_misaligned_or_overlapping_io() {
    let c = compile_synth(
        &SynthSpec::tiny(SynthFamily::Llama),
        &opts("b2q1s0", true, true),
    );
    let base = c.plan.clone();
    let arena_value = |p: &kiln_ir::plan::Plan| {
        p.keys[0]
            .buffers
            .iter()
            .position(|b| b.buf.region == Region::Arena && b.buf.bytes > 0)
            .unwrap()
    };
    let mut p = base.clone();
    let v = arena_value(&p);
    p.keys[0].buffers[v].buf.offset = p.keys[0].arena_peak;
    assert!(check_plan(&p)
        .unwrap_err()
        .iter()
        .any(|e| e.contains("outside the arena")));
    let mut p = base.clone();
    p.keys[0].buffers[v].buf.offset += 8;
    assert!(check_plan(&p)
        .unwrap_err()
        .iter()
        .any(|e| e.contains("not aligned")));
    let mut p = base.clone();
    let io: Vec<usize> = (0..p.keys[0].buffers.len())
        .filter(|&i| p.keys[0].buffers[i].buf.region == Region::Io)
        .collect();
    let o = p.keys[0].buffers[io[0]].buf.offset;
    p.keys[0].buffers[io[1]].buf.offset = o;
    assert!(check_plan(&p)
        .unwrap_err()
        .iter()
        .any(|e| e.contains("Io buffers")));
    let mut p = base.clone();
    p.keys[0].arena_lower_bound += ARENA_ALIGN;
    assert!(check_plan(&p)
        .unwrap_err()
        .iter()
        .any(|e| e.contains("lower bound")));
    let mut p = base.clone();
    p.arena_bytes += 1;
    assert!(check_plan(&p).is_err());
    assert!(check_plan(&base).is_ok());
}

#[test]
fn in_place_reuse_happens_where_the_op_allows_it_and_only_there() {
    // Unfused graphs have `add` and `rope`, which may write over a dying
    // argument.
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let c = compile_synth(&spec, &opts("b2q1s0", false, false));
    let kp = &c.plan.keys[0];
    assert!(c.reports[0].in_place > 0);
    let mut shared = 0;
    for (i, op) in kp.ops.iter().enumerate() {
        let node = &kp.graph.nodes[op.node.index()];
        for (r, res) in op.results.iter().enumerate() {
            for (a, arg) in op.args.iter().enumerate() {
                if res.buf.region == Region::Arena && res.buf == arg.buf {
                    assert!(
                        op.op.may_reuse().contains(&(r, a)),
                        "op {i} `{}` shares an argument's memory without permission",
                        op.kernel
                    );
                    assert_eq!(kp.buffers[node.args[a].index()].last_use, Some(i as u32));
                    shared += 1;
                }
            }
        }
    }
    assert_eq!(shared, c.reports[0].in_place);
}

#[test]
fn outputs_are_written_straight_into_io_and_never_copied() {
    for logits in [false, true] {
        let c = compile_synth(
            &SynthSpec::tiny(SynthFamily::Qwen2),
            &opts("b2q3s2", logits, true),
        );
        let kp = &c.plan.keys[0];
        let names: Vec<&str> = kp.outputs.iter().map(|(n, _)| n.as_str()).collect();
        let mut want = vec!["next_tokens", "accepted"];
        if logits {
            want.push("logits");
        }
        assert_eq!(names, want);
        for (name, o) in &kp.outputs {
            assert_eq!(o.buf.region, Region::Io, "{name}");
            // The producing op writes the Io address itself.
            assert!(
                kp.ops
                    .iter()
                    .any(|op| op.results.iter().any(|r| r.buf == o.buf)),
                "{name}"
            );
        }
        // Inputs are in Io too, before the outputs, and nothing else is.
        let io_values = kp
            .buffers
            .iter()
            .filter(|b| b.buf.region == Region::Io)
            .count();
        assert_eq!(io_values, kp.inputs.len() + kp.outputs.len());
        let lm_head = kp
            .ops
            .iter()
            .find(|o| {
                matches!(
                    o.op,
                    Op::MatMul {
                        out: kiln_ir::DType::F32,
                        ..
                    } | Op::FusedMatMul {
                        out: kiln_ir::DType::F32,
                        ..
                    }
                )
            })
            .unwrap();
        // Without logits the greedy argmax joins the lm_head (the argmax
        // epilogue, CPU target): its result is then the tokens output, in
        // Io; the logits themselves are never materialized.
        let argmax_joined = matches!(
            lm_head.op,
            Op::FusedMatMul {
                post: kiln_ir::Epilogue::Argmax,
                ..
            }
        );
        assert_eq!(argmax_joined, !logits);
        assert_eq!(lm_head.results[0].buf.region, Region::Io);
        assert_eq!(
            lm_head.results[0].ty.dtype == kiln_ir::DType::I32,
            argmax_joined
        );
    }
}

#[test]
fn chain_of_interior_buffers_costs_the_peak_not_the_sum() {
    let spec = SynthSpec::tiny(SynthFamily::Qwen3);
    let c = compile_synth(&spec, &without_fused_matmul(opts("b4q1s0", false, true)));
    let kp = &c.plan.keys[0];
    let sum: u64 = kp
        .buffers
        .iter()
        .filter(|b| b.buf.region == Region::Arena)
        .map(|b| b.buf.bytes.div_ceil(ARENA_ALIGN) * ARENA_ALIGN)
        .sum();
    // Two layers' worth of activations, but only a few alive at once.
    assert!(
        kp.arena_peak * 4 < sum,
        "peak {} vs sum {sum}",
        kp.arena_peak
    );
    assert!(kp.arena_peak >= kp.arena_lower_bound);
}

#[test]
fn planner_efficiency_is_at_least_95_percent_on_a_qwen3_0_6b_shaped_model() {
    let spec = SynthSpec::qwen3_0_6b();
    let mut o = opts(
        "b1q1s0,b2q1s0,b4q1s0,b8q1s0,b16q1s0,b32q1s0,b1q4s3,b8q4s3,b4q16s0",
        false,
        true,
    );
    o.kv.max_context = Some(2048);
    o.target = "cuda:sm_90".parse().unwrap();
    // The op counts below are those of the fused GEMVs (opt-in on GPUs).
    o.fused_gemv = true;
    let c = compile_synth(&spec, &o);
    for kp in &c.plan.keys {
        let e = efficiency(kp.arena_lower_bound, kp.arena_peak);
        assert!(e >= 0.95, "{}: efficiency {e:.4}", kp.key);
        // One-token keys run the fused GEMVs (GPU_FUSE_MAX_TOKENS): 6 ops
        // per layer, the final norm and the greedy argmax in the lm_head
        // (unless a gather_last sits between).
        let (k, gather) = (kp.key, (kp.key.query > 1 && kp.key.spec == 0) as u32);
        let one = k.tokens() <= 1;
        let per_layer = if one { 28 * 6 + 2 + gather } else { 28 * 9 + 4 };
        assert_eq!(
            kp.ops.len() as u32,
            per_layer + (k.spec > 0) as u32 + gather,
            "{k}"
        );
        // `launches` counts kernels: a separate argmax is two (chunks, then
        // final); the argmax epilogue is one launch.
        let kernels: u32 = kp.ops.iter().map(|o| o.lowering.launches()).sum();
        assert_eq!(kp.launches, kernels);
        assert_eq!(kernels, kp.ops.len() as u32 + !one as u32, "{k}");
    }
    check_plan(&c.plan).unwrap();
}

#[test]
fn each_blas_gemm_gets_the_targets_blas_workspace_and_nothing_else_does() {
    for (target, want) in [
        ("cpu", 0),
        ("cuda:sm_90", 32 * MIB),
        ("cuda:sm_80", 4 * MIB),
        ("hip:gfx1100", 32 * MIB),
    ] {
        let mut o = without_fused_matmul(opts("b1q1s0,b4q1s0", false, true));
        o.target = target.parse().unwrap();
        let c = compile_synth(&SynthSpec::tiny(SynthFamily::Llama), &o);
        assert_eq!(c.plan.workspace_bytes, want, "{target}");
        assert_eq!(c.plan.meta.target.to_string(), target);
        let mut blas_gemms = 0;
        for kp in &c.plan.keys {
            let mut key_ws = 0;
            for op in &kp.ops {
                let gemm = matches!(op.op, Op::MatMul { .. });
                assert_eq!(op.kernel == "gemm", gemm);
                // Only a GEMM the BLAS library runs uses workspace; kiln's
                // GEMV (the one-token keys on GPUs) and the CPU do not.
                let blas = matches!(
                    op.lowering,
                    Lowering::Gemm {
                        kind: GemmKind::Blas,
                        ..
                    }
                );
                blas_gemms += usize::from(blas);
                assert_eq!(
                    op.workspace_bytes,
                    if blas { want } else { 0 },
                    "{target} {}",
                    kp.key
                );
                key_ws = key_ws.max(op.workspace_bytes);
                if !gemm {
                    assert_eq!(op.kernel, op.op.mnemonic());
                }
            }
            assert_eq!(kp.workspace_bytes, key_ws, "{target} {}", kp.key);
        }
        // b4's GEMMs go to BLAS-Lt on GPU targets, b1's to the GEMV.
        assert_eq!(blas_gemms > 0, want > 0, "{target}");
    }
}

#[test]
fn cost_figures_follow_the_documented_model() {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let c = compile_synth(&spec, &opts("b1q1s0,b4q1s0", false, true));
    let (b1, b4) = (&c.plan.keys[0], &c.plan.keys[1]);
    assert_eq!(b1.launches as usize, b1.ops.len());
    // GEMM flops alone: per layer qkv, o, gate_up, down; plus lm_head.
    let (h, q, kv, i, v) = (32u64, 32u64, 16u64, 48u64, 96u64);
    let layer = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * h * 2 * i + 2 * i * h;
    let gemm_flops = 2 * layer + 2 * h * v;
    let max_ctx = c.plan.meta.info.max_context as u64;
    let attn = 2 * 4 * 4 * 8 * max_ctx; // layers * 4*hd*ctx per head * heads
    assert!(
        b1.flops > gemm_flops + attn,
        "{} <= {}",
        b1.flops,
        gemm_flops + attn
    );
    assert!(b1.flops < (gemm_flops + attn) * 2);
    // Bytes: at least every weight once, plus K and V at full context.
    let weights = c.plan.manifest.total_bytes();
    let embed_rows_not_read = (v - 1) * h * 2;
    let kv_read = 2 * 2 * max_ctx * kv * 2;
    assert!(b1.bytes_moved >= weights - embed_rows_not_read + kv_read);
    assert!(b4.bytes_moved > b1.bytes_moved);
    assert!(b4.flops > 3 * b1.flops);
}

#[test]
fn compiling_twice_gives_byte_identical_plans_whatever_the_key_order() {
    let spec = SynthSpec::tiny(SynthFamily::Qwen3);
    let a = compile_synth(&spec, &opts("b1q1s0,b4q1s0,b2q3s2", true, true));
    let b = compile_synth(&spec, &opts("b2q3s2,b1q1s0,b4q1s0,b1q1s0", true, true));
    let ea = kiln_ir::artifact::encode(&a.plan);
    assert_eq!(ea, kiln_ir::artifact::encode(&b.plan));
    assert_eq!(
        ea,
        kiln_ir::artifact::encode(
            &compile_synth(&spec, &opts("b1q1s0,b4q1s0,b2q3s2", true, true)).plan
        )
    );
    let ks: Vec<String> = a.plan.keys.iter().map(|k| k.key.to_string()).collect();
    assert_eq!(ks, ["b1q1s0", "b2q3s2", "b4q1s0"]);
}

#[test]
fn the_kv_layout_follows_the_options() {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let mut info = synth_meta(&spec).info;
    info.max_context = 1000;
    let ks = keys("b1q1s0,b8q1s0");
    // Default: every row of the widest key can reach the context cap.
    let (kv, ctx) = kv_layout(&info, &KvOptions::default(), &ks).unwrap();
    assert_eq!(ctx, 1000);
    assert_eq!(kv.max_blocks_per_seq, 63);
    assert_eq!(kv.num_blocks, 8 * 63 + 1);
    assert_eq!(kv.null_block, 0);
    assert_eq!((kv.layers, kv.kv_heads, kv.head_dim), (2, 2, 8));
    let o = KvOptions {
        kv_blocks: Some(10),
        block_size: 32,
        max_context: Some(100),
        ..KvOptions::default()
    };
    let (kv, ctx) = kv_layout(&info, &o, &ks).unwrap();
    assert_eq!(
        (kv.num_blocks, kv.block_size, kv.max_blocks_per_seq, ctx),
        (11, 32, 4, 100)
    );
    let o = KvOptions {
        max_tokens: Some(33),
        ..KvOptions::default()
    };
    assert_eq!(kv_layout(&info, &o, &ks).unwrap().0.num_blocks, 4);
    let bad = [
        KvOptions {
            kv_blocks: Some(1),
            max_tokens: Some(1),
            ..KvOptions::default()
        },
        KvOptions {
            block_size: 0,
            ..KvOptions::default()
        },
        KvOptions {
            kv_blocks: Some(0),
            ..KvOptions::default()
        },
        KvOptions {
            kv_blocks: Some(u32::MAX),
            ..KvOptions::default()
        },
    ];
    for o in bad {
        let e = kv_layout(&info, &o, &ks).unwrap_err();
        assert!(matches!(e, CompileError::Options(_)), "{e}");
    }
    // The compiled plan records the capped context.
    let c = compile_synth(&spec, &opts("b1q1s0", false, true));
    assert_eq!(c.plan.meta.info.max_context, 64);
    assert_eq!(c.plan.kv.max_blocks_per_seq, 4);
}

#[test]
fn a_graph_traced_for_another_kv_layout_with_a_non_computed_output_or_unverified_is_refused() {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let key: Key = "b1q1s0".parse().unwrap();
    let kv = spec.kv_layout(16, 9, 64);
    let other = spec.kv_layout(16, 5, 64);
    let m = spec.manifest();
    let target = Target::Cpu;
    let ctx = PlanContext {
        manifest: &m,
        kv: &kv,
        target: &target,
        max_context: 64,
        lower: Default::default(),
    };
    let g = spec.graph(key, &other, false);
    let e = plan_key(key, g.clone(), &verified(&g), &ctx).unwrap_err();
    assert!(matches!(e, PlanError::CacheType { .. }), "{e}");
    let mut g = spec.graph(key, &kv, false);
    let ids = g.inputs[0];
    g.add_output("echo", ids);
    let e = plan_key(key, g.clone(), &verified(&g), &ctx).unwrap_err();
    assert!(matches!(e, PlanError::OutputNotComputed { .. }), "{e}");
    assert!(e.to_string().contains("token_ids"), "{e}");
    let mut g = spec.graph(key, &kv, false);
    let w = g.weights[0];
    if let ValueDef::Weight(n) = &mut g.values[w.index()].def {
        *n = "no.such.weight".into();
    }
    let e = plan_key(key, g.clone(), &verified(&g), &ctx).unwrap_err();
    assert!(matches!(e, PlanError::MissingWeight { .. }), "{e}");
    // A graph changed after it was verified is not planned on the old proof.
    let mut g = spec.graph(key, &kv, false);
    let proof = verified(&g);
    let ty = g.ty(g.inputs[0]).clone();
    g.add_input(kiln_ir::InputRole::ContextLens, ty);
    let e = plan_key(key, g, &proof, &ctx).unwrap_err();
    assert!(matches!(e, PlanError::Unverified { .. }), "{e}");
}

/// The IR verifier's proof for `g`, without the manifest check (these
/// graphs are wrong for the planner on purpose, not for the verifier).
fn verified(g: &kiln_ir::Graph) -> kiln_ir::GraphInfo {
    kiln_ir::verify(g, None).unwrap_or_else(|e| panic!("{e}"))
}
