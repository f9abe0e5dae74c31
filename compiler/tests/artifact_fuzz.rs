//! Corrupted and truncated plan files: decoding never panics, never
//! allocates more than a small multiple of the file, and reports the fault
//! class the damage belongs to.

mod planner_support;

use kiln_compiler::passes::synth::{SynthFamily, SynthSpec};
use kiln_ir::artifact::{decode, encode, write_plan_atomic, ArtifactError, HEADER_LEN};
use planner_support::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Counts the live bytes and the high-water mark of this test binary.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Decodes `bytes`, returning the result and the most memory the decode had
/// allocated beyond what was live before it. Runs on the calling thread;
/// this binary's only test does the decoding, so nothing else allocates.
fn decode_measured(bytes: &[u8]) -> (Result<kiln_ir::plan::Plan, ArtifactError>, usize) {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let r = std::panic::catch_unwind(|| decode(bytes)).expect("decode panicked");
    (r, PEAK.load(Ordering::Relaxed) - before)
}

#[test]
fn corrupted_and_truncated_plans_never_panic_and_never_allocate_hugely() {
    let spec = SynthSpec::tiny(SynthFamily::Qwen2);
    let o = kiln_compiler::compile::CompileOptions {
        keys: keys("b1q1s0,b2q3s2"),
        logits: true,
        ..Default::default()
    };
    let plan = compile_synth(&spec, &o).plan;
    let good = encode(&plan);
    let (r, _) = decode_measured(&good);
    assert_eq!(r.unwrap(), plan);
    // What a legitimate decode of this file costs: the bound for damaged ones.
    let budget = 16 * good.len() + (1 << 20);
    let mut rng = Rng::new(2024);
    let mut classes = std::collections::BTreeMap::<&str, u32>::new();
    let mut note = |r: &Result<kiln_ir::plan::Plan, ArtifactError>| {
        let c = match r {
            Ok(_) => "ok",
            Err(ArtifactError::Truncated { .. }) => "truncated",
            Err(ArtifactError::BadMagic) => "magic",
            Err(ArtifactError::NewerVersion { .. }) => "newer",
            Err(ArtifactError::OlderVersion { .. }) => "older",
            Err(ArtifactError::TrailingBytes { .. }) => "trailing",
            Err(ArtifactError::ChecksumMismatch { .. }) => "checksum",
            Err(ArtifactError::Body { .. }) => "body",
        };
        *classes.entry(c).or_default() += 1;
    };

    // Truncation at every 97th offset (and every header offset).
    for cut in (0..HEADER_LEN + 2).chain((HEADER_LEN..good.len()).step_by(97)) {
        let (r, used) = decode_measured(&good[..cut]);
        assert!(used <= budget, "cut at {cut}: {used} bytes allocated");
        assert!(
            matches!(
                r,
                Err(ArtifactError::Truncated { .. } | ArtifactError::BadMagic)
            ),
            "cut at {cut}: {r:?}"
        );
        note(&r);
    }
    // Random byte flips: caught by the checksum, or by the header checks.
    for _ in 0..300 {
        let mut b = good.clone();
        for _ in 0..1 + rng.below(4) {
            let i = rng.below(b.len() as u64) as usize;
            b[i] ^= 1 + rng.below(255) as u8;
        }
        let (r, used) = decode_measured(&b);
        assert!(used <= budget, "{used} bytes allocated");
        assert!(r.is_err());
        note(&r);
    }
    // Damaged bodies with a recomputed checksum: only the decoder stands
    // between them and the runtime. Includes huge length prefixes.
    for round in 0..600 {
        let mut body = good[HEADER_LEN..].to_vec();
        match round % 3 {
            0 => {
                let i = rng.below(body.len() as u64) as usize;
                body[i] ^= 1 + rng.below(255) as u8;
            }
            1 => {
                // A varint u64 marker (251 = 8-byte length follows) with a
                // huge value, somewhere in the body.
                let i = rng.below(body.len().saturating_sub(9) as u64) as usize;
                body[i] = 253;
                body[i + 1..i + 9]
                    .copy_from_slice(&(u64::MAX / (1 + rng.below(1000))).to_le_bytes());
            }
            _ => {
                let cut = rng.below(body.len() as u64) as usize;
                body.truncate(cut);
            }
        }
        let mut b = good[..HEADER_LEN].to_vec();
        b[12..20].copy_from_slice(&(body.len() as u64).to_le_bytes());
        b[20..24].copy_from_slice(&crc32fast::hash(&body).to_le_bytes());
        b.extend_from_slice(&body);
        let (r, used) = decode_measured(&b);
        assert!(used <= budget, "round {round}: {used} bytes allocated");
        note(&r);
    }
    // Random header length fields.
    let body_len = (good.len() - HEADER_LEN) as u64;
    for i in 0..100 {
        let mut b = good.clone();
        let len = match i % 3 {
            0 => rng.next_u64(),
            1 => rng.below(body_len),
            _ => body_len + 1 + rng.below(body_len),
        };
        b[12..20].copy_from_slice(&len.to_le_bytes());
        let (r, used) = decode_measured(&b);
        assert!(used <= budget);
        assert!(
            matches!(
                r,
                Err(ArtifactError::Truncated { .. } | ArtifactError::TrailingBytes { .. })
            ),
            "{r:?}"
        );
        note(&r);
    }
    // Pure noise of random lengths.
    for _ in 0..200 {
        let n = rng.below(4096) as usize;
        let mut b: Vec<u8> = (0..n).map(|_| rng.below(256) as u8).collect();
        if n >= 8 && rng.below(2) == 0 {
            b[..8].copy_from_slice(b"KILNPLAN");
        }
        let (r, used) = decode_measured(&b);
        assert!(used <= budget);
        assert!(r.is_err());
        note(&r);
    }
    // Every damage class was actually exercised.
    for c in ["truncated", "magic", "checksum", "body", "trailing"] {
        assert!(
            classes.get(c).copied().unwrap_or(0) > 0,
            "{c} never seen: {classes:?}"
        );
    }

    // And the real file round-trips through an atomic write.
    let dir = std::env::temp_dir().join(format!("kiln-artifact-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.kiln");
    write_plan_atomic(&path, &plan).unwrap();
    assert_eq!(decode(&std::fs::read(&path).unwrap()).unwrap(), plan);
    std::fs::remove_dir_all(&dir).unwrap();
}
