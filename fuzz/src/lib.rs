//! `kiln-fuzz`: a fuzzer for every parser of untrusted input in kiln, on the
//! stable toolchain.
//!
//! kiln reads files it did not write: GGUF files and safetensors checkpoints
//! from the internet, config.json files, plan artifacts passed between
//! machines, IR text. Each parser gets a target ([`targets::Target`]) fed
//! by a deterministic mutator ([`mutate`]) from a committed seed corpus
//! ([`seed`], `fuzz/corpus/<target>/`) under three oracles ([`runner`]):
//! no panic (caught per input, the input saved under
//! `fuzz/crashes/<target>/`), no single allocation above
//! [`alloc::DEFAULT_LIMIT`] (256 MiB; inputs are at most 1 MiB), and no
//! input running longer than [`runner::DEFAULT_TIMEOUT_MS`] (2 s). Every
//! input is reproducible from `(target, seed, iteration)`.
//!
//! Why not cargo-fuzz: it needs a nightly toolchain for its sanitizer
//! instrumentation, and kiln builds on stable only. The price is no
//! coverage feedback; the seeds and structure-aware edits (length and CRC
//! repair for plan files, length prefixes for safetensors, token edits for
//! text) do the steering instead.
//!
//! Not here: the HTTP request parser (its target lands with `kiln serve`;
//! the place for it is marked in [`targets::Target`]), and anything that
//! needs a GPU.

pub mod alloc;
pub mod mutate;
pub mod runner;
pub mod seed;
pub mod targets;

pub use runner::{Config, Report};
pub use targets::{Outcome, Target};
