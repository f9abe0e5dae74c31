//! `kiln import` end to end on tiny random llama GGUFs written by the test:
//! weights, config, tokenizer, the output directory protocol, and every
//! refusal.

use kiln_compiler::gguf::fixture::{self, TinyLlama};
use kiln_compiler::gguf::{GgmlType, GgufFile, GgufWriter, MetaValue};
use kiln_compiler::import::{self, hf_tensor_name, ImportError, ImportOptions};
use kiln_compiler::tokenizer_build::TokenizerBuildError;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::path::{Path, PathBuf};
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

struct Case {
    _dir: tempfile::TempDir,
    gguf: PathBuf,
    out: PathBuf,
}

fn case_from_writer(w: &GgufWriter) -> Case {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    w.write(&gguf).unwrap();
    let out = dir.path().join("models").join("tiny");
    Case {
        _dir: dir,
        gguf,
        out,
    }
}

fn import(case: &Case) -> Result<import::ImportReport, ImportError> {
    import::import_gguf(&case.gguf, &case.out, &ImportOptions::default())
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn bf16_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

/// No `.kiln-import-*` directory is left beside the output.
fn assert_no_temp_dirs(out: &Path) {
    let parent = out.parent().unwrap();
    if let Ok(entries) = std::fs::read_dir(parent) {
        for e in entries {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            assert!(!name.starts_with(".kiln-import"), "left behind: {name}");
        }
    }
}

/// Rebuilds a GGUF image with its metadata and tensors passed through
/// `meta` and `tensor` (return `None` to drop an entry).
fn rewrite(
    src: &GgufWriter,
    meta: impl Fn(&str, &MetaValue) -> Option<MetaValue>,
    tensor: impl Fn(&str, &[u64], GgmlType, &[u8]) -> Option<(String, Vec<u64>, GgmlType, Vec<u8>)>,
) -> GgufWriter {
    let g = GgufFile::from_bytes(src.to_bytes().unwrap()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        if let Some(v) = meta(k, v) {
            w.add_meta(k, v);
        }
    }
    for t in g.tensors() {
        if let Some((name, dims, ty, data)) =
            tensor(&t.name, &t.dims, t.ggml_type, g.tensor_bytes(t))
        {
            w.add_raw_tensor(&name, &dims, ty, data).unwrap();
        }
    }
    w
}

fn keep_meta(_: &str, v: &MetaValue) -> Option<MetaValue> {
    Some(v.clone())
}

fn keep_tensor(
    n: &str,
    d: &[u64],
    t: GgmlType,
    b: &[u8],
) -> Option<(String, Vec<u64>, GgmlType, Vec<u8>)> {
    Some((n.to_string(), d.to_vec(), t, b.to_vec()))
}

fn check_weights(spec: &TinyLlama) {
    let built = spec.build().unwrap();
    let case = case_from_writer(&built.writer);
    let report = import(&case).unwrap();
    assert_eq!(report.tensors_written, built.expected.len());
    let bytes = std::fs::read(case.out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    let want: Vec<String> = built.expected.keys().cloned().collect();
    assert_eq!(names, want);
    assert_eq!(names.contains(&"lm_head.weight".to_string()), !spec.tied);
    for (name, (shape, values)) in &built.expected {
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), Dtype::BF16, "{name}");
        let got_shape: Vec<u64> = t.shape().iter().map(|&d| d as u64).collect();
        assert_eq!(&got_shape, shape, "{name}");
        let got = bf16_values(t.data());
        for (i, (g, w)) in got.iter().zip(values).enumerate() {
            // bf16 rounding of the f32 value, nothing more.
            assert!(
                (g - w).abs() <= w.abs() * 2f32.powi(-8),
                "{name}[{i}]: {g} vs {w} ({spec:?})"
            );
        }
    }
    assert_no_temp_dirs(&case.out);
}

#[test]
fn tiny_q4_1_model_imports_to_unpermuted_bf16_weights_under_hf_names() {
    check_weights(&TinyLlama::default());
}

#[test]
fn every_supported_ggml_type_imports_and_an_untied_lm_head_is_written() {
    let combos = [
        (GgmlType::Q4_0, GgmlType::F16, GgmlType::F32, false),
        (GgmlType::Q8_0, GgmlType::BF16, GgmlType::F16, false),
        (GgmlType::F16, GgmlType::F32, GgmlType::BF16, true),
        (GgmlType::BF16, GgmlType::Q4_1, GgmlType::F32, false),
        (GgmlType::F32, GgmlType::Q4_0, GgmlType::F32, true),
    ];
    for (i, (matrix_type, embed_type, norm_type, tied)) in combos.into_iter().enumerate() {
        check_weights(&TinyLlama {
            matrix_type,
            embed_type,
            norm_type,
            tied,
            seed: 100 + i as u64,
            ..TinyLlama::default()
        });
    }
}

#[test]
fn multi_query_attention_unpermutes_k_with_its_single_head() {
    check_weights(&TinyLlama {
        heads: 4,
        kv_heads: 1,
        ..TinyLlama::default()
    });
    check_weights(&TinyLlama {
        heads: 2,
        kv_heads: 2,
        hidden: 64,
        ..TinyLlama::default()
    });
}

#[test]
fn config_json_carries_the_gguf_hyperparameters() {
    let spec = TinyLlama::default();
    let case = case_from_writer(&spec.build().unwrap().writer);
    let report = import(&case).unwrap();
    let c = read_json(&case.out.join("config.json"));
    assert_eq!(c["architectures"][0], "LlamaForCausalLM");
    assert_eq!(c["model_type"], "llama");
    assert_eq!(c["hidden_size"], 64);
    assert_eq!(c["intermediate_size"], 96);
    assert_eq!(c["num_hidden_layers"], 2);
    assert_eq!(c["num_attention_heads"], 4);
    assert_eq!(c["num_key_value_heads"], 2);
    assert_eq!(c["head_dim"], 16);
    // Stored as f32 in the GGUF, written as the decimal a person would.
    assert_eq!(c["rms_norm_eps"].as_f64(), Some(1e-5));
    assert_eq!(c["rope_theta"].as_f64(), Some(100000.0));
    assert_eq!(c["max_position_embeddings"], 512);
    assert_eq!(c["vocab_size"], fixture::vocabulary().len());
    assert_eq!(c["tie_word_embeddings"], true);
    assert_eq!(c["bos_token_id"], 1);
    assert_eq!(c["eos_token_id"], 2);
    assert_eq!(c["torch_dtype"], "bfloat16");
    assert_eq!(c["hidden_act"], "silu");
    let g = read_json(&case.out.join("generation_config.json"));
    assert_eq!(
        (g["bos_token_id"].clone(), g["eos_token_id"].clone()),
        (1.into(), 2.into())
    );
    assert_eq!(
        report.config.vocab_size as usize,
        fixture::vocabulary().len()
    );
    assert_eq!(report.source_types[&GgmlType::Q4_1], 2 * 7);
    assert_eq!(report.source_types[&GgmlType::Q8_0], 1);
    assert_eq!(report.source_types[&GgmlType::F32], 2 * 2 + 1);
}

#[test]
fn imported_tokenizer_applies_merges_keeps_specials_whole_and_round_trips() {
    let case = case_from_writer(&TinyLlama::default().build().unwrap().writer);
    import(&case).unwrap();
    let tok = tokenizers::Tokenizer::from_file(case.out.join("tokenizer.json")).unwrap();
    let vocab = fixture::vocabulary();
    let id = |s: &str| vocab.iter().position(|t| t == s).unwrap() as u32;
    let enc = tok.encode("hello world", false).unwrap();
    assert_eq!(
        enc.get_ids(),
        &[id("hell"), id("o"), id("Ġwor"), id("l"), id("d")]
    );

    let chat = "<|im_start|>user\nhello<|im_end|>";
    let ids = tok.encode(chat, false).unwrap().get_ids().to_vec();
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.last(), Some(&2));
    assert_eq!(tok.decode(&ids, false).unwrap(), chat);
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhello");

    for text in [
        "",
        "  leading spaces and trailing   ",
        "tabs\tand\nnewlines\r\n\n",
        "naïve façade — 日本語 한국어 ✓ 👍🏽 👨‍👩‍👧",
        "fn main() { println!(\"{}\", 1 + 2); }",
        "\u{0}\u{1f}\u{7f} control bytes",
    ] {
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(tok.decode(&ids, false).unwrap(), text, "{text:?}");
    }

    let cfg = read_json(&case.out.join("tokenizer_config.json"));
    assert_eq!(cfg["chat_template"], fixture::CHAT_TEMPLATE);
    assert_eq!(cfg["bos_token"], "<|im_start|>");
    assert_eq!(cfg["eos_token"], "<|im_end|>");
    assert_eq!(cfg["add_bos_token"], false);
    assert_eq!(cfg["added_tokens_decoder"]["2"]["special"], true);
}

#[test]
fn the_pre_tokenizer_follows_tokenizer_ggml_pre() {
    // "12" is a merge; SmolLM's pre-tokenizer splits digits first, GPT-2's
    // and Llama-3's keep them together.
    for (pre, want) in [
        ("smollm", 2usize),
        ("default", 1),
        ("llama-bpe", 1),
        ("qwen2", 2),
    ] {
        let spec = TinyLlama {
            pre: pre.to_string(),
            ..TinyLlama::default()
        };
        let g = GgufFile::from_bytes(spec.build().unwrap().writer.to_bytes().unwrap()).unwrap();
        let built = kiln_compiler::tokenizer_build::build_tokenizer(&g, None).unwrap();
        let tok: tokenizers::Tokenizer = built.tokenizer_json.parse().unwrap();
        let n = tok.encode("12", false).unwrap().get_ids().len();
        assert_eq!(n, want, "pre {pre}");
        // Llama-3 groups at most three digits.
        if pre == "llama-bpe" {
            let mut s = PreTokenizedString::from("1234567");
            tok.get_pre_tokenizer()
                .unwrap()
                .pre_tokenize(&mut s)
                .unwrap();
            let pieces: Vec<&str> = s
                .get_splits(OffsetReferential::Original, OffsetType::Byte)
                .into_iter()
                .map(|(piece, _, _)| piece)
                .collect();
            assert_eq!(pieces, ["123", "456", "7"]);
        }
    }
}

#[test]
fn add_bos_token_true_prepends_bos_through_the_post_processor() {
    let built = TinyLlama::default().build().unwrap();
    let w = rewrite(
        &built.writer,
        |k, v| {
            Some(if k == "tokenizer.ggml.add_bos_token" {
                MetaValue::Bool(true)
            } else {
                v.clone()
            })
        },
        keep_tensor,
    );
    let g = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    let built = kiln_compiler::tokenizer_build::build_tokenizer(&g, None).unwrap();
    let tok: tokenizers::Tokenizer = built.tokenizer_json.parse().unwrap();
    assert_eq!(tok.encode("hello", true).unwrap().get_ids()[0], 1);
    assert_ne!(tok.encode("hello", false).unwrap().get_ids()[0], 1);
}

#[test]
fn an_existing_output_directory_is_kept_unless_force_is_given() {
    let case = case_from_writer(&TinyLlama::default().build().unwrap().writer);
    std::fs::create_dir_all(&case.out).unwrap();
    std::fs::write(case.out.join("marker"), "old").unwrap();
    let err = import(&case).unwrap_err();
    assert!(matches!(err, ImportError::OutputExists { .. }), "{err}");
    assert!(err.to_string().contains("--force"), "{err}");
    assert!(case.out.join("marker").exists());

    import::import_gguf(
        &case.gguf,
        &case.out,
        &ImportOptions {
            force: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(!case.out.join("marker").exists());
    assert!(case.out.join("model.safetensors").exists());
    assert_no_temp_dirs(&case.out);
}

fn assert_refused(w: GgufWriter, check: impl Fn(&ImportError) -> bool, needle: &str) {
    let case = case_from_writer(&w);
    let err = import(&case).unwrap_err();
    assert!(check(&err), "unexpected error: {err}");
    assert!(err.to_string().contains(needle), "{err:?} lacks {needle:?}");
    assert!(
        !case.out.exists(),
        "a refused import wrote {}",
        case.out.display()
    );
    assert_no_temp_dirs(&case.out);
}

#[test]
fn unknown_architectures_are_refused_naming_what_is_supported() {
    let base = TinyLlama::default().build().unwrap().writer;
    let w = rewrite(
        &base,
        |k, v| {
            Some(if k == "general.architecture" {
                MetaValue::String("phi3".into())
            } else {
                v.clone()
            })
        },
        keep_tensor,
    );
    let case = case_from_writer(&w);
    let err = import(&case).unwrap_err();
    assert!(
        matches!(err, ImportError::UnsupportedArchitecture { .. }),
        "{err}"
    );
    let msg = err.to_string();
    for needle in [
        "\"phi3\"",
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma3",
        "Not supported",
    ] {
        assert!(msg.contains(needle), "{needle} missing from: {msg}");
    }
    assert!(!case.out.exists());
}

#[test]
fn missing_unknown_and_misshapen_tensors_are_refused_by_name() {
    let base = TinyLlama::default().build().unwrap().writer;
    let w = rewrite(&base, keep_meta, |n, d, t, b| {
        (n != "blk.1.ffn_up.weight").then(|| (n.to_string(), d.to_vec(), t, b.to_vec()))
    });
    assert_refused(
        w,
        |e| matches!(e, ImportError::MissingTensor { .. }),
        "blk.1.ffn_up.weight",
    );

    let mut w = rewrite(&base, keep_meta, keep_tensor);
    w.add_tensor("blk.0.attn_q.bias", &[64], GgmlType::F32, &[0.5; 64])
        .unwrap();
    assert_refused(
        w,
        |e| matches!(e, ImportError::UnknownTensor { .. }),
        "blk.0.attn_q.bias",
    );

    // Metadata claiming 4 key/value heads: k_proj has half the rows.
    let w = rewrite(
        &base,
        |k, v| {
            Some(if k == "llama.attention.head_count_kv" {
                MetaValue::U32(4)
            } else {
                v.clone()
            })
        },
        keep_tensor,
    );
    assert_refused(
        w,
        |e| matches!(e, ImportError::ShapeMismatch { .. }),
        "blk.0.attn_k.weight",
    );
}

#[test]
fn unsupported_quantizations_are_refused_naming_tensor_and_type() {
    let base = TinyLlama::default().build().unwrap().writer;
    let w = rewrite(&base, keep_meta, |n, d, t, b| {
        if n == "blk.0.ffn_down.weight" {
            // Re-declare the tensor as IQ4_XS (an I-quant kiln does not
            // decode): ne0 96 is not a multiple of 256, so widen it to 256
            // columns of zeros.
            let dims = vec![256, d[1]];
            let bytes = vec![0u8; (d[1] as usize) * 136];
            Some((n.to_string(), dims, GgmlType::Iq4Xs, bytes))
        } else {
            Some((n.to_string(), d.to_vec(), t, b.to_vec()))
        }
    });
    assert_refused(
        w,
        |e| matches!(e, ImportError::Gguf(_)),
        "blk.0.ffn_down.weight",
    );
}

#[test]
fn k_quant_matrices_import_to_their_decoded_values() {
    // 256-wide rows so every K-quant block type fits.
    for ty in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q5_0, GgmlType::Q3K] {
        check_weights(&TinyLlama {
            hidden: 256,
            ffn: 256,
            heads: 4,
            kv_heads: 1,
            matrix_type: ty,
            embed_type: GgmlType::Q8_0,
            tied: false,
            ..TinyLlama::default()
        });
    }
}

#[test]
fn non_llama3_rope_freqs_and_unigram_vocabularies_are_refused() {
    let base = TinyLlama::default().build().unwrap().writer;
    let mut w = rewrite(&base, keep_meta, keep_tensor);
    // Alternating factors follow no llama3 schedule.
    let bogus: Vec<f32> = (0..8).map(|i| if i % 2 == 0 { 1.0 } else { 3.0 }).collect();
    w.add_tensor("rope_freqs.weight", &[8], GgmlType::F32, &bogus)
        .unwrap();
    assert_refused(
        w,
        |e| matches!(e, ImportError::UnsupportedFeature { .. }),
        "rope_freqs.weight that is not llama3",
    );

    let w = rewrite(
        &base,
        |k, v| {
            Some(if k == "tokenizer.ggml.model" {
                MetaValue::String("t5".into())
            } else {
                v.clone()
            })
        },
        keep_tensor,
    );
    assert_refused(
        w,
        |e| {
            matches!(
                e,
                ImportError::Tokenizer(TokenizerBuildError::UnsupportedModel { .. })
            )
        },
        "unigram",
    );

    let w = rewrite(
        &base,
        |k, v| {
            Some(if k == "tokenizer.ggml.pre" {
                MetaValue::String("chameleon".into())
            } else {
                v.clone()
            })
        },
        keep_tensor,
    );
    assert_refused(
        w,
        |e| {
            matches!(
                e,
                ImportError::Tokenizer(TokenizerBuildError::UnsupportedPre { .. })
            )
        },
        "smollm",
    );
}

#[test]
fn broken_tokenizer_metadata_is_refused() {
    let base = TinyLlama::default().build().unwrap().writer;
    // A merge naming a token that is not in the vocabulary.
    let w = rewrite(
        &base,
        |k, v| {
            if k == "tokenizer.ggml.merges" {
                let mut items = v.as_array().unwrap().to_vec();
                items.push(MetaValue::String("zz qq".into()));
                Some(MetaValue::Array {
                    elem: kiln_compiler::gguf::ValueType::String,
                    items,
                })
            } else {
                Some(v.clone())
            }
        },
        keep_tensor,
    );
    assert_refused(
        w,
        |e| matches!(e, ImportError::Tokenizer(TokenizerBuildError::Load { .. })),
        "does not load",
    );

    // A duplicated token.
    let w = rewrite(
        &base,
        |k, v| {
            if k == "tokenizer.ggml.tokens" {
                let mut items = v.as_array().unwrap().to_vec();
                items[5] = items[4].clone();
                Some(MetaValue::Array {
                    elem: kiln_compiler::gguf::ValueType::String,
                    items,
                })
            } else {
                Some(v.clone())
            }
        },
        keep_tensor,
    );
    assert_refused(
        w,
        |e| {
            matches!(
                e,
                ImportError::Tokenizer(TokenizerBuildError::DuplicateToken {
                    first: 4,
                    second: 5,
                    ..
                })
            )
        },
        "twice",
    );

    // An EOS id past the vocabulary.
    let w = rewrite(
        &base,
        |k, v| {
            Some(if k == "tokenizer.ggml.eos_token_id" {
                MetaValue::U32(100_000)
            } else {
                v.clone()
            })
        },
        keep_tensor,
    );
    assert_refused(
        w,
        |e| {
            matches!(
                e,
                ImportError::Tokenizer(TokenizerBuildError::BadTokenId { .. })
            )
        },
        "100000",
    );
}

#[test]
fn gguf_names_map_to_hugging_face_llama_names() {
    let cases = [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        (
            "blk.0.attn_q.weight",
            "model.layers.0.self_attn.q_proj.weight",
        ),
        (
            "blk.11.attn_k.weight",
            "model.layers.11.self_attn.k_proj.weight",
        ),
        (
            "blk.2.attn_v.weight",
            "model.layers.2.self_attn.v_proj.weight",
        ),
        (
            "blk.3.attn_output.weight",
            "model.layers.3.self_attn.o_proj.weight",
        ),
        (
            "blk.4.attn_norm.weight",
            "model.layers.4.input_layernorm.weight",
        ),
        (
            "blk.5.ffn_norm.weight",
            "model.layers.5.post_attention_layernorm.weight",
        ),
        (
            "blk.6.ffn_gate.weight",
            "model.layers.6.mlp.gate_proj.weight",
        ),
        ("blk.7.ffn_up.weight", "model.layers.7.mlp.up_proj.weight"),
        (
            "blk.29.ffn_down.weight",
            "model.layers.29.mlp.down_proj.weight",
        ),
    ];
    for (g, h) in cases {
        assert_eq!(hf_tensor_name(g).as_deref(), Some(h), "{g}");
    }
    for unknown in [
        "blk.x.attn_q.weight",
        "blk.0.attn_q.bias",
        "rope_freqs.weight",
        "blk.0",
        "output",
    ] {
        assert_eq!(hf_tensor_name(unknown), None, "{unknown}");
    }
}

fn import_arch(arch: &str, hidden: usize) -> (Case, Value, TinyLlama) {
    let spec = TinyLlama {
        arch: arch.to_string(),
        hidden,
        ..TinyLlama::default()
    };
    check_weights(&spec);
    let case = case_from_writer(&spec.build().unwrap().writer);
    import(&case).unwrap();
    let config = read_json(&case.out.join("config.json"));
    (case, config, spec)
}

#[test]
fn each_supported_architecture_imports_with_its_own_tensors_and_config() {
    use kiln_compiler::config::HfConfig;
    use kiln_compiler::frontend::registry::Family;
    for (arch, class, model_type) in [
        ("llama", "LlamaForCausalLM", "llama"),
        ("mistral", "MistralForCausalLM", "mistral"),
        ("qwen2", "Qwen2ForCausalLM", "qwen2"),
        ("qwen3", "Qwen3ForCausalLM", "qwen3"),
        ("gemma3", "Gemma3ForCausalLM", "gemma3_text"),
    ] {
        let (case, c, spec) = import_arch(arch, 64);
        assert_eq!(c["architectures"][0], class, "{arch}");
        assert_eq!(c["model_type"], model_type, "{arch}");
        assert_eq!(c["head_dim"], spec.head_dim(), "{arch}");
        let st_bytes = std::fs::read(case.out.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&st_bytes).unwrap();
        let has = |n: &str| st.names().contains(&n);
        assert_eq!(has("model.layers.0.self_attn.q_proj.bias"), arch == "qwen2");
        assert_eq!(
            has("model.layers.1.self_attn.k_norm.weight"),
            arch == "qwen3" || arch == "gemma3"
        );
        assert_eq!(
            has("model.layers.0.post_feedforward_layernorm.weight"),
            arch == "gemma3"
        );
        if arch == "gemma3" {
            assert_eq!(c["hidden_activation"], "gelu_pytorch_tanh");
            assert_eq!(c["query_pre_attn_scalar"], spec.head_dim());
            assert_eq!(c["sliding_window"], 64);
            assert_eq!(c["rope_local_base_freq"], 10000.0);
            assert_eq!(
                c["layer_types"],
                serde_json::json!(["sliding_attention", "sliding_attention"])
            );
            continue;
        }
        // The frontends accept every non-Gemma config as written.
        let text = std::fs::read_to_string(case.out.join("config.json")).unwrap();
        let hf = HfConfig::from_json(&text).unwrap();
        let family = Family::from_architecture(class).unwrap();
        let resolved = family.resolve(&hf).unwrap();
        assert_eq!(resolved.qkv_bias, arch == "qwen2", "{arch}");
        assert_eq!(resolved.qk_norm, arch == "qwen3", "{arch}");
    }
}

#[test]
fn only_llama_and_mistral_files_get_their_q_k_rows_unpermuted() {
    // check_weights compares against the Hugging Face order; the fixture
    // permutes only llama and mistral, as llama.cpp does. An importer that
    // unpermuted qwen/gemma rows too would fail here.
    for arch in ["qwen2", "qwen3", "gemma3"] {
        let spec = TinyLlama {
            arch: arch.to_string(),
            ..TinyLlama::default()
        };
        let built = spec.build().unwrap();
        let g = GgufFile::from_bytes(built.writer.to_bytes().unwrap()).unwrap();
        let stored = g.dequantize("blk.0.attn_q.weight").unwrap();
        let (_, want) = &built.expected["model.layers.0.self_attn.q_proj.weight"];
        assert_eq!(
            &stored, want,
            "{arch}: q rows are stored in Hugging Face order"
        );
        check_weights(&spec);
    }
}

#[test]
fn gemma3_norm_weights_lose_the_one_llama_cpp_added() {
    let spec = TinyLlama {
        arch: "gemma3".into(),
        ..TinyLlama::default()
    };
    let built = spec.build().unwrap();
    let g = GgufFile::from_bytes(built.writer.to_bytes().unwrap()).unwrap();
    let stored = g.dequantize("blk.0.post_ffw_norm.weight").unwrap();
    let case = case_from_writer(&built.writer);
    import(&case).unwrap();
    let bytes = std::fs::read(case.out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let got = bf16_values(
        st.tensor("model.layers.0.post_feedforward_layernorm.weight")
            .unwrap()
            .data(),
    );
    for (g, s) in got.iter().zip(&stored) {
        assert!((g - (s - 1.0)).abs() <= 2f32.powi(-8), "{g} vs {s} - 1");
    }
    // ffn_norm is the pre-feedforward norm in Gemma-3, not post-attention.
    assert_eq!(
        import::hf_tensor_name_for(import::GgufArch::Gemma3, "blk.3.ffn_norm.weight").as_deref(),
        Some("model.layers.3.pre_feedforward_layernorm.weight")
    );
    assert_eq!(
        import::hf_tensor_name_for(import::GgufArch::Gemma3, "blk.3.post_attention_norm.weight")
            .as_deref(),
        Some("model.layers.3.post_attention_layernorm.weight")
    );
}

#[test]
fn llama3_rope_freqs_become_the_rope_scaling_they_encode() {
    // Llama-3.1-8B's head: 128 dims, theta 500000, factor 8.
    let f = import::llama3_rope_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192);
    assert_eq!(f.len(), 64);
    assert_eq!(f[0], 1.0, "the fastest frequency is unscaled");
    assert_eq!(f[63], 8.0, "the slowest is divided by the factor");
    assert!(
        f.windows(2).all(|w| w[0] <= w[1]),
        "factors grow with wavelength"
    );
    assert!(f.iter().any(|x| *x > 1.0 && *x < 8.0), "a smooth band");

    // The fixture's head: 16 dims, theta 100000; factor 32 as Llama 3.2.
    let spec = TinyLlama::default();
    let factors: Vec<f32> = import::llama3_rope_factors(16, 100000.0, 32.0, 1.0, 4.0, 8192)
        .iter()
        .map(|&x| x as f32)
        .collect();
    let mut w = rewrite(&spec.build().unwrap().writer, keep_meta, keep_tensor);
    w.add_tensor("rope_freqs.weight", &[8], GgmlType::F32, &factors)
        .unwrap();
    let case = case_from_writer(&w);
    let report = import(&case).unwrap();
    assert_eq!(report.tensors_written, spec.build().unwrap().expected.len());
    let c = read_json(&case.out.join("config.json"));
    assert_eq!(
        c["rope_scaling"],
        serde_json::json!({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    );
    let hf = kiln_compiler::config::HfConfig::from_json(
        &std::fs::read_to_string(case.out.join("config.json")).unwrap(),
    )
    .unwrap();
    kiln_compiler::frontend::registry::Family::Llama
        .resolve(&hf)
        .unwrap();
}

#[test]
fn unsupported_rope_settings_are_refused_naming_what_is_supported() {
    let base = TinyLlama::default().build().unwrap().writer;
    // YaRN scaling.
    let mut w = rewrite(&base, keep_meta, keep_tensor);
    w.add_str("llama.rope.scaling.type", "yarn");
    assert_refused(
        w,
        |e| matches!(e, ImportError::UnsupportedFeature { .. }),
        "supported: linear, and llama3 through rope_freqs.weight",
    );
    // Linear scaling is carried into config.json.
    let mut w = rewrite(&base, keep_meta, keep_tensor);
    w.add_str("llama.rope.scaling.type", "linear")
        .add_f32("llama.rope.scaling.factor", 2.0);
    let case = case_from_writer(&w);
    import(&case).unwrap();
    let c = read_json(&case.out.join("config.json"));
    assert_eq!(
        c["rope_scaling"],
        serde_json::json!({"rope_type": "linear", "factor": 2.0})
    );
    // rope_freqs in an architecture llama.cpp never gives one.
    let qwen = TinyLlama {
        arch: "qwen3".into(),
        ..TinyLlama::default()
    };
    let mut w = rewrite(&qwen.build().unwrap().writer, keep_meta, keep_tensor);
    w.add_tensor("rope_freqs.weight", &[8], GgmlType::F32, &[1.0; 8])
        .unwrap();
    assert_refused(
        w,
        |e| matches!(e, ImportError::UnsupportedFeature { .. }),
        "rope_freqs.weight) in a qwen3 model",
    );
    // A Gemma-3 file without its sliding window.
    let gemma = TinyLlama {
        arch: "gemma3".into(),
        ..TinyLlama::default()
    };
    let w = rewrite(
        &gemma.build().unwrap().writer,
        |k, v| (k != "gemma3.attention.sliding_window").then(|| v.clone()),
        keep_tensor,
    );
    assert_refused(
        w,
        |e| matches!(e, ImportError::Gguf(_)),
        "gemma3.attention.sliding_window",
    );
}

/// Leaves in `parent` what an import killed mid-way leaves: a lock file no
/// process holds, naming `target`, and its half-written staging directory.
fn killed_import_leftovers(parent: &Path, id: &str, target: &str) -> (PathBuf, PathBuf) {
    use kiln_compiler::staging::{LOCK_SUFFIX, STAGING_PREFIX};
    std::fs::create_dir_all(parent).unwrap();
    let lock = parent.join(format!("{STAGING_PREFIX}{id}{LOCK_SUFFIX}"));
    std::fs::write(&lock, format!("target={target}\npid=4000000\n")).unwrap();
    let dir = parent.join(format!("{STAGING_PREFIX}{id}"));
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("model.safetensors"), vec![7u8; 1000]).unwrap();
    (lock, dir)
}

#[test]
fn a_killed_imports_staging_directory_is_removed_by_the_next_import_there() {
    let case = case_from_writer(&TinyLlama::default().build().unwrap().writer);
    let parent = case.out.parent().unwrap();
    let (lock, dir) = killed_import_leftovers(parent, "dead01", "tiny");
    let report = import(&case).unwrap();
    assert_eq!(report.stale.cleaned, vec![dir.clone()]);
    assert!(report.stale.left.is_empty(), "{:?}", report.stale.left);
    assert!(!dir.exists() && !lock.exists());
    assert!(case.out.join("model.safetensors").exists());
    assert_no_temp_dirs(&case.out);
}

#[test]
fn a_model_moved_aside_by_a_killed_import_is_moved_back_byte_for_byte() {
    use kiln_compiler::staging::OLD_SUFFIX;
    let case = case_from_writer(&TinyLlama::default().build().unwrap().writer);
    let parent = case.out.parent().unwrap();
    let (_, dir) = killed_import_leftovers(parent, "dead02", "tiny");
    // The import was killed between moving the old model aside and
    // renaming the new one into place: the destination is missing.
    let old = parent.join(format!(".kiln-import-dead02{OLD_SUFFIX}"));
    std::fs::create_dir(&old).unwrap();
    let weights: Vec<u8> = (0..4096u32).map(|i| (i * 31 % 251) as u8).collect();
    std::fs::write(old.join("model.safetensors"), &weights).unwrap();
    // Without --force the restored model is kept, and the error says so.
    let err = import(&case).unwrap_err();
    assert!(matches!(err, ImportError::OutputExists { .. }), "{err}");
    assert_eq!(
        std::fs::read(case.out.join("model.safetensors")).unwrap(),
        weights
    );
    assert!(!dir.exists() && !old.exists());
    assert_no_temp_dirs(&case.out);
}

#[test]
fn the_replaced_model_a_killed_import_left_after_installing_is_removed() {
    use kiln_compiler::staging::OLD_SUFFIX;
    let case = case_from_writer(&TinyLlama::default().build().unwrap().writer);
    import(&case).unwrap();
    let installed = std::fs::read(case.out.join("model.safetensors")).unwrap();
    let parent = case.out.parent().unwrap();
    let (_, dir) = killed_import_leftovers(parent, "dead03", "tiny");
    std::fs::remove_dir_all(&dir).unwrap();
    let old = parent.join(format!(".kiln-import-dead03{OLD_SUFFIX}"));
    std::fs::create_dir(&old).unwrap();
    std::fs::write(old.join("model.safetensors"), b"replaced").unwrap();
    let err = import(&case).unwrap_err();
    assert!(matches!(err, ImportError::OutputExists { .. }), "{err}");
    assert!(!old.exists());
    assert_eq!(
        std::fs::read(case.out.join("model.safetensors")).unwrap(),
        installed
    );
    assert_no_temp_dirs(&case.out);
}

#[test]
fn a_running_imports_staging_is_left_alone() {
    let case = case_from_writer(&TinyLlama::default().build().unwrap().writer);
    let parent = case.out.parent().unwrap();
    let (lock, dir) = killed_import_leftovers(parent, "live01", "other");
    // Another import holds its lock for as long as it runs.
    let held = std::fs::File::open(&lock).unwrap();
    held.lock().unwrap();
    let report = import(&case).unwrap();
    assert!(report.stale.cleaned.is_empty(), "{:?}", report.stale);
    assert!(dir.join("model.safetensors").exists() && lock.exists());
    drop(held);
    // Once that import is gone, the next import cleans up.
    let report = import::import_gguf(
        &case.gguf,
        &case.out,
        &ImportOptions {
            force: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(report.stale.cleaned, vec![dir]);
    assert_no_temp_dirs(&case.out);
}

#[test]
fn a_temp_directory_without_a_lock_file_is_reported_not_deleted() {
    let case = case_from_writer(&TinyLlama::default().build().unwrap().writer);
    let parent = case.out.parent().unwrap();
    std::fs::create_dir_all(parent).unwrap();
    let orphan = parent.join(".kiln-import-Ab12Cd");
    std::fs::create_dir(&orphan).unwrap();
    std::fs::write(orphan.join("config.json"), b"{}").unwrap();
    let report = import(&case).unwrap();
    assert_eq!(report.stale.left.len(), 1, "{:?}", report.stale);
    assert_eq!(report.stale.left[0].0, orphan);
    assert!(report.stale.left[0].1.contains("no lock file"));
    assert_eq!(std::fs::read(orphan.join("config.json")).unwrap(), b"{}");
}
