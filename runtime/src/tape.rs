//! A CPU executor of a megakernel tape ([`kiln_ir::schedule::Tape`]): the
//! proof, without a GPU, that a tape the compiler writes computes what the
//! op list computes.
//!
//! It runs a key's step over its own copy of every region the key uses
//! ([`KeyMemory`]), either op by op ([`run_ops`], the reference) or task by
//! task ([`run_tape`]) in one of three [`Order`]s: worker threads, one per
//! queue, spinning on atomic counters as the interpreter kernel's blocks
//! will; or a single-threaded adversary that runs any task whose waits and
//! queue predecessor are done, preferring the task latest on the tape (so
//! producers run as late as the waits allow), optionally starving one chosen
//! task until nothing else can run.
//!
//! Each task runs the CPU reference kernel of its op over **private copies**
//! of its operands in which only the bytes the task declares it reads
//! (`Task::reads`) are copied from memory and everything else is poison
//! (all-ones bytes: NaN in every float dtype); the kernel computes the whole
//! op into private results and only the task's tile (`Task::writes`) is
//! copied back. So a tile that reads a byte its footprint does not declare
//! computes poison, a task that runs before its producer reads the
//! producer's stale or poisoned bytes, and either shows up as output that
//! differs bitwise from [`run_ops`]. On top, the arena (which holds nothing
//! across steps) is poisoned at the start of every step and its bytes are
//! tracked: a task copying in arena bytes no task wrote yet this step is
//! reported in [`TapeRun::unwritten_reads`], naming the task and the bytes.
//!
//! Weights are read in place (nothing writes them). A task recomputing its
//! whole op is wasteful and deliberate: the CPU reference kernels stay the
//! one source of each op's math, and the tile's bits are the whole op's.
//!
//! Not here: the GPU interpreter kernel, counters in device memory and
//! their memset (this executor keeps its own counters, zeroed per step),
//! staging and sequence bookkeeping (tests stage inputs into
//! [`KeyMemory`] themselves), and any claim about speed.

use kiln_ir::plan::{BufRef, KeyPlan, Operand, Plan, Region};
use kiln_ir::schedule::{describe, Tape, Task};
use kiln_kernels::cpu::{execute, KernelError, RawTensor};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering};
use std::sync::Mutex;

/// Why a step on the tape executor failed.
#[derive(Debug, thiserror::Error)]
pub enum TapeError {
    #[error("{what}: {source}")]
    Kernel { what: String, source: KernelError },
    #[error(
        "{0} lies outside the executor's memory; validate the plan first (`kiln_ir::validate`)"
    )]
    Bounds(String),
    #[error("the tape deadlocked: no queue's head task can run ({0}); a verified tape never does")]
    Deadlock(String),
}

/// Every region a key touches, as host memory (8-byte aligned).
#[derive(Clone, Debug)]
pub struct KeyMemory {
    regions: BTreeMap<Region, Vec<u64>>,
    sizes: BTreeMap<Region, u64>,
}

impl KeyMemory {
    /// Zeroed memory for every region `kp` names, sized as `plan` declares.
    pub fn new(plan: &Plan, kp: &KeyPlan) -> Result<KeyMemory, TapeError> {
        let mut sizes = BTreeMap::new();
        let bufs = kp
            .ops
            .iter()
            .flat_map(|o| o.args.iter().chain(&o.results).map(|x| x.buf))
            .chain(kp.inputs.iter().map(|(_, b)| *b))
            .chain(kp.outputs.iter().map(|(_, o)| o.buf));
        for b in bufs {
            let size = kiln_ir::validate::region_size(plan, kp, b.region)
                .filter(|&s| s < 1 << 36)
                .ok_or_else(|| TapeError::Bounds(format!("{:?}", b.region)))?;
            sizes.insert(b.region, size);
        }
        let regions = sizes
            .iter()
            .map(|(&r, &s)| (r, vec![0u64; s.div_ceil(8) as usize]))
            .collect();
        Ok(KeyMemory { regions, sizes })
    }

    /// The bytes of region `r`.
    pub fn region(&self, r: Region) -> Option<&[u8]> {
        let v = self.regions.get(&r)?;
        let n = self.sizes[&r] as usize;
        Some(&bytemuck_bytes(v)[..n])
    }

    /// The bytes of region `r`, writable (staging, weights).
    pub fn region_mut(&mut self, r: Region) -> Option<&mut [u8]> {
        let n = *self.sizes.get(&r)? as usize;
        let v = self.regions.get_mut(&r)?;
        Some(&mut bytemuck_bytes_mut(v)[..n])
    }

    /// The bytes `b` names.
    pub fn slice(&self, b: &BufRef) -> Result<&[u8], TapeError> {
        let r = self
            .region(b.region)
            .ok_or_else(|| TapeError::Bounds(format!("{b:?}")))?;
        let e = b
            .offset
            .checked_add(b.bytes)
            .filter(|&e| e <= r.len() as u64);
        e.map(|e| &r[b.offset as usize..e as usize])
            .ok_or_else(|| TapeError::Bounds(format!("{b:?}")))
    }

    /// The bytes `b` names, writable.
    pub fn slice_mut(&mut self, b: &BufRef) -> Result<&mut [u8], TapeError> {
        let r = self
            .region_mut(b.region)
            .ok_or_else(|| TapeError::Bounds(format!("{b:?}")))?;
        let len = r.len() as u64;
        match b.offset.checked_add(b.bytes).filter(|&e| e <= len) {
            Some(e) => Ok(&mut r[b.offset as usize..e as usize]),
            None => Err(TapeError::Bounds(format!("{b:?}"))),
        }
    }

    /// Regions and their bytes, in region order (for comparisons).
    pub fn regions(&self) -> impl Iterator<Item = (Region, &[u8])> {
        self.sizes
            .keys()
            .map(|&r| (r, self.region(r).expect("a region of this memory")))
    }

    fn bases(&mut self) -> Bases {
        Bases(
            self.regions
                .iter_mut()
                .map(|(&r, v)| (r, (v.as_mut_ptr() as *mut u8, self.sizes[&r])))
                .collect(),
        )
    }

    fn poison_arena(&mut self) {
        if let Some(a) = self.region_mut(Region::Arena) {
            a.fill(0xff);
        }
    }
}

fn bytemuck_bytes(v: &[u64]) -> &[u8] {
    // SAFETY: u64 has no padding; any byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 8) }
}

fn bytemuck_bytes_mut(v: &mut [u64]) -> &mut [u8] {
    // SAFETY: as above; the borrow is unique.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, v.len() * 8) }
}

/// Base pointers of a [`KeyMemory`]'s regions, shared by worker threads.
/// Tasks touch disjoint bytes unless one waits for the other (what the tape
/// verifier proves), so sharing them is race-free for a verified tape.
struct Bases(BTreeMap<Region, (*mut u8, u64)>);

// SAFETY: see the type's docs: concurrent tasks access disjoint bytes.
unsafe impl Send for Bases {}
// SAFETY: as above.
unsafe impl Sync for Bases {}

impl Bases {
    fn ptr(&self, b: &BufRef) -> Result<*mut u8, TapeError> {
        let &(p, size) = self
            .0
            .get(&b.region)
            .ok_or_else(|| TapeError::Bounds(format!("{b:?}")))?;
        match b.offset.checked_add(b.bytes) {
            // SAFETY: inside the region's allocation.
            Some(e) if e <= size => Ok(unsafe { p.add(b.offset as usize) }),
            _ => Err(TapeError::Bounds(format!("{b:?}"))),
        }
    }
}

fn extent(o: &Operand) -> BufRef {
    BufRef {
        bytes: o.buf.bytes.min(o.ty.size_bytes()),
        ..o.buf
    }
}

/// Runs the key's ops in order over `mem` with the CPU reference kernels
/// (the arena poisoned first): what every tape order must reproduce.
pub fn run_ops(kp: &KeyPlan, mem: &mut KeyMemory) -> Result<(), TapeError> {
    mem.poison_arena();
    let bases = mem.bases();
    for (i, op) in kp.ops.iter().enumerate() {
        let raw = |o: &Operand| -> Result<RawTensor, TapeError> {
            Ok(RawTensor {
                ptr: bases.ptr(&extent(o))?,
                ty: o.ty.clone(),
            })
        };
        let args = op.args.iter().map(raw).collect::<Result<Vec<_>, _>>()?;
        let results = op.results.iter().map(raw).collect::<Result<Vec<_>, _>>()?;
        // SAFETY: every pointer is inside an allocation of its region and
        // sized by its type; the planner's aliasing is what `execute`
        // allows (the plan was validated).
        unsafe { execute(&op.op, &args, &results) }.map_err(|source| TapeError::Kernel {
            what: format!("op {i} `{}`", op.op.mnemonic()),
            source,
        })?;
    }
    Ok(())
}

/// In what order [`run_tape`] runs the tasks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// One worker thread per non-empty queue, spinning on atomic counters.
    Threads,
    /// One thread; of the tasks that can run (queue head, waits met), the
    /// one latest on the tape.
    LatestFirst,
    /// As `LatestFirst`, but task `n` runs only when nothing else can.
    Starve(u32),
}

/// What a tape run observed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TapeRun {
    /// Task ids in the order they ran (single-threaded orders; empty for
    /// `Threads`).
    pub ran: Vec<u32>,
    /// Arena reads of bytes no task had written yet this step (at most 16).
    pub unwritten_reads: Vec<String>,
}

/// Per-step write tracking of the arena.
struct Tracking {
    written: Vec<AtomicU8>,
    reports: Mutex<Vec<String>>,
}

impl Tracking {
    fn new(arena: u64) -> Tracking {
        Tracking {
            written: (0..arena).map(|_| AtomicU8::new(0)).collect(),
            reports: Mutex::new(Vec::new()),
        }
    }
    fn check(&self, what: impl Fn() -> String, lo: u64, hi: u64) {
        let hi = hi.min(self.written.len() as u64);
        let mut first = None;
        let mut count = 0u64;
        for b in lo..hi {
            if self.written[b as usize].load(Ordering::Relaxed) == 0 {
                first.get_or_insert(b);
                count += 1;
            }
        }
        if let Some(f) = first {
            let mut r = self.reports.lock().unwrap_or_else(|e| e.into_inner());
            if r.len() < 16 {
                r.push(format!(
                    "{} read {count} arena byte(s) of {lo}..{hi} (first {f}) before any task wrote them this step",
                    what()
                ));
            }
        }
    }
    fn mark(&self, lo: u64, hi: u64) {
        for b in lo..hi.min(self.written.len() as u64) {
            self.written[b as usize].store(1, Ordering::Relaxed);
        }
    }
}

/// Runs one task: private operand copies holding only its declared reads,
/// the whole op's reference kernel, its declared writes copied back.
fn run_task(
    kp: &KeyPlan,
    tape: &Tape,
    t: u32,
    bases: &Bases,
    tracking: &Tracking,
) -> Result<(), TapeError> {
    let task: &Task = &tape.tasks[t as usize];
    let what = || describe(kp, tape, t);
    let op = kp
        .ops
        .get(task.op as usize)
        .ok_or_else(|| TapeError::Bounds(what()))?;
    let mut private: Vec<Vec<u64>> = Vec::new();
    let mut args = Vec::with_capacity(op.args.len());
    for a in &op.args {
        let ext = extent(a);
        if matches!(a.buf.region, Region::Weight(_)) {
            args.push(RawTensor {
                ptr: bases.ptr(&ext)?,
                ty: a.ty.clone(),
            });
            continue;
        }
        let mut buf = vec![u64::MAX; ext.bytes.div_ceil(8) as usize];
        let dst = buf.as_mut_ptr() as *mut u8;
        for r in task.reads.iter().filter(|r| r.region == ext.region) {
            let lo = r.offset.max(ext.offset);
            let hi = (r.offset + r.bytes).min(ext.offset + ext.bytes);
            if lo >= hi {
                continue;
            }
            let src = bases.ptr(&BufRef {
                region: r.region,
                offset: lo,
                bytes: hi - lo,
            })?;
            if r.region == Region::Arena {
                tracking.check(what, lo, hi);
            }
            // SAFETY: `src` is inside the region (checked by `ptr`), `dst`
            // inside `buf` (lo..hi lies within the operand's extent).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src,
                    dst.add((lo - ext.offset) as usize),
                    (hi - lo) as usize,
                )
            };
        }
        args.push(RawTensor {
            ptr: dst,
            ty: a.ty.clone(),
        });
        private.push(buf);
    }
    let mut outs: Vec<Vec<u64>> = op
        .results
        .iter()
        .map(|r| vec![u64::MAX; extent(r).bytes.div_ceil(8) as usize])
        .collect();
    let results: Vec<RawTensor> = op
        .results
        .iter()
        .zip(outs.iter_mut())
        .map(|(r, b)| RawTensor {
            ptr: b.as_mut_ptr() as *mut u8,
            ty: r.ty.clone(),
        })
        .collect();
    // SAFETY: every argument pointer is a weight in memory or a private
    // buffer of the operand's size; every result a private buffer of its
    // size, distinct from every argument.
    unsafe { execute(&op.op, &args, &results) }.map_err(|source| TapeError::Kernel {
        what: what(),
        source,
    })?;
    drop(private);
    for w in &task.writes {
        let Some((r, out)) = op
            .results
            .iter()
            .zip(&outs)
            .map(|(r, o)| (extent(r), o))
            .find(|(r, _)| {
                r.region == w.region
                    && w.offset >= r.offset
                    && w.offset + w.bytes <= r.offset + r.bytes
            })
        else {
            return Err(TapeError::Bounds(format!("{}: write {w:?}", what())));
        };
        let dst = bases.ptr(w)?;
        let src = out.as_ptr() as *const u8;
        // SAFETY: `w` lies inside result `r`'s private buffer and inside the
        // region; concurrent tasks never write overlapping bytes (verified).
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.add((w.offset - r.offset) as usize),
                dst,
                w.bytes as usize,
            )
        };
        if w.region == Region::Arena {
            tracking.mark(w.offset, w.offset + w.bytes);
        }
    }
    Ok(())
}

/// Runs one step of `kp` as its tape over `mem` (the arena poisoned first).
/// The tape should have passed the validator; an unverified one may
/// compute garbage or deadlock (reported, never hung on, in single-threaded
/// orders), which is what the mutation tests use.
pub fn run_tape(
    kp: &KeyPlan,
    tape: &Tape,
    mem: &mut KeyMemory,
    order: Order,
) -> Result<TapeRun, TapeError> {
    mem.poison_arena();
    let arena = mem.sizes.get(&Region::Arena).copied().unwrap_or(0);
    let bases = mem.bases();
    let tracking = Tracking::new(arena);
    let counters = tape.counter_count().min(tape.tasks.len() as u64 * 4 + 16) as usize;
    let mut ran = Vec::new();
    match order {
        Order::Threads => {
            let counters: Vec<AtomicU32> = (0..counters).map(|_| AtomicU32::new(0)).collect();
            let abort = AtomicBool::new(false);
            let failure: Mutex<Option<TapeError>> = Mutex::new(None);
            std::thread::scope(|s| {
                for q in tape.queues.iter().filter(|q| !q.is_empty()) {
                    let (counters, abort, failure) = (&counters, &abort, &failure);
                    let (bases, tracking) = (&bases, &tracking);
                    s.spawn(move || {
                        for &t in q {
                            let task = &tape.tasks[t as usize];
                            for w in &task.waits {
                                let mut spins = 0u32;
                                while counters
                                    .get(w.counter as usize)
                                    .is_none_or(|c| c.load(Ordering::Acquire) < w.target)
                                {
                                    if abort.load(Ordering::Relaxed) {
                                        return;
                                    }
                                    spins += 1;
                                    if spins.is_multiple_of(64) {
                                        std::thread::yield_now();
                                    } else {
                                        std::hint::spin_loop();
                                    }
                                }
                            }
                            if let Err(e) = run_task(kp, tape, t, bases, tracking) {
                                abort.store(true, Ordering::Relaxed);
                                *failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                                return;
                            }
                            if let Some(c) = counters.get(task.counter as usize) {
                                c.fetch_add(1, Ordering::Release);
                            }
                        }
                    });
                }
            });
            if let Some(e) = failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
                return Err(e);
            }
        }
        Order::LatestFirst | Order::Starve(_) => {
            let starved = match order {
                Order::Starve(n) => Some(n),
                _ => None,
            };
            let mut counts = vec![0u32; counters];
            let mut heads = vec![0usize; tape.queues.len()];
            let n = tape.tasks.len();
            while ran.len() < n {
                let ready: Vec<(usize, u32)> = tape
                    .queues
                    .iter()
                    .zip(&heads)
                    .enumerate()
                    .filter_map(|(q, (list, &h))| list.get(h).map(|&t| (q, t)))
                    .filter(|&(_, t)| {
                        tape.tasks[t as usize].waits.iter().all(|w| {
                            counts
                                .get(w.counter as usize)
                                .is_some_and(|&c| c >= w.target)
                        })
                    })
                    .collect();
                let pick = ready
                    .iter()
                    .copied()
                    .filter(|&(_, t)| Some(t) != starved)
                    .max_by_key(|&(_, t)| t)
                    .or_else(|| ready.first().copied());
                let Some((q, t)) = pick else {
                    let heads: Vec<String> = tape
                        .queues
                        .iter()
                        .zip(&heads)
                        .filter_map(|(q, &h)| q.get(h))
                        .map(|&t| describe(kp, tape, t))
                        .collect();
                    return Err(TapeError::Deadlock(heads.join(", ")));
                };
                run_task(kp, tape, t, &bases, &tracking)?;
                if let Some(c) = counts.get_mut(tape.tasks[t as usize].counter as usize) {
                    *c += 1;
                }
                heads[q] += 1;
                ran.push(t);
            }
        }
    }
    let unwritten_reads = tracking
        .reports
        .into_inner()
        .unwrap_or_else(|e| e.into_inner());
    Ok(TapeRun {
        ran,
        unwritten_reads,
    })
}
