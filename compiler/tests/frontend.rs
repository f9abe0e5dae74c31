//! Frontend integration tests: tiny random models of every family, opened
//! from disk and traced at several keys.

mod frontend_common;

use frontend_common::{patch_config, read_tensors, tiny, variants};
use kiln_compiler::frontend::{open, Family, Model, TraceOptions};
use kiln_compiler::testing::TinySpec;
use kiln_ir::plan::KvLayout;
use kiln_ir::{
    AttnAttrs, DType, Graph, InputRole, Key, Op, RopeScaling, TensorType, ValueDef, WeightSource,
};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

const KEYS: [&str; 5] = ["b1q1s0", "b2q1s0", "b1q3s2", "b4q2s0", "b3q4s3"];

fn kv_for(m: &Model) -> KvLayout {
    m.kv_layout(16, 9)
}

fn op_counts(g: &Graph) -> BTreeMap<&'static str, usize> {
    let mut c = BTreeMap::new();
    for n in &g.nodes {
        *c.entry(n.op.mnemonic()).or_insert(0) += 1;
    }
    c
}

fn input_names(g: &Graph) -> Vec<String> {
    g.inputs
        .iter()
        .map(|&v| match &g.value(v).def {
            ValueDef::Input(r) => r.name(),
            other => panic!("input defined as {other:?}"),
        })
        .collect()
}

#[test]
fn every_family_traces_every_key_with_the_expected_ops_inputs_and_outputs() {
    for (name, family, spec) in variants() {
        let dir = tiny(family, &spec);
        let m = open(dir.path()).unwrap();
        let c = m.config().clone();
        let kv = kv_for(&m);
        let l = spec.layers as usize;
        let hd = spec.head_dim();
        for ks in KEYS {
            let key: Key = ks.parse().unwrap();
            let g = m.trace(key, &kv, &TraceOptions::default()).unwrap();
            let ctx = format!("{name} {ks}");
            if let Err(e) = kiln_ir::verify(&g, Some(m.manifest())) {
                panic!("{ctx}: {}", e.render(&g));
            }
            assert_eq!(g.name, format!("{} {ks}", family.architecture()), "{ctx}");
            let (b, q, s) = (key.batch, key.query, key.spec);
            let t = b * q;

            // Op counts per kind.
            let mut want: BTreeMap<&str, usize> = BTreeMap::new();
            want.insert("embedding", 1);
            want.insert("rms_norm", 2 * l + 1);
            want.insert("matmul", 7 * l + 1);
            want.insert("rope", 2 * l);
            want.insert("kv_write", l);
            want.insert("paged_attention", l);
            want.insert("silu_mul", l);
            want.insert("add", 2 * l);
            want.insert("argmax", 1);
            if family == Family::Qwen3 {
                want.insert("head_rms_norm", 2 * l);
            }
            if s == 0 && q > 1 {
                want.insert("gather_last", 1);
            }
            if s > 0 {
                want.insert("accept_greedy", 1);
            }
            assert_eq!(op_counts(&g), want, "{ctx}");
            let biased = g
                .nodes
                .iter()
                .filter(|n| matches!(n.op, Op::MatMul { bias: true, .. }))
                .count();
            assert_eq!(
                biased,
                if family == Family::Qwen2 { 3 * l } else { 0 },
                "{ctx}"
            );

            // Inputs, in order, with their types.
            let mut names: Vec<String> = [
                "token_ids",
                "positions",
                "slot_mapping",
                "block_tables",
                "context_lens",
            ]
            .map(String::from)
            .to_vec();
            if s > 0 {
                names.push("draft_tokens".into());
            }
            for layer in 0..spec.layers {
                names.push(format!("k_cache.{layer}"));
                names.push(format!("v_cache.{layer}"));
            }
            assert_eq!(input_names(&g), names, "{ctx}");
            let ty = |role| g.ty(g.input(role).unwrap()).clone();
            assert_eq!(ty(InputRole::TokenIds), TensorType::new(DType::I32, [t]));
            assert_eq!(ty(InputRole::Positions), TensorType::new(DType::I32, [t]));
            assert_eq!(ty(InputRole::SlotMapping), TensorType::new(DType::I32, [t]));
            assert_eq!(
                ty(InputRole::BlockTables),
                TensorType::new(DType::I32, [b, kv.max_blocks_per_seq])
            );
            assert_eq!(ty(InputRole::ContextLens), TensorType::new(DType::I32, [b]));
            if s > 0 {
                assert_eq!(
                    ty(InputRole::DraftTokens),
                    TensorType::new(DType::I32, [b * s])
                );
            }
            let cache = TensorType::new(DType::BF16, [16 * 9, spec.kv_heads * hd]);
            assert_eq!(ty(InputRole::KCache(1)), cache, "{ctx}");
            assert_eq!(ty(InputRole::VCache(0)), cache, "{ctx}");

            // Outputs.
            let outs: Vec<(&str, TensorType)> = g
                .outputs
                .iter()
                .map(|(n, v)| (n.as_str(), g.ty(*v).clone()))
                .collect();
            let rows = if s == 0 { b } else { t };
            let mut want_outs = vec![("next_tokens", TensorType::new(DType::I32, [rows]))];
            if s > 0 {
                want_outs.push(("accepted", TensorType::new(DType::I32, [b])));
            }
            assert_eq!(outs, want_outs, "{ctx}");

            // Attention and rope attributes come from the config and the layout.
            for n in &g.nodes {
                match &n.op {
                    Op::PagedAttention(AttnAttrs {
                        heads,
                        kv_heads,
                        head_dim,
                        query,
                        block_size,
                        scale,
                        window,
                        softcap,
                    }) => {
                        assert_eq!(
                            (*heads, *kv_heads, *head_dim),
                            (spec.heads, spec.kv_heads, hd),
                            "{ctx}"
                        );
                        assert_eq!((*query, *block_size), (q, 16), "{ctx}");
                        assert!((scale - 1.0 / (hd as f32).sqrt()).abs() < 1e-7, "{ctx}");
                        let want_window = if family == Family::Mistral {
                            spec.sliding_window
                        } else {
                            None
                        };
                        assert_eq!(*window, want_window, "{ctx}");
                        assert_eq!(*softcap, None);
                    }
                    Op::Rope { head_dim, rope, .. } => {
                        assert_eq!(*head_dim, hd);
                        assert_eq!(rope.theta, spec.rope_theta, "{ctx}");
                        assert_eq!(rope.scaling, spec.rope_scaling, "{ctx}");
                    }
                    Op::RmsNorm { eps, unit_offset } => {
                        assert_eq!(*eps, spec.rms_norm_eps);
                        assert!(!unit_offset);
                    }
                    _ => {}
                }
            }
            assert_eq!(c.windows.len(), l);
        }
    }
}

#[test]
fn the_step_is_wired_in_hugging_face_order() {
    // Walk the first layer of a Qwen3 b1q1s0 graph and check each op reads
    // the previous one's result, down to the residual adds.
    let dir = tiny(Family::Qwen3, &TinySpec::for_family(Family::Qwen3));
    let m = open(dir.path()).unwrap();
    let g = m
        .trace(Key::new(1, 1, 0), &kv_for(&m), &TraceOptions::default())
        .unwrap();
    let seq: Vec<&str> = g.nodes.iter().take(17).map(|n| n.op.mnemonic()).collect();
    assert_eq!(
        seq,
        [
            "embedding",
            "rms_norm",
            "matmul",
            "matmul",
            "matmul",
            "head_rms_norm",
            "head_rms_norm",
            "rope",
            "rope",
            "kv_write",
            "paged_attention",
            "matmul",
            "add",
            "rms_norm",
            "matmul",
            "matmul",
            "silu_mul"
        ]
    );
    let w = |v| match &g.value(v).def {
        ValueDef::Weight(n) => n.clone(),
        _ => String::new(),
    };
    let n = &g.nodes;
    let emb = n[0].results[0];
    assert_eq!(n[1].args[0], emb);
    assert_eq!(w(n[1].args[1]), "model.layers.0.input_layernorm.weight");
    assert_eq!(w(n[2].args[1]), "model.layers.0.self_attn.q_proj.weight");
    assert_eq!(w(n[5].args[1]), "model.layers.0.self_attn.q_norm.weight");
    assert_eq!(n[5].args[0], n[2].results[0]);
    assert_eq!(n[6].args[0], n[3].results[0]);
    assert_eq!(w(n[6].args[1]), "model.layers.0.self_attn.k_norm.weight");
    assert_eq!(
        n[7].args,
        [n[5].results[0], g.input(InputRole::Positions).unwrap()]
    );
    assert_eq!(n[8].args[0], n[6].results[0]);
    // kv_write(k, v, slots, kc, vc)
    assert_eq!(
        n[9].args,
        [
            n[8].results[0],
            n[4].results[0],
            g.input(InputRole::SlotMapping).unwrap(),
            g.input(InputRole::KCache(0)).unwrap(),
            g.input(InputRole::VCache(0)).unwrap()
        ]
    );
    // attention reads the written caches, so it is ordered after the write.
    assert_eq!(
        n[10].args,
        [
            n[7].results[0],
            n[9].results[0],
            n[9].results[1],
            g.input(InputRole::BlockTables).unwrap(),
            g.input(InputRole::ContextLens).unwrap()
        ]
    );
    assert_eq!(n[11].args[0], n[10].results[0]);
    assert_eq!(n[12].args, [n[11].results[0], emb]);
    assert_eq!(n[13].args[0], n[12].results[0]);
    assert_eq!(n[16].args, [n[14].results[0], n[15].results[0]]);
    assert_eq!(w(n[14].args[1]), "model.layers.0.mlp.gate_proj.weight");
    assert_eq!(w(n[15].args[1]), "model.layers.0.mlp.up_proj.weight");
    let down = &n[17];
    assert_eq!(down.args[0], n[16].results[0]);
    assert_eq!(w(down.args[1]), "model.layers.0.mlp.down_proj.weight");
    assert_eq!(n[18].op.mnemonic(), "add");
    assert_eq!(n[18].args, [down.results[0], n[12].results[0]]);
    // Layer 1 starts from the second residual sum.
    assert_eq!(n[19].args[0], n[18].results[0]);
    // The tail: final norm, lm_head (f32), argmax.
    let k = n.len();
    assert_eq!(w(n[k - 3].args[1]), "model.norm.weight");
    assert_eq!(
        n[k - 2].op,
        Op::MatMul {
            bias: false,
            out: DType::F32
        }
    );
    assert_eq!(n[k - 2].args[0], n[k - 3].results[0]);
    assert_eq!(n[k - 1].args, [n[k - 2].results[0]]);
}

#[test]
fn prefill_keys_gather_the_last_row_before_the_lm_head_and_spec_keys_score_every_row() {
    let dir = tiny(Family::Llama, &TinySpec::default());
    let m = open(dir.path()).unwrap();
    let kv = kv_for(&m);
    let opts = TraceOptions {
        logits: true,
        ..TraceOptions::default()
    };
    let g = m.trace(Key::new(4, 2, 0), &kv, &opts).unwrap();
    kiln_ir::verify(&g, Some(m.manifest())).unwrap_or_else(|e| panic!("{}", e.render(&g)));
    let gather = g
        .nodes
        .iter()
        .find(|n| n.op.mnemonic() == "gather_last")
        .unwrap();
    assert_eq!(gather.op, Op::GatherLast { group: 2 });
    let norm = g
        .nodes
        .iter()
        .rev()
        .find(|n| n.op.mnemonic() == "rms_norm")
        .unwrap();
    assert_eq!(gather.args, norm.results);
    let logits = g.outputs.iter().find(|(n, _)| n == "logits").unwrap().1;
    assert_eq!(g.ty(logits), &TensorType::new(DType::F32, [4, 256]));

    let g = m.trace(Key::new(3, 4, 3), &kv, &opts).unwrap();
    kiln_ir::verify(&g, Some(m.manifest())).unwrap_or_else(|e| panic!("{}", e.render(&g)));
    let logits = g.outputs.iter().find(|(n, _)| n == "logits").unwrap().1;
    assert_eq!(g.ty(logits), &TensorType::new(DType::F32, [12, 256]));
    let acc = g
        .nodes
        .iter()
        .find(|n| n.op.mnemonic() == "accept_greedy")
        .unwrap();
    assert_eq!(acc.op, Op::AcceptGreedy { spec: 3 });
    let next = g.outputs[0].1;
    assert_eq!(acc.args, [next, g.input(InputRole::DraftTokens).unwrap()]);
    let names: Vec<&str> = g.outputs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["next_tokens", "accepted", "logits"]);
}

#[test]
fn sampling_traces_draw_next_tokens_with_sample_and_spec_keys_stay_greedy() {
    let dir = tiny(Family::Llama, &TinySpec::default());
    let m = open(dir.path()).unwrap();
    let kv = kv_for(&m);
    let opts = TraceOptions {
        sampling: true,
        ..TraceOptions::default()
    };
    for key in [Key::new(3, 1, 0), Key::new(2, 4, 0)] {
        let g = m.trace(key, &kv, &opts).unwrap();
        kiln_ir::verify(&g, Some(m.manifest())).unwrap_or_else(|e| panic!("{}", e.render(&g)));
        let counts = op_counts(&g);
        assert_eq!(counts.get("sample"), Some(&1), "{key}");
        assert_eq!(counts.get("argmax"), None, "{key}");
        let sample = g.nodes.iter().find(|n| n.op == Op::Sample).unwrap();
        let params = g.input(InputRole::SampleParams).unwrap();
        let seeds = g.input(InputRole::SampleSeeds).unwrap();
        assert_eq!(sample.args[1..], [params, seeds]);
        assert_eq!(g.ty(params), &TensorType::new(DType::F32, [key.batch, 4]));
        assert_eq!(g.ty(seeds), &TensorType::new(DType::I32, [key.batch, 4]));
        assert_eq!(g.outputs[0].1, sample.results[0]);
    }
    let g = m.trace(Key::new(2, 3, 2), &kv, &opts).unwrap();
    assert_eq!(op_counts(&g).get("sample"), None);
    assert!(g.input(InputRole::SampleParams).is_none());
    // Without the option nothing changes.
    let g = m
        .trace(Key::new(3, 1, 0), &kv, &TraceOptions::default())
        .unwrap();
    assert_eq!(op_counts(&g).get("argmax"), Some(&1));
    assert!(g.input(InputRole::SampleSeeds).is_none());
}

#[test]
fn manifest_lists_exactly_the_weights_a_trace_reads_in_first_read_order() {
    for (name, family, spec) in variants() {
        let dir = tiny(family, &spec);
        let m = open(dir.path()).unwrap();
        let g = m
            .trace(Key::new(2, 1, 0), &kv_for(&m), &TraceOptions::default())
            .unwrap();
        let read: Vec<String> = g
            .weights
            .iter()
            .map(|&v| match &g.value(v).def {
                ValueDef::Weight(n) => n.clone(),
                d => panic!("{d:?}"),
            })
            .collect();
        let listed: Vec<String> = m
            .manifest()
            .entries
            .iter()
            .map(|e| e.name.clone())
            .collect();
        assert_eq!(read, listed, "{name}");
        let stored: BTreeMap<String, (DType, Vec<u32>)> =
            read_tensors(&dir.path().join("model.safetensors"))
                .into_iter()
                .map(|(n, d, s, _)| (n, (d, s)))
                .collect();
        for (&v, e) in g.weights.iter().zip(&m.manifest().entries) {
            assert_eq!(
                g.ty(v),
                &TensorType::new(e.dtype, e.shape.clone()),
                "{name} {}",
                e.name
            );
            assert_eq!(e.dtype, DType::BF16);
            let WeightSource::Tensor(t) = &e.source else {
                panic!("fused source in a frontend manifest")
            };
            assert_eq!(t.file, "model.safetensors");
            assert_eq!(t.tensor, e.name);
            let (sd, ss) = &stored[&e.name];
            assert_eq!((&t.dtype, &t.shape.0), (sd, ss), "{name} {}", e.name);
        }
        // Every stored tensor is read (tiny models hold nothing else), and a
        // tied model reads the embedding as its lm_head.
        assert_eq!(stored.len(), listed.len(), "{name}");
        assert_eq!(
            m.manifest().get("lm_head.weight").is_some(),
            !spec.tie_embeddings,
            "{name}"
        );
        let lm = g
            .nodes
            .iter()
            .rev()
            .find(|n| matches!(n.op, Op::MatMul { .. }))
            .unwrap();
        let lm_name = match &g.value(lm.args[1]).def {
            ValueDef::Weight(n) => n.clone(),
            d => panic!("{d:?}"),
        };
        let want = if spec.tie_embeddings {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        };
        assert_eq!(lm_name, want, "{name}");
    }
}

#[test]
fn model_info_reflects_the_config_with_family_specifics() {
    let dir = tiny(Family::Qwen3, &TinySpec::for_family(Family::Qwen3));
    let m = open(dir.path()).unwrap();
    let i = m.info();
    assert_eq!(m.architecture(), "Qwen3ForCausalLM");
    assert_eq!(
        (
            i.vocab_size,
            i.hidden_size,
            i.num_layers,
            i.num_heads,
            i.num_kv_heads,
            i.head_dim
        ),
        (256, 64, 2, 4, 2, 32)
    );
    assert_eq!(i.max_context, 512);
    assert_eq!(i.dtype, DType::BF16);
    assert_eq!(
        (i.bos_token_id, i.eos_token_ids.clone()),
        (Some(1), vec![2])
    );
    assert_eq!(
        m.manifest()
            .get("model.layers.1.self_attn.q_proj.weight")
            .unwrap()
            .shape
            .0,
        vec![128, 64]
    );
    assert_eq!(
        m.manifest()
            .get("model.layers.1.self_attn.o_proj.weight")
            .unwrap()
            .shape
            .0,
        vec![64, 128]
    );

    let dir = tiny(Family::Llama, &TinySpec::llama3());
    let m = open(dir.path()).unwrap();
    assert_eq!(m.info().eos_token_ids, vec![2, 3]);
    assert!(
        matches!(m.config().rope.scaling, RopeScaling::Llama3 { factor, original_max_position: 64, .. } if factor == 8.0)
    );

    let dir = tiny(Family::Llama, &TinySpec::smollm2());
    let m = open(dir.path()).unwrap();
    assert_eq!(
        (m.info().num_heads, m.info().num_kv_heads, m.info().head_dim),
        (9, 3, 8)
    );
    assert!(m.config().tie_word_embeddings);
}

#[test]
fn qwen_sliding_windows_apply_from_max_window_layers_on() {
    for family in [Family::Qwen2, Family::Qwen3] {
        let spec = TinySpec {
            layers: 3,
            sliding_window: Some(5),
            max_window_layers: 1,
            ..TinySpec::for_family(family)
        };
        let dir = tiny(family, &spec);
        let m = open(dir.path()).unwrap();
        let g = m
            .trace(Key::new(1, 1, 0), &kv_for(&m), &TraceOptions::default())
            .unwrap();
        let windows: Vec<Option<u32>> = g
            .nodes
            .iter()
            .filter_map(|n| match n.op {
                Op::PagedAttention(AttnAttrs { window, .. }) => Some(window),
                _ => None,
            })
            .collect();
        assert_eq!(windows, [None, Some(5), Some(5)], "{family}");
    }
}

#[test]
fn mistral_without_a_sliding_window_attends_to_everything_and_without_the_key_uses_4096() {
    let dir = tiny(
        Family::Mistral,
        &TinySpec {
            sliding_window: None,
            ..TinySpec::default()
        },
    );
    assert_eq!(open(dir.path()).unwrap().config().windows, [None, None]);
    patch_config(dir.path(), |c| {
        c.remove("sliding_window");
    });
    assert_eq!(
        open(dir.path()).unwrap().config().windows,
        [Some(4096), Some(4096)]
    );
}

#[test]
fn source_files_record_each_files_size_and_header_hash() {
    let dir = tiny(Family::Llama, &TinySpec::default());
    let m = open(dir.path()).unwrap();
    let p = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let digest = Sha256::digest(&bytes[..8 + n]);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    let files = m.source_files();
    assert_eq!(files.len(), 1);
    assert_eq!(files[0].name, "model.safetensors");
    assert_eq!(files[0].size, bytes.len() as u64);
    assert_eq!(files[0].header_sha256, hex);
}

#[test]
fn the_writer_is_deterministic_and_the_seed_changes_the_weights() {
    let spec = TinySpec::for_family(Family::Qwen2);
    let a = tiny(Family::Qwen2, &spec);
    let b = tiny(Family::Qwen2, &spec);
    let c = tiny(
        Family::Qwen2,
        &TinySpec {
            seed: 99,
            ..spec.clone()
        },
    );
    let read = |d: &tempfile::TempDir| std::fs::read(d.path().join("model.safetensors")).unwrap();
    assert_eq!(read(&a), read(&b));
    assert_ne!(read(&a), read(&c));
    // Same layout, so the header hash is the same; the data is not.
    let (ma, mc) = (open(a.path()).unwrap(), open(c.path()).unwrap());
    assert_eq!(
        ma.source_files()[0].header_sha256,
        mc.source_files()[0].header_sha256
    );
}

#[test]
fn the_safetensors_crate_reads_the_writers_files_with_random_values_in_every_dtype() {
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let spec = TinySpec {
            dtype,
            ..TinySpec::for_family(Family::Qwen2)
        };
        let dir = tiny(Family::Qwen2, &spec);
        for (name, d, shape, data) in read_tensors(&dir.path().join("model.safetensors")) {
            assert_eq!(d, dtype, "{name}");
            let vals: Vec<f32> = match dtype {
                DType::BF16 => data
                    .chunks(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                DType::F16 => data
                    .chunks(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                _ => data
                    .chunks(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
            };
            assert_eq!(
                vals.len() as u64,
                shape.iter().map(|&x| x as u64).product::<u64>()
            );
            let mean = vals.iter().sum::<f32>() / vals.len() as f32;
            let var = vals.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / vals.len() as f32;
            assert!(var > 1e-4, "{name} is (nearly) constant");
            assert!(
                vals.iter().all(|v| v.is_finite() && v.abs() < 8.0),
                "{name}"
            );
            if name.ends_with("norm.weight") {
                assert!((mean - 1.0).abs() < 0.1, "{name} mean {mean}");
            } else if name.contains("proj.weight") {
                // std 1/sqrt(fan_in)
                let fan_in = shape[1] as f32;
                let want = 1.0 / fan_in;
                assert!(
                    (var / want - 1.0).abs() < 0.35,
                    "{name} var {var} want {want}"
                );
            }
        }
    }
}

#[test]
fn f32_checkpoints_record_the_stored_dtype_and_still_compute_in_bf16() {
    let dir = tiny(
        Family::Llama,
        &TinySpec {
            dtype: DType::F32,
            ..TinySpec::default()
        },
    );
    let m = open(dir.path()).unwrap();
    for e in &m.manifest().entries {
        assert_eq!(e.dtype, DType::BF16);
        assert_eq!(e.source.parts()[0].dtype, DType::F32);
    }
    let g = m
        .trace(Key::new(1, 1, 0), &kv_for(&m), &TraceOptions::default())
        .unwrap();
    assert!(g.weights.iter().all(|&v| g.ty(v).dtype == DType::BF16));
}

#[test]
fn sharded_checkpoints_map_each_tensor_to_its_shard_and_trace_the_same_graph() {
    let single = tiny(Family::Qwen3, &TinySpec::for_family(Family::Qwen3));
    let sharded = tiny(
        Family::Qwen3,
        &TinySpec {
            shards: 2,
            ..TinySpec::for_family(Family::Qwen3)
        },
    );
    assert!(!sharded.path().join("model.safetensors").exists());
    let (a, b) = (open(single.path()).unwrap(), open(sharded.path()).unwrap());
    let names: Vec<&str> = b.source_files().iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"
        ]
    );
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(sharded.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let mut per_file: BTreeMap<String, usize> = BTreeMap::new();
    for e in &b.manifest().entries {
        let file = &e.source.parts()[0].file;
        assert_eq!(
            index["weight_map"][&e.name],
            serde_json::json!(file),
            "{}",
            e.name
        );
        *per_file.entry(file.clone()).or_default() += 1;
    }
    assert_eq!(per_file.len(), 2, "both shards are read");
    for (f, meta) in b.source_files().iter().zip(&names) {
        let size = std::fs::metadata(sharded.path().join(meta)).unwrap().len();
        assert_eq!(f.size, size);
    }
    let kv = kv_for(&a);
    for ks in KEYS {
        let key: Key = ks.parse().unwrap();
        let o = TraceOptions::default();
        assert_eq!(
            a.trace(key, &kv, &o).unwrap(),
            b.trace(key, &kv, &o).unwrap(),
            "{ks}"
        );
    }
}

#[test]
fn a_config_without_architectures_falls_back_to_model_type() {
    let dir = tiny(Family::Mistral, &TinySpec::for_family(Family::Mistral));
    patch_config(dir.path(), |c| {
        c.remove("architectures");
    });
    assert_eq!(
        open(dir.path()).unwrap().architecture(),
        "MistralForCausalLM"
    );
}

#[test]
fn kv_layout_helper_covers_max_context() {
    let dir = tiny(
        Family::Llama,
        &TinySpec {
            max_position: 100,
            ..TinySpec::default()
        },
    );
    let m = open(dir.path()).unwrap();
    let kv = m.kv_layout(16, 4);
    assert_eq!(kv.max_blocks_per_seq, 7);
    assert_eq!(
        (kv.layers, kv.kv_heads, kv.head_dim, kv.dtype),
        (2, 2, 16, DType::BF16)
    );
}

#[test]
fn mistral_without_num_key_value_heads_takes_hf_default_of_8() {
    let spec = TinySpec {
        heads: 8,
        kv_heads: 8,
        ..TinySpec::for_family(Family::Mistral)
    };
    let dir = tiny(Family::Mistral, &spec);
    patch_config(dir.path(), |c| {
        c.remove("num_key_value_heads");
    });
    assert_eq!(open(dir.path()).unwrap().info().num_kv_heads, 8);
    let dir = tiny(Family::Mistral, &TinySpec::for_family(Family::Mistral));
    patch_config(dir.path(), |c| {
        c.remove("num_key_value_heads");
    });
    let e = open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("8 does not divide num_attention_heads 4 (the key is absent, so MistralForCausalLM's default applies; add `num_key_value_heads`"), "{e}");
    // Llama's default is the head count: 4 kv heads, so k_proj should be [64,64].
    let dir = tiny(Family::Llama, &TinySpec::default());
    patch_config(dir.path(), |c| {
        c.remove("num_key_value_heads");
    });
    let e = open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("k_proj.weight") && e.contains("[64,64]"), "{e}");
}

#[test]
fn llama_attention_and_mlp_bias_flags_add_bias_operands() {
    let dir = tiny(Family::Llama, &TinySpec::default());
    patch_config(dir.path(), |c| {
        c.insert("attention_bias".into(), serde_json::json!(true));
        c.insert("mlp_bias".into(), serde_json::json!(true));
    });
    let e = open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("model.layers.0.self_attn.q_proj.bias"), "{e}");
    frontend_common::rewrite_tensors(&dir.path().join("model.safetensors"), |t| {
        let mut rng = kiln_compiler::testing::SplitMix64::new(5);
        let mut add = |name: String, n: u32| {
            let data = (0..n)
                .flat_map(|_| half::bf16::from_f32(rng.normal() as f32 * 0.1).to_le_bytes())
                .collect();
            t.push((name, DType::BF16, vec![n], data));
        };
        for l in 0..2 {
            for (proj, n) in [
                ("self_attn.q_proj", 64),
                ("self_attn.k_proj", 32),
                ("self_attn.v_proj", 32),
                ("self_attn.o_proj", 64),
                ("mlp.gate_proj", 128),
                ("mlp.up_proj", 128),
                ("mlp.down_proj", 64),
            ] {
                add(format!("model.layers.{l}.{proj}.bias"), n);
            }
        }
    });
    let m = open(dir.path()).unwrap();
    let g = m
        .trace(Key::new(2, 1, 0), &kv_for(&m), &TraceOptions::default())
        .unwrap();
    let biased = g
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::MatMul { bias: true, .. }))
        .count();
    assert_eq!(biased, 14);
    assert_eq!(m.manifest().entries.len(), 1 + 2 * (9 + 7) + 2);
}
