//! The server library in-process with the real SmolLM2 on the CPU backend,
//! on a plan with a deliberately small KV cache and no logits output:
//! concurrent requests that together need more KV than exists are preempted
//! and recomputed (never failed) and still produce the text each produces
//! alone; a sampled request on a plan without logits is a 400 naming the
//! fix. Skips (saying so) without the model unless `KILN_REQUIRE_SMOLLM2=1`.

use kiln_compiler::compile::{compile_dir, CompileOptions, KvOptions};
use kiln_compiler::import::{import_gguf, ImportOptions};
use kiln_compiler::testing::smollm2_gguf_for_tests;
use kiln_ir::Key;
use kiln_serve::{ServeConfig, Server};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// One HTTP/1.1 request on a fresh connection: (status, body).
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    (status, body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

fn complete(addr: SocketAddr, prompt: &str, max_tokens: u32) -> (String, String) {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).to_string();
    let (status, text) = http(addr, "POST", "/v1/completions", &body);
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    (
        v["choices"][0]["text"].as_str().unwrap().to_string(),
        v["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
            .to_string(),
    )
}

fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (_, text) = http(addr, "GET", "/metrics", "");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

#[test]
fn requests_beyond_the_kv_cache_are_preempted_and_recomputed_not_failed() {
    let Some(gguf) = smollm2_gguf_for_tests() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    import_gguf(&gguf, &model, &ImportOptions::default()).unwrap();
    // 10 blocks of 16 tokens: four sequences of ~6 + 60 tokens need 20.
    let opts = CompileOptions {
        keys: vec![Key::new(1, 1, 0), Key::new(4, 1, 0)],
        kv: KvOptions {
            kv_blocks: Some(10),
            max_context: Some(128),
            ..KvOptions::default()
        },
        ..CompileOptions::default()
    };
    let plan = compile_dir(&model, &opts, &mut |_, _| {}).unwrap().plan;
    let plan_path = dir.path().join("small-kv.kiln");
    kiln_ir::artifact::write_plan_atomic(&plan_path, &plan).unwrap();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = rt
        .block_on(Server::start(ServeConfig {
            port: 0,
            ..ServeConfig::new(plan_path, model)
        }))
        .unwrap();
    let addr = server.local_addr();
    assert!(!server.model().has_logits);

    // A sampled request on a plan without logits names the fix.
    let body = json!({"prompt": "Hi", "temperature": 0.7}).to_string();
    let (status, text) = http(addr, "POST", "/v1/completions", &body);
    assert_eq!(status, 400, "{text}");
    let err: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(err["error"]["param"], "temperature");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("kiln compile --logits"),
        "{text}"
    );

    let prompts = [
        "The history of Rome began",
        "In the middle of the ocean",
        "My grandmother always told me",
        "The best way to cook rice is",
    ];
    let alone: Vec<(String, String)> = prompts.iter().map(|p| complete(addr, p, 60)).collect();
    assert_eq!(metric(addr, "kiln_preemptions_total"), 0.0);
    let together: Vec<(String, String)> = std::thread::scope(|s| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| s.spawn(move || complete(addr, p, 60)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        metric(addr, "kiln_preemptions_total") > 0.0,
        "four sequences of up to 66 tokens in 10 blocks of 16 must preempt"
    );
    for ((p, a), t) in prompts.iter().zip(&alone).zip(&together) {
        assert_eq!(a, t, "{p:?} alone vs with preemption");
    }
    // A finished sequence's blocks are released by the engine thread after
    // the response went out; give it a moment, then require all of them.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while metric(addr, "kiln_kv_blocks_free") != metric(addr, "kiln_kv_blocks_total")
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(
        metric(addr, "kiln_kv_blocks_free"),
        metric(addr, "kiln_kv_blocks_total")
    );
    rt.block_on(server.shutdown()).unwrap();
}
