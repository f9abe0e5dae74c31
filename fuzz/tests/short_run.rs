//! The CI part of the fuzzing: every target runs a short campaign from the
//! committed corpus under all three oracles (this test installs the
//! counting allocator, so an allocation above 256 MiB aborts the test
//! binary, and the watchdog aborts it on an input running past 2 s), and
//! the committed corpus is checked to be what `kiln-fuzz seed` writes.
//!
//! Counts: 3,000 inputs per target (15,000 in all), a few seconds each in
//! the test profile. The million-input campaigns are in fuzz/RESULTS.md.

use kiln_fuzz::alloc::{self, CountingAlloc};
use kiln_fuzz::{runner, seed, Config, Outcome, Target};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Inputs per target in CI.
const CI_INPUTS: u64 = 3_000;

fn corpus(target: Target) -> Vec<Vec<u8>> {
    seed::load(&seed::default_dir(), target)
        .unwrap()
        .into_iter()
        .map(|(_, b)| b)
        .collect()
}

#[test]
fn every_target_runs_its_short_campaign_with_no_panic_no_finding_and_bounded_allocations() {
    assert!(
        alloc::installed(),
        "the counting allocator must be installed"
    );
    let mut lines = vec![kiln_fuzz::Report::HEADER.to_string()];
    for target in Target::ALL {
        let cfg = Config {
            target,
            seed: 1,
            start: 0,
            iters: CI_INPUTS,
            crashes: None,
            timeout_ms: runner::DEFAULT_TIMEOUT_MS * 5,
        };
        let r = runner::run(&cfg, &corpus(target));
        lines.push(r.line());
        assert_eq!(r.inputs, CI_INPUTS);
        assert!(
            r.clean(),
            "{}: panics {:?}, findings {:?}",
            target.name(),
            r.panics,
            r.findings
        );
        // The seeds are accepted and most mutations are refused: a target
        // that accepts nothing, or everything, is not exercising its parser.
        assert!(r.accepted >= 1, "{}: no input accepted", target.name());
        assert!(
            r.rejected >= CI_INPUTS / 4,
            "{}: only {} inputs rejected",
            target.name(),
            r.rejected
        );
        assert!(r.peak_alloc_bytes > 0 && r.peak_alloc_bytes <= alloc::DEFAULT_LIMIT as u64);
    }
    println!("{}", lines.join("\n"));
}

#[test]
fn every_committed_seed_is_accepted_by_its_target() {
    for target in Target::ALL {
        for (name, bytes) in seed::load(&seed::default_dir(), target).unwrap() {
            assert_eq!(
                target.run(&bytes),
                Outcome::Accepted,
                "{}/{name} is refused: the parser or the format changed; regenerate the corpus with `cargo run -p kiln-fuzz -- seed`",
                target.name()
            );
        }
    }
}

#[test]
fn the_committed_corpus_is_what_the_seed_command_writes() {
    let generated = seed::generate().unwrap();
    let again = seed::generate().unwrap();
    assert_eq!(generated, again, "seed generation is not deterministic");
    for target in Target::ALL {
        let committed = seed::load(&seed::default_dir(), target).unwrap();
        let names: Vec<&str> = committed.iter().map(|(n, _)| n.as_str()).collect();
        let want: Vec<&str> = generated[&target].iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            want,
            "fuzz/corpus/{} is stale: run `cargo run -p kiln-fuzz -- seed`",
            target.name()
        );
    }
}

#[test]
fn a_replayed_iteration_is_the_same_input() {
    let dir = tempfile::tempdir().unwrap();
    let c = corpus(Target::Config);
    let cfg = |start, iters| Config {
        target: Target::Config,
        seed: 42,
        start,
        iters,
        crashes: None,
        timeout_ms: runner::DEFAULT_TIMEOUT_MS,
    };
    let all = runner::dump(&cfg(0, 40), &c, &dir.path().join("all")).unwrap();
    let one = runner::dump(&cfg(37, 1), &c, &dir.path().join("one")).unwrap();
    assert_eq!(
        std::fs::read(&all[37]).unwrap(),
        std::fs::read(&one[0]).unwrap()
    );
}
