//! `oracle_run` end to end on the CPU backend: a tiny random model compiled
//! by the real compiler, the binary run as the oracle runs it, its JSON read
//! back and checked against the engine driven directly.

use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
use kiln_ir::Key;
use kiln_runtime::{CpuBackend, Engine, EngineOptions, SeqOptions};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

const NEW: u32 = 12;

struct Setup {
    dir: tempfile::TempDir,
    plan: PathBuf,
    prompts: Vec<Vec<u32>>,
    vocab: u32,
}

fn setup(keys: &str, logits: bool) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    let spec = TinySpec::llama3();
    write_tiny_model(&model, Family::Llama, &spec).unwrap();
    let opts = CompileOptions {
        keys: keys.split(',').map(|k| k.parse::<Key>().unwrap()).collect(),
        logits,
        kv: KvOptions {
            block_size: 4,
            kv_blocks: Some(96),
            max_context: Some(64),
            ..KvOptions::default()
        },
        ..CompileOptions::default()
    };
    let compiled = compile_dir(&model, &opts, &mut |_, _| {}).unwrap();
    let plan = dir.path().join("plan.kiln");
    kiln_ir::artifact::write_plan_atomic(&plan, &compiled.plan).unwrap();
    // Random prompts of different lengths (a one-token prompt among them).
    let mut rng = kiln_compiler::testing::SplitMix64::new(7);
    let prompts: Vec<Vec<u32>> = [1usize, 5, 9, 3]
        .iter()
        .map(|&n| (0..n).map(|_| rng.below(spec.vocab)).collect())
        .collect();
    std::fs::write(
        dir.path().join("prompts.json"),
        json!({ "prompts": prompts }).to_string(),
    )
    .unwrap();
    Setup {
        dir,
        plan,
        prompts,
        vocab: spec.vocab,
    }
}

fn run(s: &Setup, name: &str, extra: &[&str]) -> Result<Value, String> {
    let out = s.dir.path().join(format!("{name}.json"));
    let o = Command::new(env!("CARGO_BIN_EXE_oracle_run"))
        .arg("--plan")
        .arg(&s.plan)
        .arg("--weights")
        .arg(s.dir.path().join("model"))
        .arg("--prompts")
        .arg(s.dir.path().join("prompts.json"))
        .args(["--device", "cpu", "--new-tokens", &NEW.to_string()])
        .args(extra)
        .arg("--out")
        .arg(&out)
        .env("KILN_GRAPHS", "1")
        .output()
        .unwrap();
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    Ok(serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap())
}

fn tokens(v: &Value) -> Vec<Vec<u32>> {
    v["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            s["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

/// Greedy tokens from the engine itself, one prompt at a time.
fn engine_greedy(s: &Setup, prompt: &[u32]) -> Vec<u32> {
    let plan = kiln_ir::artifact::read_plan(&s.plan).unwrap().unwrap();
    let mut e = Engine::new(
        plan,
        &s.dir.path().join("model"),
        Box::new(CpuBackend::new()),
        EngineOptions {
            log: false,
            ..EngineOptions::default()
        },
    )
    .unwrap();
    let id = e
        .add_sequence_with(
            prompt,
            SeqOptions {
                max_new_tokens: NEW,
                stop_on_eos: false,
            },
        )
        .unwrap();
    while e.has_work() {
        e.step().unwrap();
    }
    e.remove_sequence(id).unwrap()
}

fn write_drafts(path: &Path, kind: &str, lists: &[Vec<u32>]) {
    std::fs::write(
        path,
        json!({ "kind": kind, "continuations": lists }).to_string(),
    )
    .unwrap();
}

#[test]
fn greedy_runs_match_the_engine_and_report_margins_and_first_logits() {
    let s = setup("b1q1s0,b4q1s0,b1q4s0,b4q4s0", true);
    let b1 = run(&s, "b1", &["--batch", "1"]).unwrap();
    let b4 = run(&s, "b4", &["--batch", "4"]).unwrap();
    let want: Vec<Vec<u32>> = s.prompts.iter().map(|p| engine_greedy(&s, p)).collect();
    assert_eq!(tokens(&b1), want);
    assert_eq!(
        tokens(&b4),
        want,
        "batch 4 differs from batch 1 on the CPU backend"
    );
    for seq in b1["sequences"].as_array().unwrap() {
        let margins = seq["margins"].as_array().unwrap();
        assert_eq!(margins.len(), NEW as usize);
        assert!(margins.iter().all(|m| m.as_f64().unwrap() >= 0.0));
        let tok = seq["tokens"].as_array().unwrap();
        let second = seq["top2"].as_array().unwrap();
        assert!(tok.iter().zip(second).all(|(a, b)| a != b));
        assert_eq!(seq["argmax_disagreements"], 0);
    }
    // The first-logits file holds one row per prompt, whose argmax is the
    // first generated token.
    let fl = &b1["first_logits"];
    assert_eq!(fl["rows"], 4);
    assert_eq!(fl["vocab"], s.vocab);
    let bytes = std::fs::read(s.dir.path().join(fl["file"].as_str().unwrap())).unwrap();
    assert_eq!(bytes.len(), 4 * s.vocab as usize * 4);
    for (r, seq) in want.iter().enumerate() {
        let row: Vec<f32> = bytes[r * s.vocab as usize * 4..(r + 1) * s.vocab as usize * 4]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let arg = (0..row.len())
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap();
        assert_eq!(arg as u32, seq[0], "prompt {r}");
    }
    // The chunk keys ran (prompts of 5 and 9 tokens), and graphs replayed.
    let c = &b4["counters"];
    assert!(c["b4q4s0"]["replays"].as_u64().unwrap() > 0, "{c}");
    assert!(c["b4q1s0"]["replays"].as_u64().unwrap() > 0, "{c}");
    assert_eq!(b1["mode"], "greedy");
}

#[test]
fn right_drafts_are_all_accepted_and_wrong_ones_never() {
    let s = setup("b1q1s0,b1q3s2", false);
    let plain = run(&s, "plain", &[]).unwrap();
    assert!(plain["first_logits"].is_null());
    let plain_tokens = tokens(&plain);
    let drafts = s.dir.path().join("drafts.json");
    write_drafts(&drafts, "self", &plain_tokens);
    let d = drafts.to_str().unwrap();
    let right = run(&s, "right", &["--drafts", d]).unwrap();
    let wrong = run(&s, "wrong", &["--drafts", d, "--wrong-drafts"]).unwrap();
    assert_eq!(right["drafts_kind"], "self");
    assert_eq!(wrong["drafts_kind"], "wrong");
    assert_eq!(tokens(&right), plain_tokens);
    assert_eq!(tokens(&wrong), plain_tokens);
    let mut verified = 0;
    for (run, all) in [(&right, true), (&wrong, false)] {
        for seq in run["sequences"].as_array().unwrap() {
            for st in seq["steps"].as_array().unwrap() {
                let dr = st["drafts"].as_array().unwrap();
                let em = st["emitted"].as_array().unwrap();
                if dr.is_empty() {
                    assert_eq!(em.len(), 1);
                    continue;
                }
                verified += 1;
                if all {
                    assert_eq!(em.len(), 3, "{st}");
                    assert_eq!(&em[..2], &dr[..], "{st}");
                } else {
                    assert_eq!(em.len(), 1, "{st}");
                    assert_ne!(em[0], dr[0], "{st}");
                }
            }
        }
    }
    assert!(verified > 8, "only {verified} verification steps ran");
}

#[test]
fn bad_inputs_name_the_problem() {
    let s = setup("b1q1s0", false);
    let p = s.dir.path();
    std::fs::write(p.join("bad.json"), r#"{"prompt": [[1, 2]]}"#).unwrap();
    let e = Command::new(env!("CARGO_BIN_EXE_oracle_run"))
        .arg("--plan")
        .arg(&s.plan)
        .arg("--weights")
        .arg(p.join("model"))
        .arg("--prompts")
        .arg(p.join("bad.json"))
        .arg("--out")
        .arg(p.join("x.json"))
        .output()
        .unwrap();
    assert!(!e.status.success());
    let msg = String::from_utf8_lossy(&e.stderr);
    assert!(msg.contains("has no `prompts` array"), "{msg}");

    let drafts = p.join("drafts.json");
    write_drafts(&drafts, "oracle", &[vec![1, 2, 3]]);
    let msg = run(&s, "short", &["--drafts", drafts.to_str().unwrap()]).unwrap_err();
    assert!(msg.contains("1 continuations for 4 prompts"), "{msg}");
    write_drafts(&drafts, "oracle", &vec![vec![1, 2, 3]; 4]);
    let msg = run(&s, "nospec", &["--drafts", drafts.to_str().unwrap()]).unwrap_err();
    assert!(msg.contains("needs a plan with a speculative key"), "{msg}");
    let msg = run(&s, "zero", &["--batch", "0"]).unwrap_err();
    assert!(msg.contains("--batch must be at least 1"), "{msg}");
}
