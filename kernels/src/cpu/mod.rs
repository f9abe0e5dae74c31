//! CPU reference kernels: one function per [`Op`], bf16/f16/f32 storage with
//! f32 accumulation. They are the oracle the GPU backends are checked against
//! and the CPU backend's real kernels.
//!
//! Contract of [`execute`]: operands are raw pointers into backend memory,
//! because results may alias arguments (in-place KV writes, in-place
//! elementwise reuse decided by the planner). Each kernel must be correct
//! when a result aliases the argument the op's `may_reuse`/`aliases` names.
//!
//! # Numerics (every backend must agree with these)
//! * Values are loaded from their storage dtype to f32 exactly, all
//!   arithmetic is f32, and each result is rounded to its result dtype once,
//!   at the end, with round-to-nearest-even (the `half` crate's conversions,
//!   `__float2bfloat16_rn` / `__float2half_rn` on GPUs). Fused ops round where
//!   the unfused sequence would (see each op's module).
//! * No fused multiply-add contraction: expressions are evaluated as written
//!   in the kernel modules (Rust never contracts). A GPU kernel that wants to
//!   be bit-identical must use `__fmul_rn`/`__fadd_rn` or `--fmad=false`;
//!   otherwise it agrees within the tolerances the tests state. The one
//!   exception is the dot products of `matmul` and attention scores, which
//!   use explicit fma by design (`dot`).
//! * Reductions (dot products, sums of squares) accumulate in f32 in a fixed
//!   order that does not depend on the SIMD level or the thread count, so the
//!   CPU backend is deterministic on every x86_64 and non-x86 host.
//! * Transcendentals are libm's f32 functions (`sinf`, `cosf`, `expf`,
//!   `tanhf`), except softmax's exp, which is [`math::exp`] (within 2 ulp).
//!   GPU `sinf`/`expf` differ by an ulp or two, which the tolerances absorb.
//!
//! # Threads and SIMD
//! Matmul, attention and the one-row packed `silu_mul`/`gelu_tanh_mul`
//! split their work between the calling thread and
//! rayon's current pool (the global pool, sized by `RAYON_NUM_THREADS`, or
//! the pool whose `install` the backend calls `execute` from); results do
//! not depend on the thread count. Hot loops are compiled for the baseline
//! target, AVX2 and AVX-512 and picked at run time; `KILN_CPU_SIMD=generic`
//! or `avx2` caps the level (results are the same bits at every level).
//!
//! # Layout
//! [`convert`] dtype conversions (also the public `to_f32`/`from_f32`),
//! `buf` the raw-memory view the kernels share, `simd` the instruction-set
//! dispatch, [`dot`] the dot-product kernels (and their summation order),
//! `par` the parallel loop, [`math`] vectorizable f32 math, and one module
//! per op family: [`matmul`], [`norm`], [`rope`], [`attention`], [`kv`],
//! [`elementwise`], [`gather`], [`reduce`], [`sample`] (the in-graph sampler
//! and its RNG), and `fused` (`fused_matmul`, the unfused kernels in
//! sequence).
//!
//! Not here: the backend (memory, capture, replay) lives in the runtime; the
//! GPU kernels live next to this module. Only little-endian hosts are
//! supported (tensor bytes are the device's native layout).

#[cfg(target_endian = "big")]
compile_error!("kiln's CPU kernels assume a little-endian host");

pub mod attention;
mod buf;
pub mod collective;
pub mod convert;
pub mod dot;
pub mod elementwise;
mod fused;
pub mod gather;
pub mod kv;
pub mod math;
pub mod matmul;
pub mod norm;
mod par;
mod qgroup;
mod qmatmul;
pub mod reduce;
pub mod rope;
pub mod sample;
mod simd;
pub mod stream;

use buf::Buf;
use kiln_ir::{Op, TensorType};

pub use convert::{from_f32, from_i32, round_f32, to_f32, to_i32};
pub use rope::{rope_cos_sin, rope_inv_freq_f32};

/// A dense tensor in backend memory.
#[derive(Clone, Debug)]
pub struct RawTensor {
    pub ptr: *mut u8,
    pub ty: TensorType,
}

/// A kernel refused its operands.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The operands do not fit the op: wrong count, types, shapes, pointers
    /// or an overlap the op does not allow. A caller (planner) bug.
    #[error("cpu kernel `{op}`: {message}")]
    Operands { op: &'static str, message: String },
    /// A value read from an integer operand (token id, slot, block table
    /// entry, context length) is out of range. Nothing was written.
    #[error("cpu kernel `{op}`: {message}")]
    Index { op: &'static str, message: String },
    /// A collective could not complete: another rank failed or did not
    /// arrive in time (the message names it). Nothing was written.
    #[error("collective `{op}` did not complete: {message}")]
    Collective { op: &'static str, message: String },
}

pub(crate) type Result<T> = std::result::Result<T, KernelError>;

pub(crate) fn operands(op: &Op, message: impl Into<String>) -> KernelError {
    KernelError::Operands {
        op: op.mnemonic(),
        message: message.into(),
    }
}

pub(crate) fn index_error(op: &Op, message: impl Into<String>) -> KernelError {
    KernelError::Index {
        op: op.mnemonic(),
        message: message.into(),
    }
}

/// Executes `op` on `args`, writing `results`.
///
/// Operand types are checked against [`Op::infer`]; pointers must be non-null
/// and aligned to their dtype; a result may overlap an argument only when the
/// op's `aliases()` or `may_reuse()` lists the pair, and then only as the very
/// same buffer (same pointer). An `aliases()` result given its own buffer
/// (different pointer, no overlap) first receives a copy of the argument.
/// Integer operands (ids, slots, block tables, lengths) are validated before
/// anything is written: on [`KernelError::Index`] no result was modified.
///
/// # Safety
/// Every pointer must be valid for its tensor's `size_bytes()` (reads for
/// arguments, writes for results) for the duration of the call, and no other
/// thread may access result memory during the call.
pub unsafe fn execute(
    op: &Op,
    args: &[RawTensor],
    results: &[RawTensor],
) -> std::result::Result<(), KernelError> {
    check(op, args, results)?;
    execute_prechecked(op, args, results)
}

/// The operand checks of [`execute`] alone: types against [`Op::infer`],
/// storage, null and misaligned pointers, overlaps. They depend only on the
/// operands' types and addresses, so a caller that runs the same launch
/// many times over the same memory (the CPU backend's graph replay) checks
/// it once and then calls [`execute_prechecked`].
pub fn check(
    op: &Op,
    args: &[RawTensor],
    results: &[RawTensor],
) -> std::result::Result<(), KernelError> {
    check_operands(op, args, results)
}

/// [`execute`] without its operand checks (integer operands read from
/// memory, such as token ids and block tables, are still validated before
/// anything is written).
///
/// # Safety
/// As [`execute`], and [`check`] must have accepted these very operands
/// (the same op, types and pointers).
pub unsafe fn execute_prechecked(
    op: &Op,
    args: &[RawTensor],
    results: &[RawTensor],
) -> std::result::Result<(), KernelError> {
    // Give distinct-buffer in-place results their argument's contents.
    for &(r, a) in op.aliases() {
        if results[r].ptr != args[a].ptr {
            let n = args[a].ty.size_bytes() as usize;
            std::ptr::copy_nonoverlapping(args[a].ptr, results[r].ptr, n);
        }
    }
    let a: Vec<Buf> = args.iter().map(Buf::of).collect();
    // A weight kept quantized (argument 1 of the ops that read one; the
    // checks refused it anywhere else): its bytes, read by `qmatmul`.
    let wq = args
        .get(1)
        .and_then(|w| w.ty.storage.map(|q| (q, w.ptr as *const u8)));
    let r: Vec<Buf> = results.iter().map(Buf::of).collect();
    let dims = |i: usize| args[i].ty.shape.dims().iter().map(|&d| d as usize);
    let d2 = |i: usize| {
        let mut it = dims(i);
        (it.next().unwrap_or(1), it.next().unwrap_or(1))
    };
    match op {
        Op::Embedding => match wq {
            Some((q, table)) => qmatmul::embedding(op, q, a[0], table, d2(1), r[0]),
            None => gather::embedding(op, a[0], a[1], d2(1), r[0]),
        },
        Op::RmsNorm { eps, unit_offset } => {
            norm::rms_norm(a[0], a[1], d2(0), *eps, *unit_offset, r[0]);
            Ok(())
        }
        Op::AddRmsNorm { eps, unit_offset } => {
            norm::add_rms_norm(a[0], a[1], a[2], d2(0), *eps, *unit_offset, r[0], r[1]);
            Ok(())
        }
        Op::MatMul { bias, .. } => {
            let (t, k) = d2(0);
            let (n, _) = d2(1);
            match wq {
                Some((q, w)) => qmatmul::matmul(q, a[0], w, bias.then(|| a[2]), (t, k, n), r[0]),
                None => matmul::matmul(a[0], a[1], bias.then(|| a[2]), t, k, n, r[0]),
            }
            Ok(())
        }
        Op::HeadRmsNorm {
            heads,
            head_dim,
            eps,
            unit_offset,
        } => {
            let shape = norm::Heads {
                rows: d2(0).0,
                heads: *heads as usize,
                head_dim: *head_dim as usize,
            };
            norm::head_rms_norm(a[0], a[1], shape, *eps, *unit_offset, r[0]);
            Ok(())
        }
        Op::Rope {
            heads,
            head_dim,
            rope,
        } => {
            rope::rope(a[0], a[1], rope, *heads, *head_dim, r[0]);
            Ok(())
        }
        Op::KvWrite => kv::kv_write(op, a[0], a[1], a[2], d2(0), r[0], r[1], d2(3).0),
        Op::PagedAttention(..) => {
            let (b, m) = d2(3);
            attention::paged_attention(op, a[0], r[0], a[1], a[2], a[3], a[4], b, m, d2(1).0)
        }
        Op::AttentionPartials { .. } => {
            let (b, m) = d2(3);
            attention::attention_partials(op, a[0], r[0], a[1], a[2], a[3], a[4], b, m, d2(1).0)
        }
        Op::AttentionCombine { .. } => {
            attention::attention_combine(op, a[0], r[0], d2(0).0);
            Ok(())
        }
        Op::QkvRopeKvWrite { .. } => {
            let norms = (a.len() == 7).then(|| (a[5], a[6]));
            kv::qkv_rope_kv_write(op, a[0], a[1], a[2], norms, r[0], r[1], r[2], d2(3).0)
        }
        Op::RopeAttention { attn, .. } => {
            // The definition, step by step: the roped q goes to a host
            // buffer of this call (the GPU kernel keeps it on chip).
            let (rope_op, attn_op) = op.split_rope_attention().expect("rope_attention");
            let norms = (a.len() == 9).then(|| (a[7], a[8]));
            let rows = d2(0).0;
            let len = rows * (attn.heads as usize) * (attn.head_dim as usize);
            let dtype = args[0].ty.dtype;
            // u64 words: aligned for every float dtype.
            let mut qmem = vec![0u64; (len * dtype.size()).div_ceil(8)];
            let q = Buf {
                ptr: qmem.as_mut_ptr() as *mut u8,
                dtype,
                len,
            };
            let slots = d2(3).0;
            kv::qkv_rope_kv_write(&rope_op, a[0], a[1], a[2], norms, q, r[1], r[2], slots)?;
            let (b, m) = d2(5);
            attention::paged_attention(&attn_op, q, r[0], r[1], r[2], a[5], a[6], b, m, slots)
        }
        Op::MatMulQkvRope {
            bias, pre, qk_norm, ..
        } => {
            // The definition, step by step: the packed qkv goes to a host
            // buffer of this call (the GPU kernel keeps it in scratch).
            let dtype = args[0].ty.dtype;
            let (mm, rope_op) = op.split_matmul_qkv_rope(dtype).expect("matmul_qkv_rope");
            let (t, k) = d2(0);
            let (n, _) = d2(1);
            let len = t * n;
            // u64 words: aligned for every float dtype.
            let mut qkv_mem = vec![0u64; (len * dtype.size()).div_ceil(8)];
            let qkv = Buf {
                ptr: qkv_mem.as_mut_ptr() as *mut u8,
                dtype,
                len,
            };
            let mut i = 2;
            let mut next = |present: bool| {
                let b = present.then(|| a[i]);
                i += present as usize;
                b
            };
            let o = fused::Operands {
                x: a[0],
                w: a[1],
                wq,
                bias: next(*bias),
                norm: next(pre.is_some()).zip(*pre),
                residual: None,
            };
            fused::fused_matmul(&mm, o, kiln_ir::Epilogue::None, (t, k, n), qkv)?;
            let m = 2 + *bias as usize + pre.is_some() as usize;
            let norms = qk_norm.map(|_| (a[m + 4], a[m + 5]));
            let slots = d2(m + 2).0;
            kv::qkv_rope_kv_write(
                &rope_op,
                qkv,
                a[m],
                a[m + 1],
                norms,
                r[0],
                r[1],
                r[2],
                slots,
            )
        }
        Op::SiluMul | Op::GeluTanhMul => {
            let kind = if matches!(op, Op::SiluMul) {
                elementwise::Gate::Silu
            } else {
                elementwise::Gate::GeluTanh
            };
            let (t, w) = d2(0);
            if a.len() == 2 {
                elementwise::gated_mul(kind, a[0], a[1], t * w, r[0]);
            } else {
                elementwise::gated_mul_packed(kind, a[0], t, w / 2, r[0]);
            }
            Ok(())
        }
        Op::Add => {
            elementwise::add(a[0], a[1], r[0]);
            Ok(())
        }
        Op::GatherLast { group } => {
            gather::gather_last(a[0], d2(0), *group as usize, r[0]);
            Ok(())
        }
        Op::Argmax => {
            reduce::argmax(a[0], d2(0), r[0]);
            Ok(())
        }
        Op::Scale { factor, softcap } => {
            elementwise::scale(a[0], *factor, *softcap, r[0]);
            Ok(())
        }
        Op::AcceptGreedy { spec } => {
            reduce::accept_greedy(a[0], a[1], *spec as usize, r[0]);
            Ok(())
        }
        Op::Sample => {
            sample::sample(a[0], a[1], a[2], a.get(3).copied(), d2(0), r[0]);
            Ok(())
        }
        Op::AllReduce { .. } | Op::ShardedArgmax { .. } => {
            collective::execute_collective(op, args, results, None)
        }
        Op::FusedMatMul {
            bias, pre, post, ..
        } => {
            let (t, k) = d2(0);
            let (n, _) = d2(1);
            let mut i = 2;
            let mut next = |present: bool| {
                let b = present.then(|| a[i]);
                i += present as usize;
                b
            };
            let o = fused::Operands {
                x: a[0],
                w: a[1],
                wq,
                bias: next(*bias),
                norm: next(pre.is_some()).zip(*pre),
                residual: next(*post == kiln_ir::Epilogue::Residual),
            };
            fused::fused_matmul(op, o, *post, (t, k, n), r[0])
        }
    }
}

/// Type, pointer and overlap checks shared by every op.
fn check_operands(op: &Op, args: &[RawTensor], results: &[RawTensor]) -> Result<()> {
    let arg_types: Vec<TensorType> = args.iter().map(|t| t.ty.clone()).collect();
    let want = op
        .infer(&arg_types)
        .map_err(|e| operands(op, format!("operands do not type-check: {e}")))?;
    if results.len() != want.len() {
        return Err(operands(
            op,
            format!(
                "expected {} result(s) ({}), got {}",
                want.len(),
                list(&want),
                results.len()
            ),
        ));
    }
    for (i, (r, w)) in results.iter().zip(&want).enumerate() {
        if r.ty != *w {
            return Err(operands(
                op,
                format!("result {i} must be {w} for these arguments, got {}", r.ty),
            ));
        }
    }
    for (i, t) in args.iter().enumerate() {
        if let Some(q) = t.ty.storage {
            if kiln_ir::quantized_operand(op) != Some(i) {
                return Err(operands(
                    op,
                    format!("argument {i} ({}) is stored {q}, but this op reads only dense operands there", t.ty),
                ));
            }
            if q.row_bytes(t.ty.shape.dims().get(1).copied().unwrap_or(0) as usize)
                .is_none()
            {
                return Err(operands(
                    op,
                    format!(
                        "argument {i} ({}) is not a whole number of {q} blocks per row",
                        t.ty
                    ),
                ));
            }
        }
    }
    if results.iter().any(|r| r.ty.storage.is_some()) {
        return Err(operands(op, "results are never stored quantized"));
    }
    let named = args
        .iter()
        .enumerate()
        .map(|(i, t)| ("argument", i, t))
        .chain(results.iter().enumerate().map(|(i, t)| ("result", i, t)));
    for (what, i, t) in named {
        if t.ptr.is_null() {
            return Err(operands(
                op,
                format!("{what} {i} ({}) is a null pointer", t.ty),
            ));
        }
        let align = t.ty.dtype.size();
        if (t.ptr as usize) & (align - 1) != 0 {
            return Err(operands(
                op,
                format!(
                    "{what} {i} ({}) at {:p} is not aligned to {align} bytes; allocate tensors at dtype-aligned addresses",
                    t.ty, t.ptr
                ),
            ));
        }
    }
    let range = |t: &RawTensor| {
        let s = t.ptr as usize;
        (s, s + t.ty.size_bytes() as usize)
    };
    let overlaps = |x: &RawTensor, y: &RawTensor| {
        let (a0, a1) = range(x);
        let (b0, b1) = range(y);
        a0 < b1 && b0 < a1
    };
    for (ri, r) in results.iter().enumerate() {
        for (ai, a) in args.iter().enumerate() {
            if !overlaps(r, a) {
                continue;
            }
            let allowed = op.aliases().contains(&(ri, ai)) || op.may_reuse().contains(&(ri, ai));
            if !allowed {
                return Err(operands(
                    op,
                    format!(
                        "result {ri} ({}) overlaps argument {ai} ({}), which this op does not allow; give the result its own buffer",
                        r.ty, a.ty
                    ),
                ));
            }
            if r.ptr != a.ptr {
                return Err(operands(
                    op,
                    format!(
                        "result {ri} ({}) partially overlaps argument {ai} ({}); an in-place result must start at its argument's address",
                        r.ty, a.ty
                    ),
                ));
            }
        }
        for (rj, other) in results.iter().enumerate().skip(ri + 1) {
            if overlaps(r, other) {
                return Err(operands(
                    op,
                    format!("results {ri} and {rj} overlap; every result needs its own buffer"),
                ));
            }
        }
    }
    Ok(())
}

fn list(types: &[TensorType]) -> String {
    types
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// An owned, 4-byte aligned byte buffer (a `Vec<u8>` is only 1-aligned).
struct Aligned {
    words: Vec<u32>,
    len: usize,
}

impl Aligned {
    fn from_bytes(bytes: &[u8]) -> Aligned {
        let mut a = Aligned::zeroed(bytes.len());
        a.bytes_mut().copy_from_slice(bytes);
        a
    }
    fn zeroed(len: usize) -> Aligned {
        Aligned {
            words: vec![0; len.div_ceil(4)],
            len,
        }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `words` holds at least `len` initialized bytes.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.len) }
    }
    fn ptr(&mut self) -> *mut u8 {
        self.words.as_mut_ptr() as *mut u8
    }
}

/// Safe wrapper around [`execute`] for tests and tools: takes each argument
/// as its type and little-endian bytes, allocates the results (types from
/// [`Op::infer`]) and returns their bytes in result order.
///
/// In-place results (`op.aliases()`, e.g. the KV caches of `kv_write`) start
/// as a copy of their argument and are returned as the updated copy; the
/// argument vectors are never modified.
pub fn execute_on_vecs(
    op: &Op,
    args: &[(TensorType, Vec<u8>)],
) -> std::result::Result<Vec<Vec<u8>>, KernelError> {
    for (i, (ty, bytes)) in args.iter().enumerate() {
        if bytes.len() as u64 != ty.size_bytes() {
            return Err(operands(
                op,
                format!(
                    "argument {i} is declared {ty} ({} bytes) but holds {} bytes",
                    ty.size_bytes(),
                    bytes.len()
                ),
            ));
        }
    }
    let types: Vec<TensorType> = args.iter().map(|(t, _)| t.clone()).collect();
    let result_types = op
        .infer(&types)
        .map_err(|e| operands(op, format!("operands do not type-check: {e}")))?;
    let mut arg_bufs: Vec<Aligned> = args.iter().map(|(_, b)| Aligned::from_bytes(b)).collect();
    let mut res_bufs: Vec<Aligned> = result_types
        .iter()
        .map(|t| Aligned::zeroed(t.size_bytes() as usize))
        .collect();
    let mut arg_ptrs: Vec<*mut u8> = arg_bufs.iter_mut().map(|b| b.ptr()).collect();
    for &(r, a) in op.aliases() {
        res_bufs[r] = Aligned::from_bytes(&args[a].1);
        arg_ptrs[a] = res_bufs[r].ptr();
    }
    let raw_args: Vec<RawTensor> = types
        .iter()
        .zip(&arg_ptrs)
        .map(|(ty, &ptr)| RawTensor {
            ptr,
            ty: ty.clone(),
        })
        .collect();
    let raw_results: Vec<RawTensor> = result_types
        .iter()
        .zip(res_bufs.iter_mut())
        .map(|(ty, b)| RawTensor {
            ptr: b.ptr(),
            ty: ty.clone(),
        })
        .collect();
    // SAFETY: every pointer addresses an owned buffer of exactly its type's
    // size, aligned to 4 bytes; results alias arguments only for `aliases()`
    // pairs, as the same buffer.
    unsafe { execute(op, &raw_args, &raw_results)? };
    drop(arg_bufs);
    Ok(res_bufs
        .into_iter()
        .map(|mut b| b.bytes_mut().to_vec())
        .collect())
}
