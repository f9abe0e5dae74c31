//! hiprtc, loaded with dlopen: compiles a plan's HIP kernel source for the
//! executing device at load (plans built where no offline HIP compiler was
//! installed carry source, not code objects).
//!
//! ROCm 5.3 and later ship hiprtc as `libhiprtc.so`; up to 5.2 its entry
//! points live in `libamdhip64.so` itself. Both are tried, newest first, so
//! kiln builds without hiprtc and finds whichever the machine has.
//!
//! Compiles are serialized process-wide ([`COMPILE_LOCK`]): the LLVM inside
//! some hiprtc builds registers its targets lazily on the first compile and
//! that registration is not thread-safe, so two first compiles racing on
//! different threads can register AMDGPU twice and fail every later compile
//! with "Cannot choose between targets amdgcn and amdgcn" (seen in CI with
//! Debian's ROCm when two tests compiled at once). Load-time compiles are
//! rare and cached, so the lock costs nothing that matters.
//!
//! Not here: caching the result ([`crate::hip::cache`]) and loading the code
//! object (the backend).

use crate::backend::BackendError;
use libloading::Library;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::Mutex;

/// Held for the whole of every [`Hiprtc::compile`]; see the module doc.
static COMPILE_LOCK: Mutex<()> = Mutex::new(());

type Program = *mut c_void;
type RtcResult = c_int;

const HIPRTC_SUCCESS: RtcResult = 0;

/// Libraries that may export hiprtc, in the order tried.
pub const HIPRTC_LIBRARIES: &[&str] = &[
    "libhiprtc.so",
    "libhiprtc.so.7",
    "libhiprtc.so.6",
    "libhiprtc.so.5",
    "libamdhip64.so",
    "libamdhip64.so.6",
    "libamdhip64.so.5",
];

type CreateFn = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> RtcResult;
type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> RtcResult;
type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> RtcResult;
type GetFn = unsafe extern "C" fn(Program, *mut c_char) -> RtcResult;
type DestroyFn = unsafe extern "C" fn(*mut Program) -> RtcResult;
type ErrorStringFn = unsafe extern "C" fn(RtcResult) -> *const c_char;
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> RtcResult;

/// A loaded hiprtc.
pub struct Hiprtc {
    create: CreateFn,
    compile: CompileFn,
    log_size: SizeFn,
    log: GetFn,
    code_size: SizeFn,
    code: GetFn,
    destroy: DestroyFn,
    error_string: ErrorStringFn,
    identity: String,
    // Keeps the function pointers above valid; dropped last.
    _lib: Library,
}

impl Hiprtc {
    /// Loads the first library of [`HIPRTC_LIBRARIES`] that exports hiprtc.
    pub fn load() -> Result<Hiprtc, BackendError> {
        let mut tried = Vec::new();
        for &name in HIPRTC_LIBRARIES {
            // SAFETY: loading a shared library runs its initialisers; these are
            // the ROCm libraries the HIP backend links against anyway.
            match unsafe { Library::new(name) } {
                Ok(lib) => match Hiprtc::from_library(lib, name) {
                    Ok(rtc) => return Ok(rtc),
                    Err(e) => tried.push(format!("{name}: {e}")),
                },
                Err(e) => tried.push(format!("{name}: {e}")),
            }
        }
        Err(BackendError::Device(format!(
            "hiprtc is not available, so the plan's HIP kernel source cannot be compiled at load; install ROCm's hiprtc (libhiprtc.so) or compile the plan where hipcc is installed so it carries code objects. Tried: {}",
            tried.join("; ")
        )))
    }

    fn from_library(lib: Library, name: &str) -> Result<Hiprtc, libloading::Error> {
        // SAFETY: the signatures match hiprtc.h (stable since ROCm 4.2).
        unsafe {
            let version = lib.get::<VersionFn>(b"hiprtcVersion\0").ok().map(|f| *f);
            let mut identity = format!("hiprtc from {name}");
            if let Some(version) = version {
                let (mut major, mut minor) = (0, 0);
                if version(&mut major, &mut minor) == HIPRTC_SUCCESS {
                    identity = format!("hiprtc {major}.{minor} from {name}");
                }
            }
            Ok(Hiprtc {
                create: *lib.get::<CreateFn>(b"hiprtcCreateProgram\0")?,
                compile: *lib.get::<CompileFn>(b"hiprtcCompileProgram\0")?,
                log_size: *lib.get::<SizeFn>(b"hiprtcGetProgramLogSize\0")?,
                log: *lib.get::<GetFn>(b"hiprtcGetProgramLog\0")?,
                code_size: *lib.get::<SizeFn>(b"hiprtcGetCodeSize\0")?,
                code: *lib.get::<GetFn>(b"hiprtcGetCode\0")?,
                destroy: *lib.get::<DestroyFn>(b"hiprtcDestroyProgram\0")?,
                error_string: *lib.get::<ErrorStringFn>(b"hiprtcGetErrorString\0")?,
                identity,
                _lib: lib,
            })
        }
    }

    /// Which hiprtc this is (version and library), part of the cache key.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    fn describe(&self, r: RtcResult) -> String {
        // SAFETY: returns a static string for any code.
        let p = unsafe { (self.error_string)(r) };
        let text = if p.is_null() {
            String::new()
        } else {
            // SAFETY: NUL-terminated static string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        format!("{text} ({r})")
    }

    /// Compiles `source` (named `name` in messages) with `options` into a code
    /// object. The error carries hiprtc's log.
    pub fn compile(&self, source: &str, name: &str, options: &[String]) -> Result<Vec<u8>, String> {
        let src =
            CString::new(source).map_err(|_| format!("{name}: source contains a NUL byte"))?;
        let cname = CString::new(name).map_err(|_| format!("{name}: name contains a NUL byte"))?;
        let opts: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()))
            .collect::<Result<_, _>>()
            .map_err(|_| format!("{name}: a compile option contains a NUL byte"))?;
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        // A poisoned lock only means another compile panicked; hiprtc's state
        // is not guarded by it, so carrying on is sound.
        let _serial = COMPILE_LOCK
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: valid C strings; no headers.
        let r = unsafe {
            (self.create)(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        if r != HIPRTC_SUCCESS {
            return Err(format!(
                "hiprtcCreateProgram({name}) failed: {}",
                self.describe(r)
            ));
        }
        // SAFETY: `prog` is a live program until destroyed below; buffers are
        // sized from the size queries.
        let result = unsafe {
            let r = (self.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr());
            let mut log_len = 0usize;
            let mut log = String::new();
            if (self.log_size)(prog, &mut log_len) == HIPRTC_SUCCESS && log_len > 1 {
                let mut buf = vec![0u8; log_len + 1];
                if (self.log)(prog, buf.as_mut_ptr().cast()) == HIPRTC_SUCCESS {
                    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
                    log = String::from_utf8_lossy(&buf[..end]).into_owned();
                }
            }
            if r != HIPRTC_SUCCESS {
                Err(format!(
                    "hiprtc failed to compile {name} with {options:?}: {}\n{log}",
                    self.describe(r)
                ))
            } else {
                let mut size = 0usize;
                let r = (self.code_size)(prog, &mut size);
                if r != HIPRTC_SUCCESS || size == 0 {
                    Err(format!(
                        "hiprtc compiled {name} but returned no code ({})",
                        self.describe(r)
                    ))
                } else {
                    let mut code = vec![0u8; size];
                    let r = (self.code)(prog, code.as_mut_ptr().cast());
                    if r == HIPRTC_SUCCESS {
                        Ok(code)
                    } else {
                        Err(format!(
                            "hiprtcGetCode({name}) failed: {}",
                            self.describe(r)
                        ))
                    }
                }
            }
        };
        // SAFETY: destroys the program created above, once.
        unsafe { (self.destroy)(&mut prog) };
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hip::cache::{hiprtc_options as compile_options, is_code_object};

    #[test]
    fn a_syntax_error_comes_back_with_the_compiler_log() {
        let rtc = Hiprtc::load().expect("libamdhip64 is installed for the rocm feature");
        let e = rtc
            .compile(
                "extern \"C\" __global__ void broken(float* x) { x[0] = undefined_name; }\n",
                "broken.hip",
                &compile_options("gfx90a"),
            )
            .unwrap_err();
        assert!(e.contains("undefined_name"), "{e}");
        assert!(e.contains("broken.hip"), "{e}");
    }

    #[test]
    fn a_small_kernel_compiles_to_an_amdgpu_code_object_without_a_gpu() {
        let rtc = Hiprtc::load().unwrap();
        let code = rtc
            .compile(
                "extern \"C\" __global__ void scale(float* x, float a, int n) {\n  int i = blockIdx.x * blockDim.x + threadIdx.x;\n  if (i < n) x[i] *= a;\n}\n",
                "scale.hip",
                &compile_options("gfx90a:sramecc+:xnack-"),
            )
            .unwrap();
        assert!(is_code_object(&code), "{} bytes", code.len());
        assert!(code.windows(5).any(|w| w == b"scale"));
        assert!(rtc.identity().contains("hiprtc"), "{}", rtc.identity());
    }
}
