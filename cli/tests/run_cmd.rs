//! `kiln run` as a user runs it: the binary, a compiled tiny model with a
//! byte-level tokenizer, text on stdout and statistics on stderr, and a clear
//! error (no panic) for each kind of bad input.

use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::testing::write_byte_tokenizer;
use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
use kiln_ir::Key;
use kiln_runtime::text::TextTokenizer;
use kiln_runtime::{CpuBackend, Engine, EngineOptions, GraphMode};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A tiny model (vocab 256, bytes as tokens), its plan and its tokenizer.
fn model() -> (tempfile::TempDir, PathBuf) {
    model_tp(1)
}

/// [`model`] compiled for `tp` tensor-parallel ranks (the SmolLM2 shape:
/// 9 heads over 3 KV heads, so `tp` is 1 or 3).
fn model_tp(tp: u32) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), Family::Llama, &TinySpec::smollm2()).unwrap();
    write_byte_tokenizer(dir.path()).unwrap();
    let opts = CompileOptions {
        keys: vec![Key::new(1, 1, 0), Key::new(1, 4, 0)],
        kv: KvOptions {
            block_size: 4,
            kv_blocks: Some(32),
            max_context: Some(64),
            ..KvOptions::default()
        },
        tp,
        ..CompileOptions::default()
    };
    let plan = compile_dir(dir.path(), &opts, &mut |_, _| {}).unwrap().plan;
    let path = dir.path().join("tiny.kiln");
    kiln_ir::artifact::write_plan_atomic(&path, &plan).unwrap();
    (dir, path)
}

fn kiln(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
    cmd.args(args)
        .env_remove("KILN_GRAPHS")
        .env("RUST_BACKTRACE", "0");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// What the library generates for `prompt` (the oracle for the CLI).
fn expected(dir: &Path, plan: &Path, prompt: &str, n: u32) -> String {
    let tok = TextTokenizer::from_dir(dir).unwrap();
    let opts = EngineOptions {
        graphs: GraphMode::Off,
        log: false,
        ..EngineOptions::default()
    };
    let mut e = Engine::load(plan, dir, Box::new(CpuBackend::new()), opts).unwrap();
    let ids = tok.encode(prompt).unwrap();
    let out = e.generate(&ids, n).unwrap();
    format!("{prompt}{}\n", tok.decode(&out).unwrap())
}

#[test]
fn kiln_run_streams_the_generated_text_and_ends_with_statistics() {
    let (dir, plan) = model();
    let d = dir.path().to_str().unwrap();
    let p = plan.to_str().unwrap();
    let out = kiln(
        &[
            "run",
            p,
            "--weights",
            d,
            "--prompt",
            "kiln!",
            "--max-tokens",
            "12",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), expected(dir.path(), &plan, "kiln!", 12));
    let err = text(&out.stderr);
    assert!(
        err.contains("5 prompt tokens") && err.contains("tokens/s") && err.contains("graphs on"),
        "{err}"
    );
    assert!(
        err.contains("0 eager steps") && !err.contains(" 0 replays"),
        "{err}"
    );

    // The same through a prompt file, eagerly.
    let f = dir.path().join("prompt.txt");
    std::fs::write(&f, "kiln!").unwrap();
    let out = kiln(
        &[
            "run",
            p,
            "--weights",
            d,
            "--prompt-file",
            f.to_str().unwrap(),
            "--max-tokens",
            "12",
        ],
        &[("KILN_GRAPHS", "0")],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), expected(dir.path(), &plan, "kiln!", 12));
    let err = text(&out.stderr);
    assert!(
        err.contains("graphs off") && err.contains(" 0 replays"),
        "{err}"
    );
}

#[test]
fn kiln_run_refuses_bad_input_with_a_clear_error() {
    let (dir, plan) = model();
    let d = dir.path().to_str().unwrap();
    let p = plan.to_str().unwrap();
    let bad_utf8 = dir.path().join("latin1.txt");
    std::fs::write(&bad_utf8, b"caf\xe9").unwrap();
    let long = "x".repeat(64);
    let huge = dir.path().join("huge.txt");
    std::fs::write(&huge, vec![b'a'; (8 << 20) + 1]).unwrap();
    let fifo = dir.path().join("prompt.fifo");
    let made_fifo = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success());
    let other = tempfile::tempdir().unwrap();
    write_tiny_model(other.path(), Family::Llama, &TinySpec::default()).unwrap();
    write_byte_tokenizer(other.path()).unwrap();
    let mut cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "run",
                p,
                "--weights",
                d,
                "--prompt-file",
                huge.to_str().unwrap(),
            ],
            "is 8388609 bytes; a prompt may be at most 8388608 bytes",
        ),
        (
            vec!["run", p, "--weights", d, "--prompt-file", d],
            "it is a directory, not a regular file",
        ),
        (
            vec![
                "run",
                p,
                "--weights",
                d,
                "--prompt-file",
                bad_utf8.to_str().unwrap(),
            ],
            "is not valid UTF-8 (first bad byte at offset 3)",
        ),
        (
            vec!["run", p, "--weights", d, "--prompt", ""],
            "the prompt is empty",
        ),
        (
            vec!["run", p, "--weights", d, "--prompt", &long],
            "the prompt has 64 tokens but the plan's context holds 64",
        ),
        (
            vec![
                "run",
                p,
                "--weights",
                other.path().to_str().unwrap(),
                "--prompt",
                "hi",
            ],
            "plan/weights mismatch",
        ),
        (
            vec![
                "run",
                p,
                "--weights",
                d,
                "--prompt",
                "hi",
                "--device",
                "tpu",
            ],
            "unknown device `tpu`",
        ),
        (
            vec!["run", d, "--weights", d, "--prompt", "hi"],
            "cannot read",
        ),
    ];
    if made_fifo {
        // Nothing ever writes to it: opening it would block forever.
        cases.push((
            vec![
                "run",
                p,
                "--weights",
                d,
                "--prompt-file",
                fifo.to_str().unwrap(),
            ],
            "it is a FIFO, not a regular file",
        ));
    }
    for (args, want) in cases {
        let out = kiln(&args, &[]);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn kiln_run_runs_a_tp3_plan_on_cpu_ranks_with_the_tp1_text_and_checks_tp() {
    let (dir, plan) = model_tp(3);
    let d = dir.path().to_str().unwrap();
    let p = plan.to_str().unwrap();
    // The oracle: the same model compiled unsharded, run by the library.
    let tp1 = dir.path().join("tp1.kiln");
    let opts = CompileOptions {
        keys: vec![Key::new(1, 1, 0), Key::new(1, 4, 0)],
        kv: KvOptions {
            block_size: 4,
            kv_blocks: Some(32),
            max_context: Some(64),
            ..KvOptions::default()
        },
        ..CompileOptions::default()
    };
    let one = compile_dir(dir.path(), &opts, &mut |_, _| {}).unwrap().plan;
    kiln_ir::artifact::write_plan_atomic(&tp1, &one).unwrap();
    let want = expected(dir.path(), &tp1, "kiln!", 12);
    // No flag needed: the plan says tp=3; `--tp 3` agrees with it.
    for extra in [&[][..], &["--tp", "3"][..]] {
        let mut args = vec![
            "run",
            p,
            "--weights",
            d,
            "--prompt",
            "kiln!",
            "--max-tokens",
            "12",
        ];
        args.extend_from_slice(extra);
        let out = kiln(&args, &[("KILN_TP_THREADS", "1")]);
        assert!(out.status.success(), "{extra:?}: {}", text(&out.stderr));
        assert_eq!(text(&out.stdout), want, "{extra:?}");
        let err = text(&out.stderr);
        assert!(
            err.contains("graphs on") && !err.contains(" 0 replays"),
            "{err}"
        );
    }
    // A --tp that differs from the plan's is refused with the fix.
    for (args, want) in [
        (
            vec!["run", p, "--weights", d, "--prompt", "hi", "--tp", "2"],
            "--tp 2 given, but the plan is compiled for 3 tensor-parallel rank(s)",
        ),
        (
            vec![
                "run",
                tp1.to_str().unwrap(),
                "--weights",
                d,
                "--prompt",
                "hi",
                "--tp",
                "3",
            ],
            "recompile with `kiln compile --tp 3`",
        ),
        (
            vec!["run", p, "--weights", d, "--prompt", "hi"],
            "KILN_TP_TIMEOUT_S",
        ),
    ] {
        let env: &[(&str, &str)] = if want == "KILN_TP_TIMEOUT_S" {
            &[("KILN_TP_TIMEOUT_S", "soon")]
        } else {
            &[]
        };
        let out = kiln(&args, env);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn kiln_bench_on_a_tp3_plan_reports_the_collective_time_per_step() {
    let (dir, plan) = model_tp(3);
    let json = dir.path().join("bench.json");
    let out = kiln(
        &[
            "bench",
            plan.to_str().unwrap(),
            "--device",
            "cpu",
            "--steps",
            "4",
            "--context",
            "16",
            "--tp",
            "3",
            "--json",
            json.to_str().unwrap(),
        ],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert!(
        table.contains("tp 3") && table.contains("allred ms"),
        "{table}"
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["tp"], 3);
    for k in v["keys"].as_array().unwrap() {
        let coll = k["collective_ms"]
            .as_f64()
            .expect("collective time on a tp plan");
        // Not nothing: 2 collectives per layer plus the argmax, each a
        // barrier round across threads. And part of the step: the share is
        // the busiest rank's time inside collectives over the wall time of
        // the same steps (a mean against a mean; the median `replay_ms` is
        // no bound on a busy machine), so above 1 means the accounting
        // counts time outside the timed steps.
        let share = k["collective_share"].as_f64().expect("a share with it");
        assert!(coll > 0.0 && share > 0.0 && share <= 1.001, "{k}");
    }
    // `--tp` must agree with the plan.
    let out = kiln(
        &[
            "bench",
            plan.to_str().unwrap(),
            "--device",
            "cpu",
            "--tp",
            "1",
        ],
        &[],
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--tp 1 given"),
        "{}",
        text(&out.stderr)
    );
}
