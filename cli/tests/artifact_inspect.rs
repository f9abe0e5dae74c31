//! `kiln compile` and `kiln inspect` end to end: the binary compiles tiny
//! models to plan files, and `inspect` prints them as stable text (pinned by
//! golden files), DOT and JSON.

use kiln_compiler::compile::{compile_dir, CompileOptions};
use kiln_compiler::inspect::{render, Format};
use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
use std::path::{Path, PathBuf};
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

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

fn family_name(f: Family) -> &'static str {
    match f {
        Family::Llama => "llama",
        Family::Mistral => "mistral",
        Family::Qwen2 => "qwen2",
        Family::Qwen3 => "qwen3",
        Family::Gemma3 => "gemma3",
    }
}

#[test]
fn inspect_text_of_tiny_models_matches_the_golden_files() {
    for family in Family::ALL {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model");
        write_tiny_model(&model, family, &TinySpec::for_family(family)).unwrap();
        let plan = dir.path().join("tiny.kiln");
        let (ok, out, err) = kiln(&[
            "compile",
            model.to_str().unwrap(),
            "--keys",
            "b2q1s0,b1q2s1",
            "--max-context",
            "64",
            "--kv-blocks",
            "8",
            "-q",
            "-o",
            plan.to_str().unwrap(),
        ]);
        assert!(ok, "{err}");
        assert!(out.contains("wrote"), "{out}");
        assert!(out.contains("b1q2s1") && out.contains("b2q1s0"), "{out}");
        let (ok, text, err) = kiln(&["inspect", plan.to_str().unwrap()]);
        assert!(ok, "{err}");
        kiln_ir::check_golden(
            &golden(&format!("inspect-{}.txt", family_name(family))),
            &text,
        );
        // Same plan, same text; one key selects its section only.
        assert_eq!(kiln(&["inspect", plan.to_str().unwrap()]).1, text);
        let (ok, one, _) = kiln(&["inspect", plan.to_str().unwrap(), "--key", "b1q2s1"]);
        assert!(ok);
        assert!(one.contains("key b1q2s1") && !one.contains("key b2q1s0"));
    }
}

#[test]
fn the_ir_in_inspect_text_parses_back_to_the_planned_graph() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(
        dir.path(),
        Family::Qwen3,
        &TinySpec::for_family(Family::Qwen3),
    )
    .unwrap();
    let mut o = CompileOptions {
        keys: vec!["b2q1s0".parse().unwrap()],
        ..Default::default()
    };
    o.kv.max_context = Some(64);
    let c = compile_dir(dir.path(), &o, &mut |_, _| {}).unwrap();
    let text = render(&c.plan, None, Format::Text).unwrap();
    let ir: String = text
        .lines()
        .skip_while(|l| *l != "  ir")
        .skip(1)
        .take_while(|l| *l != "  memory")
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
        .collect();
    let (g, _) = kiln_ir::parse_and_verify(&ir, Some(&c.plan.manifest))
        .unwrap_or_else(|e| panic!("{e}\n{ir}"));
    assert_eq!(g, c.plan.keys[0].graph);
}

#[test]
fn inspect_dot_and_json_are_deterministic_and_well_formed() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    write_tiny_model(&model, Family::Llama, &TinySpec::default()).unwrap();
    let plan = dir.path().join("p.kiln");
    let (ok, _, err) = kiln(&[
        "compile",
        model.to_str().unwrap(),
        // b16 (16 tokens) keeps its cuBLASLt GEMMs (and so the workspace);
        // b1 and b4 run fused GEMVs, which need none.
        "--batches",
        "1,4,16",
        "--max-context",
        "64",
        "--target",
        "cuda:sm_90",
        "-q",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let p = plan.to_str().unwrap();
    let (ok, dot, _) = kiln(&["inspect", p, "--format", "dot", "--key", "b4q1s0"]);
    assert!(ok);
    assert!(dot.starts_with("digraph") && dot.trim_end().ends_with('}'));
    assert_eq!(dot.matches("digraph").count(), 1);
    assert_eq!(
        kiln(&["inspect", p, "--format", "dot", "--key", "b4q1s0"]).1,
        dot
    );
    let (ok, json, _) = kiln(&["inspect", p, "--format", "json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["target"], "cuda:sm_90");
    assert_eq!(v["workspace_bytes"], 32 << 20);
    let keys = v["keys"].as_array().unwrap();
    assert_eq!(keys.len(), 3);
    assert_eq!(keys[1]["key"], "b4q1s0");
    assert!(keys[1]["efficiency"].as_f64().unwrap() > 0.9);
    assert_eq!(kiln(&["inspect", p, "--format", "json"]).1, json);
}

#[test]
fn cli_errors_name_the_problem_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    write_tiny_model(&model, Family::Llama, &TinySpec::default()).unwrap();
    let plan = dir.path().join("p.kiln");
    let p = plan.to_str().unwrap();
    let m = model.to_str().unwrap();
    assert!(
        kiln(&[
            "compile",
            m,
            "--keys",
            "b1q1s0",
            "--max-context",
            "64",
            "-q",
            "-o",
            p
        ])
        .0
    );
    let (ok, _, err) = kiln(&["inspect", p, "--key", "b9q1s0"]);
    assert!(!ok);
    assert!(
        err.contains("no key b9q1s0") && err.contains("b1q1s0"),
        "{err}"
    );
    // A damaged plan file.
    let mut bytes = std::fs::read(&plan).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x10;
    let bad = dir.path().join("bad.kiln");
    std::fs::write(&bad, &bytes).unwrap();
    let (ok, _, err) = kiln(&["inspect", bad.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        err.contains("checksum") && err.contains("recompile"),
        "{err}"
    );
    // Bad options.
    let (ok, _, err) = kiln(&["compile", m, "--keys", "b1q1s1", "-q", "-o", p]);
    assert!(!ok);
    assert!(
        err.contains("spec (1) must be smaller than query (1)"),
        "{err}"
    );
    let (ok, _, err) = kiln(&["compile", m, "--target", "tpu", "-q", "-o", p]);
    assert!(!ok);
    assert!(err.contains("unknown target"), "{err}");
    // A failed compile leaves the previous plan untouched.
    let before = std::fs::read(&plan).unwrap();
    let (ok, _, _) = kiln(&[
        "compile",
        dir.path().join("missing").to_str().unwrap(),
        "-q",
        "-o",
        p,
    ]);
    assert!(!ok);
    assert_eq!(std::fs::read(&plan).unwrap(), before);
    // Nothing but the plans and the model are left in the directory.
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["bad.kiln", "m", "p.kiln"]);
}

#[test]
fn inspect_into_a_reader_that_stops_early_exits_cleanly_without_a_panic() {
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    let family = Family::Llama;
    write_tiny_model(&model, family, &TinySpec::for_family(family)).unwrap();
    let plan = dir.path().join("tiny.kiln");
    let (ok, _, err) = kiln(&[
        "compile",
        model.to_str().unwrap(),
        "--keys",
        "b2q1s0,b1q2s1",
        "-q",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["inspect", plan.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Hang up before the report is written (as `| head` does once it has
    // its lines): loading the plan takes the child far longer than this.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "status {:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}
