//! A mutable view of a graph for rewrites, and the canonical rebuild every
//! pass ends with.
//!
//! Passes delete nodes, append fused ones and redirect uses freely; then
//! [`Editor::finish`] schedules the surviving nodes (a stable topological
//! order that keeps the original program order wherever dependencies allow),
//! drops dead code and renumbers values densely: inputs in declaration
//! order, then weights in order of first use, then node results in program
//! order. So the output of every pass is canonical: two equal graphs print
//! the same bytes, whatever rewrites produced them.

use kiln_ir::{Graph, Node, NodeId, Op, TensorType, ValueDef, ValueId};
use std::collections::{BinaryHeap, HashMap};

/// Whether a node must run even when none of its results is read: ops that
/// write state in place (the KV cache writes).
pub fn has_side_effects(op: &Op) -> bool {
    !op.aliases().is_empty()
}

pub(crate) struct Editor {
    pub g: Graph,
    removed: Vec<bool>,
    /// Scheduling key: (position of the node it stands in for, sequence).
    prio: Vec<(u32, u32)>,
    seq: u32,
}

impl Editor {
    pub fn new(g: Graph) -> Editor {
        let n = g.nodes.len();
        Editor {
            g,
            removed: vec![false; n],
            prio: (0..n as u32).map(|i| (i, 0)).collect(),
            seq: 1,
        }
    }

    pub fn is_removed(&self, n: NodeId) -> bool {
        self.removed[n.index()]
    }

    pub fn node_count(&self) -> usize {
        self.g.nodes.len()
    }

    /// The live node defining `v`, if `v` is a node result.
    pub fn producer(&self, v: ValueId) -> Option<(NodeId, usize)> {
        match self.g.value(v).def {
            ValueDef::Node { node, index } if !self.removed[node.index()] => {
                Some((node, index as usize))
            }
            _ => None,
        }
    }

    /// Readers of every value among the live nodes: `(node, argument index)`.
    pub fn users(&self) -> Vec<Vec<(NodeId, usize)>> {
        let mut u = vec![Vec::new(); self.g.values.len()];
        for (i, n) in self.g.nodes.iter().enumerate() {
            if self.removed[i] {
                continue;
            }
            for (j, a) in n.args.iter().enumerate() {
                u[a.index()].push((NodeId(i as u32), j));
            }
        }
        u
    }

    /// Whether `v` is a named graph output.
    pub fn is_output(&self, v: ValueId) -> bool {
        self.g.outputs.iter().any(|(_, o)| *o == v)
    }

    pub fn remove(&mut self, n: NodeId) {
        self.removed[n.index()] = true;
    }

    /// Appends a node scheduled where `anchor` was. Types its results with
    /// [`Op::infer`]; an ill-typed rewrite is an error (a pass bug).
    pub fn add_node(
        &mut self,
        op: Op,
        args: &[ValueId],
        anchor: NodeId,
    ) -> Result<Vec<ValueId>, String> {
        let tys: Vec<TensorType> = args.iter().map(|&a| self.g.ty(a).clone()).collect();
        let out = op.infer(&tys)?;
        let node = NodeId(self.g.nodes.len() as u32);
        let mut results = Vec::with_capacity(out.len());
        for (i, ty) in out.into_iter().enumerate() {
            let id = ValueId(self.g.values.len() as u32);
            self.g.values.push(kiln_ir::ValueData {
                ty,
                def: ValueDef::Node {
                    node,
                    index: i as u32,
                },
            });
            results.push(id);
        }
        self.g.nodes.push(Node {
            op,
            args: args.to_vec(),
            results: results.clone(),
        });
        self.removed.push(false);
        self.prio.push((self.prio[anchor.index()].0, self.seq));
        self.seq += 1;
        Ok(results)
    }

    /// Makes every live reader (and output) of `old` read `new` instead.
    pub fn replace_uses(&mut self, old: ValueId, new: ValueId) {
        for (i, n) in self.g.nodes.iter_mut().enumerate() {
            if self.removed[i] {
                continue;
            }
            for a in n.args.iter_mut() {
                if *a == old {
                    *a = new;
                }
            }
        }
        for (_, o) in self.g.outputs.iter_mut() {
            if *o == old {
                *o = new;
            }
        }
    }

    /// The graph value of weight `name`, declaring it if needed.
    pub fn weight_value(&mut self, name: &str, ty: TensorType) -> ValueId {
        match self.g.weight(name) {
            Some(v) => v,
            None => self.g.add_weight(name, ty),
        }
    }

    /// Schedules, drops dead code and renumbers (see the module docs).
    pub fn finish(self) -> Result<Graph, String> {
        let Editor {
            g, removed, prio, ..
        } = self;
        let n = g.nodes.len();
        // Liveness of nodes: outputs and side effects are roots.
        let mut live = vec![false; n];
        let mut stack: Vec<usize> = Vec::new();
        let producer = |v: ValueId| match g.value(v).def {
            ValueDef::Node { node, .. } => Some(node.index()),
            _ => None,
        };
        for (_, o) in &g.outputs {
            if let Some(p) = producer(*o) {
                stack.push(p);
            }
        }
        for (i, node) in g.nodes.iter().enumerate() {
            if !removed[i] && has_side_effects(&node.op) {
                stack.push(i);
            }
        }
        while let Some(i) = stack.pop() {
            if removed[i] {
                return Err(format!(
                    "a live value is defined by removed node {i} ({})",
                    g.nodes[i].op.mnemonic()
                ));
            }
            if live[i] {
                continue;
            }
            live[i] = true;
            for a in &g.nodes[i].args {
                if let Some(p) = producer(*a) {
                    stack.push(p);
                }
            }
        }

        // Dependencies among live nodes: data edges, plus "every other reader
        // of an argument a node overwrites in place runs before it".
        let mut preds: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut readers: HashMap<ValueId, Vec<usize>> = HashMap::new();
        for i in (0..n).filter(|&i| live[i]) {
            for a in &g.nodes[i].args {
                readers.entry(*a).or_default().push(i);
                if let Some(p) = producer(*a) {
                    preds[i].push(p);
                }
            }
        }
        for i in (0..n).filter(|&i| live[i]) {
            for &(_, arg) in g.nodes[i].op.aliases() {
                let Some(a) = g.nodes[i].args.get(arg) else {
                    continue;
                };
                for &r in readers.get(a).into_iter().flatten() {
                    if r != i {
                        preds[i].push(r);
                    }
                }
            }
        }
        let mut indeg = vec![0usize; n];
        let mut succs: Vec<Vec<usize>> = vec![Vec::new(); n];
        for i in 0..n {
            preds[i].sort_unstable();
            preds[i].dedup();
            for &p in &preds[i] {
                indeg[i] += 1;
                succs[p].push(i);
            }
        }
        let mut ready: BinaryHeap<std::cmp::Reverse<((u32, u32), usize)>> = (0..n)
            .filter(|&i| live[i] && indeg[i] == 0)
            .map(|i| std::cmp::Reverse((prio[i], i)))
            .collect();
        let mut order = Vec::new();
        while let Some(std::cmp::Reverse((_, i))) = ready.pop() {
            order.push(i);
            for &s in &succs[i] {
                indeg[s] -= 1;
                if indeg[s] == 0 {
                    ready.push(std::cmp::Reverse((prio[s], s)));
                }
            }
        }
        let live_count = live.iter().filter(|&&l| l).count();
        if order.len() != live_count {
            return Err("the rewritten graph has a dependency cycle".into());
        }

        // Renumber.
        let mut map: Vec<Option<ValueId>> = vec![None; g.values.len()];
        let mut out = Graph::new(g.name.clone());
        for &v in &g.inputs {
            let ValueDef::Input(role) = g.value(v).def else {
                return Err(format!("input {v} is not defined as an input"));
            };
            map[v.index()] = Some(out.add_input(role, g.ty(v).clone()));
        }
        let declare_weight = |v: ValueId, out: &mut Graph, map: &mut Vec<Option<ValueId>>| {
            if map[v.index()].is_none() {
                if let ValueDef::Weight(name) = &g.value(v).def {
                    map[v.index()] = Some(out.add_weight(name.clone(), g.ty(v).clone()));
                }
            }
        };
        for &i in &order {
            for &a in &g.nodes[i].args {
                declare_weight(a, &mut out, &mut map);
            }
        }
        for (_, o) in &g.outputs {
            declare_weight(*o, &mut out, &mut map);
        }
        for &i in &order {
            let node = &g.nodes[i];
            let mut args = Vec::with_capacity(node.args.len());
            for a in &node.args {
                args.push(map[a.index()].ok_or_else(|| {
                    format!(
                        "`{}` reads {a}, which is not defined before it",
                        node.op.mnemonic()
                    )
                })?);
            }
            let tys: Vec<TensorType> = args.iter().map(|&a| out.ty(a).clone()).collect();
            node.op
                .infer(&tys)
                .map_err(|e| format!("rewritten node is ill-typed: {e}"))?;
            let res = out.push(node.op.clone(), &args);
            for (old, new) in node.results.iter().zip(res) {
                map[old.index()] = Some(new);
            }
        }
        for (name, o) in &g.outputs {
            let v = map[o.index()].ok_or_else(|| format!("output `{name}` is not defined"))?;
            out.add_output(name.clone(), v);
        }
        Ok(out)
    }
}
