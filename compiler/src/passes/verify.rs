//! The well-formedness check run before and between passes:
//! [`kiln_ir::verify`], plus the one property the planner relies on that the
//! IR verifier deliberately leaves out (it is about execution, not typing):
//! no node reads a value after another node overwrote that value's memory in
//! place ([`kiln_ir::Op::aliases`], the KV cache writes). The planner gives
//! an in-place result its argument's address, so such a read would see the
//! new contents, not the old.

use kiln_ir::{Graph, GraphInfo, WeightManifest};

/// The IR verifier's [`GraphInfo`] when both checks pass, else every problem
/// found, each naming where it is.
pub fn verify(g: &Graph, manifest: Option<&WeightManifest>) -> Result<GraphInfo, Vec<String>> {
    let info = match kiln_ir::verify(g, manifest) {
        Ok(info) => info,
        Err(e) => return Err(e.errors.iter().map(|e| e.to_string()).collect()),
    };
    let mut errs = Vec::new();
    let mut clobbered: Vec<Option<usize>> = vec![None; g.values.len()];
    for (i, node) in g.nodes.iter().enumerate() {
        for &a in &node.args {
            if let Some(c) = clobbered[a.index()] {
                errs.push(format!(
                    "node{i} (`{}`) reads {a} after node{c} (`{}`) overwrote it in place",
                    node.op.mnemonic(),
                    g.nodes[c].op.mnemonic()
                ));
            }
        }
        for &(_, arg) in node.op.aliases() {
            clobbered[node.args[arg].index()] = Some(i);
        }
    }
    if errs.is_empty() {
        Ok(info)
    } else {
        Err(errs)
    }
}
