//! The HIP runtime entry points kiln calls, and error translation.
//!
//! `hip-sys` locates and links `libamdhip64` (its build script finds the ROCm
//! install and emits the link flags), but the functions are declared here
//! rather than taken from its bindings, for two reasons:
//! * its pre-generated bindings (HIP 5.4) return `hipError_t` as a Rust enum;
//!   a newer runtime returning a code that enum lacks would be undefined
//!   behaviour, so every call here returns the raw `c_int`;
//! * its `hipDeviceProp_t` is the pre-6.0 layout; the architecture name is
//!   read through [`crate::hip::device`] instead, which handles both.
//!
//! Only symbols present since ROCm 5.2 are declared (the oldest HIP kiln
//! builds against: Debian 12's `libamdhip64-dev`). Handles are opaque
//! pointers. Not here: hiprtc and hipBLASLt (loaded with dlopen: `rtc`,
//! `blaslt`).

use crate::backend::BackendError;
use crate::hip::device::{gcn_arch_name, PropsLayout, PROPS_BUFFER_BYTES};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

// Keeps hip-sys (and so its link directives) in the link.
use hip_sys as _;

pub type HipError = c_int;
pub type Stream = *mut c_void;
pub type Module = *mut c_void;
pub type Function = *mut c_void;
pub type Graph = *mut c_void;
pub type GraphExec = *mut c_void;
pub type GraphNode = *mut c_void;
pub type Event = *mut c_void;

pub const HIP_SUCCESS: HipError = 0;
pub const HIP_ERROR_OUT_OF_MEMORY: HipError = 2;
pub const HIP_ERROR_NOT_INITIALIZED: HipError = 3;
pub const HIP_ERROR_INSUFFICIENT_DRIVER: HipError = 35;
pub const HIP_ERROR_NO_DEVICE: HipError = 100;
pub const HIP_ERROR_INVALID_IMAGE: HipError = 200;
pub const HIP_ERROR_NO_BINARY_FOR_GPU: HipError = 209;
pub const HIP_ERROR_NOT_FOUND: HipError = 500;
/// `hipStreamNonBlocking`: the stream does not synchronize with stream 0.
pub const STREAM_NON_BLOCKING: c_uint = 1;
/// `hipStreamCaptureModeGlobal`: unsafe calls (such as `hipMalloc`) from any
/// thread fail while the capture is active, so a library that allocates
/// lazily inside kiln's capture is caught rather than baked in.
pub const CAPTURE_MODE_GLOBAL: c_int = 0;
/// `hipStreamCaptureStatusNone`.
pub const CAPTURE_STATUS_NONE: c_int = 0;

#[link(name = "amdhip64")]
extern "C" {
    pub fn hipGetDeviceCount(count: *mut c_int) -> HipError;
    pub fn hipSetDevice(device: c_int) -> HipError;
    pub fn hipDeviceGetName(name: *mut c_char, len: c_int, device: c_int) -> HipError;
    pub fn hipRuntimeGetVersion(version: *mut c_int) -> HipError;
    pub fn hipGetErrorName(error: HipError) -> *const c_char;
    pub fn hipGetErrorString(error: HipError) -> *const c_char;
    pub fn hipGetLastError() -> HipError;

    pub fn hipStreamCreateWithFlags(stream: *mut Stream, flags: c_uint) -> HipError;
    pub fn hipStreamDestroy(stream: Stream) -> HipError;
    pub fn hipStreamSynchronize(stream: Stream) -> HipError;

    pub fn hipMalloc(ptr: *mut *mut c_void, size: usize) -> HipError;
    pub fn hipMemGetInfo(free: *mut usize, total: *mut usize) -> HipError;
    pub fn hipFree(ptr: *mut c_void) -> HipError;
    pub fn hipMemsetAsync(dst: *mut c_void, value: c_int, size: usize, stream: Stream) -> HipError;
    pub fn hipMemcpyHtoDAsync(
        dst: *mut c_void,
        src: *mut c_void,
        size: usize,
        stream: Stream,
    ) -> HipError;
    pub fn hipMemcpyDtoHAsync(
        dst: *mut c_void,
        src: *mut c_void,
        size: usize,
        stream: Stream,
    ) -> HipError;

    pub fn hipModuleLoadData(module: *mut Module, image: *const c_void) -> HipError;
    pub fn hipModuleUnload(module: Module) -> HipError;
    pub fn hipModuleGetFunction(f: *mut Function, module: Module, name: *const c_char) -> HipError;
    pub fn hipModuleLaunchKernel(
        f: Function,
        grid_x: c_uint,
        grid_y: c_uint,
        grid_z: c_uint,
        block_x: c_uint,
        block_y: c_uint,
        block_z: c_uint,
        shared_bytes: c_uint,
        stream: Stream,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> HipError;

    pub fn hipStreamBeginCapture(stream: Stream, mode: c_int) -> HipError;
    pub fn hipStreamEndCapture(stream: Stream, graph: *mut Graph) -> HipError;
    pub fn hipStreamIsCapturing(stream: Stream, status: *mut c_int) -> HipError;
    pub fn hipGraphInstantiate(
        exec: *mut GraphExec,
        graph: Graph,
        error_node: *mut GraphNode,
        log: *mut c_char,
        log_size: usize,
    ) -> HipError;
    pub fn hipGraphLaunch(exec: GraphExec, stream: Stream) -> HipError;
    pub fn hipGraphExecDestroy(exec: GraphExec) -> HipError;
    pub fn hipGraphDestroy(graph: Graph) -> HipError;

    pub fn hipMemcpyDtoDAsync(
        dst: *mut c_void,
        src: *mut c_void,
        size: usize,
        stream: Stream,
    ) -> HipError;
    pub fn hipEventCreate(event: *mut Event) -> HipError;
    pub fn hipEventRecord(event: Event, stream: Stream) -> HipError;
    pub fn hipEventSynchronize(event: Event) -> HipError;
    pub fn hipEventElapsedTime(ms: *mut f32, start: Event, stop: Event) -> HipError;
    pub fn hipEventDestroy(event: Event) -> HipError;
}

fn c_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the HIP runtime returns static NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// `hipErrorX (code): description`.
pub fn describe(code: HipError) -> String {
    // SAFETY: both calls accept any code and return static strings.
    let (name, text) = unsafe { (c_str(hipGetErrorName(code)), c_str(hipGetErrorString(code))) };
    format!("{name} ({code}): {text}")
}

/// Ok for `hipSuccess`, else a device error naming the call.
pub fn check(code: HipError, call: &str) -> Result<(), BackendError> {
    if code == HIP_SUCCESS {
        Ok(())
    } else {
        Err(BackendError::Device(format!(
            "{call} failed: {}",
            describe(code)
        )))
    }
}

/// Devices the HIP runtime sees; 0 when there is no device or no driver
/// (the case on every machine without an AMD GPU).
pub fn device_count() -> u32 {
    let mut n: c_int = 0;
    // SAFETY: out-pointer to a local.
    let code = unsafe { hipGetDeviceCount(&mut n) };
    if code == HIP_SUCCESS {
        n.max(0) as u32
    } else {
        0
    }
}

/// Why [`device_count`] found nothing, for the "skipped" line of tests.
pub fn no_device_reason() -> String {
    let mut n: c_int = 0;
    // SAFETY: out-pointer to a local.
    let code = unsafe { hipGetDeviceCount(&mut n) };
    match code {
        HIP_SUCCESS if n > 0 => format!("{n} device(s) present"),
        HIP_SUCCESS => "the HIP runtime reports 0 devices".into(),
        _ => describe(code),
    }
}

/// The HIP runtime version as `major.minor.patch` and its raw number.
pub fn runtime_version() -> Result<(String, i32), BackendError> {
    let mut v: c_int = 0;
    // SAFETY: out-pointer to a local.
    check(
        unsafe { hipRuntimeGetVersion(&mut v) },
        "hipRuntimeGetVersion",
    )?;
    // HIP_VERSION = major * 10^7 + minor * 10^5 + patch.
    Ok((
        format!("{}.{}.{}", v / 10_000_000, v / 100_000 % 100, v % 100_000),
        v,
    ))
}

/// The device's marketing name.
pub fn device_name(ordinal: u32) -> Result<String, BackendError> {
    let mut buf = [0 as c_char; 256];
    // SAFETY: the buffer is 256 bytes and its length is passed.
    check(
        unsafe { hipDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, ordinal as c_int) },
        "hipDeviceGetName",
    )?;
    buf[255] = 0;
    Ok(c_str(buf.as_ptr()))
}

type GetPropsFn = unsafe extern "C" fn(*mut c_void, c_int) -> HipError;

/// The device's `gcnArchName` (`gfx90a:sramecc+:xnack-`), through the ROCm 6
/// properties entry point when the runtime has it, the older one otherwise.
pub fn device_arch(ordinal: u32) -> Result<String, BackendError> {
    let this = libloading::os::unix::Library::this();
    let mut last_err = String::new();
    for layout in [PropsLayout::R0600, PropsLayout::R0000] {
        // SAFETY: both symbols have the signature (prop*, int) -> hipError_t.
        let f = match unsafe { this.get::<GetPropsFn>(layout.symbol()) } {
            Ok(f) => f,
            Err(e) => {
                last_err = e.to_string();
                continue;
            }
        };
        // u64 storage: 8-byte aligned, like the struct.
        let mut buf = vec![0u64; PROPS_BUFFER_BYTES / 8];
        // SAFETY: the buffer is larger than either layout of the struct.
        let code = unsafe { f(buf.as_mut_ptr().cast(), ordinal as c_int) };
        check(code, "hipGetDeviceProperties")?;
        let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_ne_bytes()).collect();
        return gcn_arch_name(&bytes, layout).map_err(BackendError::Device);
    }
    Err(BackendError::Device(format!(
        "the HIP runtime exports no hipGetDeviceProperties entry point ({last_err})"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_described_by_name_code_and_text() {
        let d = describe(HIP_ERROR_OUT_OF_MEMORY);
        assert!(
            d.contains("hipErrorOutOfMemory") && d.contains("(2)"),
            "{d}"
        );
        let e = check(HIP_ERROR_NO_DEVICE, "hipSetDevice(3)")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("hipSetDevice(3) failed: hipErrorNoDevice (100)"),
            "{e}"
        );
        assert!(check(HIP_SUCCESS, "x").is_ok());
        // A code this runtime does not know is described, not undefined behaviour.
        let d = describe(123_456);
        assert!(d.contains("(123456)"), "{d}");
    }

    #[test]
    fn the_runtime_version_parses_as_major_minor_patch() {
        let (text, raw) = runtime_version().unwrap();
        assert!(raw >= 50_000_000, "{raw}");
        let parts: Vec<u32> = text.split('.').map(|p| p.parse().unwrap()).collect();
        assert_eq!(parts.len(), 3, "{text}");
        assert!(parts[0] >= 5, "{text}");
    }

    #[test]
    fn without_a_device_the_count_is_zero_and_the_reason_is_named() {
        if device_count() > 0 {
            println!("skipped: a HIP device is present ({})", no_device_reason());
            return;
        }
        let why = no_device_reason();
        assert!(!why.is_empty());
        println!("no HIP device: {why}");
    }
}
