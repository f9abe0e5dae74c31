//! `kiln-kernels`: kernels for every op the plans use.
//!
//! * [`cpu`]: Rust reference kernels (the CPU backend and the oracle);
//! * GPU sources (`.cu`, one source for CUDA and HIP) and the kernel catalog.

pub mod cpu;
pub mod gpu;
#[cfg(feature = "nvrtc")]
pub mod nvrtc;
