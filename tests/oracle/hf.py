"""Hugging Face transformers as the oracle: greedy decoding and teacher-forced scoring.

Why this exists: the oracle's reference numbers come from HF's own modeling
code, run the plainest way (an explicit greedy loop over `model(...)` with a
`DynamicCache`, no `generate()` logits processors, no stopping on EOS), so
the only thing compared is the model's forward pass.

* `greedy`: prompt prefilled in one forward pass, then one token per step;
  records every step's top-2 logits and margin, and the first step's full
  logits row. `head="f32"` computes the logits from the decoder's hidden
  states with the lm_head weight in f32 (bf16 activations, f32 logits: kiln's
  numerics); `head="model"` is HF's own lm_head.
* `score`: one forward pass over prompt + a given continuation (teacher
  forcing); for every continuation position, HF's top-2 under that prefix and
  HF's logit of the given token. This is what judges a kiln sequence after it
  has left HF's own greedy path: each kiln token must be HF's argmax under
  kiln's prefix or within a near-tie of it.

Batching: HF runs every prompt alone (batch 1). Greedy decoding of one
sequence does not depend on what else is in the batch in exact arithmetic,
and a padded HF batch would add HF's own padding/position-id handling to what
is compared. kiln's batch-1 and batch-8 runs are both compared to these
per-prompt results.

Not here: sampling, tokenizers.
"""

from __future__ import annotations

import numpy as np


def dtype_of(name: str):
    import torch

    return {"f32": torch.float32, "bf16": torch.bfloat16}[name]


def load(model_dir: str, dtype: str, device: str, gguf_file: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    # The f32 oracle must be f32: no TF32 in matmuls on GPUs that have it.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    kwargs = {"dtype": dtype_of(dtype), "attn_implementation": "eager"}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    model.to(device)
    model.eval()
    torch.set_grad_enabled(False)
    return model


def _top2(row) -> tuple[int, int, float, float]:
    import torch

    v, i = torch.topk(row.float(), 2)
    return int(i[0]), int(i[1]), float(v[0]), float(v[1])


def logits_of(model, hidden, head: str):
    """Logits from the decoder's final hidden states: `head="model"` is HF's
    own lm_head (bf16 logits for a bf16 model); `head="f32"` multiplies the
    hidden states by the lm_head weight in f32, as kiln does (bf16
    activations, f32 logits)."""
    import torch

    if head == "model":
        logits = model.lm_head(hidden)
    else:
        w = model.get_output_embeddings().weight
        logits = hidden.float() @ w.float().t()
    # Gemma's final_logit_softcapping (applied by *ForCausalLM.forward, which
    # this module bypasses to choose the head's precision).
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def forward(model, head: str, **kw):
    """One decoder pass; returns (logits, past_key_values)."""
    out = model.model(**kw)
    return logits_of(model, out.last_hidden_state, head), out.past_key_values


def greedy(model, prompt: list[int], new_tokens: int, device: str, head: str = "model") -> dict:
    """Greedy decoding of one prompt. Returns tokens, per-step top-2 and the
    first step's logits (numpy f32)."""
    import torch
    from transformers import DynamicCache

    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    logits, past = forward(
        model, head, input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True
    )
    row = logits[0, -1]
    first_logits = row.float().cpu().numpy()
    tokens, top2, margins = [], [], []
    for step in range(new_tokens):
        a, b, va, vb = _top2(row)
        tokens.append(a)
        top2.append(b)
        margins.append(va - vb)
        if step + 1 == new_tokens:
            break
        pos = len(prompt) + step
        logits, past = forward(
            model,
            head,
            input_ids=torch.tensor([[a]], dtype=torch.long, device=device),
            past_key_values=past,
            use_cache=True,
            position_ids=torch.tensor([[pos]], device=device),
        )
        row = logits[0, -1]
    return {"tokens": tokens, "top2": top2, "margins": margins, "first_logits": first_logits}


def rows(model, prompt: list[int], continuation: list[int], device: str, head: str = "model"):
    """Teacher-forced logits (f32 tensor) of the rows that predict each
    continuation token: one pass over prompt + continuation[:-1]."""
    import torch

    seq = prompt + continuation[:-1]
    ids = torch.tensor([seq], dtype=torch.long, device=device)
    logits, _ = forward(model, head, input_ids=ids, use_cache=False)
    return logits[0, len(prompt) - 1 :].float()


def score(model, prompt: list[int], continuation: list[int], device: str) -> dict:
    """Teacher-forced: HF's view of each continuation token given the tokens
    before it. Returns per position: HF's argmax, second, their logits, and
    the logit of the given token."""
    import torch

    if not continuation:
        return {"argmax": [], "second": [], "top": [], "next": [], "given": []}
    r = rows(model, prompt, continuation, device)
    v, i = torch.topk(r, 2, dim=-1)
    given = r.gather(1, torch.tensor(continuation, device=r.device).view(-1, 1))
    return {
        "argmax": i[:, 0].tolist(),
        "second": i[:, 1].tolist(),
        "top": v[:, 0].tolist(),
        "next": v[:, 1].tolist(),
        "given": given[:, 0].tolist(),
    }


def make_prompts(vocab: int, seed: int, lengths: list[int]) -> list[list[int]]:
    """Random token-id prompts of the given lengths (ids in [0, vocab))."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]
