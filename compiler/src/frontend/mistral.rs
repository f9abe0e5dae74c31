//! `MistralForCausalLM`: Llama-shaped, with sliding-window attention on every
//! layer when `sliding_window` is set (HF's default is 4096 when the key is
//! absent; `null`, as in Mistral 7B v0.2+, means full attention). The window
//! becomes `PagedAttention.window`. HF's `MistralConfig` also defaults
//! `num_key_value_heads` to 8 (not to the head count), and so does kiln.

use crate::config::{resolve_common, ConfigError, DecoderConfig, FamilyDefaults, HfConfig};

pub const ARCHITECTURE: &str = "MistralForCausalLM";
pub const MODEL_TYPE: &str = "mistral";

/// HF `MistralConfig` defaults.
pub fn defaults() -> FamilyDefaults {
    FamilyDefaults {
        architecture: ARCHITECTURE,
        max_position_embeddings: 4096 * 32,
        head_dim: None,
        num_key_value_heads: Some(8),
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    }
}

pub fn resolve(cfg: &HfConfig) -> Result<DecoderConfig, ConfigError> {
    let mut c = resolve_common(cfg, &defaults())?;
    let window = match cfg.sliding_window {
        None => Some(4096),
        Some(w) => w,
    };
    if window == Some(0) {
        return Err(ConfigError::Invalid {
            field: "sliding_window",
            problem: "must be at least 1 (or null for full attention)".into(),
        });
    }
    c.windows = vec![window; c.num_layers as usize];
    Ok(c)
}
