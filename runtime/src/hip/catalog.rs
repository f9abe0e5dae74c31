//! The HIP side of the GPU kernel catalog (`kiln_kernels::gpu`): the kernel
//! sources as one HIP translation unit, and the `kernelParams` array
//! `hipModuleLaunchKernel` takes, built from a launch body's packed
//! parameters (`ResolvedKernel::pack`).
//!
//! `kernelParams` is an array of pointers, one per kernel parameter, each
//! pointing at the parameter's bytes. The bytes live in 8-byte aligned boxes
//! owned by [`PackedParams`], so they stay put while the array is used; HIP
//! copies the values at launch (and at capture, into the graph node), so the
//! pack may be dropped right after the call.
//!
//! Not here: the launch call (`crate::gpu::hip`), the catalog itself
//! (`kiln_kernels::gpu`) and any lowering (`kiln compile` writes it into the
//! plan).

use kiln_kernels::gpu;
use std::ffi::c_void;

pub use kiln_kernels::hip::kernels_translation_unit;

/// Every entry point of every catalog module, with its module name.
pub fn all_entry_points() -> Vec<(&'static str, String)> {
    gpu::MODULES
        .iter()
        .flat_map(|m| {
            gpu::entry_points(m.name)
                .into_iter()
                .map(move |e| (m.name, e))
        })
        .collect()
}

/// Kernel parameters with stable addresses, ready for `hipModuleLaunchKernel`.
pub struct PackedParams {
    slots: Vec<Box<[u64]>>,
    sizes: Vec<usize>,
    ptrs: Vec<*mut c_void>,
}

impl PackedParams {
    /// Parameters packed by `ResolvedKernel::pack` (`bytes`, and each
    /// parameter's byte offset), each given its own stable slot.
    pub fn from_packed(bytes: &[u8], offsets: &[usize]) -> PackedParams {
        let mut slots = Vec::with_capacity(offsets.len());
        let mut sizes = Vec::with_capacity(offsets.len());
        for (i, &at) in offsets.iter().enumerate() {
            let end = offsets
                .get(i + 1)
                .copied()
                .unwrap_or(bytes.len())
                .min(bytes.len());
            let b = &bytes[at.min(end)..end];
            let mut slot = vec![0u64; b.len().div_ceil(8).max(1)].into_boxed_slice();
            // SAFETY: the slot has at least `b.len()` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(b.as_ptr(), slot.as_mut_ptr().cast::<u8>(), b.len());
            }
            slots.push(slot);
            sizes.push(b.len());
        }
        let ptrs = slots
            .iter_mut()
            .map(|s| s.as_mut_ptr().cast::<c_void>())
            .collect();
        PackedParams { slots, sizes, ptrs }
    }

    /// The `kernelParams` array.
    pub fn as_kernel_params(&mut self) -> *mut *mut c_void {
        self.ptrs.as_mut_ptr()
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The bytes parameter `i` points at.
    pub fn bytes(&self, i: usize) -> &[u8] {
        // SAFETY: `ptrs[i]` points into `slots[i]`, which holds `sizes[i]` bytes.
        unsafe { std::slice::from_raw_parts(self.ptrs[i].cast::<u8>(), self.sizes[i]) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_packed_parameter_gets_its_exact_bytes_behind_an_aligned_pointer() {
        let blob: Vec<u8> = (0u8..56).map(|i| i.wrapping_mul(37)).collect();
        let mut bytes = Vec::new();
        let mut offsets = Vec::new();
        let mut push = |b: &[u8]| {
            offsets.push(bytes.len());
            bytes.extend_from_slice(b);
        };
        push(&0x7000_0000_2000u64.to_ne_bytes());
        push(&(-123_456i32).to_ne_bytes());
        push(&blob);
        push(&0.1f32.to_ne_bytes());
        let mut p = PackedParams::from_packed(&bytes, &offsets);
        assert_eq!(p.len(), 4);
        assert_eq!(p.bytes(0), 0x7000_0000_2000u64.to_ne_bytes());
        assert_eq!(p.bytes(1), (-123_456i32).to_ne_bytes());
        assert_eq!(p.bytes(2), &blob[..]);
        assert_eq!(p.bytes(3), 0.1f32.to_ne_bytes());
        let want: Vec<Vec<u8>> = (0..4).map(|i| p.bytes(i).to_vec()).collect();
        let arr = p.as_kernel_params();
        for (i, w) in want.iter().enumerate() {
            // SAFETY: the array has 4 entries.
            let ptr = unsafe { *arr.add(i) };
            assert_eq!(ptr as usize % 8, 0);
            // SAFETY: each pointer addresses its slot.
            let got = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), w.len()) };
            assert_eq!(got, &w[..]);
        }
        // Moving the pack keeps every pointer valid.
        let moved = Box::new(p);
        assert_eq!(moved.bytes(1), (-123_456i32).to_ne_bytes());
    }

    #[test]
    fn the_catalog_makes_one_translation_unit_with_every_entry_point() {
        let tu = kernels_translation_unit().unwrap();
        assert_eq!(tu.matches("#define KILN_FOR_FLOATS").count(), 1);
        for m in gpu::MODULES {
            assert!(
                tu.contains(&format!("#line 1 \"{}\"", m.file)),
                "{}",
                m.file
            );
        }
        // Each module's text follows its #line marker, minus the include line.
        for m in gpu::MODULES {
            let at = tu.find(&format!("#line 1 \"{}\"", m.file)).unwrap();
            let body = &tu[at..];
            for line in m.raw_source.lines().filter(|l| !l.contains("kiln_port.h")) {
                assert!(body.contains(line), "{}: {line}", m.file);
            }
        }
        let entries = all_entry_points();
        let modules: std::collections::BTreeSet<_> = entries.iter().map(|(m, _)| *m).collect();
        assert_eq!(modules.len(), gpu::MODULES.len());
    }
}
