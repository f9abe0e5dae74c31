//! Parsing a GGUF file: header, metadata, tensor table, data section.
//!
//! The parser treats the file as hostile. Every count and length it reads is
//! checked against the bytes that remain before anything is allocated for
//! it, every tensor's extent is checked against the data section, and every
//! failure is a [`GgufError`] naming the problem; nothing here panics on bad
//! input. Tensor bytes are never copied: a [`GgufFile`] keeps the file
//! memory-mapped and hands out slices.
//!
//! GGUF version 1 (32-bit counts, 2023) is rejected rather than supported:
//! no current tool writes it.

use super::dequant::{self, DequantError};
use super::error::GgufError;
use super::types::GgmlType;
use super::value::{MetaValue, ValueType};
use memmap2::Mmap;
use std::collections::HashMap;
use std::ops::Deref;
use std::path::{Path, PathBuf};

/// `GGUF` as the first four bytes of the file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of each tensor when the file does not
/// say otherwise.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that overrides [`DEFAULT_ALIGNMENT`].
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// GGML tensors have at most this many dimensions.
pub const MAX_DIMS: u32 = 4;
/// Arrays of arrays deeper than this are rejected (real files use depth 1).
pub const MAX_ARRAY_NESTING: usize = 8;
/// Most items reserved up front for any count read from the file; larger
/// collections grow as their items are actually parsed.
const PREALLOC_LIMIT: u64 = 1 << 16;

/// One entry of the tensor table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in GGML order: `dims[0]` (ne0) is the innermost,
    /// contiguous one. A PyTorch `[out, in]` matrix is stored as `[in, out]`.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Byte offset of the tensor inside the data section.
    pub offset: u64,
    pub n_elements: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    /// The shape in PyTorch / safetensors order (outermost first), i.e. the
    /// GGML dims reversed.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

enum Backing {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file. The tensor data stays in the (memory-mapped) file.
pub struct GgufFile {
    path: Option<PathBuf>,
    bytes: Backing,
    version: u32,
    alignment: u64,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    data_start: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("data_start", &self.data_start)
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`.
    ///
    /// The mapping is read-only. As with any memory map, another process
    /// truncating the file while it is mapped makes later reads fault; kiln
    /// only reads model files nobody is writing.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let backing = if len == 0 {
            // Mapping an empty file fails on some platforms; an empty buffer
            // gives the proper "truncated" error instead.
            Backing::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only and lives as long as `GgufFile`;
            // see the note above about concurrent truncation.
            Backing::Mapped(unsafe { Mmap::map(&file) }.map_err(io)?)
        };
        let mut parsed = GgufFile::parse(backing)?;
        parsed.path = Some(path.to_path_buf());
        Ok(parsed)
    }

    /// Parses a GGUF image held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        GgufFile::parse(Backing::Owned(bytes))
    }

    fn parse(bytes: Backing) -> Result<GgufFile, GgufError> {
        let mut cur = Cursor {
            buf: &bytes,
            pos: 0,
        };
        let magic = cur.take(4, "the magic bytes")?;
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic {
                found: magic.to_vec(),
            });
        }
        let version = cur.u32("the format version")?;
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion { version });
        }
        let tensor_count = cur.u64("the tensor count")?;
        let kv_count = cur.u64("the metadata count")?;
        // A key-value pair is at least a key length, an empty key, a type
        // tag and a one-byte value; a tensor-info record is at least a name
        // length, a dim count, a type and an offset.
        cur.check_count("the metadata key-value count", kv_count, 8 + 4 + 1)?;
        let reserve = kv_count.min(PREALLOC_LIMIT) as usize;
        let mut metadata = Vec::with_capacity(reserve);
        let mut meta_index = HashMap::with_capacity(reserve);
        for i in 0..kv_count {
            let key = cur.string(&format!("metadata key #{i}"))?;
            let type_id = cur.u32(&format!("the value type of {key:?}"))?;
            let ty = ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
                key: key.clone(),
                type_id,
            })?;
            let value = cur.value(ty, &key, 0)?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::DuplicateKey { key });
            }
            metadata.push((key, value));
        }

        let alignment = match meta_index.get(ALIGNMENT_KEY).map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(MetaValue::U32(a)) if *a != 0 && a.is_power_of_two() => u64::from(*a),
            Some(other) => {
                return Err(GgufError::BadAlignment {
                    value: format!("{other:?}"),
                })
            }
        };

        cur.check_count("the tensor count", tensor_count, 8 + 4 + 4 + 8)?;
        let reserve = tensor_count.min(PREALLOC_LIMIT) as usize;
        let mut tensors = Vec::with_capacity(reserve);
        let mut tensor_index = HashMap::with_capacity(reserve);
        for i in 0..tensor_count {
            let name = cur.string(&format!("the name of tensor #{i}"))?;
            let n_dims = cur.u32(&format!("the dimension count of {name:?}"))?;
            if n_dims > MAX_DIMS {
                return Err(GgufError::TooManyDims { name, n_dims });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims {
                dims.push(cur.u64(&format!("dimension {d} of {name:?}"))?);
            }
            let type_id = cur.u32(&format!("the type of {name:?}"))?;
            let ggml_type =
                GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
                    name: name.clone(),
                    type_id,
                })?;
            let offset = cur.u64(&format!("the data offset of {name:?}"))?;
            let n_elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| GgufError::SizeOverflow {
                    name: name.clone(),
                    dims: dims.clone(),
                })?;
            let block = ggml_type.block_size();
            let ne0 = dims.first().copied().unwrap_or(1);
            if ne0 % block != 0 {
                return Err(GgufError::NotBlockAligned {
                    name,
                    ty: ggml_type,
                    ne0,
                    block,
                });
            }
            let n_bytes = (n_elements / block)
                .checked_mul(ggml_type.block_bytes())
                .ok_or_else(|| GgufError::SizeOverflow {
                    name: name.clone(),
                    dims: dims.clone(),
                })?;
            if offset % alignment != 0 {
                return Err(GgufError::MisalignedTensor {
                    name,
                    offset,
                    alignment,
                });
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor { name });
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
                n_elements,
                n_bytes,
            });
        }

        let file_len = bytes.len() as u64;
        // The data section starts at the next multiple of the alignment. A
        // file with no tensors may end right after its header.
        let data_start = cur.pos.div_ceil(alignment) * alignment;
        let available = file_len.saturating_sub(data_start);
        for t in &tensors {
            let end = t.offset.checked_add(t.n_bytes);
            if end.is_none_or(|end| end > available) {
                return Err(GgufError::TensorOutOfBounds {
                    name: t.name.clone(),
                    start: t.offset,
                    end: end.unwrap_or(u64::MAX),
                    available,
                });
            }
        }

        Ok(GgufFile {
            path: None,
            bytes,
            version,
            alignment,
            metadata,
            meta_index,
            tensors,
            tensor_index,
            data_start,
        })
    }

    /// Where the file came from, when it was opened from disk.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset of the data section.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// A required metadata value; `why` completes "which ..." in the error.
    pub fn require(&self, key: &str, why: &str) -> Result<&MetaValue, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            key: key.to_string(),
            why: why.to_string(),
        })
    }

    /// A required non-negative integer (any integer value type).
    pub fn require_u64(&self, key: &str, why: &str) -> Result<u64, GgufError> {
        let v = self.require(key, why)?;
        v.as_u64()
            .ok_or_else(|| wrong_type(key, "a non-negative integer", v))
    }

    /// An optional non-negative integer; present with another type is an error.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| wrong_type(key, "a non-negative integer", v)),
        }
    }

    /// A required number (float or integer value types).
    pub fn require_f64(&self, key: &str, why: &str) -> Result<f64, GgufError> {
        let v = self.require(key, why)?;
        v.as_f64().ok_or_else(|| wrong_type(key, "a number", v))
    }

    /// An optional number; present with another type is an error.
    pub fn get_f64(&self, key: &str) -> Result<Option<f64>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| wrong_type(key, "a number", v)),
        }
    }

    pub fn require_str(&self, key: &str, why: &str) -> Result<&str, GgufError> {
        let v = self.require(key, why)?;
        v.as_str().ok_or_else(|| wrong_type(key, "a string", v))
    }

    /// An optional string; present with another type is an error.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| wrong_type(key, "a string", v)),
        }
    }

    /// An optional bool; present with another type is an error.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| wrong_type(key, "a bool", v)),
        }
    }

    /// A required array whose items all have value type `elem`.
    pub fn require_array(
        &self,
        key: &str,
        elem: ValueType,
        why: &str,
    ) -> Result<&[MetaValue], GgufError> {
        let v = self.require(key, why)?;
        match v {
            MetaValue::Array { elem: e, items } if *e == elem => Ok(items),
            _ => Err(wrong_type(key, &format!("an array of {elem}"), v)),
        }
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw (possibly quantized) bytes of a tensor. Bounds were checked
    /// when the file was parsed.
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.data_start + t.offset) as usize;
        &self.bytes[start..start + t.n_bytes as usize]
    }

    /// The tensor `name` dequantized to f32, in GGML element order (which is
    /// row-major for the PyTorch shape [`TensorInfo::shape`]).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let t = self.tensor(name).ok_or_else(|| GgufError::NoSuchTensor {
            name: name.to_string(),
        })?;
        dequant::dequantize(t.ggml_type, self.tensor_bytes(t), t.n_elements as usize).map_err(|e| {
            match e {
                DequantError::Unsupported(ty) => GgufError::UnsupportedDequant {
                    name: name.to_string(),
                    ty,
                },
                // The reader sized the slice from the same block table, so
                // this cannot happen for a parsed file; report it anyway.
                other => GgufError::Corrupt {
                    what: format!("tensor {name:?}: {other}"),
                },
            }
        })
    }
}

fn wrong_type(key: &str, expected: &str, found: &MetaValue) -> GgufError {
    GgufError::WrongValueType {
        key: key.to_string(),
        expected: expected.to_string(),
        found: found.describe(),
    }
}

/// A bounds-checked little-endian reader over the file image.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: u64,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() as u64).saturating_sub(self.pos)
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what.to_string(),
                offset: self.pos,
                need: n,
                len: self.buf.len() as u64,
            });
        }
        let start = self.pos as usize;
        self.pos += n;
        Ok(&self.buf[start..start + n as usize])
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Rejects `count` items of at least `min_bytes` each when the rest of
    /// the file cannot hold them; called before allocating for the items.
    fn check_count(&self, what: &str, count: u64, min_bytes: u64) -> Result<(), GgufError> {
        let remaining = self.remaining();
        if count.saturating_mul(min_bytes) > remaining {
            return Err(GgufError::ImpossibleCount {
                what: what.to_string(),
                count,
                min_bytes,
                remaining,
            });
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(&format!("the length of {what}"))?;
        if len > self.remaining() {
            return Err(GgufError::ImpossibleCount {
                what: format!("the length of {what}"),
                count: len,
                min_bytes: 1,
                remaining: self.remaining(),
            });
        }
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 {
            what: what.to_string(),
        })
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: usize) -> Result<MetaValue, GgufError> {
        let what = || format!("the value of {key:?}");
        Ok(match ty {
            ValueType::U8 => MetaValue::U8(self.array::<1>(&what())?[0]),
            ValueType::I8 => MetaValue::I8(i8::from_le_bytes(self.array(&what())?)),
            ValueType::U16 => MetaValue::U16(u16::from_le_bytes(self.array(&what())?)),
            ValueType::I16 => MetaValue::I16(i16::from_le_bytes(self.array(&what())?)),
            ValueType::U32 => MetaValue::U32(u32::from_le_bytes(self.array(&what())?)),
            ValueType::I32 => MetaValue::I32(i32::from_le_bytes(self.array(&what())?)),
            ValueType::F32 => MetaValue::F32(f32::from_le_bytes(self.array(&what())?)),
            ValueType::U64 => MetaValue::U64(u64::from_le_bytes(self.array(&what())?)),
            ValueType::I64 => MetaValue::I64(i64::from_le_bytes(self.array(&what())?)),
            ValueType::F64 => MetaValue::F64(f64::from_le_bytes(self.array(&what())?)),
            ValueType::Bool => {
                let b = self.array::<1>(&what())?[0];
                MetaValue::Bool(b != 0)
            }
            ValueType::String => MetaValue::String(self.string(&what())?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_NESTING {
                    return Err(GgufError::NestingTooDeep {
                        key: key.to_string(),
                        limit: MAX_ARRAY_NESTING,
                    });
                }
                let type_id = self.u32(&format!("the element type of {key:?}"))?;
                let elem =
                    ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
                        key: key.to_string(),
                        type_id,
                    })?;
                let count = self.u64(&format!("the length of array {key:?}"))?;
                self.check_count(
                    &format!("the length of array {key:?}"),
                    count,
                    elem.min_encoded_bytes(),
                )?;
                // The count was bounded by the bytes left, but an item in
                // memory is larger than its encoding: reserve a bounded
                // amount and let real items grow the vector.
                let mut items = Vec::with_capacity(count.min(PREALLOC_LIMIT) as usize);
                for _ in 0..count {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                MetaValue::Array { elem, items }
            }
        })
    }
}
