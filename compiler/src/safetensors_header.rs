//! Reading safetensors *headers* without touching tensor data.
//!
//! The compiler plans a model from its shapes and dtypes alone, so it reads
//! the 8-byte little-endian header length and the JSON header of each file
//! and nothing after it: compiling a 16 GB checkpoint reads a few kilobytes.
//! Because the data is never read, the header is checked against the file
//! instead: the header must fit in the file, every tensor's `data_offsets`
//! must lie inside the data section, describe exactly `numel * dtype size`
//! bytes, and not overlap another tensor. A truncated download or a file that
//! is not safetensors at all is caught here, at compile time, with the file
//! named.
//!
//! The SHA-256 of the header bytes (length prefix + JSON) identifies the file
//! in a plan: it changes when any tensor's name, dtype, shape or placement
//! changes, and costs nothing to compute.
//!
//! Deliberately not here: reading or converting tensor data (the runtime's
//! weight binder does that, at load), and writing safetensors files (see
//! [`crate::testing`] for the tiny-model writer tests use).

use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Largest header accepted (the same limit the reference implementation uses).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Element type of a stored tensor, as spelled in the header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StDtype {
    Bool,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
}

impl StDtype {
    const ALL: [StDtype; 15] = [
        StDtype::Bool,
        StDtype::U8,
        StDtype::I8,
        StDtype::F8E5M2,
        StDtype::F8E4M3,
        StDtype::I16,
        StDtype::U16,
        StDtype::F16,
        StDtype::BF16,
        StDtype::I32,
        StDtype::U32,
        StDtype::F32,
        StDtype::F64,
        StDtype::I64,
        StDtype::U64,
    ];

    /// The header spelling (`BF16`, `F32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            StDtype::Bool => "BOOL",
            StDtype::U8 => "U8",
            StDtype::I8 => "I8",
            StDtype::F8E5M2 => "F8_E5M2",
            StDtype::F8E4M3 => "F8_E4M3",
            StDtype::I16 => "I16",
            StDtype::U16 => "U16",
            StDtype::F16 => "F16",
            StDtype::BF16 => "BF16",
            StDtype::I32 => "I32",
            StDtype::U32 => "U32",
            StDtype::F32 => "F32",
            StDtype::F64 => "F64",
            StDtype::I64 => "I64",
            StDtype::U64 => "U64",
        }
    }

    pub fn from_name(s: &str) -> Option<StDtype> {
        StDtype::ALL.into_iter().find(|d| d.name() == s)
    }

    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            StDtype::Bool | StDtype::U8 | StDtype::I8 | StDtype::F8E5M2 | StDtype::F8E4M3 => 1,
            StDtype::I16 | StDtype::U16 | StDtype::F16 | StDtype::BF16 => 2,
            StDtype::I32 | StDtype::U32 | StDtype::F32 => 4,
            StDtype::F64 | StDtype::I64 | StDtype::U64 => 8,
        }
    }

    /// The kiln dtype of the same encoding, for the types kiln can load weights from.
    pub fn to_ir(self) -> Option<kiln_ir::DType> {
        match self {
            StDtype::BF16 => Some(kiln_ir::DType::BF16),
            StDtype::F16 => Some(kiln_ir::DType::F16),
            StDtype::F32 => Some(kiln_ir::DType::F32),
            StDtype::I32 => Some(kiln_ir::DType::I32),
            _ => None,
        }
    }
}

impl fmt::Display for StDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor's header entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: StDtype,
    pub shape: Vec<u64>,
    /// Byte range inside the data section (which starts after the header).
    pub data_offsets: (u64, u64),
}

impl TensorInfo {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// A parsed, validated safetensors header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SafetensorsHeader {
    /// Size of the whole file in bytes.
    pub file_size: u64,
    /// Length of the JSON header (the value of the 8-byte prefix).
    pub header_len: u64,
    /// Lowercase hex SHA-256 of the length prefix and the JSON bytes.
    pub header_sha256: String,
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorInfo>,
    /// The `__metadata__` string map (empty when absent).
    pub metadata: BTreeMap<String, String>,
}

/// Why a file's header cannot be used. Every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is {size} bytes, too short for a safetensors file (at least the 8-byte header length); the file is truncated or not safetensors: download it again", path.display())]
    TooShort { path: PathBuf, size: u64 },
    #[error("{} declares a {len}-byte header but the file holds only {avail} bytes after the length prefix; the file is truncated or not safetensors: download it again", path.display())]
    HeaderBeyondFile { path: PathBuf, len: u64, avail: u64 },
    #[error("{} declares a {len}-byte header, more than the {MAX_HEADER_BYTES}-byte limit; the file is corrupt or not safetensors", path.display())]
    HeaderTooLarge { path: PathBuf, len: u64 },
    #[error("{}: the header is not valid JSON ({problem}); the file is corrupt or not safetensors: download it again", path.display())]
    BadJson { path: PathBuf, problem: String },
    #[error("{}: tensor `{tensor}`: {problem}; the file is corrupt: download it again", path.display())]
    BadEntry {
        path: PathBuf,
        tensor: String,
        problem: String,
    },
}

impl SafetensorsHeader {
    /// Size of the data section (the file after the prefix and the header).
    pub fn data_len(&self) -> u64 {
        self.file_size - 8 - self.header_len
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// Reads and validates the header of the safetensors file at `path`, reading
/// only the first `8 + header_len` bytes.
pub fn read_header(path: &Path) -> Result<SafetensorsHeader, HeaderError> {
    let io = |source| HeaderError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut f = File::open(path).map_err(io)?;
    let file_size = f.metadata().map_err(io)?.len();
    if file_size < 8 {
        return Err(HeaderError::TooShort {
            path: path.to_path_buf(),
            size: file_size,
        });
    }
    let mut prefix = [0u8; 8];
    f.read_exact(&mut prefix).map_err(io)?;
    let header_len = header_len(path, prefix, file_size)?;
    let mut json = vec![0u8; header_len as usize];
    f.read_exact(&mut json).map_err(io)?;
    from_parts(path, file_size, prefix, &json)
}

/// [`read_header`] over a whole file image held in memory (the fuzzer's
/// entry point; the same checks in the same order).
pub fn parse_bytes(path: &Path, bytes: &[u8]) -> Result<SafetensorsHeader, HeaderError> {
    let file_size = bytes.len() as u64;
    let Some((prefix, rest)) = bytes.split_first_chunk::<8>() else {
        return Err(HeaderError::TooShort {
            path: path.to_path_buf(),
            size: file_size,
        });
    };
    let header_len = header_len(path, *prefix, file_size)?;
    from_parts(path, file_size, *prefix, &rest[..header_len as usize])
}

/// The JSON header length the 8-byte little-endian `prefix` declares,
/// checked against the limit and against a file of `file_size` bytes
/// (at least 8) before anything is allocated for it.
pub fn header_len(path: &Path, prefix: [u8; 8], file_size: u64) -> Result<u64, HeaderError> {
    let header_len = u64::from_le_bytes(prefix);
    if header_len > MAX_HEADER_BYTES {
        return Err(HeaderError::HeaderTooLarge {
            path: path.to_path_buf(),
            len: header_len,
        });
    }
    let avail = file_size.saturating_sub(8);
    if header_len > avail {
        return Err(HeaderError::HeaderBeyondFile {
            path: path.to_path_buf(),
            len: header_len,
            avail,
        });
    }
    Ok(header_len)
}

/// Hashes and parses a header whose length [`header_len`] has checked.
fn from_parts(
    path: &Path,
    file_size: u64,
    prefix: [u8; 8],
    json: &[u8],
) -> Result<SafetensorsHeader, HeaderError> {
    let header_len = json.len() as u64;
    let mut hasher = Sha256::new();
    hasher.update(prefix);
    hasher.update(json);
    let header_sha256 = hex(&hasher.finalize());
    let (tensors, metadata) = parse_json(path, json, file_size - 8 - header_len)?;
    Ok(SafetensorsHeader {
        file_size,
        header_len,
        header_sha256,
        tensors,
        metadata,
    })
}

type Parsed = (BTreeMap<String, TensorInfo>, BTreeMap<String, String>);

/// The first key that appears twice at the top level of a JSON object
/// (`serde_json::Value` keeps the last one silently, so a header naming a
/// tensor twice would otherwise describe a different file than the bytes).
pub fn first_duplicate_key(json: &[u8]) -> Option<String> {
    use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
    struct Keys;
    impl<'de> Visitor<'de> for Keys {
        type Value = Option<String>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Option<String>, A::Error> {
            let mut seen = std::collections::HashSet::new();
            let mut dup = None;
            while let Some(k) = m.next_key::<String>()? {
                m.next_value::<IgnoredAny>()?;
                if dup.is_none() && !seen.insert(k.clone()) {
                    dup = Some(k);
                }
            }
            Ok(dup)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(json);
    de.deserialize_map(Keys).ok().flatten()
}

/// Parses the JSON header and checks every entry against a data section of
/// `data_len` bytes.
pub fn parse_json(path: &Path, json: &[u8], data_len: u64) -> Result<Parsed, HeaderError> {
    let bad_json = |problem: String| HeaderError::BadJson {
        path: path.to_path_buf(),
        problem,
    };
    let value: serde_json::Value =
        serde_json::from_slice(json).map_err(|e| bad_json(e.to_string()))?;
    let serde_json::Value::Object(map) = value else {
        return Err(bad_json("the top level is not an object".into()));
    };
    if let Some(dup) = first_duplicate_key(json) {
        return Err(bad_json(format!(
            "tensor `{dup}` is listed twice in the header (a JSON object with a repeated key); the file is damaged or was not written by a safetensors writer"
        )));
    }
    let mut tensors = BTreeMap::new();
    let mut metadata = BTreeMap::new();
    for (name, entry) in map {
        let bad = |problem: String| HeaderError::BadEntry {
            path: path.to_path_buf(),
            tensor: name.clone(),
            problem,
        };
        if name == "__metadata__" {
            let serde_json::Value::Object(m) = entry else {
                return Err(bad("`__metadata__` is not an object".into()));
            };
            for (k, v) in m {
                if let serde_json::Value::String(s) = v {
                    metadata.insert(k, s);
                }
            }
            continue;
        }
        let serde_json::Value::Object(fields) = &entry else {
            return Err(bad("the entry is not an object".into()));
        };
        let dtype_name = fields
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| bad("`dtype` is missing or not a string".into()))?;
        let dtype = StDtype::from_name(dtype_name).ok_or_else(|| {
            let known: Vec<&str> = StDtype::ALL.iter().map(|d| d.name()).collect();
            bad(format!(
                "unknown dtype `{dtype_name}` (known: {})",
                known.join(", ")
            ))
        })?;
        let shape: Vec<u64> = fields
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect::<Option<Vec<u64>>>())
            .ok_or_else(|| {
                bad("`shape` is missing or not a list of non-negative integers".into())
            })?;
        let offsets: Vec<u64> = fields
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect::<Option<Vec<u64>>>())
            .filter(|o| o.len() == 2)
            .ok_or_else(|| bad("`data_offsets` is missing or not a pair of integers".into()))?;
        let (begin, end) = (offsets[0], offsets[1]);
        if begin > end {
            return Err(bad(format!("data_offsets [{begin}, {end}] are reversed")));
        }
        if end > data_len {
            return Err(bad(format!(
                "data_offsets [{begin}, {end}] run past the {data_len}-byte data section (the file is truncated)"
            )));
        }
        let numel = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
        let want = numel
            .checked_mul(dtype.size())
            .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
        if end - begin != want {
            return Err(bad(format!(
                "data_offsets [{begin}, {end}] span {} bytes but {dtype}{shape:?} needs {want}",
                end - begin
            )));
        }
        tensors.insert(
            name,
            TensorInfo {
                dtype,
                shape,
                data_offsets: (begin, end),
            },
        );
    }
    // No two tensors may share bytes.
    let mut spans: Vec<(u64, u64, &str)> = tensors
        .iter()
        .filter(|(_, t)| t.data_offsets.0 < t.data_offsets.1)
        .map(|(n, t)| (t.data_offsets.0, t.data_offsets.1, n.as_str()))
        .collect();
    spans.sort();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(HeaderError::BadEntry {
                path: path.to_path_buf(),
                tensor: w[1].2.to_string(),
                problem: format!(
                    "data_offsets [{}, {}] overlap tensor `{}` at [{}, {}]",
                    w[1].0, w[1].1, w[0].2, w[0].0, w[0].1
                ),
            });
        }
    }
    Ok((tensors, metadata))
}

#[cfg(test)]
mod duplicate_key_tests {
    use super::*;

    #[test]
    fn a_header_naming_a_tensor_twice_is_refused_naming_it() {
        let json = br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
        let e = parse_json(Path::new("m.safetensors"), json, 8)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`a` is listed twice"), "{e}");
        assert_eq!(first_duplicate_key(br#"{"a":1,"b":2}"#), None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn file_with(json: &str, data: usize) -> Vec<u8> {
        let mut v = (json.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(json.as_bytes());
        v.extend(std::iter::repeat_n(7u8, data));
        v
    }

    #[test]
    fn a_valid_header_is_parsed_and_hashed_over_prefix_and_json() {
        let dir = tempfile::tempdir().unwrap();
        let json = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},"b":{"dtype":"F32","shape":[],"data_offsets":[12,16]}}"#;
        let bytes = file_with(json, 16);
        let p = write(dir.path(), "m.safetensors", &bytes);
        let h = read_header(&p).unwrap();
        assert_eq!(h.file_size, bytes.len() as u64);
        assert_eq!(h.header_len, json.len() as u64);
        assert_eq!(h.data_len(), 16);
        assert_eq!(h.tensors["a"].shape, vec![2, 3]);
        assert_eq!(h.tensors["a"].dtype, StDtype::BF16);
        assert_eq!(h.tensors["b"].numel(), 1);
        assert_eq!(h.metadata["format"], "pt");
        let want = hex(&Sha256::digest(&bytes[..8 + json.len()]));
        assert_eq!(h.header_sha256, want);
        assert_eq!(h.header_sha256.len(), 64);
        // A different data section does not change the hash; a different header does.
        let mut other = bytes.clone();
        *other.last_mut().unwrap() = 9;
        let p2 = write(dir.path(), "m2.safetensors", &other);
        assert_eq!(read_header(&p2).unwrap().header_sha256, h.header_sha256);
        let json3 = json.replace("[2,3]", "[3,2]");
        let p3 = write(dir.path(), "m3.safetensors", &file_with(&json3, 16));
        assert_ne!(read_header(&p3).unwrap().header_sha256, h.header_sha256);
    }

    #[test]
    fn known_sha256_vector_is_reproduced() {
        assert_eq!(
            hex(&Sha256::digest(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn corrupt_headers_are_rejected_with_the_file_named() {
        let dir = tempfile::tempdir().unwrap();
        let ok = r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}"#;
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("short", vec![1, 2, 3], "too short"),
            (
                "beyond",
                {
                    let mut v = file_with(ok, 4);
                    v.truncate(20);
                    v
                },
                "holds only",
            ),
            (
                "huge",
                {
                    let mut v = u64::MAX.to_le_bytes().to_vec();
                    v.extend_from_slice(b"{}");
                    v
                },
                "limit",
            ),
            ("notjson", file_with("{not json", 0), "not valid JSON"),
            ("array", file_with("[1,2]", 0), "not an object"),
            (
                "dtype",
                file_with(&ok.replace("BF16", "Q4"), 4),
                "unknown dtype `Q4`",
            ),
            ("past", file_with(ok, 2), "run past"),
            ("size", file_with(&ok.replace("[2]", "[3]"), 4), "needs 6"),
            (
                "reversed",
                file_with(&ok.replace("[0,4]", "[4,0]"), 4),
                "reversed",
            ),
            ("shape", file_with(&ok.replace("[2]", "[-2]"), 4), "`shape`"),
            (
                "overlap",
                file_with(
                    r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[2,6]}}"#,
                    6,
                ),
                "overlap",
            ),
        ];
        for (name, bytes, needle) in cases {
            let p = write(dir.path(), &format!("{name}.safetensors"), &bytes);
            let e = read_header(&p).unwrap_err().to_string();
            assert!(e.contains(needle), "{name}: `{e}` lacks `{needle}`");
            assert!(e.contains(&format!("{name}.safetensors")), "{name}: {e}");
        }
    }

    #[test]
    fn a_missing_file_is_an_io_error_naming_it() {
        let e = read_header(Path::new("/nonexistent/x.safetensors"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/x.safetensors"), "{e}");
    }
}
