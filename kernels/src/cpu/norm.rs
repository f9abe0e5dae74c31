//! RMSNorm family: `rms_norm`, `add_rms_norm`, `head_rms_norm`.
//!
//! For a vector `x` of `n` values (a row, or one head's slice) loaded to f32:
//! `ss = sum(x_i * x_i)` (f32, 8 lanes: lane `j` sums `i = j, j+8, ...` below
//! `n - n % 8`, lanes added pairwise `l[j] + l[j+4]`, `+2`, `+1`, then the
//! tail in order), `r = 1 / sqrt(ss / n + eps)` (IEEE division and square
//! root, not an approximate rsqrt), `y_i = (x_i * r) * w_i` with
//! `w_i` replaced by `(1 + w_i)` (computed in f32) under `unit_offset`, and
//! `y` rounded to D once. This differs from HF's Llama, which rounds
//! `x * r` to the input dtype before multiplying by `w`; the difference is
//! below one ulp of D at the output and kiln defines the single rounding.
//!
//! `add_rms_norm` rounds `sum = x + residual` to D first and normalizes the
//! ROUNDED sum, exactly as the unfused `add` then `rms_norm` would.
//!
//! Rows are processed one at a time through f32 scratch, so a result may be
//! the very buffer of its input (`head_rms_norm` in place).

use super::buf::{round_slice, Buf};

/// `sum(x^2)` in the documented order.
#[inline]
pub(crate) fn sum_squares(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..8 {
            lanes[j] += c[j] * c[j];
        }
    }
    let s4: [f32; 4] = std::array::from_fn(|j| lanes[j] + lanes[j + 4]);
    let mut s = (s4[0] + s4[2]) + (s4[1] + s4[3]);
    for v in tail {
        s += v * v;
    }
    s
}

/// Normalizes `x` in place with the (offset-applied) weights `w`.
#[inline]
pub(crate) fn normalize(x: &mut [f32], w: &[f32], eps: f32) {
    let r = 1.0 / (sum_squares(x) / x.len() as f32 + eps).sqrt();
    for (v, &g) in x.iter_mut().zip(w) {
        *v = *v * r * g;
    }
}

/// The norm weight in f32, with `1 +` applied when `unit_offset`.
pub(crate) unsafe fn load_weight(w: Buf, unit_offset: bool) -> Vec<f32> {
    let mut v = vec![0f32; w.len];
    w.load(0, &mut v);
    if unit_offset {
        for g in &mut v {
            *g += 1.0;
        }
    }
    v
}

/// `rms_norm(x: D[T,H], w: D[H]) -> D[T,H]`.
pub(crate) unsafe fn rms_norm(
    x: Buf,
    w: Buf,
    (t, h): (usize, usize),
    eps: f32,
    unit_offset: bool,
    out: Buf,
) {
    let w = load_weight(w, unit_offset);
    let mut row = vec![0f32; h];
    for i in 0..t {
        x.load(i * h, &mut row);
        normalize(&mut row, &w, eps);
        out.store(i * h, &row);
    }
}

/// `add_rms_norm(x, residual, w) -> (normed, sum)`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn add_rms_norm(
    x: Buf,
    residual: Buf,
    w: Buf,
    (t, h): (usize, usize),
    eps: f32,
    unit_offset: bool,
    normed: Buf,
    sum: Buf,
) {
    let w = load_weight(w, unit_offset);
    let mut row = vec![0f32; h];
    let mut res = vec![0f32; h];
    for i in 0..t {
        x.load(i * h, &mut row);
        residual.load(i * h, &mut res);
        for (a, b) in row.iter_mut().zip(&res) {
            *a += b;
        }
        round_slice(sum.dtype, &mut row);
        sum.store(i * h, &row);
        normalize(&mut row, &w, eps);
        normed.store(i * h, &row);
    }
}

/// Row and head layout of a `[T, heads*hd]` tensor.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Heads {
    pub rows: usize,
    pub heads: usize,
    pub head_dim: usize,
}

/// `head_rms_norm(x: D[T, heads*hd], w: D[hd])`: each head slice normalized.
pub(crate) unsafe fn head_rms_norm(
    x: Buf,
    w: Buf,
    s: Heads,
    eps: f32,
    unit_offset: bool,
    out: Buf,
) {
    let w = load_weight(w, unit_offset);
    let width = s.heads * s.head_dim;
    let mut row = vec![0f32; width];
    for i in 0..s.rows {
        x.load(i * width, &mut row);
        for head in row.chunks_exact_mut(s.head_dim) {
            normalize(head, &w, eps);
        }
        out.store(i * width, &row);
    }
}
