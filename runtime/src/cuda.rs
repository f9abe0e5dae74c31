//! The CUDA backend's public names (feature `cuda`): the one GPU backend
//! ([`crate::gpu::GpuBackend`]) on the CUDA driver ([`CudaDriver`]).
//!
//! The backend runs the launch bodies `kiln compile` lowered into the plan;
//! nothing is lowered at run time. This module only keeps the names the CLI,
//! examples and tests open the backend by (`CudaBackend::new(ordinal)`,
//! `CudaBackend::available()`). Not here: the driver (`crate::gpu::cuda`) or
//! any backend logic (`crate::gpu`).

pub use crate::gpu::cuda::{available, CudaDriver};
pub use crate::gpu::{GemmChoice, GpuCounters};

/// kiln's CUDA backend: the one GPU backend on this machine's CUDA driver.
pub type CudaBackend = crate::gpu::GpuBackend<CudaDriver>;
