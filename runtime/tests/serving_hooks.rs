//! The engine's serving hooks (what kiln-serve's scheduler uses beyond
//! add/remove/step), against a tiny compiled model and its
//! greedy reference.

mod common;

use common::*;

use kiln_runtime::{EngineError, GraphMode, PrefillMode, SeqOptions};

fn opts(n: u32) -> SeqOptions {
    SeqOptions {
        max_new_tokens: n,
        stop_on_eos: false,
    }
}

#[test]
fn a_replaced_last_token_is_what_the_next_step_feeds() {
    let model = TinyModel::default();
    let (dir, plan) = build(&model);
    let mut e = engine(&plan, dir.path(), GraphMode::On);
    let w = model.weights();
    let p = prompt(&mut Rng::new(5), model.vocab, 6);
    let id = e.add_sequence_with(&p, opts(4)).unwrap();
    // Step until the first token exists.
    while e.sequence(id).unwrap().generated.is_empty() {
        e.step().unwrap();
    }
    let argmax = e.sequence(id).unwrap().generated[0];
    let other = (argmax + 1) % model.vocab;
    e.replace_last_token(id, other).unwrap();
    e.step().unwrap();
    let got = e.sequence(id).unwrap().generated.to_vec();
    assert_eq!(got[0], other);
    let mut with_other = p.clone();
    with_other.push(other);
    let (want, _) = model.greedy_reference(&w, &with_other, 1);
    assert_eq!(got[1], want[0], "the step after a replacement must see it");
}

#[test]
fn replacing_is_refused_before_any_token_and_outside_the_vocabulary() {
    let model = TinyModel::default();
    let (dir, plan) = build(&model);
    let mut e = engine(&plan, dir.path(), GraphMode::Off);
    let id = e.add_sequence_with(&[1, 2, 3], opts(4)).unwrap();
    assert!(matches!(
        e.replace_last_token(id, 0),
        Err(EngineError::TokenNotReplaceable { .. })
    ));
    while e.sequence(id).unwrap().generated.is_empty() {
        e.step().unwrap();
    }
    assert!(matches!(
        e.replace_last_token(id, model.vocab),
        Err(EngineError::InvalidToken { .. })
    ));
}

#[test]
fn block_accounting_hooks_agree_with_the_allocator() {
    let model = TinyModel::default();
    let (dir, plan) = build(&model);
    let mut e = engine(&plan, dir.path(), GraphMode::Off);
    let usable = e.usable_kv_blocks();
    assert_eq!(e.free_kv_blocks(), usable);
    // Block size 4: a prompt of 8 takes 2 blocks; its first token (position 8)
    // needs none until position 8 is computed, i.e. one more at the decode.
    let id = e.add_sequence_with(&[1; 8], opts(10)).unwrap();
    assert_eq!(e.sequence_kv_blocks(id), Some(2));
    assert_eq!(e.kv_blocks_for(9), 3);
    assert_eq!(e.prefill_remaining(id), Some(8));
    e.set_prefill_mode(PrefillMode::TokenByToken);
    while e.sequence(id).unwrap().generated.is_empty() {
        e.step().unwrap();
    }
    assert_eq!(e.prefill_remaining(id), Some(0));
    assert_eq!(e.kv_blocks_for_next_token(id), Some(1));
    e.step().unwrap();
    assert_eq!(e.sequence_kv_blocks(id), Some(3));
    assert_eq!(e.free_kv_blocks(), usable - 3);
    e.remove_sequence(id).unwrap();
    assert_eq!(e.free_kv_blocks(), usable);
}

#[test]
fn logits_are_read_only_while_asked_for() {
    let model = TinyModel::default();
    let (dir, plan) = build(&model);
    let mut e = engine(&plan, dir.path(), GraphMode::Off);
    assert!(e.has_logits_output());
    e.set_keep_logits(false);
    let id = e.add_sequence_with(&[1, 2], opts(3)).unwrap();
    while e.sequence(id).unwrap().generated.is_empty() {
        e.step().unwrap();
    }
    assert!(e.last_logits(id).is_none());
    e.set_keep_logits(true);
    e.step().unwrap();
    assert_eq!(e.last_logits(id).unwrap().len(), model.vocab as usize);
}
