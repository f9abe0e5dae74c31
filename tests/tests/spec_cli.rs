//! `kiln run --spec K` and `kiln bench-spec` through their library entry
//! points, on a compiled tiny model with a byte-level tokenizer: the text is
//! plain decoding's, drafts are accepted, the report says so, and a plan
//! without the verification keys is refused with the `kiln compile` fix.

use kiln_cli::bench_spec::{self, BenchSpecArgs};
use kiln_cli::run_cmd::{self, RunArgs};
use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::testing::write_byte_tokenizer;
use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
use kiln_ir::Key;
use std::path::{Path, PathBuf};

/// A tiny model with a byte tokenizer in `dir`, compiled for `keys`.
fn model_in(dir: &Path, keys: &str) -> PathBuf {
    write_tiny_model(dir, Family::Llama, &TinySpec::smollm2()).unwrap();
    write_byte_tokenizer(dir).unwrap();
    let opts = CompileOptions {
        keys: keys.split(',').map(|k| k.parse::<Key>().unwrap()).collect(),
        kv: KvOptions {
            block_size: 4,
            kv_blocks: Some(128),
            max_context: Some(500),
            ..KvOptions::default()
        },
        ..CompileOptions::default()
    };
    let plan = compile_dir(dir, &opts, &mut |_, _| {}).unwrap().plan;
    let path = dir.join("tiny.kiln");
    kiln_ir::artifact::write_plan_atomic(&path, &plan).unwrap();
    path
}

fn run_args(plan: &Path, dir: &Path, prompt: &str, spec: Option<u32>) -> RunArgs {
    RunArgs {
        plan: plan.to_path_buf(),
        weights: dir.to_path_buf(),
        prompt: Some(prompt.into()),
        prompt_file: None,
        max_tokens: 24,
        device: "cpu".into(),
        spec,
        tp: None,
    }
}

#[test]
fn kiln_run_with_spec_prints_plain_decodings_text_and_counts_accepted_drafts() {
    let dir = tempfile::tempdir().unwrap();
    let plan = model_in(dir.path(), "b1q1s0,b1q4s0,b1q4s3");
    let d = dir.path();
    for prompt in ["abcabcabcabc", "kiln!"] {
        let mut plain = Vec::new();
        let p = run_cmd::run(&run_args(&plan, d, prompt, None), &mut plain).unwrap();
        assert!(p.spec.is_none());
        let mut spec = Vec::new();
        let s = run_cmd::run(&run_args(&plan, d, prompt, Some(3)), &mut spec).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&spec),
            String::from_utf8_lossy(&plain)
        );
        assert_eq!(s.report.generated_tokens, p.report.generated_tokens);
        let st = s.spec.clone().unwrap();
        assert!(st.accepted > 0, "{prompt:?}: {st:?}");
        let line = run_cmd::stats_line(&s);
        assert!(line.contains("lookup drafts accepted"), "{line}");
    }
}

#[test]
fn kiln_run_with_spec_on_a_plan_without_its_keys_names_the_compile_fix() {
    let dir = tempfile::tempdir().unwrap();
    let plan = model_in(dir.path(), "b1q1s0,b1q3s2");
    let mut out = Vec::new();
    let err = run_cmd::run(&run_args(&plan, dir.path(), "hello", Some(4)), &mut out).unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with("--spec:"), "{msg}");
    assert!(
        msg.contains("kiln compile --keys") && msg.contains("b1q5s4"),
        "{msg}"
    );
    assert!(out.is_empty(), "nothing is printed before the check");
}

#[test]
fn bench_spec_reports_acceptance_and_identical_outputs_for_both_prompt_sets() {
    let dir = tempfile::tempdir().unwrap();
    let plan = model_in(dir.path(), "b1q1s0,b1q4s0,b1q3s2");
    let args = BenchSpecArgs {
        plan: plan.clone(),
        weights: dir.path().to_path_buf(),
        device: "cpu".into(),
        spec: 2,
        max_tokens: 16,
        json: None,
        md: None,
    };
    let r = bench_spec::run(&args, "kiln bench-spec (test)").unwrap();
    assert_eq!(r.prompt_kind, "text");
    let names: Vec<&str> = r.sets.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["repetitive", "non-repetitive"]);
    for s in &r.sets {
        assert_eq!(s.identical, s.prompts, "{s:?}");
        assert!(
            s.plain.decode_tokens > 0 && s.plain.tokens_per_s > 0.0,
            "{s:?}"
        );
        assert_eq!(
            s.plain.tokens_per_step, 1.0,
            "plain decoding is one token a step"
        );
        assert_eq!(s.spec.decode_tokens, s.plain.decode_tokens);
        assert!(s.acceptance_rate <= 1.0);
    }
    let rep = &r.sets[0];
    assert!(
        rep.accepted > 0 && rep.spec.tokens_per_step > 1.0,
        "{rep:?}"
    );
    let table = r.table();
    assert!(table.contains("| repetitive |") && table.contains("kiln bench-spec (test)"));
    assert_eq!(r.date.len(), 10);
    // A k the plan cannot verify is refused before anything runs.
    let bad = BenchSpecArgs { spec: 5, ..args };
    let msg = bench_spec::run(&bad, "x").unwrap_err().to_string();
    assert!(msg.contains("b1q6s5"), "{msg}");
}

/// Writes the tiny model used for `bench/results/spec-cpu-*` into
/// `$KILN_SPEC_TINY_DIR` (run with `--ignored`).
#[test]
#[ignore]
fn write_the_tiny_bench_model() {
    let Ok(dir) = std::env::var("KILN_SPEC_TINY_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    std::fs::create_dir_all(&dir).unwrap();
    model_in(&dir, "b1q1s0,b1q4s0,b1q16s0,b1q3s2,b1q4s3");
}
