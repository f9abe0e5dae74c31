//! Inputs the fuzzer found that once broke a parser, kept under
//! `fuzz/regressions/<target>/` after the fix: each must now be refused
//! with an error (or accepted), never panic.
//!
//! - plan/weight-shape-overflows-u64.kiln (seed 2, iteration 108781 of the
//!   overflow-checked campaign): a weight whose shape's element count
//!   overflows u64 made the runtime loader's `validate_plan` panic in
//!   `Shape::numel` (in release builds the product wrapped silently, so the
//!   region size the checks compared against was wrong).

use kiln_fuzz::{Outcome, Target};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

#[test]
fn every_saved_regression_input_is_handled_without_a_panic() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions");
    let mut seen = 0;
    for target in Target::ALL {
        let Ok(dir) = std::fs::read_dir(root.join(target.name())) else {
            continue;
        };
        for entry in dir {
            let path = entry.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            let out = catch_unwind(AssertUnwindSafe(|| target.run(&bytes)));
            assert!(
                matches!(out, Ok(Outcome::Rejected | Outcome::Accepted)),
                "{} panicked or broke an oracle",
                path.display()
            );
            seen += 1;
        }
    }
    assert!(seen >= 1, "no regression inputs under {}", root.display());
}

#[test]
fn a_plan_whose_weight_bytes_overflow_is_refused_naming_the_weight() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("regressions/plan/weight-shape-overflows-u64.kiln");
    let plan = kiln_ir::artifact::decode(&std::fs::read(path).unwrap()).unwrap();
    let e = kiln_runtime::loader::validate_plan(&plan)
        .unwrap_err()
        .to_string();
    assert!(e.contains("byte count overflows"), "{e}");
}

/// Rewrites `regressions/plan/weight-shape-overflows-u64.kiln` for the
/// current plan format (run after a format change:
/// `cargo test -p kiln-fuzz --test regressions -- --ignored`): the first
/// committed plan seed with its first weight's shape made to overflow u64.
#[test]
#[ignore]
fn regenerate_the_plan_regression_input() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut seeds: Vec<_> = std::fs::read_dir(root.join("corpus/plan"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    seeds.sort();
    let mut plan = kiln_ir::artifact::decode(&std::fs::read(&seeds[0]).unwrap()).unwrap();
    plan.manifest.entries[0].shape = kiln_ir::Shape::new(vec![u32::MAX; 4]);
    let out = root.join("regressions/plan/weight-shape-overflows-u64.kiln");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    std::fs::write(out, kiln_ir::artifact::encode(&plan)).unwrap();
}
