//! Row gathers: `embedding` (rows of a table by token id) and `gather_last`
//! (the last row of each group). Both copy bits; no arithmetic, no rounding.

use super::buf::Buf;
use super::{index_error, Result};
use kiln_ir::Op;

/// `embedding(ids: i32[T], table: D[V,H]) -> D[T,H]`. Every id is checked
/// against `V` before the first row is written.
pub(crate) unsafe fn embedding(
    op: &Op,
    ids: Buf,
    table: Buf,
    (vocab, h): (usize, usize),
    out: Buf,
) -> Result<()> {
    let ids = ids.ints();
    for (t, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= vocab {
            return Err(index_error(
                op,
                format!(
                    "token id {id} at row {t} is outside the embedding table's {vocab} rows; ids must be in 0..{vocab} (check the tokenizer matches the model)"
                ),
            ));
        }
    }
    for (t, &id) in ids.iter().enumerate() {
        Buf::copy(table, id as usize * h, out, t * h, h);
    }
    Ok(())
}

/// `gather_last(x: D[B*group, H]) -> D[B, H]`.
pub(crate) unsafe fn gather_last(x: Buf, (rows, h): (usize, usize), group: usize, out: Buf) {
    for b in 0..rows / group {
        Buf::copy(x, (b * group + group - 1) * h, out, b * h, h);
    }
}
