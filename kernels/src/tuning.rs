//! GEMM tuning tables: which implementation (`gemv`, `skinny`, `blas`)
//! each GEMM shape of a target should use, as measured by `kiln tune`.
//!
//! The GEMM choice is a compile-time decision recorded in the plan
//! (`Lowering::Gemm::kind`); the runtime never times anything. Without a
//! table, `crate::gpu::default_gemm_kind` decides. With one (`kiln compile
//! --tuning tuning.json`), an entry overrides the rule for its exact shape
//! when it was measured for the same target under the same kernel-source
//! fingerprint (`crate::gpu::gemm_fingerprint`); an entry measured under
//! other kernels is stale and ignored with a note, never used.
//!
//! Deliberately not here: the measuring (the CLI drives the runtime's GPU
//! backend) and any notion of a "close enough" shape: an entry applies to
//! its exact (T, N, K, dtypes, bias) only.

use crate::gpu::gemm_fingerprint;
use kiln_ir::plan::{GemmKind, GemmShape, Target};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Version of the table format this build reads and writes.
pub const TUNING_FORMAT: u32 = 1;

/// A tuning table file.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TuningTable {
    /// [`TUNING_FORMAT`].
    pub format: u32,
    pub entries: Vec<TuningEntry>,
}

/// One measured GEMM shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TuningEntry {
    /// The plan target it was measured for (`cuda:sm_90`).
    pub target: String,
    /// The device it ran on (for people; not part of the key).
    pub device: String,
    pub shape: GemmShape,
    /// [`gemm_fingerprint`] of the measuring build, as 16 hex digits.
    pub fingerprint: String,
    /// The fastest candidate.
    pub best: GemmKind,
    /// Median microseconds per candidate that ran (by `GemmKind::name`).
    pub median_us: BTreeMap<String, f64>,
}

/// Why a tuning table could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TuningError {
    #[error("cannot read tuning table {path}: {source}; pass a file written by `kiln tune`")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("tuning table {path} is not valid JSON of the expected shape: {source}; regenerate it with `kiln tune`")]
    Parse {
        path: String,
        source: serde_json::Error,
    },
    #[error("tuning table {path} has format {found}, this build reads format {TUNING_FORMAT}; regenerate it with `kiln tune`")]
    Format { path: String, found: u32 },
}

/// The current fingerprint as a table stores it.
pub fn fingerprint_hex() -> String {
    format!("{:016x}", gemm_fingerprint())
}

impl TuningTable {
    pub fn new() -> TuningTable {
        TuningTable {
            format: TUNING_FORMAT,
            entries: Vec::new(),
        }
    }

    /// Reads a table written by `kiln tune`.
    pub fn read(path: &Path) -> Result<TuningTable, TuningError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| TuningError::Read {
            path: p.clone(),
            source,
        })?;
        TuningTable::parse(&text, &p)
    }

    /// Parses a table's JSON text (`path` names it in errors).
    pub fn parse(text: &str, path: &str) -> Result<TuningTable, TuningError> {
        let t: TuningTable = serde_json::from_str(text).map_err(|source| TuningError::Parse {
            path: path.to_string(),
            source,
        })?;
        if t.format != TUNING_FORMAT {
            return Err(TuningError::Format {
                path: path.to_string(),
                found: t.format,
            });
        }
        Ok(t)
    }

    /// The table as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a tuning table always serializes")
    }

    /// Adds (or replaces) the entry for `(target, shape)` at the current
    /// fingerprint.
    pub fn record(&mut self, entry: TuningEntry) {
        self.entries
            .retain(|e| !(e.target == entry.target && e.shape == entry.shape));
        self.entries.push(entry);
    }

    /// The choices that apply to `target` under the current kernels, and a
    /// note for every entry of that target that is stale (measured under
    /// another kernel-source fingerprint) and therefore ignored. Entries
    /// for other targets are skipped silently (one table may cover
    /// several). Where one shape appears twice, the later entry wins.
    pub fn choices(&self, target: &Target) -> (HashMap<GemmShape, GemmKind>, Vec<String>) {
        let want = target.to_string();
        let fp = fingerprint_hex();
        let mut out = HashMap::new();
        let mut notes = Vec::new();
        for e in self.entries.iter().filter(|e| e.target == want) {
            if e.fingerprint == fp {
                out.insert(e.shape, e.best);
            } else {
                notes.push(format!(
                    "tuning entry for GEMM {}x{}x{} {} -> {}{} was measured under kernel fingerprint {}, not the current {fp}: ignored (the default rule decides; rerun kiln tune)",
                    e.shape.t,
                    e.shape.n,
                    e.shape.k,
                    e.shape.dtype,
                    e.shape.out,
                    if e.shape.bias { " +bias" } else { "" },
                    e.fingerprint
                ));
            }
        }
        (out, notes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_ir::DType;

    fn shape(t: u32) -> GemmShape {
        GemmShape {
            t,
            n: 4096,
            k: 1024,
            dtype: DType::BF16,
            out: DType::BF16,
            bias: false,
        }
    }

    fn entry(target: &str, t: u32, fp: &str, best: GemmKind) -> TuningEntry {
        TuningEntry {
            target: target.into(),
            device: "test".into(),
            shape: shape(t),
            fingerprint: fp.into(),
            best,
            median_us: BTreeMap::from([("blas".to_string(), 3.5)]),
        }
    }

    #[test]
    fn current_entries_of_the_target_apply_and_stale_ones_are_noted_and_ignored() {
        let fp = fingerprint_hex();
        let mut t = TuningTable::new();
        t.record(entry("cuda:sm_90", 8, &fp, GemmKind::Blas));
        t.record(entry("cuda:sm_90", 16, "0123456789abcdef", GemmKind::Gemv));
        t.record(entry("cuda:sm_80", 4, &fp, GemmKind::Gemv));
        let (c, notes) = t.choices(&Target::Cuda { sm: 90 });
        assert_eq!(c.len(), 1);
        assert_eq!(c.get(&shape(8)), Some(&GemmKind::Blas));
        assert!(!c.contains_key(&shape(16)));
        assert_eq!(notes.len(), 1);
        assert!(notes[0].contains("0123456789abcdef") && notes[0].contains("ignored"));
        let (c80, notes80) = t.choices(&Target::Cuda { sm: 80 });
        assert_eq!(c80.get(&shape(4)), Some(&GemmKind::Gemv));
        assert!(notes80.is_empty());
    }

    #[test]
    fn a_table_round_trips_through_json_and_a_rerecorded_shape_replaces_the_old_entry() {
        let fp = fingerprint_hex();
        let mut t = TuningTable::new();
        t.record(entry("cuda:sm_90", 8, &fp, GemmKind::Blas));
        t.record(entry("cuda:sm_90", 8, &fp, GemmKind::Skinny));
        assert_eq!(t.entries.len(), 1);
        let back = TuningTable::parse(&t.to_json(), "t.json").unwrap();
        assert_eq!(back, t);
        assert_eq!(back.entries[0].best, GemmKind::Skinny);
    }

    #[test]
    fn a_table_of_another_format_or_not_json_is_refused_with_the_fix() {
        let e = TuningTable::parse(r#"{"format": 99, "entries": []}"#, "t.json").unwrap_err();
        assert!(e.to_string().contains("format 99") && e.to_string().contains("kiln tune"));
        let e = TuningTable::parse("not json", "t.json").unwrap_err();
        assert!(e.to_string().contains("t.json"));
    }
}
