//! The inner dot-product kernels shared by `matmul` and `attention`: `R`
//! dot products of one row (bf16 or f32) with `R` consecutive f32 rows.
//!
//! Summation order (the same at every SIMD level, so results are
//! bit-identical whatever the CPU): lane `j` of [`LANES`] accumulates
//! `acc = fma(w[k], x[k], acc)` (fused multiply-add, one rounding) over
//! `k = j, j+16, ...` below `K - K % 16` in increasing `k`; the lanes are
//! added pairwise (`l[j] + l[j+8]`, then `+4`, `+2`, `+1`); the tail
//! `k >= K - K % 16` is accumulated in order with fma into a separate value
//! added last. FMA halves the instruction count of the compute-bound
//! multi-row case; the portable version uses `f32::mul_add`, which is exact
//! FMA everywhere (a hardware instruction on aarch64 and FMA-capable x86,
//! a slower libm call otherwise).
//!
//! The portable version is plain Rust; on x86_64 the AVX2 version keeps lanes
//! 0..8 and 8..16 in two ymm registers and the AVX-512 version all 16 in one
//! zmm register, widening bf16 with a zero-extend and a 16-bit shift (bf16 is
//! the top half of an f32). The auto-vectorizer did not manage this loop
//! (it kept the lanes scalar), hence the intrinsics.

/// f32 accumulator lanes per row.
pub const LANES: usize = 16;

/// One weight row, as the inner loop sees it.
pub(crate) trait WeightRow: Copy {
    fn chunk(self, i: usize) -> [f32; LANES];
    fn at(self, i: usize) -> f32;
}

#[derive(Clone, Copy)]
pub(crate) struct Bf16Row<'a>(pub &'a [u16]);

impl WeightRow for Bf16Row<'_> {
    #[inline(always)]
    fn chunk(self, i: usize) -> [f32; LANES] {
        let c: &[u16; LANES] = self.0[i..i + LANES].try_into().unwrap();
        c.map(|b| f32::from_bits((b as u32) << 16))
    }
    #[inline(always)]
    fn at(self, i: usize) -> f32 {
        f32::from_bits((self.0[i] as u32) << 16)
    }
}

#[derive(Clone, Copy)]
pub(crate) struct F32Row<'a>(pub &'a [f32]);

impl WeightRow for F32Row<'_> {
    #[inline(always)]
    fn chunk(self, i: usize) -> [f32; LANES] {
        *<&[f32; LANES]>::try_from(&self.0[i..i + LANES]).unwrap()
    }
    #[inline(always)]
    fn at(self, i: usize) -> f32 {
        self.0[i]
    }
}

/// Pairwise sum of the lanes in the documented order.
#[inline(always)]
fn hsum(a: &[f32; LANES]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|j| a[j] + a[j + 8]);
    let s4: [f32; 4] = std::array::from_fn(|j| s8[j] + s8[j + 4]);
    let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
    s2[0] + s2[1]
}

/// Dot products of one weight row with `R` consecutive rows of `x` starting
/// at row `t0` (rows of length `k`).
#[inline(always)]
pub(crate) fn dot_rows<const R: usize, W: WeightRow>(
    w: W,
    x: &[f32],
    k: usize,
    t0: usize,
) -> [f32; R] {
    let xr: [&[f32]; R] = std::array::from_fn(|r| &x[(t0 + r) * k..(t0 + r + 1) * k]);
    let mut acc = [[0f32; LANES]; R];
    let kb = k - k % LANES;
    let mut i = 0;
    while i < kb {
        let wv = w.chunk(i);
        for r in 0..R {
            let xv: &[f32; LANES] = xr[r][i..i + LANES].try_into().unwrap();
            for j in 0..LANES {
                acc[r][j] = wv[j].mul_add(xv[j], acc[r][j]);
            }
        }
        i += LANES;
    }
    std::array::from_fn(|r| hsum(&acc[r]) + tail(w, xr[r], kb, k))
}

/// The inner dot kernels of one SIMD level. All levels compute the same
/// operations in the same order (see the module docs).
pub(crate) trait Kernel {
    /// `R` dot products of a bf16 weight row with rows `t0..t0+R` of `x`.
    unsafe fn dot_bf16<const R: usize>(w: &[u16], x: &[f32], k: usize, t0: usize) -> [f32; R];
    /// The same with an f32 weight row.
    unsafe fn dot_f32<const R: usize>(w: &[f32], x: &[f32], k: usize, t0: usize) -> [f32; R];
}

/// Portable Rust (the compiler vectorizes what it can).
pub(crate) struct Portable;

impl Kernel for Portable {
    #[inline(always)]
    unsafe fn dot_bf16<const R: usize>(w: &[u16], x: &[f32], k: usize, t0: usize) -> [f32; R] {
        dot_rows::<R, _>(Bf16Row(w), x, k, t0)
    }
    #[inline(always)]
    unsafe fn dot_f32<const R: usize>(w: &[f32], x: &[f32], k: usize, t0: usize) -> [f32; R] {
        dot_rows::<R, _>(F32Row(w), x, k, t0)
    }
}

/// The scalar tail `sum_{k >= kb} w[k] * x[k]`, in order, with fma.
#[inline(always)]
pub(crate) fn tail<W: WeightRow>(w: W, x: &[f32], kb: usize, k: usize) -> f32 {
    let mut s = 0f32;
    for (kk, xv) in (kb..k).zip(&x[kb..k]) {
        s = w.at(kk).mul_add(*xv, s);
    }
    s
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    //! AVX2 and AVX-512 versions of the dot kernels: lanes 0..8 and 8..16
    //! in two ymm registers (AVX2) or all 16 in one zmm register (AVX-512),
    //! fused multiply-add, the pairwise lane sum of `hsum`.
    use super::{tail, Bf16Row, F32Row, Kernel, LANES};
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn bf16x8(p: *const u16) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn bf16x16(p: *const u16) -> __m512 {
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    /// `hsum` of lanes `lo = 0..8`, `hi = 8..16`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum(lo: __m256, hi: __m256) -> f32 {
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps::<1>(s2, s2))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    unsafe fn hsum16(a: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(a);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
        hsum(lo, hi)
    }

    pub(crate) struct Avx2;

    impl Avx2 {
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn dot<const R: usize, const BF16: bool>(
            w: *const u8,
            x: &[f32],
            k: usize,
            t0: usize,
        ) -> [[__m256; 2]; R] {
            let xp: [*const f32; R] = std::array::from_fn(|r| x.as_ptr().add((t0 + r) * k));
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            let kb = k - k % LANES;
            let mut i = 0;
            while i < kb {
                let (wl, wh) = if BF16 {
                    let p = (w as *const u16).add(i);
                    (bf16x8(p), bf16x8(p.add(8)))
                } else {
                    let p = (w as *const f32).add(i);
                    (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
                };
                for r in 0..R {
                    let xl = _mm256_loadu_ps(xp[r].add(i));
                    let xh = _mm256_loadu_ps(xp[r].add(i + 8));
                    acc[r][0] = _mm256_fmadd_ps(wl, xl, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(wh, xh, acc[r][1]);
                }
                i += LANES;
            }
            acc
        }
    }

    impl Kernel for Avx2 {
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn dot_bf16<const R: usize>(w: &[u16], x: &[f32], k: usize, t0: usize) -> [f32; R] {
            debug_assert!(w.len() >= k && x.len() >= (t0 + R) * k);
            let acc = Self::dot::<R, true>(w.as_ptr() as *const u8, x, k, t0);
            let kb = k - k % LANES;
            std::array::from_fn(|r| {
                hsum(acc[r][0], acc[r][1]) + tail(Bf16Row(w), &x[(t0 + r) * k..], kb, k)
            })
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn dot_f32<const R: usize>(w: &[f32], x: &[f32], k: usize, t0: usize) -> [f32; R] {
            debug_assert!(w.len() >= k && x.len() >= (t0 + R) * k);
            let acc = Self::dot::<R, false>(w.as_ptr() as *const u8, x, k, t0);
            let kb = k - k % LANES;
            std::array::from_fn(|r| {
                hsum(acc[r][0], acc[r][1]) + tail(F32Row(w), &x[(t0 + r) * k..], kb, k)
            })
        }
    }

    pub(crate) struct Avx512;

    impl Avx512 {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        unsafe fn dot<const R: usize, const BF16: bool>(
            w: *const u8,
            x: &[f32],
            k: usize,
            t0: usize,
        ) -> [__m512; R] {
            let xp: [*const f32; R] = std::array::from_fn(|r| x.as_ptr().add((t0 + r) * k));
            let mut acc = [_mm512_setzero_ps(); R];
            let kb = k - k % LANES;
            let mut i = 0;
            while i < kb {
                let wv = if BF16 {
                    bf16x16((w as *const u16).add(i))
                } else {
                    _mm512_loadu_ps((w as *const f32).add(i))
                };
                for r in 0..R {
                    let xv = _mm512_loadu_ps(xp[r].add(i));
                    acc[r] = _mm512_fmadd_ps(wv, xv, acc[r]);
                }
                i += LANES;
            }
            acc
        }
    }

    impl Kernel for Avx512 {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        unsafe fn dot_bf16<const R: usize>(w: &[u16], x: &[f32], k: usize, t0: usize) -> [f32; R] {
            debug_assert!(w.len() >= k && x.len() >= (t0 + R) * k);
            let acc = Self::dot::<R, true>(w.as_ptr() as *const u8, x, k, t0);
            let kb = k - k % LANES;
            std::array::from_fn(|r| hsum16(acc[r]) + tail(Bf16Row(w), &x[(t0 + r) * k..], kb, k))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        unsafe fn dot_f32<const R: usize>(w: &[f32], x: &[f32], k: usize, t0: usize) -> [f32; R] {
            debug_assert!(w.len() >= k && x.len() >= (t0 + R) * k);
            let acc = Self::dot::<R, false>(w.as_ptr() as *const u8, x, k, t0);
            let kb = k - k % LANES;
            std::array::from_fn(|r| hsum16(acc[r]) + tail(F32Row(w), &x[(t0 + r) * k..], kb, k))
        }
    }
}

/// Rows of `x` that share one pass over `w` in [`dot_each`].
pub const ROWS: usize = 4;

/// One row in storage form.
#[derive(Clone, Copy)]
pub(crate) enum Row<'a> {
    Bf16(&'a [u16]),
    F32(&'a [f32]),
}

/// `put(r, dot(w, x[r]))` for every row `r` of `x` (`[rows, k]`), reading
/// `w` once per group of [`ROWS`] rows.
#[inline(always)]
pub(crate) unsafe fn dot_each<K: Kernel>(
    w: Row,
    x: &[f32],
    k: usize,
    rows: usize,
    mut put: impl FnMut(usize, f32),
) {
    let mut t0 = 0;
    while t0 < rows {
        let left = rows - t0;
        macro_rules! group {
            ($r:expr) => {{
                let vals: [f32; $r] = match w {
                    Row::Bf16(w) => K::dot_bf16::<$r>(w, x, k, t0),
                    Row::F32(w) => K::dot_f32::<$r>(w, x, k, t0),
                };
                for (r, v) in vals.into_iter().enumerate() {
                    put(t0 + r, v);
                }
            }};
        }
        match left {
            1 => group!(1),
            2 => group!(2),
            3 => group!(3),
            _ => group!(ROWS),
        }
        t0 += left.min(ROWS);
    }
}
