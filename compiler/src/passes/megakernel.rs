//! The megakernel schedule: cuts each planned op of a key into tasks, derives
//! the dependencies between tasks at tile granularity, spreads the tasks
//! over one queue per co-resident thread block and writes the tape
//! ([`kiln_ir::schedule::Tape`]) into the key's plan (`kiln compile
//! --schedule megakernel`).
//!
//! Unlike the graph passes of this module this runs after planning: tiles
//! and dependencies are decided over the planned byte ranges (arena reuse
//! included), so a task waits for the earlier tasks whose bytes it reads
//! (read after write) and for those whose bytes it overwrites (write after
//! read and write after write: the arena reuses memory across ops).
//!
//! * **Tiles.** Matmuls and fused matmuls are cut into output-column tiles
//!   (a GEMV's output rows) at least [`MegakernelOptions::min_tile`] wide,
//!   about one tile per queue; paged attention into tiles of (sequence,
//!   query head) units, about one per queue (a head's KV is read by every
//!   head of its group: at decode sizes the bytes are few and the
//!   parallelism is what counts); `qkv_rope_kv_write` into one task per
//!   query head plus one for the key heads and one for the value heads
//!   (each owns a cache: the slots are per-step values), so a query head's
//!   rope waits only for the QKV tiles of its columns and the key-cache
//!   write no longer carries the whole op (the H200 tape traces of
//!   session 14 had the whole-op task at 11.6 us per layer on the b1
//!   critical path of Qwen3-0.6B, 52 us at b8); `argmax` into its rows
//!   (a whole-op argmax was 594 us of the same model's b8 path); every other op, and any
//!   other op writing over its own arguments, is one whole-op task. What each tile touches is
//!   `kiln_ir::schedule::footprint`.
//! * **Dependencies.** A byte-range hazard tracker returns the earlier tasks
//!   each access conflicts with; a tile that reads a whole vector (a matmul's
//!   input, a reduction) conflicts with every producer tile, one that reads
//!   some columns only with the producer tiles of those columns. A
//!   dependency already implied (an earlier task on the same queue, or a
//!   task some other wait already covers transitively, by vector clocks) gets
//!   no wait of its own.
//! * **Queues.** List scheduling in the global (op, tile) order over
//!   estimated times: each task goes to the queue where it would finish
//!   first, given when that queue frees up and when the tasks it depends on
//!   finish (`task_cost_ns`: a fixed per-task part plus its bytes, KV reads
//!   at full context), ties to the lower queue. (The first cut balanced
//!   cumulative bytes instead; whole-cache KV footprints then made a few
//!   queues "full" and piled the GEMV tiles of consecutive ops onto the
//!   rest, which the H200 trace showed as one queue's tasks forming most
//!   of the step's critical path.) Every queue is therefore in global order and every wait names an
//!   earlier task: the tape cannot deadlock (the argument is in
//!   `kiln_ir::schedule`'s docs, and the validator checks both facts).
//! * **Counters.** One `u32` per task, placed in the Counters region above
//!   every op's own counters of every key (keys share the tape counters:
//!   they never run concurrently, and each step's reset kernel zeroes them).
//!
//! Not here: anything a GPU decides at run time (the interpreter kernel and
//! its occupancy check live in kiln-kernels / the CUDA backend), prefetch
//! hints, and ops the interpreter cannot run: a BLAS-Lt or tensor-core
//! (`skinny`) GEMM, collectives, and on GPU targets whatever
//! `kiln_kernels::megakernel::supported` refuses (quantized weights,
//! sampling, speculative acceptance) are refused with the op named. Under
//! `--schedule megakernel` the lowering gives every GEMM of up to 8 tokens
//! to the GEMV (`LowerOptions::prefer_gemv`), so decode keys up to b8 fit.

use kiln_ir::plan::{BufRef, GemmKind, KeyPlan, Lowering, Plan, PlanOp, Region};
use kiln_ir::schedule::{footprint, tile_units, Clocks, Hazards, Schedule, Tape, Task, Tile, Wait};
use kiln_ir::AttnAttrs;
use kiln_ir::Key;

/// Which schedule `kiln compile` writes for every key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum ScheduleKind {
    /// Each op's launches in stream order, captured as a graph.
    #[default]
    Graph,
    /// One persistent kernel per step walking a task tape.
    Megakernel,
}

/// How the tape's tasks signal completion (`kiln compile
/// --megakernel-counters`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum CounterKind {
    /// Every task bumps its own counter; a wait names one task (target 1).
    Tile,
    /// The default. The tiles of an op that no later task needs only part
    /// of share one counter, and a task that needs them all waits once
    /// (target: the op's tile count) instead of once per tile; the other
    /// ops' tiles keep their own counters, so a task still waits only for
    /// what it reads. On Qwen3-0.6B at 132 queues a b1 tape then holds
    /// 32,864 waits instead of 1,441,566 (a GEMV tile waited on 127
    /// counters, each polled by its own thread), and on an H100 the b1 step
    /// of SmolLM2-135M / Qwen3-0.6B / Llama-3.2-1B measured -1.0 / -1.3 /
    /// -3.1% and -0.8 / -5.5 / +0.3% against per-tile counters in two
    /// calls (bench/results/gpu-2026-12-07-s36).
    #[default]
    Op,
}

/// Shape of the persistent kernel the tape is cut for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MegakernelOptions {
    /// SMs of the device (132 on an H200 / H100 SXM).
    pub sm_count: u32,
    /// Co-resident blocks per SM (each walks its own queue).
    pub blocks_per_sm: u32,
    /// Narrowest matmul tile, in output columns. 8 by default: on an H100
    /// (bench/results/gpu-2026-12-07-s35) 8 against 16 took Qwen3-0.6B's b1
    /// step from 1.884 to 1.650 ms and Llama-3.2-1B's from 2.111 to 2.044
    /// (N = 1024 projections fill 128 queues instead of 64).
    pub min_tile: u32,
    /// Per-task or per-op completion counters ([`CounterKind`]).
    pub counters: CounterKind,
}

impl Default for MegakernelOptions {
    fn default() -> MegakernelOptions {
        MegakernelOptions {
            sm_count: 132,
            blocks_per_sm: 1,
            min_tile: 8,
            counters: CounterKind::Op,
        }
    }
}

/// Why a key cannot get a megakernel schedule.
#[derive(Debug, thiserror::Error)]
pub enum MegakernelError {
    #[error("key {key}: op {op} `{mnemonic}` {why}; the megakernel cannot run it: compile with `--schedule graph` (or leave this key out)")]
    Unsupported {
        key: Key,
        op: usize,
        mnemonic: &'static str,
        why: String,
    },
    #[error("megakernel options: {0}")]
    Options(String),
}

/// Why the interpreter kernel cannot run `op` (`None`: it can).
pub fn unsupported(op: &PlanOp) -> Option<String> {
    match &op.lowering {
        Lowering::Gemm { kind, .. } if *kind != GemmKind::Gemv => Some(format!(
            "runs as a `{kind}` GEMM (the megakernel runs GEMV tiles only: by default only one-token keys lower their GEMMs to `gemv`)"
        )),
        Lowering::Collective => Some("is a collective (NCCL call)".into()),
        _ if kiln_ir::validate::is_collective(&op.op) => Some("is a collective".into()),
        _ => None,
    }
}

/// Tiles of one op: `units` cut into runs of at least `min_tile` (1 for
/// attention heads and for `qkv_rope_kv_write`'s units), about one per
/// queue.
fn tiles(op: &PlanOp, queues: u32, min_tile: u32) -> Vec<Tile> {
    let units = tile_units(op);
    let min = match op.op {
        kiln_ir::Op::PagedAttention(..)
        | kiln_ir::Op::AttentionPartials { .. }
        | kiln_ir::Op::AttentionCombine { .. }
        | kiln_ir::Op::QkvRopeKvWrite { .. }
        | kiln_ir::Op::Argmax => 1,
        _ => min_tile.max(1),
    };
    let width = units.div_ceil(queues.max(1)).max(min).div_ceil(min) * min;
    (0..units.div_ceil(width))
        .map(|i| Tile {
            begin: i * width,
            end: ((i + 1) * width).min(units),
        })
        .collect()
}

/// The op whose tasks include task `t` (`op_tasks`: each op's first task
/// and count, in order).
fn task_op(op_tasks: &[(u32, u32)], t: u32) -> usize {
    op_tasks.partition_point(|&(first, _)| first <= t) - 1
}

/// One task before it has a queue: its op, tile, footprint and the earlier
/// tasks whose bytes conflict with it (newest first).
struct Cut {
    op: u32,
    tile: Tile,
    reads: Vec<BufRef>,
    writes: Vec<BufRef>,
    deps: Vec<u32>,
}

/// Which ops' tiles share one counter under [`CounterKind::Op`], from the
/// per-tile tape `tile_tasks` of the same cuts: every op of several tiles,
/// except one that some task needs only part of (its conflicts cover some
/// of the op's tiles, not all) where that part is not already implied by
/// its other waits and queue order (the per-tile tape kept a wait on it).
/// Such an op keeps per-tile counters, so no task waits for tiles it does
/// not read where that could delay it: the queries' RoPE waits for its
/// heads' QKV columns only. A residual read a column at a time, by a tile
/// that also waits on every tile of a later op, is implied and does not
/// count.
fn shared_counter_ops(cuts: &[Cut], tile_tasks: &[Task], op_tasks: &[(u32, u32)]) -> Vec<bool> {
    let mut shared: Vec<bool> = op_tasks.iter().map(|&(_, count)| count > 1).collect();
    let mut raw: std::collections::HashMap<usize, u32> = Default::default();
    for (cut, task) in cuts.iter().zip(tile_tasks) {
        raw.clear();
        for &d in &cut.deps {
            *raw.entry(task_op(op_tasks, d)).or_default() += 1;
        }
        for w in &task.waits {
            let o = task_op(op_tasks, w.counter);
            if raw.get(&o).is_some_and(|&n| n < op_tasks[o].1) {
                shared[o] = false;
            }
        }
    }
    shared
}

/// The list schedule: each task goes to the queue where it would finish
/// first, given when the queue frees up and when the tasks it depends on
/// finish (estimates: [`task_cost_ns`]). Every queue frees up at about the
/// same time after an op, so an op's tiles spread over distinct queues, and
/// no queue collects a long run of tasks that the next op then waits for.
/// A dependency already implied (queue order, or transitively by vector
/// clocks) gets no wait; one on an op whose tiles share a counter
/// (`shared`) waits for all of them once.
fn place(
    kp: &KeyPlan,
    cuts: &[Cut],
    op_tasks: &[(u32, u32)],
    shared: &[bool],
    nq: usize,
) -> (Vec<Task>, Vec<Vec<u32>>) {
    let mut tasks: Vec<Task> = Vec::with_capacity(cuts.len());
    let mut queues: Vec<Vec<u32>> = vec![Vec::new(); nq];
    let mut free = vec![0u64; nq];
    let mut finish: Vec<u64> = Vec::with_capacity(cuts.len());
    let mut clocks = Clocks::new(nq);
    for (t, cut) in cuts.iter().enumerate() {
        let t = t as u32;
        let i = cut.op;
        let op = &kp.ops[i as usize];
        let cost = task_cost_ns(op, cut.tile, &cut.reads, &cut.writes);
        let ready = cut
            .deps
            .iter()
            .map(|&d| finish[d as usize])
            .max()
            .unwrap_or(0);
        let q = (0..nq)
            .min_by_key(|&q| (free[q].max(ready), q))
            .unwrap_or(0);
        free[q] = free[q].max(ready) + cost;
        finish.push(free[q]);
        let prev = queues[q].last().copied();
        // The tasks the waits guarantee done (a shared counter's wait
        // guarantees every tile of its op), and the waits.
        let mut after = Vec::new();
        let mut waits = Vec::new();
        for &d in &cut.deps {
            if clocks.before_new(d, prev, &after) {
                continue;
            }
            let dop = task_op(op_tasks, d);
            if shared[dop] {
                let (first, count) = op_tasks[dop];
                after.extend(first..first + count);
                waits.push(Wait {
                    counter: first,
                    target: count,
                });
            } else {
                after.push(d);
                waits.push(Wait {
                    counter: d,
                    target: 1,
                });
            }
        }
        clocks.push(q as u32, queues[q].len() as u32, prev, &after);
        waits.sort_unstable_by_key(|w| w.counter);
        let counter = if shared[i as usize] {
            op_tasks[i as usize].0
        } else {
            t
        };
        tasks.push(Task {
            op: i,
            tile: cut.tile,
            reads: cut.reads.clone(),
            writes: cut.writes.clone(),
            counter,
            waits,
        });
        queues[q].push(t);
    }
    (tasks, queues)
}

/// The tape of one key, its counters starting at byte `counters_at` of the
/// Counters region.
pub fn schedule_key(
    kp: &KeyPlan,
    counters_at: u64,
    opts: &MegakernelOptions,
    gpu: bool,
) -> Result<Tape, MegakernelError> {
    if opts.sm_count == 0 || opts.blocks_per_sm == 0 {
        return Err(MegakernelError::Options(
            "--megakernel-sms and --megakernel-blocks-per-sm must be at least 1".into(),
        ));
    }
    let nq = opts.sm_count as usize * opts.blocks_per_sm as usize;
    for (i, op) in kp.ops.iter().enumerate() {
        // A GPU plan's tape runs on the interpreter kernel, which must run
        // every op; a CPU plan's tape is the CPU executor's (any op).
        let interpreter = if gpu {
            kiln_kernels::megakernel::supported(op).err()
        } else {
            None
        };
        if let Some(why) = unsupported(op).or(interpreter) {
            return Err(MegakernelError::Unsupported {
                key: kp.key,
                op: i,
                mnemonic: op.op.mnemonic(),
                why,
            });
        }
    }
    // First every task's tile, footprint and the earlier tasks it conflicts
    // with; then which ops share a counter (their tiles' consumers all take
    // every tile: `CounterKind::Op`), then the queues and the waits.
    let mut cuts: Vec<Cut> = Vec::new();
    // Each op's tasks: first id, count.
    let mut op_tasks: Vec<(u32, u32)> = Vec::with_capacity(kp.ops.len());
    let mut hazards = Hazards::new();
    for (i, op) in kp.ops.iter().enumerate() {
        let first = cuts.len() as u32;
        for tile in tiles(op, nq as u32, opts.min_tile) {
            let (reads, writes) = footprint(op, tile).map_err(MegakernelError::Options)?;
            let t = cuts.len() as u32;
            let mut deps: Vec<u32> = hazards
                .access(t, &reads, &writes)
                .into_iter()
                .map(|c| c.task)
                .collect();
            deps.sort_unstable_by(|a, b| b.cmp(a));
            deps.dedup();
            cuts.push(Cut {
                op: i as u32,
                tile,
                reads,
                writes,
                deps,
            });
        }
        op_tasks.push((first, cuts.len() as u32 - first));
    }
    let unshared = vec![false; op_tasks.len()];
    let (mut tasks, mut queues) = place(kp, &cuts, &op_tasks, &unshared, nq);
    if opts.counters == CounterKind::Op {
        let shared = shared_counter_ops(&cuts, &tasks, &op_tasks);
        if shared.iter().any(|&s| s) {
            (tasks, queues) = place(kp, &cuts, &op_tasks, &shared, nq);
        }
    }
    Ok(Tape {
        sm_count: opts.sm_count,
        blocks_per_sm: opts.blocks_per_sm,
        counters: BufRef {
            region: Region::Counters,
            offset: counters_at,
            bytes: 4 * tasks.len() as u64,
        },
        tasks,
        queues,
    })
}

/// What a tape's step costs under the scheduler's own model
/// ([`task_cost_ns`] per task, `hop_ns` per dependency between queues):
/// an estimate to compare schedules by on a machine without a GPU, not a
/// measurement (`kiln bench --profile` traces the real step).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Estimate {
    /// When the last task finishes, in ns.
    pub span_ns: u64,
    /// Tasks on the critical path (the chain of waits and queue
    /// predecessors that ends the step).
    pub path_tasks: u32,
    /// Of those links, how many are waits on another queue.
    pub path_hops: u32,
}

/// Replays `tape` under the cost model: each queue runs its tasks in
/// order, a task starting when its queue is free and its waits are met
/// (`hop_ns` after a producer on another queue finished). Err, naming the
/// task, for what a verified tape never has: a task naming no op, a task
/// on no queue, a queue out of tape order, a wait on a counter no earlier
/// task bumps.
pub fn estimate(kp: &KeyPlan, tape: &Tape, hop_ns: u64) -> Result<Estimate, String> {
    let n = tape.tasks.len();
    let mut bumpers: std::collections::HashMap<u32, Vec<usize>> =
        std::collections::HashMap::with_capacity(n);
    for (t, task) in tape.tasks.iter().enumerate() {
        bumpers.entry(task.counter).or_default().push(t);
    }
    let mut queue_of = vec![usize::MAX; n];
    for (q, list) in tape.queues.iter().enumerate() {
        for &t in list {
            if let Some(slot) = queue_of.get_mut(t as usize) {
                *slot = q;
            }
        }
    }
    for list in &tape.queues {
        if list.windows(2).any(|w| w[0] >= w[1]) {
            return Err("a queue is not in tape order".into());
        }
    }
    let mut finish = vec![0u64; n];
    // The link that decided each task's start: (task, across queues).
    let mut cause: Vec<Option<(usize, bool)>> = vec![None; n];
    // Waits name earlier tasks and queues are in tape order, so one pass in
    // tape order sees every producer first.
    let mut free = vec![(0u64, None::<usize>); tape.queues.len()];
    for (t, task) in tape.tasks.iter().enumerate() {
        let op = kp
            .ops
            .get(task.op as usize)
            .ok_or_else(|| format!("task {t} names op {} of {}", task.op, kp.ops.len()))?;
        let q = queue_of[t];
        if q == usize::MAX {
            return Err(format!("task {t} is on no queue"));
        }
        let (mut start, mut why) = (free[q].0, free[q].1.map(|p| (p, false)));
        for w in &task.waits {
            let d = match bumpers
                .get(&w.counter)
                .and_then(|b| wait_producer(b, t, w.target, &finish))
            {
                Some(d) => d,
                None => {
                    return Err(format!(
                        "task {t} waits for counter {} to reach {}, which earlier tasks do not bump that often",
                        w.counter, w.target
                    ))
                }
            };
            let across = queue_of[d] != q;
            let at = finish[d] + if across { hop_ns } else { 0 };
            if at > start {
                (start, why) = (at, Some((d, across)));
            }
        }
        let cost = task_cost_ns(op, task.tile, &task.reads, &task.writes);
        finish[t] = start + cost;
        cause[t] = why;
        free[q] = (finish[t], Some(t));
    }
    let Some(last) = (0..n).max_by_key(|&t| (finish[t], std::cmp::Reverse(t))) else {
        return Ok(Estimate {
            span_ns: 0,
            path_tasks: 0,
            path_hops: 0,
        });
    };
    let (mut path_tasks, mut path_hops, mut at) = (1u32, 0u32, last);
    while let Some((p, across)) = cause[at] {
        path_tasks += 1;
        path_hops += across as u32;
        at = p;
    }
    Ok(Estimate {
        span_ns: finish[last],
        path_tasks,
        path_hops,
    })
}

/// The task whose finish meets a wait for `target` bumps of a counter that
/// `bumpers` (in tape order) bump, for waiter `t`: of the bumpers earlier
/// than `t`, the `target`-th to finish (`finish` holds theirs). `None`
/// where fewer than `target` earlier tasks bump it.
fn wait_producer(bumpers: &[usize], t: usize, target: u32, finish: &[u64]) -> Option<usize> {
    let mut earlier: Vec<usize> = bumpers.iter().copied().filter(|&b| b < t).collect();
    let k = target as usize;
    if k == 0 || k > earlier.len() {
        return None;
    }
    earlier.sort_by_key(|&b| (finish[b], b));
    Some(earlier[k - 1])
}

/// The queue time a task is estimated to take, for placing it (not a
/// promise: the trace of `kiln bench --profile` says what it took). A fixed
/// part for the interpreter's work around every task (its record, waits,
/// barriers: about a microsecond measured on an H200), plus its bytes at
/// one SM's share of the memory bandwidth (about 30 bytes per ns). Reads of
/// a whole KV cache (attention's footprint: the slots are per-step values)
/// count as what a unit reads at the plan's full context, one head's K and V.
fn task_cost_ns(op: &PlanOp, tile: Tile, reads: &[BufRef], writes: &[BufRef]) -> u64 {
    const FIXED_NS: u64 = 1000;
    const BYTES_PER_NS: u64 = 30;
    let cached = |b: &BufRef| matches!(b.region, Region::KCache(_) | Region::VCache(_));
    let mut bytes: u64 = reads
        .iter()
        .chain(writes)
        .filter(|b| !cached(b))
        .map(|b| b.bytes)
        .fold(0, u64::saturating_add);
    // An embedding's footprint is its whole table (the ids are per-step
    // values); it reads one row per token, as many bytes as it writes.
    if matches!(op.op, kiln_ir::Op::Embedding) {
        bytes = 2 * writes.iter().map(|b| b.bytes).fold(0, u64::saturating_add);
    }
    let attn = match op.op {
        kiln_ir::Op::PagedAttention(a) => Some((a, 1)),
        kiln_ir::Op::AttentionPartials { attn, parts } => Some((attn, parts.max(1) as u64)),
        _ => None,
    };
    if let Some((
        AttnAttrs {
            head_dim,
            block_size,
            ..
        },
        parts,
    )) = attn
    {
        // A unit reads its head's K and V over the whole context (a run of
        // `attention_partials`: its share of it).
        let columns = op
            .args
            .get(3)
            .and_then(|t| t.ty.shape.dims().get(1).copied())
            .unwrap_or(1) as u64;
        let per_unit = columns * block_size as u64 * head_dim as u64 * 4 / parts;
        bytes = bytes.saturating_add(per_unit.saturating_mul((tile.end - tile.begin) as u64));
    }
    FIXED_NS + bytes / BYTES_PER_NS
}

/// Gives every key of `plan` a megakernel schedule and grows the Counters
/// region for the tapes.
pub fn schedule_plan(plan: &mut Plan, opts: &MegakernelOptions) -> Result<(), MegakernelError> {
    let base = plan
        .keys
        .iter()
        .flat_map(|k| &k.ops)
        .filter_map(|o| o.counters)
        .map(|c| c.offset + c.bytes)
        .max()
        .unwrap_or(0)
        .next_multiple_of(4);
    let mut bytes = plan.counter_bytes;
    let gpu = plan.meta.target != kiln_ir::plan::Target::Cpu;
    for kp in &mut plan.keys {
        let tape = schedule_key(kp, base, opts, gpu)?;
        bytes = bytes.max(base + tape.counters.bytes);
        kp.schedule = Schedule::Megakernel(Box::new(tape));
    }
    plan.counter_bytes = bytes;
    Ok(())
}

/// The step's length as the scheduler's own cost model estimates it (ns):
/// every task starts when its queue predecessor and every task it waits on
/// have finished, and takes `task_cost_ns`. A model, not a measurement
/// (`kiln bench --profile` traces the real one); what it is good for is
/// comparing two tapes of the same key.
pub fn estimated_span_ns(kp: &KeyPlan, tape: &Tape) -> u64 {
    let mut bumpers: std::collections::HashMap<u32, Vec<usize>> = Default::default();
    for (t, task) in tape.tasks.iter().enumerate() {
        bumpers.entry(task.counter).or_default().push(t);
    }
    let mut finish = vec![0u64; tape.tasks.len()];
    let mut prev: Vec<Option<u32>> = vec![None; tape.tasks.len()];
    for q in &tape.queues {
        for w in q.windows(2) {
            prev[w[1] as usize] = Some(w[0]);
        }
    }
    for (i, t) in tape.tasks.iter().enumerate() {
        let op = &kp.ops[t.op as usize];
        let start = t
            .waits
            .iter()
            .map(|w| {
                bumpers
                    .get(&w.counter)
                    .and_then(|b| wait_producer(b, i, w.target, &finish))
                    .map_or(0, |d| finish[d])
            })
            .chain(prev[i].map(|p| finish[p as usize]))
            .max()
            .unwrap_or(0);
        finish[i] = start + task_cost_ns(op, t.tile, &t.reads, &t.writes);
    }
    finish.into_iter().max().unwrap_or(0)
}
