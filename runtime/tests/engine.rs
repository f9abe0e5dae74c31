//! The engine against a cache-free reference: every way a step can be built
//! (decode batches with padding, prefill chunks, prefill token by token,
//! speculative verification, sub-batches when no key fits) must produce the
//! tokens of a from-scratch greedy computation.

mod common;

use common::*;
use kiln_ir::DType;
use kiln_runtime::cpu::CpuStats;

use kiln_runtime::{
    EagerFallback, EngineError, FinishReason, GraphMode, KeyCounters, PrefillMode, SeqId,
    SeqOptions,
};
use std::collections::HashMap;

/// Runs sequences added at different steps to completion; checks each against
/// the reference. Returns the engine's counters for the caller to inspect.
/// Returns the total counters and those of the chunk key b2q4s0.
fn serve_and_check(
    model: &TinyModel,
    graphs: GraphMode,
    prefill: PrefillMode,
    seqs: &[(usize, usize, usize)],
) -> (KeyCounters, KeyCounters) {
    let (dir, plan) = build(model);
    let mut opts = options(graphs);
    opts.prefill = prefill;
    let (mut e, _) = engine_with(&plan, dir.path(), opts);
    let w = model.weights();
    let mut rng = Rng::new(99);
    // (add at step, prompt length, new tokens)
    let prompts: Vec<Vec<u32>> = seqs
        .iter()
        .map(|&(_, len, _)| prompt(&mut rng, model.vocab, len))
        .collect();
    let mut ids: HashMap<SeqId, usize> = HashMap::new();
    let mut got: HashMap<usize, Vec<u32>> = HashMap::new();
    // (sequence, index of the generated token, the logits that produced it)
    let mut logits: Vec<(usize, usize, Vec<f32>)> = Vec::new();
    let mut step = 0;
    while step < 200 {
        for (i, &(at, _, n)) in seqs.iter().enumerate() {
            if at == step {
                let id = e
                    .add_sequence_with(
                        &prompts[i],
                        SeqOptions {
                            max_new_tokens: n as u32,
                            stop_on_eos: false,
                        },
                    )
                    .unwrap();
                ids.insert(id, i);
            }
        }
        for (id, toks) in e.step().unwrap() {
            let g = got.entry(ids[&id]).or_default();
            g.extend(toks);
            let l = e.last_logits(id).expect("keep_logits is on").to_vec();
            logits.push((ids[&id], g.len() - 1, l));
        }
        step += 1;
        if !e.has_work() && seqs.iter().all(|s| s.0 < step) {
            break;
        }
    }
    for (i, &(_, _, n)) in seqs.iter().enumerate() {
        let (want, want_logits) = model.greedy_reference(&w, &prompts[i], n);
        assert_eq!(got[&i], want, "sequence {i} (prompt {:?})", prompts[i]);
        for (_, j, l) in logits.iter().filter(|x| x.0 == i) {
            let d = l
                .iter()
                .zip(&want_logits[*j])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(d <= 1e-5, "sequence {i} token {j}: logits differ by {d}");
        }
    }
    assert!(logits.len() >= seqs.len());
    (
        e.total_counters(),
        e.counters()[&"b2q4s0".parse().unwrap()].clone(),
    )
}

const MIXED: &[(usize, usize, usize)] = &[
    (0, 3, 9),
    (0, 8, 6),
    (1, 1, 12),
    (2, 12, 5),
    (3, 9, 4),
    (2, 5, 8),
    (6, 2, 7),
];

#[test]
fn graph_steps_match_a_cache_free_reference_across_mixed_batches_and_chunked_prefill() {
    let (c, chunk) = serve_and_check(
        &TinyModel::default(),
        GraphMode::On,
        PrefillMode::Chunked,
        MIXED,
    );
    assert!(
        c.replays > 0 && c.eager_steps == 0 && c.padded_rows > 0,
        "{c:?}"
    );
    assert!(chunk.replays > 0, "prefill chunks ran: {chunk:?}");
}

#[test]
fn eager_steps_match_a_cache_free_reference() {
    let (c, _) = serve_and_check(
        &TinyModel::default(),
        GraphMode::Off,
        PrefillMode::Chunked,
        MIXED,
    );
    assert!(
        c.replays == 0 && c.captures == 0 && c.eager_steps > 0,
        "{c:?}"
    );
}

#[test]
fn token_by_token_prefill_matches_the_reference() {
    let (_, chunk) = serve_and_check(
        &TinyModel::default(),
        GraphMode::On,
        PrefillMode::TokenByToken,
        MIXED,
    );
    assert_eq!(chunk, Default::default());
}

#[test]
fn bf16_weights_match_the_reference() {
    let model = TinyModel {
        file_dtype: DType::BF16,
        seed: 3,
        ..TinyModel::default()
    };
    serve_and_check(&model, GraphMode::On, PrefillMode::Chunked, &MIXED[..3]);
}

#[test]
fn more_rows_than_the_largest_batch_run_eagerly_in_sub_batches_and_are_counted() {
    let model = TinyModel::default(); // largest q1 batch: 8
    let seqs: Vec<(usize, usize, usize)> = (0..10).map(|i| (0, 1 + i % 3, 6)).collect();
    let (dir, plan) = build(&model);
    let (mut e, _) = engine_with(&plan, dir.path(), options(GraphMode::On));
    let w = model.weights();
    let mut rng = Rng::new(5);
    let prompts: Vec<Vec<u32>> = seqs
        .iter()
        .map(|s| prompt(&mut rng, model.vocab, s.1))
        .collect();
    let ids: Vec<SeqId> = prompts
        .iter()
        .map(|p| {
            e.add_sequence_with(
                p,
                SeqOptions {
                    max_new_tokens: 6,
                    stop_on_eos: false,
                },
            )
            .unwrap()
        })
        .collect();
    while e.has_work() {
        e.step().unwrap();
    }
    for (i, id) in ids.iter().enumerate() {
        let (want, _) = model.greedy_reference(&w, &prompts[i], 6);
        assert_eq!(e.sequence(*id).unwrap().generated, &want[..]);
    }
    assert!(e.stats().no_fit_steps > 0);
    let b8 = &e.counters()[&"b8q1s0".parse().unwrap()];
    assert!(b8.eager_steps >= 2 * e.stats().no_fit_steps, "{b8:?}");

    // The same load under a policy that forbids eager steps fails clearly.
    let mut opts = options(GraphMode::On);
    opts.eager_fallback = EagerFallback::Forbid;
    let (mut e, _) = engine_with(&plan, dir.path(), opts);
    for p in &prompts {
        e.add_sequence(p).unwrap();
    }
    let err = e.step().unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::NoKeyFits {
                rows: 10,
                query: 1,
                largest: 8,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("b10q1s0"), "{err}");
}

#[test]
fn speculative_steps_take_accepted_drafts_plus_one_and_match_the_reference() {
    let model = TinyModel::default(); // has b2q3s2
    let (dir, plan) = build(&model);
    let (mut e, _) = engine_with(&plan, dir.path(), options(GraphMode::On));
    let w = model.weights();
    let mut rng = Rng::new(17);
    let p = prompt(&mut rng, model.vocab, 5);
    let (want, want_logits) = model.greedy_reference(&w, &p, 24);
    let id = e
        .add_sequence_with(
            &p,
            SeqOptions {
                max_new_tokens: 24,
                stop_on_eos: false,
            },
        )
        .unwrap();
    // Prefill (one chunk of 4 then one token): the first token.
    while e.sequence(id).unwrap().generated.is_empty() {
        e.step().unwrap();
    }
    let mut accepted_total = 0;
    let mut round = 0;
    while e.has_work() {
        let have = e.sequence(id).unwrap().generated.len();
        // Drafts: alternately both right, first right only, both wrong.
        let mut d: Vec<u32> = want[have..].iter().take(2).copied().collect();
        if d.len() < 2 {
            d.resize(2, 0);
        }
        match round % 3 {
            1 => d[1] = (d[1] + 1) % model.vocab,
            2 => d[0] = (d[0] + 1) % model.vocab,
            _ => {}
        }
        e.set_drafts(id, &d).unwrap();
        let out = e.step().unwrap();
        let n = out
            .iter()
            .find(|(i, _)| *i == id)
            .map_or(0, |(_, t)| t.len());
        let expect = [3, 2, 1][round % 3].min(24 - have);
        assert_eq!(n, expect, "round {round}");
        accepted_total += n - 1;
        // The logits kept are those of the row that produced the last token.
        let g = e.sequence(id).unwrap().generated.len();
        let l = e.last_logits(id).unwrap();
        let diff = l
            .iter()
            .zip(&want_logits[g - 1])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff <= 1e-5, "logits differ by {diff}");
        round += 1;
    }
    assert_eq!(e.sequence(id).unwrap().generated, &want[..]);
    assert!(accepted_total > 0);
    let spec = &e.counters()[&"b2q3s2".parse().unwrap()];
    assert!(spec.replays > 0 && spec.padded_rows > 0, "{spec:?}");
}

#[test]
fn drafts_without_a_matching_spec_key_are_refused() {
    let (dir, plan) = build(&TinyModel::default());
    let mut e = engine(&plan, dir.path(), GraphMode::On);
    let id = e.add_sequence(&[1, 2]).unwrap();
    let err = e.set_drafts(id, &[1, 2, 3]).unwrap_err();
    assert!(
        matches!(err, EngineError::NoSpecKey { count: 3, .. }),
        "{err}"
    );
    let err = e.set_drafts(id, &[1, 999]).unwrap_err();
    assert!(
        matches!(err, EngineError::InvalidToken { token: 999, .. }),
        "{err}"
    );
}

#[test]
fn generation_stops_at_eos_max_tokens_and_the_context_length() {
    let base = TinyModel::default();
    let w = base.weights();
    let mut rng = Rng::new(23);
    let p = prompt(&mut rng, base.vocab, 4);
    let (want, _) = base.greedy_reference(&w, &p, 10);
    // EOS: the 4th generated token (first occurrence) is declared EOS.
    let eos = want[3];
    let first = want.iter().position(|&t| t == eos).unwrap();
    let model = TinyModel {
        eos: vec![eos],
        ..base.clone()
    };
    let (dir, plan) = build(&model);
    let mut e = engine(&plan, dir.path(), GraphMode::On);
    let got = e.generate(&p, 10).unwrap();
    assert_eq!(got, &want[..=first]);

    let id = e
        .add_sequence_with(
            &p,
            SeqOptions {
                max_new_tokens: 3,
                stop_on_eos: false,
            },
        )
        .unwrap();
    while e.has_work() {
        e.step().unwrap();
    }
    let s = e.sequence(id).unwrap();
    assert_eq!(
        (s.generated, s.finished),
        (&want[..3], Some(&FinishReason::MaxTokens))
    );

    let (dir, plan) = build(&base);
    let mut e = engine(&plan, dir.path(), GraphMode::On);
    let long = prompt(&mut rng, base.vocab, base.max_context as usize - 3);
    let id = e.add_sequence(&long).unwrap();
    while e.has_work() {
        e.step().unwrap();
    }
    let s = e.sequence(id).unwrap();
    assert_eq!(s.generated.len(), 3);
    assert_eq!(s.finished, Some(&FinishReason::ContextFull));
    // Finished sequences gave their blocks back.
    assert_eq!(e.free_kv_blocks(), base.num_blocks - 1);
}

#[test]
fn steps_allocate_nothing_and_copy_only_their_staging_in_one_upload() {
    let model = TinyModel::default();
    let (dir, plan) = build(&model);
    let (mut e, stats) = engine_with(&plan, dir.path(), options(GraphMode::On));
    let (allocs, uploads, bytes) = (
        CpuStats::get(&stats.allocs),
        CpuStats::get(&stats.uploads),
        CpuStats::get(&stats.upload_bytes),
    );
    let mut rng = Rng::new(8);
    for len in [3, 7, 1] {
        let p = prompt(&mut rng, model.vocab, len);
        e.add_sequence_with(
            &p,
            SeqOptions {
                max_new_tokens: 20,
                stop_on_eos: false,
            },
        )
        .unwrap();
    }
    let mut steps = 0;
    while e.has_work() {
        e.step().unwrap();
        steps += 1;
    }
    assert!(steps >= 20);
    assert_eq!(CpuStats::get(&stats.allocs), allocs, "a step allocated");
    // The tiny plan packs its staging inputs: one copy per key run.
    let runs = e.total_counters().replays;
    assert_eq!(CpuStats::get(&stats.uploads) - uploads, runs);
    let max_io = plan.keys.iter().map(|k| k.io_bytes).max().unwrap();
    assert!(CpuStats::get(&stats.upload_bytes) - bytes <= runs * max_io);
}

#[test]
fn the_real_cpu_kernels_run_the_tiny_model_within_a_bound_of_the_reference() {
    // kiln_kernels::cpu::execute accumulates in another order than the test
    // kernels, so logits agree within a bound, and a token may differ only
    // where the reference's top two logits are closer than that bound.
    const BOUND: f32 = 1e-3;
    let model = TinyModel::default();
    let (dir, plan) = build(&model);
    let be = kiln_runtime::CpuBackend::new();
    let mut e =
        kiln_runtime::Engine::new(plan, dir.path(), Box::new(be), options(GraphMode::On)).unwrap();
    let w = model.weights();
    let mut rng = Rng::new(77);
    let mut compared = 0;
    for len in [1, 4, 6, 9] {
        let p = prompt(&mut rng, model.vocab, len);
        let id = e
            .add_sequence_with(
                &p,
                SeqOptions {
                    max_new_tokens: 16,
                    stop_on_eos: false,
                },
            )
            .unwrap();
        let mut logits = Vec::new();
        while e.has_work() {
            if !e.step().unwrap().is_empty() {
                logits.push(e.last_logits(id).unwrap().to_vec());
            }
        }
        let got = e.remove_sequence(id).unwrap();
        let (want, want_logits) = model.greedy_reference(&w, &p, 16);
        for i in 0..16 {
            let d = logits[i]
                .iter()
                .zip(&want_logits[i])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(d <= BOUND, "prompt {p:?} token {i}: logits differ by {d}");
            compared += 1;
            if got[i] != want[i] {
                let mut sorted = want_logits[i].clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                assert!(
                    sorted[0] - sorted[1] < BOUND,
                    "token {i} differs without a near-tie"
                );
                break;
            }
        }
    }
    assert!(compared >= 32);
    assert!(e.total_counters().replays > 0);
}
