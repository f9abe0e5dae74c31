//! Tensor parallelism at run time: one [`Backend`] that drives the N ranks
//! of a `kiln compile --tp N` plan, so the engine stays single-rank.
//!
//! A tensor-parallel plan is one program for every rank (SPMD; see
//! `kiln_ir::plan::Plan::tp`). [`TpBackend`] composes one backend per rank
//! and broadcasts every call: each allocation is made on every rank (the
//! engine sees rank 0's addresses; each launch is translated to every
//! rank's own addresses), uploads go to every rank except weight shards
//! ([`Backend::upload_rank`]), and outputs are read from rank 0 (every
//! rank holds the same next tokens: the collectives leave identical bits on
//! every rank). Capture and replay happen per rank, each rank's graph with
//! its collectives inside, so the capture contract holds per rank with the
//! same bookkeeping as a single device. Replays and collective launches run
//! on one thread per rank, concurrently, because a collective waits for
//! every rank.
//!
//! The CPU form ([`TpBackend::cpu`]) runs its ranks' collectives through
//! [`CpuExchange`], an in-process all-gather (a barrier and one slot per
//! rank) over which `kiln_kernels::cpu::collective` reduces in the fixed
//! rank order; each rank runs its kernels in a thread pool of its own, the
//! host's threads shared out ([`TpOptions`]). GPU ranks are each a
//! `GpuBackend` on its own device with an NCCL communicator
//! (`crate::gpu::nccl`, `--features cuda`).
//!
//! # A rank that fails
//! A collective waits for every rank, so one rank failing mid-step (an
//! error or a panic) would leave the others waiting forever. The first
//! rank to fail stops the group through its [`GroupControl`] (the CPU
//! exchange, NCCL's communicator abort): every rank waiting in a
//! collective, or entering one later, returns an error naming the failed
//! rank and its error, and the step returns that rank's error. The ranks
//! are then out of step, so the backend refuses every later step (load the
//! plan again). As a second line of defence a rank waits at most
//! [`TpOptions::timeout`] at one collective, then stops the group naming
//! the ranks that did not arrive.
//!
//! Not here: recovering a stopped group, pipeline parallelism, several
//! processes or hosts.

use crate::backend::{
    Backend, BackendError, DevOperand, DevPtr, DeviceInfo, GraphHandle, Launch, LaunchBody,
    ResolvedParam, Result,
};
use crate::cpu::{CpuBackend, CpuStats};
use kiln_ir::plan::KernelImage;
use kiln_ir::Key;
use kiln_kernels::cpu::collective::Exchange;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

/// How long a rank waits at a collective for the others by default before
/// it stops the group (the second line of defence: a failing rank stops the
/// group at once). `KILN_TP_TIMEOUT_S` overrides it ([`TpOptions::from_env`]).
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(120);

/// Options of a tensor-parallel group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpOptions {
    /// Longest a rank waits at one collective for the other ranks; past it
    /// the group is stopped, naming the ranks that did not arrive. `None`:
    /// wait forever (a failing rank still stops the group at once).
    pub timeout: Option<Duration>,
    /// CPU ranks: worker threads per rank (each rank runs its kernels in a
    /// thread pool of its own). `None`: the host's threads shared out,
    /// at least one each.
    pub threads_per_rank: Option<usize>,
}

impl Default for TpOptions {
    fn default() -> TpOptions {
        TpOptions {
            timeout: Some(DEFAULT_COLLECTIVE_TIMEOUT),
            threads_per_rank: None,
        }
    }
}

impl TpOptions {
    /// The defaults, with `KILN_TP_TIMEOUT_S` (seconds; `0` waits forever)
    /// and `KILN_TP_THREADS` (threads per CPU rank) where set. A value that
    /// does not parse is an error naming the variable.
    pub fn from_env() -> Result<TpOptions> {
        let mut o = TpOptions::default();
        let num = |name: &str| -> Result<Option<u64>> {
            match std::env::var(name) {
                Err(_) => Ok(None),
                Ok(v) => v.trim().parse::<u64>().map(Some).map_err(|_| {
                    BackendError::Device(format!(
                        "{name}={v:?} is not a whole number; set it to a count of seconds (timeout, 0 = none) or threads, or unset it"
                    ))
                }),
            }
        };
        if let Some(t) = num("KILN_TP_TIMEOUT_S")? {
            o.timeout = (t > 0).then(|| Duration::from_secs(t));
        }
        if let Some(n) = num("KILN_TP_THREADS")? {
            o.threads_per_rank = Some(n.max(1) as usize);
        }
        Ok(o)
    }

    /// Threads each of `ranks` CPU ranks gets.
    pub fn threads_for(&self, ranks: u32) -> usize {
        self.threads_per_rank.unwrap_or_else(|| {
            let host = std::thread::available_parallelism().map_or(1, |n| n.get());
            (host / ranks.max(1) as usize).max(1)
        })
    }
}

/// What a [`TpBackend`] needs from its ranks' collective layer (the CPU
/// exchange, NCCL communicators): stopping it when one rank fails, so no
/// other rank waits at its next collective, and the time spent inside
/// collectives.
pub trait GroupControl: Send + Sync {
    /// Stops the group: every rank waiting in a collective, or entering one
    /// later, returns an error naming `rank` and `why`. The first stop wins;
    /// later ones are ignored.
    fn abort(&self, rank: u32, why: &str);
    /// Why the group was stopped, if it was.
    fn failure(&self) -> Option<String>;
    /// Nanoseconds each rank has spent inside collectives so far (waiting
    /// for the other ranks included), rank `r` at index `r`; `None` where
    /// the layer cannot tell.
    fn collective_ns(&self) -> Option<Vec<u64>>;
}

#[derive(Default)]
struct Round {
    /// Ranks waiting at the barrier now.
    waiting: u32,
    /// Barrier rounds completed.
    generation: u64,
    /// Barrier entries per rank (two per collective).
    entered: Vec<u64>,
    /// Why the group stopped.
    failure: Option<String>,
}

struct Shared {
    ranks: u32,
    timeout: Option<Duration>,
    round: Mutex<Round>,
    moved: Condvar,
    slots: Vec<RwLock<Vec<f32>>>,
    busy_ns: Vec<AtomicU64>,
}

impl Shared {
    fn stop(&self, why: String) {
        let mut g = self.round.lock().unwrap_or_else(|e| e.into_inner());
        if g.failure.is_none() {
            g.failure = Some(why);
        }
        drop(g);
        self.moved.notify_all();
    }

    /// A barrier every rank must reach; fails as soon as the group is
    /// stopped, or when the others do not arrive within the timeout (which
    /// then stops the group, naming them).
    fn barrier(&self, rank: u32) -> std::result::Result<(), String> {
        let mut g = self.round.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = &g.failure {
            return Err(f.clone());
        }
        g.entered[rank as usize] += 1;
        g.waiting += 1;
        if g.waiting == self.ranks {
            g.waiting = 0;
            g.generation += 1;
            drop(g);
            self.moved.notify_all();
            return Ok(());
        }
        let (generation, mine) = (g.generation, g.entered[rank as usize]);
        let deadline = self.timeout.map(|t| Instant::now() + t);
        loop {
            if g.generation != generation {
                return Ok(());
            }
            if let Some(f) = &g.failure {
                return Err(f.clone());
            }
            g = match deadline {
                None => self.moved.wait(g).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        let late: Vec<String> = (0..self.ranks as usize)
                            .filter(|&r| g.entered[r] < mine)
                            .map(|r| r.to_string())
                            .collect();
                        let why = format!(
                            "rank(s) {} did not reach collective {} within {:.1} s (rank {rank} waited); a rank is stuck or far slower than the others (raise KILN_TP_TIMEOUT_S if it is only slow)",
                            late.join(", "),
                            mine.div_ceil(2),
                            self.timeout.unwrap_or_default().as_secs_f64()
                        );
                        g.failure = Some(why.clone());
                        drop(g);
                        self.moved.notify_all();
                        return Err(why);
                    }
                    self.moved
                        .wait_timeout(g, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }
}

/// One rank's handle on an in-process all-gather shared by `ranks` ranks.
pub struct CpuExchange {
    rank: u32,
    shared: Arc<Shared>,
}

/// The control of a CPU exchange group (see [`GroupControl`]).
pub struct CpuGroup(Arc<Shared>);

impl GroupControl for CpuGroup {
    fn abort(&self, rank: u32, why: &str) {
        self.0.stop(format!("rank {rank} failed: {why}"));
    }
    fn failure(&self) -> Option<String> {
        let g = self.0.round.lock().unwrap_or_else(|e| e.into_inner());
        g.failure.clone()
    }
    fn collective_ns(&self) -> Option<Vec<u64>> {
        Some(
            self.0
                .busy_ns
                .iter()
                .map(|n| n.load(Ordering::Relaxed))
                .collect(),
        )
    }
}

impl CpuExchange {
    /// Handles for ranks `0..ranks` of one group, waiting at most
    /// [`DEFAULT_COLLECTIVE_TIMEOUT`] at a collective.
    pub fn group(ranks: u32) -> Vec<CpuExchange> {
        CpuExchange::group_with_timeout(ranks, Some(DEFAULT_COLLECTIVE_TIMEOUT)).0
    }

    /// Handles for ranks `0..ranks` of one group and its control; a rank
    /// waits at most `timeout` at one collective (`None`: forever).
    pub fn group_with_timeout(
        ranks: u32,
        timeout: Option<Duration>,
    ) -> (Vec<CpuExchange>, Arc<CpuGroup>) {
        let shared = Arc::new(Shared {
            ranks,
            timeout,
            round: Mutex::new(Round {
                entered: vec![0; ranks as usize],
                ..Round::default()
            }),
            moved: Condvar::new(),
            slots: (0..ranks).map(|_| RwLock::new(Vec::new())).collect(),
            busy_ns: (0..ranks).map(|_| AtomicU64::new(0)).collect(),
        });
        let handles = (0..ranks)
            .map(|rank| CpuExchange {
                rank,
                shared: shared.clone(),
            })
            .collect();
        (handles, Arc::new(CpuGroup(shared)))
    }
}

impl Exchange for CpuExchange {
    fn rank(&self) -> u32 {
        self.rank
    }
    fn ranks(&self) -> u32 {
        self.shared.ranks
    }
    fn all_gather(
        &self,
        local: &[f32],
        f: &mut dyn FnMut(&[&[f32]]),
    ) -> std::result::Result<(), String> {
        let t0 = Instant::now();
        let s = &self.shared;
        let done = (|| {
            {
                let mut mine = s.slots[self.rank as usize]
                    .write()
                    .unwrap_or_else(|e| e.into_inner());
                mine.clear();
                mine.extend_from_slice(local);
            }
            s.barrier(self.rank)?;
            {
                let guards: Vec<_> = s
                    .slots
                    .iter()
                    .map(|l| l.read().unwrap_or_else(|e| e.into_inner()))
                    .collect();
                let parts: Vec<&[f32]> = guards.iter().map(|g| g.as_slice()).collect();
                f(&parts);
            }
            // Nobody republishes before every rank has read.
            s.barrier(self.rank)
        })();
        s.busy_ns[self.rank as usize].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        done
    }
}

/// The N ranks of a tensor-parallel plan behind one [`Backend`]. See the
/// module docs.
pub struct TpBackend {
    ranks: Vec<Box<dyn Backend + Send>>,
    /// Rank 0's base -> (bytes, every rank's base).
    allocs: BTreeMap<u64, (u64, Vec<u64>)>,
    /// Per graph handle, each rank's graph.
    graphs: BTreeMap<u32, Vec<GraphHandle>>,
    next_graph: u32,
    /// The ranks' collective layer, told when a rank fails.
    control: Option<Arc<dyn GroupControl>>,
    /// Per rank, the thread pool its work runs in (CPU ranks).
    pools: Vec<Option<Arc<rayon::ThreadPool>>>,
    /// Set once a rank failed mid-step: the ranks are out of step, every
    /// later step is refused with this.
    stopped: Option<String>,
    /// Inside a capture region: launches are recorded, nothing runs or
    /// waits, so a failing rank leaves the others in step (the engine's
    /// capture-failure policy decides, as on one device).
    capturing: bool,
    /// Graph replays each rank completed (see [`TpBackend::rank_replays`]).
    replays: Arc<[AtomicU64]>,
}

/// Runs `f` in `pool` (its kernels' parallel loops then use that pool's
/// threads), or on the calling thread.
fn in_pool<T: Send>(pool: Option<&rayon::ThreadPool>, f: impl FnOnce() -> T + Send) -> T {
    match pool {
        Some(p) => p.install(f),
        None => f(),
    }
}

/// A rank's call, with a panic turned into an error naming it.
fn guarded<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| p.downcast_ref::<&str>().copied())
            .unwrap_or("(no message)");
        Err(BackendError::Device(format!("panicked: {msg}")))
    })
}

impl TpBackend {
    /// Composes `ranks` (rank `r` at index `r`). They must be connected to
    /// each other already (a CPU exchange group, NCCL communicators); see
    /// [`TpBackend::with_control`] so a failing rank stops the others.
    pub fn new(ranks: Vec<Box<dyn Backend + Send>>) -> Result<TpBackend> {
        if ranks.is_empty() {
            return Err(BackendError::Device(
                "a tensor-parallel backend needs at least one rank".into(),
            ));
        }
        let replays: Arc<[AtomicU64]> = ranks.iter().map(|_| AtomicU64::new(0)).collect();
        Ok(TpBackend {
            pools: ranks.iter().map(|_| None).collect(),
            ranks,
            allocs: BTreeMap::new(),
            graphs: BTreeMap::new(),
            next_graph: 0,
            control: None,
            stopped: None,
            capturing: false,
            replays,
        })
    }

    /// The ranks' collective layer: stopped when a rank fails mid-step, so
    /// the other ranks return from their next collective with an error
    /// naming it instead of waiting forever; also the source of
    /// [`Backend::collective_ns`].
    pub fn with_control(mut self, control: Arc<dyn GroupControl>) -> TpBackend {
        self.control = Some(control);
        self
    }

    /// Runs rank `r`'s work in a pool of `threads` worker threads.
    fn with_threads(mut self, threads: usize) -> Result<TpBackend> {
        for (r, p) in self.pools.iter_mut().enumerate() {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads.max(1))
                .thread_name(move |i| format!("kiln-tp-rank{r}-{i}"))
                .build()
                .map_err(|e| {
                    BackendError::Device(format!(
                        "starting {threads} worker thread(s) for tensor-parallel rank {r}: {e}"
                    ))
                })?;
            *p = Some(Arc::new(pool));
        }
        Ok(self)
    }

    /// `n` CPU ranks joined by an in-process exchange, with each rank's
    /// counters, under `options` (timeout, threads per rank).
    pub fn cpu_with_options(
        n: u32,
        options: &TpOptions,
    ) -> Result<(TpBackend, Vec<Arc<CpuStats>>)> {
        let n = n.max(1);
        let (group, control) = CpuExchange::group_with_timeout(n, options.timeout);
        let mut stats = Vec::new();
        let ranks: Vec<Box<dyn Backend + Send>> = group
            .into_iter()
            .map(|ex| {
                let b = CpuBackend::new().with_exchange(Arc::new(ex));
                stats.push(b.stats());
                Box::new(b) as Box<dyn Backend + Send>
            })
            .collect();
        let be = TpBackend::new(ranks)?
            .with_control(control)
            .with_threads(options.threads_for(n))?;
        Ok((be, stats))
    }

    /// `n` CPU ranks joined by an in-process exchange, with each rank's
    /// counters (default [`TpOptions`]).
    pub fn cpu_with_stats(n: u32) -> (TpBackend, Vec<Arc<CpuStats>>) {
        TpBackend::cpu_with_options(n, &TpOptions::default())
            .expect("default CPU ranks start (thread pools of at least one thread)")
    }

    /// `n` CPU ranks joined by an in-process exchange.
    pub fn cpu(n: u32) -> TpBackend {
        TpBackend::cpu_with_stats(n).0
    }

    /// Graph replays each rank has completed, rank `r` at index `r`: the
    /// per-rank witness that every rank's graph ran (readable after the
    /// backend moved into an engine).
    pub fn rank_replays(&self) -> Arc<[AtomicU64]> {
        self.replays.clone()
    }

    /// Refuses work once a rank has failed mid-step.
    fn check_running(&self) -> Result<()> {
        match &self.stopped {
            None => Ok(()),
            Some(why) => Err(BackendError::Device(format!(
                "the tensor-parallel group is stopped ({why}); its ranks are out of step: load the plan again"
            ))),
        }
    }

    /// Records that rank `r` failed with `e` mid-step and stops the group;
    /// returns the error the caller reports.
    fn fail(&mut self, r: usize, e: &BackendError) -> BackendError {
        let why = format!("rank {r} failed: {e}");
        if self.capturing {
            return BackendError::Device(format!("tensor-parallel {why}"));
        }
        if let Some(c) = &self.control {
            c.abort(r as u32, &e.to_string());
        }
        if self.stopped.is_none() {
            self.stopped = Some(why.clone());
        }
        BackendError::Device(format!(
            "tensor-parallel {why}; the other ranks were stopped at their next collective"
        ))
    }

    fn translate(&self, rank: usize, p: DevPtr) -> DevPtr {
        if rank == 0 || p.0 == 0 {
            return p;
        }
        match self.allocs.range(..=p.0).next_back() {
            Some((&base, (len, bases))) if p.0 - base <= *len => DevPtr(bases[rank] + (p.0 - base)),
            // Not an address of ours: the rank's backend reports it.
            _ => p,
        }
    }

    /// `l` with every address in rank `rank`'s memory.
    fn launch_for(&self, rank: usize, l: &Launch) -> Launch {
        if rank == 0 {
            return l.clone();
        }
        let tr = |o: &DevOperand| DevOperand {
            ptr: self.translate(rank, o.ptr),
            ty: o.ty.clone(),
        };
        let kernel = |k: &crate::backend::ResolvedKernel| {
            let mut k = k.clone();
            for p in &mut k.params {
                if let ResolvedParam::Ptr(d) = p {
                    *d = self.translate(rank, *d);
                }
            }
            k
        };
        Launch {
            args: l.args.iter().map(tr).collect(),
            results: l.results.iter().map(tr).collect(),
            workspace: l.workspace.map(|(p, b)| (self.translate(rank, p), b)),
            body: match &l.body {
                LaunchBody::Kernels(ks) => LaunchBody::Kernels(ks.iter().map(kernel).collect()),
                LaunchBody::Gemm {
                    shape,
                    kind,
                    kernel: k,
                } => LaunchBody::Gemm {
                    shape: *shape,
                    kind: *kind,
                    kernel: k.as_ref().map(kernel),
                },
                b => b.clone(),
            },
            ..l.clone()
        }
    }

    /// Runs `f` on every rank concurrently (one thread per rank past the
    /// first), returning rank 0's value. The first rank to fail (error or
    /// panic) stops the group at once, so the others leave their next
    /// collective with an error instead of waiting for it; the error
    /// returned is that rank's.
    fn concurrently<T: Send>(
        &mut self,
        f: impl Fn(usize, &mut (dyn Backend + Send)) -> Result<T> + Sync,
    ) -> Result<T> {
        self.check_running()?;
        let first_failure: Mutex<Option<(usize, String)>> = Mutex::new(None);
        let control = self.control.clone();
        let capturing = self.capturing;
        let on_rank = |r: usize, b: &mut (dyn Backend + Send), pool: Option<&rayon::ThreadPool>| {
            let out = in_pool(pool, || guarded(|| f(r, b)));
            if let Err(e) = &out {
                let mut first = first_failure.lock().unwrap_or_else(|e| e.into_inner());
                if first.is_none() {
                    *first = Some((r, e.to_string()));
                    if let Some(c) = control.as_ref().filter(|_| !capturing) {
                        c.abort(r as u32, &e.to_string());
                    }
                }
            }
            out
        };
        let on_rank = &on_rank;
        let pools = &self.pools;
        let results: Vec<Result<T>> = std::thread::scope(|s| {
            let mut it = self.ranks.iter_mut().enumerate();
            let (_, first) = it.next().expect("at least one rank");
            let handles: Vec<_> = it
                .map(|(r, b)| s.spawn(move || on_rank(r, b.as_mut(), pools[r].as_deref())))
                .collect();
            let mut out = vec![on_rank(0, first.as_mut(), pools[0].as_deref())];
            for h in handles {
                out.push(h.join().unwrap_or_else(|_| {
                    Err(BackendError::Device("a rank's thread panicked".into()))
                }));
            }
            out
        });
        let failed = first_failure
            .into_inner()
            .unwrap_or_else(|e| e.into_inner());
        if let Some((r, _)) = failed {
            let mut results = results;
            let e = match results.swap_remove(r) {
                Err(e) => e,
                Ok(_) => BackendError::Device("(no error kept)".into()),
            };
            return Err(self.fail(r, &e));
        }
        let mut first = None;
        for r in results {
            match r {
                Err(e) => return Err(e),
                Ok(v) if first.is_none() => first = Some(v),
                Ok(_) => {}
            }
        }
        Ok(first.expect("at least one rank"))
    }

    /// Runs `f` on every rank in turn, returning rank 0's value.
    fn each<T: Send>(
        &mut self,
        f: impl FnMut(usize, &mut (dyn Backend + Send)) -> Result<T> + Send,
    ) -> Result<T> {
        let mut f = f;
        let mut first = None;
        for (r, b) in self.ranks.iter_mut().enumerate() {
            let v = in_pool(self.pools[r].as_deref(), || f(r, b.as_mut()))?;
            if r == 0 {
                first = Some(v);
            }
        }
        Ok(first.expect("at least one rank"))
    }

    /// [`TpBackend::each`] for a step's work: a failing rank leaves the
    /// ranks out of step, so it stops the group.
    fn each_in_step<T: Send>(
        &mut self,
        f: impl FnMut(usize, &mut (dyn Backend + Send)) -> Result<T> + Send,
    ) -> Result<T> {
        self.check_running()?;
        let mut f = f;
        let mut first = None;
        for r in 0..self.ranks.len() {
            let b = self.ranks[r].as_mut();
            let pool = self.pools[r].as_deref();
            match in_pool(pool, || guarded(|| f(r, b))) {
                Ok(v) if r == 0 => first = Some(v),
                Ok(_) => {}
                Err(e) => return Err(self.fail(r, &e)),
            }
        }
        Ok(first.expect("at least one rank"))
    }

    fn record(&mut self, bases: Vec<DevPtr>, bytes: u64) -> DevPtr {
        let p = bases[0];
        self.allocs
            .insert(p.0, (bytes, bases.iter().map(|b| b.0).collect()));
        p
    }
}

impl Backend for TpBackend {
    fn info(&self) -> DeviceInfo {
        let mut i = self.ranks[0].info();
        i.name = format!("{} ranks x {}", self.ranks.len(), i.name);
        i
    }
    fn ranks(&self) -> u32 {
        self.ranks.len() as u32
    }
    fn collective_ns(&self) -> Option<Vec<u64>> {
        self.control.as_ref()?.collective_ns()
    }
    fn alloc(&mut self, bytes: u64, what: &str) -> Result<DevPtr> {
        let mut bases = Vec::with_capacity(self.ranks.len());
        for b in &mut self.ranks {
            bases.push(b.alloc(bytes, what)?);
        }
        Ok(self.record(bases, bytes))
    }
    fn free(&mut self, ptr: DevPtr) -> Result<()> {
        let (_, bases) = self
            .allocs
            .remove(&ptr.0)
            .ok_or(BackendError::BadAddress(ptr.0))?;
        for (b, base) in self.ranks.iter_mut().zip(bases) {
            b.free(DevPtr(base))?;
        }
        Ok(())
    }
    fn upload(&mut self, dst: DevPtr, data: &[u8]) -> Result<()> {
        let dsts: Vec<DevPtr> = (0..self.ranks.len())
            .map(|r| self.translate(r, dst))
            .collect();
        self.each(|r, b| b.upload(dsts[r], data))
    }
    fn upload_rank(&mut self, rank: u32, dst: DevPtr, data: &[u8]) -> Result<()> {
        let r = rank as usize;
        let d = self.translate(r, dst);
        match self.ranks.get_mut(r) {
            Some(b) => b.upload(d, data),
            None => Err(BackendError::Device(format!(
                "rank {rank} does not exist: the backend drives {} ranks",
                self.ranks.len()
            ))),
        }
    }
    fn download(&mut self, src: DevPtr, out: &mut [u8]) -> Result<()> {
        // Every rank's output is the same; synchronize them all first so no
        // rank is left mid-step.
        self.synchronize()?;
        self.ranks[0].download(src, out)
    }
    fn download_rank(&mut self, rank: u32, src: DevPtr, out: &mut [u8]) -> Result<()> {
        let r = rank as usize;
        let s = self.translate(r, src);
        match self.ranks.get_mut(r) {
            Some(b) => b.download(s, out),
            None => Err(BackendError::Device(format!("rank {rank} does not exist"))),
        }
    }
    fn load_kernels(&mut self, images: &[KernelImage]) -> Result<()> {
        self.each(|_, b| b.load_kernels(images))
    }
    fn reserve_workspace(&mut self, bytes: u64) -> Result<Option<(DevPtr, u64)>> {
        let mut got = Vec::new();
        for b in &mut self.ranks {
            got.push(b.reserve_workspace(bytes)?);
        }
        match got[0] {
            None => Ok(None),
            Some((_, have)) => {
                let bases: Vec<DevPtr> = got.iter().map(|g| g.map_or(DevPtr(0), |g| g.0)).collect();
                Ok(Some((self.record(bases, have), have)))
            }
        }
    }
    fn prepare(&mut self, launch: &Launch) -> Result<()> {
        let per: Vec<Launch> = (0..self.ranks.len())
            .map(|r| self.launch_for(r, launch))
            .collect();
        self.each(|r, b| b.prepare(&per[r]))
    }
    fn launch(&mut self, launch: &Launch) -> Result<()> {
        let per: Vec<Launch> = (0..self.ranks.len())
            .map(|r| self.launch_for(r, launch))
            .collect();
        if kiln_ir::validate::is_collective(&launch.op) {
            // Every rank must reach the collective at once.
            self.concurrently(|r, b| b.launch(&per[r]))
        } else {
            self.each_in_step(|r, b| b.launch(&per[r]))
        }
    }
    fn synchronize(&mut self) -> Result<()> {
        self.each(|_, b| b.synchronize())
    }
    fn begin_capture(&mut self, key: Key) -> Result<()> {
        self.each(|_, b| b.begin_capture(key))?;
        self.capturing = true;
        Ok(())
    }
    fn end_capture(&mut self) -> Result<GraphHandle> {
        self.capturing = false;
        let mut gs = Vec::new();
        for b in &mut self.ranks {
            gs.push(b.end_capture()?);
        }
        let h = self.next_graph;
        self.next_graph += 1;
        self.graphs.insert(h, gs);
        Ok(GraphHandle(h))
    }
    fn abort_capture(&mut self) -> Result<()> {
        self.capturing = false;
        let mut first = Ok(());
        for b in &mut self.ranks {
            let r = b.abort_capture();
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
    fn replay(&mut self, graph: GraphHandle) -> Result<()> {
        let gs = self
            .graphs
            .get(&graph.0)
            .cloned()
            .ok_or_else(|| BackendError::Device(format!("no graph {}", graph.0)))?;
        let replays = self.replays.clone();
        self.concurrently(|r, b| {
            b.replay(gs[r])?;
            replays[r].fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
    }
    fn destroy_graph(&mut self, graph: GraphHandle) -> Result<()> {
        let gs = self
            .graphs
            .remove(&graph.0)
            .ok_or_else(|| BackendError::Device(format!("no graph {}", graph.0)))?;
        self.each(|r, b| b.destroy_graph(gs[r]))
    }
}
