//! The layout the CPU backend keeps quantized weights in, and the repack
//! from the stored (GGUF) layout into it at load.
//!
//! Why a layout of its own: a decode-step GEMV over GGUF rows computes one
//! output at a time, so every 32 weights need a horizontal integer sum, a
//! scalar f16 scale conversion and a scalar scale multiply (about 30
//! instructions per 32 weights). Interleaving [`GROUP`] rows puts the
//! output rows in SIMD lanes instead: four consecutive weights of each of
//! 8 rows fill one 32-byte vector, one broadcast of four activations and
//! one integer dot (`vpdpbusd`, or `maddubs`+`madd`) advance all 8 rows, and
//! the 8 rows' f16 scales convert with one instruction. The block formats
//! whose 32 weights share one scale (Q8_0, Q4_0, Q4_1, Q5_0) take this
//! layout; the others keep the stored layout (the identity repack).
//!
//! The layout is a permutation of the stored bits, so a weight's size is
//! the same in both ([`kiln_ir::TensorType::size_bytes`] needs no CPU
//! term). For an `[n, k]` weight of blocks of 32, rows `8g..8g+8` form group
//! `g` (`n / 8` groups, in order); a group holds, for each block `b` in
//! order, one *group block* of `8 · block_bytes` bytes:
//!
//! ```text
//! d[8]     f16   the 8 rows' block scales           (16 bytes)
//! m[8]     f16   Q4_1 only: the 8 rows' block mins  (16 bytes)
//! h[32]    u8    Q5_0 only: the 8 rows' fifth bits as bit planes (32 bytes):
//!                bit 2c+u of byte 4r+j is the fifth bit of element 16u+4c+j
//!                of row r (so chunk c's low nibbles take bit 2c, its high
//!                nibbles bit 2c+1, of the byte in the same place as theirs)
//! chunks   for c in 0..C, for r in 0..8: the stored quant bytes 4c..4c+4 of row r
//!          (C = 4 for the 4- and 5-bit types: chunk c's low nibbles are
//!          elements 4c..4c+4, its high nibbles 16+4c..16+4c+4; C = 8 for Q8_0)
//! ```
//!
//! The `n % 8` rows that do not fill a group follow the groups in the
//! stored layout. FP8 and the K-quants are kept as stored.
//!
//! Not here: the kernels that read it (`cpu::qgroup`), GPU layouts
//! ([`crate::quant_gpu`]).

use crate::quant::{check_tensor_len, QuantError};
use kiln_ir::QuantType;

/// Rows interleaved per group.
pub const GROUP: usize = 8;

/// Whether the CPU keeps `q` interleaved (otherwise as stored).
pub fn interleaves(q: QuantType) -> bool {
    matches!(
        q,
        QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0
    )
}

/// `(header bytes, quant bytes)` of one row's block of `q` in the stored
/// layout: the header (`d`, and `m` for Q4_1, `qh` for Q5_0) and the
/// quants. A group block's header is [`GROUP`] times the first.
pub(crate) fn split(q: QuantType) -> (usize, usize) {
    match q {
        QuantType::Q4_1 => (4, 16),
        QuantType::Q5_0 => (6, 16),
        QuantType::Q4_0 => (2, 16),
        _ => (2, 32),
    }
}

/// One Q5_0 row's 32 fifth bits `qh` (bit `e` for element `e`) as the four
/// bit-plane bytes of the group layout: bit `2c+u` of byte `j` is bit
/// `16u + 4c + j` of `qh`.
pub(crate) fn fifth_planes(qh: u32) -> [u8; 4] {
    std::array::from_fn(|j| {
        let mut v = 0u8;
        for c in 0..4 {
            for u in 0..2 {
                v |= (((qh >> (16 * u + 4 * c + j)) & 1) as u8) << (2 * c + u);
            }
        }
        v
    })
}

/// The inverse of [`fifth_planes`].
fn fifth_bits(planes: [u8; 4]) -> u32 {
    let mut qh = 0u32;
    for (j, v) in planes.iter().enumerate() {
        for c in 0..4 {
            for u in 0..2 {
                qh |= u32::from((v >> (2 * c + u)) & 1) << (16 * u + 4 * c + j);
            }
        }
    }
    qh
}

/// Repacks an `[n, k]` weight of `q` from the stored layout into the CPU
/// layout (a copy for the types kept as stored).
pub fn repack(q: QuantType, src: &[u8], n: usize, k: usize) -> Result<Vec<u8>, QuantError> {
    check_tensor_len(q, src.len(), n, k)?;
    if !interleaves(q) {
        return Ok(src.to_vec());
    }
    let bb = q.block_bytes();
    let blocks = k / 32;
    let rb = blocks * bb;
    let (hdr, qb) = split(q);
    let mut out = vec![0u8; src.len()];
    let groups = n / GROUP;
    for g in 0..groups {
        for b in 0..blocks {
            let dst = &mut out[g * GROUP * rb + b * GROUP * bb..][..GROUP * bb];
            for r in 0..GROUP {
                let blk = &src[(g * GROUP + r) * rb + b * bb..][..bb];
                dst[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
                if q == QuantType::Q4_1 {
                    dst[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&blk[2..4]);
                }
                if q == QuantType::Q5_0 {
                    let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                    dst[16 + 4 * r..16 + 4 * r + 4].copy_from_slice(&fifth_planes(qh));
                }
                for c in 0..qb / 4 {
                    let at = GROUP * hdr + c * 4 * GROUP + 4 * r;
                    dst[at..at + 4].copy_from_slice(&blk[hdr + 4 * c..hdr + 4 * c + 4]);
                }
            }
        }
    }
    let tail = groups * GROUP * rb;
    out[tail..].copy_from_slice(&src[tail..]);
    Ok(out)
}

/// Row `row` of an `[n, k]` weight in the CPU layout, written into `out`
/// (`row_bytes(k)` bytes) in the stored layout: what a row gather reads.
/// The caller checked `row < n` and the lengths.
pub fn stored_row(q: QuantType, data: &[u8], n: usize, k: usize, row: usize, out: &mut [u8]) {
    let bb = q.block_bytes();
    let rb = q.row_bytes(k).unwrap_or(0);
    let groups = n / GROUP;
    if !interleaves(q) || row >= groups * GROUP {
        out.copy_from_slice(&data[row * rb..(row + 1) * rb]);
        return;
    }
    let (hdr, qb) = split(q);
    let (g, r) = (row / GROUP, row % GROUP);
    for b in 0..k / 32 {
        let src = &data[g * GROUP * rb + b * GROUP * bb..][..GROUP * bb];
        let blk = &mut out[b * bb..(b + 1) * bb];
        blk[0..2].copy_from_slice(&src[2 * r..2 * r + 2]);
        if q == QuantType::Q4_1 {
            blk[2..4].copy_from_slice(&src[16 + 2 * r..16 + 2 * r + 2]);
        }
        if q == QuantType::Q5_0 {
            let planes = [
                src[16 + 4 * r],
                src[17 + 4 * r],
                src[18 + 4 * r],
                src[19 + 4 * r],
            ];
            blk[2..6].copy_from_slice(&fifth_bits(planes).to_le_bytes());
        }
        for c in 0..qb / 4 {
            let at = GROUP * hdr + c * 4 * GROUP + 4 * r;
            blk[hdr + 4 * c..hdr + 4 * c + 4].copy_from_slice(&src[at..at + 4]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::random_tensor;

    #[test]
    fn every_row_read_back_from_the_cpu_layout_is_the_stored_row() {
        for q in QuantType::ALL {
            for n in [1, 7, 8, 9, 16, 21] {
                let k = q.block_elems() * 3 + if q == QuantType::Fp8E4M3 { 5 } else { 0 };
                let src = if q == QuantType::Fp8E4M3 {
                    continue;
                } else {
                    random_tensor(q, n, k, 11 + n as u64)
                };
                let packed = repack(q, &src, n, k).unwrap();
                assert_eq!(packed.len(), src.len(), "{q}: the layout keeps the size");
                if interleaves(q) && n >= GROUP {
                    assert_ne!(packed, src, "{q} n={n}: nothing was interleaved");
                }
                let rb = q.row_bytes(k).unwrap();
                let mut row = vec![0u8; rb];
                for r in 0..n {
                    stored_row(q, &packed, n, k, r, &mut row);
                    assert_eq!(row, src[r * rb..(r + 1) * rb], "{q} n={n} row {r}");
                }
            }
        }
    }

    #[test]
    fn a_weight_of_the_wrong_length_is_refused() {
        let q = QuantType::Q4_1;
        let src = random_tensor(q, 8, 64, 1);
        assert!(repack(q, &src[..src.len() - 1], 8, 64).is_err());
    }
}
