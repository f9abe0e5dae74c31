//! The Backend seam: the one trait every execution target implements.
//!
//! The engine drives a backend through allocate (before capture only),
//! upload, launch, copies, synchronize, begin/end capture, replay and
//! destroy. The capture contract (DESIGN.md) is enforced by each backend:
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
}
