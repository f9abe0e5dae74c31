//! Opening a backend by name (`cpu`, `cuda`, `cuda:1`, `hip:0`), as the CLI's
//! `--device` flag and the examples spell it.
//!
//! Only the CPU backend is always built; CUDA and HIP are behind the `cuda`
//! and `rocm` cargo features, and asking for one that is not built is an
//! error saying how to build it. A tensor-parallel plan opens one backend
//! per rank behind `crate::tp::TpBackend` ([`open_backend_ranks`]). Not
//! here: device discovery or choosing a device automatically.

use crate::backend::Backend;
use crate::error::EngineError;

/// A parsed `--device` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    Cpu,
    Cuda(u32),
    Hip(u32),
}

impl std::str::FromStr for DeviceSpec {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<DeviceSpec, EngineError> {
        let bad = || {
            EngineError::Device(format!(
                "unknown device `{s}`: expected cpu, cuda, cuda:<N>, hip or hip:<N>"
            ))
        };
        let (kind, ordinal) = match s.split_once(':') {
            Some((k, n)) => (k, n.parse::<u32>().map_err(|_| bad())?),
            None => (s, 0),
        };
        match kind {
            "cpu" if !s.contains(':') => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(ordinal)),
            "hip" => Ok(DeviceSpec::Hip(ordinal)),
            _ => Err(bad()),
        }
    }
}

/// Opens the backend `spec` names.
pub fn open_backend(spec: DeviceSpec) -> Result<Box<dyn Backend + Send>, EngineError> {
    match spec {
        DeviceSpec::Cpu => Ok(Box::new(crate::cpu::CpuBackend::new())),
        DeviceSpec::Cuda(ordinal) => open_cuda(ordinal),
        DeviceSpec::Hip(ordinal) => open_hip(ordinal),
    }
}

/// Opens the backend for a plan over `ranks` tensor-parallel ranks on
/// `spec`: the single-device backend when `ranks` is 1; otherwise
/// `ranks` CPU ranks ([`crate::tp::TpBackend::cpu_with_options`], the
/// host's threads shared out) or the GPUs `spec`'s ordinal and the next
/// `ranks - 1` joined by NCCL. Options come from the environment
/// ([`crate::tp::TpOptions::from_env`]).
pub fn open_backend_ranks(
    spec: DeviceSpec,
    ranks: u32,
) -> Result<Box<dyn Backend + Send>, EngineError> {
    if ranks <= 1 {
        return open_backend(spec);
    }
    let options = crate::tp::TpOptions::from_env()?;
    match spec {
        DeviceSpec::Cpu => Ok(Box::new(
            crate::tp::TpBackend::cpu_with_options(ranks, &options)?.0,
        )),
        DeviceSpec::Cuda(first) => open_cuda_ranks(first, ranks, &options),
        DeviceSpec::Hip(first) => Err(EngineError::Device(format!(
            "hip:{first}: tensor-parallel plans ({ranks} ranks) run on cpu or cuda only (no RCCL driver yet); compile with --tp 1 for HIP"
        ))),
    }
}

#[cfg(feature = "cuda")]
fn open_cuda_ranks(
    first: u32,
    ranks: u32,
    options: &crate::tp::TpOptions,
) -> Result<Box<dyn Backend + Send>, EngineError> {
    Ok(Box::new(crate::gpu::nccl::cuda_tp_backend(
        first, ranks, options,
    )?))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda_ranks(
    first: u32,
    ranks: u32,
    _: &crate::tp::TpOptions,
) -> Result<Box<dyn Backend + Send>, EngineError> {
    Err(EngineError::Device(format!(
        "cuda:{first} ({ranks} ranks) asked for, but this build has no CUDA backend; rebuild with `--features cuda`"
    )))
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: u32) -> Result<Box<dyn Backend + Send>, EngineError> {
    Ok(Box::new(crate::gpu::GpuBackend::cuda(ordinal)?))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: u32) -> Result<Box<dyn Backend + Send>, EngineError> {
    Err(EngineError::Device(format!(
        "cuda:{ordinal} asked for, but this build has no CUDA backend; rebuild with `--features cuda`"
    )))
}

#[cfg(feature = "rocm")]
fn open_hip(ordinal: u32) -> Result<Box<dyn Backend + Send>, EngineError> {
    Ok(Box::new(crate::gpu::GpuBackend::hip(ordinal)?))
}

#[cfg(not(feature = "rocm"))]
fn open_hip(ordinal: u32) -> Result<Box<dyn Backend + Send>, EngineError> {
    Err(EngineError::Device(format!(
        "hip:{ordinal} asked for, but this build has no HIP backend; rebuild with `--features rocm`"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_and_bad_ones_say_what_is_expected() {
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
        assert_eq!("cuda:3".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(3));
        assert_eq!("hip:1".parse::<DeviceSpec>().unwrap(), DeviceSpec::Hip(1));
        for bad in ["gpu", "cuda:x", "cpu:1", "cuda:", ""] {
            let e = bad.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(e.contains("expected cpu, cuda"), "{bad}: {e}");
        }
        assert_eq!(open_backend(DeviceSpec::Cpu).unwrap().info().backend, "cpu");
        if !cfg!(feature = "cuda") {
            let e = open_backend(DeviceSpec::Cuda(0)).err().unwrap().to_string();
            assert!(e.contains("--features cuda"), "{e}");
        }
        if !cfg!(feature = "rocm") {
            let e = open_backend(DeviceSpec::Hip(0)).err().unwrap().to_string();
            assert!(e.contains("--features rocm"), "{e}");
        }
    }
}
