//! The backend contract's shared bodies (`contract/mod.rs`) on the one GPU
//! backend over the real CUDA driver (feature `cuda`). Without a CUDA device
//! every test prints `skipped: ...` and passes, unless `KILN_REQUIRE_CUDA=1`,
//! which makes absence a failure (set it on the GPU machine).
//!
//! Launch bodies are built the way the compiler lowers a plan: the kernel
//! catalog's `kiln_kernels::gpu::lower` turned into resolved kernels here,
//! in test support only (the backend itself never lowers an op).

#![cfg(feature = "cuda")]

#[macro_use]
mod contract;

use contract::{f32_operand, Gemm, Target};
use kiln_ir::plan::{ImageKind, KernelImage};
use kiln_ir::Op;
use kiln_kernels::gpu::{self, Lowered, Param, Placement};
use kiln_runtime::backend::{
    Backend, DevOperand, DevPtr, Launch, LaunchBody, ResolvedKernel, ResolvedParam,
};
use kiln_runtime::gpu::cuda::{available, CudaGpuBackend};

struct Cuda;

/// The CUDA target, or None (printing why) when no device is usable.
fn cuda() -> Option<Cuda> {
    if available() {
        return Some(Cuda);
    }
    assert!(
        std::env::var("KILN_REQUIRE_CUDA").map_or(true, |v| v != "1"),
        "KILN_REQUIRE_CUDA=1 but no CUDA driver or device is usable"
    );
    eprintln!("skipped: no CUDA driver or device on this machine");
    None
}

/// The cubins for `sm`: `KILN_CUBIN_DIR/<module>.sm_<sm>.cubin` when set,
/// else compiled here with NVRTC.
fn cubins(sm: u32) -> Vec<KernelImage> {
    if let Ok(dir) = std::env::var("KILN_CUBIN_DIR") {
        return gpu::MODULES
            .iter()
            .map(|m| KernelImage {
                name: m.name.into(),
                kind: ImageKind::Cubin,
                code: std::fs::read(format!("{dir}/{}.sm_{sm}.cubin", m.name))
                    .unwrap_or_else(|e| panic!("{dir}/{}.sm_{sm}.cubin: {e}", m.name)),
            })
            .collect();
    }
    kiln_kernels::nvrtc::compile_cubins(sm).unwrap_or_else(|e| panic!("{e}"))
}

/// `op` over `args`/`results` lowered by the catalog, with its parameters
/// resolved to the operands' addresses.
fn lowered(op: &Op, args: &[DevOperand], results: &[DevOperand]) -> Vec<ResolvedKernel> {
    let tys = |v: &[DevOperand]| v.iter().map(|o| o.ty.clone()).collect::<Vec<_>>();
    let Lowered::Kernels { calls, .. } =
        gpu::lower(op, &tys(args), &tys(results), Placement::default()).expect("op lowers")
    else {
        panic!("{} lowers to a GEMM", op.mnemonic());
    };
    calls
        .into_iter()
        .map(|c| ResolvedKernel {
            module: c.module.to_string(),
            entry: c.entry,
            grid: c.grid,
            block: c.block,
            shared_bytes: c.shared_bytes,
            pdl: true,
            cluster: 1,
            params: c
                .params
                .into_iter()
                .map(|p| match p {
                    Param::Arg(i) => ResolvedParam::Ptr(args[i].ptr),
                    Param::Result(i) => ResolvedParam::Ptr(results[i].ptr),
                    Param::Null => ResolvedParam::Ptr(DevPtr(0)),
                    Param::I32(v) => ResolvedParam::I32(v),
                    Param::I64(v) => ResolvedParam::I64(v),
                    Param::F32(v) => ResolvedParam::F32(v),
                    Param::Blob(b) => ResolvedParam::Blob(b),
                    Param::Scratch(_) | Param::Counters(_) => {
                        panic!("the contract ops need no planned scratch or counters")
                    }
                })
                .collect(),
        })
        .collect()
}

impl Target for Cuda {
    type B = CudaGpuBackend;
    fn open(&self) -> CudaGpuBackend {
        let mut b = CudaGpuBackend::cuda(0).expect("open CUDA device 0");
        let images = cubins(b.sm());
        b.load_kernels(&images).expect("load kernel modules");
        b
    }
    fn add(&self, a: DevPtr, b: DevPtr, c: DevPtr, n: u32) -> Launch {
        let args = vec![f32_operand(a, vec![n]), f32_operand(b, vec![n])];
        let results = vec![f32_operand(c, vec![n])];
        Launch {
            kernel: "add_f32".into(),
            op: Op::Add,
            body: LaunchBody::Kernels(lowered(&Op::Add, &args, &results)),
            args,
            results,
            workspace: None,
            const_args: 0,
        }
    }
    fn gemm(&self, g: Gemm, ws: Option<(DevPtr, u64)>) -> Launch {
        g.launch(
            ws,
            LaunchBody::Gemm {
                shape: g.shape(),
                kind: kiln_ir::plan::GemmKind::Blas,
                kernel: None,
            },
        )
    }
    fn replays(&self, b: &CudaGpuBackend) -> u64 {
        b.counters().graphs.replays()
    }
    fn require_workspace(&self, _b: &mut CudaGpuBackend, _bytes: u64) -> bool {
        false
    }
}

contract_tests!(cuda());

#[test]
fn the_device_reports_its_architecture_and_copy_bandwidth() {
    let Some(t) = cuda() else { return };
    let mut b = t.open();
    let info = b.info();
    assert_eq!(info.backend, "cuda");
    assert_eq!(info.arch, format!("sm_{}", b.sm()));
    assert!(b.sm_count() > 0);
    let bw = b.copy_bandwidth(64 << 20, 5).unwrap().unwrap();
    assert!(bw > 1e10, "{bw} B/s");
}
