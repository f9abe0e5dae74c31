//! `kiln-kernels`: kernels for every op the plans use.
//!
//! * [`cpu`]: Rust reference kernels (the CPU backend and the oracle);
//! * GPU sources (`.cu`, one source for CUDA and HIP) and the kernel catalog;
//! * [`hip`]: HIP images without the HIP runtime (one translation unit, offline
//!   code objects); [`nvrtc`]: CUDA cubins with NVRTC and their on-disk cache;
//! * [`megakernel`]: the megakernel interpreter skeleton and its device records.

pub mod cpu;
pub mod gpu;
pub mod hip;
pub mod image_cache;
pub mod megakernel;
#[cfg(feature = "nvrtc")]
pub mod nvrtc;
pub mod quant;
pub mod quant_cpu;
pub mod quant_gpu;
pub mod tuning;
