//! Times one SmolLM2-135M-sized decode step on the CPU kernels.
//!
//! `cargo run -p kiln-kernels --release --example cpu_decode_bench -- [--steps N] [--rows T] [--ctx C]`
//!
//! Builds random bf16 weights of SmolLM2-135M's shapes (hidden 576, 30
//! layers, 9 heads / 3 kv heads of 64, intermediate 1536, vocab 49152, tied
//! embeddings), each layer in its own buffers so every step streams all
//! ~270 MB from memory, and reports medians over the steps of:
//! * the matmuls alone (fused qkv, o, fused gate_up, down per layer, and
//!   the lm_head) -> estimated tokens/s and weight GB/s;
//! * the whole step through `execute` (embedding, norms, fused qkv/rope/KV
//!   write, paged attention over `C` cached positions, SwiGLU, residual adds,
//!   lm_head to f32 logits, argmax), with a per-op breakdown.
//!
//! Random weights say nothing about token quality; this measures speed only.

use kiln_ir::{AttnAttrs, DType, Op, Rope, RopeScaling, TensorType};
use kiln_kernels::cpu::{execute, RawTensor};
use std::collections::BTreeMap;
use std::time::Instant;

const HIDDEN: u32 = 576;
const LAYERS: usize = 30;
const HEADS: u32 = 9;
const KV_HEADS: u32 = 3;
const HEAD_DIM: u32 = 64;
const INTER: u32 = 1536;
const VOCAB: u32 = 49152;
const BLOCK: u32 = 16;

/// A tensor in 4-byte aligned host memory. Kernels write through `ptr`
/// (taken once from the vector), never through a shared borrow.
struct Tensor {
    ty: TensorType,
    words: Vec<u32>,
    ptr: *mut u8,
}

impl Tensor {
    fn zeros(dtype: DType, shape: &[u32]) -> Tensor {
        let ty = TensorType::new(dtype, shape.to_vec());
        let mut words = vec![0u32; (ty.size_bytes() as usize).div_ceil(4)];
        let ptr = words.as_mut_ptr() as *mut u8;
        Tensor { ty, words, ptr }
    }
    /// Random bf16 values with magnitudes in `[scale, 2 * scale)` (`scale`
    /// a power of two) and random signs: random bits, cheap to make.
    fn random_bf16(shape: &[u32], scale: f32, seed: &mut u64) -> Tensor {
        let mut t = Tensor::zeros(DType::BF16, shape);
        let exponent = (half::bf16::from_f32(scale).to_bits() & 0x7f80) as u32;
        let base = exponent | exponent << 16;
        for w in &mut t.words {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            *w = (*seed as u32 & 0x807f_807f) | base;
        }
        t
    }
    fn ints(shape: &[u32], values: &[i32]) -> Tensor {
        let mut t = Tensor::zeros(DType::I32, shape);
        for (w, v) in t.words.iter_mut().zip(values) {
            *w = *v as u32;
        }
        t
    }
    fn raw(&self) -> RawTensor {
        RawTensor {
            ptr: self.ptr,
            ty: self.ty.clone(),
        }
    }
}

struct Layer {
    in_norm: Tensor,
    post_norm: Tensor,
    qkv: Tensor,
    o: Tensor,
    gate_up: Tensor,
    down: Tensor,
    kc: Tensor,
    vc: Tensor,
}

fn arg(name: &str, default: usize) -> Result<usize, Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        Some(i) => Ok(args
            .get(i + 1)
            .ok_or(format!("{name} needs a value"))?
            .parse()
            .map_err(|e| format!("{name}: {e}"))?),
        None => Ok(default),
    }
}

/// CPU seconds used by this process so far (all threads, user + system),
/// from `/proc/self/stat`; `None` where that file does not exist.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesized command name; utime and stime are the
    // 14th and 15th fields overall, in clock ticks (100 per second on Linux).
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// "CPU time per step" text for a phase of `steps` steps.
fn cpu_per_step(start: Option<f64>, steps: usize) -> String {
    match (start, cpu_seconds()) {
        (Some(a), Some(b)) => format!("; CPU time {:.2} ms/step", (b - a) / steps as f64 * 1e3),
        _ => String::new(),
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let steps = arg("--steps", 15)?.max(1);
    let rows = arg("--rows", 1)?.max(1) as u32;
    let ctx = arg("--ctx", 256)?.max(rows as usize) as u32;
    let blocks = ctx.div_ceil(BLOCK) + 1;
    let slots = blocks * BLOCK;
    let kvw = KV_HEADS * HEAD_DIM;
    let qkv_n = (HEADS + 2 * KV_HEADS) * HEAD_DIM;
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let t0 = Instant::now();
    let layers: Vec<Layer> = (0..LAYERS)
        .map(|_| Layer {
            in_norm: Tensor::random_bf16(&[HIDDEN], 1.0, &mut seed),
            post_norm: Tensor::random_bf16(&[HIDDEN], 1.0, &mut seed),
            qkv: Tensor::random_bf16(&[qkv_n, HIDDEN], 0.03125, &mut seed),
            o: Tensor::random_bf16(&[HIDDEN, HIDDEN], 0.03125, &mut seed),
            gate_up: Tensor::random_bf16(&[2 * INTER, HIDDEN], 0.03125, &mut seed),
            down: Tensor::random_bf16(&[HIDDEN, INTER], 0.03125, &mut seed),
            kc: Tensor::random_bf16(&[slots, kvw], 1.0, &mut seed),
            vc: Tensor::random_bf16(&[slots, kvw], 1.0, &mut seed),
        })
        .collect();
    let embed = Tensor::random_bf16(&[VOCAB, HIDDEN], 0.03125, &mut seed);
    let final_norm = Tensor::random_bf16(&[HIDDEN], 1.0, &mut seed);
    eprintln!("built random weights in {:.1}s", t0.elapsed().as_secs_f64());

    let weight_bytes: u64 = layers
        .iter()
        .map(|l| {
            l.qkv.ty.size_bytes()
                + l.o.ty.size_bytes()
                + l.gate_up.ty.size_bytes()
                + l.down.ty.size_bytes()
                + 2 * l.in_norm.ty.size_bytes()
        })
        .sum::<u64>()
        + embed.ty.size_bytes()
        + final_norm.ty.size_bytes();

    // Activations.
    let bf = |shape: &[u32]| Tensor::zeros(DType::BF16, shape);
    let ids = Tensor::ints(
        &[rows],
        &(0..rows as i32).map(|i| 17 + i).collect::<Vec<_>>(),
    );
    let first = ctx - rows;
    let pos = Tensor::ints(
        &[rows],
        &(0..rows).map(|i| (first + i) as i32).collect::<Vec<_>>(),
    );
    let slot_ids = pos.words.iter().map(|&p| p as i32).collect::<Vec<_>>();
    let slot_t = Tensor::ints(&[rows], &slot_ids);
    let table = Tensor::ints(&[1, blocks], &(0..blocks as i32).collect::<Vec<_>>());
    let lens = Tensor::ints(&[1], &[ctx as i32]);
    let res_a = bf(&[rows, HIDDEN]);
    let res_b = bf(&[rows, HIDDEN]);
    let normed = bf(&[rows, HIDDEN]);
    let qkv = bf(&[rows, qkv_n]);
    let q = bf(&[rows, HEADS * HEAD_DIM]);
    let attn = bf(&[rows, HEADS * HEAD_DIM]);
    let o = bf(&[rows, HIDDEN]);
    let gu = bf(&[rows, 2 * INTER]);
    let act = bf(&[rows, INTER]);
    let down = bf(&[rows, HIDDEN]);
    let logits = Tensor::zeros(DType::F32, &[rows, VOCAB]);
    let next = Tensor::zeros(DType::I32, &[rows]);

    let rope = Rope {
        theta: 100_000.0,
        scaling: RopeScaling::None,
    };
    let eps = 1e-5;
    let matmul = Op::MatMul {
        bias: false,
        out: DType::BF16,
    };
    let lm_head = Op::MatMul {
        bias: false,
        out: DType::F32,
    };
    let norm = Op::RmsNorm {
        eps,
        unit_offset: false,
    };
    let add_norm = Op::AddRmsNorm {
        eps,
        unit_offset: false,
    };
    let qkv_op = Op::QkvRopeKvWrite {
        heads: HEADS,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        rope,
        qk_norm: None,
        unit_offset: false,
    };
    let attn_op = Op::PagedAttention(AttnAttrs {
        heads: HEADS,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        query: rows,
        block_size: BLOCK,
        scale: 1.0 / (HEAD_DIM as f32).sqrt(),
        window: None,
        softcap: None,
    });

    let mut timings: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    let run = |name: &'static str,
               op: &Op,
               args: &[&Tensor],
               res: &[&Tensor],
               per_op: &mut BTreeMap<&'static str, f64>|
     -> Result<(), Box<dyn std::error::Error>> {
        let a: Vec<RawTensor> = args.iter().map(|t| t.raw()).collect();
        let r: Vec<RawTensor> = res.iter().map(|t| t.raw()).collect();
        let start = Instant::now();
        // SAFETY: every tensor is an owned, aligned buffer of its type's size,
        // alive for the call; results are distinct buffers or the in-place
        // caches the op names.
        unsafe { execute(op, &a, &r)? };
        *per_op.entry(name).or_default() += start.elapsed().as_secs_f64();
        Ok(())
    };

    // 0. Attention alone, when asked (for profiling the attention kernel).
    if std::env::args().any(|a| a == "--attention-only") {
        let mut times = Vec::new();
        for _ in 0..steps {
            let mut per_op = BTreeMap::new();
            for l in &layers {
                run(
                    "attention",
                    &attn_op,
                    &[&q, &l.kc, &l.vc, &table, &lens],
                    &[&attn],
                    &mut per_op,
                )?;
            }
            times.push(per_op["attention"]);
        }
        let kv_bytes = LAYERS as f64 * 2.0 * ctx as f64 * kvw as f64 * 2.0;
        let t = median(&mut times);
        println!(
            "attention of one step (context {ctx}): median {:.3} ms, {:.2} GB/s of KV cache",
            t * 1e3,
            kv_bytes / t / 1e9
        );
        return Ok(());
    }

    // 1. Matmuls only.
    let mut mm_times = Vec::new();
    let mut mm_cpu = None;
    for step in 0..steps + 2 {
        if step == 2 {
            mm_cpu = cpu_seconds();
        }
        let mut per_op = BTreeMap::new();
        let start = Instant::now();
        for l in &layers {
            run("qkv", &matmul, &[&normed, &l.qkv], &[&qkv], &mut per_op)?;
            run("o", &matmul, &[&attn, &l.o], &[&o], &mut per_op)?;
            run(
                "gate_up",
                &matmul,
                &[&normed, &l.gate_up],
                &[&gu],
                &mut per_op,
            )?;
            run("down", &matmul, &[&act, &l.down], &[&down], &mut per_op)?;
        }
        run(
            "lm_head",
            &lm_head,
            &[&normed, &embed],
            &[&logits],
            &mut per_op,
        )?;
        if step >= 2 {
            mm_times.push(start.elapsed().as_secs_f64());
        }
    }
    let mm_cpu = cpu_per_step(mm_cpu, steps);
    let mm_best = mm_times.iter().cloned().fold(f64::INFINITY, f64::min);
    let mm = median(&mut mm_times);
    let mm_bytes = weight_bytes as f64;
    println!(
        "matmuls of one step (T={rows}): median {:.2} ms -> {:.1} tokens/s (x{rows} rows), {:.2} GB/s of weights (best {:.2} ms){mm_cpu}",
        mm * 1e3,
        rows as f64 / mm,
        mm_bytes / mm / 1e9,
        mm_best * 1e3
    );

    // 2. The whole step.
    let mut step_times = Vec::new();
    let mut st_cpu = None;
    for step in 0..steps + 2 {
        if step == 2 {
            st_cpu = cpu_seconds();
        }
        let mut per_op = BTreeMap::new();
        let start = Instant::now();
        // The residual stream ping-pongs between two buffers (add_rms_norm's
        // `sum` may not overlap its inputs).
        let (mut cur, mut nxt) = (&res_a, &res_b);
        run(
            "embedding",
            &Op::Embedding,
            &[&ids, &embed],
            &[cur],
            &mut per_op,
        )?;
        for (i, l) in layers.iter().enumerate() {
            if i == 0 {
                run("norm", &norm, &[cur, &l.in_norm], &[&normed], &mut per_op)?;
            } else {
                run(
                    "norm",
                    &add_norm,
                    &[&down, cur, &l.in_norm],
                    &[&normed, nxt],
                    &mut per_op,
                )?;
                std::mem::swap(&mut cur, &mut nxt);
            }
            run("qkv", &matmul, &[&normed, &l.qkv], &[&qkv], &mut per_op)?;
            run(
                "qkv_rope_kv_write",
                &qkv_op,
                &[&qkv, &pos, &slot_t, &l.kc, &l.vc],
                &[&q, &l.kc, &l.vc],
                &mut per_op,
            )?;
            run(
                "attention",
                &attn_op,
                &[&q, &l.kc, &l.vc, &table, &lens],
                &[&attn],
                &mut per_op,
            )?;
            run("o", &matmul, &[&attn, &l.o], &[&o], &mut per_op)?;
            run(
                "norm",
                &add_norm,
                &[&o, cur, &l.post_norm],
                &[&normed, nxt],
                &mut per_op,
            )?;
            std::mem::swap(&mut cur, &mut nxt);
            run(
                "gate_up",
                &matmul,
                &[&normed, &l.gate_up],
                &[&gu],
                &mut per_op,
            )?;
            run("silu_mul", &Op::SiluMul, &[&gu], &[&act], &mut per_op)?;
            run("down", &matmul, &[&act, &l.down], &[&down], &mut per_op)?;
        }
        run(
            "norm",
            &add_norm,
            &[&down, cur, &final_norm],
            &[&normed, nxt],
            &mut per_op,
        )?;
        run(
            "lm_head",
            &lm_head,
            &[&normed, &embed],
            &[&logits],
            &mut per_op,
        )?;
        run("argmax", &Op::Argmax, &[&logits], &[&next], &mut per_op)?;
        if step >= 2 {
            step_times.push(start.elapsed().as_secs_f64());
            for (k, v) in per_op {
                timings.entry(k).or_default().push(v);
            }
        }
    }
    let st_cpu = cpu_per_step(st_cpu, steps);
    let st_best = step_times.iter().cloned().fold(f64::INFINITY, f64::min);
    let st = median(&mut step_times);
    println!(
        "whole step (T={rows}, context {ctx}): median {:.2} ms -> {:.1} tokens/s (best {:.2} ms){st_cpu}",
        st * 1e3,
        rows as f64 / st,
        st_best * 1e3
    );
    for (name, mut v) in timings {
        println!("  {name:<18} {:>8.3} ms", median(&mut v) * 1e3);
    }
    Ok(())
}
