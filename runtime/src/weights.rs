//! Weight files: validation against the plan, then binding to device memory.
//!
//! [`WeightSet::open`] memory-maps every safetensors file the plan lists and
//! checks, before anything is allocated on the device, that each file has the
//! recorded size and header SHA-256 and that every manifest part is present
//! with the recorded dtype and shape. [`WeightSet::bind`] then allocates one
//! buffer per manifest entry (`Region::Weight(i)`), applies the entry's
//! load-time transform (rows concatenated, dtype converted among f32, f16 and
//! bf16) and uploads it. An entry that needs no transform is uploaded straight
//! from the mapping, with no host copy. [`bind_random`] binds reproducible
//! random values instead, for benchmarks of plans compiled from shape-only
//! model directories (their timing does not depend on the values).
//!
//! Not here: quantized formats (GGUF is turned into safetensors by
//! `kiln import`), sharded index files (the plan lists the shard files
//! themselves), and keeping host copies after the upload.

use crate::backend::{Backend, DevPtr};
use crate::error::EngineError;
use kiln_ir::plan::Plan;
use kiln_ir::{DType, ShardAxis, TensorRef, WeightEntry, WeightSource};
use memmap2::Mmap;
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensors};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Hex SHA-256 of a safetensors file's header: the 8-byte length prefix and
/// the JSON header it announces. `None` when the file is too short to hold
/// the header it claims.
pub fn header_sha256(bytes: &[u8]) -> Option<String> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let end = usize::try_from(n).ok()?.checked_add(8)?;
    let digest = Sha256::digest(bytes.get(..end)?);
    Some(digest.iter().map(|b| format!("{b:02x}")).collect())
}

/// The kiln dtype of a safetensors dtype, for the ones plans use.
pub fn dtype_of(d: Dtype) -> Option<DType> {
    match d {
        Dtype::BF16 => Some(DType::BF16),
        Dtype::F16 => Some(DType::F16),
        Dtype::F32 => Some(DType::F32),
        Dtype::I32 => Some(DType::I32),
        _ => None,
    }
}

/// Resolves a weight file name recorded in a plan inside the weights
/// directory, refusing, before anything is opened, a name that is absolute,
/// has `..` (or any non-plain) component, or resolves (through symlinks)
/// outside `root` (the canonical weights directory), and anything that is
/// not a regular file (a FIFO would block `open` forever). A plan is an
/// artifact people pass around: loading one never reaches outside the
/// directory it is pointed at, and no error says anything about a file
/// outside it.
pub fn confined_weight_path(root: &Path, dir: &Path, name: &str) -> Result<PathBuf, EngineError> {
    use std::path::Component;
    let rel = Path::new(name);
    let plain = !name.is_empty() && rel.components().all(|c| matches!(c, Component::Normal(_)));
    if !plain {
        return Err(EngineError::mismatch(format!(
            "the plan names weight file `{name}`, which is not a plain relative path inside the weights directory (absolute paths and `..` are refused); recompile the plan from the model directory with `kiln compile`"
        )));
    }
    let joined = dir.join(rel);
    match std::fs::symlink_metadata(&joined) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(EngineError::mismatch(format!(
                "{name} is missing from {} (the plan was compiled from it)",
                dir.display()
            )))
        }
        Err(e) => return Err(EngineError::io(&joined, e)),
    }
    // Every component is resolved (an intermediate directory may be a link too).
    let resolved = match joined.canonicalize() {
        Ok(p) if p.starts_with(root) => p,
        _ => {
            return Err(EngineError::mismatch(format!(
                "{name} in {} resolves (through a symbolic link) to a file outside the weights directory; weight files must live inside it",
                dir.display()
            )))
        }
    };
    let kind = std::fs::metadata(&resolved).map_err(|e| EngineError::io(&resolved, e))?;
    if !kind.is_file() {
        return Err(EngineError::mismatch(format!(
            "{name} in {} is {}, not a regular file; the plan expects a safetensors file there",
            dir.display(),
            describe_file_type(&kind.file_type())
        )));
    }
    Ok(resolved)
}

/// What a non-regular file is, for messages ("a directory", "a FIFO", ...).
pub fn describe_file_type(t: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_block_device() || t.is_char_device() {
            return "a device";
        }
    }
    if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_file() {
        "a regular file"
    } else {
        "not a regular file"
    }
}

struct WeightFile {
    path: PathBuf,
    map: Mmap,
    /// Start of the data section (8 + header length).
    data_start: usize,
    meta: Metadata,
}

impl WeightFile {
    fn bytes(&self, tensor: &str) -> &[u8] {
        let info = self
            .meta
            .info(tensor)
            .expect("tensor presence was validated at open");
        let (a, b) = info.data_offsets;
        &self.map[self.data_start + a..self.data_start + b]
    }
}

/// The plan's weight files, mapped and validated.
pub struct WeightSet {
    files: HashMap<String, WeightFile>,
}

impl WeightSet {
    /// Maps and validates every file of `plan.meta.files` in `dir` and every
    /// part of `plan.manifest`. Allocates nothing on any device.
    pub fn open(plan: &Plan, dir: &Path) -> Result<WeightSet, EngineError> {
        if !dir.is_dir() {
            return Err(EngineError::mismatch(format!(
                "weights directory {} does not exist or is not a directory",
                dir.display()
            )));
        }
        let mut files = HashMap::new();
        let root = dir.canonicalize().map_err(|e| EngineError::io(dir, e))?;
        for sf in &plan.meta.files {
            let path = confined_weight_path(&root, dir, &sf.name)?;
            let file = File::open(&path).map_err(|e| EngineError::io(&path, e))?;
            let size = file
                .metadata()
                .map_err(|e| EngineError::io(&path, e))?
                .len();
            if size != sf.size {
                return Err(EngineError::mismatch(format!(
                    "{} is {size} bytes but the plan was compiled from a {}-byte file",
                    path.display(),
                    sf.size
                )));
            }
            // SAFETY: the mapping is read-only; a file truncated or rewritten
            // underneath a running engine is outside what we can defend
            // against, as for every mmap-based loader.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(&path, e))?;
            let bad = |message: String| EngineError::BadWeightFile {
                file: path.clone(),
                message,
            };
            let hash = header_sha256(&map)
                .ok_or_else(|| bad("too short to hold its safetensors header".into()))?;
            if hash != sf.header_sha256 {
                return Err(EngineError::mismatch(format!(
                    "{} has header SHA-256 {hash} but the plan was compiled from a file whose header hashes to {}",
                    path.display(),
                    sf.header_sha256
                )));
            }
            let (n, meta) = SafeTensors::read_metadata(&map)
                .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
            files.insert(
                sf.name.clone(),
                WeightFile {
                    path,
                    map,
                    data_start: 8 + n,
                    meta,
                },
            );
        }
        let set = WeightSet { files };
        for entry in &plan.manifest.entries {
            set.check_entry(entry)?;
        }
        Ok(set)
    }

    fn check_part(&self, entry: &WeightEntry, part: &TensorRef) -> Result<(), EngineError> {
        let file = self.files.get(&part.file).ok_or_else(|| {
            EngineError::BadPlan(format!(
                "weight `{}` reads file {} which is not among the plan's source files",
                entry.name, part.file
            ))
        })?;
        let info = file.meta.info(&part.tensor).ok_or_else(|| {
            EngineError::mismatch(format!(
                "tensor `{}` (for weight `{}`) is missing from {}",
                part.tensor,
                entry.name,
                file.path.display()
            ))
        })?;
        let found_shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
        if let Some(q) = entry.storage {
            if info.dtype == Dtype::U8 {
                // A tensor kept quantized: U8 [N, row_bytes(K)] holding the
                // logical [N, K] part (see `kiln_ir::QuantType`).
                let d = part.shape.dims();
                let rb = (d.len() == 2).then(|| q.row_bytes(d[1] as usize)).flatten();
                let want = rb.map(|rb| vec![d[0] as u64, rb as u64]);
                let bytes = file.bytes(&part.tensor).len();
                let expected =
                    q.tensor_bytes(d[0] as usize, d.get(1).copied().unwrap_or(0) as usize);
                if want.as_ref() != Some(&found_shape) || expected != Some(bytes) {
                    return Err(EngineError::mismatch(format!(
                        "quantized tensor `{}` in {} is U8{:?} ({bytes} bytes) but a {q} {} needs U8{:?} ({} bytes); the file is damaged: import the model again",
                        part.tensor,
                        file.path.display(),
                        info.shape,
                        part.shape,
                        want.unwrap_or_default(),
                        expected.unwrap_or(0),
                    )));
                }
                return Ok(());
            }
            if q != kiln_ir::QuantType::Fp8E4M3 {
                return Err(EngineError::BadPlan(format!(
                    "weight `{}` is stored {q} but tensor `{}` is dense; only fp8_e4m3 is quantized at load",
                    entry.name, part.tensor
                )));
            }
        }
        let want_shape: Vec<u64> = part.shape.dims().iter().map(|&d| d as u64).collect();
        let found_dtype = dtype_of(info.dtype);
        if found_dtype != Some(part.dtype) || found_shape != want_shape {
            return Err(EngineError::mismatch(format!(
                "tensor `{}` in {} is {:?}{:?} but the plan expects {}{}",
                part.tensor,
                file.path.display(),
                info.dtype,
                info.shape,
                part.dtype,
                part.shape
            )));
        }
        if part.dtype != entry.dtype && !(part.dtype.is_float() && entry.dtype.is_float()) {
            return Err(EngineError::BadPlan(format!(
                "weight `{}` converts {} to {}; only float types convert",
                entry.name, part.dtype, entry.dtype
            )));
        }
        Ok(())
    }

    fn check_entry(&self, entry: &WeightEntry) -> Result<(), EngineError> {
        for part in entry.source.parts() {
            self.check_part(entry, part)?;
        }
        let bad = |why: String| {
            Err(EngineError::BadPlan(format!(
                "weight `{}` ({}{}): {why}",
                entry.name, entry.dtype, entry.shape
            )))
        };
        match &entry.source {
            WeightSource::Tensor(t) => {
                if t.shape.numel() != entry.shape.numel() {
                    return bad(format!(
                        "source `{}` has {} elements",
                        t.tensor,
                        t.shape.numel()
                    ));
                }
            }
            WeightSource::ConcatRows(parts) => {
                let d = entry.shape.dims();
                if parts.is_empty() || d.is_empty() {
                    return bad("concatenation of no tensors or into a scalar".into());
                }
                let mut rows = 0u64;
                for p in parts {
                    let pd = p.shape.dims();
                    if pd.is_empty() || pd[1..] != d[1..] {
                        return bad(format!(
                            "part `{}` {} does not share the trailing dimensions",
                            p.tensor, p.shape
                        ));
                    }
                    rows += pd[0] as u64;
                }
                if rows != d[0] as u64 {
                    return bad(format!("parts have {rows} rows in all"));
                }
            }
            WeightSource::Sharded { parts, axis, ranks } => {
                let d = entry.shape.dims();
                let mut rows = 0u64;
                for p in parts {
                    let sd = match WeightSource::shard_shape(&p.shape, *axis, *ranks) {
                        Ok(s) => s,
                        Err(e) => return bad(format!("part `{}`: {e}", p.tensor)),
                    };
                    let sd = sd.dims();
                    if d.is_empty() || sd[1..] != d[1..] {
                        return bad(format!(
                            "a rank's share {:?} of `{}` does not share the trailing dimensions",
                            sd, p.tensor
                        ));
                    }
                    rows += sd[0] as u64;
                }
                if parts.is_empty() || rows != d[0] as u64 {
                    return bad(format!("a rank's shares have {rows} rows in all"));
                }
            }
        }
        Ok(())
    }

    /// Allocates `Region::Weight(i)` for every manifest entry and uploads it.
    /// Returns each entry's base address and size, in manifest order.
    pub fn bind(
        &self,
        plan: &Plan,
        backend: &mut dyn Backend,
    ) -> Result<Vec<(DevPtr, u64)>, EngineError> {
        let mut out = Vec::with_capacity(plan.manifest.entries.len());
        let mut scratch: Vec<u8> = Vec::new();
        for entry in &plan.manifest.entries {
            // The allocation fits the stored and the GPU layout alike.
            let bytes = entry.ty().size_bytes();
            let ptr = backend.alloc(bytes, &format!("weight {}", entry.name))?;
            out.push((ptr, bytes));
            if let Some(q) = entry.storage {
                let data = self.quantized(entry, q)?;
                let data = repack_for_device(plan, q, data, entry)?;
                backend.upload(ptr, &data)?;
                continue;
            }
            if let WeightSource::Sharded { parts, axis, ranks } = &entry.source {
                // Each rank binds its own slices: `ranks` is the plan's tp,
                // which the engine checked against the backend's ranks.
                for rank in 0..*ranks {
                    scratch.clear();
                    let mut at = 0usize;
                    for part in parts {
                        let src = self.files[&part.file].bytes(&part.tensor);
                        let slice = shard_slice(src, part, *axis, *ranks, rank);
                        let n = slice.len() / part.dtype.size() * entry.dtype.size();
                        scratch.resize(at + n, 0);
                        convert(&slice, part.dtype, &mut scratch[at..at + n], entry.dtype);
                        at += n;
                    }
                    backend.upload_rank(rank, ptr, &scratch)?;
                }
                continue;
            }
            let parts = entry.source.parts();
            if let [part] = parts {
                if part.dtype == entry.dtype {
                    backend.upload(ptr, self.files[&part.file].bytes(&part.tensor))?;
                    continue;
                }
            }
            scratch.clear();
            scratch.resize(bytes as usize, 0);
            let mut at = 0usize;
            for part in parts {
                let src = self.files[&part.file].bytes(&part.tensor);
                let n = part.shape.numel() as usize * entry.dtype.size();
                convert(src, part.dtype, &mut scratch[at..at + n], entry.dtype);
                at += n;
            }
            backend.upload(ptr, &scratch)?;
        }
        Ok(out)
    }
}

impl WeightSet {
    /// The bytes of a weight kept quantized, in `q`'s CPU storage layout:
    /// the parts' blocks concatenated row-wise, or, for a dense source of
    /// an FP8 entry (`kiln compile --quantize fp8`), the parts converted to
    /// f32, concatenated and quantized per output row.
    fn quantized(
        &self,
        entry: &WeightEntry,
        q: kiln_ir::QuantType,
    ) -> Result<Vec<u8>, EngineError> {
        let d = entry.shape.dims();
        let (n, k) = (d[0] as usize, d.get(1).copied().unwrap_or(0) as usize);
        let parts = entry.source.parts();
        let file_dtype = |p: &TensorRef| self.files[&p.file].meta.info(&p.tensor).map(|i| i.dtype);
        let mut data = Vec::new();
        if parts.iter().all(|p| file_dtype(p) == Some(Dtype::U8)) {
            for p in parts {
                data.extend_from_slice(self.files[&p.file].bytes(&p.tensor));
            }
        } else {
            let mut f = Vec::with_capacity(n * k * 4);
            for p in parts {
                let src = self.files[&p.file].bytes(&p.tensor);
                let mut dst = vec![0u8; p.shape.numel() as usize * 4];
                convert(src, p.dtype, &mut dst, DType::F32);
                f.extend_from_slice(&dst);
            }
            let vals: Vec<f32> = f
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            data = kiln_kernels::quant::quantize_fp8_rows(&vals, n, k);
        }
        kiln_kernels::quant::check_tensor_len(q, data.len(), n, k)
            .map_err(|e| EngineError::mismatch(format!("weight `{}`: {e}", entry.name)))?;
        Ok(data)
    }
}

/// The device bytes of a quantized weight: for a CPU plan the CPU layout
/// (`kiln_kernels::quant_cpu`: Q8_0/Q4_0/Q4_1 with 8 rows interleaved, the
/// others as stored, the same size either way), and for a GPU plan the layout the `qgemv` kernels read
/// (`kiln_kernels::quant_gpu::repack`; FP8 codes and row scales stay as
/// stored). The plan's target decides, so the bytes always match the
/// launches the compiler lowered.
fn repack_for_device(
    plan: &Plan,
    q: kiln_ir::QuantType,
    data: Vec<u8>,
    entry: &WeightEntry,
) -> Result<Vec<u8>, EngineError> {
    let d = entry.shape.dims();
    let (n, k) = (u64::from(d[0]), u64::from(d.get(1).copied().unwrap_or(0)));
    let bad = |e: String| EngineError::WeightsMismatch {
        message: format!("weight `{}`: {e}; import the model again", entry.name),
    };
    if matches!(plan.meta.target, kiln_ir::plan::Target::Cpu) {
        if !kiln_kernels::quant_cpu::interleaves(q) {
            return Ok(data);
        }
        return kiln_kernels::quant_cpu::repack(q, &data, n as usize, k as usize)
            .map_err(|e| bad(e.to_string()));
    }
    if q == kiln_ir::QuantType::Fp8E4M3 {
        return Ok(data);
    }
    kiln_kernels::quant_gpu::repack(q, &data, n, k).map_err(|e| bad(e.to_string()))
}

/// Where an engine's weights come from.
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    /// The safetensors files the plan was compiled from, in this directory.
    Dir(&'a Path),
    /// Reproducible random values (norm weights near 1, others small), for
    /// timing plans of models whose weights are not at hand. Tokens from
    /// such an engine are meaningless.
    Random { seed: u64 },
}

/// xorshift64*: reproducible random weights without a dependency.
fn next_random(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// The random values of one entry in its plan dtype: uniform in
/// `[0.9, 1.1)` for rank-1 entries (norm weights), `[-0.05, 0.05)` otherwise.
pub fn random_entry(entry: &WeightEntry, seed: u64) -> Vec<u8> {
    if let Some(q) = entry.storage {
        let d = entry.shape.dims();
        let k = d.get(1).copied().unwrap_or(0) as usize;
        return kiln_kernels::quant::random_tensor(
            q,
            d.first().copied().unwrap_or(0) as usize,
            k,
            seed,
        );
    }
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let n = entry.shape.numel() as usize;
    let norm_like = entry.shape.rank() == 1;
    let f: Vec<u8> = (0..n)
        .flat_map(|_| {
            let u = ((next_random(&mut state) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            let v = if norm_like { 1.0 + 0.1 * u } else { 0.05 * u };
            v.to_le_bytes()
        })
        .collect();
    if entry.dtype == DType::I32 {
        return vec![0; n * 4];
    }
    let mut out = vec![0u8; n * entry.dtype.size()];
    convert(&f, DType::F32, &mut out, entry.dtype);
    out
}

/// Allocates `Region::Weight(i)` for every manifest entry and uploads random
/// values. Returns what
/// [`WeightSet::bind`] returns. Values belong to the source tensors, not the
/// entries: each source tensor's values are drawn ([`random_part`], seeded
/// by `seed` and its name) and the entry is built from them as from files
/// (concatenated, each rank's slice of a sharded one), so a tensor-parallel
/// plan holds the same weights as the unsharded plan of the same model.
/// Kept-quantized entries draw random blocks per entry.
pub fn bind_random(
    plan: &Plan,
    backend: &mut dyn Backend,
    seed: u64,
) -> Result<Vec<(DevPtr, u64)>, EngineError> {
    let mut out = Vec::with_capacity(plan.manifest.entries.len());
    for (i, entry) in plan.manifest.entries.iter().enumerate() {
        if let Some(q) = entry.storage {
            let bytes = random_entry(entry, seed.wrapping_add(i as u64));
            let bytes = repack_for_device(plan, q, bytes, entry)?;
            let size = entry.ty().size_bytes().max(bytes.len() as u64);
            let ptr = backend.alloc(size, &format!("weight {}", entry.name))?;
            backend.upload(ptr, &bytes)?;
            out.push((ptr, size));
            continue;
        }
        let size = entry.ty().size_bytes();
        let ptr = backend.alloc(size, &format!("weight {}", entry.name))?;
        let to_entry = |f32s: &[u8]| {
            let mut b = vec![0u8; f32s.len() / 4 * entry.dtype.size()];
            if entry.dtype == DType::I32 {
                return b;
            }
            convert(f32s, DType::F32, &mut b, entry.dtype);
            b
        };
        match &entry.source {
            WeightSource::Sharded { parts, axis, ranks } => {
                let full: Vec<(Vec<u8>, TensorRef)> = parts
                    .iter()
                    .map(|p| {
                        let as_f32 = TensorRef {
                            dtype: DType::F32,
                            ..p.clone()
                        };
                        (random_part(p, seed), as_f32)
                    })
                    .collect();
                for rank in 0..*ranks {
                    let mut f = Vec::new();
                    for (bytes, part) in &full {
                        f.extend(shard_slice(bytes, part, *axis, *ranks, rank));
                    }
                    backend.upload_rank(rank, ptr, &to_entry(&f))?;
                }
            }
            src => {
                // Drawn straight into the entry's dtype: the same values as
                // `to_entry` of the f32 stream, without the f32 copy (a
                // Llama-3-8B's 16 GB took over 150 s the other way).
                let mut b = Vec::with_capacity(size as usize);
                if entry.dtype == DType::I32 {
                    b.resize(size as usize, 0);
                } else {
                    for p in src.parts() {
                        random_values(p, seed, entry.dtype, &mut b);
                    }
                }
                backend.upload(ptr, &b)?;
            }
        }
        out.push((ptr, size));
    }
    Ok(out)
}

/// The random values of source tensor `part` as little-endian f32s:
/// uniform in `[0.9, 1.1)` for 1-D tensors (norm weights), `[-0.05, 0.05)`
/// otherwise, from a stream seeded by `seed` and the tensor's name (FNV-1a),
/// so every plan reading the tensor sees the same values.
pub fn random_part(part: &TensorRef, seed: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(part.shape.numel() as usize * 4);
    random_values(part, seed, DType::F32, &mut out);
    out
}

/// [`random_part`]'s values appended to `out` as little-endian `to`
/// (bf16 / f16 rounded to nearest even from the f32 value, exactly as
/// [`convert`] rounds them); `to` is a float dtype.
pub fn random_values(part: &TensorRef, seed: u64, to: DType, out: &mut Vec<u8>) {
    let name = part.tensor.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    let mut state = (seed ^ name).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let norm_like = part.shape.rank() == 1;
    let n = part.shape.numel() as usize;
    out.reserve(n * to.size());
    for _ in 0..n {
        let u = ((next_random(&mut state) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
        let v = if norm_like { 1.0 + 0.1 * u } else { 0.05 * u };
        match to {
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            _ => out.extend_from_slice(&v.to_le_bytes()),
        }
    }
}

/// Rank `rank`'s share of `part`'s bytes `src` under `Sharded { axis,
/// ranks }` (shapes were checked at open): a run of rows, or each row's
/// run of columns.
pub fn shard_slice(
    src: &[u8],
    part: &TensorRef,
    axis: ShardAxis,
    ranks: u32,
    rank: u32,
) -> Vec<u8> {
    let d = part.shape.dims();
    let es = part.dtype.size();
    let rows = d[0] as usize;
    let cols = d.get(1).map_or(1, |&c| c as usize);
    match axis {
        ShardAxis::Rows => {
            let per = rows / ranks as usize * cols * es;
            src[rank as usize * per..(rank as usize + 1) * per].to_vec()
        }
        ShardAxis::Cols => {
            let per = cols / ranks as usize * es;
            let row = cols * es;
            let mut out = Vec::with_capacity(rows * per);
            for r in 0..rows {
                let at = r * row + rank as usize * per;
                out.extend_from_slice(&src[at..at + per]);
            }
            out
        }
    }
}

fn read_f32(src: &[u8], dtype: DType, i: usize) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes(src[4 * i..4 * i + 4].try_into().unwrap()),
        DType::BF16 => {
            half::bf16::from_bits(u16::from_le_bytes([src[2 * i], src[2 * i + 1]])).to_f32()
        }
        DType::F16 => {
            half::f16::from_bits(u16::from_le_bytes([src[2 * i], src[2 * i + 1]])).to_f32()
        }
        DType::I32 => unreachable!("integer conversion is refused at validation"),
    }
}

/// Converts little-endian `src` of `from` into `dst` of `to` (element counts
/// equal). f32 to bf16/f16 rounds to nearest even.
pub fn convert(src: &[u8], from: DType, dst: &mut [u8], to: DType) {
    if from == to {
        dst.copy_from_slice(src);
        return;
    }
    let n = src.len() / from.size();
    debug_assert_eq!(dst.len(), n * to.size());
    for i in 0..n {
        let x = read_f32(src, from, i);
        match to {
            DType::F32 => dst[4 * i..4 * i + 4].copy_from_slice(&x.to_le_bytes()),
            DType::BF16 => {
                dst[2 * i..2 * i + 2].copy_from_slice(&half::bf16::from_f32(x).to_le_bytes())
            }
            DType::F16 => {
                dst[2 * i..2 * i + 2].copy_from_slice(&half::f16::from_f32(x).to_le_bytes())
            }
            DType::I32 => unreachable!("integer conversion is refused at validation"),
        }
    }
}

#[cfg(test)]
mod random_tests {
    use super::*;

    #[test]
    fn random_values_in_a_16_bit_dtype_are_the_f32_stream_converted() {
        for (dims, name) in [(vec![3u32, 37], "w.weight"), (vec![41], "norm.weight")] {
            let part = TensorRef {
                file: "model.safetensors".into(),
                tensor: name.into(),
                dtype: DType::BF16,
                shape: kiln_ir::Shape::new(dims),
            };
            let f = random_part(&part, 7);
            for to in [DType::BF16, DType::F16, DType::F32] {
                let mut want = vec![0u8; f.len() / 4 * to.size()];
                convert(&f, DType::F32, &mut want, to);
                let mut got = Vec::new();
                random_values(&part, 7, to, &mut got);
                assert_eq!(got, want, "{name} {to}");
            }
        }
    }
}

#[cfg(test)]
mod confinement_tests {
    use super::*;

    fn setup() -> (tempfile::TempDir, tempfile::TempDir, PathBuf) {
        let outside = tempfile::tempdir().unwrap();
        let secret = outside.path().join("secret.safetensors");
        std::fs::write(&secret, vec![7u8; 12345]).unwrap();
        let weights = tempfile::tempdir().unwrap();
        std::fs::write(weights.path().join("model.safetensors"), b"x").unwrap();
        (outside, weights, secret)
    }

    fn refuse(root: &Path, dir: &Path, name: &str) -> String {
        let e = confined_weight_path(root, dir, name)
            .unwrap_err()
            .to_string();
        assert!(!e.contains("12345"), "leaks the outside file's size: {e}");
        e
    }

    #[test]
    fn a_plain_name_inside_the_weights_directory_resolves() {
        let (_o, w, _s) = setup();
        let root = w.path().canonicalize().unwrap();
        let p = confined_weight_path(&root, w.path(), "model.safetensors").unwrap();
        assert!(p.starts_with(&root));
    }

    #[test]
    fn absolute_and_parent_names_are_refused_before_anything_is_opened() {
        let (_o, w, secret) = setup();
        let root = w.path().canonicalize().unwrap();
        let e = refuse(&root, w.path(), secret.to_str().unwrap());
        assert!(e.contains("not a plain relative path"), "{e}");
        let up = format!("../{}", secret.file_name().unwrap().to_str().unwrap());
        assert!(refuse(&root, w.path(), &up).contains("`..`"));
        assert!(refuse(&root, w.path(), "").contains("not a plain relative path"));
    }

    #[cfg(unix)]
    #[test]
    fn a_symlink_out_of_the_weights_directory_is_refused() {
        let (_o, w, secret) = setup();
        let root = w.path().canonicalize().unwrap();
        std::os::unix::fs::symlink(&secret, w.path().join("link.safetensors")).unwrap();
        let e = refuse(&root, w.path(), "link.safetensors");
        assert!(e.contains("outside the weights directory"), "{e}");
        // A link to a file inside is fine.
        std::os::unix::fs::symlink(
            w.path().join("model.safetensors"),
            w.path().join("inner.safetensors"),
        )
        .unwrap();
        confined_weight_path(&root, w.path(), "inner.safetensors").unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn a_fifo_or_a_directory_is_named_for_what_it_is_and_never_opened() {
        let (_o, w, _s) = setup();
        let root = w.path().canonicalize().unwrap();
        std::fs::create_dir(w.path().join("dir.safetensors")).unwrap();
        assert!(refuse(&root, w.path(), "dir.safetensors").contains("is a directory"));
        let fifo = w.path().join("fifo.safetensors");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            // Would block forever if it were opened.
            assert!(refuse(&root, w.path(), "fifo.safetensors").contains("is a FIFO"));
        }
    }

    #[test]
    fn a_missing_file_says_missing() {
        let (_o, w, _s) = setup();
        let root = w.path().canonicalize().unwrap();
        assert!(refuse(&root, w.path(), "absent.safetensors").contains("missing"));
    }
}
