//! Loads a compiled plan and its weights, then generates text greedily,
//! using only `kiln-runtime`'s public API.
//!
//! ```text
//! cargo run --release -p kiln-examples --example generate -- \
//!     model.kiln <weights-dir> "The capital of France is" [max-tokens] [device]
//! ```
//!
//! `device` is `cpu` (default), or `cuda[:N]` in a build with `--features cuda`.

use anyhow::{bail, Context};
use kiln_runtime::text::{generate_text, TextTokenizer};
use kiln_runtime::{open_backend, DeviceSpec, Engine, EngineOptions};
use std::io::Write;
use std::path::Path;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 || args.len() > 5 {
        bail!("usage: generate <plan.kiln> <weights-dir> <prompt> [max-tokens] [device]");
    }
    let (plan, weights, prompt) = (Path::new(&args[0]), Path::new(&args[1]), &args[2]);
    let max_tokens: u32 = match args.get(3) {
        Some(n) => n.parse().context("max-tokens must be a number")?,
        None => 64,
    };
    let device: DeviceSpec = args.get(4).map_or("cpu", |s| s.as_str()).parse()?;

    let backend = open_backend(device)?;
    let mut engine = Engine::load(plan, weights, backend, EngineOptions::default())
        .with_context(|| format!("loading {}", plan.display()))?;
    let tokenizer = TextTokenizer::from_dir(weights)?;

    let mut stdout = std::io::stdout().lock();
    write!(stdout, "{prompt}")?;
    let report = generate_text(&mut engine, &tokenizer, prompt, max_tokens, &mut |piece| {
        let _ = write!(stdout, "{piece}");
        let _ = stdout.flush();
    })?;
    writeln!(stdout)?;
    eprintln!(
        "{} prompt + {} generated tokens, prefill {:.0} ms, decode {:.1} tokens/s, {} replays, {} eager steps",
        report.prompt_tokens,
        report.generated_tokens,
        report.prefill_time.as_secs_f64() * 1e3,
        report.decode_tokens_per_s(),
        report.replays,
        report.eager_steps
    );
    Ok(())
}
