//! The seed corpora under `fuzz/corpus/<target>/`, and the code that
//! regenerates them (`kiln-fuzz seed`), deterministically, from kiln's own
//! writers:
//!
//! - gguf: tiny llama GGUFs from the compiler's fixture
//!   (`kiln_compiler::gguf::fixture`) in a few tensor encodings, and a small
//!   hand-built file with every metadata value type and nested arrays;
//! - safetensors: small files from the tiny-model writer
//!   (`kiln_compiler::testing::safetensors_bytes`) and a header with
//!   `__metadata__` and an empty tensor;
//! - config: the config.json of the tiny model of each family, plus the
//!   Llama 3.1 (rope scaling) and SmolLM2 shapes;
//! - plan: plan files compiled from a tiny one-layer model (decode keys,
//!   and a speculative key);
//! - ir: the IR golden file and the printed decode-step graphs of the tiny
//!   model of each family.
//!
//! Seeds are small on purpose: the mutator edits bytes at random offsets,
//! and every byte of tensor data is a byte not spent on headers.
//!
//! Not here: inputs found by fuzzing (crashes go to `fuzz/crashes/`, and a
//! fixed one becomes a regression test next to the parser it broke).

use crate::targets::Target;
use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::frontend::{self, Family, TraceOptions};
use kiln_compiler::gguf::fixture::{self, TinyLlama};
use kiln_compiler::gguf::{GgmlType, GgufWriter, MetaValue, ValueType};
use kiln_compiler::passes::megakernel::{MegakernelOptions, ScheduleKind};
use kiln_compiler::testing::{safetensors_bytes, write_tiny_model, TinySpec};
use kiln_ir::{DType, Key};
use std::collections::BTreeMap;
use std::path::Path;

/// Why the corpus could not be built, written or read.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {message}")]
pub struct SeedError {
    pub what: String,
    pub message: String,
}

fn err(what: impl Into<String>) -> impl FnOnce(String) -> SeedError {
    let what = what.into();
    move |message| SeedError { what, message }
}

/// Seeds by target: `(file name, bytes)`, in file-name order.
pub type Corpus = BTreeMap<Target, Vec<(String, Vec<u8>)>>;

/// Builds every target's seeds in memory. The same build of kiln always
/// produces the same bytes.
pub fn generate() -> Result<Corpus, SeedError> {
    let mut c = Corpus::new();
    c.insert(Target::Gguf, gguf()?);
    c.insert(Target::Safetensors, safetensors());
    let models = tempfile::tempdir().map_err(|e| err("a temporary directory")(e.to_string()))?;
    c.insert(Target::Config, config(models.path())?);
    c.insert(Target::Plan, plan(models.path())?);
    c.insert(Target::Ir, ir(models.path())?);
    c.insert(Target::Http, http());
    Ok(c)
}

/// Request bodies for both endpoints, minimal and with every field set
/// (every seed is accepted; mutation finds the refusals).
fn http() -> Vec<(String, Vec<u8>)> {
    let bodies = [
        ("completion-minimal", r#"{"prompt": "hello"}"#),
        (
            "completion-tokens",
            r#"{"prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 2}"#,
        ),
        (
            "completion-all",
            r#"{"model": "m", "prompt": ["hi"], "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 42, "stop": ["\n", "END"], "presence_penalty": 0.5, "frequency_penalty": -0.5, "stream": true, "stream_options": {"include_usage": true}, "n": 1}"#,
        ),
        (
            "chat-minimal",
            r#"{"messages": [{"role": "user", "content": "hi"}]}"#,
        ),
        (
            "chat-all",
            r#"{"messages": [{"role": "system", "content": "be brief"}, {"role": "developer", "content": null}, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, {"role": "assistant", "content": "ok"}], "max_completion_tokens": 8, "logprobs": true, "top_logprobs": 3, "stop": "x", "stream": false}"#,
        ),
    ];
    bodies
        .iter()
        .enumerate()
        .map(|(i, (name, b))| (format!("{:02}-{name}.json", i + 1), b.as_bytes().to_vec()))
        .collect()
}

/// The tiny model every model-directory seed starts from: one layer, so a
/// plan and a printed graph stay a few kilobytes.
fn tiny(family: Family) -> TinySpec {
    TinySpec {
        layers: 1,
        hidden: 32,
        heads: 2,
        kv_heads: 1,
        head_dim: matches!(family, Family::Qwen3 | Family::Gemma3).then_some(32),
        intermediate: 32,
        vocab: 64,
        max_position: 64,
        sliding_window: matches!(family, Family::Mistral | Family::Gemma3).then_some(8),
        ..TinySpec::for_family(family)
    }
}

fn gguf() -> Result<Vec<(String, Vec<u8>)>, SeedError> {
    let mut out = Vec::new();
    for (name, matrix, embed) in [
        (
            "01-tiny-llama-q4_1-q8_0.gguf",
            GgmlType::Q4_1,
            GgmlType::Q8_0,
        ),
        ("02-tiny-llama-f16-q4_0.gguf", GgmlType::F16, GgmlType::Q4_0),
    ] {
        let f = TinyLlama {
            hidden: 32,
            ffn: 32,
            layers: 1,
            heads: 2,
            kv_heads: 1,
            context: 64,
            matrix_type: matrix,
            embed_type: embed,
            ..TinyLlama::default()
        }
        .build()
        .map_err(|e| err(name)(e.to_string()))?;
        let bytes = f.writer.to_bytes().map_err(|e| err(name)(e.to_string()))?;
        out.push((name.to_string(), bytes));
    }

    let name = "03-every-value-type.gguf";
    let vocab = fixture::vocabulary();
    let types: Vec<i32> = (0..vocab.len())
        .map(|i| {
            if i < fixture::SPECIAL_TOKENS.len() {
                3
            } else {
                1
            }
        })
        .collect();
    let merges: Vec<String> = fixture::MERGES
        .iter()
        .map(|(a, b)| format!("{a} {b}"))
        .collect();
    let mut w = GgufWriter::new();
    w.add_str("general.architecture", "llama")
        .add_meta("general.alignment", MetaValue::U32(64))
        .add_meta("t.u8", MetaValue::U8(7))
        .add_meta("t.i8", MetaValue::I8(-7))
        .add_meta("t.u16", MetaValue::U16(700))
        .add_meta("t.i16", MetaValue::I16(-700))
        .add_u32("llama.block_count", 1)
        .add_meta("t.i32", MetaValue::I32(-70000))
        .add_f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .add_bool("tokenizer.ggml.add_bos_token", true)
        .add_meta("t.u64", MetaValue::U64(1 << 40))
        .add_meta("t.i64", MetaValue::I64(-(1 << 40)))
        .add_meta("llama.rope.freq_base", MetaValue::F64(10000.0))
        .add_str_array("tokenizer.ggml.tokens", &vocab)
        .add_i32_array("tokenizer.ggml.token_type", &types)
        .add_str_array("tokenizer.ggml.merges", &merges)
        .add_u32("tokenizer.ggml.eos_token_id", 2)
        .add_str("tokenizer.ggml.model", "gpt2")
        .add_meta(
            "t.nested",
            MetaValue::Array {
                elem: ValueType::Array,
                items: vec![
                    MetaValue::Array {
                        elem: ValueType::U8,
                        items: vec![MetaValue::U8(1), MetaValue::U8(2)],
                    },
                    MetaValue::Array {
                        elem: ValueType::U8,
                        items: vec![],
                    },
                ],
            },
        );
    let tensors: [(&str, &[u64], GgmlType); 4] = [
        ("output_norm.weight", &[4], GgmlType::F32),
        ("blk.0.attn_q.weight", &[4, 32], GgmlType::Q8_0),
        ("blk.0.attn_k.weight", &[2, 32], GgmlType::Q4_1),
        ("token_embd.weight", &[3, 4], GgmlType::F16),
    ];
    for (t, shape, ty) in tensors {
        let n: u64 = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        w.add_tensor(t, shape, ty, &values)
            .map_err(|e| err(name)(e.to_string()))?;
    }
    let bytes = w.to_bytes().map_err(|e| err(name)(e.to_string()))?;
    out.push((name.to_string(), bytes));
    Ok(out)
}

fn safetensors() -> Vec<(String, Vec<u8>)> {
    let bf16 = |n: usize| (0..n * 2).map(|i| (i * 7) as u8).collect::<Vec<u8>>();
    let a = safetensors_bytes(&[
        (
            "model.embed_tokens.weight".into(),
            DType::BF16,
            vec![8, 4],
            bf16(32),
        ),
        ("model.norm.weight".into(), DType::F32, vec![4], vec![0; 16]),
        ("lm_head.weight".into(), DType::F16, vec![2, 4], bf16(8)),
    ]);
    let json = r#"{"__metadata__":{"format":"pt","source":"kiln"},"empty":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]},"scalar":{"dtype":"I64","shape":[],"data_offsets":[0,8]},"m":{"dtype":"BF16","shape":[2,2],"data_offsets":[8,16]}}"#;
    let mut b = (json.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(json.as_bytes());
    b.extend((0..16u8).map(|i| i.wrapping_mul(31)));
    vec![
        ("01-three-tensors.safetensors".into(), a),
        ("02-metadata-empty-scalar.safetensors".into(), b),
    ]
}

fn write_model(
    root: &Path,
    name: &str,
    family: Family,
    spec: &TinySpec,
) -> Result<std::path::PathBuf, SeedError> {
    let dir = root.join(name);
    write_tiny_model(&dir, family, spec)
        .map_err(|e| err(format!("tiny model {name}"))(e.to_string()))?;
    Ok(dir)
}

fn config(root: &Path) -> Result<Vec<(String, Vec<u8>)>, SeedError> {
    let mut models: Vec<(String, Family, TinySpec)> = Family::ALL
        .iter()
        .map(|&f| (f.model_type().to_string(), f, tiny(f)))
        .collect();
    models.push((
        "llama3-rope-scaling".into(),
        Family::Llama,
        TinySpec::llama3(),
    ));
    models.push(("smollm2".into(), Family::Llama, TinySpec::smollm2()));
    let mut out = Vec::new();
    for (i, (name, family, spec)) in models.iter().enumerate() {
        let dir = write_model(root, &format!("config-{name}"), *family, spec)?;
        let path = dir.join("config.json");
        let bytes =
            std::fs::read(&path).map_err(|e| err(path.display().to_string())(e.to_string()))?;
        out.push((format!("{:02}-{name}.json", i + 1), bytes));
    }
    Ok(out)
}

fn plan(root: &Path) -> Result<Vec<(String, Vec<u8>)>, SeedError> {
    let dir = write_model(root, "plan-llama", Family::Llama, &tiny(Family::Llama))?;
    let mut out = Vec::new();
    for (name, keys, schedule) in [
        (
            "01-decode-b1.kiln",
            vec![Key::new(1, 1, 0)],
            ScheduleKind::Graph,
        ),
        (
            "02-decode-and-spec.kiln",
            vec![Key::new(1, 1, 0), Key::new(2, 2, 1)],
            ScheduleKind::Graph,
        ),
        // A megakernel tape, so mutations reach the tape verifier.
        (
            "03-megakernel-b1.kiln",
            vec![Key::new(1, 1, 0)],
            ScheduleKind::Megakernel,
        ),
    ] {
        let opts = CompileOptions {
            keys,
            schedule,
            megakernel: MegakernelOptions {
                sm_count: 2,
                blocks_per_sm: 2,
                min_tile: 16,
                counters: Default::default(),
            },
            kv: KvOptions {
                block_size: 16,
                kv_blocks: Some(4),
                max_tokens: None,
                max_context: Some(64),
            },
            ..CompileOptions::default()
        };
        let compiled =
            compile_dir(&dir, &opts, &mut |_, _| {}).map_err(|e| err(name)(e.to_string()))?;
        out.push((name.to_string(), kiln_ir::artifact::encode(&compiled.plan)));
    }
    Ok(out)
}

/// The IR golden file, embedded so the corpus does not depend on the
/// working directory.
const GOLDEN_KIR: &str = include_str!("../../ir/golden/decode_step.kir");

fn ir(root: &Path) -> Result<Vec<(String, Vec<u8>)>, SeedError> {
    let mut out = vec![(
        "01-golden-decode-step.kir".to_string(),
        GOLDEN_KIR.as_bytes().to_vec(),
    )];
    for (i, &family) in Family::ALL.iter().enumerate() {
        let name = format!("{:02}-{}-trace.kir", i + 2, family.model_type());
        let dir = write_model(
            root,
            &format!("ir-{}", family.model_type()),
            family,
            &tiny(family),
        )?;
        let model = frontend::open(&dir).map_err(|e| err(name.clone())(e.to_string()))?;
        let kv = model.kv_layout(16, 4);
        let key = if family == Family::Qwen3 {
            Key::new(2, 2, 1)
        } else {
            Key::new(1, 1, 0)
        };
        let g = model
            .trace(
                key,
                &kv,
                &TraceOptions {
                    logits: family == Family::Qwen2,
                    ..TraceOptions::default()
                },
            )
            .map_err(|e| err(name.clone())(e.to_string()))?;
        out.push((name, kiln_ir::print(&g).into_bytes()));
    }
    Ok(out)
}

/// Writes the corpus under `dir/<target>/`, replacing what is there.
pub fn write(dir: &Path, corpus: &Corpus) -> Result<usize, SeedError> {
    let mut n = 0;
    for (target, seeds) in corpus {
        let tdir = dir.join(target.name());
        let io = |e: std::io::Error| err(tdir.display().to_string())(e.to_string());
        if tdir.exists() {
            for entry in std::fs::read_dir(&tdir).map_err(io)? {
                let p = entry.map_err(io)?.path();
                if p.is_file() {
                    std::fs::remove_file(&p).map_err(io)?;
                }
            }
        }
        std::fs::create_dir_all(&tdir).map_err(io)?;
        for (name, bytes) in seeds {
            std::fs::write(tdir.join(name), bytes).map_err(io)?;
            n += 1;
        }
    }
    Ok(n)
}

/// Reads `dir/<target>/`'s files in name order.
pub fn load(dir: &Path, target: Target) -> Result<Vec<(String, Vec<u8>)>, SeedError> {
    let tdir = dir.join(target.name());
    let io = |e: std::io::Error| {
        err(tdir.display().to_string())(format!(
            "{e}; regenerate the corpus with `cargo run -p kiln-fuzz -- seed`"
        ))
    };
    let mut names: Vec<_> = std::fs::read_dir(&tdir)
        .map_err(io)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    names.sort();
    let mut out = Vec::new();
    for p in names {
        let bytes = std::fs::read(&p).map_err(io)?;
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        out.push((name, bytes));
    }
    if out.is_empty() {
        return Err(io(std::io::Error::other("no seed files")));
    }
    Ok(out)
}

/// The corpus directory of this checkout (`fuzz/corpus`).
pub fn default_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus")
}
