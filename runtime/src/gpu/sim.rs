//! A simulated GPU in host memory, in a CUDA or a HIP flavour, so the GPU
//! backend's orchestration runs in CI without a device.
//!
//! [`SimDriver`] implements [`GpuDriver`]: memory lives in host vectors at
//! fake device addresses, stream capture records nodes that a graph replays
//! against memory *at replay time* (so a frozen input shows up as it would on
//! a GPU), and every call is logged in order. Calls a real runtime would
//! reject inside a capture (allocation, free, synchronization, synchronous
//! copies) are logged as violations, so a test can prove the backend never
//! let one reach the device. Failures can be injected into any call by name.
//!
//! Kernels are a few built-in entry points (`add_f32`, `copy_f32`,
//! `gemv_f32`, `skinny_f32`: the two GEMM kernels share kiln's GEMV
//! parameter layout) over the packed parameter buffer, exactly as a real driver
//! receives it; modules are images built by [`SimDriver::image`]. GEMMs are
//! f32 on the host, with an algorithm whose workspace requirement the test
//! chooses. Time is a virtual clock advanced by each executed node.
//!
//! A device may be one rank of a tensor-parallel group
//! ([`SimDriver::with_exchange`]): its all-reduce meets the other ranks'
//! in an in-process exchange when it executes, so `crate::tp::TpBackend`
//! over simulated GPU ranks runs in CI.
//!
//! Not here: concurrency (work completes when submitted; `in_flight` counts
//! what a real device could still be running), and any numerics beyond f32.

use super::driver::{
    BlasAlgorithm, DeviceProps, Dims, DriverError, DriverResult, ErrorKind, GemmOperands,
    GpuDriver, Handle, Vendor,
};
use crate::backend::{BackendError, DevPtr};
use kiln_ir::plan::{GemmShape, ImageKind, KernelImage};
use kiln_ir::DType;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

/// What a simulated device saw, readable after the driver (and the backend
/// owning it) is gone: the call log, the violations, and what was still
/// live when the driver was dropped.
#[derive(Clone, Debug, Default)]
pub struct Journal {
    /// Every call made, in order (`name` or `name(detail)`).
    pub log: Vec<String>,
    /// Calls a real runtime would have rejected or that were unsafe.
    pub violations: Vec<String>,
    /// At drop: live allocations, graphs, executables, streams, events,
    /// modules, and whether the BLAS handle was live.
    pub at_drop: Option<LiveAtDrop>,
}

/// What the driver still held when it was dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LiveAtDrop {
    pub allocations: usize,
    pub graphs: usize,
    pub execs: usize,
    pub streams: usize,
    pub events: usize,
    pub modules: usize,
    pub blas: bool,
}

/// A shared view of a [`SimDriver`]'s journal.
#[derive(Clone, Debug, Default)]
pub struct JournalHandle(Arc<Mutex<Journal>>);

impl JournalHandle {
    /// A copy of the journal now.
    pub fn read(&self) -> Journal {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn with<R>(&self, f: impl FnOnce(&mut Journal) -> R) -> R {
        f(&mut self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// First line of a simulated module image.
const MAGIC: &str = "kiln-sim-module";

/// The simulated device.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub vendor: Vendor,
    pub devices: u32,
    pub name: String,
    pub arch: String,
    pub pdl: bool,
    /// Bytes that may be allocated at once (more is out of memory).
    pub memory_limit: u64,
    /// Workspace bytes the BLAS heuristic's only algorithm needs, whatever
    /// maximum the backend asks for (a library that ignores the preference).
    pub algorithm_workspace: u64,
    /// Blocks of any kernel one simulated SM holds at once (what
    /// `occupancy` answers; 0: the driver cannot say).
    pub blocks_per_sm: u32,
    /// Dynamic shared memory a kernel may be allowed beyond the default
    /// (what `allow_dynamic_shared` grants at most).
    pub dynamic_shared: u32,
    /// Shared memory of one simulated SM: `occupancy` answers at most
    /// this over the dynamic shared memory asked for (0: no limit).
    pub shared_per_sm: u32,
}

impl SimConfig {
    /// An NVIDIA-like device (`sm_90`, cubin images, PDL).
    pub fn cuda() -> SimConfig {
        SimConfig {
            vendor: Vendor::Cuda,
            devices: 1,
            name: "simulated NVIDIA H200".into(),
            arch: "sm_90".into(),
            pdl: true,
            memory_limit: 1 << 30,
            algorithm_workspace: 0,
            blocks_per_sm: 2,
            dynamic_shared: 189 << 10,
            shared_per_sm: 228 << 10,
        }
    }

    /// An AMD-like device (`gfx90a`, code objects, no PDL).
    pub fn hip() -> SimConfig {
        SimConfig {
            vendor: Vendor::Hip,
            devices: 1,
            name: "simulated AMD Instinct MI250X".into(),
            arch: "gfx90a".into(),
            pdl: false,
            memory_limit: 1 << 30,
            algorithm_workspace: 0,
            blocks_per_sm: 0,
            dynamic_shared: 0,
            shared_per_sm: 0,
        }
    }
}

#[derive(Clone, Debug)]
enum Node {
    Kernel {
        entry: String,
        params: Vec<u8>,
        offsets: Vec<usize>,
        grid: [u32; 3],
    },
    Matmul {
        shape: GemmShape,
        ops: GemmOperands,
        needs: u64,
        workspace: Option<(DevPtr, u64)>,
    },
    Copy {
        dst: DevPtr,
        src: DevPtr,
        bytes: u64,
    },
    Event(Handle),
    /// `all_reduce_sum` through the driver's exchange (f32).
    AllReduce {
        src: DevPtr,
        dst: DevPtr,
        count: u64,
    },
    /// `sharded_argmax` through the driver's exchange (f32 rows).
    ShardedArgmax {
        src: DevPtr,
        dst: DevPtr,
        rows: u64,
        vocab: u64,
    },
}

/// The other ranks of a simulated tensor-parallel group (see
/// [`SimDriver::with_exchange`]).
#[derive(Clone)]
pub struct SimExchange(pub crate::cpu::SharedExchange);

impl std::fmt::Debug for SimExchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SimExchange(rank {} of {})",
            self.0.rank(),
            self.0.ranks()
        )
    }
}

/// A simulated GPU. See the module docs.
#[derive(Debug)]
pub struct SimDriver {
    cfg: SimConfig,
    mem: BTreeMap<u64, Vec<u8>>,
    next_addr: u64,
    next_handle: Handle,
    journal: JournalHandle,
    capturing: Option<Vec<Node>>,
    graphs: HashMap<Handle, Vec<Node>>,
    execs: HashMap<Handle, Vec<Node>>,
    modules: HashMap<Handle, Vec<String>>,
    functions: HashMap<Handle, String>,
    /// Dynamic shared memory granted per function (`allow_dynamic_shared`).
    shared_grants: HashMap<Handle, u32>,
    events: HashMap<Handle, Option<f64>>,
    streams: Vec<Handle>,
    blas: Option<Handle>,
    algorithms: HashMap<Handle, u64>,
    failures: Vec<(String, u32)>,
    bound: Option<u32>,
    clock_us: f64,
    in_flight: u64,
    exchange: Option<SimExchange>,
}

fn read_u64(params: &[u8], offsets: &[usize], i: usize) -> DriverResult<u64> {
    let at = *offsets
        .get(i)
        .ok_or_else(|| DriverError::other(1, format!("kernel parameter {i} missing")))?;
    params
        .get(at..at + 8)
        .map(|b| u64::from_ne_bytes(b.try_into().unwrap_or([0; 8])))
        .ok_or_else(|| DriverError::other(1, format!("kernel parameter {i} truncated")))
}

fn read_i32(params: &[u8], offsets: &[usize], i: usize) -> DriverResult<i32> {
    let at = *offsets
        .get(i)
        .ok_or_else(|| DriverError::other(1, format!("kernel parameter {i} missing")))?;
    params
        .get(at..at + 4)
        .map(|b| i32::from_ne_bytes(b.try_into().unwrap_or([0; 4])))
        .ok_or_else(|| DriverError::other(1, format!("kernel parameter {i} truncated")))
}

impl SimDriver {
    pub fn new(cfg: SimConfig) -> SimDriver {
        SimDriver {
            cfg,
            mem: BTreeMap::new(),
            next_addr: 0x7f00_0000_0000,
            next_handle: 1,
            journal: JournalHandle::default(),
            capturing: None,
            graphs: HashMap::new(),
            execs: HashMap::new(),
            modules: HashMap::new(),
            functions: HashMap::new(),
            shared_grants: HashMap::new(),
            events: HashMap::new(),
            streams: Vec::new(),
            blas: None,
            algorithms: HashMap::new(),
            failures: Vec::new(),
            bound: None,
            clock_us: 0.0,
            in_flight: 0,
            exchange: None,
        }
    }

    /// This device as one rank of a simulated tensor-parallel group:
    /// `all_reduce_sum` (f32 only) sums every rank's values in rank order
    /// through `exchange` when the node executes (eagerly, or at replay
    /// when captured), as NCCL would on the rank's stream.
    pub fn with_exchange(mut self, exchange: crate::cpu::SharedExchange) -> SimDriver {
        self.exchange = Some(SimExchange(exchange));
        self
    }

    /// A module image for this flavour defining `entries` for `arch`.
    pub fn image(vendor: Vendor, name: &str, arch: &str, entries: &[&str]) -> KernelImage {
        let mut code = format!("{MAGIC} {arch}\n");
        for e in entries {
            code.push_str(e);
            code.push('\n');
        }
        KernelImage {
            name: name.to_string(),
            kind: match vendor {
                Vendor::Cuda => ImageKind::Cubin,
                Vendor::Hip => ImageKind::CodeObject,
            },
            code: code.into_bytes(),
        }
    }

    /// Every built-in kernel, as one image for this device.
    pub fn builtin_image(&self) -> KernelImage {
        SimDriver::image(
            self.cfg.vendor,
            "sim",
            &self.cfg.arch,
            &["add_f32", "copy_f32", "gemv_f32", "skinny_f32"],
        )
    }

    /// The vendor this device simulates.
    pub fn vendor_of_config(&self) -> Vendor {
        self.cfg.vendor
    }

    /// The journal, shared: readable after the driver is dropped.
    pub fn journal(&self) -> JournalHandle {
        self.journal.clone()
    }

    /// Every call made so far, in order (`name` or `name(detail)`).
    pub fn log(&self) -> Vec<String> {
        self.journal.read().log
    }

    /// Calls a real runtime would have rejected or that were unsafe
    /// (inside a capture, or destroying work in flight).
    pub fn violations(&self) -> Vec<String> {
        self.journal.read().violations
    }

    fn violation(&self, what: String) {
        self.journal.with(|j| j.violations.push(what));
    }

    /// Bytes allocated on the device now.
    pub fn live_bytes(&self) -> u64 {
        self.mem.values().map(|m| m.len() as u64).sum()
    }

    /// Live device allocations.
    pub fn live_allocations(&self) -> usize {
        self.mem.len()
    }

    /// Graphs and executables not yet destroyed.
    pub fn live_graphs(&self) -> (usize, usize) {
        (self.graphs.len(), self.execs.len())
    }

    /// Streams not yet destroyed.
    pub fn live_streams(&self) -> usize {
        self.streams.len()
    }

    /// The device the last `set_device` bound.
    pub fn bound(&self) -> Option<u32> {
        self.bound
    }

    /// Whether the BLAS handle is live.
    pub fn blas_live(&self) -> bool {
        self.blas.is_some()
    }

    /// Makes the `nth` next call named `call` (1 = the next one) fail.
    pub fn fail_on(&mut self, call: &str, nth: u32) {
        self.failures.push((call.to_string(), nth.max(1)));
    }

    /// Sets the workspace the BLAS heuristic's algorithm needs.
    pub fn set_algorithm_workspace(&mut self, bytes: u64) {
        self.cfg.algorithm_workspace = bytes;
    }

    /// Reads device memory directly (tests).
    pub fn peek(&self, ptr: DevPtr, len: u64) -> Option<Vec<u8>> {
        let (&base, m) = self.mem.range(..=ptr.0).next_back()?;
        let off = (ptr.0 - base) as usize;
        m.get(off..off + len as usize).map(<[u8]>::to_vec)
    }

    fn handle(&mut self) -> Handle {
        self.next_handle += 1;
        self.next_handle
    }

    /// Logs `call`, fails it if a failure was injected, and notes it as a
    /// violation when `capture_safe` is false and a capture is open.
    fn call(&mut self, call: &str, detail: String, capture_safe: bool) -> DriverResult<()> {
        let line = if detail.is_empty() {
            call.to_string()
        } else {
            format!("{call}({detail})")
        };
        self.journal.with(|j| j.log.push(line));
        if !capture_safe && self.capturing.is_some() {
            self.violation(format!("{call} inside a stream capture"));
            self.capturing = None;
            return Err(DriverError::other(
                900,
                format!("simErrorStreamCaptureInvalidated: {call} inside a capture"),
            ));
        }
        let mut fire = false;
        for (name, n) in &mut self.failures {
            if name == call {
                *n -= 1;
                if *n == 0 {
                    fire = true;
                }
            }
        }
        self.failures.retain(|(_, n)| *n > 0);
        if fire {
            return Err(DriverError::other(
                999,
                format!("simErrorInjected (999): injected failure of {call}"),
            ));
        }
        Ok(())
    }

    fn region(&mut self, ptr: u64, len: u64) -> DriverResult<&mut [u8]> {
        let bad = || {
            DriverError::other(
                1,
                format!("simErrorIllegalAddress (700): {len} bytes at {ptr:#x}"),
            )
        };
        let (&base, m) = self.mem.range_mut(..=ptr).next_back().ok_or_else(bad)?;
        let off = (ptr - base) as usize;
        if off + len as usize > m.len() {
            return Err(bad());
        }
        Ok(&mut m[off..off + len as usize])
    }

    fn read_f32(&mut self, ptr: u64, n: usize) -> DriverResult<Vec<f32>> {
        let r = self.region(ptr, n as u64 * 4)?;
        Ok(r.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    fn write_f32(&mut self, ptr: u64, v: &[f32]) -> DriverResult<()> {
        let r = self.region(ptr, v.len() as u64 * 4)?;
        for (c, x) in r.chunks_exact_mut(4).zip(v) {
            c.copy_from_slice(&x.to_le_bytes());
        }
        Ok(())
    }

    fn gemm(
        &mut self,
        x: u64,
        w: u64,
        bias: Option<u64>,
        out: u64,
        (t, n, k): (usize, usize, usize),
    ) -> DriverResult<()> {
        let xs = self.read_f32(x, t * k)?;
        let ws = self.read_f32(w, n * k)?;
        let bs = match bias {
            Some(b) => self.read_f32(b, n)?,
            None => vec![0.0; n],
        };
        let mut o = vec![0.0f32; t * n];
        for i in 0..t {
            for j in 0..n {
                let dot: f32 = (0..k).map(|l| xs[i * k + l] * ws[j * k + l]).sum();
                o[i * n + j] = dot + bs[j];
            }
        }
        self.write_f32(out, &o)
    }

    fn execute(&mut self, node: &Node) -> DriverResult<()> {
        self.in_flight += 1;
        match node {
            Node::Kernel {
                entry,
                params,
                offsets,
                grid,
            } => {
                self.clock_us += if entry.ends_with("gemv_f32") || entry == "skinny_f32" {
                    2.0
                } else {
                    5.0
                };
                let p = |i| read_u64(params, offsets, i);
                let n = |i| read_i32(params, offsets, i).map(|v| v.max(0) as usize);
                match entry.as_str() {
                    "add_f32" => {
                        let len = n(3)?;
                        let a = self.read_f32(p(0)?, len)?;
                        let b = self.read_f32(p(1)?, len)?;
                        let c: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
                        self.write_f32(p(2)?, &c)
                    }
                    "copy_f32" => {
                        let len = n(2)?;
                        let a = self.read_f32(p(0)?, len)?;
                        self.write_f32(p(1)?, &a)
                    }
                    "gemv_f32" | "skinny_f32" => {
                        let bias = Some(p(2)?).filter(|&b| b != 0);
                        self.gemm(p(0)?, p(1)?, bias, p(3)?, (n(4)?, n(5)?, n(6)?))
                    }
                    "megakernel_reset" => {
                        let bytes = 4 * n(1)? as u64;
                        self.region(p(0)?, bytes)?.fill(0);
                        Ok(())
                    }
                    "megakernel_run" => {
                        let ptrs = [p(0)?, p(1)?, p(2)?, p(3)?, p(4)?];
                        self.walk_tape(ptrs, grid[0])
                    }
                    other => Err(DriverError::other(
                        98,
                        format!("simErrorInvalidDeviceFunction (98): no kernel `{other}`"),
                    )),
                }
            }
            Node::Matmul {
                shape,
                ops,
                needs,
                workspace,
            } => {
                self.clock_us += 10.0;
                if *needs > 0 {
                    match workspace {
                        Some((p, bytes)) if *bytes >= *needs => {
                            self.region(p.0, *needs)?;
                        }
                        _ => {
                            return Err(DriverError::other(
                                7,
                                format!(
                                    "simBlasStatusInvalidValue (7): the algorithm needs {needs} bytes of workspace, got {:?}",
                                    workspace.map(|w| w.1)
                                ),
                            ))
                        }
                    }
                }
                if shape.dtype != DType::F32 || shape.out != DType::F32 {
                    return Err(DriverError::other(
                        15,
                        "simBlasStatusNotSupported (15): the simulated BLAS does f32 only",
                    ));
                }
                let dims = (shape.t as usize, shape.n as usize, shape.k as usize);
                self.gemm(ops.x.0, ops.w.0, ops.bias.map(|b| b.0), ops.out.0, dims)
            }
            Node::Copy { dst, src, bytes } => {
                self.clock_us += *bytes as f64 / 1e6;
                let data = self.region(src.0, *bytes)?.to_vec();
                self.region(dst.0, *bytes)?.copy_from_slice(&data);
                Ok(())
            }
            Node::Event(e) => {
                self.events.insert(*e, Some(self.clock_us));
                Ok(())
            }
            Node::AllReduce { src, dst, count } => {
                self.clock_us += 20.0;
                let ex = self
                    .exchange
                    .clone()
                    .ok_or_else(|| DriverError::other(-1, "simErrorNoCommunicator: no exchange"))?;
                let local = self.read_f32(src.0, *count as usize)?;
                let mut sum = vec![0f32; local.len()];
                ex.0.all_gather(&local, &mut |parts| {
                    kiln_kernels::cpu::collective::sum_in_rank_order(parts, &mut sum)
                })
                .map_err(|m| DriverError::other(-1, format!("simErrorCollective: {m}")))?;
                self.write_f32(dst.0, &sum)
            }
            Node::ShardedArgmax {
                src,
                dst,
                rows,
                vocab,
            } => {
                use kiln_kernels::cpu::collective::{local_best, reduce_best};
                self.clock_us += 20.0;
                let ex = self
                    .exchange
                    .clone()
                    .ok_or_else(|| DriverError::other(-1, "simErrorNoCommunicator: no exchange"))?;
                let (rows, vocab) = (*rows as usize, *vocab as usize);
                let x = self.read_f32(src.0, rows * vocab)?;
                let offset = ex.0.rank() as usize * vocab;
                let mut mine = Vec::with_capacity(2 * rows);
                for r in 0..rows {
                    match local_best(&x[r * vocab..(r + 1) * vocab], offset) {
                        Some((b, i)) => mine.extend([b, f32::from_bits(i as u32)]),
                        None => mine.extend([f32::NAN, 0.0]),
                    }
                }
                let mut idx = vec![0i32; rows];
                ex.0.all_gather(&mine, &mut |parts| {
                    for (r, out) in idx.iter_mut().enumerate() {
                        let cands = parts.iter().map(|p| {
                            let (b, i) = (p[2 * r], p[2 * r + 1]);
                            (!b.is_nan()).then(|| (b, i.to_bits() as usize))
                        });
                        *out = reduce_best(cands) as i32;
                    }
                })
                .map_err(|m| DriverError::other(-1, format!("simErrorCollective: {m}")))?;
                let out = self.region(dst.0, rows as u64 * 4)?;
                for (c, v) in out.chunks_exact_mut(4).zip(&idx) {
                    c.copy_from_slice(&v.to_le_bytes());
                }
                Ok(())
            }
        }
    }

    /// The control path of the megakernel interpreter over the tape image
    /// in simulated memory (no task's math): every block (queue) runs its
    /// head task once its waits are met, then bumps the task's counter;
    /// blocks take turns, the highest queue first, so a consumer on a later
    /// queue is tried before its producer. A step where no head task can run
    /// is the hang a real device would show, reported as an error naming the
    /// task and the counter it waits on; so is a counter not zero at launch.
    /// `ptrs`: tasks, queue_start,
    /// queue_tasks, waits, counters.
    fn walk_tape(&mut self, ptrs: [u64; 5], queues: u32) -> DriverResult<()> {
        use kiln_kernels::megakernel::{TASK_BYTES, WAIT_BYTES};
        let [tasks, qstart, qtasks, waits, counters] = ptrs;
        let u32_at = |d: &mut SimDriver, at: u64| -> DriverResult<u32> {
            let b = d.region(at, 4)?;
            Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        };
        let nq = queues as u64;
        let mut head = Vec::with_capacity(queues as usize);
        let mut end = Vec::with_capacity(queues as usize);
        for q in 0..nq {
            head.push(u32_at(self, qstart + 4 * q)?);
            end.push(u32_at(self, qstart + 4 * (q + 1))?);
        }
        // The interpreter needs every tape counter zero at launch (the
        // reset kernel's job); a stale one would let a waiter run early.
        for q in 0..queues as usize {
            for i in head[q]..end[q] {
                let t = u32_at(self, qtasks + 4 * i as u64)? as u64;
                let c = u32_at(self, tasks + t * TASK_BYTES as u64 + 4)? as u64;
                let v = u32_at(self, counters + 4 * c)?;
                if v != 0 {
                    return Err(DriverError::other(
                        900,
                        format!(
                            "simErrorIllegalState: megakernel counter {c} (task {t}) is {v} at launch: the tape's counters were not reset"
                        ),
                    ));
                }
            }
        }
        loop {
            let mut progressed = false;
            let mut blocked = None;
            for q in (0..queues as usize).rev() {
                if head[q] >= end[q] {
                    continue;
                }
                let t = u32_at(self, qtasks + 4 * head[q] as u64)? as u64;
                let rec = tasks + t * TASK_BYTES as u64;
                let counter = u32_at(self, rec + 4)? as u64;
                let (wb, wc) = (
                    u32_at(self, rec + 8)? as u64,
                    u32_at(self, rec + 12)? as u64,
                );
                let mut ready = true;
                for w in wb..wb + wc {
                    let at = waits + w * WAIT_BYTES as u64;
                    let (c, target) = (u32_at(self, at)? as u64, u32_at(self, at + 4)?);
                    if u32_at(self, counters + 4 * c)? < target {
                        ready = false;
                        blocked = Some((q, t, c));
                        break;
                    }
                }
                if ready {
                    let v = u32_at(self, counters + 4 * counter)? + 1;
                    self.region(counters + 4 * counter, 4)?
                        .copy_from_slice(&v.to_le_bytes());
                    head[q] += 1;
                    progressed = true;
                }
            }
            if head.iter().zip(&end).all(|(h, e)| h >= e) {
                return Ok(());
            }
            if !progressed {
                let (q, t, c) = blocked.unwrap_or((0, 0, 0));
                return Err(DriverError::other(
                    702,
                    format!(
                        "simErrorLaunchTimeout (702): megakernel hang: queue {q}'s task {t} waits on counter {c}, which no runnable task bumps"
                    ),
                ));
            }
        }
    }

    /// Records `node` when capturing, else runs it.
    fn submit(&mut self, node: Node) -> DriverResult<()> {
        match &mut self.capturing {
            Some(nodes) => {
                nodes.push(node);
                Ok(())
            }
            None => self.execute(&node),
        }
    }
}

impl GpuDriver for SimDriver {
    fn vendor(&self) -> Vendor {
        self.cfg.vendor
    }

    fn device_count(&mut self) -> u32 {
        self.cfg.devices
    }

    fn no_device_reason(&mut self) -> String {
        "the simulated driver was configured with no devices".into()
    }

    fn set_device(&mut self, ordinal: u32) -> DriverResult<()> {
        self.call("set_device", String::new(), true)?;
        if ordinal >= self.cfg.devices {
            return Err(DriverError::other(101, "simErrorInvalidDevice (101)"));
        }
        self.bound = Some(ordinal);
        Ok(())
    }

    fn device_props(&mut self, _ordinal: u32) -> Result<DeviceProps, BackendError> {
        Ok(DeviceProps {
            name: self.cfg.name.clone(),
            arch: self.cfg.arch.clone(),
            multiprocessors: 132,
            pdl: self.cfg.pdl,
        })
    }

    fn stream_create(&mut self) -> DriverResult<Handle> {
        self.call("stream_create", String::new(), false)?;
        let s = self.handle();
        self.streams.push(s);
        Ok(s)
    }

    fn stream_destroy(&mut self, stream: Handle) {
        let _ = self.call("stream_destroy", String::new(), false);
        self.streams.retain(|&s| s != stream);
    }

    fn stream_synchronize(&mut self, _stream: Handle) -> DriverResult<()> {
        self.call("stream_synchronize", String::new(), false)?;
        self.in_flight = 0;
        Ok(())
    }

    fn mem_free(&mut self) -> DriverResult<u64> {
        // Not a recorded call: the call log stays what the tests expect.
        Ok(self.cfg.memory_limit.saturating_sub(self.live_bytes()))
    }

    fn malloc(&mut self, bytes: u64) -> DriverResult<DevPtr> {
        self.call("malloc", bytes.to_string(), false)?;
        if self.live_bytes() + bytes > self.cfg.memory_limit {
            return Err(DriverError {
                kind: ErrorKind::OutOfMemory,
                code: 2,
                description: format!("simErrorMemoryAllocation (2): {bytes} bytes"),
            });
        }
        let base = self.next_addr;
        self.next_addr = (base + bytes + 4096).div_ceil(256) * 256;
        self.mem.insert(base, vec![0xA5; bytes as usize]);
        Ok(DevPtr(base))
    }

    fn free(&mut self, ptr: DevPtr) -> DriverResult<()> {
        self.call("free", format!("{:#x}", ptr.0), false)?;
        if self.in_flight > 0 {
            self.violation(format!("free({:#x}) with work in flight", ptr.0));
        }
        self.mem
            .remove(&ptr.0)
            .map(|_| ())
            .ok_or_else(|| DriverError::other(1, "simErrorInvalidValue (1): not an allocation"))
    }

    fn memset_zero(&mut self, ptr: DevPtr, bytes: u64, _stream: Handle) -> DriverResult<()> {
        self.call("memset", String::new(), false)?;
        self.region(ptr.0, bytes)?.fill(0);
        Ok(())
    }

    fn copy_to_device(&mut self, dst: DevPtr, src: &[u8], _stream: Handle) -> DriverResult<()> {
        self.call("copy_to_device", src.len().to_string(), false)?;
        self.region(dst.0, src.len() as u64)?.copy_from_slice(src);
        Ok(())
    }

    fn copy_to_host(&mut self, dst: &mut [u8], src: DevPtr, _stream: Handle) -> DriverResult<()> {
        self.call("copy_to_host", dst.len().to_string(), false)?;
        dst.copy_from_slice(self.region(src.0, dst.len() as u64)?);
        Ok(())
    }

    fn copy_device(
        &mut self,
        dst: DevPtr,
        src: DevPtr,
        bytes: u64,
        _stream: Handle,
    ) -> DriverResult<()> {
        self.call("copy_device", bytes.to_string(), true)?;
        self.submit(Node::Copy { dst, src, bytes })
    }

    fn module_load(&mut self, image: &KernelImage) -> DriverResult<Handle> {
        self.call("module_load", image.name.clone(), false)?;
        let text = String::from_utf8_lossy(&image.code);
        let mut lines = text.lines();
        let header = lines.next().unwrap_or("");
        let no_binary = |why: String| DriverError {
            kind: ErrorKind::NoBinaryForDevice,
            code: 209,
            description: format!("simErrorNoBinaryForGpu (209): {why}"),
        };
        match header.split_once(' ') {
            Some((MAGIC, arch)) if arch == self.cfg.arch => {}
            Some((MAGIC, arch)) => {
                return Err(no_binary(format!(
                    "module built for {arch}, device is {}",
                    self.cfg.arch
                )))
            }
            _ => return Err(no_binary("not a simulated module image".into())),
        }
        let m = self.handle();
        self.modules
            .insert(m, lines.map(str::to_string).collect::<Vec<_>>());
        Ok(m)
    }

    fn module_unload(&mut self, module: Handle) {
        let _ = self.call("module_unload", String::new(), false);
        self.modules.remove(&module);
    }

    fn function(&mut self, module: Handle, name: &str) -> Option<Handle> {
        let _ = self.call("function", name.to_string(), true);
        if !self.modules.get(&module)?.iter().any(|e| e == name) {
            return None;
        }
        let f = self.handle();
        self.functions.insert(f, name.to_string());
        Some(f)
    }

    fn occupancy(
        &mut self,
        function: Handle,
        block_threads: u32,
        shared_bytes: u32,
    ) -> DriverResult<u32> {
        let entry = self
            .functions
            .get(&function)
            .cloned()
            .ok_or_else(|| DriverError::other(400, "simErrorInvalidHandle (400): function"))?;
        self.call(
            "occupancy",
            format!("{entry}, {block_threads} threads, {shared_bytes} shared"),
            true,
        )?;
        if self.cfg.blocks_per_sm == 0 {
            return Err(DriverError::other(
                801,
                "simErrorNotSupported (801): occupancy queries",
            ));
        }
        let by_shared = match (self.cfg.shared_per_sm, shared_bytes) {
            (0, _) | (_, 0) => u32::MAX,
            (per_sm, s) => per_sm / s,
        };
        Ok(self.cfg.blocks_per_sm.min(by_shared))
    }

    fn allow_dynamic_shared(&mut self, function: Handle, want: u32) -> DriverResult<u32> {
        let entry = self
            .functions
            .get(&function)
            .cloned()
            .ok_or_else(|| DriverError::other(400, "simErrorInvalidHandle (400): function"))?;
        let grant = want.min(self.cfg.dynamic_shared);
        self.call(
            "allow_dynamic_shared",
            format!("{entry}, {want} -> {grant}"),
            true,
        )?;
        if grant > 0 {
            self.shared_grants.insert(function, grant);
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
        _stream: Handle,
    ) -> DriverResult<()> {
        let entry = self
            .functions
            .get(&function)
            .cloned()
            .ok_or_else(|| DriverError::other(400, "simErrorInvalidHandle (400): function"))?;
        let mut detail = if pdl {
            format!("{entry}, pdl")
        } else {
            entry.clone()
        };
        if dims.cluster > 1 {
            detail.push_str(&format!(", cluster {}", dims.cluster));
        }
        // Above the default 48 KiB a launch needs the function's grant (as
        // on CUDA, where it fails with an invalid value otherwise).
        const DEFAULT_SHARED: u32 = 48 << 10;
        if dims.shared_bytes > DEFAULT_SHARED {
            detail.push_str(&format!(", shared {}", dims.shared_bytes));
        }
        self.call("launch_kernel", detail, true)?;
        if dims.shared_bytes > DEFAULT_SHARED
            && self.shared_grants.get(&function).copied().unwrap_or(0) < dims.shared_bytes
        {
            return Err(DriverError::other(
                1,
                "simErrorInvalidValue (1): dynamic shared memory above the function's granted maximum",
            ));
        }
        if pdl && !self.cfg.pdl {
            return Err(DriverError::other(
                1,
                "simErrorInvalidValue (1): programmatic dependent launch is not supported",
            ));
        }
        // Clusters come with PDL (sm_90); either needs the simulated part to
        // offer it. A cluster must tile the grid's x dimension.
        if dims.cluster > 1 && (!self.cfg.pdl || !dims.grid[0].is_multiple_of(dims.cluster)) {
            return Err(DriverError::other(
                1,
                "simErrorInvalidClusterSize (1): thread-block cluster not supported for this launch",
            ));
        }
        self.submit(Node::Kernel {
            entry,
            params: params.to_vec(),
            offsets: offsets.to_vec(),
            grid: dims.grid,
        })
    }

    fn begin_capture(&mut self, _stream: Handle) -> DriverResult<()> {
        self.call("begin_capture", String::new(), true)?;
        if self.capturing.is_some() {
            return Err(DriverError::other(
                900,
                "simErrorIllegalState: capture open",
            ));
        }
        self.capturing = Some(Vec::new());
        Ok(())
    }

    fn end_capture(&mut self, _stream: Handle) -> DriverResult<Handle> {
        let r = self.call("end_capture", String::new(), true);
        let nodes = self.capturing.take().ok_or_else(|| {
            DriverError::other(
                901,
                "simErrorStreamCaptureInvalidated (901): the capture was invalidated",
            )
        })?;
        r?;
        let g = self.handle();
        self.graphs.insert(g, nodes);
        Ok(g)
    }

    fn instantiate(&mut self, graph: Handle) -> DriverResult<Handle> {
        self.call("instantiate", String::new(), false)?;
        let nodes = self
            .graphs
            .get(&graph)
            .cloned()
            .ok_or_else(|| DriverError::other(400, "simErrorInvalidHandle (400): graph"))?;
        let e = self.handle();
        self.execs.insert(e, nodes);
        Ok(e)
    }

    fn graph_launch(&mut self, exec: Handle, _stream: Handle) -> DriverResult<()> {
        self.call("graph_launch", String::new(), false)?;
        let nodes = self
            .execs
            .get(&exec)
            .cloned()
            .ok_or_else(|| DriverError::other(400, "simErrorInvalidHandle (400): exec"))?;
        nodes.iter().try_for_each(|n| self.execute(n))
    }

    fn exec_destroy(&mut self, exec: Handle) -> DriverResult<()> {
        self.call("exec_destroy", String::new(), false)?;
        if self.in_flight > 0 {
            self.violation("exec_destroy with work in flight".to_string());
        }
        self.execs
            .remove(&exec)
            .map(|_| ())
            .ok_or_else(|| DriverError::other(400, "simErrorInvalidHandle (400): exec"))
    }

    fn graph_destroy(&mut self, graph: Handle) -> DriverResult<()> {
        self.call("graph_destroy", String::new(), false)?;
        self.graphs
            .remove(&graph)
            .map(|_| ())
            .ok_or_else(|| DriverError::other(400, "simErrorInvalidHandle (400): graph"))
    }

    fn clear_error(&mut self) {
        self.journal.with(|j| j.log.push("clear_error".into()));
    }

    fn event_create(&mut self) -> DriverResult<Handle> {
        self.call("event_create", String::new(), false)?;
        let e = self.handle();
        self.events.insert(e, None);
        Ok(e)
    }

    fn event_record(&mut self, event: Handle, _stream: Handle) -> DriverResult<()> {
        self.call("event_record", String::new(), true)?;
        self.submit(Node::Event(event))
    }

    fn event_elapsed_ms(&mut self, from: Handle, to: Handle) -> DriverResult<f32> {
        self.call("event_elapsed", String::new(), false)?;
        match (self.events.get(&from), self.events.get(&to)) {
            (Some(Some(a)), Some(Some(b))) => Ok(((b - a) / 1e3) as f32),
            _ => Err(DriverError::other(
                600,
                "simErrorNotReady (600): event not recorded",
            )),
        }
    }

    fn event_destroy(&mut self, event: Handle) {
        let _ = self.call("event_destroy", String::new(), false);
        self.events.remove(&event);
    }

    fn blas_create(&mut self) -> DriverResult<Handle> {
        self.call("blas_create", String::new(), false)?;
        let h = self.handle();
        self.blas = Some(h);
        Ok(h)
    }

    fn blas_algorithms(
        &mut self,
        _blas: Handle,
        shape: &GemmShape,
        max_workspace: u64,
    ) -> DriverResult<Vec<BlasAlgorithm>> {
        self.call(
            "blas_algorithms",
            format!("{}x{}x{}, max {max_workspace}", shape.t, shape.n, shape.k),
            false,
        )?;
        let id = self.handle();
        let needs = self.cfg.algorithm_workspace;
        self.algorithms.insert(id, needs);
        Ok(vec![BlasAlgorithm {
            id,
            workspace: needs,
        }])
    }

    fn blas_matmul(
        &mut self,
        _blas: Handle,
        shape: &GemmShape,
        algorithm: BlasAlgorithm,
        ops: &GemmOperands,
        workspace: Option<(DevPtr, u64)>,
        _stream: Handle,
    ) -> DriverResult<()> {
        self.call("blas_matmul", String::new(), true)?;
        let needs = *self
            .algorithms
            .get(&algorithm.id)
            .ok_or_else(|| DriverError::other(7, "simBlasStatusInvalidValue (7): algorithm"))?;
        self.submit(Node::Matmul {
            shape: *shape,
            ops: *ops,
            needs,
            workspace,
        })
    }

    fn blas_destroy(&mut self, _blas: Handle) {
        let _ = self.call("blas_destroy", String::new(), false);
        self.blas = None;
        self.algorithms.clear();
    }

    fn all_reduce_sum(
        &mut self,
        src: DevPtr,
        dst: DevPtr,
        count: u64,
        (from, to): (DType, DType),
        _stream: Handle,
    ) -> DriverResult<()> {
        if self.exchange.is_none() {
            return Err(DriverError::other(
                -1,
                "this GPU driver has no collective communicator: tensor-parallel plans need the CUDA driver with NCCL (one device per rank)",
            ));
        }
        self.call("all_reduce_sum", format!("{count} {from}->{to}"), true)?;
        if from != DType::F32 || to != DType::F32 {
            return Err(DriverError::other(
                15,
                "simErrorNotSupported (15): the simulated all-reduce is f32 only",
            ));
        }
        self.submit(Node::AllReduce { src, dst, count })
    }

    fn sharded_argmax(
        &mut self,
        src: DevPtr,
        dst: DevPtr,
        (rows, vocab): (u64, u64),
        dtype: DType,
        _stream: Handle,
    ) -> DriverResult<()> {
        if self.exchange.is_none() {
            return Err(DriverError::other(
                -1,
                "this GPU driver has no collective communicator: tensor-parallel plans need the CUDA driver with NCCL (one device per rank)",
            ));
        }
        self.call("sharded_argmax", format!("{rows}x{vocab} {dtype}"), true)?;
        if dtype != DType::F32 {
            return Err(DriverError::other(
                15,
                "simErrorNotSupported (15): the simulated argmax is f32 only",
            ));
        }
        self.submit(Node::ShardedArgmax {
            src,
            dst,
            rows,
            vocab,
        })
    }
}

impl Drop for SimDriver {
    fn drop(&mut self) {
        let live = LiveAtDrop {
            allocations: self.mem.len(),
            graphs: self.graphs.len(),
            execs: self.execs.len(),
            streams: self.streams.len(),
            events: self.events.len(),
            modules: self.modules.len(),
            blas: self.blas.is_some(),
        };
        self.journal.with(|j| j.at_drop = Some(live));
    }
}
