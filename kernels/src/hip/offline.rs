//! HIP kernel images for a plan: a code object compiled at compile time when a
//! HIP compiler for the target is installed, the kernel source otherwise.
//!
//! `kiln compile --target hip:gfx942` calls [`kernel_images`] with the
//! translation unit from [`super::source`]. With `hipcc` (or ROCm's
//! `amdclang++`) on the compiling machine the plan carries a ready code object
//! ([`ImageKind::CodeObject`]); without one it carries the source
//! ([`ImageKind::Source`]), which the runtime compiles once with hiprtc for the
//! executing device and caches on disk. Both load the same way.
//!
//! The compiler is found through `KILN_HIPCC` (a path, or `none` to embed
//! source even where a compiler exists), then `$ROCM_PATH`/`$HIP_PATH`,
//! `/opt/rocm`, and `PATH`. The environment is passed in as a lookup function
//! so tests never set process variables.
//!
//! Not here: hiprtc (the ROCm-only backend loads it at run time).

use kiln_ir::plan::{ImageKind, KernelImage};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Selects (a path) or disables (`none`, `0`, `off`) the offline compiler.
pub const ENV_HIPCC: &str = "KILN_HIPCC";

/// Name of the single HIP module a plan carries.
pub const MODULE_NAME: &str = "kiln_kernels";

/// The flavour of an offline compiler, which decides its command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompilerKind {
    /// `hipcc --genco` (writes a clang offload bundle).
    Hipcc,
    /// `amdclang++ -x hip --offload-device-only` (writes a bare code object).
    AmdClang,
}

/// An offline HIP compiler found on this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OfflineCompiler {
    pub path: PathBuf,
    pub kind: CompilerKind,
}

/// Why compile-time HIP compilation failed.
#[derive(Debug, thiserror::Error)]
pub enum OfflineError {
    #[error("KILN_HIPCC={0} is not an executable file; point it at hipcc or amdclang++, or set KILN_HIPCC=none to embed kernel source compiled at load")]
    NotFound(PathBuf),
    #[error("`{0}` is not a HIP architecture (expected e.g. gfx90a, gfx942, gfx1100)")]
    BadArch(String),
    #[error("{compiler} failed to compile the kiln kernels for {arch} ({status}):\n{stderr}\nfix the kernel sources, or set KILN_HIPCC=none to embed the source and compile it at load")]
    Failed {
        compiler: String,
        arch: String,
        status: String,
        stderr: String,
    },
    #[error("{compiler} reported success for {arch} but {path} is not an AMDGPU code object ({bytes} bytes); set KILN_HIPCC=none to embed the source instead")]
    NoCodeObject {
        compiler: String,
        arch: String,
        path: PathBuf,
        bytes: usize,
    },
    #[error("running the HIP compiler: {0}")]
    Io(#[from] std::io::Error),
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

fn kind_of(path: &Path) -> CompilerKind {
    let name = path.file_name().and_then(OsStr::to_str).unwrap_or_default();
    if name.contains("clang") {
        CompilerKind::AmdClang
    } else {
        CompilerKind::Hipcc
    }
}

/// Finds an offline compiler. `env` looks up an environment variable.
pub fn find_offline_compiler(
    env: &dyn Fn(&str) -> Option<OsString>,
) -> Result<Option<OfflineCompiler>, OfflineError> {
    let var = |k: &str| env(k).filter(|v| !v.is_empty());
    if let Some(v) = var(ENV_HIPCC) {
        if matches!(v.to_str(), Some("none" | "0" | "off")) {
            return Ok(None);
        }
        let path = PathBuf::from(v);
        if !is_executable(&path) {
            return Err(OfflineError::NotFound(path));
        }
        let kind = kind_of(&path);
        return Ok(Some(OfflineCompiler { path, kind }));
    }
    let mut candidates: Vec<PathBuf> = Vec::new();
    for root in [var("ROCM_PATH"), var("HIP_PATH")].into_iter().flatten() {
        candidates.push(Path::new(&root).join("bin/hipcc"));
    }
    candidates.push(PathBuf::from("/opt/rocm/bin/hipcc"));
    let path_dirs: Vec<PathBuf> = var("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    candidates.extend(path_dirs.iter().map(|d| d.join("hipcc")));
    if let Some(root) = var("ROCM_PATH") {
        candidates.push(Path::new(&root).join("llvm/bin/amdclang++"));
    }
    candidates.push(PathBuf::from("/opt/rocm/llvm/bin/amdclang++"));
    candidates.extend(path_dirs.iter().map(|d| d.join("amdclang++")));
    Ok(candidates
        .into_iter()
        .find(|p| is_executable(p))
        .map(|path| OfflineCompiler {
            kind: kind_of(&path),
            path,
        }))
}

/// Checks that `arch` looks like a gfx target (`gfx90a`, `gfx90a:xnack-`).
pub fn check_arch(arch: &str) -> Result<(), OfflineError> {
    let base = super::base_arch(arch);
    let ok = base.len() > 3
        && base.starts_with("gfx")
        && base.bytes().all(|c| c.is_ascii_alphanumeric())
        && arch
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b':' | b'+' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(OfflineError::BadArch(arch.to_string()))
    }
}

impl OfflineCompiler {
    /// The compiler's arguments to compile `input` into a code object `output`.
    pub fn args(&self, arch: &str, input: &Path, output: &Path) -> Vec<OsString> {
        let mut a: Vec<OsString> = match self.kind {
            CompilerKind::Hipcc => vec!["--genco".into()],
            CompilerKind::AmdClang => vec![
                "-x".into(),
                "hip".into(),
                "--offload-device-only".into(),
                "--no-gpu-bundle-output".into(),
            ],
        };
        a.push(format!("--offload-arch={arch}").into());
        a.push("-O3".into());
        a.push("-o".into());
        a.push(output.into());
        a.push(input.into());
        a
    }

    /// Compiles the translation unit `tu` for `arch` into code-object bytes.
    pub fn compile(&self, tu: &str, arch: &str) -> Result<Vec<u8>, OfflineError> {
        check_arch(arch)?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!("kiln-hipcc-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let result = self.compile_in(&dir, tu, arch);
        let _ = std::fs::remove_dir_all(&dir);
        result
    }

    fn compile_in(&self, dir: &Path, tu: &str, arch: &str) -> Result<Vec<u8>, OfflineError> {
        let input = dir.join("kiln_kernels.hip");
        let output = dir.join("kiln_kernels.co");
        std::fs::write(&input, tu)?;
        let out = Command::new(&self.path)
            .args(self.args(arch, &input, &output))
            .output()?;
        let compiler = self.path.display().to_string();
        if !out.status.success() {
            return Err(OfflineError::Failed {
                compiler,
                arch: arch.to_string(),
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        let code = std::fs::read(&output).unwrap_or_default();
        if !super::is_code_object(&code) {
            return Err(OfflineError::NoCodeObject {
                compiler,
                arch: arch.to_string(),
                path: output,
                bytes: code.len(),
            });
        }
        Ok(code)
    }
}

/// The plan's HIP kernel images for `arch`: one module, a code object when
/// `compiler` is given, the translation unit `tu` otherwise.
pub fn kernel_images(
    arch: &str,
    tu: &str,
    compiler: Option<&OfflineCompiler>,
) -> Result<Vec<KernelImage>, OfflineError> {
    check_arch(arch)?;
    let image = match compiler {
        Some(c) => KernelImage {
            name: MODULE_NAME.to_string(),
            kind: ImageKind::CodeObject,
            code: c.compile(tu, arch)?,
        },
        None => KernelImage {
            name: MODULE_NAME.to_string(),
            kind: ImageKind::Source,
            code: tu.as_bytes().to_vec(),
        },
    };
    Ok(vec![image])
}

/// A plan's HIP kernel images, and a note when a discovered compiler could
/// not be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanImages {
    pub images: Vec<KernelImage>,
    /// Why the plan carries source although a compiler was found.
    pub note: Option<String>,
}

/// The images `kiln compile --target hip:<arch>` embeds. A compiler named by
/// `KILN_HIPCC` must succeed (its error is returned); a compiler merely found
/// on the machine (for example an older hipcc that does not know `arch`) is
/// tried, and on failure the plan carries the source instead, with a note
/// saying why. No compiler: source.
pub fn plan_images(
    arch: &str,
    tu: &str,
    env: &dyn Fn(&str) -> Option<OsString>,
) -> Result<PlanImages, OfflineError> {
    check_arch(arch)?;
    let explicit = env(ENV_HIPCC).is_some_and(|v| !v.is_empty());
    let compiler = find_offline_compiler(env)?;
    match (compiler, explicit) {
        (None, _) => Ok(PlanImages {
            images: kernel_images(arch, tu, None)?,
            note: None,
        }),
        (Some(c), true) => Ok(PlanImages {
            images: kernel_images(arch, tu, Some(&c))?,
            note: None,
        }),
        (Some(c), false) => match kernel_images(arch, tu, Some(&c)) {
            Ok(images) => Ok(PlanImages { images, note: None }),
            Err(e @ (OfflineError::Failed { .. } | OfflineError::NoCodeObject { .. })) => {
                Ok(PlanImages {
                    images: kernel_images(arch, tu, None)?,
                    note: Some(format!(
                        "embedding the HIP kernel source (compiled with hiprtc at load) because {} could not compile it for {arch}: {e}",
                        c.path.display()
                    )),
                })
            }
            Err(e) => Err(e),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::os::unix::fs::PermissionsExt;

    fn env_of(pairs: &[(&str, &Path)]) -> impl Fn(&str) -> Option<OsString> {
        let map: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.as_os_str().to_owned()))
            .collect();
        move |k| map.get(k).cloned()
    }

    fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    /// A fake AMDGPU code object, and a fake compiler that copies it to the
    /// path after `-o` and logs its arguments next to it.
    fn fake_compiler(dir: &Path, name: &str) -> (PathBuf, Vec<u8>) {
        let mut obj = vec![0u8; 80];
        obj[..4].copy_from_slice(b"\x7fELF");
        obj[18..20].copy_from_slice(&224u16.to_le_bytes());
        obj[70] = 0x5a;
        let obj_path = dir.join("fake.co");
        std::fs::write(&obj_path, &obj).unwrap();
        let log = dir.join(format!("{name}.args"));
        let body = format!(
            "echo \"$@\" > '{}'\nout=''\nwhile [ $# -gt 0 ]; do if [ \"$1\" = -o ]; then out=\"$2\"; fi; shift; done\ncp '{}' \"$out\"",
            log.display(),
            obj_path.display()
        );
        (script(dir, name, &body), obj)
    }

    #[test]
    fn kiln_hipcc_wins_and_none_disables_the_offline_compiler() {
        let dir = tempfile::tempdir().unwrap();
        let (hipcc, _) = fake_compiler(dir.path(), "hipcc");
        let found = find_offline_compiler(&env_of(&[(ENV_HIPCC, &hipcc)]))
            .unwrap()
            .unwrap();
        assert_eq!(
            found,
            OfflineCompiler {
                path: hipcc.clone(),
                kind: CompilerKind::Hipcc
            }
        );
        for off in ["none", "0", "off"] {
            let env = env_of(&[(ENV_HIPCC, Path::new(off)), ("PATH", dir.path())]);
            assert_eq!(find_offline_compiler(&env).unwrap(), None);
        }
        let missing = dir.path().join("nope/hipcc");
        let e = find_offline_compiler(&env_of(&[(ENV_HIPCC, &missing)])).unwrap_err();
        assert!(e.to_string().contains("KILN_HIPCC=none"), "{e}");
        // A file that is not executable is not a compiler.
        let plain = dir.path().join("plain");
        std::fs::write(&plain, "x").unwrap();
        assert!(find_offline_compiler(&env_of(&[(ENV_HIPCC, &plain)])).is_err());
    }

    #[test]
    fn rocm_path_comes_before_path_and_hipcc_before_amdclang() {
        let rocm = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(rocm.path().join("bin")).unwrap();
        std::fs::create_dir_all(rocm.path().join("llvm/bin")).unwrap();
        let on_path = tempfile::tempdir().unwrap();
        let (path_hipcc, _) = fake_compiler(on_path.path(), "hipcc");
        let (clang, _) = fake_compiler(&rocm.path().join("llvm/bin"), "amdclang++");
        // Only amdclang++ under ROCM_PATH, and a hipcc on PATH: hipcc wins.
        let env = env_of(&[("ROCM_PATH", rocm.path()), ("PATH", on_path.path())]);
        let found = find_offline_compiler(&env).unwrap().unwrap();
        if Path::new("/opt/rocm/bin/hipcc").exists() {
            return; // a real ROCm install outranks PATH; the rest assumes none
        }
        assert_eq!(found.path, path_hipcc);
        // Without PATH: the amdclang++ under ROCM_PATH.
        let env = env_of(&[("ROCM_PATH", rocm.path())]);
        let found = find_offline_compiler(&env).unwrap().unwrap();
        if found.path.starts_with("/opt/rocm") {
            return;
        }
        assert_eq!(
            found,
            OfflineCompiler {
                path: clang,
                kind: CompilerKind::AmdClang
            }
        );
        // hipcc under ROCM_PATH outranks the one on PATH.
        let (rocm_hipcc, _) = fake_compiler(&rocm.path().join("bin"), "hipcc");
        let env = env_of(&[("ROCM_PATH", rocm.path()), ("PATH", on_path.path())]);
        assert_eq!(
            find_offline_compiler(&env).unwrap().unwrap().path,
            rocm_hipcc
        );
    }

    #[test]
    fn a_compiler_present_yields_a_code_object_image_built_for_the_arch() {
        let dir = tempfile::tempdir().unwrap();
        let (path, obj) = fake_compiler(dir.path(), "hipcc");
        let c = OfflineCompiler {
            path,
            kind: CompilerKind::Hipcc,
        };
        let images =
            kernel_images("gfx942", "extern \"C\" __global__ void k() {}", Some(&c)).unwrap();
        assert_eq!(images.len(), 1);
        assert_eq!(images[0].kind, ImageKind::CodeObject);
        assert_eq!(images[0].name, MODULE_NAME);
        assert_eq!(images[0].code, obj);
        let args = std::fs::read_to_string(dir.path().join("hipcc.args")).unwrap();
        assert!(
            args.starts_with("--genco --offload-arch=gfx942 -O3 -o "),
            "{args}"
        );
        assert!(args.trim_end().ends_with("kiln_kernels.hip"), "{args}");
    }

    #[test]
    fn amdclang_is_driven_as_a_device_only_hip_compile() {
        let c = OfflineCompiler {
            path: "/opt/rocm/llvm/bin/amdclang++".into(),
            kind: CompilerKind::AmdClang,
        };
        let args: Vec<String> = c
            .args("gfx1100", Path::new("in.hip"), Path::new("out.co"))
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        assert_eq!(
            args,
            [
                "-x",
                "hip",
                "--offload-device-only",
                "--no-gpu-bundle-output",
                "--offload-arch=gfx1100",
                "-O3",
                "-o",
                "out.co",
                "in.hip"
            ]
        );
    }

    #[test]
    fn no_compiler_embeds_the_translation_unit_as_source() {
        let tu = "extern \"C\" __global__ void k(float* x) { x[0] = 1.0f; }\n";
        let images = kernel_images("gfx1100", tu, None).unwrap();
        assert_eq!(images[0].kind, ImageKind::Source);
        assert_eq!(images[0].code, tu.as_bytes());
    }

    #[test]
    fn a_failing_compiler_reports_its_stderr_and_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let path = script(
            dir.path(),
            "hipcc",
            "echo 'kiln_kernels.hip:3:1: error: unknown type name bf16x2' >&2\nexit 1",
        );
        let c = OfflineCompiler {
            path,
            kind: CompilerKind::Hipcc,
        };
        let e = kernel_images("gfx90a", "x", Some(&c))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown type name bf16x2")
                && e.contains("gfx90a")
                && e.contains("KILN_HIPCC=none"),
            "{e}"
        );
    }

    #[test]
    fn a_compiler_that_writes_no_code_object_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = script(dir.path(), "hipcc", "exit 0");
        let c = OfflineCompiler {
            path,
            kind: CompilerKind::Hipcc,
        };
        let e = c.compile("x", "gfx90a").unwrap_err();
        assert!(
            matches!(e, OfflineError::NoCodeObject { bytes: 0, .. }),
            "{e:?}"
        );
    }

    #[test]
    fn a_discovered_compiler_that_fails_falls_back_to_source_but_an_explicit_one_does_not() {
        let dir = tempfile::tempdir().unwrap();
        script(
            dir.path(),
            "hipcc",
            "echo 'clang: error: invalid target ID gfx1201' >&2\nexit 1",
        );
        let tu = "extern \"C\" __global__ void k() {}";
        // Found on PATH: source, with a note naming the compiler and why.
        let out = plan_images("gfx1201", tu, &env_of(&[("PATH", dir.path())])).unwrap();
        assert_eq!(out.images[0].kind, ImageKind::Source);
        let note = out.note.unwrap();
        assert!(
            note.contains("invalid target ID") && note.contains("hipcc"),
            "{note}"
        );
        // Named by KILN_HIPCC: its failure is the error.
        let hipcc = dir.path().join("hipcc");
        let e = plan_images("gfx1201", tu, &env_of(&[(ENV_HIPCC, &hipcc)])).unwrap_err();
        assert!(matches!(e, OfflineError::Failed { .. }), "{e:?}");
        // A working compiler gives a code object and no note.
        let good = tempfile::tempdir().unwrap();
        let (_, obj) = fake_compiler(good.path(), "hipcc");
        let out = plan_images("gfx90a", tu, &env_of(&[("PATH", good.path())])).unwrap();
        if !Path::new("/opt/rocm/bin/hipcc").exists() {
            assert_eq!(
                (
                    out.images[0].kind.clone(),
                    out.images[0].code.clone(),
                    out.note
                ),
                (ImageKind::CodeObject, obj, None)
            );
        }
        // No compiler at all: source, no note.
        let out = plan_images("gfx90a", tu, &env_of(&[(ENV_HIPCC, Path::new("none"))])).unwrap();
        assert_eq!(
            (out.images[0].kind.clone(), out.note),
            (ImageKind::Source, None)
        );
    }

    #[test]
    fn architectures_are_validated() {
        for ok in ["gfx90a", "gfx942", "gfx1100", "gfx90a:sramecc+:xnack-"] {
            check_arch(ok).unwrap();
        }
        for bad in ["sm_90", "gfx", "", "gfx90a;rm -rf", "gfx 90a"] {
            assert!(
                matches!(check_arch(bad), Err(OfflineError::BadArch(_))),
                "{bad}"
            );
        }
    }
}
