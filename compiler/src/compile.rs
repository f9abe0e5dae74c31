//! Compile orchestration: frontend -> passes -> planner -> [`Plan`].
//!
//! For each shape key the model's decode step is traced with the KV layout
//! the options describe, run through the pass pipeline (verified after every
//! pass unless told otherwise), and planned. The weight manifest is shared:
//! fusions add stacked entries, and after all keys it is pruned to exactly
//! what the graphs read, so `Region::Weight` indices are final before any
//! key is planned. GPU targets are lowered while planning (launch lists,
//! attention geometry from `--attn-target-blocks`, PDL from the SM), and
//! kernel images are built only for the modules the launch lists use.
//! Finished plans are re-checked by the independent checker
//! ([`crate::planner::check`]) when verification is on.
//!
//! Determinism: keys are sorted and deduplicated, every pass is canonical and
//! the planner breaks every tie on an index, so the same input compiles to
//! byte-identical plans.
//!
//! Not here: model parsing and tracing (frontend), kernel compilation for GPU
//! targets (a hook, [`kernel_images`], filled by the kernels crate), the
//! runtime.

use crate::frontend::{self, Model, TraceOptions};
use crate::passes::{self, Pass, PassError, PassStats, DEFAULT_PIPELINE};
use crate::planner::{self, PlanContext, PlanError};
use kiln_ir::plan::{KernelImage, KvLayout, ModelInfo, ModelMeta, Plan, Target};
use kiln_ir::{Graph, Key, WeightManifest};
use std::collections::BTreeSet;
use std::fmt::Display;
use std::path::{Path, PathBuf};

/// KV cache block size when none is given.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
/// Context cap when none is given (the model's own limit applies too).
pub const DEFAULT_MAX_CONTEXT: u32 = 4096;
/// `(token, count)` pairs per row of a sampling plan's penalties input when
/// none is given: covers every request with `max_tokens <= 256` (a row's
/// distinct generated tokens never exceed its generated tokens). Staged
/// every step: `8 * slots + 8` bytes per row.
pub const DEFAULT_PENALTY_SLOTS: u32 = 256;

/// The largest shapes `kiln compile` accepts, checked before anything is
/// traced or sized from them. Each is far above what a decode step of a
/// released model uses, and small enough that no size computed from them
/// overflows or asks for absurd memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompileLimits {
    /// Shape keys per plan (each is a traced, planned and captured graph).
    pub keys: usize,
    /// Rows of one step.
    pub batch: u32,
    /// Tokens per row of one step (also at most the context).
    pub query: u32,
    /// Draft tokens verified per row.
    pub spec: u32,
    /// `batch * query`: tokens one step scores.
    pub step_tokens: u32,
    /// `--max-context`.
    pub max_context: u32,
    /// `--block-size`.
    pub block_size: u32,
    /// KV cache, arena, workspace and counters together: more than any
    /// single device holds (1 TiB).
    pub plan_bytes: u64,
}

/// The limits in force.
pub const COMPILE_LIMITS: CompileLimits = CompileLimits {
    keys: 256,
    batch: 4096,
    query: 8192,
    spec: 64,
    step_tokens: 65_536,
    max_context: 1 << 21,
    block_size: 1024,
    plan_bytes: 1 << 40,
};

/// How the paged KV cache is sized.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvOptions {
    /// Tokens per block.
    pub block_size: u32,
    /// Usable blocks per layer (the reserved null block comes on top).
    pub kv_blocks: Option<u32>,
    /// Usable tokens per layer, rounded up to whole blocks (alternative to
    /// `kv_blocks`).
    pub max_tokens: Option<u64>,
    /// Cap on any sequence's context; the model's own limit also applies.
    pub max_context: Option<u32>,
}

impl Default for KvOptions {
    fn default() -> KvOptions {
        KvOptions {
            block_size: DEFAULT_BLOCK_SIZE,
            kv_blocks: None,
            max_tokens: None,
            max_context: None,
        }
    }
}

/// Everything `kiln compile` decides besides the model.
#[derive(Clone, Debug, PartialEq)]
pub struct CompileOptions {
    pub keys: Vec<Key>,
    pub target: Target,
    pub kv: KvOptions,
    /// Also output the f32 logits of every scored row.
    pub logits: bool,
    /// Draw next tokens with the in-graph sampler (`sample`, per-row
    /// parameters staged each step) instead of `argmax` in non-speculative
    /// keys; greedy rows stay bit-identical to argmax.
    pub sampling: bool,
    /// With `sampling`: the `(token, count)` pairs each row of the
    /// `sample_penalties` input holds, so presence/frequency penalties are
    /// applied in the graph for sequences that generate at most this many
    /// distinct tokens (`kiln compile --penalty-slots`; 0: no penalties
    /// input, at most `kiln_ir::op::MAX_PENALTY_SLOTS`).
    pub penalty_slots: u32,
    /// Verify every graph before and after each pass, and check every plan.
    pub verify: bool,
    pub passes: Vec<Pass>,
    /// Attention blocks the GPU partition size aims for (a lowering
    /// decision: `--attn-target-blocks`).
    pub attn_target_blocks: u64,
    /// Lower attention without thread-block clusters even on CUDA sm_90
    /// (`--no-attn-clusters`; the A/B of bench/attn/). Clusters are the
    /// default there: each context's partitions combine inside one cluster.
    pub no_attn_clusters: bool,
    /// Measured GEMM choices (`kiln compile --tuning`, written by `kiln
    /// tune`); without one the target's default rule decides
    /// (`kiln_kernels::gpu::default_gemm_kind`).
    pub tuning: Option<kiln_kernels::tuning::TuningTable>,
    /// GPU targets: run the full `fuse-matmul` rule (`kiln compile
    /// --fused-gemv`), which also fuses the RMSNorm prologues of quantized
    /// matmuls in multi-token keys at any K. The megakernel schedule fuses
    /// regardless (with its own rule, `Pass::FuseMatMulTape`). Without it
    /// GPU targets run `fuse-matmul-graph`: every one-token matmul fuses
    /// (dense ones over the staged fused GEMV), quantized ones of up to
    /// eight tokens fuse their epilogues and, where K <= 1024, their
    /// prologues (see `FuseRule::GRAPH_DEFAULT` for the measurements). The
    /// CPU target always runs the full pass (its reference is the unfused
    /// sequence).
    pub fused_gemv: bool,
    /// GPU targets, graph schedule: fuse dense one-token matmuls
    /// (`fuse-matmul-graph`, the default). Off (`kiln compile
    /// --no-dense-fusion`), or with `matmul_qkv_rope` on (the dense rope
    /// GEMV takes no RMSNorm prologue), `fuse-matmul-quant` fuses only
    /// matmuls over quantized weights. A `kiln tune` entry for a one-token
    /// dense shape matters only then (and for a dense lm_head, which stays
    /// unfused): a fused matmul is kiln's GEMV.
    pub dense_fusion: bool,
    /// GPU targets, graph schedule: where `fuse-matmul-qkv-rope` (in
    /// `passes`) forms `matmul_qkv_rope`, the packed q/k/v GEMV that ropes
    /// the heads and writes the KV row itself, one launch per layer fewer
    /// (`kiln compile --matmul-qkv-rope`; see [`QkvRopeFusion`] for what
    /// each setting measured). The CPU target always runs the pass (its
    /// reference is the pair).
    pub matmul_qkv_rope: QkvRopeFusion,
    /// Tensor-parallel ranks (`kiln compile --tp N`; 1: none). The shard
    /// pass (`passes::shard`) rewrites every traced key for one rank before
    /// the fusions; the plan holds every rank (SPMD).
    pub tp: u32,
    /// Device memory the plan must fit (`kiln compile --device-memory`):
    /// a plan needing more (weights, KV cache, arena, workspace, counters
    /// and staging, [`Plan::device_memory`]) is refused at compile. `None`
    /// checks at load only, against what the device reports free.
    pub device_memory: Option<u64>,
    /// Quantize the dense projection weights at load (`kiln compile
    /// --quantize fp8`; see [`crate::frontend::Model::quantize_projections`]).
    /// `None` keeps every weight as the model directory stores it.
    pub quantize: Option<kiln_ir::QuantType>,
    /// How every key's step runs (`kiln compile --schedule`): the launch
    /// list as a graph (default), or a megakernel tape
    /// ([`passes::megakernel`]).
    pub schedule: passes::megakernel::ScheduleKind,
    /// The persistent kernel's shape, with `schedule` megakernel.
    pub megakernel: passes::megakernel::MegakernelOptions,
}

impl Default for CompileOptions {
    fn default() -> CompileOptions {
        CompileOptions {
            keys: vec![Key::new(1, 1, 0)],
            target: Target::Cpu,
            kv: KvOptions::default(),
            logits: false,
            sampling: false,
            penalty_slots: DEFAULT_PENALTY_SLOTS,
            verify: true,
            passes: DEFAULT_PIPELINE.to_vec(),
            attn_target_blocks: kiln_kernels::gpu::ATTN_TARGET_BLOCKS,
            no_attn_clusters: false,
            tuning: None,
            fused_gemv: false,
            dense_fusion: true,
            matmul_qkv_rope: QkvRopeFusion::default(),
            tp: 1,
            device_memory: None,
            quantize: None,
            schedule: passes::megakernel::ScheduleKind::Graph,
            megakernel: passes::megakernel::MegakernelOptions::default(),
        }
    }
}

/// Why a compile failed.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error("invalid options: {0}")]
    Options(String),
    #[error(transparent)]
    Frontend(#[from] crate::frontend::FrontendError),
    #[error("tracing key {key} failed: {message}")]
    Trace { key: Key, message: String },
    #[error(transparent)]
    Pass(#[from] PassError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("the planner produced an invalid plan (a compiler bug; please report it):\n  {}", .0.join("\n  "))]
    Check(Vec<String>),
    #[error("kernel images for {target}: {message}")]
    Kernels { target: Target, message: String },
    #[error(transparent)]
    Tuning(#[from] kiln_kernels::tuning::TuningError),
    #[error(transparent)]
    Megakernel(#[from] passes::megakernel::MegakernelError),
    #[error("cannot write the plan to `{path}`: {source}")]
    Write {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// Per-key facts of a compile, for reports and the benchmark.
#[derive(Clone, Debug, PartialEq)]
pub struct KeyReport {
    pub key: Key,
    pub passes: PassStats,
    /// Placement order and fit policy that won.
    pub strategy: &'static str,
    /// Results placed over a dying argument.
    pub in_place: u32,
}

/// A plan and how it was made.
#[derive(Clone, Debug, PartialEq)]
pub struct Compiled {
    pub plan: Plan,
    pub reports: Vec<KeyReport>,
    /// Things the user should know that did not stop the compile (stale
    /// tuning-table entries that were ignored).
    pub notes: Vec<String>,
}

/// What [`compile_traced`] reports while it works.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Traced and rewrote key `n` of `total`.
    Passes,
    /// Planned a key.
    Planned,
}

/// `arena_lower_bound / arena_peak` (1 for an empty arena).
pub fn efficiency(lower_bound: u64, peak: u64) -> f64 {
    if peak == 0 {
        1.0
    } else {
        lower_bound as f64 / peak as f64
    }
}

/// A byte count with an optional unit: `B`, `KB`/`MB`/`GB`/`TB` (powers
/// of 1000) or `KiB`/`MiB`/`GiB`/`TiB` (powers of 1024), case-insensitive,
/// an optional space between; a fraction is allowed with a unit (`1.5GiB`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim());
    let bad = || {
        format!("`{s}` is not a size: write a byte count or a number with a unit, e.g. 141GiB, 80GB, 512MiB")
    };
    let scale: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return Err(bad()),
    };
    if num.is_empty() {
        return Err(bad());
    }
    if let Ok(n) = num.parse::<u64>() {
        return n
            .checked_mul(scale)
            .ok_or_else(|| format!("`{s}` is more than 2^64 bytes"));
    }
    let x: f64 = num.parse().map_err(|_| bad())?;
    let bytes = x * scale as f64;
    if scale == 1 || !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes as u64)
}

/// Sorted, deduplicated, validated keys.
pub fn normalize_keys(keys: &[Key]) -> Result<Vec<Key>, CompileError> {
    if keys.is_empty() {
        return Err(CompileError::Options(
            "no shape keys: pass --batches 1,2,4,8 or --keys b1q1s0,...".into(),
        ));
    }
    let l = COMPILE_LIMITS;
    let bad = |m: String| Err(CompileError::Options(m));
    let mut out = Vec::with_capacity(keys.len());
    for &k in keys {
        let k = k
            .validate()
            .map_err(|e| CompileError::Options(e.to_string()))?;
        if k.batch > l.batch {
            return bad(format!(
                "key {k}: batch {} is above the limit of {}; pass smaller --batches/--keys",
                k.batch, l.batch
            ));
        }
        if k.query > l.query {
            return bad(format!(
                "key {k}: query {} is above the limit of {}; pass a smaller --query/--keys \
                 (long prompts are prefilled in chunks of query tokens)",
                k.query, l.query
            ));
        }
        if k.spec > l.spec {
            return bad(format!(
                "key {k}: spec {} is above the limit of {} draft tokens; pass a smaller \
                 --spec/--keys",
                k.spec, l.spec
            ));
        }
        let tokens = k.batch as u64 * k.query as u64;
        if tokens > l.step_tokens as u64 {
            return bad(format!(
                "key {k}: batch x query is {tokens} tokens per step, above the limit of {}; \
                 lower the batch or the query in --batches/--query/--keys",
                l.step_tokens
            ));
        }
        out.push(k);
    }
    out.sort();
    out.dedup();
    if out.len() > l.keys {
        return bad(format!(
            "{} shape keys is above the limit of {}; pass fewer --batches/--keys",
            out.len(),
            l.keys
        ));
    }
    Ok(out)
}

/// The KV layout and context cap for a model with `info` (whose
/// `max_context` is the model's own limit, e.g. `max_position_embeddings`)
/// compiled for `keys`.
///
/// * `max_context = min(model limit, --max-context or DEFAULT_MAX_CONTEXT)`;
/// * `max_blocks_per_seq = ceil(max_context / block_size)`;
/// * usable blocks: `--kv-blocks`, or `ceil(--max-tokens / block_size)`, or
///   enough for every row of the widest key to reach `max_context`; plus the
///   reserved null block 0.
pub fn kv_layout(
    info: &ModelInfo,
    opts: &KvOptions,
    keys: &[Key],
) -> Result<(KvLayout, u32), CompileError> {
    let bad = |m: String| Err(CompileError::Options(m));
    if opts.block_size == 0 {
        return bad("--block-size must be at least 1".into());
    }
    if opts.kv_blocks.is_some() && opts.max_tokens.is_some() {
        return bad("give --kv-blocks or --max-tokens, not both".into());
    }
    let l = COMPILE_LIMITS;
    if opts.block_size > l.block_size {
        return bad(format!(
            "--block-size {} is above the limit of {} tokens per block",
            opts.block_size, l.block_size
        ));
    }
    let cap = opts.max_context.unwrap_or(DEFAULT_MAX_CONTEXT);
    if cap == 0 {
        return bad("--max-context must be at least 1".into());
    }
    if cap > l.max_context {
        return bad(format!(
            "--max-context {cap} is above the limit of {} tokens",
            l.max_context
        ));
    }
    let max_context = info.max_context.min(cap).max(1);
    if let Some(k) = keys.iter().find(|k| k.query > max_context) {
        return bad(format!(
            "key {k}: query {} is longer than the context of {max_context} tokens (the \
             smaller of --max-context and the model's limit); pass a smaller --query/--keys",
            k.query
        ));
    }
    let per_seq = max_context.div_ceil(opts.block_size);
    let max_batch = keys.iter().map(|k| k.batch).max().unwrap_or(1) as u64;
    let usable: u64 = match (opts.kv_blocks, opts.max_tokens) {
        (Some(0), _) => return bad("--kv-blocks must be at least 1".into()),
        (Some(n), _) => n as u64,
        (_, Some(0)) => return bad("--max-tokens must be at least 1".into()),
        (_, Some(t)) => t.div_ceil(opts.block_size as u64),
        _ => max_batch * per_seq as u64,
    };
    let num_blocks = usable + 1;
    let slots = num_blocks * opts.block_size as u64;
    if slots > i32::MAX as u64 {
        return bad(format!(
            "{num_blocks} blocks of {} tokens is {slots} KV slots; slot ids are i32, so use fewer blocks (--kv-blocks/--max-tokens)",
            opts.block_size
        ));
    }
    let kv = KvLayout {
        layers: info.num_layers,
        kv_heads: info.num_kv_heads,
        head_dim: info.head_dim,
        dtype: info.dtype,
        block_size: opts.block_size,
        num_blocks: num_blocks as u32,
        null_block: 0,
        max_blocks_per_seq: per_seq,
    };
    let kv_bytes = kiln_ir::validate::kv_cache_bytes(&kv)
        .and_then(|b| b.checked_mul(2 * info.num_layers as u64))
        .filter(|&b| b <= l.plan_bytes);
    if kv_bytes.is_none() {
        return bad(format!(
            "a KV cache of {num_blocks} blocks of {} tokens x {} layers x {} kv heads x {} dims \
             (K and V) is more than {} GiB, above any single device; use fewer blocks \
             (--kv-blocks/--max-tokens), a smaller --max-context or smaller --batches",
            opts.block_size,
            info.num_layers,
            info.num_kv_heads,
            info.head_dim,
            l.plan_bytes >> 30
        ));
    }
    Ok((kv, max_context))
}

/// Kernel images for `target`, embedded in the plan.
///
/// `cuda:*`: NVRTC cubins of the used modules for the target SM. `hip:*`:
/// one module of every catalog source, as a code object when hipcc or
/// amdclang++ is installed (`KILN_HIPCC` names one, or `none`), else as
/// source that the runtime compiles with hiprtc at load and caches. The CPU
/// target needs none.
///
/// `modules`: the modules the plan's launch lists use
/// (`kiln_ir::validate::modules_used`); CUDA compiles only those.
pub fn kernel_images(
    target: &Target,
    modules: &BTreeSet<String>,
) -> Result<Vec<KernelImage>, CompileError> {
    match target {
        Target::Cpu => Ok(Vec::new()),
        // NVRTC compiles each used module to a CUBIN for the target SM (no
        // GPU needed); the plan embeds cubins, never PTX.
        Target::Cuda { sm } => {
            // The megakernel interpreter is not a launch-list module: it
            // is compiled only for plans with a tape.
            let used: Vec<_> = kiln_kernels::gpu::MODULES
                .iter()
                .chain(std::iter::once(
                    &kiln_kernels::megakernel::MEGAKERNEL_MODULE,
                ))
                .filter(|m| modules.contains(m.name))
                .collect();
            // Through the on-disk image cache (keyed by source, options,
            // NVRTC version and SM): a second compile runs no NVRTC.
            let cache = kiln_kernels::image_cache::ImageCache::open_default().ok();
            kiln_kernels::nvrtc::compile_modules(*sm, &used, cache.as_ref(), &|_| {}).map_err(|e| {
                CompileError::Kernels {
                    target: target.clone(),
                    message: e.to_string(),
                }
            })
        }
        Target::Hip { gfx } => {
            use kiln_kernels::hip::{self as catalog, offline};
            let err = |message: String| CompileError::Kernels {
                target: target.clone(),
                message,
            };
            let tu = catalog::kernels_translation_unit().map_err(|e| err(e.to_string()))?;
            let out = offline::plan_images(gfx, &tu, &|k| std::env::var_os(k))
                .map_err(|e| err(e.to_string()))?;
            if let Some(note) = out.note {
                eprintln!("kiln: {note}");
            }
            Ok(out.images)
        }
    }
}

/// Compiles already-described model facts and a tracer into a plan: the
/// frontend-independent core of [`crate::compile`].
///
/// `meta.info.max_context` is the model's own limit on input and the
/// compiled limit on output. `trace(key, kv)` must return the key's plain
/// graph over `manifest` (unfused: one entry per checkpoint tensor).
pub fn compile_traced<E: Display>(
    mut meta: ModelMeta,
    mut manifest: WeightManifest,
    opts: &CompileOptions,
    mut trace: impl FnMut(Key, &KvLayout) -> Result<Graph, E>,
    progress: &mut dyn FnMut(Stage, Key),
) -> Result<Compiled, CompileError> {
    let keys = normalize_keys(&opts.keys)?;
    let tp = opts.tp;
    if tp == 0 {
        return Err(CompileError::Options("--tp must be at least 1".into()));
    }
    if tp > 1 {
        passes::shard::check_heads(tp, meta.info.num_heads, meta.info.num_kv_heads)
            .map_err(CompileError::Options)?;
        if let Some(e) = manifest.entries.iter().find(|e| e.storage.is_some()) {
            return Err(CompileError::Options(format!(
                "--tp {tp} with weights kept quantized (`{}` is {}) is not supported: \
                 import the model without --keep-quant, or compile with --tp 1",
                e.name,
                e.storage.map_or("", |q| q.name())
            )));
        }
    }
    let (kv, max_context) = kv_layout(&meta.info, &opts.kv, &keys)?;
    meta.info.max_context = max_context;
    meta.target = opts.target.clone();
    // Each rank's KV cache holds its KV heads; the tracer sees the model's.
    let rank_kv = KvLayout {
        kv_heads: kv.kv_heads / tp,
        ..kv.clone()
    };
    let shard_opts = passes::shard::ShardOptions {
        ranks: tp,
        num_heads: meta.info.num_heads,
        num_kv_heads: meta.info.num_kv_heads,
        vocab_size: meta.info.vocab_size,
        // The cross-rank argmax runs on the CPU backend and on CUDA (NCCL);
        // HIP targets, plans that sample in the graph and plans that output
        // logits keep the lm_head replicated (see the shard pass's docs).
        split_vocab: matches!(opts.target, Target::Cpu | Target::Cuda { .. })
            && !opts.sampling
            && !opts.logits,
    };

    let mut graphs = Vec::with_capacity(keys.len());
    let mut stats = Vec::with_capacity(keys.len());
    // On GPU targets the graph schedule runs `fuse-matmul` with
    // `fused_gemv` and `fuse-matmul-graph` (its default rule) without; a megakernel schedule always runs it, with the
    // interpreter's rule (`fuse-matmul-tape`): its fused tiles are never
    // slower than the unfused ops and take a hop off the tape per fusion
    // (bench/results/gpu-2026-12-02-s14/).
    let tape_rule = opts.schedule == passes::megakernel::ScheduleKind::Megakernel
        && !matches!(opts.target, Target::Cpu);
    // `fuse-rope-attention` and `fuse-matmul-qkv-rope` are graph-schedule
    // fusions: the interpreter runs their parts as tasks. On GPU targets the
    // latter forms the op where `CompileOptions::matmul_qkv_rope` says.
    let gpu = !matches!(opts.target, Target::Cpu);
    let pipeline: Vec<Pass> = opts
        .passes
        .iter()
        .copied()
        .filter(|p| !tape_rule || !matches!(p, Pass::FuseRopeAttention | Pass::FuseMatMulQkvRope))
        .filter(|p| {
            *p != Pass::FuseMatMulQkvRope || !gpu || opts.matmul_qkv_rope != QkvRopeFusion::Off
        })
        .map(|p| match p {
            Pass::FuseMatMulQkvRope if gpu && opts.matmul_qkv_rope == QkvRopeFusion::Pairs => {
                Pass::FuseMatMulQkvRopePairs
            }
            Pass::FuseMatMul if tape_rule => Pass::FuseMatMulTape,
            Pass::FuseMatMul
                if !opts.fused_gemv
                    && gpu
                    && (!opts.dense_fusion || opts.matmul_qkv_rope != QkvRopeFusion::Off) =>
            {
                Pass::FuseMatMulQuant
            }
            Pass::FuseMatMul if !opts.fused_gemv && gpu => Pass::FuseMatMulGraph,
            p => p,
        })
        .collect();
    for &key in &keys {
        let g = trace(key, &kv).map_err(|e| CompileError::Trace {
            key,
            message: e.to_string(),
        })?;
        let g = if tp > 1 {
            let g = passes::shard::shard(&g, &mut manifest, &shard_opts).map_err(|message| {
                CompileError::Trace {
                    key,
                    message: format!("shard pass (--tp {tp}): {message}"),
                }
            })?;
            // The verifier runs on the shard pass's output, naming it.
            if let Err(e) = kiln_ir::verify(&g, Some(&manifest)) {
                return Err(CompileError::Pass(PassError::Failed {
                    pass: Pass::Dce,
                    graph: g.name.clone(),
                    message: format!("the shard pass produced a malformed graph: {e}"),
                }));
            }
            g
        } else {
            g
        };
        let (g, info, s) =
            passes::run_pipeline_for(g, &mut manifest, &pipeline, opts.verify, &opts.target)?;
        // The megakernel schedule spreads each attention's context over
        // tasks (see `passes::split_attention`) on GPU targets; a CPU
        // plan's tape is a proof run by the CPU executor, and the CPU
        // backend runs the op list, where the split would only cost.
        let (g, info) = if tape_rule {
            let queues = opts
                .megakernel
                .sm_count
                .saturating_mul(opts.megakernel.blocks_per_sm);
            let (g, info, _) = passes::split_attention(g, &manifest, queues)?;
            (g, info)
        } else {
            (g, info)
        };
        graphs.push((g, info));
        stats.push(s);
        progress(Stage::Passes, key);
    }
    passes::weights::prune(
        &mut manifest,
        &graphs.iter().map(|(g, _)| g).collect::<Vec<_>>(),
    );

    let mut lower =
        kiln_kernels::gpu::LowerOptions::for_target(&opts.target, opts.attn_target_blocks);
    lower.attn_clusters &= !opts.no_attn_clusters;
    lower.prefer_gemv = opts.schedule == passes::megakernel::ScheduleKind::Megakernel;
    let mut notes = Vec::new();
    if let Some(table) = &opts.tuning {
        let (tuned, stale) = table.choices(&opts.target);
        lower.tuned = tuned;
        notes = stale;
    }
    let kv = rank_kv;
    let ctx = PlanContext {
        manifest: &manifest,
        kv: &kv,
        target: &opts.target,
        max_context,
        lower,
    };
    let mut key_plans = Vec::with_capacity(keys.len());
    let mut reports = Vec::with_capacity(keys.len());
    for ((&key, (g, info)), s) in keys.iter().zip(graphs).zip(stats) {
        let (kp, r) = planner::plan_key(key, g, &info, &ctx)?;
        key_plans.push(kp);
        reports.push(KeyReport {
            key,
            passes: s,
            strategy: r.strategy,
            in_place: r.in_place,
        });
        progress(Stage::Planned, key);
    }
    let mut plan = Plan {
        meta,
        arena_bytes: key_plans.iter().map(|k| k.arena_peak).max().unwrap_or(0),
        workspace_bytes: key_plans
            .iter()
            .map(|k| k.workspace_bytes)
            .max()
            .unwrap_or(0),
        counter_bytes: key_plans
            .iter()
            .map(planner::counter_bytes)
            .max()
            .unwrap_or(0),
        manifest,
        kv,
        keys: key_plans,
        kernel_abi: 0,
        kernels: Vec::new(),
        tp,
    };
    if opts.schedule == passes::megakernel::ScheduleKind::Megakernel {
        if let Target::Hip { .. } = opts.target {
            return Err(passes::megakernel::MegakernelError::Options(format!(
                "the megakernel interpreter runs on CUDA only, not on {}; compile with --schedule graph",
                opts.target
            ))
            .into());
        }
        passes::megakernel::schedule_plan(&mut plan, &opts.megakernel)?;
    }
    check_plan_bytes(&plan)?;
    // Only the modules the launch lists use are compiled.
    plan.kernels = kernel_images(&opts.target, &kiln_ir::validate::modules_used(&plan))?;
    if !plan.kernels.is_empty() {
        plan.kernel_abi = kiln_kernels::gpu::kernel_abi();
    }
    if opts.verify {
        planner::check::check_plan(&plan).map_err(CompileError::Check)?;
    }
    Ok(Compiled {
        plan,
        reports,
        notes,
    })
}

/// Refuses a plan whose device memory (KV cache, arena, BLAS workspace,
/// counters) adds up to more than [`CompileLimits::plan_bytes`].
fn check_plan_bytes(plan: &Plan) -> Result<(), CompileError> {
    let kv = kiln_ir::validate::kv_cache_bytes(&plan.kv)
        .and_then(|b| b.checked_mul(2 * plan.kv.layers as u64));
    let total = [plan.arena_bytes, plan.workspace_bytes, plan.counter_bytes]
        .into_iter()
        .try_fold(kv.unwrap_or(u64::MAX), u64::checked_add);
    match total {
        Some(t) if t <= COMPILE_LIMITS.plan_bytes => Ok(()),
        _ => Err(CompileError::Options(format!(
            "the plan needs {} bytes of device memory (arena {}, workspace {}, KV cache {}), \
             more than {} GiB, above any single device; use smaller --batches/--query/--keys \
             or fewer KV blocks",
            total.map_or("over 2^64".into(), |t| t.to_string()),
            plan.arena_bytes,
            plan.workspace_bytes,
            kv.map_or("over 2^64".into(), |t| t.to_string()),
            COMPILE_LIMITS.plan_bytes >> 30
        ))),
    }
}

/// Compiles an opened model.
pub fn compile_model(
    model: &Model,
    opts: &CompileOptions,
    progress: &mut dyn FnMut(Stage, Key),
) -> Result<Compiled, CompileError> {
    let max_slots = kiln_ir::op::MAX_PENALTY_SLOTS;
    if opts.sampling && opts.penalty_slots > max_slots {
        return Err(CompileError::Options(format!(
            "--penalty-slots {} is above the limit of {max_slots} (token, count) pairs per row; \
             pass a smaller --penalty-slots (or 0 for no in-graph penalties)",
            opts.penalty_slots
        )));
    }
    // The development overrides of the integer-dot GEMV's geometry and the
    // skinny GEMM's warps are checked once here, so a typo is refused
    // before tracing rather than as the first quantized matmul's lowering
    // error.
    if matches!(opts.target, Target::Cuda { .. }) {
        kiln_kernels::quant_gpu::QdotGeom::check_override().map_err(CompileError::Options)?;
        kiln_kernels::quant_gpu::skinny_warps_cap(
            std::env::var("KILN_QSKINNY_WARPS").ok().as_deref(),
        )
        .map_err(CompileError::Options)?;
        crate::passes::quant_fuse_override(std::env::var("KILN_FUSE_QUANT").ok().as_deref())
            .map_err(CompileError::Options)?;
        crate::passes::dense_fuse_override(std::env::var("KILN_FUSE_DENSE").ok().as_deref())
            .map_err(CompileError::Options)?;
        kiln_kernels::quant_gpu::skinny_prefetch(
            std::env::var("KILN_QSKINNY_PF").ok().as_deref(),
            kiln_kernels::quant_gpu::QuantType::Fp8E4M3,
        )
        .map_err(CompileError::Options)?;
    }
    let meta = ModelMeta {
        architecture: model.architecture().to_string(),
        files: model.source_files().to_vec(),
        compiler_version: env!("CARGO_PKG_VERSION").to_string(),
        target: opts.target.clone(),
        info: model.info().clone(),
    };
    let trace_opts = TraceOptions {
        logits: opts.logits,
        sampling: opts.sampling,
        penalty_slots: opts.penalty_slots,
    };
    let quantized;
    let model = match opts.quantize {
        Some(q) => {
            let mut m = model.clone();
            m.quantize_projections(q)?;
            quantized = m;
            &quantized
        }
        None => model,
    };
    let compiled = compile_traced(
        meta,
        model.manifest().clone(),
        opts,
        |key, kv| model.trace(key, kv, &trace_opts),
        progress,
    )?;
    check_device_memory(&compiled.plan, opts.device_memory)?;
    Ok(compiled)
}

/// Refuses a plan that needs more device memory than `budget` (`kiln
/// compile --device-memory`), naming both figures and each region.
pub fn check_device_memory(plan: &Plan, budget: Option<u64>) -> Result<(), CompileError> {
    let Some(budget) = budget else {
        return Ok(());
    };
    let need = plan.device_memory();
    if need.total() > budget {
        return Err(CompileError::Options(format!(
            "the plan needs {need} of device memory, more than the {budget} bytes --device-memory \
             allows ({} too many); compile with fewer KV blocks (--kv-blocks / --max-tokens), a \
             shorter --max-context, or fewer or smaller keys",
            need.total() - budget
        )));
    }
    Ok(())
}

/// Opens the model directory `dir` and compiles it.
pub fn compile_dir(
    dir: &Path,
    opts: &CompileOptions,
    progress: &mut dyn FnMut(Stage, Key),
) -> Result<Compiled, CompileError> {
    let model = frontend::open(dir)?;
    compile_model(&model, opts, progress)
}

/// `kiln compile` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct CompileArgs {
    /// Hugging Face model directory (config.json + safetensors).
    pub model_dir: PathBuf,
    /// Batch sizes to compile, with --query and --spec.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub batches: Vec<u32>,
    /// Tokens per sequence per step (1: plain decode).
    #[arg(long, default_value_t = 1)]
    pub query: u32,
    /// Draft tokens verified per step (query must be spec + 1).
    #[arg(long, default_value_t = 0)]
    pub spec: u32,
    /// Explicit shape keys instead of --batches/--query/--spec, e.g. b1q1s0,b8q2s1.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["batches", "query", "spec"])]
    pub keys: Vec<Key>,
    /// A plan for `kiln serve`: the decode keys of --batches plus
    /// prefill-chunk keys (--prefill-chunk tokens at batch 1 and at
    /// min(4, largest batch)), so a prompt prefills in chunks interleaved
    /// with decode steps; implies --logits and --sampling.
    #[arg(long, conflicts_with_all = ["keys", "query", "spec"])]
    pub serve: bool,
    /// With --serve: tokens per prefill chunk.
    #[arg(long, default_value_t = 16, requires = "serve", value_parser = clap::value_parser!(u32).range(2..=8192))]
    pub prefill_chunk: u32,
    /// cpu, cuda:sm_NN or hip:gfxNNNN.
    #[arg(long, default_value = "cpu")]
    pub target: Target,
    /// Usable KV blocks per layer (a reserved null block is added).
    #[arg(long)]
    pub kv_blocks: Option<u32>,
    /// Usable KV tokens per layer (alternative to --kv-blocks).
    #[arg(long, conflicts_with = "kv_blocks")]
    pub max_tokens: Option<u64>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = DEFAULT_BLOCK_SIZE)]
    pub block_size: u32,
    /// Longest context a sequence may reach (capped by the model's own limit).
    #[arg(long, default_value_t = DEFAULT_MAX_CONTEXT)]
    pub max_context: u32,
    /// Also output the f32 logits of every scored row.
    #[arg(long)]
    pub logits: bool,
    /// Sample next tokens inside the graph (temperature, top-k, top-p,
    /// min-p and a seed per row, staged each step) instead of argmax; what
    /// `kiln serve` wants for requests with a temperature. Argmax-only plans
    /// stay the default.
    #[arg(long)]
    pub sampling: bool,
    /// With --sampling: `(token, count)` pairs per row for presence and
    /// frequency penalties applied inside the graph (a request generating
    /// more distinct tokens than this is penalised on the host); 0 leaves
    /// them out.
    #[arg(long, default_value_t = DEFAULT_PENALTY_SLOTS, value_parser = clap::value_parser!(u32).range(0..=kiln_ir::op::MAX_PENALTY_SLOTS as i64))]
    pub penalty_slots: u32,
    /// Skip graph verification between passes (the final graph is still
    /// verified before planning) and the independent plan checker.
    #[arg(long)]
    pub no_verify: bool,
    /// GPU targets: attention blocks the partition size aims for (a
    /// compile-time lowering decision; more blocks, shorter partitions).
    #[arg(long, default_value_t = kiln_kernels::gpu::ATTN_TARGET_BLOCKS, value_parser = clap::value_parser!(u64).range(1..))]
    pub attn_target_blocks: u64,
    /// CUDA sm_90: lower attention without thread-block clusters (the plain
    /// combine through scratch, as on sm_80 and HIP). For A/B measurements.
    #[arg(long)]
    pub no_attn_clusters: bool,
    /// GPU targets: a GEMM tuning table written by `kiln tune`; its current
    /// entries for the target choose gemv / skinny / blas per shape (stale
    /// ones are ignored with a note). Without it the target's default rule
    /// decides.
    #[arg(long)]
    pub tuning: Option<PathBuf>,
    /// GPU targets: also fold RMSNorm prologues into the quantized matmuls
    /// of multi-token keys at any K (`fused_matmul`). Without it those fuse
    /// their prologues only where K <= 1024: past that the fused
    /// eight-token qskinny is slower than the unfused one
    /// (bench/results/gpu-2026-12-06-s26/). One-token matmuls, dense or
    /// quantized, fuse either way (unless `--no-dense-fusion`).
    #[arg(long)]
    pub fused_gemv: bool,
    /// GPU targets: keep dense one-token matmuls unfused (RMSNorm,
    /// SiLU*up and the residual add as their own launches), as every
    /// kiln before the staged fused GEMV did; for A/B measurements and
    /// for `kiln tune` entries of one-token dense shapes.
    #[arg(long, conflicts_with = "fused_gemv")]
    pub no_dense_fusion: bool,
    /// GPU targets, graph schedule: run the q/k norm + RoPE + KV write
    /// inside the attention kernel (`rope_attention`, the
    /// `fuse-rope-attention` pass): one launch per layer fewer, but measured
    /// 5-19% slower than the pair on an H100, so opt-in.
    #[arg(long)]
    pub rope_attention: bool,
    /// GPU targets, graph schedule: where one-token keys run the packed
    /// q/k/v projection and `qkv_rope_kv_write` as one `matmul_qkv_rope`
    /// launch: `off`, `pairs` (heads without a q/k norm) or `all`; the flag
    /// alone means `all`.
    #[arg(long, value_enum, default_value_t = QkvRopeFusion::default(),
          num_args = 0..=1, default_missing_value = "all")]
    pub matmul_qkv_rope: QkvRopeFusion,
    /// Tensor parallelism: shard the plan over N ranks (one GPU each, or N
    /// CPU threads), Megatron-style; N must divide the attention heads and
    /// the KV heads. One plan file holds every rank.
    #[arg(long, default_value_t = 1)]
    pub tp: u32,
    /// Device memory the plan must fit, e.g. `141GiB` (an H200), `80GB`,
    /// `512MiB` or a byte count: a plan needing more (weights, KV cache,
    /// arena, BLAS workspace, counters, staging) is refused here instead of
    /// at load. Leave headroom for the driver's context and libraries.
    /// Without it, the runtime checks at load against the device's free
    /// memory.
    #[arg(long, value_parser = parse_size)]
    pub device_memory: Option<u64>,
    /// Store the dense projection weights (q/k/v/o, gate/up/down, an untied
    /// lm_head) as FP8 e4m3 with one scale per output row, quantized when
    /// the runtime loads them. Norms, biases and the embedding (with a tied
    /// lm_head) stay as the directory stores them.
    #[arg(long, value_enum)]
    pub quantize: Option<QuantizeArg>,
    /// How each key's step runs: `graph` (each op's kernels, captured as a
    /// CUDA graph) or `megakernel` (one persistent kernel walking a task
    /// tape the compiler writes; keys of at most 8 tokens, no BLAS GEMMs).
    #[arg(long, value_enum, default_value_t = passes::megakernel::ScheduleKind::Graph)]
    pub schedule: passes::megakernel::ScheduleKind,
    /// With --schedule megakernel: SMs of the device the tape is cut for.
    #[arg(long, default_value_t = passes::megakernel::MegakernelOptions::default().sm_count, value_parser = clap::value_parser!(u32).range(1..))]
    pub megakernel_sms: u32,
    /// With --schedule megakernel: co-resident thread blocks per SM (one
    /// task queue each).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=32))]
    pub megakernel_blocks_per_sm: u32,
    /// With --schedule megakernel: the narrowest matmul tile in output
    /// columns (a GEMV op is cut into about one tile per queue, no
    /// narrower than this).
    #[arg(long, default_value_t = passes::megakernel::MegakernelOptions::default().min_tile, value_parser = clap::value_parser!(u32).range(1..))]
    pub megakernel_min_tile: u32,
    /// With --schedule megakernel: `op` (the tiles of an op whose consumers
    /// each take all of them share one counter, waited on once) or `tile`
    /// (each task its own completion counter).
    #[arg(long, value_enum, default_value_t = passes::megakernel::MegakernelOptions::default().counters)]
    pub megakernel_counters: passes::megakernel::CounterKind,
    /// Where to write the plan.
    #[arg(short = 'o', long, default_value = "model.kiln")]
    pub output: PathBuf,
    /// No progress bar.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

impl CompileArgs {
    /// The options these arguments describe.
    pub fn options(&self) -> CompileOptions {
        let mut keys: Vec<Key> = if self.keys.is_empty() {
            self.batches
                .iter()
                .map(|&b| Key::new(b, self.query, self.spec))
                .collect()
        } else {
            self.keys.clone()
        };
        if self.serve {
            let largest = self.batches.iter().copied().max().unwrap_or(1);
            for b in [1, largest.min(4)] {
                let k = Key::new(b, self.prefill_chunk, 0);
                if !keys.contains(&k) {
                    keys.push(k);
                }
            }
        }
        CompileOptions {
            keys,
            target: self.target.clone(),
            kv: KvOptions {
                block_size: self.block_size,
                kv_blocks: self.kv_blocks,
                max_tokens: self.max_tokens,
                max_context: Some(self.max_context),
            },
            logits: self.logits || self.serve,
            sampling: self.sampling || self.serve,
            penalty_slots: self.penalty_slots,
            verify: !self.no_verify,
            passes: DEFAULT_PIPELINE
                .into_iter()
                .flat_map(|p| match p {
                    Pass::FuseQkvRopeKvWrite if self.rope_attention => {
                        vec![p, Pass::FuseRopeAttention]
                    }
                    p => vec![p],
                })
                .collect(),
            attn_target_blocks: self.attn_target_blocks,
            no_attn_clusters: self.no_attn_clusters,
            tuning: None,
            fused_gemv: self.fused_gemv,
            dense_fusion: !self.no_dense_fusion,
            matmul_qkv_rope: self.matmul_qkv_rope,
            tp: self.tp,
            device_memory: self.device_memory,
            quantize: self.quantize.map(|_| kiln_ir::QuantType::Fp8E4M3),
            schedule: self.schedule,
            megakernel: passes::megakernel::MegakernelOptions {
                sm_count: self.megakernel_sms,
                blocks_per_sm: self.megakernel_blocks_per_sm,
                min_tile: self.megakernel_min_tile,
                counters: self.megakernel_counters,
            },
        }
    }
}

/// Where a GPU graph plan runs the packed q/k/v projection and
/// `qkv_rope_kv_write` as one `matmul_qkv_rope` launch (one-token keys,
/// kiln's GEMV dense or over a weight kept quantized; HIP keeps the pair).
/// The two forms of the kernel differ in what follows the GEMV
/// (`kernels/gpu/kiln_port.h`): heads without a q/k norm are roped pair by
/// pair by the warps that computed them (no cross-block step), heads with
/// one need the whole head, so the last block over each head finishes it
/// after a completion count.
///
/// `Off` is the default because neither form made a step faster on an
/// H100 (bench/results/gpu-2026-12-06-s30/, b1, ctx 512, fused / pair):
/// Llama-3.2-1B Q4_K 1.04, bf16 1.00, SmolLM2-135M bf16 0.985 (pairs);
/// Qwen3-0.6B Q4_K 1.15, bf16 1.035 (counted tail). The likely reason,
/// not yet profiled: under programmatic dependent launch the separate
/// `qkv_rope_kv_write` is a small grid that attention's blocks can sit
/// beside while they launch and prefetch their cache rows; behind the
/// fused GEMV (two 128-register blocks fill an SM's registers) they wait
/// for its blocks to retire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum QkvRopeFusion {
    /// Never: the GEMV and `qkv_rope_kv_write` stay two launches.
    #[default]
    Off,
    /// Only layers whose heads have no q/k norm (Llama, Mistral, Qwen2,
    /// SmolLM2): the pair epilogue.
    Pairs,
    /// Every layer the kernels run, q/k-norm heads (Qwen3, Gemma-3) with
    /// the counted tail.
    All,
}

/// What `kiln compile --quantize` can store weights as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum QuantizeArg {
    /// FP8 e4m3, one f32 scale per output row.
    Fp8,
}

/// One line per key: what `kiln compile` prints when it is done.
pub fn summary_table(plan: &Plan) -> String {
    let mut s = format!(
        "{:<10} {:>8} {:>12} {:>12} {:>7} {:>10} {:>14} {:>14}\n",
        "key", "launches", "arena_peak", "lower_bound", "eff", "workspace", "flops", "bytes"
    );
    for k in &plan.keys {
        s.push_str(&format!(
            "{:<10} {:>8} {:>12} {:>12} {:>7.4} {:>10} {:>14} {:>14}\n",
            k.key.to_string(),
            k.launches,
            k.arena_peak,
            k.arena_lower_bound,
            efficiency(k.arena_lower_bound, k.arena_peak),
            k.workspace_bytes,
            k.flops,
            k.bytes_moved
        ));
    }
    s
}

/// Runs `kiln compile`: compiles, writes the plan atomically, and returns
/// the report to print.
pub fn run(args: &CompileArgs) -> Result<String, CompileError> {
    // Before any work: the plan may not replace (or land inside) the model.
    crate::outpath::check_output(&args.output, &[&args.model_dir])
        .map_err(|e| CompileError::Options(e.to_string()))?;
    let start = std::time::Instant::now();
    let mut opts = args.options();
    if let Some(path) = &args.tuning {
        opts.tuning = Some(kiln_kernels::tuning::TuningTable::read(path)?);
    }
    let n = normalize_keys(&opts.keys)?.len() as u64;
    let bar = if args.quiet {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(2 * n)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} {msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    let compiled = compile_dir(&args.model_dir, &opts, &mut |stage, key| {
        bar.set_message(match stage {
            Stage::Passes => format!("traced and fused {key}"),
            Stage::Planned => format!("planned {key}"),
        });
        bar.inc(1);
    });
    bar.finish_and_clear();
    let compiled = compiled?;
    let bytes = kiln_ir::artifact::encode(&compiled.plan);
    kiln_ir::artifact::write_bytes_atomic(&args.output, &bytes).map_err(|source| {
        CompileError::Write {
            path: args.output.clone(),
            source,
        }
    })?;
    let p = &compiled.plan;
    let mut notes = String::new();
    for n in &compiled.notes {
        notes.push_str(&format!("note: {n}\n"));
    }
    if p.meta.target != Target::Cpu {
        for k in &p.keys {
            let kinds: Vec<String> = k
                .gemm_kinds()
                .iter()
                .map(|(kind, n)| format!("{kind} {n}"))
                .collect();
            notes.push_str(&format!("{}: GEMMs {}\n", k.key, kinds.join(", ")));
        }
    }
    for k in &p.keys {
        if let Some(t) = k.schedule.tape() {
            notes.push_str(&format!(
                "{}: megakernel tape, {} tasks on {} queues, {} waits\n",
                k.key,
                t.tasks.len(),
                t.queues.len(),
                t.tasks.iter().map(|x| x.waits.len()).sum::<usize>()
            ));
        }
    }
    Ok(format!(
        "{}{notes}wrote {} ({} bytes): {} keys, {} weights ({} bytes), arena {} bytes, workspace {} bytes, target {}, in {:.2} s\n",
        summary_table(p),
        args.output.display(),
        bytes.len(),
        p.keys.len(),
        p.manifest.entries.len(),
        p.manifest.total_bytes(),
        p.arena_bytes,
        p.workspace_bytes,
        p.meta.target,
        start.elapsed().as_secs_f64()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: CompileArgs,
    }

    fn options(argv: &[&str]) -> Result<CompileOptions, clap::Error> {
        let argv = std::iter::once("kiln").chain(argv.iter().copied());
        Cli::try_parse_from(argv).map(|c| c.args.options())
    }

    #[test]
    fn a_serve_plan_adds_prefill_chunk_keys_logits_and_sampling() {
        let o = options(&["m", "--serve", "--batches", "1,8"]).unwrap();
        let keys: Vec<String> = o.keys.iter().map(|k| k.to_string()).collect();
        assert_eq!(keys, ["b1q1s0", "b8q1s0", "b1q16s0", "b4q16s0"]);
        assert!(o.logits && o.sampling);
        let o = options(&["m", "--serve", "--batches", "1", "--prefill-chunk", "32"]).unwrap();
        let keys: Vec<String> = o.keys.iter().map(|k| k.to_string()).collect();
        assert_eq!(keys, ["b1q1s0", "b1q32s0"]);
        let plain = options(&["m"]).unwrap();
        assert!(plain.keys.iter().all(|k| k.query == 1));
        assert!(!plain.logits && !plain.sampling);
    }

    #[test]
    fn the_megakernel_flags_set_the_tape_options_and_the_default_tile_is_eight_columns() {
        use passes::megakernel::CounterKind;
        let plain = options(&["m", "--schedule", "megakernel"]).unwrap();
        assert_eq!(
            plain.megakernel,
            passes::megakernel::MegakernelOptions::default()
        );
        assert_eq!(plain.megakernel.min_tile, 8);
        assert_eq!(plain.megakernel.counters, CounterKind::Op);
        let o = options(&[
            "m",
            "--schedule",
            "megakernel",
            "--megakernel-sms",
            "66",
            "--megakernel-min-tile",
            "16",
            "--megakernel-counters",
            "tile",
        ])
        .unwrap();
        assert_eq!((o.megakernel.sm_count, o.megakernel.min_tile), (66, 16));
        assert_eq!(o.megakernel.counters, CounterKind::Tile);
        assert!(options(&["m", "--megakernel-min-tile", "0"]).is_err());
        assert!(options(&["m", "--megakernel-counters", "task"]).is_err());
    }

    #[test]
    fn serve_refuses_explicit_keys_and_a_chunk_size_needs_serve() {
        assert!(options(&["m", "--serve", "--keys", "b1q1s0"]).is_err());
        assert!(options(&["m", "--prefill-chunk", "8"]).is_err());
        assert!(options(&["m", "--serve", "--prefill-chunk", "1"]).is_err());
    }
}
