//! Quantized weights on GPUs: the repacked layout the `qgemv` and `qskinny`
//! modules' kernels read (`kernels/gpu/qgemv.cu`, `kernels/gpu/qskinny.cu`),
//! the repack from GGUF's block layout into it, a host decoder of it, and the
//! launches of the quantized GEMV, skinny GEMM and row gather.
//!
//! Why a repack: GGUF blocks interleave scales with quants (Q8_0's 34-byte
//! blocks are not even 16-byte aligned), and the K-quants pack their
//! sub-block scales in 6 bits. The kernels want every row's quants as one
//! contiguous stream of 16-byte vectors and the few bytes of scales beside
//! it, so each lane issues one 16-byte load per 32 weights (16 for Q8_0 and
//! FP8) and a small, coalesced scale load. The layout, per type:
//!
//! * every region is row-major over the N rows and starts 16-byte aligned;
//!   region 0 (the quants) at byte 0, the others at [`QLayout::offsets`];
//! * V = K/32 vectors per row for the 4/5/6-bit types; a vector is 16 bytes,
//!   byte `i` holding element `A_i` in its low nibble and `B_i` in its high
//!   one, with `A_i = 32v + i, B_i = A_i + 16` (Q4_0, Q4_1, Q5_0: ggml's
//!   own bytes) or `A_i = 64(v/2) + 16(v%2) + i, B_i = A_i + 32` (Q4_K, Q5_K:
//!   ggml's own bytes; Q6_K: the low 4 bits of its codes moved there);
//! * Q8_0: i8 `[N][K]`, f16 `d` `[N][K/32]`;
//! * Q4_0: nibbles, f16 `d` `[N][V]`; Q4_1: nibbles, f16 `(d, m)` `[N][V]`;
//! * Q5_0: nibbles, f16 `d` `[N][V]`, u32 `qh` `[N][V]` (ggml's);
//! * Q4_K: nibbles, f16 `(d, dmin)` `[N][K/256]`, bytes `(sc_A, m_A, sc_B,
//!   m_B)` `[N][K/64]` (the 6-bit scales and mins unpacked); Q5_K adds u32
//!   fifth bits `[N][V]` (bit `i` of `A_i`, bit `16+i` of `B_i`);
//! * Q6_K: nibbles, f16 `d` `[N][K/256]`, i8 `(sc_A, sc_B)` `[N][V]`, two
//!   u32 of high 2-bit pairs `[N][V]` (bits `2i..2i+1`: `A_i`, then `B_i`);
//! * FP8 e4m3: the `[N][K]` bytes as stored (already a coalesced stream);
//!   its f32 per-row scale stays a separate `[N]` buffer.
//!
//! Repacked bytes exceed the GGUF bytes by at most the 16-byte padding of
//! three region starts, except Q4_K/Q5_K (+4 bytes per 256 weights: the
//! unpacked scales) and Q6_K (+2 per 256).
//!
//! [`dequantize_repacked`] decodes the layout on the host with the
//! reference dequantizer's arithmetic, so tests compare it bitwise with
//! GGUF's own decoding and use it as the kernels' reference.
//!
//! Performance (H200, `bench_quantized_gemv_on_llama3_8b_shapes`, results in
//! `bench/results/gpu-2026-12-01-qgemv/`): at one token the 4/5/6-bit
//! kernels stream 1.5-2.2 TB/s of weights and Q8_0/FP8 2.2-3.2 TB/s; at 8
//! tokens they are compute-bound (about 0.25-0.55 TB/s): the GEMV decodes
//! to f32 and multiplies every token on the FMA pipe. So GEMMs of 2 or more
//! tokens on CUDA sm_80+ lower to [`lower_qskinny`] instead
//! (`kernels/gpu/qskinny.cu`): the same layout and operands, the codes fed
//! exactly to `mma.sync` tensor-core steps that each lie in one scale group,
//! the group scales applied in f32, one launch per 32 tokens reading every
//! weight byte once. The catalog's `quantized_skinny_applies` makes the
//! choice; the plan's entry name records it (`qskinny_<type>_t<tp>_r<mt>_..`).
//!
//! `fused_matmul` over a quantized weight lowers to the same kernels' fused
//! entries ([`lower_qgemv_fused`], [`lower_qskinny_fused`]): the RMSNorm
//! prologue ([`QNorm`]), the SiLU/GELU*up epilogue ([`QAct`]) and the
//! residual add, with the unfused sequence's rounding points; the catalog's
//! `fused_matmul_runs` is the one legality check the fuse pass and the
//! lowering share.
//!
//! Deliberately not here: the IR op and the planner's sizing (they call
//! [`repacked_bytes`] and [`lower_qgemv`] / [`lower_qskinny`] /
//! [`lower_qgather`]), CPU kernels (`crate::cpu`), tuning (quantized GEMMs
//! are not in `kiln tune` tables: the rule above is the whole choice), and
//! any cuBLASLt path on dequantized weights.

use kiln_ir::plan::{BufRef, KernelLaunch, LaunchParam};
use kiln_ir::DType;

pub use kiln_ir::QuantType;

/// `q`'s block geometry in the u64 arithmetic this module sizes with.
trait Geometry {
    fn elems(self) -> u64;
    fn bytes(self) -> u64;
    fn row(self, k: u64) -> u64;
}

impl Geometry for QuantType {
    fn elems(self) -> u64 {
        self.block_elems() as u64
    }
    fn bytes(self) -> u64 {
        self.block_bytes() as u64
    }
    fn row(self, k: u64) -> u64 {
        k / self.elems() * self.bytes()
    }
}

/// Every storage type, in a fixed order.
pub const QUANT_TYPES: [QuantType; 8] = [
    QuantType::Q8_0,
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q5_0,
    QuantType::Q4K,
    QuantType::Q5K,
    QuantType::Q6K,
    QuantType::Fp8E4M3,
];

/// The entry-point stem of `q` (`qgemv_<stem>_t..`, `qgather_<stem>_bf16`).
pub fn stem(q: QuantType) -> &'static str {
    match q {
        QuantType::Q8_0 => "q8_0",
        QuantType::Q4_0 => "q4_0",
        QuantType::Q4_1 => "q4_1",
        QuantType::Q5_0 => "q5_0",
        QuantType::Q4K => "q4k",
        QuantType::Q5K => "q5k",
        QuantType::Q6K => "q6k",
        QuantType::Fp8E4M3 => "fp8",
    }
}

/// Why a quantized weight cannot be repacked or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("{q:?} weight [{n}, {k}]: K must be a positive multiple of {multiple} (the {q:?} block and the kernels' 16-byte vector); pad K or keep this weight bf16")]
    BadK {
        q: QuantType,
        n: u64,
        k: u64,
        multiple: u64,
    },
    #[error("{q:?} weight [{n}, {k}] has no rows")]
    NoRows { q: QuantType, n: u64, k: u64 },
    #[error("{q:?} weight [{n}, {k}] must be {expected} bytes, got {got}: the data is truncated or its type or shape is wrong")]
    WrongLength {
        q: QuantType,
        n: u64,
        k: u64,
        expected: u64,
        got: u64,
    },
    #[error("FP8 weight [{n}, {k}] holds the e4m3 NaN code at row {row}, column {col}: the checkpoint is corrupt (re-export it)")]
    Fp8Nan { n: u64, k: u64, row: u64, col: u64 },
    #[error("FP8 weight [{n}, {k}] needs its {n} per-row f32 scales, got {got}")]
    Fp8Scales { n: u64, k: u64, got: u64 },
}

/// The K multiple `q` requires: its block, and 16 for FP8's vectors.
pub fn k_multiple(q: QuantType) -> u64 {
    q.k_multiple()
}

/// Where the regions of a repacked `[n, k]` weight lie (the arithmetic is
/// `kiln_ir::QuantType::gpu_layout`, which the planner and the plan
/// validator size weight buffers with).
pub type QLayout = kiln_ir::QuantLayout;

/// The repacked layout of an `[n, k]` weight of `q` (see the module doc).
pub fn layout(q: QuantType, n: u64, k: u64) -> Result<QLayout, QuantError> {
    let multiple = k_multiple(q);
    if k == 0 || !k.is_multiple_of(multiple) {
        return Err(QuantError::BadK { q, n, k, multiple });
    }
    if n == 0 {
        return Err(QuantError::NoRows { q, n, k });
    }
    q.gpu_layout(n, k)
        .ok_or(QuantError::BadK { q, n, k, multiple })
}

/// Bytes of the repacked `[n, k]` weight (what the planner allocates).
pub fn repacked_bytes(q: QuantType, n: u64, k: u64) -> Result<u64, QuantError> {
    layout(q, n, k).map(|l| l.total)
}

fn check_src(q: QuantType, src: &[u8], n: u64, k: u64) -> Result<QLayout, QuantError> {
    let l = layout(q, n, k)?;
    let expected = n * q.row(k);
    if src.len() as u64 != expected {
        return Err(QuantError::WrongLength {
            q,
            n,
            k,
            expected,
            got: src.len() as u64,
        });
    }
    Ok(l)
}

/// Scale and min `j` (0..8) of the K-quants' 12 packed 6-bit bytes.
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Converts `n` rows of `k` weights from the stored layout (GGUF blocks in
/// ggml's byte order; FP8: `[n][k]` e4m3 bytes) into the layout the kernels
/// read. Refuses a K that is not a whole number of blocks, a wrong length,
/// and FP8 NaN codes.
pub fn repack(q: QuantType, src: &[u8], n: u64, k: u64) -> Result<Vec<u8>, QuantError> {
    let l = check_src(q, src, n, k)?;
    let mut out = vec![0u8; l.total as usize];
    let bb = q.bytes() as usize;
    let (ku, nvu) = (k as usize, (k / 32) as usize);
    let [o1, o2, o3] = l.offsets.map(|o| o as usize);
    let put = |out: &mut Vec<u8>, at: usize, bytes: &[u8]| {
        out[at..at + bytes.len()].copy_from_slice(bytes);
    };
    if q == QuantType::Fp8E4M3 {
        if let Some(i) = src.iter().position(|&b| b & 0x7f == 0x7f) {
            return Err(QuantError::Fp8Nan {
                n,
                k,
                row: i as u64 / k,
                col: i as u64 % k,
            });
        }
        out[..src.len()].copy_from_slice(src);
        return Ok(out);
    }
    for row in 0..n as usize {
        let rsrc = &src[row * (q.row(k) as usize)..(row + 1) * (q.row(k) as usize)];
        for (b, blk) in rsrc.chunks_exact(bb).enumerate() {
            match q {
                QuantType::Q8_0 => {
                    put(&mut out, row * ku + 32 * b, &blk[2..34]);
                    put(&mut out, o1 + (row * nvu + b) * 2, &blk[0..2]);
                }
                QuantType::Q4_0 => {
                    put(&mut out, (row * nvu + b) * 16, &blk[2..18]);
                    put(&mut out, o1 + (row * nvu + b) * 2, &blk[0..2]);
                }
                QuantType::Q4_1 => {
                    put(&mut out, (row * nvu + b) * 16, &blk[4..20]);
                    put(&mut out, o1 + (row * nvu + b) * 4, &blk[0..4]);
                }
                QuantType::Q5_0 => {
                    put(&mut out, (row * nvu + b) * 16, &blk[6..22]);
                    put(&mut out, o1 + (row * nvu + b) * 2, &blk[0..2]);
                    put(&mut out, o2 + (row * nvu + b) * 4, &blk[2..6]);
                }
                QuantType::Q4K | QuantType::Q5K => {
                    let five = q == QuantType::Q5K;
                    let (qh, qs) = if five {
                        (&blk[16..48], &blk[48..176])
                    } else {
                        (&blk[0..0], &blk[16..144])
                    };
                    let v0 = row * nvu + 8 * b; // first vector of this super-block
                    put(&mut out, v0 * 16, qs);
                    put(&mut out, o1 + (row * (ku / 256) + b) * 4, &blk[0..4]);
                    for ch in 0..4 {
                        let (sa, ma) = scale_min_k4(2 * ch, &blk[4..16]);
                        let (sb, mb) = scale_min_k4(2 * ch + 1, &blk[4..16]);
                        put(
                            &mut out,
                            o2 + (row * (ku / 64) + 4 * b + ch) * 4,
                            &[sa, ma, sb, mb],
                        );
                    }
                    if five {
                        for v in 0..8 {
                            let (ch, h) = (v / 2, v % 2);
                            let mut bits = 0u32;
                            for i in 0..16 {
                                let byte = qh[16 * h + i];
                                bits |= u32::from((byte >> (2 * ch)) & 1) << i;
                                bits |= u32::from((byte >> (2 * ch + 1)) & 1) << (16 + i);
                            }
                            put(&mut out, o3 + (v0 + v) * 4, &bits.to_le_bytes());
                        }
                    }
                }
                QuantType::Q6K => {
                    let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
                    // The 6-bit codes in element order (ggml's dequantize_row_q6_K).
                    let mut code = [0u8; 256];
                    for half in 0..2 {
                        let (ql, qh) = (&ql[64 * half..], &qh[32 * half..]);
                        for l in 0..32 {
                            let e = 128 * half + l;
                            code[e] = (ql[l] & 0x0f) | ((qh[l] & 3) << 4);
                            code[e + 32] = (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4);
                            code[e + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                            code[e + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                        }
                    }
                    let v0 = row * nvu + 8 * b;
                    put(&mut out, o1 + (row * (ku / 256) + b) * 2, &blk[208..210]);
                    for v in 0..8 {
                        let a0 = 64 * (v / 2) + 16 * (v % 2);
                        let mut bytes = [0u8; 16];
                        let (mut ha, mut hb) = (0u32, 0u32);
                        for i in 0..16 {
                            let (ca, cb) = (code[a0 + i], code[a0 + 32 + i]);
                            bytes[i] = (ca & 0x0f) | ((cb & 0x0f) << 4);
                            ha |= u32::from(ca >> 4) << (2 * i);
                            hb |= u32::from(cb >> 4) << (2 * i);
                        }
                        put(&mut out, (v0 + v) * 16, &bytes);
                        put(
                            &mut out,
                            o2 + (v0 + v) * 2,
                            &[sc[a0 / 16], sc[(a0 + 32) / 16]],
                        );
                        let mut h = [0u8; 8];
                        h[..4].copy_from_slice(&ha.to_le_bytes());
                        h[4..].copy_from_slice(&hb.to_le_bytes());
                        put(&mut out, o3 + (v0 + v) * 8, &h);
                    }
                }
                QuantType::Fp8E4M3 => unreachable!("FP8 returned above"),
            }
        }
    }
    Ok(out)
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// e4m3 (bias 7, no infinities) as f32; `None` for the NaN codes.
pub fn e4m3_to_f32(b: u8) -> Option<f32> {
    if b & 0x7f == 0x7f {
        return None;
    }
    let bits = (u32::from(b & 0x7f) << 20) | (u32::from(b & 0x80) << 24);
    Some(f32::from_bits(bits) * 2f32.powi(120))
}

/// Decodes a repacked `[n, k]` weight to f32 with the reference
/// dequantizer's arithmetic for each type (so the result equals GGUF's own
/// decoding of the original blocks bitwise). FP8 multiplies each row by
/// `row_scale[row]` (required for FP8, ignored otherwise).
pub fn dequantize_repacked(
    q: QuantType,
    data: &[u8],
    row_scale: Option<&[f32]>,
    n: u64,
    k: u64,
) -> Result<Vec<f32>, QuantError> {
    let l = layout(q, n, k)?;
    if data.len() as u64 != l.total {
        return Err(QuantError::WrongLength {
            q,
            n,
            k,
            expected: l.total,
            got: data.len() as u64,
        });
    }
    let (nu, ku, nvu) = (n as usize, k as usize, (k / 32) as usize);
    let [o1, o2, o3] = l.offsets.map(|o| o as usize);
    let mut y = vec![0f32; nu * ku];
    let u32_at =
        |at: usize| u32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]);
    if q == QuantType::Fp8E4M3 {
        let s = row_scale
            .filter(|s| s.len() == nu)
            .ok_or(QuantError::Fp8Scales {
                n,
                k,
                got: row_scale.map_or(0, |s| s.len() as u64),
            })?;
        for (i, (o, &b)) in y.iter_mut().zip(&data[..nu * ku]).enumerate() {
            let v = e4m3_to_f32(b).ok_or(QuantError::Fp8Nan {
                n,
                k,
                row: (i / ku) as u64,
                col: (i % ku) as u64,
            })?;
            *o = v * s[i / ku];
        }
        return Ok(y);
    }
    for row in 0..nu {
        let yr = &mut y[row * ku..(row + 1) * ku];
        if q == QuantType::Q8_0 {
            for (e, o) in yr.iter_mut().enumerate() {
                let d = f16_at(data, o1 + (row * nvu + e / 32) * 2);
                *o = f32::from(data[row * ku + e] as i8) * d;
            }
            continue;
        }
        for v in 0..nvu {
            let gv = row * nvu + v;
            let qs = &data[gv * 16..gv * 16 + 16];
            let kq = matches!(q, QuantType::Q4K | QuantType::Q5K | QuantType::Q6K);
            let (a0, gap) = if kq {
                (64 * (v / 2) + 16 * (v % 2), 32)
            } else {
                (32 * v, 16)
            };
            for i in 0..16 {
                let (mut ca, mut cb) = (u32::from(qs[i] & 0x0f), u32::from(qs[i] >> 4));
                let (ya, yb) = match q {
                    QuantType::Q4_0 => {
                        let d = f16_at(data, o1 + gv * 2);
                        ((ca as i32 - 8) as f32 * d, (cb as i32 - 8) as f32 * d)
                    }
                    QuantType::Q4_1 => {
                        let (d, m) = (f16_at(data, o1 + gv * 4), f16_at(data, o1 + gv * 4 + 2));
                        (ca as f32 * d + m, cb as f32 * d + m)
                    }
                    QuantType::Q5_0 => {
                        let d = f16_at(data, o1 + gv * 2);
                        let qh = u32_at(o2 + gv * 4);
                        ca |= ((qh >> i) & 1) << 4;
                        cb |= ((qh >> (16 + i)) & 1) << 4;
                        // The reference adds a zero min: -0 becomes +0 alike.
                        (
                            (ca as i32 - 16) as f32 * d + 0.0,
                            (cb as i32 - 16) as f32 * d + 0.0,
                        )
                    }
                    QuantType::Q4K | QuantType::Q5K => {
                        let sbi = row * (ku / 256) + v / 8;
                        let (d, dmin) =
                            (f16_at(data, o1 + sbi * 4), f16_at(data, o1 + sbi * 4 + 2));
                        let s = &data[o2 + (row * (ku / 64) + v / 2) * 4..][..4];
                        if q == QuantType::Q5K {
                            let qh = u32_at(o3 + gv * 4);
                            ca |= ((qh >> i) & 1) << 4;
                            cb |= ((qh >> (16 + i)) & 1) << 4;
                        }
                        let (dla, mla) = (d * f32::from(s[0]), dmin * f32::from(s[1]));
                        let (dlb, mlb) = (d * f32::from(s[2]), dmin * f32::from(s[3]));
                        (dla * ca as f32 - mla, dlb * cb as f32 - mlb)
                    }
                    QuantType::Q6K => {
                        let d = f16_at(data, o1 + (row * (ku / 256) + v / 8) * 2);
                        let (sa, sb) = (data[o2 + gv * 2] as i8, data[o2 + gv * 2 + 1] as i8);
                        let (ha, hb) = (u32_at(o3 + gv * 8), u32_at(o3 + gv * 8 + 4));
                        ca |= ((ha >> (2 * i)) & 3) << 4;
                        cb |= ((hb >> (2 * i)) & 3) << 4;
                        (
                            d * f32::from(sa) * (ca as i32 - 32) as f32,
                            d * f32::from(sb) * (cb as i32 - 32) as f32,
                        )
                    }
                    QuantType::Q8_0 | QuantType::Fp8E4M3 => unreachable!("handled above"),
                };
                yr[a0 + i] = ya;
                yr[a0 + gap + i] = yb;
            }
        }
    }
    Ok(y)
}

// ------------------------------------------------------------- lowering

/// Token counts the quantized GEMV is instantiated for.
pub const QGEMV_TOKENS: [u32; 4] = [1, 2, 4, 8];
/// Weight rows per block of the quantized GEMV (8 warps x 2 rows).
pub const QGEMV_ROWS_PER_BLOCK: u32 = 16;
/// Threads per block of the quantized GEMV and gather.
pub const QGEMV_THREADS: u32 = 256;
/// The kernel catalog's module name.
pub const MODULE: &str = "qgemv";
/// The longest row the integer-dot GEMV quantizes x for (its shared-memory
/// copy of the token row, `KILN_QD_MAXK` in `qgemv.cu`).
pub const QDOT_MAX_K: u64 = 16384;
/// Weight rows per block of the integer-dot GEMV (8 warps x 4 rows).
pub const QDOT_ROWS_PER_BLOCK: u32 = 32;
/// The types the integer-dot GEMV is instantiated for.
pub const QDOT_TYPES: [QuantType; 3] = [QuantType::Q4K, QuantType::Q6K, QuantType::Q8_0];

/// Which of the `qgemv` module's GEMV kernels a lowering emits.
///
/// `Float` decodes every weight code to f32 and multiplies it by x as
/// stored (`qgemv_<type>_..`); `Int8Dot` quantizes the one token row to int8
/// per 32 elements, as the CPU backend's quantized matmul does, and
/// multiplies codes by codes with dp4a (`qgemv_i8_<type>_..`): at one token
/// the float kernel is bound by its instruction stream rather than by the
/// weight bytes. The int8 kernel's error bound is x's rounding (at most
/// max|x_g| / 254 per element of each 32-group g) times |w|, which is what
/// the CPU backend's quantized plans already accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QGemvKernel {
    Float,
    /// The integer-dot kernel in the geometry [`QdotGeom::for_shape`]
    /// picks for the launch's shape.
    Int8Dot,
    /// The integer-dot kernel in one given geometry (tests, A/B runs).
    Int8DotAt(QdotGeom),
}

/// The geometry of the integer-dot GEMV (`qdot_rows`' template parameters
/// in `qgemv.cu`): `rows` weight rows per warp, `unroll` 16-byte vectors
/// per row in flight per lane, `split_k` warps sharing each row's vectors
/// (their partial sums added in a fixed order in shared memory), and
/// `pipelined`: the next vectors' loads issued before the current ones are
/// multiplied (twice the registers for weights, so fewer rows per warp).
///
/// Why a choice: a block is 8 warps and quantizes x itself before its
/// first product, so a GEMV with few rows (Llama-3-8B's o and down: 4096
/// rows, 128 blocks of the plain geometry on a 132-SM part) runs one block
/// per SM with one batch of loads in flight per warp; splitting K or
/// pipelining keeps more bytes in flight there, while a GEMV with many
/// blocks (gate_up, lm_head) already does. The rule is
/// [`QdotGeom::for_shape`]; every geometry is instantiated for every
/// integer-dot entry ([`QDOT_GEOMS`], the same list as the kernel's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QdotGeom {
    pub rows: u32,
    pub unroll: u32,
    pub split_k: u32,
    pub pipelined: bool,
}

impl QdotGeom {
    /// The geometry the integer-dot kernel was first written with.
    pub const PLAIN: QdotGeom = QdotGeom {
        rows: 4,
        unroll: 2,
        split_k: 1,
        pipelined: false,
    };

    /// The entry-name tag: empty for [`QdotGeom::PLAIN`], else
    /// `_r<rows>u<unroll>k<split_k>` with `p` when pipelined.
    pub fn tag(self) -> String {
        if self == QdotGeom::PLAIN {
            String::new()
        } else {
            format!(
                "_r{}u{}k{}{}",
                self.rows,
                self.unroll,
                self.split_k,
                if self.pipelined { "p" } else { "" }
            )
        }
    }

    /// Weight rows one block covers (8 warps).
    pub fn rows_per_block(self) -> u64 {
        (8 / self.split_k as u64) * self.rows as u64
    }

    /// The geometry named by `tag` (as [`QdotGeom::tag`] writes it, or
    /// `plain`), among [`QDOT_GEOMS`].
    pub fn from_tag(tag: &str) -> Option<QdotGeom> {
        let tag = tag.trim();
        if tag == "plain" || tag.is_empty() {
            return Some(QdotGeom::PLAIN);
        }
        QDOT_GEOMS
            .into_iter()
            .find(|g| g.tag().trim_start_matches('_') == tag.trim_start_matches('_'))
    }

    /// The geometry a plan records for a GEMV of `n` weight rows and rows
    /// of `k`: `KILN_QDOT_GEOM` (a [`QdotGeom::tag`], `plain`, or `auto`
    /// for [`QdotGeom::by_blocks`]) as the plan is compiled overrides the
    /// rule, for A/B runs; a value that names no geometry is refused (a
    /// typo must not turn an A/B run into a comparison of the rule with
    /// itself).
    pub fn for_shape(n: u64, k: u64) -> Result<QdotGeom, String> {
        Self::for_shape_with(std::env::var("KILN_QDOT_GEOM").ok().as_deref(), n, k)
    }

    /// Whether `KILN_QDOT_GEOM`, when set, names a geometry (the refusal
    /// [`QdotGeom::for_shape`] would give), for a compiler to check once
    /// before any work.
    pub fn check_override() -> Result<(), String> {
        Self::for_shape(1, 1).map(|_| ())
    }

    /// [`QdotGeom::for_shape`] with the override given.
    pub fn for_shape_with(over: Option<&str>, n: u64, k: u64) -> Result<QdotGeom, String> {
        match over.map(str::trim) {
            None | Some("") => Ok(Self::rule(n, k)),
            Some("auto") => Ok(Self::by_blocks(n, k)),
            Some(t) => QdotGeom::from_tag(t).ok_or_else(|| {
                let known: Vec<String> = QDOT_GEOMS
                    .iter()
                    .skip(1)
                    .map(|g| g.tag().trim_start_matches('_').to_string())
                    .collect();
                format!(
                    "KILN_QDOT_GEOM={t} names no integer-dot geometry; \
                     set it to plain, auto or one of {} (or unset it for the rule)",
                    known.join(", ")
                )
            }),
        }
    }

    /// [`QdotGeom::for_shape`] without the override: [`QdotGeom::by_blocks`]
    /// (`KILN_QDOT_GEOM=plain` compiles the plain geometry everywhere, for
    /// comparison).
    pub fn rule(n: u64, k: u64) -> QdotGeom {
        Self::by_blocks(n, k)
    }

    /// The block-count rule, from the harness on the H200 and the H100
    /// (session 24, bench/results/gpu-2026-12-06-s24, where the plans it
    /// writes run Qwen3-0.6B Q4_K 10% and Llama-3-8B Q4_K 5% faster than
    /// the plain geometry's): the plain geometry where it makes
    /// two blocks per SM of a 132-SM part or more (gate_up, lm_head);
    /// below that, two rows per warp with pipelined loads (twice the
    /// blocks) for rows of 2048 or more (Llama-3-8B o and down, Qwen3-0.6B
    /// o and down), and one vector in flight per row of four, pipelined,
    /// for short rows or between one and two waves (Llama-3-8B qkv,
    /// Qwen3-0.6B qkv and gate_up).
    pub fn by_blocks(n: u64, k: u64) -> QdotGeom {
        const SMS: u64 = 132;
        let blocks = n.div_ceil(QdotGeom::PLAIN.rows_per_block());
        if blocks >= 2 * SMS {
            QdotGeom::PLAIN
        } else if blocks < SMS && k >= 2048 {
            QdotGeom::R2U2K1P
        } else {
            QdotGeom::R4U1K1P
        }
    }

    /// Two rows per warp, pipelined (twice the plain blocks).
    pub const R2U2K1P: QdotGeom = QdotGeom {
        rows: 2,
        unroll: 2,
        split_k: 1,
        pipelined: true,
    };

    /// Four rows per warp, one vector each in flight, pipelined.
    pub const R4U1K1P: QdotGeom = QdotGeom {
        rows: 4,
        unroll: 1,
        split_k: 1,
        pipelined: true,
    };
}

/// Every geometry the integer-dot entries are instantiated in (the list
/// `KILN_QDOT` expands in `qgemv.cu`).
pub const QDOT_GEOMS: [QdotGeom; 5] = [
    QdotGeom::PLAIN,
    QdotGeom {
        rows: 4,
        unroll: 2,
        split_k: 2,
        pipelined: false,
    },
    QdotGeom::R2U2K1P,
    QdotGeom {
        rows: 2,
        unroll: 2,
        split_k: 2,
        pipelined: true,
    },
    QdotGeom::R4U1K1P,
];

impl QGemvKernel {
    /// Whether the integer-dot kernel exists for a `t`-token GEMV of a `q`
    /// weight with rows of `k`: one token, Q4_K, Q6_K or Q8_0, `k <=`
    /// [`QDOT_MAX_K`].
    pub fn int8_dot_exists(q: QuantType, t: u64, k: u64) -> bool {
        t == 1 && k <= QDOT_MAX_K && QDOT_TYPES.contains(&q)
    }

    /// The kernel a plan records: [`QGemvKernel::choose_with`], enabled
    /// unless `KILN_QGEMV_I8=0` is set as the plan is compiled (the float
    /// kernel for an A/B comparison). On by default since its device tests
    /// passed and it measured faster on the H200: Llama-3-8B Q4_K b1 3.251
    /// -> 2.717 ms, Qwen3-0.6B Q4_K b1 1.013 -> 1.000 ms
    /// (bench/results/gpu-2026-12-04-s16/).
    pub fn choose(q: QuantType, t: u64, k: u64, cuda: bool) -> QGemvKernel {
        let on = std::env::var("KILN_QGEMV_I8").map_or(true, |v| v != "0");
        Self::choose_with(q, t, k, cuda, on)
    }

    /// [`QGemvKernel::Int8Dot`] when `enabled`, where it exists and the
    /// target has a 4-way byte dot product in hardware (`dp4a`, CUDA sm_61
    /// and later: every CUDA target kiln compiles for); `Float` on HIP (the
    /// kernel's portable path there is correct, not fast) and for every
    /// other shape.
    pub fn choose_with(q: QuantType, t: u64, k: u64, cuda: bool, enabled: bool) -> QGemvKernel {
        if cuda && enabled && Self::int8_dot_exists(q, t, k) {
            QGemvKernel::Int8Dot
        } else {
            QGemvKernel::Float
        }
    }

    /// The kernel with its geometry fixed for a GEMV of `n` rows of `k`
    /// (the error: an override naming no geometry).
    fn resolve(self, n: u64, k: u64) -> Result<QGemvKernel, String> {
        Ok(match self {
            QGemvKernel::Int8Dot => QGemvKernel::Int8DotAt(QdotGeom::for_shape(n, k)?),
            other => other,
        })
    }

    fn is_int8(self) -> bool {
        !matches!(self, QGemvKernel::Float)
    }

    fn prefix(self) -> String {
        match self {
            QGemvKernel::Float => "qgemv".into(),
            QGemvKernel::Int8Dot => "qgemv_i8".into(),
            QGemvKernel::Int8DotAt(g) => format!("qgemv_i8{}", g.tag()),
        }
    }

    fn rows_per_block(self) -> u64 {
        match self {
            QGemvKernel::Float => QGEMV_ROWS_PER_BLOCK as u64,
            QGemvKernel::Int8Dot => QDOT_ROWS_PER_BLOCK as u64,
            QGemvKernel::Int8DotAt(g) => g.rows_per_block(),
        }
    }
}

/// Every entry point of the `qgemv` module.
pub fn entry_points() -> Vec<String> {
    let mut v = Vec::new();
    for q in QUANT_TYPES {
        for o in ["bf16", "f32"] {
            for tt in QGEMV_TOKENS {
                v.push(format!("qgemv_{}_t{tt}_bf16_{o}", stem(q)));
            }
        }
        for tt in QGEMV_TOKENS {
            v.push(format!("qgemv_fused_{}_t{tt}_bf16_bf16", stem(q)));
            for o in ["bf16", "f32"] {
                v.push(format!("qgemv_fused_norm_{}_t{tt}_bf16_{o}", stem(q)));
            }
        }
        v.push(format!("qgather_{}_bf16", stem(q)));
    }
    for g in QDOT_GEOMS {
        let p = format!("qgemv_i8{}", g.tag());
        for q in QDOT_TYPES {
            for o in ["bf16", "f32"] {
                v.push(format!("{p}_{}_t1_bf16_{o}", stem(q)));
                v.push(format!("{p}_fused_norm_{}_t1_bf16_{o}", stem(q)));
            }
            v.push(format!("{p}_fused_{}_t1_bf16_bf16", stem(q)));
            v.push(format!("{p}_rope_{}_t1_bf16_bf16", stem(q)));
            v.push(format!("{p}_rope_norm_{}_t1_bf16_bf16", stem(q)));
        }
    }
    v
}

/// Why a quantized GEMV or gather cannot be lowered.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QLowerError {
    #[error("quantized {op} of a [{n}, {k}] {q:?} weight: {why}")]
    Unsupported {
        op: &'static str,
        q: QuantType,
        n: u64,
        k: u64,
        why: String,
    },
}

/// The buffers of one quantized GEMV `out[t, n] = x[t, k] . W[n, k] (+ bias)
/// (+ residual)`: `x` bf16 `[t, k]`, `w` the repacked weight, `scale` the
/// FP8 per-row f32 scales (FP8 only), `bias` bf16 `[n]`, `residual` bf16
/// `[t, n]`, `out` `[t, n]` of the output dtype.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QGemvBufs {
    pub x: BufRef,
    pub w: BufRef,
    pub scale: Option<BufRef>,
    pub bias: Option<BufRef>,
    pub residual: Option<BufRef>,
    pub out: BufRef,
}

fn offset_by(b: BufRef, bytes: u64) -> BufRef {
    BufRef {
        region: b.region,
        offset: b.offset + bytes,
        bytes: b.bytes.saturating_sub(bytes),
    }
}

/// What both quantized GEMM kernels require of their operands, checked
/// once: the layout, the output suffix, and N, K as i32.
struct GemmChecked {
    layout: QLayout,
    os: &'static str,
    osz: u64,
    n32: i32,
    k32: i32,
}

impl GemmChecked {
    /// The parameters both kernels take (they share one signature) for the
    /// launch of tokens `[t0, t0 + tokens)`.
    fn params(
        &self,
        bufs: &QGemvBufs,
        n: u64,
        k: u64,
        t0: u64,
        tokens: u64,
        w_const: bool,
    ) -> Vec<LaunchParam> {
        let opt = |b: Option<BufRef>| b.map_or(LaunchParam::Null, LaunchParam::Buf);
        let [o1, o2, o3] = self.layout.offsets.map(|o| LaunchParam::I64(o as i64));
        vec![
            LaunchParam::Buf(offset_by(bufs.x, t0 * k * 2)),
            LaunchParam::Buf(bufs.w),
            opt(bufs.scale),
            opt(bufs.bias),
            opt(bufs.residual.map(|r| offset_by(r, t0 * n * 2))),
            LaunchParam::Buf(offset_by(bufs.out, t0 * n * self.osz)),
            LaunchParam::I32(tokens as i32),
            LaunchParam::I32(self.n32),
            LaunchParam::I32(self.k32),
            LaunchParam::I32(w_const as i32),
            o1,
            o2,
            o3,
        ]
    }
}

/// Refuses the integer-dot kernel where it does not exist.
fn check_kernel(
    kern: QGemvKernel,
    q: QuantType,
    n: u64,
    k: u64,
    t: u64,
    op: &'static str,
) -> Result<(), QLowerError> {
    if kern.is_int8() && !QGemvKernel::int8_dot_exists(q, t, k) {
        return Err(QLowerError::Unsupported {
            op,
            q,
            n,
            k,
            why: format!(
                "the integer-dot GEMV takes one token of a Q4_K, Q6_K or Q8_0 weight with K <= {QDOT_MAX_K} (got {t} tokens); lower it with the float kernel"
            ),
        });
    }
    Ok(())
}

fn check_gemm(
    q: QuantType,
    n: u64,
    k: u64,
    t: u64,
    out: DType,
    bufs: &QGemvBufs,
) -> Result<GemmChecked, QLowerError> {
    check_gemm_as("matmul", q, (n, k, n), t, out, bufs)
}

/// [`check_gemm`] for `op`, whose result has `out_n` columns (`n / 2`
/// under an activation epilogue).
fn check_gemm_as(
    op: &'static str,
    q: QuantType,
    (n, k, out_n): (u64, u64, u64),
    t: u64,
    out: DType,
    bufs: &QGemvBufs,
) -> Result<GemmChecked, QLowerError> {
    let refuse = |why: String| QLowerError::Unsupported { op, q, n, k, why };
    let l = layout(q, n, k).map_err(|e| refuse(e.to_string()))?;
    let os = match out {
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        d => return Err(refuse(format!("the output must be bf16 or f32, got {d}"))),
    };
    if t == 0 {
        return Err(refuse("no tokens".into()));
    }
    let n32 = i32::try_from(n).map_err(|_| refuse("N exceeds the 32-bit index range".into()))?;
    let k32 = i32::try_from(k).map_err(|_| refuse("K exceeds the 32-bit index range".into()))?;
    if n.checked_mul(k).is_none_or(|nk| nk > i64::MAX as u64 / 2) {
        return Err(refuse("N*K exceeds the 64-bit byte range".into()));
    }
    let osz = out.size() as u64;
    let need = |what: &str, b: Option<BufRef>, bytes: u64| -> Result<(), QLowerError> {
        match b {
            Some(b) if b.bytes < bytes => Err(refuse(format!(
                "{what} needs {bytes} bytes but its buffer has {}",
                b.bytes
            ))),
            Some(b) if !b.offset.is_multiple_of(16) => Err(refuse(format!(
                "{what} must be 16-byte aligned (offset {})",
                b.offset
            ))),
            _ => Ok(()),
        }
    };
    need("x", Some(bufs.x), t * k * 2)?;
    need("the repacked weight", Some(bufs.w), l.total)?;
    need("out", Some(bufs.out), t * out_n * osz)?;
    need("bias", bufs.bias, n * 2)?;
    need("the residual", bufs.residual, t * n * 2)?;
    match (q == QuantType::Fp8E4M3, bufs.scale) {
        (true, None) => return Err(refuse("FP8 needs its per-row f32 scales".into())),
        (false, Some(_)) => {
            return Err(refuse(
                "only FP8 weights take a per-row scale operand".into(),
            ))
        }
        (true, s) => need("the FP8 scales", s, n * 4)?,
        (false, None) => {}
    }
    Ok(GemmChecked {
        layout: l,
        os,
        osz,
        n32,
        k32,
    })
}

/// The launches of a quantized GEMV over `t` tokens (x bf16; `out` bf16 or
/// f32): one launch of the `TT`-token kernel for `t <= 8`, and one launch
/// of the 8-token kernel per 8 tokens above (each re-reads the weights).
/// `w_const`: `w` is a weight (never written during a step), so the kernel
/// may start loading it before its dependency wait; `pdl`: the target's
/// programmatic-dependent-launch flag ([`crate::gpu::LowerOptions::pdl`]).
///
/// Refuses (naming the limit) K that is not a whole number of the type's
/// blocks, sizes beyond the 32-bit index range, buffers smaller than the
/// shapes need, an FP8 weight without its scales (or scales on another
/// type), and operands that are not 16-byte aligned.
///
/// How `lower_op` calls it once the quantized matmul op exists (operands
/// x, w, [scale], [bias]; `weight_args & 2`: w is a weight):
///
/// ```
/// use kiln_ir::plan::{BufRef, Region};
/// use kiln_kernels::quant_gpu::{lower_qgemv, repacked_bytes, QGemvBufs, QuantType};
/// let buf = |offset, bytes| BufRef { region: Region::Arena, offset, bytes };
/// let (t, n, k) = (1u64, 4096u64, 4096u64);
/// let w = repacked_bytes(QuantType::Q4K, n, k).unwrap();
/// let bufs = QGemvBufs {
///     x: buf(0, t * k * 2),
///     w: BufRef { region: Region::Weight(3), offset: 0, bytes: w },
///     scale: None,
///     bias: None,
///     residual: None,
///     out: buf(1 << 20, t * n * 2),
/// };
/// let launches =
///     lower_qgemv(QuantType::Q4K, n, k, t, kiln_ir::DType::BF16, &bufs, true, true).unwrap();
/// assert_eq!(launches.len(), 1);
/// assert_eq!(launches[0].entry, "qgemv_q4k_t1_bf16_bf16");
/// ```
#[allow(clippy::too_many_arguments)]
pub fn lower_qgemv(
    q: QuantType,
    n: u64,
    k: u64,
    t: u64,
    out: DType,
    bufs: &QGemvBufs,
    w_const: bool,
    pdl: bool,
) -> Result<Vec<KernelLaunch>, QLowerError> {
    lower_qgemv_with(QGemvKernel::Float, q, n, k, t, out, bufs, w_const, pdl)
}

/// [`lower_qgemv`] on the chosen kernel ([`QGemvKernel::choose`]); the
/// integer-dot kernel is refused (naming the limit) where it does not
/// exist.
#[allow(clippy::too_many_arguments)]
pub fn lower_qgemv_with(
    kern: QGemvKernel,
    q: QuantType,
    n: u64,
    k: u64,
    t: u64,
    out: DType,
    bufs: &QGemvBufs,
    w_const: bool,
    pdl: bool,
) -> Result<Vec<KernelLaunch>, QLowerError> {
    let refuse = |why: String| QLowerError::Unsupported {
        op: "matmul",
        q,
        n,
        k,
        why,
    };
    let c = check_gemm(q, n, k, t, out, bufs)?;
    check_kernel(kern, q, n, k, t, "matmul")?;
    let kern = kern.resolve(n, k).map_err(refuse)?;
    let os = c.os;
    let grid = n.div_ceil(kern.rows_per_block());
    let grid = u32::try_from(grid).map_err(|_| refuse("too many rows for one grid".into()))?;
    let mut launches = Vec::new();
    let mut t0 = 0u64;
    while t0 < t {
        let tokens = (t - t0).min(8);
        let tt = QGEMV_TOKENS
            .into_iter()
            .find(|&tt| tt as u64 >= tokens)
            .expect("tokens <= 8");
        launches.push(KernelLaunch {
            module: MODULE.into(),
            entry: format!("{}_{}_t{tt}_bf16_{os}", kern.prefix(), stem(q)),
            grid: [grid, 1, 1],
            block: [QGEMV_THREADS, 1, 1],
            shared_bytes: 0,
            cluster: 1,
            params: c.params(bufs, n, k, t0, tokens, w_const),
            pdl,
        });
        t0 += tokens;
    }
    Ok(launches)
}

/// The quantized skinny GEMM's module (`kernels/gpu/qskinny.cu`).
pub const QSKINNY_MODULE: &str = "qskinny";
/// Padded token counts (multiples of 8) the quantized skinny GEMM is
/// instantiated for: one launch takes up to 32 tokens.
pub const QSKINNY_TOKENS: [u32; 4] = [8, 16, 24, 32];
/// Row tiles (16 rows each) per block the quantized skinny GEMM takes.
pub const QSKINNY_ROW_TILES: [u32; 2] = [1, 2];

/// The ring-prefetch depths every type's eight-token, one-tile skinny
/// entries are also instantiated for (`qskinny_<type>_t8_r1_pf<d>_..`: `d`
/// units per warp in flight instead of the plain loop's one ahead; see the
/// kernel): FP8 keeps its ring in registers (one vector a unit, no
/// metadata), the others in shared memory filled by cp.async, since their
/// plain loops already sit at the register count that allows two
/// 512-thread blocks per SM.
pub const QSKINNY_PREFETCH: [u32; 3] = [2, 3, 4];

/// The dynamic shared memory a warp's ring slots may take in all, in one
/// block: 48 KiB (what a launch gets without opting in) less 1 KiB, so the
/// static shared memory fits beside it.
pub const QSKINNY_RING_SHARED: u64 = 47 * 1024;

/// Bytes of one shared-memory ring slot of `q` (one unit of a warp's 16
/// rows: the unit's 16-byte code vectors of each row, then its metadata
/// words; the kernel's `QskSlot<Q, 1>`); 0 for FP8, whose ring is
/// registers.
pub fn qskinny_slot_bytes(q: QuantType) -> u64 {
    let (vectors, meta_words) = match q {
        QuantType::Fp8E4M3 => return 0,
        QuantType::Q8_0 => (2, 1),
        QuantType::Q4_0 | QuantType::Q4_1 => (1, 1),
        QuantType::Q5_0 => (1, 2),
        QuantType::Q4K => (2, 2),
        QuantType::Q5K => (2, 4),
        QuantType::Q6K => (2, 6),
    };
    16 * (16 * vectors + 4 * meta_words)
}

/// The ring depth a launch of `warps` warps takes for a requested `depth`:
/// the deepest instantiated depth up to it whose slots fit
/// [`QSKINNY_RING_SHARED`] (Q6_K at 16 warps: 3), or none.
pub fn skinny_ring_depth(q: QuantType, warps: u64, depth: u32) -> Option<u32> {
    QSKINNY_PREFETCH
        .into_iter()
        .rev()
        .filter(|&d| d <= depth)
        .find(|&d| warps * u64::from(d) * qskinny_slot_bytes(q) <= QSKINNY_RING_SHARED)
}

/// The ring depth FP8's eight-token, one-tile launches take by default
/// (H100, Qwen3-4B FP8 b8 step): in the ring's first form depth 2 gave
/// 4.832 ms, 3 4.355 and 4 4.380 against the plain loop's 5.221
/// (bench/results/gpu-2026-12-06-s25/); in the committed form (FP8's own
/// loop, the other types' loop unchanged) depth 3 gave 4.440 against
/// 5.268 in one call, and `cuda_quant` and compute-sanitizer passed on it
/// (bench/results/gpu-2026-12-06-s26/).
pub const QSKINNY_FP8_PREFETCH: u32 = 3;

/// The one ring depth the fused eight-token entries of `q` are
/// instantiated for (`qskinny_fused[_norm]_<type>_t8_r<mt>_pf<d>_..`, every
/// type but FP8): the default depth as [`skinny_ring_depth`] caps it at 16
/// warps' worth of slots (one-tile launches of 16 warps and two-tile
/// launches of 8 take the same shared memory).
pub fn skinny_fused_ring_depth(q: QuantType) -> Option<u32> {
    if q == QuantType::Fp8E4M3 {
        return None;
    }
    QSKINNY_SMEM_PREFETCH.and_then(|d| skinny_ring_depth(q, 16, d))
}

/// The shared-memory ring depth the other types' eight-token, one-tile
/// launches take by default (capped by [`skinny_ring_depth`]). A ring of
/// registers lost on Q4_K (plain 4.891 ms, rings 5.21-5.38 on a Llama-3-8B
/// b8 step, bench/results/gpu-2026-12-06-s25/); the cp.async ring in
/// shared memory won at every depth in one H100 call
/// (bench/results/gpu-2026-12-06-s26/, b8 steps, plain / depth 2 / 3 / 4):
/// Llama-3-8B Q4_K 4.698 / 4.231 / 4.224 / 4.206 ms, Qwen3-0.6B Q4_K 1.391
/// / 1.374 / 1.305 / 1.288 ms, b1 unchanged. Every type, plain / default
/// (call 3): Llama-3-8B Q6_K 6.145 / 5.083 (its plain loop needs 101
/// registers, the ring 64), Qwen3-4B Q8_0 4.141 / 3.843, Qwen3-1.7B Q5_K
/// 2.230 / 2.133, SmolLM2-135M Q5_0 0.902 / 0.887, Llama-3.2-1B Q4_0 and
/// Qwen3-0.6B Q4_1 within 0.3%. `cuda_quant`, memcheck and racecheck
/// passed on every type's ring.
pub const QSKINNY_SMEM_PREFETCH: Option<u32> = Some(4);

/// `q`'s ring depth for eight-token, one-tile launches, overridden by
/// `KILN_QSKINNY_PF` (read at compile time like `KILN_QDOT_GEOM`, an A/B
/// knob): unset or empty is the type's default ([`QSKINNY_FP8_PREFETCH`],
/// [`QSKINNY_SMEM_PREFETCH`]), `0` the plain loop (`None`), otherwise one
/// of [`QSKINNY_PREFETCH`] for every type. A launch takes at most what
/// [`skinny_ring_depth`] allows.
pub fn skinny_prefetch(over: Option<&str>, q: QuantType) -> Result<Option<u32>, String> {
    let d = match over.map(str::trim) {
        None | Some("") => match q {
            QuantType::Fp8E4M3 => Some(QSKINNY_FP8_PREFETCH),
            _ => QSKINNY_SMEM_PREFETCH,
        },
        Some("0") => None,
        Some(v) => match v.parse::<u32>() {
            Ok(d) if QSKINNY_PREFETCH.contains(&d) => Some(d),
            _ => {
                return Err(format!(
                    "KILN_QSKINNY_PF={v} is not a prefetch depth; set it to 2, 3 or 4, \
                     0 for the plain loop, or leave it unset for each type's default \
                     (FP8 3)"
                ))
            }
        },
    };
    Ok(d)
}

/// Every entry point of the `qskinny` module.
pub fn qskinny_entry_points() -> Vec<String> {
    let mut v = Vec::new();
    for q in QUANT_TYPES {
        for o in ["bf16", "f32"] {
            for mt in QSKINNY_ROW_TILES {
                for tp in QSKINNY_TOKENS {
                    v.push(format!("qskinny_{}_t{tp}_r{mt}_bf16_{o}", stem(q)));
                }
            }
        }
        for o in ["bf16", "f32"] {
            for pf in QSKINNY_PREFETCH {
                v.push(format!("qskinny_{}_t8_r1_pf{pf}_bf16_{o}", stem(q)));
            }
        }
        if let Some(d) = skinny_fused_ring_depth(q) {
            let s = stem(q);
            v.push(format!("qskinny_fused_{s}_t8_r2_pf{d}_bf16_bf16"));
            v.push(format!("qskinny_fused_norm_{s}_t8_r1_pf{d}_bf16_bf16"));
            v.push(format!("qskinny_fused_norm_{s}_t8_r2_pf{d}_bf16_bf16"));
            v.push(format!("qskinny_fused_norm_{s}_t8_r1_pf{d}_bf16_f32"));
        }
        for tp in QSKINNY_TOKENS {
            v.push(format!("qskinny_fused_{}_t{tp}_r2_bf16_bf16", stem(q)));
            for o in ["bf16", "f32"] {
                for mt in QSKINNY_ROW_TILES {
                    v.push(format!(
                        "qskinny_fused_norm_{}_t{tp}_r{mt}_bf16_{o}",
                        stem(q)
                    ));
                }
            }
        }
    }
    v
}

/// Weight elements one warp step of the quantized skinny GEMM covers (its
/// "unit", see the kernel's header): Q8_0 and the 32-blocks one block, the
/// K-quants a 64-element chunk, FP8 one 16-byte vector.
pub fn qskinny_unit(q: QuantType) -> u64 {
    match q {
        QuantType::Fp8E4M3 => 16,
        QuantType::Q4K | QuantType::Q5K | QuantType::Q6K => 64,
        QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 => 32,
    }
}

/// The launches of a quantized GEMM over `t` tokens on tensor cores (CUDA
/// sm_80+): one launch of `kernels/gpu/qskinny.cu` per 32 tokens, each
/// reading every weight byte once, with the operands, the refusals and the
/// parameter list of [`lower_qgemv`] (`w_const`, `pdl` as there).
///
/// Geometry per launch of `tokens` tokens (documented in the kernel):
/// * tokens padded to `tp = 8 * ceil(tokens / 8)` (the MMA's 8 columns);
/// * `mt` row tiles of 16 per block: 2 when `tp >= 24` and there are at
///   least 256 such 32-row blocks (x is then re-read half as often and the
///   grid still fills the chip), else 1;
/// * `warps` split K per block: the largest power of two up to 16 / `mt`
///   that still gives every warp two units ([`qskinny_unit`]), at least 1;
/// * dynamic shared memory for the split-K partials:
///   `warps * mt * (tp / 8) * 4 * 32` f32, or more under a unit ring;
/// * eight-token, one-tile launches take the type's default unit ring
///   ([`skinny_prefetch`], [`skinny_ring_depth`]): the `_pf<d>` entry, and
///   for every type but FP8 `warps * d` slots of [`qskinny_slot_bytes`] in
///   the dynamic shared memory.
///
/// ```
/// use kiln_ir::plan::{BufRef, Region};
/// use kiln_kernels::quant_gpu::{lower_qskinny, repacked_bytes, QGemvBufs, QuantType};
/// let buf = |offset, bytes| BufRef { region: Region::Arena, offset, bytes };
/// let (t, n, k) = (8u64, 4096u64, 4096u64);
/// let w = repacked_bytes(QuantType::Q4K, n, k).unwrap();
/// let bufs = QGemvBufs {
///     x: buf(0, t * k * 2),
///     w: BufRef { region: Region::Weight(3), offset: 0, bytes: w },
///     scale: None,
///     bias: None,
///     residual: None,
///     out: buf(1 << 20, t * n * 2),
/// };
/// let launches =
///     lower_qskinny(QuantType::Q4K, n, k, t, kiln_ir::DType::BF16, &bufs, true, true).unwrap();
/// assert_eq!(launches.len(), 1);
/// assert_eq!(launches[0].entry, "qskinny_q4k_t8_r1_pf4_bf16_bf16");
/// assert_eq!((launches[0].grid, launches[0].block), ([256, 1, 1], [512, 1, 1]));
/// assert_eq!(launches[0].shared_bytes, 16 * 4 * 640);
/// ```
#[allow(clippy::too_many_arguments)]
pub fn lower_qskinny(
    q: QuantType,
    n: u64,
    k: u64,
    t: u64,
    out: DType,
    bufs: &QGemvBufs,
    w_const: bool,
    pdl: bool,
) -> Result<Vec<KernelLaunch>, QLowerError> {
    let prefetch = env_prefetch("matmul", q, n, k)?;
    lower_qskinny_with(q, n, k, t, out, bufs, w_const, pdl, prefetch)
}

/// `q`'s ring depth from `KILN_QSKINNY_PF` ([`skinny_prefetch`]), a bad
/// value refused as the lowering of `op` over `[n, k]`.
fn env_prefetch(
    op: &'static str,
    q: QuantType,
    n: u64,
    k: u64,
) -> Result<Option<u32>, QLowerError> {
    skinny_prefetch(std::env::var("KILN_QSKINNY_PF").ok().as_deref(), q)
        .map_err(|why| QLowerError::Unsupported { op, q, n, k, why })
}

/// [`lower_qskinny`] with the ring depth given (`Some(d)`: eight-token,
/// one-tile launches take the `_pf<d'>` entry, `d'` the deepest of
/// [`QSKINNY_PREFETCH`] up to `d` that [`skinny_ring_depth`] allows; other
/// launches are unaffected; `None`: the plain loop) instead of read from
/// `KILN_QSKINNY_PF`.
#[allow(clippy::too_many_arguments)]
pub fn lower_qskinny_with(
    q: QuantType,
    n: u64,
    k: u64,
    t: u64,
    out: DType,
    bufs: &QGemvBufs,
    w_const: bool,
    pdl: bool,
    prefetch: Option<u32>,
) -> Result<Vec<KernelLaunch>, QLowerError> {
    let c = check_gemm(q, n, k, t, out, bufs)?;
    let os = c.os;
    let mut launches = Vec::new();
    let mut t0 = 0u64;
    while t0 < t {
        let tokens = (t - t0).min(32);
        let g = SkinnyGeometry::of(q, "matmul", n, k, tokens, false)?;
        let ring = prefetch
            .filter(|_| g.tp == 8 && g.mt == 1)
            .and_then(|d| skinny_ring_depth(q, g.warps, d));
        let pf = ring.map_or(String::new(), |d| format!("_pf{d}"));
        // A shared-memory ring lives in the dynamic shared memory the
        // partials reuse after it: [warps][depth] slots.
        let shared = ring.map_or(0, |d| g.warps * u64::from(d) * qskinny_slot_bytes(q));
        let shared = g.shared_bytes().max(shared as u32);
        launches.push(KernelLaunch {
            module: QSKINNY_MODULE.into(),
            entry: format!("qskinny_{}_t{}_r{}{pf}_bf16_{os}", stem(q), g.tp, g.mt),
            grid: [g.grid, 1, 1],
            block: [32 * g.warps as u32, 1, 1],
            shared_bytes: shared,
            cluster: 1,
            params: c.params(bufs, n, k, t0, tokens, w_const),
            pdl,
        });
        t0 += tokens;
    }
    Ok(launches)
}

/// The developer override of the skinny GEMM's split-K warps per block
/// (`KILN_QSKINNY_WARPS`, read at compile time like `KILN_QDOT_GEOM`; an
/// A/B knob, not a tuning table): a power of two from 1 to 16 caps the
/// warps the rule picks; unset (or empty) leaves the rule alone.
pub fn skinny_warps_cap(over: Option<&str>) -> Result<Option<u64>, String> {
    match over.map(str::trim) {
        None | Some("") => Ok(None),
        Some(v) => match v.parse::<u64>() {
            Ok(w) if (1..=16).contains(&w) && w.is_power_of_two() => Ok(Some(w)),
            _ => Err(format!(
                "KILN_QSKINNY_WARPS={v} is not a warp count; set it to 1, 2, 4, 8 or 16 \
                 (or unset it for the rule)"
            )),
        },
    }
}

/// One qskinny launch's geometry (see [`lower_qskinny`]'s doc).
struct SkinnyGeometry {
    tp: u64,
    mt: u64,
    warps: u64,
    grid: u32,
}

impl SkinnyGeometry {
    /// For `tokens` (at most 32) over `n` weight rows; `act`: the fused
    /// activation epilogue, whose blocks pair gate tile `j` with up tile
    /// `j + n/2` (two tiles, `n / 2` output rows).
    fn of(
        q: QuantType,
        op: &'static str,
        n: u64,
        k: u64,
        tokens: u64,
        act: bool,
    ) -> Result<SkinnyGeometry, QLowerError> {
        let tp = tokens.div_ceil(8) * 8;
        let mt = if act || (tp >= 24 && n.div_ceil(32) >= 256) {
            2
        } else {
            1
        };
        let units = k / qskinny_unit(q);
        let cap = skinny_warps_cap(std::env::var("KILN_QSKINNY_WARPS").ok().as_deref())
            .map_err(|why| QLowerError::Unsupported { op, q, n, k, why })?;
        let mut warps = cap.map_or(16 / mt, |c| c.min(16 / mt));
        while warps > 1 && 2 * warps > units {
            warps /= 2;
        }
        let grid = if act {
            (n / 2).div_ceil(16)
        } else {
            n.div_ceil(16 * mt)
        };
        let grid = u32::try_from(grid).map_err(|_| QLowerError::Unsupported {
            op,
            q,
            n,
            k,
            why: "too many rows for one grid".into(),
        })?;
        Ok(SkinnyGeometry {
            tp,
            mt,
            warps,
            grid,
        })
    }

    /// The split-K partials: `warps * mt * (tp / 8) * 4 * 32` f32.
    fn shared_bytes(&self) -> u32 {
        (self.warps * self.mt * (self.tp / 8) * 4 * 32 * 4) as u32
    }
}

/// The RMSNorm prologue of a fused quantized GEMM (`fused_matmul`'s
/// `pre`): x is normalized as the unfused `rms_norm` stores it,
/// `round(x * inv_rms * w)` (`1 + w` under `unit_offset`), before the
/// product.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QNorm {
    /// The norm weight, bf16 `[k]`, 16-byte aligned.
    pub weight: BufRef,
    pub eps: f32,
    pub unit_offset: bool,
}

/// The activation epilogue of a fused quantized GEMM: the weight stacks
/// gate rows over up rows (`[2I, K]`) and the result is `act(g) * u`,
/// `[t, I]`, with `g` and `u` rounded to bf16 as the unfused matmul stores
/// them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QAct {
    Silu,
    GeluTanh,
}

/// What a fused launch adds to the plain quantized GEMM (whose bias and
/// residual stay in [`QGemvBufs`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct QFusion {
    pub norm: Option<QNorm>,
    pub act: Option<QAct>,
}

/// The fused entries' epilogue mode (the kernels' `KQ_FUSED_*`).
fn fused_mode(f: &QFusion, bufs: &QGemvBufs) -> i32 {
    match (f.act, bufs.residual) {
        (Some(QAct::Silu), _) => 1,
        (Some(QAct::GeluTanh), _) => 2,
        (None, Some(_)) => 3,
        (None, None) => 0,
    }
}

/// What the fused entries need beyond [`check_gemm`], checked once for
/// both kernels; returns the checked operands and the output columns.
fn check_fused(
    q: QuantType,
    n: u64,
    k: u64,
    t: u64,
    out: DType,
    bufs: &QGemvBufs,
    f: &QFusion,
) -> Result<(GemmChecked, u64), QLowerError> {
    const OP: &str = "fused_matmul";
    let refuse = |why: String| QLowerError::Unsupported {
        op: OP,
        q,
        n,
        k,
        why,
    };
    if f.act.is_some() && (n < 2 || !n.is_multiple_of(2)) {
        return Err(refuse(format!(
            "the activation epilogue needs an even number of stacked gate/up rows, got {n}"
        )));
    }
    let out_n = if f.act.is_some() { n / 2 } else { n };
    let c = check_gemm_as(OP, q, (n, k, out_n), t, out, bufs)?;
    if f.act.is_some() && bufs.residual.is_some() {
        return Err(refuse(
            "an activation epilogue and a residual add cannot share one launch".into(),
        ));
    }
    if out == DType::F32 && (f.act.is_some() || bufs.residual.is_some()) {
        return Err(refuse(
            "an f32 result is only possible without an epilogue (the final norm + lm_head); with one the result is bf16"
                .into(),
        ));
    }
    if let Some(nm) = f.norm {
        if nm.weight.bytes < k * 2 {
            return Err(refuse(format!(
                "the norm weight needs {} bytes but its buffer has {}",
                k * 2,
                nm.weight.bytes
            )));
        }
        if !nm.weight.offset.is_multiple_of(16) {
            return Err(refuse(format!(
                "the norm weight must be 16-byte aligned (offset {})",
                nm.weight.offset
            )));
        }
    }
    Ok((c, out_n))
}

impl GemmChecked {
    /// The fused entries' parameters: the plain list with the norm weight
    /// after the bias, and `eps`, `unit_offset`, `mode` at the end.
    #[allow(clippy::too_many_arguments)]
    fn fused_params(
        &self,
        bufs: &QGemvBufs,
        f: &QFusion,
        (n, k, out_n): (u64, u64, u64),
        t0: u64,
        tokens: u64,
        w_const: bool,
    ) -> Vec<LaunchParam> {
        let mut p = self.params(bufs, n, k, t0, tokens, w_const);
        // The output of tokens [t0, ..) starts t0 full result rows in.
        p[5] = LaunchParam::Buf(offset_by(bufs.out, t0 * out_n * self.osz));
        p.insert(
            4,
            f.norm
                .map_or(LaunchParam::Null, |nm| LaunchParam::Buf(nm.weight)),
        );
        p.push(LaunchParam::F32(f.norm.map_or(0.0, |nm| nm.eps)));
        p.push(LaunchParam::I32(
            f.norm.is_some_and(|nm| nm.unit_offset) as i32
        ));
        p.push(LaunchParam::I32(fused_mode(f, bufs)));
        p
    }
}

/// The launches of a fused quantized GEMV (`fused_matmul` over a weight
/// kept quantized, `kernels/gpu/qgemv.cu`): [`lower_qgemv`] with the
/// RMSNorm prologue `f.norm` and/or the activation epilogue `f.act`; the
/// residual epilogue is `bufs.residual` as for the plain GEMV. Without a
/// prologue or an activation this is [`lower_qgemv`] itself (the plain
/// entries take a bias and a residual).
///
/// Entries: `qgemv_fused_norm_<type>_t<tt>_bf16_<out>` (the prologue, any
/// epilogue) and `qgemv_fused_<type>_t<tt>_bf16_bf16` (an activation
/// without the prologue). Under an activation a warp's two rows are gate
/// row `j` and up row `j + n/2`: 8 outputs a block. Refuses (naming the
/// limit) what [`lower_qgemv`] refuses and: an odd `n` under an activation,
/// an activation with a residual, an f32 result with an epilogue, a norm
/// weight shorter than `k` or not 16-byte aligned.
///
/// ```
/// use kiln_ir::plan::{BufRef, Region};
/// use kiln_kernels::quant_gpu::{lower_qgemv_fused, repacked_bytes, QAct, QFusion, QGemvBufs, QNorm, QuantType};
/// let buf = |offset, bytes| BufRef { region: Region::Arena, offset, bytes };
/// let (t, n, k) = (1u64, 2 * 8192u64, 2048u64);
/// let bufs = QGemvBufs {
///     x: buf(0, t * k * 2),
///     w: BufRef { region: Region::Weight(3), offset: 0, bytes: repacked_bytes(QuantType::Q4K, n, k).unwrap() },
///     scale: None,
///     bias: None,
///     residual: None,
///     out: buf(1 << 20, t * n / 2 * 2),
/// };
/// let f = QFusion {
///     norm: Some(QNorm { weight: BufRef { region: Region::Weight(4), offset: 0, bytes: k * 2 }, eps: 1e-6, unit_offset: false }),
///     act: Some(QAct::Silu),
/// };
/// let ls = lower_qgemv_fused(QuantType::Q4K, n, k, t, kiln_ir::DType::BF16, &bufs, &f, true, true).unwrap();
/// assert_eq!(ls[0].entry, "qgemv_fused_norm_q4k_t1_bf16_bf16");
/// assert_eq!(ls[0].grid, [1024, 1, 1]); // 8192 outputs, 8 a block
/// ```
#[allow(clippy::too_many_arguments)]
pub fn lower_qgemv_fused(
    q: QuantType,
    n: u64,
    k: u64,
    t: u64,
    out: DType,
    bufs: &QGemvBufs,
    f: &QFusion,
    w_const: bool,
    pdl: bool,
) -> Result<Vec<KernelLaunch>, QLowerError> {
    lower_qgemv_fused_with(QGemvKernel::Float, q, n, k, t, out, bufs, f, w_const, pdl)
}

/// [`lower_qgemv_fused`] on the chosen kernel ([`QGemvKernel::choose`]).
#[allow(clippy::too_many_arguments)]
pub fn lower_qgemv_fused_with(
    kern: QGemvKernel,
    q: QuantType,
    n: u64,
    k: u64,
    t: u64,
    out: DType,
    bufs: &QGemvBufs,
    f: &QFusion,
    w_const: bool,
    pdl: bool,
) -> Result<Vec<KernelLaunch>, QLowerError> {
    let (c, out_n) = check_fused(q, n, k, t, out, bufs, f)?;
    if f.norm.is_none() && f.act.is_none() {
        return lower_qgemv_with(kern, q, n, k, t, out, bufs, w_const, pdl);
    }
    check_kernel(kern, q, n, k, t, "fused_matmul")?;
    let kern = kern.resolve(n, k).map_err(|why| QLowerError::Unsupported {
        op: "fused_matmul",
        q,
        n,
        k,
        why,
    })?;
    let name = if f.norm.is_some() {
        "fused_norm"
    } else {
        "fused"
    };
    let rows_per_block = if f.act.is_some() {
        kern.rows_per_block() / 2
    } else {
        kern.rows_per_block()
    };
    let grid =
        u32::try_from(out_n.div_ceil(rows_per_block)).map_err(|_| QLowerError::Unsupported {
            op: "fused_matmul",
            q,
            n,
            k,
            why: "too many rows for one grid".into(),
        })?;
    let mut launches = Vec::new();
    let mut t0 = 0u64;
    while t0 < t {
        let tokens = (t - t0).min(8);
        let tt = QGEMV_TOKENS
            .into_iter()
            .find(|&tt| tt as u64 >= tokens)
            .expect("tokens <= 8");
        launches.push(KernelLaunch {
            module: MODULE.into(),
            entry: format!("{}_{name}_{}_t{tt}_bf16_{}", kern.prefix(), stem(q), c.os),
            grid: [grid, 1, 1],
            block: [QGEMV_THREADS, 1, 1],
            shared_bytes: 0,
            cluster: 1,
            params: c.fused_params(bufs, f, (n, k, out_n), t0, tokens, w_const),
            pdl,
        });
        t0 += tokens;
    }
    Ok(launches)
}

/// The rope tail of a `matmul_qkv_rope` launch ([`lower_qgemv_rope`]):
/// what `qkv_rope_kv_write` takes besides the packed qkv row, and the
/// units' completion counters (u32, zero on entry, left zero; one per
/// head of the packed row).
#[derive(Clone, Debug, PartialEq)]
pub struct QRope {
    pub pos: BufRef,
    pub slots: BufRef,
    pub kc: BufRef,
    pub vc: BufRef,
    /// The q and k norm weights (bf16 `[head_dim]`), with their eps.
    pub norms: Option<(BufRef, BufRef, f32)>,
    pub unit_offset: bool,
    /// The roped q, bf16 `[heads * head_dim]`.
    pub q_out: BufRef,
    pub counters: BufRef,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Rows of each cache.
    pub num_slots: u64,
    /// The RoPE frequencies as the rope kernels take them
    /// (`crate::gpu::rope_freqs_blob`).
    pub freqs: Vec<u8>,
}

impl QRope {
    /// Refuses (naming the limit) what the rope tail cannot take for a
    /// packed row of `n` rows: rows other than `(heads + 2 * kv_heads) *
    /// head_dim`, an odd head_dim or one over 256, too few counters.
    pub fn check(&self, n: u64) -> Result<(), String> {
        let units = u64::from(self.heads) + 2 * u64::from(self.kv_heads);
        let hd = u64::from(self.head_dim);
        if hd == 0 || !hd.is_multiple_of(2) || hd > 256 {
            return Err(format!("head_dim must be even and at most 256, got {hd}"));
        }
        if units * hd != n {
            return Err(format!(
                "the weight has {n} rows, not (heads {} + 2 x kv_heads {}) x head_dim {hd}",
                self.heads, self.kv_heads
            ));
        }
        if self.counters.bytes < units * 4 {
            return Err(format!(
                "needs {units} completion counters but {} bytes were planned",
                self.counters.bytes
            ));
        }
        Ok(())
    }

    /// The rope tail's launch parameters (`kiln_rope_tail`'s, after the
    /// GEMV's): the same in the quantized and the dense entries.
    pub fn params(&self) -> Result<Vec<LaunchParam>, String> {
        let i32_of = |what: &str, v: u32| {
            i32::try_from(v).map_err(|_| format!("{what} exceeds the 32-bit range"))
        };
        let opt = |b: Option<BufRef>| b.map_or(LaunchParam::Null, LaunchParam::Buf);
        Ok(vec![
            LaunchParam::Buf(self.pos),
            LaunchParam::Buf(self.slots),
            LaunchParam::Buf(self.kc),
            LaunchParam::Buf(self.vc),
            opt(self.norms.map(|n| n.0)),
            opt(self.norms.map(|n| n.1)),
            LaunchParam::Buf(self.q_out),
            LaunchParam::Buf(self.counters),
            LaunchParam::I32(i32_of("heads", self.heads)?),
            LaunchParam::I32(i32_of("kv_heads", self.kv_heads)?),
            LaunchParam::I32(i32_of("head_dim", self.head_dim)?),
            LaunchParam::F32(self.norms.map_or(0.0, |n| n.2)),
            LaunchParam::I32(self.norms.is_some() as i32),
            LaunchParam::I32(self.unit_offset as i32),
            LaunchParam::I64(
                i64::try_from(self.num_slots).map_err(|_| "too many cache slots".to_string())?,
            ),
            LaunchParam::Blob(self.freqs.clone()),
        ])
    }
}

/// The one launch of a one-token `matmul_qkv_rope` over a weight kept
/// quantized (`qgemv.cu`'s `qgemv_i8<geometry>_rope[_norm]_<type>_t1_bf16_bf16`):
/// the integer-dot GEMV of [`lower_qgemv_fused_with`] writing the packed
/// qkv row to `bufs.out` (the op's scratch), whose last block over each
/// head finishes that head as `qkv_rope_kv_write` does (the kernel's
/// header says how). Refuses (naming the limit) what the fused GEMV
/// refuses and: another kernel than the integer-dot one, more than one
/// token, a residual, a weight whose rows are not `(heads + 2 * kv_heads)
/// * head_dim`, an odd head_dim or one over 256, and too few counters.
#[allow(clippy::too_many_arguments)]
pub fn lower_qgemv_rope(
    kern: QGemvKernel,
    q: QuantType,
    (n, k): (u64, u64),
    bufs: &QGemvBufs,
    norm: Option<QNorm>,
    r: &QRope,
    w_const: bool,
    pdl: bool,
) -> Result<KernelLaunch, QLowerError> {
    const OP: &str = "matmul_qkv_rope";
    let refuse = |why: String| QLowerError::Unsupported {
        op: OP,
        q,
        n,
        k,
        why,
    };
    let f = QFusion { norm, act: None };
    let (c, _) = check_fused(q, n, k, 1, DType::BF16, bufs, &f)?;
    if !kern.is_int8() || !QGemvKernel::int8_dot_exists(q, 1, k) {
        return Err(refuse(format!(
            "the rope tail exists in the one-token integer-dot GEMV only (Q4_K, Q6_K or Q8_0, K <= {QDOT_MAX_K})"
        )));
    }
    if bufs.residual.is_some() {
        return Err(refuse(
            "the packed q/k/v projection takes no residual".into(),
        ));
    }
    r.check(n).map_err(refuse)?;
    let kern = kern.resolve(n, k).map_err(refuse)?;
    let grid = i32::try_from(n.div_ceil(kern.rows_per_block()))
        .map_err(|_| refuse("the block count exceeds the 32-bit range".into()))?
        as u32;
    let mut params = c.fused_params(bufs, &f, (n, k, n), 0, 1, w_const);
    params.extend(r.params().map_err(refuse)?);
    let name = if norm.is_some() { "rope_norm" } else { "rope" };
    Ok(KernelLaunch {
        module: MODULE.into(),
        entry: format!("{}_{name}_{}_t1_bf16_bf16", kern.prefix(), stem(q)),
        grid: [grid, 1, 1],
        block: [QGEMV_THREADS, 1, 1],
        shared_bytes: 0,
        cluster: 1,
        params,
        pdl,
    })
}

/// The launches of a fused quantized GEMM on tensor cores
/// (`kernels/gpu/qskinny.cu`): [`lower_qskinny`] with the prologue and
/// epilogues of [`lower_qgemv_fused`] (and its refusals). Under an
/// activation every block takes two row tiles, gate rows `[16b, 16b + 16)`
/// and the up rows `n/2` further, so both sums meet in the block's split-K
/// reduction (`r2` entries, `n/2` outputs over 16-output blocks, at most 8
/// warps); otherwise the geometry is [`lower_qskinny`]'s. Without a
/// prologue or an activation this is [`lower_qskinny`] itself.
///
/// Entries: `qskinny_fused_norm_<type>_t<tp>_r<mt>_bf16_<out>` and
/// `qskinny_fused_<type>_t<tp>_r2_bf16_bf16` (an activation without the
/// prologue).
#[allow(clippy::too_many_arguments)]
pub fn lower_qskinny_fused(
    q: QuantType,
    n: u64,
    k: u64,
    t: u64,
    out: DType,
    bufs: &QGemvBufs,
    f: &QFusion,
    w_const: bool,
    pdl: bool,
) -> Result<Vec<KernelLaunch>, QLowerError> {
    let (c, out_n) = check_fused(q, n, k, t, out, bufs, f)?;
    if f.norm.is_none() && f.act.is_none() {
        return lower_qskinny(q, n, k, t, out, bufs, w_const, pdl);
    }
    let name = if f.norm.is_some() {
        "fused_norm"
    } else {
        "fused"
    };
    let prefetch = env_prefetch("fused_matmul", q, n, k)?;
    let mut launches = Vec::new();
    let mut t0 = 0u64;
    while t0 < t {
        let tokens = (t - t0).min(32);
        let g = SkinnyGeometry::of(q, "fused_matmul", n, k, tokens, f.act.is_some())?;
        let ring = prefetch
            .filter(|_| q != QuantType::Fp8E4M3 && g.tp == 8)
            .and_then(|_| skinny_fused_ring_depth(q));
        let pf = ring.map_or(String::new(), |d| format!("_pf{d}"));
        let shared = ring.map_or(0, |d| g.warps * u64::from(d) * g.mt * qskinny_slot_bytes(q));
        launches.push(KernelLaunch {
            module: QSKINNY_MODULE.into(),
            entry: format!(
                "qskinny_{name}_{}_t{}_r{}{pf}_bf16_{}",
                stem(q),
                g.tp,
                g.mt,
                c.os
            ),
            grid: [g.grid, 1, 1],
            block: [32 * g.warps as u32, 1, 1],
            shared_bytes: g.shared_bytes().max(shared as u32),
            cluster: 1,
            params: c.fused_params(bufs, f, (n, k, out_n), t0, tokens, w_const),
            pdl,
        });
        t0 += tokens;
    }
    Ok(launches)
}

/// The launch of a quantized row gather (embedding lookup): `out[i, :] =`
/// the bf16 rounding of row `ids[i]` of the `[n, k]` weight, for `t` i32
/// ids; an id outside `[0, n)` gives a zero row. `scale`: FP8's per-row
/// scales (FP8 only). Refuses what [`lower_qgemv`] refuses, and more than
/// 65535 ids.
#[allow(clippy::too_many_arguments)]
pub fn lower_qgather(
    q: QuantType,
    n: u64,
    k: u64,
    t: u64,
    ids: BufRef,
    w: BufRef,
    scale: Option<BufRef>,
    out: BufRef,
    pdl: bool,
) -> Result<KernelLaunch, QLowerError> {
    let refuse = |why: String| QLowerError::Unsupported {
        op: "embedding",
        q,
        n,
        k,
        why,
    };
    let l = layout(q, n, k).map_err(|e| refuse(e.to_string()))?;
    if t == 0 || t > 65535 {
        return Err(refuse(format!("{t} ids: the gather takes 1..=65535")));
    }
    let n32 = i32::try_from(n).map_err(|_| refuse("N exceeds the 32-bit index range".into()))?;
    let k32 = i32::try_from(k).map_err(|_| refuse("K exceeds the 32-bit index range".into()))?;
    for (what, b, bytes) in [
        ("ids", ids, t * 4),
        ("the repacked weight", w, l.total),
        ("out", out, t * k * 2),
    ] {
        if b.bytes < bytes {
            return Err(refuse(format!(
                "{what} needs {bytes} bytes but its buffer has {}",
                b.bytes
            )));
        }
    }
    if !w.offset.is_multiple_of(16) || !out.offset.is_multiple_of(16) {
        return Err(refuse("the weight and out must be 16-byte aligned".into()));
    }
    match (q == QuantType::Fp8E4M3, scale) {
        (true, None) => return Err(refuse("FP8 needs its per-row f32 scales".into())),
        (true, Some(s)) if s.bytes < n * 4 => {
            return Err(refuse(format!("the FP8 scales need {} bytes", n * 4)))
        }
        (false, Some(_)) => {
            return Err(refuse(
                "only FP8 weights take a per-row scale operand".into(),
            ))
        }
        _ => {}
    }
    let epv = if matches!(q, QuantType::Q8_0 | QuantType::Fp8E4M3) {
        16
    } else {
        32
    };
    let nv = k / epv;
    Ok(KernelLaunch {
        module: MODULE.into(),
        entry: format!("qgather_{}_bf16", stem(q)),
        grid: [nv.div_ceil(QGEMV_THREADS as u64) as u32, t as u32, 1],
        block: [QGEMV_THREADS, 1, 1],
        shared_bytes: 0,
        cluster: 1,
        params: vec![
            LaunchParam::Buf(ids),
            LaunchParam::Buf(w),
            scale.map_or(LaunchParam::Null, LaunchParam::Buf),
            LaunchParam::Buf(out),
            LaunchParam::I32(n32),
            LaunchParam::I32(k32),
            LaunchParam::I64(l.offsets[0] as i64),
            LaunchParam::I64(l.offsets[1] as i64),
            LaunchParam::I64(l.offsets[2] as i64),
        ],
        pdl,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_ir::plan::Region;

    fn buf(offset: u64, bytes: u64) -> BufRef {
        BufRef {
            region: Region::Arena,
            offset,
            bytes,
        }
    }

    /// e4m3 restated from its definition (sign, 4-bit exponent with bias 7,
    /// 3-bit mantissa, subnormals at exponent 0), in f64.
    fn e4m3_by_definition(b: u8) -> f64 {
        let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let (e, m) = (i32::from((b >> 3) & 0xf), f64::from(b & 7));
        if e == 0 {
            sign * m / 8.0 * 2f64.powi(-6)
        } else {
            sign * (1.0 + m / 8.0) * 2f64.powi(e - 7)
        }
    }

    #[test]
    fn e4m3_decodes_every_code_as_its_definition_and_nan_as_none() {
        for b in 0..=255u8 {
            match e4m3_to_f32(b) {
                None => assert_eq!(b & 0x7f, 0x7f, "code {b:#04x}"),
                Some(v) => assert_eq!(f64::from(v), e4m3_by_definition(b), "code {b:#04x}"),
            }
        }
        assert_eq!(e4m3_to_f32(0x7e), Some(448.0));
    }

    #[test]
    fn the_integer_dot_gemv_is_chosen_for_one_cuda_token_of_its_types_and_refused_elsewhere() {
        for q in QUANT_TYPES {
            let has = QDOT_TYPES.contains(&q);
            assert_eq!(
                QGemvKernel::choose_with(q, 1, 4096, true, true) == QGemvKernel::Int8Dot,
                has,
                "{q:?}"
            );
            // HIP, more than one token and rows longer than the shared copy
            // of x keep the float kernel.
            assert_eq!(
                QGemvKernel::choose_with(q, 1, 4096, false, true),
                QGemvKernel::Float
            );
            assert_eq!(
                QGemvKernel::choose_with(q, 1, 4096, true, false),
                QGemvKernel::Float
            );
            assert_eq!(
                QGemvKernel::choose_with(q, 2, 4096, true, true),
                QGemvKernel::Float
            );
            assert_eq!(
                QGemvKernel::choose_with(q, 1, QDOT_MAX_K + 256, true, true),
                QGemvKernel::Float
            );
        }
        // Asked for where it does not exist, the lowering refuses and says
        // which kernel to use instead.
        let e = check_kernel(QGemvKernel::Int8Dot, QuantType::Q4_0, 64, 256, 1, "matmul")
            .unwrap_err()
            .to_string();
        assert!(e.contains("float kernel"), "{e}");
        let e = check_kernel(QGemvKernel::Int8Dot, QuantType::Q4K, 64, 256, 3, "matmul")
            .unwrap_err()
            .to_string();
        assert!(e.contains("got 3 tokens"), "{e}");
        // Every entry a lowering can name is in the module.
        let entries = entry_points();
        for q in QDOT_TYPES {
            for o in ["bf16", "f32"] {
                let e = format!("qgemv_i8_{}_t1_bf16_{o}", stem(q));
                assert!(entries.contains(&e), "{e}");
                let e = format!("qgemv_i8_fused_norm_{}_t1_bf16_{o}", stem(q));
                assert!(entries.contains(&e), "{e}");
            }
            let e = format!("qgemv_i8_fused_{}_t1_bf16_bf16", stem(q));
            assert!(entries.contains(&e), "{e}");
        }
    }

    #[test]
    fn layouts_start_regions_16_byte_aligned_and_cover_every_byte_once() {
        for q in QUANT_TYPES {
            for (n, k) in [(1u64, 256u64), (3, 512), (17, 768), (5, 4096)] {
                let l = layout(q, n, k).unwrap();
                let mut end = l.sizes[0];
                for r in 1..4 {
                    if l.sizes[r] == 0 {
                        assert_eq!(l.offsets[r - 1], 0);
                        continue;
                    }
                    let at = l.offsets[r - 1];
                    assert!(at.is_multiple_of(16) && at >= end, "{q:?} region {r}");
                    assert!(at - end < 16, "{q:?} region {r} leaves a gap");
                    end = at + l.sizes[r];
                }
                assert!(l.total >= end && l.total - end < 16 && l.total.is_multiple_of(16));
                // Bits per weight: the GGUF bytes plus at most the unpacked
                // K-quant scales and three paddings.
                let extra = match q {
                    QuantType::Q4K | QuantType::Q5K => n * k / 256 * 4,
                    QuantType::Q6K => n * k / 256 * 2,
                    _ => 0,
                };
                assert!(l.total <= n * q.row(k) + extra + 48, "{q:?} [{n},{k}]");
                assert!(l.total >= n * q.row(k), "{q:?} [{n},{k}]");
            }
        }
    }

    #[test]
    fn k_that_is_not_a_whole_block_and_wrong_lengths_are_refused_with_the_limit() {
        let e = layout(QuantType::Q4K, 4, 4000).unwrap_err().to_string();
        assert!(e.contains("multiple of 256"), "{e}");
        assert!(layout(QuantType::Fp8E4M3, 4, 40).is_err());
        assert!(layout(QuantType::Fp8E4M3, 4, 48).is_ok());
        assert!(layout(QuantType::Q8_0, 0, 32).is_err());
        let e = repack(QuantType::Q4_0, &[0u8; 35], 2, 32).unwrap_err();
        assert!(matches!(
            e,
            QuantError::WrongLength {
                expected: 36,
                got: 35,
                ..
            }
        ));
        let mut fp8 = vec![0x38u8; 2 * 16];
        fp8[20] = 0xff;
        let e = repack(QuantType::Fp8E4M3, &fp8, 2, 16).unwrap_err();
        assert_eq!(
            e,
            QuantError::Fp8Nan {
                n: 2,
                k: 16,
                row: 1,
                col: 4
            }
        );
    }

    /// Q4_0 blocks built by hand: element e of a group has code e % 16, so
    /// the decoded row is known without any dequantizer.
    #[test]
    fn a_hand_built_q4_0_row_decodes_to_its_known_values() {
        let (n, k) = (2u64, 64u64);
        let mut src = Vec::new();
        for row in 0..n {
            for g in 0..2u64 {
                let d = half::f16::from_f32(0.5 * (1 + row * 2 + g) as f32);
                src.extend(d.to_le_bytes());
                for j in 0..16u8 {
                    // element j: code j; element j + 16: code 15 - j.
                    src.push(j | ((15 - j) << 4));
                }
            }
        }
        let rp = repack(QuantType::Q4_0, &src, n, k).unwrap();
        let y = dequantize_repacked(QuantType::Q4_0, &rp, None, n, k).unwrap();
        for row in 0..n as usize {
            for e in 0..k as usize {
                let (g, i) = (e / 32, e % 32);
                let code = if i < 16 { i } else { 31 - i } as f32;
                let d = 0.5 * (1 + row * 2 + g) as f32;
                assert_eq!(y[row * 64 + e], (code - 8.0) * d, "row {row} e {e}");
            }
        }
    }

    fn bufs(t: u64, n: u64, k: u64, q: QuantType) -> QGemvBufs {
        QGemvBufs {
            x: buf(0, t * k * 2),
            w: buf(1 << 30, repacked_bytes(q, n, k).unwrap()),
            scale: (q == QuantType::Fp8E4M3).then(|| buf(1 << 29, n * 4)),
            bias: None,
            residual: None,
            out: buf(1 << 28, t * n * 4),
        }
    }

    #[test]
    fn gemv_launches_pick_the_token_tile_and_loop_eight_tokens_at_a_time() {
        let (n, k) = (1000u64, 512u64);
        for q in QUANT_TYPES {
            for (t, want) in [
                (1u64, vec!["t1"]),
                (3, vec!["t4"]),
                (8, vec!["t8"]),
                (19, vec!["t8", "t8", "t4"]),
            ] {
                let b = bufs(t, n, k, q);
                let ls = lower_qgemv(q, n, k, t, DType::F32, &b, true, false).unwrap();
                let entries: Vec<String> = ls.iter().map(|l| l.entry.clone()).collect();
                let expect: Vec<String> = want
                    .iter()
                    .map(|tt| format!("qgemv_{}_{tt}_bf16_f32", stem(q)))
                    .collect();
                assert_eq!(entries, expect);
                for (i, l) in ls.iter().enumerate() {
                    assert!(entry_points().contains(&l.entry));
                    assert_eq!(l.grid, [63, 1, 1]);
                    let LaunchParam::Buf(x) = l.params[0] else {
                        panic!()
                    };
                    assert_eq!(x.offset, 8 * i as u64 * k * 2, "x of launch {i}");
                    let LaunchParam::Buf(o) = l.params[5] else {
                        panic!()
                    };
                    assert_eq!(o.offset, (1 << 28) + 8 * i as u64 * n * 4);
                    let LaunchParam::I32(tok) = l.params[6] else {
                        panic!()
                    };
                    assert_eq!(tok as u64, (t - 8 * i as u64).min(8));
                    let lay = layout(q, n, k).unwrap();
                    assert_eq!(l.params[10], LaunchParam::I64(lay.offsets[0] as i64));
                    assert_eq!(l.params[12], LaunchParam::I64(lay.offsets[2] as i64));
                }
            }
        }
    }

    #[test]
    fn gemv_lowering_refuses_what_its_kernel_cannot_run_and_says_why() {
        let (n, k) = (64u64, 256u64);
        let q = QuantType::Q4K;
        let ok = bufs(1, n, k, q);
        let why = |r: Result<Vec<KernelLaunch>, QLowerError>| r.unwrap_err().to_string();
        let e = why(lower_qgemv(q, n, 200, 1, DType::BF16, &ok, true, false));
        assert!(e.contains("multiple of 256"), "{e}");
        let e = why(lower_qgemv(q, n, k, 1, DType::F16, &ok, true, false));
        assert!(e.contains("bf16 or f32"), "{e}");
        let mut small = ok;
        small.w.bytes -= 1;
        let e = why(lower_qgemv(q, n, k, 1, DType::BF16, &small, true, false));
        assert!(e.contains("repacked weight needs"), "{e}");
        let mut odd = ok;
        odd.x.offset = 8;
        let e = why(lower_qgemv(q, n, k, 1, DType::BF16, &odd, true, false));
        assert!(e.contains("16-byte aligned"), "{e}");
        let mut scaled = ok;
        scaled.scale = Some(buf(0, n * 4));
        let e = why(lower_qgemv(q, n, k, 1, DType::BF16, &scaled, true, false));
        assert!(e.contains("only FP8"), "{e}");
        let mut fp8 = bufs(1, n, k, QuantType::Fp8E4M3);
        fp8.scale = None;
        let e = why(lower_qgemv(
            QuantType::Fp8E4M3,
            n,
            k,
            1,
            DType::BF16,
            &fp8,
            true,
            false,
        ));
        assert!(e.contains("per-row f32 scales"), "{e}");
        let e = why(lower_qgemv(q, n, k, 0, DType::BF16, &ok, true, false));
        assert!(e.contains("no tokens"), "{e}");
    }

    fn param_i32(l: &KernelLaunch, i: usize) -> i32 {
        match l.params[i] {
            LaunchParam::I32(v) => v,
            ref p => panic!("param {i} of {} is {p:?}", l.entry),
        }
    }

    fn param_buf(l: &KernelLaunch, i: usize) -> BufRef {
        match l.params[i] {
            LaunchParam::Buf(b) => b,
            ref p => panic!("param {i} of {} is {p:?}", l.entry),
        }
    }

    /// The geometry restated from `lower_qskinny`'s doc, per launch of
    /// `tokens` tokens: (entry suffix, grid, threads, shared bytes).
    fn skinny_geometry(q: QuantType, n: u64, k: u64, tokens: u64) -> (String, u32, u32, u32) {
        let tp = tokens.div_ceil(8) * 8;
        let mt = if tp >= 24 && n >= 256 * 32 - 31 { 2 } else { 1 };
        let units = k / qskinny_unit(q);
        let warps = [16 / mt, 8 / mt, 4 / mt, 2 / mt, 1]
            .into_iter()
            .find(|&w| w == 1 || 2 * w <= units)
            .unwrap();
        (
            format!("t{tp}_r{mt}"),
            n.div_ceil(16 * mt) as u32,
            32 * warps as u32,
            (warps * mt * tp / 8 * 512) as u32,
        )
    }

    #[test]
    fn skinny_launches_take_32_tokens_each_with_geometry_from_tokens_rows_and_k() {
        for q in QUANT_TYPES {
            let min_k = k_multiple(q).max(qskinny_unit(q));
            for (n, k) in [(5u64, min_k), (37, 3 * min_k), (1000, 4096), (8200, 4096)] {
                for t in [2u64, 3, 8, 9, 17, 24, 32, 33, 70] {
                    let b = bufs(t, n, k, q);
                    let ls =
                        lower_qskinny_with(q, n, k, t, DType::F32, &b, true, true, None).unwrap();
                    assert_eq!(ls.len() as u64, t.div_ceil(32), "{q:?} t={t}");
                    // The default differs from the plain loop only in the
                    // ring types' eight-token, one-tile entries, which take
                    // the type's default ring; Q4_K's adds its slots to the
                    // shared memory.
                    let def = lower_qskinny(q, n, k, t, DType::F32, &b, true, true).unwrap();
                    assert_eq!(def.len(), ls.len());
                    for (d, p) in def.iter().zip(&ls) {
                        let depth = skinny_prefetch(None, q)
                            .unwrap()
                            .filter(|_| p.entry.contains("_t8_r1_"))
                            .and_then(|dp| skinny_ring_depth(q, u64::from(p.block[0] / 32), dp));
                        let want = match depth {
                            Some(dp) => p.entry.replace("_t8_r1_", &format!("_t8_r1_pf{dp}_")),
                            None => p.entry.clone(),
                        };
                        assert_eq!(d.entry, want, "{q:?} [{n},{k}] t={t}");
                        assert!(qskinny_entry_points().contains(&d.entry));
                        let shared = match depth {
                            Some(dp) => p.shared_bytes.max(
                                (u64::from(dp) * qskinny_slot_bytes(q)) as u32 * p.block[0] / 32,
                            ),
                            None => p.shared_bytes,
                        };
                        assert!(shared <= 48 * 1024);
                        assert_eq!((d.grid, d.block, d.shared_bytes), (p.grid, p.block, shared));
                        assert_eq!(d.params, p.params);
                    }
                    let lay = layout(q, n, k).unwrap();
                    for (i, l) in ls.iter().enumerate() {
                        let t0 = 32 * i as u64;
                        let tokens = (t - t0).min(32);
                        let (suffix, grid, threads, shared) = skinny_geometry(q, n, k, tokens);
                        let what = format!("{q:?} [{n},{k}] t={t} launch {i}");
                        assert_eq!(
                            l.entry,
                            format!("qskinny_{}_{suffix}_bf16_f32", stem(q)),
                            "{what}"
                        );
                        assert!(qskinny_entry_points().contains(&l.entry), "{what}");
                        assert_eq!(l.module, QSKINNY_MODULE);
                        assert_eq!(l.grid, [grid, 1, 1], "{what}");
                        assert_eq!(l.block, [threads, 1, 1], "{what}");
                        assert_eq!(l.shared_bytes, shared, "{what}");
                        // Every row is covered by exactly the grid's tiles.
                        let rows = grid as u64 * if suffix.ends_with("r2") { 32 } else { 16 };
                        assert!(rows >= n && rows - n < 32, "{what}");
                        assert!(l.shared_bytes <= 48 * 1024, "{what}");
                        assert!(l.pdl);
                        assert_eq!(param_buf(l, 0).offset, t0 * k * 2, "{what}");
                        assert_eq!(param_buf(l, 5).offset, (1 << 28) + t0 * n * 4, "{what}");
                        assert_eq!(param_i32(l, 6) as u64, tokens, "{what}");
                        assert_eq!(param_i32(l, 7) as u64, n);
                        assert_eq!(param_i32(l, 8) as u64, k);
                        assert_eq!(param_i32(l, 9), 1);
                        for r in 0..3 {
                            assert_eq!(l.params[10 + r], LaunchParam::I64(lay.offsets[r] as i64));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn skinny_lowering_refuses_what_the_gemv_refuses_and_says_why() {
        let (n, k) = (64u64, 256u64);
        let q = QuantType::Q6K;
        let ok = bufs(8, n, k, q);
        let why = |r: Result<Vec<KernelLaunch>, QLowerError>| r.unwrap_err().to_string();
        let e = why(lower_qskinny(q, n, 320, 8, DType::BF16, &ok, true, false));
        assert!(e.contains("multiple of 256"), "{e}");
        let e = why(lower_qskinny(q, n, k, 8, DType::F16, &ok, true, false));
        assert!(e.contains("bf16 or f32"), "{e}");
        let mut small = ok;
        small.x.bytes -= 2;
        let e = why(lower_qskinny(q, n, k, 8, DType::BF16, &small, true, false));
        assert!(e.contains("x needs"), "{e}");
        let mut odd = ok;
        odd.w.offset += 8;
        let e = why(lower_qskinny(q, n, k, 8, DType::BF16, &odd, true, false));
        assert!(e.contains("16-byte aligned"), "{e}");
        let mut fp8 = bufs(8, n, k, QuantType::Fp8E4M3);
        fp8.scale = None;
        let e = why(lower_qskinny(
            QuantType::Fp8E4M3,
            n,
            k,
            8,
            DType::BF16,
            &fp8,
            true,
            false,
        ));
        assert!(e.contains("per-row f32 scales"), "{e}");
        let e = why(lower_qskinny(q, n, k, 0, DType::BF16, &ok, true, false));
        assert!(e.contains("no tokens"), "{e}");
    }

    /// The kernel's unit walk needs K to be whole units, and the unit to be
    /// whole scale groups of one MMA step each (16 elements): checked for
    /// every K a type accepts.
    #[test]
    fn every_k_a_type_accepts_is_whole_skinny_units_of_whole_scale_groups() {
        for q in QUANT_TYPES {
            let unit = qskinny_unit(q);
            assert!(unit.is_multiple_of(16));
            let group = match q {
                QuantType::Fp8E4M3 => 16,
                QuantType::Q6K => 16,
                _ => 32,
            };
            assert!(unit.is_multiple_of(group), "{q:?}");
            for m in 1..20u64 {
                let k = m * k_multiple(q);
                assert!(k.is_multiple_of(unit), "{q:?} K = {k}");
            }
        }
    }

    fn norm_at(offset: u64, k: u64) -> QNorm {
        QNorm {
            weight: BufRef {
                region: Region::Weight(7),
                offset,
                bytes: k * 2,
            },
            eps: 1e-5,
            unit_offset: false,
        }
    }

    /// The fused entries of both kernels: names from the prologue and the
    /// epilogue, the norm weight after the bias, `eps`, `unit_offset` and
    /// the mode last, and each launch's x, residual and out offset by its
    /// first token (out in result rows: `n / 2` wide under an activation).
    #[test]
    fn fused_launches_name_their_prologue_and_epilogue_and_offset_every_operand_per_launch() {
        let (n, k) = (1000u64, 512u64);
        for q in QUANT_TYPES {
            for (act, norm, residual, od) in [
                (None, true, false, DType::F32),
                (Some(QAct::Silu), true, false, DType::BF16),
                (Some(QAct::GeluTanh), false, false, DType::BF16),
                (None, true, true, DType::BF16),
            ] {
                let f = QFusion {
                    norm: norm.then(|| norm_at(1 << 12, k)),
                    act,
                };
                let out_n = if act.is_some() { n / 2 } else { n };
                let mut b = bufs(70, n, k, q);
                if residual {
                    b.residual = Some(buf(1 << 27, 70 * n * 2));
                }
                let os = if od == DType::F32 { "f32" } else { "bf16" };
                let name = if norm { "fused_norm" } else { "fused" };
                let mode = match (act, residual) {
                    (Some(QAct::Silu), _) => 1,
                    (Some(QAct::GeluTanh), _) => 2,
                    (None, true) => 3,
                    (None, false) => 0,
                };
                for (t, skinny) in [
                    (1u64, false),
                    (3, false),
                    (19, false),
                    (2, true),
                    (70, true),
                ] {
                    let what = format!("{q:?} t={t} skinny={skinny} act={act:?} norm={norm}");
                    let ls = if skinny {
                        lower_qskinny_fused(q, n, k, t, od, &b, &f, true, true)
                    } else {
                        lower_qgemv_fused(q, n, k, t, od, &b, &f, true, false)
                    }
                    .unwrap();
                    let per = if skinny { 32 } else { 8 };
                    assert_eq!(ls.len() as u64, t.div_ceil(per), "{what}");
                    let lay = layout(q, n, k).unwrap();
                    for (i, l) in ls.iter().enumerate() {
                        let t0 = per * i as u64;
                        let tokens = (t - t0).min(per);
                        let kern = if skinny { "qskinny" } else { "qgemv" };
                        assert!(
                            l.entry.starts_with(&format!("{kern}_{name}_{}_t", stem(q))),
                            "{what}: {}",
                            l.entry
                        );
                        assert!(l.entry.ends_with(&format!("_bf16_{os}")), "{what}");
                        let all = if skinny {
                            qskinny_entry_points()
                        } else {
                            entry_points()
                        };
                        assert!(all.contains(&l.entry), "{what}: {}", l.entry);
                        assert_eq!(l.params.len(), 17, "{what}");
                        assert_eq!(param_buf(l, 0).offset, t0 * k * 2, "{what}");
                        match f.norm {
                            Some(nm) => assert_eq!(param_buf(l, 4), nm.weight, "{what}"),
                            None => assert_eq!(l.params[4], LaunchParam::Null, "{what}"),
                        }
                        if residual {
                            assert_eq!(param_buf(l, 5).offset, (1 << 27) + t0 * n * 2);
                        } else {
                            assert_eq!(l.params[5], LaunchParam::Null, "{what}");
                        }
                        let osz = od.size() as u64;
                        assert_eq!(
                            param_buf(l, 6).offset,
                            (1 << 28) + t0 * out_n * osz,
                            "{what}"
                        );
                        assert_eq!(param_i32(l, 7) as u64, tokens, "{what}");
                        assert_eq!(param_i32(l, 8) as u64, n, "{what}");
                        for r in 0..3 {
                            assert_eq!(l.params[11 + r], LaunchParam::I64(lay.offsets[r] as i64));
                        }
                        let eps = if norm { 1e-5 } else { 0.0 };
                        assert_eq!(l.params[14], LaunchParam::F32(eps), "{what}");
                        assert_eq!(l.params[16], LaunchParam::I32(mode), "{what}");
                        if skinny {
                            let (suffix, grid, threads, shared) = skinny_geometry(q, n, k, tokens);
                            // Eight-token launches of every type but FP8
                            // take the fused ring: its slots in the shared
                            // memory too.
                            let tp = tokens.div_ceil(8) * 8;
                            let ring = skinny_fused_ring_depth(q).filter(|_| tp == 8);
                            assert_eq!(
                                l.entry.contains("_pf"),
                                ring.is_some(),
                                "{what}: {}",
                                l.entry
                            );
                            let ring_bytes = |warps: u64, mt: u64| {
                                ring.map_or(0, |d| {
                                    warps * u64::from(d) * mt * qskinny_slot_bytes(q)
                                }) as u32
                            };
                            if act.is_some() {
                                // Gate and up tiles in every block: two tiles
                                // of 16 rows, n / 2 outputs, at most 8 warps.
                                assert!(l.entry.contains("_r2_"), "{what}");
                                assert_eq!(l.grid, [(n / 2).div_ceil(16) as u32, 1, 1]);
                                assert!(l.block[0] <= 256, "{what}");
                                let warps = l.block[0] as u64 / 32;
                                assert_eq!(
                                    l.shared_bytes,
                                    ((warps * 2 * tp / 8 * 512) as u32).max(ring_bytes(warps, 2))
                                );
                            } else {
                                assert!(l.entry.contains(&suffix), "{what}");
                                assert_eq!((l.grid[0], l.block[0]), (grid, threads), "{what}");
                                let warps = u64::from(threads / 32);
                                let mt = if suffix.ends_with("r2") { 2 } else { 1 };
                                assert_eq!(
                                    l.shared_bytes,
                                    shared.max(ring_bytes(warps, mt)),
                                    "{what}"
                                );
                            }
                            assert!(l.shared_bytes <= 48 * 1024, "{what}");
                        } else {
                            let rows = if act.is_some() { 8 } else { 16 };
                            assert_eq!(l.grid, [out_n.div_ceil(rows) as u32, 1, 1], "{what}");
                            assert_eq!(l.block, [QGEMV_THREADS, 1, 1]);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn fused_lowerings_without_a_prologue_or_activation_are_the_plain_launches() {
        let (n, k, t) = (300u64, 256u64, 5u64);
        for q in QUANT_TYPES {
            let mut b = bufs(t, n, k, q);
            b.residual = Some(buf(1 << 27, t * n * 2));
            let none = QFusion::default();
            assert_eq!(
                lower_qgemv_fused(q, n, k, t, DType::BF16, &b, &none, true, true),
                lower_qgemv(q, n, k, t, DType::BF16, &b, true, true)
            );
            assert_eq!(
                lower_qskinny_fused(q, n, k, t, DType::BF16, &b, &none, true, true),
                lower_qskinny(q, n, k, t, DType::BF16, &b, true, true)
            );
        }
    }

    #[test]
    fn fused_lowerings_refuse_what_their_kernels_cannot_run_and_say_why() {
        let (n, k) = (64u64, 256u64);
        let q = QuantType::Q4K;
        let silu = QFusion {
            norm: Some(norm_at(0, k)),
            act: Some(QAct::Silu),
        };
        let normed = QFusion {
            norm: Some(norm_at(0, k)),
            act: None,
        };
        let ok = bufs(4, n, k, q);
        for skinny in [false, true] {
            let lower = |n: u64, k: u64, od: DType, b: &QGemvBufs, f: &QFusion| {
                if skinny {
                    lower_qskinny_fused(q, n, k, 4, od, b, f, true, false)
                } else {
                    lower_qgemv_fused(q, n, k, 4, od, b, f, true, false)
                }
                .map_err(|e| e.to_string())
            };
            assert!(lower(n, k, DType::BF16, &ok, &silu).is_ok());
            let e = lower(n, k, DType::F32, &ok, &silu).unwrap_err();
            assert!(
                e.contains("f32 result is only possible without an epilogue"),
                "{e}"
            );
            let mut res = ok;
            res.residual = Some(buf(1 << 27, 4 * n * 2));
            let e = lower(n, k, DType::F32, &res, &normed).unwrap_err();
            assert!(e.contains("f32 result"), "{e}");
            let e = lower(n, k, DType::BF16, &res, &silu).unwrap_err();
            assert!(e.contains("cannot share one launch"), "{e}");
            let e = lower(63, k, DType::BF16, &ok, &silu).unwrap_err();
            assert!(e.contains("even number"), "{e}");
            let e = lower(n, 320, DType::BF16, &ok, &silu).unwrap_err();
            assert!(e.contains("multiple of 256"), "{e}");
            let short = QFusion {
                norm: Some(QNorm {
                    weight: BufRef {
                        bytes: k * 2 - 2,
                        ..norm_at(0, k).weight
                    },
                    ..norm_at(0, k)
                }),
                act: None,
            };
            let e = lower(n, k, DType::BF16, &ok, &short).unwrap_err();
            assert!(e.contains("norm weight needs 512 bytes"), "{e}");
            let odd = QFusion {
                norm: Some(norm_at(8, k)),
                act: None,
            };
            let e = lower(n, k, DType::BF16, &ok, &odd).unwrap_err();
            assert!(e.contains("16-byte aligned"), "{e}");
            // Under an activation out holds n / 2 columns, not n.
            let mut half = ok;
            half.out.bytes = 4 * (n / 2) * 2;
            assert!(lower(n, k, DType::BF16, &half, &silu).is_ok());
            half.out.bytes -= 2;
            let e = lower(n, k, DType::BF16, &half, &silu).unwrap_err();
            assert!(e.contains("out needs"), "{e}");
        }
    }

    #[test]
    fn every_integer_dot_geometry_tag_names_its_geometry_back() {
        for g in QDOT_GEOMS {
            assert_eq!(QdotGeom::from_tag(&g.tag()), Some(g));
            assert_eq!(g.rows_per_block(), (8 / g.split_k as u64) * g.rows as u64);
        }
        assert_eq!(QdotGeom::from_tag("plain"), Some(QdotGeom::PLAIN));
        assert_eq!(QdotGeom::from_tag("r9u9k9"), None);
    }

    #[test]
    fn a_geometry_override_that_names_no_geometry_is_refused_with_the_known_tags() {
        let (n, k) = (4096, 14336);
        assert_eq!(
            QdotGeom::for_shape_with(None, n, k),
            Ok(QdotGeom::rule(n, k))
        );
        assert_eq!(
            QdotGeom::for_shape_with(Some(" "), n, k),
            Ok(QdotGeom::rule(n, k))
        );
        assert_eq!(
            QdotGeom::for_shape_with(Some("plain"), n, k),
            Ok(QdotGeom::PLAIN)
        );
        assert_eq!(
            QdotGeom::for_shape_with(Some("auto"), n, k),
            Ok(QdotGeom::by_blocks(n, k))
        );
        assert_eq!(
            QdotGeom::for_shape_with(Some("r4u1k1p"), n, k),
            Ok(QdotGeom::R4U1K1P)
        );
        let e = QdotGeom::for_shape_with(Some("r4u1k1"), n, k).unwrap_err();
        assert!(e.contains("KILN_QDOT_GEOM=r4u1k1 names no"), "{e}");
        assert!(e.contains("r2u2k1p") && e.contains("auto"), "{e}");
    }

    #[test]
    fn a_skinny_prefetch_override_takes_the_instantiated_depths_and_refuses_the_rest() {
        let (fp8, q4k) = (QuantType::Fp8E4M3, QuantType::Q4K);
        for unset in [None, Some(""), Some(" ")] {
            assert_eq!(skinny_prefetch(unset, fp8), Ok(Some(QSKINNY_FP8_PREFETCH)));
            assert_eq!(skinny_prefetch(unset, q4k), Ok(QSKINNY_SMEM_PREFETCH));
            assert_eq!(
                skinny_prefetch(unset, QuantType::Q6K),
                Ok(QSKINNY_SMEM_PREFETCH)
            );
        }
        for q in QUANT_TYPES {
            assert_eq!(skinny_prefetch(Some("0"), q), Ok(None));
        }
        assert!(QSKINNY_PREFETCH.contains(&QSKINNY_FP8_PREFETCH));
        assert!(QSKINNY_SMEM_PREFETCH.is_none_or(|d| QSKINNY_PREFETCH.contains(&d)));
        let entries = qskinny_entry_points();
        for d in QSKINNY_PREFETCH {
            for q in QUANT_TYPES {
                let want = Some(d);
                assert_eq!(skinny_prefetch(Some(&d.to_string()), q), Ok(want));
                for o in ["bf16", "f32"] {
                    let e = format!("qskinny_{}_t8_r1_pf{d}_bf16_{o}", stem(q));
                    assert!(entries.contains(&e), "{e}");
                }
            }
        }
        for bad in ["1", "5", "deep", "-3"] {
            let e = skinny_prefetch(Some(bad), fp8).unwrap_err();
            assert!(e.contains(&format!("KILN_QSKINNY_PF={bad} is not")), "{e}");
        }
    }

    #[test]
    fn a_prefetch_depth_picks_the_ring_entry_only_for_eight_token_one_tile_launches_of_ring_types()
    {
        let buf = |offset, bytes| BufRef {
            region: kiln_ir::plan::Region::Arena,
            offset,
            bytes,
        };
        let entry = |q: QuantType, n: u64, t: u64, pf: Option<u32>| {
            let w = repacked_bytes(q, n, 4096).unwrap();
            let bufs = QGemvBufs {
                x: buf(0, t * 4096 * 2),
                w: BufRef {
                    region: kiln_ir::plan::Region::Weight(0),
                    offset: 0,
                    bytes: w,
                },
                scale: (q == QuantType::Fp8E4M3).then(|| buf(1 << 24, n * 4)),
                bias: None,
                residual: None,
                out: buf(1 << 26, t * n * 2),
            };
            lower_qskinny_with(q, n, 4096, t, DType::BF16, &bufs, true, true, pf).unwrap()[0]
                .entry
                .clone()
        };
        let fp8 = QuantType::Fp8E4M3;
        assert_eq!(entry(fp8, 2560, 8, None), "qskinny_fp8_t8_r1_bf16_bf16");
        assert_eq!(
            entry(fp8, 2560, 8, Some(3)),
            "qskinny_fp8_t8_r1_pf3_bf16_bf16"
        );
        assert_eq!(
            entry(fp8, 2560, 5, Some(2)),
            "qskinny_fp8_t8_r1_pf2_bf16_bf16"
        );
        assert_eq!(
            entry(QuantType::Q4K, 2560, 8, Some(3)),
            "qskinny_q4k_t8_r1_pf3_bf16_bf16"
        );
        // More tokens: the plain loop.
        assert_eq!(
            entry(fp8, 2560, 16, Some(3)),
            "qskinny_fp8_t16_r1_bf16_bf16"
        );
        // Q6_K's four slots a warp would not fit 47 KiB at 16 warps: three.
        assert_eq!(
            entry(QuantType::Q6K, 2560, 8, Some(4)),
            "qskinny_q6k_t8_r1_pf3_bf16_bf16"
        );
        assert_eq!(skinny_ring_depth(QuantType::Q6K, 16, 4), Some(3));
        assert_eq!(skinny_ring_depth(QuantType::Q5K, 16, 4), Some(3));
        assert_eq!(skinny_ring_depth(QuantType::Q4K, 16, 4), Some(4));
        assert_eq!(skinny_ring_depth(QuantType::Q4K, 16, 1), None);
        assert_eq!(skinny_ring_depth(QuantType::Fp8E4M3, 16, 4), Some(4));
        // A depth past the instantiated ones takes the deepest; below them, none.
        assert_eq!(
            entry(fp8, 2560, 8, Some(7)),
            "qskinny_fp8_t8_r1_pf4_bf16_bf16"
        );
        assert_eq!(entry(fp8, 2560, 8, Some(1)), "qskinny_fp8_t8_r1_bf16_bf16");
        for e in [entry(fp8, 2560, 8, Some(4)), entry(fp8, 2560, 8, None)] {
            assert!(qskinny_entry_points().contains(&e), "{e}");
        }
    }

    #[test]
    fn a_skinny_warps_override_takes_powers_of_two_up_to_sixteen_and_refuses_the_rest() {
        assert_eq!(skinny_warps_cap(None), Ok(None));
        assert_eq!(skinny_warps_cap(Some(" ")), Ok(None));
        for w in [1u64, 2, 4, 8, 16] {
            assert_eq!(skinny_warps_cap(Some(&w.to_string())), Ok(Some(w)));
        }
        for bad in ["0", "3", "32", "four", "-4"] {
            let e = skinny_warps_cap(Some(bad)).unwrap_err();
            assert!(
                e.contains(&format!("KILN_QSKINNY_WARPS={bad} is not")),
                "{e}"
            );
            assert!(e.contains("1, 2, 4, 8 or 16"), "{e}");
        }
    }

    #[test]
    fn the_block_count_rule_keeps_the_plain_geometry_only_where_it_fills_two_waves() {
        // Llama-3-8B: gate_up (28672 rows) and the lm_head keep the plain
        // geometry; qkv (6144: 192 blocks) takes one vector per row of
        // four, pipelined; o and down (4096: 128 blocks) twice the
        // blocks. Qwen3-0.6B: qkv (K = 1024) and gate_up (192 blocks) as
        // Llama's qkv, o (K = 2048) and down as Llama's o.
        assert_eq!(QdotGeom::by_blocks(28672, 4096), QdotGeom::PLAIN);
        assert_eq!(QdotGeom::by_blocks(128256, 4096), QdotGeom::PLAIN);
        assert_eq!(QdotGeom::by_blocks(6144, 4096), QdotGeom::R4U1K1P);
        assert_eq!(QdotGeom::by_blocks(4096, 4096), QdotGeom::R2U2K1P);
        assert_eq!(QdotGeom::by_blocks(4096, 14336), QdotGeom::R2U2K1P);
        assert_eq!(QdotGeom::by_blocks(4096, 1024), QdotGeom::R4U1K1P);
        assert_eq!(QdotGeom::by_blocks(6144, 1024), QdotGeom::R4U1K1P);
        assert_eq!(QdotGeom::by_blocks(1024, 2048), QdotGeom::R2U2K1P);
        assert_eq!(QdotGeom::by_blocks(1024, 3072), QdotGeom::R2U2K1P);
        for g in [QdotGeom::R2U2K1P, QdotGeom::R4U1K1P] {
            assert!(QDOT_GEOMS.contains(&g), "{g:?} is instantiated");
        }
    }

    #[test]
    fn every_entry_point_is_listed_once() {
        for list in [entry_points(), qskinny_entry_points()] {
            let set: std::collections::BTreeSet<&String> = list.iter().collect();
            assert_eq!(set.len(), list.len());
        }
        // Plain, fused and gather entries of qgemv, the integer-dot entries
        // in every geometry (plain, fused and rope); plain and fused of
        // qskinny, and every type's ring entries.
        assert_eq!(
            entry_points().len(),
            8 * (8 + 12 + 1) + QDOT_GEOMS.len() * 3 * (5 + 2)
        );
        assert_eq!(
            qskinny_entry_points().len(),
            8 * (16 + 20 + 2 * QSKINNY_PREFETCH.len()) + 7 * 4
        );
    }

    #[test]
    fn gather_launches_cover_every_vector_of_each_id_and_refuse_bad_operands() {
        for q in QUANT_TYPES {
            let (n, k, t) = (50u64, 4096u64, 3u64);
            let w = buf(0, repacked_bytes(q, n, k).unwrap());
            let scale = (q == QuantType::Fp8E4M3).then(|| buf(1 << 20, n * 4));
            let l = lower_qgather(
                q,
                n,
                k,
                t,
                buf(1 << 21, 12),
                w,
                scale,
                buf(1 << 22, t * k * 2),
                true,
            )
            .unwrap();
            assert!(entry_points().contains(&l.entry));
            let epv = if matches!(q, QuantType::Q8_0 | QuantType::Fp8E4M3) {
                16
            } else {
                32
            };
            assert_eq!(
                l.grid[0] as u64 * QGEMV_THREADS as u64,
                (k / epv).next_multiple_of(256)
            );
            assert_eq!(l.grid[1], 3);
            let e = lower_qgather(
                q,
                n,
                k,
                t,
                buf(1 << 21, 8),
                w,
                scale,
                buf(1 << 22, t * k * 2),
                true,
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains("ids needs 12 bytes"), "{e}");
        }
    }
}
