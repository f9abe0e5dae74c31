//! The megakernel interpreter on a real GPU, kind by kind, against the CPU
//! reference kernels (`kiln_kernels::cpu::execute_on_vecs`): each case
//! builds the op's operands, runs its task(s) through `megakernel_run` (the
//! GEMV cases cut into tiles on several queues, with waits) and compares.
//! Every case runs twice, without and with the GEMV weight stage (dynamic
//! shared memory; K = 4096 tiles fill it exactly or overflow it, so part
//! of a tile is staged), and the two runs must agree bit for bit.
//!
//! Opt-in: runs only with `KILN_MK_GPU=1` (it needs a CUDA driver and
//! device); `KILN_MK_CUBIN=path` loads a prebuilt cubin of
//! `kernels/gpu/megakernel.cu` instead of compiling it with NVRTC.
#![cfg(feature = "nvrtc")]

use cudarc::driver::sys as cu;
use half::bf16;
use kiln_ir::{AttnAttrs, DType, Epilogue, Op, PreNorm, Rope, RopeScaling, Shape, TensorType};
use kiln_kernels::megakernel::{
    DeviceTask, TaskKind, BLOCK_THREADS, ENTRY, MEGAKERNEL_MODULE, WEIGHT_STAGE_BYTES,
};
use std::ffi::{c_void, CString};

fn ok(r: cu::CUresult, what: &str) {
    assert_eq!(r, cu::CUresult::CUDA_SUCCESS, "{what}");
}

struct Gpu {
    f: cu::CUfunction,
}

fn gpu() -> Option<Gpu> {
    if std::env::var("KILN_MK_GPU").as_deref() != Ok("1") {
        eprintln!("SKIPPED: set KILN_MK_GPU=1 on a machine with a CUDA device");
        return None;
    }
    // SAFETY: driver calls on this thread with the primary context current.
    unsafe {
        ok(cu::cuInit(0), "cuInit");
        let mut dev: cu::CUdevice = 0;
        ok(cu::cuDeviceGet(&mut dev, 0), "cuDeviceGet");
        let mut ctx: cu::CUcontext = std::ptr::null_mut();
        ok(cu::cuDevicePrimaryCtxRetain(&mut ctx, dev), "retain");
        ok(cu::cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
        let cubin = match std::env::var("KILN_MK_CUBIN") {
            Ok(p) => std::fs::read(p).expect("KILN_MK_CUBIN"),
            Err(_) => kiln_kernels::nvrtc::compile_module(&MEGAKERNEL_MODULE, 90).unwrap(),
        };
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
        ok(
            cu::cuFuncSetAttribute(
                f,
                cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                WEIGHT_STAGE_BYTES as i32,
            ),
            "the weight stage's dynamic shared memory",
        );
        Some(Gpu { f })
    }
}

/// A host image of one device buffer: operands placed 256-aligned.
#[derive(Default)]
struct Mem {
    bytes: Vec<u8>,
}

impl Mem {
    fn put(&mut self, data: &[u8]) -> u64 {
        let at = self.bytes.len().next_multiple_of(256);
        self.bytes.resize(at, 0);
        self.bytes.extend_from_slice(data);
        self.bytes.resize(self.bytes.len().next_multiple_of(256), 0);
        at as u64
    }
    fn zeros(&mut self, n: usize) -> u64 {
        self.put(&vec![0xa5; n])
    }
}

/// Runs `queues` (task lists; waits are (counter, target) per task) over
/// `mem`, returning the memory after the launch.
/// Runs the tasks twice, without dynamic shared memory and with the GEMV
/// weight stage the engine asks for (GEMV tiles with `i[7] = 1` whose rows
/// fit then read their weights from shared memory), checks the two runs
/// agree bit for bit, and returns the staged run's memory.
fn run(g: &Gpu, mem: &Mem, tasks: &[(DeviceTask, Vec<u32>)], queues: &[Vec<u32>]) -> Vec<u8> {
    let plain = run_once(g, mem, tasks, queues, 0);
    let staged = run_once(g, mem, tasks, queues, WEIGHT_STAGE_BYTES);
    if let Some(i) = plain.iter().zip(&staged).position(|(a, b)| a != b) {
        panic!("the weight-staged run differs from the unstaged run at byte {i}");
    }
    staged
}

fn run_once(
    g: &Gpu,
    mem: &Mem,
    tasks: &[(DeviceTask, Vec<u32>)],
    queues: &[Vec<u32>],
    shared: u32,
) -> Vec<u8> {
    let mut img = Mem::default();
    let mut data = mem.bytes.clone();
    data.resize(data.len().max(16), 0);
    let mut waits = Vec::new();
    let mut recs = Vec::new();
    for (t, w) in tasks {
        let mut t = *t;
        t.wait_begin = (waits.len() / 8) as u32;
        t.wait_count = w.len() as u32;
        for c in w {
            waits.extend_from_slice(&c.to_le_bytes());
            waits.extend_from_slice(&1u32.to_le_bytes());
        }
        recs.extend_from_slice(&t.to_bytes());
    }
    let mut starts = vec![0u32];
    let mut order = Vec::new();
    for q in queues {
        order.extend(q.iter().copied());
        starts.push(order.len() as u32);
    }
    let le = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (ta, sa, qa, wa) = (
        img.put(&recs),
        img.put(&le(&starts)),
        img.put(&le(&order)),
        img.put(&waits),
    );
    let ca = img.put(&vec![0u8; 4 * tasks.len()]);
    // SAFETY: fresh allocations of the sizes copied; pointers live.
    unsafe {
        let mut dm: cu::CUdeviceptr = 0;
        ok(cu::cuMemAlloc_v2(&mut dm, data.len()), "alloc");
        ok(
            cu::cuMemcpyHtoD_v2(dm, data.as_ptr() as *const c_void, data.len()),
            "upload",
        );
        let mut di: cu::CUdeviceptr = 0;
        ok(cu::cuMemAlloc_v2(&mut di, img.bytes.len()), "alloc");
        // Rebase the task records' pointers: they were written relative to 0.
        let mut ib = img.bytes.clone();
        for k in 0..tasks.len() {
            let at = ta as usize + k * 192;
            for s in 0..10 {
                let o = at + 112 + 8 * s;
                let p = u64::from_le_bytes(ib[o..o + 8].try_into().unwrap());
                if p != 0 {
                    ib[o..o + 8].copy_from_slice(&(p - 1 + dm).to_le_bytes());
                }
            }
        }
        ok(
            cu::cuMemcpyHtoD_v2(di, ib.as_ptr() as *const c_void, ib.len()),
            "upload",
        );
        let mut params: [u64; 6] = [di + ta, di + sa, di + qa, di + wa, di + ca, 0];
        let mut ptrs: Vec<*mut c_void> = params
            .iter_mut()
            .map(|p| p as *mut u64 as *mut c_void)
            .collect();
        ok(
            cu::cuLaunchKernel(
                g.f,
                queues.len() as u32,
                1,
                1,
                BLOCK_THREADS,
                1,
                1,
                shared,
                std::ptr::null_mut(),
                ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
            ),
            "launch",
        );
        ok(cu::cuCtxSynchronize(), "synchronize");
        let mut out = vec![0u8; data.len()];
        ok(
            cu::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, dm, out.len()),
            "download",
        );
        let mut c = vec![0u8; 4 * tasks.len()];
        ok(
            cu::cuMemcpyDtoH_v2(c.as_mut_ptr() as *mut c_void, di + ca, c.len()),
            "download",
        );
        assert!(
            c.chunks(4).all(|w| w == 1u32.to_le_bytes()),
            "counters {c:?}"
        );
        cu::cuMemFree_v2(dm);
        cu::cuMemFree_v2(di);
        out
    }
}

/// Pointer slot value for an offset in `Mem` (rebased by `run`; 0 = null).
fn at(off: u64) -> u64 {
    off + 1
}

fn rng(seed: u64) -> kiln_ir::rng::SplitMix64 {
    kiln_ir::rng::SplitMix64::new(seed)
}
fn bf16_bytes(r: &mut kiln_ir::rng::SplitMix64, n: usize, scale: f32) -> Vec<u8> {
    (0..n)
        .flat_map(|_| {
            bf16::from_f32((r.unit_f32() - 0.5) * scale)
                .to_bits()
                .to_le_bytes()
        })
        .collect()
}
fn ints(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn ty(d: DType, dims: &[u32]) -> TensorType {
    TensorType::new(d, Shape::new(dims.to_vec()))
}
fn f32s_of(d: DType, b: &[u8]) -> Vec<f32> {
    match d {
        DType::BF16 => b
            .chunks(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        DType::F32 => b
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::I32 => b
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as f32)
            .collect(),
        _ => unreachable!(),
    }
}
/// Element-wise closeness: bf16 results within a few ulps (sums reorder).
fn close(what: &str, d: DType, got: &[u8], want: &[u8]) {
    let (g, w) = (f32s_of(d, got), f32s_of(d, want));
    assert_eq!(g.len(), w.len());
    let mut worst = (0.0f32, 0usize);
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let tol = match d {
            DType::I32 => 0.0,
            DType::F32 => 1e-4 * b.abs().max(1.0),
            _ => 1.6e-2 * b.abs().max(0.05),
        };
        let e = (a - b).abs();
        assert!(
            e <= tol || (a.is_nan() && b.is_nan()),
            "{what}: element {i}: got {a}, want {b}"
        );
        if e > worst.0 {
            worst = (e, i);
        }
    }
    eprintln!(
        "{what}: {} elements ok (worst abs diff {} at {})",
        g.len(),
        worst.0,
        worst.1
    );
}

fn task(
    kind: TaskKind,
    counter: u32,
    tile: (u32, u32),
    i: &[i32],
    f: &[f32],
    p: &[u64],
) -> DeviceTask {
    let mut t = DeviceTask {
        kind,
        counter,
        wait_begin: 0,
        wait_count: 0,
        tile_begin: tile.0,
        tile_end: tile.1,
        i: [0; 16],
        f: [0.0; 4],
        p: [0; 10],
    };
    t.i[..i.len()].copy_from_slice(i);
    t.f[..f.len()].copy_from_slice(f);
    t.p[..p.len()].copy_from_slice(p);
    t
}

fn slice(mem: &[u8], off: u64, n: u64) -> Vec<u8> {
    mem[off as usize..(off + n) as usize].to_vec()
}

#[test]
fn every_task_kind_matches_the_cpu_reference() {
    let Some(g) = gpu() else { return };
    let bf = DType::BF16;
    let mut r = rng(7);

    // 1. matmul + bias, f32 logits, 10 tokens (two chunks of 8), 3 tiles on
    //    3 queues, then two argmax row tiles waiting on all three.
    {
        let (t, k, n) = (10u32, 264u32, 80u32);
        let x = bf16_bytes(&mut r, (t * k) as usize, 2.0);
        let w = bf16_bytes(&mut r, (n * k) as usize, 0.5);
        let b = bf16_bytes(&mut r, n as usize, 1.0);
        let mut m = Mem::default();
        let (xa, wa, ba) = (m.put(&x), m.put(&w), m.put(&b));
        let ya = m.zeros((t * n * 4) as usize);
        let ia = m.zeros((t * 4) as usize);
        // i[7]: a constant weight, staged in the second run.
        let ints = [t as i32, k as i32, n as i32, 0, 0, 0, 0, 1];
        let ptrs = [at(xa), at(wa), at(ba), 0, 0, at(ya)];
        let mut tasks = Vec::new();
        for (c, tile) in [(0, 32), (32, 64), (64, 80)].into_iter().enumerate() {
            tasks.push((
                task(TaskKind::GemvBf16F32, c as u32, tile, &ints, &[], &ptrs),
                vec![],
            ));
        }
        // The argmax cut into row tiles of 4 and 6 rows.
        for (c, rows) in [(3u32, (0u32, 4u32)), (4, (4, t))] {
            tasks.push((
                task(
                    TaskKind::Argmax,
                    c,
                    rows,
                    &[t as i32, n as i32, 1],
                    &[],
                    &[at(ya), at(ia)],
                ),
                vec![0, 1, 2],
            ));
        }
        let out = run(&g, &m, &tasks, &[vec![0], vec![1, 3], vec![2, 4]]);
        let op = Op::MatMul {
            bias: true,
            out: DType::F32,
        };
        let want = kiln_kernels::cpu::execute_on_vecs(
            &op,
            &[
                (ty(bf, &[t, k]), x),
                (ty(bf, &[n, k]), w),
                (ty(bf, &[n]), b),
            ],
        )
        .unwrap();
        let got = slice(&out, ya, (t * n * 4) as u64);
        close("matmul f32", DType::F32, &got, &want[0]);
        let am = kiln_kernels::cpu::execute_on_vecs(
            &Op::Argmax,
            &[(ty(DType::F32, &[t, n]), got.clone())],
        )
        .unwrap();
        close(
            "argmax",
            DType::I32,
            &slice(&out, ia, (t * 4) as u64),
            &am[0],
        );
    }

    // 2. fused_matmul: RMSNorm prologue (unit offset) + silu_mul, gelu,
    //    residual, argmax; at one token (the TT = 1 body), three, and five
    //    tokens of K = 4096 (the staged activations hold four such tokens,
    //    so the task takes two chunks).
    // K = 4096 at 40 rows fills the weight stage exactly (two tiles of
    // 20 rows, or of 10 gated row pairs, of 8 KiB); at 96 rows only the
    // first 20 rows (10 pairs) of each tile are staged and the rest stream.
    for (t, k, n) in [
        (1u32, 512u32, 96u32),
        (3, 512, 96),
        (5, 4096, 40),
        (1, 4096, 96),
    ] {
        for post in [
            Epilogue::SiluMul,
            Epilogue::GeluTanhMul,
            Epilogue::Residual,
            Epilogue::Argmax,
        ] {
            for pre in [false, true] {
                let x = bf16_bytes(&mut r, (t * k) as usize, 2.0);
                let w = bf16_bytes(&mut r, (n * k) as usize, 0.2);
                let nw = bf16_bytes(&mut r, k as usize, 1.0);
                let cols = if matches!(post, Epilogue::SiluMul | Epilogue::GeluTanhMul) {
                    n / 2
                } else {
                    n
                };
                let res = bf16_bytes(&mut r, (t * cols) as usize, 1.0);
                let mut m = Mem::default();
                let (xa, wa, na, ra) = (m.put(&x), m.put(&w), m.put(&nw), m.put(&res));
                let ya = m.zeros((t * cols * 2) as usize);
                let mode = match post {
                    Epilogue::SiluMul => 1,
                    Epilogue::GeluTanhMul => 2,
                    Epilogue::Residual => 3,
                    _ => 0,
                };
                let (kind, ints, units) = if post == Epilogue::Argmax {
                    (
                        TaskKind::GemvArgmax,
                        vec![t as i32, k as i32, n as i32, 0, pre as i32, 1],
                        1,
                    )
                } else {
                    let up = if mode == 1 || mode == 2 {
                        cols as i32
                    } else {
                        0
                    };
                    (
                        TaskKind::GemvBf16,
                        vec![t as i32, k as i32, cols as i32, mode, pre as i32, 1, up, 1],
                        cols,
                    )
                };
                let ptrs = [
                    at(xa),
                    at(wa),
                    0,
                    if pre { at(na) } else { 0 },
                    if mode == 3 { at(ra) } else { 0 },
                    at(ya),
                ];
                let mut tasks = Vec::new();
                let mut queues = vec![vec![], vec![]];
                let step = units.div_ceil(2).max(1);
                let mut b0 = 0;
                while b0 < units {
                    let c = tasks.len() as u32;
                    tasks.push((
                        task(kind, c, (b0, (b0 + step).min(units)), &ints, &[1e-5], &ptrs),
                        vec![],
                    ));
                    queues[c as usize % 2].push(c);
                    b0 += step;
                }
                let out = run(&g, &m, &tasks, &queues);
                let op = Op::FusedMatMul {
                    bias: false,
                    out: bf,
                    pre: pre.then_some(PreNorm {
                        eps: 1e-5,
                        unit_offset: true,
                    }),
                    post,
                };
                let mut args = vec![(ty(bf, &[t, k]), x), (ty(bf, &[n, k]), w)];
                if pre {
                    args.push((ty(bf, &[k]), nw));
                }
                if post == Epilogue::Residual {
                    args.push((ty(bf, &[t, n]), res));
                }
                let want = kiln_kernels::cpu::execute_on_vecs(&op, &args).unwrap();
                let what = format!("fused_matmul {post:?} pre {pre} T {t} K {k}");
                if post == Epilogue::Argmax {
                    close(
                        &what,
                        DType::I32,
                        &slice(&out, ya, (t * 4) as u64),
                        &want[0],
                    );
                } else {
                    close(&what, bf, &slice(&out, ya, (t * cols * 2) as u64), &want[0]);
                }
            }
        }
    }

    // 3. embedding (one id out of range -> zeros on the GPU, skipped here),
    //    rms_norm, add_rms_norm.
    {
        let (t, h, v) = (3u32, 320u32, 50u32);
        let table = bf16_bytes(&mut r, (v * h) as usize, 1.0);
        let idv = [4, 49, 0];
        let mut m = Mem::default();
        let (ia, ta) = (m.put(&ints(&idv)), m.put(&table));
        let ea = m.zeros((t * h * 2) as usize);
        let w = bf16_bytes(&mut r, h as usize, 1.0);
        let x2 = bf16_bytes(&mut r, (t * h) as usize, 3.0);
        let wa = m.put(&w);
        let x2a = m.put(&x2);
        let na = m.zeros((t * h * 2) as usize);
        let n2a = m.zeros((t * h * 2) as usize);
        let sa = m.zeros((t * h * 2) as usize);
        let tasks = vec![
            (
                task(
                    TaskKind::Embedding,
                    0,
                    (0, 1),
                    &[t as i32, h as i32, v as i32],
                    &[],
                    &[at(ia), at(ta), at(ea)],
                ),
                vec![],
            ),
            (
                task(
                    TaskKind::RmsNorm,
                    1,
                    (0, 1),
                    &[t as i32, h as i32, 1],
                    &[1e-6],
                    &[at(ea), at(wa), at(na)],
                ),
                vec![0],
            ),
            (
                task(
                    TaskKind::AddRmsNorm,
                    2,
                    (0, 1),
                    &[t as i32, h as i32, 0],
                    &[1e-5],
                    &[at(ea), at(x2a), at(wa), at(n2a), at(sa)],
                ),
                vec![0],
            ),
        ];
        let out = run(&g, &m, &tasks, &[vec![0, 2], vec![1]]);
        let e = kiln_kernels::cpu::execute_on_vecs(
            &Op::Embedding,
            &[(ty(DType::I32, &[t]), ints(&idv)), (ty(bf, &[v, h]), table)],
        )
        .unwrap();
        close("embedding", bf, &slice(&out, ea, (t * h * 2) as u64), &e[0]);
        let n1 = kiln_kernels::cpu::execute_on_vecs(
            &Op::RmsNorm {
                eps: 1e-6,
                unit_offset: true,
            },
            &[(ty(bf, &[t, h]), e[0].clone()), (ty(bf, &[h]), w.clone())],
        )
        .unwrap();
        close("rms_norm", bf, &slice(&out, na, (t * h * 2) as u64), &n1[0]);
        let n2 = kiln_kernels::cpu::execute_on_vecs(
            &Op::AddRmsNorm {
                eps: 1e-5,
                unit_offset: false,
            },
            &[
                (ty(bf, &[t, h]), e[0].clone()),
                (ty(bf, &[t, h]), x2),
                (ty(bf, &[h]), w),
            ],
        )
        .unwrap();
        close(
            "add_rms_norm normed",
            bf,
            &slice(&out, n2a, (t * h * 2) as u64),
            &n2[0],
        );
        close(
            "add_rms_norm sum",
            bf,
            &slice(&out, sa, (t * h * 2) as u64),
            &n2[1],
        );
    }

    // 4. qkv_rope_kv_write with q/k norm, cut into tiles of its heads + 2
    //    units (q heads, then the K unit, then the V unit) on two queues,
    //    then paged attention over the caches it wrote (GQA, query 2 and
    //    decode, window, softcap), tiled by (sequence, query head) in
    //    uneven tiles, one crossing from the first sequence into the second.
    //    The rope tilings: whole (all ten units), q heads apart from a
    //    K+V tile, a tile mixing q heads with the K unit, one unit each.
    //    Then the same attention split over the context (attention_partials
    //    in three runs, attention_combine).
    let rope_tilings: [&[(u32, u32)]; 5] = [
        &[(0, 10)],
        &[(0, 3), (3, 8), (8, 10)],
        &[(0, 5), (5, 9), (9, 10)],
        &[
            (0, 1),
            (1, 2),
            (2, 3),
            (3, 4),
            (4, 5),
            (5, 6),
            (6, 7),
            (7, 8),
            (8, 9),
            (9, 10),
        ],
        &[(0, 8), (8, 9), (9, 10)],
    ];
    for ((hd, window, softcap, qk, q), rope_tiles) in [
        (64u32, Some(24u32), Some(30.0f32), true, 2u32),
        (128, None, None, false, 2),
        (256, Some(40), None, true, 2),
        (64, Some(24), Some(30.0), true, 1),
        (128, None, None, false, 1),
    ]
    .into_iter()
    .zip(rope_tilings)
    {
        let (batch, heads, kvh, bs, mb) = (2u32, 8u32, 2u32, 16u32, 4u32);
        let t = batch * q;
        let slots_n = 8 * bs;
        let rope = Rope {
            theta: 10000.0,
            scaling: RopeScaling::None,
        };
        let qkv = bf16_bytes(&mut r, (t * (heads + 2 * kvh) * hd) as usize, 2.0);
        let kc = bf16_bytes(&mut r, (slots_n * kvh * hd) as usize, 2.0);
        let vc = bf16_bytes(&mut r, (slots_n * kvh * hd) as usize, 2.0);
        let qn = bf16_bytes(&mut r, hd as usize, 1.0);
        let kn = bf16_bytes(&mut r, hd as usize, 1.0);
        // Sequence 0: 37 tokens in blocks 3, 1, 6; sequence 1: 20 in 2, 5.
        let lens = [37, 20];
        let tables = [3, 1, 6, 0, 2, 5, 0, 0];
        let pos: Vec<i32> = if q == 2 {
            vec![35, 36, 18, 19]
        } else {
            vec![36, 19]
        };
        let slot = |b: usize, p: i32| tables[b * 4 + (p / 16) as usize] * 16 + p % 16;
        let slots: Vec<i32> = pos
            .iter()
            .enumerate()
            .map(|(i, &p)| slot(i / q as usize, p))
            .collect();
        let freqs = kiln_kernels::gpu::rope_freqs_blob(&rope, hd);
        let mut m = Mem::default();
        let (qa, pa, sla, ka, va, qna, kna, fa) = (
            m.put(&qkv),
            m.put(&ints(&pos)),
            m.put(&ints(&slots)),
            m.put(&kc),
            m.put(&vc),
            m.put(&qn),
            m.put(&kn),
            m.put(&freqs),
        );
        let qo = m.zeros((t * heads * hd * 2) as usize);
        let (ba, la) = (m.put(&ints(&tables)), m.put(&ints(&lens)));
        let oa = m.zeros((t * heads * hd * 2) as usize);
        assert_eq!(heads + 2, 10);
        // An attention task's integers (runs 0: plain paged_attention).
        let attn_ints = |runs: u32| {
            [
                batch as i32,
                q as i32,
                heads as i32,
                kvh as i32,
                hd as i32,
                bs as i32,
                mb as i32,
                window.unwrap_or(0) as i32,
                runs as i32,
            ]
        };
        let nr = rope_tiles.len() as u32;
        let mut tasks: Vec<(DeviceTask, Vec<u32>)> = rope_tiles
            .iter()
            .enumerate()
            .map(|(c, &tile)| {
                (
                    task(
                        TaskKind::QkvRopeKvWrite,
                        c as u32,
                        tile,
                        &[
                            t as i32,
                            heads as i32,
                            kvh as i32,
                            hd as i32,
                            qk as i32,
                            1,
                            slots_n as i32,
                        ],
                        &[1e-6],
                        &[
                            at(qa),
                            at(pa),
                            at(sla),
                            at(ka),
                            at(va),
                            if qk { at(qna) } else { 0 },
                            if qk { at(kna) } else { 0 },
                            at(qo),
                            at(fa),
                        ],
                    ),
                    vec![],
                )
            })
            .collect();
        for (c, tile) in [(0u32, 5u32), (5, 11), (11, 16)].into_iter().enumerate() {
            tasks.push((
                task(
                    TaskKind::PagedAttention,
                    nr + c as u32,
                    tile,
                    &attn_ints(0),
                    &[0.125, softcap.unwrap_or(0.0)],
                    &[at(qo), at(ka), at(va), at(ba), at(la), at(oa)],
                ),
                (0..nr).collect(),
            ));
        }
        assert_eq!(batch * heads, 16);
        // Rope tiles alternate between the queues (each queue in tape
        // order), attention tasks after them.
        let mut queues = vec![Vec::new(), Vec::new()];
        for i in 0..nr {
            queues[(i % 2) as usize].push(i);
        }
        queues[0].extend([nr + 1]);
        queues[1].extend([nr, nr + 2]);
        let out = run(&g, &m, &tasks, &queues);
        let op = Op::QkvRopeKvWrite {
            heads,
            kv_heads: kvh,
            head_dim: hd,
            rope,
            qk_norm: qk.then_some(1e-6),
            unit_offset: true,
        };
        let mut args = vec![
            (ty(bf, &[t, (heads + 2 * kvh) * hd]), qkv),
            (ty(DType::I32, &[t]), ints(&pos)),
            (ty(DType::I32, &[t]), ints(&slots)),
            (ty(bf, &[slots_n, kvh * hd]), kc),
            (ty(bf, &[slots_n, kvh * hd]), vc),
        ];
        if qk {
            args.push((ty(bf, &[hd]), qn));
            args.push((ty(bf, &[hd]), kn));
        }
        let w = kiln_kernels::cpu::execute_on_vecs(&op, &args).unwrap();
        let cache = (slots_n * kvh * hd * 2) as u64;
        let what = format!("qkv_rope_kv_write hd {hd}");
        close(
            &format!("{what} q"),
            bf,
            &slice(&out, qo, (t * heads * hd * 2) as u64),
            &w[0],
        );
        close(
            &format!("{what} k cache"),
            bf,
            &slice(&out, ka, cache),
            &w[1],
        );
        close(
            &format!("{what} v cache"),
            bf,
            &slice(&out, va, cache),
            &w[2],
        );
        let op = Op::PagedAttention(AttnAttrs {
            heads,
            kv_heads: kvh,
            head_dim: hd,
            query: q,
            block_size: bs,
            scale: 0.125,
            window,
            softcap,
        });
        let a = kiln_kernels::cpu::execute_on_vecs(
            &op,
            &[
                (ty(bf, &[t, heads * hd]), w[0].clone()),
                (ty(bf, &[slots_n, kvh * hd]), w[1].clone()),
                (ty(bf, &[slots_n, kvh * hd]), w[2].clone()),
                (ty(DType::I32, &[batch, mb]), ints(&tables)),
                (ty(DType::I32, &[batch]), ints(&lens)),
            ],
        )
        .unwrap();
        close(
            &format!("paged_attention hd {hd} query {q} window {window:?} softcap {softcap:?}"),
            bf,
            &slice(&out, oa, (t * heads * hd * 2) as u64),
            &a[0],
        );

        // The same attention split over the context in 3 runs
        // (attention_partials in uneven tiles, one crossing sequences),
        // then attention_combine in two tiles waiting on every run.
        let runs = 3u32;
        let attn = AttnAttrs {
            heads,
            kv_heads: kvh,
            head_dim: hd,
            query: q,
            block_size: bs,
            scale: 0.125,
            window,
            softcap,
        };
        let width = heads * runs * (hd + 2);
        let mut m = Mem::default();
        let (qa, ka, va, ba, la) = (
            m.put(&w[0]),
            m.put(&w[1]),
            m.put(&w[2]),
            m.put(&ints(&tables)),
            m.put(&ints(&lens)),
        );
        let pa = m.zeros((t * width * 4) as usize);
        let oa = m.zeros((t * heads * hd * 2) as usize);
        let units = batch * heads * runs;
        let mut tasks = Vec::new();
        for (c, tile) in [(0u32, 7u32), (7, 29), (29, units)].into_iter().enumerate() {
            tasks.push((
                task(
                    TaskKind::PagedAttention,
                    c as u32,
                    tile,
                    &attn_ints(runs),
                    &[0.125, softcap.unwrap_or(0.0)],
                    &[at(qa), at(ka), at(va), at(ba), at(la), at(pa)],
                ),
                vec![],
            ));
        }
        for (c, tile) in [(0u32, 5u32), (5, t * heads)].into_iter().enumerate() {
            tasks.push((
                task(
                    TaskKind::AttentionCombine,
                    3 + c as u32,
                    tile,
                    &[t as i32, heads as i32, hd as i32, runs as i32],
                    &[],
                    &[at(pa), at(oa)],
                ),
                vec![0, 1, 2],
            ));
        }
        let out = run(&g, &m, &tasks, &[vec![0, 3], vec![1, 4], vec![2]]);
        let split_args = [
            (ty(bf, &[t, heads * hd]), w[0].clone()),
            (ty(bf, &[slots_n, kvh * hd]), w[1].clone()),
            (ty(bf, &[slots_n, kvh * hd]), w[2].clone()),
            (ty(DType::I32, &[batch, mb]), ints(&tables)),
            (ty(DType::I32, &[batch]), ints(&lens)),
        ];
        let parts = kiln_kernels::cpu::execute_on_vecs(
            &Op::AttentionPartials { attn, parts: runs },
            &split_args,
        )
        .unwrap();
        let want = kiln_kernels::cpu::execute_on_vecs(
            &Op::AttentionCombine {
                heads,
                head_dim: hd,
                parts: runs,
                out: bf,
            },
            &[(ty(DType::F32, &[t, width]), parts[0].clone())],
        )
        .unwrap();
        close(
            &format!("split attention hd {hd} query {q} window {window:?} softcap {softcap:?}"),
            bf,
            &slice(&out, oa, (t * heads * hd * 2) as u64),
            &want[0],
        );
    }

    // 5. silu_mul packed in place, gelu_tanh_mul, add, scale (f32, softcap),
    //    gather_last.
    {
        let (t, i) = (3u32, 200u32);
        let gu = bf16_bytes(&mut r, (t * 2 * i) as usize, 6.0);
        let a = bf16_bytes(&mut r, (t * i) as usize, 6.0);
        let b = bf16_bytes(&mut r, (t * i) as usize, 6.0);
        let lf: Vec<u8> = (0..t * 256)
            .flat_map(|_| ((r.unit_f32() - 0.5) * 200.0).to_le_bytes())
            .collect();
        let mut m = Mem::default();
        let (gua, aa, bba, lfa) = (m.put(&gu), m.put(&a), m.put(&b), m.put(&lf));
        let (ga, ada, sca, gla) = (
            m.zeros((t * i * 2) as usize),
            m.zeros((t * i * 2) as usize),
            m.zeros((t * 256 * 4) as usize),
            m.zeros((i * 2) as usize),
        );
        let tasks = vec![
            (
                task(
                    TaskKind::SiluMul,
                    0,
                    (0, 1),
                    &[t as i32, i as i32, 1],
                    &[],
                    &[at(gua), 0, at(gua)],
                ),
                vec![],
            ),
            (
                task(
                    TaskKind::GeluTanhMul,
                    1,
                    (0, 1),
                    &[t as i32, i as i32, 0],
                    &[],
                    &[at(aa), at(bba), at(ga)],
                ),
                vec![],
            ),
            (
                task(
                    TaskKind::Add,
                    2,
                    (0, 1),
                    &[(t * i) as i32],
                    &[],
                    &[at(aa), at(bba), at(ada)],
                ),
                vec![],
            ),
            (
                task(
                    TaskKind::Scale,
                    3,
                    (0, 1),
                    &[(t * 256) as i32, 1, 1],
                    &[1.0, 30.0],
                    &[at(lfa), at(sca)],
                ),
                vec![],
            ),
            (
                task(
                    TaskKind::GatherLast,
                    4,
                    (0, 1),
                    &[1, 3, i as i32],
                    &[],
                    &[at(aa), at(gla)],
                ),
                vec![1, 2],
            ),
        ];
        let out = run(&g, &m, &tasks, &[vec![0, 3], vec![1, 2, 4]]);
        let s =
            kiln_kernels::cpu::execute_on_vecs(&Op::SiluMul, &[(ty(bf, &[t, 2 * i]), gu)]).unwrap();
        close(
            "silu_mul packed in place",
            bf,
            &slice(&out, gua, (t * i * 2) as u64),
            &s[0],
        );
        let two = [(ty(bf, &[t, i]), a.clone()), (ty(bf, &[t, i]), b)];
        let ge = kiln_kernels::cpu::execute_on_vecs(&Op::GeluTanhMul, &two).unwrap();
        close(
            "gelu_tanh_mul",
            bf,
            &slice(&out, ga, (t * i * 2) as u64),
            &ge[0],
        );
        let ad = kiln_kernels::cpu::execute_on_vecs(&Op::Add, &two).unwrap();
        close("add", bf, &slice(&out, ada, (t * i * 2) as u64), &ad[0]);
        let sc = kiln_kernels::cpu::execute_on_vecs(
            &Op::Scale {
                factor: 1.0,
                softcap: Some(30.0),
            },
            &[(ty(DType::F32, &[t, 256]), lf)],
        )
        .unwrap();
        close(
            "scale",
            DType::F32,
            &slice(&out, sca, (t * 256 * 4) as u64),
            &sc[0],
        );
        let gl = kiln_kernels::cpu::execute_on_vecs(
            &Op::GatherLast { group: 3 },
            &[(ty(bf, &[t, i]), a)],
        )
        .unwrap();
        close("gather_last", bf, &slice(&out, gla, (i * 2) as u64), &gl[0]);
    }
}
