//! The megakernel tape, executed on the CPU (`kiln_runtime::tape`): for
//! GPU-target and CPU plans of the tiny families (attention split over the
//! context where the tape has the queues for it), every memory region after
//! each step of the tape (worker threads, and an adversary that runs
//! producers as late as the waits allow) equals the op-by-op reference
//! bitwise, over steps whose tokens, positions, slots and context lengths
//! change; and a tape missing one wait, run by the adversary, reads bytes
//! no task wrote yet, which the executor reports and the outputs show.

use kiln_compiler::compile::{compile_traced, CompileOptions};
use kiln_compiler::passes::megakernel::{CounterKind, MegakernelOptions, ScheduleKind};
use kiln_compiler::passes::synth::{SynthFamily, SynthSpec};
use kiln_ir::plan::{BufRef, KeyPlan, ModelInfo, ModelMeta, Plan, Region, Target};
use kiln_ir::rng::SplitMix64;
use kiln_ir::schedule::{describe, Hazards, Schedule, Tape};
use kiln_ir::{InputRole, Key};
use kiln_runtime::tape::{run_ops, run_tape, KeyMemory, Order};

fn compile(spec: &SynthSpec, target: &str, keys: &str) -> Plan {
    compile_on(spec, target, keys, 3)
}

/// [`compile`] for a tape of `sms` SMs x 2 blocks (more queues than a
/// key's (sequence, head) pairs split its attention over the context).
fn compile_on(spec: &SynthSpec, target: &str, keys: &str, sms: u32) -> Plan {
    compile_counters(spec, target, keys, sms, CounterKind::Tile)
}

/// [`compile_on`] with the tape's completion counters per tile or per op.
fn compile_counters(
    spec: &SynthSpec,
    target: &str,
    keys: &str,
    sms: u32,
    counters: CounterKind,
) -> Plan {
    let opts = CompileOptions {
        keys: keys.split(',').map(|k| k.parse().unwrap()).collect(),
        target: target.parse().unwrap(),
        logits: true,
        schedule: ScheduleKind::Megakernel,
        megakernel: MegakernelOptions {
            sm_count: sms,
            blocks_per_sm: 2,
            min_tile: 8,
            counters,
        },
        ..CompileOptions::default()
    };
    let meta = ModelMeta {
        architecture: format!("Synthetic{:?}", spec.family),
        files: vec![],
        compiler_version: "test".into(),
        target: Target::Cpu,
        info: ModelInfo {
            vocab_size: spec.vocab,
            hidden_size: spec.hidden,
            num_layers: spec.layers,
            num_heads: spec.heads,
            num_kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
            max_context: 64,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            dtype: spec.dtype,
        },
    };
    let plan = compile_traced(
        meta,
        spec.manifest(),
        &opts,
        |k, kv| Ok::<_, String>(spec.graph(k, kv, true)),
        &mut |_, _| {},
    )
    .unwrap_or_else(|e| panic!("{e}"))
    .plan;
    kiln_ir::validate(&plan).unwrap_or_else(|e| panic!("{e}"));
    plan
}

fn tape(kp: &KeyPlan) -> &Tape {
    kp.schedule.tape().expect("a megakernel schedule")
}

/// Random weights (small bf16/f32 values) and KV caches.
fn fill_state(mem: &mut KeyMemory, seed: u64) {
    let mut rng = SplitMix64::new(seed);
    let regions: Vec<Region> = mem.regions().map(|(r, _)| r).collect();
    for r in regions {
        if !matches!(r, Region::Weight(_) | Region::KCache(_) | Region::VCache(_)) {
            continue;
        }
        let bytes = mem.region_mut(r).unwrap();
        // bf16 pairs of a small value; every activation of the synthetic
        // models is bf16 (f32 weights read them as small numbers too).
        for pair in bytes.chunks_mut(2) {
            let v = (rng.unit_f32() - 0.5) * 0.5;
            let b = half::bf16::from_f32(v).to_bits().to_le_bytes();
            pair.copy_from_slice(&b[..pair.len()]);
        }
    }
}

/// Stages step `step`'s inputs: fresh tokens, each sequence one token
/// further, its slots in its own blocks.
fn stage(plan: &Plan, kp: &KeyPlan, mem: &mut KeyMemory, step: u32, rng: &mut SplitMix64) {
    let Key { batch, query, .. } = kp.key;
    let kv = &plan.kv;
    let m = kv.max_blocks_per_seq;
    let usable = kv.num_blocks - 1;
    let ctx = |b: u32| 3 + step + 2 * b + query;
    let block = |b: u32, j: u32| 1 + (b * m + j) % usable;
    let slot = |b: u32, p: u32| block(b, p / kv.block_size) * kv.block_size + p % kv.block_size;
    let draws: Vec<i32> = (0..batch * query)
        .map(|_| (rng.next_u64() % plan.meta.info.vocab_size as u64) as i32)
        .collect();
    for (role, buf) in &kp.inputs {
        let vals: Vec<i32> = match role {
            InputRole::TokenIds => draws.clone(),
            InputRole::Positions => (0..batch * query)
                .map(|r| (ctx(r / query) - query + r % query) as i32)
                .collect(),
            InputRole::SlotMapping => (0..batch * query)
                .map(|r| {
                    let b = r / query;
                    slot(b, ctx(b) - query + r % query) as i32
                })
                .collect(),
            InputRole::BlockTables => (0..batch * m).map(|i| block(i / m, i % m) as i32).collect(),
            InputRole::ContextLens => (0..batch).map(|b| ctx(b) as i32).collect(),
            _ => continue,
        };
        let dst = mem.slice_mut(buf).unwrap();
        for (d, v) in dst.chunks_mut(4).zip(vals) {
            d.copy_from_slice(&v.to_le_bytes());
        }
    }
}

fn logits(kp: &KeyPlan, mem: &KeyMemory) -> Vec<f32> {
    let (_, o) = kp
        .outputs
        .iter()
        .find(|(n, _)| n == "logits")
        .expect("a logits output");
    let b = BufRef {
        bytes: o.ty.size_bytes(),
        ..o.buf
    };
    mem.slice(&b)
        .unwrap()
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn first_difference(a: &KeyMemory, b: &KeyMemory) -> Option<String> {
    for ((r, x), (_, y)) in a.regions().zip(b.regions()) {
        if let Some(i) = x.iter().zip(y).position(|(p, q)| p != q) {
            return Some(format!("{r:?} byte {i}"));
        }
    }
    None
}

/// Runs `steps` steps of the key on the reference and on the tape in
/// `order`, comparing every region after each step.
fn check_key(plan: &Plan, kp: &KeyPlan, orders: &[Order], steps: u32) {
    let mut reference = KeyMemory::new(plan, kp).unwrap();
    fill_state(&mut reference, 0x7a9e ^ kp.key.batch as u64);
    let mut mems: Vec<KeyMemory> = orders.iter().map(|_| reference.clone()).collect();
    let mut rng = SplitMix64::new(11);
    let mut previous: Option<Vec<f32>> = None;
    for step in 0..steps {
        let seed = rng.next_u64();
        stage(plan, kp, &mut reference, step, &mut SplitMix64::new(seed));
        run_ops(kp, &mut reference).unwrap_or_else(|e| panic!("{e}"));
        let l = logits(kp, &reference);
        assert!(
            l.iter().all(|x| x.is_finite()),
            "reference logits are finite"
        );
        assert_ne!(previous.as_ref(), Some(&l), "inputs change every step");
        previous = Some(l);
        for (mem, &order) in mems.iter_mut().zip(orders) {
            stage(plan, kp, mem, step, &mut SplitMix64::new(seed));
            let run = run_tape(kp, tape(kp), mem, order).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                run.unwritten_reads.is_empty(),
                "{order:?}: {:?}",
                run.unwritten_reads
            );
            if let Some(d) = first_difference(&reference, mem) {
                panic!(
                    "key {} step {step} {order:?}: tape differs from the op list at {d}",
                    kp.key
                );
            }
        }
    }
}

fn orders(t: &Tape) -> Vec<Order> {
    let n = t.tasks.len() as u32;
    vec![
        Order::Threads,
        Order::LatestFirst,
        Order::Starve(1),
        Order::Starve(n / 2),
        Order::Starve(n - 2),
    ]
}

#[test]
fn gpu_target_tapes_equal_the_op_list_bitwise_in_every_order_over_changing_steps() {
    for family in [SynthFamily::Llama, SynthFamily::Qwen2, SynthFamily::Qwen3] {
        let plan = compile(&SynthSpec::tiny(family), "cuda:sm_90", "b1q1s0");
        for kp in &plan.keys {
            check_key(&plan, kp, &orders(tape(kp)), 4);
        }
    }
}

#[test]
fn cpu_plan_tapes_with_fused_matmuls_and_batches_equal_the_op_list_bitwise() {
    for family in [SynthFamily::Llama, SynthFamily::Qwen3] {
        let plan = compile(&SynthSpec::tiny(family), "cpu", "b1q1s0,b3q1s0,b2q3s2");
        for kp in &plan.keys {
            check_key(&plan, kp, &orders(tape(kp)), 3);
        }
    }
}

#[test]
fn tapes_with_attention_split_over_the_context_equal_the_op_list_bitwise_in_every_order() {
    for (family, target, keys) in [
        (SynthFamily::Llama, "cuda:sm_90", "b1q1s0,b2q1s0"),
        (SynthFamily::Qwen3, "cuda:sm_90", "b1q1s0,b2q4s0"),
    ] {
        let plan = compile_on(&SynthSpec::tiny(family), target, keys, 8);
        for kp in &plan.keys {
            assert!(
                kp.ops
                    .iter()
                    .any(|o| matches!(o.op, kiln_ir::Op::AttentionPartials { .. })),
                "{family:?} key {}: attention was not split",
                kp.key
            );
            check_key(&plan, kp, &orders(tape(kp)), 4);
        }
    }
}

#[test]
fn tapes_with_per_op_counters_equal_the_op_list_bitwise_in_every_order_over_changing_steps() {
    for (family, keys, sms) in [
        (SynthFamily::Llama, "b1q1s0", 3),
        (SynthFamily::Qwen2, "b1q1s0", 3),
        (SynthFamily::Qwen3, "b1q1s0,b2q4s0", 8),
    ] {
        let spec = SynthSpec::tiny(family);
        let plan = compile_counters(&spec, "cuda:sm_90", keys, sms, CounterKind::Op);
        let tiles = compile_counters(&spec, "cuda:sm_90", keys, sms, CounterKind::Tile);
        for (kp, tk) in plan.keys.iter().zip(&tiles.keys) {
            let t = tape(kp);
            // Some counter is shared (a wait for several bumps), and the
            // tape waits less often than the per-tile one.
            assert!(
                t.tasks.iter().flat_map(|x| &x.waits).any(|w| w.target > 1),
                "{family:?} key {}: no shared counter",
                kp.key
            );
            let waits = |t: &Tape| t.tasks.iter().map(|x| x.waits.len()).sum::<usize>();
            assert!(waits(t) < waits(tape(tk)), "{family:?} key {}", kp.key);
            check_key(&plan, kp, &orders(t), 4);
        }
    }
}

#[test]
fn a_tape_missing_one_wait_reads_an_unwritten_tile_under_the_adversary_and_the_test_notices() {
    let plan = compile(&SynthSpec::tiny(SynthFamily::Llama), "cuda:sm_90", "b1q1s0");
    let kp = &plan.keys[0];
    let t = tape(kp);
    // A wait guarding a read of arena bytes that no earlier task writes
    // this step: (waiter, wait index, producer).
    let mut hz = Hazards::new();
    let mut victim = None;
    for (i, task) in t.tasks.iter().enumerate() {
        for c in hz.access(i as u32, &task.reads, &task.writes) {
            let fresh = c.earlier_wrote
                && !c.later_writes
                && c.bytes.region == Region::Arena
                && t.tasks[..c.task as usize].iter().all(|e| {
                    e.writes.iter().all(|w| {
                        w.region != Region::Arena
                            || w.offset + w.bytes <= c.bytes.offset
                            || c.bytes.offset + c.bytes.bytes <= w.offset
                    })
                });
            if let Some(w) = task.waits.iter().position(|w| w.counter == c.task) {
                if fresh && victim.is_none() && i > t.tasks.len() / 3 {
                    victim = Some((i, w, c.task));
                }
            }
        }
    }
    let (i, w, producer) = victim.expect("a wait guarding a fresh arena read");
    let mut bad = plan.clone();
    let Schedule::Megakernel(bt) = &mut bad.keys[0].schedule else {
        unreachable!()
    };
    bt.tasks[i].waits.remove(w);
    // The validator refuses it (nothing would run it)...
    assert!(kiln_ir::validate(&bad).is_err());
    // ...so the test runs it bypassing the validator.
    let bkp = &bad.keys[0];
    let mut reference = KeyMemory::new(&plan, kp).unwrap();
    fill_state(&mut reference, 3);
    let mut mem = reference.clone();
    let mut rng = SplitMix64::new(5);
    stage(&plan, kp, &mut reference, 0, &mut rng.clone());
    stage(&plan, kp, &mut mem, 0, &mut rng);
    run_ops(kp, &mut reference).unwrap();
    let run = run_tape(bkp, tape(bkp), &mut mem, Order::Starve(producer))
        .unwrap_or_else(|e| panic!("{e}"));
    let waiter = describe(bkp, tape(bkp), i as u32);
    let pos = |x: u32| run.ran.iter().position(|&r| r == x).unwrap();
    assert!(
        pos(i as u32) < pos(producer),
        "the adversary ran the consumer first"
    );
    assert!(
        run.unwritten_reads.iter().any(|r| r.starts_with(&waiter)),
        "{waiter}: {:?}",
        run.unwritten_reads
    );
    assert!(first_difference(&reference, &mem).is_some());
    // The same tape with the wait in place is clean under the same order.
    let mut again = KeyMemory::new(&plan, kp).unwrap();
    fill_state(&mut again, 3);
    stage(&plan, kp, &mut again, 0, &mut SplitMix64::new(5));
    let ok = run_tape(kp, t, &mut again, Order::Starve(producer)).unwrap();
    assert!(ok.unwritten_reads.is_empty());
    assert_eq!(first_difference(&reference, &again), None);
}
