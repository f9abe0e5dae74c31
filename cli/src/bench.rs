//! `kiln bench`: times a compiled plan's decode step, replayed from a
//! captured graph and launched eagerly, per shape key.
//!
//! It loads the plan through the [`Engine`] exactly as serving does (the same
//! checks, regions, weights, prepared launches and graphs) and times each key
//! with [`Engine::time_steps`]: a synthetic but valid full batch (every
//! sequence `--context` tokens long in blocks of its own, random token ids
//! and drafts), timed between the backend's marks. Per key it reports the
//! median step time replayed and eager, their ratio, tokens/s, the step time
//! over the HBM floor (the bytes the step must move over the memory
//! bandwidth measured in the same run: a device-to-device copy on a GPU,
//! bytes read plus written; on the CPU the read stream of the kernels'
//! threads, since a CPU decode step is reads), capture time, and
//! arena/workspace bytes, as a table and as JSON.
//!
//! `--profile` adds, per key, a table by kernel class from
//! [`Engine::profile_ops`]: eager steps with a timing mark around every
//! planned op, each op's median time summed per class (the kernel entry
//! with its dtype and tile suffix, e.g. `gemv.gemv_t1_bf16_bf16`; an op of
//! several launches is one class, its entries joined by ` + `): launches
//! and microseconds per step, share of the profiled step, microseconds per
//! launch, and the bytes the cost model says the class moves over its time
//! (GB/s and percent of the measured copy bandwidth: the share of DRAM
//! peak). Marks between ops serialize the launches (no
//! programmatic-dependent-launch overlap, and the device may wait for the
//! host between ops), so the profiled step is longer than the replayed one;
//! the report prints the ratio (sum of profiled ops over the replayed
//! step). The same rows are the `profile` array of each key in the JSON
//! (present only with `--profile`; the other fields are unchanged).
//!
//! On a megakernel key `--profile` reads the persistent kernel's per-task
//! trace of one replayed step instead ([`tape_rows`]: busy time per task
//! class, waiting on counters, idle) and walks its critical path
//! ([`critical_path`]: the chain of tasks that decided the step's length,
//! split into busy time per class (and how much of it GEMV tiles spent
//! before their inputs were in shared memory), counter signalling and the
//! interpreter's time between tasks), the `critical_path` object in the
//! JSON. Marks are not needed there, but the stamps (four per task, thread
//! 0's timer reads and stores) are not free, so `replay_ms` is always timed
//! on an untraced load of the plan and the trace comes from a second,
//! traced load afterwards; `traced_replay_ms` is that load's median step,
//! so the trace's own cost is printed next to the profile.
//!
//! A tensor-parallel plan runs on its ranks (CPU ranks, or GPUs from the
//! ordinal on) and its rows add the time per replayed step spent inside
//! collectives, the busiest rank's (`allred ms`, `collective_ms`, a mean
//! over the timed steps), and that time's share of the mean step
//! (`collective_share`; the median `replay_ms` is not comparable with a
//! mean over a few steps).
//!
//! Weights come from `--weights` (the safetensors the plan was compiled
//! against) or, when absent, are random ([`Weights::Random`]). Timing does not
//! depend on the values.
//!
//! Not here: loading, staging or timing code of its own (the engine's), the
//! dispatcher's padding (a timed step is the key's full batch), and anything
//! backend-specific (only the `Backend` trait, through the engine).

use kiln_ir::Key;
use kiln_runtime::{
    open_backend_ranks, DeviceSpec, Engine, EngineError, EngineOptions, GraphMode, StepMode,
    StepProfile, Weights,
};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Command-line arguments of `kiln bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// The compiled plan (`*.kiln`, target `cuda:sm_NN`).
    pub plan: PathBuf,
    /// Model directory with the safetensors files the plan was compiled
    /// against; random weights when absent.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Execution device: `cuda`, `cuda:<N>`, `hip`, `hip:<N>` or `cpu`.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Device ordinal when `--device` names none.
    #[arg(long, default_value_t = 0)]
    pub ordinal: u32,
    /// Keys to time, e.g. `b1q1s0,b32q1s0` (default: every key of the plan).
    #[arg(long, value_delimiter = ',')]
    pub keys: Vec<String>,
    /// Timed replays per key (eager steps: a tenth of it, at least 10).
    #[arg(long, default_value_t = 200)]
    pub steps: u32,
    /// Context length of every sequence in the timed step.
    #[arg(long, default_value_t = 512)]
    pub context: u32,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Tensor-parallel ranks: a check only (the plan says how many it
    /// needs); an error when it differs from the plan's.
    #[arg(long, value_name = "N")]
    pub tp: Option<u32>,
    /// Also time every op of each key on its own (eager, a mark around each
    /// op) and report time and bandwidth per kernel class.
    #[arg(long)]
    pub profile: bool,
    /// A second plan of the same model timed in the same run, its rows
    /// after the first plan's (e.g. the `--schedule megakernel` plan next
    /// to the graph-schedule one: both schedules side by side).
    #[arg(long, value_name = "PLAN")]
    pub also: Option<PathBuf>,
}

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Usage(String),
    #[error("writing {path}: {message}")]
    Io { path: String, message: String },
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// One key's result.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct KeyResult {
    pub key: String,
    /// How the step ran: `graph` (the op list's launches, replayed as a
    /// graph) or `megakernel` (one persistent kernel walking the tape).
    pub schedule: String,
    /// The plan file the row was timed from.
    pub plan: String,
    pub batch: u32,
    pub query: u32,
    pub context: u32,
    pub launches: u32,
    pub eager_ms: f64,
    pub replay_ms: f64,
    pub replay_back_to_back_ms: f64,
    pub speedup: f64,
    /// Sequences advanced per second (one step advances each sequence).
    pub tokens_per_s: f64,
    /// Bytes the step must move at the benchmark's context ([`step_bytes`]).
    pub bytes_moved: u64,
    /// The plan's own figure (at the compiled maximum context).
    pub plan_bytes_moved: u64,
    /// `None` where the backend measures no memory bandwidth.
    pub hbm_floor_ms: Option<f64>,
    pub replay_over_floor: Option<f64>,
    pub capture_ms: f64,
    /// Tensor-parallel plans: milliseconds per replayed step spent inside
    /// collectives (all-reduce and the cross-rank argmax, waiting for the
    /// other ranks included), the busiest rank's; `None` for one rank or
    /// where the backend cannot tell.
    pub collective_ms: Option<f64>,
    /// `collective_ms` over the mean timed step (both means over the same
    /// steps): the share of a step spent inside collectives, at most 1 by
    /// construction. `None` where `collective_ms` is.
    pub collective_share: Option<f64>,
    pub arena_bytes: u64,
    pub workspace_bytes: u64,
    /// How many of the key's GEMMs run as each implementation the plan
    /// recorded (`gemv`, `skinny`, `blas`; all zero on the CPU target).
    pub gemms: GemmCounts,
    /// `--profile`: one row per kernel class, slowest first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<Vec<ClassRow>>,
    /// `--profile`: the sum of the profiled ops' median times (ms).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profiled_step_ms: Option<f64>,
    /// `--profile`: `profiled_step_ms` over `replay_ms` (above 1: the marks
    /// between ops serialize them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile_over_replay: Option<f64>,
    /// `--profile` on a megakernel key: the median replayed step of the
    /// traced interpreter (a second load of the plan; `replay_ms` is
    /// always the untraced one), so the trace's own cost is visible.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traced_replay_ms: Option<f64>,
    /// `--profile` on a megakernel key: the traced step's critical path.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub critical_path: Option<CriticalPath>,
}

/// The chain of tasks that decided a traced megakernel step's length
/// ([`critical_path`]), and where its time went. `busy_us + signal_us +
/// queue_us` is the path's span (up to clock skew between SMs, clamped).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct CriticalPath {
    /// Tasks on the path.
    pub tasks: u32,
    /// Steps of the path that followed a wait to another queue's task.
    pub hops: u32,
    /// From the first path task reaching its block to the last one's
    /// counter bump (microseconds).
    pub span_us: f64,
    /// Path tasks computing (waits met to counter bumped), per task class,
    /// largest first.
    pub busy_us: Vec<(String, f64)>,
    /// How many path tasks each class of `busy_us` has, in its order (so
    /// a class's time per task on the path is `busy_us / busy_tasks`).
    pub busy_tasks: Vec<(String, u32)>,
    /// The part of the busy time before the tasks' inputs were in shared
    /// memory (a GEMV's activations and staged weights; the trace's
    /// inputs-ready stamp): the rest is computing and storing.
    pub inputs_us: f64,
    /// From a producer's counter bump to its waiter seeing it (the
    /// counters' round trip: release add, acquire polling, the barrier
    /// after it), summed over the hops.
    pub signal_us: f64,
    /// The part of `signal_us` before the waiting block reached the task:
    /// the producer was done before the waiter's own queue got there, so
    /// that time is the waiter's queue running late (its earlier tasks, the
    /// loop between them), not the counters. `signal_us - signal_late_us`
    /// is the counters' round trip proper (the waiter was there, polling).
    pub signal_late_us: f64,
    /// From the previous task of the same queue finishing to this one's
    /// waits being met, where the queue (not a wait) was the later: the
    /// interpreter's own time between tasks (the next record, its waits,
    /// the prefetches) plus polls of waits already met.
    pub queue_us: f64,
}

/// One kernel class of a profiled step (`kiln bench --profile`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ClassRow {
    /// `module.entry` of the kernel (entries joined by ` + ` for an op of
    /// several launches; `blas.gemm_<dtype>_<out>` for a vendor GEMM,
    /// `cpu.<kernel>` for a CPU reference kernel).
    pub class: String,
    /// Ops of this class in the step.
    pub ops: u32,
    /// Launches per step.
    pub launches: u32,
    /// Microseconds per step: the sum of the ops' median times.
    pub us: f64,
    /// `us` over the profiled step (the shares sum to 1).
    pub share: f64,
    pub us_per_launch: f64,
    /// Bytes the class moves per step (cost model, at the timed context).
    pub bytes: u64,
    /// `bytes` over `us`.
    pub gbs: f64,
    /// `gbs` over the measured copy bandwidth, in percent; `None` where the
    /// backend measures none (the CPU).
    pub pct_of_copy_bw: Option<f64>,
}

/// The rows of `profile` grouped by kernel class, slowest first (ties by
/// name); `copy_gbs` is the measured copy bandwidth, where there is one.
pub fn class_rows(profile: &StepProfile, copy_gbs: Option<f64>) -> Vec<ClassRow> {
    let total_us = profile.total_ms() * 1e3;
    let mut by_class: std::collections::BTreeMap<String, (u32, u32, f64, u64)> =
        std::collections::BTreeMap::new();
    for op in &profile.ops {
        let class = if op.classes.is_empty() {
            format!("{} (no launch)", op.mnemonic)
        } else {
            op.classes.join(" + ")
        };
        let e = by_class.entry(class).or_default();
        e.0 += 1;
        e.1 += op.classes.len() as u32;
        e.2 += op.median_ms * 1e3;
        e.3 += op.bytes;
    }
    let mut rows: Vec<ClassRow> = by_class
        .into_iter()
        .map(|(class, (ops, launches, us, bytes))| {
            let gbs = if us > 0.0 {
                bytes as f64 / (us * 1e3)
            } else {
                0.0
            };
            ClassRow {
                class,
                ops,
                launches,
                us,
                share: if total_us > 0.0 { us / total_us } else { 0.0 },
                us_per_launch: us / launches.max(1) as f64,
                bytes,
                gbs,
                pct_of_copy_bw: copy_gbs.filter(|b| *b > 0.0).map(|b| 100.0 * gbs / b),
            }
        })
        .collect();
    rows.sort_by(|a, b| b.us.total_cmp(&a.us).then_with(|| a.class.cmp(&b.class)));
    rows
}

/// A megakernel step's profile from its tape trace (one `[reached, waits
/// met, inputs ready, done]` per task, ns): one row per task class (`task.<op mnemonic>`)
/// whose `us` is the blocks' busy time summed over the class's tasks and
/// divided by the queues (the share of every SM's step the class takes),
/// then `wait (counters)`, the time blocks spent with a task whose waits
/// were not met yet, and `idle`, the rest of each queue's step (before its
/// first task, after its last, between tasks). The shares sum to 1; the
/// returned span (ms) is the step from the first task reached to the last
/// done. `bytes` is the op's cost-model bytes in the proportion of its
/// units the tasks cover.
pub fn tape_rows(
    plan: &kiln_ir::plan::Plan,
    kp: &kiln_ir::plan::KeyPlan,
    trace: &[[u64; 4]],
    context: u32,
    copy_gbs: Option<f64>,
) -> (Vec<ClassRow>, f64) {
    let Some(tape) = kp.schedule.tape() else {
        return (Vec::new(), 0.0);
    };
    let queues = tape.queues.len().max(1) as f64;
    let t0 = trace.iter().map(|t| t[0]).min().unwrap_or(0);
    let t1 = trace.iter().map(|t| t[3]).max().unwrap_or(0);
    let span_ns = t1.saturating_sub(t0) as f64;
    let mut by: std::collections::BTreeMap<String, (u32, f64, u64)> = Default::default();
    let mut wait_ns = 0.0;
    for (task, t) in tape.tasks.iter().zip(trace) {
        let op = &kp.ops[task.op as usize];
        let e = by.entry(format!("task.{}", op.op.mnemonic())).or_default();
        e.0 += 1;
        e.1 += t[3].saturating_sub(t[1]) as f64;
        let units = kiln_ir::schedule::tile_units(op).max(1) as u64;
        e.2 += kiln_runtime::op_bytes(op, &plan.kv, context)
            * (task.tile.end - task.tile.begin) as u64
            / units;
        wait_ns += t[1].saturating_sub(t[0]) as f64;
    }
    let busy: f64 = by.values().map(|v| v.1).sum();
    let idle_ns = (span_ns * queues - busy - wait_ns).max(0.0);
    let row = |class: String, ops: u32, ns: f64, bytes: u64| {
        let us = ns / queues / 1e3;
        let gbs = if us > 0.0 {
            bytes as f64 / (us * 1e3)
        } else {
            0.0
        };
        ClassRow {
            class,
            ops,
            launches: 0,
            us,
            share: if span_ns > 0.0 {
                ns / queues / span_ns
            } else {
                0.0
            },
            us_per_launch: us,
            bytes,
            gbs,
            pct_of_copy_bw: copy_gbs.filter(|b| *b > 0.0).map(|b| 100.0 * gbs / b),
        }
    };
    let mut rows: Vec<ClassRow> = by
        .into_iter()
        .map(|(class, (n, ns, bytes))| row(class, n, ns, bytes))
        .collect();
    rows.sort_by(|a, b| b.us.total_cmp(&a.us).then_with(|| a.class.cmp(&b.class)));
    rows.push(row("wait (counters)".into(), 0, wait_ns, 0));
    rows.push(row("idle".into(), 0, idle_ns, 0));
    (rows, span_ns / 1e6)
}

/// The critical path of a traced megakernel step: from the task that
/// finished last, repeatedly step to whichever came later of its queue
/// predecessor finishing and its last-met wait's producer finishing (the
/// producer of a wait `(counter, n)` is the n-th task to bump the counter,
/// by finish time), until a queue's first task. `None` for a key without a
/// tape or a trace that does not match it.
pub fn critical_path(kp: &kiln_ir::plan::KeyPlan, trace: &[[u64; 4]]) -> Option<CriticalPath> {
    let tape = kp.schedule.tape()?;
    let n = tape.tasks.len();
    if n == 0 || trace.len() != n {
        return None;
    }
    let mut prev = vec![None; n];
    for q in &tape.queues {
        for w in q.windows(2) {
            prev[*w.get(1)? as usize] = Some(w[0] as usize);
        }
    }
    let mut bumpers: std::collections::HashMap<u32, Vec<usize>> = Default::default();
    for (i, t) in tape.tasks.iter().enumerate() {
        bumpers.entry(t.counter).or_default().push(i);
    }
    for v in bumpers.values_mut() {
        v.sort_by_key(|&i| trace[i][3]);
    }
    let class = |i: usize| {
        kp.ops
            .get(tape.tasks[i].op as usize)
            .map_or("task.?".to_string(), |o| {
                format!("task.{}", o.op.mnemonic())
            })
    };
    let last = (0..n).max_by_key(|&i| trace[i][3])?;
    let (mut i, mut first) = (last, last);
    let mut busy: std::collections::BTreeMap<String, (f64, u32)> = Default::default();
    let (mut signal, mut late, mut queue, mut inputs, mut tasks, mut hops) =
        (0.0f64, 0.0f64, 0.0f64, 0.0f64, 0u32, 0u32);
    let gap = |a: u64, b: u64| a.saturating_sub(b) as f64 / 1e3;
    // Each step moves to a task that finished no later (ties broken by the
    // tape order), so the walk ends; the bound guards a corrupt trace.
    for _ in 0..=n {
        tasks += 1;
        first = i;
        let [reach, met, ready, done] = trace[i];
        let b = busy.entry(class(i)).or_default();
        b.0 += gap(done, met);
        b.1 += 1;
        inputs += gap(ready.min(done), met);
        let producer = tape.tasks[i]
            .waits
            .iter()
            .filter_map(|w| {
                let b = bumpers.get(&w.counter)?;
                let k = (w.target as usize).clamp(1, b.len());
                Some(b[k - 1])
            })
            .filter(|&p| p != i && (trace[p][3], p) < (done, i))
            .max_by_key(|&p| (trace[p][3], p));
        let pred = prev[i].filter(|&p| (trace[p][3], p) < (done, i));
        match (producer, pred) {
            (Some(p), q) if q.is_none_or(|q| trace[p][3] >= trace[q][3]) => {
                signal += gap(met, trace[p][3]);
                late += gap(reach.min(met), trace[p][3]);
                hops += 1;
                i = p;
            }
            (_, Some(q)) => {
                queue += gap(met, trace[q][3]);
                i = q;
            }
            _ => {
                queue += gap(met, reach);
                break;
            }
        }
    }
    let mut by_class: Vec<(String, (f64, u32))> = busy.into_iter().collect();
    by_class.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0).then_with(|| a.0.cmp(&b.0)));
    let busy_tasks = by_class.iter().map(|(c, (_, n))| (c.clone(), *n)).collect();
    let busy_us = by_class.into_iter().map(|(c, (us, _))| (c, us)).collect();
    Some(CriticalPath {
        tasks,
        hops,
        span_us: gap(trace[last][3], trace[first][0]),
        busy_us,
        busy_tasks,
        inputs_us: inputs,
        signal_us: signal,
        signal_late_us: late,
        queue_us: queue,
    })
}

/// GEMMs per implementation in one key's plan.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct GemmCounts {
    pub gemv: u32,
    pub skinny: u32,
    pub blas: u32,
}

impl GemmCounts {
    /// The counts of `kp`'s recorded choices.
    pub fn of(kp: &kiln_ir::plan::KeyPlan) -> GemmCounts {
        let mut c = GemmCounts::default();
        for (kind, n) in kp.gemm_kinds() {
            match kind {
                kiln_ir::plan::GemmKind::Gemv => c.gemv = n,
                kiln_ir::plan::GemmKind::Skinny => c.skinny = n,
                kiln_ir::plan::GemmKind::Blas => c.blas = n,
            }
        }
        c
    }
}

/// The whole report.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct BenchReport {
    pub plan: String,
    pub device: String,
    pub weights: String,
    /// `None` where the backend measures none (the CPU).
    pub copy_bandwidth_gbs: Option<f64>,
    /// Tensor-parallel ranks the plan runs on (1: a single device).
    pub tp: u32,
    pub keys: Vec<KeyResult>,
}

impl BenchReport {
    /// The human-readable table.
    pub fn table(&self) -> String {
        let bw = self
            .copy_bandwidth_gbs
            .map_or("not measured".to_string(), |b| format!("{b:.0} GB/s"));
        let mut s = format!(
            "plan {}  device {}  weights {}  memory bandwidth {bw}  tp {}\n",
            self.plan, self.device, self.weights, self.tp
        );
        let opt = |v: Option<f64>, width: usize, prec: usize| {
            v.map_or(format!("{:>width$}", "-"), |v| format!("{v:>width$.prec$}"))
        };
        s.push_str(&format!(
            "{:<10} {:<10} {:>5} {:>10} {:>10} {:>10} {:>7} {:>10} {:>9} {:>7} {:>9} {:>12} {:>12}\n",
            "key",
            "schedule",
            "ctx",
            "eager ms",
            "replay ms",
            "allred ms",
            "ratio",
            "tokens/s",
            "floor ms",
            "/floor",
            "capt ms",
            "arena B",
            "workspace B"
        ));
        for k in &self.keys {
            s.push_str(&format!(
                "{:<10} {:<10} {:>5} {:>10.3} {:>10.3} {} {:>7.2} {:>10.0} {} {} {:>9.1} {:>12} {:>12}\n",
                k.key,
                k.schedule,
                k.context,
                k.eager_ms,
                k.replay_ms,
                opt(k.collective_ms, 10, 3),
                k.speedup,
                k.tokens_per_s,
                opt(k.hbm_floor_ms, 9, 3),
                opt(k.replay_over_floor, 7, 2),
                k.capture_ms,
                k.arena_bytes,
                k.workspace_bytes
            ));
        }
        for k in &self.keys {
            if let Some(rows) = &k.profile {
                s.push_str(&profile_table(k, rows));
            }
            if let Some(c) = &k.critical_path {
                s.push_str(&critical_path_line(k, c));
            }
        }
        s
    }
}

/// One key's critical-path summary.
fn critical_path_line(k: &KeyResult, c: &CriticalPath) -> String {
    let busy: f64 = c.busy_us.iter().map(|b| b.1).sum();
    let classes: Vec<String> = c
        .busy_us
        .iter()
        .zip(&c.busy_tasks)
        .map(|((class, us), (_, n))| {
            format!(
                "{} {us:.1} in {n}, {:.2} each",
                class.trim_start_matches("task."),
                us / (*n).max(1) as f64
            )
        })
        .collect();
    format!(
        "critical path {}: {} tasks, {} hops between queues, {:.1} us: busy {busy:.1} us ({}; {:.1} us of it before the inputs were in shared memory), signal {:.1} us ({:.2} us per hop; {:.1} us of it before the waiter reached the task), between tasks {:.1} us ({:.2} us per task)\n",
        k.key,
        c.tasks,
        c.hops,
        c.span_us,
        classes.join(", "),
        c.inputs_us,
        c.signal_us,
        c.signal_us / c.hops.max(1) as f64,
        c.signal_late_us,
        c.queue_us,
        c.queue_us / c.tasks.saturating_sub(c.hops).max(1) as f64,
    )
}

/// One key's `--profile` table.
fn profile_table(k: &KeyResult, rows: &[ClassRow]) -> String {
    let mut s = match k.traced_replay_ms {
        Some(t) => format!(
            "\nprofile {}: one traced step {:.3} ms; traced replays {:.3} ms = {:.2}x the untraced {:.3} ms (the stamps' cost)\n",
            k.key,
            k.profiled_step_ms.unwrap_or(0.0),
            t,
            t / k.replay_ms,
            k.replay_ms
        ),
        None => format!(
            "\nprofile {}: {} launches, profiled step {:.3} ms = {:.2}x the replayed {:.3} ms (marks between ops serialize them)\n",
            k.key,
            rows.iter().map(|r| r.launches).sum::<u32>(),
            k.profiled_step_ms.unwrap_or(0.0),
            k.profile_over_replay.unwrap_or(0.0),
            k.replay_ms
        ),
    };
    s.push_str(&format!(
        "{:<48} {:>5} {:>8} {:>10} {:>6} {:>9} {:>8} {:>6}\n",
        "kernel class", "ops", "launches", "us/step", "share", "us/launch", "GB/s", "%copy"
    ));
    for r in rows {
        s.push_str(&format!(
            "{:<48} {:>5} {:>8} {:>10.1} {:>5.1}% {:>9.2} {:>8.1} {}\n",
            r.class,
            r.ops,
            r.launches,
            r.us,
            100.0 * r.share,
            r.us_per_launch,
            r.gbs,
            r.pct_of_copy_bw
                .map_or(format!("{:>6}", "-"), |p| format!("{p:>5.1}%"))
        ));
    }
    s
}

/// Bytes one step of `key` must move at `context` tokens per sequence: every
/// weight once (the embedding gather reads only its rows, but a tied
/// lm_head reads the whole table, so the table counts once), the K and V
/// rows of every context position of every layer, and the f32 logits row of
/// each sequence. The plan's own `bytes_moved` is computed at the compiled
/// maximum context; the benchmark's floor uses the context it runs.
pub fn step_bytes(plan: &kiln_ir::plan::Plan, key: Key, context: u32) -> u64 {
    let kv = &plan.kv;
    let kv_row = kv.kv_heads as u64 * kv.head_dim as u64 * kv.dtype.size() as u64;
    plan.manifest.total_bytes()
        + key.batch as u64 * context as u64 * kv.layers as u64 * 2 * kv_row
        + key.batch as u64 * plan.meta.info.vocab_size as u64 * 4
}

/// The device `--device` and `--ordinal` name.
fn device_spec(args: &BenchArgs) -> Result<DeviceSpec, BenchError> {
    let name = match args.device.as_str() {
        "cuda" | "hip" => format!("{}:{}", args.device, args.ordinal),
        other => other.to_string(),
    };
    Ok(name.parse::<DeviceSpec>()?)
}

/// The keys `--keys` names, or every key of the plan.
fn wanted_keys(args: &BenchArgs, plan: &kiln_ir::plan::Plan) -> Result<Vec<Key>, BenchError> {
    if args.keys.is_empty() {
        return Ok(plan.keys.iter().map(|k| k.key).collect());
    }
    args.keys
        .iter()
        .map(|s| {
            s.parse::<Key>()
                .map_err(|e| BenchError::Usage(format!("--keys: {e}")))
        })
        .collect()
}

/// Runs the benchmark; returns the report (the CLI prints its table).
pub fn run(args: &BenchArgs) -> Result<BenchReport, BenchError> {
    let spec = device_spec(args)?;
    let plan = kiln_runtime::loader::read_plan_file(&args.plan)?;
    crate::run_cmd::check_tp(args.tp, plan.tp)?;
    let tp = plan.tp;
    let keys = wanted_keys(args, &plan)?;
    let (device, bw, mut results) = bench_plan(args, &spec, plan, &args.plan, &keys)?;
    if let Some(also) = &args.also {
        let plan = kiln_runtime::loader::read_plan_file(also)?;
        if plan.tp != tp {
            return Err(BenchError::Usage(format!(
                "--also {}: the plan is tensor-parallel over {} rank(s), the first over {tp}; compare plans of one shape",
                also.display(),
                plan.tp
            )));
        }
        // The second plan's keys are the first's (each must exist).
        let (_, _, more) = bench_plan(args, &spec, plan, also, &keys)?;
        results.extend(more);
    }
    let report = BenchReport {
        plan: args.plan.display().to_string(),
        device,
        weights: args
            .weights
            .as_ref()
            .map_or("random".to_string(), |d| d.display().to_string()),
        copy_bandwidth_gbs: bw.map(|b| b / 1e9),
        tp,
        keys: results,
    };
    if let Some(p) = &args.json {
        write_json(&report, p)?;
    }
    Ok(report)
}

/// Loads `plan` (read from `path`) on a fresh backend and times `keys`:
/// the device's description, the measured copy bandwidth and one row per
/// key. The engine (and its device memory) is gone when this returns, so a
/// second plan runs on the same free device.
fn bench_plan(
    args: &BenchArgs,
    spec: &DeviceSpec,
    plan: kiln_ir::plan::Plan,
    path: &Path,
    keys: &[Key],
) -> Result<(String, Option<f64>, Vec<KeyResult>), BenchError> {
    let tp = plan.tp;
    for key in keys {
        if plan.key_plan(*key).is_none() {
            return Err(BenchError::Usage(format!(
                "{} has no key {key} (it has: {}); bench keys the plan has, or compile it with them",
                path.display(),
                plan.keys
                    .iter()
                    .map(|k| k.key.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    }
    let weights = match &args.weights {
        Some(d) => Weights::Dir(d),
        None => Weights::Random { seed: 1000 },
    };
    // Timed replays never run the traced interpreter: its stamps cost
    // time. A megakernel key's `--profile` trace comes from a second,
    // traced load of the same plan after the timings (below).
    let options = EngineOptions {
        graphs: GraphMode::On,
        log: false,
        trace_megakernel: false,
        ..EngineOptions::default()
    };
    let traced_plan = (args.profile && plan.keys.iter().any(|k| k.schedule.tape().is_some()))
        .then(|| plan.clone());
    let backend = open_backend_ranks(*spec, tp)?;
    let mut engine = Engine::with_weights(plan, weights, backend, options)?;
    let info = engine.device();
    let bw = engine.copy_bandwidth(1 << 30, 10)?;
    let eager_steps = (args.steps / 10).max(10);
    let mut results = Vec::new();
    // The rows of megakernel keys, profiled from the traced load.
    let mut traced = Vec::new();
    for &key in keys {
        let facts = engine.key_facts(key)?;
        let eager = engine.time_steps(key, StepMode::Eager, args.context, 3, eager_steps)?;
        let replay =
            engine.time_steps(key, StepMode::Graph, args.context, 10, args.steps.max(1))?;
        let (e, r) = (eager.median_ms, replay.median_ms);
        let bytes = step_bytes(engine.plan(), key, args.context);
        let gemms = engine
            .plan()
            .key_plan(key)
            .map(GemmCounts::of)
            .unwrap_or_default();
        let floor = bw.map(|bw| bytes as f64 / bw * 1e3);
        let megakernel = engine.runs_megakernel(key);
        // A megakernel key's profile is filled in from the traced load.
        if megakernel {
            traced.push(results.len());
        }
        let profile = if args.profile && !megakernel {
            let p = engine.profile_ops(key, args.context, 3, eager_steps)?;
            Some((class_rows(&p, bw.map(|b| b / 1e9)), p.total_ms()))
        } else {
            None
        };
        results.push(KeyResult {
            key: key.to_string(),
            schedule: if megakernel { "megakernel" } else { "graph" }.to_string(),
            plan: path.display().to_string(),
            batch: key.batch,
            query: key.query,
            context: args.context,
            launches: facts.launches,
            eager_ms: e,
            replay_ms: r,
            replay_back_to_back_ms: replay.back_to_back_ms,
            speedup: e / r,
            tokens_per_s: key.batch as f64 / (r / 1e3),
            bytes_moved: bytes,
            plan_bytes_moved: facts.bytes_moved,
            hbm_floor_ms: floor,
            replay_over_floor: floor.map(|f| r / f),
            capture_ms: replay.capture_ms.unwrap_or(0.0),
            collective_ms: replay.collective_ms.filter(|_| tp > 1),
            collective_share: replay
                .collective_ms
                .filter(|_| tp > 1 && replay.mean_ms > 0.0)
                .map(|c| c / replay.mean_ms),
            arena_bytes: facts.arena_bytes,
            workspace_bytes: facts.workspace_bytes,
            gemms,
            profiled_step_ms: profile.as_ref().map(|p| p.1),
            profile_over_replay: profile.as_ref().map(|p| p.1 / r),
            profile: profile.map(|p| p.0),
            traced_replay_ms: None,
            critical_path: None,
        });
    }
    if let (Some(plan), false) = (traced_plan, traced.is_empty()) {
        // The timed engine goes first, so the traced one has its memory.
        drop(engine);
        let backend = open_backend_ranks(*spec, tp)?;
        let options = EngineOptions {
            trace_megakernel: true,
            ..options
        };
        let mut engine = Engine::with_weights(plan, weights, backend, options)?;
        for i in traced {
            let key = keys[i];
            let steps = args.steps.clamp(1, 20);
            let replay = engine.time_steps(key, StepMode::Graph, args.context, 3, steps)?;
            let Some(trace) = engine.megakernel_trace(key)? else {
                continue;
            };
            // The last replayed step's tape trace: time per task class, and
            // the chain of tasks that decided the step's length.
            let kp = engine.plan().key_plan(key).expect("a loaded key");
            let (rows, span) =
                tape_rows(engine.plan(), kp, &trace, args.context, bw.map(|b| b / 1e9));
            let row = &mut results[i];
            row.critical_path = critical_path(kp, &trace);
            row.profiled_step_ms = Some(span);
            row.profile_over_replay = Some(span / row.replay_ms);
            row.traced_replay_ms = Some(replay.median_ms);
            row.profile = Some(rows);
        }
    }
    let device = format!("{} ({}, {})", info.name, info.backend, info.arch);
    Ok((device, bw, results))
}

/// Writes the report as JSON to `path` (temp file, then rename).
pub fn write_json(report: &BenchReport, path: &Path) -> Result<(), BenchError> {
    let text = serde_json::to_string_pretty(report).expect("the report serializes");
    kiln_ir::artifact::write_bytes_atomic(path, text.as_bytes()).map_err(|e| BenchError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
    use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
    use kiln_ir::plan::Target;

    fn report_row() -> KeyResult {
        KeyResult {
            key: "b1q1s0".into(),
            batch: 1,
            query: 1,
            context: 512,
            launches: 256,
            schedule: "graph".into(),
            plan: "p.kiln".into(),
            eager_ms: 1.5,
            replay_ms: 0.5,
            replay_back_to_back_ms: 0.5,
            speedup: 3.0,
            tokens_per_s: 2000.0,
            bytes_moved: 1 << 30,
            plan_bytes_moved: 1 << 31,
            hbm_floor_ms: Some(0.27),
            replay_over_floor: Some(1.85),
            capture_ms: 2.0,
            collective_ms: None,
            collective_share: None,
            arena_bytes: 1 << 20,
            workspace_bytes: 0,
            gemms: GemmCounts {
                gemv: 0,
                skinny: 7,
                blas: 1,
            },
            profile: None,
            profiled_step_ms: None,
            profile_over_replay: None,
            traced_replay_ms: None,
            critical_path: None,
        }
    }

    #[test]
    fn the_report_table_has_a_row_per_key_and_json_round_trips_through_a_file() {
        let r = BenchReport {
            plan: "m.kiln".into(),
            device: "test".into(),
            weights: "random".into(),
            copy_bandwidth_gbs: Some(4000.0),
            tp: 1,
            keys: vec![
                report_row(),
                KeyResult {
                    key: "b8q1s0".into(),
                    hbm_floor_ms: None,
                    replay_over_floor: None,
                    ..report_row()
                },
            ],
        };
        let t = r.table();
        assert!(
            t.contains("b1q1s0") && t.contains("3.00") && t.contains("1.85"),
            "{t}"
        );
        assert!(t.contains("4000 GB/s"), "{t}");
        let b8 = t
            .lines()
            .find(|l| l.starts_with("b8q1s0"))
            .expect("a b8 row");
        assert!(b8.contains(" - "), "an unmeasured floor prints as -: {b8}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bench.json");
        write_json(&r, &p).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert_eq!(v["keys"][0]["replay_ms"], 0.5);
        assert!(v["keys"][1]["hbm_floor_ms"].is_null());
        assert!(
            v["keys"][0].get("profile").is_none() && v["keys"][0].get("profiled_step_ms").is_none(),
            "without --profile the JSON keeps its old fields only"
        );
    }

    fn op(classes: &[&str], ms: f64, bytes: u64) -> kiln_runtime::OpTime {
        kiln_runtime::OpTime {
            index: 0,
            mnemonic: "matmul".into(),
            kernel: "k".into(),
            classes: classes.iter().map(|c| c.to_string()).collect(),
            bytes,
            median_ms: ms,
        }
    }

    /// Two one-launch GEMV ops and one two-launch attention op, with times
    /// and bytes chosen so every figure is known by hand.
    #[test]
    fn class_rows_sum_ops_per_kernel_class_slowest_first_with_bandwidth_against_the_copy_peak() {
        let gemv = "gemv.gemv_t1_bf16_bf16";
        let p = StepProfile {
            key: Key::new(1, 1, 0),
            context: 512,
            reps: 5,
            ops: vec![
                op(&[gemv], 0.002, 4_000_000),
                op(
                    &["attention.split_bf16", "attention.combine_bf16"],
                    0.006,
                    1_200_000,
                ),
                op(&[gemv], 0.003, 4_000_000),
            ],
        };
        let rows = class_rows(&p, Some(4000.0));
        assert_eq!(rows.len(), 2);
        let (a, g) = (&rows[0], &rows[1]);
        assert_eq!(a.class, "attention.split_bf16 + attention.combine_bf16");
        assert_eq!((a.ops, a.launches, a.bytes), (1, 2, 1_200_000));
        assert!((a.us - 6.0).abs() < 1e-9 && (a.us_per_launch - 3.0).abs() < 1e-9);
        // 1.2 MB in 6 us = 200 GB/s = 5% of 4000 GB/s.
        assert!((a.gbs - 200.0).abs() < 1e-6, "{a:?}");
        assert!((a.pct_of_copy_bw.unwrap() - 5.0).abs() < 1e-6);
        assert_eq!(g.class, gemv);
        assert_eq!((g.ops, g.launches, g.bytes), (2, 2, 8_000_000));
        // 8 MB in 5 us = 1600 GB/s = 40%.
        assert!((g.gbs - 1600.0).abs() < 1e-6, "{g:?}");
        assert!((g.pct_of_copy_bw.unwrap() - 40.0).abs() < 1e-6);
        assert!((a.share - 6.0 / 11.0).abs() < 1e-9 && (g.share - 5.0 / 11.0).abs() < 1e-9);
        // Without a measured copy bandwidth there is no percentage.
        assert!(class_rows(&p, None)
            .iter()
            .all(|r| r.pct_of_copy_bw.is_none()));
    }

    fn tiny_plan(dir: &Path, keys: &[Key]) -> PathBuf {
        tiny_plan_for(dir, keys, Target::Cpu)
    }

    fn tiny_plan_for(dir: &Path, keys: &[Key], target: Target) -> PathBuf {
        let model = dir.join("model");
        std::fs::create_dir_all(&model).unwrap();
        write_tiny_model(&model, Family::Llama, &TinySpec::for_family(Family::Llama)).unwrap();
        let opts = CompileOptions {
            keys: keys.to_vec(),
            target,
            kv: KvOptions {
                max_context: Some(64),
                ..KvOptions::default()
            },
            ..Default::default()
        };
        let plan = compile_dir(&model, &opts, &mut |_, _| {}).unwrap().plan;
        let path = dir.join("tiny.kiln");
        kiln_ir::artifact::write_plan_atomic(&path, &plan).unwrap();
        path
    }

    fn args(plan: PathBuf) -> BenchArgs {
        BenchArgs {
            plan,
            weights: None,
            device: "cpu".into(),
            ordinal: 0,
            keys: vec![],
            steps: 3,
            context: 20,
            json: None,
            tp: None,
            profile: false,
            also: None,
        }
    }

    /// The tiny Llama compiled with the megakernel schedule (key b1, a tape
    /// of four queues), for the trace tests.
    fn tiny_megakernel_plan() -> kiln_ir::plan::Plan {
        tiny_megakernel_plan_for(CompileOptions::default().target, 4)
    }

    /// [`tiny_megakernel_plan`] for `target`, its tape cut for `sms` SMs.
    fn tiny_megakernel_plan_for(target: Target, sms: u32) -> kiln_ir::plan::Plan {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model");
        std::fs::create_dir_all(&model).unwrap();
        write_tiny_model(&model, Family::Llama, &TinySpec::for_family(Family::Llama)).unwrap();
        let opts = CompileOptions {
            keys: vec![Key::new(1, 1, 0)],
            target,
            schedule: kiln_compiler::passes::megakernel::ScheduleKind::Megakernel,
            megakernel: kiln_compiler::passes::megakernel::MegakernelOptions {
                sm_count: sms,
                ..Default::default()
            },
            kv: KvOptions {
                max_context: Some(64),
                ..KvOptions::default()
            },
            ..Default::default()
        };
        compile_dir(&model, &opts, &mut |_, _| {}).unwrap().plan
    }

    /// A megakernel step's trace becomes one row per task class plus the
    /// blocks' waiting and idle time, whose shares sum to one and whose
    /// task counts are the tape's.
    #[test]
    fn a_tape_trace_gives_time_per_task_class_waiting_and_idle_shares() {
        let plan = tiny_megakernel_plan();
        let kp = &plan.keys[0];
        let tape = kp.schedule.tape().unwrap();
        // Task i: reached at 100 i, waits met 10 later, done 50 after that.
        let trace: Vec<[u64; 4]> = (0..tape.tasks.len() as u64)
            .map(|i| [100 * i, 100 * i + 10, 100 * i + 10, 100 * i + 60])
            .collect();
        let (rows, span) = tape_rows(&plan, kp, &trace, 20, Some(100.0));
        let n = tape.tasks.len() as f64;
        assert!(
            (span - (100.0 * (n - 1.0) + 60.0) / 1e6).abs() < 1e-12,
            "{span}"
        );
        let share: f64 = rows.iter().map(|r| r.share).sum();
        assert!((share - 1.0).abs() < 1e-9, "{rows:#?}");
        let tasks: u32 = rows
            .iter()
            .filter(|r| r.class.starts_with("task."))
            .map(|r| r.ops)
            .sum();
        assert_eq!(tasks as usize, tape.tasks.len());
        assert!(
            rows.iter().any(|r| r.class.ends_with("matmul")),
            "{rows:#?}"
        );
        let wait = rows.iter().find(|r| r.class == "wait (counters)").unwrap();
        assert!((wait.us - 10.0 * n / 4.0 / 1e3).abs() < 1e-9, "{wait:?}");
        assert_eq!(rows.last().unwrap().class, "idle");
    }

    /// The critical path of a traced step starts at the task that finished
    /// last, follows waits across queues (hops) and queue order otherwise,
    /// and its busy, signal and between-task times add up to its span.
    #[test]
    fn a_tape_traces_critical_path_accounts_for_its_whole_span() {
        let plan = tiny_megakernel_plan();
        let kp = &plan.keys[0];
        let tape = kp.schedule.tape().unwrap();
        // Task i: reached at 1000 i, waits met 100 later, done 500 after that.
        let n = tape.tasks.len() as u64;
        let trace: Vec<[u64; 4]> = (0..n)
            .map(|i| [1000 * i, 1000 * i + 100, 1000 * i + 300, 1000 * i + 600])
            .collect();
        let c = critical_path(kp, &trace).unwrap();
        let busy: f64 = c.busy_us.iter().map(|b| b.1).sum();
        assert!(
            (busy + c.signal_us + c.queue_us - c.span_us).abs() < 1e-9,
            "{c:#?}"
        );
        assert!(c.hops > 0 && c.tasks > c.hops, "{c:#?}");
        assert!((busy - 0.5 * c.tasks as f64).abs() < 1e-9, "{c:#?}");
        assert!(c.busy_us.iter().any(|b| b.0.ends_with("matmul")), "{c:#?}");
        // Every path task is counted once, under its own class.
        assert_eq!(c.busy_tasks.iter().map(|b| b.1).sum::<u32>(), c.tasks);
        for ((class, us), (same, n)) in c.busy_us.iter().zip(&c.busy_tasks) {
            assert_eq!(class, same);
            assert!((us - 0.5 * *n as f64).abs() < 1e-9, "{class}: {c:#?}");
        }
        // The path ends at the task that finished last (the tape's last).
        assert!(c.span_us <= trace[n as usize - 1][3] as f64 / 1e3);
        // Inputs were ready 200 ns after the waits were met, on every task.
        assert!((c.inputs_us - 0.2 * c.tasks as f64).abs() < 1e-9, "{c:#?}");
        // A trace of the wrong length is not this tape's.
        assert!(critical_path(kp, &trace[1..]).is_none());
    }

    /// A hop's signal time splits in two: before the waiting block reached
    /// the task (its own queue was late: the producer was already done),
    /// and after (the counters' round trip while the block polled).
    #[test]
    fn a_hops_signal_separates_a_waiter_arriving_late_from_the_counter_round_trip() {
        let plan = tiny_megakernel_plan();
        let kp = &plan.keys[0];
        let n = kp.schedule.tape().unwrap().tasks.len() as u64;
        // Every block reached its tasks at once (time 0): nothing is late,
        // the whole signal is the round trip.
        let early: Vec<[u64; 4]> = (0..n)
            .map(|i| [0, 1000 * i + 100, 1000 * i + 100, 1000 * i + 600])
            .collect();
        let c = critical_path(kp, &early).unwrap();
        assert!(c.hops > 0 && c.signal_us > 0.0, "{c:#?}");
        assert_eq!(c.signal_late_us, 0.0, "{c:#?}");
        // Task i reached 1000 i, met 100 later: a hop from task p (done at
        // 1000 p + 600) is late by 1000 (i - p) - 600 of its
        // 1000 (i - p) - 500, so 100 ns per hop is the round trip.
        let late: Vec<[u64; 4]> = (0..n)
            .map(|i| [1000 * i, 1000 * i + 100, 1000 * i + 100, 1000 * i + 600])
            .collect();
        let c = critical_path(kp, &late).unwrap();
        assert!(c.hops > 0, "{c:#?}");
        let round_trip = c.signal_us - c.signal_late_us;
        assert!(
            (round_trip - 0.1 * c.hops as f64).abs() < 1e-9,
            "{round_trip} {c:#?}"
        );
    }

    /// `kiln bench PLAN --also PLAN2`: the second plan's rows follow the
    /// first's in the same report, each row naming its plan and schedule;
    /// a second plan without one of the keys is refused naming it.
    #[test]
    fn also_times_a_second_plan_in_the_same_run_with_its_rows_after_the_first() {
        let dir = tempfile::tempdir().unwrap();
        let a_dir = dir.path().join("a");
        let b_dir = dir.path().join("b");
        let a_plan = tiny_plan(&a_dir, &[Key::new(1, 1, 0), Key::new(2, 1, 0)]);
        let b_plan = tiny_plan(&b_dir, &[Key::new(1, 1, 0), Key::new(2, 1, 0)]);
        let mut a = args(a_plan.clone());
        a.also = Some(b_plan.clone());
        let r = run(&a).unwrap();
        let rows: Vec<(String, String, String)> = r
            .keys
            .iter()
            .map(|k| (k.key.clone(), k.plan.clone(), k.schedule.clone()))
            .collect();
        let (pa, pb) = (a_plan.display().to_string(), b_plan.display().to_string());
        assert_eq!(
            rows,
            vec![
                ("b1q1s0".into(), pa.clone(), "graph".into()),
                ("b2q1s0".into(), pa, "graph".into()),
                ("b1q1s0".into(), pb.clone(), "graph".into()),
                ("b2q1s0".into(), pb, "graph".into()),
            ]
        );
        assert!(r.table().contains("schedule"), "{}", r.table());
        let c_plan = tiny_plan(&dir.path().join("c"), &[Key::new(1, 1, 0)]);
        let mut bad = args(a_plan);
        bad.also = Some(c_plan);
        let e = run(&bad).unwrap_err().to_string();
        assert!(e.contains("no key b2q1s0"), "{e}");
    }

    /// `kiln bench --device cpu` on a compiled tiny plan: one row per key,
    /// real (nonzero) eager and replay times from the engine, the floor over
    /// the CPU's measured read bandwidth, and the step bytes at the
    /// benchmark's context.
    #[test]
    fn bench_times_every_key_of_a_compiled_plan_through_the_engine() {
        let dir = tempfile::tempdir().unwrap();
        let keys = [Key::new(1, 1, 0), Key::new(2, 1, 0), Key::new(2, 3, 2)];
        let plan_path = tiny_plan(dir.path(), &keys);
        let mut a = args(plan_path.clone());
        a.json = Some(dir.path().join("bench.json"));
        let r = run(&a).unwrap();
        assert_eq!(r.weights, "random");
        let bw = r
            .copy_bandwidth_gbs
            .expect("the CPU measures its read bandwidth");
        assert!(bw.is_finite() && bw > 0.0, "{bw}");
        assert_eq!(
            r.keys.iter().map(|k| k.key.clone()).collect::<Vec<_>>(),
            vec!["b1q1s0", "b2q1s0", "b2q3s2"]
        );
        let plan = kiln_runtime::loader::read_plan_file(&plan_path).unwrap();
        for k in &r.keys {
            assert!(k.eager_ms > 0.0 && k.replay_ms > 0.0, "{k:?}");
            let key: Key = k.key.parse().unwrap();
            assert_eq!(k.bytes_moved, step_bytes(&plan, key, 20));
            let floor = k.hbm_floor_ms.unwrap();
            let want = k.bytes_moved as f64 / (bw * 1e9) * 1e3;
            assert!(
                (floor - want).abs() <= 1e-9 * want.max(1.0),
                "{floor} vs {want}"
            );
            assert!((k.replay_over_floor.unwrap() - k.replay_ms / floor).abs() < 1e-6);
            assert_eq!(k.launches, plan.key_plan(key).unwrap().launches);
            assert_eq!(k.arena_bytes, plan.arena_bytes);
            // A CPU plan runs reference kernels: no GEMM has an implementation.
            assert_eq!(k.gemms, GemmCounts::default());
        }
        assert!(a.json.as_ref().unwrap().is_file());
        // Only the keys asked for; an unknown key is refused by name.
        let mut one = args(plan_path.clone());
        one.keys = vec!["b2q1s0".into()];
        assert_eq!(run(&one).unwrap().keys.len(), 1);
        let mut bad = args(plan_path);
        bad.keys = vec!["b4q1s0".into()];
        let e = run(&bad).unwrap_err().to_string();
        assert!(e.contains("b4q1s0") && e.contains("b2q1s0"), "{e}");
    }

    /// `kiln bench --device cpu --profile`: per key one row per kernel class
    /// of the plan (counted here from the plan's ops), launches adding up to
    /// the key's, positive times, shares summing to 1, the cost model's
    /// bytes, and the rows round-trip through the JSON file.
    #[test]
    fn profiling_gives_one_row_per_kernel_class_whose_launches_add_up_to_the_keys() {
        let dir = tempfile::tempdir().unwrap();
        let keys = [Key::new(1, 1, 0), Key::new(2, 3, 2)];
        let plan_path = tiny_plan(dir.path(), &keys);
        let plan = kiln_runtime::loader::read_plan_file(&plan_path).unwrap();
        let mut a = args(plan_path);
        a.profile = true;
        a.json = Some(dir.path().join("bench.json"));
        let r = run(&a).unwrap();
        assert_eq!(r.keys.len(), 2);
        for k in &r.keys {
            let key: Key = k.key.parse().unwrap();
            let kp = plan.key_plan(key).unwrap();
            let rows = k.profile.as_ref().expect("--profile gives rows");
            let mut want = std::collections::BTreeMap::new();
            for op in &kp.ops {
                *want.entry(format!("cpu.{}", op.kernel)).or_insert(0u32) += 1;
            }
            let got: std::collections::BTreeMap<String, u32> =
                rows.iter().map(|r| (r.class.clone(), r.launches)).collect();
            assert_eq!(rows.len(), got.len(), "one row per class");
            assert_eq!(got, want);
            assert_eq!(rows.iter().map(|r| r.launches).sum::<u32>(), k.launches);
            assert!(
                rows.iter()
                    .all(|r| r.us > 0.0 && r.pct_of_copy_bw.is_some_and(|p| p > 0.0)),
                "{rows:?}"
            );
            assert!(rows.windows(2).all(|w| w[0].us >= w[1].us), "slowest first");
            let share: f64 = rows.iter().map(|r| r.share).sum();
            assert!((share - 1.0).abs() < 1e-9, "shares sum to {share}");
            let bytes: u64 = kp
                .ops
                .iter()
                .map(|op| kiln_runtime::op_bytes(op, &plan.kv, 20))
                .sum();
            assert_eq!(rows.iter().map(|r| r.bytes).sum::<u64>(), bytes);
            let profiled = k.profiled_step_ms.unwrap();
            let sum_us: f64 = rows.iter().map(|r| r.us).sum();
            assert!((profiled * 1e3 - sum_us).abs() < 1e-6 * sum_us.max(1.0));
            assert!((k.profile_over_replay.unwrap() - profiled / k.replay_ms).abs() < 1e-9);
        }
        let t = r.table();
        assert!(
            t.contains("profile b1q1s0")
                && t.contains("profile b2q3s2")
                && t.contains("kernel class"),
            "{t}"
        );
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(a.json.as_ref().unwrap()).unwrap()).unwrap();
        for (i, k) in r.keys.iter().enumerate() {
            let back: Vec<ClassRow> =
                serde_json::from_value(v["keys"][i]["profile"].clone()).unwrap();
            // Floats come back within an ulp or so (serde_json's parser).
            let close = |x: f64, y: f64| (x - y).abs() <= 1e-12 * x.abs().max(y.abs());
            let rows = k.profile.as_ref().unwrap();
            assert_eq!(back.len(), rows.len());
            for (b, r) in back.iter().zip(rows) {
                assert_eq!(
                    (&b.class, b.ops, b.launches, b.bytes),
                    (&r.class, r.ops, r.launches, r.bytes)
                );
                assert!(
                    match (b.pct_of_copy_bw, r.pct_of_copy_bw) {
                        (Some(x), Some(y)) => close(x, y),
                        (x, y) => x == y,
                    } && close(b.us, r.us)
                        && close(b.share, r.share)
                        && close(b.us_per_launch, r.us_per_launch)
                        && close(b.gbs, r.gbs),
                    "{b:?} vs {r:?}"
                );
            }
            assert_eq!(v["keys"][i]["launches"], k.launches, "old fields stay");
        }
    }

    /// Whether a CUDA device is usable; without one a GPU test prints
    /// SKIPPED and passes, unless `KILN_REQUIRE_CUDA=1` (the GPU machine).
    #[cfg(feature = "cuda")]
    fn cuda_here() -> bool {
        if kiln_runtime::cuda::CudaBackend::available() {
            return true;
        }
        if std::env::var("KILN_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
            panic!("KILN_REQUIRE_CUDA=1 but no CUDA device is usable");
        }
        eprintln!("SKIPPED: no CUDA driver or device on this machine");
        false
    }

    /// The GPU machine's check of `--profile` (feature `cuda`; without a
    /// device it prints SKIPPED and passes unless `KILN_REQUIRE_CUDA=1`):
    /// classes are the plan's own `module.entry` launches (or the BLAS
    /// library), launches add up, times are positive and each class has a
    /// share of the measured copy bandwidth. The table goes to stderr.
    #[cfg(feature = "cuda")]
    #[test]
    fn on_cuda_the_profile_names_the_plans_kernel_entries_and_their_share_of_the_copy_peak() {
        use kiln_ir::plan::Lowering;
        use kiln_runtime::cuda::CudaBackend;
        if !cuda_here() {
            return;
        }
        let sm = CudaBackend::new(0).expect("open CUDA device 0").sm();
        let dir = tempfile::tempdir().unwrap();
        let keys = [Key::new(1, 1, 0), Key::new(4, 1, 0)];
        let path = tiny_plan_for(dir.path(), &keys, Target::Cuda { sm });
        let plan = kiln_runtime::loader::read_plan_file(&path).unwrap();
        let mut a = args(path);
        a.device = "cuda".into();
        a.profile = true;
        a.steps = 50;
        let r = run(&a).unwrap();
        eprintln!("{}", r.table());
        assert!(r.copy_bandwidth_gbs.is_some_and(|b| b > 0.0));
        for k in &r.keys {
            let key: Key = k.key.parse().unwrap();
            let kp = plan.key_plan(key).unwrap();
            let mut entries = std::collections::BTreeSet::new();
            for op in &kp.ops {
                match &op.lowering {
                    Lowering::Kernels(ks) => {
                        entries.extend(ks.iter().map(|k| format!("{}.{}", k.module, k.entry)))
                    }
                    Lowering::Gemm {
                        kernel: Some(k), ..
                    } => {
                        entries.insert(format!("{}.{}", k.module, k.entry));
                    }
                    _ => {}
                }
            }
            let rows = k.profile.as_ref().expect("--profile gives rows");
            for row in rows {
                for part in row.class.split(" + ") {
                    assert!(
                        entries.contains(part) || part.starts_with("blas.gemm_"),
                        "{part} is no launch of the plan"
                    );
                }
                assert!(row.us > 0.0, "{row:?}");
                assert!(
                    row.pct_of_copy_bw
                        .is_some_and(|p| p.is_finite() && p >= 0.0),
                    "{row:?}"
                );
            }
            assert_eq!(rows.iter().map(|r| r.launches).sum::<u32>(), k.launches);
            let share: f64 = rows.iter().map(|r| r.share).sum();
            assert!((share - 1.0).abs() < 1e-9);
            assert!(k.profile_over_replay.is_some_and(|x| x > 0.0));
        }
    }

    /// The GPU machine's check of `--profile` on a megakernel key (feature
    /// `cuda`; SKIPPED without a device unless `KILN_REQUIRE_CUDA=1`): the
    /// timed replays are the untraced interpreter's, the trace comes from a
    /// second, traced load (its own median reported next to them), and the
    /// profile covers every task of the tape with a critical path whose
    /// parts add up to its span.
    #[cfg(feature = "cuda")]
    #[test]
    fn on_cuda_a_megakernel_key_is_timed_untraced_and_profiled_from_a_traced_load() {
        use kiln_runtime::cuda::CudaBackend;
        if !cuda_here() {
            return;
        }
        let dev = CudaBackend::new(0).expect("open CUDA device 0");
        let (sm, sms) = (dev.sm(), dev.sm_count());
        drop(dev);
        let dir = tempfile::tempdir().unwrap();
        let plan = tiny_megakernel_plan_for(Target::Cuda { sm }, sms);
        let tasks = plan.keys[0].schedule.tape().expect("a tape").tasks.len();
        let path = dir.path().join("mk.kiln");
        kiln_ir::artifact::write_plan_atomic(&path, &plan).unwrap();
        let mut a = args(path);
        a.device = "cuda".into();
        a.profile = true;
        a.steps = 30;
        let r = run(&a).unwrap();
        eprintln!("{}", r.table());
        let k = &r.keys[0];
        assert_eq!(k.schedule, "megakernel");
        assert!(k.replay_ms > 0.0);
        let traced = k.traced_replay_ms.expect("a traced load's median");
        assert!(traced > 0.0);
        let rows = k.profile.as_ref().expect("--profile gives rows");
        let task_rows: u64 = rows
            .iter()
            .filter(|r| r.class.starts_with("task."))
            .map(|r| r.ops as u64)
            .sum();
        assert_eq!(
            task_rows, tasks as u64,
            "every task of the tape is in the profile"
        );
        let span = k.profiled_step_ms.expect("the traced step's span");
        assert!(span > 0.0);
        assert!((k.profile_over_replay.unwrap() - span / k.replay_ms).abs() < 1e-9);
        let c = k.critical_path.as_ref().expect("a critical path");
        assert!(c.tasks >= 1 && c.tasks as usize <= tasks, "{c:?}");
        let busy: f64 = c.busy_us.iter().map(|b| b.1).sum();
        assert!(
            busy > 0.0 && c.signal_us >= 0.0 && c.queue_us >= 0.0,
            "{c:?}"
        );
        // Up to clock skew between SMs (clamped), the parts are the span.
        assert!(
            (busy + c.signal_us + c.queue_us - c.span_us).abs() <= 0.05 * c.span_us,
            "{c:?}"
        );
    }

    #[test]
    fn a_context_the_plan_cannot_hold_is_refused_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let mut a = args(tiny_plan(dir.path(), &[Key::new(1, 1, 0)]));
        a.context = 10_000;
        let e = run(&a).unwrap_err().to_string();
        assert!(e.contains("shorter context"), "{e}");
    }

    #[test]
    fn the_hbm_floor_bytes_grow_with_context_by_the_kv_rows_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = tiny_plan(dir.path(), &[Key::new(3, 1, 0)]);
        let plan = kiln_runtime::loader::read_plan_file(&path).unwrap();
        let k = Key::new(3, 1, 0);
        let row = plan.kv.kv_heads as u64 * plan.kv.head_dim as u64 * plan.kv.dtype.size() as u64;
        assert_eq!(
            step_bytes(&plan, k, 40) - step_bytes(&plan, k, 39),
            3 * plan.kv.layers as u64 * 2 * row
        );
        assert!(step_bytes(&plan, k, 1) > plan.manifest.total_bytes());
    }

    #[test]
    fn an_unknown_device_is_refused_with_the_names_it_accepts() {
        let mut a = args("x.kiln".into());
        a.device = "gpu".into();
        let e = run(&a).unwrap_err().to_string();
        assert!(e.contains("expected cpu, cuda"), "{e}");
    }
}
