//! `kiln_ir::validate`: a small hand-planned plan passes, and each invariant
//! of the module docs, broken by one mutation, is refused with an error
//! naming the field.

use kiln_ir::manifest::{TensorRef, WeightEntry, WeightManifest, WeightSource};
use kiln_ir::plan::*;
use kiln_ir::validate::{validate, PlanError};
use kiln_ir::{DType, Graph, InputRole, Key, NodeId, Op, Shape, TensorType, ValueId};

fn buf(region: Region, offset: u64, bytes: u64) -> BufRef {
    BufRef {
        region,
        offset,
        bytes,
    }
}

fn launch(module: &str, entry: &str, params: Vec<LaunchParam>) -> KernelLaunch {
    KernelLaunch {
        module: module.into(),
        entry: entry.into(),
        grid: [2, 1, 1],
        block: [32, 1, 1],
        shared_bytes: 0,
        cluster: 1,
        params,
        pdl: true,
    }
}

/// token_ids -> embedding -> argmax -> next_tokens, key b2q1s0. On a GPU
/// target each op is one kernel; argmax has scratch and embedding has
/// (made-up) counters so those invariants have something to check.
fn plan(target: Target) -> Plan {
    let i32t = |n| TensorType::new(DType::I32, vec![n]);
    let mut g = Graph::new("tiny");
    let ids = g.add_input(InputRole::TokenIds, i32t(2));
    let table = g.add_weight("emb", TensorType::new(DType::BF16, vec![8, 4]));
    let h = g.push1(Op::Embedding, &[ids, table]);
    let next = g.push1(Op::Argmax, &[h]);
    g.add_output("next_tokens", next);
    let b_ids = buf(Region::Io, 0, 8);
    let b_table = buf(Region::Weight(0), 0, 64);
    let b_h = buf(Region::Arena, 0, 16);
    let b_next = buf(Region::Io, 256, 8);
    let scratch = buf(Region::Arena, 256, 512);
    let counters = buf(Region::Counters, 0, 8);
    let operand = |b: BufRef, v: ValueId| Operand {
        buf: b,
        ty: g.ty(v).clone(),
    };
    let gpu = target != Target::Cpu;
    let emb = PlanOp {
        node: NodeId(0),
        kernel: "embedding".into(),
        op: Op::Embedding,
        args: vec![operand(b_ids, ids), operand(b_table, table)],
        results: vec![operand(b_h, h)],
        workspace_bytes: 0,
        lowering: if gpu {
            Lowering::Kernels(vec![launch(
                "elementwise",
                "embedding_bf16",
                vec![
                    LaunchParam::Buf(b_ids),
                    LaunchParam::Buf(b_table),
                    LaunchParam::Buf(b_h),
                    LaunchParam::Buf(counters),
                    LaunchParam::I32(4),
                ],
            )])
        } else {
            Lowering::Reference
        },
        scratch: None,
        counters: gpu.then_some(counters),
    };
    let argmax = PlanOp {
        node: NodeId(1),
        kernel: "argmax".into(),
        op: Op::Argmax,
        args: vec![operand(b_h, h)],
        results: vec![operand(b_next, next)],
        workspace_bytes: 0,
        lowering: if gpu {
            Lowering::Kernels(vec![launch(
                "sampling",
                "argmax_chunk_bf16",
                vec![
                    LaunchParam::Buf(b_h),
                    LaunchParam::Buf(scratch),
                    LaunchParam::Buf(b_next),
                ],
            )])
        } else {
            Lowering::Reference
        },
        scratch: gpu.then_some(scratch),
        counters: None,
    };
    let peak = if gpu { 768 } else { 256 };
    let buffers = [(ids, b_ids, None, Some(0)), (table, b_table, None, Some(0))]
        .into_iter()
        .chain([(h, b_h, Some(0), Some(1)), (next, b_next, Some(1), None)])
        .map(|(value, buf, first_use, last_use)| BufferPlan {
            value,
            buf,
            first_use,
            last_use,
        })
        .collect();
    let kp = KeyPlan {
        key: Key::new(2, 1, 0),
        inputs: vec![(InputRole::TokenIds, b_ids)],
        outputs: vec![("next_tokens".into(), operand(b_next, next))],
        graph: g,
        ops: vec![emb, argmax],
        buffers,
        io_bytes: 512,
        arena_peak: peak,
        arena_lower_bound: peak,
        workspace_bytes: 0,
        launches: 2,
        flops: 0,
        bytes_moved: 0,
        schedule: Default::default(),
    };
    let image = |name: &str| KernelImage {
        name: name.into(),
        kind: ImageKind::Cubin,
        code: vec![0],
    };
    Plan {
        meta: ModelMeta {
            architecture: "Tiny".into(),
            files: vec![],
            compiler_version: "test".into(),
            target,
            info: ModelInfo {
                vocab_size: 8,
                hidden_size: 4,
                num_layers: 1,
                num_heads: 1,
                num_kv_heads: 1,
                head_dim: 4,
                max_context: 32,
                bos_token_id: None,
                eos_token_ids: vec![],
                dtype: DType::BF16,
            },
        },
        manifest: WeightManifest {
            entries: vec![WeightEntry {
                name: "emb".into(),
                dtype: DType::BF16,
                shape: Shape::new([8, 4]),
                storage: None,
                source: WeightSource::Tensor(TensorRef {
                    file: "m.safetensors".into(),
                    tensor: "emb".into(),
                    dtype: DType::BF16,
                    shape: Shape::new([8, 4]),
                }),
            }],
        },
        kv: KvLayout {
            layers: 1,
            kv_heads: 1,
            head_dim: 4,
            dtype: DType::BF16,
            block_size: 16,
            num_blocks: 3,
            null_block: 0,
            max_blocks_per_seq: 2,
        },
        arena_bytes: peak,
        workspace_bytes: 0,
        counter_bytes: if gpu { 8 } else { 0 },
        keys: vec![kp],
        kernels: if gpu {
            vec![image("elementwise"), image("sampling")]
        } else {
            vec![]
        },
        kernel_abi: 0,
        tp: 1,
    }
}

fn gpu() -> Plan {
    plan(Target::Cuda { sm: 90 })
}

/// Validates a mutated plan and returns the refusal, checking it names
/// `field` (as a prefix of the reported path).
fn refused(p: &Plan, field: &str) -> PlanError {
    let e = validate(p).expect_err("the mutated plan must be refused");
    assert!(
        e.field.starts_with(field) && e.to_string().contains(field),
        "expected field `{field}`, got: {e}"
    );
    e
}

const K: &str = "keys[b2q1s0]";

#[test]
fn a_consistent_plan_validates_into_its_info() {
    let info = validate(&plan(Target::Cpu)).unwrap();
    assert!(info.modules.is_empty());
    assert_eq!(info.weights_used.iter().copied().collect::<Vec<_>>(), [0]);
    assert_eq!(info.keys[0].launches, 2);
    let info = validate(&gpu()).unwrap();
    assert_eq!(
        info.modules.iter().map(String::as_str).collect::<Vec<_>>(),
        ["elementwise", "sampling"]
    );
    assert_eq!(info.keys[0].counter_extent, 8);
    assert_eq!(info.keys[0].arena_extent, 768);
    assert_eq!(info.keys[0].io_bytes, 512);
    assert_eq!(kiln_ir::validate::modules_used(&gpu()), info.modules);
}

#[test]
fn an_unusable_kv_layout_is_refused() {
    let mut p = plan(Target::Cpu);
    p.kv.num_blocks = 1;
    refused(&p, "kv");
    let mut p = plan(Target::Cpu);
    p.kv.max_blocks_per_seq = 1;
    refused(&p, "kv.max_blocks_per_seq");
}

#[test]
fn a_plan_without_keys_or_with_a_key_twice_is_refused() {
    let mut p = plan(Target::Cpu);
    p.keys.clear();
    refused(&p, "keys");
    let mut p = plan(Target::Cpu);
    p.keys.push(p.keys[0].clone());
    let e = refused(&p, "keys[1].key");
    assert!(e.problem.contains("twice"), "{e}");
}

#[test]
fn a_buffer_outside_its_region_or_in_an_undefined_region_is_refused() {
    let mut p = plan(Target::Cpu);
    p.keys[0].ops[0].args[1].buf.bytes += 2;
    let e = refused(&p, &format!("{K}.ops[0].args[1]"));
    assert!(e.problem.contains("holds 64"), "{e}");
    let mut p = plan(Target::Cpu);
    p.keys[0].ops[0].args[1].buf.region = Region::Weight(5);
    let e = refused(&p, &format!("{K}.ops[0].args[1]"));
    assert!(e.problem.contains("does not define"), "{e}");
    let mut p = plan(Target::Cpu);
    p.keys[0].inputs[0].1.offset = u64::MAX;
    refused(&p, &format!("{K}.inputs[0]"));
    let mut p = plan(Target::Cpu);
    p.keys[0].outputs[0].1.buf.offset = 512;
    refused(&p, &format!("{K}.outputs[next_tokens]"));
}

#[test]
fn a_misaligned_arena_or_io_buffer_is_refused() {
    let mut p = plan(Target::Cpu);
    p.keys[0].buffers[2].buf.offset = 8;
    let e = refused(&p, &format!("{K}.buffers[2]"));
    assert!(e.problem.contains("aligned"), "{e}");
    let mut p = plan(Target::Cpu);
    p.keys[0].buffers[3].buf.offset = 260;
    refused(&p, &format!("{K}.buffers[3]"));
}

#[test]
fn an_operand_unlike_its_graph_value_or_ill_typed_is_refused() {
    let mut p = plan(Target::Cpu);
    p.keys[0].ops[1].results[0].ty = TensorType::new(DType::I32, vec![3]);
    let e = refused(&p, &format!("{K}.ops[1].results[0]"));
    assert!(e.problem.contains("graph value"), "{e}");
    let mut p = plan(Target::Cpu);
    p.keys[0].ops[1].node = NodeId(9);
    refused(&p, &format!("{K}.ops[1].node"));
    let mut p = plan(Target::Cpu);
    p.keys[0].ops[0].args[0].buf.bytes = 4;
    let e = refused(&p, &format!("{K}.ops[0].args[0]"));
    assert!(e.problem.contains("needs 8 bytes"), "{e}");
}

#[test]
fn inconsistent_arena_workspace_and_counter_sizes_are_refused() {
    let mut p = plan(Target::Cpu);
    p.arena_bytes += 256;
    refused(&p, "arena_bytes");
    let mut p = plan(Target::Cpu);
    p.keys[0].arena_peak = 0;
    p.keys[0].arena_lower_bound = 0;
    p.arena_bytes = 0;
    // The arena buffer no longer fits the (empty) arena.
    refused(&p, &format!("{K}.buffers[2]"));
    let mut p = plan(Target::Cpu);
    p.keys[0].ops[1].workspace_bytes = 16;
    p.keys[0].workspace_bytes = 16;
    p.workspace_bytes = 16;
    let e = refused(&p, &format!("{K}.ops[1].workspace_bytes"));
    assert!(e.problem.contains("only GEMMs"), "{e}");
    let mut p = plan(Target::Cpu);
    p.workspace_bytes = 64;
    refused(&p, "workspace_bytes");
    let mut p = gpu();
    p.counter_bytes = 64;
    refused(&p, "counter_bytes");
}

#[test]
fn two_ops_sharing_counters_or_scratch_outside_the_arena_are_refused() {
    let mut p = gpu();
    p.keys[0].ops[1].counters = p.keys[0].ops[0].counters;
    let e = refused(&p, &format!("{K}.ops[1].counters"));
    assert!(e.problem.contains("op 0"), "{e}");
    let mut p = gpu();
    p.keys[0].ops[0].counters = Some(buf(Region::Arena, 512, 8));
    refused(&p, &format!("{K}.ops[0].counters"));
    let mut p = gpu();
    p.keys[0].ops[1].scratch = Some(buf(Region::Io, 0, 8));
    let e = refused(&p, &format!("{K}.ops[1].scratch"));
    assert!(e.problem.contains("arena"), "{e}");
}

#[test]
fn a_lowering_that_does_not_match_the_target_is_refused() {
    let mut p = plan(Target::Cpu);
    p.keys[0].ops[0].lowering = gpu().keys[0].ops[0].lowering.clone();
    let e = refused(&p, &format!("{K}.ops[0].lowering"));
    assert!(e.problem.contains("Reference"), "{e}");
    let mut p = gpu();
    p.keys[0].ops[0].lowering = Lowering::Reference;
    refused(&p, &format!("{K}.ops[0].lowering"));
    let mut p = gpu();
    p.keys[0].ops[0].lowering = Lowering::Kernels(vec![]);
    let e = refused(&p, &format!("{K}.ops[0].lowering"));
    assert!(e.problem.contains("empty"), "{e}");
    let mut p = gpu();
    p.keys[0].ops[0].lowering = Lowering::Gemm {
        shape: GemmShape {
            t: 2,
            n: 8,
            k: 4,
            dtype: DType::BF16,
            out: DType::BF16,
            bias: false,
        },
        kind: kiln_ir::plan::GemmKind::Blas,
        kernel: None,
    };
    refused(&p, &format!("{K}.ops[0].lowering"));
}

#[test]
fn a_launch_parameter_outside_the_ops_planned_buffers_is_refused() {
    let mut p = gpu();
    let Lowering::Kernels(ls) = &mut p.keys[0].ops[0].lowering else {
        panic!("gpu ops have kernels")
    };
    // Arena bytes that belong to argmax's scratch, not to this op.
    ls[0].params[2] = LaunchParam::Buf(buf(Region::Arena, 256, 16));
    let e = refused(&p, &format!("{K}.ops[0].lowering.launch[0].params[2]"));
    assert!(e.problem.contains("not inside"), "{e}");
}

#[test]
fn a_gpu_plan_without_an_image_of_a_launched_module_is_refused() {
    let mut p = gpu();
    p.kernels.retain(|k| k.name != "sampling");
    let e = refused(&p, "kernels");
    assert!(e.problem.contains("sampling"), "{e}");
    let mut p = plan(Target::Cpu);
    p.kernels = gpu().kernels;
    refused(&p, "kernels");
}

#[test]
fn launches_that_are_not_the_sum_of_the_lowerings_are_refused() {
    let mut p = gpu();
    p.keys[0].launches = 5;
    let e = refused(&p, &format!("{K}.launches"));
    assert!(e.problem.contains("launch 2 kernels"), "{e}");
}

#[test]
fn a_cluster_off_sm90_or_that_does_not_tile_the_grid_is_refused() {
    let set = |p: &mut Plan, c: u32| {
        let Lowering::Kernels(ks) = &mut p.keys[0].ops[0].lowering else {
            panic!("a kernel lowering")
        };
        ks[0].cluster = c;
    };
    // grid[0] = 2: a cluster of 2 tiles it on sm_90.
    let mut p = gpu();
    set(&mut p, 2);
    validate(&p).unwrap();
    let field = format!("{K}.ops[0].lowering.launch[0].cluster");
    for c in [0, 3, 4, 32] {
        let mut p = gpu();
        set(&mut p, c);
        let e = refused(&p, &field);
        assert!(e.problem.contains("power of two"), "{e}");
    }
    for t in [
        Target::Cuda { sm: 80 },
        Target::Hip {
            gfx: "gfx1100".into(),
        },
    ] {
        let mut p = plan(t);
        set(&mut p, 2);
        let e = refused(&p, &field);
        assert!(e.problem.contains("sm_90"), "{e}");
    }
}
