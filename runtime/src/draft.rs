//! Prompt-lookup drafting: draft tokens for speculative decoding taken from
//! the sequence's own tokens, with no second model.
//!
//! The last `n` tokens of a sequence (its suffix n-gram) are looked up earlier
//! in the same sequence (prompt and generated tokens alike); the tokens that
//! followed the match are proposed as drafts. The search is, in order:
//!
//! 1. n-gram sizes from `max_ngram` down to `min_ngram` (the longest match
//!    wins: a longer shared context predicts the continuation better);
//! 2. for one size, the most recent earlier occurrence first (text being
//!    edited or repeated is usually repeated from nearby).
//!
//! A match proposes exactly `k` tokens: the tokens after it, and where the
//! match is so recent that fewer than `k` tokens follow it, the copy goes on
//! into its own drafts (the continuation of `a b a b` after matching `a b` is
//! `a b a b ...`), so a repeating pattern keeps repeating. No match proposes
//! nothing.
//!
//! Deliberately not here: scoring candidates by frequency, a suffix
//! automaton or index (sequences are short enough for a backwards scan per
//! step), and anything that touches an engine (see [`crate::spec`]).

/// Why a [`PromptLookup`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DraftError {
    #[error("prompt lookup needs at least one draft token (k = 0 given); use k >= 1 or decode without drafts")]
    NoDrafts,
    #[error("prompt lookup n-gram sizes must satisfy 1 <= min_ngram <= max_ngram (got min {min}, max {max})")]
    BadNgram { min: usize, max: usize },
}

/// A prompt-lookup drafter. See the module docs for the search order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptLookup {
    k: usize,
    min_ngram: usize,
    max_ngram: usize,
}

/// Where a proposal came from (for statistics and tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LookupMatch {
    /// The n-gram size that matched.
    pub ngram: usize,
    /// Index of the first token of the earlier occurrence.
    pub at: usize,
}

impl PromptLookup {
    /// Default n-gram sizes: 3 down to 1.
    pub const DEFAULT_MIN_NGRAM: usize = 1;
    pub const DEFAULT_MAX_NGRAM: usize = 3;

    /// A drafter proposing `k` tokens, trying n-grams of `max_ngram` down to
    /// `min_ngram` tokens.
    pub fn new(k: usize, min_ngram: usize, max_ngram: usize) -> Result<PromptLookup, DraftError> {
        if k == 0 {
            return Err(DraftError::NoDrafts);
        }
        if min_ngram == 0 || min_ngram > max_ngram {
            return Err(DraftError::BadNgram {
                min: min_ngram,
                max: max_ngram,
            });
        }
        Ok(PromptLookup {
            k,
            min_ngram,
            max_ngram,
        })
    }

    /// `k` drafts with the default n-gram sizes.
    pub fn with_k(k: usize) -> Result<PromptLookup, DraftError> {
        PromptLookup::new(k, Self::DEFAULT_MIN_NGRAM, Self::DEFAULT_MAX_NGRAM)
    }

    pub fn k(&self) -> usize {
        self.k
    }

    /// Finds the match a proposal would copy from, or `None`.
    pub fn find(&self, tokens: &[u32]) -> Option<LookupMatch> {
        let len = tokens.len();
        // An n-gram needs an earlier occurrence, so n < len.
        let top = self.max_ngram.min(len.saturating_sub(1));
        for n in (self.min_ngram..=top).rev() {
            let suffix = &tokens[len - n..];
            // Earlier occurrences start at 0..len-n (exclusive of the suffix
            // itself), most recent first.
            if let Some(at) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == suffix) {
                return Some(LookupMatch { ngram: n, at });
            }
        }
        None
    }

    /// Appends the drafts for the sequence `tokens` to `out`: exactly `k`
    /// tokens when a match is found, none otherwise. Returns the match.
    pub fn propose_into(&self, tokens: &[u32], out: &mut Vec<u32>) -> Option<LookupMatch> {
        let m = self.find(tokens)?;
        let start = out.len();
        let from = m.at + m.ngram; // < tokens.len(), see `find`
        for j in 0..self.k {
            let i = from + j;
            // Past the end of the sequence the copy reads its own drafts.
            let t = match tokens.get(i) {
                Some(&t) => t,
                None => out[start + (i - tokens.len())],
            };
            out.push(t);
        }
        Some(m)
    }

    /// The drafts for `tokens`: `k` tokens, or empty when nothing matches.
    pub fn propose(&self, tokens: &[u32]) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.k);
        self.propose_into(tokens, &mut out);
        out
    }
}
