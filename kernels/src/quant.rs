//! Block decoders of the quantized storage types ([`QuantType`]): the one
//! statement of each format's formula that the compiler's GGUF import
//! (dequantization to bf16), the CPU kernels (their tests and the FP8
//! path) and the GPU kernels' tests share.
//!
//! Formats, all little-endian with `f16` scales (ggml's layouts exactly):
//! - Q8_0, 34 bytes / 32 elements: `d`, 32 × i8 `q`; value `q·d`.
//! - Q4_0, 18 bytes: `d`, 16 bytes of nibbles; byte `j` holds element `j`
//!   (low nibble) and `j+16` (high nibble); value `(q−8)·d`.
//! - Q4_1, 20 bytes: `d`, `m`, nibbles as Q4_0; value `q·d + m`.
//! - Q5_0, 22 bytes: `d`, u32 `qh` of fifth bits (bit `e` for element `e`),
//!   nibbles as Q4_0; value `(q−16)·d`.
//! - Q4_K, 144 bytes / 256: `d`, `dmin`, 12 bytes of eight packed 6-bit
//!   scale/min pairs (one per 32 elements), 128 bytes of nibbles (bytes
//!   `32c..32c+32` hold sub-block `2c` in their low and `2c+1` in their high
//!   nibbles); value `d·sc·q − dmin·m`.
//! - Q5_K, 176 bytes: as Q4_K with 32 bytes of fifth bits (`qh[l]` bit `s`
//!   for element `l` of sub-block `s`) before the nibbles.
//! - Q6_K, 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit high
//!   parts, 16 × i8 scales (one per 16 elements), `d`; value `d·sc·(q−32)`.
//! - FP8 e4m3 (OCP "E4M3FN": bias 7, no infinities, `S.1111.111` is NaN,
//!   largest finite 448): one byte per element; a `[N, K]` tensor is `N`
//!   rows of `K` bytes followed by `N` f32 row scales.
//!
//! Not here: the GGUF types that are only ever dequantized at import (Q5_1,
//! Q2_K, Q3_K stay in the compiler's `gguf::dequant`), any GPU repacking
//! (`quant_gpu`), and the fast dot products (`cpu::qmatmul`).

use half::f16;
pub use kiln_ir::QuantType;

/// A quantized buffer that does not fit its type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("{qtype} rows of {k} elements are not a whole number of {block}-element blocks; keep this tensor dense")]
    NotWholeBlocks {
        qtype: QuantType,
        k: usize,
        block: usize,
    },
    #[error("{qtype} data for {what} must be {expected} bytes, got {got}; the tensor is damaged or was written for another shape: re-import the model")]
    WrongLength {
        qtype: QuantType,
        what: String,
        expected: usize,
        got: usize,
    },
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Scale and min `j` (0..8) of the 12 packed 6-bit scale bytes of Q4_K and
/// Q5_K: pairs 0..4 are the low six bits of bytes `j` and `j+4`; pairs 4..8
/// take their low four bits from byte `j+4` and their top two from the top
/// bits of bytes `j−4` and `j`.
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        let sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        let m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        (sc, m)
    }
}

/// The f32 value of an e4m3 byte (exact; NaN for `0x7f`/`0xff`).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = (b >> 3) & 0x0f;
    let m = b & 7;
    if e == 0x0f && m == 7 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        f32::from(m) * (2f32).powi(-9)
    } else {
        (1.0 + f32::from(m) / 8.0) * (2f32).powi(i32::from(e) - 7)
    };
    sign * mag
}

/// The e4m3 byte nearest to `x` (round to nearest even), saturating to
/// ±448; NaN maps to `0x7f`.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= 448.0 {
        return sign | 0x7e;
    }
    // The 127 non-negative finite codes are increasing in value: find the
    // first at or above `a` by binary search, then take the nearer of it
    // and the code below (ties to the even code, lowest mantissa bit clear).
    // A linear scan here made quantizing a 4B-parameter model at load take
    // minutes.
    let t = e4m3_table();
    let hi = t.partition_point(|&v| v < a).min(0x7e);
    if hi == 0 {
        return sign;
    }
    let lo = hi - 1;
    let (el, eh) = (a - t[lo], t[hi] - a);
    let best = if el < eh || (el == eh && lo & 1 == 0) {
        lo
    } else {
        hi
    };
    sign | best as u8
}

/// The values of the non-negative finite e4m3 codes 0..=0x7e, in order.
fn e4m3_table() -> &'static [f32; 127] {
    static T: std::sync::OnceLock<[f32; 127]> = std::sync::OnceLock::new();
    T.get_or_init(|| std::array::from_fn(|i| e4m3_to_f32(i as u8)))
}

/// Decodes one block of `q` (`q.block_bytes()` bytes) into
/// `q.block_elems()` values. For FP8 the value is the unscaled e4m3 value.
///
/// # Panics
/// When `block` or `out` is shorter than one block (a caller bug; the
/// checked entry point is [`dequantize_row`]).
pub fn dequantize_block(q: QuantType, b: &[u8], y: &mut [f32]) {
    match q {
        QuantType::Q8_0 => {
            let d = f16_at(b, 0);
            for (x, &v) in y[..32].iter_mut().zip(&b[2..34]) {
                *x = f32::from(v as i8) * d;
            }
        }
        QuantType::Q4_0 => {
            let d = f16_at(b, 0);
            let (lo, hi) = y[..32].split_at_mut(16);
            for (j, &v) in b[2..18].iter().enumerate() {
                lo[j] = (i32::from(v & 0x0f) - 8) as f32 * d;
                hi[j] = (i32::from(v >> 4) - 8) as f32 * d;
            }
        }
        QuantType::Q4_1 => {
            let d = f16_at(b, 0);
            let m = f16_at(b, 2);
            let (lo, hi) = y[..32].split_at_mut(16);
            for (j, &v) in b[4..20].iter().enumerate() {
                lo[j] = f32::from(v & 0x0f) * d + m;
                hi[j] = f32::from(v >> 4) * d + m;
            }
        }
        QuantType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let (lo, hi) = y[..32].split_at_mut(16);
            for (j, &v) in b[6..22].iter().enumerate() {
                let h0 = ((qh >> j) & 1) << 4;
                let h1 = ((qh >> (j + 16)) & 1) << 4;
                lo[j] = ((u32::from(v & 0x0f) | h0) as i32 - 16) as f32 * d;
                hi[j] = ((u32::from(v >> 4) | h1) as i32 - 16) as f32 * d;
            }
        }
        QuantType::Q4K | QuantType::Q5K => {
            let five = q == QuantType::Q5K;
            let d = f16_at(b, 0);
            let dmin = f16_at(b, 2);
            let scales = &b[4..16];
            let (qh, ql): (&[u8], &[u8]) = if five {
                (&b[16..48], &b[48..176])
            } else {
                (&[], &b[16..144])
            };
            for chunk in 0..4 {
                let qs = &ql[32 * chunk..32 * chunk + 32];
                for (nib, sub) in [(0u8, 2 * chunk), (4u8, 2 * chunk + 1)] {
                    let (sc, m) = scale_min_k4(sub, scales);
                    let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
                    let out = &mut y[32 * sub..32 * sub + 32];
                    for l in 0..32 {
                        let mut v = (qs[l] >> nib) & 0x0f;
                        if five && qh[l] & (1 << sub) != 0 {
                            v += 16;
                        }
                        out[l] = dl * f32::from(v) - ml;
                    }
                }
            }
        }
        QuantType::Q6K => {
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
        QuantType::Fp8E4M3 => y[0] = e4m3_to_f32(b[0]),
    }
}

/// Decodes one row of `out.len()` elements stored as `q` (`row` is exactly
/// `q.row_bytes(out.len())` bytes). FP8 rows decode to unscaled values:
/// multiply by the row's scale ([`dequantize_tensor`] does).
pub fn dequantize_row(q: QuantType, row: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    let k = out.len();
    let expected = q.row_bytes(k).ok_or(QuantError::NotWholeBlocks {
        qtype: q,
        k,
        block: q.block_elems(),
    })?;
    if row.len() != expected {
        return Err(QuantError::WrongLength {
            qtype: q,
            what: format!("a row of {k} elements"),
            expected,
            got: row.len(),
        });
    }
    let (be, bb) = (q.block_elems(), q.block_bytes());
    for (o, b) in out.chunks_exact_mut(be).zip(row.chunks_exact(bb)) {
        dequantize_block(q, b, o);
    }
    Ok(())
}

/// Decodes a whole `[n, k]` tensor in `q`'s storage layout (FP8: rows then
/// f32 scales, applied here) to `n·k` f32 values.
pub fn dequantize_tensor(
    q: QuantType,
    data: &[u8],
    n: usize,
    k: usize,
) -> Result<Vec<f32>, QuantError> {
    let rb = q.row_bytes(k).ok_or(QuantError::NotWholeBlocks {
        qtype: q,
        k,
        block: q.block_elems(),
    })?;
    check_tensor_len(q, data.len(), n, k)?;
    let mut out = vec![0f32; n * k];
    for (r, o) in out.chunks_exact_mut(k.max(1)).enumerate().take(n) {
        dequantize_row(q, &data[r * rb..(r + 1) * rb], o)?;
        if q == QuantType::Fp8E4M3 {
            let at = n * rb + 4 * r;
            let s = f32::from_le_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]]);
            o.iter_mut().for_each(|v| *v *= s);
        }
    }
    Ok(out)
}

/// Checks that `len` bytes are exactly a `[n, k]` tensor of `q`.
pub fn check_tensor_len(q: QuantType, len: usize, n: usize, k: usize) -> Result<(), QuantError> {
    let expected = q.tensor_bytes(n, k).ok_or(QuantError::NotWholeBlocks {
        qtype: q,
        k,
        block: q.block_elems(),
    })?;
    if len != expected {
        return Err(QuantError::WrongLength {
            qtype: q,
            what: format!("a [{n}, {k}] tensor"),
            expected,
            got: len,
        });
    }
    Ok(())
}

/// Quantizes a dense `[n, k]` f32 tensor to FP8 e4m3 with one scale per
/// row, `absmax / 448` (1 for an all-zero row), in the storage layout of
/// [`QuantType::Fp8E4M3`]: `n·k` bytes, then `n` f32 scales.
pub fn quantize_fp8_rows(w: &[f32], n: usize, k: usize) -> Vec<u8> {
    let mut codes = Vec::with_capacity(n * k + 4 * n);
    let mut scales = Vec::with_capacity(n);
    for r in 0..n {
        let row = &w[r * k..(r + 1) * k];
        let amax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
        let s = if amax > 0.0 && amax.is_finite() {
            amax / 448.0
        } else {
            1.0
        };
        codes.extend(row.iter().map(|&v| f32_to_e4m3(v / s)));
        scales.push(s);
    }
    for s in scales {
        codes.extend(s.to_le_bytes());
    }
    codes
}

/// A random but valid `[n, k]` tensor of `q` (uniform bytes with small
/// finite f16 scales; FP8 from uniform values in ±0.05), deterministic in
/// `seed`: random weights at real shapes for benchmarks and tests.
pub fn random_tensor(q: QuantType, n: usize, k: usize, seed: u64) -> Vec<u8> {
    let mut rng = kiln_ir::rng::SplitMix64::new(seed);
    if q == QuantType::Fp8E4M3 {
        // Codes of values uniform in [-448, 448), drawn through a table of
        // 4096 equal buckets (one `f32_to_e4m3` per bucket, not per
        // weight: a 4B-parameter plan binds in seconds, not minutes), and
        // a per-row scale of 0.05 / 448, so the weights are uniform in
        // about ±0.05 as before.
        let table: Vec<u8> = (0..4096)
            .map(|i| f32_to_e4m3(((i as f32 + 0.5) / 4096.0 - 0.5) * 896.0))
            .collect();
        let mut out: Vec<u8> = (0..n * k)
            .map(|_| table[(rng.next_u64() >> 52) as usize])
            .collect();
        let scale = 0.05f32 / 448.0;
        for _ in 0..n {
            out.extend(scale.to_le_bytes());
        }
        return out;
    }
    let len = q.tensor_bytes(n, k).unwrap_or(0);
    let mut out: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
    let scale_at: &[usize] = match q {
        QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q5_0 => &[0],
        QuantType::Q4_1 | QuantType::Q4K | QuantType::Q5K => &[0, 2],
        QuantType::Q6K => &[208],
        QuantType::Fp8E4M3 => &[],
    };
    for b in out.chunks_exact_mut(q.block_bytes()) {
        for &at in scale_at {
            let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
            let v = f16::from_f64(sign * (2f64).powf(-10.0 + 6.0 * u));
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nearest-code search by definition: every candidate, ties to even.
    fn e4m3_by_scan(x: f32) -> u8 {
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        let a = x.abs();
        if a >= 448.0 {
            return sign | 0x7e;
        }
        let mut best = 0u8;
        let mut best_err = f32::INFINITY;
        for code in 0u8..=0x7e {
            let err = (e4m3_to_f32(code) - a).abs();
            if err < best_err || (err == best_err && code & 1 == 0) {
                best = code;
                best_err = err;
            }
        }
        sign | best
    }

    #[test]
    fn e4m3_rounding_is_the_nearest_code_ties_to_even_for_values_and_midpoints() {
        let mut rng = kiln_ir::rng::SplitMix64::new(7);
        let mut xs: Vec<f32> = (0..20_000)
            .map(|_| {
                let u = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
                (u - 0.5) * 2f32.powi((rng.next_u64() % 24) as i32 - 12)
            })
            .collect();
        // Every code, every midpoint between neighbours, and beyond the range.
        for c in 0u8..0x7e {
            let (a, b) = (e4m3_to_f32(c), e4m3_to_f32(c + 1));
            xs.extend([a, -a, (a + b) / 2.0, -(a + b) / 2.0]);
        }
        xs.extend([0.0, -0.0, 447.9, 448.0, 1e9, -1e9]);
        for x in xs {
            assert_eq!(f32_to_e4m3(x), e4m3_by_scan(x), "{x}");
        }
    }

    #[test]
    fn e4m3_round_trips_every_finite_code() {
        for code in 0u8..=255 {
            let v = e4m3_to_f32(code);
            if v.is_nan() {
                continue;
            }
            let back = f32_to_e4m3(v);
            // +0 and -0 are distinct codes with equal values.
            assert_eq!(e4m3_to_f32(back), v, "{code:#x}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), (2f32).powi(-9));
        assert_eq!(f32_to_e4m3(1000.0), 0x7e);
    }

    #[test]
    fn fp8_rows_keep_each_value_within_half_an_ulp_of_the_scaled_code() {
        let (n, k) = (3, 40);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let data = quantize_fp8_rows(&w, n, k);
        let back = dequantize_tensor(QuantType::Fp8E4M3, &data, n, k).unwrap();
        for r in 0..n {
            let amax = w[r * k..(r + 1) * k]
                .iter()
                .fold(0f32, |a, v| a.max(v.abs()));
            for i in r * k..(r + 1) * k {
                // e4m3 has 3 mantissa bits: relative error <= 2^-4, plus the
                // subnormal step near zero.
                let tol = w[i].abs() / 16.0 + amax / 448.0 * (2f32).powi(-9);
                assert!(
                    (back[i] - w[i]).abs() <= tol,
                    "{i}: {} vs {}",
                    back[i],
                    w[i]
                );
            }
        }
    }

    #[test]
    fn a_row_of_the_wrong_length_is_refused() {
        let mut out = vec![0f32; 64];
        let e = dequantize_row(QuantType::Q4_0, &[0u8; 35], &mut out).unwrap_err();
        assert!(e.to_string().contains("must be 36 bytes"), "{e}");
        let mut odd = vec![0f32; 48];
        assert!(matches!(
            dequantize_row(QuantType::Q4_0, &[0u8; 27], &mut odd),
            Err(QuantError::NotWholeBlocks { .. })
        ));
    }
}
