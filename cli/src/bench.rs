//! `kiln bench`: times a compiled plan's decode step, replayed from a
//! captured graph and launched eagerly, per shape key.
//!
//! It loads the plan through the [`Engine`] exactly as serving does (the same
//! checks, regions, weights, prepared launches and graphs) and times each key
//! with [`Engine::time_steps`]: a synthetic but valid full batch (every
//! sequence `--context` tokens long in blocks of its own, random token ids
//! and drafts), timed between the backend's marks. Per key it reports the
//! median step time replayed and eager, their ratio, tokens/s, the step time
//! over the HBM floor (the bytes the step must move over the
//! device-to-device copy bandwidth measured in the same run, where the
//! backend measures one), capture time, and arena/workspace bytes, as a table
//! and as JSON.
//!
//! A tensor-parallel plan runs on its ranks (CPU ranks, or GPUs from the
//! ordinal on) and its rows add the time per replayed step spent inside
//! collectives, the busiest rank's (`allred ms`, `collective_ms`).
//!
//! Weights come from `--weights` (the safetensors the plan was compiled
//! against) or, when absent, are random ([`Weights::Random`]). Timing does not
//! depend on the values.
//!
//! Not here: loading, staging or timing code of its own (the engine's), the
//! dispatcher's padding (a timed step is the key's full batch), and anything
//! backend-specific (only the `Backend` trait, through the engine).

use kiln_ir::Key;
use kiln_runtime::{
    open_backend_ranks, DeviceSpec, Engine, EngineError, EngineOptions, GraphMode, StepMode,
    Weights,
};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// Command-line arguments of `kiln bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// The compiled plan (`*.kiln`, target `cuda:sm_NN`).
    pub plan: PathBuf,
    /// Model directory with the safetensors files the plan was compiled
    /// against; random weights when absent.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Execution device: `cuda`, `cuda:<N>`, `hip`, `hip:<N>` or `cpu`.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Device ordinal when `--device` names none.
    #[arg(long, default_value_t = 0)]
    pub ordinal: u32,
    /// Keys to time, e.g. `b1q1s0,b32q1s0` (default: every key of the plan).
    #[arg(long, value_delimiter = ',')]
    pub keys: Vec<String>,
    /// Timed replays per key (eager steps: a tenth of it, at least 10).
    #[arg(long, default_value_t = 200)]
    pub steps: u32,
    /// Context length of every sequence in the timed step.
    #[arg(long, default_value_t = 512)]
    pub context: u32,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Tensor-parallel ranks: a check only (the plan says how many it
    /// needs); an error when it differs from the plan's.
    #[arg(long, value_name = "N")]
    pub tp: Option<u32>,
}

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Usage(String),
    #[error("writing {path}: {message}")]
    Io { path: String, message: String },
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// One key's result.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct KeyResult {
    pub key: String,
    pub batch: u32,
    pub query: u32,
    pub context: u32,
    pub launches: u32,
    pub eager_ms: f64,
    pub replay_ms: f64,
    pub replay_back_to_back_ms: f64,
    pub speedup: f64,
    /// Sequences advanced per second (one step advances each sequence).
    pub tokens_per_s: f64,
    /// Bytes the step must move at the benchmark's context ([`step_bytes`]).
    pub bytes_moved: u64,
    /// The plan's own figure (at the compiled maximum context).
    pub plan_bytes_moved: u64,
    /// `None` where the backend measures no copy bandwidth (the CPU).
    pub hbm_floor_ms: Option<f64>,
    pub replay_over_floor: Option<f64>,
    pub capture_ms: f64,
    /// Tensor-parallel plans: milliseconds per replayed step spent inside
    /// collectives (all-reduce and the cross-rank argmax, waiting for the
    /// other ranks included), the busiest rank's; `None` for one rank or
    /// where the backend cannot tell.
    pub collective_ms: Option<f64>,
    pub arena_bytes: u64,
    pub workspace_bytes: u64,
    /// How many of the key's GEMMs run as each implementation the plan
    /// recorded (`gemv`, `skinny`, `blas`; all zero on the CPU target).
    pub gemms: GemmCounts,
}

/// GEMMs per implementation in one key's plan.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct GemmCounts {
    pub gemv: u32,
    pub skinny: u32,
    pub blas: u32,
}

impl GemmCounts {
    /// The counts of `kp`'s recorded choices.
    pub fn of(kp: &kiln_ir::plan::KeyPlan) -> GemmCounts {
        let mut c = GemmCounts::default();
        for (kind, n) in kp.gemm_kinds() {
            match kind {
                kiln_ir::plan::GemmKind::Gemv => c.gemv = n,
                kiln_ir::plan::GemmKind::Skinny => c.skinny = n,
                kiln_ir::plan::GemmKind::Blas => c.blas = n,
            }
        }
        c
    }
}

/// The whole report.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct BenchReport {
    pub plan: String,
    pub device: String,
    pub weights: String,
    /// `None` where the backend measures none (the CPU).
    pub copy_bandwidth_gbs: Option<f64>,
    /// Tensor-parallel ranks the plan runs on (1: a single device).
    pub tp: u32,
    pub keys: Vec<KeyResult>,
}

impl BenchReport {
    /// The human-readable table.
    pub fn table(&self) -> String {
        let bw = self
            .copy_bandwidth_gbs
            .map_or("not measured".to_string(), |b| format!("{b:.0} GB/s"));
        let mut s = format!(
            "plan {}  device {}  weights {}  copy bandwidth {bw}  tp {}\n",
            self.plan, self.device, self.weights, self.tp
        );
        let opt = |v: Option<f64>, width: usize, prec: usize| {
            v.map_or(format!("{:>width$}", "-"), |v| format!("{v:>width$.prec$}"))
        };
        s.push_str(&format!(
            "{:<10} {:>5} {:>10} {:>10} {:>10} {:>7} {:>10} {:>9} {:>7} {:>9} {:>12} {:>12}\n",
            "key",
            "ctx",
            "eager ms",
            "replay ms",
            "allred ms",
            "ratio",
            "tokens/s",
            "floor ms",
            "/floor",
            "capt ms",
            "arena B",
            "workspace B"
        ));
        for k in &self.keys {
            s.push_str(&format!(
                "{:<10} {:>5} {:>10.3} {:>10.3} {} {:>7.2} {:>10.0} {} {} {:>9.1} {:>12} {:>12}\n",
                k.key,
                k.context,
                k.eager_ms,
                k.replay_ms,
                opt(k.collective_ms, 10, 3),
                k.speedup,
                k.tokens_per_s,
                opt(k.hbm_floor_ms, 9, 3),
                opt(k.replay_over_floor, 7, 2),
                k.capture_ms,
                k.arena_bytes,
                k.workspace_bytes
            ));
        }
        s
    }
}

/// Bytes one step of `key` must move at `context` tokens per sequence: every
/// weight once (the embedding gather reads only its rows, but a tied
/// lm_head reads the whole table, so the table counts once), the K and V
/// rows of every context position of every layer, and the f32 logits row of
/// each sequence. The plan's own `bytes_moved` is computed at the compiled
/// maximum context; the benchmark's floor uses the context it runs.
pub fn step_bytes(plan: &kiln_ir::plan::Plan, key: Key, context: u32) -> u64 {
    let kv = &plan.kv;
    let kv_row = kv.kv_heads as u64 * kv.head_dim as u64 * kv.dtype.size() as u64;
    plan.manifest.total_bytes()
        + key.batch as u64 * context as u64 * kv.layers as u64 * 2 * kv_row
        + key.batch as u64 * plan.meta.info.vocab_size as u64 * 4
}

/// The device `--device` and `--ordinal` name.
fn device_spec(args: &BenchArgs) -> Result<DeviceSpec, BenchError> {
    let name = match args.device.as_str() {
        "cuda" | "hip" => format!("{}:{}", args.device, args.ordinal),
        other => other.to_string(),
    };
    Ok(name.parse::<DeviceSpec>()?)
}

/// The keys `--keys` names, or every key of the plan.
fn wanted_keys(args: &BenchArgs, plan: &kiln_ir::plan::Plan) -> Result<Vec<Key>, BenchError> {
    if args.keys.is_empty() {
        return Ok(plan.keys.iter().map(|k| k.key).collect());
    }
    args.keys
        .iter()
        .map(|s| {
            s.parse::<Key>()
                .map_err(|e| BenchError::Usage(format!("--keys: {e}")))
        })
        .collect()
}

/// Runs the benchmark; returns the report (the CLI prints its table).
pub fn run(args: &BenchArgs) -> Result<BenchReport, BenchError> {
    let spec = device_spec(args)?;
    let plan = kiln_runtime::loader::read_plan_file(&args.plan)?;
    crate::run_cmd::check_tp(args.tp, plan.tp)?;
    let tp = plan.tp;
    let keys = wanted_keys(args, &plan)?;
    let weights = match &args.weights {
        Some(d) => Weights::Dir(d),
        None => Weights::Random { seed: 1000 },
    };
    let options = EngineOptions {
        graphs: GraphMode::On,
        log: false,
        ..EngineOptions::default()
    };
    let backend = open_backend_ranks(spec, tp)?;
    let mut engine = Engine::with_weights(plan, weights, backend, options)?;
    let info = engine.device();
    let bw = engine.copy_bandwidth(1 << 30, 10)?;
    let eager_steps = (args.steps / 10).max(10);
    let mut results = Vec::new();
    for key in keys {
        let facts = engine.key_facts(key)?;
        let eager = engine.time_steps(key, StepMode::Eager, args.context, 3, eager_steps)?;
        let replay =
            engine.time_steps(key, StepMode::Graph, args.context, 10, args.steps.max(1))?;
        let (e, r) = (eager.median_ms, replay.median_ms);
        let bytes = step_bytes(engine.plan(), key, args.context);
        let gemms = engine
            .plan()
            .key_plan(key)
            .map(GemmCounts::of)
            .unwrap_or_default();
        let floor = bw.map(|bw| bytes as f64 / bw * 1e3);
        results.push(KeyResult {
            key: key.to_string(),
            batch: key.batch,
            query: key.query,
            context: args.context,
            launches: facts.launches,
            eager_ms: e,
            replay_ms: r,
            replay_back_to_back_ms: replay.back_to_back_ms,
            speedup: e / r,
            tokens_per_s: key.batch as f64 / (r / 1e3),
            bytes_moved: bytes,
            plan_bytes_moved: facts.bytes_moved,
            hbm_floor_ms: floor,
            replay_over_floor: floor.map(|f| r / f),
            capture_ms: replay.capture_ms.unwrap_or(0.0),
            collective_ms: replay.collective_ms.filter(|_| tp > 1),
            arena_bytes: facts.arena_bytes,
            workspace_bytes: facts.workspace_bytes,
            gemms,
        });
    }
    let report = BenchReport {
        plan: args.plan.display().to_string(),
        device: format!("{} ({}, {})", info.name, info.backend, info.arch),
        weights: args
            .weights
            .as_ref()
            .map_or("random".to_string(), |d| d.display().to_string()),
        copy_bandwidth_gbs: bw.map(|b| b / 1e9),
        tp,
        keys: results,
    };
    if let Some(p) = &args.json {
        write_json(&report, p)?;
    }
    Ok(report)
}

/// Writes the report as JSON to `path` (temp file, then rename).
pub fn write_json(report: &BenchReport, path: &Path) -> Result<(), BenchError> {
    let text = serde_json::to_string_pretty(report).expect("the report serializes");
    kiln_ir::artifact::write_bytes_atomic(path, text.as_bytes()).map_err(|e| BenchError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
    use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
    use kiln_ir::plan::Target;

    fn report_row() -> KeyResult {
        KeyResult {
            key: "b1q1s0".into(),
            batch: 1,
            query: 1,
            context: 512,
            launches: 256,
            eager_ms: 1.5,
            replay_ms: 0.5,
            replay_back_to_back_ms: 0.5,
            speedup: 3.0,
            tokens_per_s: 2000.0,
            bytes_moved: 1 << 30,
            plan_bytes_moved: 1 << 31,
            hbm_floor_ms: Some(0.27),
            replay_over_floor: Some(1.85),
            capture_ms: 2.0,
            collective_ms: None,
            arena_bytes: 1 << 20,
            workspace_bytes: 0,
            gemms: GemmCounts {
                gemv: 0,
                skinny: 7,
                blas: 1,
            },
        }
    }

    #[test]
    fn the_report_table_has_a_row_per_key_and_json_round_trips_through_a_file() {
        let r = BenchReport {
            plan: "m.kiln".into(),
            device: "test".into(),
            weights: "random".into(),
            copy_bandwidth_gbs: Some(4000.0),
            tp: 1,
            keys: vec![
                report_row(),
                KeyResult {
                    key: "b8q1s0".into(),
                    hbm_floor_ms: None,
                    replay_over_floor: None,
                    ..report_row()
                },
            ],
        };
        let t = r.table();
        assert!(
            t.contains("b1q1s0") && t.contains("3.00") && t.contains("1.85"),
            "{t}"
        );
        assert!(t.contains("4000 GB/s"), "{t}");
        let b8 = t
            .lines()
            .find(|l| l.starts_with("b8q1s0"))
            .expect("a b8 row");
        assert!(b8.contains(" - "), "an unmeasured floor prints as -: {b8}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bench.json");
        write_json(&r, &p).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert_eq!(v["keys"][0]["replay_ms"], 0.5);
        assert!(v["keys"][1]["hbm_floor_ms"].is_null());
    }

    fn tiny_plan(dir: &Path, keys: &[Key]) -> PathBuf {
        let model = dir.join("model");
        std::fs::create_dir_all(&model).unwrap();
        write_tiny_model(&model, Family::Llama, &TinySpec::for_family(Family::Llama)).unwrap();
        let opts = CompileOptions {
            keys: keys.to_vec(),
            target: Target::Cpu,
            kv: KvOptions {
                max_context: Some(64),
                ..KvOptions::default()
            },
            ..Default::default()
        };
        let plan = compile_dir(&model, &opts, &mut |_, _| {}).unwrap().plan;
        let path = dir.join("tiny.kiln");
        kiln_ir::artifact::write_plan_atomic(&path, &plan).unwrap();
        path
    }

    fn args(plan: PathBuf) -> BenchArgs {
        BenchArgs {
            plan,
            weights: None,
            device: "cpu".into(),
            ordinal: 0,
            keys: vec![],
            steps: 3,
            context: 20,
            json: None,
            tp: None,
        }
    }

    /// `kiln bench --device cpu` on a compiled tiny plan: one row per key,
    /// real (nonzero) eager and replay times from the engine, no HBM floor
    /// on a backend without a copy bandwidth, and the step bytes at the
    /// benchmark's context.
    #[test]
    fn bench_times_every_key_of_a_compiled_plan_through_the_engine() {
        let dir = tempfile::tempdir().unwrap();
        let keys = [Key::new(1, 1, 0), Key::new(2, 1, 0), Key::new(2, 3, 2)];
        let plan_path = tiny_plan(dir.path(), &keys);
        let mut a = args(plan_path.clone());
        a.json = Some(dir.path().join("bench.json"));
        let r = run(&a).unwrap();
        assert_eq!(r.weights, "random");
        assert_eq!(r.copy_bandwidth_gbs, None);
        assert_eq!(
            r.keys.iter().map(|k| k.key.clone()).collect::<Vec<_>>(),
            vec!["b1q1s0", "b2q1s0", "b2q3s2"]
        );
        let plan = kiln_runtime::loader::read_plan_file(&plan_path).unwrap();
        for k in &r.keys {
            assert!(k.eager_ms > 0.0 && k.replay_ms > 0.0, "{k:?}");
            assert!(k.hbm_floor_ms.is_none() && k.replay_over_floor.is_none());
            let key: Key = k.key.parse().unwrap();
            assert_eq!(k.bytes_moved, step_bytes(&plan, key, 20));
            assert_eq!(k.launches, plan.key_plan(key).unwrap().launches);
            assert_eq!(k.arena_bytes, plan.arena_bytes);
            // A CPU plan runs reference kernels: no GEMM has an implementation.
            assert_eq!(k.gemms, GemmCounts::default());
        }
        assert!(a.json.as_ref().unwrap().is_file());
        // Only the keys asked for; an unknown key is refused by name.
        let mut one = args(plan_path.clone());
        one.keys = vec!["b2q1s0".into()];
        assert_eq!(run(&one).unwrap().keys.len(), 1);
        let mut bad = args(plan_path);
        bad.keys = vec!["b4q1s0".into()];
        let e = run(&bad).unwrap_err().to_string();
        assert!(e.contains("b4q1s0") && e.contains("b2q1s0"), "{e}");
    }

    #[test]
    fn a_context_the_plan_cannot_hold_is_refused_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let mut a = args(tiny_plan(dir.path(), &[Key::new(1, 1, 0)]));
        a.context = 10_000;
        let e = run(&a).unwrap_err().to_string();
        assert!(e.contains("shorter context"), "{e}");
    }

    #[test]
    fn the_hbm_floor_bytes_grow_with_context_by_the_kv_rows_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = tiny_plan(dir.path(), &[Key::new(3, 1, 0)]);
        let plan = kiln_runtime::loader::read_plan_file(&path).unwrap();
        let k = Key::new(3, 1, 0);
        let row = plan.kv.kv_heads as u64 * plan.kv.head_dim as u64 * plan.kv.dtype.size() as u64;
        assert_eq!(
            step_bytes(&plan, k, 40) - step_bytes(&plan, k, 39),
            3 * plan.kv.layers as u64 * 2 * row
        );
        assert!(step_bytes(&plan, k, 1) > plan.manifest.total_bytes());
    }

    #[test]
    fn an_unknown_device_is_refused_with_the_names_it_accepts() {
        let mut a = args("x.kiln".into());
        a.device = "gpu".into();
        let e = run(&a).unwrap_err().to_string();
        assert!(e.contains("expected cpu, cuda"), "{e}");
    }
}
