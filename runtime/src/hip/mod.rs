//! The HIP backend (AMD GPUs): hipGraph capture and replay, hipBLASLt GEMMs
//! with a workspace grown before capture, and a per-architecture graph policy.
//!
//! Split in two on purpose:
//! * always compiled, tested in CI without an AMD device or ROCm:
//!   [`policy`] (graphs or eager, per device), [`device`] (the gfx name
//!   across ROCm ABIs), [`source`] (one translation
//!   unit from the kernel sources), [`cache`] (the code-object cache key and
//!   directory), [`offline`] (compile-time code objects via hipcc),
//!   [`gemm`] (column-major GEMM mapping, workspace bounds, algorithm choice),
//!   [`capture`] (capture-contract bookkeeping, graph table, counters);
//! * behind the `rocm` feature (links libamdhip64 through `hip-sys`;
//!   hiprtc and hipBLASLt are loaded with dlopen at run time, so neither is
//!   needed to build): `HipBackend`, the [`crate::backend::Backend`]
//!   implementation.
//!
//! Not here: the engine that drives the backend, and the kernels themselves
//! (`kernels/gpu`, shared with CUDA).

pub mod cache;
pub mod capture;
pub mod device;
pub mod gemm;
pub mod offline;
pub mod policy;
pub mod source;

#[cfg(feature = "rocm")]
pub mod blaslt;
#[cfg(feature = "rocm")]
pub mod ffi;
#[cfg(feature = "rocm")]
pub mod rtc;
