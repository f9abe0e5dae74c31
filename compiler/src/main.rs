//! The `kiln` command line: a thin dispatcher over the library's
//! subcommand modules.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "Ahead-of-time compiler for LLM decode steps"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Compile a Hugging Face model directory into a plan (`*.kiln`).
    Compile(kiln_compiler::compile::CompileArgs),
    /// Print a plan as text, DOT or a JSON summary.
    Inspect(kiln_compiler::inspect::InspectArgs),
    /// Time compiling a Qwen3-0.6B-shaped model for 16 keys.
    BenchCompile(kiln_compiler::compile_bench::BenchCompileArgs),
}

fn main() -> anyhow::Result<()> {
    let out = match Cli::parse().command {
        Command::Compile(a) => kiln_compiler::compile::run(&a)?,
        Command::Inspect(a) => kiln_compiler::inspect::run(&a)?,
        Command::BenchCompile(a) => kiln_compiler::compile_bench::run(&a)?,
    };
    print!("{out}");
    Ok(())
}
