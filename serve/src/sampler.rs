//! Choosing the next token from a row's logits: the [`Sampler`] seam and
//! [`HostSampler`], its host-side implementation.
//!
//! Where sampling runs: a plan compiled with `kiln compile --sampling`
//! draws each row's token inside the graph (the `sample` op: temperature,
//! top-k, top-p, min-p and a Philox stream keyed by the request's seed, the
//! counter being the token's index in the sequence); the scheduler hands
//! those rows their [`SamplingParams::in_graph`] parameters (and their
//! presence/frequency penalties, which the engine turns into each row's
//! `(token, count)` list staged for the graph) and takes the graph's token
//! as is. This host sampler remains only for what the graph cannot do:
//! any sampled row on an argmax-only plan, and penalised rows allowed more
//! new tokens than the plan's penalty slots (`kiln compile
//! --penalty-slots`) or on a plan compiled with none (all read the row's
//! logits). Rows the graph samples never come here: greedy rows keep the
//! graph's argmax token, bit for bit.
//!
//! The random numbers are counter-based: the uniform for a row's `step`-th
//! token is a pure function of `(seed, step)` (a splitmix64 finalizer over
//! both), so the same seed and prompt give the same text whatever else is
//! in the batch and however often the sequence was preempted and
//! recomputed, as a device Philox stream would.
//!
//! Order of operations (as vLLM and Hugging Face apply them): presence and
//! frequency penalties on the raw logits (over the tokens generated so far),
//! then temperature, then top-k, top-p and min-p on the softmax, then a draw
//! from the renormalized distribution. Not here: repetition penalty, logit
//! bias, beam search, `n` > 1.

/// One row's sampling parameters, already validated.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 is greedy.
    pub temperature: f32,
    /// In (0, 1]; 1 keeps everything.
    pub top_p: f32,
    /// 0 keeps everything.
    pub top_k: u32,
    /// In [0, 1]; 0 keeps everything.
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl SamplingParams {
    pub fn greedy() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
    pub fn has_penalties(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
    /// The graph's argmax token is the answer: no logits needed.
    pub fn argmax_suffices(&self) -> bool {
        self.is_greedy() && !self.has_penalties()
    }
    /// The row must be sampled here, from its logits, when the graph
    /// cannot draw it (`in_graph` false: see
    /// [`crate::scheduler::ModelInfo::graph_samples`]).
    pub fn needs_host(&self, in_graph: bool) -> bool {
        !self.argmax_suffices() && !in_graph
    }
    /// The parameters of the graph's `sample` op for this row.
    pub fn in_graph(&self) -> kiln_runtime::RowSampling {
        kiln_runtime::RowSampling {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            seed: self.seed,
        }
    }
}

/// Picks a row's next token.
pub trait Sampler: Send {
    /// `logits` is the row's raw logits, `generated` the tokens it generated
    /// so far (for penalties), `step` its index among them (the RNG counter).
    fn sample(&self, logits: &[f32], params: &SamplingParams, generated: &[u32], step: u64) -> u32;
}

/// The host-side sampler. See the module docs.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostSampler;

impl Sampler for HostSampler {
    fn sample(&self, logits: &[f32], params: &SamplingParams, generated: &[u32], step: u64) -> u32 {
        let mut l = logits.to_vec();
        apply_penalties(&mut l, params, generated);
        if params.is_greedy() {
            return argmax(&l);
        }
        let dist = filtered_distribution(&l, params);
        draw(&dist, uniform(params.seed, step))
    }
}

/// The first index of the largest value (NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// Presence penalty: subtracted once from every token generated at least
/// once; frequency penalty: subtracted once per occurrence (OpenAI's
/// definition).
pub fn apply_penalties(logits: &mut [f32], params: &SamplingParams, generated: &[u32]) {
    if !params.has_penalties() {
        return;
    }
    let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    for &t in generated {
        *counts.entry(t).or_insert(0) += 1;
    }
    for (t, c) in counts {
        if let Some(x) = logits.get_mut(t as usize) {
            *x -= params.presence_penalty + params.frequency_penalty * c as f32;
        }
    }
}

/// The distribution a sampled row draws from: `(token, probability)` with
/// the probabilities summing to 1, most likely first, after temperature,
/// top-k, top-p and min-p. Never empty for a non-empty row.
pub fn filtered_distribution(logits: &[f32], params: &SamplingParams) -> Vec<(u32, f64)> {
    let t = params.temperature.max(1e-6) as f64;
    let max = logits
        .iter()
        .copied()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut probs: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let p = if x.is_nan() {
                0.0
            } else {
                ((x as f64 - max) / t).exp()
            };
            (i as u32, p)
        })
        .collect();
    let by_prob = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let k = params.top_k as usize;
    if k > 0 && k < probs.len() {
        probs.select_nth_unstable_by(k - 1, by_prob);
        probs.truncate(k);
    }
    probs.sort_unstable_by(by_prob);
    let total: f64 = probs.iter().map(|p| p.1).sum();
    for p in &mut probs {
        p.1 /= total;
    }
    if params.top_p < 1.0 {
        let mut cum = 0.0;
        let mut keep = 0;
        for p in &probs {
            if cum >= params.top_p as f64 {
                break;
            }
            cum += p.1;
            keep += 1;
        }
        probs.truncate(keep.max(1));
    }
    if params.min_p > 0.0 {
        let floor = params.min_p as f64 * probs[0].1;
        probs.retain(|p| p.1 >= floor);
    }
    let total: f64 = probs.iter().map(|p| p.1).sum();
    for p in &mut probs {
        p.1 /= total;
    }
    probs
}

/// The token at cumulative probability `u` in `[0, 1)`.
pub fn draw(dist: &[(u32, f64)], u: f64) -> u32 {
    let mut cum = 0.0;
    for &(t, p) in dist {
        cum += p;
        if u < cum {
            return t;
        }
    }
    dist.last().map_or(0, |d| d.0)
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform in `[0, 1)` that depends only on `(seed, counter)`.
pub fn uniform(seed: u64, counter: u64) -> f64 {
    let z =
        mix(seed.wrapping_add(0x9E37_79B9_7F4A_7C15)) ^ counter.wrapping_mul(0xD1B5_4A32_D192_ED03);
    let z = mix(z.wrapping_add(0x9E37_79B9_7F4A_7C15));
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// `log_softmax(logits)[token]` and the `n` most likely tokens with theirs,
/// over the raw logits (what OpenAI's `logprobs` report).
pub fn logprobs(logits: &[f32], token: u32, n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln();
    let lp = |t: u32| (logits[t as usize] as f64 - lse) as f32;
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let by = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if n > 0 && n < idx.len() {
        idx.select_nth_unstable_by(n - 1, by);
        idx.truncate(n);
    }
    idx.sort_unstable_by(by);
    idx.truncate(n);
    (lp(token), idx.into_iter().map(|t| (t, lp(t))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(seed: u64, n: usize) -> Vec<f32> {
        (0..n as u64)
            .map(|i| ((uniform(seed, i) - 0.5) * 8.0) as f32)
            .collect()
    }

    fn sampled(t: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            seed: 7,
            ..SamplingParams::greedy()
        }
    }

    #[test]
    fn greedy_sampling_is_exactly_argmax() {
        for seed in 0..50 {
            let l = logits(seed, 1000);
            let best = l
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0 as u32;
            assert_eq!(
                HostSampler.sample(&l, &SamplingParams::greedy(), &[], seed),
                best
            );
        }
    }

    #[test]
    fn the_same_seed_and_step_draw_the_same_token_and_other_seeds_differ() {
        let l = logits(3, 500);
        let p = sampled(1.0);
        let a: Vec<u32> = (0..64)
            .map(|s| HostSampler.sample(&l, &p, &[], s))
            .collect();
        let b: Vec<u32> = (0..64)
            .map(|s| HostSampler.sample(&l, &p, &[], s))
            .collect();
        assert_eq!(a, b);
        let q = SamplingParams { seed: 8, ..p };
        let c: Vec<u32> = (0..64)
            .map(|s| HostSampler.sample(&l, &q, &[], s))
            .collect();
        assert_ne!(a, c);
    }

    #[test]
    fn uniforms_are_uniform_over_counters() {
        let n = 100_000;
        let mut bins = [0u32; 10];
        for c in 0..n {
            let u = uniform(42, c);
            assert!((0.0..1.0).contains(&u));
            bins[(u * 10.0) as usize] += 1;
        }
        for b in bins {
            assert!(
                (b as f64 - n as f64 / 10.0).abs() < 0.03 * n as f64 / 10.0,
                "{bins:?}"
            );
        }
    }

    /// The expected distribution, computed the plain way: softmax of
    /// logits / T, then top-k, top-p, min-p masks, renormalized.
    fn expected(l: &[f32], p: &SamplingParams) -> Vec<f64> {
        let t = p.temperature as f64;
        let z: f64 = l.iter().map(|&x| (x as f64 / t).exp()).sum();
        let sm: Vec<f64> = l.iter().map(|&x| (x as f64 / t).exp() / z).collect();
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|&a, &b| sm[b].total_cmp(&sm[a]));
        let mut keep = vec![false; l.len()];
        let k = if p.top_k == 0 {
            l.len()
        } else {
            p.top_k as usize
        };
        let kept_k: Vec<usize> = order.iter().copied().take(k).collect();
        let zk: f64 = kept_k.iter().map(|&i| sm[i]).sum();
        let mut cum = 0.0;
        for &i in &kept_k {
            if cum >= p.top_p as f64 {
                break;
            }
            cum += sm[i] / zk;
            keep[i] = true;
        }
        let top = sm[order[0]];
        for i in 0..l.len() {
            if sm[i] < p.min_p as f64 * top {
                keep[i] = false;
            }
        }
        let zz: f64 = (0..l.len()).filter(|&i| keep[i]).map(|i| sm[i]).sum();
        (0..l.len())
            .map(|i| if keep[i] { sm[i] / zz } else { 0.0 })
            .collect()
    }

    /// Chi-square goodness of fit of 40,000 draws against [`expected`], at a
    /// significance of 0.001: the statistic must stay under the critical
    /// value for its degrees of freedom (from the Wilson-Hilferty
    /// approximation with z = 3.09), and no filtered-out token may ever be
    /// drawn.
    fn chi_square_fits(l: &[f32], p: &SamplingParams) {
        let want = expected(l, p);
        let n = 40_000u64;
        let mut counts = vec![0u64; l.len()];
        for step in 0..n {
            counts[HostSampler.sample(l, p, &[], step) as usize] += 1;
        }
        let mut chi = 0.0;
        let mut cells = 0;
        for (i, &c) in counts.iter().enumerate() {
            if want[i] == 0.0 {
                assert_eq!(c, 0, "token {i} is filtered out but was drawn {c} times");
                continue;
            }
            let e = want[i] * n as f64;
            chi += (c as f64 - e).powi(2) / e;
            cells += 1;
        }
        let df = (cells - 1).max(1) as f64;
        let z = 3.09;
        let crit = df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3);
        assert!(
            chi < crit,
            "chi-square {chi:.2} >= {crit:.2} (df {df}) for {p:?}"
        );
    }

    #[test]
    fn draws_match_softmax_over_temperature() {
        let l = logits(11, 12);
        chi_square_fits(&l, &sampled(1.0));
        chi_square_fits(&l, &sampled(0.5));
        chi_square_fits(&l, &sampled(1.7));
    }

    #[test]
    fn draws_match_the_distribution_after_top_k_top_p_and_min_p() {
        let l = logits(12, 16);
        for (k, pp, mp) in [(5, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.1), (8, 0.9, 0.05)] {
            let p = SamplingParams {
                top_k: k,
                top_p: pp,
                min_p: mp,
                ..sampled(0.8)
            };
            chi_square_fits(&l, &p);
        }
    }

    #[test]
    fn the_chi_square_check_rejects_a_wrong_temperature() {
        // The check is not vacuous: draws at T = 1 do not fit T = 0.5.
        let l = logits(13, 12);
        let r = std::panic::catch_unwind(|| {
            let want = expected(&l, &sampled(0.5));
            let n = 40_000u64;
            let mut counts = vec![0u64; l.len()];
            for s in 0..n {
                counts[HostSampler.sample(&l, &sampled(1.0), &[], s) as usize] += 1;
            }
            let chi: f64 = counts
                .iter()
                .zip(&want)
                .map(|(&c, &w)| (c as f64 - w * n as f64).powi(2) / (w * n as f64))
                .sum();
            assert!(chi < 40.0, "{chi}");
        });
        assert!(r.is_err());
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let l = logits(5, 300);
        let best = argmax(&l);
        for p in [
            SamplingParams {
                top_k: 1,
                ..sampled(1.0)
            },
            SamplingParams {
                top_p: 1e-6,
                ..sampled(1.0)
            },
            SamplingParams {
                min_p: 1.0,
                ..sampled(1.0)
            },
        ] {
            for s in 0..20 {
                assert_eq!(HostSampler.sample(&l, &p, &[], s), best, "{p:?}");
            }
        }
    }

    #[test]
    fn penalties_lower_generated_tokens_by_presence_plus_frequency_times_count() {
        let mut l = vec![0.0f32; 4];
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplingParams::greedy()
        };
        apply_penalties(&mut l, &p, &[1, 1, 2]);
        assert_eq!(l, vec![0.0, -1.0, -0.75, 0.0]);
        // Greedy with a penalty moves off a repeated best token.
        let l = vec![1.0f32, 0.9, 0.0];
        assert_eq!(HostSampler.sample(&l, &p, &[0], 0), 1);
        assert_eq!(
            HostSampler.sample(&l, &SamplingParams::greedy(), &[0], 0),
            0
        );
    }

    #[test]
    fn logprobs_are_log_softmax_and_top_n_is_sorted() {
        let l = vec![1.0f32, 3.0, 2.0, 0.0];
        let (lp, top) = logprobs(&l, 2, 2);
        let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
        assert!((lp as f64 - (2.0f64.exp() / z).ln()).abs() < 1e-5);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!(top[0].1 > top[1].1);
    }
}
