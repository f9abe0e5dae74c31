//! Speculative decoding with prompt-lookup drafts on compiled tiny models (CPU
//! backend, real kernels): the tokens are exactly plain greedy decoding's, on
//! a battery of repetitive prompts (drafts found and accepted), random
//! prompts (no draft ever found) and batches whose sequences accept different
//! numbers of drafts in the same step.

mod serve_common;

use kiln_compiler::testing::{Family, TinySpec};
use kiln_runtime::{
    Engine, FinishReason, GraphMode, SeqId, SeqOptions, SpecError, SpecOptions, SpecStats,
    Speculator,
};
use serve_common::*;
use std::collections::BTreeMap;

/// Plain decode batches, a prefill chunk, and verification keys for 2 drafts.
const SPEC_KEYS: &str = "b1q1s0,b2q1s0,b4q1s0,b2q4s0,b1q3s2,b2q3s2,b4q3s2";

fn opts_n(n: u32) -> SeqOptions {
    SeqOptions {
        max_new_tokens: n,
        stop_on_eos: false,
    }
}

/// What a run produced per prompt: tokens and how it finished.
type Outputs = Vec<(Vec<u32>, Option<FinishReason>)>;

fn add_all(e: &mut Engine, prompts: &[Vec<u32>], n: u32) -> Vec<SeqId> {
    prompts
        .iter()
        .map(|p| e.add_sequence_with(p, opts_n(n)).unwrap())
        .collect()
}

fn collect(e: &Engine, ids: &[SeqId]) -> Outputs {
    ids.iter()
        .map(|&id| {
            let v = e.sequence(id).unwrap();
            (v.generated.to_vec(), v.finished.cloned())
        })
        .collect()
}

/// Plain greedy decoding of the batch (no drafts ever set).
fn plain(t: &Tiny, prompts: &[Vec<u32>], n: u32) -> Outputs {
    let mut e = engine(t, options(GraphMode::On));
    let ids = add_all(&mut e, prompts, n);
    while e.has_work() {
        e.step().unwrap();
    }
    for k in e.counters().keys().filter(|k| k.spec > 0) {
        assert_eq!(e.counters()[k].replays + e.counters()[k].eager_steps, 0);
    }
    collect(&e, &ids)
}

/// Lookup drafts accepted per prompt, summed over the run.
struct SpecRun {
    out: Outputs,
    stats: SpecStats,
    accepted: Vec<u32>,
    lookup_rows: Vec<u32>,
    spec_replays: u64,
}

fn speculative(t: &Tiny, prompts: &[Vec<u32>], n: u32, opts: SpecOptions) -> SpecRun {
    let mut e = engine(t, options(GraphMode::On));
    let ids = add_all(&mut e, prompts, n);
    let mut s = Speculator::new(&e, opts).unwrap();
    let mut accepted: BTreeMap<SeqId, u32> = BTreeMap::new();
    let mut lookup_rows: BTreeMap<SeqId, u32> = BTreeMap::new();
    while e.has_work() {
        s.step(&mut e).unwrap();
        for r in s.last_step() {
            if r.lookup {
                *accepted.entry(r.id).or_default() += r.accepted;
                *lookup_rows.entry(r.id).or_default() += 1;
            }
        }
    }
    let spec_replays = e
        .counters()
        .iter()
        .filter(|(k, _)| k.spec > 0)
        .map(|(_, c)| c.replays + c.eager_steps)
        .sum();
    SpecRun {
        out: collect(&e, &ids),
        stats: s.stats().clone(),
        accepted: ids
            .iter()
            .map(|id| accepted.get(id).copied().unwrap_or(0))
            .collect(),
        lookup_rows: ids
            .iter()
            .map(|id| lookup_rows.get(id).copied().unwrap_or(0))
            .collect(),
        spec_replays,
    }
}

/// `pattern` repeated to `len` tokens: prompt lookup finds it at once.
fn repeating(pattern: &[u32], len: usize) -> Vec<u32> {
    pattern.iter().copied().cycle().take(len).collect()
}

/// `len` distinct random tokens (no n-gram of the prompt repeats in it).
fn distinct(rng: &mut Rng, vocab: u32, len: usize) -> Vec<u32> {
    let mut p: Vec<u32> = Vec::new();
    while p.len() < len {
        let t = rng.below(vocab);
        if !p.contains(&t) {
            p.push(t);
        }
    }
    p
}

/// Whether any n-gram of `min_n` tokens occurs twice in `toks`.
fn has_repeated_ngram(toks: &[u32], min_n: usize) -> bool {
    (0..toks.len().saturating_sub(min_n))
        .any(|i| (i + 1..=toks.len() - min_n).any(|j| toks[i..i + min_n] == toks[j..j + min_n]))
}

#[test]
fn speculative_decoding_is_token_identical_to_greedy_for_every_family() {
    for family in Family::ALL {
        let t = compile_tiny(family, &TinySpec::for_family(family), SPEC_KEYS, false);
        let vocab = t.plan.meta.info.vocab_size;
        let mut rng = Rng::new(21 + family as u64);
        let list = rng.prompt(vocab, 7);
        let battery = vec![
            // A list repeated: the drafter copies it.
            repeating(&list, 19),
            // Short repeating pattern then a random tail.
            [repeating(&[5, 9], 6), rng.prompt(vocab, 5)].concat(),
            // Random prompts.
            rng.prompt(vocab, 9),
            rng.prompt(vocab, 3),
            // Five sequences: more than the largest spec batch (4) runs the
            // spec step in eager sub-batches.
            rng.prompt(vocab, 1),
        ];
        let want = plain(&t, &battery, 24);
        let got = speculative(&t, &battery, 24, SpecOptions::new(2));
        assert_eq!(got.out, want, "{family:?}");
        let st = &got.stats;
        assert!(st.spec_steps > 0 && st.accepted > 0, "{family:?}: {st:?}");
        assert!(got.spec_replays > 0, "{family:?}");
        assert!(
            got.accepted[0] > 0,
            "{family:?}: the repeated list accepted nothing"
        );
    }
}

#[test]
fn prompts_where_no_draft_is_ever_found_decode_plainly_and_identically() {
    // The untied tiny Llama wanders before it loops (tied tiny models repeat
    // their last token at once).
    let t = compile_tiny(Family::Llama, &TinySpec::default(), SPEC_KEYS, false);
    let vocab = t.plan.meta.info.vocab_size;
    let mut rng = Rng::new(77);
    let n = 10;
    // Random distinct prompts whose greedy continuation repeats no bigram
    // either, so a drafter with n-grams of 2..3 never finds a match. Such
    // prompts are searched for with plain decoding (an independent check).
    let mut found = Vec::new();
    let mut loops = Vec::new();
    for _ in 0..40 {
        let p = distinct(&mut rng, vocab, 8);
        let (g, _) = plain(&t, std::slice::from_ref(&p), n).remove(0);
        if !has_repeated_ngram(&[p.clone(), g.clone()].concat(), 2) {
            found.push(p);
        } else if has_repeated_ngram(&g[..n as usize / 2], 2) {
            loops.push(p); // loops early: prompt lookup will find drafts
        }
        if found.len() >= 2 && !loops.is_empty() {
            break;
        }
    }
    found.truncate(2);
    assert_eq!(
        found.len(),
        2,
        "no prompt without repeated bigrams in 40 tries"
    );
    assert!(
        !loops.is_empty(),
        "no prompt whose continuation loops in 40 tries"
    );
    let want = plain(&t, &found, n);
    let opts = SpecOptions {
        k: 2,
        min_ngram: 2,
        max_ngram: 3,
    };
    let got = speculative(&t, &found, n, opts);
    assert_eq!(got.out, want);
    assert_eq!(got.stats.spec_steps, 0, "{:?}", got.stats);
    assert_eq!(got.stats.proposed, 0);
    assert_eq!(got.spec_replays, 0);
    // Mixed with a prompt that loops, the draftless ones ride along on filler.
    let mut batch = found.clone();
    batch.push(loops[0].clone());
    let want = plain(&t, &batch, n);
    let got = speculative(&t, &batch, n, opts);
    assert_eq!(got.out, want);
    assert!(got.stats.filler_rows > 0, "{:?}", got.stats);
    assert_eq!(
        got.lookup_rows[..2],
        [0, 0],
        "the random prompts found drafts"
    );
    assert!(got.lookup_rows[2] > 0);
}

#[test]
fn sequences_accepting_different_lengths_in_one_step_stay_greedy() {
    for (keys, k) in [(SPEC_KEYS, 2), ("b1q1s0,b2q1s0,b4q1s0,b2q4s3,b4q4s3", 3)] {
        let t = compile_tiny(Family::Llama, &TinySpec::default(), keys, false);
        let vocab = t.plan.meta.info.vocab_size;
        let mut rng = Rng::new(5 + k as u64);
        let battery = vec![
            repeating(&rng.prompt(vocab, 4), 14),
            rng.prompt(vocab, 6),
            repeating(&[7, 7, 8], 10),
            rng.prompt(vocab, 11),
        ];
        let want = plain(&t, &battery, 30);
        let got = speculative(&t, &battery, 30, SpecOptions::new(k));
        assert_eq!(got.out, want, "k {k}");
        assert!(
            got.stats.mixed_steps > 0,
            "k {k}: no step where rows accepted different lengths: {:?}",
            got.stats
        );
        assert!(got.stats.accepted > 0 && got.stats.accepted < got.stats.proposed);
    }
}

#[test]
fn sequences_reaching_the_context_limit_finish_as_plain_decoding_does() {
    let t = compile_tiny(Family::Llama, &TinySpec::default(), SPEC_KEYS, false);
    let max = t.plan.meta.info.max_context as usize;
    let mut rng = Rng::new(9);
    let vocab = t.plan.meta.info.vocab_size;
    let battery = vec![
        repeating(&rng.prompt(vocab, 5), max - 12),
        repeating(&[4, 2], 10),
    ];
    let want = plain(&t, &battery, 40);
    assert_eq!(want[0].1, Some(FinishReason::ContextFull));
    let got = speculative(&t, &battery, 40, SpecOptions::new(2));
    assert_eq!(got.out, want);
    assert!(got.stats.accepted > 0);
}

#[test]
fn a_plan_without_the_verification_key_is_refused_naming_the_compile_fix() {
    let t = smollm2("b1q1s0,b1q3s2");
    let e = engine(&t, options(GraphMode::On));
    let err = Speculator::new(&e, SpecOptions::new(3)).unwrap_err();
    assert!(matches!(err, SpecError::NoSpecKey { k: 3, .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("b1q4s3") && msg.contains("kiln compile --keys"),
        "{msg}"
    );
    assert!(
        msg.contains("b1q3s2"),
        "the compiled spec keys are listed: {msg}"
    );
    let err = Speculator::new(&e, SpecOptions::new(0)).unwrap_err();
    assert!(matches!(err, SpecError::Draft(_)), "{err:?}");
}
