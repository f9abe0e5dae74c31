//! Golden dumps of a small hand-built decode step: its text form, its DOT,
//! and the verifier's inline rendering of a broken copy. A changed output
//! fails; `KILN_BLESS=1 cargo test -p kiln-ir` refreshes the files.

mod common;

use kiln_ir::{check_golden, parse_and_verify, print, to_dot, verify, ValueId};
use std::path::PathBuf;

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("golden")
        .join(name)
}

#[test]
fn decode_step_text_matches_its_golden_and_parses_back() {
    let g = common::decode_step();
    let text = print(&g);
    check_golden(&golden("decode_step.kir"), &text);
    // The golden file is also a parser fixture: it reads back to the graph.
    let stored = std::fs::read_to_string(golden("decode_step.kir")).unwrap();
    let (back, _) = parse_and_verify(&stored, None).unwrap();
    assert_eq!(back, g);
}

#[test]
fn decode_step_dot_matches_its_golden() {
    check_golden(&golden("decode_step.dot"), &to_dot(&common::decode_step()));
}

#[test]
fn verifier_errors_render_inline_as_in_the_golden() {
    let mut g = common::decode_step();
    // A dangling use, a wrong recorded type, a duplicate output.
    g.nodes[5].args[1] = ValueId(77);
    g.values[14].ty = kiln_ir::TensorType::new(kiln_ir::DType::BF16, [2, 16]);
    g.add_output("next_tokens", ValueId(38));
    let errs = verify(&g, None).unwrap_err();
    check_golden(&golden("decode_step.errors.txt"), &errs.render(&g));
}
