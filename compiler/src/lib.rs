//! kiln compiler: model frontends, graph passes, the memory/workspace
//! planner, plan emission and the `kiln` CLI's subcommands.

pub mod compile;
pub mod passes;
pub mod planner;
