//! Model frontends: open a Hugging Face model directory and trace its decode
//! step into kiln IR, one [`Graph`] per shape key.
//!
//! [`open`] reads `config.json` and the safetensors *headers* (never tensor
//! data), picks the family from the [registry](registry), resolves the config
//! with HF's defaults, and checks every tensor the decoder will read against
//! the config (present, float dtype, expected shape). Everything that can be
//! wrong with the user's files is reported there, once, with the file and the
//! fix named; [`Model::trace`] then only validates the key and the KV layout.
//!
//! One builder ([`decoder`]) serves every family; the family modules hold
//! only defaults and config flags. Not here: fusion passes, planning, and
//! reading or converting weight data (the runtime binds weights from the
//! manifest at load).

pub(crate) mod decoder;
pub mod gemma3;
pub mod llama;
pub mod mistral;
pub mod qwen2;
pub mod qwen3;
pub mod registry;

pub use crate::config::DecoderConfig;
pub use registry::Family;

use crate::config::{ConfigError, HfConfig};
use crate::safetensors_header::{read_header, HeaderError, SafetensorsHeader, StDtype};
use kiln_ir::plan::{KvLayout, ModelInfo, SourceFile};
use kiln_ir::{
    DType, Graph, Key, KeyError, Shape, TensorRef, WeightEntry, WeightManifest, WeightSource,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Sharded checkpoint index name.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// What to trace besides the next tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceOptions {
    /// Also output the f32 logits (`logits`).
    pub logits: bool,
    /// Non-speculative keys draw `next_tokens` with `sample` over the
    /// `sample_params` / `sample_seeds` inputs instead of `argmax`.
    pub sampling: bool,
    /// With `sampling`: `(token, count)` pairs per row of the
    /// `sample_penalties` input (presence/frequency penalties applied in
    /// the graph); 0 traces no penalties input.
    pub penalty_slots: u32,
}

/// Why a model directory cannot be compiled, or a key traced. Each message
/// names the offending file, field or tensor and says how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum FrontendError {
    #[error("{} is not a directory; pass a Hugging Face model directory (config.json + model.safetensors)", dir.display())]
    NotADirectory { dir: PathBuf },
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} has no config.json; kiln compiles a Hugging Face model directory (config.json and model.safetensors or model.safetensors.index.json)", dir.display())]
    NoConfig { dir: PathBuf },
    #[error("{}: not a valid config ({source}); fix the JSON or download the file again", path.display())]
    ConfigJson {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{}: {source}", path.display())]
    Config {
        path: PathBuf,
        #[source]
        source: ConfigError,
    },
    #[error("{}: unsupported architecture {found}; kiln supports {supported}", path.display())]
    UnknownArchitecture {
        path: PathBuf,
        found: String,
        supported: String,
    },
    #[error("{} has no {SINGLE_FILE} and no {INDEX_FILE}{hint}", dir.display())]
    NoWeights { dir: PathBuf, hint: String },
    #[error("{}: {problem}", path.display())]
    BadIndex { path: PathBuf, problem: String },
    #[error("{} lists shard `{shard}` ({tensors} tensors) but {} does not exist; download the missing shard", index.display(), path.display())]
    MissingShard {
        index: PathBuf,
        shard: String,
        path: PathBuf,
        tensors: usize,
    },
    #[error(transparent)]
    Header(#[from] HeaderError),
    #[error("tensor `{tensor}` not found (searched {}); {hint}", searched.join(", "))]
    MissingTensor {
        tensor: String,
        searched: Vec<String>,
        hint: String,
    },
    #[error("tensor `{tensor}` in {file} has shape [{}] but config.json implies {expected}; the checkpoint does not match its config (check hidden_size, intermediate_size, vocab_size, num_attention_heads, num_key_value_heads, head_dim)", found.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(","))]
    ShapeMismatch {
        tensor: String,
        file: String,
        expected: Shape,
        found: Vec<u64>,
    },
    #[error("tensor `{tensor}` in {file} is stored as {found}; expected a float weight (BF16, F16 or F32). a quantized or integer checkpoint must be converted to BF16, F16 or F32 safetensors first")]
    DtypeMismatch {
        tensor: String,
        file: String,
        found: StDtype,
    },
    #[error("quantized tensor `{tensor}` in {file}: {problem}")]
    QuantTensor {
        tensor: String,
        file: String,
        problem: String,
    },
    #[error("invalid key: {0}")]
    InvalidKey(#[from] KeyError),
    #[error("key {key} cannot be traced: {problem}")]
    UnsupportedKey { key: Key, problem: String },
    #[error("KV layout does not fit the model: {problem}")]
    KvLayout { problem: String },
}

/// An opened model: resolved config, source files and weight manifest.
#[derive(Clone, Debug)]
pub struct Model {
    dir: PathBuf,
    family: Family,
    config: DecoderConfig,
    info: ModelInfo,
    files: Vec<SourceFile>,
    manifest: WeightManifest,
}

/// Opens the HF model directory `dir`: config.json plus `model.safetensors`
/// or the shards of `model.safetensors.index.json` (headers only).
pub fn open(dir: &Path) -> Result<Model, FrontendError> {
    if !dir.is_dir() {
        return Err(FrontendError::NotADirectory {
            dir: dir.to_path_buf(),
        });
    }
    let config_path = dir.join("config.json");
    if !config_path.is_file() {
        return Err(FrontendError::NoConfig {
            dir: dir.to_path_buf(),
        });
    }
    let text = std::fs::read_to_string(&config_path).map_err(|source| FrontendError::Io {
        path: config_path.clone(),
        source,
    })?;
    let raw = HfConfig::from_json(&text).map_err(|source| FrontendError::ConfigJson {
        path: config_path.clone(),
        source,
    })?;
    let family = pick_family(&config_path, &raw)?;
    let config = family
        .resolve(&raw)
        .map_err(|source| FrontendError::Config {
            path: config_path.clone(),
            source,
        })?;
    let store = TensorStore::open(dir)?;
    let manifest = build_manifest(&config, family, &store)?;
    let info = ModelInfo {
        vocab_size: config.vocab_size,
        hidden_size: config.hidden_size,
        num_layers: config.num_layers,
        num_heads: config.num_heads,
        num_kv_heads: config.num_kv_heads,
        head_dim: config.head_dim,
        max_context: config.max_position_embeddings,
        bos_token_id: config.bos_token_id,
        eos_token_ids: config.eos_token_ids.clone(),
        dtype: decoder::ACT,
    };
    let files = store
        .files
        .iter()
        .map(|(name, h)| SourceFile {
            name: name.clone(),
            size: h.file_size,
            header_sha256: h.header_sha256.clone(),
        })
        .collect();
    Ok(Model {
        dir: dir.to_path_buf(),
        family,
        config,
        info,
        files,
        manifest,
    })
}

fn pick_family(path: &Path, raw: &HfConfig) -> Result<Family, FrontendError> {
    let unknown = |found: String| FrontendError::UnknownArchitecture {
        path: path.to_path_buf(),
        found,
        supported: Family::supported_list(),
    };
    match &raw.architectures {
        Some(archs) if !archs.is_empty() => archs
            .iter()
            .find_map(|a| Family::from_architecture(a))
            .ok_or_else(|| unknown(archs.join(", "))),
        _ => match &raw.model_type {
            Some(mt) => Family::from_model_type(mt)
                .ok_or_else(|| unknown(format!("(model_type `{mt}`, no `architectures`)"))),
            None => Err(unknown(
                "(none: config.json has neither `architectures` nor `model_type`; add \"architectures\": [\"LlamaForCausalLM\"] or the model's own)".into(),
            )),
        },
    }
}

/// The safetensors headers of a checkpoint and, when sharded, its weight map.
struct TensorStore {
    /// Headers by file name (relative to the model directory), sorted.
    files: BTreeMap<String, SafetensorsHeader>,
    /// `Some` for a sharded checkpoint: tensor -> file, from the index.
    weight_map: Option<BTreeMap<String, String>>,
}

impl TensorStore {
    fn open(dir: &Path) -> Result<TensorStore, FrontendError> {
        let single = dir.join(SINGLE_FILE);
        if single.is_file() {
            let mut files = BTreeMap::new();
            files.insert(SINGLE_FILE.to_string(), read_header(&single)?);
            return Ok(TensorStore {
                files,
                weight_map: None,
            });
        }
        let index = dir.join(INDEX_FILE);
        if !index.is_file() {
            let hint = if dir.join("pytorch_model.bin").exists()
                || dir.join("pytorch_model.bin.index.json").exists()
            {
                "; it holds PyTorch .bin weights: convert them to safetensors first (e.g. with transformers' save_pretrained(safe_serialization=True))"
            } else {
                "; download the model's safetensors weights into it"
            };
            return Err(FrontendError::NoWeights {
                dir: dir.to_path_buf(),
                hint: hint.into(),
            });
        }
        let bad = |problem: String| FrontendError::BadIndex {
            path: index.clone(),
            problem,
        };
        let text = std::fs::read_to_string(&index).map_err(|source| FrontendError::Io {
            path: index.clone(),
            source,
        })?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| bad(format!("not valid JSON ({e}); download the file again")))?;
        let map = value
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("no `weight_map` object; download the file again".into()))?;
        let mut weight_map = BTreeMap::new();
        for (tensor, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| bad(format!("weight_map entry `{tensor}` is not a file name")))?;
            let p = Path::new(file);
            let plain = p.components().count() == 1
                && matches!(p.components().next(), Some(std::path::Component::Normal(_)));
            if !plain {
                return Err(bad(format!(
                    "weight_map entry `{tensor}` points at `{file}`, which is not a file in the model directory"
                )));
            }
            weight_map.insert(tensor.clone(), file.to_string());
        }
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for f in weight_map.values() {
            *counts.entry(f.as_str()).or_default() += 1;
        }
        let mut files = BTreeMap::new();
        for (shard, tensors) in counts {
            let path = dir.join(shard);
            if !path.is_file() {
                return Err(FrontendError::MissingShard {
                    index: index.clone(),
                    shard: shard.to_string(),
                    path,
                    tensors,
                });
            }
            files.insert(shard.to_string(), read_header(&path)?);
        }
        Ok(TensorStore {
            files,
            weight_map: Some(weight_map),
        })
    }

    /// The name `file` stores the tensor `name` under: `name` or one of the
    /// family's aliases.
    fn tensor_name(&self, file: &str, name: &str, family: Family) -> Option<String> {
        let h = self.files.get(file)?;
        std::iter::once(name.to_string())
            .chain(family.tensor_aliases(name))
            .find(|n| h.tensors.contains_key(n))
    }

    /// Finds a tensor: `(file, header entry)`, or why it is missing.
    fn find(
        &self,
        tensor: &str,
        hint: &str,
    ) -> Result<(&str, &crate::safetensors_header::TensorInfo), FrontendError> {
        let missing = |searched: Vec<String>, hint: String| FrontendError::MissingTensor {
            tensor: tensor.to_string(),
            searched,
            hint,
        };
        match &self.weight_map {
            None => {
                let (name, h) = self.files.iter().next().expect("one file");
                h.tensors
                    .get(tensor)
                    .map(|t| (name.as_str(), t))
                    .ok_or_else(|| missing(vec![name.clone()], hint.to_string()))
            }
            Some(map) => match map.get(tensor) {
                None => Err(missing(
                    vec![INDEX_FILE.to_string()],
                    format!("the index's weight_map has no entry for it; {hint}"),
                )),
                Some(file) => {
                    let h = &self.files[file];
                    h.tensors.get(tensor).map(|t| (file.as_str(), t)).ok_or_else(|| {
                        missing(
                            vec![file.clone()],
                            format!("{INDEX_FILE} maps it to {file} but that shard's header does not contain it; the index and the shards are from different downloads: download them again"),
                        )
                    })
                }
            },
        }
    }
}

/// Metadata key prefix of a tensor kept quantized in a model directory
/// (`kiln import --keep-quant`): `__metadata__["kiln.quant.<tensor>"] =
/// "<storage>:<N>:<K>"` (e.g. `q4_k:576:1536`) marks the `U8` tensor
/// `<tensor>` of shape `[N, row_bytes(K)]` as the ggml blocks of a logical
/// `[N, K]` weight.
pub const QUANT_META_PREFIX: &str = "kiln.quant.";

/// The manifest entry of a weight stored quantized, `None` for a dense one.
fn quantized_entry(
    store: &TensorStore,
    file: &str,
    name: &str,
    stored_as: &str,
    info: &crate::safetensors_header::TensorInfo,
    shape: &[u32],
) -> Result<Option<WeightEntry>, FrontendError> {
    let Some(meta) = store
        .files
        .get(file)
        .and_then(|h| h.metadata.get(&format!("{QUANT_META_PREFIX}{stored_as}")))
    else {
        return Ok(None);
    };
    let bad = |problem: String| FrontendError::QuantTensor {
        tensor: name.to_string(),
        file: file.to_string(),
        problem,
    };
    let mut parts = meta.split(':');
    let (q, n, k) = match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(q), Some(n), Some(k), None) => (q, n, k),
        _ => return Err(bad(format!("metadata `{meta}` is not `<storage>:<N>:<K>`"))),
    };
    let q = kiln_ir::QuantType::from_name(q)
        .filter(|q| *q != kiln_ir::QuantType::Fp8E4M3)
        .ok_or_else(|| {
            bad(format!(
                "unknown block storage `{q}` (known: q8_0, q4_0, q4_1, q5_0, q4_k, q5_k, q6_k)"
            ))
        })?;
    let (n, k): (u32, u32) = match (n.parse(), k.parse()) {
        (Ok(n), Ok(k)) => (n, k),
        _ => return Err(bad(format!("metadata `{meta}` has a non-numeric extent"))),
    };
    if shape.len() != 2 || [n, k] != [shape[0], shape[1]] {
        return Err(bad(format!(
            "metadata says [{n}, {k}] but the model needs {}",
            Shape(shape.to_vec())
        )));
    }
    let rb = q.row_bytes(k as usize).ok_or_else(|| {
        bad(format!(
            "rows of {k} elements are not whole {q} blocks of {}",
            q.block_elems()
        ))
    })?;
    if info.dtype != crate::safetensors_header::StDtype::U8
        || info.shape != [u64::from(n), rb as u64]
    {
        return Err(bad(format!(
            "a {q} [{n}, {k}] tensor must be U8 [{n}, {rb}], found {}{:?}; the file is damaged: import the model again",
            info.dtype, info.shape
        )));
    }
    let shape = Shape(shape.to_vec());
    Ok(Some(WeightEntry {
        name: name.to_string(),
        dtype: decoder::ACT,
        shape: shape.clone(),
        storage: Some(q),
        // A quantized source records the logical dtype and shape; the file
        // holds `U8 [N, row_bytes]` (the runtime's binder checks both).
        source: WeightSource::Tensor(TensorRef {
            file: file.to_string(),
            tensor: stored_as.to_string(),
            dtype: decoder::ACT,
            shape,
        }),
    }))
}

fn build_manifest(
    c: &DecoderConfig,
    family: Family,
    store: &TensorStore,
) -> Result<WeightManifest, FrontendError> {
    let mut entries = Vec::new();
    for (name, shape) in decoder::required_weights(c) {
        let hint = if name == "lm_head.weight" {
            "config.json says tie_word_embeddings is false; if the model shares its output projection with the embedding, set \"tie_word_embeddings\": true".to_string()
        } else {
            format!(
                "the checkpoint does not match config.json's architecture {} (or the download is incomplete)",
                family.architecture()
            )
        };
        let (file, info) = match store.find(&name, &hint) {
            Ok(found) => found,
            Err(missing) => family
                .tensor_aliases(&name)
                .iter()
                .find_map(|alias| store.find(alias, &hint).ok())
                .ok_or(missing)?,
        };
        let stored_as = store
            .tensor_name(file, &name, family)
            .unwrap_or_else(|| name.clone());
        if let Some(entry) = quantized_entry(store, file, &name, &stored_as, info, &shape)? {
            entries.push(entry);
            continue;
        }
        let dtype = match info.dtype.to_ir() {
            Some(d) if d.is_float() => d,
            _ => {
                return Err(FrontendError::DtypeMismatch {
                    tensor: name,
                    file: file.to_string(),
                    found: info.dtype,
                })
            }
        };
        let found_matches = info.shape.len() == shape.len()
            && info.shape.iter().zip(&shape).all(|(&a, &b)| a == b as u64);
        if !found_matches {
            return Err(FrontendError::ShapeMismatch {
                tensor: name,
                file: file.to_string(),
                expected: Shape(shape),
                found: info.shape.clone(),
            });
        }
        let shape = Shape(shape);
        entries.push(WeightEntry {
            name: name.clone(),
            dtype: decoder::ACT,
            shape: shape.clone(),
            storage: None,
            source: WeightSource::Tensor(TensorRef {
                file: file.to_string(),
                tensor: stored_as,
                dtype,
                shape,
            }),
        });
    }
    Ok(WeightManifest { entries })
}

impl Model {
    /// The HF architecture name, e.g. `LlamaForCausalLM`.
    pub fn architecture(&self) -> &str {
        self.family.architecture()
    }

    pub fn family(&self) -> Family {
        self.family
    }

    /// The model directory this was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The resolved config (HF defaults applied).
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// Model facts for the plan (dtype BF16, max_context = max_position_embeddings).
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The safetensors files, sorted by name, with sizes and header hashes.
    pub fn source_files(&self) -> &[SourceFile] {
        &self.files
    }

    /// Every tensor a traced graph reads, unfused, in first-read order.
    pub fn manifest(&self) -> &WeightManifest {
        &self.manifest
    }

    /// A KV layout that fits this model: BF16, null block 0, and block tables
    /// wide enough for `max_context`.
    pub fn kv_layout(&self, block_size: u32, num_blocks: u32) -> KvLayout {
        KvLayout {
            layers: self.config.num_layers,
            kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            dtype: DType::BF16,
            block_size,
            num_blocks,
            null_block: 0,
            max_blocks_per_seq: self
                .config
                .max_position_embeddings
                .div_ceil(block_size.max(1)),
        }
    }

    /// Stores every dense projection weight (`*_proj.weight`: q/k/v/o,
    /// gate/up/down) and an untied `lm_head.weight` as `q`, which must be
    /// FP8 e4m3: the runtime's binder quantizes it at load, one scale per
    /// output row. The embedding stays dense (a lookup reads one row per
    /// token, so it gains nothing), and so does a tied lm_head, which is the
    /// embedding. Weights already stored quantized are left as they are.
    /// Returns how many weights changed storage.
    pub fn quantize_projections(&mut self, q: kiln_ir::QuantType) -> Result<usize, FrontendError> {
        if q != kiln_ir::QuantType::Fp8E4M3 {
            return Err(FrontendError::QuantTensor {
                tensor: "*".into(),
                file: "(kiln compile --quantize)".into(),
                problem: format!(
                    "weights can be quantized at load only to fp8_e4m3, not {q}; block formats come from `kiln import --keep-quant`"
                ),
            });
        }
        let mut n = 0;
        for e in &mut self.manifest.entries {
            let projection = e.name.ends_with("_proj.weight") || e.name == "lm_head.weight";
            if projection && e.storage.is_none() && e.shape.rank() == 2 {
                e.storage = Some(q);
                n += 1;
            }
        }
        Ok(n)
    }

    /// Traces the decode step of `key` over the paged KV cache `kv`.
    pub fn trace(
        &self,
        key: Key,
        kv: &KvLayout,
        opts: &TraceOptions,
    ) -> Result<Graph, FrontendError> {
        decoder::trace(
            &self.config,
            self.architecture(),
            &self.manifest,
            key,
            kv,
            opts,
        )
    }
}
