//! The fuzz targets: each feeds one input to a parser of untrusted input
//! and then uses the result the way kiln does, so code behind the parser
//! (accessors, dequantization, config resolution, plan validation, the IR
//! printer) is fuzzed too.
//!
//! A target returns [`Outcome::Accepted`] when the whole path accepted the
//! input, [`Outcome::Rejected`] when some stage refused it with an error
//! (the expected result for almost every mutated input), and
//! [`Outcome::Finding`] when an oracle beyond "no panic" broke: the IR
//! printer wrote text its own parser refuses, or a round trip changed the
//! graph. Panics are caught by the runner, not here.
//!
//! Every error is rendered with `to_string()`, so a panicking or
//! unbounded `Display` is found as well.
//!
//! Not here: parsers that need a file system (`GgufFile::open` maps a file;
//! the fuzzer uses `from_bytes`, the same parser), and the HTTP framing
//! itself (hyper's; kiln's code starts at the request body), and the
//! tokenizer and chat template a served request then goes through (they
//! need a model directory).

use kiln_compiler::config::HfConfig;
use kiln_compiler::frontend::Family;
use kiln_compiler::gguf::{dequant, permute, GgufFile, ValueType};
use kiln_compiler::{import, safetensors_header, tokenizer_build};
use kiln_ir::artifact;
use kiln_runtime::backend::DeviceInfo;
use kiln_runtime::loader;
use std::hint::black_box;
use std::path::Path;

use crate::mutate::Shape;

/// What one input did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Accepted,
    Rejected,
    /// An oracle other than "no panic" broke; the text says which.
    Finding(String),
}

/// A parser of untrusted input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// `GgufFile::from_bytes`, then metadata, hyperparameters, tensor
    /// table, dequantization and q/k un-permutation of small tensors, and
    /// the tokenizer built from the metadata.
    Gguf,
    /// The safetensors header reader over a whole file image (length
    /// prefix, JSON, every entry against the data section), and the
    /// `safetensors` crate's parser the runtime's weight binder uses.
    Safetensors,
    /// `HfConfig::from_json`, the frontend's family choice and
    /// `Family::resolve` (HF defaults, family specifics, limits).
    Config,
    /// `kiln_ir::artifact::decode`, then the runtime loader's checks
    /// (`validate_plan`, kernel ABI, target).
    Plan,
    /// `kiln_ir::parse_and_verify`; on success print, parse again, and
    /// require the same text and a graph that still verifies.
    Ir,
    /// `kiln serve`'s request bodies: `api::parse_body`, then both
    /// endpoints' validation (`completion_request`, `chat_request`); an
    /// accepted request's fields are read back.
    Http,
}

impl Target {
    pub const ALL: [Target; 6] = [
        Target::Gguf,
        Target::Safetensors,
        Target::Config,
        Target::Plan,
        Target::Ir,
        Target::Http,
    ];

    pub fn name(self) -> &'static str {
        crate::alloc::TARGET_NAMES[self.index()]
    }

    pub fn index(self) -> usize {
        match self {
            Target::Gguf => 0,
            Target::Safetensors => 1,
            Target::Config => 2,
            Target::Plan => 3,
            Target::Ir => 4,
            Target::Http => 5,
        }
    }

    pub fn from_name(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == name)
    }

    pub fn shape(self) -> Shape {
        match self {
            Target::Gguf => Shape::Binary,
            Target::Safetensors => Shape::Safetensors,
            Target::Config | Target::Ir | Target::Http => Shape::Text,
            Target::Plan => Shape::Plan,
        }
    }

    /// Runs one input.
    pub fn run(self, input: &[u8]) -> Outcome {
        match self {
            Target::Gguf => gguf(input),
            Target::Safetensors => safetensors(input),
            Target::Config => config(input),
            Target::Plan => plan(input),
            Target::Ir => ir(input),
            Target::Http => http(input),
        }
    }
}

/// Renders an error (its `Display` is part of what is fuzzed) and rejects.
fn reject(e: impl std::fmt::Display) -> Outcome {
    black_box(e.to_string());
    Outcome::Rejected
}

/// Tensors up to this many elements are dequantized (the import converts
/// every tensor; the fuzzer keeps each input's work small).
const DEQUANT_ELEMENTS: u64 = 1 << 16;

fn gguf(input: &[u8]) -> Outcome {
    let g = match GgufFile::from_bytes(input.to_vec()) {
        Ok(g) => g,
        Err(e) => return reject(e),
    };
    black_box(format!("{g:?}"));
    for (key, v) in g.metadata() {
        black_box((key.len(), v.describe(), v.value_type()));
        black_box((v.as_u64(), v.as_i64(), v.as_f64(), v.as_bool()));
        black_box((v.as_str().map(str::len), v.as_array().map(<[_]>::len)));
    }
    let mut ok = true;
    // The hyperparameters as the importer reads them.
    let arch = match g.get_str("general.architecture") {
        Ok(a) => a.unwrap_or("llama").to_string(),
        Err(e) => {
            black_box(e.to_string());
            ok = false;
            "llama".to_string()
        }
    };
    let mut heads = None;
    let mut kv_heads = None;
    for key in [
        "embedding_length",
        "feed_forward_length",
        "block_count",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.key_length",
        "context_length",
        "rope.dimension_count",
        "vocab_size",
    ] {
        match g.get_u64(&format!("{arch}.{key}")) {
            Ok(v) if key == "attention.head_count" => heads = v,
            Ok(v) if key == "attention.head_count_kv" => kv_heads = v,
            Ok(_) => {}
            Err(e) => {
                black_box(e.to_string());
                ok = false;
            }
        }
    }
    for key in ["attention.layer_norm_rms_epsilon", "rope.freq_base"] {
        if let Err(e) = g.get_f64(&format!("{arch}.{key}")) {
            black_box(e.to_string());
            ok = false;
        }
    }
    for (key, elem) in [
        ("tokenizer.ggml.tokens", ValueType::String),
        ("tokenizer.ggml.merges", ValueType::String),
        ("tokenizer.ggml.token_type", ValueType::I32),
    ] {
        if let Err(e) = g.require_array(key, elem, "is read by the tokenizer builder") {
            black_box(e.to_string());
            ok = false;
        }
    }
    if let Err(e) = g.get_bool("tokenizer.ggml.add_bos_token") {
        black_box(e.to_string());
    }
    // The tensor table, and the conversion import does, on small tensors.
    for t in g.tensors() {
        black_box((t.shape(), g.tensor_bytes(t).len()));
        black_box(import::hf_tensor_name(&t.name));
        if t.n_elements > DEQUANT_ELEMENTS || !dequant::is_supported(t.ggml_type) {
            continue;
        }
        let values = match g.dequantize(&t.name) {
            Ok(v) => v,
            Err(e) => {
                black_box(e.to_string());
                ok = false;
                continue;
            }
        };
        let h = if t.name.ends_with("attn_q.weight") {
            heads
        } else if t.name.ends_with("attn_k.weight") {
            kv_heads.or(heads)
        } else {
            None
        };
        if let (Some(h), [rows, cols]) = (h, t.shape().as_slice()) {
            let un = permute::unpermute_rows(&values, *rows as usize, *cols as usize, h as usize);
            match un {
                Ok(v) => {
                    black_box(v.len());
                }
                Err(e) => {
                    black_box(e.to_string());
                    ok = false;
                }
            }
        }
    }
    match tokenizer_build::build_tokenizer(&g, Some(512)) {
        Ok(t) => {
            black_box((t.tokenizer_json.len(), t.vocab_size));
        }
        Err(e) => {
            black_box(e.to_string());
            ok = false;
        }
    }
    if ok {
        Outcome::Accepted
    } else {
        Outcome::Rejected
    }
}

fn safetensors(input: &[u8]) -> Outcome {
    // The runtime binds weights with the `safetensors` crate; its parser
    // sees the same bytes.
    match safetensors::SafeTensors::deserialize(input) {
        Ok(st) => {
            for (name, view) in st.tensors() {
                black_box((name.len(), view.shape().len(), view.data().len()));
            }
        }
        Err(e) => {
            black_box(e.to_string());
        }
    }
    match safetensors_header::parse_bytes(Path::new("fuzz.safetensors"), input) {
        Ok(h) => {
            for t in h.tensors.values() {
                black_box((t.numel(), t.dtype.to_ir()));
            }
            black_box(h.data_len());
            Outcome::Accepted
        }
        Err(e) => reject(e),
    }
}

/// The family `kiln_compiler::frontend::open` picks for a config: the first
/// known `architectures` entry, else `model_type`.
fn pick_family(raw: &HfConfig) -> Option<Family> {
    match &raw.architectures {
        Some(archs) if !archs.is_empty() => archs.iter().find_map(|a| Family::from_architecture(a)),
        _ => raw.model_type.as_deref().and_then(Family::from_model_type),
    }
}

fn config(input: &[u8]) -> Outcome {
    // The frontend reads config.json with `read_to_string`: UTF-8 or refused.
    let Ok(text) = std::str::from_utf8(input) else {
        return Outcome::Rejected;
    };
    let raw = match HfConfig::from_json(text) {
        Ok(r) => r,
        Err(e) => return reject(e),
    };
    let Some(family) = pick_family(&raw) else {
        black_box(Family::supported_list());
        return Outcome::Rejected;
    };
    let cfg = match family.resolve(&raw) {
        Ok(c) => c,
        Err(e) => return reject(e),
    };
    // Every table the tracer sizes from the config is per layer or per
    // head: touch them so a resolved config that claims more than it holds
    // shows up here.
    black_box((
        cfg.windows.len(),
        cfg.eos_token_ids.len(),
        format!("{cfg:?}").len(),
    ));
    Outcome::Accepted
}

fn plan(input: &[u8]) -> Outcome {
    let plan = match artifact::decode(input) {
        Ok(p) => p,
        Err(e) => return reject(e),
    };
    if let Err(e) = loader::validate_plan(&plan) {
        return reject(e);
    }
    if let Err(e) = loader::check_kernel_abi(&plan) {
        return reject(e);
    }
    let cpu = DeviceInfo {
        backend: "cpu",
        ordinal: 0,
        name: "cpu".into(),
        arch: std::env::consts::ARCH.into(),
    };
    if let Err(e) = loader::check_target(&plan.meta.target, &cpu) {
        return reject(e);
    }
    Outcome::Accepted
}

fn ir(input: &[u8]) -> Outcome {
    let Ok(text) = std::str::from_utf8(input) else {
        return Outcome::Rejected;
    };
    let (g, _info) = match kiln_ir::parse_and_verify(text, None) {
        Ok(x) => x,
        Err(e) => return reject(e),
    };
    let printed = kiln_ir::print(&g);
    black_box(kiln_ir::to_dot(&g).len());
    let again = match kiln_ir::parse_and_verify(&printed, None) {
        Ok((g2, _)) => g2,
        Err(e) => {
            return Outcome::Finding(format!(
                "a verified graph printed to text its parser refuses: {e}"
            ))
        }
    };
    let reprinted = kiln_ir::print(&again);
    if reprinted != printed {
        return Outcome::Finding(
            "print(parse(print(g))) differs from print(g): the text format loses information"
                .into(),
        );
    }
    Outcome::Accepted
}

fn http(input: &[u8]) -> Outcome {
    use kiln_serve::api;
    let m = match api::parse_body(input) {
        Ok(m) => m,
        Err(e) => return reject(e.body()),
    };
    let mut accepted = false;
    for r in [api::completion_request(&m, 7), api::chat_request(&m, 7)] {
        match r {
            Ok(r) => {
                accepted = true;
                black_box(format!("{r:?}"));
                black_box((r.needs_logits(), r.max_tokens, r.stop.len()));
            }
            Err(e) => {
                if e.status != 400 {
                    return Outcome::Finding(format!(
                        "a request body was refused with status {} (validation answers 400): {}",
                        e.status, e.message
                    ));
                }
                black_box(e.body().to_string());
            }
        }
    }
    if accepted {
        Outcome::Accepted
    } else {
        Outcome::Rejected
    }
}
