//! `sample`: the in-graph sampler's reference semantics, its counter-based
//! RNG (Philox4x32-10) and the CPU kernel.
//!
//! Why it exists: a serving plan draws each row's next token inside the
//! graph, from per-row parameters staged like token ids, so a batch mixes
//! greedy and sampled rows without host round trips. The GPU kernel
//! (`kernels/gpu/sampling.cu`) implements exactly the algorithm written
//! here; everything after the per-token probability is integer arithmetic,
//! so for the same logits the CPU and the GPU pick the same token for the
//! same random number (the one floating-point step, [`prob`], is written
//! with explicit fma and no contraction on both, see below).
//!
//! # Semantics (normative; the GPU kernel follows it step by step)
//! Per row with logits `x[0..V]` (loaded to f32), parameters
//! `params = [temperature, top_p, min_p, 0]` (f32) and
//! `seeds = [top_k, seed_lo, seed_hi, counter]` (i32), and, in plans
//! compiled with penalty slots, the row's `penalties` (i32, `2 + 2P` words:
//! presence and frequency as f32 bits, then `P` pairs `(token, count)`):
//! 0. **Penalties** ([`penalize`]): the pairs are a list sorted by token;
//!    it ends at the first pair whose token is outside `[0, V)` or not
//!    greater than the previous pair's (padding is token `-1`). Each listed
//!    token with `count > 0` becomes
//!    `(x - presence) - frequency * (count as f32)`, rounded in f32 after
//!    each operation (no fma), everything else stays as it is. When
//!    presence and frequency are both 0 nothing changes, so a row without
//!    penalties is bit for bit what it is in a plan without them. Every
//!    later step, greedy included, sees the penalised logits.
//! 1. **Greedy**: when `temperature` is not `> 0`, or the row has no finite
//!    maximum (all NaN, or its maximum is infinite), the result is
//!    [`super::reduce::argmax_row`], bit for bit the `argmax` op.
//! 2. **Probabilities**: `m = max(x)` over non-NaN entries;
//!    `p_i = prob((x_i - m) / temperature)` in f32, 0 for NaN; `p_max = 1`.
//!    Each token's integer weight is `w_i = trunc(p_i * 2^40)` (tokens under
//!    `2^-40` of the top token weigh 0 and are never drawn).
//! 3. **Filters**, all thresholds on the bit pattern of `p` (monotone for
//!    `p >= 0`), so ties at a threshold are all kept:
//!    * top-k (`0 < top_k < V`): `tk` = the `top_k`-th largest `p`
//!      (counting multiplicity); otherwise `tk = 0`.
//!    * top-p (`top_p < 1`): over the tokens with `p >= tk`, with
//!      `Zk = sum w` and `P = max(1, floor(top_p * Zk))` (in f64), `tp` = the
//!      largest `p` value such that the weight of tokens with `p >= tp` is at
//!      least `P`: the smallest prefix of most likely tokens holding mass
//!      `top_p` of what top-k kept (serve's order: top-k, then top-p on the
//!      renormalized top-k distribution).
//!    * min-p (`min_p > 0`): `tm = min(min_p, 1)`, i.e. `p >= min_p * p_max`.
//!
//!    Kept: `p >= max(tk, tp, tm)`; the top token always is.
//! 4. **Draw**: `r = philox(seed, counter)[0] >> 8` (24 bits), `Z = sum w`
//!    over the kept tokens, `target = floor(Z * r / 2^24)`; the token is the
//!    first kept index `i` (in index order) whose inclusive prefix sum of
//!    weights exceeds `target`.
//!
//! The RNG input is `(seed, counter)` only: the row a sequence occupies is
//! deliberately not part of it, so a seeded sequence draws the same tokens
//! whatever else is in the batch; the counter is the index in the sequence
//! of the token being drawn, so preemption and recompute replay the same
//! draws.
//!
//! Where CPU and GPU can differ: nowhere in the integer steps. [`prob`] is
//! sub, IEEE div, mul, floor, explicit fma and a power-of-two scale, written
//! with `__fsub_rn`/`__fdiv_rn`/`__fmul_rn`/`fmaf` on the GPU, so its bits
//! match too; a device that flushes or rounds differently would move a
//! token only where two tokens' prefix sums straddle `target` within that
//! difference (a floating-point near-tie).
//!
//! Not here: the repetition penalty (multiplicative, over the prompt too),
//! logit bias, beam search, logprobs (a host reads logits for those). The
//! penalty list is built by the host (the runtime's engine counts the
//! tokens each sequence generated): the graph keeps no per-sequence state.

use super::buf::Buf;
use super::reduce::argmax_row;
use kiln_ir::DType;

/// f32 parameters per row: `[temperature, top_p, min_p, reserved]`.
pub const PARAMS: u32 = 4;
/// i32 parameters per row: `[top_k, seed_lo, seed_hi, counter]`.
pub const SEEDS: u32 = 4;
/// i32 words before a row's `(token, count)` pairs in the penalties
/// operand: presence and frequency, as f32 bits.
pub const PENALTY_HEADER: u32 = 2;
/// The most `(token, count)` pairs a row may carry (the GPU kernel holds a
/// row's list in shared memory).
pub const MAX_PENALTY_SLOTS: u32 = kiln_ir::op::MAX_PENALTY_SLOTS;
/// Weights are `trunc(p * 2^WEIGHT_BITS)`.
pub const WEIGHT_BITS: u32 = 40;
/// Below this scaled logit `prob` is 0 (keeps results normal on every device).
pub const PROB_FLOOR: f32 = -87.0;
/// Third Philox counter word: separates kiln's draws from other streams
/// keyed by the same seed ("kiln" in ASCII).
pub const STREAM: u32 = 0x6b69_6c6e;

/// One row's sampling parameters as a caller sets them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowSampling {
    /// Not `> 0` is greedy (argmax).
    pub temperature: f32,
    /// `>= 1` keeps everything.
    pub top_p: f32,
    /// 0 keeps everything.
    pub top_k: u32,
    /// `<= 0` keeps everything.
    pub min_p: f32,
    pub seed: u64,
}

impl RowSampling {
    /// Greedy: the `argmax` token.
    pub const GREEDY: RowSampling = RowSampling {
        temperature: 0.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        seed: 0,
    };

    /// The row's f32 staging words.
    pub fn params(&self) -> [f32; PARAMS as usize] {
        [self.temperature, self.top_p, self.min_p, 0.0]
    }

    /// The row's i32 staging words for drawing the token at index `counter`
    /// of its sequence.
    pub fn seeds(&self, counter: u32) -> [i32; SEEDS as usize] {
        [
            self.top_k.min(i32::MAX as u32) as i32,
            self.seed as u32 as i32,
            (self.seed >> 32) as u32 as i32,
            counter as i32,
        ]
    }
}

/// i32 words per row of a penalties operand with `slots` pairs.
pub const fn penalty_width(slots: u32) -> u32 {
    PENALTY_HEADER + 2 * slots
}

/// Writes one row of the penalties operand: `presence`, `frequency` and
/// the `(token, count)` pairs of `counts` (sorted by token, distinct),
/// padded with `(-1, 0)`. `None` when `counts` has more pairs than `row`
/// holds or is not strictly increasing by token.
pub fn penalty_row(
    row: &mut [i32],
    presence: f32,
    frequency: f32,
    counts: &[(u32, u32)],
) -> Option<()> {
    let slots = row.len().checked_sub(PENALTY_HEADER as usize)? / 2;
    if counts.len() > slots || counts.windows(2).any(|w| w[0].0 >= w[1].0) {
        return None;
    }
    row[0] = presence.to_bits() as i32;
    row[1] = frequency.to_bits() as i32;
    for (j, pair) in row[PENALTY_HEADER as usize..]
        .chunks_exact_mut(2)
        .enumerate()
    {
        let (t, c) = counts.get(j).map_or((-1, 0), |&(t, c)| {
            (t.min(i32::MAX as u32) as i32, c.min(i32::MAX as u32) as i32)
        });
        pair[0] = t;
        pair[1] = c;
    }
    Some(())
}

/// The listed prefix of a penalties row (step 0 of the module docs): pairs
/// up to the first one out of range or out of order.
pub fn penalty_list(pen: &[i32], vocab: usize) -> &[i32] {
    let pairs = pen.get(PENALTY_HEADER as usize..).unwrap_or(&[]);
    let mut n = 0;
    while 2 * n + 1 < pairs.len() {
        let t = pairs[2 * n];
        if t < 0 || t as usize >= vocab || (n > 0 && t <= pairs[2 * n - 2]) {
            break;
        }
        n += 1;
    }
    &pairs[..2 * n]
}

/// Step 0 of the module docs: applies a penalties row to logits `x`.
pub fn penalize(x: &mut [f32], pen: &[i32]) {
    if pen.len() < PENALTY_HEADER as usize {
        return;
    }
    let presence = f32::from_bits(pen[0] as u32);
    let frequency = f32::from_bits(pen[1] as u32);
    if presence == 0.0 && frequency == 0.0 {
        return;
    }
    for pair in penalty_list(pen, x.len()).chunks_exact(2) {
        let (t, c) = (pair[0] as usize, pair[1]);
        if c > 0 {
            x[t] = (x[t] - presence) - frequency * c as f32;
        }
    }
}

const PHILOX_M0: u32 = 0xD251_1F53;
const PHILOX_M1: u32 = 0xCD9E_8D57;
const PHILOX_W0: u32 = 0x9E37_79B9;
const PHILOX_W1: u32 = 0xBB67_AE85;

/// Philox4x32-10 (Salmon et al., SC'11): the block of four words for
/// counter `ctr` under key `key`.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mulhilo = |a: u32, b: u32| {
        let p = a as u64 * b as u64;
        ((p >> 32) as u32, p as u32)
    };
    let (mut c, mut k) = (ctr, key);
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(PHILOX_W0);
            k[1] = k[1].wrapping_add(PHILOX_W1);
        }
        let (hi0, lo0) = mulhilo(PHILOX_M0, c[0]);
        let (hi1, lo1) = mulhilo(PHILOX_M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The 24-bit uniform of the token at index `counter` of a sequence seeded
/// with `seed`: `philox([counter, 0, STREAM, 0], seed)[0] >> 8`.
pub fn uniform24(seed: u64, counter: u32) -> u32 {
    philox4x32_10([counter, 0, STREAM, 0], [seed as u32, (seed >> 32) as u32])[0] >> 8
}

/// `2^f` on `[0, 1]`: degree-8 Taylor polynomial of `exp(f ln 2)` by Horner
/// with explicit fma (relative error under 1e-7).
const EXP2_POLY: [f32; 9] = [
    1.0,
    std::f32::consts::LN_2,
    0.240_226_5,
    0.055_504_11,
    0.009_618_129,
    0.001_333_355_8,
    0.000_154_035_3,
    1.525_273_4e-5,
    1.321_548_7e-6,
];

/// `exp(z)` for `z <= 0` as the sampler computes it on every backend:
/// `y = z * log2(e)`, `n = floor(y)`, `2^(y - n)` by [`EXP2_POLY`], scaled
/// by `2^n`; 0 below [`PROB_FLOOR`], at most 1.
pub fn exp_nonpositive(z: f32) -> f32 {
    if z.is_nan() || z < PROB_FLOOR {
        return 0.0;
    }
    let y = z * std::f32::consts::LOG2_E;
    let n = y.floor();
    let f = y - n;
    let mut p = EXP2_POLY[8];
    for &c in EXP2_POLY[..8].iter().rev() {
        p = p.mul_add(f, c);
    }
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    (p * scale).min(1.0)
}

/// A token's probability relative to the top token's: `exp((x - m) / t)`.
#[inline]
pub fn prob(x: f32, m: f32, t: f32) -> f32 {
    if x.is_nan() {
        return 0.0;
    }
    exp_nonpositive((x - m) / t)
}

/// The integer weight of probability `p`.
#[inline]
pub fn weight(p: f32) -> u64 {
    (p * (1u64 << WEIGHT_BITS) as f32) as u64
}

/// `floor(z * r / 2^24)` for `z < 2^64 / 2^24`, without a 128-bit product.
#[inline]
pub fn scaled_target(z: u64, r24: u32) -> u64 {
    let r = r24 as u64;
    (z >> 24) * r + (((z & 0xFF_FFFF) * r) >> 24)
}

/// What survives step 3 of the module docs for one row: the probability
/// bits threshold and the per-token weights (0 for tokens cut).
#[derive(Clone, Debug, PartialEq)]
pub struct Kept {
    /// Kept tokens have `p.to_bits() >= threshold`.
    pub threshold: u32,
    /// `w_i` of kept tokens, 0 elsewhere.
    pub weights: Vec<u64>,
}

/// Steps 2 and 3 for a row that is not greedy (`temperature > 0` and a
/// finite maximum); `None` when the row is greedy.
pub fn kept(x: &[f32], params: [f32; 4], top_k: i32) -> Option<Kept> {
    let [t, top_p, min_p, _] = params;
    if t.is_nan() || t <= 0.0 || x.is_empty() {
        return None;
    }
    let m = x
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return None;
    }
    let p: Vec<f32> = x.iter().map(|&v| prob(v, m, t)).collect();
    let bits: Vec<u32> = p.iter().map(|v| v.to_bits()).collect();
    let w: Vec<u64> = p.iter().map(|&v| weight(v)).collect();
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_unstable_by(|&a, &b| bits[b].cmp(&bits[a]));
    let tk = if top_k > 0 && (top_k as usize) < x.len() {
        bits[order[top_k as usize - 1]]
    } else {
        0
    };
    let tp = if top_p < 1.0 {
        let zk: u64 = (0..x.len()).filter(|&i| bits[i] >= tk).map(|i| w[i]).sum();
        let target = (((top_p.max(0.0) as f64) * zk as f64) as u64).max(1);
        let mut cum = 0u64;
        let mut found = bits[order[0]];
        let mut i = 0;
        while i < order.len() && bits[order[i]] >= tk {
            let b = bits[order[i]];
            while i < order.len() && bits[order[i]] == b {
                cum += w[order[i]];
                i += 1;
            }
            if cum >= target {
                found = b;
                break;
            }
        }
        found
    } else {
        0
    };
    let tm = if min_p > 0.0 {
        min_p.min(1.0).to_bits()
    } else {
        0
    };
    let threshold = tk.max(tp).max(tm);
    let weights = (0..x.len())
        .map(|i| if bits[i] >= threshold { w[i] } else { 0 })
        .collect();
    Some(Kept { threshold, weights })
}

/// Step 4: the token at uniform `r24` among the kept weights.
pub fn draw(kept: &Kept, r24: u32) -> usize {
    let z: u64 = kept.weights.iter().sum();
    let target = scaled_target(z, r24);
    let mut cum = 0u64;
    for (i, &w) in kept.weights.iter().enumerate() {
        cum += w;
        if cum > target {
            return i;
        }
    }
    // Unreachable: the top token weighs 2^40 and target < z.
    kept.weights.iter().rposition(|&w| w > 0).unwrap_or(0)
}

/// The whole sampler for one row with an explicit uniform (tests compare
/// backends on the same uniforms through this).
pub fn sample_row_with(x: &[f32], params: [f32; 4], top_k: i32, r24: u32) -> usize {
    match kept(x, params, top_k) {
        None => argmax_row(x),
        Some(k) => draw(&k, r24),
    }
}

/// The whole sampler for one row, as the `sample` op runs it.
pub fn sample_row(x: &[f32], params: [f32; 4], seeds: [i32; 4]) -> usize {
    let seed = seeds[1] as u32 as u64 | (seeds[2] as u32 as u64) << 32;
    sample_row_with(x, params, seeds[0], uniform24(seed, seeds[3] as u32))
}

/// `sample(logits: F[R, V], params: f32[R, 4], seeds: i32[R, 4]
/// [, penalties: i32[R, 2 + 2P]]) -> i32[R]`.
pub(crate) unsafe fn sample(
    x: Buf,
    params: Buf,
    seeds: Buf,
    penalties: Option<Buf>,
    (rows, v): (usize, usize),
    out: Buf,
) {
    let mut row = vec![0f32; v];
    let mut prm = [0f32; 4];
    let seeds = seeds.ints();
    let pens = penalties.map(|p| p.ints());
    let width = pens.map_or(0, |p| p.len() / rows.max(1));
    for r in 0..rows {
        if x.dtype == DType::F32 {
            row.copy_from_slice(&x.f32s()[r * v..(r + 1) * v]);
        } else {
            x.load(r * v, &mut row);
        }
        if let Some(p) = pens {
            penalize(&mut row, &p[r * width..(r + 1) * width]);
        }
        params.load(r * 4, &mut prm);
        let s = [
            seeds[r * 4],
            seeds[r * 4 + 1],
            seeds[r * 4 + 2],
            seeds[r * 4 + 3],
        ];
        let tok = sample_row(&row, prm, s);
        out.store_ints(r, &[tok as i32]);
    }
}
