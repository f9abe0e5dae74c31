//! CPU decode speed of a SmolLM2-135M-sized model (random weights, same
//! shapes: 30 layers, hidden 576, 9 heads over 3 kv heads, intermediate 1536,
//! vocabulary 49152, tied embeddings, bf16).
//!
//! Ignored by default: it writes a 270 MB model and only means something in a
//! release build on an otherwise idle machine. Run it with
//! `cargo test --release -p kiln-tests --test serve_perf -- --ignored --nocapture`.
//! The bar is 20 tokens/s on the 2-core development machine.

use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
use kiln_ir::Key;
use kiln_runtime::{CpuBackend, Engine, EngineOptions, GraphMode, SeqOptions};
use std::time::Instant;

#[test]
#[ignore = "writes a 270 MB model; run in release: see the module docs"]
fn smollm2_135m_sized_decode_runs_at_20_tokens_per_second_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec {
        layers: 30,
        hidden: 576,
        heads: 9,
        kv_heads: 3,
        intermediate: 1536,
        vocab: 49152,
        max_position: 2048,
        rope_theta: 100000.0,
        tie_embeddings: true,
        ..TinySpec::default()
    };
    write_tiny_model(dir.path(), Family::Llama, &spec).unwrap();
    let opts = CompileOptions {
        keys: vec![Key::new(1, 1, 0)],
        kv: KvOptions {
            max_context: Some(512),
            kv_blocks: Some(64),
            ..KvOptions::default()
        },
        ..CompileOptions::default()
    };
    let plan = compile_dir(dir.path(), &opts, &mut |_, _| {}).unwrap().plan;
    let eopts = EngineOptions {
        graphs: GraphMode::FromEnv,
        ..EngineOptions::default()
    };
    let mut e = Engine::new(plan, dir.path(), Box::new(CpuBackend::new()), eopts).unwrap();
    let id = e
        .add_sequence_with(
            &[1, 2, 3, 4],
            SeqOptions {
                max_new_tokens: 80,
                stop_on_eos: false,
            },
        )
        .unwrap();
    // Prompt and warm-up (capture) first, then time 64 decode steps.
    while e.sequence(id).unwrap().generated.len() < 16 {
        e.step().unwrap();
    }
    let t = Instant::now();
    let mut n = 0;
    while e.has_work() {
        n += e
            .step()
            .unwrap()
            .iter()
            .map(|(_, t)| t.len())
            .sum::<usize>();
    }
    let tps = n as f64 / t.elapsed().as_secs_f64();
    let c = e.total_counters();
    println!(
        "SmolLM2-135M-sized decode on the CPU: {n} tokens at {tps:.1} tokens/s ({} replays, {} eager steps)",
        c.replays, c.eager_steps
    );
    assert_eq!(n, 64);
    assert!(
        tps >= 20.0,
        "{tps:.1} tokens/s is below the 20 tokens/s bar"
    );
}
