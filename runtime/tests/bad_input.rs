//! Bad input gets a clear error naming the problem and the fix, and a load
//! that fails allocates nothing.

mod common;

use common::*;
use kiln_ir::plan::{Plan, Target};
use kiln_ir::{DType, Shape, TensorRef, WeightEntry, WeightManifest, WeightSource};
use kiln_runtime::backend::Backend;
use kiln_runtime::cpu::CpuStats;

use kiln_runtime::weights::WeightSet;
use kiln_runtime::{CpuBackend, Engine, EngineError, FinishReason, GraphMode, SeqOptions};
use std::path::Path;

/// Loads `plan` from `dir`; returns the error and how many allocations the
/// backend saw.
fn load_err(plan: Plan, dir: &Path) -> (EngineError, u64) {
    let be = CpuBackend::new();
    let stats = be.stats();
    let err = match Engine::new(plan, dir, Box::new(be), options(GraphMode::On)) {
        Ok(_) => panic!("the load should have failed"),
        Err(e) => e,
    };
    (err, CpuStats::get(&stats.allocs))
}

fn assert_mismatch(plan: Plan, dir: &Path, needle: &str) {
    let (err, allocs) = load_err(plan, dir);
    assert!(matches!(err, EngineError::WeightsMismatch { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains(needle) && msg.contains("--weights"), "{msg}");
    assert_eq!(allocs, 0, "a failed load allocated");
}

#[test]
fn a_missing_weight_file_is_a_mismatch_and_nothing_is_allocated() {
    let (dir, plan) = build(&TinyModel::default());
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    assert_mismatch(plan, dir.path(), "model.safetensors is missing");
}

#[test]
fn a_weight_file_of_another_size_is_a_mismatch() {
    let (dir, plan) = build(&TinyModel::default());
    let other = TinyModel {
        hidden: 16,
        ..TinyModel::default()
    };
    other.write_weights(dir.path()).unwrap();
    assert_mismatch(plan, dir.path(), "bytes but the plan was compiled from");
}

#[test]
fn a_weight_file_with_another_header_is_a_mismatch() {
    // Same size, different header: one tensor renamed to a name of equal length.
    let (dir, plan) = build(&TinyModel::default());
    let path = dir.path().join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.windows(7).position(|w| w == b"lm_head").unwrap();
    bytes[at..at + 7].copy_from_slice(b"lm_hxad");
    std::fs::write(&path, &bytes).unwrap();
    assert_mismatch(plan, dir.path(), "header SHA-256");
}

#[test]
fn a_tensor_missing_from_the_file_is_a_mismatch_naming_it() {
    let (dir, mut plan) = build(&TinyModel::default());
    let entry = plan
        .manifest
        .entries
        .iter_mut()
        .find(|e| matches!(e.source, WeightSource::Tensor(_)))
        .expect("the plan has an unfused weight");
    let name = entry.name.clone();
    let WeightSource::Tensor(t) = &mut entry.source else {
        unreachable!("found above")
    };
    t.tensor = "renamed_tensor".into();
    assert_mismatch(
        plan,
        dir.path(),
        &format!("`renamed_tensor` (for weight `{name}`) is missing"),
    );
}

#[test]
fn a_tensor_of_another_shape_or_dtype_is_a_mismatch() {
    let (dir, plan) = build(&TinyModel::default());
    let mut p = plan.clone();
    let WeightSource::Tensor(t) = &mut p.manifest.entries[0].source else {
        unreachable!()
    };
    t.shape = Shape::new([61, 16]);
    assert_mismatch(p, dir.path(), "but the plan expects f32[61,16]");
    let mut p = plan;
    let WeightSource::Tensor(t) = &mut p.manifest.entries[0].source else {
        unreachable!()
    };
    t.dtype = DType::BF16;
    assert_mismatch(p, dir.path(), "but the plan expects bf16[61,32]");
}

#[test]
fn a_plan_for_another_target_is_refused_before_any_allocation() {
    let (dir, mut plan) = build(&TinyModel::default());
    plan.meta.target = Target::Cuda { sm: 90 };
    let (err, allocs) = load_err(plan, dir.path());
    assert!(matches!(err, EngineError::TargetMismatch { .. }), "{err}");
    assert!(err.to_string().contains("--device cuda"), "{err}");
    assert_eq!(allocs, 0);
}

#[test]
fn a_plan_whose_operand_leaves_its_region_is_refused_before_any_allocation() {
    let (dir, mut plan) = build(&TinyModel::default());
    let op = &mut plan.keys[0].ops[3];
    op.args[0].buf.offset = plan.arena_bytes;
    let (err, allocs) = load_err(plan.clone(), dir.path());
    assert!(matches!(err, EngineError::BadPlan(_)), "{err}");
    assert!(err.to_string().contains("b1q1s0"), "{err}");
    assert_eq!(allocs, 0);

    let (dir, mut plan) = build(&TinyModel::default());
    plan.keys[1].outputs.retain(|(n, _)| n != "next_tokens");
    let (err, _) = load_err(plan, dir.path());
    assert!(err.to_string().contains("no next_tokens output"), "{err}");
}

#[test]
fn out_of_memory_at_load_names_what_did_not_fit() {
    let (dir, plan) = build(&TinyModel::default());
    let be = CpuBackend::new().with_memory_limit(50_000);
    let err = match Engine::new(plan, dir.path(), Box::new(be), options(GraphMode::On)) {
        Ok(_) => panic!("should not fit"),
        Err(e) => e,
    };
    // Refused before allocating, with the needed and the free bytes.
    assert!(err.to_string().contains("has 50000 bytes free"), "{err}");
}

#[test]
fn empty_long_and_out_of_vocabulary_prompts_are_refused() {
    let model = TinyModel::default();
    let (dir, plan) = build(&model);
    let mut e = engine(&plan, dir.path(), GraphMode::On);
    assert!(matches!(e.add_sequence(&[]), Err(EngineError::EmptyPrompt)));
    let long = vec![1u32; model.max_context as usize];
    let err = e.add_sequence(&long).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::PromptTooLong {
                len: 48,
                max_context: 48
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("at most 47 tokens"), "{err}");
    let err = e.add_sequence(&[1, 61]).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::InvalidToken {
                token: 61,
                vocab: 61,
                ..
            }
        ),
        "{err}"
    );
    // None of them took a KV block; a good prompt still works.
    assert_eq!(e.free_kv_blocks(), model.num_blocks - 1);
    assert_eq!(e.generate(&[1, 2], 3).unwrap().len(), 3);
}

#[test]
fn kv_exhaustion_refuses_or_stops_one_sequence_and_the_others_go_on() {
    // 8 usable blocks of 4 tokens.
    let model = TinyModel {
        num_blocks: 9,
        ..TinyModel::default()
    };
    let (dir, plan) = build(&model);
    let mut e = engine(&plan, dir.path(), GraphMode::On);
    let w = model.weights();
    let mut rng = Rng::new(41);
    let (pa, pb) = (
        prompt(&mut rng, model.vocab, 3),
        prompt(&mut rng, model.vocab, 6),
    );
    let o = |n| SeqOptions {
        max_new_tokens: n,
        stop_on_eos: false,
    };
    let a = e.add_sequence_with(&pa, o(10)).unwrap();
    let b = e.add_sequence_with(&pb, o(40)).unwrap();
    // A prompt needing more blocks than are free is refused at once.
    let err = e.add_sequence(&[1; 25]).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::KvExhausted {
                needed: 7,
                free: 5,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("remove finished sequences"),
        "{err}"
    );
    while e.has_work() {
        e.step().unwrap();
    }
    let (want_a, _) = model.greedy_reference(&w, &pa, 10);
    let sa = e.sequence(a).unwrap();
    assert_eq!(
        (sa.generated, sa.finished),
        (&want_a[..], Some(&FinishReason::MaxTokens))
    );
    // B ran until all 8 blocks (32 positions) were its own, then stopped.
    let sb = e.sequence(b).unwrap();
    let Some(FinishReason::KvExhausted(why)) = sb.finished else {
        panic!("{:?}", sb.finished)
    };
    assert!(why.contains("KV cache exhausted"), "{why}");
    let (want_b, _) = model.greedy_reference(&w, &pb, sb.generated.len());
    assert_eq!(sb.generated, &want_b[..]);
    assert_eq!(pb.len() + sb.generated.len(), 33);
    assert_eq!(e.free_kv_blocks(), 8);
}

#[test]
fn concatenated_and_converted_weights_are_bound_exactly() {
    // Two bf16 tensors concatenated by rows into one f32 entry, and a bf16
    // tensor narrowed to f16.
    let model = TinyModel {
        file_dtype: DType::BF16,
        ..TinyModel::default()
    };
    let (dir, mut plan) = build(&model);
    let file = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&file).unwrap();
    // (shape, values as f32) of a bf16 tensor of the file.
    let tensor = |name: &str| {
        let v = st.tensor(name).unwrap();
        let shape: Vec<u32> = v.shape().iter().map(|&d| d as u32).collect();
        let vals: Vec<f32> = v
            .data()
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        (shape, vals)
    };
    let (k, v, o) = (
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
    );
    let part = |name: &str| TensorRef {
        file: "model.safetensors".into(),
        tensor: name.into(),
        dtype: DType::BF16,
        shape: Shape::new(tensor(name).0),
    };
    let (k_rows, cols) = (tensor(k).0[0], tensor(k).0[1]);
    let v_rows = tensor(v).0[0];
    let o_elems: u32 = tensor(o).0.iter().product();
    plan.manifest = WeightManifest {
        entries: vec![
            WeightEntry {
                name: "kv".into(),
                dtype: DType::F32,
                shape: Shape::new([k_rows + v_rows, cols]),
                storage: None,
                source: WeightSource::ConcatRows(vec![part(k), part(v)]),
            },
            WeightEntry {
                name: "o16".into(),
                dtype: DType::F16,
                shape: Shape::new([o_elems]),
                storage: None,
                source: WeightSource::Tensor(part(o)),
            },
        ],
    };
    let set = WeightSet::open(&plan, dir.path()).unwrap();
    let mut be = CpuBackend::new();
    let bound = set.bind(&plan, &mut be).unwrap();
    let mut got = vec![0u8; bound[0].1 as usize];
    be.download(bound[0].0, &mut got).unwrap();
    let want: Vec<u8> = tensor(k)
        .1
        .iter()
        .chain(&tensor(v).1)
        .flat_map(|x| x.to_le_bytes())
        .collect();
    assert_eq!(got, want);
    let mut got = vec![0u8; bound[1].1 as usize];
    be.download(bound[1].0, &mut got).unwrap();
    let want: Vec<u8> = tensor(o)
        .1
        .iter()
        .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
        .collect();
    assert_eq!(got, want);

    // A concatenation whose rows do not add up is a malformed plan.
    plan.manifest.entries[0].shape = Shape::new([k_rows + v_rows + 1, cols]);
    let err = WeightSet::open(&plan, dir.path()).err().unwrap();
    assert!(err.to_string().contains("rows in all"), "{err}");
}
