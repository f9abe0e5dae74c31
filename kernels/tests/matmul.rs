//! `matmul` against an f64 reference, across dtypes, awkward shapes, bias,
//! result dtypes and thread counts.
//!
//! Tolerance: the f32 accumulation bound `(K + 2) * u * sum|x*w|` (u = 2^-24)
//! plus, for a bf16/f16 result, one ulp of that dtype (the single rounding).

mod common;

use common::reference;
use common::*;
use kiln_ir::{DType, Op};
use proptest::prelude::{any, proptest, ProptestConfig};

fn check(dtype: DType, out: DType, t: usize, k: usize, n: usize, bias: bool, seed: u64) {
    let mut rng = Rng::new(seed);
    let x = float(dtype, &[t as u32, k as u32], &rng.vec(t * k, -1.0, 1.0));
    let w = float(dtype, &[n as u32, k as u32], &rng.vec(n * k, -1.0, 1.0));
    let b = float(dtype, &[n as u32], &rng.vec(n, -1.0, 1.0));
    let op = Op::MatMul { bias, out };
    let mut args = vec![x.clone(), w.clone()];
    if bias {
        args.push(b.clone());
    }
    let got = run(&op, &args);
    let bias_v = stored(&b);
    let (want, mag) = reference::matmul(
        &stored(&x),
        &stored(&w),
        bias.then_some(&bias_v[..]),
        t,
        k,
        n,
    );
    let bound: Vec<f64> = mag.iter().map(|m| (k as f64 + 2.0) * F32_U * m).collect();
    let ulps = if out == DType::F32 { 0.0 } else { 1.0 };
    assert_close_each(
        &format!("matmul {dtype}->{out} {t}x{k}x{n} bias={bias}"),
        out,
        &got[0],
        &want,
        ulps,
        &bound,
    );
}

#[test]
fn matmul_matches_f64_reference_on_awkward_shapes() {
    let shapes = [
        (1, 72, 5),
        (3, 100, 37),
        (7, 576, 61),
        (1, 17, 3),
        (5, 15, 9),
        (32, 64, 130),
        (33, 1536, 20),
    ];
    let mut seed = 1;
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for &(t, k, n) in &shapes {
            for bias in [false, true] {
                for out in [dtype, DType::F32] {
                    seed += 1;
                    check(dtype, out, t, k, n, bias, seed);
                }
            }
        }
    }
}

#[test]
fn matmul_of_smollm2_decode_projections_matches_reference() {
    // Fused qkv, o, gate_up and down of one SmolLM2-135M layer at T=1.
    for (i, &(k, n)) in [(576, 960), (576, 576), (576, 3072), (1536, 576)]
        .iter()
        .enumerate()
    {
        check(DType::BF16, DType::BF16, 1, k, n, false, 100 + i as u64);
    }
}

#[test]
fn matmul_results_do_not_depend_on_thread_count() {
    let mut rng = Rng::new(7);
    let (t, k, n) = (3, 576, 700);
    let x = float(DType::BF16, &[t, k], &rng.vec((t * k) as usize, -1.0, 1.0));
    let w = float(DType::BF16, &[n, k], &rng.vec((n * k) as usize, -1.0, 1.0));
    let op = Op::MatMul {
        bias: false,
        out: DType::F32,
    };
    let args = [x, w];
    let outputs: Vec<Vec<u8>> = [1, 2, 3, 5]
        .iter()
        .map(|&threads| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| run(&op, &args).remove(0))
        })
        .collect();
    for o in &outputs[1..] {
        assert_eq!(o, &outputs[0]);
    }
    assert!(kiln_kernels::cpu::to_f32(DType::F32, &outputs[0])
        .iter()
        .any(|v| v.abs() > 1.0));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn matmul_matches_reference_for_random_shapes(
        t in 1usize..12,
        k in 1usize..80,
        n in 1usize..40,
        d in 0usize..3,
        bias in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let dtype = [DType::BF16, DType::F16, DType::F32][d];
        check(dtype, dtype, t, k, n, bias, seed);
    }
}
