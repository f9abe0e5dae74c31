"""The oracle's model battery: real published configs, fewer layers, random weights.

Why this exists: kiln's frontends must agree with Hugging Face transformers on
what a config means (rope scaling, sliding windows, biases, q/k norm, tied
embeddings, defaults for absent fields). The surest way to test that is to
build models from the configs people actually download and run both
implementations on the same weights. Trained weights of those models are not
reachable here (no hub access), so the weights are random; the configs are
copied from the published `config.json` files, with `num_hidden_layers`
lowered so the battery runs in minutes. Nothing else in a config is changed,
except in the one variant whose name says so (`mistral-7b-v0.1-window16`).

Not here: SmolLM2 (its real weights come from `kiln import` of a GGUF file;
see run_oracle.sh), tokenizers (the oracle works in token ids).
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass, field

# The published config.json files, as downloaded (keys kiln and HF read, plus
# the inert ones, so the file kiln parses looks like the real one).
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

MISTRAL_7B_V0_1 = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}

QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# google/gemma-3-270m's config.json (transformers 4.55 spelling), as
# published; the battery entry below trims it to 6 layers (5 local, 1 global)
# and shrinks the window.
GEMMA_3_270M = {
    "_sliding_window_pattern": 6,
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 640,
    "initializer_range": 0.02,
    "intermediate_size": 2048,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 18,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 512,
    "torch_dtype": "bfloat16",
    "use_bidirectional_attention": False,
    "use_cache": True,
    "vocab_size": 262144,
}


@dataclass
class ModelSpec:
    """One model of the battery."""

    name: str
    published: str  # where the config comes from
    config: dict
    layers: int
    seed: int
    # Every change from the published config besides num_hidden_layers.
    deviations: list[str] = field(default_factory=list)

    def config_json(self) -> dict:
        c = copy.deepcopy(self.config)
        c["num_hidden_layers"] = self.layers
        if "layer_types" in c:
            c["layer_types"] = c["layer_types"][: self.layers]
        return c


def _window16() -> dict:
    c = copy.deepcopy(MISTRAL_7B_V0_1)
    c["sliding_window"] = 16
    return c


def _gemma_window16() -> dict:
    c = copy.deepcopy(GEMMA_3_270M)
    c["sliding_window"] = 16
    return c


BATTERY: list[ModelSpec] = [
    ModelSpec("llama-3.2-1b", "meta-llama/Llama-3.2-1B", LLAMA_3_2_1B, 2, 11),
    ModelSpec("mistral-7b-v0.1", "mistralai/Mistral-7B-v0.1", MISTRAL_7B_V0_1, 2, 12),
    ModelSpec(
        "mistral-7b-v0.1-window16",
        "mistralai/Mistral-7B-v0.1",
        _window16(),
        2,
        13,
        [
            "sliding_window 4096 -> 16, so the window actually cuts the "
            "context of these short sequences (prompt + 32 tokens)"
        ],
    ),
    ModelSpec("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B", QWEN2_5_0_5B, 4, 14),
    ModelSpec("qwen3-0.6b", "Qwen/Qwen3-0.6B", QWEN3_0_6B, 4, 15),
    ModelSpec(
        "gemma-3-270m-window16",
        "google/gemma-3-270m",
        _gemma_window16(),
        6,
        16,
        [
            "sliding_window 512 -> 16, so the five local layers cut the "
            "context of these sequences while the global sixth does not"
        ],
    ),
]


def by_name(names: list[str] | None) -> list[ModelSpec]:
    if not names:
        return list(BATTERY)
    known = {m.name: m for m in BATTERY}
    missing = [n for n in names if n not in known]
    if missing:
        raise SystemExit(
            f"unknown model(s) {missing}; the battery has {sorted(known)}"
        )
    return [known[n] for n in names]


# ---------------------------------------------------------------------------
# Random weights.
#
# HF's own init (normal(0, 0.02) for matrices, ones for norms, zeros for
# biases) is a poor oracle: unit norm weights and zero biases hide a kernel
# that forgets to apply them, and its logits are nearly uniform. Instead:
# * every matrix is normal with std `gain / sqrt(fan_in)`, so each layer's
#   output has about the scale of its input and attention/MLP contributions
#   are comparable to the residual stream, whatever the hidden size;
# * the embedding is normal(0, EMBED_STD) with EMBED_STD small (HF's 0.02):
#   the first RMSNorm rescales it anyway, and with a tied lm_head a large
#   embedding makes `logit(t) ~ |e_t|^2` dominate, so the model only ever
#   repeats its last token;
# * norm weights are 1 + 0.3 * normal (never all ones), biases normal(0, 0.5);
# * a tied embedding doubles as lm_head, as in the real model.
# `gain` sets how peaked the logits are; see tests/oracle/README.md for how the
# value was chosen (it trades token diversity against top-2 margins).

GAIN = 1.0
EMBED_STD = 0.02


def init_weights(model, seed: int, gain: float = GAIN) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    # Gemma's RMSNorms scale by (1 + w): centre w on 0 so the scale is ~1.
    norm_centre = 0.0 if model.config.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                val = norm_centre + 0.3 * torch.randn(p.shape, generator=g)
            elif name.endswith(".bias"):
                val = 0.5 * torch.randn(p.shape, generator=g)
            elif name.endswith("embed_tokens.weight"):
                val = EMBED_STD * torch.randn(p.shape, generator=g)
            elif p.dim() == 2:
                fan_in = p.shape[1]
                val = torch.randn(p.shape, generator=g) * (gain / math.sqrt(fan_in))
            else:
                raise SystemExit(f"no init rule for parameter {name} {tuple(p.shape)}")
            p.copy_(val.to(p.dtype))


def build(spec: ModelSpec, out_dir: str, gain: float = GAIN) -> str:
    """Writes `out_dir/<name>/` with config.json and model.safetensors (bf16)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d = os.path.join(out_dir, spec.name)
    os.makedirs(d, exist_ok=True)
    cfg_dict = spec.config_json()
    cfg_path = os.path.join(d, "config.json")
    tmp = cfg_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(cfg_dict, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, cfg_path)
    config = AutoConfig.from_pretrained(d)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_weights(model, spec.seed, gain)
    model = model.to(torch.bfloat16)
    model.save_pretrained(d, safe_serialization=True)
    # save_pretrained rewrites config.json in transformers' current spelling
    # (rope_parameters, layer_types, ...). Put the published file back: kiln
    # and HF must both read what a user downloads.
    with open(tmp, "w") as f:
        json.dump(cfg_dict, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, cfg_path)
    for extra in ("generation_config.json",):
        p = os.path.join(d, extra)
        if os.path.exists(p):
            os.remove(p)
    return d
