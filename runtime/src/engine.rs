//! The engine: a loaded plan on a backend, serving sequences step by step.
//!
//! Loading checks everything before it allocates anything (plan consistency,
//! target, weight files), then allocates every region once (weights, KV
//! caches, arena, workspace, completion counters, one Io region per key) and
//! resolves each key's op list, as the plan lowered it, to device addresses
//! (the runtime never lowers an op). Nothing is allocated after that: a step only
//! refreshes the key's staging buffers (uploads to fixed Io addresses), runs
//! the key (first time with graphs on: capture, then replay; later: replay;
//! graphs off: the same op list launched eagerly) and reads back the next
//! tokens.
//!
//! Scheduling, per step: sequences with at least one compiled chunk of prompt
//! left run a prefill chunk (query > 1 keys, largest chunk that fits, at most
//! the largest compiled batch of that chunk; the others wait a step);
//! otherwise every live sequence runs one token (the rest of its prompt token
//! by token, or decode), or, for sequences given drafts, a speculative
//! verification through a spec key. The dispatcher maps the rows to the
//! smallest compiled batch that holds them; padding rows carry safe inputs
//! (token 0, positions 0.., context length = query, the null slot, block
//! table rows of the null block). More rows than the largest batch run
//! eagerly in sub-batches, counted, or fail under [`EagerFallback::Forbid`].
//!
//! [`timing`] times one key's step (replayed or eager) for `kiln bench`
//! through the same loading path.
//!
//! Sampling: a plan compiled with `--sampling` draws next tokens with the
//! in-graph `sample` op; each row's parameters ([`RowSampling`], set with
//! [`Engine::set_sampling`], greedy by default) are staged every step with
//! the counter set to the index of the token being drawn, so a seeded
//! sequence draws the same tokens whatever its batch and after a recompute.
//! Speculative keys stay greedy (`accept_greedy`).
//!
//! Not here: preemption, prefix caching, penalties, and a request queue
//! (callers add and remove sequences between steps).

use crate::backend::{
    Backend, BackendError, DevOperand, DevPtr, GraphHandle, Launch, LaunchBody, ResolvedKernel,
    ResolvedParam,
};
use crate::error::EngineError;
use crate::kv::KvManager;
use crate::loader::{check_kernel_abi, check_target, validate_plan};
use crate::policy::{graphs_supported, EagerFallback, GraphDecision, GraphMode, GraphsSupportedFn};
use crate::weights::{WeightSet, Weights};
use kiln_ir::graph::InputRole;
use kiln_ir::plan::{BufRef, KernelLaunch, LaunchParam, Lowering, Plan, Region};
use kiln_ir::{DType, Key};
use kiln_kernels::cpu::sample::{penalty_row, RowSampling, PENALTY_HEADER};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

#[cfg(target_endian = "big")]
compile_error!("kiln's staging buffers are written in host order and read as little-endian");

pub use crate::seq::SeqId;

/// Why a sequence stopped generating.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced one of the plan's EOS tokens (kept as its last token).
    Eos,
    /// It produced its `max_new_tokens`.
    MaxTokens,
    /// It reached the plan's context length.
    ContextFull,
    /// Its next KV block could not be allocated; the message says how many
    /// were needed and free. Other sequences went on.
    KvExhausted(String),
}

/// Per-sequence options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqOptions {
    pub max_new_tokens: u32,
    pub stop_on_eos: bool,
}

/// How prompts are prefilled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PrefillMode {
    /// In chunks through query > 1 keys where compiled, the rest token by token.
    #[default]
    Chunked,
    /// Token by token through query 1 keys.
    TokenByToken,
}

/// Deliberate faults, for tests that prove the witnesses catch real bugs.
/// All off by default; never set them outside tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Faults {
    /// Allocate inside the first capture (the lazy-workspace hazard): the
    /// capture must fail with a capture contract error.
    pub alloc_inside_capture: bool,
    /// Upload a key's staging only on its first step, as if the staging
    /// refresh before replay were missing (the frozen-input hazard).
    pub freeze_staging: bool,
    /// Make replay a no-op (counted as a replay, nothing executed).
    pub skip_replay: bool,
    /// In every megakernel key's uploaded tape, drop the last wait of the
    /// task with this index (the dependency-mutation proof: the task may
    /// then read bytes before their producer wrote them).
    pub drop_tape_wait: Option<u32>,
}

/// Engine options. `Default` reads `KILN_GRAPHS` when the engine is built.
#[derive(Clone, Copy, Debug)]
pub struct EngineOptions {
    pub graphs: GraphMode,
    /// The per-device allowlist, evaluated for the backend's device.
    pub graphs_supported: GraphsSupportedFn,
    pub eager_fallback: EagerFallback,
    pub prefill: PrefillMode,
    /// Default for [`Engine::add_sequence`].
    pub max_new_tokens: u32,
    /// Read the "logits" output after each step when the plan has one.
    pub keep_logits: bool,
    /// Log the graph decision (and teardown problems) to stderr.
    pub log: bool,
    /// Megakernel keys record when each task started, had its waits met and
    /// finished ([`Engine::megakernel_trace`]; `kiln bench --profile`).
    pub trace_megakernel: bool,
    pub faults: Faults,
}

impl Default for EngineOptions {
    fn default() -> EngineOptions {
        EngineOptions {
            graphs: GraphMode::FromEnv,
            graphs_supported,
            eager_fallback: EagerFallback::Allow,
            prefill: PrefillMode::Chunked,
            max_new_tokens: 128,
            keep_logits: false,
            log: true,
            trace_megakernel: false,
            faults: Faults::default(),
        }
    }
}

/// Counters per key: the witnesses tests read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyCounters {
    pub captures: u64,
    pub replays: u64,
    pub eager_steps: u64,
    /// Padding rows run (batch minus live rows, summed over steps).
    pub padded_rows: u64,
    /// Captures of a key that had been captured before (after
    /// [`Engine::reset_graphs`]).
    pub recaptures: u64,
    pub capture_time: Duration,
}

impl KeyCounters {
    fn add(&mut self, o: &KeyCounters) {
        self.captures += o.captures;
        self.replays += o.replays;
        self.eager_steps += o.eager_steps;
        self.padded_rows += o.padded_rows;
        self.recaptures += o.recaptures;
        self.capture_time += o.capture_time;
    }
}

/// Engine-wide statistics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Calls to [`Engine::step`] that ran something.
    pub steps: u64,
    /// Tokens generated (appended after prompts).
    pub generated_tokens: u64,
    /// Prompt tokens whose KV was computed.
    pub prompt_tokens: u64,
    /// Steps in which no compiled key fitted and rows ran eagerly in sub-batches.
    pub no_fit_steps: u64,
    /// Wall time spent in steps.
    pub step_time: Duration,
}

struct Seq {
    tokens: Vec<u32>,
    prompt_len: u32,
    /// Positions whose K/V is in the cache.
    computed: u32,
    blocks: Vec<u32>,
    opts: SeqOptions,
    generated: u32,
    drafts: Vec<u32>,
    finished: Option<FinishReason>,
    logits: Vec<f32>,
    sampling: RowSampling,
    /// `(presence, frequency)` penalties, applied in the graph.
    penalties: (f32, f32),
}

/// A read-only view of a sequence.
#[derive(Clone, Copy, Debug)]
pub struct SeqView<'a> {
    pub prompt: &'a [u32],
    pub generated: &'a [u32],
    pub finished: Option<&'a FinishReason>,
}

/// A staging input: where its values start in the key's host mirror of the
/// Io region (in i32 units).
#[derive(Clone, Copy)]
struct Staged {
    at: usize,
}

/// Byte ranges of the Io region that hold staging inputs, merged where only
/// alignment padding separates them, so a step refreshes its staging with as
/// few copies as possible (one, for a plan that packs its inputs).
fn upload_runs(inputs: &[(InputRole, BufRef)]) -> Vec<(usize, usize)> {
    let mut spans: Vec<(usize, usize)> = inputs
        .iter()
        .filter(|(r, _)| r.is_staging())
        .map(|(_, b)| (b.offset as usize, (b.offset + b.bytes) as usize))
        .collect();
    spans.sort_unstable();
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (a, b) in spans {
        match runs.last_mut() {
            Some(last) if a <= last.1 + kiln_ir::plan::ARENA_ALIGN as usize => {
                last.1 = last.1.max(b)
            }
            _ => runs.push((a, b)),
        }
    }
    runs
}

struct Output {
    ptr: DevPtr,
    host: Vec<u8>,
    dtype: DType,
    rows: u32,
}

impl Output {
    fn i32_at(&self, i: usize) -> i32 {
        i32::from_le_bytes(self.host[4 * i..4 * i + 4].try_into().unwrap())
    }
}

/// A key ready to run.
struct KeyRt {
    key: Key,
    launches: Vec<Launch>,
    io: DevPtr,
    /// Host mirror of the Io region; staging inputs are written here, then
    /// `upload_runs` of it are copied to the device.
    io_host: Vec<i32>,
    upload_runs: Vec<(usize, usize)>,
    token_ids: Staged,
    positions: Option<Staged>,
    slots: Option<Staged>,
    block_tables: Option<Staged>,
    context_lens: Option<Staged>,
    drafts: Option<Staged>,
    sample_params: Option<Staged>,
    sample_seeds: Option<Staged>,
    /// The penalties input and its i32 words per row.
    sample_penalties: Option<(Staged, usize)>,
    next_tokens: Output,
    accepted: Option<Output>,
    logits: Option<Output>,
    graph: Option<GraphHandle>,
    captured_before: bool,
    staged_once: bool,
    /// A megakernel key's trace buffer and its task count (traced only).
    trace: Option<(DevPtr, u32)>,
}

/// A loaded plan serving sequences. See the module docs.
pub struct Engine {
    plan: Plan,
    backend: Box<dyn Backend + Send>,
    decision: GraphDecision,
    options: EngineOptions,
    keys: Vec<KeyRt>,
    allocations: Vec<DevPtr>,
    kv: KvManager,
    seqs: BTreeMap<SeqId, Seq>,
    next_seq: u64,
    counters: BTreeMap<Key, KeyCounters>,
    stats: EngineStats,
    /// Compiled chunk sizes (query > 1, spec 0), largest first.
    chunk_queries: Vec<u32>,
    /// Compiled spec values.
    spec_values: Vec<u32>,
    rows: Vec<SeqId>,
}

struct Regions {
    arena: DevPtr,
    workspace: DevPtr,
    counters: DevPtr,
    weights: Vec<DevPtr>,
    kc: Vec<DevPtr>,
    vc: Vec<DevPtr>,
}

impl Regions {
    fn resolve(&self, io: DevPtr, b: &BufRef) -> DevPtr {
        let base = match b.region {
            Region::Arena => self.arena,
            Region::Io => io,
            Region::Workspace => self.workspace,
            Region::Counters => self.counters,
            Region::Weight(i) => self.weights[i as usize],
            Region::KCache(l) => self.kc[l as usize],
            Region::VCache(l) => self.vc[l as usize],
        };
        base.offset(b.offset)
    }

    /// The plan's lowering with every buffer parameter resolved to an
    /// address: what the backend launches. The runtime never lowers.
    fn body(&self, io: DevPtr, l: &Lowering) -> LaunchBody {
        let kernel = |k: &KernelLaunch| ResolvedKernel {
            module: k.module.clone(),
            entry: k.entry.clone(),
            grid: k.grid,
            block: k.block,
            shared_bytes: k.shared_bytes,
            params: k
                .params
                .iter()
                .map(|p| match p {
                    LaunchParam::Buf(b) => ResolvedParam::Ptr(self.resolve(io, b)),
                    LaunchParam::Null => ResolvedParam::Ptr(DevPtr(0)),
                    LaunchParam::I32(v) => ResolvedParam::I32(*v),
                    LaunchParam::I64(v) => ResolvedParam::I64(*v),
                    LaunchParam::F32(v) => ResolvedParam::F32(*v),
                    LaunchParam::Blob(b) => ResolvedParam::Blob(b.clone()),
                })
                .collect(),
            pdl: k.pdl,
            cluster: k.cluster,
        };
        match l {
            Lowering::Reference => LaunchBody::Reference,
            Lowering::Collective => LaunchBody::Collective,
            Lowering::Kernels(ks) => LaunchBody::Kernels(ks.iter().map(kernel).collect()),
            Lowering::Gemm {
                shape,
                kind,
                kernel: k,
            } => LaunchBody::Gemm {
                shape: *shape,
                kind: *kind,
                kernel: k.as_ref().map(kernel),
            },
        }
    }
}

/// A megakernel key's step: its tape encoded into one device buffer
/// (uploaded here, before any capture), and the launch that zeroes the
/// tape's counters and starts one interpreter block per queue. Returns the
/// launch and the buffer (the engine frees it with the others).
fn megakernel_launch(
    plan: &Plan,
    kp: &kiln_ir::plan::KeyPlan,
    regions: &Regions,
    io: DevPtr,
    backend: &mut dyn Backend,
    faults: Faults,
    trace: Option<DevPtr>,
) -> Result<(Launch, DevPtr), EngineError> {
    use kiln_kernels::megakernel as mk;
    let tape = kp
        .schedule
        .tape()
        .ok_or_else(|| EngineError::BadPlan(format!("key {} has no megakernel tape", kp.key)))?;
    let resolve = |b: &BufRef| regions.resolve(io, b).0;
    let bad = |e: mk::MegakernelError| EngineError::BadPlan(e.to_string());
    // The image's size does not depend on where it lives: size it, place
    // it, encode it again with the real addresses.
    let sized = mk::encode_tape(plan, kp, 0, &resolve).map_err(bad)?;
    let buf = backend.alloc(
        sized.bytes.len().max(16) as u64,
        &format!("megakernel tape {}", kp.key),
    )?;
    let mut image = mk::encode_tape(plan, kp, buf.0, &resolve).map_err(bad)?;
    if let Some(t) = faults.drop_tape_wait.filter(|&t| t < image.tasks) {
        let at = (image.tasks_at + t as u64 * mk::TASK_BYTES as u64 + 12) as usize;
        let n = u32::from_le_bytes(image.bytes[at..at + 4].try_into().expect("4 bytes"));
        image.bytes[at..at + 4].copy_from_slice(&n.saturating_sub(1).to_le_bytes());
    }
    backend.upload(buf, &image.bytes)?;
    let counters = regions.resolve(io, &tape.counters);
    let tasks = tape.tasks.len() as u32;
    let module = kiln_ir::schedule::INTERPRETER_MODULE.to_string();
    let reset = ResolvedKernel {
        module: module.clone(),
        entry: mk::RESET_ENTRY.into(),
        grid: [tasks.div_ceil(256).clamp(1, 64), 1, 1],
        block: [256, 1, 1],
        shared_bytes: 0,
        params: vec![
            ResolvedParam::Ptr(counters),
            ResolvedParam::I32(tasks as i32),
        ],
        pdl: false,
        cluster: 1,
    };
    let at = |o: u64| ResolvedParam::Ptr(buf.offset(o));
    let run = ResolvedKernel {
        module,
        entry: mk::ENTRY.into(),
        grid: [image.queues, 1, 1],
        block: [mk::BLOCK_THREADS, 1, 1],
        // The GEMV weight stage the interpreter would like; the backend
        // grants what the device has (see `WEIGHT_STAGE_BYTES`).
        shared_bytes: weight_stage_request(),
        params: vec![
            at(image.tasks_at),
            at(image.queue_start_at),
            at(image.queue_tasks_at),
            at(image.waits_at),
            ResolvedParam::Ptr(counters),
            ResolvedParam::Ptr(trace.unwrap_or(DevPtr(0))),
        ],
        pdl: false,
        cluster: 1,
    };
    let first = kp
        .ops
        .first()
        .ok_or_else(|| EngineError::BadPlan(format!("key {} has a tape but no ops", kp.key)))?;
    Ok((
        Launch {
            kernel: format!("megakernel tape of {} ({tasks} tasks)", kp.key),
            op: first.op.clone(),
            args: Vec::new(),
            results: Vec::new(),
            workspace: None,
            const_args: 0,
            body: LaunchBody::Megakernel {
                reset,
                run,
                blocks_per_sm: tape.blocks_per_sm,
            },
        },
        buf,
    ))
}

impl Engine {
    /// Loads `plan` with the weights in `weights_dir` onto `backend`.
    ///
    /// Everything is checked before the first allocation: its target against
    /// the backend's device, the plan's internal consistency, a GPU plan's
    /// kernel ABI against this runtime's kernels, and the weight
    /// files against the plan (sizes, header hashes, every tensor's dtype and
    /// shape).
    pub fn new(
        plan: Plan,
        weights_dir: &Path,
        backend: Box<dyn Backend + Send>,
        options: EngineOptions,
    ) -> Result<Engine, EngineError> {
        Engine::with_weights(plan, Weights::Dir(weights_dir), backend, options)
    }

    /// [`Engine::new`] with the weights from `weights`: a directory, or
    /// random values for benchmarks of shape-only plans.
    pub fn with_weights(
        plan: Plan,
        weights: Weights<'_>,
        mut backend: Box<dyn Backend + Send>,
        options: EngineOptions,
    ) -> Result<Engine, EngineError> {
        // The target first: a plan for another device is refused as such,
        // before its (other target's) lowering is judged.
        let info = backend.info();
        check_target(&plan.meta.target, &info)?;
        if backend.ranks() != plan.tp {
            return Err(EngineError::BadPlan(format!(
                "the plan is tensor-parallel over {} rank(s) but the backend drives {}; load it on `kiln_runtime::tp::TpBackend` with one device (or CPU rank) per plan rank (`--tp {}` where the CLI offers it)",
                plan.tp,
                backend.ranks(),
                plan.tp
            )));
        }
        validate_plan(&plan)?;
        check_kernel_abi(&plan)?;
        let decision = GraphDecision::decide(options.graphs, options.graphs_supported, &info)?;
        // The files are opened and checked now; random weights need nothing.
        let files: Result<WeightSet, u64> = match weights {
            Weights::Dir(dir) => Ok(WeightSet::open(&plan, dir)?),
            Weights::Random { seed } => Err(seed),
        };

        // The plan must fit what the device has free: asked before the
        // first allocation, so a plan too large for it is refused with both
        // figures instead of failing part-way through loading.
        let need = plan.device_memory();
        if let Some(free) = backend.free_memory()? {
            if need.total() > free {
                return Err(EngineError::DeviceTooSmall {
                    device: format!("{} {}", info.backend, info.name),
                    need: need.to_string(),
                    need_bytes: need.total(),
                    free,
                });
            }
        }

        // Everything below allocates; nothing below is a user error any more
        // except running out of memory.
        let mut allocations = Vec::new();
        backend.load_kernels(&plan.kernels)?;
        let bound = match &files {
            Ok(set) => set.bind(&plan, backend.as_mut())?,
            Err(seed) => crate::weights::bind_random(&plan, backend.as_mut(), *seed)?,
        };
        allocations.extend(bound.iter().map(|b| b.0));
        drop(files);
        let mut kc = Vec::new();
        let mut vc = Vec::new();
        let cache_bytes = plan.kv.cache_bytes();
        for l in 0..plan.kv.layers {
            kc.push(backend.alloc(cache_bytes, &format!("k cache {l}"))?);
            vc.push(backend.alloc(cache_bytes, &format!("v cache {l}"))?);
        }
        allocations.extend(kc.iter().chain(&vc));
        let arena = if plan.arena_bytes > 0 {
            let p = backend.alloc(plan.arena_bytes, "arena")?;
            allocations.push(p);
            p
        } else {
            DevPtr(0)
        };
        let workspace = backend
            .reserve_workspace(plan.workspace_bytes)?
            .map_or(DevPtr(0), |w| w.0);
        // Completion counters: zeroed here (alloc zeroes), once, before any
        // capture; the kernels that use them leave them zero.
        let counters = if plan.counter_bytes > 0 {
            let p = backend.alloc(plan.counter_bytes, "completion counters")?;
            allocations.push(p);
            p
        } else {
            DevPtr(0)
        };
        let regions = Regions {
            arena,
            workspace,
            counters,
            weights: bound.iter().map(|b| b.0).collect(),
            kc,
            vc,
        };

        let carries_interpreter = plan
            .kernels
            .iter()
            .any(|k| k.name == kiln_ir::schedule::INTERPRETER_MODULE);
        let mut keys = Vec::new();
        for kp in &plan.keys {
            let io = backend.alloc(kp.io_bytes.max(1), &format!("io {}", kp.key))?;
            allocations.push(io);
            let launches: Vec<Launch> = kp
                .ops
                .iter()
                .map(|op| {
                    let dev = |o: &kiln_ir::plan::Operand| DevOperand {
                        ptr: regions.resolve(io, &o.buf),
                        ty: o.ty.clone(),
                    };
                    Launch {
                        const_args: op.weight_args(),
                        body: regions.body(io, &op.lowering),
                        kernel: op.kernel.clone(),
                        op: op.op.clone(),
                        args: op.args.iter().map(dev).collect(),
                        results: op.results.iter().map(dev).collect(),
                        workspace: (op.workspace_bytes > 0)
                            .then_some((workspace, op.workspace_bytes)),
                    }
                })
                .collect();
            // A key with a megakernel tape runs as one persistent kernel
            // where the plan carries the interpreter (CUDA targets); a CPU
            // plan's tape was verified and its op list runs instead.
            let mut trace = None;
            let launches = match kp.schedule.tape() {
                Some(tape) if carries_interpreter => {
                    if options.trace_megakernel {
                        let n = tape.tasks.len() as u32;
                        let bytes = TRACE_BYTES_PER_TASK * n.max(1) as u64;
                        let t = backend.alloc(bytes, &format!("megakernel trace {}", kp.key))?;
                        allocations.push(t);
                        // Zeroed: an interpreter that writes only the
                        // first three stamps leaves the fourth at 0.
                        backend.upload(t, &vec![0u8; bytes as usize])?;
                        trace = Some((t, n));
                    }
                    let (launch, buf) = megakernel_launch(
                        &plan,
                        kp,
                        &regions,
                        io,
                        backend.as_mut(),
                        options.faults,
                        trace.map(|t| t.0),
                    )?;
                    allocations.push(buf);
                    vec![launch]
                }
                _ => launches,
            };
            for l in &launches {
                backend.prepare(l)?;
            }
            let staged = |role: InputRole| {
                kp.inputs
                    .iter()
                    .find(|(r, _)| *r == role)
                    .map(|(_, b)| Staged {
                        at: (b.offset / 4) as usize,
                    })
            };
            let output = |name: &str| {
                kp.outputs
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, o)| Output {
                        ptr: io.offset(o.buf.offset),
                        host: vec![0; o.ty.size_bytes() as usize],
                        dtype: o.ty.dtype,
                        rows: o.ty.shape.dims()[0],
                    })
            };
            keys.push(KeyRt {
                key: kp.key,
                launches,
                io,
                io_host: vec![0; kp.io_bytes.div_ceil(4) as usize],
                upload_runs: upload_runs(&kp.inputs),
                token_ids: staged(InputRole::TokenIds).expect("validated"),
                positions: staged(InputRole::Positions),
                slots: staged(InputRole::SlotMapping),
                block_tables: staged(InputRole::BlockTables),
                context_lens: staged(InputRole::ContextLens),
                drafts: staged(InputRole::DraftTokens),
                sample_params: staged(InputRole::SampleParams),
                sample_seeds: staged(InputRole::SampleSeeds),
                sample_penalties: staged(InputRole::SamplePenalties).map(|p| {
                    let bytes = kp
                        .inputs
                        .iter()
                        .find(|(r, _)| *r == InputRole::SamplePenalties)
                        .map_or(0, |(_, b)| b.bytes);
                    (p, (bytes / 4 / kp.key.batch.max(1) as u64) as usize)
                }),
                next_tokens: output("next_tokens").expect("validated"),
                accepted: output("accepted"),
                logits: output("logits"),
                graph: None,
                captured_before: false,
                staged_once: false,
                trace,
            });
        }
        let mut chunk_queries: Vec<u32> = plan
            .keys
            .iter()
            .filter(|k| k.key.spec == 0 && k.key.query > 1)
            .map(|k| k.key.query)
            .collect();
        chunk_queries.sort_unstable_by(|a, b| b.cmp(a));
        chunk_queries.dedup();
        let mut spec_values: Vec<u32> = plan
            .keys
            .iter()
            .filter(|k| k.key.spec > 0)
            .map(|k| k.key.spec)
            .collect();
        spec_values.sort_unstable();
        spec_values.dedup();
        if options.log {
            eprintln!("kiln: {}", decision.reason);
            let taped: Vec<String> = plan
                .keys
                .iter()
                .filter(|k| matches!(k.schedule, kiln_ir::schedule::Schedule::Megakernel(_)))
                .map(|k| k.key.to_string())
                .collect();
            if !taped.is_empty() {
                if carries_interpreter {
                    eprintln!(
                        "kiln: keys {} run as one persistent kernel walking their tape",
                        taped.join(",")
                    );
                } else {
                    // A CPU plan: the tape was verified with the plan, the
                    // op lists run.
                    eprintln!(
                        "kiln: keys {} carry a megakernel tape (verified); the {} backend runs their op lists",
                        taped.join(","),
                        info.backend
                    );
                }
            }
        }
        Ok(Engine {
            kv: KvManager::new(&plan.kv),
            counters: plan
                .keys
                .iter()
                .map(|k| (k.key, KeyCounters::default()))
                .collect(),
            plan,
            backend,
            decision,
            options,
            keys,
            allocations,
            seqs: BTreeMap::new(),
            next_seq: 0,
            stats: EngineStats::default(),
            chunk_queries,
            spec_values,
            rows: Vec::new(),
        })
    }

    /// [`Engine::new`] with the plan read from a `*.kiln` file.
    pub fn load(
        plan_path: &Path,
        weights_dir: &Path,
        backend: Box<dyn Backend + Send>,
        options: EngineOptions,
    ) -> Result<Engine, EngineError> {
        let plan = crate::loader::read_plan_file(plan_path)?;
        Engine::new(plan, weights_dir, backend, options)
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }
    /// Whether `key`'s step runs as one persistent kernel walking its tape
    /// (a megakernel key on a backend running the plan's interpreter).
    pub fn runs_megakernel(&self, key: Key) -> bool {
        self.keys.iter().any(|k| {
            k.key == key
                && matches!(
                    k.launches.as_slice(),
                    [Launch {
                        body: LaunchBody::Megakernel { .. },
                        ..
                    }]
                )
        })
    }

    /// The last step's trace of `key`'s tape, one `[reached, waits met,
    /// inputs ready, done]` per task (the device's global timer, ns), or
    /// `None` where the key is not a traced megakernel key (see
    /// [`EngineOptions::trace_megakernel`]). Inputs ready is when a GEMV
    /// task's activations and staged weights were in shared memory; for
    /// other tasks, and for an interpreter that did not stamp it (0, or a
    /// stamp outside the task's waits-met..done), it is the waits-met time.
    /// Synchronizes the backend.
    pub fn megakernel_trace(&mut self, key: Key) -> Result<Option<Vec<[u64; 4]>>, EngineError> {
        let Some((ptr, n)) = self
            .keys
            .iter()
            .find(|k| k.key == key)
            .and_then(|k| k.trace)
        else {
            return Ok(None);
        };
        self.backend.synchronize()?;
        let mut bytes = vec![0u8; (TRACE_BYTES_PER_TASK * n as u64) as usize];
        self.backend.download(ptr, &mut bytes)?;
        Ok(Some(decode_trace(&bytes, n as usize)))
    }

    pub fn graph_decision(&self) -> &GraphDecision {
        &self.decision
    }
    pub fn device(&self) -> crate::backend::DeviceInfo {
        self.backend.info()
    }
    /// Counters of every compiled key.
    pub fn counters(&self) -> &BTreeMap<Key, KeyCounters> {
        &self.counters
    }
    /// Counters summed over keys.
    pub fn total_counters(&self) -> KeyCounters {
        let mut t = KeyCounters::default();
        for c in self.counters.values() {
            t.add(c);
        }
        t
    }
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }
    /// KV blocks not owned by any sequence.
    pub fn free_kv_blocks(&self) -> u32 {
        self.kv.free_blocks()
    }

    /// Adds a sequence with the engine's default options.
    pub fn add_sequence(&mut self, prompt: &[u32]) -> Result<SeqId, EngineError> {
        self.add_sequence_with(
            prompt,
            SeqOptions {
                max_new_tokens: self.options.max_new_tokens,
                stop_on_eos: true,
            },
        )
    }

    /// Adds a sequence. Its prompt's KV blocks are taken now; when they are
    /// not available the sequence is refused ([`EngineError::KvExhausted`]).
    pub fn add_sequence_with(
        &mut self,
        prompt: &[u32],
        opts: SeqOptions,
    ) -> Result<SeqId, EngineError> {
        let info = &self.plan.meta.info;
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt.len() >= info.max_context as usize {
            return Err(EngineError::PromptTooLong {
                len: prompt.len(),
                max_context: info.max_context,
            });
        }
        if let Some(&t) = prompt.iter().find(|&&t| t >= info.vocab_size) {
            return Err(EngineError::InvalidToken {
                what: "prompt",
                token: t,
                vocab: info.vocab_size,
            });
        }
        let mut blocks = Vec::new();
        self.kv.ensure(&mut blocks, prompt.len() as u32)?;
        let id = SeqId(self.next_seq);
        self.next_seq += 1;
        self.seqs.insert(
            id,
            Seq {
                tokens: prompt.to_vec(),
                prompt_len: prompt.len() as u32,
                computed: 0,
                blocks,
                opts,
                generated: 0,
                drafts: Vec::new(),
                finished: if opts.max_new_tokens == 0 {
                    Some(FinishReason::MaxTokens)
                } else {
                    None
                },
                logits: Vec::new(),
                sampling: RowSampling::GREEDY,
                penalties: (0.0, 0.0),
            },
        );
        if opts.max_new_tokens == 0 {
            let s = self.seqs.get_mut(&id).unwrap();
            self.kv.release(&mut s.blocks);
        }
        Ok(id)
    }

    /// Removes a sequence (finished or not), frees its KV blocks, and returns
    /// the tokens it generated.
    pub fn remove_sequence(&mut self, id: SeqId) -> Result<Vec<u32>, EngineError> {
        let mut s = self
            .seqs
            .remove(&id)
            .ok_or(EngineError::UnknownSequence(id))?;
        self.kv.release(&mut s.blocks);
        Ok(s.tokens.split_off(s.prompt_len as usize))
    }

    pub fn sequence(&self, id: SeqId) -> Option<SeqView<'_>> {
        self.seqs.get(&id).map(|s| SeqView {
            prompt: &s.tokens[..s.prompt_len as usize],
            generated: &s.tokens[s.prompt_len as usize..],
            finished: s.finished.as_ref(),
        })
    }

    /// The logits row that produced the sequence's last token (needs
    /// `keep_logits` and a plan with a "logits" output).
    pub fn last_logits(&self, id: SeqId) -> Option<&[f32]> {
        self.seqs
            .get(&id)
            .map(|s| s.logits.as_slice())
            .filter(|l| !l.is_empty())
    }

    /// Ids of every sequence in the engine (finished or not), in the order
    /// they were added.
    pub fn sequence_ids(&self) -> Vec<SeqId> {
        self.seqs.keys().copied().collect()
    }

    /// Unfinished sequences.
    pub fn live_sequences(&self) -> usize {
        self.seqs.values().filter(|s| s.finished.is_none()).count()
    }

    pub fn has_work(&self) -> bool {
        self.live_sequences() > 0
    }

    /// Draft tokens for the sequence's next step, verified through a spec key
    /// of exactly `drafts.len()` (the next step takes the accepted drafts and
    /// one more token). Empty drafts clear them. Only for a sequence whose
    /// prompt is done.
    pub fn set_drafts(&mut self, id: SeqId, drafts: &[u32]) -> Result<(), EngineError> {
        let vocab = self.plan.meta.info.vocab_size;
        if !drafts.is_empty() && !self.spec_values.contains(&(drafts.len() as u32)) {
            return Err(EngineError::NoSpecKey {
                count: drafts.len() as u32,
                compiled: self.spec_values.clone(),
            });
        }
        if let Some(&t) = drafts.iter().find(|&&t| t >= vocab) {
            return Err(EngineError::InvalidToken {
                what: "draft",
                token: t,
                vocab,
            });
        }
        let s = self
            .seqs
            .get_mut(&id)
            .ok_or(EngineError::UnknownSequence(id))?;
        s.drafts.clear();
        s.drafts.extend_from_slice(drafts);
        Ok(())
    }

    /// Whether every non-speculative key samples in the graph (the plan was
    /// compiled with `--sampling`).
    pub fn has_in_graph_sampling(&self) -> bool {
        self.keys
            .iter()
            .filter(|k| k.key.spec == 0)
            .all(|k| k.sample_params.is_some() && k.sample_seeds.is_some())
    }

    /// Sets how sequence `id` draws its next tokens from the next step on
    /// (greedy until set). A plan without in-graph sampling accepts only
    /// greedy parameters.
    pub fn set_sampling(&mut self, id: SeqId, sampling: RowSampling) -> Result<(), EngineError> {
        if sampling.temperature > 0.0 && !self.has_in_graph_sampling() {
            return Err(EngineError::SamplingUnavailable {
                temperature: sampling.temperature,
            });
        }
        let s = self
            .seqs
            .get_mut(&id)
            .ok_or(EngineError::UnknownSequence(id))?;
        s.sampling = sampling;
        Ok(())
    }

    /// The `(token, count)` pairs every non-speculative key's penalties
    /// input holds per row (`kiln compile --penalty-slots`); `None` when
    /// some key has none, so penalties cannot be applied in the graph.
    pub fn penalty_slots(&self) -> Option<u32> {
        self.keys
            .iter()
            .filter(|k| k.key.spec == 0)
            .map(|k| {
                k.sample_penalties
                    .map(|(_, w)| w.saturating_sub(PENALTY_HEADER as usize) as u32 / 2)
            })
            .min()
            .flatten()
    }

    /// Sets sequence `id`'s presence and frequency penalties (0 and 0 until
    /// set), applied inside the graph to the logits of the tokens it has
    /// generated: `x - presence * [count > 0] - frequency * count`. Refused
    /// on a plan without a penalties input, and for a sequence allowed more
    /// new tokens than a row's pairs hold (it could generate more distinct
    /// tokens than the graph can be told about).
    pub fn set_penalties(
        &mut self,
        id: SeqId,
        presence: f32,
        frequency: f32,
    ) -> Result<(), EngineError> {
        let slots = self.penalty_slots();
        let s = self
            .seqs
            .get_mut(&id)
            .ok_or(EngineError::UnknownSequence(id))?;
        if presence != 0.0 || frequency != 0.0 {
            let max_new_tokens = s.opts.max_new_tokens;
            match slots {
                Some(slots) if max_new_tokens <= slots => {}
                _ => {
                    return Err(EngineError::PenaltiesUnavailable {
                        max_new_tokens,
                        slots: slots.unwrap_or(0),
                    })
                }
            }
        }
        s.penalties = (presence, frequency);
        Ok(())
    }

    /// Destroys every captured graph; the next step of each key captures it
    /// again (counted as a recapture).
    pub fn reset_graphs(&mut self) -> Result<(), EngineError> {
        self.backend.synchronize()?;
        for k in &mut self.keys {
            if let Some(g) = k.graph.take() {
                self.backend.destroy_graph(g)?;
            }
        }
        Ok(())
    }

    /// Adds a sequence, steps until it finishes, removes it and returns its
    /// generated tokens. Other sequences in the engine step along.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new_tokens: u32,
    ) -> Result<Vec<u32>, EngineError> {
        let id = self.add_sequence_with(
            prompt,
            SeqOptions {
                max_new_tokens,
                stop_on_eos: true,
            },
        )?;
        while self.seqs[&id].finished.is_none() {
            self.step()?;
        }
        self.remove_sequence(id)
    }

    /// Picks the rows of the next step into `self.rows`; returns its query and
    /// spec, or `None` when nothing is live.
    fn schedule(&mut self) -> Option<(u32, u32)> {
        let Engine {
            seqs,
            rows,
            chunk_queries,
            options,
            plan,
            keys,
            ..
        } = self;
        rows.clear();
        let live = || seqs.iter().filter(|(_, s)| s.finished.is_none());
        if options.prefill == PrefillMode::Chunked && !chunk_queries.is_empty() {
            let best = live()
                .filter_map(|(_, s)| {
                    let left = s.prompt_len.saturating_sub(s.computed);
                    chunk_queries.iter().copied().find(|&q| q <= left)
                })
                .max();
            if let Some(q) = best {
                // A prefill chunk takes at most the largest compiled batch
                // of its shape; the other prompts wait for the next step.
                let cap = keys
                    .iter()
                    .filter(|k| k.key.query == q && k.key.spec == 0)
                    .map(|k| k.key.batch as usize)
                    .max()
                    .unwrap_or(1);
                rows.extend(
                    live()
                        .filter(|(_, s)| s.prompt_len.saturating_sub(s.computed) >= q)
                        .map(|(&id, _)| id)
                        .take(cap),
                );
                return Some((q, 0));
            }
        }
        let decoding = |s: &Seq| s.computed + 1 == s.tokens.len() as u32;
        let spec = live()
            .find(|(_, s)| !s.drafts.is_empty() && decoding(s))
            .map(|(_, s)| s.drafts.len() as u32);
        if let Some(spec) = spec {
            let max_context = plan.meta.info.max_context;
            rows.extend(
                live()
                    .filter(|(_, s)| {
                        s.drafts.len() as u32 == spec
                            && decoding(s)
                            && s.tokens.len() as u32 + spec <= max_context
                    })
                    .map(|(&id, _)| id),
            );
            if !rows.is_empty() {
                return Some((spec + 1, spec));
            }
        }
        rows.extend(live().map(|(&id, _)| id));
        (!rows.is_empty()).then_some((1, 0))
    }

    /// Runs one step: every scheduled sequence advances by one token, one
    /// prompt chunk, or one verified draft run. Returns the tokens generated
    /// this step, per sequence that generated any.
    pub fn step(&mut self) -> Result<Vec<(SeqId, Vec<u32>)>, EngineError> {
        let t0 = Instant::now();
        let mut out = Vec::new();
        let Some((query, spec)) = self.schedule() else {
            return Ok(out);
        };
        let mut rows = std::mem::take(&mut self.rows);
        // KV blocks for this step's positions; a sequence that cannot get
        // them stops, the others go on.
        rows.retain(|id| {
            let s = self.seqs.get_mut(id).expect("scheduled");
            let upto = s.computed + query;
            match self.kv.ensure(&mut s.blocks, upto) {
                Ok(()) => true,
                Err(e) => {
                    if self.options.log {
                        eprintln!("kiln: sequence {} stopped: {e}", id.0);
                    }
                    s.finished = Some(FinishReason::KvExhausted(e.to_string()));
                    self.kv.release(&mut s.blocks);
                    false
                }
            }
        });
        let result = self.run_rows(&rows, query, spec, &mut out);
        self.rows = rows;
        result?;
        self.stats.steps += 1;
        self.stats.step_time += t0.elapsed();
        Ok(out)
    }

    fn run_rows(
        &mut self,
        rows: &[SeqId],
        query: u32,
        spec: u32,
        out: &mut Vec<(SeqId, Vec<u32>)>,
    ) -> Result<(), EngineError> {
        if rows.is_empty() {
            return Ok(());
        }
        let n = rows.len() as u32;
        let fitting = self
            .keys
            .iter()
            .enumerate()
            .filter(|(_, k)| k.key.query == query && k.key.spec == spec)
            .map(|(i, k)| (k.key.batch, i));
        if let Some((_, ki)) = fitting.clone().filter(|&(b, _)| b >= n).min() {
            return self.run_key(ki, rows, self.decision.graphs, out);
        }
        let Some((largest, ki)) = fitting.max() else {
            return Err(EngineError::NoKeyFits {
                rows: n,
                query,
                spec,
                largest: 0,
            });
        };
        if self.options.eager_fallback == EagerFallback::Forbid {
            return Err(EngineError::NoKeyFits {
                rows: n,
                query,
                spec,
                largest,
            });
        }
        self.stats.no_fit_steps += 1;
        for chunk in rows.chunks(largest as usize) {
            self.run_key(ki, chunk, false, out)?;
        }
        Ok(())
    }

    /// Fills key `ki`'s staging for `rows` (padding the rest).
    fn stage(&mut self, ki: usize, rows: &[SeqId]) {
        let k = &mut self.keys[ki];
        let (q, spec) = (k.key.query as usize, k.key.spec as usize);
        let m = self.plan.kv.max_blocks_per_seq as usize;
        let kv = &self.kv;
        let null_slot = kv.null_slot() as i32;
        let (mut sorted, mut counts) = (Vec::new(), Vec::<(u32, u32)>::new());
        for r in 0..k.key.batch as usize {
            let seq = rows.get(r).map(|id| &self.seqs[id]);
            for i in 0..q {
                let t = r * q + i;
                let (tok, pos, slot) = match seq {
                    Some(s) => {
                        let pos = s.computed as usize + i;
                        let tok = s
                            .tokens
                            .get(pos)
                            .copied()
                            .unwrap_or_else(|| s.drafts[pos - s.tokens.len()]);
                        (
                            tok as i32,
                            pos as i32,
                            kv.slot(&s.blocks, pos as u32) as i32,
                        )
                    }
                    None => (0, i as i32, null_slot),
                };
                k.io_host[k.token_ids.at + t] = tok;
                if let Some(p) = k.positions {
                    k.io_host[p.at + t] = pos;
                }
                if let Some(p) = k.slots {
                    k.io_host[p.at + t] = slot;
                }
            }
            if let Some(bt) = k.block_tables {
                let row = &mut k.io_host[bt.at + r * m..bt.at + (r + 1) * m];
                match seq {
                    Some(s) => kv.fill_row(&s.blocks, row),
                    None => row.fill(kv.null_block() as i32),
                }
            }
            if let Some(cl) = k.context_lens {
                k.io_host[cl.at + r] = match seq {
                    Some(s) => (s.computed as usize + q) as i32,
                    None => q as i32,
                };
            }
            if let Some(d) = k.drafts {
                for j in 0..spec {
                    k.io_host[d.at + r * spec + j] = seq.map_or(0, |s| s.drafts[j] as i32);
                }
            }
            // The counter is the index in the sequence of the token this
            // row draws (context length after the step).
            let (sampling, counter) = seq.map_or((RowSampling::GREEDY, 0), |s| {
                (s.sampling, s.computed + q as u32)
            });
            if let Some(p) = k.sample_params {
                for (j, v) in sampling.params().into_iter().enumerate() {
                    k.io_host[p.at + r * 4 + j] = v.to_bits() as i32;
                }
            }
            if let Some(p) = k.sample_seeds {
                k.io_host[p.at + r * 4..p.at + r * 4 + 4].copy_from_slice(&sampling.seeds(counter));
            }
            if let Some((p, w)) = k.sample_penalties {
                let row = &mut k.io_host[p.at + r * w..p.at + (r + 1) * w];
                let (presence, frequency) = seq.map_or((0.0, 0.0), |s| s.penalties);
                counts.clear();
                if let Some(s) = seq.filter(|_| presence != 0.0 || frequency != 0.0) {
                    // The tokens generated before the one this row draws.
                    let end = (counter as usize).min(s.tokens.len());
                    let start = (s.prompt_len as usize).min(end);
                    sorted.clear();
                    sorted.extend_from_slice(&s.tokens[start..end]);
                    sorted.sort_unstable();
                    for &t in sorted.iter() {
                        match counts.last_mut() {
                            Some((last, c)) if *last == t => *c += 1,
                            _ => counts.push((t, 1)),
                        }
                    }
                }
                // set_penalties keeps a sequence's distinct generated
                // tokens within the slots; a list that could not fit is
                // staged empty rather than cut.
                if penalty_row(row, presence, frequency, &counts).is_none() {
                    penalty_row(row, 0.0, 0.0, &[]);
                }
            }
        }
    }

    fn run_key(
        &mut self,
        ki: usize,
        rows: &[SeqId],
        graphs: bool,
        out: &mut Vec<(SeqId, Vec<u32>)>,
    ) -> Result<(), EngineError> {
        self.stage(ki, rows);
        let faults = self.options.faults;
        if !(faults.freeze_staging && self.keys[ki].staged_once) {
            self.upload_staging(ki)?;
        }
        if graphs {
            self.capture_key(ki)?;
        }
        let k = &mut self.keys[ki];
        let key = k.key;
        let be = self.backend.as_mut();
        let c = self.counters.get_mut(&key).expect("every key has counters");
        c.padded_rows += (key.batch as usize - rows.len()) as u64;
        if graphs {
            if !faults.skip_replay {
                be.replay(k.graph.expect("captured above"))?;
            }
            c.replays += 1;
        } else {
            for l in &k.launches {
                be.launch(l)?;
            }
            c.eager_steps += 1;
        }
        be.download(k.next_tokens.ptr, &mut k.next_tokens.host)?;
        if let Some(a) = &mut k.accepted {
            be.download(a.ptr, &mut a.host)?;
        }
        let keep_logits = self.options.keep_logits;
        if keep_logits {
            if let Some(l) = &mut k.logits {
                be.download(l.ptr, &mut l.host)?;
            }
        }
        self.collect(ki, rows, out)
    }

    /// Copies key `ki`'s staging (its host mirror's upload runs) to the
    /// device.
    fn upload_staging(&mut self, ki: usize) -> Result<(), EngineError> {
        let k = &mut self.keys[ki];
        // SAFETY: i32 has no padding; u8 has no alignment requirement.
        let bytes = unsafe {
            std::slice::from_raw_parts(k.io_host.as_ptr() as *const u8, k.io_host.len() * 4)
        };
        for &(a, b) in &k.upload_runs {
            self.backend.upload(k.io.offset(a as u64), &bytes[a..b])?;
        }
        k.staged_once = true;
        Ok(())
    }

    /// Captures key `ki`'s graph unless it has one; counted. A failure names
    /// the key and aborts the capture.
    fn capture_key(&mut self, ki: usize) -> Result<(), EngineError> {
        let faults = self.options.faults;
        let k = &mut self.keys[ki];
        if k.graph.is_some() {
            return Ok(());
        }
        let key = k.key;
        let be = self.backend.as_mut();
        let t = Instant::now();
        be.begin_capture(key)
            .map_err(|source| EngineError::Capture { key, source })?;
        let mut rec = || -> Result<(), BackendError> {
            if faults.alloc_inside_capture {
                be.alloc(256, "fault injection: allocation inside a capture")?;
            }
            for l in &k.launches {
                be.launch(l)?;
            }
            Ok(())
        };
        if let Err(source) = rec() {
            if let Err(e) = be.abort_capture() {
                if self.options.log {
                    eprintln!("kiln: aborting the failed capture of {key}: {e}");
                }
            }
            return Err(EngineError::Capture { key, source });
        }
        let g = be
            .end_capture()
            .map_err(|source| EngineError::Capture { key, source })?;
        k.graph = Some(g);
        let c = self.counters.get_mut(&key).expect("every key has counters");
        c.captures += 1;
        if k.captured_before {
            c.recaptures += 1;
        }
        k.captured_before = true;
        c.capture_time += t.elapsed();
        Ok(())
    }

    /// Reads the step's outputs into the sequences.
    fn collect(
        &mut self,
        ki: usize,
        rows: &[SeqId],
        out: &mut Vec<(SeqId, Vec<u32>)>,
    ) -> Result<(), EngineError> {
        let k = &self.keys[ki];
        let (b, q, spec) = (
            k.key.batch as usize,
            k.key.query as usize,
            k.key.spec as usize,
        );
        let per_position = k.next_tokens.host.len() / 4 == b * q && q > 1;
        let info = &self.plan.meta.info;
        let vocab = info.vocab_size;
        for (r, id) in rows.iter().enumerate() {
            let s = self.seqs.get_mut(id).expect("scheduled");
            let known = s.tokens.len();
            // (index into next_tokens of the first new token, count)
            let (first, count) = if spec > 0 {
                let a = k.accepted.as_ref().expect("validated").i32_at(r);
                let a = a.clamp(0, spec as i32) as usize;
                s.computed = known as u32 + a as u32;
                s.drafts.clear();
                (r * q, a + 1)
            } else {
                let before = s.computed;
                s.computed += q as u32;
                if before < s.prompt_len {
                    self.stats.prompt_tokens += (s.computed.min(s.prompt_len) - before) as u64;
                }
                if s.computed as usize != known {
                    continue; // prefill not finished: the output is not a new token
                }
                (if per_position { r * q + q - 1 } else { r }, 1)
            };
            let mut new = Vec::with_capacity(count);
            // Which of the row's query positions produced the last new token.
            let mut last_pos = if spec > 0 { 0 } else { q - 1 };
            for j in 0..count {
                let t = k.next_tokens.i32_at(first + j);
                if t < 0 || t as u32 >= vocab {
                    return Err(EngineError::InvalidToken {
                        what: "generated",
                        token: t as u32,
                        vocab,
                    });
                }
                let t = t as u32;
                s.tokens.push(t);
                s.generated += 1;
                new.push(t);
                if spec > 0 {
                    last_pos = j;
                }
                if s.opts.stop_on_eos && info.eos_token_ids.contains(&t) {
                    s.finished = Some(FinishReason::Eos);
                } else if s.generated >= s.opts.max_new_tokens {
                    s.finished = Some(FinishReason::MaxTokens);
                } else if s.tokens.len() >= info.max_context as usize {
                    s.finished = Some(FinishReason::ContextFull);
                }
                if s.finished.is_some() {
                    break;
                }
            }
            if self.options.keep_logits {
                if let Some(l) = &k.logits {
                    // Logits are per row ([B, V]) or per scored position ([B*Q, V]).
                    let lrow = if l.rows as usize == b * q {
                        r * q + last_pos
                    } else {
                        r
                    };
                    let v = l.host.len() / l.dtype.size() / l.rows as usize;
                    let bytes = &l.host[lrow * v * l.dtype.size()..(lrow + 1) * v * l.dtype.size()];
                    s.logits.resize(v, 0.0);
                    crate::weights::convert(
                        bytes,
                        l.dtype,
                        // SAFETY: f32 slice viewed as bytes for the conversion's output.
                        unsafe {
                            std::slice::from_raw_parts_mut(s.logits.as_mut_ptr() as *mut u8, v * 4)
                        },
                        DType::F32,
                    );
                }
            }
            self.stats.generated_tokens += new.len() as u64;
            if s.finished.is_some() {
                self.kv.release(&mut s.blocks);
            }
            out.push((*id, new));
        }
        Ok(())
    }

    /// Synchronizes, destroys the graphs and frees every allocation. Called by
    /// `Drop`; call it directly to see teardown errors.
    pub fn shutdown(&mut self) -> Result<(), EngineError> {
        self.backend.synchronize()?;
        for k in &mut self.keys {
            if let Some(g) = k.graph.take() {
                self.backend.destroy_graph(g)?;
            }
        }
        for p in self.allocations.drain(..) {
            self.backend.free(p)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Serving hooks: what a server's scheduler (kiln-serve) needs beyond
// add/remove/step. Kept apart from loading and launch building on purpose.
// ---------------------------------------------------------------------------
impl Engine {
    /// Replaces the last generated token of a sequence whose next step has
    /// not run yet: host-side sampling picked another token than the
    /// graph's argmax. The next step feeds the new token. The finish state is
    /// not re-evaluated (EOS is the caller's to check: add such sequences
    /// with `stop_on_eos: false`).
    pub fn replace_last_token(&mut self, id: SeqId, token: u32) -> Result<(), EngineError> {
        let vocab = self.plan.meta.info.vocab_size;
        if token >= vocab {
            return Err(EngineError::InvalidToken {
                what: "replacement",
                token,
                vocab,
            });
        }
        let s = self
            .seqs
            .get_mut(&id)
            .ok_or(EngineError::UnknownSequence(id))?;
        if s.tokens.len() <= s.prompt_len as usize {
            return Err(EngineError::TokenNotReplaceable {
                id,
                why: "it has generated no token yet",
            });
        }
        if s.computed as usize >= s.tokens.len() {
            return Err(EngineError::TokenNotReplaceable {
                id,
                why: "its K/V is already in the cache",
            });
        }
        *s.tokens.last_mut().expect("checked above") = token;
        Ok(())
    }

    /// Turns the download of the "logits" output on or off for the next
    /// steps (a server turns it on only while a row needs logits).
    pub fn set_keep_logits(&mut self, keep: bool) {
        self.options.keep_logits = keep;
    }

    /// Whether the plan outputs logits (so host-side sampling can work).
    pub fn has_logits_output(&self) -> bool {
        self.keys.iter().all(|k| k.logits.is_some())
    }

    /// How the next steps prefill prompts. A server alternates: chunk steps
    /// ([`PrefillMode::Chunked`]) while only prompts wait, a token-by-token
    /// step (every live row advances one token, decode rows included) to
    /// bound the decode delay a long prompt causes.
    pub fn set_prefill_mode(&mut self, mode: PrefillMode) {
        self.options.prefill = mode;
    }

    /// Prompt tokens of the sequence whose K/V is not computed yet.
    pub fn prefill_remaining(&self, id: SeqId) -> Option<u32> {
        self.seqs
            .get(&id)
            .map(|s| s.prompt_len.saturating_sub(s.computed))
    }

    /// KV blocks the sequence owns now.
    pub fn sequence_kv_blocks(&self, id: SeqId) -> Option<u32> {
        self.seqs.get(&id).map(|s| s.blocks.len() as u32)
    }

    /// KV blocks the sequence needs for its next decode step (its blocks
    /// cover positions up to and including its last token's), 0 when it has
    /// them or is finished.
    pub fn kv_blocks_for_next_token(&self, id: SeqId) -> Option<u32> {
        self.seqs.get(&id).map(|s| {
            if s.finished.is_some() {
                return 0;
            }
            let upto = (s.computed + 1).max(s.prompt_len);
            self.kv
                .blocks_for(upto)
                .saturating_sub(s.blocks.len() as u32)
        })
    }

    /// KV blocks needed to hold `tokens` positions.
    pub fn kv_blocks_for(&self, tokens: u32) -> u32 {
        self.kv.blocks_for(tokens)
    }

    /// KV blocks a sequence may own in total (all but the null block).
    pub fn usable_kv_blocks(&self) -> u32 {
        self.kv.usable_blocks()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            if self.options.log {
                eprintln!("kiln: engine teardown: {e}");
            }
        }
    }
}

mod timing;
pub use timing::{
    launch_classes, op_bytes, KeyFacts, OpTime, StepMode, StepProfile, StepTimes, PROFILE_WINDOW,
};

/// The dynamic shared memory a megakernel launch asks for:
/// `KILN_MK_WSTAGE=<bytes>` (0: no weight staging, for A/B runs), else
/// [`kiln_kernels::megakernel::WEIGHT_STAGE_BYTES`].
fn weight_stage_request() -> u32 {
    std::env::var("KILN_MK_WSTAGE")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .unwrap_or(kiln_kernels::megakernel::WEIGHT_STAGE_BYTES)
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_engine_can_move_to_another_thread() {
        fn send<T: Send>() {}
        send::<super::Engine>();
    }
}

/// Bytes of a megakernel trace per task: three u64 stamps per task (reached,
/// waits met, done), then one per task (inputs ready), as the interpreter
/// (kernels/gpu/megakernel.cu, `megakernel_run`) writes them.
const TRACE_BYTES_PER_TASK: u64 = 32;

/// A downloaded trace of `n` tasks as `[reached, waits met, inputs ready,
/// done]` (see [`Engine::megakernel_trace`]).
fn decode_trace(bytes: &[u8], n: usize) -> Vec<[u64; 4]> {
    let w = |i: usize| {
        bytes
            .get(8 * i..8 * i + 8)
            .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    };
    (0..n)
        .map(|t| {
            let (reach, met, done) = (w(3 * t), w(3 * t + 1), w(3 * t + 2));
            let ready = w(3 * n + t);
            let ready = if ready >= met && ready <= done {
                ready
            } else {
                met
            };
            [reach, met, ready, done]
        })
        .collect()
}

#[cfg(test)]
mod trace_tests {
    use super::*;

    fn bytes(words: &[u64]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// The fourth stamp comes from its own array after the triples; where
    /// an interpreter left it at zero, or it falls outside the task's
    /// waits-met..done, the task's inputs count as ready when its waits
    /// were met.
    #[test]
    fn a_trace_decodes_the_ready_stamps_after_the_triples_and_falls_back_to_waits_met() {
        let t = decode_trace(
            &bytes(&[10, 20, 90, 100, 110, 150, 200, 300, 400, 35, 0, 999]),
            3,
        );
        assert_eq!(t[0], [10, 20, 35, 90]);
        assert_eq!(t[1], [100, 110, 110, 150]);
        assert_eq!(t[2], [200, 300, 300, 400]);
    }
}
