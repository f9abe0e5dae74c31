//! `kiln-cli`: the `kiln` binary's commands that execute plans, as library
//! code the binary (`src/main.rs`) and the tests call.
//!
//! It is the one crate that links both the compiler and the runtime (see
//! ARCHITECTURE.md): `run` loads a plan and generates text, `demo` chains
//! fetch, import, compile and run, `bench` times each key's step through the
//! [`kiln_runtime::Engine`], `bench-spec` measures speculative decoding.
//!
//! Deliberately not here: compiling, inspecting, importing and fetching
//! (library code in `kiln-compiler`, which never links a backend), and any
//! backend-specific code (the commands use only the `Backend` trait and the
//! engine).

pub mod bench;
pub mod bench_spec;
pub mod demo;
pub mod progress;
pub mod run_cmd;
pub mod tune;
