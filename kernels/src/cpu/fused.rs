//! `fused_matmul`: a matmul with an RMSNorm prologue and/or an epilogue
//! (`silu_mul`, `gelu_tanh_mul` of the packed product, a residual `add`, or
//! the `argmax` of each row of the product).
//!
//! The CPU reference is, by definition, the unfused sequence: it runs the
//! very kernels the unfused ops run ([`super::norm`], [`super::matmul`],
//! [`super::elementwise`]) over private scratch in the activation dtype, so
//! every intermediate is rounded exactly where the unfused graph stores it
//! and the result is bit for bit what the unfused ops give on this backend.
//! That is what lets a fused plan and an unfused plan of the same model
//! pick the same greedy tokens on the CPU backend. GPU kernels reorder the
//! sums (norm statistics, dot products) and agree within tolerance.
//!
//! The scratch is allocated per call: it holds `T x K` normed rows and
//! `T x N` products (in the `out` dtype for the argmax epilogue: the
//! logits the unfused matmul would have stored), small for decode; a fused
//! op is never the CPU backend's bottleneck (the weight stream is).
//!
//! Not here: a genuinely fused CPU loop (it would only change the summation
//! order that this module exists to keep).

use super::buf::Buf;
use super::elementwise::{self, Gate};
use super::{matmul, norm, operands, qmatmul, reduce, Result};
use kiln_ir::{DType, Epilogue, Op, PreNorm};

/// An f32-aligned scratch tensor of `len` elements of `dtype`.
struct Scratch {
    words: Vec<u32>,
    dtype: DType,
    len: usize,
}

impl Scratch {
    fn new(dtype: DType, len: usize) -> Scratch {
        Scratch {
            words: vec![0; (len * dtype.size()).div_ceil(4)],
            dtype,
            len,
        }
    }
    fn buf(&mut self) -> Buf {
        Buf {
            ptr: self.words.as_mut_ptr() as *mut u8,
            dtype: self.dtype,
            len: self.len,
        }
    }
}

/// The operands of one `fused_matmul`, in argument order.
#[derive(Clone, Copy)]
pub(crate) struct Operands {
    pub x: Buf,
    pub w: Buf,
    /// The weight's storage and bytes when it is kept quantized.
    pub wq: Option<(kiln_ir::QuantType, *const u8)>,
    pub bias: Option<Buf>,
    /// The prologue's norm weight, with its attributes.
    pub norm: Option<(Buf, PreNorm)>,
    pub residual: Option<Buf>,
}

/// The matmul of the fused op, dense or over the quantized weight.
unsafe fn mm(o: &Operands, x: Buf, (t, k, n): (usize, usize, usize), out: Buf) {
    match o.wq {
        Some((q, w)) => qmatmul::matmul(q, x, w, o.bias, (t, k, n), out),
        None => matmul::matmul(x, o.w, o.bias, t, k, n, out),
    }
}

/// `fused_matmul` over `t` rows of `k` inputs and `n` weight rows.
///
/// # Safety
/// As [`super::execute`] after its checks: inputs valid for reads, `out`
/// valid for writes and overlapping no input.
pub(crate) unsafe fn fused_matmul(
    op: &Op,
    o: Operands,
    post: Epilogue,
    (t, k, n): (usize, usize, usize),
    out: Buf,
) -> Result<()> {
    let d = o.x.dtype;
    let mut normed = Scratch::new(d, if o.norm.is_some() { t * k } else { 0 });
    let x = match o.norm {
        Some((w, p)) => {
            let b = normed.buf();
            norm::rms_norm(o.x, w, (t, k), p.eps, p.unit_offset, b);
            b
        }
        None => o.x,
    };
    // The argmax epilogue's product is the logits, in the op's `out` dtype.
    let yd = match (post, op) {
        (Epilogue::Argmax, Op::FusedMatMul { out, .. }) => *out,
        _ => d,
    };
    let mut y = Scratch::new(yd, if post == Epilogue::None { 0 } else { t * n });
    let yb = y.buf();
    match (post, o.residual) {
        (Epilogue::None, _) => mm(&o, x, (t, k, n), out),
        (Epilogue::SiluMul, _) => {
            mm(&o, x, (t, k, n), yb);
            elementwise::gated_mul_packed(Gate::Silu, yb, t, n / 2, out)
        }
        (Epilogue::GeluTanhMul, _) => {
            mm(&o, x, (t, k, n), yb);
            elementwise::gated_mul_packed(Gate::GeluTanh, yb, t, n / 2, out)
        }
        (Epilogue::Residual, Some(r)) => {
            mm(&o, x, (t, k, n), yb);
            elementwise::add(yb, r, out)
        }
        (Epilogue::Argmax, _) => {
            mm(&o, x, (t, k, n), yb);
            reduce::argmax(yb, (t, n), out)
        }
        (Epilogue::Residual, None) => {
            return Err(operands(
                op,
                "the residual epilogue needs a residual operand",
            ))
        }
    }
    Ok(())
}
