//! Test support for the planner and pass tests: a reference interpreter of
//! the op set, written from the typing rules and op docs in `kiln_ir::op`
//! (independently of the passes and the planner), in two modes:
//!
//! * [`eval_graph`]: value semantics (every SSA value its own vector), the
//!   meaning of a graph;
//! * [`exec_plan`]: memory semantics: regions are byte arrays, every operand
//!   is read from and written to the address the plan gives it, in the
//!   plan's dtype. A plan that lets two live buffers share bytes computes
//!   different numbers than [`eval_graph`].
//!
//! Values are f32 in the interpreter and rounded to their dtype after every
//! op, as the CPU kernels round their results.

#![allow(dead_code, clippy::needless_range_loop, clippy::too_many_arguments)]

use half::{bf16, f16};
use kiln_ir::plan::{BufRef, KeyPlan, KvLayout, Region};
use kiln_ir::{
    AttnAttrs, DType, Graph, InputRole, Key, Op, TensorType, ValueDef, WeightManifest, WeightSource,
};
use std::collections::HashMap;

/// xorshift64*: deterministic, dependency-free randomness for tests.
pub struct Rng(u64);
impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

pub fn round(d: DType, x: f32) -> f32 {
    match d {
        DType::BF16 => bf16::from_f32(x).to_f32(),
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::F32 => x,
        DType::I32 => x,
    }
}

/// Random checkpoint tensors for every source a manifest names, by tensor key.
pub fn random_checkpoint(m: &WeightManifest, rng: &mut Rng) -> HashMap<String, Vec<f32>> {
    let mut out = HashMap::new();
    for e in &m.entries {
        for t in e.source.parts() {
            out.entry(t.tensor.clone()).or_insert_with(|| {
                // Norm weights near 1, projections small: keeps activations sane.
                let norm = t.shape.rank() == 1 && t.tensor.contains("norm");
                (0..t.shape.numel())
                    .map(|_| {
                        let x = if norm {
                            1.0 + 0.2 * rng.unit()
                        } else {
                            0.3 * rng.unit()
                        };
                        round(t.dtype, x)
                    })
                    .collect()
            });
        }
    }
    out
}

/// A manifest entry's contents, built from the checkpoint as the runtime's
/// binder would (concatenating rows for stacked entries).
pub fn materialize(m: &WeightManifest, name: &str, ck: &HashMap<String, Vec<f32>>) -> Vec<f32> {
    let e = m
        .get(name)
        .unwrap_or_else(|| panic!("weight {name} not in manifest"));
    let parts: Vec<&Vec<f32>> = e.source.parts().iter().map(|t| &ck[&t.tensor]).collect();
    let v: Vec<f32> = match &e.source {
        WeightSource::Tensor(_) => parts[0].clone(),
        WeightSource::ConcatRows(_) => parts.iter().flat_map(|p| p.iter().copied()).collect(),
        WeightSource::Sharded { .. } => panic!("{name}: the reference evaluator runs one rank"),
    };
    assert_eq!(v.len() as u64, e.shape.numel(), "{name}");
    v.into_iter().map(|x| round(e.dtype, x)).collect()
}

/// One step's inputs.
#[derive(Clone, Debug)]
pub struct StepInputs {
    pub staging: HashMap<InputRole, Vec<f32>>,
    /// Per layer: (k cache, v cache).
    pub caches: Vec<(Vec<f32>, Vec<f32>)>,
}

/// Random but consistent inputs: each sequence has a random context length,
/// a block table of distinct non-null blocks, slots derived from positions,
/// and caches full of random history.
pub fn random_inputs(
    key: Key,
    kv: &KvLayout,
    vocab: u32,
    max_context: u32,
    rng: &mut Rng,
) -> StepInputs {
    let (b, q) = (key.batch as usize, key.query as usize);
    let bs = kv.block_size as usize;
    let m = kv.max_blocks_per_seq as usize;
    let mut free: Vec<u32> = (1..kv.num_blocks).collect();
    let mut tables = vec![0f32; b * m];
    let mut lens = vec![0f32; b];
    let mut pos = vec![0f32; b * q];
    let mut slots = vec![0f32; b * q];
    for s in 0..b {
        let ctx = q as u32 + rng.below((max_context - q as u32 + 1) as u64) as u32;
        lens[s] = ctx as f32;
        let blocks = (ctx as usize).div_ceil(bs);
        assert!(blocks <= free.len(), "test KV cache too small");
        for j in 0..blocks {
            let k = rng.below(free.len() as u64) as usize;
            tables[s * m + j] = free.swap_remove(k) as f32;
        }
        for i in 0..q {
            let p = ctx as usize - q + i;
            pos[s * q + i] = p as f32;
            slots[s * q + i] = (tables[s * m + p / bs] as usize * bs + p % bs) as f32;
        }
    }
    let ids: Vec<f32> = (0..b * q).map(|_| rng.below(vocab as u64) as f32).collect();
    let mut staging = HashMap::new();
    staging.insert(InputRole::TokenIds, ids);
    staging.insert(InputRole::Positions, pos);
    staging.insert(InputRole::SlotMapping, slots);
    staging.insert(InputRole::BlockTables, tables);
    staging.insert(InputRole::ContextLens, lens);
    if key.spec > 0 {
        let d: Vec<f32> = (0..b * key.spec as usize)
            .map(|_| rng.below(vocab as u64) as f32)
            .collect();
        staging.insert(InputRole::DraftTokens, d);
    }
    let n = kv.slots() as usize * (kv.kv_heads * kv.head_dim) as usize;
    let caches = (0..kv.layers)
        .map(|_| {
            let mut f = || {
                (0..n)
                    .map(|_| round(kv.dtype, rng.unit()))
                    .collect::<Vec<f32>>()
            };
            (f(), f())
        })
        .collect();
    StepInputs { staging, caches }
}

fn dims(t: &TensorType) -> Vec<usize> {
    t.shape.dims().iter().map(|&d| d as usize).collect()
}

fn rms(x: &[f32], w: &[f32], eps: f32, unit: bool) -> Vec<f32> {
    let ms = x.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, w)| (*v as f64 * inv) as f32 * if unit { 1.0 + w } else { *w })
        .collect()
}

fn rope_rows(
    x: &mut [f32],
    rows: usize,
    heads: usize,
    hd: usize,
    pos: &[f32],
    inv: &[f64],
    d: DType,
) {
    let half = hd / 2;
    for t in 0..rows {
        for h in 0..heads {
            let base = t * heads * hd + h * hd;
            for i in 0..half {
                let a = pos[t] as f64 * inv[i];
                let (s, c) = (a.sin() as f32, a.cos() as f32);
                let (x1, x2) = (x[base + i], x[base + i + half]);
                x[base + i] = round(d, x1 * c - x2 * s);
                x[base + i + half] = round(d, x2 * c + x1 * s);
            }
        }
    }
}

fn head_norm(
    x: &mut [f32],
    rows: usize,
    heads: usize,
    hd: usize,
    w: &[f32],
    eps: f32,
    unit: bool,
    d: DType,
) {
    for t in 0..rows {
        for h in 0..heads {
            let base = t * heads * hd + h * hd;
            let y = rms(&x[base..base + hd], w, eps, unit);
            for (i, v) in y.into_iter().enumerate() {
                x[base + i] = round(d, v);
            }
        }
    }
}

fn write_rows(cache: &mut [f32], rows: &[f32], width: usize, slots: &[f32]) {
    for (t, s) in slots.iter().enumerate() {
        let s = *s as usize;
        cache[s * width..(s + 1) * width].copy_from_slice(&rows[t * width..(t + 1) * width]);
    }
}

/// Applies `op` to `args` (with their types), returning the results in the
/// result types' precision.
pub fn apply(
    op: &Op,
    args: &[Vec<f32>],
    tys: &[TensorType],
    res_tys: &[TensorType],
) -> Vec<Vec<f32>> {
    let d = res_tys.first().map(|t| t.dtype).unwrap_or(DType::F32);
    let rnd =
        |v: Vec<f32>, t: &TensorType| v.into_iter().map(|x| round(t.dtype, x)).collect::<Vec<_>>();
    match op {
        Op::AllReduce { ranks: 1, .. } => vec![rnd(args[0].clone(), &res_tys[0])],
        Op::AllReduce { .. } | Op::ShardedArgmax { .. } => {
            panic!("the reference evaluator runs one rank")
        }
        // Formed only for megakernel keys, after the passes these tests
        // evaluate; runtime/tests/tape_cpu.rs checks them.
        Op::AttentionPartials { .. } | Op::AttentionCombine { .. } => {
            panic!("the reference evaluator does not run the megakernel's split attention")
        }
        Op::Embedding => {
            let h = dims(&tys[1])[1];
            let mut out = Vec::new();
            for id in &args[0] {
                let r = *id as usize;
                out.extend_from_slice(&args[1][r * h..(r + 1) * h]);
            }
            vec![out]
        }
        Op::RmsNorm { eps, unit_offset } => {
            let h = dims(&tys[0])[1];
            let out: Vec<f32> = args[0]
                .chunks(h)
                .flat_map(|row| rms(row, &args[1], *eps, *unit_offset))
                .collect();
            vec![rnd(out, &res_tys[0])]
        }
        Op::AddRmsNorm { eps, unit_offset } => {
            let h = dims(&tys[0])[1];
            let sum: Vec<f32> = args[0]
                .iter()
                .zip(&args[1])
                .map(|(a, b)| round(d, a + b))
                .collect();
            let normed: Vec<f32> = sum
                .chunks(h)
                .flat_map(|row| rms(row, &args[2], *eps, *unit_offset))
                .collect();
            vec![rnd(normed, &res_tys[0]), sum]
        }
        Op::MatMul { bias, .. } => {
            let (t, k) = (dims(&tys[0])[0], dims(&tys[0])[1]);
            let n = dims(&tys[1])[0];
            let mut out = vec![0f32; t * n];
            for r in 0..t {
                for c in 0..n {
                    let mut acc = 0f64;
                    for i in 0..k {
                        acc += args[0][r * k + i] as f64 * args[1][c * k + i] as f64;
                    }
                    if *bias {
                        acc += args[2][c] as f64;
                    }
                    out[r * n + c] = acc as f32;
                }
            }
            vec![rnd(out, &res_tys[0])]
        }
        Op::HeadRmsNorm {
            heads,
            head_dim,
            eps,
            unit_offset,
        } => {
            let mut x = args[0].clone();
            let rows = dims(&tys[0])[0];
            head_norm(
                &mut x,
                rows,
                *heads as usize,
                *head_dim as usize,
                &args[1],
                *eps,
                *unit_offset,
                d,
            );
            vec![x]
        }
        Op::Rope {
            heads,
            head_dim,
            rope,
        } => {
            let mut x = args[0].clone();
            let rows = dims(&tys[0])[0];
            let inv = rope.inv_freq(*head_dim);
            rope_rows(
                &mut x,
                rows,
                *heads as usize,
                *head_dim as usize,
                &args[1],
                &inv,
                d,
            );
            vec![x]
        }
        Op::KvWrite => {
            let w = dims(&tys[0])[1];
            let (mut kc, mut vc) = (args[3].clone(), args[4].clone());
            write_rows(&mut kc, &args[0], w, &args[2]);
            write_rows(&mut vc, &args[1], w, &args[2]);
            vec![kc, vc]
        }
        Op::MatMulQkvRope { .. } => {
            // Its definition: the projection, then the rope + KV write.
            let (mm, r) = op
                .split_matmul_qkv_rope(tys[0].dtype)
                .expect("matmul_qkv_rope");
            let m = 2
                + usize::from(matches!(op, Op::MatMulQkvRope { bias: true, .. }))
                + usize::from(matches!(op, Op::MatMulQkvRope { pre: Some(_), .. }));
            let qkv_ty = mm.infer(&tys[..m]).expect("typed")[0].clone();
            let qkv = apply(&mm, &args[..m], &tys[..m], std::slice::from_ref(&qkv_ty));
            let mut rargs = vec![qkv[0].clone()];
            rargs.extend_from_slice(&args[m..]);
            let mut rtys = vec![qkv_ty];
            rtys.extend_from_slice(&tys[m..]);
            apply(&r, &rargs, &rtys, res_tys)
        }
        Op::RopeAttention { .. } => {
            // Its definition: the rope + KV write, then the attention.
            let (r, a) = op.split_rope_attention().expect("rope_attention");
            let mut rargs = args[..5].to_vec();
            rargs.extend_from_slice(&args[7..]);
            let mut rtys = tys[..5].to_vec();
            rtys.extend_from_slice(&tys[7..]);
            let q_ty = res_tys[0].clone();
            let rres = [q_ty.clone(), res_tys[1].clone(), res_tys[2].clone()];
            let ro = apply(&r, &rargs, &rtys, &rres);
            let aargs = [
                ro[0].clone(),
                ro[1].clone(),
                ro[2].clone(),
                args[5].clone(),
                args[6].clone(),
            ];
            let atys = [
                q_ty,
                tys[3].clone(),
                tys[4].clone(),
                tys[5].clone(),
                tys[6].clone(),
            ];
            let ao = apply(&a, &aargs, &atys, &res_tys[..1]);
            vec![ao[0].clone(), ro[1].clone(), ro[2].clone()]
        }
        Op::QkvRopeKvWrite {
            heads,
            kv_heads,
            head_dim,
            rope,
            qk_norm,
            unit_offset,
        } => {
            let (h, kvh, hd) = (*heads as usize, *kv_heads as usize, *head_dim as usize);
            let rows = dims(&tys[0])[0];
            let width = (h + 2 * kvh) * hd;
            let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
            for r in 0..rows {
                let row = &args[0][r * width..(r + 1) * width];
                q.extend_from_slice(&row[..h * hd]);
                k.extend_from_slice(&row[h * hd..(h + kvh) * hd]);
                v.extend_from_slice(&row[(h + kvh) * hd..]);
            }
            if let Some(eps) = qk_norm {
                head_norm(&mut q, rows, h, hd, &args[5], *eps, *unit_offset, d);
                head_norm(&mut k, rows, kvh, hd, &args[6], *eps, *unit_offset, d);
            }
            let inv = rope.inv_freq(*head_dim);
            rope_rows(&mut q, rows, h, hd, &args[1], &inv, d);
            rope_rows(&mut k, rows, kvh, hd, &args[1], &inv, d);
            let (mut kc, mut vc) = (args[3].clone(), args[4].clone());
            write_rows(&mut kc, &k, kvh * hd, &args[2]);
            write_rows(&mut vc, &v, kvh * hd, &args[2]);
            vec![q, kc, vc]
        }
        Op::PagedAttention(AttnAttrs {
            heads,
            kv_heads,
            head_dim,
            query,
            block_size,
            scale,
            window,
            softcap,
        }) => {
            let (h, kvh, hd, q, bs) = (
                *heads as usize,
                *kv_heads as usize,
                *head_dim as usize,
                *query as usize,
                *block_size as usize,
            );
            let b = dims(&tys[3])[0];
            let m = dims(&tys[3])[1];
            let mut out = vec![0f32; b * q * h * hd];
            for s in 0..b {
                let ctx = args[4][s] as usize;
                for i in 0..q {
                    let p_self = ctx - q + i;
                    let lo = window.map_or(0, |w| (p_self + 1).saturating_sub(w as usize));
                    let row = s * q + i;
                    for head in 0..h {
                        let kh = head / (h / kvh);
                        let qv = &args[0][row * h * hd + head * hd..][..hd];
                        let mut scores = Vec::new();
                        for p in lo..=p_self {
                            let slot = args[3][s * m + p / bs] as usize * bs + p % bs;
                            let kr = &args[1][slot * kvh * hd + kh * hd..][..hd];
                            let mut dot = 0f64;
                            for j in 0..hd {
                                dot += qv[j] as f64 * kr[j] as f64;
                            }
                            let mut sc = dot * *scale as f64;
                            if let Some(c) = softcap {
                                sc = *c as f64 * (sc / *c as f64).tanh();
                            }
                            scores.push((slot, sc));
                        }
                        let mx = scores.iter().map(|x| x.1).fold(f64::MIN, f64::max);
                        let z: f64 = scores.iter().map(|x| (x.1 - mx).exp()).sum();
                        for j in 0..hd {
                            let mut acc = 0f64;
                            for (slot, sc) in &scores {
                                acc += (sc - mx).exp() / z
                                    * args[2][slot * kvh * hd + kh * hd + j] as f64;
                            }
                            out[row * h * hd + head * hd + j] = acc as f32;
                        }
                    }
                }
            }
            vec![rnd(out, &res_tys[0])]
        }
        Op::SiluMul | Op::GeluTanhMul => {
            let act = |g: f32| -> f32 {
                let g = g as f64;
                (match op {
                    Op::SiluMul => g / (1.0 + (-g).exp()),
                    _ => {
                        0.5 * g
                            * (1.0
                                + ((2.0 / std::f64::consts::PI).sqrt()
                                    * (g + 0.044715 * g * g * g))
                                    .tanh())
                    }
                }) as f32
            };
            let out: Vec<f32> = if args.len() == 2 {
                args[0]
                    .iter()
                    .zip(&args[1])
                    .map(|(g, u)| act(*g) * u)
                    .collect()
            } else {
                let w = dims(&tys[0])[1];
                args[0]
                    .chunks(w)
                    .flat_map(|row| {
                        let (g, u) = row.split_at(w / 2);
                        g.iter()
                            .zip(u)
                            .map(|(g, u)| act(*g) * u)
                            .collect::<Vec<_>>()
                    })
                    .collect()
            };
            vec![rnd(out, &res_tys[0])]
        }
        Op::Add => vec![rnd(
            args[0].iter().zip(&args[1]).map(|(a, b)| a + b).collect(),
            &res_tys[0],
        )],
        Op::GatherLast { group } => {
            let w = dims(&tys[0])[1];
            let g = *group as usize;
            let rows = dims(&tys[0])[0] / g;
            vec![(0..rows)
                .flat_map(|r| args[0][((r + 1) * g - 1) * w..][..w].to_vec())
                .collect()]
        }
        Op::Argmax => {
            let w = dims(&tys[0])[1];
            vec![args[0]
                .chunks(w)
                .map(|row| {
                    let mut best = 0;
                    for (i, v) in row.iter().enumerate() {
                        if *v > row[best] {
                            best = i;
                        }
                    }
                    best as f32
                })
                .collect()]
        }
        Op::Sample => {
            // Integer operands travel as f32 here: exact for the small
            // seeds and counters these graphs stage.
            let w = dims(&tys[0])[1];
            vec![args[0]
                .chunks(w)
                .enumerate()
                .map(|(r, row)| {
                    let p = &args[1][r * 4..r * 4 + 4];
                    let s = &args[2][r * 4..r * 4 + 4];
                    kiln_kernels::cpu::sample::sample_row(
                        row,
                        [p[0], p[1], p[2], p[3]],
                        [s[0] as i32, s[1] as i32, s[2] as i32, s[3] as i32],
                    ) as f32
                })
                .collect()]
        }
        Op::AcceptGreedy { spec } => {
            let s = *spec as usize;
            let b = args[1].len() / s;
            vec![(0..b)
                .map(|r| {
                    let mut n = 0;
                    while n < s && args[1][r * s + n] == args[0][r * (s + 1) + n] {
                        n += 1;
                    }
                    n as f32
                })
                .collect()]
        }
        Op::FusedMatMul {
            bias,
            out,
            pre,
            post,
        } => {
            // By definition the unfused sequence, each step rounded to D.
            let d = tys[0].dtype;
            let mut rest = (2..args.len()).map(|i| (&args[i], &tys[i]));
            let b = if *bias { rest.next() } else { None };
            let nw = if pre.is_some() { rest.next() } else { None };
            let residual = rest.next();
            let x = match (pre, nw) {
                (Some(p), Some((w, wt))) => {
                    let op = Op::RmsNorm {
                        eps: p.eps,
                        unit_offset: p.unit_offset,
                    };
                    let xt = [tys[0].clone(), wt.clone()];
                    apply(&op, &[args[0].clone(), w.clone()], &xt, &xt[..1]).remove(0)
                }
                _ => args[0].clone(),
            };
            let y_d = if matches!(post, kiln_ir::Epilogue::None | kiln_ir::Epilogue::Argmax) {
                *out
            } else {
                d
            };
            let y_ty = TensorType::new(y_d, vec![tys[0].shape.dims()[0], tys[1].shape.dims()[0]]);
            let mut mm_args = vec![x, args[1].clone()];
            let mut mm_tys = vec![tys[0].clone(), tys[1].clone()];
            if let Some((bv, bt)) = b {
                mm_args.push(bv.clone());
                mm_tys.push(bt.clone());
            }
            let mm = Op::MatMul {
                bias: *bias,
                out: y_d,
            };
            let y = apply(&mm, &mm_args, &mm_tys, std::slice::from_ref(&y_ty)).remove(0);
            let yt = [y_ty];
            match (post, residual) {
                (kiln_ir::Epilogue::SiluMul, _) => apply(&Op::SiluMul, &[y], &yt, res_tys),
                (kiln_ir::Epilogue::GeluTanhMul, _) => apply(&Op::GeluTanhMul, &[y], &yt, res_tys),
                (kiln_ir::Epilogue::Argmax, _) => apply(&Op::Argmax, &[y], &yt, res_tys),
                (kiln_ir::Epilogue::Residual, Some((r, rt))) => apply(
                    &Op::Add,
                    &[y, r.clone()],
                    &[yt[0].clone(), rt.clone()],
                    res_tys,
                ),
                _ => vec![y],
            }
        }
        Op::Scale { factor, softcap } => vec![rnd(
            args[0]
                .iter()
                .map(|&x| {
                    let y = x as f64 * *factor as f64;
                    softcap.map_or(y, |c| c as f64 * (y / c as f64).tanh()) as f32
                })
                .collect(),
            &res_tys[0],
        )],
    }
}

/// Outputs by name and the caches after the step.
#[derive(Clone, Debug)]
pub struct StepResult {
    pub outputs: Vec<(String, Vec<f32>)>,
    pub caches: Vec<(Vec<f32>, Vec<f32>)>,
}

/// Bit-for-bit equality, except that every NaN equals every NaN: random
/// chains of matmuls can overflow, and an overflowed value must still match
/// (the same NaN at the same place) rather than make the comparison
/// vacuously false.
fn same_floats(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

impl PartialEq for StepResult {
    fn eq(&self, other: &Self) -> bool {
        self.outputs.len() == other.outputs.len()
            && self
                .outputs
                .iter()
                .zip(&other.outputs)
                .all(|((n, a), (m, b))| n == m && same_floats(a, b))
            && self.caches.len() == other.caches.len()
            && self
                .caches
                .iter()
                .zip(&other.caches)
                .all(|((k, v), (k2, v2))| same_floats(k, k2) && same_floats(v, v2))
    }
}

/// Value semantics of a graph.
pub fn eval_graph(
    g: &Graph,
    m: &WeightManifest,
    ck: &HashMap<String, Vec<f32>>,
    inp: &StepInputs,
) -> StepResult {
    let mut vals: Vec<Option<Vec<f32>>> = vec![None; g.values.len()];
    // Which cache each value is a state of, and each cache's latest state.
    let mut state_of: HashMap<usize, InputRole> = HashMap::new();
    let mut latest: HashMap<InputRole, usize> = HashMap::new();
    for &v in &g.inputs {
        let ValueDef::Input(role) = g.value(v).def else {
            unreachable!()
        };
        vals[v.index()] = Some(match role {
            InputRole::KCache(l) => inp.caches[l as usize].0.clone(),
            InputRole::VCache(l) => inp.caches[l as usize].1.clone(),
            r => inp.staging[&r].clone(),
        });
        if !role.is_staging() {
            state_of.insert(v.index(), role);
            latest.insert(role, v.index());
        }
    }
    for &w in &g.weights {
        let ValueDef::Weight(n) = &g.value(w).def else {
            unreachable!()
        };
        vals[w.index()] = Some(materialize(m, n, ck));
    }
    for node in &g.nodes {
        let args: Vec<Vec<f32>> = node
            .args
            .iter()
            .map(|a| vals[a.index()].clone().expect("defined"))
            .collect();
        let tys: Vec<TensorType> = node.args.iter().map(|a| g.ty(*a).clone()).collect();
        let rt: Vec<TensorType> = node.results.iter().map(|r| g.ty(*r).clone()).collect();
        let out = apply(&node.op, &args, &tys, &rt);
        for &(r, a) in node.op.aliases() {
            if let Some(&role) = state_of.get(&node.args[a].index()) {
                state_of.insert(node.results[r].index(), role);
                latest.insert(role, node.results[r].index());
            }
        }
        for (r, v) in node.results.iter().zip(out) {
            vals[r.index()] = Some(v);
        }
    }
    let mut caches = inp.caches.clone();
    for (role, v) in latest {
        let data = vals[v].clone().unwrap();
        match role {
            InputRole::KCache(l) => caches[l as usize].0 = data,
            InputRole::VCache(l) => caches[l as usize].1 = data,
            _ => unreachable!(),
        }
    }
    StepResult {
        outputs: g
            .outputs
            .iter()
            .map(|(n, v)| (n.clone(), vals[v.index()].clone().unwrap()))
            .collect(),
        caches,
    }
}

fn encode(d: DType, v: &[f32], out: &mut [u8]) {
    match d {
        DType::BF16 => v.iter().enumerate().for_each(|(i, x)| {
            out[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(*x).to_le_bytes())
        }),
        DType::F16 => v.iter().enumerate().for_each(|(i, x)| {
            out[2 * i..2 * i + 2].copy_from_slice(&f16::from_f32(*x).to_le_bytes())
        }),
        DType::F32 => v
            .iter()
            .enumerate()
            .for_each(|(i, x)| out[4 * i..4 * i + 4].copy_from_slice(&x.to_le_bytes())),
        DType::I32 => v
            .iter()
            .enumerate()
            .for_each(|(i, x)| out[4 * i..4 * i + 4].copy_from_slice(&(*x as i32).to_le_bytes())),
    }
}

fn decode(d: DType, b: &[u8], n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| match d {
            DType::BF16 => bf16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32(),
            DType::F16 => f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32(),
            DType::F32 => f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()),
            DType::I32 => i32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()) as f32,
        })
        .collect()
}

/// Memory semantics of a key plan: every operand at its planned address.
/// The arena starts filled with garbage, as a reused arena would be.
pub fn exec_plan(
    kp: &KeyPlan,
    m: &WeightManifest,
    kv: &KvLayout,
    arena_bytes: u64,
    ck: &HashMap<String, Vec<f32>>,
    inp: &StepInputs,
) -> StepResult {
    let mut regions: HashMap<Region, Vec<u8>> = HashMap::new();
    regions.insert(
        Region::Arena,
        (0..arena_bytes).map(|i| (i * 131 % 251) as u8).collect(),
    );
    regions.insert(Region::Io, vec![0xA5; kp.io_bytes as usize]);
    for (i, e) in m.entries.iter().enumerate() {
        let mut b = vec![0u8; (e.shape.numel() * e.dtype.size() as u64) as usize];
        encode(e.dtype, &materialize(m, &e.name, ck), &mut b);
        regions.insert(Region::Weight(i as u32), b);
    }
    for l in 0..kv.layers {
        for (region, data) in [
            (Region::KCache(l), &inp.caches[l as usize].0),
            (Region::VCache(l), &inp.caches[l as usize].1),
        ] {
            let mut b = vec![0u8; kv.cache_bytes() as usize];
            encode(kv.dtype, data, &mut b);
            regions.insert(region, b);
        }
    }
    let write =
        |regions: &mut HashMap<Region, Vec<u8>>, buf: &BufRef, ty: &TensorType, v: &[f32]| {
            let r = regions.get_mut(&buf.region).expect("region");
            let end = (buf.offset + ty.size_bytes()) as usize;
            encode(ty.dtype, v, &mut r[buf.offset as usize..end]);
        };
    let read = |regions: &HashMap<Region, Vec<u8>>, buf: &BufRef, ty: &TensorType| {
        let r = &regions[&buf.region];
        decode(
            ty.dtype,
            &r[buf.offset as usize..(buf.offset + ty.size_bytes()) as usize],
            ty.numel() as usize,
        )
    };
    for (role, b) in &kp.inputs {
        let v = kp
            .graph
            .inputs
            .iter()
            .find(|&&v| kp.graph.value(v).def == ValueDef::Input(*role))
            .unwrap();
        write(&mut regions, b, kp.graph.ty(*v), &inp.staging[role]);
    }
    for op in &kp.ops {
        let args: Vec<Vec<f32>> = op
            .args
            .iter()
            .map(|a| read(&regions, &a.buf, &a.ty))
            .collect();
        let tys: Vec<TensorType> = op.args.iter().map(|a| a.ty.clone()).collect();
        let rt: Vec<TensorType> = op.results.iter().map(|r| r.ty.clone()).collect();
        let out = apply(&op.op, &args, &tys, &rt);
        for (r, v) in op.results.iter().zip(out) {
            write(&mut regions, &r.buf, &r.ty, &v);
        }
    }
    StepResult {
        outputs: kp
            .outputs
            .iter()
            .map(|(n, o)| (n.clone(), read(&regions, &o.buf, &o.ty)))
            .collect(),
        caches: (0..kv.layers)
            .map(|l| {
                let n = (kv.slots() * (kv.kv_heads * kv.head_dim) as u64) as usize;
                let k = decode(kv.dtype, &regions[&Region::KCache(l)], n);
                let v = decode(kv.dtype, &regions[&Region::VCache(l)], n);
                (k, v)
            })
            .collect(),
    }
}

use kiln_compiler::compile::{compile_traced, CompileOptions, Compiled};
use kiln_compiler::passes::synth::SynthSpec;
use kiln_ir::plan::{ModelInfo, ModelMeta, Target};

/// Model metadata for a synthetic spec (model context limit 64).
pub fn synth_meta(spec: &SynthSpec) -> ModelMeta {
    ModelMeta {
        architecture: format!("Synthetic{:?}", spec.family),
        files: vec![],
        compiler_version: env!("CARGO_PKG_VERSION").into(),
        target: Target::Cpu,
        info: ModelInfo {
            vocab_size: spec.vocab,
            hidden_size: spec.hidden,
            num_layers: spec.layers,
            num_heads: spec.heads,
            num_kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
            max_context: 64,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            dtype: spec.dtype,
        },
    }
}

/// Compiles a synthetic model with `opts`.
pub fn compile_synth(spec: &SynthSpec, opts: &CompileOptions) -> Compiled {
    compile_traced(
        synth_meta(spec),
        spec.manifest(),
        opts,
        |k, kv| Ok::<_, String>(spec.graph(k, kv, opts.logits)),
        &mut |_, _| {},
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

pub fn keys(s: &str) -> Vec<Key> {
    s.split(',').map(|k| k.parse().unwrap()).collect()
}

/// The default pipeline with `fuse` in place of `fuse-matmul` (the GPU
/// schedules' rules: `fuse-matmul-graph`, `fuse-matmul-quant`, ...).
pub fn default_pipeline_with(
    fuse: kiln_compiler::passes::Pass,
) -> Vec<kiln_compiler::passes::Pass> {
    use kiln_compiler::passes::{Pass, DEFAULT_PIPELINE};
    DEFAULT_PIPELINE
        .iter()
        .map(|&p| if p == Pass::FuseMatMul { fuse } else { p })
        .collect()
}
