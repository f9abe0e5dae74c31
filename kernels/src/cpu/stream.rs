//! The memory read bandwidth the CPU kernels' threads reach: the CPU
//! backend's answer to `Backend::copy_bandwidth`, the denominator of
//! `kiln bench`'s floor.
//!
//! Why a read and not a copy: a CPU decode step is a read stream (weights,
//! KV) with a few KB of writes, and a CPU copy's write-allocate traffic
//! would put the floor 2-3x too low. The GPU backends count a copy's bytes
//! read plus written; this counts bytes read, so both are "bytes moved per
//! second" at the device's memory.
//!
//! The pass runs on the kernels' own thread pool ([`super::par`]), cut into
//! chunks as the GEMVs are, so the figure is what those threads can stream
//! and not what a differently scheduled program could.
//!
//! Not here: the allocation (the backend's, so the buffer sits on the same
//! pages as the weights), any write or latency measurement.

use super::par;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Chunks one pass is cut into.
const CHUNKS: usize = 64;

/// Bytes per second read by the kernels' threads over `data`: the median of
/// `reps` passes after one untimed warm-up pass (at least one timed pass).
/// `data` should be resident (faulted in) and larger than the caches.
pub fn read_bandwidth(data: &[u8], reps: u32) -> f64 {
    // SAFETY: every bit pattern is a valid u64.
    let (_, words, _) = unsafe { data.align_to::<u64>() };
    // Whole 8-word rows per chunk, so only the buffer's last < 8 words are
    // left unread (and uncounted).
    let per = words.len().div_ceil(CHUNKS).next_multiple_of(8).max(8);
    let sink = AtomicU64::new(0);
    let pass = || {
        par::for_each_chunk(CHUNKS, |c| {
            let part = words.get(c * per..((c + 1) * per).min(words.len()));
            let mut lanes = [0u64; 8];
            for w in part.unwrap_or(&[]).chunks_exact(8) {
                for (l, v) in lanes.iter_mut().zip(w) {
                    *l = l.wrapping_add(*v);
                }
            }
            let s = lanes.iter().fold(0u64, |a, &b| a.wrapping_add(b));
            sink.fetch_add(std::hint::black_box(s), Ordering::Relaxed);
        })
    };
    pass();
    let mut secs: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            pass();
            t.elapsed().as_secs_f64()
        })
        .collect();
    std::hint::black_box(sink.load(Ordering::Relaxed));
    secs.sort_by(f64::total_cmp);
    let median = secs[secs.len() / 2];
    let read = 8 * (words.len() - words.len() % 8);
    if median > 0.0 {
        read as f64 / median
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_over_a_buffer_reports_a_positive_finite_bandwidth() {
        let data = vec![1u8; 4 << 20];
        let bw = read_bandwidth(&data, 3);
        assert!(bw.is_finite() && bw > 0.0, "{bw}");
        // An empty buffer reads nothing and says so.
        assert_eq!(read_bandwidth(&[], 1), 0.0);
    }
}
