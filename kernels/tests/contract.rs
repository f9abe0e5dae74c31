//! The `execute` contract: operand checks (count, types, null, alignment),
//! the overlap rules (only `aliases`/`may_reuse` pairs, only as the same
//! buffer), distinct-buffer in-place results, and `execute_on_vecs` input
//! checks. Every refusal is an error naming the problem, never a panic.

mod common;

use common::*;
use kiln_ir::{DType, Op, TensorType};
use kiln_kernels::cpu::{execute_on_vecs, KernelError, RawTensor};

fn ty(d: DType, s: &[u32]) -> TensorType {
    TensorType::new(d, s.to_vec())
}

fn operands_error(r: Result<(), KernelError>, needle: &str) {
    match r {
        Err(e @ KernelError::Operands { .. }) => assert!(e.to_string().contains(needle), "{e}"),
        other => panic!("expected an operands error containing {needle:?}, got {other:?}"),
    }
}

fn matmul() -> Op {
    Op::MatMul {
        bias: false,
        out: DType::BF16,
    }
}

#[test]
fn wrong_argument_count_and_types_are_refused() {
    let mut rng = Rng::new(120);
    let x = Owned::new(&float(DType::BF16, &[2, 8], &rng.vec(16, -1.0, 1.0)));
    let w = Owned::new(&float(DType::BF16, &[3, 8], &rng.vec(24, -1.0, 1.0)));
    let out = Owned::zeroed(ty(DType::BF16, &[2, 3]));
    operands_error(
        exec(&matmul(), &[x.raw()], &[out.raw()]),
        "takes 2 argument(s), got 1",
    );
    let w_f32 = Owned::new(&float(DType::F32, &[3, 8], &rng.vec(24, -1.0, 1.0)));
    operands_error(
        exec(&matmul(), &[x.raw(), w_f32.raw()], &[out.raw()]),
        "must share a dtype",
    );
    let wrong = Owned::zeroed(ty(DType::F32, &[2, 3]));
    operands_error(
        exec(&matmul(), &[x.raw(), w.raw()], &[wrong.raw()]),
        "result 0 must be bf16[2,3]",
    );
    operands_error(
        exec(&matmul(), &[x.raw(), w.raw()], &[]),
        "expected 1 result(s)",
    );
    exec(&matmul(), &[x.raw(), w.raw()], &[out.raw()]).unwrap();
}

#[test]
fn null_and_misaligned_pointers_are_refused() {
    let mut rng = Rng::new(121);
    let a = Owned::new(&float(DType::F32, &[4, 4], &rng.vec(16, -1.0, 1.0)));
    let out = Owned::zeroed(ty(DType::F32, &[2, 4]));
    let t = ty(DType::F32, &[2, 4]);
    let null = RawTensor {
        ptr: std::ptr::null_mut(),
        ty: t.clone(),
    };
    operands_error(
        exec(&Op::Add, &[null, a.raw_as(t.clone())], &[out.raw()]),
        "null pointer",
    );
    // SAFETY: one byte into a 64-byte buffer, still inside it.
    let odd = RawTensor {
        ptr: unsafe { a.raw().ptr.add(1) },
        ty: t.clone(),
    };
    operands_error(
        exec(&Op::Add, &[odd, a.raw_as(t)], &[out.raw()]),
        "not aligned to 4 bytes",
    );
}

#[test]
fn results_may_not_overlap_arguments_the_op_does_not_name() {
    let mut rng = Rng::new(122);
    // matmul allows no reuse: an output over x is refused.
    let x = Owned::new(&float(DType::BF16, &[2, 8], &rng.vec(16, -1.0, 1.0)));
    let w = Owned::new(&float(DType::BF16, &[8, 8], &rng.vec(64, -1.0, 1.0)));
    let over_x = x.raw_as(ty(DType::BF16, &[2, 8]));
    operands_error(
        exec(&matmul(), &[x.raw(), w.raw()], &[over_x]),
        "overlaps argument 0",
    );
    // rms_norm allows no reuse either.
    let nw = Owned::new(&float(DType::BF16, &[8], &rng.vec(8, -1.0, 1.0)));
    let norm = Op::RmsNorm {
        eps: 1e-6,
        unit_offset: false,
    };
    operands_error(
        exec(&norm, &[x.raw(), nw.raw()], &[x.raw()]),
        "overlaps argument 0",
    );
}

#[test]
fn an_in_place_result_must_start_at_its_argument() {
    let mut rng = Rng::new(123);
    let big = Owned::new(&float(DType::F32, &[2, 8], &rng.vec(16, -1.0, 1.0)));
    let b = Owned::new(&float(DType::F32, &[8], &rng.vec(8, -1.0, 1.0)));
    let t = ty(DType::F32, &[8]);
    // SAFETY: 4 bytes into a 64-byte buffer; 32 bytes from there still inside.
    let shifted = RawTensor {
        ptr: unsafe { big.raw().ptr.add(4) },
        ty: t.clone(),
    };
    operands_error(
        exec(&Op::Add, &[big.raw_as(t), b.raw()], &[shifted]),
        "partially overlaps",
    );
}

#[test]
fn results_may_not_overlap_each_other() {
    let mut rng = Rng::new(124);
    let x = Owned::new(&float(DType::F32, &[2, 8], &rng.vec(16, -1.0, 1.0)));
    let r = Owned::new(&float(DType::F32, &[2, 8], &rng.vec(16, -1.0, 1.0)));
    let w = Owned::new(&float(DType::F32, &[8], &rng.vec(8, -1.0, 1.0)));
    let out = Owned::zeroed(ty(DType::F32, &[2, 8]));
    let op = Op::AddRmsNorm {
        eps: 1e-6,
        unit_offset: false,
    };
    operands_error(
        exec(&op, &[x.raw(), r.raw(), w.raw()], &[out.raw(), out.raw()]),
        "results 0 and 1 overlap",
    );
}

#[test]
fn distinct_buffers_for_in_place_results_receive_the_updated_copy() {
    let mut rng = Rng::new(125);
    let k = float(DType::BF16, &[2, 8], &rng.vec(16, -1.0, 1.0));
    let v = float(DType::BF16, &[2, 8], &rng.vec(16, -1.0, 1.0));
    let slots = ints(&[2], &[5, 1]);
    let kc = float(DType::BF16, &[6, 8], &rng.vec(48, -1.0, 1.0));
    let vc = float(DType::BF16, &[6, 8], &rng.vec(48, -1.0, 1.0));
    let expected = run(
        &Op::KvWrite,
        &[k.clone(), v.clone(), slots.clone(), kc.clone(), vc.clone()],
    );
    let bufs: Vec<Owned> = [k, v, slots, kc.clone(), vc.clone()]
        .iter()
        .map(Owned::new)
        .collect();
    let (kr, vr) = (
        Owned::zeroed(ty(DType::BF16, &[6, 8])),
        Owned::zeroed(ty(DType::BF16, &[6, 8])),
    );
    let args: Vec<RawTensor> = bufs.iter().map(|b| b.raw()).collect();
    exec(&Op::KvWrite, &args, &[kr.raw(), vr.raw()]).unwrap();
    assert_eq!(kr.bytes(), expected[0]);
    assert_eq!(vr.bytes(), expected[1]);
    assert_eq!(bufs[3].bytes(), kc.1, "the argument cache was modified");
    assert_eq!(bufs[4].bytes(), vc.1, "the argument cache was modified");
}

#[test]
fn execute_on_vecs_checks_byte_lengths_and_types() {
    let mut rng = Rng::new(126);
    let bad_len = (ty(DType::F32, &[2, 2]), vec![0u8; 15]);
    let ok = float(DType::F32, &[2, 2], &rng.vec(4, -1.0, 1.0));
    let e = execute_on_vecs(&Op::Add, &[bad_len, ok.clone()]).unwrap_err();
    assert!(
        e.to_string()
            .contains("declared f32[2,2] (16 bytes) but holds 15 bytes"),
        "{e}"
    );
    let e = execute_on_vecs(
        &Op::Add,
        &[ok.clone(), (ty(DType::F32, &[4]), vec![0u8; 16])],
    )
    .unwrap_err();
    assert!(e.to_string().contains("operands do not type-check"), "{e}");
    let sum = execute_on_vecs(&Op::Add, &[ok.clone(), ok.clone()]).unwrap();
    let doubled: Vec<f64> = stored(&ok).iter().map(|v| 2.0 * v).collect();
    assert_close("a + a", DType::F32, &sum[0], &doubled, 0.0, 0.0);
}
