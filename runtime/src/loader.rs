//! Plan checks that run before anything is allocated: the target against the
//! executing device, and the plan's internal consistency: the plan
//! invariants (`kiln_ir::validate`: every buffer inside its region, every op
//! well typed, lowering against target, ...) and what the engine itself
//! reads (staging inputs and outputs present with the sizes their key
//! implies, a decode key).
//!
//! A plan is data from a file; the engine trusts nothing in it that it has not
//! checked here. Not here: weight files (see [`crate::weights`]) and the
//! artifact encoding (magic, version, checksum: `kiln_ir::artifact`, which
//! [`read_plan_file`] calls).

use crate::backend::DeviceInfo;
use crate::error::EngineError;
use kiln_ir::graph::InputRole;
use kiln_ir::plan::{KeyPlan, Plan, Region, Target};
use kiln_ir::validate::PlanInfo;
use kiln_ir::DType;
use std::collections::HashSet;

/// Reads and decodes a plan file (magic, version, length and checksum are
/// checked by `kiln_ir::artifact` before the body is decoded).
pub fn read_plan_file(path: &std::path::Path) -> Result<kiln_ir::plan::Plan, EngineError> {
    let bytes = std::fs::read(path).map_err(|e| EngineError::io(path, e))?;
    kiln_ir::artifact::decode(&bytes).map_err(|e| EngineError::Artifact {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Checks that a plan built for `target` can run on the device `info`
/// describes.
pub fn check_target(target: &Target, info: &DeviceInfo) -> Result<(), EngineError> {
    let ok = match target {
        Target::Cpu => info.backend == "cpu",
        Target::Cuda { sm } => info.backend == "cuda" && info.arch == format!("sm_{sm}"),
        Target::Hip { gfx } => info.backend == "hip" && info.arch == *gfx,
    };
    if ok {
        return Ok(());
    }
    let device_target = match info.backend {
        "cpu" => "cpu".to_string(),
        "cuda" => format!("cuda:{}", info.arch),
        "hip" => format!("hip:{}", info.arch),
        other => other.to_string(),
    };
    let plan_backend = match target {
        Target::Cpu => "cpu",
        Target::Cuda { .. } => "cuda",
        Target::Hip { .. } => "hip",
    };
    let fix = if plan_backend != info.backend {
        format!(
            "run it with --device {plan_backend}, or recompile with `kiln compile --target {device_target}`"
        )
    } else {
        format!("recompile the plan with `kiln compile --target {device_target}`")
    };
    Err(EngineError::TargetMismatch {
        plan: target.to_string(),
        backend: info.backend.to_string(),
        device: info.name.clone(),
        arch: info.arch.clone(),
        fix,
    })
}

/// Refuses a GPU plan whose kernel images were compiled from kernel
/// sources other than this runtime's (see `kiln_kernels::gpu::kernel_abi`).
pub fn check_kernel_abi(plan: &Plan) -> Result<(), EngineError> {
    let ours = kiln_kernels::gpu::kernel_abi();
    if plan.meta.target == Target::Cpu || plan.kernel_abi == ours {
        return Ok(());
    }
    Err(EngineError::StaleKernels {
        target: plan.meta.target.to_string(),
        compiler: plan.meta.compiler_version.clone(),
        plan: plan.kernel_abi,
        runtime: ours,
    })
}

/// Checks a plan's internal consistency (the plan invariants of
/// `kiln_ir::validate`, then what the engine needs of each key's staging
/// inputs and named outputs). Allocates nothing.
pub fn validate_plan(plan: &Plan) -> Result<PlanInfo, EngineError> {
    let info =
        kiln_ir::validate::validate(plan).map_err(|e| EngineError::BadPlan(e.to_string()))?;
    let bad = |m: String| Err(EngineError::BadPlan(m));
    let model = &plan.meta.info;
    if model.max_context < 2 || model.vocab_size == 0 {
        return bad(format!(
            "model context {} / vocabulary {} is too small",
            model.max_context, model.vocab_size
        ));
    }
    for kp in &plan.keys {
        validate_key(plan, kp)?;
    }
    if !plan
        .keys
        .iter()
        .any(|k| k.key.query == 1 && k.key.spec == 0)
    {
        return bad("the plan has no decode key (query 1, spec 0), so no sequence can finish its prompt or decode; compile with e.g. --keys b1q1s0".into());
    }
    Ok(info)
}

/// The engine's needs of one key's staging inputs and named outputs (their
/// bounds are already checked by `kiln_ir::validate`).
fn validate_key(plan: &Plan, kp: &KeyPlan) -> Result<(), EngineError> {
    let key = kp.key;
    let bad = |m: String| Err(EngineError::BadPlan(format!("key {key}: {m}")));
    let (b, q, s) = (key.batch as u64, key.query as u64, key.spec as u64);
    let m = plan.kv.max_blocks_per_seq as u64;
    let mut roles = HashSet::new();
    for (role, buf) in &kp.inputs {
        if !role.is_staging() {
            continue;
        }
        if !roles.insert(*role) {
            return bad(format!("input {} is declared twice", role.name()));
        }
        if buf.region != Region::Io {
            return bad(format!(
                "staging input {} lives in {:?}, not the key's Io region",
                role.name(),
                buf.region
            ));
        }
        if buf.offset % 4 != 0 {
            return bad(format!(
                "input {} at Io offset {} is not aligned for i32",
                role.name(),
                buf.offset
            ));
        }
        let elems = match role {
            InputRole::TokenIds | InputRole::Positions | InputRole::SlotMapping => b * q,
            InputRole::BlockTables => b * m,
            InputRole::ContextLens => b,
            InputRole::DraftTokens => b * s,
            InputRole::SampleParams | InputRole::SampleSeeds => b * 4,
            InputRole::SamplePenalties => {
                // i32[b, 2 + 2P]: any P the IR's typing accepted.
                let w = buf.bytes / (4 * b.max(1));
                let max_w = 2 + 2 * kiln_ir::op::MAX_PENALTY_SLOTS as u64;
                if w < 4 || w % 2 != 0 || w > max_w {
                    return bad(format!(
                        "input sample_penalties has {} bytes, not i32[{b}, 2 + 2P] with 1 <= P <= {}",
                        buf.bytes,
                        kiln_ir::op::MAX_PENALTY_SLOTS
                    ));
                }
                b * w
            }
            InputRole::KCache(_) | InputRole::VCache(_) => unreachable!(),
        };
        if buf.bytes != elems * 4 {
            return bad(format!(
                "input {} has {} bytes; a key of batch {b}, query {q}, spec {s} with {m}-block tables needs {} i32 = {} bytes",
                role.name(),
                buf.bytes,
                elems,
                elems * 4
            ));
        }
    }
    if !roles.contains(&InputRole::TokenIds) {
        return bad("the step has no token_ids input".into());
    }
    if s > 0 && !roles.contains(&InputRole::DraftTokens) {
        return bad("a speculative key needs a draft_tokens input".into());
    }
    let mut has_next = false;
    for (name, o) in &kp.outputs {
        if o.buf.region != Region::Io {
            return bad(format!("output {name} is not in the key's Io region"));
        }
        let dims = o.ty.shape.dims();
        match name.as_str() {
            "next_tokens" => {
                has_next = true;
                let n = o.ty.numel();
                let ok = o.ty.dtype == DType::I32
                    && dims.len() == 1
                    && (n == b * q || (s == 0 && n == b));
                if !ok {
                    return bad(format!(
                        "output next_tokens is {} but must be i32[{}]{}",
                        o.ty,
                        b * q,
                        if s == 0 {
                            format!(" or i32[{b}]")
                        } else {
                            String::new()
                        }
                    ));
                }
            }
            "accepted" if o.ty.dtype != DType::I32 || dims != [b as u32] => {
                return bad(format!("output accepted is {} but must be i32[{b}]", o.ty));
            }
            "logits" => {
                let rows_ok = dims.len() == 2 && (dims[0] as u64 == b || dims[0] as u64 == b * q);
                if !o.ty.dtype.is_float() || !rows_ok {
                    return bad(format!(
                        "output logits is {} but must be float[{b} or {}, vocab]",
                        o.ty,
                        b * q
                    ));
                }
            }
            _ => {}
        }
    }
    if !has_next {
        return bad("the step has no next_tokens output".into());
    }
    if s > 0 && !kp.outputs.iter().any(|(n, _)| n == "accepted") {
        return bad("a speculative key needs an accepted output".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(backend: &'static str, arch: &str) -> DeviceInfo {
        DeviceInfo {
            backend,
            ordinal: 0,
            name: "test device".into(),
            arch: arch.into(),
        }
    }

    #[test]
    fn a_gpu_plan_compiled_from_other_kernel_sources_is_refused_as_stale() {
        use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};
        let dir = tempfile::tempdir().unwrap();
        write_tiny_model(
            dir.path(),
            Family::Llama,
            &TinySpec::for_family(Family::Llama),
        )
        .unwrap();
        let opts = kiln_compiler::compile::CompileOptions {
            keys: vec![kiln_ir::Key::new(1, 1, 0)],
            ..Default::default()
        };
        let mut plan = kiln_compiler::compile::compile_dir(dir.path(), &opts, &mut |_, _| {})
            .unwrap()
            .plan;
        // A CPU plan carries no kernels: its fingerprint is not checked.
        plan.kernel_abi = 7;
        check_kernel_abi(&plan).unwrap();
        plan.meta.target = Target::Cuda { sm: 90 };
        plan.kernel_abi = kiln_kernels::gpu::kernel_abi();
        check_kernel_abi(&plan).unwrap();
        plan.kernel_abi ^= 1;
        let e = check_kernel_abi(&plan).unwrap_err();
        assert!(matches!(e, EngineError::StaleKernels { .. }), "{e:?}");
        let m = e.to_string();
        assert!(
            m.contains("stale plan") && m.contains("kiln compile") && m.contains("cuda:sm_90"),
            "{m}"
        );
    }

    #[test]
    fn a_plan_runs_only_on_its_target() {
        check_target(&Target::Cpu, &info("cpu", "x86_64")).unwrap();
        check_target(&Target::Cuda { sm: 90 }, &info("cuda", "sm_90")).unwrap();
        check_target(
            &Target::Hip {
                gfx: "gfx1100".into(),
            },
            &info("hip", "gfx1100"),
        )
        .unwrap();
        let e = check_target(&Target::Cuda { sm: 90 }, &info("cuda", "sm_80"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cuda:sm_90") && e.contains("kiln compile --target cuda:sm_80"),
            "{e}"
        );
        let e = check_target(&Target::Cpu, &info("cuda", "sm_90"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--device cpu"), "{e}");
        let e = check_target(&Target::Cuda { sm: 90 }, &info("cpu", "x86_64"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--device cuda"), "{e}");
    }
}
