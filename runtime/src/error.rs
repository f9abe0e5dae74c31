//! The runtime's error type: every way loading a plan or running a step can
//! fail, each message naming the problem and, where there is one, the fix.

use crate::backend::BackendError;
use crate::seq::SeqId;
use kiln_ir::Key;
use std::path::PathBuf;

/// Why the engine refused something.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a kiln plan artifact: {message}")]
    Artifact { path: PathBuf, message: String },
    #[error("the plan was compiled for target {plan} but the {backend} backend executes on {device} ({arch}); {fix}")]
    TargetMismatch {
        plan: String,
        backend: String,
        device: String,
        arch: String,
        fix: String,
    },
    #[error("malformed plan: {0}; recompile it with `kiln compile`")]
    BadPlan(String),
    #[error("stale plan: its {target} kernel images were compiled by kiln {compiler} from other kernel sources (kernel ABI {plan:016x}; this runtime's is {runtime:016x}), so they would be launched with another parameter layout; recompile it with this kiln: `kiln compile <model-dir> --target {target} ...`")]
    StaleKernels {
        target: String,
        compiler: String,
        plan: u64,
        runtime: u64,
    },
    #[error("plan/weights mismatch: {message}; point --weights at the directory the plan was compiled from, or recompile the plan against these weights")]
    WeightsMismatch { message: String },
    #[error("weight file {file}: {message}")]
    BadWeightFile { file: PathBuf, message: String },
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("capture of key {key} failed: {source}")]
    Capture {
        key: Key,
        #[source]
        source: BackendError,
    },
    #[error("the prompt is empty: give at least one token (a prompt of only whitespace may tokenize to nothing)")]
    EmptyPrompt,
    #[error("the prompt has {len} tokens but the plan's context holds {max_context}, and at least one position must remain for generation; shorten the prompt to at most {} tokens or compile with a longer context", .max_context - 1)]
    PromptTooLong { len: usize, max_context: u32 },
    #[error("{what} is {size}; a prompt may be at most {limit} bytes (kiln reads no more), so shorten it")]
    PromptTooLarge {
        what: String,
        size: String,
        limit: u64,
    },
    #[error("{what} token id {token} is outside the vocabulary (size {vocab}); the tokenizer does not match the model")]
    InvalidToken {
        what: &'static str,
        token: u32,
        vocab: u32,
    },
    #[error("KV cache exhausted: the sequence needs {needed} more block(s) of {block_size} tokens but {free} of {usable} are free; remove finished sequences, shorten the prompt, or compile with more KV blocks")]
    KvExhausted {
        needed: u32,
        free: u32,
        usable: u32,
        block_size: u32,
    },
    #[error("no sequence {0:?} in this engine")]
    UnknownSequence(SeqId),
    #[error("the plan draws next tokens with argmax only, so a row cannot sample (temperature {temperature}); recompile it with `kiln compile --sampling`")]
    SamplingUnavailable { temperature: f32 },
    #[error("presence/frequency penalties in the graph need a plan compiled with `kiln compile --sampling --penalty-slots N` where N is at least the sequence's new-token limit ({max_new_tokens}); this plan holds {slots} (token, count) pairs per row: lower the limit, recompile with more slots, or apply the penalties on the host from the logits")]
    PenaltiesUnavailable { max_new_tokens: u32, slots: u32 },
    #[error("the plan needs {need} of device memory but {device} has {free} bytes free ({short} too few); compile it with fewer KV blocks (--kv-blocks / --max-tokens), fewer or smaller keys, or use a device with more memory (plans can be checked at compile time with `kiln compile --device-memory`)", short = need_bytes - free)]
    DeviceTooSmall {
        device: String,
        need: String,
        need_bytes: u64,
        free: u64,
    },
    #[error("no compiled key fits a step of {rows} row(s) with query {query}, spec {spec} (largest compiled batch for that shape: {largest}) and the policy forbids eager steps; compile a larger key (kiln compile --keys b{rows}q{query}s{spec}) or allow eager fallback")]
    NoKeyFits {
        rows: u32,
        query: u32,
        spec: u32,
        largest: u32,
    },
    #[error("{count} draft token(s) given but the plan has no speculative key with spec {count} (compiled spec values: {compiled:?}); compile one (e.g. --keys b1q{}s{count})", .count + 1)]
    NoSpecKey { count: u32, compiled: Vec<u32> },
    #[error("KILN_GRAPHS={0:?} is not understood: use 0 (eager), 1 (force graphs) or leave it unset (graphs where the device supports them)")]
    GraphsEnv(String),
    #[error("tokenizer {path}: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("{0}")]
    Device(String),
    #[error("cannot time key {key}: {message}")]
    Timing { key: Key, message: String },
    #[error("{what} is not valid UTF-8 (first bad byte at offset {offset}); save it as UTF-8")]
    InvalidUtf8 { what: String, offset: usize },
    #[error("cannot replace the last token of sequence {id:?}: {why}")]
    TokenNotReplaceable { id: SeqId, why: &'static str },
}

impl EngineError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> EngineError {
        EngineError::Io {
            path: path.into(),
            source,
        }
    }
    pub(crate) fn mismatch(message: impl Into<String>) -> EngineError {
        EngineError::WeightsMismatch {
            message: message.into(),
        }
    }
}
