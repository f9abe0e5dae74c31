//! One GPU backend for every vendor: [`GpuBackend`] implements the
//! [`Backend`] seam once over a [`GpuDriver`], the thin layer that speaks
//! one vendor's runtime and BLAS-Lt library.
//!
//! * Memory: every allocation is in a table, so a copy or a kernel pointer
//!   outside every live allocation is [`BackendError::BadAddress`] before it
//!   reaches the device. New allocations are zeroed.
//! * The capture contract ([`crate::capture`], shared with the CPU backend):
//!   inside a capture, `alloc`, `free`, `synchronize`, `download`, `upload`,
//!   `load_kernels`, `reserve_workspace`, `prepare`, `replay`,
//!   `destroy_graph` and timing are [`BackendError::CaptureContract`] errors
//!   naming the key and the call, checked before any driver call so the
//!   capture stays intact. A launch that fails while capturing is
//!   [`BackendError::CaptureFailed`] naming the key and the op.
//! * Launches consume [`Launch::body`] as the plan lowered it: kernel lists
//!   are launched as written (entry looked up in the loaded modules,
//!   parameters packed only by [`ResolvedKernel::pack`]), a GEMM is what
//!   the plan recorded: one BLAS-Lt call or kiln's GEMV / skinny-GEMM
//!   kernel launch. The backend never
//!   lowers an op itself: [`LaunchBody::Reference`] is an error telling the
//!   user to recompile.
//! * GEMMs: the workspace is reserved before any capture; at `prepare` each
//!   shape's algorithm is chosen under the granted workspace and refused
//!   with [`BackendError::WorkspaceTooSmall`] if it needs more. Which
//!   implementation a GEMM uses is the plan's (`kiln compile`, optionally
//!   from a `kiln tune` table); nothing is timed at load. A plan whose
//!   choice this backend cannot run (a kernel its modules lack, a kind
//!   without its launch) is refused at `prepare`.
//! * A workspace outgrown after a capture is retired, not freed: a graph may
//!   still hold its address. Teardown synchronizes before destroying graph
//!   executables, releases the BLAS handle before the memory, and is safe
//!   with work in flight or a capture open.
//!
//! Not here: the graphs-or-eager decision (the engine's policy), vendor
//! extras (HIP's runtime compilation lives in its driver), and kernel
//! lowering (the compiler writes it into the plan).

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod driver;
pub mod hip;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod sim;

use crate::backend::{
    Backend, BackendError, DevOperand, DevPtr, DeviceInfo, GraphHandle, Launch, LaunchBody,
    ResolvedKernel, ResolvedParam, Result, TimingMark,
};
use crate::capture::{CaptureState, GraphCounters, GraphTable};
use driver::{
    BlasAlgorithm, DeviceProps, Dims, DriverError, ErrorKind, GemmOperands, GpuDriver, Handle,
    Vendor,
};
use kiln_ir::plan::{GemmKind, GemmShape, KernelImage};
use kiln_ir::Key;
use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

/// How one GEMM runs, resolved at `prepare` from the plan's
/// [`kiln_ir::plan::GemmKind`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmChoice {
    /// The library, with the algorithm its heuristic gave under the
    /// planned workspace.
    Blas(BlasAlgorithm),
    /// The plan's kiln kernel (`gemv` or `skinny`).
    Kernel(GemmKind),
}

/// What the backend did, for tests and benchmarks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuCounters {
    /// Captures and replays per key.
    pub graphs: GraphCounters,
    /// `launch` calls executed directly (outside any capture).
    pub eager_launches: u64,
    /// Kernels launched or recorded.
    pub kernel_launches: u64,
    /// BLAS-Lt matmuls launched or recorded.
    pub blas_calls: u64,
    /// GEMMs that ran as kiln's GEMV kernel.
    pub gemv_calls: u64,
    /// GEMMs that ran as kiln's tensor-core skinny-GEMM kernel.
    pub skinny_calls: u64,
    /// Persistent megakernel steps launched or recorded (each is two
    /// kernels: the counter reset and the interpreter).
    pub megakernel_launches: u64,
    /// GEMM shapes whose BLAS algorithm was looked up.
    pub gemm_choices: u64,
    /// Buffers outgrown after a capture and kept until teardown.
    pub retired_buffers: u64,
}

/// Timing events kept live at once; older marks are refused.
pub(crate) const EVENT_RING: u64 = 64;

struct Allocation {
    bytes: u64,
    what: String,
}

/// The BLAS algorithm cache key: the shape and the workspace granted.
type GemmKey = (GemmShape, u64);

/// kiln's GPU backend over a driver. See the module docs.
pub struct GpuBackend<D: GpuDriver> {
    driver: D,
    vendor: Vendor,
    ordinal: u32,
    info: DeviceInfo,
    props: DeviceProps,
    stream: Handle,
    allocs: BTreeMap<u64, Allocation>,
    /// Loaded modules, by image name, in load order.
    modules: Vec<(String, Handle)>,
    /// Resolved entry points, by (module, entry).
    functions: HashMap<(String, String), Handle>,
    blas: Option<Handle>,
    /// BLAS algorithms, by shape and granted workspace.
    gemms: HashMap<GemmKey, BlasAlgorithm>,
    pdl: bool,
    workspace: Option<(DevPtr, u64)>,
    /// Buffers outgrown after a capture: graphs may still use them.
    retired: Vec<DevPtr>,
    captured_any: bool,
    capture: CaptureState,
    graphs: GraphTable<(Handle, Handle)>,
    events: Vec<Handle>,
    marks: u64,
    counters: GpuCounters,
    /// Persistent kernels (entry, blocks) whose co-residency `prepare`
    /// checked: only those may launch.
    persistent_ok: std::collections::HashMap<(String, u32), u32>,
}

fn range_ok(allocs: &BTreeMap<u64, Allocation>, ptr: DevPtr, len: u64) -> bool {
    match allocs.range(..=ptr.0).next_back() {
        Some((&base, a)) => ptr
            .0
            .checked_add(len)
            .is_some_and(|end| end <= base + a.bytes.max(1)),
        None => false,
    }
}

/// `t x n x k dtype -> out (+bias)`, for messages.
pub fn describe_gemm(s: &GemmShape) -> String {
    format!(
        "GEMM {}x{}x{} {} -> {}{}",
        s.t,
        s.n,
        s.k,
        s.dtype,
        s.out,
        if s.bias { " +bias" } else { "" }
    )
}

impl<D: GpuDriver> GpuBackend<D> {
    /// A backend on device `ordinal` of `driver`: binds it and creates the
    /// backend's one stream.
    pub fn with_driver(mut driver: D, ordinal: u32) -> Result<Self> {
        let vendor = driver.vendor();
        let count = driver.device_count();
        if ordinal >= count {
            return Err(BackendError::Device(format!(
                "no {} device {ordinal}: {count} device(s) visible ({})",
                vendor.backend_name(),
                driver.no_device_reason()
            )));
        }
        driver
            .set_device(ordinal)
            .map_err(|e| e.during("set device"))?;
        let props = driver.device_props(ordinal)?;
        let stream = driver
            .stream_create()
            .map_err(|e| e.during("stream create"))?;
        let info = DeviceInfo {
            backend: vendor.backend_name(),
            ordinal,
            name: props.name.clone(),
            arch: props.arch.clone(),
        };
        Ok(GpuBackend {
            vendor,
            ordinal,
            info,
            pdl: props.pdl,
            props,
            stream,
            driver,
            allocs: BTreeMap::new(),
            modules: Vec::new(),
            functions: HashMap::new(),
            blas: None,
            gemms: HashMap::new(),
            workspace: None,
            retired: Vec::new(),
            captured_any: false,
            capture: CaptureState::default(),
            graphs: GraphTable::default(),
            events: Vec::new(),
            marks: 0,
            counters: GpuCounters::default(),
            persistent_ok: Default::default(),
        })
    }

    /// The driver (tests inspect a simulated one).
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// The driver, mutably (tests inject failures into a simulated one).
    pub fn driver_mut(&mut self) -> &mut D {
        &mut self.driver
    }

    /// The device as the driver reported it.
    pub fn props(&self) -> &DeviceProps {
        &self.props
    }

    /// What the backend did (captures, replays, launches, ...).
    pub fn counters(&self) -> &GpuCounters {
        &self.counters
    }

    /// `(what, bytes)` of every live allocation made through `alloc`.
    pub fn live_allocations(&self) -> Vec<(String, u64)> {
        self.allocs
            .values()
            .map(|a| (a.what.clone(), a.bytes))
            .collect()
    }

    /// Bytes allocated through `alloc` and still live.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocs.values().map(|a| a.bytes).sum()
    }

    /// Turns the programmatic-dependent-launch attribute on or off (it is
    /// never set on a device that does not support it).
    pub fn set_pdl(&mut self, on: bool) {
        self.pdl = on && self.props.pdl;
    }

    pub fn pdl(&self) -> bool {
        self.pdl
    }

    /// How the GEMM of `launch` runs, once `prepare` resolved it.
    pub fn gemm_choice(&self, launch: &Launch) -> Option<GemmChoice> {
        match &launch.body {
            LaunchBody::Gemm {
                kind: GemmKind::Blas,
                shape,
                ..
            } => self
                .gemms
                .get(&(*shape, self.granted(launch)))
                .copied()
                .map(GemmChoice::Blas),
            LaunchBody::Gemm {
                kind,
                kernel: Some(k),
                ..
            } => self
                .functions
                .contains_key(&(k.module.clone(), k.entry.clone()))
                .then_some(GemmChoice::Kernel(*kind)),
            _ => None,
        }
    }

    fn bind(&mut self) -> Result<()> {
        self.driver
            .set_device(self.ordinal)
            .map_err(|e| e.during("set device"))
    }

    fn sync_stream(&mut self, why: &str) -> Result<()> {
        self.driver
            .stream_synchronize(self.stream)
            .map_err(|e| e.during(&format!("stream synchronize ({why})")))
    }

    fn malloc(&mut self, bytes: u64, what: &str) -> Result<DevPtr> {
        self.driver.malloc(bytes.max(1)).map_err(|e| match e.kind {
            ErrorKind::OutOfMemory => BackendError::OutOfMemory {
                bytes,
                what: what.to_string(),
            },
            _ => e.during(&format!("device malloc({bytes}) for {what}")),
        })
    }

    fn release(&mut self, ptr: DevPtr) {
        // Best effort: used on error paths and at teardown.
        let _ = self.driver.free(ptr);
    }

    fn check_range(&self, ptr: DevPtr, len: u64) -> Result<()> {
        let owned = |p: &Option<(DevPtr, u64)>| {
            p.is_some_and(|(b, n)| ptr.0 >= b.0 && ptr.0.saturating_add(len) <= b.0 + n)
        };
        if range_ok(&self.allocs, ptr, len) || owned(&self.workspace) {
            Ok(())
        } else {
            Err(BackendError::BadAddress(ptr.0))
        }
    }

    fn check_operands(&self, ops: &[DevOperand]) -> Result<()> {
        ops.iter()
            .try_for_each(|o| self.check_range(o.ptr, o.ty.size_bytes()))
    }

    fn not_lowered(&self, launch: &Launch) -> BackendError {
        BackendError::Device(format!(
            "op `{}` ({}): plan was not lowered for this target; recompile it with kiln compile --target {}",
            launch.kernel,
            launch.op.mnemonic(),
            self.vendor.target(&self.info.arch)
        ))
    }

    fn not_prepared(what: &str) -> BackendError {
        BackendError::Device(format!(
            "{what} was not prepared before capture: call prepare() for every launch before begin_capture"
        ))
    }

    /// The function for `entry`: from the module named `module` if the plan
    /// has one by that name, else from whichever module defines it.
    fn resolve(&mut self, module: &str, entry: &str) -> Result<Handle> {
        let key = (module.to_string(), entry.to_string());
        if let Some(f) = self.functions.get(&key) {
            return Ok(*f);
        }
        let exact: Vec<Handle> = self
            .modules
            .iter()
            .filter(|(n, _)| n == module)
            .map(|(_, m)| *m)
            .collect();
        let candidates: Vec<Handle> = if exact.is_empty() {
            self.modules.iter().map(|(_, m)| *m).collect()
        } else {
            exact
        };
        for m in candidates {
            if let Some(f) = self.driver.function(m, entry) {
                self.functions.insert(key, f);
                return Ok(f);
            }
        }
        Err(BackendError::MissingKernel(entry.to_string()))
    }

    /// Checks a kernel's pointer parameters lie in live memory (null is an
    /// absent operand).
    fn check_params(&self, k: &ResolvedKernel) -> Result<()> {
        k.params.iter().try_for_each(|p| match p {
            ResolvedParam::Ptr(d) if d.0 != 0 => self.check_range(*d, 0),
            _ => Ok(()),
        })
    }

    fn launch_kernel(&mut self, k: &ResolvedKernel, capturing: bool) -> Result<()> {
        let f = match self.functions.get(&(k.module.clone(), k.entry.clone())) {
            Some(f) => *f,
            None if capturing => return Err(Self::not_prepared(&k.entry)),
            None => self.resolve(&k.module, &k.entry)?,
        };
        self.check_params(k)?;
        let (params, offsets) = k.pack();
        let dims = Dims {
            grid: k.grid,
            block: k.block,
            shared_bytes: k.shared_bytes,
            cluster: k.cluster,
        };
        self.driver
            .launch_kernel(f, dims, k.pdl && self.pdl, &params, &offsets, self.stream)
            .map_err(|e| e.during(&format!("kernel launch ({})", k.entry)))?;
        self.counters.kernel_launches += 1;
        Ok(())
    }

    /// Resolves a persistent step's two kernels and checks the device holds
    /// every block of `run` at once: a block spins on counters that other
    /// blocks bump, so a block that waits for an SM to free up would hang
    /// the step. Refused here, at load, with the figures and the fix.
    fn prepare_megakernel(
        &mut self,
        reset: &ResolvedKernel,
        run: &ResolvedKernel,
        blocks_per_sm: u32,
    ) -> Result<()> {
        if self.vendor != Vendor::Cuda {
            return Err(BackendError::Device(format!(
                "the megakernel schedule runs on CUDA only; this is a {} device: compile the plan with --schedule graph",
                self.vendor.backend_name()
            )));
        }
        self.resolve(&reset.module, &reset.entry)?;
        self.check_params(reset)?;
        let f = self.resolve(&run.module, &run.entry)?;
        self.check_params(run)?;
        let threads = run.block.iter().product::<u32>();
        // `run.shared_bytes` is what the interpreter would like (its GEMV
        // weight stage); it reads what it got from %dynamic_smem_size, so
        // any grant down to 0 is correct. The device grants what it has;
        // a grant that would cost the co-residency the tape needs is
        // dropped, since staging is a speed-up and co-residency is not.
        let occupancy = |d: &mut D, shared: u32| {
            d.occupancy(f, threads, shared)
                .map_err(|e| e.during(&format!("occupancy of {}", run.entry)))
        };
        let mut shared = if run.shared_bytes > 0 {
            self.driver
                .allow_dynamic_shared(f, run.shared_bytes)
                .map_err(|e| e.during(&format!("dynamic shared memory of {}", run.entry)))?
        } else {
            0
        };
        let mut per_sm = occupancy(&mut self.driver, shared)?;
        if shared > 0 && per_sm < blocks_per_sm {
            shared = 0;
            per_sm = occupancy(&mut self.driver, 0)?;
        }
        let sms = self.props.multiprocessors;
        let queues = run.grid.iter().product::<u32>();
        if per_sm < blocks_per_sm || queues as u64 > sms as u64 * per_sm as u64 {
            return Err(BackendError::Device(format!(
                "the plan's megakernel needs {queues} co-resident blocks of {threads} threads ({blocks_per_sm} per SM), but this {} holds {per_sm} per SM on {sms} SMs; recompile with `kiln compile --schedule megakernel --megakernel-sms {sms} --megakernel-blocks-per-sm {}` (or --schedule graph)",
                self.info.name,
                per_sm.clamp(1, blocks_per_sm.max(1)),
            )));
        }
        self.persistent_ok
            .insert((run.entry.clone(), run.grid[0]), shared);
        Ok(())
    }

    /// The workspace the plan grants this GEMM: exactly `Launch.workspace`
    /// (none: 0). The backend's reserved workspace is never a fallback
    /// grant, so an algorithm is chosen under the plan's figure only.
    fn granted(&self, launch: &Launch) -> u64 {
        launch.workspace.map_or(0, |(_, bytes)| bytes)
    }

    fn gemm_operands(launch: &Launch, shape: &GemmShape) -> Result<GemmOperands> {
        let want = if shape.bias { 3 } else { 2 };
        match (launch.args.as_slice(), launch.results.first()) {
            (args, Some(out)) if args.len() == want => Ok(GemmOperands {
                x: args[0].ptr,
                w: args[1].ptr,
                bias: args.get(2).map(|b| b.ptr),
                out: out.ptr,
            }),
            _ => Err(BackendError::Device(format!(
                "op `{}`: a {} takes {want} arguments and a result but the launch has {} and {}; the plan is damaged, recompile it",
                launch.kernel,
                describe_gemm(shape),
                launch.args.len(),
                launch.results.len()
            ))),
        }
    }

    fn blas_handle(&mut self) -> Result<Handle> {
        match self.blas {
            Some(h) => Ok(h),
            None => {
                let h = self
                    .driver
                    .blas_create()
                    .map_err(|e| e.during("BLAS-Lt handle create"))?;
                self.blas = Some(h);
                Ok(h)
            }
        }
    }

    /// The library's algorithm for `shape` under `granted` workspace bytes.
    fn blas_algorithm(&mut self, shape: &GemmShape, granted: u64) -> Result<BlasAlgorithm> {
        let h = self.blas_handle()?;
        let what = describe_gemm(shape);
        let algos = self
            .driver
            .blas_algorithms(h, shape, granted)
            .map_err(|e| e.during(&format!("BLAS-Lt heuristic for {what}")))?;
        if let Some(a) = algos.iter().find(|a| a.workspace <= granted) {
            return Ok(*a);
        }
        match algos.iter().map(|a| a.workspace).min() {
            Some(needed) => Err(BackendError::WorkspaceTooSmall {
                what,
                needed,
                granted,
            }),
            None => Err(BackendError::Device(format!(
                "the BLAS-Lt library proposes no algorithm for {what} within {granted} bytes of workspace; recompile the plan for this device/library (kiln compile --target {})",
                self.vendor.target(&self.info.arch)
            ))),
        }
    }

    /// The plan's GEMM choice as this backend runs it: a kiln kind with its
    /// launch (module `gemv` / `skinny`), or `Blas` with none. Anything else
    /// is a damaged plan.
    fn gemm_kernel<'a>(
        launch: &'a Launch,
        kind: GemmKind,
        kernel: Option<&'a ResolvedKernel>,
    ) -> Result<Option<&'a ResolvedKernel>> {
        match (kind.module(), kernel) {
            (None, None) => Ok(None),
            (Some(m), Some(k)) if k.module == m => Ok(Some(k)),
            (m, k) => Err(BackendError::Device(format!(
                "op `{}`: the plan records a `{kind}` GEMM with {}, but that kind launches {}; the plan is damaged, recompile it",
                launch.kernel,
                k.map_or("no kernel".to_string(), |k| format!("kernel `{}` of module `{}`", k.entry, k.module)),
                m.map_or("no kernel".to_string(), |m| format!("a kernel of module `{m}`")),
            ))),
        }
    }

    fn run_gemm(&mut self, launch: &Launch, shape: &GemmShape, choice: GemmChoice) -> Result<()> {
        match (choice, &launch.body) {
            (GemmChoice::Kernel(kind), LaunchBody::Gemm { kernel: Some(k), .. }) => {
                self.launch_kernel(k, self.capture.key().is_some())?;
                match kind {
                    GemmKind::Skinny => self.counters.skinny_calls += 1,
                    _ => self.counters.gemv_calls += 1,
                }
                Ok(())
            }
            (GemmChoice::Blas(algo), _) => {
                let ops = Self::gemm_operands(launch, shape)?;
                let ws = launch.workspace;
                let h = self.blas_handle()?;
                self.driver
                    .blas_matmul(h, shape, algo, &ops, ws, self.stream)
                    .map_err(|e| e.during(&format!("BLAS-Lt matmul ({})", describe_gemm(shape))))?;
                self.counters.blas_calls += 1;
                Ok(())
            }
            (GemmChoice::Kernel(kind), _) => Err(BackendError::Device(format!(
                "op `{}`: a `{kind}` GEMM carries no kernel launch; the plan is damaged, recompile it",
                launch.kernel
            ))),
        }
    }

    /// Resolves how the plan's GEMM runs: its kernel's entry point (refused
    /// if the loaded modules lack it) or the library's algorithm under the
    /// planned workspace. Nothing is timed: the plan decided.
    fn prepare_gemm(&mut self, launch: &Launch, shape: &GemmShape) -> Result<GemmChoice> {
        let LaunchBody::Gemm { kind, kernel, .. } = &launch.body else {
            return Err(self.not_lowered(launch));
        };
        let kind = *kind;
        Self::gemm_operands(launch, shape)?;
        if let Some(k) = Self::gemm_kernel(launch, kind, kernel.as_ref())? {
            let k = k.clone();
            self.resolve(&k.module, &k.entry).map_err(|e| match e {
                BackendError::MissingKernel(entry) => BackendError::Device(format!(
                    "op `{}`: the plan runs its {} as `{kind}` (kernel `{entry}`), which the loaded kernel modules do not define; recompile the plan (kiln compile --target {})",
                    launch.kernel,
                    describe_gemm(shape),
                    self.vendor.target(&self.info.arch)
                )),
                e => e,
            })?;
            self.check_params(&k)?;
            return Ok(GemmChoice::Kernel(kind));
        }
        let granted = self.granted(launch);
        if let Some(a) = self.gemms.get(&(*shape, granted)) {
            return Ok(GemmChoice::Blas(*a));
        }
        let algo = self.blas_algorithm(shape, granted)?;
        self.gemms.insert((*shape, granted), algo);
        self.counters.gemm_choices += 1;
        Ok(GemmChoice::Blas(algo))
    }

    /// Runs (or records) one op. `Err` is the failure as such; the caller
    /// turns it into a capture failure when capturing.
    fn run(&mut self, launch: &Launch, capturing: bool) -> Result<()> {
        self.check_operands(&launch.args)?;
        self.check_operands(&launch.results)?;
        match &launch.body {
            LaunchBody::Reference => Err(self.not_lowered(launch)),
            LaunchBody::Collective => {
                let (x, y) = (&launch.args[0], &launch.results[0]);
                let stream = self.stream;
                let done = match &launch.op {
                    kiln_ir::Op::ShardedArgmax { .. } => {
                        let d = x.ty.shape.dims();
                        let (rows, vocab) = match d {
                            [r, v] => (*r as u64, *v as u64),
                            _ => (1, x.ty.numel()),
                        };
                        self.driver
                            .sharded_argmax(x.ptr, y.ptr, (rows, vocab), x.ty.dtype, stream)
                    }
                    _ => self.driver.all_reduce_sum(
                        x.ptr,
                        y.ptr,
                        x.ty.numel(),
                        (x.ty.dtype, y.ty.dtype),
                        stream,
                    ),
                };
                done.map_err(|e| BackendError::Device(e.description))
            }
            LaunchBody::Kernels(ks) => ks.iter().try_for_each(|k| self.launch_kernel(k, capturing)),
            LaunchBody::Megakernel { reset, run, .. } => {
                let Some(&shared) = self.persistent_ok.get(&(run.entry.clone(), run.grid[0]))
                else {
                    return Err(Self::not_prepared(&run.entry));
                };
                self.launch_kernel(reset, capturing)?;
                if shared == run.shared_bytes {
                    self.launch_kernel(run, capturing)?;
                } else {
                    let granted = ResolvedKernel {
                        shared_bytes: shared,
                        ..run.clone()
                    };
                    self.launch_kernel(&granted, capturing)?;
                }
                self.counters.megakernel_launches += 1;
                Ok(())
            }
            LaunchBody::Gemm { shape, .. } => {
                let shape = *shape;
                let choice = match self.gemm_choice(launch) {
                    Some(c) => c,
                    None if capturing => return Err(Self::not_prepared(&describe_gemm(&shape))),
                    None => self.prepare_gemm(launch, &shape)?,
                };
                self.run_gemm(launch, &shape, choice)
            }
        }
    }

    fn destroy_pair(
        &mut self,
        graph: Handle,
        exec: Handle,
    ) -> std::result::Result<(), DriverError> {
        let a = self.driver.exec_destroy(exec);
        let b = self.driver.graph_destroy(graph);
        a.and(b)
    }

    fn event_of(&self, mark: TimingMark) -> Result<Handle> {
        let n = mark.event.ok_or_else(|| {
            BackendError::Device(
                "timing mark was not taken by this GPU backend (it carries no event)".into(),
            )
        })?;
        if n >= self.marks || self.marks - n > EVENT_RING {
            return Err(BackendError::Device(format!(
                "timing mark {n} is no longer live: at most {EVENT_RING} marks are kept; compare marks taken closer together"
            )));
        }
        Ok(self.events[(n % EVENT_RING) as usize])
    }
}

impl<D: GpuDriver> Backend for GpuBackend<D> {
    fn info(&self) -> DeviceInfo {
        self.info.clone()
    }

    fn free_memory(&mut self) -> Result<Option<u64>> {
        self.bind()?;
        self.driver
            .mem_free()
            .map(Some)
            .map_err(|e| e.during("reading the device's free memory"))
    }

    fn alloc(&mut self, bytes: u64, what: &str) -> Result<DevPtr> {
        self.capture
            .forbid_with(|| format!("alloc({bytes} bytes for {what})"))?;
        self.bind()?;
        let p = self.malloc(bytes, what)?;
        let zeroed = self
            .driver
            .memset_zero(p, bytes, self.stream)
            .map_err(|e| e.during("memset"))
            .and_then(|()| self.sync_stream("zeroing a new allocation"));
        if let Err(e) = zeroed {
            self.release(p);
            return Err(e);
        }
        self.allocs.insert(
            p.0,
            Allocation {
                bytes,
                what: what.to_string(),
            },
        );
        Ok(p)
    }

    fn free(&mut self, ptr: DevPtr) -> Result<()> {
        self.capture.forbid_with(|| format!("free({:#x})", ptr.0))?;
        if !self.allocs.contains_key(&ptr.0) {
            return Err(BackendError::BadAddress(ptr.0));
        }
        self.bind()?;
        // Work in flight may still read it.
        self.sync_stream("before a free")?;
        self.allocs.remove(&ptr.0);
        self.driver.free(ptr).map_err(|e| e.during("device free"))
    }

    fn upload(&mut self, dst: DevPtr, data: &[u8]) -> Result<()> {
        self.capture
            .forbid_with(|| format!("upload({} bytes to {:#x})", data.len(), dst.0))?;
        if data.is_empty() {
            return Ok(());
        }
        self.check_range(dst, data.len() as u64)?;
        self.bind()?;
        self.driver
            .copy_to_device(dst, data, self.stream)
            .map_err(|e| e.during("host-to-device copy"))?;
        // Pageable host memory: wait so the caller may reuse `data`.
        self.sync_stream("after an upload")
    }

    fn download(&mut self, src: DevPtr, out: &mut [u8]) -> Result<()> {
        self.capture
            .forbid_with(|| format!("download({} bytes from {:#x})", out.len(), src.0))?;
        if out.is_empty() {
            return Ok(());
        }
        self.check_range(src, out.len() as u64)?;
        self.bind()?;
        self.driver
            .copy_to_host(out, src, self.stream)
            .map_err(|e| e.during("device-to-host copy"))?;
        self.sync_stream("after a download")
    }

    fn load_kernels(&mut self, images: &[KernelImage]) -> Result<()> {
        self.capture.forbid("load_kernels")?;
        self.bind()?;
        let target = self.vendor.target(&self.info.arch);
        for image in images {
            if !self.vendor.loads(&image.kind) {
                return Err(BackendError::Device(format!(
                    "kernel image `{}` is a {:?} image, which the {} backend cannot load: this plan was compiled for another target; recompile it with kiln compile --target {target}",
                    image.name,
                    image.kind,
                    self.vendor.backend_name()
                )));
            }
            match self.driver.module_load(image) {
                Ok(m) => self.modules.push((image.name.clone(), m)),
                Err(e) if e.kind == ErrorKind::NoBinaryForDevice => {
                    return Err(BackendError::Device(format!(
                        "the plan's kernel module `{}` has no code for this device ({}, {}): {}; recompile the plan with kiln compile --target {target}",
                        image.name, self.info.name, self.info.arch, e.description
                    )))
                }
                Err(e) => return Err(e.during(&format!("module load ({})", image.name))),
            }
        }
        Ok(())
    }

    fn reserve_workspace(&mut self, bytes: u64) -> Result<Option<(DevPtr, u64)>> {
        self.capture.forbid("reserve_workspace")?;
        if bytes == 0 || self.workspace.is_some_and(|(_, have)| have >= bytes) {
            return Ok(self.workspace);
        }
        self.bind()?;
        let p = self.malloc(bytes, "BLAS workspace")?;
        if let Some((old, _)) = self.workspace.replace((p, bytes)) {
            if self.captured_any {
                self.retired.push(old);
                self.counters.retired_buffers += 1;
            } else {
                let _ = self.sync_stream("before freeing an outgrown workspace");
                self.release(old);
            }
        }
        Ok(self.workspace)
    }

    fn prepare(&mut self, launch: &Launch) -> Result<()> {
        self.capture.forbid("prepare")?;
        self.bind()?;
        self.check_operands(&launch.args)?;
        self.check_operands(&launch.results)?;
        if let Some((ws, bytes)) = launch.workspace {
            self.check_range(ws, bytes)?;
        }
        match &launch.body {
            LaunchBody::Reference => Err(self.not_lowered(launch)),
            LaunchBody::Collective => Ok(()),
            LaunchBody::Kernels(ks) => ks.iter().try_for_each(|k| {
                self.resolve(&k.module, &k.entry)?;
                self.check_params(k)
            }),
            LaunchBody::Megakernel {
                reset,
                run,
                blocks_per_sm,
            } => self.prepare_megakernel(reset, run, *blocks_per_sm),
            LaunchBody::Gemm { shape, .. } => {
                let shape = *shape;
                self.prepare_gemm(launch, &shape).map(|_| ())
            }
        }
    }

    fn launch(&mut self, launch: &Launch) -> Result<()> {
        match self.capture.key() {
            Some(key) => {
                self.capture.recorded(&launch.kernel);
                self.run(launch, true)
                    .map_err(|e| BackendError::CaptureFailed {
                        key,
                        op: format!("{} ({})", launch.kernel, launch.op.mnemonic()),
                        message: e.to_string(),
                    })
            }
            None => {
                self.bind()?;
                self.run(launch, false)?;
                self.counters.eager_launches += 1;
                Ok(())
            }
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        self.capture.forbid("synchronize")?;
        self.bind()?;
        self.sync_stream("synchronize")
    }

    fn begin_capture(&mut self, key: Key) -> Result<()> {
        if self.capture.key().is_some() {
            return self.capture.begin(key);
        }
        self.bind()?;
        self.driver
            .begin_capture(self.stream)
            .map_err(|e| BackendError::CaptureFailed {
                key,
                op: "begin stream capture".into(),
                message: e.description,
            })?;
        self.capture.begin(key)?;
        self.captured_any = true;
        Ok(())
    }

    fn end_capture(&mut self) -> Result<GraphHandle> {
        let last_op = self.capture.last_op().to_string();
        let (key, elapsed, launches) = self.capture.end()?;
        let t = Instant::now();
        let graph =
            self.driver
                .end_capture(self.stream)
                .map_err(|e| BackendError::CaptureFailed {
                    key,
                    op: last_op,
                    message: format!("end stream capture: {}", e.description),
                })?;
        let exec = match self.driver.instantiate(graph) {
            Ok(exec) => exec,
            Err(e) => {
                let _ = self.driver.graph_destroy(graph);
                return Err(BackendError::CaptureFailed {
                    key,
                    op: "graph instantiate".into(),
                    message: e.description,
                });
            }
        };
        let handle = self.graphs.insert(key, (graph, exec));
        self.counters
            .graphs
            .captured(key, launches, elapsed + t.elapsed());
        Ok(handle)
    }

    fn abort_capture(&mut self) -> Result<()> {
        if self.capture.end().is_ok() {
            if let Ok(graph) = self.driver.end_capture(self.stream) {
                let _ = self.driver.graph_destroy(graph);
            }
            self.driver.clear_error();
        }
        Ok(())
    }

    fn replay(&mut self, graph: GraphHandle) -> Result<()> {
        self.capture
            .forbid_with(|| format!("replay(graph {})", graph.0))?;
        let (key, (_, exec)) = self.graphs.get(graph)?;
        let (key, exec) = (*key, *exec);
        self.bind()?;
        self.driver
            .graph_launch(exec, self.stream)
            .map_err(|e| e.during(&format!("graph launch (key {key})")))?;
        self.counters.graphs.key(key).replays += 1;
        Ok(())
    }

    fn destroy_graph(&mut self, graph: GraphHandle) -> Result<()> {
        self.capture.forbid("destroy_graph")?;
        self.graphs.get(graph)?;
        self.bind()?;
        self.sync_stream("before destroying a graph")?;
        let (_, (g, exec)) = self.graphs.remove(graph)?;
        self.destroy_pair(g, exec)
            .map_err(|e| e.during("graph destroy"))
    }

    fn mark(&mut self) -> Result<TimingMark> {
        self.capture.forbid("mark")?;
        self.bind()?;
        let slot = (self.marks % EVENT_RING) as usize;
        if slot == self.events.len() {
            let e = self
                .driver
                .event_create()
                .map_err(|e| e.during("event create"))?;
            self.events.push(e);
        }
        self.driver
            .event_record(self.events[slot], self.stream)
            .map_err(|e| e.during("event record"))?;
        let n = self.marks;
        self.marks += 1;
        Ok(TimingMark {
            host_ns: TimingMark::host_now().host_ns,
            event: Some(n),
        })
    }

    fn elapsed_ms(&mut self, from: TimingMark, to: TimingMark) -> Result<f32> {
        self.capture.forbid("elapsed_ms")?;
        let (a, b) = (self.event_of(from)?, self.event_of(to)?);
        self.bind()?;
        self.driver
            .event_elapsed_ms(a, b)
            .map_err(|e| e.during("event elapsed time"))
    }

    fn copy_bandwidth(&mut self, bytes: u64, reps: u32) -> Result<Option<f64>> {
        self.capture.forbid("copy_bandwidth")?;
        let a = self.alloc(bytes, "bandwidth probe (source)")?;
        let b = match self.alloc(bytes, "bandwidth probe (destination)") {
            Ok(b) => b,
            Err(e) => {
                let _ = self.free(a);
                return Err(e);
            }
        };
        let mut times = Vec::new();
        let mut timed = || -> Result<()> {
            for i in 0..reps.max(1) + 1 {
                let from = self.mark()?;
                self.driver
                    .copy_device(b, a, bytes, self.stream)
                    .map_err(|e| e.during("device-to-device copy"))?;
                let to = self.mark()?;
                let ms = self.elapsed_ms(from, to)?;
                if i > 0 {
                    times.push(ms);
                }
            }
            Ok(())
        };
        let r = timed();
        let freed = self.free(a).and(self.free(b));
        r?;
        freed?;
        times.sort_by(|x, y| x.total_cmp(y));
        let median_s = f64::from(times[times.len() / 2]) / 1e3;
        // Bytes read plus bytes written.
        Ok((median_s > 0.0).then(|| 2.0 * bytes as f64 / median_s))
    }
}

impl<D: GpuDriver> Drop for GpuBackend<D> {
    fn drop(&mut self) {
        // Best effort: nothing here can report an error, and every step must
        // run even if an earlier one failed.
        let _ = self.bind();
        let _ = self.abort_capture();
        // Synchronize before destroying executables (capture contract).
        let _ = self.sync_stream("teardown");
        for (_, (g, exec)) in self.graphs.drain() {
            let _ = self.destroy_pair(g, exec);
        }
        // The BLAS handle and its descriptors go before the memory they used.
        if let Some(h) = self.blas.take() {
            self.driver.blas_destroy(h);
        }
        for (_, m) in std::mem::take(&mut self.modules) {
            self.driver.module_unload(m);
        }
        for e in std::mem::take(&mut self.events) {
            self.driver.event_destroy(e);
        }
        let owned: Vec<DevPtr> = self
            .workspace
            .take()
            .map(|(p, _)| p)
            .into_iter()
            .chain(std::mem::take(&mut self.retired))
            .chain(std::mem::take(&mut self.allocs).into_keys().map(DevPtr))
            .collect();
        for p in owned {
            self.release(p);
        }
        self.driver.stream_destroy(self.stream);
    }
}

impl<D: GpuDriver> std::fmt::Debug for GpuBackend<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuBackend")
            .field("info", &self.info)
            .field("allocations", &self.allocs.len())
            .field(
                "modules",
                &self.modules.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field("graphs", &self.graphs.len())
            .finish()
    }
}
