//! `kiln-serve` over a tensor-parallel plan: the same tiny SmolLM2-shaped
//! model (9 heads, 3 KV heads) compiled at tp=1 and tp=3 and served on the
//! CPU backend (ranks as threads). Greedy completions, alone and two at
//! once, give the tp=1 server's text.

use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::testing::{write_byte_tokenizer, write_tiny_model, Family, TinySpec};
use kiln_ir::Key;
use kiln_serve::{ServeConfig, Server};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

/// The model directory and a plan for `tp` ranks in it.
fn plan(dir: &Path, tp: u32) -> std::path::PathBuf {
    let opts = CompileOptions {
        keys: vec![Key::new(1, 1, 0), Key::new(2, 1, 0), Key::new(1, 4, 0)],
        kv: KvOptions {
            block_size: 4,
            kv_blocks: Some(64),
            max_context: Some(64),
            ..KvOptions::default()
        },
        tp,
        ..CompileOptions::default()
    };
    let plan = compile_dir(dir, &opts, &mut |_, _| {}).unwrap().plan;
    assert_eq!(plan.tp, tp);
    let path = dir.join(format!("tp{tp}.kiln"));
    kiln_ir::artifact::write_plan_atomic(&path, &plan).unwrap();
    path
}

/// POSTs `body` to `/v1/completions` and returns the first choice's text.
fn complete(addr: SocketAddr, body: &Value) -> String {
    let body = body.to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, rest) = out.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{out}");
    // Non-streamed answers carry a Content-Length body.
    let v: Value = serde_json::from_str(rest).unwrap_or_else(|e| panic!("{e}: {rest:?}"));
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

/// Serves `plan` and returns the texts of `prompts` alone, then of the
/// first two at once.
fn texts(dir: &Path, plan: std::path::PathBuf, prompts: &[&str]) -> (Vec<String>, Vec<String>) {
    let mut cfg = ServeConfig::new(plan, dir.to_path_buf());
    cfg.port = 0;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = rt.block_on(Server::start(cfg)).unwrap();
    let addr = server.local_addr();
    let req = |p: &str| json!({"prompt": p, "max_tokens": 10, "temperature": 0});
    let alone: Vec<String> = prompts.iter().map(|p| complete(addr, &req(p))).collect();
    let together: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = prompts[..2]
            .iter()
            .map(|p| {
                let r = req(p);
                s.spawn(move || complete(addr, &r))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    rt.block_on(server.shutdown()).unwrap();
    (alone, together)
}

#[test]
fn a_tp3_plan_serves_the_tp1_plans_greedy_text_alone_and_batched() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), Family::Llama, &TinySpec::smollm2()).unwrap();
    write_byte_tokenizer(dir.path()).unwrap();
    let prompts = ["kiln", "abc", "a longer prompt"];
    let (one, one_batched) = texts(dir.path(), plan(dir.path(), 1), &prompts);
    let (three, three_batched) = texts(dir.path(), plan(dir.path(), 3), &prompts);
    assert!(one.iter().any(|t| !t.is_empty()), "{one:?}");
    assert_eq!(three, one, "tp=3 alone");
    assert_eq!(three_batched, one_batched, "tp=3 batched");
    assert_eq!(one_batched[..], one[..2], "batched equals alone at tp=1");
}
