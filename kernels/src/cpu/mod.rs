//! CPU reference kernels: one function per [`Op`], bf16/f16/f32 storage with
//! f32 accumulation. They are the oracle the GPU backends are checked against
//! and the CPU backend's real kernels.
//!
//! Contract of [`execute`]: operands are raw pointers into backend memory,
//! because results may alias arguments (in-place KV writes, in-place
//! elementwise reuse decided by the planner). Each kernel must be correct
//! when a result aliases the argument the op's `may_reuse`/`aliases` names.

use kiln_ir::{Op, TensorType};

/// A dense tensor in backend memory.
#[derive(Clone, Debug)]
pub struct RawTensor {
    pub ptr: *mut u8,
    pub ty: TensorType,
}

/// A kernel refused its operands.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("cpu kernel `{op}`: {message}")]
    Operands { op: &'static str, message: String },
}

/// Executes `op` on `args`, writing `results`.
///
/// # Safety
/// Every pointer must be valid for its tensor's `size_bytes()` and suitably
/// aligned for its dtype; results may alias arguments only as the op allows.
pub unsafe fn execute(
    op: &Op,
    args: &[RawTensor],
    results: &[RawTensor],
) -> Result<(), KernelError> {
    let _ = (args, results);
    Err(KernelError::Operands {
        op: op.mnemonic(),
        message: "not implemented yet".into(),
    })
}
