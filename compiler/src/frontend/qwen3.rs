//! `Qwen3ForCausalLM`: per-head RMSNorm of q and k (`q_norm`, `k_norm`)
//! before RoPE, emitted as `HeadRmsNorm`, and a `head_dim` independent of
//! `hidden_size / num_attention_heads` (HF's default is 128). Optional
//! `attention_bias` (q/k/v/o); sliding windows as in Qwen2.

use crate::config::{
    qwen_windows, resolve_common, ConfigError, DecoderConfig, FamilyDefaults, HfConfig,
};

pub const ARCHITECTURE: &str = "Qwen3ForCausalLM";
pub const MODEL_TYPE: &str = "qwen3";

/// HF `Qwen3Config` defaults.
pub fn defaults() -> FamilyDefaults {
    FamilyDefaults {
        architecture: ARCHITECTURE,
        max_position_embeddings: 32768,
        head_dim: Some(128),
        num_key_value_heads: None,
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

pub fn resolve(cfg: &HfConfig) -> Result<DecoderConfig, ConfigError> {
    let mut c = resolve_common(cfg, &defaults())?;
    let attention_bias = cfg.attention_bias.unwrap_or(false);
    c.qkv_bias = attention_bias;
    c.o_bias = attention_bias;
    c.qk_norm = true;
    c.windows = qwen_windows(cfg, c.num_layers, 28)?;
    Ok(c)
}
