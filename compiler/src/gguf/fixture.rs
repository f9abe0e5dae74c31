//! Tiny random GGUF files for tests (llama, mistral, qwen2, qwen3, gemma3).
//!
//! Tests must not depend on downloaded weights, so this writes a complete,
//! valid llama GGUF of a few hundred kilobytes: random weights in the GGML
//! types the caller picks, q/k rows permuted exactly as llama.cpp's
//! converter does, and a real byte-level BPE vocabulary (the 256 byte
//! symbols, a few merges, ChatML control tokens and a chat template). It
//! also returns the weights the importer should recover, in Hugging Face
//! order, so a test can check names, shapes, the un-permutation and the
//! dequantization end to end. Types without a quantizer here (the
//! K-quants, Q5_0/Q5_1) are filled with random blocks. Also the bridge to
//! the `gguf` Python package for parity tests ([`python_dequantize`]).
//! Not a general model generator: the tokenizer is always byte-level BPE.

use super::dequant;
use super::error::GgufError;
use super::permute;
use super::types::GgmlType;
use super::writer::GgufWriter;
use std::collections::BTreeMap;

/// Shape and encoding of a tiny model.
#[derive(Clone, Debug)]
pub struct TinyLlama {
    pub hidden: usize,
    pub ffn: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub context: u32,
    /// Type of the projection matrices (q, k, v, o, gate, up, down).
    pub matrix_type: GgmlType,
    pub embed_type: GgmlType,
    pub norm_type: GgmlType,
    /// No `output.weight` (lm_head shares the embedding).
    pub tied: bool,
    /// `tokenizer.ggml.pre`.
    pub pre: String,
    pub seed: u64,
    /// `general.architecture`: `llama` (default), `mistral`, `qwen2`
    /// (adds q/k/v biases), `qwen3` (adds q/k norms) or `gemma3` (q/k
    /// norms, post-attention and post-feedforward norms, every norm stored
    /// as `w + 1` as llama.cpp's converter writes it). Only llama and
    /// mistral get llama.cpp's q/k row permutation.
    pub arch: String,
}

impl Default for TinyLlama {
    fn default() -> Self {
        TinyLlama {
            hidden: 64,
            ffn: 96,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            context: 512,
            matrix_type: GgmlType::Q4_1,
            embed_type: GgmlType::Q8_0,
            norm_type: GgmlType::F32,
            tied: true,
            pre: "smollm".to_string(),
            seed: 0x6b69_6c6e,
            arch: "llama".to_string(),
        }
    }
}

/// Control tokens of the fixture vocabulary, at ids 0, 1, 2.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// Merges of the fixture vocabulary, in priority order.
/// `1 2` tells the pre-tokenizers apart: SmolLM's splits digits first, so
/// it never applies.
pub const MERGES: [(&str, &str); 7] = [
    ("h", "e"),
    ("l", "l"),
    ("he", "ll"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġw", "or"),
    ("1", "2"),
];
/// The chat template stored in the fixture.
pub const CHAT_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}";

/// GPT-2's byte-to-symbol table: printable bytes stand for themselves, the
/// rest map to code points from U+0100 up, so every byte is one visible
/// character.
pub fn byte_level_alphabet() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut next = 256u32;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).expect("a byte is a char")
            } else {
                let c = char::from_u32(next).expect("U+0100.. are chars");
                next += 1;
                c
            }
        })
        .collect()
}

/// The fixture's vocabulary: specials, the 256 byte symbols, then one token
/// per merge.
pub fn vocabulary() -> Vec<String> {
    let mut v: Vec<String> = SPECIAL_TOKENS.iter().map(|s| s.to_string()).collect();
    v.extend(byte_level_alphabet().into_iter().map(String::from));
    v.extend(MERGES.iter().map(|(a, b)| format!("{a}{b}")));
    v
}

/// splitmix64: deterministic, dependency-free random numbers.
pub struct Rng(kiln_ir::rng::SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(kiln_ir::rng::SplitMix64::new(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
}

/// A per-tensor seed for random blocks, stable across runs.
fn rng_seed(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// A built fixture.
pub struct TinyLlamaFile {
    pub writer: GgufWriter,
    /// The weights `kiln import` should produce, by Hugging Face name, as
    /// f32 values in `[out, in]` row-major order: each random weight after
    /// its GGML encoding round trip, before any bf16 rounding.
    pub expected: BTreeMap<String, (Vec<u64>, Vec<f32>)>,
}

impl TinyLlama {
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// Writes the model into a [`GgufWriter`] (not yet to disk).
    pub fn build(&self) -> Result<TinyLlamaFile, GgufError> {
        let mut rng = Rng::new(self.seed);
        let vocab = vocabulary();
        let n_vocab = vocab.len();
        let hd = self.head_dim();
        let a = self.arch.as_str();
        let k = |s: &str| format!("{a}.{s}");
        let gemma = a == "gemma3";
        let permuted = matches!(a, "llama" | "mistral");
        let mut w = GgufWriter::new();
        w.add_str("general.architecture", a)
            .add_str("general.name", "kiln tiny fixture")
            .add_u32(&k("block_count"), self.layers as u32)
            .add_u32(&k("context_length"), self.context)
            .add_u32(&k("embedding_length"), self.hidden as u32)
            .add_u32(&k("feed_forward_length"), self.ffn as u32)
            .add_u32(&k("attention.head_count"), self.heads as u32)
            .add_u32(&k("attention.head_count_kv"), self.kv_heads as u32)
            .add_f32(&k("rope.freq_base"), 100000.0)
            .add_f32(&k("attention.layer_norm_rms_epsilon"), 1e-5)
            .add_u32(&k("rope.dimension_count"), hd as u32)
            .add_u32(&k("attention.key_length"), hd as u32)
            .add_u32(&k("vocab_size"), n_vocab as u32);
        if gemma {
            w.add_u32(&k("attention.sliding_window"), 64);
        }
        w.add_str("tokenizer.ggml.model", "gpt2")
            .add_str("tokenizer.ggml.pre", &self.pre)
            .add_str_array("tokenizer.ggml.tokens", &vocab)
            .add_i32_array(
                "tokenizer.ggml.token_type",
                &(0..n_vocab)
                    .map(|i| if i < SPECIAL_TOKENS.len() { 3 } else { 1 })
                    .collect::<Vec<_>>(),
            )
            .add_str_array(
                "tokenizer.ggml.merges",
                &MERGES
                    .iter()
                    .map(|(a, b)| format!("{a} {b}"))
                    .collect::<Vec<_>>(),
            )
            .add_u32("tokenizer.ggml.bos_token_id", 1)
            .add_u32("tokenizer.ggml.eos_token_id", 2)
            .add_u32("tokenizer.ggml.unknown_token_id", 0)
            .add_u32("tokenizer.ggml.padding_token_id", 2)
            .add_bool("tokenizer.ggml.add_bos_token", false)
            .add_str("tokenizer.chat_template", CHAT_TEMPLATE);

        let mut expected = BTreeMap::new();
        let mut tensor = |w: &mut GgufWriter,
                          gguf_name: &str,
                          hf_name: &str,
                          shape: Vec<u64>,
                          ty: GgmlType,
                          permute_heads: Option<usize>,
                          values: Vec<f32>|
         -> Result<(), GgufError> {
            let werr = |e: &dyn std::fmt::Display| GgufError::Write {
                reason: e.to_string(),
            };
            if !dequant::can_quantize(ty) {
                // No quantizer for this type: random blocks stand in for the
                // weights, in GGUF row order, and the expectation is their
                // decoding put back into Hugging Face order.
                let n = values.len();
                let blocks = n / ty.block_size() as usize;
                let bytes = dequant::random_blocks(ty, blocks, rng_seed(gguf_name));
                let stored = dequant::dequantize(ty, &bytes, n).map_err(|e| werr(&e))?;
                let hf = match permute_heads {
                    Some(h) => {
                        permute::unpermute_rows(&stored, shape[0] as usize, shape[1] as usize, h)
                            .map_err(|e| werr(&e))?
                    }
                    None => stored,
                };
                expected.insert(hf_name.to_string(), (shape.clone(), hf));
                let dims: Vec<u64> = shape.iter().rev().copied().collect();
                w.add_raw_tensor(gguf_name, &dims, ty, bytes)?;
                return Ok(());
            }
            // What survives the encoding, row by row (rows are independent
            // of the permutation, which only reorders them).
            let bytes = dequant::quantize(ty, &values).map_err(|e| werr(&e))?;
            let roundtrip =
                dequant::dequantize(ty, &bytes, values.len()).map_err(|e| GgufError::Write {
                    reason: e.to_string(),
                })?;
            expected.insert(hf_name.to_string(), (shape.clone(), roundtrip));
            let stored = match permute_heads {
                Some(h) => permute::permute_rows(&values, shape[0] as usize, shape[1] as usize, h)
                    .map_err(|e| GgufError::Write {
                        reason: e.to_string(),
                    })?,
                None => values,
            };
            w.add_tensor(gguf_name, &shape, ty, &stored)?;
            Ok(())
        };

        let (d, f) = (self.hidden as u64, self.ffn as u64);
        let (q, kv) = ((self.heads * hd) as u64, (self.kv_heads * hd) as u64);
        let embd = rng.vec(n_vocab * self.hidden, 0.5);
        tensor(
            &mut w,
            "token_embd.weight",
            "model.embed_tokens.weight",
            vec![n_vocab as u64, d],
            self.embed_type,
            None,
            embd,
        )?;
        for l in 0..self.layers {
            let g = |s: &str| format!("blk.{l}.{s}.weight");
            let h = |s: &str| format!("model.layers.{l}.{s}.weight");
            let mt = self.matrix_type;
            // Gemma stores 1 + w; the shift is taken off the expectation below.
            let base = if gemma { 2.0 } else { 1.0 };
            let norm = |rng: &mut Rng| (0..self.hidden).map(|_| base + 0.1 * rng.unit()).collect();
            let v = norm(&mut rng);
            tensor(
                &mut w,
                &g("attn_norm"),
                &h("input_layernorm"),
                vec![d],
                self.norm_type,
                None,
                v,
            )?;
            let v = rng.vec((q * d) as usize, 0.2);
            tensor(
                &mut w,
                &g("attn_q"),
                &h("self_attn.q_proj"),
                vec![q, d],
                mt,
                permuted.then_some(self.heads),
                v,
            )?;
            let v = rng.vec((kv * d) as usize, 0.2);
            tensor(
                &mut w,
                &g("attn_k"),
                &h("self_attn.k_proj"),
                vec![kv, d],
                mt,
                permuted.then_some(self.kv_heads),
                v,
            )?;
            let v = rng.vec((kv * d) as usize, 0.2);
            tensor(
                &mut w,
                &g("attn_v"),
                &h("self_attn.v_proj"),
                vec![kv, d],
                mt,
                None,
                v,
            )?;
            let v = rng.vec((d * q) as usize, 0.2);
            tensor(
                &mut w,
                &g("attn_output"),
                &h("self_attn.o_proj"),
                vec![d, q],
                mt,
                None,
                v,
            )?;
            let v = norm(&mut rng);
            tensor(
                &mut w,
                &g("ffn_norm"),
                &h(if gemma {
                    "pre_feedforward_layernorm"
                } else {
                    "post_attention_layernorm"
                }),
                vec![d],
                self.norm_type,
                None,
                v,
            )?;
            let v = rng.vec((f * d) as usize, 0.2);
            tensor(
                &mut w,
                &g("ffn_gate"),
                &h("mlp.gate_proj"),
                vec![f, d],
                mt,
                None,
                v,
            )?;
            let v = rng.vec((f * d) as usize, 0.2);
            tensor(
                &mut w,
                &g("ffn_up"),
                &h("mlp.up_proj"),
                vec![f, d],
                mt,
                None,
                v,
            )?;
            let v = rng.vec((d * f) as usize, 0.2);
            tensor(
                &mut w,
                &g("ffn_down"),
                &h("mlp.down_proj"),
                vec![d, f],
                mt,
                None,
                v,
            )?;
            if a == "qwen2" {
                for (gn, hn, rows) in [
                    ("attn_q", "q_proj", q),
                    ("attn_k", "k_proj", kv),
                    ("attn_v", "v_proj", kv),
                ] {
                    let v = rng.vec(rows as usize, 0.1);
                    tensor(
                        &mut w,
                        &format!("blk.{l}.{gn}.bias"),
                        &format!("model.layers.{l}.self_attn.{hn}.bias"),
                        vec![rows],
                        GgmlType::F32,
                        None,
                        v,
                    )?;
                }
            }
            if a == "qwen3" || gemma {
                for (gn, hn) in [
                    ("attn_q_norm", "self_attn.q_norm"),
                    ("attn_k_norm", "self_attn.k_norm"),
                ] {
                    let v = (0..hd).map(|_| base + 0.1 * rng.unit()).collect();
                    tensor(
                        &mut w,
                        &g(gn),
                        &h(hn),
                        vec![hd as u64],
                        self.norm_type,
                        None,
                        v,
                    )?;
                }
            }
            if gemma {
                for (gn, hn) in [
                    ("post_attention_norm", "post_attention_layernorm"),
                    ("post_ffw_norm", "post_feedforward_layernorm"),
                ] {
                    let v = norm(&mut rng);
                    tensor(&mut w, &g(gn), &h(hn), vec![d], self.norm_type, None, v)?;
                }
            }
        }
        let base = if gemma { 2.0 } else { 1.0 };
        let v = (0..self.hidden).map(|_| base + 0.1 * rng.unit()).collect();
        tensor(
            &mut w,
            "output_norm.weight",
            "model.norm.weight",
            vec![d],
            self.norm_type,
            None,
            v,
        )?;
        if !self.tied {
            let v = rng.vec(n_vocab * self.hidden, 0.5);
            tensor(
                &mut w,
                "output.weight",
                "lm_head.weight",
                vec![n_vocab as u64, d],
                self.matrix_type,
                None,
                v,
            )?;
        }
        if gemma {
            for (name, (_, values)) in expected.iter_mut() {
                if name.ends_with("norm.weight") {
                    values.iter_mut().for_each(|v| *v -= 1.0);
                }
            }
        }
        Ok(TinyLlamaFile {
            writer: w,
            expected,
        })
    }
}

/// Tensors of the GGUF at `path` dequantized by the `gguf` Python package
/// (llama.cpp's reference reader) through `scripts/gguf_dequant_parity.py`,
/// by name, in GGML element order; every tensor when `names` is empty.
/// `None` (the caller skips, saying so) when python3 or the package is
/// missing, unless `KILN_REQUIRE_GGUF_PY=1`, which makes that a panic.
/// A failing script is always a panic: it is a test helper.
pub fn python_dequantize(
    path: &std::path::Path,
    names: &[&str],
) -> Option<BTreeMap<String, Vec<f32>>> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("scripts")
        .join("gguf_dequant_parity.py");
    let python = std::env::var("KILN_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let out = tempfile::tempdir().expect("a temporary directory");
    let status = std::process::Command::new(&python)
        .arg(&script)
        .arg(path)
        .arg(out.path())
        .args(names)
        .status();
    let required = std::env::var("KILN_REQUIRE_GGUF_PY").as_deref() == Ok("1");
    match status {
        Ok(s) if s.success() => {}
        Ok(s) if s.code() == Some(3) => {
            assert!(
                !required,
                "KILN_REQUIRE_GGUF_PY=1 but the gguf Python package is missing (pip install gguf)"
            );
            eprintln!("SKIPPED: the gguf Python package is missing (pip install gguf)");
            return None;
        }
        Ok(s) => panic!("{} failed with {s}", script.display()),
        Err(e) => {
            assert!(
                !required,
                "KILN_REQUIRE_GGUF_PY=1 but {python} cannot run: {e}"
            );
            eprintln!("SKIPPED: {python} cannot run ({e}); the gguf parity check needs it");
            return None;
        }
    }
    let index: serde_json::Value = serde_json::from_slice(
        &std::fs::read(out.path().join("index.json")).expect("the script writes index.json"),
    )
    .expect("index.json is JSON");
    let mut tensors = BTreeMap::new();
    for name in index.as_object().expect("an object").keys() {
        let bytes = std::fs::read(out.path().join(format!("{name}.f32"))).expect("tensor file");
        let values = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        tensors.insert(name.clone(), values);
    }
    Some(tensors)
}
