//! Golden text dumps of traced graphs: a 2-layer tiny Llama and a 2-layer
//! tiny Qwen3 at a decode key and a speculative-verification key. A change
//! to the frontend's output is a visible diff here; refresh with
//! `KILN_BLESS=1 cargo test -p kiln-compiler --test frontend_golden`.

mod frontend_common;

use frontend_common::tiny;
use kiln_compiler::frontend::{open, TraceOptions};
use kiln_compiler::testing::{Family, TinySpec};
use kiln_ir::Key;
use std::path::Path;

fn check(name: &str, family: Family) {
    let dir = tiny(family, &TinySpec::for_family(family));
    let m = open(dir.path()).unwrap();
    let kv = m.kv_layout(16, 9);
    for ks in ["b2q1s0", "b1q3s2"] {
        let key: Key = ks.parse().unwrap();
        let g = m.trace(key, &kv, &TraceOptions::default()).unwrap();
        kiln_ir::verify(&g, Some(m.manifest())).unwrap_or_else(|e| panic!("{}", e.render(&g)));
        let text = kiln_ir::print(&g);
        // The text is the whole graph: it parses back to the same graph.
        let (back, _) = kiln_ir::parse_and_verify(&text, Some(m.manifest()))
            .unwrap_or_else(|e| panic!("{name} {ks}: {e}"));
        assert_eq!(back, g, "{name} {ks}");
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/golden")
            .join(format!("{name}_{ks}.txt"));
        kiln_ir::check_golden(&path, &text);
    }
}

#[test]
fn tiny_llama_traces_match_their_golden_text() {
    check("llama", Family::Llama);
}

#[test]
fn tiny_qwen3_traces_match_their_golden_text() {
    check("qwen3", Family::Qwen3);
}
