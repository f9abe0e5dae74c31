//! The `kiln-fuzz` binary: `kiln-fuzz seed` regenerates the corpus,
//! `kiln-fuzz <target|all> --seed S --iters N [--start I]` runs campaigns.
//! See the library docs for the targets and the oracles.

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use kiln_fuzz::alloc::{self, CountingAlloc};
use kiln_fuzz::{runner, seed, Config, Report, Target};
use std::path::PathBuf;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const ORACLES: &str = "Oracles: a panic in any input fails the run (the input is saved under \
--crashes/<target>/); any single allocation above --alloc-limit-mib (default 256 MiB; inputs are \
at most 1 MiB) aborts the process naming target, seed and iteration; an input running longer \
than --timeout-ms (default 2000) aborts likewise. Replay one input with \
`kiln-fuzz <target> --seed S --start I --iters 1`, or write it out with --dump DIR.";

#[derive(Parser, Debug)]
#[command(
    name = "kiln-fuzz",
    about = "Fuzz kiln's parsers of untrusted input: gguf, safetensors, config, plan, ir, http",
    after_help = ORACLES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Campaign seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Inputs to run.
    #[arg(long, default_value_t = 10_000)]
    iters: u64,
    /// First iteration (replay a single input with --start I --iters 1).
    #[arg(long, default_value_t = 0)]
    start: u64,
    /// Seed corpus directory (holds one folder per target).
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// Where panicking inputs are saved.
    #[arg(long)]
    crashes: Option<PathBuf>,
    /// Bound on any single allocation while an input runs, in MiB.
    #[arg(long, default_value_t = (alloc::DEFAULT_LIMIT >> 20) as u64)]
    alloc_limit_mib: u64,
    /// Bound on one input's run time, in milliseconds.
    #[arg(long, default_value_t = runner::DEFAULT_TIMEOUT_MS)]
    timeout_ms: u64,
    /// Print the reports as JSON (one object per target) after the table.
    #[arg(long)]
    json: bool,
    /// Write the inputs to this directory instead of running them.
    #[arg(long)]
    dump: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Regenerate the seed corpora (deterministic).
    Seed {
        /// Output directory (default: this checkout's fuzz/corpus).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// GGUF reader, metadata, dequantization, tokenizer builder.
    Gguf(RunArgs),
    /// Safetensors header reader (and the safetensors crate's parser).
    Safetensors(RunArgs),
    /// config.json parsing and family resolution.
    Config(RunArgs),
    /// Plan file decoder and the runtime loader's checks.
    Plan(RunArgs),
    /// IR text parser, verifier, printer round trip.
    Ir(RunArgs),
    /// `kiln serve` request bodies through its parsing and validation.
    Http(RunArgs),
    /// Every target in turn with the same arguments.
    All(RunArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let (targets, args): (Vec<Target>, RunArgs) = match cli.command {
        Command::Seed { out } => {
            let dir = out.unwrap_or_else(seed::default_dir);
            let corpus = seed::generate()?;
            let n = seed::write(&dir, &corpus)?;
            println!("wrote {n} seed files under {}", dir.display());
            return Ok(());
        }
        Command::Gguf(a) => (vec![Target::Gguf], a),
        Command::Safetensors(a) => (vec![Target::Safetensors], a),
        Command::Config(a) => (vec![Target::Config], a),
        Command::Plan(a) => (vec![Target::Plan], a),
        Command::Ir(a) => (vec![Target::Ir], a),
        Command::Http(a) => (vec![Target::Http], a),
        Command::All(a) => (Target::ALL.to_vec(), a),
    };
    let limit = usize::try_from(args.alloc_limit_mib)
        .ok()
        .and_then(|m| m.checked_mul(1 << 20))
        .context("--alloc-limit-mib is too large for this machine")?;
    alloc::set_limit(limit);
    let corpus_dir = args.corpus.clone().unwrap_or_else(seed::default_dir);
    let crashes = args
        .crashes
        .clone()
        .unwrap_or_else(|| corpus_dir.parent().unwrap_or(&corpus_dir).join("crashes"));

    let mut reports: Vec<Report> = Vec::new();
    if args.dump.is_none() {
        println!("{}", Report::HEADER);
    }
    for target in targets {
        let corpus: Vec<Vec<u8>> = seed::load(&corpus_dir, target)?
            .into_iter()
            .map(|(_, b)| b)
            .collect();
        let cfg = Config {
            target,
            seed: args.seed,
            start: args.start,
            iters: args.iters,
            crashes: Some(crashes.clone()),
            timeout_ms: args.timeout_ms,
        };
        if let Some(dir) = &args.dump {
            let files = runner::dump(&cfg, &corpus, dir)
                .with_context(|| format!("cannot write inputs to {}", dir.display()))?;
            println!(
                "wrote {} {} inputs to {}",
                files.len(),
                target.name(),
                dir.display()
            );
            continue;
        }
        let r = runner::run(&cfg, &corpus);
        println!("{}", r.line());
        for f in r.panics.iter().chain(&r.findings) {
            eprintln!(
                "  FAIL {} iteration {}: {}{}",
                target.name(),
                f.iteration,
                f.message,
                f.saved
                    .as_ref()
                    .map(|p| format!(" (input saved to {})", p.display()))
                    .unwrap_or_default()
            );
        }
        reports.push(r);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    }
    let failed: Vec<&str> = reports
        .iter()
        .filter(|r| !r.clean())
        .map(|r| r.target.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("panics or findings in: {}", failed.join(", "));
    }
    Ok(())
}
