//! Compiles the GPU modules to CUBIN with NVRTC, for a plan's `cuda:sm_NN`
//! target (feature `nvrtc`).
//!
//! `kiln compile --target cuda:sm_90` calls [`compile_cubins`] and stores the
//! images in the plan, so a serving process loads machine code and never
//! compiles. NVRTC is loaded dynamically (cudarc, `dynamic-loading`): it is
//! needed only at compile time, works without a GPU, and comes from the
//! `nvidia-cuda-nvrtc` wheel (13.0.x) or a CUDA toolkit. [`locate`] finds
//! `libnvrtc.so.13` (see its docs for the search order) and preloads it, so
//! neither `LD_LIBRARY_PATH` nor a toolkit install is required.
//!
//! Compiled images are cached on disk ([`crate::image_cache`], keyed by the
//! exact module source, the options, the NVRTC version and the SM), so only
//! the first compile of a kernel source for an SM runs NVRTC;
//! [`compile_modules`] compiles a given list of modules and reports progress.
//!
//! Deliberately not here: PTX output (a plan carries machine code for its
//! exact SM; a device of another SM is refused at load with a clear error
//! instead of being JIT-compiled), and loading modules onto a device (the
//! runtime's CUDA backend).

use crate::gpu::{module_source, GpuModule, MODULES};
use crate::image_cache::{CacheError, ImageCache, ImageKey, Lookup};
use cudarc::nvrtc::sys;
use kiln_ir::plan::{ImageKind, KernelImage};
use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The SM versions kiln compiles for and tests in CI.
pub const SUPPORTED_SMS: [u32; 2] = [80, 90];

/// The NVRTC shared library's file name (CUDA 13).
pub const NVRTC_SONAME: &str = "libnvrtc.so.13";

/// Why a compile failed.
#[derive(Debug, thiserror::Error)]
pub enum NvrtcError {
    #[error("NVRTC ({soname}) was not found; searched: {searched}. Install it with `pip install nvidia-cuda-nvrtc==13.0.*` or set KILN_NVRTC_LIB to the library's path")]
    NotFound {
        soname: &'static str,
        searched: String,
    },
    #[error("NVRTC at {path} could not be loaded: {message}")]
    Load { path: String, message: String },
    #[error("sm_{0} is not a supported CUDA target; supported: sm_80, sm_90")]
    UnsupportedSm(u32),
    #[error("NVRTC failed to compile module `{module}` for sm_{sm}:\n{log}")]
    Compile {
        module: &'static str,
        sm: u32,
        log: String,
    },
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("NVRTC call {call} failed for module `{module}`: {code}")]
    Api {
        call: &'static str,
        module: &'static str,
        code: String,
    },
}

/// Where NVRTC was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NvrtcLocation {
    /// Found by the dynamic loader (`LD_LIBRARY_PATH`, system paths).
    Loader,
    /// Preloaded from this file.
    File(PathBuf),
}

static LOCATED: OnceLock<Result<NvrtcLocation, String>> = OnceLock::new();
static PRELOADED: OnceLock<Vec<libloading::Library>> = OnceLock::new();

/// NVRTC's builtins library, which NVRTC itself opens by name at compile time.
const BUILTINS_SONAME: &str = "libnvrtc-builtins.so.13.0";

/// Directories that may hold the `nvidia-cuda-nvrtc` wheel's library: the
/// site-packages of the `python3` on PATH, then common toolkit folders.
fn candidate_files() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Ok(out) = std::process::Command::new("python3")
        .args([
            "-c",
            "import site,sys\nfor p in site.getsitepackages()+[site.getusersitepackages()]+sys.path: print(p)",
        ])
        .stderr(std::process::Stdio::null())
        .output()
    {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let p = PathBuf::from(line.trim());
            if !line.trim().is_empty() {
                dirs.push(p.join("nvidia/cu13/lib"));
                dirs.push(p.join("nvidia/cuda_nvrtc/lib"));
            }
        }
    }
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/local/cuda-13.0/lib64",
        "/usr/lib/x86_64-linux-gnu",
    ] {
        dirs.push(PathBuf::from(d));
    }
    let mut files: Vec<PathBuf> = Vec::new();
    for d in dirs {
        let f = d.join(NVRTC_SONAME);
        if !files.contains(&f) {
            files.push(f);
        }
    }
    files
}

/// Loads NVRTC (and its builtins library beside it, which NVRTC opens by
/// soname during a compile) from `path`; both stay loaded for the life of
/// the process, so later loads by soname resolve to them.
fn preload(path: &Path) -> Result<(), String> {
    let mut libs = Vec::new();
    if let Some(dir) = path.parent() {
        let builtins = dir.join(BUILTINS_SONAME);
        if builtins.is_file() {
            // SAFETY: loading runs the library's initializers, which have no
            // preconditions.
            libs.push(unsafe { libloading::Library::new(&builtins) }.map_err(|e| e.to_string())?);
        }
    }
    // SAFETY: as above.
    libs.push(unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?);
    let _ = PRELOADED.set(libs);
    Ok(())
}

/// Finds NVRTC and makes it loadable by cudarc. Search order:
/// 1. `KILN_NVRTC_LIB` (a path to `libnvrtc.so.13`);
/// 2. the dynamic loader (`LD_LIBRARY_PATH`, system folders);
/// 3. the `nvidia-cuda-nvrtc` wheel in the site-packages of `python3`, then
///    `/usr/local/cuda*/lib64`.
///
/// A library found by path is preloaded; cudarc's later load by soname then
/// resolves to it.
pub fn locate() -> Result<NvrtcLocation, NvrtcError> {
    let r = LOCATED.get_or_init(|| {
        if let Ok(p) = std::env::var("KILN_NVRTC_LIB") {
            let path = PathBuf::from(&p);
            return preload(&path)
                .map(|_| NvrtcLocation::File(path))
                .map_err(|e| format!("KILN_NVRTC_LIB={p}: {e}"));
        }
        // SAFETY: probing only opens and closes the library.
        if unsafe { sys::is_culib_present() } {
            return Ok(NvrtcLocation::Loader);
        }
        let files = candidate_files();
        for f in &files {
            if f.is_file() && preload(f).is_ok() {
                return Ok(NvrtcLocation::File(f.clone()));
            }
        }
        let searched: Vec<String> = std::iter::once("the dynamic loader".to_string())
            .chain(files.iter().map(|f| f.display().to_string()))
            .collect();
        Err(searched.join(", "))
    });
    match r {
        Ok(l) => Ok(l.clone()),
        Err(e) if e.starts_with("KILN_NVRTC_LIB=") => Err(NvrtcError::Load {
            path: e.clone(),
            message: "could not be opened".into(),
        }),
        Err(e) => Err(NvrtcError::NotFound {
            soname: NVRTC_SONAME,
            searched: e.clone(),
        }),
    }
}

/// True when NVRTC can be loaded (tests skip with a message otherwise).
pub fn available() -> bool {
    locate().is_ok()
}

/// NVRTC's version `(major, minor)`.
pub fn version() -> Result<(i32, i32), NvrtcError> {
    locate()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are valid for the call.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    check(r, "nvrtcVersion", "-")?;
    Ok((major, minor))
}

fn check(r: sys::nvrtcResult, call: &'static str, module: &'static str) -> Result<(), NvrtcError> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: nvrtcGetErrorString returns a static string for any code.
    let msg = unsafe { CStr::from_ptr(sys::nvrtcGetErrorString(r)) }
        .to_string_lossy()
        .into_owned();
    Err(NvrtcError::Api {
        call,
        module,
        code: format!("{r:?} ({msg})"),
    })
}

/// The options every module is compiled with for `sm`.
pub fn options(sm: u32) -> Vec<String> {
    vec![
        format!("--gpu-architecture=sm_{sm}"),
        "--std=c++17".into(),
        "--device-as-default-execution-space".into(),
        "-DNDEBUG".into(),
        // Accurate math: no --use_fast_math, so expf/sinf/cosf/tanhf and
        // division match the CPU reference to an ulp or two.
        "--fmad=true".into(),
    ]
}

/// `KILN_NVRTC_VERBOSE=1` adds ptxas's resource report (registers, spills,
/// shared memory) to each compile and prints the log to stderr.
fn verbose() -> bool {
    std::env::var("KILN_NVRTC_VERBOSE").is_ok_and(|v| v == "1")
}

struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is
        // destroyed once.
        unsafe {
            let _ = sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

/// Compiles one module to a CUBIN for `sm`.
pub fn compile_module(m: &GpuModule, sm: u32) -> Result<Vec<u8>, NvrtcError> {
    if !SUPPORTED_SMS.contains(&sm) {
        return Err(NvrtcError::UnsupportedSm(sm));
    }
    locate()?;
    let src = CString::new(module_source(m)).expect("kernel sources contain no NUL byte");
    let name = CString::new(m.file).expect("file names contain no NUL byte");
    let mut raw: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: src and name outlive the program; no headers are passed.
    check(
        unsafe {
            sys::nvrtcCreateProgram(
                &mut raw,
                src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        },
        "nvrtcCreateProgram",
        m.name,
    )?;
    let prog = Program(raw);
    let mut opts = options(sm);
    if verbose() {
        opts.push("--ptxas-options=-v".into());
    }
    let opts: Vec<CString> = opts
        .into_iter()
        .map(|o| CString::new(o).expect("options contain no NUL byte"))
        .collect();
    let ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: ptrs holds valid C strings for the call.
    let r = unsafe { sys::nvrtcCompileProgram(prog.0, ptrs.len() as i32, ptrs.as_ptr()) };
    let log = program_log(&prog, m.name)?;
    if verbose() {
        eprintln!("nvrtc {} sm_{sm}:\n{log}", m.name);
    }
    if r == sys::nvrtcResult::NVRTC_ERROR_COMPILATION {
        return Err(NvrtcError::Compile {
            module: m.name,
            sm,
            log,
        });
    }
    check(r, "nvrtcCompileProgram", m.name)?;
    let mut size = 0usize;
    // SAFETY: the program compiled; size is a valid out pointer.
    check(
        unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) },
        "nvrtcGetCUBINSize",
        m.name,
    )?;
    let mut cubin = vec![0u8; size];
    // SAFETY: cubin has the size NVRTC reported.
    check(
        unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut c_char) },
        "nvrtcGetCUBIN",
        m.name,
    )?;
    if size == 0 {
        return Err(NvrtcError::Api {
            call: "nvrtcGetCUBIN",
            module: m.name,
            code: "empty CUBIN (was the target a virtual compute_ architecture?)".into(),
        });
    }
    Ok(cubin)
}

fn program_log(prog: &Program, module: &'static str) -> Result<String, NvrtcError> {
    let mut size = 0usize;
    // SAFETY: valid program and out pointer.
    check(
        unsafe { sys::nvrtcGetProgramLogSize(prog.0, &mut size) },
        "nvrtcGetProgramLogSize",
        module,
    )?;
    let mut buf = vec![0u8; size.max(1)];
    // SAFETY: buf has the size NVRTC reported.
    check(
        unsafe { sys::nvrtcGetProgramLog(prog.0, buf.as_mut_ptr() as *mut c_char) },
        "nvrtcGetProgramLog",
        module,
    )?;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).trim().to_string())
}

/// One module finished, for a progress display.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModuleDone<'a> {
    pub module: &'a str,
    /// Served from the cache (no NVRTC run).
    pub cached: bool,
    /// Modules finished so far (this one included) and in all.
    pub done: usize,
    pub total: usize,
}

/// The cache key of module `m` for `sm` under NVRTC `version`.
fn image_key<'a>(
    source: &'a str,
    options: &'a [String],
    compiler: &'a str,
    arch: &'a str,
) -> ImageKey<'a> {
    ImageKey {
        source,
        options,
        compiler,
        arch,
    }
}

/// Compiles `modules` for `target_sm` (e.g. 90 for `cuda:sm_90`), in
/// parallel: one [`KernelImage`] of kind `Cubin` per module, named as the
/// module, in the order given. With a `cache`, a module whose entry is
/// there (same source, options, NVRTC version and SM) is not compiled, and a
/// fresh compile is stored; a corrupt entry is recompiled and replaced.
/// `progress` is called once per module as it finishes, from any thread.
pub fn compile_modules(
    target_sm: u32,
    modules: &[&GpuModule],
    cache: Option<&ImageCache>,
    progress: &(dyn Fn(ModuleDone<'_>) + Sync),
) -> Result<Vec<KernelImage>, NvrtcError> {
    use rayon::prelude::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    if !SUPPORTED_SMS.contains(&target_sm) {
        return Err(NvrtcError::UnsupportedSm(target_sm));
    }
    let (major, minor) = version()?;
    let compiler = format!("nvrtc {major}.{minor}");
    let arch = format!("sm_{target_sm}");
    let opts = options(target_sm);
    let done = AtomicUsize::new(0);
    // NVRTC programs are independent: compile the modules in parallel.
    modules
        .par_iter()
        .map(|m| {
            let source = module_source(m);
            let key = image_key(&source, &opts, &compiler, &arch);
            let (code, cached) = match cache {
                Some(c) => {
                    if let Lookup::Corrupt(why) = c.lookup(&key)? {
                        eprintln!("kiln: kernel cache: {why}; recompiling");
                    }
                    c.get_or_compile(&key, || compile_module(m, target_sm))?
                }
                None => (compile_module(m, target_sm)?, false),
            };
            progress(ModuleDone {
                module: m.name,
                cached,
                done: done.fetch_add(1, Ordering::Relaxed) + 1,
                total: modules.len(),
            });
            Ok(KernelImage {
                name: m.name.to_string(),
                kind: ImageKind::Cubin,
                code,
            })
        })
        .collect()
}

/// The modules among `modules` whose images for `target_sm` are not in
/// `cache` (or are corrupt there): what a compile would run NVRTC for.
pub fn uncached_modules<'m>(
    target_sm: u32,
    modules: &[&'m GpuModule],
    cache: &ImageCache,
) -> Result<Vec<&'m GpuModule>, NvrtcError> {
    let (major, minor) = version()?;
    let compiler = format!("nvrtc {major}.{minor}");
    let arch = format!("sm_{target_sm}");
    let opts = options(target_sm);
    let mut out = Vec::new();
    for m in modules {
        let source = module_source(m);
        if !matches!(
            cache.lookup(&image_key(&source, &opts, &compiler, &arch))?,
            Lookup::Hit(_)
        ) {
            out.push(*m);
        }
    }
    Ok(out)
}

/// Compiles every GPU module for `target_sm` through the default kernel
/// cache (`$KILN_CACHE/kernels`, else `~/.cache/kiln/kernels`; without a
/// home directory, uncached).
pub fn compile_cubins(target_sm: u32) -> Result<Vec<KernelImage>, NvrtcError> {
    let cache = ImageCache::open_default().ok();
    let all: Vec<&GpuModule> = MODULES.iter().collect();
    compile_modules(target_sm, &all, cache.as_ref(), &|_| {})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::entry_points;

    /// True (with a message) when NVRTC is absent and the test should skip;
    /// with `KILN_REQUIRE_NVRTC=1` (CI) an absent NVRTC fails instead.
    fn skip() -> bool {
        if let Err(e) = locate() {
            if std::env::var("KILN_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
                panic!("KILN_REQUIRE_NVRTC=1 but {e}");
            }
            eprintln!("SKIPPED: NVRTC is not installed here ({e})");
            return true;
        }
        false
    }

    /// Every module compiles to a real CUBIN (an ELF file) for sm_80 and
    /// sm_90, and every entry point the catalog names is a symbol in it.
    #[test]
    fn every_module_compiles_to_a_cubin_for_sm_80_and_sm_90() {
        if skip() {
            return;
        }
        // KILN_DUMP_CUBINS=<dir> also writes `<module>.sm_<sm>.cubin` there
        // (scripts/gpu-check.sh carries them to a GPU machine).
        let dump = std::env::var("KILN_DUMP_CUBINS").ok();
        for sm in SUPPORTED_SMS {
            let images = compile_cubins(sm).unwrap_or_else(|e| panic!("{e}"));
            if let Some(dir) = &dump {
                for img in &images {
                    std::fs::write(format!("{dir}/{}.sm_{sm}.cubin", img.name), &img.code).unwrap();
                }
            }
            assert_eq!(images.len(), MODULES.len());
            for (img, m) in images.iter().zip(MODULES.iter()) {
                assert_eq!(img.name, m.name);
                assert_eq!(img.kind, ImageKind::Cubin);
                assert_eq!(&img.code[..4], b"\x7fELF", "{} sm_{sm} is not ELF", m.name);
                for e in entry_points(m.name) {
                    let needle = format!("{e}\0");
                    assert!(
                        img.code
                            .windows(needle.len())
                            .any(|w| w == needle.as_bytes()),
                        "entry {e} missing from the sm_{sm} cubin of {}",
                        m.name
                    );
                }
            }
        }
    }

    #[test]
    fn a_kernel_that_does_not_compile_reports_the_module_and_the_log() {
        if skip() {
            return;
        }
        let bad = GpuModule {
            name: "broken",
            file: "broken.cu",
            raw_source: "#include \"kiln_port.h\"\nKILN_GLOBAL void f() { undefined_thing(); }\n",
        };
        let e = compile_module(&bad, 90).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("broken") && s.contains("undefined_thing"), "{s}");
    }

    #[test]
    fn an_unsupported_sm_is_refused_by_name() {
        let e = compile_module(&MODULES[0], 75).unwrap_err();
        assert!(e.to_string().contains("sm_75"), "{e}");
    }

    /// The cache test compiles the smallest module for real: a second compile
    /// is served from the cache, a changed source is not.
    #[test]
    fn a_second_compile_hits_the_cache_and_a_changed_source_misses_it() {
        if skip() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(dir.path());
        let small = MODULES
            .iter()
            .min_by_key(|m| m.raw_source.len())
            .expect("there are modules");
        let seen = std::sync::Mutex::new(Vec::new());
        let record = |d: ModuleDone<'_>| seen.lock().unwrap().push((d.cached, d.done, d.total));
        let first = compile_modules(90, &[small], Some(&cache), &record).unwrap();
        let second = compile_modules(90, &[small], Some(&cache), &record).unwrap();
        assert_eq!(first, second);
        assert_eq!(*seen.lock().unwrap(), vec![(false, 1, 1), (true, 1, 1)]);
        assert!(uncached_modules(90, &[small], &cache).unwrap().is_empty());
        assert_eq!(uncached_modules(80, &[small], &cache).unwrap().len(), 1);
        let edited_source = format!("{}\n// edited\n", small.raw_source);
        let edited = GpuModule {
            raw_source: Box::leak(edited_source.into_boxed_str()),
            ..*small
        };
        assert_eq!(uncached_modules(90, &[&edited], &cache).unwrap().len(), 1);
        let third = compile_modules(90, &[&edited], Some(&cache), &record).unwrap();
        assert_eq!(seen.lock().unwrap().last(), Some(&(false, 1, 1)));
        assert_eq!(third[0].name, small.name);
    }

    #[test]
    fn nvrtc_is_the_13_0_line() {
        if skip() {
            return;
        }
        let (major, _) = version().unwrap();
        assert_eq!(major, 13);
    }
}
