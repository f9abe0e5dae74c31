//! The one error type of the GGUF module. Every message names what was wrong
//! and where, so that a user holding a damaged or unsupported file knows
//! whether to re-download it, re-convert it, or pick another quantization.

use super::types::GgmlType;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read GGUF file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "not a GGUF file: the first four bytes are {found:02x?}, expected the magic \"GGUF\" \
         (47 47 55 46); is this a safetensors or PyTorch checkpoint instead?"
    )]
    BadMagic { found: Vec<u8> },

    #[error(
        "GGUF version {version} is not supported: kiln reads GGUF versions 2 and 3 \
         (re-convert the model with a current llama.cpp convert_hf_to_gguf.py)"
    )]
    UnsupportedVersion { version: u32 },

    #[error(
        "GGUF file is truncated: reading {what} at byte {offset} needs {need} bytes, \
         but the file ends at byte {len} (incomplete download?)"
    )]
    Truncated {
        what: String,
        offset: u64,
        need: u64,
        len: u64,
    },

    #[error(
        "corrupt GGUF header: {what} is {count}, but even at {min_bytes} bytes each they cannot \
         fit in the {remaining} bytes left in the file"
    )]
    ImpossibleCount {
        what: String,
        count: u64,
        min_bytes: u64,
        remaining: u64,
    },

    #[error("corrupt GGUF metadata: {what} is not valid UTF-8")]
    InvalidUtf8 { what: String },

    #[error("corrupt GGUF metadata: key {key:?} has unknown value type id {type_id}")]
    UnknownValueType { key: String, type_id: u32 },

    #[error(
        "corrupt GGUF metadata: key {key:?} nests arrays more than {limit} deep; \
         no GGUF writer produces that"
    )]
    NestingTooDeep { key: String, limit: usize },

    #[error("GGUF metadata key {key:?} appears twice")]
    DuplicateKey { key: String },

    #[error("GGUF tensor {name:?} appears twice in the tensor table")]
    DuplicateTensor { name: String },

    #[error(
        "invalid general.alignment {value}: it must be a non-zero power of two \
         (llama.cpp's default is 32)"
    )]
    BadAlignment { value: String },

    #[error("GGUF tensor {name:?} has {n_dims} dimensions; GGML tensors have at most 4")]
    TooManyDims { name: String, n_dims: u32 },

    #[error("GGUF tensor {name:?} has dimensions {dims:?}, whose element count overflows")]
    SizeOverflow { name: String, dims: Vec<u64> },

    #[error(
        "GGUF tensor {name:?} has unknown GGML type id {type_id}; \
         this file was written by a newer llama.cpp than kiln knows"
    )]
    UnknownTensorType { name: String, type_id: u32 },

    #[error(
        "GGUF tensor {name:?} of type {ty} has a row of {ne0} elements, \
         not a multiple of the type's block size {block}"
    )]
    NotBlockAligned {
        name: String,
        ty: GgmlType,
        ne0: u64,
        block: u64,
    },

    #[error(
        "GGUF tensor {name:?} starts at data offset {offset}, \
         which is not a multiple of the file's alignment {alignment}"
    )]
    MisalignedTensor {
        name: String,
        offset: u64,
        alignment: u64,
    },

    #[error(
        "GGUF tensor {name:?} occupies bytes {start}..{end} of the data section, \
         but the file has only {available} bytes of tensor data (truncated download?)"
    )]
    TensorOutOfBounds {
        name: String,
        start: u64,
        end: u64,
        available: u64,
    },

    #[error("GGUF file has no tensor named {name:?}")]
    NoSuchTensor { name: String },

    #[error("GGUF file lacks the metadata key {key:?}, which {why}")]
    MissingKey { key: String, why: String },

    #[error("GGUF metadata key {key:?} should be {expected}, but the file holds {found}")]
    WrongValueType {
        key: String,
        expected: String,
        found: String,
    },

    #[error(
        "tensor {name:?} is stored as {ty}, which kiln cannot dequantize \
         (supported: {list}; not supported: I-quants (IQ*), TQ1_0/TQ2_0, MXFP4/NVFP4, \
         Q1_0, Q8_1/Q8_K and integer types); pick a GGUF with one of the supported \
         quantizations",
        list = super::dequant::SUPPORTED_LIST
    )]
    UnsupportedDequant { name: String, ty: GgmlType },

    #[error("corrupt GGUF file: {what}")]
    Corrupt { what: String },

    #[error("cannot write GGUF file: {reason}")]
    Write { reason: String },
}
