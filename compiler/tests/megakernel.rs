//! The megakernel schedule (`--schedule megakernel`): the pass writes a tape
//! the validator accepts, cut at tile granularity, and the tape verifier
//! refuses every mutation that could make a task read unwritten bytes,
//! race another task or deadlock.

mod planner_support;

use kiln_compiler::compile::{CompileError, CompileOptions};
use kiln_compiler::passes::megakernel::{CounterKind, MegakernelOptions, ScheduleKind};
use kiln_compiler::passes::synth::{SynthFamily, SynthSpec};
use kiln_compiler::passes::Pass;
use kiln_ir::plan::{Plan, Region};
use kiln_ir::schedule::{describe, Hazards, Schedule, Tape};
use kiln_ir::validate::validate;
use kiln_ir::AttnAttrs;
use kiln_ir::Op;
use planner_support::*;
use std::collections::BTreeSet;

fn options(target: &str, keys_: &str, sms: u32) -> CompileOptions {
    CompileOptions {
        keys: keys(keys_),
        target: target.parse().unwrap(),
        schedule: ScheduleKind::Megakernel,
        megakernel: MegakernelOptions {
            sm_count: sms,
            blocks_per_sm: 2,
            min_tile: 8,
            counters: Default::default(),
        },
        ..CompileOptions::default()
    }
}

fn tape(plan: &Plan, k: usize) -> &Tape {
    plan.keys[k].schedule.tape().expect("a megakernel schedule")
}

/// Each task's dependencies before any reduction: the earlier tasks whose
/// bytes its footprint touches (read after write, write after read or
/// write).
fn dependencies(t: &Tape) -> Vec<BTreeSet<u32>> {
    let mut hz = Hazards::new();
    t.tasks
        .iter()
        .enumerate()
        .map(|(i, x)| {
            hz.access(i as u32, &x.reads, &x.writes)
                .into_iter()
                .map(|c| c.task)
                .collect()
        })
        .collect()
}

fn tape_mut(plan: &mut Plan, k: usize) -> &mut Tape {
    match &mut plan.keys[k].schedule {
        Schedule::Megakernel(t) => t,
        Schedule::Graph => panic!("a megakernel schedule"),
    }
}

#[test]
fn a_gpu_plan_gets_a_tape_per_key_cut_into_gemv_tiles_and_attention_heads() {
    for family in [SynthFamily::Llama, SynthFamily::Qwen3] {
        let spec = SynthSpec::tiny(family);
        let plan = compile_synth(&spec, &options("cuda:sm_90", "b1q1s0", 3)).plan;
        validate(&plan).unwrap_or_else(|e| panic!("{e}"));
        for (k, kp) in plan.keys.iter().enumerate() {
            let t = tape(&plan, k);
            assert_eq!(t.queues.len(), 6);
            for (i, op) in kp.ops.iter().enumerate() {
                let n = t.tasks.iter().filter(|x| x.op as usize == i).count();
                match op.op {
                    Op::PagedAttention(AttnAttrs { heads, .. }) => {
                        // One unit per (sequence, query head), about one
                        // tile per queue.
                        let units = kp.key.batch * heads;
                        assert_eq!(n as u32, units.div_ceil(units.div_ceil(6)), "op {i}");
                    }
                    Op::MatMul { .. } | Op::FusedMatMul { .. } => {
                        let cols = *op.results[0].ty.shape.dims().last().unwrap();
                        assert!(n > 1 && n <= 6, "op {i}: {n} tiles of {cols} columns");
                    }
                    // One task per query head, one for the K cache, one
                    // for the V cache.
                    Op::QkvRopeKvWrite { heads, .. } => {
                        assert_eq!(n as u32, heads + 2, "op {i}")
                    }
                    // One task per row.
                    Op::Argmax => assert_eq!(n as u32, kp.key.batch, "op {i}"),
                    _ => assert_eq!(n, 1, "op {i} `{}`", op.op.mnemonic()),
                }
            }
            // The megakernel schedule fuses with the interpreter's rule:
            // norms and epilogues join the GEMVs, the argmax stays apart.
            assert!(
                kp.ops
                    .iter()
                    .any(|o| matches!(o.op, Op::FusedMatMul { .. })),
                "{family:?}: no fused GEMV"
            );
            assert!(
                !kp.ops.iter().any(|o| matches!(
                    o.op,
                    Op::FusedMatMul {
                        post: kiln_ir::op::Epilogue::Argmax,
                        ..
                    }
                )),
                "{family:?}: the argmax was fused into the lm_head"
            );
            // The counters sit above every op's own counters.
            let op_counters = plan
                .keys
                .iter()
                .flat_map(|k| &k.ops)
                .filter_map(|o| o.counters)
                .map(|c| c.offset + c.bytes)
                .max()
                .unwrap_or(0);
            assert!(t.counters.offset >= op_counters);
            assert_eq!(t.counters.region, Region::Counters);
            assert_eq!(t.counters.bytes, 4 * t.tasks.len() as u64);
            assert!(plan.counter_bytes >= t.counters.offset + t.counters.bytes);
        }
        // The graph schedule is unchanged: the same compile without
        // --schedule writes no tape and fewer counter bytes.
        let graph = compile_synth(
            &spec,
            &CompileOptions {
                schedule: ScheduleKind::Graph,
                ..options("cuda:sm_90", "b1q1s0", 3)
            },
        )
        .plan;
        assert!(graph.keys.iter().all(|k| k.schedule == Schedule::Graph));
        assert!(graph.counter_bytes < plan.counter_bytes);
        // Without its tapes the plan is the graph schedule's plan of the
        // same fusions (the megakernel schedule runs `fuse-matmul-tape` and
        // no `fuse-rope-attention`).
        let graph = compile_synth(
            &spec,
            &CompileOptions {
                schedule: ScheduleKind::Graph,
                passes: kiln_compiler::passes::DEFAULT_PIPELINE
                    .iter()
                    .filter(|&&p| p != Pass::FuseRopeAttention)
                    .map(|&p| match p {
                        Pass::FuseMatMul => Pass::FuseMatMulTape,
                        p => p,
                    })
                    .collect(),
                ..options("cuda:sm_90", "b1q1s0", 3)
            },
        )
        .plan;
        let mut stripped = plan.clone();
        for k in &mut stripped.keys {
            k.schedule = Schedule::Graph;
        }
        stripped.counter_bytes = graph.counter_bytes;
        // A GPU plan with a tape also carries the interpreter's image.
        let interpreter = kiln_ir::schedule::INTERPRETER_MODULE;
        assert!(stripped.kernels.iter().any(|k| k.name == interpreter));
        assert!(graph.kernels.iter().all(|k| k.name != interpreter));
        stripped.kernels.retain(|k| k.name != interpreter);
        assert_eq!(stripped, graph);
    }
}

#[test]
fn a_tile_depends_only_on_the_producer_tiles_of_the_bytes_it_touches() {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    // With the logits an output the argmax stays a separate reduction
    // (otherwise it joins the lm_head GEMV).
    let opts = CompileOptions {
        logits: true,
        ..options("cpu", "b1q1s0", 4)
    };
    let plan = compile_synth(&spec, &opts).plan;
    validate(&plan).unwrap_or_else(|e| panic!("{e}"));
    let kp = &plan.keys[0];
    let t = tape(&plan, 0);
    // The dependencies before any reduction, from the footprints.
    let deps = dependencies(t);
    let tiles_of = |op: u32| -> BTreeSet<u32> {
        (0..t.tasks.len() as u32)
            .filter(|&i| t.tasks[i as usize].op == op)
            .collect()
    };
    // Some tile depends on a strict, non-empty subset of a tiled producer:
    // a residual epilogue reads only its own columns of the residual
    // stream, a head group overwrites only the arena columns it reuses.
    let mut partial = 0;
    for dep in &deps {
        let producers: BTreeSet<u32> = dep.iter().map(|&d| t.tasks[d as usize].op).collect();
        for p in producers {
            let all = tiles_of(p);
            let some = dep.iter().filter(|d| all.contains(d)).count();
            if all.len() > 1 && some < all.len() {
                partial += 1;
            }
        }
    }
    assert!(
        partial > 0,
        "no tile-granular dependency in {} tasks",
        t.tasks.len()
    );
    // A full reduction (argmax over the logits) depends on every lm_head tile.
    let argmax = kp
        .ops
        .iter()
        .position(|o| matches!(o.op, Op::Argmax))
        .unwrap() as u32;
    let a = *tiles_of(argmax).iter().next().unwrap();
    let lm_op = argmax - 1;
    assert!(tiles_of(lm_op).len() > 1);
    assert!(tiles_of(lm_op).is_subset(&deps[a as usize]));
    // Every wait names an earlier task of an earlier op.
    for (i, x) in t.tasks.iter().enumerate() {
        for w in &x.waits {
            assert!((w.counter as usize) < i);
            assert!(t.tasks[w.counter as usize].op < x.op);
        }
    }
}

#[test]
fn a_query_head_ropes_after_its_own_qkv_columns_and_the_argmax_reads_one_row_per_task() {
    let spec = SynthSpec::tiny(SynthFamily::Qwen3);
    let plan = compile_synth(&spec, &options("cuda:sm_90", "b1q1s0,b2q1s0", 8)).plan;
    validate(&plan).unwrap_or_else(|e| panic!("{e}"));
    for (k, kp) in plan.keys.iter().enumerate() {
        let t = tape(&plan, k);
        let deps = dependencies(t);
        let tasks_of = |op: usize| -> Vec<u32> {
            (0..t.tasks.len() as u32)
                .filter(|&i| t.tasks[i as usize].op as usize == op)
                .collect()
        };
        let mut seen = 0;
        for (i, op) in kp.ops.iter().enumerate() {
            let Op::QkvRopeKvWrite { heads, .. } = op.op else {
                continue;
            };
            seen += 1;
            let rope = tasks_of(i);
            assert_eq!(rope.len() as u32, heads + 2);
            // The qkv producer is the op writing the rope's first argument.
            let qkv = kp.ops[..i]
                .iter()
                .rposition(|o| o.results.iter().any(|r| r.buf == op.args[0].buf))
                .expect("a qkv producer");
            let qkv_tiles: BTreeSet<u32> = tasks_of(qkv).into_iter().collect();
            assert!(qkv_tiles.len() > 1, "the qkv GEMV is tiled");
            for (u, &r) in rope.iter().enumerate() {
                let from_qkv: BTreeSet<u32> =
                    deps[r as usize].intersection(&qkv_tiles).copied().collect();
                assert!(!from_qkv.is_empty(), "unit {u} waits for no qkv tile");
                if (u as u32) < heads {
                    // A query head needs only the tiles of its columns.
                    assert!(
                        from_qkv.len() < qkv_tiles.len(),
                        "query head {u} waits for every qkv tile"
                    );
                }
                let task = &t.tasks[r as usize];
                let caches = task
                    .writes
                    .iter()
                    .filter(|b| matches!(b.region, Region::KCache(_) | Region::VCache(_)))
                    .count();
                assert_eq!(caches, usize::from(u as u32 >= heads), "unit {u}");
            }
            // The attention that reads this layer's q depends on every q
            // head it reads and on both cache units.
            let attn = kp.ops[i..]
                .iter()
                .position(|o| matches!(o.op, Op::PagedAttention(..) | Op::AttentionPartials { .. }))
                .map(|p| p + i)
                .expect("attention after the rope");
            for a in tasks_of(attn) {
                let d = &deps[a as usize];
                assert!(d.contains(&rope[heads as usize]) && d.contains(&rope[heads as usize + 1]));
                assert!(rope[..heads as usize].iter().any(|q| d.contains(q)));
            }
        }
        assert!(seen > 0, "no qkv_rope_kv_write in key {}", kp.key);
        // The argmax is one task per row, each reading its own row.
        let argmax = kp
            .ops
            .iter()
            .position(|o| matches!(o.op, Op::Argmax))
            .expect("an argmax");
        let rows = tasks_of(argmax);
        assert_eq!(rows.len() as u32, kp.key.batch);
        for (r, &a) in rows.iter().enumerate() {
            let x = &t.tasks[a as usize];
            assert_eq!((x.tile.begin, x.tile.end), (r as u32, r as u32 + 1));
            let row = kp.ops[argmax].args[0].ty.size_bytes() / kp.key.batch as u64;
            assert_eq!(x.reads.iter().map(|b| b.bytes).sum::<u64>(), row);
        }
    }
}

#[test]
fn attention_is_split_over_the_context_where_queues_outnumber_its_heads_and_each_combine_waits_for_its_own_runs(
) {
    let spec = SynthSpec::tiny(SynthFamily::Qwen3);
    // 8 SMs x 2 blocks = 16 queues: b1 (4 heads) splits into 4 runs, b2
    // into 2, b4 (16 units) not at all.
    let opts = options("cuda:sm_90", "b1q1s0,b2q1s0,b4q1s0", 8);
    let plan = compile_synth(&spec, &opts).plan;
    validate(&plan).unwrap_or_else(|e| panic!("{e}"));
    for (k, kp) in plan.keys.iter().enumerate() {
        let t = tape(&plan, k);
        let want_runs = match kp.key.batch {
            1 => Some(4),
            2 => Some(2),
            _ => None,
        };
        let runs: Vec<u32> = kp
            .ops
            .iter()
            .filter_map(|o| match o.op {
                Op::AttentionPartials { parts, .. } => Some(parts),
                _ => None,
            })
            .collect();
        let plain = kp
            .ops
            .iter()
            .filter(|o| matches!(o.op, Op::PagedAttention(..)))
            .count();
        match want_runs {
            Some(r) => {
                assert_eq!(runs, vec![r; 2], "key {}", kp.key);
                assert_eq!(plain, 0);
            }
            None => assert!(runs.is_empty() && plain == 2, "key {}", kp.key),
        }
        let Some(r) = want_runs else { continue };
        let deps = dependencies(t);
        let mut combines = 0;
        for (i, op) in kp.ops.iter().enumerate() {
            let Op::AttentionCombine { heads, .. } = op.op else {
                continue;
            };
            combines += 1;
            let producer = i - 1;
            assert!(matches!(kp.ops[producer].op, Op::AttentionPartials { .. }));
            let partial_tasks: Vec<u32> = (0..t.tasks.len() as u32)
                .filter(|&x| t.tasks[x as usize].op as usize == producer)
                .collect();
            // One task per (sequence, head, run) on this many queues.
            assert_eq!(partial_tasks.len() as u32, kp.key.batch * heads * r);
            for x in (0..t.tasks.len()).filter(|&x| t.tasks[x].op as usize == i) {
                let task = &t.tasks[x];
                let from: Vec<u32> = deps[x]
                    .iter()
                    .copied()
                    .filter(|d| partial_tasks.contains(d))
                    .collect();
                // A combine tile of (row, head) units waits for exactly the
                // runs of those units.
                let units = task.tile.end - task.tile.begin;
                assert_eq!(from.len() as u32, units * r, "task {x}");
                for d in from {
                    let u = t.tasks[d as usize].tile.begin / r;
                    assert!(
                        (task.tile.begin..task.tile.end).contains(&u),
                        "task {x} waits on {d}"
                    );
                }
            }
        }
        assert_eq!(combines, 2, "key {}: one combine per layer", kp.key);
    }
}

#[test]
fn a_cpu_plan_s_tape_keeps_its_attention_whole() {
    // The CPU backend runs a tape plan's op list: the split would only cost.
    let spec = SynthSpec::tiny(SynthFamily::Qwen3);
    let plan = compile_synth(&spec, &options("cpu", "b1q1s0", 8)).plan;
    let ops = &plan.keys[0].ops;
    assert!(ops.iter().any(|o| matches!(o.op, Op::PagedAttention(..))));
    assert!(!ops.iter().any(|o| kiln_ir::validate::tape_only(&o.op)));
}

#[test]
fn a_gpu_key_scheduled_as_a_graph_may_not_hold_the_split_attention_ops() {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let plan = compile_synth(&spec, &options("cuda:sm_90", "b1q1s0", 8)).plan;
    assert!(plan.keys[0]
        .ops
        .iter()
        .any(|o| kiln_ir::validate::tape_only(&o.op)));
    let mut bad = plan.clone();
    bad.keys[0].schedule = Schedule::Graph;
    let e = validate(&bad).expect_err("a split attention without its tape");
    assert!(
        e.field.starts_with("keys[b1q1s0].ops[")
            && e.problem
                .contains("runs only as tasks of a megakernel tape"),
        "{e}"
    );
}

#[test]
fn two_tiles_of_one_rope_op_writing_one_cache_are_refused() {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    // A CPU plan: no launch parameters to keep in step with the mutations.
    let plan = compile_synth(&spec, &options("cpu", "b1q1s0", 3)).plan;
    let t = tape(&plan, 0);
    let (i, heads) = plan.keys[0]
        .ops
        .iter()
        .enumerate()
        .find_map(|(i, o)| match o.op {
            Op::QkvRopeKvWrite { heads, .. } => Some((i, heads)),
            _ => None,
        })
        .unwrap();
    let k_unit = t
        .tasks
        .iter()
        .position(|x| x.op as usize == i && x.tile.begin == heads)
        .unwrap();
    // The V unit claims the K cache too: the footprint check names it first;
    // with footprints that agree but overlap, the tile check does.
    let mut bad = plan.clone();
    let kc = tape(&bad, 0).tasks[k_unit].writes[0];
    let v_unit = k_unit + 1;
    tape_mut(&mut bad, 0).tasks[v_unit].writes.push(kc);
    let e = validate(&bad).expect_err("a V unit writing the K cache");
    assert!(
        e.field.ends_with(&format!("tasks[{v_unit}]")) && e.problem.contains("footprint"),
        "{e}"
    );
    // A plan whose V cache is the K cache: the footprints agree with the
    // op, and the K and V units now write the same bytes.
    let mut bad = plan.clone();
    let op = &mut bad.keys[0].ops[i];
    op.args[4].buf = op.args[3].buf;
    op.results[2].buf = op.results[1].buf;
    let op = bad.keys[0].ops[i].clone();
    for x in &mut tape_mut(&mut bad, 0).tasks {
        if x.op as usize == i {
            (x.reads, x.writes) = kiln_ir::schedule::footprint(&op, x.tile).unwrap();
        }
    }
    let e = validate(&bad).expect_err("two units writing one cache");
    assert!(
        e.field.ends_with(&format!("tasks[{v_unit}]")) && e.problem.contains("independent"),
        "{e}"
    );
}

#[test]
fn dropping_any_one_wait_makes_the_verifier_refuse_the_tape_naming_the_task() {
    let spec = SynthSpec::tiny(SynthFamily::Qwen3);
    let plan = compile_synth(&spec, &options("cuda:sm_90", "b1q1s0", 3)).plan;
    let t = tape(&plan, 0);
    let mut dropped = 0;
    for i in 0..t.tasks.len() {
        for w in 0..t.tasks[i].waits.len() {
            let mut bad = plan.clone();
            let waiter = describe(&bad.keys[0], tape(&bad, 0), i as u32);
            let gone = tape_mut(&mut bad, 0).tasks[i].waits.remove(w);
            let e = validate(&bad).expect_err("a tape missing a wait");
            assert_eq!(e.field, format!("keys[b1q1s0].schedule.tasks[{i}].waits"));
            assert!(e.problem.starts_with(&waiter), "{e}");
            let producer = describe(&bad.keys[0], tape(&bad, 0), gone.counter);
            assert!(e.problem.contains("without waiting"), "{e}");
            // The unguarded producer is named (directly, or the one whose
            // transitive guard went with the dropped wait).
            assert!(e.problem.contains("task "), "{e} ({producer})");
            dropped += 1;
        }
    }
    assert!(dropped > 10, "only {dropped} waits in the tape");
}

/// `--megakernel-counters op` (the default): an op whose tiles every consumer takes whole
/// gets one counter, bumped by each of its tiles and waited on once for all
/// of them; the QKV projection, whose columns the query heads' RoPE reads a
/// head at a time, keeps a counter per tile, so a head still waits for its
/// own columns only. The verifier accepts the tape, and refuses it without
/// any one of its waits.
#[test]
fn with_per_op_counters_a_whole_op_is_waited_on_once_and_a_rope_head_still_waits_for_its_own_columns(
) {
    let spec = SynthSpec::tiny(SynthFamily::Qwen3);
    let mut opts = options("cuda:sm_90", "b1q1s0", 3);
    opts.megakernel.counters = CounterKind::Op;
    let plan = compile_synth(&spec, &opts).plan;
    validate(&plan).unwrap_or_else(|e| panic!("{e}"));
    let mut per_tile = options("cuda:sm_90", "b1q1s0", 3);
    per_tile.megakernel.counters = CounterKind::Tile;
    let tiles = compile_synth(&spec, &per_tile).plan;
    let (kp, t) = (&plan.keys[0], tape(&plan, 0));
    let bumpers = |c: u32| -> Vec<u32> {
        (0..t.tasks.len() as u32)
            .filter(|&i| t.tasks[i as usize].counter == c)
            .collect()
    };
    let mut shared = 0;
    for (i, task) in t.tasks.iter().enumerate() {
        for w in &task.waits {
            let b = bumpers(w.counter);
            // A wait names every bumper of its counter: all tiles of one op.
            assert_eq!(b.len() as u32, w.target, "task {i}: {w:?}");
            let op = t.tasks[b[0] as usize].op;
            let whole = t.tasks.iter().filter(|x| x.op == op).count() as u32;
            assert!(b.iter().all(|&x| t.tasks[x as usize].op == op));
            assert!(w.target == 1 || w.target == whole, "task {i}: {w:?}");
            shared += (w.target > 1) as u32;
        }
    }
    assert!(shared > 0, "no wait on a shared counter");
    let waits = |t: &Tape| t.tasks.iter().map(|x| x.waits.len()).sum::<usize>();
    assert!(
        waits(t) < waits(tape(&tiles, 0)),
        "{} vs {}",
        waits(t),
        waits(tape(&tiles, 0))
    );
    // The query heads' RoPE tasks wait on single QKV tiles (target 1).
    let mut rope_on_qkv = 0;
    for (i, op) in kp.ops.iter().enumerate() {
        let Op::QkvRopeKvWrite { heads, .. } = op.op else {
            continue;
        };
        let qkv = kp.ops[..i]
            .iter()
            .rposition(|o| o.results.iter().any(|r| r.buf == op.args[0].buf))
            .expect("a qkv producer");
        let qkv_tiles = t.tasks.iter().filter(|x| x.op as usize == qkv).count();
        assert!(qkv_tiles > 1, "the qkv GEMV is tiled");
        for task in t
            .tasks
            .iter()
            .filter(|x| x.op as usize == i)
            .take(heads as usize)
        {
            for w in &task.waits {
                if t.tasks[w.counter as usize].op as usize == qkv {
                    assert_eq!(w.target, 1, "a rope head waits for all of the qkv GEMV");
                    rope_on_qkv += 1;
                }
            }
        }
    }
    // (At 3 SMs x 2 queues some heads' columns are on other queues.)
    assert!(rope_on_qkv > 0, "no rope head waits on a qkv tile");
    for i in 0..t.tasks.len() {
        for w in 0..t.tasks[i].waits.len() {
            let mut bad = plan.clone();
            tape_mut(&mut bad, 0).tasks[i].waits.remove(w);
            let e = validate(&bad).expect_err("a tape missing a wait");
            assert!(e.problem.contains("without waiting"), "{e}");
        }
    }
}

#[test]
fn the_verifier_refuses_a_forward_wait_a_reordered_queue_a_missing_task_and_a_wrong_footprint() {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let plan = compile_synth(&spec, &options("cuda:sm_90", "b1q1s0", 2)).plan;
    let refuse = |what: &str, f: &dyn Fn(&mut Tape), needle: &str| {
        let mut bad = plan.clone();
        f(tape_mut(&mut bad, 0));
        let e = validate(&bad).expect_err(what);
        assert!(e.to_string().contains(needle), "{what}: {e}");
    };
    refuse(
        "forward wait",
        &|t| {
            let last = t.tasks.len() as u32 - 1;
            t.tasks[0].waits.push(kiln_ir::Wait {
                counter: last,
                target: 1,
            })
        },
        "deadlock",
    );
    refuse(
        "reordered queue",
        &|t| {
            let q = t.queues.iter_mut().find(|q| q.len() > 1).unwrap();
            q.swap(0, 1);
        },
        "global order",
    );
    refuse(
        "missing task",
        &|t| {
            let q = t.queues.iter_mut().find(|q| !q.is_empty()).unwrap();
            q.pop();
        },
        "is on no queue",
    );
    refuse(
        "duplicate task",
        &|t| {
            let x = t.queues[0][0];
            t.queues[1].insert(0, x);
        },
        "appears twice",
    );
    refuse(
        "shrunken footprint",
        &|t| {
            let task = t.tasks.iter_mut().find(|x| x.reads.len() > 1).unwrap();
            task.reads.pop();
        },
        "footprint",
    );
    refuse(
        "counter out of bounds",
        &|t| t.counters.bytes -= 4,
        "counter",
    );
    refuse(
        "a wait above its counter's bumps",
        &|t| {
            let task = t.tasks.iter_mut().find(|x| !x.waits.is_empty()).unwrap();
            task.waits[0].target = 2;
        },
        "target 2",
    );
    refuse("wrong queue count", &|t| t.blocks_per_sm = 3, "queues");
}

#[test]
fn a_key_with_a_blas_or_skinny_gemm_is_refused_naming_the_op_and_the_graph_schedule() {
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let e = kiln_compiler::compile::compile_traced(
        synth_meta(&spec),
        spec.manifest(),
        &options("cuda:sm_90", "b1q1s0,b16q1s0", 2),
        |k, kv| Ok::<_, String>(spec.graph(k, kv, false)),
        &mut |_, _| {},
    )
    .map(|_| ())
    .expect_err("16 tokens are more than the GEMV takes: BLAS GEMMs");
    let CompileError::Megakernel(_) = &e else {
        panic!("expected a megakernel refusal, got {e}")
    };
    let msg = e.to_string();
    assert!(msg.contains("key b16q1s0"), "{msg}");
    assert!(msg.contains("`matmul`"), "{msg}");
    assert!(msg.contains("--schedule graph"), "{msg}");
}

#[test]
fn a_megakernel_plan_round_trips_through_the_artifact_and_validates_again() {
    let spec = SynthSpec::tiny(SynthFamily::Qwen2);
    let plan = compile_synth(&spec, &options("cpu", "b1q1s0,b4q1s0", 4)).plan;
    let back = kiln_ir::artifact::decode(&kiln_ir::artifact::encode(&plan)).unwrap();
    assert_eq!(back, plan);
    validate(&back).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn inspect_shows_the_tape_with_queues_dependencies_and_bytes_read() {
    use kiln_compiler::inspect::{render, Format};
    let spec = SynthSpec::tiny(SynthFamily::Llama);
    let plan = compile_synth(&spec, &options("cpu", "b1q1s0", 2)).plan;
    let text = render(&plan, None, Format::Text).unwrap();
    let t = tape(&plan, 0);
    assert!(text.contains(&format!(
        "schedule    megakernel: 2 SMs x 2 blocks per SM = 4 queues, {} tasks",
        t.tasks.len()
    )));
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/megakernel_llama_b1q1s0.txt");
    kiln_ir::check_golden(&path, &text);
    let json: serde_json::Value =
        serde_json::from_str(&render(&plan, None, Format::Json).unwrap()).unwrap();
    let tasks = json["keys"][0]["tape"]["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), t.tasks.len());
    for (j, x) in tasks.iter().zip(&t.tasks) {
        assert_eq!(j["read_bytes"].as_u64(), Some(x.read_bytes()));
        assert_eq!(j["waits"].as_array().unwrap().len(), x.waits.len());
    }
    // A graph-schedule plan prints no tape.
    let graph = compile_synth(
        &spec,
        &CompileOptions {
            schedule: ScheduleKind::Graph,
            ..options("cpu", "b1q1s0", 2)
        },
    )
    .plan;
    let gj = render(&graph, None, Format::Json).unwrap();
    assert!(!gj.contains("\"tape\""));
    assert!(!render(&graph, None, Format::Text)
        .unwrap()
        .contains("schedule"));
}

/// Scheduling and verifying a real shape stays cheap (run by hand:
/// `cargo test -p kiln-compiler --test megakernel -- --ignored --nocapture`).
#[test]
#[ignore]
fn scheduling_and_verifying_qwen3_0_6b_at_132_sms_takes_seconds_not_minutes() {
    let spec = SynthSpec::qwen3_0_6b();
    let mut opts = options("cuda:sm_90", "b1q1s0,b8q1s0", 132);
    opts.megakernel = MegakernelOptions::default();
    let t0 = std::time::Instant::now();
    let plan = compile_synth(&spec, &opts).plan;
    let t1 = std::time::Instant::now();
    validate(&plan).unwrap_or_else(|e| panic!("{e}"));
    let t2 = std::time::Instant::now();
    let t = tape(&plan, 0);
    let waits: usize = t.tasks.iter().map(|x| x.waits.len()).sum();
    let bytes = kiln_ir::artifact::encode(&plan).len();
    println!(
        "{} tasks, {waits} waits, plan {bytes} bytes; compile {:?}, validate {:?}",
        t.tasks.len(),
        t1 - t0,
        t2 - t1
    );
    for kp in &plan.keys {
        let span =
            kiln_compiler::passes::megakernel::estimated_span_ns(kp, kp.schedule.tape().unwrap());
        println!("key {}: estimated span {:.1} us", kp.key, span as f64 / 1e3);
    }
    assert!((t2 - t1).as_secs() < 60);
}

#[test]
fn the_estimate_replays_the_tape_under_the_cost_model_and_charges_each_hop_on_its_path() {
    use kiln_compiler::passes::megakernel::estimate;
    let spec = SynthSpec::tiny(SynthFamily::Qwen3);
    let plan = compile_synth(&spec, &options("cuda:sm_90", "b1q1s0", 8)).plan;
    let (kp, t) = (&plan.keys[0], tape(&plan, 0));
    let free = estimate(kp, t, 0).unwrap();
    let hop = 5000;
    let charged = estimate(kp, t, hop).unwrap();
    // A step is at least as long as its path's tasks, and the path crosses
    // queues (every GEMV tile reads the whole previous vector).
    assert!(free.path_tasks > 1 && charged.path_hops > 0, "{charged:?}");
    assert!(charged.path_hops < charged.path_tasks);
    // Charging hops lengthens the step by at least one hop (the path
    // crosses queues) and by at most one hop per link of the charged path.
    assert!(charged.span_ns >= free.span_ns + hop);
    assert!(
        charged.span_ns <= free.span_ns + hop * u64::from(charged.path_tasks),
        "{free:?} {charged:?}"
    );
    // A wait on a later task is no tape: refused, not looped on.
    let mut bad = t.clone();
    let last = bad.tasks.len() as u32 - 1;
    bad.tasks[0].waits.push(kiln_ir::schedule::Wait {
        counter: last,
        target: 1,
    });
    assert!(estimate(kp, &bad, 0).is_err());
}
