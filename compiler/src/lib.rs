//! `kiln-compiler`: model frontends, passes, the memory/workspace planner, the
//! emitter, GGUF import, fetch and inspect: everything that turns a model
//! into a plan artifact.
//!
//! Deliberately not here: anything that runs a plan. The compiler never links
//! the runtime or a backend (see ARCHITECTURE.md); the `kiln` binary and the
//! commands that execute plans (run, demo, bench, bench-spec) live in the
//! `kiln-cli` crate.

pub mod compile;
pub mod compile_bench;
pub mod config;
pub mod fetch;
pub mod frontend;
pub mod gguf;
pub mod import;
pub mod inspect;
pub mod outpath;
pub mod passes;
pub mod planner;
pub mod safetensors_header;
pub mod staging;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod tokenizer_build;
