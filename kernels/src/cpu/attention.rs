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
//! the matmul kernels' 16-lane fma order, see `dot`); with softcap
//! `s = cap * tanh(s / cap)`; softmax in f32 with the max subtracted
//! (`e = exp(s - max)` with `math::exp`, a vectorizable exp within 2 ulp of
//! the exact value; `l = sum e` in `math::sum`'s 16-lane order);
//! `out = (sum_p e_p * v_p) / l` (per element, fma in position order, then
//! one division), rounded to D once. This is the two-pass form; GPU
//! kernels using an online softmax agree within tolerance.
//!
//! Validation before any write: `ctx >= Q` (the context includes this
//! step's tokens), `ctx` fits the block table's columns, and every block
//! table entry the step reads addresses slots inside the cache. Entries for
//! blocks no query token reads (beyond `ctx`, or before the window) are not
//! looked at, so they may hold padding such as -1.
//!
//! Work is split over sequences, and over ranges of kv heads only when there
//! are fewer sequences than threads (`par`): an item covering all kv heads
//! reads each cache row contiguously. An item's query heads share one pass
//! over its keys and values; the V pass keeps up to four rows' accumulators
//! in registers over tiles of positions (`dot::Kernel::weighted_rows`).

use super::buf::Buf;
use super::dot::{dot_each, Kernel, Row};
use super::simd::{self, multiversion};
use super::{index_error, operands, Result};
use super::{math, par};
use kiln_ir::{AttnAttrs, DType, Op};

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

impl Params {
    /// The attributes of a `paged_attention` with `m` block table columns.
    fn of(a: &AttnAttrs, m: usize) -> Params {
        Params {
            heads: a.heads as usize,
            kv_heads: a.kv_heads as usize,
            hd: a.head_dim as usize,
            query: a.query as usize,
            bs: a.block_size as usize,
            scale: a.scale,
            window: a.window.map(|w| w as usize),
            softcap: a.softcap,
            m,
        }
    }
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

/// Everything the items of one call read and write.
struct Item<'a> {
    p: Params,
    q: Buf,
    kc: Buf,
    vc: Buf,
    out: Buf,
    tables: &'a [i32],
    lens: &'a [i32],
}

/// Positions ahead whose K/V rows are prefetched.
const PREFETCH_AHEAD: usize = 8;

/// Asks the CPU to start loading the `bytes` at `p` into cache (a hint: no
/// effect on results, nothing on non-x86 targets).
#[inline(always)]
fn prefetch(p: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let mut off = 0;
        while off < bytes {
            // SAFETY: prefetch never faults, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    p.wrapping_add(off) as *const i8,
                )
            };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, bytes);
}

/// Positions per tile of the V pass (their rows stay in L1 while every
/// 16-lane column chunk is accumulated).
const V_TILE: usize = 64;

/// `acc[rows] += sum_p e[rows][p] * v_p` over `offs`, rows in groups of up
/// to 4 (accumulators in registers), positions in tiles of [`V_TILE`].
#[inline(always)]
unsafe fn weighted_rows<K: Kernel>(
    acc: &mut [f32],
    e: &[f32],
    es: usize,
    v: Row,
    offs: &[usize],
    hd: usize,
    rows: usize,
) {
    for (t, tile) in offs.chunks(V_TILE).enumerate() {
        let e = &e[t * V_TILE..];
        let mut r0 = 0;
        while r0 < rows {
            let (acc, e) = (&mut acc[r0 * hd..], &e[r0 * es..]);
            match rows - r0 {
                1 => K::weighted_rows::<1>(acc, e, es, v, tile, hd),
                2 => K::weighted_rows::<2>(acc, e, es, v, tile, hd),
                3 => K::weighted_rows::<3>(acc, e, es, v, tile, hd),
                _ => K::weighted_rows::<4>(acc, e, es, v, tile, hd),
            }
            r0 += (rows - r0).min(4);
        }
    }
}

/// One sequence `b` and the kv heads `g0..g1`: all their query rows. Row
/// `r = (gi * Q + i) * group + hg` is query token `i` of head
/// `(g0 + gi) * group + hg`; the `group` rows of one (kv head, token) share
/// a position range and are processed together. Covering several kv heads
/// per item makes the reads of each cache row contiguous.
#[inline(always)]
unsafe fn item_impl<K: Kernel>(it: &Item<'_>, b: usize, g0: usize, g1: usize) {
    let p = &it.p;
    let (hd, q_len) = (p.hd, p.query);
    let group = p.heads / p.kv_heads;
    let ng = g1 - g0;
    let ctx = it.lens[b] as usize;
    let table = &it.tables[b * p.m..(b + 1) * p.m];
    let lo = first_pos(p, ctx, 0);
    let span = ctx - lo;
    let q_width = p.heads * hd;
    let kv_width = p.kv_heads * hd;
    // q rows, grouped (kv head, token, head in group).
    let mut q = vec![0f32; ng * q_len * group * hd];
    for gi in 0..ng {
        for i in 0..q_len {
            for hg in 0..group {
                let r = (gi * q_len + i) * group + hg;
                let h = (g0 + gi) * group + hg;
                it.q.load(
                    (b * q_len + i) * q_width + h * hd,
                    &mut q[r * hd..(r + 1) * hd],
                );
            }
        }
    }
    // Element offset of each position's row (kv head g0) in the caches.
    let offs: Vec<usize> = (lo..ctx)
        .map(|pos| slot(p, table, pos) * kv_width + g0 * hd)
        .collect();
    let bf16 = it.kc.dtype == DType::BF16;
    // Non-bf16 caches are converted to f32 once for this item, densely:
    // row j holds the ng heads of position lo + j.
    let width = ng * hd;
    let (kf, vf, dense) = if bf16 {
        (Vec::new(), Vec::new(), Vec::new())
    } else {
        let mut kf = vec![0f32; span * width];
        let mut vf = vec![0f32; span * width];
        for (j, &off) in offs.iter().enumerate() {
            it.kc.load(off, &mut kf[j * width..(j + 1) * width]);
            it.vc.load(off, &mut vf[j * width..(j + 1) * width]);
        }
        (kf, vf, (0..span).map(|j| j * width).collect::<Vec<_>>())
    };
    let (rowoffs, keys, values) = if bf16 {
        (&offs[..], Row::Bf16(it.kc.u16s()), Row::Bf16(it.vc.u16s()))
    } else {
        (&dense[..], Row::F32(&kf[..]), Row::F32(&vf[..]))
    };
    let es = it.kc.dtype.size();
    let mut scores = vec![0f32; ng * group * span];
    let mut acc = vec![0f32; group * hd];
    let mut voffs = vec![0usize; span];
    for i in 0..q_len {
        let first = first_pos(p, ctx, i);
        let last = ctx - q_len + i;
        let (a, z) = (first - lo, last + 1 - lo);
        // Scores of this token's rows over its positions; each cache row
        // (all ng heads) is read once, contiguously.
        for j in a..z {
            if bf16 {
                if let Some(&ahead) = rowoffs.get(j + PREFETCH_AHEAD) {
                    prefetch(it.kc.ptr.wrapping_add(ahead * es), width * es);
                }
            }
            for gi in 0..ng {
                let o = rowoffs[j] + gi * hd;
                let key = match keys {
                    Row::Bf16(k) => Row::Bf16(&k[o..o + hd]),
                    Row::F32(k) => Row::F32(&k[o..o + hd]),
                };
                let qi = &q[(gi * q_len + i) * group * hd..(gi * q_len + i + 1) * group * hd];
                let sc = &mut scores[gi * group * span..(gi + 1) * group * span];
                dot_each::<K>(key, qi, hd, group, |r, d| {
                    let mut s = d * p.scale;
                    if let Some(cap) = p.softcap {
                        s = cap * (s / cap).tanh();
                    }
                    sc[r * span + j] = s;
                });
            }
        }
        for gi in 0..ng {
            let sc = &mut scores[gi * group * span..(gi + 1) * group * span];
            // Softmax weights (unnormalized) and their sums.
            let mut denom = vec![0f32; group];
            for (r, l) in denom.iter_mut().enumerate() {
                let row = &mut sc[r * span + a..r * span + z];
                let max = math::max(row);
                for s in row.iter_mut() {
                    *s = math::exp(*s - max);
                }
                *l = math::sum(row);
            }
            // Weighted sum of values, then one division per element.
            for (v, &o) in voffs[a..z].iter_mut().zip(&rowoffs[a..z]) {
                *v = o + gi * hd;
            }
            acc.fill(0.0);
            weighted_rows::<K>(&mut acc, &sc[a..], span, values, &voffs[a..z], hd, group);
            for (hg, l) in denom.iter().enumerate() {
                let h = (g0 + gi) * group + hg;
                let out = &mut acc[hg * hd..(hg + 1) * hd];
                for v in out.iter_mut() {
                    *v /= l;
                }
                it.out.store((b * q_len + i) * q_width + h * hd, out);
            }
        }
    }
}

multiversion! {
    unsafe fn item(it: &Item<'_>, b: usize, g0: usize, g1: usize) => item_impl
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
    let Op::PagedAttention(attn) = op else {
        unreachable!("dispatched by execute")
    };
    let p = Params::of(attn, m);
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
    let macs: usize = lens.iter().map(|&c| c as usize).sum::<usize>() * p.query * p.heads * p.hd;
    if macs < PARALLEL_MIN_MACS {
        for b in 0..batch {
            item(level, &it, b, 0, p.kv_heads);
        }
        return Ok(());
    }
    // Split each sequence's kv heads only as far as needed to give every
    // thread work: whole sequences read the caches most efficiently.
    let splits = rayon::current_num_threads()
        .div_ceil(batch.max(1))
        .clamp(1, p.kv_heads);
    let per = p.kv_heads.div_ceil(splits);
    let splits = p.kv_heads.div_ceil(per);
    par::for_each_chunk(batch * splits, |x| {
        let (b, s) = (x / splits, x % splits);
        let g0 = s * per;
        // SAFETY: items write disjoint (sequence, head) output slices.
        unsafe { item(level, &it, b, g0, (g0 + per).min(p.kv_heads)) };
    });
    Ok(())
}

/// `attention_partials(q, kc, vc, block_tables, context_lens) -> partials`
/// (op.rs has the definition). A plain loop in f32 (`dot` in index order,
/// `exp` from std): megakernel plans run it on the CPU to prove their
/// tapes, not for speed, and the tape and the op list run this same code.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn attention_partials(
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
    let Op::AttentionPartials { attn, parts } = op else {
        unreachable!("dispatched by execute")
    };
    let p = Params::of(attn, m);
    let (tables, lens) = (tables.ints(), lens.ints());
    validate(op, &p, tables, lens, cache_slots)?;
    let (hd, parts) = (p.hd, *parts as usize);
    let group = p.heads / p.kv_heads;
    let (q_width, kv_width) = (p.heads * hd, p.kv_heads * hd);
    let entry = hd + 2;
    let row_width = p.heads * parts * entry;
    let mut qrow = vec![0f32; hd];
    let mut key = vec![0f32; hd];
    let mut val = vec![0f32; hd];
    let mut o = vec![0f32; entry];
    let mut scores = Vec::new();
    for b in 0..batch {
        let ctx = lens[b] as usize;
        let table = &tables[b * p.m..(b + 1) * p.m];
        let lo = first_pos(&p, ctx, 0);
        let run = (ctx - lo).div_ceil(parts).max(1);
        for i in 0..p.query {
            let (first, last) = (first_pos(&p, ctx, i), ctx - p.query + i);
            let r = b * p.query + i;
            for h in 0..p.heads {
                q.load(r * q_width + h * hd, &mut qrow);
                let g = h / group;
                for part in 0..parts {
                    let a = (lo + part * run).max(first);
                    let z = (lo + (part + 1) * run).min(last + 1);
                    o.fill(0.0);
                    scores.clear();
                    for pos in a..z {
                        kc.load(slot(&p, table, pos) * kv_width + g * hd, &mut key);
                        let d: f32 = qrow.iter().zip(&key).fold(0.0, |s, (x, y)| s + x * y);
                        let mut s = d * p.scale;
                        if let Some(cap) = p.softcap {
                            s = cap * (s / cap).tanh();
                        }
                        scores.push(s);
                    }
                    let (mut mx, mut l) = (f32::NEG_INFINITY, 0f32);
                    if a < z {
                        mx = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        for (pos, s) in (a..z).zip(&scores) {
                            let e = (s - mx).exp();
                            l += e;
                            vc.load(slot(&p, table, pos) * kv_width + g * hd, &mut val);
                            for (acc, v) in o.iter_mut().zip(&val) {
                                *acc += e * v;
                            }
                        }
                    }
                    o[hd] = mx;
                    o[hd + 1] = l;
                    out.store(r * row_width + (h * parts + part) * entry, &o);
                }
            }
        }
    }
    Ok(())
}

/// `attention_combine(partials) -> out` over `rows` rows (op.rs has the
/// definition).
pub(crate) unsafe fn attention_combine(op: &Op, x: Buf, out: Buf, rows: usize) {
    let Op::AttentionCombine {
        heads,
        head_dim,
        parts,
        ..
    } = op
    else {
        unreachable!("dispatched by execute")
    };
    let (heads, hd, parts) = (*heads as usize, *head_dim as usize, *parts as usize);
    let entry = hd + 2;
    let mut e = vec![0f32; parts * entry];
    let mut acc = vec![0f32; hd];
    for r in 0..rows {
        for h in 0..heads {
            x.load((r * heads + h) * parts * entry, &mut e);
            let runs = || e.chunks_exact(entry).filter(|c| c[hd + 1] > 0.0);
            let mx = runs().map(|c| c[hd]).fold(f32::NEG_INFINITY, f32::max);
            acc.fill(0.0);
            let mut l = 0f32;
            for c in runs() {
                let w = (c[hd] - mx).exp();
                l += w * c[hd + 1];
                for (a, o) in acc.iter_mut().zip(&c[..hd]) {
                    *a += w * o;
                }
            }
            if l > 0.0 {
                for a in acc.iter_mut() {
                    *a /= l;
                }
            }
            out.store((r * heads + h) * hd, &acc);
        }
    }
}
