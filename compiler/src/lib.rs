//! kiln compiler.
pub mod fetch;
pub mod gguf;
pub mod import;
pub mod tokenizer_build;
