//! The megakernel interpreter's device side (`kernels/gpu/megakernel.cu`):
//! its module, the byte layout of the task and wait records, the task kinds
//! the interpreter runs, and the encoder that turns a verified tape
//! ([`kiln_ir::schedule::Tape`]) into the one device image the runtime
//! uploads ([`encode_tape`]).
//!
//! Why here: the record layout and the kernel that reads it must change
//! together, and both must agree with the CPU reference kernels on every
//! op's semantics; keeping the encoder next to the `.cu` source (and
//! testing that the source declares the same constants) makes a drift a
//! test failure instead of a device fault.
//!
//! Status: the interpreter runs every op of a default llama / qwen3 /
//! gemma-family bf16 decode plan (GEMV and fused-GEMV tiles, embedding,
//! the RMSNorm family, fused q/k-norm + RoPE + KV write (tiled by query
//! head, plus a K-cache and a V-cache unit), paged attention (and its
//! context-split form, `attention_partials` as an attention task with runs
//! plus `attention_combine`; both forms, the argmax row tiles and the GEMV
//! weight stage passed `megakernel_gpu` and `cuda_serve` on an H100 in
//! bench/results/gpu-2026-12-05-s22; the two-ended TMA stage with
//! look-ahead, the parallel combine and the two-barrier attention merge in
//! bench/results/gpu-2026-12-07-s33; the per-thread `cp.async` stage on
//! sm_90, now the default, in bench/results/gpu-2026-12-07-s35)
//! per (sequence, query head), the gated activations, add, scale, argmax, gather
//! last). It compiles under NVRTC (tested here). Every task kind has run
//! once on an H200 against the CPU reference over hand-built tapes
//! (`kernels/tests/megakernel_gpu.rs`, opt-in with `KILN_MK_GPU=1`), and
//! whole compiled plans' tapes run through it on the engine
//! (`tests/tests/cuda_serve.rs`: the graph schedule's tokens on every key of
//! five families; bench/results/gpu-2026-12-02-s13). It is correct but
//! not yet fast: 1.4-1.5x the graph schedule's b1 step on an H100
//! (bench/results/gpu-2026-12-07-s33, where the critical path is broken
//! down). It is
//! deliberately not in [`crate::gpu::MODULES`] (the compiler adds it to a
//! plan's images only for megakernel keys). Known cost: `fused_matmul
//! {argmax}` (and `argmax`) have one unit, so the whole lm_head runs on one
//! block; plans for the megakernel should keep the argmax unfused.
//!
//! Numerics: every result is rounded where the graph schedule's kernels
//! round it (the CPU reference's rounding points). GEMV tiles keep
//! `gemv.cu`'s per-lane summation order (KS = 1), so a tile's bits are
//! meant to equal the unsplit graph GEMV's; norms, attention and argmax
//! reduce in their own order and agree within the usual tolerances.
//!
//! Deliberately not here: tape construction and verification
//! (`kiln_ir::schedule`, the compiler's megakernel pass), region
//! allocation and address resolution (the caller's `resolve`), launching
//! the counter reset and the occupancy check (the CUDA backend). Refused (see
//! [`supported`]): weights kept quantized, activations other than bf16,
//! sampling, speculative acceptance, collectives, and the unfused
//! `head_rms_norm` / `rope` / `kv_write` (the default lowering fuses them
//! into `qkv_rope_kv_write`).

use crate::gpu::GpuModule;
use kiln_ir::plan::{BufRef, KeyPlan, Operand, Plan, PlanOp};
use kiln_ir::{AttnAttrs, DType, Epilogue, Key, Op};

/// The interpreter's module (not in [`crate::gpu::MODULES`]; see the docs).
pub const MEGAKERNEL_MODULE: GpuModule = GpuModule {
    name: "megakernel",
    file: "megakernel.cu",
    raw_source: include_str!("../gpu/megakernel.cu"),
};

/// The kernel's entry point.
pub const ENTRY: &str = "megakernel_run";

/// The counter reset kernel (`megakernel_reset(unsigned* counters,
/// unsigned n)`, grid-stride), launched right before [`ENTRY`].
pub const RESET_ENTRY: &str = "megakernel_reset";

/// Threads per block (`KILN_MK_THREADS`).
pub const BLOCK_THREADS: u32 = 256;

/// Bytes of one [`DeviceTask`] record (`struct MkTask`).
pub const TASK_BYTES: usize = 192;

/// Bytes of one wait record (`struct MkWait`: counter, target).
pub const WAIT_BYTES: usize = 8;

/// Static shared memory the interpreter declares (bytes): the scratch
/// floats, the GEMV's staged activations, the current task's record and
/// the weight stage's two mbarriers.
/// The dynamic part is the weight stage ([`WEIGHT_STAGE_BYTES`]).
pub const SHARED_BYTES: u32 = 4 * SMEM_FLOATS + 2 * X_STAGE + TASK_BYTES as u32 + 16;
const SMEM_FLOATS: u32 = 1344;
/// The bf16 activations a GEMV task stages in shared memory per pass
/// (`KILN_MK_X_STAGE`): tokens of K elements go in chunks of
/// `X_STAGE / K` (at most eight), so K may be at most this.
pub const X_STAGE: u32 = 16384;

/// The dynamic shared memory the engine asks for the interpreter's GEMV
/// weight stage: a GEMV tile copies as many of its first weight rows as
/// fit there with `cp.async`, issued while the block's previous task still
/// runs (the stage is a two-ended ring: the next task's rows go into the
/// bytes the current task's rows leave free), so those bytes are in flight
/// while the block finishes one task and waits for the next; only the rest
/// streams from DRAM after the waits. 184 KiB is what an sm_90 block's
/// 227 KiB leaves beside the static shared memory ([`SHARED_BYTES`]) and
/// the driver's reserve; it holds two consecutive GEMV tiles of Qwen3-0.6B
/// and SmolLM2-135M at 132 queues whole or nearly (gate_up with its SiLU
/// epilogue: 24 + 24 rows of 2 KiB, down 16 rows of 6 KiB). The backend
/// grants less where the device has less (or none where the grant would
/// cost the co-residency the tape needs); `KILN_MK_WSTAGE=<bytes>`
/// overrides the request (0: no staging).
pub const WEIGHT_STAGE_BYTES: u32 = 184 << 10;

/// The widest head the attention and RoPE tasks take.
pub const MAX_HEAD_DIM: u32 = 256;
/// The widest row the norm tasks take (`KILN_MK_NORM_MAX`).
pub const NORM_MAX: u32 = 8192;
/// Bytes of weight a task prefetches into L2 at most while it waits.
pub const PREFETCH_MAX: u64 = 4 << 20;

/// Integer, float and pointer slots of a record.
pub const INTS: usize = 16;
pub const FLOATS: usize = 4;
pub const PTRS: usize = 10;

/// What a task computes (`KILN_MK_*`). The meaning of each kind's `i`, `f`
/// and `p` slots is documented on the variant (and in the `.cu` source).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum TaskKind {
    /// A GEMV tile (`matmul`, `fused_matmul` without argmax) with a bf16
    /// result over output columns `[tile_begin, tile_end)`. i: 0 tokens T,
    /// 1 K, 2 output columns (the result's row stride), 3 epilogue (0 none,
    /// 1 silu_mul, 2 gelu_tanh_mul, 3 residual), 4 RMSNorm prologue (0/1),
    /// 5 unit_offset, 6 row offset of the `up` weight rows (gated
    /// epilogues: the output columns; else 0), 7 the weight is a plan
    /// weight (0/1: its rows may be staged in shared memory before the
    /// task's waits, see [`WEIGHT_STAGE_BYTES`]). f: 0 eps. p: 0 x, 1 w,
    /// 2 bias (0: none), 3 norm weight (0: none), 4 residual (0: none),
    /// 5 out.
    GemvBf16 = 1,
    /// As [`TaskKind::GemvBf16`] with an f32 result (logits).
    GemvBf16F32 = 2,
    /// `fused_matmul{argmax}`, the whole op: i: 0 T, 1 K, 2 N, 3 logit
    /// dtype (0 bf16, 1 f32), 4 prologue, 5 unit_offset. f: 0 eps. p: 0 x,
    /// 1 w, 2 bias, 3 norm weight, 5 out (i32[T]).
    GemvArgmax = 3,
    /// `embedding`: i: 0 T, 1 H, 2 vocab. p: 0 ids, 1 table, 2 out.
    Embedding = 4,
    /// `rms_norm`: i: 0 T, 1 H, 2 unit_offset. f: 0 eps. p: 0 x, 1 w,
    /// 2 out.
    RmsNorm = 5,
    /// `add_rms_norm`: i: 0 T, 1 H, 2 unit_offset. f: 0 eps. p: 0 x,
    /// 1 residual, 2 w, 3 normed, 4 sum.
    AddRmsNorm = 6,
    /// `qkv_rope_kv_write`, units `[tile_begin, tile_end)` of its
    /// `heads + 2` (q heads one by one, then the k heads, then the v heads:
    /// `kiln_ir::schedule::rope_kv_parts`): i: 0 T, 1 heads, 2 kv_heads, 3 head_dim,
    /// 4 q/k norm (0/1), 5 unit_offset, 6 cache slots. f: 0 eps. p: 0 qkv,
    /// 1 positions, 2 slots, 3 K cache, 4 V cache, 5 q_norm, 6 k_norm,
    /// 7 q out, 8 inverse frequencies (f32[head_dim / 2], constant pool).
    QkvRopeKvWrite = 7,
    /// `paged_attention`, units `[tile_begin, tile_end)` of batch x heads
    /// (unit u: sequence u / heads, query head u % heads): i: 0 batch,
    /// 1 query, 2 heads, 3 kv_heads, 4 head_dim, 5 block_size, 6 block
    /// table columns, 7 window (0: none). f: 0 scale, 1 softcap (0: none).
    /// p: 0 q, 1 K cache, 2 V cache, 3 block tables, 4 context lengths,
    /// 5 out.
    PagedAttention = 8,
    /// `silu_mul`: i: 0 T, 1 I (result columns), 2 packed (0/1). p: 0 gate
    /// (or gate_up), 1 up (0 when packed), 2 out.
    SiluMul = 9,
    /// `gelu_tanh_mul`: as [`TaskKind::SiluMul`].
    GeluTanhMul = 10,
    /// `add`: i: 0 elements. p: 0 a, 1 b, 2 out.
    Add = 11,
    /// `scale`: i: 0 elements, 1 dtype (0 bf16, 1 f32), 2 softcap (0/1).
    /// f: 0 factor, 1 softcap. p: 0 x, 1 out.
    Scale = 12,
    /// `argmax`: i: 0 rows, 1 vocab, 2 dtype (0 bf16, 1 f32). p: 0 x,
    /// 1 out.
    Argmax = 13,
    /// `gather_last`: i: 0 result rows, 1 group, 2 row width in 16-bit
    /// units. p: 0 x, 1 out.
    GatherLast = 14,
    /// `attention_combine`, units `[tile_begin, tile_end)` of rows x heads
    /// (unit u: head u % heads of row u / heads): i: 0 rows, 1 heads,
    /// 2 head_dim, 3 runs. p: 0 partials (f32), 1 out (bf16).
    /// (`attention_partials` is [`TaskKind::PagedAttention`] with i: 8 its
    /// runs and p: 5 its f32 partials.)
    AttentionCombine = 15,
}

impl TaskKind {
    /// Every kind, with its `#define` name in the source.
    pub const ALL: [(TaskKind, &'static str); 15] = [
        (TaskKind::GemvBf16, "KILN_MK_GEMV_BF16"),
        (TaskKind::GemvBf16F32, "KILN_MK_GEMV_BF16_F32"),
        (TaskKind::GemvArgmax, "KILN_MK_GEMV_ARGMAX"),
        (TaskKind::Embedding, "KILN_MK_EMBEDDING"),
        (TaskKind::RmsNorm, "KILN_MK_RMS_NORM"),
        (TaskKind::AddRmsNorm, "KILN_MK_ADD_RMS_NORM"),
        (TaskKind::QkvRopeKvWrite, "KILN_MK_QKV_ROPE_KV_WRITE"),
        (TaskKind::PagedAttention, "KILN_MK_PAGED_ATTENTION"),
        (TaskKind::SiluMul, "KILN_MK_SILU_MUL"),
        (TaskKind::GeluTanhMul, "KILN_MK_GELU_TANH_MUL"),
        (TaskKind::Add, "KILN_MK_ADD"),
        (TaskKind::Scale, "KILN_MK_SCALE"),
        (TaskKind::Argmax, "KILN_MK_ARGMAX"),
        (TaskKind::GatherLast, "KILN_MK_GATHER_LAST"),
        (TaskKind::AttentionCombine, "KILN_MK_ATTENTION_COMBINE"),
    ];
}

/// One task as the interpreter reads it (`struct MkTask`), addresses
/// resolved.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceTask {
    pub kind: TaskKind,
    /// The counter it bumps by one when done (an index into the tape's
    /// counters).
    pub counter: u32,
    /// First wait of the task in the waits array.
    pub wait_begin: u32,
    pub wait_count: u32,
    pub tile_begin: u32,
    pub tile_end: u32,
    /// Kind-specific integers ([`TaskKind`]).
    pub i: [i32; INTS],
    /// Kind-specific floats.
    pub f: [f32; FLOATS],
    /// Kind-specific device addresses (0: null).
    pub p: [u64; PTRS],
}

impl DeviceTask {
    /// The record's little-endian bytes, laid out as `struct MkTask`.
    pub fn to_bytes(&self) -> [u8; TASK_BYTES] {
        let mut b = [0u8; TASK_BYTES];
        let words = [
            self.kind as u32,
            self.counter,
            self.wait_begin,
            self.wait_count,
            self.tile_begin,
            self.tile_end,
        ];
        for (k, w) in words.iter().enumerate() {
            b[4 * k..4 * k + 4].copy_from_slice(&w.to_le_bytes());
        }
        // Bytes 24..32: two reserved words, zero.
        for (k, v) in self.i.iter().enumerate() {
            b[32 + 4 * k..36 + 4 * k].copy_from_slice(&v.to_le_bytes());
        }
        for (k, v) in self.f.iter().enumerate() {
            b[96 + 4 * k..100 + 4 * k].copy_from_slice(&v.to_le_bytes());
        }
        for (k, v) in self.p.iter().enumerate() {
            b[112 + 8 * k..120 + 8 * k].copy_from_slice(&v.to_le_bytes());
        }
        b
    }
}

/// A key's tape encoded as one device buffer (see [`encode_tape`]). The
/// offsets are bytes from the buffer's start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TapeImage {
    pub bytes: Vec<u8>,
    pub tasks_at: u64,
    pub queue_start_at: u64,
    pub queue_tasks_at: u64,
    pub waits_at: u64,
    pub queues: u32,
    pub tasks: u32,
}

/// Why a key's tape cannot be encoded for the interpreter.
#[derive(Debug, thiserror::Error)]
pub enum MegakernelError {
    #[error("key {key}: its schedule is `{schedule}`, not a megakernel tape; compile it with --schedule megakernel or run it as a graph")]
    NotMegakernel { key: Key, schedule: &'static str },
    #[error("key {key}: op {op} `{mnemonic}` {why}; the megakernel interpreter cannot run it: compile with --schedule graph")]
    Unsupported {
        key: Key,
        op: usize,
        mnemonic: &'static str,
        why: String,
    },
    #[error("key {key}: op {op} `{mnemonic}`: {why}")]
    Operand {
        key: Key,
        op: usize,
        mnemonic: &'static str,
        why: String,
    },
    #[error("key {key}: the tape is malformed ({why}); recompile the plan")]
    Tape { key: Key, why: String },
}

fn dims(o: &Operand) -> &[u32] {
    o.ty.shape.dims()
}

/// `[rows, cols]` of a rank-2 operand (a vector is one row).
fn two(o: &Operand) -> Result<(u32, u32), String> {
    match dims(o) {
        [r, c] => Ok((*r, *c)),
        [c] => Ok((1, *c)),
        d => Err(format!("expects rank-2 operands, got {d:?}")),
    }
}

fn need_bf16(o: &Operand, what: &str) -> Result<(), String> {
    if let Some(q) = o.ty.storage {
        return Err(format!(
            "keeps its {what} quantized ({q}); the megakernel interpreter runs bf16 weights only"
        ));
    }
    if o.ty.dtype != DType::BF16 {
        return Err(format!(
            "has a {} {what}; the megakernel interpreter runs bf16 activations and weights only",
            o.ty.dtype
        ));
    }
    Ok(())
}

fn need_mult8(v: u32, what: &str) -> Result<(), String> {
    if !v.is_multiple_of(8) || v == 0 {
        return Err(format!(
            "has {what} {v}, not a positive multiple of 8 (the interpreter moves 16-byte vectors)"
        ));
    }
    Ok(())
}

fn float_kind(o: &Operand, what: &str) -> Result<i32, String> {
    match o.ty.dtype {
        DType::BF16 if o.ty.storage.is_none() => Ok(0),
        DType::F32 => Ok(1),
        d => Err(format!(
            "has a {d} {what}; the megakernel interpreter reads bf16 or f32 there"
        )),
    }
}

fn fits_i32(v: u64, what: &str) -> Result<i32, String> {
    i32::try_from(v).map_err(|_| format!("has {what} {v}, beyond the interpreter's 32-bit index"))
}

/// Whether the interpreter runs `op` (`Err` says why not, phrased to
/// follow "op N `mnemonic`").
pub fn supported(op: &PlanOp) -> Result<(), String> {
    if kiln_ir::validate::is_collective(&op.op)
        || matches!(op.lowering, kiln_ir::plan::Lowering::Collective)
    {
        return Err("is a collective (an NCCL call between ranks)".into());
    }
    let (a, r) = (&op.args, &op.results);
    let arity = |n: usize, m: usize| {
        if a.len() < n || r.len() < m {
            Err(format!(
                "has {} argument(s) and {} result(s), fewer than the op takes",
                a.len(),
                r.len()
            ))
        } else {
            Ok(())
        }
    };
    match &op.op {
        Op::MatMul { bias, out } | Op::FusedMatMul { bias, out, .. } => {
            arity(2, 1)?;
            need_bf16(&a[0], "input")?;
            need_bf16(&a[1], "weight")?;
            let (_, k) = two(&a[0])?;
            need_mult8(k, "K")?;
            if k > X_STAGE {
                return Err(format!(
                    "has K = {k}, more than the {X_STAGE} activations a GEMV task stages in shared memory"
                ));
            }
            let (n, _) = two(&a[1])?;
            if *bias {
                arity(3, 1)?;
                need_bf16(&a[2], "bias")?;
            }
            let post = match &op.op {
                Op::FusedMatMul { post, pre, .. } => {
                    if pre.is_some() {
                        let i = 2 + *bias as usize;
                        arity(i + 1, 1)?;
                        need_bf16(&a[i], "norm weight")?;
                    }
                    *post
                }
                _ => Epilogue::None,
            };
            match post {
                Epilogue::Argmax => {
                    if !matches!(out, DType::BF16 | DType::F32) {
                        return Err(format!(
                            "has {out} logits; the interpreter stores bf16 or f32"
                        ));
                    }
                }
                _ => {
                    if !matches!(out, DType::BF16 | DType::F32) || r[0].ty.dtype != *out {
                        return Err(format!(
                            "has a {} result; the interpreter stores bf16 or f32",
                            r[0].ty.dtype
                        ));
                    }
                    if post != Epilogue::None && *out != DType::BF16 {
                        return Err("has an epilogue over a non-bf16 product".into());
                    }
                    if matches!(post, Epilogue::SiluMul | Epilogue::GeluTanhMul)
                        && !n.is_multiple_of(2)
                    {
                        return Err(format!("gates an odd number ({n}) of weight rows"));
                    }
                    if post == Epilogue::Residual {
                        need_bf16(a.last().expect("arity checked"), "residual")?;
                    }
                }
            }
            Ok(())
        }
        Op::Embedding => {
            arity(2, 1)?;
            need_bf16(&a[1], "embedding table")?;
            need_mult8(two(&a[1])?.1, "hidden size")
        }
        Op::RmsNorm { .. } | Op::AddRmsNorm { .. } => {
            let n = if matches!(op.op, Op::RmsNorm { .. }) {
                2
            } else {
                3
            };
            arity(n, 1)?;
            for x in &a[..n] {
                need_bf16(x, "operand")?;
            }
            let (_, h) = two(&a[0])?;
            need_mult8(h, "hidden size")?;
            if h > NORM_MAX {
                return Err(format!(
                    "normalizes rows of {h}, wider than the interpreter's {NORM_MAX}"
                ));
            }
            Ok(())
        }
        Op::QkvRopeKvWrite {
            head_dim, qk_norm, ..
        } => {
            arity(if qk_norm.is_some() { 7 } else { 5 }, 3)?;
            need_bf16(&a[0], "qkv")?;
            need_bf16(&a[3], "K cache")?;
            need_bf16(&a[4], "V cache")?;
            if qk_norm.is_some() {
                need_bf16(&a[5], "q norm weight")?;
                need_bf16(&a[6], "k norm weight")?;
            }
            if *head_dim > MAX_HEAD_DIM || *head_dim % 2 != 0 {
                return Err(format!(
                    "has head_dim {head_dim}; the interpreter rotates even heads up to {MAX_HEAD_DIM}"
                ));
            }
            if r[1].buf != a[3].buf || r[2].buf != a[4].buf {
                return Err("writes its caches to buffers other than the caches it reads".into());
            }
            Ok(())
        }
        Op::AttentionPartials {
            attn: AttnAttrs { head_dim, .. },
            ..
        }
        | Op::PagedAttention(AttnAttrs { head_dim, .. }) => {
            arity(5, 1)?;
            need_bf16(&a[0], "q")?;
            need_bf16(&a[1], "K cache")?;
            need_bf16(&a[2], "V cache")?;
            if *head_dim > MAX_HEAD_DIM || !head_dim.is_multiple_of(8) {
                return Err(format!(
                    "has head_dim {head_dim}; the interpreter's attention takes multiples of 8 up to {MAX_HEAD_DIM}"
                ));
            }
            Ok(())
        }
        Op::AttentionCombine {
            head_dim, out, ..
        } => {
            arity(1, 1)?;
            if *out != DType::BF16 {
                return Err(format!("has {out} results; the interpreter's combine writes bf16"));
            }
            if *head_dim > MAX_HEAD_DIM {
                return Err(format!(
                    "has head_dim {head_dim}; the interpreter combines heads up to {MAX_HEAD_DIM}"
                ));
            }
            Ok(())
        }
        Op::SiluMul | Op::GeluTanhMul => {
            arity(1, 1)?;
            for x in a {
                need_bf16(x, "operand")?;
            }
            need_mult8(two(&r[0])?.1, "result width")
        }
        Op::Add => {
            arity(2, 1)?;
            need_bf16(&a[0], "operand")?;
            need_bf16(&a[1], "operand")?;
            need_mult8(u32::try_from(a[0].ty.numel()).unwrap_or(1), "element count")
        }
        Op::Scale { .. } => {
            arity(1, 1)?;
            float_kind(&a[0], "operand")?;
            need_mult8(u32::try_from(a[0].ty.numel()).unwrap_or(1), "element count")
        }
        Op::Argmax => {
            arity(1, 1)?;
            float_kind(&a[0], "input")?;
            let (_, v) = two(&a[0])?;
            if !v.is_multiple_of(4) {
                return Err(format!("has a vocabulary of {v}, not a multiple of 4"));
            }
            Ok(())
        }
        Op::GatherLast { .. } => {
            arity(1, 1)?;
            if a[0].ty.storage.is_some() {
                return Err("gathers a quantized operand".into());
            }
            two(&a[0]).map(|_| ())
        }
        Op::HeadRmsNorm { .. } | Op::Rope { .. } | Op::KvWrite => Err(
            "is unfused (the interpreter runs the fused qkv_rope_kv_write the default passes form)"
                .into(),
        ),
        Op::RopeAttention { .. } => Err(
            "is the graph schedule's fused rope + attention (the interpreter runs qkv_rope_kv_write and paged_attention as separate tasks; --schedule megakernel does not form it)"
                .into(),
        ),
        Op::MatMulQkvRope { .. } => Err(
            "is the graph schedule's QKV GEMV with the rope in its last blocks (the interpreter runs the fused_matmul and qkv_rope_kv_write as separate tasks; --schedule megakernel does not form it)"
                .into(),
        ),
        Op::Sample => Err("is the in-graph sampler, which the interpreter does not run".into()),
        Op::AcceptGreedy { .. } => {
            Err("is speculative acceptance, which the interpreter does not run".into())
        }
        Op::AllReduce { .. } | Op::ShardedArgmax { .. } => {
            Err("is a collective (an NCCL call between ranks)".into())
        }
    }
}

/// The record fields one op's tasks share: (kind, i, f, p).
type OpRecord = (TaskKind, [i32; INTS], [f32; FLOATS], [u64; PTRS]);

/// Constant-pool blobs (RoPE tables), deduplicated, 16-byte aligned.
#[derive(Default)]
struct Pool {
    bytes: Vec<u8>,
}

impl Pool {
    /// Offset of `blob` in the pool (added once).
    fn add(&mut self, blob: &[u8]) -> u64 {
        let mut at = 0;
        while at + blob.len() <= self.bytes.len() {
            if &self.bytes[at..at + blob.len()] == blob {
                return at as u64;
            }
            at += 16;
        }
        let at = self.bytes.len();
        self.bytes.extend_from_slice(blob);
        self.bytes.resize(self.bytes.len().next_multiple_of(16), 0);
        at as u64
    }
}

/// The record of `op` (index `at` of the key), its constant-pool blobs
/// added to `pool` (whose device address is `pool_base`).
fn op_record(
    op: &PlanOp,
    pool: &mut Pool,
    pool_base: u64,
    resolve: &dyn Fn(&BufRef) -> u64,
) -> Result<OpRecord, String> {
    supported(op)?;
    let (a, r) = (&op.args, &op.results);
    let mut i = [0i32; INTS];
    let mut f = [0f32; FLOATS];
    let mut p = [0u64; PTRS];
    let addr = |o: &Operand| resolve(&o.buf);
    let kind = match &op.op {
        Op::MatMul { bias, out } | Op::FusedMatMul { bias, out, .. } => {
            let (t, k) = two(&a[0])?;
            let (n, _) = two(&a[1])?;
            let (pre, post) = match &op.op {
                Op::FusedMatMul { pre, post, .. } => (*pre, *post),
                _ => (None, Epilogue::None),
            };
            let mut next = 2;
            p[0] = addr(&a[0]);
            p[1] = addr(&a[1]);
            if *bias {
                p[2] = addr(&a[next]);
                next += 1;
            }
            if let Some(pn) = pre {
                p[3] = addr(&a[next]);
                next += 1;
                i[4] = 1;
                i[5] = pn.unit_offset as i32;
                f[0] = pn.eps;
            }
            p[5] = addr(&r[0]);
            i[0] = fits_i32(t as u64, "tokens")?;
            i[1] = fits_i32(k as u64, "K")?;
            if post == Epilogue::Argmax {
                i[2] = fits_i32(n as u64, "N")?;
                i[3] = (*out == DType::F32) as i32;
                TaskKind::GemvArgmax
            } else {
                let gated = matches!(post, Epilogue::SiluMul | Epilogue::GeluTanhMul);
                let cols = if gated { n / 2 } else { n };
                i[2] = fits_i32(cols as u64, "N")?;
                i[3] = match post {
                    Epilogue::None | Epilogue::Argmax => 0,
                    Epilogue::SiluMul => 1,
                    Epilogue::GeluTanhMul => 2,
                    Epilogue::Residual => 3,
                };
                i[6] = if gated { cols as i32 } else { 0 };
                // A weight (nothing in a step writes it) may be staged in
                // shared memory before the task's waits are met.
                i[7] = matches!(a[1].buf.region, kiln_ir::plan::Region::Weight(_)) as i32;
                if post == Epilogue::Residual {
                    p[4] = addr(&a[next]);
                }
                if *out == DType::F32 {
                    TaskKind::GemvBf16F32
                } else {
                    TaskKind::GemvBf16
                }
            }
        }
        Op::Embedding => {
            let (vocab, h) = two(&a[1])?;
            i[0] = fits_i32(a[0].ty.numel(), "tokens")?;
            i[1] = h as i32;
            i[2] = fits_i32(vocab as u64, "vocab")?;
            p[0] = addr(&a[0]);
            p[1] = addr(&a[1]);
            p[2] = addr(&r[0]);
            TaskKind::Embedding
        }
        Op::RmsNorm { eps, unit_offset } | Op::AddRmsNorm { eps, unit_offset } => {
            let (t, h) = two(&a[0])?;
            i[0] = fits_i32(t as u64, "rows")?;
            i[1] = h as i32;
            i[2] = *unit_offset as i32;
            f[0] = *eps;
            if matches!(op.op, Op::RmsNorm { .. }) {
                p[0] = addr(&a[0]);
                p[1] = addr(&a[1]);
                p[2] = addr(&r[0]);
                TaskKind::RmsNorm
            } else {
                p[0] = addr(&a[0]);
                p[1] = addr(&a[1]);
                p[2] = addr(&a[2]);
                p[3] = addr(&r[0]);
                p[4] = addr(&r[1]);
                TaskKind::AddRmsNorm
            }
        }
        Op::QkvRopeKvWrite {
            heads,
            kv_heads,
            head_dim,
            rope,
            qk_norm,
            unit_offset,
        } => {
            let (t, _) = two(&a[0])?;
            let (slots, _) = two(&a[3])?;
            i[0] = fits_i32(t as u64, "tokens")?;
            i[1] = *heads as i32;
            i[2] = *kv_heads as i32;
            i[3] = *head_dim as i32;
            i[4] = qk_norm.is_some() as i32;
            i[5] = *unit_offset as i32;
            i[6] = fits_i32(slots as u64, "cache slots")?;
            f[0] = qk_norm.unwrap_or(0.0);
            p[0] = addr(&a[0]);
            p[1] = addr(&a[1]);
            p[2] = addr(&a[2]);
            p[3] = addr(&r[1]);
            p[4] = addr(&r[2]);
            if qk_norm.is_some() {
                p[5] = addr(&a[5]);
                p[6] = addr(&a[6]);
            }
            p[7] = addr(&r[0]);
            p[8] = pool_base + pool.add(&crate::gpu::rope_freqs_blob(rope, *head_dim));
            TaskKind::QkvRopeKvWrite
        }
        Op::PagedAttention(attn) | Op::AttentionPartials { attn, .. } => {
            let AttnAttrs {
                heads,
                kv_heads,
                head_dim,
                query,
                block_size,
                scale,
                window,
                softcap,
            } = attn;
            // attention_partials: the same record with the runs in i[8].
            if let Op::AttentionPartials { parts, .. } = &op.op {
                i[8] = (*parts).max(1) as i32;
            }
            let (batch, m) = two(&a[3])?;
            if *kv_heads == 0 || heads % kv_heads != 0 || *query == 0 || *block_size == 0 {
                return Err(format!(
                    "has heads {heads}, kv_heads {kv_heads}, query {query}, block size {block_size}: not a GQA shape"
                ));
            }
            fits_i32(m as u64 * *block_size as u64, "context capacity")?;
            i[0] = batch as i32;
            i[1] = *query as i32;
            i[2] = *heads as i32;
            i[3] = *kv_heads as i32;
            i[4] = *head_dim as i32;
            i[5] = *block_size as i32;
            i[6] = m as i32;
            i[7] = window.map_or(0, |w| w.min(i32::MAX as u32) as i32);
            f[0] = *scale;
            f[1] = softcap.unwrap_or(0.0);
            for (k, o) in a.iter().take(5).enumerate() {
                p[k] = addr(o);
            }
            p[5] = addr(&r[0]);
            if *window == Some(0) {
                return Err("has window 0, which attends to nothing".into());
            }
            TaskKind::PagedAttention
        }
        Op::AttentionCombine {
            heads,
            head_dim,
            parts,
            ..
        } => {
            let (rows, _) = two(&a[0])?;
            i[0] = fits_i32(rows as u64, "rows")?;
            i[1] = *heads as i32;
            i[2] = *head_dim as i32;
            i[3] = (*parts).max(1) as i32;
            p[0] = addr(&a[0]);
            p[1] = addr(&r[0]);
            TaskKind::AttentionCombine
        }
        Op::SiluMul | Op::GeluTanhMul => {
            let (t, inter) = two(&r[0])?;
            i[0] = fits_i32(t as u64, "rows")?;
            i[1] = inter as i32;
            i[2] = (a.len() == 1) as i32;
            p[0] = addr(&a[0]);
            if a.len() == 2 {
                p[1] = addr(&a[1]);
            }
            p[2] = addr(&r[0]);
            if matches!(op.op, Op::SiluMul) {
                TaskKind::SiluMul
            } else {
                TaskKind::GeluTanhMul
            }
        }
        Op::Add => {
            i[0] = fits_i32(a[0].ty.numel(), "elements")?;
            p[0] = addr(&a[0]);
            p[1] = addr(&a[1]);
            p[2] = addr(&r[0]);
            TaskKind::Add
        }
        Op::Scale { factor, softcap } => {
            i[0] = fits_i32(a[0].ty.numel(), "elements")?;
            i[1] = float_kind(&a[0], "operand")?;
            i[2] = softcap.is_some() as i32;
            f[0] = *factor;
            f[1] = softcap.unwrap_or(1.0);
            p[0] = addr(&a[0]);
            p[1] = addr(&r[0]);
            TaskKind::Scale
        }
        Op::Argmax => {
            let (rows, v) = two(&a[0])?;
            i[0] = fits_i32(rows as u64, "rows")?;
            i[1] = fits_i32(v as u64, "vocab")?;
            i[2] = float_kind(&a[0], "input")?;
            p[0] = addr(&a[0]);
            p[1] = addr(&r[0]);
            TaskKind::Argmax
        }
        Op::GatherLast { group } => {
            let (rows, width) = two(&r[0])?;
            let units = width as u64 * r[0].ty.dtype.size() as u64 / 2;
            i[0] = fits_i32(rows as u64, "rows")?;
            i[1] = fits_i32(*group as u64, "group")?;
            i[2] = fits_i32(units, "row width")?;
            p[0] = addr(&a[0]);
            p[1] = addr(&r[0]);
            TaskKind::GatherLast
        }
        _ => return Err("is not an op the interpreter runs".into()),
    };
    // Vector loads and stores need 16-byte alignment (the arena's 256 and
    // every region base give it; a misplaced operand is refused here
    // rather than faulting on the device).
    let vector_ptrs: &[usize] = match kind {
        TaskKind::GemvBf16 | TaskKind::GemvBf16F32 | TaskKind::GemvArgmax => &[0, 1, 3],
        TaskKind::Embedding => &[1, 2],
        TaskKind::RmsNorm => &[0, 1, 2],
        TaskKind::AddRmsNorm => &[0, 1, 2, 3, 4],
        TaskKind::PagedAttention => &[0, 1, 2],
        TaskKind::SiluMul | TaskKind::GeluTanhMul | TaskKind::Add => &[0, 1, 2],
        TaskKind::Scale | TaskKind::Argmax => &[0, 1],
        TaskKind::QkvRopeKvWrite | TaskKind::GatherLast | TaskKind::AttentionCombine => &[],
    };
    for &k in vector_ptrs {
        if kind == TaskKind::Argmax && k == 1 {
            continue; // i32 results, stored one by one
        }
        if p[k] % 16 != 0 {
            return Err(format!(
                "operand at device address {:#x} (record slot p[{k}]) is not 16-byte aligned; the interpreter moves 16-byte vectors (place every operand and region at 16-byte boundaries)",
                p[k]
            ));
        }
    }
    Ok((kind, i, f, p))
}

/// Encodes `kp.schedule`'s tape (which must be [`kiln_ir::Schedule::Megakernel`])
/// as one buffer that will live at device address `base`: `[tasks
/// (TASK_BYTES each) | queue_start (u32, queues + 1) | queue_tasks (u32) |
/// waits (MkWait) | constant pool (RoPE inverse-frequency tables)]`, each
/// section 16-byte aligned; the offsets in the [`TapeImage`] are relative
/// to `base`. `resolve` maps a planned buffer to its device address. The
/// image's size does not depend on `base`.
pub fn encode_tape(
    plan: &Plan,
    kp: &KeyPlan,
    base: u64,
    resolve: &dyn Fn(&BufRef) -> u64,
) -> Result<TapeImage, MegakernelError> {
    let _ = plan;
    let key = kp.key;
    let tape = match kp.schedule.tape() {
        Some(t) => t,
        None => {
            return Err(MegakernelError::NotMegakernel {
                key,
                schedule: kp.schedule.name(),
            })
        }
    };
    let bad = |why: String| MegakernelError::Tape { key, why };
    let n = tape.tasks.len();
    let nq = tape.queues.len();
    let queued: usize = tape.queues.iter().map(|q| q.len()).sum();
    let nw: usize = tape.tasks.iter().map(|t| t.waits.len()).sum();
    if n > u32::MAX as usize || nw > u32::MAX as usize || nq == 0 {
        return Err(bad(format!("{n} tasks, {nq} queues, {nw} waits")));
    }
    let a16 = |x: usize| x.next_multiple_of(16);
    let tasks_at = 0usize;
    let queue_start_at = a16(tasks_at + n * TASK_BYTES);
    let queue_tasks_at = a16(queue_start_at + 4 * (nq + 1));
    let waits_at = a16(queue_tasks_at + 4 * queued);
    let pool_at = a16(waits_at + WAIT_BYTES * nw);
    let mut pool = Pool::default();
    let mut records: Vec<Option<OpRecord>> = vec![None; kp.ops.len()];
    let mut bytes = vec![0u8; pool_at];
    let mut wait_next = 0usize;
    let counters = tape.counter_count();
    for (ti, task) in tape.tasks.iter().enumerate() {
        let oi = task.op as usize;
        let op = kp
            .ops
            .get(oi)
            .ok_or_else(|| bad(format!("task {ti} names op {oi} of {}", kp.ops.len())))?;
        if records[oi].is_none() {
            let rec = op_record(op, &mut pool, base + pool_at as u64, resolve).map_err(|why| {
                if supported(op).is_err() {
                    MegakernelError::Unsupported {
                        key,
                        op: oi,
                        mnemonic: op.op.mnemonic(),
                        why,
                    }
                } else {
                    MegakernelError::Operand {
                        key,
                        op: oi,
                        mnemonic: op.op.mnemonic(),
                        why,
                    }
                }
            })?;
            records[oi] = Some(rec);
        }
        let (kind, i, f, p) = records[oi].expect("filled above");
        if task.counter as u64 >= counters {
            return Err(bad(format!(
                "task {ti} bumps counter {} of {counters}",
                task.counter
            )));
        }
        // The interpreter reads a qkv_rope_kv_write tile as a range of
        // `heads + 2` units; an op left whole (its q result sharing bytes
        // with an argument) is all of them.
        let whole = kiln_ir::schedule::tile_units(op) == 1;
        let (tile_begin, tile_end) = match op.op {
            Op::QkvRopeKvWrite { heads, .. } if whole => (0, heads.saturating_add(2)),
            Op::Argmax if whole => (0, i.first().map_or(0, |&r| r.max(0) as u32)),
            _ => (task.tile.begin, task.tile.end),
        };
        let rec = DeviceTask {
            kind,
            counter: task.counter,
            wait_begin: wait_next as u32,
            wait_count: task.waits.len() as u32,
            tile_begin,
            tile_end,
            i,
            f,
            p,
        };
        let at = tasks_at + ti * TASK_BYTES;
        bytes[at..at + TASK_BYTES].copy_from_slice(&rec.to_bytes());
        for w in &task.waits {
            if w.counter as u64 >= counters {
                return Err(bad(format!(
                    "task {ti} waits on counter {} of {counters}",
                    w.counter
                )));
            }
            let at = waits_at + WAIT_BYTES * wait_next;
            bytes[at..at + 4].copy_from_slice(&w.counter.to_le_bytes());
            bytes[at + 4..at + 8].copy_from_slice(&w.target.to_le_bytes());
            wait_next += 1;
        }
    }
    let mut start = 0u32;
    let mut qt = queue_tasks_at;
    for (q, list) in tape.queues.iter().enumerate() {
        let at = queue_start_at + 4 * q;
        bytes[at..at + 4].copy_from_slice(&start.to_le_bytes());
        for &t in list {
            if t as usize >= n {
                return Err(bad(format!("queue {q} lists task {t} of {n}")));
            }
            bytes[qt..qt + 4].copy_from_slice(&t.to_le_bytes());
            qt += 4;
        }
        start += list.len() as u32;
    }
    let at = queue_start_at + 4 * nq;
    bytes[at..at + 4].copy_from_slice(&start.to_le_bytes());
    bytes.extend_from_slice(&pool.bytes);
    Ok(TapeImage {
        bytes,
        tasks_at: tasks_at as u64,
        queue_start_at: queue_start_at as u64,
        queue_tasks_at: queue_tasks_at as u64,
        waits_at: waits_at as u64,
        queues: nq as u32,
        tasks: n as u32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_ir::plan::{KernelImage, KvLayout, Lowering, ModelInfo, ModelMeta, Region, Target};
    use kiln_ir::schedule::{Schedule, Tape, Task, Tile, Wait};
    use kiln_ir::{Graph, NodeId, PreNorm, QuantType, Rope, RopeScaling, Shape, TensorType};

    fn opd(region: Region, offset: u64, dtype: DType, d: &[u32]) -> Operand {
        let ty = TensorType::new(dtype, Shape::new(d.to_vec()));
        Operand {
            buf: BufRef {
                region,
                offset,
                bytes: ty.size_bytes(),
            },
            ty,
        }
    }
    fn arena(offset: u64, dtype: DType, d: &[u32]) -> Operand {
        opd(Region::Arena, offset, dtype, d)
    }
    fn weight(i: u32, d: &[u32]) -> Operand {
        opd(Region::Weight(i), 0, DType::BF16, d)
    }
    fn io(offset: u64, d: &[u32]) -> Operand {
        opd(Region::Io, offset, DType::I32, d)
    }
    fn plan_op(op: Op, args: Vec<Operand>, results: Vec<Operand>) -> PlanOp {
        PlanOp {
            node: NodeId(0),
            kernel: String::new(),
            op,
            args,
            results,
            workspace_bytes: 0,
            lowering: Lowering::Reference,
            scratch: None,
            counters: None,
        }
    }
    /// Region bases 1 MiB apart (weights and caches 16 MiB), all aligned.
    fn resolve(b: &BufRef) -> u64 {
        let base = match b.region {
            Region::Arena => 0x10_0000,
            Region::Io => 0x20_0000,
            Region::Workspace => 0x30_0000,
            Region::Counters => 0x40_0000,
            Region::Weight(i) => 0x100_0000 * (1 + i as u64),
            Region::KCache(l) => 0x1_0000_0000 + 0x100_0000 * l as u64,
            Region::VCache(l) => 0x2_0000_0000 + 0x100_0000 * l as u64,
        };
        base + b.offset
    }
    fn record(op: &PlanOp) -> OpRecord {
        op_record(op, &mut Pool::default(), 0xf000, &resolve).unwrap()
    }
    fn rope() -> Rope {
        Rope {
            theta: 10000.0,
            scaling: RopeScaling::None,
        }
    }
    fn qkv_op(qk_norm: bool) -> PlanOp {
        let (t, heads, kvh, hd) = (2u32, 4u32, 2u32, 64u32);
        let mut args = vec![
            arena(0, DType::BF16, &[t, (heads + 2 * kvh) * hd]),
            io(0, &[t]),
            io(64, &[t]),
            opd(Region::KCache(1), 0, DType::BF16, &[64, kvh * hd]),
            opd(Region::VCache(1), 0, DType::BF16, &[64, kvh * hd]),
        ];
        if qk_norm {
            args.push(weight(5, &[hd]));
            args.push(weight(6, &[hd]));
        }
        let results = vec![
            arena(4096, DType::BF16, &[t, heads * hd]),
            args[3].clone(),
            args[4].clone(),
        ];
        plan_op(
            Op::QkvRopeKvWrite {
                heads,
                kv_heads: kvh,
                head_dim: hd,
                rope: rope(),
                qk_norm: qk_norm.then_some(1e-6),
                unit_offset: true,
            },
            args,
            results,
        )
    }

    #[test]
    fn a_device_task_puts_every_field_where_struct_mktask_has_it() {
        let t = DeviceTask {
            kind: TaskKind::GemvBf16F32,
            counter: 7,
            wait_begin: 11,
            wait_count: 3,
            tile_begin: 16,
            tile_end: 32,
            i: std::array::from_fn(|k| 100 + k as i32 - 5 * (k == 15) as i32 * 40),
            f: [0.5, -1.25, 3.0, 1e-6],
            p: std::array::from_fn(|k| 0x1000_0000_0000 + 0x10 * k as u64),
        };
        let b = t.to_bytes();
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let i32_at = |o: usize| i32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let f32_at = |o: usize| f32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        assert_eq!(
            (0..8).map(|k| u32_at(4 * k)).collect::<Vec<_>>(),
            vec![2, 7, 11, 3, 16, 32, 0, 0]
        );
        assert_eq!((0..16).map(|k| i32_at(32 + 4 * k)).collect::<Vec<_>>(), t.i);
        assert_eq!((0..4).map(|k| f32_at(96 + 4 * k)).collect::<Vec<_>>(), t.f);
        assert_eq!(
            (0..10).map(|k| u64_at(112 + 8 * k)).collect::<Vec<_>>(),
            t.p
        );
        assert_eq!(112 + 8 * PTRS, TASK_BYTES);
        // The source declares the same layout and constants.
        let src = MEGAKERNEL_MODULE.raw_source;
        assert!(src.contains("// One task, 192 bytes"));
        assert!(src.contains(&format!("static_assert(sizeof(MkTask) == {TASK_BYTES}")));
        assert!(src.contains("int i[16];                    // byte 32"));
        assert!(src.contains("float f[4];                   // byte 96"));
        assert!(src.contains("unsigned long long p[10];     // byte 112"));
        for (name, v) in [
            ("KILN_MK_THREADS", BLOCK_THREADS),
            ("KILN_MK_SMEM_FLOATS", SMEM_FLOATS),
            ("KILN_MK_NORM_MAX", NORM_MAX),
            ("KILN_MK_MAX_HEAD_DIM", MAX_HEAD_DIM),
            ("KILN_MK_X_STAGE", X_STAGE),
        ] {
            assert!(src.contains(&format!("#define {name} {v}\n")), "{name}");
        }
        assert!(src.contains(&format!(
            "#define KILN_MK_PREFETCH_MAX ({}u << 20)",
            PREFETCH_MAX >> 20
        )));
        for (kind, name) in TaskKind::ALL {
            assert!(
                src.contains(&format!("#define {name} {}\n", kind as u32)),
                "{name}"
            );
            assert!(src.contains(&format!("case {name}:")), "{name} has no case");
        }
        assert!(src.contains(&format!("KILN_GLOBAL void {RESET_ENTRY}(")));
        const { assert!(SHARED_BYTES <= 48 * 1024) };
        // Static plus the stage fit one sm_90 block (227 KiB) with the
        // driver's 1 KiB reserve per block to spare.
        const { assert!(SHARED_BYTES + WEIGHT_STAGE_BYTES + 1024 <= 227 * 1024) };
    }

    #[test]
    fn every_kind_fills_its_documented_slots() {
        let bf = DType::BF16;
        // matmul with bias and f32 logits: a plain GEMV tile.
        let mm = plan_op(
            Op::MatMul {
                bias: true,
                out: DType::F32,
            },
            vec![
                arena(0, bf, &[3, 64]),
                weight(1, &[40, 64]),
                weight(2, &[40]),
            ],
            vec![arena(1024, DType::F32, &[3, 40])],
        );
        let (k, i, _, p) = record(&mm);
        assert_eq!(k, TaskKind::GemvBf16F32);
        assert_eq!(&i[..8], &[3, 64, 40, 0, 0, 0, 0, 1]);
        assert_eq!(
            &p[..6],
            &[0x10_0000, 0x200_0000, 0x300_0000, 0, 0, 0x10_0400]
        );
        // fused_matmul: RMSNorm prologue, gated epilogue over [2I, K].
        let fused = |post: Epilogue, extra: Option<Operand>, out: Operand| {
            let mut args = vec![
                arena(0, bf, &[1, 64]),
                weight(1, &[32, 64]),
                weight(3, &[64]),
            ];
            args.extend(extra);
            plan_op(
                Op::FusedMatMul {
                    bias: false,
                    out: if post == Epilogue::Argmax {
                        DType::F32
                    } else {
                        bf
                    },
                    pre: Some(PreNorm {
                        eps: 1e-5,
                        unit_offset: true,
                    }),
                    post,
                },
                args,
                vec![out],
            )
        };
        let (k, i, f, p) = record(&fused(
            Epilogue::GeluTanhMul,
            None,
            arena(512, bf, &[1, 16]),
        ));
        assert_eq!(k, TaskKind::GemvBf16);
        assert_eq!(&i[..7], &[1, 64, 16, 2, 1, 1, 16]);
        assert_eq!(f[0], 1e-5);
        assert_eq!((p[2], p[3], p[4], p[5]), (0, 0x400_0000, 0, 0x10_0200));
        let res = arena(2048, bf, &[1, 32]);
        let (_, i, _, p) = record(&fused(
            Epilogue::Residual,
            Some(res),
            arena(512, bf, &[1, 32]),
        ));
        assert_eq!((i[2], i[3], i[6], p[4]), (32, 3, 0, 0x10_0800));
        let (k, i, _, p) = record(&fused(Epilogue::Argmax, None, arena(512, DType::I32, &[1])));
        assert_eq!(k, TaskKind::GemvArgmax);
        assert_eq!(
            (i[0], i[1], i[2], i[3], i[4], p[5]),
            (1, 64, 32, 1, 1, 0x10_0200)
        );
        // embedding
        let emb = plan_op(
            Op::Embedding,
            vec![io(0, &[2]), weight(0, &[100, 64])],
            vec![arena(256, bf, &[2, 64])],
        );
        let (k, i, _, p) = record(&emb);
        assert_eq!((k, &i[..3]), (TaskKind::Embedding, &[2, 64, 100][..]));
        assert_eq!(&p[..3], &[0x20_0000, 0x100_0000, 0x10_0100]);
        // rms_norm and add_rms_norm
        let rn = plan_op(
            Op::RmsNorm {
                eps: 1e-6,
                unit_offset: true,
            },
            vec![arena(0, bf, &[2, 64]), weight(4, &[64])],
            vec![arena(256, bf, &[2, 64])],
        );
        let (k, i, f, p) = record(&rn);
        assert_eq!(
            (k, &i[..3], f[0]),
            (TaskKind::RmsNorm, &[2, 64, 1][..], 1e-6)
        );
        assert_eq!(&p[..3], &[0x10_0000, 0x500_0000, 0x10_0100]);
        let arn = plan_op(
            Op::AddRmsNorm {
                eps: 1e-5,
                unit_offset: false,
            },
            vec![
                arena(0, bf, &[2, 64]),
                arena(256, bf, &[2, 64]),
                weight(4, &[64]),
            ],
            vec![arena(512, bf, &[2, 64]), arena(768, bf, &[2, 64])],
        );
        let (k, i, _, p) = record(&arn);
        assert_eq!((k, &i[..3]), (TaskKind::AddRmsNorm, &[2, 64, 0][..]));
        assert_eq!(
            &p[..5],
            &[0x10_0000, 0x10_0100, 0x500_0000, 0x10_0200, 0x10_0300]
        );
        // qkv_rope_kv_write with q/k norm: the table lands in the pool.
        let mut pool = Pool::default();
        let (k, i, f, p) = op_record(&qkv_op(true), &mut pool, 0xf000, &resolve).unwrap();
        assert_eq!(k, TaskKind::QkvRopeKvWrite);
        assert_eq!(&i[..7], &[2, 4, 2, 64, 1, 1, 64]);
        assert_eq!(f[0], 1e-6);
        assert_eq!(
            &p[..9],
            &[
                0x10_0000,
                0x20_0000,
                0x20_0040,
                0x1_0100_0000,
                0x2_0100_0000,
                0x600_0000,
                0x700_0000,
                0x10_1000,
                0xf000
            ]
        );
        assert_eq!(pool.bytes, crate::gpu::rope_freqs_blob(&rope(), 64));
        let (_, i, _, p) = op_record(&qkv_op(false), &mut pool, 0xf000, &resolve).unwrap();
        assert_eq!(
            (i[4], p[5], p[6], p[8]),
            (0, 0, 0, 0xf000),
            "one table, shared"
        );
        assert_eq!(pool.bytes.len(), 512);
        // paged_attention with a window and a softcap
        let pa = plan_op(
            Op::PagedAttention(AttnAttrs {
                heads: 8,
                kv_heads: 2,
                head_dim: 128,
                query: 2,
                block_size: 16,
                scale: 0.125,
                window: Some(512),
                softcap: Some(50.0),
            }),
            vec![
                arena(0, bf, &[6, 1024]),
                opd(Region::KCache(0), 0, bf, &[160, 256]),
                opd(Region::VCache(0), 0, bf, &[160, 256]),
                io(0, &[3, 10]),
                io(256, &[3]),
            ],
            vec![arena(16384, bf, &[6, 1024])],
        );
        let (k, i, f, p) = record(&pa);
        assert_eq!(k, TaskKind::PagedAttention);
        assert_eq!(&i[..8], &[3, 2, 8, 2, 128, 16, 10, 512]);
        assert_eq!(&f[..2], &[0.125, 50.0]);
        assert_eq!(
            &p[..6],
            &[
                0x10_0000,
                0x1_0000_0000,
                0x2_0000_0000,
                0x20_0000,
                0x20_0100,
                0x10_4000
            ]
        );
        // silu_mul packed, gelu_tanh_mul split, add, scale, argmax, gather_last
        let sm = plan_op(
            Op::SiluMul,
            vec![arena(0, bf, &[2, 64])],
            vec![arena(0, bf, &[2, 32])],
        );
        let (k, i, _, p) = record(&sm);
        assert_eq!(
            (k, &i[..3], &p[..3]),
            (
                TaskKind::SiluMul,
                &[2, 32, 1][..],
                &[0x10_0000, 0, 0x10_0000][..]
            )
        );
        let gm = plan_op(
            Op::GeluTanhMul,
            vec![arena(0, bf, &[2, 32]), arena(256, bf, &[2, 32])],
            vec![arena(512, bf, &[2, 32])],
        );
        let (k, i, _, p) = record(&gm);
        assert_eq!((k, i[2], p[1]), (TaskKind::GeluTanhMul, 0, 0x10_0100));
        let add = plan_op(
            Op::Add,
            vec![arena(0, bf, &[2, 64]), arena(256, bf, &[2, 64])],
            vec![arena(0, bf, &[2, 64])],
        );
        let (k, i, _, p) = record(&add);
        assert_eq!(
            (k, i[0], &p[..3]),
            (TaskKind::Add, 128, &[0x10_0000, 0x10_0100, 0x10_0000][..])
        );
        let sc = plan_op(
            Op::Scale {
                factor: 1.0,
                softcap: Some(30.0),
            },
            vec![arena(0, DType::F32, &[2, 64])],
            vec![arena(1024, DType::F32, &[2, 64])],
        );
        let (k, i, f, _) = record(&sc);
        assert_eq!(
            (k, &i[..3], &f[..2]),
            (TaskKind::Scale, &[128, 1, 1][..], &[1.0, 30.0][..])
        );
        let am = plan_op(
            Op::Argmax,
            vec![arena(0, DType::F32, &[2, 100])],
            vec![io(0, &[2])],
        );
        let (k, i, _, p) = record(&am);
        assert_eq!(
            (k, &i[..3], p[1]),
            (TaskKind::Argmax, &[2, 100, 1][..], 0x20_0000)
        );
        let gl = plan_op(
            Op::GatherLast { group: 2 },
            vec![arena(0, DType::F32, &[4, 10])],
            vec![arena(512, DType::F32, &[2, 10])],
        );
        let (k, i, _, _) = record(&gl);
        assert_eq!((k, &i[..3]), (TaskKind::GatherLast, &[2, 2, 20][..]));
    }

    fn test_plan(ops: Vec<PlanOp>, tape: Option<Tape>) -> (Plan, KeyPlan) {
        let kp = KeyPlan {
            key: Key::new(2, 1, 0),
            graph: Graph::new("g"),
            ops,
            buffers: vec![],
            inputs: vec![],
            outputs: vec![],
            io_bytes: 512,
            arena_peak: 4096,
            arena_lower_bound: 4096,
            workspace_bytes: 0,
            launches: 0,
            flops: 0,
            bytes_moved: 0,
            schedule: tape.map_or(Schedule::Graph, |t| Schedule::Megakernel(Box::new(t))),
        };
        let plan = Plan {
            meta: ModelMeta {
                architecture: "LlamaForCausalLM".into(),
                files: vec![],
                compiler_version: "0".into(),
                target: Target::Cuda { sm: 90 },
                info: ModelInfo {
                    vocab_size: 100,
                    hidden_size: 64,
                    num_layers: 2,
                    num_heads: 4,
                    num_kv_heads: 2,
                    head_dim: 64,
                    max_context: 64,
                    bos_token_id: None,
                    eos_token_ids: vec![],
                    dtype: DType::BF16,
                },
            },
            manifest: Default::default(),
            kv: KvLayout {
                layers: 2,
                kv_heads: 2,
                head_dim: 64,
                dtype: DType::BF16,
                block_size: 16,
                num_blocks: 4,
                null_block: 0,
                max_blocks_per_seq: 4,
            },
            arena_bytes: 1 << 16,
            workspace_bytes: 0,
            counter_bytes: 64,
            keys: vec![kp.clone()],
            kernels: Vec::<KernelImage>::new(),
            kernel_abi: 0,
            tp: 1,
        };
        (plan, kp)
    }

    fn task(op: u32, tile: (u32, u32), counter: u32, waits: &[u32]) -> Task {
        Task {
            op,
            tile: Tile {
                begin: tile.0,
                end: tile.1,
            },
            reads: vec![],
            writes: vec![],
            counter,
            waits: waits
                .iter()
                .map(|&c| Wait {
                    counter: c,
                    target: 1,
                })
                .collect(),
        }
    }

    fn three_ops() -> Vec<PlanOp> {
        let bf = DType::BF16;
        vec![
            plan_op(
                Op::Embedding,
                vec![io(0, &[2]), weight(0, &[100, 512])],
                vec![arena(0, bf, &[2, 512])],
            ),
            qkv_op(false),
            plan_op(
                Op::MatMul {
                    bias: false,
                    out: bf,
                },
                vec![arena(0, bf, &[2, 512]), weight(1, &[48, 512])],
                vec![arena(8192, bf, &[2, 48])],
            ),
        ]
    }

    fn three_op_tape() -> Tape {
        Tape {
            sm_count: 3,
            blocks_per_sm: 1,
            counters: BufRef {
                region: Region::Counters,
                offset: 0,
                bytes: 20,
            },
            tasks: vec![
                task(0, (0, 1), 0, &[]),
                task(1, (0, 1), 1, &[0]),
                task(2, (0, 16), 2, &[0]),
                task(2, (16, 32), 3, &[0, 1]),
                task(2, (32, 48), 4, &[0]),
            ],
            queues: vec![vec![0, 3], vec![1, 4], vec![2]],
        }
    }

    #[test]
    fn the_image_has_aligned_sections_and_a_size_independent_of_its_base() {
        let (plan, kp) = test_plan(three_ops(), Some(three_op_tape()));
        let a = encode_tape(&plan, &kp, 0, &resolve).unwrap();
        let base = 0x7f12_3456_7000u64;
        let b = encode_tape(&plan, &kp, base, &resolve).unwrap();
        assert_eq!(a.bytes.len(), b.bytes.len());
        assert_eq!(
            (a.tasks_at, a.queue_start_at, a.queue_tasks_at, a.waits_at),
            (b.tasks_at, b.queue_start_at, b.queue_tasks_at, b.waits_at)
        );
        assert_eq!((a.tasks, a.queues), (5, 3));
        for at in [a.tasks_at, a.queue_start_at, a.queue_tasks_at, a.waits_at] {
            assert_eq!(at % 16, 0);
        }
        assert_eq!(a.queue_start_at, 5 * TASK_BYTES as u64);
        assert_eq!(a.queue_tasks_at, a.queue_start_at + 16);
        assert_eq!(a.waits_at, a.queue_tasks_at + 32);
        let u32s = |img: &TapeImage, at: u64, n: usize| -> Vec<u32> {
            (0..n)
                .map(|k| {
                    let o = at as usize + 4 * k;
                    u32::from_le_bytes(img.bytes[o..o + 4].try_into().unwrap())
                })
                .collect()
        };
        assert_eq!(u32s(&b, b.queue_start_at, 4), vec![0, 2, 4, 5]);
        assert_eq!(u32s(&b, b.queue_tasks_at, 5), vec![0, 3, 1, 4, 2]);
        // Waits in task order: (counter, target) pairs.
        assert_eq!(u32s(&b, b.waits_at, 10), vec![0, 1, 0, 1, 0, 1, 1, 1, 0, 1]);
        // Task 3: counter 3, waits 2..4, tile 16..32, a GEMV over 2 tokens.
        let t3 = b.tasks_at + 3 * TASK_BYTES as u64;
        assert_eq!(
            u32s(&b, t3, 8),
            vec![TaskKind::GemvBf16 as u32, 3, 2, 2, 16, 32, 0, 0]
        );
        assert_eq!(u32s(&b, t3 + 32, 3), vec![2, 512, 48]);
        // The RoPE table is the last section; the qkv task points at it.
        let pool_at = (b.waits_at + 8 * 5).next_multiple_of(16);
        assert_eq!(b.bytes.len() as u64, pool_at + 512);
        assert_eq!(
            &b.bytes[pool_at as usize..],
            &crate::gpu::rope_freqs_blob(&rope(), 64)[..]
        );
        let t1 = b.tasks_at as usize + TASK_BYTES;
        let p8 = u64::from_le_bytes(b.bytes[t1 + 112 + 64..t1 + 120 + 64].try_into().unwrap());
        assert_eq!(p8, base + pool_at);
        // Everything but that pointer is the same at either base.
        let mut c = b.bytes.clone();
        c[t1 + 176..t1 + 184].copy_from_slice(&pool_at.to_le_bytes());
        assert_eq!(c, a.bytes);
    }

    #[test]
    fn refusals_name_the_key_the_op_and_what_to_do() {
        let err = |ops: Vec<PlanOp>| {
            let (plan, kp) = test_plan(ops, Some(three_op_tape()));
            encode_tape(&plan, &kp, 0, &resolve)
                .unwrap_err()
                .to_string()
        };
        // A weight kept quantized.
        let mut ops = three_ops();
        ops[2].args[1].ty = ops[2].args[1].ty.clone().stored(QuantType::Q4K);
        let e = err(ops);
        assert!(e.contains("key b2q1s0: op 2 `matmul`"), "{e}");
        assert!(e.contains("quantized (q4_k)"), "{e}");
        assert!(e.contains("bf16 weights only"), "{e}");
        assert!(e.contains("compile with --schedule graph"), "{e}");
        // f16 activations.
        let mut ops = three_ops();
        ops[0].args[1].ty.dtype = DType::F16;
        ops[0].results[0].ty.dtype = DType::F16;
        let e = err(ops);
        assert!(
            e.contains("op 0 `embedding`") && e.contains("bf16 activations"),
            "{e}"
        );
        // Sampling and the unfused kv_write.
        let mut ops = three_ops();
        ops[1].op = Op::Sample;
        assert!(err(ops).contains("op 1 `sample` is the in-graph sampler"));
        let mut ops = three_ops();
        ops[1].op = Op::KvWrite;
        assert!(err(ops).contains("op 1 `kv_write` is unfused"));
        // A misaligned operand.
        let mut ops = three_ops();
        ops[2].results[0].buf.offset += 8;
        ops[2].args[0].buf.offset += 8;
        let e = err(ops);
        assert!(
            e.contains("op 2 `matmul`") && e.contains("not 16-byte aligned"),
            "{e}"
        );
        // A graph-schedule key.
        let (plan, kp) = test_plan(three_ops(), None);
        let e = encode_tape(&plan, &kp, 0, &resolve)
            .unwrap_err()
            .to_string();
        assert!(e.contains("key b2q1s0: its schedule is `graph`"), "{e}");
        // supported() says the same, for the compiler to refuse early.
        let mut ops = three_ops();
        ops[2].args[1].ty = ops[2].args[1].ty.clone().stored(QuantType::Q8_0);
        assert!(supported(&ops[2]).unwrap_err().contains("q8_0"));
        assert!(three_ops().iter().all(|o| supported(o).is_ok()));
    }

    /// Whether NVRTC is here to compile with; where it is not, the test
    /// says SKIPPED, unless KILN_REQUIRE_NVRTC=1 makes that a failure.
    #[cfg(feature = "nvrtc")]
    fn nvrtc_here() -> bool {
        match crate::nvrtc::locate() {
            Ok(_) => true,
            Err(e) if std::env::var("KILN_REQUIRE_NVRTC").is_ok_and(|v| v == "1") => {
                panic!("KILN_REQUIRE_NVRTC=1 but {e}")
            }
            Err(e) => {
                eprintln!("SKIPPED: NVRTC is not installed here ({e})");
                false
            }
        }
    }

    /// The interpreter compiles to a CUBIN for every supported SM and
    /// exports its entry points (named so `cargo test -p kiln-kernels
    /// every_module_compiles` runs it with the catalog's modules).
    #[cfg(feature = "nvrtc")]
    #[test]
    fn every_module_compiles_and_so_does_the_megakernel_interpreter() {
        if !nvrtc_here() {
            return;
        }
        for sm in crate::nvrtc::SUPPORTED_SMS {
            let cubin = crate::nvrtc::compile_module(&MEGAKERNEL_MODULE, sm)
                .unwrap_or_else(|e| panic!("sm_{sm}: {e}"));
            assert_eq!(&cubin[..4], b"\x7fELF");
            // KILN_DUMP_CUBINS=<dir>: also written there, for
            // kernels/tests/megakernel_gpu.rs's KILN_MK_CUBIN on a GPU
            // machine (the catalog's dump does not hold the interpreter).
            if let Ok(dir) = std::env::var("KILN_DUMP_CUBINS") {
                std::fs::write(format!("{dir}/megakernel.sm_{sm}.cubin"), &cubin).unwrap();
            }
            for entry in [ENTRY, RESET_ENTRY] {
                let needle = format!("{entry}\0");
                assert!(
                    cubin.windows(needle.len()).any(|w| w == needle.as_bytes()),
                    "{entry} missing from the sm_{sm} cubin"
                );
            }
        }
    }

    /// The interpreter's A/B knobs (defines that are off by default) must
    /// still compile, or an A/B on the device fails at its first step:
    /// the TMA stage with look-ahead, the look-ahead over per-thread
    /// copies, and polls without a sleep.
    #[cfg(feature = "nvrtc")]
    #[test]
    fn the_interpreter_compiles_for_sm_90_with_each_of_its_a_b_knobs() {
        if !nvrtc_here() {
            return;
        }
        for knob in [
            "#define KILN_MK_USE_TMA 1",
            "#define KILN_MK_LOOKAHEAD 1",
            "#define KILN_MK_PAUSE_NS 0",
            "#define KILN_MK_PREFETCH_EARLY 1",
            "#define KILN_MK_PREFETCH_AHEAD 2",
        ] {
            let source: &'static str =
                Box::leak(format!("{knob}\n{}", MEGAKERNEL_MODULE.raw_source).into_boxed_str());
            let m = GpuModule {
                raw_source: source,
                ..MEGAKERNEL_MODULE
            };
            let cubin =
                crate::nvrtc::compile_module(&m, 90).unwrap_or_else(|e| panic!("{knob}: {e}"));
            let needle = format!("{ENTRY}\0");
            assert!(
                cubin.windows(needle.len()).any(|w| w == needle.as_bytes()),
                "{knob}: {ENTRY} missing"
            );
        }
    }
}
