//! Instruction-set dispatch for the hot loops (matmul, attention).
//!
//! The hot kernels are written once, in plain Rust with fixed-width lane
//! accumulators the compiler vectorizes, and compiled several times: for the
//! baseline target and, on x86_64, with AVX2 and AVX-512 enabled. The level
//! is detected once per process. Every variant performs the same f32
//! operations in the same order (lanes are independent accumulators, no FMA
//! contraction), so results are bit-identical whatever the level; the matmul
//! unit tests check it.
//!
//! `KILN_CPU_SIMD=generic|avx2|avx512` lowers the level (never above what the
//! CPU supports), for measurements and for reproducing a baseline host.

use std::sync::OnceLock;

/// A compiled variant of the hot loops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    Generic,
    Avx2,
    Avx512,
}

/// The level this process uses.
pub(crate) fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let best = detected();
        match std::env::var("KILN_CPU_SIMD").as_deref() {
            Ok("generic") => Level::Generic,
            Ok("avx2") => best.min(Level::Avx2),
            _ => best,
        }
    })
}

/// The best level the CPU supports.
pub(crate) fn detected() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            return Level::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Level::Avx2;
        }
    }
    Level::Generic
}

/// Every level this CPU can run, lowest first (for tests).
#[cfg(test)]
pub(crate) fn available() -> Vec<Level> {
    [Level::Generic, Level::Avx2, Level::Avx512]
        .into_iter()
        .filter(|&l| l <= detected())
        .collect()
}

/// Defines `unsafe fn $name(level: Level, args...)` that runs
/// `$imp::<K>(args...)` with the [`crate::cpu::dot::Kernel`] of `level`,
/// compiled with that level's target features. `$imp` must be
/// `#[inline(always)]` (and so must the plain-Rust helpers of its hot loop)
/// so the features reach it. The caller guarantees `level <= detected()`.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis unsafe fn $name:ident($($a:ident : $t:ty),* $(,)?) => $imp:ident) => {
        $(#[$m])*
        $vis unsafe fn $name(level: $crate::cpu::simd::Level, $($a: $t),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($a: $t),*) {
                    $imp::<$crate::cpu::dot::x86::Avx2>($($a),*)
                }
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
                unsafe fn avx512($($a: $t),*) {
                    $imp::<$crate::cpu::dot::x86::Avx512>($($a),*)
                }
                match level {
                    $crate::cpu::simd::Level::Avx512 => return avx512($($a),*),
                    $crate::cpu::simd::Level::Avx2 => return avx2($($a),*),
                    $crate::cpu::simd::Level::Generic => {}
                }
            }
            let _ = level;
            $imp::<$crate::cpu::dot::Portable>($($a),*)
        }
    };
}
pub(crate) use multiversion;
