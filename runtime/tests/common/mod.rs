//! Shared helpers of the runtime's integration tests: tiny hand-planned
//! models on the CPU backend with the reference test kernels.

#![allow(dead_code)]

use kiln_ir::plan::Plan;
use kiln_runtime::cpu::CpuStats;
use kiln_runtime::testing::{reference_kernels, TinyModel};
use kiln_runtime::{CpuBackend, Engine, EngineOptions, Faults, GraphMode};
use std::path::Path;
use std::sync::Arc;
use tempfile::TempDir;

pub fn build(model: &TinyModel) -> (TempDir, Plan) {
    let dir = tempfile::tempdir().unwrap();
    let plan = model.build(dir.path()).unwrap();
    (dir, plan)
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

pub fn engine_with(plan: &Plan, dir: &Path, opts: EngineOptions) -> (Engine, Arc<CpuStats>) {
    let be = CpuBackend::with_kernels(reference_kernels);
    let stats = be.stats();
    let e = Engine::new(plan.clone(), dir, Box::new(be), opts).unwrap();
    (e, stats)
}

pub fn engine(plan: &Plan, dir: &Path, graphs: GraphMode) -> Engine {
    engine_with(plan, dir, options(graphs)).0
}

/// Faults named in `KILN_TEST_FAULTS` (comma separated: `freeze_staging`,
/// `skip_replay`, `alloc_inside_capture`), so a mutation can be applied to
/// the replay-equals-eager test from outside:
/// `KILN_TEST_FAULTS=skip_replay cargo test -p kiln-runtime --test replay`
/// must fail.
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

/// A random prompt of `len` tokens.
pub fn prompt(rng: &mut kiln_runtime::testing::Rng, vocab: u32, len: usize) -> Vec<u32> {
    (0..len).map(|_| rng.below(vocab)).collect()
}
