//! `matmul` / `fused_matmul` / `embedding` over weights kept quantized
//! ([`QuantType`]): the CPU backend's quantized GEMV and row gather.
//!
//! Why a module of its own: a quantized decode step is bound by the weight
//! stream like the dense one, but the stream is 3-4x shorter, so the
//! arithmetic per weight byte must be cheap. As llama.cpp does, each row of
//! `x` is quantized once per matmul to 8-bit blocks of 32 ([`QRow`]: `i8`
//! values, one f32 scale `dx`, and `dx·Σq` per 16 and per 32 elements), and
//! each 32-element sub-block of a weight row is decoded to 32 small
//! unsigned integers `w` (signed for Q8_0) with an affine map
//! `value = sd·w + off` (two `sd`/`off` halves of 16 for Q6_K). The product
//! of a sub-block is then an exact integer dot product `Σ w·q` (AVX2
//! `maddubs`/`madd`, or the portable loop) taken in 8 lanes of 4 elements:
//!
//! ```text
//! acc[j] += (Σ_{e in 4j..4j+4} w[e]·q[e]) as f32 · (sd·dx)   (lanes j = 0..8)
//! m      += off · (dx·Σq)                                     (per sub-block)
//! out     = ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7)) + m (+ bias), rounded once
//! ```
//!
//! Both instruction sets perform exactly these f32 operations in this
//! order (the integer sums are exact), so the AVX2 and portable paths give
//! the same bits; the unit tests check it. Against dequantize-then-multiply
//! in f32 the result differs by the activation quantization (at most half
//! a step `dx/2` per element, so `|err| <= Σ|w|·dx/2` per output plus f32
//! rounding); the tests check that bound.
//!
//! FP8 e4m3 weights take a plain f32 path (the activations stay f32): each
//! code is decoded through a 256-entry table, 8 lanes accumulate
//! `w·x` in element order, and the row scale multiplies the lane sum.
//!
//! Q8_0, Q4_0, Q4_1 and Q5_0 do not take the per-row loop below: the CPU keeps
//! them with 8 rows interleaved ([`crate::quant_cpu`]) and `qgroup`
//! computes 8 rows per vector with its own, equally fixed, formula.
//!
//! Not here: the GPU kernels (kernels/gpu/qgemv.cu), prefill-sized GEMM
//! blocking (T rows reuse each decoded weight block from registers only),
//! AVX-512 variants.

use super::buf::Buf;
use super::par;
use super::simd::{self, Level};
use crate::quant::{e4m3_to_f32, scale_min_k4};
use half::f16;
use kiln_ir::QuantType;
use std::sync::OnceLock;

/// Below this many weight bytes a matmul runs on the calling thread.
const PARALLEL_MIN_BYTES: usize = 1 << 15;
/// Column chunks a parallel matmul is cut into.
const PARALLEL_CHUNKS: usize = 32;

/// One row of `x` quantized to 8-bit blocks of 32.
pub(crate) struct QRow {
    pub q: Vec<i8>,
    /// Scale of each block of 32.
    pub d: Vec<f32>,
    /// `d · Σq` over each block.
    pub s: Vec<f32>,
    /// `d · Σq` over the first and the second 16 elements of each block.
    pub s_lo: Vec<f32>,
    pub s_hi: Vec<f32>,
}

impl QRow {
    /// Quantizes `x` (length a multiple of 32): `d = max|x| / 127`,
    /// `q = round(x / d)` (ties to even), `d = 0` for a zero block.
    pub(crate) fn new(x: &[f32]) -> QRow {
        let blocks = x.len() / 32;
        let mut r = QRow {
            q: vec![0; x.len()],
            d: vec![0.0; blocks],
            s: vec![0.0; blocks],
            s_lo: vec![0.0; blocks],
            s_hi: vec![0.0; blocks],
        };
        for b in 0..blocks {
            let xs = &x[32 * b..32 * b + 32];
            // The maximum in 8 lanes, so it vectorizes (a running fold is
            // one dependent `max` per element); a maximum is exact in any
            // order, and `f32::max` skips NaN either way.
            let mut lanes = [0f32; 8];
            for c in xs.chunks_exact(8) {
                for (l, v) in lanes.iter_mut().zip(c) {
                    *l = l.max(v.abs());
                }
            }
            let amax = lanes.iter().fold(0f32, |a, &v| a.max(v));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let qs = &mut r.q[32 * b..32 * b + 32];
            for (q, &v) in qs.iter_mut().zip(xs) {
                // Round to nearest, ties to even, by the 1.5·2^23 shift
                // (exact for |v·id| <= 127.0x < 2^22), which vectorizes;
                // `f32::round` is a libm call per element.
                const SHIFT: f32 = 12_582_912.0;
                *q = ((v * id + SHIFT) - SHIFT).clamp(-127.0, 127.0) as i8;
            }
            let lo: i32 = qs[..16].iter().map(|&v| i32::from(v)).sum();
            let hi: i32 = qs[16..].iter().map(|&v| i32::from(v)).sum();
            r.d[b] = d;
            r.s[b] = d * (lo + hi) as f32;
            r.s_lo[b] = d * lo as f32;
            r.s_hi[b] = d * hi as f32;
        }
        r
    }
}

/// The affine map of one sub-block: `value = sd·w + off`, lanes 0..4 (the
/// first 16 elements) with index 0, lanes 4..8 with index 1.
#[derive(Clone, Copy)]
struct Affine {
    sd: [f32; 2],
    off: [f32; 2],
    /// Whether `off` is used at all (not for Q8_0), and whether it differs
    /// per half (Q6_K).
    offset: Offset,
}

#[derive(Clone, Copy, PartialEq)]
enum Offset {
    None,
    Whole,
    Halves,
}

impl Affine {
    fn whole(sd: f32, off: f32) -> Affine {
        Affine {
            sd: [sd, sd],
            off: [off, off],
            offset: Offset::Whole,
        }
    }
}

/// The accumulator both instruction sets update identically (see the
/// module docs): 8 lanes and the offset sum.
struct Acc {
    lanes: [f32; 8],
    m: f32,
}

impl Acc {
    #[inline(always)]
    fn offset(&mut self, a: &Affine, x: &QRow, b: usize) {
        match a.offset {
            Offset::None => {}
            Offset::Whole => self.m += a.off[0] * x.s[b],
            Offset::Halves => {
                self.m += a.off[0] * x.s_lo[b];
                self.m += a.off[1] * x.s_hi[b];
            }
        }
    }
    #[inline(always)]
    fn finish(&self, lanes: [f32; 8]) -> f32 {
        let l = lanes;
        ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])) + self.m
    }
}

#[inline(always)]
fn h(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// The affine maps of the sub-blocks of one block, given an f16 decoder.
/// Shared by both instruction sets, so the scales are the same f32 values.
#[inline(always)]
fn affine(q: QuantType, b: &[u8], sub: usize, f: impl Fn(u16) -> f32) -> Affine {
    match q {
        QuantType::Q8_0 => Affine {
            offset: Offset::None,
            ..Affine::whole(f(h(b, 0)), 0.0)
        },
        QuantType::Q4_0 => {
            let d = f(h(b, 0));
            Affine::whole(d, d * -8.0)
        }
        QuantType::Q4_1 => Affine::whole(f(h(b, 0)), f(h(b, 2))),
        QuantType::Q5_0 => {
            let d = f(h(b, 0));
            Affine::whole(d, d * -16.0)
        }
        QuantType::Q4K | QuantType::Q5K => {
            let (d, dmin) = (f(h(b, 0)), f(h(b, 2)));
            let (sc, m) = scale_min_k4(sub, &b[4..16]);
            Affine::whole(d * f32::from(sc), -(dmin * f32::from(m)))
        }
        QuantType::Q6K => {
            let d = f(h(b, 208));
            // Sub-block `sub` = half `sub / 4`, part `k = sub % 4`: its
            // elements 0..16 use scale 8·half + 2k, 16..32 the next one.
            let (half, k) = (sub / 4, sub % 4);
            let s0 = f32::from(b[192 + 8 * half + 2 * k] as i8);
            let s1 = f32::from(b[192 + 8 * half + 2 * k + 1] as i8);
            let (a, c) = (d * s0, d * s1);
            Affine {
                sd: [a, c],
                off: [a * -32.0, c * -32.0],
                offset: Offset::Halves,
            }
        }
        QuantType::Fp8E4M3 => unreachable!("fp8 takes the f32 path"),
    }
}

/// Sub-blocks of 32 per block.
fn subs(q: QuantType) -> usize {
    q.block_elems() / 32
}

/// The 32 integer weights of sub-block `sub` of block `b`, portably.
#[inline(always)]
fn decode_portable(q: QuantType, b: &[u8], sub: usize, w: &mut [u8; 32]) {
    let nibbles = |w: &mut [u8; 32], p: &[u8]| {
        for j in 0..16 {
            w[j] = p[j] & 15;
            w[j + 16] = p[j] >> 4;
        }
    };
    match q {
        QuantType::Q8_0 => w.copy_from_slice(&b[2..34]),
        QuantType::Q4_0 => nibbles(w, &b[2..18]),
        QuantType::Q4_1 => nibbles(w, &b[4..20]),
        QuantType::Q5_0 => {
            nibbles(w, &b[6..22]);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for (e, v) in w.iter_mut().enumerate() {
                *v |= (((qh >> e) & 1) << 4) as u8;
            }
        }
        QuantType::Q4K | QuantType::Q5K => {
            let five = q == QuantType::Q5K;
            let ql = if five { &b[48..176] } else { &b[16..144] };
            let (c, shift) = (sub / 2, 4 * (sub % 2));
            for l in 0..32 {
                w[l] = (ql[32 * c + l] >> shift) & 15;
                if five {
                    w[l] |= ((b[16 + l] >> sub) & 1) << 4;
                }
            }
        }
        QuantType::Q6K => {
            let (half, k) = (sub / 4, sub % 4);
            let ql = &b[64 * half..64 * half + 64];
            let qh = &b[128 + 32 * half..128 + 32 * half + 32];
            let (src, shift) = (32 * (k % 2), 4 * (k / 2));
            for l in 0..32 {
                w[l] = ((ql[src + l] >> shift) & 15) | (((qh[l] >> (2 * k)) & 3) << 4);
            }
        }
        QuantType::Fp8E4M3 => unreachable!("fp8 takes the f32 path"),
    }
}

/// Dot product of one weight row with one quantized `x` row, portably.
fn dot_portable(q: QuantType, row: &[u8], x: &QRow) -> f32 {
    let mut acc = Acc {
        lanes: [0.0; 8],
        m: 0.0,
    };
    let mut w = [0u8; 32];
    let per = subs(q);
    for (bi, b) in row.chunks_exact(q.block_bytes()).enumerate() {
        for sub in 0..per {
            let xb = bi * per + sub;
            let a = affine(q, b, sub, |v| f16::from_bits(v).to_f32());
            decode_portable(q, b, sub, &mut w);
            let xq = &x.q[32 * xb..32 * xb + 32];
            let dx = x.d[xb];
            let sdx = [a.sd[0] * dx, a.sd[1] * dx];
            for j in 0..8 {
                let mut s = 0i32;
                for e in 4 * j..4 * j + 4 {
                    let wv = if q == QuantType::Q8_0 {
                        i32::from(w[e] as i8)
                    } else {
                        i32::from(w[e])
                    };
                    s += wv * i32::from(xq[e]);
                }
                acc.lanes[j] += s as f32 * sdx[j / 4];
            }
            acc.offset(&a, x, xb);
        }
    }
    acc.finish(acc.lanes)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The AVX2 path: the same sub-block loop with the weights decoded in
    //! a ymm register and the integer dot product by `maddubs`/`madd`.
    use super::{affine, subs, Acc, QRow};
    use kiln_ir::QuantType;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        let v = _mm_loadu_si128(p as *const __m128i);
        let m = _mm_set1_epi8(15);
        let lo = _mm_and_si128(v, m);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m);
        _mm256_set_m128i(hi, lo)
    }

    /// `(v >> s) & mask` per byte (`mask < 1 << (8 - s)`).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn shr_and(v: __m256i, s: i32, mask: i8) -> __m256i {
        _mm256_and_si256(
            _mm256_srl_epi16(v, _mm_cvtsi32_si128(s)),
            _mm256_set1_epi8(mask),
        )
    }

    /// Byte `e` is `0x10` where bit `e` of `qh` is set, else 0.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn fifth_bits(qh: u32) -> __m256i {
        let t = _mm256_set1_epi32(qh as i32);
        let shuf = _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        );
        let bytes = _mm256_shuffle_epi8(t, shuf);
        let bit = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
        let set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, bit), _mm256_set1_epi64x(-1));
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn decode(q: QuantType, b: &[u8], sub: usize) -> __m256i {
        let p = b.as_ptr();
        match q {
            QuantType::Q8_0 => _mm256_loadu_si256(p.add(2) as *const __m256i),
            QuantType::Q4_0 => nibbles(p.add(2)),
            QuantType::Q4_1 => nibbles(p.add(4)),
            QuantType::Q5_0 => {
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                _mm256_or_si256(nibbles(p.add(6)), fifth_bits(qh))
            }
            QuantType::Q4K | QuantType::Q5K => {
                let five = q == QuantType::Q5K;
                let ql = if five { p.add(48) } else { p.add(16) };
                let (c, shift) = (sub / 2, 4 * (sub % 2) as i32);
                let v = _mm256_loadu_si256(ql.add(32 * c) as *const __m256i);
                let w = shr_and(v, shift, 15);
                if five {
                    let qh = _mm256_loadu_si256(p.add(16) as *const __m256i);
                    let hb = _mm256_slli_epi16::<4>(shr_and(qh, sub as i32, 1));
                    _mm256_or_si256(w, hb)
                } else {
                    w
                }
            }
            QuantType::Q6K => {
                let (half, k) = (sub / 4, sub % 4);
                let ql = p.add(64 * half + 32 * (k % 2));
                let qh = p.add(128 + 32 * half);
                let lo = shr_and(
                    _mm256_loadu_si256(ql as *const __m256i),
                    4 * (k / 2) as i32,
                    15,
                );
                let hi = shr_and(_mm256_loadu_si256(qh as *const __m256i), 2 * k as i32, 3);
                _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi))
            }
            QuantType::Fp8E4M3 => unreachable!("fp8 takes the f32 path"),
        }
    }

    /// [`super::dot_portable`] with AVX2 (same bits).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(q: QuantType, row: &[u8], x: &QRow) -> f32 {
        let mut acc = Acc {
            lanes: [0.0; 8],
            m: 0.0,
        };
        let mut lanes = _mm256_setzero_ps();
        let ones = _mm256_set1_epi16(1);
        let per = subs(q);
        let signed = q == QuantType::Q8_0;
        for (bi, b) in row.chunks_exact(q.block_bytes()).enumerate() {
            for sub in 0..per {
                let xb = bi * per + sub;
                let a = affine(q, b, sub, |v| {
                    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(v))))
                });
                let w = decode(q, b, sub);
                let xq = _mm256_loadu_si256(x.q.as_ptr().add(32 * xb) as *const __m256i);
                let p16 = if signed {
                    _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w))
                } else {
                    _mm256_maddubs_epi16(w, xq)
                };
                let s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
                let dx = *x.d.get_unchecked(xb);
                let (s0, s1) = (a.sd[0] * dx, a.sd[1] * dx);
                let scale = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
                lanes = _mm256_add_ps(lanes, _mm256_mul_ps(s, scale));
                acc.offset(&a, x, xb);
            }
        }
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), lanes);
        acc.finish(out)
    }
}

/// Dot product of a weight row with a quantized `x` row at `level`.
#[inline]
fn dot(level: Level, q: QuantType, row: &[u8], x: &QRow) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if level >= Level::Avx2 && has_f16c() {
        // SAFETY: AVX2, FMA (Level::Avx2) and F16C were detected.
        return unsafe { avx2::dot(q, row, x) };
    }
    let _ = level;
    dot_portable(q, row, x)
}

#[cfg(target_arch = "x86_64")]
fn has_f16c() -> bool {
    static F16C: OnceLock<bool> = OnceLock::new();
    *F16C.get_or_init(|| std::arch::is_x86_feature_detected!("f16c"))
}

fn e4m3_table() -> &'static [f32; 256] {
    static T: OnceLock<[f32; 256]> = OnceLock::new();
    T.get_or_init(|| std::array::from_fn(|i| e4m3_to_f32(i as u8)))
}

/// FP8 row dot product: 8 lanes in element order, then the pairwise sum.
fn dot_fp8(row: &[u8], x: &[f32]) -> f32 {
    let t = e4m3_table();
    let mut l = [0f32; 8];
    let mut chunks = row.chunks_exact(8);
    let mut xs = x.chunks_exact(8);
    for (w, xv) in (&mut chunks).zip(&mut xs) {
        for j in 0..8 {
            l[j] += t[w[j] as usize] * xv[j];
        }
    }
    for (j, (&w, &xv)) in chunks.remainder().iter().zip(xs.remainder()).enumerate() {
        l[j] += t[w as usize] * xv;
    }
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// `out[t, n] = x[t] · w[n] (+ bias[n])` with `w` in the CPU layout of `q`
/// ([`crate::quant_cpu`]: Q8_0, Q4_0, Q4_1 and Q5_0 interleaved and computed by
/// `qgroup`, the others as stored), at `level`.
///
/// # Safety
/// As [`super::execute`] after its checks: `x`, `bias` valid for reads,
/// `w` valid for `q.tensor_bytes(n, k)` bytes, `out` for writes and not
/// overlapping the inputs.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul_at(
    level: Level,
    q: QuantType,
    x: Buf,
    w: *const u8,
    bias: Option<Buf>,
    (t, k, n): (usize, usize, usize),
    out: Buf,
) {
    if t == 0 || n == 0 {
        return;
    }
    let rb = q.row_bytes(k).unwrap_or(0);
    let wbytes = std::slice::from_raw_parts(w, q.tensor_bytes(n, k).unwrap_or(0));
    let mut xf = vec![0f32; t * k];
    x.load(0, &mut xf);
    let bias_f32 = bias.map(|b| {
        let mut v = vec![0f32; n];
        b.load(0, &mut v);
        v
    });
    let fp8 = q == QuantType::Fp8E4M3;
    let rows: Vec<QRow> = if fp8 {
        Vec::new()
    } else {
        xf.chunks_exact(k.max(1)).map(QRow::new).collect()
    };
    if crate::quant_cpu::interleaves(q) {
        let path = super::qgroup::path(level);
        super::qgroup::matmul(path, q, &rows, wbytes, bias_f32.as_deref(), (t, k, n), out);
        return;
    }
    let scales = fp8.then(|| &wbytes[n * rb..]);
    let block_cols = |n0: usize, n1: usize| {
        let cols = n1 - n0;
        let mut res = vec![0f32; t * cols];
        for c in n0..n1 {
            let row = &wbytes[c * rb..(c + 1) * rb];
            let b = bias_f32.as_ref().map_or(0.0, |b| b[c]);
            for r in 0..t {
                let v = match scales {
                    Some(s) => {
                        let s = f32::from_le_bytes([
                            s[4 * c],
                            s[4 * c + 1],
                            s[4 * c + 2],
                            s[4 * c + 3],
                        ]);
                        dot_fp8(row, &xf[r * k..(r + 1) * k]) * s
                    }
                    None => dot(level, q, row, &rows[r]),
                };
                res[r * cols + c - n0] = v + b;
            }
        }
        for r in 0..t {
            // SAFETY: chunks store disjoint columns of `out`.
            unsafe { out.store(r * n + n0, &res[r * cols..(r + 1) * cols]) };
        }
    };
    if n * rb < PARALLEL_MIN_BYTES {
        block_cols(0, n);
        return;
    }
    let block = n.div_ceil(PARALLEL_CHUNKS).max(16);
    par::for_each_chunk(n.div_ceil(block), |b| {
        let n0 = b * block;
        block_cols(n0, (n0 + block).min(n));
    });
}

/// [`matmul_at`] at the process's SIMD level.
///
/// # Safety
/// As [`matmul_at`].
pub(crate) unsafe fn matmul(
    q: QuantType,
    x: Buf,
    w: *const u8,
    bias: Option<Buf>,
    tkn: (usize, usize, usize),
    out: Buf,
) {
    matmul_at(simd::level(), q, x, w, bias, tkn, out)
}

/// `embedding` from a table of `q` in the CPU layout: row `id` decoded (and scaled,
/// for FP8) and rounded to the result dtype. Ids are checked first.
///
/// # Safety
/// As [`super::execute`]: `table` valid for `q.tensor_bytes(vocab, h)`.
pub(crate) unsafe fn embedding(
    op: &kiln_ir::Op,
    q: QuantType,
    ids: Buf,
    table: *const u8,
    (vocab, h): (usize, usize),
    out: Buf,
) -> super::Result<()> {
    let ids = ids.ints();
    if let Some((t, &id)) = ids
        .iter()
        .enumerate()
        .find(|(_, &id)| id < 0 || id as usize >= vocab)
    {
        return Err(super::index_error(
            op,
            format!(
                "token id {id} at row {t} is outside the embedding table's {vocab} rows; ids must be in 0..{vocab} (check the tokenizer matches the model)"
            ),
        ));
    }
    let rb = q.row_bytes(h).unwrap_or(0);
    let data = std::slice::from_raw_parts(table, q.tensor_bytes(vocab, h).unwrap_or(0));
    let mut row = vec![0f32; h];
    let mut stored = vec![0u8; rb];
    for (t, &id) in ids.iter().enumerate() {
        let id = id as usize;
        crate::quant_cpu::stored_row(q, data, vocab, h, id, &mut stored);
        crate::quant::dequantize_row(q, &stored, &mut row)
            .map_err(|e| super::operands(op, e.to_string()))?;
        if q == QuantType::Fp8E4M3 {
            let at = vocab * rb + 4 * id;
            let s = f32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]);
            row.iter_mut().for_each(|v| *v *= s);
        }
        out.store(t * h, &row);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_tensor;
    use kiln_ir::rng::SplitMix64;
    use kiln_ir::DType;

    /// Random blocks of `q` with small finite f16 scales
    /// ([`crate::quant::random_tensor`]); FP8 weights of unit range.
    pub(crate) fn random_weights(q: QuantType, n: usize, k: usize, seed: u64) -> Vec<u8> {
        if q != QuantType::Fp8E4M3 {
            return crate::quant::random_tensor(q, n, k, seed);
        }
        let mut rng = SplitMix64::new(seed);
        let w: Vec<f32> = (0..n * k)
            .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            .collect();
        crate::quant::quantize_fp8_rows(&w, n, k)
    }

    fn noise(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        (0..n)
            .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
            .collect()
    }

    /// f32 rounding of the sums: relative to the products' magnitudes, and
    /// to the affine terms `sd·w` and `off`, which can exceed the values
    /// they sum to (at most twice the largest value plus the largest
    /// offset of these test scales, 2^-4 · 63).
    fn rounding(w: &[f32], x: &[f32], mag: f64) -> f64 {
        let wmax = w.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
        let xsum: f64 = x.iter().map(|v| v.abs() as f64).sum();
        1e-5 * (mag + xsum * (2.0 * wmax + 4.0)) + 1e-30
    }

    fn run(level: Level, q: QuantType, w: &[u8], x: &[f32], t: usize, k: usize) -> Vec<f32> {
        let n = w.len() / (q.tensor_bytes(1, k).unwrap());
        let mut xs = x.to_vec();
        let w = &crate::quant_cpu::repack(q, w, n, k).unwrap();
        let mut out = vec![0f32; t * n];
        let buf = |p: *mut f32, len| Buf {
            ptr: p as *mut u8,
            dtype: DType::F32,
            len,
        };
        unsafe {
            matmul_at(
                level,
                q,
                buf(xs.as_mut_ptr(), t * k),
                w.as_ptr(),
                None,
                (t, k, n),
                buf(out.as_mut_ptr(), t * n),
            )
        };
        out
    }

    #[test]
    fn activation_blocks_take_the_maximum_of_a_running_fold_bit_for_bit() {
        let mut x = noise(32 * 40, 3);
        // A zero block, a block with a NaN, one with an infinity, one of
        // negative zeros, and a large range.
        x[32..64].iter_mut().for_each(|v| *v = 0.0);
        x[70] = f32::NAN;
        x[100] = f32::INFINITY;
        x[128..160].iter_mut().for_each(|v| *v = -0.0);
        x[200] = -1e30;
        let r = QRow::new(&x);
        for b in 0..40 {
            let xs = &x[32 * b..32 * b + 32];
            let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            assert_eq!(r.d[b].to_bits(), d.to_bits(), "block {b}");
        }
    }

    #[test]
    fn every_quantized_matmul_is_dequantize_then_multiply_within_the_activation_step() {
        let levels = simd::available();
        for q in QuantType::ALL {
            for (t, blocks, n) in [(1, 1, 3), (2, 3, 37), (3, 5, 17), (1, 2, 129)] {
                // Awkward sizes: odd block counts, a row count that is not a
                // multiple of any chunk, FP8 rows of a length that is not a
                // multiple of the 8 lanes.
                let k = if q == QuantType::Fp8E4M3 {
                    blocks * 32 + 5
                } else {
                    blocks * q.block_elems()
                };
                let w = random_weights(q, n, k, 7 + t as u64 + n as u64);
                let x = noise(t * k, 99 + k as u64);
                let dense = dequantize_tensor(q, &w, n, k).unwrap();
                let base = run(levels[0], q, &w, &x, t, k);
                for &l in &levels[1..] {
                    let other = run(l, q, &w, &x, t, k);
                    assert!(
                        base.iter()
                            .zip(&other)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{q} {l:?} {t}x{k}x{n} differs from the portable path"
                    );
                }
                for r in 0..t {
                    let xr = &x[r * k..(r + 1) * k];
                    let amax_blocks: Vec<f32> = xr
                        .chunks(32)
                        .map(|c| c.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0)
                        .collect();
                    for c in 0..n {
                        let wr = &dense[c * k..(c + 1) * k];
                        let exact: f64 =
                            wr.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let mag: f64 = wr
                            .iter()
                            .zip(xr)
                            .map(|(&a, &b)| (a as f64 * b as f64).abs())
                            .sum();
                        let step: f64 = if q == QuantType::Fp8E4M3 {
                            0.0
                        } else {
                            wr.iter()
                                .enumerate()
                                .map(|(i, &a)| a.abs() as f64 * amax_blocks[i / 32] as f64 / 2.0)
                                .sum()
                        };
                        let got = base[r * n + c] as f64;
                        let tol = step * 1.0001 + rounding(wr, xr, mag);
                        assert!(
                            (got - exact).abs() <= tol,
                            "{q} {t}x{k}x{n} [{r},{c}]: {got} vs {exact} (tol {tol})"
                        );
                    }
                }
                assert!(base.iter().any(|v| *v != 0.0), "{q}: all zero");
            }
        }
    }

    #[test]
    fn the_quantized_product_of_an_exactly_representable_row_equals_the_dense_product() {
        // x with one nonzero value per block of 32 quantizes exactly (q = ±127,
        // d = |x|/127 exact for x = 127·2^-j): the product then equals the
        // dequantized weight times x up to f32 rounding of the sums.
        for q in QuantType::ALL
            .into_iter()
            .filter(|q| *q != QuantType::Fp8E4M3)
        {
            let (n, k) = (5, q.block_elems() * 2);
            let w = random_weights(q, n, k, 3);
            let dense = dequantize_tensor(q, &w, n, k).unwrap();
            let mut x = vec![0f32; k];
            for b in 0..k / 32 {
                x[32 * b + (b * 7) % 32] = 127.0 * (2f32).powi(-(b as i32 % 5));
            }
            let got = run(Level::Generic, q, &w, &x, 1, k);
            for c in 0..n {
                let exact: f64 = (0..k).map(|i| dense[c * k + i] as f64 * x[i] as f64).sum();
                let mag: f64 = (0..k)
                    .map(|i| (dense[c * k + i] as f64 * x[i] as f64).abs())
                    .sum();
                let wr = &dense[c * k..(c + 1) * k];
                assert!(
                    (got[c] as f64 - exact).abs() <= rounding(wr, &x, mag),
                    "{q} col {c}: {} vs {exact}",
                    got[c]
                );
            }
        }
    }
}
