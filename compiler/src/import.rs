//! `kiln import`: a GGUF file → a Hugging Face style model directory
//! (`config.json`, `model.safetensors`, `tokenizer.json`,
//! `tokenizer_config.json`, `generation_config.json`) that kiln's frontend
//! compiles like any other checkpoint.
//!
//! Architectures (`general.architecture`): `llama` (Llama 2, 3, 3.1, 3.2,
//! SmolLM2; Mistral files converted as llama), `mistral`, `qwen2` (Qwen2 and
//! Qwen2.5), `qwen3` and `gemma3`. Each writes the config.json its Hugging
//! Face class reads (see [`GgufArch`]).
//!
//! On the way every tensor is dequantized to f32 (see `gguf::dequant`),
//! GGML's reversed dims become `[out, in]`, and the values are stored as
//! bf16. With `--keep-quant` ([`ImportOptions::keep_quant`]) the 2-D
//! weights of a block type kiln's kernels read are instead written as
//! stored: `U8 [N, row_bytes]` plus `__metadata__["kiln.quant.<tensor>"] =
//! "<storage>:<N>:<K>"`, the format the frontend reads
//! (`frontend::QUANT_META_PREFIX`). The writer is kiln's own streaming one
//! (one tensor in memory at a time), not the safetensors crate's, which
//! needs every tensor's bytes at once. Two things llama.cpp's converter did to the weights are undone:
//! - `attn_q`/`attn_k` rows are put back into Hugging Face's rotate-half
//!   order (see `gguf::permute`) for llama and mistral only; llama.cpp
//!   permutes only those (Qwen and Gemma use NEOX-style RoPE, unpermuted).
//!   A kept-quant tensor's rows move the same way: blocks lie inside rows.
//! - Gemma-3's RMSNorm scales by `1 + w`; llama.cpp's converter stores
//!   `w + 1` in every `*norm.weight` tensor (`Gemma3Model.norm_shift`) so
//!   that its plain RMSNorm applies. kiln subtracts the 1 again, so the
//!   written weights mean what Hugging Face's Gemma-3 checkpoint means.
//!
//! Llama-3.1/3.2 files carry `rope_freqs.weight`, the per-frequency divisors
//! of llama3 RoPE scaling; the importer writes the `rope_scaling` they
//! encode after checking every entry against the llama3 formula.
//!
//! The directory is assembled under a temporary name beside the destination
//! and renamed into place, so a failed import never leaves a half-written
//! model behind; what a killed import left there is cleaned by the next
//! import into the same place (see [`crate::staging`]).
//!
//! Deliberately not supported, each a clear error: other architectures,
//! RoPE scaling other than llama3 (`rope_freqs`) and linear, partial
//! rotary dimensions, and tensors this mapping does not know.

use crate::gguf::dequant;
use crate::gguf::permute::{self, PermuteError};
use crate::gguf::{GgmlType, GgufError, GgufFile, TensorInfo};
use crate::staging::{self, Staging, StagingError, Sweep};
use crate::tokenizer_build::{self, TokenizerBuildError};
use half::bf16;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// The weights file `kiln import` writes.
pub const WEIGHTS_FILE: &str = "model.safetensors";

/// A `general.architecture` kiln import converts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgufArch {
    /// `llama`: Llama 2/3/3.1/3.2, SmolLM2, and Mistral files llama.cpp
    /// converted as llama. → `LlamaForCausalLM`.
    Llama,
    /// `mistral` → `MistralForCausalLM` (sliding window when the file has one).
    Mistral,
    /// `qwen2`: Qwen2 and Qwen2.5, q/k/v bias. → `Qwen2ForCausalLM`.
    Qwen2,
    /// `qwen3`: per-head q/k RMSNorm. → `Qwen3ForCausalLM`.
    Qwen3,
    /// `gemma3`: text-only Gemma-3. → `Gemma3ForCausalLM` / `gemma3_text`.
    Gemma3,
}

impl GgufArch {
    pub const ALL: [GgufArch; 5] = [
        GgufArch::Llama,
        GgufArch::Mistral,
        GgufArch::Qwen2,
        GgufArch::Qwen3,
        GgufArch::Gemma3,
    ];

    /// The `general.architecture` value (also the metadata key prefix).
    pub fn gguf_name(self) -> &'static str {
        match self {
            GgufArch::Llama => "llama",
            GgufArch::Mistral => "mistral",
            GgufArch::Qwen2 => "qwen2",
            GgufArch::Qwen3 => "qwen3",
            GgufArch::Gemma3 => "gemma3",
        }
    }

    pub fn from_gguf_name(name: &str) -> Option<GgufArch> {
        GgufArch::ALL.into_iter().find(|a| a.gguf_name() == name)
    }

    /// The Hugging Face `architectures[0]` written to config.json.
    pub fn hf_architecture(self) -> &'static str {
        match self {
            GgufArch::Llama => "LlamaForCausalLM",
            GgufArch::Mistral => "MistralForCausalLM",
            GgufArch::Qwen2 => "Qwen2ForCausalLM",
            GgufArch::Qwen3 => "Qwen3ForCausalLM",
            GgufArch::Gemma3 => "Gemma3ForCausalLM",
        }
    }

    /// The Hugging Face `model_type` written to config.json.
    pub fn hf_model_type(self) -> &'static str {
        match self {
            GgufArch::Llama => "llama",
            GgufArch::Mistral => "mistral",
            GgufArch::Qwen2 => "qwen2",
            GgufArch::Qwen3 => "qwen3",
            GgufArch::Gemma3 => "gemma3_text",
        }
    }

    /// Whether llama.cpp's converter permuted the q/k rows of this family.
    pub fn qk_permuted(self) -> bool {
        matches!(self, GgufArch::Llama | GgufArch::Mistral)
    }

    /// The supported list, for error messages.
    pub fn supported_list() -> &'static str {
        "llama (Llama 2, 3, 3.1, 3.2, SmolLM2), mistral, qwen2 (Qwen2, Qwen2.5), qwen3, gemma3"
    }
}

impl fmt::Display for GgufArch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.gguf_name())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error(transparent)]
    Gguf(#[from] GgufError),

    #[error("cannot build the tokenizer: {0}")]
    Tokenizer(#[from] TokenizerBuildError),

    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "general.architecture is {arch:?}, which kiln import does not convert; supported: {}. \
         Not supported: every other architecture (e.g. gemma, gemma2, phi3, qwen2moe, qwen3moe, \
         deepseek2, mixtral-style MoE)",
        GgufArch::supported_list()
    )]
    UnsupportedArchitecture { arch: String },

    #[error("this GGUF uses {feature}, which kiln import does not support yet")]
    UnsupportedFeature { feature: String },

    #[error(
        "GGUF tensor {name:?} has no Hugging Face counterpart that kiln knows for a {arch} model"
    )]
    UnknownTensor { name: String, arch: GgufArch },

    #[error(
        "GGUF file lacks tensor {name:?} ({hf_name}), which a {layers}-layer {arch} model needs"
    )]
    MissingTensor {
        name: String,
        hf_name: String,
        layers: u64,
        arch: GgufArch,
    },

    #[error(
        "GGUF tensor {name:?} ({hf_name}) has shape {found:?}, but the model's metadata \
         implies {expected:?}"
    )]
    ShapeMismatch {
        name: String,
        hf_name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },

    #[error("invalid model hyperparameters: {0}")]
    BadConfig(String),

    #[error("tensor {name:?}: {source}")]
    Permute {
        name: String,
        #[source]
        source: PermuteError,
    },

    #[error("output directory {path} already exists; pass --force to replace it")]
    OutputExists { path: PathBuf },
}

impl From<StagingError> for ImportError {
    fn from(e: StagingError) -> ImportError {
        ImportError::Io {
            action: e.action,
            path: e.path,
            source: e.source,
        }
    }
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ImportError {
    let path = path.to_path_buf();
    move |source| ImportError::Io {
        action,
        path,
        source,
    }
}

/// Options of [`import_gguf`].
#[derive(Clone, Debug, Default)]
pub struct ImportOptions {
    /// Replace an existing output directory.
    pub force: bool,
    /// Keep 2-D weights of a block type kiln's kernels read (Q8_0, Q4_0,
    /// Q4_1, Q5_0, Q4_K, Q5_K, Q6_K) as stored instead of dequantizing them
    /// to bf16 (see [`crate::frontend::QUANT_META_PREFIX`]). Norms, biases
    /// and tensors of other types are converted to bf16 either way.
    pub keep_quant: bool,
}

/// The Hugging Face `config.json` kiln import writes: the fields every
/// decoder family shares, plus the family's own in `extra` (Gemma-3's
/// `query_pre_attn_scalar`, `layer_types`, ...).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelConfig {
    pub architectures: Vec<String>,
    pub model_type: String,
    pub hidden_size: u64,
    pub intermediate_size: u64,
    pub num_hidden_layers: u64,
    pub num_attention_heads: u64,
    pub num_key_value_heads: u64,
    pub head_dim: u64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Value>,
    pub max_position_embeddings: u64,
    pub vocab_size: u64,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pad_token_id: Option<u32>,
    pub hidden_act: String,
    /// Absent for Qwen2, whose q/k/v bias is implied by the class.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mlp_bias: Option<bool>,
    pub torch_dtype: String,
    /// Family-specific fields, written after the shared ones.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

/// The config type's former name.
pub type LlamaConfig = ModelConfig;

/// What an import did.
#[derive(Clone, Debug)]
pub struct ImportReport {
    pub out_dir: PathBuf,
    pub arch: GgufArch,
    pub config: ModelConfig,
    /// How many source tensors had each GGML type.
    pub source_types: BTreeMap<GgmlType, usize>,
    /// Tensors written to `model.safetensors`.
    pub tensors_written: usize,
    /// Of those, the tensors written as stored (`--keep-quant`), by storage.
    pub kept_quant: BTreeMap<kiln_ir::QuantType, usize>,
    /// Bytes of tensor data in `model.safetensors`.
    pub weight_bytes: u64,
    pub parameters: u64,
    /// Tokens in the tokenizer vocabulary (may be below `config.vocab_size`
    /// when the embedding is padded).
    pub tokenizer_vocab: usize,
    pub special_token_ids: Vec<u32>,
    pub has_chat_template: bool,
    /// What killed imports had left beside the output: cleaned, or left
    /// alone with why (see [`crate::staging`]).
    pub stale: Sweep,
}

/// The Hugging Face name of a llama-family GGUF tensor, or `None` for a name
/// this mapping does not know. Same as [`hf_tensor_name_for`] with
/// [`GgufArch::Llama`].
pub fn hf_tensor_name(gguf_name: &str) -> Option<String> {
    hf_tensor_name_for(GgufArch::Llama, gguf_name)
}

/// The Hugging Face name of a GGUF tensor of an `arch` model, or `None`
/// for a name this mapping does not know. `ffn_norm` is the one name whose
/// meaning differs: the pre-MLP norm, which Llama-style models call
/// `post_attention_layernorm` and Gemma-3 `pre_feedforward_layernorm`
/// (Gemma-3's `post_attention_layernorm` is `post_attention_norm`, the
/// norm of the attention output).
pub fn hf_tensor_name_for(arch: GgufArch, gguf_name: &str) -> Option<String> {
    let fixed = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: u64 = layer.parse().ok()?;
    let gemma = arch == GgufArch::Gemma3;
    let qk_norm = matches!(arch, GgufArch::Qwen3 | GgufArch::Gemma3);
    let hf = match part {
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" if gemma => "pre_feedforward_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "post_attention_norm.weight" if gemma => "post_attention_layernorm.weight",
        "post_ffw_norm.weight" if gemma => "post_feedforward_layernorm.weight",
        "attn_q_norm.weight" if qk_norm => "self_attn.q_norm.weight",
        "attn_k_norm.weight" if qk_norm => "self_attn.k_norm.weight",
        "attn_q.bias" if arch == GgufArch::Qwen2 => "self_attn.q_proj.bias",
        "attn_k.bias" if arch == GgufArch::Qwen2 => "self_attn.k_proj.bias",
        "attn_v.bias" if arch == GgufArch::Qwen2 => "self_attn.v_proj.bias",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// An f32 GGUF value as the decimal a person wrote (1e-5, not
/// 9.999999747378752e-06): GGUF stores these hyperparameters as f32.
fn f32_as_written(v: f64) -> f64 {
    let short = format!("{}", v as f32);
    short.parse().unwrap_or(v)
}

struct Hparams {
    arch: GgufArch,
    hidden: u64,
    ffn: u64,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    eps: f64,
    theta: f64,
    context: u64,
    /// `linear` RoPE scaling from the metadata (llama3 comes from
    /// `rope_freqs.weight`, see [`llama3_scaling`]).
    rope_scaling: Option<Value>,
    sliding_window: Option<u64>,
}

fn read_hparams(g: &GgufFile) -> Result<Hparams, ImportError> {
    let name = g.require_str("general.architecture", "names the model architecture")?;
    let arch =
        GgufArch::from_gguf_name(name).ok_or_else(|| ImportError::UnsupportedArchitecture {
            arch: name.to_string(),
        })?;
    let k = |s: &str| format!("{arch}.{s}");
    let why = &format!("is a {arch} hyperparameter kiln needs");
    let hidden = g.require_u64(&k("embedding_length"), why)?;
    let ffn = g.require_u64(&k("feed_forward_length"), why)?;
    let layers = g.require_u64(&k("block_count"), why)?;
    let heads = g.require_u64(&k("attention.head_count"), why)?;
    let kv_heads = g.get_u64(&k("attention.head_count_kv"))?.unwrap_or(heads);
    let eps = g.require_f64(&k("attention.layer_norm_rms_epsilon"), why)?;
    let theta = g.get_f64(&k("rope.freq_base"))?.unwrap_or(10000.0);
    let context = g.require_u64(&k("context_length"), why)?;
    if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
        return Err(ImportError::BadConfig(format!(
            "{heads} attention heads cannot share {kv_heads} key/value heads"
        )));
    }
    let head_dim = match g.get_u64(&k("attention.key_length"))? {
        Some(d) => d,
        None if hidden % heads == 0 => hidden / heads,
        None => {
            return Err(ImportError::BadConfig(format!(
                "hidden size {hidden} is not a multiple of {heads} heads and \
                 {arch}.attention.key_length is absent"
            )))
        }
    };
    if let Some(v) = g.get_u64(&k("attention.value_length"))? {
        if v != head_dim {
            return Err(ImportError::UnsupportedFeature {
                feature: format!(
                    "a value head size ({v}) different from the key head size ({head_dim})"
                ),
            });
        }
    }
    if let Some(rot) = g.get_u64(&k("rope.dimension_count"))? {
        if rot != head_dim {
            return Err(ImportError::UnsupportedFeature {
                feature: format!("partial rotary embeddings ({rot} of {head_dim} dims)"),
            });
        }
    }
    let rope_scaling = match g.get_str(&k("rope.scaling.type"))? {
        None | Some("none") => None,
        Some("linear") => {
            let key = k("rope.scaling.factor");
            let factor = g.require_f64(&key, "is the factor of linear RoPE scaling")?;
            if !(factor.is_finite() && factor > 0.0) {
                return Err(ImportError::BadConfig(format!("{key} is {factor}")));
            }
            Some(json!({"rope_type": "linear", "factor": f32_as_written(factor)}))
        }
        Some(kind) => {
            return Err(ImportError::UnsupportedFeature {
                feature: format!(
                "RoPE scaling {kind:?} (supported: linear, and llama3 through rope_freqs.weight)"
            ),
            })
        }
    };
    if head_dim % 2 != 0 {
        return Err(ImportError::BadConfig(format!(
            "head size {head_dim} is odd"
        )));
    }
    let sliding_window = g.get_u64(&k("attention.sliding_window"))?;
    if arch == GgufArch::Gemma3 && sliding_window.is_none() {
        return Err(GgufError::MissingKey {
            key: k("attention.sliding_window"),
            why: "is the local attention window of Gemma-3's sliding layers".into(),
        }
        .into());
    }
    Ok(Hparams {
        arch,
        hidden,
        ffn,
        layers,
        heads,
        kv_heads,
        head_dim,
        eps: f32_as_written(eps),
        theta: f32_as_written(theta),
        context,
        rope_scaling,
        sliding_window,
    })
}

/// Llama-3.1 RoPE parameters that `rope_freqs.weight` does not record and
/// every Llama 3.1/3.2/3.3 release uses.
const LLAMA3_LOW_FREQ_FACTOR: f64 = 1.0;
const LLAMA3_HIGH_FREQ_FACTOR: f64 = 4.0;
const LLAMA3_ORIGINAL_CONTEXT: u64 = 8192;

/// The llama3 per-frequency divisors (what llama.cpp's converter writes to
/// `rope_freqs.weight`) for a head of `head_dim`.
pub fn llama3_rope_factors(
    head_dim: u64,
    theta: f64,
    factor: f64,
    low_freq_factor: f64,
    high_freq_factor: f64,
    original_context: u64,
) -> Vec<f64> {
    let old = original_context as f64;
    let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth =
                    (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// The llama3 `rope_scaling` a `rope_freqs.weight` tensor encodes: the
/// factor is its largest entry (or `rope.scaling.factor`), the original
/// context `rope.scaling.original_context_length` or 8192, the frequency
/// factors 1 and 4; every entry must then match the llama3 formula.
fn llama3_scaling(g: &GgufFile, h: &Hparams, t: &TensorInfo) -> Result<Value, ImportError> {
    let n = h.head_dim / 2;
    if t.shape() != [n] {
        return Err(ImportError::ShapeMismatch {
            name: t.name.clone(),
            hf_name: "rope_scaling (config.json)".into(),
            expected: vec![n],
            found: t.shape(),
        });
    }
    let got = g.dequantize(&t.name)?;
    let k = |s: &str| format!("{}.{s}", h.arch);
    let factor = match g.get_f64(&k("rope.scaling.factor"))? {
        Some(f) => f,
        None => got.iter().copied().fold(f32::MIN, f32::max) as f64,
    };
    let original = g
        .get_u64(&k("rope.scaling.original_context_length"))?
        .unwrap_or(LLAMA3_ORIGINAL_CONTEXT);
    if !(factor.is_finite() && factor >= 1.0) {
        return Err(ImportError::UnsupportedFeature {
            feature: format!("rope_freqs.weight with a largest factor of {factor} (llama3 scaling has a factor >= 1)"),
        });
    }
    let want = llama3_rope_factors(
        h.head_dim,
        h.theta,
        factor,
        LLAMA3_LOW_FREQ_FACTOR,
        LLAMA3_HIGH_FREQ_FACTOR,
        original,
    );
    if let Some((i, (g, w))) = got
        .iter()
        .zip(&want)
        .enumerate()
        .find(|(_, (g, w))| ((f64::from(**g) - **w) / **w).abs() > 1e-4)
    {
        return Err(ImportError::UnsupportedFeature {
            feature: format!(
                "rope_freqs.weight that is not llama3 RoPE scaling with factor {factor}, \
                 low_freq_factor {LLAMA3_LOW_FREQ_FACTOR}, high_freq_factor \
                 {LLAMA3_HIGH_FREQ_FACTOR} and original_max_position_embeddings {original} \
                 (entry {i} is {g}, the formula gives {w})"
            ),
        });
    }
    Ok(json!({
        "rope_type": "llama3",
        "factor": f32_as_written(factor),
        "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
        "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": original,
    }))
}

/// What happens to a tensor's values between dequantizing and writing.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Transform {
    None,
    /// Undo llama.cpp's q/k row permutation with this many heads.
    Unpermute(u64),
    /// Subtract the 1 llama.cpp's Gemma converter added to a norm weight.
    MinusOne,
}

/// One tensor to convert.
struct Plan<'a> {
    info: &'a TensorInfo,
    hf_name: String,
    shape: Vec<u64>,
    transform: Transform,
    /// `Some` when the tensor is written as stored (`--keep-quant`): its
    /// GGML blocks, rows moved back by an [`Transform::Unpermute`].
    keep: Option<kiln_ir::QuantType>,
}

impl Plan<'_> {
    /// Bytes of this tensor in `model.safetensors`.
    fn bytes(&self) -> u64 {
        match self.keep {
            Some(q) => self.shape[0] * q.row_bytes(self.shape[1] as usize).unwrap_or(0) as u64,
            None => self.info.n_elements * 2,
        }
    }
}

/// The storage a tensor keeps under `--keep-quant`: a 2-D weight (every
/// 2-D tensor of the mapping is a matmul or embedding weight) of a block
/// type the kernels read, whose transform is at most a row permutation
/// (blocks lie inside rows, so moving rows moves whole blocks).
fn kept_storage(
    info: &TensorInfo,
    shape: &[u64],
    transform: Transform,
) -> Option<kiln_ir::QuantType> {
    let q = dequant::quant_type(info.ggml_type)?;
    let row_ok = shape.len() == 2 && q.row_bytes(shape[1] as usize).is_some();
    let transform_ok = matches!(transform, Transform::None | Transform::Unpermute(_));
    (row_ok && transform_ok).then_some(q)
}

struct Layout<'a> {
    plans: Vec<Plan<'a>>,
    vocab: u64,
    tied: bool,
    rope_scaling: Option<Value>,
}

fn plan_tensors<'a>(
    g: &'a GgufFile,
    h: &Hparams,
    keep_quant: bool,
) -> Result<Layout<'a>, ImportError> {
    let arch = h.arch;
    let mut rope_scaling = h.rope_scaling.clone();
    let rope_freqs = g.tensor("rope_freqs.weight");
    if let Some(t) = rope_freqs {
        if !matches!(arch, GgufArch::Llama | GgufArch::Mistral) {
            return Err(ImportError::UnsupportedFeature {
                feature: format!("RoPE frequency factors ({}) in a {arch} model", t.name),
            });
        }
        if rope_scaling.is_some() {
            return Err(ImportError::UnsupportedFeature {
                feature: format!("both {}.rope.scaling.type and rope_freqs.weight", arch),
            });
        }
        rope_scaling = Some(llama3_scaling(g, h, t)?);
    }
    let missing = |name: &str, hf_name: &str| ImportError::MissingTensor {
        name: name.into(),
        hf_name: hf_name.into(),
        layers: h.layers,
        arch,
    };
    let embd = g
        .tensor("token_embd.weight")
        .ok_or_else(|| missing("token_embd.weight", "model.embed_tokens.weight"))?;
    let vocab = match embd.shape().as_slice() {
        [v, d] if *d == h.hidden => *v,
        other => {
            return Err(ImportError::ShapeMismatch {
                name: embd.name.clone(),
                hf_name: "model.embed_tokens.weight".into(),
                expected: vec![0, h.hidden],
                found: other.to_vec(),
            })
        }
    };
    let tied = g.tensor("output.weight").is_none();
    let q = h.heads * h.head_dim;
    let kv = h.kv_heads * h.head_dim;
    let norm = if arch == GgufArch::Gemma3 {
        Transform::MinusOne
    } else {
        Transform::None
    };
    let (perm_q, perm_k) = if arch.qk_permuted() {
        (
            Transform::Unpermute(h.heads),
            Transform::Unpermute(h.kv_heads),
        )
    } else {
        (Transform::None, Transform::None)
    };
    let mut expected: Vec<(String, Vec<u64>, Transform)> = vec![
        (
            "token_embd.weight".into(),
            vec![vocab, h.hidden],
            Transform::None,
        ),
        ("output_norm.weight".into(), vec![h.hidden], norm),
    ];
    if !tied {
        expected.push((
            "output.weight".into(),
            vec![vocab, h.hidden],
            Transform::None,
        ));
    }
    for l in 0..h.layers {
        let b = |s: &str| format!("blk.{l}.{s}");
        expected.extend([
            (b("attn_norm.weight"), vec![h.hidden], norm),
            (b("attn_q.weight"), vec![q, h.hidden], perm_q),
            (b("attn_k.weight"), vec![kv, h.hidden], perm_k),
            (b("attn_v.weight"), vec![kv, h.hidden], Transform::None),
            (b("attn_output.weight"), vec![h.hidden, q], Transform::None),
            (b("ffn_norm.weight"), vec![h.hidden], norm),
            (b("ffn_gate.weight"), vec![h.ffn, h.hidden], Transform::None),
            (b("ffn_up.weight"), vec![h.ffn, h.hidden], Transform::None),
            (b("ffn_down.weight"), vec![h.hidden, h.ffn], Transform::None),
        ]);
        if arch == GgufArch::Qwen2 {
            expected.extend([
                (b("attn_q.bias"), vec![q], Transform::None),
                (b("attn_k.bias"), vec![kv], Transform::None),
                (b("attn_v.bias"), vec![kv], Transform::None),
            ]);
        }
        if matches!(arch, GgufArch::Qwen3 | GgufArch::Gemma3) {
            expected.extend([
                (b("attn_q_norm.weight"), vec![h.head_dim], norm),
                (b("attn_k_norm.weight"), vec![h.head_dim], norm),
            ]);
        }
        if arch == GgufArch::Gemma3 {
            expected.extend([
                (b("post_attention_norm.weight"), vec![h.hidden], norm),
                (b("post_ffw_norm.weight"), vec![h.hidden], norm),
            ]);
        }
    }
    let mut wanted: HashSet<&str> = expected.iter().map(|(n, _, _)| n.as_str()).collect();
    if rope_freqs.is_some() {
        wanted.insert("rope_freqs.weight");
    }
    if let Some(t) = g
        .tensors()
        .iter()
        .find(|t| !wanted.contains(t.name.as_str()))
    {
        return Err(ImportError::UnknownTensor {
            name: t.name.clone(),
            arch,
        });
    }
    let mut plans = Vec::with_capacity(expected.len());
    for (name, shape, transform) in expected {
        let hf_name =
            hf_tensor_name_for(arch, &name).ok_or_else(|| ImportError::UnknownTensor {
                name: name.clone(),
                arch,
            })?;
        let info = g.tensor(&name).ok_or_else(|| missing(&name, &hf_name))?;
        if !dequant::is_supported(info.ggml_type) {
            return Err(GgufError::UnsupportedDequant {
                name,
                ty: info.ggml_type,
            }
            .into());
        }
        if info.shape() != shape {
            return Err(ImportError::ShapeMismatch {
                name,
                hf_name,
                expected: shape,
                found: info.shape(),
            });
        }
        let keep = if keep_quant {
            kept_storage(info, &shape, transform)
        } else {
            None
        };
        plans.push(Plan {
            info,
            hf_name,
            shape,
            transform,
            keep,
        });
    }
    plans.sort_by(|a, b| a.hf_name.cmp(&b.hf_name));
    Ok(Layout {
        plans,
        vocab,
        tied,
        rope_scaling,
    })
}

/// The bytes of one converted tensor: bf16, or the stored blocks of a
/// kept tensor.
fn convert(g: &GgufFile, p: &Plan<'_>) -> Result<Vec<u8>, ImportError> {
    if let Some(q) = p.keep {
        let data = g.tensor_bytes(p.info);
        let rows = p.shape[0] as usize;
        let row_bytes = q.row_bytes(p.shape[1] as usize).unwrap_or(0);
        if Some(data.len()) != rows.checked_mul(row_bytes) {
            // The reader sized the slice from the same block table, so this
            // cannot happen for a parsed file; report it anyway.
            return Err(GgufError::Corrupt {
                what: format!(
                    "tensor {:?} holds {} bytes, not the {rows} rows of {row_bytes} bytes of a {q} {:?}",
                    p.info.name,
                    data.len(),
                    p.shape
                ),
            }
            .into());
        }
        return match p.transform {
            Transform::Unpermute(heads) => {
                permute::unpermute_rows(data, rows, row_bytes, heads as usize).map_err(|source| {
                    ImportError::Permute {
                        name: p.info.name.clone(),
                        source,
                    }
                })
            }
            _ => Ok(data.to_vec()),
        };
    }
    let mut values = g.dequantize(&p.info.name)?;
    match p.transform {
        Transform::None => {}
        Transform::Unpermute(heads) => {
            let rows = p.shape[0] as usize;
            let cols = p.shape[1] as usize;
            values =
                permute::unpermute_rows(&values, rows, cols, heads as usize).map_err(|source| {
                    ImportError::Permute {
                        name: p.info.name.clone(),
                        source,
                    }
                })?;
        }
        Transform::MinusOne => values.iter_mut().for_each(|v| *v -= 1.0),
    }
    let mut out = Vec::with_capacity(values.len() * 2);
    for v in values {
        out.extend(bf16::from_f32(v).to_le_bytes());
    }
    Ok(out)
}

/// Streams the tensors into a safetensors file, one tensor in memory at a
/// time. Tensors are laid out in name order.
fn write_safetensors(
    g: &GgufFile,
    plans: &[Plan<'_>],
    path: &Path,
    source_name: &str,
) -> Result<(), ImportError> {
    let mut header = serde_json::Map::new();
    let mut meta = serde_json::Map::new();
    meta.insert("format".into(), json!("pt"));
    meta.insert("source".into(), json!(source_name));
    meta.insert("converted_by".into(), json!("kiln import"));
    let mut offset = 0u64;
    let mut entries = Vec::with_capacity(plans.len());
    for p in plans {
        let bytes = p.bytes();
        let (dtype, shape) = match p.keep {
            Some(q) => {
                let (n, k) = (p.shape[0], p.shape[1]);
                meta.insert(
                    format!("{}{}", crate::frontend::QUANT_META_PREFIX, p.hf_name),
                    json!(format!("{}:{n}:{k}", q.name())),
                );
                ("U8", vec![n, bytes / n.max(1)])
            }
            None => ("BF16", p.shape.clone()),
        };
        entries.push((
            p.hf_name.clone(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes]}),
        ));
        offset += bytes;
    }
    header.insert("__metadata__".into(), Value::Object(meta));
    header.extend(entries);
    let mut head = serde_json::to_vec(&Value::Object(header)).expect("a JSON map serializes");
    // The data section starts 8-byte aligned; the format pads with spaces.
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    let file = std::fs::File::create(path).map_err(io_err("cannot create", path))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let write = io_err("cannot write", path);
    let mut result = w
        .write_all(&(head.len() as u64).to_le_bytes())
        .and_then(|_| w.write_all(&head));
    for p in plans {
        if result.is_err() {
            break;
        }
        let data = convert(g, p)?;
        result = w.write_all(&data);
    }
    result
        .and_then(|_| w.flush())
        .and_then(|_| w.get_ref().sync_all())
        .map_err(write)
}

fn write_json(dir: &Path, name: &str, value: &impl Serialize) -> Result<(), ImportError> {
    let path = dir.join(name);
    let mut text = serde_json::to_string_pretty(value).expect("config values serialize");
    text.push('\n');
    std::fs::write(&path, text).map_err(io_err("cannot write", &path))
}

/// Gemma-3's local (sliding-window) RoPE base, which llama.cpp does not
/// store for gemma3 unless `rope.freq_base_swa` is present.
const GEMMA3_LOCAL_ROPE_THETA: f64 = 10000.0;
/// Every sixth Gemma-3 layer is global (llama.cpp hard-codes the pattern).
const GEMMA3_SLIDING_PATTERN: u64 = 6;
/// Gemma-3-27B's query scale is `hidden / heads` (168), not the head size;
/// llama.cpp recognises it by its 62 layers.
const GEMMA3_27B_LAYERS: u64 = 62;

/// The config.json of the imported model.
fn model_config(
    g: &GgufFile,
    h: &Hparams,
    layout: &Layout<'_>,
    tok: &tokenizer_build::BuiltTokenizer,
) -> Result<ModelConfig, ImportError> {
    let arch = h.arch;
    let k = |s: &str| format!("{arch}.{s}");
    let mut extra = serde_json::Map::new();
    let (mut attention_bias, mut mlp_bias) = (Some(false), Some(false));
    let mut hidden_act = "silu";
    match arch {
        GgufArch::Llama => {}
        GgufArch::Mistral => {
            extra.insert("sliding_window".into(), json!(h.sliding_window));
        }
        GgufArch::Qwen2 => {
            (attention_bias, mlp_bias) = (None, None);
            extra.insert("use_sliding_window".into(), json!(false));
            extra.insert("sliding_window".into(), json!(h.sliding_window));
        }
        GgufArch::Qwen3 => {
            mlp_bias = None;
            extra.insert("use_sliding_window".into(), json!(false));
            extra.insert("sliding_window".into(), json!(h.sliding_window));
        }
        GgufArch::Gemma3 => {
            mlp_bias = None;
            hidden_act = "gelu_pytorch_tanh";
            let pattern = g
                .get_u64(&k("attention.sliding_window_pattern"))?
                .unwrap_or(GEMMA3_SLIDING_PATTERN);
            if pattern == 0 {
                return Err(ImportError::BadConfig(format!(
                    "{} is 0",
                    k("attention.sliding_window_pattern")
                )));
            }
            let layer_types: Vec<&str> = (0..h.layers)
                .map(|i| {
                    if (i + 1) % pattern == 0 {
                        "full_attention"
                    } else {
                        "sliding_attention"
                    }
                })
                .collect();
            let scalar = if h.layers == GEMMA3_27B_LAYERS {
                h.hidden / h.heads
            } else {
                h.head_dim
            };
            let local_theta = g
                .get_f64(&k("rope.freq_base_swa"))?
                .map(f32_as_written)
                .unwrap_or(GEMMA3_LOCAL_ROPE_THETA);
            let softcap = |key: &str| -> Result<Value, ImportError> {
                Ok(json!(g.get_f64(&k(key))?.map(f32_as_written)))
            };
            extra.insert("hidden_activation".into(), json!(hidden_act));
            extra.insert("query_pre_attn_scalar".into(), json!(scalar));
            extra.insert("sliding_window".into(), json!(h.sliding_window));
            extra.insert("sliding_window_pattern".into(), json!(pattern));
            extra.insert("layer_types".into(), json!(layer_types));
            extra.insert("rope_local_base_freq".into(), json!(local_theta));
            extra.insert(
                "final_logit_softcapping".into(),
                softcap("final_logit_softcapping")?,
            );
            extra.insert(
                "attn_logit_softcapping".into(),
                softcap("attn_logit_softcapping")?,
            );
        }
    }
    Ok(ModelConfig {
        architectures: vec![arch.hf_architecture().into()],
        model_type: arch.hf_model_type().into(),
        hidden_size: h.hidden,
        intermediate_size: h.ffn,
        num_hidden_layers: h.layers,
        num_attention_heads: h.heads,
        num_key_value_heads: h.kv_heads,
        head_dim: h.head_dim,
        rms_norm_eps: h.eps,
        rope_theta: h.theta,
        rope_scaling: layout.rope_scaling.clone(),
        max_position_embeddings: h.context,
        vocab_size: layout.vocab,
        tie_word_embeddings: layout.tied,
        bos_token_id: tok.special.bos,
        eos_token_id: tok.special.eos,
        pad_token_id: tok.special.pad,
        hidden_act: hidden_act.into(),
        attention_bias,
        mlp_bias,
        torch_dtype: "bfloat16".into(),
        extra,
    })
}

/// Converts the GGUF at `gguf_path` into a model directory at `out_dir`.
pub fn import_gguf(
    gguf_path: &Path,
    out_dir: &Path,
    opts: &ImportOptions,
) -> Result<ImportReport, ImportError> {
    let parent = match out_dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    // What killed imports left here is cleaned first: a model one of them
    // had moved aside is back in place before the existence check below.
    let stale = staging::sweep(&parent);
    if out_dir.exists() && !opts.force {
        return Err(ImportError::OutputExists {
            path: out_dir.to_path_buf(),
        });
    }
    let g = GgufFile::open(gguf_path)?;
    let h = read_hparams(&g)?;
    let layout = plan_tensors(&g, &h, opts.keep_quant)?;
    let vocab = layout.vocab;
    let tok = tokenizer_build::build_tokenizer(&g, Some(h.context))?;
    if tok.vocab_size as u64 > vocab {
        return Err(ImportError::BadConfig(format!(
            "the tokenizer has {} tokens but the embedding only {vocab} rows",
            tok.vocab_size
        )));
    }

    let config = model_config(&g, &h, &layout, &tok)?;
    let mut generation = serde_json::Map::new();
    generation.insert("_from_model_config".into(), json!(true));
    if let Some(b) = tok.special.bos {
        generation.insert("bos_token_id".into(), json!(b));
    }
    if let Some(e) = tok.special.eos {
        generation.insert("eos_token_id".into(), json!(e));
    }
    if let Some(p) = tok.special.pad {
        generation.insert("pad_token_id".into(), json!(p));
    }

    std::fs::create_dir_all(&parent).map_err(io_err("cannot create", &parent))?;
    let target = out_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stage = Staging::create(&parent, &target)?;
    let tmp = stage.dir();
    let source_name = gguf_path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();

    write_json(tmp, "config.json", &config)?;
    write_json(tmp, "generation_config.json", &generation)?;
    let tok_path = tmp.join("tokenizer.json");
    std::fs::write(&tok_path, &tok.tokenizer_json).map_err(io_err("cannot write", &tok_path))?;
    write_json(tmp, "tokenizer_config.json", &tok.tokenizer_config)?;
    let plans = &layout.plans;
    write_safetensors(&g, plans, &tmp.join(WEIGHTS_FILE), &source_name)?;

    stage.install(out_dir)?;

    let mut source_types = BTreeMap::new();
    for t in g.tensors() {
        *source_types.entry(t.ggml_type).or_insert(0) += 1;
    }
    let mut kept_quant = BTreeMap::new();
    for q in plans.iter().filter_map(|p| p.keep) {
        *kept_quant.entry(q).or_insert(0) += 1;
    }
    Ok(ImportReport {
        out_dir: out_dir.to_path_buf(),
        arch: h.arch,
        kept_quant,
        weight_bytes: plans.iter().map(Plan::bytes).sum(),
        parameters: plans.iter().map(|p| p.info.n_elements).sum(),
        tensors_written: plans.len(),
        source_types,
        tokenizer_vocab: tok.vocab_size,
        special_token_ids: tok.special_token_ids,
        has_chat_template: tok.tokenizer_config.get("chat_template").is_some(),
        config,
        stale,
    })
}
