//! Bad input to the frontend: each case gets a clear error that names the
//! problem and the fix, never a panic.

mod frontend_common;

use frontend_common::{patch_config, rewrite_tensors, tiny};
use kiln_compiler::frontend::{open, FrontendError, TraceOptions};
use kiln_compiler::testing::{Family, TinySpec};
use kiln_ir::{DType, Key};
use serde_json::json;
use std::path::Path;

fn open_err(dir: &Path) -> (FrontendError, String) {
    let e = open(dir).expect_err("opening should fail");
    let s = e.to_string();
    (e, s)
}

fn assert_has(msg: &str, needles: &[&str]) {
    for n in needles {
        assert!(msg.contains(n), "`{msg}` lacks `{n}`");
    }
}

#[test]
fn an_unknown_architecture_lists_the_supported_ones() {
    let dir = tiny(Family::Llama, &TinySpec::default());
    patch_config(dir.path(), |c| {
        c.insert("architectures".into(), json!(["GPT2LMHeadModel"]));
    });
    let (e, s) = open_err(dir.path());
    assert!(matches!(e, FrontendError::UnknownArchitecture { .. }));
    assert_has(
        &s,
        &[
            "GPT2LMHeadModel",
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "Qwen2ForCausalLM",
            "Qwen3ForCausalLM",
            "config.json",
        ],
    );
    patch_config(dir.path(), |c| {
        c.remove("architectures");
        c.remove("model_type");
    });
    let (_, s) = open_err(dir.path());
    assert_has(&s, &["neither `architectures` nor `model_type`"]);
}

#[test]
fn a_missing_tensor_is_named_with_the_files_searched() {
    let dir = tiny(Family::Qwen3, &TinySpec::for_family(Family::Qwen3));
    rewrite_tensors(&dir.path().join("model.safetensors"), |t| {
        t.retain(|x| x.0 != "model.layers.1.self_attn.k_norm.weight")
    });
    let (e, s) = open_err(dir.path());
    assert!(matches!(e, FrontendError::MissingTensor { .. }));
    assert_has(
        &s,
        &[
            "model.layers.1.self_attn.k_norm.weight",
            "searched model.safetensors",
            "Qwen3ForCausalLM",
        ],
    );
}

#[test]
fn an_untied_config_without_lm_head_suggests_tie_word_embeddings() {
    let dir = tiny(Family::Qwen2, &TinySpec::for_family(Family::Qwen2));
    patch_config(dir.path(), |c| {
        c.insert("tie_word_embeddings".into(), json!(false));
    });
    let (_, s) = open_err(dir.path());
    assert_has(&s, &["lm_head.weight", "\"tie_word_embeddings\": true"]);
}

#[test]
fn a_shape_that_disagrees_with_the_config_shows_expected_and_found() {
    let dir = tiny(Family::Llama, &TinySpec::default());
    patch_config(dir.path(), |c| {
        c.insert("intermediate_size".into(), json!(96));
    });
    let (e, s) = open_err(dir.path());
    assert!(matches!(e, FrontendError::ShapeMismatch { .. }));
    assert_has(
        &s,
        &[
            "model.layers.0.mlp.gate_proj.weight",
            "[128,64]",
            "[96,64]",
            "intermediate_size",
        ],
    );
}

#[test]
fn an_integer_weight_is_a_dtype_mismatch_with_the_stored_type() {
    let dir = tiny(Family::Llama, &TinySpec::default());
    rewrite_tensors(&dir.path().join("model.safetensors"), |t| {
        let x = t.iter_mut().find(|x| x.0 == "model.norm.weight").unwrap();
        x.1 = DType::I32;
        x.3 = vec![1; 64 * 4];
    });
    let (e, s) = open_err(dir.path());
    assert!(matches!(e, FrontendError::DtypeMismatch { .. }));
    assert_has(&s, &["model.norm.weight", "I32", "BF16, F16 or F32"]);
}

#[test]
fn truncated_and_corrupt_safetensors_headers_are_reported_with_the_file() {
    let dir = tiny(Family::Llama, &TinySpec::default());
    let p = dir.path().join("model.safetensors");
    let full = std::fs::read(&p).unwrap();

    std::fs::write(&p, &full[..40]).unwrap();
    let (e, s) = open_err(dir.path());
    assert!(matches!(e, FrontendError::Header(_)));
    assert_has(&s, &["model.safetensors", "header", "truncated"]);

    std::fs::write(&p, &full[..full.len() - 10]).unwrap();
    let (_, s) = open_err(dir.path());
    assert_has(&s, &["model.safetensors", "run past", "truncated"]);

    std::fs::write(&p, &full[..5]).unwrap();
    let (_, s) = open_err(dir.path());
    assert_has(&s, &["too short"]);

    let mut bad = full.clone();
    bad[8] = b'#';
    std::fs::write(&p, &bad).unwrap();
    let (_, s) = open_err(dir.path());
    assert_has(&s, &["model.safetensors", "not valid JSON"]);
}

#[test]
fn an_index_pointing_at_a_missing_shard_names_the_shard() {
    let dir = tiny(
        Family::Llama,
        &TinySpec {
            shards: 2,
            ..TinySpec::default()
        },
    );
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let (e, s) = open_err(dir.path());
    assert!(matches!(e, FrontendError::MissingShard { .. }));
    assert_has(
        &s,
        &[
            "model.safetensors.index.json",
            "model-00002-of-00002.safetensors",
            "download the missing shard",
        ],
    );
}

#[test]
fn a_stale_index_is_caught_when_the_shard_lacks_the_tensor() {
    let dir = tiny(
        Family::Llama,
        &TinySpec {
            shards: 2,
            ..TinySpec::default()
        },
    );
    let p = dir.path().join("model.safetensors.index.json");
    let mut idx: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let map = idx["weight_map"].as_object_mut().unwrap();
    let first = map["model.embed_tokens.weight"].clone();
    let other = if first == json!("model-00001-of-00002.safetensors") {
        "model-00002-of-00002.safetensors"
    } else {
        "model-00001-of-00002.safetensors"
    };
    map.insert("model.embed_tokens.weight".into(), json!(other));
    std::fs::write(&p, idx.to_string()).unwrap();
    let (_, s) = open_err(dir.path());
    assert_has(
        &s,
        &["model.embed_tokens.weight", other, "different downloads"],
    );

    idx["weight_map"]
        .as_object_mut()
        .unwrap()
        .remove("model.embed_tokens.weight");
    std::fs::write(&p, idx.to_string()).unwrap();
    let (_, s) = open_err(dir.path());
    assert_has(
        &s,
        &["model.embed_tokens.weight", "weight_map has no entry"],
    );

    idx["weight_map"]
        .as_object_mut()
        .unwrap()
        .insert("x".into(), json!("../outside.safetensors"));
    std::fs::write(&p, idx.to_string()).unwrap();
    let (e, s) = open_err(dir.path());
    assert!(matches!(e, FrontendError::BadIndex { .. }));
    assert_has(
        &s,
        &[
            "../outside.safetensors",
            "not a file in the model directory",
        ],
    );
}

#[test]
fn missing_or_inconsistent_config_fields_name_the_field() {
    let cases: Vec<(serde_json::Value, Vec<&str>)> = vec![
        (
            json!({"num_key_value_heads": 3}),
            vec![
                "num_key_value_heads",
                "3 does not divide num_attention_heads 4",
            ],
        ),
        (
            json!({"hidden_size": 66}),
            vec![
                "hidden_size",
                "not divisible by num_attention_heads 4",
                "add `head_dim`",
            ],
        ),
        (
            json!({"hidden_act": "gelu_pytorch_tanh"}),
            vec!["hidden_act", "silu"],
        ),
        (
            json!({"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
            vec!["rope_scaling", "`dynamic` is not supported", "llama3"],
        ),
        (
            json!({"sliding_window": 0}),
            vec!["sliding_window", "at least 1"],
        ),
        (
            json!({"hidden_size": "sixty-four"}),
            vec!["config.json", "invalid type"],
        ),
    ];
    for (patch, needles) in cases {
        let dir = tiny(Family::Mistral, &TinySpec::for_family(Family::Mistral));
        patch_config(dir.path(), |c| {
            for (k, v) in patch.as_object().unwrap() {
                c.insert(k.clone(), v.clone());
            }
        });
        let (_, s) = open_err(dir.path());
        assert_has(&s, &needles);
        assert!(s.contains("config.json"), "{s}");
    }
    let dir = tiny(Family::Llama, &TinySpec::default());
    patch_config(dir.path(), |c| {
        c.remove("num_hidden_layers");
    });
    let (e, s) = open_err(dir.path());
    assert!(matches!(e, FrontendError::Config { .. }));
    assert_has(&s, &["`num_hidden_layers` is missing", "add it"]);
    std::fs::write(dir.path().join("config.json"), "{ \"vocab_size\": 3,").unwrap();
    let (e, _) = open_err(dir.path());
    assert!(matches!(e, FrontendError::ConfigJson { .. }));
}

#[test]
fn a_directory_without_config_or_weights_says_what_it_needs() {
    let dir = tempfile::tempdir().unwrap();
    let (e, s) = open_err(dir.path());
    assert!(matches!(e, FrontendError::NoConfig { .. }));
    assert_has(&s, &["no config.json", "model.safetensors"]);

    let dir = tiny(Family::Llama, &TinySpec::default());
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let (e, s) = open_err(dir.path());
    assert!(matches!(e, FrontendError::NoWeights { .. }));
    assert_has(
        &s,
        &["no model.safetensors", "model.safetensors.index.json"],
    );
    std::fs::write(dir.path().join("pytorch_model.bin"), b"x").unwrap();
    let (_, s) = open_err(dir.path());
    assert_has(&s, &["PyTorch .bin", "safetensors"]);

    let (e, _) = open_err(&dir.path().join("config.json"));
    assert!(matches!(e, FrontendError::NotADirectory { .. }));
}

#[test]
fn invalid_keys_are_rejected_before_tracing() {
    let dir = tiny(Family::Llama, &TinySpec::default());
    let m = open(dir.path()).unwrap();
    let kv = m.kv_layout(16, 8);
    let o = TraceOptions::default();
    let cases = [
        (Key::new(0, 1, 0), "batch must be at least 1"),
        (Key::new(1, 0, 0), "query must be at least 1"),
        (Key::new(1, 2, 2), "must be smaller than query"),
        (Key::new(2, 4, 1), "query must be spec+1 = 2; use b2q2s1"),
        (Key::new(u32::MAX, 2, 0), "overflows"),
    ];
    for (key, needle) in cases {
        let s = m.trace(key, &kv, &o).unwrap_err().to_string();
        assert_has(&s, &[needle]);
    }
}

#[test]
fn a_kv_layout_that_does_not_fit_the_model_is_rejected() {
    let dir = tiny(Family::Llama, &TinySpec::default());
    let m = open(dir.path()).unwrap();
    let good = m.kv_layout(16, 8);
    let o = TraceOptions::default();
    let k = Key::new(1, 1, 0);
    let cases = [
        (
            kiln_ir::plan::KvLayout {
                layers: 3,
                ..good.clone()
            },
            "layers is 3 but the model has 2",
        ),
        (
            kiln_ir::plan::KvLayout {
                head_dim: 8,
                ..good.clone()
            },
            "head_dim is 8 but the model has 16",
        ),
        (
            kiln_ir::plan::KvLayout {
                dtype: DType::F32,
                ..good.clone()
            },
            "use a bf16 cache",
        ),
        (
            kiln_ir::plan::KvLayout {
                block_size: 0,
                ..good.clone()
            },
            "at least 1",
        ),
        (
            kiln_ir::plan::KvLayout {
                null_block: 8,
                ..good.clone()
            },
            "null_block 8",
        ),
        (
            kiln_ir::plan::KvLayout {
                num_blocks: u32::MAX,
                ..good.clone()
            },
            "use fewer blocks",
        ),
    ];
    for (kv, needle) in cases {
        let e = m.trace(k, &kv, &o).unwrap_err();
        assert!(matches!(e, FrontendError::KvLayout { .. }));
        assert_has(&e.to_string(), &[needle]);
    }
    assert!(m.trace(k, &good, &o).is_ok());
}
