//! The fusion passes. Each matches a pattern of plain ops a frontend emits and
//! replaces it with a fused op that computes the same function (the fused
//! ops' typing rules and kernels are defined as exactly the unfused
//! sequence, see `kiln_ir::op`).
//!
//! A pattern is fused only when it is legal: every intermediate the fused op
//! no longer materializes must have no other reader and must not be a graph
//! output, attributes must agree, and weights must be manifest entries. A
//! pattern that does not qualify is left alone (that is not an error).

use super::editor::Editor;
use super::weights::{concat_rows, fused_name};
use kiln_ir::plan::Target;
use kiln_ir::{
    DType, Epilogue, NodeId, Op, PreNorm, TensorType, ValueDef, ValueId, WeightManifest,
};

/// What a fusion pass did, for the compile report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FuseCount(pub u32);

type Users = Vec<Vec<(NodeId, usize)>>;

/// `v` is read by exactly one live node, and is not an output.
fn sole_reader(ed: &Editor, users: &Users, v: ValueId) -> Option<NodeId> {
    match users[v.index()].as_slice() {
        [(n, _)] if !ed.is_output(v) => Some(*n),
        _ => None,
    }
}

fn weight_name(ed: &Editor, v: ValueId) -> Option<String> {
    match &ed.g.value(v).def {
        ValueDef::Weight(n) => Some(n.clone()),
        _ => None,
    }
}

fn is_available_anywhere(ed: &Editor, v: ValueId) -> bool {
    matches!(ed.g.value(v).def, ValueDef::Weight(_) | ValueDef::Input(_))
}

/// `add` followed by `rms_norm` of the sum becomes `add_rms_norm`, which
/// returns both the normed rows and the sum (the residual stream).
pub(crate) fn add_rms_norm(ed: &mut Editor) -> Result<FuseCount, String> {
    let mut count = 0;
    for i in 0..ed.node_count() {
        let n2 = NodeId(i as u32);
        if ed.is_removed(n2) {
            continue;
        }
        let node = ed.g.node(n2).clone();
        let Op::RmsNorm { eps, unit_offset } = node.op else {
            continue;
        };
        let (x, w) = (node.args[0], node.args[1]);
        let Some((n1, _)) = ed.producer(x) else {
            continue;
        };
        let add = ed.g.node(n1).clone();
        if add.op != Op::Add || !is_available_anywhere(ed, w) {
            continue;
        }
        let r = ed.add_node(
            Op::AddRmsNorm { eps, unit_offset },
            &[add.args[0], add.args[1], w],
            n1,
        )?;
        ed.replace_uses(node.results[0], r[0]);
        ed.replace_uses(add.results[0], r[1]);
        ed.remove(n1);
        ed.remove(n2);
        count += 1;
    }
    Ok(FuseCount(count))
}

/// A matmul node reading `x`, with its weight (and bias) names.
#[derive(Clone, Debug)]
struct Proj {
    node: NodeId,
    x: ValueId,
    weight: String,
    bias: Option<String>,
    out: DType,
}

fn proj(ed: &Editor, v: ValueId) -> Option<Proj> {
    let (n, _) = ed.producer(v)?;
    let node = ed.g.node(n);
    let Op::MatMul { bias, out } = node.op else {
        return None;
    };
    Some(Proj {
        node: n,
        x: node.args[0],
        weight: weight_name(ed, node.args[1])?,
        bias: if bias {
            Some(weight_name(ed, node.args[2])?)
        } else {
            None
        },
        out,
    })
}

/// A matmul emitting several projections of the same `x` at once, over
/// weights stacked along rows.
fn stacked_matmul(
    ed: &mut Editor,
    manifest: &mut WeightManifest,
    parts: &[&Proj],
    roles: &[&str],
    fused_role: &str,
) -> Result<Option<ValueId>, String> {
    let first = parts[0];
    if parts
        .iter()
        .any(|p| p.x != first.x || p.out != first.out || p.bias.is_some() != first.bias.is_some())
    {
        return Ok(None);
    }
    let wnames: Vec<&str> = parts.iter().map(|p| p.weight.as_str()).collect();
    // Weights kept in different storages (a Q4_K_M file mixes Q4_K, Q6_K
    // and Q5_0 within a layer) cannot share one stacked tensor: the
    // projections stay separate matmuls.
    let storage = |n: &str| manifest.get(n).map(|e| e.storage);
    if wnames.iter().any(|n| storage(n) != storage(wnames[0])) {
        return Ok(None);
    }
    let anchor = parts.iter().map(|p| p.node).min().unwrap();
    let wname = fused_name(&wnames, roles, fused_role);
    let w = concat_rows(manifest, &wname, &wnames)?;
    let wv = ed.weight_value(&wname, w.ty());
    let mut args = vec![first.x, wv];
    if first.bias.is_some() {
        let bnames: Vec<&str> = parts.iter().map(|p| p.bias.as_deref().unwrap()).collect();
        let bname = fused_name(&bnames, roles, fused_role);
        let b = concat_rows(manifest, &bname, &bnames)?;
        args.push(ed.weight_value(&bname, TensorType::new(b.dtype, b.shape.clone())));
    }
    let r = ed.add_node(
        Op::MatMul {
            bias: first.bias.is_some(),
            out: first.out,
        },
        &args,
        anchor,
    )?;
    Ok(Some(r[0]))
}

/// One rotary chain: `matmul -> [head_rms_norm] -> rope`.
#[derive(Clone, Debug)]
struct RopeChain {
    proj: Proj,
    /// `(node, weight, eps, unit_offset)` of the optional head norm.
    norm: Option<(NodeId, ValueId, f32, bool)>,
    rope_node: NodeId,
    heads: u32,
    head_dim: u32,
    rope: kiln_ir::Rope,
    pos: ValueId,
    out: ValueId,
}

/// Follows `rope`'s input back to its projection; every intermediate must be
/// read only by the next op of the chain.
fn rope_chain(ed: &Editor, users: &Users, rope_node: NodeId) -> Option<RopeChain> {
    let node = ed.g.node(rope_node);
    let Op::Rope {
        heads,
        head_dim,
        rope,
    } = &node.op
    else {
        return None;
    };
    let (pre, pos) = (node.args[0], node.args[1]);
    if sole_reader(ed, users, pre)? != rope_node {
        return None;
    }
    let (mut mm_out, mut norm) = (pre, None);
    let (pn, _) = ed.producer(pre)?;
    if let Op::HeadRmsNorm {
        heads: nh,
        head_dim: nhd,
        eps,
        unit_offset,
    } = ed.g.node(pn).op
    {
        if nh != *heads || nhd != *head_dim {
            return None;
        }
        let nnode = ed.g.node(pn);
        if !is_available_anywhere(ed, nnode.args[1]) {
            return None;
        }
        mm_out = nnode.args[0];
        if sole_reader(ed, users, mm_out)? != pn {
            return None;
        }
        norm = Some((pn, nnode.args[1], eps, unit_offset));
    }
    Some(RopeChain {
        proj: proj(ed, mm_out)?,
        norm,
        rope_node,
        heads: *heads,
        head_dim: *head_dim,
        rope: rope.clone(),
        pos,
        out: node.results[0],
    })
}

/// q/k/v projections of one input, `[head_rms_norm] + rope` on q and k, and
/// `kv_write` of k and v become one matmul over the stacked q/k/v weight
/// (rows q, then k, then v) and one `qkv_rope_kv_write`.
pub(crate) fn qkv_rope_kv_write(
    ed: &mut Editor,
    manifest: &mut WeightManifest,
) -> Result<FuseCount, String> {
    let mut count = 0;
    for i in 0..ed.node_count() {
        let kw = NodeId(i as u32);
        if ed.is_removed(kw) || ed.g.node(kw).op != Op::KvWrite {
            continue;
        }
        let users = ed.users();
        let kwn = ed.g.node(kw).clone();
        let (k_in, v_in, slots, kc, vc) = (
            kwn.args[0],
            kwn.args[1],
            kwn.args[2],
            kwn.args[3],
            kwn.args[4],
        );
        if k_in == v_in || sole_reader(ed, &users, k_in) != Some(kw) {
            continue;
        }
        if sole_reader(ed, &users, v_in) != Some(kw) {
            continue;
        }
        let Some((k_rope, _)) = ed.producer(k_in) else {
            continue;
        };
        let Some(k) = rope_chain(ed, &users, k_rope) else {
            continue;
        };
        let Some(v) = proj(ed, v_in) else {
            continue;
        };
        // The q chain: another projection of the same input, roped at the
        // same positions with the same frequencies and head size.
        let mut q_chains = Vec::new();
        for &(reader, arg) in &users[k.proj.x.index()] {
            if arg != 0 || reader == k.proj.node || reader == v.node {
                continue;
            }
            let r = ed.g.node(reader).results[0];
            let rn = match users[r.index()].as_slice() {
                [(rn, 0)] => *rn,
                _ => continue,
            };
            // Walk through an optional head norm to the rope.
            let rope_node = match &ed.g.node(rn).op {
                Op::Rope { .. } => rn,
                Op::HeadRmsNorm { .. } => {
                    let nr = ed.g.node(rn).results[0];
                    match users[nr.index()].as_slice() {
                        [(n, 0)] => *n,
                        _ => continue,
                    }
                }
                _ => continue,
            };
            if let Some(q) = rope_chain(ed, &users, rope_node) {
                if q.proj.node == reader
                    && q.pos == k.pos
                    && q.rope == k.rope
                    && q.head_dim == k.head_dim
                {
                    q_chains.push(q);
                }
            }
        }
        let [q] = q_chains.as_slice() else {
            continue;
        };
        let qk_norm = match (q.norm, k.norm) {
            (None, None) => None,
            (Some((_, _, qe, qu)), Some((_, _, ke, ku))) if qe == ke && qu == ku => Some((qe, qu)),
            _ => continue,
        };
        let kv_heads = k.heads;
        let cache_dtype = ed.g.ty(kc).dtype;
        if k.proj.out != cache_dtype || ed.g.ty(k.proj.x).dtype != cache_dtype {
            continue;
        }
        let Some(qkv) = stacked_matmul(
            ed,
            manifest,
            &[&q.proj, &k.proj, &v],
            &["q_proj", "k_proj", "v_proj"],
            "qkv_proj",
        )?
        else {
            continue;
        };
        let mut args = vec![qkv, k.pos, slots, kc, vc];
        if let (Some(qn), Some(kn)) = (q.norm, k.norm) {
            args.push(qn.1);
            args.push(kn.1);
        }
        let r = ed.add_node(
            Op::QkvRopeKvWrite {
                heads: q.heads,
                kv_heads,
                head_dim: k.head_dim,
                rope: k.rope.clone(),
                qk_norm: qk_norm.map(|(e, _)| e),
                unit_offset: qk_norm.is_some_and(|(_, u)| u),
            },
            &args,
            kw,
        )?;
        ed.replace_uses(q.out, r[0]);
        ed.replace_uses(kwn.results[0], r[1]);
        ed.replace_uses(kwn.results[1], r[2]);
        for n in [
            q.proj.node,
            k.proj.node,
            v.node,
            q.rope_node,
            k.rope_node,
            kw,
        ] {
            ed.remove(n);
        }
        for n in [q.norm, k.norm].into_iter().flatten() {
            ed.remove(n.0);
        }
        count += 1;
    }
    Ok(FuseCount(count))
}

/// `qkv_rope_kv_write` whose q and caches only `paged_attention` reads
/// becomes `rope_attention` (GPU graph schedule: one launch fewer per layer,
/// and the roped q never goes to memory). The fused node runs where the
/// attention ran; it is legal when the attention is the only reader of the
/// q and of the updated caches (which may still be graph outputs: those are
/// read after the step), the attributes agree, and the tables and lengths
/// are defined before the rope node ran.
pub(crate) fn rope_attention(ed: &mut Editor) -> Result<FuseCount, String> {
    let mut count = 0;
    for i in 0..ed.node_count() {
        let an = NodeId(i as u32);
        if ed.is_removed(an) {
            continue;
        }
        let attn = ed.g.node(an).clone();
        if !matches!(attn.op, Op::PagedAttention(..)) {
            continue;
        }
        let Some((rn, 0)) = ed.producer(attn.args[0]) else {
            continue;
        };
        let rope_node = ed.g.node(rn).clone();
        // None unless the producer is the rope op and the heads agree.
        let Some(fused) = Op::join_rope_attention(&rope_node.op, &attn.op) else {
            continue;
        };
        if attn.args[1] != rope_node.results[1] || attn.args[2] != rope_node.results[2] {
            continue;
        }
        let users = ed.users();
        let only_attn = |v: ValueId| users[v.index()].iter().all(|(n, _)| *n == an);
        if sole_reader(ed, &users, attn.args[0]) != Some(an)
            || !only_attn(rope_node.results[1])
            || !only_attn(rope_node.results[2])
        {
            continue;
        }
        // Tables and lengths must exist where the rope node ran (they are
        // step inputs in every traced graph).
        let defined_before = |v: ValueId| match ed.producer(v) {
            None => true,
            Some((p, _)) => p.index() < rn.index(),
        };
        if !defined_before(attn.args[3]) || !defined_before(attn.args[4]) {
            continue;
        }
        let mut args = rope_node.args[..5].to_vec();
        args.push(attn.args[3]);
        args.push(attn.args[4]);
        args.extend_from_slice(&rope_node.args[5..]);
        let r = ed.add_node(fused, &args, an)?;
        ed.replace_uses(attn.results[0], r[0]);
        ed.replace_uses(rope_node.results[1], r[1]);
        ed.replace_uses(rope_node.results[2], r[2]);
        ed.remove(rn);
        ed.remove(an);
        count += 1;
    }
    Ok(FuseCount(count))
}

/// The packed q/k/v projection feeding `qkv_rope_kv_write` becomes
/// `matmul_qkv_rope`: a `matmul` or a `fused_matmul` without an epilogue
/// (after `fuse-matmul`, with its RMSNorm prologue) whose result has no
/// other reader, is no output and has the activations' dtype. The fused op
/// takes the `qkv_rope_kv_write`'s place (everything it reads exists there).
///
/// Formed only where the packed row would otherwise go to memory for a
/// second launch to read: on a GPU target where
/// [`kiln_kernels::gpu::matmul_qkv_rope_runs`] accepts it (the one-token
/// integer-dot GEMV over a weight kept quantized, whose last blocks rope
/// the heads), and on the CPU for weights kept quantized too, so the CPU
/// reference runs the ops a GPU plan runs (its definition, step by step).
/// Without `qk_norm_too`, layers whose heads have a q/k norm keep the pair
/// (`fuse-matmul-qkv-rope-pairs`).
pub(crate) fn matmul_qkv_rope(
    ed: &mut Editor,
    target: &Target,
    qk_norm_too: bool,
) -> Result<FuseCount, String> {
    let mut count = 0;
    for i in 0..ed.node_count() {
        let rn = NodeId(i as u32);
        if ed.is_removed(rn) {
            continue;
        }
        let rope_node = ed.g.node(rn).clone();
        let Op::QkvRopeKvWrite { qk_norm, .. } = &rope_node.op else {
            continue;
        };
        if qk_norm.is_some() && !qk_norm_too {
            continue;
        }
        let qkv = rope_node.args[0];
        let Some((mn, 0)) = ed.producer(qkv) else {
            continue;
        };
        let users = ed.users();
        if sole_reader(ed, &users, qkv) != Some(rn) {
            continue;
        }
        let mm = ed.g.node(mn).clone();
        let act = ed.g.ty(qkv).dtype;
        let Some(fused) = Op::join_matmul_qkv_rope(&mm.op, &rope_node.op, act) else {
            continue;
        };
        let mut args = mm.args.clone();
        args.extend_from_slice(&rope_node.args[1..]);
        let tys: Vec<TensorType> = args.iter().map(|&v| ed.g.ty(v).clone()).collect();
        if fused.infer(&tys).is_err() {
            continue;
        }
        let quantized = tys[1].storage.is_some();
        let runs = match target {
            Target::Cpu => quantized,
            Target::Cuda { .. } | Target::Hip { .. } => {
                kiln_kernels::gpu::matmul_qkv_rope_runs(&fused, &tys, target).is_ok()
            }
        };
        if !runs {
            continue;
        }
        let r = ed.add_node(fused, &args, rn)?;
        for (k, &v) in rope_node.results.iter().enumerate() {
            ed.replace_uses(v, r[k]);
        }
        ed.remove(mn);
        ed.remove(rn);
        count += 1;
    }
    Ok(FuseCount(count))
}

/// `silu_mul(gate(x), up(x))` (or `gelu_tanh_mul`) becomes one matmul over
/// the stacked gate/up weight (gate rows first) and the one-argument form.
pub(crate) fn gate_up(ed: &mut Editor, manifest: &mut WeightManifest) -> Result<FuseCount, String> {
    let mut count = 0;
    for i in 0..ed.node_count() {
        let act = NodeId(i as u32);
        if ed.is_removed(act) {
            continue;
        }
        let node = ed.g.node(act).clone();
        if !matches!(node.op, Op::SiluMul | Op::GeluTanhMul) || node.args.len() != 2 {
            continue;
        }
        let users = ed.users();
        let (g, u) = (node.args[0], node.args[1]);
        if g == u
            || sole_reader(ed, &users, g) != Some(act)
            || sole_reader(ed, &users, u) != Some(act)
        {
            continue;
        }
        let (Some(gp), Some(up)) = (proj(ed, g), proj(ed, u)) else {
            continue;
        };
        let Some(gu) = stacked_matmul(
            ed,
            manifest,
            &[&gp, &up],
            &["gate_proj", "up_proj"],
            "gate_up_proj",
        )?
        else {
            continue;
        };
        let r = ed.add_node(node.op.clone(), &[gu], act)?;
        ed.replace_uses(node.results[0], r[0]);
        for n in [gp.node, up.node, act] {
            ed.remove(n);
        }
        count += 1;
    }
    Ok(FuseCount(count))
}

/// A matmul (plain or already fused) that a prologue or an epilogue may
/// join: its operands by role.
#[derive(Clone, Debug)]
struct Fusable {
    node: NodeId,
    x: ValueId,
    w: ValueId,
    bias: Option<ValueId>,
    out: DType,
    pre: Option<(PreNorm, ValueId)>,
    post: Epilogue,
    residual: Option<ValueId>,
}

impl Fusable {
    /// The live node `n` as a fusable matmul.
    fn of_node(ed: &Editor, n: NodeId) -> Option<Fusable> {
        if ed.is_removed(n) {
            return None;
        }
        let node = ed.g.node(n);
        let a = &node.args;
        match node.op {
            Op::MatMul { bias, out } => Some(Fusable {
                node: n,
                x: a[0],
                w: a[1],
                bias: bias.then(|| a[2]),
                out,
                pre: None,
                post: Epilogue::None,
                residual: None,
            }),
            Op::FusedMatMul {
                bias,
                out,
                pre,
                post,
            } => {
                let mut i = 2;
                let mut next = |present: bool| {
                    let v = present.then(|| a[i]);
                    i += present as usize;
                    v
                };
                let bias = next(bias);
                let norm = next(pre.is_some());
                let residual = next(post == Epilogue::Residual);
                Some(Fusable {
                    node: n,
                    x: a[0],
                    w: a[1],
                    bias,
                    out,
                    pre: pre.zip(norm),
                    post,
                    residual,
                })
            }
            _ => None,
        }
    }

    /// The matmul whose result 0 is `v`.
    fn producing(ed: &Editor, v: ValueId) -> Option<Fusable> {
        match ed.producer(v)? {
            (n, 0) => Fusable::of_node(ed, n),
            _ => None,
        }
    }

    fn op(&self) -> Op {
        Op::FusedMatMul {
            bias: self.bias.is_some(),
            out: self.out,
            pre: self.pre.map(|p| p.0),
            post: self.post,
        }
    }

    fn args(&self) -> Vec<ValueId> {
        let mut a = vec![self.x, self.w];
        a.extend(self.bias);
        a.extend(self.pre.map(|p| p.1));
        a.extend(self.residual);
        a
    }

    /// Whether `target`'s kernels run this fused matmul: always on the CPU
    /// (its reference is the unfused sequence); on a GPU what the kernel
    /// catalog's [`kiln_kernels::gpu::fused_matmul_runs`] accepts (the
    /// check the lowering makes): the dense fused GEMV for keys of up to
    /// `rule.max_tokens` tokens, and for a weight kept quantized the
    /// qgemv / qskinny fused entries at any token count (the unfused
    /// quantized matmul runs the same kernels, never cuBLASLt).
    fn runs_on(&self, ed: &Editor, target: &Target, rule: FuseRule) -> bool {
        let tys: Vec<TensorType> = self.args().iter().map(|&v| ed.g.ty(v).clone()).collect();
        if self.op().infer(&tys).is_err() {
            return false;
        }
        match target {
            Target::Cpu => true,
            Target::Cuda { .. } | Target::Hip { .. } => {
                let quantized = tys.get(1).is_some_and(|w| w.storage.is_some());
                let tokens = tys.first().and_then(|x| x.shape.dims().first().copied());
                let k = tys.first().and_then(|x| x.shape.dims().get(1).copied());
                let within = |most: u32| tokens.is_some_and(|t| t <= most);
                (if quantized {
                    within(rule.quant_max_tokens)
                        && (self.pre.is_none()
                            || within(1)
                            || k.is_some_and(|k| u64::from(k) <= rule.quant_multi_norm_max_k))
                } else {
                    rule.dense
                        && within(rule.max_tokens)
                        && (self.pre.is_none()
                            || within(1)
                            || k.is_some_and(|k| u64::from(k) <= rule.dense_multi_norm_max_k))
                }) && kiln_kernels::gpu::fused_matmul_runs(&self.op(), &tys, target).is_ok()
            }
        }
    }

    /// Appends the fused node (scheduled where the matmul was) and retires
    /// the matmul; returns the fused result.
    fn emit(&self, ed: &mut Editor) -> Result<ValueId, String> {
        let r = ed.add_node(self.op(), &self.args(), self.node)?;
        ed.remove(self.node);
        Ok(r[0])
    }
}

/// The most tokens a GPU key fuses its GEMVs for. The fused kernels run up
/// to [`kiln_kernels::gpu::FUSED_MAX_TOKENS`], but measured on the H200
/// (bench/results/gpu-2026-12-01-s7/) a fused T=8 GEMV is 2-4x slower per
/// step than the unfused ops with cuBLASLt (the GEMV is ALU-bound at 8
/// tokens), so only one-token keys fuse; larger keys keep cuBLASLt. The
/// tensor-core fused skinny GEMM that took over keys of 2..8 tokens was,
/// in its first form, faster only on the smallest model (H100, b8 ctx
/// 512, `KILN_FUSE_DENSE=8` / default ms, bench/results/gpu-2026-12-07-s40/):
/// SmolLM2-135M 0.872 / 1.094, Qwen3-0.6B 1.598 / 1.571, Llama-3.2-1B
/// 1.665 / 1.499, Qwen3-4B 5.286 / 4.537. Its pipelined form (session
/// 40) and its half tiles and eight-warp RMSNorm entry (session 41) are
/// not measured yet, so the default stays at one token.
pub(crate) const GPU_FUSE_MAX_TOKENS: u32 = 1;

/// Which fusions [`fuse_matmul`] makes on GPU targets (the CPU target
/// fuses whatever its reference kernels run, at any token count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FuseRule {
    /// Whether matmuls over dense (bf16/f16/f32) weights fuse at all.
    pub dense: bool,
    /// The most tokens a key may have for its dense GEMVs to fuse.
    pub max_tokens: u32,
    /// The most tokens a key may have for matmuls over weights kept
    /// quantized to fuse (their unfused form runs the same qgemv / qskinny
    /// kernels, never cuBLASLt, so nothing is given up by fusing).
    pub quant_max_tokens: u32,
    /// The largest K whose quantized matmuls of more than one token take an
    /// RMSNorm prologue (every block of the skinny GEMM recomputes its
    /// tokens' inverse RMS from the whole x rows, L2 traffic that grows as
    /// N * K; one-token keys always may).
    pub quant_multi_norm_max_k: u64,
    /// The largest K whose dense matmuls of more than one token take an
    /// RMSNorm prologue (the fused skinny GEMM's blocks each recompute
    /// their tokens' inverse RMS, as the quantized one's do); past it the
    /// norm stays its own op and only the epilogues fuse.
    pub dense_multi_norm_max_k: u64,
    /// Whether `argmax(matmul)` becomes `fused_matmul{argmax}`.
    pub argmax: bool,
    /// Whether a dense lm_head (an f32 result or the argmax epilogue, over
    /// a weight not kept quantized) takes the final RMSNorm prologue and the
    /// argmax epilogue on a GPU target. Measured on the H100 (b1 ctx 512,
    /// bench/results/gpu-2026-12-07-s38/ call 2) the unfused rms_norm, GEMV
    /// (3040 GB/s on Qwen3-0.6B's 311 MB lm_head) and two argmax launches
    /// beat the fused register GEMV (2287 GB/s: the per-warp statistic and
    /// the norm weight take it from 60 to 79 registers, three resident
    /// blocks per SM instead of four) by 1-2% per step: SmolLM2-135M 0.704
    /// vs 0.721 ms, Qwen3-0.6B 0.959 vs 0.977, Llama-3.2-1B 1.253 vs 1.262.
    pub dense_lm_head: bool,
}

impl FuseRule {
    /// The graph schedule's rule with `--fused-gemv` (`fuse-matmul`).
    pub const GRAPH: FuseRule = FuseRule {
        dense: true,
        max_tokens: GPU_FUSE_MAX_TOKENS,
        quant_max_tokens: u32::MAX,
        quant_multi_norm_max_k: u64::MAX,
        dense_multi_norm_max_k: u64::MAX,
        argmax: true,
        dense_lm_head: true,
    };

    /// The graph schedule's default rule on GPU targets
    /// (`fuse-matmul-graph`): dense matmuls of one-token keys except the
    /// lm_head (see `dense_lm_head`), and matmuls over quantized weights in
    /// keys of up to eight tokens, with an RMSNorm prologue past one token
    /// only where K <= 1024.
    ///
    /// Dense: until the fused GEMV ran over the staged weight stream and
    /// split-K of the plain GEMV it replaces (`gemv.cu`'s
    /// gemv_staged_fused_*), it was 7-12% slower per step than the unfused
    /// ops (bench/results/gpu-2026-12-04-s18/: its o_proj / down ran 36-64
    /// blocks on 132 SMs). With them it is faster (H100, b1 ctx 512,
    /// fused / unfused ms, bench/results/gpu-2026-12-07-s38/): SmolLM2-135M
    /// 0.714 / 0.789, Qwen3-0.6B 0.977 / 1.089, Llama-3.2-1B 1.247 / 1.252.
    /// `kiln compile --no-dense-fusion` (`fuse-matmul-quant`) is the A/B.
    ///
    /// Quantized: measured on the H200 (bench/results/gpu-2026-12-04-s18/),
    /// the one-token integer-dot GEMV with its RMSNorm prologue and
    /// SiLU/residual epilogues is faster than the unfused ops it replaces.
    /// At eight tokens, once the skinny GEMM's fused entries kept a
    /// unit ring (H100, Q4_K shapes, b8 steps, unfused / epilogues only /
    /// epilogues and prologues, bench/results/gpu-2026-12-06-s26/ call
    /// 13): Qwen3-0.6B (K 1024) 1.334 / 1.286 / 1.153 ms, Llama-3.2-1B
    /// (2048) 1.145 / 1.075 / 1.104, Qwen3-1.7B (2048) 1.917 / 1.831 /
    /// 1.862, Qwen3-4B (2560) 3.252 / 3.136 / 3.454, Llama-3-8B (4096)
    /// 4.283 / 4.052 / 4.518: the epilogues always win, the prologue (every
    /// block recomputes its tokens' inverse RMS over the whole rows) only
    /// at K 1024. Keys past eight tokens were not measured and stay
    /// unfused.
    pub const GRAPH_DEFAULT: FuseRule = FuseRule {
        dense: true,
        max_tokens: GPU_FUSE_MAX_TOKENS,
        quant_max_tokens: 8,
        quant_multi_norm_max_k: 1024,
        dense_multi_norm_max_k: u64::MAX,
        argmax: true,
        dense_lm_head: false,
    };

    /// [`FuseRule::GRAPH_DEFAULT`] unless `KILN_FUSE_QUANT` (a compile-time
    /// A/B knob, checked at compile start by [`quant_fuse_override`])
    /// overrides its multi-token part.
    pub fn graph_default() -> FuseRule {
        let mut base = FuseRule::GRAPH_DEFAULT;
        if let Ok(Some((t, k))) =
            dense_fuse_override(std::env::var("KILN_FUSE_DENSE").ok().as_deref())
        {
            base.max_tokens = t;
            base.dense_multi_norm_max_k = k;
        }
        match quant_fuse_override(std::env::var("KILN_FUSE_QUANT").ok().as_deref()) {
            Ok(Some((quant_max_tokens, quant_multi_norm_max_k))) => FuseRule {
                quant_max_tokens,
                quant_multi_norm_max_k,
                ..base
            },
            _ => base,
        }
    }

    /// The megakernel schedule's rule (`fuse-matmul-tape`): the
    /// interpreter's GEMV tiles take up to eight tokens with every prologue
    /// and epilogue, and a separate argmax task reads the logits that the
    /// lm_head's tiles (spread over every queue) wrote, where a fused
    /// argmax would be one task on one block reading the whole lm_head.
    pub const TAPE: FuseRule = FuseRule {
        dense: true,
        max_tokens: 8,
        quant_max_tokens: u32::MAX,
        quant_multi_norm_max_k: u64::MAX,
        dense_multi_norm_max_k: u64::MAX,
        argmax: false,
        dense_lm_head: true,
    };
}

/// `KILN_FUSE_QUANT`, the default graph schedule's quantized fusions of
/// multi-token keys (a compile-time A/B knob): unset or empty keeps the
/// rule's own; `one` fuses one-token keys only; `epi` fuses the epilogues
/// (residual, SiLU/GELU*up, argmax) at every token count and the RMSNorm
/// prologue at one token; `all` fuses everything at every token count; a
/// number K does what `all` does for prologues over at most K columns and
/// what `epi` does otherwise. Returns (`quant_max_tokens`,
/// `quant_multi_norm_max_k`).
pub fn quant_fuse_override(v: Option<&str>) -> Result<Option<(u32, u64)>, String> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some("one") => Ok(Some((1, 0))),
        Some("epi") => Ok(Some((u32::MAX, 0))),
        Some("all") => Ok(Some((u32::MAX, u64::MAX))),
        Some(v) => match v.parse::<u64>() {
            Ok(k) => Ok(Some((u32::MAX, k))),
            Err(_) => Err(format!(
                "KILN_FUSE_QUANT={v} is not a fusion rule; set it to one, epi, all or a \
                 largest K for multi-token RMSNorm prologues (or unset it for the default)"
            )),
        },
    }
}

/// `KILN_FUSE_DENSE`, the most tokens a key may have for the default graph
/// schedule's dense fusions (a compile-time A/B knob): unset or empty
/// keeps the rule's own; `T` from 1 to
/// [`kiln_kernels::gpu::FUSED_MAX_TOKENS`] replaces it (one token runs the
/// fused GEMV, more the fused skinny GEMM), and `T:K` also keeps the
/// RMSNorm prologue of multi-token keys to K of at most `K` (`T:0`: the
/// epilogues only). Returns (`max_tokens`, `dense_multi_norm_max_k`).
pub fn dense_fuse_override(v: Option<&str>) -> Result<Option<(u32, u64)>, String> {
    let most = kiln_kernels::gpu::FUSED_MAX_TOKENS;
    let v = match v.map(str::trim) {
        None | Some("") => return Ok(None),
        Some(v) => v,
    };
    let bad = || {
        format!(
            "KILN_FUSE_DENSE={v} is not a token count; set it to a number from 1 to {most}, \
             optionally with `:K`, the largest K of a multi-token RMSNorm prologue \
             (or unset it for the default)"
        )
    };
    let (t, k) = match v.split_once(':') {
        Some((t, k)) => (t.trim(), Some(k.trim().parse::<u64>().map_err(|_| bad())?)),
        None => (v, None),
    };
    match t.parse::<u32>() {
        Ok(t) if (1..=most).contains(&t) => Ok(Some((t, k.unwrap_or(u64::MAX)))),
        _ => Err(bad()),
    }
}

/// Whether `f` is a dense lm_head, which only a rule with `dense_lm_head`
/// fuses on a GPU: an f32 result or an argmax epilogue over a weight that
/// is not kept quantized.
fn dense_lm_head(ed: &Editor, f: &Fusable) -> bool {
    (f.out == DType::F32 || f.post == Epilogue::Argmax) && ed.g.ty(f.w).storage.is_none()
}

/// What [`fuse_matmul`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct MatMulFusions {
    /// Epilogues joined (residual add, SiLU/GELU * up, argmax).
    pub epilogues: u32,
    /// RMSNorm prologues joined.
    pub prologues: u32,
}

/// Folds the elementwise ops around the decode-step GEMVs into the GEMVs:
///
/// 1. epilogues: `argmax(matmul)` -> `fused_matmul{argmax}` (the logits
///    are then never stored);
///    `add(matmul, r)` -> `fused_matmul{residual}`;
///    `add_rms_norm(matmul, r, w)` -> `fused_matmul{residual}` (its result
///    is the `sum`, the residual stream) followed by `rms_norm(sum, w)`;
///    one-argument `silu_mul` / `gelu_tanh_mul` of a stacked gate/up matmul
///    -> `fused_matmul{silu_mul | gelu_tanh_mul}`;
/// 2. prologues: `rms_norm(x, w)` read only by a matmul (as its `x`) ->
///    `fused_matmul{norm}` over the raw `x`, so the norm that step 1 split
///    off `add_rms_norm` lands in the next GEMV.
///
/// The matmul's result (and the norm's) must have no other reader and not
/// be a graph output, and the fused op must be one `target`'s kernels run
/// ([`Fusable::runs_on`]); otherwise the ops stay as they are.
pub(crate) fn fuse_matmul(
    ed: &mut Editor,
    target: &Target,
    rule: FuseRule,
) -> Result<MatMulFusions, String> {
    let mut count = MatMulFusions::default();
    let gpu = !matches!(target, Target::Cpu);
    // 1. Epilogues.
    for i in 0..ed.node_count() {
        let n = NodeId(i as u32);
        if ed.is_removed(n) {
            continue;
        }
        let node = ed.g.node(n).clone();
        let users = ed.users();
        let sole = |ed: &Editor, v: ValueId| sole_reader(ed, &users, v) == Some(n);
        let unfused = |ed: &Editor, v: ValueId| {
            Fusable::producing(ed, v).filter(|f| f.post == Epilogue::None)
        };
        match node.op {
            Op::Add | Op::AddRmsNorm { .. } => {
                let (a, b) = (node.args[0], node.args[1]);
                if a == b {
                    continue;
                }
                let candidate = [(a, b), (b, a)].into_iter().find_map(|(y, r)| {
                    let mut f = unfused(ed, y).filter(|_| sole(ed, y))?;
                    f.post = Epilogue::Residual;
                    f.residual = Some(r);
                    f.runs_on(ed, target, rule).then_some(f)
                });
                let Some(f) = candidate else {
                    continue;
                };
                let sum = f.emit(ed)?;
                if let Op::AddRmsNorm { eps, unit_offset } = node.op {
                    let normed =
                        ed.add_node(Op::RmsNorm { eps, unit_offset }, &[sum, node.args[2]], n)?;
                    ed.replace_uses(node.results[0], normed[0]);
                    ed.replace_uses(node.results[1], sum);
                } else {
                    ed.replace_uses(node.results[0], sum);
                }
                ed.remove(n);
                count.epilogues += 1;
            }
            // The greedy lm_head: its logits are read only by the argmax
            // (so not an output: plans without --logits / --sampling).
            Op::Argmax if rule.argmax || !gpu => {
                let y = node.args[0];
                let Some(mut f) = unfused(ed, y).filter(|_| sole(ed, y)) else {
                    continue;
                };
                f.post = Epilogue::Argmax;
                if gpu && !rule.dense_lm_head && dense_lm_head(ed, &f) {
                    continue;
                }
                if !f.runs_on(ed, target, rule) {
                    continue;
                }
                let r = f.emit(ed)?;
                ed.replace_uses(node.results[0], r);
                ed.remove(n);
                count.epilogues += 1;
            }
            Op::SiluMul | Op::GeluTanhMul if node.args.len() == 1 => {
                let gu = node.args[0];
                let Some(mut f) = unfused(ed, gu).filter(|_| sole(ed, gu)) else {
                    continue;
                };
                f.post = if node.op == Op::SiluMul {
                    Epilogue::SiluMul
                } else {
                    Epilogue::GeluTanhMul
                };
                if !f.runs_on(ed, target, rule) {
                    continue;
                }
                let r = f.emit(ed)?;
                ed.replace_uses(node.results[0], r);
                ed.remove(n);
                count.epilogues += 1;
            }
            _ => {}
        }
    }
    // 2. Prologues.
    for i in 0..ed.node_count() {
        let n = NodeId(i as u32);
        if ed.is_removed(n) {
            continue;
        }
        let node = ed.g.node(n).clone();
        let Op::RmsNorm { eps, unit_offset } = node.op else {
            continue;
        };
        let users = ed.users();
        let Some(m) = sole_reader(ed, &users, node.results[0]) else {
            continue;
        };
        let Some(mut f) = Fusable::of_node(ed, m) else {
            continue;
        };
        if f.pre.is_some() || f.x != node.results[0] || !is_available_anywhere(ed, node.args[1]) {
            continue;
        }
        if gpu && !rule.dense_lm_head && dense_lm_head(ed, &f) {
            continue;
        }
        f.x = node.args[0];
        f.pre = Some((PreNorm { eps, unit_offset }, node.args[1]));
        if !f.runs_on(ed, target, rule) {
            continue;
        }
        let result = ed.g.node(m).results[0];
        let r = f.emit(ed)?;
        ed.replace_uses(result, r);
        ed.remove(n);
        count.prologues += 1;
    }
    Ok(count)
}

/// Splits every `paged_attention` over its context for the megakernel
/// schedule: `attention_partials` (one task per (sequence, head, run)) then
/// `attention_combine`, with `runs = queues / (batch * heads)` clamped to
/// `2..=MAX_RUNS` (none where there are already about as many (sequence,
/// head) units as queues). At batch 1 a decode step otherwise leaves most of
/// the interpreter's blocks idle while a few each read a head's whole
/// context (23 us per layer on Qwen3-0.6B's critical path in session 14's
/// H200 traces, 1-2 MB of KV that the chip reads in under a microsecond).
pub(crate) fn split_attention(ed: &mut Editor, queues: u32) -> Result<FuseCount, String> {
    /// Runs at most (a combine reads `runs` entries per (row, head)).
    const MAX_RUNS: u32 = 16;
    let mut count = 0;
    for i in 0..ed.node_count() {
        let an = NodeId(i as u32);
        if ed.is_removed(an) {
            continue;
        }
        let node = ed.g.node(an).clone();
        let Op::PagedAttention(attn) = node.op else {
            continue;
        };
        let batch =
            ed.g.ty(node.args[3])
                .shape
                .dims()
                .first()
                .copied()
                .unwrap_or(1);
        let units = batch.max(1).saturating_mul(attn.heads.max(1));
        let runs = (queues / units).min(MAX_RUNS);
        if runs < 2 {
            continue;
        }
        let out = ed.g.ty(node.results[0]).dtype;
        let p = ed.add_node(Op::AttentionPartials { attn, parts: runs }, &node.args, an)?;
        let c = ed.add_node(
            Op::AttentionCombine {
                heads: attn.heads,
                head_dim: attn.head_dim,
                parts: runs,
                out,
            },
            &p,
            an,
        )?;
        ed.replace_uses(node.results[0], c[0]);
        ed.remove(an);
        count += 1;
    }
    Ok(FuseCount(count))
}
