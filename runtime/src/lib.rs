//! `kiln-runtime`: loads plans and replays them.
//!
//! A serving process links this crate (with `kiln-ir` and `kiln-kernels`) and
//! never the compiler.

pub mod backend;
#[cfg(feature = "cuda")]
pub mod cuda;
