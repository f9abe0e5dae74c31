//! Helpers shared by the frontend integration tests.
#![allow(dead_code)]

use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
use kiln_ir::DType;
use std::path::Path;

/// The model variants every test runs over: name, family, spec.
pub fn variants() -> Vec<(&'static str, Family, TinySpec)> {
    vec![
        ("llama", Family::Llama, TinySpec::for_family(Family::Llama)),
        (
            "llama_tied",
            Family::Llama,
            TinySpec {
                tie_embeddings: true,
                ..TinySpec::default()
            },
        ),
        ("llama3_scaled", Family::Llama, TinySpec::llama3()),
        ("smollm2", Family::Llama, TinySpec::smollm2()),
        (
            "mistral",
            Family::Mistral,
            TinySpec::for_family(Family::Mistral),
        ),
        ("qwen2", Family::Qwen2, TinySpec::for_family(Family::Qwen2)),
        ("qwen3", Family::Qwen3, TinySpec::for_family(Family::Qwen3)),
    ]
}

pub fn tiny(family: Family, spec: &TinySpec) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), family, spec).unwrap();
    dir
}

/// Edits config.json in place.
pub fn patch_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// All tensors of a safetensors file: (name, dtype, shape, bytes).
pub fn read_tensors(path: &Path) -> Vec<(String, DType, Vec<u32>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let dtype = match view.dtype() {
                safetensors::Dtype::BF16 => DType::BF16,
                safetensors::Dtype::F16 => DType::F16,
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::I32 => DType::I32,
                d => panic!("unexpected dtype {d:?}"),
            };
            let shape = view.shape().iter().map(|&d| d as u32).collect();
            (name, dtype, shape, view.data().to_vec())
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Rewrites a safetensors file with `edit` applied to its tensor list.
pub fn rewrite_tensors(
    path: &Path,
    edit: impl FnOnce(&mut Vec<(String, DType, Vec<u32>, Vec<u8>)>),
) {
    let mut t = read_tensors(path);
    edit(&mut t);
    std::fs::write(path, kiln_compiler::testing::safetensors_bytes(&t)).unwrap();
}
