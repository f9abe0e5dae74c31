//! A campaign: iterations `start..start + iters` of one target, each input
//! made by the [`Mutator`], run under the three oracles, and summed into a
//! [`Report`].
//!
//! - Panics are caught per input (`catch_unwind`, with a quiet panic hook
//!   that keeps the message); the input is saved under
//!   `<crashes>/<target>/seed<S>-iter<I>.bin` and the campaign goes on.
//! - Allocations above the bound abort the process ([`crate::alloc`]).
//! - A watchdog thread aborts the process when one input runs longer than
//!   the time bound (default [`DEFAULT_TIMEOUT_MS`]), naming the iteration.
//!
//! Both aborts name `(target, seed, iteration)`; the same triple replays the
//! same input, and `--dump` writes it out without running it.
//!
//! Not here: parallel workers (one core per campaign keeps a shared machine
//! usable and the reports comparable) and corpus growth from new inputs
//! (no coverage signal on stable Rust).

use crate::alloc;
use crate::mutate::Mutator;
use crate::targets::{Outcome, Target};
use serde::Serialize;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The bound on one input's run time: 2 s (the slowest seed runs in
/// milliseconds).
pub const DEFAULT_TIMEOUT_MS: u64 = 2000;

/// How a campaign runs.
#[derive(Clone, Debug)]
pub struct Config {
    pub target: Target,
    pub seed: u64,
    pub start: u64,
    pub iters: u64,
    /// Where panicking inputs are saved (`<crashes>/<target>/`); `None`
    /// keeps them in memory only (the CI test).
    pub crashes: Option<PathBuf>,
    pub timeout_ms: u64,
}

/// One panicking or otherwise failing input.
#[derive(Clone, Debug, Serialize)]
pub struct Failure {
    pub iteration: u64,
    pub message: String,
    /// Where the input was saved, if it was.
    pub saved: Option<PathBuf>,
}

/// What a campaign found.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub target: String,
    pub seed: u64,
    pub start: u64,
    pub inputs: u64,
    /// Inputs the whole path accepted.
    pub accepted: u64,
    /// Inputs refused with an error.
    pub rejected: u64,
    pub panics: Vec<Failure>,
    /// Broken oracles other than panics (e.g. an IR round trip).
    pub findings: Vec<Failure>,
    /// Largest single allocation while an input ran, and which input.
    pub peak_alloc_bytes: u64,
    pub peak_alloc_iteration: u64,
    pub alloc_limit_bytes: u64,
    /// Whether the counting allocator was installed (else peaks read 0).
    pub alloc_counted: bool,
    pub slowest_us: u64,
    pub slowest_iteration: u64,
    pub largest_input_bytes: u64,
    pub elapsed_ms: u64,
}

impl Report {
    /// Zero panics and zero findings (allocation and time bounds abort the
    /// process, so a report that exists has met them).
    pub fn clean(&self) -> bool {
        self.panics.is_empty() && self.findings.is_empty()
    }

    pub const HEADER: &'static str =
        "target       seed        inputs   accepted   rejected  panics  findings  peak_alloc(iter)          slowest(iter)          secs";

    /// One line of the results table.
    pub fn line(&self) -> String {
        format!(
            "{:<12} {:<8} {:>10} {:>10} {:>10} {:>7} {:>9}  {:>9} B ({:<10}) {:>8} us ({:<10}) {:>6.1}",
            self.target,
            self.seed,
            self.inputs,
            self.accepted,
            self.rejected,
            self.panics.len(),
            self.findings.len(),
            self.peak_alloc_bytes,
            self.peak_alloc_iteration,
            self.slowest_us,
            self.slowest_iteration,
            self.elapsed_ms as f64 / 1000.0
        )
    }
}

/// The message of the last panic on this process (set by the quiet hook).
fn last_panic() -> &'static Mutex<Option<String>> {
    static LAST: OnceLock<Mutex<Option<String>>> = OnceLock::new();
    LAST.get_or_init(|| Mutex::new(None))
}

/// Start of the running input in ns since [`epoch`]; 0 when idle.
static RUNNING_SINCE: AtomicU64 = AtomicU64::new(0);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ns() -> u64 {
    (epoch().elapsed().as_nanos() as u64).max(1)
}

/// Campaigns share process-wide oracles; run one at a time.
fn campaign_lock() -> &'static Mutex<()> {
    static LOCK: OnceLock<Mutex<()>> = OnceLock::new();
    LOCK.get_or_init(|| Mutex::new(()))
}

fn watchdog(limit_ms: u64, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let limit_ns = limit_ms.saturating_mul(1_000_000);
        while !stop.load(Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
            let since = RUNNING_SINCE.load(Relaxed);
            if since == 0 {
                continue;
            }
            let ran = now_ns().saturating_sub(since);
            if ran > limit_ns {
                alloc::die(&alloc::hang_message(limit_ms, ran / 1_000_000));
            }
        }
    })
}

/// Runs a campaign over `corpus`.
pub fn run(cfg: &Config, corpus: &[Vec<u8>]) -> Report {
    let _guard = campaign_lock().lock().unwrap_or_else(|e| e.into_inner());
    let target = cfg.target;
    let mutator = Mutator::new(corpus, target.shape(), cfg.seed, target.index() as u64 + 1);
    let counted = alloc::installed();
    let started = Instant::now();
    epoch();

    let prev_hook = panic::take_hook();
    panic::set_hook(Box::new(|info| {
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let msg = if let Some(s) = info.payload().downcast_ref::<&str>() {
            (*s).to_string()
        } else if let Some(s) = info.payload().downcast_ref::<String>() {
            s.clone()
        } else {
            "(non-string panic payload)".to_string()
        };
        *last_panic().lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("{msg}{at}"));
    }));
    let stop = Arc::new(AtomicBool::new(false));
    let dog = watchdog(cfg.timeout_ms, stop.clone());

    let mut r = Report {
        target: target.name().to_string(),
        seed: cfg.seed,
        start: cfg.start,
        inputs: 0,
        accepted: 0,
        rejected: 0,
        panics: Vec::new(),
        findings: Vec::new(),
        peak_alloc_bytes: 0,
        peak_alloc_iteration: cfg.start,
        alloc_limit_bytes: alloc::limit() as u64,
        alloc_counted: counted,
        slowest_us: 0,
        slowest_iteration: cfg.start,
        largest_input_bytes: 0,
        elapsed_ms: 0,
    };
    for iter in cfg.start..cfg.start.saturating_add(cfg.iters) {
        let input = mutator.input(iter);
        alloc::set_current(target.index(), cfg.seed, iter);
        let t0 = Instant::now();
        RUNNING_SINCE.store(now_ns(), Relaxed);
        alloc::arm();
        let result = panic::catch_unwind(AssertUnwindSafe(|| target.run(&input)));
        let peak = alloc::disarm();
        RUNNING_SINCE.store(0, Relaxed);
        let us = t0.elapsed().as_micros() as u64;

        r.inputs += 1;
        r.largest_input_bytes = r.largest_input_bytes.max(input.len() as u64);
        if peak as u64 > r.peak_alloc_bytes {
            r.peak_alloc_bytes = peak as u64;
            r.peak_alloc_iteration = iter;
        }
        if us > r.slowest_us {
            r.slowest_us = us;
            r.slowest_iteration = iter;
        }
        match result {
            Ok(Outcome::Accepted) => r.accepted += 1,
            Ok(Outcome::Rejected) => r.rejected += 1,
            Ok(Outcome::Finding(message)) => {
                let saved = save(cfg, iter, &input);
                r.findings.push(Failure {
                    iteration: iter,
                    message,
                    saved,
                });
            }
            Err(_) => {
                let message = last_panic()
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take()
                    .unwrap_or_else(|| "(no panic message)".into());
                let saved = save(cfg, iter, &input);
                r.panics.push(Failure {
                    iteration: iter,
                    message,
                    saved,
                });
            }
        }
    }
    stop.store(true, Relaxed);
    let _ = dog.join();
    panic::set_hook(prev_hook);
    r.elapsed_ms = started.elapsed().as_millis() as u64;
    r
}

fn save(cfg: &Config, iter: u64, input: &[u8]) -> Option<PathBuf> {
    let dir = cfg.crashes.as_ref()?.join(cfg.target.name());
    let path = dir.join(format!("seed{}-iter{iter}.bin", cfg.seed));
    std::fs::create_dir_all(&dir).ok()?;
    std::fs::write(&path, input).ok()?;
    Some(path)
}

/// Writes the inputs of `start..start + iters` to `dir` without running
/// them (to inspect or replay an input a bound aborted on).
pub fn dump(cfg: &Config, corpus: &[Vec<u8>], dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let target = cfg.target;
    let mutator = Mutator::new(corpus, target.shape(), cfg.seed, target.index() as u64 + 1);
    std::fs::create_dir_all(dir)?;
    let mut out = Vec::new();
    for iter in cfg.start..cfg.start.saturating_add(cfg.iters) {
        let path = dir.join(format!("{}-seed{}-iter{iter}.bin", target.name(), cfg.seed));
        std::fs::write(&path, mutator.input(iter))?;
        out.push(path);
    }
    Ok(out)
}
