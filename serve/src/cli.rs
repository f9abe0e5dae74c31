//! The command line of [`crate::serve`], shared by the `kiln-serve` binary
//! and `kiln serve`, so both accept the same options.

use crate::conn::{
    ConnLimits, DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS,
};
use crate::scheduler::SchedulerConfig;
use crate::{ServeConfig, DEFAULT_MAX_BODY_BYTES};
use kiln_runtime::DeviceSpec;
use std::path::PathBuf;
use std::time::Duration;

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
    /// Connections served at once; one more gets a 503 and is closed.
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS, value_parser = connections)]
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers; also how long an
    /// idle keep-alive connection stays open.
    #[arg(long, default_value_t = DEFAULT_HEADER_TIMEOUT.as_secs_f64(), value_parser = secs)]
    pub header_timeout_secs: f64,
    /// Seconds a client has to send a request's body.
    #[arg(long, default_value_t = DEFAULT_BODY_TIMEOUT.as_secs_f64(), value_parser = secs)]
    pub body_timeout_secs: f64,
}

/// 1 to 1,000,000 connections.
fn connections(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=1_000_000).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{s}`: --max-connections is a count from 1 to 1000000"
        )),
    }
}

/// A positive number of seconds, at most a day.
fn secs(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if v.is_finite() && v > 0.0 && v <= 86_400.0 {
        Ok(v)
    } else {
        Err(format!(
            "{s} s: a timeout is more than 0 and at most 86400 seconds"
        ))
    }
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
        limits: ConnLimits {
            max_connections: args.max_connections,
            header_timeout: Duration::from_secs_f64(args.header_timeout_secs),
            body_timeout: Duration::from_secs_f64(args.body_timeout_secs),
        },
        ..ServeConfig::new(args.plan, args.weights)
    };
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(crate::serve(config))
}
