//! The traced decode step: values with typed `u32` ids, nodes in program
//! order, and side tables.
//!
//! A [`Graph`] is plain data and may be malformed (a parser or a buggy pass
//! can build anything); [`crate::verify()`] decides whether it is well formed.
//! The [`Graph::node`]-building helpers type each result with [`Op::infer`]
//! and panic on a type error, because a frontend that builds an ill-typed
//! graph is a compiler bug, not bad user input.

use crate::op::Op;
use crate::types::TensorType;
use serde::{Deserialize, Serialize};
use std::fmt;

/// An SSA value, printed `%N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ValueId(pub u32);

/// A node (one op application), printed by its position in the body.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(pub u32);

impl ValueId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
impl NodeId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}
impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}
impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node{}", self.0)
    }
}

/// What a graph input is: the step's staging buffers and the KV cache state.
/// Every per-step value reaches the graph through one of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum InputRole {
    /// `i32[B*Q]`: the tokens scored this step (last accepted token, then drafts).
    TokenIds,
    /// `i32[B*Q]`: position of each token.
    Positions,
    /// `i32[B*Q]`: KV slot each token's K/V is written to (the null slot for padding).
    SlotMapping,
    /// `i32[B, M]`: physical block of each sequence's logical block.
    BlockTables,
    /// `i32[B]`: tokens in each sequence's context, including this step's.
    ContextLens,
    /// `i32[B*spec]`: draft tokens to verify (only when spec > 0).
    DraftTokens,
    /// `f32[B, 4]`: each row's `[temperature, top_p, min_p, 0]` for `sample`.
    SampleParams,
    /// `i32[B, 4]`: each row's `[top_k, seed_lo, seed_hi, counter]` for `sample`.
    SampleSeeds,
    /// `D[S, kvh*hd]`: layer `l`'s key cache (state, not staging).
    KCache(u32),
    /// `D[S, kvh*hd]`: layer `l`'s value cache.
    VCache(u32),
    /// `i32[B, 2 + 2P]`: each row's presence and frequency penalties (f32
    /// bits) and `P` `(token, count)` pairs of its generated tokens, for
    /// `sample`. Last in the enum so older plans decode unchanged.
    SamplePenalties,
}

impl InputRole {
    /// True for the host-refreshed staging inputs (not the KV cache).
    pub fn is_staging(self) -> bool {
        !matches!(self, InputRole::KCache(_) | InputRole::VCache(_))
    }
    /// Text spelling: `token_ids`, `k_cache.3`, ...
    pub fn name(self) -> String {
        match self {
            InputRole::TokenIds => "token_ids".into(),
            InputRole::Positions => "positions".into(),
            InputRole::SlotMapping => "slot_mapping".into(),
            InputRole::BlockTables => "block_tables".into(),
            InputRole::ContextLens => "context_lens".into(),
            InputRole::DraftTokens => "draft_tokens".into(),
            InputRole::SampleParams => "sample_params".into(),
            InputRole::SampleSeeds => "sample_seeds".into(),
            InputRole::SamplePenalties => "sample_penalties".into(),
            InputRole::KCache(l) => format!("k_cache.{l}"),
            InputRole::VCache(l) => format!("v_cache.{l}"),
        }
    }
    pub fn from_name(s: &str) -> Option<InputRole> {
        Some(match s {
            "token_ids" => InputRole::TokenIds,
            "positions" => InputRole::Positions,
            "slot_mapping" => InputRole::SlotMapping,
            "block_tables" => InputRole::BlockTables,
            "context_lens" => InputRole::ContextLens,
            "draft_tokens" => InputRole::DraftTokens,
            "sample_params" => InputRole::SampleParams,
            "sample_seeds" => InputRole::SampleSeeds,
            "sample_penalties" => InputRole::SamplePenalties,
            _ => {
                let (kind, l) = s.split_once('.')?;
                if l.is_empty() || !l.bytes().all(|c| c.is_ascii_digit()) {
                    return None;
                }
                let l: u32 = l.parse().ok()?;
                match kind {
                    "k_cache" => InputRole::KCache(l),
                    "v_cache" => InputRole::VCache(l),
                    _ => return None,
                }
            }
        })
    }
}

/// Where a value comes from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ValueDef {
    /// A graph input.
    Input(InputRole),
    /// A weight, by manifest name.
    Weight(String),
    /// Result `index` of node `node`.
    Node { node: NodeId, index: u32 },
}

/// Side-table entry of a value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ValueData {
    pub ty: TensorType,
    pub def: ValueDef,
}

/// One op application.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub op: Op,
    pub args: Vec<ValueId>,
    pub results: Vec<ValueId>,
}

/// A decode-step graph.
#[derive(Clone, Debug, PartialEq, Default, Serialize, Deserialize)]
pub struct Graph {
    /// Free-form name, e.g. `llama b2q1s0`.
    pub name: String,
    /// Side table indexed by [`ValueId`].
    pub values: Vec<ValueData>,
    /// Nodes in program order, indexed by [`NodeId`].
    pub nodes: Vec<Node>,
    /// Input values in declaration order.
    pub inputs: Vec<ValueId>,
    /// Weight values in declaration order.
    pub weights: Vec<ValueId>,
    /// Named outputs (`next_tokens`, `accepted`, `logits`).
    pub outputs: Vec<(String, ValueId)>,
}

impl Graph {
    pub fn new(name: impl Into<String>) -> Graph {
        Graph {
            name: name.into(),
            ..Graph::default()
        }
    }

    pub fn value(&self, v: ValueId) -> &ValueData {
        &self.values[v.index()]
    }
    pub fn ty(&self, v: ValueId) -> &TensorType {
        &self.values[v.index()].ty
    }
    pub fn node(&self, n: NodeId) -> &Node {
        &self.nodes[n.index()]
    }

    fn push_value(&mut self, ty: TensorType, def: ValueDef) -> ValueId {
        let id = ValueId(self.values.len() as u32);
        self.values.push(ValueData { ty, def });
        id
    }

    /// Declares an input.
    pub fn add_input(&mut self, role: InputRole, ty: TensorType) -> ValueId {
        let v = self.push_value(ty, ValueDef::Input(role));
        self.inputs.push(v);
        v
    }

    /// Declares a weight by manifest name.
    pub fn add_weight(&mut self, name: impl Into<String>, ty: TensorType) -> ValueId {
        let v = self.push_value(ty, ValueDef::Weight(name.into()));
        self.weights.push(v);
        v
    }

    /// Finds the input of a role.
    pub fn input(&self, role: InputRole) -> Option<ValueId> {
        self.inputs
            .iter()
            .copied()
            .find(|&v| self.value(v).def == ValueDef::Input(role))
    }

    /// Finds a weight value by manifest name.
    pub fn weight(&self, name: &str) -> Option<ValueId> {
        self.weights
            .iter()
            .copied()
            .find(|&v| matches!(&self.value(v).def, ValueDef::Weight(n) if n == name))
    }

    /// Appends a node, typing its results with [`Op::infer`].
    ///
    /// # Panics
    /// On a type error: frontends and passes must build well-typed graphs.
    pub fn push(&mut self, op: Op, args: &[ValueId]) -> Vec<ValueId> {
        let tys: Vec<TensorType> = args.iter().map(|&a| self.ty(a).clone()).collect();
        let out = match op.infer(&tys) {
            Ok(t) => t,
            Err(e) => panic!("ill-typed node in graph `{}`: {e}", self.name),
        };
        let node = NodeId(self.nodes.len() as u32);
        let results: Vec<ValueId> = out
            .into_iter()
            .enumerate()
            .map(|(i, ty)| {
                self.push_value(
                    ty,
                    ValueDef::Node {
                        node,
                        index: i as u32,
                    },
                )
            })
            .collect();
        self.nodes.push(Node {
            op,
            args: args.to_vec(),
            results: results.clone(),
        });
        results
    }

    /// [`Graph::push`] for single-result ops.
    pub fn push1(&mut self, op: Op, args: &[ValueId]) -> ValueId {
        let r = self.push(op, args);
        assert_eq!(r.len(), 1, "push1 on a multi-result op");
        r[0]
    }

    /// Declares a named output.
    pub fn add_output(&mut self, name: impl Into<String>, v: ValueId) {
        self.outputs.push((name.into(), v));
    }
}
