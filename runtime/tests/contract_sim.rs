//! The backend contract's shared bodies (`contract/mod.rs`) on the one GPU
//! backend over the simulated driver, in a CUDA and a HIP flavour, then what
//! only a driver that logs every call can show: forbidden calls never reach
//! the device, the teardown order, failure paths, image checks, and the
//! GEMM implementation choice.

#[macro_use]
mod contract;

use contract::{f32_operand, Gemm, Target};
use kiln_ir::plan::GemmShape;
use kiln_ir::{DType, Key, Op};
use kiln_runtime::backend::{
    Backend, BackendError, DevPtr, Launch, LaunchBody, ResolvedKernel, ResolvedParam,
};
use kiln_runtime::gpu::driver::Vendor;
use kiln_runtime::gpu::sim::{LiveAtDrop, SimConfig, SimDriver};
use kiln_runtime::gpu::{GemmChoice, GemmPolicy, GpuBackend};

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
    }
}

fn gemm_launch(g: Gemm, ws: Option<(DevPtr, u64)>, gemv: bool) -> Launch {
    let shape = GemmShape {
        t: g.t,
        n: g.n,
        k: g.k,
        dtype: DType::F32,
        out: DType::F32,
        bias: false,
    };
    let gemv = gemv.then(|| {
        kernel(
            "gemv_f32",
            vec![
                ResolvedParam::Ptr(g.x),
                ResolvedParam::Ptr(g.w),
                ResolvedParam::Ptr(DevPtr(0)),
                ResolvedParam::Ptr(g.out),
                ResolvedParam::I32(g.t as i32),
                ResolvedParam::I32(g.n as i32),
                ResolvedParam::I32(g.k as i32),
            ],
        )
    });
    Launch {
        kernel: "matmul_f32".into(),
        op: Op::MatMul {
            bias: false,
            out: DType::F32,
        },
        args: vec![
            f32_operand(g.x, vec![g.t, g.k]),
            f32_operand(g.w, vec![g.n, g.k]),
        ],
        results: vec![f32_operand(g.out, vec![g.t, g.n])],
        workspace: ws,
        const_args: 0b10,
        body: LaunchBody::Gemm { shape, gemv },
    }
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
        gemm_launch(g, ws, false)
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
        assert!(b.driver().violations().is_empty(), "{:?}", b.driver().violations());
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
            false,
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
