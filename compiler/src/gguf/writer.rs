//! A small GGUF writer.
//!
//! kiln never ships GGUF files; this exists so tests (here and in other
//! crates) can write real GGUF images of tiny random models, with real
//! quantized blocks, and so corruption tests can start from a valid file.
//! It writes versions 2 and 3 (identical on disk for little-endian files)
//! and honours `general.alignment`. It does not write big-endian files.

use super::dequant::{self};
use super::error::GgufError;
use super::reader::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC};
use super::types::GgmlType;
use super::value::{MetaValue, ValueType};
use std::collections::HashSet;
use std::io::Write;
use std::path::Path;

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

/// Builds a GGUF image in memory.
pub struct GgufWriter {
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        GgufWriter::new()
    }
}

impl GgufWriter {
    /// An empty version-3 file.
    pub fn new() -> GgufWriter {
        GgufWriter {
            version: 3,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Sets the version field written in the header (any value, so tests
    /// can write versions the reader must reject).
    pub fn set_version(&mut self, version: u32) -> &mut Self {
        self.version = version;
        self
    }

    /// Adds a metadata pair. A `general.alignment` pair also sets the
    /// alignment the writer pads to.
    pub fn add_meta(&mut self, key: &str, value: MetaValue) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    pub fn add_str(&mut self, key: &str, value: &str) -> &mut Self {
        self.add_meta(key, MetaValue::String(value.to_string()))
    }

    pub fn add_u32(&mut self, key: &str, value: u32) -> &mut Self {
        self.add_meta(key, MetaValue::U32(value))
    }

    pub fn add_f32(&mut self, key: &str, value: f32) -> &mut Self {
        self.add_meta(key, MetaValue::F32(value))
    }

    pub fn add_bool(&mut self, key: &str, value: bool) -> &mut Self {
        self.add_meta(key, MetaValue::Bool(value))
    }

    /// Adds an array of strings.
    pub fn add_str_array<S: AsRef<str>>(&mut self, key: &str, items: &[S]) -> &mut Self {
        let items = items
            .iter()
            .map(|s| MetaValue::String(s.as_ref().to_string()))
            .collect();
        self.add_meta(
            key,
            MetaValue::Array {
                elem: ValueType::String,
                items,
            },
        )
    }

    /// Adds an array of f32 (SentencePiece scores).
    pub fn add_f32_array(&mut self, key: &str, items: &[f32]) -> &mut Self {
        let items = items.iter().map(|&v| MetaValue::F32(v)).collect();
        self.add_meta(
            key,
            MetaValue::Array {
                elem: ValueType::F32,
                items,
            },
        )
    }

    /// Adds an array of i32.
    pub fn add_i32_array(&mut self, key: &str, items: &[i32]) -> &mut Self {
        let items = items.iter().map(|&v| MetaValue::I32(v)).collect();
        self.add_meta(
            key,
            MetaValue::Array {
                elem: ValueType::I32,
                items,
            },
        )
    }

    /// Adds a tensor from raw bytes. `dims` are in GGML order (innermost
    /// first); `data` must be exactly the bytes `ty` needs for them.
    pub fn add_raw_tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> Result<&mut Self, GgufError> {
        let n: u64 = dims.iter().product();
        let expected = usize::try_from(n)
            .ok()
            .and_then(|n| dequant::byte_len(ty, n));
        if expected != Some(data.len()) {
            return Err(GgufError::Write {
                reason: format!(
                    "tensor {name:?}: {ty} data for dims {dims:?} must be {expected:?} bytes, got {}",
                    data.len()
                ),
            });
        }
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty,
            data,
        });
        Ok(self)
    }

    /// Adds a tensor given in PyTorch shape order (outermost first) as f32
    /// values, encoded as `ty` (F32, F16, BF16, Q8_0, Q4_0 or Q4_1).
    pub fn add_tensor(
        &mut self,
        name: &str,
        shape: &[u64],
        ty: GgmlType,
        values: &[f32],
    ) -> Result<&mut Self, GgufError> {
        let data = dequant::quantize(ty, values).map_err(|e| GgufError::Write {
            reason: format!("tensor {name:?}: {e}"),
        })?;
        let dims: Vec<u64> = shape.iter().rev().copied().collect();
        self.add_raw_tensor(name, &dims, ty, data)
    }

    fn alignment(&self) -> Result<u64, GgufError> {
        match self.metadata.iter().rev().find(|(k, _)| k == ALIGNMENT_KEY) {
            None => Ok(DEFAULT_ALIGNMENT),
            Some((_, MetaValue::U32(a))) if *a != 0 && a.is_power_of_two() => Ok(u64::from(*a)),
            Some((_, v)) => Err(GgufError::Write {
                reason: format!("{ALIGNMENT_KEY} must be a power-of-two uint32, got {v:?}"),
            }),
        }
    }

    /// The complete file image.
    pub fn to_bytes(&self) -> Result<Vec<u8>, GgufError> {
        let alignment = self.alignment()?;
        let mut names = HashSet::new();
        if let Some(t) = self.tensors.iter().find(|t| !names.insert(&t.name)) {
            return Err(GgufError::Write {
                reason: format!("tensor {:?} added twice", t.name),
            });
        }
        let mut out = Vec::new();
        out.extend(GGUF_MAGIC);
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_str(&mut out, key);
            out.extend(value.value_type().id().to_le_bytes());
            put_value(&mut out, key, value)?;
        }
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ty.id().to_le_bytes());
            out.extend(offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len() as u64).div_ceil(alignment) * alignment;
        }
        pad_to(&mut out, alignment);
        let data_start = out.len() as u64;
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize((data_start + off) as usize, 0);
            out.extend(&t.data);
        }
        Ok(out)
    }

    /// Writes the file to `path` through a temporary file in the same
    /// directory, renamed into place.
    pub fn write(&self, path: &Path) -> Result<(), GgufError> {
        let bytes = self.to_bytes()?;
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io)?;
        tmp.write_all(&bytes).map_err(io)?;
        tmp.persist(path).map_err(|e| io(e.error))?;
        Ok(())
    }
}

fn pad_to(out: &mut Vec<u8>, alignment: u64) {
    let len = (out.len() as u64).div_ceil(alignment) * alignment;
    out.resize(len as usize, 0);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, key: &str, value: &MetaValue) -> Result<(), GgufError> {
    match value {
        MetaValue::U8(v) => out.push(*v),
        MetaValue::I8(v) => out.extend(v.to_le_bytes()),
        MetaValue::U16(v) => out.extend(v.to_le_bytes()),
        MetaValue::I16(v) => out.extend(v.to_le_bytes()),
        MetaValue::U32(v) => out.extend(v.to_le_bytes()),
        MetaValue::I32(v) => out.extend(v.to_le_bytes()),
        MetaValue::F32(v) => out.extend(v.to_le_bytes()),
        MetaValue::U64(v) => out.extend(v.to_le_bytes()),
        MetaValue::I64(v) => out.extend(v.to_le_bytes()),
        MetaValue::F64(v) => out.extend(v.to_le_bytes()),
        MetaValue::Bool(v) => out.push(u8::from(*v)),
        MetaValue::String(s) => put_str(out, s),
        MetaValue::Array { elem, items } => {
            out.extend(elem.id().to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for item in items {
                if item.value_type() != *elem {
                    return Err(GgufError::Write {
                        reason: format!(
                            "array {key:?} is declared as {elem} but holds a {}",
                            item.value_type()
                        ),
                    });
                }
                put_value(out, key, item)?;
            }
        }
    }
    Ok(())
}
