//! Text in and out: the model's `tokenizer.json`, incremental decoding for
//! streaming, prompt files, and [`generate_text`], the loop `kiln run` and the
//! examples share.
//!
//! Streaming decodes token by token without splitting a multi-byte character
//! across pieces: a piece is emitted only once the text decoded so far no
//! longer ends in a replacement character, and only what is new since the
//! last piece is emitted; `finish` flushes a tail cut mid-character.
//!
//! Not here: chat templates (the prompt is used as given) and sampling (the
//! engine decodes greedily).

use crate::engine::{Engine, FinishReason, SeqId, SeqOptions};
use crate::error::EngineError;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A Hugging Face `tokenizer.json`.
pub struct TextTokenizer {
    tok: tokenizers::Tokenizer,
    path: PathBuf,
}

impl TextTokenizer {
    /// Loads `tokenizer.json` from a model directory.
    pub fn from_dir(dir: &Path) -> Result<TextTokenizer, EngineError> {
        TextTokenizer::from_file(&dir.join("tokenizer.json"))
    }

    pub fn from_file(path: &Path) -> Result<TextTokenizer, EngineError> {
        if !path.is_file() {
            return Err(EngineError::Tokenizer {
                path: path.to_path_buf(),
                message: "not found; the weights directory must hold the model's tokenizer.json (kiln import writes one)".into(),
            });
        }
        let tok = tokenizers::Tokenizer::from_file(path).map_err(|e| EngineError::Tokenizer {
            path: path.to_path_buf(),
            message: format!("cannot be loaded: {e}"),
        })?;
        Ok(TextTokenizer {
            tok,
            path: path.to_path_buf(),
        })
    }

    fn err(&self, e: impl std::fmt::Display) -> EngineError {
        EngineError::Tokenizer {
            path: self.path.clone(),
            message: e.to_string(),
        }
    }

    /// Token ids of `text`, with the special tokens the tokenizer's own
    /// post-processor adds (as `tokenizer(text)` does in transformers).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let enc = self.tok.encode(text, true).map_err(|e| self.err(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, EngineError> {
        self.tok.decode(ids, true).map_err(|e| self.err(e))
    }

    pub fn vocab_size(&self) -> usize {
        self.tok.get_vocab_size(true)
    }

    /// An incremental decoder for one sequence.
    pub fn stream(&self) -> TextStream<'_> {
        TextStream {
            tok: self,
            ids: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
        }
    }
}

/// Incremental decoding of one sequence's tokens.
pub struct TextStream<'a> {
    tok: &'a TextTokenizer,
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

impl TextStream<'_> {
    /// Adds a token; returns the text it completes, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>, EngineError> {
        tokenizers::tokenizer::step_decode_stream(
            &self.tok.tok,
            vec![id],
            true,
            &mut self.ids,
            &mut self.prefix,
            &mut self.prefix_index,
        )
        .map_err(|e| self.tok.err(e))
    }

    /// Ends the stream: the text of tokens `push` held back because they
    /// end inside a multi-byte character (generation stopped mid-character),
    /// decoded as the full decode would (with U+FFFD for the broken tail),
    /// so the pieces always concatenate to `decode(all ids)`.
    pub fn finish(self) -> Result<Option<String>, EngineError> {
        if self.ids.is_empty() {
            return Ok(None);
        }
        let text = self.tok.decode(&self.ids)?;
        match text.strip_prefix(self.prefix.as_str()) {
            Some(rest) if !rest.is_empty() => Ok(Some(rest.to_string())),
            _ => Ok(None),
        }
    }
}

/// The largest prompt read from a file or given on the command line, in
/// bytes: far more text than any compiled context holds (a token is rarely
/// under two bytes), and small enough to tokenize in bounded memory.
pub const MAX_PROMPT_BYTES: u64 = 8 << 20;

/// Refuses a prompt of more than [`MAX_PROMPT_BYTES`] bytes.
pub fn check_prompt_size(prompt: &str) -> Result<(), EngineError> {
    if prompt.len() as u64 > MAX_PROMPT_BYTES {
        return Err(EngineError::PromptTooLarge {
            what: "the prompt".into(),
            size: format!("{} bytes", prompt.len()),
            limit: MAX_PROMPT_BYTES,
        });
    }
    Ok(())
}

/// Reads a prompt file, which must be a regular UTF-8 file of at most
/// [`MAX_PROMPT_BYTES`]; a FIFO or device is refused before it is opened
/// (it could block or never end), and no more than the limit is read.
pub fn read_prompt_file(path: &Path) -> Result<String, EngineError> {
    use std::io::Read;
    let meta = std::fs::metadata(path).map_err(|e| EngineError::io(path, e))?;
    if !meta.is_file() {
        return Err(EngineError::io(
            path,
            std::io::Error::other(format!(
                "it is {}, not a regular file; give the prompt as a file",
                crate::weights::describe_file_type(&meta.file_type())
            )),
        ));
    }
    let too_large = |size: String| EngineError::PromptTooLarge {
        what: format!("prompt file {}", path.display()),
        size,
        limit: MAX_PROMPT_BYTES,
    };
    if meta.len() > MAX_PROMPT_BYTES {
        return Err(too_large(format!("{} bytes", meta.len())));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_PROMPT_BYTES + 1).read_to_end(&mut bytes))
        .map_err(|e| EngineError::io(path, e))?;
    if bytes.len() as u64 > MAX_PROMPT_BYTES {
        return Err(too_large("growing past the limit while read".into()));
    }
    String::from_utf8(bytes).map_err(|e| EngineError::InvalidUtf8 {
        what: format!("prompt file {}", path.display()),
        offset: e.utf8_error().valid_up_to(),
    })
}

/// What [`generate_text`] measured.
#[derive(Clone, Debug, Default)]
pub struct RunReport {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub finish: Option<FinishReason>,
    /// Whether the engine replayed graphs (the policy's decision).
    pub graphs: bool,
    /// Time to the first generated token (prefill).
    pub prefill_time: Duration,
    /// Time from the first generated token to the last.
    pub decode_time: Duration,
    pub replays: u64,
    pub eager_steps: u64,
    pub captures: u64,
    pub capture_time: Duration,
}

impl RunReport {
    /// Decode tokens per second (tokens after the first over the time they took).
    pub fn decode_tokens_per_s(&self) -> f64 {
        let n = self.generated_tokens.saturating_sub(1);
        if n == 0 || self.decode_time.is_zero() {
            return 0.0;
        }
        n as f64 / self.decode_time.as_secs_f64()
    }
}

/// Tokenizes `prompt`, generates up to `max_new_tokens` greedily on `engine`
/// (stopping at EOS), and hands each completed piece of text to `sink` as it
/// is produced.
pub fn generate_text(
    engine: &mut Engine,
    tok: &TextTokenizer,
    prompt: &str,
    max_new_tokens: u32,
    sink: &mut dyn FnMut(&str),
) -> Result<RunReport, EngineError> {
    generate_text_with(engine, tok, prompt, max_new_tokens, sink, &mut |e| e.step())
}

/// One engine step as [`Engine::step`] takes it: the tokens each sequence
/// generated.
pub type StepFn<'a> = dyn FnMut(&mut Engine) -> Result<Vec<(SeqId, Vec<u32>)>, EngineError> + 'a;

/// [`generate_text`] with each step taken by `step` (for example a
/// [`crate::spec::Speculator`] drafting before [`Engine::step`]).
pub fn generate_text_with(
    engine: &mut Engine,
    tok: &TextTokenizer,
    prompt: &str,
    max_new_tokens: u32,
    sink: &mut dyn FnMut(&str),
    step: &mut StepFn<'_>,
) -> Result<RunReport, EngineError> {
    let ids = tok.encode(prompt)?;
    let before = engine.total_counters();
    let t0 = Instant::now();
    let seq = engine.add_sequence_with(
        &ids,
        SeqOptions {
            max_new_tokens,
            stop_on_eos: true,
        },
    )?;
    let mut stream = tok.stream();
    let mut first: Option<Instant> = None;
    let mut report = RunReport {
        prompt_tokens: ids.len(),
        graphs: engine.graph_decision().graphs,
        ..RunReport::default()
    };
    let result = (|| {
        while engine.sequence(seq).is_some_and(|s| s.finished.is_none()) {
            for (id, toks) in step(engine)? {
                if id != seq {
                    continue;
                }
                for t in toks {
                    if first.is_none() {
                        first = Some(Instant::now());
                    }
                    report.generated_tokens += 1;
                    if let Some(piece) = stream.push(t)? {
                        sink(&piece);
                    }
                }
            }
        }
        if let Some(tail) = stream.finish()? {
            sink(&tail);
        }
        Ok::<(), EngineError>(())
    })();
    report.finish = engine.sequence(seq).and_then(|s| s.finished.cloned());
    engine.remove_sequence(seq)?;
    result?;
    let end = Instant::now();
    let first = first.unwrap_or(end);
    report.prefill_time = first - t0;
    report.decode_time = end - first;
    let after = engine.total_counters();
    report.replays = after.replays - before.replays;
    report.eager_steps = after.eager_steps - before.eager_steps;
    report.captures = after.captures - before.captures;
    report.capture_time = after.capture_time - before.capture_time;
    Ok(report)
}
