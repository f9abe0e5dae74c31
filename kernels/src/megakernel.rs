//! The megakernel interpreter's device side (`kernels/gpu/megakernel.cu`):
//! its module, the byte layout of the task and wait records the runtime will
//! upload, and the task kinds this build's interpreter runs.
//!
//! Status: a skeleton. The kernel compiles under NVRTC (tested here) but has
//! never run on a GPU, no backend launches it, and it is deliberately not in
//! [`crate::gpu::MODULES`]: it would change the kernel ABI fingerprint of
//! every plan and join the HIP translation unit before it has run anywhere.
//! It implements the control path (one block per queue, acquire waits,
//! release bumps) and one kind, a dense bf16 GEMV tile; every other op's
//! tile is still to be written (see `kiln_ir::schedule` for what each tile
//! reads and writes).
//!
//! Not here: tape construction and verification (`kiln_ir::schedule`, the
//! compiler's megakernel pass), address resolution, the counter memset and
//! the occupancy check (the CUDA backend's job when it launches this).

use crate::gpu::GpuModule;

/// The interpreter's module (not in [`crate::gpu::MODULES`]; see the docs).
pub const MEGAKERNEL_MODULE: GpuModule = GpuModule {
    name: "megakernel",
    file: "megakernel.cu",
    raw_source: include_str!("../gpu/megakernel.cu"),
};

/// The kernel's entry point.
pub const ENTRY: &str = "megakernel_run";

/// Threads per block (`KILN_MK_THREADS`).
pub const BLOCK_THREADS: u32 = 256;

/// Bytes of one [`DeviceTask`] record (`struct MkTask`).
pub const TASK_BYTES: usize = 80;

/// Bytes of one wait record (`struct MkWait`: counter, target).
pub const WAIT_BYTES: usize = 8;

/// What a task computes (`KILN_MK_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum TaskKind {
    /// A bf16 GEMV tile with a bf16 result.
    GemvBf16 = 1,
    /// A bf16 GEMV tile with an f32 result (logits).
    GemvBf16F32 = 2,
}

/// One task as the interpreter reads it (`struct MkTask`), addresses
/// resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceTask {
    pub kind: TaskKind,
    pub counter: u32,
    pub wait_begin: u32,
    pub wait_count: u32,
    pub tile_begin: u32,
    pub tile_end: u32,
    pub tokens: u32,
    pub k: u32,
    pub n: u32,
    pub x: u64,
    pub w: u64,
    /// 0: no bias.
    pub bias: u64,
    pub out: u64,
}

impl DeviceTask {
    /// The record's little-endian bytes, laid out as `struct MkTask`.
    pub fn to_bytes(&self) -> [u8; TASK_BYTES] {
        let mut b = [0u8; TASK_BYTES];
        let words = [
            self.kind as u32,
            self.counter,
            self.wait_begin,
            self.wait_count,
            self.tile_begin,
            self.tile_end,
            self.tokens,
            self.k,
            self.n,
        ];
        for (i, w) in words.iter().enumerate() {
            b[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
        }
        // Three padding words, then the pointers at byte 48.
        for (i, p) in [self.x, self.w, self.bias, self.out].iter().enumerate() {
            b[48 + 8 * i..56 + 8 * i].copy_from_slice(&p.to_le_bytes());
        }
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_task_puts_every_field_where_struct_mktask_has_it() {
        let t = DeviceTask {
            kind: TaskKind::GemvBf16F32,
            counter: 7,
            wait_begin: 11,
            wait_count: 3,
            tile_begin: 16,
            tile_end: 32,
            tokens: 1,
            k: 1024,
            n: 151936,
            x: 0x1000,
            w: 0x2000_0000_0000,
            bias: 0,
            out: 0xdead_beef,
        };
        let b = t.to_bytes();
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        assert_eq!(
            (0..9).map(|i| u32_at(4 * i)).collect::<Vec<_>>(),
            vec![2, 7, 11, 3, 16, 32, 1, 1024, 151936]
        );
        assert_eq!([u32_at(36), u32_at(40), u32_at(44)], [0, 0, 0]);
        assert_eq!(
            [u64_at(48), u64_at(56), u64_at(64), u64_at(72)],
            [0x1000, 0x2000_0000_0000, 0, 0xdead_beef]
        );
        // The source declares the same layout and constants.
        let src = MEGAKERNEL_MODULE.raw_source;
        assert!(src.contains("// One task, 80 bytes"));
        assert!(src.contains(&format!("#define KILN_MK_THREADS {BLOCK_THREADS}")));
        assert!(src.contains(&format!(
            "#define KILN_MK_GEMV_BF16 {}",
            TaskKind::GemvBf16 as u32
        )));
        assert!(src.contains(&format!(
            "#define KILN_MK_GEMV_BF16_F32 {}",
            TaskKind::GemvBf16F32 as u32
        )));
    }

    /// The interpreter compiles to a CUBIN for every supported SM and
    /// exports its entry point (named so `cargo test -p kiln-kernels
    /// every_module_compiles` runs it with the catalog's modules).
    #[cfg(feature = "nvrtc")]
    #[test]
    fn every_module_compiles_and_so_does_the_megakernel_interpreter() {
        if let Err(e) = crate::nvrtc::locate() {
            if std::env::var("KILN_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
                panic!("KILN_REQUIRE_NVRTC=1 but {e}");
            }
            eprintln!("SKIPPED: NVRTC is not installed here ({e})");
            return;
        }
        for sm in crate::nvrtc::SUPPORTED_SMS {
            let cubin = crate::nvrtc::compile_module(&MEGAKERNEL_MODULE, sm)
                .unwrap_or_else(|e| panic!("sm_{sm}: {e}"));
            assert_eq!(&cubin[..4], b"\x7fELF");
            let needle = format!("{ENTRY}\0");
            assert!(
                cubin.windows(needle.len()).any(|w| w == needle.as_bytes()),
                "{ENTRY} missing from the sm_{sm} cubin"
            );
        }
    }
}
