//! The tensor-parallel shard pass (`kiln compile --tp N`): one rank's graph
//! from the traced (unfused) decode step, Megatron-style.
//!
//! Every rank runs the same program (the plan is SPMD, see
//! `kiln_ir::plan::Plan::tp`), so the pass writes one graph and records in
//! the manifest which slice of each weight a rank binds
//! ([`WeightSource::Sharded`]; the runtime's binder supplies the rank):
//!
//! * q/k/v and gate/up projections are column-parallel: each rank holds
//!   `1/N` of the output rows (its heads, its KV heads, its share of the
//!   intermediate size), biases likewise;
//! * attention runs on the rank's heads; the KV cache inputs hold only the
//!   rank's KV heads;
//! * o_proj and down_proj are row-parallel (each rank's columns of the
//!   weight) and followed by `all_reduce`, so the residual stream is whole
//!   and identical on every rank; norms and embeddings are replicated;
//! * the lm_head is split over the vocabulary, with `sharded_argmax` as the
//!   cross-rank argmax, when [`ShardOptions::split_vocab`] is set; otherwise
//!   it is replicated (every rank computes all logits, bit-identical across
//!   ranks because its input is).
//!
//! It runs before the fusions, which then stack the sharded q/k/v and
//! gate/up slices per rank (`weights::concat_rows` keeps them sharded) and
//! never fold the residual add into a row-parallel matmul (the add reads the
//! `all_reduce`, not the matmul).
//!
//! Not here: choosing N, pipeline parallelism, or a bias on a row-parallel
//! matmul (refused: it would be added N times).

use kiln_ir::{
    AttnAttrs, Graph, Op, ShardAxis, TensorType, ValueDef, ValueId, WeightEntry, WeightManifest,
    WeightSource,
};
use std::collections::HashMap;

/// What the pass needs besides the graph.
#[derive(Clone, Debug)]
pub struct ShardOptions {
    /// Ranks, at least 2.
    pub ranks: u32,
    pub num_heads: u32,
    pub num_kv_heads: u32,
    pub vocab_size: u32,
    /// Split the lm_head over the vocabulary (with `sharded_argmax`);
    /// otherwise replicate it.
    pub split_vocab: bool,
}

/// Refuses a rank count that does not divide the head counts, naming them
/// and the counts that would work.
pub fn check_heads(ranks: u32, heads: u32, kv_heads: u32) -> Result<(), String> {
    if ranks == 0 {
        return Err("--tp must be at least 1".into());
    }
    if heads.is_multiple_of(ranks) && kv_heads.is_multiple_of(ranks) {
        return Ok(());
    }
    let ok: Vec<String> = (1..=kv_heads.min(heads))
        .filter(|d| heads.is_multiple_of(*d) && kv_heads.is_multiple_of(*d))
        .map(|d| d.to_string())
        .collect();
    Err(format!(
        "--tp {ranks} does not divide the model's {heads} attention heads and {kv_heads} KV heads: each rank must hold whole heads and whole KV heads; use --tp {}",
        ok.join(", ")
    ))
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    Column,
    Row,
    Vocab,
}

fn role_of(name: &str, vocab_name: bool) -> Option<Role> {
    const COL: [&str; 5] = [
        ".q_proj.",
        ".k_proj.",
        ".v_proj.",
        ".gate_proj.",
        ".up_proj.",
    ];
    const ROW: [&str; 2] = [".o_proj.", ".down_proj."];
    if COL.iter().any(|r| name.contains(r)) {
        Some(Role::Column)
    } else if ROW.iter().any(|r| name.contains(r)) {
        Some(Role::Row)
    } else if vocab_name {
        Some(Role::Vocab)
    } else {
        None
    }
}

/// The name of rank-sharded weight `name` (the entry differs from the
/// unsharded one, which a tied embedding still reads).
pub fn sharded_name(name: &str, axis: ShardAxis) -> String {
    match axis {
        ShardAxis::Rows => format!("{name}.tp_rows"),
        ShardAxis::Cols => format!("{name}.tp_cols"),
    }
}

/// Rewrites `g` into one rank's graph and adds the sharded weights to
/// `manifest`. See the module docs.
pub fn shard(g: &Graph, manifest: &mut WeightManifest, o: &ShardOptions) -> Result<Graph, String> {
    let n = o.ranks;
    check_heads(n, o.num_heads, o.num_kv_heads)?;
    let mut out = Graph::new(g.name.clone());
    let mut map: HashMap<ValueId, ValueId> = HashMap::new();
    let div = |x: u32, what: &str| -> Result<u32, String> {
        if x.is_multiple_of(n) {
            Ok(x / n)
        } else {
            Err(format!("--tp {n} does not divide the {what} ({x})"))
        }
    };
    for &v in &g.inputs {
        let d = g.value(v);
        let ValueDef::Input(role) = d.def else {
            return Err(format!("input {v} is not an input"));
        };
        let mut ty = d.ty.clone();
        if !role.is_staging() {
            // KV caches hold the rank's KV heads.
            let dims = ty.shape.0.clone();
            ty.shape.0 = vec![dims[0], div(dims[1], "KV cache row (KV heads x head dim)")?];
        }
        map.insert(v, out.add_input(role, ty));
    }
    // Weights are declared lazily, in first-use order, sharded or not.
    let weight = |out: &mut Graph,
                  manifest: &mut WeightManifest,
                  v: ValueId,
                  axis: Option<ShardAxis>|
     -> Result<ValueId, String> {
        let ValueDef::Weight(name) = &g.value(v).def else {
            return Err(format!("{v} is not a weight"));
        };
        let entry = manifest
            .get(name)
            .ok_or_else(|| format!("weight `{name}` is not in the manifest"))?
            .clone();
        let Some(axis) = axis else {
            return Ok(out
                .weight(name)
                .unwrap_or_else(|| out.add_weight(name.clone(), g.ty(v).clone())));
        };
        let WeightSource::Tensor(t) = &entry.source else {
            return Err(format!(
                "weight `{name}` is not one checkpoint tensor; the shard pass runs before fusions"
            ));
        };
        let shape = WeightSource::shard_shape(&entry.shape, axis, n)
            .map_err(|e| format!("weight `{name}`: {e}; pick a --tp that divides it"))?;
        let sname = sharded_name(name, axis);
        if manifest.get(&sname).is_none() {
            let at = manifest.index_of(name).unwrap_or(manifest.entries.len());
            manifest.entries.insert(
                at + 1,
                WeightEntry {
                    name: sname.clone(),
                    dtype: entry.dtype,
                    storage: None,
                    shape: shape.clone(),
                    source: WeightSource::Sharded {
                        parts: vec![t.clone()],
                        axis,
                        ranks: n,
                    },
                },
            );
        }
        Ok(out
            .weight(&sname)
            .unwrap_or_else(|| out.add_weight(sname, TensorType::new(entry.dtype, shape))))
    };
    let vocab_names = ["lm_head.weight", "model.embed_tokens.weight"];
    // Whether the lm_head was split: its argmax becomes `sharded_argmax`.
    let mut vocab_values: Vec<ValueId> = Vec::new();
    for node in &g.nodes {
        let mut op = node.op.clone();
        let mut args = Vec::with_capacity(node.args.len());
        let mut row_parallel = false;
        match &node.op {
            Op::MatMul { bias, .. } => {
                let wv = node.args[1];
                let wname = match &g.value(wv).def {
                    ValueDef::Weight(s) => s.clone(),
                    _ => return Err("a matmul's weight is not a weight".into()),
                };
                let is_vocab = vocab_names.contains(&wname.as_str())
                    && g.ty(wv).shape.dims().first() == Some(&o.vocab_size);
                let role = role_of(&wname, is_vocab).ok_or_else(|| {
                    format!("the shard pass does not know how to split the matmul over `{wname}`")
                })?;
                let (waxis, baxis) = match role {
                    Role::Column => (Some(ShardAxis::Rows), Some(ShardAxis::Rows)),
                    Role::Row => {
                        if *bias {
                            return Err(format!(
                                "the row-parallel matmul over `{wname}` has a bias, which tensor parallelism would add once per rank; compile without --tp"
                            ));
                        }
                        row_parallel = true;
                        (Some(ShardAxis::Cols), None)
                    }
                    Role::Vocab if o.split_vocab && o.vocab_size.is_multiple_of(n) => {
                        (Some(ShardAxis::Rows), Some(ShardAxis::Rows))
                    }
                    Role::Vocab => (None, None),
                };
                args.push(map[&node.args[0]]);
                args.push(weight(&mut out, manifest, wv, waxis)?);
                if *bias {
                    args.push(weight(&mut out, manifest, node.args[2], baxis)?);
                }
                if role == Role::Vocab && waxis.is_some() {
                    vocab_values.push(node.results[0]);
                }
            }
            _ => {
                for &a in &node.args {
                    args.push(match &g.value(a).def {
                        ValueDef::Weight(_) => weight(&mut out, manifest, a, None)?,
                        _ => *map
                            .get(&a)
                            .ok_or_else(|| format!("{a} is used before it is defined"))?,
                    });
                }
            }
        }
        match &mut op {
            Op::Rope { heads, .. } | Op::HeadRmsNorm { heads, .. } => {
                *heads = div(*heads, "heads of a rope / head norm")?
            }
            Op::PagedAttention(AttnAttrs {
                heads, kv_heads, ..
            })
            | Op::QkvRopeKvWrite {
                heads, kv_heads, ..
            } => {
                *heads = div(*heads, "attention heads")?;
                *kv_heads = div(*kv_heads, "KV heads")?;
            }
            Op::Argmax
                if node
                    .args
                    .iter()
                    .any(|a| flows_from_vocab(g, *a, &vocab_values)) =>
            {
                op = Op::ShardedArgmax { ranks: n };
            }
            Op::Sample
                if node
                    .args
                    .iter()
                    .any(|a| flows_from_vocab(g, *a, &vocab_values)) =>
            {
                return Err("in-graph sampling over a vocabulary split across ranks is not supported; the lm_head stays replicated for --sampling plans".into());
            }
            _ => {}
        }
        let tys: Vec<TensorType> = args.iter().map(|&a| out.ty(a).clone()).collect();
        op.infer(&tys)
            .map_err(|e| format!("sharded `{}` does not type-check: {e}", op.mnemonic()))?;
        // A row-parallel matmul's partial products stay f32; the
        // all_reduce rounds their sum once, as the unsharded matmul rounds.
        let act = match &op {
            Op::MatMul { out, .. } if row_parallel => {
                let d = *out;
                op = Op::MatMul {
                    bias: false,
                    out: kiln_ir::DType::F32,
                };
                Some(d)
            }
            _ => None,
        };
        let results = out.push(op, &args);
        for (old, new) in node.results.iter().zip(&results) {
            map.insert(*old, *new);
        }
        if let Some(d) = act {
            let r = out.push1(Op::AllReduce { ranks: n, out: d }, &[results[0]]);
            map.insert(node.results[0], r);
        }
        // Values derived from split logits stay split (gather_last, scale).
        if node.args.first().is_some_and(|a| vocab_values.contains(a))
            && matches!(node.op, Op::GatherLast { .. } | Op::Scale { .. })
        {
            vocab_values.push(node.results[0]);
        }
    }
    for (name, v) in &g.outputs {
        if vocab_values.contains(v) {
            return Err(format!(
                "output `{name}` would hold only one rank's share of the vocabulary; the lm_head stays replicated for plans with a logits output"
            ));
        }
        out.add_output(name.clone(), map[v]);
    }
    Ok(out)
}

fn flows_from_vocab(_g: &Graph, v: ValueId, vocab: &[ValueId]) -> bool {
    vocab.contains(&v)
}
