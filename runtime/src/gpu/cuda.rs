//! The CUDA driver (feature `cuda`): [`GpuDriver`] on the CUDA driver API and
//! cuBLASLt through cudarc's dynamically loaded bindings.
//!
//! One primary context per device, made current by `set_device` before every
//! backend call. Kernel images are the plan's cubins (no NVRTC at run time);
//! launches carry the programmatic-stream-serialization attribute when the
//! backend asks for PDL. Captures are global-mode stream captures, so the
//! driver itself also rejects an unsafe call from any thread while one is
//! open. cuBLASLt descriptors are made once per GEMM shape; the heuristic is
//! asked with the granted workspace as its maximum, and every algorithm it
//! proposes is reported with its workspace requirement for the backend to
//! check.
//!
//! Not here: any bookkeeping or policy ([`crate::gpu::GpuBackend`]).

use super::driver::{
    BlasAlgorithm, DeviceProps, Dims, DriverError, DriverResult, ErrorKind, GemmOperands,
    GpuDriver, Handle, Vendor,
};
use crate::backend::{BackendError, DevPtr};
use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys as cu;
use kiln_ir::plan::{GemmShape, KernelImage};
use kiln_ir::DType;
use std::collections::HashMap;
use std::ffi::{c_void, CString};

/// The driver's name and description of `r`.
pub fn describe(r: cu::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut desc: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: both out-pointers are valid; the driver returns static strings.
    unsafe {
        cu::cuGetErrorName(r, &mut name);
        cu::cuGetErrorString(r, &mut desc);
    }
    let s = |p: *const std::ffi::c_char| {
        if p.is_null() {
            format!("{r:?}")
        } else {
            // SAFETY: non-null pointers from the driver are NUL-terminated.
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_string_lossy()
                .into_owned()
        }
    };
    format!("{} ({})", s(name), s(desc))
}

/// True when the driver library (`libcuda.so.1`) can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: probing opens and closes the library.
    unsafe { cu::is_culib_present() }
}

/// True when cuBLASLt (`libcublasLt.so.13`) can be loaded.
pub fn cublaslt_present() -> bool {
    // SAFETY: as above.
    unsafe { lt::is_culib_present() }
}

fn err(r: cu::CUresult) -> DriverError {
    let kind = match r {
        cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY => ErrorKind::OutOfMemory,
        cu::CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU | cu::CUresult::CUDA_ERROR_INVALID_IMAGE => {
            ErrorKind::NoBinaryForDevice
        }
        _ => ErrorKind::Other,
    };
    DriverError {
        kind,
        code: r as i32,
        description: describe(r),
    }
}

fn ok(r: cu::CUresult) -> DriverResult<()> {
    if r == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(err(r))
    }
}

fn lt_ok(s: lt::cublasStatus_t, call: &str) -> DriverResult<()> {
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Ok(());
    }
    // SAFETY: cuBLASLt returns a static string for every status.
    let msg = unsafe {
        let p = lt::cublasLtGetStatusString(s);
        if p.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    Err(DriverError::other(
        s as i32,
        format!("{call}: {s:?} ({msg})"),
    ))
}

fn h<T>(p: *mut T) -> Handle {
    p as usize as Handle
}

fn p<T>(h: Handle) -> *mut T {
    h as usize as *mut T
}

fn data_type(d: DType) -> DriverResult<lt::cudaDataType> {
    Ok(match d {
        DType::BF16 => lt::cudaDataType::CUDA_R_16BF,
        DType::F16 => lt::cudaDataType::CUDA_R_16F,
        DType::F32 => lt::cudaDataType::CUDA_R_32F,
        other => {
            return Err(DriverError::other(
                -1,
                format!("cuBLASLt GEMM operands must be float, got {other}"),
            ))
        }
    })
}

/// cuBLASLt descriptors of one GEMM shape.
struct Descriptors {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    d: lt::cublasLtMatrixLayout_t,
}

impl Descriptors {
    /// `out[t, n] = x[t, k] @ w[n, k]^T` in column-major terms:
    /// `D[n, t] = W^T[n, k] X[k, t]`, W transposed.
    fn new(g: &GemmShape) -> DriverResult<Descriptors> {
        let (din, dout) = (data_type(g.dtype)?, data_type(g.out)?);
        let mut desc = std::ptr::null_mut();
        // SAFETY: out-pointers are valid; attribute values live across
        // each call; layouts are created before use and destroyed in drop.
        unsafe {
            lt_ok(
                lt::cublasLtMatmulDescCreate(
                    &mut desc,
                    lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    lt::cudaDataType::CUDA_R_32F,
                ),
                "cublasLtMatmulDescCreate",
            )?;
            let mut out = Descriptors {
                desc,
                a: std::ptr::null_mut(),
                b: std::ptr::null_mut(),
                d: std::ptr::null_mut(),
            };
            let set = |attr, v: *const c_void, n: usize| {
                lt_ok(
                    lt::cublasLtMatmulDescSetAttribute(desc, attr, v, n),
                    "cublasLtMatmulDescSetAttribute",
                )
            };
            let (op_t, op_n) = (1i32, 0i32);
            set(
                lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &op_t as *const i32 as *const c_void,
                4,
            )?;
            set(
                lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                &op_n as *const i32 as *const c_void,
                4,
            )?;
            if g.bias {
                let epi = lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
                set(
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    &epi as *const _ as *const c_void,
                    std::mem::size_of_val(&epi),
                )?;
                set(
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                    &din as *const _ as *const c_void,
                    std::mem::size_of_val(&din),
                )?;
            }
            let layout = |ty, rows: u32, cols: u32, ld: u32| {
                let mut l = std::ptr::null_mut();
                lt_ok(
                    lt::cublasLtMatrixLayoutCreate(&mut l, ty, rows as u64, cols as u64, ld as i64),
                    "cublasLtMatrixLayoutCreate",
                )
                .map(|_| l)
            };
            out.a = layout(din, g.k, g.n, g.k)?;
            out.b = layout(din, g.k, g.t, g.k)?;
            out.d = layout(dout, g.n, g.t, g.n)?;
            Ok(out)
        }
    }
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each handle was created by cuBLASLt (or is null) and is
        // destroyed once.
        unsafe {
            for l in [self.a, self.b, self.d] {
                if !l.is_null() {
                    lt::cublasLtMatrixLayoutDestroy(l);
                }
            }
            lt::cublasLtMatmulDescDestroy(self.desc);
        }
    }
}

/// The CUDA driver. See the module docs.
pub struct CudaDriver {
    /// Retained primary contexts, by ordinal.
    contexts: HashMap<u32, (cu::CUdevice, cu::CUcontext)>,
    descriptors: HashMap<GemmShape, Descriptors>,
    algorithms: HashMap<Handle, lt::cublasLtMatmulAlgo_t>,
    next_algorithm: Handle,
    /// Functions already allowed a non-portable cluster size.
    nonportable: std::collections::HashSet<Handle>,
}

// SAFETY: the context is made current on the calling thread by `set_device`
// before every backend call, and `&mut self` serializes use.
unsafe impl Send for CudaDriver {}

impl Default for CudaDriver {
    fn default() -> Self {
        CudaDriver {
            contexts: HashMap::new(),
            descriptors: HashMap::new(),
            algorithms: HashMap::new(),
            next_algorithm: 1,
            nonportable: std::collections::HashSet::new(),
        }
    }
}

impl CudaDriver {
    fn init() -> DriverResult<()> {
        if !driver_present() {
            return Err(DriverError::other(
                -1,
                "the CUDA driver (libcuda.so.1) was not found; the cuda backend needs an NVIDIA GPU and its driver",
            ));
        }
        // SAFETY: plain driver call.
        ok(unsafe { cu::cuInit(0) })
    }
}

impl GpuDriver for CudaDriver {
    fn vendor(&self) -> Vendor {
        Vendor::Cuda
    }

    fn device_count(&mut self) -> u32 {
        let mut n = 0;
        // SAFETY: valid out-pointer.
        match Self::init().and_then(|()| ok(unsafe { cu::cuDeviceGetCount(&mut n) })) {
            Ok(()) => n.max(0) as u32,
            Err(_) => 0,
        }
    }

    fn no_device_reason(&mut self) -> String {
        match Self::init() {
            Err(e) => e.description,
            Ok(()) => "the CUDA driver reports no device (check CUDA_VISIBLE_DEVICES)".into(),
        }
    }

    fn set_device(&mut self, ordinal: u32) -> DriverResult<()> {
        let ctx = match self.contexts.get(&ordinal) {
            Some((_, ctx)) => *ctx,
            None => {
                Self::init()?;
                let (mut dev, mut ctx) = (0, std::ptr::null_mut());
                // SAFETY: valid out-pointers; the context is released in drop.
                unsafe {
                    ok(cu::cuDeviceGet(&mut dev, ordinal as i32))?;
                    ok(cu::cuDevicePrimaryCtxRetain(&mut ctx, dev))?;
                }
                self.contexts.insert(ordinal, (dev, ctx));
                ctx
            }
        };
        // SAFETY: a retained primary context.
        ok(unsafe { cu::cuCtxSetCurrent(ctx) })
    }

    fn device_props(&mut self, ordinal: u32) -> Result<DeviceProps, BackendError> {
        let dev = self
            .contexts
            .get(&ordinal)
            .map(|(d, _)| *d)
            .ok_or_else(|| BackendError::Device(format!("CUDA device {ordinal} is not bound")))?;
        let mut name = [0i8; 256];
        // SAFETY: the buffer holds 256 bytes; the driver NUL-terminates.
        let name = unsafe {
            ok(cu::cuDeviceGetName(name.as_mut_ptr(), 255, dev))
                .map_err(|e| e.during("cuDeviceGetName"))?;
            std::ffi::CStr::from_ptr(name.as_ptr())
                .to_string_lossy()
                .into_owned()
        };
        let attr = |a| {
            let mut v = 0;
            // SAFETY: valid out-pointer.
            ok(unsafe { cu::cuDeviceGetAttribute(&mut v, a, dev) })
                .map(|_| v.max(0) as u32)
                .map_err(|e| e.during("cuDeviceGetAttribute"))
        };
        use cu::CUdevice_attribute as A;
        let major = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sms = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        Ok(DeviceProps {
            name,
            arch: format!("sm_{major}{minor}"),
            multiprocessors: sms,
            pdl: major >= 9 && std::env::var("KILN_PDL").map_or(true, |v| v != "0"),
        })
    }

    fn stream_create(&mut self) -> DriverResult<Handle> {
        let mut s = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe {
            cu::cuStreamCreate(&mut s, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(h(s))
    }

    fn stream_destroy(&mut self, stream: Handle) {
        // SAFETY: a stream this driver created, destroyed once.
        unsafe { cu::cuStreamDestroy_v2(p(stream)) };
    }

    fn stream_synchronize(&mut self, stream: Handle) -> DriverResult<()> {
        // SAFETY: a live stream.
        ok(unsafe { cu::cuStreamSynchronize(p(stream)) })
    }

    fn malloc(&mut self, bytes: u64) -> DriverResult<DevPtr> {
        let mut d = 0;
        // SAFETY: valid out-pointer.
        ok(unsafe { cu::cuMemAlloc_v2(&mut d, bytes as usize) })?;
        Ok(DevPtr(d))
    }

    fn mem_free(&mut self) -> DriverResult<u64> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; a context is current (set_device).
        ok(unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total) })?;
        Ok(free as u64)
    }

    fn free(&mut self, ptr: DevPtr) -> DriverResult<()> {
        // SAFETY: an allocation from cuMemAlloc, freed once.
        ok(unsafe { cu::cuMemFree_v2(ptr.0) })
    }

    fn memset_zero(&mut self, ptr: DevPtr, bytes: u64, stream: Handle) -> DriverResult<()> {
        // SAFETY: the backend checked the range.
        ok(unsafe { cu::cuMemsetD8Async(ptr.0, 0, bytes as usize, p(stream)) })
    }

    fn copy_to_device(&mut self, dst: DevPtr, src: &[u8], stream: Handle) -> DriverResult<()> {
        // SAFETY: `src` stays valid until the backend synchronizes.
        ok(unsafe {
            cu::cuMemcpyHtoDAsync_v2(dst.0, src.as_ptr() as *const c_void, src.len(), p(stream))
        })
    }

    fn copy_to_host(&mut self, dst: &mut [u8], src: DevPtr, stream: Handle) -> DriverResult<()> {
        // SAFETY: `dst` stays valid until the backend synchronizes.
        ok(unsafe {
            cu::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr() as *mut c_void, src.0, dst.len(), p(stream))
        })
    }

    fn copy_device(
        &mut self,
        dst: DevPtr,
        src: DevPtr,
        bytes: u64,
        stream: Handle,
    ) -> DriverResult<()> {
        // SAFETY: the backend allocated both ranges.
        ok(unsafe { cu::cuMemcpyDtoDAsync_v2(dst.0, src.0, bytes as usize, p(stream)) })
    }

    fn module_load(&mut self, image: &KernelImage) -> DriverResult<Handle> {
        let mut m = std::ptr::null_mut();
        // SAFETY: a cubin image; the driver copies it.
        ok(unsafe { cu::cuModuleLoadData(&mut m, image.code.as_ptr() as *const c_void) })?;
        Ok(h(m))
    }

    fn module_unload(&mut self, module: Handle) {
        // SAFETY: a loaded module, unloaded once.
        unsafe { cu::cuModuleUnload(p(module)) };
    }

    fn function(&mut self, module: Handle, name: &str) -> Option<Handle> {
        let c = CString::new(name).ok()?;
        let mut f = std::ptr::null_mut();
        // SAFETY: a loaded module and a NUL-terminated name.
        let r = unsafe { cu::cuModuleGetFunction(&mut f, p(module), c.as_ptr()) };
        (r == cu::CUresult::CUDA_SUCCESS).then(|| h(f))
    }

    fn occupancy(
        &mut self,
        function: Handle,
        block_threads: u32,
        shared_bytes: u32,
    ) -> DriverResult<u32> {
        let mut n: i32 = 0;
        // SAFETY: a live function handle and an out-pointer to an i32.
        ok(unsafe {
            cu::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut n,
                p(function),
                block_threads as i32,
                shared_bytes as usize,
            )
        })?;
        Ok(n.max(0) as u32)
    }

    fn allow_dynamic_shared(&mut self, function: Handle, want: u32) -> DriverResult<u32> {
        let f: cu::CUfunction = p(function);
        let mut stat = 0i32;
        // SAFETY: a live function handle and an out-pointer to an i32.
        ok(unsafe {
            cu::cuFuncGetAttribute(
                &mut stat,
                cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                f,
            )
        })?;
        let mut dev: cu::CUdevice = 0;
        // SAFETY: valid out-pointer; the context is current (bound).
        ok(unsafe { cu::cuCtxGetDevice(&mut dev) })?;
        let mut optin = 0i32;
        // SAFETY: valid out-pointer and device.
        ok(unsafe {
            cu::cuDeviceGetAttribute(
                &mut optin,
                cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                dev,
            )
        })?;
        let room = (optin.max(0) as u32).saturating_sub(stat.max(0) as u32);
        let grant = want.min(room);
        if grant > 0 {
            // SAFETY: a live function handle; the value is within the
            // device's opt-in limit (computed above).
            ok(unsafe {
                cu::cuFuncSetAttribute(
                    f,
                    cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    grant as i32,
                )
            })?;
        }
        Ok(grant)
    }

    fn launch_kernel(
        &mut self,
        function: Handle,
        dims: Dims,
        pdl: bool,
        params: &[u8],
        offsets: &[usize],
        stream: Handle,
    ) -> DriverResult<()> {
        // An 8-aligned copy of the packed parameters.
        let mut buf = vec![0u64; params.len().div_ceil(8)];
        // SAFETY: `buf` holds at least params.len() bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                params.as_ptr(),
                buf.as_mut_ptr() as *mut u8,
                params.len(),
            )
        };
        let base = buf.as_mut_ptr() as *mut u8;
        let mut ptrs: Vec<*mut c_void> = offsets
            .iter()
            // SAFETY: every offset lies inside the packed buffer.
            .map(|&o| unsafe { base.add(o) } as *mut c_void)
            .collect();
        let f: cu::CUfunction = p(function);
        // A cluster above the portable 8 blocks needs the function's
        // opt-in, set once before its first such launch.
        if dims.cluster > 8 && self.nonportable.insert(function) {
            // SAFETY: a live function handle.
            ok(unsafe {
                cu::cuFuncSetAttribute(
                    f,
                    cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                    1,
                )
            })?;
        }
        // SAFETY: the parameters were packed by `ResolvedKernel::pack` for
        // this entry point; the driver copies them before returning. With
        // PDL a kernel may start while its predecessor runs; every kiln
        // kernel waits for its predecessors before touching their outputs.
        // A cluster launch needs sm_90 (the plan's target, checked at load).
        ok(unsafe {
            if pdl || dims.cluster > 1 {
                let mut attrs: [cu::CUlaunchAttribute; 2] = std::mem::zeroed();
                let mut n = 0;
                if pdl {
                    attrs[n].id = cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                    attrs[n].value.programmaticStreamSerializationAllowed = 1;
                    n += 1;
                }
                if dims.cluster > 1 {
                    attrs[n].id = cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
                    attrs[n].value.clusterDim.x = dims.cluster;
                    attrs[n].value.clusterDim.y = 1;
                    attrs[n].value.clusterDim.z = 1;
                    n += 1;
                }
                let cfg = cu::CUlaunchConfig {
                    gridDimX: dims.grid[0],
                    gridDimY: dims.grid[1],
                    gridDimZ: dims.grid[2],
                    blockDimX: dims.block[0],
                    blockDimY: dims.block[1],
                    blockDimZ: dims.block[2],
                    sharedMemBytes: dims.shared_bytes,
                    hStream: p(stream),
                    attrs: attrs.as_mut_ptr(),
                    numAttrs: n as u32,
                };
                cu::cuLaunchKernelEx(&cfg, f, ptrs.as_mut_ptr(), std::ptr::null_mut())
            } else {
                cu::cuLaunchKernel(
                    f,
                    dims.grid[0],
                    dims.grid[1],
                    dims.grid[2],
                    dims.block[0],
                    dims.block[1],
                    dims.block[2],
                    dims.shared_bytes,
                    p(stream),
                    ptrs.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
        })
    }

    fn begin_capture(&mut self, stream: Handle) -> DriverResult<()> {
        // SAFETY: a live stream.
        ok(unsafe {
            cu::cuStreamBeginCapture_v2(
                p(stream),
                cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            )
        })
    }

    fn end_capture(&mut self, stream: Handle) -> DriverResult<Handle> {
        let mut g = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        let r = unsafe { cu::cuStreamEndCapture(p(stream), &mut g) };
        if r != cu::CUresult::CUDA_SUCCESS {
            if !g.is_null() {
                // SAFETY: a partial graph from the failed capture.
                unsafe { cu::cuGraphDestroy(g) };
            }
            return Err(err(r));
        }
        Ok(h(g))
    }

    fn instantiate(&mut self, graph: Handle) -> DriverResult<Handle> {
        let mut e = std::ptr::null_mut();
        // SAFETY: a graph from end_capture.
        ok(unsafe { cu::cuGraphInstantiateWithFlags(&mut e, p(graph), 0) })?;
        Ok(h(e))
    }

    fn graph_launch(&mut self, exec: Handle, stream: Handle) -> DriverResult<()> {
        // SAFETY: a live executable and stream.
        ok(unsafe { cu::cuGraphLaunch(p(exec), p(stream)) })
    }

    fn exec_destroy(&mut self, exec: Handle) -> DriverResult<()> {
        // SAFETY: a live executable, destroyed once, its stream idle.
        ok(unsafe { cu::cuGraphExecDestroy(p(exec)) })
    }

    fn graph_destroy(&mut self, graph: Handle) -> DriverResult<()> {
        // SAFETY: a live graph, destroyed once.
        ok(unsafe { cu::cuGraphDestroy(p(graph)) })
    }

    fn clear_error(&mut self) {
        // The driver API has no sticky error to clear outside a broken
        // context; a failed capture is fully ended by end_capture.
    }

    fn event_create(&mut self) -> DriverResult<Handle> {
        let mut e = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { cu::cuEventCreate(&mut e, 0) })?;
        Ok(h(e))
    }

    fn event_record(&mut self, event: Handle, stream: Handle) -> DriverResult<()> {
        // SAFETY: live event and stream.
        ok(unsafe { cu::cuEventRecord(p(event), p(stream)) })
    }

    fn event_elapsed_ms(&mut self, from: Handle, to: Handle) -> DriverResult<f32> {
        let mut ms = 0.0f32;
        // SAFETY: live events; `to` is waited for before reading.
        unsafe {
            ok(cu::cuEventSynchronize(p(to)))?;
            ok(cu::cuEventElapsedTime_v2(&mut ms, p(from), p(to)))?;
        }
        Ok(ms)
    }

    fn event_destroy(&mut self, event: Handle) {
        // SAFETY: a live event, destroyed once.
        unsafe { cu::cuEventDestroy_v2(p(event)) };
    }

    fn blas_create(&mut self) -> DriverResult<Handle> {
        if !cublaslt_present() {
            return Err(DriverError::other(
                -1,
                "cuBLASLt (libcublasLt.so.13) was not found: install the CUDA 13 toolkit or the `nvidia-cublas` wheel and put its lib folder on LD_LIBRARY_PATH",
            ));
        }
        let mut handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        lt_ok(unsafe { lt::cublasLtCreate(&mut handle) }, "cublasLtCreate")?;
        Ok(h(handle))
    }

    fn blas_algorithms(
        &mut self,
        blas: Handle,
        shape: &GemmShape,
        max_workspace: u64,
    ) -> DriverResult<Vec<BlasAlgorithm>> {
        if !self.descriptors.contains_key(shape) {
            self.descriptors.insert(*shape, Descriptors::new(shape)?);
        }
        let d = &self.descriptors[shape];
        let mut pref = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the preference is destroyed below.
        let found = unsafe {
            lt_ok(
                lt::cublasLtMatmulPreferenceCreate(&mut pref),
                "cublasLtMatmulPreferenceCreate",
            )?;
            let r = lt_ok(
                lt::cublasLtMatmulPreferenceSetAttribute(
                    pref,
                    lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &max_workspace as *const u64 as *const c_void,
                    8,
                ),
                "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)",
            );
            let mut results: Vec<lt::cublasLtMatmulHeuristicResult_t> =
                vec![std::mem::zeroed(); 16];
            let mut count = 0i32;
            let r = r.and_then(|()| {
                let s = lt::cublasLtMatmulAlgoGetHeuristic(
                    p(blas),
                    d.desc,
                    d.a,
                    d.b,
                    d.d,
                    d.d,
                    pref,
                    results.len() as i32,
                    results.as_mut_ptr(),
                    &mut count,
                );
                if s == lt::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED {
                    count = 0;
                    Ok(())
                } else {
                    lt_ok(s, "cublasLtMatmulAlgoGetHeuristic")
                }
            });
            lt::cublasLtMatmulPreferenceDestroy(pref);
            r?;
            results.truncate(count.max(0) as usize);
            results
        };
        let mut out = Vec::new();
        for r in found
            .iter()
            .filter(|r| r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
        {
            let id = self.next_algorithm;
            self.next_algorithm += 1;
            self.algorithms.insert(id, r.algo);
            out.push(BlasAlgorithm {
                id,
                workspace: r.workspaceSize as u64,
            });
        }
        Ok(out)
    }

    fn blas_matmul(
        &mut self,
        blas: Handle,
        shape: &GemmShape,
        algorithm: BlasAlgorithm,
        ops: &GemmOperands,
        workspace: Option<(DevPtr, u64)>,
        stream: Handle,
    ) -> DriverResult<()> {
        let missing = |what: &str| {
            DriverError::other(
                -1,
                format!("no cuBLASLt {what} for this GEMM; prepare it first"),
            )
        };
        let d = self
            .descriptors
            .get(shape)
            .ok_or_else(|| missing("descriptors"))?;
        let algo = self
            .algorithms
            .get(&algorithm.id)
            .ok_or_else(|| missing("algorithm"))?;
        let (ws, ws_bytes) = match workspace {
            Some((p, n)) if n >= algorithm.workspace => (p.0, algorithm.workspace),
            _ if algorithm.workspace == 0 => (0, 0),
            _ => {
                return Err(DriverError::other(
                    -1,
                    format!(
                        "the algorithm needs {} bytes of workspace, more than granted",
                        algorithm.workspace
                    ),
                ))
            }
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: descriptors and algorithm were made for this shape and
        // handle; the operand addresses were range-checked by the backend.
        unsafe {
            if let Some(b) = ops.bias {
                let ptr = b.0 as *const c_void;
                lt_ok(
                    lt::cublasLtMatmulDescSetAttribute(
                        d.desc,
                        lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                        &ptr as *const *const c_void as *const c_void,
                        8,
                    ),
                    "cublasLtMatmulDescSetAttribute(BIAS_POINTER)",
                )?;
            }
            lt_ok(
                lt::cublasLtMatmul(
                    p(blas),
                    d.desc,
                    &alpha as *const f32 as *const c_void,
                    ops.w.0 as *const c_void,
                    d.a,
                    ops.x.0 as *const c_void,
                    d.b,
                    &beta as *const f32 as *const c_void,
                    ops.out.0 as *const c_void,
                    d.d,
                    ops.out.0 as *mut c_void,
                    d.d,
                    algo,
                    ws as *mut c_void,
                    ws_bytes as usize,
                    p::<c_void>(stream) as lt::cudaStream_t,
                ),
                "cublasLtMatmul",
            )
        }
    }

    fn blas_destroy(&mut self, blas: Handle) {
        self.descriptors.clear();
        self.algorithms.clear();
        // SAFETY: the handle from blas_create, destroyed once, after its
        // descriptors.
        unsafe { lt::cublasLtDestroy(p(blas)) };
    }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        for (_, (dev, _)) in self.contexts.drain() {
            // SAFETY: each primary context was retained once.
            unsafe { cu::cuDevicePrimaryCtxRelease_v2(dev) };
        }
    }
}

/// True when a CUDA driver is installed and reports at least one device.
pub fn available() -> bool {
    CudaDriver::default().device_count() > 0
}

/// The GPU backend on this machine's CUDA driver.
pub type CudaGpuBackend = super::GpuBackend<CudaDriver>;

impl super::GpuBackend<CudaDriver> {
    /// Opens CUDA device `ordinal`.
    pub fn cuda(ordinal: u32) -> Result<CudaGpuBackend, BackendError> {
        super::GpuBackend::with_driver(CudaDriver::default(), ordinal)
    }

    /// Opens CUDA device `ordinal` (the same as [`Self::cuda`]).
    pub fn new(ordinal: u32) -> Result<CudaGpuBackend, BackendError> {
        Self::cuda(ordinal)
    }

    /// True when a CUDA driver is installed and reports at least one device.
    pub fn available() -> bool {
        available()
    }

    /// The device's compute capability as `major * 10 + minor` (90 on H200).
    pub fn sm(&self) -> u32 {
        self.props()
            .arch
            .trim_start_matches("sm_")
            .parse()
            .unwrap_or(0)
    }

    /// Streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.props().multiprocessors
    }
}
