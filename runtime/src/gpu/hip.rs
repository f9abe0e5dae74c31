//! The HIP driver: [`GpuDriver`] over any [`HipDriver`] (the HIP runtime,
//! hiprtc and hipBLASLt on a real machine with feature `rocm`; a simulated
//! one in tests), so AMD devices run the one GPU backend.
//!
//! What stays HIP-specific lives here or in [`crate::hip`]: the device's
//! target ID and base gfx name, kernel *source* images compiled by hiprtc at
//! load and kept in the code-object cache, and the column-major mapping of
//! kiln's row-major GEMM onto hipBLASLt ([`GemmProblem`]). HIP has no
//! programmatic dependent launch, so the PDL flag is never set.
//!
//! Not here: any backend bookkeeping ([`crate::gpu::GpuBackend`]).

use super::driver::{
    BlasAlgorithm, DeviceProps, Dims, DriverError, DriverResult, ErrorKind, GemmOperands,
    GpuDriver, Handle, Vendor,
};
use crate::backend::{BackendError, DevPtr};
use crate::hip::cache::{cache_key, default_cache_dir, hiprtc_options, CacheOutcome, CodeCache};
use crate::hip::catalog::PackedParams;
use crate::hip::driver::{self as hd, HipDriver};
use crate::hip::gemm::{self as hg, GemmProblem};
use crate::hip::policy;
use kiln_ir::plan::{GemmShape, ImageKind, KernelImage};
use kiln_ir::TensorType;
use std::collections::HashMap;

fn lift(e: hd::DriverError) -> DriverError {
    let kind = match e.code {
        hd::ERROR_OUT_OF_MEMORY => ErrorKind::OutOfMemory,
        hd::ERROR_NO_BINARY_FOR_GPU | hd::ERROR_INVALID_IMAGE => ErrorKind::NoBinaryForDevice,
        _ => ErrorKind::Other,
    };
    DriverError {
        kind,
        code: e.code,
        description: e.description,
    }
}

fn backend(e: BackendError) -> DriverError {
    DriverError::other(-1, e.to_string())
}

/// The hipBLASLt problem of a row-major GEMM shape.
pub fn problem(s: &GemmShape) -> Result<GemmProblem, String> {
    let x = TensorType::new(s.dtype, [s.t, s.k]);
    let w = TensorType::new(s.dtype, [s.n, s.k]);
    let bias = s.bias.then(|| TensorType::new(s.dtype, [s.n]));
    let out = TensorType::new(s.out, [s.t, s.n]);
    GemmProblem::from_matmul(&x, &w, bias.as_ref(), &out)
}

/// [`GpuDriver`] over a [`HipDriver`]. See the module docs.
pub struct HipGpuDriver<H: HipDriver> {
    hip: H,
    target_id: String,
    runtime: String,
    cache: Option<CodeCache>,
    /// Algorithms handed out: the problem and the workspace it was chosen
    /// under.
    gemms: HashMap<Handle, (GemmProblem, u64)>,
    next: Handle,
    /// Kernel source modules compiled by hiprtc / taken from the cache.
    pub kernels_compiled: u64,
    pub kernel_cache_hits: u64,
}

impl<H: HipDriver> HipGpuDriver<H> {
    /// Wraps `hip`, caching compiled kernel source in the default cache.
    pub fn new(hip: H) -> Self {
        HipGpuDriver {
            hip,
            target_id: String::new(),
            runtime: String::new(),
            cache: default_cache_dir().ok().map(CodeCache::new),
            gemms: HashMap::new(),
            next: 1,
            kernels_compiled: 0,
            kernel_cache_hits: 0,
        }
    }

    /// Puts compiled kernel source in `dir` instead of the default cache.
    pub fn with_cache_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.cache = Some(CodeCache::new(dir));
        self
    }

    /// The wrapped HIP driver.
    pub fn hip(&self) -> &H {
        &self.hip
    }

    /// The wrapped HIP driver, mutably (tests reconfigure a simulated one).
    pub fn hip_mut(&mut self) -> &mut H {
        &mut self.hip
    }

    /// The device's full target ID (`gfx90a:sramecc+:xnack-`), once bound.
    pub fn target_id(&self) -> &str {
        &self.target_id
    }

    /// The code object for a source image: from the cache, or hiprtc.
    fn compile_source(&mut self, image: &KernelImage) -> DriverResult<Vec<u8>> {
        let no_binary = |why: String| DriverError {
            kind: ErrorKind::NoBinaryForDevice,
            code: hd::ERROR_INVALID_IMAGE,
            description: why,
        };
        let source = std::str::from_utf8(&image.code)
            .map_err(|_| no_binary("the kernel source image is not UTF-8".into()))?;
        let options = hiprtc_options(&self.target_id);
        let compiler = format!(
            "{}; HIP runtime {}",
            self.hip.rtc_identity().map_err(backend)?,
            self.runtime
        );
        let key = cache_key(source.as_bytes(), &options, &self.target_id, &compiler);
        let name = format!("{}.hip", image.name);
        let hip = &mut self.hip;
        let mut compile = || {
            hip.rtc_compile(source, &name, &options)
                .map_err(BackendError::Device)
        };
        let (code, outcome) = match &self.cache {
            Some(cache) => cache.load_or_compile(&key, compile).map_err(backend)?,
            None => (
                compile().map_err(backend)?,
                CacheOutcome::CompiledNotStored("no cache directory (set KILN_CACHE_DIR)".into()),
            ),
        };
        match outcome {
            CacheOutcome::Hit(_) => self.kernel_cache_hits += 1,
            CacheOutcome::Compiled(_) => self.kernels_compiled += 1,
            CacheOutcome::CompiledNotStored(why) => {
                self.kernels_compiled += 1;
                eprintln!(
                    "kiln: compiled HIP kernels `{}` for {} but could not cache them: {why}",
                    image.name, self.target_id
                );
            }
        }
        Ok(code)
    }
}

impl<H: HipDriver> GpuDriver for HipGpuDriver<H> {
    fn vendor(&self) -> Vendor {
        Vendor::Hip
    }

    fn device_count(&mut self) -> u32 {
        self.hip.device_count()
    }

    fn no_device_reason(&mut self) -> String {
        self.hip.no_device_reason()
    }

    fn set_device(&mut self, ordinal: u32) -> DriverResult<()> {
        self.hip.set_device(ordinal).map_err(lift)
    }

    fn device_props(&mut self, ordinal: u32) -> Result<DeviceProps, BackendError> {
        let name = self.hip.device_name(ordinal)?;
        self.target_id = self.hip.device_target_id(ordinal)?;
        self.runtime = self.hip.runtime_version()?.0;
        Ok(DeviceProps {
            name,
            arch: policy::base_arch(&self.target_id).to_string(),
            multiprocessors: 0,
            pdl: false,
        })
    }

    fn stream_create(&mut self) -> DriverResult<Handle> {
        self.hip.stream_create().map_err(lift)
    }

    fn stream_destroy(&mut self, stream: Handle) {
        self.hip.stream_destroy(stream)
    }

    fn stream_synchronize(&mut self, stream: Handle) -> DriverResult<()> {
        self.hip.stream_synchronize(stream).map_err(lift)
    }

    fn malloc(&mut self, bytes: u64) -> DriverResult<DevPtr> {
        self.hip.malloc(bytes).map_err(lift)
    }

    fn mem_free(&mut self) -> DriverResult<u64> {
        self.hip.mem_free().map_err(lift)
    }

    fn free(&mut self, ptr: DevPtr) -> DriverResult<()> {
        self.hip.free(ptr).map_err(lift)
    }

    fn memset_zero(&mut self, ptr: DevPtr, bytes: u64, stream: Handle) -> DriverResult<()> {
        self.hip.memset_zero(ptr, bytes, stream).map_err(lift)
    }

    fn copy_to_device(&mut self, dst: DevPtr, src: &[u8], stream: Handle) -> DriverResult<()> {
        self.hip.copy_to_device(dst, src, stream).map_err(lift)
    }

    fn copy_to_host(&mut self, dst: &mut [u8], src: DevPtr, stream: Handle) -> DriverResult<()> {
        self.hip.copy_to_host(dst, src, stream).map_err(lift)
    }

    fn copy_device(
        &mut self,
        dst: DevPtr,
        src: DevPtr,
        bytes: u64,
        stream: Handle,
    ) -> DriverResult<()> {
        self.hip.copy_device(dst, src, bytes, stream).map_err(lift)
    }

    fn module_load(&mut self, image: &KernelImage) -> DriverResult<Handle> {
        match image.kind {
            ImageKind::Source => {
                let code = self.compile_source(image)?;
                self.hip.module_load(&code).map_err(lift)
            }
            _ => self.hip.module_load(&image.code).map_err(lift),
        }
    }

    fn module_unload(&mut self, module: Handle) {
        self.hip.module_unload(module)
    }

    fn function(&mut self, module: Handle, name: &str) -> Option<Handle> {
        self.hip.function(module, name)
    }

    fn launch_kernel(
        &mut self,
        function: Handle,
        dims: Dims,
        _pdl: bool,
        params: &[u8],
        offsets: &[usize],
        stream: Handle,
    ) -> DriverResult<()> {
        if dims.cluster > 1 {
            // Plans never ask for clusters on HIP (validate refuses them off
            // CUDA sm_90); a hand-built launch that does is refused here.
            return Err(DriverError::other(
                1,
                "hipErrorInvalidValue (1): thread-block clusters are not supported on HIP",
            ));
        }
        let mut packed = PackedParams::from_packed(params, offsets);
        let dims = hd::Dims {
            grid: dims.grid,
            block: dims.block,
            shared_bytes: dims.shared_bytes,
        };
        self.hip
            .launch_kernel(function, dims, stream, &mut packed)
            .map_err(lift)
    }

    fn begin_capture(&mut self, stream: Handle) -> DriverResult<()> {
        self.hip.begin_capture(stream).map_err(lift)
    }

    fn end_capture(&mut self, stream: Handle) -> DriverResult<Handle> {
        self.hip.end_capture(stream).map_err(lift)
    }

    fn instantiate(&mut self, graph: Handle) -> DriverResult<Handle> {
        self.hip.instantiate(graph).map_err(lift)
    }

    fn graph_launch(&mut self, exec: Handle, stream: Handle) -> DriverResult<()> {
        self.hip.graph_launch(exec, stream).map_err(lift)
    }

    fn exec_destroy(&mut self, exec: Handle) -> DriverResult<()> {
        self.hip.exec_destroy(exec).map_err(lift)
    }

    fn graph_destroy(&mut self, graph: Handle) -> DriverResult<()> {
        self.hip.graph_destroy(graph).map_err(lift)
    }

    fn clear_error(&mut self) {
        self.hip.clear_error()
    }

    fn event_create(&mut self) -> DriverResult<Handle> {
        self.hip.event_create().map_err(lift)
    }

    fn event_record(&mut self, event: Handle, stream: Handle) -> DriverResult<()> {
        self.hip.event_record(event, stream).map_err(lift)
    }

    fn event_elapsed_ms(&mut self, from: Handle, to: Handle) -> DriverResult<f32> {
        self.hip.event_elapsed_ms(from, to).map_err(lift)
    }

    fn event_destroy(&mut self, event: Handle) {
        self.hip.event_destroy(event)
    }

    fn blas_create(&mut self) -> DriverResult<Handle> {
        // hipBLASLt is loaded by the HIP driver on the first heuristic query.
        Ok(1)
    }

    fn blas_algorithms(
        &mut self,
        _blas: Handle,
        shape: &GemmShape,
        max_workspace: u64,
    ) -> DriverResult<Vec<BlasAlgorithm>> {
        let p = problem(shape).map_err(|m| DriverError::other(-1, m))?;
        let workspace = match self.hip.gemm_prepare(&p, max_workspace) {
            Ok(needed) => needed,
            // Report the requirement; the backend refuses it by name.
            Err(BackendError::WorkspaceTooSmall { needed, .. }) => needed,
            Err(e) => return Err(backend(e)),
        };
        let id = self.next;
        self.next += 1;
        self.gemms.insert(id, (p, max_workspace));
        Ok(vec![BlasAlgorithm { id, workspace }])
    }

    fn blas_matmul(
        &mut self,
        _blas: Handle,
        _shape: &GemmShape,
        algorithm: BlasAlgorithm,
        ops: &GemmOperands,
        workspace: Option<(DevPtr, u64)>,
        stream: Handle,
    ) -> DriverResult<()> {
        let (p, granted) = self.gemms.get(&algorithm.id).cloned().ok_or_else(|| {
            DriverError::other(-1, "no hipBLASLt algorithm for this GEMM; prepare it first")
        })?;
        // Row-major out = x @ w^T is column-major D = W^T X.
        let hops = hg::GemmOperands {
            a: ops.w,
            b: ops.x,
            d: ops.out,
            bias: ops.bias,
        };
        self.hip
            .gemm_run(&p, granted, &hops, workspace.map(|w| w.0), stream)
            .map_err(backend)
    }

    fn blas_destroy(&mut self, _blas: Handle) {
        self.gemms.clear();
        self.hip.gemm_release();
    }
}

#[cfg(feature = "rocm")]
mod real {
    use super::*;
    use crate::hip::real::RealHip;

    /// The one GPU backend on this machine's HIP libraries.
    pub type HipGpuBackend = crate::gpu::GpuBackend<HipGpuDriver<RealHip>>;

    impl crate::gpu::GpuBackend<HipGpuDriver<RealHip>> {
        /// Opens HIP device `ordinal`.
        pub fn hip(ordinal: u32) -> Result<HipGpuBackend, BackendError> {
            crate::gpu::GpuBackend::with_driver(HipGpuDriver::new(RealHip::default()), ordinal)
        }

        /// Opens HIP device `ordinal` (the same as [`Self::hip`]).
        pub fn new(ordinal: u32) -> Result<HipGpuBackend, BackendError> {
            Self::hip(ordinal)
        }

        /// HIP devices on this machine (0 without an AMD GPU or driver).
        pub fn device_count() -> u32 {
            RealHip::default().device_count()
        }

        /// Why there is no device (for test skip lines).
        pub fn no_device_reason() -> String {
            RealHip::default().no_device_reason()
        }
    }
}

#[cfg(feature = "rocm")]
pub use real::HipGpuBackend;
