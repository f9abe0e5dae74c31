//! The quantized GEMV and row gather (`kernels/gpu/qgemv.cu`) and the
//! quantized skinny GEMM on tensor cores (`kernels/gpu/qskinny.cu`), lowered
//! by `kiln_kernels::quant_gpu`, on a real GPU: for every storage type, random
//! GGUF blocks (random e4m3 bytes and scales for FP8) at awkward sizes,
//! repacked as the runtime will repack them, against a host reference that
//! decodes the repacked layout (`dequantize_repacked`, bitwise equal to
//! GGUF's own dequantizer: `tests/quant_repack.rs`) and multiplies in f64;
//! poisoned outputs; the same kernels captured once and replayed with new
//! activations every step; the fused entries (`fused_matmul`: the RMSNorm
//! prologue, SiLU/GELU*up and residual epilogues) against the unfused
//! sequence on the host (the tests named `quantized_fused_*`); the
//! integer-dot GEMV (one token through int8 x and dp4a, `qgemv_i8_*`) in the
//! same cases with x's rounding added to the bound; the packed q/k/v GEMV
//! whose last blocks rope the heads (`matmul_qkv_rope`, the `qgemv_i8_*_rope*`
//! entries) bit for bit against the unfused GEMV + `qkv_rope_kv_write`, also
//! under capture and replay; and an ignored benchmark at Llama-3-8B shapes.
//!
//! Every test skips without a CUDA device unless `KILN_REQUIRE_CUDA=1`.
#![cfg(feature = "cuda")]

mod cuda_support;

use cuda_support::*;
use half::bf16;
use kiln_compiler::gguf::dequant::random_blocks;
use kiln_compiler::gguf::types::GgmlType;
use kiln_ir::plan::{BufRef, KernelLaunch, LaunchParam, Region};
use kiln_ir::{DType, Key, Op, TensorType};
use kiln_kernels::quant_gpu::{
    dequantize_repacked, lower_qgather, lower_qgemv_fused_with, lower_qgemv_rope, lower_qgemv_with,
    lower_qskinny_fused, lower_qskinny_with, repack, QAct, QFusion, QGemvBufs, QGemvKernel, QNorm,
    QRope, QdotGeom, QuantType, QDOT_GEOMS, QDOT_TYPES, QSKINNY_PREFETCH, QUANT_TYPES,
};
use kiln_runtime::backend::{
    Backend, DevOperand, DevPtr, Launch, LaunchBody, ResolvedKernel, ResolvedParam,
};
use kiln_runtime::cuda::CudaBackend;

fn gpu() -> Option<CudaBackend> {
    let d = device();
    if d.is_none() {
        assert!(
            std::env::var("KILN_REQUIRE_CUDA").as_deref() != Ok("1"),
            "KILN_REQUIRE_CUDA=1 but no CUDA device is usable"
        );
    }
    d
}

fn ggml(q: QuantType) -> Option<GgmlType> {
    Some(match q {
        QuantType::Q8_0 => GgmlType::Q8_0,
        QuantType::Q4_0 => GgmlType::Q4_0,
        QuantType::Q4_1 => GgmlType::Q4_1,
        QuantType::Q5_0 => GgmlType::Q5_0,
        QuantType::Q4K => GgmlType::Q4K,
        QuantType::Q5K => GgmlType::Q5K,
        QuantType::Q6K => GgmlType::Q6K,
        QuantType::Fp8E4M3 => return None,
    })
}

/// A quantized weight on the device and its host decoding.
struct DevWeight {
    q: QuantType,
    n: u64,
    k: u64,
    w: DevOperand,
    scale: Option<DevOperand>,
    /// `[n, k]` row-major, the repacked layout decoded on the host.
    deq: Vec<f32>,
}

/// Random stored bytes of `q` (GGUF blocks; FP8: non-NaN e4m3 bytes and
/// per-row scales), repacked and uploaded.
fn weight(b: &mut CudaBackend, q: QuantType, n: u64, k: u64, seed: u64) -> DevWeight {
    weight_as(b, q, n, k, seed, true)
}

/// [`weight`], with the host decoding skipped unless `decode`.
fn weight_as(
    b: &mut CudaBackend,
    q: QuantType,
    n: u64,
    k: u64,
    seed: u64,
    decode: bool,
) -> DevWeight {
    let (src, scale) = match ggml(q) {
        Some(t) => (
            random_blocks(t, (n * k / q.block_elems() as u64) as usize, seed),
            None,
        ),
        None => {
            let mut r = Rng::new(seed);
            let bytes: Vec<u8> = (0..n * k)
                .map(|_| {
                    let v = r.next_u64() as u8;
                    if v & 0x7f == 0x7f {
                        v ^ 1
                    } else {
                        v
                    }
                })
                .collect();
            // Scales that keep |w| <= 448 / 512 (FP8 checkpoints' range).
            let s: Vec<f32> = (0..n).map(|_| (1.0 + r.uniform()) / 1024.0).collect();
            (bytes, Some(s))
        }
    };
    let rp = repack(q, &src, n, k).unwrap();
    let deq = if decode {
        dequantize_repacked(q, &rp, scale.as_deref(), n, k).unwrap()
    } else {
        Vec::new()
    };
    let wty = TensorType::new(DType::I32, vec![(rp.len() / 4) as u32]);
    let w = alloc_bytes(b, &rp, wty);
    let scale = scale.map(|s| {
        let bytes: Vec<u8> = s.iter().flat_map(|v| v.to_le_bytes()).collect();
        alloc_bytes(b, &bytes, TensorType::new(DType::F32, vec![n as u32]))
    });
    DevWeight {
        q,
        n,
        k,
        w,
        scale,
        deq,
    }
}

fn alloc_bytes(b: &mut CudaBackend, bytes: &[u8], ty: TensorType) -> DevOperand {
    let p = b
        .alloc(bytes.len() as u64, "test quantized weight")
        .unwrap();
    b.upload(p, bytes).unwrap();
    DevOperand { ptr: p, ty }
}

fn abs(o: &DevOperand) -> BufRef {
    BufRef {
        region: Region::Arena,
        offset: o.ptr.0,
        bytes: o.ty.size_bytes(),
    }
}

fn resolve(k: &KernelLaunch) -> ResolvedKernel {
    ResolvedKernel {
        module: k.module.clone(),
        entry: k.entry.clone(),
        grid: k.grid,
        block: k.block,
        shared_bytes: k.shared_bytes,
        params: k
            .params
            .iter()
            .map(|p| match p {
                LaunchParam::Buf(b) => ResolvedParam::Ptr(DevPtr(b.offset)),
                LaunchParam::Null => ResolvedParam::Ptr(DevPtr(0)),
                LaunchParam::I32(v) => ResolvedParam::I32(*v),
                LaunchParam::I64(v) => ResolvedParam::I64(*v),
                LaunchParam::F32(v) => ResolvedParam::F32(*v),
                LaunchParam::Blob(b) => ResolvedParam::Blob(b.clone()),
            })
            .collect(),
        pdl: k.pdl,
        cluster: k.cluster,
    }
}

/// A launch running `ks` (the op is only a label here: the quantized
/// matmul op is not in the IR yet).
fn launch_of(what: &str, ks: &[KernelLaunch], args: Vec<DevOperand>, out: DevOperand) -> Launch {
    Launch {
        const_args: 0b10,
        body: LaunchBody::Kernels(ks.iter().map(resolve).collect()),
        kernel: format!("test:{what}"),
        op: Op::MatMul {
            bias: false,
            out: out.ty.dtype,
        },
        args,
        results: vec![out],
        workspace: None,
    }
}

/// One GEMV case: operands on the device and the launch over them.
struct Case {
    t: u64,
    out_dtype: DType,
    x: DevOperand,
    bias: Option<(DevOperand, HT)>,
    res: Option<(DevOperand, HT)>,
    out: DevOperand,
    launch: Launch,
    /// The launch quantizes x to int8 (`qgemv_i8`).
    int8_x: bool,
    /// The first kernel's entry point.
    entry: String,
}

/// Which kernel a case runs: the GEMV (`qgemv`), its integer-dot form
/// (`qgemv_i8`, one token of Q4_K, Q6_K, Q8_0) or the tensor-core skinny
/// GEMM (`qskinny`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kern {
    Gemv,
    /// The integer-dot GEMV in one of its geometries.
    GemvI8(QdotGeom),
    Skinny,
    /// The skinny GEMM with the ring type's unit ring of this depth
    /// (eight-token, one-tile launches; others lower as `Skinny`).
    SkinnyRing(u32),
}

impl Kern {
    /// The GEMV kernels a `t`-token case of `q` at `k` runs on.
    fn gemvs(q: QuantType, t: u64, k: u64) -> Vec<Kern> {
        let mut v = vec![Kern::Gemv];
        if QGemvKernel::int8_dot_exists(q, t, k) {
            v.extend(QDOT_GEOMS.into_iter().map(Kern::GemvI8));
        }
        v
    }
}

/// x's rounding under the integer-dot GEMV, as a bound on a product with
/// weight row `w`: each 32-group g of x is off by at most max_g|x| / 254
/// per element (the code's half step; 1% over for the f32 scale's own
/// rounding), times sum_{i in g} |w_i|. `slack` widens each |x| by the
/// normalized values' rounding ambiguity (0 for a plain GEMV).
fn int8_x_bound(x: &[f64], slack: &[f64], w: &[f32]) -> f64 {
    x.chunks(32)
        .zip(slack.chunks(32))
        .zip(w.chunks(32))
        .map(|((xg, sg), wg)| {
            let amax = xg.iter().zip(sg).fold(0f64, |a, (v, s)| a.max(v.abs() + s));
            let wsum: f64 = wg.iter().map(|v| f64::from(v.abs())).sum();
            amax / 254.0 * 1.01 * wsum
        })
        .sum()
}

#[allow(clippy::too_many_arguments)]
fn kernel_case(
    b: &mut CudaBackend,
    r: &mut Rng,
    w: &DevWeight,
    t: u64,
    out_dtype: DType,
    bias: bool,
    residual: bool,
    kern: Kern,
) -> Case {
    let (n, k) = (w.n as u32, w.k as u32);
    let x = put(b, &HT::random(r, DType::BF16, &[t as u32, k], 1.0));
    let bias = bias.then(|| {
        let h = HT::random(r, DType::BF16, &[n], 0.5);
        (put(b, &h), h)
    });
    let res = residual.then(|| {
        let h = HT::random(r, DType::BF16, &[t as u32, n], 2.0);
        (put(b, &h), h)
    });
    let out = poisoned(b, &TensorType::new(out_dtype, vec![t as u32, n]));
    let bufs = QGemvBufs {
        x: abs(&x),
        w: abs(&w.w),
        scale: w.scale.as_ref().map(abs),
        bias: bias.as_ref().map(|(d, _)| abs(d)),
        residual: res.as_ref().map(|(d, _)| abs(d)),
        out: abs(&out),
    };
    let g = |k| lower_qgemv_with(k, w.q, w.n, w.k, t, out_dtype, &bufs, true, b.pdl());
    let ks = match kern {
        Kern::Gemv => g(QGemvKernel::Float),
        Kern::GemvI8(geom) => g(QGemvKernel::Int8DotAt(geom)),
        Kern::Skinny => lower_qskinny_with(w.q, w.n, w.k, t, out_dtype, &bufs, true, b.pdl(), None),
        Kern::SkinnyRing(d) => {
            lower_qskinny_with(w.q, w.n, w.k, t, out_dtype, &bufs, true, b.pdl(), Some(d))
        }
    }
    .unwrap();
    let int8_x = ks[0].entry.starts_with("qgemv_i8_");
    assert_eq!(int8_x, matches!(kern, Kern::GemvI8(_)), "{}", ks[0].entry);
    let mut args = vec![x.clone(), w.w.clone()];
    args.extend(w.scale.clone());
    args.extend(bias.as_ref().map(|(d, _)| d.clone()));
    args.extend(res.as_ref().map(|(d, _)| d.clone()));
    let launch = launch_of(
        if matches!(kern, Kern::Skinny | Kern::SkinnyRing(_)) {
            "qskinny"
        } else {
            "qgemv"
        },
        &ks,
        args,
        out.clone(),
    );
    Case {
        t,
        out_dtype,
        x,
        bias,
        res,
        out,
        launch,
        int8_x,
        entry: ks[0].entry.clone(),
    }
}

/// Checks `got` against the f64 product of `x` and the decoded weight.
/// Bound per element: 2^-8 |want| (bf16 output rounding) + 2^-7 |r1|
/// with a residual (the product's own rounding, which may land on the
/// other neighbour) + 2^-14 sum_k |x w| (f32 accumulation in another
/// order) + 1e-6, plus [`int8_x_bound`] under the integer-dot GEMV.
fn check_gemv(what: &str, w: &DevWeight, c: &Case, x: &HT, got: &HT) {
    let (n, k) = (w.n as usize, w.k as usize);
    let mut worst = 0f64;
    let zeros = vec![0f64; k];
    for t in 0..c.t as usize {
        let xt: Vec<f64> = x.f[t * k..(t + 1) * k]
            .iter()
            .map(|&v| f64::from(v))
            .collect();
        for row in 0..n {
            let (mut acc, mut mag) = (0f64, 0f64);
            for e in 0..k {
                let p = f64::from(x.f[t * k + e]) * f64::from(w.deq[row * k + e]);
                acc += p;
                mag += p.abs();
            }
            if let Some((_, bh)) = &c.bias {
                acc += f64::from(bh.f[row]);
            }
            let mut bound = 2f64.powi(-14) * mag + 1e-6;
            if c.int8_x {
                bound += int8_x_bound(&xt, &zeros, &w.deq[row * k..(row + 1) * k]);
            }
            let want = match &c.res {
                Some((_, rh)) => {
                    // The kernel's f32 sum may round to the bf16
                    // neighbour of the reference's r1: a full ulp, up to
                    // 2^-7 |r1| (measured on the H200: Q8_0 at T = 3 with
                    // a bias and a residual, 1 ulp of r1 plus half an ulp
                    // of the result).
                    let r1 = f64::from(bf16::from_f64(acc).to_f32());
                    bound += 2f64.powi(-7) * r1.abs();
                    r1 + f64::from(rh.f[t * n + row])
                }
                None => acc,
            };
            if c.out_dtype == DType::BF16 {
                bound += 2f64.powi(-8) * want.abs();
            }
            let g = f64::from(got.f[t * n + row]);
            let err = (g - want).abs();
            assert!(
                err <= bound,
                "{what}: y[{t}, {row}] = {g}, want {want} (error {err:.3e} > bound {bound:.3e})"
            );
            worst = worst.max(err / bound);
        }
    }
    eprintln!("{what}: worst error / bound = {worst:.3}");
}

/// `c` launched once, its output checked against the host reference.
fn launch_and_check(b: &mut CudaBackend, w: &DevWeight, c: &Case, what: &str) {
    b.prepare(&c.launch).unwrap();
    b.launch(&c.launch).unwrap();
    b.synchronize().unwrap();
    let x = download(b, &c.x);
    let got = download(b, &c.out);
    check_gemv(what, w, c, &x, &got);
}

/// `c` captured once and replayed four times with new activations (and a
/// poisoned output) each step: every replay matches the host reference on
/// that step's x, and the replay counter moves by four.
fn replay_follows_changing_inputs(
    b: &mut CudaBackend,
    r: &mut Rng,
    w: &DevWeight,
    c: &Case,
    what: &str,
) {
    let (t, k) = (c.t, w.k);
    b.prepare(&c.launch).unwrap();
    b.begin_capture(Key::new(t as u32, 1, 0)).unwrap();
    b.launch(&c.launch).unwrap();
    let graph = b.end_capture().unwrap();
    let before = b.counters().graphs.replays();
    for step in 0..4 {
        let x = HT::random(r, DType::BF16, &[t as u32, k as u32], 1.0 + step as f32);
        b.upload(c.x.ptr, &x.bytes()).unwrap();
        b.upload(c.out.ptr, &vec![0xff; c.out.ty.size_bytes() as usize])
            .unwrap();
        b.replay(graph).unwrap();
        b.synchronize().unwrap();
        let got = download(b, &c.out);
        check_gemv(&format!("{what} replay step {step}"), w, c, &x, &got);
    }
    assert_eq!(b.counters().graphs.replays() - before, 4);
    b.destroy_graph(graph).unwrap();
}

fn download(b: &mut CudaBackend, o: &DevOperand) -> HT {
    get(b, o)
}

/// The K values a type is tested at: one block, several, and a long row.
fn ks(q: QuantType) -> [u64; 3] {
    match q.block_elems() {
        256 => [256, 768, 4096],
        32 => [32, 96, 4128],
        _ => [16, 80, 4112],
    }
}

#[test]
fn quantized_gemv_matches_the_decoded_weight_for_every_type_at_awkward_sizes() {
    let Some(mut b) = gpu() else { return };
    let mut r = Rng::new(21);
    let mut cases = 0;
    for (qi, q) in QUANT_TYPES.into_iter().enumerate() {
        for (ki, k) in ks(q).into_iter().enumerate() {
            // N below one block of rows, not a multiple of 16, and large.
            for n in [5u64, 37, 1000] {
                let w = weight(&mut b, q, n, k, 1000 + 10 * qi as u64 + ki as u64);
                for (ti, t) in [1u64, 3, 8, 11].into_iter().enumerate() {
                    let out = if (ti + ki) % 2 == 0 {
                        DType::BF16
                    } else {
                        DType::F32
                    };
                    let bias = (n + t) % 2 == 1;
                    // The residual at T = 3, and at T = 1 on the
                    // integer-dot kernel's long rows.
                    let residual = out == DType::BF16 && (ti == 1 || (t == 1 && ki == 2));
                    for kern in Kern::gemvs(q, t, k) {
                        let c = kernel_case(&mut b, &mut r, &w, t, out, bias, residual, kern);
                        launch_and_check(&mut b, &w, &c, &format!("{kern:?} {q:?} [{t},{k}]x[{n},{k}]^T -> {out} bias={bias} residual={residual}"));
                        cases += 1;
                    }
                }
            }
        }
    }
    // The integer-dot kernel adds a T = 1 case for Q4_K, Q6_K and Q8_0 in
    // each of its geometries.
    assert_eq!(cases, 8 * 3 * 3 * 4 + 3 * 3 * 3 * QDOT_GEOMS.len());
}

/// Each type's GEMV captured once and replayed with new activations every
/// step (weights fixed, output re-poisoned): each replay matches the host
/// reference on that step's x, and the replay counter moves.
#[test]
fn quantized_gemv_under_capture_and_replay_follows_changing_inputs() {
    let Some(mut b) = gpu() else { return };
    let mut r = Rng::new(22);
    for (qi, q) in QUANT_TYPES.into_iter().enumerate() {
        let (n, k, t) = (1000u64, ks(q)[2], [1u64, 3, 8][qi % 3]);
        // The integer-dot GEMV's types at one token (Q4_K otherwise runs
        // at three).
        let (t, kern) = if QGemvKernel::int8_dot_exists(q, 1, k) {
            (1, Kern::GemvI8(QDOT_GEOMS[qi % QDOT_GEOMS.len()]))
        } else {
            (t, Kern::Gemv)
        };
        let w = weight(&mut b, q, n, k, 2000 + qi as u64);
        let c = kernel_case(&mut b, &mut r, &w, t, DType::BF16, true, false, kern);
        replay_follows_changing_inputs(&mut b, &mut r, &w, &c, &format!("{kern:?} {q:?} t={t}"));
    }
}

/// The tensor-core skinny GEMM against the same f64 reference and bound as
/// the GEMV (its per-group sums are f32 MMA accumulations, the scales applied
/// per group in f32, so it differs from "dequantize, then multiply" by f32
/// reordering only): every type, K at the type's minimum, a few groups and a
/// long row, N below one 16-row tile, not a multiple of 16, and large, T
/// across one, two and four 8-token tiles and over 32 (two launches);
/// outputs poisoned. One case per type at N = 8200 takes the two-tile
/// (32-row) blocks.
#[test]
fn quantized_skinny_gemm_matches_the_decoded_weight_for_every_type_at_awkward_sizes() {
    let Some(mut b) = gpu() else { return };
    let mut r = Rng::new(26);
    let mut cases = 0;
    for (qi, q) in QUANT_TYPES.into_iter().enumerate() {
        let mut shapes: Vec<(u64, u64, Vec<u64>)> = Vec::new();
        for k in ks(q) {
            for n in [5u64, 37, 1000] {
                shapes.push((n, k, vec![2, 3, 8, 9, 17, 32]));
            }
        }
        shapes.push((8200, ks(q)[1], vec![24, 32, 41]));
        for (si, (n, k, ts)) in shapes.into_iter().enumerate() {
            let w = weight(&mut b, q, n, k, 6000 + 20 * qi as u64 + si as u64);
            for (ti, t) in ts.into_iter().enumerate() {
                let out = if (ti + si) % 2 == 0 {
                    DType::BF16
                } else {
                    DType::F32
                };
                let bias = (n + t) % 2 == 1;
                let residual = out == DType::BF16 && ti % 3 == 1;
                let c = kernel_case(&mut b, &mut r, &w, t, out, bias, residual, Kern::Skinny);
                launch_and_check(&mut b, &w, &c, &format!("qskinny {q:?} [{t},{k}]x[{n},{k}]^T -> {out} bias={bias} residual={residual}"));
                cases += 1;
            }
            let _ = b.free(w.w.ptr);
        }
    }
    assert_eq!(cases, 8 * (3 * 3 * 6 + 3));
}

/// The eight-token skinny GEMM of every type with its unit ring (FP8: a
/// ring of registers; the others a ring in shared memory filled by
/// cp.async) at 2, 3 and 4 units per warp in flight (Q5_K and Q6_K capped
/// at 3 where 16 warps' slots would not fit) against the same reference and bound as
/// the plain loop: K at the type's minimum (fewer units than ring slots), a
/// few units and a long row, N below a tile (clamped rows), not a multiple
/// of 16, and large, 2..8 tokens, outputs poisoned; the launch is the ring
/// entry. Then one case per type captured and replayed with new activations
/// every step.
#[test]
fn every_type_s_skinny_gemm_with_a_unit_ring_matches_the_decoded_weight_and_replays() {
    let Some(mut b) = gpu() else { return };
    let mut r = Rng::new(28);
    let mut cases = 0;
    for (qi, q) in QUANT_TYPES.into_iter().enumerate() {
        for (di, d) in QSKINNY_PREFETCH.into_iter().enumerate() {
            for (si, k) in ks(q).into_iter().enumerate() {
                for n in [5u64, 37, 1000] {
                    let seed = 9000 + 1000 * qi as u64 + 100 * di as u64 + 10 * si as u64 + n;
                    let w = weight(&mut b, q, n, k, seed);
                    for t in [2u64, 5, 8] {
                        let out = if (t + n) % 2 == 0 {
                            DType::BF16
                        } else {
                            DType::F32
                        };
                        let bias = t == 5;
                        let residual = out == DType::BF16 && t == 8;
                        let c = kernel_case(
                            &mut b,
                            &mut r,
                            &w,
                            t,
                            out,
                            bias,
                            residual,
                            Kern::SkinnyRing(d),
                        );
                        assert!(c.entry.contains("_t8_r1_pf"), "{}", c.entry);
                        launch_and_check(&mut b, &w, &c, &format!("qskinny ring {d} {q:?} [{t},{k}]x[{n},{k}]^T -> {out} bias={bias} residual={residual}"));
                        cases += 1;
                    }
                    let _ = b.free(w.w.ptr);
                }
            }
        }
        let (n, k, t) = (1000u64, ks(q)[2], 8u64);
        let w = weight(&mut b, q, n, k, 9999 - qi as u64);
        let c = kernel_case(
            &mut b,
            &mut r,
            &w,
            t,
            DType::BF16,
            true,
            false,
            Kern::SkinnyRing(3),
        );
        replay_follows_changing_inputs(&mut b, &mut r, &w, &c, &format!("qskinny ring 3 {q:?}"));
        let _ = b.free(w.w.ptr);
    }
    assert_eq!(cases, 8 * 3 * 3 * 3 * 3);
}

/// Each type's skinny GEMM captured once and replayed with new activations
/// every step: each replay matches the host reference on that step's x, and
/// the replay counter moves.
#[test]
fn quantized_skinny_gemm_under_capture_and_replay_follows_changing_inputs() {
    let Some(mut b) = gpu() else { return };
    let mut r = Rng::new(27);
    for (qi, q) in QUANT_TYPES.into_iter().enumerate() {
        let (n, k, t) = (1000u64, ks(q)[2], [2u64, 9, 32][qi % 3]);
        let w = weight(&mut b, q, n, k, 7000 + qi as u64);
        let c = kernel_case(
            &mut b,
            &mut r,
            &w,
            t,
            DType::BF16,
            true,
            false,
            Kern::Skinny,
        );
        replay_follows_changing_inputs(&mut b, &mut r, &w, &c, &format!("qskinny {q:?} t={t}"));
    }
}

// ------------------------------------------------------------ fused_matmul

/// What a fused case folds into the GEMM (`fused_matmul`'s prologue and
/// epilogue).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fused {
    /// RMSNorm prologue, no epilogue, a bf16 result.
    Norm,
    /// RMSNorm prologue and SiLU*up.
    NormSilu,
    /// Gemma's (1 + w) RMSNorm prologue and GELU-tanh*up.
    NormGeluUnit,
    /// RMSNorm prologue and the residual add.
    NormResidual,
    /// RMSNorm prologue, an f32 result (the final norm + lm_head).
    NormF32,
    /// SiLU*up without a prologue (what keys of 2-8 tokens fuse over
    /// K > 1024).
    Silu,
}

const FUSED: [Fused; 6] = [
    Fused::Norm,
    Fused::NormSilu,
    Fused::NormGeluUnit,
    Fused::NormResidual,
    Fused::NormF32,
    Fused::Silu,
];

impl Fused {
    fn act(self) -> Option<QAct> {
        match self {
            Fused::NormSilu | Fused::Silu => Some(QAct::Silu),
            Fused::NormGeluUnit => Some(QAct::GeluTanh),
            _ => None,
        }
    }
    /// Whether the case has the RMSNorm prologue.
    fn norm(self) -> bool {
        self != Fused::Silu
    }
    fn out(self) -> DType {
        if self == Fused::NormF32 {
            DType::F32
        } else {
            DType::BF16
        }
    }
}

/// The inputs of one fused case on the device and the host.
struct FusedCase {
    t: u64,
    kind: Fused,
    unit_offset: bool,
    eps: f32,
    x: DevOperand,
    norm_w: (DevOperand, HT),
    bias: Option<(DevOperand, HT)>,
    res: Option<(DevOperand, HT)>,
    out: DevOperand,
}

fn fused_case(
    b: &mut CudaBackend,
    r: &mut Rng,
    w: &DevWeight,
    t: u64,
    kind: Fused,
    bias: bool,
) -> FusedCase {
    let (n, k) = (w.n as u32, w.k as u32);
    let unit_offset = kind == Fused::NormGeluUnit;
    // x far from unit RMS (the norm matters), norm weights around 1 (or
    // around 0 under the unit offset, as Gemma stores them).
    let x = put(b, &HT::random(r, DType::BF16, &[t as u32, k], 3.0));
    let nw = HT::floats(
        DType::BF16,
        &[k],
        (0..k)
            .map(|_| {
                let v = r.uniform() * 0.5;
                if unit_offset {
                    v
                } else {
                    1.0 + v
                }
            })
            .collect(),
    );
    let norm_w = (put(b, &nw), nw);
    let bias = bias.then(|| {
        let h = HT::random(r, DType::BF16, &[n], 0.5);
        (put(b, &h), h)
    });
    let res = (kind == Fused::NormResidual).then(|| {
        let h = HT::random(r, DType::BF16, &[t as u32, n], 2.0);
        (put(b, &h), h)
    });
    let out_n = if kind.act().is_some() { n / 2 } else { n };
    let out = poisoned(b, &TensorType::new(kind.out(), vec![t as u32, out_n]));
    FusedCase {
        t,
        kind,
        unit_offset,
        eps: 1e-5,
        x,
        norm_w,
        bias,
        res,
        out,
    }
}

/// The launch of `c` on `kern`'s fused entries.
fn fused_launch(b: &CudaBackend, w: &DevWeight, c: &FusedCase, kern: Kern) -> Launch {
    let bufs = QGemvBufs {
        x: abs(&c.x),
        w: abs(&w.w),
        scale: w.scale.as_ref().map(abs),
        bias: c.bias.as_ref().map(|(d, _)| abs(d)),
        residual: c.res.as_ref().map(|(d, _)| abs(d)),
        out: abs(&c.out),
    };
    let f = QFusion {
        norm: c.kind.norm().then(|| QNorm {
            weight: abs(&c.norm_w.0),
            eps: c.eps,
            unit_offset: c.unit_offset,
        }),
        act: c.kind.act(),
    };
    let (q, n, k, t, od) = (w.q, w.n, w.k, c.t, c.kind.out());
    let g = |kk| lower_qgemv_fused_with(kk, q, n, k, t, od, &bufs, &f, true, b.pdl());
    let ks = match kern {
        Kern::Gemv => g(QGemvKernel::Float),
        Kern::GemvI8(geom) => g(QGemvKernel::Int8DotAt(geom)),
        Kern::Skinny => lower_qskinny_fused(q, n, k, t, od, &bufs, &f, true, b.pdl()),
        Kern::SkinnyRing(_) => unreachable!("the ring has plain entries only"),
    }
    .unwrap();
    for l in &ks {
        assert!(l.entry.contains("_fused_"), "{}", l.entry);
        assert_eq!(l.entry.contains("_norm_"), c.kind.norm(), "{}", l.entry);
    }
    let mut args = vec![c.x.clone(), w.w.clone()];
    args.extend(w.scale.clone());
    args.extend(c.bias.as_ref().map(|(d, _)| d.clone()));
    if c.kind.norm() {
        args.push(c.norm_w.0.clone());
    }
    args.extend(c.res.as_ref().map(|(d, _)| d.clone()));
    launch_of(
        if kern == Kern::Skinny {
            "qskinny_fused"
        } else {
            "qgemv_fused"
        },
        &ks,
        args,
        c.out.clone(),
    )
}

/// Relative error allowed in the device's inverse RMS (f32 sum of squares
/// over up to 4128 terms in another order, sqrt and divide): an element
/// whose normalized value lies this close to a bf16 rounding boundary may
/// round to either neighbour.
const INV_RMS_REL: f64 = 1.0 / 16384.0;

/// The unfused prologue on the host: each row's inverse RMS in f64, the
/// normed rows `bf16(x * inv * w)` (w + 1 in f32 under the unit offset, as
/// the kernels and `cpu::norm` form it), and per element how far the
/// device may land from it (0 unless the value is within
/// [`INV_RMS_REL`] of a rounding boundary: then the other neighbour).
fn host_normed(c: &FusedCase, x: &HT, k: usize) -> (Vec<f64>, Vec<f64>) {
    let nw = &c.norm_w.1;
    let mut xn = vec![0f64; x.f.len()];
    let mut amb = vec![0f64; x.f.len()];
    if !c.kind.norm() {
        // No prologue: the product reads x as stored.
        for (d, &v) in xn.iter_mut().zip(&x.f) {
            *d = f64::from(v);
        }
        return (xn, amb);
    }
    for t in 0..c.t as usize {
        let row = &x.f[t * k..(t + 1) * k];
        let ss: f64 = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let inv = 1.0 / (ss / k as f64 + f64::from(c.eps)).sqrt();
        for e in 0..k {
            let g = if c.unit_offset {
                1.0f32 + nw.f[e]
            } else {
                nw.f[e]
            };
            let v = f64::from(row[e]) * inv * f64::from(g);
            let round = |v: f64| f64::from(bf16::from_f64(v).to_f32());
            let mid = round(v);
            let lo = round(v * (1.0 - INV_RMS_REL));
            let hi = round(v * (1.0 + INV_RMS_REL));
            xn[t * k + e] = mid;
            amb[t * k + e] = (lo - mid).abs().max((hi - mid).abs());
        }
    }
    (xn, amb)
}

/// Checks a fused case against the unfused sequence computed on the host
/// from the decoded weight: the prologue as [`host_normed`], the product in
/// f64, then the epilogue with the unfused ops' rounding points.
///
/// Bound per element, extending [`check_gemv`]'s: each product sum may be
/// off by 2^-14 sum_k |xn w| (f32 accumulation) plus sum_k amb_k |w_k|
/// (normalized elements on a rounding boundary); a sum the unfused
/// sequence rounds to bf16 (y before the residual, g and u before the
/// activation) may land a full ulp (2^-7) away; the activation moves that
/// by at most 1.13 |u| |dg| + |act(g)| |du| + |dg du| (|silu'|, |gelu'| <=
/// 1.13); the result's own bf16 rounding adds 2^-8 |want|. Under the
/// integer-dot GEMV (`kern`) each product also carries [`int8_x_bound`] of
/// the normalized row.
fn check_fused(what: &str, kern: Kern, w: &DevWeight, c: &FusedCase, x: &HT, got: &HT) {
    let (n, k) = (w.n as usize, w.k as usize);
    let (xn, amb) = host_normed(c, x, k);
    let act = c.kind.act();
    let out_n = if act.is_some() { n / 2 } else { n };
    // The product of token t with row `row`, its bias, and its error bound.
    let dot = |t: usize, row: usize| {
        let (mut acc, mut bound) = (0f64, 1e-6);
        let mut mag = 0f64;
        for e in 0..k {
            let wv = f64::from(w.deq[row * k + e]);
            let p = xn[t * k + e] * wv;
            acc += p;
            mag += p.abs();
            bound += amb[t * k + e] * wv.abs();
        }
        if let Some((_, bh)) = &c.bias {
            acc += f64::from(bh.f[row]);
        }
        if matches!(kern, Kern::GemvI8(_)) {
            bound += int8_x_bound(
                &xn[t * k..(t + 1) * k],
                &amb[t * k..(t + 1) * k],
                &w.deq[row * k..(row + 1) * k],
            );
        }
        (acc, bound + 2f64.powi(-14) * mag)
    };
    let rb = |v: f64| f64::from(bf16::from_f64(v).to_f32());
    let mut worst = 0f64;
    for t in 0..c.t as usize {
        for j in 0..out_n {
            let (want, mut bound) = match act {
                Some(a) => {
                    let (ga, gb) = dot(t, j);
                    let (ua, ub) = dot(t, j + out_n);
                    let (g, u) = (rb(ga), rb(ua));
                    let dg = gb + 2f64.powi(-7) * g.abs();
                    let du = ub + 2f64.powi(-7) * u.abs();
                    let f = match a {
                        QAct::Silu => g / (1.0 + (-g).exp()),
                        QAct::GeluTanh => {
                            let k0 = (2.0 / std::f64::consts::PI).sqrt();
                            0.5 * g * (1.0 + (k0 * (g + 0.044715 * g * g * g)).tanh())
                        }
                    };
                    // The activation in f32 (expf / tanhf): a few ulps.
                    let b = 1.13 * u.abs() * dg + f.abs() * du + 1.13 * dg * du;
                    (f * u, b + 2f64.powi(-20) * (f * u).abs())
                }
                None => {
                    let (y, b) = dot(t, j);
                    match &c.res {
                        Some((_, rh)) => {
                            let r1 = rb(y);
                            (
                                r1 + f64::from(rh.f[t * n + j]),
                                b + 2f64.powi(-7) * r1.abs(),
                            )
                        }
                        None => (y, b),
                    }
                }
            };
            if c.kind.out() == DType::BF16 {
                bound += 2f64.powi(-8) * want.abs();
            }
            let g = f64::from(got.f[t * out_n + j]);
            let err = (g - want).abs();
            assert!(
                err <= bound,
                "{what}: y[{t}, {j}] = {g}, want {want} (error {err:.3e} > bound {bound:.3e})"
            );
            worst = worst.max(err / bound);
        }
    }
    eprintln!("{what}: worst error / bound = {worst:.3}");
}

/// Both kernels' fused entries (the RMSNorm prologue, plain and Gemma's
/// (1 + w), with no epilogue, SiLU*up, GELU-tanh*up, the residual add and
/// an f32 result; and SiLU*up without the prologue) for every type, at T = 1, 3, 8, 17 and 32 (the GEMV at up
/// to 17 tokens, its 8-token loop included; the tensor-core GEMM from 3 on
/// sm_80+), K a few blocks and a long row, N not a multiple of 16 (37
/// outputs under the activations) and large; outputs poisoned; against the
/// unfused sequence on the host ([`check_fused`]). The reference is not
/// the CPU backend's `fused_matmul`: its quantized matmul rounds x to int8
/// (`cpu::qmatmul`), an error far above the GPU kernels' bound; the host
/// sequence here has the CPU backend's rounding points and the decoded
/// weight exactly.
#[test]
fn quantized_fused_gemms_match_the_unfused_sequence_for_every_type_prologue_and_epilogue() {
    let Some(mut b) = gpu() else { return };
    let tensor_cores = b.sm() >= 80;
    let mut r = Rng::new(31);
    let mut cases = 0;
    for (qi, q) in QUANT_TYPES.into_iter().enumerate() {
        for (si, (n, k)) in [(74u64, ks(q)[1]), (600, ks(q)[2])].into_iter().enumerate() {
            let w = weight(&mut b, q, n, k, 8000 + 10 * qi as u64 + si as u64);
            for (fi, kind) in FUSED.into_iter().enumerate() {
                for t in [1u64, 3, 8, 17, 32] {
                    let bias = (t as usize + fi + si) % 2 == 1;
                    let c = fused_case(&mut b, &mut r, &w, t, kind, bias);
                    let mut kerns = Vec::new();
                    if t <= 17 {
                        kerns.extend(Kern::gemvs(q, t, k));
                    }
                    if t >= 3 && tensor_cores {
                        kerns.push(Kern::Skinny);
                    }
                    for kern in kerns {
                        let l = fused_launch(&b, &w, &c, kern);
                        b.upload(c.out.ptr, &vec![0xff; c.out.ty.size_bytes() as usize])
                            .unwrap();
                        b.prepare(&l).unwrap();
                        b.launch(&l).unwrap();
                        b.synchronize().unwrap();
                        let x = download(&mut b, &c.x);
                        let got = download(&mut b, &c.out);
                        check_fused(
                            &format!(
                                "fused {kern:?} {q:?} {kind:?} [{t},{k}]x[{n},{k}]^T bias={bias}"
                            ),
                            kern,
                            &w,
                            &c,
                            &x,
                            &got,
                        );
                        cases += 1;
                    }
                    for d in [Some(&c.x), Some(&c.norm_w.0), Some(&c.out)]
                        .into_iter()
                        .chain([c.bias.as_ref().map(|p| &p.0), c.res.as_ref().map(|p| &p.0)])
                        .flatten()
                    {
                        let _ = b.free(d.ptr);
                    }
                }
            }
            let _ = b.free(w.w.ptr);
        }
    }
    let per_shape = if tensor_cores { 4 + 4 } else { 4 };
    // The integer-dot kernel adds the T = 1 case of Q4_K, Q6_K and Q8_0 in
    // each of its geometries.
    assert_eq!(
        cases,
        8 * 2 * FUSED.len() * per_shape + 3 * 2 * FUSED.len() * QDOT_GEOMS.len()
    );
}

/// Each type's fused GEMM (norm + SiLU*up; the GEMV at one token, the
/// tensor-core GEMM above where it applies) captured once and replayed
/// with a new x and a new norm weight every step: each replay matches the
/// host reference on that step's inputs, and the replay counter moves.
#[test]
fn quantized_fused_gemms_under_capture_and_replay_follow_changing_inputs() {
    let Some(mut b) = gpu() else { return };
    let tensor_cores = b.sm() >= 80;
    let mut r = Rng::new(32);
    for (qi, q) in QUANT_TYPES.into_iter().enumerate() {
        let (n, k, t) = (1000u64, ks(q)[2], [1u64, 9, 32][qi % 3]);
        let kern = if t >= 2 && tensor_cores {
            Kern::Skinny
        } else if QGemvKernel::int8_dot_exists(q, t, k) {
            Kern::GemvI8(QDOT_GEOMS[(qi + 1) % QDOT_GEOMS.len()])
        } else {
            Kern::Gemv
        };
        let w = weight(&mut b, q, n, k, 9000 + qi as u64);
        let mut c = fused_case(&mut b, &mut r, &w, t, Fused::NormSilu, true);
        let l = fused_launch(&b, &w, &c, kern);
        b.prepare(&l).unwrap();
        b.begin_capture(Key::new(t as u32, 1, 0)).unwrap();
        b.launch(&l).unwrap();
        let graph = b.end_capture().unwrap();
        let before = b.counters().graphs.replays();
        for step in 0..4 {
            let x = HT::random(
                &mut r,
                DType::BF16,
                &[t as u32, k as u32],
                1.0 + step as f32,
            );
            b.upload(c.x.ptr, &x.bytes()).unwrap();
            let nw = HT::random(&mut r, DType::BF16, &[k as u32], 2.0);
            b.upload(c.norm_w.0.ptr, &nw.bytes()).unwrap();
            c.norm_w.1 = nw;
            b.upload(c.out.ptr, &vec![0xff; c.out.ty.size_bytes() as usize])
                .unwrap();
            b.replay(graph).unwrap();
            b.synchronize().unwrap();
            let got = download(&mut b, &c.out);
            check_fused(
                &format!("fused {kern:?} {q:?} replay step {step} t={t}"),
                kern,
                &w,
                &c,
                &x,
                &got,
            );
        }
        assert_eq!(b.counters().graphs.replays() - before, 4);
        b.destroy_graph(graph).unwrap();
    }
}

fn gather_launch(
    b: &mut CudaBackend,
    w: &DevWeight,
    ids: &[i32],
) -> (Launch, DevOperand, DevOperand) {
    let idh = HT::ints(&[ids.len() as u32], ids.to_vec());
    let dids = put(b, &idh);
    let out = poisoned(
        b,
        &TensorType::new(DType::BF16, vec![ids.len() as u32, w.k as u32]),
    );
    let l = lower_qgather(
        w.q,
        w.n,
        w.k,
        ids.len() as u64,
        abs(&dids),
        abs(&w.w),
        w.scale.as_ref().map(abs),
        abs(&out),
        b.pdl(),
    )
    .unwrap();
    let mut args = vec![dids.clone(), w.w.clone()];
    args.extend(w.scale.clone());
    (launch_of("qgather", &[l], args, out.clone()), dids, out)
}

/// The gather is exact: each element equals the bf16 rounding of the
/// decoded weight, and ids outside the table give zero rows.
fn check_gather(what: &str, w: &DevWeight, ids: &[i32], got: &HT) {
    let k = w.k as usize;
    for (t, &id) in ids.iter().enumerate() {
        for e in 0..k {
            let want = if id >= 0 && (id as u64) < w.n {
                bf16::from_f32(w.deq[id as usize * k + e]).to_f32()
            } else {
                0.0
            };
            let g = got.f[t * k + e];
            assert!(
                g == want,
                "{what}: out[{t}, {e}] (id {id}) = {g}, want {want}"
            );
        }
    }
}

#[test]
fn quantized_gather_returns_each_ids_row_exactly_and_zeroes_out_of_range_ids() {
    let Some(mut b) = gpu() else { return };
    let mut r = Rng::new(23);
    for (qi, q) in QUANT_TYPES.into_iter().enumerate() {
        for k in ks(q) {
            let n = 300u64;
            let w = weight(&mut b, q, n, k, 3000 + qi as u64 + k);
            let ids = [0, 299, r.below(300) as i32, -1, 300, r.below(300) as i32];
            let (l, _, out) = gather_launch(&mut b, &w, &ids);
            b.prepare(&l).unwrap();
            b.launch(&l).unwrap();
            b.synchronize().unwrap();
            check_gather(&format!("{q:?} k={k}"), &w, &ids, &download(&mut b, &out));
        }
    }
}

#[test]
fn quantized_gather_under_capture_and_replay_follows_changing_ids() {
    let Some(mut b) = gpu() else { return };
    let mut r = Rng::new(24);
    for (qi, q) in QUANT_TYPES.into_iter().enumerate() {
        let (n, k) = (5000u64, ks(q)[2]);
        let w = weight(&mut b, q, n, k, 4000 + qi as u64);
        let (l, dids, out) = gather_launch(&mut b, &w, &[0, 0, 0]);
        b.prepare(&l).unwrap();
        b.begin_capture(Key::new(3, 1, 0)).unwrap();
        b.launch(&l).unwrap();
        let graph = b.end_capture().unwrap();
        let before = b.counters().graphs.replays();
        for step in 0..4 {
            let ids: Vec<i32> = (0..3).map(|_| r.below(n as u32) as i32).collect();
            b.upload(dids.ptr, &HT::ints(&[3], ids.clone()).bytes())
                .unwrap();
            b.upload(out.ptr, &vec![0xff; out.ty.size_bytes() as usize])
                .unwrap();
            b.replay(graph).unwrap();
            b.synchronize().unwrap();
            check_gather(
                &format!("{q:?} replay step {step}"),
                &w,
                &ids,
                &download(&mut b, &out),
            );
        }
        assert_eq!(b.counters().graphs.replays() - before, 4);
        b.destroy_graph(graph).unwrap();
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Prints each type's GEMV (T = 1 and 8) and skinny GEMM (T = 8 and 32) at
/// Llama-3-8B's projection shapes (the aim: qskinny at T = 8 within
/// 1.2x of the GEMV at T = 1):
/// one CUDA graph of 20 launches (cycling through enough weight copies to
/// exceed the 60 MB L2, so every launch streams from HBM), replayed 15
/// times, each replay timed with CUDA events; the median per launch as
/// GB/s of weight bytes (the repacked buffer) and the share of 4.8 TB/s.
#[test]
#[ignore = "benchmark: run on the GPU machine"]
fn bench_quantized_gemv_on_llama3_8b_shapes() {
    let Some(mut b) = gpu() else { return };
    let mut r = Rng::new(25);
    println!("type   shape(NxK)     T kernel  us/launch  weight GB/s  of 4.8 TB/s");
    for q in QUANT_TYPES {
        for (n, k) in [(4096u64, 4096u64), (14336, 4096), (4096, 14336)] {
            let wbytes = kiln_kernels::quant_gpu::repacked_bytes(q, n, k).unwrap();
            let copies = (256 << 20) / wbytes + 1;
            let ws: Vec<DevWeight> = (0..copies)
                .map(|i| weight_as(&mut b, q, n, k, 5000 + i, false))
                .collect();
            for (t, kern) in [
                (1u64, Kern::Gemv),
                (8, Kern::Gemv),
                (8, Kern::Skinny),
                (32, Kern::Skinny),
            ] {
                let cs: Vec<Case> = ws
                    .iter()
                    .map(|w| kernel_case(&mut b, &mut r, w, t, DType::BF16, false, false, kern))
                    .collect();
                for c in &cs {
                    b.prepare(&c.launch).unwrap();
                    b.launch(&c.launch).unwrap();
                }
                let per_graph = 20usize;
                b.begin_capture(Key::new(t as u32, 1, 0)).unwrap();
                for i in 0..per_graph {
                    b.launch(&cs[i % cs.len()].launch).unwrap();
                }
                let graph = b.end_capture().unwrap();
                b.replay(graph).unwrap();
                let mut times = Vec::new();
                for _ in 0..15 {
                    let from = b.mark().unwrap();
                    b.replay(graph).unwrap();
                    let to = b.mark().unwrap();
                    times.push(f64::from(b.elapsed_ms(from, to).unwrap()) * 1e3 / per_graph as f64);
                }
                b.destroy_graph(graph).unwrap();
                let us = median(times);
                let gbs = wbytes as f64 / (us * 1e-6) / 1e9;
                println!(
                    "{:<6} {:>5}x{:<6} {t:>2} {kern:<6?} {us:>10.2} {gbs:>12.0} {:>10.0}%",
                    kiln_kernels::quant_gpu::stem(q),
                    n,
                    k,
                    gbs / 4800.0 * 100.0
                );
                for c in cs {
                    let _ = b.free(c.x.ptr);
                    let _ = b.free(c.out.ptr);
                }
            }
            for w in ws {
                let _ = b.free(w.w.ptr);
                if let Some(s) = w.scale {
                    let _ = b.free(s.ptr);
                }
            }
        }
    }
}

/// One `matmul_qkv_rope` case on the device: the GEMV's operands, the rope
/// tail's, and the unfused pair's own copies of the caches.
struct RopeCase {
    heads: u32,
    kvh: u32,
    hd: u32,
    norm: bool,
    qk_norm: bool,
    unit_offset: bool,
    x: DevOperand,
    norm_w: DevOperand,
    bias: Option<DevOperand>,
    /// pos, slots, kc, vc, q_norm, k_norm as host tensors (the unfused
    /// qkv_rope_kv_write's arguments after qkv).
    host: Vec<HT>,
    pos: DevOperand,
    slots: DevOperand,
    kc: DevOperand,
    vc: DevOperand,
    qn: DevOperand,
    kn: DevOperand,
    q_out: DevOperand,
    scratch: DevOperand,
    counters: DevOperand,
}

const ROPE_SLOTS: u32 = 9;

#[allow(clippy::too_many_arguments)]
fn rope_case(
    b: &mut CudaBackend,
    r: &mut Rng,
    (heads, kvh, hd): (u32, u32, u32),
    k: u64,
    norm: bool,
    qk_norm: bool,
    bias: bool,
    slot: i32,
) -> RopeCase {
    let n = (heads + 2 * kvh) * hd;
    let unit_offset = qk_norm && hd % 128 == 64;
    let x = put(b, &HT::random(r, DType::BF16, &[1, k as u32], 3.0));
    let nw: Vec<f32> = (0..k).map(|_| 1.0 + r.uniform() * 0.5).collect();
    let norm_w = put(b, &HT::floats(DType::BF16, &[k as u32], nw));
    let bias = bias.then(|| put(b, &HT::random(r, DType::BF16, &[n], 0.5)));
    let row = kvh * hd;
    let host = vec![
        HT::ints(&[1], vec![(r.next_u64() % 4000) as i32]),
        HT::ints(&[1], vec![slot]),
        HT::random(r, DType::BF16, &[ROPE_SLOTS, row], 1.0),
        HT::random(r, DType::BF16, &[ROPE_SLOTS, row], 1.0),
        HT::random(r, DType::BF16, &[hd], 1.0),
        HT::random(r, DType::BF16, &[hd], 1.0),
    ];
    let dev: Vec<DevOperand> = host.iter().map(|h| put(b, h)).collect();
    let q_out = poisoned(b, &TensorType::new(DType::BF16, vec![1, heads * hd]));
    let scratch = poisoned(b, &TensorType::new(DType::BF16, vec![1, n]));
    let units = heads + 2 * kvh;
    let counters = put(b, &HT::ints(&[units], vec![0; units as usize]));
    RopeCase {
        heads,
        kvh,
        hd,
        norm,
        qk_norm,
        unit_offset,
        x,
        norm_w,
        bias,
        host,
        pos: dev[0].clone(),
        slots: dev[1].clone(),
        kc: dev[2].clone(),
        vc: dev[3].clone(),
        qn: dev[4].clone(),
        kn: dev[5].clone(),
        q_out,
        scratch,
        counters,
    }
}

fn rope_op_of(c: &RopeCase) -> Op {
    Op::QkvRopeKvWrite {
        heads: c.heads,
        kv_heads: c.kvh,
        head_dim: c.hd,
        rope: kiln_ir::Rope {
            theta: 10000.0,
            scaling: kiln_ir::RopeScaling::None,
        },
        qk_norm: c.qk_norm.then_some(1e-6),
        unit_offset: c.unit_offset,
    }
}

fn rope_bufs(w: &DevWeight, c: &RopeCase, out: &DevOperand) -> (QGemvBufs, Option<QNorm>) {
    (
        QGemvBufs {
            x: abs(&c.x),
            w: abs(&w.w),
            scale: None,
            bias: c.bias.as_ref().map(abs),
            residual: None,
            out: abs(out),
        },
        c.norm.then(|| QNorm {
            weight: abs(&c.norm_w),
            eps: 1e-5,
            unit_offset: false,
        }),
    )
}

/// The fused launch of `c` in geometry `geom`.
fn rope_launch(b: &CudaBackend, w: &DevWeight, c: &RopeCase, geom: QdotGeom) -> Launch {
    let (bufs, norm) = rope_bufs(w, c, &c.scratch);
    let Op::QkvRopeKvWrite { rope, .. } = rope_op_of(c) else {
        unreachable!()
    };
    let rope_args = QRope {
        pos: abs(&c.pos),
        slots: abs(&c.slots),
        kc: abs(&c.kc),
        vc: abs(&c.vc),
        norms: c.qk_norm.then(|| (abs(&c.qn), abs(&c.kn), 1e-6)),
        unit_offset: c.unit_offset,
        q_out: abs(&c.q_out),
        counters: abs(&c.counters),
        heads: c.heads,
        kv_heads: c.kvh,
        head_dim: c.hd,
        num_slots: u64::from(ROPE_SLOTS),
        freqs: kiln_kernels::gpu::rope_freqs_blob(&rope, c.hd),
    };
    let l = lower_qgemv_rope(
        QGemvKernel::Int8DotAt(geom),
        w.q,
        (w.n, w.k),
        &bufs,
        norm,
        &rope_args,
        true,
        b.pdl(),
    )
    .unwrap();
    assert!(l.entry.contains("_rope"), "{}", l.entry);
    assert_eq!(l.entry.contains("_rope_norm_"), c.norm, "{}", l.entry);
    let mut args = vec![c.x.clone(), w.w.clone()];
    args.extend(c.bias.clone());
    args.extend([
        c.norm_w.clone(),
        c.pos.clone(),
        c.slots.clone(),
        c.kc.clone(),
    ]);
    args.extend([c.vc.clone(), c.qn.clone(), c.kn.clone(), c.counters.clone()]);
    let mut launch = launch_of("qgemv_rope", &[l], args, c.q_out.clone());
    launch
        .results
        .extend([c.scratch.clone(), c.kc.clone(), c.vc.clone()]);
    launch
}

/// The unfused pair on the device: the integer-dot GEMV (same geometry)
/// into a fresh qkv buffer, then `qkv_rope_kv_write` on the host copies of
/// pos, slots, caches and norms. Returns (q, k cache, v cache).
fn rope_unfused(b: &mut CudaBackend, w: &DevWeight, c: &RopeCase, geom: QdotGeom) -> Vec<HT> {
    let qkv = poisoned(b, &TensorType::new(DType::BF16, vec![1, w.n as u32]));
    let (bufs, norm) = rope_bufs(w, c, &qkv);
    let f = QFusion { norm, act: None };
    let kern = QGemvKernel::Int8DotAt(geom);
    let ks = lower_qgemv_fused_with(
        kern,
        w.q,
        w.n,
        w.k,
        1,
        DType::BF16,
        &bufs,
        &f,
        true,
        b.pdl(),
    )
    .unwrap();
    let l = launch_of("qgemv_i8", &ks, vec![c.x.clone(), w.w.clone()], qkv.clone());
    b.prepare(&l).unwrap();
    b.launch(&l).unwrap();
    b.synchronize().unwrap();
    let mut args = vec![download(b, &qkv)];
    let _ = b.free(qkv.ptr);
    args.extend(c.host[..4].iter().cloned());
    if c.qk_norm {
        args.extend(c.host[4..].iter().cloned());
    }
    run_op(b, &rope_op_of(c), &args)
}

fn rope_free(b: &mut CudaBackend, c: RopeCase) {
    for d in [
        c.x, c.norm_w, c.pos, c.slots, c.kc, c.vc, c.qn, c.kn, c.q_out,
    ]
    .into_iter()
    .chain([c.scratch, c.counters])
    .chain(c.bias)
    {
        let _ = b.free(d.ptr);
    }
}

/// Runs the fused launch and compares it with the unfused pair bit for
/// bit: the roped q, both caches (the new row at the slot, every other row
/// untouched), and the completion counters back at zero.
fn check_rope(
    b: &mut CudaBackend,
    what: &str,
    w: &DevWeight,
    c: &RopeCase,
    l: &Launch,
    want: &[HT],
) {
    let got_q = download(b, &c.q_out);
    assert_eq!(
        got_q.bytes(),
        want[0].bytes(),
        "{what}: q differs from the unfused pair's"
    );
    let kc = download(b, &c.kc);
    let vc = download(b, &c.vc);
    assert_eq!(kc.bytes(), want[1].bytes(), "{what}: k cache differs");
    assert_eq!(vc.bytes(), want[2].bytes(), "{what}: v cache differs");
    let counters = download(b, &c.counters);
    assert!(
        counters.i.iter().all(|&v| v == 0),
        "{what}: completion counters not reset: {:?}",
        counters.i
    );
    let _ = (w, l);
}

/// The packed q/k/v GEMV with the rope tail (`qgemv_i8<geometry>_rope*`,
/// what `matmul_qkv_rope` lowers to) against the unfused integer-dot GEMV
/// followed by `qkv_rope_kv_write`, bit for bit, for each integer-dot type, every
/// geometry, head layouts where a block covers part of a head, one head,
/// and several heads (head_dim 128, 64, 256, 16), with and without the
/// RMSNorm prologue, q/k norm (Gemma's unit offset too), bias, and a slot
/// out of range (the caches untouched, q still written); q poisoned.
#[test]
fn qkv_gemv_with_the_rope_tail_matches_the_unfused_pair_bit_for_bit() {
    let Some(mut b) = gpu() else { return };
    let mut r = Rng::new(41);
    let layouts = [(16u32, 8u32, 128u32), (8, 2, 64), (4, 1, 256), (6, 3, 16)];
    let mut cases = 0;
    for (qi, q) in QDOT_TYPES.into_iter().enumerate() {
        for (li, &(heads, kvh, hd)) in layouts.iter().enumerate() {
            let k = ks(q)[1 + (li % 2)];
            let n = u64::from((heads + 2 * kvh) * hd);
            let w = weight_as(&mut b, q, n, k, 7100 + 10 * qi as u64 + li as u64, false);
            for (gi, geom) in QDOT_GEOMS.into_iter().enumerate() {
                let v = qi + li + gi;
                let norm = v % 2 == 0;
                let qk_norm = v % 3 != 0;
                let bias = v % 4 == 1;
                let slot = if v % 5 == 4 {
                    ROPE_SLOTS as i32 + 2
                } else {
                    (v % 9) as i32
                };
                let c = rope_case(
                    &mut b,
                    &mut r,
                    (heads, kvh, hd),
                    k,
                    norm,
                    qk_norm,
                    bias,
                    slot,
                );
                let what = format!(
                    "{q:?} {geom:?} {heads}/{kvh}x{hd} k={k} norm={norm} qk_norm={qk_norm} bias={bias} slot={slot}"
                );
                let want = rope_unfused(&mut b, &w, &c, geom);
                let l = rope_launch(&b, &w, &c, geom);
                b.prepare(&l).unwrap();
                b.launch(&l).unwrap();
                b.synchronize().unwrap();
                check_rope(&mut b, &what, &w, &c, &l, &want);
                if (0..ROPE_SLOTS as i32).contains(&slot) {
                    assert_ne!(want[1].bytes(), c.host[2].bytes(), "{what}: no key written");
                }
                rope_free(&mut b, c);
                cases += 1;
            }
            let _ = b.free(w.w.ptr);
        }
    }
    assert_eq!(cases, QDOT_TYPES.len() * 4 * QDOT_GEOMS.len());
}

/// The rope GEMV captured once and replayed with a new x, position and
/// slot every step (and fresh poison in q): each replay equals the unfused
/// pair on that step's inputs, so the completion counters are back at zero
/// for every replay, and the replay counter moves. With the q/k norm (the
/// counted tail) and without it (the pair epilogue).
#[test]
fn qkv_gemv_with_the_rope_tail_replays_what_the_unfused_pair_computes() {
    let Some(mut b) = gpu() else { return };
    let mut r = Rng::new(42);
    let (heads, kvh, hd) = (16u32, 8u32, 128u32);
    let q = QuantType::Q4K;
    let k = 1024u64;
    let n = u64::from((heads + 2 * kvh) * hd);
    let w = weight_as(&mut b, q, n, k, 7300, false);
    let geom = QdotGeom::R4U1K1P;
    for qk_norm in [true, false] {
        let mut c = rope_case(&mut b, &mut r, (heads, kvh, hd), k, true, qk_norm, false, 0);
        let l = rope_launch(&b, &w, &c, geom);
        b.prepare(&l).unwrap();
        b.begin_capture(Key::new(1, 1, 0)).unwrap();
        b.launch(&l).unwrap();
        let graph = b.end_capture().unwrap();
        let before = b.counters().graphs.replays();
        for step in 0..5 {
            let x = HT::random(&mut r, DType::BF16, &[1, k as u32], 1.0 + step as f32);
            b.upload(c.x.ptr, &x.bytes()).unwrap();
            c.host[0] = HT::ints(&[1], vec![100 + 7 * step]);
            c.host[1] = HT::ints(&[1], vec![step % ROPE_SLOTS as i32]);
            b.upload(c.pos.ptr, &c.host[0].bytes()).unwrap();
            b.upload(c.slots.ptr, &c.host[1].bytes()).unwrap();
            b.upload(c.q_out.ptr, &vec![0xff; c.q_out.ty.size_bytes() as usize])
                .unwrap();
            let want = rope_unfused(&mut b, &w, &c, geom);
            b.replay(graph).unwrap();
            b.synchronize().unwrap();
            let what = format!("qk_norm={qk_norm} replay step {step}");
            check_rope(&mut b, &what, &w, &c, &l, &want);
            c.host[2] = want[1].clone();
            c.host[3] = want[2].clone();
        }
        assert_eq!(b.counters().graphs.replays() - before, 5);
        b.destroy_graph(graph).unwrap();
        rope_free(&mut b, c);
    }
    let _ = b.free(w.w.ptr);
}
