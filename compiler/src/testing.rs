//! Tiny random models in Hugging Face layout, for tests in every crate.
//!
//! Model weights never go into git, so tests write their own: a `config.json`
//! and `model.safetensors` (or two shards and an index) with deterministic
//! pseudo-random weights from a seed. The weights are not zeros and not
//! constant: matrices are normal with standard deviation `1/sqrt(fan_in)` (so
//! activations stay near unit scale through the layers and logits have
//! clear top-1 margins rather than ties), norm weights are `1 + N(0, 0.1)`
//! (so a norm that ignores its weight changes the result), biases
//! `N(0, 0.1)`.
//!
//! Tensor names and the config are written out by hand, independently of the
//! frontend's own naming, so a naming mistake in either shows up as a test
//! failure rather than agreeing with itself.
//!
//! [`write_byte_tokenizer`] adds the simplest real tokenizer (bytes as
//! tokens) for tests that go through text.
//!
//! Not here: real tokenizers and checkpoints, reading tensor data back (that
//! is the runtime's weight binder).

pub use crate::frontend::Family;
use kiln_ir::{DType, RopeScaling};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::io;
use std::path::Path;

/// splitmix64: a tiny, seedable, platform-independent PRNG.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    /// Uniform integer in `[0, n)` (n > 0).
    pub fn below(&mut self, n: u32) -> u32 {
        (self.uniform() * n as f64) as u32
    }
}

/// Sizes and options of a tiny model. [`TinySpec::default`] is a 2-layer
/// Llama-shaped model: hidden 64, 4 heads, 2 kv heads, vocab 256,
/// intermediate 128, BF16, one file.
#[derive(Clone, Debug, PartialEq)]
pub struct TinySpec {
    pub layers: u32,
    pub hidden: u32,
    pub heads: u32,
    pub kv_heads: u32,
    /// Written as `head_dim` when set; otherwise `hidden / heads` is implied.
    pub head_dim: Option<u32>,
    pub intermediate: u32,
    pub vocab: u32,
    pub max_position: u32,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// Written as `rope_scaling` unless `None`.
    pub rope_scaling: RopeScaling,
    /// Tied: no `lm_head.weight`, `tie_word_embeddings: true`.
    pub tie_embeddings: bool,
    /// Mistral: `sliding_window` (written as null when `None`). Qwen2/3:
    /// `use_sliding_window: true` with this window from layer
    /// `max_window_layers` on. Ignored for Llama.
    pub sliding_window: Option<u32>,
    pub max_window_layers: u32,
    pub bos_token_id: u32,
    /// Written as an integer when there is one, a list otherwise.
    pub eos_token_ids: Vec<u32>,
    /// Stored dtype of every tensor: BF16, F16 or F32.
    pub dtype: DType,
    /// 1: `model.safetensors`; n > 1: n shards and `model.safetensors.index.json`.
    pub shards: u32,
    pub seed: u64,
}

impl Default for TinySpec {
    fn default() -> TinySpec {
        TinySpec {
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: None,
            intermediate: 128,
            vocab: 256,
            max_position: 512,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::None,
            tie_embeddings: false,
            sliding_window: None,
            max_window_layers: 0,
            bos_token_id: 1,
            eos_token_ids: vec![2],
            dtype: DType::BF16,
            shards: 1,
            seed: 0x6b69_6c6e,
        }
    }
}

impl TinySpec {
    /// The family's characteristic tiny model: Llama untied; Mistral with a
    /// sliding window of 8; Qwen2 tied (biases are implied by the family);
    /// Qwen3 tied with head_dim 32 (not hidden/heads = 16); Gemma-3 tied,
    /// head_dim 32, 3 layers (local, global, local) with a window of 8 (so
    /// it matters within a test's context).
    pub fn for_family(family: Family) -> TinySpec {
        let d = TinySpec::default();
        match family {
            Family::Llama => d,
            Family::Mistral => TinySpec {
                sliding_window: Some(8),
                ..d
            },
            Family::Qwen2 => TinySpec {
                tie_embeddings: true,
                ..d
            },
            Family::Qwen3 => TinySpec {
                head_dim: Some(32),
                tie_embeddings: true,
                ..d
            },
            Family::Gemma3 => TinySpec {
                layers: 3,
                head_dim: Some(32),
                tie_embeddings: true,
                sliding_window: Some(8),
                rms_norm_eps: 1e-6,
                rope_theta: 1_000_000.0,
                ..d
            },
        }
    }

    /// Llama 3.1-style: theta 500000 and llama3 rope scaling whose original
    /// context (64) is short enough that the scaling changes tiny head dims.
    pub fn llama3() -> TinySpec {
        TinySpec {
            rope_theta: 500000.0,
            rope_scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 64,
            },
            eos_token_ids: vec![2, 3],
            ..TinySpec::default()
        }
    }

    /// SmolLM2-shaped (a Llama): 9 heads over 3 kv heads, tied embeddings,
    /// theta 100000.
    pub fn smollm2() -> TinySpec {
        TinySpec {
            hidden: 72,
            heads: 9,
            kv_heads: 3,
            intermediate: 192,
            rope_theta: 100000.0,
            tie_embeddings: true,
            ..TinySpec::default()
        }
    }

    /// The head dimension the model uses.
    pub fn head_dim(&self) -> u32 {
        self.head_dim.unwrap_or(self.hidden / self.heads.max(1))
    }
}

enum Init {
    /// `N(0, std^2)`.
    Normal(f64),
    /// `1 + N(0, 0.1^2)`.
    NormWeight,
}

/// Gemma-3's local (sliding) layers of a tiny model: every second layer
/// (1, 3, ...) is global, so two layers already hold both kinds.
pub fn gemma3_layer_is_sliding(layer: u32) -> bool {
    !(layer + 1).is_multiple_of(2)
}

/// Gemma-3's `query_pre_attn_scalar` in a tiny model: `hidden / heads`
/// (as Gemma-3-27B), so it differs from `head_dim` and a scale that
/// ignores it shows.
pub fn gemma3_query_pre_attn_scalar(spec: &TinySpec) -> u32 {
    spec.hidden / spec.heads.max(1)
}

/// Gemma-3's `final_logit_softcapping` in a tiny model.
pub const GEMMA3_TINY_FINAL_SOFTCAP: f32 = 30.0;

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

fn check(spec: &TinySpec) -> io::Result<()> {
    let positive = [
        ("layers", spec.layers),
        ("hidden", spec.hidden),
        ("heads", spec.heads),
        ("kv_heads", spec.kv_heads),
        ("intermediate", spec.intermediate),
        ("vocab", spec.vocab),
        ("shards", spec.shards),
        ("max_position", spec.max_position),
    ];
    for (what, v) in positive {
        if v == 0 {
            return Err(invalid(format!("TinySpec.{what} must be at least 1")));
        }
    }
    if spec.head_dim.is_none() && !spec.hidden.is_multiple_of(spec.heads) {
        return Err(invalid(format!(
            "TinySpec: hidden {} is not divisible by heads {}; set head_dim",
            spec.hidden, spec.heads
        )));
    }
    if !spec.dtype.is_float() {
        return Err(invalid(format!(
            "TinySpec.dtype must be a float type, got {}",
            spec.dtype
        )));
    }
    Ok(())
}

fn tensors(family: Family, spec: &TinySpec) -> Vec<(String, Vec<u32>, Init)> {
    let (h, i, v) = (spec.hidden, spec.intermediate, spec.vocab);
    let hd = spec.head_dim();
    let (q, kv) = (spec.heads * hd, spec.kv_heads * hd);
    let lin = |fan_in: u32| Init::Normal(1.0 / (fan_in as f64).sqrt());
    let gemma = family == Family::Gemma3;
    // Gemma's norms scale by 1 + w: its weights are centred on 0.
    let norm_init = || {
        if gemma {
            Init::Normal(0.1)
        } else {
            Init::NormWeight
        }
    };
    let mut t = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![v, h],
        Init::Normal(1.0),
    )];
    for l in 0..spec.layers {
        let p = format!("model.layers.{l}");
        t.push((format!("{p}.input_layernorm.weight"), vec![h], norm_init()));
        t.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            norm_init(),
        ));
        if gemma {
            for n in ["pre_feedforward_layernorm", "post_feedforward_layernorm"] {
                t.push((format!("{p}.{n}.weight"), vec![h], norm_init()));
            }
        }
        t.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h], lin(h)));
        t.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h], lin(h)));
        t.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h], lin(h)));
        t.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q], lin(q)));
        if family == Family::Qwen2 {
            t.push((
                format!("{p}.self_attn.q_proj.bias"),
                vec![q],
                Init::Normal(0.1),
            ));
            t.push((
                format!("{p}.self_attn.k_proj.bias"),
                vec![kv],
                Init::Normal(0.1),
            ));
            t.push((
                format!("{p}.self_attn.v_proj.bias"),
                vec![kv],
                Init::Normal(0.1),
            ));
        }
        if family == Family::Qwen3 || gemma {
            t.push((
                format!("{p}.self_attn.q_norm.weight"),
                vec![hd],
                norm_init(),
            ));
            t.push((
                format!("{p}.self_attn.k_norm.weight"),
                vec![hd],
                norm_init(),
            ));
        }
        t.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h], lin(h)));
        t.push((format!("{p}.mlp.up_proj.weight"), vec![i, h], lin(h)));
        t.push((format!("{p}.mlp.down_proj.weight"), vec![h, i], lin(i)));
    }
    t.push(("model.norm.weight".to_string(), vec![h], norm_init()));
    if !spec.tie_embeddings {
        t.push(("lm_head.weight".to_string(), vec![v, h], lin(h)));
    }
    t
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn values(name: &str, n: usize, init: &Init, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed ^ fnv1a(name));
    (0..n)
        .map(|_| match init {
            Init::Normal(std) => (rng.normal() * std) as f32,
            Init::NormWeight => (1.0 + 0.1 * rng.normal()) as f32,
        })
        .collect()
}

fn encode(vals: &[f32], dtype: DType) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() * dtype.size());
    for &x in vals {
        match dtype {
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f32(x).to_le_bytes()),
            _ => out.extend_from_slice(&x.to_le_bytes()),
        }
    }
    out
}

fn st_dtype(d: DType) -> &'static str {
    match d {
        DType::BF16 => "BF16",
        DType::F16 => "F16",
        DType::F32 => "F32",
        DType::I32 => "I32",
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory.
fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Serializes tensors (already encoded) as one safetensors file.
pub fn safetensors_bytes(tensors: &[(String, DType, Vec<u32>, Vec<u8>)]) -> Vec<u8> {
    let mut sorted: Vec<&(String, DType, Vec<u32>, Vec<u8>)> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for (name, dtype, shape, data) in &sorted {
        header.insert(
            name.clone(),
            json!({"dtype": st_dtype(*dtype), "shape": shape, "data_offsets": [offset, offset + data.len()]}),
        );
        offset += data.len();
    }
    let mut json = Value::Object(header).to_string().into_bytes();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len() + offset);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    for (_, _, _, data) in &sorted {
        out.extend_from_slice(data);
    }
    out
}

/// The f64 with the f32's shortest decimal spelling, so `1e-5f32` is written
/// `1e-5`, not `9.999999747378752e-6`.
fn decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

fn config_json(family: Family, spec: &TinySpec) -> Value {
    let mut c = Map::new();
    c.insert("architectures".into(), json!([family.architecture()]));
    c.insert("model_type".into(), json!(family.model_type()));
    c.insert("vocab_size".into(), json!(spec.vocab));
    c.insert("hidden_size".into(), json!(spec.hidden));
    c.insert("intermediate_size".into(), json!(spec.intermediate));
    c.insert("num_hidden_layers".into(), json!(spec.layers));
    c.insert("num_attention_heads".into(), json!(spec.heads));
    c.insert("num_key_value_heads".into(), json!(spec.kv_heads));
    if let Some(hd) = spec.head_dim {
        c.insert("head_dim".into(), json!(hd));
    }
    c.insert("hidden_act".into(), json!("silu"));
    c.insert("max_position_embeddings".into(), json!(spec.max_position));
    c.insert("rms_norm_eps".into(), json!(decimal(spec.rms_norm_eps)));
    c.insert("rope_theta".into(), json!(decimal(spec.rope_theta)));
    match spec.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => {
            c.insert(
                "rope_scaling".into(),
                json!({"type": "linear", "factor": decimal(factor)}),
            );
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => {
            c.insert(
                "rope_scaling".into(),
                json!({"rope_type": "llama3", "factor": decimal(factor),
                    "low_freq_factor": decimal(low_freq_factor), "high_freq_factor": decimal(high_freq_factor),
                    "original_max_position_embeddings": original_max_position}),
            );
        }
    }
    c.insert("tie_word_embeddings".into(), json!(spec.tie_embeddings));
    c.insert("bos_token_id".into(), json!(spec.bos_token_id));
    let eos = match spec.eos_token_ids.as_slice() {
        [one] => json!(one),
        many => json!(many),
    };
    c.insert("eos_token_id".into(), eos);
    let torch_dtype = match spec.dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    };
    c.insert("torch_dtype".into(), json!(torch_dtype));
    match family {
        Family::Llama => {
            c.insert("attention_bias".into(), json!(false));
            c.insert("mlp_bias".into(), json!(false));
        }
        Family::Mistral => {
            c.insert("sliding_window".into(), json!(spec.sliding_window));
        }
        Family::Qwen2 | Family::Qwen3 => {
            c.insert(
                "use_sliding_window".into(),
                json!(spec.sliding_window.is_some()),
            );
            c.insert("sliding_window".into(), json!(spec.sliding_window));
            c.insert("max_window_layers".into(), json!(spec.max_window_layers));
            if family == Family::Qwen3 {
                c.insert("attention_bias".into(), json!(false));
            }
        }
        Family::Gemma3 => {
            c.insert("hidden_act".into(), json!("gelu_pytorch_tanh"));
            c.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
            c.insert("attention_bias".into(), json!(false));
            c.insert("sliding_window".into(), json!(spec.sliding_window));
            let types: Vec<&str> = (0..spec.layers)
                .map(|l| {
                    if gemma3_layer_is_sliding(l) {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect();
            c.insert("layer_types".into(), json!(types));
            c.insert("rope_local_base_freq".into(), json!(10000.0));
            c.insert(
                "query_pre_attn_scalar".into(),
                json!(gemma3_query_pre_attn_scalar(spec)),
            );
            c.insert(
                "final_logit_softcapping".into(),
                json!(decimal(GEMMA3_TINY_FINAL_SOFTCAP)),
            );
            c.insert("attn_logit_softcapping".into(), json!(null));
        }
    }
    Value::Object(c)
}

/// Writes a tiny random model of `family` into `dir` (created if needed):
/// `config.json` and `model.safetensors`, or `spec.shards` shards named
/// `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`.
/// The same spec always writes the same bytes.
pub fn write_tiny_model(dir: &Path, family: Family, spec: &TinySpec) -> io::Result<()> {
    check(spec)?;
    std::fs::create_dir_all(dir)?;
    let config =
        serde_json::to_string_pretty(&config_json(family, spec)).map_err(io::Error::other)?;
    write_atomic(&dir.join("config.json"), config.as_bytes())?;

    let encoded: Vec<(String, DType, Vec<u32>, Vec<u8>)> = tensors(family, spec)
        .into_iter()
        .map(|(name, shape, init)| {
            let n: usize = shape.iter().map(|&d| d as usize).product();
            let data = encode(&values(&name, n, &init, spec.seed), spec.dtype);
            (name, spec.dtype, shape, data)
        })
        .collect();
    if spec.shards == 1 {
        return write_atomic(&dir.join("model.safetensors"), &safetensors_bytes(&encoded));
    }
    let n = spec.shards as usize;
    let per = encoded.len().div_ceil(n);
    let mut weight_map = BTreeMap::new();
    let total: usize = encoded.iter().map(|t| t.3.len()).sum();
    for (i, chunk) in encoded.chunks(per.max(1)).enumerate() {
        let name = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        for t in chunk {
            weight_map.insert(t.0.clone(), name.clone());
        }
        write_atomic(&dir.join(&name), &safetensors_bytes(chunk))?;
    }
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    let index = serde_json::to_string_pretty(&index).map_err(io::Error::other)?;
    write_atomic(&dir.join("model.safetensors.index.json"), index.as_bytes())
}

/// The SmolLM2 GGUF the real-model tests read: `KILN_SMOLLM2_GGUF`, else
/// kiln's cache. `None` (the test skips, saying so) when it is not there,
/// unless `KILN_REQUIRE_SMOLLM2=1` (CI), which makes a missing file a panic.
pub fn smollm2_gguf_for_tests() -> Option<std::path::PathBuf> {
    let path = std::env::var_os("KILN_SMOLLM2_GGUF")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            crate::fetch::default_cache_dir()
                .join("smollm2")
                .join(crate::fetch::SMOLLM2_FILE)
        });
    if path.is_file() {
        return Some(path);
    }
    if std::env::var("KILN_REQUIRE_SMOLLM2").as_deref() == Ok("1") {
        panic!(
            "KILN_REQUIRE_SMOLLM2=1 but {} does not exist; run `kiln fetch`",
            path.display()
        );
    }
    eprintln!(
        "SKIPPED: {} not found (run `kiln fetch`, or set KILN_SMOLLM2_GGUF)",
        path.display()
    );
    None
}

/// The GPT-2 byte-to-character map byte-level BPE vocabularies use.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).expect("valid code point")
}

/// Writes a byte-level BPE `tokenizer.json` into `dir`: token `i < 256` is
/// byte `i` (no merges), token 256 is the special `<eos>`. Returns the EOS id.
pub fn write_byte_tokenizer(dir: &Path) -> std::io::Result<u32> {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..=255u8)
        .map(|b| (byte_char(b).to_string(), serde_json::Value::from(b as u32)))
        .chain(std::iter::once(("<eos>".to_string(), 256.into())))
        .collect();
    let byte_level = serde_json::json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
    });
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{
            "id": 256, "content": "<eos>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": []
        }
    });
    let tmp = dir.join("tokenizer.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&json)?)?;
    std::fs::rename(&tmp, dir.join("tokenizer.json"))?;
    Ok(256)
}

/// The Gemma-3-270M GGUF (Q4_K_M) the real-model tests read:
/// `KILN_GEMMA3_GGUF`, else `gemma3/gemma-3-270m-q4_k_m.gguf` in kiln's
/// cache, where `scripts/fetch-gemma3.sh` puts it. `None` (the test skips,
/// saying so) when it is not there, unless `KILN_REQUIRE_GEMMA3=1` (CI),
/// which makes a missing file a panic.
pub fn gemma3_gguf_for_tests() -> Option<std::path::PathBuf> {
    let path = std::env::var_os("KILN_GEMMA3_GGUF")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            crate::fetch::default_cache_dir()
                .join("gemma3")
                .join("gemma-3-270m-q4_k_m.gguf")
        });
    if path.is_file() {
        return Some(path);
    }
    if std::env::var("KILN_REQUIRE_GEMMA3").as_deref() == Ok("1") {
        panic!(
            "KILN_REQUIRE_GEMMA3=1 but {} does not exist; run scripts/fetch-gemma3.sh",
            path.display()
        );
    }
    eprintln!(
        "SKIPPED: {} not found (run scripts/fetch-gemma3.sh, or set KILN_GEMMA3_GGUF)",
        path.display()
    );
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_normals_have_unit_scale_and_differ_by_seed() {
        let mut r = SplitMix64::new(1);
        let xs: Vec<f64> = (0..20000).map(|_| r.normal()).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(mean.abs() < 0.03, "{mean}");
        assert!((var - 1.0).abs() < 0.05, "{var}");
        assert_ne!(SplitMix64::new(1).next_u64(), SplitMix64::new(2).next_u64());
    }

    #[test]
    fn tensor_values_are_random_per_name_and_not_constant() {
        let a = values("a", 64, &Init::Normal(0.1), 7);
        let b = values("b", 64, &Init::Normal(0.1), 7);
        assert_ne!(a, b);
        assert!(a.iter().any(|&x| x != a[0]));
        let n = values("n", 64, &Init::NormWeight, 7);
        assert!(n.iter().all(|&x| (0.5..1.5).contains(&x)));
        assert!(n.iter().any(|&x| (x - 1.0).abs() > 0.01));
    }

    #[test]
    fn a_bad_spec_is_rejected_not_written() {
        let dir = tempfile::tempdir().unwrap();
        let spec = TinySpec {
            hidden: 30,
            heads: 4,
            ..TinySpec::default()
        };
        let e = write_tiny_model(dir.path(), Family::Llama, &spec).unwrap_err();
        assert!(e.to_string().contains("set head_dim"), "{e}");
        assert!(!dir.path().join("config.json").exists());
    }
}
