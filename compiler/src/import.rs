//! `kiln import`: a llama-family GGUF file → a Hugging Face style model
//! directory (`config.json`, `model.safetensors`, `tokenizer.json`,
//! `tokenizer_config.json`, `generation_config.json`) that kiln's frontend
//! compiles like any other checkpoint.
//!
//! On the way every tensor is dequantized to f32 (see `gguf::dequant`),
//! `attn_q`/`attn_k` rows are put back into Hugging Face's rotate-half order
//! (see `gguf::permute`), GGML's reversed dims become `[out, in]`, and the
//! values are stored as bf16. The directory is assembled under a temporary
//! name beside the destination and renamed into place, so a failed import
//! never leaves a half-written model behind.
//!
//! Deliberately not supported, each a clear error: architectures other than
//! `llama` (Llama 2/3, Mistral and SmolLM GGUFs all use it), RoPE scaling
//! (`rope_freqs.weight`, `llama.rope.scaling.*`), partial rotary
//! dimensions, and tensors this mapping does not know.

use crate::gguf::dequant;
use crate::gguf::permute::{self, PermuteError};
use crate::gguf::{GgmlType, GgufError, GgufFile, TensorInfo};
use crate::tokenizer_build::{self, TokenizerBuildError};
use half::bf16;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashSet};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// The weights file `kiln import` writes.
pub const WEIGHTS_FILE: &str = "model.safetensors";

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
        "general.architecture is {arch:?}; kiln import converts llama-family GGUFs \
         (general.architecture = \"llama\": Llama 2/3, Mistral, SmolLM2) only"
    )]
    UnsupportedArchitecture { arch: String },

    #[error("this GGUF uses {feature}, which kiln import does not support yet")]
    UnsupportedFeature { feature: String },

    #[error("GGUF tensor {name:?} has no Hugging Face counterpart that kiln knows")]
    UnknownTensor { name: String },

    #[error(
        "GGUF file lacks tensor {name:?} ({hf_name}), which a {layers}-layer llama model needs"
    )]
    MissingTensor {
        name: String,
        hf_name: String,
        layers: u64,
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
}

/// The Hugging Face `config.json` kiln import writes (LlamaForCausalLM).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LlamaConfig {
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
    pub attention_bias: bool,
    pub mlp_bias: bool,
    pub torch_dtype: String,
}

/// What an import did.
#[derive(Clone, Debug)]
pub struct ImportReport {
    pub out_dir: PathBuf,
    pub config: LlamaConfig,
    /// How many source tensors had each GGML type.
    pub source_types: BTreeMap<GgmlType, usize>,
    /// Tensors written to `model.safetensors`.
    pub tensors_written: usize,
    pub parameters: u64,
    /// Tokens in the tokenizer vocabulary (may be below `config.vocab_size`
    /// when the embedding is padded).
    pub tokenizer_vocab: usize,
    pub special_token_ids: Vec<u32>,
    pub has_chat_template: bool,
}

/// The Hugging Face name of a llama-family GGUF tensor, or `None` for a name
/// this mapping does not know.
pub fn hf_tensor_name(gguf_name: &str) -> Option<String> {
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
    let hf = match part {
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
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
    hidden: u64,
    ffn: u64,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    eps: f64,
    theta: f64,
    context: u64,
}

fn read_hparams(g: &GgufFile) -> Result<Hparams, ImportError> {
    let arch = g.require_str("general.architecture", "names the model architecture")?;
    if arch != "llama" {
        return Err(ImportError::UnsupportedArchitecture {
            arch: arch.to_string(),
        });
    }
    let k = |s: &str| format!("llama.{s}");
    let why = "is a llama hyperparameter kiln needs";
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
                 llama.attention.key_length is absent"
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
    if let Some(kind) = g.get_str(&k("rope.scaling.type"))? {
        if kind != "none" {
            return Err(ImportError::UnsupportedFeature {
                feature: format!("RoPE scaling ({kind})"),
            });
        }
    }
    if head_dim % 2 != 0 {
        return Err(ImportError::BadConfig(format!(
            "head size {head_dim} is odd"
        )));
    }
    Ok(Hparams {
        hidden,
        ffn,
        layers,
        heads,
        kv_heads,
        head_dim,
        eps: f32_as_written(eps),
        theta: f32_as_written(theta),
        context,
    })
}

/// One tensor to convert.
struct Plan<'a> {
    info: &'a TensorInfo,
    hf_name: String,
    shape: Vec<u64>,
    /// Heads to un-permute the rows for (attn_q, attn_k).
    unpermute: Option<u64>,
}

fn plan_tensors<'a>(
    g: &'a GgufFile,
    h: &Hparams,
) -> Result<(Vec<Plan<'a>>, u64, bool), ImportError> {
    if let Some(t) = g.tensors().iter().find(|t| t.name == "rope_freqs.weight") {
        return Err(ImportError::UnsupportedFeature {
            feature: format!("Llama-3.1 RoPE frequency scaling ({})", t.name),
        });
    }
    let embd = g
        .tensor("token_embd.weight")
        .ok_or(ImportError::MissingTensor {
            name: "token_embd.weight".into(),
            hf_name: "model.embed_tokens.weight".into(),
            layers: h.layers,
        })?;
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
    let mut expected: Vec<(String, Vec<u64>, Option<u64>)> = vec![
        ("token_embd.weight".into(), vec![vocab, h.hidden], None),
        ("output_norm.weight".into(), vec![h.hidden], None),
    ];
    if !tied {
        expected.push(("output.weight".into(), vec![vocab, h.hidden], None));
    }
    for l in 0..h.layers {
        let b = |s: &str| format!("blk.{l}.{s}.weight");
        expected.extend([
            (b("attn_norm"), vec![h.hidden], None),
            (b("attn_q"), vec![q, h.hidden], Some(h.heads)),
            (b("attn_k"), vec![kv, h.hidden], Some(h.kv_heads)),
            (b("attn_v"), vec![kv, h.hidden], None),
            (b("attn_output"), vec![h.hidden, q], None),
            (b("ffn_norm"), vec![h.hidden], None),
            (b("ffn_gate"), vec![h.ffn, h.hidden], None),
            (b("ffn_up"), vec![h.ffn, h.hidden], None),
            (b("ffn_down"), vec![h.hidden, h.ffn], None),
        ]);
    }
    let wanted: HashSet<&str> = expected.iter().map(|(n, _, _)| n.as_str()).collect();
    if let Some(t) = g
        .tensors()
        .iter()
        .find(|t| !wanted.contains(t.name.as_str()))
    {
        return Err(ImportError::UnknownTensor {
            name: t.name.clone(),
        });
    }
    let mut plans = Vec::with_capacity(expected.len());
    for (name, shape, unpermute) in expected {
        let hf_name = hf_tensor_name(&name)
            .ok_or_else(|| ImportError::UnknownTensor { name: name.clone() })?;
        let info = g.tensor(&name).ok_or_else(|| ImportError::MissingTensor {
            name: name.clone(),
            hf_name: hf_name.clone(),
            layers: h.layers,
        })?;
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
        plans.push(Plan {
            info,
            hf_name,
            shape,
            unpermute,
        });
    }
    plans.sort_by(|a, b| a.hf_name.cmp(&b.hf_name));
    Ok((plans, vocab, tied))
}

/// The bf16 bytes of one converted tensor.
fn convert(g: &GgufFile, p: &Plan<'_>) -> Result<Vec<u8>, ImportError> {
    let mut values = g.dequantize(&p.info.name)?;
    if let Some(heads) = p.unpermute {
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
    header.insert(
        "__metadata__".into(),
        json!({"format": "pt", "source": source_name, "converted_by": "kiln import"}),
    );
    let mut offset = 0u64;
    for p in plans {
        let bytes = p.info.n_elements * 2;
        header.insert(
            p.hf_name.clone(),
            json!({"dtype": "BF16", "shape": p.shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
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

/// Converts the GGUF at `gguf_path` into a model directory at `out_dir`.
pub fn import_gguf(
    gguf_path: &Path,
    out_dir: &Path,
    opts: &ImportOptions,
) -> Result<ImportReport, ImportError> {
    if out_dir.exists() && !opts.force {
        return Err(ImportError::OutputExists {
            path: out_dir.to_path_buf(),
        });
    }
    let g = GgufFile::open(gguf_path)?;
    let h = read_hparams(&g)?;
    let (plans, vocab, tied) = plan_tensors(&g, &h)?;
    let tok = tokenizer_build::build_tokenizer(&g, Some(h.context))?;
    if tok.vocab_size as u64 > vocab {
        return Err(ImportError::BadConfig(format!(
            "the tokenizer has {} tokens but the embedding only {vocab} rows",
            tok.vocab_size
        )));
    }

    let config = LlamaConfig {
        architectures: vec!["LlamaForCausalLM".into()],
        model_type: "llama".into(),
        hidden_size: h.hidden,
        intermediate_size: h.ffn,
        num_hidden_layers: h.layers,
        num_attention_heads: h.heads,
        num_key_value_heads: h.kv_heads,
        head_dim: h.head_dim,
        rms_norm_eps: h.eps,
        rope_theta: h.theta,
        rope_scaling: None,
        max_position_embeddings: h.context,
        vocab_size: vocab,
        tie_word_embeddings: tied,
        bos_token_id: tok.special.bos,
        eos_token_id: tok.special.eos,
        pad_token_id: tok.special.pad,
        hidden_act: "silu".into(),
        attention_bias: false,
        mlp_bias: false,
        torch_dtype: "bfloat16".into(),
    };
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

    let parent = match out_dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(io_err("cannot create", &parent))?;
    let tmp = tempfile::Builder::new()
        .prefix(".kiln-import-")
        .tempdir_in(&parent)
        .map_err(io_err("cannot create a temporary directory in", &parent))?;
    let source_name = gguf_path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();

    write_json(tmp.path(), "config.json", &config)?;
    write_json(tmp.path(), "generation_config.json", &generation)?;
    let tok_path = tmp.path().join("tokenizer.json");
    std::fs::write(&tok_path, &tok.tokenizer_json).map_err(io_err("cannot write", &tok_path))?;
    write_json(tmp.path(), "tokenizer_config.json", &tok.tokenizer_config)?;
    write_safetensors(&g, &plans, &tmp.path().join(WEIGHTS_FILE), &source_name)?;

    install_dir(tmp, out_dir)?;

    let mut source_types = BTreeMap::new();
    for t in g.tensors() {
        *source_types.entry(t.ggml_type).or_insert(0) += 1;
    }
    Ok(ImportReport {
        out_dir: out_dir.to_path_buf(),
        parameters: plans.iter().map(|p| p.info.n_elements).sum(),
        tensors_written: plans.len(),
        source_types,
        tokenizer_vocab: tok.vocab_size,
        special_token_ids: tok.special_token_ids,
        has_chat_template: tok.tokenizer_config.get("chat_template").is_some(),
        config,
    })
}

/// Renames the finished temporary directory to `out_dir`, moving an
/// existing `out_dir` aside first and deleting it only once the new one is
/// in place.
fn install_dir(tmp: tempfile::TempDir, out_dir: &Path) -> Result<(), ImportError> {
    let parent = tmp.path().parent().unwrap_or(Path::new(".")).to_path_buf();
    let staged = tmp.keep();
    let old = if out_dir.exists() {
        let aside = tempfile::Builder::new()
            .prefix(".kiln-import-old-")
            .tempdir_in(&parent)
            .map_err(io_err("cannot create a temporary directory in", &parent))?
            .keep();
        // `aside` exists (empty); renaming a directory onto an empty
        // directory replaces it on Unix, so remove it first for portability.
        std::fs::remove_dir(&aside).map_err(io_err("cannot remove", &aside))?;
        std::fs::rename(out_dir, &aside).map_err(io_err("cannot move aside", out_dir))?;
        Some(aside)
    } else {
        None
    };
    if let Err(e) = std::fs::rename(&staged, out_dir) {
        if let Some(aside) = &old {
            let _ = std::fs::rename(aside, out_dir);
        }
        let _ = std::fs::remove_dir_all(&staged);
        return Err(io_err("cannot rename the imported model to", out_dir)(e));
    }
    if let Some(aside) = old {
        if aside.is_dir() {
            std::fs::remove_dir_all(&aside).map_err(io_err("cannot remove", &aside))?;
        } else {
            std::fs::remove_file(&aside).map_err(io_err("cannot remove", &aside))?;
        }
    }
    Ok(())
}
