//! Quantized weights kept compressed on CUDA, end to end (feature `cuda`, a
//! GPU): a tiny random GGUF imported with `--keep-quant`, compiled for the
//! device's SM (matmuls and the embedding become the `qgemv` module's
//! launches over weights repacked at load), run by the real engine with
//! graphs, against the CPU engine on the bf16 import of the same file.
//!
//! Two GPU paths, two references. The float kernels (`qgemv_<type>_*`,
//! `qskinny_*`) dequantize each weight exactly and multiply it with the
//! bf16 activations in f32, so they compute what the bf16 import computes
//! up to summation order and the bf16 rounding of the dequantized weights:
//! their reference is the CPU engine on the bf16 import. The one-token
//! integer-dot kernel (`qgemv_i8_*`, the CUDA default for Q4_K, Q6_K and
//! Q8_0) quantizes the activations per 32 to int8 exactly as the CPU
//! backend's quantized matmul does, so a plan whose layers run it is held
//! to the CPU engine on the same kept import (against the bf16 import its
//! int8 activations alone moved the tiny model's logits by 4.6% of their
//! range on the H100, session 25; against the kept import 0.56%). Either way:
//! teacher-forced logits within [`LOGIT_REL`] of the row's range, and every
//! greedy token equal unless the reference's top two logits are a near-tie
//! (margin under twice that difference). The replay counter is the witness
//! that graphs ran.
//!
//! Without a CUDA device every test prints SKIPPED and passes, unless
//! `KILN_REQUIRE_CUDA=1` (the GPU machine's runs) makes that a failure.
#![cfg(feature = "cuda")]

use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions, QkvRopeFusion};
use kiln_compiler::gguf::fixture::TinyLlama;
use kiln_compiler::gguf::GgmlType;
use kiln_compiler::import::{import_gguf, ImportOptions};
use kiln_ir::plan::{Lowering, Plan, Target};
use kiln_ir::Key;
use kiln_runtime::cuda::CudaBackend;
use kiln_runtime::{Backend, CpuBackend, Engine, EngineOptions, GraphMode, SeqOptions};
use std::path::Path;

const NEW_TOKENS: u32 = 12;
/// The dense CUDA-vs-CPU tests allow 1.5% of a row's largest logit for
/// summation order and rounding points. Here the CPU side also reads every
/// weight rounded to bf16 (the bf16 import) while the GPU multiplies the
/// exact dequantized value: one more rounding per weight. Measured on the
/// H200 (bench/results/gpu-2026-12-01-s7/final/): 1.05e-2 to 1.60e-2 of the
/// range over the four type pairs, every greedy token equal but one
/// near-tie. 2.5% bounds that with room for other seeds.
const LOGIT_REL: f32 = 2.5e-2;

fn gpu() -> Option<u32> {
    if !CudaBackend::available() {
        if std::env::var("KILN_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
            panic!("KILN_REQUIRE_CUDA=1 but no CUDA device is usable");
        }
        eprintln!("SKIPPED: no CUDA driver or device on this machine");
        return None;
    }
    Some(CudaBackend::new(0).expect("open CUDA device 0").sm())
}

fn opts(target: Target, matmul_qkv_rope: bool) -> CompileOptions {
    CompileOptions {
        matmul_qkv_rope: if matmul_qkv_rope {
            QkvRopeFusion::All
        } else {
            QkvRopeFusion::Off
        },
        keys: vec![Key::new(1, 1, 0), Key::new(1, 8, 0)],
        target,
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

fn engine(plan: &Plan, dir: &Path, backend: Box<dyn Backend + Send>) -> Engine {
    let opts = EngineOptions {
        graphs: GraphMode::On,
        log: false,
        ..EngineOptions::default()
    };
    Engine::new(plan.clone(), dir, backend, opts).unwrap()
}

fn backend(cuda: bool) -> Box<dyn Backend + Send> {
    if cuda {
        Box::new(CudaBackend::new(0).unwrap())
    } else {
        Box::new(CpuBackend::new())
    }
}

/// Greedy tokens and, teacher-forced with `forced` when given, the logits of
/// every generated position; the engine's replays.
fn run(
    plan: &Plan,
    dir: &Path,
    cuda: bool,
    prompt: &[u32],
    forced: Option<&[u32]>,
) -> (Vec<u32>, Vec<Vec<f32>>, u64) {
    let mut e = engine(plan, dir, backend(cuda));
    e.set_keep_logits(true);
    let n = forced.map_or(NEW_TOKENS, |f| f.len() as u32);
    let id = e
        .add_sequence_with(
            prompt,
            SeqOptions {
                max_new_tokens: n,
                stop_on_eos: false,
            },
        )
        .unwrap();
    let mut rows = Vec::new();
    while e.has_work() {
        e.step().unwrap();
        let s = e.sequence(id).unwrap();
        let n = s.generated.len();
        let finished = s.finished.is_some();
        if n > rows.len() {
            rows.push(e.last_logits(id).unwrap().to_vec());
            if let Some(f) = forced {
                if !finished {
                    e.replace_last_token(id, f[n - 1]).unwrap();
                }
            }
        }
    }
    let tokens = e.sequence(id).unwrap().generated.to_vec();
    (tokens, rows, e.total_counters().replays)
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// `rope`: compile the GPU plan with `matmul_qkv_rope` (the packed q/k/v
/// GEMV with the rope tail) and require its launches in the plan.
fn check(matrix: GgmlType, embed: GgmlType, rope: bool) -> Result<String, String> {
    let sm = gpu().expect("checked by the caller");
    let model = TinyLlama {
        hidden: 256,
        ffn: 256,
        matrix_type: matrix,
        embed_type: embed,
        ..TinyLlama::default()
    };
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("tiny.gguf");
    model.build().unwrap().writer.write(&gguf).unwrap();
    let (dense, kept) = (tmp.path().join("dense"), tmp.path().join("kept"));
    import_gguf(&gguf, &dense, &ImportOptions::default()).unwrap();
    let keep = ImportOptions {
        keep_quant: true,
        ..ImportOptions::default()
    };
    import_gguf(&gguf, &kept, &keep).unwrap();
    let gpu_plan = compile_dir(&kept, &opts(Target::Cuda { sm }, rope), &mut |_, _| {})
        .unwrap()
        .plan;
    // The kept plan really runs quantized kernels.
    let launches: Vec<_> = gpu_plan
        .keys
        .iter()
        .flat_map(|k| &k.ops)
        .filter_map(|op| match &op.lowering {
            Lowering::Kernels(ls) => Some(ls),
            _ => None,
        })
        .flatten()
        .filter(|l| l.module == "qgemv")
        .collect();
    if launches.is_empty() {
        return Err(format!("{matrix}/{embed}: no qgemv launch in the plan"));
    }
    let qlaunches = launches.len();
    let rope_launches = launches
        .iter()
        .filter(|l| l.entry.contains("_rope_"))
        .count();
    if rope != (rope_launches > 0) {
        return Err(format!(
            "{matrix}/{embed}: {rope_launches} rope-tail GEMV launch(es) in a plan compiled with matmul_qkv_rope {rope}"
        ));
    }
    // int8 activations in most of the GPU's matmuls (the layers'; the
    // lm_head's type can differ from theirs): the CPU reference quantizes
    // them too. With the layers on the float kernels, an integer-dot
    // lm_head perturbs only the last product, and the bf16 import stays
    // the closer reference (measured on the H100, session 25: 1.2-1.6e-2
    // against it, 2.9-3.4e-2 against the kept import).
    let matmuls: Vec<_> = launches
        .iter()
        .filter(|l| !l.entry.starts_with("qgather"))
        .collect();
    let i8s = matmuls
        .iter()
        .filter(|l| l.entry.starts_with("qgemv_i8"))
        .count();
    let int8 = 2 * i8s > matmuls.len();
    let (ref_dir, reference) = if int8 {
        (&kept, "the kept import")
    } else {
        (&dense, "the bf16 import")
    };
    let cpu_plan = compile_dir(ref_dir, &opts(Target::Cpu, false), &mut |_, _| {})
        .unwrap()
        .plan;
    let mut worst = 0f32;
    let mut ties = 0;
    let mut replays = 0;
    for prompt in [
        vec![1u32, 40, 72, 101],
        vec![1, 200, 7, 7, 9, 33, 250],
        vec![5],
    ] {
        let (want, _, _) = run(&cpu_plan, ref_dir, false, &prompt, None);
        let (_, lc, _) = run(&cpu_plan, ref_dir, false, &prompt, Some(&want));
        let (_, lg, r) = run(&gpu_plan, &kept, true, &prompt, Some(&want));
        let got: Vec<u32> = lg.iter().map(|r| argmax(r)).collect();
        replays += r;
        if lc.len() != lg.len() {
            return Err(format!(
                "{matrix}/{embed}: {} vs {} logit rows",
                lc.len(),
                lg.len()
            ));
        }
        for (i, (a, b)) in lc.iter().zip(&lg).enumerate() {
            let (lo, hi) = a
                .iter()
                .fold((f32::MAX, f32::MIN), |(l, h), v| (l.min(*v), h.max(*v)));
            let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            worst = worst.max(d / (hi - lo));
            if got.get(i) != want.get(i) {
                let mut s = a.clone();
                s.sort_by(|x, y| y.total_cmp(x));
                if s[0] - s[1] > 2.0 * d {
                    return Err(format!(
                        "{matrix}/{embed} prompt {prompt:?} step {i}: CUDA {:?} vs CPU on {reference} {:?} with a margin of {} over a logit difference of {d}",
                        got.get(i),
                        want.get(i),
                        s[0] - s[1]
                    ));
                }
                ties += 1;
            }
        }
    }
    if worst > LOGIT_REL {
        return Err(format!(
            "{matrix}/{embed}: logits differ from the CPU engine on {reference} by {worst:.3e} of their range (bound {LOGIT_REL})"
        ));
    }
    if replays == 0 {
        return Err(format!("{matrix}/{embed}: no graph replays"));
    }
    Ok(format!(
        "{matrix}/{embed}: worst relative logit difference {worst:.2e} against the CPU engine on {reference}, {ties} near-tie(s), {qlaunches} qgemv launches ({rope_launches} with the rope tail), {replays} replays"
    ))
}

#[test]
fn kept_quantized_weights_on_cuda_decode_what_the_bf16_import_decodes_on_the_cpu() {
    if gpu().is_none() {
        return;
    }
    let mut errs = Vec::new();
    for (matrix, embed) in [
        (GgmlType::Q4_1, GgmlType::Q8_0),
        (GgmlType::Q4_0, GgmlType::Q4K),
        (GgmlType::Q5K, GgmlType::Q5_0),
        (GgmlType::Q6K, GgmlType::Q4_0),
    ] {
        match check(matrix, embed, false) {
            Ok(m) => eprintln!("{m}"),
            Err(e) => errs.push(e),
        }
    }
    assert!(errs.is_empty(), "{}", errs.join("\n"));
}

/// The same engine check with the GPU plan compiled `--matmul-qkv-rope`:
/// each layer's packed q/k/v projection over an integer-dot type is one
/// GEMV launch whose last blocks rope the heads and write the KV row
/// (the CPU reference runs the op as the projection, then
/// `qkv_rope_kv_write`). Every step's positions and slots change, so a
/// head finished from a stale row or a counter left non-zero by the
/// previous replay shows in the logits.
#[test]
fn the_qkv_gemv_with_the_rope_tail_decodes_on_cuda_what_the_cpu_engine_decodes() {
    if gpu().is_none() {
        return;
    }
    let mut errs = Vec::new();
    for (matrix, embed) in [
        (GgmlType::Q4K, GgmlType::Q8_0),
        (GgmlType::Q6K, GgmlType::Q4_0),
        (GgmlType::Q8_0, GgmlType::Q4K),
    ] {
        match check(matrix, embed, true) {
            Ok(m) => eprintln!("{m}"),
            Err(e) => errs.push(e),
        }
    }
    assert!(errs.is_empty(), "{}", errs.join("\n"));
}
