//! Reading GGUF files, the single-file model format of llama.cpp.
//!
//! kiln's compiler consumes Hugging Face style model directories
//! (`config.json` + safetensors + `tokenizer.json`); this module is the
//! bridge that lets `kiln import` turn a GGUF into one. It parses the file
//! defensively ([`reader`]), dequantizes the common tensor types including
//! the K-quants of Q4_K_M-style files ([`dequant`]), and undoes llama.cpp's q/k row
//! permutation ([`permute`]). [`writer`] writes small GGUF files and
//! [`fixture`] builds tiny random GGUFs of each supported architecture,
//! both for tests.
//!
//! Deliberately not here: the GGUF→Hugging Face name mapping and config
//! translation (that is `crate::import`), the tokenizer (`crate::tokenizer_build`),
//! big-endian GGUF files, and I-quant dequantization.

pub mod dequant;
pub mod error;
#[cfg(any(test, feature = "testing"))]
pub mod fixture;
pub mod permute;
pub mod reader;
pub mod types;
pub mod value;
pub mod writer;

pub use error::GgufError;
pub use reader::{GgufFile, TensorInfo};
pub use types::GgmlType;
pub use value::{MetaValue, ValueType};
pub use writer::GgufWriter;
