//! The GPU kernel catalog: which module and entry point runs each op, with
//! what launch geometry and parameters.
//!
//! The CUDA C sources live in `kernels/gpu/*.cu` and are the one source for
//! both GPU backends (NVRTC for CUDA, hiprtc for HIP); `kiln_port.h` is
//! inlined in front of each module by [`module_source`], so a module compiles
//! with no include path.
//!
//! Lowering is a compile-time decision. `kiln compile` asks [`op_needs`] for
//! the scratch and completion counters an op's kernels need (so the planner
//! can place them), then [`lower_op`] turns the op into the plan's
//! [`Lowering`]: its complete launch list with every buffer parameter a
//! planned [`BufRef`], or a GEMM with the implementation [`choose_gemm`]
//! picks (the target's [`default_gemm_kind`] or a `kiln tune` table) and
//! its kiln kernel launch ([`gemv_call`], [`skinny_call`]). [`LowerOptions`] carries what the target decides (PDL,
//! the attention block target). An op no kernel can run is a
//! [`CatalogError`] naming the op and the limit, so the compile fails.
//!
//! [`lower`] (symbolic [`Param`]s, geometry from `KILN_ATTN_TARGET_BLOCKS`)
//! is the older run-time form the CUDA and HIP backends still call; it is
//! the same catalog ([`lower_symbolic`]) and goes once they launch
//! `Launch::body`. Nothing that changes between steps is ever a parameter:
//! token ids, positions, slots, block tables and context lengths are
//! operands (device memory), read by the kernels at run time.
//!
//! Deliberately not here: any driver call (the backends own those), and the
//! BLAS library's algorithm (cuBLASLt / hipBLASLt, looked up by the backend
//! under the planned workspace when the plan records `blas`).

use kiln_ir::plan::{
    BufRef, GemmKind, GemmShape, KernelLaunch, LaunchParam, Lowering, Operand, Region, Target,
};
use kiln_ir::{AttnAttrs, DType, Epilogue, Op, Rope, TensorType};
use std::collections::HashMap;

/// The portability header every module starts with.
pub const PORT_HEADER: &str = include_str!("../gpu/kiln_port.h");

/// One GPU source module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuModule {
    /// Module name: the [`kiln_ir::plan::KernelImage`] name of its binary.
    pub name: &'static str,
    /// File name under `kernels/gpu/`.
    pub file: &'static str,
    /// The source as written (with its `#include "kiln_port.h"`).
    pub raw_source: &'static str,
}

/// Every module, in a fixed order.
pub const MODULES: [GpuModule; 9] = [
    GpuModule {
        name: "norm",
        file: "norm.cu",
        raw_source: include_str!("../gpu/norm.cu"),
    },
    GpuModule {
        name: "rope",
        file: "rope.cu",
        raw_source: include_str!("../gpu/rope.cu"),
    },
    GpuModule {
        name: "attention",
        file: "attention.cu",
        raw_source: include_str!("../gpu/attention.cu"),
    },
    GpuModule {
        name: "elementwise",
        file: "elementwise.cu",
        raw_source: include_str!("../gpu/elementwise.cu"),
    },
    GpuModule {
        name: "gemv",
        file: "gemv.cu",
        raw_source: include_str!("../gpu/gemv.cu"),
    },
    GpuModule {
        name: "sampling",
        file: "sampling.cu",
        raw_source: include_str!("../gpu/sampling.cu"),
    },
    GpuModule {
        name: "skinny",
        file: "skinny.cu",
        raw_source: include_str!("../gpu/skinny.cu"),
    },
    // Quantized GEMV and row gather (crate::quant_gpu lowers them).
    GpuModule {
        name: crate::quant_gpu::MODULE,
        file: "qgemv.cu",
        raw_source: include_str!("../gpu/qgemv.cu"),
    },
    // Quantized skinny GEMM on tensor cores, 2..32 tokens (crate::quant_gpu).
    GpuModule {
        name: crate::quant_gpu::QSKINNY_MODULE,
        file: "qskinny.cu",
        raw_source: include_str!("../gpu/qskinny.cu"),
    },
];

/// The launch catalog's own source: entry names, parameter order and the
/// by-value structs' layouts live here, next to the kernels they call.
const CATALOG_SOURCE: &str = include_str!("gpu.rs");

/// A fingerprint of the GPU kernel ABI: FNV-1a over `kiln_port.h`, every
/// module's source, this launch catalog and the megakernel interpreter
/// (whose task records the runtime encodes). A plan records the value its
/// kernel images were compiled under; a runtime whose kernels or catalog
/// differ (a stale plan: the images would be launched with another
/// parameter layout) refuses it before loading anything. Any edit counts,
/// comments included: erring towards "recompile" is the safe side.
pub fn kernel_abi() -> u64 {
    static ABI: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *ABI.get_or_init(|| {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let parts = std::iter::once(PORT_HEADER)
            .chain(MODULES.iter().map(|m| m.raw_source))
            .chain(std::iter::once(CATALOG_SOURCE))
            .chain(std::iter::once(
                crate::megakernel::MEGAKERNEL_MODULE.raw_source,
            ));
        for part in parts {
            // Length first, so moving text between parts changes the hash.
            for b in (part.len() as u64)
                .to_le_bytes()
                .iter()
                .chain(part.as_bytes())
            {
                h = (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3);
            }
        }
        h
    })
}

/// Looks a module up by name.
pub fn module(name: &str) -> Option<&'static GpuModule> {
    MODULES.iter().find(|m| m.name == name)
}

/// The module's source with `kiln_port.h` inlined, ready for a runtime
/// compiler (no include path, no toolkit headers).
pub fn module_source(m: &GpuModule) -> String {
    let mut out = String::with_capacity(PORT_HEADER.len() + m.raw_source.len() + 64);
    for line in m.raw_source.lines() {
        if line.trim() == "#include \"kiln_port.h\"" {
            out.push_str("// ---- kiln_port.h (inlined) ----\n");
            out.push_str(PORT_HEADER);
            out.push_str("// ---- end kiln_port.h ----\n");
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Storage suffixes of the float entry points.
const FLOAT_SUFFIXES: [&str; 3] = ["bf16", "f16", "f32"];
/// Rows per tile of the attention partition kernel.
const ATTN_ROW_TILES: [u32; 4] = [1, 2, 4, 8];

/// (input, output) storage pairs of the skinny-GEMM kernels.
const GEMV_TYPES: [(&str, &str); 4] = [
    ("bf16", "bf16"),
    ("bf16", "f32"),
    ("f16", "f16"),
    ("f16", "f32"),
];
/// Token counts the skinny-GEMM kernels are instantiated for.
const GEMV_TOKENS: [u32; 4] = [1, 2, 4, 8];
/// Output features per skinny-GEMM block (8 warps x 2 rows).
pub const GEMV_ROWS_PER_BLOCK: u32 = 16;

/// The split-K factors the GEMV is instantiated for (`gemv.cu`'s KS).
const GEMV_KSPLITS: [u32; 3] = [1, 2, 4];
/// The entry-name prefix of split factor `ks` (`gemv_k2_t1_...`).
fn ksplit_prefix(ks: u32) -> String {
    if ks == 1 {
        String::new()
    } else {
        format!("k{ks}_")
    }
}

/// Blocks a plain GEMV launch aims for at least (one per SM of an H100 /
/// H200): a GEMV with fewer 16-row blocks splits K over 2 or 4 warps per
/// row pair instead (`gemv.cu`'s KS). `KILN_GEMV_MIN_BLOCKS` overrides it
/// at compile time (0: never split), for measuring.
pub const GEMV_MIN_BLOCKS: u32 = 132;

fn gemv_min_blocks() -> u32 {
    static V: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        std::env::var("KILN_GEMV_MIN_BLOCKS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(GEMV_MIN_BLOCKS)
    })
}

/// The split factor for an `n`-row GEMV with `k` inputs: the smallest of
/// [`GEMV_KSPLITS`] whose grid reaches `min_blocks`, as long as every lane
/// of the split still has a vector of each row to load.
pub fn gemv_ksplit(n: u32, k: u32, min_blocks: u32) -> u32 {
    let kv = k / 8;
    let mut pick = 1;
    for ks in GEMV_KSPLITS {
        if kv < KILN_WARP * ks {
            break;
        }
        pick = ks;
        if n.div_ceil(GEMV_ROWS_PER_BLOCK / ks) >= min_blocks {
            break;
        }
    }
    pick
}

/// One-token GEMVs with fewer 16-row blocks than this run the staged GEMV
/// (`gemv.cu`'s gemv_staged_rows: weights through a shared-memory ring
/// filled by cp.async), when K is at most [`GEMV_STAGED_MAX_K`]. Measured
/// on the H200 in a graph (`bench/gemv/gemv_bench.cu`): the staged kernel
/// wins 15-25% on the small GEMVs of 135M-1B models and loses 5-30% where
/// the register kernel already has two or more blocks per SM, or K is
/// 9728 and more. `KILN_GEMV_STAGED=0` at compile time turns it off (for
/// measuring).
pub const GEMV_STAGED_MAX_BLOCKS: u32 = 256;
/// The largest K the staged GEMV is chosen for (see [`GEMV_STAGED_MAX_BLOCKS`]).
pub const GEMV_STAGED_MAX_K: u32 = 8192;

fn gemv_staged_enabled() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("KILN_GEMV_STAGED").map_or(true, |v| v.trim() != "0"))
}

/// Whether a `t`-token GEMV of `n` rows and `k` inputs runs the staged
/// kernel, and its split factor: 4 for at most 2048 rows (128 blocks) when
/// every lane of the split has a vector, else 2 when it has, else 1. On
/// targets without cp.async (HIP) the staged entry points run the register
/// kernel with the same split, so the choice is valid everywhere.
pub fn gemv_staged_applies(t: u32, n: u32, k: u32) -> Option<u32> {
    if t != 1 || k > GEMV_STAGED_MAX_K || n.div_ceil(GEMV_ROWS_PER_BLOCK) >= GEMV_STAGED_MAX_BLOCKS
    {
        return None;
    }
    let kv = k / 8;
    Some(if n <= 2048 && kv >= 4 * KILN_WARP {
        4
    } else if kv >= 2 * KILN_WARP {
        2
    } else {
        1
    })
}

/// Whether kiln's GEMV of `t` tokens over `n` rows of `k` runs staged, and
/// its split factor (16 / split rows per block): what [`gemv_call`] and the
/// dense `matmul_qkv_rope` launch both take.
fn gemv_split(t: u32, n: u32, k: u32) -> (bool, u32) {
    let staged = gemv_staged_enabled()
        .then(|| gemv_staged_applies(t, n, k))
        .flatten();
    (
        staged.is_some(),
        staged.unwrap_or_else(|| gemv_ksplit(n, k, gemv_min_blocks())),
    )
}

/// kiln's GEMV kernel (`gemv.cu`) for `g` when it applies (T <= 8, bf16/f16
/// inputs, K a multiple of 8): a decode-shaped GEMM that is one pass over
/// the weights; used where [`choose_gemm`] records `gemv`. `w_const`: the weight operand is a weight whose
/// bytes never change during a step (not an activation), so the kernel may
/// load it before waiting for the kernel that produced `x`.
pub fn gemv_call(g: &GemmCall, w_const: bool) -> Option<KernelCall> {
    let i = match g.dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => return None,
    };
    let o = match g.out {
        DType::F32 => "f32",
        d if d == g.dtype => i,
        _ => return None,
    };
    let tt = GEMV_TOKENS.into_iter().find(|&tt| tt >= g.t)?;
    if g.k == 0 || !g.k.is_multiple_of(8) || g.n == 0 || i32::try_from(g.n).is_err() {
        return None;
    }
    let (staged, ks) = gemv_split(g.t, g.n, g.k);
    let kind = if staged { "staged_" } else { "" };
    Some(KernelCall {
        module: "gemv",
        entry: format!("gemv_{kind}{}t{tt}_{i}_{o}", ksplit_prefix(ks)),
        grid: [g.n.div_ceil(GEMV_ROWS_PER_BLOCK / ks), 1, 1],
        block: [256, 1, 1],
        shared_bytes: 0,
        cluster: 1,
        params: vec![
            Param::Arg(0),
            Param::Arg(1),
            if g.bias { Param::Arg(2) } else { Param::Null },
            Param::Result(0),
            Param::I32(g.t as i32),
            Param::I32(g.n as i32),
            Param::I32(g.k as i32),
            Param::I32(w_const as i32),
        ],
    })
}

/// The most tokens the fused GEMV (`fused_matmul`) takes: the largest
/// instantiated token count. Larger steps keep their unfused ops (the
/// `fuse-matmul` pass asks [`fused_matmul_call`] before it fuses).
pub const FUSED_MAX_TOKENS: u32 = 8;

/// The fused launch of a `fused_matmul` with operand types `args`. One
/// token: the fused GEMV (see `gemv.cu`), one warp per two weight rows
/// (per output under an activation epilogue, whose rows are `j` and
/// `j + N/2`), 16 outputs (8) per block. Two to eight tokens: the fused
/// skinny GEMM on tensor cores (`skinny.cu`, [`skinny_fused_call`]), which
/// reads each weight byte once where the register GEMV re-reads x per row
/// pair and runs out of FMA throughput. The `argmax` epilogue keeps the
/// GEMV at every token count. `w_const` as for [`gemv_call`]. Refuses what the kernel
/// cannot run: activations other than bf16/f16, an f32 result with an
/// epilogue other than `argmax`, more than [`FUSED_MAX_TOKENS`] tokens, `K % 8 != 0`, sizes
/// beyond the 32-bit index range.
pub fn fused_matmul_call(
    op: &Op,
    args: &[TensorType],
    w_const: bool,
) -> Result<KernelCall, CatalogError> {
    fused_matmul_launch(op, args, if w_const { u32::MAX } else { 0 })
}

/// [`fused_matmul_call`] with the op's weight operands named one by one:
/// bit `i` of `weight_args` ([`kiln_ir::plan::PlanOp::weight_args`]) set
/// when argument `i` is a weight. The kernel loads the first vectors of
/// the weight (argument 1) and of the prologue's norm weight before its
/// dependency wait when they are weights (its `consts` bits 0 and 1).
pub fn fused_matmul_launch(
    op: &Op,
    args: &[TensorType],
    weight_args: u32,
) -> Result<KernelCall, CatalogError> {
    let m = "fused_matmul";
    let unsupported = |why: String| CatalogError::Unsupported { op: m, why };
    if let Some(q) = args.get(1).and_then(|w| w.storage) {
        return Err(unsupported(format!(
            "the fused GEMV reads dense weights; a {} weight runs the quantized fused entries (`fused_matmul_runs`, `lower_op`)",
            q.name()
        )));
    }
    let Op::FusedMatMul {
        bias,
        out,
        pre,
        post,
    } = op
    else {
        return Err(unsupported(format!(
            "not a fused matmul: `{}`",
            op.mnemonic()
        )));
    };
    if !op.arity().contains(&args.len()) {
        return Err(unsupported(format!("got {} argument(s)", args.len())));
    }
    let (x, w) = (args[0].shape.dims(), args[1].shape.dims());
    let (&[t, k], &[n, _]) = (x, w) else {
        return Err(unsupported("x and the weight must have rank 2".into()));
    };
    let i = match args[0].dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        d => {
            return Err(unsupported(format!(
                "the fused GEMV reads bf16 or f16 activations, got {d}; compile without the `fuse-matmul` pass"
            )))
        }
    };
    let o = match (*out, post) {
        (DType::F32, Epilogue::None | Epilogue::Argmax) => "f32",
        (d, _) if d == args[0].dtype => i,
        (d, _) => {
            return Err(unsupported(format!(
                "result dtype {d} with the `{}` epilogue (f32 results only without an epilogue)",
                post.name()
            )))
        }
    };
    let Some(tt) = GEMV_TOKENS.into_iter().find(|&tt| tt >= t) else {
        return Err(unsupported(format!(
            "{t} tokens exceed the fused GEMV's {FUSED_MAX_TOKENS}; such keys keep the unfused ops (cuBLASLt)"
        )));
    };
    if k == 0 || !k.is_multiple_of(8) {
        return Err(unsupported(format!(
            "the inner dimension {k} must be a positive multiple of 8 (16-byte rows)"
        )));
    }
    if n == 0 || i32::try_from(n).is_err() || i32::try_from(k).is_err() {
        return Err(unsupported(format!(
            "{n} x {k} weights are outside the kernel's 32-bit index range"
        )));
    }
    if *post == Epilogue::Argmax {
        return Ok(fused_argmax_call(
            (t, n, k),
            tt,
            (i, o),
            *bias,
            *pre,
            consts(weight_args, *bias, pre.is_some()),
        ));
    }
    let act = matches!(post, Epilogue::SiluMul | Epilogue::GeluTanhMul);
    if t > 1 {
        return Ok(skinny_fused_call(
            (t, n, k),
            (i, o),
            act,
            *bias,
            *pre,
            *post == Epilogue::Residual,
            post_mode(*post),
            consts(weight_args, *bias, pre.is_some()),
        ));
    }
    // One token over a weight the plain GEMV would stage: the staged fused
    // entry with the plain GEMV's split (its grid counts 16 / split
    // virtual rows per block, an activation's outputs twice).
    let staged = match gemv_split(t, n, k) {
        (true, ks) if o == i => Some(ks),
        _ => None,
    };
    let grid = match staged {
        Some(ks) => n.div_ceil(GEMV_ROWS_PER_BLOCK / ks),
        None if act => (n / 2).div_ceil(GEMV_ROWS_PER_BLOCK / 2),
        None => n.div_ceil(GEMV_ROWS_PER_BLOCK),
    };
    let norm = if pre.is_some() { "norm_" } else { "" };
    Ok(KernelCall {
        module: "gemv",
        entry: match staged {
            Some(ks) => format!("gemv_staged_fused_{norm}{}t1_{i}_{o}", ksplit_prefix(ks)),
            None => format!("gemv_fused_{norm}t{tt}_{i}_{o}"),
        },
        grid: [grid, 1, 1],
        block: [256, 1, 1],
        shared_bytes: 0,
        cluster: 1,
        params: fused_params(
            (t, n, k),
            *bias,
            *pre,
            *post == Epilogue::Residual,
            consts(weight_args, *bias, pre.is_some()),
            post_mode(*post),
        ),
    })
}

/// The fused kernels' epilogue `mode` (gemv.cu, skinny.cu): 0 none, 1
/// silu_mul, 2 gelu_tanh_mul, 3 residual (`argmax` has its own entries).
fn post_mode(post: Epilogue) -> i32 {
    match post {
        Epilogue::None | Epilogue::Argmax => 0,
        Epilogue::SiluMul => 1,
        Epilogue::GeluTanhMul => 2,
        Epilogue::Residual => 3,
    }
}

/// The fused skinny GEMM (`skinny.cu`, `skinny_fused_[norm_]t8_r<MT>`) for
/// a `fused_matmul` of `t` in 2..=8 tokens: the plain skinny GEMM's
/// tensor-core product (each weight byte read once per launch, whatever
/// the token count) with the fused GEMV's prologue and epilogues. An
/// activation epilogue takes two row tiles per block (16 gate rows and
/// the 16 up rows `n / 2` further) and a grid over the `n / 2` outputs;
/// the others one tile of 16 rows. The split-K warps are the plain skinny
/// GEMM's ([`skinny_call`]).
#[allow(clippy::too_many_arguments)]
fn skinny_fused_call(
    (t, n, k): (u32, u32, u32),
    (i, o): (&str, &str),
    act: bool,
    bias: bool,
    pre: Option<kiln_ir::PreNorm>,
    residual: bool,
    mode: i32,
    consts: i32,
) -> KernelCall {
    let mt: u32 = if act { 2 } else { 1 };
    let chunks = k.div_ceil(32);
    // The one-tile RMSNorm entry holds 100 registers a thread (its x rows
    // beside the weights in flight), so a 16-warp block is alone on its SM
    // and a grid of more blocks than SMs runs in two waves (Llama-3.2-1B's
    // 192-block qkv at 700 GB/s, bench/results/gpu-2026-12-07-s40/); eight
    // warps put two blocks on an SM, one wave up to twice the SM count.
    let mut warps = if pre.is_some() && mt == 1 {
        8
    } else {
        skinny_max_warps(mt)
    };
    while warps > 1 && 2 * warps > chunks {
        warps /= 2;
    }
    let rows = if act { n / 2 } else { n };
    let norm = if pre.is_some() { "norm_" } else { "" };
    let (tile_rows, kept, h) = skinny_tile(skinny_half(rows, 8));
    KernelCall {
        module: "skinny",
        entry: format!("skinny_fused_{norm}t8_r{mt}{h}_{i}_{o}"),
        grid: [rows.div_ceil(tile_rows), 1, 1],
        block: [32 * warps, 1, 1],
        shared_bytes: warps * mt * kept * 32 * 4,
        cluster: 1,
        params: fused_params((t, n, k), bias, pre, residual, consts, mode),
    }
}

/// The parameters every fused GEMV / skinny entry takes (`gemv.cu`,
/// `skinny.cu`): x, w, then the bias, the prologue's norm weight and the
/// residual as the next arguments when present (null otherwise), the
/// result, the sizes, `consts`, eps, the (1 + w) flag and the epilogue mode.
fn fused_params(
    (t, n, k): (u32, u32, u32),
    bias: bool,
    pre: Option<kiln_ir::PreNorm>,
    residual: bool,
    consts: i32,
    mode: i32,
) -> Vec<Param> {
    let mut next = 2;
    let mut optional = |present: bool| {
        if present {
            next += 1;
            Param::Arg(next - 1)
        } else {
            Param::Null
        }
    };
    let bias_p = optional(bias);
    let norm_p = optional(pre.is_some());
    let res_p = optional(residual);
    let mut v = vec![
        Param::Arg(0),
        Param::Arg(1),
        bias_p,
        norm_p,
        res_p,
        Param::Result(0),
    ];
    v.extend(fused_sizes_tail((t, n, k), pre, consts));
    v.push(Param::I32(mode));
    v
}

/// The parameters every fused GEMV entry (plain, skinny and argmax) takes
/// after its pointers: the sizes, `consts`, the prologue's eps and its
/// (1 + w) flag.
fn fused_sizes_tail(
    (t, n, k): (u32, u32, u32),
    pre: Option<kiln_ir::PreNorm>,
    consts: i32,
) -> [Param; 6] {
    [
        Param::I32(t as i32),
        Param::I32(n as i32),
        Param::I32(k as i32),
        Param::I32(consts),
        Param::F32(pre.map_or(0.0, |p| p.eps)),
        Param::I32(pre.is_some_and(|p| p.unit_offset) as i32),
    ]
}

/// The fused GEMV kernels' `consts` flags for `weight_args` (bit `i` set
/// when argument `i` is a weight): bit 0 the weight (argument 1), bit 1 the
/// prologue's norm weight (argument 2, or 3 after a bias) may be read
/// before the dependency wait.
fn consts(weight_args: u32, bias: bool, norm: bool) -> i32 {
    let norm_at = 2 + bias as u32;
    (weight_args >> 1 & 1) as i32 | ((norm && weight_args >> norm_at & 1 == 1) as i32) << 1
}

/// Where the argmax GEMV's per-block `(max, index)` partials live in its
/// scratch for `t` tokens over `n` weight rows: the values (f32
/// `[t][blocks]`) at 0, the indices (i32, same layout) at the returned
/// offset (256-byte aligned); and the scratch bytes in all.
pub fn fused_argmax_scratch(t: u32, n: u32) -> (u64, u64) {
    let pairs = t as u64 * n.div_ceil(GEMV_ROWS_PER_BLOCK) as u64;
    let idx_offset = (pairs * 4).div_ceil(256) * 256;
    (idx_offset, idx_offset + pairs * 4)
}

/// The launch of a `fused_matmul` with the `argmax` epilogue (`gemv.cu`'s
/// `gemv_argmax_*`): the fused GEMV's blocks and rows (16 rows per block),
/// each block's `(max, first index)` per token to scratch, the last block
/// (completion counter 0) merging them into `i32[t]`. Shapes are checked
/// by [`fused_matmul_call`].
fn fused_argmax_call(
    (t, n, k): (u32, u32, u32),
    tt: u32,
    (i, o): (&str, &str),
    bias: bool,
    pre: Option<kiln_ir::PreNorm>,
    consts: i32,
) -> KernelCall {
    let (idx_offset, _) = fused_argmax_scratch(t, n);
    let norm = if pre.is_some() { "norm_" } else { "" };
    let mut params = vec![
        Param::Arg(0),
        Param::Arg(1),
        if bias { Param::Arg(2) } else { Param::Null },
        if pre.is_some() {
            Param::Arg(2 + bias as usize)
        } else {
            Param::Null
        },
        Param::Scratch(0),
        Param::Scratch(idx_offset),
        Param::Counters(0),
        Param::Result(0),
    ];
    params.extend(fused_sizes_tail((t, n, k), pre, consts));
    KernelCall {
        module: "gemv",
        entry: format!("gemv_argmax_{norm}t{tt}_{i}_{o}"),
        grid: [n.div_ceil(GEMV_ROWS_PER_BLOCK), 1, 1],
        block: [256, 1, 1],
        shared_bytes: 0,
        cluster: 1,
        params,
    }
}

/// A `fused_matmul`'s lowering: [`fused_matmul_call`] with the scratch and
/// completion counters it uses (those of the `argmax` epilogue, none for
/// the others).
pub fn fused_matmul_lowered(
    op: &Op,
    args: &[TensorType],
    weight_args: u32,
) -> Result<Lowered, CatalogError> {
    let call = fused_matmul_launch(op, args, weight_args)?;
    let (scratch_bytes, counters) = match op {
        Op::FusedMatMul {
            post: Epilogue::Argmax,
            ..
        } => {
            let (t, n) = (args[0].shape.dims()[0], args[1].shape.dims()[0]);
            (fused_argmax_scratch(t, n).1, 1)
        }
        _ => (0, 0),
    };
    Ok(Lowered::Kernels {
        calls: vec![call],
        scratch_bytes,
        counters,
    })
}

/// Padded token counts (multiples of 8) the skinny-GEMM kernels are
/// instantiated for.
const SKINNY_TOKENS: [u32; 4] = [8, 16, 24, 32];
/// Row tiles (16 rows each) per block the skinny-GEMM kernels take.
const SKINNY_ROW_TILES: [u32; 2] = [1, 2];
/// Most warps (split-K ways) of a skinny-GEMM block, per row tiles per block
/// (the kernels' `__launch_bounds__(512 / MT)`).
const fn skinny_max_warps(row_tiles: u32) -> u32 {
    16 / row_tiles
}

/// Below this many blocks of 16-row tiles, an eight-token skinny GEMM takes
/// half tiles of 8 rows (the `r<MT>h` entries) and twice the grid. Its
/// weight stream is what bounds it, and a block keeps its SM's loads in
/// flight only while there are blocks for every SM: an H100 SXM or H200
/// has 132, so a grid under 120 leaves a tenth of them or more idle (an
/// A100 has 108: its boundary grids lose a little). Session 40 measured
/// the 64-block o_proj/down of Qwen3-0.6B at b8 (1,024 rows) at 559 GB/s,
/// against 1,567 GB/s for the 1,536-block gate/up of Llama-3.2-1B
/// (bench/results/gpu-2026-12-07-s40/).
/// The lower half of each MMA then multiplies zero rows: tensor-core time
/// is not what an eight-token product waits for.
pub const SKINNY_HALF_BELOW: u32 = 120;

/// Whether an eight-token skinny GEMM over `rows` output rows (per tile:
/// the gate rows of an activation pair) takes half tiles.
pub const fn skinny_half(rows: u32, tp: u32) -> bool {
    tp == 8 && rows.div_ceil(16) < SKINNY_HALF_BELOW
}

/// A skinny block's tile: its rows, the accumulators a lane keeps of each
/// MMA (all four, or the first two of a half tile, whose rows g + 8 are
/// zeros) and the entry-name suffix.
const fn skinny_tile(half: bool) -> (u32, u32, &'static str) {
    if half {
        (8, 2, "h")
    } else {
        (16, 4, "")
    }
}

/// kiln's tensor-core skinny GEMM (`kernels/gpu/skinny.cu`) for `g` when
/// it applies (T <= 32, bf16/f16 inputs, output of the input dtype or f32,
/// K a multiple of 8). `w_const` as for [`gemv_call`].
///
/// Geometry, all from the shape (documented in the kernel's header):
/// * tokens padded to `tp = 8 * ceil(T / 8)` (the MMA's 8 columns);
/// * `mt` row tiles of 16 per block: 2 when `tp >= 24` and there are at
///   least 256 such 32-row blocks (x is then re-read from L2 half as often
///   and the grid still fills the chip), else 1;
/// * at eight tokens, one half tile of 8 rows (`skinny_t8_r1h`) instead
///   where the 16-row grid is under [`SKINNY_HALF_BELOW`] blocks;
/// * `warps` split K per block: the largest power of two up to
///   16 / `mt` that still gives every warp two 32-wide k-chunks (one loop
///   iteration); at least 1;
/// * dynamic shared memory for the split-K partials:
///   `warps * mt * (tp / 8) * 4 * 32` f32 (`* 2 * 32` for a half tile).
pub fn skinny_call(g: &GemmCall, w_const: bool) -> Option<KernelCall> {
    let i = match g.dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => return None,
    };
    let o = match g.out {
        DType::F32 => "f32",
        d if d == g.dtype => i,
        _ => return None,
    };
    if g.t == 0 || g.t > 32 || g.k == 0 || !g.k.is_multiple_of(8) || g.n == 0 {
        return None;
    }
    if i32::try_from(g.n).is_err() || i32::try_from(g.k).is_err() {
        return None;
    }
    let tp = g.t.div_ceil(8) * 8;
    let mt = if tp >= 24 && g.n.div_ceil(32) >= 256 {
        2
    } else {
        1
    };
    let chunks = g.k.div_ceil(32);
    let mut warps = skinny_max_warps(mt);
    while warps > 1 && 2 * warps > chunks {
        warps /= 2;
    }
    let (tile_rows, kept, h) = skinny_tile(mt == 1 && skinny_half(g.n, tp));
    let shared = warps * mt * (tp / 8) * kept * 32 * 4;
    Some(KernelCall {
        module: "skinny",
        entry: format!("skinny_t{tp}_r{mt}{h}_{i}_{o}"),
        grid: [g.n.div_ceil(tile_rows * mt), 1, 1],
        block: [32 * warps, 1, 1],
        shared_bytes: shared,
        cluster: 1,
        params: vec![
            Param::Arg(0),
            Param::Arg(1),
            if g.bias { Param::Arg(2) } else { Param::Null },
            Param::Result(0),
            Param::I32(g.t as i32),
            Param::I32(g.n as i32),
            Param::I32(g.k as i32),
            Param::I32(w_const as i32),
        ],
    })
}

/// The launch of kiln's kernel for `kind` on `g` (`None` for `Blas`, or
/// when that kernel does not take the shape).
pub fn gemm_kernel_call(kind: GemmKind, g: &GemmCall, w_const: bool) -> Option<KernelCall> {
    match kind {
        GemmKind::Gemv => gemv_call(g, w_const),
        GemmKind::Skinny => skinny_call(g, w_const),
        GemmKind::Blas => None,
    }
}

/// Whether `kind` can run `g` on `target`.
pub fn gemm_kind_applies(kind: GemmKind, target: &Target, g: &GemmCall) -> bool {
    match kind {
        GemmKind::Blas => true,
        GemmKind::Gemv => gemv_call(g, false).is_some(),
        GemmKind::Skinny => {
            skinny_call(g, false).is_some() && !matches!(target, Target::Cuda { sm } if *sm < 80)
        }
    }
}

/// The GEMM implementation a target uses without a tuning table:
///
/// `gemv` for one token, `blas` above (and for any shape kiln's kernels do
/// not take: f32, K not a multiple of 8), on every GPU target. Measured on
/// the H200 (bench/results/gpu-2026-12-01-s6/): kiln's GEMV at 8 tokens is
/// 1.3-2.7x slower per step than cuBLASLt, and the tensor-core `skinny`
/// GEMM, correct, is not yet faster than cuBLASLt at 32 tokens; both are
/// chosen only by a tuning table until they win.
///
/// `kiln tune` measures the candidates per shape and `kiln compile
/// --tuning` overrides this rule where a table entry is current.
pub fn default_gemm_kind(target: &Target, g: &GemmCall) -> GemmKind {
    if g.t == 1 && gemm_kind_applies(GemmKind::Gemv, target, g) {
        GemmKind::Gemv
    } else {
        GemmKind::Blas
    }
}

/// The implementation `opts` picks for `g`: a tuned entry when it applies,
/// otherwise [`default_gemm_kind`].
pub fn choose_gemm(g: &GemmCall, opts: &LowerOptions) -> GemmKind {
    if opts.prefer_gemv && gemm_kind_applies(GemmKind::Gemv, &opts.target, g) {
        return GemmKind::Gemv;
    }
    opts.tuned
        .get(g)
        .copied()
        .filter(|&k| gemm_kind_applies(k, &opts.target, g))
        .unwrap_or_else(|| default_gemm_kind(&opts.target, g))
}

/// A fingerprint of what a GEMM timing depends on in kiln: FNV-1a over
/// `kiln_port.h`, `gemv.cu`, `skinny.cu` and [`GEMM_GEOMETRY_REVISION`]. A
/// tuning table records it per entry; an entry under another fingerprint is
/// stale (the kernels or their geometry changed) and is ignored.
pub fn gemm_fingerprint() -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let rev = GEMM_GEOMETRY_REVISION.to_string();
    let parts = [
        PORT_HEADER,
        include_str!("../gpu/gemv.cu"),
        include_str!("../gpu/skinny.cu"),
        rev.as_str(),
    ];
    for part in parts {
        for b in (part.len() as u64)
            .to_le_bytes()
            .iter()
            .chain(part.as_bytes())
        {
            h = (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Bump when [`gemv_call`]'s or [`skinny_call`]'s geometry (grid, block,
/// shared memory, instantiation choice) changes: tuning tables measured
/// under the old geometry become stale.
pub const GEMM_GEOMETRY_REVISION: u32 = 3;

/// Every entry point a module defines (after macro expansion), so a backend
/// can resolve them all when it loads the module and fail early.
pub fn entry_points(module: &str) -> Vec<String> {
    let mut v = Vec::new();
    let per_float = |v: &mut Vec<String>, names: &[&str]| {
        for s in FLOAT_SUFFIXES {
            for n in names {
                v.push(format!("{n}_{s}"));
            }
        }
    };
    match module {
        "norm" => per_float(&mut v, &["rms_norm", "add_rms_norm", "head_rms_norm"]),
        "rope" => per_float(&mut v, &["rope", "kv_write", "qkv_rope_kv_write"]),
        "attention" => {
            for s in FLOAT_SUFFIXES {
                for rt in ATTN_ROW_TILES {
                    for vec in [8, 1] {
                        v.push(format!("paged_attn_part_r{rt}_v{vec}_{s}"));
                    }
                    v.push(format!("paged_attn_stream_r{rt}_{s}"));
                    v.push(format!("paged_attn_rope_stream_r{rt}_{s}"));
                }
            }
        }
        "elementwise" => {
            per_float(
                &mut v,
                &[
                    "embedding",
                    "silu_mul",
                    "gelu_tanh_mul",
                    "add",
                    "gather_last",
                    "scale",
                ],
            );
            v.push("gather_last_i32".into());
        }
        "gemv" => {
            for (i, o) in GEMV_TYPES {
                for tt in GEMV_TOKENS {
                    for ks in GEMV_KSPLITS {
                        v.push(format!("gemv_{}t{tt}_{i}_{o}", ksplit_prefix(ks)));
                    }
                }
            }
            for (i, o) in GEMV_TYPES {
                for ks in GEMV_KSPLITS {
                    v.push(format!("gemv_staged_{}t1_{i}_{o}", ksplit_prefix(ks)));
                }
            }
            for s in ["bf16", "f16"] {
                for staged in ["", "staged_"] {
                    for ks in GEMV_KSPLITS {
                        v.push(format!("gemv_{staged}{}rope_t1_{s}_{s}", ksplit_prefix(ks)));
                    }
                }
            }
            for s in ["bf16", "f16"] {
                for ks in GEMV_KSPLITS {
                    for norm in ["", "norm_"] {
                        v.push(format!(
                            "gemv_staged_fused_{norm}{}t1_{s}_{s}",
                            ksplit_prefix(ks)
                        ));
                    }
                }
            }
            for (i, o) in GEMV_TYPES {
                for tt in GEMV_TOKENS {
                    v.push(format!("gemv_fused_t{tt}_{i}_{o}"));
                    v.push(format!("gemv_fused_norm_t{tt}_{i}_{o}"));
                }
            }
            for (i, o) in GEMV_TYPES {
                for tt in GEMV_TOKENS {
                    v.push(format!("gemv_argmax_t{tt}_{i}_{o}"));
                    v.push(format!("gemv_argmax_norm_t{tt}_{i}_{o}"));
                }
            }
        }
        "skinny" => {
            for (i, o) in GEMV_TYPES {
                for mt in SKINNY_ROW_TILES {
                    for tp in SKINNY_TOKENS {
                        v.push(format!("skinny_t{tp}_r{mt}_{i}_{o}"));
                    }
                    for norm in ["", "norm_"] {
                        v.push(format!("skinny_fused_{norm}t8_r{mt}_{i}_{o}"));
                        v.push(format!("skinny_fused_{norm}t8_r{mt}h_{i}_{o}"));
                    }
                }
                v.push(format!("skinny_t8_r1h_{i}_{o}"));
            }
        }
        "sampling" => {
            per_float(&mut v, &["argmax_chunk"]);
            v.push("argmax_final".into());
            v.push("accept_greedy".into());
            per_float(&mut v, &["sample", "sample_pen"]);
        }
        crate::quant_gpu::MODULE => v = crate::quant_gpu::entry_points(),
        crate::quant_gpu::QSKINNY_MODULE => v = crate::quant_gpu::qskinny_entry_points(),
        _ => {}
    }
    v
}

/// The catalog name of the kernel that runs `op` on activations of `dtype`
/// (what the compiler writes into `PlanOp::kernel`): `gemm` for matmuls,
/// otherwise `<mnemonic>_<dtype>` (`accept_greedy` has no dtype).
pub fn kernel_name(op: &Op, dtype: DType) -> String {
    match op {
        Op::MatMul { .. } => "gemm".into(),
        Op::AcceptGreedy { .. } => "accept_greedy".into(),
        _ => format!("{}_{}", op.mnemonic(), dtype.name()),
    }
}

/// One kernel parameter, described symbolically.
#[derive(Clone, Debug, PartialEq)]
pub enum Param {
    /// Device address of argument `i`.
    Arg(usize),
    /// Device address of result `i`.
    Result(usize),
    /// Device address `offset` bytes into the op's scratch buffer.
    Scratch(u64),
    /// Device address of completion counter `i` (u32, zero between
    /// launches: the kernel that uses them resets them).
    Counters(u32),
    /// A null device pointer (an absent optional operand).
    Null,
    I32(i32),
    I64(i64),
    F32(f32),
    /// A by-value struct, laid out as the kernel declares it.
    Blob(Vec<u8>),
}

impl Param {
    /// Bytes of the parameter as the kernel receives it.
    pub fn size(&self) -> usize {
        match self {
            Param::Arg(_)
            | Param::Result(_)
            | Param::Scratch(_)
            | Param::Counters(_)
            | Param::Null
            | Param::I64(_) => 8,
            Param::I32(_) | Param::F32(_) => 4,
            Param::Blob(b) => b.len(),
        }
    }
}

/// One kernel launch.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelCall {
    pub module: &'static str,
    pub entry: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Dynamic shared memory bytes.
    pub shared_bytes: u32,
    /// Blocks per thread-block cluster along x (1: none); see
    /// `KernelLaunch::cluster`.
    pub cluster: u32,
    pub params: Vec<Param>,
}

/// A GEMM `out[t, n] = x[t, k] @ w[n, k]^T (+ bias[n])`, row-major operands:
/// the plan's [`GemmShape`] (one description of a matmul shape everywhere).
pub type GemmCall = GemmShape;

/// How an op runs on a GPU.
#[derive(Clone, Debug, PartialEq)]
pub enum Lowered {
    /// Kernel launches in stream order, the scratch bytes they need (a
    /// backend-owned buffer, allocated before capture; its contents do not
    /// survive the op) and the completion counters they use (a separate,
    /// zero-initialized backend buffer that the kernels leave zeroed).
    Kernels {
        calls: Vec<KernelCall>,
        scratch_bytes: u64,
        counters: u32,
    },
    /// One BLAS call.
    Gemm(GemmCall),
    /// One collective-library call (NCCL) over the plan's ranks.
    Collective,
}

impl Lowered {
    /// Launches the op costs (a GEMM counts one).
    pub fn launches(&self) -> u32 {
        match self {
            Lowered::Kernels { calls, .. } => calls.len() as u32,
            Lowered::Gemm(_) | Lowered::Collective => 1,
        }
    }
}

/// Facts about operand placement that change the lowering.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// Result 0 overlaps argument 0 in memory (in-place reuse by the planner).
    pub result0_overlaps_arg0: bool,
}

/// The op cannot run with these operands on the GPU kernels.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CatalogError {
    #[error("gpu kernel for `{op}`: {why}")]
    Unsupported { op: &'static str, why: String },
}

/// The largest head dim RoPE kernels take (the frequency table is passed by
/// value, `head_dim / 2` f32).
pub const ROPE_MAX_HEAD_DIM: u32 = 256;
/// The largest head dim `head_rms_norm` takes (16 elements per lane).
pub const HEAD_NORM_MAX_HEAD_DIM: u32 = 512;
/// Threads of an attention partition block.
pub const ATTN_THREADS: u32 = 128;
/// Lanes of a warp, as the kernels are written (`KILN_WARP`).
const KILN_WARP: u32 = 32;
/// Upper bound on attention partitions per sequence.
pub const ATTN_MAX_PARTS: u32 = 256;
/// The most partitions one thread-block cluster of the attention kernel
/// holds (`KILN_ATTN_MAX_CLUSTER` in attention.cu; sm_90's non-portable
/// cluster limit, [`kiln_ir::plan::MAX_CLUSTER`]).
pub const ATTN_MAX_CLUSTER: u32 = 16;
/// Threads of the `sample` kernel's one block per row.
pub const SAMPLE_THREADS: u32 = 1024;

/// Elements of a row one block of the argmax's first stage scans.
pub const ARGMAX_CHUNK: u32 = 4096;
/// Attention blocks the partition size aims for by default (about two per
/// SM of an H100/H200). With the streaming kernel, 256 matched 1024 at b1
/// and beat it by 8% at b32 on the H200 (Qwen3-0.6B shape, context 512:
/// `bench/results/gpu-2026-11-29-s4/`); shorter partitions only add
/// combine work once each block keeps enough K/V loads in flight.
pub const ATTN_TARGET_BLOCKS: u64 = 256;

/// The attention block target of the run-time [`lower`]:
/// `KILN_ATTN_TARGET_BLOCKS` when set to a positive integer, else
/// [`ATTN_TARGET_BLOCKS`]. Plans choose theirs at compile time
/// (`kiln compile --attn-target-blocks`, [`LowerOptions`]).
pub fn attn_target_blocks() -> u64 {
    static TARGET: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TARGET.get_or_init(|| {
        std::env::var("KILN_ATTN_TARGET_BLOCKS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|&v| v > 0)
            .unwrap_or(ATTN_TARGET_BLOCKS)
    })
}
/// Shared memory a block may use without an opt-in.
pub const MAX_STATIC_SHARED: u32 = 48 * 1024;

fn float_suffix(op: &'static str, d: DType) -> Result<&'static str, CatalogError> {
    match d {
        DType::BF16 => Ok("bf16"),
        DType::F16 => Ok("f16"),
        DType::F32 => Ok("f32"),
        DType::I32 => Err(CatalogError::Unsupported {
            op,
            why: "operands must be bf16, f16 or f32, got i32".into(),
        }),
    }
}

fn to_i32(op: &'static str, what: &str, v: u64) -> Result<i32, CatalogError> {
    i32::try_from(v).map_err(|_| CatalogError::Unsupported {
        op,
        why: format!("{what} = {v} exceeds the kernels' 32-bit index range"),
    })
}

fn blocks(n: u64, per: u32) -> Result<u32, CatalogError> {
    let b = n.div_ceil(per as u64).max(1);
    u32::try_from(b).map_err(|_| CatalogError::Unsupported {
        op: "launch",
        why: format!("{n} work items need more than 2^32 blocks"),
    })
}

/// Threads for a one-block-per-row kernel over rows of `h` elements.
fn row_threads(h: u32) -> u32 {
    (h.div_ceil(4)).next_power_of_two().clamp(32, 1024)
}

fn call(
    module: &'static str,
    entry: String,
    grid: [u32; 3],
    block: u32,
    params: Vec<Param>,
) -> KernelCall {
    KernelCall {
        module,
        entry,
        grid,
        block: [block, 1, 1],
        shared_bytes: 0,
        cluster: 1,
        params,
    }
}

/// The RoPE frequency table as the kernels' by-value `RopeFreqs` struct:
/// `head_dim / 2` f32 (rounded from the plan's f64 table), zero-padded to 128.
pub fn rope_freqs_blob(rope: &Rope, head_dim: u32) -> Vec<u8> {
    let mut out = vec![0u8; (ROPE_MAX_HEAD_DIM / 2) as usize * 4];
    for (i, f) in rope.inv_freq(head_dim).iter().enumerate() {
        out[i * 4..i * 4 + 4].copy_from_slice(&(*f as f32).to_ne_bytes());
    }
    out
}

/// Dynamic shared memory of `paged_attn_rope_stream_*` for a lowered
/// streaming attention launch `part`: its own, or the new K/V rows
/// (`query` of each, `elem`-byte elements) after the cluster state region,
/// as `attn_stream` lays them out. `None` when that passes the
/// 48 KiB a launch may take without opting in (the unfused pair runs then).
pub fn rope_attention_shared_bytes(
    part: &KernelCall,
    query: u32,
    head_dim: u32,
    elem: u64,
) -> Option<u32> {
    let shape = match part.params.get(9) {
        Some(Param::Blob(b)) if b.len() >= 64 => b,
        _ => return None,
    };
    let word = |i: usize| i32::from_ne_bytes(shape[i * 4..i * 4 + 4].try_into().unwrap_or([0; 4]));
    // AttnShape: batch, query, heads, kv_heads, head_dim, block_size,
    // max_blocks, window, scale, softcap, part_len, num_parts, tiles, tg,
    // want_parts, cluster.
    let (part_len, cluster) = (word(10) as u64, word(15));
    let rt = part
        .entry
        .strip_prefix("paged_attn_stream_r")?
        .split('_')
        .next()?
        .parse::<u64>()
        .ok()?;
    let (hd, warps) = (head_dim as u64, (ATTN_THREADS / KILN_WARP) as u64);
    let mut floats = rt * hd + part_len + warps * rt * (hd + 2);
    if cluster > 1 {
        floats += attention_gather_floats(rt, hd);
    }
    let floats = floats.div_ceil(8) * 8;
    let bytes = (floats * 4 + 2 * query as u64 * hd * elem).max(part.shared_bytes as u64);
    (bytes <= MAX_STATIC_SHARED as u64).then_some(bytes as u32)
}

/// Floats of the streaming attention kernel's cluster gather region for
/// `rt`-row tiles of head dim `hd` (`attention.cu`, `attn_gather_per`): the
/// accumulator slices every member of a cluster pushes to the member that
/// merges them (at most `rt * hd` plus one rounding per member), then each
/// member's (max, sum) per row.
pub fn attention_gather_floats(rt: u64, hd: u64) -> u64 {
    let c = ATTN_MAX_CLUSTER as u64;
    rt * hd + c * (1 + 2 * rt)
}

/// Geometry of one paged-attention op (see `attention.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnGeometry {
    /// The streaming partition kernel (`paged_attn_stream_*`: head_dim a
    /// multiple of 8, at most 256) rather than the phased one.
    pub stream: bool,
    /// Query rows per partition block (1, 2, 4 or 8).
    pub row_tile: u32,
    /// Row tiles per (sequence, kv head).
    pub tiles: u32,
    /// Elements per vector load (8 when `head_dim % 8 == 0`, else 1).
    pub vec: u32,
    /// Lanes sharing one key in the score phase.
    pub tg: u32,
    /// Context positions per partition.
    pub part_len: u32,
    /// Partitions the grid spans.
    pub num_parts: u32,
    /// Partitions a step's actual context is spread over (at most
    /// `num_parts`): the kernel cuts the context it reads from device
    /// memory into this many pieces of at least one pass of its key loop
    /// and at most `part_len` positions, so a short context still gives
    /// the chip about `target_blocks` blocks.
    pub want_parts: u32,
    /// Partitions per thread-block cluster (1: none). With clusters (CUDA
    /// sm_90, the streaming kernel) the partitions of one cluster merge
    /// their softmax states through distributed shared memory (a
    /// reduce-scatter: each member merges a slice, see `attention.cu`),
    /// without the scratch round trip, fence and completion counter of the
    /// plain combine; only a context spread over more than one cluster still
    /// combines the clusters' states through scratch. `num_parts` is a
    /// multiple of it.
    pub cluster: u32,
    /// Dynamic shared memory of the partition kernel.
    pub shared_bytes: u32,
    /// Byte offset of the (max, sum) pairs in scratch.
    pub ml_offset: u64,
    /// Scratch bytes (partial accumulators, then (max, sum) pairs).
    pub scratch_bytes: u64,
}

/// Chooses the paged-attention geometry for `batch` sequences of `query`
/// tokens and block tables `max_blocks` wide.
#[allow(clippy::too_many_arguments)]
pub fn attention_geometry(
    batch: u32,
    query: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    max_blocks: u32,
) -> Result<AttnGeometry, CatalogError> {
    attention_geometry_for(
        batch,
        query,
        heads,
        kv_heads,
        head_dim,
        block_size,
        max_blocks,
        attn_target_blocks(),
        false,
    )
}

/// [`attention_geometry`] aiming at `target_blocks` attention blocks (the
/// compile option `--attn-target-blocks`) instead of the environment's;
/// `clusters`: the target launches thread-block clusters (CUDA sm_90 and
/// later, [`LowerOptions::attn_clusters`]).
#[allow(clippy::too_many_arguments)]
pub fn attention_geometry_for(
    batch: u32,
    query: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    max_blocks: u32,
    target_blocks: u64,
    clusters: bool,
) -> Result<AttnGeometry, CatalogError> {
    let op = "paged_attention";
    let unsupported = |why: String| CatalogError::Unsupported { op, why };
    let group = heads / kv_heads;
    let rows = group * query;
    let row_tile = ATTN_ROW_TILES
        .into_iter()
        .find(|&rt| rt >= rows)
        .unwrap_or(8);
    let tiles = rows.div_ceil(row_tile);
    let vec = if head_dim.is_multiple_of(8) { 8 } else { 1 };
    let nch = head_dim / vec;
    if nch == 0 || nch > ATTN_THREADS {
        return Err(unsupported(format!(
            "head_dim {head_dim} is not supported (at most {} when a multiple of 8, else at most {})",
            ATTN_THREADS * 8,
            ATTN_THREADS
        )));
    }
    let tg = nch.next_power_of_two().min(32);
    let max_ctx = max_blocks as u64 * block_size as u64;
    // The largest partition that still gives the chip enough blocks, at
    // least 32 positions, and never more than ATTN_MAX_PARTS partitions.
    let base_blocks = batch as u64 * kv_heads as u64 * tiles as u64;
    let mut part_len: u64 = 512;
    let target = target_blocks.max(1);
    while part_len > 32 && base_blocks * max_ctx.div_ceil(part_len) < target {
        part_len /= 2;
    }
    if max_ctx.div_ceil(part_len) > ATTN_MAX_PARTS as u64 {
        part_len = max_ctx.div_ceil(ATTN_MAX_PARTS as u64).div_ceil(32) * 32;
    }
    let mut num_parts = max_ctx.div_ceil(part_len).max(1);
    let want_parts = target.div_ceil(base_blocks.max(1)).clamp(1, num_parts);
    let npl = (ATTN_THREADS / nch) as u64;
    let (rt, hd) = (row_tile as u64, head_dim as u64);
    // The streaming kernel (K and V loaded together, online softmax in
    // registers) needs one 8-element chunk per lane.
    let stream = vec == 8 && nch <= KILN_WARP;
    // A cluster holds as many partitions as a step may spread a context
    // over, up to the hardware's limit: a context then combines inside one
    // cluster (measured on the H200 with bench/attn/attn_bench.cu: a short
    // context split over two clusters of 8 is slower than no cluster).
    // The cluster combine's gather region (attention_gather_floats) must
    // fit beside the streaming kernel's shared memory; where it does not
    // (head_dim 256 with 8-row tiles), the plain combine runs.
    let warps = (ATTN_THREADS / KILN_WARP) as u64;
    let stream_floats = rt * hd + part_len + warps * rt * (hd + 2);
    let fits = (stream_floats + attention_gather_floats(rt, hd)).max(rt * (num_parts + 1)) * 4
        <= MAX_STATIC_SHARED as u64;
    // Clusters of fewer than 4 partitions measured slower than the plain
    // combine (SmolLM2-135M b32: 3 partitions, 16.2 us plain, 18.4 us with
    // clusters of 2), so those stay plain.
    let cluster = match (want_parts.min(ATTN_MAX_CLUSTER as u64) + 1).next_power_of_two() / 2 {
        c if clusters && stream && fits && c >= 4 => c,
        _ => 1,
    };
    num_parts = num_parts.div_ceil(cluster) * cluster;
    let partition = if stream {
        // q rows, the slot of each position, each warp's (acc, m, l), then
        // (clusters) the gather region of the members' pushed states.
        let cres = if cluster > 1 {
            attention_gather_floats(rt, hd)
        } else {
            0
        };
        stream_floats + cres
    } else {
        // Phase 1: q rows, scores and the slot of each position; phase 2:
        // the per-position-lane partial sums of V.
        (rt * hd + rt * part_len + part_len).max(npl * rt * hd)
    };
    // Then (the last block): partition weights and 1/L per row.
    let floats = partition.max(rt * (num_parts + 1));
    let shared = floats * 4;
    if shared > MAX_STATIC_SHARED as u64 {
        return Err(unsupported(format!(
            "needs {shared} bytes of shared memory (head_dim {head_dim}, {part_len} positions per partition); at most {MAX_STATIC_SHARED}"
        )));
    }
    let row_parts = batch as u64 * query as u64 * heads as u64 * num_parts;
    let acc_bytes = row_parts * hd * 4;
    let ml_offset = acc_bytes.div_ceil(256) * 256;
    let scratch_bytes = ml_offset + row_parts * 2 * 4;
    Ok(AttnGeometry {
        stream,
        row_tile,
        tiles,
        vec,
        tg,
        part_len: part_len as u32,
        num_parts: num_parts as u32,
        want_parts: want_parts as u32,
        cluster: cluster as u32,
        shared_bytes: shared as u32,
        ml_offset,
        scratch_bytes,
    })
}

/// Lowers `op` with operand types `args` / `results` to kernel launches or a
/// GEMM. The operand types must already type-check (`Op::infer`).
///
/// The run-time form, kept while the backends still lower at load: attention
/// geometry follows [`attn_target_blocks`]. Plans are lowered by
/// [`lower_op`] at compile time.
pub fn lower(
    op: &Op,
    args: &[TensorType],
    results: &[TensorType],
    placement: Placement,
) -> Result<Lowered, CatalogError> {
    lower_symbolic(op, args, results, placement, attn_target_blocks(), false)
}

/// [`lower`] with an explicit attention block target and whether attention
/// may use thread-block clusters ([`LowerOptions::attn_clusters`]).
pub fn lower_symbolic(
    op: &Op,
    args: &[TensorType],
    results: &[TensorType],
    placement: Placement,
    attn_target_blocks: u64,
    attn_clusters: bool,
) -> Result<Lowered, CatalogError> {
    let m = op.mnemonic();
    let arity_ok = op.arity().contains(&args.len());
    if !arity_ok || results.is_empty() {
        return Err(CatalogError::Unsupported {
            op: m,
            why: format!(
                "got {} argument(s) and {} result(s)",
                args.len(),
                results.len()
            ),
        });
    }
    let dims = |t: &TensorType| t.shape.dims().to_vec();
    let x = dims(&args[0]);
    let unsupported = |why: String| CatalogError::Unsupported { op: m, why };
    let two = |d: &[u32]| -> Result<(u32, u32), CatalogError> {
        match d {
            [a, b] => Ok((*a, *b)),
            _ => Err(unsupported(format!("expected a rank-2 operand, got {d:?}"))),
        }
    };
    let calls = |c: Vec<KernelCall>| Lowered::Kernels {
        calls: c,
        scratch_bytes: 0,
        counters: 0,
    };
    Ok(match op {
        Op::MatMulQkvRope { .. } => {
            return Err(unsupported(
                "its one launch is the quantized GEMV's, lowered over planned buffers (lower_op)"
                    .into(),
            ))
        }
        // NCCL sums bf16/f16 in the dtype (not f32 once), so a GPU rank's
        // bits may differ from the CPU reference in the last place; the
        // ranks still agree with each other (NCCL's ring order is fixed).
        Op::AllReduce { .. } => {
            float_suffix(m, args[0].dtype)?;
            Lowered::Collective
        }
        // The cross-rank argmax: each rank's (max, global index) per row,
        // gathered from every rank by the collective library, reduced in
        // rank order exactly as the CPU does (the runtime's NCCL driver).
        Op::ShardedArgmax { .. } => {
            float_suffix(m, args[0].dtype)?;
            Lowered::Collective
        }
        // The two halves of a context-split attention exist only in keys
        // scheduled as a megakernel tape, whose interpreter runs them as
        // tasks: no launch list (the plan validator refuses them in a
        // graph-schedule key).
        Op::AttentionPartials { .. } | Op::AttentionCombine { .. } => calls(vec![]),
        Op::Embedding => {
            let s = float_suffix(m, args[1].dtype)?;
            let (vocab, h) = two(&dims(&args[1]))?;
            let t = args[0].numel();
            calls(vec![call(
                "elementwise",
                format!("embedding_{s}"),
                [blocks(t, 1)?, 1, 1],
                row_threads(h).min(256),
                vec![
                    Param::Arg(0),
                    Param::Arg(1),
                    Param::Result(0),
                    Param::I32(to_i32(m, "hidden", h as u64)?),
                    Param::I32(to_i32(m, "vocab", vocab as u64)?),
                ],
            )])
        }
        Op::RmsNorm { eps, unit_offset } => {
            let s = float_suffix(m, args[0].dtype)?;
            let (t, h) = two(&x)?;
            calls(vec![call(
                "norm",
                format!("rms_norm_{s}"),
                [blocks(t as u64, 1)?, 1, 1],
                row_threads(h),
                vec![
                    Param::Arg(0),
                    Param::Arg(1),
                    Param::Result(0),
                    Param::I32(h as i32),
                    Param::F32(*eps),
                    Param::I32(*unit_offset as i32),
                ],
            )])
        }
        Op::AddRmsNorm { eps, unit_offset } => {
            let s = float_suffix(m, args[0].dtype)?;
            let (t, h) = two(&x)?;
            calls(vec![call(
                "norm",
                format!("add_rms_norm_{s}"),
                [blocks(t as u64, 1)?, 1, 1],
                row_threads(h),
                vec![
                    Param::Arg(0),
                    Param::Arg(1),
                    Param::Arg(2),
                    Param::Result(0),
                    Param::Result(1),
                    Param::I32(h as i32),
                    Param::F32(*eps),
                    Param::I32(*unit_offset as i32),
                ],
            )])
        }
        Op::HeadRmsNorm {
            heads,
            head_dim,
            eps,
            unit_offset,
        } => {
            let s = float_suffix(m, args[0].dtype)?;
            if *head_dim > HEAD_NORM_MAX_HEAD_DIM {
                return Err(unsupported(format!(
                    "head_dim {head_dim} exceeds {HEAD_NORM_MAX_HEAD_DIM}"
                )));
            }
            let (t, _) = two(&x)?;
            let rows = t as u64 * *heads as u64;
            calls(vec![call(
                "norm",
                format!("head_rms_norm_{s}"),
                [blocks(rows, 4)?, 1, 1],
                128,
                vec![
                    Param::Arg(0),
                    Param::Arg(1),
                    Param::Result(0),
                    Param::I32(to_i32(m, "rows", rows)?),
                    Param::I32(*head_dim as i32),
                    Param::F32(*eps),
                    Param::I32(*unit_offset as i32),
                ],
            )])
        }
        Op::Rope {
            heads,
            head_dim,
            rope,
        } => {
            let s = float_suffix(m, args[0].dtype)?;
            if *head_dim > ROPE_MAX_HEAD_DIM {
                return Err(unsupported(format!(
                    "head_dim {head_dim} exceeds {ROPE_MAX_HEAD_DIM}"
                )));
            }
            let (t, _) = two(&x)?;
            let n = t as u64 * *heads as u64 * (*head_dim / 2) as u64;
            to_i32(m, "pairs", n)?;
            calls(vec![call(
                "rope",
                format!("rope_{s}"),
                [blocks(n, 256)?, 1, 1],
                256,
                vec![
                    Param::Arg(0),
                    Param::Arg(1),
                    Param::Result(0),
                    Param::I32(t as i32),
                    Param::I32(*heads as i32),
                    Param::I32(*head_dim as i32),
                    Param::Blob(rope_freqs_blob(rope, *head_dim)),
                ],
            )])
        }
        Op::KvWrite => {
            let s = float_suffix(m, args[0].dtype)?;
            let (t, row) = two(&x)?;
            let (slots, _) = two(&dims(&args[3]))?;
            calls(vec![call(
                "rope",
                format!("kv_write_{s}"),
                [blocks(t as u64, 1)?, 1, 1],
                row_threads(row).min(256),
                vec![
                    Param::Arg(0),
                    Param::Arg(1),
                    Param::Arg(2),
                    Param::Arg(3),
                    Param::Arg(4),
                    Param::I32(row as i32),
                    Param::I64(slots as i64),
                ],
            )])
        }
        Op::QkvRopeKvWrite {
            heads,
            kv_heads,
            head_dim,
            rope,
            qk_norm,
            unit_offset,
        } => {
            let s = float_suffix(m, args[0].dtype)?;
            if *head_dim > ROPE_MAX_HEAD_DIM {
                return Err(unsupported(format!(
                    "head_dim {head_dim} exceeds {ROPE_MAX_HEAD_DIM}"
                )));
            }
            let (t, _) = two(&x)?;
            let (slots, _) = two(&dims(&args[3]))?;
            let warps = t as u64 * (*heads + 2 * *kv_heads) as u64;
            to_i32(m, "units", warps)?;
            let norm = qk_norm.is_some();
            calls(vec![call(
                "rope",
                format!("qkv_rope_kv_write_{s}"),
                [blocks(warps, 4)?, 1, 1],
                128,
                vec![
                    Param::Arg(0),
                    Param::Arg(1),
                    Param::Arg(2),
                    Param::Arg(3),
                    Param::Arg(4),
                    if norm { Param::Arg(5) } else { Param::Null },
                    if norm { Param::Arg(6) } else { Param::Null },
                    Param::Result(0),
                    Param::I32(t as i32),
                    Param::I32(*heads as i32),
                    Param::I32(*kv_heads as i32),
                    Param::I32(*head_dim as i32),
                    Param::F32(qk_norm.unwrap_or(0.0)),
                    Param::I32(norm as i32),
                    Param::I32(*unit_offset as i32),
                    Param::I64(slots as i64),
                    Param::Blob(rope_freqs_blob(rope, *head_dim)),
                ],
            )])
        }
        Op::PagedAttention(AttnAttrs {
            heads,
            kv_heads,
            head_dim,
            query,
            block_size,
            scale,
            window,
            softcap,
        }) => {
            let s = float_suffix(m, args[0].dtype)?;
            let (batch, max_blocks) = two(&dims(&args[3]))?;
            let g = attention_geometry_for(
                batch,
                *query,
                *heads,
                *kv_heads,
                *head_dim,
                *block_size,
                max_blocks,
                attn_target_blocks,
                attn_clusters,
            )?;
            to_i32(m, "context", max_blocks as u64 * *block_size as u64)?;
            let mut shape = Vec::with_capacity(60);
            for v in [
                batch,
                *query,
                *heads,
                *kv_heads,
                *head_dim,
                *block_size,
                max_blocks,
                window.unwrap_or(0),
            ] {
                shape.extend_from_slice(&(v as i32).to_ne_bytes());
            }
            shape.extend_from_slice(&scale.to_ne_bytes());
            shape.extend_from_slice(&softcap.unwrap_or(0.0).to_ne_bytes());
            for v in [
                g.part_len,
                g.num_parts,
                g.tiles,
                g.tg,
                g.want_parts,
                g.cluster,
            ] {
                shape.extend_from_slice(&(v as i32).to_ne_bytes());
            }
            let grid_y = batch as u64 * *kv_heads as u64 * g.tiles as u64;
            if grid_y > 65535 {
                return Err(unsupported(format!(
                    "batch {batch} x kv_heads {kv_heads} x tiles {} exceeds the 65535 grid rows",
                    g.tiles
                )));
            }
            let part = KernelCall {
                module: "attention",
                entry: if g.stream {
                    format!("paged_attn_stream_r{}_{s}", g.row_tile)
                } else {
                    format!("paged_attn_part_r{}_v{}_{s}", g.row_tile, g.vec)
                },
                grid: [g.num_parts, grid_y as u32, 1],
                block: [ATTN_THREADS, 1, 1],
                shared_bytes: g.shared_bytes,
                cluster: g.cluster,
                params: vec![
                    Param::Arg(0),
                    Param::Arg(1),
                    Param::Arg(2),
                    Param::Arg(3),
                    Param::Arg(4),
                    Param::Scratch(0),
                    Param::Scratch(g.ml_offset),
                    Param::Counters(0),
                    Param::Result(0),
                    Param::Blob(shape),
                ],
            };
            Lowered::Kernels {
                calls: vec![part],
                scratch_bytes: g.scratch_bytes,
                counters: grid_y as u32,
            }
        }
        Op::RopeAttention {
            attn: AttnAttrs {
                head_dim, query, ..
            },
            qk_norm,
            unit_offset,
            rope,
        } => {
            let (rope_op, attn_op) = op.split_rope_attention().expect("rope_attention");
            let q_ty = results[0].clone();
            let attn_args = [
                q_ty.clone(),
                args[3].clone(),
                args[4].clone(),
                args[5].clone(),
                args[6].clone(),
            ];
            let Lowered::Kernels {
                calls: attn_calls,
                scratch_bytes,
                counters,
            } = lower_symbolic(
                &attn_op,
                &attn_args,
                &results[..1],
                placement,
                attn_target_blocks,
                attn_clusters,
            )?
            else {
                return Err(unsupported("attention did not lower to kernels".into()));
            };
            let [part] = attn_calls.as_slice() else {
                return Err(unsupported(
                    "attention lowered to more than one kernel".into(),
                ));
            };
            let elem = args[0].dtype.size() as u64;
            let extra = rope_attention_shared_bytes(part, *query, *head_dim, elem);
            let stream_entry = part.entry.strip_prefix("paged_attn_stream_");
            match (stream_entry, extra) {
                (Some(rest), Some(shared)) => {
                    // One kernel: the attention ropes its own rows.
                    let (slots, _) = two(&dims(&args[3]))?;
                    let norm = qk_norm.is_some();
                    let mut cfg = Vec::with_capacity(24 + 512);
                    cfg.extend_from_slice(&(slots as i64).to_ne_bytes());
                    cfg.extend_from_slice(&qk_norm.unwrap_or(0.0).to_ne_bytes());
                    cfg.extend_from_slice(&(norm as i32).to_ne_bytes());
                    cfg.extend_from_slice(&(*unit_offset as i32).to_ne_bytes());
                    cfg.extend_from_slice(&rope_freqs_blob(rope, *head_dim));
                    let shape = match part.params.get(9) {
                        Some(Param::Blob(b)) => b.clone(),
                        _ => return Err(unsupported("attention launch without its shape".into())),
                    };
                    let mut fused = part.clone();
                    fused.entry = format!("paged_attn_rope_stream_{rest}");
                    fused.shared_bytes = shared;
                    fused.params = vec![
                        Param::Arg(0),
                        Param::Arg(1),
                        Param::Arg(2),
                        Param::Arg(3),
                        Param::Arg(4),
                        Param::Arg(5),
                        Param::Arg(6),
                        if norm { Param::Arg(7) } else { Param::Null },
                        if norm { Param::Arg(8) } else { Param::Null },
                        part.params[5].clone(),
                        part.params[6].clone(),
                        Param::Counters(0),
                        Param::Result(0),
                        Param::Blob(shape),
                        Param::Blob(cfg),
                    ];
                    Lowered::Kernels {
                        calls: vec![fused],
                        scratch_bytes,
                        counters,
                    }
                }
                _ => {
                    // The two kernels it is defined as, q in planned scratch
                    // after the attention's own (the phased attention form,
                    // or shared memory too small for the new rows).
                    let q_off = scratch_bytes.div_ceil(256) * 256;
                    let q_bytes = q_ty.size_bytes();
                    let mut rope_args: Vec<TensorType> = args[..5].to_vec();
                    rope_args.extend_from_slice(&args[7..]);
                    let rope_results = [q_ty.clone(), args[3].clone(), args[4].clone()];
                    let Lowered::Kernels {
                        calls: rope_calls, ..
                    } = lower_symbolic(
                        &rope_op,
                        &rope_args,
                        &rope_results,
                        placement,
                        attn_target_blocks,
                        attn_clusters,
                    )?
                    else {
                        return Err(unsupported(
                            "qkv_rope_kv_write did not lower to kernels".into(),
                        ));
                    };
                    let remap_rope = |p: &Param| match p {
                        Param::Arg(i) if *i >= 5 => Param::Arg(i + 2),
                        Param::Result(0) => Param::Scratch(q_off),
                        other => other.clone(),
                    };
                    let remap_attn = |p: &Param| match p {
                        Param::Arg(0) => Param::Scratch(q_off),
                        Param::Arg(i) => Param::Arg(i + 2),
                        other => other.clone(),
                    };
                    let mut calls = Vec::with_capacity(rope_calls.len() + 1);
                    for c in &rope_calls {
                        let mut c = c.clone();
                        c.params = c.params.iter().map(remap_rope).collect();
                        calls.push(c);
                    }
                    let mut a = part.clone();
                    a.params = a.params.iter().map(remap_attn).collect();
                    calls.push(a);
                    Lowered::Kernels {
                        calls,
                        scratch_bytes: q_off + q_bytes,
                        counters,
                    }
                }
            }
        }
        Op::SiluMul | Op::GeluTanhMul => {
            let s = float_suffix(m, args[0].dtype)?;
            let name = if matches!(op, Op::SiluMul) {
                "silu_mul"
            } else {
                "gelu_tanh_mul"
            };
            let (t, inter) = two(&dims(&results[0]))?;
            let packed = args.len() == 1;
            let n = t as u64 * inter as u64;
            to_i32(m, "elements", n)?;
            // A packed gate_up overwritten in place shrinks rows: later rows'
            // results land on earlier rows' inputs, so walk rows in order.
            let serial = packed && t > 1 && placement.result0_overlaps_arg0;
            let (grid, block) = if serial {
                (1, 1024)
            } else {
                (blocks(n, 256)?, 256)
            };
            calls(vec![call(
                "elementwise",
                format!("{name}_{s}"),
                [grid, 1, 1],
                block,
                vec![
                    Param::Arg(0),
                    if packed { Param::Null } else { Param::Arg(1) },
                    Param::Result(0),
                    Param::I32(t as i32),
                    Param::I32(inter as i32),
                    Param::I32(serial as i32),
                ],
            )])
        }
        Op::Add => {
            let s = float_suffix(m, args[0].dtype)?;
            let n = args[0].numel();
            calls(vec![call(
                "elementwise",
                format!("add_{s}"),
                [blocks(n, 256)?, 1, 1],
                256,
                vec![
                    Param::Arg(0),
                    Param::Arg(1),
                    Param::Result(0),
                    Param::I64(n as i64),
                ],
            )])
        }
        Op::Scale { factor, softcap } => {
            let s = float_suffix(m, args[0].dtype)?;
            let n = args[0].numel();
            calls(vec![call(
                "elementwise",
                format!("scale_{s}"),
                [blocks(n, 256)?, 1, 1],
                256,
                vec![
                    Param::Arg(0),
                    Param::Result(0),
                    Param::I64(n as i64),
                    Param::F32(*factor),
                    Param::F32(softcap.unwrap_or(1.0)),
                    Param::I32(softcap.is_some() as i32),
                ],
            )])
        }
        Op::GatherLast { group } => {
            let s = match args[0].dtype {
                DType::I32 => "i32",
                d => float_suffix(m, d)?,
            };
            let (rows, width) = two(&dims(&results[0]))?;
            calls(vec![call(
                "elementwise",
                format!("gather_last_{s}"),
                [blocks(rows as u64, 1)?, 1, 1],
                row_threads(width).min(256),
                vec![
                    Param::Arg(0),
                    Param::Result(0),
                    Param::I32(*group as i32),
                    Param::I32(width as i32),
                ],
            )])
        }
        Op::Argmax => {
            let s = float_suffix(m, args[0].dtype)?;
            let (rows, vocab) = two(&x)?;
            let chunks = vocab.div_ceil(ARGMAX_CHUNK);
            if rows > 65535 {
                return Err(unsupported(format!(
                    "{rows} rows exceed the 65535 grid rows"
                )));
            }
            let pairs = rows as u64 * chunks as u64;
            let idx_offset = (pairs * 4).div_ceil(256) * 256;
            Lowered::Kernels {
                calls: vec![
                    call(
                        "sampling",
                        format!("argmax_chunk_{s}"),
                        [chunks, rows, 1],
                        256,
                        vec![
                            Param::Arg(0),
                            Param::Scratch(0),
                            Param::Scratch(idx_offset),
                            Param::I32(vocab as i32),
                            Param::I32(chunks as i32),
                        ],
                    ),
                    call(
                        "sampling",
                        "argmax_final".into(),
                        [rows, 1, 1],
                        256,
                        vec![
                            Param::Scratch(0),
                            Param::Scratch(idx_offset),
                            Param::Result(0),
                            Param::I32(chunks as i32),
                        ],
                    ),
                ],
                scratch_bytes: idx_offset + pairs * 4,
                counters: 0,
            }
        }
        Op::AcceptGreedy { spec } => {
            let b = results[0].numel();
            calls(vec![call(
                "sampling",
                "accept_greedy".into(),
                [blocks(b, 128)?, 1, 1],
                128,
                vec![
                    Param::Arg(0),
                    Param::Arg(1),
                    Param::Result(0),
                    Param::I32(to_i32(m, "batch", b)?),
                    Param::I32(*spec as i32),
                ],
            )])
        }
        Op::Sample => {
            let s = float_suffix(m, args[0].dtype)?;
            let (rows, vocab) = two(&x)?;
            let vocab = Param::I32(to_i32(m, "vocab", vocab as u64)?);
            let (entry, params) = match args.get(3) {
                None => (
                    format!("sample_{s}"),
                    vec![
                        Param::Arg(0),
                        Param::Arg(1),
                        Param::Arg(2),
                        Param::Result(0),
                        vocab,
                    ],
                ),
                Some(p) => {
                    let (_, width) = two(&dims(p))?;
                    (
                        format!("sample_pen_{s}"),
                        vec![
                            Param::Arg(0),
                            Param::Arg(1),
                            Param::Arg(2),
                            Param::Arg(3),
                            Param::I32(to_i32(m, "penalty width", width as u64)?),
                            Param::Result(0),
                            vocab,
                        ],
                    )
                }
            };
            calls(vec![call(
                "sampling",
                entry,
                [rows.max(1), 1, 1],
                SAMPLE_THREADS,
                params,
            )])
        }
        Op::FusedMatMul { .. } => fused_matmul_lowered(op, args, 0)?,
        Op::MatMul { bias, out } => {
            let (t, k) = two(&x)?;
            let (n, _) = two(&dims(&args[1]))?;
            float_suffix(m, args[0].dtype)?;
            Lowered::Gemm(GemmCall {
                t,
                n,
                k,
                dtype: args[0].dtype,
                out: *out,
                bias: *bias,
            })
        }
    })
}

/// What `kiln compile` decides about lowering for its target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LowerOptions {
    /// Attention blocks the partition size aims for
    /// (`kiln compile --attn-target-blocks`).
    pub attn_target_blocks: u64,
    /// Launch every kernel with the programmatic-dependent-launch attribute.
    pub pdl: bool,
    /// Attention combines its context partitions inside thread-block
    /// clusters (CUDA sm_90 and later; see [`AttnGeometry::cluster`]).
    pub attn_clusters: bool,
    /// The target whose default GEMM rule applies ([`default_gemm_kind`]).
    pub target: Target,
    /// GEMM implementations measured by `kiln tune`, already filtered to
    /// this target and the current [`gemm_fingerprint`]
    /// (`crate::tuning::TuningTable::choices`); shapes not here (or whose
    /// entry names a kernel that cannot run them) use the default rule.
    pub tuned: HashMap<GemmShape, GemmKind>,
    /// Every GEMM the GEMV kernel takes (up to 8 tokens) lowers to it,
    /// whatever the default rule or a tuning table says: the megakernel
    /// schedule's interpreter runs GEMV tiles only.
    pub prefer_gemv: bool,
}

impl LowerOptions {
    /// The options for `target`: PDL on CUDA sm_90 and later (the kernels'
    /// prologue waits on their predecessor with `griddepcontrol.wait`; older
    /// parts and HIP launch plainly), attention aiming at `attn_target_blocks`.
    pub fn for_target(target: &Target, attn_target_blocks: u64) -> LowerOptions {
        LowerOptions {
            attn_target_blocks: attn_target_blocks.max(1),
            pdl: matches!(target, Target::Cuda { sm } if *sm >= 90),
            attn_clusters: matches!(target, Target::Cuda { sm } if *sm >= 90),
            target: target.clone(),
            tuned: HashMap::new(),
            prefer_gemv: false,
        }
    }
}

impl Default for LowerOptions {
    fn default() -> LowerOptions {
        LowerOptions {
            attn_target_blocks: ATTN_TARGET_BLOCKS,
            pdl: false,
            attn_clusters: false,
            target: Target::Cuda { sm: 80 },
            tuned: HashMap::new(),
            prefer_gemv: false,
        }
    }
}

/// Buffers an op's kernels need besides its operands, which the planner
/// places before the op is lowered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpNeeds {
    /// Scratch bytes, live only during the op (an arena buffer).
    pub scratch_bytes: u64,
    /// u32 completion counters (zero on entry, left zero).
    pub counters: u32,
}

fn placement_of(args: &[Operand], results: &[Operand]) -> Placement {
    let meet = |a: &BufRef, b: &BufRef| {
        a.region == b.region
            && a.bytes > 0
            && b.bytes > 0
            && a.offset < b.offset.saturating_add(b.bytes)
            && b.offset < a.offset.saturating_add(a.bytes)
    };
    Placement {
        result0_overlaps_arg0: match (results.first(), args.first()) {
            (Some(r), Some(a)) => meet(&r.buf, &a.buf),
            _ => false,
        },
    }
}

fn types(o: &[Operand]) -> Vec<TensorType> {
    o.iter().map(|o| o.ty.clone()).collect()
}

/// The scratch and counters `op`'s kernels need with operands of these
/// types (they depend on types and options only, not on placement, so the
/// planner asks before it places anything). Errors name the op and the
/// limit the operands exceed: this is where `kiln compile` refuses an op no
/// kernel of the target can run.
pub fn op_needs(
    op: &Op,
    args: &[TensorType],
    results: &[TensorType],
    opts: &LowerOptions,
) -> Result<OpNeeds, CatalogError> {
    // A fused matmul over a quantized weight runs the qgemv / qskinny
    // fused entries (no scratch, no counters); ask the same check the
    // fuse-matmul pass asked, so `kiln compile` names the limit here.
    if matches!(op, Op::FusedMatMul { .. }) && args.get(1).is_some_and(|w| w.storage.is_some()) {
        fused_matmul_runs(op, args, &opts.target)?;
        return Ok(OpNeeds::default());
    }
    if matches!(op, Op::MatMulQkvRope { .. }) {
        matmul_qkv_rope_runs(op, args, &opts.target)?;
        return matmul_qkv_rope_needs(op, args);
    }
    let l = lower_symbolic(
        op,
        args,
        results,
        Placement::default(),
        opts.attn_target_blocks,
        opts.attn_clusters,
    )?;
    Ok(match l {
        Lowered::Kernels {
            scratch_bytes,
            counters,
            ..
        } => OpNeeds {
            scratch_bytes,
            counters,
        },
        Lowered::Gemm(_) | Lowered::Collective => OpNeeds::default(),
    })
}

/// Whether a quantized matmul of `t` tokens on `target` runs the tensor-core
/// `qskinny` GEMM (every weight byte read once per 32 tokens) instead of the
/// `qgemv` GEMV: from 2 tokens on CUDA sm_80 and later. HIP and older CUDA
/// parts keep `qgemv` (qskinny's portable path there is correct, not fast).
pub fn quantized_skinny_applies(target: &Target, t: u64) -> bool {
    t >= 2 && matches!(target, Target::Cuda { sm } if *sm >= 80)
}

fn is_cuda(target: &Target) -> bool {
    matches!(target, Target::Cuda { .. })
}

/// A `matmul` or `embedding` whose weight (argument 1) is stored quantized
/// becomes the `qgemv` module's launches ([`crate::quant_gpu`]), or for a
/// matmul of 2 or more tokens where [`quantized_skinny_applies`] the
/// `qskinny` module's (the entry name in the plan says which): the weight
/// stays compressed in device memory in the repacked layout the runtime
/// writes at load, and is dequantized in registers. `None` for every other
/// op. FP8 weights carry their per-row f32 scales after the `[N][K]` bytes
/// of the same weight buffer (the repacked layout's second region).
fn lower_quantized(
    op: &Op,
    args: &[Operand],
    results: &[Operand],
    weight_args: u32,
    opts: &LowerOptions,
) -> Result<Option<Lowering>, CatalogError> {
    use crate::quant_gpu as qg;
    let m = op.mnemonic();
    let Some(q) = args.get(1).and_then(|a| a.ty.storage) else {
        return Ok(None);
    };
    let refuse = |why: String| CatalogError::Unsupported { op: m, why };
    let (n, k) = match args[1].ty.shape.dims() {
        [n, k] => (*n as u64, *k as u64),
        d => {
            return Err(refuse(format!(
                "a quantized weight must be rank 2, got {d:?}"
            )))
        }
    };
    let out = results.first().ok_or_else(|| refuse("no result".into()))?;
    let w = args[1].buf;
    let scale = fp8_scales(q, w, n, k);
    let launches = match op {
        Op::FusedMatMul { .. } => {
            lower_quantized_fused(op, args, out, weight_args & 2 != 0, &opts.target, opts.pdl)?
        }
        Op::MatMul { bias, out: od } => {
            if args[0].ty.dtype != DType::BF16 {
                return Err(refuse(format!(
                    "quantized weights take bf16 activations, got {}",
                    args[0].ty.dtype
                )));
            }
            let t = args[0].ty.numel() / k.max(1);
            let bufs = qg::QGemvBufs {
                x: args[0].buf,
                w,
                scale,
                bias: if *bias {
                    args.get(2).map(|a| a.buf)
                } else {
                    None
                },
                residual: None,
                out: out.buf,
            };
            let w_const = weight_args & 2 != 0;
            if quantized_skinny_applies(&opts.target, t) {
                qg::lower_qskinny(q, n, k, t, *od, &bufs, w_const, opts.pdl)
            } else {
                let kern = qg::QGemvKernel::choose(q, t, k, is_cuda(&opts.target));
                qg::lower_qgemv_with(kern, q, n, k, t, *od, &bufs, w_const, opts.pdl)
            }
            .map_err(|e| refuse(e.to_string()))?
        }
        Op::Embedding => {
            let t = args[0].ty.numel();
            vec![
                qg::lower_qgather(q, n, k, t, args[0].buf, w, scale, out.buf, opts.pdl)
                    .map_err(|e| refuse(e.to_string()))?,
            ]
        }
        _ => {
            return Err(refuse(format!(
                "kiln's GPU kernels read a {} weight only in matmul, fused_matmul and embedding",
                q.name()
            )))
        }
    };
    Ok(Some(Lowering::Kernels(launches)))
}

/// FP8's per-row f32 scales: after the `[n][k]` codes (k a multiple of 16)
/// in the same weight buffer. `None` for the other types.
fn fp8_scales(q: kiln_ir::QuantType, w: BufRef, n: u64, k: u64) -> Option<BufRef> {
    (q == kiln_ir::QuantType::Fp8E4M3).then(|| {
        let at = n * k;
        BufRef {
            region: w.region,
            offset: w.offset + at,
            bytes: w.bytes.saturating_sub(at),
        }
    })
}

/// Operand `i` of a lowering run only to ask whether it succeeds: each at
/// its own 16-byte aligned offset, sized generously (buffer sizes are the
/// planner's, not a kernel limit).
fn placeholder(i: usize, ty: &TensorType) -> Operand {
    Operand {
        buf: BufRef {
            region: Region::Arena,
            offset: (i as u64 + 1) << 40,
            bytes: 1 << 39,
        },
        ty: ty.clone(),
    }
}

/// [`placeholder`]s for `tys`, numbered from `first`.
fn placeholders(first: usize, tys: &[TensorType]) -> Vec<Operand> {
    tys.iter()
        .enumerate()
        .map(|(i, t)| placeholder(first + i, t))
        .collect()
}

/// Whether `target`'s kernels run a `fused_matmul` with operand types
/// `args`, and if not, why: the dense fused GEMV ([`fused_matmul_call`])
/// for dense weights; for a weight kept quantized, the qgemv / qskinny
/// fused entries, by running their very lowering over placeholder buffers
/// (so the `fuse-matmul` pass, which asks this before it fuses, and
/// [`lower_op`] never disagree). Token limits of the pass's own (the dense
/// GEMV's one-token rule) are the pass's.
pub fn fused_matmul_runs(
    op: &Op,
    args: &[TensorType],
    target: &Target,
) -> Result<(), CatalogError> {
    if args.get(1).is_none_or(|w| w.storage.is_none()) {
        return fused_matmul_call(op, args, true).map(|_| ());
    }
    let m = "fused_matmul";
    let results = op
        .infer(args)
        .map_err(|why| CatalogError::Unsupported { op: m, why })?;
    let ops = placeholders(0, args);
    let out = placeholder(args.len(), &results[0]);
    lower_quantized_fused(op, &ops, &out, true, target, false).map(|_| ())
}

/// The scratch and completion counters of a `matmul_qkv_rope`: the packed
/// qkv rows (`T x N` elements of the activation dtype; the op's projection
/// writes them there instead of to a planned value) and one counter per
/// head of the packed row per token.
fn matmul_qkv_rope_needs(op: &Op, args: &[TensorType]) -> Result<OpNeeds, CatalogError> {
    let m = "matmul_qkv_rope";
    let Op::MatMulQkvRope {
        heads, kv_heads, ..
    } = op
    else {
        return Err(CatalogError::Unsupported {
            op: m,
            why: format!("not a matmul_qkv_rope: `{}`", op.mnemonic()),
        });
    };
    let t = args
        .first()
        .map_or(0, |x| x.shape.dims().first().copied().unwrap_or(0));
    let n = args
        .get(1)
        .map_or(0, |w| w.shape.dims().first().copied().unwrap_or(0));
    let elem = args.first().map_or(2, |x| x.dtype.size() as u64);
    let units = u64::from(t) * (u64::from(*heads) + 2 * u64::from(*kv_heads));
    let counters = u32::try_from(units).map_err(|_| CatalogError::Unsupported {
        op: m,
        why: format!("{units} completion counters exceed the 32-bit range"),
    })?;
    Ok(OpNeeds {
        scratch_bytes: u64::from(t) * u64::from(n) * elem,
        counters,
    })
}

/// Whether `target`'s kernels run a `matmul_qkv_rope` with operand types
/// `args` in one launch, and if not, why: kiln's one-token GEMV on CUDA,
/// dense or integer-dot over a weight kept quantized (Q4_K, Q6_K, Q8_0),
/// roping in its epilogue (heads without a q/k norm) or in its last blocks
/// (with one; see `kernels/gpu/kiln_port.h`), checked by running that very lowering over placeholder buffers (so the
/// fusion pass, which asks this before it fuses, and [`lower_op`] never
/// disagree). There is no multi-launch form: a GPU plan has the op only
/// where this holds.
pub fn matmul_qkv_rope_runs(
    op: &Op,
    args: &[TensorType],
    target: &Target,
) -> Result<(), CatalogError> {
    let m = "matmul_qkv_rope";
    let results = op
        .infer(args)
        .map_err(|why| CatalogError::Unsupported { op: m, why })?;
    let ops = placeholders(0, args);
    let res = placeholders(args.len(), &results);
    let scratch = placeholder(args.len() + results.len(), &results[0]).buf;
    let counters = placeholder(args.len() + results.len() + 1, &results[0]).buf;
    lower_matmul_qkv_rope(op, &ops, &res, (scratch, counters), true, target, false).map(|_| ())
}

/// The launch of a `matmul_qkv_rope` (see [`matmul_qkv_rope_runs`] for
/// where it exists): operands x, w, [bias], [norm], pos, slots, kc, vc,
/// [q_norm, k_norm] as the op orders them; the packed qkv row goes to
/// `scratch`, the units' counters are `counters`.
fn lower_matmul_qkv_rope(
    op: &Op,
    args: &[Operand],
    results: &[Operand],
    (scratch, counters): (BufRef, BufRef),
    w_const: bool,
    target: &Target,
    pdl: bool,
) -> Result<Vec<KernelLaunch>, CatalogError> {
    use crate::quant_gpu as qg;
    let m = "matmul_qkv_rope";
    let refuse = |why: String| CatalogError::Unsupported { op: m, why };
    let Op::MatMulQkvRope {
        bias,
        pre,
        heads,
        kv_heads,
        head_dim,
        rope,
        qk_norm,
        unit_offset,
    } = op
    else {
        return Err(refuse(format!(
            "not a matmul_qkv_rope: `{}`",
            op.mnemonic()
        )));
    };
    if !op.arity().contains(&args.len()) || results.len() != 3 {
        return Err(refuse(format!(
            "got {} argument(s) and {} result(s)",
            args.len(),
            results.len()
        )));
    }
    if !is_cuda(target) {
        return Err(refuse(
            "the GEMV with the rope tail is CUDA's (HIP keeps the matmul and qkv_rope_kv_write)"
                .into(),
        ));
    }
    let mut next = 2;
    let mut optional = |present: bool| {
        let b = present.then(|| args[next].buf);
        next += present as usize;
        b
    };
    let bias_b = optional(*bias);
    let norm_b = optional(pre.is_some());
    let a = next;
    let num_slots = match args[a + 2].ty.shape.dims() {
        [s, _] => *s as u64,
        d => return Err(refuse(format!("the k cache must be rank 2, got {d:?}"))),
    };
    let r = qg::QRope {
        pos: args[a].buf,
        slots: args[a + 1].buf,
        kc: results[1].buf,
        vc: results[2].buf,
        norms: qk_norm.map(|eps| (args[a + 4].buf, args[a + 5].buf, eps)),
        unit_offset: *unit_offset,
        q_out: results[0].buf,
        counters,
        heads: *heads,
        kv_heads: *kv_heads,
        head_dim: *head_dim,
        num_slots,
        freqs: rope_freqs_blob(rope, *head_dim),
    };
    let Some(q) = args[1].ty.storage else {
        if pre.is_some() {
            return Err(refuse(
                "a dense projection with the rope tail takes no RMSNorm prologue".into(),
            ));
        }
        return lower_dense_qkv_rope(args, bias_b, &r, scratch, w_const, pdl).map_err(refuse);
    };
    if args[0].ty.dtype != DType::BF16 {
        return Err(refuse(format!(
            "quantized weights take bf16 activations, got {}",
            args[0].ty.dtype
        )));
    }
    let (n, k) = match args[1].ty.shape.dims() {
        [n, k] => (*n as u64, *k as u64),
        d => {
            return Err(refuse(format!(
                "a quantized weight must be rank 2, got {d:?}"
            )))
        }
    };
    let t = args[0].ty.numel() / k.max(1);
    if t != 1 {
        return Err(refuse(format!(
            "the GEMV with the rope tail takes one token, got {t}"
        )));
    }
    let bufs = qg::QGemvBufs {
        x: args[0].buf,
        w: args[1].buf,
        scale: fp8_scales(q, args[1].buf, n, k),
        bias: bias_b,
        residual: None,
        out: scratch,
    };
    let norm = pre.zip(norm_b).map(|(p, weight)| qg::QNorm {
        weight,
        eps: p.eps,
        unit_offset: p.unit_offset,
    });
    let kern = qg::QGemvKernel::choose(q, t, k, true);
    qg::lower_qgemv_rope(kern, q, (n, k), &bufs, norm, &r, w_const, pdl)
        .map(|l| vec![l])
        .map_err(|e| refuse(e.to_string()))
}

/// [`lower_matmul_qkv_rope`] over a dense weight: kiln's one-token GEMV
/// (`gemv.cu`, register or staged with the split a plain matmul of the
/// shape gets from [`gemv_call`]) writing the packed row to `scratch`,
/// its `rope` entry finishing each head in its last block. No RMSNorm
/// prologue (the dense GEMVs that take one are the fused ones, which stay
/// opt-in), bf16/f16 activations, the weight's dtype. Errors are the
/// refusal's reason.
fn lower_dense_qkv_rope(
    args: &[Operand],
    bias: Option<BufRef>,
    r: &crate::quant_gpu::QRope,
    scratch: BufRef,
    w_const: bool,
    pdl: bool,
) -> Result<Vec<KernelLaunch>, String> {
    let d = args[0].ty.dtype;
    if !matches!(d, DType::BF16 | DType::F16) || args[1].ty.dtype != d {
        return Err(format!(
            "the dense GEMV with the rope tail takes bf16 or f16 activations and weights, got {d} and {}",
            args[1].ty.dtype
        ));
    }
    let (n, k) = match args[1].ty.shape.dims() {
        [n, k] => (*n, *k),
        d => return Err(format!("the weight must be rank 2, got {d:?}")),
    };
    let t = args[0].ty.shape.dims().first().copied().unwrap_or(0);
    if t != 1 {
        return Err(format!(
            "the GEMV with the rope tail takes one token, got {t}"
        ));
    }
    r.check(u64::from(n))?;
    if k == 0 || !k.is_multiple_of(8) || i32::try_from(n).is_err() || i32::try_from(k).is_err() {
        return Err(format!(
            "kiln's GEMV does not take a [{n}, {k}] weight (K a multiple of 8, sizes in i32)"
        ));
    }
    if scratch.bytes < u64::from(n) * d.size() as u64 {
        return Err("its scratch was planned too small".into());
    }
    let (staged, ks) = gemv_split(1, n, k);
    let rpb = GEMV_ROWS_PER_BLOCK / ks;
    let s = if d == DType::BF16 { "bf16" } else { "f16" };
    let mut params = vec![
        LaunchParam::Buf(args[0].buf),
        LaunchParam::Buf(args[1].buf),
        bias.map_or(LaunchParam::Null, LaunchParam::Buf),
        LaunchParam::Buf(scratch),
        LaunchParam::I32(1),
        LaunchParam::I32(n as i32),
        LaunchParam::I32(k as i32),
        LaunchParam::I32(w_const as i32),
    ];
    params.extend(r.params()?);
    Ok(vec![KernelLaunch {
        module: "gemv".into(),
        entry: format!(
            "gemv_{}{}rope_t1_{s}_{s}",
            if staged { "staged_" } else { "" },
            ksplit_prefix(ks)
        ),
        grid: [n.div_ceil(rpb), 1, 1],
        block: [256, 1, 1],
        shared_bytes: 0,
        cluster: 1,
        params,
        pdl,
    }])
}

/// The launches of a `fused_matmul` whose weight (argument 1) is kept
/// quantized: operands x, w, [bias], [norm], [residual] as the op orders
/// them, lowered to [`crate::quant_gpu::lower_qskinny_fused`] where
/// [`quantized_skinny_applies`] (2 or more tokens on CUDA sm_80+) and to
/// [`crate::quant_gpu::lower_qgemv_fused`] otherwise, as a quantized
/// matmul chooses.
fn lower_quantized_fused(
    op: &Op,
    args: &[Operand],
    out: &Operand,
    w_const: bool,
    target: &Target,
    pdl: bool,
) -> Result<Vec<KernelLaunch>, CatalogError> {
    use crate::quant_gpu as qg;
    let m = "fused_matmul";
    let refuse = |why: String| CatalogError::Unsupported { op: m, why };
    let Op::FusedMatMul {
        bias,
        out: od,
        pre,
        post,
    } = op
    else {
        return Err(refuse(format!("not a fused matmul: `{}`", op.mnemonic())));
    };
    if !op.arity().contains(&args.len()) {
        return Err(refuse(format!("got {} argument(s)", args.len())));
    }
    let Some(q) = args[1].ty.storage else {
        return Err(refuse("the weight is not stored quantized".into()));
    };
    let (n, k) = match args[1].ty.shape.dims() {
        [n, k] => (*n as u64, *k as u64),
        d => {
            return Err(refuse(format!(
                "a quantized weight must be rank 2, got {d:?}"
            )))
        }
    };
    if args[0].ty.dtype != DType::BF16 {
        return Err(refuse(format!(
            "quantized weights take bf16 activations, got {}",
            args[0].ty.dtype
        )));
    }
    // The quantized fused entries run these epilogues; any other (a later
    // one) keeps its unfused ops.
    if !matches!(
        post,
        Epilogue::None | Epilogue::Residual | Epilogue::SiluMul | Epilogue::GeluTanhMul
    ) {
        return Err(refuse(format!(
            "the quantized fused GEMMs have no `{}` epilogue; it stays unfused",
            post.name()
        )));
    }
    let t = args[0].ty.numel() / k.max(1);
    let mut next = 2;
    let mut optional = |present: bool| {
        let b = present.then(|| args[next].buf);
        next += present as usize;
        b
    };
    let bias_b = optional(*bias);
    let norm_b = optional(pre.is_some());
    let res_b = optional(*post == Epilogue::Residual);
    let f = qg::QFusion {
        norm: pre.zip(norm_b).map(|(p, weight)| qg::QNorm {
            weight,
            eps: p.eps,
            unit_offset: p.unit_offset,
        }),
        act: match post {
            Epilogue::SiluMul => Some(qg::QAct::Silu),
            Epilogue::GeluTanhMul => Some(qg::QAct::GeluTanh),
            _ => None,
        },
    };
    let bufs = qg::QGemvBufs {
        x: args[0].buf,
        w: args[1].buf,
        scale: fp8_scales(q, args[1].buf, n, k),
        bias: bias_b,
        residual: res_b,
        out: out.buf,
    };
    if quantized_skinny_applies(target, t) {
        qg::lower_qskinny_fused(q, n, k, t, *od, &bufs, &f, w_const, pdl)
    } else {
        let kern = qg::QGemvKernel::choose(q, t, k, is_cuda(target));
        qg::lower_qgemv_fused_with(kern, q, n, k, t, *od, &bufs, &f, w_const, pdl)
    }
    .map_err(|e| refuse(e.to_string()))
}

/// Lowers one planned op for a GPU target: its complete launch list with
/// every buffer parameter a planned [`BufRef`] (an operand, `scratch`,
/// `counters`), or a GEMM with kiln's skinny-GEMM alternative. `weight_args`
/// is [`kiln_ir::plan::PlanOp::weight_args`]: when the GEMM's weight operand
/// is a weight, the GEMV may prefetch it before its dependency wait.
/// `scratch` and `counters` must hold what [`op_needs`] asked for.
pub fn lower_op(
    op: &Op,
    args: &[Operand],
    results: &[Operand],
    scratch: Option<BufRef>,
    counters: Option<BufRef>,
    weight_args: u32,
    opts: &LowerOptions,
) -> Result<Lowering, CatalogError> {
    let m = op.mnemonic();
    if matches!(op, Op::MatMulQkvRope { .. }) {
        let (Some(scratch), Some(counters)) = (scratch, counters) else {
            return Err(CatalogError::Unsupported {
                op: m,
                why: "its scratch and completion counters were not planned".into(),
            });
        };
        return Ok(Lowering::Kernels(lower_matmul_qkv_rope(
            op,
            args,
            results,
            (scratch, counters),
            weight_args & 2 != 0,
            &opts.target,
            opts.pdl,
        )?));
    }
    if let Some(l) = lower_quantized(op, args, results, weight_args, opts)? {
        return Ok(l);
    }
    let lowered = match op {
        // The fused GEMV prefetches its weight before the dependency wait
        // when the weight operand is a weight, as the plain GEMV does.
        Op::FusedMatMul { .. } => fused_matmul_lowered(op, &types(args), weight_args)?,
        _ => lower_symbolic(
            op,
            &types(args),
            &types(results),
            placement_of(args, results),
            opts.attn_target_blocks,
            opts.attn_clusters,
        )?,
    };
    let short = |what: &str, need: u64, have: u64| CatalogError::Unsupported {
        op: m,
        why: format!("needs {need} bytes of {what} but {have} were planned"),
    };
    let resolve = |c: KernelCall| -> Result<KernelLaunch, CatalogError> {
        let mut params = Vec::with_capacity(c.params.len());
        for p in c.params {
            let missing = |what: &str, i: u64| CatalogError::Unsupported {
                op: m,
                why: format!(
                    "kernel {} wants {what} {i}, which the op does not have",
                    c.entry
                ),
            };
            params.push(match p {
                Param::Arg(i) => LaunchParam::Buf(
                    args.get(i)
                        .ok_or_else(|| missing("argument", i as u64))?
                        .buf,
                ),
                Param::Result(i) => LaunchParam::Buf(
                    results
                        .get(i)
                        .ok_or_else(|| missing("result", i as u64))?
                        .buf,
                ),
                Param::Scratch(off) => {
                    let s = scratch
                        .filter(|s| off <= s.bytes)
                        .ok_or_else(|| missing("scratch at byte", off))?;
                    LaunchParam::Buf(BufRef {
                        region: s.region,
                        offset: s.offset + off,
                        bytes: s.bytes - off,
                    })
                }
                Param::Counters(i) => {
                    let at = 4 * i as u64;
                    let c = counters
                        .filter(|c| c.region == Region::Counters && at < c.bytes)
                        .ok_or_else(|| missing("completion counter", i as u64))?;
                    LaunchParam::Buf(BufRef {
                        region: Region::Counters,
                        offset: c.offset + at,
                        bytes: c.bytes - at,
                    })
                }
                Param::Null => LaunchParam::Null,
                Param::I32(v) => LaunchParam::I32(v),
                Param::I64(v) => LaunchParam::I64(v),
                Param::F32(v) => LaunchParam::F32(v),
                Param::Blob(b) => LaunchParam::Blob(b),
            });
        }
        Ok(KernelLaunch {
            module: c.module.to_string(),
            entry: c.entry,
            grid: c.grid,
            block: c.block,
            shared_bytes: c.shared_bytes,
            cluster: c.cluster,
            params,
            pdl: opts.pdl,
        })
    };
    Ok(match lowered {
        Lowered::Kernels {
            calls,
            scratch_bytes,
            counters: n,
        } => {
            let have = scratch.map_or(0, |s| s.bytes);
            if scratch_bytes > have {
                return Err(short("scratch", scratch_bytes, have));
            }
            let have = counters.map_or(0, |c| c.bytes);
            if n as u64 * 4 > have {
                return Err(short("completion counters", n as u64 * 4, have));
            }
            Lowering::Kernels(calls.into_iter().map(resolve).collect::<Result<_, _>>()?)
        }
        Lowered::Collective => Lowering::Collective,
        Lowered::Gemm(shape) => {
            let kind = choose_gemm(&shape, opts);
            Lowering::Gemm {
                shape,
                kind,
                kernel: gemm_kernel_call(kind, &shape, weight_args & 2 != 0)
                    .map(resolve)
                    .transpose()?,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_ir::RopeScaling;

    fn tt(d: DType, s: &[u32]) -> TensorType {
        TensorType::new(d, s.to_vec())
    }

    /// Every entry point the catalog can name is defined in its module's
    /// source: either literally or through a `KILN_*` instantiation macro
    /// whose name stem appears in the source.
    #[test]
    fn every_entry_point_is_declared_in_its_module_source() {
        for m in MODULES {
            let src = module_source(&m);
            assert!(src.contains("kiln_port.h (inlined)"), "{}", m.name);
            assert!(
                !src.contains("#include"),
                "{} still includes a file",
                m.name
            );
            for e in entry_points(m.name) {
                // Drop dtype and instantiation tokens (`bf16`, `t4`, `r2`, `v8`,
                // `k2`, `pf3`, the integer-dot GEMV's geometry tags `r4u2k2p`).
                let stem: Vec<&str> = e
                    .split('_')
                    .filter(|tok| {
                        let dtype = ["bf16", "f16", "f32", "i32"].contains(tok);
                        let digits = |p: usize| {
                            tok.len() > p && tok[p..].bytes().all(|c| c.is_ascii_digit())
                        };
                        let inst = (tok.starts_with(['t', 'r', 'v', 'k']) && digits(1))
                            || (tok.starts_with("pf") && digits(2))
                            || (tok.starts_with('r')
                                && tok.len() > 2
                                && tok.ends_with('h')
                                && tok[1..tok.len() - 1].bytes().all(|c| c.is_ascii_digit()));
                        let geom = crate::quant_gpu::QDOT_GEOMS
                            .iter()
                            .any(|g| g.tag().trim_start_matches('_') == *tok);
                        !dtype && !inst && !geom
                    })
                    .collect();
                let stem = stem.join("_");
                assert!(
                    src.contains(&format!("void {stem}")) || src.contains(&format!("{stem}_")),
                    "entry {e} not found in {}",
                    m.file
                );
            }
        }
    }

    fn entries_of(l: &Lowered) -> Vec<(String, &'static str)> {
        match l {
            Lowered::Kernels { calls, .. } => {
                calls.iter().map(|c| (c.entry.clone(), c.module)).collect()
            }
            Lowered::Gemm(_) | Lowered::Collective => vec![],
        }
    }

    #[test]
    fn every_lowered_entry_is_listed_by_its_module() {
        let rope = Rope {
            theta: 1e6,
            scaling: RopeScaling::None,
        };
        let d = DType::BF16;
        let cases: Vec<(Op, Vec<TensorType>, Vec<TensorType>)> = vec![
            (
                Op::Embedding,
                vec![tt(DType::I32, &[3]), tt(d, &[50, 64])],
                vec![tt(d, &[3, 64])],
            ),
            (
                Op::RmsNorm {
                    eps: 1e-6,
                    unit_offset: false,
                },
                vec![tt(d, &[3, 64]), tt(d, &[64])],
                vec![tt(d, &[3, 64])],
            ),
            (
                Op::PagedAttention(AttnAttrs {
                    heads: 6,
                    kv_heads: 2,
                    head_dim: 72,
                    query: 3,
                    block_size: 16,
                    scale: 0.1,
                    window: Some(40),
                    softcap: None,
                }),
                vec![
                    tt(d, &[6, 432]),
                    tt(d, &[256, 144]),
                    tt(d, &[256, 144]),
                    tt(DType::I32, &[2, 9]),
                    tt(DType::I32, &[2]),
                ],
                vec![tt(d, &[6, 432])],
            ),
            (
                Op::QkvRopeKvWrite {
                    heads: 4,
                    kv_heads: 2,
                    head_dim: 64,
                    rope: rope.clone(),
                    qk_norm: Some(1e-6),
                    unit_offset: false,
                },
                vec![
                    tt(d, &[3, 512]),
                    tt(DType::I32, &[3]),
                    tt(DType::I32, &[3]),
                    tt(d, &[64, 128]),
                    tt(d, &[64, 128]),
                    tt(d, &[64]),
                    tt(d, &[64]),
                ],
                vec![tt(d, &[3, 256]), tt(d, &[64, 128]), tt(d, &[64, 128])],
            ),
            (
                Op::GatherLast { group: 2 },
                vec![tt(DType::I32, &[4, 1])],
                vec![tt(DType::I32, &[2, 1])],
            ),
            (
                Op::AcceptGreedy { spec: 2 },
                vec![tt(DType::I32, &[6]), tt(DType::I32, &[4])],
                vec![tt(DType::I32, &[2])],
            ),
            (
                Op::FusedMatMul {
                    bias: false,
                    out: d,
                    pre: Some(kiln_ir::PreNorm {
                        eps: 1e-6,
                        unit_offset: false,
                    }),
                    post: Epilogue::SiluMul,
                },
                vec![tt(d, &[3, 64]), tt(d, &[40, 64]), tt(d, &[64])],
                vec![tt(d, &[3, 20])],
            ),
        ];
        for (op, a, r) in cases {
            let l = lower(&op, &a, &r, Placement::default()).unwrap();
            let es = entries_of(&l);
            assert!(!es.is_empty(), "{op:?}");
            for (e, module) in es {
                assert!(
                    entry_points(module).contains(&e),
                    "{e} not listed by module {module}"
                );
            }
        }
    }

    #[test]
    fn attention_geometry_keeps_shared_memory_and_partitions_bounded() {
        for (hd, ctx_blocks) in [(64, 8), (128, 256), (256, 4096), (72, 3)] {
            for (heads, kvh, q) in [(16, 8, 1), (32, 8, 4), (8, 1, 8), (4, 4, 1)] {
                let g = attention_geometry(4, q, heads, kvh, hd, 16, ctx_blocks).unwrap();
                assert!(g.shared_bytes <= MAX_STATIC_SHARED, "{g:?}");
                assert!(g.num_parts <= ATTN_MAX_PARTS, "{g:?}");
                assert!(g.num_parts as u64 * g.part_len as u64 >= ctx_blocks as u64 * 16);
                assert!((1..=g.num_parts).contains(&g.want_parts), "{g:?}");
                assert!(g.row_tile * g.tiles >= heads / kvh * q);
                assert_eq!(g.ml_offset % 256, 0);
                assert!(g.tg.is_power_of_two() && g.tg <= 32);
            }
        }
        assert!(attention_geometry(1, 1, 2, 1, 2048, 16, 4).is_err());
    }

    #[test]
    fn a_gemv_too_narrow_to_fill_the_chip_splits_k_and_a_wide_one_does_not() {
        // Qwen3-0.6B's o_proj (1024 x 2048): 64 blocks, split in 2 -> 128,
        // not yet 132, so in 4 -> 256; its qkv (4096 rows) stays whole.
        assert_eq!(gemv_ksplit(1024, 2048, 132), 4);
        assert_eq!(gemv_ksplit(4096, 1024, 132), 1);
        // Llama-3.2-1B's o_proj (2048 rows): 128 blocks -> 2.
        assert_eq!(gemv_ksplit(2048, 2048, 132), 2);
        // Too few vectors per row for 4 slices of 32 lanes: 2 at most.
        assert_eq!(gemv_ksplit(64, 512, 132), 2);
        assert_eq!(gemv_ksplit(64, 64, 132), 1);
        assert_eq!(gemv_ksplit(1024, 2048, 0), 1);
        let g = GemmCall {
            t: 1,
            n: 1024,
            k: 2048,
            dtype: DType::BF16,
            out: DType::BF16,
            bias: false,
        };
        // Two tokens: the register kernel with its split.
        let c = gemv_call(&GemmCall { t: 2, ..g }, true).unwrap();
        if gemv_min_blocks() == GEMV_MIN_BLOCKS {
            assert_eq!((c.entry.as_str(), c.grid[0]), ("gemv_k4_t2_bf16_bf16", 256));
        }
        assert!(entry_points("gemv").contains(&c.entry));
    }

    #[test]
    fn small_one_token_gemvs_take_the_staged_kernel_and_large_ones_the_register_kernel() {
        // Llama-3.2-1B: o_proj and down (2048 rows) split in 4, qkv (3072
        // rows) in 2; gate_up (16384 rows) keeps the register kernel.
        assert_eq!(gemv_staged_applies(1, 2048, 2048), Some(4));
        assert_eq!(gemv_staged_applies(1, 2048, 8192), Some(4));
        assert_eq!(gemv_staged_applies(1, 3072, 2048), Some(2));
        assert_eq!(gemv_staged_applies(1, 16384, 2048), None);
        // SmolLM2's 576-wide rows have 72 vectors: split in 2 at most.
        assert_eq!(gemv_staged_applies(1, 576, 576), Some(2));
        // K past 8192 (Qwen3-4B's down), more than one token, or 256+
        // blocks: never.
        assert_eq!(gemv_staged_applies(1, 2560, 9728), None);
        assert_eq!(gemv_staged_applies(2, 2048, 2048), None);
        assert_eq!(gemv_staged_applies(1, 4096, 1024), None);
        // Rows too short for two slices of 32 lanes: no split.
        assert_eq!(gemv_staged_applies(1, 64, 256), Some(1));
        let g = GemmCall {
            t: 1,
            n: 2048,
            k: 2048,
            dtype: DType::BF16,
            out: DType::F32,
            bias: false,
        };
        let c = gemv_call(&g, true).unwrap();
        if gemv_staged_enabled() {
            assert_eq!(
                (c.entry.as_str(), c.grid[0]),
                ("gemv_staged_k4_t1_bf16_f32", 512)
            );
        }
        assert!(entry_points("gemv").contains(&c.entry));
        for (n, k) in [(64u32, 256u32), (576, 576), (3072, 2048)] {
            let c = gemv_call(&GemmCall { n, k, ..g }, true).unwrap();
            let ks = gemv_staged_applies(1, n, k).unwrap();
            assert_eq!(c.grid[0], n.div_ceil(GEMV_ROWS_PER_BLOCK / ks));
            assert!(entry_points("gemv").contains(&c.entry), "{}", c.entry);
        }
    }

    #[test]
    fn a_short_context_is_spread_over_the_partitions_the_chip_needs_and_a_wide_batch_over_one() {
        // Qwen3-0.6B's attention with a 4096-position table: at batch 1 the
        // 8 (sequence, kv head) rows need 32 partitions for 256 blocks; at
        // batch 32 they are 256 already, so one partition (the direct
        // write, no combine) stays.
        let g =
            attention_geometry_for(1, 1, 16, 8, 128, 16, 256, ATTN_TARGET_BLOCKS, false).unwrap();
        assert_eq!((g.part_len, g.num_parts, g.want_parts), (128, 32, 32));
        let g =
            attention_geometry_for(8, 1, 16, 8, 128, 16, 256, ATTN_TARGET_BLOCKS, false).unwrap();
        assert_eq!(g.want_parts, 4);
        let g =
            attention_geometry_for(32, 1, 16, 8, 128, 16, 256, ATTN_TARGET_BLOCKS, false).unwrap();
        assert_eq!(g.want_parts, 1);
        assert_eq!(g.cluster, 1);
    }

    #[test]
    fn attention_clusters_hold_the_partitions_a_step_spreads_a_context_over() {
        // (batch, heads, kv heads, head_dim, want_parts, cluster) for the
        // default block target over a 4096-position table.
        for (batch, heads, kvh, hd, want, cluster) in [
            (1, 16, 8, 128, 32, 16), // Qwen3-0.6B b1: capped at 16
            (8, 16, 8, 128, 4, 4),   // b8: all four partitions in one cluster
            (32, 16, 8, 128, 1, 1),  // b32: one partition, no cluster
            (32, 9, 3, 64, 3, 1),    // 3 partitions: a cluster of 2 would be slower
            (1, 9, 3, 64, 86, 16),   // SmolLM2 b1
            (4, 9, 3, 64, 22, 16),   // 22 partitions: the largest power of two under them
            (2, 32, 8, 64, 16, 16),
            (3, 32, 8, 64, 11, 8),
        ] {
            let on =
                attention_geometry_for(batch, 1, heads, kvh, hd, 16, 256, ATTN_TARGET_BLOCKS, true)
                    .unwrap();
            let off = attention_geometry_for(
                batch,
                1,
                heads,
                kvh,
                hd,
                16,
                256,
                ATTN_TARGET_BLOCKS,
                false,
            )
            .unwrap();
            let what = format!("b{batch} {heads}/{kvh}x{hd}");
            assert_eq!((on.want_parts, on.cluster), (want, cluster), "{what}");
            assert_eq!(off.cluster, 1, "{what}");
            assert!(on.cluster.is_power_of_two() && on.cluster <= ATTN_MAX_CLUSTER);
            assert!(on.cluster <= on.want_parts.max(1), "{what}");
            assert_eq!(on.num_parts % on.cluster, 0, "{what}");
            assert!(on.num_parts >= off.num_parts && on.num_parts <= ATTN_MAX_PARTS);
            // The cluster's gather region: RT * hd + 16 * (1 + 2 RT) more
            // floats, whatever the cluster's size.
            let extra = if on.cluster > 1 {
                attention_gather_floats(on.row_tile as u64, hd as u64) as u32 * 4
            } else {
                0
            };
            assert_eq!(on.shared_bytes, off.shared_bytes + extra, "{what}");
        }
        // head_dim 256 with 8-row tiles: the state region would not fit, so
        // the plain combine runs.
        let g = attention_geometry_for(1, 8, 4, 1, 256, 4, 24, ATTN_TARGET_BLOCKS, true).unwrap();
        assert_eq!((g.row_tile, g.cluster), (8, 1));
        assert!(g.shared_bytes <= MAX_STATIC_SHARED);
        // The phased kernel (head_dim not a multiple of 8) never clusters.
        let g = attention_geometry_for(1, 1, 4, 1, 36, 16, 4, ATTN_TARGET_BLOCKS, true).unwrap();
        assert!(!g.stream);
        assert_eq!(g.cluster, 1);
    }

    #[test]
    fn attention_shape_blob_matches_the_kernel_struct_layout() {
        let op = Op::PagedAttention(AttnAttrs {
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            query: 1,
            block_size: 16,
            scale: 0.125,
            window: None,
            softcap: Some(30.0),
        });
        let a = vec![
            tt(DType::BF16, &[2, 256]),
            tt(DType::BF16, &[64, 128]),
            tt(DType::BF16, &[64, 128]),
            tt(DType::I32, &[2, 4]),
            tt(DType::I32, &[2]),
        ];
        let r = vec![tt(DType::BF16, &[2, 256])];
        let Lowered::Kernels { calls, .. } = lower(&op, &a, &r, Placement::default()).unwrap()
        else {
            panic!("attention lowers to kernels")
        };
        let Param::Blob(b) = calls[0].params.last().unwrap() else {
            panic!("shape struct is the last parameter")
        };
        // struct AttnShape: 8 ints, 2 floats, 6 ints.
        assert_eq!(b.len(), 16 * 4);
        let src = MODULES
            .iter()
            .find(|m| m.name == "attention")
            .unwrap()
            .raw_source;
        assert!(
            src.contains("int want_parts;") && src.contains("int cluster;"),
            "the kernel struct ends with want_parts and cluster"
        );
        let f = |i: usize| f32::from_ne_bytes(b[i * 4..i * 4 + 4].try_into().unwrap());
        let n = |i: usize| i32::from_ne_bytes(b[i * 4..i * 4 + 4].try_into().unwrap());
        assert_eq!((n(0), n(2), n(4), n(6), n(7)), (2, 4, 64, 4, 0));
        assert_eq!((f(8), f(9)), (0.125, 30.0));
    }

    /// A quantized matmul of `t` tokens lowered for `target`: the modules and
    /// entries of its launches.
    fn quantized_matmul_entries(
        q: kiln_ir::QuantType,
        t: u32,
        target: &Target,
    ) -> Vec<(String, String)> {
        let (n, k) = (1000u32, 512u32);
        let x = tt(DType::BF16, &[t, k]);
        let mut w = tt(DType::BF16, &[n, k]);
        w.storage = Some(q);
        let out = tt(DType::BF16, &[t, n]);
        // FP8's per-row f32 scales follow its codes in the same buffer.
        let wbytes =
            crate::quant_gpu::repacked_bytes(q, n as u64, k as u64).unwrap() + 4 * n as u64;
        let op = |region, offset, ty: &TensorType, bytes| Operand {
            buf: BufRef {
                region,
                offset,
                bytes,
            },
            ty: ty.clone(),
        };
        let args = vec![
            op(Region::Arena, 0, &x, x.size_bytes()),
            op(Region::Weight(0), 0, &w, wbytes),
        ];
        let results = vec![op(Region::Arena, 1 << 20, &out, out.size_bytes())];
        let opts = LowerOptions::for_target(target, 1);
        let m = Op::MatMul {
            bias: false,
            out: DType::BF16,
        };
        let needs = op_needs(&m, &types(&args), &types(&results), &opts).unwrap();
        assert_eq!(needs, OpNeeds::default(), "no scratch, no counters");
        let Lowering::Kernels(ls) = lower_op(&m, &args, &results, None, None, 2, &opts).unwrap()
        else {
            panic!("a quantized matmul lowers to kernels")
        };
        ls.into_iter().map(|l| (l.module, l.entry)).collect()
    }

    #[test]
    fn quantized_matmuls_of_two_or_more_tokens_take_the_tensor_core_kernel_on_sm_80_and_later() {
        use crate::quant_gpu::{stem, QUANT_TYPES};
        let sm90 = Target::Cuda { sm: 90 };
        for q in QUANT_TYPES {
            let s = stem(q);
            let one = |m: &str, e: String| vec![(m.to_string(), e)];
            // One token: the integer-dot GEMV where it exists, else the float one.
            let i8 = crate::quant_gpu::QGemvKernel::choose(q, 1, 4096, true)
                == crate::quant_gpu::QGemvKernel::Int8Dot;
            // (1000 rows of 512: the rule's geometry, not the plain one.)
            let geom = crate::quant_gpu::QdotGeom::rule(1000, 512).tag();
            let gemv = if i8 {
                format!("qgemv_i8{geom}_{s}_t1_bf16_bf16")
            } else {
                format!("qgemv_{s}_t1_bf16_bf16")
            };
            assert!(entry_points("qgemv").contains(&gemv), "{gemv}");
            assert_eq!(quantized_matmul_entries(q, 1, &sm90), one("qgemv", gemv));
            // Eight-token launches take the type's default unit ring (FP8's
            // in registers, the others' in shared memory), as deep as the
            // split-K warps' slots allow at K = 512.
            let warps = {
                let units = 512 / crate::quant_gpu::qskinny_unit(q);
                let mut w = 16u64;
                while w > 1 && 2 * w > units {
                    w /= 2;
                }
                w
            };
            let ring = crate::quant_gpu::skinny_prefetch(None, q)
                .unwrap()
                .and_then(|d| crate::quant_gpu::skinny_ring_depth(q, warps, d))
                .map_or(String::new(), |d| format!("_pf{d}"));
            for (t, tp) in [(2u32, 8u32), (8, 8), (9, 16), (32, 32)] {
                let pf = if tp == 8 { ring.as_str() } else { "" };
                let want = one("qskinny", format!("qskinny_{s}_t{tp}_r1{pf}_bf16_bf16"));
                assert_eq!(quantized_matmul_entries(q, t, &sm90), want, "{q:?} t={t}");
                let sm80 = Target::Cuda { sm: 80 };
                assert_eq!(quantized_matmul_entries(q, t, &sm80), want, "{q:?} t={t}");
                assert!(entry_points("qskinny").contains(&want[0].1));
            }
            let two = quantized_matmul_entries(q, 40, &sm90);
            assert_eq!(
                two,
                vec![
                    ("qskinny".into(), format!("qskinny_{s}_t32_r1_bf16_bf16")),
                    (
                        "qskinny".into(),
                        format!("qskinny_{s}_t8_r1{ring}_bf16_bf16")
                    ),
                ]
            );
            // Older parts and HIP keep the GEMV.
            for target in [
                Target::Cuda { sm: 75 },
                Target::Hip {
                    gfx: "gfx1100".into(),
                },
            ] {
                let ls = quantized_matmul_entries(q, 8, &target);
                assert_eq!(ls, one("qgemv", format!("qgemv_{s}_t8_bf16_bf16")));
            }
        }
    }

    /// A quantized `fused_matmul` over a `[n, k]` weight of `t` tokens
    /// lowered for `target` (operands x, w, [bias], [norm], [residual]):
    /// the launches, after checking that the fuse pass's legality check
    /// and the planner's `op_needs` accept it too.
    fn quantized_fused_launches(
        q: kiln_ir::QuantType,
        (t, n, k): (u32, u32, u32),
        op: &Op,
        target: &Target,
    ) -> Result<Vec<KernelLaunch>, String> {
        let Op::FusedMatMul {
            bias, pre, post, ..
        } = op
        else {
            panic!("not a fused matmul")
        };
        let mut w = tt(DType::BF16, &[n, k]);
        w.storage = Some(q);
        let mut a = vec![tt(DType::BF16, &[t, k]), w];
        if *bias {
            a.push(tt(DType::BF16, &[n]));
        }
        if pre.is_some() {
            a.push(tt(DType::BF16, &[k]));
        }
        if *post == Epilogue::Residual {
            a.push(tt(DType::BF16, &[t, n]));
        }
        let r = op.infer(&a)?;
        let wbytes = crate::quant_gpu::repacked_bytes(q, n as u64, k as u64)
            .map_or(1 << 30, |b| b + 4 * n as u64);
        let args: Vec<Operand> = a
            .iter()
            .enumerate()
            .map(|(i, ty)| Operand {
                buf: BufRef {
                    region: if i == 1 {
                        Region::Weight(0)
                    } else {
                        Region::Arena
                    },
                    offset: if i == 1 { 0 } else { (i as u64) << 24 },
                    bytes: if i == 1 { wbytes } else { ty.size_bytes() },
                },
                ty: ty.clone(),
            })
            .collect();
        let results = vec![Operand {
            buf: BufRef {
                region: Region::Arena,
                offset: 15 << 24,
                bytes: r[0].size_bytes(),
            },
            ty: r[0].clone(),
        }];
        let opts = LowerOptions::for_target(target, 1);
        let runs = fused_matmul_runs(op, &a, target).map_err(|e| e.to_string());
        let needs = op_needs(op, &a, &r, &opts).map_err(|e| e.to_string());
        let lowered = lower_op(op, &args, &results, None, None, 2, &opts);
        // The pass's check, the planner's needs and the lowering agree.
        assert_eq!(runs.is_ok(), lowered.is_ok(), "{op:?} t={t}: {runs:?}");
        assert_eq!(needs.is_ok(), lowered.is_ok(), "{op:?} t={t}: {needs:?}");
        match lowered.map_err(|e| e.to_string())? {
            Lowering::Kernels(ls) => Ok(ls),
            other => panic!("a quantized fused matmul lowered to {other:?}"),
        }
    }

    #[test]
    fn quantized_fused_matmuls_lower_to_the_fused_entries_the_fuse_pass_is_told_run() {
        use crate::quant_gpu::{stem, QUANT_TYPES};
        let sm90 = Target::Cuda { sm: 90 };
        let hip = Target::Hip {
            gfx: "gfx1100".into(),
        };
        let norm = Some(kiln_ir::PreNorm {
            eps: 1e-6,
            unit_offset: true,
        });
        let fused = |bias, out, pre, post| Op::FusedMatMul {
            bias,
            out,
            pre,
            post,
        };
        let (n, k) = (1000u32, 512u32);
        for q in QUANT_TYPES {
            let s = stem(q);
            let one = |t, op: &Op, target: &Target| {
                let ls = quantized_fused_launches(q, (t, n, k), op, target).unwrap();
                for l in &ls {
                    assert!(entry_points(&l.module).contains(&l.entry), "{}", l.entry);
                }
                ls
            };
            // One token: the fused GEMV; 8 outputs a block under an activation.
            let op = fused(false, DType::BF16, norm, Epilogue::SiluMul);
            let ls = one(1, &op, &sm90);
            assert_eq!(ls.len(), 1);
            if crate::quant_gpu::QGemvKernel::choose(q, 1, k as u64, true)
                == crate::quant_gpu::QGemvKernel::Int8Dot
            {
                // The integer-dot GEMV in the rule's geometry: half its
                // rows a block in gate/up row pairs.
                let g = crate::quant_gpu::QdotGeom::rule(n as u64, k as u64);
                assert_eq!(
                    ls[0].entry,
                    format!("qgemv_i8{}_fused_norm_{s}_t1_bf16_bf16", g.tag())
                );
                let pairs = g.rows_per_block() as u32 / 2;
                assert_eq!(ls[0].grid, [(n / 2).div_ceil(pairs), 1, 1]);
            } else {
                assert_eq!(ls[0].entry, format!("qgemv_fused_norm_{s}_t1_bf16_bf16"));
                assert_eq!(ls[0].grid, [(n / 2).div_ceil(8), 1, 1]);
            }
            // On HIP the float kernel at one token, whatever the type.
            let ls = one(1, &op, &hip);
            assert_eq!(ls[0].entry, format!("qgemv_fused_norm_{s}_t1_bf16_bf16"));
            assert_eq!(ls[0].params.len(), 17);
            assert_eq!(ls[0].params[14], LaunchParam::F32(1e-6));
            assert_eq!(ls[0].params[15], LaunchParam::I32(1));
            assert_eq!(ls[0].params[16], LaunchParam::I32(1));
            // The final norm + lm_head of 8 tokens: tensor cores, an f32 result.
            let op = fused(false, DType::F32, norm, Epilogue::None);
            // Eight-token fused launches take the type's fused ring (none
            // for FP8).
            let fring = crate::quant_gpu::skinny_fused_ring_depth(q)
                .map_or(String::new(), |d| format!("_pf{d}"));
            let ls = one(8, &op, &sm90);
            assert_eq!(
                ls[0].entry,
                format!("qskinny_fused_norm_{s}_t8_r1{fring}_bf16_f32")
            );
            assert_eq!(ls[0].params[16], LaunchParam::I32(0));
            // GELU without the prologue on HIP: the GEMV at any token count.
            let op = fused(true, DType::BF16, None, Epilogue::GeluTanhMul);
            let ls = one(3, &op, &hip);
            assert_eq!(ls[0].entry, format!("qgemv_fused_{s}_t4_bf16_bf16"));
            assert_eq!(ls[0].params[16], LaunchParam::I32(2));
            assert!(!ls[0].pdl);
            // ... and on tensor cores: gate and up tiles in one block.
            let ls = one(3, &op, &sm90);
            assert_eq!(
                ls[0].entry,
                format!("qskinny_fused_{s}_t8_r2{fring}_bf16_bf16")
            );
            assert_eq!(ls[0].grid, [(n / 2).div_ceil(16), 1, 1]);
            // A residual alone is the plain kernel's epilogue.
            let op = fused(false, DType::BF16, None, Epilogue::Residual);
            let ls = one(17, &op, &sm90);
            assert_eq!(ls[0].entry, format!("qskinny_{s}_t24_r1_bf16_bf16"));
            assert!(matches!(ls[0].params[4], LaunchParam::Buf(b) if b.offset == 2 << 24));
        }
        // K that is not whole Q4_K blocks: refused by all three, naming it.
        let op = fused(false, DType::BF16, norm, Epilogue::SiluMul);
        let e = quantized_fused_launches(kiln_ir::QuantType::Q4K, (1, 64, 320), &op, &sm90)
            .unwrap_err();
        assert!(e.contains("multiple of 256"), "{e}");
    }

    #[test]
    fn lower_op_points_kernels_at_the_planned_scratch_and_counters_and_refuses_too_few() {
        let op = Op::PagedAttention(AttnAttrs {
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            query: 1,
            block_size: 16,
            scale: 0.125,
            window: None,
            softcap: None,
        });
        let a = vec![
            tt(DType::BF16, &[2, 256]),
            tt(DType::BF16, &[64, 128]),
            tt(DType::BF16, &[64, 128]),
            tt(DType::I32, &[2, 4]),
            tt(DType::I32, &[2]),
        ];
        let r = vec![tt(DType::BF16, &[2, 256])];
        let at = |region, offset, ty: &TensorType| Operand {
            buf: BufRef {
                region,
                offset,
                bytes: ty.size_bytes(),
            },
            ty: ty.clone(),
        };
        let args: Vec<_> = a
            .iter()
            .enumerate()
            .map(|(i, t)| at(Region::Io, 1024 * i as u64, t))
            .collect();
        let results = vec![at(Region::Arena, 0, &r[0])];
        let opts = LowerOptions::for_target(&Target::Cuda { sm: 90 }, 1);
        let needs = op_needs(&op, &a, &r, &opts).unwrap();
        assert!(needs.scratch_bytes > 0 && needs.counters > 0);
        let scratch = BufRef {
            region: Region::Arena,
            offset: 4096,
            bytes: needs.scratch_bytes,
        };
        let counters = BufRef {
            region: Region::Counters,
            offset: 16,
            bytes: needs.counters as u64 * 4,
        };
        let lower = |s, c| lower_op(&op, &args, &results, s, c, 0, &opts);
        let Lowering::Kernels(ls) = lower(Some(scratch), Some(counters)).unwrap() else {
            panic!("attention lowers to kernels")
        };
        let buf_at = |i: usize| match &ls[0].params[i] {
            LaunchParam::Buf(b) => *b,
            p => panic!("parameter {i} is {p:?}"),
        };
        assert_eq!(buf_at(0), args[0].buf);
        assert_eq!(buf_at(5).offset, 4096);
        assert!(buf_at(6).offset > 4096 && buf_at(6).region == Region::Arena);
        assert_eq!((buf_at(7).region, buf_at(7).offset), (Region::Counters, 16));
        assert_eq!(buf_at(8), results[0].buf);
        assert!(ls[0].pdl);
        let small = BufRef {
            bytes: needs.scratch_bytes - 1,
            ..scratch
        };
        let e = lower(Some(small), Some(counters)).unwrap_err().to_string();
        assert!(e.contains("scratch"), "{e}");
        let e = lower(Some(scratch), None).unwrap_err().to_string();
        assert!(e.contains("completion counters"), "{e}");
    }

    #[test]
    fn rope_table_is_the_plan_table_rounded_to_f32() {
        let rope = Rope {
            theta: 10000.0,
            scaling: RopeScaling::Linear { factor: 2.0 },
        };
        let b = rope_freqs_blob(&rope, 64);
        assert_eq!(b.len(), 512);
        let want = rope.inv_freq(64);
        for (i, w) in want.iter().enumerate() {
            let got = f32::from_ne_bytes(b[i * 4..i * 4 + 4].try_into().unwrap());
            assert_eq!(got, *w as f32);
        }
        assert!(b[32 * 4..].iter().all(|&x| x == 0));
    }

    #[test]
    fn packed_silu_mul_in_place_over_several_rows_runs_serially() {
        let a = vec![tt(DType::BF16, &[3, 20])];
        let r = vec![tt(DType::BF16, &[3, 10])];
        let serial = lower(
            &Op::SiluMul,
            &a,
            &r,
            Placement {
                result0_overlaps_arg0: true,
            },
        )
        .unwrap();
        let Lowered::Kernels { calls, .. } = serial else {
            panic!()
        };
        assert_eq!(calls[0].grid, [1, 1, 1]);
        assert_eq!(calls[0].params[5], Param::I32(1));
        let parallel = lower(&Op::SiluMul, &a, &r, Placement::default()).unwrap();
        let Lowered::Kernels { calls, .. } = parallel else {
            panic!()
        };
        assert_eq!(calls[0].params[5], Param::I32(0));
    }

    #[test]
    fn skinny_gemms_get_a_kiln_kernel_and_wide_or_unaligned_ones_do_not() {
        let g = |t, k, dtype, out| GemmCall {
            t,
            n: 1000,
            k,
            dtype,
            out,
            bias: true,
        };
        let c = gemv_call(&g(3, 1024, DType::BF16, DType::F32), true).unwrap();
        // 63 blocks of 16 rows would leave the chip half idle: K splits in 4.
        let ks = gemv_ksplit(1000, 1024, gemv_min_blocks());
        assert_eq!(c.entry, format!("gemv_{}t4_bf16_f32", ksplit_prefix(ks)));
        assert!(entry_points("gemv").contains(&c.entry));
        assert_eq!(c.grid[0], 1000u32.div_ceil(GEMV_ROWS_PER_BLOCK / ks));
        assert_eq!(c.params[2], Param::Arg(2));
        // The weight-prefetch flag is the last parameter; an activation as
        // the weight operand must not be read before the dependency wait.
        assert_eq!(c.params.last(), Some(&Param::I32(1)));
        let c = gemv_call(&g(3, 1024, DType::BF16, DType::F32), false).unwrap();
        assert_eq!(c.params.last(), Some(&Param::I32(0)));
        assert!(gemv_call(&g(9, 1024, DType::BF16, DType::BF16), true).is_none());
        assert!(gemv_call(&g(1, 1020, DType::BF16, DType::BF16), true).is_none());
        assert!(gemv_call(&g(1, 1024, DType::F32, DType::F32), true).is_none());
        assert!(gemv_call(&g(1, 1024, DType::BF16, DType::F16), true).is_none());
    }

    fn fused(bias: bool, out: DType, pre: bool, post: Epilogue) -> Op {
        Op::FusedMatMul {
            bias,
            out,
            pre: pre.then_some(kiln_ir::PreNorm {
                eps: 1e-5,
                unit_offset: true,
            }),
            post,
        }
    }

    #[test]
    fn fused_gemv_operands_land_in_the_kernel_slots_their_flags_name() {
        let d = DType::BF16;
        // bias, norm and residual all present: arguments 2, 3 and 4.
        let op = fused(true, d, true, Epilogue::Residual);
        let a = [
            tt(d, &[5, 96]),
            tt(d, &[40, 96]),
            tt(d, &[40]),
            tt(d, &[96]),
            tt(d, &[5, 40]),
        ];
        let c = fused_matmul_call(&op, &a, true).unwrap();
        assert_eq!(c.entry, "skinny_fused_norm_t8_r1h_bf16_bf16");
        assert_eq!(c.module, "skinny");
        assert!(entry_points("skinny").contains(&c.entry));
        assert_eq!(
            &c.params[..6],
            &[
                Param::Arg(0),
                Param::Arg(1),
                Param::Arg(2),
                Param::Arg(3),
                Param::Arg(4),
                Param::Result(0)
            ]
        );
        // Five tokens take the skinny GEMM: 40 rows are far too few blocks
        // of 16 for the chip, so one half tile of 8 rows per block (two
        // kept accumulators a lane); K 96 is three 32-wide chunks, so one
        // split-K warp.
        assert_eq!((c.grid[0], c.block[0]), (5, 32));
        assert_eq!(c.shared_bytes, 32 * 2 * 4);
        assert_eq!(
            &c.params[9..],
            &[
                Param::I32(3),
                Param::F32(1e-5),
                Param::I32(1),
                Param::I32(3)
            ]
        );
        // The `consts` bits name which of the weight (argument 1) and the
        // norm weight (argument 3 here) may be read before the wait.
        for (weight_args, consts) in [(0b1010, 3), (0b0010, 1), (0b1000, 2), (0b10101, 0)] {
            let c = fused_matmul_launch(&op, &a, weight_args).unwrap();
            assert_eq!(
                c.params[9],
                Param::I32(consts),
                "weight_args {weight_args:#b}"
            );
        }
        // Only a residual: it is argument 2; absent operands are null.
        let op = fused(false, d, false, Epilogue::Residual);
        let c = fused_matmul_call(&op, &[a[0].clone(), a[1].clone(), a[4].clone()], false).unwrap();
        assert_eq!(c.entry, "skinny_fused_t8_r1h_bf16_bf16");
        assert_eq!(&c.params[2..5], &[Param::Null, Param::Null, Param::Arg(2)]);
        assert_eq!(c.params[9], Param::I32(0));
        // An activation epilogue over two tokens: the skinny GEMM's gate and
        // up tiles, half tiles of 8 of the 100 outputs per block.
        let op = fused(false, d, false, Epilogue::GeluTanhMul);
        let c = fused_matmul_call(&op, &[tt(d, &[2, 96]), tt(d, &[200, 96])], true).unwrap();
        assert_eq!(
            (c.entry.as_str(), c.grid[0]),
            ("skinny_fused_t8_r2h_bf16_bf16", 13)
        );
        assert!(entry_points("skinny").contains(&c.entry));
        // Enough outputs for the chip (4,000: 250 blocks of 16): full tiles.
        let c = fused_matmul_call(&op, &[tt(d, &[2, 96]), tt(d, &[8000, 96])], true).unwrap();
        assert_eq!(
            (c.entry.as_str(), c.grid[0], c.shared_bytes),
            ("skinny_fused_t8_r2_bf16_bf16", 250, 2 * 4 * 32 * 4)
        );
        assert!(entry_points("skinny").contains(&c.entry));
        // The one-tile RMSNorm entry takes at most eight warps (two blocks
        // an SM at its register count); the plain one sixteen.
        let k = 2048;
        let norm = fused(false, d, true, Epilogue::None);
        let c = fused_matmul_call(
            &norm,
            &[tt(d, &[8, k]), tt(d, &[4000, k]), tt(d, &[k])],
            true,
        )
        .unwrap();
        assert_eq!(
            (c.entry.as_str(), c.grid[0], c.block[0]),
            ("skinny_fused_norm_t8_r1_bf16_bf16", 250, 256)
        );
        let plain = fused(false, d, false, Epilogue::None);
        let c = fused_matmul_call(&plain, &[tt(d, &[8, k]), tt(d, &[4000, k])], true).unwrap();
        assert_eq!(
            (c.entry.as_str(), c.block[0]),
            ("skinny_fused_t8_r1_bf16_bf16", 512)
        );
        // One token, the same epilogue: the register GEMV, 8 outputs per
        // block, where the plain GEMV would not stage.
        let c = fused_matmul_call(&op, &[tt(d, &[1, 4096]), tt(d, &[200, 4096])], true).unwrap();
        if !matches!(gemv_split(1, 200, 4096), (true, _)) {
            assert_eq!(
                (c.entry.as_str(), c.grid[0]),
                ("gemv_fused_t1_bf16_bf16", 13)
            );
        }
        assert_eq!(c.params.last(), Some(&Param::I32(2)));
        // One token over a weight the plain GEMV stages: the staged fused
        // entry with the plain GEMV's split, its grid in 16 / split virtual
        // rows (an activation's gate and up rows both count).
        let staged = gemv_staged_enabled();
        let c = fused_matmul_call(&op, &[tt(d, &[1, 96]), tt(d, &[200, 96])], true).unwrap();
        if staged {
            assert_eq!(
                (c.entry.as_str(), c.grid[0]),
                ("gemv_staged_fused_t1_bf16_bf16", 13)
            );
        }
        let norm = fused(false, d, true, Epilogue::SiluMul);
        let c = fused_matmul_call(
            &norm,
            &[tt(d, &[1, 1024]), tt(d, &[2048, 1024]), tt(d, &[1024])],
            true,
        )
        .unwrap();
        let plain = gemv_call(
            &GemmCall {
                dtype: d,
                out: d,
                t: 1,
                n: 2048,
                k: 1024,
                bias: false,
            },
            true,
        )
        .unwrap();
        if staged {
            assert_eq!(plain.entry, "gemv_staged_k4_t1_bf16_bf16");
            assert_eq!(
                (c.entry.as_str(), c.grid),
                ("gemv_staged_fused_norm_k4_t1_bf16_bf16", plain.grid)
            );
        }
        // f32 results (a small lm_head) keep the register kernel.
        let lm = fused(false, DType::F32, true, Epilogue::None);
        let c = fused_matmul_call(
            &lm,
            &[tt(d, &[1, 1024]), tt(d, &[2048, 1024]), tt(d, &[1024])],
            true,
        )
        .unwrap();
        assert_eq!(c.entry, "gemv_fused_norm_t1_bf16_f32");
    }

    #[test]
    fn fused_gemv_refuses_what_its_kernel_cannot_run_and_says_why() {
        let d = DType::BF16;
        let none = fused(false, DType::F32, true, Epilogue::None);
        let w = tt(d, &[40, 64]);
        let nw = tt(d, &[64]);
        let ok = fused_matmul_call(&none, &[tt(d, &[8, 64]), w.clone(), nw.clone()], true);
        assert_eq!(ok.unwrap().entry, "skinny_fused_norm_t8_r1h_bf16_f32");
        let e = fused_matmul_call(&none, &[tt(d, &[9, 64]), w.clone(), nw.clone()], true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("9 tokens exceed"), "{e}");
        let e = fused_matmul_call(
            &none,
            &[tt(d, &[2, 60]), tt(d, &[40, 60]), tt(d, &[60])],
            true,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("multiple of 8"), "{e}");
        let f = DType::F32;
        let e = fused_matmul_call(
            &fused(false, f, false, Epilogue::None),
            &[tt(f, &[2, 64]), tt(f, &[40, 64])],
            true,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("bf16 or f16"), "{e}");
        // Through the catalog entry point too, so `kiln compile` refuses it.
        assert!(lower(
            &none,
            &[tt(d, &[9, 64]), w, nw],
            &[tt(DType::F32, &[9, 40])],
            Placement::default()
        )
        .is_err());
    }

    fn shape(t: u32, n: u32, k: u32, dtype: DType) -> GemmCall {
        GemmCall {
            t,
            n,
            k,
            dtype,
            out: dtype,
            bias: false,
        }
    }

    #[test]
    fn the_skinny_gemm_geometry_follows_tokens_rows_and_k() {
        // 3 tokens pad to one 8-token tile; 4000 rows are 250 blocks of
        // 16; K = 1000 is 32 chunks of 32, so 16 warps get two chunks each.
        let c = skinny_call(&shape(3, 4000, 1000, DType::BF16), true).unwrap();
        assert_eq!(c.entry, "skinny_t8_r1_bf16_bf16");
        assert!(entry_points("skinny").contains(&c.entry));
        assert_eq!((c.grid, c.block), ([250, 1, 1], [512, 1, 1]));
        assert_eq!(c.shared_bytes, 16 * 4 * 32 * 4);
        assert_eq!(c.params[2], Param::Null);
        assert_eq!(c.params.last(), Some(&Param::I32(1)));
        // 1000 rows would be 63 blocks of 16, too few for the chip: half
        // tiles of 8, 125 blocks, two kept accumulators a lane.
        let c = skinny_call(&shape(3, 1000, 1000, DType::BF16), true).unwrap();
        assert_eq!(c.entry, "skinny_t8_r1h_bf16_bf16");
        assert!(entry_points("skinny").contains(&c.entry));
        assert_eq!((c.grid, c.block), ([125, 1, 1], [512, 1, 1]));
        assert_eq!(c.shared_bytes, 16 * 2 * 32 * 4);
        // The boundary: 119 blocks of 16 take halves, 120 do not.
        assert!(skinny_half(119 * 16, 8) && !skinny_half(120 * 16, 8) && !skinny_half(16, 16));
        // Short K: fewer warps, never below one.
        let c = skinny_call(&shape(17, 1000, 64, DType::F16), false).unwrap();
        assert_eq!(c.entry, "skinny_t24_r1_f16_f16");
        assert_eq!(c.block, [32, 1, 1]);
        assert_eq!(c.params.last(), Some(&Param::I32(0)));
        // Many rows and 32 tokens: two row tiles per block, at most 8 warps.
        let c = skinny_call(&shape(32, 8192, 4096, DType::BF16), true).unwrap();
        assert_eq!(c.entry, "skinny_t32_r2_bf16_bf16");
        assert_eq!((c.grid[0], c.block[0]), (256, 256));
        assert_eq!(c.shared_bytes, 8 * 2 * 4 * 4 * 32 * 4);
        assert!(entry_points("skinny").contains(&c.entry));
        for bad in [
            shape(33, 1000, 1024, DType::BF16),
            shape(4, 1000, 1020, DType::BF16),
            shape(4, 1000, 1024, DType::F32),
            shape(0, 1000, 1024, DType::BF16),
        ] {
            assert!(skinny_call(&bad, true).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn the_default_gemm_rule_is_gemv_for_one_token_then_blas_on_every_gpu_target() {
        let sm90 = Target::Cuda { sm: 90 };
        let sm75 = Target::Cuda { sm: 75 };
        let hip = Target::Hip {
            gfx: "gfx1100".into(),
        };
        let k =
            |target: &Target, t: u32| default_gemm_kind(target, &shape(t, 2048, 1024, DType::BF16));
        for target in [&sm90, &sm75, &hip] {
            assert_eq!(k(target, 1), GemmKind::Gemv, "{target:?} T = 1");
            for t in [2, 8, 9, 32, 33] {
                assert_eq!(k(target, t), GemmKind::Blas, "{target:?} T = {t}");
            }
        }
        let f32 = shape(4, 2048, 1024, DType::F32);
        assert_eq!(default_gemm_kind(&sm90, &f32), GemmKind::Blas);
    }

    #[test]
    fn a_tuned_choice_overrides_the_rule_only_where_its_kernel_takes_the_shape() {
        let mut opts = LowerOptions::for_target(&Target::Cuda { sm: 90 }, 1);
        let s5 = shape(5, 2048, 1024, DType::BF16);
        let s16 = shape(16, 2048, 1024, DType::BF16);
        assert_eq!(choose_gemm(&s5, &opts), GemmKind::Blas);
        opts.tuned.insert(s5, GemmKind::Gemv);
        opts.tuned.insert(s16, GemmKind::Gemv); // gemv cannot run 16 tokens
        assert_eq!(choose_gemm(&s5, &opts), GemmKind::Gemv);
        assert_eq!(choose_gemm(&s16, &opts), GemmKind::Blas);
        let other = shape(5, 4096, 1024, DType::BF16);
        assert_eq!(choose_gemm(&other, &opts), GemmKind::Blas);
    }

    #[test]
    fn kernel_names_follow_the_catalog_convention() {
        assert_eq!(
            kernel_name(
                &Op::RmsNorm {
                    eps: 1e-5,
                    unit_offset: false
                },
                DType::BF16
            ),
            "rms_norm_bf16"
        );
        assert_eq!(
            kernel_name(
                &Op::MatMul {
                    bias: false,
                    out: DType::F32
                },
                DType::BF16
            ),
            "gemm"
        );
    }

    #[test]
    fn integer_operands_are_refused_with_a_clear_error() {
        let e = lower(
            &Op::Add,
            &[tt(DType::I32, &[4]), tt(DType::I32, &[4])],
            &[tt(DType::I32, &[4])],
            Placement::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("bf16, f16 or f32"), "{e}");
    }

    #[test]
    fn the_argmax_gemv_plans_one_pair_per_block_and_token_and_one_counter() {
        let d = DType::BF16;
        // The Qwen3 lm_head at 3 tokens, with the final norm as prologue.
        let (t, n, k) = (3u32, 151_936u32, 1024u32);
        let op = fused(false, DType::F32, true, Epilogue::Argmax);
        let a = vec![tt(d, &[t, k]), tt(d, &[n, k]), tt(d, &[k])];
        let r = vec![tt(DType::I32, &[t])];
        assert_eq!(op.infer(&a).unwrap(), r);
        let opts = LowerOptions::for_target(&Target::Cuda { sm: 90 }, 1);
        let needs = op_needs(&op, &a, &r, &opts).unwrap();
        let blocks = n.div_ceil(GEMV_ROWS_PER_BLOCK) as u64;
        assert_eq!(blocks, 9496);
        let idx = (t as u64 * blocks * 4).div_ceil(256) * 256;
        assert_eq!(needs.counters, 1);
        assert_eq!(needs.scratch_bytes, idx + t as u64 * blocks * 4);
        let at = |region, offset, ty: &TensorType| Operand {
            buf: BufRef {
                region,
                offset,
                bytes: ty.size_bytes(),
            },
            ty: ty.clone(),
        };
        let args = vec![
            at(Region::Io, 0, &a[0]),
            at(Region::Weight(0), 0, &a[1]),
            at(Region::Weight(1), 0, &a[2]),
        ];
        let results = vec![at(Region::Arena, 0, &r[0])];
        let scratch = BufRef {
            region: Region::Arena,
            offset: 8192,
            bytes: needs.scratch_bytes,
        };
        let counters = BufRef {
            region: Region::Counters,
            offset: 8,
            bytes: 4,
        };
        let lower = |s, c| lower_op(&op, &args, &results, s, c, 2, &opts);
        let Lowering::Kernels(ls) = lower(Some(scratch), Some(counters)).unwrap() else {
            panic!("the argmax GEMV lowers to kernels")
        };
        assert_eq!(ls.len(), 1, "one launch: no separate argmax");
        let l = &ls[0];
        assert_eq!(l.entry, "gemv_argmax_norm_t4_bf16_f32");
        assert!(entry_points("gemv").contains(&l.entry));
        assert_eq!(l.grid, [blocks as u32, 1, 1]);
        let buf = |i: usize| match &l.params[i] {
            LaunchParam::Buf(b) => *b,
            p => panic!("parameter {i} is {p:?}"),
        };
        assert_eq!(buf(0), args[0].buf);
        assert_eq!(buf(1), args[1].buf);
        assert_eq!(l.params[2], LaunchParam::Null, "no bias");
        assert_eq!(buf(3), args[2].buf, "the norm weight");
        assert_eq!(buf(4).offset, 8192);
        assert_eq!(buf(5).offset, 8192 + idx);
        assert_eq!((buf(6).region, buf(6).offset), (Region::Counters, 8));
        assert_eq!(buf(7), results[0].buf);
        assert_eq!(
            &l.params[8..],
            &[
                LaunchParam::I32(t as i32),
                LaunchParam::I32(n as i32),
                LaunchParam::I32(k as i32),
                LaunchParam::I32(1),
                LaunchParam::F32(1e-5),
                LaunchParam::I32(1),
            ]
        );
        let small = BufRef {
            bytes: needs.scratch_bytes - 1,
            ..scratch
        };
        let e = lower(Some(small), Some(counters)).unwrap_err().to_string();
        assert!(e.contains("scratch"), "{e}");
        let e = lower(Some(scratch), None).unwrap_err().to_string();
        assert!(e.contains("completion counters"), "{e}");
        // A bias and no norm; f16 logits in the activations' dtype.
        let op = fused(true, DType::F16, false, Epilogue::Argmax);
        let h = DType::F16;
        let c = fused_matmul_call(
            &op,
            &[tt(h, &[1, 64]), tt(h, &[1001, 64]), tt(h, &[1001])],
            false,
        )
        .unwrap();
        assert_eq!(c.entry, "gemv_argmax_t1_f16_f16");
        assert_eq!(&c.params[2..4], &[Param::Arg(2), Param::Null]);
        // Nine tokens are beyond the GEMV.
        let e = fused_matmul_call(
            &op,
            &[tt(h, &[9, 64]), tt(h, &[1001, 64]), tt(h, &[1001])],
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("tokens"), "{e}");
    }
}
