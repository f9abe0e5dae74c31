//! Small programs on kiln's public runtime API, in `examples/examples/`:
//!
//! * `generate`: load a plan and weights, generate text greedily.
