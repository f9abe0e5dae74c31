//! `kiln-ir`: the types everything else in kiln stands on.
//!
//! * [`types`]: dtypes, static shapes, tensor types;
//! * [`op`]: the closed op set of a decode step and its typing rules;
//! * [`graph`]: the traced step (values with `u32` ids, nodes, side tables);
//! * [`key`]: shape keys `(batch, query, spec)`;
//! * [`manifest`]: weights and their load-time transforms;
//! * [`plan`]: what a compiled plan holds (and [`artifact`] its encoding).
//!
//! Not here: model frontends, passes and planning (compiler), execution
//! (runtime), kernels (kernels).

pub mod artifact;
pub mod graph;
pub mod key;
pub mod manifest;
pub mod op;
pub mod plan;
pub mod types;

pub use graph::{Graph, InputRole, Node, NodeId, ValueData, ValueDef, ValueId};
pub use key::{Key, KeyError};
pub use manifest::{TensorRef, WeightEntry, WeightManifest, WeightSource};
pub use op::{Op, Rope, RopeScaling};
pub use types::{DType, Shape, TensorType};
