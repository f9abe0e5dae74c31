//! The command line of [`crate::serve`], shared by the `kiln-serve` binary
//! and `kiln serve`, so both accept the same options.

use crate::scheduler::SchedulerConfig;
use crate::{ServeConfig, DEFAULT_MAX_BODY_BYTES};
use kiln_runtime::DeviceSpec;
use std::path::PathBuf;

/// Serve a compiled plan over the OpenAI HTTP API.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// The plan (`kiln compile ... -o model.kiln`).
    pub plan: PathBuf,
    /// The model directory the plan was compiled from (weights,
    /// tokenizer.json, chat template).
    #[arg(long)]
    pub weights: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// 0 picks a free port (printed on stdout).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// cpu, cuda, cuda:N, hip, hip:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// The name /v1/models reports (default: the weights directory's name).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Largest request body accepted, in bytes.
    #[arg(long, default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Prefill chunk steps in a row that may leave decoding sequences
    /// without a token before a token-by-token step runs.
    #[arg(long, default_value_t = 1)]
    pub max_decode_delay_steps: u32,
}

/// Runs the server for `args` until Ctrl-C or SIGTERM (logs to stderr).
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let device: DeviceSpec = args.device.parse()?;
    let config = ServeConfig {
        host: args.host,
        port: args.port,
        device,
        model_name: args.model_name,
        max_body_bytes: args.max_body_bytes,
        scheduler: SchedulerConfig {
            max_decode_delay_steps: args.max_decode_delay_steps,
        },
        ..ServeConfig::new(args.plan, args.weights)
    };
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(crate::serve(config))
}
