//! `rms_norm`, `add_rms_norm` and `head_rms_norm` against f64 references,
//! including Gemma's `(1 + w)`, the rounded-sum rule of `add_rms_norm` and
//! `head_rms_norm` in place.
//!
//! Tolerance: one ulp of the result dtype plus `1e-5 * |y|`-scale f32 error
//! (the sum of squares and the scale are f32).

mod common;

use common::reference;
use common::*;
use kiln_ir::{DType, Op, TensorType};
use kiln_kernels::cpu::round_f32;

fn f32_err(want: &[f64]) -> Vec<f64> {
    want.iter().map(|w| 1e-5 * w.abs() + 1e-7).collect()
}

#[test]
fn rms_norm_matches_reference_for_odd_sizes_dtypes_and_unit_offset() {
    let mut rng = Rng::new(11);
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for &(t, h) in &[(1usize, 576usize), (3, 72), (7, 100), (2, 5)] {
            for unit_offset in [false, true] {
                let eps = 1e-5;
                let x = float(dtype, &[t as u32, h as u32], &rng.vec(t * h, -3.0, 3.0));
                let w = float(dtype, &[h as u32], &rng.vec(h, -1.5, 1.5));
                let got = run(&Op::RmsNorm { eps, unit_offset }, &[x.clone(), w.clone()]);
                let (xs, ws) = (stored(&x), stored(&w));
                let want: Vec<f64> = (0..t)
                    .flat_map(|i| {
                        reference::rms_norm(&xs[i * h..(i + 1) * h], &ws, eps as f64, unit_offset)
                    })
                    .collect();
                assert_close_each(
                    &format!("rms_norm {dtype} {t}x{h} offset={unit_offset}"),
                    dtype,
                    &got[0],
                    &want,
                    1.0,
                    &f32_err(&want),
                );
            }
        }
    }
}

#[test]
fn rms_norm_eps_matters_for_tiny_rows() {
    // With x ~ 1e-3 the mean square (1e-6) is comparable to eps = 1e-5: a
    // kernel that drops or misplaces eps is off by far more than an ulp.
    let mut rng = Rng::new(12);
    let (t, h) = (2, 64);
    let x = float(DType::F32, &[t, h], &rng.vec((t * h) as usize, -2e-3, 2e-3));
    let w = float(DType::F32, &[h], &rng.vec(h as usize, 0.5, 1.5));
    let eps = 1e-5;
    let got = run(
        &Op::RmsNorm {
            eps,
            unit_offset: false,
        },
        &[x.clone(), w.clone()],
    );
    let (xs, ws) = (stored(&x), stored(&w));
    let want: Vec<f64> = (0..t as usize)
        .flat_map(|i| reference::rms_norm(&xs[i * 64..(i + 1) * 64], &ws, eps as f64, false))
        .collect();
    assert_close_each(
        "rms_norm small",
        DType::F32,
        &got[0],
        &want,
        0.0,
        &f32_err(&want),
    );
}

#[test]
fn add_rms_norm_normalizes_the_rounded_sum_and_returns_it() {
    let mut rng = Rng::new(13);
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for &(t, h) in &[(3usize, 72usize), (1, 576), (7, 100)] {
            for unit_offset in [false, true] {
                let eps = 1e-6;
                let x = float(dtype, &[t as u32, h as u32], &rng.vec(t * h, -2.0, 2.0));
                let r = float(dtype, &[t as u32, h as u32], &rng.vec(t * h, -2.0, 2.0));
                let w = float(dtype, &[h as u32], &rng.vec(h, -1.0, 1.0));
                let got = run(
                    &Op::AddRmsNorm { eps, unit_offset },
                    &[x.clone(), r.clone(), w.clone()],
                );
                // The sum, rounded once to D, exactly.
                let sum: Vec<f64> = stored(&x)
                    .iter()
                    .zip(stored(&r))
                    .map(|(a, b)| round_f32(dtype, (*a as f32) + (b as f32)) as f64)
                    .collect();
                assert_close(
                    &format!("add_rms_norm sum {dtype}"),
                    dtype,
                    &got[1],
                    &sum,
                    0.0,
                    0.0,
                );
                let ws = stored(&w);
                let want: Vec<f64> = (0..t)
                    .flat_map(|i| {
                        reference::rms_norm(&sum[i * h..(i + 1) * h], &ws, eps as f64, unit_offset)
                    })
                    .collect();
                assert_close_each(
                    &format!("add_rms_norm normed {dtype} {t}x{h}"),
                    dtype,
                    &got[0],
                    &want,
                    1.0,
                    &f32_err(&want),
                );
            }
        }
    }
}

#[test]
fn add_rms_norm_equals_add_then_rms_norm_bit_for_bit() {
    let mut rng = Rng::new(14);
    let (t, h) = (5u32, 100u32);
    let x = float(DType::BF16, &[t, h], &rng.vec((t * h) as usize, -4.0, 4.0));
    let r = float(DType::BF16, &[t, h], &rng.vec((t * h) as usize, -4.0, 4.0));
    let w = float(DType::BF16, &[h], &rng.vec(h as usize, -1.0, 1.0));
    let fused = run(
        &Op::AddRmsNorm {
            eps: 1e-6,
            unit_offset: true,
        },
        &[x.clone(), r.clone(), w.clone()],
    );
    let sum = run(&Op::Add, &[x, r]).remove(0);
    let ty = TensorType::new(DType::BF16, vec![t, h]);
    let normed = run(
        &Op::RmsNorm {
            eps: 1e-6,
            unit_offset: true,
        },
        &[(ty, sum.clone()), w],
    )
    .remove(0);
    assert_eq!(fused[1], sum);
    assert_eq!(fused[0], normed);
}

fn head_case(
    dtype: DType,
    t: u32,
    heads: u32,
    hd: u32,
    unit_offset: bool,
    seed: u64,
) -> (Op, Vec<Arg>, Vec<f64>) {
    let mut rng = Rng::new(seed);
    let eps = 1e-6;
    let x = float(
        dtype,
        &[t, heads * hd],
        &rng.vec((t * heads * hd) as usize, -3.0, 3.0),
    );
    let w = float(dtype, &[hd], &rng.vec(hd as usize, -1.0, 1.0));
    let (xs, ws) = (stored(&x), stored(&w));
    let want: Vec<f64> = xs
        .chunks(hd as usize)
        .flat_map(|head| reference::rms_norm(head, &ws, eps as f64, unit_offset))
        .collect();
    let op = Op::HeadRmsNorm {
        heads,
        head_dim: hd,
        eps,
        unit_offset,
    };
    (op, vec![x, w], want)
}

#[test]
fn head_rms_norm_normalizes_each_head_separately() {
    let mut seed = 20;
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for &(t, heads, hd) in &[(3, 6, 16), (1, 9, 64), (7, 2, 10)] {
            for unit_offset in [false, true] {
                seed += 1;
                let (op, args, want) = head_case(dtype, t, heads, hd, unit_offset, seed);
                let got = run(&op, &args);
                assert_close_each(
                    &format!("head_rms_norm {dtype}"),
                    dtype,
                    &got[0],
                    &want,
                    1.0,
                    &f32_err(&want),
                );
            }
        }
    }
}

#[test]
fn head_rms_norm_in_place_gives_the_out_of_place_result() {
    let (op, args, _) = head_case(DType::BF16, 7, 6, 16, false, 30);
    let out_of_place = run(&op, &args).remove(0);
    let x = Owned::new(&args[0]);
    let w = Owned::new(&args[1]);
    exec(&op, &[x.raw(), w.raw()], &[x.raw()]).unwrap();
    assert_eq!(x.bytes(), out_of_place);
    assert_ne!(x.bytes(), args[0].1, "the norm changed nothing");
}
