//! The weight manifest: every tensor a plan reads, where it comes from in the
//! user's safetensors files, and the load-time transform that produces it.
//!
//! The compiler never rewrites the user's files: fusions that need a new
//! tensor (q/k/v concatenated, gate/up concatenated) record a transform here
//! and the runtime's weight binder applies it at load.

use crate::types::{DType, QuantType, Shape, TensorType};
use serde::{Deserialize, Serialize};

/// A tensor inside one of the model's safetensors files.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorRef {
    /// File name relative to the model directory, e.g. `model.safetensors`.
    pub file: String,
    /// Tensor key in that file, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub tensor: String,
    /// Dtype as stored in the file.
    pub dtype: DType,
    /// Shape as stored in the file.
    pub shape: Shape,
}

/// How a manifest entry is produced at load time. A dtype conversion from the
/// source dtype to the entry's dtype is implied when they differ.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WeightSource {
    /// One tensor as is.
    Tensor(TensorRef),
    /// Tensors concatenated along axis 0 (rows), in order.
    ConcatRows(Vec<TensorRef>),
}

impl WeightSource {
    pub fn parts(&self) -> &[TensorRef] {
        match self {
            WeightSource::Tensor(t) => std::slice::from_ref(t),
            WeightSource::ConcatRows(v) => v,
        }
    }
}

/// One weight the plan binds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightEntry {
    /// Name the graph uses (`ValueDef::Weight`). For an unfused weight it is the
    /// safetensors key; a fused one gets a derived name such as
    /// `model.layers.0.self_attn.qkv_proj.weight`.
    pub name: String,
    /// Dtype the plan computes with.
    pub dtype: DType,
    pub shape: Shape,
    pub source: WeightSource,
    /// `Some` when the plan keeps the weight quantized (see
    /// [`QuantType`] for the byte layout). `dtype`/`shape` stay the logical
    /// ones. The source is then either a tensor already in that storage
    /// (`kiln import --keep-quant`: a `U8` safetensors tensor of
    /// `[N, row_bytes]`) or a dense float tensor the weight binder
    /// quantizes at load (`kiln compile --quantize fp8`).
    #[serde(default)]
    pub storage: Option<QuantType>,
}

impl WeightEntry {
    /// The entry's type as the graph sees it (logical dtype and shape, and
    /// the storage).
    pub fn ty(&self) -> TensorType {
        let mut t = TensorType::new(self.dtype, self.shape.clone());
        t.storage = self.storage;
        t
    }
    /// Bytes the entry occupies once bound (stored bytes for a quantized
    /// weight).
    pub fn stored_bytes(&self) -> u64 {
        self.ty().stored_bytes()
    }
}

/// All weights of a model, in a deterministic order.
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct WeightManifest {
    pub entries: Vec<WeightEntry>,
}

impl WeightManifest {
    pub fn get(&self, name: &str) -> Option<&WeightEntry> {
        self.entries.iter().find(|e| e.name == name)
    }
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.entries.iter().position(|e| e.name == name)
    }
    pub fn total_bytes(&self) -> u64 {
        self.entries.iter().map(WeightEntry::stored_bytes).sum()
    }
}
