//! `Gemma3ForCausalLM` (`gemma3_text`), and the text decoder of a
//! multimodal `gemma3` config (`Gemma3ForConditionalGeneration`, whose
//! decoder config is nested under `text_config`).
//!
//! Gemma-3 is the shared decoder with these differences, all config flags of
//! [`DecoderConfig`] (the tracer has no Gemma code path of its own):
//! - every RMSNorm scales by `1 + w` (q/k norms included), computed in f32
//!   and rounded once, as HF's `Gemma3RMSNorm`;
//! - sandwich norms: `post_attention_layernorm` normalizes the attention
//!   output before the residual add; `pre_feedforward_layernorm` and
//!   `post_feedforward_layernorm` wrap the MLP;
//! - a GELU-tanh gated MLP (`hidden_activation: gelu_pytorch_tanh`);
//! - embeddings multiplied by `sqrt(hidden_size)` rounded to the activation
//!   dtype first (HF casts the normalizer to the weight dtype: 25.25 for
//!   hidden 640 in bf16, not 25.298);
//! - attention scale `query_pre_attn_scalar^-0.5`;
//! - sliding-window (local) layers from `layer_types`, else every
//!   `sliding_window_pattern`-th layer (6) is global; local layers use
//!   `rope_local_base_freq` (10000) without scaling, global ones
//!   `rope_theta` (1e6) and `rope_scaling` when the config sets it;
//!   transformers 5's per-layer-type `rope_parameters` are read too;
//! - tied embeddings by default; `attn_logit_softcapping` and
//!   `final_logit_softcapping` when set.
//!
//! Not here: a multimodal model's vision tower (only the text decoder is
//! traced; its weights may carry a `language_model.` prefix, see
//! [`tensor_aliases`]), and bidirectional attention (EmbeddingGemma).

use crate::config::{
    invalid, positive_finite, resolve_common, rope_scaling, ConfigError, DecoderConfig,
    FamilyDefaults, HfConfig, MlpAct, RopeScalingConfig,
};
use kiln_ir::{Rope, RopeScaling};

pub const ARCHITECTURE: &str = "Gemma3ForCausalLM";
pub const MODEL_TYPE: &str = "gemma3_text";
/// The multimodal class whose `text_config` holds the decoder.
pub const MULTIMODAL_ARCHITECTURE: &str = "Gemma3ForConditionalGeneration";
pub const MULTIMODAL_MODEL_TYPE: &str = "gemma3";

/// HF `Gemma3TextConfig` defaults.
pub fn defaults() -> FamilyDefaults {
    FamilyDefaults {
        architecture: ARCHITECTURE,
        max_position_embeddings: 131_072,
        head_dim: Some(256),
        num_key_value_heads: Some(4),
        bos_token_id: Some(2),
        eos_token_ids: vec![1],
    }
}

/// HF's defaults for the Gemma-specific fields.
const ROPE_THETA: f64 = 1_000_000.0;
const LOCAL_ROPE_THETA: f64 = 10_000.0;
const QUERY_PRE_ATTN_SCALAR: f64 = 256.0;
const SLIDING_WINDOW: u32 = 4096;
const SLIDING_WINDOW_PATTERN: u32 = 6;

/// The decoder's own config: `text_config` of a multimodal config (token
/// ids the nested one lacks taken from the outer one), else `cfg` itself.
fn text_config(cfg: &HfConfig) -> HfConfig {
    match &cfg.text_config {
        None => cfg.clone(),
        Some(t) => {
            let mut t = (**t).clone();
            t.architectures = cfg.architectures.clone();
            t.bos_token_id = t.bos_token_id.or(cfg.bos_token_id);
            t.eos_token_id = t.eos_token_id.clone().or(cfg.eos_token_id.clone());
            t
        }
    }
}

fn rope_of(theta: f64, scaling: Option<&RopeScalingConfig>) -> Result<Rope, ConfigError> {
    let theta = positive_finite(theta, "rope_theta")? as f32;
    let scaling = match scaling {
        None => RopeScaling::None,
        Some(p) => rope_scaling(p)?,
    };
    Ok(Rope { theta, scaling })
}

pub fn resolve(raw: &HfConfig) -> Result<DecoderConfig, ConfigError> {
    let cfg = text_config(raw);
    let act = cfg
        .hidden_activation
        .as_deref()
        .unwrap_or("gelu_pytorch_tanh");
    if act != "gelu_pytorch_tanh" {
        return Err(invalid(
            "hidden_activation",
            format!("`{act}` is not supported for {ARCHITECTURE}: kiln's Gemma-3 MLP is GELU-tanh gated (`gelu_pytorch_tanh`)"),
        ));
    }
    // transformers 5 keys `rope_parameters` by layer type.
    let keyed = cfg
        .rope_parameters
        .as_ref()
        .filter(|p| p.full_attention.is_some() || p.sliding_attention.is_some());
    let (global_params, local_params) = match keyed {
        Some(p) => (p.full_attention.as_deref(), p.sliding_attention.as_deref()),
        None => (
            cfg.rope_parameters.as_ref().or(cfg.rope_scaling.as_ref()),
            None,
        ),
    };
    let mut plain = cfg.clone();
    // The shared resolver checks for a SiLU MLP; Gemma's activation is
    // checked above (HF reads `hidden_activation`, not `hidden_act`).
    plain.hidden_act = None;
    plain.rope_parameters = None;
    plain.rope_scaling = None;
    plain.tie_word_embeddings = Some(cfg.tie_word_embeddings.unwrap_or(true));
    let mut c = resolve_common(&plain, &defaults())?;

    let theta = global_params
        .and_then(|p| p.rope_theta)
        .or(cfg.rope_theta)
        .unwrap_or(ROPE_THETA);
    c.rope = rope_of(theta, global_params)?;
    let local_theta = local_params
        .and_then(|p| p.rope_theta)
        .or(cfg.rope_local_base_freq)
        .unwrap_or(LOCAL_ROPE_THETA);
    c.local_rope = Some(rope_of(local_theta, local_params)?);

    let attention_bias = cfg.attention_bias.unwrap_or(false);
    c.qkv_bias = attention_bias;
    c.o_bias = attention_bias;
    c.qk_norm = true;
    c.norm_unit_offset = true;
    c.sandwich_norms = true;
    c.mlp_act = MlpAct::GeluTanh;
    // HF: `embed_scale = hidden_size**0.5` (a float32 buffer), cast to the
    // weight dtype before the multiply.
    let scale = (c.hidden_size as f64).sqrt() as f32;
    c.embed_scale = Some(kiln_kernels::cpu::round_f32(super::decoder::ACT, scale));
    let scalar = positive_finite(
        cfg.query_pre_attn_scalar.unwrap_or(QUERY_PRE_ATTN_SCALAR),
        "query_pre_attn_scalar",
    )?;
    c.attn_scale = Some(scalar.powf(-0.5) as f32);
    let cap = |v: Option<f64>, field: &'static str| -> Result<Option<f32>, ConfigError> {
        v.map(|x| positive_finite(x, field).map(|x| x as f32))
            .transpose()
    };
    c.attn_softcap = cap(cfg.attn_logit_softcapping, "attn_logit_softcapping")?;
    c.final_softcap = cap(cfg.final_logit_softcapping, "final_logit_softcapping")?;

    let window = match cfg.sliding_window {
        None => Some(SLIDING_WINDOW),
        Some(w) => w,
    };
    if window == Some(0) {
        return Err(invalid(
            "sliding_window",
            "must be at least 1 (or null for full attention)",
        ));
    }
    let n = c.num_layers as usize;
    let sliding: Vec<bool> = match &cfg.layer_types {
        Some(types) => {
            if types.len() != n {
                return Err(invalid(
                    "layer_types",
                    format!(
                        "has {} entries but num_hidden_layers is {n}; give one per layer",
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
            let pattern = cfg.sliding_window_pattern.unwrap_or(SLIDING_WINDOW_PATTERN);
            if pattern == 0 {
                return Err(invalid(
                    "sliding_window_pattern",
                    "must be at least 1 (every pattern-th layer is global)",
                ));
            }
            (0..n as u32)
                .map(|l| !(l + 1).is_multiple_of(pattern))
                .collect()
        }
    };
    c.windows = sliding
        .into_iter()
        .map(|s| if s { window } else { None })
        .collect();
    Ok(c)
}

/// Where a multimodal checkpoint keeps the decoder's tensor `name`, besides
/// under `name` itself: `language_model.` in front (transformers < 4.52) or
/// `model.language_model.` instead of `model.` (later versions).
pub fn tensor_aliases(name: &str) -> Vec<String> {
    let mut v = vec![format!("language_model.{name}")];
    if let Some(rest) = name.strip_prefix("model.") {
        v.push(format!("model.language_model.{rest}"));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: serde_json::Value) -> HfConfig {
        HfConfig::from_json(&v.to_string()).unwrap()
    }

    fn base() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "vocab_size": 300, "hidden_size": 640, "intermediate_size": 96,
            "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 256, "sliding_window": 512, "query_pre_attn_scalar": 256,
            "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh"
        })
    }

    #[test]
    fn defaults_follow_gemma3_text_config() {
        let c = resolve(&parse(base())).unwrap();
        assert_eq!(c.embed_scale, Some(25.25), "bf16(sqrt(640)) is 25.25");
        assert_eq!(c.attn_scale, Some(1.0 / 16.0));
        assert_eq!(c.rope.theta, 1e6);
        assert_eq!(c.local_rope.as_ref().unwrap().theta, 10000.0);
        assert!(c.tie_word_embeddings && c.qk_norm && c.norm_unit_offset && c.sandwich_norms);
        assert_eq!(c.mlp_act, MlpAct::GeluTanh);
        let w = Some(512);
        assert_eq!(c.windows, vec![w, w, w, w, w, None, w]);
        assert_eq!(
            (c.bos_token_id, c.eos_token_ids.clone()),
            (Some(2), vec![1])
        );
        assert_eq!((c.attn_softcap, c.final_softcap), (None, None));
    }

    #[test]
    fn layer_types_pattern_and_transformers5_rope_parameters_are_read() {
        let mut v = base();
        v["sliding_window_pattern"] = serde_json::json!(2);
        let c = resolve(&parse(v.clone())).unwrap();
        assert_eq!(c.windows[..3], [Some(512), None, Some(512)]);
        v["layer_types"] = serde_json::json!(vec!["full_attention"; 7]);
        assert_eq!(resolve(&parse(v.clone())).unwrap().windows, vec![None; 7]);
        v["rope_parameters"] = serde_json::json!({
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 500000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}
        });
        let c = resolve(&parse(v)).unwrap();
        assert_eq!(
            c.rope,
            Rope {
                theta: 500000.0,
                scaling: RopeScaling::Linear { factor: 8.0 }
            }
        );
        assert_eq!(
            c.local_rope,
            Some(Rope {
                theta: 20000.0,
                scaling: RopeScaling::None
            })
        );
    }

    #[test]
    fn a_multimodal_config_resolves_its_text_config() {
        let v = serde_json::json!({
            "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "eos_token_id": [1, 106], "text_config": base()
        });
        let c = resolve(&parse(v)).unwrap();
        assert_eq!(c.eos_token_ids, vec![1, 106]);
        assert_eq!(c.hidden_size, 640);
    }

    #[test]
    fn wrong_activation_pattern_or_softcap_names_the_field() {
        for (patch, needle) in [
            (
                serde_json::json!({"hidden_activation": "silu"}),
                "`silu` is not supported",
            ),
            (
                serde_json::json!({"sliding_window_pattern": 0}),
                "sliding_window_pattern",
            ),
            (
                serde_json::json!({"final_logit_softcapping": -1.0}),
                "final_logit_softcapping",
            ),
            (serde_json::json!({"layer_types": ["x"]}), "layer_types"),
        ] {
            let mut v = base();
            for (k, x) in patch.as_object().unwrap() {
                v[k] = x.clone();
            }
            let e = resolve(&parse(v)).unwrap_err().to_string();
            assert!(e.contains(needle), "{patch}: {e}");
        }
    }
}
