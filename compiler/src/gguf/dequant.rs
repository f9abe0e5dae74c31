//! Dequantization of GGML tensor data to f32, and the matching reference
//! quantizers.
//!
//! Supported: F32, F16, BF16, the 32-element block formats Q8_0, Q4_0,
//! Q4_1, Q5_0 and Q5_1, and the 256-element K-quant super-blocks Q2_K,
//! Q3_K, Q4_K, Q5_K and Q6_K (the default SmolLM2 GGUF is Q4_1 with a Q8_0
//! embedding; Q4_K_M files, the most common download, mix Q4_K, Q6_K, Q5_0,
//! Q8_0 and F32). Block layouts, little-endian, `f16` scales:
//! - Q8_0, 34 bytes: `d`, then 32 × i8 `q`; value `q·d`.
//! - Q4_0, 18 bytes: `d`, then 16 bytes of nibbles; byte `j` holds
//!   element `j` in its low nibble and element `j+16` in its high nibble;
//!   value `(q−8)·d`.
//! - Q4_1, 20 bytes: `d`, `m`, then 16 bytes of nibbles laid out as in
//!   Q4_0; value `q·d + m`.
//! - Q5_0, 22 bytes: `d`, a u32 `qh` of fifth bits (bit `e` for element
//!   `e`), 16 bytes of nibbles as in Q4_0; value `(q−16)·d`.
//! - Q5_1, 24 bytes: `d`, `m`, `qh`, nibbles; value `q·d + m`.
//! - Q2_K, 84 bytes: 16 scale bytes (low nibble scale, high nibble min, one
//!   per 16 elements), 64 bytes of 2-bit values, `d`, `dmin`; value
//!   `d·sc·q − dmin·m`.
//! - Q3_K, 110 bytes: 32 bytes `hmask` (third bits), 64 bytes of 2-bit low
//!   parts, 12 bytes of sixteen packed 6-bit scales, `d`; value
//!   `d·(sc−32)·(q − 4 if the high bit is clear)`.
//! - Q4_K, 144 bytes: `d`, `dmin`, 12 bytes of eight 6-bit scale/min pairs
//!   (one per 32 elements), 128 bytes of nibbles; value `d·sc·q − dmin·m`.
//! - Q5_K, 176 bytes: as Q4_K plus 32 bytes of fifth bits before the nibbles.
//! - Q6_K, 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit high
//!   parts, 16 × i8 scales (one per 16 elements), `d`; value `d·sc·(q−32)`.
//!
//! The element order inside each K-quant block follows ggml's
//! `dequantize_row_*` exactly; the tests check it against a per-element
//! restatement of the formats and against the `gguf` Python package.
//!
//! Q8_1/Q8_K (activation-only formats), the I-quants, TQ, MXFP4/NVFP4 and
//! the integer types are deliberately absent: each is an error naming it,
//! never a guess.
//!
//! The quantizers exist so tests can write GGUF files holding real quantized
//! blocks; they are simple round-to-nearest and make no claim to match
//! llama.cpp's output bit for bit. The K-quants and Q5 formats have no
//! quantizer here: tests build those blocks from random bytes
//! ([`random_blocks`]).

use super::types::GgmlType;
use half::{bf16, f16};

/// Elements per block of the Q formats here.
pub const QK: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    #[error("kiln cannot dequantize {0} (supported: {SUPPORTED_LIST})")]
    Unsupported(GgmlType),
    #[error("{n} elements are not a whole number of {ty} blocks of {block}")]
    NotWholeBlocks { ty: GgmlType, n: usize, block: u64 },
    #[error("{ty} data for {n} elements must be {expected} bytes, got {got}")]
    WrongLength {
        ty: GgmlType,
        n: usize,
        expected: usize,
        got: usize,
    },
}

/// The types [`dequantize`] handles, in the order error messages list them.
pub const SUPPORTED: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// [`SUPPORTED`] as text, for error messages.
pub const SUPPORTED_LIST: &str =
    "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K";

/// True when [`dequantize`] handles `ty`.
pub fn is_supported(ty: GgmlType) -> bool {
    SUPPORTED.contains(&ty)
}

/// Types [`quantize`] can encode (a subset of [`SUPPORTED`]).
pub fn can_quantize(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q4_1
    )
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// K-quant super-block size.
pub const QK_K: usize = 256;

/// Scale and min `j` (0..8) of the 12 packed 6-bit scale bytes of Q4_K and
/// Q5_K: pairs 0..4 are the low six bits of bytes `j` and `j+4`; pairs 4..8
/// take their low four bits from byte `j+4` and their top two from the top
/// bits of bytes `j−4` and `j`.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    if j < 4 {
        (f32::from(q[j] & 63), f32::from(q[j + 4] & 63))
    } else {
        let sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        let m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        (f32::from(sc), f32::from(m))
    }
}

fn dequant_q2k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    let mut is = 0;
    let mut out = 0;
    for half in 0..2 {
        let q = &qs[32 * half..32 * half + 32];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * f32::from(sc & 0x0f);
                let ml = dmin * f32::from(sc >> 4);
                for &byte in &q[16 * part..16 * part + 16] {
                    y[out] = dl * f32::from((byte >> shift) & 3) - ml;
                    out += 1;
                }
            }
        }
    }
}

fn dequant_q3k(b: &[u8], y: &mut [f32]) {
    let (hmask, qs, packed) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    // Unpack sixteen 6-bit scales: low nibbles from bytes 0..8, two high
    // bits each from bytes 8..12.
    let mut scales = [0i32; 16];
    for (i, s) in scales.iter_mut().enumerate() {
        let low = if i < 8 {
            packed[i] & 0x0f
        } else {
            packed[i - 8] >> 4
        };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        *s = i32::from(low | (high << 4)) - 32;
    }
    let mut is = 0;
    let mut bit = 0u32;
    let mut out = 0;
    for half in 0..2 {
        let q = &qs[32 * half..32 * half + 32];
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let dl = d * scales[is] as f32;
                is += 1;
                for l in 16 * part..16 * part + 16 {
                    let low = i32::from((q[l] >> shift) & 3);
                    let high = if hmask[l] & (1 << bit) != 0 { 0 } else { 4 };
                    y[out] = dl * (low - high) as f32;
                    out += 1;
                }
            }
            bit += 1;
        }
    }
}

fn dequant_q45k(b: &[u8], y: &mut [f32], five: bool) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let (qh, ql): (&[u8], &[u8]) = if five {
        (&b[16..48], &b[48..176])
    } else {
        (&[], &b[16..144])
    };
    for chunk in 0..4 {
        let q = &ql[32 * chunk..32 * chunk + 32];
        for (nib, sub) in [(0u8, 2 * chunk), (4u8, 2 * chunk + 1)] {
            let (sc, m) = scale_min_k4(sub, scales);
            let (dl, ml) = (d * sc, dmin * m);
            let out = &mut y[32 * sub..32 * sub + 32];
            for l in 0..32 {
                let mut v = (q[l] >> nib) & 0x0f;
                if five && qh[l] & (1 << sub) != 0 {
                    v += 16;
                }
                out[l] = dl * f32::from(v) - ml;
            }
        }
    }
}

fn dequant_q6k(b: &[u8], y: &mut [f32]) {
    let (ql, qh) = (&b[0..128], &b[128..192]);
    let scales = &b[192..208];
    let d = f16_at(b, 208);
    for half in 0..2 {
        let (ql, qh) = (&ql[64 * half..], &qh[32 * half..]);
        let sc = &scales[8 * half..];
        let y = &mut y[128 * half..];
        for l in 0..32 {
            let is = l / 16;
            let q1 = i32::from((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32;
            let q2 = i32::from((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
            let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            let s = |k: usize| f32::from(sc[is + 2 * k] as i8);
            y[l] = d * s(0) * q1 as f32;
            y[l + 32] = d * s(1) * q2 as f32;
            y[l + 64] = d * s(2) * q3 as f32;
            y[l + 96] = d * s(3) * q4 as f32;
        }
    }
}

/// `blocks` random blocks of `ty` whose f16 scales are finite and small
/// (every other byte is uniform), for tests of the dequantizers and for
/// fixtures of types [`quantize`] cannot encode. Deterministic in `seed`.
pub fn random_blocks(ty: GgmlType, blocks: usize, seed: u64) -> Vec<u8> {
    let mut rng = kiln_ir::rng::SplitMix64::new(seed);
    let len = blocks * ty.block_bytes() as usize;
    let mut out: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
    // Offsets of the f16 scales within one block.
    let scale_at: &[usize] = match ty {
        GgmlType::F16 | GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q6K => &[208],
        _ => &[],
    };
    for block in out.chunks_exact_mut(ty.block_bytes() as usize) {
        for &at in scale_at {
            // Uniform in ±[2^-12, 2^-4): normal f16 values, never inf/NaN.
            let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            let mag = (2f64).powf(-12.0 + 8.0 * u);
            let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
            block[at..at + 2].copy_from_slice(&f16::from_f64(sign * mag).to_le_bytes());
        }
    }
    out
}

/// Bytes that `n` elements of `ty` occupy, or `None` when `n` is not a
/// whole number of blocks.
pub fn byte_len(ty: GgmlType, n: usize) -> Option<usize> {
    let block = ty.block_size() as usize;
    n.is_multiple_of(block)
        .then(|| n / block * ty.block_bytes() as usize)
}

/// Decodes `n` elements of type `ty` from `data` to f32.
pub fn dequantize(ty: GgmlType, data: &[u8], n: usize) -> Result<Vec<f32>, DequantError> {
    if !is_supported(ty) {
        return Err(DequantError::Unsupported(ty));
    }
    let expected = byte_len(ty, n).ok_or(DequantError::NotWholeBlocks {
        ty,
        n,
        block: ty.block_size(),
    })?;
    if expected != data.len() {
        return Err(DequantError::WrongLength {
            ty,
            n,
            expected,
            got: data.len(),
        });
    }
    let mut out = vec![0f32; n];
    match ty {
        GgmlType::F32 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(data.chunks_exact(34)) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                for (x, &q) in o.iter_mut().zip(&b[2..34]) {
                    *x = f32::from(q as i8) * d;
                }
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(data.chunks_exact(18)) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                let (lo, hi) = o.split_at_mut(QK / 2);
                for (j, &q) in b[2..18].iter().enumerate() {
                    lo[j] = (i32::from(q & 0x0f) - 8) as f32 * d;
                    hi[j] = (i32::from(q >> 4) - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(data.chunks_exact(20)) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                let m = f16::from_le_bytes([b[2], b[3]]).to_f32();
                let (lo, hi) = o.split_at_mut(QK / 2);
                for (j, &q) in b[4..20].iter().enumerate() {
                    lo[j] = f32::from(q & 0x0f) * d + m;
                    hi[j] = f32::from(q >> 4) * d + m;
                }
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let one = ty == GgmlType::Q5_1;
            let bytes = ty.block_bytes() as usize;
            for (o, b) in out.chunks_exact_mut(QK).zip(data.chunks_exact(bytes)) {
                let d = f16_at(b, 0);
                let (m, at) = if one { (f16_at(b, 2), 4) } else { (0.0, 2) };
                let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
                let offset = if one { 0 } else { 16 };
                let (lo, hi) = o.split_at_mut(QK / 2);
                for (j, &q) in b[at + 4..at + 20].iter().enumerate() {
                    let h0 = ((qh >> j) & 1) << 4;
                    let h1 = ((qh >> (j + 16)) & 1) << 4;
                    let x0 = (u32::from(q & 0x0f) | h0) as i32 - offset;
                    let x1 = (u32::from(q >> 4) | h1) as i32 - offset;
                    lo[j] = x0 as f32 * d + m;
                    hi[j] = x1 as f32 * d + m;
                }
            }
        }
        GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => {
            let bytes = ty.block_bytes() as usize;
            for (o, b) in out.chunks_exact_mut(QK_K).zip(data.chunks_exact(bytes)) {
                match ty {
                    GgmlType::Q2K => dequant_q2k(b, o),
                    GgmlType::Q3K => dequant_q3k(b, o),
                    GgmlType::Q4K => dequant_q45k(b, o, false),
                    GgmlType::Q5K => dequant_q45k(b, o, true),
                    _ => dequant_q6k(b, o),
                }
            }
        }
        _ => unreachable!("is_supported admitted {ty}"),
    }
    Ok(out)
}

/// Encodes f32 values as `ty`. `x.len()` must be a multiple of the block
/// size for the Q formats. Supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1
/// ([`can_quantize`]).
pub fn quantize(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>, DequantError> {
    if !can_quantize(ty) {
        return Err(DequantError::Unsupported(ty));
    }
    let len = byte_len(ty, x.len()).ok_or(DequantError::NotWholeBlocks {
        ty,
        n: x.len(),
        block: ty.block_size(),
    })?;
    let mut out = Vec::with_capacity(len);
    match ty {
        GgmlType::F32 => x.iter().for_each(|v| out.extend(v.to_le_bytes())),
        GgmlType::F16 => x
            .iter()
            .for_each(|v| out.extend(f16::from_f32(*v).to_le_bytes())),
        GgmlType::BF16 => x
            .iter()
            .for_each(|v| out.extend(bf16::from_f32(*v).to_le_bytes())),
        GgmlType::Q8_0 => {
            for blk in x.chunks_exact(QK) {
                let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(
                    blk.iter()
                        .map(|v| (v * id).round().clamp(-127.0, 127.0) as i8 as u8),
                );
            }
        }
        GgmlType::Q4_0 => {
            for blk in x.chunks_exact(QK) {
                // The value of largest magnitude maps to -8, so the other
                // end of the range reaches +7.
                let max = blk
                    .iter()
                    .copied()
                    .fold(0f32, |a, v| if v.abs() > a.abs() { v } else { a });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q = |v: f32| (v * id + 8.5).floor().clamp(0.0, 15.0) as u8;
                out.extend(f16::from_f32(d).to_le_bytes());
                for j in 0..QK / 2 {
                    out.push(q(blk[j]) | (q(blk[j + QK / 2]) << 4));
                }
            }
        }
        GgmlType::Q4_1 => {
            for blk in x.chunks_exact(QK) {
                let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
                let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q = |v: f32| ((v - min) * id + 0.5).floor().clamp(0.0, 15.0) as u8;
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(f16::from_f32(min).to_le_bytes());
                for j in 0..QK / 2 {
                    out.push(q(blk[j]) | (q(blk[j + QK / 2]) << 4));
                }
            }
        }
        _ => unreachable!("can_quantize admitted {ty}"),
    }
    Ok(out)
}
