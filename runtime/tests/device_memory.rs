//! A plan that cannot fit the device is refused at load before anything
//! is allocated, naming what it needs and what the device has free: on the
//! CPU backend (its memory limit, or the host's available memory) and on
//! the GPU backend over the simulated driver (its memory limit, as
//! `cuMemGetInfo` / `hipMemGetInfo` would report it).

mod common;

use common::{build, options, TinyModel};
use kiln_ir::plan::Target;
use kiln_runtime::backend::Backend;
use kiln_runtime::cpu::{CpuBackend, CpuStats};
use kiln_runtime::gpu::sim::{SimConfig, SimDriver};
use kiln_runtime::gpu::GpuBackend;
use kiln_runtime::{Engine, EngineError, GraphMode};

fn refused(r: Result<Engine, EngineError>) -> EngineError {
    match r {
        Ok(_) => panic!("the plan should not fit"),
        Err(e) => e,
    }
}

#[test]
fn a_plan_larger_than_the_cpu_backends_memory_is_refused_before_any_allocation() {
    let (dir, plan) = build(&TinyModel::default());
    let need = plan.device_memory().total();
    assert!(need > plan.device_memory().weights, "every region counts");
    for limit in [need / 2, need - 1] {
        let be = CpuBackend::new().with_memory_limit(limit);
        let stats = be.stats();
        let err = refused(Engine::new(
            plan.clone(),
            dir.path(),
            Box::new(be),
            options(GraphMode::On),
        ));
        match &err {
            EngineError::DeviceTooSmall {
                need_bytes, free, ..
            } => assert_eq!((*need_bytes, *free), (need, limit)),
            other => panic!("{other}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains(&need.to_string()) && msg.contains(&limit.to_string()),
            "{msg}"
        );
        assert!(
            msg.contains("--kv-blocks"),
            "the message names a fix: {msg}"
        );
        assert_eq!(CpuStats::get(&stats.allocs), 0, "a refused plan allocated");
    }
    // Exactly enough loads, and uses all of it.
    let be = CpuBackend::new().with_memory_limit(need);
    let stats = be.stats();
    let e = Engine::new(plan, dir.path(), Box::new(be), options(GraphMode::On)).unwrap();
    assert_eq!(CpuStats::get(&stats.live_bytes), need);
    drop(e);
}

#[test]
fn the_cpu_backend_reports_what_is_left_of_its_limit_or_the_hosts_memory() {
    let mut be = CpuBackend::new().with_memory_limit(10_000);
    assert_eq!(be.free_memory().unwrap(), Some(10_000));
    be.alloc(4096, "test").unwrap();
    assert_eq!(be.free_memory().unwrap(), Some(10_000 - 4096));
    if std::path::Path::new("/proc/meminfo").exists() {
        let host = CpuBackend::new().free_memory().unwrap();
        assert!(host.is_some_and(|b| b > 0), "{host:?}");
    }
}

#[test]
fn a_plan_larger_than_the_simulated_devices_free_memory_is_refused_before_any_allocation() {
    let model = TinyModel::default();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = SimConfig::hip();
    let plan = model
        .build_for(
            dir.path(),
            Target::Hip {
                gfx: cfg.arch.clone(),
            },
        )
        .unwrap();
    let need = plan.device_memory().total();
    cfg.memory_limit = need - 100;
    let driver = SimDriver::new(cfg);
    let journal = driver.journal();
    let mut be = GpuBackend::with_driver(driver, 0).unwrap();
    let free = be
        .free_memory()
        .unwrap()
        .expect("the simulated driver tells");
    assert!(free <= need - 100 && free + 4096 > need - 100, "{free}");
    let mallocs = || {
        let log = journal.read().log;
        log.iter().filter(|c| c.starts_with("malloc")).count()
    };
    let before = mallocs();
    let err = refused(Engine::new(
        plan,
        dir.path(),
        Box::new(be),
        options(GraphMode::On),
    ));
    let msg = err.to_string();
    assert!(
        matches!(err, EngineError::DeviceTooSmall { need_bytes, free: f, .. } if need_bytes == need && f == free),
        "{msg}"
    );
    assert!(msg.contains("simulated AMD Instinct MI250X"), "{msg}");
    assert_eq!(mallocs(), before, "a refused plan reached malloc");
}
