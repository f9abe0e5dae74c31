//! The HTTP side: axum routes, request validation against the loaded
//! model, prompt rendering and tokenization, and OpenAI-shaped responses
//! (JSON, or server-sent events ending with `data: [DONE]`).
//!
//! Handlers never touch the engine: they send a [`Submission`] to the engine
//! thread and read [`Event`]s back. A streaming response is fed by a small
//! task that forwards events; when the client goes away the response body is
//! dropped, the task's send fails, it drops the event receiver, and the
//! engine thread removes the sequence before its next step.
//!
//! Every error, including an unknown route (404), a wrong method (405) and a
//! body over the limit (413), is an OpenAI-style JSON error body. Requests
//! beyond the sequences the plan runs at once are queued, not refused: the
//! queue holds validated requests only, each bounded by the body limit, a
//! prompt shorter than the context and `max_tokens` capped by the context.
//! Not here: auth, TLS, CORS, rate limits and connection limits (put a proxy
//! in front).

use crate::api::{self, ApiError, GenRequest, Prompt};
use crate::metrics::Metrics;
use crate::scheduler::{Command, Event, ModelInfo, Submission, TokenLogprob};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kiln_runtime::chat::{ChatError, ChatTemplate};
use kiln_runtime::text::TextTokenizer;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tokio_stream::wrappers::UnboundedReceiverStream;

/// Everything a handler needs.
pub struct AppState {
    pub tx: UnboundedSender<Command>,
    pub info: ModelInfo,
    pub tok: Arc<TextTokenizer>,
    /// The model's chat template, or why there is none.
    pub template: Result<ChatTemplate, String>,
    pub metrics: Arc<Mutex<Metrics>>,
    /// How long a client has to send a request body (`--body-timeout-secs`).
    pub body_timeout: std::time::Duration,
    pub created: u64,
    pub next_id: AtomicU64,
}

type Shared = Arc<AppState>;

/// The routes, with a request body limit of `max_body_bytes`.
pub fn router(state: Shared, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(unknown_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                refuse_declared_oversize(req, next, max_body_bytes)
            },
        ))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn random_seed() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    (status, Json(e.body())).into_response()
}

fn count(state: &AppState, endpoint: &str, status: u16) {
    state
        .metrics
        .lock()
        .expect("metrics lock")
        .count_request(endpoint, status);
}

async fn health(State(s): State<Shared>) -> Response {
    if s.tx.is_closed() {
        count(&s, "/health", 503);
        return error_response(&ApiError::unavailable("the engine thread has stopped"));
    }
    count(&s, "/health", 200);
    Json(json!({"status": "ok"})).into_response()
}

async fn models(State(s): State<Shared>) -> Response {
    count(&s, "/v1/models", 200);
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.info.name,
            "object": "model",
            "created": s.created,
            "owned_by": "kiln",
            "max_model_len": s.info.max_context,
        }],
    }))
    .into_response()
}

async fn metrics(State(s): State<Shared>) -> Response {
    count(&s, "/metrics", 200);
    let text = s.metrics.lock().expect("metrics lock").render();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

impl Kind {
    fn endpoint(self) -> &'static str {
        match self {
            Kind::Chat => "/v1/chat/completions",
            Kind::Completion => "/v1/completions",
        }
    }
}

/// A request whose `Content-Length` is over the limit is answered 413 from
/// the header alone: no body is read or waited for.
async fn refuse_declared_oversize(
    req: axum::extract::Request,
    next: axum::middleware::Next,
    max_body_bytes: usize,
) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match declared {
        Some(n) if n > max_body_bytes as u64 => error_response(&ApiError {
            status: 413,
            message: format!(
                "the request body is {n} bytes, more than this server accepts \
                 ({max_body_bytes}); send a smaller one or restart kiln serve with a larger \
                 --max-body-bytes"
            ),
            param: None,
            kind: "invalid_request_error",
        }),
        _ => next.run(req).await,
    }
}

async fn unknown_route(uri: axum::http::Uri) -> Response {
    error_response(&ApiError {
        status: 404,
        message: format!(
            "no route {}: kiln serves POST /v1/completions, POST /v1/chat/completions, \
             GET /v1/models, GET /health and GET /metrics",
            uri.path()
        ),
        param: None,
        kind: "invalid_request_error",
    })
}

async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let allowed = if uri.path().starts_with("/v1/") && uri.path().ends_with("completions") {
        "POST"
    } else {
        "GET"
    };
    let mut r = error_response(&ApiError {
        status: 405,
        message: format!("{method} is not allowed on {}; use {allowed}", uri.path()),
        param: None,
        kind: "invalid_request_error",
    });
    r.headers_mut()
        .insert(header::ALLOW, header::HeaderValue::from_static(allowed));
    r
}

/// A body that could not be read (over `--max-body-bytes`, or the client
/// stopped sending) as an OpenAI-style error with the rejection's status.
fn body_error(s: &AppState, kind: Kind, e: BytesRejection) -> Response {
    let status = e.status().as_u16();
    let message = if status == 413 {
        format!(
            "the request body is larger than this server accepts ({}); send a smaller one or \
             restart kiln serve with a larger --max-body-bytes",
            e.body_text()
        )
    } else {
        format!("the request body could not be read: {}", e.body_text())
    };
    let e = ApiError {
        status,
        message,
        param: None,
        kind: "invalid_request_error",
    };
    count(s, kind.endpoint(), e.status);
    error_response(&e)
}

/// A request body read within the server's body timeout: the bytes, the
/// rejection (too large, or the client stopped sending), or `Err(None)`
/// when the client took longer than the timeout.
struct TimedBody(Result<Bytes, Option<BytesRejection>>);

impl axum::extract::FromRequest<Shared> for TimedBody {
    type Rejection = Infallible;
    async fn from_request(req: axum::extract::Request, s: &Shared) -> Result<Self, Infallible> {
        let read = <Bytes as axum::extract::FromRequest<Shared>>::from_request(req, s);
        Ok(TimedBody(
            match tokio::time::timeout(s.body_timeout, read).await {
                Ok(r) => r.map_err(Some),
                Err(_) => Err(None),
            },
        ))
    }
}

/// A body that took longer than the body timeout: 408, named as such.
fn body_timeout(s: &AppState, kind: Kind) -> Response {
    let e = ApiError {
        status: 408,
        message: format!(
            "the request body did not arrive within {} s; send it at once (or restart kiln \
             serve with a larger --body-timeout-secs)",
            s.body_timeout.as_secs_f64()
        ),
        param: None,
        kind: "invalid_request_error",
    };
    count(s, kind.endpoint(), e.status);
    let mut r = error_response(&e);
    r.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    r
}

async fn chat_completions(State(s): State<Shared>, TimedBody(body): TimedBody) -> Response {
    match body {
        Ok(body) => generate(s, Kind::Chat, body).await,
        Err(Some(e)) => body_error(&s, Kind::Chat, e),
        Err(None) => body_timeout(&s, Kind::Chat),
    }
}

async fn completions(State(s): State<Shared>, TimedBody(body): TimedBody) -> Response {
    match body {
        Ok(body) => generate(s, Kind::Completion, body).await,
        Err(Some(e)) => body_error(&s, Kind::Completion, e),
        Err(None) => body_timeout(&s, Kind::Completion),
    }
}

async fn generate(s: Shared, kind: Kind, body: Bytes) -> Response {
    let r = match prepare(&s, kind, &body) {
        Ok(r) => r,
        Err(e) => {
            count(&s, kind.endpoint(), e.status);
            return error_response(&e);
        }
    };
    let (req, prompt) = r;
    let prompt_len = prompt.len() as u32;
    let max_new_tokens = max_new_tokens(&s.info, &req, prompt_len);
    let (etx, erx) = unbounded_channel();
    let stream = req.stream;
    let sub = Submission {
        prompt,
        req: req.clone(),
        max_new_tokens,
        events: etx,
        arrived: Instant::now(),
    };
    if s.tx.send(Command::Submit(Box::new(sub))).is_err() {
        let e = ApiError::unavailable("the engine thread has stopped");
        count(&s, kind.endpoint(), e.status);
        return error_response(&e);
    }
    count(&s, kind.endpoint(), 200);
    let id = format!(
        "{}-{}",
        if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        s.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let shape = Shape {
        kind,
        id,
        created: now_secs(),
        model: s.info.name.clone(),
        logprobs: req.logprobs.is_some(),
    };
    if stream {
        stream_response(shape, req.include_usage, erx)
    } else {
        collect_response(shape, erx).await
    }
}

/// Validates a body into a request and its prompt tokens.
fn prepare(s: &AppState, kind: Kind, body: &[u8]) -> Result<(GenRequest, Vec<u32>), ApiError> {
    let m = api::parse_body(body)?;
    let req = match kind {
        Kind::Chat => api::chat_request(&m, random_seed())?,
        Kind::Completion => api::completion_request(&m, random_seed())?,
    };
    let field = if kind == Kind::Chat {
        "messages"
    } else {
        "prompt"
    };
    let prompt = match &req.prompt {
        Prompt::Tokens(t) => {
            if let Some(&bad) = t.iter().find(|&&t| t >= s.info.vocab_size) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!(
                        "token id {bad} is outside the vocabulary (size {})",
                        s.info.vocab_size
                    ),
                ));
            }
            t.clone()
        }
        Prompt::Text(text) => encode(s, text)?,
        Prompt::Chat(msgs) => {
            let t = s
                .template
                .as_ref()
                .map_err(|why| ApiError::invalid("messages", why.clone()))?;
            let text = t.render(msgs, true).map_err(|e| match e {
                ChatError::OutOfFuel | ChatError::TooLong | ChatError::Render(_) => {
                    ApiError::invalid("messages", e.to_string())
                }
                other => ApiError::server(other.to_string()),
            })?;
            encode(s, &text)?
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            field,
            format!("`{field}` tokenizes to nothing; send some text"),
        ));
    }
    let len = prompt.len() as u32;
    if len >= s.info.max_context {
        return Err(ApiError::invalid(
            field,
            format!(
                "the prompt has {len} tokens but this model's context is {} tokens, and at \
                 least one must remain for the reply; shorten the prompt to at most {} tokens",
                s.info.max_context,
                s.info.max_context - 1
            ),
        ));
    }
    let blocks = len.div_ceil(s.info.kv_block_size) + 1;
    if blocks > s.info.usable_kv_blocks {
        return Err(ApiError::invalid(
            field,
            format!(
                "the prompt has {len} tokens, more than this plan's whole KV cache holds ({} \
                 blocks of {}); shorten it or compile the plan with more KV blocks",
                s.info.usable_kv_blocks, s.info.kv_block_size
            ),
        ));
    }
    let graph = s
        .info
        .graph_samples(&req.sampling, max_new_tokens(&s.info, &req, len));
    if req.needs_logits_on(graph) && !s.info.has_logits {
        let param = if req.logprobs.is_some() {
            "logprobs"
        } else if req.sampling.has_penalties() {
            if req.sampling.presence_penalty != 0.0 {
                "presence_penalty"
            } else {
                "frequency_penalty"
            }
        } else {
            "temperature"
        };
        let serves = if s.info.in_graph_sampling {
            "it samples in the graph but has no logits for logprobs, or for penalties on \
             requests allowed more new tokens than its penalty slots"
        } else {
            "it serves greedy requests only (temperature 0, no penalties, no logprobs)"
        };
        return Err(ApiError::invalid(
            param,
            format!(
                "`{param}` needs the model's logits, but this plan does not output them, so \
                 {serves}; recompile the plan with `kiln compile --logits` (and `--sampling` \
                 to sample in the graph)"
            ),
        ));
    }
    Ok((req, prompt))
}

/// The most tokens a request may generate: its `max_tokens`, capped by the
/// context left after its prompt.
fn max_new_tokens(info: &ModelInfo, req: &GenRequest, prompt_len: u32) -> u32 {
    req.max_tokens
        .unwrap_or(u32::MAX)
        .min(info.max_context.saturating_sub(prompt_len))
}

fn encode(s: &AppState, text: &str) -> Result<Vec<u32>, ApiError> {
    s.tok
        .encode(text)
        .map_err(|e| ApiError::server(format!("tokenizing the prompt failed: {e}")))
}

/// What every response chunk repeats.
struct Shape {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
}

fn bytes_of(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

impl Shape {
    fn chat_logprobs(&self, lps: &[TokenLogprob]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        json!({"content": lps.iter().map(|l| json!({
            "token": l.token,
            "logprob": l.logprob,
            "bytes": bytes_of(&l.token),
            "top_logprobs": l.top.iter().map(|(t, p)| json!({
                "token": t, "logprob": p, "bytes": bytes_of(t),
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>()})
    }

    fn completion_logprobs(&self, lps: &[TokenLogprob], offset: usize) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let mut at = offset;
        let mut offsets = Vec::new();
        for l in lps {
            offsets.push(at);
            at += l.token.len();
        }
        json!({
            "tokens": lps.iter().map(|l| l.token.clone()).collect::<Vec<_>>(),
            "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
            "top_logprobs": lps.iter().map(|l| {
                l.top.iter().map(|(t, p)| (t.clone(), json!(p))).collect::<serde_json::Map<_, _>>()
            }).collect::<Vec<_>>(),
            "text_offset": offsets,
        })
    }

    fn usage(prompt: u32, completion: u32) -> Value {
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        })
    }

    fn chunk(&self, choice: Value) -> Value {
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }
}

fn sse(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

fn stream_response(
    shape: Shape,
    include_usage: bool,
    mut erx: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> Response {
    let (otx, orx) = unbounded_channel::<Result<SseEvent, Infallible>>();
    tokio::spawn(async move {
        let send = |v: SseEvent| otx.send(Ok(v)).is_ok();
        if shape.kind == Kind::Chat {
            let first = shape.chunk(json!({
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": Value::Null,
                "finish_reason": Value::Null,
            }));
            if !send(sse(&first)) {
                return;
            }
        }
        let mut offset = 0usize;
        loop {
            let ev = tokio::select! {
                ev = erx.recv() => ev,
                _ = otx.closed() => return,
            };
            let Some(ev) = ev else {
                let e = ApiError::server("the engine dropped the request");
                let _ = send(sse(&e.body()));
                break;
            };
            match ev {
                Event::Text { text, logprobs } => {
                    let choice = match shape.kind {
                        Kind::Chat => json!({
                            "index": 0,
                            "delta": {"content": text},
                            "logprobs": shape.chat_logprobs(&logprobs),
                            "finish_reason": Value::Null,
                        }),
                        Kind::Completion => json!({
                            "index": 0,
                            "text": text,
                            "logprobs": shape.completion_logprobs(&logprobs, offset),
                            "finish_reason": Value::Null,
                        }),
                    };
                    offset += text.len();
                    if !send(sse(&shape.chunk(choice))) {
                        return;
                    }
                }
                Event::Done {
                    finish_reason,
                    prompt_tokens,
                    completion_tokens,
                } => {
                    let choice = match shape.kind {
                        Kind::Chat => json!({
                            "index": 0, "delta": {}, "logprobs": Value::Null,
                            "finish_reason": finish_reason,
                        }),
                        Kind::Completion => json!({
                            "index": 0, "text": "", "logprobs": Value::Null,
                            "finish_reason": finish_reason,
                        }),
                    };
                    if !send(sse(&shape.chunk(choice))) {
                        return;
                    }
                    if include_usage {
                        let mut last = shape.chunk(Value::Null);
                        last["choices"] = json!([]);
                        last["usage"] = Shape::usage(prompt_tokens, completion_tokens);
                        if !send(sse(&last)) {
                            return;
                        }
                    }
                    break;
                }
                Event::Error(message) => {
                    let _ = send(sse(&ApiError::server(message).body()));
                    break;
                }
            }
        }
        let _ = send(SseEvent::default().data("[DONE]"));
    });
    Sse::new(UnboundedReceiverStream::new(orx)).into_response()
}

async fn collect_response(
    shape: Shape,
    mut erx: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> Response {
    let mut text = String::new();
    let mut lps = Vec::new();
    loop {
        match erx.recv().await {
            Some(Event::Text { text: t, logprobs }) => {
                text.push_str(&t);
                lps.extend(logprobs);
            }
            Some(Event::Done {
                finish_reason,
                prompt_tokens,
                completion_tokens,
            }) => {
                let (object, choice) = match shape.kind {
                    Kind::Chat => (
                        "chat.completion",
                        json!({
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "logprobs": shape.chat_logprobs(&lps),
                            "finish_reason": finish_reason,
                        }),
                    ),
                    Kind::Completion => (
                        "text_completion",
                        json!({
                            "index": 0,
                            "text": text,
                            "logprobs": shape.completion_logprobs(&lps, 0),
                            "finish_reason": finish_reason,
                        }),
                    ),
                };
                return Json(json!({
                    "id": shape.id,
                    "object": object,
                    "created": shape.created,
                    "model": shape.model,
                    "choices": [choice],
                    "usage": Shape::usage(prompt_tokens, completion_tokens),
                }))
                .into_response();
            }
            Some(Event::Error(message)) => return error_response(&ApiError::server(message)),
            None => return error_response(&ApiError::server("the engine dropped the request")),
        }
    }
}
