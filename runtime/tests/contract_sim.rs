//! The backend contract's shared bodies (`contract/mod.rs`) on the one GPU
//! backend over the simulated driver, in a CUDA and a HIP flavour, then what
//! only a driver that logs every call can show: forbidden calls never reach
//! the device, the teardown order, failure paths, image checks, and the
//! GEMM implementation choice.

#[macro_use]
mod contract;

use contract::{f32_operand, Gemm, Target};
use kiln_ir::plan::GemmKind;
use kiln_ir::{Key, Op};
use kiln_runtime::backend::{
    Backend, BackendError, DevPtr, Launch, LaunchBody, ResolvedKernel, ResolvedParam,
};
use kiln_runtime::gpu::driver::Vendor;
use kiln_runtime::gpu::sim::{LiveAtDrop, SimConfig, SimDriver};
use kiln_runtime::gpu::{GemmChoice, GpuBackend};

type SimBackend = GpuBackend<SimDriver>;

struct Sim(SimConfig);

fn kernel(entry: &str, params: Vec<ResolvedParam>) -> ResolvedKernel {
    ResolvedKernel {
        module: "sim".into(),
        entry: entry.into(),
        grid: [4, 1, 1],
        block: [256, 1, 1],
        shared_bytes: 0,
        params,
        pdl: true,
        cluster: 1,
    }
}

/// A GEMM launch run as `kind`: the simulated `gemv_f32` / `skinny_f32`
/// kernel (kiln's GEMV parameter layout) or the library.
fn gemm_launch(g: Gemm, ws: Option<(DevPtr, u64)>, kind: GemmKind) -> Launch {
    let shape = g.shape();
    let entry = match kind {
        GemmKind::Gemv => "gemv_f32",
        GemmKind::Skinny => "skinny_f32",
        GemmKind::Blas => "",
    };
    let kernel = kind.module().map(|m| {
        let mut k = kernel(
            entry,
            vec![
                ResolvedParam::Ptr(g.x),
                ResolvedParam::Ptr(g.w),
                ResolvedParam::Ptr(DevPtr(0)),
                ResolvedParam::Ptr(g.out),
                ResolvedParam::I32(g.t as i32),
                ResolvedParam::I32(g.n as i32),
                ResolvedParam::I32(g.k as i32),
            ],
        );
        k.module = m.into();
        k
    });
    g.launch(
        ws,
        LaunchBody::Gemm {
            shape,
            kind,
            kernel,
        },
    )
}

impl Target for Sim {
    type B = SimBackend;
    fn open(&self) -> SimBackend {
        let driver = SimDriver::new(self.0.clone());
        let image = driver.builtin_image();
        let mut b = GpuBackend::with_driver(driver, 0).unwrap();
        b.load_kernels(&[image]).unwrap();
        b
    }
    fn add(&self, a: DevPtr, b: DevPtr, c: DevPtr, n: u32) -> Launch {
        Launch {
            kernel: "add_f32".into(),
            op: Op::Add,
            args: vec![f32_operand(a, vec![n]), f32_operand(b, vec![n])],
            results: vec![f32_operand(c, vec![n])],
            workspace: None,
            const_args: 0,
            body: LaunchBody::Kernels(vec![kernel(
                "add_f32",
                vec![
                    ResolvedParam::Ptr(a),
                    ResolvedParam::Ptr(b),
                    ResolvedParam::Ptr(c),
                    ResolvedParam::I32(n as i32),
                ],
            )]),
        }
    }
    fn gemm(&self, g: Gemm, ws: Option<(DevPtr, u64)>) -> Launch {
        gemm_launch(g, ws, GemmKind::Blas)
    }
    fn replays(&self, b: &SimBackend) -> u64 {
        b.counters().graphs.replays()
    }
    fn require_workspace(&self, b: &mut SimBackend, bytes: u64) -> bool {
        b.driver_mut().set_algorithm_workspace(bytes);
        true
    }
}

mod cuda_flavour {
    use super::*;
    contract_tests!(Some(Sim(SimConfig::cuda())), workspace);
}

mod hip_flavour {
    use super::*;
    contract_tests!(Some(Sim(SimConfig::hip())), workspace);
}

fn both() -> [Sim; 2] {
    [Sim(SimConfig::cuda()), Sim(SimConfig::hip())]
}

fn buffers(b: &mut SimBackend, n: u32) -> (DevPtr, DevPtr, DevPtr) {
    (
        b.alloc(n as u64 * 4, "x").unwrap(),
        b.alloc(n as u64 * 4, "y").unwrap(),
        b.alloc(n as u64 * 4, "z").unwrap(),
    )
}

#[test]
fn forbidden_calls_inside_a_capture_never_reach_the_device() {
    for t in both() {
        let mut b = t.open();
        let p = b.alloc(256, "p").unwrap();
        b.begin_capture(Key::new(1, 1, 0)).unwrap();
        let before = b.driver().log().len();
        assert!(b.alloc(16, "x").is_err());
        assert!(b.free(p).is_err());
        assert!(b.synchronize().is_err());
        assert!(b.download(p, &mut [0; 4]).is_err());
        assert!(b.upload(p, &[0; 4]).is_err());
        assert!(b.reserve_workspace(1024).is_err());
        assert!(b.mark().is_err());
        assert_eq!(b.driver().log().len(), before, "{:?}", b.driver().log());
        let g = b.end_capture().unwrap();
        b.replay(g).unwrap();
        assert!(
            b.driver().violations().is_empty(),
            "{:?}",
            b.driver().violations()
        );
    }
}

#[test]
fn teardown_synchronizes_before_destroying_graphs_and_releases_blas_before_memory() {
    for t in both() {
        let mut b = t.open();
        let (x, y, z) = buffers(&mut b, 64);
        let l = t.add(x, y, z, 64);
        b.prepare(&l).unwrap();
        let ws = b.reserve_workspace(4096).unwrap();
        let g = gemm_launch(
            Gemm {
                x,
                w: y,
                out: z,
                t: 2,
                n: 4,
                k: 8,
            },
            ws,
            GemmKind::Blas,
        );
        b.prepare(&g).unwrap();
        b.begin_capture(Key::new(1, 1, 0)).unwrap();
        b.launch(&l).unwrap();
        b.launch(&g).unwrap();
        let graph = b.end_capture().unwrap();
        b.replay(graph).unwrap();
        let journal = b.driver().journal();
        drop(b);
        let j = journal.read();
        let log = j.log;
        let pos = |name: &str| log.iter().rposition(|l| l.starts_with(name)).unwrap();
        let sync = pos("stream_synchronize");
        assert!(sync < pos("exec_destroy"), "{log:?}");
        assert!(pos("blas_destroy") < pos("free"), "{log:?}");
        assert!(j.violations.is_empty(), "{:?}", j.violations);
        assert_eq!(
            j.at_drop,
            Some(LiveAtDrop::default()),
            "everything was released"
        );
    }
}

fn small_gemm(b: &mut SimBackend) -> Gemm {
    let (t, n, k) = (2u32, 4u32, 8u32);
    let x = b.alloc((t * k) as u64 * 4, "x").unwrap();
    let w = b.alloc((n * k) as u64 * 4, "w").unwrap();
    let out = b.alloc((t * n) as u64 * 4, "out").unwrap();
    b.upload(x, &contract::f32_bytes(&vec![1.0; (t * k) as usize]))
        .unwrap();
    b.upload(w, &contract::f32_bytes(&vec![2.0; (n * k) as usize]))
        .unwrap();
    Gemm { x, w, out, t, n, k }
}

#[test]
fn a_launch_the_plan_did_not_lower_is_refused_naming_the_op_and_the_fix() {
    for t in both() {
        let mut b = t.open();
        let (x, y, z) = buffers(&mut b, 16);
        let mut l = t.add(x, y, z, 16);
        l.body = LaunchBody::Reference;
        for e in [b.prepare(&l).unwrap_err(), b.launch(&l).unwrap_err()] {
            let m = e.to_string();
            assert!(
                m.contains("add_f32") && m.contains("not lowered for this target; recompile"),
                "{m}"
            );
            assert!(m.contains(&b.info().arch), "{m}");
        }
    }
}

#[test]
fn images_for_another_vendor_or_architecture_are_refused_with_the_fix() {
    for t in both() {
        let mut b = t.open();
        let vendor = b.driver().vendor_of_config();
        let other = match vendor {
            Vendor::Cuda => Vendor::Hip,
            Vendor::Hip => Vendor::Cuda,
        };
        let arch = b.info().arch;
        let foreign = SimDriver::image(other, "k", &arch, &["add_f32"]);
        let e = b.load_kernels(&[foreign]).unwrap_err().to_string();
        assert!(e.contains("recompile it with kiln compile --target"), "{e}");
        let wrong_arch = SimDriver::image(vendor, "k", "sm_00", &["add_f32"]);
        let e = b.load_kernels(&[wrong_arch]).unwrap_err().to_string();
        assert!(
            e.contains("has no code for this device") && e.contains(&arch),
            "{e}"
        );
    }
}

#[test]
fn a_kernel_missing_from_the_modules_is_refused_at_prepare() {
    for t in both() {
        let mut b = t.open();
        let (x, y, z) = buffers(&mut b, 16);
        let mut l = t.add(x, y, z, 16);
        if let LaunchBody::Kernels(ks) = &mut l.body {
            ks[0].entry = "no_such_kernel".into();
        }
        assert!(matches!(
            b.prepare(&l),
            Err(BackendError::MissingKernel(e)) if e == "no_such_kernel"
        ));
    }
}

#[test]
fn a_launch_not_prepared_before_capture_fails_the_capture_naming_key_and_op() {
    for t in both() {
        let mut b = t.open();
        let g = small_gemm(&mut b);
        let l = t.gemm(g, None);
        let key = Key::new(2, 1, 0);
        b.begin_capture(key).unwrap();
        match b.launch(&l).unwrap_err() {
            BackendError::CaptureFailed {
                key: k,
                op,
                message,
            } => {
                assert_eq!(k, key);
                assert!(op.contains("matmul_f32"), "{op}");
                assert!(message.contains("not prepared before capture"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        b.abort_capture().unwrap();
    }
}

#[test]
fn a_failed_end_of_capture_names_the_last_op_and_a_failed_instantiation_leaks_no_graph() {
    for t in both() {
        let mut b = t.open();
        let (x, y, z) = buffers(&mut b, 16);
        let l = t.add(x, y, z, 16);
        b.prepare(&l).unwrap();
        b.driver_mut().fail_on("end_capture", 1);
        b.begin_capture(Key::new(1, 1, 0)).unwrap();
        b.launch(&l).unwrap();
        match b.end_capture().unwrap_err() {
            BackendError::CaptureFailed { op, .. } => assert_eq!(op, "add_f32"),
            other => panic!("{other:?}"),
        }
        b.driver_mut().fail_on("instantiate", 1);
        b.begin_capture(Key::new(1, 1, 0)).unwrap();
        b.launch(&l).unwrap();
        match b.end_capture().unwrap_err() {
            BackendError::CaptureFailed { key, op, .. } => {
                assert_eq!((key, op.as_str()), (Key::new(1, 1, 0), "graph instantiate"))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(b.driver().live_graphs(), (0, 0));
        // Usable again.
        b.begin_capture(Key::new(1, 1, 0)).unwrap();
        b.launch(&l).unwrap();
        let g = b.end_capture().unwrap();
        b.replay(g).unwrap();
    }
}

#[test]
fn out_of_memory_names_the_request() {
    let mut cfg = SimConfig::hip();
    cfg.memory_limit = 1000;
    let mut b = Sim(cfg).open();
    match b.alloc(4096, "KV cache").unwrap_err() {
        BackendError::OutOfMemory { bytes, what } => {
            assert_eq!((bytes, what.as_str()), (4096, "KV cache"))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_pdl_attribute_reaches_the_driver_only_where_the_device_supports_it() {
    for (t, want) in [
        (Sim(SimConfig::cuda()), true),
        (Sim(SimConfig::hip()), false),
    ] {
        let mut b = t.open();
        assert_eq!(b.pdl(), want);
        let (x, y, z) = buffers(&mut b, 16);
        b.launch(&t.add(x, y, z, 16)).unwrap();
        let log = b.driver().log();
        let launch = log
            .iter()
            .rfind(|l| l.starts_with("launch_kernel"))
            .unwrap();
        assert_eq!(launch.contains("pdl"), want, "{launch}");
        b.set_pdl(false);
        b.launch(&t.add(x, y, z, 16)).unwrap();
        let log = b.driver().log();
        let launch = log
            .iter()
            .rfind(|l| l.starts_with("launch_kernel"))
            .unwrap();
        assert!(!launch.contains("pdl"), "{launch}");
    }
}

#[test]
fn a_cluster_launch_reaches_the_cuda_driver_and_is_refused_on_hip() {
    for (t, ok) in [
        (Sim(SimConfig::cuda()), true),
        (Sim(SimConfig::hip()), false),
    ] {
        let mut b = t.open();
        let (x, y, z) = buffers(&mut b, 16);
        let mut l = t.add(x, y, z, 16);
        let LaunchBody::Kernels(ks) = &mut l.body else {
            panic!("a kernel body")
        };
        ks[0].grid = [4, 1, 1];
        ks[0].cluster = 2;
        let got = b.prepare(&l).and_then(|()| b.launch(&l));
        let log = b.driver().log();
        if ok {
            got.unwrap();
            let launch = log
                .iter()
                .rfind(|l| l.starts_with("launch_kernel"))
                .unwrap();
            assert!(launch.contains("cluster 2"), "{launch}");
        } else {
            let e = got.unwrap_err().to_string();
            assert!(e.contains("cluster"), "{e}");
        }
    }
}

/// `out[t, n] = sum_k x[t, k] w[n, k]`, computed here independently.
fn reference_gemm(x: &[f32], w: &[f32], t: usize, n: usize, k: usize) -> Vec<f32> {
    let mut o = vec![0.0; t * n];
    for i in 0..t {
        for j in 0..n {
            o[i * n + j] = (0..k).map(|l| x[i * k + l] * w[j * k + l]).sum();
        }
    }
    o
}

#[test]
fn each_gemm_runs_as_the_plan_recorded_eagerly_and_under_replay_with_changing_inputs() {
    for t in both() {
        let mut b = t.open();
        let g = small_gemm(&mut b);
        let (tt, n, k) = (g.t as usize, g.n as usize, g.k as usize);
        let w: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 - 3.0).collect();
        b.upload(g.w, &contract::f32_bytes(&w)).unwrap();
        for (i, kind) in GemmKind::ALL.into_iter().enumerate() {
            let l = gemm_launch(g, None, kind);
            b.prepare(&l).unwrap();
            let choice = b.gemm_choice(&l).unwrap();
            match kind {
                GemmKind::Blas => assert!(matches!(choice, GemmChoice::Blas(_)), "{choice:?}"),
                k => assert_eq!(choice, GemmChoice::Kernel(k)),
            }
            let key = Key::new(1 + i as u32, 1, 0);
            let before = b.counters().clone();
            b.begin_capture(key).unwrap();
            b.launch(&l).unwrap();
            let graph = b.end_capture().unwrap();
            for step in 0..3 {
                let x: Vec<f32> = (0..tt * k)
                    .map(|j| ((j + 3 * step + i) % 5) as f32 - 2.0)
                    .collect();
                b.upload(g.x, &contract::f32_bytes(&x)).unwrap();
                b.upload(g.out, &contract::f32_bytes(&vec![f32::NAN; tt * n]))
                    .unwrap();
                if step == 0 {
                    b.launch(&l).unwrap();
                } else {
                    b.replay(graph).unwrap();
                }
                let mut out = vec![0u8; tt * n * 4];
                b.download(g.out, &mut out).unwrap();
                assert_eq!(
                    contract::bytes_f32(&out),
                    reference_gemm(&x, &w, tt, n, k),
                    "{kind} step {step}"
                );
            }
            let after = b.counters();
            let ran = |a: u64, z: u64| a - z;
            // One capture recording plus one eager run.
            assert_eq!(
                (
                    ran(after.gemv_calls, before.gemv_calls),
                    ran(after.skinny_calls, before.skinny_calls),
                    ran(after.blas_calls, before.blas_calls),
                ),
                match kind {
                    GemmKind::Gemv => (2, 0, 0),
                    GemmKind::Skinny => (0, 2, 0),
                    GemmKind::Blas => (0, 0, 2),
                },
                "{kind}"
            );
            assert_eq!(b.counters().graphs.replays() - before.graphs.replays(), 2);
        }
    }
}

#[test]
fn a_gemm_choice_the_backend_cannot_run_is_refused_at_prepare_naming_the_fix() {
    for t in both() {
        let mut b = t.open();
        let g = small_gemm(&mut b);
        // A skinny GEMM whose kernel the loaded modules do not define.
        let mut l = gemm_launch(g, None, GemmKind::Skinny);
        if let LaunchBody::Gemm {
            kernel: Some(k), ..
        } = &mut l.body
        {
            k.entry = "skinny_t8_r1_bf16_bf16".into();
        }
        let m = b.prepare(&l).unwrap_err().to_string();
        assert!(
            m.contains("`skinny`")
                && m.contains("skinny_t8_r1_bf16_bf16")
                && m.contains("recompile"),
            "{m}"
        );
        // A kind whose launch is of another module, and one without any.
        let mut l = gemm_launch(g, None, GemmKind::Gemv);
        if let LaunchBody::Gemm { kind, .. } = &mut l.body {
            *kind = GemmKind::Skinny;
        }
        let m = b.prepare(&l).unwrap_err().to_string();
        assert!(m.contains("damaged") && m.contains("module `gemv`"), "{m}");
        let mut l = gemm_launch(g, None, GemmKind::Blas);
        if let LaunchBody::Gemm { kind, .. } = &mut l.body {
            *kind = GemmKind::Gemv;
        }
        let m = b.prepare(&l).unwrap_err().to_string();
        assert!(m.contains("damaged") && m.contains("no kernel"), "{m}");
        assert!(b.launch(&l).is_err());
    }
}

#[test]
fn copy_bandwidth_is_measured_between_events_and_its_buffers_are_freed() {
    let t = Sim(SimConfig::cuda());
    let mut b = t.open();
    let bw = b.copy_bandwidth(1 << 20, 3).unwrap().unwrap();
    // The simulated device copies at 1 byte per picosecond-ish: 1e12 B/s
    // counted once per direction.
    assert!((bw - 2e12).abs() / 2e12 < 1e-3, "{bw}");
    assert!(b.live_allocations().is_empty());
}

#[test]
fn a_workspace_grown_before_any_capture_frees_the_old_one_and_after_a_capture_retires_it() {
    let t = Sim(SimConfig::cuda());
    let mut b = t.open();
    b.reserve_workspace(1024).unwrap();
    b.reserve_workspace(2048).unwrap();
    assert_eq!(b.counters().retired_buffers, 0);
    assert_eq!(b.driver().live_allocations(), 1);
    b.begin_capture(Key::new(1, 1, 0)).unwrap();
    let g = b.end_capture().unwrap();
    b.reserve_workspace(4096).unwrap();
    assert_eq!(b.counters().retired_buffers, 1);
    assert_eq!(b.driver().live_allocations(), 2);
    b.destroy_graph(g).unwrap();
}

#[test]
fn a_kernel_pointer_outside_every_allocation_is_refused_before_the_launch() {
    for t in both() {
        let mut b = t.open();
        let (x, y, z) = buffers(&mut b, 16);
        let mut l = t.add(x, y, z, 16);
        if let LaunchBody::Kernels(ks) = &mut l.body {
            ks[0].params[1] = ResolvedParam::Ptr(DevPtr(0x10));
        }
        let launches = b.counters().kernel_launches;
        assert!(matches!(b.launch(&l), Err(BackendError::BadAddress(0x10))));
        assert_eq!(b.counters().kernel_launches, launches);
    }
}

#[test]
fn timing_marks_older_than_the_event_ring_are_refused_not_misread() {
    let t = Sim(SimConfig::cuda());
    let mut b = t.open();
    let first = b.mark().unwrap();
    let mut last = first;
    for _ in 0..64 {
        last = b.mark().unwrap();
    }
    let e = b.elapsed_ms(first, last).unwrap_err().to_string();
    assert!(e.contains("no longer live"), "{e}");
    let cpu_mark = kiln_runtime::backend::TimingMark::host_now();
    assert!(b.elapsed_ms(cpu_mark, last).is_err());
}
