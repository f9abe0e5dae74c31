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

/// One sequence `b` and the kv heads `g0..g1`, prepared for the passes:
/// its query rows, the cache offsets of its positions and (for caches that
/// are not bf16) the rows converted to f32. Row `r = (gi * Q + i) * group +
/// hg` of `q` is query token `i` of head `(g0 + gi) * group + hg`; the
/// `group` rows of one (kv head, token) share a position range and are
/// processed together. Covering several kv heads makes the reads of each
/// cache row contiguous.
struct Seq<'a> {
    it: &'a Item<'a>,
    b: usize,
    ctx: usize,
    /// The first position any query token reads, and `ctx - lo`.
    lo: usize,
    span: usize,
    g0: usize,
    ng: usize,
    group: usize,
    q: Vec<f32>,
    /// Element offset of each position's row (kv head g0) in `keys` and
    /// `values`: the caches themselves (bf16) or `kf`/`vf` (row j holds the
    /// ng heads of position lo + j).
    rowoffs: Vec<usize>,
    kf: Vec<f32>,
    vf: Vec<f32>,
    bf16: bool,
}

impl Seq<'_> {
    fn keys(&self) -> Row<'_> {
        if self.bf16 {
            // SAFETY: the cache is valid for reads during the call.
            Row::Bf16(unsafe { self.it.kc.u16s() })
        } else {
            Row::F32(&self.kf)
        }
    }
    fn values(&self) -> Row<'_> {
        if self.bf16 {
            // SAFETY: as in `keys`.
            Row::Bf16(unsafe { self.it.vc.u16s() })
        } else {
            Row::F32(&self.vf)
        }
    }
    /// Length of one row of scores (positions `lo..ctx`).
    fn rows(&self) -> usize {
        self.ng * self.group
    }
    /// The positions query token `i` reads, as indices into the span.
    fn range(&self, i: usize) -> (usize, usize) {
        let p = &self.it.p;
        let first = first_pos(p, self.ctx, i);
        let last = self.ctx - p.query + i;
        (first - self.lo, last + 1 - self.lo)
    }
}

/// Loads the query rows and the position offsets of sequence `b`, kv heads
/// `g0..g1` (see [`Seq`]).
unsafe fn prepare<'a>(it: &'a Item<'a>, b: usize, g0: usize, g1: usize) -> Seq<'a> {
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
    let offs: Vec<usize> = (lo..ctx)
        .map(|pos| slot(p, table, pos) * kv_width + g0 * hd)
        .collect();
    let bf16 = it.kc.dtype == DType::BF16;
    let width = ng * hd;
    let (rowoffs, kf, vf) = if bf16 {
        (offs, Vec::new(), Vec::new())
    } else {
        // Non-bf16 caches are converted to f32 once, densely.
        let mut kf = vec![0f32; span * width];
        let mut vf = vec![0f32; span * width];
        for (j, &off) in offs.iter().enumerate() {
            it.kc.load(off, &mut kf[j * width..(j + 1) * width]);
            it.vc.load(off, &mut vf[j * width..(j + 1) * width]);
        }
        ((0..span).map(|j| j * width).collect(), kf, vf)
    };
    Seq {
        it,
        b,
        ctx,
        lo,
        span,
        g0,
        ng,
        group,
        q,
        rowoffs,
        kf,
        vf,
        bf16,
    }
}

/// Scores of query token `i`'s rows at span positions `j0..j1`, written to
/// `sc[row * span + j]` (`row = gi * group + hg`). Each cache row (all ng
/// heads) is read once, contiguously.
///
/// # Safety
/// `sc` is valid for `rows * span` writes and nobody else writes those
/// positions of it during the call.
#[inline(always)]
unsafe fn scores_impl<K: Kernel>(s: &Seq<'_>, i: usize, j0: usize, j1: usize, sc: *mut f32) {
    let p = &s.it.p;
    let (hd, q_len, group, span) = (p.hd, p.query, s.group, s.span);
    let keys = s.keys();
    let es = s.it.kc.dtype.size();
    let width = s.ng * hd;
    for j in j0..j1 {
        if s.bf16 {
            if let Some(&ahead) = s.rowoffs.get(j + PREFETCH_AHEAD) {
                prefetch(s.it.kc.ptr.wrapping_add(ahead * es), width * es);
            }
        }
        for gi in 0..s.ng {
            let o = s.rowoffs[j] + gi * hd;
            let key = match keys {
                Row::Bf16(k) => Row::Bf16(&k[o..o + hd]),
                Row::F32(k) => Row::F32(&k[o..o + hd]),
            };
            let qi = &s.q[(gi * q_len + i) * group * hd..(gi * q_len + i + 1) * group * hd];
            let base = sc.add(gi * group * span + j);
            dot_each::<K>(key, qi, hd, group, |r, d| {
                let mut v = d * p.scale;
                if let Some(cap) = p.softcap {
                    v = cap * (v / cap).tanh();
                }
                *base.add(r * span) = v;
            });
        }
    }
}

multiversion! {
    unsafe fn scores(s: &Seq<'_>, i: usize, j0: usize, j1: usize, sc: *mut f32) => scores_impl
}

/// Softmax weights (unnormalized, in place over span positions `a..z`) of
/// score rows `rows` and their sums `denom[row]`. (`K` only selects the
/// target features: the arithmetic is plain f32, the same at every level.)
#[inline(always)]
unsafe fn softmax_impl<K: Kernel>(
    sc: &mut [f32],
    span: usize,
    (a, z): (usize, usize),
    rows: std::ops::Range<usize>,
    denom: &mut [f32],
) {
    for r in rows {
        let row = &mut sc[r * span + a..r * span + z];
        let max = math::max(row);
        for s in row.iter_mut() {
            *s = math::exp(*s - max);
        }
        denom[r] = math::sum(row);
    }
}

multiversion! {
    unsafe fn softmax_rows(
        sc: &mut [f32],
        span: usize,
        range: (usize, usize),
        rows: std::ops::Range<usize>,
        denom: &mut [f32],
    ) => softmax_impl
}

/// Output columns `c0..c1` of query token `i`'s rows of kv head `gi`: the
/// weighted sum of values over span positions `a..z` (fma in position
/// order per element), one division per element, stored.
///
/// # Safety
/// `sc` holds the softmax weights of token `i` and `denom` their sums; no
/// one else writes these output columns during the call.
#[inline(always)]
unsafe fn values_impl<K: Kernel>(
    s: &Seq<'_>,
    i: usize,
    gi: usize,
    (c0, c1): (usize, usize),
    sc: &[f32],
    denom: &[f32],
) {
    let p = &s.it.p;
    let (hd, q_len, group, span) = (p.hd, p.query, s.group, s.span);
    let (a, z) = s.range(i);
    let w = c1 - c0;
    // The accumulators on the stack when they fit (they usually do: a
    // group of up to 16 heads of 16 columns).
    let mut on_stack = [0f32; 256];
    let mut on_heap = Vec::new();
    let acc = if group * w <= on_stack.len() {
        &mut on_stack[..group * w]
    } else {
        on_heap.resize(group * w, 0f32);
        &mut on_heap[..]
    };
    let e = &sc[gi * group * span + a..];
    // The values from column `gi * hd + c0` of each row on: the position
    // offsets then address this chunk's columns.
    let v0 = gi * hd + c0;
    let v = match s.values() {
        Row::Bf16(v) => Row::Bf16(&v[v0..]),
        Row::F32(v) => Row::F32(&v[v0..]),
    };
    weighted_rows::<K>(acc, e, span, v, &s.rowoffs[a..z], w, group);
    let q_width = p.heads * hd;
    for hg in 0..group {
        let h = (s.g0 + gi) * group + hg;
        let l = denom[gi * group + hg];
        let out = &mut acc[hg * w..(hg + 1) * w];
        for v in out.iter_mut() {
            *v /= l;
        }
        s.it.out
            .store((s.b * q_len + i) * q_width + h * hd + c0, out);
    }
}

multiversion! {
    unsafe fn values(s: &Seq<'_>, i: usize, gi: usize, cols: (usize, usize), sc: &[f32], denom: &[f32]) => values_impl
}

/// One sequence `b` and the kv heads `g0..g1`, all their query rows, on
/// the calling thread.
unsafe fn item(level: simd::Level, it: &Item<'_>, b: usize, g0: usize, g1: usize) {
    let s = prepare(it, b, g0, g1);
    let hd = it.p.hd;
    let mut sc = vec![0f32; s.rows() * s.span];
    let mut denom = vec![0f32; s.rows()];
    for i in 0..it.p.query {
        let (a, z) = s.range(i);
        scores(level, &s, i, a, z, sc.as_mut_ptr());
        for gi in 0..s.ng {
            softmax_rows(
                level,
                &mut sc,
                s.span,
                (a, z),
                gi * s.group..(gi + 1) * s.group,
                &mut denom,
            );
            values(level, &s, i, gi, (0, hd), &sc, &denom);
        }
    }
}

/// Positions per chunk of the parallel scores pass, at least.
const SPLIT_MIN_POSITIONS: usize = 16;
/// Output columns per chunk of the parallel values pass.
const SPLIT_COLUMNS: usize = 16;

/// A pointer chunks of one pass write disjoint elements through.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
// SAFETY: the passes write disjoint elements (distinct positions) and read
// nothing another chunk writes.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// Sequence `b`, all kv heads, split over threads below the kv heads: per
/// query token, the scores over chunks of positions, the softmax rows on
/// the calling thread, then the values over (kv head, column chunk). Every
/// element is computed by the very operations [`item`] performs, in the
/// same order (a score depends on its position alone, a value element on
/// its column alone), so the bits are the same.
unsafe fn split_seq(level: simd::Level, it: &Item<'_>, b: usize, threads: usize) {
    let s = prepare(it, b, 0, it.p.kv_heads);
    let hd = it.p.hd;
    let mut sc = vec![0f32; s.rows() * s.span];
    let mut denom = vec![0f32; s.rows()];
    let col_chunks = hd.div_ceil(SPLIT_COLUMNS);
    for i in 0..it.p.query {
        let (a, z) = s.range(i);
        let per = (z - a).div_ceil(4 * threads).max(SPLIT_MIN_POSITIONS);
        let out = Shared(sc.as_mut_ptr());
        let s = &s;
        par::for_each_chunk((z - a).div_ceil(per), move |c| {
            let j0 = a + c * per;
            let out = out;
            // SAFETY: chunks write disjoint positions of `sc`.
            unsafe { scores(level, s, i, j0, (j0 + per).min(z), out.0) };
        });
        softmax_rows(level, &mut sc, s.span, (a, z), 0..s.rows(), &mut denom);
        let (sc, denom) = (&sc[..], &denom[..]);
        par::for_each_chunk(s.ng * col_chunks, |x| {
            let (gi, cc) = (x / col_chunks, x % col_chunks);
            let c0 = cc * SPLIT_COLUMNS;
            // SAFETY: chunks store disjoint (head, column) ranges of `out`.
            unsafe {
                values(
                    level,
                    s,
                    i,
                    gi,
                    (c0, (c0 + SPLIT_COLUMNS).min(hd)),
                    sc,
                    denom,
                )
            };
        });
    }
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
    let macs: usize = lens.iter().map(|&c| c as usize).sum::<usize>() * p.query * p.heads * p.hd;
    if macs < PARALLEL_MIN_MACS {
        for b in 0..batch {
            item(level, &it, b, 0, p.kv_heads);
        }
        return Ok(());
    }
    let threads = rayon::current_num_threads();
    if batch < threads {
        // Fewer sequences than threads: split each below its kv heads
        // (a decode step of one sequence with 3 kv heads on 2 threads
        // would otherwise split 2:1).
        for b in 0..batch {
            split_seq(level, &it, b, threads);
        }
        return Ok(());
    }
    // Split each sequence's kv heads only as far as needed to give every
    // thread work: whole sequences read the caches most efficiently.
    let splits = threads.div_ceil(batch.max(1)).clamp(1, p.kv_heads);
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

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use kiln_ir::rng::SplitMix64;

    fn noise(rng: &mut SplitMix64, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
            .collect()
    }

    /// A tensor's bytes in `dtype` (bf16 or f32), 4-byte aligned.
    fn tensor(dtype: DType, v: &[f32]) -> Vec<u32> {
        match dtype {
            DType::BF16 => {
                let h: Vec<u16> = v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
                h.chunks(2)
                    .map(|c| u32::from(c[0]) | u32::from(*c.get(1).unwrap_or(&0)) << 16)
                    .collect()
            }
            _ => v.iter().map(|x| x.to_bits()).collect(),
        }
    }

    fn buf(words: &mut [u32], dtype: DType, len: usize) -> Buf {
        Buf {
            ptr: words.as_mut_ptr() as *mut u8,
            dtype,
            len,
        }
    }

    struct Case {
        heads: usize,
        kv_heads: usize,
        hd: usize,
        query: usize,
        bs: usize,
        window: Option<usize>,
        softcap: Option<f32>,
        dtype: DType,
        lens: Vec<usize>,
    }

    /// The output bytes of `case` computed by `run` over its items.
    fn run_case(case: &Case, seed: u64, run: &dyn Fn(&Item<'_>, usize)) -> Vec<u32> {
        let mut rng = SplitMix64::new(seed);
        let batch = case.lens.len();
        let m = case.lens.iter().max().unwrap().div_ceil(case.bs);
        let blocks = batch * m + 3;
        let slots = blocks * case.bs;
        let (qw, kw) = (case.heads * case.hd, case.kv_heads * case.hd);
        let rows = batch * case.query;
        let mut q = tensor(case.dtype, &noise(&mut rng, rows * qw, 1.5));
        let mut kc = tensor(case.dtype, &noise(&mut rng, slots * kw, 1.5));
        let mut vc = tensor(case.dtype, &noise(&mut rng, slots * kw, 2.0));
        // Blocks scattered in reverse, so positions are not contiguous.
        let tables: Vec<i32> = (0..batch * m).map(|i| (blocks - 1 - i) as i32).collect();
        let lens: Vec<i32> = case.lens.iter().map(|&l| l as i32).collect();
        let mut out = tensor(case.dtype, &vec![0.0; rows * qw]);
        let it = Item {
            p: Params {
                heads: case.heads,
                kv_heads: case.kv_heads,
                hd: case.hd,
                query: case.query,
                bs: case.bs,
                scale: 1.0 / (case.hd as f32).sqrt(),
                window: case.window,
                softcap: case.softcap,
                m,
            },
            q: buf(&mut q, case.dtype, rows * qw),
            kc: buf(&mut kc, case.dtype, slots * kw),
            vc: buf(&mut vc, case.dtype, slots * kw),
            out: buf(&mut out, case.dtype, rows * qw),
            tables: &tables,
            lens: &lens,
        };
        for b in 0..batch {
            run(&it, b);
        }
        out
    }

    #[test]
    fn attention_split_below_the_kv_heads_gives_the_bits_of_the_serial_item() {
        let mut cases = Vec::new();
        // (heads, kv_heads, hd): SmolLM2's 9/3/64, no GQA, a group of 4
        // with a head_dim that is no multiple of the 16-column chunks, MQA.
        for (heads, kv_heads, hd) in [(9, 3, 64), (4, 4, 32), (8, 2, 40), (6, 1, 24)] {
            for (query, window, softcap) in [
                (1, None, None),
                (1, Some(37), None),
                (3, None, Some(20.0)),
                (2, Some(5), None),
            ] {
                for dtype in [DType::BF16, DType::F32] {
                    cases.push(Case {
                        heads,
                        kv_heads,
                        hd,
                        query,
                        bs: if hd == 64 { 16 } else { 5 },
                        window,
                        softcap,
                        dtype,
                        // Contexts that do not divide by the chunks, and
                        // one shorter than a chunk.
                        lens: vec![query.max(3), 17, 64, 97, 515],
                    });
                }
            }
        }
        for (n, case) in cases.iter().enumerate() {
            let seed = 100 + n as u64;
            for level in simd::available() {
                let want = run_case(case, seed, &|it, b| unsafe {
                    item(level, it, b, 0, it.p.kv_heads)
                });
                for threads in [2, 3, 7] {
                    let got = run_case(case, seed, &|it, b| unsafe {
                        split_seq(level, it, b, threads)
                    });
                    assert!(
                        got == want,
                        "{}/{}/{} query {} window {:?} softcap {:?} {} at {level:?}, split for {threads} threads: the bits differ",
                        case.heads,
                        case.kv_heads,
                        case.hd,
                        case.query,
                        case.window,
                        case.softcap,
                        case.dtype
                    );
                }
            }
        }
    }
}
