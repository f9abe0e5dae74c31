//! Element types, static shapes and tensor types.
//!
//! kiln compiles one graph per shape key, so every shape is static: a shape is
//! a list of `u32` extents, row-major, innermost last. There are no symbolic
//! dimensions on purpose: the planner must know every byte before capture.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of a tensor. Quantized weights keep a dense logical dtype
/// and record their storage in [`TensorType::storage`] ([`QuantType`]).
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

/// How a weight is stored when it is not dense: a GGUF block format kept as
/// the file holds it, or FP8 e4m3 with one f32 scale per output row.
///
/// Storage layout of a `[N, K]` weight (on the CPU, in the model directory,
/// and what `kiln_kernels::quant` reads):
/// * block types: `N` rows, each row the `K / block_elems()` blocks of that
///   row in order, exactly ggml's little-endian byte layout
///   (`row_bytes(K)` bytes per row);
/// * `Fp8E4M3`: `N` rows of `K` e4m3 bytes, then `N` little-endian f32
///   scales (one per output row, `w[n,k] = e4m3(q[n,k]) * scale[n]`) in the
///   same buffer, so one tensor holds everything ([`QuantType::tensor_bytes`]).
///
/// The logical type of such a weight stays `D[N, K]` (the activations'
/// dtype); [`TensorType::storage`] records the storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[allow(non_camel_case_types)]
pub enum QuantType {
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q4K,
    Q5K,
    Q6K,
    Fp8E4M3,
}

impl QuantType {
    pub const ALL: [QuantType; 8] = [
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q4K,
        QuantType::Q5K,
        QuantType::Q6K,
        QuantType::Fp8E4M3,
    ];

    /// Elements per block (32 for the `*_0`/`*_1` types, 256 for the
    /// K-quants, 1 for FP8).
    pub fn block_elems(self) -> usize {
        match self {
            QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 => 32,
            QuantType::Q4K | QuantType::Q5K | QuantType::Q6K => 256,
            QuantType::Fp8E4M3 => 1,
        }
    }

    /// Bytes per block (GGUF's sizes; 1 for FP8, whose scales are extra).
    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::Q8_0 => 34,
            QuantType::Q4_0 => 18,
            QuantType::Q4_1 => 20,
            QuantType::Q5_0 => 22,
            QuantType::Q4K => 144,
            QuantType::Q5K => 176,
            QuantType::Q6K => 210,
            QuantType::Fp8E4M3 => 1,
        }
    }

    /// Bytes of one row of `k` elements, `None` when `k` is not a multiple
    /// of [`QuantType::block_elems`].
    pub fn row_bytes(self, k: usize) -> Option<usize> {
        k.is_multiple_of(self.block_elems())
            .then(|| k / self.block_elems() * self.block_bytes())
    }

    /// Bytes of a whole `[rows, k]` tensor: the rows, plus the per-row f32
    /// scales for FP8. `None` when `k` is not a whole number of blocks.
    pub fn tensor_bytes(self, rows: usize, k: usize) -> Option<usize> {
        let rb = self.row_bytes(k)?;
        let scales = if self == QuantType::Fp8E4M3 { 4 } else { 0 };
        rows.checked_mul(rb + scales)
    }

    /// The spelling of the text form and of model-directory metadata
    /// (`q8_0`, `q4_k`, `fp8_e4m3`, ...).
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q8_0 => "q8_0",
            QuantType::Q4_0 => "q4_0",
            QuantType::Q4_1 => "q4_1",
            QuantType::Q5_0 => "q5_0",
            QuantType::Q4K => "q4_k",
            QuantType::Q5K => "q5_k",
            QuantType::Q6K => "q6_k",
            QuantType::Fp8E4M3 => "fp8_e4m3",
        }
    }

    pub fn from_name(s: &str) -> Option<QuantType> {
        QuantType::ALL.into_iter().find(|q| q.name() == s)
    }

    /// The K multiple kiln's kernels need: the block, and 16 for FP8 (its
    /// GPU kernels read 16-byte vectors of codes).
    pub fn k_multiple(self) -> u64 {
        (self.block_elems() as u64).max(16)
    }

    /// Where the regions of an `[n, k]` weight lie in the layout kiln's GPU
    /// kernels read (`kernels/gpu/qgemv.cu`; `kiln_kernels::quant_gpu`
    /// repacks GGUF blocks into it at load). `None` when `n` is 0 or `k` is
    /// not a positive multiple of [`QuantType::k_multiple`]. FP8's region 0
    /// is its `[n][k]` codes; its per-row scales follow them in the weight
    /// buffer, as in the stored layout ([`QuantType::gpu_bytes`]).
    pub fn gpu_layout(self, n: u64, k: u64) -> Option<QuantLayout> {
        if n == 0 || k == 0 || !k.is_multiple_of(self.k_multiple()) {
            return None;
        }
        let (g, sb) = (k / 32, k / 256);
        let nk = n.checked_mul(k)?;
        let sizes = match self {
            QuantType::Q8_0 => [nk, n * g * 2, 0, 0],
            QuantType::Q4_0 => [nk / 2, n * g * 2, 0, 0],
            QuantType::Q4_1 => [nk / 2, n * g * 4, 0, 0],
            QuantType::Q5_0 => [nk / 2, n * g * 2, n * g * 4, 0],
            QuantType::Q4K => [nk / 2, n * sb * 4, n * (k / 64) * 4, 0],
            QuantType::Q5K => [nk / 2, n * sb * 4, n * (k / 64) * 4, n * g * 4],
            QuantType::Q6K => [nk / 2, n * sb * 2, n * g * 2, n * g * 8],
            QuantType::Fp8E4M3 => [nk, 0, 0, 0],
        };
        let align16 = |v: u64| v.div_ceil(16) * 16;
        let mut offsets = [0u64; 3];
        let mut end = sizes[0];
        for r in 1..4 {
            if sizes[r] > 0 {
                let at = align16(end);
                offsets[r - 1] = at;
                end = at + sizes[r];
            }
        }
        Some(QuantLayout {
            offsets,
            sizes,
            total: align16(end),
        })
    }

    /// Device bytes of an `[n, k]` weight on a GPU target: the repacked
    /// layout's, plus FP8's `n` f32 row scales after its codes.
    pub fn gpu_bytes(self, n: u64, k: u64) -> Option<u64> {
        let l = self.gpu_layout(n, k)?;
        Some(match self {
            QuantType::Fp8E4M3 => l.total + n * 4,
            _ => l.total,
        })
    }
}

/// The regions of a quantized weight in the GPU kernels' layout
/// ([`QuantType::gpu_layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantLayout {
    /// Byte offsets of regions 1..=3 (0 for an absent region): the `off1`,
    /// `off2`, `off3` kernel parameters.
    pub offsets: [u64; 3],
    /// Bytes of regions 0..=3.
    pub sizes: [u64; 4],
    /// Total bytes (a 16-byte multiple).
    pub total: u64,
}

impl fmt::Display for QuantType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A tensor type: element type and static shape. Printed `bf16[2,576]`,
/// or `bf16[576,576] stored q4_k` for a weight kept quantized.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Shape,
    /// `Some` for a weight kept in a quantized storage type: `dtype` and
    /// `shape` are then the logical ones (what a dense copy would be) and
    /// only ops that read that storage may take it (the verifier checks).
    #[serde(default)]
    pub storage: Option<QuantType>,
}

impl TensorType {
    pub fn new(dtype: DType, shape: impl Into<Shape>) -> TensorType {
        TensorType {
            dtype,
            shape: shape.into(),
            storage: None,
        }
    }
    /// This type stored as `q`.
    pub fn stored(mut self, q: QuantType) -> TensorType {
        self.storage = Some(q);
        self
    }
    pub fn numel(&self) -> u64 {
        self.shape.numel()
    }
    /// Bytes of the tensor as stored: dense bytes, or the quantized bytes
    /// ([`QuantType::tensor_bytes`] of rows × the innermost extent). A
    /// quantized shape whose row length is not a whole number of blocks
    /// (the verifier refuses it) counts as dense.
    ///
    /// For a weight stored quantized this is the buffer kiln allocates for
    /// it: enough for the stored (GGUF) layout the CPU reads and for the GPU
    /// kernels' repacked layout, whichever is larger (they differ by a few
    /// bytes per 256 weights). [`TensorType::stored_bytes`] is the stored
    /// layout's own size.
    pub fn size_bytes(&self) -> u64 {
        if let Some(q) = self.storage {
            if let Some(b) = self.quant_bytes(q) {
                let gpu = match self.shape.0.as_slice() {
                    [n, k] => q.gpu_bytes(u64::from(*n), u64::from(*k)).unwrap_or(0),
                    _ => 0,
                };
                return b.max(gpu);
            }
        }
        self.numel() * self.dtype.size() as u64
    }
    /// Bytes of the stored layout (GGUF blocks; FP8 codes plus row scales)
    /// for a quantized weight, [`TensorType::size_bytes`] otherwise: what a
    /// model file holds and a decode step reads.
    pub fn stored_bytes(&self) -> u64 {
        match self.storage.and_then(|q| self.quant_bytes(q)) {
            Some(b) => b,
            None => self.size_bytes(),
        }
    }
    fn quant_bytes(&self, q: QuantType) -> Option<u64> {
        let (&k, outer) = self.shape.0.split_last()?;
        let rows = outer.iter().map(|&d| d as u64).product::<u64>();
        let rows = usize::try_from(rows).ok()?;
        q.tensor_bytes(rows, k as usize).map(|b| b as u64)
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)?;
        if let Some(q) = self.storage {
            write!(f, " stored {q}")?;
        }
        Ok(())
    }
}
