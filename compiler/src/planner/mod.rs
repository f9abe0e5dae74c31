//! The planner: turns one key's graph (after passes) into a [`KeyPlan`]:
//! the op list in stream order with every operand's address, the memory map,
//! the arena high-water mark next to its lower bound, the BLAS workspace,
//! and the step's cost figures.
//!
//! Placement rules:
//! * staging inputs and named outputs go to the key's Io region, at fixed
//!   256-byte-aligned offsets (inputs in declaration order, then outputs), so
//!   the host writes inputs and reads outputs without any copy: the op that
//!   makes an output writes it in place in Io;
//! * weights go to `Region::Weight(i)` (manifest index), KV caches to
//!   `KCache(l)`/`VCache(l)`, and results an op writes in place
//!   ([`Op::aliases`]) to their argument's memory;
//! * everything else goes to the arena, with liveness over the schedule
//!   (program order) and in-place reuse where [`Op::may_reuse`] allows it,
//!   the argument dies at that op, and sizes match; offsets come from
//!   [`memory::place`];
//! * on GPU targets, an op's kernel scratch (attention partials, argmax
//!   pairs) is one more arena block, alive during that op only, and its
//!   completion counters get their own bytes of `Region::Counters` (each op
//!   of a key its own, so kernels that overlap under PDL never share them);
//!   then every op is lowered (`kiln_kernels::gpu::lower_op`) over those
//!   addresses, and `launches` counts the kernels. An op no kernel of the
//!   target can run is [`PlanError::Unsupported`].
//!
//! [`check`] re-derives all of this independently and is run on every plan
//! the tests compile.
//!
//! Not here: graph rewrites (passes), the kernel catalog itself (geometry,
//! entry points and parameter layouts live in `kiln_kernels::gpu`), anything
//! needing a device.

pub mod check;
pub mod cost;
pub mod memory;
pub mod workspace;

use kiln_ir::plan::{
    BufRef, BufferPlan, GemmKind, KeyPlan, KvLayout, Lowering, Operand, PlanOp, Region, Target,
    ARENA_ALIGN,
};
use kiln_ir::{
    Graph, GraphInfo, InputRole, Key, NodeId, Op, TensorType, ValueDef, ValueId, WeightManifest,
};
use kiln_kernels::gpu::{self, LowerOptions, OpNeeds};

/// Why a graph cannot be planned. These are mismatches between a graph and
/// the manifest or KV layout it is planned against.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("key {key}: graph `{graph}` is not the one its verifier info describes; plan only what `passes::run_pipeline` (or `kiln_ir::verify`) returned with it")]
    Unverified { key: Key, graph: String },
    #[error("key {key}: output `{name}` is {what}, not computed by the step; outputs must be op results so they can be written straight into the Io region")]
    OutputNotComputed {
        key: Key,
        name: String,
        what: String,
    },
    #[error("key {key}: weight `{name}` is not in the weight manifest; the manifest must list every weight a graph reads")]
    MissingWeight { key: Key, name: String },
    #[error("key {key}: weight `{name}` is {graph} in the graph but {manifest} in the manifest")]
    WeightType {
        key: Key,
        name: String,
        graph: TensorType,
        manifest: TensorType,
    },
    #[error("key {key}: input `{role}` is {got} but the KV layout makes it {want}; trace the graph with the same KV layout it is planned with")]
    CacheType {
        key: Key,
        role: String,
        got: TensorType,
        want: TensorType,
    },
    #[error(
        "key {key}: input `{role}` names a layer the KV layout does not have ({layers} layers)"
    )]
    CacheLayer { key: Key, role: String, layers: u32 },
    #[error("key {key}: node {node} (`{op}`) writes its result {result} in place over argument {arg}, which is not in a cache region; in-place writes are only planned for KV caches")]
    BadAlias {
        key: Key,
        node: u32,
        op: &'static str,
        result: usize,
        arg: usize,
    },
    #[error("key {key}: op {op} (node {node}, `{mnemonic}`) cannot run on {target}: {why}; no kernel of the target supports it (compile for another target, or a model within the kernels' limits)")]
    Unsupported {
        key: Key,
        op: u32,
        node: u32,
        mnemonic: &'static str,
        target: Target,
        why: String,
    },
    #[error("key {key}: value %{value} is neither an input, a weight nor a node result, so it cannot be placed; the verifier accepted a graph it should not have: please report this compiler bug")]
    Unplaced { key: Key, value: u32 },
}

/// Inputs of [`plan_key`] besides the graph.
#[derive(Clone, Debug)]
pub struct PlanContext<'a> {
    pub manifest: &'a WeightManifest,
    pub kv: &'a KvLayout,
    pub target: &'a Target,
    /// Longest context a sequence may reach (for cost figures).
    pub max_context: u32,
    /// Lowering decisions for GPU targets (ignored for `Target::Cpu`).
    pub lower: LowerOptions,
}

/// Rounds up to [`ARENA_ALIGN`].
pub fn align(bytes: u64) -> u64 {
    bytes.div_ceil(ARENA_ALIGN) * ARENA_ALIGN
}

/// Catalog name of the kernel that executes `op`.
pub fn kernel_name(op: &Op) -> String {
    match op {
        Op::MatMul { .. } => "gemm".to_string(),
        _ => op.mnemonic().to_string(),
    }
}

/// Bytes of [`Region::Counters`] a key's ops use (the end of the last one).
pub fn counter_bytes(kp: &KeyPlan) -> u64 {
    kp.ops
        .iter()
        .filter_map(|o| o.counters)
        .map(|c| c.offset + c.bytes)
        .max()
        .unwrap_or(0)
}

/// Statistics of a placement, for reports.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanReport {
    pub strategy: &'static str,
    pub in_place: u32,
}

/// Plans one key (see the module docs). `info` is the verifier's proof for
/// exactly this graph (as [`crate::passes::run_pipeline`] returns it):
/// nothing is planned from unverified IR.
pub fn plan_key(
    key: Key,
    graph: Graph,
    info: &GraphInfo,
    ctx: &PlanContext,
) -> Result<(KeyPlan, PlanReport), PlanError> {
    if !info.matches(&graph) {
        return Err(PlanError::Unverified {
            key,
            graph: graph.name.clone(),
        });
    }
    let nv = graph.values.len();
    let n_ops = graph.nodes.len();
    let bytes = |v: ValueId| graph.ty(v).size_bytes();

    // Liveness over the schedule (program order, the verified topological
    // order): defined by its node, live to its last reader.
    let at = |n: Option<NodeId>| n.map(|n| n.0);
    let first: Vec<Option<u32>> = (0..nv as u32)
        .map(|v| at(info.def_node(ValueId(v))))
        .collect();
    let last: Vec<Option<u32>> = (0..nv as u32)
        .map(|v| at(info.last_use(ValueId(v))))
        .collect();

    let mut buf: Vec<Option<BufRef>> = vec![None; nv];

    // Io: staging inputs, then outputs.
    let mut io = 0u64;
    let mut io_place = |b: u64| {
        let at = io;
        io = align(io + b.max(1));
        at
    };
    let mut inputs = Vec::new();
    for &v in &graph.inputs {
        let ValueDef::Input(role) = graph.value(v).def else {
            continue;
        };
        let b = match role {
            InputRole::KCache(l) | InputRole::VCache(l) => {
                if l >= ctx.kv.layers {
                    return Err(PlanError::CacheLayer {
                        key,
                        role: role.name(),
                        layers: ctx.kv.layers,
                    });
                }
                let want = TensorType::new(
                    ctx.kv.dtype,
                    [(ctx.kv.slots()) as u32, ctx.kv.kv_heads * ctx.kv.head_dim],
                );
                if *graph.ty(v) != want || ctx.kv.slots() > u32::MAX as u64 {
                    return Err(PlanError::CacheType {
                        key,
                        role: role.name(),
                        got: graph.ty(v).clone(),
                        want,
                    });
                }
                let region = match role {
                    InputRole::KCache(_) => Region::KCache(l),
                    _ => Region::VCache(l),
                };
                BufRef {
                    region,
                    offset: 0,
                    bytes: ctx.kv.cache_bytes(),
                }
            }
            _ => {
                let b = BufRef {
                    region: Region::Io,
                    offset: io_place(bytes(v)),
                    bytes: bytes(v),
                };
                inputs.push((role, b));
                b
            }
        };
        buf[v.index()] = Some(b);
    }
    for &v in &graph.weights {
        let ValueDef::Weight(name) = &graph.value(v).def else {
            continue;
        };
        let idx = ctx
            .manifest
            .index_of(name)
            .ok_or_else(|| PlanError::MissingWeight {
                key,
                name: name.clone(),
            })?;
        let e = &ctx.manifest.entries[idx];
        let want = e.ty();
        if *graph.ty(v) != want {
            return Err(PlanError::WeightType {
                key,
                name: name.clone(),
                graph: graph.ty(v).clone(),
                manifest: want,
            });
        }
        buf[v.index()] = Some(BufRef {
            region: Region::Weight(idx as u32),
            offset: 0,
            bytes: want.size_bytes(),
        });
    }
    let mut is_output = vec![false; nv];
    for (name, v) in &graph.outputs {
        let what = match &graph.value(*v).def {
            ValueDef::Input(r) => Some(format!("the input `{}`", r.name())),
            ValueDef::Weight(w) => Some(format!("the weight `{w}`")),
            ValueDef::Node { node, index } => {
                let op = &graph.node(*node).op;
                op.aliases()
                    .iter()
                    .any(|&(r, _)| r == *index as usize)
                    .then(|| format!("written in place by `{}`", op.mnemonic()))
            }
        };
        if let Some(what) = what {
            return Err(PlanError::OutputNotComputed {
                key,
                name: name.clone(),
                what,
            });
        }
        if !is_output[v.index()] {
            is_output[v.index()] = true;
            buf[v.index()] = Some(BufRef {
                region: Region::Io,
                offset: io_place(bytes(*v)),
                bytes: bytes(*v),
            });
        }
    }
    let io_bytes = io;

    // Arena values: groups of values sharing memory through in-place reuse.
    let mut group_of: Vec<Option<usize>> = vec![None; nv];
    let mut blocks: Vec<memory::Block> = Vec::new();
    let mut in_place = 0u32;
    for (i, node) in graph.nodes.iter().enumerate() {
        let i32_ = i as u32;
        let mut taken: Vec<usize> = Vec::new();
        for (j, &r) in node.results.iter().enumerate() {
            if let Some(&(_, a)) = node.op.aliases().iter().find(|&&(rr, _)| rr == j) {
                let ab = buf[node.args[a].index()];
                match ab {
                    Some(b) if matches!(b.region, Region::KCache(_) | Region::VCache(_)) => {
                        buf[r.index()] = Some(b);
                        continue;
                    }
                    _ => {
                        return Err(PlanError::BadAlias {
                            key,
                            node: i as u32,
                            op: node.op.mnemonic(),
                            result: j,
                            arg: a,
                        })
                    }
                }
            }
            if is_output[r.index()] {
                continue;
            }
            let end = last[r.index()].unwrap_or(i32_).max(i32_);
            let reuse = node.op.may_reuse().iter().find_map(|&(rr, a)| {
                let av = node.args[a];
                let g = group_of[av.index()]?;
                (rr == j
                    && last[av.index()] == Some(i32_)
                    && bytes(av) == bytes(r)
                    && !taken.contains(&g))
                .then_some(g)
            });
            let g = match reuse {
                Some(g) => {
                    in_place += 1;
                    taken.push(g);
                    blocks[g].end = blocks[g].end.max(end);
                    g
                }
                None => {
                    blocks.push(memory::Block {
                        size: align(bytes(r)),
                        start: i32_,
                        end,
                    });
                    blocks.len() - 1
                }
            };
            group_of[r.index()] = Some(g);
        }
    }
    // GPU targets: each op's scratch (an arena block live only during the
    // op) and its own completion counters, sized from the operand types.
    let gpu_target = *ctx.target != Target::Cpu;
    let mut needs = vec![OpNeeds::default(); n_ops];
    let mut scratch_block: Vec<Option<usize>> = vec![None; n_ops];
    if gpu_target {
        for (i, node) in graph.nodes.iter().enumerate() {
            let ty = |v: &[ValueId]| v.iter().map(|&v| graph.ty(v).clone()).collect::<Vec<_>>();
            needs[i] = gpu::op_needs(&node.op, &ty(&node.args), &ty(&node.results), &ctx.lower)
                .map_err(|e| PlanError::Unsupported {
                    key,
                    op: i as u32,
                    node: i as u32,
                    mnemonic: node.op.mnemonic(),
                    target: ctx.target.clone(),
                    why: e.to_string(),
                })?;
            if needs[i].scratch_bytes > 0 {
                blocks.push(memory::Block {
                    size: align(needs[i].scratch_bytes),
                    start: i as u32,
                    end: i as u32,
                });
                scratch_block[i] = Some(blocks.len() - 1);
            }
        }
    }
    let placement = memory::place(&blocks);
    let lower_bound = memory::lower_bound(&blocks);
    for v in 0..nv {
        if let Some(g) = group_of[v] {
            buf[v] = Some(BufRef {
                region: Region::Arena,
                offset: placement.offsets[g],
                bytes: bytes(ValueId(v as u32)),
            });
        }
    }

    if let Some(v) = buf.iter().position(|b| b.is_none()) {
        return Err(PlanError::Unplaced {
            key,
            value: v as u32,
        });
    }
    let buf: Vec<BufRef> = buf
        .into_iter()
        .map(|b| {
            b.unwrap_or(BufRef {
                region: Region::Arena,
                offset: 0,
                bytes: 0,
            })
        })
        .collect();

    // The op list.
    let blas = workspace::blas_model(ctx.target);
    let operand = |v: ValueId| Operand {
        buf: buf[v.index()],
        ty: graph.ty(v).clone(),
    };
    let mut ops = Vec::with_capacity(n_ops);
    let mut flops = 0u64;
    let mut ws_max = 0u64;
    let mut counter_at = 0u64;
    for (i, node) in graph.nodes.iter().enumerate() {
        let ws = match node.op {
            Op::MatMul { .. } => {
                let x = graph.ty(node.args[0]).shape.dims();
                let w = graph.ty(node.args[1]).shape.dims();
                workspace::gemm_workspace(&blas, x[0] as u64, w[0] as u64, x[1] as u64)
            }
            _ => 0,
        };
        let scratch = scratch_block[i].map(|b| BufRef {
            region: Region::Arena,
            offset: placement.offsets[b],
            bytes: needs[i].scratch_bytes,
        });
        let counters = (needs[i].counters > 0).then(|| {
            let b = BufRef {
                region: Region::Counters,
                offset: counter_at,
                bytes: needs[i].counters as u64 * 4,
            };
            counter_at += b.bytes;
            b
        });
        let mut op = PlanOp {
            node: NodeId(i as u32),
            kernel: kernel_name(&node.op),
            op: node.op.clone(),
            args: node.args.iter().map(|&a| operand(a)).collect(),
            results: node.results.iter().map(|&r| operand(r)).collect(),
            workspace_bytes: ws,
            lowering: Lowering::Reference,
            scratch,
            counters,
        };
        if gpu_target {
            op.lowering = gpu::lower_op(
                &op.op,
                &op.args,
                &op.results,
                op.scratch,
                op.counters,
                op.weight_args(),
                &ctx.lower,
            )
            .map_err(|e| PlanError::Unsupported {
                key,
                op: i as u32,
                node: i as u32,
                mnemonic: node.op.mnemonic(),
                target: ctx.target.clone(),
                why: e.to_string(),
            })?;
        }
        // Only a GEMM the vendor BLAS-Lt runs uses workspace: kiln's own
        // GEMV, skinny and quantized kernels do not, so a key whose GEMMs
        // all lowered to them reserves none.
        if gpu_target
            && !matches!(
                op.lowering,
                Lowering::Gemm {
                    kind: GemmKind::Blas,
                    ..
                }
            )
        {
            op.workspace_bytes = 0;
        }
        ws_max = ws_max.max(op.workspace_bytes);
        flops += cost::op_flops(&op, ctx.max_context as u64);
        ops.push(op);
    }
    let kv_row_bytes = ctx.kv.kv_heads as u64 * ctx.kv.head_dim as u64 * ctx.kv.dtype.size() as u64;
    let bytes_moved = cost::step_bytes(&graph, &ops, kv_row_bytes, ctx.max_context as u64);
    let buffers = (0..nv)
        .map(|v| BufferPlan {
            value: ValueId(v as u32),
            buf: buf[v],
            first_use: first[v],
            last_use: last[v],
        })
        .collect();
    let outputs = graph
        .outputs
        .iter()
        .map(|(n, v)| (n.clone(), operand(*v)))
        .collect();
    let launches = ops.iter().map(|o| o.lowering.launches()).sum();
    Ok((
        KeyPlan {
            key,
            graph,
            ops,
            buffers,
            inputs,
            outputs,
            io_bytes,
            arena_peak: placement.peak,
            arena_lower_bound: lower_bound,
            workspace_bytes: ws_max,
            launches,
            flops,
            bytes_moved,
            schedule: Default::default(),
        },
        PlanReport {
            strategy: placement.strategy,
            in_place,
        },
    ))
}
