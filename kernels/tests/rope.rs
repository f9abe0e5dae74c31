//! `rope` against the documented recipe (f32 angle `pos * inv_freq`, then
//! exact cos/sin and rotation in f64), against pure-f64 angles at small
//! positions, with rope scaling, in place, and `rope_cos_sin`.
//!
//! Tolerance vs the recipe: one ulp of the result dtype plus f32 error of
//! `cosf`/`sinf` and the rotation (`4e-7 * (|x1| + |x2|)`).

mod common;

use common::reference;
use common::*;
use kiln_ir::{DType, Op, Rope, RopeScaling};
use kiln_kernels::cpu::{rope_cos_sin, rope_inv_freq_f32};

fn rope_params(scaling: RopeScaling) -> Rope {
    Rope {
        theta: 10_000.0,
        scaling,
    }
}

/// Reference rope of a `[t, heads*hd]` tensor with angle function `angle`,
/// plus the per-element error allowance.
fn reference_rope(
    x: &[f64],
    pos: &[i32],
    heads: usize,
    hd: usize,
    angle: impl Fn(i32, usize) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut out = Vec::new();
    let mut err = Vec::new();
    for (t, &p) in pos.iter().enumerate() {
        let angles: Vec<f64> = (0..hd / 2).map(|i| angle(p, i)).collect();
        for h in 0..heads {
            let head = &x[(t * heads + h) * hd..(t * heads + h + 1) * hd];
            out.extend(reference::rope_head(head, &angles));
            for i in 0..hd {
                let j = if i < hd / 2 { i + hd / 2 } else { i - hd / 2 };
                err.push(4e-7 * (head[i].abs() + head[j].abs()));
            }
        }
    }
    (out, err)
}

#[test]
fn rope_follows_the_documented_f32_angle_recipe() {
    let mut rng = Rng::new(40);
    let scalings = [
        RopeScaling::None,
        RopeScaling::Linear { factor: 4.0 },
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        },
    ];
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for scaling in &scalings {
            for &(t, heads, hd) in &[(3usize, 6usize, 16usize), (7, 2, 64), (1, 9, 64), (2, 1, 2)] {
                let rope = rope_params(scaling.clone());
                let x = float(
                    dtype,
                    &[t as u32, (heads * hd) as u32],
                    &rng.vec(t * heads * hd, -2.0, 2.0),
                );
                let positions: Vec<i32> = (0..t).map(|_| rng.below(40_000) as i32).collect();
                let pos = ints(&[t as u32], &positions);
                let op = Op::Rope {
                    heads: heads as u32,
                    head_dim: hd as u32,
                    rope: rope.clone(),
                };
                let got = run(&op, &[x.clone(), pos]);
                let inv = rope.inv_freq(hd as u32);
                let (want, err) = reference_rope(&stored(&x), &positions, heads, hd, |p, i| {
                    reference::rope_angle_f32(p, inv[i])
                });
                assert_close_each(
                    &format!("rope {dtype} {scaling:?} {t}x{heads}x{hd}"),
                    dtype,
                    &got[0],
                    &want,
                    1.0,
                    &err,
                );
            }
        }
    }
}

#[test]
fn rope_matches_exact_angles_at_small_positions() {
    // Below position 64 the f32 angle is within ~4e-6 rad of the exact one.
    let mut rng = Rng::new(41);
    let (t, heads, hd) = (5usize, 4usize, 32usize);
    let rope = rope_params(RopeScaling::None);
    let x = float(
        DType::F32,
        &[t as u32, (heads * hd) as u32],
        &rng.vec(t * heads * hd, -1.0, 1.0),
    );
    let positions: Vec<i32> = (0..t as i32).map(|i| i * 13 % 64).collect();
    let got = run(
        &Op::Rope {
            heads: heads as u32,
            head_dim: hd as u32,
            rope: rope.clone(),
        },
        &[x.clone(), ints(&[t as u32], &positions)],
    );
    let inv = rope.inv_freq(hd as u32);
    let (want, _) = reference_rope(&stored(&x), &positions, heads, hd, |p, i| p as f64 * inv[i]);
    let err = vec![2e-5; want.len()];
    assert_close_each("rope exact angles", DType::F32, &got[0], &want, 0.0, &err);
}

#[test]
fn linear_scaling_by_two_at_position_2p_equals_no_scaling_at_p() {
    // (2p) * (f/2) == p * f exactly in f32, so the outputs agree bit for bit.
    let mut rng = Rng::new(42);
    let (t, heads, hd) = (4u32, 3u32, 64u32);
    let x = float(
        DType::BF16,
        &[t, heads * hd],
        &rng.vec((t * heads * hd) as usize, -2.0, 2.0),
    );
    let p: Vec<i32> = vec![1, 17, 1000, 3333];
    let doubled: Vec<i32> = p.iter().map(|v| 2 * v).collect();
    let plain = run(
        &Op::Rope {
            heads,
            head_dim: hd,
            rope: rope_params(RopeScaling::None),
        },
        &[x.clone(), ints(&[t], &p)],
    );
    let scaled = run(
        &Op::Rope {
            heads,
            head_dim: hd,
            rope: rope_params(RopeScaling::Linear { factor: 2.0 }),
        },
        &[x.clone(), ints(&[t], &doubled)],
    );
    assert_eq!(plain[0], scaled[0]);
    assert_ne!(plain[0], x.1, "rope changed nothing");
}

#[test]
fn rope_in_place_gives_the_out_of_place_result() {
    let mut rng = Rng::new(43);
    let (t, heads, hd) = (7u32, 6u32, 16u32);
    let x = float(
        DType::BF16,
        &[t, heads * hd],
        &rng.vec((t * heads * hd) as usize, -2.0, 2.0),
    );
    let pos = ints(&[t], &[0, 5, 9, 100, 7, 3000, 12]);
    let op = Op::Rope {
        heads,
        head_dim: hd,
        rope: rope_params(RopeScaling::None),
    };
    let expected = run(&op, &[x.clone(), pos.clone()]).remove(0);
    let (xb, pb) = (Owned::new(&x), Owned::new(&pos));
    exec(&op, &[xb.raw(), pb.raw()], &[xb.raw()]).unwrap();
    assert_eq!(xb.bytes(), expected);
}

#[test]
fn position_zero_is_the_identity() {
    let mut rng = Rng::new(44);
    let x = float(DType::F32, &[2, 64], &rng.vec(128, -2.0, 2.0));
    let op = Op::Rope {
        heads: 1,
        head_dim: 64,
        rope: rope_params(RopeScaling::None),
    };
    let got = run(&op, &[x.clone(), ints(&[2], &[0, 0])]);
    assert_eq!(got[0], x.1);
}

#[test]
fn rope_cos_sin_exposes_the_kernels_f32_angles() {
    let rope = rope_params(RopeScaling::Linear { factor: 2.0 });
    let inv = rope_inv_freq_f32(&rope, 64);
    assert_eq!(inv.len(), 32);
    let (c, s) = rope_cos_sin(&rope, 64, 4097);
    for i in 0..32 {
        let angle = 4097f32 * inv[i];
        assert_eq!(c[i], angle.cos());
        assert_eq!(s[i], angle.sin());
    }
    // And the kernel uses exactly these: a unit vector e_0 rotates to (c, s).
    let mut x = vec![0f32; 64];
    x[0] = 1.0;
    let got = run(
        &Op::Rope {
            heads: 1,
            head_dim: 64,
            rope,
        },
        &[float(DType::F32, &[1, 64], &x), ints(&[1], &[4097])],
    );
    let y = kiln_kernels::cpu::to_f32(DType::F32, &got[0]);
    assert_eq!((y[0], y[32]), (c[0], s[0]));
}
