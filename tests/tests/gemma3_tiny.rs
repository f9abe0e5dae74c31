//! A tiny random Gemma-3 (3 layers: local, global, local; window 8), traced
//! by the frontend, compiled and decoded by the CPU engine, against a
//! straight-line CPU computation of the Gemma-3 forward pass written here
//! from Hugging Face's `Gemma3ForCausalLM` (not from kiln's graph): scaled
//! embeddings, (1+w) RMSNorms, q/k norms, sandwich norms, GELU-tanh MLP,
//! `query_pre_attn_scalar`, local/global RoPE bases, the sliding window and
//! the final logit softcap.
//!
//! The reference rounds to bf16 where HF's bf16 modules do, and runs the
//! whole sequence at once (no KV cache), so the engine's paged, chunked,
//! graph-replayed decode is checked against an unrelated computation. Each
//! Gemma difference is also switched off in the reference once, and the
//! engine's logits must be far from that variant: a frontend that dropped
//! the difference would fail.

mod serve_common;

use half::bf16;
use kiln_compiler::testing::{
    gemma3_layer_is_sliding, gemma3_query_pre_attn_scalar, Family, TinySpec,
    GEMMA3_TINY_FINAL_SOFTCAP,
};
use kiln_runtime::{GraphMode, SeqOptions};
use serve_common::*;
use std::collections::HashMap;

/// Weights of the tiny model as f32.
struct W(HashMap<String, Vec<f32>>);

impl W {
    fn load(dir: &std::path::Path) -> W {
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut m = HashMap::new();
        for (name, view) in st.tensors() {
            assert_eq!(view.dtype(), safetensors::Dtype::BF16, "{name}");
            let v: Vec<f32> = view
                .data()
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect();
            m.insert(name.to_string(), v);
        }
        W(m)
    }
    fn get(&self, n: &str) -> &[f32] {
        self.0
            .get(n)
            .unwrap_or_else(|| panic!("no tensor {n}"))
            .as_slice()
    }
}

/// Which Gemma-3 features the reference applies (all, except in the
/// "switched off" variants).
#[derive(Clone, Copy)]
struct Feat {
    window: bool,
    local_rope: bool,
    unit_offset: bool,
    embed_scale: bool,
    sandwich: bool,
    attn_scalar: bool,
    softcap: bool,
}

const ALL: Feat = Feat {
    window: true,
    local_rope: true,
    unit_offset: true,
    embed_scale: true,
    sandwich: true,
    attn_scalar: true,
    softcap: true,
};

fn r(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// `x / sqrt(mean(x^2) + eps) * (1 + w)` in f32, rounded once (Gemma3RMSNorm).
fn norm(x: &[f32], w: &[f32], eps: f32, unit: bool) -> Vec<f32> {
    let ms = x.iter().map(|v| (v * v) as f64).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, g)| {
            let g = if unit { 1.0 + *g as f64 } else { *g as f64 };
            r((*v as f64 * inv * g) as f32)
        })
        .collect()
}

/// `x @ w^T` for `w: [n, k]`, f64 accumulation.
fn lin(x: &[f32], w: &[f32], n: usize) -> Vec<f32> {
    let k = x.len();
    (0..n)
        .map(|i| {
            let row = &w[i * k..(i + 1) * k];
            x.iter()
                .zip(row)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>() as f32
        })
        .collect()
}

fn gelu_tanh(g: f64) -> f64 {
    0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh())
}

/// Rotate-half RoPE of one head at position `pos`.
fn rope(x: &mut [f32], pos: usize, theta: f64) {
    let hd = x.len();
    let half = hd / 2;
    for i in 0..half {
        let inv = 1.0 / theta.powf((2 * i) as f64 / hd as f64);
        let (s, c) = (pos as f64 * inv).sin_cos();
        let (a, b) = (x[i] as f64, x[i + half] as f64);
        x[i] = r((a * c - b * s) as f32);
        x[i + half] = r((b * c + a * s) as f32);
    }
}

/// Logits at every position of `tokens`.
fn reference(spec: &TinySpec, w: &W, tokens: &[u32], f: Feat) -> Vec<Vec<f32>> {
    let (hdim, heads, kvh, hd) = (
        spec.hidden as usize,
        spec.heads as usize,
        spec.kv_heads as usize,
        spec.head_dim() as usize,
    );
    let (inter, vocab, eps) = (
        spec.intermediate as usize,
        spec.vocab as usize,
        spec.rms_norm_eps,
    );
    let emb = w.get("model.embed_tokens.weight");
    let scale = if f.embed_scale {
        r((hdim as f64).sqrt() as f32)
    } else {
        1.0
    };
    let mut h: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&t| {
            emb[t as usize * hdim..(t as usize + 1) * hdim]
                .iter()
                .map(|v| r(v * scale))
                .collect()
        })
        .collect();
    let n = tokens.len();
    let scalar = if f.attn_scalar {
        gemma3_query_pre_attn_scalar(spec) as f64
    } else {
        hd as f64
    };
    for l in 0..spec.layers {
        let p = format!("model.layers.{l}.");
        let g = |s: &str| w.get(&format!("{p}{s}.weight"));
        let sliding = gemma3_layer_is_sliding(l);
        let theta = if sliding && f.local_rope {
            10000.0
        } else {
            spec.rope_theta as f64
        };
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in h.iter().enumerate() {
            let x = norm(x, g("input_layernorm"), eps, f.unit_offset);
            let mut q: Vec<f32> = lin(&x, g("self_attn.q_proj"), heads * hd)
                .into_iter()
                .map(r)
                .collect();
            let mut k: Vec<f32> = lin(&x, g("self_attn.k_proj"), kvh * hd)
                .into_iter()
                .map(r)
                .collect();
            let v: Vec<f32> = lin(&x, g("self_attn.v_proj"), kvh * hd)
                .into_iter()
                .map(r)
                .collect();
            for head in q.chunks_exact_mut(hd) {
                let nq = norm(head, g("self_attn.q_norm"), eps, f.unit_offset);
                head.copy_from_slice(&nq);
                rope(head, pos, theta);
            }
            for head in k.chunks_exact_mut(hd) {
                let nk = norm(head, g("self_attn.k_norm"), eps, f.unit_offset);
                head.copy_from_slice(&nk);
                rope(head, pos, theta);
            }
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for t in 0..n {
            let mut attn = vec![0f32; heads * hd];
            for head in 0..heads {
                let kh = head / (heads / kvh);
                let q = &qs[t][head * hd..(head + 1) * hd];
                let first = if sliding && f.window {
                    (t + 1).saturating_sub(spec.sliding_window.unwrap() as usize)
                } else {
                    0
                };
                let scores: Vec<f64> = (first..=t)
                    .map(|j| {
                        let k = &ks[j][kh * hd..(kh + 1) * hd];
                        q.iter()
                            .zip(k)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            * scalar.powf(-0.5)
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let acc: f64 = (first..=t)
                        .zip(&e)
                        .map(|(j, p)| p / z * vs[j][kh * hd + d] as f64)
                        .sum();
                    attn[head * hd + d] = r(acc as f32);
                }
            }
            let mut o: Vec<f32> = lin(&attn, g("self_attn.o_proj"), hdim)
                .into_iter()
                .map(r)
                .collect();
            let mlp_norm = if f.sandwich {
                o = norm(&o, g("post_attention_layernorm"), eps, f.unit_offset);
                "pre_feedforward_layernorm"
            } else {
                "post_attention_layernorm"
            };
            for (a, b) in h[t].iter_mut().zip(&o) {
                *a = r(*a + b);
            }
            let x = norm(&h[t], g(mlp_norm), eps, f.unit_offset);
            let gate = lin(&x, g("mlp.gate_proj"), inter);
            let up = lin(&x, g("mlp.up_proj"), inter);
            let act: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(a, b)| r((gelu_tanh(r(*a) as f64) * r(*b) as f64) as f32))
                .collect();
            let mut down: Vec<f32> = lin(&act, g("mlp.down_proj"), hdim)
                .into_iter()
                .map(r)
                .collect();
            if f.sandwich {
                down = norm(&down, g("post_feedforward_layernorm"), eps, f.unit_offset);
            }
            for (a, b) in h[t].iter_mut().zip(&down) {
                *a = r(*a + b);
            }
        }
    }
    h.iter()
        .map(|x| {
            let x = norm(x, w.get("model.norm.weight"), eps, f.unit_offset);
            lin(&x, emb, vocab)
                .into_iter()
                .map(|v| {
                    if f.softcap {
                        let c = GEMMA3_TINY_FINAL_SOFTCAP as f64;
                        (c * (v as f64 / c).tanh()) as f32
                    } else {
                        v
                    }
                })
                .collect()
        })
        .collect()
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decode of each prompt, alone or all at once: tokens and the
/// logits row behind each token.
fn decode(
    t: &Tiny,
    prompts: &[Vec<u32>],
    n: u32,
    together: bool,
) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    let run = |batch: &[Vec<u32>]| {
        let mut e = engine(t, options(GraphMode::On));
        let ids: Vec<_> = batch
            .iter()
            .map(|p| {
                e.add_sequence_with(
                    p,
                    SeqOptions {
                        max_new_tokens: n,
                        stop_on_eos: false,
                    },
                )
                .unwrap()
            })
            .collect();
        let mut rows: Vec<Vec<Vec<f32>>> = vec![Vec::new(); ids.len()];
        while e.has_work() {
            for (id, _) in e.step().unwrap() {
                let i = ids.iter().position(|x| *x == id).unwrap();
                rows[i].push(e.last_logits(id).unwrap().to_vec());
            }
        }
        let replays: u64 = e.counters().values().map(|c| c.replays).sum();
        assert!(replays > 0, "no graph was replayed");
        ids.iter()
            .zip(rows)
            .map(|(&id, rows)| (e.sequence(id).unwrap().generated.to_vec(), rows))
            .collect::<Vec<_>>()
    };
    if together {
        run(prompts)
    } else {
        prompts
            .iter()
            .flat_map(|p| run(std::slice::from_ref(p)))
            .collect()
    }
}

#[test]
fn tiny_gemma3_decodes_like_a_straight_line_gemma3_forward_pass_and_each_difference_matters() {
    let spec = TinySpec::for_family(Family::Gemma3);
    let t = compile_tiny(Family::Gemma3, &spec, KEYS, true);
    let w = W::load(t.dir.path());
    let mut rng = Rng::new(33);
    // Longer than the window (8), so local layers drop early positions.
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| rng.prompt(spec.vocab, 11 + 2 * i)).collect();
    let n = 6;
    let got = decode(&t, &prompts, n, false);
    let variants: [(&str, Feat); 7] = [
        (
            "no sliding window",
            Feat {
                window: false,
                ..ALL
            },
        ),
        (
            "global rope on local layers",
            Feat {
                local_rope: false,
                ..ALL
            },
        ),
        (
            "plain (w) norms",
            Feat {
                unit_offset: false,
                ..ALL
            },
        ),
        (
            "unscaled embeddings",
            Feat {
                embed_scale: false,
                ..ALL
            },
        ),
        (
            "no sandwich norms",
            Feat {
                sandwich: false,
                ..ALL
            },
        ),
        (
            "1/sqrt(head_dim) scale",
            Feat {
                attn_scalar: false,
                ..ALL
            },
        ),
        (
            "no final softcap",
            Feat {
                softcap: false,
                ..ALL
            },
        ),
    ];
    let mut worst = 0f32;
    let mut variant_gap = vec![0f32; variants.len()];
    for (prompt, (tokens, rows)) in prompts.iter().zip(&got) {
        assert_eq!(tokens.len(), n as usize);
        let mut seq = prompt.clone();
        seq.extend_from_slice(tokens);
        let want = reference(&spec, &w, &seq, ALL);
        for (i, row) in rows.iter().enumerate() {
            let pos = prompt.len() - 1 + i;
            let d = max_diff(row, &want[pos]);
            worst = worst.max(d);
            // Greedy agrees unless the reference's top two are within the
            // tolerance (a near-tie).
            let top = argmax(&want[pos]);
            let mut sorted = want[pos].clone();
            sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
            if sorted[0] - sorted[1] > 2.0 * TOL {
                assert_eq!(tokens[i], top, "prompt {prompt:?} token {i}");
            }
        }
        for (vi, (_, f)) in variants.iter().enumerate() {
            let other = reference(&spec, &w, &seq, *f);
            let last = rows.len() - 1;
            let d = max_diff(&rows[last], &other[prompt.len() - 1 + last]);
            variant_gap[vi] = variant_gap[vi].max(d);
        }
    }
    eprintln!("worst {worst}, variant gaps {variant_gap:?}");
    assert!(
        worst <= TOL,
        "kiln's logits differ from the reference by {worst} > {TOL}"
    );
    for ((name, _), gap) in variants.iter().zip(&variant_gap) {
        assert!(
            *gap > 5.0 * TOL,
            "the reference with {name} is only {gap} from kiln's logits: the test cannot tell them apart"
        );
    }
    // b1 and b8: the same prompts decoded together give the same tokens.
    let more: Vec<Vec<u32>> = (0..8).map(|i| rng.prompt(spec.vocab, 5 + i)).collect();
    let alone = decode(&t, &more, 4, false);
    let together = decode(&t, &more, 4, true);
    for (a, b) in alone.iter().zip(&together) {
        assert_eq!(a.0, b.0, "batch of 8 differs from batch of 1");
    }
}

/// Largest logit difference accepted between kiln and the reference: bf16
/// rounding at slightly different points (kiln rounds fused ops once).
const TOL: f32 = 0.12;
