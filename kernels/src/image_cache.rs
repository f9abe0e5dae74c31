//! An on-disk cache of compiled kernel images, so compiling a second model
//! (or the same one again) for a GPU target does not re-run the kernel
//! compiler.
//!
//! An entry is keyed by a SHA-256 over everything that decides the image:
//! the exact module source, the compile options, the compiler's version and
//! the target architecture, each length-prefixed so no two inputs share a key
//! by concatenation. An entry for other source therefore has another name and
//! is never used. Each entry file stores its key and a SHA-256 of its image
//! after a magic line; an entry that is truncated, corrupted or names another
//! key is reported as [`Lookup::Corrupt`] and the caller recompiles and
//! overwrites it. Entries are written to a temporary file in the cache
//! directory and renamed into place, so concurrent compiles never see half an
//! entry.
//!
//! The directory is `$KILN_CACHE/kernels`, else `~/.cache/kiln/kernels`
//! ([`default_dir`]).
//!
//! Not here: running a compiler (the caller passes the compile as a closure,
//! see `nvrtc::compile_modules`), eviction (entries are small; delete the
//! directory to reclaim the space), and HIP code objects (the runtime's HIP
//! code-object cache).

use sha2::{Digest, Sha256};
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 16] = b"kiln-kernel-img1";
const HEADER: usize = MAGIC.len() + 32 + 32;

/// What decides a compiled image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageKey<'a> {
    /// The exact source text handed to the compiler.
    pub source: &'a str,
    pub options: &'a [String],
    /// The compiler and its version, e.g. `nvrtc 13.0`.
    pub compiler: &'a str,
    /// The target architecture, e.g. `sm_90`.
    pub arch: &'a str,
}

impl ImageKey<'_> {
    /// The raw SHA-256 of the key's fields.
    pub fn digest(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        let mut field = |tag: &[u8], bytes: &[u8]| {
            h.update((tag.len() as u64).to_le_bytes());
            h.update(tag);
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        field(b"kiln-kernel-image-v1", b"");
        field(b"compiler", self.compiler.as_bytes());
        field(b"arch", self.arch.as_bytes());
        field(b"options", &(self.options.len() as u64).to_le_bytes());
        for o in self.options {
            field(b"option", o.as_bytes());
        }
        field(b"source", self.source.as_bytes());
        h.finalize().into()
    }

    /// The key as hex, the entry's file name.
    pub fn hex(&self) -> String {
        hex(&self.digest())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A failure of the cache directory itself (a bad entry is not one: it is a
/// [`Lookup::Corrupt`]).
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("no kernel cache directory: set KILN_CACHE (or HOME)")]
    NoDirectory,
    #[error("kernel cache {path}: {source}; fix its permissions, or set KILN_CACHE to a writable directory")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What a lookup found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    Hit(Vec<u8>),
    Miss,
    /// An entry exists but fails its checks (why); recompile and store.
    Corrupt(String),
}

/// `$KILN_CACHE/kernels`, else `$HOME/.cache/kiln/kernels`, from the values
/// passed in (tests never set process variables). Empty values count as unset.
pub fn dir_from(kiln_cache: Option<OsString>, home: Option<OsString>) -> Option<PathBuf> {
    let set = |v: Option<OsString>| v.filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = set(kiln_cache) {
        return Some(d.join("kernels"));
    }
    set(home).map(|h| h.join(".cache").join("kiln").join("kernels"))
}

/// [`dir_from`] with the process environment.
pub fn default_dir() -> Result<PathBuf, CacheError> {
    dir_from(std::env::var_os("KILN_CACHE"), std::env::var_os("HOME"))
        .ok_or(CacheError::NoDirectory)
}

/// A directory of compiled kernel images.
#[derive(Clone, Debug)]
pub struct ImageCache {
    dir: PathBuf,
}

impl ImageCache {
    /// A cache in `dir` (created on the first store).
    pub fn new(dir: impl Into<PathBuf>) -> ImageCache {
        ImageCache { dir: dir.into() }
    }

    /// The cache in [`default_dir`].
    pub fn open_default() -> Result<ImageCache, CacheError> {
        Ok(ImageCache::new(default_dir()?))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The entry file of `key`.
    pub fn path(&self, key: &ImageKey<'_>) -> PathBuf {
        self.dir.join(format!("{}.img", key.hex()))
    }

    /// Reads and checks the entry of `key`.
    pub fn lookup(&self, key: &ImageKey<'_>) -> Result<Lookup, CacheError> {
        let path = self.path(key);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Lookup::Miss),
            Err(source) => return Err(CacheError::Io { path, source }),
        };
        if bytes.len() < HEADER || &bytes[..MAGIC.len()] != MAGIC {
            return Ok(Lookup::Corrupt(format!(
                "{} is not a kernel cache entry ({} bytes)",
                path.display(),
                bytes.len()
            )));
        }
        let (stored_key, rest) = bytes[MAGIC.len()..].split_at(32);
        let (checksum, image) = rest.split_at(32);
        if stored_key != key.digest() {
            return Ok(Lookup::Corrupt(format!(
                "{} holds the image of another key",
                path.display()
            )));
        }
        let actual: [u8; 32] = Sha256::digest(image).into();
        if checksum != actual {
            return Ok(Lookup::Corrupt(format!(
                "{}: the image's checksum does not match (stored {}, actual {})",
                path.display(),
                hex(checksum),
                hex(&actual)
            )));
        }
        Ok(Lookup::Hit(image.to_vec()))
    }

    /// Stores `image` as the entry of `key` (temporary file, then rename).
    pub fn store(&self, key: &ImageKey<'_>, image: &[u8]) -> Result<(), CacheError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| CacheError::Io { path, source }
        };
        std::fs::create_dir_all(&self.dir).map_err(io(&self.dir))?;
        let mut tmp = tempfile::NamedTempFile::new_in(&self.dir).map_err(io(&self.dir))?;
        let checksum: [u8; 32] = Sha256::digest(image).into();
        let mut data = Vec::with_capacity(HEADER + image.len());
        data.extend_from_slice(MAGIC);
        data.extend_from_slice(&key.digest());
        data.extend_from_slice(&checksum);
        data.extend_from_slice(image);
        tmp.write_all(&data).map_err(io(tmp.path()))?;
        let path = self.path(key);
        tmp.persist(&path).map_err(|e| CacheError::Io {
            path: path.clone(),
            source: e.error,
        })?;
        Ok(())
    }

    /// The cached image of `key`, or `compile()`'s, stored for next time.
    /// Returns the image and whether it came from the cache. A corrupt entry
    /// is recompiled and replaced.
    pub fn get_or_compile<E: From<CacheError>>(
        &self,
        key: &ImageKey<'_>,
        compile: impl FnOnce() -> Result<Vec<u8>, E>,
    ) -> Result<(Vec<u8>, bool), E> {
        if let Lookup::Hit(image) = self.lookup(key)? {
            return Ok((image, true));
        }
        let image = compile()?;
        self.store(key, &image)?;
        Ok((image, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn key<'a>(source: &'a str, options: &'a [String]) -> ImageKey<'a> {
        ImageKey {
            source,
            options,
            compiler: "test 1.0",
            arch: "sm_90",
        }
    }

    fn compile_counting<'a>(
        calls: &'a Cell<u32>,
        image: &'a [u8],
    ) -> impl FnOnce() -> Result<Vec<u8>, CacheError> + 'a {
        move || {
            calls.set(calls.get() + 1);
            Ok(image.to_vec())
        }
    }

    #[test]
    fn a_second_compile_of_the_same_source_is_a_cache_hit() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(dir.path().join("kernels"));
        let opts = vec!["-O3".to_string()];
        let calls = Cell::new(0);
        let (a, hit) = cache
            .get_or_compile(&key("src", &opts), compile_counting(&calls, b"image"))
            .unwrap();
        assert_eq!((a.as_slice(), hit, calls.get()), (&b"image"[..], false, 1));
        let (b, hit) = cache
            .get_or_compile(&key("src", &opts), compile_counting(&calls, b"other"))
            .unwrap();
        assert_eq!((b.as_slice(), hit, calls.get()), (&b"image"[..], true, 1));
    }

    #[test]
    fn changed_source_options_compiler_or_arch_miss_the_cache() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(dir.path());
        let opts = vec!["-O3".to_string()];
        let base = key("src", &opts);
        cache.store(&base, b"image").unwrap();
        assert_eq!(cache.lookup(&base).unwrap(), Lookup::Hit(b"image".to_vec()));
        let other_opts = vec!["-O2".to_string()];
        let split = vec!["-O".to_string(), "3".to_string()];
        for k in [
            key("src ", &opts),
            key("src", &other_opts),
            key("src", &split),
            ImageKey {
                compiler: "test 1.1",
                ..base.clone()
            },
            ImageKey {
                arch: "sm_80",
                ..base.clone()
            },
        ] {
            assert_eq!(cache.lookup(&k).unwrap(), Lookup::Miss, "{k:?}");
        }
    }

    #[test]
    fn a_corrupted_entry_is_detected_and_recompiled() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ImageCache::new(dir.path());
        let opts = vec![];
        let k = key("src", &opts);
        cache.store(&k, b"the image bytes").unwrap();
        let path = cache.path(&k);
        let mut bytes = std::fs::read(&path).unwrap();
        *bytes.last_mut().unwrap() ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        match cache.lookup(&k).unwrap() {
            Lookup::Corrupt(why) => assert!(why.contains("checksum"), "{why}"),
            other => panic!("{other:?}"),
        }
        let calls = Cell::new(0);
        let (img, hit) = cache
            .get_or_compile(&k, compile_counting(&calls, b"the image bytes"))
            .unwrap();
        assert_eq!(
            (img.as_slice(), hit, calls.get()),
            (&b"the image bytes"[..], false, 1)
        );
        assert_eq!(
            cache.lookup(&k).unwrap(),
            Lookup::Hit(b"the image bytes".to_vec())
        );
        // A truncated entry, and one renamed onto another key's file, too.
        std::fs::write(&path, &bytes[..10]).unwrap();
        assert!(matches!(cache.lookup(&k).unwrap(), Lookup::Corrupt(_)));
        let other = key("other source", &opts);
        cache.store(&other, b"x").unwrap();
        std::fs::rename(cache.path(&other), &path).unwrap();
        match cache.lookup(&k).unwrap() {
            Lookup::Corrupt(why) => assert!(why.contains("another key"), "{why}"),
            l => panic!("{l:?}"),
        }
    }

    #[test]
    fn the_directory_follows_kiln_cache_then_home() {
        let d = dir_from(Some("/c".into()), Some("/h".into()));
        assert_eq!(d, Some(PathBuf::from("/c/kernels")));
        let d = dir_from(Some("".into()), Some("/h".into()));
        assert_eq!(d, Some(PathBuf::from("/h/.cache/kiln/kernels")));
        assert_eq!(dir_from(None, None), None);
    }
}
