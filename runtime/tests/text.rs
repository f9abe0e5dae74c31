//! Text in and out: tokenizer loading, streaming that never splits a
//! character, prompt files, and `generate_text` end to end.

mod common;

use common::*;
use kiln_compiler::testing::write_byte_tokenizer;
use kiln_runtime::text::{generate_text, read_prompt_file, TextTokenizer};
use kiln_runtime::{EngineError, FinishReason, GraphMode};

#[test]
fn streamed_pieces_concatenate_to_the_full_text_and_never_split_a_character() {
    let dir = tempfile::tempdir().unwrap();
    write_byte_tokenizer(dir.path()).unwrap();
    let tok = TextTokenizer::from_dir(dir.path()).unwrap();
    let text = "héllo wörld ✓ 日本";
    let ids = tok.encode(text).unwrap();
    assert_eq!(ids.len(), text.len(), "one token per byte");
    let mut stream = tok.stream();
    let mut pieces = Vec::new();
    for &id in &ids {
        if let Some(p) = stream.push(id).unwrap() {
            pieces.push(p);
        }
    }
    assert_eq!(pieces.concat(), text);
    assert!(pieces.iter().all(|p| !p.contains('\u{fffd}')), "{pieces:?}");
    // "✓" is three bytes: the stream emitted it whole.
    assert!(pieces.iter().any(|p| p.contains('✓')));
    assert_eq!(tok.decode(&ids).unwrap(), text);
}

#[test]
fn a_stream_cut_inside_a_character_flushes_its_tail_on_finish() {
    let dir = tempfile::tempdir().unwrap();
    write_byte_tokenizer(dir.path()).unwrap();
    let tok = TextTokenizer::from_dir(dir.path()).unwrap();
    let ids = tok.encode("ok ✓").unwrap();
    // Stop one byte short of the end: "✓" is three bytes.
    let cut = &ids[..ids.len() - 1];
    let mut stream = tok.stream();
    let mut pieces = Vec::new();
    for &id in cut {
        if let Some(p) = stream.push(id).unwrap() {
            pieces.push(p);
        }
    }
    assert_eq!(pieces.concat(), "ok ", "the partial character is held back");
    let tail = stream.finish().unwrap().expect("the held-back bytes");
    pieces.push(tail);
    assert_eq!(pieces.concat(), tok.decode(cut).unwrap());
    assert!(pieces.concat().ends_with('\u{fffd}'), "{pieces:?}");
    // A stream that ended on a whole character has nothing left.
    let mut whole = tok.stream();
    for &id in &ids {
        whole.push(id).unwrap();
    }
    assert_eq!(whole.finish().unwrap(), None);
}

#[test]
fn a_missing_tokenizer_is_an_error_saying_where_it_should_be() {
    let dir = tempfile::tempdir().unwrap();
    let err = TextTokenizer::from_dir(dir.path()).err().unwrap();
    let msg = err.to_string();
    assert!(
        msg.contains("tokenizer.json") && msg.contains("kiln import"),
        "{msg}"
    );
    std::fs::write(dir.path().join("tokenizer.json"), b"{ not json").unwrap();
    let msg = TextTokenizer::from_dir(dir.path())
        .err()
        .unwrap()
        .to_string();
    assert!(msg.contains("cannot be loaded"), "{msg}");
}

#[test]
fn a_prompt_file_that_is_not_utf8_is_refused_with_the_offset() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("prompt.txt");
    std::fs::write(&path, b"caf\xe9 au lait").unwrap();
    let err = read_prompt_file(&path).unwrap_err();
    assert!(
        matches!(err, EngineError::InvalidUtf8 { offset: 3, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("prompt.txt"), "{err}");
    std::fs::write(&path, "café".as_bytes()).unwrap();
    assert_eq!(read_prompt_file(&path).unwrap(), "café");
}

#[test]
fn generate_text_streams_the_reference_continuation_and_reports_counters() {
    let mut model = TinyModel {
        vocab: 257,
        max_context: 64,
        ..TinyModel::default()
    };
    let (dir, _) = build(&model);
    write_byte_tokenizer(dir.path()).unwrap();
    let tok = TextTokenizer::from_dir(dir.path()).unwrap();
    let prompt = "kiln";
    let ids = tok.encode(prompt).unwrap();
    let w = model.weights();
    let (want, _) = model.greedy_reference(&w, &ids, 20);
    // Make the 6th reference token EOS, so generation stops there.
    model.eos = vec![want[5]];
    let stop = want.iter().position(|&t| t == want[5]).unwrap();
    let plan = model.build(dir.path()).unwrap();
    let mut e = engine(&plan, dir.path(), GraphMode::On);
    let mut text = String::new();
    let report = generate_text(&mut e, &tok, prompt, 20, &mut |p| text.push_str(p)).unwrap();
    assert_eq!(report.generated_tokens, stop + 1);
    assert_eq!(report.finish, Some(FinishReason::Eos));
    assert_eq!(text, tok.decode(&want[..=stop]).unwrap());
    assert!(report.replays > 0 && report.captures > 0 && report.eager_steps == 0);
    assert_eq!(report.prompt_tokens, ids.len());
    // The sequence was removed: the engine is idle with all blocks free.
    assert!(!e.has_work());
    assert_eq!(e.free_kv_blocks(), model.num_blocks - 1);
}
