//! Element types, static shapes and tensor types.
//!
//! kiln compiles one graph per shape key, so every shape is static: a shape is
//! a list of `u32` extents, row-major, innermost last. There are no symbolic
//! dimensions on purpose: the planner must know every byte before capture.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of a tensor. Quantized types get their own variants later
/// (with a block size), which is why `size_bytes` takes the element count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DType {
    BF16,
    F16,
    F32,
    I32,
}

impl DType {
    pub const ALL: [DType; 4] = [DType::BF16, DType::F16, DType::F32, DType::I32];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
        }
    }

    /// True for floating-point types (the types activations and weights use).
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I32)
    }

    /// The spelling used by the text form (`bf16`, `f16`, `f32`, `i32`).
    pub fn name(self) -> &'static str {
        match self {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::I32 => "i32",
        }
    }

    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A static, row-major shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Shape(pub Vec<u32>);

impl Shape {
    pub fn new(dims: impl Into<Vec<u32>>) -> Shape {
        Shape(dims.into())
    }
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    pub fn dims(&self) -> &[u32] {
        &self.0
    }
    /// Number of elements (1 for a rank-0 shape).
    pub fn numel(&self) -> u64 {
        self.0.iter().map(|&d| d as u64).product()
    }
}

impl From<Vec<u32>> for Shape {
    fn from(v: Vec<u32>) -> Shape {
        Shape(v)
    }
}
impl<const N: usize> From<[u32; N]> for Shape {
    fn from(v: [u32; N]) -> Shape {
        Shape(v.to_vec())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// A tensor type: element type and static shape. Printed `bf16[2,576]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Shape,
}

impl TensorType {
    pub fn new(dtype: DType, shape: impl Into<Shape>) -> TensorType {
        TensorType {
            dtype,
            shape: shape.into(),
        }
    }
    pub fn numel(&self) -> u64 {
        self.shape.numel()
    }
    /// Bytes of a dense tensor of this type.
    pub fn size_bytes(&self) -> u64 {
        self.numel() * self.dtype.size() as u64
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}
