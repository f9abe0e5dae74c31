//! Parallel loops for the kernels, robust to a busy machine.
//!
//! A plain rayon `par_iter` called from the backend's thread injects the job
//! into the pool and puts the caller to sleep; on a loaded machine the
//! step then waits for pool threads to be scheduled at every op (a decode
//! step has ~150 ops). [`for_each_chunk`] instead runs chunks on the calling
//! thread at once and lets helper threads join: every thread claims the
//! next chunk from an atomic counter, and when the caller runs out of chunks
//! it closes the job, so a helper that had not started yet never touches it
//! and is never waited for. The caller only waits for chunks a helper is
//! already running. On a saturated machine the op degrades to the
//! single-threaded time.
//!
//! The helpers are this module's own threads, not rayon's: a decode step
//! posts a job every 20-60 us, and a helper woken through a futex for each
//! one joins too late to take its share (measured on SmolLM2-135M Q4_1 on
//! two cores: the helper ran 45% of the GEMV chunks, and a fifth of all
//! samples were in the scheduler). A helper that finished a job spins on
//! the job counter for [`SPIN`] before it parks, so within a step it joins
//! in well under a microsecond, and an idle process costs nothing. The
//! number of helpers a job takes is still `rayon::current_num_threads() - 1`
//! (`RAYON_NUM_THREADS`, or the pool whose `install` the caller runs in).
//!
//! Which chunk ran on which thread never changes a result: each chunk
//! writes its own outputs with a fixed operation order.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle helper spins for the next job before it parks.
const SPIN: Duration = Duration::from_micros(200);
/// Helper threads at most.
const MAX_HELPERS: usize = 256;

/// State shared between the caller and its helpers.
struct Job {
    next: AtomicUsize,
    chunks: usize,
    /// Helpers that may join.
    helpers: usize,
    /// `(closed, helpers running, helpers joined, caller parked)`.
    state: Mutex<(bool, usize, usize, bool)>,
    idle: Condvar,
    /// The caller's closure, type-erased. Valid while `closed` is false or
    /// a helper is running; the caller does not return before both are over.
    f: *const (dyn Fn(usize) + Sync),
}

// SAFETY: `f` points to a `Sync` closure, and the protocol above keeps it
// alive while any helper may call it.
unsafe impl Send for Job {}
unsafe impl Sync for Job {}

impl Job {
    fn run_chunks(&self) {
        loop {
            let c = self.next.fetch_add(1, Ordering::Relaxed);
            if c >= self.chunks {
                return;
            }
            // SAFETY: see `f`.
            unsafe { (*self.f)(c) };
        }
    }
}

impl Job {
    /// Runs chunks as a helper, unless the job is closed or has its helpers.
    fn join(&self) {
        {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if s.0 || s.2 >= self.helpers {
                return;
            }
            s.1 += 1;
            s.2 += 1;
        }
        let _running = Running(self);
        self.run_chunks();
    }
}

/// The helper threads and the job they serve next.
struct Pool {
    /// The latest posted job (callers that post at once replace each
    /// other's: each caller finishes its own job alone if need be).
    slot: Mutex<Option<Arc<Job>>>,
    /// Bumped by every post; helpers spin on it.
    posted: AtomicU64,
    /// Helpers parked on `wake`.
    parked: Mutex<usize>,
    wake: Condvar,
    spawned: Mutex<usize>,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        slot: Mutex::new(None),
        posted: AtomicU64::new(0),
        parked: Mutex::new(0),
        wake: Condvar::new(),
        spawned: Mutex::new(0),
    })
}

impl Pool {
    fn post(&'static self, job: &Arc<Job>, helpers: usize) {
        {
            let mut n = self.spawned.lock().unwrap_or_else(|e| e.into_inner());
            while *n < helpers.min(MAX_HELPERS) {
                let spawned = std::thread::Builder::new()
                    .name("kiln-cpu".into())
                    .spawn(move || self.serve());
                if spawned.is_err() {
                    // No thread to be had: the callers run their chunks.
                    break;
                }
                *n += 1;
            }
        }
        *self.slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::clone(job));
        self.posted.fetch_add(1, Ordering::Release);
        let parked = self.parked.lock().unwrap_or_else(|e| e.into_inner());
        if *parked > 0 {
            self.wake.notify_all();
        }
    }

    /// A helper's life: wait for a post (spinning, then parked), join it.
    fn serve(&'static self) {
        let mut seen = self.posted.load(Ordering::Acquire);
        loop {
            let since = Instant::now();
            let mut spins = 0u32;
            loop {
                let now = self.posted.load(Ordering::Acquire);
                if now != seen {
                    seen = now;
                    break;
                }
                spins = spins.wrapping_add(1);
                std::hint::spin_loop();
                if spins.is_multiple_of(256) && since.elapsed() >= SPIN {
                    let mut parked = self.parked.lock().unwrap_or_else(|e| e.into_inner());
                    *parked += 1;
                    while self.posted.load(Ordering::Acquire) == seen {
                        parked = self.wake.wait(parked).unwrap_or_else(|e| e.into_inner());
                    }
                    *parked -= 1;
                }
            }
            let job = self.slot.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if let Some(job) = job {
                job.join();
            }
        }
    }
}

/// Closes the job and waits for running helpers when the caller leaves
/// `for_each_chunk`, also when a chunk panics on the calling thread, so no
/// helper can call `f` after it is dropped.
struct CloseAndWait<'a>(&'a Job);

impl Drop for CloseAndWait<'_> {
    fn drop(&mut self) {
        // Helpers still running a chunk finish within microseconds at a
        // decode step's sizes: spin for them first, so the caller is not
        // put to sleep and woken through the scheduler at every op.
        let since = Instant::now();
        loop {
            let mut s = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
            s.0 = true;
            if s.1 == 0 {
                return;
            }
            if since.elapsed() >= SPIN {
                s.3 = true;
                while s.1 > 0 {
                    s = self.0.idle.wait(s).unwrap_or_else(|e| e.into_inner());
                }
                return;
            }
            drop(s);
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        }
    }
}

/// Decrements the running-helper count even if a chunk panics.
struct Running<'a>(&'a Job);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut s = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        s.1 -= 1;
        if s.1 == 0 && s.3 {
            self.0.idle.notify_all();
        }
    }
}

/// Calls `f(c)` for every `c` in `0..chunks`, on the calling thread and up
/// to `rayon::current_num_threads() - 1` helper threads.
pub(crate) fn for_each_chunk<F: Fn(usize) + Sync>(chunks: usize, f: F) {
    let helpers = rayon::current_num_threads()
        .saturating_sub(1)
        .min(chunks.saturating_sub(1));
    if helpers == 0 {
        (0..chunks).for_each(f);
        return;
    }
    let f_ref: &(dyn Fn(usize) + Sync) = &f;
    // SAFETY: erases the borrow's lifetime; the protocol keeps `f` alive
    // for every use (we wait below before `f` is dropped).
    let f_ptr: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(f_ref) };
    let job = Arc::new(Job {
        next: AtomicUsize::new(0),
        chunks,
        helpers,
        state: Mutex::new((false, 0, 0, false)),
        idle: Condvar::new(),
        f: f_ptr,
    });
    pool().post(&job, helpers);
    let _close = CloseAndWait(&job);
    job.run_chunks();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_runs_exactly_once() {
        for chunks in [0, 1, 2, 3, 17, 1000] {
            let hits: Vec<AtomicUsize> = (0..chunks).map(|_| AtomicUsize::new(0)).collect();
            for_each_chunk(chunks, |c| {
                hits[c].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "{chunks}"
            );
        }
    }

    #[test]
    fn a_panicking_chunk_on_the_caller_waits_for_helpers_before_unwinding() {
        let done = AtomicUsize::new(0);
        let caller = std::thread::current().id();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for_each_chunk(64, |_| {
                if std::thread::current().id() == caller {
                    panic!("chunk failed");
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
                done.fetch_add(1, Ordering::Relaxed);
            });
        }));
        assert!(result.is_err());
        // Whatever the helpers ran, they had finished before the unwinding
        // left `for_each_chunk`: the count no longer changes.
        let seen = done.load(Ordering::Relaxed);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(done.load(Ordering::Relaxed), seen);
    }

    #[test]
    fn nested_calls_from_inside_the_pool_finish() {
        let total = AtomicUsize::new(0);
        rayon::scope(|_| {
            for_each_chunk(8, |_| {
                for_each_chunk(8, |_| {
                    total.fetch_add(1, Ordering::Relaxed);
                });
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 64);
    }
}
