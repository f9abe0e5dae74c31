//! The planner on real frontend traces: tiny random models of every family
//! written to disk, compiled through `compile_dir` like `kiln compile`.

mod planner_support;

use kiln_compiler::compile::{compile_dir, compile_model, CompileOptions};
use kiln_compiler::frontend::{open, TraceOptions};
use kiln_compiler::planner::check::check_plan;
use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
use kiln_ir::Op;
use planner_support::*;

fn model(family: Family, spec: &TinySpec) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), family, spec).unwrap();
    dir
}

fn opts(ks: &str, logits: bool) -> CompileOptions {
    let mut o = CompileOptions {
        keys: keys(ks),
        logits,
        ..CompileOptions::default()
    };
    o.kv.max_context = Some(64);
    o
}

const KEYS: &str = "b1q1s0,b3q1s0,b2q2s1,b1q4s3,b2q5s0";

#[test]
fn tiny_models_of_every_family_compile_fused_and_pass_the_checker() {
    for family in Family::ALL {
        for spec in [
            TinySpec::for_family(family),
            TinySpec {
                shards: 2,
                ..TinySpec::for_family(family)
            },
        ] {
            let dir = model(family, &spec);
            let c = compile_dir(dir.path(), &opts(KEYS, true), &mut |_, _| {})
                .unwrap_or_else(|e| panic!("{family:?}: {e}"));
            check_plan(&c.plan).unwrap_or_else(|e| panic!("{family:?}: {e:#?}"));
            assert_eq!(c.plan.meta.architecture, family.architecture());
            assert_eq!(c.plan.meta.files.len(), spec.shards as usize);
            for (kp, r) in c.plan.keys.iter().zip(&c.reports) {
                let l = spec.layers;
                assert_eq!(r.passes.qkv_rope_kv_write, l, "{family:?} {}", kp.key);
                assert_eq!(r.passes.gate_up, l, "{family:?} {}", kp.key);
                assert_eq!(r.passes.add_rms_norm, 2 * l, "{family:?} {}", kp.key);
                assert!(kp
                    .ops
                    .iter()
                    .all(|o| !matches!(o.op, Op::KvWrite | Op::Rope { .. })));
            }
        }
    }
}

#[test]
fn planned_execution_of_a_compiled_model_matches_its_traced_graph() {
    // The traced, unfused graph over the checkpoint's own tensors, in value
    // semantics, against the fused plan executed at its planned addresses
    // with the fused manifest: passes, manifest transforms and memory plan
    // together must not change a bit.
    let mut rng = Rng::new(1234);
    for family in Family::ALL {
        for spec in [TinySpec::for_family(family), TinySpec::llama3()] {
            if spec == TinySpec::llama3() && family != Family::Llama {
                continue;
            }
            let dir = model(family, &spec);
            let m = open(dir.path()).unwrap();
            for logits in [false, true] {
                let c = compile_model(&m, &opts(KEYS, logits), &mut |_, _| {}).unwrap();
                let ck = random_checkpoint(m.manifest(), &mut rng);
                for kp in &c.plan.keys {
                    let traced = m
                        .trace(
                            kp.key,
                            &c.plan.kv,
                            &TraceOptions {
                                logits,
                                ..TraceOptions::default()
                            },
                        )
                        .unwrap();
                    let inp = random_inputs(kp.key, &c.plan.kv, spec.vocab, 64, &mut rng);
                    let want = eval_graph(&traced, m.manifest(), &ck, &inp);
                    let got = exec_plan(
                        kp,
                        &c.plan.manifest,
                        &c.plan.kv,
                        c.plan.arena_bytes,
                        &ck,
                        &inp,
                    );
                    assert!(
                        got == want,
                        "{family:?} {} logits={logits}: the plan computes something else",
                        kp.key
                    );
                    assert!(got.caches != inp.caches);
                }
            }
        }
    }
}

#[test]
fn compiling_a_model_directory_twice_gives_byte_identical_plans() {
    let dir = model(Family::Qwen2, &TinySpec::for_family(Family::Qwen2));
    let a = compile_dir(dir.path(), &opts(KEYS, false), &mut |_, _| {}).unwrap();
    let b = compile_dir(dir.path(), &opts(KEYS, false), &mut |_, _| {}).unwrap();
    assert_eq!(
        kiln_ir::artifact::encode(&a.plan),
        kiln_ir::artifact::encode(&b.plan)
    );
}

#[test]
fn a_key_the_frontend_cannot_trace_is_reported_with_its_name() {
    let dir = model(Family::Llama, &TinySpec::default());
    // spec > 0 needs query = spec + 1.
    let e = compile_dir(dir.path(), &opts("b1q4s1", false), &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("b1q4s1"), "{e}");
    let e = compile_dir(
        &dir.path().join("nope"),
        &opts("b1q1s0", false),
        &mut |_, _| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("not a directory"), "{e}");
}
