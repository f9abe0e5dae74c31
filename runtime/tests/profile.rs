//! `Engine::profile_ops` (`kiln bench --profile`): every planned op of a step
//! timed between its own pair of marks, and the per-op byte model the report
//! puts next to the times.
//!
//! A logging backend wraps the CPU backend and records the order of marks,
//! launches and elapsed-time reads, so the test checks where the marks are
//! taken, not only that times come out.

mod common;

use common::*;
use kiln_ir::plan::{KernelImage, Plan};
use kiln_ir::{Key, Op};
use kiln_runtime::backend::{DevPtr, GraphHandle, Launch, TimingMark};
use kiln_runtime::{
    op_bytes, Backend, BackendError, CpuBackend, DeviceInfo, Engine, GraphMode, PROFILE_WINDOW,
};
use std::sync::{Arc, Mutex};

#[derive(Clone, Debug, PartialEq, Eq)]
enum Event {
    /// A mark, numbered in the order taken.
    Mark(u64),
    /// A launch of the op with this catalog kernel name.
    Launch(String),
    /// An elapsed-time read between two marks (their numbers).
    Elapsed(u64, u64),
}

/// The CPU backend, recording marks, launches and elapsed reads.
struct Logging {
    inner: CpuBackend,
    log: Arc<Mutex<Vec<Event>>>,
    marks: u64,
}

type R<T> = Result<T, BackendError>;

impl Backend for Logging {
    fn info(&self) -> DeviceInfo {
        self.inner.info()
    }
    fn alloc(&mut self, bytes: u64, what: &str) -> R<DevPtr> {
        self.inner.alloc(bytes, what)
    }
    fn free(&mut self, ptr: DevPtr) -> R<()> {
        self.inner.free(ptr)
    }
    fn upload(&mut self, dst: DevPtr, data: &[u8]) -> R<()> {
        self.inner.upload(dst, data)
    }
    fn download(&mut self, src: DevPtr, out: &mut [u8]) -> R<()> {
        self.inner.download(src, out)
    }
    fn load_kernels(&mut self, images: &[KernelImage]) -> R<()> {
        self.inner.load_kernels(images)
    }
    fn reserve_workspace(&mut self, bytes: u64) -> R<Option<(DevPtr, u64)>> {
        self.inner.reserve_workspace(bytes)
    }
    fn prepare(&mut self, launch: &Launch) -> R<()> {
        self.inner.prepare(launch)
    }
    fn launch(&mut self, launch: &Launch) -> R<()> {
        self.log
            .lock()
            .unwrap()
            .push(Event::Launch(launch.kernel.clone()));
        self.inner.launch(launch)
    }
    fn synchronize(&mut self) -> R<()> {
        self.inner.synchronize()
    }
    fn begin_capture(&mut self, key: Key) -> R<()> {
        self.inner.begin_capture(key)
    }
    fn end_capture(&mut self) -> R<GraphHandle> {
        self.inner.end_capture()
    }
    fn replay(&mut self, graph: GraphHandle) -> R<()> {
        self.inner.replay(graph)
    }
    fn destroy_graph(&mut self, graph: GraphHandle) -> R<()> {
        self.inner.destroy_graph(graph)
    }
    fn mark(&mut self) -> R<TimingMark> {
        let mut m = self.inner.mark()?;
        m.event = Some(self.marks);
        self.log.lock().unwrap().push(Event::Mark(self.marks));
        self.marks += 1;
        Ok(m)
    }
    fn elapsed_ms(&mut self, from: TimingMark, to: TimingMark) -> R<f32> {
        self.log.lock().unwrap().push(Event::Elapsed(
            from.event.expect("a logged mark"),
            to.event.expect("a logged mark"),
        ));
        self.inner.elapsed_ms(from, to)
    }
}

fn model() -> TinyModel {
    TinyModel {
        // Enough layers for more ops than one window of marks.
        layers: 6,
        keys: vec![Key::new(1, 1, 0), Key::new(2, 1, 0)],
        ..TinyModel::default()
    }
}

fn logging_engine(plan: &Plan, dir: &std::path::Path) -> (Engine, Arc<Mutex<Vec<Event>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let be = Logging {
        inner: CpuBackend::new(),
        log: log.clone(),
        marks: 0,
    };
    let e = Engine::new(plan.clone(), dir, Box::new(be), options(GraphMode::Off)).unwrap();
    (e, log)
}

#[test]
fn profiling_marks_before_the_first_op_and_after_every_op_and_reads_each_op_between_its_own_marks()
{
    let (dir, plan) = build(&model());
    let key = Key::new(2, 1, 0);
    let kernels: Vec<String> = plan
        .key_plan(key)
        .unwrap()
        .ops
        .iter()
        .map(|o| o.kernel.clone())
        .collect();
    assert!(
        kernels.len() > PROFILE_WINDOW,
        "the plan has {} ops: too few to cross a window of marks",
        kernels.len()
    );
    let (mut e, log) = logging_engine(&plan, dir.path());
    log.lock().unwrap().clear();
    let before = e.counters()[&key].eager_steps;
    let (warmup, reps) = (2, 3);
    let p = e.profile_ops(key, 9, warmup, reps).unwrap();

    // The expected order, built from the plan: warm-up steps without marks,
    // then per timed step and window a mark, each op followed by a mark,
    // and the reads of consecutive marks.
    let mut want = Vec::new();
    for _ in 0..warmup {
        want.extend(kernels.iter().cloned().map(Event::Launch));
    }
    let mut m = 0;
    for _ in 0..reps {
        for window in kernels.chunks(PROFILE_WINDOW) {
            let first = m;
            want.push(Event::Mark(m));
            m += 1;
            for k in window {
                want.push(Event::Launch(k.clone()));
                want.push(Event::Mark(m));
                m += 1;
            }
            want.extend((first..m - 1).map(|i| Event::Elapsed(i, i + 1)));
        }
    }
    assert_eq!(*log.lock().unwrap(), want);

    assert_eq!(p.key, key);
    assert_eq!(p.reps, reps);
    assert_eq!(p.ops.len(), kernels.len());
    let kp = plan.key_plan(key).unwrap();
    for (i, (o, op)) in p.ops.iter().zip(&kp.ops).enumerate() {
        assert_eq!(o.index as usize, i);
        assert_eq!(o.mnemonic, op.op.mnemonic());
        // A CPU plan runs one reference kernel per op.
        assert_eq!(o.classes, vec![format!("cpu.{}", op.kernel)]);
        assert_eq!(o.bytes, op_bytes(op, &plan.kv, 9));
        assert!(o.median_ms >= 0.0 && o.median_ms.is_finite(), "{o:?}");
    }
    assert!(p.total_ms() > 0.0);
    assert_eq!(p.launches(), kp.launches);
    assert_eq!(
        e.counters()[&key].eager_steps - before,
        (warmup + reps) as u64,
        "profiled steps count as eager steps"
    );
}

#[test]
fn profiling_is_refused_for_zero_steps_and_for_an_unknown_key() {
    let (dir, plan) = build(&model());
    let (mut e, _) = logging_engine(&plan, dir.path());
    let err = e.profile_ops(Key::new(2, 1, 0), 9, 0, 0).unwrap_err();
    assert!(err.to_string().contains("at least one"), "{err}");
    let err = e.profile_ops(Key::new(4, 1, 0), 9, 0, 1).unwrap_err();
    assert!(err.to_string().contains("b2q1s0"), "{err}");
}

/// The byte model against figures computed here from the tiny model's
/// config (hidden 32, 4 heads of 8, 2 KV heads, vocab 61): a
/// projection moves its input, whole weight and output; an embedding the ids, the
/// gathered rows and its output; attention reads K and V of every context
/// position of each sequence.
#[test]
fn op_bytes_count_operands_once_gathered_rows_only_and_the_kv_read_at_the_context() {
    let (_dir, plan) = build(&model());
    let kp = plan.key_plan(Key::new(2, 1, 0)).unwrap();
    let numel = |dims: &[u32]| dims.iter().map(|&d| d as u64).product::<u64>();
    let mut seen = (0, 0, 0);
    for op in &kp.ops {
        match &op.op {
            Op::Embedding => {
                // ids i32[2], two rows of 32 gathered, [2, 32] written.
                let es = op.args[1].ty.dtype.size() as u64;
                assert_eq!(op_bytes(op, &plan.kv, 9), 2 * 4 + 2 * (2 * 32 * es));
                seen.0 += 1;
            }
            Op::MatMul { .. } | Op::FusedMatMul { .. } => {
                // Every operand (input, whole weight, output; a fused
                // GEMV's norm weight, residual or bias too) once.
                let size = |o: &kiln_ir::plan::Operand| {
                    o.ty.dtype.size() as u64 * numel(o.ty.shape.dims())
                };
                let want: u64 = op.args.iter().chain(&op.results).map(size).sum();
                assert_eq!(op_bytes(op, &plan.kv, 9), want, "{}", op.kernel);
                assert_eq!(op.args[0].ty.shape.dims()[0], 2, "two tokens per step");
                assert!(numel(op.args[1].ty.shape.dims()) >= 32 * 32);
                seen.1 += 1;
            }
            Op::PagedAttention(..) => {
                // 2 sequences x (K + V) x 2 KV heads x 8 dims per position
                // of context.
                let per_position = 2 * 2 * 2 * 8 * plan.kv.dtype.size() as u64;
                assert_eq!(
                    op_bytes(op, &plan.kv, 10) - op_bytes(op, &plan.kv, 9),
                    per_position
                );
                assert_eq!(
                    op_bytes(op, &plan.kv, 20) - op_bytes(op, &plan.kv, 10),
                    10 * per_position
                );
                seen.2 += 1;
            }
            _ => {}
        }
    }
    assert!(
        seen.0 == 1 && seen.1 > 0 && seen.2 == 6,
        "ops seen: {seen:?}"
    );
}
