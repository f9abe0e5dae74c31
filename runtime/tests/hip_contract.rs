//! The backend contract (ARCHITECTURE.md, "The capture contract"), as test bodies
//! generic over [`Backend`], run on:
//! * the HIP backend's logic over a simulated device ([`sim::SimHip`], in
//!   every CI run): the same code as on a GPU down to the driver seam, with a
//!   device that keeps memory in host vectors, records captures as node lists
//!   and logs every call, so the order of calls is checked too;
//! * the real HIP backend (feature `rocm`) when an AMD device is present,
//!   printing `skipped: no HIP device (...)` otherwise.
//!
//! The bodies take a backend whose kernels are already loaded, so the same
//! bodies run on any backend.

#[macro_use]
mod contract;
mod gpu_bodies;

use kiln_ir::{AttnAttrs, DType, Key, Op, TensorType};
use kiln_runtime::backend::{Backend, BackendError, DevOperand, DevPtr, Launch};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    fn f32s(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next() % 20001) as f32 / 1000.0 - 10.0)
            .collect()
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn add_launch(a: DevPtr, b: DevPtr, c: DevPtr, n: u32) -> Launch {
    let ty = TensorType::new(DType::F32, [n]);
    let op = |ptr| DevOperand {
        ptr,
        ty: ty.clone(),
    };
    let l = Launch {
        const_args: 0,
        body: kiln_runtime::backend::LaunchBody::Reference,
        kernel: "add_f32".into(),
        op: Op::Add,
        args: vec![op(a), op(b)],
        results: vec![op(c)],
        workspace: None,
    };
    Launch {
        body: gpu_bodies::body(&l, false),
        ..l
    }
}

/// A capture-contract error for `key` naming `call` (backends may add
/// detail after the name, e.g. `alloc(16 bytes for x)`).
fn is_contract_error(e: &BackendError, key: Key, call: &str) -> bool {
    matches!(e, BackendError::CaptureContract { key: k, call: c, .. } if *k == key && c.starts_with(call))
}

/// Bytes uploaded at any offset of an allocation download unchanged.
pub fn contract_uploads_download_unchanged<B: Backend>(b: &mut B) {
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
pub fn contract_copies_outside_allocations_are_bad_addresses<B: Backend>(b: &mut B) {
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

/// Inside a capture, alloc, free, synchronize, download and upload fail with
/// the key and the call; afterwards the backend works eagerly again.
pub fn contract_forbidden_calls_inside_a_capture_name_key_and_call<B: Backend>(b: &mut B) {
    let key = Key::new(3, 2, 1);
    let p = b.alloc(256, "before capture").unwrap();
    b.begin_capture(key).unwrap();
    let e = b.alloc(16, "inside").unwrap_err();
    assert!(is_contract_error(&e, key, "alloc"), "{e:?}");
    let e = b.free(p).unwrap_err();
    assert!(is_contract_error(&e, key, "free"), "{e:?}");
    let e = b.synchronize().unwrap_err();
    assert!(is_contract_error(&e, key, "synchronize"), "{e:?}");
    let e = b.download(p, &mut [0u8; 4]).unwrap_err();
    assert!(is_contract_error(&e, key, "download"), "{e:?}");
    let e = b.upload(p, &[1, 2, 3, 4]).unwrap_err();
    assert!(is_contract_error(&e, key, "upload"), "{e:?}");
    assert!(e.to_string().contains("b3q2s1"), "{e}");
    b.abort_capture().unwrap();
    // Eager again: the refused calls work and memory is intact.
    let q = b.alloc(16, "after capture").unwrap();
    b.synchronize().unwrap();
    b.upload(p, &[9, 8, 7, 6]).unwrap();
    let mut out = [0u8; 4];
    b.download(p, &mut out).unwrap();
    assert_eq!(out, [9, 8, 7, 6]);
    b.free(q).unwrap();
    b.free(p).unwrap();
}

/// Captures do not nest, and ending one that was never begun is an error.
pub fn contract_captures_do_not_nest<B: Backend>(b: &mut B) {
    assert!(b.end_capture().is_err());
    let key = Key::new(1, 1, 0);
    b.begin_capture(key).unwrap();
    let e = b.begin_capture(Key::new(2, 1, 0)).unwrap_err();
    assert!(
        matches!(e, BackendError::CaptureContract { key: k, .. } if k == key),
        "{e:?}"
    );
    b.abort_capture().unwrap();
}

/// A captured add, replayed with fresh inputs uploaded to the captured
/// addresses each time, computes the fresh sum: the graph reads its inputs at
/// replay, not at capture. Fails if replay is skipped or an input is frozen.
pub fn contract_replay_reads_fresh_inputs_at_the_captured_addresses<B: Backend>(b: &mut B) -> u32 {
    let n = 1000u32;
    let bytes = n as u64 * 4;
    let (x, y, z) = (
        b.alloc(bytes, "x").unwrap(),
        b.alloc(bytes, "y").unwrap(),
        b.alloc(bytes, "z").unwrap(),
    );
    let launch = add_launch(x, y, z, n);
    b.prepare(&launch).unwrap();
    let mut rng = Rng(0xdead_beef_0bad_cafe);
    // Eager first: the op itself is right.
    let (a, c) = (rng.f32s(n as usize), rng.f32s(n as usize));
    b.upload(x, &f32_bytes(&a)).unwrap();
    b.upload(y, &f32_bytes(&c)).unwrap();
    b.launch(&launch).unwrap();
    let mut out = vec![0u8; bytes as usize];
    b.download(z, &mut out).unwrap();
    let want: Vec<f32> = a.iter().zip(&c).map(|(p, q)| p + q).collect();
    assert_eq!(bytes_f32(&out), want, "eager add");

    let key = Key::new(1, 1, 0);
    b.begin_capture(key).unwrap();
    b.launch(&launch).unwrap();
    let g = b.end_capture().unwrap();
    let mut replays = 0;
    for step in 0..4 {
        let (a, c) = (rng.f32s(n as usize), rng.f32s(n as usize));
        b.upload(x, &f32_bytes(&a)).unwrap();
        b.upload(y, &f32_bytes(&c)).unwrap();
        b.replay(g).unwrap();
        replays += 1;
        b.download(z, &mut out).unwrap();
        let want: Vec<f32> = a.iter().zip(&c).map(|(p, q)| p + q).collect();
        assert_eq!(bytes_f32(&out), want, "replay {step}");
    }
    b.destroy_graph(g).unwrap();
    assert!(b.replay(g).is_err(), "a destroyed graph cannot be replayed");
    for p in [x, y, z] {
        b.free(p).unwrap();
    }
    replays
}

/// Dropping a backend with live graphs and allocations is safe.
pub fn contract_teardown_with_live_graphs_is_safe<B: Backend>(mut b: B) {
    let n = 256u32;
    let (x, y, z) = (
        b.alloc(n as u64 * 4, "x").unwrap(),
        b.alloc(n as u64 * 4, "y").unwrap(),
        b.alloc(n as u64 * 4, "z").unwrap(),
    );
    let l = add_launch(x, y, z, n);
    b.prepare(&l).unwrap();
    b.begin_capture(Key::new(1, 1, 0)).unwrap();
    b.launch(&l).unwrap();
    let g = b.end_capture().unwrap();
    b.replay(g).unwrap();
    b.replay(g).unwrap();
    drop(b);
}

#[cfg(feature = "rocm")]
mod hip {
    use super::*;
    use kiln_runtime::backend::GraphHandle;
    use kiln_runtime::gpu::hip::HipGpuDriver;
    use kiln_runtime::gpu::GpuBackend;
    use kiln_runtime::hip::catalog::kernels_translation_unit;
    use kiln_runtime::hip::offline::kernel_images;
    use kiln_runtime::hip::policy::{self, base_arch};
    use kiln_runtime::hip::real::RealHip;
    use kiln_runtime::hip::HipBackend;

    /// A backend on device 0 with the catalog loaded (compiled into a fresh
    /// cache), or `None` after printing why the test is skipped.
    fn backend(test: &str) -> Option<HipBackend> {
        if HipBackend::device_count() == 0 {
            println!(
                "skipped: no HIP device ({}) -- {test} needs an AMD GPU",
                HipBackend::no_device_reason()
            );
            return None;
        }
        let dir = std::env::temp_dir().join(format!("kiln-hip-contract-{}", std::process::id()));
        let driver = HipGpuDriver::new(RealHip::default()).with_cache_dir(dir);
        let mut b = GpuBackend::with_driver(driver, 0).unwrap();
        let arch = b.info().arch;
        let images =
            kernel_images(base_arch(&arch), &kernels_translation_unit().unwrap(), None).unwrap();
        b.load_kernels(&images).unwrap();
        Some(b)
    }

    #[test]
    fn uploads_download_unchanged() {
        if let Some(mut b) = backend("uploads_download_unchanged") {
            contract_uploads_download_unchanged(&mut b);
        }
    }

    #[test]
    fn copies_outside_allocations_are_bad_addresses() {
        if let Some(mut b) = backend("copies_outside_allocations_are_bad_addresses") {
            contract_copies_outside_allocations_are_bad_addresses(&mut b);
        }
    }

    #[test]
    fn forbidden_calls_inside_a_capture_name_key_and_call() {
        if let Some(mut b) = backend("forbidden_calls_inside_a_capture_name_key_and_call") {
            contract_forbidden_calls_inside_a_capture_name_key_and_call(&mut b);
        }
    }

    #[test]
    fn captures_do_not_nest() {
        if let Some(mut b) = backend("captures_do_not_nest") {
            contract_captures_do_not_nest(&mut b);
        }
    }

    #[test]
    fn replay_reads_fresh_inputs_and_the_replay_counter_moves() {
        if let Some(mut b) = backend("replay_reads_fresh_inputs_and_the_replay_counter_moves") {
            let replays = contract_replay_reads_fresh_inputs_at_the_captured_addresses(&mut b);
            let c = b.counters();
            assert_eq!(c.graphs.replays(), replays as u64);
            assert_eq!(c.graphs.keys[&Key::new(1, 1, 0)].captures, 1);
            assert_eq!(c.graphs.keys[&Key::new(1, 1, 0)].captured_launches, 1);
            assert!(c.eager_launches >= 1);
            let d = b.driver();
            assert!(d.kernels_compiled + d.kernel_cache_hits >= 1);
        }
    }

    #[test]
    fn teardown_with_live_graphs_is_safe() {
        if let Some(b) = backend("teardown_with_live_graphs_is_safe") {
            contract_teardown_with_live_graphs_is_safe(b);
        }
    }

    #[test]
    fn bf16_gemms_on_hipblaslt_match_a_host_reference_eagerly_and_replayed() {
        use half::bf16;
        let Some(mut b) =
            backend("bf16_gemms_on_hipblaslt_match_a_host_reference_eagerly_and_replayed")
        else {
            return;
        };
        let (t, k, n) = (8usize, 576usize, 1536usize);
        let planned = 4u64 << 20;
        let ws = b.reserve_workspace(planned).unwrap().unwrap();
        let bf = |s: Vec<u32>| TensorType::new(DType::BF16, s);
        let (x, w, bias, out) = (
            b.alloc((t * k * 2) as u64, "x").unwrap(),
            b.alloc((n * k * 2) as u64, "w").unwrap(),
            b.alloc((n * 2) as u64, "bias").unwrap(),
            b.alloc((t * n * 4) as u64, "logits").unwrap(),
        );
        let l = Launch {
            const_args: 0,
            body: kiln_runtime::backend::LaunchBody::Reference,
            kernel: "gemm".into(),
            op: Op::MatMul {
                bias: true,
                out: DType::F32,
            },
            args: vec![
                DevOperand {
                    ptr: x,
                    ty: bf(vec![t as u32, k as u32]),
                },
                DevOperand {
                    ptr: w,
                    ty: bf(vec![n as u32, k as u32]),
                },
                DevOperand {
                    ptr: bias,
                    ty: bf(vec![n as u32]),
                },
            ],
            results: vec![DevOperand {
                ptr: out,
                ty: TensorType::new(DType::F32, [t as u32, n as u32]),
            }],
            workspace: Some((ws.0, planned)),
        };
        let l = Launch {
            body: gpu_bodies::body(&l, false),
            ..l
        };
        b.prepare(&l).unwrap();
        let mut rng = Rng(2024);
        let round = |v: Vec<f32>| -> Vec<bf16> {
            v.into_iter().map(|x| bf16::from_f32(x / 10.0)).collect()
        };
        let to_bytes = |v: &[bf16]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let wv = round(rng.f32s(n * k));
        let bv = round(rng.f32s(n));
        b.upload(w, &to_bytes(&wv)).unwrap();
        b.upload(bias, &to_bytes(&bv)).unwrap();
        let mut check = |b: &mut HipBackend, replay: Option<GraphHandle>| {
            let xv = round(rng.f32s(t * k));
            b.upload(x, &to_bytes(&xv)).unwrap();
            match replay {
                Some(g) => b.replay(g).unwrap(),
                None => b.launch(&l).unwrap(),
            }
            let mut got = vec![0u8; t * n * 4];
            b.download(out, &mut got).unwrap();
            let got = bytes_f32(&got);
            for r in 0..t {
                for c in 0..n {
                    let want: f32 = (0..k)
                        .map(|i| xv[r * k + i].to_f32() * wv[c * k + i].to_f32())
                        .sum::<f32>()
                        + bv[c].to_f32();
                    let g = got[r * n + c];
                    assert!(
                        (g - want).abs() <= 1e-2 * (1.0 + want.abs()),
                        "[{r},{c}] {g} vs {want}"
                    );
                }
            }
        };
        check(&mut b, None);
        b.begin_capture(Key::new(8, 1, 0)).unwrap();
        b.launch(&l).unwrap();
        let g = b.end_capture().unwrap();
        for _ in 0..3 {
            check(&mut b, Some(g));
        }
        assert_eq!(b.counters().graphs.keys[&Key::new(8, 1, 0)].replays, 3);
    }

    #[test]
    fn each_device_opens_on_its_own_ordinal_and_the_policy_names_it() {
        let n = HipBackend::device_count();
        if n == 0 {
            println!(
                "skipped: no HIP device ({})",
                HipBackend::no_device_reason()
            );
            return;
        }
        for ordinal in 0..n {
            let b = HipBackend::new(ordinal).unwrap();
            let info = b.info();
            assert_eq!(info.ordinal, ordinal);
            let want = policy::decide(&info, None).unwrap();
            assert!(
                want.reason.contains(&format!("device {ordinal}")),
                "{}",
                want.reason
            );
            println!("{}", want.reason);
        }
        let e = HipBackend::new(n).unwrap_err().to_string();
        assert!(
            e.to_lowercase().contains(&format!("no hip device {n}")),
            "{e}"
        );
    }

    #[test]
    fn without_a_device_construction_fails_with_a_clear_error() {
        if HipBackend::device_count() > 0 {
            println!("skipped: a HIP device is present");
            return;
        }
        let e = HipBackend::new(0).unwrap_err().to_string();
        assert!(
            e.to_lowercase().contains("no hip device 0") && e.contains("0 device(s) visible"),
            "{e}"
        );
    }
}

/// A simulated HIP device behind the [`HipDriver`] seam.
mod sim {
    use kiln_ir::DType;
    use kiln_runtime::backend::{BackendError, DevPtr};
    use kiln_runtime::hip::catalog::{all_entry_points, PackedParams};
    use kiln_runtime::hip::driver::{
        Dims, DriverError, Handle, HipDriver, ERROR_NO_BINARY_FOR_GPU, ERROR_OUT_OF_MEMORY,
    };
    use kiln_runtime::hip::gemm::{select_algorithm, AlgoCandidate, GemmOperands, GemmProblem};
    use std::cell::RefCell;
    use std::collections::{BTreeMap, BTreeSet, HashMap};
    use std::rc::Rc;

    /// What the device saw, shared with the test so it outlives the backend.
    #[derive(Debug, Default)]
    pub struct Trace {
        /// Every call, as `name@device`.
        pub log: Vec<String>,
        /// Calls the capture contract forbids that reached the device.
        pub violations: Vec<String>,
        /// Device allocations alive.
        pub live: usize,
        pub rtc_compiles: usize,
        /// Every kernel launched or recorded: entry and parameter bytes.
        pub kernels: Vec<(String, Vec<Vec<u8>>)>,
    }

    thread_local! {
        /// HIP's current device is per thread and shared by every backend on
        /// the thread, so the simulation keeps it here, not per driver.
        static CURRENT_DEVICE: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
    }

    const STREAM_CAPTURE_UNSUPPORTED: i32 = 900;
    const ILLEGAL_ADDRESS: i32 = 700;

    #[derive(Clone, Debug)]
    enum Node {
        Kernel { name: String, params: Vec<Vec<u8>> },
        Gemm { p: GemmProblem, ops: GemmOperands },
    }

    /// What the simulated device is and how it misbehaves.
    #[derive(Clone, Debug)]
    pub struct Config {
        /// Full target ID per ordinal.
        pub devices: Vec<String>,
        /// Bytes the device can hold.
        pub memory: u64,
        /// Entry points the loaded modules define.
        pub functions: BTreeSet<String>,
        /// What the GEMM heuristic proposes: (workspace, usable) per algorithm.
        pub gemm_algos: Vec<(u64, bool)>,
        /// `hipStreamEndCapture` fails (an invalidated capture).
        pub fail_end_capture: bool,
        /// `hipGraphInstantiate` fails.
        pub fail_instantiate: bool,
    }

    impl Default for Config {
        fn default() -> Config {
            Config {
                devices: vec!["gfx90a:sramecc+:xnack-".into()],
                memory: 1 << 30,
                functions: all_entry_points().into_iter().map(|(_, e)| e).collect(),
                gemm_algos: vec![(0, true)],
                fail_end_capture: false,
                fail_instantiate: false,
            }
        }
    }

    /// A device in host memory that records what it is asked in a [`Trace`].
    pub struct SimHip {
        pub cfg: Config,
        pub trace: Rc<RefCell<Trace>>,
        memory: BTreeMap<u64, (u32, Vec<u8>)>,
        next_addr: u64,
        used: u64,
        streams: BTreeSet<Handle>,
        modules: HashMap<Handle, String>,
        functions: HashMap<Handle, String>,
        capturing: Option<Vec<Node>>,
        graphs: HashMap<Handle, Vec<Node>>,
        execs: HashMap<Handle, Vec<Node>>,
        pending: bool,
        next_handle: Handle,
        prepared: BTreeMap<String, u64>,
    }

    fn current() -> Option<u32> {
        CURRENT_DEVICE.with(|c| c.get())
    }

    impl SimHip {
        pub fn new(cfg: Config) -> SimHip {
            SimHip {
                cfg,
                trace: Rc::default(),
                memory: BTreeMap::new(),
                next_addr: 0x7f00_0000_0000,
                used: 0,
                streams: BTreeSet::new(),
                modules: HashMap::new(),
                functions: HashMap::new(),
                capturing: None,
                graphs: HashMap::new(),
                execs: HashMap::new(),
                pending: false,
                next_handle: 1,
                prepared: BTreeMap::new(),
            }
        }

        fn handle(&mut self) -> Handle {
            self.next_handle += 1;
            self.next_handle
        }

        fn call(&mut self, name: &str) {
            let entry = match current() {
                Some(d) => format!("{name}@{d}"),
                None => name.to_string(),
            };
            self.trace.borrow_mut().log.push(entry);
        }

        /// Refuses (and records) a call that a global-mode capture forbids.
        fn uncapturable(&mut self, name: &str) -> Result<(), DriverError> {
            if self.capturing.is_some() {
                self.trace
                    .borrow_mut()
                    .violations
                    .push(format!("{name} during a capture"));
                return Err(DriverError {
                    code: STREAM_CAPTURE_UNSUPPORTED,
                    description: format!("hipErrorStreamCaptureUnsupported: {name}"),
                });
            }
            Ok(())
        }

        fn region(&mut self, ptr: u64, len: u64) -> Result<&mut [u8], DriverError> {
            let bad = || DriverError {
                code: ILLEGAL_ADDRESS,
                description: format!("hipErrorIllegalAddress: {ptr:#x}+{len}"),
            };
            let (&base, (_, buf)) = self.memory.range_mut(..=ptr).next_back().ok_or_else(bad)?;
            let off = (ptr - base) as usize;
            if off + len as usize > buf.len() {
                return Err(bad());
            }
            Ok(&mut buf[off..off + len as usize])
        }

        fn read_f32(&mut self, ptr: u64, n: usize) -> Result<Vec<f32>, DriverError> {
            Ok(self
                .region(ptr, n as u64 * 4)?
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect())
        }

        fn write_f32(&mut self, ptr: u64, v: &[f32]) -> Result<(), DriverError> {
            let dst = self.region(ptr, v.len() as u64 * 4)?;
            for (d, x) in dst.chunks_exact_mut(4).zip(v) {
                d.copy_from_slice(&x.to_le_bytes());
            }
            Ok(())
        }

        fn execute(&mut self, node: &Node) -> Result<(), DriverError> {
            match node {
                Node::Kernel { name, params } if name == "add_f32" => {
                    let word = |i: usize| u64::from_ne_bytes(params[i][..8].try_into().unwrap());
                    let n = word(3) as usize;
                    let a = self.read_f32(word(0), n)?;
                    let b = self.read_f32(word(1), n)?;
                    let c: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
                    self.write_f32(word(2), &c)
                }
                // Other kernels only exist to be recorded (prepare/capture tests).
                Node::Kernel { .. } => Ok(()),
                Node::Gemm { p, ops } => {
                    assert!(
                        [p.a.dtype, p.b.dtype, p.d.dtype] == [DType::F32; 3],
                        "the simulated device runs f32 GEMMs only"
                    );
                    let a = self.read_f32(ops.a.0, (p.a.ld as u64 * p.a.cols) as usize)?;
                    let b = self.read_f32(ops.b.0, (p.b.ld as u64 * p.b.cols) as usize)?;
                    let bias = match ops.bias {
                        Some(bp) => Some(self.read_f32(bp.0, p.m as usize)?),
                        None => None,
                    };
                    let at = |buf: &[f32], ld: i64, r: u64, c: u64| {
                        buf[(r as i64 + c as i64 * ld) as usize]
                    };
                    let mut d = vec![0f32; (p.d.ld as u64 * p.n) as usize];
                    for j in 0..p.n {
                        for i in 0..p.m {
                            let mut s = 0f32;
                            for l in 0..p.k {
                                let x = if p.trans_a {
                                    at(&a, p.a.ld, l, i)
                                } else {
                                    at(&a, p.a.ld, i, l)
                                };
                                let y = if p.trans_b {
                                    at(&b, p.b.ld, j, l)
                                } else {
                                    at(&b, p.b.ld, l, j)
                                };
                                s += x * y;
                            }
                            if let Some(bias) = &bias {
                                s += bias[i as usize];
                            }
                            d[(i as i64 + j as i64 * p.d.ld) as usize] = s;
                        }
                    }
                    self.write_f32(ops.d.0, &d)
                }
            }
        }

        fn submit(&mut self, node: Node) -> Result<(), DriverError> {
            match &mut self.capturing {
                Some(nodes) => {
                    nodes.push(node);
                    Ok(())
                }
                None => {
                    self.pending = true;
                    self.execute(&node)
                }
            }
        }

        /// A fake code object for `target_id`: an AMDGPU ELF header, then a
        /// line naming the architecture.
        pub fn code_object(target_id: &str) -> Vec<u8> {
            let mut v = vec![0u8; 64];
            v[..4].copy_from_slice(b"\x7fELF");
            v[18..20].copy_from_slice(&224u16.to_le_bytes());
            v.extend_from_slice(format!("kiln-sim:{target_id}\n").as_bytes());
            v
        }
    }

    impl HipDriver for SimHip {
        fn mem_free(&mut self) -> Result<u64, DriverError> {
            Ok(u64::MAX)
        }
        fn device_count(&mut self) -> u32 {
            self.cfg.devices.len() as u32
        }
        fn no_device_reason(&mut self) -> String {
            "simulated machine without devices".into()
        }
        fn set_device(&mut self, ordinal: u32) -> Result<(), DriverError> {
            CURRENT_DEVICE.with(|c| c.set(Some(ordinal)));
            Ok(())
        }
        fn device_name(&mut self, ordinal: u32) -> Result<String, BackendError> {
            Ok(format!("Simulated AMD GPU {ordinal}"))
        }
        fn device_target_id(&mut self, ordinal: u32) -> Result<String, BackendError> {
            Ok(self.cfg.devices[ordinal as usize].clone())
        }
        fn runtime_version(&mut self) -> Result<(String, i32), BackendError> {
            Ok(("6.2.41133".into(), 60_241_133))
        }
        fn stream_create(&mut self) -> Result<Handle, DriverError> {
            self.call("stream_create");
            let h = self.handle();
            self.streams.insert(h);
            Ok(h)
        }
        fn stream_destroy(&mut self, stream: Handle) {
            self.call("stream_destroy");
            assert!(self.streams.remove(&stream), "stream destroyed twice");
        }
        fn stream_synchronize(&mut self, _stream: Handle) -> Result<(), DriverError> {
            self.call("stream_synchronize");
            self.uncapturable("hipStreamSynchronize")?;
            self.pending = false;
            Ok(())
        }
        fn malloc(&mut self, bytes: u64) -> Result<DevPtr, DriverError> {
            self.call("malloc");
            self.uncapturable("hipMalloc")?;
            let size = bytes.max(1);
            if self.used + size > self.cfg.memory {
                return Err(DriverError {
                    code: ERROR_OUT_OF_MEMORY,
                    description: "hipErrorOutOfMemory (2): out of memory".into(),
                });
            }
            let p = self.next_addr;
            self.next_addr += size.div_ceil(256) * 256 + 4096;
            self.used += size;
            let device = current().expect("a device is bound");
            // Garbage, not zeros: the backend must zero what it hands out.
            self.memory.insert(p, (device, vec![0xa5; size as usize]));
            self.trace.borrow_mut().live += 1;
            Ok(DevPtr(p))
        }
        fn free(&mut self, ptr: DevPtr) -> Result<(), DriverError> {
            self.call("free");
            self.uncapturable("hipFree")?;
            match self.memory.remove(&ptr.0) {
                Some((device, buf)) => {
                    assert_eq!(
                        Some(device),
                        current(),
                        "freed while another device was bound"
                    );
                    self.used -= buf.len() as u64;
                    self.trace.borrow_mut().live -= 1;
                    Ok(())
                }
                None => {
                    self.trace
                        .borrow_mut()
                        .violations
                        .push(format!("free of unknown pointer {:#x}", ptr.0));
                    Err(DriverError {
                        code: 1,
                        description: "hipErrorInvalidValue".into(),
                    })
                }
            }
        }
        fn memset_zero(&mut self, ptr: DevPtr, bytes: u64, _s: Handle) -> Result<(), DriverError> {
            self.call("memset");
            self.uncapturable("hipMemsetAsync")?;
            self.region(ptr.0, bytes)?.fill(0);
            Ok(())
        }
        fn copy_to_device(
            &mut self,
            dst: DevPtr,
            src: &[u8],
            _s: Handle,
        ) -> Result<(), DriverError> {
            self.call("copy_to_device");
            self.uncapturable("hipMemcpyHtoDAsync")?;
            self.region(dst.0, src.len() as u64)?.copy_from_slice(src);
            Ok(())
        }
        fn copy_to_host(
            &mut self,
            dst: &mut [u8],
            src: DevPtr,
            _s: Handle,
        ) -> Result<(), DriverError> {
            self.call("copy_to_host");
            self.uncapturable("hipMemcpyDtoHAsync")?;
            let len = dst.len() as u64;
            dst.copy_from_slice(self.region(src.0, len)?);
            Ok(())
        }
        fn module_load(&mut self, code: &[u8]) -> Result<Handle, DriverError> {
            self.call("module_load");
            self.uncapturable("hipModuleLoadData")?;
            let text = String::from_utf8_lossy(code.get(64..).unwrap_or_default()).into_owned();
            let arch = text
                .strip_prefix("kiln-sim:")
                .and_then(|t| t.lines().next())
                .unwrap_or_default()
                .split(':')
                .next()
                .unwrap_or_default()
                .to_string();
            let device = self.cfg.devices[current().unwrap() as usize].clone();
            if arch != device.split(':').next().unwrap() {
                return Err(DriverError {
                    code: ERROR_NO_BINARY_FOR_GPU,
                    description: format!("hipErrorNoBinaryForGpu (209): code object for `{arch}`"),
                });
            }
            let h = self.handle();
            self.modules.insert(h, arch);
            Ok(h)
        }
        fn module_unload(&mut self, module: Handle) {
            self.call("module_unload");
            assert!(
                self.modules.remove(&module).is_some(),
                "module unloaded twice"
            );
        }
        fn function(&mut self, module: Handle, name: &str) -> Option<Handle> {
            self.call("function");
            if !self.modules.contains_key(&module) || !self.cfg.functions.contains(name) {
                return None;
            }
            let h = self.handle();
            self.functions.insert(h, name.to_string());
            Some(h)
        }
        fn launch_kernel(
            &mut self,
            f: Handle,
            _dims: Dims,
            _s: Handle,
            params: &mut PackedParams,
        ) -> Result<(), DriverError> {
            self.call("launch_kernel");
            let name = self.functions[&f].clone();
            let params: Vec<Vec<u8>> = (0..params.len())
                .map(|i| params.bytes(i).to_vec())
                .collect();
            self.trace
                .borrow_mut()
                .kernels
                .push((name.clone(), params.clone()));
            self.submit(Node::Kernel { name, params })
        }
        fn begin_capture(&mut self, _s: Handle) -> Result<(), DriverError> {
            self.call("begin_capture");
            assert!(
                self.capturing.is_none(),
                "nested capture reached the device"
            );
            self.capturing = Some(Vec::new());
            Ok(())
        }
        fn end_capture(&mut self, _s: Handle) -> Result<Handle, DriverError> {
            self.call("end_capture");
            let nodes = self
                .capturing
                .take()
                .expect("end_capture without a capture");
            if self.cfg.fail_end_capture {
                return Err(DriverError {
                    code: 901,
                    description: "hipErrorStreamCaptureInvalidated (901): operation not permitted when stream is capturing".into(),
                });
            }
            let h = self.handle();
            self.graphs.insert(h, nodes);
            Ok(h)
        }
        fn instantiate(&mut self, graph: Handle) -> Result<Handle, DriverError> {
            self.call("instantiate");
            if self.cfg.fail_instantiate {
                return Err(DriverError {
                    code: 1,
                    description: "hipErrorInvalidValue (1): simulated".into(),
                });
            }
            let nodes = self.graphs[&graph].clone();
            let h = self.handle();
            self.execs.insert(h, nodes);
            Ok(h)
        }
        fn graph_launch(&mut self, exec: Handle, _s: Handle) -> Result<(), DriverError> {
            self.call("graph_launch");
            self.uncapturable("hipGraphLaunch")?;
            self.pending = true;
            for node in self.execs[&exec].clone() {
                self.execute(&node)?;
            }
            Ok(())
        }
        fn exec_destroy(&mut self, exec: Handle) -> Result<(), DriverError> {
            self.call("exec_destroy");
            if self.pending {
                self.trace
                    .borrow_mut()
                    .violations
                    .push("graph executable destroyed with work in flight".into());
            }
            assert!(
                self.execs.remove(&exec).is_some(),
                "executable destroyed twice"
            );
            Ok(())
        }
        fn graph_destroy(&mut self, graph: Handle) -> Result<(), DriverError> {
            self.call("graph_destroy");
            assert!(
                self.graphs.remove(&graph).is_some(),
                "graph destroyed twice"
            );
            Ok(())
        }
        fn clear_error(&mut self) {}
        fn rtc_identity(&mut self) -> Result<String, BackendError> {
            Ok("simulated hiprtc 1.0".into())
        }
        fn rtc_compile(
            &mut self,
            source: &str,
            _name: &str,
            options: &[String],
        ) -> Result<Vec<u8>, String> {
            self.call("rtc_compile");
            self.trace.borrow_mut().rtc_compiles += 1;
            if source.contains("#error") {
                return Err("kiln_kernels.hip:1:2: error: simulated".into());
            }
            let arch = options
                .iter()
                .find_map(|o| o.strip_prefix("--offload-arch="))
                .ok_or("no --offload-arch option")?;
            Ok(SimHip::code_object(arch))
        }
        fn gemm_prepare(&mut self, p: &GemmProblem, granted: u64) -> Result<u64, BackendError> {
            self.call("gemm_prepare");
            let key = format!("{p:?}/{granted}");
            if let Some(ws) = self.prepared.get(&key) {
                return Ok(*ws);
            }
            let cands: Vec<AlgoCandidate> = self
                .cfg
                .gemm_algos
                .iter()
                .map(|&(workspace, usable)| AlgoCandidate { workspace, usable })
                .collect();
            let i = select_algorithm(&cands, granted, &p.describe())?;
            self.prepared.insert(key, cands[i].workspace);
            Ok(cands[i].workspace)
        }
        fn gemm_is_prepared(&self, p: &GemmProblem, granted: u64) -> bool {
            self.prepared.contains_key(&format!("{p:?}/{granted}"))
        }
        fn gemm_run(
            &mut self,
            p: &GemmProblem,
            granted: u64,
            ops: &GemmOperands,
            _ws: Option<DevPtr>,
            _s: Handle,
        ) -> Result<(), BackendError> {
            self.call("gemm_run");
            assert!(
                self.gemm_is_prepared(p, granted),
                "gemm_run of an unprepared GEMM"
            );
            self.submit(Node::Gemm {
                p: p.clone(),
                ops: *ops,
            })
            .map_err(|e| e.during("hipblasLtMatmul"))
        }
        fn gemm_prepared_count(&self) -> usize {
            self.prepared.len()
        }
        fn event_create(&mut self) -> Result<Handle, DriverError> {
            self.call("hipEventCreate");
            Ok(self.handle())
        }
        fn event_record(&mut self, _event: Handle, _stream: Handle) -> Result<(), DriverError> {
            self.call("hipEventRecord");
            Ok(())
        }
        /// Work completes when submitted, so no time passes between events.
        fn event_elapsed_ms(&mut self, _from: Handle, _to: Handle) -> Result<f32, DriverError> {
            self.call("hipEventElapsedTime");
            Ok(0.0)
        }
        fn gemm_release(&mut self) {
            self.call("gemm_release");
            self.prepared.clear();
        }
    }
}

/// The contract, and the HIP backend's own rules, on the simulated device.
mod on_sim {
    use super::sim::{Config, SimHip, Trace};
    use super::*;
    use kiln_ir::plan::{ImageKind, KernelImage};
    use kiln_runtime::gpu::hip::HipGpuDriver;
    use kiln_runtime::gpu::GpuBackend;
    use kiln_runtime::hip::catalog::kernels_translation_unit;
    use kiln_runtime::hip::offline::kernel_images;
    use std::cell::RefCell;
    use std::rc::Rc;

    type SimBackend = GpuBackend<HipGpuDriver<SimHip>>;

    fn open(
        sim: SimHip,
        ordinal: u32,
        cache: &std::path::Path,
    ) -> Result<SimBackend, BackendError> {
        GpuBackend::with_driver(HipGpuDriver::new(sim).with_cache_dir(cache), ordinal)
    }

    struct Fixture {
        b: SimBackend,
        trace: Rc<RefCell<Trace>>,
        _cache: tempfile::TempDir,
    }

    impl Fixture {
        fn with(cfg: Config, ordinal: u32) -> Fixture {
            let sim = SimHip::new(cfg);
            let trace = sim.trace.clone();
            let cache = tempfile::tempdir().unwrap();
            let mut b = open(sim, ordinal, cache.path()).unwrap();
            let tu = kernels_translation_unit().unwrap();
            b.load_kernels(&kernel_images(&b.info().arch, &tu, None).unwrap())
                .unwrap();
            Fixture {
                b,
                trace,
                _cache: cache,
            }
        }

        fn new() -> Fixture {
            Fixture::with(Config::default(), 0)
        }

        fn violations(&self) -> Vec<String> {
            self.trace.borrow().violations.clone()
        }

        fn log(&self) -> Vec<String> {
            self.trace.borrow().log.clone()
        }
    }

    #[test]
    fn uploads_download_unchanged() {
        let mut f = Fixture::new();
        contract_uploads_download_unchanged(&mut f.b);
        assert!(f.violations().is_empty(), "{:?}", f.violations());
    }

    #[test]
    fn copies_outside_allocations_are_bad_addresses() {
        let mut f = Fixture::new();
        contract_copies_outside_allocations_are_bad_addresses(&mut f.b);
    }

    #[test]
    fn forbidden_calls_inside_a_capture_name_key_and_call_and_never_reach_the_device() {
        let mut f = Fixture::new();
        contract_forbidden_calls_inside_a_capture_name_key_and_call(&mut f.b);
        assert!(f.violations().is_empty(), "{:?}", f.violations());
    }

    #[test]
    fn captures_do_not_nest() {
        let mut f = Fixture::new();
        contract_captures_do_not_nest(&mut f.b);
        assert!(f.violations().is_empty(), "{:?}", f.violations());
    }

    #[test]
    fn replay_reads_fresh_inputs_and_the_replay_counter_moves() {
        let mut f = Fixture::new();
        let replays = contract_replay_reads_fresh_inputs_at_the_captured_addresses(&mut f.b);
        let c = f.b.counters();
        assert_eq!(c.graphs.replays(), replays as u64);
        let k = &c.graphs.keys[&Key::new(1, 1, 0)];
        assert_eq!((k.captures, k.captured_launches, k.replays), (1, 1, 4));
        assert_eq!(c.eager_launches, 1);
        assert!(f.violations().is_empty(), "{:?}", f.violations());
        // The replays are graph launches, not re-issued kernels.
        let log = f.log();
        let kernels = log
            .iter()
            .filter(|l| l.starts_with("launch_kernel"))
            .count();
        let graphs = log.iter().filter(|l| l.starts_with("graph_launch")).count();
        assert_eq!(
            (kernels, graphs),
            (2, 4),
            "one eager launch, one captured, four replays"
        );
    }

    #[test]
    fn teardown_synchronizes_before_destroying_graphs_and_frees_everything() {
        let f = Fixture::new();
        let trace = f.trace.clone();
        contract_teardown_with_live_graphs_is_safe(f.b);
        let t = trace.borrow();
        assert!(t.violations.is_empty(), "{:?}", t.violations);
        assert_eq!(t.live, 0, "device memory left after teardown");
        let pos = |name: &str| t.log.iter().position(|l| l.starts_with(name)).unwrap();
        let rpos = |name: &str| t.log.iter().rposition(|l| l.starts_with(name)).unwrap();
        let last_replay = rpos("graph_launch");
        let sync = last_replay
            + t.log[last_replay..]
                .iter()
                .position(|l| l.starts_with("stream_synchronize"))
                .unwrap();
        assert!(sync < pos("exec_destroy"), "{:?}", t.log);
        assert!(pos("exec_destroy") < pos("graph_destroy"));
        if let Some(release) = t.log.iter().rposition(|l| l.starts_with("gemm_release")) {
            assert!(release < rpos("free"), "BLAS released before memory");
        }
        assert!(rpos("module_unload") < rpos("stream_destroy"));
        assert!(t.log.last().unwrap().starts_with("stream_destroy"));
    }

    #[test]
    fn dropping_a_backend_in_the_middle_of_a_capture_ends_it_and_frees_everything() {
        let mut f = Fixture::new();
        let n = 64;
        let x = f.b.alloc(n * 4, "x").unwrap();
        let l = add_launch(x, x, x, n as u32);
        f.b.prepare(&l).unwrap();
        f.b.begin_capture(Key::new(2, 1, 0)).unwrap();
        f.b.launch(&l).unwrap();
        let trace = f.trace.clone();
        drop(f.b);
        let t = trace.borrow();
        assert!(t.violations.is_empty(), "{:?}", t.violations);
        assert_eq!(t.live, 0);
        let end = t
            .log
            .iter()
            .position(|l| l.starts_with("end_capture"))
            .unwrap();
        let free = t.log.iter().position(|l| l.starts_with("free")).unwrap();
        assert!(end < free, "{:?}", t.log);
    }

    fn matmul_launch(
        x: DevPtr,
        w: DevPtr,
        bias: Option<DevPtr>,
        out: DevPtr,
        (t, k, n): (u32, u32, u32),
        ws: Option<(DevPtr, u64)>,
    ) -> Launch {
        let f = |s: Vec<u32>| TensorType::new(DType::F32, s);
        let mut args = vec![
            DevOperand {
                ptr: x,
                ty: f(vec![t, k]),
            },
            DevOperand {
                ptr: w,
                ty: f(vec![n, k]),
            },
        ];
        if let Some(b) = bias {
            args.push(DevOperand {
                ptr: b,
                ty: f(vec![n]),
            });
        }
        let l = Launch {
            const_args: 0,
            body: kiln_runtime::backend::LaunchBody::Reference,
            kernel: "gemm".into(),
            op: Op::MatMul {
                bias: bias.is_some(),
                out: DType::F32,
            },
            args,
            results: vec![DevOperand {
                ptr: out,
                ty: f(vec![t, n]),
            }],
            workspace: ws,
        };
        Launch {
            body: gpu_bodies::body(&l, false),
            ..l
        }
    }

    #[test]
    fn a_captured_gemm_replays_with_fresh_activations_through_hipblaslt_operands() {
        let mut f = Fixture::new();
        let b = &mut f.b;
        let ws = b.reserve_workspace(1 << 20).unwrap().unwrap();
        let (t, k, n) = (5u32, 24u32, 7u32);
        let (x, w, bias, out) = (
            b.alloc(t as u64 * k as u64 * 4, "x").unwrap(),
            b.alloc(n as u64 * k as u64 * 4, "w").unwrap(),
            b.alloc(n as u64 * 4, "bias").unwrap(),
            b.alloc(t as u64 * n as u64 * 4, "out").unwrap(),
        );
        let l = matmul_launch(x, w, Some(bias), out, (t, k, n), Some((ws.0, 4096)));
        b.prepare(&l).unwrap();
        assert_eq!(b.counters().gemm_choices, 1);
        let mut rng = Rng(77);
        let wv = rng.f32s((n * k) as usize);
        let bv = rng.f32s(n as usize);
        b.upload(w, &f32_bytes(&wv)).unwrap();
        b.upload(bias, &f32_bytes(&bv)).unwrap();
        b.begin_capture(Key::new(5, 1, 0)).unwrap();
        b.launch(&l).unwrap();
        let g = b.end_capture().unwrap();
        for _ in 0..3 {
            let xv = rng.f32s((t * k) as usize);
            b.upload(x, &f32_bytes(&xv)).unwrap();
            b.replay(g).unwrap();
            let mut got = vec![0u8; (t * n * 4) as usize];
            b.download(out, &mut got).unwrap();
            let got = bytes_f32(&got);
            for r in 0..t as usize {
                for c in 0..n as usize {
                    let want: f32 = (0..k as usize)
                        .map(|i| xv[r * k as usize + i] * wv[c * k as usize + i])
                        .sum::<f32>()
                        + bv[c];
                    let g = got[r * n as usize + c];
                    assert!(
                        (g - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "[{r},{c}] {g} vs {want}"
                    );
                }
            }
        }
        assert!(f.violations().is_empty(), "{:?}", f.violations());
    }

    #[test]
    fn a_gemm_algorithm_needing_more_workspace_than_planned_is_refused_at_prepare() {
        // A BLAS that ignores the max-workspace preference: its only usable
        // algorithm needs 1 MiB while the plan grants 64 KiB.
        let cfg = Config {
            gemm_algos: vec![(8 << 20, false), (1 << 20, true)],
            ..Config::default()
        };
        let mut f = Fixture::with(cfg, 0);
        let b = &mut f.b;
        let ws = b.reserve_workspace(64 << 10).unwrap().unwrap();
        let p = b.alloc(1 << 16, "operands").unwrap();
        let l = matmul_launch(p, p, None, p, (2, 8, 4), Some((ws.0, 64 << 10)));
        match b.prepare(&l).unwrap_err() {
            BackendError::WorkspaceTooSmall {
                what,
                needed,
                granted,
            } => {
                assert_eq!((needed, granted), (1 << 20, 64 << 10));
                assert!(what.contains("2x4x8"), "{what}");
            }
            e => panic!("expected WorkspaceTooSmall, got {e:?}"),
        }
        // And a capture of it fails naming the key and the GEMM, recording nothing.
        let key = Key::new(2, 1, 0);
        b.begin_capture(key).unwrap();
        let e = b.launch(&l).unwrap_err();
        assert!(
            matches!(&e, BackendError::CaptureFailed { key: k, op, message } if *k == key && op == "gemm (matmul)" && message.contains("not prepared")),
            "{e:?}"
        );
        b.abort_capture().unwrap();
        assert!(
            !f.log().iter().any(|l| l.starts_with("gemm_run")),
            "nothing ran"
        );
    }

    #[test]
    fn a_workspace_outgrown_after_a_capture_is_retired_not_freed() {
        let mut f = Fixture::new();
        let b = &mut f.b;
        let ws = b.reserve_workspace(4096).unwrap();
        assert_eq!(ws.unwrap().1, 4096);
        b.begin_capture(Key::new(1, 1, 0)).unwrap();
        let e = b.reserve_workspace(8192).unwrap_err();
        assert!(
            matches!(&e, BackendError::CaptureContract { call, .. } if call == "reserve_workspace"),
            "{e:?}"
        );
        let g = b.end_capture().unwrap();
        assert_eq!(
            b.reserve_workspace(4096).unwrap(),
            ws,
            "same size: same buffer"
        );
        let frees = f.log().iter().filter(|l| l.starts_with("free")).count();
        let b = &mut f.b;
        let grown = b.reserve_workspace(8192).unwrap().unwrap();
        assert_eq!(grown.1, 8192);
        assert_eq!(b.counters().retired_buffers, 1);
        b.replay(g).unwrap();
        assert_eq!(
            f.log().iter().filter(|l| l.starts_with("free")).count(),
            frees,
            "the old workspace is still allocated"
        );
        let trace = f.trace.clone();
        drop(f.b);
        assert_eq!(trace.borrow().live, 0, "and freed at teardown");
    }

    fn attention_launch(
        q: DevPtr,
        kc: DevPtr,
        bt: DevPtr,
        cl: DevPtr,
        out: DevPtr,
        max_blocks: u32,
    ) -> Launch {
        let bf = |s: Vec<u32>| TensorType::new(DType::BF16, s);
        let i = |s: Vec<u32>| TensorType::new(DType::I32, s);
        Launch {
            const_args: 0,
            body: kiln_runtime::backend::LaunchBody::Reference,
            kernel: "paged_attention_bf16".into(),
            op: Op::PagedAttention(AttnAttrs {
                heads: 4,
                kv_heads: 2,
                head_dim: 64,
                query: 1,
                block_size: 16,
                scale: 0.125,
                window: None,
                softcap: None,
            }),
            args: vec![
                DevOperand {
                    ptr: q,
                    ty: bf(vec![2, 256]),
                },
                DevOperand {
                    ptr: kc,
                    ty: bf(vec![64, 128]),
                },
                DevOperand {
                    ptr: kc,
                    ty: bf(vec![64, 128]),
                },
                DevOperand {
                    ptr: bt,
                    ty: i(vec![2, max_blocks]),
                },
                DevOperand {
                    ptr: cl,
                    ty: i(vec![2]),
                },
            ],
            results: vec![DevOperand {
                ptr: out,
                ty: bf(vec![2, 256]),
            }],
            workspace: None,
        }
    }

    #[test]
    fn a_launch_not_prepared_before_capture_fails_the_capture_naming_key_and_op() {
        let mut f = Fixture::new();
        let b = &mut f.b;
        let buf = b.alloc(1 << 20, "operands").unwrap();
        let mut l = attention_launch(buf, buf, buf, buf, buf, 8);
        gpu_bodies::lower(b, &mut l, false);
        let key = Key::new(2, 1, 0);
        b.begin_capture(key).unwrap();
        let e = b.launch(&l).unwrap_err();
        assert!(
            matches!(&e, BackendError::CaptureFailed { key: k, op, .. } if *k == key && op.starts_with("paged_attention_bf16")),
            "{e:?}"
        );
        assert!(e.to_string().contains("prepare()"), "{e}");
        b.abort_capture().unwrap();
        // Eagerly the same launch prepares itself and runs.
        b.launch(&l).unwrap();
        assert!(f.violations().is_empty(), "{:?}", f.violations());
    }

    #[test]
    fn a_failed_end_of_capture_names_the_last_op_recorded() {
        let cfg = Config {
            fail_end_capture: true,
            ..Config::default()
        };
        let mut f = Fixture::with(cfg, 0);
        let b = &mut f.b;
        let x = b.alloc(256, "x").unwrap();
        let l = add_launch(x, x, x, 64);
        b.prepare(&l).unwrap();
        let key = Key::new(1, 2, 1);
        b.begin_capture(key).unwrap();
        b.launch(&l).unwrap();
        let e = b.end_capture().unwrap_err();
        assert!(
            matches!(&e, BackendError::CaptureFailed { key: k, op, message } if *k == key && op == "add_f32" && message.contains("Invalidated")),
            "{e:?}"
        );
        // The backend is usable again.
        b.launch(&l).unwrap();
        b.synchronize().unwrap();
    }

    #[test]
    fn a_failed_instantiation_is_a_capture_failure_and_leaks_no_graph() {
        let cfg = Config {
            fail_instantiate: true,
            ..Config::default()
        };
        let mut f = Fixture::with(cfg, 0);
        f.b.begin_capture(Key::new(1, 1, 0)).unwrap();
        let e = f.b.end_capture().unwrap_err();
        assert!(
            matches!(&e, BackendError::CaptureFailed { op, .. } if op == "graph instantiate"),
            "{e:?}"
        );
        let log = f.log();
        assert!(
            log.iter().any(|l| l.starts_with("graph_destroy")),
            "{log:?}"
        );
    }

    #[test]
    fn kernel_source_is_compiled_once_per_device_and_then_served_from_the_cache() {
        let cache = tempfile::tempdir().unwrap();
        let tu = kernels_translation_unit().unwrap();
        let images = kernel_images("gfx90a", &tu, None).unwrap();
        let mut compiles = Vec::new();
        for _ in 0..2 {
            let sim = SimHip::new(Config::default());
            let trace = sim.trace.clone();
            let mut b = open(sim, 0, cache.path()).unwrap();
            b.load_kernels(&images).unwrap();
            let c = b.driver();
            compiles.push((
                trace.borrow().rtc_compiles,
                c.kernels_compiled,
                c.kernel_cache_hits,
            ));
        }
        assert_eq!(compiles, vec![(1, 1, 0), (0, 0, 1)]);
        // Another architecture compiles again.
        let sim = SimHip::new(Config {
            devices: vec!["gfx1100".into()],
            ..Config::default()
        });
        let trace = sim.trace.clone();
        let mut b = open(sim, 0, cache.path()).unwrap();
        b.load_kernels(&images).unwrap();
        assert_eq!(trace.borrow().rtc_compiles, 1);
    }

    #[test]
    fn code_objects_for_another_architecture_or_cuda_images_are_refused_with_the_fix() {
        let mut f = Fixture::new();
        let wrong = KernelImage {
            name: "kiln_kernels".into(),
            kind: ImageKind::CodeObject,
            code: SimHip::code_object("gfx1100"),
        };
        let e = f.b.load_kernels(&[wrong]).unwrap_err().to_string();
        assert!(
            e.contains("no code for this device") && e.contains("--target hip:gfx90a"),
            "{e}"
        );
        let right = KernelImage {
            name: "kiln_kernels".into(),
            kind: ImageKind::CodeObject,
            code: SimHip::code_object("gfx90a:xnack-"),
        };
        f.b.load_kernels(&[right]).unwrap();
        let cubin = KernelImage {
            name: "norm".into(),
            kind: ImageKind::Cubin,
            code: vec![1, 2, 3],
        };
        let e = f.b.load_kernels(&[cubin]).unwrap_err().to_string();
        assert!(e.contains("Cubin") && e.contains("hip:gfx90a"), "{e}");
    }

    #[test]
    fn a_kernel_missing_from_the_modules_is_refused_at_prepare() {
        let mut cfg = Config::default();
        cfg.functions.remove("add_f32");
        let mut f = Fixture::with(cfg, 0);
        let x = f.b.alloc(64, "x").unwrap();
        let e = f.b.prepare(&add_launch(x, x, x, 16)).unwrap_err();
        assert!(
            matches!(&e, BackendError::MissingKernel(k) if k == "add_f32"),
            "{e:?}"
        );
    }

    #[test]
    fn out_of_memory_names_the_request() {
        let cfg = Config {
            memory: 1 << 20,
            ..Config::default()
        };
        let mut f = Fixture::with(cfg, 0);
        match f.b.alloc(2 << 20, "k cache 3").unwrap_err() {
            BackendError::OutOfMemory { bytes, what } => {
                assert_eq!((bytes, what.as_str()), (2 << 20, "k cache 3"))
            }
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn each_backend_binds_its_own_device_on_every_call() {
        let cfg = Config {
            devices: vec!["gfx1030".into(), "gfx90a:sramecc+:xnack-".into()],
            ..Config::default()
        };
        let mut on1 = Fixture::with(cfg.clone(), 1);
        let mut on0 = Fixture::with(cfg, 0);
        assert_eq!(on1.b.info().arch, "gfx90a");
        assert_eq!(on1.b.info().ordinal, 1);
        assert_eq!(on0.b.info().arch, "gfx1030");
        assert_eq!(on1.b.driver().target_id(), "gfx90a:sramecc+:xnack-");
        // Interleaved use: every allocation lands on the backend's own device.
        for _ in 0..3 {
            on1.b.alloc(64, "a").unwrap();
            on0.b.alloc(64, "b").unwrap();
        }
        assert!(on1
            .log()
            .iter()
            .filter(|l| l.starts_with("malloc"))
            .all(|l| l.ends_with("@1")));
        assert!(on0
            .log()
            .iter()
            .filter(|l| l.starts_with("malloc"))
            .all(|l| l.ends_with("@0")));
        let cache = tempfile::tempdir().unwrap();
        let e = open(SimHip::new(Config::default()), 1, cache.path()).unwrap_err();
        let e = e.to_string();
        assert!(e.to_lowercase().contains("no hip device 1"), "{e}");
    }
}

/// The shared contract bodies (`contract/mod.rs`, also run on cpu and the
/// simulated GPU driver) on the one GPU backend over this file's simulated
/// HIP driver, through the HIP adapter (`kiln_runtime::gpu::hip`).
mod on_gpu_backend {
    use super::contract::{f32_operand, Gemm, Target};
    use super::sim::{Config, SimHip};
    use kiln_ir::Op;
    use kiln_runtime::backend::{
        Backend, DevPtr, Launch, LaunchBody, ResolvedKernel, ResolvedParam,
    };
    use kiln_runtime::gpu::hip::HipGpuDriver;
    use kiln_runtime::gpu::GpuBackend;
    use kiln_runtime::hip::catalog::kernels_translation_unit;
    use kiln_runtime::hip::offline::kernel_images;

    type B = GpuBackend<HipGpuDriver<SimHip>>;

    struct Hip(tempfile::TempDir);

    fn hip() -> Option<Hip> {
        Some(Hip(tempfile::tempdir().unwrap()))
    }

    impl Target for Hip {
        type B = B;
        fn open(&self) -> B {
            let driver =
                HipGpuDriver::new(SimHip::new(Config::default())).with_cache_dir(self.0.path());
            let mut b = GpuBackend::with_driver(driver, 0).unwrap();
            let tu = kernels_translation_unit().unwrap();
            b.load_kernels(&kernel_images(&b.info().arch, &tu, None).unwrap())
                .unwrap();
            b
        }
        fn add(&self, a: DevPtr, b: DevPtr, c: DevPtr, n: u32) -> Launch {
            Launch {
                kernel: "add_f32".into(),
                op: Op::Add,
                args: vec![f32_operand(a, vec![n]), f32_operand(b, vec![n])],
                results: vec![f32_operand(c, vec![n])],
                workspace: None,
                const_args: 0,
                body: LaunchBody::Kernels(vec![ResolvedKernel {
                    module: "elementwise".into(),
                    entry: "add_f32".into(),
                    grid: [4, 1, 1],
                    block: [256, 1, 1],
                    shared_bytes: 0,
                    params: vec![
                        ResolvedParam::Ptr(a),
                        ResolvedParam::Ptr(b),
                        ResolvedParam::Ptr(c),
                        ResolvedParam::I64(n.into()),
                    ],
                    pdl: true,
                    cluster: 1,
                }]),
            }
        }
        fn gemm(&self, g: Gemm, ws: Option<(DevPtr, u64)>) -> Launch {
            g.launch(
                ws,
                LaunchBody::Gemm {
                    shape: g.shape(),
                    kind: kiln_ir::plan::GemmKind::Blas,
                    kernel: None,
                },
            )
        }
        fn replays(&self, b: &B) -> u64 {
            b.counters().graphs.replays()
        }
        fn require_workspace(&self, b: &mut B, bytes: u64) -> bool {
            b.driver_mut().hip_mut().cfg.gemm_algos = vec![(bytes, true)];
            true
        }
    }

    contract_tests!(hip(), workspace);
}
