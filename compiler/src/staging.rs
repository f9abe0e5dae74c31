//! Staging directories for `kiln import`: the output is assembled beside its
//! destination and renamed into place, and what a killed import left behind
//! is found and cleaned by the next import into the same parent directory.
//!
//! Why a lock file: a temporary directory alone cannot say whether the import
//! writing it is still running or was killed. Each staging therefore holds
//! an exclusive OS lock ([`std::fs::File::try_lock`]) on
//! `.kiln-import-XXXX.lock` for its whole life; the kernel drops the lock
//! when the process dies, however it dies. The next import in that parent
//! tries each lock: one it can take belongs to a dead import, whose
//! `.kiln-import-XXXX/` (a half-written model) is removed. If the dead import
//! was killed while replacing an existing output, the previous model sits in
//! `.kiln-import-XXXX.old/`: it is moved back when the destination the lock
//! file names is missing, and removed when the new model is already in
//! place. A lock held by a live import is left alone.
//!
//! `.kiln-import-*` entries without a lock file (made by an older kiln, or by
//! hand) are never deleted, since nothing says whose they are: they are
//! reported so the user can remove them.
//!
//! Not here: checking that the output is not an input (`crate::outpath`),
//! writing the model (`crate::import`).

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

/// Every staging entry's name starts with this.
pub const STAGING_PREFIX: &str = ".kiln-import-";
/// The lock file of a staging: `<prefix>XXXX<LOCK_SUFFIX>`.
pub const LOCK_SUFFIX: &str = ".lock";
/// Where a replaced output waits until the new one is in place.
pub const OLD_SUFFIX: &str = ".old";

/// What the sweep of a parent directory found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sweep {
    /// Left by a killed import and removed (or, for a replaced model,
    /// moved back to its destination).
    pub cleaned: Vec<PathBuf>,
    /// Not removed, with why: entries without a lock file, or that could
    /// not be removed.
    pub left: Vec<(PathBuf, String)>,
}

/// A failed file system step: what was being done, to which path.
#[derive(Debug)]
pub struct StagingError {
    pub action: &'static str,
    pub path: PathBuf,
    pub source: io::Error,
}

fn step(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> StagingError {
    let path = path.to_path_buf();
    move |source| StagingError {
        action,
        path,
        source,
    }
}

fn remove_any(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn exists(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

/// Finds what killed imports left in `parent` and cleans it (see the module
/// docs). Never fails: what cannot be cleaned is reported in
/// [`Sweep::left`].
pub fn sweep(parent: &Path) -> Sweep {
    let mut out = Sweep::default();
    let Ok(entries) = std::fs::read_dir(parent) else {
        return out;
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(STAGING_PREFIX))
        .collect();
    names.sort();
    // Bases with a lock file, live or stale: their dirs are accounted for.
    let mut locked = Vec::new();
    for name in &names {
        let Some(base) = name.strip_suffix(LOCK_SUFFIX) else {
            continue;
        };
        locked.push(base.to_string());
        let lock_path = parent.join(name);
        let Ok(mut file) = OpenOptions::new().read(true).write(true).open(&lock_path) else {
            continue;
        };
        if file.try_lock().is_err() {
            continue; // a live import holds it
        }
        let mut text = String::new();
        let _ = file.read_to_string(&mut text);
        let target = text
            .lines()
            .find_map(|l| l.strip_prefix("target="))
            .map(|t| parent.join(t));
        let mut ok = true;
        let dir = parent.join(base);
        if exists(&dir) {
            match remove_any(&dir) {
                Ok(()) => out.cleaned.push(dir),
                Err(e) => {
                    ok = false;
                    out.left.push((dir, format!("cannot remove it: {e}")));
                }
            }
        }
        let old = parent.join(format!("{base}{OLD_SUFFIX}"));
        if exists(&old) {
            match &target {
                Some(t) if !exists(t) => match std::fs::rename(&old, t) {
                    Ok(()) => out.cleaned.push(old),
                    Err(e) => {
                        ok = false;
                        out.left.push((
                            old,
                            format!(
                                "holds the model an import killed while replacing {} had moved \
                                 aside, and moving it back failed: {e}; move it back by hand",
                                t.display()
                            ),
                        ));
                    }
                },
                Some(_) => match remove_any(&old) {
                    Ok(()) => out.cleaned.push(old),
                    Err(e) => {
                        ok = false;
                        out.left.push((old, format!("cannot remove it: {e}")));
                    }
                },
                None => {
                    ok = false;
                    out.left.push((
                        old,
                        "a replaced model whose destination the lock file does not name; \
                         move it back or remove it by hand"
                            .into(),
                    ));
                }
            }
        }
        if ok {
            let _ = std::fs::remove_file(&lock_path);
        }
        drop(file);
    }
    for name in &names {
        if name.ends_with(LOCK_SUFFIX) {
            continue;
        }
        let base = name.strip_suffix(OLD_SUFFIX).unwrap_or(name);
        if locked.iter().any(|b| b == base) {
            continue;
        }
        let path = parent.join(name);
        if exists(&path) {
            out.left.push((
                path,
                "has no lock file, so kiln cannot tell whether an import is still writing it \
                 (an older kiln leaves these); remove it by hand if no import is running"
                    .into(),
            ));
        }
    }
    out
}

/// A staging directory for one import into `parent/<target>`; removed (with
/// its lock file) when dropped unless installed.
pub struct Staging {
    lock: Option<File>,
    lock_path: PathBuf,
    dir: PathBuf,
    old: PathBuf,
    installed: bool,
}

impl Staging {
    /// Creates and locks `parent/.kiln-import-XXXX.lock`, then the directory
    /// `parent/.kiln-import-XXXX/`.
    pub fn create(parent: &Path, target: &str) -> Result<Staging, StagingError> {
        let tmp = tempfile::Builder::new()
            .prefix(STAGING_PREFIX)
            .suffix(LOCK_SUFFIX)
            .tempfile_in(parent)
            .map_err(step("cannot create a lock file in", parent))?;
        let (mut file, lock_path) = tmp
            .keep()
            .map_err(|e| step("cannot keep the lock file in", parent)(e.error))?;
        let name = lock_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let base = name.strip_suffix(LOCK_SUFFIX).unwrap_or(&name).to_string();
        let mut s = Staging {
            lock: None,
            dir: parent.join(&base),
            old: parent.join(format!("{base}{OLD_SUFFIX}")),
            lock_path,
            installed: false,
        };
        file.try_lock()
            .map_err(|e| step("cannot lock", &s.lock_path)(io::Error::other(e.to_string())))?;
        writeln!(file, "target={target}\npid={}", std::process::id())
            .and_then(|_| file.sync_all())
            .map_err(step("cannot write", &s.lock_path))?;
        s.lock = Some(file);
        std::fs::create_dir(&s.dir).map_err(step("cannot create", &s.dir))?;
        Ok(s)
    }

    /// The directory to write the new model into.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Renames the staged directory to `out_dir`. An existing `out_dir` is
    /// moved aside first and removed only once the new one is in place; on a
    /// failed rename it is moved back.
    pub fn install(mut self, out_dir: &Path) -> Result<(), StagingError> {
        let replacing = exists(out_dir);
        if replacing {
            std::fs::rename(out_dir, &self.old).map_err(step("cannot move aside", out_dir))?;
        }
        if let Err(e) = std::fs::rename(&self.dir, out_dir) {
            if replacing {
                let _ = std::fs::rename(&self.old, out_dir);
            }
            return Err(step("cannot rename the imported model to", out_dir)(e));
        }
        self.installed = true;
        if replacing {
            remove_any(&self.old).map_err(step(
                "the new model is in place, but cannot remove the replaced one at",
                &self.old,
            ))?;
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.installed {
            let _ = remove_any(&self.dir);
        }
        // `old` survives only when removing it after the install failed
        // (reported): the lock file stays, so the next sweep removes it.
        if !exists(&self.old) {
            let _ = std::fs::remove_file(&self.lock_path);
        }
        drop(self.lock.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn staging_entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(STAGING_PREFIX))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_failed_rename_removes_the_staged_directory_and_its_lock() {
        let d = tempfile::tempdir().unwrap();
        let s = Staging::create(d.path(), "m").unwrap();
        std::fs::write(s.dir().join("config.json"), "{}").unwrap();
        assert_eq!(staging_entries(d.path()).len(), 2);
        // The destination's parent does not exist: the rename fails.
        let err = s.install(&d.path().join("missing").join("m")).unwrap_err();
        assert!(err.action.contains("rename"), "{}", err.action);
        assert_eq!(staging_entries(d.path()), Vec::<String>::new());
    }

    #[test]
    fn a_replaced_output_is_moved_back_when_the_rename_fails() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("m");
        std::fs::create_dir(&out).unwrap();
        std::fs::write(out.join("weights"), b"old bytes").unwrap();
        let s = Staging::create(d.path(), "m").unwrap();
        // The staged directory vanished: moving the output aside works,
        // the second rename fails, and the output must be moved back.
        std::fs::remove_dir(s.dir()).unwrap();
        let err = s.install(&out).unwrap_err();
        assert!(err.action.contains("rename"), "{}", err.action);
        assert_eq!(std::fs::read(out.join("weights")).unwrap(), b"old bytes");
        assert!(staging_entries(d.path()).is_empty());
    }

    #[test]
    fn a_lock_held_by_someone_else_keeps_its_staging() {
        let d = tempfile::tempdir().unwrap();
        let s = Staging::create(d.path(), "m").unwrap();
        let before = staging_entries(d.path());
        let sw = sweep(d.path());
        assert_eq!(sw, Sweep::default());
        assert_eq!(staging_entries(d.path()), before);
        drop(s);
        assert!(staging_entries(d.path()).is_empty());
    }
}
