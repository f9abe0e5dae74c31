//! The one decoder builder every family shares: the list of weights a
//! [`DecoderConfig`] reads, and the traced decode step for one shape key.
//!
//! The graph is deliberately plain (one op per HF module call): the planner's
//! passes fuse add+norm, q/k/v, gate/up and rope+kv-write afterwards, so the
//! frontend stays a readable transcription of the HF forward pass and every
//! fusion is tested in one place. Families differ only through the config's
//! flags (biases, q/k norm, windows, tied embeddings, and Gemma's (1+w) and
//! sandwich norms, GELU-tanh MLP, embedding scale, local RoPE and softcaps),
//! never through code paths of their own.

use super::{FrontendError, TraceOptions};
use crate::config::{DecoderConfig, MlpAct};
use kiln_ir::plan::KvLayout;
use kiln_ir::{AttnAttrs, DType, Graph, InputRole, Key, Op, TensorType, ValueId, WeightManifest};
use std::collections::HashMap;

/// Activation and weight dtype of traced graphs.
pub const ACT: DType = DType::BF16;

/// Every weight the decoder reads, in the order a trace first reads it, with
/// the shape config.json implies: `(safetensors key, shape)`.
pub fn required_weights(c: &DecoderConfig) -> Vec<(String, Vec<u32>)> {
    let (h, v, i, hd) = (c.hidden_size, c.vocab_size, c.intermediate_size, c.head_dim);
    let q = c.num_heads * hd;
    let kv = c.num_kv_heads * hd;
    let mut w: Vec<(String, Vec<u32>)> = Vec::new();
    let mut push = |name: String, shape: Vec<u32>| w.push((name, shape));
    push("model.embed_tokens.weight".into(), vec![v, h]);
    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}.");
        push(format!("{p}input_layernorm.weight"), vec![h]);
        for (proj, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
            push(format!("{p}self_attn.{proj}.weight"), vec![rows, h]);
            if c.qkv_bias {
                push(format!("{p}self_attn.{proj}.bias"), vec![rows]);
            }
        }
        if c.qk_norm {
            push(format!("{p}self_attn.q_norm.weight"), vec![hd]);
            push(format!("{p}self_attn.k_norm.weight"), vec![hd]);
        }
        push(format!("{p}self_attn.o_proj.weight"), vec![h, q]);
        if c.o_bias {
            push(format!("{p}self_attn.o_proj.bias"), vec![h]);
        }
        push(format!("{p}post_attention_layernorm.weight"), vec![h]);
        if c.sandwich_norms {
            push(format!("{p}pre_feedforward_layernorm.weight"), vec![h]);
        }
        for (proj, rows, cols) in [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)] {
            push(format!("{p}mlp.{proj}.weight"), vec![rows, cols]);
            if c.mlp_bias {
                push(format!("{p}mlp.{proj}.bias"), vec![rows]);
            }
        }
        if c.sandwich_norms {
            push(format!("{p}post_feedforward_layernorm.weight"), vec![h]);
        }
    }
    push("model.norm.weight".into(), vec![h]);
    if !c.tie_word_embeddings {
        push("lm_head.weight".into(), vec![v, h]);
    }
    w
}

/// Name of the output projection's weight (the embedding when tied).
pub fn lm_head_name(c: &DecoderConfig) -> &'static str {
    if c.tie_word_embeddings {
        "model.embed_tokens.weight"
    } else {
        "lm_head.weight"
    }
}

/// Checks that a KV layout fits the model, so tracing cannot build an
/// ill-typed graph.
pub fn check_kv(c: &DecoderConfig, kv: &KvLayout) -> Result<(), FrontendError> {
    let bad = |problem: String| Err(FrontendError::KvLayout { problem });
    for (what, got, want) in [
        ("layers", kv.layers, c.num_layers),
        ("kv_heads", kv.kv_heads, c.num_kv_heads),
        ("head_dim", kv.head_dim, c.head_dim),
    ] {
        if got != want {
            return bad(format!(
                "{what} is {got} but the model has {want}; build the layout with Model::kv_layout"
            ));
        }
    }
    if kv.dtype != ACT {
        return bad(format!(
            "dtype is {} but the traced step computes in {ACT}; use a {ACT} cache",
            kv.dtype
        ));
    }
    if kv.block_size == 0 || kv.num_blocks == 0 || kv.max_blocks_per_seq == 0 {
        return bad(format!(
            "block_size ({}), num_blocks ({}) and max_blocks_per_seq ({}) must all be at least 1",
            kv.block_size, kv.num_blocks, kv.max_blocks_per_seq
        ));
    }
    if kv.null_block >= kv.num_blocks {
        return bad(format!(
            "null_block {} is outside the {} blocks",
            kv.null_block, kv.num_blocks
        ));
    }
    if kv.slots() > u32::MAX as u64 {
        return bad(format!(
            "{} slots ({} blocks of {}) exceed the 2^32-1 rows a tensor shape can hold; use fewer blocks",
            kv.slots(),
            kv.num_blocks,
            kv.block_size
        ));
    }
    Ok(())
}

/// Weight values of a graph under construction, added on first use with the
/// manifest's type.
struct Weights<'a> {
    manifest: HashMap<&'a str, TensorType>,
    added: HashMap<String, ValueId>,
}

impl Weights<'_> {
    fn get(&mut self, g: &mut Graph, name: &str) -> ValueId {
        if let Some(&v) = self.added.get(name) {
            return v;
        }
        let ty = self
            .manifest
            .get(name)
            .unwrap_or_else(|| panic!("frontend bug: `{name}` is not in the manifest"))
            .clone();
        let v = g.add_weight(name, ty);
        self.added.insert(name.to_string(), v);
        v
    }
}

/// Traces the decode step of `key`. `manifest` must come from
/// [`required_weights`] of the same config (the model checked it at open).
pub fn trace(
    c: &DecoderConfig,
    architecture: &str,
    manifest: &WeightManifest,
    key: Key,
    kv: &KvLayout,
    opts: &TraceOptions,
) -> Result<Graph, FrontendError> {
    let key = key.validate()?;
    check_kv(c, kv)?;
    let too_large = || FrontendError::UnsupportedKey {
        key,
        problem: "batch*query overflows a 32-bit token count; use a smaller key".into(),
    };
    let (b, q, spec) = (key.batch, key.query, key.spec);
    let t = b.checked_mul(q).ok_or_else(too_large)?;
    if spec > 0 && q != spec + 1 {
        return Err(FrontendError::UnsupportedKey {
            key,
            problem: format!(
                "a verification step scores the last accepted token and its {spec} draft(s), so query must be spec+1 = {}; use b{b}q{}s{spec}",
                spec + 1,
                spec + 1
            ),
        });
    }

    let mut g = Graph::new(format!("{architecture} {key}"));
    let mut w = Weights {
        manifest: manifest
            .entries
            .iter()
            .map(|e| (e.name.as_str(), e.ty()))
            .collect(),
        added: HashMap::new(),
    };
    let i32t = |dims: Vec<u32>| TensorType::new(DType::I32, dims);
    let token_ids = g.add_input(InputRole::TokenIds, i32t(vec![t]));
    let positions = g.add_input(InputRole::Positions, i32t(vec![t]));
    let slots = g.add_input(InputRole::SlotMapping, i32t(vec![t]));
    let block_tables = g.add_input(InputRole::BlockTables, i32t(vec![b, kv.max_blocks_per_seq]));
    let context_lens = g.add_input(InputRole::ContextLens, i32t(vec![b]));
    let drafts = (spec > 0).then(|| g.add_input(InputRole::DraftTokens, i32t(vec![b * spec])));
    let sampling = (opts.sampling && spec == 0).then(|| {
        (
            g.add_input(
                InputRole::SampleParams,
                TensorType::new(DType::F32, vec![b, 4]),
            ),
            g.add_input(InputRole::SampleSeeds, i32t(vec![b, 4])),
            (opts.penalty_slots > 0).then(|| {
                g.add_input(
                    InputRole::SamplePenalties,
                    i32t(vec![b, 2 + 2 * opts.penalty_slots]),
                )
            }),
        )
    });
    let cache_ty = TensorType::new(
        kv.dtype,
        vec![kv.slots() as u32, c.num_kv_heads * c.head_dim],
    );
    let mut caches = Vec::with_capacity(c.num_layers as usize);
    for l in 0..c.num_layers {
        let k = g.add_input(InputRole::KCache(l), cache_ty.clone());
        let v = g.add_input(InputRole::VCache(l), cache_ty.clone());
        caches.push((k, v));
    }

    let norm = Op::RmsNorm {
        eps: c.rms_norm_eps,
        unit_offset: c.norm_unit_offset,
    };
    let mm = |bias: bool| Op::MatMul { bias, out: ACT };
    let embed = w.get(&mut g, "model.embed_tokens.weight");
    let mut h = g.push1(Op::Embedding, &[token_ids, embed]);
    if let Some(factor) = c.embed_scale {
        h = g.push1(
            Op::Scale {
                factor,
                softcap: None,
            },
            &[h],
        );
    }
    let attn_scale = c
        .attn_scale
        .unwrap_or_else(|| 1.0 / (c.head_dim as f32).sqrt());
    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}.");
        let ln = w.get(&mut g, &format!("{p}input_layernorm.weight"));
        let x = g.push1(norm.clone(), &[h, ln]);
        let proj = |g: &mut Graph, w: &mut Weights, name: &str, bias: bool, x: ValueId| {
            let mut args = vec![x, w.get(g, &format!("{p}{name}.weight"))];
            if bias {
                args.push(w.get(g, &format!("{p}{name}.bias")));
            }
            g.push1(mm(bias), &args)
        };
        let mut qv = proj(&mut g, &mut w, "self_attn.q_proj", c.qkv_bias, x);
        let mut kv_ = proj(&mut g, &mut w, "self_attn.k_proj", c.qkv_bias, x);
        let vv = proj(&mut g, &mut w, "self_attn.v_proj", c.qkv_bias, x);
        if c.qk_norm {
            let qn = w.get(&mut g, &format!("{p}self_attn.q_norm.weight"));
            let kn = w.get(&mut g, &format!("{p}self_attn.k_norm.weight"));
            let head_norm = |heads: u32| Op::HeadRmsNorm {
                heads,
                head_dim: c.head_dim,
                eps: c.rms_norm_eps,
                unit_offset: c.norm_unit_offset,
            };
            qv = g.push1(head_norm(c.num_heads), &[qv, qn]);
            kv_ = g.push1(head_norm(c.num_kv_heads), &[kv_, kn]);
        }
        let window = c.windows[l as usize];
        let layer_rope = match (&c.local_rope, window) {
            (Some(local), Some(_)) => local,
            _ => &c.rope,
        };
        let rope = |heads: u32| Op::Rope {
            heads,
            head_dim: c.head_dim,
            rope: layer_rope.clone(),
        };
        qv = g.push1(rope(c.num_heads), &[qv, positions]);
        kv_ = g.push1(rope(c.num_kv_heads), &[kv_, positions]);
        let (kc, vc) = caches[l as usize];
        let written = g.push(Op::KvWrite, &[kv_, vv, slots, kc, vc]);
        let attn = g.push1(
            Op::PagedAttention(AttnAttrs {
                heads: c.num_heads,
                kv_heads: c.num_kv_heads,
                head_dim: c.head_dim,
                query: q,
                block_size: kv.block_size,
                scale: attn_scale,
                window,
                softcap: c.attn_softcap,
            }),
            &[qv, written[0], written[1], block_tables, context_lens],
        );
        let mut o = proj(&mut g, &mut w, "self_attn.o_proj", c.o_bias, attn);
        // Gemma: the attention output is normed before the residual add,
        // and the MLP has its own input norm.
        let mlp_norm = if c.sandwich_norms {
            let ln2 = w.get(&mut g, &format!("{p}post_attention_layernorm.weight"));
            o = g.push1(norm.clone(), &[o, ln2]);
            "pre_feedforward_layernorm"
        } else {
            "post_attention_layernorm"
        };
        h = g.push1(Op::Add, &[o, h]);
        let ln = w.get(&mut g, &format!("{p}{mlp_norm}.weight"));
        let x = g.push1(norm.clone(), &[h, ln]);
        let gate = proj(&mut g, &mut w, "mlp.gate_proj", c.mlp_bias, x);
        let up = proj(&mut g, &mut w, "mlp.up_proj", c.mlp_bias, x);
        let act_op = match c.mlp_act {
            MlpAct::Silu => Op::SiluMul,
            MlpAct::GeluTanh => Op::GeluTanhMul,
        };
        let act = g.push1(act_op, &[gate, up]);
        let mut down = proj(&mut g, &mut w, "mlp.down_proj", c.mlp_bias, act);
        if c.sandwich_norms {
            let ln3 = w.get(&mut g, &format!("{p}post_feedforward_layernorm.weight"));
            down = g.push1(norm.clone(), &[down, ln3]);
        }
        h = g.push1(Op::Add, &[down, h]);
    }
    let final_norm = w.get(&mut g, "model.norm.weight");
    let mut x = g.push1(norm, &[h, final_norm]);
    if spec == 0 && q > 1 {
        x = g.push1(Op::GatherLast { group: q }, &[x]);
    }
    let lm_head = w.get(&mut g, lm_head_name(c));
    let mut logits = g.push1(
        Op::MatMul {
            bias: false,
            out: DType::F32,
        },
        &[x, lm_head],
    );
    if let Some(cap) = c.final_softcap {
        logits = g.push1(
            Op::Scale {
                factor: 1.0,
                softcap: Some(cap),
            },
            &[logits],
        );
    }
    let next = match sampling {
        Some((params, seeds, None)) => g.push1(Op::Sample, &[logits, params, seeds]),
        Some((params, seeds, Some(pens))) => g.push1(Op::Sample, &[logits, params, seeds, pens]),
        None => g.push1(Op::Argmax, &[logits]),
    };
    g.add_output("next_tokens", next);
    if let Some(drafts) = drafts {
        let accepted = g.push1(Op::AcceptGreedy { spec }, &[next, drafts]);
        g.add_output("accepted", accepted);
    }
    if opts.logits {
        g.add_output("logits", logits);
    }
    Ok(g)
}
