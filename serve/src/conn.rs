//! The connection layer: accepting TCP connections with a bound on how many
//! are open at once, and serving each over HTTP/1 with timeouts, so slow,
//! idle or too many clients cannot hold the server.
//!
//! Why it exists instead of `axum::serve`: that one accepts every
//! connection and never times out a client that sends its headers one byte
//! a minute (slowloris) or keeps an idle connection forever. Here:
//! * At most [`ConnLimits::max_connections`] connections are served at
//!   once. One beyond that gets a `503 Service Unavailable` with an
//!   OpenAI-style error body, `Retry-After: 1` and `Connection: close`,
//!   and is closed: no queue, since a client retries a 503 with backoff as
//!   it does with any OpenAI-compatible server. At most
//!   [`MAX_REFUSING`] refusals are in flight; beyond that a connection is
//!   closed at once.
//! * Each connection is hyper's HTTP/1 with its header read timeout
//!   ([`ConnLimits::header_timeout`]). hyper starts that timer whenever a
//!   connection waits for a request head, the idle wait between keep-alive
//!   requests included, so it is also the idle keep-alive timeout.
//! * The request body timeout ([`ConnLimits::body_timeout`]) is applied
//!   where handlers read bodies (`http::TimedBody`), since only they know a
//!   body is being read.
//!
//! Connections are watched for graceful shutdown: on stop, no new ones are
//! accepted and open ones finish their current response (bounded by
//! [`SHUTDOWN_GRACE`]). Not here: TLS, HTTP/2, per-client rate limits.

use crate::metrics::Metrics;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Default bound on connections served at once.
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;
/// Default time a client has to send a request's headers (and the longest
/// an idle keep-alive connection stays open).
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// Default time a client has to send a request's body.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Refusals (503 responses to connections over the limit) in flight at most.
pub const MAX_REFUSING: usize = 64;
/// How long a refused connection gets to take its 503.
const REFUSE_TIME: Duration = Duration::from_secs(1);
/// How long shutdown waits for open connections to finish.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Bounds on what clients may hold.
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> ConnLimits {
        ConnLimits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
        }
    }
}

/// Serves `app` on `listener` until `stop` fires, then lets open
/// connections finish (see the module docs).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    metrics: Arc<Mutex<Metrics>>,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<()> {
    let max = limits.max_connections.max(1);
    let permits = Arc::new(Semaphore::new(max));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let graceful = GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    tokio::pin!(stop);
    loop {
        let stream = tokio::select! {
            _ = &mut stop => break,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of file descriptors and the like: back off.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        match permits.clone().try_acquire_owned() {
            Ok(permit) => {
                let open = max - permits.available_permits();
                metrics.lock().expect("metrics lock").connections_open = open as u64;
                let conn = builder
                    .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
                let conn = graceful.watch(conn);
                let (m, p) = (metrics.clone(), permits.clone());
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!("connection ended: {e}");
                    }
                    drop(permit);
                    m.lock().expect("metrics lock").connections_open =
                        (max - p.available_permits()) as u64;
                });
            }
            Err(_) => {
                metrics.lock().expect("metrics lock").connections_refused += 1;
                if let Ok(r) = refusing.clone().try_acquire_owned() {
                    tokio::spawn(async move {
                        let _ = tokio::time::timeout(REFUSE_TIME, refuse(stream, max)).await;
                        drop(r);
                    });
                }
            }
        }
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(SHUTDOWN_GRACE) => {
            tracing::warn!("connections still open {}s after shutdown began; closing them", SHUTDOWN_GRACE.as_secs());
        }
    }
    Ok(())
}

/// The response a connection over the limit gets.
pub fn refusal(max_connections: usize) -> Vec<u8> {
    let body = serde_json::json!({
        "error": {
            "message": format!(
                "the server is serving its maximum of {max_connections} connections; retry \
                 shortly, or restart kiln serve with a larger --max-connections"
            ),
            "type": "server_overloaded",
            "param": null,
            "code": null,
        }
    })
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Writes the 503, stops writing, and drains what the client sent for a
/// moment so that closing does not reset the connection before the client
/// read the response.
async fn refuse(mut stream: TcpStream, max_connections: usize) {
    if stream.write_all(&refusal(max_connections)).await.is_err() {
        return;
    }
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 4096];
    let mut drained = 0usize;
    while drained < 64 << 10 {
        match stream.read(&mut sink).await {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}
