//! The HIP backend's counters. The capture-contract bookkeeping itself is
//! shared by every backend (`crate::capture`) and re-exported here.
//!
//! The HIP runtime itself rejects some calls inside a stream capture (and
//! silently accepts others, such as a synchronous copy on another stream), so
//! the backend checks every forbidden call here first and fails with
//! [`BackendError::CaptureContract`] naming the key and the call, before any
//! HIP call is made and the capture is invalidated.
//!
//! Not here: the HIP calls (ROCm-only `backend` module).

pub use crate::capture::{contract_violation, CaptureState, GraphTable, KeyCounters};
use crate::hip::policy::PolicyDecision;
use kiln_ir::Key;
use std::collections::BTreeMap;

/// What the HIP backend did, for tests and `kiln bench`: a test that claims a
/// graph ran checks that `replays` moved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HipCounters {
    /// The graph policy for this backend's device, with its reason.
    pub policy: PolicyDecision,
    pub keys: BTreeMap<Key, KeyCounters>,
    /// Launches executed directly (outside any capture).
    pub eager_launches: u64,
    /// Kernel modules compiled by hiprtc at load.
    pub kernels_compiled: u64,
    /// Kernel modules taken from the on-disk cache.
    pub kernel_cache_hits: u64,
    /// GEMM algorithms selected (one per distinct GEMM problem).
    pub gemm_algorithms: u64,
}

impl HipCounters {
    pub fn new(policy: PolicyDecision) -> HipCounters {
        HipCounters {
            policy,
            keys: BTreeMap::new(),
            eager_launches: 0,
            kernels_compiled: 0,
            kernel_cache_hits: 0,
            gemm_algorithms: 0,
        }
    }

    pub fn key(&mut self, key: Key) -> &mut KeyCounters {
        self.keys.entry(key).or_default()
    }

    /// Replays over all keys.
    pub fn replays(&self) -> u64 {
        self.keys.values().map(|k| k.replays).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_sum_replays_over_keys_and_carry_the_policy() {
        let policy = PolicyDecision {
            graphs: true,
            reason: "hip device 1 (x, gfx90a): on".into(),
        };
        let mut c = HipCounters::new(policy.clone());
        c.key(Key::new(1, 1, 0)).replays += 3;
        c.key(Key::new(8, 1, 0)).replays += 2;
        c.key(Key::new(1, 1, 0)).captures += 1;
        assert_eq!(c.replays(), 5);
        assert_eq!(c.keys[&Key::new(1, 1, 0)].captures, 1);
        assert_eq!(c.policy, policy);
    }
}
