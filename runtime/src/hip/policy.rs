//! Whether steps on a HIP device replay as hipGraphs or launch eagerly.
//!
//! hipGraph capture works on some AMD architectures and is fragile or broken on
//! others, so the HIP backend turns graphs on by default only for gfx
//! architectures with public evidence of working stream capture (the
//! [`GRAPH_ALLOWLIST`]). `KILN_GRAPHS=1` forces graphs anywhere, `KILN_GRAPHS=0`
//! forces eager launches everywhere.
//!
//! The decision is a pure function of the executing device (its ordinal and
//! architecture, from the backend's [`DeviceInfo`]) and of the `KILN_GRAPHS`
//! value passed in as a parameter, so tests cover every case without touching
//! the process environment. It always comes with a reason, which the backend
//! logs and exposes in its counters.
//!
//! Not here: reading the environment (the caller does, once) and the engine's
//! choice between replay and eager for a step (it asks the backend).

use crate::backend::DeviceInfo;

/// Environment variable that overrides the default policy.
pub const ENV_VAR: &str = "KILN_GRAPHS";

/// Architectures on which graph capture is on by default, with the evidence.
///
/// Evidence, as known when this list was written (none of it is a kiln run:
/// kiln's HIP backend has not yet run on AMD hardware): vLLM captures HIP
/// graphs by default (`enforce_eager=False`) and its GPU installation docs
/// list as supported ROCm GPUs MI200s (`gfx90a`: Instinct MI210/MI250/MI250X),
/// MI300 (`gfx942`: Instinct MI300X/MI300A/MI325X) and the Radeon RX 7900
/// series (`gfx1100`: RX 7900 XTX/XT, PRO W7900; support landed in
/// vllm-project/vllm#2768).
///
/// The same docs list gfx950, gfx1101, gfx1150/1151 and gfx1200/1201; they stay
/// off until a kiln capture test passes on one (`KILN_GRAPHS=1` runs that test
/// there). An architecture is added here with its evidence.
pub const GRAPH_ALLOWLIST: &[(&str, &str)] = &[
    ("gfx90a", "Instinct MI200 series"),
    ("gfx942", "Instinct MI300 series"),
    ("gfx1100", "Radeon RX 7900 series / PRO W7900"),
];

/// The graph policy for one device, with the reason it was reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyDecision {
    /// True: capture each key once and replay it. False: launch eagerly.
    pub graphs: bool,
    /// One line naming the device, its architecture and why.
    pub reason: String,
}

/// `KILN_GRAPHS` held a value the policy does not understand.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{ENV_VAR}=`{0}` is not understood: use {ENV_VAR}=1 to force graph capture, {ENV_VAR}=0 to force eager launches, or leave it unset for the per-architecture default")]
pub struct PolicyError(pub String);

/// The base architecture of a HIP `gcnArchName` (`gfx90a:sramecc+:xnack-` is
/// `gfx90a`): the target features after `:` do not change the policy.
pub use kiln_kernels::hip::base_arch;

/// The allowlist entry of an architecture, if it has one.
pub fn allowlisted(gcn_arch_name: &str) -> Option<&'static str> {
    let base = base_arch(gcn_arch_name);
    GRAPH_ALLOWLIST
        .iter()
        .find(|(arch, _)| *arch == base)
        .map(|(_, parts)| *parts)
}

/// The allowlist in the shape of the engine's policy hook
/// (`fn(&DeviceInfo) -> (bool, String)`): whether `info`'s architecture
/// replays graphs by default, and why.
pub fn graphs_supported(info: &DeviceInfo) -> (bool, String) {
    let base = base_arch(&info.arch);
    match allowlisted(&info.arch) {
        Some(parts) => (true, format!("{base} ({parts}) is on the HIP graph allowlist")),
        None => (
            false,
            format!(
                "{base} is not on the HIP graph allowlist ({}); set {ENV_VAR}=1 to try graph capture",
                GRAPH_ALLOWLIST
                    .iter()
                    .map(|(a, _)| *a)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ),
    }
}

/// Decides graphs vs eager for `device` (the device that executes the step)
/// given the value of `KILN_GRAPHS` (`None` when unset).
///
/// An empty or whitespace-only value counts as unset; any value other than
/// `0` and `1` is an error rather than a silent default.
pub fn decide(
    device: &DeviceInfo,
    kiln_graphs: Option<&str>,
) -> Result<PolicyDecision, PolicyError> {
    let who = format!(
        "{} device {} ({}, {})",
        device.backend, device.ordinal, device.name, device.arch
    );
    let forced = match kiln_graphs.map(str::trim) {
        None | Some("") => None,
        Some("1") => Some(true),
        Some("0") => Some(false),
        Some(other) => return Err(PolicyError(other.to_string())),
    };
    let listed = allowlisted(&device.arch);
    let base = base_arch(&device.arch);
    let decision = match (forced, listed) {
        (Some(false), _) => PolicyDecision {
            graphs: false,
            reason: format!("{who}: eager launches, forced by {ENV_VAR}=0"),
        },
        (Some(true), Some(parts)) => PolicyDecision {
            graphs: true,
            reason: format!(
                "{who}: graph capture on ({ENV_VAR}=1; {base} ({parts}) is on the HIP graph allowlist anyway)"
            ),
        },
        (Some(true), None) => PolicyDecision {
            graphs: true,
            reason: format!(
                "{who}: graph capture on, forced by {ENV_VAR}=1 although {base} is not on the HIP graph allowlist"
            ),
        },
        (None, _) => {
            let (graphs, why) = graphs_supported(device);
            let what = if graphs { "graph capture on" } else { "eager launches" };
            PolicyDecision {
                graphs,
                reason: format!("{who}: {what}: {why}"),
            }
        }
    };
    Ok(decision)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(ordinal: u32, arch: &str) -> DeviceInfo {
        DeviceInfo {
            backend: "hip",
            ordinal,
            name: format!("fake AMD device {ordinal}"),
            arch: arch.to_string(),
        }
    }

    #[test]
    fn every_allowlisted_architecture_gets_graphs_by_default_with_its_name_in_the_reason() {
        for (arch, parts) in GRAPH_ALLOWLIST {
            for full in [arch.to_string(), format!("{arch}:sramecc+:xnack-")] {
                let d = decide(&device(0, &full), None).unwrap();
                assert!(d.graphs, "{full}: {}", d.reason);
                assert!(d.reason.contains(arch), "{}", d.reason);
                assert!(d.reason.contains(parts), "{}", d.reason);
                assert!(d.reason.contains("allowlist"), "{}", d.reason);
            }
        }
    }

    #[test]
    fn architectures_off_the_allowlist_run_eagerly_and_say_how_to_opt_in() {
        for arch in [
            "gfx1030", "gfx908", "gfx1200", "gfx950", "gfx90", "gfx9", "gfx94", "gfx11000",
        ] {
            let d = decide(&device(0, arch), None).unwrap();
            assert!(!d.graphs, "{arch}: {}", d.reason);
            assert!(d.reason.contains("KILN_GRAPHS=1"), "{}", d.reason);
            assert!(d.reason.contains(arch), "{}", d.reason);
        }
    }

    #[test]
    fn kiln_graphs_one_forces_graphs_on_any_architecture() {
        for arch in ["gfx1030", "gfx90a", "gfx1201:xnack-"] {
            let d = decide(&device(3, arch), Some("1")).unwrap();
            assert!(d.graphs, "{arch}: {}", d.reason);
            assert!(d.reason.contains("KILN_GRAPHS=1"), "{}", d.reason);
        }
    }

    #[test]
    fn kiln_graphs_zero_forces_eager_even_on_the_allowlist() {
        for (arch, _) in GRAPH_ALLOWLIST {
            let d = decide(&device(0, arch), Some("0")).unwrap();
            assert!(!d.graphs, "{arch}: {}", d.reason);
            assert!(d.reason.contains("KILN_GRAPHS=0"), "{}", d.reason);
        }
        let d = decide(&device(0, "gfx1030"), Some(" 0 ")).unwrap();
        assert!(!d.graphs);
    }

    #[test]
    fn an_empty_kiln_graphs_means_the_default() {
        assert!(decide(&device(0, "gfx942"), Some("")).unwrap().graphs);
        assert!(!decide(&device(0, "gfx1030"), Some("  ")).unwrap().graphs);
    }

    #[test]
    fn a_kiln_graphs_value_other_than_zero_or_one_is_an_error_naming_the_fix() {
        for bad in ["yes", "true", "2", "on", "01"] {
            let e = decide(&device(0, "gfx90a"), Some(bad)).unwrap_err();
            assert_eq!(e.0, bad);
            let msg = e.to_string();
            assert!(msg.contains(&format!("`{bad}`")), "{msg}");
            assert!(
                msg.contains("KILN_GRAPHS=1") && msg.contains("KILN_GRAPHS=0"),
                "{msg}"
            );
        }
    }

    #[test]
    fn the_decision_is_for_the_executing_device_not_device_zero() {
        // A host with an RDNA2 card at ordinal 0 and an MI210 at ordinal 1:
        // the backend runs on ordinal 1, so graphs are on and the reason says so.
        let dev0 = device(0, "gfx1030");
        let dev1 = device(1, "gfx90a:sramecc+:xnack-");
        let d1 = decide(&dev1, None).unwrap();
        assert!(d1.graphs);
        assert!(d1.reason.contains("device 1"), "{}", d1.reason);
        assert!(!d1.reason.contains("device 0"), "{}", d1.reason);
        let d0 = decide(&dev0, None).unwrap();
        assert!(!d0.graphs);
        assert!(d0.reason.contains("device 0"), "{}", d0.reason);
    }

    #[test]
    fn the_engine_hook_agrees_with_the_default_decision() {
        for arch in [
            "gfx90a:sramecc+:xnack-",
            "gfx942",
            "gfx1100",
            "gfx1030",
            "gfx1201",
        ] {
            let d = device(2, arch);
            let (ok, why) = graphs_supported(&d);
            let decision = decide(&d, None).unwrap();
            assert_eq!(ok, decision.graphs, "{arch}");
            assert!(
                decision.reason.ends_with(&why),
                "{} / {why}",
                decision.reason
            );
            assert!(why.contains(base_arch(arch)), "{why}");
        }
    }

    #[test]
    fn base_arch_drops_target_features() {
        assert_eq!(base_arch("gfx90a:sramecc+:xnack-"), "gfx90a");
        assert_eq!(base_arch("gfx1100"), "gfx1100");
        assert_eq!(base_arch(" gfx942:sramecc+ "), "gfx942");
        assert_eq!(base_arch(""), "");
    }
}
