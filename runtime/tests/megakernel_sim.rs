//! The megakernel schedule's runtime path without a GPU: a tiny model
//! compiled for `cuda:sm_90` with `--schedule megakernel`, loaded by the
//! engine on the GPU backend over the simulated driver. The engine encodes
//! each key's tape into one device buffer, the backend checks co-residency
//! with the driver's occupancy answer at load, and every step is two
//! kernels (the counter reset, then one interpreter block per queue). The
//! simulated driver walks the uploaded tape from device memory (the
//! interpreter's control path: waits, then counter bumps), so a tape image
//! whose waits could not be met would hang there and fail the step.
//!
//! Not here: the tasks' math (the simulated driver runs none of it; the
//! H200 tests in `tests/tests/cuda_serve.rs` and
//! `kernels/tests/megakernel_gpu.rs` do).

use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::passes::megakernel::{MegakernelOptions, ScheduleKind};
use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
use kiln_ir::plan::{ImageKind, Plan, Target};
use kiln_ir::Key;
use kiln_runtime::gpu::sim::{SimConfig, SimDriver};
use kiln_runtime::gpu::GpuBackend;
use kiln_runtime::{Engine, EngineOptions, GraphMode, Weights};

const KEYS: &str = "b1q1s0,b2q1s0";

/// A tiny Llama compiled for the simulated H200 with a tape per key cut
/// for `sms` SMs, one block each; its kernel images replaced by simulated
/// ones that define the interpreter's two entries.
fn plan(sms: u32) -> (tempfile::TempDir, Plan) {
    plan_with(sms, 1)
}

fn plan_with(sms: u32, blocks_per_sm: u32) -> (tempfile::TempDir, Plan) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(
        dir.path(),
        Family::Llama,
        &TinySpec::for_family(Family::Llama),
    )
    .unwrap();
    let opts = CompileOptions {
        keys: KEYS.split(',').map(|k| k.parse::<Key>().unwrap()).collect(),
        target: Target::Cuda { sm: 90 },
        kv: KvOptions {
            max_context: Some(64),
            ..KvOptions::default()
        },
        schedule: ScheduleKind::Megakernel,
        megakernel: MegakernelOptions {
            sm_count: sms,
            blocks_per_sm,
            min_tile: 8,
            counters: Default::default(),
        },
        ..CompileOptions::default()
    };
    let mut plan = compile_dir(dir.path(), &opts, &mut |_, _| {}).unwrap().plan;
    for img in &mut plan.kernels {
        assert_eq!(img.kind, ImageKind::Cubin);
        let entries: &[&str] = if img.name == kiln_ir::schedule::INTERPRETER_MODULE {
            &["megakernel_reset", "megakernel_run"]
        } else {
            &[]
        };
        *img = SimDriver::image(
            kiln_runtime::gpu::driver::Vendor::Cuda,
            &img.name,
            "sm_90",
            entries,
        );
    }
    (dir, plan)
}

fn options(graphs: GraphMode) -> EngineOptions {
    EngineOptions {
        graphs,
        log: false,
        ..EngineOptions::default()
    }
}

#[test]
fn every_megakernel_key_steps_as_a_counter_reset_and_one_interpreter_block_per_queue() {
    let (_dir, plan) = plan(4);
    assert!(plan.kernels.iter().any(|k| k.name == "megakernel"));
    for graphs in [GraphMode::Off, GraphMode::On] {
        let driver = SimDriver::new(SimConfig::cuda());
        let journal = driver.journal();
        let be = GpuBackend::with_driver(driver, 0).unwrap();
        let mut e = Engine::with_weights(
            plan.clone(),
            Weights::Random { seed: 7 },
            Box::new(be),
            options(graphs),
        )
        .unwrap();
        for kp in &plan.keys {
            assert!(e.runs_megakernel(kp.key), "{}", kp.key);
        }
        let log = journal.read().log;
        // Co-residency is asked at load, once per key, with the GEMV
        // weight stage the device granted.
        let stage = kiln_kernels::megakernel::WEIGHT_STAGE_BYTES;
        assert_eq!(
            log.iter()
                .filter(|c| **c
                    == format!("occupancy(megakernel_run, 256 threads, {stage} shared)"))
                .count(),
            plan.keys.len(),
            "{log:#?}"
        );
        // Two sequences at once use the b2 key, one alone the b1 key.
        let a = e.add_sequence(&[1, 2, 3]).unwrap();
        for _ in 0..3 {
            e.step().unwrap();
        }
        let b = e.add_sequence(&[4, 5]).unwrap();
        for _ in 0..3 {
            e.step().unwrap();
        }
        assert!(e.sequence(a).is_some() && e.sequence(b).is_some());
        let log = journal.read().log;
        let launches: Vec<&String> = log
            .iter()
            .filter(|c| c.starts_with("launch_kernel("))
            .collect();
        // Nothing but the interpreter ever launched (eagerly or recorded).
        assert!(!launches.is_empty());
        let run = format!("launch_kernel(megakernel_run, shared {stage})");
        assert!(
            launches
                .iter()
                .all(|c| *c == "launch_kernel(megakernel_reset)" || **c == run),
            "{launches:#?}"
        );
        assert!(journal.read().violations.is_empty());
        let c = e.total_counters();
        match graphs {
            GraphMode::On => assert!(c.replays >= 4, "{c:?}"),
            _ => assert!(c.eager_steps >= 6 && c.replays == 0, "{c:?}"),
        }
    }
}

#[test]
fn a_tape_needing_more_co_resident_blocks_than_the_device_holds_is_refused_at_load() {
    // 200 queues on a simulated 132-SM part holding one block per SM.
    let (_dir, plan) = plan(200);
    let mut cfg = SimConfig::cuda();
    cfg.blocks_per_sm = 1;
    let be = GpuBackend::with_driver(SimDriver::new(cfg), 0).unwrap();
    let err = Engine::with_weights(
        plan.clone(),
        Weights::Random { seed: 7 },
        Box::new(be),
        options(GraphMode::On),
    )
    .err()
    .expect("refused");
    let msg = err.to_string();
    assert!(
        msg.contains("200 co-resident blocks") && msg.contains("holds 1 per SM on 132 SMs"),
        "{msg}"
    );
    assert!(msg.contains("--megakernel-sms 132"), "{msg}");
    // A driver that cannot say how many blocks fit runs no tape.
    let mut cfg = SimConfig::cuda();
    cfg.blocks_per_sm = 0;
    let be = GpuBackend::with_driver(SimDriver::new(cfg), 0).unwrap();
    let (_dir, small) = self::plan(4);
    let err = Engine::with_weights(
        small,
        Weights::Random { seed: 7 },
        Box::new(be),
        options(GraphMode::On),
    )
    .err()
    .expect("refused");
    assert!(err.to_string().contains("occupancy"), "{err}");
}

#[test]
fn the_weight_stage_is_granted_where_the_device_has_room_and_dropped_where_it_costs_co_residency() {
    let stage = kiln_kernels::megakernel::WEIGHT_STAGE_BYTES;
    // (blocks per SM the tape needs, dynamic shared memory the device
    // grants, shared memory per SM) -> what the interpreter launches with.
    for (blocks, grantable, per_sm, want) in [
        // One block per SM: the whole request.
        (1, 189 << 10, 228 << 10, stage),
        // A smaller part (an sm_80-sized opt-in): what it has.
        (1, 120 << 10, 164 << 10, 120 << 10),
        // Two blocks per SM would not fit beside a 184 KiB stage: none.
        (2, 189 << 10, 228 << 10, 0),
        // A driver that grants nothing: none.
        (1, 0, 228 << 10, 0),
    ] {
        let (_dir, plan) = plan_with(4, blocks);
        let mut cfg = SimConfig::cuda();
        cfg.dynamic_shared = grantable;
        cfg.shared_per_sm = per_sm;
        let driver = SimDriver::new(cfg);
        let journal = driver.journal();
        let be = GpuBackend::with_driver(driver, 0).unwrap();
        let mut e = Engine::with_weights(
            plan,
            Weights::Random { seed: 7 },
            Box::new(be),
            options(GraphMode::Off),
        )
        .unwrap_or_else(|e| panic!("{blocks} blocks, {grantable} grantable: {e}"));
        e.add_sequence(&[1, 2, 3]).unwrap();
        e.step().unwrap();
        let log = journal.read().log;
        let run = if want > 48 << 10 {
            format!("launch_kernel(megakernel_run, shared {want})")
        } else {
            "launch_kernel(megakernel_run)".to_string()
        };
        assert!(
            log.contains(&run),
            "{blocks} blocks, {grantable} grantable: no `{run}` in {log:#?}"
        );
        assert!(journal.read().violations.is_empty());
    }
}
