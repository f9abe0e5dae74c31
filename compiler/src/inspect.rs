//! `kiln inspect`: a plan as stable, diffable text (or DOT, or a JSON
//! summary).
//!
//! This is what a reviewer reads when a model change alters a plan, and what
//! golden tests pin, so the same plan always prints the same bytes: nothing
//! here depends on hash order, time or paths. The text holds, for the plan,
//! the model, KV layout, arena/workspace sizes and the weight manifest; and
//! per key a summary (launches, arena peak, lower bound, efficiency,
//! workspace, Io bytes, flops, bytes moved), the IR after passes in the
//! `kiln_ir` text form (which parses back), the memory map (value, region,
//! offset, bytes, first and last use; then each op's scratch and counters),
//! and the launch list (GPU targets: each op's kernels with module, entry,
//! grid, block, dynamic shared bytes, PDL flag and parameters, or its GEMM
//! shape and skinny-GEMM alternative; CPU: one line, the reference kernels),
//! and for a megakernel schedule the tape: every task's queue slot, tile,
//! bytes read and written and waits, then each queue's tasks.
//!
//! Not here: decoding (that is [`kiln_ir::artifact`]), any judgement of the
//! plan (that is [`crate::planner::check`]).

use crate::compile::efficiency;
use kiln_ir::artifact::{self, ArtifactError};
use kiln_ir::plan::{
    BufRef, GemmShape, KernelLaunch, KeyPlan, LaunchParam, Lowering, Plan, Region,
};
use kiln_ir::schedule::Tape;
use kiln_ir::{Key, WeightSource};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Output format of `kiln inspect`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Summary, IR and memory map per key.
    Text,
    /// Graphviz DOT of each key's graph.
    Dot,
    /// The summary as JSON.
    Json,
}

/// `kiln inspect` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct InspectArgs {
    /// The plan file (`kiln compile -o ...`).
    pub plan: PathBuf,
    /// Only this key (e.g. `b8q1s0`).
    #[arg(long)]
    pub key: Option<Key>,
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

/// Why a plan could not be inspected.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error("cannot read `{path}`: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("`{path}`: {source}")]
    Artifact {
        path: PathBuf,
        source: ArtifactError,
    },
    #[error("the plan has no key {key}; it has {available}")]
    NoSuchKey { key: Key, available: String },
}

/// Reads a plan file.
pub fn load(path: &Path) -> Result<Plan, InspectError> {
    let bytes = std::fs::read(path).map_err(|source| InspectError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    artifact::decode(&bytes).map_err(|source| InspectError::Artifact {
        path: path.to_path_buf(),
        source,
    })
}

/// The keys to show: all, or the one asked for.
fn selected(plan: &Plan, key: Option<Key>) -> Result<Vec<&KeyPlan>, InspectError> {
    match key {
        None => Ok(plan.keys.iter().collect()),
        Some(k) => match plan.key_plan(k) {
            Some(kp) => Ok(vec![kp]),
            None => Err(InspectError::NoSuchKey {
                key: k,
                available: plan
                    .keys
                    .iter()
                    .map(|k| k.key.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        },
    }
}

/// Runs `kiln inspect`, returning what it prints.
pub fn run(args: &InspectArgs) -> Result<String, InspectError> {
    let plan = load(&args.plan)?;
    render(&plan, args.key, args.format)
}

/// Renders `plan` (or one key of it) in `format`.
pub fn render(plan: &Plan, key: Option<Key>, format: Format) -> Result<String, InspectError> {
    let keys = selected(plan, key)?;
    Ok(match format {
        Format::Text => text(plan, &keys),
        Format::Dot => keys.iter().map(|k| kiln_ir::to_dot(&k.graph)).collect(),
        Format::Json => json(plan, &keys),
    })
}

fn region(r: Region) -> String {
    match r {
        Region::Arena => "arena".into(),
        Region::Io => "io".into(),
        Region::Weight(i) => format!("weight.{i}"),
        Region::KCache(l) => format!("k_cache.{l}"),
        Region::VCache(l) => format!("v_cache.{l}"),
        Region::Workspace => "workspace".into(),
        Region::Counters => "counters".into(),
    }
}

/// One launch parameter as `kiln inspect` prints it: a buffer as
/// `region+offset[bytes]`, constants with their type.
fn param(p: &LaunchParam) -> String {
    match p {
        LaunchParam::Buf(b) => format!("{}+{}[{}]", region(b.region), b.offset, b.bytes),
        LaunchParam::Null => "null".into(),
        LaunchParam::I32(v) => format!("i32 {v}"),
        LaunchParam::I64(v) => format!("i64 {v}"),
        LaunchParam::F32(v) => format!("f32 {v:?}"),
        LaunchParam::Blob(b) => format!("blob[{}]", b.len()),
    }
}

fn dims(d: [u32; 3]) -> String {
    format!("{}x{}x{}", d[0], d[1], d[2])
}

fn launch_line(l: &KernelLaunch) -> String {
    format!(
        "{}.{} grid {} block {} shared {}{}{} ({})",
        l.module,
        l.entry,
        dims(l.grid),
        dims(l.block),
        l.shared_bytes,
        if l.pdl { " pdl" } else { "" },
        if l.cluster > 1 {
            format!(" cluster {}", l.cluster)
        } else {
            String::new()
        },
        l.params.iter().map(param).collect::<Vec<_>>().join(", ")
    )
}

fn gemm_line(g: &GemmShape) -> String {
    format!(
        "gemm t {} n {} k {} {} -> {}{}",
        g.t,
        g.n,
        g.k,
        g.dtype,
        g.out,
        if g.bias { " +bias" } else { "" }
    )
}

fn opt(x: Option<u32>) -> String {
    x.map_or("-".to_string(), |x| x.to_string())
}

fn text(plan: &Plan, keys: &[&KeyPlan]) -> String {
    let mut o = String::new();
    let m = &plan.meta;
    let kv = &plan.kv;
    let _ = writeln!(o, "plan {}", m.architecture);
    let _ = writeln!(o, "  target      {}", m.target);
    let _ = writeln!(o, "  compiler    kiln {}", m.compiler_version);
    for f in &m.files {
        let _ = writeln!(
            o,
            "  file        {} ({} bytes, header sha256 {})",
            f.name, f.size, f.header_sha256
        );
    }
    let i = &m.info;
    let _ = writeln!(
        o,
        "  model       vocab {} hidden {} layers {} heads {} kv_heads {} head_dim {} {} max_context {}",
        i.vocab_size, i.hidden_size, i.num_layers, i.num_heads, i.num_kv_heads, i.head_dim, i.dtype, i.max_context
    );
    let _ = writeln!(
        o,
        "  kv          {} layers x {} blocks (null block {}) x {} tokens, {} kv_heads x {} head_dim {}, {} blocks/seq, {} bytes per cache",
        kv.layers, kv.num_blocks, kv.null_block, kv.block_size, kv.kv_heads, kv.head_dim, kv.dtype, kv.max_blocks_per_seq, kv.cache_bytes()
    );
    if plan.tp > 1 {
        let _ = writeln!(
            o,
            "  ranks       {} (tensor parallel: every rank runs this program on its shard; kv, arena, workspace and counters are per rank)",
            plan.tp
        );
    }
    let _ = writeln!(o, "  arena       {} bytes", plan.arena_bytes);
    let _ = writeln!(o, "  workspace   {} bytes", plan.workspace_bytes);
    let _ = writeln!(o, "  counters    {} bytes", plan.counter_bytes);
    if plan.kernels.is_empty() {
        let _ = writeln!(o, "  kernels     0");
    } else {
        let _ = writeln!(
            o,
            "  kernels     {} images, kernel ABI {:016x}",
            plan.kernels.len(),
            plan.kernel_abi
        );
    }
    let _ = writeln!(
        o,
        "  weights     {} entries, {} bytes",
        plan.manifest.entries.len(),
        plan.manifest.total_bytes()
    );
    for (n, e) in plan.manifest.entries.iter().enumerate() {
        let src = match &e.source {
            WeightSource::Tensor(t) if t.tensor == e.name => t.file.to_string(),
            WeightSource::Tensor(t) => format!("{}:{}", t.file, t.tensor),
            WeightSource::ConcatRows(parts) => format!(
                "concat_rows({})",
                parts
                    .iter()
                    .map(|t| t.tensor.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            WeightSource::Sharded { parts, axis, ranks } => format!(
                "shard_{}({}, ranks {ranks})",
                match axis {
                    kiln_ir::ShardAxis::Rows => "rows",
                    kiln_ir::ShardAxis::Cols => "cols",
                },
                parts
                    .iter()
                    .map(|t| t.tensor.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let _ = writeln!(
            o,
            "    weight.{n:<4} {} {}{} <- {src}",
            e.name, e.dtype, e.shape
        );
    }
    for kp in keys {
        let _ = writeln!(o);
        let _ = writeln!(o, "key {}", kp.key);
        let _ = writeln!(
            o,
            "  summary     launches {}, arena peak {}, lower bound {}, efficiency {:.4}, workspace {}, io {}, flops {}, bytes {}",
            kp.launches,
            kp.arena_peak,
            kp.arena_lower_bound,
            efficiency(kp.arena_lower_bound, kp.arena_peak),
            kp.workspace_bytes,
            kp.io_bytes,
            kp.flops,
            kp.bytes_moved
        );
        let _ = writeln!(o, "  ir");
        for line in kiln_ir::print(&kp.graph).lines() {
            if line.is_empty() {
                let _ = writeln!(o);
            } else {
                let _ = writeln!(o, "    {line}");
            }
        }
        let _ = writeln!(o, "  memory");
        let _ = writeln!(
            o,
            "    {:<7} {:<12} {:>12} {:>12} {:>6} {:>6}",
            "value", "region", "offset", "bytes", "first", "last"
        );
        for b in &kp.buffers {
            let _ = writeln!(
                o,
                "    {:<7} {:<12} {:>12} {:>12} {:>6} {:>6}",
                b.value.to_string(),
                region(b.buf.region),
                b.buf.offset,
                b.buf.bytes,
                opt(b.first_use),
                opt(b.last_use)
            );
        }
        for (i, op) in kp.ops.iter().enumerate() {
            for (what, b) in [("scratch", op.scratch), ("counters", op.counters)] {
                let Some(b) = b else { continue };
                let _ = writeln!(
                    o,
                    "    {:<7} {:<12} {:>12} {:>12} {:>6} {:>6}",
                    format!("{what}.{i}"),
                    region(b.region),
                    b.offset,
                    b.bytes,
                    i,
                    i
                );
            }
        }
        if kp.ops.iter().all(|op| op.lowering == Lowering::Reference) {
            let _ = writeln!(o, "  launches    reference kernels, one per op");
        } else {
            let _ = writeln!(o, "  launches");
            for (i, op) in kp.ops.iter().enumerate() {
                let head = format!("    op {i:<4} {:<18}", op.op.mnemonic());
                match &op.lowering {
                    Lowering::Reference => {
                        let _ = writeln!(o, "{head} reference");
                    }
                    Lowering::Collective => {
                        let _ = writeln!(o, "{head} collective (nccl)");
                    }
                    Lowering::Kernels(ls) => {
                        for (n, l) in ls.iter().enumerate() {
                            let lead = if n == 0 {
                                head.clone()
                            } else {
                                " ".repeat(head.len())
                            };
                            let _ = writeln!(o, "{lead} {}", launch_line(l));
                        }
                    }
                    Lowering::Gemm {
                        shape,
                        kind,
                        kernel,
                    } => {
                        let _ = writeln!(o, "{head} {} as {kind}", gemm_line(shape));
                        if let Some(l) = kernel {
                            let _ = writeln!(o, "{} {}", " ".repeat(head.len()), launch_line(l));
                        }
                    }
                }
            }
        }
        if let Some(tape) = kp.schedule.tape() {
            tape_text(&mut o, kp, tape);
        }
    }
    o
}

/// Bytes of a list of ranges.
fn total(bs: &[BufRef]) -> u64 {
    bs.iter().map(|b| b.bytes).sum()
}

/// Where each task runs: (queue, position).
fn placement(tape: &Tape) -> Vec<(usize, usize)> {
    let mut at = vec![(0, 0); tape.tasks.len()];
    for (q, list) in tape.queues.iter().enumerate() {
        for (p, &t) in list.iter().enumerate() {
            if let Some(a) = at.get_mut(t as usize) {
                *a = (q, p);
            }
        }
    }
    at
}

/// The megakernel tape: every task with its queue slot, tile, the bytes it
/// reads and writes and the tasks it waits for; then each queue.
fn tape_text(o: &mut String, kp: &KeyPlan, tape: &Tape) {
    let c = &tape.counters;
    let _ = writeln!(
        o,
        "  schedule    megakernel: {} SMs x {} blocks per SM = {} queues, {} tasks, counters {}+{}[{}] (zeroed by the reset kernel at the start of each step)",
        tape.sm_count,
        tape.blocks_per_sm,
        tape.queues.len(),
        tape.tasks.len(),
        region(c.region),
        c.offset,
        c.bytes
    );
    // The scheduler's cost model, charging a hop what an H100 measured
    // (bench/results/gpu-2026-12-07-s33: 2-3 us per hop on the critical path).
    const HOP_NS: u64 = 2000;
    if let Ok(e) = crate::passes::megakernel::estimate(kp, tape, HOP_NS) {
        let _ = writeln!(
            o,
            "  estimate    {:.1} us by the scheduler's cost model at {HOP_NS} ns per hop between queues: critical path {} tasks, {} hops (a model to compare tapes by, not a measurement)",
            e.span_ns as f64 / 1000.0,
            e.path_tasks,
            e.path_hops
        );
    }
    let _ = writeln!(o, "  tasks");
    let at = placement(tape);
    for (t, task) in tape.tasks.iter().enumerate() {
        let mnemonic = kp
            .ops
            .get(task.op as usize)
            .map_or("?", |op| op.op.mnemonic());
        let waits: Vec<String> = task
            .waits
            .iter()
            .map(|w| {
                if w.target == 1 {
                    format!("c{}", w.counter)
                } else {
                    format!("c{}>={}", w.counter, w.target)
                }
            })
            .collect();
        let _ = writeln!(
            o,
            "    task {t:<5} op {:<4} {:<18} tile {:>5}..{:<5} queue {:>3}.{:<4} reads {:>10} bytes ({} ranges) writes {:>9} bytes ({} ranges) bumps c{} waits {}",
            task.op,
            mnemonic,
            task.tile.begin,
            task.tile.end,
            at[t].0,
            at[t].1,
            task.read_bytes(),
            task.reads.len(),
            total(&task.writes),
            task.writes.len(),
            task.counter,
            if waits.is_empty() { "-".to_string() } else { waits.join(" ") }
        );
    }
    let _ = writeln!(o, "  queues");
    for (q, list) in tape.queues.iter().enumerate() {
        let bytes: u64 = list
            .iter()
            .filter_map(|&t| tape.tasks.get(t as usize))
            .map(|x| x.read_bytes())
            .sum();
        let ids: Vec<String> = list.iter().map(|t| t.to_string()).collect();
        let _ = writeln!(
            o,
            "    queue {q:<4} {} tasks, reads {bytes} bytes: {}",
            list.len(),
            if ids.is_empty() {
                "-".to_string()
            } else {
                ids.join(" ")
            }
        );
    }
}

#[derive(Serialize)]
struct JsonPlan<'a> {
    architecture: &'a str,
    target: String,
    compiler_version: &'a str,
    arena_bytes: u64,
    workspace_bytes: u64,
    counter_bytes: u64,
    weight_entries: usize,
    weight_bytes: u64,
    kv_cache_bytes_per_layer: u64,
    kv_num_blocks: u32,
    kv_block_size: u32,
    max_context: u32,
    keys: Vec<JsonKey>,
}

#[derive(Serialize)]
struct JsonKey {
    key: String,
    launches: u32,
    arena_peak: u64,
    arena_lower_bound: u64,
    efficiency: f64,
    workspace_bytes: u64,
    io_bytes: u64,
    flops: u64,
    bytes_moved: u64,
    ops: Vec<JsonOp>,
    /// The megakernel tape (absent for the graph schedule).
    #[serde(skip_serializing_if = "Option::is_none")]
    tape: Option<JsonTape>,
}

#[derive(Serialize)]
struct JsonTape {
    sm_count: u32,
    blocks_per_sm: u32,
    /// `counters+offset[bytes]`.
    counters: String,
    tasks: Vec<JsonTask>,
    queues: Vec<Vec<u32>>,
}

#[derive(Serialize)]
struct JsonTask {
    op: u32,
    mnemonic: String,
    tile: [u32; 2],
    queue: usize,
    read_bytes: u64,
    /// `region+offset[bytes]`, as launch parameters print.
    reads: Vec<String>,
    writes: Vec<String>,
    counter: u32,
    /// `[counter, target]` pairs.
    waits: Vec<[u32; 2]>,
}

fn json_tape(kp: &KeyPlan, tape: &Tape) -> JsonTape {
    let at = placement(tape);
    let range = |b: &BufRef| param(&LaunchParam::Buf(*b));
    JsonTape {
        sm_count: tape.sm_count,
        blocks_per_sm: tape.blocks_per_sm,
        counters: range(&tape.counters),
        tasks: tape
            .tasks
            .iter()
            .enumerate()
            .map(|(t, x)| JsonTask {
                op: x.op,
                mnemonic: kp
                    .ops
                    .get(x.op as usize)
                    .map_or("?", |op| op.op.mnemonic())
                    .to_string(),
                tile: [x.tile.begin, x.tile.end],
                queue: at[t].0,
                read_bytes: x.read_bytes(),
                reads: x.reads.iter().map(range).collect(),
                writes: x.writes.iter().map(range).collect(),
                counter: x.counter,
                waits: x.waits.iter().map(|w| [w.counter, w.target]).collect(),
            })
            .collect(),
        queues: tape.queues.clone(),
    }
}

#[derive(Serialize)]
struct JsonOp {
    op: String,
    /// `reference`, `kernels` or `gemm`.
    lowering: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    gemm: Option<GemmShape>,
    /// How a GEMM runs: `gemv`, `skinny` or `blas`.
    #[serde(skip_serializing_if = "Option::is_none")]
    gemm_kind: Option<&'static str>,
    /// The kernel list; for a GEMM, its kiln kernel (none for `blas`).
    launches: Vec<JsonLaunch>,
}

#[derive(Serialize)]
struct JsonLaunch {
    module: String,
    entry: String,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: u32,
    pdl: bool,
    cluster: u32,
    params: Vec<String>,
}

fn json_launch(l: &KernelLaunch) -> JsonLaunch {
    JsonLaunch {
        module: l.module.clone(),
        entry: l.entry.clone(),
        grid: l.grid,
        block: l.block,
        shared_bytes: l.shared_bytes,
        pdl: l.pdl,
        cluster: l.cluster,
        params: l.params.iter().map(param).collect(),
    }
}

fn json_ops(kp: &KeyPlan) -> Vec<JsonOp> {
    kp.ops
        .iter()
        .map(|op| {
            let (lowering, gemm, gemm_kind, launches) = match &op.lowering {
                Lowering::Reference => ("reference", None, None, vec![]),
                Lowering::Collective => ("collective", None, None, vec![]),
                Lowering::Kernels(ls) => {
                    ("kernels", None, None, ls.iter().map(json_launch).collect())
                }
                Lowering::Gemm {
                    shape,
                    kind,
                    kernel,
                } => (
                    "gemm",
                    Some(*shape),
                    Some(kind.name()),
                    kernel.iter().map(json_launch).collect(),
                ),
            };
            JsonOp {
                op: op.op.mnemonic().to_string(),
                lowering,
                gemm,
                gemm_kind,
                launches,
            }
        })
        .collect()
}

fn json(plan: &Plan, keys: &[&KeyPlan]) -> String {
    let j = JsonPlan {
        architecture: &plan.meta.architecture,
        target: plan.meta.target.to_string(),
        compiler_version: &plan.meta.compiler_version,
        arena_bytes: plan.arena_bytes,
        workspace_bytes: plan.workspace_bytes,
        counter_bytes: plan.counter_bytes,
        weight_entries: plan.manifest.entries.len(),
        weight_bytes: plan.manifest.total_bytes(),
        kv_cache_bytes_per_layer: 2 * plan.kv.cache_bytes(),
        kv_num_blocks: plan.kv.num_blocks,
        kv_block_size: plan.kv.block_size,
        max_context: plan.meta.info.max_context,
        keys: keys
            .iter()
            .map(|k| JsonKey {
                key: k.key.to_string(),
                launches: k.launches,
                arena_peak: k.arena_peak,
                arena_lower_bound: k.arena_lower_bound,
                // Four decimals, so the text is stable across float printing.
                efficiency: (efficiency(k.arena_lower_bound, k.arena_peak) * 1e4).round() / 1e4,
                workspace_bytes: k.workspace_bytes,
                io_bytes: k.io_bytes,
                flops: k.flops,
                bytes_moved: k.bytes_moved,
                ops: json_ops(k),
                tape: k.schedule.tape().map(|t| json_tape(k, t)),
            })
            .collect(),
    };
    let mut s = serde_json::to_string_pretty(&j).expect("plain data serializes");
    s.push('\n');
    s
}
