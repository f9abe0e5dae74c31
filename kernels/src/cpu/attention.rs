//! `paged_attention` over a block-paged KV cache, with causal masking inside
//! the query window, an optional sliding window, optional logit softcap and
//! grouped-query heads.
//!
//! Semantics (op.rs is the spec): sequence `b` has `ctx = context_lens[b]`
//! tokens including this step's `Q`; its query token `i` sits at position
//! `pos = ctx - Q + i` and attends to positions `p` with `p <= pos` and, when
//! `window` is set, `p > pos - window`. Position `p` lives in slot
//! `block_tables[b][p / bs] * bs + p % bs`. Query head `h` reads kv head
//! `h / (heads / kv_heads)`.
//!
//! Numerics: q, k, v loaded to f32; `s = dot(q, k) * scale` (the dot in
//! the matmul kernels' 16-lane order, see `dot`); with softcap `s = cap * tanh(s / cap)`; softmax in f32 with the
//! max subtracted (`e = exp(s - max)` with `math::exp`, a vectorizable exp
//! within 2 ulp of libm's; `l = sum e` in `math::sum`'s 16-lane order);
//! `out = (sum_p e_p * v_p) / l` (accumulated in position order, one
//! division per element), rounded to D once. This is the two-pass form; GPU
//! kernels using an online softmax agree within tolerance.
//!
//! Validation before any write: `ctx >= Q` (the context includes this
//! step's tokens), `ctx` fits the block table's columns, and every block
//! table entry the step reads addresses slots inside the cache. Entries for
//! blocks no query token reads (beyond `ctx`, or before the window) are not
//! looked at, so they may hold padding such as -1.
//!
//! Work is split over (sequence, kv head) pairs across threads (`par`); each
//! pair's query heads share one pass over that kv head's keys and values.

use super::buf::Buf;
use super::dot::{dot_each, Kernel, Row};
use super::simd::{self, multiversion};
use super::{index_error, operands, Result};
use super::{math, par};
use kiln_ir::{DType, Op};

/// Below this many score multiply-adds the op runs on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 15;

/// The op's attributes, unpacked.
#[derive(Clone, Copy, Debug)]
struct Params {
    heads: usize,
    kv_heads: usize,
    hd: usize,
    query: usize,
    bs: usize,
    scale: f32,
    window: Option<usize>,
    softcap: Option<f32>,
    /// Block table columns.
    m: usize,
}

/// The first position query token `i` of a sequence of `ctx` attends to.
#[inline(always)]
fn first_pos(p: &Params, ctx: usize, i: usize) -> usize {
    let pos = ctx - p.query + i;
    match p.window {
        Some(w) => (pos + 1).saturating_sub(w),
        None => 0,
    }
}

/// The slot of position `pos` (validated beforehand).
#[inline(always)]
fn slot(p: &Params, table: &[i32], pos: usize) -> usize {
    table[pos / p.bs] as usize * p.bs + pos % p.bs
}

/// Everything one (sequence, kv head) item reads and writes.
struct Item<'a> {
    p: Params,
    q: Buf,
    kc: Buf,
    vc: Buf,
    out: Buf,
    tables: &'a [i32],
    lens: &'a [i32],
}

/// Widens bf16 bits to f32 (a loop the compiler vectorizes).
#[inline(always)]
fn widen_bf16(src: &[u16], dst: &mut [f32]) {
    for (d, &b) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((b as u32) << 16);
    }
}

/// One (sequence `b`, kv head `g`) pair: all `group * Q` query rows.
#[inline(always)]
unsafe fn item_impl<K: Kernel>(it: &Item<'_>, b: usize, g: usize) {
    let p = &it.p;
    let (hd, q_len) = (p.hd, p.query);
    let group = p.heads / p.kv_heads;
    let ctx = it.lens[b] as usize;
    let table = &it.tables[b * p.m..(b + 1) * p.m];
    let lo = first_pos(p, ctx, 0);
    let span = ctx - lo;
    // Rows r = (head-in-group, query token): q vectors, scores, accumulators.
    let rows = group * q_len;
    let q_width = p.heads * hd;
    let kv_width = p.kv_heads * hd;
    let mut q = vec![0f32; rows * hd];
    for hg in 0..group {
        let h = g * group + hg;
        for i in 0..q_len {
            let r = hg * q_len + i;
            it.q.load(
                (b * q_len + i) * q_width + h * hd,
                &mut q[r * hd..(r + 1) * hd],
            );
        }
    }
    // Valid position range [first, last] of each row.
    let bounds: Vec<(usize, usize)> = (0..rows)
        .map(|r| {
            let i = r % q_len;
            (first_pos(p, ctx, i), ctx - q_len + i)
        })
        .collect();
    let bf16 = it.kc.dtype == DType::BF16;
    let (kbits, vbits) = if bf16 {
        (it.kc.u16s(), it.vc.u16s())
    } else {
        (&[][..], &[][..])
    };
    // Element offset of each position's head slice in the caches.
    let offs: Vec<usize> = (lo..ctx)
        .map(|pos| slot(p, table, pos) * kv_width + g * hd)
        .collect();
    let mut scores = vec![f32::NEG_INFINITY; rows * span];
    let mut kv = vec![0f32; hd];
    for (pos, &off) in (lo..ctx).zip(&offs) {
        let key = if bf16 {
            Row::Bf16(&kbits[off..off + hd])
        } else {
            it.kc.load(off, &mut kv);
            Row::F32(&kv)
        };
        dot_each::<K>(key, &q, hd, rows, |r, d| {
            let (first, last) = bounds[r];
            if pos >= first && pos <= last {
                let mut s = d * p.scale;
                if let Some(cap) = p.softcap {
                    s = cap * (s / cap).tanh();
                }
                scores[r * span + pos - lo] = s;
            }
        });
    }
    let mut denom = vec![0f32; rows];
    for (r, &(first, last)) in bounds.iter().enumerate() {
        let row = &mut scores[r * span + first - lo..r * span + last + 1 - lo];
        let max = math::max(row);
        for s in row.iter_mut() {
            *s = math::exp(*s - max);
        }
        denom[r] = math::sum(row);
    }
    let mut acc = vec![0f32; rows * hd];
    for (pos, &off) in (lo..ctx).zip(&offs) {
        if bf16 {
            widen_bf16(&vbits[off..off + hd], &mut kv);
        } else {
            it.vc.load(off, &mut kv);
        }
        for (r, &(first, last)) in bounds.iter().enumerate() {
            if pos < first || pos > last {
                continue;
            }
            let e = scores[r * span + pos - lo];
            for (a, v) in acc[r * hd..(r + 1) * hd].iter_mut().zip(&kv) {
                *a += e * v;
            }
        }
    }
    for (r, &l) in denom.iter().enumerate() {
        let (hg, i) = (r / q_len, r % q_len);
        let h = g * group + hg;
        let out = &mut acc[r * hd..(r + 1) * hd];
        for a in out.iter_mut() {
            *a /= l;
        }
        it.out.store((b * q_len + i) * q_width + h * hd, out);
    }
}

multiversion! {
    unsafe fn item(it: &Item<'_>, b: usize, g: usize) => item_impl
}

/// Checks lengths and block table entries of every sequence.
fn validate(op: &Op, p: &Params, tables: &[i32], lens: &[i32], cache_slots: usize) -> Result<()> {
    if p.window == Some(0) {
        return Err(operands(
            op,
            "window 0 attends to nothing; use a window of at least 1 or none",
        ));
    }
    for (b, &ctx) in lens.iter().enumerate() {
        if ctx < p.query as i32 {
            return Err(index_error(
                op,
                format!(
                    "context length {ctx} of sequence {b} is shorter than the query length {}; context_lens must count this step's query tokens too (padding rows need at least {} tokens)",
                    p.query, p.query
                ),
            ));
        }
        let ctx = ctx as usize;
        let capacity = p.m * p.bs;
        if ctx > capacity {
            return Err(index_error(
                op,
                format!(
                    "context length {ctx} of sequence {b} needs {} blocks of {} but the block table has {} columns; compile with a larger max context or cap the sequence",
                    ctx.div_ceil(p.bs),
                    p.bs,
                    p.m
                ),
            ));
        }
        let lo = first_pos(p, ctx, 0);
        for blk in lo / p.bs..ctx.div_ceil(p.bs) {
            let entry = tables[b * p.m + blk];
            // Slots this step reads in the block: up to ctx.
            let used = (ctx - blk * p.bs).min(p.bs);
            let end = (entry as i64) * p.bs as i64 + used as i64;
            if entry < 0 || end > cache_slots as i64 {
                return Err(index_error(
                    op,
                    format!(
                        "block table entry {entry} (sequence {b}, block {blk}) addresses slots outside the KV cache of {cache_slots} slots ({} blocks of {}); every block the context covers must be allocated inside the cache",
                        cache_slots / p.bs,
                        p.bs
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// `paged_attention(q, kc, vc, block_tables, context_lens) -> out`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn paged_attention(
    op: &Op,
    q: Buf,
    out: Buf,
    kc: Buf,
    vc: Buf,
    tables: Buf,
    lens: Buf,
    batch: usize,
    m: usize,
    cache_slots: usize,
) -> Result<()> {
    let Op::PagedAttention {
        heads,
        kv_heads,
        head_dim,
        query,
        block_size,
        scale,
        window,
        softcap,
    } = op
    else {
        unreachable!("dispatched by execute")
    };
    let p = Params {
        heads: *heads as usize,
        kv_heads: *kv_heads as usize,
        hd: *head_dim as usize,
        query: *query as usize,
        bs: *block_size as usize,
        scale: *scale,
        window: window.map(|w| w as usize),
        softcap: *softcap,
        m,
    };
    let (tables, lens) = (tables.ints(), lens.ints());
    validate(op, &p, tables, lens, cache_slots)?;
    let it = Item {
        p,
        q,
        kc,
        vc,
        out,
        tables,
        lens,
    };
    let level = simd::level();
    let items = batch * p.kv_heads;
    let macs: usize = lens.iter().map(|&c| c as usize).sum::<usize>() * p.query * p.heads * p.hd;
    if macs < PARALLEL_MIN_MACS {
        for x in 0..items {
            item(level, &it, x / p.kv_heads, x % p.kv_heads);
        }
    } else {
        par::for_each_chunk(items, |x| {
            // SAFETY: items write disjoint (sequence, head) output slices.
            unsafe { item(level, &it, x / p.kv_heads, x % p.kv_heads) };
        });
    }
    Ok(())
}
