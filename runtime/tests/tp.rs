//! Tensor parallelism on the CPU backend: `kiln compile --tp N` plans run on
//! `TpBackend::cpu(N)` (ranks as threads, in-process all-reduce) and give
//! the tokens of the unsharded plan, with graphs replayed on every rank; a
//! rank that fails mid-step (error, panic, stall) stops the other ranks
//! with an error naming it instead of leaving them waiting.

use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
use kiln_ir::{Key, Op};
use kiln_kernels::cpu::collective::Exchange;
use kiln_runtime::tp::{CpuExchange, TpBackend};
use kiln_runtime::{CpuBackend, Engine, EngineOptions, GraphMode};
use std::path::Path;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn compile(dir: &Path, tp: u32, logits: bool) -> Result<kiln_ir::plan::Plan, String> {
    let opts = CompileOptions {
        keys: vec![Key::new(1, 1, 0), Key::new(2, 1, 0), Key::new(1, 4, 0)],
        logits,
        kv: KvOptions {
            block_size: 4,
            kv_blocks: Some(48),
            max_context: Some(64),
            ..KvOptions::default()
        },
        tp,
        ..CompileOptions::default()
    };
    compile_dir(dir, &opts, &mut |_, _| {})
        .map(|c| c.plan)
        .map_err(|e| e.to_string())
}

fn options() -> EngineOptions {
    EngineOptions {
        graphs: GraphMode::On,
        log: false,
        keep_logits: true,
        max_new_tokens: 1000,
        ..EngineOptions::default()
    }
}

/// Greedy tokens (and each step's logits when the plan outputs them) of
/// two sequences stepped together.
fn run(e: &mut Engine, prompts: &[Vec<u32>], n: usize) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let ids: Vec<_> = prompts
        .iter()
        .map(|p| {
            e.add_sequence_with(
                p,
                kiln_runtime::SeqOptions {
                    max_new_tokens: n as u32,
                    stop_on_eos: false,
                },
            )
            .unwrap()
        })
        .collect();
    let mut logits = Vec::new();
    while e.has_work() {
        e.step().unwrap();
        for &id in &ids {
            if let Some(l) = e.last_logits(id) {
                logits.push(l.to_vec());
            }
        }
    }
    let toks = ids
        .iter()
        .map(|&id| {
            let all = e.remove_sequence(id).unwrap();
            all[all.len() - n..].to_vec()
        })
        .collect();
    (toks, logits)
}

fn prompts(vocab: u32, seed: u32) -> Vec<Vec<u32>> {
    vec![
        (0..5).map(|i| (i * 37 + seed * 11 + 3) % vocab).collect(),
        (0..9).map(|i| (i * 53 + seed * 7 + 1) % vocab).collect(),
    ]
}

fn check_family(family: Family, spec: TinySpec, tp: u32) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), family, &spec).unwrap();
    for logits in [false, true] {
        let one = compile(dir.path(), 1, logits).unwrap();
        let many = compile(dir.path(), tp, logits).unwrap();
        assert_eq!(many.tp, tp);
        // The sharded program really is sharded: collectives in every key,
        // the cross-rank argmax exactly when the vocabulary is split (no
        // logits output on the CPU target).
        for kp in &many.keys {
            let n = |f: fn(&Op) -> bool| kp.ops.iter().filter(|o| f(&o.op)).count();
            assert_eq!(
                n(|o| matches!(o, Op::AllReduce { .. })),
                2 * spec.layers as usize,
                "{family:?} {}",
                kp.key
            );
            let split = !logits && spec.vocab.is_multiple_of(tp);
            assert_eq!(n(|o| matches!(o, Op::ShardedArgmax { .. })) > 0, split);
        }
        assert_eq!(many.kv.kv_heads * tp, one.kv.kv_heads);
        let bytes = kiln_ir::artifact::encode(&many);
        let back = kiln_ir::artifact::decode(&bytes).unwrap();
        assert_eq!(back, many);

        let mut e1 = Engine::new(one, dir.path(), Box::new(CpuBackend::new()), options()).unwrap();
        let (be, stats) = TpBackend::cpu_with_stats(tp);
        let mut en = Engine::new(many, dir.path(), Box::new(be), options()).unwrap();
        for seed in 0..2 {
            let p = prompts(spec.vocab, seed);
            let (t1, l1) = run(&mut e1, &p, 6);
            let (tn, ln) = run(&mut en, &p, 6);
            assert_eq!(t1, tn, "{family:?} tp={tp} tokens differ from tp=1");
            assert_eq!(l1.len(), ln.len());
            // Bound: the sharded sums regroup the dot products (per-rank
            // partial sums rounded to bf16, then summed in f32 once), so
            // logits move by a few bf16 ulps of the hidden state.
            let worst = l1
                .iter()
                .flatten()
                .zip(ln.iter().flatten())
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst <= 0.05, "{family:?} logits differ by {worst}");
        }
        for (r, s) in stats.iter().enumerate() {
            let replays = kiln_runtime::cpu::CpuStats::get(&s.replays);
            assert!(replays >= 12, "rank {r} replayed {replays} graphs");
        }
        assert!(en.total_counters().replays >= 12);
    }
}

#[test]
fn tp2_plans_of_the_tiny_families_give_the_tp1_tokens_with_graphs_replayed() {
    for family in [Family::Llama, Family::Qwen2, Family::Qwen3, Family::Gemma3] {
        check_family(family, TinySpec::for_family(family), 2);
    }
}

#[test]
fn tp3_of_a_smollm2_shaped_model_gives_the_tp1_tokens() {
    check_family(Family::Llama, TinySpec::smollm2(), 3);
}

#[test]
fn tp2_of_a_model_with_nine_heads_is_refused_naming_the_head_counts() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), Family::Llama, &TinySpec::smollm2()).unwrap();
    let err = compile(dir.path(), 2, false).unwrap_err();
    assert!(err.contains("9 attention heads"), "{err}");
    assert!(err.contains("3 KV heads"), "{err}");
    assert!(err.contains("--tp 1, 3"), "{err}");
}

#[test]
fn a_tp_plan_on_a_single_rank_backend_is_refused_at_load() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), Family::Llama, &TinySpec::default()).unwrap();
    let plan = compile(dir.path(), 2, false).unwrap();
    let err = Engine::new(plan, dir.path(), Box::new(CpuBackend::new()), options())
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("2 rank(s)") && err.contains("drives 1"),
        "{err}"
    );
}

/// How an injected rank failure happens.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// The rank's collective returns an error.
    Error,
    /// The rank panics inside its collective.
    Panic,
    /// The rank arrives far too late.
    Stall(Duration),
}

/// A rank's exchange that fails at its `after`-th collective once armed
/// (`armed` counts down; the failure fires when it reaches zero).
struct FaultyExchange {
    inner: CpuExchange,
    armed: Arc<AtomicI64>,
    fault: Fault,
}

impl Exchange for FaultyExchange {
    fn rank(&self) -> u32 {
        self.inner.rank()
    }
    fn ranks(&self) -> u32 {
        self.inner.ranks()
    }
    fn all_gather(&self, local: &[f32], f: &mut dyn FnMut(&[&[f32]])) -> Result<(), String> {
        if self.armed.fetch_sub(1, Ordering::SeqCst) == 1 {
            match self.fault {
                Fault::Error => return Err("injected failure (test)".into()),
                Fault::Panic => panic!("injected panic (test)"),
                Fault::Stall(d) => std::thread::sleep(d),
            }
        }
        self.inner.all_gather(local, f)
    }
}

/// Runs `f` on a thread of its own and fails the test if it takes longer
/// than `limit` (a hang is the bug these tests look for).
fn bounded<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("did not finish within {limit:?}: a rank is hanging")
        }
        Err(_) => panic!("the test body panicked (see its message above)"),
    }
}

/// A 2-rank engine on the tiny Llama whose rank `faulty` fails as `fault`
/// at its 3rd collective once armed; steps until armed and returns the
/// error of the failing step, then the error of the step after it.
fn fail_a_step(
    faulty: u32,
    fault: Fault,
    graphs: GraphMode,
    timeout: Option<Duration>,
) -> (String, String) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), Family::Llama, &TinySpec::default()).unwrap();
    let plan = compile(dir.path(), 2, false).unwrap();
    let (group, control) = CpuExchange::group_with_timeout(2, timeout);
    let armed = Arc::new(AtomicI64::new(i64::MAX));
    let ranks: Vec<Box<dyn kiln_runtime::Backend + Send>> = group
        .into_iter()
        .map(|ex| {
            let ex: kiln_runtime::cpu::SharedExchange = if ex.rank() == faulty {
                Arc::new(FaultyExchange {
                    inner: ex,
                    armed: armed.clone(),
                    fault,
                })
            } else {
                Arc::new(ex)
            };
            Box::new(CpuBackend::new().with_exchange(ex)) as Box<dyn kiln_runtime::Backend + Send>
        })
        .collect();
    let be = TpBackend::new(ranks).unwrap().with_control(control);
    let opts = EngineOptions {
        graphs,
        ..options()
    };
    let mut e = Engine::new(plan, dir.path(), Box::new(be), opts).unwrap();
    let id = e
        .add_sequence_with(
            &[3, 1, 4, 1, 5],
            kiln_runtime::SeqOptions {
                max_new_tokens: 50,
                stop_on_eos: false,
            },
        )
        .unwrap();
    // Healthy steps first: the group works until the fault.
    while e.sequence(id).unwrap().generated.len() < 3 {
        e.step().unwrap();
    }
    armed.store(3, Ordering::SeqCst);
    let first = e.step().expect_err("the failing step errs").to_string();
    eprintln!("failing step: {first}");
    let second = e.step().expect_err("a stopped group errs").to_string();
    (first, second)
}

#[test]
fn a_rank_whose_collective_fails_stops_the_other_ranks_with_an_error_naming_it() {
    for graphs in [GraphMode::On, GraphMode::Off] {
        for faulty in [0, 1] {
            // No timeout: only the stop can release the waiting rank.
            let (first, second) = bounded(Duration::from_secs(120), move || {
                fail_a_step(faulty, Fault::Error, graphs, None)
            });
            assert!(
                first.contains(&format!("rank {faulty} failed"))
                    && first.contains("injected failure (test)"),
                "{graphs:?} rank {faulty}: {first}"
            );
            assert!(
                second.contains("stopped") && second.contains(&format!("rank {faulty} failed")),
                "{second}"
            );
        }
    }
}

#[test]
fn a_rank_that_panics_mid_step_stops_the_others_instead_of_hanging_them() {
    let (first, second) = bounded(Duration::from_secs(120), || {
        fail_a_step(1, Fault::Panic, GraphMode::On, None)
    });
    assert!(
        first.contains("rank 1 failed") && first.contains("injected panic (test)"),
        "{first}"
    );
    assert!(second.contains("load the plan again"), "{second}");
}

#[test]
fn a_rank_that_never_arrives_is_named_when_the_collective_timeout_expires() {
    let stall = Duration::from_secs(3);
    let t0 = std::time::Instant::now();
    let (first, _) = bounded(Duration::from_secs(120), move || {
        fail_a_step(
            1,
            Fault::Stall(stall),
            GraphMode::On,
            Some(Duration::from_millis(200)),
        )
    });
    assert!(
        first.contains("rank(s) 1 did not reach collective") && first.contains("within 0.2 s"),
        "{first}"
    );
    // The waiting rank gave up at the timeout; the step returned once the
    // stalled rank woke and found the group stopped (not at a later
    // collective).
    assert!(t0.elapsed() < Duration::from_secs(60));
}

#[test]
fn random_weights_of_a_tp3_plan_are_the_unsharded_plans_values_sharded() {
    // Benchmarks of shape-only models bind random weights: a tp plan must
    // hold the unsharded plan's values (each rank its slice), so tp=1 and
    // tp=3 decode the same tokens from them.
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::smollm2();
    write_tiny_model(dir.path(), Family::Llama, &spec).unwrap();
    let mut toks = Vec::new();
    for (tp, seed) in [(1, 7), (3, 7), (1, 8)] {
        let plan = compile(dir.path(), tp, true).unwrap();
        let be: Box<dyn kiln_runtime::Backend + Send> = if tp == 1 {
            Box::new(CpuBackend::new())
        } else {
            Box::new(TpBackend::cpu(tp))
        };
        let weights = kiln_runtime::Weights::Random { seed };
        let mut e = Engine::with_weights(plan, weights, be, options()).unwrap();
        toks.push(run(&mut e, &prompts(spec.vocab, 1), 6));
    }
    assert_eq!(toks[0].0, toks[1].0, "tp=3 tokens differ from tp=1");
    let worst = toks[0]
        .1
        .iter()
        .flatten()
        .zip(toks[1].1.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 0.05, "logits differ by {worst}");
    // Another seed is other weights (the comparison above is not vacuous).
    assert_ne!(toks[0].1, toks[2].1);
}

#[test]
fn a_cuda_tp2_plan_splits_the_lm_head_with_a_collective_argmax() {
    // The GPU form compiles here (NVRTC only); `cuda_tp.rs` runs it.
    if !kiln_kernels::nvrtc::available() {
        eprintln!("SKIPPED: NVRTC not available");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), Family::Llama, &TinySpec::default()).unwrap();
    for logits in [false, true] {
        let opts = CompileOptions {
            keys: vec![Key::new(1, 1, 0), Key::new(1, 8, 0)],
            target: kiln_ir::plan::Target::Cuda { sm: 90 },
            logits,
            tp: 2,
            ..CompileOptions::default()
        };
        let plan = compile_dir(dir.path(), &opts, &mut |_, _| {}).unwrap().plan;
        for kp in &plan.keys {
            let collectives: Vec<_> = kp
                .ops
                .iter()
                .filter(|o| kiln_ir::validate::is_collective(&o.op))
                .collect();
            assert!(collectives
                .iter()
                .all(|o| matches!(o.lowering, kiln_ir::plan::Lowering::Collective)));
            let argmax = collectives
                .iter()
                .filter(|o| matches!(o.op, Op::ShardedArgmax { ranks: 2 }))
                .count();
            // Split exactly when no logits output needs the whole row.
            assert_eq!(argmax, usize::from(!logits), "{} logits={logits}", kp.key);
        }
    }
}
