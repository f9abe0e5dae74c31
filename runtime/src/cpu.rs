//! The CPU backend: a real way to run small models, and the backend that
//! proves the capture contract in CI without a GPU.
//!
//! Memory is an emulated address space. Every allocation gets a base address
//! from a monotonic counter (bases are never reused, and a guard gap separates
//! allocations), so a [`DevPtr`] resolves to `(allocation, offset)` and an
//! address outside every live allocation is [`BackendError::BadAddress`],
//! including one into freed memory.
//!
//! Capture records launches instead of running them, as a CUDA stream capture
//! does; replay re-executes the recorded launches, resolving their recorded
//! addresses against memory *at replay time*. A graph therefore reads whatever
//! the staging buffers hold when it is replayed: a missing staging refresh
//! (a frozen input) or a stale pointer shows up exactly as it would on a GPU.
//! Inside a capture, `alloc`, `free`, `synchronize`, `download` and `upload`
//! are [`BackendError::CaptureContract`] errors naming the key and the call.
//! (Uploads are refused rather than recorded: the engine refreshes staging
//! before replay, outside any capture, and a recorded host copy would be the
//! frozen-input hazard itself.)
//!
//! Kernels are `kiln_kernels::cpu::execute` unless a test injects another
//! [`KernelFn`]. A captured launch is checked once, at capture: its
//! operands are resolved and `kiln_kernels::cpu::check` runs on them (a bad
//! operand fails the capture, naming the key and the op), and the graph
//! keeps the resolved host pointers. Replay runs
//! `kiln_kernels::cpu::execute_prechecked` on them, re-resolving every
//! operand only after a `free` (an allocation never moves while it lives
//! and its base is never reused, so until something is freed the recorded
//! addresses resolve to the same host pointers and the same checks pass;
//! after a free, an operand in freed memory is a `BadAddress` at replay as
//! before). The kernels' own validation of values read from memory (token
//! ids, block tables, context lengths) still runs at every replay.
//!
//! Not here: threads and streams (every call completes before it
//! returns, so `synchronize` has nothing to wait for), GEMM algorithm
//! selection (the CPU matmul needs no workspace).

use crate::backend::{
    Backend, BackendError, DevOperand, DevPtr, DeviceInfo, GraphHandle, Launch, Result,
};
use crate::capture::{CaptureState, GraphTable};
use crate::hostmem::{HostBlock, HostMem};
use kiln_ir::plan::KernelImage;
use kiln_ir::{Key, Op};
use kiln_kernels::cpu::collective::{self, Exchange};
use kiln_kernels::cpu::{KernelError, RawTensor};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The kernel entry point the backend dispatches to (signature of
/// `kiln_kernels::cpu::execute`).
pub type KernelFn =
    unsafe fn(&Op, &[RawTensor], &[RawTensor]) -> std::result::Result<(), KernelError>;

/// An operand check (signature of `kiln_kernels::cpu::check`).
type CheckFn = fn(&Op, &[RawTensor], &[RawTensor]) -> std::result::Result<(), KernelError>;

/// What the backend runs: `check` once per captured launch, `prechecked` at
/// every replay, `checked` (both in one) for an eager launch.
#[derive(Clone, Copy)]
struct Kernels {
    check: CheckFn,
    prechecked: KernelFn,
    checked: KernelFn,
}

/// The check of an injected kernel, which checks its own operands.
fn no_check(_: &Op, _: &[RawTensor], _: &[RawTensor]) -> std::result::Result<(), KernelError> {
    Ok(())
}

/// First address handed out; low addresses stay invalid so a zero or small
/// integer used as a pointer is caught.
const BASE_START: u64 = 0x10_0000_0000;
/// Unmapped bytes between two allocations, so an overrun never lands in a
/// neighbour.
const GUARD: u64 = 1 << 16;
/// The largest bandwidth probe: twice the largest L3 seen on the machines
/// this runs on (260 MB), so the pass measures memory, not cache.
const PROBE_MAX: u64 = 512 << 20;
/// Alignment of every allocation's base address and host memory.
const ALIGN: u64 = 256;

/// Counters the CPU backend keeps, shared through an `Arc` so a test can read
/// them after the backend has moved into an engine (or been dropped by a
/// failed load).
#[derive(Debug, Default)]
pub struct CpuStats {
    /// `alloc` calls that succeeded.
    pub allocs: AtomicU64,
    /// `free` calls that succeeded.
    pub frees: AtomicU64,
    /// Bytes currently allocated.
    pub live_bytes: AtomicU64,
    /// Host to device copies.
    pub uploads: AtomicU64,
    /// Bytes copied host to device.
    pub upload_bytes: AtomicU64,
    /// Ops executed (eagerly or by a replay).
    pub executed_ops: AtomicU64,
    /// Ops recorded into graphs.
    pub recorded_ops: AtomicU64,
    /// Graph replays.
    pub replays: AtomicU64,
}

impl CpuStats {
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

struct Allocation {
    len: u64,
    host: HostBlock,
}

/// The emulated device address space.
struct AddressSpace {
    allocs: BTreeMap<u64, Allocation>,
    next: u64,
    live_bytes: u64,
    limit: Option<u64>,
    /// Bumped by every `free`: host pointers resolved at an earlier epoch
    /// may point into freed memory; at the same epoch they are still valid.
    epoch: u64,
    /// Where the host memory comes from (huge-page slabs for large blocks).
    host: HostMem,
}

impl AddressSpace {
    fn new(limit: Option<u64>) -> AddressSpace {
        AddressSpace {
            allocs: BTreeMap::new(),
            next: BASE_START,
            live_bytes: 0,
            limit,
            epoch: 0,
            host: HostMem::default(),
        }
    }

    fn alloc(&mut self, bytes: u64, what: &str) -> Result<DevPtr> {
        let oom = || BackendError::OutOfMemory {
            bytes,
            what: what.to_string(),
        };
        if let Some(limit) = self.limit {
            if self.live_bytes.saturating_add(bytes) > limit {
                return Err(oom());
            }
        }
        let size = usize::try_from(bytes.max(1)).map_err(|_| oom())?;
        let host = self
            .host
            .alloc_zeroed(size, ALIGN as usize)
            .ok_or_else(oom)?;
        let base = self.next;
        self.next = (base + bytes + GUARD).div_ceil(ALIGN) * ALIGN;
        self.allocs.insert(base, Allocation { len: bytes, host });
        self.live_bytes += bytes;
        Ok(DevPtr(base))
    }

    fn free(&mut self, ptr: DevPtr) -> Result<u64> {
        match self.allocs.remove(&ptr.0) {
            Some(a) => {
                self.live_bytes -= a.len;
                self.epoch += 1;
                Ok(a.len)
            }
            None => Err(BackendError::BadAddress(ptr.0)),
        }
    }

    /// Host pointer of `[addr, addr + bytes)`, which must lie inside one live
    /// allocation.
    fn resolve(&self, addr: u64, bytes: u64) -> Result<*mut u8> {
        let (&base, a) = self
            .allocs
            .range(..=addr)
            .next_back()
            .ok_or(BackendError::BadAddress(addr))?;
        let off = addr - base;
        if off.checked_add(bytes).is_none_or(|end| end > a.len) || (bytes == 0 && off > a.len) {
            return Err(BackendError::BadAddress(addr));
        }
        // SAFETY: off + bytes <= len, inside the allocation.
        Ok(unsafe { a.host.ptr.add(off as usize) })
    }
}

/// Reused operand vectors, so a launch allocates nothing once warm.
#[derive(Default)]
struct Scratch {
    args: Vec<RawTensor>,
    results: Vec<RawTensor>,
}

fn fill_raw(mem: &AddressSpace, ops: &[DevOperand], out: &mut Vec<RawTensor>) -> Result<()> {
    out.truncate(ops.len());
    for (i, o) in ops.iter().enumerate() {
        let ptr = mem.resolve(o.ptr.0, o.ty.size_bytes())?;
        if !(ptr as usize).is_multiple_of(o.ty.dtype.size()) {
            return Err(BackendError::Device(format!(
                "operand at {:#x} is not aligned for {}",
                o.ptr.0, o.ty.dtype
            )));
        }
        if let Some(r) = out.get_mut(i) {
            r.ptr = ptr;
            r.ty.dtype = o.ty.dtype;
            r.ty.shape.0.clone_from(&o.ty.shape.0);
            // A reused slot may have held a quantized weight of another
            // launch: the storage travels with the operand too.
            r.ty.storage = o.ty.storage;
        } else {
            out.push(RawTensor {
                ptr,
                ty: o.ty.clone(),
            });
        }
    }
    Ok(())
}

/// This rank's view of the other ranks, for collectives (`crate::tp`).
pub type SharedExchange = Arc<dyn Exchange + Send + Sync>;

/// Resolves every operand of `l` against current memory into `scratch`.
fn resolve(mem: &AddressSpace, scratch: &mut Scratch, l: &Launch) -> Result<()> {
    fill_raw(mem, &l.args, &mut scratch.args)?;
    fill_raw(mem, &l.results, &mut scratch.results)?;
    if let Some((ws, bytes)) = l.workspace {
        mem.resolve(ws.0, bytes)?;
    }
    Ok(())
}

/// Runs `l`'s kernel (`kernel`, or the collective with the exchange) on
/// operands resolved by [`resolve`].
///
/// # Safety
/// `ops` holds `l`'s operands resolved against memory that is still live
/// and not accessed by anything else during the call; when `kernel` is a
/// prechecked entry, the operands passed its check.
unsafe fn run(
    kernel: KernelFn,
    l: &Launch,
    ops: &Scratch,
    exchange: Option<&SharedExchange>,
) -> Result<()> {
    if let (Some(ex), true) = (exchange, kiln_ir::validate::is_collective(&l.op)) {
        // SAFETY: as below; the exchange copies the operand before any
        // other rank reads it.
        return unsafe {
            collective::execute_collective(&l.op, &ops.args, &ops.results, Some(&**ex))
        }
        .map_err(|e| BackendError::Device(format!("kernel `{}`: {e}", l.kernel)));
    }
    // SAFETY: every pointer was resolved inside a live allocation for its
    // tensor's full size and checked for dtype alignment; the caller keeps
    // the allocations alive while the kernel runs.
    unsafe { kernel(&l.op, &ops.args, &ops.results) }
        .map_err(|e| BackendError::Device(format!("kernel `{}`: {e}", l.kernel)))
}

/// Resolves every operand of `l` against current memory and runs its kernel
/// with its checks (an eager launch).
fn execute(
    mem: &AddressSpace,
    kernels: KernelFn,
    scratch: &mut Scratch,
    l: &Launch,
    exchange: Option<&SharedExchange>,
) -> Result<()> {
    resolve(mem, scratch, l)?;
    // SAFETY: just resolved; we hold `mem` borrowed, so nothing is freed.
    unsafe { run(kernels, l, scratch, exchange) }
}

/// A captured graph: the launches, each with its operands resolved and
/// checked at capture.
struct Recorded {
    launches: Vec<Launch>,
    /// `ops[i]`: the host operands of `launches[i]`.
    ops: Vec<Scratch>,
    /// The address-space epoch `ops` were resolved at.
    epoch: u64,
}

/// The CPU backend. See the module docs.
pub struct CpuBackend {
    mem: AddressSpace,
    kernels: Kernels,
    /// The contract bookkeeping every backend shares.
    capture: CaptureState,
    /// Launches recorded by the open capture, with their checked operands.
    recording: Recorded,
    graphs: GraphTable<Recorded>,
    workspace: Option<(DevPtr, u64)>,
    scratch: Scratch,
    stats: Arc<CpuStats>,
    /// The other ranks of a tensor-parallel plan (`crate::tp`); `None`:
    /// one rank.
    exchange: Option<SharedExchange>,
}

// SAFETY: the raw pointers are owned host allocations that nothing else
// references; moving the backend to another thread moves their ownership.
unsafe impl Send for CpuBackend {}

impl Default for CpuBackend {
    fn default() -> CpuBackend {
        CpuBackend::new()
    }
}

/// `MemAvailable` from /proc/meminfo, in bytes (Linux; `None` elsewhere or
/// when it cannot be read).
fn host_available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

impl CpuBackend {
    /// A backend running `kiln_kernels::cpu::execute` (captured launches
    /// checked once, see the module docs).
    pub fn new() -> CpuBackend {
        CpuBackend::with(Kernels {
            check: kiln_kernels::cpu::check,
            prechecked: kiln_kernels::cpu::execute_prechecked,
            checked: kiln_kernels::cpu::execute,
        })
    }

    /// A backend dispatching to `kernels` (tests inject simple kernels),
    /// which check their own operands at every launch and replay.
    pub fn with_kernels(kernels: KernelFn) -> CpuBackend {
        CpuBackend::with(Kernels {
            check: no_check,
            prechecked: kernels,
            checked: kernels,
        })
    }

    fn with(kernels: Kernels) -> CpuBackend {
        CpuBackend {
            mem: AddressSpace::new(None),
            kernels,
            capture: CaptureState::default(),
            recording: Recorded {
                launches: Vec::new(),
                ops: Vec::new(),
                epoch: 0,
            },
            graphs: GraphTable::default(),
            workspace: None,
            scratch: Scratch::default(),
            stats: Arc::new(CpuStats::default()),
            exchange: None,
        }
    }

    /// This backend as one rank of a tensor-parallel group: collectives
    /// go through `exchange` (see `crate::tp::TpBackend::cpu`).
    pub fn with_exchange(mut self, exchange: SharedExchange) -> CpuBackend {
        self.exchange = Some(exchange);
        self
    }

    /// Caps the bytes that may be live at once (allocations beyond it are
    /// [`BackendError::OutOfMemory`]), to test out-of-memory paths.
    pub fn with_memory_limit(mut self, bytes: u64) -> CpuBackend {
        self.mem.limit = Some(bytes);
        self
    }

    /// The backend's counters, readable after it moved into an engine.
    pub fn stats(&self) -> Arc<CpuStats> {
        self.stats.clone()
    }

    /// Number of live allocations.
    pub fn live_allocations(&self) -> usize {
        self.mem.allocs.len()
    }

    fn forbid_in_capture(&self, call: impl FnOnce() -> String) -> Result<()> {
        self.capture.forbid_with(call)
    }
}

impl Backend for CpuBackend {
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            backend: "cpu",
            ordinal: 0,
            name: format!(
                "host CPU ({} threads)",
                std::thread::available_parallelism().map_or(1, |n| n.get())
            ),
            arch: std::env::consts::ARCH.to_string(),
        }
    }

    /// With a memory limit, what is left of it; otherwise the host's
    /// available memory (`MemAvailable` in /proc/meminfo), unknown where
    /// that cannot be read.
    fn free_memory(&mut self) -> Result<Option<u64>> {
        Ok(match self.mem.limit {
            Some(limit) => Some(limit.saturating_sub(self.mem.live_bytes)),
            None => host_available_memory(),
        })
    }

    fn alloc(&mut self, bytes: u64, what: &str) -> Result<DevPtr> {
        self.forbid_in_capture(|| format!("alloc({bytes} bytes for {what})"))?;
        let p = self.mem.alloc(bytes, what)?;
        self.stats.allocs.fetch_add(1, Ordering::Relaxed);
        self.stats
            .live_bytes
            .store(self.mem.live_bytes, Ordering::Relaxed);
        Ok(p)
    }

    fn free(&mut self, ptr: DevPtr) -> Result<()> {
        self.forbid_in_capture(|| format!("free({:#x})", ptr.0))?;
        self.mem.free(ptr)?;
        self.stats.frees.fetch_add(1, Ordering::Relaxed);
        self.stats
            .live_bytes
            .store(self.mem.live_bytes, Ordering::Relaxed);
        Ok(())
    }

    fn upload(&mut self, dst: DevPtr, data: &[u8]) -> Result<()> {
        self.forbid_in_capture(|| format!("upload({} bytes to {:#x})", data.len(), dst.0))?;
        let p = self.mem.resolve(dst.0, data.len() as u64)?;
        // SAFETY: `p` is valid for data.len() bytes; host and emulated memory
        // never overlap.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        self.stats.uploads.fetch_add(1, Ordering::Relaxed);
        self.stats
            .upload_bytes
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// The read bandwidth of the kernels' threads over a probe buffer on
    /// the backend's own pages (`kiln_kernels::cpu::stream`): bytes read per
    /// second, the CPU's floor denominator. At most [`PROBE_MAX`] bytes and
    /// 5 passes (more only lengthens a `kiln bench`); no figure, rather than
    /// an error, when the probe cannot be allocated.
    fn copy_bandwidth(&mut self, bytes: u64, reps: u32) -> Result<Option<f64>> {
        self.forbid_in_capture(|| "copy_bandwidth".to_string())?;
        let bytes = bytes.min(PROBE_MAX);
        let Ok(p) = self.alloc(bytes, "bandwidth probe") else {
            return Ok(None);
        };
        let host = self.mem.resolve(p.0, bytes);
        let bw = host.map(|h| {
            // SAFETY: `h` is valid for `bytes` bytes of a live allocation,
            // which nothing else touches until it is freed below.
            let data = unsafe { std::slice::from_raw_parts(h, bytes as usize) };
            kiln_kernels::cpu::stream::read_bandwidth(data, reps.min(5))
        });
        self.free(p)?;
        Ok(bw?).map(|b| (b > 0.0).then_some(b))
    }

    fn download(&mut self, src: DevPtr, out: &mut [u8]) -> Result<()> {
        self.forbid_in_capture(|| format!("download({} bytes from {:#x})", out.len(), src.0))?;
        let p = self.mem.resolve(src.0, out.len() as u64)?;
        // SAFETY: as in `upload`.
        unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn load_kernels(&mut self, images: &[KernelImage]) -> Result<()> {
        self.forbid_in_capture(|| "load_kernels".into())?;
        match images.first() {
            None => Ok(()),
            Some(img) => Err(BackendError::Device(format!(
                "the CPU backend runs Rust kernels but the plan carries GPU kernel images (first: `{}`); compile the plan with --target cpu",
                img.name
            ))),
        }
    }

    fn reserve_workspace(&mut self, bytes: u64) -> Result<Option<(DevPtr, u64)>> {
        self.forbid_in_capture(|| "reserve_workspace".into())?;
        if bytes == 0 {
            return Ok(None);
        }
        if let Some((p, have)) = self.workspace {
            if have >= bytes {
                return Ok(Some((p, have)));
            }
            self.free(p)?;
        }
        let p = self.alloc(bytes, "BLAS workspace")?;
        self.workspace = Some((p, bytes));
        Ok(self.workspace)
    }

    fn prepare(&mut self, launch: &Launch) -> Result<()> {
        // The CPU matmul needs no workspace; check the operands resolve so a
        // malformed plan fails at load, not mid-step.
        for o in launch.args.iter().chain(&launch.results) {
            self.mem.resolve(o.ptr.0, o.ty.size_bytes())?;
        }
        Ok(())
    }

    fn launch(&mut self, launch: &Launch) -> Result<()> {
        if let Some(key) = self.capture.key() {
            // Check the addresses now, so a capture fails at the op that
            // broke it; replay resolves them again against live memory.
            for o in launch.args.iter().chain(&launch.results) {
                if let Err(e) = self.mem.resolve(o.ptr.0, o.ty.size_bytes()) {
                    return Err(BackendError::CaptureFailed {
                        key,
                        op: launch.kernel.clone(),
                        message: e.to_string(),
                    });
                }
            }
            // The kernel's operand checks, once: replay runs the
            // prechecked entry on these very operands.
            let mut ops = Scratch::default();
            let checked = resolve(&self.mem, &mut ops, launch).and_then(|()| {
                (self.kernels.check)(&launch.op, &ops.args, &ops.results)
                    .map_err(|e| BackendError::Device(format!("kernel `{}`: {e}", launch.kernel)))
            });
            if let Err(e) = checked {
                return Err(BackendError::CaptureFailed {
                    key,
                    op: launch.kernel.clone(),
                    message: e.to_string(),
                });
            }
            self.capture.recorded(&launch.kernel);
            self.recording.launches.push(launch.clone());
            self.recording.ops.push(ops);
            self.stats.recorded_ops.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        execute(
            &self.mem,
            self.kernels.checked,
            &mut self.scratch,
            launch,
            self.exchange.as_ref(),
        )?;
        self.stats.executed_ops.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn synchronize(&mut self) -> Result<()> {
        self.forbid_in_capture(|| "synchronize".into())
    }

    fn begin_capture(&mut self, key: Key) -> Result<()> {
        self.capture.begin(key)?;
        self.recording.launches.clear();
        self.recording.ops.clear();
        self.recording.epoch = self.mem.epoch;
        Ok(())
    }

    fn end_capture(&mut self) -> Result<GraphHandle> {
        let (key, _, _) = self.capture.end()?;
        let recorded = Recorded {
            launches: std::mem::take(&mut self.recording.launches),
            ops: std::mem::take(&mut self.recording.ops),
            epoch: self.recording.epoch,
        };
        Ok(self.graphs.insert(key, recorded))
    }

    fn abort_capture(&mut self) -> Result<()> {
        let _ = self.capture.end();
        self.recording.launches.clear();
        self.recording.ops.clear();
        Ok(())
    }

    fn replay(&mut self, graph: GraphHandle) -> Result<()> {
        self.forbid_in_capture(|| format!("replay(graph {})", graph.0))?;
        let (_, g) = self.graphs.get_mut(graph)?;
        if g.epoch != self.mem.epoch {
            // Something was freed since these operands were resolved:
            // resolve them again (an operand in freed memory fails here).
            for (l, ops) in g.launches.iter().zip(&mut g.ops) {
                resolve(&self.mem, ops, l)?;
            }
            g.epoch = self.mem.epoch;
        }
        for (l, ops) in g.launches.iter().zip(&g.ops) {
            // SAFETY: resolved at the current epoch (nothing freed since) and
            // checked at capture; we hold `mem` borrowed.
            unsafe { run(self.kernels.prechecked, l, ops, self.exchange.as_ref()) }?;
        }
        self.stats
            .executed_ops
            .fetch_add(g.launches.len() as u64, Ordering::Relaxed);
        self.stats.replays.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn destroy_graph(&mut self, graph: GraphHandle) -> Result<()> {
        self.forbid_in_capture(|| "destroy_graph".into())?;
        self.graphs.remove(graph).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_ir::{DType, TensorType};

    /// `add` on f32 only: enough to check the capture machinery without the
    /// real kernels.
    unsafe fn add_only(
        op: &Op,
        args: &[RawTensor],
        results: &[RawTensor],
    ) -> std::result::Result<(), KernelError> {
        assert_eq!(op, &Op::Add);
        let n = args[0].ty.numel() as usize;
        let a = std::slice::from_raw_parts(args[0].ptr as *const f32, n);
        let b = std::slice::from_raw_parts(args[1].ptr as *const f32, n);
        let mut out = vec![0f32; n];
        for i in 0..n {
            out[i] = a[i] + b[i];
        }
        std::ptr::copy_nonoverlapping(out.as_ptr(), results[0].ptr as *mut f32, n);
        Ok(())
    }

    fn bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
    fn floats(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn add_launch(a: DevPtr, b: DevPtr, out: DevPtr, n: u32) -> Launch {
        let ty = TensorType::new(DType::F32, [n]);
        let o = |ptr| DevOperand {
            ptr,
            ty: ty.clone(),
        };
        Launch {
            const_args: 0,
            body: crate::backend::LaunchBody::Reference,
            kernel: "add_f32".into(),
            op: Op::Add,
            args: vec![o(a), o(b)],
            results: vec![o(out)],
            workspace: None,
        }
    }

    /// Pseudo-random floats from a seed (xorshift), so tests never run on zeros.
    fn random(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 20001) as f32 / 1000.0 - 10.0
            })
            .collect()
    }

    #[test]
    fn the_read_bandwidth_is_measured_outside_a_capture_and_refused_inside_one() {
        let mut be = CpuBackend::with_kernels(add_only);
        let bw = be.copy_bandwidth(16 << 20, 2).unwrap();
        assert!(bw.is_some_and(|b| b.is_finite() && b > 0.0), "{bw:?}");
        // The probe is freed again.
        assert_eq!(CpuStats::get(&be.stats().live_bytes), 0);
        be.begin_capture(Key::new(1, 1, 0)).unwrap();
        let e = be.copy_bandwidth(16 << 20, 2).unwrap_err().to_string();
        assert!(e.contains("copy_bandwidth"), "{e}");
        let _ = be.end_capture();
        // A probe the memory limit cannot hold gives no figure, not an error.
        let mut small = CpuBackend::with_kernels(add_only).with_memory_limit(1 << 20);
        assert_eq!(small.copy_bandwidth(16 << 20, 2).unwrap(), None);
    }

    #[test]
    fn replay_reads_inputs_at_replay_time_not_capture_time() {
        let mut be = CpuBackend::with_kernels(add_only);
        let n = 64;
        let a = be.alloc(n as u64 * 4, "a").unwrap();
        let b = be.alloc(n as u64 * 4, "b").unwrap();
        let c = be.alloc(n as u64 * 4, "c").unwrap();
        let (x0, y0) = (random(1, n), random(2, n));
        be.upload(a, &bytes(&x0)).unwrap();
        be.upload(b, &bytes(&y0)).unwrap();
        be.begin_capture(Key::new(1, 1, 0)).unwrap();
        be.launch(&add_launch(a, b, c, n as u32)).unwrap();
        let g = be.end_capture().unwrap();
        // Capture records; nothing ran yet.
        let mut out = vec![0u8; n * 4];
        be.download(c, &mut out).unwrap();
        assert!(floats(&out).iter().all(|&v| v == 0.0));
        for step in 0..4u64 {
            let (x, y) = (random(10 + step, n), random(20 + step, n));
            be.upload(a, &bytes(&x)).unwrap();
            be.upload(b, &bytes(&y)).unwrap();
            be.replay(g).unwrap();
            be.download(c, &mut out).unwrap();
            let want: Vec<f32> = x.iter().zip(&y).map(|(p, q)| p + q).collect();
            assert_eq!(floats(&out), want, "step {step}");
        }
        assert_eq!(CpuStats::get(&be.stats().replays), 4);
    }

    #[test]
    fn every_forbidden_call_inside_a_capture_names_the_key_and_the_call() {
        let mut be = CpuBackend::with_kernels(add_only);
        let p = be.alloc(16, "x").unwrap();
        let key = Key::new(4, 1, 0);
        be.begin_capture(key).unwrap();
        let mut buf = [0u8; 4];
        let errs = [
            ("alloc", be.alloc(8, "lazy workspace").unwrap_err()),
            ("free", be.free(p).unwrap_err()),
            ("synchronize", be.synchronize().unwrap_err()),
            ("download", be.download(p, &mut buf).unwrap_err()),
            ("upload", be.upload(p, &buf).unwrap_err()),
        ];
        for (call, e) in errs {
            match &e {
                BackendError::CaptureContract {
                    key: k, call: c, ..
                } => {
                    assert_eq!(*k, key);
                    assert!(c.starts_with(call), "{c}");
                }
                other => panic!("{call}: expected a capture contract error, got {other}"),
            }
            let msg = e.to_string();
            assert!(msg.contains("b4q1s0") && msg.contains(call), "{msg}");
        }
        // The failed calls changed nothing: the allocation is still live.
        be.abort_capture().unwrap();
        be.download(p, &mut buf).unwrap();
        assert_eq!(be.live_allocations(), 1);
    }

    #[test]
    fn addresses_outside_live_allocations_are_bad_addresses() {
        let mut be = CpuBackend::with_kernels(add_only);
        let a = be.alloc(64, "a").unwrap();
        let b = be.alloc(64, "b").unwrap();
        let mut buf = [0u8; 8];
        // One past the end, straddling the end, before the first allocation.
        assert!(matches!(
            be.download(a.offset(64), &mut buf),
            Err(BackendError::BadAddress(_))
        ));
        assert!(matches!(
            be.download(a.offset(60), &mut buf),
            Err(BackendError::BadAddress(_))
        ));
        assert!(matches!(
            be.download(DevPtr(8), &mut buf),
            Err(BackendError::BadAddress(8))
        ));
        be.download(a.offset(56), &mut buf).unwrap();
        // A freed allocation's address is never valid again, even after new
        // allocations.
        be.free(a).unwrap();
        let _c = be.alloc(64, "c").unwrap();
        assert!(matches!(
            be.download(a, &mut buf),
            Err(BackendError::BadAddress(_))
        ));
        be.download(b, &mut buf).unwrap();
    }

    #[test]
    fn a_graph_replayed_after_its_memory_was_freed_fails_with_a_bad_address() {
        let mut be = CpuBackend::with_kernels(add_only);
        let a = be.alloc(16, "a").unwrap();
        let b = be.alloc(16, "b").unwrap();
        let c = be.alloc(16, "c").unwrap();
        be.begin_capture(Key::new(1, 1, 0)).unwrap();
        be.launch(&add_launch(a, b, c, 4)).unwrap();
        let g = be.end_capture().unwrap();
        be.replay(g).unwrap();
        be.free(b).unwrap();
        assert!(matches!(be.replay(g), Err(BackendError::BadAddress(x)) if x == b.0));
    }

    #[test]
    fn a_launch_on_a_bad_address_during_capture_names_the_key_and_op() {
        let mut be = CpuBackend::with_kernels(add_only);
        let a = be.alloc(16, "a").unwrap();
        be.begin_capture(Key::new(2, 1, 0)).unwrap();
        let e = be
            .launch(&add_launch(a, a, a.offset(4), 4))
            .unwrap_err()
            .to_string();
        assert!(e.contains("b2q1s0") && e.contains("add_f32"), "{e}");
    }

    #[test]
    fn a_bad_operand_is_refused_at_capture_naming_the_key_and_the_op() {
        // The real kernels: their operand checks run once, at capture.
        let mut be = CpuBackend::new();
        let a = be.alloc(16, "a").unwrap();
        let b = be.alloc(32, "b").unwrap();
        let c = be.alloc(16, "c").unwrap();
        let mut bad = add_launch(a, b, c, 4);
        bad.args[1].ty = TensorType::new(DType::F32, [8]);
        let key = Key::new(3, 1, 0);
        be.begin_capture(key).unwrap();
        match be.launch(&bad).unwrap_err() {
            BackendError::CaptureFailed {
                key: k,
                op,
                message,
            } => {
                assert_eq!(k, key);
                assert_eq!(op, "add_f32");
                assert!(message.contains("type-check"), "{message}");
            }
            other => panic!("expected a capture failure, got {other}"),
        }
        be.abort_capture().unwrap();
        // The same launch outside a capture is refused by the kernel too.
        let e = be.launch(&bad).unwrap_err().to_string();
        assert!(e.contains("add_f32") && e.contains("type-check"), "{e}");
    }

    #[test]
    fn a_graph_of_the_real_kernels_recomputes_every_replay_and_survives_unrelated_frees() {
        let mut be = CpuBackend::new();
        let n = 40;
        let spare = be.alloc(64, "spare").unwrap();
        let a = be.alloc(n as u64 * 4, "a").unwrap();
        let b = be.alloc(n as u64 * 4, "b").unwrap();
        let c = be.alloc(n as u64 * 4, "c").unwrap();
        be.begin_capture(Key::new(1, 1, 0)).unwrap();
        be.launch(&add_launch(a, b, c, n as u32)).unwrap();
        let g = be.end_capture().unwrap();
        let mut out = vec![0u8; n * 4];
        for step in 0..4u64 {
            if step == 2 {
                // A free elsewhere: the graph's operands are resolved again
                // and still address the same memory.
                be.free(spare).unwrap();
            }
            let (x, y) = (random(30 + step, n), random(40 + step, n));
            be.upload(a, &bytes(&x)).unwrap();
            be.upload(b, &bytes(&y)).unwrap();
            be.replay(g).unwrap();
            be.download(c, &mut out).unwrap();
            let want: Vec<f32> = x.iter().zip(&y).map(|(p, q)| p + q).collect();
            assert_eq!(floats(&out), want, "step {step}");
        }
        be.free(a).unwrap();
        assert!(matches!(be.replay(g), Err(BackendError::BadAddress(x)) if x == a.0));
    }

    #[test]
    fn out_of_memory_is_an_error_naming_the_allocation() {
        let mut be = CpuBackend::with_kernels(add_only).with_memory_limit(1000);
        be.alloc(600, "arena").unwrap();
        let e = be.alloc(600, "k cache 0").unwrap_err().to_string();
        assert!(e.contains("600") && e.contains("k cache 0"), "{e}");
    }

    #[test]
    fn gpu_kernel_images_are_refused_with_the_fix() {
        let mut be = CpuBackend::new();
        let img = KernelImage {
            name: "kiln_sm90".into(),
            kind: kiln_ir::plan::ImageKind::Cubin,
            code: vec![1, 2, 3],
        };
        let e = be.load_kernels(&[img]).unwrap_err().to_string();
        assert!(e.contains("--target cpu"), "{e}");
    }
}
