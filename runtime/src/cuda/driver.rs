//! Checked calls into the CUDA driver and cuBLASLt: every return code becomes
//! a [`BackendError`] naming the call, so no failure is silently dropped.

use crate::backend::BackendError;
use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys as cu;
use std::ffi::CStr;

/// The driver's name and description of `r`.
pub fn describe(r: cu::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut desc: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: both out-pointers are valid; the driver returns static strings.
    unsafe {
        cu::cuGetErrorName(r, &mut name);
        cu::cuGetErrorString(r, &mut desc);
    }
    let s = |p: *const std::ffi::c_char| {
        if p.is_null() {
            format!("{r:?}")
        } else {
            // SAFETY: non-null pointers from the driver are NUL-terminated.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    format!("{} ({})", s(name), s(desc))
}

/// `Ok` for `CUDA_SUCCESS`, else a `Device` error naming `call`.
pub fn check(r: cu::CUresult, call: &str) -> Result<(), BackendError> {
    if r == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(BackendError::Device(format!(
            "{call} failed: {}",
            describe(r)
        )))
    }
}

/// `Ok` for `CUBLAS_STATUS_SUCCESS`, else a `Device` error naming `call`.
pub fn check_lt(s: lt::cublasStatus_t, call: &str) -> Result<(), BackendError> {
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Ok(());
    }
    // SAFETY: cuBLASLt returns a static string for every status.
    let msg = unsafe {
        let p = lt::cublasLtGetStatusString(s);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    Err(BackendError::Device(format!(
        "{call} failed: {s:?} ({msg})"
    )))
}

/// True when the driver library (`libcuda.so.1`) can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: probing opens and closes the library.
    unsafe { cu::is_culib_present() }
}

/// True when cuBLASLt (`libcublasLt.so.13`) can be loaded.
pub fn cublaslt_present() -> bool {
    // SAFETY: as above.
    unsafe { lt::is_culib_present() }
}
