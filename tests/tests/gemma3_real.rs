//! The real Gemma-3-270M (Q4_K_M GGUF from PyPI, `scripts/fetch-gemma3.sh`)
//! end to end on the CPU backend: `kiln import`, compile, greedy decode of a
//! few prompts. The b1 and b8 keys must produce the same tokens; the
//! question about France must be answered with Paris; and the bare prompt
//! "The capital of France is" must continue with the known answer of an
//! independent f32 forward pass (`scripts/gemma3_numpy_reference.py`: numpy
//! over the `gguf` package's dequantization of the same file), which is
//! " the capital of the country of France." (this base, Q4_K_M model does
//! not say Paris there; it does when asked). Skipped with a note when the GGUF
//! is absent, unless `KILN_REQUIRE_GEMMA3=1` (CI).

use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::import::{import_gguf, ImportOptions};
use kiln_compiler::testing::gemma3_gguf_for_tests;
use kiln_ir::Key;
use kiln_runtime::text::TextTokenizer;
use kiln_runtime::{CpuBackend, Engine, EngineOptions, GraphMode, SeqOptions};
use std::path::Path;

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "Q: What is the capital of France?\nA:",
    "def fibonacci(n):",
];
const NEW_TOKENS: u32 = 8;
/// Greedy ids after "The capital of France is" from
/// `scripts/gemma3_numpy_reference.py` (f32, no kiln code involved).
const FRANCE_REFERENCE: [u32; 8] = [506, 5279, 529, 506, 2891, 529, 7001, 236761];

fn decode(plan: &kiln_ir::plan::Plan, dir: &Path, prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let opts = EngineOptions {
        graphs: GraphMode::On,
        log: false,
        ..EngineOptions::default()
    };
    let mut e = Engine::new(plan.clone(), dir, Box::new(CpuBackend::new()), opts).unwrap();
    let ids: Vec<_> = prompts
        .iter()
        .map(|p| {
            e.add_sequence_with(
                p,
                SeqOptions {
                    max_new_tokens: NEW_TOKENS,
                    stop_on_eos: false,
                },
            )
            .unwrap()
        })
        .collect();
    while e.has_work() {
        e.step().unwrap();
    }
    ids.iter()
        .map(|&id| e.sequence(id).unwrap().generated.to_vec())
        .collect()
}

#[test]
fn gemma3_270m_imports_compiles_answers_paris_and_matches_an_independent_forward_pass_on_b1_and_b8()
{
    let Some(gguf) = gemma3_gguf_for_tests() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("gemma3");
    import_gguf(&gguf, &dir, &ImportOptions::default()).unwrap();
    let opts = CompileOptions {
        keys: vec![Key::new(1, 1, 0), Key::new(8, 1, 0), Key::new(1, 8, 0)],
        kv: KvOptions {
            block_size: 16,
            kv_blocks: Some(64),
            max_context: Some(256),
            ..KvOptions::default()
        },
        ..CompileOptions::default()
    };
    let plan = compile_dir(&dir, &opts, &mut |_, _| {}).unwrap().plan;
    let tok = TextTokenizer::from_dir(&dir).unwrap();
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| tok.encode(p).unwrap()).collect();
    assert_eq!(prompts[0].len(), 6, "BOS and five words: {:?}", prompts[0]);
    assert_eq!(prompts[0][0], 2, "Gemma needs its BOS");

    // One at a time: the b1 keys (b1q8s0 prefill chunks, b1q1s0 decode).
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .flat_map(|p| decode(&plan, &dir, std::slice::from_ref(p)))
        .collect();
    // All together: the b8 key (rows padded).
    let together = decode(&plan, &dir, &prompts);
    for (i, text) in PROMPTS.iter().enumerate() {
        let out = tok.decode(&alone[i]).unwrap();
        eprintln!("{text:?} -> {out:?} {:?}", alone[i]);
    }
    assert_eq!(
        alone[0],
        FRANCE_REFERENCE,
        "{:?} continued with {:?}",
        PROMPTS[0],
        tok.decode(&alone[0]).unwrap()
    );
    let answer = tok.decode(&alone[1]).unwrap();
    assert!(
        answer.contains("Paris"),
        "{:?} was answered with {answer:?}",
        PROMPTS[1]
    );
    assert_eq!(alone, together, "b1 and b8 keys disagree");
}
