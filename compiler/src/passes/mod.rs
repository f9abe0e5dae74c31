//! Graph-to-graph passes run on every traced key before planning.
//!
//! The pipeline ([`DEFAULT_PIPELINE`]) is: dead-code elimination, then the
//! fusions (`add` + `rms_norm` into `add_rms_norm`; q/k/v projections +
//! `[head_rms_norm]` + `rope` + `kv_write` into one stacked matmul and
//! `qkv_rope_kv_write`; gate/up projections + `silu_mul` into one stacked
//! matmul and the one-argument `silu_mul`; then the GEMV prologues and
//! epilogues: RMSNorm, SiLU/GELU*up and the residual add folded into the
//! matmuls as `fused_matmul`; then, where the target runs it, the packed
//! q/k/v projection and its `qkv_rope_kv_write` as one `matmul_qkv_rope`).
//! Every pass ends with the
//! canonical rebuild of [`editor::Editor::finish`] (schedule, dead-code
//! removal, dense renumbering), so each pass's output is deterministic and
//! prints densely.
//!
//! By default the verifier runs on the input and after every pass, and a
//! failure names the pass that broke the graph; with that off it still runs
//! once on the result, whose [`GraphInfo`] the planner requires. Fusions that need new
//! weights add [`kiln_ir::WeightSource::ConcatRows`] entries to the shared
//! manifest; [`weights::prune`] then drops what no graph reads.
//!
//! The one target fact a pass uses is whether the target's kernels run a
//! fused op it is about to form (`fuse-matmul` asks the kernel catalog, so
//! a GPU key of more than 8 tokens keeps its unfused ops and their GEMMs);
//! [`run_pipeline`] is the CPU form, where every fusion is legal.
//!
//! [`megakernel`] is the one pass that runs after planning: it turns a
//! planned key into a megakernel's task tape (`--schedule megakernel`).
//!
//! Not here: scheduling for memory (program order is the schedule; the
//! planner places buffers), or any other target-specific choice.

mod editor;
mod fuse;
pub use fuse::{dense_fuse_override, quant_fuse_override};
pub mod megakernel;
pub mod shard;
#[doc(hidden)]
pub mod synth;
pub mod verify;
pub mod weights;

pub use editor::has_side_effects;

use kiln_ir::plan::Target;
use kiln_ir::{Graph, GraphInfo, WeightManifest};
use std::fmt;

/// One pass of the pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pass {
    /// Dead-code elimination and dense renumbering.
    Dce,
    /// `add` + `rms_norm` of the sum -> `add_rms_norm`.
    FuseAddRmsNorm,
    /// q/k/v matmuls + `[head_rms_norm]` + `rope` + `kv_write` -> stacked
    /// matmul + `qkv_rope_kv_write`.
    FuseQkvRopeKvWrite,
    /// `qkv_rope_kv_write` + the `paged_attention` reading its q and caches
    /// -> `rope_attention` (GPU targets only; `kiln compile` also drops it
    /// for the megakernel schedule, whose interpreter runs the two as tasks).
    /// Opt-in (`kiln compile --rope-attention`), not in [`DEFAULT_PIPELINE`].
    FuseRopeAttention,
    /// gate/up matmuls + `silu_mul` -> stacked matmul + one-argument `silu_mul`.
    FuseGateUp,
    /// RMSNorm prologues and SiLU/GELU*up / residual-add epilogues folded
    /// into matmuls -> `fused_matmul`, where the target's kernels run it.
    FuseMatMul,
    /// `fuse-matmul` with the megakernel interpreter's rule (what
    /// `--schedule megakernel` runs instead of it on GPU targets): keys of
    /// up to eight tokens fuse (the interpreter's GEMV tiles take eight),
    /// and the lm_head keeps its argmax separate, because a fused argmax
    /// is a whole-op task that one block would run alone.
    FuseMatMulTape,
    /// `fuse-matmul` with the graph schedule's default GPU rule (what GPU
    /// targets run without `--fused-gemv`): dense matmuls in one-token
    /// keys, matmuls over weights kept quantized in keys of up to eight
    /// tokens (see `FuseRule::GRAPH_DEFAULT` for the measurements).
    FuseMatMulGraph,
    /// `fuse-matmul-graph` without its dense fusions: what GPU targets
    /// run with `--matmul-qkv-rope` (the dense rope GEMV takes no RMSNorm
    /// prologue, so the packed q/k/v matmul stays plain for it).
    FuseMatMulQuant,
    /// The packed q/k/v projection + `qkv_rope_kv_write` ->
    /// `matmul_qkv_rope`, where the target's kernels run it: one-token
    /// keys on CUDA through kiln's GEMV (dense, or over a weight kept
    /// quantized in an integer-dot type), and (so the CPU reference runs
    /// what a GPU plan runs) weights kept quantized on the CPU. It runs
    /// after `fuse-matmul`, whose RMSNorm prologue the fused op keeps. In
    /// [`DEFAULT_PIPELINE`]; on GPU targets `compile` keeps it, swaps it
    /// for `fuse-matmul-qkv-rope-pairs` or drops it as
    /// `CompileOptions::matmul_qkv_rope` says.
    FuseMatMulQkvRope,
    /// `fuse-matmul-qkv-rope` for layers whose heads have no q/k norm only
    /// (the kernels' pair epilogue; `QkvRopeFusion::Pairs`).
    FuseMatMulQkvRopePairs,
}

impl Pass {
    pub fn name(self) -> &'static str {
        match self {
            Pass::Dce => "dce",
            Pass::FuseAddRmsNorm => "fuse-add-rms-norm",
            Pass::FuseQkvRopeKvWrite => "fuse-qkv-rope-kv-write",
            Pass::FuseRopeAttention => "fuse-rope-attention",
            Pass::FuseGateUp => "fuse-gate-up",
            Pass::FuseMatMul => "fuse-matmul",
            Pass::FuseMatMulTape => "fuse-matmul-tape",
            Pass::FuseMatMulGraph => "fuse-matmul-graph",
            Pass::FuseMatMulQuant => "fuse-matmul-quant",
            Pass::FuseMatMulQkvRope => "fuse-matmul-qkv-rope",
            Pass::FuseMatMulQkvRopePairs => "fuse-matmul-qkv-rope-pairs",
        }
    }
}

impl fmt::Display for Pass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The passes `kiln compile` runs, in order.
///
/// `fuse-rope-attention` is not among them: `kiln compile --rope-attention`
/// adds it (after `fuse-qkv-rope-kv-write`). Its kernels are correct on an
/// H100 but the fused step measured 5-19% slower than the pair there
/// (bench/results/gpu-2026-12-05-s20/).
pub const DEFAULT_PIPELINE: [Pass; 6] = [
    Pass::Dce,
    Pass::FuseAddRmsNorm,
    Pass::FuseQkvRopeKvWrite,
    Pass::FuseGateUp,
    Pass::FuseMatMul,
    Pass::FuseMatMulQkvRope,
];

/// Why the pipeline stopped.
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error("graph `{graph}` is malformed before any pass ran:\n  {}\nthis is a frontend bug; please report it with the model's config.json", .errors.join("\n  "))]
    BadInput { graph: String, errors: Vec<String> },
    #[error("pass `{pass}` produced a malformed graph `{graph}`:\n  {}\nthis is a compiler bug; please report it (`--no-verify` skips this check)", .errors.join("\n  "))]
    Verify {
        pass: Pass,
        graph: String,
        errors: Vec<String>,
    },
    #[error("graph `{graph}` is malformed after the passes:\n  {}\nper-pass verification was off, so the pass that broke it is unknown; rerun without `--no-verify` to name it", .errors.join("\n  "))]
    Unverified { graph: String, errors: Vec<String> },
    #[error("pass `{pass}` failed on graph `{graph}`: {message}")]
    Failed {
        pass: Pass,
        graph: String,
        message: String,
    },
}

/// Counts of what the pipeline changed, for reports and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassStats {
    pub nodes_before: usize,
    pub nodes_after: usize,
    pub add_rms_norm: u32,
    pub qkv_rope_kv_write: u32,
    pub rope_attention: u32,
    pub gate_up: u32,
    /// Epilogues `fuse-matmul` joined to a matmul (residual add, SiLU/GELU*up,
    /// argmax).
    pub matmul_epilogues: u32,
    /// RMSNorm prologues `fuse-matmul` joined to a matmul.
    pub matmul_prologues: u32,
    /// `matmul_qkv_rope` ops formed.
    pub matmul_qkv_rope: u32,
}

/// Runs one pass for the CPU target.
pub fn run_pass(
    pass: Pass,
    graph: Graph,
    manifest: &mut WeightManifest,
    stats: &mut PassStats,
) -> Result<Graph, PassError> {
    run_pass_for(pass, graph, manifest, stats, &Target::Cpu)
}

/// Runs one pass for `target` (see the module docs for what it decides).
pub fn run_pass_for(
    pass: Pass,
    graph: Graph,
    manifest: &mut WeightManifest,
    stats: &mut PassStats,
    target: &Target,
) -> Result<Graph, PassError> {
    let name = graph.name.clone();
    let failed = |message: String| PassError::Failed {
        pass,
        graph: name.clone(),
        message,
    };
    let mut ed = editor::Editor::new(graph);
    match pass {
        Pass::Dce => {}
        Pass::FuseAddRmsNorm => {
            stats.add_rms_norm += fuse::add_rms_norm(&mut ed).map_err(failed)?.0
        }
        Pass::FuseQkvRopeKvWrite => {
            stats.qkv_rope_kv_write += fuse::qkv_rope_kv_write(&mut ed, manifest)
                .map_err(failed)?
                .0
        }
        // The CPU gains nothing from it (its caches and q live in host memory
        // either way), so CPU pipelines leave the pair as traced.
        Pass::FuseRopeAttention if matches!(target, Target::Cpu) => {}
        Pass::FuseRopeAttention => {
            stats.rope_attention += fuse::rope_attention(&mut ed).map_err(failed)?.0
        }
        Pass::FuseGateUp => stats.gate_up += fuse::gate_up(&mut ed, manifest).map_err(failed)?.0,
        Pass::FuseMatMul => {
            let c = fuse::fuse_matmul(&mut ed, target, fuse::FuseRule::GRAPH).map_err(failed)?;
            stats.matmul_epilogues += c.epilogues;
            stats.matmul_prologues += c.prologues;
        }
        Pass::FuseMatMulTape => {
            let c = fuse::fuse_matmul(&mut ed, target, fuse::FuseRule::TAPE).map_err(failed)?;
            stats.matmul_epilogues += c.epilogues;
            stats.matmul_prologues += c.prologues;
        }
        Pass::FuseMatMulGraph => {
            let c = fuse::fuse_matmul(&mut ed, target, fuse::FuseRule::graph_default())
                .map_err(failed)?;
            stats.matmul_epilogues += c.epilogues;
            stats.matmul_prologues += c.prologues;
        }
        Pass::FuseMatMulQuant => {
            let c = fuse::fuse_matmul(
                &mut ed,
                target,
                fuse::FuseRule {
                    dense: false,
                    ..fuse::FuseRule::graph_default()
                },
            )
            .map_err(failed)?;
            stats.matmul_epilogues += c.epilogues;
            stats.matmul_prologues += c.prologues;
        }
        Pass::FuseMatMulQkvRope => {
            stats.matmul_qkv_rope += fuse::matmul_qkv_rope(&mut ed, target, true)
                .map_err(failed)?
                .0
        }
        Pass::FuseMatMulQkvRopePairs => {
            stats.matmul_qkv_rope += fuse::matmul_qkv_rope(&mut ed, target, false)
                .map_err(failed)?
                .0
        }
    }
    ed.finish().map_err(failed)
}

/// The megakernel schedule's context split of attention
/// (`fuse::split_attention`) for a tape of `queues` queues, on a verified
/// graph; the result is verified again (its [`GraphInfo`] is what the
/// planner takes). Returns how many attentions were split.
pub fn split_attention(
    graph: Graph,
    manifest: &WeightManifest,
    queues: u32,
) -> Result<(Graph, GraphInfo, u32), PassError> {
    let name = graph.name.clone();
    let mut ed = editor::Editor::new(graph);
    let failed = |message: String| PassError::Failed {
        pass: Pass::Dce,
        graph: name.clone(),
        message: format!("split-attention: {message}"),
    };
    let n = fuse::split_attention(&mut ed, queues).map_err(failed)?.0;
    let g = ed.finish().map_err(failed)?;
    let info = kiln_ir::verify(&g, Some(manifest))
        .map_err(|e| failed(format!("produced a malformed graph: {e}")))?;
    Ok((g, info, n))
}

/// Runs `passes` in order, verifying the input and every pass's output when
/// `verify` is set. The result is verified either way: its [`GraphInfo`] is
/// what the planner requires, so nothing is planned from unverified IR
/// (`verify` off only stops naming the pass that broke a graph).
///
/// This is the CPU form; [`run_pipeline_for`] names the target.
pub fn run_pipeline(
    graph: Graph,
    manifest: &mut WeightManifest,
    passes: &[Pass],
    verify: bool,
) -> Result<(Graph, GraphInfo, PassStats), PassError> {
    run_pipeline_for(graph, manifest, passes, verify, &Target::Cpu)
}

/// [`run_pipeline`] for `target`: fusions form only ops its kernels run.
pub fn run_pipeline_for(
    graph: Graph,
    manifest: &mut WeightManifest,
    passes: &[Pass],
    verify: bool,
    target: &Target,
) -> Result<(Graph, GraphInfo, PassStats), PassError> {
    pipeline(graph, manifest, passes, verify, |p, g, m, s| {
        run_pass_for(p, g, m, s, target)
    })
}

/// [`run_pipeline`] with the pass application as a parameter, so tests can
/// check what happens when a pass misbehaves.
fn pipeline(
    graph: Graph,
    manifest: &mut WeightManifest,
    passes: &[Pass],
    verify: bool,
    mut apply: impl FnMut(Pass, Graph, &mut WeightManifest, &mut PassStats) -> Result<Graph, PassError>,
) -> Result<(Graph, GraphInfo, PassStats), PassError> {
    let mut stats = PassStats {
        nodes_before: graph.nodes.len(),
        ..PassStats::default()
    };
    let mut info = None;
    if verify {
        info =
            Some(
                verify::verify(&graph, Some(manifest)).map_err(|errors| PassError::BadInput {
                    graph: graph.name.clone(),
                    errors,
                })?,
            );
    }
    let mut g = graph;
    for &pass in passes {
        g = apply(pass, g, manifest, &mut stats)?;
        if verify {
            info =
                Some(
                    verify::verify(&g, Some(manifest)).map_err(|errors| PassError::Verify {
                        pass,
                        graph: g.name.clone(),
                        errors,
                    })?,
                );
        }
    }
    let info = match info {
        Some(info) => info,
        None => verify::verify(&g, Some(manifest)).map_err(|errors| PassError::Unverified {
            graph: g.name.clone(),
            errors,
        })?,
    };
    stats.nodes_after = g.nodes.len();
    Ok((g, info, stats))
}

#[cfg(test)]
mod tests {
    use super::*;
    use synth::{SynthFamily, SynthSpec};

    #[test]
    fn a_pass_that_breaks_the_graph_is_named_and_never_reaches_the_planner() {
        let spec = SynthSpec::tiny(SynthFamily::Llama);
        let key = kiln_ir::Key::new(2, 1, 0);
        let g = spec.graph(key, &spec.kv_layout(16, 9, 64), false);
        // A gate/up fusion that forgets to declare the weight it reads.
        let broken = |pass: Pass, g: Graph, m: &mut WeightManifest, s: &mut PassStats| {
            let mut g = run_pass(pass, g, m, s)?;
            if pass == Pass::FuseGateUp {
                g.weights.pop();
            }
            Ok(g)
        };
        let mut m = spec.manifest();
        let e = pipeline(g.clone(), &mut m, &DEFAULT_PIPELINE, true, broken).unwrap_err();
        assert!(
            matches!(
                e,
                PassError::Verify {
                    pass: Pass::FuseGateUp,
                    ..
                }
            ),
            "{e}"
        );
        let text = e.to_string();
        assert!(text.contains("pass `fuse-gate-up`"), "{text}");
        assert!(text.contains("--no-verify"), "{text}");
        // With per-pass verification off the break is still caught before
        // anything could plan it, without the pass's name. (It must be the
        // last pass run: a later pass's canonical rebuild re-declares every
        // weight a node reads, which would repair this particular break.)
        let upto: Vec<Pass> = DEFAULT_PIPELINE
            .iter()
            .copied()
            .take_while(|p| *p != Pass::FuseGateUp)
            .chain([Pass::FuseGateUp])
            .collect();
        let mut m = spec.manifest();
        let e = pipeline(g, &mut m, &upto, false, broken).unwrap_err();
        assert!(matches!(e, PassError::Unverified { .. }), "{e}");
        assert!(e.to_string().contains("without `--no-verify`"), "{e}");
    }
}
