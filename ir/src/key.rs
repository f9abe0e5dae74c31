//! Shape keys: `(batch, query, spec)`, printed `b8q1s0`.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// One compiled shape of the decode step.
///
/// * `batch`: sequence slots in the step (live rows padded up to it);
/// * `query`: tokens per sequence in the step (1 for plain decode);
/// * `spec`: how many of those query tokens are drafts to verify, `spec < query`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Key {
    pub batch: u32,
    pub query: u32,
    pub spec: u32,
}

/// Why a key is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("key `{0}` is not of the form b<batch>q<query>s<spec>, e.g. b8q1s0")]
    Syntax(String),
    #[error("key {0}: batch must be at least 1")]
    ZeroBatch(Key),
    #[error("key {0}: query must be at least 1")]
    ZeroQuery(Key),
    #[error("key {key}: spec ({s}) must be smaller than query ({q}); a step verifying k drafts scores k+1 tokens, e.g. b{b}q{q1}s{s}", s = .0.spec, q = .0.query, b = .0.batch, q1 = .0.spec + 1, key = .0)]
    SpecNotBelowQuery(Key),
}

impl Key {
    pub fn new(batch: u32, query: u32, spec: u32) -> Key {
        Key { batch, query, spec }
    }
    /// Checks `batch >= 1`, `query >= 1`, `spec < query`.
    pub fn validate(self) -> Result<Key, KeyError> {
        if self.batch == 0 {
            return Err(KeyError::ZeroBatch(self));
        }
        if self.query == 0 {
            return Err(KeyError::ZeroQuery(self));
        }
        if self.spec >= self.query {
            return Err(KeyError::SpecNotBelowQuery(self));
        }
        Ok(self)
    }
    /// Tokens scored by the step: `batch * query`.
    pub fn tokens(self) -> u32 {
        self.batch * self.query
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "b{}q{}s{}", self.batch, self.query, self.spec)
    }
}

impl FromStr for Key {
    type Err = KeyError;
    /// Parses `b8q1s0` and validates it.
    fn from_str(s: &str) -> Result<Key, KeyError> {
        let bad = || KeyError::Syntax(s.to_string());
        let rest = s.strip_prefix('b').ok_or_else(bad)?;
        let (b, rest) = rest.split_once('q').ok_or_else(bad)?;
        let (q, sp) = rest.split_once('s').ok_or_else(bad)?;
        let num = |t: &str| -> Result<u32, KeyError> {
            if t.is_empty() || !t.bytes().all(|c| c.is_ascii_digit()) {
                return Err(bad());
            }
            t.parse().map_err(|_| bad())
        };
        Key::new(num(b)?, num(q)?, num(sp)?).validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn keys_print_and_parse_back() {
        for k in ["b1q1s0", "b8q1s0", "b1q3s2", "b32q4s0"] {
            assert_eq!(k.parse::<Key>().unwrap().to_string(), k);
        }
    }
    #[test]
    fn invalid_keys_are_rejected_with_a_reason() {
        assert!(matches!(
            "b0q1s0".parse::<Key>(),
            Err(KeyError::ZeroBatch(_))
        ));
        assert!(matches!(
            "b1q0s0".parse::<Key>(),
            Err(KeyError::ZeroQuery(_))
        ));
        let e = "b1q2s2".parse::<Key>().unwrap_err().to_string();
        assert!(e.contains("must be smaller than query"), "{e}");
        assert!(matches!("b1x1s0".parse::<Key>(), Err(KeyError::Syntax(_))));
        assert!(matches!("b-1q1s0".parse::<Key>(), Err(KeyError::Syntax(_))));
    }
}
