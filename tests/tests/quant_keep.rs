//! Quantized weights kept as stored, end to end on the CPU backend: a tiny
//! random GGUF (llama, so q/k rows are permuted by llama.cpp's converter)
//! imported with `--keep-quant` keeps the GGUF blocks (rows moved back),
//! compiles into a plan whose matmul and embedding weights are stored
//! quantized, and decodes the same greedy tokens as the bf16 import of the
//! same file. A damaged kept tensor is refused at load, by name.

use half::bf16;
use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::gguf::fixture::TinyLlama;
use kiln_compiler::gguf::{dequant, GgmlType, GgufFile};
use kiln_compiler::import::{import_gguf, ImportOptions};
use kiln_ir::Key;
use kiln_runtime::{CpuBackend, Engine, EngineOptions, GraphMode, SeqOptions};
use safetensors::SafeTensors;
use std::path::Path;

const NEW_TOKENS: u32 = 10;

fn opts() -> CompileOptions {
    CompileOptions {
        keys: vec![Key::new(1, 1, 0), Key::new(1, 8, 0)],
        kv: KvOptions {
            block_size: 16,
            kv_blocks: Some(16),
            max_context: Some(64),
            ..KvOptions::default()
        },
        logits: true,
        ..CompileOptions::default()
    }
}

fn engine(plan: &kiln_ir::plan::Plan, dir: &Path) -> Result<Engine, kiln_runtime::EngineError> {
    let opts = EngineOptions {
        graphs: GraphMode::On,
        log: false,
        ..EngineOptions::default()
    };
    Engine::new(plan.clone(), dir, Box::new(CpuBackend::new()), opts)
}

fn greedy(plan: &kiln_ir::plan::Plan, dir: &Path, prompt: &[u32]) -> Vec<u32> {
    let mut e = engine(plan, dir).unwrap();
    let id = e
        .add_sequence_with(
            prompt,
            SeqOptions {
                max_new_tokens: NEW_TOKENS,
                stop_on_eos: false,
            },
        )
        .unwrap();
    while e.has_work() {
        e.step().unwrap();
    }
    e.sequence(id).unwrap().generated.to_vec()
}

/// The logits row of every generated position when the sequence is forced
/// to continue with `forced` (teacher forcing), so two plans are compared
/// on the same inputs even where their greedy choices part.
fn forced_logits(
    plan: &kiln_ir::plan::Plan,
    dir: &Path,
    prompt: &[u32],
    forced: &[u32],
) -> Vec<Vec<f32>> {
    let mut e = engine(plan, dir).unwrap();
    e.set_keep_logits(true);
    let id = e
        .add_sequence_with(
            prompt,
            SeqOptions {
                max_new_tokens: forced.len() as u32,
                stop_on_eos: false,
            },
        )
        .unwrap();
    let mut rows = Vec::new();
    while e.has_work() {
        e.step().unwrap();
        let n = e.sequence(id).unwrap().generated.len();
        if n > rows.len() {
            rows.push(e.last_logits(id).unwrap().to_vec());
            if e.sequence(id).unwrap().finished.is_none() {
                e.replace_last_token(id, forced[n - 1]).unwrap();
            }
        }
    }
    rows
}

/// The largest logit difference relative to the bf16 row's range, over
/// every position of every prompt, under teacher forcing with the bf16
/// plan's greedy tokens. Two argmaxes can only part where the bf16 margin
/// is at most twice the largest difference (a near-tie), so a small bound
/// here makes every differing greedy token a documented near-tie.
fn worst_relative_logit_error(
    a: (&kiln_ir::plan::Plan, &Path),
    b: (&kiln_ir::plan::Plan, &Path),
) -> f32 {
    let mut worst = 0f32;
    for p in prompts() {
        let tokens = greedy(a.0, a.1, &p);
        let la = forced_logits(a.0, a.1, &p, &tokens);
        let lb = forced_logits(b.0, b.1, &p, &tokens);
        assert_eq!(la.len(), tokens.len());
        assert_eq!(lb.len(), tokens.len());
        for (ra, rb) in la.iter().zip(&lb) {
            let (lo, hi) = ra
                .iter()
                .fold((f32::MAX, f32::MIN), |(l, h), v| (l.min(*v), h.max(*v)));
            let d = ra
                .iter()
                .zip(rb)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            worst = worst.max(d / (hi - lo));
        }
    }
    worst
}

struct Imported {
    _tmp: tempfile::TempDir,
    gguf: std::path::PathBuf,
    dense: std::path::PathBuf,
    kept: std::path::PathBuf,
}

fn import_both(model: &TinyLlama) -> Imported {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("tiny.gguf");
    model.build().unwrap().writer.write(&gguf).unwrap();
    let dense = tmp.path().join("dense");
    let kept = tmp.path().join("kept");
    import_gguf(&gguf, &dense, &ImportOptions::default()).unwrap();
    let report = import_gguf(
        &gguf,
        &kept,
        &ImportOptions {
            keep_quant: true,
            ..ImportOptions::default()
        },
    )
    .unwrap();
    assert!(!report.kept_quant.is_empty(), "nothing was kept");
    Imported {
        _tmp: tmp,
        gguf,
        dense,
        kept,
    }
}

/// Every kept tensor is U8 `[N, row_bytes]` with its `kiln.quant.*` entry,
/// and its blocks decode to exactly the bf16 import's values (rounded to
/// bf16): the blocks are the GGUF's, with q/k rows moved back.
fn assert_kept_blocks_match_the_dense_import(im: &Imported, expect_kept: usize) {
    let kept_bytes = std::fs::read(im.kept.join("model.safetensors")).unwrap();
    let dense_bytes = std::fs::read(im.dense.join("model.safetensors")).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&kept_bytes).unwrap();
    let meta = meta.metadata().clone().unwrap_or_default();
    let kept = SafeTensors::deserialize(&kept_bytes).unwrap();
    let dense = SafeTensors::deserialize(&dense_bytes).unwrap();
    let g = GgufFile::open(&im.gguf).unwrap();
    let mut seen = 0;
    for (name, view) in kept.tensors() {
        let d = dense.tensor(&name).unwrap();
        let Some(m) = meta.get(&format!("kiln.quant.{name}")) else {
            assert_eq!(view.dtype(), safetensors::Dtype::BF16, "{name}");
            assert_eq!(view.data(), d.data(), "{name} differs from the bf16 import");
            continue;
        };
        seen += 1;
        assert_eq!(view.dtype(), safetensors::Dtype::U8, "{name}");
        let (n, k) = (d.shape()[0], d.shape()[1]);
        let storage = m.split(':').next().unwrap();
        assert_eq!(m, &format!("{storage}:{n}:{k}"), "{name}");
        let ty = [
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
        ]
        .into_iter()
        .find(|t| dequant::quant_type(*t).is_some_and(|q| q.name() == storage))
        .unwrap();
        let rb = dequant::byte_len(ty, k).unwrap();
        assert_eq!(view.shape(), [n, rb], "{name}");
        let values = dequant::dequantize(ty, view.data(), n * k).unwrap();
        let want: Vec<u8> = values
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect();
        assert!(
            want == d.data(),
            "{name}: kept blocks decode to other values"
        );
    }
    assert_eq!(seen, expect_kept);
    // The q/k rows really moved: the kept q_proj is not the GGUF's bytes.
    let q = kept
        .tensor("model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    let raw = g.tensor_bytes(g.tensor("blk.0.attn_q.weight").unwrap());
    assert_eq!(q.data().len(), raw.len());
    assert_ne!(q.data(), raw, "q rows were not un-permuted");
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 40, 72, 101],
        vec![1, 200, 7, 7, 9, 33, 250],
        vec![5],
    ]
}

fn assert_same_greedy_tokens(im: &Imported) {
    let dense_plan = compile_dir(&im.dense, &opts(), &mut |_, _| {})
        .unwrap()
        .plan;
    let kept_plan = compile_dir(&im.kept, &opts(), &mut |_, _| {}).unwrap().plan;
    let stored: Vec<_> = kept_plan
        .manifest
        .entries
        .iter()
        .filter(|e| e.storage.is_some())
        .collect();
    assert!(!stored.is_empty(), "the kept plan has no quantized weight");
    assert!(kept_plan.manifest.total_bytes() < dense_plan.manifest.total_bytes());
    for p in prompts() {
        let a = greedy(&dense_plan, &im.dense, &p);
        let b = greedy(&kept_plan, &im.kept, &p);
        assert_eq!(a.len(), NEW_TOKENS as usize);
        assert_eq!(a, b, "prompt {p:?}: bf16 import vs kept blocks");
    }
}

#[test]
fn a_q4_1_gguf_imported_with_keep_quant_keeps_its_blocks_and_decodes_like_the_bf16_import() {
    let model = TinyLlama::default();
    let im = import_both(&model);
    // 7 matrices per layer and the (tied) Q8_0 embedding.
    assert_kept_blocks_match_the_dense_import(&im, 7 * model.layers + 1);
    assert_same_greedy_tokens(&im);
}

#[test]
fn k_quant_and_q5_0_weights_are_kept_and_decode_like_the_bf16_import() {
    for (matrix, embed) in [
        // Q4_K as the tied embedding (so the lm_head matmul reads it too).
        // As every projection of this random model, Q4_K's random
        // per-sub-block minimums make the network so sensitive that int8
        // activations move the logits by ~20% of their range: the real
        // Q4_K_M Gemma-3 test (gemma3_real.rs) is the check there.
        (GgmlType::Q4_0, GgmlType::Q4K),
        (GgmlType::Q5K, GgmlType::Q5_0),
        (GgmlType::Q6K, GgmlType::Q4_0),
    ] {
        let model = TinyLlama {
            hidden: 256,
            ffn: 256,
            matrix_type: matrix,
            embed_type: embed,
            ..TinyLlama::default()
        };
        let im = import_both(&model);
        assert_kept_blocks_match_the_dense_import(&im, 7 * model.layers + 1);
        let dense_plan = compile_dir(&im.dense, &opts(), &mut |_, _| {})
            .unwrap()
            .plan;
        let kept_plan = compile_dir(&im.kept, &opts(), &mut |_, _| {}).unwrap().plan;
        let err = worst_relative_logit_error((&dense_plan, &im.dense), (&kept_plan, &im.kept));
        let mut same = 0;
        for p in prompts() {
            let a = greedy(&dense_plan, &im.dense, &p);
            let b = greedy(&kept_plan, &im.kept, &p);
            same += a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        }
        eprintln!(
            "{matrix}/{embed}: worst relative logit error {err}, {same} leading tokens equal"
        );
        assert!(
            err < 0.1,
            "{matrix}/{embed}: logits differ by {err} of their range"
        );
    }
}

#[test]
fn a_kept_tensor_of_the_wrong_byte_length_is_refused_at_load_naming_it() {
    let im = import_both(&TinyLlama::default());
    let plan = compile_dir(&im.kept, &opts(), &mut |_, _| {}).unwrap().plan;
    let path = im.kept.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let victim = "model.layers.1.mlp.down_proj.weight";
    let mut views = Vec::new();
    let mut cut: Vec<u8> = Vec::new();
    for (name, v) in st.tensors() {
        if name == victim {
            // One row short: the length no longer matches [N, row_bytes].
            let (n, rb) = (v.shape()[0], v.shape()[1]);
            cut = v.data()[..(n - 1) * rb].to_vec();
            continue;
        }
        views.push((name, v));
    }
    let rb = st.tensor(victim).unwrap().shape()[1];
    let n = st.tensor(victim).unwrap().shape()[0];
    let short = safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![n - 1, rb], &cut)
        .unwrap();
    views.push((victim.to_string(), short));
    let out = safetensors::serialize(views, meta.metadata().clone()).unwrap();
    std::fs::write(&path, &out).unwrap();
    // The plan's fingerprint of the file alone would refuse it; record the
    // damaged file's so the binder's own length check is what answers.
    let mut plan = plan;
    let sf = &mut plan.meta.files[0];
    sf.size = out.len() as u64;
    sf.header_sha256 = kiln_runtime::weights::header_sha256(&out).unwrap();
    let err = engine(&plan, &im.kept)
        .err()
        .expect("a damaged tensor loaded");
    let msg = err.to_string();
    assert!(msg.contains(victim), "{msg}");
    assert!(msg.contains("import the model again"), "{msg}");
}

#[test]
fn a_kept_plan_for_a_gpu_lowers_its_quantized_weights_to_qgemv_and_qskinny_launches_over_repacked_buffers(
) {
    let model = TinyLlama {
        hidden: 256,
        ffn: 256,
        matrix_type: GgmlType::Q4K,
        embed_type: GgmlType::Q6K,
        ..TinyLlama::default()
    };
    let im = import_both(&model);
    let opts = CompileOptions {
        target: kiln_ir::plan::Target::Cuda { sm: 90 },
        ..opts()
    };
    let plan = compile_dir(&im.kept, &opts, &mut |_, _| {}).unwrap().plan;
    let mut entries = std::collections::BTreeSet::new();
    for kp in &plan.keys {
        for op in &kp.ops {
            let quantized = op.args.get(1).is_some_and(|a| a.ty.storage.is_some());
            match &op.lowering {
                kiln_ir::plan::Lowering::Kernels(ls) if quantized => {
                    for l in ls {
                        // One token: the GEMV; more: the tensor-core GEMM.
                        let want = if l.entry.starts_with("qskinny_") {
                            "qskinny"
                        } else {
                            "qgemv"
                        };
                        assert_eq!(l.module, want, "{}", op.kernel);
                        entries.insert(l.entry.clone());
                    }
                    // The weight operand is sized for the GPU layout.
                    let w = &op.args[1].ty;
                    let [n, k] = w.shape.dims() else { panic!() };
                    let gpu = w
                        .storage
                        .unwrap()
                        .gpu_bytes(u64::from(*n), u64::from(*k))
                        .unwrap();
                    assert!(op.args[1].buf.bytes >= gpu, "{}", op.kernel);
                }
                other if quantized => panic!("{} lowered to {other:?}", op.kernel),
                _ => {}
            }
        }
    }
    // The b1 integer-dot GEMV (the CUDA default) and the 8-token
    // tensor-core GEMM over Q4_K matrices (with its unit ring), and the
    // Q6_K embedding/lm_head; no 8-token key loops the GEMV any more. Every
    // GEMV of the tiny model is under a wave of blocks with rows under
    // 2048, so the geometry rule gives it one vector in flight per row of
    // four, pipelined.
    let geom = kiln_kernels::quant_gpu::QdotGeom::R4U1K1P.tag();
    let ring = kiln_kernels::quant_gpu::skinny_prefetch(None, kiln_ir::QuantType::Q4K)
        .unwrap()
        .map_or(String::new(), |d| format!("_pf{d}"));
    let skinny = format!("qskinny_q4k_t8_r1{ring}_bf16_bf16");
    for e in [
        format!("qgemv_i8{geom}_q4k_t1_bf16_bf16"),
        skinny.clone(),
        "qgather_q6k_bf16".into(),
    ] {
        assert!(entries.contains(e.as_str()), "{e} missing from {entries:?}");
    }
    assert!(!entries.contains("qgemv_q4k_t8_bf16_bf16"), "{entries:?}");
    // `kiln inspect` shows the choice in the 8-token key's launch list.
    let text = kiln_compiler::inspect::render(
        &plan,
        Some(Key::new(1, 8, 0)),
        kiln_compiler::inspect::Format::Text,
    )
    .unwrap();
    assert!(text.contains(&skinny), "{text}");
    // Every GEMM runs as qgemv or qskinny, none through cuBLASLt: no BLAS
    // workspace.
    for kp in &plan.keys {
        assert!(kp.ops.iter().all(|o| o.workspace_bytes == 0), "{}", kp.key);
        assert_eq!(kp.workspace_bytes, 0, "{}", kp.key);
    }
    assert_eq!(plan.workspace_bytes, 0);
    kiln_ir::validate(&plan).unwrap();
}

/// Every kernel launch of each key of `plan`: (key, entries in order).
fn launches_per_key(plan: &kiln_ir::plan::Plan) -> Vec<(Key, Vec<String>)> {
    plan.keys
        .iter()
        .map(|kp| {
            let mut v = Vec::new();
            for op in &kp.ops {
                match &op.lowering {
                    kiln_ir::plan::Lowering::Kernels(ls) => {
                        v.extend(ls.iter().map(|l| l.entry.clone()))
                    }
                    other => v.push(format!("{other:?}")),
                }
            }
            (kp.key, v)
        })
        .collect()
}

/// A Q4_K plan compiled for a GPU folds the RMSNorms into the GEMMs that
/// read them and SiLU*up into the gate/up GEMM (the quantized fused
/// entries, gate and up rows or tiles paired), so each key launches fewer
/// kernels: by default keys of up to eight tokens (the integer-dot qgemv
/// at one, qskinny at eight; the prologue too, K being 256 <= 1024), with
/// `--fused-gemv` every key; here both plans launch the same kernels.
#[test]
fn a_kept_q4_k_plan_for_a_gpu_fuses_keys_of_up_to_eight_tokens_by_default_and_every_key_when_asked()
{
    let model = TinyLlama {
        hidden: 256,
        ffn: 256,
        matrix_type: GgmlType::Q4K,
        embed_type: GgmlType::Q6K,
        ..TinyLlama::default()
    };
    let im = import_both(&model);
    let compile = |fused_gemv: bool| {
        let opts = CompileOptions {
            target: kiln_ir::plan::Target::Cuda { sm: 90 },
            fused_gemv,
            ..opts()
        };
        let plan = compile_dir(&im.kept, &opts, &mut |_, _| {}).unwrap().plan;
        kiln_ir::validate(&plan).unwrap();
        plan
    };
    let (plain, fused) = (compile(false), compile(true));
    let fused_ops = |p: &kiln_ir::plan::Plan, query: u32| {
        p.keys
            .iter()
            .filter(|k| k.key.query == query)
            .flat_map(|k| &k.ops)
            .filter(|o| matches!(o.op, kiln_ir::Op::FusedMatMul { .. }))
            .count()
    };
    assert!(fused_ops(&plain, 1) > 0);
    assert!(fused_ops(&plain, 8) > 0);
    assert!(fused_ops(&fused, 1) > 0);
    assert!(fused_ops(&fused, 8) > 0);
    let (lp, lf) = (launches_per_key(&plain), launches_per_key(&fused));
    let ring = kiln_kernels::quant_gpu::skinny_fused_ring_depth(kiln_ir::QuantType::Q4K)
        .map_or(String::new(), |d| format!("_pf{d}"));
    for ((key, p), (_, f)) in lp.iter().zip(&lf) {
        // Both plans fuse every key alike.
        assert_eq!(p, f, "{key}");
        let want = if key.query == 1 {
            // (the geometry rule's pick for the tiny model's GEMVs)
            "qgemv_i8_r4u1k1p_fused_norm_q4k_t1_bf16_bf16".to_string()
        } else {
            // The norms and the SiLU of each layer are gone: per layer the
            // fused qkv, the RoPE/KV write, the attention, o (residual),
            // gate/up (norm + SiLU) and down (residual); around them the
            // embedding gather, the last rows' norm and gather, the lm_head
            // and the two-stage argmax.
            assert!(f.len() <= 6 * model.layers + 6, "{key}: {f:?}");
            format!("qskinny_fused_norm_q4k_t8_r2{ring}_bf16_bf16")
        };
        assert!(f.contains(&want), "{key}: {want} missing from {f:?}");
        // No rms_norm or silu_mul kernel is left between the GEMMs.
        assert!(!f.iter().any(|e| e.starts_with("silu_mul")), "{key}: {f:?}");
    }
    // The fused plan's quantized weights still run only qgemv / qskinny.
    for kp in &fused.keys {
        assert_eq!(kp.workspace_bytes, 0, "{}", kp.key);
    }
}

#[test]
fn an_fp8_plan_of_a_bf16_model_decodes_like_the_bf16_plan_and_reports_its_stored_bytes() {
    let im = import_both(&TinyLlama::default());
    let dense_plan = compile_dir(&im.dense, &opts(), &mut |_, _| {})
        .unwrap()
        .plan;
    let fp8_opts = CompileOptions {
        quantize: Some(kiln_ir::QuantType::Fp8E4M3),
        ..opts()
    };
    let fp8_plan = compile_dir(&im.dense, &fp8_opts, &mut |_, _| {})
        .unwrap()
        .plan;
    // Projections are fp8; norms and the (tied) embedding stay bf16.
    let mut want_bytes = 0u64;
    let mut fp8 = 0;
    for e in &fp8_plan.manifest.entries {
        let d = e.shape.dims();
        if e.storage.is_some() {
            assert_eq!(e.storage, Some(kiln_ir::QuantType::Fp8E4M3), "{}", e.name);
            assert!(e.name.contains("proj"), "{} should stay dense", e.name);
            // One byte per element and an f32 scale per row.
            want_bytes += u64::from(d[0]) * (u64::from(d[1]) + 4);
            fp8 += 1;
        } else {
            assert!(!e.name.contains("_proj"), "{} was not quantized", e.name);
            want_bytes += d.iter().map(|&v| u64::from(v)).product::<u64>() * 2;
        }
    }
    assert!(fp8 > 0);
    let json =
        kiln_compiler::inspect::render(&fp8_plan, None, kiln_compiler::inspect::Format::Json)
            .unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["weight_bytes"].as_u64(), Some(want_bytes), "{json}");
    let dense_json =
        kiln_compiler::inspect::render(&dense_plan, None, kiln_compiler::inspect::Format::Json)
            .unwrap();
    let dv: serde_json::Value = serde_json::from_str(&dense_json).unwrap();
    assert!(want_bytes < dv["weight_bytes"].as_u64().unwrap());

    let err = worst_relative_logit_error((&dense_plan, &im.dense), (&fp8_plan, &im.dense));
    let mut same = 0;
    for p in prompts() {
        let a = greedy(&dense_plan, &im.dense, &p);
        let b = greedy(&fp8_plan, &im.dense, &p);
        same += a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    }
    eprintln!("fp8: worst relative logit error {err}, {same} leading tokens equal");
    assert!(err < 0.1, "fp8 logits differ by {err} of their range");
}
