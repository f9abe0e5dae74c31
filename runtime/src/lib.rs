//! `kiln-runtime`: loads plans and replays them.
//!
//! A serving process links this crate (with `kiln-ir` and `kiln-kernels`) and
//! never the compiler.
//!
//! * [`engine`]: the public API: load a plan and weights on a backend, add and
//!   remove sequences, step, read tokens, logits and counters;
//! * [`backend`]: the seam every execution target implements; [`capture`],
//!   the capture contract's bookkeeping every backend shares; [`cpu`], the
//!   CPU backend with emulated capture; [`gpu`], the one GPU backend over a
//!   vendor driver (CUDA, HIP, or a simulated device);
//! * [`loader`] and [`weights`]: everything checked before anything is
//!   allocated, then weights bound to device memory;
//! * [`kv`]: the paged KV cache's block allocator; [`policy`]: graphs or eager;
//! * [`text`]: tokenizer in and streaming text out; [`chat`]: the model's chat
//!   template, rendered as Hugging Face does; [`device`]: backends by name;
//! * [`draft`]: prompt-lookup drafts; [`spec`]: speculative decoding driven by
//!   them over an engine;
//! * [`tape`]: a CPU executor of a megakernel tape (threads or an
//!   adversarial order), the proof that a tape computes the op list.

pub mod backend;
pub mod capture;
pub mod chat;
pub mod cpu;
pub mod device;
pub mod draft;
pub mod engine;
pub mod error;
pub mod gpu;
mod hostmem;
pub mod kv;
pub mod loader;
pub mod policy;
pub mod seq;
pub mod spec;
pub mod tape;
pub mod text;
pub mod tp;
pub mod weights;

pub use backend::{Backend, BackendError, DeviceInfo};
pub use cpu::CpuBackend;
pub use device::{open_backend, open_backend_ranks, DeviceSpec};
pub use draft::{DraftError, PromptLookup};
pub use engine::{launch_classes, op_bytes, OpTime, StepProfile, PROFILE_WINDOW};
pub use engine::{
    Engine, EngineOptions, EngineStats, Faults, FinishReason, KeyCounters, KeyFacts, PrefillMode,
    SeqId, SeqOptions, SeqView, StepMode, StepTimes,
};
pub use error::EngineError;
pub use kiln_kernels::cpu::sample::RowSampling;
pub use policy::{EagerFallback, GraphDecision, GraphMode};
pub use spec::{RowOutcome, SpecError, SpecOptions, SpecStats, Speculator};
pub use weights::Weights;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod hip;
