#!/usr/bin/env python3
"""Write a model directory with a real config.json and a real safetensors
header but no weight data (a sparse file), for compiling plans of real model
shapes without downloading weights. `kiln compile` reads headers only;
`kiln bench` without --weights fills random weights on the device.

    scripts/make-shaped-model.py qwen3-0.6b /tmp/shapes/qwen3-0.6b [--tokenizer]

--layers N keeps the shape's layer shapes but only N layers.

--tokenizer also writes a synthetic word-level tokenizer.json of the shape's
vocabulary size (for `kiln serve` on a shaped model).

--quant TYPE (q8_0, q4_0, q4_1, q5_0, q4_k, q5_k, q6_k) stores every 2-D
weight as kept-quantized blocks (`kiln import --keep-quant`'s format: U8
[N, row_bytes] plus `__metadata__["kiln.quant.<tensor>"] = "TYPE:N:K"`), for
benchmarking quantized plans at real shapes; norms stay bf16.
"""
import json
import os
import struct
import sys

SHAPES = {
    "qwen3-0.6b": dict(arch="Qwen3ForCausalLM", model_type="qwen3", hidden=1024, layers=28, heads=16, kv=8, head_dim=128, inter=3072, vocab=151936, tied=True, theta=1e6, max_pos=40960, eps=1e-6),
    "qwen3-1.7b": dict(arch="Qwen3ForCausalLM", model_type="qwen3", hidden=2048, layers=28, heads=16, kv=8, head_dim=128, inter=6144, vocab=151936, tied=True, theta=1e6, max_pos=40960, eps=1e-6),
    "qwen3-4b": dict(arch="Qwen3ForCausalLM", model_type="qwen3", hidden=2560, layers=36, heads=32, kv=8, head_dim=128, inter=9728, vocab=151936, tied=True, theta=1e6, max_pos=40960, eps=1e-6),
    "llama-3-8b": dict(arch="LlamaForCausalLM", model_type="llama", hidden=4096, layers=32, heads=32, kv=8, head_dim=128, inter=14336, vocab=128256, tied=False, theta=5e5, max_pos=8192, eps=1e-5),
    "llama-3.2-1b": dict(arch="LlamaForCausalLM", model_type="llama", hidden=2048, layers=16, heads=32, kv=8, head_dim=64, inter=8192, vocab=128256, tied=True, theta=5e5, max_pos=131072, eps=1e-5,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # google/gemma-3-270m: (1+w) sandwich norms, q/k norm, GELU-tanh, 5 local
    # (window 512, rope base 1e4) : 1 global (1e6) layers; see gemma3_config.
    "gemma3-270m": dict(arch="Gemma3ForCausalLM", model_type="gemma3_text", hidden=640, layers=18, heads=4, kv=1, head_dim=256, inter=2048, vocab=262144, tied=True, theta=1e6, max_pos=32768, eps=1e-6),
    "smollm2-135m": dict(arch="LlamaForCausalLM", model_type="llama", hidden=576, layers=30, heads=9, kv=3, head_dim=64, inter=1536, vocab=49152, tied=True, theta=1e5, max_pos=8192, eps=1e-5),
}


def write_tokenizer(out, vocab):
    """A synthetic word-level tokenizer.json with one word per id (`t0` ..), so
    a server can detokenize whatever a random-weight model emits: the serving
    benchmark needs the vocabulary's size, not its words."""
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab)}, "unk_token": "t0"},
    }
    path = os.path.join(out, "tokenizer.json")
    with open(path + ".tmp", "w") as f:
        json.dump(tok, f)
    os.replace(path + ".tmp", path)


def gemma3_config(cfg, s):
    """The Gemma-3 fields of google/gemma-3-270m's published config.json."""
    cfg.pop("hidden_act")
    cfg.update({
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": s["head_dim"],
        "sliding_window": 512, "rope_local_base_freq": 10000.0, "rope_scaling": None,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(s["layers"])],
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False,
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    })


def main():
    name, out = sys.argv[1], sys.argv[2]
    if "--layers" in sys.argv[3:]:
        # The shape's layers cut to N (the same layer shapes, a shorter model):
        # correctness tests of big shapes on random weights.
        SHAPES[name] = dict(SHAPES[name], layers=int(sys.argv[sys.argv.index("--layers") + 1]))
    s = SHAPES[name]
    os.makedirs(out, exist_ok=True)
    cfg = {
        "architectures": [s["arch"]], "model_type": s["model_type"],
        "hidden_size": s["hidden"], "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"], "num_key_value_heads": s["kv"],
        "head_dim": s["head_dim"], "intermediate_size": s["inter"],
        "vocab_size": s["vocab"], "tie_word_embeddings": s["tied"],
        "rope_theta": s["theta"], "max_position_embeddings": s["max_pos"],
        "rms_norm_eps": s["eps"], "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    if "rope_scaling" in s:
        cfg["rope_scaling"] = s["rope_scaling"]
    gemma = s["model_type"] == "gemma3_text"
    if gemma:
        gemma3_config(cfg, s)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    h, hd, kv, heads = s["hidden"], s["head_dim"], s["kv"], s["heads"]
    tensors = [("model.embed_tokens.weight", [s["vocab"], h])]
    for l in range(s["layers"]):
        p = f"model.layers.{l}."
        tensors += [
            (p + "input_layernorm.weight", [h]),
            (p + "self_attn.q_proj.weight", [heads * hd, h]),
            (p + "self_attn.k_proj.weight", [kv * hd, h]),
            (p + "self_attn.v_proj.weight", [kv * hd, h]),
            (p + "self_attn.o_proj.weight", [h, heads * hd]),
            (p + "post_attention_layernorm.weight", [h]),
            (p + "mlp.gate_proj.weight", [s["inter"], h]),
            (p + "mlp.up_proj.weight", [s["inter"], h]),
            (p + "mlp.down_proj.weight", [h, s["inter"]]),
        ]
        if s["model_type"] == "qwen3" or gemma:
            tensors += [(p + "self_attn.q_norm.weight", [hd]), (p + "self_attn.k_norm.weight", [hd])]
        if gemma:
            tensors += [(p + "pre_feedforward_layernorm.weight", [h]), (p + "post_feedforward_layernorm.weight", [h])]
    tensors.append(("model.norm.weight", [h]))
    if not s["tied"]:
        tensors.append(("lm_head.weight", [s["vocab"], h]))
    quant = None
    if "--quant" in sys.argv[3:]:
        quant = sys.argv[sys.argv.index("--quant") + 1]
    blocks = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22),
              "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}
    if quant is not None and quant not in blocks:
        sys.exit(f"--quant {quant}: expected one of {', '.join(blocks)}")
    header, meta, off = {}, {}, 0
    for n, shape in tensors:
        if quant is not None and len(shape) == 2 and shape[1] % blocks[quant][0] == 0:
            be, bb = blocks[quant]
            stored = [shape[0], shape[1] // be * bb]
            size = stored[0] * stored[1]
            header[n] = {"dtype": "U8", "shape": stored, "data_offsets": [off, off + size]}
            meta[f"kiln.quant.{n}"] = f"{quant}:{shape[0]}:{shape[1]}"
        else:
            size = 2
            for d in shape:
                size *= d
            header[n] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + size]}
        off += size
    if meta:
        header["__metadata__"] = meta
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((8 - len(blob) % 8) % 8)
    path = os.path.join(out, "model.safetensors")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        f.truncate(8 + len(blob) + off)
    os.replace(tmp, path)
    if "--tokenizer" in sys.argv[3:]:
        write_tokenizer(out, s["vocab"])
    what = f"{quant}-quantized" if quant else "bf16"
    print(f"{name}: {len(tensors)} tensors, {off / 1e9:.2f} GB of (absent) {what} weights -> {out}")


if __name__ == "__main__":
    main()
