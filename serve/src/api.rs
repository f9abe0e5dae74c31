//! The OpenAI request surface: parsing and validating request bodies into
//! [`GenRequest`]s, and the OpenAI-style error body.
//!
//! Bodies are parsed as JSON values and read field by field, so every
//! invalid value is a 400 whose message and `param` name the field (a typed
//! serde struct would report only a line and column). Unknown fields are
//! ignored, as OpenAI does. Defaults that differ from OpenAI's, on purpose:
//! an absent `temperature` is greedy (0), because a plan without a logits
//! output can only serve greedy rows and a silent switch to sampling would
//! make the same request behave differently across plans; ask for
//! `temperature` to sample.
//!
//! Not here: tools/function calling, `n` > 1, `echo`, `logit_bias`,
//! `suffix`, multimodal content, `response_format`.

use crate::sampler::SamplingParams;
use kiln_runtime::chat::ChatMessage;
use serde_json::{json, Map, Value};

/// Largest `top_logprobs` / completions `logprobs`.
pub const MAX_TOP_LOGPROBS: u32 = 5;
/// Most stop strings per request (OpenAI's limit).
pub const MAX_STOPS: usize = 4;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;
/// Most chat messages per request.
pub const MAX_MESSAGES: usize = 4096;

/// A 400 (or other status) with an OpenAI-style body.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub param: Option<String>,
    pub kind: &'static str,
}

impl ApiError {
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            param: Some(param.to_string()),
            kind: "invalid_request_error",
        }
    }
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            param: None,
            kind: "invalid_request_error",
        }
    }
    pub fn server(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 500,
            message: message.into(),
            param: None,
            kind: "server_error",
        }
    }
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 503,
            message: message.into(),
            param: None,
            kind: "server_error",
        }
    }
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": Value::Null,
        }})
    }
}

/// What the client sent as the prompt.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Chat(Vec<ChatMessage>),
}

/// How many log probabilities to report per token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogprobsRequest {
    /// Alternatives per position, 0..=5.
    pub top: u32,
}

/// A validated completion or chat completion request.
#[derive(Clone, Debug, PartialEq)]
pub struct GenRequest {
    pub prompt: Prompt,
    pub max_tokens: Option<u32>,
    pub sampling: SamplingParams,
    /// The client gave a seed (otherwise `sampling.seed` is random).
    pub seeded: bool,
    pub stop: Vec<String>,
    pub logprobs: Option<LogprobsRequest>,
    pub stream: bool,
    pub include_usage: bool,
}

impl GenRequest {
    /// The row needs the plan's logits on a plan without in-graph sampling
    /// (sampling, penalties or logprobs).
    pub fn needs_logits(&self) -> bool {
        self.needs_logits_on(false)
    }
    /// The row needs the plan's logits when the graph does (`in_graph`) or
    /// does not draw its tokens (penalties included): logprobs, or
    /// host-side sampling.
    pub fn needs_logits_on(&self, in_graph: bool) -> bool {
        self.sampling.needs_host(in_graph) || self.logprobs.is_some()
    }
}

/// Parses a body as a JSON object.
pub fn parse_body(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| {
        ApiError::bad_request(format!(
            "the request body is not valid JSON: {e}; send a JSON object"
        ))
    })?;
    match v {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::bad_request(
            "the request body must be a JSON object",
        )),
    }
}

fn present<'a>(m: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    m.get(k).filter(|v| !v.is_null())
}

fn number(m: &Map<String, Value>, k: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    match present(m, k) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
            Some(x) => Err(ApiError::invalid(
                k,
                format!("`{k}` is {x}; it must be between {lo} and {hi}"),
            )),
            None => Err(ApiError::invalid(
                k,
                format!("`{k}` must be a number, got {v}"),
            )),
        },
    }
}

fn integer(m: &Map<String, Value>, k: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
    match present(m, k) {
        None => Ok(None),
        Some(v) => match v.as_i64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(Some(x)),
            Some(x) => Err(ApiError::invalid(
                k,
                format!("`{k}` is {x}; it must be between {lo} and {hi}"),
            )),
            None => Err(ApiError::invalid(
                k,
                format!("`{k}` must be an integer, got {v}"),
            )),
        },
    }
}

fn boolean(m: &Map<String, Value>, k: &str) -> Result<Option<bool>, ApiError> {
    match present(m, k) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ApiError::invalid(
            k,
            format!("`{k}` must be true or false, got {v}"),
        )),
    }
}

/// The parameters shared by both endpoints. `seed` is the random seed used
/// when the client sends none.
fn common(m: &Map<String, Value>, random_seed: u64) -> Result<GenRequest, ApiError> {
    let mut max_tokens = None;
    for k in ["max_completion_tokens", "max_tokens"] {
        if let Some(x) = integer(m, k, 1, u32::MAX as i64).map_err(|e| {
            if present(m, k).and_then(Value::as_i64).is_some() {
                ApiError::invalid(k, format!("`{k}` must be at least 1"))
            } else {
                e
            }
        })? {
            max_tokens.get_or_insert(x as u32);
        }
    }
    if let Some(n) = integer(m, "n", 1, 1)
        .map_err(|_| ApiError::invalid("n", "`n` must be 1: kiln serves one choice per request"))?
    {
        debug_assert_eq!(n, 1);
    }
    let temperature = number(m, "temperature", 0.0, 2.0)?.unwrap_or(0.0) as f32;
    let top_p = number(m, "top_p", 0.0, 1.0)?.unwrap_or(1.0) as f32;
    if top_p <= 0.0 {
        return Err(ApiError::invalid(
            "top_p",
            "`top_p` must be greater than 0 (and at most 1)",
        ));
    }
    let top_k = integer(m, "top_k", -1, u32::MAX as i64)?
        .unwrap_or(0)
        .max(0) as u32;
    let min_p = number(m, "min_p", 0.0, 1.0)?.unwrap_or(0.0) as f32;
    let presence_penalty = number(m, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32;
    let frequency_penalty = number(m, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32;
    let seed = integer(m, "seed", i64::MIN, i64::MAX)?;
    let stop = match present(m, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            if a.len() > MAX_STOPS {
                return Err(ApiError::invalid(
                    "stop",
                    format!(
                        "`stop` has {} strings; at most {MAX_STOPS} are allowed",
                        a.len()
                    ),
                ));
            }
            a.iter()
                .map(|s| {
                    s.as_str().map(str::to_string).ok_or_else(|| {
                        ApiError::invalid("stop", "`stop` must be a string or a list of strings")
                    })
                })
                .collect::<Result<_, _>>()?
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "`stop` must be a string or a list of strings",
            ))
        }
    };
    if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "a `stop` string has {} bytes; at most {MAX_STOP_BYTES} are allowed",
                long.len()
            ),
        ));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            "`stop` strings must not be empty",
        ));
    }
    let stream = boolean(m, "stream")?.unwrap_or(false);
    let include_usage = match present(m, "stream_options") {
        None => false,
        Some(Value::Object(o)) => boolean(o, "include_usage")
            .map_err(|_| {
                ApiError::invalid(
                    "stream_options.include_usage",
                    "`stream_options.include_usage` must be true or false",
                )
            })?
            .unwrap_or(false),
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "`stream_options` must be an object",
            ))
        }
    };
    Ok(GenRequest {
        prompt: Prompt::Text(String::new()),
        max_tokens,
        sampling: SamplingParams {
            temperature,
            top_p,
            top_k,
            min_p,
            presence_penalty,
            frequency_penalty,
            seed: seed.map_or(random_seed, |s| s as u64),
        },
        seeded: seed.is_some(),
        stop,
        logprobs: None,
        stream,
        include_usage,
    })
}

/// A `POST /v1/chat/completions` body.
pub fn chat_request(m: &Map<String, Value>, random_seed: u64) -> Result<GenRequest, ApiError> {
    let mut r = common(m, random_seed)?;
    let Some(msgs) = present(m, "messages") else {
        return Err(ApiError::invalid(
            "messages",
            "`messages` is required: a non-empty list of {\"role\", \"content\"} objects",
        ));
    };
    let Some(list) = msgs.as_array().filter(|a| !a.is_empty()) else {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must be a non-empty list of {\"role\", \"content\"} objects",
        ));
    };
    if list.len() > MAX_MESSAGES {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "`messages` has {} entries; at most {MAX_MESSAGES} are allowed",
                list.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, msg) in list.iter().enumerate() {
        let field = format!("messages[{i}]");
        let Some(o) = msg.as_object() else {
            return Err(ApiError::invalid(
                &field,
                format!("`{field}` must be an object"),
            ));
        };
        let role = match o.get("role").and_then(Value::as_str) {
            Some(r @ ("system" | "user" | "assistant" | "developer" | "tool")) => {
                if r == "developer" {
                    "system"
                } else {
                    r
                }
            }
            _ => {
                return Err(ApiError::invalid(
                    &format!("{field}.role"),
                    format!(
                        "`{field}.role` must be one of system, user, assistant, developer, tool"
                    ),
                ))
            }
        };
        let content = match o.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (
                        p.get("type").and_then(Value::as_str),
                        p.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                &format!("{field}.content"),
                                format!(
                                    "`{field}.content` parts must be {{\"type\": \"text\", \"text\": ...}}: \
                                     kiln serves text models"
                                ),
                            ))
                        }
                    }
                }
                text
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    &format!("{field}.content"),
                    format!("`{field}.content` must be a string or a list of text parts"),
                ))
            }
        };
        out.push(ChatMessage::new(role, &content));
    }
    r.prompt = Prompt::Chat(out);
    let want = boolean(m, "logprobs")?.unwrap_or(false);
    let top = integer(m, "top_logprobs", 0, MAX_TOP_LOGPROBS as i64)?;
    if top.is_some() && !want {
        return Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` needs `logprobs: true`",
        ));
    }
    if want {
        r.logprobs = Some(LogprobsRequest {
            top: top.unwrap_or(0) as u32,
        });
    }
    Ok(r)
}

/// A `POST /v1/completions` body.
pub fn completion_request(
    m: &Map<String, Value>,
    random_seed: u64,
) -> Result<GenRequest, ApiError> {
    let mut r = common(m, random_seed)?;
    let bad = || {
        ApiError::invalid(
            "prompt",
            "`prompt` must be a string, a list of one string, or a list of token ids \
             (kiln serves one prompt per request)",
        )
    };
    r.prompt = match present(m, "prompt") {
        None => {
            return Err(ApiError::invalid(
                "prompt",
                "`prompt` is required: a string or a list of token ids",
            ))
        }
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Prompt::Text(a[0].as_str().expect("checked").to_string())
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_u64) => Prompt::Tokens(
            a.iter()
                .map(|v| v.as_u64().expect("checked").min(u32::MAX as u64) as u32)
                .collect(),
        ),
        Some(_) => return Err(bad()),
    };
    if let Some(top) = integer(m, "logprobs", 0, MAX_TOP_LOGPROBS as i64)? {
        r.logprobs = Some(LogprobsRequest { top: top as u32 });
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<GenRequest, ApiError> {
        chat_request(&parse_body(body.as_bytes())?, 1)
    }

    const MSG: &str = r#""messages": [{"role": "user", "content": "hi"}]"#;

    #[test]
    fn malformed_json_is_a_400_saying_so() {
        let e = parse_body(b"{\"messages\": [").unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
    }

    #[test]
    fn missing_messages_names_the_field() {
        let e = chat(r#"{"model": "x"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert!(e.message.contains("required"));
        let e = chat(r#"{"messages": []}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
    }

    #[test]
    fn negative_max_tokens_names_the_field() {
        let e = chat(&format!(r#"{{{MSG}, "max_tokens": -3}}"#)).unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(e.message.contains("at least 1"), "{}", e.message);
    }

    #[test]
    fn a_string_temperature_names_the_field() {
        let e = chat(&format!(r#"{{{MSG}, "temperature": "hot"}}"#)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert!(e.message.contains("must be a number"), "{}", e.message);
        let e = chat(&format!(r#"{{{MSG}, "temperature": 3}}"#)).unwrap_err();
        assert!(e.message.contains("between 0 and 2"), "{}", e.message);
    }

    #[test]
    fn unknown_fields_are_ignored_and_defaults_are_greedy() {
        let r = chat(&format!(r#"{{{MSG}, "frobnicate": 1, "user": "u"}}"#)).unwrap();
        assert!(r.sampling.is_greedy());
        assert!(!r.needs_logits());
        assert!(!r.needs_logits_on(true));
        assert_eq!(r.max_tokens, None);
        assert_eq!(r.prompt, Prompt::Chat(vec![ChatMessage::user("hi")]));
    }

    #[test]
    fn every_sampling_field_is_read() {
        let r = chat(&format!(
            r#"{{{MSG}, "max_completion_tokens": 9, "max_tokens": 3, "temperature": 0.5,
                "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 123, "stop": ["a", "b"],
                "presence_penalty": 0.1, "frequency_penalty": -0.2, "logprobs": true,
                "top_logprobs": 5, "n": 1, "stream": true,
                "stream_options": {{"include_usage": true}}}}"#
        ))
        .unwrap();
        assert_eq!(r.max_tokens, Some(9));
        assert_eq!(r.sampling.top_k, 40);
        assert_eq!(r.sampling.seed, 123);
        assert!(r.seeded && r.stream && r.include_usage);
        assert_eq!(r.stop, vec!["a", "b"]);
        assert_eq!(r.logprobs, Some(LogprobsRequest { top: 5 }));
        assert!(r.needs_logits());
    }

    #[test]
    fn out_of_range_values_are_refused_by_name() {
        for (field, v) in [
            ("top_logprobs", "6"),
            ("n", "2"),
            ("top_p", "0"),
            ("min_p", "1.5"),
            ("presence_penalty", "-3"),
            ("stop", "[\"a\",\"b\",\"c\",\"d\",\"e\"]"),
            ("stop", "7"),
            ("stream", "\"yes\""),
        ] {
            let extra = if field == "top_logprobs" {
                ", \"logprobs\": true"
            } else {
                ""
            };
            let e = chat(&format!(r#"{{{MSG}, "{field}": {v}{extra}}}"#)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{field}: {}", e.message);
        }
    }

    #[test]
    fn completion_prompts_are_text_one_string_or_token_ids() {
        let p = |b: &str| completion_request(&parse_body(b.as_bytes()).unwrap(), 0);
        assert_eq!(
            p(r#"{"prompt": "a"}"#).unwrap().prompt,
            Prompt::Text("a".into())
        );
        assert_eq!(
            p(r#"{"prompt": ["a"]}"#).unwrap().prompt,
            Prompt::Text("a".into())
        );
        assert_eq!(
            p(r#"{"prompt": [1, 2]}"#).unwrap().prompt,
            Prompt::Tokens(vec![1, 2])
        );
        assert_eq!(
            p(r#"{"prompt": ["a", "b"]}"#).unwrap_err().param.as_deref(),
            Some("prompt")
        );
        assert_eq!(
            p(r#"{"prompt": "a", "logprobs": 2}"#).unwrap().logprobs,
            Some(LogprobsRequest { top: 2 })
        );
    }

    #[test]
    fn too_many_messages_and_overlong_stop_strings_are_refused_by_name() {
        let msgs = vec![json!({"role": "user", "content": "x"}); MAX_MESSAGES + 1];
        let body = json!({"messages": msgs}).to_string();
        let e = chat(&body).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert!(
            e.message.contains(&format!("{}", MAX_MESSAGES + 1)),
            "{}",
            e.message
        );
        let ok = json!({"messages": &msgs[..MAX_MESSAGES]}).to_string();
        assert!(chat(&ok).is_ok());
        let stop = "s".repeat(MAX_STOP_BYTES + 1);
        let e = chat(&format!(r#"{{{MSG}, "stop": "{stop}"}}"#)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop"));
        let stop = "s".repeat(MAX_STOP_BYTES);
        assert!(chat(&format!(r#"{{{MSG}, "stop": ["{stop}"]}}"#)).is_ok());
    }

    #[test]
    fn the_error_body_is_openai_shaped() {
        let b = ApiError::invalid("temperature", "bad").body();
        assert_eq!(b["error"]["param"], "temperature");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["message"], "bad");
    }
}
