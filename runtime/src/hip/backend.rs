//! The HIP backend: the [`Backend`] seam on an AMD GPU.
//!
//! [`HipBackendOn`] holds all of the backend's logic and reaches HIP only
//! through a [`HipDriver`]; `HipBackend` (feature `rocm`) is it on the real
//! libraries. One non-blocking stream per backend, on the device chosen by
//! ordinal and bound before every call (so several backends on several
//! devices can share a thread). Kernel modules come from the plan's images
//! (code objects, or source compiled by hiprtc for this device and cached on
//! disk); GEMMs run on hipBLASLt with the workspace grown before any capture;
//! steps are captured in global mode (an allocation by any library during the
//! capture fails instead of being baked in) and replayed as graphs.
//!
//! The capture contract is checked here, before any HIP call: inside a
//! capture, `alloc`, `free`, `synchronize`, `download`, `upload`,
//! `load_kernels`, `reserve_workspace`, `prepare`, `replay` and
//! `destroy_graph` fail with [`BackendError::CaptureContract`] naming the key
//! and the call, and the capture stays usable (or can be aborted). A launch
//! that fails while capturing is a [`BackendError::CaptureFailed`] naming the
//! key and the op.
//!
//! Buffers the backend owns (BLAS workspace, kernel scratch) never move while
//! a graph may hold their address: the workspace is frozen by the first
//! capture, and a scratch buffer outgrown after a capture is kept until
//! teardown. Teardown synchronizes before destroying graph executables, and
//! releases hipBLASLt before freeing memory.
//!
//! Not here: the graphs-or-eager decision for steps (the engine's, with
//! [`crate::hip::policy::graphs_supported`] as the HIP allowlist hook; this
//! backend's own [`PolicyDecision`] is logged and reported in its counters).
//! Nothing here has run on AMD hardware yet.

use crate::backend::{Backend, BackendError, DevPtr, DeviceInfo, GraphHandle, Launch, Result};
use crate::hip::cache::{
    cache_key, default_cache_dir, hiprtc_options as compile_options, CacheOutcome, CodeCache,
};
use crate::hip::capture::{CaptureState, GraphTable, HipCounters};
use crate::hip::catalog::{lower, OpBuffers, PackedParams};
use crate::hip::driver::{
    Dims, DriverError, Handle, HipDriver, ERROR_INVALID_IMAGE, ERROR_NO_BINARY_FOR_GPU,
    ERROR_OUT_OF_MEMORY,
};
use crate::hip::gemm::{GemmProblem, WorkspaceChange, WorkspaceLedger};
use crate::hip::policy::{self, PolicyDecision};
use kiln_ir::plan::{ImageKind, KernelImage};
use kiln_ir::{Key, Op};
use kiln_kernels::gpu::Lowered;
use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

/// The buffers the backend owns for kernels.
#[derive(Clone, Copy)]
enum Owned {
    Scratch,
    Counters,
}

struct Allocation {
    bytes: u64,
    what: String,
}

/// The HIP backend's logic over a [`HipDriver`].
pub struct HipBackendOn<D: HipDriver> {
    driver: D,
    ordinal: u32,
    /// `arch` is the base gfx name (`gfx90a`), what plans target.
    info: DeviceInfo,
    /// The full target ID (`gfx90a:sramecc+:xnack-`), what hiprtc compiles for.
    target_id: String,
    runtime: (String, i32),
    stream: Handle,
    /// Allocations made through `alloc`, by base address.
    allocs: BTreeMap<u64, Allocation>,
    /// Loaded modules, by image name, in load order.
    modules: Vec<(String, Handle)>,
    /// Resolved entry points, by (module, entry).
    functions: HashMap<(String, String), Handle>,
    cache: Option<CodeCache>,
    ledger: WorkspaceLedger,
    workspace: Option<(DevPtr, u64)>,
    /// The current kernel scratch buffer (bytes).
    scratch: Option<(DevPtr, u64)>,
    /// The current zero-initialized completion counters (bytes; u32 each).
    counters_buf: Option<(DevPtr, u64)>,
    /// Scratch and counter buffers outgrown after a capture: graphs may still
    /// use them, so they live until teardown.
    retired: Vec<DevPtr>,
    captured_any: bool,
    capture: CaptureState,
    graphs: GraphTable<(Handle, Handle)>,
    counters: HipCounters,
}

impl<D: HipDriver> HipBackendOn<D> {
    /// A backend on device `ordinal` of `driver`, with the graph policy for
    /// the `KILN_GRAPHS` value `kiln_graphs` and the kernel cache in
    /// [`default_cache_dir`].
    pub fn with_driver(mut driver: D, ordinal: u32, kiln_graphs: Option<&str>) -> Result<Self> {
        let count = driver.device_count();
        if ordinal >= count {
            return Err(BackendError::Device(format!(
                "no HIP device {ordinal}: {count} device(s) visible ({}); check HIP_VISIBLE_DEVICES and the amdgpu driver",
                driver.no_device_reason()
            )));
        }
        driver
            .set_device(ordinal)
            .map_err(|e| e.during("hipSetDevice"))?;
        let name = driver.device_name(ordinal)?;
        let target_id = driver.device_target_id(ordinal)?;
        let runtime = driver.runtime_version()?;
        let info = DeviceInfo {
            backend: "hip",
            ordinal,
            name,
            arch: policy::base_arch(&target_id).to_string(),
        };
        let decision =
            policy::decide(&info, kiln_graphs).map_err(|e| BackendError::Device(e.to_string()))?;
        eprintln!("kiln: {} (HIP runtime {})", decision.reason, runtime.0);
        let stream = driver
            .stream_create()
            .map_err(|e| e.during("hipStreamCreateWithFlags"))?;
        Ok(HipBackendOn {
            driver,
            ordinal,
            info,
            target_id,
            runtime,
            stream,
            allocs: BTreeMap::new(),
            modules: Vec::new(),
            functions: HashMap::new(),
            cache: default_cache_dir().ok().map(CodeCache::new),
            ledger: WorkspaceLedger::default(),
            workspace: None,
            scratch: None,
            counters_buf: None,
            retired: Vec::new(),
            captured_any: false,
            capture: CaptureState::default(),
            graphs: GraphTable::default(),
            counters: HipCounters::new(decision),
        })
    }

    /// Puts compiled kernel source in `dir` instead of the default cache.
    pub fn set_cache_dir(&mut self, dir: impl Into<std::path::PathBuf>) {
        self.cache = Some(CodeCache::new(dir));
    }

    /// The graph policy for this backend's device, with its reason.
    pub fn policy(&self) -> &PolicyDecision {
        &self.counters.policy
    }

    /// What the backend did (captures, replays, compiles, ...).
    pub fn counters(&self) -> &HipCounters {
        &self.counters
    }

    /// The device's full target ID (`gfx90a:sramecc+:xnack-`).
    pub fn target_id(&self) -> &str {
        &self.target_id
    }

    /// The HIP runtime version (`6.2.41133`).
    pub fn runtime_version(&self) -> &str {
        &self.runtime.0
    }

    /// The driver (tests inspect a simulated one).
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// `(what, bytes)` of every live allocation made through `alloc`.
    pub fn live_allocations(&self) -> Vec<(String, u64)> {
        self.allocs
            .values()
            .map(|a| (a.what.clone(), a.bytes))
            .collect()
    }

    fn bind(&mut self) -> Result<()> {
        self.driver
            .set_device(self.ordinal)
            .map_err(|e| e.during("hipSetDevice"))
    }

    fn sync_stream(&mut self, why: &str) -> Result<()> {
        self.driver
            .stream_synchronize(self.stream)
            .map_err(|e| e.during(&format!("hipStreamSynchronize ({why})")))
    }

    fn malloc(&mut self, bytes: u64, what: &str) -> Result<DevPtr> {
        self.driver.malloc(bytes).map_err(|e| match e.code {
            ERROR_OUT_OF_MEMORY => BackendError::OutOfMemory {
                bytes,
                what: what.to_string(),
            },
            _ => e.during(&format!("hipMalloc({bytes}) for {what}")),
        })
    }

    fn release(&mut self, ptr: DevPtr) {
        // Best effort: used on error paths and for backend-owned buffers.
        let _ = self.driver.free(ptr);
    }

    /// Checks that `[ptr, ptr + len)` lies inside one live allocation.
    fn check_range(&self, ptr: DevPtr, len: u64) -> Result<()> {
        match self.allocs.range(..=ptr.0).next_back() {
            Some((&base, a)) if ptr.0 + len <= base + a.bytes.max(1) => Ok(()),
            _ => Err(BackendError::BadAddress(ptr.0)),
        }
    }

    fn load_module(&mut self, image: &KernelImage, code: &[u8]) -> Result<()> {
        match self.driver.module_load(code) {
            Ok(m) => {
                self.modules.push((image.name.clone(), m));
                Ok(())
            }
            Err(e) if e.code == ERROR_NO_BINARY_FOR_GPU || e.code == ERROR_INVALID_IMAGE => {
                Err(BackendError::Device(format!(
                    "the plan's kernel module `{}` has no code for this device ({}, {}): {}; recompile the plan with kiln compile --target hip:{}",
                    image.name, self.info.name, self.target_id, e.description, self.info.arch
                )))
            }
            Err(e) => Err(e.during(&format!("hipModuleLoadData({})", image.name))),
        }
    }

    /// The code object for a source image: from the cache, or hiprtc.
    fn compile_source(&mut self, image: &KernelImage) -> Result<Vec<u8>> {
        let source = std::str::from_utf8(&image.code).map_err(|_| {
            BackendError::Device(format!(
                "kernel source image `{}` is not UTF-8; the plan is damaged, recompile it",
                image.name
            ))
        })?;
        let options = compile_options(&self.target_id);
        let compiler = format!(
            "{}; HIP runtime {}",
            self.driver.rtc_identity()?,
            self.runtime.0
        );
        let key = cache_key(source.as_bytes(), &options, &self.target_id, &compiler);
        let name = format!("{}.hip", image.name);
        let driver = &mut self.driver;
        let mut compile = || {
            driver
                .rtc_compile(source, &name, &options)
                .map_err(BackendError::Device)
        };
        let (code, outcome) = match &self.cache {
            Some(cache) => cache.load_or_compile(&key, compile)?,
            None => (
                compile()?,
                CacheOutcome::CompiledNotStored(
                    "no cache directory (set KILN_CACHE_DIR)".to_string(),
                ),
            ),
        };
        match outcome {
            CacheOutcome::Hit(_) => self.counters.kernel_cache_hits += 1,
            CacheOutcome::Compiled(_) => self.counters.kernels_compiled += 1,
            CacheOutcome::CompiledNotStored(why) => {
                self.counters.kernels_compiled += 1;
                eprintln!(
                    "kiln: compiled HIP kernels `{}` for {} but could not cache them: {why}",
                    image.name, self.target_id
                );
            }
        }
        Ok(code)
    }

    /// The function for `entry`: from the module named `module` if the plan
    /// has one by that name, else from whichever module defines it (a plan
    /// may carry all catalog modules as one image).
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

    /// Makes a backend-owned buffer (`which`: scratch or counters) at least
    /// `bytes`, zero-filled. An outgrown buffer is freed only if no capture
    /// may hold its address yet; otherwise it is kept until teardown.
    fn grow_owned(&mut self, which: Owned, bytes: u64) -> Result<()> {
        let current = match which {
            Owned::Scratch => self.scratch,
            Owned::Counters => self.counters_buf,
        };
        if bytes == 0 || current.is_some_and(|(_, s)| s >= bytes) {
            return Ok(());
        }
        let what = match which {
            Owned::Scratch => "kernel scratch",
            Owned::Counters => "completion counters",
        };
        let p = self.malloc(bytes, what)?;
        let zeroed = self
            .driver
            .memset_zero(p, bytes, self.stream)
            .map_err(|e| e.during("hipMemsetAsync"))
            .and_then(|()| self.sync_stream("zeroing a new buffer"));
        if let Err(e) = zeroed {
            self.release(p);
            return Err(e);
        }
        let slot = match which {
            Owned::Scratch => &mut self.scratch,
            Owned::Counters => &mut self.counters_buf,
        };
        if let Some((old, _)) = slot.replace((p, bytes)) {
            if self.captured_any {
                self.retired.push(old);
            } else {
                self.release(old);
            }
        }
        Ok(())
    }

    fn op_buffers(&self) -> OpBuffers {
        OpBuffers {
            scratch: self.scratch,
            counters: self.counters_buf.map(|(p, b)| (p, (b / 4) as u32)),
        }
    }

    fn gemm_grant(&self, launch: &Launch, p: &GemmProblem) -> Result<(Option<DevPtr>, u64)> {
        self.ledger
            .grant_for(launch.workspace, self.workspace, &p.describe())
    }

    fn prepare_gemm(&mut self, launch: &Launch) -> Result<()> {
        let (p, _) = GemmProblem::from_launch(launch)?;
        let (_, granted) = self.gemm_grant(launch, &p)?;
        self.driver.gemm_prepare(&p, granted)?;
        self.counters.gemm_algorithms = self.driver.gemm_prepared_count() as u64;
        Ok(())
    }

    /// Runs (or records) one op. `Err` is the failure as such; the caller
    /// turns it into a capture failure when capturing.
    fn run(&mut self, launch: &Launch, capturing: bool) -> Result<()> {
        let not_prepared = |what: &str| {
            BackendError::Device(format!(
                "{what} was not prepared before capture: call prepare() for every launch before begin_capture"
            ))
        };
        if let Op::MatMul { .. } = launch.op {
            let (p, ops) = GemmProblem::from_launch(launch)?;
            let (ws, granted) = self.gemm_grant(launch, &p)?;
            if !self.driver.gemm_is_prepared(&p, granted) {
                if capturing {
                    return Err(not_prepared(&p.describe()));
                }
                self.prepare_gemm(launch)?;
            }
            return self.driver.gemm_run(&p, granted, &ops, ws, self.stream);
        }
        let Lowered::Kernels {
            calls,
            scratch_bytes,
            counters,
        } = lower(launch)?
        else {
            return Err(BackendError::Device(format!(
                "{}: the catalog lowers this op to a GEMM but it is not a matmul",
                launch.kernel
            )));
        };
        let counter_bytes = counters as u64 * 4;
        let short = self.scratch.map_or(0, |(_, s)| s) < scratch_bytes
            || self.counters_buf.map_or(0, |(_, s)| s) < counter_bytes;
        if short {
            if capturing {
                return Err(not_prepared(&format!(
                    "{} (needs {scratch_bytes} bytes of scratch and {counters} completion counters)",
                    launch.kernel
                )));
            }
            self.grow_owned(Owned::Scratch, scratch_bytes)?;
            self.grow_owned(Owned::Counters, counter_bytes)?;
        }
        for c in &calls {
            let f = match self.functions.get(&(c.module.to_string(), c.entry.clone())) {
                Some(f) => *f,
                None if capturing => return Err(not_prepared(&c.entry)),
                None => self.resolve(c.module, &c.entry)?,
            };
            let mut params = PackedParams::new(&c.params, launch, self.op_buffers())?;
            let dims = Dims {
                grid: c.grid,
                block: c.block,
                shared_bytes: c.shared_bytes,
            };
            self.driver
                .launch_kernel(f, dims, self.stream, &mut params)
                .map_err(|e| e.during(&format!("hipModuleLaunchKernel({})", c.entry)))?;
        }
        Ok(())
    }

    /// Destroys one instantiated graph (the stream must be idle).
    fn destroy_pair(
        &mut self,
        graph: Handle,
        exec: Handle,
    ) -> std::result::Result<(), DriverError> {
        let a = self.driver.exec_destroy(exec);
        let b = self.driver.graph_destroy(graph);
        a.and(b)
    }
}

impl<D: HipDriver> Backend for HipBackendOn<D> {
    fn info(&self) -> DeviceInfo {
        self.info.clone()
    }

    fn alloc(&mut self, bytes: u64, what: &str) -> Result<DevPtr> {
        self.capture.forbid("alloc")?;
        self.bind()?;
        let p = self.malloc(bytes, what)?;
        let zeroed = self
            .driver
            .memset_zero(p, bytes, self.stream)
            .map_err(|e| e.during("hipMemsetAsync"))
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
        self.capture.forbid("free")?;
        if !self.allocs.contains_key(&ptr.0) {
            return Err(BackendError::BadAddress(ptr.0));
        }
        self.bind()?;
        self.allocs.remove(&ptr.0);
        self.driver.free(ptr).map_err(|e| e.during("hipFree"))
    }

    fn upload(&mut self, dst: DevPtr, data: &[u8]) -> Result<()> {
        self.capture.forbid("upload")?;
        if data.is_empty() {
            return Ok(());
        }
        self.check_range(dst, data.len() as u64)?;
        self.bind()?;
        self.driver
            .copy_to_device(dst, data, self.stream)
            .map_err(|e| e.during("hipMemcpyHtoDAsync"))?;
        // Pageable host memory: wait so the caller may reuse `data`.
        self.sync_stream("after an upload")
    }

    fn download(&mut self, src: DevPtr, out: &mut [u8]) -> Result<()> {
        self.capture.forbid("download")?;
        if out.is_empty() {
            return Ok(());
        }
        self.check_range(src, out.len() as u64)?;
        self.bind()?;
        self.driver
            .copy_to_host(out, src, self.stream)
            .map_err(|e| e.during("hipMemcpyDtoHAsync"))?;
        self.sync_stream("after a download")
    }

    fn load_kernels(&mut self, images: &[KernelImage]) -> Result<()> {
        self.capture.forbid("load_kernels")?;
        self.bind()?;
        for image in images {
            match image.kind {
                ImageKind::Cubin => {
                    return Err(BackendError::Device(format!(
                        "kernel image `{}` is a CUDA cubin: this plan was compiled for a CUDA target; recompile it with kiln compile --target hip:{}",
                        image.name, self.info.arch
                    )))
                }
                ImageKind::CodeObject => self.load_module(image, &image.code)?,
                ImageKind::Source => {
                    let code = self.compile_source(image)?;
                    self.load_module(image, &code)?;
                }
            }
        }
        Ok(())
    }

    fn reserve_workspace(&mut self, bytes: u64) -> Result<Option<(DevPtr, u64)>> {
        self.capture.forbid("reserve_workspace")?;
        self.bind()?;
        match self.ledger.plan(bytes)? {
            WorkspaceChange::Keep => {}
            WorkspaceChange::Allocate(n) => {
                self.workspace = Some((self.malloc(n, "BLAS workspace")?, n));
            }
            WorkspaceChange::Reallocate { to, .. } => {
                if let Some((old, _)) = self.workspace.take() {
                    self.release(old);
                }
                self.workspace = Some((self.malloc(to, "BLAS workspace")?, to));
            }
            WorkspaceChange::Release(_) => {
                if let Some((old, _)) = self.workspace.take() {
                    self.release(old);
                }
            }
        }
        self.ledger.commit(bytes);
        Ok(self.workspace)
    }

    fn prepare(&mut self, launch: &Launch) -> Result<()> {
        self.capture.forbid("prepare")?;
        self.bind()?;
        match lower(launch)? {
            Lowered::Kernels {
                calls,
                scratch_bytes,
                counters,
            } => {
                self.grow_owned(Owned::Scratch, scratch_bytes)?;
                self.grow_owned(Owned::Counters, counters as u64 * 4)?;
                for c in &calls {
                    self.resolve(c.module, &c.entry)?;
                }
                Ok(())
            }
            Lowered::Gemm(_) => self.prepare_gemm(launch),
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
        self.capture.forbid("begin_capture")?;
        self.bind()?;
        self.driver
            .begin_capture(self.stream)
            .map_err(|e| BackendError::CaptureFailed {
                key,
                op: "hipStreamBeginCapture".into(),
                message: e.description,
            })?;
        self.capture.begin(key)?;
        self.ledger.freeze(key);
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
                    message: format!("hipStreamEndCapture: {}", e.description),
                })?;
        let exec = match self.driver.instantiate(graph) {
            Ok(exec) => exec,
            Err(e) => {
                let _ = self.driver.graph_destroy(graph);
                return Err(BackendError::CaptureFailed {
                    key,
                    op: "hipGraphInstantiate".into(),
                    message: e.description,
                });
            }
        };
        let handle = self.graphs.insert(key, (graph, exec));
        let c = self.counters.key(key);
        c.captures += 1;
        c.captured_launches += launches;
        c.capture_time += elapsed + t.elapsed();
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
        self.capture.forbid("replay")?;
        let (key, (_, exec)) = self.graphs.get(graph)?;
        let (key, exec) = (*key, *exec);
        self.bind()?;
        self.driver
            .graph_launch(exec, self.stream)
            .map_err(|e| e.during(&format!("hipGraphLaunch (key {key})")))?;
        self.counters.key(key).replays += 1;
        Ok(())
    }

    fn destroy_graph(&mut self, graph: GraphHandle) -> Result<()> {
        self.capture.forbid("destroy_graph")?;
        self.graphs.get(graph)?;
        self.bind()?;
        self.sync_stream("before destroying a graph")?;
        let (_, (g, exec)) = self.graphs.remove(graph)?;
        self.destroy_pair(g, exec)
            .map_err(|e| e.during("hipGraphExecDestroy/hipGraphDestroy"))
    }
}

impl<D: HipDriver> Drop for HipBackendOn<D> {
    fn drop(&mut self) {
        // Best effort: nothing here can report an error, and every step must
        // run even if an earlier one failed.
        let _ = self.bind();
        let _ = self.abort_capture();
        // Synchronize before destroying executables (capture contract rule 5).
        let _ = self.sync_stream("teardown");
        for (_, (g, exec)) in self.graphs.drain() {
            let _ = self.destroy_pair(g, exec);
        }
        // hipBLASLt's descriptors and handle go before the memory they used.
        self.driver.gemm_release();
        for (_, m) in std::mem::take(&mut self.modules) {
            self.driver.module_unload(m);
        }
        let owned: Vec<DevPtr> = self
            .workspace
            .take()
            .into_iter()
            .chain(self.scratch.take())
            .chain(self.counters_buf.take())
            .map(|(p, _)| p)
            .chain(std::mem::take(&mut self.retired))
            .chain(std::mem::take(&mut self.allocs).into_keys().map(DevPtr))
            .collect();
        for p in owned {
            self.release(p);
        }
        self.driver.stream_destroy(self.stream);
    }
}

impl<D: HipDriver> std::fmt::Debug for HipBackendOn<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipBackend")
            .field("info", &self.info)
            .field("target_id", &self.target_id)
            .field("runtime", &self.runtime.0)
            .field("allocations", &self.allocs.len())
            .field(
                "modules",
                &self.modules.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field("graphs", &self.graphs.len())
            .field("policy", &self.counters.policy)
            .finish()
    }
}

#[cfg(feature = "rocm")]
mod real_backend {
    use super::*;
    use crate::hip::real::RealHip;

    /// The HIP backend on this machine's HIP libraries.
    pub type HipBackend = HipBackendOn<RealHip>;

    impl HipBackendOn<RealHip> {
        /// HIP devices on this machine (0 without an AMD GPU or driver).
        pub fn device_count() -> u32 {
            RealHip::default().device_count()
        }

        /// Why there is no device (for test skip lines).
        pub fn no_device_reason() -> String {
            RealHip::default().no_device_reason()
        }

        /// A backend on device `ordinal`, with the graph policy read from
        /// `KILN_GRAPHS`.
        pub fn new(ordinal: u32) -> Result<HipBackend> {
            let env = std::env::var(policy::ENV_VAR).ok();
            HipBackendOn::with_driver(RealHip::default(), ordinal, env.as_deref())
        }

        /// As [`HipBackendOn::new`] with the `KILN_GRAPHS` value given.
        pub fn with_policy_env(ordinal: u32, kiln_graphs: Option<&str>) -> Result<HipBackend> {
            HipBackendOn::with_driver(RealHip::default(), ordinal, kiln_graphs)
        }
    }
}

#[cfg(feature = "rocm")]
pub use real_backend::HipBackend;
