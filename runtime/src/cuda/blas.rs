//! cuBLASLt GEMMs with a workspace bounded by the plan.
//!
//! kiln's weights are `[N, K]` row-major and activations `[T, K]` row-major;
//! `out[T, N] = x @ w^T` is computed column-major as `out^T[N, T] = w[K, N]^T
//! @ x^T[K, T]`: A = w (transposed), B = x, both with leading dimension K, D
//! with leading dimension N. Compute is f32 (`CUBLAS_COMPUTE_32F`, no TF32),
//! so the only rounding is the store to the result dtype, as on the CPU.
//!
//! An algorithm is selected per GEMM shape with the heuristic preference
//! `MAX_WORKSPACE_BYTES` set to the plan's figure, once, before capture
//! ([`Blas::select`]); a GEMM whose every algorithm needs more than that is
//! refused with `WorkspaceTooSmall` naming what it would need. Bias is the
//! `BIAS` epilogue (added in f32 before the store).
//!
//! Not here: batched or strided GEMMs (the plans have none), FP8.

use super::driver::check_lt;
use crate::backend::BackendError;
use cudarc::cublaslt::sys as lt;
use kiln_ir::DType;
use kiln_kernels::gpu::GemmCall;
use std::collections::HashMap;
use std::ffi::c_void;

fn data_type(d: DType) -> Result<lt::cudaDataType, BackendError> {
    Ok(match d {
        DType::BF16 => lt::cudaDataType::CUDA_R_16BF,
        DType::F16 => lt::cudaDataType::CUDA_R_16F,
        DType::F32 => lt::cudaDataType::CUDA_R_32F,
        DType::I32 => {
            return Err(BackendError::Device(
                "GEMM operands must be float, got i32".into(),
            ))
        }
    })
}

/// Descriptors and the selected algorithm of one GEMM shape.
struct Prepared {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    d: lt::cublasLtMatrixLayout_t,
    /// Heuristic candidates that fit the granted workspace, best first,
    /// with the workspace each needs.
    algos: Vec<(lt::cublasLtMatmulAlgo_t, u64)>,
    /// The candidate in use.
    chosen: usize,
    /// Workspace the candidates were selected under.
    granted: u64,
}

/// A cuBLASLt handle and the per-shape algorithm cache.
pub struct Blas {
    handle: lt::cublasLtHandle_t,
    cache: HashMap<GemmCall, Prepared>,
}

/// Human name of a GEMM for error messages.
pub fn describe(g: &GemmCall) -> String {
    format!(
        "matmul {}[{},{}] x {}[{},{}]^T{} -> {}[{},{}]",
        g.dtype,
        g.t,
        g.k,
        g.dtype,
        g.n,
        g.k,
        if g.bias { " + bias" } else { "" },
        g.out,
        g.t,
        g.n
    )
}

impl Blas {
    pub fn new() -> Result<Blas, BackendError> {
        if !super::driver::cublaslt_present() {
            return Err(BackendError::Device(
                "cuBLASLt (libcublasLt.so.13) was not found: install the CUDA 13 toolkit or the `nvidia-cublas` wheel and put its lib folder on LD_LIBRARY_PATH".into(),
            ));
        }
        let mut handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check_lt(unsafe { lt::cublasLtCreate(&mut handle) }, "cublasLtCreate")?;
        Ok(Blas {
            handle,
            cache: HashMap::new(),
        })
    }

    /// The workspace the chosen algorithm of `g` needs, if selected.
    pub fn selected(&self, g: &GemmCall) -> Option<u64> {
        self.cache.get(g).map(|p| p.algos[p.chosen].1)
    }

    /// Uses candidate `i` of `g` from now on.
    pub fn choose(&mut self, g: &GemmCall, i: usize) {
        if let Some(p) = self.cache.get_mut(g) {
            if i < p.algos.len() {
                p.chosen = i;
            }
        }
    }

    fn descriptors(
        g: &GemmCall,
    ) -> Result<
        (
            lt::cublasLtMatmulDesc_t,
            lt::cublasLtMatrixLayout_t,
            lt::cublasLtMatrixLayout_t,
            lt::cublasLtMatrixLayout_t,
        ),
        BackendError,
    > {
        let (din, dout) = (data_type(g.dtype)?, data_type(g.out)?);
        let mut desc = std::ptr::null_mut();
        // SAFETY: out-pointers are valid; attribute buffers outlive each call.
        unsafe {
            check_lt(
                lt::cublasLtMatmulDescCreate(
                    &mut desc,
                    lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    lt::cudaDataType::CUDA_R_32F,
                ),
                "cublasLtMatmulDescCreate",
            )?;
            let op_t: i32 = 1; // CUBLAS_OP_T
            let op_n: i32 = 0; // CUBLAS_OP_N
            let set = |attr, v: *const c_void, n: usize| {
                check_lt(
                    lt::cublasLtMatmulDescSetAttribute(desc, attr, v, n),
                    "cublasLtMatmulDescSetAttribute",
                )
            };
            set(
                lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &op_t as *const i32 as *const c_void,
                4,
            )?;
            set(
                lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                &op_n as *const i32 as *const c_void,
                4,
            )?;
            if g.bias {
                let epi = lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
                set(
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    &epi as *const _ as *const c_void,
                    std::mem::size_of_val(&epi),
                )?;
                let bt = din;
                set(
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                    &bt as *const _ as *const c_void,
                    std::mem::size_of_val(&bt),
                )?;
            }
            let layout = |ty, rows: u32, cols: u32, ld: u32| {
                let mut l = std::ptr::null_mut();
                check_lt(
                    lt::cublasLtMatrixLayoutCreate(&mut l, ty, rows as u64, cols as u64, ld as i64),
                    "cublasLtMatrixLayoutCreate",
                )
                .map(|_| l)
            };
            let a = layout(din, g.k, g.n, g.k)?;
            let b = layout(din, g.k, g.t, g.k)?;
            let d = layout(dout, g.n, g.t, g.n)?;
            Ok((desc, a, b, d))
        }
    }

    fn heuristic(
        &self,
        desc: lt::cublasLtMatmulDesc_t,
        a: lt::cublasLtMatrixLayout_t,
        b: lt::cublasLtMatrixLayout_t,
        d: lt::cublasLtMatrixLayout_t,
        max_workspace: u64,
    ) -> Result<Vec<lt::cublasLtMatmulHeuristicResult_t>, BackendError> {
        let mut pref = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the preference is destroyed below.
        unsafe {
            check_lt(
                lt::cublasLtMatmulPreferenceCreate(&mut pref),
                "cublasLtMatmulPreferenceCreate",
            )?;
            let ws: u64 = max_workspace;
            let r = check_lt(
                lt::cublasLtMatmulPreferenceSetAttribute(
                    pref,
                    lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &ws as *const u64 as *const c_void,
                    8,
                ),
                "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)",
            );
            let mut results: Vec<lt::cublasLtMatmulHeuristicResult_t> =
                vec![std::mem::zeroed(); 16];
            let mut count = 0i32;
            let r = r.and_then(|_| {
                let s = lt::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    desc,
                    a,
                    b,
                    d,
                    d,
                    pref,
                    results.len() as i32,
                    results.as_mut_ptr(),
                    &mut count,
                );
                // NOT_SUPPORTED means "no algorithm under this preference".
                if s == lt::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED {
                    count = 0;
                    Ok(())
                } else {
                    check_lt(s, "cublasLtMatmulAlgoGetHeuristic")
                }
            });
            lt::cublasLtMatmulPreferenceDestroy(pref);
            r?;
            results.truncate(count.max(0) as usize);
            results.retain(|h| {
                h.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                    && h.workspaceSize as u64 <= max_workspace
            });
            Ok(results)
        }
    }

    /// Selects (once) and caches the candidate algorithms of `g` under
    /// `granted` bytes of workspace; the heuristic's first is chosen until
    /// [`Blas::choose`] says otherwise. Returns the number of candidates.
    /// With `allow_none`, no fitting algorithm is not an error (another
    /// implementation will run the GEMM); otherwise it is `WorkspaceTooSmall`.
    pub fn select(
        &mut self,
        g: &GemmCall,
        granted: u64,
        allow_none: bool,
    ) -> Result<usize, BackendError> {
        if let Some(p) = self.cache.get(g) {
            if p.granted == granted {
                return Ok(p.algos.len());
            }
        }
        let (desc, a, b, d) = Self::descriptors(g)?;
        let found = self.heuristic(desc, a, b, d, granted);
        let algos: Vec<(lt::cublasLtMatmulAlgo_t, u64)> = match found {
            Ok(v) if !v.is_empty() => v.iter().map(|h| (h.algo, h.workspaceSize as u64)).collect(),
            other => {
                // What would it need? Ask again without the bound.
                let needed = self
                    .heuristic(desc, a, b, d, 1 << 32)
                    .ok()
                    .and_then(|v| v.iter().map(|h| h.workspaceSize as u64).min());
                destroy(desc, a, b, d);
                other?;
                if allow_none {
                    return Ok(0);
                }
                return Err(match needed {
                    Some(needed) => BackendError::WorkspaceTooSmall {
                        what: describe(g),
                        needed,
                        granted,
                    },
                    None => BackendError::Device(format!(
                        "cuBLASLt has no algorithm for {} on this device",
                        describe(g)
                    )),
                });
            }
        };
        if let Some(old) = self.cache.remove(g) {
            destroy(old.desc, old.a, old.b, old.d);
        }
        let n = algos.len();
        self.cache.insert(
            *g,
            Prepared {
                desc,
                a,
                b,
                d,
                algos,
                chosen: 0,
                granted,
            },
        );
        Ok(n)
    }

    /// Enqueues `g` on `stream`. The algorithm must have been selected.
    ///
    /// # Safety
    /// Pointers must address live device memory of the GEMM's sizes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul(
        &self,
        g: &GemmCall,
        x: u64,
        w: u64,
        bias: Option<u64>,
        out: u64,
        workspace: (u64, u64),
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), BackendError> {
        let p = self.cache.get(g).ok_or_else(|| {
            BackendError::Device(format!(
                "{} has no selected algorithm; call prepare before launching it",
                describe(g)
            ))
        })?;
        let (algo, need) = p.algos[p.chosen];
        if need > workspace.1 {
            return Err(BackendError::WorkspaceTooSmall {
                what: describe(g),
                needed: need,
                granted: workspace.1,
            });
        }
        if let Some(bp) = bias {
            let ptr = bp as *const c_void;
            check_lt(
                lt::cublasLtMatmulDescSetAttribute(
                    p.desc,
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &ptr as *const *const c_void as *const c_void,
                    8,
                ),
                "cublasLtMatmulDescSetAttribute(BIAS_POINTER)",
            )?;
        }
        let alpha = 1.0f32;
        let beta = 0.0f32;
        check_lt(
            lt::cublasLtMatmul(
                self.handle,
                p.desc,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                p.a,
                x as *const c_void,
                p.b,
                &beta as *const f32 as *const c_void,
                out as *const c_void,
                p.d,
                out as *mut c_void,
                p.d,
                &algo,
                workspace.0 as *mut c_void,
                need as usize,
                stream as lt::cudaStream_t,
            ),
            "cublasLtMatmul",
        )
    }
}

fn destroy(
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    d: lt::cublasLtMatrixLayout_t,
) {
    // SAFETY: each descriptor was created by cuBLASLt and is destroyed once.
    unsafe {
        lt::cublasLtMatrixLayoutDestroy(a);
        lt::cublasLtMatrixLayoutDestroy(b);
        lt::cublasLtMatrixLayoutDestroy(d);
        lt::cublasLtMatmulDescDestroy(desc);
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        for (_, p) in self.cache.drain() {
            destroy(p.desc, p.a, p.b, p.d);
        }
        // SAFETY: the handle was created by cublasLtCreate.
        unsafe {
            lt::cublasLtDestroy(self.handle);
        }
    }
}
