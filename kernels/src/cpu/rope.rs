//! Rotary position embedding (rotate-half, the full head dim rotated).
//!
//! The normative recipe, which the CUDA/HIP kernels replicate:
//! * `inv_freq[i]` (`i < hd/2`) is [`Rope::inv_freq`] (f64, scaling applied)
//!   cast to f32 once ([`rope_inv_freq_f32`]);
//! * `angle = (pos as f32) * inv_freq[i]`, one f32 multiply (positions are
//!   exact in f32 below 2^24);
//! * `c = cos(angle)`, `s = sin(angle)` in f32 (libm `cosf`/`sinf` here;
//!   `cosf`/`sinf` on GPUs, never the `__cosf` fast intrinsics; both are
//!   within an ulp or two of the true value, so GPUs agree within tolerance,
//!   not always bit for bit);
//! * with `x1 = x[i]`, `x2 = x[i + hd/2]` in f32:
//!   `out[i] = x1*c - x2*s` and `out[i + hd/2] = x2*c + x1*s`, each product
//!   rounded separately (no FMA), then rounded to D once.
//!
//! Computing the angle in f32 loses precision at large positions (the
//! rounding of `pos * inv_freq` grows with `pos`), like most f32 engines do;
//! it is a documented choice, not an accident. The table of cos/sin per token
//! is computed once and shared by all heads of that token.

use super::buf::Buf;
use kiln_ir::Rope;

/// The f32 inverse frequencies every backend uses.
pub fn rope_inv_freq_f32(rope: &Rope, head_dim: u32) -> Vec<f32> {
    rope.inv_freq(head_dim).iter().map(|&f| f as f32).collect()
}

/// `(cos, sin)` of the `head_dim / 2` angles at `pos`, as the kernels compute
/// them (for other backends' tests and precomputed tables).
pub fn rope_cos_sin(rope: &Rope, head_dim: u32, pos: i32) -> (Vec<f32>, Vec<f32>) {
    let inv = rope_inv_freq_f32(rope, head_dim);
    let mut c = vec![0f32; inv.len()];
    let mut s = vec![0f32; inv.len()];
    cos_sin(&inv, pos, &mut c, &mut s);
    (c, s)
}

#[inline]
pub(crate) fn cos_sin(inv: &[f32], pos: i32, cos: &mut [f32], sin: &mut [f32]) {
    let p = pos as f32;
    for ((f, c), s) in inv.iter().zip(cos.iter_mut()).zip(sin.iter_mut()) {
        let angle = p * f;
        *c = angle.cos();
        *s = angle.sin();
    }
}

/// Rotates one head's `hd` values in place.
#[inline]
pub(crate) fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    let (a, b) = x.split_at_mut(half);
    for (((x1, x2), &c), &s) in a.iter_mut().zip(b.iter_mut()).zip(cos).zip(sin) {
        let (v1, v2) = (*x1, *x2);
        *x1 = v1 * c - v2 * s;
        *x2 = v2 * c + v1 * s;
    }
}

/// Per-token rope state: the f32 frequencies and cos/sin scratch.
pub(crate) struct RopeTable {
    rope: Rope,
    head_dim: u32,
    inv: Vec<f32>,
    /// The position `cos`/`sin` hold.
    pos: Option<i32>,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

std::thread_local! {
    /// The table of this thread's last rope op: every layer of a decode
    /// step rotates with the same parameters at the same positions, so the
    /// frequencies (30 `powf` per op) and the cos/sin of the last position
    /// are reused, not recomputed. They are the same values either way.
    static LAST: std::cell::RefCell<Option<RopeTable>> = const { std::cell::RefCell::new(None) };
}

impl RopeTable {
    pub fn new(rope: &Rope, head_dim: u32) -> RopeTable {
        let inv = rope_inv_freq_f32(rope, head_dim);
        let n = inv.len();
        RopeTable {
            rope: rope.clone(),
            head_dim,
            inv,
            pos: None,
            cos: vec![0.0; n],
            sin: vec![0.0; n],
        }
    }
    /// [`RopeTable::new`], or this thread's last table when it was made for
    /// the same parameters (hand it back with [`RopeTable::keep`]).
    pub fn reused(rope: &Rope, head_dim: u32) -> RopeTable {
        match LAST.with(|l| l.borrow_mut().take()) {
            Some(t) if t.rope == *rope && t.head_dim == head_dim => t,
            _ => RopeTable::new(rope, head_dim),
        }
    }
    /// Keeps this table for the thread's next [`RopeTable::reused`].
    pub fn keep(self) {
        LAST.with(|l| *l.borrow_mut() = Some(self));
    }
    /// Computes cos/sin for `pos` (unless they already are `pos`'s).
    pub fn at(&mut self, pos: i32) {
        if self.pos != Some(pos) {
            cos_sin(&self.inv, pos, &mut self.cos, &mut self.sin);
            self.pos = Some(pos);
        }
    }
    /// Rotates every head of a row (`heads * hd` values) in place.
    pub fn rotate_heads(&self, row: &mut [f32], head_dim: usize) {
        for head in row.chunks_exact_mut(head_dim) {
            rotate(head, &self.cos, &self.sin);
        }
    }
}

/// `rope(x: D[T, heads*hd], pos: i32[T]) -> D[T, heads*hd]` (may be in place).
pub(crate) unsafe fn rope(x: Buf, pos: Buf, rope: &Rope, heads: u32, head_dim: u32, out: Buf) {
    let hd = head_dim as usize;
    let width = heads as usize * hd;
    let positions = pos.ints();
    let mut table = RopeTable::reused(rope, head_dim);
    let mut row = vec![0f32; width];
    for (t, &p) in positions.iter().enumerate() {
        table.at(p);
        x.load(t * width, &mut row);
        table.rotate_heads(&mut row, hd);
        out.store(t * width, &row);
    }
    table.keep();
}
