//! Small f32 math the hot loops need in a form the compiler can vectorize.
//!
//! [`exp`] replaces libm's `expf` inside softmax: a call per score kept the
//! loop scalar and cost more than the dot products. It is plain f32
//! arithmetic (no calls, no FMA), so it vectorizes and gives the same bits
//! at every SIMD level. Accuracy: within 2 ulp of the true value for
//! normal results (checked against f64 in the tests below); results below
//! `exp(-87)` (about 1.6e-38, the edge of the normal range) are flushed to
//! 0, which changes no softmax weight that matters.

/// `log2(e)` rounded to f32.
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln(2)` split in a part with few significant bits (so `n * LN2_HI` is
/// exact) and the f32 rest.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Adding then subtracting `1.5 * 2^23` rounds an f32 to an integer
/// (nearest even) without a call.
const ROUND: f32 = 12_582_912.0;

/// `e^x` in f32 (see the module docs for accuracy and the flush to 0).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let xc = x.clamp(-87.0, 88.0);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    // `t`'s low mantissa bits hold `n` (two's complement within 2^22).
    let n_bits = t.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    // Taylor polynomial of e^r on |r| <= ln2/2, Horner form.
    let p = 1.0 / 5040.0;
    let p = p * r + 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    let scale = f32::from_bits((n_bits.wrapping_add(127) as u32) << 23);
    let y = p * scale;
    if x.is_nan() {
        x
    } else if x < -87.0 {
        0.0
    } else if x > 88.0 {
        f32::INFINITY
    } else {
        y
    }
}

/// The maximum of `x` (NaN entries ignored; `-inf` for an empty slice).
/// Order does not matter for a maximum, so lanes are used freely.
#[inline(always)]
pub fn max(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..16 {
            lanes[j] = lanes[j].max(c[j]);
        }
    }
    let mut m = f32::NEG_INFINITY;
    for v in lanes.iter().chain(tail) {
        m = m.max(*v);
    }
    m
}

/// `sum(x)` in the 16-lane order of the dot kernels: lane `j` sums
/// `x[j], x[j+16], ...` below `len - len % 16`, lanes added pairwise
/// (`l[j] + l[j+8]`, `+4`, `+2`, `+1`), then the tail in order.
#[inline(always)]
pub fn sum(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..16 {
            lanes[j] += c[j];
        }
    }
    let s8: [f32; 8] = std::array::from_fn(|j| lanes[j] + lanes[j + 8]);
    let s4: [f32; 4] = std::array::from_fn(|j| s8[j] + s8[j + 4]);
    let mut s = (s4[0] + s4[2]) + (s4[1] + s4[3]);
    let mut t = 0f32;
    for v in tail {
        t += v;
    }
    s += t;
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_two_ulp_of_the_f64_value_over_the_normal_range() {
        let mut worst = 0;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp() as f32;
            let got = exp(x);
            worst = worst.max(ulps(got, want));
            x += 0.000_731;
        }
        assert!(worst <= 2, "worst error {worst} ulp");
    }

    #[test]
    fn exp_handles_the_edges() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-1e9), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(1e9), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn sum_and_max_match_the_obvious_loops() {
        let x: Vec<f32> = (0..203)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37)
            .collect();
        let want: f64 = x.iter().map(|&v| v as f64).sum();
        assert!((sum(&x) as f64 - want).abs() < 1e-3);
        assert_eq!(max(&x), x.iter().cloned().fold(f32::MIN, f32::max));
        assert_eq!(max(&[]), f32::NEG_INFINITY);
    }
}
