//! Elementwise ops: `silu_mul`, `gelu_tanh_mul` (two-argument and packed
//! forms), `add` and `scale`.
//!
//! Exact f32 expressions (normative; `exp`/`tanh` are libm's `expf`/`tanhf`):
//! * `silu(g) = g / (1 + exp(-g))`, result `silu(g) * u`;
//! * `gelu_tanh(g) = (0.5 * g) * (1 + tanh(C * (g + 0.044715 * ((g * g) * g))))`
//!   with `C = sqrt(2/pi)` as f32 (`0.7978846`), result `gelu_tanh(g) * u`;
//! * `add`: `a + b`;
//! * `scale`: `y = x * factor`, then `cap * tanhf(y / cap)` under a softcap.
//!
//! Each result is rounded to D once. Work goes through f32 scratch in chunks
//! (rows for the packed form), each read completely before it is written, so
//! a result may be the very buffer of the argument `may_reuse` names,
//! including the packed form writing `[T, I]` over its `[T, 2I]` input (row
//! `t` of the result only covers input rows `<= t`, processed in order).
//! A single long packed row (a decode step's MLP) is cut into column chunks
//! shared with helper threads; each element's arithmetic is unchanged.

use super::buf::Buf;
use super::par;

/// Elements per scratch chunk of the flat forms.
const CHUNK: usize = 1024;

/// Which gate activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    Silu,
    GeluTanh,
}

/// `sqrt(2/pi)` rounded to f32.
pub const SQRT_2_OVER_PI: f32 = 0.797_884_6;

#[inline]
pub fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

#[inline]
pub fn gelu_tanh(g: f32) -> f32 {
    (0.5 * g) * (1.0 + (SQRT_2_OVER_PI * (g + 0.044715 * (g * g * g))).tanh())
}

#[inline]
fn apply(kind: Gate, gate: &mut [f32], up: &[f32]) {
    match kind {
        Gate::Silu => {
            for (g, u) in gate.iter_mut().zip(up) {
                *g = silu(*g) * u;
            }
        }
        Gate::GeluTanh => {
            for (g, u) in gate.iter_mut().zip(up) {
                *g = gelu_tanh(*g) * u;
            }
        }
    }
}

/// Two-argument form over `n` elements.
pub(crate) unsafe fn gated_mul(kind: Gate, gate: Buf, up: Buf, n: usize, out: Buf) {
    let mut g = vec![0f32; CHUNK.min(n)];
    let mut u = vec![0f32; CHUNK.min(n)];
    let mut start = 0;
    while start < n {
        let len = CHUNK.min(n - start);
        gate.load(start, &mut g[..len]);
        up.load(start, &mut u[..len]);
        apply(kind, &mut g[..len], &u[..len]);
        out.store(start, &g[..len]);
        start += len;
    }
}

/// One row of the packed form from this many outputs on is cut into
/// column chunks that helper threads share (the gate's `expf`/`tanhf` per
/// element is most of the op).
const PARALLEL_MIN: usize = 1024;
/// Outputs per chunk of a parallel row.
const PARALLEL_CHUNK: usize = 256;

/// Packed form: `gate_up: [t, 2i]` -> `[t, i]`.
pub(crate) unsafe fn gated_mul_packed(kind: Gate, gate_up: Buf, t: usize, i: usize, out: Buf) {
    if t == 1 && i >= PARALLEL_MIN {
        // One row in column chunks: chunk `c` reads gate and up columns
        // `c0..c1` and writes output columns `c0..c1`, which in place are
        // its own gate columns (already read), never another chunk's input.
        par::for_each_chunk(i.div_ceil(PARALLEL_CHUNK), |c| {
            let c0 = c * PARALLEL_CHUNK;
            let len = PARALLEL_CHUNK.min(i - c0);
            let (mut g, mut u) = ([0f32; PARALLEL_CHUNK], [0f32; PARALLEL_CHUNK]);
            // SAFETY: as the serial loop below, over disjoint columns.
            unsafe {
                gate_up.load(c0, &mut g[..len]);
                gate_up.load(i + c0, &mut u[..len]);
                apply(kind, &mut g[..len], &u[..len]);
                out.store(c0, &g[..len]);
            }
        });
        return;
    }
    let mut row = vec![0f32; 2 * i];
    for r in 0..t {
        gate_up.load(r * 2 * i, &mut row);
        let (g, u) = row.split_at_mut(i);
        apply(kind, g, u);
        out.store(r * i, g);
    }
}

/// `add(a, b)` over all elements.
pub(crate) unsafe fn add(a: Buf, b: Buf, out: Buf) {
    let n = a.len;
    let mut x = vec![0f32; CHUNK.min(n)];
    let mut y = vec![0f32; CHUNK.min(n)];
    let mut start = 0;
    while start < n {
        let len = CHUNK.min(n - start);
        a.load(start, &mut x[..len]);
        b.load(start, &mut y[..len]);
        for (p, q) in x[..len].iter_mut().zip(&y[..len]) {
            *p += q;
        }
        out.store(start, &x[..len]);
        start += len;
    }
}

/// `scale(x)`: `x * factor`, softcapped when `softcap` is set.
pub(crate) unsafe fn scale(x: Buf, factor: f32, softcap: Option<f32>, out: Buf) {
    let n = x.len;
    let mut v = vec![0f32; CHUNK.min(n)];
    let mut start = 0;
    while start < n {
        let len = CHUNK.min(n - start);
        x.load(start, &mut v[..len]);
        for e in &mut v[..len] {
            *e = scale_one(*e, factor, softcap);
        }
        out.store(start, &v[..len]);
        start += len;
    }
}

/// One element of `scale`, the normative expression.
#[inline]
pub fn scale_one(x: f32, factor: f32, softcap: Option<f32>) -> f32 {
    let y = x * factor;
    match softcap {
        Some(cap) => cap * (y / cap).tanh(),
        None => y,
    }
}
