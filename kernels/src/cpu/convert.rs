//! Byte-level conversions between kiln's storage dtypes and f32/i32, for
//! tests, tools and other crates that hand tensors to [`super::execute_on_vecs`].
//!
//! Bytes are little-endian, as the tensors are in device memory. Rounding to
//! bf16/f16 is round-to-nearest-even, exactly what the kernels do when they
//! store a result. Not here: the kernels' own (in-place, unaligned-pointer)
//! loads and stores, which live in `buf`.

use half::{bf16, f16};
use kiln_ir::DType;

/// Decodes `bytes` of `dtype` to f32 (exact for bf16/f16/f32; i32 values are
/// converted numerically). A trailing partial element is ignored.
pub fn to_f32(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::I32 => to_i32(bytes).into_iter().map(|v| v as f32).collect(),
    }
}

/// Encodes `values` as `dtype` bytes, rounding to nearest even (i32:
/// saturating truncation toward zero, NaN to 0).
pub fn from_f32(dtype: DType, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size());
    for &v in values {
        match dtype {
            DType::BF16 => out.extend_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f32(v).to_bits().to_le_bytes()),
            DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            DType::I32 => out.extend_from_slice(&(v as i32).to_le_bytes()),
        }
    }
    out
}

/// Decodes little-endian i32 bytes. A trailing partial element is ignored.
pub fn to_i32(bytes: &[u8]) -> Vec<i32> {
    bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Encodes i32 values as little-endian bytes.
pub fn from_i32(values: &[i32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// `v` after a round trip through `dtype` (what storing a result does).
pub fn round_f32(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_f32(v).to_f32(),
        DType::F16 => f16::from_f32(v).to_f32(),
        DType::F32 => v,
        DType::I32 => v as i32 as f32,
    }
}
