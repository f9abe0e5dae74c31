//! HIP kernel images produced without a GPU or the HIP runtime: the kernel
//! sources as one translation unit ([`source`]), code objects from an offline
//! compiler at `kiln compile` time ([`offline`]), and the small facts about
//! architectures and code objects both need.
//!
//! It lives here, next to the kernel sources, so the compiler can embed HIP
//! images without linking the runtime; the runtime's HIP backend re-exports
//! these modules and adds what needs the device (hiprtc at load, the
//! code-object cache, graphs).
//!
//! Not here: anything that calls into `libamdhip64` or hiprtc.

pub mod offline;
pub mod source;

use crate::gpu;
use source::{translation_unit, SourceError, SourceText};

/// Every catalog module in one translation unit (the portability header once,
/// then the modules in catalog order): what a HIP plan embeds as source or
/// compiles into its code object.
pub fn kernels_translation_unit() -> Result<String, SourceError> {
    let header = SourceText {
        name: source::PORT_HEADER,
        text: gpu::PORT_HEADER,
    };
    let sources: Vec<SourceText<'_>> = gpu::MODULES
        .iter()
        .map(|m| SourceText {
            name: m.file,
            text: m.raw_source,
        })
        .collect();
    translation_unit(&header, &sources)
}

/// The base architecture of a `gcnArchName` (`gfx90a:sramecc+:xnack-` ->
/// `gfx90a`): target features dropped.
pub fn base_arch(gcn_arch_name: &str) -> &str {
    let name = gcn_arch_name.trim();
    name.split(':').next().unwrap_or(name)
}

/// `ELF` magic plus `e_machine == EM_AMDGPU` (224), or a clang offload bundle
/// (what `hipcc --genco` writes). Both load with `hipModuleLoadData`.
pub fn is_code_object(bytes: &[u8]) -> bool {
    const EM_AMDGPU: u16 = 224;
    const BUNDLE: &[u8] = b"__CLANG_OFFLOAD_BUNDLE__";
    if bytes.starts_with(BUNDLE) {
        return bytes.len() > BUNDLE.len();
    }
    bytes.len() >= 64
        && bytes.starts_with(b"\x7fELF")
        && u16::from_le_bytes([bytes[18], bytes[19]]) == EM_AMDGPU
}
