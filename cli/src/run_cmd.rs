//! `kiln run`: load a plan and its weights, generate from a prompt, stream the
//! text to stdout and end with the run's statistics on stderr.
//!
//! Everything here is argument handling: loading, dispatch, graphs and text
//! streaming are `kiln-runtime`'s (the same calls the examples make). Not
//! here: chat templates, sampling, batching several prompts. A
//! tensor-parallel plan runs on as many ranks as it was compiled for.

use kiln_runtime::text::{generate_text_with, read_prompt_file, RunReport, TextTokenizer};
use kiln_runtime::{
    open_backend_ranks, DeviceSpec, Engine, EngineError, EngineOptions, SpecError, SpecOptions,
    SpecStats, Speculator,
};
use std::io::Write;
use std::path::PathBuf;

/// `kiln run` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct RunArgs {
    /// The plan file (`kiln compile ... -o model.kiln`).
    pub plan: PathBuf,
    /// Model directory holding the safetensors files the plan was compiled
    /// from and `tokenizer.json`.
    #[arg(long)]
    pub weights: PathBuf,
    /// The prompt.
    #[arg(
        long,
        required_unless_present = "prompt_file",
        conflicts_with = "prompt_file"
    )]
    pub prompt: Option<String>,
    /// Read the prompt from this UTF-8 file instead.
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Most tokens to generate (generation also stops at the model's EOS).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    /// Where to run: cpu, cuda[:N] (a build with --features cuda), hip[:N].
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Speculative decoding with K prompt-lookup drafts per step (token-
    /// identical output). The plan needs spec keys `b*q{K+1}s{K}`.
    #[arg(long, value_name = "K")]
    pub spec: Option<u32>,
    /// Tensor-parallel ranks: a check only, the plan says how many it
    /// needs (`kiln compile --tp N`); an error when it differs. The ranks
    /// are CPU ranks sharing the host's threads, or the GPUs from
    /// `--device`'s ordinal on.
    #[arg(long, value_name = "N")]
    pub tp: Option<u32>,
}

/// Refuses `--tp asked` when the plan was compiled for `plan_tp` ranks.
pub fn check_tp(asked: Option<u32>, plan_tp: u32) -> Result<(), EngineError> {
    match asked {
        Some(n) if n != plan_tp => Err(EngineError::BadPlan(format!(
            "--tp {n} given, but the plan is compiled for {plan_tp} tensor-parallel rank(s); drop --tp (the plan decides) or recompile with `kiln compile --tp {n}`"
        ))),
        _ => Ok(()),
    }
}

/// Why `kiln run` failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("--spec: {0}")]
    Spec(#[from] SpecError),
    #[error("writing the output: {0}")]
    Output(#[from] std::io::Error),
}

/// Runs `args`, streaming the prompt and the generated text to `out`.
pub fn run(args: &RunArgs, out: &mut dyn Write) -> Result<RunOutcome, RunError> {
    let prompt = match (&args.prompt, &args.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => read_prompt_file(f)?,
        (None, None) => unreachable!("clap requires --prompt or --prompt-file"),
    };
    kiln_runtime::text::check_prompt_size(&prompt)?;
    let device: DeviceSpec = args.device.parse()?;
    // The tokenizer and the prompt are checked before the (slower) load.
    let tokenizer = TextTokenizer::from_dir(&args.weights)?;
    if tokenizer.encode(&prompt)?.is_empty() {
        return Err(EngineError::EmptyPrompt.into());
    }
    // The plan's keys and ranks are checked before the weights are loaded.
    let mut spec = None;
    let plan = kiln_runtime::loader::read_plan_file(&args.plan)?;
    check_tp(args.tp, plan.tp)?;
    if let Some(k) = args.spec {
        kiln_runtime::spec::check_plan(&plan, k)?;
    }
    let backend = open_backend_ranks(device, plan.tp)?;
    let mut engine = Engine::new(plan, &args.weights, backend, EngineOptions::default())?;
    if let Some(k) = args.spec {
        spec = Some(Speculator::new(&engine, SpecOptions::new(k))?);
    }
    write!(out, "{prompt}")?;
    out.flush()?;
    let mut write_err = None;
    let report = generate_text_with(
        &mut engine,
        &tokenizer,
        &prompt,
        args.max_tokens,
        &mut |p| {
            if write_err.is_none() {
                if let Err(e) = write!(out, "{p}").and_then(|_| out.flush()) {
                    write_err = Some(e);
                }
            }
        },
        &mut |e| match spec.as_mut() {
            Some(s) => s.step(e),
            None => e.step(),
        },
    )?;
    if let Some(e) = write_err {
        return Err(e.into());
    }
    writeln!(out)?;
    Ok(RunOutcome {
        report,
        spec: spec.map(|s| s.stats().clone()),
    })
}

/// What `kiln run` measured: the generation, and with `--spec` the drafting.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    pub report: RunReport,
    pub spec: Option<SpecStats>,
}

/// The statistics line `kiln run` ends with.
pub fn stats_line(o: &RunOutcome) -> String {
    let r = &o.report;
    let spec = match &o.spec {
        Some(s) => format!(
            "; spec: {}/{} lookup drafts accepted ({:.0}%), {} of {} steps verified drafts",
            s.accepted,
            s.proposed,
            100.0 * s.acceptance_rate(),
            s.spec_steps,
            s.steps
        ),
        None => String::new(),
    };
    format!(
        "{} prompt tokens, {} generated ({}), prefill {:.1} ms, decode {:.1} tokens/s; graphs {}: {} captures, {} replays, {} eager steps",
        r.prompt_tokens,
        r.generated_tokens,
        match &r.finish {
            Some(f) => format!("{f:?}"),
            None => "unfinished".into(),
        },
        r.prefill_time.as_secs_f64() * 1e3,
        r.decode_tokens_per_s(),
        if r.graphs { "on" } else { "off" },
        r.captures,
        r.replays,
        r.eager_steps
    ) + &spec
}
