//! The closed set of operations a decode step is made of.
//!
//! Each variant documents its typing rule as `name(args) -> results`, where
//! `D` is a float dtype shared by the activations of the op, `T` the number of
//! tokens in the step (`batch * query`), `B` the batch, `H` a hidden size and
//! `hd` a head dimension. [`Op::infer`] implements exactly these rules; the
//! verifier and the graph builder both use it, so a rule lives in one place.
//!
//! Attributes are constants baked into the plan (eps, head counts, rope
//! frequencies). Nothing that changes from step to step is an attribute: such
//! values are graph inputs read from device memory.
//!
//! Fused variants (`QkvRopeKvWrite`, `RopeAttention`, `MatMulQkvRope`, `AddRmsNorm`,
//! `FusedMatMul`, the one-argument forms of `SiluMul`/`GeluTanhMul`) are produced by compiler passes; frontends emit the
//! plain ones. They are in the same enum so the verifier, the printer and the
//! backends see one closed set.

use crate::types::{DType, Shape, TensorType};
use serde::{Deserialize, Serialize};

/// The most context runs `attention_partials` splits a sequence into.
pub const MAX_ATTENTION_PARTS: u32 = 64;

/// Rotary frequency scaling.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    /// `inv_freq[i] = theta^(-2i/hd)`.
    None,
    /// Positions divided by `factor` (HF "linear").
    Linear { factor: f32 },
    /// Llama 3.1 wavelength-dependent scaling (HF "llama3").
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: u32,
    },
}

/// The attributes of paged decode attention (`paged_attention`, and the
/// attention half of `rope_attention`): one struct, so the fused op carries
/// exactly the attention it is defined as. Encoded (bincode) as its fields
/// in order, the same bytes as the flat attribute lists it replaced.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttnAttrs {
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub query: u32,
    pub block_size: u32,
    pub scale: f32,
    pub window: Option<u32>,
    pub softcap: Option<f32>,
}

/// Rotary embedding parameters (rotate-half convention, full head dim rotated).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rope {
    pub theta: f32,
    pub scaling: RopeScaling,
}

impl Rope {
    /// The inverse frequencies for `head_dim`, `head_dim / 2` of them, in f64.
    /// Kernels on every backend use this table (uploaded or baked), so they
    /// agree bit for bit on the angles' inputs.
    pub fn inv_freq(&self, head_dim: u32) -> Vec<f64> {
        let half = head_dim / 2;
        let base: Vec<f64> = (0..half)
            .map(|i| 1.0 / (self.theta as f64).powf((2 * i) as f64 / head_dim as f64))
            .collect();
        match self.scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor as f64).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                let (factor, lo, hi) = (
                    factor as f64,
                    low_freq_factor as f64,
                    high_freq_factor as f64,
                );
                let old = original_max_position as f64;
                let low_wavelen = old / lo;
                let high_wavelen = old / hi;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - lo) / (hi - lo);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }
}

/// The RMSNorm a [`Op::FusedMatMul`] applies to its input rows before the
/// product (its prologue): `rms_norm { eps, unit_offset }`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PreNorm {
    pub eps: f32,
    pub unit_offset: bool,
}

/// What a [`Op::FusedMatMul`] does with its product before storing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Epilogue {
    /// The product itself (rounded to `out`).
    None,
    /// `silu_mul` of the packed product: the weight stacks gate rows over
    /// up rows, the result is `silu(gate) * up`, half as wide.
    SiluMul,
    /// As `SiluMul` with GELU (tanh approximation).
    GeluTanhMul,
    /// `add` of a residual operand: the result is the new residual stream.
    Residual,
    /// `argmax` of the product: the result is `i32[T]`, each row's index of
    /// the first maximum of the product rounded to `out` (the logits the
    /// unfused matmul would store), under `Op::Argmax`'s NaN rule. The
    /// lm_head GEMV of a greedy plan whose logits are not an output.
    Argmax,
}

impl Epilogue {
    /// The name in the text form.
    pub fn name(self) -> &'static str {
        match self {
            Epilogue::None => "none",
            Epilogue::SiluMul => "silu_mul",
            Epilogue::GeluTanhMul => "gelu_tanh_mul",
            Epilogue::Residual => "residual",
            Epilogue::Argmax => "argmax",
        }
    }

    /// Every epilogue, in text-form order.
    pub const ALL: [Epilogue; 5] = [
        Epilogue::None,
        Epilogue::SiluMul,
        Epilogue::GeluTanhMul,
        Epilogue::Residual,
        Epilogue::Argmax,
    ];

    /// The epilogue named `name` in the text form.
    pub fn from_name(name: &str) -> Option<Epilogue> {
        Epilogue::ALL.into_iter().find(|e| e.name() == name)
    }
}

/// The most `(token, count)` pairs a row of `sample`'s penalties operand
/// may carry (the GPU kernel holds a row's list in shared memory).
pub const MAX_PENALTY_SLOTS: u32 = 1024;

/// One operation. See the module docs for the notation of the typing rules.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// `embedding(ids: i32[T], table: D[V,H]) -> D[T,H]`: row gather.
    Embedding,
    /// `rms_norm(x: D[T,H], w: D[H]) -> D[T,H]`:
    /// `x / sqrt(mean(x^2) + eps) * w`, or `* (1 + w)` when `unit_offset` (Gemma).
    RmsNorm { eps: f32, unit_offset: bool },
    /// `add_rms_norm(x: D[T,H], residual: D[T,H], w: D[H]) -> (normed: D[T,H], sum: D[T,H])`:
    /// `sum = x + residual` (rounded to D), `normed = rms_norm(sum)`.
    AddRmsNorm { eps: f32, unit_offset: bool },
    /// `matmul(x: D[T,K], w: D[N,K] [, bias: D[N]]) -> out[T,N]`: `x @ w^T (+ bias)`,
    /// weights stored `[out, in]` as in HF checkpoints. `out` is the result dtype
    /// (f32 for logits). Arity 3 exactly when `bias`.
    MatMul { bias: bool, out: DType },
    /// `head_rms_norm(x: D[T, heads*hd], w: D[hd]) -> D[T, heads*hd]`: RMSNorm of
    /// each head's `hd` slice (Qwen3 q_norm/k_norm).
    HeadRmsNorm {
        heads: u32,
        head_dim: u32,
        eps: f32,
        unit_offset: bool,
    },
    /// `rope(x: D[T, heads*hd], pos: i32[T]) -> D[T, heads*hd]`: rotate-half RoPE
    /// at each token's position.
    Rope {
        heads: u32,
        head_dim: u32,
        rope: Rope,
    },
    /// `kv_write(k: D[T, kvh*hd], v: D[T, kvh*hd], slots: i32[T], kc: D[S, kvh*hd], vc: D[S, kvh*hd])
    ///   -> (kc': D[S, kvh*hd], vc': D[S, kvh*hd])`: row `t` of k/v goes to slot
    /// `slots[t]` of the caches. The results are the caches themselves (in place):
    /// they exist so attention is ordered after the write.
    KvWrite,
    /// `paged_attention(q: D[B*Q, heads*hd], kc: D[S, kvh*hd], vc: D[S, kvh*hd],
    ///   block_tables: i32[B, M], context_lens: i32[B]) -> D[B*Q, heads*hd]`.
    /// Query token `i` of sequence `b` sits at position `context_lens[b] - Q + i`
    /// and attends to positions `<= ` its own (causal inside the query window),
    /// and only to the last `window` positions when `window` is set. Position
    /// `p` of sequence `b` lives in slot `block_tables[b][p / block_size] *
    /// block_size + p % block_size`. Scores are `q.k * scale`, then
    /// `softcap * tanh(s / softcap)` when `softcap` is set. GQA: head `h` reads
    /// kv head `h / (heads / kv_heads)`.
    PagedAttention(AttnAttrs),
    /// Fused q/k norm + RoPE + KV write over a packed qkv projection:
    /// `qkv_rope_kv_write(qkv: D[T, (heads + 2*kvh)*hd], pos: i32[T], slots: i32[T],
    ///   kc: D[S, kvh*hd], vc: D[S, kvh*hd] [, q_norm: D[hd], k_norm: D[hd]])
    ///   -> (q: D[T, heads*hd], kc', vc')`. Arity 7 exactly when `qk_norm` is set.
    QkvRopeKvWrite {
        heads: u32,
        kv_heads: u32,
        head_dim: u32,
        rope: Rope,
        /// `eps` of the per-head RMSNorm applied to q and k before RoPE.
        qk_norm: Option<f32>,
        unit_offset: bool,
    },
    /// `silu_mul(gate: D[T,I], up: D[T,I]) -> D[T,I]`, or the fused form
    /// `silu_mul(gate_up: D[T,2I]) -> D[T,I]` (gate is the first half).
    SiluMul,
    /// As `SiluMul` with GELU (tanh approximation) instead of SiLU.
    GeluTanhMul,
    /// `add(a: D[..], b: D[..]) -> D[..]`: same type in and out.
    Add,
    /// `gather_last(x: D[B*group, H]) -> D[B, H]`: the last row of each group of
    /// `group` rows (the one position whose logits a prefill chunk needs).
    GatherLast { group: u32 },
    /// `argmax(x: F[R, V]) -> i32[R]`: index of the first maximum of each row.
    Argmax,
    /// `accept_greedy(pred: i32[B*(spec+1)], drafts: i32[B*spec]) -> i32[B]`:
    /// per sequence, the number of leading drafts equal to the model's own
    /// greedy prediction at the previous position (`drafts[b,j] == pred[b,j]`).
    /// The host then takes `accepted + 1` tokens from `pred` (the bonus token).
    AcceptGreedy { spec: u32 },
    /// `sample(logits: F[R, V], params: f32[R, 4], seeds: i32[R, 4]) -> i32[R]`:
    /// each row's next token drawn from `softmax(logits / temperature)` after
    /// top-k, top-p and min-p, with a Philox4x32-10 uniform keyed by the row's
    /// seed and counter; `params` row `[temperature, top_p, min_p, 0]`, `seeds`
    /// row `[top_k, seed_lo, seed_hi, counter]`. A row with `temperature <= 0`
    /// is exactly `argmax`. An optional fourth operand
    /// `penalties: i32[R, 2 + 2P]` carries each row's presence and
    /// frequency penalties (f32 bits) and up to `P` `(token, count)` pairs
    /// (sorted by token, padded with `-1`), applied to the logits first:
    /// `x - presence - frequency * count`. The normative algorithm is in
    /// kiln-kernels (`cpu::sample`).
    Sample,
    /// A matmul with an RMSNorm prologue and/or an epilogue, the unfused
    /// sequence computed by one kernel (formed by the `fuse-matmul` pass):
    /// `fused_matmul(x: D[T,K], w: D[N,K] [, bias: D[N]] [, norm: D[K]]
    ///   [, residual: D[T,N]]) -> R`, arguments in that order, `bias` present
    /// exactly when `bias`, `norm` exactly when `pre` is set, `residual`
    /// exactly when `post` is `Residual`. It computes
    /// `y = matmul(pre ? rms_norm(x, norm) : x, w [, bias])` and then
    /// * `None`: `R = out[T,N]`, `y` itself;
    /// * `SiluMul` / `GeluTanhMul`: `R = D[T,N/2]`, `silu_mul(y)` /
    ///   `gelu_tanh_mul(y)` of the packed product (N even, gate rows first);
    /// * `Residual`: `R = D[T,N]`, `add(y, residual)`;
    /// * `Argmax`: `R = i32[T]`, `argmax(y)` with `y` rounded to `out` (f32
    ///   logits, or D): the greedy token of each row, `y` never stored.
    ///
    /// With an epilogue other than `Argmax`, `out` must be D. Every intermediate (the normed rows,
    /// `y`) is rounded to D where the unfused op would store it, so the fused
    /// op equals the unfused sequence up to the summation order of the sums.
    FusedMatMul {
        bias: bool,
        out: DType,
        pre: Option<PreNorm>,
        post: Epilogue,
    },
    /// `scale(x: D[..]) -> D[..]`: `y = x * factor`, then
    /// `softcap * tanh(y / softcap)` when `softcap` is set, rounded to D once.
    /// Gemma's embedding scale (`factor` = sqrt(hidden) already rounded to
    /// the activation dtype, as HF rounds it) and final logit softcapping
    /// (`factor` 1 on f32 logits).
    Scale { factor: f32, softcap: Option<f32> },
    // Tensor-parallel collectives (`kiln compile --tp N`). Every rank of a
    // plan runs the same program; `ranks` is the plan's rank count.
    /// `all_reduce(x: F[..]) -> out[..]`: the elementwise sum of `x` over the
    /// `ranks` ranks, accumulated in f32 in the fixed order `rank 0 + rank 1
    /// + ...` (left to right) and rounded to `out` once, so every rank holds
    /// the same bits.
    /// The shard pass feeds it f32 partial products, so the row-parallel
    /// matmul's sum is rounded once, as the unsharded matmul's is.
    /// With `ranks` 1 it is a conversion.
    AllReduce { ranks: u32, out: DType },
    /// `sharded_argmax(x: F[R, Vs]) -> i32[R]`: the argmax of each row of the
    /// rank-order concatenation of every rank's `x` (rank `r` holds columns
    /// `r*Vs .. (r+1)*Vs` of the full row): the global index of the first
    /// maximum, exactly the unsharded `argmax` of the full row. Each rank
    /// contributes its (max, global index) pair; the pairs are reduced in
    /// rank order, a later rank winning only with a strictly larger value.
    /// With `ranks` 1 it is `argmax`.
    ShardedArgmax { ranks: u32 },
    // Appended last: a variant's position is its tag in encoded plans, so
    // plans written before it existed still decode.
    /// `qkv_rope_kv_write` feeding `paged_attention`, as one op:
    /// `rope_attention(qkv: D[T, (heads + 2*kvh)*hd], pos: i32[T], slots: i32[T],
    ///   kc: D[S, kvh*hd], vc: D[S, kvh*hd], block_tables: i32[B, M],
    ///   context_lens: i32[B] [, q_norm: D[hd], k_norm: D[hd]])
    ///   -> (out: D[T, heads*hd], kc', vc')`, `T = B * query`. Defined as
    /// exactly `(q, kc', vc') = qkv_rope_kv_write(qkv, pos, slots, kc, vc
    /// [, q_norm, k_norm])` then `out = paged_attention(q, kc', vc',
    /// block_tables, context_lens)` with the attributes of both (q is rounded
    /// to `D` between them, as the unfused op stores it); arity 9 exactly when
    /// `qk_norm` is set. The roped q never reaches memory: the attention
    /// kernel ropes its own query rows and the step's new K/V rows.
    RopeAttention {
        /// The attention's attributes (its heads are the rope's too).
        attn: AttnAttrs,
        rope: Rope,
        qk_norm: Option<f32>,
        unit_offset: bool,
    },
    /// The first half of `paged_attention` split over the context (what the
    /// megakernel schedule runs, so one (sequence, head)'s positions spread
    /// over several blocks): `attention_partials(q, kc, vc, block_tables,
    /// context_lens) -> f32[R, heads * parts * (head_dim + 2)]` with the
    /// operands of `paged_attention` (same typing rule), `R = B * query`.
    /// Sequence `b` of `ctx` tokens, whose first query token sees positions
    /// from `lo` (0, or `ctx - query - window + 1` clamped at 0 with a
    /// window), has its positions `[lo, ctx)` cut into `parts` runs of
    /// `ceil((ctx - lo) / parts)`; entry `(row, head, part)` (in that order,
    /// `head_dim + 2` floats each) holds, over the positions of that run the
    /// row sees (the masking of `paged_attention`), `o = sum_p e_p * v_p`,
    /// then `m = max_p s_p` and `l = sum_p e_p` with `e_p = exp(s_p - m)`
    /// and `s_p` the row's score; a run the row sees nothing of is
    /// `o = 0, m = -inf, l = 0`.
    AttentionPartials { attn: AttnAttrs, parts: u32 },
    /// The second half: `attention_combine(partials: f32[R, heads * parts *
    /// (head_dim + 2)]) -> out[R, heads * head_dim]`: per (row, head),
    /// `M = max m` over the runs with `l > 0`, `w = exp(m - M)`, `L = sum w *
    /// l`, `out = (sum w * o) / L` in run order, rounded to `out` once (0
    /// where no run saw a position). `attention_combine(attention_partials(
    /// ...))` is `paged_attention(...)` up to the order of the sums.
    AttentionCombine {
        heads: u32,
        head_dim: u32,
        parts: u32,
        out: DType,
    },
    /// The packed q/k/v projection (a `fused_matmul` without an epilogue)
    /// feeding `qkv_rope_kv_write`, as one op:
    /// `matmul_qkv_rope(x: D[T, K], w: D[N, K] [, bias: D[N]] [, norm_w: D[K]],
    ///   pos: i32[T], slots: i32[T], kc: D[S, kvh*hd], vc: D[S, kvh*hd]
    ///   [, q_norm: D[hd], k_norm: D[hd]]) -> (q: D[T, heads*hd], kc', vc')`
    /// with `N = (heads + 2*kvh)*hd`. Defined as exactly
    /// `qkv = fused_matmul{bias, out: D, pre, epilogue: none}(x, w [, bias]
    /// [, norm_w])` then `(q, kc', vc') = qkv_rope_kv_write(qkv, pos, slots,
    /// kc, vc [, q_norm, k_norm])` with the attributes of both (qkv rounded to
    /// `D` between them, as the unfused matmul stores it). The packed qkv is
    /// no value of the graph: on a GPU the GEMV's blocks write it to the op's
    /// scratch and the last block to finish each head's rows ropes and
    /// stores that head, so the step has one launch fewer per layer.
    MatMulQkvRope {
        bias: bool,
        pre: Option<PreNorm>,
        heads: u32,
        kv_heads: u32,
        head_dim: u32,
        rope: Rope,
        qk_norm: Option<f32>,
        unit_offset: bool,
    },
}

/// Why an op's operands do not type-check. The verifier adds the location.
pub type TypeError = String;

impl Op {
    /// The mnemonic used in the text form.
    pub fn mnemonic(&self) -> &'static str {
        match self {
            Op::Embedding => "embedding",
            Op::RmsNorm { .. } => "rms_norm",
            Op::AddRmsNorm { .. } => "add_rms_norm",
            Op::MatMul { .. } => "matmul",
            Op::HeadRmsNorm { .. } => "head_rms_norm",
            Op::Rope { .. } => "rope",
            Op::KvWrite => "kv_write",
            Op::PagedAttention(..) => "paged_attention",
            Op::QkvRopeKvWrite { .. } => "qkv_rope_kv_write",
            Op::RopeAttention { .. } => "rope_attention",
            Op::SiluMul => "silu_mul",
            Op::GeluTanhMul => "gelu_tanh_mul",
            Op::Add => "add",
            Op::GatherLast { .. } => "gather_last",
            Op::Argmax => "argmax",
            Op::AcceptGreedy { .. } => "accept_greedy",
            Op::Sample => "sample",
            Op::FusedMatMul { .. } => "fused_matmul",
            Op::Scale { .. } => "scale",
            Op::AllReduce { .. } => "all_reduce",
            Op::ShardedArgmax { .. } => "sharded_argmax",
            Op::AttentionPartials { .. } => "attention_partials",
            Op::AttentionCombine { .. } => "attention_combine",
            Op::MatMulQkvRope { .. } => "matmul_qkv_rope",
        }
    }

    /// All mnemonics, for error messages ("expected one of ...").
    pub const MNEMONICS: [&'static str; 24] = [
        "embedding",
        "rms_norm",
        "add_rms_norm",
        "matmul",
        "head_rms_norm",
        "rope",
        "kv_write",
        "paged_attention",
        "qkv_rope_kv_write",
        "rope_attention",
        "silu_mul",
        "gelu_tanh_mul",
        "add",
        "gather_last",
        "argmax",
        "accept_greedy",
        "sample",
        "fused_matmul",
        "scale",
        "all_reduce",
        "sharded_argmax",
        "attention_partials",
        "attention_combine",
        "matmul_qkv_rope",
    ];

    /// Accepted argument counts.
    pub fn arity(&self) -> &'static [usize] {
        match self {
            Op::Embedding => &[2],
            Op::RmsNorm { .. } => &[2],
            Op::AddRmsNorm { .. } => &[3],
            Op::MatMul { bias: false, .. } => &[2],
            Op::MatMul { bias: true, .. } => &[3],
            Op::HeadRmsNorm { .. } => &[2],
            Op::Rope { .. } => &[2],
            Op::KvWrite => &[5],
            Op::PagedAttention(..) => &[5],
            Op::QkvRopeKvWrite { qk_norm: None, .. } => &[5],
            Op::QkvRopeKvWrite {
                qk_norm: Some(_), ..
            } => &[7],
            Op::RopeAttention { qk_norm: None, .. } => &[7],
            Op::RopeAttention {
                qk_norm: Some(_), ..
            } => &[9],
            Op::SiluMul | Op::GeluTanhMul => &[1, 2],
            Op::Add => &[2],
            Op::GatherLast { .. } => &[1],
            Op::Argmax => &[1],
            Op::AcceptGreedy { .. } => &[2],
            Op::Sample => &[3, 4],
            Op::Scale { .. } => &[1],
            Op::AllReduce { .. } | Op::ShardedArgmax { .. } => &[1],
            Op::AttentionPartials { .. } => &[5],
            Op::AttentionCombine { .. } => &[1],
            Op::FusedMatMul { .. } => match self.fused_arg_count() {
                2 => &[2],
                3 => &[3],
                4 => &[4],
                _ => &[5],
            },
            Op::MatMulQkvRope { qk_norm, .. } => {
                match self.fused_arg_count() + 4 + 2 * qk_norm.is_some() as usize {
                    6 => &[6],
                    7 => &[7],
                    8 => &[8],
                    9 => &[9],
                    _ => &[10],
                }
            }
        }
    }

    /// Argument count of a `fused_matmul` (2 for any other op): x and w,
    /// then bias, norm weight and residual when present.
    fn fused_arg_count(&self) -> usize {
        match self {
            Op::FusedMatMul {
                bias, pre, post, ..
            } => {
                2 + *bias as usize + pre.is_some() as usize + (*post == Epilogue::Residual) as usize
            }
            // Its matmul's: x, w, then bias and norm weight when present.
            Op::MatMulQkvRope { bias, pre, .. } => 2 + *bias as usize + pre.is_some() as usize,
            _ => 2,
        }
    }

    /// The inverse of [`Op::split_matmul_qkv_rope`]: the `matmul_qkv_rope`
    /// of a projection (a `matmul`, or a `fused_matmul` without an
    /// epilogue) whose result dtype is `act` and a `qkv_rope_kv_write`;
    /// None for any other pair. The fusion pass, the parser and the printer
    /// all go through this pair, so the fused op's attributes are the
    /// parts' and nothing else.
    pub fn join_matmul_qkv_rope(mm: &Op, rope: &Op, act: DType) -> Option<Op> {
        let (bias, pre) = match mm {
            Op::MatMul { bias, out } if *out == act => (*bias, None),
            Op::FusedMatMul {
                bias,
                out,
                pre,
                post: Epilogue::None,
            } if *out == act => (*bias, *pre),
            _ => return None,
        };
        let Op::QkvRopeKvWrite {
            heads,
            kv_heads,
            head_dim,
            rope,
            qk_norm,
            unit_offset,
        } = rope
        else {
            return None;
        };
        Some(Op::MatMulQkvRope {
            bias,
            pre,
            heads: *heads,
            kv_heads: *kv_heads,
            head_dim: *head_dim,
            rope: rope.clone(),
            qk_norm: *qk_norm,
            unit_offset: *unit_offset,
        })
    }

    /// A `matmul_qkv_rope`'s two parts for activations of dtype `act`: the
    /// `fused_matmul` (no epilogue, result `act`) and the
    /// `qkv_rope_kv_write` it is defined as (None for any other op).
    pub fn split_matmul_qkv_rope(&self, act: DType) -> Option<(Op, Op)> {
        let Op::MatMulQkvRope {
            bias,
            pre,
            heads,
            kv_heads,
            head_dim,
            rope,
            qk_norm,
            unit_offset,
        } = self
        else {
            return None;
        };
        Some((
            Op::FusedMatMul {
                bias: *bias,
                out: act,
                pre: *pre,
                post: Epilogue::None,
            },
            Op::QkvRopeKvWrite {
                heads: *heads,
                kv_heads: *kv_heads,
                head_dim: *head_dim,
                rope: rope.clone(),
                qk_norm: *qk_norm,
                unit_offset: *unit_offset,
            },
        ))
    }

    /// The inverse of [`Op::split_rope_attention`]: the `rope_attention` of
    /// a `qkv_rope_kv_write` and a `paged_attention`, None unless they are
    /// those ops and agree on heads, kv heads and head_dim. The fusion pass,
    /// the parser and the printer all go through this pair, so the fused
    /// op's attributes are the parts' and nothing else.
    pub fn join_rope_attention(rope: &Op, attn: &Op) -> Option<Op> {
        let (
            Op::QkvRopeKvWrite {
                heads,
                kv_heads,
                head_dim,
                rope,
                qk_norm,
                unit_offset,
            },
            Op::PagedAttention(a),
        ) = (rope, attn)
        else {
            return None;
        };
        ((*heads, *kv_heads, *head_dim) == (a.heads, a.kv_heads, a.head_dim)).then(|| {
            Op::RopeAttention {
                attn: *a,
                rope: rope.clone(),
                qk_norm: *qk_norm,
                unit_offset: *unit_offset,
            }
        })
    }

    /// A `rope_attention`'s two parts: the `qkv_rope_kv_write` and the
    /// `paged_attention` it is defined as (None for any other op).
    pub fn split_rope_attention(&self) -> Option<(Op, Op)> {
        let Op::RopeAttention {
            attn,
            rope,
            qk_norm,
            unit_offset,
        } = self
        else {
            return None;
        };
        Some((
            Op::QkvRopeKvWrite {
                heads: attn.heads,
                kv_heads: attn.kv_heads,
                head_dim: attn.head_dim,
                rope: rope.clone(),
                qk_norm: *qk_norm,
                unit_offset: *unit_offset,
            },
            Op::PagedAttention(*attn),
        ))
    }

    /// Indices of results that alias an argument (in-place ops): `(result, arg)`.
    /// The planner gives such a result the argument's memory.
    pub fn aliases(&self) -> &'static [(usize, usize)] {
        match self {
            Op::KvWrite => &[(0, 3), (1, 4)],
            Op::QkvRopeKvWrite { .. } | Op::RopeAttention { .. } => &[(1, 3), (2, 4)],
            // The caches follow the matmul's operands and pos, slots.
            Op::MatMulQkvRope { .. } => match self.fused_arg_count() {
                2 => &[(1, 4), (2, 5)],
                3 => &[(1, 5), (2, 6)],
                _ => &[(1, 6), (2, 7)],
            },
            _ => &[],
        }
    }

    /// Whether the op may write its result over argument `arg` when that
    /// argument dies at this op (elementwise, same size): `(result, arg)` pairs.
    pub fn may_reuse(&self) -> &'static [(usize, usize)] {
        match self {
            Op::Add => &[(0, 0), (0, 1)],
            Op::Rope { .. } => &[(0, 0)],
            Op::HeadRmsNorm { .. } => &[(0, 0)],
            Op::SiluMul | Op::GeluTanhMul => &[(0, 0)],
            Op::Scale { .. } => &[(0, 0)],
            _ => &[],
        }
    }

    /// Result types from argument types, per the typing rules above.
    pub fn infer(&self, args: &[TensorType]) -> Result<Vec<TensorType>, TypeError> {
        if !self.arity().contains(&args.len()) {
            let want: Vec<String> = self.arity().iter().map(|a| a.to_string()).collect();
            return Err(format!(
                "`{}` takes {} argument(s), got {}",
                self.mnemonic(),
                want.join(" or "),
                args.len()
            ));
        }
        let m = self.mnemonic();
        let float = |i: usize, what: &str| -> Result<(), TypeError> {
            if args[i].dtype.is_float() {
                Ok(())
            } else {
                Err(format!(
                    "`{m}` {what} (argument {i}) must be a float tensor, got {}",
                    args[i]
                ))
            }
        };
        let int = |i: usize, what: &str| -> Result<(), TypeError> {
            if args[i].dtype == DType::I32 {
                Ok(())
            } else {
                Err(format!(
                    "`{m}` {what} (argument {i}) must be i32, got {}",
                    args[i]
                ))
            }
        };
        let rank = |i: usize, r: usize, what: &str| -> Result<&[u32], TypeError> {
            let d = args[i].shape.dims();
            if d.len() == r {
                Ok(d)
            } else {
                Err(format!(
                    "`{m}` {what} (argument {i}) must have rank {r}, got {}",
                    args[i]
                ))
            }
        };
        let same_dtype = |i: usize, j: usize| -> Result<(), TypeError> {
            if args[i].dtype == args[j].dtype {
                Ok(())
            } else {
                Err(format!(
                    "`{m}` arguments {i} and {j} must share a dtype, got {} and {}",
                    args[i], args[j]
                ))
            }
        };
        let want = |cond: bool, msg: String| -> Result<(), TypeError> {
            if cond {
                Ok(())
            } else {
                Err(format!("`{m}` {msg}"))
            }
        };
        let tt = |d: DType, s: Vec<u32>| TensorType::new(d, Shape(s));
        // Attribute products are compared in u64: a parsed graph may carry any
        // u32 attributes, and typing must reject them, not overflow.
        let wide = |x: u32| x as u64;
        match self {
            Op::Embedding => {
                int(0, "ids")?;
                let ids = rank(0, 1, "ids")?;
                float(1, "table")?;
                let tab = rank(1, 2, "table")?;
                Ok(vec![tt(args[1].dtype, vec![ids[0], tab[1]])])
            }
            Op::RmsNorm { .. } => {
                float(0, "x")?;
                let x = rank(0, 2, "x")?;
                let w = rank(1, 1, "weight")?;
                same_dtype(0, 1)?;
                want(
                    w[0] == x[1],
                    format!("weight length {} must equal the row length {}", w[0], x[1]),
                )?;
                Ok(vec![args[0].clone()])
            }
            Op::AddRmsNorm { .. } => {
                float(0, "x")?;
                let x = rank(0, 2, "x")?;
                want(
                    args[1] == args[0],
                    format!("residual {} must have the type of x {}", args[1], args[0]),
                )?;
                let w = rank(2, 1, "weight")?;
                same_dtype(0, 2)?;
                want(
                    w[0] == x[1],
                    format!("weight length {} must equal the row length {}", w[0], x[1]),
                )?;
                Ok(vec![args[0].clone(), args[0].clone()])
            }
            Op::MatMul { bias, out } => {
                float(0, "x")?;
                let x = rank(0, 2, "x")?;
                float(1, "weight")?;
                let w = rank(1, 2, "weight")?;
                same_dtype(0, 1)?;
                want(
                    x[1] == w[1],
                    format!(
                        "x {} and weight {} disagree on the inner dimension ({} vs {})",
                        args[0], args[1], x[1], w[1]
                    ),
                )?;
                want(
                    out.is_float(),
                    format!("result dtype must be float, got {out}"),
                )?;
                if *bias {
                    let b = rank(2, 1, "bias")?;
                    same_dtype(0, 2)?;
                    want(
                        b[0] == w[0],
                        format!(
                            "bias length {} must equal the output features {}",
                            b[0], w[0]
                        ),
                    )?;
                }
                Ok(vec![tt(*out, vec![x[0], w[0]])])
            }
            Op::HeadRmsNorm {
                heads, head_dim, ..
            } => {
                float(0, "x")?;
                let x = rank(0, 2, "x")?;
                let w = rank(1, 1, "weight")?;
                same_dtype(0, 1)?;
                want(
                    *head_dim > 0 && x[1] as u64 == wide(*heads) * wide(*head_dim),
                    format!(
                        "x row length {} must be heads*head_dim = {}*{}",
                        x[1], heads, head_dim
                    ),
                )?;
                want(
                    w[0] == *head_dim,
                    format!("weight length {} must equal head_dim {}", w[0], head_dim),
                )?;
                Ok(vec![args[0].clone()])
            }
            Op::Rope {
                heads, head_dim, ..
            } => {
                float(0, "x")?;
                let x = rank(0, 2, "x")?;
                int(1, "positions")?;
                let p = rank(1, 1, "positions")?;
                want(
                    *head_dim > 0 && head_dim % 2 == 0,
                    format!("head_dim {head_dim} must be even and positive"),
                )?;
                want(
                    x[1] as u64 == wide(*heads) * wide(*head_dim),
                    format!(
                        "x row length {} must be heads*head_dim = {}*{}",
                        x[1], heads, head_dim
                    ),
                )?;
                want(
                    p[0] == x[0],
                    format!(
                        "positions length {} must equal the token count {}",
                        p[0], x[0]
                    ),
                )?;
                Ok(vec![args[0].clone()])
            }
            Op::KvWrite => {
                float(0, "k")?;
                let k = rank(0, 2, "k")?;
                want(
                    args[1] == args[0],
                    format!("v {} must have the type of k {}", args[1], args[0]),
                )?;
                int(2, "slots")?;
                let s = rank(2, 1, "slots")?;
                want(
                    s[0] == k[0],
                    format!("slots length {} must equal the token count {}", s[0], k[0]),
                )?;
                let kc = rank(3, 2, "k cache")?;
                same_dtype(0, 3)?;
                want(
                    kc[1] == k[1],
                    format!("k cache row {} must equal the k row {}", kc[1], k[1]),
                )?;
                want(
                    args[4] == args[3],
                    format!(
                        "v cache {} must have the type of the k cache {}",
                        args[4], args[3]
                    ),
                )?;
                Ok(vec![args[3].clone(), args[4].clone()])
            }
            Op::PagedAttention(AttnAttrs {
                heads,
                kv_heads,
                head_dim,
                query,
                block_size,
                ..
            }) => {
                float(0, "q")?;
                let q = rank(0, 2, "q")?;
                want(
                    *kv_heads > 0 && *heads > 0 && heads % kv_heads == 0,
                    format!("heads {heads} must be a positive multiple of kv_heads {kv_heads}"),
                )?;
                want(
                    *query > 0 && *block_size > 0,
                    "query and block_size must be positive".into(),
                )?;
                want(
                    q[1] as u64 == wide(*heads) * wide(*head_dim),
                    format!(
                        "q row length {} must be heads*head_dim = {}*{}",
                        q[1], heads, head_dim
                    ),
                )?;
                let kc = rank(1, 2, "k cache")?;
                same_dtype(0, 1)?;
                want(
                    kc[1] as u64 == wide(*kv_heads) * wide(*head_dim),
                    format!(
                        "k cache row {} must be kv_heads*head_dim = {}*{}",
                        kc[1], kv_heads, head_dim
                    ),
                )?;
                want(
                    args[2] == args[1],
                    format!(
                        "v cache {} must have the type of the k cache {}",
                        args[2], args[1]
                    ),
                )?;
                int(3, "block_tables")?;
                let bt = rank(3, 2, "block_tables")?;
                int(4, "context_lens")?;
                let cl = rank(4, 1, "context_lens")?;
                want(
                    cl[0] == bt[0],
                    format!(
                        "context_lens length {} must equal the block_tables rows {}",
                        cl[0], bt[0]
                    ),
                )?;
                want(
                    q[0] as u64 == wide(bt[0]) * wide(*query),
                    format!("q rows {} must be batch*query = {}*{}", q[0], bt[0], query),
                )?;
                Ok(vec![args[0].clone()])
            }
            Op::QkvRopeKvWrite {
                heads,
                kv_heads,
                head_dim,
                qk_norm,
                ..
            } => {
                float(0, "qkv")?;
                let x = rank(0, 2, "qkv")?;
                want(
                    *head_dim > 0 && head_dim % 2 == 0,
                    format!("head_dim {head_dim} must be even and positive"),
                )?;
                want(
                    x[1] as u64 == (wide(*heads) + 2 * wide(*kv_heads)) * wide(*head_dim),
                    format!(
                        "qkv row length {} must be (heads + 2*kv_heads)*head_dim = ({} + 2*{})*{}",
                        x[1], heads, kv_heads, head_dim
                    ),
                )?;
                for (i, what) in [(1, "positions"), (2, "slots")] {
                    int(i, what)?;
                    let p = rank(i, 1, what)?;
                    want(
                        p[0] == x[0],
                        format!("{what} length {} must equal the token count {}", p[0], x[0]),
                    )?;
                }
                let kc = rank(3, 2, "k cache")?;
                same_dtype(0, 3)?;
                want(
                    kc[1] as u64 == wide(*kv_heads) * wide(*head_dim),
                    format!(
                        "k cache row {} must be kv_heads*head_dim = {}*{}",
                        kc[1], kv_heads, head_dim
                    ),
                )?;
                want(
                    args[4] == args[3],
                    format!(
                        "v cache {} must have the type of the k cache {}",
                        args[4], args[3]
                    ),
                )?;
                if qk_norm.is_some() {
                    for i in [5, 6] {
                        let w = rank(i, 1, "norm weight")?;
                        same_dtype(0, i)?;
                        want(
                            w[0] == *head_dim,
                            format!(
                                "norm weight length {} must equal head_dim {}",
                                w[0], head_dim
                            ),
                        )?;
                    }
                }
                Ok(vec![
                    tt(args[0].dtype, vec![x[0], heads * head_dim]),
                    args[3].clone(),
                    args[4].clone(),
                ])
            }
            Op::RopeAttention { .. } => {
                // Exactly the two ops it stands for: each typing rule in one place.
                let (rope_op, attn_op) = self.split_rope_attention().expect("rope_attention");
                let mut ra: Vec<TensorType> = args[..5].to_vec();
                ra.extend_from_slice(&args[7..]);
                let r = rope_op.infer(&ra)?;
                attn_op.infer(&[
                    r[0].clone(),
                    r[1].clone(),
                    r[2].clone(),
                    args[5].clone(),
                    args[6].clone(),
                ])?;
                Ok(r)
            }
            Op::MatMulQkvRope { .. } => {
                // Exactly the two ops it stands for: each typing rule in one place.
                let m = self.fused_arg_count();
                let act = args[0].dtype;
                let (mm, rope) = self.split_matmul_qkv_rope(act).expect("matmul_qkv_rope");
                let qkv = mm.infer(&args[..m])?;
                let mut ra = qkv;
                ra.extend_from_slice(&args[m..]);
                rope.infer(&ra)
            }
            Op::SiluMul | Op::GeluTanhMul => {
                float(0, "gate")?;
                let g = rank(0, 2, "gate")?;
                if args.len() == 2 {
                    want(
                        args[1] == args[0],
                        format!("up {} must have the type of gate {}", args[1], args[0]),
                    )?;
                    Ok(vec![args[0].clone()])
                } else {
                    want(
                        g[1] % 2 == 0,
                        format!("packed gate_up row length {} must be even", g[1]),
                    )?;
                    Ok(vec![tt(args[0].dtype, vec![g[0], g[1] / 2])])
                }
            }
            Op::Add => {
                float(0, "a")?;
                want(
                    args[1] == args[0],
                    format!(
                        "operands must have one type, got {} and {}",
                        args[0], args[1]
                    ),
                )?;
                Ok(vec![args[0].clone()])
            }
            Op::GatherLast { group } => {
                let x = rank(0, 2, "x")?;
                want(
                    *group > 0 && x[0] % group == 0,
                    format!("row count {} must be a multiple of group {}", x[0], group),
                )?;
                Ok(vec![tt(args[0].dtype, vec![x[0] / group, x[1]])])
            }
            Op::Argmax => {
                float(0, "x")?;
                let x = rank(0, 2, "x")?;
                want(x[1] > 0, "rows must not be empty".into())?;
                Ok(vec![tt(DType::I32, vec![x[0]])])
            }
            Op::AcceptGreedy { spec } => {
                int(0, "pred")?;
                let p = rank(0, 1, "pred")?;
                int(1, "drafts")?;
                let d = rank(1, 1, "drafts")?;
                want(*spec > 0, "spec must be at least 1".into())?;
                want(
                    wide(p[0]) % (wide(*spec) + 1) == 0,
                    format!(
                        "pred length {} must be a multiple of spec+1 = {}",
                        p[0],
                        wide(*spec) + 1
                    ),
                )?;
                let b = (wide(p[0]) / (wide(*spec) + 1)) as u32;
                want(
                    wide(d[0]) == wide(b) * wide(*spec),
                    format!("drafts length {} must be batch*spec = {}*{}", d[0], b, spec),
                )?;
                Ok(vec![tt(DType::I32, vec![b])])
            }
            Op::Sample => {
                float(0, "logits")?;
                let x = rank(0, 2, "logits")?;
                want(x[1] > 0, "rows must not be empty".into())?;
                for (i, what, dtype) in [(1, "params", DType::F32), (2, "seeds", DType::I32)] {
                    let d = rank(i, 2, what)?;
                    want(
                        args[i].dtype == dtype && d == [x[0], 4],
                        format!(
                            "{what} (argument {i}) must be {dtype}[{}, 4] (one row per logits row), got {}",
                            x[0], args[i]
                        ),
                    )?;
                }
                if args.len() == 4 {
                    let d = rank(3, 2, "penalties")?;
                    want(
                        args[3].dtype == DType::I32
                            && d[0] == x[0]
                            && d[1] >= 4
                            && d[1] % 2 == 0
                            && d[1] <= 2 + 2 * MAX_PENALTY_SLOTS,
                        format!(
                            "penalties (argument 3) must be i32[{}, 2 + 2P] with 1 <= P <= {MAX_PENALTY_SLOTS} (presence, frequency, then P (token, count) pairs), got {}",
                            x[0], args[3]
                        ),
                    )?;
                    want(
                        x[1] <= i32::MAX as u32,
                        format!(
                            "a vocabulary of {} does not fit the penalties' i32 tokens",
                            x[1]
                        ),
                    )?;
                }
                Ok(vec![tt(DType::I32, vec![x[0]])])
            }
            Op::FusedMatMul {
                bias,
                out,
                pre,
                post,
            } => {
                float(0, "x")?;
                let x = rank(0, 2, "x")?;
                float(1, "weight")?;
                let w = rank(1, 2, "weight")?;
                same_dtype(0, 1)?;
                want(
                    x[1] == w[1],
                    format!(
                        "x {} and weight {} disagree on the inner dimension ({} vs {})",
                        args[0], args[1], x[1], w[1]
                    ),
                )?;
                want(
                    out.is_float(),
                    format!("result dtype must be float, got {out}"),
                )?;
                let d = args[0].dtype;
                let mut i = 2;
                if *bias {
                    let b = rank(i, 1, "bias")?;
                    same_dtype(0, i)?;
                    want(
                        b[0] == w[0],
                        format!(
                            "bias length {} must equal the output features {}",
                            b[0], w[0]
                        ),
                    )?;
                    i += 1;
                }
                if pre.is_some() {
                    let nw = rank(i, 1, "norm weight")?;
                    same_dtype(0, i)?;
                    want(
                        nw[0] == x[1],
                        format!(
                            "norm weight length {} must equal the row length {}",
                            nw[0], x[1]
                        ),
                    )?;
                    i += 1;
                }
                want(
                    matches!(post, Epilogue::None | Epilogue::Argmax) || *out == d,
                    format!(
                        "with the `{}` epilogue the result dtype must be the activations' {d}, got {out}",
                        post.name()
                    ),
                )?;
                match post {
                    Epilogue::None => Ok(vec![tt(*out, vec![x[0], w[0]])]),
                    Epilogue::SiluMul | Epilogue::GeluTanhMul => {
                        want(
                            w[0] % 2 == 0,
                            format!("packed gate_up weight rows {} must be even", w[0]),
                        )?;
                        Ok(vec![tt(d, vec![x[0], w[0] / 2])])
                    }
                    Epilogue::Residual => {
                        let r = tt(d, vec![x[0], w[0]]);
                        want(
                            args[i] == r,
                            format!("residual {} must have the result type {r}", args[i]),
                        )?;
                        Ok(vec![r])
                    }
                    Epilogue::Argmax => {
                        want(w[0] > 0, "the argmax epilogue needs a non-empty row".into())?;
                        Ok(vec![tt(DType::I32, vec![x[0]])])
                    }
                }
            }
            Op::Scale { .. } => {
                float(0, "x")?;
                Ok(vec![args[0].clone()])
            }
            Op::AllReduce { ranks, out } => {
                float(0, "x")?;
                want(*ranks > 0, "ranks must be at least 1".into())?;
                want(
                    out.is_float(),
                    format!("result dtype must be float, got {out}"),
                )?;
                Ok(vec![tt(*out, args[0].shape.dims().to_vec())])
            }
            Op::AttentionPartials { attn, parts } => {
                // paged_attention's operands, in one place.
                let r = Op::PagedAttention(*attn).infer(args)?;
                let rows = r[0].shape.dims()[0];
                want(
                    (1..=MAX_ATTENTION_PARTS).contains(parts),
                    format!("parts {parts} must be in 1..={MAX_ATTENTION_PARTS}"),
                )?;
                let width = wide(attn.heads) * wide(*parts) * (wide(attn.head_dim) + 2);
                want(
                    width <= u32::MAX as u64,
                    format!("the partials row ({width} floats) must fit a u32"),
                )?;
                Ok(vec![tt(DType::F32, vec![rows, width as u32])])
            }
            Op::AttentionCombine {
                heads,
                head_dim,
                parts,
                out,
            } => {
                want(
                    args[0].dtype == DType::F32,
                    format!("partials must be f32, got {}", args[0].dtype),
                )?;
                let x = rank(0, 2, "partials")?;
                want(
                    (1..=MAX_ATTENTION_PARTS).contains(parts) && *heads > 0,
                    format!("heads {heads} must be positive and parts {parts} in 1..={MAX_ATTENTION_PARTS}"),
                )?;
                want(
                    out.is_float(),
                    format!("out must be a float dtype, got {out}"),
                )?;
                want(
                    wide(x[1]) == wide(*heads) * wide(*parts) * (wide(*head_dim) + 2),
                    format!(
                        "partials row {} must be heads*parts*(head_dim+2) = {heads}*{parts}*({head_dim}+2)",
                        x[1]
                    ),
                )?;
                let w = wide(*heads) * wide(*head_dim);
                want(
                    w <= u32::MAX as u64,
                    format!("heads*head_dim {w} must fit a u32"),
                )?;
                Ok(vec![tt(*out, vec![x[0], w as u32])])
            }
            Op::ShardedArgmax { ranks } => {
                float(0, "x")?;
                let x = rank(0, 2, "x")?;
                want(*ranks > 0, "ranks must be at least 1".into())?;
                want(x[1] > 0, "rows must not be empty".into())?;
                want(
                    wide(x[1]) * wide(*ranks) <= i32::MAX as u64,
                    format!(
                        "the full row ({} ranks * {}) must fit an i32 index",
                        ranks, x[1]
                    ),
                )?;
                Ok(vec![tt(DType::I32, vec![x[0]])])
            }
        }
    }
}
