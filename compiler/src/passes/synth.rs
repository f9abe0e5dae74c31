//! Synthetic decoder graphs in the frontends' vocabulary, for tests and
//! benchmarks of the passes and the planner that must not depend on a model
//! on disk.
//!
//! The graphs follow the trace contract of the frontends: plain ops only
//! (`add`, `rms_norm`, separate q/k/v matmuls with bias for Qwen2,
//! `head_rms_norm` for Qwen3, `rope`, `kv_write`, `paged_attention`,
//! gate/up matmuls + two-argument `silu_mul`, an f32 `lm_head`, `argmax`,
//! `accept_greedy` when `spec > 0`), the standard inputs and the outputs
//! `next_tokens`, `accepted` (spec > 0) and `logits` (optional). Weight names
//! are the Hugging Face checkpoint names.
//!
//! Not here: reading configs or checkpoints (that is the frontend's job).

use kiln_ir::plan::KvLayout;
use kiln_ir::{
    AttnAttrs, DType, Graph, InputRole, Key, Op, Rope, RopeScaling, Shape, TensorRef, TensorType,
    WeightEntry, WeightManifest, WeightSource,
};

/// Which decoder family to imitate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthFamily {
    /// Llama / Mistral / SmolLM2: no biases, no q/k norm.
    Llama,
    /// Qwen2: q/k/v biases.
    Qwen2,
    /// Qwen3: q/k head norms.
    Qwen3,
}

/// Model dimensions.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthSpec {
    pub family: SynthFamily,
    pub vocab: u32,
    pub hidden: u32,
    pub layers: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub intermediate: u32,
    /// `lm_head` shares the embedding table.
    pub tied: bool,
    pub dtype: DType,
}

impl SynthSpec {
    /// A tiny model of `family` (fast to build, big enough to exercise GQA).
    pub fn tiny(family: SynthFamily) -> SynthSpec {
        SynthSpec {
            family,
            vocab: 96,
            hidden: 32,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            intermediate: 48,
            tied: family == SynthFamily::Qwen3,
            dtype: DType::BF16,
        }
    }

    /// Qwen3-0.6B's shape.
    pub fn qwen3_0_6b() -> SynthSpec {
        SynthSpec {
            family: SynthFamily::Qwen3,
            vocab: 151936,
            hidden: 1024,
            layers: 28,
            heads: 16,
            kv_heads: 8,
            head_dim: 128,
            intermediate: 3072,
            tied: true,
            dtype: DType::BF16,
        }
    }

    /// The paged KV layout for `num_blocks` blocks (null block included).
    pub fn kv_layout(&self, block_size: u32, num_blocks: u32, max_context: u32) -> KvLayout {
        KvLayout {
            layers: self.layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            dtype: self.dtype,
            block_size,
            num_blocks,
            null_block: 0,
            max_blocks_per_seq: max_context.div_ceil(block_size),
        }
    }

    /// Every checkpoint tensor, in checkpoint order, name -> shape.
    pub fn tensors(&self) -> Vec<(String, Vec<u32>)> {
        let (h, q, kv, i) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        );
        let mut t = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab, h])];
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            t.push((format!("{p}.input_layernorm.weight"), vec![h]));
            t.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
            t.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
            t.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
            if self.family == SynthFamily::Qwen2 {
                t.push((format!("{p}.self_attn.q_proj.bias"), vec![q]));
                t.push((format!("{p}.self_attn.k_proj.bias"), vec![kv]));
                t.push((format!("{p}.self_attn.v_proj.bias"), vec![kv]));
            }
            if self.family == SynthFamily::Qwen3 {
                t.push((format!("{p}.self_attn.q_norm.weight"), vec![self.head_dim]));
                t.push((format!("{p}.self_attn.k_norm.weight"), vec![self.head_dim]));
            }
            t.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
            t.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            t.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
            t.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
            t.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
        }
        t.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tied {
            t.push(("lm_head.weight".to_string(), vec![self.vocab, h]));
        }
        t
    }

    /// The unfused manifest: one entry per checkpoint tensor.
    pub fn manifest(&self) -> WeightManifest {
        WeightManifest {
            entries: self
                .tensors()
                .into_iter()
                .map(|(name, shape)| WeightEntry {
                    name: name.clone(),
                    dtype: self.dtype,
                    shape: Shape(shape.clone()),
                    storage: None,
                    source: WeightSource::Tensor(TensorRef {
                        file: "model.safetensors".into(),
                        tensor: name,
                        dtype: self.dtype,
                        shape: Shape(shape),
                    }),
                })
                .collect(),
        }
    }

    /// The decode step of `key` over `kv`, plain ops only.
    pub fn graph(&self, key: Key, kv: &KvLayout, logits: bool) -> Graph {
        let d = self.dtype;
        let (t, b) = (key.tokens(), key.batch);
        let (h, qw, kvw) = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        );
        let mut g = Graph::new(format!("synthetic {:?} {key}", self.family));
        let i32v = |n: u32| TensorType::new(DType::I32, [n]);
        let ids = g.add_input(InputRole::TokenIds, i32v(t));
        let pos = g.add_input(InputRole::Positions, i32v(t));
        let slots = g.add_input(InputRole::SlotMapping, i32v(t));
        let tables = g.add_input(
            InputRole::BlockTables,
            TensorType::new(DType::I32, [b, kv.max_blocks_per_seq]),
        );
        let lens = g.add_input(InputRole::ContextLens, i32v(b));
        let drafts =
            (key.spec > 0).then(|| g.add_input(InputRole::DraftTokens, i32v(b * key.spec)));
        let cache_ty = TensorType::new(
            kv.dtype,
            [(kv.num_blocks * kv.block_size), kv.kv_heads * kv.head_dim],
        );
        let mut caches = Vec::new();
        for l in 0..self.layers {
            let kc = g.add_input(InputRole::KCache(l), cache_ty.clone());
            let vc = g.add_input(InputRole::VCache(l), cache_ty.clone());
            caches.push((kc, vc));
        }
        let shapes: std::collections::HashMap<String, Vec<u32>> =
            self.tensors().into_iter().collect();
        let mut w = |g: &mut Graph, name: &str| -> kiln_ir::ValueId {
            if let Some(v) = g.weight(name) {
                return v;
            }
            let shape = shapes[name].clone();
            g.add_weight(name, TensorType::new(d, shape))
        };
        let eps = 1e-6;
        let rope = Rope {
            theta: 10000.0,
            scaling: RopeScaling::None,
        };
        let mm = |bias| Op::MatMul { bias, out: d };
        let table = w(&mut g, "model.embed_tokens.weight");
        let mut hs = g.push1(Op::Embedding, &[ids, table]);
        let norm = Op::RmsNorm {
            eps,
            unit_offset: false,
        };
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            let ln = w(&mut g, &format!("{p}.input_layernorm.weight"));
            let x = g.push1(norm.clone(), &[hs, ln]);
            let bias = self.family == SynthFamily::Qwen2;
            let proj = |g: &mut Graph,
                        w: &mut dyn FnMut(&mut Graph, &str) -> kiln_ir::ValueId,
                        n: &str| {
                let wt = w(g, &format!("{p}.self_attn.{n}_proj.weight"));
                if bias {
                    let bs = w(g, &format!("{p}.self_attn.{n}_proj.bias"));
                    g.push1(mm(true), &[x, wt, bs])
                } else {
                    g.push1(mm(false), &[x, wt])
                }
            };
            let mut q = proj(&mut g, &mut w, "q");
            let mut k = proj(&mut g, &mut w, "k");
            let v = proj(&mut g, &mut w, "v");
            if self.family == SynthFamily::Qwen3 {
                let qn = w(&mut g, &format!("{p}.self_attn.q_norm.weight"));
                let kn = w(&mut g, &format!("{p}.self_attn.k_norm.weight"));
                let hn = |heads| Op::HeadRmsNorm {
                    heads,
                    head_dim: self.head_dim,
                    eps,
                    unit_offset: false,
                };
                q = g.push1(hn(self.heads), &[q, qn]);
                k = g.push1(hn(self.kv_heads), &[k, kn]);
            }
            let rp = |heads| Op::Rope {
                heads,
                head_dim: self.head_dim,
                rope: rope.clone(),
            };
            let q = g.push1(rp(self.heads), &[q, pos]);
            let k = g.push1(rp(self.kv_heads), &[k, pos]);
            let (kc, vc) = caches[l as usize];
            let kvw_ = g.push(Op::KvWrite, &[k, v, slots, kc, vc]);
            let attn = g.push1(
                Op::PagedAttention(AttnAttrs {
                    heads: self.heads,
                    kv_heads: self.kv_heads,
                    head_dim: self.head_dim,
                    query: key.query,
                    block_size: kv.block_size,
                    scale: 1.0 / (self.head_dim as f32).sqrt(),
                    window: None,
                    softcap: None,
                }),
                &[q, kvw_[0], kvw_[1], tables, lens],
            );
            let o = w(&mut g, &format!("{p}.self_attn.o_proj.weight"));
            let o = g.push1(mm(false), &[attn, o]);
            hs = g.push1(Op::Add, &[hs, o]);
            let ln2 = w(&mut g, &format!("{p}.post_attention_layernorm.weight"));
            let x2 = g.push1(norm.clone(), &[hs, ln2]);
            let gw = w(&mut g, &format!("{p}.mlp.gate_proj.weight"));
            let uw = w(&mut g, &format!("{p}.mlp.up_proj.weight"));
            let dw = w(&mut g, &format!("{p}.mlp.down_proj.weight"));
            let gate = g.push1(mm(false), &[x2, gw]);
            let up = g.push1(mm(false), &[x2, uw]);
            let act = g.push1(Op::SiluMul, &[gate, up]);
            let down = g.push1(mm(false), &[act, dw]);
            hs = g.push1(Op::Add, &[hs, down]);
        }
        let _ = (h, qw, kvw);
        let fw = w(&mut g, "model.norm.weight");
        let mut last = g.push1(norm, &[hs, fw]);
        if key.spec == 0 && key.query > 1 {
            last = g.push1(Op::GatherLast { group: key.query }, &[last]);
        }
        let head = if self.tied {
            table
        } else {
            w(&mut g, "lm_head.weight")
        };
        let lg = g.push1(
            Op::MatMul {
                bias: false,
                out: DType::F32,
            },
            &[last, head],
        );
        let next = g.push1(Op::Argmax, &[lg]);
        g.add_output("next_tokens", next);
        if let Some(dr) = drafts {
            let acc = g.push1(Op::AcceptGreedy { spec: key.spec }, &[next, dr]);
            g.add_output("accepted", acc);
        }
        if logits {
            g.add_output("logits", lg);
        }
        g
    }
}
