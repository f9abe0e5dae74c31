//! kiln compiler.
