//! The pass pipeline: fusions preserve the step's function, fire where they
//! are legal and only there, leave a manifest of exactly what is read, and
//! produce canonical graphs.

mod planner_support;

use kiln_compiler::passes::synth::{SynthFamily, SynthSpec};
use kiln_compiler::passes::{run_pass, run_pipeline, Pass, PassError, PassStats, DEFAULT_PIPELINE};
use kiln_ir::{
    DType, Graph, InputRole, Key, Op, TensorType, ValueDef, WeightManifest, WeightSource,
};
use planner_support::*;
use std::collections::BTreeSet;

const FAMILIES: [SynthFamily; 3] = [SynthFamily::Llama, SynthFamily::Qwen2, SynthFamily::Qwen3];

fn kv_for(spec: &SynthSpec, key: Key) -> kiln_ir::plan::KvLayout {
    // Room for every row to reach the 64-token context.
    spec.kv_layout(16, key.batch * 4 + 1, 64)
}

fn fused(spec: &SynthSpec, g: Graph) -> (Graph, WeightManifest, kiln_compiler::passes::PassStats) {
    let mut m = spec.manifest();
    let (g, _, s) =
        run_pipeline(g, &mut m, &DEFAULT_PIPELINE, true).unwrap_or_else(|e| panic!("{e}"));
    kiln_compiler::passes::weights::prune(&mut m, &[&g]);
    (g, m, s)
}

fn count(g: &Graph, f: impl Fn(&Op) -> bool) -> usize {
    g.nodes.iter().filter(|n| f(&n.op)).count()
}

#[test]
fn fusions_compute_the_same_function_as_the_traced_graph() {
    let mut rng = Rng::new(7);
    for fam in FAMILIES {
        let spec = SynthSpec::tiny(fam);
        for key in keys("b1q1s0,b3q1s0,b2q3s2,b2q4s0") {
            let kv = kv_for(&spec, key);
            let plain = spec.graph(key, &kv, true);
            let (g, m, _) = fused(&spec, plain.clone());
            let ck = random_checkpoint(&spec.manifest(), &mut rng);
            let inp = random_inputs(key, &kv, spec.vocab, 64, &mut rng);
            let want = eval_graph(&plain, &spec.manifest(), &ck, &inp);
            let got = eval_graph(&g, &m, &ck, &inp);
            assert_eq!(got.outputs.len(), want.outputs.len());
            for ((n, a), (_, b)) in got.outputs.iter().zip(&want.outputs) {
                assert!(a == b, "{fam:?} {key}: output `{n}` differs after fusion");
            }
            assert!(
                got.caches == want.caches,
                "{fam:?} {key}: KV caches differ after fusion"
            );
            // The step did write the caches (the comparison is not vacuous).
            assert!(
                got.caches != inp.caches,
                "{fam:?} {key}: the step wrote nothing"
            );
        }
    }
}

#[test]
fn a_wrongly_stacked_weight_changes_the_result() {
    // The function-preservation check above is sensitive: stacking k before
    // q in the fused weight gives different tokens.
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let key: Key = "b2q1s0".parse().unwrap();
    let kv = kv_for(&spec, key);
    let plain = spec.graph(key, &kv, true);
    let (g, mut m, _) = fused(&spec, plain.clone());
    let e = m
        .entries
        .iter_mut()
        .find(|e| e.name == "model.layers.0.self_attn.qkv_proj.weight")
        .unwrap();
    let WeightSource::ConcatRows(parts) = &mut e.source else {
        panic!("not stacked")
    };
    parts.swap(0, 1);
    let mut rng = Rng::new(3);
    let ck = random_checkpoint(&spec.manifest(), &mut rng);
    let inp = random_inputs(key, &kv, spec.vocab, 64, &mut rng);
    // The swapped parts have different row counts (q: 32, k: 16), so
    // materializing still works but the layout is wrong.
    let want = eval_graph(&plain, &spec.manifest(), &ck, &inp);
    let got = eval_graph(&g, &m, &ck, &inp);
    assert_ne!(got.outputs, want.outputs);
}

#[test]
fn every_layer_is_fused_once_and_the_manifest_holds_exactly_what_graphs_read() {
    // The fusions before `fuse-matmul` (which tests/fuse_matmul.rs covers).
    let passes: Vec<Pass> = DEFAULT_PIPELINE
        .iter()
        .copied()
        .filter(|p| *p != Pass::FuseMatMul)
        .collect();
    for fam in FAMILIES {
        let spec = SynthSpec::tiny(fam);
        let key: Key = "b2q1s0".parse().unwrap();
        let mut m = spec.manifest();
        let (g, _, s) = run_pipeline(
            spec.graph(key, &kv_for(&spec, key), false),
            &mut m,
            &passes,
            true,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        kiln_compiler::passes::weights::prune(&mut m, &[&g]);
        let l = spec.layers as usize;
        // Two add+norm pairs per layer; the first layer's input norm follows
        // the embedding, not an add, and the final norm follows the last add.
        assert_eq!(s.add_rms_norm as usize, 2 * l, "{fam:?}");
        assert_eq!(s.qkv_rope_kv_write as usize, l);
        assert_eq!(s.gate_up as usize, l);
        assert_eq!(count(&g, |o| matches!(o, Op::QkvRopeKvWrite { .. })), l);
        assert_eq!(
            count(&g, |o| matches!(
                o,
                Op::Rope { .. } | Op::KvWrite | Op::HeadRmsNorm { .. } | Op::Add
            )),
            0
        );
        assert_eq!(count(&g, |o| matches!(o, Op::RmsNorm { .. })), 1);
        // Per layer: qkv, o, gate_up, down; plus lm_head.
        assert_eq!(count(&g, |o| matches!(o, Op::MatMul { .. })), 4 * l + 1);
        for n in &g.nodes {
            if let Op::QkvRopeKvWrite { qk_norm, .. } = &n.op {
                assert_eq!(qk_norm.is_some(), fam == SynthFamily::Qwen3);
            }
            if n.op == Op::SiluMul {
                assert_eq!(n.args.len(), 1);
            }
        }
        let read: BTreeSet<String> = g
            .weights
            .iter()
            .map(|&w| match &g.value(w).def {
                ValueDef::Weight(n) => n.clone(),
                _ => unreachable!(),
            })
            .collect();
        let listed: BTreeSet<String> = m.entries.iter().map(|e| e.name.clone()).collect();
        assert_eq!(read, listed, "{fam:?}");
        let qkv = m.get("model.layers.1.self_attn.qkv_proj.weight").unwrap();
        let names: Vec<&str> = qkv
            .source
            .parts()
            .iter()
            .map(|t| t.tensor.as_str())
            .collect();
        assert_eq!(
            names,
            [
                "model.layers.1.self_attn.q_proj.weight",
                "model.layers.1.self_attn.k_proj.weight",
                "model.layers.1.self_attn.v_proj.weight"
            ]
        );
        assert_eq!(
            qkv.shape.dims(),
            [
                (spec.heads + 2 * spec.kv_heads) * spec.head_dim,
                spec.hidden
            ]
        );
        assert_eq!(
            m.get("model.layers.0.self_attn.qkv_proj.bias").is_some(),
            fam == SynthFamily::Qwen2
        );
        let gu = m.get("model.layers.0.mlp.gate_up_proj.weight").unwrap();
        assert_eq!(
            gu.source.parts()[0].tensor,
            "model.layers.0.mlp.gate_proj.weight"
        );
        assert_eq!(gu.shape.dims(), [2 * spec.intermediate, spec.hidden]);
        assert!(m.get("model.layers.0.mlp.up_proj.weight").is_none());
    }
}

/// The first node whose op is a matmul reading weight `name`.
fn matmul_reading(g: &Graph, name: &str) -> kiln_ir::ValueId {
    let w = g.weight(name).unwrap();
    g.nodes
        .iter()
        .find(|n| matches!(n.op, Op::MatMul { .. }) && n.args[1] == w)
        .unwrap()
        .results[0]
}

#[test]
fn fusion_is_skipped_when_an_intermediate_has_another_reader() {
    let spec = SynthSpec::tiny(SynthFamily::Qwen3);
    let key: Key = "b2q1s0".parse().unwrap();
    let kv = kv_for(&spec, key);
    let mut plain = spec.graph(key, &kv, false);
    // Layer 0's gate projection and k projection become outputs: neither
    // the gate/up nor the qkv fusion may swallow them.
    let gate = matmul_reading(&plain, "model.layers.0.mlp.gate_proj.weight");
    let k = matmul_reading(&plain, "model.layers.0.self_attn.k_proj.weight");
    plain.add_output("probe_gate", gate);
    plain.add_output("probe_k", k);
    let (g, m, s) = fused(&spec, plain.clone());
    assert_eq!(s.gate_up, spec.layers - 1);
    assert_eq!(s.qkv_rope_kv_write, spec.layers - 1);
    assert!(m.get("model.layers.0.mlp.gate_up_proj.weight").is_none());
    assert!(m.get("model.layers.0.mlp.gate_proj.weight").is_some());
    assert!(m.get("model.layers.1.mlp.gate_up_proj.weight").is_some());
    // And the graph still means the same thing, probes included.
    let mut rng = Rng::new(11);
    let ck = random_checkpoint(&spec.manifest(), &mut rng);
    let inp = random_inputs(key, &kv, spec.vocab, 64, &mut rng);
    assert_eq!(
        eval_graph(&g, &m, &ck, &inp),
        eval_graph(&plain, &spec.manifest(), &ck, &inp)
    );
}

#[test]
fn dead_code_is_removed_and_value_ids_are_dense_and_canonical() {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let key: Key = "b1q1s0".parse().unwrap();
    let kv = kv_for(&spec, key);
    let mut g = spec.graph(key, &kv, false);
    let live_nodes = g.nodes.len();
    // A dead chain: a projection nobody reads, and a norm of it.
    let x = matmul_reading(&g, "model.layers.1.mlp.down_proj.weight");
    let w = g.weight("model.layers.0.self_attn.o_proj.weight").unwrap();
    let dead = g.push1(
        Op::MatMul {
            bias: false,
            out: DType::BF16,
        },
        &[x, w],
    );
    let lnw = g.weight("model.norm.weight").unwrap();
    g.push1(
        Op::RmsNorm {
            eps: 1e-6,
            unit_offset: false,
        },
        &[dead, lnw],
    );
    let mut m = spec.manifest();
    let (out, _, _) = run_pipeline(g, &mut m, &[Pass::Dce], true).unwrap();
    assert_eq!(out.nodes.len(), live_nodes);
    // Inputs, then weights in order of first use, then results in order.
    let n_in = out.inputs.len();
    let n_w = out.weights.len();
    assert_eq!(
        out.inputs,
        (0..n_in as u32).map(kiln_ir::ValueId).collect::<Vec<_>>()
    );
    assert_eq!(
        out.weights,
        (n_in as u32..(n_in + n_w) as u32)
            .map(kiln_ir::ValueId)
            .collect::<Vec<_>>()
    );
    let mut next = (n_in + n_w) as u32;
    for n in &out.nodes {
        for r in &n.results {
            assert_eq!(r.0, next);
            next += 1;
        }
    }
    assert_eq!(next as usize, out.values.len());
    // A KV write nobody reads still writes the cache: it is kept. (A graph
    // with no outputs is not valid IR, so the pass runs alone, unverified.)
    let mut only_write = Graph::new("only a kv write");
    let cache = TensorType::new(DType::BF16, [32, 16]);
    let kc = only_write.add_input(InputRole::KCache(0), cache.clone());
    let vc = only_write.add_input(InputRole::VCache(0), cache);
    let slots = only_write.add_input(InputRole::SlotMapping, TensorType::new(DType::I32, [2]));
    let rows = only_write.add_weight("rows", TensorType::new(DType::BF16, [2, 16]));
    only_write.push(Op::KvWrite, &[rows, rows, slots, kc, vc]);
    let out = run_pass(
        Pass::Dce,
        only_write,
        &mut WeightManifest::default(),
        &mut PassStats::default(),
    )
    .unwrap();
    assert_eq!(out.nodes.len(), 1);
}

#[test]
fn passes_are_deterministic_whatever_the_weight_declaration_order() {
    let spec = SynthSpec::tiny(SynthFamily::Qwen2);
    let key: Key = "b2q1s0".parse().unwrap();
    let kv = kv_for(&spec, key);
    let g = spec.graph(key, &kv, true);
    let (a, ma, _) = fused(&spec, g.clone());
    let (b, mb, _) = fused(&spec, g.clone());
    assert_eq!(a, b);
    assert_eq!(ma, mb);
    // Same graph with weights declared in reverse order.
    let mut r = g.clone();
    r.weights.reverse();
    let (c, _, _) = fused(&spec, r);
    assert_eq!(a, c);
}

#[test]
fn a_fused_weight_name_collision_names_the_pass() {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let key: Key = "b1q1s0".parse().unwrap();
    let g = spec.graph(key, &kv_for(&spec, key), false);
    let mut m = spec.manifest();
    // A checkpoint that already has a (different) tensor of the fused name.
    let mut squatter = m
        .get("model.layers.0.self_attn.o_proj.weight")
        .unwrap()
        .clone();
    squatter.name = "model.layers.0.self_attn.qkv_proj.weight".into();
    m.entries.push(squatter);
    let e = run_pipeline(g, &mut m, &DEFAULT_PIPELINE, true).unwrap_err();
    assert!(
        matches!(
            e,
            PassError::Failed {
                pass: Pass::FuseQkvRopeKvWrite,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("fuse-qkv-rope-kv-write"), "{e}");
}

#[test]
fn a_malformed_traced_graph_is_rejected_before_any_pass() {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let key: Key = "b1q1s0".parse().unwrap();
    let mut g = spec.graph(key, &kv_for(&spec, key), false);
    // Read a value before it is defined.
    let last = g.nodes.len() - 1;
    let late = g.nodes[last].results[0];
    g.nodes[1].args[0] = late;
    let mut m = spec.manifest();
    let e = run_pipeline(g.clone(), &mut m, &DEFAULT_PIPELINE, true).unwrap_err();
    assert!(matches!(e, PassError::BadInput { .. }), "{e}");
    assert!(e.to_string().contains("node1 (`rms_norm`)"), "{e}");
    // A weight missing from the manifest.
    let g = spec.graph(key, &kv_for(&spec, key), false);
    let mut m = spec.manifest();
    m.entries.retain(|e| e.name != "model.norm.weight");
    let e = run_pipeline(g, &mut m, &DEFAULT_PIPELINE, true).unwrap_err();
    assert!(e.to_string().contains("model.norm.weight"), "{e}");
}

/// The fusions up to `fuse-rope-attention` (no `fuse-matmul`), for `target`.
fn fused_for(
    spec: &SynthSpec,
    g: Graph,
    target: &kiln_ir::plan::Target,
) -> (Graph, WeightManifest, PassStats) {
    let passes = [
        Pass::Dce,
        Pass::FuseAddRmsNorm,
        Pass::FuseQkvRopeKvWrite,
        Pass::FuseRopeAttention,
        Pass::FuseGateUp,
    ];
    let mut m = spec.manifest();
    let (g, _, s) = kiln_compiler::passes::run_pipeline_for(g, &mut m, &passes, true, target)
        .unwrap_or_else(|e| panic!("{e}"));
    kiln_compiler::passes::weights::prune(&mut m, &[&g]);
    (g, m, s)
}

#[test]
fn rope_attention_fuses_every_layer_on_gpu_targets_and_computes_the_same_function() {
    let gpu = kiln_ir::plan::Target::Cuda { sm: 90 };
    let mut rng = Rng::new(41);
    for fam in FAMILIES {
        let spec = SynthSpec::tiny(fam);
        for key in keys("b1q1s0,b3q1s0,b2q3s2,b2q4s0") {
            let kv = kv_for(&spec, key);
            let plain = spec.graph(key, &kv, true);
            let (g, m, s) = fused_for(&spec, plain.clone(), &gpu);
            let l = spec.layers as usize;
            assert_eq!(s.rope_attention as usize, l, "{fam:?} {key}");
            assert_eq!(count(&g, |o| matches!(o, Op::RopeAttention { .. })), l);
            assert_eq!(
                count(&g, |o| matches!(
                    o,
                    Op::QkvRopeKvWrite { .. } | Op::PagedAttention(..)
                )),
                0,
                "{fam:?} {key}"
            );
            // One fewer op per layer than the unfused pipeline's.
            let (cpu_g, _, _) = fused_for(&spec, plain.clone(), &kiln_ir::plan::Target::Cpu);
            assert_eq!(cpu_g.nodes.len(), g.nodes.len() + l, "{fam:?} {key}");
            let ck = random_checkpoint(&spec.manifest(), &mut rng);
            let inp = random_inputs(key, &kv, spec.vocab, 64, &mut rng);
            let want = eval_graph(&plain, &spec.manifest(), &ck, &inp);
            let got = eval_graph(&g, &m, &ck, &inp);
            for ((n, a), (_, b)) in got.outputs.iter().zip(&want.outputs) {
                assert!(a == b, "{fam:?} {key}: output `{n}` differs after fusion");
            }
            assert!(got.caches == want.caches, "{fam:?} {key}: caches differ");
            assert!(got.caches != inp.caches, "{fam:?} {key}: nothing written");
        }
    }
}

#[test]
fn rope_attention_is_not_formed_for_the_cpu_nor_when_the_roped_q_has_another_reader() {
    let spec = SynthSpec::tiny(SynthFamily::Qwen3);
    let key: Key = "b2q1s0".parse().unwrap();
    let kv = kv_for(&spec, key);
    let plain = spec.graph(key, &kv, false);
    let (g, _, s) = fused_for(&spec, plain.clone(), &kiln_ir::plan::Target::Cpu);
    assert_eq!(s.rope_attention, 0);
    assert_eq!(count(&g, |o| matches!(o, Op::RopeAttention { .. })), 0);
    // Layer 0's roped q becomes an output: that layer keeps the pair.
    let mut m = spec.manifest();
    let passes = [Pass::Dce, Pass::FuseAddRmsNorm, Pass::FuseQkvRopeKvWrite];
    let (mut g, _, _) =
        run_pipeline(plain, &mut m, &passes, true).unwrap_or_else(|e| panic!("{e}"));
    let q0 = g
        .nodes
        .iter()
        .find(|n| matches!(n.op, Op::QkvRopeKvWrite { .. }))
        .unwrap()
        .results[0];
    g.add_output("probe_q", q0);
    let gpu = kiln_ir::plan::Target::Cuda { sm: 90 };
    let mut s = PassStats::default();
    let g = kiln_compiler::passes::run_pass_for(Pass::FuseRopeAttention, g, &mut m, &mut s, &gpu)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.rope_attention, spec.layers - 1);
    assert_eq!(count(&g, |o| matches!(o, Op::QkvRopeKvWrite { .. })), 1);
    assert_eq!(count(&g, |o| matches!(o, Op::PagedAttention(..))), 1);
    kiln_ir::verify(&g, Some(&m)).unwrap_or_else(|e| panic!("{e:?}"));
}
