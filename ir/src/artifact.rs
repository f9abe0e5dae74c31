//! The `*.kiln` file format: a fixed header in front of a bincode-encoded
//! [`Plan`].
//!
//! A plan file is read by a serving process that may be a different kiln
//! build than the one that wrote it, and it may be damaged on disk. So the
//! body is framed by a header that is checked before any decoding:
//!
//! ```text
//! offset  size  field
//!      0     8  magic  b"KILNPLAN"
//!      8     4  format version, u32 little-endian (FORMAT_VERSION)
//!     12     8  body length in bytes, u64 little-endian
//!     20     4  CRC-32 (IEEE) of the body, u32 little-endian
//!     24     n  body: bincode 2 (serde, standard config) of `Plan`
//! ```
//!
//! Decoding checks, in order: magic, version, length, checksum, then decodes
//! the body with a bincode byte limit derived from the body's length, so a
//! corrupted length prefix inside the body cannot make the decoder allocate
//! more than a small multiple of the file size. Every failure is a distinct
//! [`ArtifactError`] whose message says what to do.
//!
//! Not here: compatibility shims for older formats (a version mismatch is an
//! error: recompiling is cheap and always correct), and any validation of the
//! plan's contents against a device or weights (the runtime's loader does
//! that).

use crate::plan::Plan;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// First eight bytes of every plan file.
pub const MAGIC: [u8; 8] = *b"KILNPLAN";

/// Version of the encoding this build writes and reads. Bump it whenever a
/// plan type changes shape (a serde field added, removed or reordered).
pub const FORMAT_VERSION: u32 = 7;

/// Bytes before the body.
pub const HEADER_LEN: usize = 24;

/// Why a plan file could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArtifactError {
    #[error("plan file is truncated: {needed} bytes expected, {got} present; the file was cut short (interrupted copy?): copy it again or recompile it with `kiln compile`")]
    Truncated { needed: u64, got: u64 },
    #[error("not a kiln plan file (the first bytes are not `KILNPLAN`); pass a file written by `kiln compile -o model.kiln`")]
    BadMagic,
    #[error("plan file format version {found} is newer than this kiln understands (version {supported}); upgrade kiln, or recompile the model with this kiln (`kiln compile`)")]
    NewerVersion { found: u32, supported: u32 },
    #[error("plan file format version {found} is older than this kiln understands (version {supported}); recompile the model with this kiln (`kiln compile`)")]
    OlderVersion { found: u32, supported: u32 },
    #[error("plan file has {extra} unexpected bytes after its body; the file is damaged: recompile it with `kiln compile`")]
    TrailingBytes { extra: u64 },
    #[error("plan file checksum mismatch (header says {expected:#010x}, body hashes to {actual:#010x}); the file is corrupted: recompile it with `kiln compile`")]
    ChecksumMismatch { expected: u32, actual: u32 },
    #[error("plan file body does not decode ({message}) although its checksum matches; it was written by an incompatible kiln build: recompile it with this kiln (`kiln compile`)")]
    Body { message: String },
}

/// Encodes a plan into the file format.
pub fn encode(plan: &Plan) -> Vec<u8> {
    let body = bincode::serde::encode_to_vec(plan, bincode::config::standard())
        .expect("plan types are plain data: bincode serialization cannot fail");
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Decodes a plan file, checking the header first. Never panics; allocates
/// at most a small multiple of `bytes.len()` whatever the input.
pub fn decode(bytes: &[u8]) -> Result<Plan, ArtifactError> {
    let got = bytes.len() as u64;
    let truncated = |needed: u64| ArtifactError::Truncated { needed, got };
    // Magic: a short file that starts like a plan is truncated; anything else
    // is not a plan at all.
    let m = bytes.len().min(MAGIC.len());
    if bytes[..m] != MAGIC[..m] {
        return Err(ArtifactError::BadMagic);
    }
    if bytes.len() < HEADER_LEN {
        return Err(truncated(HEADER_LEN as u64));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
    if version > FORMAT_VERSION {
        return Err(ArtifactError::NewerVersion {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    if version < FORMAT_VERSION {
        return Err(ArtifactError::OlderVersion {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    let body_len = u64::from_le_bytes(bytes[12..20].try_into().unwrap());
    let expected = u32::from_le_bytes(bytes[20..24].try_into().unwrap());
    let avail = got - HEADER_LEN as u64;
    if body_len > avail {
        return Err(truncated((HEADER_LEN as u64).saturating_add(body_len)));
    }
    if body_len < avail {
        return Err(ArtifactError::TrailingBytes {
            extra: avail - body_len,
        });
    }
    let body = &bytes[HEADER_LEN..];
    let actual = crc32fast::hash(body);
    if actual != expected {
        return Err(ArtifactError::ChecksumMismatch { expected, actual });
    }
    decode_body(body)
}

/// Decodes the body with a bincode byte limit sized from its length.
///
/// bincode counts, against the limit, the in-memory size of every primitive
/// it decodes (at most 8 bytes for the widest field in a plan, which is at
/// least one encoded byte) plus the length of every string and byte buffer
/// before allocating it. So a valid body never claims more than
/// `8 * len`, and a corrupt one is refused before it allocates more than
/// the limit. The limit is a const generic, hence the power-of-two buckets:
/// the limit is at most twice what a valid body of this length can claim.
fn decode_body(body: &[u8]) -> Result<Plan, ArtifactError> {
    let need = (body.len() as u64)
        .saturating_mul(8)
        .saturating_add(64 << 10);
    macro_rules! bucket {
        ($($shift:literal),*) => {
            $(
                if need <= 1u64 << $shift {
                    return finish(bincode::serde::decode_from_slice(
                        body,
                        bincode::config::standard().with_limit::<{ 1usize << $shift }>(),
                    ), body.len());
                }
            )*
        };
    }
    #[cfg(target_pointer_width = "64")]
    bucket!(20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40);
    #[cfg(not(target_pointer_width = "64"))]
    bucket!(20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30);
    Err(ArtifactError::Body {
        message: format!(
            "a {}-byte body is larger than any plan kiln writes",
            body.len()
        ),
    })
}

fn finish(
    r: Result<(Plan, usize), bincode::error::DecodeError>,
    len: usize,
) -> Result<Plan, ArtifactError> {
    match r {
        Ok((plan, used)) if used == len => Ok(plan),
        Ok((_, used)) => Err(ArtifactError::Body {
            message: format!("the plan ends at byte {used} of a {len}-byte body"),
        }),
        Err(e) => Err(ArtifactError::Body {
            message: e.to_string(),
        }),
    }
}

/// Writes `plan` to `path` atomically: the bytes go to a temporary file in the
/// same directory, are flushed to disk, and the file is renamed over `path`.
/// On any failure the temporary file is removed and `path` is untouched.
pub fn write_plan_atomic(path: &Path, plan: &Plan) -> io::Result<()> {
    write_bytes_atomic(path, &encode(plan))
}

/// Reads and decodes a plan file; I/O errors and format errors are kept apart.
pub fn read_plan(path: &Path) -> Result<Result<Plan, ArtifactError>, io::Error> {
    let bytes = std::fs::read(path)?;
    Ok(decode(&bytes))
}

/// [`write_plan_atomic`] for already encoded bytes.
pub fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let file_name = path.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("`{}` does not name a file", path.display()),
        )
    })?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    // A name unique to this process and call: concurrent writers of the same
    // path each rename a complete file; the last rename wins.
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(
        ".{}.{}.{}.tmp",
        file_name.to_string_lossy(),
        std::process::id(),
        n
    ));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Key;
    use crate::manifest::{TensorRef, WeightEntry, WeightManifest, WeightSource};
    use crate::plan::*;
    use crate::types::{DType, Shape};
    use crate::Graph;

    fn plan() -> Plan {
        let t = TensorRef {
            file: "model.safetensors".into(),
            tensor: "w".into(),
            dtype: DType::BF16,
            shape: Shape::new([3, 5]),
        };
        Plan {
            meta: ModelMeta {
                architecture: "LlamaForCausalLM".into(),
                files: vec![SourceFile {
                    name: "model.safetensors".into(),
                    size: 12345,
                    header_sha256: "ab".repeat(32),
                }],
                compiler_version: "0.1.0".into(),
                target: Target::Hip {
                    gfx: "gfx1100".into(),
                },
                info: ModelInfo {
                    vocab_size: 77,
                    hidden_size: 16,
                    num_layers: 2,
                    num_heads: 4,
                    num_kv_heads: 2,
                    head_dim: 4,
                    max_context: 64,
                    bos_token_id: Some(1),
                    eos_token_ids: vec![2, 3],
                    dtype: DType::BF16,
                },
            },
            manifest: WeightManifest {
                entries: vec![WeightEntry {
                    name: "w".into(),
                    dtype: DType::BF16,
                    shape: Shape::new([6, 5]),
                    storage: None,
                    source: WeightSource::ConcatRows(vec![t.clone(), t]),
                }],
            },
            kv: KvLayout {
                layers: 2,
                kv_heads: 2,
                head_dim: 4,
                dtype: DType::BF16,
                block_size: 16,
                num_blocks: 9,
                null_block: 0,
                max_blocks_per_seq: 4,
            },
            arena_bytes: 4096,
            workspace_bytes: 0,
            counter_bytes: 64,
            keys: vec![KeyPlan {
                key: Key::new(2, 1, 0),
                graph: Graph::new("g"),
                ops: vec![],
                buffers: vec![],
                inputs: vec![],
                outputs: vec![],
                io_bytes: 512,
                arena_peak: 4096,
                arena_lower_bound: 3840,
                workspace_bytes: 0,
                launches: 0,
                flops: 99,
                bytes_moved: 1000,
                schedule: Default::default(),
            }],
            kernels: vec![KernelImage {
                name: "m".into(),
                kind: ImageKind::CodeObject,
                code: vec![1, 2, 3, 250],
            }],
            kernel_abi: 0x0123_4567_89ab_cdef,
            tp: 1,
        }
    }

    #[test]
    fn a_plan_survives_encode_and_decode() {
        let p = plan();
        assert_eq!(decode(&encode(&p)).unwrap(), p);
    }

    #[test]
    fn each_header_fault_has_its_own_error() {
        let good = encode(&plan());
        let mut b = good.clone();
        b[0] = b'X';
        assert_eq!(decode(&b), Err(ArtifactError::BadMagic));
        assert_eq!(decode(b"ELF"), Err(ArtifactError::BadMagic));
        assert!(matches!(
            decode(&good[..5]),
            Err(ArtifactError::Truncated { needed: 24, got: 5 })
        ));
        assert!(matches!(
            decode(&good[..good.len() - 1]),
            Err(ArtifactError::Truncated { .. })
        ));
        let mut b = good.clone();
        b[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
        assert!(matches!(
            decode(&b),
            Err(ArtifactError::NewerVersion { .. })
        ));
        let mut b = good.clone();
        b[8..12].copy_from_slice(&(FORMAT_VERSION - 1).to_le_bytes());
        let e = decode(&b).unwrap_err();
        assert!(matches!(e, ArtifactError::OlderVersion { .. }));
        assert!(e.to_string().contains("recompile"), "{e}");
        let mut b = good.clone();
        b.push(0);
        assert_eq!(decode(&b), Err(ArtifactError::TrailingBytes { extra: 1 }));
        let mut b = good.clone();
        let last = b.len() - 1;
        b[last] ^= 0x40;
        assert!(matches!(
            decode(&b),
            Err(ArtifactError::ChecksumMismatch { .. })
        ));
    }

    #[test]
    fn a_body_that_checksums_but_does_not_decode_is_a_body_error() {
        let good = encode(&plan());
        // Replace the body with garbage and fix up the checksum: only the
        // decoder can notice.
        let mut b = good[..HEADER_LEN].to_vec();
        let body: Vec<u8> = (0..good.len() - HEADER_LEN)
            .map(|i| (i * 131 % 251) as u8 | 0x80)
            .collect();
        b[20..24].copy_from_slice(&crc32fast::hash(&body).to_le_bytes());
        b.extend_from_slice(&body);
        assert!(matches!(decode(&b), Err(ArtifactError::Body { .. })));
    }

    #[test]
    fn atomic_write_leaves_the_plan_and_no_temporary_file() {
        let dir = std::env::temp_dir().join(format!("kiln-artifact-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.kiln");
        write_plan_atomic(&path, &plan()).unwrap();
        assert_eq!(read_plan(&path).unwrap().unwrap(), plan());
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("m.kiln")]);
        // Writing into a missing directory fails and creates nothing.
        assert!(write_plan_atomic(&dir.join("missing/m.kiln"), &plan()).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
