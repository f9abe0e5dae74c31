//! Commands never overwrite their own inputs: `kiln compile DIR -o
//! DIR/model.safetensors` and `kiln import X.gguf -o X.gguf --force` are
//! refused before any work, and the input stays intact byte for byte.

use kiln_compiler::gguf::fixture::TinyLlama;
use kiln_compiler::testing::{write_tiny_model, Family, TinySpec};

fn kiln(args: &[&std::ffi::OsStr]) -> (bool, String) {
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn compiling_a_plan_over_the_models_own_files_is_refused_and_they_stay_intact() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    write_tiny_model(&model, Family::Llama, &TinySpec::for_family(Family::Llama)).unwrap();
    for victim in ["model.safetensors", "config.json"] {
        let path = model.join(victim);
        let before = std::fs::read(&path).unwrap();
        let (ok, err) = kiln(&[
            "compile".as_ref(),
            model.as_os_str(),
            "-q".as_ref(),
            "-o".as_ref(),
            path.as_os_str(),
        ]);
        assert!(!ok, "compile -o {victim} succeeded");
        assert!(err.contains("inside the input"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), before, "{victim} changed");
    }
}

#[test]
fn importing_a_gguf_onto_itself_with_force_is_refused_and_it_stays_intact() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    TinyLlama::default()
        .build()
        .unwrap()
        .writer
        .write(&gguf)
        .unwrap();
    let before = std::fs::read(&gguf).unwrap();
    for out in [gguf.clone(), dir.path().to_path_buf()] {
        let (ok, err) = kiln(&[
            "import".as_ref(),
            gguf.as_os_str(),
            "-o".as_ref(),
            out.as_os_str(),
            "--force".as_ref(),
        ]);
        assert!(!ok, "import -o {} --force succeeded", out.display());
        assert!(err.contains("refusing to write"), "{err}");
        assert_eq!(std::fs::read(&gguf).unwrap(), before, "the GGUF changed");
    }
}
