//! Serving compiled plans end to end on the CPU: the ways a step can be
//! built (batched with padding, prefill chunks, speculative verification)
//! give the tokens of the simplest way, plans load from their files, and
//! mismatched inputs are refused.

mod serve_common;

use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
use kiln_runtime::cpu::CpuStats;
use kiln_runtime::{CpuBackend, Engine, EngineError, GraphMode, PrefillMode, SeqId, SeqOptions};
use serve_common::*;

fn opts_n(n: u32) -> SeqOptions {
    SeqOptions {
        max_new_tokens: n,
        stop_on_eos: false,
    }
}

/// Greedy tokens of `prompt`, run alone through b1q1s0 token by token.
fn alone(t: &Tiny, prompt: &[u32], n: u32) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut o = options(GraphMode::On);
    o.prefill = PrefillMode::TokenByToken;
    let mut e = engine(t, o);
    let id = e.add_sequence_with(prompt, opts_n(n)).unwrap();
    let mut logits = Vec::new();
    while e.has_work() {
        if !e.step().unwrap().is_empty() {
            logits.push(e.last_logits(id).unwrap().to_vec());
        }
    }
    (e.remove_sequence(id).unwrap(), logits)
}

#[test]
fn batched_chunked_decoding_with_padding_gives_each_sequence_its_tokens_alone() {
    let t = smollm2(KEYS);
    let vocab = t.plan.meta.info.vocab_size;
    let mut rng = Rng::new(3);
    // Prompt lengths around the chunk of 4: chunks end mid-prompt and at its end.
    let prompts: Vec<Vec<u32>> = [1, 3, 4, 5, 8, 11, 13]
        .iter()
        .map(|&n| rng.prompt(vocab, n))
        .collect();
    let mut e = engine(&t, options(GraphMode::On));
    let ids: Vec<SeqId> = prompts
        .iter()
        .map(|p| e.add_sequence_with(p, opts_n(12)).unwrap())
        .collect();
    while e.has_work() {
        e.step().unwrap();
    }
    for (p, id) in prompts.iter().zip(&ids) {
        let (want, _) = alone(&t, p, 12);
        assert_eq!(
            e.sequence(*id).unwrap().generated,
            &want[..],
            "prompt {p:?}"
        );
    }
    let c = e.counters();
    let chunk = &c[&"b2q4s0".parse().unwrap()];
    let b8 = &c[&"b8q1s0".parse().unwrap()];
    assert!(chunk.replays > 0 && chunk.padded_rows > 0, "{chunk:?}");
    assert!(b8.replays > 0 && b8.padded_rows > 0, "{b8:?}");
}

#[test]
fn the_models_own_tokens_as_drafts_are_all_accepted_and_reproduce_greedy_decoding() {
    let t = smollm2(KEYS);
    let vocab = t.plan.meta.info.vocab_size;
    let mut rng = Rng::new(11);
    let p = rng.prompt(vocab, 6);
    let (want, want_logits) = alone(&t, &p, 20);
    let mut e = engine(&t, options(GraphMode::On));
    let id = e.add_sequence_with(&p, opts_n(20)).unwrap();
    while e.sequence(id).unwrap().generated.is_empty() {
        e.step().unwrap();
    }
    let mut round = 0;
    while e.has_work() {
        let have = e.sequence(id).unwrap().generated.len();
        let mut d: Vec<u32> = want[have..].iter().copied().chain([0, 0]).take(2).collect();
        // Every third round the second draft is wrong: one accepted, plus the bonus.
        if round % 3 == 2 {
            d[1] = (d[1] + 1) % vocab;
        }
        e.set_drafts(id, &d).unwrap();
        let got: usize = e.step().unwrap().iter().map(|(_, t)| t.len()).sum();
        let expect = if round % 3 == 2 { 2 } else { 3 };
        assert_eq!(got, expect.min(20 - have), "round {round}");
        let g = e.sequence(id).unwrap().generated.len();
        let d = max_diff(e.last_logits(id).unwrap(), &want_logits[g - 1]);
        assert!(
            d <= 2e-2,
            "round {round}: logits differ from plain decoding by {d}"
        );
        round += 1;
    }
    assert_eq!(e.sequence(id).unwrap().generated, &want[..]);
    let spec = &e.counters()[&"b2q3s2".parse().unwrap()];
    assert_eq!(spec.replays, round as u64);
}

#[test]
fn every_family_decodes_the_same_tokens_with_graphs_and_eagerly() {
    for family in Family::ALL {
        let t = compile_tiny(
            family,
            &TinySpec::for_family(family),
            "b1q1s0,b2q1s0,b2q4s0",
            false,
        );
        let vocab = t.plan.meta.info.vocab_size;
        let mut rng = Rng::new(5);
        let prompts = [rng.prompt(vocab, 7), rng.prompt(vocab, 2)];
        let run = |graphs| {
            let mut e = engine(&t, options(graphs));
            let ids: Vec<SeqId> = prompts
                .iter()
                .map(|p| e.add_sequence_with(p, opts_n(10)).unwrap())
                .collect();
            while e.has_work() {
                e.step().unwrap();
            }
            let c = e.total_counters();
            let toks: Vec<Vec<u32>> = ids.iter().map(|&i| e.remove_sequence(i).unwrap()).collect();
            (toks, c)
        };
        let (g, gc) = run(GraphMode::On);
        let (x, xc) = run(GraphMode::Off);
        assert_eq!(g, x, "{family:?}");
        assert!(g.iter().all(|t| t.len() == 10));
        assert!(
            gc.replays > 0 && gc.eager_steps == 0 && xc.replays == 0,
            "{family:?}"
        );
    }
}

#[test]
fn a_plan_loads_from_its_file_and_a_damaged_file_is_refused_before_any_allocation() {
    let t = smollm2("b1q1s0");
    let path = t.dir.path().join("model.kiln");
    kiln_ir::artifact::write_plan_atomic(&path, &t.plan).unwrap();
    let mut e = Engine::load(
        &path,
        t.dir.path(),
        Box::new(CpuBackend::new()),
        options(GraphMode::On),
    )
    .unwrap();
    let (want, _) = alone(&t, &[9, 8, 7], 5);
    assert_eq!(e.generate(&[9, 8, 7], 5).unwrap(), want);

    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let be = CpuBackend::new();
    let stats = be.stats();
    let err = Engine::load(&path, t.dir.path(), Box::new(be), options(GraphMode::On))
        .err()
        .unwrap();
    assert!(matches!(err, EngineError::Artifact { .. }), "{err}");
    assert!(err.to_string().contains("checksum"), "{err}");
    assert_eq!(CpuStats::get(&stats.allocs), 0);
}

#[test]
fn weights_of_another_model_are_refused_before_any_allocation() {
    let t = smollm2("b1q1s0");
    let other = tempfile::tempdir().unwrap();
    let spec = TinySpec {
        intermediate: 160,
        ..TinySpec::smollm2()
    };
    write_tiny_model(other.path(), Family::Llama, &spec).unwrap();
    let be = CpuBackend::new();
    let stats = be.stats();
    let err = Engine::new(
        t.plan.clone(),
        other.path(),
        Box::new(be),
        options(GraphMode::On),
    )
    .err()
    .unwrap();
    assert!(matches!(err, EngineError::WeightsMismatch { .. }), "{err}");
    assert!(err.to_string().contains("model.safetensors"), "{err}");
    assert_eq!(CpuStats::get(&stats.allocs), 0);
}

#[test]
fn a_prompt_longer_than_the_compiled_context_is_refused() {
    let t = smollm2("b1q1s0");
    let mut e = engine(&t, options(GraphMode::On));
    let max = t.plan.meta.info.max_context as usize;
    let err = e.add_sequence(&vec![1; max]).unwrap_err();
    assert!(matches!(err, EngineError::PromptTooLong { .. }), "{err}");
    // One position short of the context: one token is generated, then the
    // context is full.
    let got = e.generate(&vec![1; max - 1], 10).unwrap();
    assert_eq!(got.len(), 1);
}
