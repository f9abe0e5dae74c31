//! Lowering at compile time: GPU plans carry every op's complete launch
//! list over planned buffers (attention scratch in the arena, completion
//! counters in their own region), PDL and attention geometry are compile
//! decisions, `launches` counts kernels, and an op no kernel of the target
//! can run fails `kiln compile`.

mod planner_support;

use kiln_compiler::compile::{compile_traced, CompileError, CompileOptions, QkvRopeFusion};
use kiln_compiler::inspect::{render, Format};
use kiln_compiler::passes::synth::{SynthFamily, SynthSpec};
use kiln_compiler::passes::Pass;
use kiln_compiler::planner::check::{check_key, check_plan};
use kiln_compiler::planner::{plan_key, PlanContext, PlanError};
use kiln_ir::plan::{KeyPlan, LaunchParam, Lowering, Region, Target};
use kiln_ir::validate::{kernel_launches, validate};
use kiln_ir::{Key, Op};
use kiln_kernels::gpu::{LowerOptions, ROPE_MAX_HEAD_DIM};
use planner_support::*;

fn compile(
    spec: &SynthSpec,
    target: &str,
) -> Result<kiln_compiler::compile::Compiled, CompileError> {
    let opts = CompileOptions {
        // b12q1s0 (12 tokens) is past the fused GEMVs: it keeps its norms
        // and GEMMs, so every lowering kind appears.
        keys: keys("b1q1s0,b3q1s0,b2q3s2,b12q1s0"),
        target: target.parse().unwrap(),
        // The fused GEMV is opt-in on GPUs; on here so its launches are
        // lowered and shown too.
        fused_gemv: true,
        ..CompileOptions::default()
    };
    compile_traced(
        synth_meta(spec),
        spec.manifest(),
        &opts,
        |k, kv| Ok::<_, String>(spec.graph(k, kv, false)),
        &mut |_, _| {},
    )
}

/// One key planned directly (no kernel images needed), unfused graph.
fn plan_one(spec: &SynthSpec, target: Target, lower: LowerOptions) -> KeyPlan {
    let key: Key = "b2q1s0".parse().unwrap();
    let kv = spec.kv_layout(16, 9, 64);
    let m = spec.manifest();
    let ctx = PlanContext {
        manifest: &m,
        kv: &kv,
        target: &target,
        max_context: 64,
        lower,
    };
    let g = spec.graph(key, &kv, false);
    let info = kiln_ir::verify(&g, None).unwrap_or_else(|e| panic!("{e}"));
    let (kp, _) = plan_key(key, g, &info, &ctx).unwrap_or_else(|e| panic!("{e}"));
    let errs = check_key(&kp, &m, &kv);
    assert!(errs.is_empty(), "{errs:#?}");
    kp
}

fn attention_ops(kp: &KeyPlan) -> Vec<usize> {
    (0..kp.ops.len())
        .filter(|&i| {
            matches!(
                kp.ops[i].op,
                Op::PagedAttention(..) | Op::RopeAttention { .. }
            )
        })
        .collect()
}

#[test]
fn an_op_beyond_the_kernels_limits_fails_kiln_compile_naming_the_op_and_the_limit() {
    let spec = SynthSpec {
        head_dim: ROPE_MAX_HEAD_DIM + 64,
        ..SynthSpec::tiny(SynthFamily::Llama)
    };
    // The reference kernels run it: the refusal is the GPU kernels' limit.
    compile(&spec, "cpu").unwrap();
    let e = compile(&spec, "cuda:sm_90").unwrap_err();
    let CompileError::Plan(PlanError::Unsupported { mnemonic, .. }) = &e else {
        panic!("expected an unsupported-op refusal, got {e}")
    };
    assert!(mnemonic.contains("rope"), "{e}");
    let m = e.to_string();
    assert!(
        m.contains(&format!(
            "head_dim {} exceeds {ROPE_MAX_HEAD_DIM}",
            spec.head_dim
        )) && m.contains("cuda:sm_90")
            && m.contains(mnemonic),
        "{m}"
    );
}

#[test]
fn a_gpu_plan_lowers_every_op_over_planned_scratch_and_counters() {
    let c = compile(&SynthSpec::tiny(SynthFamily::Qwen3), "hip:gfx1100").unwrap();
    let plan = &c.plan;
    check_plan(plan).unwrap_or_else(|e| panic!("{e:#?}"));
    let info = validate(plan).unwrap();
    for m in [
        "attention",
        "norm",
        "rope",
        "elementwise",
        "sampling",
        "gemv",
    ] {
        assert!(info.modules.contains(m), "{m} not in {:?}", info.modules);
    }
    assert!(plan.counter_bytes > 0);
    for kp in &plan.keys {
        let sum: u32 = kp.ops.iter().map(|o| o.lowering.launches()).sum();
        assert_eq!(kp.launches, sum);
        assert!(kp.ops.iter().all(|o| o.lowering != Lowering::Reference));
        let att = attention_ops(kp);
        assert!(!att.is_empty());
        let mut counters = Vec::new();
        for &i in &att {
            let op = &kp.ops[i];
            let s = op.scratch.expect("attention has scratch");
            assert_eq!(s.region, Region::Arena);
            let c = op.counters.expect("attention has counters");
            assert_eq!(c.region, Region::Counters);
            assert!(counters.iter().all(|d: &kiln_ir::plan::BufRef| {
                c.offset >= d.offset + d.bytes || d.offset >= c.offset + c.bytes
            }));
            counters.push(c);
            let Lowering::Kernels(ls) = &op.lowering else {
                panic!("attention lowers to kernels")
            };
            let bufs: Vec<_> = ls[0]
                .params
                .iter()
                .filter_map(|p| match p {
                    LaunchParam::Buf(b) => Some(*b),
                    _ => None,
                })
                .collect();
            assert!(bufs
                .iter()
                .any(|b| b.region == Region::Arena && b.offset == s.offset));
            assert!(bufs
                .iter()
                .any(|b| b.region == Region::Counters && b.offset == c.offset));
            // HIP launches without the PDL attribute.
            assert!(!ls[0].pdl);
        }
    }
}

#[test]
fn pdl_is_decided_per_target_at_compile_time() {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    for (sm, want) in [(90, true), (80, false)] {
        let t = Target::Cuda { sm };
        let kp = plan_one(&spec, t.clone(), LowerOptions::for_target(&t, 256));
        let launches: Vec<_> = kp
            .ops
            .iter()
            .flat_map(|o| kernel_launches(&o.lowering))
            .collect();
        assert!(!launches.is_empty());
        assert!(launches.iter().all(|l| l.pdl == want), "sm_{sm}");
    }
}

#[test]
fn attention_geometry_follows_the_compile_option() {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let t = Target::Cuda { sm: 90 };
    let grid = |blocks| {
        let kp = plan_one(&spec, t.clone(), LowerOptions::for_target(&t, blocks));
        let i = attention_ops(&kp)[0];
        let Lowering::Kernels(ls) = &kp.ops[i].lowering else {
            panic!()
        };
        (ls[0].grid, kp.ops[i].scratch.unwrap().bytes)
    };
    let (few, few_scratch) = grid(1);
    let (many, many_scratch) = grid(100_000);
    // More target blocks: shorter partitions, more of them, more partials.
    assert!(many[0] > few[0], "{few:?} vs {many:?}");
    assert!(many_scratch > few_scratch);
}

#[test]
fn a_gemm_records_its_kernel_with_the_weight_prefetch_flag() {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let t = Target::Cuda { sm: 90 };
    // The default rule gives two tokens to cuBLASLt (no kiln kernel); a
    // tuning choice of the skinny GEMM for every shape makes each GEMM
    // record its launch.
    let mut opts = LowerOptions::for_target(&t, 256);
    for op in &plan_one(&spec, t.clone(), LowerOptions::for_target(&t, 256)).ops {
        if let Lowering::Gemm { shape, .. } = &op.lowering {
            opts.tuned.insert(*shape, kiln_ir::plan::GemmKind::Skinny);
        }
    }
    let kp = plan_one(&spec, t.clone(), opts);
    let mut seen = 0;
    for op in &kp.ops {
        let Lowering::Gemm {
            shape,
            kind,
            kernel,
        } = &op.lowering
        else {
            continue;
        };
        assert_eq!(shape.k, op.args[0].ty.shape.dims()[1]);
        // Two tokens on sm_90, tuned to the tensor-core skinny GEMM.
        assert_eq!(*kind, kiln_ir::plan::GemmKind::Skinny);
        let g = kernel.as_ref().expect("a skinny GEMM carries its launch");
        assert_eq!(g.module, "skinny");
        let w_const = op.weight_args() & 2 != 0;
        assert_eq!(g.params.last(), Some(&LaunchParam::I32(w_const as i32)));
        assert_eq!(g.params[1], LaunchParam::Buf(op.args[1].buf));
        seen += 1;
    }
    assert!(seen > 0);
}

#[test]
fn the_checker_refuses_scratch_that_shares_bytes_with_a_live_value() {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let t = Target::Cuda { sm: 90 };
    let mut kp = plan_one(&spec, t.clone(), LowerOptions::for_target(&t, 256));
    let i = attention_ops(&kp)[0];
    // Move the scratch over the attention's own (arena) query operand.
    let q = kp.ops[i].args[0].buf;
    assert_eq!(q.region, Region::Arena);
    kp.ops[i].scratch.as_mut().unwrap().offset = q.offset;
    let kv = spec.kv_layout(16, 9, 64);
    let errs = check_key(&kp, &spec.manifest(), &kv);
    assert!(
        errs.iter()
            .any(|e| e.contains("scratch") && e.contains("share arena bytes")),
        "{errs:#?}"
    );
}

#[test]
fn inspect_shows_the_launch_list_with_grids_blocks_and_params() {
    let c = compile(&SynthSpec::tiny(SynthFamily::Llama), "hip:gfx1100").unwrap();
    // b1 runs fused GEMVs: the qkv projection with its norm folded in, over
    // the staged GEMV (a small weight: the plain GEMV would stage it too).
    let text = render(&c.plan, Some("b1q1s0".parse().unwrap()), Format::Text).unwrap();
    assert!(
        text.contains("gemv.gemv_staged_fused_norm_t1_bf16_bf16 grid "),
        "{text}"
    );
    let text = render(&c.plan, Some("b12q1s0".parse().unwrap()), Format::Text).unwrap();
    assert!(text.contains("  launches\n"), "{text}");
    let line = text
        .lines()
        .find(|l| l.contains("attention.paged_attn"))
        .expect("an attention launch line");
    assert!(
        line.contains(" grid ") && line.contains(" block 128x1x1") && line.contains("counters+"),
        "{line}"
    );
    assert!(text.contains("gemm t 12 n "), "{text}");
    assert!(text.lines().any(|l| l.trim_start().starts_with("scratch.")));
    assert!(text.contains("  counters    "));
    let json = render(&c.plan, None, Format::Json).unwrap();
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let ops: Vec<serde_json::Value> = v["keys"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|k| k["ops"].as_array().unwrap().clone())
        .collect();
    assert!(ops.iter().any(|o| o["lowering"] == "kernels"
        && o["launches"][0]["grid"]
            .as_array()
            .is_some_and(|g| g.len() == 3)));
    assert!(ops
        .iter()
        .any(|o| o["lowering"] == "gemm" && o["gemm"]["k"].is_u64()));
}

#[test]
fn a_rope_attention_plan_lowers_one_attention_launch_per_layer_and_validates() {
    let spec = SynthSpec::tiny(SynthFamily::Qwen3);
    for target in ["cuda:sm_90", "cuda:sm_80", "hip:gfx1100"] {
        let opts = CompileOptions {
            keys: keys("b1q1s0,b3q1s0,b2q3s2"),
            target: target.parse().unwrap(),
            passes: vec![
                Pass::Dce,
                Pass::FuseAddRmsNorm,
                Pass::FuseQkvRopeKvWrite,
                Pass::FuseRopeAttention,
                Pass::FuseGateUp,
                Pass::FuseMatMul,
            ],
            ..CompileOptions::default()
        };
        let c = compile_traced(
            synth_meta(&spec),
            spec.manifest(),
            &opts,
            |k, kv| Ok::<_, String>(spec.graph(k, kv, false)),
            &mut |_, _| {},
        )
        .unwrap_or_else(|e| panic!("{target}: {e}"));
        check_plan(&c.plan).unwrap_or_else(|e| panic!("{target}: {e:#?}"));
        let info = validate(&c.plan).unwrap();
        // The RoPE + KV write runs inside the attention kernel.
        assert!(
            !info.modules.contains("rope"),
            "{target}: {:?}",
            info.modules
        );
        for kp in &c.plan.keys {
            let att: Vec<_> = kp
                .ops
                .iter()
                .filter(|o| matches!(o.op, Op::RopeAttention { .. }))
                .collect();
            assert_eq!(att.len() as u32, spec.layers, "{target} {}", kp.key);
            for o in att {
                let Lowering::Kernels(ls) = &o.lowering else {
                    panic!("rope_attention lowers to kernels")
                };
                assert_eq!(ls.len(), 1, "{target} {}", kp.key);
                assert!(ls[0].entry.starts_with("paged_attn_rope_stream_r"));
            }
        }
    }
}

/// `--matmul-qkv-rope` decides where a GPU plan forms `matmul_qkv_rope`:
/// `off` nowhere, `pairs` only over heads without a q/k norm (Llama, not
/// Qwen3), `all` over both; where formed, CUDA's one-token key runs one
/// GEMV launch per layer (no `qkv_rope_kv_write`), while three tokens and
/// HIP keep the pair under every setting.
#[test]
fn a_gpu_plan_forms_matmul_qkv_rope_where_the_setting_says_and_lowers_one_launch_per_layer() {
    let compile = |spec: &SynthSpec, target: &str, mode: QkvRopeFusion| {
        let opts = CompileOptions {
            keys: keys("b1q1s0,b3q1s0"),
            target: target.parse().unwrap(),
            matmul_qkv_rope: mode,
            ..CompileOptions::default()
        };
        let c = compile_traced(
            synth_meta(spec),
            spec.manifest(),
            &opts,
            |k, kv| Ok::<_, String>(spec.graph(k, kv, false)),
            &mut |_, _| {},
        )
        .unwrap_or_else(|e| panic!("{target}: {e}"));
        check_plan(&c.plan).unwrap_or_else(|e| panic!("{target}: {e:#?}"));
        validate(&c.plan).unwrap_or_else(|e| panic!("{target}: {e}"));
        c.plan
    };
    fn fused(kp: &KeyPlan) -> Vec<&kiln_ir::plan::PlanOp> {
        kp.ops
            .iter()
            .filter(|o| matches!(o.op, Op::MatMulQkvRope { .. }))
            .collect()
    }
    use QkvRopeFusion::{All, Off, Pairs};
    for (family, mode, formed) in [
        (SynthFamily::Qwen3, Off, false),
        (SynthFamily::Qwen3, Pairs, false),
        (SynthFamily::Qwen3, All, true),
        (SynthFamily::Llama, Off, false),
        (SynthFamily::Llama, Pairs, true),
        (SynthFamily::Llama, All, true),
    ] {
        let spec = SynthSpec::tiny(family);
        let what = format!("{family:?} {mode:?}");
        for kp in &compile(&spec, "hip:gfx1100", mode).keys {
            assert!(fused(kp).is_empty(), "{what} hip {}", kp.key);
        }
        for kp in &compile(&spec, "cuda:sm_90", mode).keys {
            let ops = fused(kp);
            let pairs = kp
                .ops
                .iter()
                .filter(|o| matches!(o.op, Op::QkvRopeKvWrite { .. }))
                .count() as u32;
            if formed && kp.key.batch * kp.key.query == 1 {
                assert_eq!(ops.len() as u32, spec.layers, "{what} {}", kp.key);
                assert_eq!(pairs, 0, "{what} {}", kp.key);
                for o in ops {
                    let Lowering::Kernels(ls) = &o.lowering else {
                        panic!("matmul_qkv_rope lowers to kernels")
                    };
                    assert_eq!(ls.len(), 1, "{what} {}", kp.key);
                    assert!(ls[0].entry.contains("rope_t1"), "{}", ls[0].entry);
                }
            } else {
                assert!(ops.is_empty(), "{what} {}", kp.key);
                assert_eq!(pairs, spec.layers, "{what} {}", kp.key);
            }
        }
    }
}
