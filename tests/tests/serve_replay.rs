//! Replay equals eager on compiled plans, and the capture contract, on the CPU
//! backend with the real kernels.
//!
//! Two independently initialised engines (each model written and compiled in
//! its own directory) run the same workload: one replays captured graphs, the
//! other launches every op eagerly (`KILN_GRAPHS=0` behaviour). The batch's
//! tokens, positions, block tables and number of live rows change at every
//! step. Tokens must be identical and logits within [`LOGIT_BOUND`]; the
//! witnesses are the replay counter, one capture per key used, and the
//! backend actually executing replays.
//!
//! Mutations the test must catch (proved by the fault tests below, and
//! applicable to the main test from outside with
//! `KILN_TEST_FAULTS=freeze_staging` or `KILN_TEST_FAULTS=skip_replay`):
//! (a) the staging refresh before replay removed, (b) replay a no-op.

mod serve_common;

use kiln_runtime::cpu::CpuStats;
use kiln_runtime::{
    BackendError, CpuBackend, Engine, EngineError, Faults, GraphMode, SeqId, SeqOptions,
};
use serve_common::*;
use std::collections::BTreeSet;

/// Replay and eager run the same kernels on the same inputs, so they agree
/// exactly on the CPU; the bound is what a backend whose graphs reorder
/// reductions would be allowed.
const LOGIT_BOUND: f32 = 1e-4;
const STEPS: usize = 40;

fn replay_vs_eager(faults: Faults) -> Result<(), String> {
    let a = smollm2(KEYS);
    let b = smollm2(KEYS);
    let vocab = a.plan.meta.info.vocab_size;
    let mut opts = options(GraphMode::On);
    opts.faults = faults;
    let be = CpuBackend::new();
    let stats = be.stats();
    let mut graphs = Engine::new(a.plan.clone(), a.dir.path(), Box::new(be), opts).unwrap();
    let mut eager = engine(&b, options(GraphMode::Off));
    let mut rng = Rng::new(0xfeed);
    let mut live: Vec<SeqId> = Vec::new();
    let mut last_rows = 0;
    let mut compared = 0;
    for step in 0..STEPS {
        // The number of live rows changes at every step.
        let mut changed = false;
        while !changed || live.len() == last_rows {
            if live.len() <= 1 || (live.len() < 7 && rng.below(2) == 0) {
                let len = 1 + rng.below(9) as usize;
                let p = rng.prompt(vocab, len);
                let o = SeqOptions {
                    max_new_tokens: 8 + rng.below(30),
                    stop_on_eos: false,
                };
                let ida = graphs.add_sequence_with(&p, o).map_err(|e| e.to_string())?;
                let idb = eager.add_sequence_with(&p, o).map_err(|e| e.to_string())?;
                assert_eq!(ida, idb);
                live.push(ida);
            } else {
                let id = live.remove(rng.below(live.len() as u32) as usize);
                graphs.remove_sequence(id).map_err(|e| e.to_string())?;
                eager.remove_sequence(id).map_err(|e| e.to_string())?;
            }
            changed = true;
        }
        if step % 5 == 4 {
            // Drafts for up to two decoding sequences (the spec key's batch).
            for &id in live.iter().take(2) {
                let s = graphs.sequence(id).unwrap();
                if !s.generated.is_empty() && s.finished.is_none() {
                    let d = [rng.below(vocab), rng.below(vocab)];
                    graphs.set_drafts(id, &d).map_err(|e| e.to_string())?;
                    eager.set_drafts(id, &d).map_err(|e| e.to_string())?;
                }
            }
        }
        last_rows = live.len();
        let ta = graphs.step().map_err(|e| format!("step {step}: {e}"))?;
        let tb = eager.step().map_err(|e| format!("step {step}: {e}"))?;
        if ta != tb {
            return Err(format!(
                "step {step}: replay gave {ta:?}, eager gave {tb:?}"
            ));
        }
        for (id, toks) in &ta {
            compared += toks.len();
            let d = max_diff(
                graphs.last_logits(*id).unwrap(),
                eager.last_logits(*id).unwrap(),
            );
            if d > LOGIT_BOUND {
                return Err(format!("step {step}: logits of {id:?} differ by {d}"));
            }
        }
        live.retain(|id| graphs.sequence(*id).unwrap().finished.is_none());
    }
    assert!(compared >= STEPS, "only {compared} tokens compared");
    let used: BTreeSet<_> = graphs
        .counters()
        .iter()
        .filter(|(_, c)| c.replays > 0)
        .map(|(k, _)| *k)
        .collect();
    let t = graphs.total_counters();
    assert!(used.len() >= 4, "keys used: {used:?}");
    assert_eq!(
        t.captures,
        used.len() as u64,
        "one capture per key used: {t:?}"
    );
    assert_eq!(t.eager_steps, 0);
    assert!(t.replays >= STEPS as u64, "{t:?}");
    if !faults.skip_replay {
        assert_eq!(CpuStats::get(&stats.replays), t.replays);
    }
    let e = eager.total_counters();
    assert_eq!((e.captures, e.replays), (0, 0));
    assert!(e.eager_steps >= STEPS as u64);
    Ok(())
}

#[test]
fn replay_equals_eager_on_a_compiled_model_over_forty_changing_steps() {
    replay_vs_eager(faults_from_env()).unwrap();
}

#[test]
fn the_replay_check_fails_without_the_staging_refresh() {
    let e = replay_vs_eager(Faults {
        freeze_staging: true,
        ..Faults::default()
    })
    .unwrap_err();
    assert!(e.contains("replay gave"), "{e}");
}

#[test]
fn the_replay_check_fails_when_replay_does_nothing() {
    let e = replay_vs_eager(Faults {
        skip_replay: true,
        ..Faults::default()
    })
    .unwrap_err();
    assert!(e.contains("replay gave"), "{e}");
}

#[test]
fn an_allocation_inside_a_capture_fails_loudly_naming_the_key() {
    let t = smollm2("b2q1s0");
    let mut opts = options(GraphMode::On);
    opts.faults.alloc_inside_capture = true;
    let mut e = engine(&t, opts);
    e.add_sequence(&[1, 2, 3]).unwrap();
    let err = e.step().unwrap_err();
    let EngineError::Capture { key, source } = &err else {
        panic!("{err}")
    };
    assert_eq!(key.to_string(), "b2q1s0");
    assert!(
        matches!(source, BackendError::CaptureContract { call, .. } if call.starts_with("alloc")),
        "{source}"
    );
    assert_eq!(e.total_counters().captures, 0);
}

#[test]
fn dropping_an_engine_with_work_in_flight_is_safe() {
    let t = smollm2("b1q1s0,b4q1s0");
    let be = CpuBackend::new();
    let stats = be.stats();
    let mut e = Engine::new(
        t.plan.clone(),
        t.dir.path(),
        Box::new(be),
        options(GraphMode::On),
    )
    .unwrap();
    for p in [&[1u32, 2, 3][..], &[4, 5], &[6]] {
        e.add_sequence(p).unwrap();
    }
    for _ in 0..4 {
        e.step().unwrap();
    }
    assert!(e.has_work() && e.total_counters().replays > 0);
    drop(e);
    assert_eq!(CpuStats::get(&stats.live_bytes), 0);
    assert_eq!(CpuStats::get(&stats.frees), CpuStats::get(&stats.allocs));
}

/// Child half of the `KILN_GRAPHS` test: the parent runs it in a fresh
/// process with the variable set or unset.
#[test]
#[ignore = "run in a child process by kiln_graphs_unset_0_and_1_give_their_counters_in_separate_processes"]
fn kiln_graphs_child() {
    let t = smollm2("b1q1s0");
    let opts = options(GraphMode::FromEnv);
    let mut e = match Engine::new(
        t.plan.clone(),
        t.dir.path(),
        Box::new(CpuBackend::new()),
        opts,
    ) {
        Ok(e) => e,
        Err(err) => {
            println!("RESULT error: {err}");
            return;
        }
    };
    let got = e.generate(&[5, 6, 7, 8], 6).unwrap();
    let c = e.total_counters();
    println!(
        "RESULT graphs={} captures={} replays={} eager={} tokens={:?}",
        e.graph_decision().graphs,
        c.captures,
        c.replays,
        c.eager_steps,
        got
    );
}

fn run_child(graphs: Option<&str>) -> String {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--ignored",
        "--exact",
        "kiln_graphs_child",
        "--nocapture",
        "--test-threads=1",
    ]);
    match graphs {
        Some(v) => cmd.env("KILN_GRAPHS", v),
        None => cmd.env_remove("KILN_GRAPHS"),
    };
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "child failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .find_map(|l| l.split_once("RESULT ").map(|x| x.1.to_string()))
        .unwrap_or_else(|| panic!("no RESULT line in {text}"))
}

#[test]
fn kiln_graphs_unset_0_and_1_give_their_counters_in_separate_processes() {
    // 4 prompt tokens one by one, then 5 decode steps: 9 steps of b1q1s0.
    let unset = run_child(None);
    let off = run_child(Some("0"));
    let on = run_child(Some("1"));
    assert!(
        unset.starts_with("graphs=true captures=1 replays=9 eager=0"),
        "{unset}"
    );
    assert!(
        off.starts_with("graphs=false captures=0 replays=0 eager=9"),
        "{off}"
    );
    assert!(
        on.starts_with("graphs=true captures=1 replays=9 eager=0"),
        "{on}"
    );
    // Same tokens whichever way the steps ran.
    let tokens = |s: &str| s.split_once("tokens=").unwrap().1.to_string();
    assert_eq!(tokens(&unset), tokens(&off));
    assert_eq!(tokens(&on), tokens(&off));
    let bad = run_child(Some("maybe"));
    assert!(bad.starts_with("error: KILN_GRAPHS=\"maybe\""), "{bad}");
}
