//! The engine on the HIP backend against the cache-free reference of the
//! runtime's tiny model: greedy tokens and logits of graph replay and of eager
//! steps, on the HIP device. Needs an AMD GPU (with hipBLASLt for the
//! model's f32 GEMMs); prints `skipped: no HIP device (...)` otherwise.
#![cfg(feature = "rocm")]

mod common;

use common::{options, prompt, Rng, TinyModel};
use kiln_ir::plan::Target;
use kiln_runtime::hip::policy::graphs_supported;
use kiln_runtime::hip::HipBackend;
use kiln_runtime::{Backend, Engine, GraphMode, SeqOptions};

/// Logits of the HIP kernels (f32 accumulation in another order than the
/// reference loops) agree within this bound; a token may differ only where
/// the reference's top two logits are closer than it.
const BOUND: f32 = 1e-3;

fn run(graphs: GraphMode) {
    if HipBackend::device_count() == 0 {
        println!(
            "skipped: no HIP device ({})",
            HipBackend::no_device_reason()
        );
        return;
    }
    let model = TinyModel::default();
    let be = HipBackend::new(0).unwrap();
    // Compiled for this device by the real compiler: lowered launches, and
    // the kernels as code objects (hipcc) or source (compiled at load).
    let dir = tempfile::tempdir().unwrap();
    let plan = model
        .build_for(
            dir.path(),
            Target::Hip {
                gfx: be.info().arch,
            },
        )
        .unwrap();
    let mut opts = options(graphs);
    opts.graphs_supported = graphs_supported;
    let mut e = Engine::new(plan, dir.path(), Box::new(be), opts).unwrap();
    let w = model.weights();
    let mut rng = Rng::new(5);
    for len in [1, 5, 9] {
        let p = prompt(&mut rng, model.vocab, len);
        let id = e
            .add_sequence_with(
                &p,
                SeqOptions {
                    max_new_tokens: 12,
                    stop_on_eos: false,
                },
            )
            .unwrap();
        let mut logits = Vec::new();
        while e.has_work() {
            if !e.step().unwrap().is_empty() {
                logits.push(e.last_logits(id).unwrap().to_vec());
            }
        }
        let got = e.remove_sequence(id).unwrap();
        let (want, want_logits) = model.greedy_reference(&w, &p, 12);
        for i in 0..12 {
            let d = logits[i]
                .iter()
                .zip(&want_logits[i])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(d <= BOUND, "prompt {p:?} token {i}: logits differ by {d}");
            if got[i] != want[i] {
                let mut sorted = want_logits[i].clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                assert!(
                    sorted[0] - sorted[1] < BOUND,
                    "token {i} differs without a near-tie"
                );
            }
        }
    }
    let c = e.total_counters();
    if graphs == GraphMode::On {
        assert!(c.replays > 0 && c.captures > 0, "{c:?}");
    } else {
        assert_eq!(c.replays, 0, "{c:?}");
    }
}

#[test]
fn replayed_hip_graphs_match_the_reference() {
    run(GraphMode::On);
}

#[test]
fn eager_hip_steps_match_the_reference() {
    run(GraphMode::Off);
}
