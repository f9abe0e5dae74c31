//! The allocation oracle: a counting global allocator that aborts the
//! process on any single allocation above a bound while a fuzz input runs.
//!
//! A parser of hostile input must size its tables from what the input
//! actually holds, never from a count it merely declares. The inputs the
//! fuzzer makes are at most [`crate::mutate::MAX_INPUT`] bytes, so any one
//! allocation above [`DEFAULT_LIMIT`] (256 MiB) while a target runs is a
//! count taken on trust, and the process stops on it: the message (target,
//! seed, iteration, size) is formatted on the stack and written to stderr
//! without allocating, then the process aborts. The iteration replays with
//! `kiln-fuzz <target> --seed S --start I --iters 1`.
//!
//! Only allocations made while a target runs are checked ([`arm`] /
//! [`disarm`]); building the corpus and the report are not. The binary and
//! the CI test install [`CountingAlloc`] as their `#[global_allocator]`;
//! without it (e.g. in another crate's tests) the oracle reports a peak of
//! zero and never fires.
//!
//! Not here: counting total live bytes (a parser may legitimately hold many
//! small allocations; the bound is per allocation) and freeing checks (the
//! system allocator's own).

use std::alloc::{GlobalAlloc, Layout, System};
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};

/// The bound on any single allocation while an input runs: 256 MiB.
pub const DEFAULT_LIMIT: usize = 256 << 20;

static LIMIT: AtomicUsize = AtomicUsize::new(DEFAULT_LIMIT);
static ARMED: AtomicBool = AtomicBool::new(false);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// What the abort message names: set by the runner before each input.
static TARGET: AtomicUsize = AtomicUsize::new(0);
static SEED: AtomicU64 = AtomicU64::new(0);
static ITER: AtomicU64 = AtomicU64::new(0);

/// Target names by index, for the non-allocating abort message.
pub const TARGET_NAMES: [&str; 6] = ["gguf", "safetensors", "config", "plan", "ir", "http"];

/// The system allocator with the per-allocation bound. Install it with
/// `#[global_allocator] static A: CountingAlloc = CountingAlloc;`.
pub struct CountingAlloc;

#[inline]
fn check(size: usize) {
    if !ARMED.load(Relaxed) {
        return;
    }
    PEAK.fetch_max(size, Relaxed);
    if size > LIMIT.load(Relaxed) {
        ARMED.store(false, Relaxed);
        let mut msg = StackMsg::new();
        let _ = writeln!(
            msg,
            "kiln-fuzz: FAIL allocation of {size} bytes (bound {}) in target {} at seed {} iteration {}; replay with `kiln-fuzz {} --seed {} --start {} --iters 1`",
            LIMIT.load(Relaxed),
            target_name(),
            SEED.load(Relaxed),
            ITER.load(Relaxed),
            target_name(),
            SEED.load(Relaxed),
            ITER.load(Relaxed),
        );
        die(&msg);
    }
}

// SAFETY: every method forwards to `System` with the caller's layout; the
// bookkeeping only reads and writes atomics and never allocates.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        INSTALLED.store(true, Relaxed);
        check(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        check(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

fn target_name() -> &'static str {
    TARGET_NAMES
        .get(TARGET.load(Relaxed))
        .copied()
        .unwrap_or("?")
}

/// Whether [`CountingAlloc`] is this process's global allocator.
pub fn installed() -> bool {
    // Any allocation through it sets the flag; make one.
    drop(std::hint::black_box(Box::new(0u8)));
    INSTALLED.load(Relaxed)
}

/// Sets the per-allocation bound.
pub fn set_limit(bytes: usize) {
    LIMIT.store(bytes, Relaxed);
}

pub fn limit() -> usize {
    LIMIT.load(Relaxed)
}

/// Names the input about to run (for the abort messages of this oracle
/// and of the watchdog).
pub fn set_current(target: usize, seed: u64, iter: u64) {
    TARGET.store(target, Relaxed);
    SEED.store(seed, Relaxed);
    ITER.store(iter, Relaxed);
}

/// Starts checking allocations, with the peak reset.
pub fn arm() {
    PEAK.store(0, Relaxed);
    ARMED.store(true, Relaxed);
}

/// Stops checking; returns the largest single allocation since [`arm`].
pub fn disarm() -> usize {
    ARMED.store(false, Relaxed);
    PEAK.load(Relaxed)
}

/// Writes a message built without allocating, then aborts. Used by this
/// oracle and by the watchdog.
pub(crate) fn die(msg: &StackMsg) -> ! {
    let _ = std::io::stderr().write_all(msg.bytes());
    std::process::abort()
}

/// The abort message for an input that ran past `limit_ms`, without
/// allocating.
pub(crate) fn hang_message(limit_ms: u64, ran_ms: u64) -> StackMsg {
    let mut msg = StackMsg::new();
    let _ = writeln!(
        msg,
        "kiln-fuzz: FAIL hang: target {} at seed {} iteration {} ran {ran_ms} ms (bound {limit_ms} ms); replay with `kiln-fuzz {} --seed {} --start {} --iters 1`",
        target_name(),
        SEED.load(Relaxed),
        ITER.load(Relaxed),
        target_name(),
        SEED.load(Relaxed),
        ITER.load(Relaxed),
    );
    msg
}

/// A fixed 512-byte buffer that `write!` fills without allocating
/// (longer text is cut).
pub(crate) struct StackMsg {
    buf: [u8; 512],
    len: usize,
}

impl StackMsg {
    fn new() -> StackMsg {
        StackMsg {
            buf: [0; 512],
            len: 0,
        }
    }
    fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl std::fmt::Write for StackMsg {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}
