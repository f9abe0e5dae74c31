//! `matmul(x: D[T,K], w: D[N,K] [, bias: D[N]]) -> out[T,N]`, the CPU
//! backend's GEMM, tuned for decode (T = 1..32 rows, weights read once).
//!
//! Decode is bound by reading the weights, so the kernel streams each weight
//! row exactly once per group of [`super::dot::ROWS`] rows of `x`, converting bf16 to f32
//! with a shift (bf16 is the top half of an f32) on the fly, and accumulates
//! into [`super::dot::LANES`] independent f32 lanes per row, which the compiler turns into
//! SIMD registers (compiled for AVX2 and AVX-512 too, see `simd`). Output
//! columns are split into chunks shared by the calling thread and rayon's
//! workers (see `par`); each output element is computed
//! by one thread in a fixed order, so results do not depend on thread count.
//!
//! Summation order of `out[t,n]` (normative for the CPU backend, not for
//! GPUs, which agree within tolerance): the 16-lane fma order of `dot`,
//! then `+ bias[n]`, then one rounding to the result dtype.
//!
//! Not here: large-T (prefill) blocking for cache reuse beyond the row group,
//! and quantized weights.

use super::buf::Buf;
use super::dot::{dot_each, Kernel, Row, ROWS};
use super::par;
use super::simd::{self, multiversion};
use half::f16;
use half::slice::HalfFloatSliceExt;
use kiln_ir::DType;

/// Below this many multiply-adds a matmul runs on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 16;
/// Column chunks a parallel matmul is cut into (small chunks bound the wait
/// for a helper thread that was preempted mid-chunk).
const PARALLEL_CHUNKS: usize = 32;

/// Weights in their storage form.
#[derive(Clone, Copy)]
enum Weights<'a> {
    Bf16(&'a [u16]),
    F16(&'a [f16]),
    F32(&'a [f32]),
}

/// Everything a column block needs.
struct Problem<'a> {
    x: &'a [f32],
    w: Weights<'a>,
    bias: Option<&'a [f32]>,
    t: usize,
    k: usize,
    n: usize,
    out: Buf,
}

/// Output columns `n0..n1` for every row.
#[inline(always)]
unsafe fn column_block_impl<K: Kernel>(p: &Problem<'_>, n0: usize, n1: usize) {
    let (k, cols) = (p.k, n1 - n0);
    let mut res = vec![0f32; p.t * cols];
    let mut row = Vec::new();
    // A group of ROWS rows of x stays in L1 while the block's weight rows
    // stream past it (from memory once, then from L2 for later groups).
    let mut t0 = 0;
    while t0 < p.t {
        let rows = ROWS.min(p.t - t0);
        let xg = &p.x[t0 * k..(t0 + rows) * k];
        for n in n0..n1 {
            let bias = p.bias.map_or(0.0, |b| b[n]);
            let w = match p.w {
                Weights::Bf16(w) => Row::Bf16(&w[n * k..(n + 1) * k]),
                Weights::F32(w) => Row::F32(&w[n * k..(n + 1) * k]),
                Weights::F16(w) => {
                    row.resize(k, 0f32);
                    w[n * k..(n + 1) * k].convert_to_f32_slice(&mut row);
                    Row::F32(&row[..])
                }
            };
            let col = n - n0;
            dot_each::<K>(w, xg, k, rows, |r, v| res[(t0 + r) * cols + col] = v + bias);
        }
        t0 += rows;
    }
    for t in 0..p.t {
        p.out.store(t * p.n + n0, &res[t * cols..(t + 1) * cols]);
    }
}

multiversion! {
    /// Output columns `n0..n1` at `level`.
    unsafe fn column_block(p: &Problem<'_>, n0: usize, n1: usize) => column_block_impl
}

/// Runs the matmul at a given SIMD level (`level <= simd::detected()`).
///
/// # Safety
/// As [`super::execute`] after its checks: `x`, `w`, `bias` are valid for
/// reads, `out` for writes and does not overlap them.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul_at(
    level: simd::Level,
    x: Buf,
    w: Buf,
    bias: Option<Buf>,
    t: usize,
    k: usize,
    n: usize,
    out: Buf,
) {
    let x_f32: Vec<f32>;
    let x_view: &[f32] = if x.dtype == DType::F32 {
        x.f32s()
    } else {
        x_f32 = {
            let mut v = vec![0f32; t * k];
            x.load(0, &mut v);
            v
        };
        &x_f32
    };
    let bias_f32 = bias.map(|b| {
        let mut v = vec![0f32; n];
        b.load(0, &mut v);
        v
    });
    let weights = match w.dtype {
        DType::BF16 => Weights::Bf16(w.u16s()),
        DType::F16 => Weights::F16(std::slice::from_raw_parts(w.ptr as *const f16, w.len)),
        _ => Weights::F32(w.f32s()),
    };
    let p = Problem {
        x: x_view,
        w: weights,
        bias: bias_f32.as_deref(),
        t,
        k,
        n,
        out,
    };
    if t == 0 || n == 0 {
        return;
    }
    if t * n * k < PARALLEL_MIN_MACS {
        column_block(level, &p, 0, n);
        return;
    }
    let block = n.div_ceil(PARALLEL_CHUNKS).max(16);
    par::for_each_chunk(n.div_ceil(block), |b| {
        let n0 = b * block;
        // SAFETY: chunks write disjoint output columns.
        unsafe { column_block(level, &p, n0, (n0 + block).min(n)) };
    });
}

/// `out = x @ w^T (+ bias)` at the process's SIMD level.
///
/// # Safety
/// As [`matmul_at`].
pub(crate) unsafe fn matmul(
    x: Buf,
    w: Buf,
    bias: Option<Buf>,
    t: usize,
    k: usize,
    n: usize,
    out: Buf,
) {
    matmul_at(simd::level(), x, w, bias, t, k, n, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::convert::{from_f32, to_f32};

    fn noise(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn run(level: simd::Level, dtype: DType, t: usize, k: usize, n: usize, bias: bool) -> Vec<u8> {
        let x = from_f32(dtype, &noise(t * k, 1));
        let w = from_f32(dtype, &noise(n * k, 2));
        let b = from_f32(dtype, &noise(n, 3));
        let mut out = vec![0u32; t * n];
        let buf = |p: *mut u8, dtype, len| Buf { ptr: p, dtype, len };
        // The test vectors are built from u8 and may be misaligned for f32:
        // copy them into u32-backed storage.
        let align = |v: &[u8]| {
            let mut a = vec![0u32; v.len().div_ceil(4)];
            unsafe {
                std::ptr::copy_nonoverlapping(v.as_ptr(), a.as_mut_ptr() as *mut u8, v.len())
            };
            a
        };
        let (mut xa, mut wa, mut ba) = (align(&x), align(&w), align(&b));
        unsafe {
            matmul_at(
                level,
                buf(xa.as_mut_ptr() as *mut u8, dtype, t * k),
                buf(wa.as_mut_ptr() as *mut u8, dtype, n * k),
                bias.then(|| buf(ba.as_mut_ptr() as *mut u8, dtype, n)),
                t,
                k,
                n,
                buf(out.as_mut_ptr() as *mut u8, DType::F32, t * n),
            );
        }
        out.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn every_simd_level_gives_the_same_bits() {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for &(t, k, n) in &[
                (1, 576, 200),
                (3, 100, 37),
                (7, 72, 300),
                (5, 1536, 64),
                (33, 17, 9),
            ] {
                let levels = simd::available();
                let base = run(levels[0], dtype, t, k, n, true);
                for &l in &levels[1..] {
                    assert_eq!(
                        run(l, dtype, t, k, n, true),
                        base,
                        "{l:?} {dtype} {t}x{k}x{n}"
                    );
                }
                let any: f32 = to_f32(DType::F32, &base).iter().map(|v| v.abs()).sum();
                assert!(any > 0.0);
            }
        }
    }
}
