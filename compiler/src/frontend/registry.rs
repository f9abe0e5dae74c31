//! The architecture registry: which HF `architectures` names kiln compiles,
//! and which family module resolves each one's config.
//!
//! Adding a family is one module with its defaults and specifics plus one
//! line here; the decoder builder ([`super::decoder`]) is shared, so there is
//! no per-model graph code to add.

use super::{gemma3, llama, mistral, qwen2, qwen3};
use crate::config::{ConfigError, DecoderConfig, HfConfig};
use std::fmt;

/// A supported model family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// `LlamaForCausalLM`: Llama 2, 3, 3.1 (llama3 rope scaling), SmolLM2.
    Llama,
    /// `MistralForCausalLM`: sliding-window attention.
    Mistral,
    /// `Qwen2ForCausalLM`: Qwen2 and Qwen2.5, bias on q/k/v.
    Qwen2,
    /// `Qwen3ForCausalLM`: per-head q/k RMSNorm, independent head_dim.
    Qwen3,
    /// `Gemma3ForCausalLM` (`gemma3_text`; also the text decoder of a
    /// `gemma3` multimodal config): (1+w) and sandwich norms, GELU-tanh,
    /// scaled embeddings, local/global attention layers.
    Gemma3,
}

impl Family {
    pub const ALL: [Family; 5] = [
        Family::Llama,
        Family::Mistral,
        Family::Qwen2,
        Family::Qwen3,
        Family::Gemma3,
    ];

    /// The HF architecture name (`config.json` `architectures[0]`).
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => llama::ARCHITECTURE,
            Family::Mistral => mistral::ARCHITECTURE,
            Family::Qwen2 => qwen2::ARCHITECTURE,
            Family::Qwen3 => qwen3::ARCHITECTURE,
            Family::Gemma3 => gemma3::ARCHITECTURE,
        }
    }

    /// The HF `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => llama::MODEL_TYPE,
            Family::Mistral => mistral::MODEL_TYPE,
            Family::Qwen2 => qwen2::MODEL_TYPE,
            Family::Qwen3 => qwen3::MODEL_TYPE,
            Family::Gemma3 => gemma3::MODEL_TYPE,
        }
    }

    /// The family of an HF architecture name (each family's own, and
    /// `Gemma3ForConditionalGeneration`, whose text decoder is Gemma-3).
    pub fn from_architecture(name: &str) -> Option<Family> {
        if name == gemma3::MULTIMODAL_ARCHITECTURE {
            return Some(Family::Gemma3);
        }
        Family::ALL.into_iter().find(|f| f.architecture() == name)
    }

    /// The family of an HF `model_type` (`gemma3` included).
    pub fn from_model_type(name: &str) -> Option<Family> {
        if name == gemma3::MULTIMODAL_MODEL_TYPE {
            return Some(Family::Gemma3);
        }
        Family::ALL.into_iter().find(|f| f.model_type() == name)
    }

    /// Other names a checkpoint of this family may store tensor `name`
    /// under (a multimodal Gemma-3's `language_model` prefix).
    pub fn tensor_aliases(self, name: &str) -> Vec<String> {
        match self {
            Family::Gemma3 => gemma3::tensor_aliases(name),
            _ => Vec::new(),
        }
    }

    /// Resolves a config of this family: HF defaults, family specifics, checks.
    pub fn resolve(self, cfg: &HfConfig) -> Result<DecoderConfig, ConfigError> {
        match self {
            Family::Llama => llama::resolve(cfg),
            Family::Mistral => mistral::resolve(cfg),
            Family::Qwen2 => qwen2::resolve(cfg),
            Family::Qwen3 => qwen3::resolve(cfg),
            Family::Gemma3 => gemma3::resolve(cfg),
        }
    }

    /// `LlamaForCausalLM, MistralForCausalLM, ...` for error messages.
    pub fn supported_list() -> String {
        let names: Vec<&str> = Family::ALL.iter().map(|f| f.architecture()).collect();
        names.join(", ")
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.architecture())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_round_trips_through_its_names() {
        for f in Family::ALL {
            assert_eq!(Family::from_architecture(f.architecture()), Some(f));
            assert_eq!(Family::from_model_type(f.model_type()), Some(f));
        }
        assert_eq!(Family::from_architecture("GPT2LMHeadModel"), None);
        assert!(Family::supported_list().contains("Qwen3ForCausalLM"));
        assert_eq!(
            Family::from_architecture("Gemma3ForConditionalGeneration"),
            Some(Family::Gemma3)
        );
        assert_eq!(Family::from_model_type("gemma3"), Some(Family::Gemma3));
    }
}
