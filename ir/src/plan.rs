//! Plan types: what `kiln compile` writes and the runtime replays.
//!
//! These live in `kiln-ir` so a serving process links the runtime and the IR
//! and never the compiler. The encoding (magic, version, checksum) is in
//! [`crate::artifact`].
//!
//! Memory is addressed by [`BufRef`]: a region and an offset. The runtime
//! allocates each region once, before any capture, and resolves a `BufRef` to
//! `base(region) + offset`; nothing in a plan is a raw device address.

use crate::graph::{Graph, InputRole, NodeId, ValueId};
use crate::key::Key;
use crate::manifest::WeightManifest;
use crate::op::Op;
use crate::types::{DType, TensorType};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Arena offsets are aligned to this many bytes.
pub const ARENA_ALIGN: u64 = 256;

/// What the plan's kernels were built for.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Target {
    /// The CPU reference backend.
    Cpu,
    /// NVIDIA, by SM version (`cuda:sm_90` is `Cuda { sm: 90 }`).
    Cuda { sm: u32 },
    /// AMD, by gfx architecture name (`hip:gfx1100`).
    Hip { gfx: String },
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Cpu => f.write_str("cpu"),
            Target::Cuda { sm } => write!(f, "cuda:sm_{sm}"),
            Target::Hip { gfx } => write!(f, "hip:{gfx}"),
        }
    }
}

impl std::str::FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> Result<Target, String> {
        let err = || {
            format!("unknown target `{s}`: expected cpu, cuda:sm_<NN> (e.g. cuda:sm_90) or hip:gfx<ARCH> (e.g. hip:gfx1100)")
        };
        if s == "cpu" {
            return Ok(Target::Cpu);
        }
        if let Some(sm) = s.strip_prefix("cuda:sm_") {
            if !sm.is_empty() && sm.bytes().all(|c| c.is_ascii_digit()) {
                return sm.parse().map(|sm| Target::Cuda { sm }).map_err(|_| err());
            }
            return Err(err());
        }
        if let Some(gfx) = s.strip_prefix("hip:") {
            if gfx.starts_with("gfx")
                && gfx.len() > 3
                && gfx.bytes().all(|c| c.is_ascii_alphanumeric())
            {
                return Ok(Target::Hip {
                    gfx: gfx.to_string(),
                });
            }
        }
        Err(err())
    }
}

/// A source weight file the plan was compiled against.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceFile {
    /// Name relative to the model directory.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Hex SHA-256 of the safetensors header (length prefix + JSON).
    pub header_sha256: String,
}

/// Model facts the runtime needs without reading config.json.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub vocab_size: u32,
    pub hidden_size: u32,
    pub num_layers: u32,
    pub num_heads: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    /// Longest context a sequence may reach (prompt + generated).
    pub max_context: u32,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Activation and weight dtype of the plan.
    pub dtype: DType,
}

/// Metadata of the compiled model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelMeta {
    /// HF architecture name, e.g. `LlamaForCausalLM`.
    pub architecture: String,
    pub files: Vec<SourceFile>,
    /// `kiln-compiler` version that wrote the plan.
    pub compiler_version: String,
    pub target: Target,
    pub info: ModelInfo,
}

/// Paged KV cache layout.
///
/// Each layer has a K and a V cache of `num_blocks * block_size` slots, each
/// slot `kv_heads * head_dim` elements of `dtype`. Block `null_block` is
/// reserved: padding rows write there, and no sequence ever owns it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype: DType,
    pub block_size: u32,
    /// Total blocks per layer, the null block included.
    pub num_blocks: u32,
    /// The reserved block (0).
    pub null_block: u32,
    /// Width `M` of the block tables: `ceil(max_context / block_size)`.
    pub max_blocks_per_seq: u32,
}

impl KvLayout {
    pub fn slots(&self) -> u64 {
        self.num_blocks as u64 * self.block_size as u64
    }
    /// Bytes of one layer's K (or V) cache.
    pub fn cache_bytes(&self) -> u64 {
        self.slots() * self.kv_heads as u64 * self.head_dim as u64 * self.dtype.size() as u64
    }
    /// The slot padding rows write to.
    pub fn null_slot(&self) -> u32 {
        self.null_block * self.block_size
    }
}

/// A memory region the runtime allocates once, before any capture.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Region {
    /// Scratch shared by every key's graph (they never run concurrently).
    Arena,
    /// This key's staging inputs and outputs (host-written before replay,
    /// host-read after); one Io region per key.
    Io,
    /// Manifest entry `i`.
    Weight(u32),
    /// Layer `l`'s K cache.
    KCache(u32),
    /// Layer `l`'s V cache.
    VCache(u32),
    /// The BLAS workspace (`workspace_bytes`).
    Workspace,
    /// Completion counters (`Plan::counter_bytes`, u32 each): zeroed once at
    /// load, before any capture; every kernel that uses them leaves them
    /// zero. Within a key each op has its own counters. A megakernel tape's
    /// counters (`crate::schedule::Tape::counters`) lie above every op's and
    /// are zeroed by the reset kernel at the start of each step instead.
    Counters,
}

/// Bytes `[offset, offset + bytes)` of a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BufRef {
    pub region: Region,
    pub offset: u64,
    pub bytes: u64,
}

/// An operand of a planned op: where it lives and its type.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Operand {
    pub buf: BufRef,
    pub ty: TensorType,
}

/// One launch (or library call) of a key's step, in stream order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanOp {
    /// The graph node this op executes.
    pub node: NodeId,
    /// Kernel catalog name (e.g. `rms_norm_bf16`, `gemm` for BLAS calls).
    pub kernel: String,
    /// The op with its constant attributes.
    pub op: Op,
    pub args: Vec<Operand>,
    pub results: Vec<Operand>,
    /// BLAS workspace this op may use (GEMMs only; 0 otherwise).
    pub workspace_bytes: u64,
    /// How the op executes on the plan's target, decided at compile time.
    pub lowering: Lowering,
    /// Arena bytes the op's kernels use as scratch (attention partials and
    /// their (max, sum) pairs), live only during this op; `None` when it
    /// needs none (always on `Target::Cpu`).
    pub scratch: Option<BufRef>,
    /// The op's own completion counters in [`Region::Counters`]; `None`
    /// when it uses none.
    pub counters: Option<BufRef>,
}

impl PlanOp {
    /// Bit `i` set when argument `i` (of the first 32) is a weight: bytes
    /// that never change while a plan is loaded, so a kernel may start
    /// reading them before the ops it depends on have finished.
    pub fn weight_args(&self) -> u32 {
        self.args
            .iter()
            .take(32)
            .enumerate()
            .filter(|(_, a)| matches!(a.buf.region, Region::Weight(_)))
            .fold(0, |m, (i, _)| m | 1 << i)
    }
}

/// A GEMM `out[t, n] = x[t, k] @ w[n, k]^T (+ bias[n])` over row-major
/// operands: the one description of a matmul shape that the compiler's
/// workspace model, the kernel catalog and every backend's BLAS path share.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GemmShape {
    pub t: u32,
    pub n: u32,
    pub k: u32,
    /// dtype of x, w and bias.
    pub dtype: DType,
    /// dtype of the result.
    pub out: DType,
    pub bias: bool,
}

/// One kernel parameter as the plan states it: a planned buffer's address
/// or a constant. Nothing that changes from step to step is ever a
/// constant here (token ids, positions, slots, block tables and context
/// lengths are buffers).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum LaunchParam {
    /// Device address of `offset` bytes into a region (an operand, the op's
    /// planned scratch, its completion counters).
    Buf(BufRef),
    /// A null device pointer (an absent optional operand).
    Null,
    I32(i32),
    I64(i64),
    F32(f32),
    /// A by-value struct, laid out as the kernel declares it.
    Blob(Vec<u8>),
}

impl LaunchParam {
    /// Bytes of the parameter as the kernel receives it.
    pub fn size(&self) -> usize {
        match self {
            LaunchParam::Buf(_) | LaunchParam::Null | LaunchParam::I64(_) => 8,
            LaunchParam::I32(_) | LaunchParam::F32(_) => 4,
            LaunchParam::Blob(b) => b.len(),
        }
    }
}

/// One kernel launch, decided by `kiln compile`: the runtime resolves the
/// buffer parameters to addresses and launches it as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelLaunch {
    /// Kernel image (module) name.
    pub module: String,
    /// Entry point (symbol) in that module.
    pub entry: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Dynamic shared memory bytes.
    pub shared_bytes: u32,
    pub params: Vec<LaunchParam>,
    /// Launched with the programmatic-dependent-launch attribute (the
    /// kernel may start before its predecessor finishes and waits for it
    /// with `griddepcontrol.wait` before reading its outputs).
    pub pdl: bool,
    /// Blocks per thread-block cluster along x (CUDA sm_90 and later; 1:
    /// no cluster). The blocks of a cluster run at once on one GPC and read
    /// each other's shared memory (attention combines its context
    /// partitions so). At most [`MAX_CLUSTER`], a power of two dividing
    /// `grid[0]`; above 8 the runtime allows the non-portable size.
    pub cluster: u32,
}

/// The largest thread-block cluster a plan may ask for (sm_90's
/// non-portable limit).
pub const MAX_CLUSTER: u32 = 16;

/// How one planned op executes on the plan's target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Lowering {
    /// `Target::Cpu`: the reference kernel for `PlanOp::op` over its operands.
    Reference,
    /// Kernel launches in stream order.
    Kernels(Vec<KernelLaunch>),
    /// A collective over the plan's ranks (`all_reduce`, `sharded_argmax`)
    /// on a GPU target: the collective library's call (NCCL) on the rank's
    /// stream over `PlanOp::args` / `results`, captured into the graph.
    Collective,
    /// A GEMM, run as `kind` (decided at compile time: the target's default
    /// rule or a `kiln tune` table; see `kiln_kernels::gpu::choose_gemm`).
    /// `kernel` is the launch of kiln's kernel for `Gemv` and `Skinny`
    /// (module `gemv` / `skinny`) and `None` for `Blas`: one BLAS-Lt call
    /// over the op's operands and the planned workspace. The runtime runs
    /// what is recorded here and times nothing.
    Gemm {
        shape: GemmShape,
        kind: GemmKind,
        kernel: Option<KernelLaunch>,
    },
}

/// Which implementation runs a GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum GemmKind {
    /// kiln's FMA GEMV (`gemv.cu`): T <= 8, one warp per row pair.
    Gemv,
    /// kiln's tensor-core skinny GEMM (`skinny.cu`): T <= 32, each weight
    /// byte read once.
    Skinny,
    /// The vendor BLAS-Lt library (cuBLASLt / hipBLASLt).
    Blas,
}

impl GemmKind {
    pub const ALL: [GemmKind; 3] = [GemmKind::Gemv, GemmKind::Skinny, GemmKind::Blas];

    /// The name used in plans' text, tuning tables and `kiln bench` JSON.
    pub fn name(self) -> &'static str {
        match self {
            GemmKind::Gemv => "gemv",
            GemmKind::Skinny => "skinny",
            GemmKind::Blas => "blas",
        }
    }

    /// The kernel module a kiln-kernel kind launches (`None` for `Blas`).
    pub fn module(self) -> Option<&'static str> {
        match self {
            GemmKind::Gemv => Some("gemv"),
            GemmKind::Skinny => Some("skinny"),
            GemmKind::Blas => None,
        }
    }
}

impl fmt::Display for GemmKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for GemmKind {
    type Err = String;
    fn from_str(s: &str) -> Result<GemmKind, String> {
        GemmKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                format!("unknown GEMM implementation `{s}`: expected gemv, skinny or blas")
            })
    }
}

impl Lowering {
    /// Kernels (or library calls) this op costs per step.
    pub fn launches(&self) -> u32 {
        match self {
            Lowering::Reference | Lowering::Gemm { .. } | Lowering::Collective => 1,
            Lowering::Kernels(k) => k.len() as u32,
        }
    }
}

/// Placement and lifetime of one value in a key's plan (the memory map).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BufferPlan {
    pub value: ValueId,
    pub buf: BufRef,
    /// Index in `ops` of the op defining it (`None` for inputs and weights).
    pub first_use: Option<u32>,
    /// Index in `ops` of the last op reading it (`None` if never read by an op).
    pub last_use: Option<u32>,
}

/// Everything one shape key needs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KeyPlan {
    pub key: Key,
    /// The graph after passes (what `kiln inspect` prints).
    pub graph: Graph,
    pub ops: Vec<PlanOp>,
    pub buffers: Vec<BufferPlan>,
    /// Staging inputs, in the Io region.
    pub inputs: Vec<(InputRole, BufRef)>,
    /// Named outputs, in the Io region.
    pub outputs: Vec<(String, Operand)>,
    /// Size of this key's Io region.
    pub io_bytes: u64,
    /// Planned arena high-water mark.
    pub arena_peak: u64,
    /// Largest set of simultaneously live arena bytes (aligned sizes).
    pub arena_lower_bound: u64,
    /// Largest workspace any GEMM of this key needs.
    pub workspace_bytes: u64,
    /// Kernels (and library calls) one step launches: the sum of the ops'
    /// [`Lowering::launches`].
    pub launches: u32,
    pub flops: u64,
    /// Bytes the step must move (weights + KV read + activations).
    pub bytes_moved: u64,
    /// How the step runs: the launch list as a graph (the default), or a
    /// megakernel's task tape (`kiln compile --schedule megakernel`).
    #[serde(default)]
    pub schedule: crate::schedule::Schedule,
}

/// How a kernel image is stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ImageKind {
    /// NVRTC-compiled cubin for `Target::Cuda`.
    Cubin,
    /// HIP code object for `Target::Hip`.
    CodeObject,
    /// Source compiled at load (HIP without an offline compiler), cached by hash.
    Source,
}

/// A compiled kernel module.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelImage {
    /// Module name.
    pub name: String,
    pub kind: ImageKind,
    pub code: Vec<u8>,
}

/// A whole plan artifact.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub meta: ModelMeta,
    pub manifest: WeightManifest,
    pub kv: KvLayout,
    /// Arena bytes: the maximum of the keys' peaks.
    pub arena_bytes: u64,
    /// BLAS workspace bytes: the maximum over keys; grown before any capture.
    pub workspace_bytes: u64,
    /// Bytes of [`Region::Counters`]: the most any key's ops use together
    /// (keys never run concurrently, so they share it).
    pub counter_bytes: u64,
    pub keys: Vec<KeyPlan>,
    /// Empty for `Target::Cpu`.
    pub kernels: Vec<KernelImage>,
    /// The kernel ABI fingerprint (`kiln_kernels::gpu::kernel_abi`) the
    /// images were compiled under; 0 for `Target::Cpu`. A runtime with other
    /// kernels refuses the plan as stale.
    pub kernel_abi: u64,
    /// Ranks of a tensor-parallel plan (`kiln compile --tp N`; 1 otherwise).
    /// One program serves every rank (SPMD): the keys, the KV layout (each
    /// rank's own heads) and the memory plan are each rank's, the same for
    /// all; [`crate::WeightSource::Sharded`] entries give each rank its
    /// slice at load; collectives (`all_reduce`, `sharded_argmax`) take the
    /// rank from the runtime.
    pub tp: u32,
}

impl KeyPlan {
    /// How many of this key's GEMMs run as each implementation, in
    /// [`GemmKind::ALL`] order (`Reference` lowerings count as none).
    pub fn gemm_kinds(&self) -> [(GemmKind, u32); 3] {
        GemmKind::ALL.map(|kind| {
            let n = self
                .ops
                .iter()
                .filter(|op| matches!(&op.lowering, Lowering::Gemm { kind: k, .. } if *k == kind))
                .count() as u32;
            (kind, n)
        })
    }
}

impl Plan {
    pub fn key_plan(&self, key: Key) -> Option<&KeyPlan> {
        self.keys.iter().find(|k| k.key == key)
    }

    /// The device memory the runtime allocates for this plan, region by
    /// region (saturating: a damaged plan's figure is huge, not wrapped).
    /// Kernel images, the driver's context and library handles are not in
    /// it: they are the headroom a device needs beyond these bytes.
    pub fn device_memory(&self) -> DeviceMemory {
        let weights = self
            .manifest
            .entries
            .iter()
            .map(|e| e.shape.numel().saturating_mul(e.dtype.size() as u64))
            .fold(0u64, u64::saturating_add);
        let kv_cache = self
            .kv
            .cache_bytes()
            .saturating_mul(2)
            .saturating_mul(self.kv.layers as u64);
        let staging = self
            .keys
            .iter()
            .map(|k| k.io_bytes.max(1))
            .fold(0u64, u64::saturating_add);
        DeviceMemory {
            weights,
            kv_cache,
            arena: self.arena_bytes,
            workspace: self.workspace_bytes,
            counters: self.counter_bytes,
            staging,
        }
    }
}

/// [`Plan::device_memory`]: bytes per region.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    pub weights: u64,
    /// K and V of every layer.
    pub kv_cache: u64,
    pub arena: u64,
    pub workspace: u64,
    pub counters: u64,
    /// Every key's Io region (staging inputs and outputs).
    pub staging: u64,
}

impl DeviceMemory {
    pub fn total(&self) -> u64 {
        [
            self.weights,
            self.kv_cache,
            self.arena,
            self.workspace,
            self.counters,
            self.staging,
        ]
        .into_iter()
        .fold(0, u64::saturating_add)
    }
}

impl fmt::Display for DeviceMemory {
    /// `1234567 bytes (weights 1000000, KV cache 200000, ...)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bytes (weights {}, KV cache {}, arena {}, BLAS workspace {}, counters {}, staging {})",
            self.total(),
            self.weights,
            self.kv_cache,
            self.arena,
            self.workspace,
            self.counters,
            self.staging
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_args_marks_exactly_the_operands_in_weight_regions() {
        let operand = |region| Operand {
            buf: BufRef {
                region,
                offset: 0,
                bytes: 16,
            },
            ty: TensorType::new(DType::BF16, vec![8]),
        };
        let op = PlanOp {
            node: NodeId(0),
            kernel: "gemm".into(),
            op: Op::MatMul {
                bias: true,
                out: DType::BF16,
            },
            args: vec![
                operand(Region::Arena),
                operand(Region::Weight(3)),
                operand(Region::Weight(0)),
            ],
            results: vec![operand(Region::Io)],
            workspace_bytes: 0,
            lowering: Lowering::Reference,
            scratch: None,
            counters: None,
        };
        assert_eq!(op.weight_args(), 0b110);
        let activations_only = PlanOp {
            args: vec![operand(Region::Arena), operand(Region::KCache(0))],
            ..op
        };
        assert_eq!(activations_only.weight_args(), 0);
    }
}
