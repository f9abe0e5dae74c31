//! The seam between the HIP backend's logic and the HIP libraries.
//!
//! [`HipDriver`] is every call the backend makes into the HIP runtime, hiprtc
//! and hipBLASLt, at the granularity the backend needs. The real driver
//! (feature `rocm`) forwards to the libraries; tests supply a driver that
//! simulates a device in host memory and logs every call, so the backend's
//! orchestration (the capture contract, what happens before capture, the
//! teardown order) is tested in CI without an AMD GPU.
//!
//! Handles (streams, modules, functions, graphs, executables) are opaque
//! `u64`s: the real driver stores pointers in them.
//!
//! Not here: any policy or bookkeeping (the backend), or library loading
//! details (`ffi`, `rtc`, `blaslt`).

use crate::backend::{BackendError, DevPtr};
use crate::hip::catalog::PackedParams;
use crate::hip::gemm::{GemmOperands, GemmProblem};

/// An opaque driver handle.
pub type Handle = u64;

/// A failed HIP runtime call: its `hipError_t` and the runtime's description.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverError {
    pub code: i32,
    /// `hipErrorX (code): text`.
    pub description: String,
}

/// `hipErrorOutOfMemory`.
pub const ERROR_OUT_OF_MEMORY: i32 = 2;
/// `hipErrorInvalidImage`.
pub const ERROR_INVALID_IMAGE: i32 = 200;
/// `hipErrorNoBinaryForGpu`.
pub const ERROR_NO_BINARY_FOR_GPU: i32 = 209;

/// The error of a call a driver does not implement.
fn unsupported(what: &str) -> DriverError {
    DriverError {
        code: -1,
        description: format!("this HIP driver does not implement {what}"),
    }
}

impl DriverError {
    /// The error as a backend error, naming the call.
    pub fn during(self, call: &str) -> BackendError {
        BackendError::Device(format!("{call} failed: {}", self.description))
    }
}

/// Grid, block and dynamic shared memory of one kernel launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
}

/// Every call the HIP backend makes into HIP, hiprtc and hipBLASLt.
pub trait HipDriver {
    /// Devices visible (0 without a device or driver).
    fn device_count(&mut self) -> u32;
    /// Why no device is visible, for messages.
    fn no_device_reason(&mut self) -> String;
    fn set_device(&mut self, ordinal: u32) -> Result<(), DriverError>;
    fn device_name(&mut self, ordinal: u32) -> Result<String, BackendError>;
    /// The full target ID (`gfx90a:sramecc+:xnack-`).
    fn device_target_id(&mut self, ordinal: u32) -> Result<String, BackendError>;
    /// `(major.minor.patch, HIP_VERSION)`.
    fn runtime_version(&mut self) -> Result<(String, i32), BackendError>;

    fn stream_create(&mut self) -> Result<Handle, DriverError>;
    fn stream_destroy(&mut self, stream: Handle);
    fn stream_synchronize(&mut self, stream: Handle) -> Result<(), DriverError>;

    fn malloc(&mut self, bytes: u64) -> Result<DevPtr, DriverError>;
    /// Free bytes on the current device (`hipMemGetInfo`).
    fn mem_free(&mut self) -> Result<u64, DriverError>;
    fn free(&mut self, ptr: DevPtr) -> Result<(), DriverError>;
    fn memset_zero(&mut self, ptr: DevPtr, bytes: u64, stream: Handle) -> Result<(), DriverError>;
    /// Stream-ordered host-to-device copy (the caller synchronizes).
    fn copy_to_device(
        &mut self,
        dst: DevPtr,
        src: &[u8],
        stream: Handle,
    ) -> Result<(), DriverError>;
    /// Stream-ordered device-to-host copy (the caller synchronizes).
    fn copy_to_host(
        &mut self,
        dst: &mut [u8],
        src: DevPtr,
        stream: Handle,
    ) -> Result<(), DriverError>;

    fn module_load(&mut self, code: &[u8]) -> Result<Handle, DriverError>;
    fn module_unload(&mut self, module: Handle);
    /// The function `name` in `module`, if it defines one.
    fn function(&mut self, module: Handle, name: &str) -> Option<Handle>;
    fn launch_kernel(
        &mut self,
        function: Handle,
        dims: Dims,
        stream: Handle,
        params: &mut PackedParams,
    ) -> Result<(), DriverError>;

    /// Begins a global-mode stream capture.
    fn begin_capture(&mut self, stream: Handle) -> Result<(), DriverError>;
    /// Ends the capture and returns its graph. On error the stream is no
    /// longer capturing and any partial graph is destroyed.
    fn end_capture(&mut self, stream: Handle) -> Result<Handle, DriverError>;
    /// Instantiates a graph; the error carries the instantiation log.
    fn instantiate(&mut self, graph: Handle) -> Result<Handle, DriverError>;
    fn graph_launch(&mut self, exec: Handle, stream: Handle) -> Result<(), DriverError>;
    fn exec_destroy(&mut self, exec: Handle) -> Result<(), DriverError>;
    fn graph_destroy(&mut self, graph: Handle) -> Result<(), DriverError>;
    /// Clears a sticky error left by a failed call.
    fn clear_error(&mut self);

    /// Which runtime compiler this is (loads it on first use).
    fn rtc_identity(&mut self) -> Result<String, BackendError>;
    /// Compiles `source` into a code object; the error carries the log.
    fn rtc_compile(
        &mut self,
        source: &str,
        name: &str,
        options: &[String],
    ) -> Result<Vec<u8>, String>;

    /// Selects (once per problem and grant) an algorithm for `p` within
    /// `granted` workspace bytes, loading the BLAS library on first use.
    /// Returns the workspace the algorithm needs.
    fn gemm_prepare(&mut self, p: &GemmProblem, granted: u64) -> Result<u64, BackendError>;
    /// Whether `gemm_prepare(p, granted)` has succeeded.
    fn gemm_is_prepared(&self, p: &GemmProblem, granted: u64) -> bool;
    /// Runs a prepared GEMM.
    fn gemm_run(
        &mut self,
        p: &GemmProblem,
        granted: u64,
        ops: &GemmOperands,
        workspace: Option<DevPtr>,
        stream: Handle,
    ) -> Result<(), BackendError>;
    /// Stream-ordered device-to-device copy (bandwidth probes).
    fn copy_device(
        &mut self,
        dst: DevPtr,
        src: DevPtr,
        bytes: u64,
        stream: Handle,
    ) -> Result<(), DriverError> {
        let _ = (dst, src, bytes, stream);
        Err(unsupported("device-to-device copies"))
    }
    fn event_create(&mut self) -> Result<Handle, DriverError> {
        Err(unsupported("events"))
    }
    fn event_record(&mut self, event: Handle, stream: Handle) -> Result<(), DriverError> {
        let _ = (event, stream);
        Err(unsupported("events"))
    }
    /// Milliseconds between two recorded events (waits for `to`).
    fn event_elapsed_ms(&mut self, from: Handle, to: Handle) -> Result<f32, DriverError> {
        let _ = (from, to);
        Err(unsupported("events"))
    }
    fn event_destroy(&mut self, event: Handle) {
        let _ = event;
    }

    /// GEMM problems prepared.
    fn gemm_prepared_count(&self) -> usize;
    /// Releases the BLAS library's handle and descriptors (teardown, before
    /// the memory they used is freed).
    fn gemm_release(&mut self);
}
