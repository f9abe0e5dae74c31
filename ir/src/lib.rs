//! `kiln-ir`: the types everything else in kiln stands on.
//!
//! * [`types`]: dtypes, static shapes, tensor types;
//! * [`op`]: the closed op set of a decode step and its typing rules;
//! * [`graph`]: the traced step (values with `u32` ids, nodes, side tables);
//! * [`verify`](mod@verify): the invariants of a well-formed graph, and the
//!   [`GraphInfo`] later stages require as proof;
//! * [`print`](mod@print) / [`parse`](mod@parse): the stable text form, which
//!   parses back exactly, with line:column errors;
//! * [`text`]: what the text-form modules share (positions, source maps,
//!   verifier locations, escapes), so they depend on each other one way;
//! * [`dot`]: Graphviz output;
//! * [`golden`]: golden-file checks for tests (`KILN_BLESS=1` refreshes);
//! * [`key`]: shape keys `(batch, query, spec)`;
//! * [`manifest`]: weights and their load-time transforms;
//! * [`plan`]: what a compiled plan holds (and [`artifact`] its encoding);
//! * [`rng`]: the deterministic generator tests and fixtures share;
//! * [`schedule`]: a key's schedule (graph, or a megakernel's task tape) and
//!   the tape verifier.
//!
//! Not here: model frontends, passes and planning (compiler), execution
//! (runtime), kernels (kernels).

pub mod artifact;
pub mod dot;
pub mod golden;
pub mod graph;
pub mod key;
pub mod manifest;
pub mod op;
pub mod parse;
pub mod plan;
pub mod print;
pub mod rng;
pub mod schedule;
pub mod text;
pub mod types;
pub mod validate;
pub mod verify;

pub use dot::to_dot;
pub use golden::check_golden;
pub use graph::{Graph, InputRole, Node, NodeId, ValueData, ValueDef, ValueId};
pub use key::{Key, KeyError};
pub use manifest::{ShardAxis, TensorRef, WeightEntry, WeightManifest, WeightSource};
pub use op::{AttnAttrs, Epilogue, Op, PreNorm, Rope, RopeScaling};
pub use parse::{
    parse, parse_and_verify, parse_with_map, LocatedError, NodeSpans, ParseError, ParseErrorKind,
    Pos, SourceMap, Span, TextError,
};
pub use print::{print, print_with_map};
pub use schedule::{Schedule, Tape, Task, Tile, Wait};
pub use types::{DType, QuantLayout, QuantType, Shape, TensorType};
pub use validate::{validate, PlanInfo};
pub use verify::{
    quantized_operand, verify, GraphInfo, Location, VerifyError, VerifyErrorKind, VerifyErrors,
};
