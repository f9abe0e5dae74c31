//! The CUDA ranks of a tensor-parallel plan: one device and one stream per
//! rank, joined by NCCL communicators (cudarc's `nccl` bindings, loaded
//! dynamically), behind `crate::tp::TpBackend`.
//!
//! [`NcclDriver`] is the CUDA driver plus the rank's communicator: every
//! call goes to [`CudaDriver`] except `all_reduce_sum`, which enqueues
//! `ncclAllReduce` on the rank's stream, so a capture records it into the
//! rank's graph (NCCL supports stream capture) and a replay runs it. The
//! plan's all-reduce sums f32 partials and rounds once to the activation
//! dtype: NCCL sums the f32 values in place (its ring order is fixed, so
//! every rank holds the same bits), then a one-kernel module
//! ([`CONVERT_MODULE`], compiled by NVRTC when the ranks are opened, before
//! any capture) rounds them into the result. Communicators are created
//! before any capture, with `ncclCommInitAll` over the ranks' devices.
//!
//! A rank that fails stops the group ([`NcclGroup`], a
//! `crate::tp::GroupControl`): `ncclCommAbort` on every communicator, so
//! the other ranks' collectives return instead of waiting.
//!
//! The process must set `NCCL_NVLS_ENABLE=0` and `NCCL_CUMEM_ENABLE=0`
//! (NVLink multicast off) before NCCL loads where the machine requires it;
//! the tests and `scripts/gpu-final.sh` do.
//!
//! Not here: the cross-rank argmax on GPUs (GPU plans keep the lm_head
//! replicated; `kiln_kernels::gpu` refuses `sharded_argmax`), time inside
//! collectives (`Backend::collective_ns` is `None`: graph replays cannot be
//! split by the host), several processes or hosts, and RCCL for HIP.

use super::cuda::CudaDriver;
use super::driver::{
    BlasAlgorithm, DeviceProps, Dims, DriverError, DriverResult, GemmOperands, GpuDriver, Handle,
    Vendor,
};
use super::GpuBackend;
use crate::backend::{Backend, BackendError, DevPtr};
use crate::tp::{GroupControl, TpBackend, TpOptions};
use cudarc::nccl::{result as nr, sys as ns};
use kiln_ir::plan::{GemmShape, ImageKind, KernelImage};
use kiln_ir::DType;
use kiln_kernels::gpu::GpuModule;
use std::sync::{Arc, Mutex};

/// The rounding kernels the all-reduce ends with: `n` f32 values to bf16
/// or f16, round to nearest even (kiln_port.h's `st`).
pub const CONVERT_MODULE: GpuModule = GpuModule {
    name: "tp_convert",
    file: "tp_convert.cu",
    raw_source: r#"#include "kiln_port.h"
KILN_GLOBAL void f32_to_bf16(const float* x, kbf16* y, i64 n) {
  i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = st<kbf16>(x[i]);
}
KILN_GLOBAL void f32_to_f16(const float* x, kf16* y, i64 n) {
  i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = st<kf16>(x[i]);
}
"#,
};

/// Whether libnccl can be loaded (it is loaded only when ranks are opened).
pub fn nccl_present() -> bool {
    // SAFETY: tries to open the library; nothing is called.
    unsafe { ns::is_culib_present() }
}

fn nccl_err(call: &str, e: nr::NcclError) -> BackendError {
    BackendError::Device(format!("{call}: NCCL error {:?}", e.0))
}

/// Every rank's communicator of one group; destroys them when the last
/// rank's driver is gone, or aborts them when a rank fails.
pub struct NcclGroup {
    comms: Vec<ns::ncclComm_t>,
    /// Why the group stopped (the communicators are aborted then).
    failure: Mutex<Option<String>>,
}

// SAFETY: NCCL communicators may be used from any thread; each rank's is
// used by one driver at a time (`&mut self`), and abort is NCCL's way to
// stop a communicator from another thread.
unsafe impl Send for NcclGroup {}
unsafe impl Sync for NcclGroup {}

impl GroupControl for NcclGroup {
    fn abort(&self, rank: u32, why: &str) {
        let mut f = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_some() {
            return;
        }
        *f = Some(format!("rank {rank} failed: {why}"));
        for &c in &self.comms {
            // SAFETY: a live communicator, aborted once (guarded by
            // `failure`); nothing destroys it afterwards.
            let _ = unsafe { nr::comm_abort(c) };
        }
    }
    fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
    fn collective_ns(&self) -> Option<Vec<u64>> {
        None
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        if self.failure().is_some() {
            return;
        }
        for &c in &self.comms {
            // SAFETY: a live communicator, destroyed once, after every
            // driver using it is gone (they hold the group).
            let _ = unsafe { nr::comm_destroy(c) };
        }
    }
}

/// The CUDA driver of one rank with its NCCL communicator. See the module
/// docs.
pub struct NcclDriver {
    inner: CudaDriver,
    group: Arc<NcclGroup>,
    rank: usize,
    /// The rounding kernels: (module, f32_to_bf16, f32_to_f16).
    convert: Option<(Handle, Handle, Handle)>,
}

// SAFETY: as `CudaDriver`; the communicator is this rank's alone.
unsafe impl Send for NcclDriver {}

impl NcclDriver {
    fn load_convert(&mut self, sm: u32) -> Result<(), BackendError> {
        let code = kiln_kernels::nvrtc::compile_module(&CONVERT_MODULE, sm).map_err(|e| {
            BackendError::Device(format!("compiling the all-reduce rounding kernels: {e}"))
        })?;
        let image = KernelImage {
            name: CONVERT_MODULE.name.into(),
            kind: ImageKind::Cubin,
            code,
        };
        let m = self
            .inner
            .module_load(&image)
            .map_err(|e| e.during("loading the all-reduce rounding kernels"))?;
        let f = |d: &mut CudaDriver, name: &str| {
            d.function(m, name)
                .ok_or_else(|| BackendError::Device(format!("the rounding module has no `{name}`")))
        };
        let bf16 = f(&mut self.inner, "f32_to_bf16")?;
        let f16 = f(&mut self.inner, "f32_to_f16")?;
        self.convert = Some((m, bf16, f16));
        Ok(())
    }
}

impl Drop for NcclDriver {
    fn drop(&mut self) {
        if let Some((m, _, _)) = self.convert.take() {
            self.inner.module_unload(m);
        }
    }
}

fn nccl_dtype(d: DType) -> Option<ns::ncclDataType_t> {
    Some(match d {
        DType::F32 => ns::ncclDataType_t::ncclFloat32,
        DType::BF16 => ns::ncclDataType_t::ncclBfloat16,
        DType::F16 => ns::ncclDataType_t::ncclFloat16,
        _ => return None,
    })
}

impl GpuDriver for NcclDriver {
    fn vendor(&self) -> Vendor {
        self.inner.vendor()
    }
    fn device_count(&mut self) -> u32 {
        self.inner.device_count()
    }
    fn no_device_reason(&mut self) -> String {
        self.inner.no_device_reason()
    }
    fn set_device(&mut self, ordinal: u32) -> DriverResult<()> {
        self.inner.set_device(ordinal)
    }
    fn device_props(&mut self, ordinal: u32) -> Result<DeviceProps, BackendError> {
        self.inner.device_props(ordinal)
    }
    fn stream_create(&mut self) -> DriverResult<Handle> {
        self.inner.stream_create()
    }
    fn stream_destroy(&mut self, stream: Handle) {
        self.inner.stream_destroy(stream)
    }
    fn stream_synchronize(&mut self, stream: Handle) -> DriverResult<()> {
        self.inner.stream_synchronize(stream)
    }
    fn malloc(&mut self, bytes: u64) -> DriverResult<DevPtr> {
        self.inner.malloc(bytes)
    }
    fn mem_free(&mut self) -> DriverResult<u64> {
        self.inner.mem_free()
    }
    fn free(&mut self, ptr: DevPtr) -> DriverResult<()> {
        self.inner.free(ptr)
    }
    fn memset_zero(&mut self, ptr: DevPtr, bytes: u64, stream: Handle) -> DriverResult<()> {
        self.inner.memset_zero(ptr, bytes, stream)
    }
    fn copy_to_device(&mut self, dst: DevPtr, src: &[u8], stream: Handle) -> DriverResult<()> {
        self.inner.copy_to_device(dst, src, stream)
    }
    fn copy_to_host(&mut self, dst: &mut [u8], src: DevPtr, stream: Handle) -> DriverResult<()> {
        self.inner.copy_to_host(dst, src, stream)
    }
    fn copy_device(
        &mut self,
        dst: DevPtr,
        src: DevPtr,
        bytes: u64,
        stream: Handle,
    ) -> DriverResult<()> {
        self.inner.copy_device(dst, src, bytes, stream)
    }
    fn module_load(&mut self, image: &KernelImage) -> DriverResult<Handle> {
        self.inner.module_load(image)
    }
    fn module_unload(&mut self, module: Handle) {
        self.inner.module_unload(module)
    }
    fn function(&mut self, module: Handle, name: &str) -> Option<Handle> {
        self.inner.function(module, name)
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
        self.inner
            .launch_kernel(function, dims, pdl, params, offsets, stream)
    }
    fn begin_capture(&mut self, stream: Handle) -> DriverResult<()> {
        self.inner.begin_capture(stream)
    }
    fn end_capture(&mut self, stream: Handle) -> DriverResult<Handle> {
        self.inner.end_capture(stream)
    }
    fn instantiate(&mut self, graph: Handle) -> DriverResult<Handle> {
        self.inner.instantiate(graph)
    }
    fn graph_launch(&mut self, exec: Handle, stream: Handle) -> DriverResult<()> {
        self.inner.graph_launch(exec, stream)
    }
    fn exec_destroy(&mut self, exec: Handle) -> DriverResult<()> {
        self.inner.exec_destroy(exec)
    }
    fn graph_destroy(&mut self, graph: Handle) -> DriverResult<()> {
        self.inner.graph_destroy(graph)
    }
    fn clear_error(&mut self) {
        self.inner.clear_error()
    }
    fn event_create(&mut self) -> DriverResult<Handle> {
        self.inner.event_create()
    }
    fn event_record(&mut self, event: Handle, stream: Handle) -> DriverResult<()> {
        self.inner.event_record(event, stream)
    }
    fn event_elapsed_ms(&mut self, from: Handle, to: Handle) -> DriverResult<f32> {
        self.inner.event_elapsed_ms(from, to)
    }
    fn event_destroy(&mut self, event: Handle) {
        self.inner.event_destroy(event)
    }
    fn blas_create(&mut self) -> DriverResult<Handle> {
        self.inner.blas_create()
    }
    fn blas_algorithms(
        &mut self,
        blas: Handle,
        shape: &GemmShape,
        max_workspace: u64,
    ) -> DriverResult<Vec<BlasAlgorithm>> {
        self.inner.blas_algorithms(blas, shape, max_workspace)
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
        self.inner
            .blas_matmul(blas, shape, algorithm, ops, workspace, stream)
    }
    fn blas_destroy(&mut self, blas: Handle) {
        self.inner.blas_destroy(blas)
    }

    fn all_reduce_sum(
        &mut self,
        src: DevPtr,
        dst: DevPtr,
        count: u64,
        (from, to): (DType, DType),
        stream: Handle,
    ) -> DriverResult<()> {
        if let Some(why) = self.group.failure() {
            return Err(DriverError::other(
                -1,
                format!("the NCCL group is stopped ({why}); load the plan again"),
            ));
        }
        let Some(dt) = nccl_dtype(from) else {
            return Err(DriverError::other(
                -1,
                format!("all_reduce over {from} values: NCCL sums f32, bf16 and f16 only"),
            ));
        };
        let comm = self.group.comms[self.rank];
        let nccl = |send: DevPtr, recv: DevPtr| {
            // SAFETY: `send`/`recv` are `count`-element buffers of `from` on
            // this rank's device (checked by the backend against its
            // allocations); the stream is this rank's.
            unsafe {
                nr::all_reduce(
                    send.0 as usize as *const std::ffi::c_void,
                    recv.0 as usize as *mut std::ffi::c_void,
                    count as usize,
                    dt,
                    ns::ncclRedOp_t::ncclSum,
                    comm,
                    stream as usize as ns::cudaStream_t,
                )
            }
            .map(|_| ())
            .map_err(|e| DriverError::other(e.0 as i32, format!("ncclAllReduce: {:?}", e.0)))
        };
        if from == to {
            return nccl(src, dst);
        }
        // The f32 partials are summed in place (nothing reads them after
        // the all-reduce), then rounded once into the result.
        nccl(src, src)?;
        let (_, bf16, f16) = self.convert.ok_or_else(|| {
            DriverError::other(-1, "the all-reduce rounding kernels were not loaded")
        })?;
        let function = match (from, to) {
            (DType::F32, DType::BF16) => bf16,
            (DType::F32, DType::F16) => f16,
            _ => {
                return Err(DriverError::other(
                    -1,
                    format!("all_reduce from {from} to {to}: only f32 -> bf16/f16 rounds"),
                ))
            }
        };
        let mut params = Vec::with_capacity(24);
        params.extend_from_slice(&src.0.to_ne_bytes());
        params.extend_from_slice(&dst.0.to_ne_bytes());
        params.extend_from_slice(&(count as i64).to_ne_bytes());
        let dims = Dims {
            grid: [count.div_ceil(256).max(1) as u32, 1, 1],
            block: [256, 1, 1],
            shared_bytes: 0,
        };
        self.inner
            .launch_kernel(function, dims, false, &params, &[0, 8, 16], stream)
    }
}

/// A CUDA rank of a tensor-parallel plan.
pub type NcclGpuBackend = GpuBackend<NcclDriver>;

/// `ranks` CUDA devices from ordinal `first` on, one rank each, joined by
/// NCCL communicators created now (before any capture), behind one
/// [`TpBackend`]. Errors name what is missing: the driver, enough GPUs,
/// libnccl.
pub fn cuda_tp_backend(
    first: u32,
    ranks: u32,
    options: &TpOptions,
) -> Result<TpBackend, BackendError> {
    let _ = options; // NCCL has no host-side wait to bound; see the module docs.
    let mut probe = CudaDriver::default();
    let visible = probe.device_count();
    if first + ranks > visible {
        return Err(BackendError::Device(format!(
            "the plan is tensor-parallel over {ranks} ranks and needs CUDA devices {first}..{} but {visible} are visible ({}); run it on a machine with {} GPUs or recompile with a smaller --tp",
            first + ranks - 1,
            probe.no_device_reason(),
            first + ranks
        )));
    }
    if !nccl_present() {
        return Err(BackendError::Device(format!(
            "tensor-parallel plans on CUDA need NCCL, but libnccl (libnccl.so.2) could not be loaded; install NCCL (e.g. the nvidia-nccl-cu12 wheel) and put its lib directory on LD_LIBRARY_PATH ({ranks} ranks asked for)"
        )));
    }
    // One backend (device, stream) per rank first: the contexts exist
    // before NCCL binds to the devices.
    let mut cuda = Vec::with_capacity(ranks as usize);
    for r in 0..ranks {
        let mut d = CudaDriver::default();
        d.set_device(first + r)
            .map_err(|e| e.during(&format!("set device {} (rank {r})", first + r)))?;
        cuda.push(d);
    }
    let devices: Vec<std::ffi::c_int> =
        (0..ranks).map(|r| (first + r) as std::ffi::c_int).collect();
    let mut comms: Vec<ns::ncclComm_t> = vec![std::ptr::null_mut(); ranks as usize];
    // SAFETY: `comms` holds `ranks` slots and `devices` `ranks` ordinals.
    unsafe { nr::comm_init_all(comms.as_mut_ptr(), ranks as i32, devices.as_ptr()) }
        .map_err(|e| nccl_err("ncclCommInitAll", e))?;
    let group = Arc::new(NcclGroup {
        comms,
        failure: Mutex::new(None),
    });
    let mut backends: Vec<Box<dyn Backend + Send>> = Vec::with_capacity(ranks as usize);
    for (r, inner) in cuda.into_iter().enumerate() {
        let driver = NcclDriver {
            inner,
            group: group.clone(),
            rank: r,
            convert: None,
        };
        let mut b = GpuBackend::with_driver(driver, first + r as u32)?;
        let sm = b
            .props()
            .arch
            .trim_start_matches("sm_")
            .parse()
            .unwrap_or(0);
        b.driver_mut().load_convert(sm)?;
        backends.push(Box::new(b));
    }
    Ok(TpBackend::new(backends)?.with_control(group))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_all_reduce_rounding_kernels_compile_under_nvrtc() {
        if !kiln_kernels::nvrtc::available() {
            eprintln!("SKIPPED: NVRTC not available");
            return;
        }
        let cubin = kiln_kernels::nvrtc::compile_module(&CONVERT_MODULE, 90).unwrap();
        assert!(cubin.len() > 100);
    }

    #[test]
    fn a_missing_libnccl_or_too_few_gpus_is_refused_by_name() {
        // Probing for libnccl loads nothing else and never panics (cudarc's
        // lazy loading would panic at the first NCCL call without it).
        let present = nccl_present();
        eprintln!("libnccl present: {present}");
        if present && super::super::cuda::available() {
            return;
        }
        let e = cuda_tp_backend(0, 64, &TpOptions::default())
            .err()
            .expect("64 GPUs are not here")
            .to_string();
        assert!(
            e.contains("needs CUDA devices 0..63") || e.contains("libnccl"),
            "{e}"
        );
    }
}
