//! The seam between the GPU backend's logic and a vendor's libraries.
//!
//! [`GpuDriver`] is every call [`crate::gpu::GpuBackend`] makes into a GPU
//! runtime and its BLAS-Lt library, at the granularity the backend needs:
//! streams, memory, copies, modules, kernel launch (with the programmatic
//! dependent launch flag), stream capture, graph instantiate/replay/destroy,
//! events, and the BLAS-Lt handle, heuristic query and matmul. CUDA (cudarc)
//! and HIP (hip-sys) implement it for real devices; [`crate::gpu::sim`]
//! simulates a device in host memory in either vendor's flavour, so the
//! backend's orchestration is tested in CI without a GPU.
//!
//! Handles (streams, modules, functions, graphs, executables, events, BLAS
//! handles) are opaque `u64`s: real drivers store pointers in them.
//!
//! Not here: any policy or bookkeeping (the backend), parameter packing
//! (`ResolvedKernel::pack`, the one packing), or vendor-only extras such as
//! HIP's runtime compilation and code-object cache (the HIP driver does
//! those inside `module_load`).

use crate::backend::{BackendError, DevPtr};
use kiln_ir::plan::{GemmShape, ImageKind, KernelImage};

/// An opaque driver handle.
pub type Handle = u64;

/// Which vendor's API a driver speaks: names the calls in messages and says
/// which kernel images a plan for it carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Vendor {
    Cuda,
    Hip,
}

impl Vendor {
    /// `cuda` / `hip`: [`crate::backend::DeviceInfo::backend`].
    pub fn backend_name(self) -> &'static str {
        match self {
            Vendor::Cuda => "cuda",
            Vendor::Hip => "hip",
        }
    }

    /// Whether a plan for this vendor may carry images of `kind`.
    pub fn loads(self, kind: &ImageKind) -> bool {
        match self {
            Vendor::Cuda => *kind == ImageKind::Cubin,
            Vendor::Hip => matches!(kind, ImageKind::CodeObject | ImageKind::Source),
        }
    }

    /// The `kiln compile --target` value for a device of architecture `arch`.
    pub fn target(self, arch: &str) -> String {
        format!("{}:{arch}", self.backend_name())
    }
}

/// What kind of failure a driver call reported, as far as the backend acts
/// on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The device is out of memory.
    OutOfMemory,
    /// A module has no code for this device (or is not a module at all).
    NoBinaryForDevice,
    /// Anything else.
    Other,
}

/// A failed driver call: its kind, the vendor's code and description.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverError {
    pub kind: ErrorKind,
    pub code: i32,
    /// `cudaErrorX (code): text` / `hipErrorX (code): text`.
    pub description: String,
}

impl DriverError {
    pub fn other(code: i32, description: impl Into<String>) -> DriverError {
        DriverError {
            kind: ErrorKind::Other,
            code,
            description: description.into(),
        }
    }

    /// The error as a backend error, naming the call.
    pub fn during(self, call: &str) -> BackendError {
        BackendError::Device(format!("{call} failed: {}", self.description))
    }
}

pub type DriverResult<T> = std::result::Result<T, DriverError>;

/// Grid, block and dynamic shared memory of one kernel launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
    /// Blocks per thread-block cluster along x (1: none).
    pub cluster: u32,
}

/// The device the backend runs on, as the driver reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceProps {
    pub name: String,
    /// What plans target: `sm_90`, `gfx90a`.
    pub arch: String,
    /// Streaming multiprocessors / compute units.
    pub multiprocessors: u32,
    /// Whether launches may carry the programmatic-dependent-launch
    /// attribute (CUDA sm_90+).
    pub pdl: bool,
}

/// Operand addresses of one GEMM `out[t, n] = x[t, k] @ w[n, k]^T (+ bias)`,
/// row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmOperands {
    pub x: DevPtr,
    pub w: DevPtr,
    pub bias: Option<DevPtr>,
    pub out: DevPtr,
}

/// One algorithm a BLAS-Lt heuristic proposed for a GEMM shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlasAlgorithm {
    /// Driver handle of the algorithm (valid until `blas_destroy`).
    pub id: Handle,
    /// Workspace bytes the algorithm needs.
    pub workspace: u64,
}

/// Every call the GPU backend makes into a vendor's runtime and BLAS-Lt.
pub trait GpuDriver {
    fn vendor(&self) -> Vendor;
    /// Devices visible (0 without a device or driver).
    fn device_count(&mut self) -> u32;
    /// Why no device is visible, for messages.
    fn no_device_reason(&mut self) -> String;
    /// Makes `ordinal` current on the calling thread.
    fn set_device(&mut self, ordinal: u32) -> DriverResult<()>;
    fn device_props(&mut self, ordinal: u32) -> Result<DeviceProps, BackendError>;

    fn stream_create(&mut self) -> DriverResult<Handle>;
    fn stream_destroy(&mut self, stream: Handle);
    fn stream_synchronize(&mut self, stream: Handle) -> DriverResult<()>;

    fn malloc(&mut self, bytes: u64) -> DriverResult<DevPtr>;
    /// Free bytes on the current device (`cuMemGetInfo`, `hipMemGetInfo`).
    fn mem_free(&mut self) -> DriverResult<u64>;
    fn free(&mut self, ptr: DevPtr) -> DriverResult<()>;
    fn memset_zero(&mut self, ptr: DevPtr, bytes: u64, stream: Handle) -> DriverResult<()>;
    /// Stream-ordered host-to-device copy; `src` may be reused once the
    /// stream is synchronized (the backend does so).
    fn copy_to_device(&mut self, dst: DevPtr, src: &[u8], stream: Handle) -> DriverResult<()>;
    /// Stream-ordered device-to-host copy (the caller synchronizes).
    fn copy_to_host(&mut self, dst: &mut [u8], src: DevPtr, stream: Handle) -> DriverResult<()>;
    /// Stream-ordered device-to-device copy.
    fn copy_device(
        &mut self,
        dst: DevPtr,
        src: DevPtr,
        bytes: u64,
        stream: Handle,
    ) -> DriverResult<()>;

    /// Loads a plan image (the backend has checked its kind is this
    /// vendor's).
    fn module_load(&mut self, image: &KernelImage) -> DriverResult<Handle>;
    fn module_unload(&mut self, module: Handle);
    /// The function `name` in `module`, if it defines one.
    fn function(&mut self, module: Handle, name: &str) -> Option<Handle>;
    /// Launches `function` with parameters packed by
    /// `ResolvedKernel::pack` (`params`, and each one's byte `offsets`);
    /// `pdl` sets the programmatic-dependent-launch attribute.
    fn launch_kernel(
        &mut self,
        function: Handle,
        dims: Dims,
        pdl: bool,
        params: &[u8],
        offsets: &[usize],
        stream: Handle,
    ) -> DriverResult<()>;

    /// How many blocks of `function` one SM holds at once with
    /// `block_threads` threads and `shared_bytes` of dynamic shared memory
    /// (`cuOccupancyMaxActiveBlocksPerMultiprocessor`): what a persistent
    /// kernel's co-residency is checked against. A driver that cannot say
    /// refuses, and so does every persistent launch on it.
    fn occupancy(
        &mut self,
        function: Handle,
        block_threads: u32,
        shared_bytes: u32,
    ) -> DriverResult<u32> {
        let _ = (function, block_threads, shared_bytes);
        Err(DriverError::other(
            -1,
            "this driver cannot report occupancy, so it runs no persistent (megakernel) launch; compile with --schedule graph",
        ))
    }

    /// Lets `function` launch with up to `want` bytes of dynamic shared
    /// memory, as far as the device allows beyond the function's static
    /// shared memory (CUDA: `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`
    /// against `CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`),
    /// and returns what it granted. Launches with more than the grant fail.
    /// The default grants nothing: a driver without the query launches
    /// every kernel without dynamic shared memory beyond what its plan
    /// launches already use.
    fn allow_dynamic_shared(&mut self, function: Handle, want: u32) -> DriverResult<u32> {
        let _ = (function, want);
        Ok(0)
    }

    /// Begins a global-mode stream capture.
    fn begin_capture(&mut self, stream: Handle) -> DriverResult<()>;
    /// Ends the capture and returns its graph. On error the stream is no
    /// longer capturing and any partial graph is destroyed.
    fn end_capture(&mut self, stream: Handle) -> DriverResult<Handle>;
    /// Instantiates a graph; the error carries the instantiation log.
    fn instantiate(&mut self, graph: Handle) -> DriverResult<Handle>;
    fn graph_launch(&mut self, exec: Handle, stream: Handle) -> DriverResult<()>;
    fn exec_destroy(&mut self, exec: Handle) -> DriverResult<()>;
    fn graph_destroy(&mut self, graph: Handle) -> DriverResult<()>;
    /// Clears a sticky error left by a failed call.
    fn clear_error(&mut self);

    fn event_create(&mut self) -> DriverResult<Handle>;
    fn event_record(&mut self, event: Handle, stream: Handle) -> DriverResult<()>;
    /// Milliseconds between two recorded events (waits for `to`).
    fn event_elapsed_ms(&mut self, from: Handle, to: Handle) -> DriverResult<f32>;
    fn event_destroy(&mut self, event: Handle);

    /// Creates the BLAS-Lt handle.
    fn blas_create(&mut self) -> DriverResult<Handle>;
    /// The heuristic's algorithms for `shape`, best first, asked with a
    /// maximum-workspace preference of `max_workspace` bytes (a library may
    /// still propose more; the backend checks each requirement).
    fn blas_algorithms(
        &mut self,
        blas: Handle,
        shape: &GemmShape,
        max_workspace: u64,
    ) -> DriverResult<Vec<BlasAlgorithm>>;
    /// Runs one GEMM with a chosen algorithm.
    fn blas_matmul(
        &mut self,
        blas: Handle,
        shape: &GemmShape,
        algorithm: BlasAlgorithm,
        ops: &GemmOperands,
        workspace: Option<(DevPtr, u64)>,
        stream: Handle,
    ) -> DriverResult<()>;
    /// Releases the handle and every descriptor and algorithm made with it.
    fn blas_destroy(&mut self, blas: Handle);

    /// Enqueues the sum over every rank's `count` elements of `from` at
    /// `src` into `dst` as `to` on `stream`: the collective library's
    /// all-reduce (NCCL), capturable, then the rounding to `to`. Drivers
    /// without a communicator refuse it; the default does.
    fn all_reduce_sum(
        &mut self,
        src: DevPtr,
        dst: DevPtr,
        count: u64,
        (from, to): (kiln_ir::DType, kiln_ir::DType),
        stream: Handle,
    ) -> DriverResult<()> {
        let _ = (src, dst, count, from, to, stream);
        Err(DriverError::other(
            -1,
            "this GPU driver has no collective communicator: tensor-parallel plans need the CUDA driver with NCCL (one device per rank)",
        ))
    }

    /// Enqueues the cross-rank argmax of `rows` rows of `vocab` values of
    /// `dtype` at `src` (this rank's vocabulary slice) into `rows` i32s at
    /// `dst` on `stream`: each rank's first maximum (NaN skipped) with its
    /// global index, gathered from every rank by the collective library and
    /// reduced in rank order, a later rank winning only when strictly larger
    /// (`kiln_kernels::cpu::collective`'s rule). The default refuses.
    fn sharded_argmax(
        &mut self,
        src: DevPtr,
        dst: DevPtr,
        (rows, vocab): (u64, u64),
        dtype: kiln_ir::DType,
        stream: Handle,
    ) -> DriverResult<()> {
        let _ = (src, dst, rows, vocab, dtype, stream);
        Err(DriverError::other(
            -1,
            "this GPU driver has no collective communicator: tensor-parallel plans need the CUDA driver with NCCL (one device per rank)",
        ))
    }
}
