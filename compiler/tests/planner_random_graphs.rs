//! The planner on random dataflow graphs, whose lifetimes are nothing like a
//! decoder's chain: long-lived values, fan-out, outputs in the middle,
//! in-place candidates everywhere. Every plan must pass the independent
//! checker and compute, at its planned addresses, exactly what the graph
//! means.

mod planner_support;

use kiln_compiler::compile::efficiency;
use kiln_compiler::passes::{run_pipeline, Pass};
use kiln_compiler::planner::check::check_key;
use kiln_compiler::planner::{plan_key, PlanContext};
use kiln_ir::plan::{KvLayout, Target};
use kiln_ir::{
    DType, Graph, InputRole, Key, Op, Rope, RopeScaling, Shape, TensorRef, TensorType, ValueId,
    WeightEntry, WeightManifest, WeightSource,
};
use planner_support::*;
use proptest::prelude::{any, proptest, ProptestConfig};
use std::collections::HashMap;

const T: u32 = 3;
const VOCAB: u32 = 40;

struct Built {
    graph: Graph,
    manifest: WeightManifest,
}

fn random_graph(seed: u64) -> Built {
    let mut rng = Rng::new(seed);
    let mut g = Graph::new(format!("random {seed:#x}"));
    let mut m = WeightManifest::default();
    let mut weight = |g: &mut Graph, dims: Vec<u32>| {
        let name = format!("w{}", g.weights.len());
        let shape = Shape(dims);
        m.entries.push(WeightEntry {
            name: name.clone(),
            dtype: DType::BF16,
            shape: shape.clone(),
            storage: None,
            source: WeightSource::Tensor(TensorRef {
                file: "model.safetensors".into(),
                tensor: name.clone(),
                dtype: DType::BF16,
                shape: shape.clone(),
            }),
        });
        g.add_weight(name, TensorType::new(DType::BF16, shape))
    };
    let ids = g.add_input(InputRole::TokenIds, TensorType::new(DType::I32, [T]));
    let pos = g.add_input(InputRole::Positions, TensorType::new(DType::I32, [T]));
    let widths = [16u32, 32, 48, 64, 96];
    let w0 = widths[rng.below(widths.len() as u64) as usize];
    let table = weight(&mut g, vec![VOCAB, w0]);
    let mut pool: Vec<ValueId> = vec![g.push1(Op::Embedding, &[ids, table])];
    let width = |g: &Graph, v: ValueId| g.ty(v).shape.dims()[1];
    let steps = 8 + rng.below(150);
    for _ in 0..steps {
        // Mostly recent values, sometimes old ones (long lifetimes).
        let pick = |rng: &mut Rng, pool: &Vec<ValueId>| {
            if rng.below(4) == 0 {
                pool[rng.below(pool.len() as u64) as usize]
            } else {
                pool[pool.len() - 1 - rng.below(pool.len().min(3) as u64) as usize]
            }
        };
        let x = pick(&mut rng, &pool);
        let wx = width(&g, x);
        let mut choice = rng.below(7);
        // One-argument silu_mul halves the width; rope needs whole heads.
        if (choice == 5 && wx % 32 != 0) || (choice == 6 && wx % 8 != 0) {
            choice = 0;
        }
        let v = match choice {
            0 | 1 => {
                let n = widths[rng.below(widths.len() as u64) as usize];
                let w = weight(&mut g, vec![n, wx]);
                g.push1(
                    Op::MatMul {
                        bias: false,
                        out: DType::BF16,
                    },
                    &[x, w],
                )
            }
            2 => {
                let same: Vec<ValueId> = pool
                    .iter()
                    .copied()
                    .filter(|&v| width(&g, v) == wx)
                    .collect();
                let y = same[rng.below(same.len() as u64) as usize];
                g.push1(Op::Add, &[x, y])
            }
            3 => {
                let w = weight(&mut g, vec![wx]);
                g.push1(
                    Op::RmsNorm {
                        eps: 1e-5,
                        unit_offset: rng.below(2) == 0,
                    },
                    &[x, w],
                )
            }
            4 => {
                let same: Vec<ValueId> = pool
                    .iter()
                    .copied()
                    .filter(|&v| width(&g, v) == wx)
                    .collect();
                let y = same[rng.below(same.len() as u64) as usize];
                g.push1(Op::SiluMul, &[x, y])
            }
            5 => g.push1(Op::SiluMul, &[x]),
            _ => g.push1(
                Op::Rope {
                    heads: wx / 8,
                    head_dim: 8,
                    rope: Rope {
                        theta: 10000.0,
                        scaling: RopeScaling::None,
                    },
                },
                &[x, pos],
            ),
        };
        pool.push(v);
        // Now and then a value in the middle is an output.
        if rng.below(8) == 0 {
            let name = format!("probe{}", g.outputs.len());
            g.add_output(name, v);
        }
    }
    let last = *pool.last().unwrap();
    let wl = width(&g, last);
    let head = weight(&mut g, vec![VOCAB, wl]);
    let logits = g.push1(
        Op::MatMul {
            bias: false,
            out: DType::F32,
        },
        &[last, head],
    );
    let next = g.push1(Op::Argmax, &[logits]);
    g.add_output("next_tokens", next);
    Built {
        graph: g,
        manifest: m,
    }
}

fn no_kv() -> KvLayout {
    KvLayout {
        layers: 0,
        kv_heads: 1,
        head_dim: 8,
        dtype: DType::BF16,
        block_size: 16,
        num_blocks: 1,
        null_block: 0,
        max_blocks_per_seq: 1,
    }
}

fn check_random(seed: u64) -> (f64, u32) {
    let Built {
        graph,
        mut manifest,
    } = random_graph(seed);
    let (g, info, _) =
        run_pipeline(graph, &mut manifest, &[Pass::Dce], true).unwrap_or_else(|e| panic!("{e}"));
    let kv = no_kv();
    let target = Target::Cpu;
    let ctx = PlanContext {
        manifest: &manifest,
        kv: &kv,
        target: &target,
        max_context: 16,
        lower: Default::default(),
    };
    let key = Key::new(T, 1, 0);
    let (kp, report) = plan_key(key, g, &info, &ctx).unwrap_or_else(|e| panic!("{e}"));
    let errs = check_key(&kp, &manifest, &kv);
    assert!(errs.is_empty(), "seed {seed:#x}: {errs:#?}");
    let mut rng = Rng::new(seed ^ 0x5555);
    let ck = random_checkpoint(&manifest, &mut rng);
    let mut staging = HashMap::new();
    staging.insert(
        InputRole::TokenIds,
        (0..T).map(|_| rng.below(VOCAB as u64) as f32).collect(),
    );
    staging.insert(
        InputRole::Positions,
        (0..T).map(|_| rng.below(100) as f32).collect(),
    );
    let inp = StepInputs {
        staging,
        caches: vec![],
    };
    let want = eval_graph(&kp.graph, &manifest, &ck, &inp);
    let got = exec_plan(&kp, &manifest, &kv, kp.arena_peak, &ck, &inp);
    assert!(got == want, "seed {seed:#x}: planned execution differs");
    (
        efficiency(kp.arena_lower_bound, kp.arena_peak),
        report.in_place,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn random_graphs_plan_without_overlap_and_compute_what_they_mean(seed in any::<u64>()) {
        check_random(seed);
    }
}

#[test]
fn random_graphs_reuse_in_place_and_stay_near_the_lower_bound() {
    let (mut sum, mut worst, mut reused) = (0.0, 1.0f64, 0);
    let n = 300;
    for seed in 0..n {
        let (e, r) = check_random(seed);
        sum += e;
        worst = worst.min(e);
        reused += r;
    }
    let mean = sum / n as f64;
    eprintln!("mean {mean:.4} worst {worst:.4} reused {reused}");
    assert!(
        reused > n as u32,
        "in-place reuse hardly ever happened: {reused}"
    );
    // Measured: mean 0.9975, worst 0.8947 (a graph whose bound is not
    // reachable or not found).
    assert!(mean >= 0.98, "mean efficiency {mean:.4}");
    assert!(worst >= 0.85, "worst efficiency {worst:.4}");
}

/// CI found this seed: its matmul chain overflows to NaN in two probes, and
/// a plain `==` on floats called the identical plan "different".
#[test]
fn a_graph_that_overflows_to_nan_still_matches_its_plan() {
    check_random(0x945d_b651_978a_380e);
}
