//! `kiln demo` end to end without network: a tiny random llama GGUF (real
//! byte-level BPE vocabulary, ChatML control tokens, a chat template) goes
//! through import, compile, load and a chat completion in a temporary cache;
//! the second run reuses every stage, a changed GGUF redoes them, and a
//! stale plan is never used.

use kiln_cli::demo::{
    self, demo_keys, plan_freshness, DemoOptions, Freshness, ModelSource, StageOutcome,
};
use kiln_compiler::compile::{compile_dir, CompileOptions};
use kiln_compiler::gguf::fixture::TinyLlama;
use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
use kiln_ir::plan::Target;
use kiln_ir::Key;
use kiln_runtime::chat::{ChatMessage, ChatTemplate};
use kiln_runtime::text::TextTokenizer;
use kiln_runtime::{CpuBackend, DeviceSpec, Engine, EngineOptions, GraphMode};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};

fn quiet() -> EngineOptions {
    EngineOptions {
        graphs: GraphMode::Auto,
        log: false,
        ..EngineOptions::default()
    }
}

fn write_gguf(path: &Path, seed: u64) {
    TinyLlama {
        seed,
        ..TinyLlama::default()
    }
    .build()
    .unwrap()
    .writer
    .write(path)
    .unwrap();
}

fn options(cache: &Path, gguf: &Path, prompt: &str) -> DemoOptions {
    DemoOptions {
        cache_dir: cache.to_path_buf(),
        source: ModelSource::Gguf(gguf.to_path_buf()),
        prompt: prompt.to_string(),
        system: None,
        device: DeviceSpec::Cpu,
        max_tokens: 10,
        engine: quiet(),
    }
}

fn run(opts: &DemoOptions) -> (demo::DemoReport, String, Vec<String>) {
    let mut out = Vec::new();
    let mut log = Vec::new();
    let report = demo::run(opts, &mut out, &mut |l| log.push(l.to_string())).unwrap();
    (report, String::from_utf8(out).unwrap(), log)
}

/// What the engine generates for the rendered prompt, outside the demo.
fn oracle(model_dir: &Path, plan: &Path, prompt: &str, n: u32) -> String {
    let tok = TextTokenizer::from_dir(model_dir).unwrap();
    let rendered = ChatTemplate::from_model_dir(model_dir)
        .unwrap()
        .render(&[ChatMessage::user(prompt)], true)
        .unwrap();
    let mut e = Engine::load(plan, model_dir, Box::new(CpuBackend::new()), quiet()).unwrap();
    let out = e.generate(&tok.encode(&rendered).unwrap(), n).unwrap();
    tok.decode(&out).unwrap()
}

/// The streamed completion is the oracle's text, except that the runtime's
/// streamer (kiln_runtime::text::TextStream) holds back a trailing
/// incomplete UTF-8 sequence, which random byte tokens can leave at the end:
/// the oracle decodes it as replacement characters.
fn assert_streamed(streamed: &str, oracle: &str) {
    let rest = oracle.strip_prefix(streamed).unwrap_or_else(|| {
        panic!("streamed {streamed:?} is not a prefix of the oracle {oracle:?}")
    });
    assert!(
        rest.chars().all(|c| c == '\u{fffd}'),
        "{streamed:?} vs {oracle:?}"
    );
}

#[test]
fn demo_on_a_tiny_gguf_imports_compiles_and_streams_a_chat_completion_with_stats() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("tiny-chat.gguf");
    write_gguf(&gguf, 0x5eed_0001);
    let cache = tmp.path().join("cache");
    let opts = options(&cache, &gguf, "Why is the sky blue?");

    let (r, out, log) = run(&opts);
    assert_eq!(
        (&r.fetch, &r.import, &r.compile),
        (
            &StageOutcome::Local,
            &StageOutcome::Done,
            &StageOutcome::Done
        )
    );
    assert!(r.model_dir.starts_with(&cache) && r.plan_path.starts_with(&cache));
    assert_eq!(r.plan_path.file_name().unwrap(), "cpu.kiln");
    assert!(r.run.generated_tokens > 0 && r.run.prompt_tokens > 0);
    assert!(r
        .rendered_prompt
        .contains("<|im_start|>user\nWhy is the sky blue?<|im_end|>\n"));
    assert_eq!(out, format!("{}\n", r.completion));
    assert_streamed(
        &r.completion,
        &oracle(&r.model_dir, &r.plan_path, &opts.prompt, opts.max_tokens),
    );
    assert!(r.run.replays > 0 && r.run.eager_steps == 0, "{:?}", r.run);
    for stage in ["fetch:", "import:", "load:", "compile:", "run:"] {
        assert!(log.iter().any(|l| l.starts_with(stage)), "{stage} {log:?}");
    }
    let stats = demo::stats_table(&r);
    for word in [
        "fetch",
        "import",
        "compile",
        "load",
        "prefill",
        "decode",
        "tokens/s",
        "replays",
        "eager steps",
    ] {
        assert!(stats.contains(word), "{word} missing from\n{stats}");
    }

    // Everything is cached the second time, and the answer is the same.
    let (r2, out2, _) = run(&opts);
    assert_eq!(
        (&r2.import, &r2.compile),
        (&StageOutcome::Cached, &StageOutcome::Cached)
    );
    assert_eq!(out2, out);

    // A different GGUF under the same name: re-imported, and the plan from
    // the old import is not reused.
    write_gguf(&gguf, 0x5eed_0002);
    let (r3, _, log3) = run(&opts);
    assert!(
        matches!(&r3.import, StageOutcome::Redone(why) if why.contains("different GGUF")),
        "{:?}",
        r3.import
    );
    assert!(
        matches!(&r3.compile, StageOutcome::Redone(why) if why.contains("older than the imported model")),
        "{:?}",
        r3.compile
    );
    assert!(log3.iter().any(|l| l.starts_with("compile: not reusing")));
    assert_streamed(
        &r3.completion,
        &oracle(&r3.model_dir, &r3.plan_path, &opts.prompt, opts.max_tokens),
    );
    assert_ne!(r3.completion, r.completion, "new weights, same text?");
}

#[test]
fn an_interrupted_import_without_its_marker_is_imported_again() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("m.gguf");
    write_gguf(&gguf, 0x5eed_0003);
    let cache = tmp.path().join("cache");
    let opts = options(&cache, &gguf, "hello");
    let (r, _, _) = run(&opts);
    std::fs::remove_file(r.model_dir.join(demo::IMPORT_MARKER)).unwrap();
    let (r2, _, _) = run(&opts);
    assert!(
        matches!(&r2.import, StageOutcome::Redone(why) if why.contains(demo::IMPORT_MARKER)),
        "{:?}",
        r2.import
    );
    assert!(matches!(r2.compile, StageOutcome::Redone(_)));
    assert_eq!(r2.completion, r.completion);
}

/// A tiny model directory, its import marker and a fresh demo plan.
fn plan_setup() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), Family::Llama, &TinySpec::smollm2()).unwrap();
    let marker = dir.path().join(demo::IMPORT_MARKER);
    std::fs::write(&marker, "{}").unwrap();
    let opts = CompileOptions {
        keys: demo_keys(),
        ..CompileOptions::default()
    };
    let plan = compile_dir(dir.path(), &opts, &mut |_, _| {}).unwrap().plan;
    let path = dir.path().join("cpu.kiln");
    kiln_ir::artifact::write_plan_atomic(&path, &plan).unwrap();
    (dir, path, marker)
}

fn stale(f: Freshness) -> String {
    match f {
        Freshness::Stale(why) => why,
        Freshness::Fresh(_) => panic!("a stale plan was judged fresh"),
        Freshness::Missing => panic!("an existing plan was judged missing"),
    }
}

#[test]
fn stale_plans_are_detected_with_the_reason() {
    let (_dir, plan, marker) = plan_setup();
    let keys = demo_keys();
    assert!(matches!(
        plan_freshness(&plan, &marker, &Target::Cpu, &keys),
        Freshness::Fresh(_)
    ));
    // Keys are compared as a set.
    let mut reversed = keys.clone();
    reversed.reverse();
    assert!(matches!(
        plan_freshness(&plan, &marker, &Target::Cpu, &reversed),
        Freshness::Fresh(_)
    ));

    let why = stale(plan_freshness(
        &plan,
        &marker,
        &Target::Cuda { sm: 90 },
        &keys,
    ));
    assert!(
        why.contains("targets cpu") && why.contains("cuda:sm_90"),
        "{why}"
    );

    let why = stale(plan_freshness(
        &plan,
        &marker,
        &Target::Cpu,
        &[Key::new(1, 1, 0)],
    ));
    assert!(why.contains("b1q16s0"), "{why}");

    // The import is newer than the plan.
    let f = std::fs::File::options().write(true).open(&plan).unwrap();
    f.set_modified(SystemTime::now() - Duration::from_secs(3600))
        .unwrap();
    drop(f);
    let why = stale(plan_freshness(&plan, &marker, &Target::Cpu, &keys));
    assert!(why.contains("older than the imported model"), "{why}");

    // Another compiler version.
    let mut p = kiln_ir::artifact::read_plan(&plan).unwrap().unwrap();
    p.meta.compiler_version = "0.0.1-old".into();
    kiln_ir::artifact::write_plan_atomic(&plan, &p).unwrap();
    let why = stale(plan_freshness(&plan, &marker, &Target::Cpu, &keys));
    assert!(why.contains("kiln 0.0.1-old"), "{why}");

    // Damaged bytes.
    let mut bytes = std::fs::read(&plan).unwrap();
    let mid = bytes.len() / 2;
    bytes.truncate(mid);
    std::fs::write(&plan, &bytes).unwrap();
    let why = stale(plan_freshness(&plan, &marker, &Target::Cpu, &keys));
    assert!(why.contains("cannot be decoded"), "{why}");

    std::fs::remove_file(&plan).unwrap();
    assert!(matches!(
        plan_freshness(&plan, &marker, &Target::Cpu, &keys),
        Freshness::Missing
    ));
}

fn kiln(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_GRAPHS", "0")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

#[test]
fn kiln_demo_prints_the_completion_on_stdout_and_stages_and_stats_on_stderr() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("tiny.gguf");
    write_gguf(&gguf, 0x5eed_0004);
    let cache = tmp.path().join("cache");
    let args = [
        "demo",
        "--gguf",
        gguf.to_str().unwrap(),
        "--cache-dir",
        cache.to_str().unwrap(),
        "--prompt",
        "Name a colour.",
        "--max-tokens",
        "7",
    ];
    let out = kiln(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let model_dir = demo::source_dir(&cache, &ModelSource::Gguf(gguf.clone())).join("model");
    let plan = model_dir.parent().unwrap().join("plans").join("cpu.kiln");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let streamed = stdout.strip_suffix('\n').expect("a final newline");
    assert!(!streamed.is_empty());
    assert_streamed(streamed, &oracle(&model_dir, &plan, "Name a colour.", 7));
    for needle in [
        "kiln demo: import: converting",
        "kiln demo: compile: planning keys b1q1s0,b1q16s0 for cpu",
        "prefill",
        "tokens/s",
        "graphs off: 0 captures",
        "0 replays",
    ] {
        assert!(err.contains(needle), "{needle} missing from\n{err}");
    }
}

#[test]
fn kiln_demo_refuses_bad_input_with_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let c = cache.to_str().unwrap();
    let cases: [(&[&str], &str); 4] = [
        (
            &["demo", "--gguf", "/nonexistent/x.gguf", "--cache-dir", c],
            "is not a file",
        ),
        (
            &[
                "demo",
                "--gguf",
                "/nonexistent/x.gguf",
                "--prompt",
                " ",
                "--cache-dir",
                c,
            ],
            "the prompt is empty",
        ),
        (
            &["demo", "--device", "tpu", "--cache-dir", c],
            "unknown device `tpu`",
        ),
        (
            &["demo", "--max-tokens", "0", "--cache-dir", c],
            "--max-tokens must be at least 1",
        ),
    ];
    for (args, needle) in cases {
        let out = kiln(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    // A file that is not a GGUF: the importer's error, nothing cached.
    let bogus = tmp.path().join("bogus.gguf");
    std::fs::write(&bogus, b"not a gguf file at all, just text").unwrap();
    let out = kiln(&["demo", "--gguf", bogus.to_str().unwrap(), "--cache-dir", c]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("importing the model"),
        "{err}"
    );
    assert!(!cache.join("gguf").join("bogus").join("model").exists());
}

#[test]
fn demo_runs_gemma3_270m_from_a_cached_gguf_and_answers_paris() {
    let Some(gguf) = kiln_compiler::testing::gemma3_gguf_for_tests() else {
        return;
    };
    // A cache whose gemma3/ entry already holds the GGUF: no network.
    let cache = tempfile::tempdir().unwrap();
    let dir = cache.path().join("gemma3");
    std::fs::create_dir_all(&dir).unwrap();
    let cached = dir.join(kiln_compiler::fetch::GEMMA3_FILE);
    if std::fs::hard_link(&gguf, &cached).is_err() {
        std::fs::copy(&gguf, &cached).unwrap();
    }
    let opts = DemoOptions {
        source: ModelSource::Gemma3,
        prompt: "What is the capital of France?".into(),
        max_tokens: 12,
        ..options(cache.path(), &gguf, "")
    };
    let (report, streamed, log) = run(&opts);
    assert_eq!(report.fetch, StageOutcome::Cached, "{log:?}");
    assert_eq!(
        report.rendered_prompt,
        "Q: What is the capital of France?\nA:"
    );
    assert!(
        report.model_dir.join("chat_template.jinja").is_file(),
        "{log:?}"
    );
    eprintln!("gemma3 demo: {streamed:?}");
    assert!(streamed.contains("Paris"), "{streamed:?}");
}
