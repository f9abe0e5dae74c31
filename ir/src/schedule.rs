//! How a key's step is scheduled: the default CUDA-graph schedule, or one
//! persistent "megakernel" that walks an instruction tape.
//!
//! A [`KeyPlan`]'s [`Schedule::Graph`] runs the op list as kernel launches in
//! stream order (captured into a graph). [`Schedule::Megakernel`] carries a
//! [`Tape`]: every op is cut into [`Task`]s (a tile of its output), the tasks
//! are spread over `sm_count * blocks_per_sm` queues (one per co-resident
//! thread block), and a task waits on completion counters in global memory
//! for exactly the earlier tasks whose bytes it reads or overwrites, instead
//! of on a kernel boundary.
//!
//! # The tape's meaning
//! * The **global order** of the tape is the task index. Running the tasks
//!   one by one in that order is the op list run op by op: tasks are grouped
//!   by op in op order, and the tiles of one op write disjoint bytes and
//!   never overwrite what another tile of the op reads.
//! * A task's tile is a range of its op's **units** ([`tile_units`]): output
//!   columns of a matmul / fused matmul (a GEMV's output rows), (sequence,
//!   query head) pairs of paged attention, (sequence, query head, run)
//!   triples of `attention_partials` and (row, head) pairs of
//!   `attention_combine`, the rows of `argmax`, the query heads of
//!   `qkv_rope_kv_write` one by one followed by its K-cache unit and its
//!   V-cache unit, or the single unit of any other op
//!   (a whole-op task). What a tile reads and writes is [`footprint`]: the
//!   one definition the scheduler, the verifier, the CPU executor and the
//!   GPU interpreter share. Reads of a paged KV cache are the whole cache
//!   (the slots are per-step values), reads of a weight only the rows the
//!   tile uses (the whole weight when it is stored quantized: its GPU layout
//!   is not row-contiguous). A tile uses none of its op's planned scratch
//!   or completion counters (those belong to the graph schedule's
//!   launches): whatever it needs besides its footprint lives in the
//!   interpreter's shared memory.
//! * Each task bumps its counter (`u32`, +1) when its writes are visible; a
//!   [`Wait`] `(counter, target)` blocks until the counter reaches `target`.
//!   The scheduler gives every task its own counter (target 1); the format
//!   allows shared counters, and a wait guards the tasks bumping its counter
//!   only when `target` is their number.
//!
//! # Counter reset: a planned reset at the start of the step
//! The key's tape counters (`Tape::counters`, in [`Region::Counters`] above
//! every op's own counters in every key) are zeroed by a reset kernel
//! (`megakernel_reset`, a memset in effect) captured in the same graph
//! right before the persistent kernel. Chosen over an epoch
//! scheme or a last-block-out reset because it is self-healing: a step that
//! was aborted half way (a fault, a host interrupt in eager mode) cannot leave
//! a counter that makes the next step skip a wait or hang, nothing ever
//! overflows, and no grid-wide barrier is needed at the end of the step. The
//! cost is one small kernel node writing `4 * tasks` bytes per step. The tape counters
//! never overlap an op's counters, so graph-schedule keys of the same plan
//! still find theirs zero.
//!
//! # Why the tape cannot deadlock
//! The verifier ([`verify_tape`]) guarantees (a) every queue lists its tasks
//! in increasing global order and (b) every counter a task waits on is bumped
//! only by tasks earlier in the global order. All queues' blocks are
//! co-resident (the runtime checks occupancy against `blocks_per_sm` at load
//! and refuses the plan otherwise), so each queue makes progress whenever its
//! head task's waits are met. Induction on the global order: the earliest
//! unfinished task has every task before it done; by (a) everything ahead of
//! it on its queue is done, so it is at its queue's head, and by (b) its
//! waits are met, so it runs. Hence every task finishes.
//!
//! # Invariants the verifier checks (in order)
//! 1. the shape: `sm_count` and `blocks_per_sm` positive, one queue per block
//!    (`sm_count * blocks_per_sm` queues), the counters a whole number of
//!    `u32` in [`Region::Counters`] overlapping no op's counters of any key;
//! 2. every task names an op of the key and a non-empty tile inside that op's
//!    units; its reads and writes are exactly [`footprint`]; its counter is
//!    in bounds;
//! 3. the tiles of each op partition its units exactly, in increasing order,
//!    the ops' tasks follow the op order, and no tile writes bytes another
//!    tile of its op reads or writes (an op that writes over its own
//!    arguments is cut only where its footprints keep the tiles apart:
//!    `qkv_rope_kv_write`, whose K and V units each own one cache);
//! 4. every task id appears on exactly one queue, exactly once, and each
//!    queue is in increasing global order;
//! 5. every wait names a counter in bounds with a target between 1 and the
//!    number of tasks bumping it, all of them earlier than the waiter;
//! 6. for every byte a task reads or writes that an earlier task of the step
//!    writes (and every byte it writes that an earlier task reads), that
//!    earlier task happens before it: on its queue, through a wait, or
//!    transitively. Together with 4 and 5 this is "no unguarded read, no two
//!    possibly concurrent tasks writing overlapping bytes, no write over a
//!    value still being read".
//!
//! Not here: choosing tiles and queues (the compiler's megakernel pass),
//! executing a tape (the runtime's tape executor, the interpreter kernel),
//! and the reset itself (the runtime captures it).

use crate::op::{AttnAttrs, Epilogue, Op};
use crate::plan::{BufRef, KeyPlan, Operand, Plan, PlanOp, Region};
use crate::validate::PlanError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The kernel module of the persistent interpreter that runs a tape on a
/// GPU. A GPU plan with a tape must carry its image (validation checks it
/// with the modules the launch lists use).
pub const INTERPRETER_MODULE: &str = "megakernel";

/// How a key's step runs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub enum Schedule {
    /// The op list's launches in stream order, captured as a graph.
    #[default]
    Graph,
    /// One persistent kernel per step walking this tape.
    Megakernel(Box<Tape>),
}

impl Schedule {
    /// The name `kiln compile --schedule` takes.
    pub fn name(&self) -> &'static str {
        match self {
            Schedule::Graph => "graph",
            Schedule::Megakernel(_) => "megakernel",
        }
    }
    pub fn tape(&self) -> Option<&Tape> {
        match self {
            Schedule::Graph => None,
            Schedule::Megakernel(t) => Some(t),
        }
    }
}

/// A key's megakernel schedule. See the module docs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tape {
    /// Streaming multiprocessors the tape was cut for.
    pub sm_count: u32,
    /// Co-resident thread blocks per SM the persistent kernel needs.
    pub blocks_per_sm: u32,
    /// The tape's completion counters (`u32` each), zeroed by the reset kernel at
    /// the start of every step.
    pub counters: BufRef,
    /// Every task, in global order.
    pub tasks: Vec<Task>,
    /// Task ids of each queue (one per thread block), in execution order.
    pub queues: Vec<Vec<u32>>,
}

impl Tape {
    /// Number of counters.
    pub fn counter_count(&self) -> u64 {
        self.counters.bytes / 4
    }
}

/// A range `[begin, end)` of an op's units ([`tile_units`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Tile {
    pub begin: u32,
    pub end: u32,
}

/// One instruction of the tape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Task {
    /// Index into the key's `ops`.
    pub op: u32,
    pub tile: Tile,
    /// Bytes the tile reads ([`footprint`]).
    pub reads: Vec<BufRef>,
    /// Bytes the tile writes ([`footprint`]).
    pub writes: Vec<BufRef>,
    /// The counter it bumps by one when done.
    pub counter: u32,
    /// What must have happened before it starts.
    pub waits: Vec<Wait>,
}

impl Task {
    /// Bytes the task reads (weights included).
    pub fn read_bytes(&self) -> u64 {
        self.reads
            .iter()
            .map(|b| b.bytes)
            .fold(0, u64::saturating_add)
    }
}

/// Block until counter `counter` reaches `target`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Wait {
    pub counter: u32,
    pub target: u32,
}

/// The bytes of an operand its type occupies (a buffer may be larger).
fn extent(o: &Operand) -> BufRef {
    BufRef {
        bytes: o.buf.bytes.min(o.ty.size_bytes()),
        ..o.buf
    }
}

fn overlap(a: &BufRef, b: &BufRef) -> bool {
    a.region == b.region
        && a.bytes > 0
        && b.bytes > 0
        && a.offset < b.offset.saturating_add(b.bytes)
        && b.offset < a.offset.saturating_add(a.bytes)
}

/// Whether any result of `op` shares bytes with one of its arguments (an
/// in-place op: such an op runs as one whole-op task).
pub fn writes_what_it_reads(op: &PlanOp) -> bool {
    op.results
        .iter()
        .any(|r| op.args.iter().any(|a| overlap(&extent(r), &extent(a))))
}

/// How many units an op's output is cut into: output columns for a matmul
/// or fused matmul, (sequence, query head) pairs for paged attention, rows
/// for `argmax`,
/// `heads + 2` for `qkv_rope_kv_write` (see [`rope_kv_parts`]), 1 for every
/// other op and for any other op writing over its own arguments.
pub fn tile_units(op: &PlanOp) -> u32 {
    if let Op::QkvRopeKvWrite { heads, .. } = op.op {
        // The caches are written in place by design; the q result must be
        // bytes of its own for the query heads to be cut apart.
        let q_apart = op.results.len() == 3
            && op.args.len() >= 5
            && !op
                .args
                .iter()
                .any(|a| overlap(&extent(&op.results[0]), &extent(a)));
        return if q_apart && heads > 0 {
            heads.saturating_add(2)
        } else {
            1
        };
    }
    if writes_what_it_reads(op) || op.results.len() != 1 {
        return 1;
    }
    let last = |o: &Operand| o.ty.shape.dims().last().copied().unwrap_or(1);
    match &op.op {
        Op::MatMul { .. } | Op::FusedMatMul { .. } if op.results[0].ty.shape.rank() == 2 => {
            last(&op.results[0]).max(1)
        }
        Op::PagedAttention(AttnAttrs { heads, .. }) => {
            attention_batch(op).saturating_mul((*heads).max(1))
        }
        // (sequence, query head, run) triples.
        Op::AttentionPartials { attn, parts } => attention_batch(op)
            .saturating_mul(attn.heads.max(1))
            .saturating_mul((*parts).max(1)),
        // (row, head) pairs.
        Op::AttentionCombine { heads, .. } if op.args[0].ty.shape.rank() == 2 => {
            op.args[0].ty.shape.dims()[0].saturating_mul((*heads).max(1))
        }
        // One unit per row: a row's reduction reads only that row.
        Op::Argmax if op.args.len() == 1 && op.args[0].ty.shape.rank() == 2 => {
            op.args[0].ty.shape.dims()[0].max(1)
        }
        _ => 1,
    }
}

/// The parts of `qkv_rope_kv_write` units `[b, e)` cover: the query
/// heads `[q0, q1)` (possibly empty), whether the K-cache unit (`heads`:
/// every key head, normed, roped and written at the step's slots) and
/// whether the V-cache unit (`heads + 1`: every value head copied to the
/// slots) are in it. The key and value heads are one unit each because a
/// cache row's slot is a per-step value: a unit writing at the slots owns
/// the whole cache, and two tiles owning one cache would overlap.
pub fn rope_kv_parts(heads: u32, b: u32, e: u32) -> (u32, u32, bool, bool) {
    (
        b.min(heads),
        e.min(heads),
        b <= heads && heads < e,
        b <= heads.saturating_add(1) && heads.saturating_add(1) < e,
    )
}

/// The sequences of a `paged_attention` (its block tables' rows).
fn attention_batch(op: &PlanOp) -> u32 {
    op.args
        .get(3)
        .and_then(|t| t.ty.shape.dims().first().copied())
        .unwrap_or(1)
        .max(1)
}

/// Units `[u0, u1)` of a `paged_attention` over `q` or `out` (`[batch *
/// query, heads * head_dim]`): unit `u` is query head `u % heads` of
/// sequence `u / heads`, its `query` rows' `head_dim` columns. One range
/// per row of each sequence the units touch.
fn attention_units(
    o: &Operand,
    u0: u32,
    u1: u32,
    heads: u32,
    query: u32,
    head_dim: u32,
) -> Vec<BufRef> {
    let es = o.ty.dtype.size() as u64;
    let (heads, query, hd) = (heads.max(1) as u64, query.max(1) as u64, head_dim as u64);
    let row = heads * hd * es;
    let mut out = Vec::new();
    let (mut u, u1) = (u0 as u64, u1 as u64);
    while u < u1 {
        let b = u / heads;
        let h0 = u % heads;
        let h1 = (u1 - b * heads).min(heads);
        for r in b * query..(b + 1) * query {
            out.push(BufRef {
                region: o.buf.region,
                offset: o.buf.offset + r * row + h0 * hd * es,
                bytes: (h1 - h0) * hd * es,
            });
        }
        u = (b + 1) * heads;
    }
    out
}

/// Columns `[c0, c1)` of a row-major 2-D operand `[rows, cols]`: one range
/// when they are all of them, one per row otherwise.
fn columns(o: &Operand, c0: u32, c1: u32) -> Vec<BufRef> {
    let d = o.ty.shape.dims();
    let (rows, cols) = match d {
        [r, c] => (*r as u64, *c as u64),
        [c] => (1, *c as u64),
        _ => return vec![extent(o)],
    };
    let (c0, c1) = (c0 as u64, c1 as u64);
    let es = o.ty.dtype.size() as u64;
    if c0 == 0 && c1 == cols {
        return vec![extent(o)];
    }
    (0..rows)
        .map(|r| BufRef {
            region: o.buf.region,
            offset: o.buf.offset + (r * cols + c0) * es,
            bytes: (c1 - c0) * es,
        })
        .collect()
}

/// Rows `[r0, r1)` of a row-major weight `[N, K]` (or a vector `[N]`); the
/// whole buffer when it is stored quantized.
fn rows(o: &Operand, r0: u32, r1: u32) -> BufRef {
    if o.ty.storage.is_some() {
        return extent(o);
    }
    let d = o.ty.shape.dims();
    let row = d.iter().skip(1).map(|&x| x as u64).product::<u64>() * o.ty.dtype.size() as u64;
    BufRef {
        region: o.buf.region,
        offset: o.buf.offset + r0 as u64 * row,
        bytes: (r1 - r0) as u64 * row,
    }
}

/// The bytes tile `tile` of `op` reads and writes: `(reads, writes)`. See
/// the module docs; `Err` names why the tile is not one of the op's.
pub fn footprint(op: &PlanOp, tile: Tile) -> Result<(Vec<BufRef>, Vec<BufRef>), String> {
    let units = tile_units(op);
    if tile.begin >= tile.end || tile.end > units {
        return Err(format!(
            "tile {}..{} is not a non-empty range of the op's {units} units",
            tile.begin, tile.end
        ));
    }
    let whole = || {
        (
            op.args.iter().map(extent).collect(),
            op.results.iter().map(extent).collect(),
        )
    };
    if units == 1 {
        return Ok(whole());
    }
    let (b, e) = (tile.begin, tile.end);
    match &op.op {
        Op::MatMul { bias, .. } => {
            let mut reads = vec![extent(&op.args[0]), rows(&op.args[1], b, e)];
            if *bias {
                reads.push(rows(&op.args[2], b, e));
            }
            Ok((reads, columns(&op.results[0], b, e)))
        }
        Op::FusedMatMul {
            bias, pre, post, ..
        } => {
            let gated = matches!(post, Epilogue::SiluMul | Epilogue::GeluTanhMul);
            let half = units;
            let weight_rows = |o: &Operand| {
                let mut v = vec![rows(o, b, e)];
                if gated && o.ty.storage.is_none() {
                    v.push(rows(o, half + b, half + e));
                }
                v
            };
            let mut reads = vec![extent(&op.args[0])];
            reads.extend(weight_rows(&op.args[1]));
            let mut i = 2;
            if *bias {
                reads.extend(weight_rows(&op.args[i]));
                i += 1;
            }
            if pre.is_some() {
                reads.push(extent(&op.args[i]));
                i += 1;
            }
            if *post == Epilogue::Residual {
                reads.extend(columns(&op.args[i], b, e));
            }
            Ok((reads, columns(&op.results[0], b, e)))
        }
        Op::PagedAttention(AttnAttrs {
            heads,
            head_dim,
            query,
            ..
        }) => {
            let mut reads = attention_units(&op.args[0], b, e, *heads, *query, *head_dim);
            reads.extend(op.args[1..].iter().map(extent));
            let writes = attention_units(&op.results[0], b, e, *heads, *query, *head_dim);
            Ok((reads, writes))
        }
        Op::AttentionPartials { attn, parts } => {
            // Unit u is run u % parts of (sequence, head) u / parts: it
            // reads that head's q rows and writes its own entry.
            let parts = (*parts).max(1);
            let (h0, h1) = (b / parts, (e - 1) / parts + 1);
            let mut reads =
                attention_units(&op.args[0], h0, h1, attn.heads, attn.query, attn.head_dim);
            reads.extend(op.args[1..].iter().map(extent));
            let writes = attention_units(
                &op.results[0],
                b,
                e,
                attn.heads.saturating_mul(parts),
                attn.query,
                attn.head_dim.saturating_add(2),
            );
            Ok((reads, writes))
        }
        Op::AttentionCombine {
            heads,
            head_dim,
            parts,
            ..
        } => {
            // Unit u is head u % heads of row u / heads.
            let entry = head_dim.saturating_add(2).saturating_mul(*parts);
            Ok((
                attention_units(&op.args[0], b, e, *heads, 1, entry),
                attention_units(&op.results[0], b, e, *heads, 1, *head_dim),
            ))
        }
        Op::Argmax => Ok((
            vec![rows(&op.args[0], b, e)],
            vec![rows(&op.results[0], b, e)],
        )),
        Op::QkvRopeKvWrite {
            heads,
            kv_heads,
            head_dim,
            ..
        } => {
            // qkv rows are [q heads | k heads | v heads], head_dim each.
            let (q0, q1, k, v) = rope_kv_parts(*heads, b, e);
            let col = |h: u32| h.saturating_mul(*head_dim);
            let (kb, vb, ve) = (
                *heads,
                heads.saturating_add(*kv_heads),
                heads.saturating_add(kv_heads.saturating_mul(2)),
            );
            let (mut reads, mut writes) = (Vec::new(), Vec::new());
            if q0 < q1 {
                reads.extend(columns(&op.args[0], col(q0), col(q1)));
                writes.extend(columns(&op.results[0], col(q0), col(q1)));
            }
            if k {
                reads.extend(columns(&op.args[0], col(kb), col(vb)));
            }
            if v {
                reads.extend(columns(&op.args[0], col(vb), col(ve)));
            }
            // Positions and slots (every unit checks the slots), the
            // caches a unit writes in place, the norm weights.
            reads.extend(op.args[1..3].iter().map(extent));
            if k {
                reads.push(extent(&op.args[3]));
                writes.push(extent(&op.results[1]));
            }
            if v {
                reads.push(extent(&op.args[4]));
                writes.push(extent(&op.results[2]));
            }
            reads.extend(op.args[5..].iter().map(extent));
            Ok((reads, writes))
        }
        _ => Ok(whole()),
    }
}

/// What an access conflicts with: an earlier task and the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conflict {
    /// The earlier task.
    pub task: u32,
    /// Bytes both touch.
    pub bytes: BufRef,
    /// The earlier task wrote them (`false`: it read them and the later
    /// task writes them).
    pub earlier_wrote: bool,
    /// The later task writes them.
    pub later_writes: bool,
}

#[derive(Clone, Debug, Default)]
struct Seg {
    end: u64,
    writer: Option<u32>,
    readers: Vec<u32>,
}

/// Last writer and readers-since of every byte touched so far, per region,
/// as disjoint segments: what the scheduler derives dependencies from and
/// the verifier checks them against. Weights are never tracked (nothing in
/// a step writes them).
#[derive(Debug, Default)]
pub struct Hazards {
    regions: BTreeMap<Region, BTreeMap<u64, Seg>>,
}

impl Hazards {
    pub fn new() -> Hazards {
        Hazards::default()
    }

    /// Splits so that a segment starts at `at` (when one spans it).
    fn split(map: &mut BTreeMap<u64, Seg>, at: u64) {
        let Some((&s, seg)) = map.range_mut(..at).next_back() else {
            return;
        };
        if seg.end > at {
            let tail = Seg {
                end: seg.end,
                writer: seg.writer,
                readers: seg.readers.clone(),
            };
            seg.end = at;
            let _ = s;
            map.insert(at, tail);
        }
    }

    /// The segments covering `b`, created where none exist yet.
    fn cover<'a>(map: &'a mut BTreeMap<u64, Seg>, b: &BufRef) -> Vec<(u64, &'a mut Seg)> {
        let (lo, hi) = (b.offset, b.offset.saturating_add(b.bytes));
        Hazards::split(map, lo);
        Hazards::split(map, hi);
        // Fill gaps with empty segments.
        let mut gaps = Vec::new();
        let mut pos = lo;
        for (&s, seg) in map.range(lo..hi) {
            if s > pos {
                gaps.push((pos, s));
            }
            pos = seg.end;
        }
        if pos < hi {
            gaps.push((pos, hi));
        }
        for (s, e) in gaps {
            map.insert(
                s,
                Seg {
                    end: e,
                    ..Seg::default()
                },
            );
        }
        map.range_mut(lo..hi).map(|(&s, seg)| (s, seg)).collect()
    }

    /// Records task `task` reading `reads` and then writing `writes`, and
    /// returns every conflict with an earlier task (read after write, write
    /// after write, write after read; never with itself).
    pub fn access(&mut self, task: u32, reads: &[BufRef], writes: &[BufRef]) -> Vec<Conflict> {
        let mut out = Vec::new();
        for (b, write) in reads
            .iter()
            .map(|b| (b, false))
            .chain(writes.iter().map(|b| (b, true)))
        {
            if matches!(b.region, Region::Weight(_)) || b.bytes == 0 {
                continue;
            }
            let map = self.regions.entry(b.region).or_default();
            for (s, seg) in Hazards::cover(map, b) {
                let bytes = BufRef {
                    region: b.region,
                    offset: s,
                    bytes: seg.end - s,
                };
                if let Some(w) = seg.writer.filter(|&w| w != task) {
                    out.push(Conflict {
                        task: w,
                        bytes,
                        earlier_wrote: true,
                        later_writes: write,
                    });
                }
                if write {
                    for &r in seg.readers.iter().filter(|&&r| r != task) {
                        out.push(Conflict {
                            task: r,
                            bytes,
                            earlier_wrote: false,
                            later_writes: true,
                        });
                    }
                    seg.writer = Some(task);
                    seg.readers.clear();
                } else if seg.readers.last() != Some(&task) {
                    seg.readers.push(task);
                }
            }
        }
        out
    }
}

/// Happens-before over a tape as vector clocks: for each task, how many
/// tasks of each queue happen before it or are it. Built in global order.
#[derive(Debug)]
pub struct Clocks {
    queues: usize,
    clocks: Vec<u32>,
    /// (queue, position) of each task added so far.
    place: Vec<(u32, u32)>,
}

impl Clocks {
    pub fn new(queues: usize) -> Clocks {
        Clocks {
            queues,
            clocks: Vec::new(),
            place: Vec::new(),
        }
    }

    /// Adds the next task (its id is the number added so far) on `queue` at
    /// `position`, after `prev` (its queue predecessor) and the tasks
    /// `after` (those its waits guard; all already added).
    pub fn push(&mut self, queue: u32, position: u32, prev: Option<u32>, after: &[u32]) {
        let q = self.queues;
        let mut c = vec![0u32; q];
        for &t in prev.iter().chain(after) {
            let src = &self.clocks[t as usize * q..(t as usize + 1) * q];
            for (d, s) in c.iter_mut().zip(src) {
                *d = (*d).max(*s);
            }
        }
        c[queue as usize] = position + 1;
        self.clocks.extend_from_slice(&c);
        self.place.push((queue, position));
    }

    /// Whether task `a` happens before (or is) task `b` (both added).
    pub fn before(&self, a: u32, b: u32) -> bool {
        let (qa, pa) = self.place[a as usize];
        self.clocks[b as usize * self.queues + qa as usize] > pa
    }

    /// Like [`Clocks::before`] for a task not yet added: would `a` happen
    /// before a task placed after `prev` and `after`?
    pub fn before_new(&self, a: u32, prev: Option<u32>, after: &[u32]) -> bool {
        prev.iter().chain(after).any(|&t| self.before(a, t))
    }
}

/// The most task-queue pairs [`verify_tape`] builds clocks for (128 MiB).
pub const MAX_CLOCK_WORDS: u64 = 1 << 25;

fn bad<T>(field: impl Into<String>, problem: impl Into<String>) -> Result<T, PlanError> {
    Err(PlanError {
        field: field.into(),
        problem: problem.into(),
    })
}

/// Describes a task for error messages: `task 12 (op 3 `matmul`, tile 0..16)`.
pub fn describe(kp: &KeyPlan, tape: &Tape, t: u32) -> String {
    match tape.tasks.get(t as usize) {
        Some(task) => format!(
            "task {t} (op {} `{}`, tile {}..{})",
            task.op,
            kp.ops
                .get(task.op as usize)
                .map_or("?", |o| o.op.mnemonic()),
            task.tile.begin,
            task.tile.end
        ),
        None => format!("task {t}"),
    }
}

/// Checks a key's tape against the invariants of the module docs.
pub fn verify_tape(plan: &Plan, kp: &KeyPlan, tape: &Tape) -> Result<(), PlanError> {
    let f = format!("keys[{}].schedule", kp.key);
    // 1. Shape and counters.
    let blocks = (tape.sm_count as u64) * (tape.blocks_per_sm as u64);
    if blocks == 0 || tape.queues.len() as u64 != blocks {
        return bad(
            format!("{f}.queues"),
            format!(
                "{} queues for {} SMs x {} blocks per SM; a tape has one queue per co-resident block",
                tape.queues.len(),
                tape.sm_count,
                tape.blocks_per_sm
            ),
        );
    }
    let c = &tape.counters;
    if c.region != Region::Counters
        || !c.offset.is_multiple_of(4)
        || !c.bytes.is_multiple_of(4)
        || c.offset
            .checked_add(c.bytes)
            .is_none_or(|e| e > plan.counter_bytes)
    {
        return bad(
            format!("{f}.counters"),
            format!(
                "{c:?} is not a 4-byte aligned run of u32 counters inside the {}-byte Counters region",
                plan.counter_bytes
            ),
        );
    }
    for other in &plan.keys {
        for (i, op) in other.ops.iter().enumerate() {
            if let Some(oc) = op.counters.filter(|oc| overlap(oc, c)) {
                return bad(
                    format!("{f}.counters"),
                    format!(
                        "overlap op {i}'s counters {oc:?} of key {}: those must stay zero for graph-schedule kernels",
                        other.key
                    ),
                );
            }
        }
    }
    let n_counters = tape.counter_count();
    let n = tape.tasks.len();
    if n > u32::MAX as usize {
        return bad(format!("{f}.tasks"), "more tasks than u32 ids");
    }
    // 2. and 3. Tasks, footprints, tiles.
    // Vector clocks cost tasks x queues words: bound them before allocating.
    if (n as u64).saturating_mul(blocks) > MAX_CLOCK_WORDS {
        return bad(
            format!("{f}.tasks"),
            format!(
                "{n} tasks on {blocks} queues is beyond what kiln verifies ({MAX_CLOCK_WORDS} task-queue pairs); use fewer SMs or blocks per SM"
            ),
        );
    }
    let mut bumpers: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    let mut next_unit: Vec<u32> = vec![0; kp.ops.len()];
    let mut last_op = 0u32;
    for (t, task) in tape.tasks.iter().enumerate() {
        let tf = format!("{f}.tasks[{t}]");
        let Some(op) = kp.ops.get(task.op as usize) else {
            return bad(
                format!("{tf}.op"),
                format!("names op {} of a key with {} ops", task.op, kp.ops.len()),
            );
        };
        if task.op < last_op {
            return bad(
                format!("{tf}.op"),
                format!(
                    "op {} comes after a task of op {last_op}: tasks follow the op order",
                    task.op
                ),
            );
        }
        last_op = task.op;
        let (reads, writes) = footprint(op, task.tile).map_err(|e| PlanError {
            field: format!("{tf}.tile"),
            problem: e,
        })?;
        if reads != task.reads || writes != task.writes {
            return bad(
                tf,
                format!(
                    "its reads/writes are not the footprint of tile {}..{} of `{}`",
                    task.tile.begin,
                    task.tile.end,
                    op.op.mnemonic()
                ),
            );
        }
        let units = tile_units(op);
        let next = &mut next_unit[task.op as usize];
        if task.tile.begin != *next {
            return bad(
                format!("{tf}.tile"),
                format!(
                    "starts at unit {} but op {}'s tiles so far end at {}: tiles partition the op's units in order",
                    task.tile.begin, task.op, *next
                ),
            );
        }
        *next = task.tile.end;
        if units > 1 && writes_what_it_reads(op) {
            // Tiles of one op may run in any order or at once: none may
            // write what another reads or writes. Tasks of an op are
            // consecutive on the tape (checked above).
            let mine = |o: &Task| o.op == task.op;
            for (e, other) in tape.tasks[..t].iter().enumerate().rev() {
                if !mine(other) {
                    break;
                }
                let clash = |a: &[BufRef], b: &[BufRef]| {
                    a.iter().find(|x| b.iter().any(|y| overlap(x, y))).copied()
                };
                let theirs: Vec<BufRef> =
                    other.reads.iter().chain(&other.writes).copied().collect();
                let clash =
                    clash(&task.writes, &theirs).or_else(|| clash(&other.writes, &task.reads));
                if let Some(bytes) = clash {
                    return bad(
                        tf,
                        format!(
                            "its tile and task {e}'s tile of the same `{}` both touch {bytes:?} and one writes it: tiles of one op must be independent",
                            op.op.mnemonic()
                        ),
                    );
                }
            }
        }
        if task.counter as u64 >= n_counters {
            return bad(
                format!("{tf}.counter"),
                format!("counter {} of {n_counters}", task.counter),
            );
        }
        bumpers.entry(task.counter).or_default().push(t as u32);
    }
    for (i, op) in kp.ops.iter().enumerate() {
        if next_unit[i] != tile_units(op) {
            return bad(
                format!("{f}.tasks"),
                format!(
                    "op {i} `{}` has {} units but its tiles cover {} (a tape written by an older kiln cuts ops differently: recompile the plan with `kiln compile`)",
                    op.op.mnemonic(),
                    tile_units(op),
                    next_unit[i]
                ),
            );
        }
    }
    // 4. Queues.
    let mut place: Vec<Option<(u32, u32)>> = vec![None; n];
    for (q, list) in tape.queues.iter().enumerate() {
        let mut last: Option<u32> = None;
        for (p, &t) in list.iter().enumerate() {
            let qf = format!("{f}.queues[{q}][{p}]");
            let Some(slot) = place.get_mut(t as usize) else {
                return bad(qf, format!("task {t} of {n}"));
            };
            if slot.is_some() {
                return bad(qf, format!("task {t} appears twice"));
            }
            if last.is_some_and(|l| l >= t) {
                return bad(
                    qf,
                    format!(
                        "task {t} after task {}: a queue runs in global order",
                        last.unwrap_or(0)
                    ),
                );
            }
            *slot = Some((q as u32, p as u32));
            last = Some(t);
        }
    }
    if let Some(t) = place.iter().position(|p| p.is_none()) {
        return bad(
            format!("{f}.queues"),
            format!("{} is on no queue", describe(kp, tape, t as u32)),
        );
    }
    // 5. and 6. Waits and hazards, in global order.
    let mut clocks = Clocks::new(tape.queues.len());
    let mut hazards = Hazards::new();
    for (t, task) in tape.tasks.iter().enumerate() {
        let t = t as u32;
        let mut after = Vec::new();
        for (w, wait) in task.waits.iter().enumerate() {
            let wf = format!("{f}.tasks[{t}].waits[{w}]");
            if wait.counter as u64 >= n_counters {
                return bad(wf, format!("counter {} of {n_counters}", wait.counter));
            }
            let list = bumpers.get(&wait.counter).map_or(&[][..], |l| l.as_slice());
            if wait.target == 0 || wait.target as usize > list.len() {
                return bad(
                    wf,
                    format!(
                        "target {} but {} task(s) bump counter {}",
                        wait.target,
                        list.len(),
                        wait.counter
                    ),
                );
            }
            if let Some(&late) = list.iter().find(|&&b| b >= t) {
                return bad(
                    wf,
                    format!(
                        "counter {} is bumped by {}, which is not earlier on the tape (a deadlock)",
                        wait.counter,
                        describe(kp, tape, late)
                    ),
                );
            }
            if wait.target as usize == list.len() {
                after.extend_from_slice(list);
            }
        }
        let (q, p) = place[t as usize].expect("checked above");
        let prev = (p > 0).then(|| tape.queues[q as usize][p as usize - 1]);
        clocks.push(q, p, prev, &after);
        for c in hazards.access(t, &task.reads, &task.writes) {
            if !clocks.before(c.task, t) {
                let what = match (c.earlier_wrote, c.later_writes) {
                    (true, false) => "reads",
                    (true, true) => "overwrites bytes written by",
                    (false, _) => "overwrites bytes still read by",
                };
                let (r, o, e) = (
                    c.bytes.region,
                    c.bytes.offset,
                    c.bytes.offset + c.bytes.bytes,
                );
                let problem = if c.earlier_wrote && !c.later_writes {
                    format!(
                        "{} reads bytes {o}..{e} of {r:?} written by {}, without waiting for it (an unguarded read)",
                        describe(kp, tape, t),
                        describe(kp, tape, c.task)
                    )
                } else {
                    format!(
                        "{} {what} {} (bytes {o}..{e} of {r:?}) without waiting for it",
                        describe(kp, tape, t),
                        describe(kp, tape, c.task)
                    )
                };
                return bad(format!("{f}.tasks[{t}].waits"), problem);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arena(offset: u64, bytes: u64) -> BufRef {
        BufRef {
            region: Region::Arena,
            offset,
            bytes,
        }
    }

    #[test]
    fn hazards_report_the_last_writer_and_the_readers_since_of_exactly_the_overlapping_bytes() {
        let mut h = Hazards::new();
        // 0 writes 0..64, 1 writes 64..128, 2 reads 32..96.
        assert!(h.access(0, &[], &[arena(0, 64)]).is_empty());
        assert!(h.access(1, &[], &[arena(64, 64)]).is_empty());
        let c = h.access(2, &[arena(32, 64)], &[]);
        let raw: Vec<(u32, u64, u64)> = c
            .iter()
            .map(|c| (c.task, c.bytes.offset, c.bytes.bytes))
            .collect();
        assert_eq!(raw, vec![(0, 32, 32), (1, 64, 32)]);
        assert!(c.iter().all(|c| c.earlier_wrote && !c.later_writes));
        // 3 writes 90..100: after writer 1 (WAW) and reader 2 (WAR) on
        // 90..96, after writer 1 alone on 96..100.
        let c = h.access(3, &[], &[arena(90, 10)]);
        let mut got: Vec<(u32, bool, u64, u64)> = c
            .iter()
            .map(|c| (c.task, c.earlier_wrote, c.bytes.offset, c.bytes.bytes))
            .collect();
        got.sort();
        assert_eq!(
            got,
            vec![(1, true, 90, 6), (1, true, 96, 4), (2, false, 90, 6)]
        );
        // Disjoint bytes, weights and the task itself never conflict.
        assert!(h.access(4, &[arena(200, 8)], &[arena(208, 8)]).is_empty());
        let w = BufRef {
            region: Region::Weight(0),
            offset: 0,
            bytes: 8,
        };
        assert!(h.access(5, &[w], &[w]).is_empty());
        // Reading and writing bytes 4 wrote: after 4 twice (RAW, WAW), never
        // after its own read.
        let c = h.access(6, &[arena(208, 8)], &[arena(208, 8)]);
        assert_eq!(c.len(), 2);
        assert!(c.iter().all(|c| c.task == 4 && c.earlier_wrote));
    }

    #[test]
    fn clocks_order_tasks_through_queues_and_waits_transitively_and_nothing_else() {
        // Queue 0: 0, 2. Queue 1: 1 (waits 0), 3 (waits nothing).
        let mut c = Clocks::new(2);
        c.push(0, 0, None, &[]);
        c.push(1, 0, None, &[0]);
        c.push(0, 1, Some(0), &[1]);
        c.push(1, 1, Some(1), &[]);
        assert!(c.before(0, 1) && c.before(1, 2) && c.before(0, 2));
        assert!(c.before(0, 3), "0 -> 1 -> 3 through the wait and queue 1");
        assert!(!c.before(2, 3) && !c.before(3, 2));
        assert!(!c.before(1, 0));
        assert!(c.before_new(0, None, &[1]) && !c.before_new(2, Some(3), &[]));
    }
}
