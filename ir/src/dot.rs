//! Graphviz DOT output of a [`Graph`], for `kiln inspect --dot` and golden
//! dumps.
//!
//! Why it exists: a reviewer sees the dataflow of a step (which norm feeds
//! which projection, where the KV write orders attention) faster in a
//! picture than in the text form. The output is deterministic (same graph,
//! same bytes): inputs, weights, nodes and outputs are emitted in the graph's
//! list order, edges in argument order.
//!
//! Shapes: inputs are boxes, weights are notes, ops are ellipses labelled
//! `nodeN: mnemonic {attrs}` and their result ids and types, outputs are
//! double octagons. An edge from a producer to a user is labelled with the
//! value id. Names are escaped as in the text form, then for DOT. A malformed
//! graph still renders: an argument with no declared producer gets an edge
//! from a red `undefined %N` box.
//!
//! Not here: layout (left to Graphviz), the plan's memory map (that is the
//! planner's dump), any parsing of DOT.

use crate::graph::{Graph, ValueDef, ValueId};
use crate::print::attrs;
use crate::text::escape;
use std::collections::{BTreeSet, HashSet};
use std::fmt::Write as _;

/// DOT source of `g`.
pub fn to_dot(g: &Graph) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "digraph \"{}\" {{", dot_escape(&escape(&g.name)));
    out.push_str("  rankdir=TB;\n");
    out.push_str("  node [fontname=\"monospace\", fontsize=10];\n");
    out.push_str("  edge [fontname=\"monospace\", fontsize=9];\n");

    let ty = |v: ValueId| {
        g.values
            .get(v.index())
            .map(|d| d.ty.to_string())
            .unwrap_or_else(|| "?".into())
    };
    for &v in &g.inputs {
        let role = match g.values.get(v.index()).map(|d| &d.def) {
            Some(ValueDef::Input(role)) => role.name(),
            _ => "?".into(),
        };
        let _ = writeln!(
            out,
            "  v{} [shape=box, label=\"{v} input {}\\n{}\"];",
            v.0,
            dot_escape(&role),
            ty(v)
        );
    }
    for &v in &g.weights {
        let name = match g.values.get(v.index()).map(|d| &d.def) {
            Some(ValueDef::Weight(name)) => escape(name),
            _ => "?".into(),
        };
        let _ = writeln!(
            out,
            "  v{} [shape=note, label=\"{v} weight {}\\n{}\"];",
            v.0,
            dot_escape(&name),
            ty(v)
        );
    }
    for (n, node) in g.nodes.iter().enumerate() {
        let a = attrs(&node.op);
        let head = if a.is_empty() {
            format!("node{n}: {}", node.op.mnemonic())
        } else {
            format!("node{n}: {} {{{a}}}", node.op.mnemonic())
        };
        let results: Vec<String> = node
            .results
            .iter()
            .map(|&r| format!("{r} : {}", ty(r)))
            .collect();
        let _ = writeln!(
            out,
            "  n{n} [shape=ellipse, label=\"{}\\n{}\"];",
            dot_escape(&head),
            results.join("\\n")
        );
    }
    for (i, (name, _)) in g.outputs.iter().enumerate() {
        let _ = writeln!(
            out,
            "  out{i} [shape=doubleoctagon, label=\"output {}\"];",
            dot_escape(&escape(name))
        );
    }

    // Where an edge carrying `v` starts, when `v` is declared where its
    // table entry says.
    let inputs: HashSet<ValueId> = g.inputs.iter().copied().collect();
    let weights: HashSet<ValueId> = g.weights.iter().copied().collect();
    let source = |v: ValueId| -> Option<String> {
        match &g.values.get(v.index())?.def {
            ValueDef::Input(_) if inputs.contains(&v) => Some(format!("v{}", v.0)),
            ValueDef::Weight(_) if weights.contains(&v) => Some(format!("v{}", v.0)),
            ValueDef::Node { node, index } => {
                let n = g.nodes.get(node.index())?;
                (n.results.get(*index as usize) == Some(&v)).then(|| format!("n{}", node.0))
            }
            _ => None,
        }
    };
    let mut undefined: BTreeSet<u32> = BTreeSet::new();
    let mut edges = String::new();
    let edge = |from: String, to: String, v: ValueId, edges: &mut String| {
        let _ = writeln!(edges, "  {from} -> {to} [label=\"{v}\"];");
    };
    for (n, node) in g.nodes.iter().enumerate() {
        for &a in &node.args {
            let from = source(a).unwrap_or_else(|| {
                undefined.insert(a.0);
                format!("undef{}", a.0)
            });
            edge(from, format!("n{n}"), a, &mut edges);
        }
    }
    for (i, (_, v)) in g.outputs.iter().enumerate() {
        let from = source(*v).unwrap_or_else(|| {
            undefined.insert(v.0);
            format!("undef{}", v.0)
        });
        edge(from, format!("out{i}"), *v, &mut edges);
    }
    for u in undefined {
        let _ = writeln!(
            out,
            "  undef{u} [shape=box, color=red, fontcolor=red, label=\"undefined %{u}\"];"
        );
    }
    out.push_str(&edges);
    out.push_str("}\n");
    out
}

/// Escapes text for a DOT double-quoted string (shown literally).
fn dot_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out
}
