#!/usr/bin/env python3
"""Independent f32 reference of Gemma-3-270M's greedy decode, straight from the GGUF.

Dequantizes every tensor with the `gguf` package (no kiln code), runs the Gemma-3
forward pass in numpy (f32, whole sequence, no cache) and prints the token ids after
greedy decoding. llama.cpp stores Gemma norm weights with the +1 already added, so
they are used as `x * w` here. Layer pattern, thetas, window and the 25.25 embedding
scale (bf16(sqrt(640))) are Gemma-3-270M's.

    python3 scripts/gemma3_numpy_reference.py GGUF 2,818,5279,529,7001,563 8

(the ids: "The capital of France is" with BOS). tests/tests/gemma3_real.rs
compares kiln's greedy tokens with this script's answer.
"""
import sys, numpy as np, gguf
from gguf.quants import dequantize
r = gguf.GGUFReader(sys.argv[1])
T = {}
for t in r.tensors:
    a = dequantize(t.data, t.tensor_type).astype(np.float32)
    T[t.name] = a.reshape([int(x) for x in reversed(t.shape)]) if a.ndim == 1 and len(t.shape) > 1 else a
ids = [int(x) for x in sys.argv[2].split(',')]
n_new = int(sys.argv[3])
H, L, NH, HD, eps = 640, 18, 4, 256, 1e-6
def rms(x, w): return x / np.sqrt((x*x).mean(-1, keepdims=True) + eps) * w
def gelu(g): return 0.5*g*(1+np.tanh(np.sqrt(2/np.pi)*(g+0.044715*g**3)))
def rope(x, pos, theta):
    half = HD//2
    inv = 1.0/theta**(np.arange(half)*2/HD)
    ang = np.outer(pos, inv); c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a*c[:,None,:]-b*s[:,None,:], b*c[:,None,:]+a*s[:,None,:]], -1)
E = T['token_embd.weight']
print(E.shape, file=sys.stderr)
for step in range(n_new):
    n = len(ids); pos = np.arange(n)
    h = E[ids] * np.float32(25.25)
    for l in range(L):
        p = f'blk.{l}.'
        sliding = (l+1) % 6 != 0
        theta = 10000.0 if sliding else 1e6
        x = rms(h, T[p+'attn_norm.weight'])
        q = (x @ T[p+'attn_q.weight'].T).reshape(n, NH, HD)
        k = (x @ T[p+'attn_k.weight'].T).reshape(n, 1, HD)
        v = (x @ T[p+'attn_v.weight'].T).reshape(n, 1, HD)
        q = rope(rms(q, T[p+'attn_q_norm.weight']), pos, theta)
        k = rope(rms(k, T[p+'attn_k_norm.weight']), pos, theta)
        s = np.einsum('qhd,khd->hqk', q, np.repeat(k, NH, 1)) / 16.0
        mask = np.tril(np.ones((n, n), bool))
        if sliding: mask &= (pos[:,None] - pos[None,:]) < 512
        s = np.where(mask, s, -1e30); s = s - s.max(-1, keepdims=True); e = np.exp(s); e /= e.sum(-1, keepdims=True)
        o = np.einsum('hqk,khd->qhd', e, np.repeat(v, NH, 1)).reshape(n, NH*HD)
        o = o @ T[p+'attn_output.weight'].T
        h = h + rms(o, T[p+'post_attention_norm.weight'])
        x = rms(h, T[p+'ffn_norm.weight'])
        m = (gelu(x @ T[p+'ffn_gate.weight'].T) * (x @ T[p+'ffn_up.weight'].T)) @ T[p+'ffn_down.weight'].T
        h = h + rms(m, T[p+'post_ffw_norm.weight'])
    logits = rms(h[-1], T['output_norm.weight']) @ E.T
    top = np.argsort(-logits)[:3]
    print(step, top.tolist(), logits[top].tolist(), file=sys.stderr)
    ids.append(int(top[0]))
print(ids)
