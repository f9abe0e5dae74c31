//! `sample`: Philox's published answers, the exp the sampler uses, greedy
//! rows identical to `argmax`, mixed batches, and the empirical
//! distribution against softmax(logits / T) after top-k, top-p and min-p
//! (chi-square at significance 0.001).

mod common;

use common::*;
use kiln_ir::{DType, Op};
use kiln_kernels::cpu::sample::{
    exp_nonpositive, penalize, penalty_row, penalty_width, philox4x32_10, sample_row,
    sample_row_with, uniform24, RowSampling,
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

/// One row's presence, frequency and `(token, count)` list.
type RowPenalties = (f32, f32, Vec<(u32, u32)>);

/// The `sample` op with a penalties operand: each row's [`RowPenalties`]
/// in `slots` pairs.
fn sample_penalised(
    rows: &[Vec<f32>],
    rs: &[RowSampling],
    counters: &[u32],
    pens: &[RowPenalties],
    slots: u32,
) -> Vec<i32> {
    let v = rows[0].len() as u32;
    let r = rows.len() as u32;
    let params: Vec<f32> = rs.iter().flat_map(|s| s.params()).collect();
    let seeds: Vec<i32> = rs
        .iter()
        .zip(counters)
        .flat_map(|(s, &c)| s.seeds(c))
        .collect();
    let w = penalty_width(slots) as usize;
    let mut pen = vec![0i32; r as usize * w];
    for (row, (p, f, counts)) in pen.chunks_exact_mut(w).zip(pens) {
        penalty_row(row, *p, *f, counts).expect("the list fits");
    }
    let out = run(
        &Op::Sample,
        &[
            float(DType::F32, &[r, v], &rows.concat()),
            float(DType::F32, &[r, 4], &params),
            ints(&[r, 4], &seeds),
            ints(&[r, w as u32], &pen),
        ],
    );
    to_i32(&out[0])
}

/// OpenAI's formula, written out independently of `penalize`.
fn penalised(x: &[f32], presence: f32, frequency: f32, counts: &[(u32, u32)]) -> Vec<f32> {
    let mut y = x.to_vec();
    for &(t, c) in counts {
        if c > 0 {
            let once = y[t as usize] - presence;
            y[t as usize] = once - frequency * c as f32;
        }
    }
    y
}

/// A random sorted, distinct `(token, count)` list over `v` tokens.
fn random_counts(rng: &mut Rng, v: u32, n: usize) -> Vec<(u32, u32)> {
    let mut toks: Vec<u32> = (0..n).map(|_| rng.below(v as usize) as u32).collect();
    toks.sort_unstable();
    toks.dedup();
    toks.into_iter()
        .map(|t| (t, 1 + rng.below(4) as u32))
        .collect()
}

#[test]
fn penalties_move_the_distribution_exactly_as_presence_and_frequency_say() {
    let mut rng = Rng::new(210);
    let n = 40_000;
    for (t, p, f, k, top_p) in [
        (1.0, 0.8, 0.0, 0, 1.0),
        (0.7, 0.0, 0.5, 0, 1.0),
        (1.2, 0.4, 0.3, 10, 0.95),
        (0.9, -0.5, 0.2, 0, 1.0),
    ] {
        let x = rng.vec(24, -2.0, 2.0);
        let counts = random_counts(&mut rng, 24, 8);
        let rs = RowSampling {
            temperature: t,
            top_k: k,
            top_p,
            seed: 31,
            ..RowSampling::GREEDY
        };
        let mut got = vec![0u64; x.len()];
        // Many counters in one batch of rows, so the op's operand layout
        // is exercised, not just the reference row function.
        let batch = 200u32;
        for c0 in (0..n).step_by(batch as usize) {
            let rows = vec![x.clone(); batch as usize];
            let counters: Vec<u32> = (c0..c0 + batch).collect();
            let pens = vec![(p, f, counts.clone()); batch as usize];
            let rss = vec![rs; batch as usize];
            for tok in sample_penalised(&rows, &rss, &counters, &pens, 16) {
                got[tok as usize] += 1;
            }
        }
        let y = penalised(&x, p, f, &counts);
        let (chi, crit) = chi_square(&got, &expected(&y, t, k, top_p, 0.0), n as u64);
        assert!(chi < crit, "chi-square {chi:.2} >= {crit:.2} for {p} {f}");
        // And the check can fail: the unpenalised distribution is rejected
        // (where no filter cuts a token one of the two keeps).
        if k == 0 && top_p == 1.0 {
            let (chi0, crit0) = chi_square(&got, &expected(&x, t, 0, 1.0, 0.0), n as u64);
            assert!(
                chi0 > crit0,
                "{chi0} <= {crit0}: penalties {p} {f} changed nothing"
            );
        }
    }
}

#[test]
fn zero_penalties_and_empty_lists_leave_every_draw_bit_identical() {
    let mut rng = Rng::new(211);
    let rows: Vec<Vec<f32>> = (0..6).map(|_| rng.vec(3000, -8.0, 8.0)).collect();
    let rs: Vec<RowSampling> = (0..6)
        .map(|i| RowSampling {
            temperature: if i % 3 == 0 { 0.0 } else { 0.9 },
            top_p: 0.9,
            seed: 1000 + i,
            ..RowSampling::GREEDY
        })
        .collect();
    for step in 0..20u32 {
        let counters: Vec<u32> = (0..6).map(|i| step * 7 + i).collect();
        let counts = random_counts(&mut rng, 3000, 30);
        let pens: Vec<RowPenalties> = (0..6)
            .map(|i| match i % 2 {
                0 => (0.0, 0.0, counts.clone()),
                _ => (1.5, 0.5, Vec::new()),
            })
            .collect();
        assert_eq!(
            sample_penalised(&rows, &rs, &counters, &pens, 32),
            sample(&rows, &rs, &counters)
        );
    }
}

#[test]
fn greedy_rows_with_penalties_are_the_argmax_of_the_penalised_logits() {
    let mut rng = Rng::new(212);
    let mut moved = 0;
    for _ in 0..50 {
        let x = rng.vec(500, -4.0, 4.0);
        let best = argmax(std::slice::from_ref(&x))[0] as u32;
        // Penalise the best token and a few others.
        let mut counts = random_counts(&mut rng, 500, 5);
        counts.retain(|&(t, _)| t != best);
        counts.push((best, 1 + rng.below(3) as u32));
        counts.sort_unstable();
        let (p, f) = (rng.uniform(0.5, 1.5), rng.uniform(0.0, 1.0));
        let got = sample_penalised(
            std::slice::from_ref(&x),
            &[RowSampling::GREEDY],
            &[0],
            &[(p, f, counts.clone())],
            8,
        );
        let y = penalised(&x, p, f, &counts);
        assert_eq!(got, argmax(&[y]));
        moved += (got[0] as u32 != best) as u32;
    }
    assert!(moved > 10, "only {moved} of 50 penalised best tokens lost");
}

#[test]
fn the_penalty_list_ends_at_the_first_pair_out_of_range_or_out_of_order() {
    let x = vec![0.0f32; 10];
    let words = |pairs: &[(i32, i32)]| {
        let mut w = vec![1.0f32.to_bits() as i32, 0];
        for &(t, c) in pairs {
            w.extend([t, c]);
        }
        w
    };
    let apply = |pairs: &[(i32, i32)]| {
        let mut y = x.clone();
        penalize(&mut y, &words(pairs));
        y.iter().map(|&v| (v != 0.0) as u8).collect::<Vec<_>>()
    };
    assert_eq!(
        apply(&[(1, 1), (3, 2), (9, 1)]),
        [0, 1, 0, 1, 0, 0, 0, 0, 0, 1]
    );
    assert_eq!(
        apply(&[(1, 1), (10, 1), (3, 1)]),
        [0, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(apply(&[(4, 1), (2, 1)]), [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]);
    assert_eq!(apply(&[(4, 1), (4, 1)]), [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]);
    assert_eq!(apply(&[(-1, 0), (2, 1)]), [0; 10]);
    assert_eq!(
        apply(&[(2, 0), (5, -3), (6, 1)]),
        [0, 0, 0, 0, 0, 0, 1, 0, 0, 0]
    );
    // penalty_row refuses lists that do not fit or are not sorted.
    let mut row = vec![0; penalty_width(2) as usize];
    assert!(penalty_row(&mut row, 1.0, 0.0, &[(1, 1), (2, 1), (3, 1)]).is_none());
    assert!(penalty_row(&mut row, 1.0, 0.0, &[(2, 1), (1, 1)]).is_none());
    assert!(penalty_row(&mut row, 1.0, 0.0, &[(1, 1)]).is_some());
    assert_eq!(&row[2..], &[1, 1, -1, 0]);
}
