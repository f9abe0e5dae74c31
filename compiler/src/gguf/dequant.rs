//! Dequantization of GGML tensor data to f32, and the matching reference
//! quantizers.
//!
//! Supported: F32, F16, BF16 and the three simple 32-element block formats
//! Q8_0, Q4_0 and Q4_1 (the default SmolLM2 GGUF is Q4_1 with a Q8_0
//! embedding). Block layouts, little-endian:
//! - Q8_0, 34 bytes: f16 scale `d`, then 32 × i8 `q`; value `q·d`.
//! - Q4_0, 18 bytes: f16 `d`, then 16 bytes of nibbles; byte `j` holds
//!   element `j` in its low nibble and element `j+16` in its high nibble;
//!   value `(q−8)·d`.
//! - Q4_1, 20 bytes: f16 `d`, f16 `m`, then 16 bytes of nibbles laid out as
//!   in Q4_0; value `q·d + m`.
//!
//! K-quants, I-quants and the other block formats are deliberately absent:
//! every other type is an error naming it, never a guess.
//!
//! The quantizers exist so tests can write GGUF files holding real quantized
//! blocks; they are simple round-to-nearest and make no claim to match
//! llama.cpp's output bit for bit.

use super::types::GgmlType;
use half::{bf16, f16};

/// Elements per block of the Q formats here.
pub const QK: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    #[error("kiln cannot dequantize {0} (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)")]
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

/// True when [`dequantize`] handles `ty`.
pub fn is_supported(ty: GgmlType) -> bool {
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
        _ => unreachable!("is_supported admitted {ty}"),
    }
    Ok(out)
}

/// Encodes f32 values as `ty`. `x.len()` must be a multiple of the block
/// size for the Q formats. Supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1.
pub fn quantize(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>, DequantError> {
    if !is_supported(ty) {
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
        _ => unreachable!("is_supported admitted {ty}"),
    }
    Ok(out)
}
