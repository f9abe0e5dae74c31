//! Shared helpers of the runtime's integration tests: tiny models written as
//! Hugging Face directories, compiled into real plans by the real compiler
//! (kiln-compiler is a dev-dependency), run on the CPU backend.
//!
//! The reference a test compares an engine with is the simplest way the
//! runtime can produce greedy tokens: a fresh engine per sequence, on a plan
//! with only the `b1q1s0` key, eager, prompt token by token. Every other way
//! a step can be built (batches with padding, prefill chunks, speculative
//! verification, graphs) must agree with it; the HF oracle on the GPU
//! machine checks this path itself against Hugging Face.

#![allow(dead_code)]

use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
use kiln_ir::plan::Plan;
use kiln_ir::{DType, Key};
use kiln_runtime::cpu::CpuStats;
use kiln_runtime::{CpuBackend, Engine, EngineOptions, Faults, GraphMode, PrefillMode, SeqOptions};
use std::path::Path;
use std::sync::Arc;
use tempfile::TempDir;

/// Deterministic pseudo-random numbers (splitmix64).
#[derive(Clone, Debug)]
pub struct Rng(kiln_ir::rng::SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(kiln_ir::rng::SplitMix64::new(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in `[0, n)`.
    pub fn below(&mut self, n: u32) -> u32 {
        (self.next_u64() % n as u64) as u32
    }
}

/// A tiny Llama-family model and the shapes its plan is compiled for.
#[derive(Clone, Debug)]
pub struct TinyModel {
    pub vocab: u32,
    pub hidden: u32,
    pub layers: u32,
    pub max_context: u32,
    pub block_size: u32,
    /// KV blocks per layer, the null block included.
    pub num_blocks: u32,
    pub keys: Vec<Key>,
    pub eos: Vec<u32>,
    /// Dtype of the tensors in the safetensors file (and so of the plan).
    pub file_dtype: DType,
    pub seed: u64,
}

impl Default for TinyModel {
    fn default() -> TinyModel {
        TinyModel {
            vocab: 61,
            hidden: 32,
            layers: 2,
            max_context: 48,
            block_size: 4,
            num_blocks: 64,
            keys: ["b1q1s0", "b2q1s0", "b4q1s0", "b8q1s0", "b2q4s0", "b2q3s2"]
                .iter()
                .map(|k| k.parse().unwrap())
                .collect(),
            eos: vec![],
            file_dtype: DType::F32,
            seed: 7,
        }
    }
}

/// A model directory with a `b1q1s0` plan: what [`TinyModel::greedy_reference`]
/// runs.
pub struct Reference {
    dir: TempDir,
    plan: Plan,
}

impl TinyModel {
    fn spec(&self) -> TinySpec {
        TinySpec {
            layers: self.layers,
            hidden: self.hidden,
            heads: 4,
            kv_heads: 2,
            intermediate: 2 * self.hidden,
            vocab: self.vocab,
            max_position: 512,
            bos_token_id: 0,
            eos_token_ids: self.eos.clone(),
            dtype: self.file_dtype,
            seed: self.seed,
            ..TinySpec::default()
        }
    }

    /// Writes `config.json` and `model.safetensors` into `dir`.
    pub fn write_weights(&self, dir: &Path) -> std::io::Result<()> {
        write_tiny_model(dir, Family::Llama, &self.spec())
    }

    fn compile(&self, dir: &Path, keys: &[Key]) -> Plan {
        self.compile_for(dir, keys, kiln_ir::plan::Target::Cpu)
    }

    fn compile_for(&self, dir: &Path, keys: &[Key], target: kiln_ir::plan::Target) -> Plan {
        self.compile_with(dir, keys, target, false)
    }

    /// Writes the model into `dir` and compiles a plan for [`Self::keys`]
    /// whose non-speculative keys sample in the graph (`--sampling`).
    pub fn build_sampling(
        &self,
        dir: &Path,
        target: kiln_ir::plan::Target,
    ) -> std::io::Result<Plan> {
        self.write_weights(dir)?;
        Ok(self.compile_with(dir, &self.keys, target, true))
    }

    fn compile_with(
        &self,
        dir: &Path,
        keys: &[Key],
        target: kiln_ir::plan::Target,
        sampling: bool,
    ) -> Plan {
        let opts = CompileOptions {
            target,
            keys: keys.to_vec(),
            logits: true,
            sampling,
            kv: KvOptions {
                block_size: self.block_size,
                kv_blocks: Some(self.num_blocks - 1),
                max_context: Some(self.max_context),
                ..KvOptions::default()
            },
            ..CompileOptions::default()
        };
        compile_dir(dir, &opts, &mut |_, _| {})
            .unwrap_or_else(|e| panic!("compiling the tiny model: {e}"))
            .plan
    }

    /// Writes the model into `dir` and compiles its plan for [`Self::keys`].
    pub fn build(&self, dir: &Path) -> std::io::Result<Plan> {
        self.write_weights(dir)?;
        Ok(self.compile(dir, &self.keys))
    }

    /// As [`Self::build`], compiled for `target` (a GPU target gets its
    /// launches lowered and its kernel images, as `kiln compile` does).
    pub fn build_for(&self, dir: &Path, target: kiln_ir::plan::Target) -> std::io::Result<Plan> {
        self.write_weights(dir)?;
        Ok(self.compile_for(dir, &self.keys, target))
    }

    /// The reference model: the same weights with a `b1q1s0` plan.
    pub fn weights(&self) -> Reference {
        let dir = tempfile::tempdir().unwrap();
        self.write_weights(dir.path()).unwrap();
        let plan = self.compile(dir.path(), &[Key::new(1, 1, 0)]);
        Reference { dir, plan }
    }

    /// `n` greedy tokens after `prompt` (never stopping at EOS) and the
    /// logits that produced each, from a fresh single-sequence eager engine
    /// fed the prompt token by token.
    pub fn greedy_reference(
        &self,
        r: &Reference,
        prompt: &[u32],
        n: usize,
    ) -> (Vec<u32>, Vec<Vec<f32>>) {
        let mut opts = options(GraphMode::Off);
        opts.prefill = PrefillMode::TokenByToken;
        let mut e = Engine::new(
            r.plan.clone(),
            r.dir.path(),
            Box::new(CpuBackend::new()),
            opts,
        )
        .unwrap();
        let id = e
            .add_sequence_with(
                prompt,
                SeqOptions {
                    max_new_tokens: n as u32,
                    stop_on_eos: false,
                },
            )
            .unwrap();
        let (mut tokens, mut logits) = (Vec::new(), Vec::new());
        while e.has_work() {
            for (_, new) in e.step().unwrap() {
                tokens.extend(new);
                logits.push(e.last_logits(id).expect("the plan has logits").to_vec());
            }
        }
        assert_eq!(tokens.len(), n, "the reference ran short");
        (tokens, logits)
    }
}

pub fn build(model: &TinyModel) -> (TempDir, Plan) {
    let dir = tempfile::tempdir().unwrap();
    let plan = model.build(dir.path()).unwrap();
    (dir, plan)
}

pub fn options(graphs: GraphMode) -> EngineOptions {
    EngineOptions {
        graphs,
        log: false,
        keep_logits: true,
        max_new_tokens: 1000,
        ..EngineOptions::default()
    }
}

pub fn engine_with(plan: &Plan, dir: &Path, opts: EngineOptions) -> (Engine, Arc<CpuStats>) {
    let be = CpuBackend::new();
    let stats = be.stats();
    let e = Engine::new(plan.clone(), dir, Box::new(be), opts).unwrap();
    (e, stats)
}

pub fn engine(plan: &Plan, dir: &Path, graphs: GraphMode) -> Engine {
    engine_with(plan, dir, options(graphs)).0
}

/// Faults named in `KILN_TEST_FAULTS` (comma separated: `freeze_staging`,
/// `skip_replay`, `alloc_inside_capture`), so a mutation can be applied to
/// the replay-equals-eager test from outside:
/// `KILN_TEST_FAULTS=skip_replay cargo test -p kiln-runtime --test replay`
/// must fail.
pub fn faults_from_env() -> Faults {
    let mut f = Faults::default();
    if let Ok(v) = std::env::var("KILN_TEST_FAULTS") {
        for name in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match name {
                "freeze_staging" => f.freeze_staging = true,
                "skip_replay" => f.skip_replay = true,
                "alloc_inside_capture" => f.alloc_inside_capture = true,
                other => panic!("KILN_TEST_FAULTS: unknown fault `{other}`"),
            }
        }
    }
    f
}

/// A random prompt of `len` tokens.
pub fn prompt(rng: &mut Rng, vocab: u32, len: usize) -> Vec<u32> {
    (0..len).map(|_| rng.below(vocab)).collect()
}
