//! SentencePiece vocabularies (`tokenizer.ggml.model = "llama"`) built into
//! `tokenizers` BPE models: merges in score order, `<0xNN>` byte fallback,
//! the `▁` space rule with and without the space prefix, special tokens and
//! add_bos from the metadata, and damaged vocabularies as clear errors.

use kiln_compiler::gguf::{GgufFile, GgufWriter};
use kiln_compiler::tokenizer_build::{build_tokenizer, TokenizerBuildError, TokenizerKind};
use std::str::FromStr;

/// `<unk>`, `<s>`, `</s>`, `<start>` (control), the 256 byte tokens, then
/// the pieces with their scores.
fn vocab(pieces: &[(&str, f32)]) -> (Vec<String>, Vec<f32>, Vec<i32>) {
    let mut toks: Vec<String> = ["<unk>", "<s>", "</s>", "<start>"]
        .map(String::from)
        .to_vec();
    let mut scores = vec![0.0; 4];
    let mut types = vec![2, 3, 3, 3];
    for b in 0..=255u8 {
        toks.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        types.push(6);
    }
    for (p, s) in pieces {
        toks.push(p.to_string());
        scores.push(*s);
        types.push(1);
    }
    (toks, scores, types)
}

fn writer(pieces: &[(&str, f32)], prefix: Option<bool>, add_bos: bool) -> GgufWriter {
    let (toks, scores, types) = vocab(pieces);
    let mut w = GgufWriter::new();
    w.add_str("tokenizer.ggml.model", "llama")
        .add_str_array("tokenizer.ggml.tokens", &toks)
        .add_f32_array("tokenizer.ggml.scores", &scores)
        .add_i32_array("tokenizer.ggml.token_type", &types)
        .add_u32("tokenizer.ggml.unknown_token_id", 0)
        .add_u32("tokenizer.ggml.bos_token_id", 1)
        .add_u32("tokenizer.ggml.eos_token_id", 2)
        .add_bool("tokenizer.ggml.add_bos_token", add_bos);
    if let Some(p) = prefix {
        w.add_bool("tokenizer.ggml.add_space_prefix", p);
    }
    w
}

fn build(w: &GgufWriter) -> Result<tokenizers::Tokenizer, TokenizerBuildError> {
    let g = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    let built = build_tokenizer(&g, None)?;
    assert_eq!(built.kind, TokenizerKind::SentencePiece);
    Ok(tokenizers::Tokenizer::from_str(&built.tokenizer_json).unwrap())
}

fn pieces(tok: &tokenizers::Tokenizer, text: &str, special: bool) -> Vec<String> {
    tok.encode(text, special).unwrap().get_tokens().to_vec()
}

const BASE: [(&str, f32); 8] = [
    ("▁", -1.0),
    ("a", -2.0),
    ("b", -3.0),
    ("c", -4.0),
    ("h", -5.0),
    ("i", -6.0),
    ("▁h", -7.0),
    ("▁hi", -8.0),
];

#[test]
fn merges_follow_the_merged_tokens_scores() {
    // "abc" can become ab+c or a+bc; the higher-scoring piece wins.
    let mut v = BASE.to_vec();
    v.extend([("ab", -10.0), ("bc", -20.0)]);
    let tok = build(&writer(&v, Some(false), false)).unwrap();
    assert_eq!(pieces(&tok, "abc", false), ["ab", "c"]);
    let mut v = BASE.to_vec();
    v.extend([("ab", -20.0), ("bc", -10.0)]);
    let tok = build(&writer(&v, Some(false), false)).unwrap();
    assert_eq!(pieces(&tok, "abc", false), ["a", "bc"]);
}

#[test]
fn spaces_become_the_visible_space_and_the_prefix_follows_the_metadata() {
    // Default (Llama 2, Mistral): a ▁ is prepended.
    let tok = build(&writer(&BASE, None, false)).unwrap();
    assert_eq!(pieces(&tok, "hi hi", false), ["▁hi", "▁hi"]);
    assert_eq!(
        tok.decode(tok.encode("hi hi", false).unwrap().get_ids(), false)
            .unwrap(),
        "hi hi"
    );
    // Gemma: add_space_prefix = false.
    let tok = build(&writer(&BASE, Some(false), false)).unwrap();
    assert_eq!(pieces(&tok, "hi hi", false), ["h", "i", "▁hi"]);
    assert_eq!(
        tok.decode(tok.encode("hi hi", false).unwrap().get_ids(), false)
            .unwrap(),
        "hi hi"
    );
}

#[test]
fn characters_outside_the_vocabulary_fall_back_to_byte_tokens() {
    let tok = build(&writer(&BASE, Some(false), false)).unwrap();
    assert_eq!(pieces(&tok, "aé", false), ["a", "<0xC3>", "<0xA9>"]);
    let ids = tok.encode("aé€", false).unwrap().get_ids().to_vec();
    assert_eq!(tok.decode(&ids, false).unwrap(), "aé€");
}

#[test]
fn bos_comes_from_the_metadata_and_control_tokens_stay_whole() {
    let tok = build(&writer(&BASE, Some(false), true)).unwrap();
    let enc = tok.encode("<start>hi", true).unwrap();
    assert_eq!(enc.get_tokens(), ["<s>", "<start>", "h", "i"]);
    assert_eq!(enc.get_ids()[0], 1);
    let tok = build(&writer(&BASE, Some(false), false)).unwrap();
    assert_eq!(tok.encode("hi", true).unwrap().get_tokens(), ["h", "i"]);
}

#[test]
fn damaged_sentencepiece_vocabularies_are_refused_by_name() {
    // Scores missing.
    let (toks, _, types) = vocab(&BASE);
    let mut w = GgufWriter::new();
    w.add_str("tokenizer.ggml.model", "llama")
        .add_str_array("tokenizer.ggml.tokens", &toks)
        .add_i32_array("tokenizer.ggml.token_type", &types);
    let err = build(&w).unwrap_err();
    assert!(err.to_string().contains("tokenizer.ggml.scores"), "{err}");

    // Scores of the wrong length.
    let mut w = GgufWriter::new();
    w.add_str("tokenizer.ggml.model", "llama")
        .add_str_array("tokenizer.ggml.tokens", &toks)
        .add_f32_array("tokenizer.ggml.scores", &[0.0; 3])
        .add_i32_array("tokenizer.ggml.token_type", &types);
    let err = build(&w).unwrap_err();
    assert!(
        matches!(err, TokenizerBuildError::ScoresLength { scores: 3, .. }),
        "{err}"
    );

    // A byte token that is not <0xNN>.
    let (mut toks, scores, types) = vocab(&BASE);
    toks[4 + 0x41] = "<0xZZ>".into();
    let mut w = GgufWriter::new();
    w.add_str("tokenizer.ggml.model", "llama")
        .add_str_array("tokenizer.ggml.tokens", &toks)
        .add_f32_array("tokenizer.ggml.scores", &scores)
        .add_i32_array("tokenizer.ggml.token_type", &types);
    let err = build(&w).unwrap_err();
    assert!(
        matches!(err, TokenizerBuildError::BadByteToken { id: 69, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("<0xZZ>"), "{err}");

    // A duplicated piece.
    let mut v = BASE.to_vec();
    v.push(("a", -30.0));
    let err = build(&writer(&v, None, false)).unwrap_err();
    assert!(
        matches!(err, TokenizerBuildError::DuplicateToken { .. }),
        "{err}"
    );
}
