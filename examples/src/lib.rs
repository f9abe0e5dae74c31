//! Small programs on the runtime API live in `examples/`.
