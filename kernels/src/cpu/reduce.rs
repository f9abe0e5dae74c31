//! Integer-valued reductions: `argmax` over logits and `accept_greedy` for
//! speculative verification.
//!
//! `argmax` NaN rule (normative, GPUs must match): NaN entries are skipped;
//! among the rest the first index holding the maximum wins (`-inf` counts as
//! a value, so a row of `-inf` gives 0); a row of only NaNs gives 0. As a
//! total order for tree reductions: `(v, i)` beats `(w, j)` when `w` is NaN
//! and `v` is not, or both are numbers and `v > w`, or `v == w` (or both
//! NaN) and `i < j`.

use super::buf::Buf;
use kiln_ir::DType;

/// Index of the first maximum of `row` under the NaN rule above.
#[inline]
pub fn argmax_row(row: &[f32]) -> usize {
    let mut best: Option<(f32, usize)> = None;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        match best {
            Some((b, _)) if v <= b => {}
            _ => best = Some((v, i)),
        }
    }
    best.map_or(0, |(_, i)| i)
}

/// `argmax(x: F[R, V]) -> i32[R]`.
pub(crate) unsafe fn argmax(x: Buf, (rows, v): (usize, usize), out: Buf) {
    let mut scratch = Vec::new();
    for r in 0..rows {
        let idx = if x.dtype == DType::F32 {
            argmax_row(&x.f32s()[r * v..(r + 1) * v])
        } else {
            scratch.resize(v, 0f32);
            x.load(r * v, &mut scratch);
            argmax_row(&scratch)
        };
        out.store_ints(r, &[idx as i32]);
    }
}

/// `accept_greedy(pred: i32[B*(spec+1)], drafts: i32[B*spec]) -> i32[B]`:
/// the count of leading `j` with `drafts[b*spec + j] == pred[b*(spec+1) + j]`.
pub(crate) unsafe fn accept_greedy(pred: Buf, drafts: Buf, spec: usize, out: Buf) {
    let (pred, drafts) = (pred.ints(), drafts.ints());
    for b in 0..drafts.len() / spec {
        let p = &pred[b * (spec + 1)..b * (spec + 1) + spec];
        let d = &drafts[b * spec..(b + 1) * spec];
        let accepted = p.iter().zip(d).take_while(|(x, y)| x == y).count();
        out.store_ints(b, &[accepted as i32]);
    }
}
