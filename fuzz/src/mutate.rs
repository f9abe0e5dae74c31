//! The mutator: turns (seed, iteration) into one input, deterministically.
//!
//! Every input is a pure function of the target's corpus, the campaign seed
//! and the iteration number, so any input replays on its own
//! (`--start I --iters 1`) with no state carried between iterations. The
//! first `corpus.len()` iterations run the seeds unchanged. After that, each
//! input is a corpus entry with one to eight stacked edits drawn from
//! SplitMix64 ([`kiln_ir::rng::SplitMix64`]):
//!
//! - bytes: bit flips, byte sets to 0/0x7f/0x80/0xff or random, truncation,
//!   extension with random or repeated bytes, insertion and deletion of
//!   ranges, duplication of a range, splicing the input with another corpus
//!   entry (prefix of one, suffix of the other), and overwriting a 4- or
//!   8-byte little-endian integer with a boundary value (0, 1, 2^31-1,
//!   2^32-1, 2^63, u64::MAX, a random large value, ...). Offsets favour the
//!   first 512 bytes, where headers, counts and lengths live.
//! - bincode (the plan body): a varint marker (251/252/253) followed by a
//!   boundary value, which is how bincode's standard config spells a large
//!   length or integer.
//! - text (config.json, IR, the safetensors JSON header): a digit run
//!   replaced by a huge or odd number, a `"key": value` pair duplicated,
//!   braces and brackets deleted or inserted, lines duplicated, deleted or
//!   swapped, a token replaced by a token of any corpus entry, and deep
//!   nesting.
//!
//! Not here: coverage feedback (there is no instrumentation on the stable
//! toolchain; the corpus is what steers) and target-specific repairs, which
//! the targets apply through [`Shape`].

use kiln_ir::rng::SplitMix64;

/// The largest input the mutator makes. Inputs are cut to this size, so
/// every parser sees at most 1 MiB (the allocation bound is stated against
/// it).
pub const MAX_INPUT: usize = 1 << 20;

/// Values written over integers: the edges parsers get wrong.
const BOUNDARY: [u64; 15] = [
    0,
    1,
    2,
    0x7f,
    0x80,
    0xff,
    0xffff,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    1 << 63,
    u64::MAX,
    u64::MAX - 1,
    1 << 40,
];

/// Numbers written over digit runs in text.
const HUGE_NUMBERS: [&str; 14] = [
    "0",
    "-1",
    "4294967295",
    "4294967296",
    "2147483648",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999999999",
    "1e308",
    "1e999",
    "-1e999",
    "1e-400",
    "0.0000000000000000000000001",
    "65537",
];

/// How a target's inputs are laid out, so edits land where they matter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Opaque bytes (GGUF).
    Binary,
    /// UTF-8 text (config.json, IR): text and byte edits.
    Text,
    /// Safetensors: 8-byte length prefix + JSON + data. The JSON gets text
    /// edits and usually a prefix that matches its new length.
    Safetensors,
    /// Plan file: 24-byte header + bincode body. The body gets byte and
    /// varint edits and usually a header whose length and CRC match it.
    Plan,
}

/// A deterministic input generator for one target.
pub struct Mutator<'a> {
    corpus: &'a [Vec<u8>],
    /// Tokens of every corpus entry (text shapes), for token replacement.
    tokens: Vec<&'a [u8]>,
    shape: Shape,
    seed: u64,
    salt: u64,
}

fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'%' || b == b'-'
}

fn token_spans(text: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < text.len() {
        if is_token_byte(text[i]) {
            let s = i;
            while i < text.len() && is_token_byte(text[i]) {
                i += 1;
            }
            out.push((s, i));
        } else {
            i += 1;
        }
    }
    out
}

impl<'a> Mutator<'a> {
    /// `salt` separates targets that share a seed.
    pub fn new(corpus: &'a [Vec<u8>], shape: Shape, seed: u64, salt: u64) -> Mutator<'a> {
        let mut tokens = Vec::new();
        if shape != Shape::Binary && shape != Shape::Plan {
            for entry in corpus {
                for (s, e) in token_spans(entry) {
                    if e - s <= 64 {
                        tokens.push(&entry[s..e]);
                    }
                }
            }
            tokens.sort_unstable();
            tokens.dedup();
        }
        Mutator {
            corpus,
            tokens,
            shape,
            seed,
            salt,
        }
    }

    /// The input of iteration `iter`.
    pub fn input(&self, iter: u64) -> Vec<u8> {
        if self.corpus.is_empty() {
            return Vec::new();
        }
        if iter < self.corpus.len() as u64 {
            return self.corpus[iter as usize].clone();
        }
        let mut rng = SplitMix64::new(
            self.seed
                ^ self.salt.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                ^ iter.wrapping_mul(0xd1b5_4a32_d192_ed03),
        );
        rng.next_u64();
        let base = &self.corpus[below(&mut rng, self.corpus.len())];
        let mut out = match self.shape {
            Shape::Binary => {
                let mut b = base.clone();
                self.stack(&mut rng, &mut b, false);
                b
            }
            Shape::Text => {
                let mut b = base.clone();
                self.stack(&mut rng, &mut b, true);
                b
            }
            Shape::Safetensors => self.safetensors(&mut rng, base),
            Shape::Plan => self.plan(&mut rng, base),
        };
        out.truncate(MAX_INPUT);
        out
    }

    fn stack(&self, rng: &mut SplitMix64, b: &mut Vec<u8>, text: bool) {
        // 1..=8 edits, mostly few.
        let n = 1 + (rng.next_u64().trailing_ones() as usize).min(7);
        for _ in 0..n {
            if text && !rng.next_u64().is_multiple_of(3) {
                self.text_edit(rng, b);
            } else {
                self.byte_edit(rng, b);
            }
            if b.len() > MAX_INPUT {
                b.truncate(MAX_INPUT);
            }
        }
    }

    fn safetensors(&self, rng: &mut SplitMix64, base: &[u8]) -> Vec<u8> {
        let declared = base
            .get(..8)
            .map(|p| u64::from_le_bytes(p.try_into().unwrap_or([0; 8])))
            .unwrap_or(0);
        let split = 8usize.saturating_add(declared.min(base.len() as u64) as usize);
        if base.len() < 8 || split > base.len() || rng.next_u64().is_multiple_of(5) {
            let mut b = base.to_vec();
            self.stack(rng, &mut b, false);
            return b;
        }
        let mut json = base[8..split].to_vec();
        let mut data = base[split..].to_vec();
        self.stack(rng, &mut json, true);
        if rng.next_u64().is_multiple_of(6) {
            self.byte_edit(rng, &mut data);
        }
        let prefix = if rng.next_u64().is_multiple_of(8) {
            declared
        } else {
            json.len() as u64
        };
        let mut out = prefix.to_le_bytes().to_vec();
        out.extend_from_slice(&json);
        out.extend_from_slice(&data);
        out
    }

    fn plan(&self, rng: &mut SplitMix64, base: &[u8]) -> Vec<u8> {
        const H: usize = kiln_ir::artifact::HEADER_LEN;
        if base.len() < H || rng.next_u64().is_multiple_of(8) {
            let mut b = base.to_vec();
            self.stack(rng, &mut b, false);
            return b;
        }
        let mut body = base[H..].to_vec();
        let n = 1 + (rng.next_u64().trailing_ones() as usize).min(7);
        for _ in 0..n {
            if rng.next_u64().is_multiple_of(3) {
                varint_edit(rng, &mut body);
            } else {
                self.byte_edit(rng, &mut body);
            }
        }
        let mut out = base[..H].to_vec();
        if !rng.next_u64().is_multiple_of(10) {
            out[12..20].copy_from_slice(&(body.len() as u64).to_le_bytes());
            out[20..24].copy_from_slice(&crc32fast::hash(&body).to_le_bytes());
        }
        out.extend_from_slice(&body);
        out
    }

    fn byte_edit(&self, rng: &mut SplitMix64, b: &mut Vec<u8>) {
        let len = b.len();
        match rng.next_u64() % 12 {
            0 | 1 if len > 0 => {
                let i = offset(rng, len);
                b[i] ^= 1 << (rng.next_u64() % 8);
            }
            2 if len > 0 => {
                let i = offset(rng, len);
                b[i] = [0, 0x7f, 0x80, 0xff, rng.next_u64() as u8][below(rng, 5)];
            }
            3 if len > 0 => {
                b.truncate(below(rng, len));
            }
            4 => {
                let n = 1 + below(rng, 64);
                let fill = rng.next_u64() as u8;
                let random = rng.next_u64().is_multiple_of(2);
                for _ in 0..n {
                    b.push(if random { rng.next_u64() as u8 } else { fill });
                }
            }
            5 => {
                let i = if len == 0 { 0 } else { offset(rng, len + 1) };
                let n = 1 + below(rng, 16);
                let ins: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                b.splice(i..i, ins);
            }
            6 if len > 0 => {
                let i = offset(rng, len);
                let n = (1 + below(rng, 64)).min(len - i);
                b.drain(i..i + n);
            }
            7 if len > 0 => {
                // Duplicate a range in place.
                let i = offset(rng, len);
                let n = (1 + below(rng, 256)).min(len - i);
                let chunk = b[i..i + n].to_vec();
                b.splice(i..i, chunk);
            }
            8 => {
                // Splice with another corpus entry.
                let other = &self.corpus[below(rng, self.corpus.len())];
                let cut_a = if len == 0 { 0 } else { below(rng, len + 1) };
                let cut_b = if other.is_empty() {
                    0
                } else {
                    below(rng, other.len() + 1)
                };
                b.truncate(cut_a);
                b.extend_from_slice(&other[cut_b..]);
            }
            9 | 10 if len >= 4 => {
                let wide = rng.next_u64().is_multiple_of(2) && len >= 8;
                let w = if wide { 8 } else { 4 };
                let mut i = offset(rng, len - w + 1);
                if rng.next_u64().is_multiple_of(2) {
                    i -= i % w;
                }
                let v = boundary(rng);
                b[i..i + w].copy_from_slice(&v.to_le_bytes()[..w]);
            }
            _ if len > 0 => {
                let i = offset(rng, len);
                b[i] = rng.next_u64() as u8;
            }
            _ => b.push(rng.next_u64() as u8),
        }
    }

    fn text_edit(&self, rng: &mut SplitMix64, b: &mut Vec<u8>) {
        match rng.next_u64() % 10 {
            0 | 1 => {
                // A digit run replaced by a huge or odd number.
                let runs: Vec<(usize, usize)> = token_spans(b)
                    .into_iter()
                    .filter(|&(s, _)| b[s].is_ascii_digit() || b[s] == b'-')
                    .collect();
                if let Some(&(s, e)) = pick(rng, &runs) {
                    let n = HUGE_NUMBERS[below(rng, HUGE_NUMBERS.len())];
                    b.splice(s..e, n.bytes());
                }
            }
            2 => {
                // Duplicate a `"key": value` pair (up to the next comma).
                let keys: Vec<usize> = find_all(b, b"\":")
                    .into_iter()
                    .filter_map(|q| b[..q].iter().rposition(|&c| c == b'"'))
                    .collect();
                if let Some(&s) = pick(rng, &keys) {
                    if let Some(rel) = b[s..].iter().position(|&c| c == b',') {
                        let pair = b[s..=s + rel].to_vec();
                        b.splice(s..s, pair);
                    }
                }
            }
            3 => {
                let braces: Vec<usize> = (0..b.len())
                    .filter(|&i| matches!(b[i], b'{' | b'}' | b'[' | b']' | b'(' | b')'))
                    .collect();
                if let Some(&i) = pick(rng, &braces) {
                    b.remove(i);
                }
            }
            4 => {
                let i = below(rng, b.len() + 1);
                const PUNCT: &[u8] = b"{}[]()\",:=";
                let c = PUNCT[below(rng, PUNCT.len())];
                b.insert(i, c);
            }
            5 => {
                let lines = line_spans(b);
                if let Some(&(s, e)) = pick(rng, &lines) {
                    match rng.next_u64() % 3 {
                        0 => {
                            let l = b[s..e].to_vec();
                            b.splice(s..s, l);
                        }
                        1 => {
                            b.drain(s..e);
                        }
                        _ => {
                            if let Some(&(s2, e2)) = pick(rng, &lines) {
                                if e <= s2 {
                                    let second = b[s2..e2].to_vec();
                                    let first = b[s..e].to_vec();
                                    b.splice(s2..e2, first);
                                    b.splice(s..e, second);
                                }
                            }
                        }
                    }
                }
            }
            6 | 7 => {
                // A token replaced by a token from any corpus entry.
                let spans = token_spans(b);
                if let (Some(&(s, e)), Some(t)) = (pick(rng, &spans), pick(rng, &self.tokens)) {
                    b.splice(s..e, t.iter().copied());
                }
            }
            8 => {
                // Deep nesting.
                let i = below(rng, b.len() + 1);
                let depth = 1 + below(rng, 300);
                let open = [b'[', b'{', b'('][below(rng, 3)];
                b.splice(i..i, std::iter::repeat_n(open, depth));
            }
            _ => {
                // A token inserted from the corpus.
                if let Some(t) = pick(rng, &self.tokens) {
                    let i = below(rng, b.len() + 1);
                    let mut ins = t.to_vec();
                    ins.push(b' ');
                    b.splice(i..i, ins);
                }
            }
        }
    }
}

fn varint_edit(rng: &mut SplitMix64, b: &mut Vec<u8>) {
    if b.is_empty() {
        return;
    }
    let i = offset(rng, b.len());
    let v = boundary(rng);
    let (marker, bytes): (u8, Vec<u8>) = match rng.next_u64() % 3 {
        0 => (251, (v as u16).to_le_bytes().to_vec()),
        1 => (252, (v as u32).to_le_bytes().to_vec()),
        _ => (253, v.to_le_bytes().to_vec()),
    };
    let n = (1 + bytes.len()).min(b.len() - i);
    let mut ins = vec![marker];
    ins.extend(bytes);
    // Overwrite (keeps later fields aligned) or insert.
    if rng.next_u64().is_multiple_of(2) {
        b.splice(i..i + n, ins);
    } else {
        b.splice(i..i, ins);
    }
}

fn boundary(rng: &mut SplitMix64) -> u64 {
    let i = below(rng, BOUNDARY.len() + 2);
    match BOUNDARY.get(i) {
        Some(&v) => v,
        None => rng.next_u64() | (1 << 33),
    }
}

fn below(rng: &mut SplitMix64, n: usize) -> usize {
    if n == 0 {
        0
    } else {
        (rng.next_u64() % n as u64) as usize
    }
}

/// An offset in `0..len` (len > 0), favouring the first 512 bytes.
fn offset(rng: &mut SplitMix64, len: usize) -> usize {
    if rng.next_u64().is_multiple_of(2) {
        below(rng, len.min(512))
    } else {
        below(rng, len)
    }
}

fn pick<'b, T>(rng: &mut SplitMix64, items: &'b [T]) -> Option<&'b T> {
    if items.is_empty() {
        None
    } else {
        Some(&items[below(rng, items.len())])
    }
}

fn find_all(hay: &[u8], needle: &[u8]) -> Vec<usize> {
    hay.windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect()
}

/// Lines with their newline.
fn line_spans(b: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut s = 0;
    for (i, &c) in b.iter().enumerate() {
        if c == b'\n' {
            out.push((s, i + 1));
            s = i + 1;
        }
    }
    if s < b.len() {
        out.push((s, b.len()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus() -> Vec<Vec<u8>> {
        vec![
            br#"{"a": 12, "b": [1, 2, 3], "c": "x"}"#.to_vec(),
            b"line one\nline %2 = 7\n".to_vec(),
        ]
    }

    #[test]
    fn the_same_seed_and_iteration_give_the_same_input() {
        let c = corpus();
        let m = Mutator::new(&c, Shape::Text, 7, 1);
        for i in 0..500 {
            assert_eq!(m.input(i), m.input(i), "iteration {i}");
        }
    }

    #[test]
    fn the_first_iterations_are_the_seeds_and_later_ones_differ_from_them() {
        let c = corpus();
        let m = Mutator::new(&c, Shape::Text, 7, 1);
        assert_eq!(m.input(0), c[0]);
        assert_eq!(m.input(1), c[1]);
        let changed = (2..200).filter(|&i| !c.contains(&m.input(i))).count();
        assert!(changed > 150, "only {changed} of 198 inputs were mutated");
    }

    #[test]
    fn different_seeds_give_different_inputs() {
        let c = corpus();
        let a = Mutator::new(&c, Shape::Text, 1, 1);
        let b = Mutator::new(&c, Shape::Text, 2, 1);
        let same = (2..200).filter(|&i| a.input(i) == b.input(i)).count();
        assert!(same < 50, "{same} of 198 inputs equal across seeds");
    }

    #[test]
    fn plan_inputs_usually_carry_a_header_that_matches_their_body() {
        let mut plan = b"KILNPLAN".to_vec();
        plan.extend(2u32.to_le_bytes());
        let body = vec![5u8; 100];
        plan.extend((body.len() as u64).to_le_bytes());
        plan.extend(crc32fast::hash(&body).to_le_bytes());
        plan.extend(&body);
        let c = vec![plan];
        let m = Mutator::new(&c, Shape::Plan, 3, 4);
        let framed = (1..500)
            .map(|i| m.input(i))
            .filter(|p| {
                p.len() >= 24
                    && u64::from_le_bytes(p[12..20].try_into().unwrap()) == (p.len() - 24) as u64
                    && u32::from_le_bytes(p[20..24].try_into().unwrap())
                        == crc32fast::hash(&p[24..])
            })
            .count();
        assert!(framed > 350, "only {framed} of 499 plan inputs are framed");
    }

    #[test]
    fn no_input_exceeds_the_size_bound() {
        let c = vec![vec![7u8; MAX_INPUT - 3]];
        let m = Mutator::new(&c, Shape::Binary, 9, 0);
        for i in 1..64 {
            assert!(m.input(i).len() <= MAX_INPUT);
        }
    }
}
