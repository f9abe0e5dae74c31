//! The HIP side of the GPU kernel catalog (`kiln_kernels::gpu`): the kernel
//! sources as one HIP translation unit, the catalog's lowering of a
//! [`Launch`] with its operands' placement, and the `kernelParams` array
//! `hipModuleLaunchKernel` takes, built from the catalog's symbolic
//! parameters.
//!
//! `kernelParams` is an array of pointers, one per kernel parameter, each
//! pointing at the parameter's bytes. The bytes live in 8-byte aligned boxes
//! owned by [`PackedParams`], so they stay put while the array is used; HIP
//! copies the values at launch (and at capture, into the graph node), so the
//! pack may be dropped right after the call.
//!
//! Not here: the launch call (ROCm-only backend) and the catalog itself
//! (`kiln_kernels::gpu`).

use crate::backend::{BackendError, DevOperand, DevPtr, Launch};
use kiln_kernels::gpu::{self, Lowered, Param, Placement};
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

/// Whether result 0 overlaps argument 0 in memory (the planner's in-place
/// reuse), which changes how some ops are lowered.
pub fn placement(launch: &Launch) -> Placement {
    let range = |o: &DevOperand| (o.ptr.0, o.ptr.0 + o.ty.size_bytes());
    let overlaps = match (launch.args.first(), launch.results.first()) {
        (Some(a), Some(r)) => {
            let (a0, a1) = range(a);
            let (r0, r1) = range(r);
            a0 < r1 && r0 < a1
        }
        _ => false,
    };
    Placement {
        result0_overlaps_arg0: overlaps,
    }
}

/// The catalog's lowering of `launch`.
pub fn lower(launch: &Launch) -> Result<Lowered, BackendError> {
    let args: Vec<_> = launch.args.iter().map(|a| a.ty.clone()).collect();
    let results: Vec<_> = launch.results.iter().map(|r| r.ty.clone()).collect();
    gpu::lower(&launch.op, &args, &results, placement(launch))
        .map_err(|e| BackendError::Device(format!("{}: {e}", launch.kernel)))
}

/// The backend-owned buffers an op's parameters may point into.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpBuffers {
    /// Scratch: base and bytes.
    pub scratch: Option<(DevPtr, u64)>,
    /// Zero-initialized u32 completion counters: base and count.
    pub counters: Option<(DevPtr, u32)>,
}

/// Kernel parameters with stable addresses, ready for `hipModuleLaunchKernel`.
pub struct PackedParams {
    slots: Vec<Box<[u64]>>,
    sizes: Vec<usize>,
    ptrs: Vec<*mut c_void>,
}

impl PackedParams {
    /// Resolves `params` against `launch`'s operands and the backend's
    /// scratch and counter buffers.
    pub fn new(
        params: &[Param],
        launch: &Launch,
        buffers: OpBuffers,
    ) -> Result<PackedParams, BackendError> {
        let scratch = buffers.scratch;
        let bad = |m: String| BackendError::Device(format!("{}: {m}", launch.kernel));
        let mut slots = Vec::with_capacity(params.len());
        let mut sizes = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            let bytes: Vec<u8> = match p {
                Param::Arg(j) => launch
                    .args
                    .get(*j)
                    .ok_or_else(|| bad(format!("parameter {i} names argument {j}, but the launch has {}", launch.args.len())))?
                    .ptr
                    .0
                    .to_ne_bytes()
                    .to_vec(),
                Param::Result(j) => launch
                    .results
                    .get(*j)
                    .ok_or_else(|| bad(format!("parameter {i} names result {j}, but the launch has {}", launch.results.len())))?
                    .ptr
                    .0
                    .to_ne_bytes()
                    .to_vec(),
                Param::Scratch(off) => match scratch {
                    Some((base, size)) if *off < size.max(1) => base.offset(*off).0.to_ne_bytes().to_vec(),
                    Some((_, size)) => {
                        return Err(bad(format!("parameter {i} is scratch offset {off}, beyond the {size}-byte scratch buffer")))
                    }
                    None => return Err(bad(format!("parameter {i} needs the scratch buffer, which is not allocated; prepare() the launch first"))),
                },
                Param::Counters(c) => match buffers.counters {
                    Some((base, n)) if *c < n => base.offset(*c as u64 * 4).0.to_ne_bytes().to_vec(),
                    Some((_, n)) => {
                        return Err(bad(format!("parameter {i} is completion counter {c}, beyond the {n} allocated")))
                    }
                    None => return Err(bad(format!("parameter {i} needs completion counters, which are not allocated; prepare() the launch first"))),
                },
                Param::Null => 0u64.to_ne_bytes().to_vec(),
                Param::I32(v) => v.to_ne_bytes().to_vec(),
                Param::I64(v) => v.to_ne_bytes().to_vec(),
                Param::F32(v) => v.to_ne_bytes().to_vec(),
                Param::Blob(b) => b.clone(),
            };
            debug_assert_eq!(bytes.len(), p.size());
            let mut slot = vec![0u64; bytes.len().div_ceil(8).max(1)].into_boxed_slice();
            // SAFETY: the slot has at least `bytes.len()` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    slot.as_mut_ptr().cast::<u8>(),
                    bytes.len(),
                );
            }
            slots.push(slot);
            sizes.push(bytes.len());
        }
        let ptrs = slots
            .iter_mut()
            .map(|s| s.as_mut_ptr().cast::<c_void>())
            .collect();
        Ok(PackedParams { slots, sizes, ptrs })
    }

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
    use kiln_ir::{DType, Op, TensorType};

    fn launch(args: &[(u64, TensorType)], results: &[(u64, TensorType)]) -> Launch {
        let ops = |v: &[(u64, TensorType)]| {
            v.iter()
                .map(|(p, ty)| DevOperand {
                    ptr: DevPtr(*p),
                    ty: ty.clone(),
                })
                .collect()
        };
        Launch {
            const_args: 0,
            body: crate::backend::LaunchBody::Reference,
            kernel: "add_f32".into(),
            op: Op::Add,
            args: ops(args),
            results: ops(results),
            workspace: None,
        }
    }

    #[test]
    fn every_parameter_kind_is_packed_with_its_exact_bytes_behind_its_pointer() {
        let f = TensorType::new(DType::F32, [16]);
        let l = launch(
            &[(0x7000_0000_1000, f.clone()), (0x7000_0000_2000, f.clone())],
            &[(0x7000_0000_3000, f)],
        );
        let blob: Vec<u8> = (0u8..56).map(|i| i.wrapping_mul(37)).collect();
        let params = vec![
            Param::Arg(1),
            Param::Result(0),
            Param::Scratch(512),
            Param::Null,
            Param::I32(-123_456),
            Param::I64(-9_876_543_210),
            Param::F32(0.1),
            Param::Blob(blob.clone()),
            Param::Arg(0),
            Param::Counters(3),
        ];
        let buffers = OpBuffers {
            scratch: Some((DevPtr(0x7100_0000_0000), 4096)),
            counters: Some((DevPtr(0x7200_0000_0000), 8)),
        };
        let mut p = PackedParams::new(&params, &l, buffers).unwrap();
        assert_eq!(p.len(), params.len());
        assert_eq!(p.bytes(0), 0x7000_0000_2000u64.to_ne_bytes());
        assert_eq!(p.bytes(1), 0x7000_0000_3000u64.to_ne_bytes());
        assert_eq!(p.bytes(2), 0x7100_0000_0200u64.to_ne_bytes());
        assert_eq!(p.bytes(3), 0u64.to_ne_bytes());
        assert_eq!(p.bytes(4), (-123_456i32).to_ne_bytes());
        assert_eq!(p.bytes(5), (-9_876_543_210i64).to_ne_bytes());
        assert_eq!(p.bytes(6), 0.1f32.to_ne_bytes());
        assert_eq!(p.bytes(7), &blob[..]);
        assert_eq!(p.bytes(8), 0x7000_0000_1000u64.to_ne_bytes());
        assert_eq!(p.bytes(9), 0x7200_0000_000cu64.to_ne_bytes());
        // The array HIP reads holds the same pointers, each 8-byte aligned.
        let arr = p.as_kernel_params();
        for (i, param) in params.iter().enumerate() {
            // SAFETY: the array has params.len() entries.
            let ptr = unsafe { *arr.add(i) };
            assert_eq!(ptr as usize % 8, 0);
            // SAFETY: each pointer addresses its slot.
            let got = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), param.size()) };
            assert_eq!(got, p.bytes(i));
        }
    }

    #[test]
    fn the_pointers_survive_moving_the_pack() {
        let f = TensorType::new(DType::F32, [4]);
        let l = launch(&[(0x1000, f.clone())], &[(0x2000, f)]);
        let p =
            PackedParams::new(&[Param::Arg(0), Param::I32(7)], &l, OpBuffers::default()).unwrap();
        let moved = Box::new(p);
        assert_eq!(moved.bytes(0), 0x1000u64.to_ne_bytes());
        assert_eq!(moved.bytes(1), 7i32.to_ne_bytes());
    }

    #[test]
    fn unresolvable_parameters_are_errors_naming_the_kernel() {
        let f = TensorType::new(DType::F32, [4]);
        let l = launch(&[(0x1000, f.clone())], &[(0x2000, f)]);
        for (params, want) in [
            (vec![Param::Arg(3)], "argument 3"),
            (vec![Param::Result(1)], "result 1"),
            (vec![Param::Scratch(0)], "not allocated"),
            (vec![Param::Counters(0)], "not allocated"),
        ] {
            let e = PackedParams::new(&params, &l, OpBuffers::default())
                .err()
                .unwrap()
                .to_string();
            assert!(e.starts_with("add_f32:") && e.contains(want), "{e}");
        }
        let buffers = OpBuffers {
            scratch: Some((DevPtr(0x9000), 4096)),
            counters: Some((DevPtr(0xa000), 2)),
        };
        for p in [Param::Scratch(4096), Param::Counters(2)] {
            let e = PackedParams::new(&[p], &l, buffers)
                .err()
                .unwrap()
                .to_string();
            assert!(e.contains("beyond"), "{e}");
        }
    }

    #[test]
    fn in_place_results_are_detected_from_addresses() {
        let x = TensorType::new(DType::BF16, [3, 20]);
        let y = TensorType::new(DType::BF16, [3, 10]);
        let same = launch(&[(0x1000, x.clone())], &[(0x1000, y.clone())]);
        assert!(placement(&same).result0_overlaps_arg0);
        let inside = launch(&[(0x1000, x.clone())], &[(0x1000 + 100, y.clone())]);
        assert!(placement(&inside).result0_overlaps_arg0);
        // x is 120 bytes: a result starting right after it does not overlap.
        let after = launch(&[(0x1000, x.clone())], &[(0x1000 + 120, y.clone())]);
        assert!(!placement(&after).result0_overlaps_arg0);
        let before = launch(&[(0x1000, x)], &[(0x1000 - 60, y)]);
        assert!(!placement(&before).result0_overlaps_arg0);
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

    #[test]
    fn lowering_errors_name_the_kernel() {
        let i = TensorType::new(DType::I32, [4]);
        let l = launch(&[(0x1000, i.clone()), (0x2000, i.clone())], &[(0x3000, i)]);
        let e = lower(&l).unwrap_err().to_string();
        assert!(
            e.starts_with("add_f32:") && e.contains("bf16, f16 or f32"),
            "{e}"
        );
    }
}
