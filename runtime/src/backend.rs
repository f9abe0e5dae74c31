//! The Backend seam: the one trait every execution target implements.
//!
//! The engine drives a backend through allocate (before capture only),
//! upload, launch, copies, synchronize, begin/end capture, replay and
//! destroy. The capture contract (ARCHITECTURE.md) is enforced by each backend:
//! inside a capture region, `alloc`, `free`, `synchronize` and `download` are
//! errors naming the key being captured and the offending call.
//!
//! Device memory is addressed by [`DevPtr`], an opaque 64-bit address that the
//! backend hands out from `alloc`. On CUDA/HIP it is the device pointer; on
//! the CPU backend it is an address in an emulated space, so a recorded call
//! reads memory at that address when it is replayed, exactly as a GPU graph
//! would.

use kiln_ir::plan::KernelImage;
use kiln_ir::{Key, Op, TensorType};

/// A device address (base of an allocation plus an offset).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevPtr(pub u64);

impl DevPtr {
    pub fn offset(self, bytes: u64) -> DevPtr {
        DevPtr(self.0 + bytes)
    }
}

/// An operand resolved to a device address.
#[derive(Clone, Debug, PartialEq)]
pub struct DevOperand {
    pub ptr: DevPtr,
    pub ty: TensorType,
}

/// One op ready to launch: constants from the plan, operands resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    pub kernel: String,
    pub op: Op,
    pub args: Vec<DevOperand>,
    pub results: Vec<DevOperand>,
    /// Workspace the op may use (GEMMs), already allocated.
    pub workspace: Option<(DevPtr, u64)>,
    /// Bit `i` set: argument `i` is a weight, whose bytes never change
    /// while the engine lives, so a kernel may start reading it before the
    /// ops it depends on have finished (the CUDA GEMV prefetches it then).
    /// 0 is always safe.
    pub const_args: u32,
    /// How the op executes, as the plan lowered it, with every buffer
    /// parameter resolved to an address. The backend launches it as
    /// written; it never lowers an op itself.
    pub body: LaunchBody,
}

/// The resolved form of [`kiln_ir::plan::Lowering`].
#[derive(Clone, Debug, PartialEq)]
pub enum LaunchBody {
    /// The CPU reference kernel for `Launch::op` over `args` / `results`.
    Reference,
    /// Kernel launches in stream order.
    Kernels(Vec<ResolvedKernel>),
    /// A collective over the plan's ranks (`all_reduce`): the collective
    /// library's call on the rank's stream over `args` / `results`.
    Collective,
    /// A GEMM over `args` (x, w, bias) and `results[0]`, run as the plan's
    /// `kind` decided it: one BLAS-Lt call with `Launch::workspace`
    /// (`Blas`, `kernel` is `None`) or kiln's `kernel` (`Gemv`, `Skinny`).
    Gemm {
        shape: kiln_ir::plan::GemmShape,
        kind: kiln_ir::plan::GemmKind,
        kernel: Option<ResolvedKernel>,
    },
    /// A key's whole step as one persistent kernel walking its tape
    /// (`kiln_ir::schedule::Tape`): `reset` zeroes the tape's counters,
    /// then `run` launches one block per queue. Every block of `run` must be
    /// co-resident (a block spins on counters other blocks bump), so the
    /// backend checks at `prepare` that the device holds `run.grid[0]`
    /// blocks at once, `blocks_per_sm` on each SM, and refuses the plan
    /// otherwise. `Launch::op` is the key's first op (for messages only).
    Megakernel {
        reset: ResolvedKernel,
        run: ResolvedKernel,
        blocks_per_sm: u32,
    },
}

/// A kernel launch with its parameters resolved to addresses.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedKernel {
    pub module: String,
    pub entry: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
    pub params: Vec<ResolvedParam>,
    pub pdl: bool,
    /// Blocks per thread-block cluster along x (1: none; see
    /// `KernelLaunch::cluster`).
    pub cluster: u32,
}

/// One resolved kernel parameter.
#[derive(Clone, Debug, PartialEq)]
pub enum ResolvedParam {
    Ptr(DevPtr),
    I32(i32),
    I64(i64),
    F32(f32),
    Blob(Vec<u8>),
}

impl ResolvedKernel {
    /// The parameters packed as the kernel ABI lays them out (each value at
    /// its natural alignment), with each parameter's byte
    /// offset: the one packing both GPU drivers use. By-value structs
    /// (blobs) are 4-aligned: the kernels' structs hold 32-bit fields only.
    pub fn pack(&self) -> (Vec<u8>, Vec<usize>) {
        let mut buf = Vec::new();
        let mut offsets = Vec::with_capacity(self.params.len());
        for p in &self.params {
            let (align, bytes): (usize, Vec<u8>) = match p {
                ResolvedParam::Ptr(d) => (8, d.0.to_ne_bytes().to_vec()),
                ResolvedParam::I64(v) => (8, v.to_ne_bytes().to_vec()),
                ResolvedParam::I32(v) => (4, v.to_ne_bytes().to_vec()),
                ResolvedParam::F32(v) => (4, v.to_ne_bytes().to_vec()),
                ResolvedParam::Blob(b) => (4, b.clone()),
            };
            let at = buf.len().div_ceil(align) * align;
            buf.resize(at, 0);
            offsets.push(at);
            buf.extend_from_slice(&bytes);
        }
        (buf, offsets)
    }
}

/// A captured, instantiated graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphHandle(pub u32);

/// Facts about the executing device that the graph policy decides on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// `cpu`, `cuda`, `hip`.
    pub backend: &'static str,
    /// Device ordinal the backend executes on.
    pub ordinal: u32,
    /// Human-readable name (e.g. `NVIDIA H200`).
    pub name: String,
    /// Architecture (`sm_90`, `gfx1100`, `x86_64`).
    pub arch: String,
}

/// Backend errors. Every message names what broke and, where there is one,
/// the fix.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("capture contract broken while capturing key {key}: `{call}` is not allowed inside a capture region ({why})")]
    CaptureContract { key: Key, call: String, why: String },
    #[error("capture of key {key} failed at op `{op}`: {message}")]
    CaptureFailed {
        key: Key,
        op: String,
        message: String,
    },
    #[error("out of device memory allocating {bytes} bytes for {what}")]
    OutOfMemory { bytes: u64, what: String },
    #[error("invalid device address {0:#x}: not inside any live allocation")]
    BadAddress(u64),
    #[error("GEMM algorithm for {what} needs {needed} bytes of workspace but the plan grants {granted}; recompile the plan for this device/library (kiln compile --target ...)")]
    WorkspaceTooSmall {
        what: String,
        needed: u64,
        granted: u64,
    },
    #[error("kernel `{0}` is not in the plan's kernel images; recompile the plan for this target")]
    MissingKernel(String),
    #[error("{0}")]
    Device(String),
}

pub type Result<T> = std::result::Result<T, BackendError>;

/// The seam between the engine and an execution target.
pub trait Backend {
    fn info(&self) -> DeviceInfo;
    /// Allocates `bytes` (zeroed). Error inside a capture.
    fn alloc(&mut self, bytes: u64, what: &str) -> Result<DevPtr>;
    /// Bytes this backend could allocate now, when it can tell: the
    /// engine refuses a plan that needs more before allocating anything.
    /// `None` (the default) is unknown, and nothing is checked.
    fn free_memory(&mut self) -> Result<Option<u64>> {
        Ok(None)
    }
    /// Frees an allocation. Error inside a capture.
    fn free(&mut self, ptr: DevPtr) -> Result<()>;
    /// Host to device copy; stream-ordered. Allowed inside a capture only as a
    /// recorded copy from memory that stays valid (backends may refuse).
    fn upload(&mut self, dst: DevPtr, data: &[u8]) -> Result<()>;
    /// Device to host copy; synchronizes. Error inside a capture.
    fn download(&mut self, src: DevPtr, out: &mut [u8]) -> Result<()>;
    /// Loads the plan's kernel modules (no-op on CPU). Before capture.
    fn load_kernels(&mut self, images: &[KernelImage]) -> Result<()>;
    /// Grows the BLAS workspace to exactly the planned figure. Before capture.
    fn reserve_workspace(&mut self, bytes: u64) -> Result<Option<(DevPtr, u64)>>;
    /// Checks, before capture, that the GEMM of `launch` fits its workspace
    /// (selecting and caching its algorithm). Error names the GEMM.
    fn prepare(&mut self, launch: &Launch) -> Result<()>;
    /// Launches one op (recorded when capturing).
    fn launch(&mut self, launch: &Launch) -> Result<()>;
    /// Waits for all work. Error inside a capture.
    fn synchronize(&mut self) -> Result<()>;
    fn begin_capture(&mut self, key: Key) -> Result<()>;
    fn end_capture(&mut self) -> Result<GraphHandle>;
    /// Leaves a capture region after an error inside it, discarding what was
    /// recorded, so the backend is usable (eagerly) again. The default ends the
    /// capture and destroys the partial graph; backends whose `end_capture`
    /// cannot succeed after a failed call override it.
    fn abort_capture(&mut self) -> Result<()> {
        let graph = self.end_capture()?;
        self.destroy_graph(graph)
    }
    fn replay(&mut self, graph: GraphHandle) -> Result<()>;
    /// Destroys a graph executable (synchronizing first).
    fn destroy_graph(&mut self, graph: GraphHandle) -> Result<()>;

    /// Records a timing mark in stream order (GPU backends: an event; the
    /// default: the host clock once all queued work is done). Not allowed
    /// inside a capture. Benchmarks time steps between two marks.
    fn mark(&mut self) -> Result<TimingMark> {
        self.synchronize()?;
        Ok(TimingMark::host_now())
    }
    /// Milliseconds between two marks (waits for the later one).
    fn elapsed_ms(&mut self, from: TimingMark, to: TimingMark) -> Result<f32> {
        self.synchronize()?;
        Ok(to.host_ns.saturating_sub(from.host_ns) as f32 / 1e6)
    }
    /// Measured memory bandwidth in bytes moved per second over a buffer of
    /// `bytes` (the HBM floor's denominator): on a GPU a device-to-device
    /// copy, bytes read plus written; on the CPU the kernels' threads'
    /// read stream; `None` where the backend has nothing to measure.
    fn copy_bandwidth(&mut self, bytes: u64, reps: u32) -> Result<Option<f64>> {
        let _ = (bytes, reps);
        Ok(None)
    }

    // Tensor parallelism (`crate::tp`): a backend driving several ranks
    // says how many; everything else it broadcasts to every rank.
    /// Ranks this backend drives (1 for a single device).
    fn ranks(&self) -> u32 {
        1
    }
    /// Nanoseconds each rank has spent inside collectives so far (waiting
    /// for the other ranks included), rank `r` at index `r`; `None` (the
    /// default) where there are none or the backend cannot tell.
    fn collective_ns(&self) -> Option<Vec<u64>> {
        None
    }
    /// Host to device copy into rank `rank`'s memory only (a weight
    /// shard); `dst` as for [`Backend::upload`]. Before capture.
    fn upload_rank(&mut self, rank: u32, dst: DevPtr, data: &[u8]) -> Result<()> {
        if rank == 0 {
            self.upload(dst, data)
        } else {
            Err(BackendError::Device(format!(
                "rank {rank} does not exist on a single-device backend; load tensor-parallel plans on a tp backend (one device per rank)"
            )))
        }
    }
    /// Device to host copy from rank `rank`'s memory; see
    /// [`Backend::download`].
    fn download_rank(&mut self, rank: u32, src: DevPtr, out: &mut [u8]) -> Result<()> {
        if rank == 0 {
            self.download(src, out)
        } else {
            self.upload_rank(rank, src, &[])
        }
    }
}

/// A point in a backend's stream, for timing. `event` is a backend handle
/// (GPU event) when the backend records one; `host_ns` is the host clock
/// (nanoseconds since the first mark of the process) otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimingMark {
    pub host_ns: u64,
    pub event: Option<u64>,
}

impl TimingMark {
    /// A host-clock mark taken now.
    pub fn host_now() -> TimingMark {
        static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        let epoch = *EPOCH.get_or_init(std::time::Instant::now);
        TimingMark {
            host_ns: epoch.elapsed().as_nanos() as u64,
            event: None,
        }
    }
}
