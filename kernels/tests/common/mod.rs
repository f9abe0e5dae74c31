//! Shared test support: a seeded RNG, tensor builders, tolerance checks,
//! and owned aligned buffers for calling `execute` directly (aliasing and
//! error tests). The f64 reference kernels are in `reference.rs`, written
//! from op.rs's spec independently of the kernels under test.

#![allow(dead_code)]

pub mod reference;

use kiln_ir::{DType, Op, TensorType};
use kiln_kernels::cpu::{
    execute, execute_on_vecs, from_f32, from_i32, to_f32, KernelError, RawTensor,
};

/// A tensor argument: its type and little-endian bytes.
pub type Arg = (TensorType, Vec<u8>);

/// SplitMix64: small, seeded, good enough for test data.
pub struct Rng(kiln_ir::rng::SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(kiln_ir::rng::SplitMix64::new(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }
    pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

/// A float tensor argument holding `values` rounded to `dtype`.
pub fn float(dtype: DType, shape: &[u32], values: &[f32]) -> (TensorType, Vec<u8>) {
    let ty = TensorType::new(dtype, shape.to_vec());
    assert_eq!(ty.numel() as usize, values.len(), "test bug: {ty}");
    (ty, from_f32(dtype, values))
}

/// An i32 tensor argument.
pub fn ints(shape: &[u32], values: &[i32]) -> (TensorType, Vec<u8>) {
    let ty = TensorType::new(DType::I32, shape.to_vec());
    assert_eq!(ty.numel() as usize, values.len(), "test bug: {ty}");
    (ty, from_i32(values))
}

/// The values an argument actually holds, as f64 (what references read).
pub fn stored(arg: &(TensorType, Vec<u8>)) -> Vec<f64> {
    to_f32(arg.0.dtype, &arg.1)
        .into_iter()
        .map(|v| v as f64)
        .collect()
}

/// Runs `op` through `execute_on_vecs`, panicking with the error.
pub fn run(op: &Op, args: &[(TensorType, Vec<u8>)]) -> Vec<Vec<u8>> {
    execute_on_vecs(op, args).unwrap_or_else(|e| panic!("{}: {e}", op.mnemonic()))
}

/// Runs `op` and returns its error, panicking if it succeeds.
pub fn run_err(op: &Op, args: &[(TensorType, Vec<u8>)]) -> KernelError {
    match execute_on_vecs(op, args) {
        Ok(_) => panic!("{} accepted operands it should refuse", op.mnemonic()),
        Err(e) => e,
    }
}

/// One unit in the last place of `dtype` at magnitude `v`.
pub fn ulp(dtype: DType, v: f64) -> f64 {
    let (mantissa_bits, min_exp) = match dtype {
        DType::BF16 => (7, -126),
        DType::F16 => (10, -14),
        DType::F32 => (23, -126),
        DType::I32 => return 1.0,
    };
    let e = if v == 0.0 {
        min_exp
    } else {
        (v.abs().log2().floor() as i32).max(min_exp)
    };
    2f64.powi(e - mantissa_bits)
}

/// Checks `got` (decoded result bytes of `dtype`) against the exact `want`:
/// `|got - want| <= ulps * ulp(want) + abs`. Names the first failure.
pub fn assert_close(what: &str, dtype: DType, got: &[u8], want: &[f64], ulps: f64, abs: f64) {
    let got = to_f32(dtype, got);
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        let tol = ulps * ulp(dtype, w) + abs;
        assert!(
            err <= tol,
            "{what}: element {i} is {g}, want {w} (error {err:e} > tolerance {tol:e})"
        );
    }
    // A comparison that compared nothing proves nothing.
    assert!(!want.is_empty(), "{what}: nothing compared");
}

/// An owned, 4-byte aligned buffer for direct `execute` calls.
pub struct Owned {
    pub ty: TensorType,
    words: Vec<u32>,
    ptr: *mut u8,
}

impl Owned {
    pub fn new(arg: &(TensorType, Vec<u8>)) -> Owned {
        let mut words = vec![0u32; arg.1.len().div_ceil(4)];
        let ptr = words.as_mut_ptr() as *mut u8;
        // SAFETY: `words` holds at least `len` bytes.
        unsafe { std::ptr::copy_nonoverlapping(arg.1.as_ptr(), ptr, arg.1.len()) };
        Owned {
            ty: arg.0.clone(),
            words,
            ptr,
        }
    }
    pub fn zeroed(ty: TensorType) -> Owned {
        let bytes = vec![0u8; ty.size_bytes() as usize];
        Owned::new(&(ty, bytes))
    }
    pub fn raw(&self) -> RawTensor {
        RawTensor {
            ptr: self.ptr,
            ty: self.ty.clone(),
        }
    }
    /// A view of the same memory with another type (for aliasing tests).
    pub fn raw_as(&self, ty: TensorType) -> RawTensor {
        assert!(ty.size_bytes() <= self.ty.size_bytes());
        RawTensor { ptr: self.ptr, ty }
    }
    pub fn bytes(&self) -> Vec<u8> {
        let n = self.ty.size_bytes() as usize;
        // SAFETY: the buffer holds `n` bytes and no kernel runs now.
        unsafe { std::slice::from_raw_parts(self.ptr, n).to_vec() }
    }
}

/// `execute` on raw tensors of owned buffers.
pub fn exec(op: &Op, args: &[RawTensor], results: &[RawTensor]) -> Result<(), KernelError> {
    // SAFETY: tests only pass `Owned` buffers of at least each type's size.
    unsafe { execute(op, args, results) }
}

/// As [`assert_close`] with a per-element absolute bound.
pub fn assert_close_each(
    what: &str,
    dtype: DType,
    got: &[u8],
    want: &[f64],
    ulps: f64,
    abs: &[f64],
) {
    let got = to_f32(dtype, got);
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert!(!want.is_empty(), "{what}: nothing compared");
    for (i, ((&g, &w), &a)) in got.iter().zip(want).zip(abs).enumerate() {
        let err = (g as f64 - w).abs();
        let tol = ulps * ulp(dtype, w) + a;
        assert!(
            err <= tol,
            "{what}: element {i} is {g}, want {w} (error {err:e} > tolerance {tol:e})"
        );
    }
}

/// Unit roundoff of f32 accumulation.
pub const F32_U: f64 = 1.0 / (1u64 << 24) as f64;
