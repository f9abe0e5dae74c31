//! In-graph sampling on the CPU backend: a plan compiled with `--sampling`
//! draws each row's token with the `sample` op from staged parameters.
//! Checked against the reference sampler applied to the logits the same
//! step produced, against the argmax plan for greedy rows, and for seeded
//! reproducibility across batch composition and recompute.

mod common;

use common::*;
use kiln_ir::plan::Target;
use kiln_kernels::cpu::sample::sample_row;
use kiln_runtime::{Engine, EngineError, GraphMode, RowSampling, SeqId, SeqOptions};

fn opts(n: u32) -> SeqOptions {
    SeqOptions {
        max_new_tokens: n,
        stop_on_eos: false,
    }
}

fn hot(seed: u64) -> RowSampling {
    RowSampling {
        temperature: 1.3,
        top_p: 0.97,
        top_k: 40,
        min_p: 0.01,
        seed,
    }
}

fn sampling_engine(model: &TinyModel, graphs: GraphMode) -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    let plan = model.build_sampling(dir.path(), Target::Cpu).unwrap();
    let e = engine(&plan, dir.path(), graphs);
    (dir, e)
}

/// Runs every sequence to completion; returns their generated tokens.
fn run_all(e: &mut Engine, ids: &[SeqId]) -> Vec<Vec<u32>> {
    while e.has_work() {
        e.step().unwrap();
    }
    ids.iter()
        .map(|&id| e.sequence(id).unwrap().generated.to_vec())
        .collect()
}

#[test]
fn each_sampled_token_is_the_reference_samplers_draw_from_that_steps_logits() {
    let model = TinyModel::default();
    let (_dir, mut e) = sampling_engine(&model, GraphMode::On);
    assert!(e.has_in_graph_sampling());
    let mut rng = Rng::new(40);
    let rows: Vec<(SeqId, RowSampling, usize)> = (0..3)
        .map(|i| {
            let p = prompt(&mut rng, model.vocab, 5 + i);
            let id = e.add_sequence_with(&p, opts(12)).unwrap();
            let s = if i == 1 {
                RowSampling::GREEDY
            } else {
                hot(77 + i as u64)
            };
            e.set_sampling(id, s).unwrap();
            (id, s, p.len())
        })
        .collect();
    let (mut checked, mut off_argmax) = (0, 0);
    while e.has_work() {
        for (id, toks) in e.step().unwrap() {
            let &(_, s, plen) = rows.iter().find(|r| r.0 == id).unwrap();
            let seq = e.sequence(id).unwrap();
            let index = plen + seq.generated.len() - 1;
            let logits = e.last_logits(id).unwrap();
            let want = sample_row(logits, s.params(), s.seeds(index as u32));
            assert_eq!(toks, vec![want as u32], "sequence {id:?} token {index}");
            let best = kiln_kernels::cpu::reduce::argmax_row(logits) as u32;
            if s.temperature == 0.0 {
                assert_eq!(toks[0], best, "a greedy row is argmax");
            } else if toks[0] != best {
                off_argmax += 1;
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 36);
    assert!(
        e.total_counters().replays > 0,
        "the graphs must have replayed"
    );
    // The sampled rows do sample: not every token is the argmax.
    assert!(
        off_argmax > 2,
        "{off_argmax} of 24 sampled tokens left the argmax"
    );
}

#[test]
fn greedy_rows_of_a_sampling_plan_equal_the_argmax_plan_next_to_sampled_rows() {
    let model = TinyModel::default();
    let (dir, plan) = build(&model);
    let mut argmax = engine(&plan, dir.path(), GraphMode::On);
    let (_sdir, mut sampled) = sampling_engine(&model, GraphMode::On);
    let mut rng = Rng::new(41);
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| prompt(&mut rng, model.vocab, 3 + 2 * i))
        .collect();
    let a: Vec<SeqId> = prompts
        .iter()
        .map(|p| argmax.add_sequence_with(p, opts(10)).unwrap())
        .collect();
    let s: Vec<SeqId> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let id = sampled.add_sequence_with(p, opts(10)).unwrap();
            if i % 2 == 1 {
                sampled.set_sampling(id, hot(i as u64)).unwrap();
            }
            id
        })
        .collect();
    let want = run_all(&mut argmax, &a);
    let got = run_all(&mut sampled, &s);
    for i in [0, 2] {
        assert_eq!(got[i], want[i], "greedy sequence {i}");
    }
    assert!(
        got[1] != want[1] || got[3] != want[3],
        "sampled rows at T=1.3 should leave the greedy path"
    );
}

#[test]
fn a_seeded_sequence_draws_the_same_tokens_alone_in_a_batch_and_after_recompute() {
    let model = TinyModel::default();
    let mut rng = Rng::new(42);
    let p = prompt(&mut rng, model.vocab, 7);
    let others: Vec<Vec<u32>> = (0..3).map(|_| prompt(&mut rng, model.vocab, 9)).collect();

    let (_d1, mut e) = sampling_engine(&model, GraphMode::On);
    let id = e.add_sequence_with(&p, opts(14)).unwrap();
    e.set_sampling(id, hot(1234)).unwrap();
    let alone = run_all(&mut e, &[id]).remove(0);

    // In a batch with other sampled and greedy sequences, admitted first.
    let (_d2, mut e) = sampling_engine(&model, GraphMode::On);
    let mut ids = Vec::new();
    for (i, o) in others.iter().enumerate() {
        let oid = e.add_sequence_with(o, opts(20)).unwrap();
        if i != 1 {
            e.set_sampling(oid, hot(9 + i as u64)).unwrap();
        }
        ids.push(oid);
    }
    let id = e.add_sequence_with(&p, opts(14)).unwrap();
    e.set_sampling(id, hot(1234)).unwrap();
    ids.push(id);
    let batch = run_all(&mut e, &ids).pop().unwrap();
    assert_eq!(batch, alone, "the batch changed a seeded sequence's draws");

    // Preempted after 5 tokens and recomputed: prompt + those tokens as a
    // new prompt, same seed; the rest is the same.
    let (_d3, mut e) = sampling_engine(&model, GraphMode::On);
    let mut resumed = p.clone();
    resumed.extend_from_slice(&alone[..5]);
    let id = e.add_sequence_with(&resumed, opts(9)).unwrap();
    e.set_sampling(id, hot(1234)).unwrap();
    let rest = run_all(&mut e, &[id]).remove(0);
    assert_eq!(rest, alone[5..], "recompute changed the draws");

    // Another seed draws something else.
    let (_d4, mut e) = sampling_engine(&model, GraphMode::Off);
    let id = e.add_sequence_with(&p, opts(14)).unwrap();
    e.set_sampling(id, hot(1235)).unwrap();
    assert_ne!(run_all(&mut e, &[id]).remove(0), alone);
}

#[test]
fn replayed_graphs_follow_parameters_that_change_between_steps() {
    let model = TinyModel::default();
    let (_d1, mut graphs) = sampling_engine(&model, GraphMode::On);
    let (_d2, mut eager) = sampling_engine(&model, GraphMode::Off);
    let p = prompt(&mut Rng::new(43), model.vocab, 4);
    let a = graphs.add_sequence_with(&p, opts(16)).unwrap();
    let b = eager.add_sequence_with(&p, opts(16)).unwrap();
    let mut step = 0u64;
    while graphs.has_work() {
        let s = match step % 3 {
            0 => RowSampling::GREEDY,
            1 => hot(step),
            _ => RowSampling {
                top_k: 2,
                ..hot(step + 100)
            },
        };
        graphs.set_sampling(a, s).unwrap();
        eager.set_sampling(b, s).unwrap();
        graphs.step().unwrap();
        eager.step().unwrap();
        step += 1;
    }
    assert_eq!(
        graphs.sequence(a).unwrap().generated,
        eager.sequence(b).unwrap().generated
    );
    let c = graphs.total_counters();
    assert!(c.replays > 10 && c.eager_steps == 0, "{c:?}");
}

#[test]
fn an_argmax_plan_refuses_sampled_rows_and_names_the_flag() {
    let model = TinyModel::default();
    let (dir, plan) = build(&model);
    let mut e = engine(&plan, dir.path(), GraphMode::Off);
    assert!(!e.has_in_graph_sampling());
    let id = e.add_sequence(&[1, 2, 3]).unwrap();
    e.set_sampling(id, RowSampling::GREEDY).unwrap();
    let err = e.set_sampling(id, hot(1)).unwrap_err();
    assert!(matches!(err, EngineError::SamplingUnavailable { .. }));
    assert!(err.to_string().contains("--sampling"), "{err}");
}

#[test]
fn penalised_rows_draw_from_the_logits_less_presence_and_frequency_over_generated_tokens() {
    let model = TinyModel::default();
    let (_dir, mut e) = sampling_engine(&model, GraphMode::On);
    let slots = e
        .penalty_slots()
        .expect("sampling plans carry penalty slots");
    let mut rng = Rng::new(41);
    // (sampling, presence, frequency): a greedy row with a presence penalty
    // large enough that it never repeats a token, a sampled penalised row,
    // and an unpenalised row next to them.
    let cases = [
        (RowSampling::GREEDY, 1000.0f32, 0.0f32),
        (hot(5), 0.7, 0.4),
        (hot(6), 0.0, 0.0),
    ];
    let n = 10;
    let rows: Vec<(SeqId, usize)> = cases
        .iter()
        .enumerate()
        .map(|(i, &(s, p, f))| {
            let pr = prompt(&mut rng, model.vocab, 4 + i);
            let id = e.add_sequence_with(&pr, opts(n)).unwrap();
            e.set_sampling(id, s).unwrap();
            e.set_penalties(id, p, f).unwrap();
            (id, pr.len())
        })
        .collect();
    let mut checked = 0;
    while e.has_work() {
        for (id, toks) in e.step().unwrap() {
            let i = rows.iter().position(|r| r.0 == id).unwrap();
            let (s, p, f) = cases[i];
            let seq = e.sequence(id).unwrap();
            let before = &seq.generated[..seq.generated.len() - 1];
            let mut y = e.last_logits(id).unwrap().to_vec();
            for (t, v) in y.iter_mut().enumerate() {
                let c = before.iter().filter(|&&g| g as usize == t).count();
                if c > 0 {
                    *v = (*v - p) - f * c as f32;
                }
            }
            let index = rows[i].1 + before.len();
            let want = sample_row(&y, s.params(), s.seeds(index as u32));
            assert_eq!(toks, vec![want as u32], "row {i} token {index}");
            checked += 1;
        }
    }
    assert_eq!(checked, 3 * n);
    let greedy = e.sequence(rows[0].0).unwrap().generated.to_vec();
    let mut distinct = greedy.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        greedy.len(),
        "presence 1000 repeats: {greedy:?}"
    );
    // More new tokens than the slots could name is refused, naming the flag.
    let id = e.add_sequence_with(&[1, 2], opts(slots + 1)).unwrap();
    let err = e.set_penalties(id, 0.5, 0.0).unwrap_err();
    assert!(err.to_string().contains("--penalty-slots"), "{err}");
    e.set_penalties(id, 0.0, 0.0).unwrap();
}
