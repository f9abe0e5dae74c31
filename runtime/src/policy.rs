//! The graph policy: whether steps replay captured graphs or launch eagerly,
//! and why.
//!
//! `KILN_GRAPHS` unset means graphs wherever the backend and the executing
//! device support capture ([`graphs_supported`], an allowlist evaluated for the
//! device the engine runs on, not device 0); `KILN_GRAPHS=0` forces eager;
//! `KILN_GRAPHS=1` forces graphs even on a device outside the allowlist. The
//! decision and its reason are kept on the engine and logged once.
//!
//! Not here: which key a step uses (the dispatcher) and what happens when no
//! key fits ([`EagerFallback`] is only the switch).

use crate::backend::DeviceInfo;
use crate::error::EngineError;

/// How the engine decides between graphs and eager launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GraphMode {
    /// Read `KILN_GRAPHS` when the engine is built (the default).
    #[default]
    FromEnv,
    /// Graphs where the device allows them (`KILN_GRAPHS` unset).
    Auto,
    /// Always eager (`KILN_GRAPHS=0`).
    Off,
    /// Always graphs, even outside the allowlist (`KILN_GRAPHS=1`).
    On,
}

impl GraphMode {
    /// The mode `KILN_GRAPHS` asks for.
    pub fn from_env() -> Result<GraphMode, EngineError> {
        match std::env::var("KILN_GRAPHS") {
            Err(std::env::VarError::NotPresent) => Ok(GraphMode::Auto),
            Err(std::env::VarError::NotUnicode(v)) => {
                Err(EngineError::GraphsEnv(v.to_string_lossy().into_owned()))
            }
            Ok(v) => match v.trim() {
                "" => Ok(GraphMode::Auto),
                "0" => Ok(GraphMode::Off),
                "1" => Ok(GraphMode::On),
                _ => Err(EngineError::GraphsEnv(v)),
            },
        }
    }

    /// `FromEnv` replaced by what the environment says.
    pub fn resolve(self) -> Result<GraphMode, EngineError> {
        match self {
            GraphMode::FromEnv => GraphMode::from_env(),
            m => Ok(m),
        }
    }
}

/// What a step does when no compiled key fits it (more live rows than the
/// largest compiled batch for its query).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum EagerFallback {
    /// Run it eagerly, in sub-batches of the largest key (counted).
    #[default]
    Allow,
    /// Fail the step with [`EngineError::NoKeyFits`].
    Forbid,
}

/// The per-device allowlist hook: can this device capture and replay graphs?
pub type GraphsSupportedFn = fn(&DeviceInfo) -> (bool, String);

/// The default allowlist.
///
/// * cpu: emulated capture always works;
/// * cuda: CUDA graphs work on every device CUDA 12+ supports;
/// * hip: the gfx architectures of [`crate::hip::policy::GRAPH_ALLOWLIST`]
///   (public evidence of working hipGraph capture; kiln itself has not run on
///   AMD hardware yet); others need `KILN_GRAPHS=1`.
pub fn graphs_supported(info: &DeviceInfo) -> (bool, String) {
    match info.backend {
        "cpu" => (true, "the CPU backend's emulated capture".into()),
        "cuda" => (
            true,
            format!("CUDA graphs are supported on {} ({})", info.name, info.arch),
        ),
        "hip" => crate::hip::policy::graphs_supported(info),
        other => (false, format!("unknown backend `{other}`")),
    }
}

/// The policy's verdict for one engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraphDecision {
    pub graphs: bool,
    /// The mode it came from (`FromEnv` already resolved).
    pub mode: GraphMode,
    pub reason: String,
}

impl GraphDecision {
    pub fn decide(
        mode: GraphMode,
        supported: GraphsSupportedFn,
        info: &DeviceInfo,
    ) -> Result<GraphDecision, EngineError> {
        let mode = mode.resolve()?;
        let (ok, why) = supported(info);
        let dev = format!("{} device {} ({})", info.backend, info.ordinal, info.name);
        Ok(match mode {
            GraphMode::Off => GraphDecision {
                graphs: false,
                mode,
                reason: format!("KILN_GRAPHS=0 forces eager launches on {dev}"),
            },
            GraphMode::On => GraphDecision {
                graphs: true,
                mode,
                reason: if ok {
                    format!("KILN_GRAPHS=1 forces graphs on {dev}")
                } else {
                    format!("KILN_GRAPHS=1 forces graphs on {dev} although {why}")
                },
            },
            _ => GraphDecision {
                graphs: ok,
                mode: GraphMode::Auto,
                reason: if ok {
                    format!("graphs on {dev}: {why}")
                } else {
                    format!("eager on {dev}: {why}")
                },
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(backend: &'static str, arch: &str) -> DeviceInfo {
        DeviceInfo {
            backend,
            ordinal: 1,
            name: "dev".into(),
            arch: arch.into(),
        }
    }

    #[test]
    fn each_mode_decides_with_a_reason_naming_the_executing_device() {
        let cpu = dev("cpu", "x86_64");
        let d = GraphDecision::decide(GraphMode::Auto, graphs_supported, &cpu).unwrap();
        assert!(d.graphs && d.reason.contains("device 1"), "{}", d.reason);
        let d = GraphDecision::decide(GraphMode::Off, graphs_supported, &cpu).unwrap();
        assert!(!d.graphs && d.reason.contains("KILN_GRAPHS=0"));
        let hip = dev("hip", "gfx1030");
        let d = GraphDecision::decide(GraphMode::Auto, graphs_supported, &hip).unwrap();
        assert!(!d.graphs && d.reason.contains("gfx1030"), "{}", d.reason);
        let d = GraphDecision::decide(GraphMode::Auto, graphs_supported, &dev("hip", "gfx942"))
            .unwrap();
        assert!(d.graphs && d.reason.contains("gfx942"), "{}", d.reason);
        let d = GraphDecision::decide(GraphMode::On, graphs_supported, &hip).unwrap();
        assert!(d.graphs && d.reason.contains("allowlist"), "{}", d.reason);
    }

    #[test]
    fn the_allowlist_hook_is_consulted_for_the_device() {
        fn only_ordinal_0(i: &DeviceInfo) -> (bool, String) {
            (i.ordinal == 0, format!("ordinal {}", i.ordinal))
        }
        let d =
            GraphDecision::decide(GraphMode::Auto, only_ordinal_0, &dev("cuda", "sm_90")).unwrap();
        assert!(!d.graphs && d.reason.contains("ordinal 1"));
    }
}
