//! `kiln-serve` end to end with the real SmolLM2-135M-Instruct on the CPU
//! backend, driven by the official `openai` Python client
//! (`openai_client.py` next to this file; its checks are listed there).
//!
//! The test imports the GGUF, compiles a plan with decode keys b1/b2/b4/b8,
//! prefill-chunk keys, in-graph sampling and penalties (`--sampling`, the
//! default penalty slots) and a logits output (for logprobs), starts the
//! binary on 127.0.0.1 with an ephemeral port, runs the client script with a
//! time limit, and stops the server with SIGTERM: it must exit cleanly and
//! never panic. Skips (saying so) without the model or the `openai` package,
//! unless `KILN_REQUIRE_SMOLLM2=1`.

use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::import::{import_gguf, ImportOptions};
use kiln_compiler::testing::smollm2_gguf_for_tests;
use kiln_ir::Key;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn required() -> bool {
    std::env::var("KILN_REQUIRE_SMOLLM2").as_deref() == Ok("1")
}

fn python_has_openai() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            !required(),
            "KILN_REQUIRE_SMOLLM2=1 but python3 cannot import openai; \
             run `python3 -m pip install openai` (.ci/run pins the version)"
        );
        eprintln!("SKIPPED: python3 cannot import openai (pip install openai)");
    }
    ok
}

/// Imports SmolLM2 and compiles a serving plan into `dir`.
fn build_plan(gguf: &Path, dir: &Path) -> (PathBuf, PathBuf) {
    let model = dir.join("model");
    import_gguf(gguf, &model, &ImportOptions::default()).unwrap();
    let keys = ["b1q1s0", "b2q1s0", "b4q1s0", "b8q1s0", "b1q16s0", "b4q16s0"]
        .iter()
        .map(|k| k.parse::<Key>().unwrap())
        .collect();
    let opts = CompileOptions {
        keys,
        logits: true,
        sampling: true,
        kv: KvOptions {
            max_context: Some(256),
            ..KvOptions::default()
        },
        ..CompileOptions::default()
    };
    let plan = compile_dir(&model, &opts, &mut |_, _| {}).unwrap().plan;
    let path = dir.join("serve.kiln");
    kiln_ir::artifact::write_plan_atomic(&path, &plan).unwrap();
    (path, model)
}

/// The server process; killed if the test fails before stopping it.
struct ServerProc {
    child: Option<Child>,
    stderr: mpsc::Receiver<String>,
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn start_server(plan: &Path, model: &Path) -> (ServerProc, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln-serve"))
        .arg(plan)
        .arg("--weights")
        .arg(model)
        .args([
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--model-name",
            "smollm2",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let (err_tx, err_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        let _ = err_tx.send(s);
    });
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(url) = line.strip_prefix("kiln-serve: listening on ") {
                let _ = tx.send(url.to_string());
            }
        }
    });
    let proc = ServerProc {
        child: Some(child),
        stderr: err_rx,
    };
    let url = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("the server did not print its address within 120 s");
    (proc, url)
}

/// Waits for `child` at most `limit`; kills it past that.
fn wait_bounded(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let t = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn the_openai_client_gets_what_the_openai_api_promises_from_smollm2() {
    let Some(gguf) = smollm2_gguf_for_tests() else {
        return;
    };
    if !python_has_openai() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (plan, model) = build_plan(&gguf, dir.path());
    let (mut server, url) = start_server(&plan, &model);
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let mut client = Command::new("python3")
        .arg(&script)
        .arg(&url)
        .spawn()
        .unwrap();
    let status = wait_bounded(&mut client, Duration::from_secs(900));

    // Stop the server the way an operator does and require a clean exit.
    let mut child = server.child.take().unwrap();
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let exit = wait_bounded(&mut child, Duration::from_secs(60));
    let stderr = server
        .stderr
        .recv_timeout(Duration::from_secs(10))
        .unwrap_or_default();
    eprintln!("--- server stderr ---\n{stderr}");
    let status = status.expect("the client script ran past 900 s");
    assert!(status.success(), "the client script failed: {status}");
    assert!(!stderr.contains("panicked"), "the server panicked");
    let exit = exit.expect("the server did not exit within 60 s of SIGTERM");
    assert!(exit.success(), "the server exited with {exit}");
}
