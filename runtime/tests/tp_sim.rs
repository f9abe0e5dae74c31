//! The GPU backend's tensor-parallel path in CI: `TpBackend` over two
//! simulated GPU ranks (`SimDriver::with_exchange`), each a `GpuBackend`
//! with its own stream and graphs. A step (a kernel, then an all-reduce
//! lowered as `Lowering::Collective`) is captured on every rank and
//! replayed with inputs that change every step; every rank holds the
//! rank-order sum, every rank's graph is launched, and a rank whose graph
//! launch fails stops the other (waiting in its all-reduce) with an error
//! naming it. The CUDA form of the same path (NCCL) is `cuda_tp.rs`.

use kiln_ir::{DType, Key, Op, TensorType};
use kiln_runtime::backend::{
    Backend, DevOperand, DevPtr, Launch, LaunchBody, ResolvedKernel, ResolvedParam,
};
use kiln_runtime::gpu::sim::{JournalHandle, SimConfig, SimDriver};
use kiln_runtime::gpu::GpuBackend;
use kiln_runtime::tp::{CpuExchange, TpBackend};
use std::time::Duration;

const N: u32 = 64;

fn f32_operand(ptr: DevPtr) -> DevOperand {
    DevOperand {
        ptr,
        ty: TensorType::new(DType::F32, vec![N]),
    }
}

fn add(a: DevPtr, b: DevPtr, c: DevPtr) -> Launch {
    Launch {
        kernel: "add_f32".into(),
        op: Op::Add,
        args: vec![f32_operand(a), f32_operand(b)],
        results: vec![f32_operand(c)],
        workspace: None,
        const_args: 0,
        body: LaunchBody::Kernels(vec![ResolvedKernel {
            module: "sim".into(),
            entry: "add_f32".into(),
            grid: [1, 1, 1],
            block: [64, 1, 1],
            shared_bytes: 0,
            params: vec![
                ResolvedParam::Ptr(a),
                ResolvedParam::Ptr(b),
                ResolvedParam::Ptr(c),
                ResolvedParam::I32(N as i32),
            ],
            pdl: false,
            cluster: 1,
        }]),
    }
}

fn all_reduce(x: DevPtr, y: DevPtr, ranks: u32) -> Launch {
    Launch {
        kernel: "all_reduce".into(),
        op: Op::AllReduce {
            ranks,
            out: DType::F32,
        },
        args: vec![f32_operand(x)],
        results: vec![f32_operand(y)],
        workspace: None,
        const_args: 0,
        body: LaunchBody::Collective,
    }
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `ranks` simulated GPU ranks behind one tp backend, with each rank's
/// journal; `fail` makes rank `.0`'s `.1`-th graph launch fail.
fn ranks(ranks: u32, fail: Option<(u32, u32)>) -> (TpBackend, Vec<JournalHandle>) {
    let (group, control) = CpuExchange::group_with_timeout(ranks, None);
    let mut journals = Vec::new();
    let backends: Vec<Box<dyn Backend + Send>> = group
        .into_iter()
        .enumerate()
        .map(|(r, ex)| {
            let mut d = SimDriver::new(SimConfig::cuda()).with_exchange(std::sync::Arc::new(ex));
            if let Some((fr, nth)) = fail {
                if fr == r as u32 {
                    d.fail_on("graph_launch", nth);
                }
            }
            journals.push(d.journal());
            let image = d.builtin_image();
            let mut b = GpuBackend::with_driver(d, 0).unwrap();
            b.load_kernels(&[image]).unwrap();
            Box::new(b) as Box<dyn Backend + Send>
        })
        .collect();
    let be = TpBackend::new(backends).unwrap().with_control(control);
    (be, journals)
}

struct Step {
    x: DevPtr,
    w: DevPtr,
    p: DevPtr,
    y: DevPtr,
}

/// Allocates the step's buffers, uploads each rank's weight `w_r[i] = r +
/// i / 8` and captures `y = all_reduce(x + w)` on every rank.
fn capture(be: &mut TpBackend, n: u32) -> (Step, kiln_runtime::backend::GraphHandle) {
    let s = Step {
        x: be.alloc(N as u64 * 4, "x").unwrap(),
        w: be.alloc(N as u64 * 4, "w").unwrap(),
        p: be.alloc(N as u64 * 4, "partial").unwrap(),
        y: be.alloc(N as u64 * 4, "y").unwrap(),
    };
    for r in 0..n {
        let w: Vec<f32> = (0..N).map(|i| r as f32 + i as f32 / 8.0).collect();
        be.upload_rank(r, s.w, &bytes(&w)).unwrap();
    }
    let step = [add(s.x, s.w, s.p), all_reduce(s.p, s.y, n)];
    for l in &step {
        be.prepare(l).unwrap();
    }
    be.begin_capture(Key::new(1, 1, 0)).unwrap();
    for l in &step {
        be.launch(l).unwrap();
    }
    let g = be.end_capture().unwrap();
    (s, g)
}

#[test]
fn an_all_reduce_captured_on_simulated_gpu_ranks_replays_the_rank_order_sum_on_every_rank() {
    let n = 2;
    let (mut be, journals) = ranks(n, None);
    let (s, g) = capture(&mut be, n);
    for step in 0..5 {
        let x: Vec<f32> = (0..N).map(|i| (i * 3 + step * 7) as f32 * 0.25).collect();
        be.upload(s.x, &bytes(&x)).unwrap();
        be.replay(g).unwrap();
        be.synchronize().unwrap();
        // The independent computation: sum over ranks of x + w_r.
        let want: Vec<f32> = (0..N as usize)
            .map(|i| {
                (0..n)
                    .map(|r| x[i] + (r as f32 + i as f32 / 8.0))
                    .fold(0f32, |a, v| a + v)
            })
            .collect();
        for r in 0..n {
            let mut out = vec![0u8; N as usize * 4];
            be.download_rank(r, s.y, &mut out).unwrap();
            assert_eq!(floats(&out), want, "rank {r}, step {step}");
        }
    }
    for (r, j) in journals.iter().enumerate() {
        let log = j.read().log;
        let launches = log.iter().filter(|l| l.starts_with("graph_launch")).count();
        assert_eq!(launches, 5, "rank {r}'s graph launches");
        // The all-reduce was recorded into the graph, not run at capture.
        assert_eq!(
            log.iter()
                .filter(|l| l.starts_with("all_reduce_sum"))
                .count(),
            1,
            "rank {r}"
        );
        assert!(j.read().violations.is_empty(), "{:?}", j.read().violations);
    }
}

#[test]
fn a_simulated_rank_whose_graph_launch_fails_stops_the_rank_waiting_in_its_all_reduce() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (mut be, _) = ranks(2, Some((1, 2)));
        let (s, g) = capture(&mut be, 2);
        be.upload(s.x, &bytes(&[1.0; N as usize])).unwrap();
        be.replay(g).unwrap();
        let first = be.replay(g).err().map(|e| e.to_string());
        let second = be.replay(g).err().map(|e| e.to_string());
        let _ = tx.send((first, second));
    });
    let (first, second) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a rank hung in its all-reduce (or the body panicked)");
    let first = first.expect("the failing replay errs");
    assert!(first.contains("rank 1 failed"), "{first}");
    assert!(
        first.contains("graph_launch") || first.contains("sim"),
        "{first}"
    );
    let second = second.expect("a stopped group errs");
    assert!(second.contains("stopped"), "{second}");
}

/// The first maximum of `row` (NaN skipped; 0 when all are NaN): the
/// unsharded argmax the cross-rank one must equal.
fn argmax(row: &[f32]) -> i32 {
    let mut best: Option<(f32, usize)> = None;
    for (i, &v) in row.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(b, _)| v > b) {
            best = Some((v, i));
        }
    }
    best.map_or(0, |(_, i)| i as i32)
}

#[test]
fn a_captured_sharded_argmax_on_simulated_gpu_ranks_is_the_argmax_of_the_whole_row() {
    let (ranks_n, rows, vs) = (2u32, 4usize, 5usize);
    let (mut be, journals) = ranks(ranks_n, None);
    let x = be.alloc((rows * vs * 4) as u64, "logits shard").unwrap();
    let y = be.alloc((rows * 4) as u64, "next tokens").unwrap();
    let l = Launch {
        kernel: "sharded_argmax".into(),
        op: Op::ShardedArgmax { ranks: ranks_n },
        args: vec![DevOperand {
            ptr: x,
            ty: TensorType::new(DType::F32, vec![rows as u32, vs as u32]),
        }],
        results: vec![DevOperand {
            ptr: y,
            ty: TensorType::new(DType::I32, vec![rows as u32]),
        }],
        workspace: None,
        const_args: 0,
        body: LaunchBody::Collective,
    };
    be.prepare(&l).unwrap();
    be.begin_capture(Key::new(rows as u32, 1, 0)).unwrap();
    be.launch(&l).unwrap();
    let g = be.end_capture().unwrap();
    for step in 0..4u32 {
        // Whole rows: a tie across ranks (the lower index wins), NaNs, an
        // all-NaN row, and values that move every step.
        let full: Vec<Vec<f32>> = (0..rows)
            .map(|r| {
                (0..ranks_n as usize * vs)
                    .map(|i| match r {
                        0 => [1.0, 3.0, 2.0, 3.0, 0.0][i % vs] + step as f32,
                        1 if i % 3 == 0 => f32::NAN,
                        1 => ((i * 7 + step as usize * 3) % 11) as f32,
                        2 => f32::NAN,
                        _ => -((i as f32 - step as f32 * 2.0).abs()),
                    })
                    .collect()
            })
            .collect();
        for rank in 0..ranks_n as usize {
            let shard: Vec<f32> = full
                .iter()
                .flat_map(|row| row[rank * vs..(rank + 1) * vs].to_vec())
                .collect();
            be.upload_rank(rank as u32, x, &bytes(&shard)).unwrap();
        }
        be.replay(g).unwrap();
        let want: Vec<i32> = full.iter().map(|r| argmax(r)).collect();
        for rank in 0..ranks_n {
            let mut out = vec![0u8; rows * 4];
            be.download_rank(rank, y, &mut out).unwrap();
            let got: Vec<i32> = out
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(got, want, "rank {rank}, step {step}");
        }
    }
    for j in &journals {
        let n = j
            .read()
            .log
            .iter()
            .filter(|l| l.starts_with("graph_launch"))
            .count();
        assert_eq!(n, 4);
    }
}
