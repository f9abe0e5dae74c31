//! An independent checker of finished plans.
//!
//! It exists because a planner bug is silent: two live buffers sharing bytes
//! produce plausible but wrong tokens. [`check_plan`] first runs the plan
//! invariants every consumer relies on (`kiln_ir::validate`: bounds,
//! alignment, operand types, sizes, lowering against target, launch
//! parameters, key uniqueness), then re-derives, from the graph and the op
//! list alone, what a correct placement must satisfy, with deliberately
//! simple code that shares nothing with the planner (no interval sweeps, no
//! groups: every pair of buffers is compared, O(n^2)):
//!
//! * each op executes its graph node with the node's operands at the
//!   addresses of the memory map, and is named `gemm` or its mnemonic;
//! * lifetimes in the memory map are the ones the op list implies;
//! * weights live in their manifest entry's region, caches in their layer's
//!   region at full size, staging inputs and outputs in Io, results written
//!   in place at their argument's address, everything else in the arena;
//! * arena buffers are 256-byte aligned and inside `[0, arena_peak)`, and
//!   two arena buffers alive at the same op never share a byte, except an
//!   argument and the result an op may write over it ([`Op::may_reuse`]) when
//!   the argument dies at that op and they are placed identically; an op's
//!   scratch is an arena buffer alive during that op only, and shares no
//!   byte with anything alive then (its own operands included);
//! * Io buffers are pairwise disjoint;
//! * the lower bound is recomputed (the largest sum of aligned sizes alive
//!   at one op, scratch included, counting a reused pair once) and equals
//!   the plan's, and the peak is at least that.
//!
//! Not here: judging how good a placement is (that is the efficiency
//! figure), or checking the graph itself (the verifier).

use kiln_ir::plan::{BufRef, KeyPlan, KvLayout, Plan, Region, ARENA_ALIGN};
use kiln_ir::{InputRole, Op, ValueDef, WeightManifest};

fn ranges_meet(a: &BufRef, b: &BufRef) -> bool {
    a.region == b.region
        && a.bytes > 0
        && b.bytes > 0
        && a.offset < b.offset + b.bytes
        && b.offset < a.offset + a.bytes
}

fn round_up(x: u64) -> u64 {
    x.div_ceil(ARENA_ALIGN) * ARENA_ALIGN
}

/// Checks every key of `plan` and the plan-level figures. Returns every
/// violation found, each naming the key and the values involved.
pub fn check_plan(plan: &Plan) -> Result<(), Vec<String>> {
    let mut errs = Vec::new();
    if let Err(e) = kiln_ir::validate::validate(plan) {
        errs.push(e.to_string());
    }
    for kp in &plan.keys {
        errs.extend(check_key(kp, &plan.manifest, &plan.kv));
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs)
    }
}

/// Checks one key plan (see the module docs).
pub fn check_key(kp: &KeyPlan, manifest: &WeightManifest, kv: &KvLayout) -> Vec<String> {
    let k = kp.key;
    let g = &kp.graph;
    let mut errs = Vec::new();
    let nv = g.values.len();
    if kp.buffers.len() != nv {
        errs.push(format!(
            "{k}: memory map has {} entries for {nv} values",
            kp.buffers.len()
        ));
        return errs;
    }
    for (i, b) in kp.buffers.iter().enumerate() {
        if b.value.index() != i {
            errs.push(format!("{k}: memory map entry {i} is for {}", b.value));
            return errs;
        }
    }
    let at = |v: kiln_ir::ValueId| kp.buffers[v.index()].buf;

    // Lifetimes implied by the op list.
    let mut def: Vec<Option<u32>> = vec![None; nv];
    let mut last: Vec<Option<u32>> = vec![None; nv];
    if kp.ops.len() != g.nodes.len() {
        errs.push(format!(
            "{k}: {} ops for {} graph nodes",
            kp.ops.len(),
            g.nodes.len()
        ));
    }
    let mut seen_node = vec![false; g.nodes.len()];
    for (i, op) in kp.ops.iter().enumerate() {
        let Some(node) = g.nodes.get(op.node.index()) else {
            errs.push(format!("{k}: op {i} runs missing node {}", op.node));
            continue;
        };
        if std::mem::replace(&mut seen_node[op.node.index()], true) {
            errs.push(format!("{k}: node {} runs twice", op.node));
        }
        if op.op != node.op {
            errs.push(format!("{k}: op {i} is not its node's op"));
        }
        let want = match node.op {
            Op::MatMul { .. } => "gemm",
            _ => node.op.mnemonic(),
        };
        if op.kernel != want {
            errs.push(format!(
                "{k}: op {i} kernel `{}` should be `{want}`",
                op.kernel
            ));
        }
        for (list, vals, what) in [
            (&op.args, &node.args, "argument"),
            (&op.results, &node.results, "result"),
        ] {
            if list.len() != vals.len() {
                errs.push(format!("{k}: op {i} has the wrong number of {what}s"));
                continue;
            }
            for (j, (o, &v)) in list.iter().zip(vals).enumerate() {
                if o.buf != at(v) || o.ty != *g.ty(v) {
                    errs.push(format!(
                        "{k}: op {i} {what} {j} ({v}) does not match the memory map"
                    ));
                }
            }
        }
        for &a in &node.args {
            last[a.index()] = Some(i as u32);
        }
        for &r in &node.results {
            if def[r.index()].is_some() {
                errs.push(format!("{k}: {r} is produced twice"));
            }
            def[r.index()] = Some(i as u32);
        }
    }
    for (v, b) in kp.buffers.iter().enumerate() {
        if b.first_use != def[v] || b.last_use != last[v] {
            errs.push(format!(
                "{k}: %{v} lifetime {:?}..{:?} in the memory map, {:?}..{:?} in the op list",
                b.first_use, b.last_use, def[v], last[v]
            ));
        }
    }

    // Where each value must live.
    let outputs: Vec<kiln_ir::ValueId> = g.outputs.iter().map(|(_, v)| *v).collect();
    for (v, vd) in g.values.iter().enumerate() {
        let b = kp.buffers[v].buf;
        let bytes = vd.ty.size_bytes();
        let is_out = outputs.iter().any(|o| o.index() == v);
        let bad = |why: String| format!("{k}: %{v} {why}, placed at {:?}", b);
        match &vd.def {
            ValueDef::Input(role) => match role {
                InputRole::KCache(l) | InputRole::VCache(l) => {
                    let region = if matches!(role, InputRole::KCache(_)) {
                        Region::KCache(*l)
                    } else {
                        Region::VCache(*l)
                    };
                    if b.region != region
                        || b.offset != 0
                        || b.bytes != kv.cache_bytes()
                        || bytes != kv.cache_bytes()
                    {
                        errs.push(bad(format!(
                            "is `{}` but is not the whole cache region",
                            role.name()
                        )));
                    }
                }
                _ => {
                    if b.region != Region::Io || b.bytes != bytes {
                        errs.push(bad("is a staging input outside Io".into()));
                    }
                    if !kp.inputs.iter().any(|(r, rb)| r == role && *rb == b) {
                        errs.push(bad(format!(
                            "staging input `{}` is not listed",
                            role.name()
                        )));
                    }
                }
            },
            ValueDef::Weight(name) => match manifest.entries.iter().position(|e| &e.name == name) {
                None => errs.push(bad(format!("weight `{name}` is not in the manifest"))),
                Some(idx) => {
                    if b.region != Region::Weight(idx as u32) || b.offset != 0 || b.bytes != bytes {
                        errs.push(bad(format!(
                            "weight `{name}` is not its manifest entry {idx}"
                        )));
                    }
                }
            },
            ValueDef::Node { node, index } => {
                let n = &g.nodes[node.index()];
                if let Some(&(_, a)) = n.op.aliases().iter().find(|(r, _)| *r == *index as usize) {
                    if b != at(n.args[a]) {
                        errs.push(bad(format!(
                            "is written in place over {} but not placed there",
                            n.args[a]
                        )));
                    }
                } else if is_out {
                    if b.region != Region::Io || b.bytes != bytes {
                        errs.push(bad("is an output outside Io".into()));
                    }
                } else if b.region != Region::Arena || b.bytes != bytes {
                    errs.push(bad("is an intermediate outside the arena".into()));
                }
            }
        }
    }
    for (name, o) in &kp.outputs {
        match g.outputs.iter().find(|(n, _)| n == name) {
            Some((_, v)) if o.buf == at(*v) && o.ty == *g.ty(*v) => {}
            _ => errs.push(format!("{k}: output `{name}` does not match the graph")),
        }
    }
    if kp.outputs.len() != g.outputs.len() {
        errs.push(format!("{k}: outputs list does not match the graph"));
    }

    // Arena: alignment, bounds, pairwise disjointness of live buffers.
    let arena: Vec<usize> = (0..nv)
        .filter(|&v| kp.buffers[v].buf.region == Region::Arena)
        .collect();
    // (arg, result) pairs an op may place together.
    let reuse_ok = |a: usize, r: usize| -> bool {
        let Some(d) = def[r] else { return false };
        let n = &g.nodes[kp.ops[d as usize].node.index()];
        let Some(ri) = n.results.iter().position(|x| x.index() == r) else {
            return false;
        };
        last[a] == Some(d)
            && n.op
                .may_reuse()
                .iter()
                .any(|&(rr, aa)| rr == ri && n.args.get(aa).is_some_and(|x| x.index() == a))
            && kp.buffers[a].buf.offset == kp.buffers[r].buf.offset
            && kp.buffers[a].buf.bytes == kp.buffers[r].buf.bytes
    };
    let live = |v: usize| -> Option<(u32, u32)> {
        let s = def[v]?;
        Some((s, last[v].unwrap_or(s).max(s)))
    };
    for (x, &u) in arena.iter().enumerate() {
        let bu = kp.buffers[u].buf;
        if !bu.offset.is_multiple_of(ARENA_ALIGN) {
            errs.push(format!(
                "{k}: %{u} arena offset {} is not aligned",
                bu.offset
            ));
        }
        if bu.offset + bu.bytes > kp.arena_peak {
            errs.push(format!(
                "{k}: %{u} [{}, {}) is outside the arena peak {}",
                bu.offset,
                bu.offset + bu.bytes,
                kp.arena_peak
            ));
        }
        let Some((us, ue)) = live(u) else {
            errs.push(format!("{k}: %{u} is in the arena but no op makes it"));
            continue;
        };
        for &w in &arena[..x] {
            let Some((ws, we)) = live(w) else { continue };
            if us > we || ws > ue || !ranges_meet(&bu, &kp.buffers[w].buf) {
                continue;
            }
            if reuse_ok(u, w) || reuse_ok(w, u) {
                continue;
            }
            errs.push(format!(
                "{k}: %{u} (ops {us}..{ue}) and %{w} (ops {ws}..{we}) are alive together and share arena bytes"
            ));
        }
    }
    // Scratch: an arena buffer alive during its op only.
    for (i, op) in kp.ops.iter().enumerate() {
        let Some(s) = op.scratch else { continue };
        if s.region != Region::Arena
            || !s.offset.is_multiple_of(ARENA_ALIGN)
            || s.offset + s.bytes > kp.arena_peak
        {
            errs.push(format!(
                "{k}: op {i} scratch {s:?} is not an aligned arena buffer inside the peak {}",
                kp.arena_peak
            ));
        }
        for &w in &arena {
            let Some((ws, we)) = live(w) else { continue };
            if ws <= i as u32 && i as u32 <= we && ranges_meet(&s, &kp.buffers[w].buf) {
                errs.push(format!(
                    "{k}: op {i} scratch and %{w} (ops {ws}..{we}) are alive together and share arena bytes"
                ));
            }
        }
    }
    // The lower bound, recomputed op by op.
    let mut lb = 0u64;
    for t in 0..kp.ops.len() as u32 {
        let mut sum = kp.ops[t as usize]
            .scratch
            .filter(|s| s.region == Region::Arena)
            .map_or(0, |s| round_up(s.bytes));
        for &v in &arena {
            if let Some((s, e)) = live(v) {
                if s <= t && t <= e {
                    sum += round_up(kp.buffers[v].buf.bytes);
                }
            }
        }
        // A result placed over an argument that dies here is one buffer.
        let node = &g.nodes[kp.ops[t as usize].node.index()];
        let mut counted: Vec<usize> = Vec::new();
        for &r in &node.results {
            for &a in &node.args {
                let (a, r) = (a.index(), r.index());
                if kp.buffers[a].buf.region == Region::Arena
                    && kp.buffers[r].buf.region == Region::Arena
                    && !counted.contains(&a)
                    && reuse_ok(a, r)
                {
                    counted.push(a);
                    sum -= round_up(kp.buffers[r].buf.bytes);
                }
            }
        }
        lb = lb.max(sum);
    }
    if lb != kp.arena_lower_bound {
        errs.push(format!(
            "{k}: recomputed arena lower bound {lb} differs from the plan's {}",
            kp.arena_lower_bound
        ));
    }
    if kp.arena_peak < kp.arena_lower_bound {
        errs.push(format!(
            "{k}: arena peak {} is below the lower bound {}",
            kp.arena_peak, kp.arena_lower_bound
        ));
    }

    // Io: pairwise disjoint (bounds and alignment: `kiln_ir::validate`).
    let io: Vec<usize> = (0..nv)
        .filter(|&v| kp.buffers[v].buf.region == Region::Io)
        .collect();
    for (x, &u) in io.iter().enumerate() {
        let b = kp.buffers[u].buf;
        for &w in &io[..x] {
            if ranges_meet(&b, &kp.buffers[w].buf) {
                errs.push(format!("{k}: Io buffers of %{u} and %{w} overlap"));
            }
        }
    }

    errs
}
