//! `kiln bench`: times a compiled plan's decode step on a GPU, replayed from
//! a captured graph and launched eagerly, per shape key.
//!
//! It drives the backend seam directly from the plan: every region the plan
//! addresses is allocated once (arena, each key's Io region, weights, the
//! per-layer K/V caches, the BLAS workspace at the plan's figure), each
//! GEMM is prepared before capture, and each key's op list becomes one
//! graph. Per key it reports the median step time replayed and eager, their
//! ratio, tokens/s, the step time over the HBM floor (the plan's bytes moved
//! over the device-to-device copy bandwidth measured in the same run),
//! capture time, and arena/workspace bytes, as a table and as JSON.
//!
//! Inputs are synthetic but valid: every sequence has `--context` tokens of
//! context in its own blocks (the null block never appears), token ids and
//! draft tokens are random. Weights come from `--weights` (the safetensors
//! the plan was compiled against, with the manifest's transforms) or, when
//! absent, are random; K/V caches are random. Timing does not depend on the
//! values; the emitted tokens are only meaningful with real weights and a
//! real prefix, which is the engine's job, not the benchmark's.
//!
//! Not here: the engine's dispatcher, padding and sampling policy (this
//! times one key at a time, full batch), and any CPU timing.

use kiln_ir::manifest::{TensorRef, WeightEntry};
use kiln_ir::plan::KvLayout;
use kiln_ir::{DType, InputRole, Key};
use serde::Serialize;
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
    /// Execution device: `cuda` (the only one timed).
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// CUDA device ordinal.
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
}

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Usage(String),
    #[error("reading {path}: {message}")]
    Io { path: String, message: String },
    #[error("plan {path}: {message}")]
    Plan { path: String, message: String },
    #[error("weights: {0}")]
    Weights(String),
    #[error("device: {0}")]
    Device(String),
}

/// One key's result.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct KeyResult {
    pub key: String,
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
    pub hbm_floor_ms: f64,
    pub replay_over_floor: f64,
    pub capture_ms: f64,
    pub arena_bytes: u64,
    pub workspace_bytes: u64,
}

/// The whole report.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct BenchReport {
    pub plan: String,
    pub device: String,
    pub weights: String,
    pub copy_bandwidth_gbs: f64,
    /// Device bytes the backend holds beyond the plan's regions (attention
    /// scratch, completion counters).
    pub backend_extra_bytes: u64,
    pub keys: Vec<KeyResult>,
}

impl BenchReport {
    /// The human-readable table.
    pub fn table(&self) -> String {
        let mut s = format!(
            "plan {}  device {}  weights {}  copy bandwidth {:.0} GB/s\n",
            self.plan, self.device, self.weights, self.copy_bandwidth_gbs
        );
        s.push_str(&format!(
            "{:<10} {:>5} {:>10} {:>10} {:>7} {:>10} {:>9} {:>7} {:>9} {:>12} {:>12}\n",
            "key",
            "ctx",
            "eager ms",
            "replay ms",
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
                "{:<10} {:>5} {:>10.3} {:>10.3} {:>7.2} {:>10.0} {:>9.3} {:>7.2} {:>9.1} {:>12} {:>12}\n",
                k.key,
                k.context,
                k.eager_ms,
                k.replay_ms,
                k.speedup,
                k.tokens_per_s,
                k.hbm_floor_ms,
                k.replay_over_floor,
                k.capture_ms,
                k.arena_bytes,
                k.workspace_bytes
            ));
        }
        s
    }
}

/// Host-side inputs of one step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepInputs {
    pub token_ids: Vec<i32>,
    pub positions: Vec<i32>,
    pub slot_mapping: Vec<i32>,
    /// Row-major `[batch, max_blocks_per_seq]`.
    pub block_tables: Vec<i32>,
    pub context_lens: Vec<i32>,
    pub draft_tokens: Vec<i32>,
}

impl StepInputs {
    /// Bytes of the staging input `role` (None for the caches).
    pub fn bytes(&self, role: InputRole) -> Option<Vec<u8>> {
        let v = match role {
            InputRole::TokenIds => &self.token_ids,
            InputRole::Positions => &self.positions,
            InputRole::SlotMapping => &self.slot_mapping,
            InputRole::BlockTables => &self.block_tables,
            InputRole::ContextLens => &self.context_lens,
            InputRole::DraftTokens => &self.draft_tokens,
            InputRole::KCache(_) | InputRole::VCache(_) => return None,
        };
        Some(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// xorshift64*, for reproducible synthetic inputs and weights.
struct Rng(u64);
impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u32) -> i32 {
        (self.next() % n.max(1) as u64) as i32
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Valid inputs for `key` with every sequence at `context` tokens: sequence
/// `b` owns blocks `1 + b*n .. 1 + (b+1)*n` (block 0 is the null block), the
/// step's `query` tokens sit at the last positions of the context.
pub fn step_inputs(
    key: Key,
    kv: &KvLayout,
    context: u32,
    vocab: u32,
    seed: u64,
) -> Result<StepInputs, BenchError> {
    let (b, q) = (key.batch, key.query);
    if context < q {
        return Err(BenchError::Usage(format!(
            "--context {context} is shorter than the {q} query tokens of key {key}"
        )));
    }
    let per_seq = context.div_ceil(kv.block_size);
    if per_seq > kv.max_blocks_per_seq {
        return Err(BenchError::Usage(format!(
            "--context {context} needs {per_seq} blocks per sequence but the plan's block tables hold {} ({} tokens); lower --context or recompile with a longer max context",
            kv.max_blocks_per_seq,
            kv.max_blocks_per_seq * kv.block_size
        )));
    }
    let needed = 1 + b as u64 * per_seq as u64;
    if needed > kv.num_blocks as u64 {
        return Err(BenchError::Usage(format!(
            "key {key} at --context {context} needs {needed} KV blocks but the plan's cache has {}; lower --context or the batch",
            kv.num_blocks
        )));
    }
    let mut r = Rng::new(seed);
    let m = kv.max_blocks_per_seq as usize;
    let mut block_tables = vec![kv.null_block as i32; b as usize * m];
    for s in 0..b as usize {
        for j in 0..per_seq as usize {
            block_tables[s * m + j] = (1 + s * per_seq as usize + j) as i32;
        }
    }
    let mut positions = Vec::new();
    let mut slot_mapping = Vec::new();
    for s in 0..b as usize {
        for i in 0..q {
            let p = context - q + i;
            positions.push(p as i32);
            let blk = block_tables[s * m + (p / kv.block_size) as usize];
            slot_mapping.push(blk * kv.block_size as i32 + (p % kv.block_size) as i32);
        }
    }
    Ok(StepInputs {
        token_ids: (0..b * q).map(|_| r.below(vocab)).collect(),
        positions,
        slot_mapping,
        block_tables,
        context_lens: vec![context as i32; b as usize],
        draft_tokens: (0..b * key.spec).map(|_| r.below(vocab)).collect(),
    })
}

/// Converts raw little-endian values of `from` to `to`.
fn convert(bytes: &[u8], from: DType, to: DType) -> Result<Vec<u8>, BenchError> {
    if from == to {
        return Ok(bytes.to_vec());
    }
    let vals: Vec<f32> = match from {
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::I32 => {
            return Err(BenchError::Weights(format!(
                "cannot convert i32 weights to {to}"
            )))
        }
    };
    Ok(match to {
        DType::BF16 => vals
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        DType::F16 => vals
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        DType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::I32 => {
            return Err(BenchError::Weights(format!(
                "cannot convert {from} weights to i32"
            )))
        }
    })
}

fn st_dtype(d: safetensors::Dtype) -> Option<DType> {
    match d {
        safetensors::Dtype::BF16 => Some(DType::BF16),
        safetensors::Dtype::F16 => Some(DType::F16),
        safetensors::Dtype::F32 => Some(DType::F32),
        safetensors::Dtype::I32 => Some(DType::I32),
        _ => None,
    }
}

/// Loads safetensors files on demand (memory-mapped) and builds manifest
/// entries with their transforms (row concatenation, dtype conversion).
pub struct WeightLoader {
    dir: PathBuf,
    files: Vec<(String, memmap2::Mmap)>,
}

impl WeightLoader {
    pub fn new(dir: &Path) -> WeightLoader {
        WeightLoader {
            dir: dir.to_path_buf(),
            files: Vec::new(),
        }
    }

    fn file(&mut self, name: &str) -> Result<&memmap2::Mmap, BenchError> {
        if let Some(i) = self.files.iter().position(|(n, _)| n == name) {
            return Ok(&self.files[i].1);
        }
        let path = self.dir.join(name);
        let f = std::fs::File::open(&path).map_err(|e| BenchError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        // SAFETY: the model files are read-only inputs for the benchmark's
        // lifetime; a concurrent writer is outside the contract.
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| BenchError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        self.files.push((name.to_string(), map));
        Ok(&self.files.last().expect("just pushed").1)
    }

    fn part(&mut self, t: &TensorRef, to: DType) -> Result<Vec<u8>, BenchError> {
        let map = self.file(&t.file)?;
        let st = safetensors::SafeTensors::deserialize(map)
            .map_err(|e| BenchError::Weights(format!("{}: {e}", t.file)))?;
        let view = st
            .tensor(&t.tensor)
            .map_err(|e| BenchError::Weights(format!("{}: tensor `{}`: {e}", t.file, t.tensor)))?;
        let dtype = st_dtype(view.dtype()).ok_or_else(|| {
            BenchError::Weights(format!(
                "{}: tensor `{}` has unsupported dtype {:?}",
                t.file,
                t.tensor,
                view.dtype()
            ))
        })?;
        let shape: Vec<u32> = view.shape().iter().map(|&d| d as u32).collect();
        if dtype != t.dtype || shape != t.shape.dims() {
            return Err(BenchError::Weights(format!(
                "{}: tensor `{}` is {dtype}{shape:?} but the plan expects {}{}; the weights are not the ones the plan was compiled against",
                t.file, t.tensor, t.dtype, t.shape
            )));
        }
        convert(view.data(), dtype, to)
    }

    /// The bytes of `entry` in its plan dtype.
    pub fn entry(&mut self, entry: &WeightEntry) -> Result<Vec<u8>, BenchError> {
        let mut out = Vec::new();
        for t in entry.source.parts() {
            out.extend(self.part(t, entry.dtype)?);
        }
        let want = entry.shape.numel() * entry.dtype.size() as u64;
        if out.len() as u64 != want {
            return Err(BenchError::Weights(format!(
                "`{}`: sources give {} bytes, the entry needs {want}",
                entry.name,
                out.len()
            )));
        }
        Ok(out)
    }
}

/// Random values in [-0.05, 0.05) for `entry` (a norm weight near 1), in its
/// plan dtype.
pub fn random_entry(entry: &WeightEntry, seed: u64) -> Result<Vec<u8>, BenchError> {
    let mut r = Rng::new(seed);
    let n = entry.shape.numel() as usize;
    let norm_like = entry.shape.rank() == 1;
    let f: Vec<u8> = (0..n)
        .flat_map(|_| {
            let v = if norm_like {
                1.0 + 0.1 * r.uniform()
            } else {
                0.05 * r.uniform()
            };
            v.to_le_bytes()
        })
        .collect();
    convert(&f, DType::F32, entry.dtype)
}

/// The key's plan, or a usage error listing the keys the plan has.
fn key_plan(plan: &kiln_ir::plan::Plan, key: Key) -> Result<&kiln_ir::plan::KeyPlan, BenchError> {
    plan.key_plan(key).ok_or_else(|| {
        BenchError::Usage(format!(
            "key {key} is not in the plan (it has: {})",
            plan.keys
                .iter()
                .map(|k| k.key.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })
}

/// The staging uploads of one key's step: each input's Io location and
/// bytes, checked against the sizes the plan recorded.
pub fn key_uploads(
    plan: &kiln_ir::plan::Plan,
    key: Key,
    context: u32,
) -> Result<Vec<(kiln_ir::plan::BufRef, Vec<u8>)>, BenchError> {
    let kp = key_plan(plan, key)?;
    let inputs = step_inputs(key, &plan.kv, context, plan.meta.info.vocab_size, 11)?;
    let mut out = Vec::new();
    for (role, buf) in &kp.inputs {
        if let Some(bytes) = inputs.bytes(*role) {
            if bytes.len() as u64 != buf.bytes {
                return Err(BenchError::Usage(format!(
                    "input {} of key {key} is {} bytes in the plan, {} synthesized",
                    role.name(),
                    buf.bytes,
                    bytes.len()
                )));
            }
            out.push((*buf, bytes));
        }
    }
    Ok(out)
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

/// Runs the benchmark; returns the report (the CLI prints its table).
pub fn run(args: &BenchArgs) -> Result<BenchReport, BenchError> {
    if args.device != "cuda" {
        return Err(BenchError::Usage(format!(
            "--device {}: kiln bench times GPU graphs; use --device cuda",
            args.device
        )));
    }
    #[cfg(feature = "cuda")]
    {
        cuda::run(args)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(BenchError::Usage(
            "this kiln was built without CUDA support; rebuild with `cargo build --release --features cuda`".into(),
        ))
    }
}

/// Writes the report as JSON to `path` (temp file, then rename).
pub fn write_json(report: &BenchReport, path: &Path) -> Result<(), BenchError> {
    let text = serde_json::to_string_pretty(report).expect("the report serializes");
    kiln_ir::artifact::write_bytes_atomic(path, text.as_bytes()).map_err(|e| BenchError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use kiln_ir::plan::{BufRef, Plan, Region, Target};
    use kiln_runtime::backend::{Backend, DevOperand, DevPtr, Launch};
    use kiln_runtime::cuda::CudaBackend;
    use std::collections::HashMap;

    fn dev(e: impl std::fmt::Display) -> BenchError {
        BenchError::Device(e.to_string())
    }

    fn median(mut v: Vec<f32>) -> f64 {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2] as f64
    }

    pub fn run(args: &BenchArgs) -> Result<BenchReport, BenchError> {
        let path = args.plan.display().to_string();
        let plan: Plan = kiln_ir::artifact::read_plan(&args.plan)
            .map_err(|e| BenchError::Io {
                path: path.clone(),
                message: e.to_string(),
            })?
            .map_err(|e| BenchError::Plan {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let mut b = CudaBackend::new(args.ordinal).map_err(dev)?;
        let sm = b.sm();
        match plan.meta.target {
            Target::Cuda { sm: p } if p == sm => {}
            ref t => {
                return Err(BenchError::Plan {
                    path,
                    message: format!(
                        "compiled for {t}, but the device is sm_{sm}; recompile with --target cuda:sm_{sm}"
                    ),
                })
            }
        }
        let images = if plan.kernels.is_empty() {
            eprintln!(
                "note: the plan carries no kernel images; compiling them with NVRTC for sm_{sm}"
            );
            kiln_kernels::nvrtc::compile_cubins(sm).map_err(dev)?
        } else {
            plan.kernels.clone()
        };
        b.load_kernels(&images).map_err(dev)?;
        let bw = b.copy_bandwidth(1 << 30, 10).map_err(dev)?;

        // Regions.
        let mut bases: HashMap<Region, DevPtr> = HashMap::new();
        let arena = b.alloc(plan.arena_bytes.max(1), "arena").map_err(dev)?;
        bases.insert(Region::Arena, arena);
        let ws = b.reserve_workspace(plan.workspace_bytes).map_err(dev)?;
        if let Some((p, _)) = ws {
            bases.insert(Region::Workspace, p);
        }
        let weights = match &args.weights {
            Some(d) => d.display().to_string(),
            None => "random".to_string(),
        };
        let mut loader = args.weights.as_deref().map(WeightLoader::new);
        for (i, e) in plan.manifest.entries.iter().enumerate() {
            let bytes = match loader.as_mut() {
                Some(l) => l.entry(e)?,
                None => random_entry(e, 1000 + i as u64)?,
            };
            let p = b.alloc(bytes.len() as u64, &e.name).map_err(dev)?;
            b.upload(p, &bytes).map_err(dev)?;
            bases.insert(Region::Weight(i as u32), p);
        }
        let cache_bytes = plan.kv.cache_bytes();
        let mut rng = Rng::new(7);
        let chunk: Vec<u8> = {
            let f: Vec<u8> = (0..(1 << 20))
                .flat_map(|_| rng.uniform().to_le_bytes())
                .collect();
            convert(&f, DType::F32, plan.kv.dtype)?
        };
        for l in 0..plan.kv.layers {
            for region in [Region::KCache(l), Region::VCache(l)] {
                let p = b.alloc(cache_bytes, "kv cache").map_err(dev)?;
                let mut off = 0u64;
                while off < cache_bytes {
                    let n = (cache_bytes - off).min(chunk.len() as u64);
                    b.upload(p.offset(off), &chunk[..n as usize]).map_err(dev)?;
                    off += n;
                }
                bases.insert(region, p);
            }
        }

        let wanted: Vec<Key> = if args.keys.is_empty() {
            plan.keys.iter().map(|k| k.key).collect()
        } else {
            args.keys
                .iter()
                .map(|s| {
                    s.parse::<Key>()
                        .map_err(|e| BenchError::Usage(e.to_string()))
                })
                .collect::<Result<_, _>>()?
        };
        let mut results = Vec::new();
        for key in wanted {
            let kp = key_plan(&plan, key)?;
            let io = b.alloc(kp.io_bytes.max(1), "io").map_err(dev)?;
            bases.insert(Region::Io, io);
            for (buf, bytes) in key_uploads(&plan, key, args.context)? {
                b.upload(resolve(&bases, &buf)?, &bytes).map_err(dev)?;
            }
            let launches: Vec<Launch> = kp
                .ops
                .iter()
                .map(|op| {
                    let operand = |o: &kiln_ir::plan::Operand| -> Result<DevOperand, BenchError> {
                        Ok(DevOperand {
                            ptr: resolve(&bases, &o.buf)?,
                            ty: o.ty.clone(),
                        })
                    };
                    Ok(Launch {
                        // As the engine does: weights may be read early.
                        const_args: op.weight_args(),
                        body: kiln_runtime::backend::LaunchBody::Reference,
                        kernel: op.kernel.clone(),
                        op: op.op.clone(),
                        args: op.args.iter().map(operand).collect::<Result<_, _>>()?,
                        results: op.results.iter().map(operand).collect::<Result<_, _>>()?,
                        workspace: if op.workspace_bytes > 0 { ws } else { None },
                    })
                })
                .collect::<Result<_, BenchError>>()?;
            for l in &launches {
                b.prepare(l).map_err(dev)?;
            }
            for _ in 0..3 {
                for l in &launches {
                    b.launch(l).map_err(dev)?;
                }
            }
            b.synchronize().map_err(dev)?;
            let eager_steps = (args.steps / 10).max(10);
            let mut eager = Vec::new();
            for _ in 0..eager_steps {
                eager.push(
                    b.time_ms(|b| launches.iter().try_for_each(|l| b.launch(l)))
                        .map_err(dev)?,
                );
            }
            let t0 = std::time::Instant::now();
            b.begin_capture(key).map_err(dev)?;
            for l in &launches {
                if let Err(e) = b.launch(l) {
                    let _ = b.abort_capture_now();
                    return Err(dev(e));
                }
            }
            let g = b.end_capture().map_err(dev)?;
            let capture_ms = t0.elapsed().as_secs_f64() * 1e3;
            for _ in 0..10 {
                b.replay(g).map_err(dev)?;
            }
            let mut replay = Vec::new();
            for _ in 0..args.steps.max(1) {
                replay.push(b.time_ms(|b| b.replay(g)).map_err(dev)?);
            }
            let b2b = b
                .time_ms(|b| (0..100).try_for_each(|_| b.replay(g)))
                .map_err(dev)? as f64
                / 100.0;
            b.destroy_graph(g).map_err(dev)?;
            b.free(io).map_err(dev)?;
            let (e, r) = (median(eager), median(replay));
            let bytes = step_bytes(&plan, key, args.context);
            let floor = bytes as f64 / bw * 1e3;
            results.push(KeyResult {
                key: key.to_string(),
                batch: key.batch,
                query: key.query,
                context: args.context,
                launches: kp.launches,
                eager_ms: e,
                replay_ms: r,
                replay_back_to_back_ms: b2b,
                speedup: e / r,
                tokens_per_s: key.batch as f64 / (r / 1e3),
                bytes_moved: bytes,
                plan_bytes_moved: kp.bytes_moved,
                hbm_floor_ms: floor,
                replay_over_floor: r / floor,
                capture_ms,
                arena_bytes: plan.arena_bytes,
                workspace_bytes: plan.workspace_bytes,
            });
        }
        let planned: u64 = plan.arena_bytes
            + plan.workspace_bytes
            + plan.manifest.total_bytes()
            + 2 * plan.kv.layers as u64 * cache_bytes;
        let report = BenchReport {
            plan: path,
            device: format!("{} (sm_{sm}, {} SMs)", b.info().name, b.sm_count()),
            weights,
            copy_bandwidth_gbs: bw / 1e9,
            backend_extra_bytes: b.allocated_bytes().saturating_sub(planned + 1),
            keys: results,
        };
        if let Some(p) = &args.json {
            write_json(&report, p)?;
        }
        Ok(report)
    }

    fn resolve(bases: &HashMap<Region, DevPtr>, buf: &BufRef) -> Result<DevPtr, BenchError> {
        bases
            .get(&buf.region)
            .map(|p| p.offset(buf.offset))
            .ok_or_else(|| {
                BenchError::Device(format!(
                    "the plan addresses region {:?}, which was not allocated",
                    buf.region
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_ir::manifest::WeightSource;
    use kiln_ir::Shape;

    fn kv() -> KvLayout {
        KvLayout {
            layers: 2,
            kv_heads: 2,
            head_dim: 8,
            dtype: DType::BF16,
            block_size: 16,
            num_blocks: 40,
            null_block: 0,
            max_blocks_per_seq: 8,
        }
    }

    #[test]
    fn synthetic_inputs_give_each_sequence_its_own_blocks_and_never_the_null_block() {
        let key = Key::new(3, 2, 1);
        let s = step_inputs(key, &kv(), 100, 1000, 5).unwrap();
        assert_eq!(s.token_ids.len(), 6);
        assert_eq!(s.draft_tokens.len(), 3);
        assert_eq!(s.context_lens, vec![100; 3]);
        assert_eq!(s.positions, vec![98, 99, 98, 99, 98, 99]);
        // 100 tokens = 7 blocks per sequence, disjoint, none the null block.
        let mut used = Vec::new();
        for b in 0..3 {
            let row = &s.block_tables[b * 8..b * 8 + 7];
            assert!(row.iter().all(|&x| x != 0));
            used.extend_from_slice(row);
            assert_eq!(
                s.block_tables[b * 8 + 7],
                0,
                "unused entries point at the null block"
            );
        }
        used.sort();
        used.dedup();
        assert_eq!(used.len(), 21);
        // The slot of position 99 of sequence 1: block 6 of its table, offset 3.
        assert_eq!(s.slot_mapping[3], s.block_tables[8 + 6] * 16 + 3);
        assert!(s.token_ids.iter().all(|&t| (0..1000).contains(&t)));
    }

    #[test]
    fn a_context_beyond_the_plan_is_refused_with_the_fix() {
        let e = step_inputs(Key::new(1, 1, 0), &kv(), 200, 1000, 1).unwrap_err();
        assert!(e.to_string().contains("lower --context"), "{e}");
        let e = step_inputs(Key::new(8, 1, 0), &kv(), 100, 1000, 1).unwrap_err();
        assert!(e.to_string().contains("KV blocks"), "{e}");
        let e = step_inputs(Key::new(1, 4, 3), &kv(), 2, 1000, 1).unwrap_err();
        assert!(e.to_string().contains("query tokens"), "{e}");
    }

    fn write_safetensors(dir: &Path, tensors: &[(&str, DType, Vec<u32>, Vec<u8>)]) {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for (name, d, shape, bytes) in tensors {
            let dt = match d {
                DType::BF16 => "BF16",
                DType::F16 => "F16",
                DType::F32 => "F32",
                DType::I32 => "I32",
            };
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": [data.len(), data.len() + bytes.len()]}),
            );
            data.extend_from_slice(bytes);
        }
        let h = serde_json::to_vec(&header).unwrap();
        let mut f = (h.len() as u64).to_le_bytes().to_vec();
        f.extend(h);
        f.extend(data);
        std::fs::write(dir.join("model.safetensors"), f).unwrap();
    }

    #[test]
    fn weights_load_with_row_concatenation_and_dtype_conversion() {
        let dir = tempfile::tempdir().unwrap();
        let q: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
        let k: Vec<f32> = (0..4).map(|i| -(i as f32)).collect();
        write_safetensors(
            dir.path(),
            &[
                (
                    "q",
                    DType::F32,
                    vec![3, 2],
                    q.iter().flat_map(|v| v.to_le_bytes()).collect(),
                ),
                (
                    "k",
                    DType::BF16,
                    vec![2, 2],
                    k.iter()
                        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                        .collect(),
                ),
            ],
        );
        let tr = |name: &str, d, s: Vec<u32>| TensorRef {
            file: "model.safetensors".into(),
            tensor: name.into(),
            dtype: d,
            shape: Shape(s),
        };
        let entry = WeightEntry {
            name: "qk".into(),
            dtype: DType::BF16,
            shape: Shape(vec![5, 2]),
            source: WeightSource::ConcatRows(vec![
                tr("q", DType::F32, vec![3, 2]),
                tr("k", DType::BF16, vec![2, 2]),
            ]),
        };
        let bytes = WeightLoader::new(dir.path()).entry(&entry).unwrap();
        let got: Vec<f32> = bytes
            .chunks(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        let want: Vec<f32> = q.iter().chain(k.iter()).cloned().collect();
        assert_eq!(got, want);
        // A tensor whose shape differs from the plan's record is refused.
        let bad = WeightEntry {
            source: WeightSource::Tensor(tr("q", DType::F32, vec![2, 3])),
            shape: Shape(vec![2, 3]),
            ..entry.clone()
        };
        let e = WeightLoader::new(dir.path()).entry(&bad).unwrap_err();
        assert!(
            e.to_string()
                .contains("not the ones the plan was compiled against"),
            "{e}"
        );
        let missing = WeightEntry {
            source: WeightSource::Tensor(tr("nope", DType::F32, vec![3, 2])),
            shape: Shape(vec![3, 2]),
            ..entry
        };
        assert!(WeightLoader::new(dir.path()).entry(&missing).is_err());
    }

    #[test]
    fn random_weights_have_the_entry_size_and_norms_sit_near_one() {
        let e = |shape: Vec<u32>| WeightEntry {
            name: "w".into(),
            dtype: DType::BF16,
            shape: Shape(shape),
            source: WeightSource::Tensor(TensorRef {
                file: "m".into(),
                tensor: "w".into(),
                dtype: DType::BF16,
                shape: Shape(vec![1]),
            }),
        };
        let norm = random_entry(&e(vec![64]), 1).unwrap();
        assert_eq!(norm.len(), 128);
        let vals: Vec<f32> = norm
            .chunks(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        assert!(vals.iter().all(|v| (0.85..1.15).contains(v)));
        let mat = random_entry(&e(vec![8, 16]), 2).unwrap();
        assert_eq!(mat.len(), 256);
        assert_ne!(random_entry(&e(vec![8, 16]), 3).unwrap(), mat);
    }

    #[test]
    fn the_report_table_has_a_row_per_key_and_json_round_trips_through_a_file() {
        let r = BenchReport {
            plan: "m.kiln".into(),
            device: "test".into(),
            weights: "random".into(),
            copy_bandwidth_gbs: 4000.0,
            backend_extra_bytes: 0,
            keys: vec![KeyResult {
                key: "b1q1s0".into(),
                batch: 1,
                query: 1,
                context: 512,
                launches: 256,
                eager_ms: 1.5,
                replay_ms: 0.5,
                replay_back_to_back_ms: 0.5,
                speedup: 3.0,
                tokens_per_s: 2000.0,
                bytes_moved: 1 << 30,
                plan_bytes_moved: 1 << 31,
                hbm_floor_ms: 0.27,
                replay_over_floor: 1.85,
                capture_ms: 2.0,
                arena_bytes: 1 << 20,
                workspace_bytes: 0,
            }],
        };
        let t = r.table();
        assert!(t.contains("b1q1s0") && t.contains("3.00"), "{t}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bench.json");
        write_json(&r, &p).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert_eq!(v["keys"][0]["replay_ms"], 0.5);
    }

    /// Every family's tiny plan compiled for `cuda:sm_90`: the benchmark's
    /// synthesized inputs fit every key, every op addresses a region the
    /// benchmark allocates, and every op lowers to the GPU kernel catalog.
    #[test]
    fn compiled_tiny_plans_fit_the_benchmark_and_lower_to_gpu_kernels() {
        use crate::frontend::registry::Family;
        use crate::testing::{write_tiny_model, TinySpec};
        use kiln_ir::plan::{Region, Target};
        use kiln_kernels::gpu::{lower, Lowered, Placement};
        for family in [Family::Llama, Family::Mistral, Family::Qwen2, Family::Qwen3] {
            let dir = tempfile::tempdir().unwrap();
            write_tiny_model(dir.path(), family, &TinySpec::for_family(family)).unwrap();
            let keys = vec![Key::new(1, 1, 0), Key::new(3, 1, 0), Key::new(2, 3, 2)];
            let opts = crate::compile::CompileOptions {
                keys: keys.clone(),
                target: Target::Cuda { sm: 90 },
                ..Default::default()
            };
            let plan = crate::compile::compile_dir(dir.path(), &opts, &mut |_, _| {})
                .unwrap()
                .plan;
            let ctx = (plan.kv.max_blocks_per_seq * plan.kv.block_size).min(40);
            // The floor's bytes grow with context by exactly the K/V rows read.
            let k = Key::new(3, 1, 0);
            let row =
                plan.kv.kv_heads as u64 * plan.kv.head_dim as u64 * plan.kv.dtype.size() as u64;
            assert_eq!(
                step_bytes(&plan, k, ctx) - step_bytes(&plan, k, ctx - 1),
                3 * plan.kv.layers as u64 * 2 * row
            );
            assert!(step_bytes(&plan, k, 1) > plan.manifest.total_bytes());
            for key in keys {
                let ups = key_uploads(&plan, key, ctx)
                    .unwrap_or_else(|e| panic!("{family:?} {key}: {e}"));
                assert!(ups.iter().all(|(b, _)| b.region == Region::Io));
                let kp = plan.key_plan(key).unwrap();
                for op in &kp.ops {
                    for o in op.args.iter().chain(&op.results) {
                        let known = match o.buf.region {
                            Region::Weight(i) => (i as usize) < plan.manifest.entries.len(),
                            Region::KCache(l) | Region::VCache(l) => l < plan.kv.layers,
                            Region::Arena | Region::Io | Region::Workspace | Region::Counters => {
                                true
                            }
                        };
                        assert!(known, "{family:?} {key}: {:?}", o.buf.region);
                    }
                    let a: Vec<_> = op.args.iter().map(|o| o.ty.clone()).collect();
                    let r: Vec<_> = op.results.iter().map(|o| o.ty.clone()).collect();
                    let overlap = match (op.results.first(), op.args.first()) {
                        (Some(x), Some(y)) => {
                            x.buf.region == y.buf.region
                                && x.buf.offset < y.buf.offset + y.buf.bytes
                                && y.buf.offset < x.buf.offset + x.buf.bytes
                        }
                        _ => false,
                    };
                    let l = lower(
                        &op.op,
                        &a,
                        &r,
                        Placement {
                            result0_overlaps_arg0: overlap,
                        },
                    )
                    .unwrap_or_else(|e| panic!("{family:?} {key} {}: {e}", op.kernel));
                    if let Lowered::Kernels { calls, .. } = l {
                        for c in calls {
                            assert!(kiln_kernels::gpu::entry_points(c.module).contains(&c.entry));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_non_cuda_device_is_refused_by_name() {
        let args = BenchArgs {
            plan: "x.kiln".into(),
            weights: None,
            device: "cpu".into(),
            ordinal: 0,
            keys: vec![],
            steps: 10,
            context: 16,
            json: None,
        };
        let e = run(&args).unwrap_err();
        assert!(e.to_string().contains("--device cuda"), "{e}");
    }
}
