//! The `sample` kernel on a real GPU: the same token as the CPU reference
//! for the same logits, parameters, seeds and counters (greedy rows are
//! argmax), the empirical distribution against softmax(logits / T) after
//! top-k/top-p/min-p (chi-square at significance 0.001), and replay of a
//! captured graph with parameters that change every step; with a
//! penalties operand, the same token as the CPU reference applied to the
//! penalised logits.
//!
//! Skips without a CUDA device unless `KILN_REQUIRE_CUDA=1`.
#![cfg(feature = "cuda")]

mod cuda_support;

use cuda_support::*;
use kiln_ir::{DType, Key, Op, TensorType};
use kiln_kernels::cpu::sample::{penalize, penalty_row, penalty_width, sample_row, RowSampling};
use kiln_runtime::backend::{Backend, Launch};
use kiln_runtime::cuda::CudaBackend;

fn gpu() -> Option<CudaBackend> {
    let d = device();
    if d.is_none() {
        assert!(
            std::env::var("KILN_REQUIRE_CUDA").as_deref() != Ok("1"),
            "KILN_REQUIRE_CUDA=1 but no CUDA device is usable"
        );
    }
    d
}

/// The `params` and `seeds` operands of rows `rs` drawing at `counters`.
fn staged(rs: &[RowSampling], counters: &[u32]) -> (HT, HT) {
    let r = rs.len() as u32;
    (
        HT::floats(
            DType::F32,
            &[r, 4],
            rs.iter().flat_map(|s| s.params()).collect(),
        ),
        HT::ints(
            &[r, 4],
            rs.iter()
                .zip(counters)
                .flat_map(|(s, &c)| s.seeds(c))
                .collect(),
        ),
    )
}

fn inputs(rows: &[Vec<f32>], rs: &[RowSampling], counters: &[u32]) -> [HT; 3] {
    let (r, v) = (rows.len() as u32, rows[0].len() as u32);
    let (p, s) = staged(rs, counters);
    [HT::floats(DType::F32, &[r, v], rows.concat()), p, s]
}

fn logits(r: &mut Rng, v: usize, scale: f32) -> Vec<f32> {
    (0..v).map(|_| (r.uniform() - 0.5) * scale).collect()
}

#[test]
fn cuda_sample_picks_the_cpu_references_token_for_the_same_uniforms() {
    let Some(mut b) = gpu() else { return };
    let mut r = Rng::new(300);
    for v in [7usize, 1000, 49152, 151_936, 262_144] {
        let rows: Vec<Vec<f32>> = (0..8).map(|i| logits(&mut r, v, 4.0 + i as f32)).collect();
        let rs: Vec<RowSampling> = (0..8)
            .map(|i| RowSampling {
                temperature: [0.0, 0.6, 1.0, 1.4, 0.0, 0.9, 1.1, 2.0][i],
                top_p: [1.0, 0.9, 1.0, 0.5, 1.0, 1.0, 0.95, 0.8][i],
                top_k: [0, 0, 40, 0, 0, 5, 100, 1000][i],
                min_p: [0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.02, 0.0][i],
                seed: r.next_u64(),
            })
            .collect();
        for step in 0..4u32 {
            let counters: Vec<u32> = (0..8).map(|i| step * 8 + i).collect();
            let args = inputs(&rows, &rs, &counters);
            let got = run_op(&mut b, &Op::Sample, &args);
            let want: Vec<i32> = rows
                .iter()
                .zip(&rs)
                .zip(&counters)
                .map(|((x, s), &c)| sample_row(x, s.params(), s.seeds(c)) as i32)
                .collect();
            assert_eq!(got[0].i, want, "V {v} step {step}");
            let argmax = run_op(&mut b, &Op::Argmax, &args[..1]);
            for i in [0, 4] {
                assert_eq!(
                    got[0].i[i], argmax[0].i[i],
                    "greedy row {i} is argmax, V {v}"
                );
            }
        }
    }
}

/// softmax(x / T), top-k, top-p on the renormalized top-k, min-p; in f64.
fn expected(x: &[f32], s: &RowSampling) -> Vec<f64> {
    let m = x.iter().cloned().fold(f32::MIN, f32::max) as f64;
    let e: Vec<f64> = x
        .iter()
        .map(|&v| ((v as f64 - m) / s.temperature as f64).exp())
        .collect();
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&a, &b| e[b].total_cmp(&e[a]));
    let k = if s.top_k == 0 {
        x.len()
    } else {
        s.top_k as usize
    };
    order.truncate(k);
    let zk: f64 = order.iter().map(|&i| e[i]).sum();
    let mut keep = vec![false; x.len()];
    let mut cum = 0.0;
    for &i in &order {
        if s.top_p < 1.0 && cum >= s.top_p as f64 {
            break;
        }
        cum += e[i] / zk;
        keep[i] = e[i] >= s.min_p as f64;
    }
    let z: f64 = (0..x.len()).filter(|&i| keep[i]).map(|i| e[i]).sum();
    (0..x.len())
        .map(|i| if keep[i] { e[i] / z } else { 0.0 })
        .collect()
}

#[test]
fn cuda_draws_match_softmax_after_the_filters_by_chi_square() {
    let Some(mut b) = gpu() else { return };
    let mut r = Rng::new(301);
    // 40,000 draws per case: 4000 rows of the same logits, ten launches,
    // every row its own counter.
    let (rows_n, launches) = (4000usize, 10u32);
    for s in [
        RowSampling {
            temperature: 1.0,
            ..RowSampling::GREEDY
        },
        RowSampling {
            temperature: 0.7,
            top_k: 6,
            ..RowSampling::GREEDY
        },
        RowSampling {
            temperature: 1.2,
            top_p: 0.85,
            min_p: 0.03,
            ..RowSampling::GREEDY
        },
    ] {
        let s = RowSampling {
            seed: r.next_u64(),
            ..s
        };
        let x = logits(&mut r, 20, 6.0);
        let rows = vec![x.clone(); rows_n];
        let rs = vec![s; rows_n];
        let mut counts = vec![0u64; x.len()];
        for l in 0..launches {
            let counters: Vec<u32> = (0..rows_n as u32).map(|i| l * rows_n as u32 + i).collect();
            let got = run_op(&mut b, &Op::Sample, &inputs(&rows, &rs, &counters));
            for &t in &got[0].i {
                counts[t as usize] += 1;
            }
        }
        let n = (rows_n as u64) * launches as u64;
        let want = expected(&x, &s);
        let (mut chi, mut cells) = (0.0, 0);
        for (i, (&c, &w)) in counts.iter().zip(&want).enumerate() {
            if w == 0.0 {
                assert_eq!(c, 0, "token {i} is filtered out but was drawn");
                continue;
            }
            chi += (c as f64 - w * n as f64).powi(2) / (w * n as f64);
            cells += 1;
        }
        let df = (cells - 1).max(1) as f64;
        let a = 2.0 / (9.0 * df);
        let crit = df * (1.0 - a + 3.09 * a.sqrt()).powi(3);
        assert!(chi < crit, "chi-square {chi:.2} >= {crit:.2} for {s:?}");
    }
}

#[test]
fn a_captured_sample_replays_with_parameters_that_change_every_step() {
    let Some(mut b) = gpu() else { return };
    let mut r = Rng::new(302);
    let (rows, v) = (4u32, 32_000usize);
    let x: Vec<Vec<f32>> = (0..rows).map(|_| logits(&mut r, v, 8.0)).collect();
    let lg = put(
        &mut b,
        &HT::floats(DType::F32, &[rows, v as u32], x.concat()),
    );
    let params = poisoned(&mut b, &TensorType::new(DType::F32, vec![rows, 4]));
    let seeds = poisoned(&mut b, &TensorType::new(DType::I32, vec![rows, 4]));
    let out = poisoned(&mut b, &TensorType::new(DType::I32, vec![rows]));
    let mut launch = Launch {
        const_args: 0,
        body: kiln_runtime::backend::LaunchBody::Reference,
        kernel: "sample_f32".into(),
        op: Op::Sample,
        args: vec![lg, params.clone(), seeds.clone()],
        results: vec![out.clone()],
        workspace: None,
    };
    let pdl = b.pdl();
    let _owned = gpu_bodies::lower(&mut b, &mut launch, pdl);
    b.prepare(&launch).unwrap();
    let stage = |b: &mut CudaBackend, rs: &[RowSampling], step: u32| {
        let (p, s) = staged(rs, &vec![step; rs.len()]);
        b.upload(params.ptr, &p.bytes()).unwrap();
        b.upload(seeds.ptr, &s.bytes()).unwrap();
    };
    let greedy = vec![RowSampling::GREEDY; rows as usize];
    stage(&mut b, &greedy, 0);
    b.begin_capture(Key::new(rows, 1, 0)).unwrap();
    b.launch(&launch).unwrap();
    let g = b.end_capture().unwrap();
    let mut seen = Vec::new();
    for step in 0..12u32 {
        let rs: Vec<RowSampling> = (0..rows)
            .map(|i| {
                if (i + step) % 3 == 0 {
                    RowSampling::GREEDY
                } else {
                    RowSampling {
                        temperature: 0.5 + 0.1 * step as f32,
                        top_k: [0, 3, 50][(step % 3) as usize],
                        top_p: 0.9,
                        min_p: 0.0,
                        seed: 17 + i as u64,
                    }
                }
            })
            .collect();
        stage(&mut b, &rs, step);
        b.upload(out.ptr, &vec![0xFF; rows as usize * 4]).unwrap();
        b.replay(g).unwrap();
        let got = get(&mut b, &out).i;
        let want: Vec<i32> = (0..rows as usize)
            .map(|i| sample_row(&x[i], rs[i].params(), rs[i].seeds(step)) as i32)
            .collect();
        assert_eq!(got, want, "step {step}");
        seen.push(got);
    }
    seen.dedup();
    assert!(seen.len() > 6, "replay ignored the refreshed parameters");
    b.destroy_graph(g).unwrap();
}

/// A penalties operand of `slots` pairs per row: rows alternate between
/// no penalties, presence+frequency over a random sorted list, and a list
/// that ends early (a pair out of order), so the kernel's list handling is
/// compared with the reference, not just its arithmetic.
fn penalties(r: &mut Rng, rows: usize, v: usize, slots: u32) -> Vec<i32> {
    let w = penalty_width(slots) as usize;
    let mut out = vec![0i32; rows * w];
    for (i, row) in out.chunks_exact_mut(w).enumerate() {
        let mut toks: Vec<u32> = (0..slots / 2)
            .map(|_| (r.next_u64() % v as u64) as u32)
            .collect();
        toks.sort_unstable();
        toks.dedup();
        let counts: Vec<(u32, u32)> = toks
            .iter()
            .map(|&t| (t, 1 + (r.next_u64() % 5) as u32))
            .collect();
        let (p, f) = match i % 3 {
            0 => (0.0, 0.0),
            _ => (0.3 + i as f32 * 0.2, 0.25),
        };
        penalty_row(row, p, f, &counts).unwrap();
        if i % 3 == 2 && counts.len() > 2 {
            // Out of order: the list ends after the first pair.
            row[2 + 2] = row[2];
        }
    }
    out
}

#[test]
fn cuda_sample_with_penalties_picks_the_cpu_references_token() {
    let Some(mut b) = gpu() else { return };
    let mut r = Rng::new(302);
    for (v, slots) in [(1000usize, 16u32), (151_936, 256), (262_144, 1024)] {
        let rows: Vec<Vec<f32>> = (0..6).map(|i| logits(&mut r, v, 3.0 + i as f32)).collect();
        let rs: Vec<RowSampling> = (0..6)
            .map(|i| RowSampling {
                temperature: [0.0, 0.8, 1.2, 0.0, 0.7, 1.0][i],
                top_p: [1.0, 0.9, 1.0, 1.0, 0.95, 1.0][i],
                top_k: [0, 0, 50, 0, 0, 200][i],
                min_p: 0.0,
                seed: r.next_u64(),
            })
            .collect();
        for step in 0..4u32 {
            let counters: Vec<u32> = (0..6).map(|i| step * 6 + i).collect();
            let pens = penalties(&mut r, 6, v, slots);
            let w = penalty_width(slots);
            let [x, p, s] = inputs(&rows, &rs, &counters);
            let args = [x, p, s, HT::ints(&[6, w], pens.clone())];
            let got = run_op(&mut b, &Op::Sample, &args);
            let want: Vec<i32> = (0..6)
                .map(|i| {
                    let mut y = rows[i].clone();
                    penalize(&mut y, &pens[i * w as usize..(i + 1) * w as usize]);
                    sample_row(&y, rs[i].params(), rs[i].seeds(counters[i])) as i32
                })
                .collect();
            assert_eq!(got[0].i, want, "V {v} slots {slots} step {step}");
            // Rows without penalties are exactly the unpenalised kernel's.
            let plain = run_op(&mut b, &Op::Sample, &args[..3]);
            for i in [0, 3] {
                assert_eq!(got[0].i[i], plain[0].i[i], "row {i} has no penalties");
            }
        }
    }
}
