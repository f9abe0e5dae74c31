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
use super::math;
use kiln_ir::DType;

/// Index of the first maximum of `row` under the NaN rule above.
///
/// Two passes that vectorize (a vocabulary-sized row is read at memory
/// speed): the maximum of the numbers ([`math::max`], which skips NaN;
/// `-inf` when there are none), then the first index holding a value equal
/// to it. That is the first maximum of the rule: `-0.0 == 0.0`, so of
/// zeros the first one wins, as the rule's `v == w` says; a row with no
/// number matches nothing and gives 0.
#[inline]
pub fn argmax_row(row: &[f32]) -> usize {
    let max = math::max(row);
    const CHUNK: usize = 64;
    for (c, chunk) in row.chunks(CHUNK).enumerate() {
        // A branch-free test per chunk, then the position within it.
        if chunk.iter().fold(false, |hit, &v| hit | (v == max)) {
            let i = chunk.iter().position(|&v| v == max).unwrap_or(0);
            return c * CHUNK + i;
        }
    }
    0
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

#[cfg(test)]
mod tests {
    use super::argmax_row;
    use kiln_ir::rng::SplitMix64;

    /// The NaN rule read literally: one pass keeping the first best.
    fn first_best(row: &[f32]) -> usize {
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

    #[test]
    fn argmax_row_is_the_first_best_of_the_nan_rule_on_rows_of_ties_zeros_nans_and_infinities() {
        let mut rng = SplitMix64::new(5);
        let pool = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            1.0,
            -1.0,
            3.5,
        ];
        for len in [1usize, 2, 15, 63, 64, 65, 130, 1000] {
            for _ in 0..200 {
                // Few distinct values, so ties and special values are common;
                // some rows are mostly NaN.
                let nan_heavy = rng.next_u64().is_multiple_of(4);
                let row: Vec<f32> = (0..len)
                    .map(|_| {
                        let r = rng.next_u64();
                        if nan_heavy && !r.is_multiple_of(8) {
                            f32::NAN
                        } else {
                            pool[(r >> 8) as usize % pool.len()]
                        }
                    })
                    .collect();
                assert_eq!(argmax_row(&row), first_best(&row), "{row:?}");
            }
        }
    }
}
