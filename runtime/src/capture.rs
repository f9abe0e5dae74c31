//! The capture contract's bookkeeping, once for every backend: which key is
//! being captured, which calls are refused meanwhile and why, the last op
//! recorded (to name what broke a capture), the table of instantiated graphs
//! and the per-key counters.
//!
//! Backends check every forbidden call here *before* touching the device, so
//! a contract violation is a [`BackendError::CaptureContract`] naming the key
//! and the call, and the capture itself stays intact (a GPU runtime would
//! otherwise invalidate it, or silently accept a call such as a synchronous
//! copy on another stream).
//!
//! Not here: anything that touches memory or a device (the backends), and the
//! graphs-or-eager decision (the engine's policy).

use crate::backend::{BackendError, GraphHandle};
use kiln_ir::Key;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Why `call` (its name: the text before any `(`) is refused inside a
/// capture region.
pub fn why(call: &str) -> &'static str {
    let name = call.split('(').next().unwrap_or(call);
    match name {
        "alloc" => "a device allocation inside a capture is not recorded into the graph and its address would differ at every capture; allocate arena, workspace, KV cache and staging buffers before the first capture",
        "free" => "freeing memory a captured graph may still read is a use-after-free at replay; free only at teardown, after destroying the graphs",
        "synchronize" => "a host synchronization inside a capture waits on work that has not been launched yet (the capture only records it)",
        "download" => "a device-to-host read inside a capture reads memory before the recorded kernels have run, and its host destination is not valid at replay; read outputs after replay",
        "upload" => "a host-to-device copy inside a capture would make every replay re-read this host buffer, which is gone by then; upload step inputs before replay, to their fixed staging addresses",
        "load_kernels" => "modules must be loaded before capture",
        "reserve_workspace" => "the BLAS workspace must be grown before any capture",
        "prepare" => "GEMM algorithms are chosen (and may be timed) before capture",
        "replay" => "graphs do not nest: replaying a graph inside a capture would record it as a child of this one",
        "destroy_graph" => "destroying a graph synchronizes the stream, which a capture cannot do",
        "begin_capture" => "captures do not nest; end the current capture first",
        "mark" | "elapsed_ms" | "time_ms" => "timing marks are taken between steps, outside any capture",
        "copy_bandwidth" => "measuring bandwidth allocates and synchronizes",
        _ => "the capture contract forbids it",
    }
}

/// The error for `call` while `key` is being captured.
pub fn contract_violation(key: Key, call: &str) -> BackendError {
    BackendError::CaptureContract {
        key,
        call: call.to_string(),
        why: why(call).to_string(),
    }
}

/// Which key is being captured, since when, and the last op recorded.
#[derive(Debug, Default)]
pub struct CaptureState {
    current: Option<(Key, Instant)>,
    last_op: Option<String>,
    launches: u64,
}

impl CaptureState {
    /// The key being captured.
    pub fn key(&self) -> Option<Key> {
        self.current.map(|(k, _)| k)
    }

    /// Ok outside a capture; the contract error for `call` inside one.
    pub fn forbid(&self, call: &str) -> Result<(), BackendError> {
        match self.key() {
            Some(key) => Err(contract_violation(key, call)),
            None => Ok(()),
        }
    }

    /// As [`CaptureState::forbid`], building the call's description (with
    /// its arguments) only when it is refused.
    pub fn forbid_with(&self, call: impl FnOnce() -> String) -> Result<(), BackendError> {
        match self.key() {
            Some(key) => Err(contract_violation(key, &call())),
            None => Ok(()),
        }
    }

    /// Starts capturing `key` (refused inside another capture).
    pub fn begin(&mut self, key: Key) -> Result<(), BackendError> {
        if let Some(current) = self.key() {
            return Err(contract_violation(
                current,
                &format!("begin_capture({key})"),
            ));
        }
        self.current = Some((key, Instant::now()));
        self.last_op = None;
        self.launches = 0;
        Ok(())
    }

    /// Notes that `op` was recorded into the capture.
    pub fn recorded(&mut self, op: &str) {
        if self.current.is_some() {
            self.last_op = Some(op.to_string());
            self.launches += 1;
        }
    }

    /// The last op recorded, for naming what broke a capture.
    pub fn last_op(&self) -> &str {
        self.last_op.as_deref().unwrap_or("(no op recorded yet)")
    }

    /// Ends the capture: the key, how long it took, and the ops recorded.
    pub fn end(&mut self) -> Result<(Key, Duration, u64), BackendError> {
        match self.current.take() {
            Some((key, started)) => Ok((key, started.elapsed(), self.launches)),
            None => Err(BackendError::Device(
                "end_capture called with no capture in progress; call begin_capture(key) first"
                    .into(),
            )),
        }
    }
}

/// The error for a handle not in a table whose next handle is `next`.
fn unknown_handle(next: u32, h: GraphHandle) -> BackendError {
    let state = if h.0 < next {
        "was destroyed"
    } else {
        "was never created by this backend"
    };
    BackendError::Device(format!(
        "graph handle {} {state}; capture the key again to get a live handle",
        h.0
    ))
}

/// Instantiated graphs by handle. Handles are never reused, so a stale handle
/// is an error rather than another key's graph.
#[derive(Debug)]
pub struct GraphTable<G> {
    next: u32,
    live: BTreeMap<u32, (Key, G)>,
}

impl<G> Default for GraphTable<G> {
    fn default() -> Self {
        GraphTable {
            next: 0,
            live: BTreeMap::new(),
        }
    }
}

impl<G> GraphTable<G> {
    pub fn insert(&mut self, key: Key, graph: G) -> GraphHandle {
        let h = self.next;
        self.next += 1;
        self.live.insert(h, (key, graph));
        GraphHandle(h)
    }

    fn unknown(&self, h: GraphHandle) -> BackendError {
        unknown_handle(self.next, h)
    }

    pub fn get(&self, h: GraphHandle) -> Result<&(Key, G), BackendError> {
        self.live.get(&h.0).ok_or_else(|| self.unknown(h))
    }

    pub fn get_mut(&mut self, h: GraphHandle) -> Result<&mut (Key, G), BackendError> {
        let next = self.next;
        self.live
            .get_mut(&h.0)
            .ok_or_else(|| unknown_handle(next, h))
    }

    pub fn remove(&mut self, h: GraphHandle) -> Result<(Key, G), BackendError> {
        match self.live.remove(&h.0) {
            Some(g) => Ok(g),
            None => Err(self.unknown(h)),
        }
    }

    /// Removes every live graph (teardown), in creation order.
    pub fn drain(&mut self) -> Vec<(Key, G)> {
        std::mem::take(&mut self.live).into_values().collect()
    }

    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }
}

/// Per-key capture and replay counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyCounters {
    pub captures: u64,
    pub replays: u64,
    /// Launches recorded into this key's captures.
    pub captured_launches: u64,
    pub capture_time: Duration,
}

/// Counters per key, for tests and benchmarks: a test that claims a graph ran
/// checks that `replays` moved.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GraphCounters {
    pub keys: BTreeMap<Key, KeyCounters>,
}

impl GraphCounters {
    pub fn key(&mut self, key: Key) -> &mut KeyCounters {
        self.keys.entry(key).or_default()
    }

    /// Replays over all keys.
    pub fn replays(&self) -> u64 {
        self.keys.values().map(|k| k.replays).sum()
    }

    /// Notes a finished capture of `key`.
    pub fn captured(&mut self, key: Key, launches: u64, took: Duration) {
        let c = self.key(key);
        c.captures += 1;
        c.captured_launches += launches;
        c.capture_time += took;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forbidden_calls_inside_a_capture_name_the_key_the_call_and_why() {
        let mut s = CaptureState::default();
        for call in ["alloc", "free", "synchronize", "download", "upload"] {
            assert!(s.forbid(call).is_ok());
        }
        let key = Key::new(4, 2, 1);
        s.begin(key).unwrap();
        for call in [
            "alloc(64 bytes for x)",
            "free",
            "synchronize",
            "download",
            "upload",
            "load_kernels",
            "reserve_workspace",
            "prepare",
            "replay",
            "destroy_graph",
            "mark",
        ] {
            match s.forbid(call).unwrap_err() {
                BackendError::CaptureContract {
                    key: k,
                    call: c,
                    why,
                } => {
                    assert_eq!(k, key);
                    assert_eq!(c, call);
                    assert!(!why.contains("forbids it"), "{call} has no specific reason");
                }
                other => panic!("{call}: {other:?}"),
            }
        }
        let msg = s.forbid("alloc").unwrap_err().to_string();
        assert!(msg.contains("b4q2s1") && msg.contains("`alloc`"), "{msg}");
        let lazy = s
            .forbid_with(|| "free(0x10)".into())
            .unwrap_err()
            .to_string();
        assert!(lazy.contains("`free(0x10)`"), "{lazy}");
    }

    #[test]
    fn captures_do_not_nest_and_end_requires_a_begin() {
        let mut s = CaptureState::default();
        assert!(
            matches!(s.end(), Err(BackendError::Device(m)) if m.contains("no capture in progress"))
        );
        s.begin(Key::new(1, 1, 0)).unwrap();
        let e = s.begin(Key::new(8, 1, 0)).unwrap_err();
        assert!(
            matches!(&e, BackendError::CaptureContract { key, call, .. } if *key == Key::new(1, 1, 0) && call == "begin_capture(b8q1s0)"),
            "{e:?}"
        );
        s.recorded("rms_norm_bf16");
        s.recorded("gemm");
        assert_eq!(s.last_op(), "gemm");
        let (key, _, launches) = s.end().unwrap();
        assert_eq!((key, launches), (Key::new(1, 1, 0), 2));
        assert!(s.forbid("alloc").is_ok());
        // Ops outside a capture are not counted into the next one.
        s.recorded("add");
        s.begin(Key::new(2, 1, 0)).unwrap();
        assert_eq!(s.last_op(), "(no op recorded yet)");
        assert_eq!(s.end().unwrap().2, 0);
    }

    #[test]
    fn graph_handles_are_never_reused_and_stale_ones_are_errors() {
        let mut t = GraphTable::default();
        let a = t.insert(Key::new(1, 1, 0), "a");
        let b = t.insert(Key::new(2, 1, 0), "b");
        assert_ne!(a, b);
        assert_eq!(t.get(a).unwrap().1, "a");
        assert_eq!(t.remove(a).unwrap(), (Key::new(1, 1, 0), "a"));
        let e = t.get(a).unwrap_err().to_string();
        assert!(e.contains("was destroyed"), "{e}");
        let c = t.insert(Key::new(1, 1, 0), "c");
        assert_ne!(c, a);
        let e = t.remove(GraphHandle(99)).unwrap_err().to_string();
        assert!(e.contains("never created"), "{e}");
        assert_eq!(t.len(), 2);
        assert_eq!(
            t.drain(),
            vec![(Key::new(2, 1, 0), "b"), (Key::new(1, 1, 0), "c")]
        );
        assert!(t.is_empty());
    }

    #[test]
    fn counters_sum_replays_over_keys() {
        let mut c = GraphCounters::default();
        c.key(Key::new(1, 1, 0)).replays += 3;
        c.key(Key::new(8, 1, 0)).replays += 2;
        c.captured(Key::new(1, 1, 0), 7, Duration::from_millis(1));
        assert_eq!(c.replays(), 5);
        assert_eq!(c.keys[&Key::new(1, 1, 0)].captures, 1);
        assert_eq!(c.keys[&Key::new(1, 1, 0)].captured_launches, 7);
    }
}
