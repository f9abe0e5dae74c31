//! The CUDA backend (feature `cuda`): kiln's [`Backend`] on an NVIDIA GPU
//! through the driver API (cudarc, loaded dynamically).
//!
//! * Kernels come from the plan's CUBINs ([`Backend::load_kernels`]); every
//!   entry point the catalog ([`kiln_kernels::gpu`]) names is resolved at
//!   load, so a missing kernel fails before the first step.
//! * One non-blocking stream carries everything: uploads (through a pinned
//!   staging ring, so a step's host-to-device copies are asynchronous and
//!   stream-ordered), kernels, cuBLASLt GEMMs, downloads.
//! * Capture is `cuStreamBeginCapture` in GLOBAL mode: besides kiln's own
//!   checks (alloc, free, synchronize, download and upload are refused
//!   inside a capture with `CaptureContract`), the driver itself rejects any
//!   unsafe call from any thread while a capture is open. A capture becomes
//!   one instantiated `CUgraphExec` per key, uploaded to the device at once;
//!   replay is one `cuGraphLaunch`.
//! * The GEMM workspace is allocated by `reserve_workspace` to the plan's
//!   figure; algorithms are chosen in `prepare` under that bound
//!   ([`blas`]). Paged attention's split-context partials live in a scratch
//!   buffer that `prepare` sizes (before capture) from the catalog.
//! * Teardown synchronizes, then destroys graphs, modules, the BLAS handle,
//!   memory and the stream.
//!
//! Not here: multi-GPU, multi-stream overlap, and any kernel JIT (a plan
//! carries CUBINs for its SM; a mismatch is a clear load error).

mod blas;
pub mod driver;
mod staging;

use crate::backend::{
    Backend, BackendError, DevOperand, DevPtr, DeviceInfo, GraphHandle, Launch, Result,
};
use blas::Blas;
use cudarc::driver::sys as cu;
use driver::check;
use kiln_ir::plan::{ImageKind, KernelImage};
use kiln_ir::{Key, Op};
use kiln_kernels::gpu::{self, GemmCall, KernelCall, Lowered, Param, Placement};
use staging::Staging;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_void, CString};

/// Which implementation runs a GEMM shape (decided in `prepare`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GemmImpl {
    /// cuBLASLt with its chosen algorithm.
    Blas,
    /// kiln's skinny-GEMM kernel (`gemv.cu`).
    Kiln,
}

/// How GEMMs are implemented (see [`CudaBackend::set_gemm_policy`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPolicy {
    /// Time cuBLASLt's candidates and kiln's skinny-GEMM kernel in
    /// `prepare`, keep the fastest (the default).
    Autotune,
    /// cuBLASLt only, its heuristic's first algorithm.
    BlasOnly,
    /// kiln's skinny-GEMM kernel wherever it applies, else cuBLASLt.
    KilnWhereApplicable,
}

/// A live device allocation.
struct Alloc {
    bytes: u64,
    what: String,
}

/// kiln's CUDA backend. See the module docs.
pub struct CudaBackend {
    ctx: cu::CUcontext,
    device: cu::CUdevice,
    ordinal: u32,
    name: String,
    sm: u32,
    sm_count: u32,
    stream: cu::CUstream,
    allocs: BTreeMap<u64, Alloc>,
    modules: Vec<(String, cu::CUmodule)>,
    functions: HashMap<String, cu::CUfunction>,
    blas: Blas,
    /// Per GEMM shape: the implementation and the workspace it was chosen under.
    gemm_impl: HashMap<GemmCall, (GemmImpl, u64)>,
    gemm_policy: GemmPolicy,
    /// Launch kernels with programmatic dependent launch (sm_90+).
    pdl: bool,
    /// Per GEMM shape, the candidates timed in `prepare` (label, microseconds).
    gemm_timings: Vec<(String, Vec<(String, f32)>)>,
    workspace: Option<(DevPtr, u64)>,
    scratch: Option<(DevPtr, u64)>,
    /// Zero-initialized u32 completion counters (kernels leave them zeroed).
    counters: Option<(DevPtr, u32)>,
    staging: Staging,
    capturing: Option<Key>,
    /// Op of the last launch recorded in the open capture (for error messages).
    last_captured_op: Option<String>,
    graphs: HashMap<u32, cu::CUgraphExec>,
    next_graph: u32,
    events: (cu::CUevent, cu::CUevent),
}

// SAFETY: every entry point makes the backend's context current on the
// calling thread before any driver call, and `&mut self` serializes use.
unsafe impl Send for CudaBackend {}

/// Bytes of pinned host memory used to stage uploads (in four chunks).
const STAGING_BYTES: usize = 64 << 20;

impl CudaBackend {
    /// True when a CUDA driver is installed and reports at least one device.
    pub fn available() -> bool {
        if !driver::driver_present() {
            return false;
        }
        let mut n = 0;
        // SAFETY: plain driver calls with valid out-pointers.
        unsafe {
            cu::cuInit(0) == cu::CUresult::CUDA_SUCCESS
                && cu::cuDeviceGetCount(&mut n) == cu::CUresult::CUDA_SUCCESS
                && n > 0
        }
    }

    /// Opens device `ordinal`: its primary context, one stream, a cuBLASLt
    /// handle, the pinned staging ring and timing events (all before any
    /// capture, as the contract requires).
    pub fn new(ordinal: u32) -> Result<CudaBackend> {
        if !driver::driver_present() {
            return Err(BackendError::Device(
                "the CUDA driver (libcuda.so.1) was not found; the cuda backend needs an NVIDIA GPU and its driver".into(),
            ));
        }
        // SAFETY: driver calls with valid out-pointers; the context is
        // retained here and released in Drop.
        unsafe {
            check(cu::cuInit(0), "cuInit")?;
            let mut count = 0;
            check(cu::cuDeviceGetCount(&mut count), "cuDeviceGetCount")?;
            if ordinal as i32 >= count {
                return Err(BackendError::Device(format!(
                    "CUDA device {ordinal} does not exist ({count} device(s) present)"
                )));
            }
            let mut device = 0;
            check(cu::cuDeviceGet(&mut device, ordinal as i32), "cuDeviceGet")?;
            let mut name_buf = [0i8; 256];
            check(
                cu::cuDeviceGetName(name_buf.as_mut_ptr(), 255, device),
                "cuDeviceGetName",
            )?;
            let name = std::ffi::CStr::from_ptr(name_buf.as_ptr())
                .to_string_lossy()
                .into_owned();
            let attr = |a| {
                let mut v = 0;
                check(
                    cu::cuDeviceGetAttribute(&mut v, a, device),
                    "cuDeviceGetAttribute",
                )
                .map(|_| v as u32)
            };
            let major = attr(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
            let minor = attr(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
            let sm_count = attr(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
            let mut ctx = std::ptr::null_mut();
            check(
                cu::cuDevicePrimaryCtxRetain(&mut ctx, device),
                "cuDevicePrimaryCtxRetain",
            )?;
            check(cu::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
            let mut stream = std::ptr::null_mut();
            check(
                cu::cuStreamCreate(
                    &mut stream,
                    cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                ),
                "cuStreamCreate",
            )?;
            let mut e0 = std::ptr::null_mut();
            let mut e1 = std::ptr::null_mut();
            check(cu::cuEventCreate(&mut e0, 0), "cuEventCreate")?;
            check(cu::cuEventCreate(&mut e1, 0), "cuEventCreate")?;
            let blas = Blas::new()?;
            let staging = Staging::new(STAGING_BYTES, 4)?;
            Ok(CudaBackend {
                ctx,
                device,
                ordinal,
                name,
                sm: major * 10 + minor,
                sm_count,
                stream,
                allocs: BTreeMap::new(),
                modules: Vec::new(),
                functions: HashMap::new(),
                blas,
                gemm_impl: HashMap::new(),
                gemm_policy: GemmPolicy::Autotune,
                pdl: major >= 9 && std::env::var("KILN_PDL").map_or(true, |v| v != "0"),
                gemm_timings: Vec::new(),
                workspace: None,
                scratch: None,
                counters: None,
                staging,
                capturing: None,
                last_captured_op: None,
                graphs: HashMap::new(),
                next_graph: 0,
                events: (e0, e1),
            })
        }
    }

    /// The device's SM version (90 for an H100/H200).
    pub fn sm(&self) -> u32 {
        self.sm
    }

    /// Streaming multiprocessors on the device.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// Bytes of device memory this backend holds (allocations, workspace and
    /// scratch included).
    pub fn allocated_bytes(&self) -> u64 {
        self.allocs.values().map(|a| a.bytes).sum()
    }

    /// Bytes of the attention scratch buffer (0 before any attention op was
    /// prepared).
    pub fn scratch_bytes(&self) -> u64 {
        self.scratch.map_or(0, |s| s.1)
    }

    fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained for the backend's lifetime.
        check(unsafe { cu::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// The capture contract's refusal, with the reasons every backend
    /// shares (`crate::capture`).
    fn refuse_in_capture(&self, call: &str) -> Result<()> {
        match self.capturing {
            Some(key) => Err(crate::capture::contract_violation(key, call)),
            None => Ok(()),
        }
    }

    fn check_range(&self, ptr: DevPtr, bytes: u64) -> Result<()> {
        match self.allocs.range(..=ptr.0).next_back() {
            Some((&base, a)) if ptr.0 + bytes <= base + a.bytes => Ok(()),
            _ => Err(BackendError::BadAddress(ptr.0)),
        }
    }

    fn raw_alloc(&mut self, bytes: u64, what: &str) -> Result<DevPtr> {
        let mut p: cu::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the allocation is freed by `free`/Drop.
        let r = unsafe { cu::cuMemAlloc_v2(&mut p, bytes.max(1) as usize) };
        if r == cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(BackendError::OutOfMemory {
                bytes,
                what: what.into(),
            });
        }
        check(r, &format!("cuMemAlloc({bytes} bytes for {what})"))?;
        // SAFETY: p is a fresh allocation of at least `bytes`.
        check(
            unsafe { cu::cuMemsetD8Async(p, 0, bytes as usize, self.stream) },
            "cuMemsetD8Async",
        )?;
        self.allocs.insert(
            p,
            Alloc {
                bytes,
                what: what.into(),
            },
        );
        Ok(DevPtr(p))
    }

    fn raw_free(&mut self, ptr: DevPtr) -> Result<()> {
        if self.allocs.remove(&ptr.0).is_none() {
            return Err(BackendError::BadAddress(ptr.0));
        }
        // SAFETY: work that may use the allocation finishes before it is freed.
        unsafe {
            check(cu::cuStreamSynchronize(self.stream), "cuStreamSynchronize")?;
            check(cu::cuMemFree_v2(ptr.0), "cuMemFree")
        }
    }

    /// Lets go of an outgrown backend-owned buffer (scratch, counters,
    /// workspace). A live graph may have baked its address in, so while any
    /// graph exists the buffer stays allocated (it is in `allocs`, freed at
    /// teardown after the stream drains); otherwise it is freed now.
    fn retire(&mut self, p: DevPtr) -> Result<()> {
        if self.graphs.is_empty() {
            self.raw_free(p)
        } else {
            Ok(())
        }
    }

    /// Grows the attention scratch buffer to at least `bytes` (before capture).
    fn ensure_scratch(&mut self, bytes: u64, op: &str) -> Result<()> {
        if bytes == 0 || self.scratch.is_some_and(|s| s.1 >= bytes) {
            return Ok(());
        }
        if let Some(key) = self.capturing {
            return Err(BackendError::CaptureFailed {
                key,
                op: op.into(),
                message: format!(
                    "needs {bytes} bytes of attention scratch that were not prepared before capture (call prepare for every op before capturing)"
                ),
            });
        }
        if let Some((p, _)) = self.scratch.take() {
            self.retire(p)?;
        }
        let p = self.raw_alloc(bytes, "attention scratch")?;
        self.scratch = Some((p, bytes));
        Ok(())
    }

    /// Grows the completion counters to at least `n` (before capture).
    fn ensure_counters(&mut self, n: u32, op: &str) -> Result<()> {
        if n == 0 || self.counters.is_some_and(|c| c.1 >= n) {
            return Ok(());
        }
        if let Some(key) = self.capturing {
            return Err(BackendError::CaptureFailed {
                key,
                op: op.into(),
                message: format!(
                    "needs {n} completion counters that were not prepared before capture (call prepare for every op before capturing)"
                ),
            });
        }
        if let Some((p, _)) = self.counters.take() {
            self.retire(p)?;
        }
        let p = self.raw_alloc(n as u64 * 4, "completion counters")?;
        self.counters = Some((p, n));
        Ok(())
    }

    fn lower(launch: &Launch) -> Result<Lowered> {
        let args: Vec<_> = launch.args.iter().map(|a| a.ty.clone()).collect();
        let results: Vec<_> = launch.results.iter().map(|a| a.ty.clone()).collect();
        let overlaps = |a: &DevOperand, b: &DevOperand| {
            let (a0, a1) = (a.ptr.0, a.ptr.0 + a.ty.size_bytes());
            let (b0, b1) = (b.ptr.0, b.ptr.0 + b.ty.size_bytes());
            a0 < b1 && b0 < a1
        };
        let placement = Placement {
            result0_overlaps_arg0: match (launch.results.first(), launch.args.first()) {
                (Some(r), Some(a)) => overlaps(r, a),
                _ => false,
            },
        };
        gpu::lower(&launch.op, &args, &results, placement).map_err(|e| {
            BackendError::Device(format!(
                "op `{}` ({}): {e}",
                launch.kernel,
                op_name(&launch.op)
            ))
        })
    }

    fn gemm_granted(&self, launch: &Launch) -> (u64, u64) {
        match launch.workspace.or(self.workspace) {
            Some((p, n)) => (p.0, n),
            None => (0, 0),
        }
    }

    fn launch_kernel(&mut self, launch: &Launch, call: &KernelCall) -> Result<()> {
        let f = *self
            .functions
            .get(&call.entry)
            .ok_or_else(|| BackendError::MissingKernel(call.entry.clone()))?;
        // Marshal parameters into one buffer, each at its natural alignment.
        let mut offsets = Vec::with_capacity(call.params.len());
        let mut size = 0usize;
        for p in &call.params {
            let align = match p {
                Param::I32(_) | Param::F32(_) | Param::Blob(_) => 4,
                _ => 8,
            };
            size = size.div_ceil(align) * align;
            offsets.push(size);
            size += p.size();
        }
        let mut buf = vec![0u64; size.div_ceil(8)];
        let bytes: &mut [u8] =
            // SAFETY: the u64 buffer is viewed as its own bytes.
            unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u8, buf.len() * 8) };
        let operand = |v: &[DevOperand], i: usize, what: &str| -> Result<u64> {
            v.get(i).map(|o| o.ptr.0).ok_or_else(|| {
                BackendError::Device(format!(
                    "op `{}`: kernel {} wants {what} {i}, which the launch does not have",
                    launch.kernel, call.entry
                ))
            })
        };
        for (p, &off) in call.params.iter().zip(&offsets) {
            let v: Vec<u8> = match p {
                Param::Arg(i) => operand(&launch.args, *i, "argument")?
                    .to_ne_bytes()
                    .to_vec(),
                Param::Result(i) => operand(&launch.results, *i, "result")?
                    .to_ne_bytes()
                    .to_vec(),
                Param::Scratch(o) => {
                    let (base, _) = self.scratch.ok_or_else(|| {
                        BackendError::Device(format!(
                            "op `{}` needs attention scratch that was never allocated",
                            launch.kernel
                        ))
                    })?;
                    (base.0 + o).to_ne_bytes().to_vec()
                }
                Param::Counters(i) => {
                    let (base, _) = self.counters.ok_or_else(|| {
                        BackendError::Device(format!(
                            "op `{}` needs completion counters that were never allocated",
                            launch.kernel
                        ))
                    })?;
                    (base.0 + 4 * *i as u64).to_ne_bytes().to_vec()
                }
                Param::Null => 0u64.to_ne_bytes().to_vec(),
                Param::I32(v) => v.to_ne_bytes().to_vec(),
                Param::I64(v) => v.to_ne_bytes().to_vec(),
                Param::F32(v) => v.to_ne_bytes().to_vec(),
                Param::Blob(b) => b.clone(),
            };
            bytes[off..off + v.len()].copy_from_slice(&v);
        }
        let mut ptrs: Vec<*mut c_void> = offsets
            .iter()
            // SAFETY: offsets lie inside `bytes`.
            .map(|&o| unsafe { bytes.as_mut_ptr().add(o) } as *mut c_void)
            .collect();
        // SAFETY: the parameter buffer matches the kernel's signature (the
        // catalog and the .cu sources are tested together); the driver
        // copies the parameters before returning. With PDL the kernel may
        // begin launching while its predecessor runs; every kernel's
        // prologue waits for its predecessors before touching memory.
        let r = unsafe {
            if self.pdl {
                let mut attr: cu::CUlaunchAttribute = std::mem::zeroed();
                attr.id =
                    cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attr.value.programmaticStreamSerializationAllowed = 1;
                let cfg = cu::CUlaunchConfig {
                    gridDimX: call.grid[0],
                    gridDimY: call.grid[1],
                    gridDimZ: call.grid[2],
                    blockDimX: call.block[0],
                    blockDimY: call.block[1],
                    blockDimZ: call.block[2],
                    sharedMemBytes: call.shared_bytes,
                    hStream: self.stream,
                    attrs: &mut attr,
                    numAttrs: 1,
                };
                cu::cuLaunchKernelEx(&cfg, f, ptrs.as_mut_ptr(), std::ptr::null_mut())
            } else {
                cu::cuLaunchKernel(
                    f,
                    call.grid[0],
                    call.grid[1],
                    call.grid[2],
                    call.block[0],
                    call.block[1],
                    call.block[2],
                    call.shared_bytes,
                    self.stream,
                    ptrs.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
        };
        self.launch_result(r, launch, &format!("cuLaunchKernel({})", call.entry))
    }

    fn launch_result(&self, r: cu::CUresult, launch: &Launch, call: &str) -> Result<()> {
        if r == cu::CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        match self.capturing {
            Some(key) => Err(BackendError::CaptureFailed {
                key,
                op: launch.kernel.clone(),
                message: format!("{call} failed: {}", driver::describe(r)),
            }),
            None => Err(BackendError::Device(format!(
                "op `{}`: {call} failed: {}",
                launch.kernel,
                driver::describe(r)
            ))),
        }
    }

    /// Chooses how GEMM `g` runs: cuBLASLt algorithms under the granted
    /// workspace and, for decode shapes, kiln's skinny-GEMM kernel; with
    /// autotuning (default; `KILN_GEMM_AUTOTUNE=0` turns it off) each
    /// candidate is timed on the launch's own buffers and the fastest kept.
    fn prepare_gemm(&mut self, launch: &Launch, g: &GemmCall, autotune: bool) -> Result<()> {
        let granted = self.gemm_granted(launch);
        if self.gemm_impl.get(g).is_some_and(|c| c.1 == granted.1) {
            return Ok(());
        }
        let policy = self.gemm_policy;
        let kiln = gpu::gemv_call(g, launch.const_args & 2 != 0)
            .filter(|c| self.functions.contains_key(&c.entry))
            .filter(|_| policy != GemmPolicy::BlasOnly);
        let n = self.blas.select(g, granted.1, kiln.is_some())?;
        let autotune = autotune
            && policy == GemmPolicy::Autotune
            && std::env::var("KILN_GEMM_AUTOTUNE").map_or(true, |v| v != "0");
        let choice = if policy == GemmPolicy::KilnWhereApplicable && kiln.is_some() {
            GemmImpl::Kiln
        } else if autotune && n + kiln.is_some() as usize > 1 {
            let mut times: Vec<(String, f32)> = Vec::new();
            let mut best = (f32::INFINITY, GemmImpl::Blas, 0usize);
            let reps = 5;
            for i in 0..n.min(8) {
                self.blas.choose(g, i);
                let ws = granted;
                let stream = self.stream;
                let run = |b: &mut Self| -> Result<()> {
                    let bias = if g.bias {
                        Some(launch.args[2].ptr.0)
                    } else {
                        None
                    };
                    // SAFETY: the launch's planned buffers, as in `launch_gemm`.
                    unsafe {
                        b.blas.matmul(
                            g,
                            launch.args[0].ptr.0,
                            launch.args[1].ptr.0,
                            bias,
                            launch.results[0].ptr.0,
                            ws,
                            stream,
                        )
                    }
                };
                run(self)?;
                let ms = self.time_ms(|b| (0..reps).try_for_each(|_| run(b)))? / reps as f32;
                times.push((format!("cublaslt#{i}"), ms * 1e3));
                if ms < best.0 {
                    best = (ms, GemmImpl::Blas, i);
                }
            }
            if let Some(call) = &kiln {
                self.launch_kernel(launch, call)?;
                let ms = self
                    .time_ms(|b| (0..reps).try_for_each(|_| b.launch_kernel(launch, call)))?
                    / reps as f32;
                times.push((call.entry.clone(), ms * 1e3));
                if ms < best.0 {
                    best = (ms, GemmImpl::Kiln, 0);
                }
            }
            self.gemm_timings.push((blas::describe(g), times));
            if best.1 == GemmImpl::Blas {
                self.blas.choose(g, best.2);
            }
            best.1
        } else if n > 0 {
            GemmImpl::Blas
        } else {
            GemmImpl::Kiln
        };
        self.gemm_impl.insert(*g, (choice, granted.1));
        Ok(())
    }

    /// Sets how GEMMs prepared from now on are implemented (choices already
    /// made are forgotten).
    pub fn set_gemm_policy(&mut self, policy: GemmPolicy) {
        self.gemm_policy = policy;
        self.gemm_impl.clear();
    }

    /// Turns programmatic dependent launch on or off for later launches
    /// (on by default on sm_90+; `KILN_PDL=0` turns it off). Kernels built
    /// for sm_80 ignore it.
    pub fn set_pdl(&mut self, on: bool) {
        self.pdl = on && self.sm >= 90;
    }

    /// Whether kernels launch with programmatic dependent launch.
    pub fn pdl(&self) -> bool {
        self.pdl
    }

    /// The candidates each GEMM shape was timed with in `prepare`
    /// (description, then (implementation, microseconds)), for reports.
    pub fn gemm_timings(&self) -> &[(String, Vec<(String, f32)>)] {
        &self.gemm_timings
    }

    fn launch_gemm(&mut self, launch: &Launch, g: &GemmCall) -> Result<()> {
        let granted = self.gemm_granted(launch);
        if self.gemm_impl.get(g).is_none_or(|c| c.1 != granted.1) {
            if let Some(key) = self.capturing {
                return Err(BackendError::CaptureFailed {
                    key,
                    op: launch.kernel.clone(),
                    message: format!(
                        "{} has no algorithm selected; prepare every GEMM before capture",
                        blas::describe(g)
                    ),
                });
            }
            self.prepare_gemm(launch, g, false)?;
        }
        if self.gemm_impl[g].0 == GemmImpl::Kiln {
            let call =
                gpu::gemv_call(g, launch.const_args & 2 != 0).expect("chosen only when it applies");
            return self.launch_kernel(launch, &call);
        }
        let bias = if g.bias {
            Some(launch.args[2].ptr.0)
        } else {
            None
        };
        // SAFETY: operands come from the engine's planned buffers, checked
        // against the GEMM's types by the catalog.
        let r = unsafe {
            self.blas.matmul(
                g,
                launch.args[0].ptr.0,
                launch.args[1].ptr.0,
                bias,
                launch.results[0].ptr.0,
                granted,
                self.stream,
            )
        };
        match (r, self.capturing) {
            (Err(BackendError::Device(m)), Some(key)) => Err(BackendError::CaptureFailed {
                key,
                op: launch.kernel.clone(),
                message: m,
            }),
            (r, _) => r,
        }
    }

    /// Workspace bytes the algorithm selected for this GEMM launch needs
    /// (None before `prepare` selected one); `Ok(None)` for non-GEMM ops too.
    pub fn gemm_workspace(&self, launch: &Launch) -> Result<Option<u64>> {
        Ok(match Self::lower(launch)? {
            Lowered::Gemm(g) => match self.gemm_impl.get(&g) {
                Some((GemmImpl::Kiln, _)) => Some(0),
                Some((GemmImpl::Blas, _)) => self.blas.selected(&g),
                None => None,
            },
            Lowered::Kernels { .. } => None,
        })
    }

    /// Live allocations as (address, bytes, purpose), for reports.
    pub fn allocations(&self) -> Vec<(u64, u64, String)> {
        self.allocs
            .iter()
            .map(|(&p, a)| (p, a.bytes, a.what.clone()))
            .collect()
    }

    /// Times `f` on the stream with CUDA events: milliseconds between an
    /// event recorded before and one after the work `f` enqueues. Not inside
    /// a capture.
    pub fn time_ms(&mut self, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<f32> {
        self.bind()?;
        self.refuse_in_capture("time_ms")?;
        // SAFETY: events and stream are live.
        unsafe {
            check(
                cu::cuEventRecord(self.events.0, self.stream),
                "cuEventRecord",
            )?;
        }
        f(self)?;
        let mut ms = 0.0f32;
        // SAFETY: as above; elapsed time is read after the end event completes.
        unsafe {
            check(
                cu::cuEventRecord(self.events.1, self.stream),
                "cuEventRecord",
            )?;
            check(cu::cuEventSynchronize(self.events.1), "cuEventSynchronize")?;
            check(
                cu::cuEventElapsedTime_v2(&mut ms, self.events.0, self.events.1),
                "cuEventElapsedTime",
            )?;
        }
        Ok(ms)
    }

    /// Device-to-device copy bandwidth in bytes per second, counting bytes
    /// read plus bytes written (the HBM ceiling a step is measured against).
    /// Median of `reps` copies of `bytes`.
    pub fn copy_bandwidth(&mut self, bytes: u64, reps: u32) -> Result<f64> {
        let a = self.alloc(bytes, "bandwidth probe (source)")?;
        let b = self.alloc(bytes, "bandwidth probe (destination)")?;
        let stream = self.stream;
        let mut times = Vec::new();
        for i in 0..reps + 2 {
            let ms = self.time_ms(|_| {
                // SAFETY: both buffers hold `bytes`.
                check(
                    unsafe { cu::cuMemcpyDtoDAsync_v2(b.0, a.0, bytes as usize, stream) },
                    "cuMemcpyDtoDAsync",
                )
            })?;
            if i >= 2 {
                times.push(ms);
            }
        }
        self.free(a)?;
        self.free(b)?;
        times.sort_by(|x, y| x.total_cmp(y));
        let med = times[times.len() / 2] as f64 / 1e3;
        Ok(2.0 * bytes as f64 / med)
    }

    /// Test hook: calls `cuMemAlloc` directly, bypassing kiln's own check,
    /// to prove the driver itself rejects an allocation inside a capture
    /// (GLOBAL mode) and that the failure surfaces. Returns the driver's
    /// verdict; the capture is invalidated either way.
    #[doc(hidden)]
    pub fn debug_driver_alloc(&mut self, bytes: u64) -> Result<()> {
        self.bind()?;
        let mut p: cu::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; a successful allocation is freed at once.
        let r = unsafe { cu::cuMemAlloc_v2(&mut p, bytes as usize) };
        if r == cu::CUresult::CUDA_SUCCESS {
            // SAFETY: p was just allocated.
            unsafe { cu::cuMemFree_v2(p) };
        }
        match self.capturing {
            Some(key) if r != cu::CUresult::CUDA_SUCCESS => Err(BackendError::CaptureContract {
                key,
                call: "cuMemAlloc".into(),
                why: format!("the driver refused it: {}", driver::describe(r)),
            }),
            _ => check(r, "cuMemAlloc"),
        }
    }

    fn end_capture_raw(&mut self) -> (cu::CUresult, cu::CUgraph) {
        let mut graph: cu::CUgraph = std::ptr::null_mut();
        // SAFETY: the stream is capturing; graph is a valid out-pointer.
        let r = unsafe { cu::cuStreamEndCapture(self.stream, &mut graph) };
        (r, graph)
    }

    /// Ends an open capture after a failure inside it and discards the
    /// partial graph, so the backend can run eagerly again.
    pub fn abort_capture_now(&mut self) -> Result<()> {
        self.bind()?;
        if self.capturing.take().is_none() {
            return Ok(());
        }
        self.last_captured_op = None;
        let (_, graph) = self.end_capture_raw();
        if !graph.is_null() {
            // SAFETY: the graph came from cuStreamEndCapture.
            unsafe { cu::cuGraphDestroy(graph) };
        }
        Ok(())
    }
}

fn op_name(op: &Op) -> &'static str {
    op.mnemonic()
}

impl Backend for CudaBackend {
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            backend: "cuda",
            ordinal: self.ordinal,
            name: self.name.clone(),
            arch: format!("sm_{}", self.sm),
        }
    }

    fn alloc(&mut self, bytes: u64, what: &str) -> Result<DevPtr> {
        self.bind()?;
        self.refuse_in_capture(&format!("alloc({bytes} bytes for {what})"))?;
        self.raw_alloc(bytes, what)
    }

    fn free(&mut self, ptr: DevPtr) -> Result<()> {
        self.bind()?;
        self.refuse_in_capture(&format!("free({:#x})", ptr.0))?;
        if self.workspace.is_some_and(|w| w.0 == ptr) {
            self.workspace = None;
        }
        if self.scratch.is_some_and(|s| s.0 == ptr) {
            self.scratch = None;
        }
        if self.counters.is_some_and(|c| c.0 == ptr) {
            self.counters = None;
        }
        self.raw_free(ptr)
    }

    fn upload(&mut self, dst: DevPtr, data: &[u8]) -> Result<()> {
        self.bind()?;
        self.refuse_in_capture("upload")?;
        self.check_range(dst, data.len() as u64)?;
        self.staging.upload(dst.0, data, self.stream)
    }

    fn download(&mut self, src: DevPtr, out: &mut [u8]) -> Result<()> {
        self.bind()?;
        self.refuse_in_capture("download")?;
        self.check_range(src, out.len() as u64)?;
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: the stream is drained first, so the (legacy-stream)
        // synchronous copy sees every enqueued write; `out` holds the bytes.
        unsafe {
            check(cu::cuStreamSynchronize(self.stream), "cuStreamSynchronize")?;
            check(
                cu::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, src.0, out.len()),
                "cuMemcpyDtoH",
            )
        }
    }

    fn load_kernels(&mut self, images: &[KernelImage]) -> Result<()> {
        self.bind()?;
        self.refuse_in_capture("load_kernels")?;
        for img in images {
            if img.kind != ImageKind::Cubin {
                return Err(BackendError::Device(format!(
                    "kernel image `{}` is a {:?}, not a CUBIN; compile the plan with --target cuda:sm_{}",
                    img.name, img.kind, self.sm
                )));
            }
            if gpu::module(&img.name).is_none() {
                return Err(BackendError::Device(format!(
                    "kernel image `{}` is not a module this runtime knows (expected one of: {})",
                    img.name,
                    gpu::MODULES.map(|m| m.name).join(", ")
                )));
            }
            let mut module = std::ptr::null_mut();
            // SAFETY: the image bytes are a complete CUBIN kept alive for the call.
            let r =
                unsafe { cu::cuModuleLoadData(&mut module, img.code.as_ptr() as *const c_void) };
            if r != cu::CUresult::CUDA_SUCCESS {
                return Err(BackendError::Device(format!(
                    "loading kernel module `{}` on {} (sm_{}) failed: {}; the plan's CUBINs must be compiled for this GPU (kiln compile --target cuda:sm_{})",
                    img.name,
                    self.name,
                    self.sm,
                    driver::describe(r),
                    self.sm
                )));
            }
            self.modules.push((img.name.clone(), module));
            for entry in gpu::entry_points(&img.name) {
                let c = CString::new(entry.clone()).expect("entry names have no NUL");
                let mut f = std::ptr::null_mut();
                // SAFETY: module is loaded; f is a valid out-pointer.
                let r = unsafe { cu::cuModuleGetFunction(&mut f, module, c.as_ptr()) };
                if r != cu::CUresult::CUDA_SUCCESS {
                    return Err(BackendError::MissingKernel(entry));
                }
                self.functions.insert(entry, f);
            }
        }
        Ok(())
    }

    fn reserve_workspace(&mut self, bytes: u64) -> Result<Option<(DevPtr, u64)>> {
        self.bind()?;
        self.refuse_in_capture("reserve_workspace")?;
        if let Some((p, n)) = self.workspace {
            if n == bytes {
                return Ok(self.workspace);
            }
            self.workspace = None;
            self.retire(p)?;
        }
        if bytes == 0 {
            return Ok(None);
        }
        let p = self.raw_alloc(bytes, "BLAS workspace")?;
        self.workspace = Some((p, bytes));
        Ok(self.workspace)
    }

    fn prepare(&mut self, launch: &Launch) -> Result<()> {
        self.bind()?;
        self.refuse_in_capture("prepare")?;
        match Self::lower(launch)? {
            Lowered::Gemm(g) => self.prepare_gemm(launch, &g, true)?,
            Lowered::Kernels {
                calls,
                scratch_bytes,
                counters,
            } => {
                for c in &calls {
                    if !self.functions.contains_key(&c.entry) {
                        return Err(BackendError::MissingKernel(c.entry.clone()));
                    }
                }
                self.ensure_scratch(scratch_bytes, &launch.kernel)?;
                self.ensure_counters(counters, &launch.kernel)?;
            }
        }
        Ok(())
    }

    fn launch(&mut self, launch: &Launch) -> Result<()> {
        self.bind()?;
        if self.capturing.is_some() {
            self.last_captured_op = Some(launch.kernel.clone());
        }
        match Self::lower(launch)? {
            Lowered::Gemm(g) => self.launch_gemm(launch, &g),
            Lowered::Kernels {
                calls,
                scratch_bytes,
                counters,
            } => {
                self.ensure_scratch(scratch_bytes, &launch.kernel)?;
                self.ensure_counters(counters, &launch.kernel)?;
                for c in &calls {
                    self.launch_kernel(launch, c)?;
                }
                Ok(())
            }
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        self.bind()?;
        self.refuse_in_capture("synchronize")?;
        // SAFETY: live stream.
        check(
            unsafe { cu::cuStreamSynchronize(self.stream) },
            "cuStreamSynchronize",
        )
    }

    fn begin_capture(&mut self, key: Key) -> Result<()> {
        self.bind()?;
        if let Some(open) = self.capturing {
            return Err(BackendError::CaptureContract {
                key,
                call: "begin_capture".into(),
                why: format!("the capture of key {open} is still open"),
            });
        }
        // SAFETY: live stream; GLOBAL mode makes the driver refuse unsafe
        // calls (allocation, synchronous copies) from any thread meanwhile.
        check(
            unsafe {
                cu::cuStreamBeginCapture_v2(
                    self.stream,
                    cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
                )
            },
            &format!("cuStreamBeginCapture (key {key})"),
        )?;
        self.capturing = Some(key);
        self.last_captured_op = None;
        Ok(())
    }

    fn end_capture(&mut self) -> Result<GraphHandle> {
        self.bind()?;
        let key = self.capturing.take().ok_or_else(|| {
            BackendError::Device("end_capture called with no capture open".into())
        })?;
        let last = self
            .last_captured_op
            .take()
            .unwrap_or_else(|| "(none)".into());
        let (r, graph) = self.end_capture_raw();
        if r != cu::CUresult::CUDA_SUCCESS || graph.is_null() {
            if !graph.is_null() {
                // SAFETY: graph came from cuStreamEndCapture.
                unsafe { cu::cuGraphDestroy(graph) };
            }
            return Err(BackendError::CaptureFailed {
                key,
                op: last,
                message: format!(
                    "cuStreamEndCapture failed: {} (the capture was invalidated by a call inside it)",
                    driver::describe(r)
                ),
            });
        }
        let mut exec: cu::CUgraphExec = std::ptr::null_mut();
        // SAFETY: graph is a complete captured graph; destroyed after
        // instantiation (the executable is independent of it).
        unsafe {
            let r = cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0);
            cu::cuGraphDestroy(graph);
            if r != cu::CUresult::CUDA_SUCCESS {
                return Err(BackendError::CaptureFailed {
                    key,
                    op: last,
                    message: format!("cuGraphInstantiate failed: {}", driver::describe(r)),
                });
            }
            check(cu::cuGraphUpload(exec, self.stream), "cuGraphUpload")?;
        }
        let h = self.next_graph;
        self.next_graph += 1;
        self.graphs.insert(h, exec);
        Ok(GraphHandle(h))
    }

    /// Ends the open capture whatever broke it (the driver may have
    /// invalidated it) and discards the partial graph.
    fn abort_capture(&mut self) -> Result<()> {
        self.abort_capture_now()
    }

    fn replay(&mut self, graph: GraphHandle) -> Result<()> {
        self.bind()?;
        self.refuse_in_capture("replay")?;
        let exec = *self
            .graphs
            .get(&graph.0)
            .ok_or_else(|| BackendError::Device(format!("graph {} does not exist", graph.0)))?;
        // SAFETY: exec is a live executable graph.
        check(
            unsafe { cu::cuGraphLaunch(exec, self.stream) },
            "cuGraphLaunch",
        )
    }

    fn destroy_graph(&mut self, graph: GraphHandle) -> Result<()> {
        self.bind()?;
        self.refuse_in_capture("destroy_graph")?;
        let exec = self
            .graphs
            .remove(&graph.0)
            .ok_or_else(|| BackendError::Device(format!("graph {} does not exist", graph.0)))?;
        // SAFETY: a replay in flight finishes before its executable is destroyed.
        unsafe {
            check(cu::cuStreamSynchronize(self.stream), "cuStreamSynchronize")?;
            check(cu::cuGraphExecDestroy(exec), "cuGraphExecDestroy")
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Teardown never panics: errors here have no one to report to.
        let _ = self.bind();
        let _ = self.abort_capture_now();
        // SAFETY: everything destroyed below was created by this backend and
        // is destroyed once, after the stream has drained.
        unsafe {
            cu::cuStreamSynchronize(self.stream);
            for (_, exec) in self.graphs.drain() {
                cu::cuGraphExecDestroy(exec);
            }
            for (_, m) in self.modules.drain(..) {
                cu::cuModuleUnload(m);
            }
            for (&p, _) in self.allocs.iter() {
                cu::cuMemFree_v2(p);
            }
            self.allocs.clear();
            self.staging.release();
            cu::cuEventDestroy_v2(self.events.0);
            cu::cuEventDestroy_v2(self.events.1);
            cu::cuStreamDestroy_v2(self.stream);
            cu::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opening_a_device_without_a_driver_or_gpu_is_a_clear_error_not_a_panic() {
        if CudaBackend::available() {
            eprintln!("SKIPPED: a CUDA device is present; this test covers machines without one");
            return;
        }
        let e = CudaBackend::new(0).err().expect("no device, no backend");
        let s = e.to_string();
        assert!(
            s.contains("driver") || s.contains("device") || s.contains("cuInit"),
            "{s}"
        );
    }
}
