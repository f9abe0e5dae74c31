//! Progress bars for the CLI's long compile steps.
//!
//! The slowest step of a first `kiln compile --target cuda:*` (and of
//! `kiln demo --device cuda`) is NVRTC compiling the kernel modules; it used
//! to sit silent for a minute. [`warm_kernel_cache`] compiles the modules the
//! kernel cache lacks, with a bar, before the compile proper, which then
//! finds every image in the cache.
//!
//! Not here: the compile itself (`kiln_compiler::compile`, which shows its
//! own bar for tracing and planning) and the cache (`kiln_kernels::image_cache`).

use kiln_ir::plan::Target;
use kiln_kernels::gpu::{GpuModule, MODULES};
use kiln_kernels::image_cache::ImageCache;
use kiln_kernels::nvrtc;

/// For a `cuda:sm_NN` target: compiles every kernel module the kernel cache
/// does not hold for that SM, showing a progress bar unless `quiet`. Returns
/// how many modules were compiled. Other targets, an unusable cache
/// directory or a missing NVRTC do nothing here: the compile proper reports
/// those with its own errors.
pub fn warm_kernel_cache(target: &Target, quiet: bool) -> usize {
    let Target::Cuda { sm } = target else {
        return 0;
    };
    let Ok(cache) = ImageCache::open_default() else {
        return 0;
    };
    let all: Vec<&GpuModule> = MODULES.iter().collect();
    let Ok(missing) = nvrtc::uncached_modules(*sm, &all, &cache) else {
        return 0;
    };
    if missing.is_empty() {
        return 0;
    }
    let bar = if quiet {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(missing.len() as u64)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{bar:30}] {pos}/{len} NVRTC sm_{msg} ({elapsed})",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar.set_message(format!("{sm}"));
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    let result = nvrtc::compile_modules(*sm, &missing, Some(&cache), &|_| bar.inc(1));
    bar.finish_and_clear();
    match result {
        Ok(images) => images.len(),
        // The compile proper recompiles and reports the error in context.
        Err(_) => 0,
    }
}
