//! The CUDA backend on a real GPU: every kernel against the host reference
//! (and the shared CPU reference kernels once they exist) on random inputs
//! at awkward sizes with poisoned outputs, GEMMs through cuBLASLt, the
//! capture contract, replay against eager with changing inputs, teardown.
//!
//! Every test skips with a message when no CUDA device is present; on the
//! GPU machine `scripts/gpu-check.sh` runs this binary.
#![cfg(feature = "cuda")]

mod cuda_support;

use cuda_support::*;
use kiln_ir::plan::GemmKind;
use kiln_ir::{AttnAttrs, DType, Key, Op, Rope, RopeScaling, TensorType};
use kiln_runtime::backend::{Backend, BackendError, DevOperand, Launch};
use kiln_runtime::cuda::{CudaBackend, GemmChoice};

/// GPU milliseconds `f` takes on the stream, from two timing marks.
fn time_ms(
    b: &mut CudaBackend,
    f: impl FnOnce(&mut CudaBackend) -> Result<(), BackendError>,
) -> Result<f32, BackendError> {
    let from = b.mark()?;
    f(b)?;
    let to = b.mark()?;
    b.elapsed_ms(from, to)
}

fn check_op(b: &mut CudaBackend, what: &str, op: &Op, args: &[HT]) {
    let tys: Vec<TensorType> = args.iter().map(|a| a.ty.clone()).collect();
    let rtys = op.infer(&tys).unwrap();
    let got = run_op(b, op, args);
    let want = reference(op, args, &rtys);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_close(&format!("{what} result {i} vs host reference"), g, w);
    }
    if let Some(cpu) = cpu_reference(op, args) {
        for (i, (g, w)) in got.iter().zip(&cpu).enumerate() {
            assert_close(&format!("{what} result {i} vs CPU kernels"), g, w);
        }
    }
}

fn rope(theta: f32) -> Rope {
    Rope {
        theta,
        scaling: RopeScaling::None,
    }
}

#[test]
fn embedding_gathers_rows_and_zeroes_out_of_range_ids() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(1);
    for d in [DType::BF16, DType::F32] {
        let table = HT::random(&mut r, d, &[1000, 576], 1.0);
        let ids = HT::ints(&[6], vec![0, 999, 17, 17, 512, 3]);
        check_op(&mut b, "embedding", &Op::Embedding, &[ids, table]);
    }
}

#[test]
fn rms_norm_and_add_rms_norm_match_the_reference_at_awkward_widths() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(2);
    for (d, t, h, unit) in [
        (DType::BF16, 3, 1000, false),
        (DType::BF16, 5, 1027, true),
        (DType::F16, 2, 576, false),
        (DType::F32, 4, 4097, false),
    ] {
        let x = HT::random(&mut r, d, &[t, h], 3.0);
        let w = HT::random(&mut r, d, &[h], 1.0);
        let op = Op::RmsNorm {
            eps: 1e-6,
            unit_offset: unit,
        };
        check_op(
            &mut b,
            &format!("rms_norm {d} {t}x{h}"),
            &op,
            &[x.clone(), w.clone()],
        );
        let res = HT::random(&mut r, d, &[t, h], 3.0);
        let op = Op::AddRmsNorm {
            eps: 1e-5,
            unit_offset: unit,
        };
        check_op(
            &mut b,
            &format!("add_rms_norm {d} {t}x{h}"),
            &op,
            &[x, res, w],
        );
    }
}

#[test]
fn head_rms_norm_normalizes_each_head_slice() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(3);
    for (heads, hd) in [(5, 128), (3, 72), (2, 256)] {
        let x = HT::random(&mut r, DType::BF16, &[3, heads * hd], 2.0);
        let w = HT::random(&mut r, DType::BF16, &[hd], 1.0);
        let op = Op::HeadRmsNorm {
            heads,
            head_dim: hd,
            eps: 1e-6,
            unit_offset: false,
        };
        check_op(&mut b, &format!("head_rms_norm {heads}x{hd}"), &op, &[x, w]);
    }
}

#[test]
fn rope_rotates_halves_at_each_tokens_position() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(4);
    let llama3 = Rope {
        theta: 500000.0,
        scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        },
    };
    for (heads, hd, rp) in [(3, 64, rope(10000.0)), (2, 128, llama3), (1, 8, rope(1e6))] {
        let x = HT::random(&mut r, DType::BF16, &[4, heads * hd], 1.0);
        let pos = HT::ints(&[4], vec![0, 1, 4097, r.below(30000) as i32]);
        let op = Op::Rope {
            heads,
            head_dim: hd,
            rope: rp,
        };
        check_op(&mut b, &format!("rope {heads}x{hd}"), &op, &[x, pos]);
    }
}

#[test]
fn kv_write_puts_each_row_in_its_slot_and_leaves_the_rest() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(5);
    let row = 2 * 72;
    let k = HT::random(&mut r, DType::BF16, &[5, row], 1.0);
    let v = HT::random(&mut r, DType::BF16, &[5, row], 1.0);
    let slots = HT::ints(&[5], vec![99, 0, 41, 42, 7]);
    let kc = HT::random(&mut r, DType::BF16, &[100, row], 1.0);
    let vc = HT::random(&mut r, DType::BF16, &[100, row], 1.0);
    check_op(&mut b, "kv_write", &Op::KvWrite, &[k, v, slots, kc, vc]);
}

#[test]
fn fused_qkv_rope_kv_write_matches_with_and_without_qk_norm() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(6);
    for (heads, kvh, hd, norm) in [
        (4, 2, 128, Some(1e-6)),
        (3, 1, 64, None),
        (2, 2, 256, Some(1e-5)),
    ] {
        let t = 3;
        let qkv = HT::random(&mut r, DType::BF16, &[t, (heads + 2 * kvh) * hd], 2.0);
        let pos = HT::ints(&[t], vec![5, 300, r.below(9000) as i32]);
        let slots = HT::ints(&[t], vec![63, 2, 30]);
        let kc = HT::random(&mut r, DType::BF16, &[64, kvh * hd], 1.0);
        let vc = HT::random(&mut r, DType::BF16, &[64, kvh * hd], 1.0);
        let mut args = vec![qkv, pos, slots, kc, vc];
        if norm.is_some() {
            args.push(HT::random(&mut r, DType::BF16, &[hd], 1.0));
            args.push(HT::random(&mut r, DType::BF16, &[hd], 1.0));
        }
        let op = Op::QkvRopeKvWrite {
            heads,
            kv_heads: kvh,
            head_dim: hd,
            rope: rope(1e6),
            qk_norm: norm,
            unit_offset: false,
        };
        check_op(
            &mut b,
            &format!("qkv_rope_kv_write {heads}/{kvh}x{hd}"),
            &op,
            &args,
        );
    }
}

/// Builds paged-attention inputs: `ctx` per sequence, block tables over a
/// shuffled set of physical blocks (block 0 reserved), random caches.
#[allow(clippy::too_many_arguments)]
fn attention_case(
    r: &mut Rng,
    d: DType,
    ctx: &[i32],
    query: u32,
    heads: u32,
    kvh: u32,
    hd: u32,
    bs: u32,
    max_blocks: u32,
) -> Vec<HT> {
    let batch = ctx.len() as u32;
    let num_blocks = batch * max_blocks + 1;
    let mut phys: Vec<i32> = (1..num_blocks as i32).collect();
    for i in (1..phys.len()).rev() {
        let j = r.below(i as u32 + 1) as usize;
        phys.swap(i, j);
    }
    let bt = HT::ints(
        &[batch, max_blocks],
        phys[..(batch * max_blocks) as usize].to_vec(),
    );
    let slots = num_blocks * bs;
    vec![
        HT::random(r, d, &[batch * query, heads * hd], 1.0),
        HT::random(r, d, &[slots, kvh * hd], 1.0),
        HT::random(r, d, &[slots, kvh * hd], 1.0),
        bt,
        HT::ints(&[batch], ctx.to_vec()),
    ]
}

#[test]
fn paged_attention_matches_for_gqa_causal_windows_softcap_and_long_contexts() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(7);
    // (dtype, ctx lens, query, heads, kvh, hd, block size, max blocks, window, softcap)
    #[allow(clippy::type_complexity)]
    let cases: Vec<(
        DType,
        Vec<i32>,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        Option<u32>,
        Option<f32>,
    )> = vec![
        (
            DType::BF16,
            vec![1, 17, 300],
            1,
            8,
            2,
            128,
            16,
            20,
            None,
            None,
        ),
        (
            DType::BF16,
            vec![4, 129, 257],
            4,
            4,
            2,
            64,
            16,
            17,
            None,
            None,
        ),
        (
            DType::BF16,
            vec![200, 33],
            3,
            6,
            2,
            72,
            8,
            30,
            Some(37),
            None,
        ),
        (
            DType::BF16,
            vec![90],
            1,
            4,
            4,
            256,
            32,
            4,
            Some(64),
            Some(50.0),
        ),
        (
            DType::F16,
            vec![45, 5],
            2,
            4,
            1,
            36,
            16,
            4,
            None,
            Some(30.0),
        ),
        (DType::F32, vec![70], 1, 2, 1, 64, 16, 5, None, None),
        // f16 through the streaming kernel (head_dim a multiple of 8), with
        // a window and a softcap; 36 above takes the phased kernel.
        (
            DType::F16,
            vec![150, 3],
            2,
            8,
            4,
            64,
            16,
            12,
            Some(50),
            Some(20.0),
        ),
        (
            DType::BF16,
            vec![4800, 1000],
            1,
            16,
            8,
            128,
            16,
            300,
            None,
            None,
        ),
        (DType::BF16, vec![40], 8, 8, 1, 128, 16, 3, None, None),
    ];
    for (d, ctx, q, heads, kvh, hd, bs, mb, window, softcap) in cases {
        let args = attention_case(&mut r, d, &ctx, q, heads, kvh, hd, bs, mb);
        let op = Op::PagedAttention(attn_attrs(heads, kvh, hd, q, bs, window, softcap));
        let what = format!(
            "paged_attention {d} ctx={ctx:?} q={q} {heads}/{kvh}x{hd} bs={bs} window={window:?} softcap={softcap:?}"
        );
        // On sm_90 the partitions combine inside thread-block clusters, as
        // plans lower it there; the plain combine (sm_80, HIP) runs too.
        check_op(
            &mut b,
            &format!("{what} (as lowered for the device)"),
            &op,
            &args,
        );
        gpu_bodies::without_clusters(|| {
            check_op(&mut b, &format!("{what} (no clusters)"), &op, &args)
        });
    }
}

#[test]
fn scale_with_and_without_softcap_matches_the_host_reference() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(19);
    for (dtype, factor, softcap) in [
        (DType::BF16, 25.25f32, None),
        (DType::F32, 1.0, Some(30.0f32)),
    ] {
        let x = HT::random(&mut r, dtype, &[3, 2049], 60.0);
        let op = Op::Scale { factor, softcap };
        check_op(
            &mut b,
            &format!("scale {dtype} {factor} {softcap:?}"),
            &op,
            &[x],
        );
    }
}

#[test]
fn gated_activations_match_in_both_forms() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(8);
    for op in [Op::SiluMul, Op::GeluTanhMul] {
        let g = HT::random(&mut r, DType::BF16, &[5, 1001], 4.0);
        let u = HT::random(&mut r, DType::BF16, &[5, 1001], 2.0);
        check_op(&mut b, &format!("{} 2-arg", op.mnemonic()), &op, &[g, u]);
        let gu = HT::random(&mut r, DType::BF16, &[3, 2 * 777], 4.0);
        check_op(&mut b, &format!("{} packed", op.mnemonic()), &op, &[gu]);
    }
}

#[test]
fn packed_silu_mul_written_in_place_over_its_input_is_still_correct() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(9);
    let gu = HT::random(&mut r, DType::BF16, &[6, 2 * 1500], 4.0);
    let out_ty = TensorType::new(DType::BF16, vec![6, 1500]);
    let want = reference(
        &Op::SiluMul,
        std::slice::from_ref(&gu),
        std::slice::from_ref(&out_ty),
    );
    let x = put(&mut b, &gu);
    let res = DevOperand {
        ptr: x.ptr,
        ty: out_ty,
    };
    let mut l = Launch {
        const_args: 0,
        body: kiln_runtime::backend::LaunchBody::Reference,
        kernel: "silu_mul_bf16".into(),
        op: Op::SiluMul,
        args: vec![x],
        results: vec![res.clone()],
        workspace: None,
    };
    let pdl = b.pdl();
    gpu_bodies::lower(&mut b, &mut l, pdl);
    b.prepare(&l).unwrap();
    b.launch(&l).unwrap();
    let got = get(&mut b, &res);
    assert_close("in-place packed silu_mul", &got, &want[0]);
}

#[test]
fn add_gather_last_argmax_and_accept_greedy_match() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(10);
    let a = HT::random(&mut r, DType::BF16, &[1001], 5.0);
    let c = HT::random(&mut r, DType::BF16, &[1001], 5.0);
    let a2 = HT::floats(DType::BF16, &[7, 143], a.f[..1001].to_vec());
    let c2 = HT::floats(DType::BF16, &[7, 143], c.f[..1001].to_vec());
    check_op(&mut b, "add", &Op::Add, &[a2, c2]);
    let x = HT::random(&mut r, DType::F32, &[6, 333], 1.0);
    check_op(
        &mut b,
        "gather_last f32",
        &Op::GatherLast { group: 3 },
        &[x],
    );
    let xi = HT::ints(&[6, 2], (0..12).collect());
    check_op(
        &mut b,
        "gather_last i32",
        &Op::GatherLast { group: 2 },
        &[xi],
    );
    // argmax over a real vocabulary, with planted ties: the first index wins.
    let v = 151_936u32;
    let mut logits = HT::random(&mut r, DType::F32, &[3, v], 10.0);
    logits.f[5] = 50.0;
    logits.f[v as usize - 1] = 50.0; // tie in row 0: index 5 must win
    logits.f[v as usize + 150_000] = 60.0;
    logits.f[2 * v as usize + 7] = 11.0;
    logits.f[2 * v as usize + 8] = 11.0;
    check_op(&mut b, "argmax f32", &Op::Argmax, &[logits]);
    let lb = HT::random(&mut r, DType::BF16, &[2, 5000], 3.0);
    check_op(&mut b, "argmax bf16", &Op::Argmax, &[lb]);
    let pred = HT::ints(&[12], vec![1, 2, 3, 9, 4, 5, 6, 9, 7, 7, 7, 9]);
    let drafts = HT::ints(&[9], vec![1, 2, 3, 4, 0, 6, 8, 7, 7]);
    check_op(
        &mut b,
        "accept_greedy",
        &Op::AcceptGreedy { spec: 3 },
        &[pred, drafts],
    );
}

fn check_op_as(b: &mut CudaBackend, what: &str, op: &Op, args: &[HT], gemm: GemmKind) {
    let tys: Vec<TensorType> = args.iter().map(|a| a.ty.clone()).collect();
    let rtys = op.infer(&tys).unwrap();
    let got = run_op_as(b, op, args, Some(gemm));
    let want = reference(op, args, &rtys);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_close(&format!("{what} result {i} vs host reference"), g, w);
    }
}

#[test]
fn matmul_matches_through_cublaslt_the_gemv_and_the_skinny_gemm() {
    let Some(mut b) = device() else { return };
    b.reserve_workspace(32 << 20).unwrap();
    let mut r = Rng::new(11);
    for (d, out, t, n, k, bias) in [
        (DType::BF16, DType::BF16, 1, 1000, 1024, false),
        // One token: the staged GEMV (gemv_staged_applies) at every split
        // (37 x 520: K in 2, a partial last stage; 129 x 64: no split, odd
        // rows; 2048 x 4104: K in 4, partial stage; 3001 x 8192: K in 2,
        // many stages, f32 out) with and without bias.
        (DType::BF16, DType::BF16, 1, 37, 520, true),
        (DType::F16, DType::F16, 1, 129, 64, true),
        (DType::BF16, DType::BF16, 1, 2048, 4104, true),
        (DType::BF16, DType::F32, 1, 3001, 8192, false),
        (DType::BF16, DType::BF16, 7, 1000, 520, true),
        (DType::BF16, DType::F32, 5, 3001, 256, false),
        (DType::BF16, DType::BF16, 33, 768, 2048, false),
        (DType::F16, DType::F16, 3, 128, 64, true),
        (DType::F32, DType::F32, 4, 96, 200, false),
        (DType::BF16, DType::BF16, 8, 4099, 1024, true),
        (DType::BF16, DType::F32, 2, 151_936, 1024, false),
    ] {
        let x = HT::random(&mut r, d, &[t, k], 1.0);
        let w = HT::random(&mut r, d, &[n, k], 0.1);
        let mut args = vec![x, w];
        if bias {
            args.push(HT::random(&mut r, d, &[n], 1.0));
        }
        let op = Op::MatMul { bias, out };
        let kiln_kernels = d != DType::F32;
        for kind in GemmKind::ALL {
            let applies = match kind {
                GemmKind::Blas => true,
                GemmKind::Gemv => kiln_kernels && t <= 8,
                GemmKind::Skinny => kiln_kernels && t <= 32,
            };
            if applies {
                check_op_as(
                    &mut b,
                    &format!("matmul {kind} {d}[{t},{k}]x[{n},{k}]^T -> {out} bias={bias}"),
                    &op,
                    &args,
                    kind,
                );
            }
        }
    }
}

/// The tensor-core skinny GEMM against the host reference at every token
/// count that changes its tiling (1..3 MMA tiles of 8, partial tiles), N
/// and K off every power of two (partial 16-row tiles, partial 32-wide
/// k-chunks, K = 8 and K < 32 per warp), with and without bias, bf16 and
/// f16 in, the input dtype or f32 out, outputs poisoned before the run.
/// At up to eight tokens N = 1000, 17 and 200 take half tiles of 8 rows
/// (`skinny_t8_r1h`, fewer than `SKINNY_HALF_BELOW` 16-row blocks; 17 and
/// 1000 leave a partial one), N = 4099 and 9000 full tiles.
#[test]
fn the_skinny_gemm_matches_the_reference_at_awkward_sizes() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(15);
    let mut cases = 0;
    for t in [2u32, 3, 5, 8, 9, 17, 32] {
        for (n, k) in [
            (1000u32, 1000u32),
            (17, 72),
            (4099, 1032),
            (200, 8),
            (9000, 3080),
        ] {
            for (d, out) in [
                (DType::BF16, DType::BF16),
                (DType::BF16, DType::F32),
                (DType::F16, DType::F16),
                (DType::F16, DType::F32),
            ] {
                let bias = (t + n + k) % 2 == 1 || d == DType::F16;
                let x = HT::random(&mut r, d, &[t, k], 1.0);
                let w = HT::random(&mut r, d, &[n, k], 0.2);
                let mut args = vec![x, w];
                if bias {
                    args.push(HT::random(&mut r, d, &[n], 1.0));
                }
                check_op_as(
                    &mut b,
                    &format!("skinny {d}[{t},{k}]x[{n},{k}]^T -> {out} bias={bias}"),
                    &Op::MatMul { bias, out },
                    &args,
                    GemmKind::Skinny,
                );
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 7 * 5 * 4);
}

/// The skinny GEMM captured once and replayed with new activations every
/// step (weights fixed, output re-poisoned): each replay matches the host
/// reference on that step's inputs, and the replay counter moves.
#[test]
fn the_skinny_gemm_under_capture_and_replay_follows_changing_inputs() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(16);
    for (t, n, k, d) in [
        (5u32, 1000u32, 1032u32, DType::BF16),
        (32, 3001, 520, DType::F16),
    ] {
        let op = Op::MatMul { bias: true, out: d };
        let w_h = HT::random(&mut r, d, &[n, k], 0.2);
        let bias_h = HT::random(&mut r, d, &[n], 1.0);
        let mut x_h = HT::random(&mut r, d, &[t, k], 1.0);
        let x = put(&mut b, &x_h);
        let w = put(&mut b, &w_h);
        let bias = put(&mut b, &bias_h);
        let ty = TensorType::new(d, vec![t, n]);
        let out = poisoned(&mut b, &ty);
        let mut l = Launch {
            const_args: 0b10,
            body: kiln_runtime::backend::LaunchBody::Reference,
            kernel: "test:skinny".into(),
            op: op.clone(),
            args: vec![x.clone(), w, bias],
            results: vec![out.clone()],
            workspace: None,
        };
        let pdl = b.pdl();
        gpu_bodies::lower_as(&mut b, &mut l, pdl, Some(GemmKind::Skinny));
        b.prepare(&l).unwrap();
        assert_eq!(
            b.gemm_choice(&l),
            Some(GemmChoice::Kernel(GemmKind::Skinny))
        );
        let key = Key::new(t, 1, 0);
        b.begin_capture(key).unwrap();
        b.launch(&l).unwrap();
        let graph = b.end_capture().unwrap();
        let before = b.counters().graphs.replays();
        for step in 0..4 {
            if step > 0 {
                x_h = HT::random(&mut r, d, &[t, k], 1.0 + step as f32);
                b.upload(x.ptr, &x_h.bytes()).unwrap();
            }
            b.upload(out.ptr, &vec![0xff; ty.size_bytes() as usize])
                .unwrap();
            b.replay(graph).unwrap();
            b.synchronize().unwrap();
            let want = reference(
                &op,
                &[x_h.clone(), w_h.clone(), bias_h.clone()],
                std::slice::from_ref(&ty),
            );
            assert_close(
                &format!("skinny replay step {step} {d}[{t},{k}]x[{n},{k}]^T"),
                &get(&mut b, &out),
                &want[0],
            );
        }
        assert_eq!(b.counters().graphs.replays() - before, 4);
        b.destroy_graph(graph).unwrap();
    }
}

/// Prints skinny vs gemv vs cuBLASLt per Qwen3-0.6B GEMM shape at T = 1,
/// 8 and 32 (median of 50 launches each, weights at GB/s): the data a
/// `kiln tune` table is made of, for a person to read.
#[test]
#[ignore = "benchmark: run on the GPU machine"]
fn bench_skinny_vs_gemv_vs_cublaslt_on_qwen3_0_6b_shapes() {
    let Some(mut b) = device() else { return };
    let (ws, _) = b.reserve_workspace(32 << 20).unwrap().expect("a workspace");
    let mut r = Rng::new(17);
    // (name, N, K): fused qkv, o_proj, fused gate/up, down_proj, lm_head.
    for (name, n, k) in [
        ("qkv", 4096u32, 1024u32),
        ("o_proj", 1024, 2048),
        ("gate_up", 6144, 1024),
        ("down", 1024, 3072),
        ("lm_head", 151_936, 1024),
    ] {
        let w = put(&mut b, &HT::random(&mut r, DType::BF16, &[n, k], 0.05));
        for t in [1u32, 8, 32] {
            let x = put(&mut b, &HT::random(&mut r, DType::BF16, &[t, k], 1.0));
            let out = poisoned(&mut b, &TensorType::new(DType::BF16, vec![t, n]));
            let mut line = format!("{name} T={t} N={n} K={k}:");
            for kind in GemmKind::ALL {
                if kind == GemmKind::Gemv && t > 8 {
                    continue;
                }
                let mut l = Launch {
                    const_args: 0b10,
                    body: kiln_runtime::backend::LaunchBody::Reference,
                    kernel: "gemm".into(),
                    op: Op::MatMul {
                        bias: false,
                        out: DType::BF16,
                    },
                    args: vec![x.clone(), w.clone()],
                    results: vec![out.clone()],
                    workspace: Some((ws, 32 << 20)),
                };
                let pdl = b.pdl();
                gpu_bodies::lower_as(&mut b, &mut l, pdl, Some(kind));
                b.prepare(&l).unwrap();
                b.launch(&l).unwrap();
                let ms = median(
                    (0..50)
                        .map(|_| time_ms(&mut b, |b| b.launch(&l)).unwrap())
                        .collect(),
                );
                line.push_str(&format!(
                    " {kind} {:.1} us ({:.0} GB/s)",
                    ms * 1e3,
                    (n as f64 * k as f64 * 2.0) / (ms / 1e3) / 1e9
                ));
            }
            eprintln!("{line}");
            b.free(x.ptr).unwrap();
            b.free(out.ptr).unwrap();
        }
        b.free(w.ptr).unwrap();
    }
}

#[test]
fn gemm_algorithms_are_chosen_within_the_granted_workspace() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(12);
    let (ws, _) = b.reserve_workspace(32 << 20).unwrap().expect("a workspace");
    for granted in [0u64, 1 << 20, 32 << 20] {
        let x = put(&mut b, &HT::random(&mut r, DType::BF16, &[16, 4096], 1.0));
        let w = put(
            &mut b,
            &HT::random(&mut r, DType::BF16, &[4096, 4096], 0.05),
        );
        let out = poisoned(&mut b, &TensorType::new(DType::BF16, vec![16, 4096]));
        let mut l = Launch {
            const_args: 0,
            body: kiln_runtime::backend::LaunchBody::Reference,
            kernel: "gemm".into(),
            op: Op::MatMul {
                bias: false,
                out: DType::BF16,
            },
            args: vec![x, w],
            results: vec![out.clone()],
            workspace: (granted > 0).then_some((ws, granted)),
        };
        gpu_bodies::lower_as(&mut b, &mut l, false, Some(GemmKind::Blas));
        l.workspace = (granted > 0).then_some((ws, granted));
        b.prepare(&l).unwrap();
        let used = match b.gemm_choice(&l).expect("selected in prepare") {
            GemmChoice::Blas(a) => a.workspace,
            GemmChoice::Kernel(k) => panic!("a blas GEMM ran as {k}"),
        };
        assert!(
            used <= granted,
            "algorithm needs {used} > granted {granted}"
        );
        b.launch(&l).unwrap();
        let got = get(&mut b, &out);
        assert!(
            got.f.iter().all(|x| x.is_finite()),
            "granted {granted}: unwritten output"
        );
        eprintln!("granted {granted}: algorithm uses {used} bytes");
    }
}

// ------------------------------------------------------------ capture contract

fn small_step(b: &mut CudaBackend, r: &mut Rng) -> (Vec<Launch>, DevOperand, DevOperand) {
    // ids -> embedding -> rms_norm -> matmul(f32 logits) -> argmax
    let (v, h) = (2048u32, 256u32);
    let ids = poisoned(b, &TensorType::new(DType::I32, vec![4]));
    let table = put(b, &HT::random(r, DType::BF16, &[v, h], 1.0));
    let w = put(b, &HT::random(r, DType::BF16, &[h], 1.0));
    let lm = put(b, &HT::random(r, DType::BF16, &[v, h], 0.2));
    let x = poisoned(b, &TensorType::new(DType::BF16, vec![4, h]));
    let y = poisoned(b, &TensorType::new(DType::BF16, vec![4, h]));
    let logits = poisoned(b, &TensorType::new(DType::F32, vec![4, v]));
    let next = poisoned(b, &TensorType::new(DType::I32, vec![4]));
    let l = |kernel: &str, op: Op, args: Vec<DevOperand>, results: Vec<DevOperand>| Launch {
        const_args: 0,
        body: kiln_runtime::backend::LaunchBody::Reference,
        kernel: kernel.into(),
        op,
        args,
        results,
        workspace: None,
    };
    let launches = vec![
        l(
            "embedding_bf16",
            Op::Embedding,
            vec![ids.clone(), table],
            vec![x.clone()],
        ),
        l(
            "rms_norm_bf16",
            Op::RmsNorm {
                eps: 1e-6,
                unit_offset: false,
            },
            vec![x, w],
            vec![y.clone()],
        ),
        l(
            "gemm",
            Op::MatMul {
                bias: false,
                out: DType::F32,
            },
            vec![y, lm],
            vec![logits.clone()],
        ),
        l("argmax_f32", Op::Argmax, vec![logits], vec![next.clone()]),
    ];
    let mut launches = launches;
    let pdl = b.pdl();
    for l in &mut launches {
        gpu_bodies::lower(b, l, pdl);
    }
    (launches, ids, next)
}

fn read_ints(b: &mut CudaBackend, o: &DevOperand) -> Vec<i32> {
    get(b, o).i
}

#[test]
fn replay_equals_eager_with_fresh_inputs_every_step() {
    let Some(mut b) = device() else { return };
    b.reserve_workspace(4 << 20).unwrap();
    let mut r = Rng::new(13);
    let (launches, ids, next) = small_step(&mut b, &mut r);
    for l in &launches {
        b.prepare(l).unwrap();
    }
    let key = Key::new(4, 1, 0);
    b.upload(ids.ptr, &HT::ints(&[4], vec![1, 2, 3, 4]).bytes())
        .unwrap();
    b.begin_capture(key).unwrap();
    for l in &launches {
        b.launch(l).unwrap();
    }
    let g = b.end_capture().unwrap();
    let mut outputs = Vec::new();
    for step in 0..6 {
        let tokens: Vec<i32> = (0..4).map(|_| r.below(2048) as i32).collect();
        let bytes = HT::ints(&[4], tokens.clone()).bytes();
        // eager
        b.upload(next.ptr, &[0xFF; 16]).unwrap();
        b.upload(ids.ptr, &bytes).unwrap();
        for l in &launches {
            b.launch(l).unwrap();
        }
        let eager = read_ints(&mut b, &next);
        // replay
        b.upload(next.ptr, &[0xFF; 16]).unwrap();
        b.upload(ids.ptr, &bytes).unwrap();
        b.replay(g).unwrap();
        let replayed = read_ints(&mut b, &next);
        assert_eq!(replayed, eager, "step {step}: tokens {tokens:?}");
        assert!(eager.iter().all(|&t| (0..2048).contains(&t)), "{eager:?}");
        outputs.push(replayed);
    }
    // The inputs matter: a frozen input would repeat one answer.
    outputs.dedup();
    assert!(outputs.len() > 1, "replay ignored the refreshed token ids");
    b.destroy_graph(g).unwrap();
}

#[test]
fn allocation_inside_a_capture_fails_loudly_and_the_backend_recovers() {
    let Some(mut b) = device() else { return };
    b.reserve_workspace(4 << 20).unwrap();
    let mut r = Rng::new(14);
    let (launches, ids, next) = small_step(&mut b, &mut r);
    for l in &launches {
        b.prepare(l).unwrap();
    }
    let key = Key::new(4, 1, 0);
    b.begin_capture(key).unwrap();
    b.launch(&launches[0]).unwrap();
    // kiln's own contract check.
    match b.alloc(1 << 20, "lazy workspace") {
        Err(BackendError::CaptureContract { key: k, call, .. }) => {
            assert_eq!(k, key);
            assert!(call.contains("alloc"), "{call}");
        }
        other => panic!("alloc inside capture must be refused, got {other:?}"),
    }
    for (what, e) in [
        ("synchronize", b.synchronize().err()),
        ("download", b.download(next.ptr, &mut [0u8; 16]).err()),
        ("upload", b.upload(ids.ptr, &[0u8; 16]).err()),
        ("reserve_workspace", b.reserve_workspace(8 << 20).err()),
    ] {
        assert!(
            matches!(e, Some(BackendError::CaptureContract { .. })),
            "{what} inside capture: {e:?}"
        );
    }
    // A capture that saw a refused call may still end or fail; a failure
    // names the key.
    if let Err(e) = b.end_capture() {
        assert!(e.to_string().contains("b4q1s0"), "{e}");
    }
    // Eager work runs again afterwards.
    b.upload(ids.ptr, &HT::ints(&[4], vec![5, 6, 7, 8]).bytes())
        .unwrap();
    for l in &launches {
        b.launch(l).unwrap();
    }
    let out = read_ints(&mut b, &next);
    assert!(out.iter().all(|&t| (0..2048).contains(&t)), "{out:?}");
}

#[test]
fn a_gemm_not_prepared_before_capture_fails_the_capture_by_name() {
    let Some(mut b) = device() else { return };
    b.reserve_workspace(4 << 20).unwrap();
    let mut r = Rng::new(15);
    let (launches, _, _) = small_step(&mut b, &mut r);
    let key = Key::new(4, 1, 0);
    // Every launch but the GEMM is prepared (the backend refuses any
    // unprepared launch inside a capture; the GEMM is the one this names).
    b.prepare(&launches[0]).unwrap();
    b.prepare(&launches[1]).unwrap();
    b.begin_capture(key).unwrap();
    b.launch(&launches[0]).unwrap();
    b.launch(&launches[1]).unwrap();
    let e = b.launch(&launches[2]).unwrap_err();
    assert!(
        matches!(&e, BackendError::CaptureFailed { op, .. } if op.contains("gemm")),
        "{e}"
    );
    b.abort_capture().unwrap();
}

#[test]
fn dropping_the_backend_with_work_and_graphs_in_flight_is_safe() {
    let Some(mut b) = device() else { return };
    b.reserve_workspace(4 << 20).unwrap();
    let mut r = Rng::new(16);
    let (launches, _, _) = small_step(&mut b, &mut r);
    for l in &launches {
        b.prepare(l).unwrap();
    }
    b.begin_capture(Key::new(4, 1, 0)).unwrap();
    for l in &launches {
        b.launch(l).unwrap();
    }
    let g = b.end_capture().unwrap();
    for _ in 0..50 {
        b.replay(g).unwrap();
    }
    drop(b); // no synchronize: teardown must drain the stream itself
}

#[test]
fn kernel_images_for_another_gpu_are_refused_with_the_fix() {
    let Some(mut b) = device() else { return };
    let other = if b.sm() == 90 { 80 } else { 90 };
    let imgs = cubins(other);
    let e = b.load_kernels(&imgs).unwrap_err().to_string();
    assert!(e.contains("--target cuda:sm_"), "{e}");
}

// ------------------------------------------------------------- whole steps

#[test]
fn a_whole_synthetic_step_matches_the_host_reference_eager_and_replayed() {
    for pdl in [true, false] {
        whole_step(pdl);
    }
}

fn whole_step(pdl: bool) {
    let Some(mut b) = device() else { return };
    b.set_pdl(pdl);
    eprintln!(
        "whole step with programmatic dependent launch {}",
        if b.pdl() { "on" } else { "off" }
    );
    b.reserve_workspace(32 << 20).unwrap();
    let step = synth::build(synth::TINY, &[1, 37, 200], 21);
    let (want_logits, want_next) = synth::host_run(&step);
    let dev = synth::upload(&mut b, &step);
    for l in &dev.launches {
        b.launch(l).unwrap();
    }
    let logits = get(&mut b, &dev.ptrs[step.logits]);
    let next = get(&mut b, &dev.ptrs[step.next]);
    let e = rel_err(&logits.f, &want_logits.f);
    eprintln!(
        "whole step: logits relative error {e:.2e}, tokens {:?} vs {:?}",
        next.i, want_next.i
    );
    assert!(e < 3e-2, "logits relative error {e}");
    // Greedy tokens agree unless the reference's top two are a near-tie.
    let v = step.cfg.vocab as usize;
    for (row, (&g, &w)) in next.i.iter().zip(&want_next.i).enumerate() {
        if g != w {
            let r = &want_logits.f[row * v..(row + 1) * v];
            let margin = (r[w as usize] - r[g as usize]).abs();
            assert!(
                margin < 0.05,
                "row {row}: token {g} vs {w}, reference margin {margin}"
            );
        }
    }
    // The same step replayed from a graph gives the eager bits.
    b.begin_capture(Key::new(3, 1, 0)).unwrap();
    for l in &dev.launches {
        b.launch(l).unwrap();
    }
    let g = b.end_capture().unwrap();
    b.upload(
        dev.ptrs[step.logits].ptr,
        &vec![0xFF; logits.ty.size_bytes() as usize],
    )
    .unwrap();
    b.replay(g).unwrap();
    let replayed = get(&mut b, &dev.ptrs[step.logits]);
    assert_eq!(
        replayed.f.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        logits.f.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "replayed logits differ from eager"
    );
}

fn median(mut v: Vec<f32>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2] as f64
}

struct Timing {
    eager_ms: f64,
    replay_ms: f64,
    back_to_back_ms: f64,
    capture_ms: f64,
    tokens: Vec<i32>,
}

/// Eager (median of 30) and replayed (median of 200, plus 100 back to back)
/// step times; checks replay and eager agree on the tokens.
fn time_step(b: &mut CudaBackend, key: Key, launches: &[Launch], next: &DevOperand) -> Timing {
    for _ in 0..3 {
        for l in launches {
            b.launch(l).unwrap();
        }
    }
    b.synchronize().unwrap();
    let mut eager = Vec::new();
    for _ in 0..30 {
        eager.push(
            time_ms(b, |b| {
                for l in launches {
                    b.launch(l)?;
                }
                Ok(())
            })
            .unwrap(),
        );
    }
    let eager_next = get(b, next).i;
    let t0 = std::time::Instant::now();
    b.begin_capture(key).unwrap();
    for l in launches {
        b.launch(l).unwrap();
    }
    let g = b.end_capture().unwrap();
    let capture_ms = t0.elapsed().as_secs_f64() * 1e3;
    for _ in 0..10 {
        b.replay(g).unwrap();
    }
    let mut replay = Vec::new();
    for _ in 0..200 {
        replay.push(time_ms(b, |b| b.replay(g)).unwrap());
    }
    let back_to_back_ms =
        time_ms(b, |b| (0..100).try_for_each(|_| b.replay(g))).unwrap() as f64 / 100.0;
    let replay_next = get(b, next).i;
    assert_eq!(
        replay_next, eager_next,
        "replay and eager disagree on the tokens"
    );
    b.destroy_graph(g).unwrap();
    Timing {
        eager_ms: median(eager),
        replay_ms: median(replay),
        back_to_back_ms,
        capture_ms,
        tokens: replay_next,
    }
}

/// GPU time of each launch inside a graph (the launch repeated 10 times in
/// one capture), summed per kernel (GEMMs per shape), largest first.
fn profile_ops(b: &mut CudaBackend, launches: &[Launch]) -> Vec<(String, usize, f64)> {
    let mut acc: Vec<(String, usize, f64)> = Vec::new();
    for l in launches {
        b.begin_capture(Key::new(999, 1, 0)).unwrap();
        for _ in 0..10 {
            b.launch(l).unwrap();
        }
        let g = b.end_capture().unwrap();
        b.replay(g).unwrap();
        let us = median(
            (0..5)
                .map(|_| time_ms(b, |b| b.replay(g)).unwrap())
                .collect(),
        ) * 100.0;
        b.destroy_graph(g).unwrap();
        let label = match &l.op {
            Op::MatMul { .. } => {
                let x = l.args[0].ty.shape.dims();
                let w = l.args[1].ty.shape.dims();
                format!("gemm {}x{}x{}", x[0], w[0], x[1])
            }
            _ => l.kernel.clone(),
        };
        match acc.iter_mut().find(|e| e.0 == label) {
            Some(e) => {
                e.1 += 1;
                e.2 += us;
            }
            None => acc.push((label, 1, us)),
        }
    }
    acc.sort_by(|a, b| b.2.total_cmp(&a.2));
    acc
}

/// Times one synthetic Qwen3-0.6B decode step: eager launches vs graph
/// replay, against the HBM floor measured in the same run, with a per-op
/// profile and a cuBLASLt-only ablation. Prints one JSON line per
/// configuration (and writes them to `KILN_BENCH_OUT` when set).
#[test]
#[ignore = "benchmark: run on the GPU machine by scripts/gpu-check.sh"]
fn bench_synthetic_qwen3_0_6b_step_replay_vs_eager() {
    let Some(mut b) = device() else { return };
    b.reserve_workspace(32 << 20).unwrap();
    let bw = b
        .copy_bandwidth(2 << 30, 10)
        .unwrap()
        .expect("the CUDA backend measures copy bandwidth");
    eprintln!("device-to-device copy: {:.0} GB/s (read + write)", bw / 1e9);
    // Decode GEMMs stream their weights: achieved bandwidth per policy on a
    // weight four times the L2 (256 MiB), rotating nothing (one pass each).
    {
        let mut r = Rng::new(77);
        let (n, k) = (16384u32, 8192u32);
        let w = put(&mut b, &HT::random(&mut r, DType::BF16, &[n, k], 0.01));
        for t in [1u32, 8, 32] {
            let x = put(&mut b, &HT::random(&mut r, DType::BF16, &[t, k], 1.0));
            let out = poisoned(&mut b, &TensorType::new(DType::BF16, vec![t, n]));
            let mut l = Launch {
                const_args: 0b10,
                body: kiln_runtime::backend::LaunchBody::Reference,
                kernel: "gemm".into(),
                op: Op::MatMul {
                    bias: false,
                    out: DType::BF16,
                },
                args: vec![x.clone(), w.clone()],
                results: vec![out.clone()],
                workspace: None,
            };
            for policy in GemmKind::ALL {
                if policy == GemmKind::Gemv && t > 8 {
                    continue;
                }
                l.workspace = None;
                gpu_bodies::lower_as(&mut b, &mut l, false, Some(policy));
                b.prepare(&l).unwrap();
                b.launch(&l).unwrap();
                let ms = median(
                    (0..20)
                        .map(|_| time_ms(&mut b, |b| b.launch(&l)).unwrap())
                        .collect(),
                );
                eprintln!(
                    "gemm bf16 [{t},{k}]x[{n},{k}]^T {policy}: {:.1} us, weights at {:.0} GB/s",
                    ms * 1e3,
                    (n as f64 * k as f64 * 2.0) / (ms / 1e3) / 1e9
                );
            }
            b.free(x.ptr).unwrap();
            b.free(out.ptr).unwrap();
        }
        b.free(w.ptr).unwrap();
    }
    let mut lines = Vec::new();
    for (batch, ctx) in [(1u32, 512i32), (32, 512), (1, 128), (32, 128), (8, 2048)] {
        let ctxs = vec![ctx; batch as usize];
        let step = synth::build(synth::QWEN3_0_6B, &ctxs, 42 + batch as u64);
        let key = Key::new(batch, 1, 0);
        let mut ablation = String::new();
        let dev = if batch == 1 && ctx == 512 {
            // cuBLASLt alone (heuristic's first algorithm), for comparison.
            let blas = synth::upload_as(&mut b, &step, Some(GemmKind::Blas));
            let t = time_step(&mut b, key, &blas.launches, &blas.ptrs[step.next]);
            ablation = format!(
                ",\"blas_only_replay_ms\":{:.4},\"blas_only_eager_ms\":{:.4}",
                t.replay_ms, t.eager_ms
            );
            synth::upload(&mut b, &step)
        } else {
            synth::upload(&mut b, &step)
        };
        if batch == 1 && ctx == 512 && b.pdl() {
            b.set_pdl(false);
            let t = time_step(&mut b, key, &dev.launches, &dev.ptrs[step.next]);
            ablation.push_str(&format!(
                ",\"no_pdl_replay_ms\":{:.4},\"no_pdl_eager_ms\":{:.4}",
                t.replay_ms, t.eager_ms
            ));
            b.set_pdl(true);
        }
        let t = time_step(&mut b, key, &dev.launches, &dev.ptrs[step.next]);
        if ctx == 512 {
            let prof = profile_ops(&mut b, &dev.launches);
            let total: f64 = prof.iter().map(|p| p.2).sum();
            eprintln!("per-op GPU time in a graph, b{batch} ctx {ctx} (sum {total:.0} us):");
            for (label, n, us) in prof.iter().take(14) {
                eprintln!(
                    "  {label:<32} x{n:<4} {us:>8.1} us  ({:.2} us each)",
                    us / *n as f64
                );
            }
        }
        let bytes =
            step.weight_bytes + step.kv_read_bytes + batch as u64 * step.cfg.vocab as u64 * 4;
        let floor_ms = bytes as f64 / bw * 1e3;
        let line = format!(
            "{{\"model\":\"qwen3-0.6b-synthetic\",\"batch\":{batch},\"context\":{ctx},\"launch_ops\":{},\"eager_ms\":{:.4},\"replay_ms\":{:.4},\"replay_back_to_back_ms\":{:.4},\"speedup\":{:.2},\"tokens_per_s\":{:.0},\"bytes_moved\":{bytes},\"copy_bw_gbs\":{:.0},\"hbm_floor_ms\":{floor_ms:.4},\"replay_over_floor\":{:.2},\"capture_ms\":{:.2},\"device_bytes\":{},\"workspace_bytes\":{},\"lowering_buffers\":{},\"pdl\":{}{ablation}}}",
            dev.launches.len(),
            t.eager_ms,
            t.replay_ms,
            t.back_to_back_ms,
            t.eager_ms / t.replay_ms,
            batch as f64 / (t.replay_ms / 1e3),
            bw / 1e9,
            t.replay_ms / floor_ms,
            t.capture_ms,
            b.allocated_bytes(),
            32u64 << 20,
            dev.scratch.len(),
            b.pdl(),
        );
        assert_eq!(t.tokens.len(), batch as usize);
        println!("{line}");
        lines.push(line);
        synth::free(&mut b, dev);
    }
    if let Ok(path) = std::env::var("KILN_BENCH_OUT") {
        let tmp = format!("{path}.tmp");
        std::fs::write(&tmp, lines.join("\n") + "\n").unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }
}

#[test]
fn the_host_reference_of_the_tiny_step_is_finite_and_in_range() {
    // Runs without a GPU: guards the oracle the device checks rely on.
    let step = synth::build(synth::TINY, &[1, 37, 200], 21);
    let (logits, next) = synth::host_run(&step);
    assert!(logits.f.iter().all(|x| x.is_finite()));
    assert!(logits.f.iter().any(|&x| x != 0.0));
    assert!(
        next.i
            .iter()
            .all(|&t| (0..step.cfg.vocab as i32).contains(&t)),
        "{:?}",
        next.i
    );
}

#[test]
fn the_host_reference_agrees_with_the_cpu_reference_kernels() {
    // Runs without a GPU: the two oracles the device results are held to
    // must agree with each other first.
    let mut r = Rng::new(99);
    let d = DType::BF16;
    let mut cases: Vec<(Op, Vec<HT>)> = vec![
        (
            Op::RmsNorm {
                eps: 1e-6,
                unit_offset: true,
            },
            vec![
                HT::random(&mut r, d, &[3, 1000], 3.0),
                HT::random(&mut r, d, &[1000], 1.0),
            ],
        ),
        (
            Op::AddRmsNorm {
                eps: 1e-5,
                unit_offset: false,
            },
            vec![
                HT::random(&mut r, d, &[2, 520], 3.0),
                HT::random(&mut r, d, &[2, 520], 3.0),
                HT::random(&mut r, d, &[520], 1.0),
            ],
        ),
        (
            Op::Rope {
                heads: 3,
                head_dim: 64,
                rope: rope(10000.0),
            },
            vec![
                HT::random(&mut r, d, &[4, 192], 1.0),
                HT::ints(&[4], vec![0, 7, 4097, 29999]),
            ],
        ),
        (
            Op::QkvRopeKvWrite {
                heads: 4,
                kv_heads: 2,
                head_dim: 64,
                rope: rope(1e6),
                qk_norm: Some(1e-6),
                unit_offset: false,
            },
            vec![
                HT::random(&mut r, d, &[3, 512], 2.0),
                HT::ints(&[3], vec![5, 300, 8191]),
                HT::ints(&[3], vec![63, 2, 30]),
                HT::random(&mut r, d, &[64, 128], 1.0),
                HT::random(&mut r, d, &[64, 128], 1.0),
                HT::random(&mut r, d, &[64], 1.0),
                HT::random(&mut r, d, &[64], 1.0),
            ],
        ),
        (Op::SiluMul, vec![HT::random(&mut r, d, &[3, 2 * 777], 4.0)]),
        (
            Op::GeluTanhMul,
            vec![
                HT::random(&mut r, d, &[2, 300], 4.0),
                HT::random(&mut r, d, &[2, 300], 2.0),
            ],
        ),
        (
            Op::Argmax,
            vec![HT::random(&mut r, DType::F32, &[3, 5000], 5.0)],
        ),
        (
            Op::MatMul {
                bias: true,
                out: DType::F32,
            },
            vec![
                HT::random(&mut r, d, &[3, 256], 1.0),
                HT::random(&mut r, d, &[100, 256], 0.1),
                HT::random(&mut r, d, &[100], 1.0),
            ],
        ),
    ];
    for (ctx, q, window, softcap) in [
        (vec![1, 17, 300], 1, None, None),
        (vec![200, 33], 3, Some(37), None),
        (vec![45, 5], 2, None, Some(30.0)),
    ] {
        let args = attention_case(&mut r, d, &ctx, q, 4, 2, 64, 16, 20);
        cases.push((
            Op::PagedAttention(AttnAttrs {
                heads: 4,
                kv_heads: 2,
                head_dim: 64,
                query: q,
                block_size: 16,
                scale: 0.125,
                window,
                softcap,
            }),
            args,
        ));
    }
    for (op, args) in cases {
        let tys: Vec<TensorType> = args.iter().map(|a| a.ty.clone()).collect();
        let rtys = op.infer(&tys).unwrap();
        let host = reference(&op, &args, &rtys);
        let cpu = cpu_reference(&op, &args).expect("the CPU reference kernels exist");
        for (i, (h, c)) in host.iter().zip(&cpu).enumerate() {
            assert_close(
                &format!("{} result {i}: host vs CPU kernels", op.mnemonic()),
                h,
                c,
            );
        }
    }
}

// ------------------------------------------------------------ fused GEMVs

fn fused_op(bias: bool, out: DType, pre: bool, post: kiln_ir::Epilogue) -> Op {
    Op::FusedMatMul {
        bias,
        out,
        pre: pre.then_some(kiln_ir::PreNorm {
            eps: 1e-6,
            unit_offset: bias,
        }),
        post,
    }
}

fn fused_args(r: &mut Rng, op: &Op, d: DType, t: u32, n: u32, k: u32) -> Vec<HT> {
    let Op::FusedMatMul {
        bias, pre, post, ..
    } = op
    else {
        unreachable!()
    };
    let mut a = vec![
        HT::random(r, d, &[t, k], 2.0),
        HT::random(r, d, &[n, k], 0.1),
    ];
    if *bias {
        a.push(HT::random(r, d, &[n], 0.5));
    }
    if pre.is_some() {
        a.push(HT::random(r, d, &[k], 1.0));
    }
    if *post == kiln_ir::Epilogue::Residual {
        a.push(HT::random(r, d, &[t, n], 2.0));
    }
    a
}

#[test]
fn fused_matmul_matches_for_every_prologue_and_epilogue_at_awkward_sizes() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(15);
    for d in [DType::BF16, DType::F16] {
        // (t, n, k): odd block tails, K not a multiple of the unrolled
        // stride, every token-count instantiation, a wide tied lm_head.
        // Past one token, n = 4098 runs the skinny GEMM's 16-row tiles
        // (its activation pairs 2049 outputs, also 16-row tiles) and the
        // smaller n its half tiles of 8 (kiln_kernels::gpu::skinny_half).
        for (t, n, k) in [
            (1, 1000, 1024),
            (3, 130, 72),
            (5, 34, 520),
            (8, 4098, 1024),
            (2, 6, 8),
            (7, 768, 3072),
            // One token over the staged kernel's split 2 and 1.
            (1, 2050, 520),
            (1, 70, 264),
        ] {
            // The argmax epilogue has its own test (its ties need care).
            for post in kiln_ir::Epilogue::ALL
                .into_iter()
                .filter(|p| *p != kiln_ir::Epilogue::Argmax)
            {
                for pre in [false, true] {
                    let bias = (t + pre as u32) % 2 == 1;
                    let op = fused_op(bias, d, pre, post);
                    let args = fused_args(&mut r, &op, d, t, n, k);
                    check_op(
                        &mut b,
                        &format!(
                            "fused_matmul {d} t{t} n{n} k{k} bias={bias} pre={pre} {}",
                            post.name()
                        ),
                        &op,
                        &args,
                    );
                }
            }
        }
        // f32 logits with the final norm folded in (the lm_head).
        let op = fused_op(false, DType::F32, true, kiln_ir::Epilogue::None);
        let args = fused_args(&mut r, &op, d, 2, 151_936, 1024);
        check_op(&mut b, &format!("fused lm_head {d}"), &op, &args);
    }
}

#[test]
fn a_step_of_fused_gemvs_replays_what_it_computes_eagerly_with_fresh_inputs() {
    // Four tokens run the fused skinny GEMM; one token the staged GEMVs.
    for t in [4, 1] {
        fused_step_replays(t);
    }
}

fn fused_step_replays(t: u32) {
    use kiln_ir::Epilogue;
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(16 + t as u64);
    let (h, i, v) = (256u32, 384u32, 2048u32);
    let d = DType::BF16;
    let tt = |s: &[u32]| TensorType::new(d, s.to_vec());
    // h -> gate_up(norm, silu) -> down(+h) -> lm_head(norm, f32) -> argmax
    let x = poisoned(&mut b, &tt(&[t, h]));
    let w_gu = put(&mut b, &HT::random(&mut r, d, &[2 * i, h], 0.1));
    let n1 = put(&mut b, &HT::random(&mut r, d, &[h], 1.0));
    let w_down = put(&mut b, &HT::random(&mut r, d, &[h, i], 0.1));
    let lm = put(&mut b, &HT::random(&mut r, d, &[v, h], 0.2));
    let n2 = put(&mut b, &HT::random(&mut r, d, &[h], 1.0));
    let act = poisoned(&mut b, &tt(&[t, i]));
    let h2 = poisoned(&mut b, &tt(&[t, h]));
    let logits = poisoned(&mut b, &TensorType::new(DType::F32, vec![t, v]));
    let next = poisoned(&mut b, &TensorType::new(DType::I32, vec![t]));
    let l = |op: Op, args: Vec<DevOperand>, results: Vec<DevOperand>| Launch {
        const_args: if matches!(op, Op::FusedMatMul { .. }) {
            2
        } else {
            0
        },
        body: kiln_runtime::backend::LaunchBody::Reference,
        kernel: op.mnemonic().into(),
        op,
        args,
        results,
        workspace: None,
    };
    let mut launches = vec![
        l(
            fused_op(false, d, true, Epilogue::SiluMul),
            vec![x.clone(), w_gu.clone(), n1.clone()],
            vec![act.clone()],
        ),
        l(
            fused_op(false, d, false, Epilogue::Residual),
            vec![act.clone(), w_down.clone(), x.clone()],
            vec![h2.clone()],
        ),
        l(
            fused_op(false, DType::F32, true, Epilogue::None),
            vec![h2.clone(), lm.clone(), n2.clone()],
            vec![logits.clone()],
        ),
        l(Op::Argmax, vec![logits.clone()], vec![next.clone()]),
    ];
    let pdl = b.pdl();
    let mut owned = Vec::new();
    for l in &mut launches {
        owned.extend(gpu_bodies::lower(&mut b, l, pdl));
        b.prepare(l).unwrap();
    }
    let key = Key::new(t, 1, 0);
    b.upload(x.ptr, &HT::random(&mut r, d, &[t, h], 2.0).bytes())
        .unwrap();
    b.begin_capture(key).unwrap();
    for l in &launches {
        b.launch(l).unwrap();
    }
    let g = b.end_capture().unwrap();
    let mut seen = Vec::new();
    for step in 0..6 {
        let xs = HT::random(&mut r, d, &[t, h], 2.0);
        let poison = |b: &mut CudaBackend, o: &DevOperand| {
            b.upload(o.ptr, &vec![0xFF; o.ty.size_bytes() as usize])
                .unwrap()
        };
        // Eager.
        for o in [&act, &h2, &logits, &next] {
            poison(&mut b, o);
        }
        b.upload(x.ptr, &xs.bytes()).unwrap();
        for l in &launches {
            b.launch(l).unwrap();
        }
        b.synchronize().unwrap();
        let (eager_h2, eager_next) = (get(&mut b, &h2), get(&mut b, &next));
        // Replayed.
        for o in [&act, &h2, &logits, &next] {
            poison(&mut b, o);
        }
        b.upload(x.ptr, &xs.bytes()).unwrap();
        b.replay(g).unwrap();
        b.synchronize().unwrap();
        let (got_h2, got_next) = (get(&mut b, &h2), get(&mut b, &next));
        assert_eq!(got_h2.f, eager_h2.f, "step {step}: residual stream");
        assert_eq!(got_next.i, eager_next.i, "step {step}: tokens");
        // Against the CPU reference of the same fused ops.
        let w = |b: &mut CudaBackend, o: &DevOperand| get(b, o);
        let (wgu, wn1, wd) = (w(&mut b, &w_gu), w(&mut b, &n1), w(&mut b, &w_down));
        let a = cpu_reference(
            &fused_op(false, d, true, Epilogue::SiluMul),
            &[xs.clone(), wgu, wn1],
        )
        .expect("cpu fused_matmul")
        .remove(0);
        let want_h2 = cpu_reference(
            &fused_op(false, d, false, Epilogue::Residual),
            &[a, wd, xs.clone()],
        )
        .expect("cpu fused_matmul")
        .remove(0);
        assert_close(
            &format!("step {step}: residual stream vs CPU"),
            &got_h2,
            &want_h2,
        );
        seen.push(got_next.i);
    }
    seen.dedup();
    assert!(seen.len() > 1, "replay ignored the refreshed input");
    b.destroy_graph(g).unwrap();
    for p in owned {
        let _ = b.free(p);
    }
}

// ------------------------------------------------------- the argmax GEMV

/// Operands of an lm_head `fused_matmul{argmax}` case. `variant` 0: random;
/// 1: rows 15, 16 (the first two blocks' boundary) and n-1 get the same
/// weights and bias and are every token's maximum (x and the norm weight
/// positive), so they tie and row 15 must win; 2: as 1 with row 15's bias
/// NaN, so row 16 must win; 3: every bias NaN, so every token gives 0.
fn argmax_case(
    r: &mut Rng,
    op: &Op,
    d: DType,
    (t, n, k): (u32, u32, u32),
    variant: u32,
) -> Vec<HT> {
    let mut a = fused_args(r, op, d, t, n, k);
    if variant == 0 {
        return a;
    }
    let Op::FusedMatMul { bias, pre, .. } = op else {
        unreachable!()
    };
    assert!(n > 17 && (variant < 2 || *bias));
    let pos = |h: &HT| {
        HT::floats(
            h.ty.dtype,
            h.ty.shape.dims(),
            h.f.iter().map(|v| v.abs() + 0.25).collect(),
        )
    };
    a[0] = pos(&a[0]);
    let nw = 2 + *bias as usize;
    if pre.is_some() {
        a[nw] = pos(&a[nw]);
    }
    let ku = k as usize;
    let row: Vec<f32> = (0..ku)
        .map(|_| rnd(d, 0.5 + 0.25 * r.uniform().abs()))
        .collect();
    for j in [15usize, 16, n as usize - 1] {
        a[1].f[j * ku..(j + 1) * ku].copy_from_slice(&row);
    }
    if *bias {
        let b = &mut a[2].f;
        let v = b[15];
        b[16] = v;
        b[n as usize - 1] = v;
        if variant == 2 {
            b[15] = f32::NAN;
        }
        if variant == 3 {
            b.iter_mut().for_each(|x| *x = f32::NAN);
        }
    }
    a
}

/// The lm_head with argmax in its GEMV picks, bit for bit, what the same
/// GEMV storing the logits followed by the GPU argmax picks (the logits are
/// the same f32 sums), for T in 1..8, the Qwen vocabulary and odd ones,
/// with and without the norm prologue and a bias, f32 and bf16/f16 logits;
/// ties across a block boundary go to the first row, NaN logits never win,
/// a row of NaN gives 0; and each pick is a maximum of the CPU reference's
/// logits within the sums' tolerance.
#[test]
fn the_argmax_gemv_picks_what_the_unfused_gpu_argmax_picks_at_awkward_sizes() {
    use kiln_ir::Epilogue;
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(17);
    for d in [DType::BF16, DType::F16] {
        for (t, n, k) in [
            (1, 151_936, 1024),
            (3, 1001, 72),
            (5, 50_257, 520),
            (8, 4098, 64),
            (2, 33, 8),
            (7, 151_936, 128),
            (4, 129, 1024),
        ] {
            for (pre, out) in [
                (true, DType::F32),
                (false, d),
                (true, d),
                (false, DType::F32),
            ] {
                for variant in 0..4u32 {
                    let bias = variant >= 2 || (t + pre as u32) % 2 == 1;
                    let what = format!("argmax gemv {d} t{t} n{n} k{k} pre={pre} out={out} bias={bias} variant {variant}");
                    let fused = fused_op(bias, out, pre, Epilogue::Argmax);
                    let args = argmax_case(&mut r, &fused, d, (t, n, k), variant);
                    let got = run_op(&mut b, &fused, &args).remove(0).i;
                    // The unfused GPU pair over the same operands.
                    let logits =
                        run_op(&mut b, &fused_op(bias, out, pre, Epilogue::None), &args).remove(0);
                    let want = run_op(&mut b, &Op::Argmax, std::slice::from_ref(&logits))
                        .remove(0)
                        .i;
                    assert_eq!(got, want, "{what}: vs the GEMV + argmax");
                    match variant {
                        1 => assert!(got.iter().all(|&i| i == 15), "{what}: {got:?}"),
                        2 => assert!(got.iter().all(|&i| i == 16), "{what}: {got:?}"),
                        3 => assert!(got.iter().all(|&i| i == 0), "{what}: {got:?}"),
                        _ => {}
                    }
                    // Against the CPU reference's logits: a maximum within
                    // twice the GEMV's tolerance of the row's largest logit.
                    let cpu = cpu_reference(&fused_op(bias, out, pre, Epilogue::None), &args)
                        .expect("cpu fused_matmul")
                        .remove(0);
                    for (row, &i) in got.iter().enumerate() {
                        let l = &cpu.f[row * n as usize..(row + 1) * n as usize];
                        let max = l
                            .iter()
                            .copied()
                            .filter(|v| !v.is_nan())
                            .fold(f32::NEG_INFINITY, f32::max);
                        if variant == 3 {
                            continue;
                        }
                        let slack = 4.0 * tol(d) as f32 * max.abs().max(1.0);
                        assert!(
                            l[i as usize] >= max - slack,
                            "{what}: row {row} picks {i} ({} vs {max})",
                            l[i as usize]
                        );
                    }
                }
            }
        }
    }
}

/// A captured step with the argmax GEMV and, beside it, the unfused GEMV +
/// argmax over the same operands, replayed over fresh inputs: the tokens
/// agree every step and change with the input. The completion counter is
/// what replay proves: a last block that did not reset it would leave the
/// next replay without a merging block, and its poisoned tokens would
/// differ.
#[test]
fn the_argmax_gemv_replays_with_fresh_inputs_and_resets_its_counter() {
    use kiln_ir::Epilogue;
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(18);
    let d = DType::BF16;
    for (t, h, v) in [(1u32, 1024u32, 151_936u32), (3, 256, 1001)] {
        let x = poisoned(&mut b, &TensorType::new(d, vec![t, h]));
        let lm = put(&mut b, &HT::random(&mut r, d, &[v, h], 0.2));
        let nw = put(&mut b, &HT::random(&mut r, d, &[h], 1.0));
        let logits = poisoned(&mut b, &TensorType::new(DType::F32, vec![t, v]));
        let want = poisoned(&mut b, &TensorType::new(DType::I32, vec![t]));
        let got = poisoned(&mut b, &TensorType::new(DType::I32, vec![t]));
        let l = |op: Op, args: Vec<DevOperand>, results: Vec<DevOperand>| Launch {
            const_args: if matches!(op, Op::FusedMatMul { .. }) {
                2
            } else {
                0
            },
            body: kiln_runtime::backend::LaunchBody::Reference,
            kernel: op.mnemonic().into(),
            op,
            args,
            results,
            workspace: None,
        };
        let mut launches = vec![
            l(
                fused_op(false, DType::F32, true, Epilogue::Argmax),
                vec![x.clone(), lm.clone(), nw.clone()],
                vec![got.clone()],
            ),
            l(
                fused_op(false, DType::F32, true, Epilogue::None),
                vec![x.clone(), lm.clone(), nw.clone()],
                vec![logits.clone()],
            ),
            l(Op::Argmax, vec![logits.clone()], vec![want.clone()]),
        ];
        let pdl = b.pdl();
        let mut owned = Vec::new();
        for l in &mut launches {
            owned.extend(gpu_bodies::lower(&mut b, l, pdl));
            b.prepare(l).unwrap();
        }
        b.upload(x.ptr, &HT::random(&mut r, d, &[t, h], 2.0).bytes())
            .unwrap();
        b.begin_capture(Key::new(t, 1, 0)).unwrap();
        for l in &launches {
            b.launch(l).unwrap();
        }
        let g = b.end_capture().unwrap();
        let mut seen = Vec::new();
        for step in 0..8 {
            for o in [&logits, &want, &got] {
                b.upload(o.ptr, &vec![0xFF; o.ty.size_bytes() as usize])
                    .unwrap();
            }
            b.upload(x.ptr, &HT::random(&mut r, d, &[t, h], 2.0).bytes())
                .unwrap();
            b.replay(g).unwrap();
            b.synchronize().unwrap();
            let (w, g2) = (get(&mut b, &want).i, get(&mut b, &got).i);
            assert_eq!(g2, w, "t{t} v{v} step {step}");
            seen.push(g2);
        }
        seen.dedup();
        assert!(
            seen.len() > 1,
            "t{t} v{v}: replay ignored the refreshed input"
        );
        b.destroy_graph(g).unwrap();
        for p in owned {
            let _ = b.free(p);
        }
    }
}

/// `rope_attention` inputs: `ctx` per sequence, `query` new tokens each at
/// positions `ctx - query ..`, their slots through shuffled block tables
/// (block 0 reserved), random caches and packed qkv rows, and norm weights
/// when `norm`.
#[allow(clippy::too_many_arguments)]
fn rope_attention_case(
    r: &mut Rng,
    d: DType,
    ctx: &[i32],
    query: u32,
    heads: u32,
    kvh: u32,
    hd: u32,
    bs: u32,
    max_blocks: u32,
    norm: bool,
) -> Vec<HT> {
    let a = attention_case(r, d, ctx, query, heads, kvh, hd, bs, max_blocks);
    let (kc, vc, bt, cl) = (a[1].clone(), a[2].clone(), a[3].clone(), a[4].clone());
    let (mut pos, mut slots) = (vec![], vec![]);
    for (s, &len) in ctx.iter().enumerate() {
        for qi in 0..query as i32 {
            let p = len - query as i32 + qi;
            pos.push(p);
            let blk = bt.i[s * max_blocks as usize + (p as u32 / bs) as usize];
            slots.push(blk * bs as i32 + p % bs as i32);
        }
    }
    let t = ctx.len() as u32 * query;
    let mut args = vec![
        HT::random(r, d, &[t, (heads + 2 * kvh) * hd], 2.0),
        HT::ints(&[t], pos),
        HT::ints(&[t], slots),
        kc,
        vc,
        bt,
        cl,
    ];
    if norm {
        args.push(HT::random(r, d, &[hd], 1.0));
        args.push(HT::random(r, d, &[hd], 1.0));
    }
    args
}

/// The unfused pair on the device: `qkv_rope_kv_write`, then
/// `paged_attention` over the q and caches it wrote.
fn unfused_rope_attention(b: &mut CudaBackend, op: &Op, args: &[HT]) -> Vec<HT> {
    let (rope_op, attn_op) = op.split_rope_attention().unwrap();
    let mut rargs = args[..5].to_vec();
    rargs.extend_from_slice(&args[7..]);
    let r = run_op(b, &rope_op, &rargs);
    let a = run_op(
        b,
        &attn_op,
        &[
            r[0].clone(),
            r[1].clone(),
            r[2].clone(),
            args[5].clone(),
            args[6].clone(),
        ],
    );
    vec![a[0].clone(), r[1].clone(), r[2].clone()]
}

/// Attention attributes at the usual scale `1 / sqrt(hd)`.
fn attn_attrs(
    heads: u32,
    kvh: u32,
    hd: u32,
    q: u32,
    bs: u32,
    window: Option<u32>,
    softcap: Option<f32>,
) -> AttnAttrs {
    AttnAttrs {
        heads,
        kv_heads: kvh,
        head_dim: hd,
        query: q,
        block_size: bs,
        scale: 1.0 / (hd as f32).sqrt(),
        window,
        softcap,
    }
}

#[allow(clippy::too_many_arguments)]
fn rope_attention_op(
    heads: u32,
    kvh: u32,
    hd: u32,
    q: u32,
    bs: u32,
    window: Option<u32>,
    softcap: Option<f32>,
    norm: bool,
) -> Op {
    Op::RopeAttention {
        attn: attn_attrs(heads, kvh, hd, q, bs, window, softcap),
        rope: rope(1e6),
        qk_norm: norm.then_some(1e-6),
        unit_offset: false,
    }
}

#[test]
fn rope_attention_matches_the_unfused_pair_bit_for_bit_and_the_references() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(31);
    // (dtype, ctx lens, query, heads, kvh, hd, block size, max blocks, window, softcap, norm)
    #[allow(clippy::type_complexity)]
    let cases: Vec<(
        DType,
        Vec<i32>,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        Option<u32>,
        Option<f32>,
        bool,
    )> = vec![
        // Qwen3-0.6B's attention at b1 and b3 (q/k norm), contexts in one
        // and in several clusters.
        (
            DType::BF16,
            vec![512],
            1,
            16,
            8,
            128,
            16,
            40,
            None,
            None,
            true,
        ),
        (
            DType::BF16,
            vec![1, 17, 300],
            1,
            16,
            8,
            128,
            16,
            20,
            None,
            None,
            true,
        ),
        (
            DType::BF16,
            vec![4800, 1000],
            1,
            16,
            8,
            128,
            16,
            300,
            None,
            None,
            false,
        ),
        // Query windows (speculative keys): new positions in one partition
        // and spread over two, row tiles per kv head > 1.
        (
            DType::BF16,
            vec![5, 130],
            3,
            8,
            2,
            64,
            16,
            10,
            Some(37),
            None,
            false,
        ),
        (DType::BF16, vec![40], 8, 8, 1, 128, 16, 3, None, None, true),
        (
            DType::F16,
            vec![150, 3],
            2,
            8,
            4,
            64,
            16,
            12,
            Some(50),
            Some(20.0),
            true,
        ),
        (DType::F32, vec![70], 1, 2, 1, 64, 16, 5, None, None, false),
        // Gemma-3's head_dim 256 with a window and a softcap.
        (
            DType::BF16,
            vec![90],
            1,
            4,
            1,
            256,
            32,
            4,
            Some(64),
            Some(50.0),
            true,
        ),
        // head_dim 36 takes the phased attention: the unfused pair runs.
        (
            DType::F16,
            vec![45, 5],
            2,
            4,
            1,
            36,
            16,
            4,
            None,
            Some(30.0),
            false,
        ),
    ];
    for (d, ctx, q, heads, kvh, hd, bs, mb, window, softcap, norm) in cases {
        let args = rope_attention_case(&mut r, d, &ctx, q, heads, kvh, hd, bs, mb, norm);
        let op = rope_attention_op(heads, kvh, hd, q, bs, window, softcap, norm);
        let what = format!(
            "rope_attention {d} ctx={ctx:?} q={q} {heads}/{kvh}x{hd} window={window:?} norm={norm}"
        );
        for clusters in [true, false] {
            let run = |b: &mut CudaBackend| {
                check_op(b, &what, &op, &args);
                (run_op(b, &op, &args), unfused_rope_attention(b, &op, &args))
            };
            let (fused, pair) = if clusters {
                run(&mut b)
            } else {
                gpu_bodies::without_clusters(|| run(&mut b))
            };
            for (i, name) in ["output", "k cache", "v cache"].iter().enumerate() {
                assert_eq!(
                    fused[i].bytes(),
                    pair[i].bytes(),
                    "{what} clusters={clusters}: {name} differs from the unfused pair's"
                );
            }
            assert_ne!(fused[1].bytes(), args[3].bytes(), "{what}: no key written");
        }
    }
}

#[test]
fn rope_attention_replays_what_the_unfused_pair_computes_with_fresh_inputs() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(32);
    let d = DType::BF16;
    let (heads, kvh, hd, bs, mb) = (16u32, 8u32, 128u32, 16u32, 40u32);
    let ctx0 = [300i32, 31];
    let op = rope_attention_op(heads, kvh, hd, 1, bs, None, None, true);
    let args = rope_attention_case(&mut r, d, &ctx0, 1, heads, kvh, hd, bs, mb, true);
    let dev: Vec<DevOperand> = args.iter().map(|a| put(&mut b, a)).collect();
    let out = poisoned(&mut b, &TensorType::new(d, vec![2, heads * hd]));
    let mut launch = Launch {
        const_args: 0,
        body: kiln_runtime::backend::LaunchBody::Reference,
        kernel: "test:rope_attention".into(),
        op: op.clone(),
        args: dev.clone(),
        results: vec![out.clone(), dev[3].clone(), dev[4].clone()],
        workspace: None,
    };
    let pdl = b.pdl();
    let owned = gpu_bodies::lower(&mut b, &mut launch, pdl);
    b.prepare(&launch).unwrap();
    b.begin_capture(Key::new(2, 1, 0)).unwrap();
    b.launch(&launch).unwrap();
    let g = b.end_capture().unwrap();
    // The host's copy of the inputs, stepped as a decode loop steps them.
    let mut host = args.clone();
    let mut seen = Vec::new();
    let before = b.counters().graphs.replays();
    for step in 0..6 {
        let ctx: Vec<i32> = ctx0.iter().map(|c| c + step).collect();
        let fresh = rope_attention_case(&mut r, d, &ctx, 1, heads, kvh, hd, bs, mb, true);
        // New qkv rows, positions and slots; the tables, lengths and norm
        // weights stay as captured except the lengths, which grow.
        let slots: Vec<i32> = (0..2)
            .map(|s| {
                let p = ctx[s] - 1;
                let blk = host[5].i[s * mb as usize + (p as u32 / bs) as usize];
                blk * bs as i32 + p % bs as i32
            })
            .collect();
        host[0] = fresh[0].clone();
        host[1] = HT::ints(&[2], ctx.iter().map(|c| c - 1).collect());
        host[2] = HT::ints(&[2], slots);
        host[6] = HT::ints(&[2], ctx.clone());
        for i in [0, 1, 2, 6] {
            b.upload(dev[i].ptr, &host[i].bytes()).unwrap();
        }
        b.upload(out.ptr, &vec![0xFF; out.ty.size_bytes() as usize])
            .unwrap();
        let want = unfused_rope_attention(&mut b, &op, &host);
        b.replay(g).unwrap();
        b.synchronize().unwrap();
        let got = get(&mut b, &out);
        assert_eq!(got.bytes(), want[0].bytes(), "step {step}: output");
        let (kc, vc) = (get(&mut b, &dev[3]), get(&mut b, &dev[4]));
        assert_eq!(kc.bytes(), want[1].bytes(), "step {step}: k cache");
        assert_eq!(vc.bytes(), want[2].bytes(), "step {step}: v cache");
        host[3] = kc;
        host[4] = vc;
        seen.push(got.bytes());
    }
    assert_eq!(b.counters().graphs.replays() - before, 6);
    seen.dedup();
    assert_eq!(seen.len(), 6, "replay ignored the refreshed inputs");
    b.destroy_graph(g).unwrap();
    for o in dev.iter().chain([&out]) {
        let _ = b.free(o.ptr);
    }
    for p in owned {
        let _ = b.free(p);
    }
}

/// A dense `matmul_qkv_rope` case: x, w, [bias], pos, slots, caches,
/// [q_norm, k_norm] as host tensors, the op, and its unfused pair's ops.
fn dense_qkv_rope_case(
    r: &mut Rng,
    d: DType,
    (heads, kvh, hd): (u32, u32, u32),
    k: u32,
    bias: bool,
    norm: bool,
    slot: i32,
) -> (Op, Vec<HT>) {
    let n = (heads + 2 * kvh) * hd;
    let slots = 7u32;
    let mut args = vec![
        HT::random(r, d, &[1, k], 2.0),
        HT::random(r, d, &[n, k], 0.1),
    ];
    if bias {
        args.push(HT::random(r, d, &[n], 0.5));
    }
    args.push(HT::ints(&[1], vec![(r.next_u64() % 3000) as i32]));
    args.push(HT::ints(&[1], vec![slot]));
    args.push(HT::random(r, d, &[slots, kvh * hd], 1.0));
    args.push(HT::random(r, d, &[slots, kvh * hd], 1.0));
    if norm {
        args.push(HT::random(r, d, &[hd], 1.0));
        args.push(HT::random(r, d, &[hd], 1.0));
    }
    let op = Op::MatMulQkvRope {
        bias,
        pre: None,
        heads,
        kv_heads: kvh,
        head_dim: hd,
        rope: rope(1_000_000.0),
        qk_norm: norm.then_some(1e-6),
        unit_offset: norm && hd == 64,
    };
    (op, args)
}

/// The unfused pair on the device: the matmul through kiln's GEMV (the
/// kernel the fused op's launch runs), then `qkv_rope_kv_write`.
fn unfused_qkv_rope(b: &mut CudaBackend, op: &Op, args: &[HT]) -> Vec<HT> {
    let d = args[0].ty.dtype;
    let (mm, rope_op) = op.split_matmul_qkv_rope(d).unwrap();
    let Op::FusedMatMul { bias, out, .. } = mm else {
        unreachable!()
    };
    let m = 2 + bias as usize;
    let qkv = run_op_as(
        b,
        &Op::MatMul { bias, out },
        &args[..m],
        Some(GemmKind::Gemv),
    );
    let mut rargs = qkv;
    rargs.extend_from_slice(&args[m..]);
    run_op(b, &rope_op, &rargs)
}

/// The dense packed q/k/v GEMV with the rope tail (`gemv_[staged_]
/// [kN_]rope_t1_*`, what `matmul_qkv_rope` lowers to over a dense weight)
/// against the unfused GEMV and `qkv_rope_kv_write`, bit for bit, and
/// against the host reference: bf16 and f16, the register and the staged
/// GEMV at every split (Qwen3-0.6B's qkv shape runs the register kernel,
/// Llama-3.2-1B's and SmolLM2's the staged one), blocks covering part of
/// a head, one head and several, bias, q/k norm, a slot out of range (the
/// caches untouched, q still written); q poisoned.
#[test]
fn dense_qkv_gemv_with_the_rope_tail_matches_the_unfused_pair_bit_for_bit() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(77);
    let cases = [
        (DType::BF16, (16u32, 8u32, 128u32), 1024u32, false, true, 3),
        (DType::BF16, (32, 8, 64), 2048, false, false, 0),
        (DType::BF16, (9, 3, 64), 576, true, false, 6),
        (DType::F16, (4, 1, 256), 640, true, true, 2),
        (DType::BF16, (6, 3, 16), 64, false, true, 9),
        (DType::F16, (2, 1, 8), 256, true, false, 1),
        (DType::BF16, (16, 8, 128), 4104, true, true, 5),
    ];
    for (d, heads, k, bias, norm, slot) in cases {
        let (op, args) = dense_qkv_rope_case(&mut r, d, heads, k, bias, norm, slot);
        let what =
            format!("matmul_qkv_rope {d} {heads:?} k={k} bias={bias} norm={norm} slot={slot}");
        check_op(&mut b, &what, &op, &args);
        let fused = run_op(&mut b, &op, &args);
        let pair = unfused_qkv_rope(&mut b, &op, &args);
        for (i, name) in ["q", "k cache", "v cache"].iter().enumerate() {
            assert_eq!(
                fused[i].bytes(),
                pair[i].bytes(),
                "{what}: {name} differs from the unfused pair's"
            );
        }
        let kc_at = 2 + bias as usize + 2;
        if slot < 7 {
            assert_ne!(
                fused[1].bytes(),
                args[kc_at].bytes(),
                "{what}: no key written"
            );
        } else {
            assert_eq!(
                fused[1].bytes(),
                args[kc_at].bytes(),
                "{what}: a bad slot was written"
            );
        }
    }
}

/// The dense rope GEMV captured once and replayed with a new x, position
/// and slot every step: each replay equals the unfused pair on that step's
/// inputs (so its completion counters were back at zero), and the replay
/// counter moves. With the q/k norm (the counted tail) and without it (the
/// pair epilogue), on the register (Qwen3-0.6B's qkv shape) and the staged
/// GEMV (Llama-3.2-1B's).
#[test]
fn dense_qkv_gemv_with_the_rope_tail_replays_what_the_unfused_pair_computes() {
    let Some(mut b) = device() else { return };
    let mut r = Rng::new(78);
    let qwen3 = (16u32, 8u32, 128u32);
    for (heads, norm, k) in [
        (qwen3, true, 1024u32),
        (qwen3, false, 1024),
        ((32, 8, 64), false, 2048),
    ] {
        let (op, mut host) = dense_qkv_rope_case(&mut r, DType::BF16, heads, k, false, norm, 0);
        let dev: Vec<DevOperand> = host.iter().map(|a| put(&mut b, a)).collect();
        let q = poisoned(
            &mut b,
            &TensorType::new(DType::BF16, vec![1, heads.0 * heads.2]),
        );
        let mut launch = Launch {
            const_args: 2,
            body: kiln_runtime::backend::LaunchBody::Reference,
            kernel: "test:matmul_qkv_rope".into(),
            op: op.clone(),
            args: dev.clone(),
            results: vec![q.clone(), dev[4].clone(), dev[5].clone()],
            workspace: None,
        };
        let pdl = b.pdl();
        let owned = gpu_bodies::lower(&mut b, &mut launch, pdl);
        b.prepare(&launch).unwrap();
        b.begin_capture(Key::new(1, 1, 0)).unwrap();
        b.launch(&launch).unwrap();
        let g = b.end_capture().unwrap();
        let before = b.counters().graphs.replays();
        for step in 0..5 {
            let what = format!("norm={norm} k={k} step {step}");
            host[0] = HT::random(&mut r, DType::BF16, &[1, k], 1.0 + step as f32);
            host[2] = HT::ints(&[1], vec![200 + 3 * step]);
            host[3] = HT::ints(&[1], vec![step % 7]);
            for i in [0, 2, 3] {
                b.upload(dev[i].ptr, &host[i].bytes()).unwrap();
            }
            b.upload(q.ptr, &vec![0xFF; q.ty.size_bytes() as usize])
                .unwrap();
            let want = unfused_qkv_rope(&mut b, &op, &host);
            b.replay(g).unwrap();
            b.synchronize().unwrap();
            assert_eq!(get(&mut b, &q).bytes(), want[0].bytes(), "{what}: q");
            let (kc, vc) = (get(&mut b, &dev[4]), get(&mut b, &dev[5]));
            assert_eq!(kc.bytes(), want[1].bytes(), "{what}: k cache");
            assert_eq!(vc.bytes(), want[2].bytes(), "{what}: v cache");
            host[4] = kc;
            host[5] = vc;
        }
        assert_eq!(b.counters().graphs.replays() - before, 5);
        b.destroy_graph(g).unwrap();
        for o in dev.iter().chain([&q]) {
            let _ = b.free(o.ptr);
        }
        for p in owned {
            let _ = b.free(p);
        }
    }
}
