//! Host memory behind the CPU backend's allocations, on transparent huge
//! pages where the OS offers them.
//!
//! Why a module of its own: a CPU decode step streams every weight once, and
//! with 4 KiB pages the stream crosses a page (a TLB miss, and the end of
//! the hardware prefetcher's run) every 64 cache lines. A Q4_1 SmolLM2-135M
//! keeps its 66 MB of projections in ~150 allocations of 0.2-1.1 MB, each
//! too small for a 2 MiB page of its own, so the weights are carved in order
//! out of **slabs**: anonymous mappings of [`SLAB_BYTES`] advised
//! `MADV_HUGEPAGE`, 2 MiB aligned. An allocation larger than [`SLAB_MAX`]
//! gets an advised mapping of its own; one smaller than [`SLAB_MIN`] (most
//! of a test's, the arena, io and staging) comes from the global allocator
//! as before.
//!
//! Every block is zeroed (anonymous mappings are, and slab space is never
//! handed out twice) and aligned to [`crate::cpu`]'s 256 bytes. A slab is
//! unmapped when the last block carved from it is freed and the allocator has
//! moved on to a newer slab. Freed space inside a live slab is not reused:
//! bump allocation keeps this module trivially correct, and the backend's
//! large allocations (weights, KV caches) live as long as the engine. The
//! waste is bounded by one slab per long-lived block that outlives its
//! neighbours.
//!
//! Every mapped block is **faulted in when it is allocated** (one write per
//! 4 KiB page), not at its first use. A KV cache is written a few hundred
//! bytes a token, so left lazy its pages would fault (and be zeroed, 2 MiB
//! at a time on huge pages) inside decode steps: on the 2-core VM, 5% of a
//! 300-token `kiln run`'s samples were the kernel clearing KV pages in
//! `replay`. A planned buffer costs its page faults at load, like
//! `cudaMalloc` plus the memset that zeroes it.
//!
//! Whether the kernel backs a slab with huge pages is the OS's decision
//! (`/sys/kernel/mm/transparent_hugepage/enabled` set to `madvise` or
//! `always`); without them the memory behaves exactly as before. No other
//! platform advice is attempted off Linux.

use memmap2::MmapMut;
use std::alloc::Layout;
use std::sync::Arc;

/// Bytes of one slab.
pub(crate) const SLAB_BYTES: usize = 32 << 20;
/// Allocations below this come from the global allocator.
pub(crate) const SLAB_MIN: usize = 64 << 10;
/// Allocations above this get a mapping of their own.
pub(crate) const SLAB_MAX: usize = 8 << 20;
/// The huge page size the mappings are aligned to.
const HUGE: usize = 2 << 20;

/// An anonymous mapping, 2 MiB aligned inside, advised for huge pages.
struct Mapping {
    _map: MmapMut,
    /// The first 2 MiB boundary inside the mapping.
    base: *mut u8,
}

// SAFETY: the mapping is plain memory; access is coordinated by the backend
// (one owner per block), as for the global allocator's memory.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    /// A mapping of at least `len` bytes starting at a 2 MiB boundary.
    fn new(len: usize) -> Option<Mapping> {
        let total = len.checked_add(HUGE)?;
        let mut map = MmapMut::map_anon(total).ok()?;
        let raw = map.as_mut_ptr();
        let skip = raw.align_offset(HUGE);
        #[cfg(target_os = "linux")]
        {
            // Advice only: a kernel without THP leaves 4 KiB pages.
            let _ = map.advise_range(memmap2::Advice::HugePage, skip, len);
        }
        // SAFETY: skip < HUGE, so base + len stays inside the mapping.
        let base = unsafe { raw.add(skip) };
        Some(Mapping { _map: map, base })
    }
}

/// Where a block's memory came from.
enum Source {
    Heap(Layout),
    /// Carved from (or the whole of) a mapping, unmapped with its last block.
    Mapped {
        _map: Arc<Mapping>,
    },
}

/// One zeroed host block.
pub(crate) struct HostBlock {
    pub(crate) ptr: *mut u8,
    source: Source,
}

impl Drop for HostBlock {
    fn drop(&mut self) {
        if let Source::Heap(layout) = self.source {
            // SAFETY: `ptr` came from `alloc_zeroed(layout)` and is freed once.
            unsafe { std::alloc::dealloc(self.ptr, layout) }
        }
        // A mapped block drops its reference; the last one unmaps.
    }
}

/// Faults in every page of the fresh, zeroed block `[ptr, ptr + size)` by
/// writing the zero it already holds into each.
fn fault_in(ptr: *mut u8, size: usize) {
    for at in (0..size).step_by(4096) {
        // SAFETY: `at < size`, inside the block; the byte is zero already.
        unsafe { ptr.add(at).write_volatile(0) };
    }
}

/// The slab in use: the mapping and how much of it is handed out.
struct Slab {
    map: Arc<Mapping>,
    used: usize,
}

/// The allocator (one per CPU backend).
#[derive(Default)]
pub(crate) struct HostMem {
    slab: Option<Slab>,
}

impl HostMem {
    /// `size` zeroed bytes aligned to `align` (a power of two at most 4096),
    /// or `None` when the host has no memory for them.
    pub(crate) fn alloc_zeroed(&mut self, size: usize, align: usize) -> Option<HostBlock> {
        debug_assert!(align.is_power_of_two() && align <= 4096);
        let size = size.max(1);
        if size < SLAB_MIN {
            let layout = Layout::from_size_align(size, align).ok()?;
            // SAFETY: layout has a non-zero size.
            let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
            return (!ptr.is_null()).then_some(HostBlock {
                ptr,
                source: Source::Heap(layout),
            });
        }
        if size > SLAB_MAX {
            let map = Arc::new(Mapping::new(size)?);
            fault_in(map.base, size);
            return Some(HostBlock {
                ptr: map.base,
                source: Source::Mapped { _map: map },
            });
        }
        let fits = |s: &Slab| s.used.next_multiple_of(align) + size <= SLAB_BYTES;
        if !self.slab.as_ref().is_some_and(fits) {
            self.slab = Some(Slab {
                map: Arc::new(Mapping::new(SLAB_BYTES)?),
                used: 0,
            });
        }
        let slab = self.slab.as_mut()?;
        let at = slab.used.next_multiple_of(align);
        slab.used = at + size;
        // SAFETY: at + size <= SLAB_BYTES, inside the mapping.
        let ptr = unsafe { slab.map.base.add(at) };
        fault_in(ptr, size);
        Some(HostBlock {
            ptr,
            source: Source::Mapped {
                _map: slab.map.clone(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zeroed(b: &HostBlock, len: usize) -> bool {
        // SAFETY: the block holds `len` bytes.
        unsafe { std::slice::from_raw_parts(b.ptr, len) }
            .iter()
            .all(|&v| v == 0)
    }

    #[test]
    fn every_size_class_is_zeroed_aligned_and_disjoint() {
        let mut m = HostMem::default();
        let sizes = [
            1,
            100,
            SLAB_MIN - 1,
            SLAB_MIN,
            300 << 10,
            SLAB_MAX,
            SLAB_MAX + 1,
        ];
        let blocks: Vec<_> = sizes
            .iter()
            .map(|&s| (s, m.alloc_zeroed(s, 256).unwrap()))
            .collect();
        for (s, b) in &blocks {
            assert_eq!(b.ptr as usize % 256, 0, "size {s}");
            assert!(zeroed(b, *s), "size {s}");
            // SAFETY: the block holds `s` bytes; writing proves it is ours.
            unsafe { std::ptr::write_bytes(b.ptr, 0xa5, *s) };
        }
        let mut spans: Vec<_> = blocks
            .iter()
            .map(|(s, b)| (b.ptr as usize, b.ptr as usize + s))
            .collect();
        spans.sort();
        assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "{spans:x?}");
    }

    #[test]
    fn a_slab_outlives_the_allocator_moving_on_while_a_block_from_it_lives() {
        let mut m = HostMem::default();
        let first = m.alloc_zeroed(SLAB_MAX, 256).unwrap();
        // Enough blocks to open several more slabs; the first stays mapped.
        let more: Vec<_> = (0..3 * SLAB_BYTES / SLAB_MAX)
            .map(|_| m.alloc_zeroed(SLAB_MAX, 256).unwrap())
            .collect();
        // SAFETY: the first block is still live and holds SLAB_MAX bytes.
        unsafe { std::ptr::write_bytes(first.ptr, 1, SLAB_MAX) };
        assert_eq!(unsafe { *first.ptr.add(SLAB_MAX - 1) }, 1);
        drop(more);
        drop(first);
        // Space is never handed out twice: a new block is zero again.
        let again = m.alloc_zeroed(SLAB_MIN, 256).unwrap();
        assert!(zeroed(&again, SLAB_MIN));
    }
}
