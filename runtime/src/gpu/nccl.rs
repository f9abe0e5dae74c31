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
//! every rank holds the same bits), then a kernel of [`TP_MODULE`]
//! (compiled by NVRTC when the ranks are opened, before any capture)
//! rounds them into the result. The cross-rank argmax (`sharded_argmax`,
//! the lm_head split over the vocabulary) is a kernel writing each rank's
//! per-row (max, global index), `ncclAllGather` of those pairs, and a
//! kernel reducing them in rank order by the CPU reference's rule.
//! Communicators are created before any capture, with `ncclCommInitAll`
//! over the ranks' devices, and warmed up (one all-reduce and one
//! all-gather on every rank at once) so NCCL's lazy peer connection, which
//! allocates, never happens inside a capture; `NCCL_RUNTIME_CONNECT=0`
//! connects every protocol at init as well.
//!
//! A rank that fails stops the group ([`NcclGroup`], a
//! `crate::tp::GroupControl`): `ncclCommAbort` on every communicator, so
//! the other ranks' collectives return instead of waiting.
//!
//! The process must set `NCCL_NVLS_ENABLE=0` and `NCCL_CUMEM_ENABLE=0`
//! (NVLink multicast off) before NCCL loads where the machine requires it;
//! the tests and `scripts/gpu-final.sh` do.
//!
//! Not here: time inside
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

/// The kernels of the collectives besides NCCL's own: the rounding the
/// all-reduce ends with (`n` f32 values to bf16 or f16, round to nearest
/// even: kiln_port.h's `st`), and the two halves of the cross-rank argmax
/// (each rank's per-row first maximum with its global index as an f32
/// pair, then the rank-order reduction of every rank's pairs).
pub const TP_MODULE: GpuModule = GpuModule {
    name: "tp_collective",
    file: "tp_collective.cu",
    raw_source: r#"#include "kiln_port.h"
KILN_GLOBAL void f32_to_bf16(const float* x, kbf16* y, i64 n) {
  i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = st<kbf16>(x[i]);
}
KILN_GLOBAL void f32_to_f16(const float* x, kf16* y, i64 n) {
  i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = st<kf16>(x[i]);
}

// One block of 256 threads per row: the row's first maximum (NaN skipped)
// as (value, global index bits); (NaN, 0) when every value is NaN.
template <typename T>
KILN_DEV void local_best(const T* x, float* pairs, int rows, int vocab, int offset) {
  __shared__ float sb[256];
  __shared__ int si[256];
  int row = blockIdx.x;
  if (row >= rows) return;
  const T* r = x + (i64)row * vocab;
  float best = 0.0f;
  int bi = -1;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    float v = ld(r[i]);
    if (v != v) continue;
    if (bi < 0 || v > best) { best = v; bi = i; }
  }
  sb[threadIdx.x] = best;
  si[threadIdx.x] = bi;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      float ob = sb[threadIdx.x + s], mb = sb[threadIdx.x];
      int oi = si[threadIdx.x + s], mi = si[threadIdx.x];
      if (oi >= 0 && (mi < 0 || ob > mb || (ob == mb && oi < mi))) {
        sb[threadIdx.x] = ob;
        si[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    int i = si[0];
    pairs[2 * row] = i < 0 ? __int_as_float(0x7fc00000) : sb[0];
    pairs[2 * row + 1] = __int_as_float(i < 0 ? 0 : offset + i);
  }
}
KILN_GLOBAL void local_best_f32(const float* x, float* p, int rows, int vocab, int offset) {
  local_best(x, p, rows, vocab, offset);
}
KILN_GLOBAL void local_best_bf16(const kbf16* x, float* p, int rows, int vocab, int offset) {
  local_best(x, p, rows, vocab, offset);
}
KILN_GLOBAL void local_best_f16(const kf16* x, float* p, int rows, int vocab, int offset) {
  local_best(x, p, rows, vocab, offset);
}

// One thread per row: rank 0's candidate unless a later rank's is strictly
// larger; index 0 when no rank has one (every value NaN).
KILN_GLOBAL void reduce_best(const float* g, int* y, int rows, int ranks) {
  int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  float best = 0.0f;
  int bi = -1;
  for (int r = 0; r < ranks; ++r) {
    const float* p = g + (i64)r * rows * 2 + 2 * row;
    float b = p[0];
    if (b != b) continue;
    if (bi < 0 || b > best) { best = b; bi = __float_as_int(p[1]); }
  }
  y[row] = bi < 0 ? 0 : bi;
}
"#,
};

/// Most rows one cross-rank argmax takes (its gather buffers are allocated
/// when the ranks open, before any capture).
pub const MAX_ARGMAX_ROWS: u64 = 4096;

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
    /// The collective kernels ([`TP_MODULE`]), once loaded.
    kernels: Option<TpKernels>,
}

#[derive(Clone, Copy)]
struct TpKernels {
    module: Handle,
    to_bf16: Handle,
    to_f16: Handle,
    /// `local_best_{f32, bf16, f16}`.
    local_best: [Handle; 3],
    reduce_best: Handle,
    /// This rank's (value, index) pairs, and every rank's gathered.
    send: DevPtr,
    gathered: DevPtr,
}

// SAFETY: as `CudaDriver`; the communicator is this rank's alone.
unsafe impl Send for NcclDriver {}

impl NcclDriver {
    /// Compiles and loads [`TP_MODULE`] for `sm` and allocates the argmax
    /// gather buffers: before any capture.
    fn load_kernels(&mut self, sm: u32) -> Result<(), BackendError> {
        let code = kiln_kernels::nvrtc::compile_module(&TP_MODULE, sm)
            .map_err(|e| BackendError::Device(format!("compiling the collective kernels: {e}")))?;
        let image = KernelImage {
            name: TP_MODULE.name.into(),
            kind: ImageKind::Cubin,
            code,
        };
        let module = self
            .inner
            .module_load(&image)
            .map_err(|e| e.during("loading the collective kernels"))?;
        let mut f = |name: &str| {
            self.inner.function(module, name).ok_or_else(|| {
                BackendError::Device(format!("the collective module has no `{name}`"))
            })
        };
        let (to_bf16, to_f16) = (f("f32_to_bf16")?, f("f32_to_f16")?);
        let local_best = [
            f("local_best_f32")?,
            f("local_best_bf16")?,
            f("local_best_f16")?,
        ];
        let reduce_best = f("reduce_best")?;
        let pair_bytes = MAX_ARGMAX_ROWS * 2 * 4;
        let ranks = self.group.comms.len() as u64;
        let send = self
            .inner
            .malloc(pair_bytes)
            .map_err(|e| e.during("allocating the argmax pairs"))?;
        let gathered = self
            .inner
            .malloc(pair_bytes * ranks)
            .map_err(|e| e.during("allocating the gathered argmax pairs"))?;
        self.kernels = Some(TpKernels {
            module,
            to_bf16,
            to_f16,
            local_best,
            reduce_best,
            send,
            gathered,
        });
        Ok(())
    }

    /// One all-reduce and one all-gather on a stream of its own, waited
    /// for: NCCL connects its peers at a communicator's first collectives
    /// (allocating), which must not happen inside a capture. Every rank
    /// must call it at once (each from its own thread).
    fn warm_up(&mut self, ordinal: u32) -> DriverResult<()> {
        let k = self.kernels()?;
        self.inner.set_device(ordinal)?;
        let stream = self.inner.stream_create()?;
        let comm = self.group.comms[self.rank];
        let n = (2 * MAX_ARGMAX_ROWS) as usize;
        let cs = stream as usize as ns::cudaStream_t;
        let nccl = |what: &str, r: Result<nr::NcclStatus, nr::NcclError>| {
            r.map(|_| ())
                .map_err(|e| DriverError::other(e.0 as i32, format!("{what} (warm-up): {:?}", e.0)))
        };
        // SAFETY: `send` holds `n` f32s and `gathered` `ranks * n`, on this
        // rank's device; the stream is this rank's.
        let done = unsafe {
            let send = k.send.0 as usize as *mut std::ffi::c_void;
            let gathered = k.gathered.0 as usize as *mut std::ffi::c_void;
            let f32 = ns::ncclDataType_t::ncclFloat32;
            nccl(
                "ncclAllReduce",
                nr::all_reduce(send, send, n, f32, ns::ncclRedOp_t::ncclSum, comm, cs),
            )
            .and_then(|()| {
                nccl(
                    "ncclAllGather",
                    nr::all_gather(send, gathered, n, f32, comm, cs),
                )
            })
        }
        .and_then(|()| self.inner.stream_synchronize(stream));
        self.inner.stream_destroy(stream);
        done
    }

    fn kernels(&self) -> DriverResult<TpKernels> {
        self.kernels
            .ok_or_else(|| DriverError::other(-1, "the collective kernels were not loaded"))
    }

    fn stopped(&self) -> DriverResult<()> {
        match self.group.failure() {
            None => Ok(()),
            Some(why) => Err(DriverError::other(
                -1,
                format!("the NCCL group is stopped ({why}); load the plan again"),
            )),
        }
    }
}

impl Drop for NcclDriver {
    fn drop(&mut self) {
        if let Some(k) = self.kernels.take() {
            let _ = self.inner.free(k.send);
            let _ = self.inner.free(k.gathered);
            self.inner.module_unload(k.module);
        }
    }
}

/// Packs kernel parameters as `ResolvedKernel::pack` does: each at its
/// natural alignment.
fn pack(params: &[ParamValue]) -> (Vec<u8>, Vec<usize>) {
    let mut buf = Vec::new();
    let mut offsets = Vec::new();
    for p in params {
        let (align, bytes): (usize, Vec<u8>) = match p {
            ParamValue::Ptr(d) => (8, d.0.to_ne_bytes().to_vec()),
            ParamValue::I64(v) => (8, v.to_ne_bytes().to_vec()),
            ParamValue::I32(v) => (4, v.to_ne_bytes().to_vec()),
        };
        let at = buf.len().div_ceil(align) * align;
        buf.resize(at, 0);
        offsets.push(at);
        buf.extend_from_slice(&bytes);
    }
    (buf, offsets)
}

enum ParamValue {
    Ptr(DevPtr),
    I64(i64),
    I32(i32),
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
        self.stopped()?;
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
        let k = self.kernels()?;
        let function = match (from, to) {
            (DType::F32, DType::BF16) => k.to_bf16,
            (DType::F32, DType::F16) => k.to_f16,
            _ => {
                return Err(DriverError::other(
                    -1,
                    format!("all_reduce from {from} to {to}: only f32 -> bf16/f16 rounds"),
                ))
            }
        };
        let (params, offsets) = pack(&[
            ParamValue::Ptr(src),
            ParamValue::Ptr(dst),
            ParamValue::I64(count as i64),
        ]);
        let dims = Dims {
            grid: [count.div_ceil(256).max(1) as u32, 1, 1],
            block: [256, 1, 1],
            shared_bytes: 0,
            cluster: 1,
        };
        self.inner
            .launch_kernel(function, dims, false, &params, &offsets, stream)
    }

    fn sharded_argmax(
        &mut self,
        src: DevPtr,
        dst: DevPtr,
        (rows, vocab): (u64, u64),
        dtype: DType,
        stream: Handle,
    ) -> DriverResult<()> {
        self.stopped()?;
        if rows > MAX_ARGMAX_ROWS || vocab > i32::MAX as u64 / self.group.comms.len() as u64 {
            return Err(DriverError::other(
                -1,
                format!(
                    "sharded_argmax over {rows} rows of {vocab}: at most {MAX_ARGMAX_ROWS} rows per step; compile smaller keys"
                ),
            ));
        }
        let k = self.kernels()?;
        let local = match dtype {
            DType::F32 => k.local_best[0],
            DType::BF16 => k.local_best[1],
            DType::F16 => k.local_best[2],
            _ => {
                return Err(DriverError::other(
                    -1,
                    format!("sharded_argmax over {dtype} values: f32, bf16 or f16 only"),
                ))
            }
        };
        let ranks = self.group.comms.len();
        let (params, offsets) = pack(&[
            ParamValue::Ptr(src),
            ParamValue::Ptr(k.send),
            ParamValue::I32(rows as i32),
            ParamValue::I32(vocab as i32),
            ParamValue::I32((self.rank as u64 * vocab) as i32),
        ]);
        let one_block_per_row = Dims {
            grid: [rows.max(1) as u32, 1, 1],
            block: [256, 1, 1],
            shared_bytes: 0,
            cluster: 1,
        };
        self.inner
            .launch_kernel(local, one_block_per_row, false, &params, &offsets, stream)?;
        let comm = self.group.comms[self.rank];
        // SAFETY: `send` holds `2 * rows` f32s (rows <= MAX_ARGMAX_ROWS) and
        // `gathered` `ranks` times as many, both on this rank's device.
        unsafe {
            nr::all_gather(
                k.send.0 as usize as *const std::ffi::c_void,
                k.gathered.0 as usize as *mut std::ffi::c_void,
                (2 * rows) as usize,
                ns::ncclDataType_t::ncclFloat32,
                comm,
                stream as usize as ns::cudaStream_t,
            )
        }
        .map(|_| ())
        .map_err(|e| DriverError::other(e.0 as i32, format!("ncclAllGather: {:?}", e.0)))?;
        let (params, offsets) = pack(&[
            ParamValue::Ptr(k.gathered),
            ParamValue::Ptr(dst),
            ParamValue::I32(rows as i32),
            ParamValue::I32(ranks as i32),
        ]);
        let dims = Dims {
            grid: [rows.div_ceil(128).max(1) as u32, 1, 1],
            block: [128, 1, 1],
            shared_bytes: 0,
            cluster: 1,
        };
        self.inner
            .launch_kernel(k.reduce_best, dims, false, &params, &offsets, stream)
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
    let mut ranked: Vec<NcclGpuBackend> = Vec::with_capacity(ranks as usize);
    for (r, inner) in cuda.into_iter().enumerate() {
        let driver = NcclDriver {
            inner,
            group: group.clone(),
            rank: r,
            kernels: None,
        };
        let mut b = GpuBackend::with_driver(driver, first + r as u32)?;
        let sm = b
            .props()
            .arch
            .trim_start_matches("sm_")
            .parse()
            .unwrap_or(0);
        b.driver_mut().load_kernels(sm)?;
        ranked.push(b);
    }
    // Peers connect now, every rank at once, before any capture.
    let warm: Vec<DriverResult<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranked
            .iter_mut()
            .enumerate()
            .map(|(r, b)| s.spawn(move || b.driver_mut().warm_up(first + r as u32)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(DriverError::other(-1, "a rank's warm-up panicked")))
            })
            .collect()
    });
    for (r, w) in warm.into_iter().enumerate() {
        w.map_err(|e| e.during(&format!("NCCL warm-up on rank {r}")))?;
    }
    let backends: Vec<Box<dyn Backend + Send>> = ranked
        .into_iter()
        .map(|b| Box::new(b) as Box<dyn Backend + Send>)
        .collect();
    Ok(TpBackend::new(backends)?.with_control(group))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_collective_kernels_compile_under_nvrtc() {
        if !kiln_kernels::nvrtc::available() {
            eprintln!("SKIPPED: NVRTC not available");
            return;
        }
        let cubin = kiln_kernels::nvrtc::compile_module(&TP_MODULE, 90).unwrap();
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
