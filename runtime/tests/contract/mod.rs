//! The backend contract (ARCHITECTURE.md, "The capture contract"): one test
//! body per property, generic over [`Target`], instantiated per backend by
//! [`contract_tests!`] in thin test files (cpu, the simulated GPU driver in a
//! CUDA and a HIP flavour, the real CUDA driver when a device is present).
//!
//! A [`Target`] opens a backend with its kernels loaded and builds the
//! launches the bodies need in that backend's form (a reference op on the
//! CPU, resolved kernel lists and BLAS-Lt GEMMs on a GPU), so every body runs
//! unchanged on every backend.

#![allow(dead_code)]

use kiln_ir::{DType, Key, TensorType};
use kiln_runtime::backend::{Backend, BackendError, DevOperand, DevPtr, Launch};

/// A backend under test and the launches it understands.
pub trait Target {
    type B: Backend;
    /// A fresh backend with its kernels loaded.
    fn open(&self) -> Self::B;
    /// `c[i] = a[i] + b[i]` over `n` f32.
    fn add(&self, a: DevPtr, b: DevPtr, c: DevPtr, n: u32) -> Launch;
    /// `out[t, n] = x[t, k] @ w[n, k]^T`, f32, using `ws` as its workspace.
    fn gemm(&self, ops: Gemm, ws: Option<(DevPtr, u64)>) -> Launch;
    /// Graph replays the backend has counted.
    fn replays(&self, b: &Self::B) -> u64;
    /// Makes the backend's GEMM algorithm need `bytes` of workspace; false
    /// where the target cannot (the test is then not instantiated for it).
    fn require_workspace(&self, b: &mut Self::B, bytes: u64) -> bool;
}

/// Operands of an f32 GEMM.
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    pub x: DevPtr,
    pub w: DevPtr,
    pub out: DevPtr,
    pub t: u32,
    pub n: u32,
    pub k: u32,
}

impl Gemm {
    /// The BLAS-Lt shape of these operands.
    pub fn shape(self) -> kiln_ir::plan::GemmShape {
        kiln_ir::plan::GemmShape {
            t: self.t,
            n: self.n,
            k: self.k,
            dtype: DType::F32,
            out: DType::F32,
            bias: false,
        }
    }

    /// The f32 matmul launch over these operands; `body` is what each
    /// target varies (reference kernel, BLAS call, skinny-GEMM alternative).
    pub fn launch(
        self,
        ws: Option<(DevPtr, u64)>,
        body: kiln_runtime::backend::LaunchBody,
    ) -> Launch {
        Launch {
            kernel: "matmul_f32".into(),
            op: kiln_ir::Op::MatMul {
                bias: false,
                out: DType::F32,
            },
            args: vec![
                f32_operand(self.x, vec![self.t, self.k]),
                f32_operand(self.w, vec![self.n, self.k]),
            ],
            results: vec![f32_operand(self.out, vec![self.t, self.n])],
            workspace: ws,
            const_args: 0b10,
            body,
        }
    }
}

pub fn f32_operand(ptr: DevPtr, shape: Vec<u32>) -> DevOperand {
    DevOperand {
        ptr,
        ty: TensorType::new(DType::F32, shape),
    }
}

pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Small integers as f32, so sums and dot products are exact.
    pub fn f32s(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| (self.next() % 17) as f32 - 8.0).collect()
    }
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn put<B: Backend>(b: &mut B, v: &[f32]) -> DevPtr {
    let p = b.alloc(v.len() as u64 * 4, "input").unwrap();
    b.upload(p, &f32_bytes(v)).unwrap();
    p
}

fn get<B: Backend>(b: &mut B, p: DevPtr, n: usize) -> Vec<f32> {
    let mut out = vec![0u8; n * 4];
    b.download(p, &mut out).unwrap();
    bytes_f32(&out)
}

fn host_gemm(x: &[f32], w: &[f32], (t, n, k): (usize, usize, usize)) -> Vec<f32> {
    let mut o = vec![0.0; t * n];
    for i in 0..t {
        for j in 0..n {
            o[i * n + j] = (0..k).map(|l| x[i * k + l] * w[j * k + l]).sum();
        }
    }
    o
}

/// A capture-contract error for `key` naming `call` (backends may add
/// detail after the name, e.g. `alloc(16 bytes for x)`).
pub fn is_contract_error(e: &BackendError, key: Key, call: &str) -> bool {
    matches!(e, BackendError::CaptureContract { key: k, call: c, .. } if *k == key && c.starts_with(call))
}

/// Bytes uploaded at any offset of an allocation download unchanged, and new
/// allocations are zeroed.
pub fn uploads_download_unchanged<T: Target>(t: &T) {
    let mut b = t.open();
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for size in [1u64, 3, 256, 4097, 1 << 16] {
        let p = b.alloc(size, "roundtrip").unwrap();
        let mut zeros = vec![0xffu8; size as usize];
        b.download(p, &mut zeros).unwrap();
        assert!(zeros.iter().all(|&x| x == 0), "alloc({size}) is zeroed");
        let data = rng.bytes(size as usize);
        b.upload(p, &data).unwrap();
        let off = size / 3;
        let tail = rng.bytes((size - off) as usize);
        b.upload(p.offset(off), &tail).unwrap();
        let mut out = vec![0u8; size as usize];
        b.download(p, &mut out).unwrap();
        assert_eq!(&out[..off as usize], &data[..off as usize]);
        assert_eq!(&out[off as usize..], &tail[..]);
        b.free(p).unwrap();
    }
}

/// Copies outside live allocations are refused, freed memory included.
pub fn copies_outside_allocations_are_bad_addresses<T: Target>(t: &T) {
    let mut b = t.open();
    let p = b.alloc(64, "bounds").unwrap();
    assert!(matches!(
        b.upload(p.offset(60), &[0; 8]),
        Err(BackendError::BadAddress(_))
    ));
    let mut out = [0u8; 65];
    assert!(matches!(
        b.download(p, &mut out),
        Err(BackendError::BadAddress(_))
    ));
    b.free(p).unwrap();
    assert!(matches!(
        b.upload(p, &[1]),
        Err(BackendError::BadAddress(_))
    ));
    assert!(matches!(b.free(p), Err(BackendError::BadAddress(_))));
}

/// Inside a capture, alloc, free, synchronize, download, upload,
/// reserve_workspace, replay and timing marks fail naming the key and the
/// call; afterwards the backend works eagerly again with memory intact.
pub fn forbidden_calls_inside_a_capture_name_key_and_call<T: Target>(t: &T) {
    let mut b = t.open();
    let key = Key::new(3, 2, 1);
    let p = b.alloc(256, "before capture").unwrap();
    b.upload(p, &[1, 2, 3, 4]).unwrap();
    let l = t.add(p, p, p.offset(128), 16);
    b.prepare(&l).unwrap();
    b.begin_capture(Key::new(1, 1, 0)).unwrap();
    b.launch(&l).unwrap();
    let g = b.end_capture().unwrap();
    b.begin_capture(key).unwrap();
    let e = b.alloc(16, "inside").unwrap_err();
    assert!(is_contract_error(&e, key, "alloc"), "{e:?}");
    let e = b.free(p).unwrap_err();
    assert!(is_contract_error(&e, key, "free"), "{e:?}");
    let e = b.synchronize().unwrap_err();
    assert!(is_contract_error(&e, key, "synchronize"), "{e:?}");
    let e = b.download(p, &mut [0u8; 4]).unwrap_err();
    assert!(is_contract_error(&e, key, "download"), "{e:?}");
    let e = b.upload(p, &[9, 9, 9, 9]).unwrap_err();
    assert!(is_contract_error(&e, key, "upload"), "{e:?}");
    assert!(e.to_string().contains("b3q2s1"), "{e}");
    let e = b.reserve_workspace(1 << 20).unwrap_err();
    assert!(is_contract_error(&e, key, "reserve_workspace"), "{e:?}");
    let e = b.replay(g).unwrap_err();
    assert!(is_contract_error(&e, key, "replay"), "{e:?}");
    let e = b.mark().unwrap_err();
    assert!(
        matches!(&e, BackendError::CaptureContract { key: k, .. } if *k == key),
        "{e:?}"
    );
    b.abort_capture().unwrap();
    // Eager again: the refused calls work and memory is intact.
    let q = b.alloc(16, "after capture").unwrap();
    b.synchronize().unwrap();
    let mut out = [0u8; 4];
    b.download(p, &mut out).unwrap();
    assert_eq!(out, [1, 2, 3, 4], "a refused upload wrote nothing");
    b.destroy_graph(g).unwrap();
    b.free(q).unwrap();
    b.free(p).unwrap();
}

/// Captures do not nest, and ending one that was never begun is an error.
pub fn captures_do_not_nest<T: Target>(t: &T) {
    let mut b = t.open();
    assert!(b.end_capture().is_err());
    let key = Key::new(1, 1, 0);
    b.begin_capture(key).unwrap();
    let e = b.begin_capture(Key::new(2, 1, 0)).unwrap_err();
    assert!(is_contract_error(&e, key, "begin_capture"), "{e:?}");
    b.abort_capture().unwrap();
    b.begin_capture(Key::new(2, 1, 0)).unwrap();
    b.abort_capture().unwrap();
}

/// A captured add, replayed with fresh inputs uploaded to the captured
/// addresses every step, computes the fresh sum (the graph reads its inputs
/// at replay, not at capture), equal to the eager result, and the replay
/// counter moves once per replay.
pub fn replay_reads_fresh_inputs_at_the_captured_addresses<T: Target>(t: &T) {
    let mut b = t.open();
    let n = 1000u32;
    let bytes = n as u64 * 4;
    let (x, y, z) = (
        b.alloc(bytes, "x").unwrap(),
        b.alloc(bytes, "y").unwrap(),
        b.alloc(bytes, "z").unwrap(),
    );
    let launch = t.add(x, y, z, n);
    b.prepare(&launch).unwrap();
    let mut rng = Rng(0xdead_beef_0bad_cafe);
    let key = Key::new(1, 1, 0);
    b.begin_capture(key).unwrap();
    b.launch(&launch).unwrap();
    let g = b.end_capture().unwrap();
    let before = t.replays(&b);
    for step in 0..4 {
        let (a, c) = (rng.f32s(n as usize), rng.f32s(n as usize));
        b.upload(x, &f32_bytes(&a)).unwrap();
        b.upload(y, &f32_bytes(&c)).unwrap();
        b.launch(&launch).unwrap();
        let eager = get(&mut b, z, n as usize);
        b.upload(z, &vec![0u8; bytes as usize]).unwrap();
        b.replay(g).unwrap();
        let replayed = get(&mut b, z, n as usize);
        let want: Vec<f32> = a.iter().zip(&c).map(|(p, q)| p + q).collect();
        assert_eq!(eager, want, "eager step {step}");
        assert_eq!(replayed, eager, "replay {step} against eager");
    }
    assert_eq!(t.replays(&b) - before, 4, "the replay counter moved");
    b.destroy_graph(g).unwrap();
    assert!(b.replay(g).is_err(), "a destroyed graph cannot be replayed");
}

/// A captured GEMM replays with fresh activations at fixed addresses and
/// matches the eager GEMM and a host reference.
pub fn captured_gemm_replays_fresh_activations<T: Target>(t: &T) {
    let mut b = t.open();
    let (tt, n, k) = (3u32, 8u32, 16u32);
    let ws = b.reserve_workspace(1 << 16).unwrap();
    let mut rng = Rng(0x5eed);
    let w = rng.f32s((n * k) as usize);
    let wp = put(&mut b, &w);
    let x = b.alloc((tt * k) as u64 * 4, "x").unwrap();
    let out = b.alloc((tt * n) as u64 * 4, "out").unwrap();
    let ops = Gemm {
        x,
        w: wp,
        out,
        t: tt,
        n,
        k,
    };
    let l = t.gemm(ops, ws);
    b.prepare(&l).unwrap();
    b.begin_capture(Key::new(3, 1, 0)).unwrap();
    b.launch(&l).unwrap();
    let g = b.end_capture().unwrap();
    for step in 0..3 {
        let xs = rng.f32s((tt * k) as usize);
        b.upload(x, &f32_bytes(&xs)).unwrap();
        b.launch(&l).unwrap();
        let eager = get(&mut b, out, (tt * n) as usize);
        b.upload(out, &vec![0u8; (tt * n) as usize * 4]).unwrap();
        b.replay(g).unwrap();
        let replayed = get(&mut b, out, (tt * n) as usize);
        let want = host_gemm(&xs, &w, (tt as usize, n as usize, k as usize));
        assert_eq!(eager, want, "eager GEMM step {step}");
        assert_eq!(replayed, want, "replayed GEMM step {step}");
    }
}

/// A launch on memory that is not live, inside a capture, fails the capture
/// naming the key and the op; the backend is usable after aborting.
pub fn capture_failure_names_key_and_op<T: Target>(t: &T) {
    let mut b = t.open();
    let p = b.alloc(4096, "p").unwrap();
    let gone = b.alloc(4096, "gone").unwrap();
    let good = t.add(p, p, p, 64);
    b.prepare(&good).unwrap();
    b.free(gone).unwrap();
    let bad = t.add(p, gone, p, 64);
    let key = Key::new(2, 1, 0);
    b.begin_capture(key).unwrap();
    b.launch(&good).unwrap();
    match b.launch(&bad).unwrap_err() {
        BackendError::CaptureFailed { key: k, op, .. } => {
            assert_eq!(k, key);
            assert!(op.contains(&bad.kernel), "{op}");
        }
        other => panic!("expected a capture failure, got {other:?}"),
    }
    b.abort_capture().unwrap();
    b.launch(&good).unwrap();
    b.synchronize().unwrap();
}

/// Dropping a backend with live graphs, allocations and replays still in
/// flight (no synchronize) is safe.
pub fn teardown_with_work_in_flight_is_safe<T: Target>(t: &T) {
    let mut b = t.open();
    let n = 256u32;
    let (x, y, z) = (
        b.alloc(n as u64 * 4, "x").unwrap(),
        b.alloc(n as u64 * 4, "y").unwrap(),
        b.alloc(n as u64 * 4, "z").unwrap(),
    );
    let l = t.add(x, y, z, n);
    b.prepare(&l).unwrap();
    b.begin_capture(Key::new(1, 1, 0)).unwrap();
    b.launch(&l).unwrap();
    let g = b.end_capture().unwrap();
    b.replay(g).unwrap();
    b.replay(g).unwrap();
    b.launch(&l).unwrap();
    drop(b);
}

/// Dropping a backend in the middle of a capture is safe.
pub fn teardown_inside_a_capture_is_safe<T: Target>(t: &T) {
    let mut b = t.open();
    let p = b.alloc(1024, "p").unwrap();
    let l = t.add(p, p, p, 64);
    b.prepare(&l).unwrap();
    b.begin_capture(Key::new(1, 1, 0)).unwrap();
    b.launch(&l).unwrap();
    drop(b);
}

/// A workspace grown after a capture does not free the one the graph
/// holds: the graph replays correctly after the growth.
pub fn retired_workspace_outlives_graphs<T: Target>(t: &T) {
    let mut b = t.open();
    assert!(t.require_workspace(&mut b, 256));
    let ws = b.reserve_workspace(256).unwrap();
    assert!(ws.is_some(), "a workspace was reserved");
    let (tt, n, k) = (2u32, 4u32, 8u32);
    let mut rng = Rng(77);
    let w = rng.f32s((n * k) as usize);
    let wp = put(&mut b, &w);
    let x = b.alloc((tt * k) as u64 * 4, "x").unwrap();
    let out = b.alloc((tt * n) as u64 * 4, "out").unwrap();
    let l = t.gemm(
        Gemm {
            x,
            w: wp,
            out,
            t: tt,
            n,
            k,
        },
        ws,
    );
    b.prepare(&l).unwrap();
    b.begin_capture(Key::new(2, 1, 0)).unwrap();
    b.launch(&l).unwrap();
    let g = b.end_capture().unwrap();
    let grown = b.reserve_workspace(1 << 20).unwrap();
    assert_ne!(grown.map(|w| w.0), ws.map(|w| w.0), "the workspace moved");
    let xs = rng.f32s((tt * k) as usize);
    b.upload(x, &f32_bytes(&xs)).unwrap();
    b.replay(g).unwrap();
    let want = host_gemm(&xs, &w, (tt as usize, n as usize, k as usize));
    assert_eq!(get(&mut b, out, (tt * n) as usize), want);
}

/// Workspace is reserved before capture, and a GEMM whose algorithm needs
/// more than the plan grants is refused at prepare naming the GEMM and both
/// figures; with enough workspace the same GEMM prepares.
pub fn too_small_workspace_is_refused_at_prepare<T: Target>(t: &T) {
    let mut b = t.open();
    assert!(t.require_workspace(&mut b, 1 << 20));
    let ws = b.reserve_workspace(4096).unwrap();
    let x = b.alloc(4 * 16 * 4, "x").unwrap();
    let w = b.alloc(8 * 16 * 4, "w").unwrap();
    let out = b.alloc(4 * 8 * 4, "out").unwrap();
    let ops = Gemm {
        x,
        w,
        out,
        t: 4,
        n: 8,
        k: 16,
    };
    match b.prepare(&t.gemm(ops, ws)).unwrap_err() {
        BackendError::WorkspaceTooSmall {
            what,
            needed,
            granted,
        } => {
            assert_eq!((needed, granted), (1 << 20, 4096));
            assert!(what.contains("4x8x16"), "{what}");
        }
        other => panic!("expected WorkspaceTooSmall, got {other:?}"),
    }
    let ws = b.reserve_workspace(1 << 20).unwrap();
    b.prepare(&t.gemm(ops, ws)).unwrap();
}

/// Two marks around work give a non-negative elapsed time.
pub fn timing_marks_measure_work_between_them<T: Target>(t: &T) {
    let mut b = t.open();
    let p = b.alloc(4096, "p").unwrap();
    let l = t.add(p, p, p, 1024);
    b.prepare(&l).unwrap();
    let from = b.mark().unwrap();
    for _ in 0..10 {
        b.launch(&l).unwrap();
    }
    let to = b.mark().unwrap();
    let ms = b.elapsed_ms(from, to).unwrap();
    assert!(ms >= 0.0 && ms.is_finite(), "{ms}");
}

/// Instantiates every property for one target. `$target` is an expression
/// yielding `Option<impl Target>` (None: skipped, with the reason printed
/// by the expression). `workspace` adds the properties that need a target
/// whose GEMM algorithm can be made to need workspace.
macro_rules! contract_tests {
    ($target:expr) => {
        contract_tests!(@each $target;
            uploads_download_unchanged,
            copies_outside_allocations_are_bad_addresses,
            forbidden_calls_inside_a_capture_name_key_and_call,
            captures_do_not_nest,
            replay_reads_fresh_inputs_at_the_captured_addresses,
            captured_gemm_replays_fresh_activations,
            capture_failure_names_key_and_op,
            teardown_with_work_in_flight_is_safe,
            teardown_inside_a_capture_is_safe,
            timing_marks_measure_work_between_them,
        );
    };
    ($target:expr, workspace) => {
        contract_tests!($target);
        contract_tests!(@each $target;
            retired_workspace_outlives_graphs,
            too_small_workspace_is_refused_at_prepare,
        );
    };
    (@each $target:expr; $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                if let Some(t) = $target {
                    crate::contract::$name(&t);
                }
            }
        )*
    };
}
