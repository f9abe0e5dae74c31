//! Shared helpers of the CUDA tests: host tensors, a deterministic RNG, an
//! independent host reference of every op (written from `ir/src/op.rs`), and
//! device plumbing (upload, poison, run, download).
#![allow(dead_code)]

use half::{bf16, f16};
use kiln_ir::{AttnAttrs, DType, Epilogue, Op, TensorType};
use kiln_runtime::backend::{Backend, DevOperand, Launch};
use kiln_runtime::cuda::CudaBackend;

pub mod synth;

#[path = "../gpu_bodies/mod.rs"]
pub mod gpu_bodies;

/// xorshift64*: deterministic, seeded per test.
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
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn below(&mut self, n: u32) -> u32 {
        (self.next_u64() % n as u64) as u32
    }
}

/// Rounds `x` to `d` and back (what a stored value of dtype `d` holds).
pub fn rnd(d: DType, x: f32) -> f32 {
    match d {
        DType::BF16 => bf16::from_f32(x).to_f32(),
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::F32 => x,
        DType::I32 => x.round(),
    }
}

/// A host tensor: float values (already representable in the dtype) or ints.
#[derive(Clone, Debug)]
pub struct HT {
    pub ty: TensorType,
    pub f: Vec<f32>,
    pub i: Vec<i32>,
}

impl HT {
    pub fn floats(d: DType, shape: &[u32], v: Vec<f32>) -> HT {
        let ty = TensorType::new(d, shape.to_vec());
        assert_eq!(v.len() as u64, ty.numel());
        HT {
            ty,
            f: v.into_iter().map(|x| rnd(d, x)).collect(),
            i: vec![],
        }
    }
    pub fn ints(shape: &[u32], v: Vec<i32>) -> HT {
        let ty = TensorType::new(DType::I32, shape.to_vec());
        assert_eq!(v.len() as u64, ty.numel());
        HT {
            ty,
            f: vec![],
            i: v,
        }
    }
    pub fn random(rng: &mut Rng, d: DType, shape: &[u32], scale: f32) -> HT {
        let n: u64 = shape.iter().map(|&x| x as u64).product();
        HT::floats(d, shape, (0..n).map(|_| rng.uniform() * scale).collect())
    }
    pub fn bytes(&self) -> Vec<u8> {
        match self.ty.dtype {
            DType::BF16 => self
                .f
                .iter()
                .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                .collect(),
            DType::F16 => self
                .f
                .iter()
                .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                .collect(),
            DType::F32 => self.f.iter().flat_map(|x| x.to_le_bytes()).collect(),
            DType::I32 => self.i.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    pub fn from_bytes(ty: &TensorType, b: &[u8]) -> HT {
        let (f, i) = match ty.dtype {
            DType::BF16 => (
                b.chunks(2)
                    .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                vec![],
            ),
            DType::F16 => (
                b.chunks(2)
                    .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                vec![],
            ),
            DType::F32 => (
                b.chunks(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                vec![],
            ),
            DType::I32 => (
                vec![],
                b.chunks(4)
                    .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
            ),
        };
        HT {
            ty: ty.clone(),
            f,
            i,
        }
    }
}

/// Relative L2 error ‖got − want‖ / ‖want‖ (NaN anywhere gives infinity).
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        num += (g as f64 - w as f64).powi(2);
        den += (w as f64).powi(2);
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// The tolerance of a result stored in `d` after f32 math.
pub fn tol(d: DType) -> f64 {
    match d {
        DType::BF16 => 1e-2,
        DType::F16 => 2e-3,
        _ => 1e-4,
    }
}

/// Asserts `got` matches `want` (exactly for ints, within the dtype's
/// tolerance for floats) and that no poisoned element survived.
pub fn assert_close(what: &str, got: &HT, want: &HT) {
    assert_eq!(got.ty, want.ty, "{what}: type");
    if got.ty.dtype == DType::I32 {
        assert_eq!(got.i, want.i, "{what}: ints differ");
        return;
    }
    let nan = got.f.iter().filter(|x| x.is_nan()).count();
    assert_eq!(nan, 0, "{what}: {nan} element(s) still poisoned or NaN");
    let e = rel_err(&got.f, &want.f);
    assert!(
        e <= tol(got.ty.dtype),
        "{what}: relative error {e:.3e} exceeds {:.0e}",
        tol(got.ty.dtype)
    );
}

// ---------------------------------------------------------------- reference

fn norm_w(w: f32, unit: bool) -> f32 {
    if unit {
        1.0 + w
    } else {
        w
    }
}

fn rms_row(x: &[f32], w: &[f32], eps: f32, unit: bool, d: DType) -> Vec<f32> {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let inv = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(&v, &wv)| rnd(d, v * inv * norm_w(wv, unit)))
        .collect()
}

fn rope_pair(x1: f32, x2: f32, pos: i32, f: f32) -> (f32, f32) {
    let a = pos as f32 * f;
    let (s, c) = (a.sin(), a.cos());
    (x1 * c - x2 * s, x2 * c + x1 * s)
}

fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}
fn gelu_tanh(g: f32) -> f32 {
    0.5 * g * (1.0 + (0.797_884_6 * (g + 0.044715 * g * g * g)).tanh())
}

/// The host reference of `op`: results for `args` (the caches of in-place
/// ops are taken from the arguments and updated).
pub fn reference(op: &Op, args: &[HT], result_tys: &[TensorType]) -> Vec<HT> {
    let d = args[0].ty.dtype;
    let dims = |t: &HT| t.ty.shape.dims().to_vec();
    match op {
        Op::AllReduce { .. } | Op::ShardedArgmax { .. } => {
            panic!("collectives need several ranks; runtime/tests/cuda_tp.rs tests them")
        }
        Op::AttentionPartials { .. } | Op::AttentionCombine { .. } => {
            panic!("only a megakernel tape runs these; kernels/tests/megakernel_gpu.rs tests them")
        }
        Op::Embedding => {
            let tab = &args[1];
            let (v, h) = (dims(tab)[0] as i32, dims(tab)[1] as usize);
            let mut out = Vec::new();
            for &id in &args[0].i {
                if id < 0 || id >= v {
                    out.extend(std::iter::repeat_n(0.0, h));
                } else {
                    out.extend_from_slice(&tab.f[id as usize * h..(id as usize + 1) * h]);
                }
            }
            vec![HT::floats(
                tab.ty.dtype,
                &[args[0].i.len() as u32, h as u32],
                out,
            )]
        }
        Op::RmsNorm { eps, unit_offset } => {
            let h = dims(&args[0])[1] as usize;
            let out: Vec<f32> = args[0]
                .f
                .chunks(h)
                .flat_map(|r| rms_row(r, &args[1].f, *eps, *unit_offset, d))
                .collect();
            vec![HT::floats(d, &dims(&args[0]), out)]
        }
        Op::AddRmsNorm { eps, unit_offset } => {
            let h = dims(&args[0])[1] as usize;
            let sum: Vec<f32> = args[0]
                .f
                .iter()
                .zip(&args[1].f)
                .map(|(a, b)| rnd(d, a + b))
                .collect();
            let normed: Vec<f32> = sum
                .chunks(h)
                .flat_map(|r| rms_row(r, &args[2].f, *eps, *unit_offset, d))
                .collect();
            vec![
                HT::floats(d, &dims(&args[0]), normed),
                HT::floats(d, &dims(&args[0]), sum),
            ]
        }
        Op::HeadRmsNorm {
            head_dim,
            eps,
            unit_offset,
            ..
        } => {
            let out: Vec<f32> = args[0]
                .f
                .chunks(*head_dim as usize)
                .flat_map(|r| rms_row(r, &args[1].f, *eps, *unit_offset, d))
                .collect();
            vec![HT::floats(d, &dims(&args[0]), out)]
        }
        Op::Rope {
            heads,
            head_dim,
            rope,
        } => {
            let f: Vec<f32> = rope.inv_freq(*head_dim).iter().map(|&x| x as f32).collect();
            let hd = *head_dim as usize;
            let half = hd / 2;
            let mut out = args[0].f.clone();
            for (t, &p) in args[1].i.iter().enumerate() {
                for h in 0..*heads as usize {
                    let base = (t * *heads as usize + h) * hd;
                    for i in 0..half {
                        let (a, b) =
                            rope_pair(args[0].f[base + i], args[0].f[base + i + half], p, f[i]);
                        out[base + i] = rnd(d, a);
                        out[base + i + half] = rnd(d, b);
                    }
                }
            }
            vec![HT::floats(d, &dims(&args[0]), out)]
        }
        Op::KvWrite => {
            let row = dims(&args[0])[1] as usize;
            let (mut kc, mut vc) = (args[3].clone(), args[4].clone());
            for (t, &s) in args[2].i.iter().enumerate() {
                let s = s as usize;
                kc.f[s * row..(s + 1) * row].copy_from_slice(&args[0].f[t * row..(t + 1) * row]);
                vc.f[s * row..(s + 1) * row].copy_from_slice(&args[1].f[t * row..(t + 1) * row]);
            }
            vec![kc, vc]
        }
        Op::MatMulQkvRope { bias, pre, .. } => {
            // Its definition: the projection, then the rope + KV write.
            let (mm, r) = op.split_matmul_qkv_rope(d).expect("matmul_qkv_rope");
            let m = 2 + *bias as usize + pre.is_some() as usize;
            let tys: Vec<TensorType> = args[..m].iter().map(|a| a.ty.clone()).collect();
            let qkv_ty = mm.infer(&tys).expect("typed");
            let qkv = reference(&mm, &args[..m], &qkv_ty);
            let mut rargs = qkv;
            rargs.extend_from_slice(&args[m..]);
            reference(&r, &rargs, &[])
        }
        Op::RopeAttention { .. } => {
            // Its definition: the rope + KV write, then the attention.
            let (r, a) = op.split_rope_attention().expect("rope_attention");
            let mut rargs = args[..5].to_vec();
            rargs.extend_from_slice(&args[7..]);
            let ro = reference(&r, &rargs, &[]);
            let aargs = [
                ro[0].clone(),
                ro[1].clone(),
                ro[2].clone(),
                args[5].clone(),
                args[6].clone(),
            ];
            let ao = reference(&a, &aargs, &[]);
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
            let half = hd / 2;
            let f: Vec<f32> = rope.inv_freq(*head_dim).iter().map(|&x| x as f32).collect();
            let units = h + 2 * kvh;
            let t_n = dims(&args[0])[0] as usize;
            let mut q = vec![0.0f32; t_n * h * hd];
            let (mut kc, mut vc) = (args[3].clone(), args[4].clone());
            // Rows of each cache: a slot outside them writes no K/V (q is
            // still written), as the kernels check.
            let num_slots = kc.f.len() / (kvh * hd).max(1);
            for t in 0..t_n {
                let p = args[1].i[t];
                let slot = args[2].i[t];
                let slot_ok = slot >= 0 && (slot as usize) < num_slots;
                let slot = slot.max(0) as usize;
                for u in 0..units {
                    let src = &args[0].f[(t * units + u) * hd..(t * units + u + 1) * hd];
                    if u >= h && !slot_ok {
                        continue;
                    }
                    if u >= h + kvh {
                        let dst = slot * kvh * hd + (u - h - kvh) * hd;
                        vc.f[dst..dst + hd].copy_from_slice(src);
                        continue;
                    }
                    let mut x: Vec<f32> = src.to_vec();
                    if let Some(eps) = qk_norm {
                        let w = if u < h { &args[5].f } else { &args[6].f };
                        let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
                        let inv = 1.0 / ((ss / hd as f64) as f32 + eps).sqrt();
                        for (i, v) in x.iter_mut().enumerate() {
                            *v = *v * inv * norm_w(w[i], *unit_offset);
                        }
                    }
                    let mut o = vec![0.0f32; hd];
                    for i in 0..half {
                        let (a, b) = rope_pair(x[i], x[i + half], p, f[i]);
                        o[i] = rnd(d, a);
                        o[i + half] = rnd(d, b);
                    }
                    if u < h {
                        q[(t * h + u) * hd..(t * h + u + 1) * hd].copy_from_slice(&o);
                    } else {
                        let dst = slot * kvh * hd + (u - h) * hd;
                        kc.f[dst..dst + hd].copy_from_slice(&o);
                    }
                }
            }
            vec![HT::floats(d, &[t_n as u32, (h * hd) as u32], q), kc, vc]
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
            let (h, kvh, hd, qn, bs) = (
                *heads as usize,
                *kv_heads as usize,
                *head_dim as usize,
                *query as usize,
                *block_size as usize,
            );
            let m = dims(&args[3])[1] as usize;
            let b_n = dims(&args[3])[0] as usize;
            let mut out = vec![0.0f32; b_n * qn * h * hd];
            for b in 0..b_n {
                let ctx = args[4].i[b] as usize;
                for qi in 0..qn {
                    let pos = ctx - qn + qi;
                    let lo = match window {
                        Some(w) => (pos + 1).saturating_sub(*w as usize),
                        None => 0,
                    };
                    for hh in 0..h {
                        let g = hh / (h / kvh);
                        let qrow = &args[0].f[((b * qn + qi) * h + hh) * hd..][..hd];
                        let mut scores = Vec::new();
                        let mut slots = Vec::new();
                        for p in lo..=pos {
                            let slot = args[3].i[b * m + p / bs] as usize * bs + p % bs;
                            let k = &args[1].f[(slot * kvh + g) * hd..][..hd];
                            let dot: f64 =
                                qrow.iter().zip(k).map(|(&a, &c)| a as f64 * c as f64).sum();
                            let mut s = dot * *scale as f64;
                            if let Some(cap) = softcap {
                                s = *cap as f64 * (s / *cap as f64).tanh();
                            }
                            scores.push(s);
                            slots.push(slot);
                        }
                        let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                        let l: f64 = e.iter().sum();
                        let o = &mut out[((b * qn + qi) * h + hh) * hd..][..hd];
                        for (w, &slot) in e.iter().zip(&slots) {
                            let v = &args[2].f[(slot * kvh + g) * hd..][..hd];
                            for (oi, &vi) in o.iter_mut().zip(v) {
                                *oi += (w / l * vi as f64) as f32;
                            }
                        }
                        for oi in o.iter_mut() {
                            *oi = rnd(d, *oi);
                        }
                    }
                }
            }
            vec![HT::floats(d, &dims(&args[0]), out)]
        }
        Op::SiluMul | Op::GeluTanhMul => {
            let act = |g: f32| {
                if matches!(op, Op::SiluMul) {
                    silu(g)
                } else {
                    gelu_tanh(g)
                }
            };
            let rd = result_tys[0].shape.dims().to_vec();
            let (t, inter) = (rd[0] as usize, rd[1] as usize);
            let mut out = Vec::with_capacity(t * inter);
            for r in 0..t {
                for i in 0..inter {
                    let (g, u) = if args.len() == 1 {
                        (
                            args[0].f[r * 2 * inter + i],
                            args[0].f[r * 2 * inter + inter + i],
                        )
                    } else {
                        (args[0].f[r * inter + i], args[1].f[r * inter + i])
                    };
                    out.push(rnd(d, act(g) * u));
                }
            }
            vec![HT::floats(d, &rd, out)]
        }
        Op::Scale { factor, softcap } => vec![HT::floats(
            d,
            &dims(&args[0]),
            args[0]
                .f
                .iter()
                .map(|&x| {
                    let y = x * factor;
                    rnd(d, softcap.map_or(y, |c| c * (y / c).tanh()))
                })
                .collect(),
        )],
        Op::Add => vec![HT::floats(
            d,
            &dims(&args[0]),
            args[0]
                .f
                .iter()
                .zip(&args[1].f)
                .map(|(a, b)| rnd(d, a + b))
                .collect(),
        )],
        Op::GatherLast { group } => {
            let w = dims(&args[0])[1] as usize;
            let g = *group as usize;
            let rows = dims(&args[0])[0] as usize / g;
            let pick = |r: usize| (r * g + g - 1) * w;
            if d == DType::I32 {
                let v = (0..rows)
                    .flat_map(|r| args[0].i[pick(r)..pick(r) + w].to_vec())
                    .collect();
                vec![HT::ints(&[rows as u32, w as u32], v)]
            } else {
                let v = (0..rows)
                    .flat_map(|r| args[0].f[pick(r)..pick(r) + w].to_vec())
                    .collect();
                vec![HT::floats(d, &[rows as u32, w as u32], v)]
            }
        }
        Op::Argmax => {
            let v = dims(&args[0])[1] as usize;
            let out = args[0]
                .f
                .chunks(v)
                .map(|r| {
                    let mut bi = 0;
                    for (i, &x) in r.iter().enumerate() {
                        if x > r[bi] {
                            bi = i;
                        }
                    }
                    bi as i32
                })
                .collect::<Vec<_>>();
            vec![HT::ints(&[out.len() as u32], out)]
        }
        Op::Sample => {
            // The normative algorithm is the CPU reference's (documented
            // there); the GPU must pick the same token.
            let v = dims(&args[0])[1] as usize;
            let out = args[0]
                .f
                .chunks(v)
                .enumerate()
                .map(|(r, row)| {
                    let p = &args[1].f[r * 4..r * 4 + 4];
                    let s = &args[2].i[r * 4..r * 4 + 4];
                    kiln_kernels::cpu::sample::sample_row(
                        row,
                        [p[0], p[1], p[2], p[3]],
                        [s[0], s[1], s[2], s[3]],
                    ) as i32
                })
                .collect::<Vec<_>>();
            let rows = out.len() as u32;
            vec![HT::ints(&[rows], out)]
        }
        Op::AcceptGreedy { spec } => {
            let s = *spec as usize;
            let b_n = args[1].i.len() / s;
            let out = (0..b_n)
                .map(|b| {
                    let mut n = 0;
                    while n < s && args[1].i[b * s + n] == args[0].i[b * (s + 1) + n] {
                        n += 1;
                    }
                    n as i32
                })
                .collect::<Vec<_>>();
            vec![HT::ints(&[b_n as u32], out)]
        }
        Op::MatMul { bias, out } => {
            let (t, k) = (dims(&args[0])[0] as usize, dims(&args[0])[1] as usize);
            let n = dims(&args[1])[0] as usize;
            let mut o = Vec::with_capacity(t * n);
            for r in 0..t {
                for c in 0..n {
                    let mut s: f64 = (0..k)
                        .map(|i| args[0].f[r * k + i] as f64 * args[1].f[c * k + i] as f64)
                        .sum();
                    if *bias {
                        s += args[2].f[c] as f64;
                    }
                    o.push(rnd(*out, s as f32));
                }
            }
            vec![HT::floats(*out, &[t as u32, n as u32], o)]
        }
        Op::FusedMatMul {
            bias,
            out,
            pre,
            post,
        } => {
            // By definition the unfused sequence, each step rounded to D.
            let d = args[0].ty.dtype;
            let mut rest = args[2..].iter();
            let b = if *bias { rest.next() } else { None };
            let nw = if pre.is_some() { rest.next() } else { None };
            let residual = rest.next();
            let x = match (pre, nw) {
                (Some(p), Some(nw)) => {
                    let op = Op::RmsNorm {
                        eps: p.eps,
                        unit_offset: p.unit_offset,
                    };
                    reference(&op, &[args[0].clone(), nw.clone()], &[args[0].ty.clone()]).remove(0)
                }
                _ => args[0].clone(),
            };
            let y_d = if matches!(post, Epilogue::None | Epilogue::Argmax) {
                *out
            } else {
                d
            };
            let y_ty = TensorType::new(y_d, vec![x.ty.shape.dims()[0], args[1].ty.shape.dims()[0]]);
            let mut mm = vec![x, args[1].clone()];
            mm.extend(b.cloned());
            let y = reference(
                &Op::MatMul {
                    bias: *bias,
                    out: y_d,
                },
                &mm,
                &[y_ty],
            )
            .remove(0);
            match (post, residual) {
                (Epilogue::None, _) => vec![y],
                (Epilogue::SiluMul, _) => reference(&Op::SiluMul, &[y], result_tys),
                (Epilogue::GeluTanhMul, _) => reference(&Op::GeluTanhMul, &[y], result_tys),
                (Epilogue::Residual, Some(r)) => reference(&Op::Add, &[y, r.clone()], result_tys),
                (Epilogue::Residual, None) => panic!("a residual fused_matmul needs a residual"),
                (Epilogue::Argmax, _) => reference(&Op::Argmax, &[y], result_tys),
            }
        }
    }
}

// ------------------------------------------------------------------- device

/// Skips (returning None) with a clear message when no GPU is usable.
pub fn device() -> Option<CudaBackend> {
    if !CudaBackend::available() {
        eprintln!("SKIPPED: no CUDA driver or device on this machine");
        return None;
    }
    let mut b = CudaBackend::new(0).expect("open CUDA device 0");
    let sm = b.sm();
    let images = cubins(sm);
    b.load_kernels(&images).expect("load kernel modules");
    Some(b)
}

/// The CUBINs for `sm`: from `KILN_CUBIN_DIR/<module>.sm_<sm>.cubin` when
/// set (carried from a machine with NVRTC), else compiled here.
pub fn cubins(sm: u32) -> Vec<kiln_ir::plan::KernelImage> {
    if let Ok(dir) = std::env::var("KILN_CUBIN_DIR") {
        return kiln_kernels::gpu::MODULES
            .iter()
            .map(|m| kiln_ir::plan::KernelImage {
                name: m.name.into(),
                kind: kiln_ir::plan::ImageKind::Cubin,
                code: std::fs::read(format!("{dir}/{}.sm_{sm}.cubin", m.name))
                    .unwrap_or_else(|e| panic!("{dir}/{}.sm_{sm}.cubin: {e}", m.name)),
            })
            .collect();
    }
    kiln_kernels::nvrtc::compile_cubins(sm).unwrap_or_else(|e| panic!("{e}"))
}

/// Allocates and uploads `t`.
pub fn put(b: &mut CudaBackend, t: &HT) -> DevOperand {
    let p = b.alloc(t.ty.size_bytes(), "test input").unwrap();
    b.upload(p, &t.bytes()).unwrap();
    DevOperand {
        ptr: p,
        ty: t.ty.clone(),
    }
}

/// Allocates a result buffer filled with 0xFF bytes (NaN for floats, -1
/// for ints), so an element the kernel never writes is caught.
pub fn poisoned(b: &mut CudaBackend, ty: &TensorType) -> DevOperand {
    let p = b.alloc(ty.size_bytes(), "test result").unwrap();
    b.upload(p, &vec![0xFF; ty.size_bytes() as usize]).unwrap();
    DevOperand {
        ptr: p,
        ty: ty.clone(),
    }
}

pub fn get(b: &mut CudaBackend, o: &DevOperand) -> HT {
    let mut buf = vec![0u8; o.ty.size_bytes() as usize];
    b.download(o.ptr, &mut buf).unwrap();
    HT::from_bytes(&o.ty, &buf)
}

/// Runs `op` on the device: arguments uploaded, results poisoned (in-place
/// results reuse their argument's buffer), prepared, launched, downloaded.
pub fn run_op(b: &mut CudaBackend, op: &Op, args: &[HT]) -> Vec<HT> {
    run_op_as(b, op, args, None)
}

/// [`run_op`] with a matmul run as `gemm` (`None`: the default rule).
pub fn run_op_as(
    b: &mut CudaBackend,
    op: &Op,
    args: &[HT],
    gemm: Option<kiln_ir::plan::GemmKind>,
) -> Vec<HT> {
    let tys: Vec<TensorType> = args.iter().map(|a| a.ty.clone()).collect();
    let result_tys = op.infer(&tys).expect("test operands type-check");
    let dargs: Vec<DevOperand> = args.iter().map(|a| put(b, a)).collect();
    let aliases = op.aliases();
    let results: Vec<DevOperand> = result_tys
        .iter()
        .enumerate()
        .map(|(r, ty)| match aliases.iter().find(|(res, _)| *res == r) {
            Some((_, a)) => dargs[*a].clone(),
            None => poisoned(b, ty),
        })
        .collect();
    let mut launch = Launch {
        // As the engine marks a matmul's weight operand: the GEMV kernel
        // then loads it before its dependency wait.
        const_args: if matches!(
            op,
            Op::MatMul { .. } | Op::FusedMatMul { .. } | Op::MatMulQkvRope { .. }
        ) {
            2
        } else {
            0
        },
        kernel: format!("test:{}", op.mnemonic()),
        op: op.clone(),
        args: dargs.clone(),
        results: results.clone(),
        workspace: None,
        body: kiln_runtime::backend::LaunchBody::Reference,
    };
    let pdl = b.pdl();
    let owned = gpu_bodies::lower_as(b, &mut launch, pdl, gemm);
    b.prepare(&launch).unwrap();
    b.launch(&launch).unwrap();
    b.synchronize().unwrap();
    let out = results.iter().map(|r| get(b, r)).collect();
    for o in dargs.iter().chain(results.iter()) {
        let _ = b.free(o.ptr);
    }
    for p in owned {
        let _ = b.free(p);
    }
    out
}

/// The shared CPU reference kernels (`kiln_kernels::cpu::execute`) on the same
/// inputs, or None (with a message) while they are not implemented.
pub fn cpu_reference(op: &Op, args: &[HT]) -> Option<Vec<HT>> {
    use kiln_kernels::cpu::{execute, RawTensor};
    let tys: Vec<TensorType> = args.iter().map(|a| a.ty.clone()).collect();
    let result_tys = op.infer(&tys).ok()?;
    // u64-backed buffers keep every dtype aligned.
    let mut arg_bufs: Vec<Vec<u64>> = args
        .iter()
        .map(|a| {
            let b = a.bytes();
            let mut v = vec![0u64; b.len().div_ceil(8)];
            // SAFETY: v holds at least b.len() bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(b.as_ptr(), v.as_mut_ptr() as *mut u8, b.len())
            };
            v
        })
        .collect();
    let mut res_bufs: Vec<Vec<u64>> = result_tys
        .iter()
        .map(|t| vec![u64::MAX; (t.size_bytes() as usize).div_ceil(8)])
        .collect();
    let aliases = op.aliases();
    let raw_args: Vec<RawTensor> = arg_bufs
        .iter_mut()
        .zip(args)
        .map(|(b, a)| RawTensor {
            ptr: b.as_mut_ptr() as *mut u8,
            ty: a.ty.clone(),
        })
        .collect();
    let raw_res: Vec<RawTensor> = result_tys
        .iter()
        .enumerate()
        .map(|(r, ty)| match aliases.iter().find(|(res, _)| *res == r) {
            Some((_, a)) => raw_args[*a].clone(),
            None => RawTensor {
                ptr: res_bufs[r].as_mut_ptr() as *mut u8,
                ty: ty.clone(),
            },
        })
        .collect();
    // SAFETY: every buffer is sized and aligned for its tensor.
    if let Err(e) = unsafe { execute(op, &raw_args, &raw_res) } {
        eprintln!(
            "NOTE: CPU reference kernel unavailable for {}: {e}",
            op.mnemonic()
        );
        return None;
    }
    Some(
        raw_res
            .iter()
            .map(|r| {
                // SAFETY: r.ptr addresses size_bytes() initialized bytes.
                let b = unsafe { std::slice::from_raw_parts(r.ptr, r.ty.size_bytes() as usize) };
                HT::from_bytes(&r.ty, b)
            })
            .collect(),
    )
}
