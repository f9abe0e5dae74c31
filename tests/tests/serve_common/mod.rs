//! Shared helpers of the serving tests: tiny random models compiled by the
//! real compiler, run by the runtime on the CPU backend with the real kernels.

#![allow(dead_code)]

use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
use kiln_ir::plan::Plan;
use kiln_ir::Key;
use kiln_runtime::{CpuBackend, Engine, EngineOptions, Faults, GraphMode};
use tempfile::TempDir;

/// A compiled tiny model and the directory holding its weights.
pub struct Tiny {
    pub dir: TempDir,
    pub plan: Plan,
}

/// Writes a tiny model of `family` and compiles `keys` for it (16-token
/// context blocks of 4, 64 usable blocks, context 96).
pub fn compile_tiny(family: Family, spec: &TinySpec, keys: &str, logits: bool) -> Tiny {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), family, spec).unwrap();
    let opts = CompileOptions {
        keys: keys.split(',').map(|k| k.parse::<Key>().unwrap()).collect(),
        logits,
        kv: KvOptions {
            block_size: 4,
            kv_blocks: Some(64),
            max_context: Some(96),
            ..KvOptions::default()
        },
        ..CompileOptions::default()
    };
    let compiled = compile_dir(dir.path(), &opts, &mut |_, _| {}).unwrap();
    Tiny {
        dir,
        plan: compiled.plan,
    }
}

/// The keys most serving tests compile: decode batches 1..8, a prefill chunk
/// of 4 for 2 sequences, speculative verification of 2 drafts for 2.
pub const KEYS: &str = "b1q1s0,b2q1s0,b4q1s0,b8q1s0,b2q4s0,b2q3s2";

pub fn smollm2(keys: &str) -> Tiny {
    compile_tiny(Family::Llama, &TinySpec::smollm2(), keys, true)
}

pub fn options(graphs: GraphMode) -> EngineOptions {
    EngineOptions {
        graphs,
        log: false,
        keep_logits: true,
        max_new_tokens: 1000,
        ..EngineOptions::default()
    }
}

pub fn engine(t: &Tiny, opts: EngineOptions) -> Engine {
    Engine::new(
        t.plan.clone(),
        t.dir.path(),
        Box::new(CpuBackend::new()),
        opts,
    )
    .unwrap()
}

/// Faults named in `KILN_TEST_FAULTS` (comma separated: `freeze_staging`,
/// `skip_replay`, `alloc_inside_capture`), so the lead can apply a mutation
/// to the replay test from outside and watch it fail:
/// `KILN_TEST_FAULTS=skip_replay cargo test -p kiln-tests --test serve_replay`.
pub fn faults_from_env() -> Faults {
    let mut f = Faults::default();
    if let Ok(v) = std::env::var("KILN_TEST_FAULTS") {
        for name in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match name {
                "freeze_staging" => f.freeze_staging = true,
                "skip_replay" => f.skip_replay = true,
                "alloc_inside_capture" => f.alloc_inside_capture = true,
                other => panic!("KILN_TEST_FAULTS: unknown fault `{other}`"),
            }
        }
    }
    f
}

/// Deterministic pseudo-random numbers for workloads.
pub struct Rng(kiln_ir::rng::SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(kiln_ir::rng::SplitMix64::new(seed))
    }
    pub fn below(&mut self, n: u32) -> u32 {
        (self.0.next_u64() % n as u64) as u32
    }
    pub fn prompt(&mut self, vocab: u32, len: usize) -> Vec<u32> {
        (0..len).map(|_| self.below(vocab)).collect()
    }
}

/// Largest absolute difference of two logit rows.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}
