//! kiln compiler: model frontends, graph passes, the memory/workspace
//! planner, plan emission and the `kiln` CLI's subcommands.

pub mod compile;
pub mod compile_bench;
pub mod config;
pub mod frontend;
pub mod inspect;
pub mod passes;
pub mod planner;
pub mod safetensors_header;
pub mod testing;
