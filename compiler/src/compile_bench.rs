//! `kiln bench-compile`: how long compiling a real-sized model takes, and how
//! good the memory planner is on it.
//!
//! It writes a Qwen3-0.6B-shaped model to disk (config.json and a
//! `model.safetensors` whose header is real and whose 1.2 GB of data is a
//! sparse hole: compile reads headers only, never tensor data), then opens
//! and compiles it for 16 shape keys through the same path as `kiln compile`
//! (frontend, passes with verification, planner, checker, encoding), a few
//! times, and reports the best and median wall time plus each key's planner
//! efficiency (lower bound / peak) as a table and JSON.
//!
//! Not here: timing assertions (this is a benchmark, not a test), runtime
//! step timings (`kiln bench`).

use crate::compile::{self, efficiency, CompileOptions, KvOptions};
use crate::passes::synth::SynthSpec;
use kiln_ir::plan::Target;
use kiln_ir::Key;
use serde::Serialize;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The 16 keys the benchmark compiles: decode at six batch sizes,
/// speculative verification of 1 and 3 drafts, and prefill chunks.
pub const BENCH_KEYS: &str = "b1q1s0,b2q1s0,b4q1s0,b8q1s0,b16q1s0,b32q1s0,b1q2s1,b2q2s1,b4q2s1,b8q2s1,b1q4s3,b4q4s3,b8q4s3,b1q16s0,b4q16s0,b1q64s0";

/// `kiln bench-compile` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct BenchCompileArgs {
    /// Where to write the model (default: a fresh directory under the system
    /// temp dir, removed afterwards).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Target to compile for (its BLAS workspace model applies).
    #[arg(long, default_value = "cuda:sm_90")]
    pub target: Target,
    /// Compiles to time (the first is reported too).
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,
    /// Also write the JSON report here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("writing the benchmark model to `{path}`: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error(transparent)]
    Compile(#[from] compile::CompileError),
}

/// Writes `config.json` and a header-only `model.safetensors` (data is a
/// sparse hole of the right length) for a Qwen3-shaped `spec`.
pub fn write_header_only_model(dir: &Path, spec: &SynthSpec) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let config = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": spec.tied,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
        "attention_bias": false,
        "use_sliding_window": false,
        "sliding_window": null,
        "max_window_layers": spec.layers,
    });
    let text = serde_json::to_string_pretty(&config).map_err(io::Error::other)?;
    kiln_ir::artifact::write_bytes_atomic(&dir.join("config.json"), text.as_bytes())?;

    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0u64;
    for (name, shape) in spec.tensors() {
        let bytes = shape.iter().map(|&d| d as u64).product::<u64>() * 2;
        header.insert(
            name,
            serde_json::json!({"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut json = serde_json::to_string(&header).map_err(io::Error::other)?;
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let path = dir.join("model.safetensors");
    let tmp = dir.join(".model.safetensors.tmp");
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&(json.len() as u64).to_le_bytes())?;
        f.write_all(json.as_bytes())?;
        f.set_len(8 + json.len() as u64 + offset)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[derive(Serialize)]
struct KeyRow {
    key: String,
    launches: u32,
    arena_peak: u64,
    arena_lower_bound: u64,
    efficiency: f64,
    strategy: &'static str,
}

#[derive(Serialize)]
struct Report {
    model: &'static str,
    target: String,
    keys: usize,
    runs_s: Vec<f64>,
    best_s: f64,
    median_s: f64,
    plan_bytes: usize,
    arena_bytes: u64,
    workspace_bytes: u64,
    min_efficiency: f64,
    per_key: Vec<KeyRow>,
}

/// Runs the benchmark; returns the table and JSON to print.
pub fn run(args: &BenchCompileArgs) -> Result<String, BenchError> {
    let spec = SynthSpec::qwen3_0_6b();
    let (dir, temp) = match &args.dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("kiln-bench-compile-{}", std::process::id())),
            true,
        ),
    };
    write_header_only_model(&dir, &spec).map_err(|source| BenchError::Write {
        path: dir.clone(),
        source,
    })?;
    let opts = CompileOptions {
        keys: BENCH_KEYS
            .split(',')
            .map(|k| k.parse::<Key>().expect("valid"))
            .collect(),
        target: args.target.clone(),
        kv: KvOptions::default(),
        ..CompileOptions::default()
    };
    let mut runs = Vec::new();
    let mut last = None;
    for _ in 0..args.repeat.max(1) {
        let t = Instant::now();
        let c = compile::compile_dir(&dir, &opts, &mut |_, _| {})?;
        let bytes = kiln_ir::artifact::encode(&c.plan);
        runs.push(t.elapsed().as_secs_f64());
        last = Some((c, bytes.len()));
    }
    if temp {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let (c, plan_bytes) = last.expect("at least one run");
    let mut sorted = runs.clone();
    sorted.sort_by(f64::total_cmp);
    let per_key: Vec<KeyRow> = c
        .plan
        .keys
        .iter()
        .zip(&c.reports)
        .map(|(k, r)| KeyRow {
            key: k.key.to_string(),
            launches: k.launches,
            arena_peak: k.arena_peak,
            arena_lower_bound: k.arena_lower_bound,
            efficiency: efficiency(k.arena_lower_bound, k.arena_peak),
            strategy: r.strategy,
        })
        .collect();
    let report = Report {
        model: "Qwen3-0.6B-shaped (28 layers, hidden 1024, vocab 151936)",
        target: args.target.to_string(),
        keys: per_key.len(),
        best_s: sorted[0],
        median_s: sorted[sorted.len() / 2],
        runs_s: runs,
        plan_bytes,
        arena_bytes: c.plan.arena_bytes,
        workspace_bytes: c.plan.workspace_bytes,
        min_efficiency: per_key.iter().map(|k| k.efficiency).fold(1.0, f64::min),
        per_key,
    };
    let json = serde_json::to_string_pretty(&report).expect("plain data") + "\n";
    if let Some(p) = &args.json {
        kiln_ir::artifact::write_bytes_atomic(p, json.as_bytes()).map_err(|source| {
            BenchError::Write {
                path: p.clone(),
                source,
            }
        })?;
    }
    let mut table = format!(
        "{:<9} {:>8} {:>12} {:>12} {:>7}  {}\n",
        "key", "launches", "arena_peak", "lower_bound", "eff", "placement"
    );
    for k in &report.per_key {
        table.push_str(&format!(
            "{:<9} {:>8} {:>12} {:>12} {:>7.4}  {}\n",
            k.key, k.launches, k.arena_peak, k.arena_lower_bound, k.efficiency, k.strategy
        ));
    }
    table.push_str(&format!(
        "compile of {} keys: best {:.3} s, median {:.3} s over {} run(s); plan {} bytes; min efficiency {:.4}\n",
        report.keys,
        report.best_s,
        report.median_s,
        report.runs_s.len(),
        report.plan_bytes,
        report.min_efficiency
    ));
    Ok(format!("{table}\n{json}"))
}
