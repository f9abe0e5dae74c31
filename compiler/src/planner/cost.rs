//! Static cost figures of a planned step: flops and bytes moved.
//!
//! They exist so `kiln inspect` and `kiln bench` can put a measured step time
//! next to what the step must do (the HBM floor is `bytes_moved` over the
//! device's copy bandwidth). They are upper-bound estimates, computed from
//! the shapes alone:
//!
//! * flops: `2*M*N*K` per GEMM (+ `M*N` for a bias); attention `4*hd*ctx`
//!   per query token and head (QK^T and PV), with `ctx = max_context`, the
//!   longest context any sequence may reach, since the plan cannot know the
//!   live lengths; elementwise ops a small per-element count (add 1, RMSNorm
//!   4, add+RMSNorm 5, RoPE 3, SiLU*mul 5, GELU*mul 10, argmax 1, sample 10: its exp over a few
//!   passes); a `fused_matmul` its GEMM plus the counts of its prologue and epilogue;
//!   a `rope_attention` its RoPE and its attention; a `matmul_qkv_rope` its
//!   GEMM (with its prologue) and its RoPE.
//! * bytes moved: every weight once at full size (a weight read only by an
//!   `embedding` gather counts only the gathered rows); each attention reads
//!   every sequence's K and V at `max_context`; each KV write writes its
//!   rows; every other operand is read once by each op that takes it and
//!   written once by the op that makes it.
//!
//! Not here: measured numbers (the runtime's bench), per-kernel efficiency.

use kiln_ir::plan::PlanOp;
use kiln_ir::{AttnAttrs, Graph, Op, ValueDef};
use std::collections::HashSet;

/// Flops of one op (see the module docs for the model).
pub fn op_flops(op: &PlanOp, max_context: u64) -> u64 {
    let numel = |i: usize| op.args[i].ty.numel();
    let out = |i: usize| op.results[i].ty.numel();
    match &op.op {
        Op::MatMul { bias, .. } => {
            let (m, k) = (
                op.args[0].ty.shape.dims()[0] as u64,
                op.args[0].ty.shape.dims()[1] as u64,
            );
            let n = op.args[1].ty.shape.dims()[0] as u64;
            2 * m * n * k + if *bias { m * n } else { 0 }
        }
        Op::PagedAttention(AttnAttrs {
            heads, head_dim, ..
        })
        | Op::AttentionPartials {
            attn: AttnAttrs {
                heads, head_dim, ..
            },
            ..
        } => {
            let tokens = op.args[0].ty.shape.dims()[0] as u64;
            tokens * *heads as u64 * 4 * *head_dim as u64 * max_context
        }
        Op::Embedding | Op::KvWrite | Op::GatherLast { .. } => 0,
        Op::RmsNorm { .. } | Op::HeadRmsNorm { .. } => 4 * numel(0),
        Op::AddRmsNorm { .. } => 5 * numel(0),
        Op::Rope { .. } => 3 * numel(0),
        Op::QkvRopeKvWrite {
            heads,
            kv_heads,
            head_dim,
            qk_norm,
            ..
        } => {
            let tokens = op.args[0].ty.shape.dims()[0] as u64;
            let roped = tokens * (*heads + *kv_heads) as u64 * *head_dim as u64;
            roped * (3 + if qk_norm.is_some() { 4 } else { 0 })
        }
        Op::RopeAttention {
            attn: a, qk_norm, ..
        } => {
            let tokens = op.args[0].ty.shape.dims()[0] as u64;
            let roped = tokens * (a.heads + a.kv_heads) as u64 * a.head_dim as u64;
            roped * (3 + if qk_norm.is_some() { 4 } else { 0 })
                + tokens * a.heads as u64 * 4 * a.head_dim as u64 * max_context
        }
        Op::MatMulQkvRope {
            bias,
            pre,
            heads,
            kv_heads,
            head_dim,
            qk_norm,
            ..
        } => {
            let (m, k) = (
                op.args[0].ty.shape.dims()[0] as u64,
                op.args[0].ty.shape.dims()[1] as u64,
            );
            let n = op.args[1].ty.shape.dims()[0] as u64;
            let roped = m * (*heads + *kv_heads) as u64 * *head_dim as u64;
            2 * m * n * k
                + if *bias { m * n } else { 0 }
                + if pre.is_some() { 4 * m * k } else { 0 }
                + roped * (3 + if qk_norm.is_some() { 4 } else { 0 })
        }
        Op::SiluMul => 5 * out(0),
        Op::GeluTanhMul => 10 * out(0),
        Op::Add => numel(0),
        Op::Argmax => numel(0),
        Op::AcceptGreedy { .. } => numel(1),
        Op::Sample => 10 * numel(0),
        Op::FusedMatMul {
            bias, pre, post, ..
        } => {
            let (m, k) = (
                op.args[0].ty.shape.dims()[0] as u64,
                op.args[0].ty.shape.dims()[1] as u64,
            );
            let n = op.args[1].ty.shape.dims()[0] as u64;
            let epilogue = match post {
                kiln_ir::Epilogue::None => 0,
                kiln_ir::Epilogue::SiluMul => 5 * out(0),
                kiln_ir::Epilogue::GeluTanhMul => 10 * out(0),
                kiln_ir::Epilogue::Residual => out(0),
                kiln_ir::Epilogue::Argmax => m * n,
            };
            2 * m * n * k
                + if *bias { m * n } else { 0 }
                + if pre.is_some() { 4 * m * k } else { 0 }
                + epilogue
        }
        Op::Scale { softcap, .. } => numel(0) * if softcap.is_some() { 10 } else { 1 },
        Op::AllReduce { ranks, .. } => numel(0) * (*ranks as u64).saturating_sub(1),
        Op::ShardedArgmax { .. } => numel(0),
        Op::AttentionCombine { .. } => 3 * numel(0),
    }
}

/// Bytes one step moves (see the module docs for the model).
pub fn step_bytes(graph: &Graph, ops: &[PlanOp], kv_row_bytes: u64, max_context: u64) -> u64 {
    let mut total = 0u64;
    // Weights: once each; gather-only weights by the rows gathered.
    let mut full: HashSet<usize> = HashSet::new();
    let mut gathered: Vec<(usize, u64)> = Vec::new();
    for (op, node) in ops.iter().map(|o| (o, graph.node(o.node))) {
        for (i, a) in node.args.iter().enumerate() {
            if !matches!(graph.value(*a).def, ValueDef::Weight(_)) {
                continue;
            }
            if op.op == Op::Embedding && i == 1 {
                gathered.push((a.index(), op.results[0].ty.size_bytes()));
            } else {
                full.insert(a.index());
            }
        }
    }
    for &w in &full {
        total += graph.values[w].ty.size_bytes();
    }
    for (w, rows) in gathered {
        if !full.contains(&w) {
            total += rows;
        }
    }
    for op in ops {
        let node = graph.node(op.node);
        let is_weight = |i: usize| matches!(graph.value(node.args[i]).def, ValueDef::Weight(_));
        let aliased_args: Vec<usize> = op.op.aliases().iter().map(|&(_, a)| a).collect();
        let aliased_results: Vec<usize> = op.op.aliases().iter().map(|&(r, _)| r).collect();
        match &op.op {
            Op::PagedAttention(..) => {
                let batch = op.args[3].ty.shape.dims()[0] as u64;
                total += 2 * batch * max_context * kv_row_bytes;
                total += op.args[0].ty.size_bytes() + op.results[0].ty.size_bytes();
                total += op.args[3].ty.size_bytes() + op.args[4].ty.size_bytes();
                continue;
            }
            Op::KvWrite | Op::QkvRopeKvWrite { .. } | Op::MatMulQkvRope { .. } => {
                let tokens = op.args[0].ty.shape.dims()[0] as u64;
                total += 2 * tokens * kv_row_bytes;
            }
            Op::RopeAttention { .. } => {
                // The KV write and the attention's reads; qkv, positions,
                // slots, tables and lengths in, the output out (the roped q
                // stays on chip).
                let tokens = op.args[0].ty.shape.dims()[0] as u64;
                let batch = op.args[5].ty.shape.dims()[0] as u64;
                total += 2 * tokens * kv_row_bytes + 2 * batch * max_context * kv_row_bytes;
                for i in [0, 1, 2, 5, 6] {
                    total += op.args[i].ty.size_bytes();
                }
                total += op.results[0].ty.size_bytes();
                continue;
            }
            _ => {}
        }
        for (i, a) in op.args.iter().enumerate() {
            if !is_weight(i) && !aliased_args.contains(&i) {
                total += a.ty.size_bytes();
            }
        }
        for (i, r) in op.results.iter().enumerate() {
            if !aliased_results.contains(&i) {
                total += r.ty.size_bytes();
            }
        }
    }
    total
}
