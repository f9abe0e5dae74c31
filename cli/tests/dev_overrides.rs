//! Development overrides read from the environment at compile time are
//! checked before any work: a value that names nothing is refused with the
//! values that would be accepted, and no plan is written.

use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};

#[test]
fn a_geometry_override_naming_no_geometry_refuses_a_cuda_compile_and_writes_no_plan() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    write_tiny_model(&model, Family::Llama, &TinySpec::for_family(Family::Llama)).unwrap();
    let plan = dir.path().join("tiny.kiln");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["compile".as_ref(), model.as_os_str()])
        .args(["--target", "cuda:sm_90", "--keys", "b1q1s0", "-q", "-o"])
        .arg(&plan)
        .env("KILN_QDOT_GEOM", "r4u1k9")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "compile succeeded: {err}");
    assert!(err.contains("KILN_QDOT_GEOM=r4u1k9 names no"), "{err}");
    assert!(err.contains("plain, auto or one of"), "{err}");
    assert!(!plan.exists(), "a plan was written");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "only the model directory is left"
    );
}
