//! kiln's GPU kernels compiled for AMD targets, without an AMD GPU: hiprtc
//! (shipped with `libamdhip64`, what CI installs) compiles the catalog's
//! translation unit to a code object for gfx90a, and every catalog entry
//! point must be in it. This is the check that `kernels/gpu/*.cu` and
//! `kiln_port.h` stay valid HIP, not only CUDA.
//!
//! gfx90a is the newest allowlisted architecture Debian's hiprtc (ROCm 5.2)
//! knows; machines with a newer ROCm compile for their own device at load.
#![cfg(feature = "rocm")]

use kiln_ir::plan::ImageKind;
use kiln_runtime::hip::cache::{
    cache_key, hiprtc_options as compile_options, is_code_object, CacheOutcome, CodeCache,
};
use kiln_runtime::hip::catalog::{all_entry_points, kernels_translation_unit};
use kiln_runtime::hip::offline::{kernel_images, MODULE_NAME};
use kiln_runtime::hip::rtc::Hiprtc;

/// True when `code` defines the kernel `name` (its symbol or its kernel
/// descriptor `name.kd` is in the ELF string tables).
fn defines(code: &[u8], name: &str) -> bool {
    [format!("\0{name}\0"), format!("\0{name}.kd\0")]
        .iter()
        .any(|pat| code.windows(pat.len()).any(|w| w == pat.as_bytes()))
}

#[test]
fn the_catalog_compiles_with_hiprtc_for_gfx90a_and_defines_every_entry_point() {
    let tu = kernels_translation_unit().unwrap();
    let images = kernel_images("gfx90a", &tu, None).unwrap();
    assert_eq!(images.len(), 1);
    assert_eq!(images[0].name, MODULE_NAME);
    assert_eq!(images[0].kind, ImageKind::Source);

    let rtc = Hiprtc::load().unwrap();
    let arch = "gfx90a:sramecc+:xnack-";
    let options = compile_options(arch);
    let dir = tempfile::tempdir().unwrap();
    let cache = CodeCache::new(dir.path());
    let key = cache_key(&images[0].code, &options, arch, rtc.identity());
    let compile = || rtc.compile(&tu, "kiln_kernels.hip", &options);

    let (code, outcome) = cache.load_or_compile(&key, compile).unwrap();
    assert!(matches!(outcome, CacheOutcome::Compiled(_)), "{outcome:?}");
    assert!(is_code_object(&code), "{} bytes", code.len());
    let missing: Vec<String> = all_entry_points()
        .into_iter()
        .filter(|(_, e)| !defines(&code, e))
        .map(|(m, e)| format!("{m}::{e}"))
        .collect();
    assert!(
        missing.is_empty(),
        "entry points missing from the code object: {missing:?}"
    );
    // A name the catalog does not have is not found (the check can fail).
    assert!(!defines(&code, "rms_norm_f64"));

    // The second load is served from the cache, byte for byte.
    let (again, outcome) = cache
        .load_or_compile(&key, || -> Result<Vec<u8>, String> {
            panic!("must not recompile")
        })
        .unwrap();
    assert!(matches!(outcome, CacheOutcome::Hit(_)), "{outcome:?}");
    assert_eq!(again, code);
}
