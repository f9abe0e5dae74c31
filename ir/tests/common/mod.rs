//! Graph builders shared by the integration tests: a hand-built decode step
//! (the golden one) and a generator of random well-formed graphs.
#![allow(dead_code)]

use kiln_ir::{
    AttnAttrs, DType, Epilogue, Graph, InputRole, Op, PreNorm, Rope, RopeScaling, TensorType,
    ValueId,
};

/// splitmix64: a tiny deterministic generator, so a failing seed replays.
pub struct Rng(kiln_ir::rng::SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(kiln_ir::rng::SplitMix64::new(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as u32
    }
    pub fn coin(&mut self) -> bool {
        self.next_u64() & 1 == 1
    }
    pub fn pick<T: Clone>(&mut self, xs: &[T]) -> T {
        xs[(self.next_u64() % xs.len() as u64) as usize].clone()
    }
}

fn t(d: DType, dims: &[u32]) -> TensorType {
    TensorType::new(d, dims.to_vec())
}

/// One Llama-style decoder layer plus embedding and head, at key b2q1s0:
/// embedding, norms, q/k/v projections, rope (llama3 scaling), kv_write,
/// paged attention, o_proj, fused add+norm, gated MLP (silu_mul), final norm,
/// lm_head in f32, argmax. Weights are declared where first used, as a
/// frontend does, so value ids of weights and nodes interleave.
pub fn decode_step() -> Graph {
    let bf = DType::BF16;
    let (b, h, heads, kvh, hd, v, slots, inter) =
        (2u32, 64u32, 4u32, 2u32, 16u32, 256u32, 64u32, 128u32);
    let mut g = Graph::new("llama b2q1s0");
    let ids = g.add_input(InputRole::TokenIds, t(DType::I32, &[b]));
    let pos = g.add_input(InputRole::Positions, t(DType::I32, &[b]));
    let slot = g.add_input(InputRole::SlotMapping, t(DType::I32, &[b]));
    let bt = g.add_input(InputRole::BlockTables, t(DType::I32, &[b, 2]));
    let cl = g.add_input(InputRole::ContextLens, t(DType::I32, &[b]));
    let kc = g.add_input(InputRole::KCache(0), t(bf, &[slots, kvh * hd]));
    let vc = g.add_input(InputRole::VCache(0), t(bf, &[slots, kvh * hd]));

    let emb_w = g.add_weight("model.embed_tokens.weight", t(bf, &[v, h]));
    let x = g.push1(Op::Embedding, &[ids, emb_w]);
    let ln1 = g.add_weight("model.layers.0.input_layernorm.weight", t(bf, &[h]));
    let xn = g.push1(
        Op::RmsNorm {
            eps: 1e-5,
            unit_offset: false,
        },
        &[x, ln1],
    );
    let mm = |out| Op::MatMul { bias: false, out };
    let wq = g.add_weight(
        "model.layers.0.self_attn.q_proj.weight",
        t(bf, &[heads * hd, h]),
    );
    let q = g.push1(mm(bf), &[xn, wq]);
    let wk = g.add_weight(
        "model.layers.0.self_attn.k_proj.weight",
        t(bf, &[kvh * hd, h]),
    );
    let k = g.push1(mm(bf), &[xn, wk]);
    let wv = g.add_weight(
        "model.layers.0.self_attn.v_proj.weight",
        t(bf, &[kvh * hd, h]),
    );
    let vv = g.push1(mm(bf), &[xn, wv]);
    let rope = Rope {
        theta: 500000.0,
        scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        },
    };
    let q = g.push1(
        Op::Rope {
            heads,
            head_dim: hd,
            rope: rope.clone(),
        },
        &[q, pos],
    );
    let k = g.push1(
        Op::Rope {
            heads: kvh,
            head_dim: hd,
            rope,
        },
        &[k, pos],
    );
    let kv = g.push(Op::KvWrite, &[k, vv, slot, kc, vc]);
    let attn = g.push1(
        Op::PagedAttention(AttnAttrs {
            heads,
            kv_heads: kvh,
            head_dim: hd,
            query: 1,
            block_size: 16,
            scale: 0.25,
            window: None,
            softcap: None,
        }),
        &[q, kv[0], kv[1], bt, cl],
    );
    let wo = g.add_weight(
        "model.layers.0.self_attn.o_proj.weight",
        t(bf, &[h, heads * hd]),
    );
    let o = g.push1(mm(bf), &[attn, wo]);
    let ln2 = g.add_weight(
        "model.layers.0.post_attention_layernorm.weight",
        t(bf, &[h]),
    );
    let nr = g.push(
        Op::AddRmsNorm {
            eps: 1e-5,
            unit_offset: false,
        },
        &[o, x, ln2],
    );
    let (normed, resid) = (nr[0], nr[1]);
    let wg = g.add_weight("model.layers.0.mlp.gate_proj.weight", t(bf, &[inter, h]));
    let gate = g.push1(mm(bf), &[normed, wg]);
    let wu = g.add_weight("model.layers.0.mlp.up_proj.weight", t(bf, &[inter, h]));
    let up = g.push1(mm(bf), &[normed, wu]);
    let act = g.push1(Op::SiluMul, &[gate, up]);
    let wd = g.add_weight("model.layers.0.mlp.down_proj.weight", t(bf, &[h, inter]));
    let down = g.push1(mm(bf), &[act, wd]);
    let y = g.push1(Op::Add, &[resid, down]);
    let lnf = g.add_weight("model.norm.weight", t(bf, &[h]));
    let yn = g.push1(
        Op::RmsNorm {
            eps: 1e-5,
            unit_offset: false,
        },
        &[y, lnf],
    );
    let head = g.add_weight("lm_head.weight", t(bf, &[v, h]));
    let logits = g.push1(mm(DType::F32), &[yn, head]);
    let next = g.push1(Op::Argmax, &[logits]);
    g.add_output("next_tokens", next);
    g
}

/// Random, well-formed graphs: every op, attribute variant and option,
/// names with characters that need escaping, weights and caches declared in
/// the middle of the body (so ids interleave).
pub struct Gen<'a> {
    pub rng: Rng,
    floats: &'a [f32],
    names: &'a [String],
    fi: usize,
    ni: usize,
    pub g: Graph,
    d: DType,
    b: u32,
    q: u32,
    spec: u32,
    hd: u32,
    heads: u32,
    kvh: u32,
    slots: u32,
    /// Float activations with `T = b*q` rows.
    acts: Vec<ValueId>,
    /// Other float rank-2 values (other dtypes or row counts).
    others: Vec<ValueId>,
    /// Current (k, v) cache values per layer, with the layer number.
    caches: Vec<(u32, Option<(ValueId, ValueId)>)>,
    weights_made: usize,
}

impl<'a> Gen<'a> {
    fn float(&mut self) -> f32 {
        if self.floats.is_empty() {
            return 1.5;
        }
        let x = self.floats[self.fi % self.floats.len()];
        self.fi += 1;
        x
    }
    fn name(&mut self) -> String {
        if self.names.is_empty() {
            return String::new();
        }
        let s = self.names[self.ni % self.names.len()].clone();
        self.ni += 1;
        s
    }
    fn tokens(&self) -> u32 {
        self.b * self.q
    }
    fn input(&mut self, role: InputRole) -> ValueId {
        self.g.input(role).expect("declared up front")
    }
    fn weight(&mut self, dims: &[u32]) -> ValueId {
        let name = format!("{}#{}", self.name(), self.weights_made);
        self.weights_made += 1;
        let d = self.d;
        self.g.add_weight(name, t(d, dims))
    }
    fn cols(&self, v: ValueId) -> u32 {
        self.g.ty(v).shape.dims()[1]
    }
    fn any_act(&mut self) -> ValueId {
        let a = self.acts.clone();
        self.rng.pick(&a)
    }
    /// An activation `D[T, c]`: an existing one, or a projection to `c`.
    fn act_with_cols(&mut self, c: u32) -> ValueId {
        let have: Vec<ValueId> = self
            .acts
            .iter()
            .copied()
            .filter(|&v| self.cols(v) == c)
            .collect();
        if !have.is_empty() && self.rng.range(0, 3) > 0 {
            return self.rng.pick(&have);
        }
        let x = self.any_act();
        let k = self.cols(x);
        let w = self.weight(&[c, k]);
        let bias = self.rng.coin();
        let d = self.d;
        let y = if bias {
            let bv = self.weight(&[c]);
            self.g.push1(Op::MatMul { bias, out: d }, &[x, w, bv])
        } else {
            self.g.push1(Op::MatMul { bias, out: d }, &[x, w])
        };
        self.acts.push(y);
        y
    }
    fn rope(&mut self) -> Rope {
        let theta = self.float();
        let scaling = match self.rng.range(0, 2) {
            0 => RopeScaling::None,
            1 => RopeScaling::Linear {
                factor: self.float(),
            },
            _ => RopeScaling::Llama3 {
                factor: self.float(),
                low_freq_factor: self.float(),
                high_freq_factor: self.float(),
                original_max_position: self.rng.next_u64() as u32,
            },
        };
        Rope { theta, scaling }
    }
    fn layer(&mut self) -> usize {
        let i = self.rng.range(0, self.caches.len() as u32 - 1) as usize;
        if self.caches[i].1.is_none() {
            // Caches are declared on first use, in the middle of the body.
            let (l, d) = (self.caches[i].0, self.d);
            let ty = t(d, &[self.slots, self.kvh * self.hd]);
            let k = self.g.add_input(InputRole::KCache(l), ty.clone());
            let v = self.g.add_input(InputRole::VCache(l), ty);
            self.caches[i].1 = Some((k, v));
        }
        i
    }
    /// Random attention attributes for these heads (`paged_attention`
    /// and the attention half of `rope_attention`).
    fn attn_attrs(&mut self, heads: u32, kvh: u32, hd: u32) -> AttnAttrs {
        AttnAttrs {
            heads,
            kv_heads: kvh,
            head_dim: hd,
            query: self.q,
            block_size: self.rng.pick(&[1, 2, 4, 16]),
            scale: self.float(),
            window: self.rng.coin().then(|| self.rng.next_u64() as u32),
            softcap: self.opt_float(),
        }
    }

    fn opt_float(&mut self) -> Option<f32> {
        if self.rng.coin() {
            Some(self.float())
        } else {
            None
        }
    }

    /// Appends one random op (kind `kind % 16`).
    fn step(&mut self, kind: u32) {
        let d = self.d;
        let (heads, kvh, hd) = (self.heads, self.kvh, self.hd);
        match kind % 16 {
            0 => {
                let ids = self.input(InputRole::TokenIds);
                let v = self.rng.range(1, 12);
                let c = self.rng.pick(&[2, 4, 6, 8]);
                let w = self.weight(&[v, c]);
                let x = self.g.push1(Op::Embedding, &[ids, w]);
                self.acts.push(x);
            }
            1 => {
                let x = self.any_act();
                let c = self.cols(x);
                let w = self.weight(&[c]);
                let op = Op::RmsNorm {
                    eps: self.float(),
                    unit_offset: self.rng.coin(),
                };
                let y = self.g.push1(op, &[x, w]);
                self.acts.push(y);
            }
            2 => {
                let x = self.any_act();
                let c = self.cols(x);
                let r = self.act_with_cols(c);
                let w = self.weight(&[c]);
                let op = Op::AddRmsNorm {
                    eps: self.float(),
                    unit_offset: self.rng.coin(),
                };
                let out = self.g.push(op, &[x, r, w]);
                self.acts.extend(out);
            }
            3 if self.rng.range(0, 3) == 0 => {
                // A fused matmul with a random prologue and epilogue.
                let x = self.any_act();
                let k = self.cols(x);
                let post = self.rng.pick(&Epilogue::ALL);
                let n = 2 * self.rng.range(1, 8);
                let w = self.weight(&[n, k]);
                let bias = self.rng.coin();
                let out = if matches!(post, Epilogue::None | Epilogue::Argmax) {
                    self.rng.pick(&[DType::BF16, DType::F16, DType::F32])
                } else {
                    d
                };
                let pre = self.opt_float().map(|eps| PreNorm {
                    eps,
                    unit_offset: self.rng.coin(),
                });
                let mut args = vec![x, w];
                if bias {
                    args.push(self.weight(&[n]));
                }
                if pre.is_some() {
                    args.push(self.weight(&[k]));
                }
                if post == Epilogue::Residual {
                    args.push(self.act_with_cols(n));
                }
                let op = Op::FusedMatMul {
                    bias,
                    out,
                    pre,
                    post,
                };
                let y = self.g.push1(op, &args);
                // The argmax epilogue's i32 tokens feed nothing here.
                if post == Epilogue::Argmax {
                } else if out == d {
                    self.acts.push(y)
                } else {
                    self.others.push(y)
                }
            }
            3 => {
                let x = self.any_act();
                let k = self.cols(x);
                let n = self.rng.range(1, 16);
                let w = self.weight(&[n, k]);
                let bias = self.rng.coin();
                let out = self.rng.pick(&[DType::BF16, DType::F16, DType::F32]);
                let y = if bias {
                    let bv = self.weight(&[n]);
                    self.g.push1(Op::MatMul { bias, out }, &[x, w, bv])
                } else {
                    self.g.push1(Op::MatMul { bias, out }, &[x, w])
                };
                if out == d {
                    self.acts.push(y)
                } else {
                    self.others.push(y)
                }
            }
            4 => {
                let x = self.act_with_cols(heads * hd);
                let w = self.weight(&[hd]);
                let op = Op::HeadRmsNorm {
                    heads,
                    head_dim: hd,
                    eps: self.float(),
                    unit_offset: self.rng.coin(),
                };
                let y = self.g.push1(op, &[x, w]);
                self.acts.push(y);
            }
            5 => {
                let h = if self.rng.coin() { heads } else { kvh };
                let x = self.act_with_cols(h * hd);
                let pos = self.input(InputRole::Positions);
                let op = Op::Rope {
                    heads: h,
                    head_dim: hd,
                    rope: self.rope(),
                };
                let y = self.g.push1(op, &[x, pos]);
                self.acts.push(y);
            }
            6 => {
                let l = self.layer();
                let k = self.act_with_cols(kvh * hd);
                let v = self.act_with_cols(kvh * hd);
                let slots = self.input(InputRole::SlotMapping);
                let (kc, vc) = self.caches[l].1.expect("declared");
                let out = self.g.push(Op::KvWrite, &[k, v, slots, kc, vc]);
                self.caches[l].1 = Some((out[0], out[1]));
            }
            7 => {
                let l = self.layer();
                let qv = self.act_with_cols(heads * hd);
                let (kc, vc) = self.caches[l].1.expect("declared");
                let bt = self.input(InputRole::BlockTables);
                let cl = self.input(InputRole::ContextLens);
                let attn = self.attn_attrs(heads, kvh, hd);
                let y = if self.rng.coin() {
                    self.g
                        .push1(Op::PagedAttention(attn), &[qv, kc, vc, bt, cl])
                } else {
                    // The megakernel's split form: partials, then combine.
                    let parts = self.rng.range(1, 5);
                    let p = self
                        .g
                        .push1(Op::AttentionPartials { attn, parts }, &[qv, kc, vc, bt, cl]);
                    let out = self.g.ty(qv).dtype;
                    self.g.push1(
                        Op::AttentionCombine {
                            heads,
                            head_dim: hd,
                            parts,
                            out,
                        },
                        &[p],
                    )
                };
                self.acts.push(y);
            }
            8 => {
                let l = self.layer();
                let qkv = self.act_with_cols((heads + 2 * kvh) * hd);
                let pos = self.input(InputRole::Positions);
                let slots = self.input(InputRole::SlotMapping);
                let (kc, vc) = self.caches[l].1.expect("declared");
                let qk_norm = self.opt_float();
                let mut args = vec![qkv, pos, slots, kc, vc];
                if qk_norm.is_some() {
                    args.push(self.weight(&[hd]));
                    args.push(self.weight(&[hd]));
                }
                let rope = self.rope();
                let unit_offset = self.rng.coin();
                let form = self.rng.range(0, 3);
                let op = if form == 0 {
                    Op::QkvRopeKvWrite {
                        heads,
                        kv_heads: kvh,
                        head_dim: hd,
                        rope,
                        qk_norm,
                        unit_offset,
                    }
                } else if form == 1 {
                    // The projection that makes qkv, in the same op: x, w,
                    // [bias], [norm weight] go before pos.
                    let x = self.any_act();
                    let k = self.cols(x);
                    let n = (heads + 2 * kvh) * hd;
                    let d = self.d;
                    let w = self.weight(&[n, k]);
                    let bias = self.rng.coin();
                    let pre = self.rng.coin().then(|| PreNorm {
                        eps: self.float(),
                        unit_offset: self.rng.coin(),
                    });
                    let mut front = vec![x, w];
                    if bias {
                        front.push(self.weight(&[n]));
                    }
                    if pre.is_some() {
                        front.push(self.weight(&[k]));
                    }
                    args.splice(0..1, front);
                    let mm = Op::FusedMatMul {
                        bias,
                        out: d,
                        pre,
                        post: Epilogue::None,
                    };
                    let rope_op = Op::QkvRopeKvWrite {
                        heads,
                        kv_heads: kvh,
                        head_dim: hd,
                        rope,
                        qk_norm,
                        unit_offset,
                    };
                    Op::join_matmul_qkv_rope(&mm, &rope_op, d).expect("the two parts join")
                } else {
                    // The fused rope + attention: tables and lengths go
                    // after the caches, before the norm weights.
                    let bt = self.input(InputRole::BlockTables);
                    let cl = self.input(InputRole::ContextLens);
                    args.insert(5, bt);
                    args.insert(6, cl);
                    Op::RopeAttention {
                        attn: self.attn_attrs(heads, kvh, hd),
                        rope,
                        qk_norm,
                        unit_offset,
                    }
                };
                let out = self.g.push(op, &args);
                self.acts.push(out[0]);
                self.caches[l].1 = Some((out[1], out[2]));
            }
            9 | 10 => {
                let op = if kind % 16 == 9 {
                    Op::SiluMul
                } else {
                    Op::GeluTanhMul
                };
                let y = if self.rng.coin() {
                    let gate = self.any_act();
                    let c = self.cols(gate);
                    let up = self.act_with_cols(c);
                    self.g.push1(op, &[gate, up])
                } else {
                    let c = 2 * self.rng.range(1, 6);
                    let gu = self.act_with_cols(c);
                    self.g.push1(op, &[gu])
                };
                self.acts.push(y);
            }
            11 => {
                let x = self.any_act();
                let c = self.cols(x);
                let y0 = self.act_with_cols(c);
                let y = self.g.push1(Op::Add, &[x, y0]);
                self.acts.push(y);
            }
            12 => {
                let x = self.any_act();
                let group = self.rng.pick(&[1, self.q, self.tokens()]);
                let y = self.g.push1(Op::GatherLast { group }, &[x]);
                self.others.push(y);
            }
            13 => {
                let mut pool = self.acts.clone();
                pool.extend(self.others.iter().copied());
                let x = self.rng.pick(&pool);
                let rows = self.g.value(x).ty.shape.dims()[0];
                if self.spec == 0 && rows == self.b && self.rng.coin() {
                    let params = self.input(InputRole::SampleParams);
                    let seeds = self.input(InputRole::SampleSeeds);
                    self.g.push1(Op::Sample, &[x, params, seeds]);
                } else {
                    self.g.push1(Op::Argmax, &[x]);
                }
            }
            15 => {
                let x = self.any_act();
                let ranks = self.rng.range(1, 4);
                match self.rng.range(0, 4) {
                    // The tensor-parallel collectives.
                    0 => {
                        let out = self.g.value(x).ty.dtype;
                        let y = self.g.push1(Op::AllReduce { ranks, out }, &[x]);
                        self.acts.push(y);
                    }
                    1 => {
                        self.g.push1(Op::ShardedArgmax { ranks }, &[x]);
                    }
                    _ => {
                        let op = Op::Scale {
                            factor: self.float(),
                            softcap: self.opt_float(),
                        };
                        let y = self.g.push1(op, &[x]);
                        self.acts.push(y);
                    }
                }
            }
            _ => {
                if self.spec == 0 || self.q != self.spec + 1 {
                    return self.step(13);
                }
                let x = self.any_act();
                let pred = self.g.push1(Op::Argmax, &[x]);
                let drafts = self.input(InputRole::DraftTokens);
                self.g
                    .push1(Op::AcceptGreedy { spec: self.spec }, &[pred, drafts]);
            }
        }
    }
}

/// A random well-formed graph from `seed`, drawing float attributes from
/// `floats` and strings (graph, weight and output names) from `names`.
pub fn random_graph(seed: u64, floats: &[f32], names: &[String]) -> Graph {
    let mut rng = Rng::new(seed);
    let d = rng.pick(&[DType::BF16, DType::F16, DType::F32]);
    let b = rng.range(1, 3);
    let q = rng.range(1, 3);
    let spec = if q > 1 && rng.coin() {
        rng.range(1, q - 1)
    } else {
        0
    };
    let kvh = rng.range(1, 2);
    let heads = kvh * rng.range(1, 2);
    let hd = rng.pick(&[2, 4, 8]);
    let slots = rng.range(4, 40);
    let layers = rng.range(1, 3);
    let mut caches = vec![];
    let mut l = rng.range(0, 3);
    for _ in 0..layers {
        caches.push((l, None));
        l += rng.range(1, 1000);
    }
    let mut gen = Gen {
        rng,
        floats,
        names,
        fi: 0,
        ni: 0,
        g: Graph::default(),
        d,
        b,
        q,
        spec,
        hd,
        heads,
        kvh,
        slots,
        acts: vec![],
        others: vec![],
        caches,
        weights_made: 0,
    };
    gen.g.name = gen.name();
    let tokens = b * q;
    let m = gen.rng.range(1, 3);
    let mut staging = vec![
        (InputRole::TokenIds, t(DType::I32, &[tokens])),
        (InputRole::Positions, t(DType::I32, &[tokens])),
        (InputRole::SlotMapping, t(DType::I32, &[tokens])),
        (InputRole::BlockTables, t(DType::I32, &[b, m])),
        (InputRole::ContextLens, t(DType::I32, &[b])),
    ];
    if spec > 0 {
        staging.push((InputRole::DraftTokens, t(DType::I32, &[b * spec])));
    } else {
        staging.push((InputRole::SampleParams, t(DType::F32, &[b, 4])));
        staging.push((InputRole::SampleSeeds, t(DType::I32, &[b, 4])));
    }
    // Declare the staging inputs in a random order.
    while !staging.is_empty() {
        let i = gen.rng.range(0, staging.len() as u32 - 1) as usize;
        let (role, ty) = staging.remove(i);
        gen.g.add_input(role, ty);
    }
    gen.step(0); // an embedding, so there is an activation
    let steps = gen.rng.range(2, 24);
    for _ in 0..steps {
        let kind = gen.rng.range(0, 15);
        gen.step(kind);
    }
    let outputs = gen.rng.range(1, 3);
    for i in 0..outputs {
        let v = ValueId(gen.rng.range(0, gen.g.values.len() as u32 - 1));
        let name = format!("{}#{i}", gen.name());
        gen.g.add_output(name, v);
    }
    gen.g
}
