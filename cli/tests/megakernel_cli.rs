//! `kiln compile --schedule megakernel` end to end: the binary writes a plan
//! whose keys carry a verified tape, `kiln inspect` prints it, and a key the
//! megakernel cannot run is refused naming the op and the way out.

use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
use std::process::Command;

fn kiln(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn compile_schedule_megakernel_writes_a_tape_that_inspect_shows() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    write_tiny_model(&model, Family::Qwen3, &TinySpec::for_family(Family::Qwen3)).unwrap();
    let plan = dir.path().join("mk.kiln");
    let (ok, out, err) = kiln(&[
        "compile",
        model.to_str().unwrap(),
        "--keys",
        "b1q1s0,b2q1s0",
        "--max-context",
        "64",
        "--schedule",
        "megakernel",
        "--megakernel-sms",
        "4",
        "--megakernel-blocks-per-sm",
        "2",
        "-q",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("b1q1s0: megakernel tape, ") && out.contains(" tasks on 8 queues"),
        "{out}"
    );
    let (ok, text, err) = kiln(&["inspect", plan.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert_eq!(
        text.matches("schedule    megakernel: 4 SMs x 2 blocks per SM = 8 queues")
            .count(),
        2,
        "{text}"
    );
    let (ok, json, _) = kiln(&["inspect", plan.to_str().unwrap(), "--format", "json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    for k in v["keys"].as_array().unwrap() {
        let tape = &k["tape"];
        assert_eq!(tape["queues"].as_array().unwrap().len(), 8);
        let tasks = tape["tasks"].as_array().unwrap();
        let ops = k["ops"].as_array().unwrap().len();
        assert!(tasks.len() > ops, "{} tasks for {ops} ops", tasks.len());
    }
    // The loader validates (and so verifies) the tape it reads.
    let p = kiln_compiler::inspect::load(&plan).unwrap();
    kiln_runtime::loader::validate_plan(&p).unwrap();
    // Running it says that the op lists run, not the tapes.
    kiln_compiler::testing::write_byte_tokenizer(&model).unwrap();
    let (ok, _, err) = kiln(&[
        "run",
        plan.to_str().unwrap(),
        "--weights",
        model.to_str().unwrap(),
        "--prompt",
        "kiln",
        "--max-tokens",
        "4",
    ]);
    assert!(ok, "{err}");
    assert!(
        err.contains("keys b1q1s0,b2q1s0 carry a megakernel tape (verified); the cpu backend runs their op lists"),
        "{err}"
    );
}

#[test]
fn a_gpu_key_with_blas_gemms_is_refused_naming_the_op_and_suggesting_schedule_graph() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    write_tiny_model(&model, Family::Llama, &TinySpec::for_family(Family::Llama)).unwrap();
    let plan = dir.path().join("mk.kiln");
    let (ok, _, err) = kiln(&[
        "compile",
        model.to_str().unwrap(),
        "--target",
        "cuda:sm_90",
        "--keys",
        "b1q1s0,b16q1s0",
        "--max-context",
        "64",
        "--schedule",
        "megakernel",
        "-q",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert!(!ok);
    // Up to 8 tokens a megakernel plan's GEMMs run as GEMV tiles; 16 do not.
    assert!(err.contains("key b16q1s0"), "{err}");
    assert!(
        err.contains("`matmul`") && err.contains("`blas` GEMM"),
        "{err}"
    );
    assert!(err.contains("--schedule graph"), "{err}");
    assert!(!plan.exists());
}
