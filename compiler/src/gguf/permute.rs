//! llama.cpp's q/k row permutation, and its inverse.
//!
//! Hugging Face Llama checkpoints apply RoPE in "rotate-half" form: within a
//! head of size `hd`, dimension `i` pairs with `i + hd/2`. llama.cpp's
//! kernels pair adjacent dimensions `(2j, 2j+1)` instead, so its converter
//! reorders the output rows of `q_proj` and `k_proj`: row `i·hd/2 + j` of a
//! head (half `i`, index `j`) moves to row `2j + i`. kiln computes RoPE the
//! rotate-half way, so `kiln import` moves the rows back.
//!
//! The head count is the query head count for `q_proj` and the key/value
//! head count for `k_proj`. Only rows move; each row (a weight's input
//! dimension) is untouched, which is why the permutation commutes with the
//! row-wise GGUF block quantization and can run after dequantizing.

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PermuteError {
    #[error(
        "cannot undo the llama.cpp q/k row permutation: {rows} rows do not split into \
         {n_head} heads of an even size"
    )]
    Heads { rows: usize, n_head: usize },
    #[error("matrix data has {len} elements, not the {rows} x {cols} its shape says")]
    Length {
        len: usize,
        rows: usize,
        cols: usize,
    },
}

fn head_dim(rows: usize, n_head: usize) -> Result<usize, PermuteError> {
    let err = PermuteError::Heads { rows, n_head };
    if n_head == 0 || !rows.is_multiple_of(n_head) {
        return Err(err);
    }
    let hd = rows / n_head;
    if !hd.is_multiple_of(2) {
        return Err(err);
    }
    Ok(hd)
}

/// Applies llama.cpp's permutation (Hugging Face order → GGUF order) to a
/// row-major `[rows, cols]` matrix. Exists to test [`unpermute_rows`] and to
/// write test GGUF files the way llama.cpp would.
pub fn permute_rows<T: Copy>(
    w: &[T],
    rows: usize,
    cols: usize,
    n_head: usize,
) -> Result<Vec<T>, PermuteError> {
    remap(w, rows, cols, n_head, |hd, i, j| {
        (i * hd / 2 + j, 2 * j + i)
    })
}

/// Undoes llama.cpp's permutation (GGUF order → Hugging Face order) on a
/// row-major `[rows, cols]` matrix.
pub fn unpermute_rows<T: Copy>(
    w: &[T],
    rows: usize,
    cols: usize,
    n_head: usize,
) -> Result<Vec<T>, PermuteError> {
    remap(w, rows, cols, n_head, |hd, i, j| {
        (2 * j + i, i * hd / 2 + j)
    })
}

/// Copies row `h·hd + src` to row `h·hd + dst` for every head `h`, half `i`
/// and pair index `j`, where `(src, dst) = f(hd, i, j)`.
fn remap<T: Copy>(
    w: &[T],
    rows: usize,
    cols: usize,
    n_head: usize,
    f: impl Fn(usize, usize, usize) -> (usize, usize),
) -> Result<Vec<T>, PermuteError> {
    let hd = head_dim(rows, n_head)?;
    if Some(w.len()) != rows.checked_mul(cols) {
        return Err(PermuteError::Length {
            len: w.len(),
            rows,
            cols,
        });
    }
    let mut out = w.to_vec();
    for h in 0..n_head {
        for i in 0..2 {
            for j in 0..hd / 2 {
                let (src, dst) = f(hd, i, j);
                let (src, dst) = ((h * hd + src) * cols, (h * hd + dst) * cols);
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    Ok(out)
}
