//! A raw view of one operand, shared by the kernel modules.
//!
//! Results may alias arguments, so kernels never hold a `&[T]` of an
//! argument and a `&mut [T]` of a result at the same time. They go through
//! [`Buf`]: every access builds a short-lived slice over exactly the
//! elements it touches, converts them to or from f32 scratch, and drops it
//! before the next access. An in-place kernel therefore reads a row (or
//! chunk) completely before writing it back.
//!
//! Bounds are the caller's responsibility (indices come from shapes that
//! [`super::execute`] validated); they are checked in debug builds.

use super::RawTensor;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use kiln_ir::DType;
use std::slice;

/// One operand: base pointer, dtype and element count.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Buf {
    pub ptr: *mut u8,
    pub dtype: DType,
    pub len: usize,
}

// SAFETY: a `Buf` is an address; kernels that share one across threads write
// disjoint element ranges and only read ranges nobody writes concurrently.
unsafe impl Send for Buf {}
unsafe impl Sync for Buf {}

impl Buf {
    pub fn of(t: &RawTensor) -> Buf {
        Buf {
            ptr: t.ptr,
            dtype: t.ty.dtype,
            len: t.ty.numel() as usize,
        }
    }

    /// Converts elements `start .. start + dst.len()` to f32.
    ///
    /// # Safety
    /// The range is inside the tensor and nobody writes it concurrently.
    #[inline]
    pub unsafe fn load(&self, start: usize, dst: &mut [f32]) {
        let n = dst.len();
        debug_assert!(start + n <= self.len, "load {start}+{n} > {}", self.len);
        if n == 0 {
            return;
        }
        match self.dtype {
            DType::BF16 => {
                let s = slice::from_raw_parts((self.ptr as *const u16).add(start), n);
                for (d, &b) in dst.iter_mut().zip(s) {
                    *d = f32::from_bits((b as u32) << 16);
                }
            }
            DType::F16 => {
                let s = slice::from_raw_parts((self.ptr as *const f16).add(start), n);
                s.convert_to_f32_slice(dst);
            }
            DType::F32 => {
                dst.copy_from_slice(slice::from_raw_parts(
                    (self.ptr as *const f32).add(start),
                    n,
                ));
            }
            DType::I32 => {
                let s = slice::from_raw_parts((self.ptr as *const i32).add(start), n);
                for (d, &v) in dst.iter_mut().zip(s) {
                    *d = v as f32;
                }
            }
        }
    }

    /// Rounds `src` to the dtype and stores it at `start ..`.
    ///
    /// # Safety
    /// The range is inside the tensor and nobody else accesses it concurrently.
    #[inline]
    pub unsafe fn store(&self, start: usize, src: &[f32]) {
        let n = src.len();
        debug_assert!(start + n <= self.len, "store {start}+{n} > {}", self.len);
        if n == 0 {
            return;
        }
        match self.dtype {
            DType::BF16 => {
                let d = slice::from_raw_parts_mut((self.ptr as *mut bf16).add(start), n);
                d.convert_from_f32_slice(src);
            }
            DType::F16 => {
                let d = slice::from_raw_parts_mut((self.ptr as *mut f16).add(start), n);
                d.convert_from_f32_slice(src);
            }
            DType::F32 => {
                slice::from_raw_parts_mut((self.ptr as *mut f32).add(start), n)
                    .copy_from_slice(src);
            }
            DType::I32 => {
                let d = slice::from_raw_parts_mut((self.ptr as *mut i32).add(start), n);
                for (d, &v) in d.iter_mut().zip(src) {
                    *d = v as i32;
                }
            }
        }
    }

    /// The whole tensor as `i32` (integer operands are never results of the
    /// op that reads them, so a shared slice is sound).
    ///
    /// # Safety
    /// The tensor is i32 and not written during the borrow.
    pub unsafe fn ints<'a>(&self) -> &'a [i32] {
        debug_assert_eq!(self.dtype, DType::I32);
        if self.len == 0 {
            return &[];
        }
        slice::from_raw_parts(self.ptr as *const i32, self.len)
    }

    /// The whole tensor as raw 16-bit words (bf16/f16 weights).
    ///
    /// # Safety
    /// The tensor is 16-bit and not written during the borrow.
    pub unsafe fn u16s<'a>(&self) -> &'a [u16] {
        debug_assert_eq!(self.dtype.size(), 2);
        if self.len == 0 {
            return &[];
        }
        slice::from_raw_parts(self.ptr as *const u16, self.len)
    }

    /// The whole tensor as f32.
    ///
    /// # Safety
    /// The tensor is f32 and not written during the borrow.
    pub unsafe fn f32s<'a>(&self) -> &'a [f32] {
        debug_assert_eq!(self.dtype, DType::F32);
        if self.len == 0 {
            return &[];
        }
        slice::from_raw_parts(self.ptr as *const f32, self.len)
    }

    /// Writes i32 values at `start ..`.
    ///
    /// # Safety
    /// As [`Buf::store`]; the tensor is i32.
    pub unsafe fn store_ints(&self, start: usize, src: &[i32]) {
        debug_assert_eq!(self.dtype, DType::I32);
        debug_assert!(start + src.len() <= self.len);
        std::ptr::copy_nonoverlapping(src.as_ptr(), (self.ptr as *mut i32).add(start), src.len());
    }

    /// Copies `n` elements bit for bit from `src[src_start..]` to
    /// `dst[dst_start..]` (same element size; ranges may overlap).
    ///
    /// # Safety
    /// Both ranges are inside their tensors.
    pub unsafe fn copy(src: Buf, src_start: usize, dst: Buf, dst_start: usize, n: usize) {
        let es = src.dtype.size();
        debug_assert_eq!(es, dst.dtype.size());
        debug_assert!(src_start + n <= src.len && dst_start + n <= dst.len);
        std::ptr::copy(
            src.ptr.add(src_start * es),
            dst.ptr.add(dst_start * es),
            n * es,
        );
    }
}

/// Rounds every value through `dtype` (what storing and reloading would do).
#[inline]
pub(crate) fn round_slice(dtype: DType, v: &mut [f32]) {
    match dtype {
        DType::BF16 => {
            for x in v {
                *x = bf16::from_f32(*x).to_f32();
            }
        }
        DType::F16 => {
            for x in v {
                *x = f16::from_f32(*x).to_f32();
            }
        }
        DType::F32 | DType::I32 => {}
    }
}
