//! The megakernel interpreter skeleton (`kernels/gpu/megakernel.cu`) on a
//! real GPU: a hand-built tape of two chained GEMVs cut into column tiles on
//! two queues, the second layer's tiles waiting on every first-layer tile,
//! against an f64 host computation; the occupancy the launch needs checked
//! first; the counters zeroed by a memset between two runs, which must give
//! the same bits.
//!
//! Run on the GPU machine with
//! (`cargo test -p kiln-runtime --features cuda --test cuda_megakernel`).
//! Skips without a CUDA device unless `KILN_REQUIRE_CUDA=1`.
#![cfg(feature = "cuda")]

use cudarc::driver::sys as cu;
use kiln_kernels::megakernel::{
    DeviceTask, TaskKind, BLOCK_THREADS, ENTRY, MEGAKERNEL_MODULE, TASK_BYTES,
};
use kiln_runtime::cuda::CudaBackend;
use std::ffi::{c_void, CString};

fn ok(r: cu::CUresult, what: &str) {
    assert_eq!(r, cu::CUresult::CUDA_SUCCESS, "{what}");
}

fn gpu() -> bool {
    let present = CudaBackend::available();
    if !present {
        assert!(
            std::env::var("KILN_REQUIRE_CUDA").as_deref() != Ok("1"),
            "KILN_REQUIRE_CUDA=1 but no CUDA device is usable"
        );
        eprintln!("SKIPPED: no CUDA driver or device on this machine");
    }
    present
}

/// Device memory holding `bytes`.
fn upload(bytes: &[u8]) -> cu::CUdeviceptr {
    let mut p: cu::CUdeviceptr = 0;
    // SAFETY: a fresh allocation of the size copied into it.
    unsafe {
        ok(cu::cuMemAlloc_v2(&mut p, bytes.len().max(4)), "cuMemAlloc");
        ok(
            cu::cuMemcpyHtoD_v2(p, bytes.as_ptr() as *const c_void, bytes.len()),
            "cuMemcpyHtoD",
        );
    }
    p
}

fn download(p: cu::CUdeviceptr, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    // SAFETY: `p` holds at least `n` bytes (allocated by `upload`).
    unsafe {
        ok(
            cu::cuMemcpyDtoH_v2(v.as_mut_ptr() as *mut c_void, p, n),
            "cuMemcpyDtoH",
        )
    };
    v
}

fn bf16s(r: &mut kiln_ir::rng::SplitMix64, n: usize) -> Vec<half::bf16> {
    (0..n)
        .map(|_| half::bf16::from_f32(r.unit_f32() - 0.5))
        .collect()
}

fn bytes16(v: &[half::bf16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}

/// A plain GEMV tile's integers (`TaskKind::GemvBf16`): one token, `k`,
/// `n` output columns, no epilogue or norm prologue.
fn gemv_ints(k: usize, n: usize) -> [i32; 16] {
    let mut i = [0i32; 16];
    (i[0], i[1], i[2]) = (1, k as i32, n as i32);
    i
}

/// A GEMV tile's addresses: x, w, no bias / norm / residual, out.
fn gemv_ptrs(x: u64, w: u64, out: u64) -> [u64; 10] {
    let mut p = [0u64; 10];
    (p[0], p[1], p[5]) = (x, w, out);
    p
}

#[test]
fn two_chained_gemv_layers_on_two_queues_match_the_host_and_a_rerun_after_the_memset() {
    if !gpu() {
        return;
    }
    // SAFETY (whole test): driver calls on one thread with the device's
    // primary context current; every pointer passed is live.
    unsafe {
        ok(cu::cuInit(0), "cuInit");
        let mut dev: cu::CUdevice = 0;
        ok(cu::cuDeviceGet(&mut dev, 0), "cuDeviceGet");
        let mut ctx: cu::CUcontext = std::ptr::null_mut();
        ok(cu::cuDevicePrimaryCtxRetain(&mut ctx, dev), "retain");
        ok(cu::cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
        let (mut major, mut minor, mut sms) = (0, 0, 0);
        use cu::CUdevice_attribute as A;
        ok(
            cu::cuDeviceGetAttribute(
                &mut major,
                A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                dev,
            ),
            "major",
        );
        ok(
            cu::cuDeviceGetAttribute(
                &mut minor,
                A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                dev,
            ),
            "minor",
        );
        ok(
            cu::cuDeviceGetAttribute(&mut sms, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
            "SM count",
        );
        let sm = (major * 10 + minor) as u32;
        let sm = if sm >= 90 { 90 } else { 80 };
        let cubin = kiln_kernels::nvrtc::compile_module(&MEGAKERNEL_MODULE, sm)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut module: cu::CUmodule = std::ptr::null_mut();
        ok(
            cu::cuModuleLoadData(&mut module, cubin.as_ptr() as *const c_void),
            "cuModuleLoadData",
        );
        let name = CString::new(ENTRY).unwrap();
        let mut f: cu::CUfunction = std::ptr::null_mut();
        ok(
            cu::cuModuleGetFunction(&mut f, module, name.as_ptr()),
            ENTRY,
        );
        // Occupancy: both queues' blocks must be co-resident.
        let queues = 2u32;
        let mut per_sm = 0;
        ok(
            cu::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut per_sm,
                f,
                BLOCK_THREADS as i32,
                0,
            ),
            "occupancy",
        );
        assert!(
            per_sm >= 1 && (per_sm * sms) as u32 >= queues,
            "{per_sm} blocks/SM x {sms} SMs"
        );

        // y1[512] = W1[512, 256] x[256] (bf16), y2[256] = W2[256, 512] y1 (f32).
        let (k1, n1, n2) = (256usize, 512usize, 256usize);
        let mut r = kiln_ir::rng::SplitMix64::new(16);
        let x = bf16s(&mut r, k1);
        let w1 = bf16s(&mut r, n1 * k1);
        let w2 = bf16s(&mut r, n2 * n1);
        let (dx, dw1, dw2) = (
            upload(&bytes16(&x)),
            upload(&bytes16(&w1)),
            upload(&bytes16(&w2)),
        );
        let dy1 = upload(&vec![0xffu8; n1 * 2]);
        let dy2 = upload(&vec![0xffu8; n2 * 4]);
        let mut tasks = Vec::new();
        for i in 0..4u32 {
            let w = n1 as u32 / 4;
            tasks.push(DeviceTask {
                kind: TaskKind::GemvBf16,
                counter: i,
                wait_begin: 0,
                wait_count: 0,
                tile_begin: i * w,
                tile_end: (i + 1) * w,
                i: gemv_ints(k1, n1),
                f: [0.0; 4],
                p: gemv_ptrs(dx, dw1, dy1),
            });
        }
        for i in 0..4u32 {
            let w = n2 as u32 / 4;
            tasks.push(DeviceTask {
                kind: TaskKind::GemvBf16F32,
                counter: 4 + i,
                wait_begin: 0,
                wait_count: 4,
                tile_begin: i * w,
                tile_end: (i + 1) * w,
                i: gemv_ints(n1, n2),
                f: [0.0; 4],
                p: gemv_ptrs(dy1, dw2, dy2),
            });
        }
        let task_bytes: Vec<u8> = tasks.iter().flat_map(|t| t.to_bytes()).collect();
        assert_eq!(task_bytes.len(), 8 * TASK_BYTES);
        let waits: Vec<u8> = (0..4u32)
            .flat_map(|c| [c, 1])
            .flat_map(u32::to_le_bytes)
            .collect();
        // Queue 0: 0 2 4 6; queue 1: 1 3 5 7 (each in tape order).
        let starts: Vec<u8> = [0u32, 4, 8].iter().flat_map(|v| v.to_le_bytes()).collect();
        let order: Vec<u8> = [0u32, 2, 4, 6, 1, 3, 5, 7]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let (dt, ds, dq, dw) = (
            upload(&task_bytes),
            upload(&starts),
            upload(&order),
            upload(&waits),
        );
        let dc = upload(&[0u8; 32]);
        let run = || -> Vec<u8> {
            ok(cu::cuMemsetD32_v2(dc, 0, 8), "counter memset");
            let mut params: [u64; 6] = [dt, ds, dq, dw, dc, 0];
            let mut ptrs: Vec<*mut c_void> = params
                .iter_mut()
                .map(|p| p as *mut u64 as *mut c_void)
                .collect();
            ok(
                cu::cuLaunchKernel(
                    f,
                    queues,
                    1,
                    1,
                    BLOCK_THREADS,
                    1,
                    1,
                    0,
                    std::ptr::null_mut(),
                    ptrs.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
                "launch",
            );
            ok(
                cu::cuCtxSynchronize(),
                "synchronize (a hang here is a deadlock)",
            );
            let c = download(dc, 32);
            assert!(
                c.chunks(4).all(|w| w == 1u32.to_le_bytes()),
                "every task bumped once: {c:?}"
            );
            download(dy2, n2 * 4)
        };
        let first = run();
        assert_eq!(run(), first, "a rerun after the memset gives the same bits");
        // Host reference in f64 (y1 rounded to bf16 as the kernel stores it).
        let y1: Vec<f64> = (0..n1)
            .map(|j| {
                let s: f64 = (0..k1)
                    .map(|i| x[i].to_f64() * w1[j * k1 + i].to_f64())
                    .sum();
                half::bf16::from_f64(s).to_f64()
            })
            .collect();
        let got: Vec<f32> = first
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        for (j, g) in got.iter().enumerate() {
            let want: f64 = (0..n1).map(|i| y1[i] * w2[j * n1 + i].to_f64()).sum();
            // y1's bf16 rounding may differ by one ulp from the f64 sum.
            let tol = 0.05 + 0.01 * want.abs();
            assert!(
                (*g as f64 - want).abs() <= tol,
                "y2[{j}] = {g}, host {want}"
            );
        }
        for p in [dx, dw1, dw2, dy1, dy2, dt, ds, dq, dw, dc] {
            cu::cuMemFree_v2(p);
        }
        cu::cuModuleUnload(module);
        cu::cuDevicePrimaryCtxRelease_v2(dev);
    }
}
