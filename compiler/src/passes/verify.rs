//! The well-formedness check run between passes.
//!
//! TODO(ir branch): `kiln_ir::verify::verify` is the verifier of record; when
//! it lands this module becomes a call to it. Until then this is a compact
//! structural check of the properties the passes and the planner rely on:
//! dense ids, definitions before uses in program order, every node typed by
//! [`kiln_ir::Op::infer`], inputs/weights/outputs well defined, weights
//! present in the manifest with their declared type, and nothing reading a
//! value after an op overwrote it in place.

use kiln_ir::{Graph, NodeId, TensorType, ValueDef, ValueId, WeightManifest};

/// Every problem found, each naming where it is.
pub fn verify(g: &Graph, manifest: Option<&WeightManifest>) -> Result<(), Vec<String>> {
    let mut errs = Vec::new();
    let nv = g.values.len();
    // Where each value becomes available: inputs/weights before node 0.
    let mut defined_at: Vec<Option<i64>> = vec![None; nv];
    let ok_id = |v: ValueId| v.index() < nv;
    for &v in &g.inputs {
        if !ok_id(v) {
            errs.push(format!("input {v} is out of range"));
            continue;
        }
        match g.value(v).def {
            ValueDef::Input(role) => {
                if g.inputs
                    .iter()
                    .filter(|&&o| g.value(o).def == ValueDef::Input(role))
                    .count()
                    > 1
                {
                    errs.push(format!("input `{}` is declared twice", role.name()));
                }
                defined_at[v.index()] = Some(-1);
            }
            _ => errs.push(format!("{v} is listed as an input but not defined as one")),
        }
    }
    for &v in &g.weights {
        if !ok_id(v) {
            errs.push(format!("weight {v} is out of range"));
            continue;
        }
        match &g.value(v).def {
            ValueDef::Weight(name) => {
                defined_at[v.index()] = Some(-1);
                if let Some(m) = manifest {
                    match m.get(name) {
                        None => errs.push(format!("weight `{name}` ({v}) is not in the manifest")),
                        Some(e) => {
                            let want = TensorType::new(e.dtype, e.shape.clone());
                            if *g.ty(v) != want {
                                errs.push(format!(
                                    "weight `{name}` is declared {} but the manifest says {want}",
                                    g.ty(v)
                                ));
                            }
                        }
                    }
                }
            }
            _ => errs.push(format!("{v} is listed as a weight but not defined as one")),
        }
    }
    // Values overwritten in place, and by which node.
    let mut clobbered: Vec<Option<usize>> = vec![None; nv];
    for (i, node) in g.nodes.iter().enumerate() {
        let at = format!("node {i} (`{}`)", node.op.mnemonic());
        let mut tys = Vec::new();
        for &a in &node.args {
            if !ok_id(a) {
                errs.push(format!("{at} reads {a}, which does not exist"));
                continue;
            }
            match defined_at[a.index()] {
                Some(d) if d < i as i64 => {}
                _ => errs.push(format!("{at} reads {a} before it is defined")),
            }
            if let Some(c) = clobbered[a.index()] {
                errs.push(format!(
                    "{at} reads {a} after node {c} overwrote it in place"
                ));
            }
            tys.push(g.ty(a).clone());
        }
        if tys.len() != node.args.len() {
            continue;
        }
        match node.op.infer(&tys) {
            Err(e) => errs.push(format!("{at}: {e}")),
            Ok(want) => {
                if want.len() != node.results.len() {
                    errs.push(format!(
                        "{at} has {} results, its op makes {}",
                        node.results.len(),
                        want.len()
                    ));
                    continue;
                }
                for (j, (&r, t)) in node.results.iter().zip(&want).enumerate() {
                    if !ok_id(r) {
                        errs.push(format!("{at} result {j} ({r}) does not exist"));
                        continue;
                    }
                    if g.value(r).def
                        != (ValueDef::Node {
                            node: NodeId(i as u32),
                            index: j as u32,
                        })
                    {
                        errs.push(format!("{at} result {j} ({r}) is not defined by it"));
                    }
                    if defined_at[r.index()].is_some() {
                        errs.push(format!("{r} is defined twice"));
                    }
                    defined_at[r.index()] = Some(i as i64);
                    if g.ty(r) != t {
                        errs.push(format!("{at} result {r} is {} but should be {t}", g.ty(r)));
                    }
                }
            }
        }
        for &(_, arg) in node.op.aliases() {
            if let Some(&a) = node.args.get(arg) {
                if ok_id(a) {
                    clobbered[a.index()] = Some(i);
                }
            }
        }
    }
    for (v, d) in defined_at.iter().enumerate() {
        if d.is_none() {
            errs.push(format!("%{v} is never defined (orphan value)"));
        }
    }
    for (name, v) in &g.outputs {
        if !ok_id(*v) || defined_at[v.index()].is_none() {
            errs.push(format!("output `{name}` names {v}, which is not defined"));
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs)
    }
}
