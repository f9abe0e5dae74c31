//! A synthetic decode step with a real model's shapes (Qwen3 layout: fused
//! qkv with q/k norm, paged attention, packed gate_up, tied lm_head), built
//! directly on the Backend seam. It lets the GPU checks time replay against
//! eager and check a whole step against the host reference before the
//! engine and compiler exist.
#![allow(dead_code)]

use super::*;
use kiln_ir::{AttnAttrs, Rope, RopeScaling};
use kiln_runtime::backend::DevPtr;

#[derive(Clone, Copy, Debug)]
pub struct Cfg {
    pub vocab: u32,
    pub hidden: u32,
    pub layers: u32,
    pub heads: u32,
    pub kvh: u32,
    pub hd: u32,
    pub inter: u32,
    pub block: u32,
}

pub const QWEN3_0_6B: Cfg = Cfg {
    vocab: 151_936,
    hidden: 1024,
    layers: 28,
    heads: 16,
    kvh: 8,
    hd: 128,
    inter: 3072,
    block: 16,
};

pub const TINY: Cfg = Cfg {
    vocab: 512,
    hidden: 256,
    layers: 2,
    heads: 4,
    kvh: 2,
    hd: 64,
    inter: 512,
    block: 16,
};

/// A buffer of the step.
#[derive(Clone, Debug)]
pub struct Buf {
    pub ty: TensorType,
    /// Initial contents (weights, inputs, caches); None for intermediates.
    pub init: Option<HT>,
}

pub struct SOp {
    pub op: Op,
    pub args: Vec<usize>,
    pub results: Vec<usize>,
}

pub struct Step {
    pub cfg: Cfg,
    pub batch: u32,
    pub bufs: Vec<Buf>,
    pub ops: Vec<SOp>,
    pub ids: usize,
    pub logits: usize,
    pub next: usize,
    /// Bytes of weights (lm_head counted once as a read; the embedding
    /// gather reads only `batch` rows).
    pub weight_bytes: u64,
    pub kv_read_bytes: u64,
}

/// Fills a tensor from a shared random pattern (fast for large weights).
fn patterned(pattern: &[f32], d: DType, shape: &[u32], offset: &mut usize) -> HT {
    let n: usize = shape.iter().map(|&x| x as usize).product();
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        v.push(pattern[(*offset + i * 7) % pattern.len()]);
    }
    *offset += 12_345;
    HT {
        ty: TensorType::new(d, shape.to_vec()),
        f: v,
        i: vec![],
    }
}

/// Builds the step for `batch` sequences with context lengths `ctx`.
pub fn build(cfg: Cfg, ctx: &[i32], seed: u64) -> Step {
    let mut r = Rng::new(seed);
    let batch = ctx.len() as u32;
    let d = DType::BF16;
    let pattern: Vec<f32> = (0..(1 << 20)).map(|_| rnd(d, r.uniform())).collect();
    let mut off = 0usize;
    let mut bufs: Vec<Buf> = Vec::new();
    let add = |bufs: &mut Vec<Buf>, ty: TensorType, init: Option<HT>| {
        bufs.push(Buf { ty, init });
        bufs.len() - 1
    };
    let tt = |dt: DType, s: &[u32]| TensorType::new(dt, s.to_vec());
    let scale_w = |mut h: HT, s: f32| {
        for x in h.f.iter_mut() {
            *x = rnd(d, *x * s);
        }
        h
    };
    let max_ctx = *ctx.iter().max().unwrap() as u32;
    let m = max_ctx.div_ceil(cfg.block);
    let num_blocks = batch * m + 1;
    let slots = num_blocks * cfg.block;
    // Inputs.
    let ids_v: Vec<i32> = (0..batch).map(|_| r.below(cfg.vocab) as i32).collect();
    let mut phys: Vec<i32> = (1..num_blocks as i32).collect();
    for i in (1..phys.len()).rev() {
        let j = r.below(i as u32 + 1) as usize;
        phys.swap(i, j);
    }
    let bt_v: Vec<i32> = phys[..(batch * m) as usize].to_vec();
    let pos_v: Vec<i32> = ctx.iter().map(|&c| c - 1).collect();
    let slot_v: Vec<i32> = (0..batch as usize)
        .map(|b| {
            let p = pos_v[b] as u32;
            bt_v[b * m as usize + (p / cfg.block) as usize] * cfg.block as i32
                + (p % cfg.block) as i32
        })
        .collect();
    let ids = add(
        &mut bufs,
        tt(DType::I32, &[batch]),
        Some(HT::ints(&[batch], ids_v)),
    );
    let pos = add(
        &mut bufs,
        tt(DType::I32, &[batch]),
        Some(HT::ints(&[batch], pos_v)),
    );
    let slot = add(
        &mut bufs,
        tt(DType::I32, &[batch]),
        Some(HT::ints(&[batch], slot_v)),
    );
    let bt = add(
        &mut bufs,
        tt(DType::I32, &[batch, m]),
        Some(HT::ints(&[batch, m], bt_v)),
    );
    let cl = add(
        &mut bufs,
        tt(DType::I32, &[batch]),
        Some(HT::ints(&[batch], ctx.to_vec())),
    );
    let h = cfg.hidden;
    let qkv_n = (cfg.heads + 2 * cfg.kvh) * cfg.hd;
    let mut weight_bytes = 0u64;
    let mut weight = |bufs: &mut Vec<Buf>, shape: &[u32], s: f32, off: &mut usize| {
        let w = scale_w(patterned(&pattern, d, shape, off), s);
        weight_bytes += w.ty.size_bytes();
        add(bufs, w.ty.clone(), Some(w))
    };
    let embed = weight(&mut bufs, &[cfg.vocab, h], 1.0, &mut off);
    let mut ops = Vec::new();
    let rope = Rope {
        theta: 1e6,
        scaling: RopeScaling::None,
    };
    let x0 = add(&mut bufs, tt(d, &[batch, h]), None);
    ops.push(SOp {
        op: Op::Embedding,
        args: vec![ids, embed],
        results: vec![x0],
    });
    let mut residual = x0;
    let mut pending: Option<usize> = None; // the block output to add to the residual
    let ws = 1.0 / (h as f32).sqrt();
    for _ in 0..cfg.layers {
        let in_norm = weight(&mut bufs, &[h], 1.0, &mut off);
        let qkv_w = weight(&mut bufs, &[qkv_n, h], ws, &mut off);
        let qn = weight(&mut bufs, &[cfg.hd], 1.0, &mut off);
        let kn = weight(&mut bufs, &[cfg.hd], 1.0, &mut off);
        let o_w = weight(&mut bufs, &[h, cfg.heads * cfg.hd], ws, &mut off);
        let post = weight(&mut bufs, &[h], 1.0, &mut off);
        let gu_w = weight(&mut bufs, &[2 * cfg.inter, h], ws, &mut off);
        let down_w = weight(
            &mut bufs,
            &[h, cfg.inter],
            1.0 / (cfg.inter as f32).sqrt(),
            &mut off,
        );
        let cache = |bufs: &mut Vec<Buf>, off: &mut usize| {
            let c = patterned(&pattern, d, &[slots, cfg.kvh * cfg.hd], off);
            add(bufs, c.ty.clone(), Some(c))
        };
        let kc = cache(&mut bufs, &mut off);
        let vc = cache(&mut bufs, &mut off);
        let normed = add(&mut bufs, tt(d, &[batch, h]), None);
        match pending {
            None => ops.push(SOp {
                op: Op::RmsNorm {
                    eps: 1e-6,
                    unit_offset: false,
                },
                args: vec![residual, in_norm],
                results: vec![normed],
            }),
            Some(p) => {
                let sum = add(&mut bufs, tt(d, &[batch, h]), None);
                ops.push(SOp {
                    op: Op::AddRmsNorm {
                        eps: 1e-6,
                        unit_offset: false,
                    },
                    args: vec![p, residual, in_norm],
                    results: vec![normed, sum],
                });
                residual = sum;
            }
        }
        let qkv = add(&mut bufs, tt(d, &[batch, qkv_n]), None);
        ops.push(SOp {
            op: Op::MatMul {
                bias: false,
                out: d,
            },
            args: vec![normed, qkv_w],
            results: vec![qkv],
        });
        let q = add(&mut bufs, tt(d, &[batch, cfg.heads * cfg.hd]), None);
        ops.push(SOp {
            op: Op::QkvRopeKvWrite {
                heads: cfg.heads,
                kv_heads: cfg.kvh,
                head_dim: cfg.hd,
                rope: rope.clone(),
                qk_norm: Some(1e-6),
                unit_offset: false,
            },
            args: vec![qkv, pos, slot, kc, vc, qn, kn],
            results: vec![q, kc, vc],
        });
        let attn = add(&mut bufs, tt(d, &[batch, cfg.heads * cfg.hd]), None);
        ops.push(SOp {
            op: Op::PagedAttention(AttnAttrs {
                heads: cfg.heads,
                kv_heads: cfg.kvh,
                head_dim: cfg.hd,
                query: 1,
                block_size: cfg.block,
                scale: 1.0 / (cfg.hd as f32).sqrt(),
                window: None,
                softcap: None,
            }),
            args: vec![q, kc, vc, bt, cl],
            results: vec![attn],
        });
        let o = add(&mut bufs, tt(d, &[batch, h]), None);
        ops.push(SOp {
            op: Op::MatMul {
                bias: false,
                out: d,
            },
            args: vec![attn, o_w],
            results: vec![o],
        });
        let normed2 = add(&mut bufs, tt(d, &[batch, h]), None);
        let sum2 = add(&mut bufs, tt(d, &[batch, h]), None);
        ops.push(SOp {
            op: Op::AddRmsNorm {
                eps: 1e-6,
                unit_offset: false,
            },
            args: vec![o, residual, post],
            results: vec![normed2, sum2],
        });
        residual = sum2;
        let gu = add(&mut bufs, tt(d, &[batch, 2 * cfg.inter]), None);
        ops.push(SOp {
            op: Op::MatMul {
                bias: false,
                out: d,
            },
            args: vec![normed2, gu_w],
            results: vec![gu],
        });
        let act = add(&mut bufs, tt(d, &[batch, cfg.inter]), None);
        ops.push(SOp {
            op: Op::SiluMul,
            args: vec![gu],
            results: vec![act],
        });
        let down = add(&mut bufs, tt(d, &[batch, h]), None);
        ops.push(SOp {
            op: Op::MatMul {
                bias: false,
                out: d,
            },
            args: vec![act, down_w],
            results: vec![down],
        });
        pending = Some(down);
    }
    let fnorm = weight(&mut bufs, &[h], 1.0, &mut off);
    let normed = add(&mut bufs, tt(d, &[batch, h]), None);
    let sum = add(&mut bufs, tt(d, &[batch, h]), None);
    ops.push(SOp {
        op: Op::AddRmsNorm {
            eps: 1e-6,
            unit_offset: false,
        },
        args: vec![pending.unwrap(), residual, fnorm],
        results: vec![normed, sum],
    });
    let logits = add(&mut bufs, tt(DType::F32, &[batch, cfg.vocab]), None);
    ops.push(SOp {
        op: Op::MatMul {
            bias: false,
            out: DType::F32,
        },
        args: vec![normed, embed],
        results: vec![logits],
    });
    let next = add(&mut bufs, tt(DType::I32, &[batch]), None);
    ops.push(SOp {
        op: Op::Argmax,
        args: vec![logits],
        results: vec![next],
    });
    let kv_read_bytes: u64 = ctx
        .iter()
        .map(|&c| c as u64 * cfg.layers as u64 * 2 * (cfg.kvh * cfg.hd) as u64 * 2)
        .sum();
    Step {
        cfg,
        batch,
        bufs,
        ops,
        ids,
        logits,
        next,
        weight_bytes,
        kv_read_bytes,
    }
}

/// Runs the step on the host reference; returns (logits, next tokens).
pub fn host_run(step: &Step) -> (HT, HT) {
    let mut vals: Vec<Option<HT>> = step.bufs.iter().map(|b| b.init.clone()).collect();
    for s in &step.ops {
        let args: Vec<HT> = s
            .args
            .iter()
            .map(|&a| vals[a].clone().expect("defined"))
            .collect();
        let rtys: Vec<TensorType> = s.results.iter().map(|&r| step.bufs[r].ty.clone()).collect();
        let out = reference(&s.op, &args, &rtys);
        for (&r, v) in s.results.iter().zip(out) {
            vals[r] = Some(v);
        }
    }
    (
        vals[step.logits].clone().unwrap(),
        vals[step.next].clone().unwrap(),
    )
}

/// The step on the device: buffers, launches.
pub struct DevStep {
    pub ptrs: Vec<DevOperand>,
    pub launches: Vec<Launch>,
    /// Scratch and counters the lowering asked for.
    pub scratch: Vec<DevPtr>,
}

/// Allocates and fills every buffer, builds and prepares the launches.
pub fn upload(b: &mut CudaBackend, step: &Step) -> DevStep {
    upload_as(b, step, None)
}

/// [`upload`] with every matmul run as `gemm` (`None`: the default rule).
pub fn upload_as(
    b: &mut CudaBackend,
    step: &Step,
    gemm: Option<kiln_ir::plan::GemmKind>,
) -> DevStep {
    let ptrs: Vec<DevOperand> = step
        .bufs
        .iter()
        .map(|buf| match &buf.init {
            Some(h) => put(b, h),
            None => poisoned(b, &buf.ty),
        })
        .collect();
    let mut launches: Vec<Launch> = step
        .ops
        .iter()
        .map(|s| Launch {
            // Every matmul here multiplies by a weight, as in the engine.
            const_args: if matches!(s.op, Op::MatMul { .. }) {
                2
            } else {
                0
            },
            kernel: kiln_kernels::gpu::kernel_name(&s.op, step.bufs[s.args[0]].ty.dtype),
            op: s.op.clone(),
            args: s.args.iter().map(|&a| ptrs[a].clone()).collect(),
            results: s.results.iter().map(|&r| ptrs[r].clone()).collect(),
            workspace: None,
            body: kiln_runtime::backend::LaunchBody::Reference,
        })
        .collect();
    let pdl = b.pdl();
    let mut scratch = Vec::new();
    for l in &mut launches {
        scratch.extend(super::gpu_bodies::lower_as(b, l, pdl, gemm));
        b.prepare(l).unwrap();
    }
    DevStep {
        ptrs,
        launches,
        scratch,
    }
}

pub fn free(b: &mut CudaBackend, d: DevStep) {
    for p in d.ptrs {
        b.free(p.ptr).unwrap();
    }
    for p in d.scratch {
        b.free(p).unwrap();
    }
}
