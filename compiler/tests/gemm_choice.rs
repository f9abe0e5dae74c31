//! The GEMM implementation is a compile-time decision recorded in the plan:
//! the target's default rule, a `kiln tune` table overriding it where its
//! entry is current, stale entries ignored with a note, the CPU target
//! untouched, and the plan validator refusing a recorded choice that cannot
//! run.

mod planner_support;

use kiln_compiler::compile::{compile_traced, CompileOptions, Compiled};
use kiln_compiler::passes::synth::{SynthFamily, SynthSpec};
use kiln_ir::artifact::{decode, encode};
use kiln_ir::plan::{GemmKind, GemmShape, Lowering, Plan, Target};
use kiln_ir::validate::validate;
use kiln_kernels::tuning::{fingerprint_hex, TuningEntry, TuningTable};
use planner_support::*;
use std::collections::BTreeMap;

fn compile(target: &str, tuning: Option<TuningTable>) -> Compiled {
    compile_with(target, tuning, false)
}

/// The synthetic model compiled for `target` with the keys the tests
/// use; `dense_fusion` as `CompileOptions::dense_fusion` (off by default
/// here: with it a one-token key's dense matmuls are fused GEMVs and no
/// GEMM choice is left to test).
fn compile_with(target: &str, tuning: Option<TuningTable>, dense_fusion: bool) -> Compiled {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let opts = CompileOptions {
        keys: keys("b1q1s0,b3q1s0,b40q1s0"),
        target: target.parse().unwrap(),
        tuning,
        dense_fusion,
        ..CompileOptions::default()
    };
    compile_traced(
        synth_meta(&spec),
        spec.manifest(),
        &opts,
        |k, kv| Ok::<_, String>(spec.graph(k, kv, false)),
        &mut |_, _| {},
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Every GEMM of the plan: (key batch, shape, kind, kernel module).
fn gemms(p: &Plan) -> Vec<(u32, GemmShape, GemmKind, Option<String>)> {
    let mut v = Vec::new();
    for k in &p.keys {
        for op in &k.ops {
            if let Lowering::Gemm {
                shape,
                kind,
                kernel,
            } = &op.lowering
            {
                v.push((
                    k.key.batch,
                    *shape,
                    *kind,
                    kernel.as_ref().map(|l| l.module.clone()),
                ));
            }
        }
    }
    v
}

fn entry(target: &str, shape: GemmShape, best: GemmKind, fingerprint: String) -> TuningEntry {
    TuningEntry {
        target: target.into(),
        device: "test".into(),
        shape,
        fingerprint,
        best,
        median_us: BTreeMap::new(),
    }
}

#[test]
fn without_a_table_the_default_rule_picks_gemv_for_one_token_then_blas() {
    let c = compile("cuda:sm_90", None);
    assert!(c.notes.is_empty(), "{:?}", c.notes);
    let g = gemms(&c.plan);
    assert!(!g.is_empty());
    for (batch, shape, kind, module) in &g {
        assert_eq!(shape.t, *batch, "decode GEMMs have one row per sequence");
        let want = match shape.t {
            1 => GemmKind::Gemv,
            _ => GemmKind::Blas,
        };
        assert_eq!(*kind, want, "{shape:?}");
        assert_eq!(module.as_deref(), kind.module(), "{shape:?}");
    }
    for k in &c.plan.keys {
        let counts = k.gemm_kinds();
        let total: u32 = counts.iter().map(|(_, n)| n).sum();
        assert_eq!(
            total as usize,
            g.iter().filter(|x| x.0 == k.key.batch).count()
        );
    }
    // The recorded choice survives the artifact round trip and validates.
    let back = decode(&encode(&c.plan)).unwrap();
    assert_eq!(back, c.plan);
    validate(&back).unwrap();
}

#[test]
fn with_dense_fusion_a_one_token_key_keeps_only_its_lm_head_to_choose() {
    let c = compile_with("cuda:sm_90", None, true);
    let g = gemms(&c.plan);
    // The dense lm_head (f32 logits) stays unfused under the default rule
    // (`FuseRule::dense_lm_head`); every other one-token matmul fused.
    let one: Vec<_> = g.iter().filter(|x| x.0 == 1).collect();
    assert_eq!(one.len(), 1, "{g:?}");
    assert_eq!(one[0].1.out, kiln_ir::DType::F32, "{g:?}");
    assert!(g.iter().any(|x| x.0 == 3), "{g:?}");
    let b1 = c.plan.keys.iter().find(|k| k.key.batch == 1).unwrap();
    assert!(b1
        .ops
        .iter()
        .any(|o| matches!(o.op, kiln_ir::Op::FusedMatMul { pre: Some(_), .. })));
}

#[test]
fn a_current_table_entry_changes_the_choice_for_its_shape_only() {
    let base = compile("cuda:sm_90", None);
    let g = gemms(&base.plan);
    let (_, s3, _, _) = *g.iter().find(|x| x.0 == 3).unwrap();
    let (_, s1, _, _) = *g.iter().find(|x| x.0 == 1).unwrap();
    let mut t = TuningTable::new();
    t.record(entry("cuda:sm_90", s3, GemmKind::Skinny, fingerprint_hex()));
    t.record(entry("cuda:sm_90", s1, GemmKind::Blas, fingerprint_hex()));
    let c = compile("cuda:sm_90", Some(t));
    assert!(c.notes.is_empty(), "{:?}", c.notes);
    for ((_, sa, ka, _), (_, sb, kb, mb)) in g.iter().zip(gemms(&c.plan)) {
        assert_eq!(*sa, sb);
        let want = if sb == s3 {
            GemmKind::Skinny
        } else if sb == s1 {
            GemmKind::Blas
        } else {
            *ka
        };
        assert_eq!(kb, want, "{sb:?}");
        assert_eq!(mb.as_deref(), kb.module());
    }
    validate(&c.plan).unwrap();
}

#[test]
fn a_stale_or_foreign_entry_is_ignored_and_a_stale_one_is_noted() {
    let base = compile("cuda:sm_90", None);
    let (_, s3, k3, _) = *gemms(&base.plan).iter().find(|x| x.0 == 3).unwrap();
    assert_eq!(k3, GemmKind::Blas);
    let mut t = TuningTable::new();
    t.record(entry(
        "cuda:sm_90",
        s3,
        GemmKind::Blas,
        "00000000deadbeef".into(),
    ));
    let mut foreign = s3;
    foreign.t = 1;
    t.record(entry(
        "cuda:sm_80",
        foreign,
        GemmKind::Blas,
        fingerprint_hex(),
    ));
    let c = compile("cuda:sm_90", Some(t));
    assert_eq!(gemms(&c.plan), gemms(&base.plan));
    assert_eq!(c.notes.len(), 1, "{:?}", c.notes);
    assert!(
        c.notes[0].contains("00000000deadbeef") && c.notes[0].contains("ignored"),
        "{}",
        c.notes[0]
    );
}

#[test]
fn the_cpu_target_keeps_reference_lowerings_whatever_the_table_says() {
    let mut t = TuningTable::new();
    let shape = GemmShape {
        t: 1,
        n: 96,
        k: 32,
        dtype: kiln_ir::DType::BF16,
        out: kiln_ir::DType::F32,
        bias: false,
    };
    t.record(entry("cpu", shape, GemmKind::Skinny, fingerprint_hex()));
    let c = compile("cpu", Some(t));
    assert!(c
        .plan
        .keys
        .iter()
        .all(|k| k.ops.iter().all(|op| op.lowering == Lowering::Reference)));
}

#[test]
fn the_validator_refuses_a_recorded_gemm_choice_that_cannot_run() {
    // Skinny for every 3-token GEMM (a tuning table; the default rule
    // never picks it), so the plan holds skinny launches to tamper with.
    let mut t = TuningTable::new();
    for (_, s, _, _) in gemms(&compile("cuda:sm_90", None).plan) {
        if s.t == 3 {
            t.record(entry("cuda:sm_90", s, GemmKind::Skinny, fingerprint_hex()));
        }
    }
    let c = compile("cuda:sm_90", Some(t));
    let find = |p: &mut Plan, batch: u32| -> (usize, usize) {
        for (ki, k) in p.keys.iter().enumerate() {
            for (oi, op) in k.ops.iter().enumerate() {
                if k.key.batch == batch && matches!(op.lowering, Lowering::Gemm { .. }) {
                    return (ki, oi);
                }
            }
        }
        panic!("no GEMM at batch {batch}")
    };
    let refuse = |p: &Plan, want: &str| {
        let e = validate(p).unwrap_err();
        assert!(e.field.ends_with(".lowering"), "{e}");
        assert!(e.problem.contains(want), "wanted `{want}` in: {e}");
    };
    // A skinny launch recorded as gemv.
    let mut p = c.plan.clone();
    let (ki, oi) = find(&mut p, 3);
    if let Lowering::Gemm { kind, .. } = &mut p.keys[ki].ops[oi].lowering {
        *kind = GemmKind::Gemv;
    }
    refuse(&p, "module `gemv`");
    // Blas with a kernel, and skinny without one.
    let mut p = c.plan.clone();
    if let Lowering::Gemm { kind, .. } = &mut p.keys[ki].ops[oi].lowering {
        *kind = GemmKind::Blas;
    }
    refuse(&p, "launches no kernel");
    let mut p = c.plan.clone();
    if let Lowering::Gemm { kernel, .. } = &mut p.keys[ki].ops[oi].lowering {
        *kernel = None;
    }
    refuse(&p, "needs its `skinny` kernel");
    // Skinny past 32 tokens: relabel a 40-token blas GEMM with a skinny launch.
    let mut p = c.plan.clone();
    let (kb, ob) = find(&mut p, 40);
    let launch = match &p.keys[ki].ops[oi].lowering {
        Lowering::Gemm { kernel, .. } => kernel.clone(),
        _ => unreachable!(),
    };
    if let Lowering::Gemm { kind, kernel, .. } = &mut p.keys[kb].ops[ob].lowering {
        assert_eq!(*kind, GemmKind::Blas);
        *kind = GemmKind::Skinny;
        *kernel = launch;
    }
    refuse(&p, "at most 32 tokens");
    // Skinny on a part without tensor cores for it.
    let mut p = c.plan.clone();
    p.meta.target = Target::Cuda { sm: 75 };
    refuse(&p, "sm_80");
}
