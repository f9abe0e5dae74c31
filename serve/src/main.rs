//! `kiln-serve <plan.kiln> --weights <dir>`: the command line of
//! [`kiln_serve::serve`] (the same as `kiln serve`).

use clap::Parser;

/// Serve a compiled plan over the OpenAI HTTP API.
#[derive(Parser, Debug)]
#[command(name = "kiln-serve", version)]
struct Args {
    #[command(flatten)]
    serve: kiln_serve::cli::ServeArgs,
}

fn main() -> anyhow::Result<()> {
    kiln_serve::cli::run(Args::parse().serve)
}
