//! hipBLASLt, loaded with dlopen: the HIP backend's GEMMs.
//!
//! Every GEMM problem is prepared once, before any capture: descriptors are
//! created, the heuristic is asked for algorithms with a max-workspace
//! preference equal to the workspace the plan grants, and each answer is
//! checked by [`crate::hip::gemm::select_algorithm`] (refusing, with
//! `WorkspaceTooSmall`, an algorithm that needs more than the plan grants).
//! A launch then only sets the bias pointer and calls `hipblasLtMatmul` with
//! the chosen algorithm and the pre-grown workspace, so nothing inside a
//! capture allocates or searches.
//!
//! Enum values and struct layouts are those of hipBLASLt in ROCm 6.0 and
//! later (`hipDataType`, `hipblasComputeType_t`); earlier hipBLASLt releases
//! used other values, so the backend refuses them by HIP runtime version.
//!
//! Not here: the column-major mapping and the bounds ([`crate::hip::gemm`]).

use crate::backend::{BackendError, DevPtr};
use crate::hip::ffi::Stream;
use crate::hip::gemm::{select_algorithm, AlgoCandidate, GemmOperands, GemmProblem, MatrixLayout};
use kiln_ir::DType;
use libloading::Library;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};

type Status = c_int;
type Handle = *mut c_void;
type MatmulDesc = *mut c_void;
type Layout = *mut c_void;
type Preference = *mut c_void;

const STATUS_SUCCESS: Status = 0;

/// Libraries tried, in order.
pub const HIPBLASLT_LIBRARIES: &[&str] =
    &["libhipblaslt.so", "libhipblaslt.so.1", "libhipblaslt.so.0"];

/// `hipDataType` values (hip/library_types.h).
pub fn data_type(d: DType) -> Option<c_int> {
    match d {
        DType::F32 => Some(0),   // HIP_R_32F
        DType::F16 => Some(2),   // HIP_R_16F
        DType::BF16 => Some(14), // HIP_R_16BF
        DType::I32 => None,
    }
}

/// `HIPBLAS_COMPUTE_32F`: f32 accumulation, as the CPU reference does.
pub const COMPUTE_32F: c_int = 2;
/// `HIP_R_32F`, the type of alpha and beta.
pub const SCALE_32F: c_int = 0;
/// `hipblasOperation_t`.
pub const OP_N: c_int = 111;
pub const OP_T: c_int = 112;
/// `hipblasLtMatmulDescAttributes_t`.
pub const DESC_TRANSA: c_int = 0;
pub const DESC_TRANSB: c_int = 1;
pub const DESC_EPILOGUE: c_int = 2;
pub const DESC_BIAS_POINTER: c_int = 3;
pub const DESC_BIAS_DATA_TYPE: c_int = 4;
/// `hipblasLtEpilogue_t`.
pub const EPILOGUE_DEFAULT: u32 = 1;
pub const EPILOGUE_BIAS: u32 = 4;
/// `HIPBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES` (a `uint64_t`).
pub const PREF_MAX_WORKSPACE_BYTES: c_int = 1;
/// Algorithms asked of the heuristic per problem.
pub const REQUESTED_ALGOS: usize = 16;

/// `hipblasLtMatmulAlgo_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Algo {
    pub data: [u8; 16],
    pub max_workspace_bytes: usize,
}

/// `hipblasLtMatmulHeuristicResult_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HeuristicResult {
    pub algo: Algo,
    pub workspace_size: usize,
    pub state: Status,
    pub waves_count: f32,
    pub reserved: [c_int; 4],
}

type CreateFn = unsafe extern "C" fn(*mut Handle) -> Status;
type DestroyFn = unsafe extern "C" fn(*mut c_void) -> Status;
type DescCreateFn = unsafe extern "C" fn(*mut MatmulDesc, c_int, c_int) -> Status;
type SetAttrFn = unsafe extern "C" fn(*mut c_void, c_int, *const c_void, usize) -> Status;
type LayoutCreateFn = unsafe extern "C" fn(*mut Layout, c_int, u64, u64, i64) -> Status;
type PrefCreateFn = unsafe extern "C" fn(*mut Preference) -> Status;
type HeuristicFn = unsafe extern "C" fn(
    Handle,
    MatmulDesc,
    Layout,
    Layout,
    Layout,
    Layout,
    Preference,
    c_int,
    *mut HeuristicResult,
    *mut c_int,
) -> Status;
type MatmulFn = unsafe extern "C" fn(
    Handle,
    MatmulDesc,
    *const c_void,
    *const c_void,
    Layout,
    *const c_void,
    Layout,
    *const c_void,
    *const c_void,
    Layout,
    *mut c_void,
    Layout,
    *const Algo,
    *mut c_void,
    usize,
    Stream,
) -> Status;

struct Fns {
    destroy: DestroyFn,
    desc_create: DescCreateFn,
    desc_destroy: DestroyFn,
    desc_set: SetAttrFn,
    layout_create: LayoutCreateFn,
    layout_destroy: DestroyFn,
    pref_create: PrefCreateFn,
    pref_destroy: DestroyFn,
    pref_set: SetAttrFn,
    heuristic: HeuristicFn,
    matmul: MatmulFn,
}

/// One prepared GEMM: descriptors and the chosen algorithm.
struct Prepared {
    desc: MatmulDesc,
    a: Layout,
    b: Layout,
    d: Layout,
    algo: Algo,
    workspace: u64,
}

/// A hipBLASLt handle on the current device, and the GEMMs prepared on it.
pub struct HipBlasLt {
    fns: Fns,
    handle: Handle,
    prepared: HashMap<(GemmProblem, u64), Prepared>,
    library: String,
    _lib: Library,
}

fn status(s: Status, call: &str, what: &str) -> Result<(), BackendError> {
    if s == STATUS_SUCCESS {
        Ok(())
    } else {
        Err(BackendError::Device(format!(
            "{call} failed for {what}: hipblasStatus_t {s}"
        )))
    }
}

impl HipBlasLt {
    /// Loads hipBLASLt and creates a handle on the current HIP device.
    pub fn load() -> Result<HipBlasLt, BackendError> {
        let mut tried = Vec::new();
        for &name in HIPBLASLT_LIBRARIES {
            // SAFETY: loading ROCm's hipBLASLt runs its initialisers only.
            match unsafe { Library::new(name) } {
                Ok(lib) => match HipBlasLt::from_library(lib, name) {
                    Ok(b) => return Ok(b),
                    Err(e) => tried.push(format!("{name}: {e}")),
                },
                Err(e) => tried.push(format!("{name}: {e}")),
            }
        }
        Err(BackendError::Device(format!(
            "hipBLASLt is not available and the plan has GEMMs; install ROCm's hipBLASLt (ROCm >= 6.0, an architecture it supports). Tried: {}",
            tried.join("; ")
        )))
    }

    fn from_library(lib: Library, name: &str) -> Result<HipBlasLt, String> {
        let e = |err: libloading::Error| err.to_string();
        // SAFETY: signatures as in hipblaslt.h (ROCm 6.x); the pointers stay
        // valid while `lib` (kept in the struct) is loaded.
        let (fns, create) = unsafe {
            (
                Fns {
                    destroy: *lib.get::<DestroyFn>(b"hipblasLtDestroy\0").map_err(e)?,
                    desc_create: *lib
                        .get::<DescCreateFn>(b"hipblasLtMatmulDescCreate\0")
                        .map_err(e)?,
                    desc_destroy: *lib
                        .get::<DestroyFn>(b"hipblasLtMatmulDescDestroy\0")
                        .map_err(e)?,
                    desc_set: *lib
                        .get::<SetAttrFn>(b"hipblasLtMatmulDescSetAttribute\0")
                        .map_err(e)?,
                    layout_create: *lib
                        .get::<LayoutCreateFn>(b"hipblasLtMatrixLayoutCreate\0")
                        .map_err(e)?,
                    layout_destroy: *lib
                        .get::<DestroyFn>(b"hipblasLtMatrixLayoutDestroy\0")
                        .map_err(e)?,
                    pref_create: *lib
                        .get::<PrefCreateFn>(b"hipblasLtMatmulPreferenceCreate\0")
                        .map_err(e)?,
                    pref_destroy: *lib
                        .get::<DestroyFn>(b"hipblasLtMatmulPreferenceDestroy\0")
                        .map_err(e)?,
                    pref_set: *lib
                        .get::<SetAttrFn>(b"hipblasLtMatmulPreferenceSetAttribute\0")
                        .map_err(e)?,
                    heuristic: *lib
                        .get::<HeuristicFn>(b"hipblasLtMatmulAlgoGetHeuristic\0")
                        .map_err(e)?,
                    matmul: *lib.get::<MatmulFn>(b"hipblasLtMatmul\0").map_err(e)?,
                },
                *lib.get::<CreateFn>(b"hipblasLtCreate\0").map_err(e)?,
            )
        };
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: out-pointer; the caller has set the HIP device.
        let s = unsafe { create(&mut handle) };
        if s != STATUS_SUCCESS || handle.is_null() {
            return Err(format!("hipblasLtCreate failed: hipblasStatus_t {s}"));
        }
        Ok(HipBlasLt {
            fns,
            handle,
            prepared: HashMap::new(),
            library: name.to_string(),
            _lib: lib,
        })
    }

    /// Which library was loaded.
    pub fn library(&self) -> &str {
        &self.library
    }

    fn layout(&self, l: &MatrixLayout, what: &str) -> Result<Layout, BackendError> {
        let ty = data_type(l.dtype).ok_or_else(|| {
            BackendError::Device(format!("{what}: hipBLASLt has no {} matrices", l.dtype))
        })?;
        let mut out: Layout = std::ptr::null_mut();
        // SAFETY: out-pointer; plain values.
        let s = unsafe { (self.fns.layout_create)(&mut out, ty, l.rows, l.cols, l.ld) };
        status(s, "hipblasLtMatrixLayoutCreate", what)?;
        Ok(out)
    }

    fn set(
        &self,
        f: SetAttrFn,
        obj: *mut c_void,
        attr: c_int,
        value: &[u8],
        what: &str,
    ) -> Result<(), BackendError> {
        // SAFETY: `value` is the attribute's exact byte representation.
        let s = unsafe { f(obj, attr, value.as_ptr().cast(), value.len()) };
        status(s, "hipBLASLt set attribute", what)
    }

    /// Selects (once per problem and grant) the algorithm for `p` within
    /// `granted` workspace bytes. Returns the workspace it needs.
    pub fn prepare(&mut self, p: &GemmProblem, granted: u64) -> Result<u64, BackendError> {
        if let Some(done) = self.prepared.get(&(p.clone(), granted)) {
            return Ok(done.workspace);
        }
        let what = p.describe();
        let mut desc: MatmulDesc = std::ptr::null_mut();
        // SAFETY: out-pointer; plain values.
        let s = unsafe { (self.fns.desc_create)(&mut desc, COMPUTE_32F, SCALE_32F) };
        status(s, "hipblasLtMatmulDescCreate", &what)?;
        let mut created = Prepared {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            algo: Algo::default(),
            workspace: 0,
        };
        let result = self.fill(&mut created, p, granted, &what);
        match result {
            Ok(()) => {
                let ws = created.workspace;
                self.prepared.insert((p.clone(), granted), created);
                Ok(ws)
            }
            Err(e) => {
                self.destroy_prepared(&created);
                Err(e)
            }
        }
    }

    fn fill(
        &self,
        g: &mut Prepared,
        p: &GemmProblem,
        granted: u64,
        what: &str,
    ) -> Result<(), BackendError> {
        let op = |t: bool| if t { OP_T } else { OP_N };
        self.set(
            self.fns.desc_set,
            g.desc,
            DESC_TRANSA,
            &op(p.trans_a).to_ne_bytes(),
            what,
        )?;
        self.set(
            self.fns.desc_set,
            g.desc,
            DESC_TRANSB,
            &op(p.trans_b).to_ne_bytes(),
            what,
        )?;
        let epilogue = if p.bias.is_some() {
            EPILOGUE_BIAS
        } else {
            EPILOGUE_DEFAULT
        };
        self.set(
            self.fns.desc_set,
            g.desc,
            DESC_EPILOGUE,
            &epilogue.to_ne_bytes(),
            what,
        )?;
        if let Some(bias) = p.bias {
            let ty = data_type(bias).ok_or_else(|| {
                BackendError::Device(format!("{what}: hipBLASLt has no {bias} bias"))
            })?;
            self.set(
                self.fns.desc_set,
                g.desc,
                DESC_BIAS_DATA_TYPE,
                &ty.to_ne_bytes(),
                what,
            )?;
        }
        g.a = self.layout(&p.a, what)?;
        g.b = self.layout(&p.b, what)?;
        g.d = self.layout(&p.d, what)?;
        let mut pref: Preference = std::ptr::null_mut();
        // SAFETY: out-pointer.
        status(
            unsafe { (self.fns.pref_create)(&mut pref) },
            "hipblasLtMatmulPreferenceCreate",
            what,
        )?;
        let mut results = [HeuristicResult::default(); REQUESTED_ALGOS];
        let mut returned: c_int = 0;
        let asked = self
            .set(
                self.fns.pref_set,
                pref,
                PREF_MAX_WORKSPACE_BYTES,
                &granted.to_ne_bytes(),
                what,
            )
            .map(|()| {
                // SAFETY: descriptors are live; `results` holds REQUESTED_ALGOS entries.
                unsafe {
                    (self.fns.heuristic)(
                        self.handle,
                        g.desc,
                        g.a,
                        g.b,
                        g.d,
                        g.d,
                        pref,
                        REQUESTED_ALGOS as c_int,
                        results.as_mut_ptr(),
                        &mut returned,
                    )
                }
            });
        // SAFETY: created above, destroyed once.
        unsafe { (self.fns.pref_destroy)(pref) };
        // A heuristic that finds nothing may report NOT_SUPPORTED: that is
        // "no candidates", which select_algorithm explains.
        asked?;
        let n = (returned.max(0) as usize).min(REQUESTED_ALGOS);
        let candidates: Vec<AlgoCandidate> = results[..n]
            .iter()
            .map(|r| AlgoCandidate {
                workspace: r.workspace_size as u64,
                usable: r.state == STATUS_SUCCESS,
            })
            .collect();
        let i = select_algorithm(&candidates, granted, what)?;
        g.algo = results[i].algo;
        g.workspace = results[i].workspace_size as u64;
        Ok(())
    }

    fn destroy_prepared(&self, g: &Prepared) {
        // SAFETY: each non-null object was created by this library, once.
        unsafe {
            for l in [g.a, g.b, g.d] {
                if !l.is_null() {
                    (self.fns.layout_destroy)(l);
                }
            }
            if !g.desc.is_null() {
                (self.fns.desc_destroy)(g.desc);
            }
        }
    }

    /// Runs the prepared GEMM `p` (with grant `granted`) on `stream`.
    ///
    /// # Safety
    /// `stream` must be a live HIP stream of the current device, and `ops`
    /// (and `workspace`, `granted` bytes) device memory large enough for `p`.
    pub unsafe fn matmul(
        &self,
        p: &GemmProblem,
        granted: u64,
        ops: &GemmOperands,
        workspace: Option<DevPtr>,
        stream: Stream,
    ) -> Result<(), BackendError> {
        let what = p.describe();
        let g = self.prepared.get(&(p.clone(), granted)).ok_or_else(|| {
            BackendError::Device(format!(
                "{what} was not prepared: prepare() selects its algorithm before any capture"
            ))
        })?;
        if let Some(bias) = ops.bias {
            let ptr = bias.0 as *const c_void;
            // SAFETY: the attribute is a device pointer, passed by address.
            let bytes: [u8; 8] = (ptr as u64).to_ne_bytes();
            self.set(self.fns.desc_set, g.desc, DESC_BIAS_POINTER, &bytes, &what)?;
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        let ws = workspace.map_or(std::ptr::null_mut(), |w| w.0 as *mut c_void);
        let ws_bytes = if ws.is_null() { 0 } else { granted as usize };
        // SAFETY: descriptors and algorithm are live; operands are device
        // addresses resolved by the engine; alpha/beta are host f32.
        let s = unsafe {
            (self.fns.matmul)(
                self.handle,
                g.desc,
                (&alpha as *const f32).cast(),
                ops.a.0 as *const c_void,
                g.a,
                ops.b.0 as *const c_void,
                g.b,
                (&beta as *const f32).cast(),
                ops.d.0 as *const c_void,
                g.d,
                ops.d.0 as *mut c_void,
                g.d,
                &g.algo,
                ws,
                ws_bytes,
                stream,
            )
        };
        status(s, "hipblasLtMatmul", &what)
    }

    /// Whether `prepare(p, granted)` has succeeded.
    pub fn is_prepared(&self, p: &GemmProblem, granted: u64) -> bool {
        self.prepared.contains_key(&(p.clone(), granted))
    }

    /// Distinct GEMM problems prepared.
    pub fn prepared_count(&self) -> usize {
        self.prepared.len()
    }
}

impl Drop for HipBlasLt {
    fn drop(&mut self) {
        let prepared: Vec<Prepared> = self.prepared.drain().map(|(_, g)| g).collect();
        for g in &prepared {
            self.destroy_prepared(g);
        }
        // SAFETY: the handle was created by hipblasLtCreate, destroyed once.
        unsafe { (self.fns.destroy)(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ffi_structs_have_the_hipblaslt_layout() {
        // hipblasLtMatmulAlgo_t { uint8_t data[16]; size_t max_workspace_bytes; }
        assert_eq!(std::mem::size_of::<Algo>(), 24);
        // { algo; size_t workspaceSize; hipblasStatus_t state; float wavesCount; int reserved[4]; }
        assert_eq!(std::mem::size_of::<HeuristicResult>(), 56);
        assert_eq!(std::mem::offset_of!(HeuristicResult, workspace_size), 24);
        assert_eq!(std::mem::offset_of!(HeuristicResult, state), 32);
        assert_eq!(std::mem::offset_of!(HeuristicResult, waves_count), 36);
    }

    #[test]
    fn kiln_dtypes_map_to_hip_data_types() {
        assert_eq!(data_type(DType::F32), Some(0));
        assert_eq!(data_type(DType::F16), Some(2));
        assert_eq!(data_type(DType::BF16), Some(14));
        assert_eq!(data_type(DType::I32), None);
    }

    #[test]
    fn a_missing_hipblaslt_is_a_clear_error() {
        match HipBlasLt::load() {
            Ok(b) => println!("hipBLASLt present: {}", b.library()),
            Err(e) => {
                let e = e.to_string();
                assert!(
                    e.contains("install ROCm's hipBLASLt") && e.contains("libhipblaslt.so"),
                    "{e}"
                );
            }
        }
    }
}
