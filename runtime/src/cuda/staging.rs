//! Pinned staging for host-to-device uploads.
//!
//! `Backend::upload` gets a borrowed slice that is gone when it returns, but
//! an asynchronous copy reads its source later. The data is therefore copied
//! into page-locked chunks first and the device copy is enqueued from there;
//! a chunk is reused only after the event recorded behind its last copy has
//! completed. Small per-step uploads pack into the current chunk, so a step's
//! input refresh costs no host synchronization; large uploads (weights)
//! stream through all chunks, the host filling one while the DMA drains
//! another.

use super::driver::check;
use crate::backend::BackendError;
use cudarc::driver::sys as cu;
use std::ffi::c_void;

struct Chunk {
    host: *mut u8,
    /// Bytes of the chunk in use by copies not yet known to be complete.
    used: usize,
    /// Recorded after the chunk's last enqueued copy (when `pending`).
    event: cu::CUevent,
    pending: bool,
}

pub struct Staging {
    chunks: Vec<Chunk>,
    chunk_bytes: usize,
    current: usize,
}

impl Staging {
    pub fn new(total: usize, n: usize) -> Result<Staging, BackendError> {
        let chunk_bytes = total / n;
        let mut chunks = Vec::with_capacity(n);
        for _ in 0..n {
            let mut host: *mut c_void = std::ptr::null_mut();
            let mut event = std::ptr::null_mut();
            // SAFETY: valid out-pointers; freed in `release`.
            unsafe {
                check(
                    cu::cuMemHostAlloc(&mut host, chunk_bytes, 0),
                    "cuMemHostAlloc (upload staging)",
                )?;
                check(
                    cu::cuEventCreate(
                        &mut event,
                        cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                    ),
                    "cuEventCreate",
                )?;
            }
            chunks.push(Chunk {
                host: host as *mut u8,
                used: 0,
                event,
                pending: false,
            });
        }
        Ok(Staging {
            chunks,
            chunk_bytes,
            current: 0,
        })
    }

    /// Moves to the next chunk, waiting until the copies reading it are done.
    fn advance(&mut self, stream: cu::CUstream) -> Result<(), BackendError> {
        let cur = &mut self.chunks[self.current];
        if cur.used > 0 {
            // SAFETY: live event and stream.
            check(
                unsafe { cu::cuEventRecord(cur.event, stream) },
                "cuEventRecord",
            )?;
            cur.pending = true;
        }
        self.current = (self.current + 1) % self.chunks.len();
        let next = &mut self.chunks[self.current];
        if next.pending {
            // SAFETY: live event.
            check(
                unsafe { cu::cuEventSynchronize(next.event) },
                "cuEventSynchronize",
            )?;
            next.pending = false;
        }
        next.used = 0;
        Ok(())
    }

    /// Enqueues a copy of `data` to device address `dst` on `stream`.
    pub fn upload(
        &mut self,
        dst: u64,
        data: &[u8],
        stream: cu::CUstream,
    ) -> Result<(), BackendError> {
        let mut done = 0usize;
        while done < data.len() {
            let free = self.chunk_bytes - self.chunks[self.current].used;
            // Align each copy's source to 16 bytes within the chunk.
            if free < 16 || (free < data.len() - done && free < self.chunk_bytes / 4) {
                self.advance(stream)?;
                continue;
            }
            let n = free.min(data.len() - done);
            let c = &mut self.chunks[self.current];
            // SAFETY: [used, used + n) lies inside the pinned chunk, which no
            // pending copy reads (it was drained before reuse).
            unsafe {
                let src = c.host.add(c.used);
                std::ptr::copy_nonoverlapping(data.as_ptr().add(done), src, n);
                check(
                    cu::cuMemcpyHtoDAsync_v2(dst + done as u64, src as *const c_void, n, stream),
                    "cuMemcpyHtoDAsync",
                )?;
            }
            c.used = (c.used + n).div_ceil(16) * 16;
            c.used = c.used.min(self.chunk_bytes);
            done += n;
        }
        Ok(())
    }

    /// Frees the pinned memory and events (the stream must be drained).
    pub fn release(&mut self) {
        for c in self.chunks.drain(..) {
            // SAFETY: allocated in `new`, released once.
            unsafe {
                cu::cuMemFreeHost(c.host as *mut c_void);
                cu::cuEventDestroy_v2(c.event);
            }
        }
    }
}
