//! `kiln import` as a user runs it: the binary converts a GGUF, reports what
//! it wrote, and refuses to overwrite without `--force`.

use kiln_compiler::gguf::fixture::TinyLlama;

#[test]
fn kiln_import_command_line_converts_and_reports_errors() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    TinyLlama::default()
        .build()
        .unwrap()
        .writer
        .write(&gguf)
        .unwrap();
    let out = dir.path().join("models").join("tiny");
    let run = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .arg("import")
            .arg(&gguf)
            .arg("-o")
            .arg(&out)
            .args(extra)
            .output()
            .unwrap()
    };
    let ok = run(&[]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(
        stdout.contains("14 Q4_1") && stdout.contains("1 Q8_0"),
        "{stdout}"
    );
    let again = run(&[]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    assert!(run(&["--force"]).status.success());
}

/// `kiln import` under `sh` with a file size limit: `ulimit -f` makes the
/// kernel stop the process with SIGXFSZ at its first write past the limit
/// (a real kill mid-import), and with SIGXFSZ ignored the write fails with
/// EFBIG instead (a disk error mid-import).
#[cfg(unix)]
fn import_with_size_limit(
    gguf: &std::path::Path,
    out: &std::path::Path,
    ignore_signal: bool,
) -> std::process::Output {
    let script = if ignore_signal {
        "trap '' XFSZ; ulimit -f 8; exec \"$0\" \"$@\""
    } else {
        "ulimit -f 8; exec \"$0\" \"$@\""
    };
    std::process::Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg(env!("CARGO_BIN_EXE_kiln"))
        .arg("import")
        .arg(gguf)
        .arg("-o")
        .arg(out)
        .output()
        .unwrap()
}

#[cfg(unix)]
fn staging_entries(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".kiln-import-"))
        .collect()
}

#[cfg(unix)]
#[test]
fn an_import_killed_mid_write_is_cleaned_up_by_the_next_import() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    TinyLlama::default()
        .build()
        .unwrap()
        .writer
        .write(&gguf)
        .unwrap();
    let before = std::fs::read(&gguf).unwrap();
    let out = dir.path().join("models").join("tiny");
    let killed = import_with_size_limit(&gguf, &out, false);
    assert_eq!(
        killed.status.signal(),
        Some(25), // SIGXFSZ on Linux
        "expected the import to be killed by SIGXFSZ: {:?} {}",
        killed.status,
        String::from_utf8_lossy(&killed.stderr)
    );
    assert!(!out.exists());
    let left = staging_entries(out.parent().unwrap());
    assert!(
        left.iter().any(|n| n.ends_with(".lock")),
        "a killed import leaves its lock file: {left:?}"
    );
    let next = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("import")
        .arg(&gguf)
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&next.stderr);
    assert!(next.status.success(), "{stderr}");
    assert!(stderr.contains("left by a killed import"), "{stderr}");
    assert!(staging_entries(out.parent().unwrap()).is_empty());
    assert!(out.join("model.safetensors").exists());
    assert_eq!(std::fs::read(&gguf).unwrap(), before, "the input changed");
}

#[cfg(unix)]
#[test]
fn an_import_whose_write_fails_mid_way_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    TinyLlama::default()
        .build()
        .unwrap()
        .writer
        .write(&gguf)
        .unwrap();
    let out = dir.path().join("models").join("tiny");
    let failed = import_with_size_limit(&gguf, &out, true);
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert_eq!(failed.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cannot write"), "{stderr}");
    assert!(!out.exists());
    assert!(staging_entries(out.parent().unwrap()).is_empty());
}
