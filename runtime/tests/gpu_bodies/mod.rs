//! Launch bodies for GPU tests, built the way `kiln compile` lowers a plan:
//! `kiln_kernels::gpu::lower_op` over the launch's operands, with the scratch
//! and completion counters the lowering asks for allocated here and resolved
//! to addresses the way the engine resolves a plan's buffers. The backend
//! itself never lowers an op.

#![allow(dead_code)]

use kiln_ir::plan::{
    BufRef, GemmKind, GemmShape, KernelLaunch, LaunchParam, Lowering, Operand, Region,
};
use kiln_kernels::gpu::{lower_op, op_needs, LowerOptions};
use kiln_runtime::backend::{
    Backend, DevOperand, DevPtr, Launch, LaunchBody, ResolvedKernel, ResolvedParam,
};

/// BLAS workspace reserved for a GEMM lowered without one.
pub const WORKSPACE_BYTES: u64 = 32 << 20;

thread_local! {
    /// Lower attention without thread-block clusters even where the device
    /// launches them ([`without_clusters`]).
    static NO_CLUSTERS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with attention lowered as for a target without clusters (sm_80,
/// HIP), so a test can run both forms of the kernel on an sm_90 device.
pub fn without_clusters<R>(f: impl FnOnce() -> R) -> R {
    NO_CLUSTERS.with(|c| c.set(true));
    let r = f();
    NO_CLUSTERS.with(|c| c.set(false));
    r
}

fn absolute(ptr: DevPtr, bytes: u64) -> BufRef {
    // Every buffer is "arena" at its absolute address, so the lowering's
    // overlap checks compare real addresses and resolving is the identity.
    BufRef {
        region: Region::Arena,
        offset: ptr.0,
        bytes,
    }
}

fn operands(v: &[DevOperand]) -> Vec<Operand> {
    v.iter()
        .map(|o| Operand {
            buf: absolute(o.ptr, o.ty.size_bytes()),
            ty: o.ty.clone(),
        })
        .collect()
}

fn resolve(k: &KernelLaunch) -> ResolvedKernel {
    ResolvedKernel {
        module: k.module.clone(),
        entry: k.entry.clone(),
        grid: k.grid,
        block: k.block,
        shared_bytes: k.shared_bytes,
        params: k
            .params
            .iter()
            .map(|p| match p {
                LaunchParam::Buf(b) => ResolvedParam::Ptr(DevPtr(b.offset)),
                LaunchParam::Null => ResolvedParam::Ptr(DevPtr(0)),
                LaunchParam::I32(v) => ResolvedParam::I32(*v),
                LaunchParam::I64(v) => ResolvedParam::I64(*v),
                LaunchParam::F32(v) => ResolvedParam::F32(*v),
                LaunchParam::Blob(b) => ResolvedParam::Blob(b.clone()),
            })
            .collect(),
        pdl: k.pdl,
        cluster: k.cluster,
    }
}

/// Fills `launch.body` (and, for a GEMM without one, `launch.workspace`)
/// with the catalog's lowering of its op. Returns the buffers allocated for
/// it (scratch, zeroed counters), for the caller to free after the last use.
pub fn lower<B: Backend>(b: &mut B, launch: &mut Launch, pdl: bool) -> Vec<DevPtr> {
    lower_as(b, launch, pdl, None)
}

/// The GEMM shape of a matmul launch (`None` for other ops).
pub fn gemm_shape(launch: &Launch) -> Option<GemmShape> {
    let kiln_ir::Op::MatMul { bias, out } = launch.op else {
        return None;
    };
    let (x, w) = (&launch.args[0].ty, &launch.args[1].ty);
    Some(GemmShape {
        t: x.shape.dims()[0],
        n: w.shape.dims()[0],
        k: x.shape.dims()[1],
        dtype: x.dtype,
        out,
        bias,
    })
}

/// [`lower`], with a matmul run as `gemm` (as a `kiln tune` table would
/// make `kiln compile` choose it) instead of the default rule's choice;
/// panics if that kind cannot run the shape.
pub fn lower_as<B: Backend>(
    b: &mut B,
    launch: &mut Launch,
    pdl: bool,
    gemm: Option<GemmKind>,
) -> Vec<DevPtr> {
    let tys = |v: &[DevOperand]| v.iter().map(|o| o.ty.clone()).collect::<Vec<_>>();
    // As `kiln compile` lowers for the device: PDL and attention clusters
    // come together (sm_90).
    let mut opts = LowerOptions {
        pdl,
        attn_clusters: pdl && !NO_CLUSTERS.with(|c| c.get()),
        ..LowerOptions::default()
    };
    if let (Some(kind), Some(shape)) = (gemm, gemm_shape(launch)) {
        opts.tuned.insert(shape, kind);
        assert_eq!(
            kiln_kernels::gpu::choose_gemm(&shape, &opts),
            kind,
            "{}: {kind} cannot run {shape:?}",
            launch.kernel
        );
    }
    let needs = op_needs(&launch.op, &tys(&launch.args), &tys(&launch.results), &opts)
        .unwrap_or_else(|e| panic!("{}: {e}", launch.kernel));
    let mut owned = Vec::new();
    let scratch = (needs.scratch_bytes > 0).then(|| {
        let p = b.alloc(needs.scratch_bytes, "test scratch").unwrap();
        owned.push(p);
        absolute(p, needs.scratch_bytes)
    });
    let counters = (needs.counters > 0).then(|| {
        let bytes = needs.counters as u64 * 4;
        let p = b.alloc(bytes, "test counters").unwrap();
        b.upload(p, &vec![0u8; bytes as usize]).unwrap();
        owned.push(p);
        BufRef {
            region: Region::Counters,
            offset: p.0,
            bytes,
        }
    });
    let lowering = lower_op(
        &launch.op,
        &operands(&launch.args),
        &operands(&launch.results),
        scratch,
        counters,
        launch.const_args,
        &opts,
    )
    .unwrap_or_else(|e| panic!("{}: {e}", launch.kernel));
    launch.body = match lowering {
        Lowering::Reference => LaunchBody::Reference,
        Lowering::Collective => LaunchBody::Collective,
        Lowering::Kernels(ks) => LaunchBody::Kernels(ks.iter().map(resolve).collect()),
        Lowering::Gemm {
            shape,
            kind,
            kernel,
        } => {
            if launch.workspace.is_none() {
                launch.workspace = b.reserve_workspace(WORKSPACE_BYTES).unwrap();
            }
            LaunchBody::Gemm {
                shape,
                kind,
                kernel: kernel.as_ref().map(resolve),
            }
        }
    };
    owned
}

/// The catalog's lowering of `launch`'s op as its body, for ops that need
/// neither scratch nor counters (panics naming the op otherwise).
pub fn body(launch: &Launch, pdl: bool) -> LaunchBody {
    let tys = |v: &[DevOperand]| v.iter().map(|o| o.ty.clone()).collect::<Vec<_>>();
    let opts = LowerOptions {
        pdl,
        ..LowerOptions::default()
    };
    let needs = op_needs(&launch.op, &tys(&launch.args), &tys(&launch.results), &opts)
        .unwrap_or_else(|e| panic!("{}: {e}", launch.kernel));
    assert!(
        needs.scratch_bytes == 0 && needs.counters == 0,
        "{} needs scratch or counters: use gpu_bodies::lower",
        launch.kernel
    );
    let lowering = lower_op(
        &launch.op,
        &operands(&launch.args),
        &operands(&launch.results),
        None,
        None,
        launch.const_args,
        &opts,
    )
    .unwrap_or_else(|e| panic!("{}: {e}", launch.kernel));
    match lowering {
        Lowering::Reference => LaunchBody::Reference,
        Lowering::Collective => LaunchBody::Collective,
        Lowering::Kernels(ks) => LaunchBody::Kernels(ks.iter().map(resolve).collect()),
        Lowering::Gemm {
            shape,
            kind,
            kernel,
        } => LaunchBody::Gemm {
            shape,
            kind,
            kernel: kernel.as_ref().map(resolve),
        },
    }
}
