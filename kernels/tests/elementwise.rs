//! `silu_mul`, `gelu_tanh_mul` (two-argument and packed forms), `add` and `scale`
//! against f64 references, and in place.
//!
//! Tolerance: one ulp of the result dtype plus f32 error: `2e-6 * |y|` for
//! the roundings, plus `2e-7 * |g * u|` because `1 + tanh(z)` cancels for
//! very negative gates (absolute f32 error of `tanhf` near -1, inherent in
//! the tanh formula every f32 implementation shares).

mod common;

use common::reference;
use common::*;
use kiln_ir::{DType, Op, TensorType};
use kiln_kernels::cpu::elementwise::SQRT_2_OVER_PI;
use kiln_kernels::cpu::round_f32;

fn err(want: &[f64], g: &[f64], u: &[f64]) -> Vec<f64> {
    want.iter()
        .zip(g.iter().zip(u))
        .map(|(w, (g, u))| 2e-6 * w.abs() + 2e-7 * (g * u).abs() + 1e-30)
        .collect()
}

fn gate(op: &Op) -> fn(f64) -> f64 {
    match op {
        Op::SiluMul => reference::silu,
        _ => reference::gelu_tanh,
    }
}

#[test]
fn gated_products_match_reference_in_both_forms() {
    let mut rng = Rng::new(100);
    for op in [Op::SiluMul, Op::GeluTanhMul] {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for &(t, i) in &[(1u32, 1536u32), (3, 72), (7, 100), (2, 1500)] {
                // Wide gate range: exercises exp/tanh saturation both ways.
                let g = rng.vec((t * i) as usize, -12.0, 12.0);
                let u = rng.vec((t * i) as usize, -3.0, 3.0);
                let ga = float(dtype, &[t, i], &g);
                let ua = float(dtype, &[t, i], &u);
                let f = gate(&op);
                let (gs, us) = (stored(&ga), stored(&ua));
                let want: Vec<f64> = gs.iter().zip(&us).map(|(g, u)| f(*g) * u).collect();
                let two = run(&op, &[ga.clone(), ua.clone()]);
                let tol = err(&want, &gs, &us);
                assert_close_each(
                    &format!("{} {dtype} two-arg", op.mnemonic()),
                    dtype,
                    &two[0],
                    &want,
                    1.0,
                    &tol,
                );
                // Packed: row r is [gate row r | up row r].
                let es = dtype.size() * i as usize;
                let mut packed = Vec::new();
                for r in 0..t as usize {
                    packed.extend_from_slice(&ga.1[r * es..(r + 1) * es]);
                    packed.extend_from_slice(&ua.1[r * es..(r + 1) * es]);
                }
                let one = run(&op, &[(TensorType::new(dtype, vec![t, 2 * i]), packed)]);
                assert_eq!(
                    one[0],
                    two[0],
                    "{} packed differs from two-arg",
                    op.mnemonic()
                );
            }
        }
    }
}

#[test]
fn gelu_constant_is_sqrt_two_over_pi_rounded_to_f32() {
    assert_eq!(
        SQRT_2_OVER_PI,
        (2.0f64 / std::f64::consts::PI).sqrt() as f32
    );
}

#[test]
fn gated_products_in_place_give_the_out_of_place_result() {
    let mut rng = Rng::new(101);
    // Several rows; and one long row, which helper threads share in column
    // chunks (the last one short).
    for (t, i, op) in [
        (5u32, 300u32, Op::SiluMul),
        (5, 300, Op::GeluTanhMul),
        (1, 1100, Op::SiluMul),
        (1, 1100, Op::GeluTanhMul),
    ] {
        let g = float(DType::BF16, &[t, i], &rng.vec((t * i) as usize, -4.0, 4.0));
        let u = float(DType::BF16, &[t, i], &rng.vec((t * i) as usize, -4.0, 4.0));
        let expected = run(&op, &[g.clone(), u.clone()]).remove(0);
        let (gb, ub) = (Owned::new(&g), Owned::new(&u));
        exec(&op, &[gb.raw(), ub.raw()], &[gb.raw()]).unwrap();
        assert_eq!(gb.bytes(), expected);

        // Packed in place: a [t, i] result over its [t, 2i] input.
        let gu = float(
            DType::BF16,
            &[t, 2 * i],
            &rng.vec((t * 2 * i) as usize, -4.0, 4.0),
        );
        let expected = run(&op, std::slice::from_ref(&gu)).remove(0);
        let b = Owned::new(&gu);
        exec(
            &op,
            &[b.raw()],
            &[b.raw_as(TensorType::new(DType::BF16, vec![t, i]))],
        )
        .unwrap();
        assert_eq!(&b.bytes()[..expected.len()], &expected[..]);
    }
}

#[test]
fn add_rounds_the_f32_sum_once_for_every_dtype_and_rank() {
    let mut rng = Rng::new(102);
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for shape in [vec![3u32, 72], vec![2500], vec![2, 3, 5]] {
            let n: u32 = shape.iter().product();
            let a = float(dtype, &shape, &rng.vec(n as usize, -100.0, 100.0));
            let b = float(dtype, &shape, &rng.vec(n as usize, -100.0, 100.0));
            let got = run(&Op::Add, &[a.clone(), b.clone()]);
            let want: Vec<f64> = stored(&a)
                .iter()
                .zip(stored(&b))
                .map(|(x, y)| round_f32(dtype, *x as f32 + y as f32) as f64)
                .collect();
            assert_close(
                &format!("add {dtype} {shape:?}"),
                dtype,
                &got[0],
                &want,
                0.0,
                0.0,
            );
        }
    }
}

#[test]
fn add_in_place_over_either_operand() {
    let mut rng = Rng::new(103);
    let a = float(DType::BF16, &[7, 100], &rng.vec(700, -5.0, 5.0));
    let b = float(DType::BF16, &[7, 100], &rng.vec(700, -5.0, 5.0));
    let expected = run(&Op::Add, &[a.clone(), b.clone()]).remove(0);
    for over in [0, 1] {
        let (ab, bb) = (Owned::new(&a), Owned::new(&b));
        let result = if over == 0 { ab.raw() } else { bb.raw() };
        exec(&Op::Add, &[ab.raw(), bb.raw()], &[result]).unwrap();
        let got = if over == 0 { ab.bytes() } else { bb.bytes() };
        assert_eq!(got, expected, "in place over operand {over}");
    }
    // a + a with the result over a.
    let ab = Owned::new(&a);
    exec(&Op::Add, &[ab.raw(), ab.raw()], &[ab.raw()]).unwrap();
    let doubled: Vec<f64> = stored(&a).iter().map(|v| 2.0 * v).collect();
    assert_close(
        "a + a in place",
        DType::BF16,
        &ab.bytes(),
        &doubled,
        0.0,
        0.0,
    );
}

#[test]
fn scale_multiplies_and_softcaps_like_the_f64_formula_and_runs_in_place() {
    let mut rng = Rng::new(117);
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (factor, softcap) in [(25.25f32, None), (1.0, Some(30.0f32)), (0.5, Some(2.0))] {
            let n = 1500u32;
            let x = rng.vec(n as usize, -80.0, 80.0);
            let xa = float(dtype, &[3, n / 3], &x);
            let xs = stored(&xa);
            let want: Vec<f64> = xs
                .iter()
                .map(|&v| {
                    let y = v * factor as f64;
                    softcap.map_or(y, |c| c as f64 * (y / c as f64).tanh())
                })
                .collect();
            let op = Op::Scale { factor, softcap };
            let got = run(&op, std::slice::from_ref(&xa));
            let what = format!("scale {dtype} factor {factor} softcap {softcap:?}");
            let tol: Vec<f64> = want.iter().map(|w| 4e-6 * w.abs() + 1e-6).collect();
            assert_close_each(&what, dtype, &got[0], &want, 1.0, &tol);
            // In place (the op's may_reuse pair): the same bits.
            let buf = Owned::new(&xa);
            exec(&op, &[buf.raw()], &[buf.raw()]).unwrap();
            assert_eq!(buf.bytes(), got[0], "{what}: in place differs");
        }
    }
}
