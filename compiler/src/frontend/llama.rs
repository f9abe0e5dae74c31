//! `LlamaForCausalLM`: Llama 2, Llama 3, Llama 3.1 (llama3 rope scaling),
//! SmolLM2 and other Llama-shaped checkpoints, tied or untied embeddings.
//!
//! Everything specific to the family is its defaults and the optional
//! `attention_bias` (q/k/v/o) and `mlp_bias` flags; the graph comes from the
//! shared decoder builder.

use crate::config::{resolve_common, ConfigError, DecoderConfig, FamilyDefaults, HfConfig};

pub const ARCHITECTURE: &str = "LlamaForCausalLM";
pub const MODEL_TYPE: &str = "llama";

/// HF `LlamaConfig` defaults.
pub fn defaults() -> FamilyDefaults {
    FamilyDefaults {
        architecture: ARCHITECTURE,
        max_position_embeddings: 2048,
        head_dim: None,
        num_key_value_heads: None,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    }
}

pub fn resolve(cfg: &HfConfig) -> Result<DecoderConfig, ConfigError> {
    let mut c = resolve_common(cfg, &defaults())?;
    let attention_bias = cfg.attention_bias.unwrap_or(false);
    c.qkv_bias = attention_bias;
    c.o_bias = attention_bias;
    c.mlp_bias = cfg.mlp_bias.unwrap_or(false);
    Ok(c)
}
