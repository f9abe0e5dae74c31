#!/usr/bin/env python3
"""Weight and logit parity of `kiln import` against Hugging Face transformers.

Hugging Face transformers can load a GGUF directly: it dequantizes every
tensor and undoes llama.cpp's q/k row permutation itself. This script loads
the same GGUF that way, loads the directory `kiln import` wrote with the
ordinary safetensors path, and compares:

1. every weight tensor (ours are bf16; the tolerance is bf16 rounding of
   the f32 dequantized value: |ours - hf| <= 2^-8 |hf| + 1e-30);
2. q_proj/k_proj of layer 0 against the *still permuted* GGUF rows, to show
   the comparison would catch a missing un-permutation;
3. next-token logits and 32 greedy tokens on a chat prompt, both models in
   f32 on the CPU (the HF model's weights rounded to bf16 first, so both
   see identical values when (1) passes).

Usage (needs `pip install torch transformers accelerate gguf`):

    python3 scripts/weights_parity.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf \
        --imported /tmp/smol --out bench/results/weights-parity

Writes <out>.json and <out>.md; exit status 1 on any mismatch.
"""

import argparse
import datetime
import json
import os
import platform
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--imported", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()

    import numpy as np
    import torch
    import transformers
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    gguf = os.path.abspath(args.gguf)
    gdir, gname = os.path.dirname(gguf), os.path.basename(gguf)
    hf = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(args.imported, dtype=torch.float32).eval()
    hf_sd = hf.state_dict()
    our_sd = ours.state_dict()

    # 1. Every tensor.
    tensors = []
    for name, h in hf_sd.items():
        o = our_sd[name]
        if tuple(o.shape) != tuple(h.shape):
            tensors.append({"name": name, "ok": False, "why": f"shape {tuple(o.shape)} vs {tuple(h.shape)}"})
            continue
        diff = (o - h).abs()
        bound = h.abs() * 2.0**-8 + 1e-30
        tensors.append(
            {
                "name": name,
                "ok": bool((diff <= bound).all()),
                "max_abs_diff": float(diff.max()),
                "max_abs_value": float(h.abs().max()),
                "max_diff_over_bound": float((diff / bound).max()),
            }
        )
    n_bad = sum(not t["ok"] for t in tensors)

    # 2. The comparison discriminates: layer 0 q/k rows in GGUF order differ.
    reader = GGUFReader(gguf)
    raw = {t.name: t for t in reader.tensors}
    discrimination = {}
    for gname_t, hf_name in [
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight"),
    ]:
        t = raw[gname_t]
        permuted = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        permuted = permuted.reshape(our_sd[hf_name].shape)
        discrimination[hf_name] = {
            "max_abs_diff_ours_vs_unpermuted_hf": float((our_sd[hf_name] - hf_sd[hf_name]).abs().max()),
            "max_abs_diff_ours_vs_gguf_row_order": float((our_sd[hf_name] - permuted).abs().max()),
        }

    # Samples of Hugging Face's values, re-checked by the Rust test
    # `imported_smollm2_weights_match_recorded_hf_samples` without Python.
    samples = {}
    for name, rows in [
        ("model.layers.0.self_attn.q_proj.weight", [0, 1, 31, 32, 33, 63, 64, 575]),
        ("model.layers.0.self_attn.k_proj.weight", [0, 1, 32, 33, 191]),
        ("model.layers.29.self_attn.k_proj.weight", [5, 37, 130]),
        ("model.layers.29.mlp.down_proj.weight", [0, 575]),
        ("model.embed_tokens.weight", [0, 1, 2, 1000, 49151]),
        ("model.norm.weight", None),
    ]:
        h = hf_sd[name]
        if rows is None:
            samples[name] = {"rows": None, "values": h[:16].tolist()}
        else:
            samples[name] = {"rows": rows, "values": [h[r, :16].tolist() for r in rows]}

    # 3. Logits and greedy tokens, identical weights in bf16 precision.
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    tok = AutoTokenizer.from_pretrained(args.imported)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Name three primary colors."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        l_hf = hf(ids).logits[0, -1]
        l_our = ours(ids).logits[0, -1]
        g_hf = hf.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)[0, ids.shape[1]:]
        g_our = ours.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)[0, ids.shape[1]:]
    logits = {
        "max_abs_diff": float((l_hf - l_our).abs().max()),
        "max_abs_logit": float(l_hf.abs().max()),
        "argmax_hf": int(l_hf.argmax()),
        "argmax_ours": int(l_our.argmax()),
    }
    greedy = {
        "prompt": prompt,
        "hf_tokens": g_hf.tolist(),
        "our_tokens": g_our.tolist(),
        "identical": g_hf.tolist() == g_our.tolist(),
        "text": tok.decode(g_our, skip_special_tokens=False),
    }

    ok = n_bad == 0 and greedy["identical"] and logits["argmax_hf"] == logits["argmax_ours"]
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python3 " + " ".join(sys.argv),
        "gguf": gname,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "tensors_compared": len(tensors),
        "tensors_out_of_tolerance": n_bad,
        "worst_tensor": max(tensors, key=lambda t: t.get("max_diff_over_bound", float("inf"))),
        "permutation_discrimination": discrimination,
        "hf_samples_first_16_columns": samples,
        "logits": logits,
        "greedy": greedy,
        "ok": ok,
        "tensors": tensors,
    }
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False, indent=1)
        f.write("\n")
    w = result["worst_tensor"]
    lines = [
        "# Weight parity: kiln import vs Hugging Face transformers (GGUF loader)",
        "",
        f"- date: {result['date']}",
        f"- command: `{result['command']}`",
        f"- GGUF: `{gname}`",
        f"- versions: {result['versions']}",
        f"- tensors compared: {len(tensors)}, out of bf16 tolerance: {n_bad}",
        f"- worst tensor: {w['name']} (max |diff| {w.get('max_abs_diff')}, "
        f"{w.get('max_diff_over_bound')} of the bf16 bound)",
    ]
    for name, d in discrimination.items():
        lines.append(
            f"- {name}: max |ours - HF| {d['max_abs_diff_ours_vs_unpermuted_hf']:.3g}; "
            f"max |ours - GGUF row order| {d['max_abs_diff_ours_vs_gguf_row_order']:.3g}"
        )
    lines += [
        f"- last-position logits: max |diff| {logits['max_abs_diff']:.3g} "
        f"(max |logit| {logits['max_abs_logit']:.3g}), argmax {logits['argmax_ours']} vs {logits['argmax_hf']}",
        f"- {args.new_tokens} greedy tokens identical: {greedy['identical']}",
        f"- greedy text: {greedy['text']!r}",
        f"- verdict: {'PASS' if ok else 'FAIL'}",
    ]
    with open(args.out + ".md", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
