//! The `fuse-matmul` pass: RMSNorm prologues and SiLU*up / residual-add
//! epilogues folded into the decode-step GEMVs, and the greedy argmax into
//! the lm_head GEMV. It must preserve the step's
//! function exactly (the fused op is defined as the unfused sequence, and the
//! reference interpreter evaluates it from that definition), fire on every
//! layer where it is legal, leave an intermediate with a second reader
//! alone, and on a GPU target fuse only keys whose fused GEMV exists.

mod planner_support;

use kiln_compiler::passes::synth::{SynthFamily, SynthSpec};
use kiln_compiler::passes::{run_pipeline, run_pipeline_for, Pass, PassStats, DEFAULT_PIPELINE};
use kiln_ir::plan::Target;
use kiln_ir::{Epilogue, Graph, Key, Op, WeightManifest};
use planner_support::*;

const FAMILIES: [SynthFamily; 3] = [SynthFamily::Llama, SynthFamily::Qwen2, SynthFamily::Qwen3];

fn kv_for(spec: &SynthSpec, key: Key) -> kiln_ir::plan::KvLayout {
    spec.kv_layout(16, key.batch * 4 + 1, 64)
}

fn without_fuse_matmul() -> Vec<Pass> {
    DEFAULT_PIPELINE
        .iter()
        .copied()
        .filter(|p| *p != Pass::FuseMatMul)
        .collect()
}

fn pipeline(
    spec: &SynthSpec,
    g: Graph,
    passes: &[Pass],
    target: &Target,
) -> (Graph, WeightManifest, PassStats) {
    let mut m = spec.manifest();
    let (g, _, s) =
        run_pipeline_for(g, &mut m, passes, true, target).unwrap_or_else(|e| panic!("{e}"));
    kiln_compiler::passes::weights::prune(&mut m, &[&g]);
    (g, m, s)
}

fn count(g: &Graph, f: impl Fn(&Op) -> bool) -> usize {
    g.nodes.iter().filter(|n| f(&n.op)).count()
}

fn fused_with(g: &Graph, pre: bool, post: Epilogue) -> usize {
    count(
        g,
        |o| matches!(o, Op::FusedMatMul { pre: p, post: e, .. } if p.is_some() == pre && *e == post),
    )
}

#[test]
fn every_decoder_layer_becomes_four_fused_gemvs_plus_rope_and_attention() {
    for fam in FAMILIES {
        let spec = SynthSpec::tiny(fam);
        let key: Key = "b2q1s0".parse().unwrap();
        let g = spec.graph(key, &kv_for(&spec, key), false);
        let (g, _, s) = pipeline(&spec, g, &DEFAULT_PIPELINE, &Target::Cpu);
        let l = spec.layers as usize;
        // Per layer: o_proj residual, SiLU*up, down_proj residual; and the
        // lm_head's argmax (the logits are no output here).
        assert_eq!(s.matmul_epilogues as usize, 3 * l + 1, "{fam:?}");
        // Per layer: the qkv and gate_up norms; plus the final norm.
        assert_eq!(s.matmul_prologues as usize, 2 * l + 1, "{fam:?}");
        let unfused = count(&g, |o| {
            matches!(
                o,
                Op::RmsNorm { .. }
                    | Op::AddRmsNorm { .. }
                    | Op::Add
                    | Op::SiluMul
                    | Op::MatMul { .. }
            )
        });
        assert_eq!(unfused, 0, "{fam:?}: {}", kiln_ir::print(&g));
        assert_eq!(fused_with(&g, true, Epilogue::None), l, "qkv");
        assert_eq!(fused_with(&g, true, Epilogue::Argmax), 1, "lm_head");
        assert_eq!(fused_with(&g, false, Epilogue::Residual), 2 * l, "o + down");
        assert_eq!(fused_with(&g, true, Epilogue::SiluMul), l, "gate_up");
        // embedding, 6 per layer, lm_head with its argmax.
        assert_eq!(
            g.nodes.len(),
            1 + 6 * l + 1,
            "{fam:?}: {}",
            kiln_ir::print(&g)
        );
    }
}

#[test]
fn the_fused_step_computes_exactly_what_the_unfused_step_computes() {
    let mut rng = Rng::new(1515);
    for fam in FAMILIES {
        let spec = SynthSpec::tiny(fam);
        // b2q4s0 ends in gather_last (its final norm stays unfused), b2q3s2
        // verifies drafts, b3q1s0 is plain decode.
        for key in keys("b1q1s0,b3q1s0,b2q3s2,b2q4s0") {
            let kv = kv_for(&spec, key);
            let plain = spec.graph(key, &kv, true);
            let (a, ma, _) = pipeline(&spec, plain.clone(), &without_fuse_matmul(), &Target::Cpu);
            let (b, mb, s) = pipeline(&spec, plain, &DEFAULT_PIPELINE, &Target::Cpu);
            assert!(s.matmul_epilogues > 0 && s.matmul_prologues > 0);
            let ck = random_checkpoint(&spec.manifest(), &mut rng);
            let inp = random_inputs(key, &kv, spec.vocab, 64, &mut rng);
            let want = eval_graph(&a, &ma, &ck, &inp);
            let got = eval_graph(&b, &mb, &ck, &inp);
            assert_eq!(got.outputs, want.outputs, "{fam:?} {key}");
            assert!(got.caches == want.caches, "{fam:?} {key}: caches differ");
            // The logits vary with the inputs (the check is not vacuous).
            let logits = &got.outputs.iter().find(|o| o.0 == "logits").unwrap().1;
            assert!(logits.iter().any(|&v| v != logits[0]), "{fam:?} {key}");
        }
    }
}

#[test]
fn a_fused_plan_is_planned_and_replays_the_unfused_numbers() {
    // Memory semantics too: the planner's placement of the fused ops'
    // operands (no in-place reuse is declared) gives the graph's values.
    let mut rng = Rng::new(1516);
    let spec = SynthSpec::tiny(SynthFamily::Qwen3);
    let opts = kiln_compiler::compile::CompileOptions {
        keys: keys("b1q1s0,b4q1s0"),
        logits: true,
        ..Default::default()
    };
    let c = compile_synth(&spec, &opts);
    let ck = random_checkpoint(&spec.manifest(), &mut rng);
    for kp in &c.plan.keys {
        assert!(
            kp.ops
                .iter()
                .any(|o| matches!(o.op, Op::FusedMatMul { .. })),
            "{}",
            kp.key
        );
        let inp = random_inputs(kp.key, &c.plan.kv, spec.vocab, 64, &mut rng);
        let plain = spec.graph(kp.key, &c.plan.kv, true);
        let want = eval_graph(&plain, &spec.manifest(), &ck, &inp);
        let got = exec_plan(
            kp,
            &c.plan.manifest,
            &c.plan.kv,
            c.plan.arena_bytes,
            &ck,
            &inp,
        );
        assert!(got == want, "{}: planned fused execution differs", kp.key);
    }
}

#[test]
fn a_product_or_norm_with_a_second_reader_is_not_folded() {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let key: Key = "b2q1s0".parse().unwrap();
    let kv = kv_for(&spec, key);
    let mut plain = spec.graph(key, &kv, false);
    // Layer 0's o_proj product and its input norm become outputs.
    let wo = plain
        .weight("model.layers.0.self_attn.o_proj.weight")
        .unwrap();
    let o = plain
        .nodes
        .iter()
        .find(|n| matches!(n.op, Op::MatMul { .. }) && n.args[1] == wo)
        .unwrap()
        .results[0];
    let norm0 = plain
        .nodes
        .iter()
        .find(|n| matches!(n.op, Op::RmsNorm { .. }))
        .unwrap()
        .results[0];
    plain.add_output("probe_o", o);
    plain.add_output("probe_norm", norm0);
    let (g, m, s) = pipeline(&spec, plain.clone(), &DEFAULT_PIPELINE, &Target::Cpu);
    let l = spec.layers as usize;
    // Layer 0 loses its o_proj residual and therefore its gate_up norm (the
    // add_rms_norm stays whole), and its qkv norm; the lm_head gains its
    // argmax.
    assert_eq!(s.matmul_epilogues as usize, 3 * l - 1 + 1);
    assert_eq!(s.matmul_prologues as usize, 2 * l + 1 - 2);
    assert_eq!(count(&g, |o| matches!(o, Op::AddRmsNorm { .. })), 1);
    assert_eq!(count(&g, |o| matches!(o, Op::RmsNorm { .. })), 1);
    assert_eq!(count(&g, |o| matches!(o, Op::MatMul { .. })), 2);
    let mut rng = Rng::new(12);
    let ck = random_checkpoint(&spec.manifest(), &mut rng);
    let inp = random_inputs(key, &kv, spec.vocab, 64, &mut rng);
    assert_eq!(
        eval_graph(&g, &m, &ck, &inp),
        eval_graph(&plain, &spec.manifest(), &ck, &inp)
    );
}

#[test]
fn a_gpu_target_fuses_only_keys_its_fused_gemv_runs() {
    let spec = SynthSpec::tiny(SynthFamily::Qwen2);
    let cuda = Target::Cuda { sm: 90 };
    for (key, fuses) in [
        ("b8q1s0", false),
        ("b1q1s0", true),
        ("b3q3s0", false),
        ("b16q1s0", false),
    ] {
        let key: Key = key.parse().unwrap();
        let g = spec.graph(key, &kv_for(&spec, key), false);
        let (g, _, s) = pipeline(&spec, g, &DEFAULT_PIPELINE, &cuda);
        let any = count(&g, |o| matches!(o, Op::FusedMatMul { .. }));
        assert_eq!(any > 0, fuses, "{key}: {s:?}");
        if !fuses {
            // The unfused graph is exactly what the pipeline gave before.
            let g0 = spec.graph(key, &kv_for(&spec, key), false);
            let (g0, _, _) = pipeline(&spec, g0, &without_fuse_matmul(), &cuda);
            assert_eq!(kiln_ir::print(&g), kiln_ir::print(&g0), "{key}");
        }
    }
    // An f32 model has no fused GEMV on a GPU, but fuses on the CPU.
    let spec = SynthSpec {
        dtype: kiln_ir::DType::F32,
        ..SynthSpec::tiny(SynthFamily::Llama)
    };
    let key: Key = "b1q1s0".parse().unwrap();
    let g = spec.graph(key, &kv_for(&spec, key), false);
    let (gg, _, _) = pipeline(&spec, g.clone(), &DEFAULT_PIPELINE, &cuda);
    assert_eq!(count(&gg, |o| matches!(o, Op::FusedMatMul { .. })), 0);
    let mut m = spec.manifest();
    let (gc, _, _) = run_pipeline(g, &mut m, &DEFAULT_PIPELINE, true).unwrap();
    assert!(count(&gc, |o| matches!(o, Op::FusedMatMul { .. })) > 0);
}

/// The lm_head + argmax of a greedy plan becomes one `fused_matmul{argmax}`
/// (with the final norm as its prologue) on the CPU and on a one-token CUDA
/// key, and the step's tokens are exactly the unfused step's; with the
/// logits an output, or read by a second op, the argmax stays separate.
#[test]
fn the_greedy_argmax_joins_the_lm_head_only_when_nothing_else_reads_the_logits() {
    let argmax_fused = |g: &Graph| fused_with(g, true, Epilogue::Argmax);
    let mut rng = Rng::new(1517);
    for fam in FAMILIES {
        let spec = SynthSpec::tiny(fam);
        let mut all_tokens = Vec::new();
        for key in keys("b1q1s0,b3q1s0,b2q3s2,b2q4s0") {
            let kv = kv_for(&spec, key);
            let plain = spec.graph(key, &kv, false);
            let (a, ma, _) = pipeline(&spec, plain.clone(), &without_fuse_matmul(), &Target::Cpu);
            let (b, mb, _) = pipeline(&spec, plain.clone(), &DEFAULT_PIPELINE, &Target::Cpu);
            // gather_last keys (b2q4s0) keep their final norm unfused, so the
            // argmax joins a prologue-less lm_head there.
            let joined = count(&b, |o| {
                matches!(
                    o,
                    Op::FusedMatMul {
                        post: Epilogue::Argmax,
                        ..
                    }
                )
            });
            assert_eq!(joined, 1, "{fam:?} {key}: {}", kiln_ir::print(&b));
            assert_eq!(count(&b, |o| *o == Op::Argmax), 0, "{fam:?} {key}");
            let ck = random_checkpoint(&spec.manifest(), &mut rng);
            let inp = random_inputs(key, &kv, spec.vocab, 64, &mut rng);
            let want = eval_graph(&a, &ma, &ck, &inp);
            let got = eval_graph(&b, &mb, &ck, &inp);
            assert_eq!(got.outputs, want.outputs, "{fam:?} {key}");
            assert!(got.caches == want.caches, "{fam:?} {key}: caches differ");
            let toks = &got.outputs.iter().find(|o| o.0 == "next_tokens").unwrap().1;
            all_tokens.extend(toks.iter().copied());
        }
        // The tokens vary over rows and keys (the comparison is not vacuous).
        assert!(
            all_tokens.iter().any(|&v| v != all_tokens[0]),
            "{fam:?}: {all_tokens:?}"
        );
        // With the logits an output, the lm_head keeps its logits.
        let key: Key = "b1q1s0".parse().unwrap();
        let kv = kv_for(&spec, key);
        let (g, _, _) = pipeline(
            &spec,
            spec.graph(key, &kv, true),
            &DEFAULT_PIPELINE,
            &Target::Cpu,
        );
        assert_eq!(
            count(&g, |o| matches!(
                o,
                Op::FusedMatMul {
                    post: Epilogue::Argmax,
                    ..
                }
            )),
            0
        );
        assert_eq!(count(&g, |o| *o == Op::Argmax), 1, "{fam:?}");
        // A second reader of the logits: a second argmax, also an output.
        let mut probed = spec.graph(key, &kv, false);
        let am = probed.nodes.iter().find(|n| n.op == Op::Argmax).unwrap();
        let logits = am.args[0];
        let probe = probed.push(Op::Argmax, &[logits])[0];
        probed.add_output("probe_tokens", probe);
        let (g, _, _) = pipeline(&spec, probed, &DEFAULT_PIPELINE, &Target::Cpu);
        assert_eq!(argmax_fused(&g), 0, "{fam:?}");
        assert_eq!(count(&g, |o| *o == Op::Argmax), 2, "{fam:?}");
        // A one-token CUDA key fuses it, an eight-token one does not.
        let cuda = Target::Cuda { sm: 90 };
        for (key, fuses) in [("b1q1s0", 1), ("b8q1s0", 0)] {
            let key: Key = key.parse().unwrap();
            let kv = kv_for(&spec, key);
            let (g, _, _) = pipeline(&spec, spec.graph(key, &kv, false), &DEFAULT_PIPELINE, &cuda);
            assert_eq!(argmax_fused(&g), fuses, "{fam:?} {key}");
        }
    }
}

/// The graph schedule's default GPU rule (`fuse-matmul-graph`) fuses every
/// dense one-token GEMV of the layers but leaves the dense lm_head plain:
/// the final rms_norm, the matmul and the argmax stay three ops (measured
/// faster than the fused register GEMV, `FuseRule::dense_lm_head`), while
/// `fuse-matmul` (`--fused-gemv`) folds both into it.
#[test]
fn the_default_gpu_rule_fuses_the_layers_but_not_the_dense_lm_head() {
    let cuda = Target::Cuda { sm: 90 };
    for fam in FAMILIES {
        let spec = SynthSpec::tiny(fam);
        let key: Key = "b1q1s0".parse().unwrap();
        let kv = kv_for(&spec, key);
        let (g, _, _) = pipeline(
            &spec,
            spec.graph(key, &kv, false),
            &default_pipeline_with(Pass::FuseMatMulGraph),
            &cuda,
        );
        assert!(fused_with(&g, true, Epilogue::SiluMul) > 0, "{fam:?}");
        assert!(fused_with(&g, false, Epilogue::Residual) > 0, "{fam:?}");
        assert_eq!(
            count(&g, |o| matches!(
                o,
                Op::FusedMatMul {
                    post: Epilogue::Argmax,
                    ..
                }
            )),
            0,
            "{fam:?}"
        );
        assert_eq!(count(&g, |o| *o == Op::Argmax), 1, "{fam:?}");
        assert_eq!(
            count(&g, |o| matches!(o, Op::RmsNorm { .. })),
            1,
            "{fam:?}: only the final norm stays: {}",
            kiln_ir::print(&g)
        );
        let (g, _, _) = pipeline(
            &spec,
            spec.graph(key, &kv, false),
            &default_pipeline_with(Pass::FuseMatMul),
            &cuda,
        );
        assert_eq!(fused_with(&g, true, Epilogue::Argmax), 1, "{fam:?}");
        assert_eq!(count(&g, |o| *o == Op::Argmax), 0, "{fam:?}");
    }
}

/// With the projections kept quantized (FP8 here), the graph schedule's
/// default GPU rule (`fuse-matmul-graph`) fuses the residual and SiLU*up
/// epilogues of keys of up to eight tokens, and past one token an
/// RMSNorm prologue only where K <= 1024 (the b8 A/B of
/// bench/results/gpu-2026-12-06-s26/); keys of more tokens stay unfused.
#[test]
fn quantized_keys_of_up_to_eight_tokens_fuse_epilogues_and_only_narrow_prologues() {
    let cuda = Target::Cuda { sm: 90 };
    let passes = default_pipeline_with(Pass::FuseMatMulGraph);
    for hidden in [1024u32, 2048] {
        let spec = SynthSpec {
            hidden,
            intermediate: 64,
            ..SynthSpec::tiny(SynthFamily::Llama)
        };
        for (key, epilogues, prologues) in [
            ("b1q1s0", true, true),
            ("b8q1s0", true, hidden <= 1024),
            ("b3q1s0", true, hidden <= 1024),
            ("b16q1s0", false, false),
        ] {
            let key: Key = key.parse().unwrap();
            let mut g = spec.graph(key, &kv_for(&spec, key), false);
            let mut m = spec.manifest();
            for &w in &g.weights.clone() {
                let quantize = matches!(&g.value(w).def, kiln_ir::ValueDef::Weight(n)
                    if n.ends_with("_proj.weight") || n == "lm_head.weight");
                if quantize {
                    g.values[w.0 as usize].ty.storage = Some(kiln_ir::QuantType::Fp8E4M3);
                }
            }
            for e in &mut m.entries {
                if e.name.ends_with("_proj.weight") || e.name == "lm_head.weight" {
                    e.storage = Some(kiln_ir::QuantType::Fp8E4M3);
                }
            }
            let (g, _, s) =
                run_pipeline_for(g, &mut m, &passes, true, &cuda).unwrap_or_else(|e| panic!("{e}"));
            let what = format!("hidden {hidden} {key}: {s:?}");
            let post = |e: Epilogue| {
                count(
                    &g,
                    |o| matches!(o, Op::FusedMatMul { post, .. } if *post == e),
                )
            };
            let layers = spec.layers as usize;
            let want = |on: bool, n: usize| if on { n } else { 0 };
            assert_eq!(post(Epilogue::SiluMul), want(epilogues, layers), "{what}");
            assert!((post(Epilogue::Residual) > 0) == epilogues, "{what}");
            let pre = count(&g, |o| matches!(o, Op::FusedMatMul { pre: Some(_), .. }));
            assert_eq!(pre > 0, prologues, "{what}");
        }
    }
}

/// `KILN_FUSE_QUANT` names the multi-token part of the rule or is refused
/// with what it takes.
#[test]
fn the_quantized_fusion_override_takes_one_epi_all_or_a_width_and_refuses_the_rest() {
    use kiln_compiler::passes::quant_fuse_override as o;
    assert_eq!(o(None), Ok(None));
    assert_eq!(o(Some(" ")), Ok(None));
    assert_eq!(o(Some("one")), Ok(Some((1, 0))));
    assert_eq!(o(Some("epi")), Ok(Some((u32::MAX, 0))));
    assert_eq!(o(Some("all")), Ok(Some((u32::MAX, u64::MAX))));
    assert_eq!(o(Some("2048")), Ok(Some((u32::MAX, 2048))));
    let e = o(Some("most")).unwrap_err();
    assert!(
        e.contains("KILN_FUSE_QUANT=most is not") && e.contains("one, epi, all"),
        "{e}"
    );
}

/// `KILN_FUSE_DENSE` names the most tokens of a dense fused key, from one
/// to the fused kernels' eight, optionally with the largest K of a
/// multi-token RMSNorm prologue, or is refused with what it takes.
#[test]
fn the_dense_fusion_override_takes_a_token_count_up_to_eight_and_refuses_the_rest() {
    use kiln_compiler::passes::dense_fuse_override as o;
    assert_eq!(o(None), Ok(None));
    assert_eq!(o(Some("")), Ok(None));
    assert_eq!(o(Some("1")), Ok(Some((1, u64::MAX))));
    assert_eq!(o(Some(" 8 ")), Ok(Some((8, u64::MAX))));
    assert_eq!(o(Some("8:1024")), Ok(Some((8, 1024))));
    assert_eq!(o(Some("8:0")), Ok(Some((8, 0))));
    for bad in ["0", "9", "all", "8:", "8:big", ":1024"] {
        let e = o(Some(bad)).unwrap_err();
        assert!(
            e.contains(&format!("KILN_FUSE_DENSE={bad} is not")) && e.contains("from 1 to 8"),
            "{e}"
        );
    }
}

/// Marks the q/k/v projections (and, with `all`, every projection) as
/// stored `q` in the graph and the manifest.
fn quantize_projections(g: &mut Graph, m: &mut WeightManifest, q: kiln_ir::QuantType, all: bool) {
    let pick = |n: &str| {
        ["q_proj.weight", "k_proj.weight", "v_proj.weight"]
            .iter()
            .any(|s| n.ends_with(s))
            || (all && n.ends_with("_proj.weight"))
    };
    for &w in &g.weights.clone() {
        if matches!(&g.value(w).def, kiln_ir::ValueDef::Weight(n) if pick(n)) {
            g.values[w.0 as usize].ty.storage = Some(q);
        }
    }
    for e in &mut m.entries {
        if pick(&e.name) {
            e.storage = Some(q);
        }
    }
}

/// `fuse-matmul-qkv-rope` joins the packed q/k/v projection (with its
/// RMSNorm prologue) and `qkv_rope_kv_write` into `matmul_qkv_rope` on
/// every layer where the target runs it: one-token CUDA keys over Q8_0 /
/// Q4_K weights (the integer-dot GEMV's types) or a dense bf16 weight
/// (kiln's GEMV), and the CPU for weights kept quantized; never a dense
/// CPU projection, a multi-token GPU key, an FP8 weight (no integer-dot
/// kernel) or HIP.
#[test]
fn the_packed_qkv_projection_and_its_rope_become_one_op_where_the_target_runs_it() {
    let cuda = Target::Cuda { sm: 90 };
    let hip = Target::Hip {
        gfx: "gfx90a".into(),
    };
    let spec = SynthSpec {
        hidden: 256,
        intermediate: 64,
        head_dim: 32,
        ..SynthSpec::tiny(SynthFamily::Qwen3)
    };
    let layers = spec.layers as usize;
    for (target, key, q, want) in [
        (&cuda, "b1q1s0", Some(kiln_ir::QuantType::Q8_0), layers),
        (&cuda, "b1q1s0", Some(kiln_ir::QuantType::Q4K), layers),
        (&cuda, "b8q1s0", Some(kiln_ir::QuantType::Q8_0), 0),
        (&cuda, "b1q1s0", Some(kiln_ir::QuantType::Fp8E4M3), 0),
        // Dense bf16: kiln's one-token GEMV has the rope entries too.
        (&cuda, "b1q1s0", None, layers),
        (&hip, "b1q1s0", Some(kiln_ir::QuantType::Q8_0), 0),
        (
            &Target::Cpu,
            "b1q1s0",
            Some(kiln_ir::QuantType::Q8_0),
            layers,
        ),
        (
            &Target::Cpu,
            "b3q1s0",
            Some(kiln_ir::QuantType::Q4_0),
            layers,
        ),
        (&Target::Cpu, "b1q1s0", None, 0),
    ] {
        let key: Key = key.parse().unwrap();
        let mut g = spec.graph(key, &kv_for(&spec, key), false);
        let mut m = spec.manifest();
        if let Some(q) = q {
            quantize_projections(&mut g, &mut m, q, false);
        }
        let passes: Vec<Pass> = DEFAULT_PIPELINE
            .iter()
            .map(|&p| match p {
                Pass::FuseMatMul if !matches!(target, Target::Cpu) => Pass::FuseMatMulQuant,
                p => p,
            })
            .collect();
        let (g, _, s) =
            run_pipeline_for(g, &mut m, &passes, true, target).unwrap_or_else(|e| panic!("{e}"));
        let what = format!("{target:?} {key} {q:?}");
        let fused = count(&g, |o| matches!(o, Op::MatMulQkvRope { .. }));
        assert_eq!(fused, want, "{what}");
        assert_eq!(s.matmul_qkv_rope as usize, want, "{what}");
        let left = count(&g, |o| matches!(o, Op::QkvRopeKvWrite { .. }));
        assert_eq!(left, layers - want, "{what}");
        if matches!(target, Target::Cpu) {
            // The CPU fuses every norm, so each fused op keeps its prologue
            // (on the GPU only where the norm before it is fusable: here the
            // dense o/down projections keep layer 1's add_rms_norm).
            assert_eq!(
                count(&g, |o| matches!(o, Op::MatMulQkvRope { pre: Some(_), .. })),
                want,
                "{what}"
            );
        }
        // The text form round-trips the fused op.
        let text = kiln_ir::print(&g);
        assert_eq!(text.matches("matmul_qkv_rope {").count(), want, "{what}");
        let back = kiln_ir::parse(&text).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(kiln_ir::print(&back), text, "{what}");
    }
}

/// The fused op computes exactly what the projection and
/// `qkv_rope_kv_write` compute: the step evaluated by the reference
/// interpreter (the fused op through its definition) with and without the
/// pass, quantized projections read as their f32 values (the interpreter
/// ignores storage, so only the graph's structure differs).
#[test]
fn the_matmul_qkv_rope_step_computes_exactly_what_the_pair_computes() {
    let mut rng = Rng::new(1616);
    for fam in FAMILIES {
        let spec = SynthSpec::tiny(fam);
        for key in keys("b1q1s0,b2q3s2") {
            let kv = kv_for(&spec, key);
            let mut plain = spec.graph(key, &kv, true);
            let mut m0 = spec.manifest();
            quantize_projections(&mut plain, &mut m0, kiln_ir::QuantType::Q8_0, false);
            let without: Vec<Pass> = DEFAULT_PIPELINE
                .iter()
                .copied()
                .filter(|p| *p != Pass::FuseMatMulQkvRope)
                .collect();
            let run = |passes: &[Pass]| {
                let mut m = m0.clone();
                let (g, _, s) = run_pipeline_for(plain.clone(), &mut m, passes, true, &Target::Cpu)
                    .unwrap_or_else(|e| panic!("{e}"));
                kiln_compiler::passes::weights::prune(&mut m, &[&g]);
                (g, m, s)
            };
            let (a, ma, _) = run(&without);
            let (b, mb, s) = run(&DEFAULT_PIPELINE);
            assert_eq!(s.matmul_qkv_rope, spec.layers, "{fam:?} {key}");
            let ck = random_checkpoint(&spec.manifest(), &mut rng);
            let inp = random_inputs(key, &kv, spec.vocab, 64, &mut rng);
            let want = eval_graph(&a, &ma, &ck, &inp);
            let got = eval_graph(&b, &mb, &ck, &inp);
            assert_eq!(got.outputs, want.outputs, "{fam:?} {key}");
            assert!(got.caches == want.caches, "{fam:?} {key}: caches differ");
        }
    }
}
