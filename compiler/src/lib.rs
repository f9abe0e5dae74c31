//! kiln compiler.

pub mod config;
pub mod frontend;
pub mod safetensors_header;
pub mod testing;
