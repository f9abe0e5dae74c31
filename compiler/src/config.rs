//! Hugging Face `config.json`: the raw file ([`HfConfig`]) and the resolved,
//! validated decoder description ([`DecoderConfig`]) the tracer builds from.
//!
//! Resolution applies Hugging Face's per-architecture defaults for fields a
//! config may omit (`rms_norm_eps`, `rope_theta`, `num_key_value_heads`,
//! `head_dim`, `max_position_embeddings`, `tie_word_embeddings`,
//! `sliding_window`, token ids); the family modules in
//! [`crate::frontend`] supply those defaults and their architecture's
//! specifics. The structural sizes (`vocab_size`, `hidden_size`,
//! `intermediate_size`, `num_hidden_layers`, `num_attention_heads`) are
//! required even though HF's classes have defaults for them: `save_pretrained`
//! always writes them, and a config without them is not describing the
//! checkpoint next to it (HF's 7B-sized default would only turn into a
//! confusing shape mismatch later).
//!
//! Not here: reading tensors, and architectures outside the registry. Unknown
//! keys in the file are ignored, as HF ignores them.

use kiln_ir::{Rope, RopeScaling};
use serde::{Deserialize, Deserializer};

/// `eos_token_id` is an integer or a list of integers.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(t) => vec![*t],
            TokenIds::Many(v) => v.clone(),
        }
    }
}

/// `rope_scaling` (or transformers 5's `rope_parameters`, which also carries
/// `rope_theta`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct RopeScalingConfig {
    pub rope_type: Option<String>,
    /// The older spelling of `rope_type`.
    #[serde(rename = "type")]
    pub type_: Option<String>,
    pub factor: Option<f64>,
    pub low_freq_factor: Option<f64>,
    pub high_freq_factor: Option<f64>,
    pub original_max_position_embeddings: Option<u32>,
    pub rope_theta: Option<f64>,
    /// transformers 5 Gemma-3: `rope_parameters` keyed by layer type.
    pub full_attention: Option<Box<RopeScalingConfig>>,
    pub sliding_attention: Option<Box<RopeScalingConfig>>,
}

/// Absent stays `None`; present (even `null`) becomes `Some(..)`.
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

/// The fields of `config.json` kiln reads. Absent fields are `None`;
/// `sliding_window` distinguishes absent (`None`) from `null` (`Some(None)`),
/// because Mistral's default (4096) applies only when it is absent.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct HfConfig {
    pub architectures: Option<Vec<String>>,
    pub model_type: Option<String>,
    pub vocab_size: Option<u32>,
    pub hidden_size: Option<u32>,
    pub intermediate_size: Option<u32>,
    pub num_hidden_layers: Option<u32>,
    pub num_attention_heads: Option<u32>,
    pub num_key_value_heads: Option<u32>,
    pub head_dim: Option<u32>,
    pub hidden_act: Option<String>,
    pub max_position_embeddings: Option<u32>,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<RopeScalingConfig>,
    pub rope_parameters: Option<RopeScalingConfig>,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    pub mlp_bias: Option<bool>,
    #[serde(default, deserialize_with = "present")]
    pub sliding_window: Option<Option<u32>>,
    pub use_sliding_window: Option<bool>,
    pub max_window_layers: Option<u32>,
    pub layer_types: Option<Vec<String>>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<TokenIds>,
    // Gemma-3 (`gemma3_text`).
    pub hidden_activation: Option<String>,
    pub query_pre_attn_scalar: Option<f64>,
    pub rope_local_base_freq: Option<f64>,
    pub final_logit_softcapping: Option<f64>,
    pub attn_logit_softcapping: Option<f64>,
    #[serde(alias = "_sliding_window_pattern")]
    pub sliding_window_pattern: Option<u32>,
    /// A multimodal `gemma3` config nests the decoder's config here.
    pub text_config: Option<Box<HfConfig>>,
}

impl HfConfig {
    pub fn from_json(text: &str) -> Result<HfConfig, serde_json::Error> {
        serde_json::from_str(text)
    }
}

/// A config field that is missing or does not make sense.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("`{field}` is missing ({what}); add it to config.json (copy it from the model's original config)")]
    Missing {
        field: &'static str,
        what: &'static str,
    },
    #[error("`{field}`: {problem}")]
    Invalid {
        field: &'static str,
        problem: String,
    },
}

pub(crate) fn invalid(field: &'static str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        problem: problem.into(),
    }
}

/// What a family fills in when config.json leaves a field out (HF's class defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct FamilyDefaults {
    pub architecture: &'static str,
    pub max_position_embeddings: u32,
    /// `Some(d)`: HF's default head_dim is the constant `d` (Qwen3: 128);
    /// `None`: it is `hidden_size / num_attention_heads`.
    pub head_dim: Option<u32>,
    /// HF's default `num_key_value_heads` when absent: `None` means
    /// `num_attention_heads` (Llama, Qwen); Mistral's is 8.
    pub num_key_value_heads: Option<u32>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// The gate activation of the MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpAct {
    /// `silu` (Llama, Mistral, Qwen).
    Silu,
    /// `gelu_pytorch_tanh` (Gemma).
    GeluTanh,
}

/// A decoder-only transformer with RMSNorm, RoPE, GQA attention and a
/// gated MLP, fully resolved: every field has its final value. The fields
/// after `eos_token_ids` are Gemma-3's differences; [`resolve_common`] sets
/// them to the Llama behaviour.
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderConfig {
    pub vocab_size: u32,
    pub hidden_size: u32,
    pub intermediate_size: u32,
    pub num_layers: u32,
    pub num_heads: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub max_position_embeddings: u32,
    pub rms_norm_eps: f32,
    pub rope: Rope,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Bias on gate/up/down projections.
    pub mlp_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Sliding attention window of each layer (`None`: full attention).
    pub windows: Vec<Option<u32>>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Every RMSNorm (q/k norms included) scales by `1 + w` (Gemma).
    pub norm_unit_offset: bool,
    /// Gemma's sandwich norms: `post_attention_layernorm` normalizes the
    /// attention output before the residual add, `pre_feedforward_layernorm`
    /// and `post_feedforward_layernorm` wrap the MLP. Without it,
    /// `post_attention_layernorm` is the MLP's input norm (Llama).
    pub sandwich_norms: bool,
    pub mlp_act: MlpAct,
    /// Embedding rows multiplied by this (Gemma: sqrt(hidden) rounded to
    /// the activation dtype).
    pub embed_scale: Option<f32>,
    /// Attention score scale; `None`: `1 / sqrt(head_dim)`.
    pub attn_scale: Option<f32>,
    /// RoPE of the sliding-window layers when it differs from `rope`
    /// (Gemma-3's local base frequency).
    pub local_rope: Option<Rope>,
    /// `cap * tanh(s / cap)` on attention scores.
    pub attn_softcap: Option<f32>,
    /// `cap * tanh(l / cap)` on the final logits.
    pub final_softcap: Option<f32>,
}

/// The largest structural sizes kiln accepts from a config.json. Each is
/// far above any released model (the largest have ~260k-token vocabularies,
/// 16k-wide hidden states and ~130 layers) and small enough that every table
/// sized from it is bounded.
pub struct Limits {
    pub vocab_size: u32,
    pub hidden_size: u32,
    pub intermediate_size: u32,
    pub num_layers: u32,
    pub num_heads: u32,
    pub head_dim: u32,
}

/// The limits in force.
pub const LIMITS: Limits = Limits {
    vocab_size: 4 << 20,
    hidden_size: 65_536,
    intermediate_size: 1 << 20,
    num_layers: 1024,
    num_heads: 1024,
    head_dim: 1024,
};

fn required(v: Option<u32>, field: &'static str, what: &'static str) -> Result<u32, ConfigError> {
    match v {
        None => Err(ConfigError::Missing { field, what }),
        Some(0) => Err(invalid(field, "must be at least 1")),
        Some(x) => Ok(x),
    }
}

pub(crate) fn positive_finite(v: f64, field: &'static str) -> Result<f64, ConfigError> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(invalid(
            field,
            format!("must be a positive finite number, got {v}"),
        ))
    }
}

/// Resolves the fields every supported family shares. The family modules
/// then set their specifics (biases, q/k norm, windows).
pub fn resolve_common(cfg: &HfConfig, d: &FamilyDefaults) -> Result<DecoderConfig, ConfigError> {
    let vocab_size = required(cfg.vocab_size, "vocab_size", "the vocabulary size")?;
    let hidden_size = required(cfg.hidden_size, "hidden_size", "the model width")?;
    let intermediate_size = required(cfg.intermediate_size, "intermediate_size", "the MLP width")?;
    let num_layers = required(
        cfg.num_hidden_layers,
        "num_hidden_layers",
        "the number of decoder layers",
    )?;
    let num_heads = required(
        cfg.num_attention_heads,
        "num_attention_heads",
        "the number of query heads",
    )?;
    let num_kv_heads = match cfg.num_key_value_heads {
        None => d.num_key_value_heads.unwrap_or(num_heads),
        Some(0) => return Err(invalid("num_key_value_heads", "must be at least 1")),
        Some(k) => k,
    };
    if num_heads % num_kv_heads != 0 {
        let source = if cfg.num_key_value_heads.is_none() {
            format!(
                " (the key is absent, so {}'s default applies; add `num_key_value_heads` to config.json)",
                d.architecture
            )
        } else {
            String::new()
        };
        return Err(invalid(
            "num_key_value_heads",
            format!(
                "{num_kv_heads} does not divide num_attention_heads {num_heads}{source}; grouped-query attention needs every kv head to serve the same number of query heads"
            ),
        ));
    }
    let head_dim = match (cfg.head_dim, d.head_dim) {
        (Some(0), _) => return Err(invalid("head_dim", "must be at least 1")),
        (Some(h), _) => h,
        (None, Some(h)) => h,
        (None, None) => {
            if hidden_size % num_heads != 0 {
                return Err(invalid(
                    "hidden_size",
                    format!(
                        "{hidden_size} is not divisible by num_attention_heads {num_heads} and config.json has no `head_dim`; add `head_dim` (the per-head width) to config.json"
                    ),
                ));
            }
            hidden_size / num_heads
        }
    };
    if head_dim % 2 != 0 {
        return Err(invalid(
            "head_dim",
            format!("{head_dim} is odd; rotary embeddings rotate pairs of dimensions"),
        ));
    }
    for (field, n) in [
        ("num_attention_heads", num_heads),
        ("num_key_value_heads", num_kv_heads),
    ] {
        if (n as u64) * (head_dim as u64) > u32::MAX as u64 {
            return Err(invalid(field, format!("{n} heads of {head_dim} overflow")));
        }
    }
    if let Some(act) = &cfg.hidden_act {
        if act != "silu" && act != "swish" {
            return Err(invalid(
                "hidden_act",
                format!(
                    "`{act}` is not supported for {}: kiln's decoder uses a SiLU-gated MLP (`silu`)",
                    d.architecture
                ),
            ));
        }
    }
    let max_position_embeddings = match cfg.max_position_embeddings {
        Some(0) => return Err(invalid("max_position_embeddings", "must be at least 1")),
        Some(m) => m,
        None => d.max_position_embeddings,
    };
    let rms_norm_eps = positive_finite(cfg.rms_norm_eps.unwrap_or(1e-6), "rms_norm_eps")? as f32;
    // Limits, checked before anything is sized from these numbers (a
    // config.json is input from a model directory: a layer count of 2^32-1
    // must be a message, not a multi-gigabyte allocation).
    for (field, value, max) in [
        ("vocab_size", vocab_size, LIMITS.vocab_size),
        ("hidden_size", hidden_size, LIMITS.hidden_size),
        (
            "intermediate_size",
            intermediate_size,
            LIMITS.intermediate_size,
        ),
        ("num_hidden_layers", num_layers, LIMITS.num_layers),
        ("num_attention_heads", num_heads, LIMITS.num_heads),
        ("num_key_value_heads", num_kv_heads, LIMITS.num_heads),
        ("head_dim", head_dim, LIMITS.head_dim),
    ] {
        if value > max {
            return Err(invalid(
                field,
                format!("{value} exceeds kiln's limit of {max}; check config.json (a damaged or hostile file?)"),
            ));
        }
    }
    let eos_token_ids = cfg
        .eos_token_id
        .as_ref()
        .map(TokenIds::to_vec)
        .unwrap_or_else(|| d.eos_token_ids.clone());
    let bos_token_id = cfg.bos_token_id.or(d.bos_token_id);
    for (field, id) in eos_token_ids
        .iter()
        .map(|&e| ("eos_token_id", e))
        .chain(bos_token_id.map(|b| ("bos_token_id", b)))
    {
        if id >= vocab_size {
            return Err(invalid(
                field,
                format!("{id} is outside the vocabulary (vocab_size {vocab_size}); fix the token id in config.json"),
            ));
        }
    }

    // transformers 5 moved rope_theta and the scaling into `rope_parameters`.
    let params = cfg.rope_parameters.as_ref().or(cfg.rope_scaling.as_ref());
    let theta = params
        .and_then(|p| p.rope_theta)
        .or(cfg.rope_theta)
        .unwrap_or(10000.0);
    let theta = positive_finite(theta, "rope_theta")? as f32;
    let scaling = match params {
        None => RopeScaling::None,
        Some(p) => rope_scaling(p)?,
    };

    Ok(DecoderConfig {
        vocab_size,
        hidden_size,
        intermediate_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        max_position_embeddings,
        rms_norm_eps,
        rope: Rope { theta, scaling },
        tie_word_embeddings: cfg.tie_word_embeddings.unwrap_or(false),
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        qk_norm: false,
        windows: vec![None; num_layers as usize],
        bos_token_id,
        eos_token_ids,
        norm_unit_offset: false,
        sandwich_norms: false,
        mlp_act: MlpAct::Silu,
        embed_scale: None,
        attn_scale: None,
        local_rope: None,
        attn_softcap: None,
        final_softcap: None,
    })
}

pub(crate) fn rope_scaling(p: &RopeScalingConfig) -> Result<RopeScaling, ConfigError> {
    const FIELD: &str = "rope_scaling";
    let kind = p.rope_type.as_deref().or(p.type_.as_deref());
    let factor = |p: &RopeScalingConfig| -> Result<f32, ConfigError> {
        let f = p.factor.ok_or_else(|| {
            invalid(
                FIELD,
                "`factor` is missing; add the scaling factor (e.g. 8.0)",
            )
        })?;
        Ok(positive_finite(f, "rope_scaling.factor")? as f32)
    };
    match kind {
        None | Some("default") => Ok(RopeScaling::None),
        Some("linear") => Ok(RopeScaling::Linear { factor: factor(p)? }),
        Some("llama3") => {
            let need = |v: Option<f64>, name: &str| -> Result<f32, ConfigError> {
                let v = v.ok_or_else(|| {
                    invalid(
                        FIELD,
                        format!("llama3 scaling needs `{name}`; add it (Llama 3.1 uses low_freq_factor 1.0, high_freq_factor 4.0, original_max_position_embeddings 8192)"),
                    )
                })?;
                Ok(positive_finite(v, "rope_scaling")? as f32)
            };
            let factor = factor(p)?;
            let low = need(p.low_freq_factor, "low_freq_factor")?;
            let high = need(p.high_freq_factor, "high_freq_factor")?;
            if high <= low {
                return Err(invalid(
                    FIELD,
                    format!("high_freq_factor {high} must be larger than low_freq_factor {low}"),
                ));
            }
            let original = p.original_max_position_embeddings.ok_or_else(|| {
                invalid(FIELD, "llama3 scaling needs `original_max_position_embeddings`; add it (8192 for Llama 3.1)")
            })?;
            if original == 0 {
                return Err(invalid(
                    FIELD,
                    "original_max_position_embeddings must be at least 1",
                ));
            }
            Ok(RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position: original,
            })
        }
        Some(other) => Err(invalid(
            FIELD,
            format!(
                "rope type `{other}` is not supported; kiln supports default, linear and llama3"
            ),
        )),
    }
}

/// Sliding windows of Qwen2-style configs: a layer slides when
/// `use_sliding_window` is set and either `layer_types` says
/// `sliding_attention` or (without `layer_types`) its index is at least
/// `max_window_layers`, as HF's Qwen2/Qwen3 configs decide.
pub fn qwen_windows(
    cfg: &HfConfig,
    num_layers: u32,
    default_max_window_layers: u32,
) -> Result<Vec<Option<u32>>, ConfigError> {
    let window = match (cfg.use_sliding_window.unwrap_or(false), cfg.sliding_window) {
        (false, _) => None,
        (true, None) => Some(4096),
        (true, Some(w)) => w,
    };
    if window == Some(0) {
        return Err(invalid(
            "sliding_window",
            "must be at least 1 (or null for full attention)",
        ));
    }
    let sliding: Vec<bool> = match &cfg.layer_types {
        Some(types) => {
            if types.len() != num_layers as usize {
                return Err(invalid(
                    "layer_types",
                    format!(
                        "has {} entries but num_hidden_layers is {num_layers}; give one per layer",
                        types.len()
                    ),
                ));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    "full_attention" => Ok(false),
                    "sliding_attention" => Ok(true),
                    other => Err(invalid(
                        "layer_types",
                        format!("unknown layer type `{other}`; expected full_attention or sliding_attention"),
                    )),
                })
                .collect::<Result<_, _>>()?
        }
        None => {
            let first = cfg.max_window_layers.unwrap_or(default_max_window_layers);
            (0..num_layers).map(|l| l >= first).collect()
        }
    };
    Ok(sliding
        .into_iter()
        .map(|s| if s { window } else { None })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> FamilyDefaults {
        FamilyDefaults {
            architecture: "LlamaForCausalLM",
            max_position_embeddings: 2048,
            head_dim: None,
            num_key_value_heads: None,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
        }
    }

    fn base() -> serde_json::Value {
        serde_json::json!({
            "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 3, "num_attention_heads": 8
        })
    }

    fn resolve(v: serde_json::Value) -> Result<DecoderConfig, ConfigError> {
        resolve_common(&HfConfig::from_json(&v.to_string()).unwrap(), &defaults())
    }

    #[test]
    fn omitted_fields_take_hugging_face_defaults() {
        let c = resolve(base()).unwrap();
        assert_eq!(c.num_kv_heads, 8);
        assert_eq!(c.head_dim, 8);
        assert_eq!(c.max_position_embeddings, 2048);
        assert_eq!(c.rms_norm_eps, 1e-6);
        assert_eq!(
            c.rope,
            Rope {
                theta: 10000.0,
                scaling: RopeScaling::None
            }
        );
        assert!(!c.tie_word_embeddings);
        assert_eq!(c.bos_token_id, Some(1));
        assert_eq!(c.eos_token_ids, vec![2]);
        assert_eq!(c.windows, vec![None; 3]);
    }

    #[test]
    fn eos_may_be_an_integer_or_a_list() {
        let mut v = base();
        v["vocab_size"] = serde_json::json!(128256);
        v["eos_token_id"] = serde_json::json!([128001, 128008, 128009]);
        assert_eq!(
            resolve(v.clone()).unwrap().eos_token_ids,
            vec![128001, 128008, 128009]
        );
        v["eos_token_id"] = serde_json::json!(7);
        assert_eq!(resolve(v).unwrap().eos_token_ids, vec![7]);
    }

    #[test]
    fn llama3_and_linear_rope_scaling_are_read_under_either_key_spelling() {
        let mut v = base();
        v["rope_theta"] = serde_json::json!(500000.0);
        v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192});
        let c = resolve(v.clone()).unwrap();
        assert_eq!(c.rope.theta, 500000.0);
        assert_eq!(
            c.rope.scaling,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192
            }
        );
        v["rope_scaling"] = serde_json::json!({"type": "linear", "factor": 2.5});
        assert_eq!(
            resolve(v).unwrap().rope.scaling,
            RopeScaling::Linear { factor: 2.5 }
        );
    }

    #[test]
    fn transformers5_rope_parameters_carry_theta_and_type() {
        let mut v = base();
        v["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 1000000.0});
        let c = resolve(v).unwrap();
        assert_eq!(
            c.rope,
            Rope {
                theta: 1e6,
                scaling: RopeScaling::None
            }
        );
    }

    #[test]
    fn inconsistent_or_missing_fields_name_the_field_and_the_fix() {
        let cases: Vec<(serde_json::Value, &str)> = vec![
            (
                serde_json::json!({"num_key_value_heads": 3}),
                "3 does not divide num_attention_heads 8",
            ),
            (serde_json::json!({"hidden_size": 60}), "add `head_dim`"),
            (serde_json::json!({"head_dim": 7}), "odd"),
            (
                serde_json::json!({"hidden_act": "gelu"}),
                "`gelu` is not supported",
            ),
            (serde_json::json!({"rms_norm_eps": -1.0}), "rms_norm_eps"),
            (serde_json::json!({"num_hidden_layers": 0}), "at least 1"),
            (
                serde_json::json!({"rope_scaling": {"type": "yarn", "factor": 4.0}}),
                "`yarn` is not supported",
            ),
            (
                serde_json::json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
                "low_freq_factor",
            ),
            (
                serde_json::json!({"rope_scaling": {"rope_type": "linear"}}),
                "`factor` is missing",
            ),
        ];
        for (patch, needle) in cases {
            let mut v = base();
            for (k, val) in patch.as_object().unwrap() {
                v[k] = val.clone();
            }
            let e = resolve(v).unwrap_err().to_string();
            assert!(e.contains(needle), "`{e}` lacks `{needle}`");
        }
        let mut v = base();
        v.as_object_mut().unwrap().remove("intermediate_size");
        let e = resolve(v).unwrap_err().to_string();
        assert!(
            e.contains("`intermediate_size` is missing") && e.contains("add it"),
            "{e}"
        );
    }

    #[test]
    fn absurd_sizes_and_out_of_vocabulary_token_ids_are_refused_naming_the_field_and_limit() {
        for (patch, needle) in [
            (
                serde_json::json!({"num_hidden_layers": 4294967295u32}),
                "num_hidden_layers",
            ),
            (
                serde_json::json!({"num_hidden_layers": 100000000}),
                "exceeds kiln's limit of 1024",
            ),
            (
                serde_json::json!({"vocab_size": 4294967295u32}),
                "vocab_size",
            ),
            (serde_json::json!({"hidden_size": 0}), "at least 1"),
            (serde_json::json!({"eos_token_id": 100}), "eos_token_id"),
            (
                serde_json::json!({"eos_token_id": [1, 5000]}),
                "5000 is outside the vocabulary",
            ),
            (serde_json::json!({"bos_token_id": 100}), "bos_token_id"),
        ] {
            let mut v = base();
            for (k, x) in patch.as_object().unwrap() {
                v[k] = x.clone();
            }
            let e = resolve(v).unwrap_err().to_string();
            assert!(e.contains(needle), "{patch}: {e}");
        }
    }

    #[test]
    fn qwen_windows_follow_use_sliding_window_and_max_window_layers() {
        let parse = |v: serde_json::Value| HfConfig::from_json(&v.to_string()).unwrap();
        let off = parse(serde_json::json!({"sliding_window": 32, "max_window_layers": 1}));
        assert_eq!(qwen_windows(&off, 3, 28).unwrap(), vec![None; 3]);
        let on = parse(
            serde_json::json!({"use_sliding_window": true, "sliding_window": 32, "max_window_layers": 1}),
        );
        assert_eq!(
            qwen_windows(&on, 3, 28).unwrap(),
            vec![None, Some(32), Some(32)]
        );
        let typed = parse(
            serde_json::json!({"use_sliding_window": true, "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
        );
        assert_eq!(
            qwen_windows(&typed, 3, 28).unwrap(),
            vec![Some(16), None, Some(16)]
        );
        let e = qwen_windows(&typed, 4, 28).unwrap_err().to_string();
        assert!(
            e.contains("has 3 entries but num_hidden_layers is 4"),
            "{e}"
        );
    }

    #[test]
    fn sliding_window_distinguishes_absent_from_null() {
        let a = HfConfig::from_json("{}").unwrap();
        assert_eq!(a.sliding_window, None);
        let n = HfConfig::from_json(r#"{"sliding_window": null}"#).unwrap();
        assert_eq!(n.sliding_window, Some(None));
        let s = HfConfig::from_json(r#"{"sliding_window": 4096}"#).unwrap();
        assert_eq!(s.sliding_window, Some(Some(4096)));
    }
}
