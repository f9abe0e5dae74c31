//! Plan validation: the invariants every consumer of a [`Plan`] relies on,
//! checked once, next to the plan types.
//!
//! A plan is data from a file. [`validate`] checks it and returns a
//! [`PlanInfo`] carrying what consumers need afterwards (per-key region
//! sizes, the extents actually used, the weights and kernel modules the
//! launch lists use), in the manner of naga's `ModuleInfo`: whoever holds a
//! `PlanInfo` knows the plan passed. Both the compiler's independent checker
//! (which adds its own overlap and lower-bound checks) and the runtime loader
//! (which adds what the engine needs of staging inputs and outputs) call it.
//!
//! Invariants, in the order they are checked (an error names the field):
//!
//! 1. the KV layout is usable: a positive block size, at least one block
//!    besides the null block, the null block inside the layout, and block
//!    tables wide enough for the model's context;
//! 2. the plan has at least one key, every key is valid (`Key::validate`)
//!    and no key appears twice;
//! 3. every [`BufRef`] (operands, staging inputs, outputs, the memory map,
//!    scratch, counters, launch parameters) names a region the plan defines
//!    and lies inside it (`offset + bytes` does not overflow nor pass the
//!    region's size; see [`region_size`]);
//! 4. arena and Io buffers start on [`ARENA_ALIGN`]; counters on 4 bytes;
//!    scratch lives in the arena, counters in [`Region::Counters`];
//! 5. every op runs a node of its key's graph, and its operands have that
//!    node's values' types; each operand's buffer holds its type; the op's
//!    result types are what its argument types imply (`Op::infer`);
//! 6. sizes are consistent: each key's arena buffers end within its
//!    `arena_peak`, the plan's `arena_bytes` is the largest peak, its
//!    `workspace_bytes` the largest key workspace, each op's workspace at
//!    most its key's (and only GEMMs have any), and `counter_bytes` the
//!    largest counters extent of any key;
//! 7. within a key no two ops share counter bytes;
//! 8. the lowering matches the target: `Reference` for every op iff the
//!    target is `Cpu`; on GPU targets `Gemm` exactly for matmuls over dense
//!    weights (with the shape its operands imply) and a non-empty kernel
//!    list otherwise (a matmul over a quantized weight included); a
//!    GEMM's recorded implementation ([`GemmKind`]) can run its shape on the
//!    target (token limit, dtypes, K, `skinny` only on sm_80+ or HIP) and
//!    carries exactly the launch of its module (`blas`: none);
//! 9. every buffer a launch parameter refers to lies inside one of the op's
//!    operands, its scratch or its counters (planned buffers only);
//! 10. kernel images: none for `Cpu`; for `Cuda` every module the launch
//!     lists use is in `plan.kernels`; for `Hip` at least one image (one
//!     translation unit holds every module);
//! 11. `launches` of each key is the sum of its ops' [`Lowering::launches`];
//! 12. tensor parallelism: `tp` is at least 1, every collective op
//!     (`all_reduce`, `sharded_argmax`) and every `Sharded` weight names
//!     exactly `tp` ranks (checked by [`validate_tp`] before any key), and on
//!     GPU targets collectives lower to `Collective` and nothing else does.
//! 13. a kernel launch's thread-block cluster is 1, or (CUDA sm_90 and later
//!     only) a power of two of at most [`crate::plan::MAX_CLUSTER`] that
//!     divides `grid[0]`;
//! 14. on GPU targets, the ops only a tape runs (`attention_partials`,
//!     `attention_combine`: [`tape_only`]) appear only in megakernel keys;
//! 15. a megakernel schedule's tape passes [`crate::schedule::verify_tape`]
//!     (its own invariants are listed there), and its counters count in
//!     `counter_bytes`; a tape is on a CPU or CUDA target, and a CUDA plan
//!     with one carries the interpreter's image
//!     ([`crate::schedule::INTERPRETER_MODULE`]).
//!
//! Not here: whether two live arena buffers overlap or how good a placement
//! is (the compiler's checker), weight files against the manifest (the
//! runtime's weight loader), the artifact encoding ([`crate::artifact`]),
//! and what the engine requires of staging inputs and named outputs.

use crate::key::Key;
use crate::op::Op;
use crate::plan::{
    BufRef, GemmKind, GemmShape, KernelLaunch, KeyPlan, LaunchParam, Lowering, Plan, PlanOp,
    Region, Target, ARENA_ALIGN,
};
use crate::types::DType;
use std::collections::{BTreeSet, HashSet};

/// A violated invariant: the field (a path into the plan, e.g.
/// `keys[b1q1s0].ops[3].args[1]`) and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("plan field `{field}`: {problem}")]
pub struct PlanError {
    pub field: String,
    pub problem: String,
}

/// What one key uses, as validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyInfo {
    pub key: Key,
    /// Size of this key's Io region.
    pub io_bytes: u64,
    /// Highest end of any arena buffer the key uses (at most its peak).
    pub arena_extent: u64,
    /// Highest end of any counter the key uses.
    pub counter_extent: u64,
    /// Kernels (and library calls) per step.
    pub launches: u32,
}

/// What a valid plan holds, for its consumers. See the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanInfo {
    /// One entry per key, in plan order.
    pub keys: Vec<KeyInfo>,
    /// Manifest indices an op of some key reads.
    pub weights_used: BTreeSet<u32>,
    /// Kernel modules the launch lists use (empty for `Cpu`).
    pub modules: BTreeSet<String>,
    /// Bytes of each shared region: arena, workspace, counters.
    pub arena_bytes: u64,
    pub workspace_bytes: u64,
    pub counter_bytes: u64,
}

/// Size of region `r` as the plan declares it for key `kp` (`None`: the
/// plan defines no such region).
pub fn region_size(plan: &Plan, kp: &KeyPlan, r: Region) -> Option<u64> {
    match r {
        Region::Arena => Some(plan.arena_bytes),
        Region::Io => Some(kp.io_bytes),
        Region::Workspace => Some(plan.workspace_bytes),
        Region::Counters => Some(plan.counter_bytes),
        Region::Weight(i) => plan
            .manifest
            .entries
            .get(i as usize)
            // `validate` refuses sizes that overflow before any key.
            .map(|e| match e.storage {
                // The allocation (`TensorType::size_bytes`: the stored or the
                // GPU layout, whichever is larger); rows that are not whole
                // blocks make no region at all.
                Some(_) => dense_bytes(&e.shape, e.dtype).map_or(u64::MAX, |_| e.ty().size_bytes()),
                None => dense_bytes(&e.shape, e.dtype).unwrap_or(u64::MAX),
            }),
        Region::KCache(l) | Region::VCache(l) => {
            (l < plan.kv.layers).then(|| kv_cache_bytes(&plan.kv).unwrap_or(u64::MAX))
        }
    }
}

/// Bytes of a dense `dtype` tensor of `shape`, or `None` when the count
/// does not fit in u64 (only a corrupt plan says so; `Shape::numel` would
/// overflow).
pub fn dense_bytes(shape: &crate::Shape, dtype: crate::DType) -> Option<u64> {
    shape
        .dims()
        .iter()
        .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d as u64))
}

/// `KvLayout::cache_bytes`, or `None` when it overflows u64.
pub fn kv_cache_bytes(kv: &crate::plan::KvLayout) -> Option<u64> {
    (kv.num_blocks as u64)
        .checked_mul(kv.block_size as u64)?
        .checked_mul(kv.kv_heads as u64)?
        .checked_mul(kv.head_dim as u64)?
        .checked_mul(kv.dtype.size() as u64)
}

/// The kernel modules `plan`'s launch lists use, sorted: what a GPU compile
/// must build images for.
pub fn modules_used(plan: &Plan) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for op in plan.keys.iter().flat_map(|k| &k.ops) {
        for l in kernel_launches(&op.lowering) {
            out.insert(l.module.clone());
        }
    }
    if plan.meta.target != Target::Cpu && plan.keys.iter().any(|k| k.schedule.tape().is_some()) {
        out.insert(crate::schedule::INTERPRETER_MODULE.to_string());
    }
    out
}

/// Every kernel launch of a lowering (a GEMM's kiln kernel included).
pub fn kernel_launches(l: &Lowering) -> Vec<&KernelLaunch> {
    match l {
        Lowering::Reference | Lowering::Collective => vec![],
        Lowering::Kernels(k) => k.iter().collect(),
        Lowering::Gemm { kernel, .. } => kernel.iter().collect(),
    }
}

/// The most tokens each GEMM implementation takes (`Blas`: any).
pub fn gemm_kind_max_tokens(kind: GemmKind) -> u32 {
    match kind {
        GemmKind::Gemv => 8,
        GemmKind::Skinny => 32,
        GemmKind::Blas => u32::MAX,
    }
}

/// Invariant 8's GEMM part: the recorded implementation can run this
/// shape on this target and its launch is the one that kind launches.
fn check_gemm_choice(
    field: &str,
    target: &Target,
    shape: &GemmShape,
    kind: GemmKind,
    kernel: Option<&KernelLaunch>,
) -> Result<(), PlanError> {
    match (kind.module(), kernel) {
        (None, None) => return Ok(()),
        (None, Some(k)) => {
            return err(
                field,
                format!(
                    "a `blas` GEMM launches no kernel, but it carries `{}`",
                    k.entry
                ),
            )
        }
        (Some(m), None) => {
            return err(
                field,
                format!("a `{kind}` GEMM needs its `{m}` kernel launch"),
            )
        }
        (Some(m), Some(k)) if k.module != m || !k.entry.starts_with(m) => {
            return err(
                field,
                format!(
                    "a `{kind}` GEMM launches module `{m}`, not `{}` (`{}`)",
                    k.module, k.entry
                ),
            )
        }
        (Some(_), Some(_)) => {}
    }
    if shape.t > gemm_kind_max_tokens(kind) {
        return err(
            field,
            format!(
                "`{kind}` takes at most {} tokens, the GEMM has {}",
                gemm_kind_max_tokens(kind),
                shape.t
            ),
        );
    }
    if !matches!(shape.dtype, DType::BF16 | DType::F16)
        || !(shape.out == shape.dtype || shape.out == DType::F32)
        || !shape.k.is_multiple_of(8)
    {
        return err(
            field,
            format!(
                "`{kind}` takes bf16/f16 inputs, K a multiple of 8 and an output of the input dtype or f32; the GEMM is {} -> {} with K = {}",
                shape.dtype, shape.out, shape.k
            ),
        );
    }
    if kind == GemmKind::Skinny && matches!(target, Target::Cuda { sm } if *sm < 80) {
        return err(
            field,
            format!(
                "the `skinny` GEMM's tensor-core path needs sm_80 or later; the target is {target}"
            ),
        );
    }
    Ok(())
}

fn err<T>(field: impl Into<String>, problem: impl Into<String>) -> Result<T, PlanError> {
    Err(PlanError {
        field: field.into(),
        problem: problem.into(),
    })
}

fn end(b: &BufRef) -> Option<u64> {
    b.offset.checked_add(b.bytes)
}

fn inside(outer: &BufRef, inner: &BufRef) -> bool {
    outer.region == inner.region
        && inner.offset >= outer.offset
        && matches!((end(inner), end(outer)), (Some(i), Some(o)) if i <= o)
}

/// Checks every invariant of the module docs; see [`PlanInfo`].
pub fn validate(plan: &Plan) -> Result<PlanInfo, PlanError> {
    validate_tp(plan)?;
    let kv = &plan.kv;
    let info = &plan.meta.info;
    if kv.block_size == 0 || kv.num_blocks < 2 || kv.null_block >= kv.num_blocks {
        return err(
            "kv",
            format!(
                "KV layout needs a positive block size and at least one block besides the null block (block_size {}, num_blocks {}, null_block {})",
                kv.block_size, kv.num_blocks, kv.null_block
            ),
        );
    }
    if (kv.max_blocks_per_seq as u64) * (kv.block_size as u64) < info.max_context as u64 {
        return err(
            "kv.max_blocks_per_seq",
            format!(
                "block tables of {} blocks of {} tokens cannot hold the context of {}",
                kv.max_blocks_per_seq, kv.block_size, info.max_context
            ),
        );
    }
    if kv_cache_bytes(kv).is_none() {
        return err(
            "kv",
            format!(
                "KV cache of {} blocks of {} tokens x {} kv heads x {} dims is larger than any device (the byte count overflows)",
                kv.num_blocks, kv.block_size, kv.kv_heads, kv.head_dim
            ),
        );
    }
    if let Some((i, e)) = plan
        .manifest
        .entries
        .iter()
        .enumerate()
        .find(|(_, e)| dense_bytes(&e.shape, e.dtype).is_none())
    {
        return err(
            format!("manifest.entries[{i}]"),
            format!(
                "weight `{}` has shape {} whose byte count overflows",
                e.name, e.shape
            ),
        );
    }
    if plan.keys.is_empty() {
        return err("keys", "the plan has no keys");
    }
    let mut seen = HashSet::new();
    let mut out = PlanInfo {
        keys: Vec::with_capacity(plan.keys.len()),
        weights_used: BTreeSet::new(),
        modules: BTreeSet::new(),
        arena_bytes: plan.arena_bytes,
        workspace_bytes: plan.workspace_bytes,
        counter_bytes: plan.counter_bytes,
    };
    for (i, kp) in plan.keys.iter().enumerate() {
        if let Err(e) = kp.key.validate() {
            return err(format!("keys[{i}].key"), e.to_string());
        }
        if !seen.insert(kp.key) {
            return err(
                format!("keys[{i}].key"),
                format!("key {} appears twice", kp.key),
            );
        }
        let ki = validate_key(plan, kp, &mut out)?;
        out.keys.push(ki);
    }
    let peak = plan.keys.iter().map(|k| k.arena_peak).max().unwrap_or(0);
    if plan.arena_bytes != peak {
        return err(
            "arena_bytes",
            format!(
                "{} is not the largest key arena peak {peak}",
                plan.arena_bytes
            ),
        );
    }
    let ws = plan
        .keys
        .iter()
        .map(|k| k.workspace_bytes)
        .max()
        .unwrap_or(0);
    if plan.workspace_bytes != ws {
        return err(
            "workspace_bytes",
            format!(
                "{} is not the largest key workspace {ws}",
                plan.workspace_bytes
            ),
        );
    }
    let counters = out.keys.iter().map(|k| k.counter_extent).max().unwrap_or(0);
    if plan.counter_bytes != counters {
        return err(
            "counter_bytes",
            format!(
                "{} is not the largest counters extent of a key ({counters})",
                plan.counter_bytes
            ),
        );
    }
    match &plan.meta.target {
        Target::Cpu => {
            if !plan.kernels.is_empty() {
                return err("kernels", "a cpu plan carries no kernel images");
            }
        }
        Target::Cuda { .. } => {
            for m in &out.modules {
                if !plan.kernels.iter().any(|k| &k.name == m) {
                    return err(
                        "kernels",
                        format!(
                            "module `{m}` is launched but has no kernel image; recompile the plan"
                        ),
                    );
                }
            }
        }
        Target::Hip { .. } => {
            if !out.modules.is_empty() && plan.kernels.is_empty() {
                return err(
                    "kernels",
                    "the launch lists use kernels but the plan has no kernel image; recompile the plan",
                );
            }
        }
    }
    Ok(out)
}

fn validate_key(plan: &Plan, kp: &KeyPlan, out: &mut PlanInfo) -> Result<KeyInfo, PlanError> {
    let key = kp.key;
    let kf = format!("keys[{key}]");
    let mut arena_extent = 0u64;
    let mut counter_extent = 0u64;
    // Bounds and alignment of one buffer.
    let mut check = |field: &dyn Fn() -> String, b: &BufRef| -> Result<(), PlanError> {
        let Some(size) = region_size(plan, kp, b.region) else {
            return err(
                field(),
                format!("refers to {:?}, which the plan does not define", b.region),
            );
        };
        let Some(e) = end(b).filter(|&e| e <= size) else {
            return err(
                field(),
                format!(
                    "spans bytes {}..{} of {:?}, which holds {size}",
                    b.offset,
                    b.offset.saturating_add(b.bytes),
                    b.region
                ),
            );
        };
        match b.region {
            Region::Arena | Region::Io if !b.offset.is_multiple_of(ARENA_ALIGN) => {
                return err(
                    field(),
                    format!(
                        "offset {} in {:?} is not {ARENA_ALIGN}-byte aligned",
                        b.offset, b.region
                    ),
                );
            }
            Region::Counters if !b.offset.is_multiple_of(4) => {
                return err(
                    field(),
                    format!("counter offset {} is not 4-byte aligned", b.offset),
                );
            }
            Region::Arena => arena_extent = arena_extent.max(e),
            Region::Counters => counter_extent = counter_extent.max(e),
            _ => {}
        }
        Ok(())
    };
    for (j, (role, b)) in kp.inputs.iter().enumerate() {
        check(&|| format!("{kf}.inputs[{j}] ({})", role.name()), b)?;
    }
    for (name, o) in &kp.outputs {
        check(&|| format!("{kf}.outputs[{name}]"), &o.buf)?;
        // The engine sizes a host buffer from the type: it must fit the
        // (already checked) staging buffer.
        if dense_bytes(&o.ty.shape, o.ty.dtype).is_none_or(|n| n > o.buf.bytes) {
            return err(
                format!("{kf}.outputs[{name}]"),
                format!(
                    "of type {} does not fit its {}-byte buffer",
                    o.ty, o.buf.bytes
                ),
            );
        }
    }
    for (j, b) in kp.buffers.iter().enumerate() {
        check(&|| format!("{kf}.buffers[{j}]"), &b.buf)?;
    }
    let g = &kp.graph;
    let mut launches = 0u32;
    let mut counters: Vec<(usize, BufRef)> = Vec::new();
    for (i, op) in kp.ops.iter().enumerate() {
        let of = format!("{kf}.ops[{i}]");
        let Some(node) = g.nodes.get(op.node.index()) else {
            return err(
                format!("{of}.node"),
                format!("runs {}, which the key's graph does not have", op.node),
            );
        };
        if node.op != op.op {
            return err(format!("{of}.op"), "is not its graph node's op");
        }
        for (what, list, vals) in [
            ("args", &op.args, &node.args),
            ("results", &op.results, &node.results),
        ] {
            if list.len() != vals.len() {
                return err(
                    format!("{of}.{what}"),
                    format!(
                        "has {} operands but node {} has {}",
                        list.len(),
                        op.node,
                        vals.len()
                    ),
                );
            }
            for (j, (o, &v)) in list.iter().zip(vals).enumerate() {
                let f = || format!("{of}.{what}[{j}]");
                check(&f, &o.buf)?;
                if g.values.get(v.index()).map(|d| &d.ty) != Some(&o.ty) {
                    return err(f(), format!("is typed {} but graph value {v} is not", o.ty));
                }
                if dense_bytes(&o.ty.shape, o.ty.dtype).is_none() {
                    return err(f(), format!("has type {} whose byte count overflows", o.ty));
                }
                if o.ty.size_bytes() > o.buf.bytes {
                    return err(
                        f(),
                        format!(
                            "of type {} needs {} bytes but its buffer has {}",
                            o.ty,
                            o.ty.size_bytes(),
                            o.buf.bytes
                        ),
                    );
                }
                if let Region::Weight(w) = o.buf.region {
                    out.weights_used.insert(w);
                }
            }
        }
        let arg_types: Vec<_> = op.args.iter().map(|o| o.ty.clone()).collect();
        let want = match op.op.infer(&arg_types) {
            Ok(w) => w,
            Err(e) => return err(format!("{of}.args"), e.to_string()),
        };
        let got: Vec<_> = op.results.iter().map(|o| o.ty.clone()).collect();
        if want != got {
            return err(
                format!("{of}.results"),
                format!("are typed {got:?} but the arguments imply {want:?}"),
            );
        }
        if op.workspace_bytes > kp.workspace_bytes {
            return err(
                format!("{of}.workspace_bytes"),
                format!(
                    "{} exceeds the key's workspace {}",
                    op.workspace_bytes, kp.workspace_bytes
                ),
            );
        }
        if op.workspace_bytes > 0 && !matches!(op.op, Op::MatMul { .. }) {
            return err(
                format!("{of}.workspace_bytes"),
                "only GEMMs are granted workspace",
            );
        }
        if let Some(s) = &op.scratch {
            check(&|| format!("{of}.scratch"), s)?;
            if s.region != Region::Arena {
                return err(format!("{of}.scratch"), "scratch must live in the arena");
            }
        }
        if let Some(c) = &op.counters {
            check(&|| format!("{of}.counters"), c)?;
            if c.region != Region::Counters {
                return err(
                    format!("{of}.counters"),
                    "completion counters must live in the Counters region",
                );
            }
            if let Some((o, _)) = counters.iter().find(|(_, d)| {
                d.bytes > 0
                    && c.bytes > 0
                    && c.offset < d.offset + d.bytes
                    && d.offset < c.offset + c.bytes
            }) {
                return err(
                    format!("{of}.counters"),
                    format!("shares counter bytes with op {o}; each op needs its own"),
                );
            }
            counters.push((i, *c));
        }
        validate_lowering(op, &plan.meta.target, &of, &mut check)?;
        for l in kernel_launches(&op.lowering) {
            out.modules.insert(l.module.clone());
        }
        launches = launches.saturating_add(op.lowering.launches());
    }
    if kp.schedule.tape().is_none() && plan.meta.target != Target::Cpu {
        if let Some((i, op)) = kp.ops.iter().enumerate().find(|(_, o)| tape_only(&o.op)) {
            return err(
                format!("{kf}.ops[{i}]"),
                format!(
                    "`{}` runs only as tasks of a megakernel tape (it has no launch list) but this key is scheduled as a graph; recompile the plan (`kiln compile`)",
                    op.op.mnemonic()
                ),
            );
        }
    }
    if let Some(tape) = kp.schedule.tape() {
        check(&|| format!("{kf}.schedule.counters"), &tape.counters)?;
        crate::schedule::verify_tape(plan, kp, tape)?;
        match plan.meta.target {
            Target::Cpu => {}
            Target::Cuda { .. } => {
                out.modules
                    .insert(crate::schedule::INTERPRETER_MODULE.to_string());
            }
            Target::Hip { .. } => {
                return err(
                    format!("{kf}.schedule"),
                    "a megakernel tape on a hip target: the interpreter runs on CUDA only; compile with --schedule graph",
                );
            }
        }
    }
    if kp.arena_peak > plan.arena_bytes {
        return err(
            format!("{kf}.arena_peak"),
            format!(
                "{} exceeds the plan's arena {}",
                kp.arena_peak, plan.arena_bytes
            ),
        );
    }
    if arena_extent > kp.arena_peak {
        return err(
            format!("{kf}.arena_peak"),
            format!(
                "{} is below the end of an arena buffer the key uses ({arena_extent})",
                kp.arena_peak
            ),
        );
    }
    let ws = kp.ops.iter().map(|o| o.workspace_bytes).max().unwrap_or(0);
    if ws != kp.workspace_bytes {
        return err(
            format!("{kf}.workspace_bytes"),
            format!(
                "{} is not the largest op workspace {ws}",
                kp.workspace_bytes
            ),
        );
    }
    if kp.launches != launches {
        return err(
            format!("{kf}.launches"),
            format!(
                "{} but the ops' lowerings launch {launches} kernels",
                kp.launches
            ),
        );
    }
    Ok(KeyInfo {
        key,
        io_bytes: kp.io_bytes,
        arena_extent,
        counter_extent,
        launches,
    })
}

/// Invariant 12: one rank count across the plan. The program is each
/// rank's (SPMD), so checking it once checks every rank.
pub fn validate_tp(plan: &Plan) -> Result<(), PlanError> {
    if plan.tp == 0 {
        return err("tp", "a plan has at least one rank");
    }
    for (i, e) in plan.manifest.entries.iter().enumerate() {
        if let crate::WeightSource::Sharded { ranks, .. } = &e.source {
            if *ranks != plan.tp {
                return err(
                    format!("manifest.entries[{i}].source"),
                    format!(
                        "weight `{}` is sharded {ranks} ways in a plan of {} ranks",
                        e.name, plan.tp
                    ),
                );
            }
        }
    }
    for kp in &plan.keys {
        for (o, op) in kp.ops.iter().enumerate() {
            if let Op::AllReduce { ranks, .. } | Op::ShardedArgmax { ranks } = op.op {
                if ranks != plan.tp {
                    return err(
                        format!("keys[{}].ops[{o}].op", kp.key),
                        format!(
                            "`{}` over {ranks} ranks in a plan of {} ranks",
                            op.op.mnemonic(),
                            plan.tp
                        ),
                    );
                }
            }
        }
    }
    Ok(())
}

/// Whether `op` is a collective over the plan's ranks.
pub fn is_collective(op: &Op) -> bool {
    matches!(op, Op::AllReduce { .. } | Op::ShardedArgmax { .. })
}

/// Checks one buffer's bounds and alignment; the field is named lazily.
type BufCheck<'a> = dyn FnMut(&dyn Fn() -> String, &BufRef) -> Result<(), PlanError> + 'a;

fn validate_lowering(
    op: &PlanOp,
    target: &Target,
    of: &str,
    check: &mut BufCheck<'_>,
) -> Result<(), PlanError> {
    let field = format!("{of}.lowering");
    // A matmul over a weight stored quantized runs kiln's quantized GEMV
    // launches (the weight stays compressed), never a BLAS GEMM.
    let quantized = op.args.get(1).is_some_and(|w| w.ty.storage.is_some());
    let is_gemm = matches!(op.op, Op::MatMul { .. }) && !quantized;
    let gpu = *target != Target::Cpu;
    match (&op.lowering, gpu) {
        (Lowering::Reference, false) => return Ok(()),
        (Lowering::Reference, true) => {
            return err(
                field,
                "a GPU plan needs the op's launch list, not `Reference`",
            )
        }
        (_, false) => {
            return err(
                field,
                "a cpu plan runs the reference kernels: `Reference` only",
            )
        }
        (Lowering::Collective, true) => {
            if !is_collective(&op.op) {
                return err(field, "only collectives lower to `Collective`");
            }
        }
        (_, true) if is_collective(&op.op) => {
            return err(field, "a collective lowers to `Collective`");
        }
        (
            Lowering::Gemm {
                shape,
                kind,
                kernel,
            },
            true,
        ) => {
            if !is_gemm {
                return err(field, "only matmuls lower to a GEMM");
            }
            let (x, w) = (&op.args[0].ty, &op.args[1].ty);
            let (xd, wd) = (x.shape.dims(), w.shape.dims());
            let want = (
                xd.first(),
                wd.first(),
                xd.get(1),
                x.dtype,
                op.results[0].ty.dtype,
            );
            let got = (
                Some(&shape.t),
                Some(&shape.n),
                Some(&shape.k),
                shape.dtype,
                shape.out,
            );
            let bias = op.args.len() == 3;
            if want != got || shape.bias != bias {
                return err(
                    field,
                    format!("GEMM shape {shape:?} does not match the operands"),
                );
            }
            check_gemm_choice(&field, target, shape, *kind, kernel.as_ref())?;
        }
        (Lowering::Kernels(k), true) => {
            if is_gemm {
                return err(field, "a matmul lowers to a GEMM");
            }
            // Only the ops a tape runs have none (their keys' schedule is
            // checked with the key).
            if k.is_empty() != tape_only(&op.op) {
                return err(
                    field,
                    if k.is_empty() {
                        "the launch list is empty"
                    } else {
                        "an op only a megakernel tape runs has no launch list"
                    },
                );
            }
        }
    }
    let planned: Vec<BufRef> = op
        .args
        .iter()
        .chain(&op.results)
        .map(|o| o.buf)
        .chain(op.scratch)
        .chain(op.counters)
        .collect();
    for (n, l) in kernel_launches(&op.lowering).into_iter().enumerate() {
        let c = l.cluster;
        if c != 1 {
            let f = format!("{field}.launch[{n}].cluster");
            if !matches!(target, Target::Cuda { sm } if *sm >= 90) {
                return err(
                    f,
                    format!("a cluster of {c} blocks needs a CUDA sm_90 or later target"),
                );
            }
            if !c.is_power_of_two() || c > crate::plan::MAX_CLUSTER || !l.grid[0].is_multiple_of(c)
            {
                return err(
                    f,
                    format!(
                        "a cluster of {c} blocks over grid {:?}: want a power of two of at most {} dividing grid[0]",
                        l.grid,
                        crate::plan::MAX_CLUSTER
                    ),
                );
            }
        }
        for (p, param) in l.params.iter().enumerate() {
            let LaunchParam::Buf(b) = param else { continue };
            let f = || format!("{field}.launch[{n}].params[{p}]");
            check(&f, b)?;
            if !planned.iter().any(|o| inside(o, b)) {
                return err(
                    f(),
                    format!(
                        "{b:?} is not inside an operand, the scratch or the counters of the op"
                    ),
                );
            }
        }
    }
    Ok(())
}

/// Ops that exist only for the megakernel schedule: on GPU targets they have
/// no launch list, and the interpreter runs them as tasks (the CPU runs them
/// as reference kernels like any op).
pub fn tape_only(op: &Op) -> bool {
    matches!(
        op,
        Op::AttentionPartials { .. } | Op::AttentionCombine { .. }
    )
}
