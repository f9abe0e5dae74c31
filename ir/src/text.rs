//! The text form's shared vocabulary: positions and spans, the source map
//! that ties a graph to its text, the verifier's locations, the attribute
//! order of each op and the string escapes.
//!
//! It exists so the dependencies between the text-form modules run one way:
//! [`crate::parse`] uses [`crate::verify`], which uses [`crate::print`], and
//! all three use this module; none of them reaches back.
//!
//! Not here: printing, parsing or verifying themselves.

use crate::graph::{NodeId, ValueId};
use std::fmt;
use std::fmt::Write as _;

/// A position in a text: 1-based line and 1-based column counted in
/// characters (Unicode scalar values), not bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Pos {
    pub line: u32,
    pub column: u32,
}

impl fmt::Display for Pos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

/// A range of text, `start` inclusive, `end` exclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Span {
    pub start: Pos,
    pub end: Pos,
}

/// Spans of one node statement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeSpans {
    /// The op mnemonic.
    pub op: Span,
    /// Each `%N` left of `=`.
    pub results: Vec<Span>,
    /// Each argument `%N`.
    pub args: Vec<Span>,
    /// Each result type right of `:`.
    pub types: Vec<Span>,
}

/// Where each part of a graph is in its text, as recorded by [`parse_with_map`]
/// or [`crate::print_with_map`]. Indices follow the graph's lists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceMap {
    /// The `graph` keyword.
    pub graph: Span,
    /// Each input statement, `%N` to the end of its type.
    pub inputs: Vec<Span>,
    /// Each weight statement.
    pub weights: Vec<Span>,
    pub nodes: Vec<NodeSpans>,
    /// Each output statement.
    pub outputs: Vec<Span>,
}

impl SourceMap {
    /// The text a verifier location points at. Locations with no statement of
    /// their own (the graph, an undeclared value) or outside this map point at
    /// the `graph` keyword.
    pub fn span(&self, loc: &Location) -> Span {
        let node = |n: NodeId| self.nodes.get(n.index());
        let found = match *loc {
            Location::Graph | Location::Value(_) => None,
            Location::Input(i) => self.inputs.get(i).copied(),
            Location::Weight(i) => self.weights.get(i).copied(),
            Location::Output(i) => self.outputs.get(i).copied(),
            Location::Node(n) => node(n).map(|s| s.op),
            Location::Arg { node: n, arg } => {
                node(n).map(|s| s.args.get(arg).copied().unwrap_or(s.op))
            }
            Location::Result { node: n, result } => {
                node(n).map(|s| s.results.get(result).copied().unwrap_or(s.op))
            }
            Location::ResultType { node: n, result } => node(n).map(|s| {
                s.types
                    .get(result)
                    .or(s.results.get(result))
                    .copied()
                    .unwrap_or(s.op)
            }),
        };
        found.unwrap_or(self.graph)
    }
}

/// What a verifier error is about. [`crate::SourceMap::span`] turns it into
/// a position in a text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Location {
    /// The graph as a whole.
    Graph,
    /// A value-table entry that no statement declares.
    Value(ValueId),
    /// Entry `i` of [`Graph::inputs`].
    Input(usize),
    /// Entry `i` of [`Graph::weights`].
    Weight(usize),
    /// A node (its op).
    Node(NodeId),
    /// Argument `arg` of a node.
    Arg { node: NodeId, arg: usize },
    /// Result `result` of a node (its id).
    Result { node: NodeId, result: usize },
    /// The recorded type of result `result` of a node.
    ResultType { node: NodeId, result: usize },
    /// Entry `i` of [`Graph::outputs`].
    Output(usize),
}

/// Attribute names of each op, in the order the printer writes them.
pub(crate) fn attr_names(mnemonic: &str) -> &'static [&'static str] {
    match mnemonic {
        "rms_norm" | "add_rms_norm" => &["eps", "unit_offset"],
        "matmul" => &["bias", "out"],
        "head_rms_norm" => &["heads", "head_dim", "eps", "unit_offset"],
        "rope" => &["heads", "head_dim", "theta", "scaling"],
        "paged_attention" => &[
            "heads",
            "kv_heads",
            "head_dim",
            "query",
            "block_size",
            "scale",
            "window",
            "softcap",
        ],
        "qkv_rope_kv_write" => &[
            "heads",
            "kv_heads",
            "head_dim",
            "theta",
            "scaling",
            "qk_norm",
            "unit_offset",
        ],
        "rope_attention" => &[
            "heads",
            "kv_heads",
            "head_dim",
            "query",
            "block_size",
            "scale",
            "window",
            "softcap",
            "theta",
            "scaling",
            "qk_norm",
            "unit_offset",
        ],
        "matmul_qkv_rope" => &[
            "bias",
            "norm",
            "norm_unit_offset",
            "heads",
            "kv_heads",
            "head_dim",
            "theta",
            "scaling",
            "qk_norm",
            "unit_offset",
        ],
        "gather_last" => &["group"],
        "accept_greedy" => &["spec"],
        "fused_matmul" => &["bias", "out", "norm", "unit_offset", "epilogue"],
        "scale" => &["factor", "softcap"],
        "all_reduce" => &["ranks", "out"],
        "sharded_argmax" => &["ranks"],
        "attention_partials" => &[
            "heads",
            "kv_heads",
            "head_dim",
            "query",
            "block_size",
            "scale",
            "window",
            "softcap",
            "parts",
        ],
        "attention_combine" => &["heads", "head_dim", "parts", "out"],
        _ => &[],
    }
}

/// A string in double quotes with the text form's escapes.
pub(crate) fn quote(s: &str) -> String {
    format!("\"{}\"", escape(s))
}

/// The inside of a quoted string: `"` and `\` escaped, control characters as
/// `\n`, `\r`, `\t` or `\u{HEX}`.
pub(crate) fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}
