//! The on-disk cache of HIP code objects compiled at load.
//!
//! A plan for a HIP target without an offline compiler carries kernel source
//! ([`kiln_ir::plan::ImageKind::Source`]); the backend compiles it with hiprtc
//! for the executing device's architecture. That takes seconds, so the code
//! object is kept in `<cache dir>/<key>.co`, where the key is a SHA-256 over
//! the source, the compile options, the architecture and the compiler's
//! identity: change any of them and the key changes, so a stale object is never
//! loaded. Entries are written to a temporary file and renamed, so a reader
//! never sees half an object; an entry that is not a code object (truncated,
//! overwritten) is treated as a miss and replaced.
//!
//! Not here: the compiler itself (hiprtc is loaded by the ROCm-only backend),
//! eviction (entries are small; delete the directory to reclaim space).

use sha2::{Digest, Sha256};
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Overrides the cache directory.
pub const ENV_CACHE_DIR: &str = "KILN_CACHE_DIR";

/// Why the cache cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("no cache directory for compiled HIP kernels: set KILN_CACHE_DIR (or XDG_CACHE_HOME or HOME)")]
    NoDirectory,
    #[error("cannot write the HIP kernel cache entry {path}: {source}; set KILN_CACHE_DIR to a writable directory")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What [`CodeCache::load_or_compile`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheOutcome {
    /// A valid entry was on disk; nothing was compiled.
    Hit(PathBuf),
    /// Compiled, and stored at the path.
    Compiled(PathBuf),
    /// Compiled, but not stored (the reason: unwritable directory, or the
    /// compiler's output is not a code object). The code is still returned.
    CompiledNotStored(String),
}

/// The hiprtc options kiln compiles kernel source with, for `target_id` (the
/// device's full `gcnArchName`, so target features such as xnack match).
pub fn hiprtc_options(target_id: &str) -> Vec<String> {
    vec![format!("--offload-arch={target_id}"), "-O3".to_string()]
}

/// The cache key: hex SHA-256 over length-prefixed fields, so no two distinct
/// inputs share a key by concatenation (`"ab" + "c"` is not `"a" + "bc"`).
pub fn cache_key(source: &[u8], options: &[String], arch: &str, compiler: &str) -> String {
    let mut h = Sha256::new();
    let mut field = |tag: &[u8], bytes: &[u8]| {
        h.update(tag);
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field(b"kiln-hip-code-object-v1", b"");
    field(b"arch", arch.as_bytes());
    field(b"compiler", compiler.as_bytes());
    field(b"options", &(options.len() as u64).to_le_bytes());
    for o in options {
        field(b"option", o.as_bytes());
    }
    field(b"source", source);
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The cache directory from the values of `KILN_CACHE_DIR`, `XDG_CACHE_HOME`
/// and `HOME` (passed in, so tests do not touch the environment): the first
/// as is, else `<XDG_CACHE_HOME>/kiln/hip`, else `<HOME>/.cache/kiln/hip`.
/// Empty values count as unset.
pub fn cache_dir_from(
    kiln_cache_dir: Option<OsString>,
    xdg_cache_home: Option<OsString>,
    home: Option<OsString>,
) -> Result<PathBuf, CacheError> {
    let set = |v: Option<OsString>| v.filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = set(kiln_cache_dir) {
        return Ok(dir);
    }
    if let Some(xdg) = set(xdg_cache_home) {
        return Ok(xdg.join("kiln").join("hip"));
    }
    if let Some(home) = set(home) {
        return Ok(home.join(".cache").join("kiln").join("hip"));
    }
    Err(CacheError::NoDirectory)
}

/// [`cache_dir_from`] with the process environment.
pub fn default_cache_dir() -> Result<PathBuf, CacheError> {
    cache_dir_from(
        std::env::var_os(ENV_CACHE_DIR),
        std::env::var_os("XDG_CACHE_HOME"),
        std::env::var_os("HOME"),
    )
}

pub use kiln_kernels::hip::is_code_object;

/// A directory of compiled code objects.
#[derive(Clone, Debug)]
pub struct CodeCache {
    dir: PathBuf,
}

impl CodeCache {
    pub fn new(dir: impl Into<PathBuf>) -> CodeCache {
        CodeCache { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the entry for `key` lives.
    pub fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.co"))
    }

    /// The entry for `key`, if present and a code object.
    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        let bytes = std::fs::read(self.path(key)).ok()?;
        is_code_object(&bytes).then_some(bytes)
    }

    /// Stores `code` under `key` (temporary file, then rename).
    pub fn put(&self, key: &str, code: &[u8]) -> Result<PathBuf, CacheError> {
        let path = self.path(key);
        let write_err = |source| CacheError::Write {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(&self.dir).map_err(write_err)?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let tmp = self
            .dir
            .join(format!(".{key}.co.{}.{nanos}.tmp", std::process::id()));
        let written = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(code)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(write_err(e));
        }
        Ok(path)
    }

    /// The code object for `key`: from disk, or from `compile` (then stored).
    /// A compile error is returned as is; a failure to store is not an error
    /// (the object is still used) but is reported in the outcome.
    pub fn load_or_compile<E>(
        &self,
        key: &str,
        compile: impl FnOnce() -> Result<Vec<u8>, E>,
    ) -> Result<(Vec<u8>, CacheOutcome), E> {
        if let Some(code) = self.get(key) {
            return Ok((code, CacheOutcome::Hit(self.path(key))));
        }
        let code = compile()?;
        if !is_code_object(&code) {
            let why = format!(
                "the compiler returned {} bytes that are not an AMDGPU code object",
                code.len()
            );
            return Ok((code, CacheOutcome::CompiledNotStored(why)));
        }
        let outcome = match self.put(key, &code) {
            Ok(path) => CacheOutcome::Compiled(path),
            Err(e) => CacheOutcome::CompiledNotStored(e.to_string()),
        };
        Ok((code, outcome))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A fake AMDGPU ELF whose body depends on `seed`.
    fn fake_code_object(seed: u64) -> Vec<u8> {
        let mut v = vec![0u8; 96];
        v[..4].copy_from_slice(b"\x7fELF");
        v[18..20].copy_from_slice(&224u16.to_le_bytes());
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for b in &mut v[64..] {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        v
    }

    fn opts(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn hiprtc_options_name_the_full_target_id() {
        assert_eq!(
            hiprtc_options("gfx942:sramecc+:xnack-"),
            ["--offload-arch=gfx942:sramecc+:xnack-", "-O3"]
        );
    }

    #[test]
    fn the_key_changes_with_source_options_arch_and_compiler() {
        let o = opts(&["-O3", "--offload-arch=gfx90a"]);
        let base = cache_key(b"src", &o, "gfx90a", "hiprtc 6.2");
        assert_eq!(base.len(), 64);
        assert!(base.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(base, cache_key(b"src", &o, "gfx90a", "hiprtc 6.2"));
        let variants = [
            cache_key(b"src ", &o, "gfx90a", "hiprtc 6.2"),
            cache_key(
                b"src",
                &opts(&["-O2", "--offload-arch=gfx90a"]),
                "gfx90a",
                "hiprtc 6.2",
            ),
            cache_key(
                b"src",
                &opts(&["--offload-arch=gfx90a", "-O3"]),
                "gfx90a",
                "hiprtc 6.2",
            ),
            cache_key(b"src", &o, "gfx90a:xnack+", "hiprtc 6.2"),
            cache_key(b"src", &o, "gfx90a", "hiprtc 6.3"),
        ];
        for v in &variants {
            assert_ne!(&base, v);
        }
    }

    #[test]
    fn fields_cannot_be_shifted_into_each_other() {
        assert_ne!(
            cache_key(b"x", &opts(&["ab", "c"]), "gfx90a", "c"),
            cache_key(b"x", &opts(&["a", "bc"]), "gfx90a", "c")
        );
        assert_ne!(
            cache_key(b"x", &opts(&[]), "gfx90a", "hiprtc"),
            cache_key(b"x", &opts(&[""]), "gfx90a", "hiprtc")
        );
        assert_ne!(
            cache_key(b"", &[], "gfx90ah", "iprtc"),
            cache_key(b"", &[], "gfx90a", "hiprtc")
        );
    }

    #[test]
    fn the_cache_directory_follows_kiln_cache_dir_then_xdg_then_home() {
        let s = |v: &str| Some(OsString::from(v));
        assert_eq!(
            cache_dir_from(s("/k"), s("/x"), s("/h")).unwrap(),
            PathBuf::from("/k")
        );
        assert_eq!(
            cache_dir_from(None, s("/x"), s("/h")).unwrap(),
            PathBuf::from("/x/kiln/hip")
        );
        assert_eq!(
            cache_dir_from(s(""), s(""), s("/h")).unwrap(),
            PathBuf::from("/h/.cache/kiln/hip")
        );
        let e = cache_dir_from(None, None, s("")).unwrap_err();
        assert!(e.to_string().contains("KILN_CACHE_DIR"), "{e}");
    }

    #[test]
    fn code_objects_are_recognised_and_other_bytes_are_not() {
        assert!(is_code_object(&fake_code_object(1)));
        let mut x86 = fake_code_object(1);
        x86[18..20].copy_from_slice(&62u16.to_le_bytes());
        assert!(!is_code_object(&x86));
        assert!(!is_code_object(&fake_code_object(1)[..40]));
        assert!(is_code_object(b"__CLANG_OFFLOAD_BUNDLE__\x02\x00"));
        assert!(!is_code_object(b"__CLANG_OFFLOAD_BUNDLE__"));
        assert!(!is_code_object(b"extern \"C\" __global__ void k() {}"));
    }

    #[test]
    fn the_first_load_compiles_and_stores_and_the_second_is_a_hit() {
        let dir = tempfile::tempdir().unwrap();
        let cache = CodeCache::new(dir.path().join("nested").join("hip"));
        let calls = Cell::new(0);
        let compile = || {
            calls.set(calls.get() + 1);
            Ok::<_, String>(fake_code_object(7))
        };
        let key = cache_key(b"tu", &[], "gfx942", "hiprtc 6.2");
        let (code, outcome) = cache.load_or_compile(&key, compile).unwrap();
        assert_eq!(code, fake_code_object(7));
        assert_eq!(outcome, CacheOutcome::Compiled(cache.path(&key)));
        let (again, outcome) = cache.load_or_compile(&key, compile).unwrap();
        assert_eq!(again, code);
        assert_eq!(outcome, CacheOutcome::Hit(cache.path(&key)));
        assert_eq!(calls.get(), 1);
        // Another architecture is another key: compiled again.
        let other = cache_key(b"tu", &[], "gfx1100", "hiprtc 6.2");
        let (_, outcome) = cache.load_or_compile(&other, compile).unwrap();
        assert!(matches!(outcome, CacheOutcome::Compiled(_)));
        assert_eq!(calls.get(), 2);
        // No temporary files are left behind.
        let names: Vec<_> = std::fs::read_dir(cache.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names
            .iter()
            .all(|n| n.ends_with(".co") && !n.starts_with('.')));
    }

    #[test]
    fn a_corrupt_entry_is_a_miss_and_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let cache = CodeCache::new(dir.path());
        let key = cache_key(b"tu", &[], "gfx90a", "hiprtc 5.2");
        std::fs::write(cache.path(&key), &fake_code_object(3)[..30]).unwrap();
        assert_eq!(cache.get(&key), None);
        let (code, outcome) = cache
            .load_or_compile(&key, || Ok::<_, String>(fake_code_object(3)))
            .unwrap();
        assert_eq!(outcome, CacheOutcome::Compiled(cache.path(&key)));
        assert_eq!(std::fs::read(cache.path(&key)).unwrap(), code);
    }

    #[test]
    fn compile_errors_pass_through_and_nothing_is_stored() {
        let dir = tempfile::tempdir().unwrap();
        let cache = CodeCache::new(dir.path());
        let e = cache
            .load_or_compile("k", || {
                Err::<Vec<u8>, _>("error: unknown type `bf16x2`".to_string())
            })
            .unwrap_err();
        assert!(e.contains("bf16x2"));
        assert!(cache.get("k").is_none());
    }

    #[test]
    fn output_that_is_not_a_code_object_is_returned_but_not_stored() {
        let dir = tempfile::tempdir().unwrap();
        let cache = CodeCache::new(dir.path());
        let (code, outcome) = cache
            .load_or_compile("k", || Ok::<_, String>(b"not an object".to_vec()))
            .unwrap();
        assert_eq!(code, b"not an object");
        assert!(
            matches!(outcome, CacheOutcome::CompiledNotStored(ref why) if why.contains("not an AMDGPU code object"))
        );
        assert!(!cache.path("k").exists());
    }

    #[test]
    fn an_unwritable_cache_still_returns_the_compiled_object() {
        let dir = tempfile::tempdir().unwrap();
        // A file where the directory should be: create_dir_all fails.
        let blocker = dir.path().join("blocker");
        std::fs::write(&blocker, b"x").unwrap();
        let cache = CodeCache::new(blocker.join("hip"));
        let (code, outcome) = cache
            .load_or_compile("k", || Ok::<_, String>(fake_code_object(9)))
            .unwrap();
        assert_eq!(code, fake_code_object(9));
        assert!(
            matches!(outcome, CacheOutcome::CompiledNotStored(ref why) if why.contains("KILN_CACHE_DIR")),
            "{outcome:?}"
        );
    }
}
