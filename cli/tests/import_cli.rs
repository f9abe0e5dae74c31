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
