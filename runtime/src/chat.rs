//! Chat templates: turning a list of messages into the prompt text an
//! instruction-tuned model was trained on.
//!
//! Hugging Face models ship their template as Jinja source, either in
//! `chat_template.jinja` or in `tokenizer_config.json` (`chat_template`), and
//! `transformers` renders it with a sandboxed Jinja2 environment
//! (`trim_blocks`, `lstrip_blocks`) given `messages`, `add_generation_prompt`,
//! the special tokens as strings and a `raise_exception` function. This module
//! does the same with a real Jinja engine (minijinja, with minijinja-contrib's
//! Python string, list and dict methods such as `.strip()`, `.startswith()`
//! and `.split()`, which Qwen3's and Gemma's templates call), so the model's
//! own template decides the prompt, including its default system prompt; kiln
//! hard-codes no format. It lives in the runtime so that a serving process
//! renders templates without linking the compiler.
//!
//! Rendering is bounded: a template runs on a fixed amount of minijinja fuel
//! (instructions) and may write at most [`MAX_RENDERED_BYTES`], so a hostile
//! or looping template, or a huge message list, fails with a clear error
//! rather than hanging a server.
//!
//! Not here: tool/function-calling arguments (`tools`, `documents`),
//! multimodal message content, and tokenization (the rendered text goes
//! through `tokenizer.json` as any prompt does).

use serde::Serialize;
use std::path::{Path, PathBuf};

/// Instructions one render may execute (minijinja fuel). Real templates
/// use a few thousand per message; this leaves room for long conversations.
pub const RENDER_FUEL: u64 = 5_000_000;

/// The most bytes a rendered prompt may have.
pub const MAX_RENDERED_BYTES: usize = 4 << 20;

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
    pub fn system(content: &str) -> ChatMessage {
        ChatMessage::new("system", content)
    }
    pub fn user(content: &str) -> ChatMessage {
        ChatMessage::new("user", content)
    }
}

/// Why a template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {message}")]
    Json { path: PathBuf, message: String },
    #[error(
        "{path} has no `chat_template`; this model has no chat format, so prompt it \
         with plain text (`kiln run --prompt`) instead"
    )]
    NoTemplate { path: PathBuf },
    #[error("{path}: `{field}` {message}")]
    BadField {
        path: PathBuf,
        field: &'static str,
        message: String,
    },
    #[error("the chat template does not parse: {0}")]
    Syntax(String),
    #[error(
        "rendering the chat template failed: {0}; the template may need a feature kiln's \
         renderer lacks: prompt with plain text (`kiln run --prompt`) instead"
    )]
    Render(String),
    #[error(
        "rendering the chat template used more than its budget of {RENDER_FUEL} instructions; \
         send fewer or shorter messages"
    )]
    OutOfFuel,
    #[error(
        "the rendered chat prompt is longer than {MAX_RENDERED_BYTES} bytes; send fewer or \
         shorter messages"
    )]
    TooLong,
}

/// An `io::Write` into a string that refuses to grow past a cap.
struct CappedWriter {
    out: Vec<u8>,
    cap: usize,
    overflowed: bool,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > self.cap {
            self.overflowed = true;
            return Err(std::io::Error::other("rendered prompt over its size cap"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A model's chat template and the special tokens it may refer to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatTemplate {
    pub source: String,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

/// A special token in `tokenizer_config.json`: a string, or an AddedToken
/// object whose `content` is the string.
fn token_field(
    cfg: &serde_json::Value,
    field: &'static str,
    path: &Path,
) -> Result<Option<String>, ChatError> {
    match cfg.get(field) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => match v.get("content").and_then(|c| c.as_str()) {
            Some(s) => Ok(Some(s.to_string())),
            None => Err(ChatError::BadField {
                path: path.to_path_buf(),
                field,
                message: "must be a string or an object with a string `content`".into(),
            }),
        },
    }
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> ChatTemplate {
        ChatTemplate {
            source: source.to_string(),
            bos_token: bos_token.map(str::to_string),
            eos_token: eos_token.map(str::to_string),
        }
    }

    /// The template of a model directory: `chat_template.jinja` when it
    /// exists (newer `transformers` write it there), else
    /// `tokenizer_config.json`'s `chat_template`. A list of named templates
    /// (`[{"name": ..., "template": ...}]`) yields the one named `default`.
    /// The special tokens come from `tokenizer_config.json` either way.
    pub fn from_model_dir(dir: &Path) -> Result<ChatTemplate, ChatError> {
        let path = dir.join("tokenizer_config.json");
        let jinja_path = dir.join("chat_template.jinja");
        let jinja = match std::fs::read_to_string(&jinja_path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => {
                return Err(ChatError::Io {
                    path: jinja_path,
                    source,
                })
            }
        };
        if let Some(source) = &jinja {
            if !path.exists() {
                return Ok(ChatTemplate::new(source, None, None));
            }
        }
        let text = std::fs::read_to_string(&path).map_err(|source| ChatError::Io {
            path: path.clone(),
            source,
        })?;
        let cfg: serde_json::Value = serde_json::from_str(&text).map_err(|e| ChatError::Json {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let source = match cfg.get("chat_template") {
            _ if jinja.is_some() => jinja.expect("checked"),
            None | Some(serde_json::Value::Null) => {
                return Err(ChatError::NoTemplate { path });
            }
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string)
                .ok_or_else(|| ChatError::BadField {
                    path: path.clone(),
                    field: "chat_template",
                    message: "is a list of named templates without one named `default`".into(),
                })?,
            Some(_) => {
                return Err(ChatError::BadField {
                    path,
                    field: "chat_template",
                    message: "must be a string or a list of named templates".into(),
                })
            }
        };
        Ok(ChatTemplate {
            source,
            bos_token: token_field(&cfg, "bos_token", &path)?,
            eos_token: token_field(&cfg, "eos_token", &path)?,
        })
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where
    /// the assistant's reply begins.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(RENDER_FUEL));
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| ChatError::Syntax(e.to_string()))?,
        );
        env.add_function("raise_exception", |message: String| -> Result<(), _> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                format!("the template raised: {message}"),
            ))
        });
        let template = env
            .template_from_str(&self.source)
            .map_err(|e| ChatError::Syntax(describe(&e)))?;
        let mut out = CappedWriter {
            out: Vec::new(),
            cap: MAX_RENDERED_BYTES,
            overflowed: false,
        };
        let rendered = template.render_captured_to(
            minijinja::context! {
                messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.clone().unwrap_or_default(),
                eos_token => self.eos_token.clone().unwrap_or_default(),
            },
            &mut out,
        );
        let failed = rendered.err();
        match failed {
            None => {}
            Some(_) if out.overflowed => return Err(ChatError::TooLong),
            Some(e) if e.kind() == minijinja::ErrorKind::OutOfFuel => {
                return Err(ChatError::OutOfFuel)
            }
            Some(e) => return Err(ChatError::Render(describe(&e))),
        }
        String::from_utf8(out.out).map_err(|e| ChatError::Render(e.to_string()))
    }
}

/// A minijinja error with its causes, on one line.
fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_special_token_yields_its_content() {
        let cfg =
            serde_json::json!({"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": 3});
        let p = Path::new("tokenizer_config.json");
        assert_eq!(
            token_field(&cfg, "bos_token", p).unwrap().as_deref(),
            Some("<s>")
        );
        assert!(matches!(
            token_field(&cfg, "eos_token", p),
            Err(ChatError::BadField { .. })
        ));
    }
}
