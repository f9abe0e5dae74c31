//! The real [`HipDriver`]: the HIP runtime (linked), hiprtc and hipBLASLt
//! (loaded on first use).
//!
//! Not here: anything the backend decides; this only forwards calls and
//! turns return codes into [`DriverError`]s.

use crate::backend::{BackendError, DevPtr};
use crate::hip::blaslt::HipBlasLt;
use crate::hip::catalog::PackedParams;
use crate::hip::driver::{Dims, DriverError, Handle, HipDriver};
use crate::hip::ffi::{self, describe};
use crate::hip::gemm::{GemmOperands, GemmProblem};
use crate::hip::rtc::Hiprtc;
use std::ffi::{c_int, c_void, CString};

/// hipBLASLt's ABI kiln speaks is the one of ROCm 6.0 and later.
const MIN_HIPBLASLT_RUNTIME: i32 = 60_000_000;

/// The HIP libraries of this machine.
#[derive(Default)]
pub struct RealHip {
    rtc: Option<Hiprtc>,
    blas: Option<HipBlasLt>,
}

// SAFETY: the handles inside (hipBLASLt's handle and descriptors, loaded
// libraries) are process-wide, not bound to the creating thread; the backend
// owning this driver serialises all use through `&mut self` and binds its
// device on the calling thread before each call.
unsafe impl Send for RealHip {}

fn rc(code: ffi::HipError) -> Result<(), DriverError> {
    if code == ffi::HIP_SUCCESS {
        Ok(())
    } else {
        Err(DriverError {
            code,
            description: describe(code),
        })
    }
}

fn ptr(h: Handle) -> *mut c_void {
    h as usize as *mut c_void
}

impl RealHip {
    fn blas(&mut self) -> Result<&mut HipBlasLt, BackendError> {
        if self.blas.is_none() {
            let (text, v) = ffi::runtime_version()?;
            if v < MIN_HIPBLASLT_RUNTIME {
                return Err(BackendError::Device(format!(
                    "GEMMs need hipBLASLt from ROCm 6.0 or later; this HIP runtime is {text}"
                )));
            }
            self.blas = Some(HipBlasLt::load()?);
        }
        Ok(self.blas.as_mut().expect("loaded above"))
    }
}

impl HipDriver for RealHip {
    fn device_count(&mut self) -> u32 {
        ffi::device_count()
    }

    fn no_device_reason(&mut self) -> String {
        ffi::no_device_reason()
    }

    fn set_device(&mut self, ordinal: u32) -> Result<(), DriverError> {
        // SAFETY: plain call.
        rc(unsafe { ffi::hipSetDevice(ordinal as c_int) })
    }

    fn device_name(&mut self, ordinal: u32) -> Result<String, BackendError> {
        ffi::device_name(ordinal)
    }

    fn device_target_id(&mut self, ordinal: u32) -> Result<String, BackendError> {
        ffi::device_arch(ordinal)
    }

    fn runtime_version(&mut self) -> Result<(String, i32), BackendError> {
        ffi::runtime_version()
    }

    fn stream_create(&mut self) -> Result<Handle, DriverError> {
        let mut s: ffi::Stream = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        rc(unsafe { ffi::hipStreamCreateWithFlags(&mut s, ffi::STREAM_NON_BLOCKING) })?;
        Ok(s as Handle)
    }

    fn stream_destroy(&mut self, stream: Handle) {
        // SAFETY: a stream created by stream_create, destroyed once.
        unsafe { ffi::hipStreamDestroy(ptr(stream)) };
    }

    fn stream_synchronize(&mut self, stream: Handle) -> Result<(), DriverError> {
        // SAFETY: a live stream.
        rc(unsafe { ffi::hipStreamSynchronize(ptr(stream)) })
    }

    fn malloc(&mut self, bytes: u64) -> Result<DevPtr, DriverError> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        rc(unsafe { ffi::hipMalloc(&mut p, bytes.max(1) as usize) })?;
        Ok(DevPtr(p as u64))
    }

    fn mem_free(&mut self) -> Result<u64, DriverError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers to locals.
        rc(unsafe { ffi::hipMemGetInfo(&mut free, &mut total) })?;
        Ok(free as u64)
    }

    fn free(&mut self, p: DevPtr) -> Result<(), DriverError> {
        // SAFETY: the backend frees each allocation of malloc once.
        rc(unsafe { ffi::hipFree(ptr(p.0)) })
    }

    fn memset_zero(&mut self, p: DevPtr, bytes: u64, stream: Handle) -> Result<(), DriverError> {
        // SAFETY: `p` is an allocation of at least `bytes` bytes.
        rc(unsafe { ffi::hipMemsetAsync(ptr(p.0), 0, bytes as usize, ptr(stream)) })
    }

    fn copy_to_device(
        &mut self,
        dst: DevPtr,
        src: &[u8],
        stream: Handle,
    ) -> Result<(), DriverError> {
        // SAFETY: the backend checked the destination range; the caller
        // synchronizes before `src` is released.
        rc(unsafe {
            ffi::hipMemcpyHtoDAsync(
                ptr(dst.0),
                src.as_ptr() as *mut c_void,
                src.len(),
                ptr(stream),
            )
        })
    }

    fn copy_to_host(
        &mut self,
        dst: &mut [u8],
        src: DevPtr,
        stream: Handle,
    ) -> Result<(), DriverError> {
        // SAFETY: the backend checked the source range; the caller
        // synchronizes before `dst` is read.
        rc(unsafe {
            ffi::hipMemcpyDtoHAsync(dst.as_mut_ptr().cast(), ptr(src.0), dst.len(), ptr(stream))
        })
    }

    fn module_load(&mut self, code: &[u8]) -> Result<Handle, DriverError> {
        let mut m: ffi::Module = std::ptr::null_mut();
        // SAFETY: `code` is a complete code object, held for the call.
        rc(unsafe { ffi::hipModuleLoadData(&mut m, code.as_ptr().cast()) })?;
        Ok(m as Handle)
    }

    fn module_unload(&mut self, module: Handle) {
        // SAFETY: a loaded module, unloaded once, with no kernel running.
        unsafe { ffi::hipModuleUnload(ptr(module)) };
    }

    fn function(&mut self, module: Handle, name: &str) -> Option<Handle> {
        let cname = CString::new(name).ok()?;
        let mut f: ffi::Function = std::ptr::null_mut();
        // SAFETY: a loaded module; NUL-terminated name.
        let code = unsafe { ffi::hipModuleGetFunction(&mut f, ptr(module), cname.as_ptr()) };
        if code == ffi::HIP_SUCCESS && !f.is_null() {
            Some(f as Handle)
        } else {
            // A failed lookup leaves a sticky error on some runtimes.
            // SAFETY: plain call.
            unsafe { ffi::hipGetLastError() };
            None
        }
    }

    fn launch_kernel(
        &mut self,
        function: Handle,
        dims: Dims,
        stream: Handle,
        params: &mut PackedParams,
    ) -> Result<(), DriverError> {
        // SAFETY: `function` is a loaded kernel; `params` holds one pointer per
        // kernel parameter, valid for the call.
        rc(unsafe {
            ffi::hipModuleLaunchKernel(
                ptr(function),
                dims.grid[0],
                dims.grid[1],
                dims.grid[2],
                dims.block[0],
                dims.block[1],
                dims.block[2],
                dims.shared_bytes,
                ptr(stream),
                params.as_kernel_params(),
                std::ptr::null_mut(),
            )
        })
    }

    fn begin_capture(&mut self, stream: Handle) -> Result<(), DriverError> {
        // SAFETY: a live stream that is not capturing.
        rc(unsafe { ffi::hipStreamBeginCapture(ptr(stream), ffi::CAPTURE_MODE_GLOBAL) })
    }

    fn end_capture(&mut self, stream: Handle) -> Result<Handle, DriverError> {
        let mut g: ffi::Graph = std::ptr::null_mut();
        // SAFETY: ends the capture begun on this stream.
        let code = unsafe { ffi::hipStreamEndCapture(ptr(stream), &mut g) };
        if code == ffi::HIP_SUCCESS && !g.is_null() {
            return Ok(g as Handle);
        }
        // SAFETY: destroys a partial graph once; clears the sticky error.
        unsafe {
            if !g.is_null() {
                ffi::hipGraphDestroy(g);
            }
            ffi::hipGetLastError();
        }
        Err(DriverError {
            code,
            description: describe(code),
        })
    }

    fn instantiate(&mut self, graph: Handle) -> Result<Handle, DriverError> {
        let mut exec: ffi::GraphExec = std::ptr::null_mut();
        let mut log = vec![0u8; 4096];
        // SAFETY: a captured graph; the log buffer's size is passed.
        let code = unsafe {
            ffi::hipGraphInstantiate(
                &mut exec,
                ptr(graph),
                std::ptr::null_mut(),
                log.as_mut_ptr().cast(),
                log.len(),
            )
        };
        if code == ffi::HIP_SUCCESS {
            return Ok(exec as Handle);
        }
        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
        Err(DriverError {
            code,
            description: format!(
                "{} {}",
                describe(code),
                String::from_utf8_lossy(&log[..end])
            ),
        })
    }

    fn graph_launch(&mut self, exec: Handle, stream: Handle) -> Result<(), DriverError> {
        // SAFETY: a live executable graph and stream.
        rc(unsafe { ffi::hipGraphLaunch(ptr(exec), ptr(stream)) })
    }

    fn exec_destroy(&mut self, exec: Handle) -> Result<(), DriverError> {
        // SAFETY: destroyed once, with the stream idle.
        rc(unsafe { ffi::hipGraphExecDestroy(ptr(exec)) })
    }

    fn graph_destroy(&mut self, graph: Handle) -> Result<(), DriverError> {
        // SAFETY: destroyed once.
        rc(unsafe { ffi::hipGraphDestroy(ptr(graph)) })
    }

    fn clear_error(&mut self) {
        // SAFETY: plain call.
        unsafe { ffi::hipGetLastError() };
    }

    fn rtc_identity(&mut self) -> Result<String, BackendError> {
        if self.rtc.is_none() {
            self.rtc = Some(Hiprtc::load()?);
        }
        Ok(self
            .rtc
            .as_ref()
            .expect("loaded above")
            .identity()
            .to_string())
    }

    fn rtc_compile(
        &mut self,
        source: &str,
        name: &str,
        options: &[String],
    ) -> Result<Vec<u8>, String> {
        if self.rtc.is_none() {
            self.rtc = Some(Hiprtc::load().map_err(|e| e.to_string())?);
        }
        self.rtc
            .as_ref()
            .expect("loaded above")
            .compile(source, name, options)
    }

    fn copy_device(
        &mut self,
        dst: DevPtr,
        src: DevPtr,
        bytes: u64,
        stream: Handle,
    ) -> Result<(), DriverError> {
        // SAFETY: the backend allocated both ranges.
        rc(unsafe { ffi::hipMemcpyDtoDAsync(ptr(dst.0), ptr(src.0), bytes as usize, ptr(stream)) })
    }

    fn event_create(&mut self) -> Result<Handle, DriverError> {
        let mut e: ffi::Event = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        rc(unsafe { ffi::hipEventCreate(&mut e) })?;
        Ok(e as usize as Handle)
    }

    fn event_record(&mut self, event: Handle, stream: Handle) -> Result<(), DriverError> {
        // SAFETY: live event and stream.
        rc(unsafe { ffi::hipEventRecord(ptr(event), ptr(stream)) })
    }

    fn event_elapsed_ms(&mut self, from: Handle, to: Handle) -> Result<f32, DriverError> {
        let mut ms = 0f32;
        // SAFETY: live events; `to` is waited for first.
        unsafe {
            rc(ffi::hipEventSynchronize(ptr(to)))?;
            rc(ffi::hipEventElapsedTime(&mut ms, ptr(from), ptr(to)))?;
        }
        Ok(ms)
    }

    fn event_destroy(&mut self, event: Handle) {
        // SAFETY: a live event, destroyed once.
        unsafe { ffi::hipEventDestroy(ptr(event)) };
    }

    fn gemm_prepare(&mut self, p: &GemmProblem, granted: u64) -> Result<u64, BackendError> {
        self.blas()?.prepare(p, granted)
    }

    fn gemm_is_prepared(&self, p: &GemmProblem, granted: u64) -> bool {
        self.blas
            .as_ref()
            .is_some_and(|b| b.is_prepared(p, granted))
    }

    fn gemm_run(
        &mut self,
        p: &GemmProblem,
        granted: u64,
        ops: &GemmOperands,
        workspace: Option<DevPtr>,
        stream: Handle,
    ) -> Result<(), BackendError> {
        let blas = self.blas.as_ref().ok_or_else(|| {
            BackendError::Device(format!(
                "{} was not prepared: prepare() loads hipBLASLt and selects the algorithm before any capture",
                p.describe()
            ))
        })?;
        // SAFETY: the backend resolved the operands against live allocations
        // and checked the workspace grant; the stream is the backend's.
        unsafe { blas.matmul(p, granted, ops, workspace, ptr(stream)) }
    }

    fn gemm_prepared_count(&self) -> usize {
        self.blas.as_ref().map_or(0, |b| b.prepared_count())
    }

    fn gemm_release(&mut self) {
        self.blas = None;
    }
}
