//! The weight manifest: every tensor a plan reads, where it comes from in the
//! user's safetensors files, and the load-time transform that produces it.
//!
//! The compiler never rewrites the user's files: fusions that need a new
//! tensor (q/k/v concatenated, gate/up concatenated) record a transform here
//! and the runtime's weight binder applies it at load.

use crate::types::{DType, Shape};
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
        self.entries
            .iter()
            .map(|e| e.shape.numel() * e.dtype.size() as u64)
            .sum()
    }
}
