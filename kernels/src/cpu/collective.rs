//! Tensor-parallel collectives on the CPU: `all_reduce` and
//! `sharded_argmax`, the reference every backend's collectives are checked
//! against.
//!
//! The ranks of a plan run the same program; a collective needs every
//! rank's operand. [`Exchange`] is that seam: the runtime's CPU
//! tensor-parallel backend implements it in-process (threads, a barrier,
//! every rank's contribution visible to every rank). With one rank no
//! exchange is needed and the ops are the identity and `argmax`.
//!
//! # Numerics
//! * `all_reduce`: every rank's values are loaded to f32 exactly, summed in
//!   the fixed order rank 0 + rank 1 + ... (left to right, no pairwise tree),
//!   and rounded to the dtype once. Every rank computes the same sum from the
//!   same contributions, so every rank holds the same bits afterwards.
//! * `sharded_argmax`: each rank's local first maximum (NaN skipped, as
//!   `argmax`) with its global index `rank * Vs + local`; the pairs are
//!   reduced in rank order and a later rank wins only with a strictly larger
//!   value, so ties go to the lowest global index, exactly as the unsharded
//!   `argmax` of the concatenated row.
//!
//! Not here: threads, barriers and NCCL (the runtime's), and the GPU
//! lowering (a collective is one library call, `Lowering::Collective`).

use super::{operands, RawTensor, Result};
use kiln_ir::Op;

/// Every rank's contribution, visible to every rank. Implemented by the
/// runtime; all ranks must call [`Exchange::all_gather`] for every
/// collective, in program order.
pub trait Exchange {
    /// This rank, `0..ranks`.
    fn rank(&self) -> u32;
    /// Ranks taking part.
    fn ranks(&self) -> u32;
    /// Publishes `local` and calls `f` with every rank's published slice, in
    /// rank order (this rank's included). Returns once every rank has
    /// finished reading, so `local`'s next publication cannot race a reader.
    /// An error (another rank failed, or did not arrive in time) says why,
    /// naming the rank; `f` may then not have been called.
    fn all_gather(
        &self,
        local: &[f32],
        f: &mut dyn FnMut(&[&[f32]]),
    ) -> std::result::Result<(), String>;
}

/// The elementwise f32 sum of `parts` in rank order, into `out`.
pub fn sum_in_rank_order(parts: &[&[f32]], out: &mut [f32]) {
    out.fill(0.0);
    // 0.0 + x is x exactly (also for -0.0 sums: the result's sign may
    // differ from rank 0's -0.0 only when every part is -0.0, where f32
    // addition gives +0.0 on every backend alike).
    out.copy_from_slice(&parts[0][..out.len()]);
    for p in &parts[1..] {
        for (o, v) in out.iter_mut().zip(p.iter()) {
            *o += *v;
        }
    }
}

/// One rank's candidate: `(value, global index)` of its row's first
/// maximum, `None` when every value is NaN.
pub fn local_best(row: &[f32], offset: usize) -> Option<(f32, usize)> {
    let mut best: Option<(f32, usize)> = None;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        match best {
            Some((b, _)) if v <= b => {}
            _ => best = Some((v, offset + i)),
        }
    }
    best
}

/// The rank-order reduction of candidates: the earliest present one unless
/// a later one is strictly larger; index 0 when none is present (as
/// `argmax` of an all-NaN row).
pub fn reduce_best(candidates: impl IntoIterator<Item = Option<(f32, usize)>>) -> usize {
    let mut best: Option<(f32, usize)> = None;
    for c in candidates.into_iter().flatten() {
        match best {
            Some((b, _)) if c.0 <= b => {}
            _ => best = Some(c),
        }
    }
    best.map_or(0, |(_, i)| i)
}

fn collective_error(op: &Op, message: String) -> super::KernelError {
    super::KernelError::Collective {
        op: op.mnemonic(),
        message,
    }
}

/// Runs a collective op with `exchange` (or none: one rank).
///
/// # Safety
/// As [`super::execute`]: pointers valid for their tensors' sizes; the
/// result of `all_reduce` may be the argument itself.
pub unsafe fn execute_collective(
    op: &Op,
    args: &[RawTensor],
    results: &[RawTensor],
    exchange: Option<&dyn Exchange>,
) -> Result<()> {
    let (Op::AllReduce { ranks, .. } | Op::ShardedArgmax { ranks }) = op else {
        return Err(operands(op, "not a collective"));
    };
    let (rank, have) = exchange.map_or((0, 1), |e| (e.rank(), e.ranks()));
    if *ranks != have {
        return Err(operands(
            op,
            format!(
                "the op is over {ranks} ranks but {have} rank(s) take part; run a tensor-parallel plan on its tp backend (one rank per plan rank)"
            ),
        ));
    }
    if args.len() != 1 || results.len() != 1 {
        return Err(operands(op, "takes one argument and one result"));
    }
    let (x, y) = (&args[0], &results[0]);
    let bytes = std::slice::from_raw_parts(x.ptr as *const u8, x.ty.size_bytes() as usize);
    let local = super::to_f32(x.ty.dtype, bytes);
    match op {
        Op::AllReduce { .. } => {
            if y.ty.shape != x.ty.shape {
                return Err(operands(
                    op,
                    format!("result {} must have the shape of {}", y.ty, x.ty),
                ));
            }
            let mut sum = vec![0f32; local.len()];
            match exchange {
                None => sum.copy_from_slice(&local),
                Some(e) => e
                    .all_gather(&local, &mut |parts| sum_in_rank_order(parts, &mut sum))
                    .map_err(|m| collective_error(op, m))?,
            }
            let out = super::from_f32(y.ty.dtype, &sum);
            std::ptr::copy_nonoverlapping(out.as_ptr(), y.ptr, out.len());
        }
        _ => {
            let d = x.ty.shape.dims();
            if d.len() != 2 || d[1] == 0 || y.ty.numel() != d[0] as u64 {
                return Err(operands(op, format!("bad operands {} -> {}", x.ty, y.ty)));
            }
            let (rows, v) = (d[0] as usize, d[1] as usize);
            // Each row's candidate as two f32s: the value (NaN: none) and
            // the global index's bits.
            let mut mine = Vec::with_capacity(2 * rows);
            for r in 0..rows {
                match local_best(&local[r * v..(r + 1) * v], rank as usize * v) {
                    Some((b, i)) => mine.extend([b, f32::from_bits(i as u32)]),
                    None => mine.extend([f32::NAN, 0.0]),
                }
            }
            let mut idx = vec![0i32; rows];
            let mut reduce = |parts: &[&[f32]]| {
                for (r, out) in idx.iter_mut().enumerate() {
                    let cands = parts.iter().map(|p| {
                        let (b, i) = (p[2 * r], p[2 * r + 1]);
                        (!b.is_nan()).then(|| (b, i.to_bits() as usize))
                    });
                    *out = reduce_best(cands) as i32;
                }
            };
            match exchange {
                None => reduce(&[&mine]),
                Some(e) => e
                    .all_gather(&mine, &mut reduce)
                    .map_err(|m| collective_error(op, m))?,
            }
            let out = super::from_i32(&idx);
            std::ptr::copy_nonoverlapping(out.as_ptr(), y.ptr, out.len());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rank_order_sum_adds_left_to_right_in_f32() {
        // 1e8 + 1 - 1e8 is 0 in f32 left to right; another order gives 1.
        let (a, b, c) = ([1e8f32, 2.5], [1.0f32, -0.5], [-1e8f32, 1.0]);
        let mut out = [0f32; 2];
        sum_in_rank_order(&[&a, &b, &c], &mut out);
        assert_eq!(out, [(1e8f32 + 1.0) - 1e8, (2.5f32 - 0.5) + 1.0]);
        assert_eq!(out[0], 0.0);
    }

    #[test]
    fn sharded_argmax_matches_the_argmax_of_the_concatenated_row() {
        let rows: [&[f32]; 4] = [
            &[1.0, 3.0, 3.0, -1.0, 3.0, 2.0],
            &[f32::NAN, f32::NAN, 0.5, 0.5, f32::NAN, 0.25],
            &[f32::NAN; 6],
            &[-2.0, -3.0, -1.0, -1.0, -5.0, -1.0],
        ];
        for row in rows {
            for ranks in [1usize, 2, 3, 6] {
                let v = row.len() / ranks;
                let cands = (0..ranks).map(|r| local_best(&row[r * v..(r + 1) * v], r * v));
                assert_eq!(
                    reduce_best(cands),
                    super::super::reduce::argmax_row(row),
                    "{row:?} over {ranks} ranks"
                );
            }
        }
    }
}
