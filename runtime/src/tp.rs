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
//! rank order. GPU ranks would each be a `GpuBackend` on its own device
//! with an NCCL communicator; that driver is not written yet (the
//! `GpuDriver::all_reduce_sum` default refuses).
//!
//! Not here: a failure on one rank mid-step leaves the others waiting at
//! the next collective (the CPU exchange has no timeout), pipeline
//! parallelism, several processes or hosts.

use crate::backend::{
    Backend, BackendError, DevOperand, DevPtr, DeviceInfo, GraphHandle, Launch, LaunchBody,
    ResolvedParam, Result,
};
use crate::cpu::{CpuBackend, CpuStats};
use kiln_ir::plan::KernelImage;
use kiln_ir::Key;
use kiln_kernels::cpu::collective::Exchange;
use std::collections::BTreeMap;
use std::sync::{Arc, Barrier, RwLock};

struct Shared {
    ranks: u32,
    barrier: Barrier,
    slots: Vec<RwLock<Vec<f32>>>,
}

/// One rank's handle on an in-process all-gather shared by `ranks` ranks.
pub struct CpuExchange {
    rank: u32,
    shared: Arc<Shared>,
}

impl CpuExchange {
    /// Handles for ranks `0..ranks` of one group.
    pub fn group(ranks: u32) -> Vec<CpuExchange> {
        let shared = Arc::new(Shared {
            ranks,
            barrier: Barrier::new(ranks as usize),
            slots: (0..ranks).map(|_| RwLock::new(Vec::new())).collect(),
        });
        (0..ranks)
            .map(|rank| CpuExchange {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }
}

impl Exchange for CpuExchange {
    fn rank(&self) -> u32 {
        self.rank
    }
    fn ranks(&self) -> u32 {
        self.shared.ranks
    }
    fn all_gather(&self, local: &[f32], f: &mut dyn FnMut(&[&[f32]])) {
        let s = &self.shared;
        {
            let mut mine = s.slots[self.rank as usize]
                .write()
                .unwrap_or_else(|e| e.into_inner());
            mine.clear();
            mine.extend_from_slice(local);
        }
        s.barrier.wait();
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
        s.barrier.wait();
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
}

impl TpBackend {
    /// Composes `ranks` (rank `r` at index `r`). They must be connected to
    /// each other already (a CPU exchange group, NCCL communicators).
    pub fn new(ranks: Vec<Box<dyn Backend + Send>>) -> Result<TpBackend> {
        if ranks.is_empty() {
            return Err(BackendError::Device(
                "a tensor-parallel backend needs at least one rank".into(),
            ));
        }
        Ok(TpBackend {
            ranks,
            allocs: BTreeMap::new(),
            graphs: BTreeMap::new(),
            next_graph: 0,
        })
    }

    /// `n` CPU ranks joined by an in-process exchange, with each rank's
    /// counters.
    pub fn cpu_with_stats(n: u32) -> (TpBackend, Vec<Arc<CpuStats>>) {
        let mut stats = Vec::new();
        let ranks: Vec<Box<dyn Backend + Send>> = CpuExchange::group(n.max(1))
            .into_iter()
            .map(|ex| {
                let b = CpuBackend::new().with_exchange(Arc::new(ex));
                stats.push(b.stats());
                Box::new(b) as Box<dyn Backend + Send>
            })
            .collect();
        (TpBackend::new(ranks).expect("at least one rank"), stats)
    }

    /// `n` CPU ranks joined by an in-process exchange.
    pub fn cpu(n: u32) -> TpBackend {
        TpBackend::cpu_with_stats(n).0
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
    /// first), returning rank 0's value or the first error by rank.
    fn concurrently<T: Send>(
        &mut self,
        f: impl Fn(usize, &mut (dyn Backend + Send)) -> Result<T> + Sync,
    ) -> Result<T> {
        let f = &f;
        let results: Vec<Result<T>> = std::thread::scope(|s| {
            let mut it = self.ranks.iter_mut().enumerate();
            let (_, first) = it.next().expect("at least one rank");
            let handles: Vec<_> = it.map(|(r, b)| s.spawn(move || f(r, b.as_mut()))).collect();
            let mut out = vec![f(0, first.as_mut())];
            for h in handles {
                out.push(h.join().unwrap_or_else(|_| {
                    Err(BackendError::Device("a rank's thread panicked".into()))
                }));
            }
            out
        });
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
    fn each<T>(&mut self, mut f: impl FnMut(usize, &mut dyn Backend) -> Result<T>) -> Result<T> {
        let mut first = None;
        for (r, b) in self.ranks.iter_mut().enumerate() {
            let v = f(r, b.as_mut())?;
            if r == 0 {
                first = Some(v);
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
            self.each(|r, b| b.launch(&per[r]))
        }
    }
    fn synchronize(&mut self) -> Result<()> {
        self.each(|_, b| b.synchronize())
    }
    fn begin_capture(&mut self, key: Key) -> Result<()> {
        self.each(|_, b| b.begin_capture(key))
    }
    fn end_capture(&mut self) -> Result<GraphHandle> {
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
        self.concurrently(|r, b| b.replay(gs[r]))
    }
    fn destroy_graph(&mut self, graph: GraphHandle) -> Result<()> {
        let gs = self
            .graphs
            .remove(&graph.0)
            .ok_or_else(|| BackendError::Device(format!("no graph {}", graph.0)))?;
        self.each(|r, b| b.destroy_graph(gs[r]))
    }
}
