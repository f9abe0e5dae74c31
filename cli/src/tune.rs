//! `kiln tune`: measures, on the device, how fast each GEMM shape of a plan
//! runs as each implementation kiln can record (`gemv`, `skinny`, `blas`),
//! and writes the winners as a tuning table for `kiln compile --tuning`.
//!
//! Why a separate command: the GEMM choice is a compile-time decision in
//! the plan, and timing at load was noisy and made the runtime lower. Here
//! each candidate is launched through the `Backend` trait exactly as a plan
//! would launch it (the catalog's launch for the kernel kinds, one BLAS-Lt
//! call under the plan's workspace for `blas`), timed between the backend's
//! event marks, one launch per sample, and the median kept.
//!
//! Not here: writing plans (tables feed `kiln compile`), and any fuzzy
//! matching of shapes (an entry is for its exact shape; see
//! `kiln_kernels::tuning`).

use kiln_ir::plan::{GemmKind, GemmShape, Lowering, Plan, Target};
use kiln_ir::{DType, Op, TensorType};
use kiln_kernels::gpu::{gemm_kernel_call, gemm_kind_applies, LowerOptions, Param};
use kiln_kernels::tuning::{fingerprint_hex, TuningEntry, TuningTable};
use kiln_runtime::backend::{
    Backend, DevOperand, DevPtr, Launch, LaunchBody, ResolvedKernel, ResolvedParam,
};
use kiln_runtime::{open_backend, DeviceSpec};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Command-line arguments of `kiln tune`.
#[derive(clap::Args, Debug, Clone)]
pub struct TuneArgs {
    /// The compiled plan (`*.kiln`, a GPU target) whose GEMM shapes to time.
    pub plan: PathBuf,
    /// Weight values: only `random` (a GEMM's time does not depend on them).
    #[arg(long, default_value = "random")]
    pub weights: String,
    /// Execution device: `cuda`, `cuda:<N>`, `hip` or `hip:<N>`.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Timed launches per candidate (the median is kept).
    #[arg(long, default_value_t = 30)]
    pub reps: u32,
    /// Where to write the table; entries already there for other shapes or
    /// targets are kept.
    #[arg(short = 'o', long, default_value = "tuning.json")]
    pub output: PathBuf,
}

/// The distinct GEMM shapes of a plan, in first-use order.
pub fn plan_gemm_shapes(plan: &Plan) -> Vec<GemmShape> {
    let mut v: Vec<GemmShape> = Vec::new();
    for op in plan.keys.iter().flat_map(|k| &k.ops) {
        if let Lowering::Gemm { shape, .. } = &op.lowering {
            if !v.contains(shape) {
                v.push(*shape);
            }
        }
    }
    v
}

/// Random finite 16-bit (bf16 / f16) or f32 values in about [-1, 1).
fn random_bytes(d: DType, n: u64, seed: &mut u64) -> Vec<u8> {
    let mut next = || {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    };
    let mut out = Vec::with_capacity((n * d.size() as u64) as usize);
    for _ in 0..n {
        let v = next();
        match d {
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            _ => out.extend_from_slice(&v.to_le_bytes()),
        }
    }
    out
}

/// The kernel modules every candidate of `plan`'s GEMM shapes launches
/// (`gemm_kernel_call`'s), whether or not the plan uses them.
pub fn candidate_modules(plan: &Plan) -> std::collections::BTreeSet<String> {
    let mut m = std::collections::BTreeSet::new();
    for shape in plan_gemm_shapes(plan) {
        for kind in GemmKind::ALL {
            if gemm_kind_applies(kind, &plan.meta.target, &shape) {
                if let Some(c) = gemm_kernel_call(kind, &shape, true) {
                    m.insert(c.module.to_string());
                }
            }
        }
    }
    m
}

/// The plan's kernel images plus those of the candidate modules it does
/// not embed: a plan carries only the modules its own choices launch (a
/// plan whose b8 GEMMs run as cuBLASLt holds no `skinny`), and every
/// candidate must be timed. The missing ones are compiled for the plan's
/// target as `kiln compile` would (through the kernel image cache); where
/// that fails (no NVRTC on this machine, say) the plan's own images are
/// used and the candidates they lack are skipped with the reason.
fn candidate_images(plan: &Plan) -> Vec<kiln_ir::plan::KernelImage> {
    let mut images = plan.kernels.clone();
    let missing: std::collections::BTreeSet<String> = candidate_modules(plan)
        .into_iter()
        .filter(|m| !images.iter().any(|i| &i.name == m))
        .collect();
    if missing.is_empty() {
        return images;
    }
    match kiln_compiler::compile::kernel_images(&plan.meta.target, &missing) {
        Ok(more) => images.extend(more.into_iter().filter(|i| missing.contains(&i.name))),
        Err(e) => eprintln!(
            "kiln tune: the plan does not embed the candidate modules {missing:?} and they \
             could not be compiled here ({e}); their candidates are skipped"
        ),
    }
    images
}

/// Times every applicable implementation of every GEMM shape of `plan` on
/// `b` and returns the table entries (one per shape).
pub fn tune_plan(b: &mut dyn Backend, plan: &Plan, reps: u32) -> anyhow::Result<Vec<TuningEntry>> {
    let target = plan.meta.target.clone();
    if target == Target::Cpu {
        anyhow::bail!(
            "the plan targets cpu, whose matmuls run the reference kernel: there is no GEMM choice to tune; compile for a GPU target (kiln compile --target cuda:sm_90)"
        );
    }
    let pdl = LowerOptions::for_target(&target, 1).pdl;
    b.load_kernels(&candidate_images(plan))?;
    let ws = b.reserve_workspace(plan.workspace_bytes)?;
    let device = b.info().name;
    let fingerprint = fingerprint_hex();
    let mut seed = 0x5eed_u64;
    let mut entries = Vec::new();
    for shape in plan_gemm_shapes(plan) {
        let ty = |d: DType, dims: Vec<u32>| TensorType::new(d, dims);
        let mut put =
            |b: &mut dyn Backend, t: TensorType, what: &str| -> anyhow::Result<DevOperand> {
                let p = b.alloc(t.size_bytes(), what)?;
                b.upload(p, &random_bytes(t.dtype, t.numel(), &mut seed))?;
                Ok(DevOperand { ptr: p, ty: t })
            };
        let x = put(b, ty(shape.dtype, vec![shape.t, shape.k]), "tune x")?;
        let w = put(b, ty(shape.dtype, vec![shape.n, shape.k]), "tune w")?;
        let mut args = vec![x, w];
        if shape.bias {
            args.push(put(b, ty(shape.dtype, vec![shape.n]), "tune bias")?);
        }
        let out = put(b, ty(shape.out, vec![shape.t, shape.n]), "tune out")?;
        let mut median_us = BTreeMap::new();
        for kind in GemmKind::ALL {
            if !gemm_kind_applies(kind, &target, &shape) {
                continue;
            }
            let kernel = gemm_kernel_call(kind, &shape, true).map(|c| ResolvedKernel {
                module: c.module.to_string(),
                entry: c.entry,
                grid: c.grid,
                block: c.block,
                shared_bytes: c.shared_bytes,
                cluster: c.cluster,
                params: c
                    .params
                    .iter()
                    .map(|p| match p {
                        Param::Arg(i) => ResolvedParam::Ptr(args[*i].ptr),
                        Param::Result(_) => ResolvedParam::Ptr(out.ptr),
                        Param::I32(v) => ResolvedParam::I32(*v),
                        Param::I64(v) => ResolvedParam::I64(*v),
                        Param::F32(v) => ResolvedParam::F32(*v),
                        _ => ResolvedParam::Ptr(DevPtr(0)),
                    })
                    .collect(),
                pdl,
            });
            let launch = Launch {
                kernel: format!("tune:{kind}"),
                op: Op::MatMul {
                    bias: shape.bias,
                    out: shape.out,
                },
                args: args.clone(),
                results: vec![out.clone()],
                workspace: ws,
                const_args: 0b10,
                body: LaunchBody::Gemm {
                    shape,
                    kind,
                    kernel,
                },
            };
            // A candidate the device cannot run (no BLAS algorithm within
            // the workspace, say) is left out, not fatal.
            if let Err(e) = b.prepare(&launch) {
                eprintln!("kiln tune: {kind} skipped for {shape:?}: {e}");
                continue;
            }
            for _ in 0..3 {
                b.launch(&launch)?;
            }
            let mut times = Vec::with_capacity(reps as usize);
            for _ in 0..reps.max(1) {
                let from = b.mark()?;
                b.launch(&launch)?;
                let to = b.mark()?;
                times.push(b.elapsed_ms(from, to)? as f64 * 1e3);
            }
            b.synchronize()?;
            times.sort_by(|a, b| a.total_cmp(b));
            median_us.insert(kind.name().to_string(), times[times.len() / 2]);
        }
        for o in args.iter().chain(std::iter::once(&out)) {
            b.free(o.ptr)?;
        }
        let best = median_us
            .iter()
            .min_by(|a, b| a.1.total_cmp(b.1))
            .and_then(|(k, _)| k.parse::<GemmKind>().ok())
            .ok_or_else(|| anyhow::anyhow!("no implementation could run GEMM {shape:?}"))?;
        entries.push(TuningEntry {
            target: target.to_string(),
            device: device.clone(),
            shape,
            fingerprint: fingerprint.clone(),
            best,
            median_us,
        });
    }
    Ok(entries)
}

/// Runs `kiln tune`; returns the lines to print.
pub fn run(args: &TuneArgs) -> anyhow::Result<String> {
    if args.weights != "random" {
        anyhow::bail!(
            "--weights {}: kiln tune times with random weights only (a GEMM's time does not depend on the values); pass --weights random",
            args.weights
        );
    }
    let plan = kiln_runtime::loader::read_plan_file(&args.plan)?;
    let spec: DeviceSpec = args.device.parse()?;
    let mut table = if args.output.is_file() {
        TuningTable::read(&args.output)?
    } else {
        TuningTable::new()
    };
    let mut b = open_backend(spec)?;
    let entries = tune_plan(b.as_mut(), &plan, args.reps)?;
    let mut s = String::new();
    for e in entries {
        let times: Vec<String> = e
            .median_us
            .iter()
            .map(|(k, us)| format!("{k} {us:.1} us"))
            .collect();
        s.push_str(&format!(
            "GEMM {}x{}x{} {} -> {}{}: {} -> {}\n",
            e.shape.t,
            e.shape.n,
            e.shape.k,
            e.shape.dtype,
            e.shape.out,
            if e.shape.bias { " +bias" } else { "" },
            times.join(", "),
            e.best
        ));
        table.record(e);
    }
    std::fs::write(&args.output, table.to_json())
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", args.output.display()))?;
    s.push_str(&format!(
        "wrote {} ({} entries); use it with kiln compile --tuning {}\n",
        args.output.display(),
        table.entries.len(),
        args.output.display()
    ));
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_compiler::compile::{compile_dir, CompileOptions};
    use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};

    fn plan(target: &str) -> Plan {
        let dir = tempfile::tempdir().unwrap();
        write_tiny_model(
            dir.path(),
            Family::Llama,
            &TinySpec::for_family(Family::Llama),
        )
        .unwrap();
        let opts = CompileOptions {
            keys: vec!["b1q1s0".parse().unwrap(), "b3q1s0".parse().unwrap()],
            target: target.parse().unwrap(),
            // One-token matmuls stay GEMMs to tune (fused, they are
            // kiln's GEMV whatever a table says).
            dense_fusion: false,
            ..CompileOptions::default()
        };
        compile_dir(dir.path(), &opts, &mut |_, _| {}).unwrap().plan
    }

    #[test]
    fn the_shapes_to_tune_are_each_distinct_gemm_of_the_plan_once() {
        let p = plan("hip:gfx1100");
        let shapes = plan_gemm_shapes(&p);
        let all: Vec<GemmShape> = p
            .keys
            .iter()
            .flat_map(|k| &k.ops)
            .filter_map(|op| match &op.lowering {
                Lowering::Gemm { shape, .. } => Some(*shape),
                _ => None,
            })
            .collect();
        assert!(all.len() > shapes.len(), "fused layers repeat shapes");
        for s in &all {
            assert_eq!(shapes.iter().filter(|x| *x == s).count(), 1);
        }
        assert!(shapes.iter().any(|s| s.t == 1) && shapes.iter().any(|s| s.t == 3));
    }

    #[test]
    fn a_plan_whose_gemms_run_as_blas_still_names_the_skinny_and_gemv_modules_to_time() {
        let p = plan("cuda:sm_90");
        let used: Vec<&str> = p.kernels.iter().map(|i| i.name.as_str()).collect();
        assert!(
            !used.contains(&"skinny"),
            "this plan's b3 GEMMs default to cuBLASLt, so it embeds no skinny: {used:?}"
        );
        let m = candidate_modules(&p);
        assert!(m.contains("skinny") && m.contains("gemv"), "{m:?}");
    }

    #[test]
    fn tuning_a_cpu_plan_is_refused_with_the_fix() {
        let p = plan("cpu");
        let mut b = kiln_runtime::cpu::CpuBackend::new();
        let e = tune_plan(&mut b, &p, 3).unwrap_err().to_string();
        assert!(
            e.contains("no GEMM choice") && e.contains("--target"),
            "{e}"
        );
    }
}
