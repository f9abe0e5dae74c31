//! Timing one key's step through the loaded engine, for `kiln bench`.
//!
//! Benchmarks load plans exactly as serving does (the same checks, regions,
//! weights, prepared launches and captured graphs), so what they time is what
//! serves. [`Engine::time_steps`] stages a synthetic but valid full batch for
//! a key (every sequence `context` tokens long in blocks of its own, the null
//! block never addressed, random token ids and drafts), then times graph
//! replays or eager steps between the backend's timing marks
//! (`Backend::mark` / `Backend::elapsed_ms`: device events on GPU backends,
//! the host clock otherwise). Steps timed here count in the key's counters
//! like any other.
//!
//! [`Engine::profile_ops`] times each planned op on its own: eager steps
//! with a mark before the first op and after every op, so op `i` lies
//! between two consecutive marks. Marks between ops serialize the launches
//! (on GPUs no programmatic-dependent-launch overlap, and the device may
//! wait for the host's next launch), so the sum of the per-op times exceeds
//! a replayed step; the ratio says by how much. Marks are taken in windows
//! of [`PROFILE_WINDOW`] ops and read back after each window, because GPU
//! backends keep a bounded ring of live events. Each op comes with its
//! kernel classes ([`launch_classes`]) and the bytes the cost model says it
//! moves ([`op_bytes`]) so reports can group ops and put their bandwidth
//! next to the device's.
//!
//! Not here: output readback (a timed step downloads nothing), the
//! dispatcher and padding (a timed step is always the key's full batch), and
//! any report formatting (the CLI's `bench` module).

use super::{Engine, EngineError, KeyRt};
use crate::backend::Backend;
use kiln_ir::plan::{KvLayout, Lowering, PlanOp, Region};
use kiln_ir::{AttnAttrs, Key, Op};

/// How a timed step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepMode {
    /// Replay of the key's captured graph (captured first if needed).
    Graph,
    /// The key's launches issued one by one.
    Eager,
}

/// Step times of one key in one mode, in milliseconds.
#[derive(Clone, Debug, PartialEq)]
pub struct StepTimes {
    pub mode: StepMode,
    /// Timed steps (after the warm-up ones).
    pub reps: u32,
    pub median_ms: f64,
    /// The timed steps' mean: the statistic to set `collective_ms` (also a
    /// mean) against, since a median and a mean of a few steps on a busy
    /// machine need not be ordered.
    pub mean_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    /// `reps` steps issued back to back between two marks, divided by `reps`
    /// (no per-step mark in between).
    pub back_to_back_ms: f64,
    /// Time the key's graph capture took (the capture that made the graph,
    /// which may predate this call); `None` in eager mode.
    pub capture_ms: Option<f64>,
    /// Tensor-parallel plans: milliseconds per timed step spent inside
    /// collectives (waiting for the other ranks included), the largest of
    /// any rank's; `None` where the backend cannot tell (or has no ranks).
    pub collective_ms: Option<f64>,
}

/// What a key's plan and its loaded form hold, for reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyFacts {
    pub key: Key,
    /// Launches per step as the plan counts them.
    pub launches: u32,
    /// Bytes the plan says one step moves (at the compiled maximum context).
    pub bytes_moved: u64,
    /// The plan's arena and BLAS workspace (shared by every key).
    pub arena_bytes: u64,
    pub workspace_bytes: u64,
    /// The key's own Io region (staging inputs and outputs).
    pub io_bytes: u64,
}

/// One planned op's time in a profiled step ([`Engine::profile_ops`]).
#[derive(Clone, Debug, PartialEq)]
pub struct OpTime {
    /// Index of the op in the key's plan (`kiln inspect` order).
    pub index: u32,
    /// The op's IR mnemonic (`matmul`, `paged_attention`, ...).
    pub mnemonic: String,
    /// The plan's kernel catalog name of the op.
    pub kernel: String,
    /// The kernel class of each of the op's launches, in stream order
    /// ([`launch_classes`]); its length is the op's launches per step.
    pub classes: Vec<String>,
    /// Bytes the op moves at the profiled context ([`op_bytes`]).
    pub bytes: u64,
    /// Median over the timed steps of the time between the marks around
    /// the op, in milliseconds.
    pub median_ms: f64,
}

/// Every op of one key's step, timed on its own ([`Engine::profile_ops`]).
#[derive(Clone, Debug, PartialEq)]
pub struct StepProfile {
    pub key: Key,
    /// Tokens per sequence of the timed batch.
    pub context: u32,
    /// Timed steps (after the warm-up ones).
    pub reps: u32,
    /// One entry per planned op, in plan order.
    pub ops: Vec<OpTime>,
}

impl StepProfile {
    /// The sum of the ops' median times (milliseconds): the profiled step.
    pub fn total_ms(&self) -> f64 {
        self.ops.iter().map(|o| o.median_ms).sum()
    }

    /// Launches per step of the profiled ops.
    pub fn launches(&self) -> u32 {
        self.ops.iter().map(|o| o.classes.len() as u32).sum()
    }
}

/// Ops timed between one pair of read-backs in [`Engine::profile_ops`]:
/// `PROFILE_WINDOW + 1` marks stay live at once, fewer than the 64 events
/// a GPU backend keeps.
pub const PROFILE_WINDOW: usize = 32;
const _: () = assert!((PROFILE_WINDOW as u64) < crate::gpu::EVENT_RING);

/// The kernel class of each launch of `op`, in stream order: `module.entry`
/// of a kernel (the entry keeps its dtype and tile suffix, e.g.
/// `gemv.gemv_t1_bf16_bf16`); for a GEMM run by the vendor library
/// `blas.gemm_<dtype>_<out>`; `collective.<mnemonic>` for a collective;
/// `cpu.<kernel>` for a CPU reference kernel.
pub fn launch_classes(op: &PlanOp) -> Vec<String> {
    match &op.lowering {
        Lowering::Reference => vec![format!("cpu.{}", op.kernel)],
        Lowering::Kernels(ks) => ks
            .iter()
            .map(|k| format!("{}.{}", k.module, k.entry))
            .collect(),
        Lowering::Collective => vec![format!("collective.{}", op.op.mnemonic())],
        Lowering::Gemm {
            shape,
            kind,
            kernel,
        } => vec![match kernel {
            Some(k) => format!("{}.{}", k.module, k.entry),
            None => format!("{}.gemm_{}_{}", kind.name(), shape.dtype, shape.out),
        }],
    }
}

/// Bytes `op` moves in one step with every sequence `context` tokens long,
/// per the planner's cost model applied to one op: each operand read or
/// written once at its full size (weights included, quantized ones at
/// their stored size as `kiln bench`'s HBM floor counts them: an op reads
/// its whole weight, even where another op shares it), except that an `embedding`
/// reads only the table rows it gathers, KV cache operands count only the
/// rows touched (attention reads K and V of every context position of each
/// sequence, or of its sliding window; a KV write writes K and V of each
/// token).
pub fn op_bytes(op: &PlanOp, kv: &KvLayout, context: u32) -> u64 {
    let kv_row = kv.kv_heads as u64 * kv.head_dim as u64 * kv.dtype.size() as u64;
    let cache =
        |o: &kiln_ir::plan::Operand| matches!(o.buf.region, Region::KCache(_) | Region::VCache(_));
    let rows = |o: Option<&kiln_ir::plan::Operand>| {
        o.and_then(|o| o.ty.shape.dims().first().copied())
            .unwrap_or(0) as u64
    };
    let mut total = 0u64;
    for (i, a) in op.args.iter().enumerate() {
        if cache(a) {
            continue;
        }
        total += if op.op == Op::Embedding && i == 1 {
            op.results.first().map_or(0, |r| r.ty.size_bytes())
        } else {
            a.ty.stored_bytes()
        };
    }
    total += op
        .results
        .iter()
        .filter(|r| !cache(r))
        .map(|r| r.ty.size_bytes())
        .sum::<u64>();
    match &op.op {
        Op::PagedAttention(AttnAttrs { window, .. }) => {
            // args: q, kc, vc, block tables [batch, blocks], context lengths.
            let read = window.map_or(context, |w| context.min(w)) as u64;
            total += 2 * rows(op.args.get(3)) * read * kv_row;
        }
        Op::KvWrite | Op::QkvRopeKvWrite { .. } => {
            total += 2 * rows(op.args.first()) * kv_row;
        }
        _ => {}
    }
    total
}

/// Synthetic staging of one full batch: each sequence `context` tokens long,
/// sequence `b` owning blocks `1 + b*n .. 1 + (b+1)*n` (block 0 is the null
/// block), the step's `query` tokens at the last positions of the context.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct SyntheticBatch {
    pub token_ids: Vec<i32>,
    pub positions: Vec<i32>,
    pub slot_mapping: Vec<i32>,
    /// Row-major `[batch, max_blocks_per_seq]`.
    pub block_tables: Vec<i32>,
    pub context_lens: Vec<i32>,
    pub draft_tokens: Vec<i32>,
}

/// xorshift64*, for reproducible synthetic token ids.
fn next_random(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

pub(crate) fn synthetic_batch(
    key: Key,
    kv: &KvLayout,
    context: u32,
    vocab: u32,
    seed: u64,
) -> Result<SyntheticBatch, String> {
    let (b, q) = (key.batch, key.query);
    if context < q {
        return Err(format!(
            "a context of {context} tokens is shorter than the key's {q} query tokens; time a longer context"
        ));
    }
    let per_seq = context.div_ceil(kv.block_size);
    if per_seq > kv.max_blocks_per_seq {
        return Err(format!(
            "a context of {context} tokens needs {per_seq} blocks per sequence but the plan's block tables hold {} ({} tokens); time a shorter context or recompile with a longer max context",
            kv.max_blocks_per_seq,
            kv.max_blocks_per_seq * kv.block_size
        ));
    }
    let needed = 1 + b as u64 * per_seq as u64;
    if needed > kv.num_blocks as u64 {
        return Err(format!(
            "{b} sequences of {context} tokens need {needed} KV blocks but the plan's cache has {}; time a shorter context or recompile with more KV blocks",
            kv.num_blocks
        ));
    }
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut below = |n: u32| (next_random(&mut state) % n.max(1) as u64) as i32;
    let m = kv.max_blocks_per_seq as usize;
    let mut block_tables = vec![kv.null_block as i32; b as usize * m];
    for s in 0..b as usize {
        for j in 0..per_seq as usize {
            block_tables[s * m + j] = (1 + s * per_seq as usize + j) as i32;
        }
    }
    let mut positions = Vec::new();
    let mut slot_mapping = Vec::new();
    for s in 0..b as usize {
        for i in 0..q {
            let p = context - q + i;
            positions.push(p as i32);
            let blk = block_tables[s * m + (p / kv.block_size) as usize];
            slot_mapping.push(blk * kv.block_size as i32 + (p % kv.block_size) as i32);
        }
    }
    Ok(SyntheticBatch {
        token_ids: (0..b * q).map(|_| below(vocab)).collect(),
        positions,
        slot_mapping,
        block_tables,
        context_lens: vec![context as i32; b as usize],
        draft_tokens: (0..b * key.spec).map(|_| below(vocab)).collect(),
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Milliseconds `f` takes between two marks of `be`.
fn timed(
    be: &mut dyn Backend,
    f: impl FnOnce(&mut dyn Backend) -> Result<(), crate::BackendError>,
) -> Result<f64, EngineError> {
    let a = be.mark()?;
    f(be)?;
    let b = be.mark()?;
    Ok(be.elapsed_ms(a, b)? as f64)
}

fn launch_all(be: &mut dyn Backend, k: &KeyRt) -> Result<(), crate::BackendError> {
    k.launches.iter().try_for_each(|l| be.launch(l))
}

impl Engine {
    fn key_index(&self, key: Key) -> Result<usize, EngineError> {
        self.keys
            .iter()
            .position(|k| k.key == key)
            .ok_or_else(|| EngineError::Timing {
                key,
                message: format!(
                    "the plan has no such key (it has: {})",
                    self.keys
                        .iter()
                        .map(|k| k.key.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
    }

    /// The plan's and the loaded key's sizes, for reports.
    pub fn key_facts(&self, key: Key) -> Result<KeyFacts, EngineError> {
        let ki = self.key_index(key)?;
        let kp = &self.plan.keys[ki];
        Ok(KeyFacts {
            key,
            launches: if self.runs_megakernel(key) {
                2
            } else {
                kp.launches
            },
            bytes_moved: kp.bytes_moved,
            arena_bytes: self.plan.arena_bytes,
            workspace_bytes: self.plan.workspace_bytes,
            io_bytes: kp.io_bytes,
        })
    }

    /// The backend's measured memory bandwidth (bytes moved per second over
    /// a `bytes` buffer; see `Backend::copy_bandwidth`), `None` where it has
    /// none to measure.
    pub fn copy_bandwidth(&mut self, bytes: u64, reps: u32) -> Result<Option<f64>, EngineError> {
        Ok(self.backend.copy_bandwidth(bytes, reps)?)
    }

    /// Stages a synthetic full batch for `key` at `context` tokens per
    /// sequence (see the module docs), runs `warmup` untimed steps, then
    /// times `reps` steps in `mode`. Refused while sequences are live: the
    /// synthetic batch writes KV blocks the sequences may own.
    pub fn time_steps(
        &mut self,
        key: Key,
        mode: StepMode,
        context: u32,
        warmup: u32,
        reps: u32,
    ) -> Result<StepTimes, EngineError> {
        let ki = self.stage_timed_batch(key, context, reps)?;
        if mode == StepMode::Graph {
            self.capture_key(ki)?;
        }
        let k = &self.keys[ki];
        let be: &mut dyn Backend = self.backend.as_mut();
        let step = |be: &mut dyn Backend| -> Result<(), crate::BackendError> {
            match (mode, k.graph) {
                (StepMode::Graph, Some(g)) => be.replay(g),
                _ => launch_all(be, k),
            }
        };
        for _ in 0..warmup {
            step(be)?;
        }
        be.synchronize()?;
        let mut times = Vec::with_capacity(reps as usize);
        let coll_before = be.collective_ns();
        for _ in 0..reps {
            times.push(timed(be, step)?);
        }
        let collective_ms = per_step_max_ms(coll_before, be.collective_ns(), reps);
        let back_to_back = timed(be, |be| (0..reps).try_for_each(|_| step(be)))? / reps as f64;
        be.synchronize()?;
        let c = self.counters.get_mut(&key).expect("every key has counters");
        let steps = (warmup + 2 * reps) as u64;
        let capture_ms = match mode {
            StepMode::Graph => {
                c.replays += steps;
                Some(c.capture_time.as_secs_f64() * 1e3)
            }
            StepMode::Eager => {
                c.eager_steps += steps;
                None
            }
        };
        Ok(StepTimes {
            mode,
            reps,
            mean_ms: times.iter().sum::<f64>() / times.len().max(1) as f64,
            median_ms: median(&mut times),
            min_ms: times.iter().copied().fold(f64::INFINITY, f64::min),
            max_ms: times.iter().copied().fold(0.0, f64::max),
            back_to_back_ms: back_to_back,
            capture_ms,
            collective_ms,
        })
    }

    /// Checks that `key` can be timed (no live sequences, at least one
    /// step) and stages a synthetic full batch of `context` tokens per
    /// sequence for it; returns the key's index.
    fn stage_timed_batch(
        &mut self,
        key: Key,
        context: u32,
        reps: u32,
    ) -> Result<usize, EngineError> {
        let ki = self.key_index(key)?;
        if !self.seqs.is_empty() {
            return Err(EngineError::Timing {
                key,
                message: format!(
                    "{} sequence(s) are live and a timed step would overwrite their KV blocks; time on an engine with no sequences",
                    self.seqs.len()
                ),
            });
        }
        if reps == 0 {
            return Err(EngineError::Timing {
                key,
                message: "zero timed steps asked for; time at least one".into(),
            });
        }
        let batch = synthetic_batch(
            key,
            &self.plan.kv,
            context,
            self.plan.meta.info.vocab_size,
            11,
        )
        .map_err(|message| EngineError::Timing { key, message })?;
        self.stage_batch(ki, &batch)?;
        Ok(ki)
    }

    /// Stages a synthetic full batch for `key` as [`Engine::time_steps`]
    /// does, runs `warmup` untimed eager steps, then `reps` eager steps with
    /// a timing mark before the first op and after every op; returns each
    /// op's median time with its kernel classes and bytes (see the module
    /// docs: marks serialize the ops, so the sum exceeds a replayed step).
    /// Refused while sequences are live.
    pub fn profile_ops(
        &mut self,
        key: Key,
        context: u32,
        warmup: u32,
        reps: u32,
    ) -> Result<StepProfile, EngineError> {
        let ki = self.stage_timed_batch(key, context, reps)?;
        let k = &self.keys[ki];
        let be: &mut dyn Backend = self.backend.as_mut();
        for _ in 0..warmup {
            launch_all(be, k)?;
        }
        be.synchronize()?;
        let mut samples = vec![Vec::with_capacity(reps as usize); k.launches.len()];
        for _ in 0..reps {
            for (w, window) in k.launches.chunks(PROFILE_WINDOW).enumerate() {
                let mut marks = Vec::with_capacity(window.len() + 1);
                marks.push(be.mark()?);
                for l in window {
                    be.launch(l)?;
                    marks.push(be.mark()?);
                }
                for (i, pair) in marks.windows(2).enumerate() {
                    let ms = be.elapsed_ms(pair[0], pair[1])? as f64;
                    samples[w * PROFILE_WINDOW + i].push(ms);
                }
            }
        }
        be.synchronize()?;
        let c = self.counters.get_mut(&key).expect("every key has counters");
        c.eager_steps += (warmup + reps) as u64;
        if self.runs_megakernel(key) {
            // One persistent kernel: the step is one "op" (the reset and
            // the interpreter), whatever the tape's tasks.
            let kp = &self.plan.keys[ki];
            let bytes = kp
                .ops
                .iter()
                .map(|o| op_bytes(o, &self.plan.kv, context))
                .sum();
            return Ok(StepProfile {
                key,
                context,
                reps,
                ops: vec![OpTime {
                    index: 0,
                    mnemonic: "megakernel".into(),
                    kernel: self.keys[ki].launches[0].kernel.clone(),
                    classes: vec![
                        "megakernel.megakernel_reset".into(),
                        "megakernel.megakernel_run".into(),
                    ],
                    bytes,
                    median_ms: median(&mut samples[0]),
                }],
            });
        }
        let ops = self.plan.keys[ki]
            .ops
            .iter()
            .zip(&mut samples)
            .enumerate()
            .map(|(i, (op, times))| OpTime {
                index: i as u32,
                mnemonic: op.op.mnemonic().to_string(),
                kernel: op.kernel.clone(),
                classes: launch_classes(op),
                bytes: op_bytes(op, &self.plan.kv, context),
                median_ms: median(times),
            })
            .collect();
        Ok(StepProfile {
            key,
            context,
            reps,
            ops,
        })
    }

    /// Writes `batch` into key `ki`'s staging and uploads it.
    fn stage_batch(&mut self, ki: usize, batch: &SyntheticBatch) -> Result<(), EngineError> {
        let k = &mut self.keys[ki];
        let fields = [
            (Some(k.token_ids), &batch.token_ids),
            (k.positions, &batch.positions),
            (k.slots, &batch.slot_mapping),
            (k.block_tables, &batch.block_tables),
            (k.context_lens, &batch.context_lens),
            (k.drafts, &batch.draft_tokens),
        ];
        for (at, values) in fields {
            if let Some(s) = at {
                k.io_host[s.at..s.at + values.len()].copy_from_slice(values);
            }
        }
        self.upload_staging(ki)
    }
}

/// The largest per-rank growth from `before` to `after` (nanoseconds),
/// per step of `reps`, in milliseconds.
fn per_step_max_ms(before: Option<Vec<u64>>, after: Option<Vec<u64>>, reps: u32) -> Option<f64> {
    let (b, a) = (before?, after?);
    a.iter()
        .zip(&b)
        .map(|(a, b)| a.saturating_sub(*b))
        .max()
        .map(|ns| ns as f64 / 1e6 / reps.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_ir::DType;

    fn kv() -> KvLayout {
        KvLayout {
            layers: 2,
            kv_heads: 2,
            head_dim: 8,
            dtype: DType::BF16,
            block_size: 16,
            num_blocks: 40,
            null_block: 0,
            max_blocks_per_seq: 8,
        }
    }

    #[test]
    fn collective_time_per_step_is_the_busiest_ranks_growth_over_the_steps() {
        let ms = per_step_max_ms(
            Some(vec![5, 1_000_000]),
            Some(vec![8_000_005, 3_000_000]),
            4,
        );
        assert_eq!(ms, Some(2.0));
        assert_eq!(per_step_max_ms(None, Some(vec![1]), 1), None);
    }

    #[test]
    fn synthetic_batches_give_each_sequence_its_own_blocks_and_never_the_null_block() {
        let key = Key::new(3, 2, 1);
        let s = synthetic_batch(key, &kv(), 100, 1000, 5).unwrap();
        assert_eq!(s.token_ids.len(), 6);
        assert_eq!(s.draft_tokens.len(), 3);
        assert_eq!(s.context_lens, vec![100; 3]);
        assert_eq!(s.positions, vec![98, 99, 98, 99, 98, 99]);
        // 100 tokens = 7 blocks per sequence, disjoint, none the null block.
        let mut used = Vec::new();
        for b in 0..3 {
            let row = &s.block_tables[b * 8..b * 8 + 7];
            assert!(row.iter().all(|&x| x != 0));
            used.extend_from_slice(row);
            assert_eq!(
                s.block_tables[b * 8 + 7],
                0,
                "unused entries point at the null block"
            );
        }
        used.sort();
        used.dedup();
        assert_eq!(used.len(), 21);
        // The slot of position 99 of sequence 1: block 6 of its table, offset 3.
        assert_eq!(s.slot_mapping[3], s.block_tables[8 + 6] * 16 + 3);
        assert!(s.token_ids.iter().all(|&t| (0..1000).contains(&t)));
    }

    #[test]
    fn a_context_beyond_the_plan_is_refused_with_the_fix() {
        let e = synthetic_batch(Key::new(1, 1, 0), &kv(), 200, 1000, 1).unwrap_err();
        assert!(e.contains("shorter context"), "{e}");
        let e = synthetic_batch(Key::new(8, 1, 0), &kv(), 100, 1000, 1).unwrap_err();
        assert!(e.contains("KV blocks"), "{e}");
        let e = synthetic_batch(Key::new(1, 4, 3), &kv(), 2, 1000, 1).unwrap_err();
        assert!(e.contains("query tokens"), "{e}");
    }
}
