//! `Qwen2ForCausalLM`: Qwen2 and Qwen2.5. Always a bias on the q/k/v
//! projections (HF hard-codes it; the o projection has none), which becomes
//! `MatMul { bias: true }`. Sliding windows only when `use_sliding_window` is
//! set, on the layers HF's config selects.

use crate::config::{
    qwen_windows, resolve_common, ConfigError, DecoderConfig, FamilyDefaults, HfConfig,
};

pub const ARCHITECTURE: &str = "Qwen2ForCausalLM";
pub const MODEL_TYPE: &str = "qwen2";

/// HF `Qwen2Config` defaults (no default token ids).
pub fn defaults() -> FamilyDefaults {
    FamilyDefaults {
        architecture: ARCHITECTURE,
        max_position_embeddings: 32768,
        head_dim: None,
        num_key_value_heads: None,
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

pub fn resolve(cfg: &HfConfig) -> Result<DecoderConfig, ConfigError> {
    let mut c = resolve_common(cfg, &defaults())?;
    c.qkv_bias = true;
    c.windows = qwen_windows(cfg, c.num_layers, 28)?;
    Ok(c)
}
