//! Building a Hugging Face `tokenizer.json` from a GGUF file's vocabulary.
//!
//! A GGUF carries its tokenizer as metadata: `tokenizer.ggml.tokens`,
//! `.merges`, `.token_type`, the special token ids, and `tokenizer.ggml.pre`
//! naming the pre-tokenizer llama.cpp applies. This module turns that into
//! the JSON the `tokenizers` crate (and Python `transformers`) loads, then
//! loads it with the `tokenizers` crate to prove it is valid before anyone
//! writes it to disk.
//!
//! Supported:
//! - byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`) with the
//!   pre-tokenizers of the GPT-2, SmolLM/StarCoder, Llama-3 and Qwen2
//!   families;
//! - SentencePiece BPE vocabularies with scores (`"llama"`: Llama 2,
//!   Mistral, Gemma). They become a `tokenizers` BPE model: the merges are
//!   every split of a normal token into two vocabulary tokens, ranked by the
//!   merged token's score (SentencePiece merges the adjacent pair whose
//!   concatenation scores highest, which is the same order); characters
//!   outside the vocabulary fall back to the `<0xNN>` byte tokens; spaces
//!   become `▁`, and `tokenizer.ggml.add_space_prefix` (default true, false
//!   for Gemma) prepends one to each text segment, as llama.cpp does.
//!
//! Special tokens and `add_bos`/`add_eos` come from the metadata for both.
//! Deliberately not supported: unigram (`"t5"`), WordPiece (`"bert"`) and
//! RWKV vocabularies; each is a clear error.

use crate::gguf::{GgufError, GgufFile, MetaValue, ValueType};
use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::str::FromStr;

/// GGUF token types (llama.cpp's `llama_token_type`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizerBuildError {
    #[error(transparent)]
    Gguf(#[from] GgufError),

    #[error(
        "tokenizer.ggml.model is {model:?}; kiln import builds byte-level BPE (\"gpt2\") \
         and SentencePiece BPE (\"llama\") vocabularies, not unigram (\"t5\"), \
         WordPiece (\"bert\"), RWKV (\"rwkv\") or others"
    )]
    UnsupportedModel { model: String },

    #[error("tokenizer.ggml.scores has {scores} entries but tokenizer.ggml.tokens has {tokens}")]
    ScoresLength { tokens: usize, scores: usize },

    #[error("token {id} is marked as a byte token but is {token:?}, not <0xNN>")]
    BadByteToken { id: usize, token: String },

    #[error(
        "tokenizer.ggml.pre is {pre:?}, a pre-tokenizer kiln does not know; supported: {known}"
    )]
    UnsupportedPre { pre: String, known: String },

    #[error("token {token:?} appears twice in tokenizer.ggml.tokens, as ids {first} and {second}")]
    DuplicateToken {
        token: String,
        first: usize,
        second: usize,
    },

    #[error("merge #{index} {merge:?} is not two tokens separated by one space")]
    BadMerge { index: usize, merge: String },

    #[error(
        "tokenizer.ggml.token_type has {types} entries but tokenizer.ggml.tokens has {tokens}"
    )]
    TokenTypeLength { tokens: usize, types: usize },

    #[error("{key} is {id}, outside the vocabulary of {vocab} tokens")]
    BadTokenId { key: String, id: u64, vocab: usize },

    #[error("the tokenizer.json built from this GGUF does not load: {reason}")]
    Load { reason: String },

    #[error("the tokenizer built from this GGUF {problem}")]
    Check { problem: String },
}

/// How llama.cpp splits text before BPE, by `tokenizer.ggml.pre` family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// GPT-2's regex (`'s|'t|... ?\p{L}+| ?\p{N}+|...`), applied by the
    /// byte-level pre-tokenizer itself.
    Gpt2,
    /// Every digit on its own, then GPT-2's regex (SmolLM, StarCoder).
    DigitsThenGpt2,
    /// The Llama-3 / cl100k regex (numbers in groups of up to three).
    Llama3,
    /// Qwen2's regex (single digits, no leading space on letters).
    Qwen2,
}

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.pre` values and the family each belongs to; the names
/// are llama.cpp's.
const PRE_TOKENIZERS: &[(&str, PreTokenizer)] = &[
    ("default", PreTokenizer::Gpt2),
    ("gpt-2", PreTokenizer::Gpt2),
    ("gpt2", PreTokenizer::Gpt2),
    ("mpt", PreTokenizer::Gpt2),
    ("olmo", PreTokenizer::Gpt2),
    ("jais", PreTokenizer::Gpt2),
    ("smollm", PreTokenizer::DigitsThenGpt2),
    ("starcoder", PreTokenizer::DigitsThenGpt2),
    ("refact", PreTokenizer::DigitsThenGpt2),
    ("command-r", PreTokenizer::DigitsThenGpt2),
    ("codeshell", PreTokenizer::DigitsThenGpt2),
    ("exaone", PreTokenizer::DigitsThenGpt2),
    ("minerva-7b", PreTokenizer::DigitsThenGpt2),
    ("llama-bpe", PreTokenizer::Llama3),
    ("llama3", PreTokenizer::Llama3),
    ("llama-v3", PreTokenizer::Llama3),
    ("falcon3", PreTokenizer::Llama3),
    ("dbrx", PreTokenizer::Llama3),
    ("smaug-bpe", PreTokenizer::Llama3),
    ("qwen2", PreTokenizer::Qwen2),
    ("deepseek-r1-qwen", PreTokenizer::Qwen2),
];

impl PreTokenizer {
    /// The family `tokenizer.ggml.pre` names. A file without the key gets
    /// llama.cpp's fallback, GPT-2's regex.
    pub fn from_gguf_name(pre: Option<&str>) -> Result<PreTokenizer, TokenizerBuildError> {
        let pre = pre.unwrap_or("default");
        PRE_TOKENIZERS
            .iter()
            .find(|(name, _)| *name == pre)
            .map(|&(_, p)| p)
            .ok_or_else(|| TokenizerBuildError::UnsupportedPre {
                pre: pre.to_string(),
                known: PRE_TOKENIZERS
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    fn to_json(self) -> Value {
        let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
        let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
        match self {
            PreTokenizer::Gpt2 => byte_level(true),
            PreTokenizer::DigitsThenGpt2 => json!({
                "type": "Sequence",
                "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)],
            }),
            PreTokenizer::Llama3 => json!({
                "type": "Sequence",
                "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)],
            }),
            PreTokenizer::Qwen2 => json!({
                "type": "Sequence",
                "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)],
            }),
        }
    }

    /// Llama-3 style vocabularies look whole words up before merging.
    fn ignore_merges(self) -> bool {
        self == PreTokenizer::Llama3
    }
}

/// The vocabulary kinds `tokenizer.ggml.model` names that kiln builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// `"gpt2"`: byte-level BPE with explicit merges.
    ByteLevelBpe,
    /// `"llama"`: SentencePiece BPE with scores and byte fallback.
    SentencePiece,
}

/// SentencePiece's visible space.
const SPACE: &str = "\u{2581}";

/// The byte token `<0xNN>` of byte `b`.
fn byte_token(b: u8) -> String {
    format!("<0x{b:02X}>")
}

/// The byte a `<0xNN>` token stands for.
fn byte_token_value(tok: &str) -> Option<u8> {
    let hex = tok.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// BPE merges equivalent to SentencePiece's score-ordered merging: every
/// split of a normal token into two normal tokens, ranked by the merged
/// token's score (highest first), ties by the ids of the left and right
/// parts. Control, user-defined, byte and unused tokens are never built by
/// merging.
fn sentencepiece_merges<'a>(
    tokens: &[&'a str],
    types: &[i32],
    scores: &[f64],
    ids: &HashMap<&str, usize>,
) -> Vec<[&'a str; 2]> {
    let normal = |id: usize| types[id] == token_type::NORMAL;
    let mut ranked: Vec<(f64, usize, usize, [&'a str; 2])> = Vec::new();
    for (id, &tok) in tokens.iter().enumerate() {
        if !normal(id) {
            continue;
        }
        for (at, _) in tok.char_indices().skip(1) {
            let (l, r) = tok.split_at(at);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) {
                if normal(li) && normal(ri) {
                    ranked.push((scores[id], li, ri, [l, r]));
                }
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    ranked.into_iter().map(|(_, _, _, m)| m).collect()
}

/// Special token ids read from the GGUF (`tokenizer.ggml.*_token_id`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
}

/// Everything `kiln import` writes about the tokenizer.
#[derive(Debug)]
pub struct BuiltTokenizer {
    /// The `tokenizer.json` text, already proven to load.
    pub tokenizer_json: String,
    /// The `tokenizer_config.json` object (special tokens, chat template).
    pub tokenizer_config: Value,
    pub special: SpecialIds,
    pub add_bos: bool,
    pub add_eos: bool,
    pub vocab_size: usize,
    pub kind: TokenizerKind,
    /// The byte-level pre-tokenizer; `None` for SentencePiece.
    pub pre: Option<PreTokenizer>,
    /// SentencePiece only: a `▁` is prepended to each text segment.
    pub add_space_prefix: bool,
    /// Ids of control/unknown tokens, emitted as special added tokens.
    pub special_token_ids: Vec<u32>,
}

/// The vocabulary, serialized as a JSON object in id order.
struct Vocab<'a>(&'a [String]);

impl Serialize for Vocab<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (id, tok) in self.0.iter().enumerate() {
            map.serialize_entry(tok, &id)?;
        }
        map.end()
    }
}

#[derive(Serialize)]
struct BpeModel<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    dropout: Option<f32>,
    unk_token: Option<String>,
    continuing_subword_prefix: Option<String>,
    end_of_word_suffix: Option<String>,
    fuse_unk: bool,
    byte_fallback: bool,
    ignore_merges: bool,
    vocab: Vocab<'a>,
    merges: Vec<[&'a str; 2]>,
}

#[derive(Serialize)]
struct AddedToken<'a> {
    id: u32,
    content: &'a str,
    single_word: bool,
    lstrip: bool,
    rstrip: bool,
    normalized: bool,
    special: bool,
}

#[derive(Serialize)]
struct TokenizerJson<'a> {
    version: &'static str,
    truncation: Option<Value>,
    padding: Option<Value>,
    added_tokens: Vec<AddedToken<'a>>,
    normalizer: Option<Value>,
    pre_tokenizer: Value,
    post_processor: Value,
    decoder: Value,
    model: BpeModel<'a>,
}

fn strings<'a>(
    gguf: &'a GgufFile,
    key: &str,
    why: &str,
) -> Result<Vec<&'a str>, TokenizerBuildError> {
    let items = gguf.require_array(key, ValueType::String, why)?;
    Ok(items.iter().filter_map(MetaValue::as_str).collect())
}

fn token_id(gguf: &GgufFile, key: &str, vocab: usize) -> Result<Option<u32>, TokenizerBuildError> {
    match gguf.get_u64(key)? {
        None => Ok(None),
        Some(id) if id < vocab as u64 => Ok(Some(id as u32)),
        Some(id) => Err(TokenizerBuildError::BadTokenId {
            key: key.to_string(),
            id,
            vocab,
        }),
    }
}

/// Builds and validates the tokenizer a GGUF file describes.
/// `model_max_length` goes into `tokenizer_config.json`.
pub fn build_tokenizer(
    gguf: &GgufFile,
    model_max_length: Option<u64>,
) -> Result<BuiltTokenizer, TokenizerBuildError> {
    let model = gguf.require_str(
        "tokenizer.ggml.model",
        "names the tokenizer kind and is needed to build tokenizer.json",
    )?;
    let kind = match model {
        "gpt2" => TokenizerKind::ByteLevelBpe,
        "llama" => TokenizerKind::SentencePiece,
        _ => {
            return Err(TokenizerBuildError::UnsupportedModel {
                model: model.to_string(),
            })
        }
    };
    let spm = kind == TokenizerKind::SentencePiece;
    let pre = match kind {
        TokenizerKind::ByteLevelBpe => Some(PreTokenizer::from_gguf_name(
            gguf.get_str("tokenizer.ggml.pre")?,
        )?),
        TokenizerKind::SentencePiece => None,
    };
    let tokens = strings(gguf, "tokenizer.ggml.tokens", "holds the vocabulary")?;
    let merges_raw = if spm {
        Vec::new()
    } else {
        strings(
            gguf,
            "tokenizer.ggml.merges",
            "holds the BPE merges of a byte-level vocabulary",
        )?
    };
    let types: Vec<i32> = match gguf.get("tokenizer.ggml.token_type") {
        None => vec![token_type::NORMAL; tokens.len()],
        Some(_) => gguf
            .require_array("tokenizer.ggml.token_type", ValueType::I32, "")?
            .iter()
            .map(|v| v.as_i64().unwrap_or(0) as i32)
            .collect(),
    };
    if types.len() != tokens.len() {
        return Err(TokenizerBuildError::TokenTypeLength {
            tokens: tokens.len(),
            types: types.len(),
        });
    }

    let mut seen: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
    for (id, tok) in tokens.iter().enumerate() {
        if let Some(first) = seen.insert(tok, id) {
            return Err(TokenizerBuildError::DuplicateToken {
                token: tok.to_string(),
                first,
                second: id,
            });
        }
    }

    let merges = if spm {
        let scores: Vec<f64> = gguf
            .require_array(
                "tokenizer.ggml.scores",
                ValueType::F32,
                "ranks the merges of a SentencePiece vocabulary",
            )?
            .iter()
            .map(|v| v.as_f64().unwrap_or(f64::NEG_INFINITY))
            .collect();
        if scores.len() != tokens.len() {
            return Err(TokenizerBuildError::ScoresLength {
                tokens: tokens.len(),
                scores: scores.len(),
            });
        }
        for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
            if ty == token_type::BYTE && byte_token_value(tok).is_none() {
                return Err(TokenizerBuildError::BadByteToken {
                    id,
                    token: tok.to_string(),
                });
            }
        }
        sentencepiece_merges(&tokens, &types, &scores, &seen)
    } else {
        let mut merges = Vec::with_capacity(merges_raw.len());
        for (index, m) in merges_raw.iter().enumerate() {
            match m.split_once(' ') {
                Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains(' ') => {
                    merges.push([a, b])
                }
                _ => {
                    return Err(TokenizerBuildError::BadMerge {
                        index,
                        merge: m.to_string(),
                    })
                }
            }
        }
        merges
    };
    let add_space_prefix = spm
        && gguf
            .get_bool("tokenizer.ggml.add_space_prefix")?
            .unwrap_or(true);
    let byte_fallback_complete = (0..=255u8).all(|b| seen.contains_key(byte_token(b).as_str()));

    let n = tokens.len();
    let special = SpecialIds {
        bos: token_id(gguf, "tokenizer.ggml.bos_token_id", n)?,
        eos: token_id(gguf, "tokenizer.ggml.eos_token_id", n)?,
        unk: token_id(gguf, "tokenizer.ggml.unknown_token_id", n)?,
        pad: token_id(gguf, "tokenizer.ggml.padding_token_id", n)?,
    };
    let add_bos = gguf
        .get_bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(false);
    let add_eos = gguf
        .get_bool("tokenizer.ggml.add_eos_token")?
        .unwrap_or(false);

    // Control and unknown tokens are special: matched whole in input text
    // and skipped when decoding with skip_special_tokens. User-defined
    // tokens are matched whole but decoded like text.
    let mut added = Vec::new();
    let mut special_token_ids = Vec::new();
    for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        let is_special = ty == token_type::CONTROL || ty == token_type::UNKNOWN;
        if is_special || ty == token_type::USER_DEFINED {
            added.push(AddedToken {
                id: id as u32,
                content: tok,
                single_word: false,
                lstrip: false,
                rstrip: false,
                normalized: false,
                special: is_special,
            });
            if is_special {
                special_token_ids.push(id as u32);
            }
        }
    }

    let post_processor = post_processor(kind, &tokens, &special, add_bos, add_eos);
    let (normalizer, pre_tokenizer, decoder) = match pre {
        Some(pre) => (
            None,
            pre.to_json(),
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
        ),
        None => {
            let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": SPACE});
            let normalizer = if add_space_prefix {
                json!({"type": "Sequence", "normalizers": [
                    {"type": "Prepend", "prepend": SPACE}, replace]})
            } else {
                replace
            };
            let mut decoders = vec![
                json!({"type": "Replace", "pattern": {"String": SPACE}, "content": " "}),
                json!({"type": "ByteFallback"}),
                json!({"type": "Fuse"}),
            ];
            if add_space_prefix {
                decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
            }
            (
                Some(normalizer),
                Value::Null,
                json!({"type": "Sequence", "decoders": decoders}),
            )
        }
    };
    let doc = TokenizerJson {
        version: "1.0",
        truncation: None,
        padding: None,
        added_tokens: added,
        normalizer,
        pre_tokenizer,
        post_processor,
        decoder,
        model: BpeModel {
            kind: "BPE",
            dropout: None,
            unk_token: special
                .unk
                .filter(|_| spm)
                .map(|id| tokens[id as usize].to_string()),
            continuing_subword_prefix: None,
            end_of_word_suffix: None,
            fuse_unk: spm,
            byte_fallback: spm,
            ignore_merges: pre.is_some_and(PreTokenizer::ignore_merges),
            vocab: Vocab(
                // Owned copies keep the serializer simple; the vocabulary is
                // at most a few MB.
                &tokens.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            ),
            merges,
        },
    };
    let tokenizer_json =
        serde_json::to_string_pretty(&doc).map_err(|e| TokenizerBuildError::Load {
            reason: format!("cannot serialize: {e}"),
        })?;
    check_loads(&tokenizer_json, n, !spm || byte_fallback_complete)?;

    let name = |id: Option<u32>| id.map(|i| tokens[i as usize].to_string());
    let mut decoder = serde_json::Map::new();
    for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        let is_special = ty == token_type::CONTROL || ty == token_type::UNKNOWN;
        if is_special || ty == token_type::USER_DEFINED {
            decoder.insert(
                id.to_string(),
                json!({"content": tok, "lstrip": false, "normalized": false,
                       "rstrip": false, "single_word": false, "special": is_special}),
            );
        }
    }
    let mut config = json!({
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "added_tokens_decoder": decoder,
        "bos_token": name(special.bos),
        "eos_token": name(special.eos),
        "unk_token": name(special.unk),
        "pad_token": name(special.pad),
        "clean_up_tokenization_spaces": false,
        "tokenizer_class": if spm { "PreTrainedTokenizerFast" } else { "GPT2Tokenizer" },
    });
    if let Some(len) = model_max_length {
        config["model_max_length"] = json!(len);
    }
    if let Some(template) = gguf.get_str("tokenizer.chat_template")? {
        config["chat_template"] = json!(template);
    }

    Ok(BuiltTokenizer {
        tokenizer_json,
        tokenizer_config: config,
        special,
        add_bos,
        add_eos,
        vocab_size: n,
        kind,
        pre,
        add_space_prefix,
        special_token_ids,
    })
}

/// A template adding BOS/EOS when the GGUF asks for them, otherwise the
/// byte-level post-processor Hugging Face byte-level tokenizers carry.
fn post_processor(
    kind: TokenizerKind,
    tokens: &[&str],
    special: &SpecialIds,
    add_bos: bool,
    add_eos: bool,
) -> Value {
    let bos = special.bos.filter(|_| add_bos);
    let eos = special.eos.filter(|_| add_eos);
    if bos.is_none() && eos.is_none() {
        if kind == TokenizerKind::SentencePiece {
            return Value::Null;
        }
        return json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true});
    }
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = serde_json::Map::new();
    let tok = |id: u32| json!({"SpecialToken": {"id": tokens[id as usize], "type_id": 0}});
    for id in [bos, eos].into_iter().flatten() {
        let t = tokens[id as usize];
        specials.insert(t.to_string(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    if let Some(b) = bos {
        single.push(tok(b));
        pair.push(tok(b));
    }
    single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    pair.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    if let Some(e) = eos {
        single.push(tok(e));
        pair.push(tok(e));
    }
    if let Some(b) = bos {
        pair.push(json!({"SpecialToken": {"id": tokens[b as usize], "type_id": 1}}));
    }
    pair.push(json!({"Sequence": {"id": "B", "type_id": 1}}));
    if let Some(e) = eos {
        pair.push(json!({"SpecialToken": {"id": tokens[e as usize], "type_id": 1}}));
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
}

/// Loads the JSON with the `tokenizers` crate and checks the vocabulary
/// size and (where every byte is representable: always for byte-level
/// BPE, with all 256 byte tokens for SentencePiece) a round trip, so a
/// broken file is never written.
fn check_loads(text: &str, vocab: usize, round_trip: bool) -> Result<(), TokenizerBuildError> {
    let tok = tokenizers::Tokenizer::from_str(text).map_err(|e| TokenizerBuildError::Load {
        reason: e.to_string(),
    })?;
    let got = tok.get_vocab_size(true);
    if got != vocab {
        return Err(TokenizerBuildError::Check {
            problem: format!("has {got} tokens where the GGUF lists {vocab}"),
        });
    }
    if !round_trip {
        return Ok(());
    }
    let probe = "kiln import: héllo wörld 123 ✓\n\tend";
    let ids = tok
        .encode(probe, false)
        .map_err(|e| TokenizerBuildError::Check {
            problem: format!("cannot encode a probe string: {e}"),
        })?
        .get_ids()
        .to_vec();
    let back = tok
        .decode(&ids, false)
        .map_err(|e| TokenizerBuildError::Check {
            problem: format!("cannot decode a probe string: {e}"),
        })?;
    if back != probe {
        return Err(TokenizerBuildError::Check {
            problem: format!("does not round-trip a probe string: {probe:?} came back as {back:?}"),
        });
    }
    Ok(())
}
