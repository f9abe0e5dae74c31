#!/usr/bin/env python3
"""kiln vs Hugging Face transformers: the oracle's driver.

Subcommands, in the order run_oracle.sh calls them:

* `models`: write the random-weight battery (models.py) under WORK/models.
* `reference`: for every model under WORK/models, the prompts, HF's greedy
  decoding in f32 (the oracle) and in bf16, and the bf16 noise floor that sets
  the near-tie threshold; writes WORK/<model>/{prompts,drafts,hf}.json and the
  first-step logits.
* `compare`: reads kiln's runs (oracle_run's JSON), scores every kiln
  sequence teacher-forced under HF f32, and writes the report (markdown +
  JSON).

The oracle is HF in f32 on bf16 weights: the exact function the checkpoint
defines. HF in bf16 is reported next to it, and its deviation from f32 is the
noise floor: see README.md for the threshold and why.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf  # noqa: E402
import models  # noqa: E402

# Prompt lengths: a one-token prompt, lengths around and across the KV block
# size (16) and the window of the window16 variant, up to 44 tokens, so every
# sequence (prompt + 32 new tokens) stays under 80 positions.
PROMPT_LENGTHS = [1, 5, 9, 14, 17, 26, 33, 44]
PROMPT_SEED = 2024
NEW_TOKENS = 32
# The near-tie threshold is this many times the largest error HF bf16 makes
# in a top-2 margin against HF f32 on the same model and steps.
THRESHOLD_FACTOR = 2.0


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


def model_dirs(work: str, names: list[str] | None) -> list[tuple[str, str]]:
    found = sorted(
        (os.path.basename(os.path.dirname(c)), os.path.dirname(c))
        for c in glob.glob(os.path.join(work, "models", "*", "config.json"))
    )
    if names:
        found = [f for f in found if f[0] in names]
        missing = sorted(set(names) - {f[0] for f in found})
        if missing:
            raise SystemExit(f"no model directory for {missing} under {work}/models")
    if not found:
        raise SystemExit(f"no models under {work}/models; run `oracle.py models` first")
    return found


def log(msg: str) -> None:
    print(f"[oracle {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cmd_models(a) -> None:
    out = os.path.join(a.work, "models")
    os.makedirs(out, exist_ok=True)
    for spec in models.by_name(a.models):
        t = time.time()
        d = models.build(spec, out)
        log(f"built {spec.name} ({spec.layers} layers) in {time.time() - t:.1f} s -> {d}")


# HF variants run by `reference`: (name, dtype, head). "bf16h" is HF's bf16
# decoder with an f32 lm_head, the numerics kiln's plans have (bf16
# activations, f32 logits): its deviation from f32 sets the threshold.
VARIANTS = [("f32", "f32", "model"), ("bf16", "bf16", "model"), ("bf16h", "bf16", "f32")]


def _margin_error(m32, m16, prompt, tokens, device) -> list[float]:
    """|error| of bf16h's top-2 margin at each step, teacher-forced on
    `tokens` (HF f32's greedy continuation): for f32's top-2 tokens a, b,
    |(l16[a] - l16[b]) - (l32[a] - l32[b])|."""
    import torch

    r32 = hf.rows(m32, prompt, tokens, device, "model")
    r16 = hf.rows(m16, prompt, tokens, device, "f32")
    _, top = torch.topk(r32, 2, dim=-1)
    d32 = r32.gather(1, top[:, :1]) - r32.gather(1, top[:, 1:])
    d16 = r16.gather(1, top[:, :1]) - r16.gather(1, top[:, 1:])
    return (d16 - d32).abs()[:, 0].tolist()


def cmd_reference(a) -> None:
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    for name, d in model_dirs(a.work, a.models):
        t0 = time.time()
        wd = os.path.join(a.work, name)
        os.makedirs(wd, exist_ok=True)
        cfg = read_json(os.path.join(d, "config.json"))
        vocab = cfg["vocab_size"]
        # A model directory may bring its own prompts (token ids of real
        # text, for real weights: run_oracle.sh writes them for Gemma-3-270M).
        own = os.path.join(d, "oracle-prompts.json")
        if os.path.exists(own):
            prompts = read_json(own)["prompts"]
        else:
            prompts = hf.make_prompts(vocab, PROMPT_SEED, PROMPT_LENGTHS)
        if a.prompts:
            # A shorter run (a slow machine): the battery's first N prompts.
            prompts = prompts[: a.prompts]
        write_json(
            os.path.join(wd, "prompts.json"),
            {"model": name, "vocab_size": vocab, "new_tokens": a.new_tokens, "prompts": prompts},
        )
        loaded = {"f32": hf.load(d, "f32", a.device), "bf16": hf.load(d, "bf16", a.device)}
        runs, firsts = {}, {}
        for var, dt, head in VARIANTS:
            seqs, rows = [], []
            for p in prompts:
                g = hf.greedy(loaded[dt], p, a.new_tokens, a.device, head)
                rows.append(g.pop("first_logits"))
                seqs.append(g)
            firsts[var] = np.stack(rows)
            np.save(os.path.join(wd, f"hf-{var}-first-logits.npy"), firsts[var])
            runs[var] = seqs
        m32 = loaded["f32"]
        # bf16h's error in the decision quantity along f32's path, and each
        # bf16 variant's regret under f32 along its own path.
        err = [
            _margin_error(m32, loaded["bf16"], p, s["tokens"], a.device)
            for p, s in zip(prompts, runs["f32"])
        ]
        regret = {}
        for var in ("bf16", "bf16h"):
            regret[var] = []
            for p, s in zip(prompts, runs[var]):
                sc = hf.score(m32, p, s["tokens"], a.device)
                regret[var].append([t - g for t, g in zip(sc["top"], sc["given"])])
        err_max = float(max(max(e) for e in err))
        variants = {}
        for var, dt, head in VARIANTS:
            v = {"dtype": dt, "head": head, "sequences": runs[var]}
            if var != "f32":
                v["identical_to_f32"] = [
                    x["tokens"] == y["tokens"] for x, y in zip(runs[var], runs["f32"])
                ]
                v["regret_under_f32"] = regret[var]
                v["first_step_rel_error"] = rel_errors(firsts[var], firsts["f32"])
            variants[var] = v
        ref = {
            "model": name,
            "device": a.device,
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "new_tokens": a.new_tokens,
            "variants": variants,
            "margin_error": {
                "per_step": err,
                "max": err_max,
                "p99": float(np.percentile(np.concatenate(err), 99)),
                "median": float(np.median(np.concatenate(err))),
            },
            "threshold": THRESHOLD_FACTOR * err_max,
            "threshold_factor": THRESHOLD_FACTOR,
            "logit_std": float(firsts["f32"].std()),
        }
        write_json(os.path.join(wd, "hf.json"), ref)
        write_json(
            os.path.join(wd, "drafts.json"),
            {"model": name, "kind": "oracle", "continuations": [s["tokens"] for s in runs["f32"]]},
        )
        ident = {v: sum(variants[v]["identical_to_f32"]) for v in ("bf16", "bf16h")}
        margins = np.concatenate([s["margins"] for s in runs["f32"]])
        log(
            f"{name}: vs HF f32, identical sequences: bf16 {ident['bf16']}/{len(prompts)}, "
            f"bf16h {ident['bf16h']}/{len(prompts)}; bf16h margin error max {err_max:.3g} "
            f"(median {ref['margin_error']['median']:.3g}) -> threshold {ref['threshold']:.3g}; "
            f"f32 margins min {margins.min():.3g} median {np.median(margins):.3g}; "
            f"logit std {ref['logit_std']:.3g}; {time.time() - t0:.0f} s"
        )
        del loaded, m32


def _fake_run(path: str, seqs: list[dict], first: np.ndarray, name: str) -> None:
    """An oracle_run-shaped JSON (and first-logits file) from HF results."""
    stem = os.path.basename(path)[:-5]
    first.astype("<f4").tofile(os.path.join(os.path.dirname(path), f"{stem}.first-logits.f32"))
    write_json(
        path,
        {
            "tool": f"oracle.py selftest ({name})",
            "device": "cpu",
            "device_kind": "cpu",
            "mode": "greedy",
            "batch": 1,
            "sequences": [
                {"prompt": i, "tokens": s["tokens"], "margins": s["margins"], "top2": s["top2"]}
                for i, s in enumerate(seqs)
            ],
            "first_logits": {"file": f"{stem}.first-logits.f32", "rows": len(seqs), "vocab": first.shape[1]},
        },
    )


def _break(model, bug: str) -> None:
    """Plants a bug of the kind a kernel or frontend could have."""
    import torch

    layers = model.model.layers
    with torch.no_grad():
        if bug == "norm-weight":
            # layer 0's post-attention RMSNorm weight ignored (taken as ones)
            layers[0].post_attention_layernorm.weight.fill_(1.0)
        elif bug == "rope-theta":
            # rotary frequencies of a theta 4x too small: inv_freq_i =
            # theta^(-i/n) for i < n = head_dim/2, so each scales by 4^(i/n)
            for mod in model.modules():
                if hasattr(mod, "inv_freq") and hasattr(mod, "original_inv_freq"):
                    n = mod.inv_freq.numel()
                    i = torch.arange(n, dtype=mod.inv_freq.dtype, device=mod.inv_freq.device)
                    mod.inv_freq.mul_(4.0 ** (i / n))
        else:
            raise SystemExit(f"unknown bug {bug}")


def cmd_selftest(a) -> None:
    """Negative and positive controls for the judge: HF's bf16 decoder with
    an f32 head (kiln's numerics) must pass, and the same decoder with a
    planted bug must fail."""
    import shutil

    import compare

    failures = []
    for name, d in model_dirs(a.work, a.models):
        src = os.path.join(a.work, name)
        ref = read_json(os.path.join(src, "hf.json"))
        prompts = read_json(os.path.join(src, "prompts.json"))["prompts"]
        for case in ["faithful"] + a.bugs:
            tw = os.path.join(a.work, "selftest", case)
            shutil.rmtree(tw, ignore_errors=True)
            os.makedirs(os.path.join(tw, "models"))
            os.symlink(os.path.abspath(d), os.path.join(tw, "models", name))
            wd = os.path.join(tw, name)
            os.makedirs(wd)
            for f in ("hf.json", "prompts.json", "hf-f32-first-logits.npy"):
                shutil.copy(os.path.join(src, f), wd)
            if case == "faithful":
                seqs = ref["variants"]["bf16h"]["sequences"]
                first = np.load(os.path.join(src, "hf-bf16h-first-logits.npy"))
            else:
                m = hf.load(d, "bf16", a.device)
                _break(m, case)
                seqs, rows = [], []
                for p in prompts:
                    g = hf.greedy(m, p, ref["new_tokens"], a.device, "f32")
                    rows.append(g.pop("first_logits"))
                    seqs.append(g)
                first = np.stack(rows)
                del m
            _fake_run(os.path.join(wd, "kiln-cpu-b1.json"), seqs, first, case)
            ns = argparse.Namespace(
                work=tw, models=[name], device=a.device, out=os.path.join(tw, "out"),
                command="selftest", threads=a.threads,
            )
            try:
                compare.run(ns)
                passed = True
            except SystemExit as e:
                passed = e.code in (0, None)
            want = case == "faithful"
            log(f"selftest {name} {case}: judge says {'PASS' if passed else 'FAIL'} (want {'PASS' if want else 'FAIL'})")
            if passed != want:
                failures.append(f"{name} {case}")
    if failures:
        raise SystemExit(f"selftest: the judge got these wrong: {failures}")


def rel_errors(x: np.ndarray, ref: np.ndarray) -> list[float]:
    """Per row: ||x - ref|| / ||ref||."""
    x = x.astype(np.float64)
    ref = ref.astype(np.float64)
    return (np.linalg.norm(x - ref, axis=1) / np.linalg.norm(ref, axis=1)).tolist()


def cmd_self_drafts(a) -> None:
    """Drafts from kiln's own plain greedy run: verification must accept all
    of them wherever the verified step agrees with plain decoding."""
    run = read_json(a.run)
    seqs = sorted(run["sequences"], key=lambda s: s["prompt"])
    write_json(a.out, {"source": os.path.basename(a.run), "kind": "self", "continuations": [s["tokens"] for s in seqs]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("models", help="write the random-weight battery")
    p.add_argument("--work", required=True)
    p.add_argument("--models", nargs="*")
    p.set_defaults(fn=cmd_models)
    p = sub.add_parser("reference", help="HF greedy (f32 oracle, bf16) and the noise floor")
    p.add_argument("--work", required=True)
    p.add_argument("--models", nargs="*")
    p.add_argument("--device", default="cpu")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--prompts", type=int, default=0, help="only the first N prompts (0: all)")
    p.add_argument("--threads", type=int, default=0)
    p.set_defaults(fn=cmd_reference)
    p = sub.add_parser("compare", help="score kiln's runs and write the report")
    p.add_argument("--work", required=True)
    p.add_argument("--models", nargs="*")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True, help="directory for oracle-report.{md,json}")
    p.add_argument("--command", default="", help="the command line to record in the report")
    p.add_argument("--threads", type=int, default=0)
    p.set_defaults(fn=lambda a: __import__("compare").run(a))
    p = sub.add_parser("selftest", help="check that the judge passes HF bf16 and fails planted bugs")
    p.add_argument("--work", required=True)
    p.add_argument("--models", nargs="*")
    p.add_argument("--device", default="cpu")
    p.add_argument("--bugs", nargs="*", default=["norm-weight", "rope-theta"])
    p.add_argument("--threads", type=int, default=0)
    p.set_defaults(fn=cmd_selftest)
    p = sub.add_parser("self-drafts", help="drafts.json from a kiln greedy run")
    p.add_argument("--run", required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_self_drafts)
    a = ap.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
