//! The quantized GEMV over Q8_0, Q4_0, Q4_1 and Q5_0 weights in the CPU's
//! interleaved layout ([`crate::quant_cpu`]): 8 output rows per SIMD
//! vector.
//!
//! Why a module of its own: these are the formats of the GGUF files people
//! run on CPUs (SmolLM2's Q4_1 projections and Q8_0 embedding), and at one
//! token a step the row-at-a-time kernel of `qmatmul` spends most of its
//! instructions on horizontal sums and scalar scales. Here the lanes are
//! rows, so per 32 weights of 8 rows the work is 4-8 integer dots, one f16
//! conversion of 8 scales and two vector multiply-adds.
//!
//! Every path computes, per output row `r` and the blocks `b` of the row in
//! order (the `x` row quantized as `qmatmul::QRow`: `q`, `dx = d[b]`,
//! `s = s[b] = dx·Σq`):
//!
//! ```text
//! isum = Σ_{e<32} w[e]·q[e]                 exact, i32
//! acc  = acc + (isum as f32) · (d_r·dx)
//! m    = m + off_r · s                      off = min (Q4_1), d_r·(-8) (Q4_0),
//!                                           d_r·(-16) (Q5_0); none for Q8_0
//! out  = (acc + m) + bias                   rounded once to the result dtype
//! ```
//!
//! The integer sums are exact whatever the instructions (`vpdpbusd` with
//! AVX-VNNI, `maddubs`+`madd` with AVX2: no pair of products overflows
//! i16, 2·127·128 < 2^15), so the AVX-VNNI, AVX2 and portable paths give
//! the same bits; the unit tests check it. The `n % 8` rows outside a group
//! take the portable per-row loop, which is the same formula.
//!
//! Not here: the K-quants and FP8 (the per-row kernel of `qmatmul`,
//! their layout is the stored one), prefill blocking beyond reusing each
//! group's bytes from cache for the `T` rows of `x`.

use super::buf::Buf;
use super::par;
use super::qmatmul::QRow;
use super::simd::Level;
use crate::quant_cpu::GROUP;
use half::f16;
use kiln_ir::QuantType;

/// Group chunks a parallel call is cut into, at most.
const PARALLEL_CHUNKS: usize = 32;
/// The smallest chunk a parallel call hands out, in weight bytes.
const CHUNK_MIN_BYTES: usize = 16 << 10;
/// Below this many weight bytes a matmul runs on the calling thread.
const PARALLEL_MIN_BYTES: usize = 1 << 15;

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// The header bytes of a group block (8 f16 scales, and 8 mins for Q4_1
/// or 32 bytes of fifth-bit planes for Q5_0)
/// and of a stored block ([`crate::quant_cpu`]'s layout).
fn header(q: QuantType) -> (usize, usize) {
    let (stored, _) = crate::quant_cpu::split(q);
    (GROUP * stored, stored)
}

/// The 8 outputs of one group over one `x` row, portably.
fn group_portable(q: QuantType, g: &[u8], blocks: usize, x: &QRow) -> [f32; GROUP] {
    let bb8 = GROUP * q.block_bytes();
    let (gh, _) = header(q);
    let mut acc = [0f32; GROUP];
    let mut m = [0f32; GROUP];
    for b in 0..blocks {
        let p = &g[b * bb8..(b + 1) * bb8];
        let xq = &x.q[32 * b..32 * b + 32];
        let (dx, s) = (x.d[b], x.s[b]);
        for r in 0..GROUP {
            let mut isum = 0i32;
            match q {
                QuantType::Q8_0 => {
                    for c in 0..8 {
                        for e in 0..4 {
                            let w = p[gh + 32 * c + 4 * r + e] as i8;
                            isum += i32::from(w) * i32::from(xq[4 * c + e]);
                        }
                    }
                }
                _ => {
                    for c in 0..4 {
                        for e in 0..4 {
                            let v = p[gh + 32 * c + 4 * r + e];
                            // Q5_0's fifth bits (bit planes at byte 16+4r+e).
                            let (f0, f1) = if q == QuantType::Q5_0 {
                                let h = p[16 + 4 * r + e];
                                (((h >> (2 * c)) & 1) << 4, ((h >> (2 * c + 1)) & 1) << 4)
                            } else {
                                (0, 0)
                            };
                            isum += i32::from((v & 15) | f0) * i32::from(xq[4 * c + e]);
                            isum += i32::from((v >> 4) | f1) * i32::from(xq[16 + 4 * c + e]);
                        }
                    }
                }
            }
            let d = f16_at(p, 2 * r);
            acc[r] += isum as f32 * (d * dx);
            match q {
                QuantType::Q4_1 => m[r] += f16_at(p, 16 + 2 * r) * s,
                QuantType::Q4_0 => m[r] += (d * -8.0) * s,
                QuantType::Q5_0 => m[r] += (d * -16.0) * s,
                _ => {}
            }
        }
    }
    std::array::from_fn(|r| acc[r] + m[r])
}

/// One row in the stored layout (a row outside every group), portably:
/// the same formula.
fn row_portable(q: QuantType, row: &[u8], x: &QRow) -> f32 {
    let bb = q.block_bytes();
    let (_, h) = header(q);
    let (mut acc, mut m) = (0f32, 0f32);
    for (b, blk) in row.chunks_exact(bb).enumerate() {
        let xq = &x.q[32 * b..32 * b + 32];
        let (dx, s) = (x.d[b], x.s[b]);
        let mut isum = 0i32;
        match q {
            QuantType::Q8_0 => {
                for e in 0..32 {
                    isum += i32::from(blk[h + e] as i8) * i32::from(xq[e]);
                }
            }
            _ => {
                let qh = if q == QuantType::Q5_0 {
                    u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]])
                } else {
                    0
                };
                let fifth = |e: usize| (((qh >> e) & 1) << 4) as u8;
                for e in 0..16 {
                    let v = blk[h + e];
                    isum += i32::from((v & 15) | fifth(e)) * i32::from(xq[e]);
                    isum += i32::from((v >> 4) | fifth(16 + e)) * i32::from(xq[16 + e]);
                }
            }
        }
        let d = f16_at(blk, 0);
        acc += isum as f32 * (d * dx);
        match q {
            QuantType::Q4_1 => m += f16_at(blk, 2) * s,
            QuantType::Q4_0 => m += (d * -8.0) * s,
            QuantType::Q5_0 => m += (d * -16.0) * s,
            _ => {}
        }
    }
    acc + m
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The group loop with the rows in the 8 lanes of a ymm register.
    use super::{header, QRow, GROUP};

    /// How far ahead of the group block being read the loop prefetches.
    /// Measured on the 2-core machine over 96 MB of Q4_1 groups, two
    /// threads, huge pages: 1024 bytes reach ~19 GB/s, 2048 ~23, 4096 ~24
    /// (a plain AVX2 read of the same bytes: ~23).
    const PREFETCH: usize = 4096;
    use kiln_ir::QuantType;
    use std::arch::x86_64::*;

    /// `acc + Σ4 w·x` per i32 lane, `w` unsigned, `x` signed bytes.
    #[inline(always)]
    unsafe fn dot4<const VNNI: bool>(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
        if VNNI {
            _mm256_dpbusd_avx_epi32(acc, w, x)
        } else {
            let p = _mm256_maddubs_epi16(w, x);
            _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
        }
    }

    /// Bit `k` of every byte of `planes` at bit 4, the rest zero (a 16-bit
    /// shift keeps each byte's bit 4 from its own byte for shifts up to 4).
    #[inline(always)]
    unsafe fn fifth(planes: __m256i, k: i32) -> __m256i {
        let v = if k <= 4 {
            _mm256_sll_epi16(planes, _mm_cvtsi32_si128(4 - k))
        } else {
            _mm256_srl_epi16(planes, _mm_cvtsi32_si128(k - 4))
        };
        _mm256_and_si256(v, _mm256_set1_epi8(0x10))
    }

    /// Four bytes of `x` at `p` in every lane.
    #[inline(always)]
    unsafe fn bcast(p: *const i8) -> __m256i {
        _mm256_set1_epi32((p as *const i32).read_unaligned())
    }

    #[inline(always)]
    unsafe fn group<const VNNI: bool>(
        q: QuantType,
        g: *const u8,
        blocks: usize,
        x: &QRow,
    ) -> [f32; GROUP] {
        let bb8 = GROUP * q.block_bytes();
        let (gh, _) = header(q);
        let nib = _mm256_set1_epi8(15);
        let mut acc = _mm256_setzero_ps();
        let mut m = _mm256_setzero_ps();
        let xq = x.q.as_ptr();
        let lines = bb8.div_ceil(64);
        for b in 0..blocks {
            let p = g.add(b * bb8);
            // The stream is sequential, but the hardware prefetchers stop
            // at page boundaries and keep too few lines in flight for one
            // core to reach the memory bandwidth; a software prefetch of
            // every line of the block PREFETCH bytes ahead does.
            // (Prefetches never fault, past the end of `g` included.)
            for l in 0..lines {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH + 64 * l) as *const i8);
            }
            let xb = xq.add(32 * b);
            let w0 = p.add(gh);
            let mut isum = _mm256_setzero_si256();
            if q == QuantType::Q8_0 {
                for c in 0..8 {
                    let w = _mm256_loadu_si256(w0.add(32 * c) as *const __m256i);
                    let xv = _mm256_sign_epi8(bcast(xb.add(4 * c)), w);
                    isum = dot4::<VNNI>(isum, _mm256_sign_epi8(w, w), xv);
                }
            } else if q == QuantType::Q5_0 {
                // The fifth bits: bit 2c (low nibbles) or 2c+1 (high) of
                // the plane byte in the same place.
                let planes = _mm256_loadu_si256(p.add(16) as *const __m256i);
                for c in 0..4 {
                    let raw = _mm256_loadu_si256(w0.add(32 * c) as *const __m256i);
                    let lo =
                        _mm256_or_si256(_mm256_and_si256(raw, nib), fifth(planes, 2 * c as i32));
                    let hi = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(raw), nib),
                        fifth(planes, 2 * c as i32 + 1),
                    );
                    isum = dot4::<VNNI>(isum, lo, bcast(xb.add(4 * c)));
                    isum = dot4::<VNNI>(isum, hi, bcast(xb.add(16 + 4 * c)));
                }
            } else {
                for c in 0..4 {
                    let raw = _mm256_loadu_si256(w0.add(32 * c) as *const __m256i);
                    let lo = _mm256_and_si256(raw, nib);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), nib);
                    isum = dot4::<VNNI>(isum, lo, bcast(xb.add(4 * c)));
                    isum = dot4::<VNNI>(isum, hi, bcast(xb.add(16 + 4 * c)));
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
            let dx = _mm256_set1_ps(*x.d.get_unchecked(b));
            acc = _mm256_add_ps(
                acc,
                _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, dx)),
            );
            let s = _mm256_set1_ps(*x.s.get_unchecked(b));
            match q {
                QuantType::Q4_1 => {
                    let mn = _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i));
                    m = _mm256_add_ps(m, _mm256_mul_ps(mn, s));
                }
                QuantType::Q4_0 => {
                    let off = _mm256_mul_ps(d, _mm256_set1_ps(-8.0));
                    m = _mm256_add_ps(m, _mm256_mul_ps(off, s));
                }
                QuantType::Q5_0 => {
                    let off = _mm256_mul_ps(d, _mm256_set1_ps(-16.0));
                    m = _mm256_add_ps(m, _mm256_mul_ps(off, s));
                }
                _ => {}
            }
        }
        let mut out = [0f32; GROUP];
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(acc, m));
        out
    }

    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    pub(super) unsafe fn group_vnni(
        q: QuantType,
        g: *const u8,
        blocks: usize,
        x: &QRow,
    ) -> [f32; GROUP] {
        group::<true>(q, g, blocks, x)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn group_avx2(
        q: QuantType,
        g: *const u8,
        blocks: usize,
        x: &QRow,
    ) -> [f32; GROUP] {
        group::<false>(q, g, blocks, x)
    }
}

/// Which group loop runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    Portable,
    Avx2,
    AvxVnni,
}

/// The fastest path this CPU runs at `level` (`KILN_CPU_SIMD` caps it).
pub(crate) fn path(level: Level) -> Path {
    #[cfg(target_arch = "x86_64")]
    if level >= Level::Avx2 && std::arch::is_x86_feature_detected!("f16c") {
        if std::arch::is_x86_feature_detected!("avxvnni") {
            return Path::AvxVnni;
        }
        return Path::Avx2;
    }
    let _ = level;
    Path::Portable
}

/// Every path this CPU can run (for tests).
#[cfg(test)]
pub(crate) fn paths() -> Vec<Path> {
    let best = path(super::simd::detected());
    [Path::Portable, Path::Avx2, Path::AvxVnni]
        .into_iter()
        .filter(|p| match best {
            Path::Portable => *p == Path::Portable,
            Path::Avx2 => *p != Path::AvxVnni,
            Path::AvxVnni => true,
        })
        .collect()
}

#[inline]
fn group_at(path: Path, q: QuantType, g: &[u8], blocks: usize, x: &QRow) -> [f32; GROUP] {
    #[cfg(target_arch = "x86_64")]
    match path {
        // SAFETY: `path` only names what `path()` detected; `g` holds
        // `blocks` group blocks (checked by the caller's slicing).
        Path::AvxVnni => return unsafe { x86::group_vnni(q, g.as_ptr(), blocks, x) },
        Path::Avx2 => return unsafe { x86::group_avx2(q, g.as_ptr(), blocks, x) },
        Path::Portable => {}
    }
    let _ = path;
    group_portable(q, g, blocks, x)
}

/// `out[t, n] = x[t] · w[n] (+ bias[n])` for `w` in the CPU layout of `q`
/// (an interleaved type), `xs` the quantized rows of `x`.
///
/// # Safety
/// `out` is valid for `t·n` writes of its dtype and overlaps nothing read.
pub(crate) unsafe fn matmul(
    path: Path,
    q: QuantType,
    xs: &[QRow],
    w: &[u8],
    bias: Option<&[f32]>,
    (_, k, n): (usize, usize, usize),
    out: Buf,
) {
    let blocks = k / 32;
    let gb = GROUP * blocks * q.block_bytes();
    let groups = n / GROUP;
    let bias_at = |c: usize| bias.map_or(0.0, |b| b[c]);
    // Each group's 8 outputs are stored as they are computed (a chunk
    // allocates nothing: a decode step runs ~4000 chunks).
    let run = |g0: usize, g1: usize| {
        for g in g0..g1 {
            let bytes = &w[g * gb..(g + 1) * gb];
            for (r, x) in xs.iter().enumerate() {
                let mut v = group_at(path, q, bytes, blocks, x);
                for (l, v) in v.iter_mut().enumerate() {
                    *v += bias_at(g * GROUP + l);
                }
                // SAFETY: chunks store disjoint columns of `out`.
                unsafe { out.store(r * n + g * GROUP, &v) };
            }
        }
    };
    if groups > 0 {
        if w.len() < PARALLEL_MIN_BYTES {
            run(0, groups);
        } else {
            // Chunks of at least CHUNK_MIN_BYTES: each chunk starts a new
            // stream the prefetchers must ramp up on.
            let per = groups
                .div_ceil(PARALLEL_CHUNKS)
                .max(CHUNK_MIN_BYTES.div_ceil(gb));
            par::for_each_chunk(groups.div_ceil(per), |c| {
                let g0 = c * per;
                run(g0, (g0 + per).min(groups));
            });
        }
    }
    let rb = blocks * q.block_bytes();
    for c in groups * GROUP..n {
        let row = &w[groups * gb + (c - groups * GROUP) * rb..][..rb];
        for (r, x) in xs.iter().enumerate() {
            let v = row_portable(q, row, x) + bias_at(c);
            out.store(r * n + c, &[v]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::random_tensor;
    use crate::quant_cpu::repack;
    use kiln_ir::rng::SplitMix64;

    fn noise(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        (0..n)
            .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
            .collect()
    }

    #[test]
    fn every_path_gives_the_bits_of_the_per_row_formula() {
        for q in [
            QuantType::Q8_0,
            QuantType::Q4_0,
            QuantType::Q4_1,
            QuantType::Q5_0,
        ] {
            for (n, blocks) in [(8, 1), (16, 3), (24, 7)] {
                let k = 32 * blocks;
                let src = random_tensor(q, n, k, 5 + n as u64);
                let packed = repack(q, &src, n, k).unwrap();
                let x = QRow::new(&noise(k, 17 + blocks as u64));
                let rb = q.row_bytes(k).unwrap();
                let gb = GROUP * rb;
                for g in 0..n / GROUP {
                    let want: Vec<f32> = (0..GROUP)
                        .map(|r| row_portable(q, &src[(g * GROUP + r) * rb..][..rb], &x))
                        .collect();
                    for p in paths() {
                        let got = group_at(p, q, &packed[g * gb..(g + 1) * gb], blocks, &x);
                        for r in 0..GROUP {
                            assert_eq!(
                                got[r].to_bits(),
                                want[r].to_bits(),
                                "{q} {p:?} n={n} k={k} group {g} row {r}: {} vs {}",
                                got[r],
                                want[r]
                            );
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod speed {
    //! `cargo test --release -p kiln-kernels --lib qgroup::speed -- --ignored --nocapture`:
    //! GB/s of the group GEMV over more weight bytes than the caches hold.
    use super::*;
    use crate::quant::random_tensor;
    use crate::quant_cpu::repack;
    use kiln_ir::DType;

    #[test]
    #[ignore = "a measurement, not a check"]
    fn group_gemv_bandwidth() {
        for (q, n, k, count) in [
            (QuantType::Q4_1, 1536, 576, 160),
            (QuantType::Q4_1, 576, 576, 400),
            (QuantType::Q8_0, 49152, 576, 4),
        ] {
            let ws: Vec<Vec<u8>> = (0..count)
                .map(|i| repack(q, &random_tensor(q, n, k, i as u64), n, k).unwrap())
                .collect();
            let bytes: usize = ws.iter().map(|w| w.len()).sum();
            let x: Vec<f32> = (0..k).map(|i| (i as f32 * 0.37).sin()).collect();
            let xs = vec![QRow::new(&x)];
            let mut out = vec![0f32; n];
            let buf = Buf {
                ptr: out.as_mut_ptr() as *mut u8,
                dtype: DType::F32,
                len: n,
            };
            let p = path(super::super::simd::detected());
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t0 = std::time::Instant::now();
                for w in &ws {
                    unsafe { matmul(p, q, &xs, w, None, (1, k, n), buf) };
                }
                best = best.min(t0.elapsed().as_secs_f64());
            }
            println!(
                "{q} {n}x{k} x{count}: {:.1} MB in {:.2} ms = {:.1} GB/s ({p:?}, {} threads)",
                bytes as f64 / 1e6,
                best * 1e3,
                bytes as f64 / best / 1e9,
                rayon::current_num_threads()
            );
        }
    }
}
