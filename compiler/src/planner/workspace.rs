//! The BLAS workspace model: how many bytes of workspace each GEMM of a plan
//! is granted on a target.
//!
//! Why it exists: BLAS libraries (cuBLASLt, hipBLASLt) pick algorithms that
//! may need scratch memory (split-K partial sums, stream-K fix-up buffers).
//! If no workspace is given, hipBLASLt allocates one lazily on first use,
//! which inside a graph capture is an allocation in the capture region, the
//! classic capture hazard. kiln decides the figure at compile time: the
//! runtime allocates `Plan::workspace_bytes` before any capture, selects each
//! GEMM's algorithm with a max-workspace preference equal to the op's
//! `workspace_bytes`, and refuses to capture if a selected algorithm needs
//! more.
//!
//! The model, per target:
//!
//! | target            | library   | per-GEMM grant |
//! |-------------------|-----------|----------------|
//! | `cpu`             | none      | 0              |
//! | `cuda:sm_90`+     | cuBLASLt  | 32 MiB         |
//! | `cuda:sm_<90`     | cuBLASLt  | 4 MiB          |
//! | `hip:gfx*`        | hipBLASLt | 32 MiB         |
//!
//! The CUDA figures are the workspace sizes NVIDIA's cuBLAS documentation
//! recommends (`cublasSetWorkspace`: 32 MiB on Hopper, 4 MiB on other
//! architectures). AMD publishes no figure for hipBLASLt; we grant the same
//! 32 MiB, which covers its split-K/stream-K solutions for decode-sized GEMMs.
//! The grant is a cap, not a requirement: the libraries do not publish
//! per-algorithm workspace needs ahead of selection, and a smaller per-shape
//! estimate would only take the skinny-GEMM (split-K) algorithms away from
//! decode steps. Since all GEMMs of a step share one buffer, the plan's
//! memory cost is the maximum, and that is the same whether each GEMM is
//! granted the cap or less.
//!
//! Not here: algorithm selection and the fit check (the runtime's backend).

use kiln_ir::plan::Target;

pub const MIB: u64 = 1 << 20;

/// A target's BLAS library and its workspace cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlasModel {
    /// `none`, `cublasLt` or `hipblasLt`.
    pub library: &'static str,
    /// Bytes of workspace granted to each GEMM.
    pub max_workspace: u64,
}

/// The model for `target` (see the table in the module docs).
pub fn blas_model(target: &Target) -> BlasModel {
    match target {
        Target::Cpu => BlasModel {
            library: "none",
            max_workspace: 0,
        },
        Target::Cuda { sm } if *sm >= 90 => BlasModel {
            library: "cublasLt",
            max_workspace: 32 * MIB,
        },
        Target::Cuda { .. } => BlasModel {
            library: "cublasLt",
            max_workspace: 4 * MIB,
        },
        Target::Hip { .. } => BlasModel {
            library: "hipblasLt",
            max_workspace: 32 * MIB,
        },
    }
}

/// Workspace granted to one `[m, k] x [k, n]` GEMM. An empty GEMM launches
/// nothing and gets none.
pub fn gemm_workspace(model: &BlasModel, m: u64, n: u64, k: u64) -> u64 {
    if m == 0 || n == 0 || k == 0 {
        0
    } else {
        model.max_workspace
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hopper_gets_the_32_mib_nvidia_recommends_and_older_gpus_4() {
        let h = blas_model(&"cuda:sm_90".parse().unwrap());
        assert_eq!(gemm_workspace(&h, 8, 4096, 1024), 32 * MIB);
        let a = blas_model(&"cuda:sm_80".parse().unwrap());
        assert_eq!(gemm_workspace(&a, 8, 4096, 1024), 4 * MIB);
        let r = blas_model(&"hip:gfx1100".parse().unwrap());
        assert_eq!(r.library, "hipblasLt");
        assert_eq!(gemm_workspace(&r, 1, 1, 1), 32 * MIB);
        assert_eq!(gemm_workspace(&blas_model(&Target::Cpu), 8, 8, 8), 0);
        assert_eq!(gemm_workspace(&h, 0, 4096, 1024), 0);
    }
}
