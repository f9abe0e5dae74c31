//! Manifest edits that fusions need: concatenated weights and pruning.
//!
//! A fused matmul reads one weight made of several checkpoint tensors stacked
//! along rows. The compiler never writes tensors: it records a
//! [`WeightSource::ConcatRows`] entry and the runtime's binder builds it at
//! load. Entries are shared by every key's graph, so adding one is
//! idempotent; a name collision with different contents is an error.

use kiln_ir::{Graph, Shape, ValueDef, WeightEntry, WeightManifest, WeightSource};
use std::collections::HashSet;

/// The name of a weight made of `names`, each `P + roles[i] + S` for one
/// prefix `P` and suffix `S`: `P + fused_role + S` (e.g. `...self_attn.` +
/// `qkv_proj` + `.weight`). Names that do not follow that pattern are joined
/// with `+`, which no checkpoint uses, so the result never collides.
pub fn fused_name(names: &[&str], roles: &[&str], fused_role: &str) -> String {
    debug_assert_eq!(names.len(), roles.len());
    let split = |name: &str, role: &str| -> Option<(String, String)> {
        // The last occurrence, so a prefix may itself contain the role text.
        let at = name.rfind(role)?;
        Some((name[..at].to_string(), name[at + role.len()..].to_string()))
    };
    let mut common: Option<(String, String)> = None;
    let mut ok = true;
    for (n, r) in names.iter().zip(roles) {
        match (split(n, r), &common) {
            (Some(ps), None) => common = Some(ps),
            (Some(ps), Some(c)) if &ps == c => {}
            _ => {
                ok = false;
                break;
            }
        }
    }
    match (ok, common) {
        (true, Some((p, s))) => format!("{p}{fused_role}{s}"),
        _ => names.join("+"),
    }
}

/// Adds (or finds) the entry `name` that stacks the entries `parts` along
/// rows. All parts must exist, share a dtype and agree on every dimension but
/// the first. The new entry is placed where the first part is, so manifest
/// order follows the checkpoint's.
pub fn concat_rows(
    manifest: &mut WeightManifest,
    name: &str,
    parts: &[&str],
) -> Result<WeightEntry, String> {
    let mut entries = Vec::with_capacity(parts.len());
    for p in parts {
        entries.push(
            manifest
                .get(p)
                .ok_or_else(|| {
                    format!("weight `{p}` is read by the graph but not in the manifest")
                })?
                .clone(),
        );
    }
    let first = &entries[0];
    let mut rows = 0u32;
    let mut sources = Vec::new();
    for e in &entries {
        if e.dtype != first.dtype {
            return Err(format!(
                "cannot stack `{}` ({}) with `{}` ({}): dtypes differ",
                e.name, e.dtype, first.name, first.dtype
            ));
        }
        // Quantized rows concatenate as bytes (blocks lie inside rows), so
        // parts stack when they share one storage; FP8 entries are
        // quantized at load after the concatenation.
        if e.storage != first.storage {
            return Err(format!(
                "cannot stack `{}` (stored {:?}) with `{}` (stored {:?}): storages differ",
                e.name, e.storage, first.name, first.storage
            ));
        }
        let d = e.shape.dims();
        if d.is_empty() || d[1..] != first.shape.dims()[1..] {
            return Err(format!(
                "cannot stack `{}` {} with `{}` {} along rows",
                e.name, e.shape, first.name, first.shape
            ));
        }
        rows = rows
            .checked_add(d[0])
            .ok_or_else(|| format!("stacked weight `{name}` has too many rows"))?;
        sources.extend(e.source.parts().iter().cloned());
    }
    let mut dims = first.shape.dims().to_vec();
    dims[0] = rows;
    let entry = WeightEntry {
        name: name.to_string(),
        dtype: first.dtype,
        shape: Shape(dims),
        storage: first.storage,
        source: WeightSource::ConcatRows(sources),
    };
    match manifest.get(name) {
        Some(existing) if *existing == entry => {}
        Some(existing) => {
            return Err(format!(
                "fused weight `{name}` collides with a different manifest entry ({} {})",
                existing.dtype, existing.shape
            ))
        }
        None => {
            let at = manifest
                .index_of(parts[0])
                .unwrap_or(manifest.entries.len());
            manifest.entries.insert(at, entry.clone());
        }
    }
    Ok(entry)
}

/// Keeps exactly the entries some graph reads, in manifest order.
pub fn prune(manifest: &mut WeightManifest, graphs: &[&Graph]) {
    let used: HashSet<&str> = graphs
        .iter()
        .flat_map(|g| g.weights.iter().map(move |&w| &g.value(w).def))
        .filter_map(|d| match d {
            ValueDef::Weight(n) => Some(n.as_str()),
            _ => None,
        })
        .collect();
    manifest.entries.retain(|e| used.contains(e.name.as_str()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_names_follow_the_checkpoint_convention() {
        assert_eq!(
            fused_name(
                &[
                    "model.layers.3.self_attn.q_proj.weight",
                    "model.layers.3.self_attn.k_proj.weight",
                    "model.layers.3.self_attn.v_proj.weight"
                ],
                &["q_proj", "k_proj", "v_proj"],
                "qkv_proj"
            ),
            "model.layers.3.self_attn.qkv_proj.weight"
        );
        assert_eq!(
            fused_name(&["a.wq", "b.wk"], &["q_proj", "k_proj"], "qk"),
            "a.wq+b.wk"
        );
        // Parts from different layers do not share a prefix.
        assert_eq!(
            fused_name(
                &["l.1.gate_proj.weight", "l.2.up_proj.weight"],
                &["gate_proj", "up_proj"],
                "gate_up_proj"
            ),
            "l.1.gate_proj.weight+l.2.up_proj.weight"
        );
    }
}
