//! `sample`: Philox's published answers, the exp the sampler uses, greedy
//! rows identical to `argmax`, mixed batches, and the empirical
//! distribution against softmax(logits / T) after top-k, top-p and min-p
//! (chi-square at significance 0.001).

mod common;

use common::*;
use kiln_ir::{DType, Op};
use kiln_kernels::cpu::sample::{
    exp_nonpositive, philox4x32_10, sample_row, sample_row_with, uniform24, RowSampling,
};
use kiln_kernels::cpu::to_i32;

#[test]
fn philox_matches_the_random123_known_answer_vectors() {
    assert_eq!(
        philox4x32_10([0; 4], [0; 2]),
        [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
    );
    assert_eq!(
        philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
        [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
    );
    assert_eq!(
        philox4x32_10(
            [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
            [0xa409_3822, 0x299f_31d0]
        ),
        [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
    );
}

#[test]
fn uniforms_depend_on_seed_and_counter_and_are_uniform() {
    assert_ne!(uniform24(1, 0), uniform24(2, 0));
    assert_ne!(uniform24(1, 0), uniform24(1, 1));
    assert_ne!(
        uniform24(1 << 32, 0),
        uniform24(0, 0),
        "the seed's high half counts"
    );
    let n = 100_000u32;
    let mut bins = [0u32; 16];
    for c in 0..n {
        let u = uniform24(42, c);
        assert!(u < 1 << 24);
        bins[(u >> 20) as usize] += 1;
    }
    let e = n as f64 / 16.0;
    let chi: f64 = bins.iter().map(|&b| (b as f64 - e).powi(2) / e).sum();
    // 15 degrees of freedom, significance 0.001: 37.7.
    assert!(chi < 37.7, "{chi} {bins:?}");
}

#[test]
fn the_samplers_exp_is_close_to_exp_and_exact_at_zero() {
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert_eq!(exp_nonpositive(-88.0), 0.0);
    assert_eq!(exp_nonpositive(f32::NAN), 0.0);
    assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    let mut worst = 0f64;
    for i in 0..=86_990 {
        let z = -(i as f32) * 0.001 - (i % 7) as f32 * 1.3e-4;
        let got = exp_nonpositive(z) as f64;
        let want = (z as f64).exp();
        // The f32 range reduction `z * log2(e)` costs up to about |z| * 8e-8.
        let bound = 3e-7 + (z as f64).abs() * 8e-8;
        worst = worst.max((got - want).abs() / want / bound);
    }
    assert!(worst < 1.0, "relative error {worst} of the bound");
}

fn sample(rows: &[Vec<f32>], rs: &[RowSampling], counters: &[u32]) -> Vec<i32> {
    let v = rows[0].len() as u32;
    let r = rows.len() as u32;
    let params: Vec<f32> = rs.iter().flat_map(|s| s.params()).collect();
    let seeds: Vec<i32> = rs
        .iter()
        .zip(counters)
        .flat_map(|(s, &c)| s.seeds(c))
        .collect();
    let out = run(
        &Op::Sample,
        &[
            float(DType::F32, &[r, v], &rows.concat()),
            float(DType::F32, &[r, 4], &params),
            ints(&[r, 4], &seeds),
        ],
    );
    to_i32(&out[0])
}

fn argmax(rows: &[Vec<f32>]) -> Vec<i32> {
    let v = rows[0].len() as u32;
    let x = float(DType::F32, &[rows.len() as u32, v], &rows.concat());
    to_i32(&run(&Op::Argmax, &[x])[0])
}

#[test]
fn greedy_rows_are_exactly_argmax_whatever_their_other_parameters() {
    let mut rng = Rng::new(200);
    let nan = f32::NAN;
    let mut rows: Vec<Vec<f32>> = (0..6).map(|_| rng.vec(5000, -20.0, 20.0)).collect();
    rows.push(vec![nan; 5000]);
    rows.push(vec![f32::NEG_INFINITY; 5000]);
    let mut tie = vec![0.0; 5000];
    tie[7] = 3.0;
    tie[4000] = 3.0;
    tie[9] = nan;
    rows.push(tie);
    let greedy: Vec<RowSampling> = (0..rows.len())
        .map(|i| RowSampling {
            temperature: [0.0, -1.0, nan][i % 3],
            top_p: 0.5,
            top_k: 3,
            min_p: 0.2,
            seed: i as u64,
        })
        .collect();
    let counters: Vec<u32> = (0..rows.len() as u32).collect();
    assert_eq!(sample(&rows, &greedy, &counters), argmax(&rows));
    // A sampled row with no finite maximum is greedy too.
    let hot = vec![
        RowSampling {
            temperature: 1.0,
            ..RowSampling::GREEDY
        };
        3
    ];
    let inf_rows = vec![
        vec![nan; 10],
        vec![f32::NEG_INFINITY; 10],
        vec![1.0, f32::INFINITY, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ];
    assert_eq!(sample(&inf_rows, &hot, &[0, 1, 2]), vec![0, 0, 1]);
}

#[test]
fn a_mixed_batch_gives_each_row_what_it_gets_alone_in_any_row() {
    let mut rng = Rng::new(201);
    let rows: Vec<Vec<f32>> = (0..5).map(|_| rng.vec(3000, -4.0, 4.0)).collect();
    let rs: Vec<RowSampling> = (0..5)
        .map(|i| RowSampling {
            temperature: [0.0, 0.7, 1.0, 0.0, 1.3][i],
            top_p: [1.0, 0.9, 1.0, 1.0, 0.95][i],
            top_k: [0, 0, 50, 0, 0][i],
            min_p: [0.0, 0.0, 0.0, 0.0, 0.05][i],
            seed: 1000 + i as u64,
        })
        .collect();
    let counters = [3, 9, 27, 81, 243];
    let batch = sample(&rows, &rs, &counters);
    let greedy = argmax(&rows);
    for i in 0..5 {
        let alone = sample(&rows[i..i + 1], &rs[i..i + 1], &counters[i..i + 1]);
        assert_eq!(batch[i], alone[0], "row {i}");
        if rs[i].temperature == 0.0 {
            assert_eq!(batch[i], greedy[i], "greedy row {i}");
        }
    }
    // Reversed order: the same tokens, reversed (the row index is not an
    // input of the draw).
    let (mut rr, mut rp, mut rc) = (rows.clone(), rs.clone(), counters.to_vec());
    rr.reverse();
    rp.reverse();
    rc.reverse();
    let mut back = sample(&rr, &rp, &rc);
    back.reverse();
    assert_eq!(back, batch);
    // Over many counters the sampled rows do move off the argmax.
    let moved = (0..50u32)
        .filter(|&c| sample(&rows[1..2], &rs[1..2], &[c])[0] != greedy[1])
        .count();
    assert!(moved > 10, "{moved}");
}

/// The expected distribution, computed independently in f64 with libm's
/// exp: softmax(x / T), top-k, then top-p on the renormalized top-k
/// distribution (the smallest most-likely prefix holding `top_p`), then
/// min-p relative to the top token, renormalized.
fn expected(x: &[f32], t: f32, top_k: u32, top_p: f32, min_p: f32) -> Vec<f64> {
    let m = x.iter().cloned().fold(f32::MIN, f32::max) as f64;
    let e: Vec<f64> = x
        .iter()
        .map(|&v| ((v as f64 - m) / t as f64).exp())
        .collect();
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&a, &b| e[b].total_cmp(&e[a]));
    let k = if top_k == 0 { x.len() } else { top_k as usize };
    let top: Vec<usize> = order.into_iter().take(k).collect();
    let zk: f64 = top.iter().map(|&i| e[i]).sum();
    let mut keep = vec![false; x.len()];
    let mut cum = 0.0;
    for &i in &top {
        if top_p < 1.0 && cum >= top_p as f64 {
            break;
        }
        cum += e[i] / zk;
        keep[i] = true;
    }
    for i in 0..x.len() {
        if e[i] < min_p as f64 {
            keep[i] = false;
        }
    }
    let z: f64 = (0..x.len()).filter(|&i| keep[i]).map(|i| e[i]).sum();
    (0..x.len())
        .map(|i| if keep[i] { e[i] / z } else { 0.0 })
        .collect()
}

/// Chi-square of `counts` against `want` (cells with expectation > 0);
/// asserts that no cell of expectation 0 was drawn. Returns (statistic,
/// critical value at significance 0.001 for its degrees of freedom, from
/// the Wilson-Hilferty approximation with z = 3.09).
fn chi_square(counts: &[u64], want: &[f64], n: u64) -> (f64, f64) {
    let mut chi = 0.0;
    let mut cells = 0;
    for (i, (&c, &w)) in counts.iter().zip(want).enumerate() {
        if w == 0.0 {
            assert_eq!(c, 0, "token {i} is filtered out but was drawn {c} times");
            continue;
        }
        let e = w * n as f64;
        chi += (c as f64 - e).powi(2) / e;
        cells += 1;
    }
    let df = (cells - 1).max(1) as f64;
    let a = 2.0 / (9.0 * df);
    (chi, df * (1.0 - a + 3.09 * a.sqrt()).powi(3))
}

fn draws(x: &[f32], rs: RowSampling, n: u32) -> Vec<u64> {
    let mut counts = vec![0u64; x.len()];
    for c in 0..n {
        counts[sample_row(x, rs.params(), rs.seeds(c))] += 1;
    }
    counts
}

#[test]
fn draws_match_softmax_over_temperature_after_top_k_top_p_and_min_p() {
    let mut rng = Rng::new(202);
    let n = 40_000;
    for (t, k, p, mp) in [
        (1.0, 0, 1.0, 0.0),
        (0.5, 0, 1.0, 0.0),
        (1.7, 0, 1.0, 0.0),
        (0.8, 5, 1.0, 0.0),
        (0.8, 0, 0.8, 0.0),
        (0.8, 0, 1.0, 0.1),
        (0.8, 8, 0.9, 0.05),
        (1.2, 20, 0.95, 0.0),
    ] {
        let x = rng.vec(24, -3.0, 3.0);
        let rs = RowSampling {
            temperature: t,
            top_k: k,
            top_p: p,
            min_p: mp,
            seed: 99,
        };
        let (chi, crit) = chi_square(&draws(&x, rs, n), &expected(&x, t, k, p, mp), n as u64);
        assert!(chi < crit, "chi-square {chi:.2} >= {crit:.2} for {rs:?}");
    }
}

#[test]
fn the_chi_square_check_rejects_draws_at_the_wrong_temperature() {
    let x = Rng::new(203).vec(16, -3.0, 3.0);
    let n = 40_000;
    let rs = RowSampling {
        temperature: 1.0,
        seed: 5,
        ..RowSampling::GREEDY
    };
    let (chi, crit) = chi_square(&draws(&x, rs, n), &expected(&x, 0.6, 0, 1.0, 0.0), n as u64);
    assert!(
        chi > crit,
        "{chi} <= {crit}: the check cannot tell T=1 from T=0.6"
    );
}

#[test]
fn top_k_one_min_p_one_and_zero_top_p_keep_only_the_top_token() {
    let x = Rng::new(204).vec(1000, -5.0, 5.0);
    let best = argmax(std::slice::from_ref(&x))[0] as usize;
    for (k, p, mp) in [(1, 1.0, 0.0), (0, 0.0, 0.0), (0, 1e-9, 0.0), (0, 1.0, 1.0)] {
        for r in [0, 1 << 23, (1 << 24) - 1] {
            assert_eq!(
                sample_row_with(&x, [1.0, p, mp, 0.0], k, r),
                best,
                "k {k} p {p} min_p {mp}"
            );
        }
    }
}

#[test]
fn ties_at_a_threshold_are_all_kept_and_lower_tokens_never_drawn() {
    let x = vec![2.0, 2.0, 2.0, 1.9, -1.0];
    let mut seen = [0u32; 5];
    for r in (0..1u32 << 24).step_by(1 << 14) {
        seen[sample_row_with(&x, [1.0, 1.0, 0.0, 0.0], 1, r)] += 1;
    }
    assert!(seen[..3].iter().all(|&s| s > 300), "{seen:?}");
    assert_eq!(seen[3] + seen[4], 0, "{seen:?}");
}

#[test]
fn the_draw_walks_the_kept_tokens_in_index_order() {
    // Two equal tokens: the lower half of the uniforms picks the first.
    let x = vec![0.0, 0.0];
    assert_eq!(sample_row_with(&x, [1.0, 1.0, 0.0, 0.0], 0, 0), 0);
    assert_eq!(
        sample_row_with(&x, [1.0, 1.0, 0.0, 0.0], 0, (1 << 23) - 1),
        0
    );
    assert_eq!(sample_row_with(&x, [1.0, 1.0, 0.0, 0.0], 0, 1 << 23), 1);
    assert_eq!(
        sample_row_with(&x, [1.0, 1.0, 0.0, 0.0], 0, (1 << 24) - 1),
        1
    );
}
