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

    /// Weighted sum of rows of `v` into `R` accumulator rows: for each
    /// position `p` of `offs` in order, each row `r < R` and each `j < hd`,
    /// `acc[r*hd + j] = fma(e[r*es + p], v[offs[p] + j], acc[r*hd + j])`.
    /// (Attention's `sum_p e_p * v_p`; every level performs exactly these
    /// fmas in this order per element.)
    #[inline(always)]
    unsafe fn weighted_rows<const R: usize>(
        acc: &mut [f32],
        e: &[f32],
        es: usize,
        v: Row,
        offs: &[usize],
        hd: usize,
    ) {
        for (p, &off) in offs.iter().enumerate() {
            for r in 0..R {
                let w = e[r * es + p];
                let a = &mut acc[r * hd..(r + 1) * hd];
                match v {
                    Row::Bf16(v) => {
                        for (a, &b) in a.iter_mut().zip(&v[off..off + hd]) {
                            *a = w.mul_add(f32::from_bits((b as u32) << 16), *a);
                        }
                    }
                    Row::F32(v) => {
                        for (a, &b) in a.iter_mut().zip(&v[off..off + hd]) {
                            *a = w.mul_add(b, *a);
                        }
                    }
                }
            }
        }
    }
}

/// The scalar columns `j0..hd` of [`Kernel::weighted_rows`], in its order.
#[inline(always)]
fn weighted_tail<const R: usize>(
    acc: &mut [f32],
    e: &[f32],
    es: usize,
    v: Row,
    offs: &[usize],
    hd: usize,
    j0: usize,
) {
    for r in 0..R {
        for j in j0..hd {
            let mut a = acc[r * hd + j];
            for (p, &off) in offs.iter().enumerate() {
                let x = match v {
                    Row::Bf16(v) => f32::from_bits((v[off + j] as u32) << 16),
                    Row::F32(v) => v[off + j],
                };
                a = e[r * es + p].mul_add(x, a);
            }
            acc[r * hd + j] = a;
        }
    }
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
    use super::{tail, weighted_tail, Bf16Row, F32Row, Kernel, Row, LANES};
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

    /// How far ahead of the element being read the weight stream is
    /// prefetched: the hardware prefetchers stop at page boundaries and keep
    /// too few lines in flight for a core to reach the memory bandwidth
    /// (the same measurement as `qgroup`'s PREFETCH).
    const PREFETCH: usize = 4096;

    /// Prefetches the line `PREFETCH` bytes past element `i` of the
    /// weight row `w` (bf16 or f32 elements); never faults.
    #[inline(always)]
    unsafe fn prefetch_ahead<const BF16: bool>(w: *const u8, i: usize) {
        let at = if BF16 { 2 * i } else { 4 * i };
        _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(at + PREFETCH) as *const i8);
        if !BF16 {
            _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(at + PREFETCH + 32) as *const i8);
        }
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
            let mut xp = [x.as_ptr(); R];
            for (r, p) in xp.iter_mut().enumerate() {
                *p = x.as_ptr().add((t0 + r) * k);
            }
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            let kb = k - k % LANES;
            let mut i = 0;
            while i < kb {
                prefetch_ahead::<BF16>(w, i);
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

    impl Avx2 {
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn weighted<const R: usize, const BF16: bool>(
            acc: &mut [f32],
            e: &[f32],
            es: usize,
            v: *const u8,
            offs: &[usize],
            hd: usize,
        ) {
            let mut c = 0;
            while c + 8 <= hd {
                let mut a = [_mm256_setzero_ps(); R];
                for (r, a) in a.iter_mut().enumerate() {
                    *a = _mm256_loadu_ps(acc.as_ptr().add(r * hd + c));
                }
                for (p, &off) in offs.iter().enumerate() {
                    let x = if BF16 {
                        bf16x8((v as *const u16).add(off + c))
                    } else {
                        _mm256_loadu_ps((v as *const f32).add(off + c))
                    };
                    for (r, a) in a.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(_mm256_set1_ps(*e.get_unchecked(r * es + p)), x, *a);
                    }
                }
                for (r, a) in a.iter().enumerate() {
                    _mm256_storeu_ps(acc.as_mut_ptr().add(r * hd + c), *a);
                }
                c += 8;
            }
        }
    }

    impl Kernel for Avx2 {
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn weighted_rows<const R: usize>(
            acc: &mut [f32],
            e: &[f32],
            es: usize,
            v: Row,
            offs: &[usize],
            hd: usize,
        ) {
            debug_assert!(acc.len() >= R * hd && e.len() >= (R - 1) * es + offs.len());
            match v {
                Row::Bf16(s) => {
                    debug_assert!(offs.iter().all(|&o| o + hd <= s.len()));
                    Self::weighted::<R, true>(acc, e, es, s.as_ptr() as *const u8, offs, hd)
                }
                Row::F32(s) => {
                    debug_assert!(offs.iter().all(|&o| o + hd <= s.len()));
                    Self::weighted::<R, false>(acc, e, es, s.as_ptr() as *const u8, offs, hd)
                }
            }
            weighted_tail::<R>(acc, e, es, v, offs, hd, hd - hd % 8);
        }

        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn dot_bf16<const R: usize>(w: &[u16], x: &[f32], k: usize, t0: usize) -> [f32; R] {
            debug_assert!(w.len() >= k && x.len() >= (t0 + R) * k);
            let acc = Self::dot::<R, true>(w.as_ptr() as *const u8, x, k, t0);
            let kb = k - k % LANES;
            let mut out = [0f32; R];
            for r in 0..R {
                out[r] = hsum(acc[r][0], acc[r][1]) + tail(Bf16Row(w), &x[(t0 + r) * k..], kb, k);
            }
            out
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn dot_f32<const R: usize>(w: &[f32], x: &[f32], k: usize, t0: usize) -> [f32; R] {
            debug_assert!(w.len() >= k && x.len() >= (t0 + R) * k);
            let acc = Self::dot::<R, false>(w.as_ptr() as *const u8, x, k, t0);
            let kb = k - k % LANES;
            let mut out = [0f32; R];
            for r in 0..R {
                out[r] = hsum(acc[r][0], acc[r][1]) + tail(F32Row(w), &x[(t0 + r) * k..], kb, k);
            }
            out
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
            let mut xp = [x.as_ptr(); R];
            for (r, p) in xp.iter_mut().enumerate() {
                *p = x.as_ptr().add((t0 + r) * k);
            }
            let mut acc = [_mm512_setzero_ps(); R];
            let kb = k - k % LANES;
            let mut i = 0;
            while i < kb {
                prefetch_ahead::<BF16>(w, i);
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

    impl Avx512 {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        unsafe fn weighted<const R: usize, const BF16: bool>(
            acc: &mut [f32],
            e: &[f32],
            es: usize,
            v: *const u8,
            offs: &[usize],
            hd: usize,
        ) {
            let mut c = 0;
            while c + 16 <= hd {
                let mut a = [_mm512_setzero_ps(); R];
                for (r, a) in a.iter_mut().enumerate() {
                    *a = _mm512_loadu_ps(acc.as_ptr().add(r * hd + c));
                }
                for (p, &off) in offs.iter().enumerate() {
                    let x = if BF16 {
                        bf16x16((v as *const u16).add(off + c))
                    } else {
                        _mm512_loadu_ps((v as *const f32).add(off + c))
                    };
                    for (r, a) in a.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(_mm512_set1_ps(*e.get_unchecked(r * es + p)), x, *a);
                    }
                }
                for (r, a) in a.iter().enumerate() {
                    _mm512_storeu_ps(acc.as_mut_ptr().add(r * hd + c), *a);
                }
                c += 16;
            }
        }
    }

    impl Kernel for Avx512 {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        unsafe fn weighted_rows<const R: usize>(
            acc: &mut [f32],
            e: &[f32],
            es: usize,
            v: Row,
            offs: &[usize],
            hd: usize,
        ) {
            debug_assert!(acc.len() >= R * hd && e.len() >= (R - 1) * es + offs.len());
            match v {
                Row::Bf16(s) => {
                    debug_assert!(offs.iter().all(|&o| o + hd <= s.len()));
                    Self::weighted::<R, true>(acc, e, es, s.as_ptr() as *const u8, offs, hd)
                }
                Row::F32(s) => {
                    debug_assert!(offs.iter().all(|&o| o + hd <= s.len()));
                    Self::weighted::<R, false>(acc, e, es, s.as_ptr() as *const u8, offs, hd)
                }
            }
            weighted_tail::<R>(acc, e, es, v, offs, hd, hd - hd % 16);
        }

        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        unsafe fn dot_bf16<const R: usize>(w: &[u16], x: &[f32], k: usize, t0: usize) -> [f32; R] {
            debug_assert!(w.len() >= k && x.len() >= (t0 + R) * k);
            let acc = Self::dot::<R, true>(w.as_ptr() as *const u8, x, k, t0);
            let kb = k - k % LANES;
            let mut out = [0f32; R];
            for r in 0..R {
                out[r] = hsum16(acc[r]) + tail(Bf16Row(w), &x[(t0 + r) * k..], kb, k);
            }
            out
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        unsafe fn dot_f32<const R: usize>(w: &[f32], x: &[f32], k: usize, t0: usize) -> [f32; R] {
            debug_assert!(w.len() >= k && x.len() >= (t0 + R) * k);
            let acc = Self::dot::<R, false>(w.as_ptr() as *const u8, x, k, t0);
            let kb = k - k % LANES;
            let mut out = [0f32; R];
            for r in 0..R {
                out[r] = hsum16(acc[r]) + tail(F32Row(w), &x[(t0 + r) * k..], kb, k);
            }
            out
        }
    }
}

/// Rows of `x` that share one pass over `w` in `dot_each`.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::simd::{self, Level};

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

    /// `weighted_rows::<R>` at `level` (R dispatched at run time).
    #[allow(clippy::too_many_arguments)]
    unsafe fn weighted_at(
        level: Level,
        r: usize,
        acc: &mut [f32],
        e: &[f32],
        es: usize,
        v: Row,
        offs: &[usize],
        hd: usize,
    ) {
        macro_rules! go {
            ($k:ty) => {
                match r {
                    1 => <$k>::weighted_rows::<1>(acc, e, es, v, offs, hd),
                    2 => <$k>::weighted_rows::<2>(acc, e, es, v, offs, hd),
                    3 => <$k>::weighted_rows::<3>(acc, e, es, v, offs, hd),
                    _ => <$k>::weighted_rows::<4>(acc, e, es, v, offs, hd),
                }
            };
        }
        match level {
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => go!(x86::Avx2),
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => go!(x86::Avx512),
            _ => go!(Portable),
        }
    }

    #[test]
    fn weighted_rows_gives_the_same_bits_at_every_simd_level() {
        for &hd in &[64usize, 24, 72, 5, 16] {
            for r in 1..=4 {
                let n_pos = 37;
                let rows = 50;
                let vf = noise(rows * hd, hd as u64);
                let vb: Vec<u16> = vf
                    .iter()
                    .map(|x| half::bf16::from_f32(*x).to_bits())
                    .collect();
                let offs: Vec<usize> = (0..n_pos).map(|p| (p * 7 % rows) * hd).collect();
                let es = n_pos + 3;
                let e = noise(r * es, 99);
                let init = noise(r * hd, 7);
                for v in [Row::Bf16(&vb), Row::F32(&vf)] {
                    let mut base = init.clone();
                    unsafe { weighted_at(Level::Generic, r, &mut base, &e, es, v, &offs, hd) };
                    assert_ne!(base, init);
                    for level in simd::available() {
                        let mut got = init.clone();
                        unsafe { weighted_at(level, r, &mut got, &e, es, v, &offs, hd) };
                        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got), bits(&base), "{level:?} hd {hd} rows {r}");
                    }
                }
            }
        }
    }
}
