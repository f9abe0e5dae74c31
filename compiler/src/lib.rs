//! `kiln-compiler`: model frontends, passes, the memory/workspace planner, the
//! emitter, GGUF import, and the `kiln` CLI (`src/main.rs`).

pub mod bench;
pub mod bench_spec;
pub mod compile;
pub mod compile_bench;
pub mod config;
pub mod demo;
pub mod fetch;
pub mod frontend;
pub mod gguf;
pub mod import;
pub mod inspect;
pub mod passes;
pub mod planner;
pub mod run_cmd;
pub mod safetensors_header;
pub mod testing;
pub mod tokenizer_build;
