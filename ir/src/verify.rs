//! The verifier: decides whether a [`Graph`] is well formed, and returns the
//! [`GraphInfo`] later stages take as proof that it is.
//!
//! Why it exists: a [`Graph`] is plain data that a parser, a frontend or a
//! pass can get wrong. Every later stage (passes, the planner, the emitter)
//! takes a `&GraphInfo`, which only [`verify`] can make, so none of them runs
//! on an unchecked graph, and none re-derives users or definitions.
//!
//! Invariants, checked in this order (all errors are collected, not just the
//! first; a check that needs an earlier one to hold skips what it cannot
//! judge):
//!
//! 1. **Ids and definitions.** Every [`ValueId`] named by a node (argument or
//!    result), by [`Graph::inputs`], [`Graph::weights`] or [`Graph::outputs`]
//!    is in range. Each value is declared exactly once, where its table entry
//!    says: a `ValueDef::Node { node, index }` value is exactly
//!    `nodes[node].results[index]`, `ValueDef::Input` values are exactly the
//!    ones listed in `inputs`, `ValueDef::Weight` values exactly those in
//!    `weights`. No value is declared twice (a second declaration is a
//!    *duplicate definition*), none is left undeclared. No input role and no
//!    weight name appears twice.
//! 2. **Input types.** Staging inputs are `i32`: token ids, positions, slot
//!    mapping, context lengths and draft tokens of rank 1, block tables of
//!    rank 2; KV caches are float of rank 2.
//! 3. **Op typing.** Each node's argument count is one its op accepts, and
//!    [`Op::infer`](crate::Op::infer) on the recorded argument types succeeds and gives exactly
//!    the recorded result count and types.
//! 4. **Order.** Program order is a topological order: every argument
//!    produced by a node is produced by an earlier node. A dependency cycle is
//!    reported as such (with its nodes), other out-of-order uses as
//!    use-before-definition.
//! 5. **Outputs.** At least one output; names are unique; each refers to a
//!    declared value.
//! 6. **Manifest** (when one is given). Every weight's name is in the
//!    manifest, with the manifest entry's dtype, shape and storage.
//! 7. **Quantized storage.** A value whose type has a
//!    [`storage`](crate::TensorType::storage) is a weight of rank 2 whose row
//!    length is a whole number of the storage's blocks, and it is only the
//!    weight operand of an op whose kernels read that storage
//!    ([`quantized_operand`]: `matmul`, `fused_matmul`, `embedding`).
//!
//! Not here: anything about how a graph runs (memory, kernels, aliasing
//! legality beyond [`Op::aliases`](crate::Op::aliases) being a typing matter), and dead-code
//! judgement (an unused node is legal; removing it is a pass's job).

use crate::graph::{Graph, InputRole, NodeId, ValueDef, ValueId};
use crate::manifest::WeightManifest;
use crate::print::print_with_map;
use crate::text::quote;
pub use crate::text::Location;
use crate::types::{DType, TensorType};
use petgraph::graph::DiGraph;
use std::collections::HashMap;
use std::fmt;

/// What is wrong, without where (see [`VerifyError`]).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum VerifyErrorKind {
    #[error("{value} does not exist (the graph has {count} values); define it or refer to an existing value")]
    DanglingValue { value: ValueId, count: usize },
    #[error("value {value} ({def}) is not declared by any input, weight or node result")]
    Undeclared { value: ValueId, def: String },
    #[error("{value} is declared here as {here}, but its table entry says it is {recorded}")]
    DefMismatch {
        value: ValueId,
        here: String,
        recorded: String,
    },
    #[error("{value} is defined more than once; it is already {first}")]
    DuplicateDefinition { value: ValueId, first: String },
    #[error("input role `{role}` is declared twice (first as {first}); each role is one input")]
    DuplicateRole { role: String, first: ValueId },
    #[error("weight {name} is declared twice (first as {first}); reuse the first value")]
    DuplicateWeight { name: String, first: ValueId },
    #[error("input `{role}` must be {want}, got {got}")]
    InputType {
        role: String,
        want: &'static str,
        got: TensorType,
    },
    #[error("`{op}` takes {want} argument(s), got {got}")]
    Arity {
        op: &'static str,
        want: String,
        got: usize,
    },
    #[error("{0}")]
    Type(String),
    #[error("`{op}` gives {want} result(s), but {got} are declared")]
    ResultCount {
        op: &'static str,
        want: usize,
        got: usize,
    },
    #[error("result {index} of `{op}` is declared {recorded}, but the op gives {inferred}")]
    ResultType {
        op: &'static str,
        index: usize,
        recorded: TensorType,
        inferred: TensorType,
    },
    #[error("{value} is used here before {def} defines it; move the definition earlier")]
    UseBeforeDef { value: ValueId, def: NodeId },
    #[error("dependency cycle: {}", cycle_text(.0))]
    Cycle(Vec<NodeId>),
    #[error("the graph has no outputs; a step must produce at least one (e.g. `next_tokens`)")]
    NoOutputs,
    #[error("output name {0} is used twice; output names must be unique")]
    DuplicateOutput(String),
    #[error("weight {0} is not in the weight manifest; add it there or fix the name")]
    NotInManifest(String),
    #[error("{value} is stored {storage} but only weights of rank 2 may be stored quantized, got {ty}; keep it dense")]
    StorageNotWeight {
        value: ValueId,
        storage: crate::types::QuantType,
        ty: TensorType,
    },
    #[error("weight {value} is stored {storage} with rows of {k} elements, not a whole number of {block}-element blocks; keep this tensor dense (import without --keep-quant for it)")]
    StorageBlocks {
        value: ValueId,
        storage: crate::types::QuantType,
        k: u32,
        block: usize,
    },
    #[error("argument {index} ({value}) of `{op}` is stored {storage}, but `{op}` cannot read quantized storage (only the weight of matmul, fused_matmul and embedding can); keep that weight dense")]
    StorageOperand {
        op: &'static str,
        index: usize,
        value: ValueId,
        storage: crate::types::QuantType,
    },
    #[error("weight {name} is {graph} in the graph but {manifest} in the manifest")]
    ManifestMismatch {
        name: String,
        graph: TensorType,
        manifest: TensorType,
    },
}

fn cycle_text(nodes: &[NodeId]) -> String {
    let mut parts: Vec<String> = nodes.iter().map(|n| n.to_string()).collect();
    if let Some(first) = nodes.first() {
        parts.push(first.to_string());
    }
    format!(
        "{} each need a value the next one defines",
        parts.join(" -> ")
    )
}

/// The argument of `op` that may be a weight kept in quantized storage
/// (invariant 7): the weight of `matmul` / `fused_matmul` and the table of
/// `embedding`, whose CPU kernels (`kiln_kernels::cpu`) and GPU kernels read
/// the blocks directly. Every other operand must be dense.
pub fn quantized_operand(op: &crate::op::Op) -> Option<usize> {
    use crate::op::Op;
    match op {
        Op::MatMul { .. } | Op::FusedMatMul { .. } | Op::MatMulQkvRope { .. } | Op::Embedding => {
            Some(1)
        }
        _ => None,
    }
}

/// One broken invariant: where, a short description of the thing (context),
/// and what is wrong.
#[derive(Clone, Debug, PartialEq)]
pub struct VerifyError {
    pub location: Location,
    /// The thing at `location` in words, e.g. ``node3 (`rms_norm`)``.
    pub context: String,
    pub kind: VerifyErrorKind,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.context, self.kind)
    }
}

/// Every error [`verify`] found, in check order.
#[derive(Clone, Debug, PartialEq)]
pub struct VerifyErrors {
    /// The graph's name.
    pub graph: String,
    pub errors: Vec<VerifyError>,
}

impl fmt::Display for VerifyErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "graph {} is malformed ({} error{}):",
            quote(&self.graph),
            self.errors.len(),
            if self.errors.len() == 1 { "" } else { "s" }
        )?;
        for e in &self.errors {
            write!(f, "\n  {e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for VerifyErrors {}

impl VerifyErrors {
    /// The graph's text form with each error inline, under the line it is
    /// about, with carets under the offending token:
    ///
    /// ```text
    ///   %6 = embedding %0, %99 : bf16[2,64]
    ///                      ^^^ error: %99 does not exist: ...
    /// ```
    ///
    /// Errors about the graph as a whole or about an undeclared value go
    /// under the `graph` line. Pass the graph that was verified.
    pub fn render(&self, g: &Graph) -> String {
        let (text, map) = print_with_map(g);
        let mut under: HashMap<u32, Vec<(u32, u32, &VerifyError)>> = HashMap::new();
        for e in &self.errors {
            let s = map.span(&e.location);
            let len = if s.end.line == s.start.line {
                s.end.column.saturating_sub(s.start.column).max(1)
            } else {
                1
            };
            under
                .entry(s.start.line)
                .or_default()
                .push((s.start.column, len, e));
        }
        let mut out = String::new();
        for (i, line) in text.lines().enumerate() {
            out.push_str(line);
            out.push('\n');
            for &(col, len, e) in under.get(&(i as u32 + 1)).into_iter().flatten() {
                let pad = " ".repeat(col.saturating_sub(1) as usize);
                let carets = "^".repeat(len as usize);
                out.push_str(&format!("{pad}{carets} error: {}\n", e.kind));
            }
        }
        out
    }
}

/// What later stages need to know about a verified graph. Only [`verify`]
/// makes one, so holding a `&GraphInfo` means the graph was verified. It
/// describes the graph it was made from: pass that graph, unchanged, with it
/// ([`GraphInfo::matches`] catches the grossest mix-ups).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraphInfo {
    /// Per value: the nodes reading it, in program order, each once.
    users: Vec<Vec<NodeId>>,
    /// Per value: the node defining it (`None` for inputs and weights).
    def_node: Vec<Option<NodeId>>,
    /// Per value: how many times it is read (node arguments, with repeats,
    /// plus outputs).
    use_count: Vec<u32>,
    /// Per value: whether an output refers to it.
    is_output: Vec<bool>,
    /// A topological order of the nodes: program order.
    order: Vec<NodeId>,
    num_values: usize,
    num_nodes: usize,
}

impl GraphInfo {
    /// Nodes that read `v`, in program order, each once (a node reading `v`
    /// twice is listed once).
    pub fn users(&self, v: ValueId) -> &[NodeId] {
        &self.users[v.index()]
    }
    /// The node defining `v`; `None` for inputs and weights.
    pub fn def_node(&self, v: ValueId) -> Option<NodeId> {
        self.def_node[v.index()]
    }
    /// Reads of `v`: node arguments (a node reading it twice counts twice)
    /// plus outputs referring to it.
    pub fn use_count(&self, v: ValueId) -> usize {
        self.use_count[v.index()] as usize
    }
    /// Whether an output refers to `v`.
    pub fn is_output(&self, v: ValueId) -> bool {
        self.is_output[v.index()]
    }
    /// The last node reading `v` (`None` when no node reads it). An output
    /// value stays live to the end of the step regardless.
    pub fn last_use(&self, v: ValueId) -> Option<NodeId> {
        self.users[v.index()].last().copied()
    }
    /// The nodes in a topological order (program order, which the verifier
    /// checked is one).
    pub fn order(&self) -> &[NodeId] {
        &self.order
    }
    /// Whether `g` has the value and node counts of the verified graph.
    pub fn matches(&self, g: &Graph) -> bool {
        g.values.len() == self.num_values && g.nodes.len() == self.num_nodes
    }
}

/// A place that declares a value.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Site {
    Input(usize),
    Weight(usize),
    Result { node: usize, index: usize },
}

impl Site {
    fn location(self) -> Location {
        match self {
            Site::Input(i) => Location::Input(i),
            Site::Weight(i) => Location::Weight(i),
            Site::Result { node, index } => Location::Result {
                node: NodeId(node as u32),
                result: index,
            },
        }
    }
    fn describe(self, g: &Graph) -> String {
        match self {
            Site::Input(i) => format!("input {i} of the inputs list"),
            Site::Weight(i) => format!("weight {i} of the weights list"),
            Site::Result { node, index } => format!(
                "result {index} of {} (`{}`)",
                NodeId(node as u32),
                g.nodes[node].op.mnemonic()
            ),
        }
    }
    /// Whether a value whose table entry is `def` belongs at this site.
    fn fits(self, def: &ValueDef) -> bool {
        match (self, def) {
            (Site::Input(_), ValueDef::Input(_)) => true,
            (Site::Weight(_), ValueDef::Weight(_)) => true,
            (Site::Result { node, index }, ValueDef::Node { node: n, index: i }) => {
                n.index() == node && *i as usize == index
            }
            _ => false,
        }
    }
}

/// A value's table entry in words.
fn describe_def(def: &ValueDef) -> String {
    match def {
        ValueDef::Input(role) => format!("input `{}`", role.name()),
        ValueDef::Weight(name) => format!("weight {}", quote(name)),
        ValueDef::Node { node, index } => format!("result {index} of {node}"),
    }
}

struct Checker<'g> {
    g: &'g Graph,
    errors: Vec<VerifyError>,
}

impl Checker<'_> {
    fn context(&self, loc: Location) -> String {
        let g = self.g;
        let node = |n: NodeId| match g.nodes.get(n.index()) {
            Some(node) => format!("{n} (`{}`)", node.op.mnemonic()),
            None => n.to_string(),
        };
        match loc {
            Location::Graph => "graph".into(),
            Location::Value(v) => format!("value {v}"),
            Location::Input(i) => match g.inputs.get(i).and_then(|v| g.values.get(v.index())) {
                Some(d) => match &d.def {
                    ValueDef::Input(role) => format!("input {i} (`{}`)", role.name()),
                    _ => format!("input {i}"),
                },
                None => format!("input {i}"),
            },
            Location::Weight(i) => match g.weights.get(i).and_then(|v| g.values.get(v.index())) {
                Some(d) => match &d.def {
                    ValueDef::Weight(name) => format!("weight {i} ({})", quote(name)),
                    _ => format!("weight {i}"),
                },
                None => format!("weight {i}"),
            },
            Location::Node(n) => node(n),
            Location::Arg { node: n, arg } => format!("{}, argument {arg}", node(n)),
            Location::Result { node: n, result } | Location::ResultType { node: n, result } => {
                format!("{}, result {result}", node(n))
            }
            Location::Output(i) => match g.outputs.get(i) {
                Some((name, _)) => format!("output {}", quote(name)),
                None => format!("output {i}"),
            },
        }
    }

    fn err(&mut self, location: Location, kind: VerifyErrorKind) {
        let context = self.context(location);
        self.errors.push(VerifyError {
            location,
            context,
            kind,
        });
    }

    fn in_range(&mut self, v: ValueId, loc: Location) -> bool {
        if v.index() < self.g.values.len() {
            true
        } else {
            self.err(
                loc,
                VerifyErrorKind::DanglingValue {
                    value: v,
                    count: self.g.values.len(),
                },
            );
            false
        }
    }
}

/// Checks every invariant in the module docs. On success, the facts later
/// stages need; on failure, every error found.
pub fn verify(g: &Graph, manifest: Option<&WeightManifest>) -> Result<GraphInfo, VerifyErrors> {
    let mut c = Checker { g, errors: vec![] };
    let nv = g.values.len();

    // 1. Ids and definitions.
    let mut sites: Vec<Vec<Site>> = vec![vec![]; nv];
    for (i, &v) in g.inputs.iter().enumerate() {
        if c.in_range(v, Location::Input(i)) {
            sites[v.index()].push(Site::Input(i));
        }
    }
    for (i, &v) in g.weights.iter().enumerate() {
        if c.in_range(v, Location::Weight(i)) {
            sites[v.index()].push(Site::Weight(i));
        }
    }
    for (n, node) in g.nodes.iter().enumerate() {
        let id = NodeId(n as u32);
        for (i, &r) in node.results.iter().enumerate() {
            if c.in_range(
                r,
                Location::Result {
                    node: id,
                    result: i,
                },
            ) {
                sites[r.index()].push(Site::Result { node: n, index: i });
            }
        }
        for (a, &v) in node.args.iter().enumerate() {
            c.in_range(v, Location::Arg { node: id, arg: a });
        }
    }
    // `declared[v]`: v is declared where its table entry says (exactly once).
    let mut declared = vec![false; nv];
    // Site errors, gathered per value, reported in site order below so the
    // errors read top to bottom.
    let mut site_errors: Vec<(Site, VerifyErrorKind)> = vec![];
    for (v, (data, here)) in g.values.iter().zip(&sites).enumerate() {
        let value = ValueId(v as u32);
        let fitting = here.iter().position(|s| s.fits(&data.def));
        match fitting {
            None if here.is_empty() => c.err(
                Location::Value(value),
                VerifyErrorKind::Undeclared {
                    value,
                    def: describe_def(&data.def),
                },
            ),
            None => {
                site_errors.push((
                    here[0],
                    VerifyErrorKind::DefMismatch {
                        value,
                        here: here[0].describe(g),
                        recorded: describe_def(&data.def),
                    },
                ));
                for &s in &here[1..] {
                    site_errors.push((
                        s,
                        VerifyErrorKind::DuplicateDefinition {
                            value,
                            first: here[0].describe(g),
                        },
                    ));
                }
            }
            Some(k) => {
                declared[v] = true;
                for (j, &s) in here.iter().enumerate() {
                    if j != k {
                        site_errors.push((
                            s,
                            VerifyErrorKind::DuplicateDefinition {
                                value,
                                first: describe_def(&data.def),
                            },
                        ));
                    }
                }
            }
        }
    }
    let site_key = |s: &Site| match *s {
        Site::Input(i) => (0, i, 0),
        Site::Weight(i) => (1, i, 0),
        Site::Result { node, index } => (2, node, index),
    };
    site_errors.sort_by_key(|(s, _)| site_key(s));
    for (s, kind) in site_errors {
        c.err(s.location(), kind);
    }
    let mut roles: HashMap<InputRole, ValueId> = HashMap::new();
    for (i, &v) in g.inputs.iter().enumerate() {
        if let Some(ValueDef::Input(role)) = g.values.get(v.index()).map(|d| &d.def) {
            if let Some(&first) = roles.get(role) {
                c.err(
                    Location::Input(i),
                    VerifyErrorKind::DuplicateRole {
                        role: role.name(),
                        first,
                    },
                );
            } else {
                roles.insert(*role, v);
            }
        }
    }
    let mut names: HashMap<&str, ValueId> = HashMap::new();
    for (i, &v) in g.weights.iter().enumerate() {
        if let Some(ValueDef::Weight(name)) = g.values.get(v.index()).map(|d| &d.def) {
            if let Some(&first) = names.get(name.as_str()) {
                c.err(
                    Location::Weight(i),
                    VerifyErrorKind::DuplicateWeight {
                        name: quote(name),
                        first,
                    },
                );
            } else {
                names.insert(name, v);
            }
        }
    }

    // 2. Input types.
    for (i, &v) in g.inputs.iter().enumerate() {
        let Some(data) = g.values.get(v.index()) else {
            continue;
        };
        let ValueDef::Input(role) = data.def else {
            continue;
        };
        let (ok, want) = match role {
            InputRole::BlockTables => (
                data.ty.dtype == DType::I32 && data.ty.shape.rank() == 2,
                "i32 of rank 2",
            ),
            InputRole::KCache(_) | InputRole::VCache(_) => (
                data.ty.dtype.is_float() && data.ty.shape.rank() == 2,
                "a float tensor of rank 2",
            ),
            InputRole::SampleParams => (
                data.ty.dtype == DType::F32 && data.ty.shape.rank() == 2,
                "f32 of rank 2",
            ),
            InputRole::SampleSeeds | InputRole::SamplePenalties => (
                data.ty.dtype == DType::I32 && data.ty.shape.rank() == 2,
                "i32 of rank 2",
            ),
            _ => (
                data.ty.dtype == DType::I32 && data.ty.shape.rank() == 1,
                "i32 of rank 1",
            ),
        };
        if !ok {
            c.err(
                Location::Input(i),
                VerifyErrorKind::InputType {
                    role: role.name(),
                    want,
                    got: data.ty.clone(),
                },
            );
        }
    }

    // 3. Op typing.
    for (n, node) in g.nodes.iter().enumerate() {
        let id = NodeId(n as u32);
        let m = node.op.mnemonic();
        if !node.op.arity().contains(&node.args.len()) {
            let want: Vec<String> = node.op.arity().iter().map(|a| a.to_string()).collect();
            c.err(
                Location::Node(id),
                VerifyErrorKind::Arity {
                    op: m,
                    want: want.join(" or "),
                    got: node.args.len(),
                },
            );
            continue;
        }
        let Some(tys) = node
            .args
            .iter()
            .map(|a| g.values.get(a.index()).map(|d| d.ty.clone()))
            .collect::<Option<Vec<TensorType>>>()
        else {
            continue; // dangling argument, reported above
        };
        match node.op.infer(&tys) {
            Err(msg) => c.err(Location::Node(id), VerifyErrorKind::Type(msg)),
            Ok(out) if out.len() != node.results.len() => c.err(
                Location::Node(id),
                VerifyErrorKind::ResultCount {
                    op: m,
                    want: out.len(),
                    got: node.results.len(),
                },
            ),
            Ok(out) => {
                for (i, (ty, r)) in out.into_iter().zip(&node.results).enumerate() {
                    let Some(data) = g.values.get(r.index()) else {
                        continue;
                    };
                    if !(Site::Result { node: n, index: i }).fits(&data.def) {
                        continue; // not this node's value: reported above
                    }
                    if data.ty != ty {
                        c.err(
                            Location::ResultType {
                                node: id,
                                result: i,
                            },
                            VerifyErrorKind::ResultType {
                                op: m,
                                index: i,
                                recorded: data.ty.clone(),
                                inferred: ty,
                            },
                        );
                    }
                }
            }
        }
    }

    // 4. Order. `producer[v]`: the node defining v, when v is declared as a
    // node result.
    let producer: Vec<Option<NodeId>> = g
        .values
        .iter()
        .enumerate()
        .map(|(v, d)| match d.def {
            ValueDef::Node { node, .. } if declared[v] => Some(node),
            _ => None,
        })
        .collect();
    let mut dag: DiGraph<(), ()> = DiGraph::with_capacity(g.nodes.len(), 0);
    for _ in &g.nodes {
        dag.add_node(());
    }
    for (n, node) in g.nodes.iter().enumerate() {
        for a in &node.args {
            if let Some(Some(p)) = producer.get(a.index()) {
                dag.add_edge(
                    petgraph::graph::NodeIndex::new(p.index()),
                    petgraph::graph::NodeIndex::new(n),
                    (),
                );
            }
        }
    }
    // Strongly connected components with more than one node, or a node
    // feeding itself, are cycles.
    let mut cyclic = vec![false; g.nodes.len()];
    let mut cycles: Vec<Vec<NodeId>> = vec![];
    for scc in petgraph::algo::tarjan_scc(&dag) {
        let self_loop = scc.len() == 1 && dag.contains_edge(scc[0], scc[0]);
        if scc.len() > 1 || self_loop {
            let mut nodes: Vec<NodeId> = scc.iter().map(|i| NodeId(i.index() as u32)).collect();
            nodes.sort();
            for n in &nodes {
                cyclic[n.index()] = true;
            }
            cycles.push(nodes);
        }
    }
    cycles.sort();
    for nodes in cycles {
        c.err(Location::Node(nodes[0]), VerifyErrorKind::Cycle(nodes));
    }
    for (n, node) in g.nodes.iter().enumerate() {
        if cyclic[n] {
            continue;
        }
        for (i, a) in node.args.iter().enumerate() {
            if let Some(Some(p)) = producer.get(a.index()) {
                if p.index() >= n {
                    c.err(
                        Location::Arg {
                            node: NodeId(n as u32),
                            arg: i,
                        },
                        VerifyErrorKind::UseBeforeDef { value: *a, def: *p },
                    );
                }
            }
        }
    }

    // 5. Outputs.
    if g.outputs.is_empty() {
        c.err(Location::Graph, VerifyErrorKind::NoOutputs);
    }
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (i, (name, v)) in g.outputs.iter().enumerate() {
        if seen.insert(name.as_str(), i).is_some() {
            c.err(
                Location::Output(i),
                VerifyErrorKind::DuplicateOutput(quote(name)),
            );
        }
        c.in_range(*v, Location::Output(i));
    }

    // 6. Manifest.
    if let Some(manifest) = manifest {
        for (i, &v) in g.weights.iter().enumerate() {
            let Some(data) = g.values.get(v.index()) else {
                continue;
            };
            let ValueDef::Weight(name) = &data.def else {
                continue;
            };
            match manifest.get(name) {
                None => c.err(
                    Location::Weight(i),
                    VerifyErrorKind::NotInManifest(quote(name)),
                ),
                Some(e)
                    if e.dtype != data.ty.dtype
                        || e.shape != data.ty.shape
                        || e.storage != data.ty.storage =>
                {
                    let mut manifest = TensorType::new(e.dtype, e.shape.clone());
                    manifest.storage = e.storage;
                    c.err(
                        Location::Weight(i),
                        VerifyErrorKind::ManifestMismatch {
                            name: quote(name),
                            graph: data.ty.clone(),
                            manifest,
                        },
                    )
                }
                Some(_) => {}
            }
        }
    }

    // 7. Quantized storage.
    for (v, data) in g.values.iter().enumerate() {
        let Some(q) = data.ty.storage else { continue };
        let value = ValueId(v as u32);
        let weight = g.weights.iter().position(|&w| w == value);
        let loc = weight.map_or(Location::Graph, Location::Weight);
        let dims = data.ty.shape.dims();
        if weight.is_none() || dims.len() != 2 {
            c.err(
                loc,
                VerifyErrorKind::StorageNotWeight {
                    value,
                    storage: q,
                    ty: data.ty.clone(),
                },
            );
            continue;
        }
        if q.row_bytes(dims[1] as usize).is_none() {
            c.err(
                loc,
                VerifyErrorKind::StorageBlocks {
                    value,
                    storage: q,
                    k: dims[1],
                    block: q.block_elems(),
                },
            );
        }
    }
    for (n, node) in g.nodes.iter().enumerate() {
        for (index, a) in node.args.iter().enumerate() {
            let Some(q) = g.values.get(a.index()).and_then(|d| d.ty.storage) else {
                continue;
            };
            if quantized_operand(&node.op) != Some(index) {
                c.err(
                    Location::Arg {
                        node: NodeId(n as u32),
                        arg: index,
                    },
                    VerifyErrorKind::StorageOperand {
                        op: node.op.mnemonic(),
                        index,
                        value: *a,
                        storage: q,
                    },
                );
            }
        }
    }

    if !c.errors.is_empty() {
        return Err(VerifyErrors {
            graph: g.name.clone(),
            errors: c.errors,
        });
    }

    let mut users: Vec<Vec<NodeId>> = vec![vec![]; nv];
    let mut use_count = vec![0u32; nv];
    let mut is_output = vec![false; nv];
    for (n, node) in g.nodes.iter().enumerate() {
        for a in &node.args {
            use_count[a.index()] += 1;
            let u = &mut users[a.index()];
            if u.last() != Some(&NodeId(n as u32)) {
                u.push(NodeId(n as u32));
            }
        }
    }
    for (_, v) in &g.outputs {
        use_count[v.index()] += 1;
        is_output[v.index()] = true;
    }
    Ok(GraphInfo {
        users,
        def_node: producer,
        use_count,
        is_output,
        order: (0..g.nodes.len() as u32).map(NodeId).collect(),
        num_values: nv,
        num_nodes: g.nodes.len(),
    })
}
