//! Sequence identity, shared by the engine and its error type.
//!
//! It sits in its own module so the dependency runs one way: `engine` uses
//! `error`, and both use `seq`; `error` never reaches into `engine`.
//!
//! Not here: a sequence's state (tokens, blocks, drafts), which is the
//! engine's own.

/// A sequence served by an engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);
