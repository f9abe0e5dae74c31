//! `kiln-serve`: an OpenAI-compatible HTTP server over a compiled plan.
//!
//! [`Server::start`] loads a plan and its weights on a backend
//! ([`kiln_runtime::open_backend`]) on a dedicated engine thread, binds
//! `host:port` and serves `POST /v1/completions`, `POST /v1/chat/completions`
//! (JSON or server-sent events), `GET /v1/models`, `GET /health` and
//! `GET /metrics` (Prometheus text) with axum on tokio. [`serve`] does that
//! and runs until Ctrl-C or SIGTERM; the `kiln-serve` binary (and `kiln
//! serve`) is its command line.
//!
//! The crate links the runtime and the IR, never the compiler, so a serving
//! process carries no frontend or planner. Modules: [`api`] (request
//! surface and validation), [`http`] (routes and response shapes),
//! [`scheduler`] (the engine thread: queue, admission, continuous batching,
//! preemption), [`sampler`] (host-side sampling behind the `Sampler` trait),
//! [`stream`] (detokenization, stop strings), [`metrics`], [`conn`] (the
//! connection limit and the header, idle and body timeouts).
//!
//! Not here: multiple models per process, LoRA, tools/function calling,
//! auth/TLS, tensor-parallel serving.

pub mod api;
pub mod cli;
pub mod conn;
pub mod http;
pub mod metrics;
pub mod sampler;
pub mod scheduler;
pub mod stream;

use anyhow::Context;
use kiln_runtime::chat::ChatTemplate;
use kiln_runtime::text::TextTokenizer;
use kiln_runtime::{DeviceSpec, Engine, EngineOptions};
use metrics::Metrics;
use scheduler::{Command, ModelInfo, Scheduler, SchedulerConfig};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc::UnboundedSender;

/// Default request body limit (bytes).
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;

/// How to serve.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub plan: PathBuf,
    /// The model directory: weights, `tokenizer.json`, the chat template.
    pub weights: PathBuf,
    pub host: String,
    /// 0 picks a free port ([`Server::local_addr`] says which).
    pub port: u16,
    pub device: DeviceSpec,
    /// The name `/v1/models` reports (default: the weights directory's name).
    pub model_name: Option<String>,
    pub max_body_bytes: usize,
    pub scheduler: SchedulerConfig,
    /// Connections at once, and the header (idle) and body timeouts.
    pub limits: conn::ConnLimits,
}

impl ServeConfig {
    pub fn new(plan: PathBuf, weights: PathBuf) -> ServeConfig {
        ServeConfig {
            plan,
            weights,
            host: "127.0.0.1".into(),
            port: 8000,
            device: DeviceSpec::Cpu,
            model_name: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            scheduler: SchedulerConfig::default(),
            limits: conn::ConnLimits::default(),
        }
    }
}

/// A running server.
pub struct Server {
    addr: SocketAddr,
    info: ModelInfo,
    engine_tx: UnboundedSender<Command>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    http: tokio::task::JoinHandle<std::io::Result<()>>,
    engine: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// Loads the plan on the engine thread, binds, and starts serving.
    pub async fn start(config: ServeConfig) -> anyhow::Result<Server> {
        let tok = Arc::new(TextTokenizer::from_dir(&config.weights)?);
        let template = ChatTemplate::from_model_dir(&config.weights).map_err(|e| e.to_string());
        if let Err(why) = &template {
            tracing::warn!("chat completions are unavailable: {why}");
        }
        let name = config.model_name.clone().unwrap_or_else(|| {
            config
                .weights
                .file_name()
                .map_or("kiln".into(), |n| n.to_string_lossy().into_owned())
        });
        let metrics = Arc::new(Mutex::new(Metrics::default()));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let thread_tok = tok.clone();
        let thread_metrics = metrics.clone();
        let cfg = config.clone();
        let engine = std::thread::Builder::new()
            .name("kiln-engine".into())
            .spawn(move || {
                let loaded = (|| -> anyhow::Result<Engine> {
                    let loading = || format!("loading {}", cfg.plan.display());
                    let plan =
                        kiln_runtime::loader::read_plan_file(&cfg.plan).with_context(loading)?;
                    // A tensor-parallel plan opens one backend per rank.
                    let backend = kiln_runtime::open_backend_ranks(cfg.device, plan.tp)?;
                    let engine = Engine::new(plan, &cfg.weights, backend, EngineOptions::default())
                        .with_context(loading)?;
                    Ok(engine)
                })();
                let engine = match loaded {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                if !engine
                    .plan()
                    .keys
                    .iter()
                    .any(|k| k.key.query > 1 && k.key.spec == 0)
                {
                    tracing::warn!(
                        "the plan has no prefill-chunk keys (query > 1): prompts prefill one token per step; compile it with `kiln compile --serve`"
                    );
                }
                let info = ModelInfo::from_engine(&engine, name);
                let _ = ready_tx.send(Ok(info.clone()));
                Scheduler::new(
                    engine,
                    thread_tok,
                    Box::new(sampler::HostSampler),
                    info,
                    cfg.scheduler,
                    rx,
                    thread_metrics,
                )
                .run();
            })
            .context("starting the engine thread")?;
        let info = ready_rx
            .await
            .context("the engine thread ended while loading")??;
        if info.vocab_size as usize > tok.vocab_size() + 1024 || tok.vocab_size() == 0 {
            tracing::warn!(
                "the tokenizer has {} tokens and the plan {}: check --weights",
                tok.vocab_size(),
                info.vocab_size
            );
        }
        let listener = tokio::net::TcpListener::bind((config.host.as_str(), config.port))
            .await
            .with_context(|| format!("binding {}:{}", config.host, config.port))?;
        let addr = listener.local_addr()?;
        let state = Arc::new(http::AppState {
            tx: tx.clone(),
            info: info.clone(),
            tok,
            template,
            metrics: metrics.clone(),
            body_timeout: config.limits.body_timeout,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            next_id: Default::default(),
        });
        let app = http::router(state, config.max_body_bytes);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let limits = config.limits;
        let http = tokio::spawn(conn::serve(listener, app, limits, metrics, stop_rx));
        tracing::info!(
            "serving {} on http://{addr} (context {}, {} sequences at once, logits: {}, sampling in the graph: {})",
            info.name,
            info.max_context,
            info.max_running,
            info.has_logits,
            info.in_graph_sampling
        );
        Ok(Server {
            addr,
            info,
            engine_tx: tx,
            stop: Some(stop_tx),
            http,
            engine: Some(engine),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn model(&self) -> &ModelInfo {
        &self.info
    }

    /// Stops accepting connections, ends open requests, stops the engine
    /// thread (which tears the engine down) and waits for both.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = self.engine_tx.send(Command::Shutdown);
        let http = (&mut self.http).await;
        if let Some(t) = self.engine.take() {
            tokio::task::spawn_blocking(move || t.join())
                .await?
                .map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
        }
        http??;
        Ok(())
    }

    /// Serves until Ctrl-C or SIGTERM, then shuts down.
    pub async fn run_until_signal(self) -> anyhow::Result<()> {
        shutdown_signal().await;
        tracing::info!("shutting down");
        self.shutdown().await
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Loads the plan, serves, and returns after Ctrl-C or SIGTERM. Prints
/// `listening on http://ADDR` on stdout once the socket is bound.
pub async fn serve(config: ServeConfig) -> anyhow::Result<()> {
    let server = Server::start(config).await?;
    println!("kiln-serve: listening on http://{}", server.local_addr());
    use std::io::Write;
    let _ = std::io::stdout().flush();
    server.run_until_signal().await
}
