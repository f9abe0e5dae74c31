//! The HIP backend (AMD GPUs): hipGraph capture and replay, hipBLASLt GEMMs
//! with a workspace grown before capture, and a per-architecture graph policy.
//!
//! Split so that as much as possible is tested in CI without an AMD device:
//! * always compiled (tested by `cargo test` everywhere):
//!   the [`driver::HipDriver`] seam (tests drive the one GPU backend over it
//!   with a simulated device), [`policy`] (graphs or
//!   eager, per device), [`device`] (the gfx name across ROCm ABIs),
//!   [`source`] and [`catalog`] (the kernels as one translation unit, launch
//!   parameters), [`cache`] (the code-object cache), [`offline`] (code
//!   objects via hipcc at compile time), [`gemm`] (column-major mapping,
//!   workspace bounds, algorithm choice), [`capture`] (the HIP counters; the
//!   contract bookkeeping itself is shared by every backend, `crate::capture`);
//! * behind the `rocm` feature, which links `libamdhip64` through `hip-sys`
//!   (hiprtc and hipBLASLt are loaded with dlopen at run time, so neither is
//!   needed to build): `real::RealHip`, the driver on the real libraries, and
//!   `HipBackend`, the one GPU backend (`crate::gpu`) on it through
//!   `crate::gpu::hip::HipGpuDriver`.
//!
//! Not here: the engine that drives the backend, and the kernels themselves
//! (`kernels/gpu`, shared with CUDA).

pub mod cache;
pub mod capture;
pub mod catalog;
pub mod device;
pub mod driver;
pub mod gemm;
pub mod policy;

// Compile-time HIP images live with the kernel sources, so the compiler can
// produce them without linking the runtime.
pub use kiln_kernels::hip::{offline, source};

#[cfg(feature = "rocm")]
pub mod blaslt;
#[cfg(feature = "rocm")]
pub mod ffi;
#[cfg(feature = "rocm")]
pub mod real;
#[cfg(feature = "rocm")]
pub mod rtc;

/// kiln's HIP backend: the one GPU backend on this machine's HIP libraries.
#[cfg(feature = "rocm")]
pub type HipBackend = crate::gpu::hip::HipGpuBackend;
