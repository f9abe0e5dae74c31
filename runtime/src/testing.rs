//! Test support: tiny models the runtime can run without the compiler.
//!
//! The runtime must not depend on the compiler, yet its engine needs plans to
//! be tested against. This module builds them by hand: [`TinyModel`] writes a
//! random safetensors file, traces a small attention model per key (embedding,
//! per layer q/k/v projections, RoPE, KV write, paged attention, output
//! projection with a residual add, then `gather_last` for prefill chunks, the
//! LM head, argmax and `accept_greedy` for speculative keys) and lays the
//! values out naively (no buffer reuse). [`reference_kernels`] runs those ops
//! in plain f32 loops, and [`TinyModel::greedy_reference`] computes greedy
//! tokens from scratch with no KV cache, using the same loops, so the engine's
//! block tables, slots, positions and context lengths are checked exactly.
//!
//! Not here: a planner (no reuse, no alignment games), the real kernels (the
//! CPU backend calls `kiln_kernels::cpu::execute` outside tests), or model
//! architectures beyond this toy.

use crate::weights::header_sha256;
use kiln_ir::graph::{Graph, InputRole, ValueDef, ValueId};
use kiln_ir::plan::{
    BufRef, BufferPlan, KeyPlan, KvLayout, ModelInfo, ModelMeta, Operand, Plan, PlanOp, Region,
    SourceFile, Target, ARENA_ALIGN,
};
use kiln_ir::{
    DType, Key, Op, Rope, RopeScaling, Shape, TensorRef, TensorType, WeightEntry, WeightManifest,
    WeightSource,
};
use kiln_kernels::cpu::{KernelError, RawTensor};
use std::collections::HashMap;
use std::path::Path;

/// Deterministic pseudo-random numbers (splitmix64).
#[derive(Clone, Debug)]
pub struct Rng(kiln_ir::rng::SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(kiln_ir::rng::SplitMix64::new(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in `[-scale, scale)`.
    pub fn float(&mut self, scale: f32) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }
    /// Uniform in `[0, n)`.
    pub fn below(&mut self, n: u32) -> u32 {
        (self.next_u64() % n as u64) as u32
    }
}

/// A tiny attention model and the shapes it is planned for.
#[derive(Clone, Debug)]
pub struct TinyModel {
    pub vocab: u32,
    pub hidden: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub layers: u32,
    pub max_context: u32,
    pub block_size: u32,
    /// KV blocks per layer, the null block included.
    pub num_blocks: u32,
    pub keys: Vec<Key>,
    pub eos: Vec<u32>,
    /// Dtype of the tensors in the safetensors file (the plan computes in f32,
    /// so bf16/f16 exercise the binder's conversion).
    pub file_dtype: DType,
    /// Prefill chunks score every position (no `gather_last`): next tokens
    /// and logits are per position, `[B*Q]` and `[B*Q, V]`.
    pub per_position_chunks: bool,
    pub seed: u64,
}

impl Default for TinyModel {
    fn default() -> TinyModel {
        TinyModel {
            vocab: 61,
            hidden: 32,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            layers: 2,
            max_context: 48,
            block_size: 4,
            num_blocks: 64,
            keys: ["b1q1s0", "b2q1s0", "b4q1s0", "b8q1s0", "b2q4s0", "b2q3s2"]
                .iter()
                .map(|k| k.parse().unwrap())
                .collect(),
            eos: vec![],
            file_dtype: DType::F32,
            per_position_chunks: false,
            seed: 7,
        }
    }
}

/// The tensors of a [`TinyModel`], in f32, as the plan sees them.
pub struct TinyWeights {
    pub tensors: HashMap<String, (Vec<u32>, Vec<f32>)>,
}

const FILE: &str = "model.safetensors";

impl TinyModel {
    fn rope(&self) -> Rope {
        Rope {
            theta: 10000.0,
            scaling: RopeScaling::None,
        }
    }

    fn weight_shapes(&self) -> Vec<(String, Vec<u32>)> {
        let (h, hd) = (self.hidden, self.head_dim);
        let mut v = vec![("embed".to_string(), vec![self.vocab, h])];
        for l in 0..self.layers {
            v.push((format!("l{l}.q"), vec![self.heads * hd, h]));
            v.push((format!("l{l}.k"), vec![self.kv_heads * hd, h]));
            v.push((format!("l{l}.v"), vec![self.kv_heads * hd, h]));
            v.push((format!("l{l}.o"), vec![h, self.heads * hd]));
        }
        v.push(("lm_head".to_string(), vec![self.vocab, h]));
        v
    }

    /// Random weights, rounded to `file_dtype` so the file and the host
    /// reference hold the same values.
    pub fn weights(&self) -> TinyWeights {
        let mut rng = Rng::new(self.seed);
        let round = |x: f32| match self.file_dtype {
            DType::BF16 => half::bf16::from_f32(x).to_f32(),
            DType::F16 => half::f16::from_f32(x).to_f32(),
            _ => x,
        };
        let tensors = self
            .weight_shapes()
            .into_iter()
            .map(|(name, shape)| {
                let n: u32 = shape.iter().product();
                let scale = if name == "embed" { 1.0 } else { 0.5 };
                let data = (0..n).map(|_| round(rng.float(scale))).collect();
                (name, (shape, data))
            })
            .collect();
        TinyWeights { tensors }
    }

    /// Writes `model.safetensors` into `dir` (through a temporary file and a
    /// rename) and returns its plan entry.
    pub fn write_weights(&self, dir: &Path) -> std::io::Result<SourceFile> {
        let w = self.weights();
        let mut bytes: Vec<(String, Vec<u32>, Vec<u8>)> = Vec::new();
        for (name, shape) in self.weight_shapes() {
            let data = &w.tensors[&name].1;
            let mut b = vec![0u8; data.len() * self.file_dtype.size()];
            let src: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
            crate::weights::convert(&src, DType::F32, &mut b, self.file_dtype);
            bytes.push((name, shape, b));
        }
        let st_dtype = match self.file_dtype {
            DType::BF16 => safetensors::Dtype::BF16,
            DType::F16 => safetensors::Dtype::F16,
            DType::F32 => safetensors::Dtype::F32,
            DType::I32 => safetensors::Dtype::I32,
        };
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
            .iter()
            .map(|(n, s, b)| {
                let shape: Vec<usize> = s.iter().map(|&d| d as usize).collect();
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(st_dtype, shape, b).unwrap(),
                )
            })
            .collect();
        let data = safetensors::serialize(views, None).map_err(std::io::Error::other)?;
        let tmp = dir.join(format!("{FILE}.tmp"));
        std::fs::write(&tmp, &data)?;
        std::fs::rename(&tmp, dir.join(FILE))?;
        Ok(SourceFile {
            name: FILE.into(),
            size: data.len() as u64,
            header_sha256: header_sha256(&data).expect("we just wrote a header"),
        })
    }

    pub fn kv_layout(&self) -> KvLayout {
        KvLayout {
            layers: self.layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            dtype: DType::F32,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            null_block: 0,
            max_blocks_per_seq: self.max_context.div_ceil(self.block_size),
        }
    }

    fn manifest(&self) -> WeightManifest {
        WeightManifest {
            entries: self
                .weight_shapes()
                .into_iter()
                .map(|(name, shape)| WeightEntry {
                    name: name.clone(),
                    dtype: DType::F32,
                    shape: Shape(shape.clone()),
                    source: WeightSource::Tensor(TensorRef {
                        file: FILE.into(),
                        tensor: name,
                        dtype: self.file_dtype,
                        shape: Shape(shape),
                    }),
                })
                .collect(),
        }
    }

    /// The traced step of one key.
    pub fn graph(&self, key: Key) -> Graph {
        let (b, q, s) = (key.batch, key.query, key.spec);
        let t = b * q;
        let kv = self.kv_layout();
        let slots = kv.slots() as u32;
        let kvw = self.kv_heads * self.head_dim;
        let i32t = |d: Vec<u32>| TensorType::new(DType::I32, d);
        let f32t = |d: Vec<u32>| TensorType::new(DType::F32, d);
        let mut g = Graph::new(format!("tiny {key}"));
        let ids = g.add_input(InputRole::TokenIds, i32t(vec![t]));
        let pos = g.add_input(InputRole::Positions, i32t(vec![t]));
        let slot = g.add_input(InputRole::SlotMapping, i32t(vec![t]));
        let bt = g.add_input(InputRole::BlockTables, i32t(vec![b, kv.max_blocks_per_seq]));
        let cl = g.add_input(InputRole::ContextLens, i32t(vec![b]));
        let drafts = (s > 0).then(|| g.add_input(InputRole::DraftTokens, i32t(vec![b * s])));
        let mut w = HashMap::new();
        for (name, shape) in self.weight_shapes() {
            let v = g.add_weight(name.clone(), f32t(shape));
            w.insert(name, v);
        }
        let mut x = g.push1(Op::Embedding, &[ids, w["embed"]]);
        for l in 0..self.layers {
            let kc = g.add_input(InputRole::KCache(l), f32t(vec![slots, kvw]));
            let vc = g.add_input(InputRole::VCache(l), f32t(vec![slots, kvw]));
            let mm = |g: &mut Graph, a: ValueId, wn: &str| {
                g.push1(
                    Op::MatMul {
                        bias: false,
                        out: DType::F32,
                    },
                    &[a, w[wn]],
                )
            };
            let qv = mm(&mut g, x, &format!("l{l}.q"));
            let kv_ = mm(&mut g, x, &format!("l{l}.k"));
            let vv = mm(&mut g, x, &format!("l{l}.v"));
            let rope = |heads| Op::Rope {
                heads,
                head_dim: self.head_dim,
                rope: self.rope(),
            };
            let qv = g.push1(rope(self.heads), &[qv, pos]);
            let kv_ = g.push1(rope(self.kv_heads), &[kv_, pos]);
            let caches = g.push(Op::KvWrite, &[kv_, vv, slot, kc, vc]);
            let att = g.push1(
                Op::PagedAttention {
                    heads: self.heads,
                    kv_heads: self.kv_heads,
                    head_dim: self.head_dim,
                    query: q,
                    block_size: self.block_size,
                    scale: 1.0 / (self.head_dim as f32).sqrt(),
                    window: None,
                    softcap: None,
                },
                &[qv, caches[0], caches[1], bt, cl],
            );
            let o = mm(&mut g, att, &format!("l{l}.o"));
            x = g.push1(Op::Add, &[x, o]);
        }
        if q > 1 && s == 0 && !self.per_position_chunks {
            x = g.push1(Op::GatherLast { group: q }, &[x]);
        }
        let logits = g.push1(
            Op::MatMul {
                bias: false,
                out: DType::F32,
            },
            &[x, w["lm_head"]],
        );
        let next = g.push1(Op::Argmax, &[logits]);
        g.add_output("next_tokens", next);
        g.add_output("logits", logits);
        if let Some(d) = drafts {
            let acc = g.push1(Op::AcceptGreedy { spec: s }, &[next, d]);
            g.add_output("accepted", acc);
        }
        g
    }

    /// Writes the weights into `dir` and returns the plan.
    pub fn build(&self, dir: &Path) -> std::io::Result<Plan> {
        let file = self.write_weights(dir)?;
        let manifest = self.manifest();
        let kv = self.kv_layout();
        let keys: Vec<KeyPlan> = self
            .keys
            .iter()
            .map(|&k| naive_key_plan(k, self.graph(k), &manifest, &kv))
            .collect();
        Ok(Plan {
            meta: ModelMeta {
                architecture: "KilnTinyForTests".into(),
                files: vec![file],
                compiler_version: "hand-planned".into(),
                target: Target::Cpu,
                info: ModelInfo {
                    vocab_size: self.vocab,
                    hidden_size: self.hidden,
                    num_layers: self.layers,
                    num_heads: self.heads,
                    num_kv_heads: self.kv_heads,
                    head_dim: self.head_dim,
                    max_context: self.max_context,
                    bos_token_id: None,
                    eos_token_ids: self.eos.clone(),
                    dtype: DType::F32,
                },
            },
            manifest,
            arena_bytes: keys.iter().map(|k| k.arena_peak).max().unwrap_or(0),
            workspace_bytes: 0,
            counter_bytes: 0,
            kv,
            keys,
            kernels: vec![],
            kernel_abi: 0,
        })
    }

    /// Greedy continuation of `prompt` computed from scratch at every step
    /// (full causal attention over the whole sequence, no KV cache), with the
    /// same f32 loops as [`reference_kernels`]. Returns `n` tokens and the
    /// logits that produced each.
    pub fn greedy_reference(
        &self,
        w: &TinyWeights,
        prompt: &[u32],
        n: usize,
    ) -> (Vec<u32>, Vec<Vec<f32>>) {
        let mut toks = prompt.to_vec();
        let mut all_logits = Vec::new();
        let (h, hd) = (self.hidden as usize, self.head_dim as usize);
        let inv = self.rope().inv_freq(self.head_dim);
        for _ in 0..n {
            let t = toks.len();
            let embed = &w.tensors["embed"].1;
            let mut x: Vec<f32> = toks
                .iter()
                .flat_map(|&id| embed[id as usize * h..(id as usize + 1) * h].to_vec())
                .collect();
            for l in 0..self.layers {
                let get = |n: &str| &w.tensors[&format!("l{l}.{n}")];
                let mut q = matmul(&x, t, &get("q").1, get("q").0[0] as usize, h);
                let mut k = matmul(&x, t, &get("k").1, get("k").0[0] as usize, h);
                let v = matmul(&x, t, &get("v").1, get("v").0[0] as usize, h);
                let pos: Vec<i32> = (0..t as i32).collect();
                rope(&mut q, &pos, self.heads as usize, hd, &inv);
                rope(&mut k, &pos, self.kv_heads as usize, hd, &inv);
                let qw = self.heads as usize * hd;
                let kvw = self.kv_heads as usize * hd;
                let mut att = vec![0f32; t * qw];
                for i in 0..t {
                    let rows: Vec<usize> = (0..=i).collect();
                    attend(
                        &q[i * qw..(i + 1) * qw],
                        &k,
                        &v,
                        &rows,
                        self.heads as usize,
                        self.kv_heads as usize,
                        hd,
                        kvw,
                        1.0 / (self.head_dim as f32).sqrt(),
                        &mut att[i * qw..(i + 1) * qw],
                    );
                }
                let o = matmul(&att, t, &get("o").1, h, qw);
                for (a, b) in x.iter_mut().zip(&o) {
                    *a += *b;
                }
            }
            let last = &x[(t - 1) * h..t * h];
            let lm = &w.tensors["lm_head"].1;
            let logits = matmul(last, 1, lm, self.vocab as usize, h);
            toks.push(argmax(&logits) as u32);
            all_logits.push(logits);
        }
        (toks.split_off(prompt.len()), all_logits)
    }
}

/// Lays out one key naively: staging and outputs in Io, intermediates in the
/// arena without reuse, in-place results on their argument.
pub fn naive_key_plan(key: Key, graph: Graph, manifest: &WeightManifest, kv: &KvLayout) -> KeyPlan {
    let align = |x: u64| x.div_ceil(ARENA_ALIGN) * ARENA_ALIGN;
    let mut place: HashMap<ValueId, BufRef> = HashMap::new();
    let (mut io, mut arena) = (0u64, 0u64);
    let mut inputs = Vec::new();
    for &v in &graph.inputs {
        let ty = graph.ty(v);
        let ValueDef::Input(role) = graph.value(v).def else {
            unreachable!()
        };
        let buf = match role {
            InputRole::KCache(l) => BufRef {
                region: Region::KCache(l),
                offset: 0,
                bytes: kv.cache_bytes(),
            },
            InputRole::VCache(l) => BufRef {
                region: Region::VCache(l),
                offset: 0,
                bytes: kv.cache_bytes(),
            },
            _ => {
                let b = BufRef {
                    region: Region::Io,
                    offset: io,
                    bytes: ty.size_bytes(),
                };
                io = align(io + ty.size_bytes());
                b
            }
        };
        inputs.push((role, buf));
        place.insert(v, buf);
    }
    for &v in &graph.weights {
        let ValueDef::Weight(name) = &graph.value(v).def else {
            unreachable!()
        };
        let i = manifest.index_of(name).expect("weight in manifest");
        place.insert(
            v,
            BufRef {
                region: Region::Weight(i as u32),
                offset: 0,
                bytes: graph.ty(v).size_bytes(),
            },
        );
    }
    let outputs_of: HashMap<ValueId, &str> = graph
        .outputs
        .iter()
        .map(|(n, v)| (*v, n.as_str()))
        .collect();
    let mut ops = Vec::new();
    for (ni, node) in graph.nodes.iter().enumerate() {
        for (ri, &r) in node.results.iter().enumerate() {
            let ty = graph.ty(r);
            let buf = if let Some(&(_, a)) = node.op.aliases().iter().find(|(x, _)| *x == ri) {
                place[&node.args[a]]
            } else if outputs_of.contains_key(&r) {
                let b = BufRef {
                    region: Region::Io,
                    offset: io,
                    bytes: ty.size_bytes(),
                };
                io = align(io + ty.size_bytes());
                b
            } else {
                let b = BufRef {
                    region: Region::Arena,
                    offset: arena,
                    bytes: ty.size_bytes(),
                };
                arena = align(arena + ty.size_bytes());
                b
            };
            place.insert(r, buf);
        }
        let operand = |v: &ValueId| Operand {
            buf: place[v],
            ty: graph.ty(*v).clone(),
        };
        ops.push(PlanOp {
            node: kiln_ir::NodeId(ni as u32),
            kernel: node.op.mnemonic().to_string(),
            op: node.op.clone(),
            args: node.args.iter().map(operand).collect(),
            results: node.results.iter().map(operand).collect(),
            workspace_bytes: 0,
            lowering: kiln_ir::plan::Lowering::Reference,
            scratch: None,
            counters: None,
        });
    }
    let outputs = graph
        .outputs
        .iter()
        .map(|(n, v)| {
            (
                n.clone(),
                Operand {
                    buf: place[v],
                    ty: graph.ty(*v).clone(),
                },
            )
        })
        .collect();
    let buffers = (0..graph.values.len() as u32)
        .map(|i| BufferPlan {
            value: ValueId(i),
            buf: place[&ValueId(i)],
            first_use: None,
            last_use: None,
        })
        .collect();
    KeyPlan {
        key,
        launches: ops.len() as u32,
        graph,
        ops,
        buffers,
        inputs,
        outputs,
        io_bytes: io,
        arena_peak: arena,
        arena_lower_bound: arena,
        workspace_bytes: 0,
        flops: 0,
        bytes_moved: 0,
    }
}

fn matmul(x: &[f32], t: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0f32; t * n];
    for i in 0..t {
        for j in 0..n {
            let mut acc = 0f32;
            for c in 0..k {
                acc += x[i * k + c] * w[j * k + c];
            }
            out[i * n + j] = acc;
        }
    }
    out
}

fn rope(x: &mut [f32], pos: &[i32], heads: usize, hd: usize, inv: &[f64]) {
    let half = hd / 2;
    let w = heads * hd;
    for (t, &p) in pos.iter().enumerate() {
        for h in 0..heads {
            let base = t * w + h * hd;
            for i in 0..half {
                let a = p as f64 * inv[i];
                let (s, c) = (a.sin() as f32, a.cos() as f32);
                let (x1, x2) = (x[base + i], x[base + i + half]);
                x[base + i] = x1 * c - x2 * s;
                x[base + i + half] = x2 * c + x1 * s;
            }
        }
    }
}

/// One query row attending to the K/V rows `rows` (row indices into k/v).
#[allow(clippy::too_many_arguments)]
fn attend(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    rows: &[usize],
    heads: usize,
    kv_heads: usize,
    hd: usize,
    kvw: usize,
    scale: f32,
    out: &mut [f32],
) {
    let group = heads / kv_heads;
    let mut scores = vec![0f32; rows.len()];
    for h in 0..heads {
        let kh = h / group;
        let qh = &q[h * hd..(h + 1) * hd];
        let mut max = f32::NEG_INFINITY;
        for (j, &r) in rows.iter().enumerate() {
            let kr = &k[r * kvw + kh * hd..r * kvw + (kh + 1) * hd];
            let mut d = 0f32;
            for c in 0..hd {
                d += qh[c] * kr[c];
            }
            scores[j] = d * scale;
            max = max.max(scores[j]);
        }
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let o = &mut out[h * hd..(h + 1) * hd];
        o.fill(0.0);
        for (j, &r) in rows.iter().enumerate() {
            let vr = &v[r * kvw + kh * hd..r * kvw + (kh + 1) * hd];
            for c in 0..hd {
                o[c] += scores[j] / sum * vr[c];
            }
        }
    }
}

fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

unsafe fn f32s<'a>(t: &RawTensor) -> &'a [f32] {
    std::slice::from_raw_parts(t.ptr as *const f32, t.ty.numel() as usize)
}
unsafe fn i32s<'a>(t: &RawTensor) -> &'a [i32] {
    std::slice::from_raw_parts(t.ptr as *const i32, t.ty.numel() as usize)
}
unsafe fn write_f32(t: &RawTensor, v: &[f32]) {
    std::ptr::copy(v.as_ptr(), t.ptr as *mut f32, v.len());
}

/// f32 kernels for the ops [`TinyModel`] uses, with the loops of
/// [`TinyModel::greedy_reference`]. Other ops and dtypes are refused.
///
/// # Safety
/// As `kiln_kernels::cpu::execute`.
pub unsafe fn reference_kernels(
    op: &Op,
    args: &[RawTensor],
    results: &[RawTensor],
) -> Result<(), KernelError> {
    let refuse = |m: &str| KernelError::Operands {
        op: op.mnemonic(),
        message: m.to_string(),
    };
    for t in args.iter().chain(results) {
        if !matches!(t.ty.dtype, DType::F32 | DType::I32) {
            return Err(refuse("the test kernels run f32 only"));
        }
    }
    let dims = |t: &RawTensor| {
        t.ty.shape
            .dims()
            .iter()
            .map(|&d| d as usize)
            .collect::<Vec<_>>()
    };
    match op {
        Op::Embedding => {
            let (ids, tab) = (i32s(&args[0]), f32s(&args[1]));
            let h = dims(&args[1])[1];
            let mut out = vec![0f32; ids.len() * h];
            for (t, &id) in ids.iter().enumerate() {
                let id = id as usize;
                if id >= dims(&args[1])[0] {
                    return Err(refuse("token id out of range"));
                }
                out[t * h..(t + 1) * h].copy_from_slice(&tab[id * h..(id + 1) * h]);
            }
            write_f32(&results[0], &out);
        }
        Op::MatMul { bias: false, .. } => {
            let (xd, wd) = (dims(&args[0]), dims(&args[1]));
            let out = matmul(f32s(&args[0]), xd[0], f32s(&args[1]), wd[0], wd[1]);
            write_f32(&results[0], &out);
        }
        Op::Rope {
            heads,
            head_dim,
            rope: r,
        } => {
            let mut x = f32s(&args[0]).to_vec();
            let inv = r.inv_freq(*head_dim);
            rope(
                &mut x,
                i32s(&args[1]),
                *heads as usize,
                *head_dim as usize,
                &inv,
            );
            write_f32(&results[0], &x);
        }
        Op::KvWrite => {
            let (k, v, slots) = (f32s(&args[0]), f32s(&args[1]), i32s(&args[2]));
            let w = dims(&args[0])[1];
            let s = dims(&args[3])[0];
            let (kc, vc) = (results[0].ptr as *mut f32, results[1].ptr as *mut f32);
            for (t, &slot) in slots.iter().enumerate() {
                let slot = slot as usize;
                if slot >= s {
                    return Err(refuse("slot out of range"));
                }
                std::ptr::copy(k.as_ptr().add(t * w), kc.add(slot * w), w);
                std::ptr::copy(v.as_ptr().add(t * w), vc.add(slot * w), w);
            }
        }
        Op::PagedAttention {
            heads,
            kv_heads,
            head_dim,
            query,
            block_size,
            scale,
            ..
        } => {
            let (q, kc, vc) = (f32s(&args[0]), f32s(&args[1]), f32s(&args[2]));
            let (bt, cl) = (i32s(&args[3]), i32s(&args[4]));
            let (b, m) = (dims(&args[3])[0], dims(&args[3])[1]);
            let (qn, bs) = (*query as usize, *block_size as usize);
            let qw = (*heads * *head_dim) as usize;
            let kvw = (*kv_heads * *head_dim) as usize;
            let s = dims(&args[1])[0];
            let mut out = vec![0f32; b * qn * qw];
            for bi in 0..b {
                for i in 0..qn {
                    let pos = cl[bi] as i64 - qn as i64 + i as i64;
                    let mut rows = Vec::new();
                    for p in 0..=pos.max(-1) {
                        let p = p as usize;
                        let blk = bt[bi * m + p / bs] as usize;
                        let slot = blk * bs + p % bs;
                        if slot >= s {
                            return Err(refuse("block table entry out of range"));
                        }
                        rows.push(slot);
                    }
                    let row = bi * qn + i;
                    attend(
                        &q[row * qw..(row + 1) * qw],
                        kc,
                        vc,
                        &rows,
                        *heads as usize,
                        *kv_heads as usize,
                        *head_dim as usize,
                        kvw,
                        *scale,
                        &mut out[row * qw..(row + 1) * qw],
                    );
                }
            }
            write_f32(&results[0], &out);
        }
        Op::Add => {
            let out: Vec<f32> = f32s(&args[0])
                .iter()
                .zip(f32s(&args[1]))
                .map(|(a, b)| a + b)
                .collect();
            write_f32(&results[0], &out);
        }
        Op::GatherLast { group } => {
            let x = f32s(&args[0]);
            let h = dims(&args[0])[1];
            let g = *group as usize;
            let out: Vec<f32> = (0..dims(&args[0])[0] / g)
                .flat_map(|b| x[((b + 1) * g - 1) * h..(b + 1) * g * h].to_vec())
                .collect();
            write_f32(&results[0], &out);
        }
        Op::Argmax => {
            let x = f32s(&args[0]);
            let v = dims(&args[0])[1];
            let out: Vec<i32> = x.chunks(v).map(|r| argmax(r) as i32).collect();
            std::ptr::copy(out.as_ptr(), results[0].ptr as *mut i32, out.len());
        }
        Op::AcceptGreedy { spec } => {
            let (pred, drafts) = (i32s(&args[0]), i32s(&args[1]));
            let s = *spec as usize;
            let b = drafts.len() / s;
            let out: Vec<i32> = (0..b)
                .map(|r| {
                    (0..s)
                        .take_while(|&j| drafts[r * s + j] == pred[r * (s + 1) + j])
                        .count() as i32
                })
                .collect();
            std::ptr::copy(out.as_ptr(), results[0].ptr as *mut i32, out.len());
        }
        _ => return Err(refuse("not among the test kernels")),
    }
    Ok(())
}

/// The GPT-2 byte-to-character map byte-level BPE vocabularies use.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).expect("valid code point")
}

/// Writes a byte-level BPE `tokenizer.json` into `dir`: token `i < 256` is
/// byte `i` (no merges), token 256 is the special `<eos>`. Returns the EOS id.
pub fn write_byte_tokenizer(dir: &Path) -> std::io::Result<u32> {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..=255u8)
        .map(|b| (byte_char(b).to_string(), serde_json::Value::from(b as u32)))
        .chain(std::iter::once(("<eos>".to_string(), 256.into())))
        .collect();
    let byte_level = serde_json::json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
    });
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{
            "id": 256, "content": "<eos>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": []
        }
    });
    let tmp = dir.join("tokenizer.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&json)?)?;
    std::fs::rename(&tmp, dir.join("tokenizer.json"))?;
    Ok(256)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tiny_key_graph_passes_the_ir_verifier() {
        let m = TinyModel::default();
        let manifest = m.manifest();
        for &k in &m.keys {
            if let Err(e) = kiln_ir::verify(&m.graph(k), Some(&manifest)) {
                panic!("{k}: {e}");
            }
        }
    }
}
