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

/// The kept-quant storage type of a GGUF tensor type: the types `kiln import
/// --keep-quant` keeps as stored and whose decoders live in
/// `kiln_kernels::quant`. `None` for every other type.
pub fn quant_type(ty: GgmlType) -> Option<kiln_ir::QuantType> {
    use kiln_ir::QuantType as Q;
    Some(match ty {
        GgmlType::Q8_0 => Q::Q8_0,
        GgmlType::Q4_0 => Q::Q4_0,
        GgmlType::Q4_1 => Q::Q4_1,
        GgmlType::Q5_0 => Q::Q5_0,
        GgmlType::Q4K => Q::Q4K,
        GgmlType::Q5K => Q::Q5K,
        GgmlType::Q6K => Q::Q6K,
        _ => return None,
    })
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
        GgmlType::Q2K | GgmlType::Q3K => {
            for (o, b) in out
                .chunks_exact_mut(QK_K)
                .zip(data.chunks_exact(ty.block_bytes() as usize))
            {
                if ty == GgmlType::Q2K {
                    dequant_q2k(b, o)
                } else {
                    dequant_q3k(b, o)
                }
            }
        }
        GgmlType::Q5_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(data.chunks_exact(24)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
                let (lo, hi) = o.split_at_mut(QK / 2);
                for (j, &q) in b[8..24].iter().enumerate() {
                    let h0 = ((qh >> j) & 1) << 4;
                    let h1 = ((qh >> (j + 16)) & 1) << 4;
                    lo[j] = (u32::from(q & 0x0f) | h0) as f32 * d + m;
                    hi[j] = (u32::from(q >> 4) | h1) as f32 * d + m;
                }
            }
        }
        _ => {
            // The storage types the CPU and GPU kernels read: one decoder,
            // in kiln_kernels::quant.
            let q = quant_type(ty).expect("is_supported admitted a kept-quant type");
            for (o, b) in out
                .chunks_exact_mut(q.block_elems())
                .zip(data.chunks_exact(q.block_bytes()))
            {
                kiln_kernels::quant::dequantize_block(q, b, o);
            }
        }
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
