//! Straightforward f64 implementations of the ops, written from op.rs's
//! typing rules and the kernel modules' documented recipes, sharing no code
//! with the kernels. Inputs are the values the tensors actually store.

/// `x[t,k] @ w[n,k]^T (+ bias)`, and per output `sum |x*w|` (for the f32
/// accumulation error bound).
pub fn matmul(
    x: &[f64],
    w: &[f64],
    bias: Option<&[f64]>,
    t: usize,
    k: usize,
    n: usize,
) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; t * n];
    let mut mag = vec![0.0; t * n];
    for i in 0..t {
        for j in 0..n {
            let mut s = 0.0;
            let mut m = 0.0;
            for kk in 0..k {
                s += x[i * k + kk] * w[j * k + kk];
                m += (x[i * k + kk] * w[j * k + kk]).abs();
            }
            if let Some(b) = bias {
                s += b[j];
                m += b[j].abs();
            }
            out[i * n + j] = s;
            mag[i * n + j] = m;
        }
    }
    (out, mag)
}

/// RMSNorm of one vector: `x / sqrt(mean(x^2) + eps) * w` (or `(1 + w)`).
pub fn rms_norm(x: &[f64], w: &[f64], eps: f64, unit_offset: bool) -> Vec<f64> {
    let mean = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (mean + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, g)| v * r * if unit_offset { 1.0 + g } else { *g })
        .collect()
}

/// The angle of frequency `i` at `pos` as the documented recipe makes it:
/// an f32 product of the f32 position and the f32 inverse frequency.
pub fn rope_angle_f32(pos: i32, inv_freq: f64) -> f64 {
    ((pos as f32) * (inv_freq as f32)) as f64
}

/// Rotate-half RoPE of one head given its angles.
pub fn rope_head(x: &[f64], angles: &[f64]) -> Vec<f64> {
    let half = x.len() / 2;
    let mut out = vec![0.0; x.len()];
    for i in 0..half {
        let (c, s) = (angles[i].cos(), angles[i].sin());
        out[i] = x[i] * c - x[i + half] * s;
        out[i + half] = x[i + half] * c + x[i] * s;
    }
    out
}

pub fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

pub fn gelu_tanh(g: f64) -> f64 {
    0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g)).tanh())
}

/// Attributes of a paged attention case.
#[derive(Clone, Debug)]
pub struct Attn {
    pub heads: usize,
    pub kv_heads: usize,
    pub hd: usize,
    pub query: usize,
    pub block_size: usize,
    pub scale: f64,
    pub window: Option<usize>,
    pub softcap: Option<f64>,
}

/// Paged attention straight from the spec: one query row at a time.
pub fn paged_attention(
    a: &Attn,
    q: &[f64],
    kc: &[f64],
    vc: &[f64],
    tables: &[i32],
    m: usize,
    lens: &[i32],
) -> Vec<f64> {
    let batch = lens.len();
    let (qw, kw) = (a.heads * a.hd, a.kv_heads * a.hd);
    let mut out = vec![0.0; batch * a.query * qw];
    for b in 0..batch {
        let ctx = lens[b] as usize;
        for i in 0..a.query {
            let pos = ctx - a.query + i;
            let first = match a.window {
                Some(w) if pos + 1 > w => pos + 1 - w,
                _ => 0,
            };
            let row = b * a.query + i;
            for h in 0..a.heads {
                let g = h / (a.heads / a.kv_heads);
                let qv = &q[row * qw + h * a.hd..row * qw + (h + 1) * a.hd];
                let slot_of = |p: usize| {
                    tables[b * m + p / a.block_size] as usize * a.block_size + p % a.block_size
                };
                let scores: Vec<f64> = (first..=pos)
                    .map(|p| {
                        let kv = &kc[slot_of(p) * kw + g * a.hd..][..a.hd];
                        let mut s = qv.iter().zip(kv).map(|(x, y)| x * y).sum::<f64>() * a.scale;
                        if let Some(cap) = a.softcap {
                            s = cap * (s / cap).tanh();
                        }
                        s
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let l: f64 = e.iter().sum();
                for d in 0..a.hd {
                    let mut acc = 0.0;
                    for (p, ep) in (first..=pos).zip(&e) {
                        acc += ep * vc[slot_of(p) * kw + g * a.hd + d];
                    }
                    out[row * qw + h * a.hd + d] = acc / l;
                }
            }
        }
    }
    out
}
