//! Parallel loops for the kernels, robust to a busy machine.
//!
//! A plain rayon `par_iter` called from the backend's thread injects the job
//! into the pool and puts the caller to sleep; on a loaded machine the
//! step then waits for pool threads to be scheduled at every op (a decode
//! step has ~150 ops). [`for_each_chunk`] instead runs chunks on the calling
//! thread at once and lets rayon's workers help: every thread claims the
//! next chunk from an atomic counter, and when the caller runs out of chunks
//! it closes the job, so a helper that had not started yet never touches it
//! and is never waited for. The caller only waits for chunks a helper is
//! already running. On an idle machine helpers join within microseconds;
//! on a saturated one the op degrades to the single-threaded time.
//!
//! Which chunk ran on which thread never changes a result: each chunk
//! writes its own outputs with a fixed operation order.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// State shared between the caller and its helpers.
struct Job {
    next: AtomicUsize,
    chunks: usize,
    /// `(closed, helpers running)`.
    state: Mutex<(bool, usize)>,
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

/// Closes the job and waits for running helpers when the caller leaves
/// `for_each_chunk`, also when a chunk panics on the calling thread, so no
/// helper can call `f` after it is dropped.
struct CloseAndWait<'a>(&'a Job);

impl Drop for CloseAndWait<'_> {
    fn drop(&mut self) {
        let mut s = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        s.0 = true;
        while s.1 > 0 {
            s = self.0.idle.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Decrements the running-helper count even if a chunk panics.
struct Running<'a>(&'a Job);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut s = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        s.1 -= 1;
        if s.1 == 0 {
            self.0.idle.notify_all();
        }
    }
}

/// Calls `f(c)` for every `c` in `0..chunks`, on the calling thread and up
/// to `rayon::current_num_threads() - 1` rayon workers.
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
        state: Mutex::new((false, 0)),
        idle: Condvar::new(),
        f: f_ptr,
    });
    for _ in 0..helpers {
        let job = Arc::clone(&job);
        rayon::spawn(move || {
            {
                let mut s = job.state.lock().unwrap_or_else(|e| e.into_inner());
                if s.0 {
                    return;
                }
                s.1 += 1;
            }
            let _running = Running(&job);
            job.run_chunks();
        });
    }
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
