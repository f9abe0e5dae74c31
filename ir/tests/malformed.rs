//! Malformed texts: each is rejected with the right line:column and a
//! message naming the problem, by the parser (syntax) or by the verifier
//! through the parse's source map (semantics). None panics.

use kiln_ir::{parse, parse_and_verify, ParseErrorKind, Pos, TextError, VerifyErrorKind};

/// A small valid graph; the tests below break one thing in it.
const BASE: &str = r#"graph "t" {
  %0 = input token_ids : i32[2]
  %1 = input positions : i32[2]

  %2 = weight "emb" : bf16[16,8]
  %3 = weight "norm" : bf16[8]

  %4 = embedding %0, %2 : bf16[2,8]
  %5 = rms_norm {eps = 1e-5, unit_offset = false} %4, %3 : bf16[2,8]
  %6 = rope {heads = 2, head_dim = 4, theta = 1e4, scaling = none} %5, %1 : bf16[2,8]

  output "x" = %6
}
"#;

/// `BASE` with the first occurrence of `from` replaced by `to`.
fn with(from: &str, to: &str) -> String {
    assert!(BASE.contains(from), "`{from}` is not in the base text");
    BASE.replacen(from, to, 1)
}

/// Position of the `nth` (0-based) occurrence of `needle` in `text`.
fn at_nth(text: &str, needle: &str, nth: usize) -> Pos {
    let offset = text
        .match_indices(needle)
        .nth(nth)
        .unwrap_or_else(|| panic!("`{needle}` #{nth} not in\n{text}"))
        .0;
    let before = &text[..offset];
    let line = before.matches('\n').count() as u32 + 1;
    let column = before[before.rfind('\n').map_or(0, |i| i + 1)..]
        .chars()
        .count() as u32
        + 1;
    Pos { line, column }
}

fn at(text: &str, needle: &str) -> Pos {
    at_nth(text, needle, 0)
}

/// Parses `text`, expecting a syntax error at `pos` whose message contains
/// every one of `words`.
fn syntax_error(text: &str, pos: Pos, words: &[&str]) -> ParseErrorKind {
    let e = parse(text).expect_err("the text must not parse");
    let msg = e.to_string();
    assert_eq!(e.pos, pos, "wrong position for `{msg}` in\n{text}");
    assert!(
        msg.starts_with(&format!("{}:{}: ", pos.line, pos.column)),
        "{msg}"
    );
    for w in words {
        assert!(msg.contains(w), "`{msg}` does not mention `{w}`");
    }
    // parse_and_verify reports the same.
    assert_eq!(
        parse_and_verify(text, None).unwrap_err(),
        TextError::Syntax(e.clone())
    );
    e.kind
}

/// Parses and verifies `text`, expecting exactly `count` verifier errors, the
/// first at `pos` with a message containing every one of `words`.
fn semantic_error(text: &str, count: usize, pos: Pos, words: &[&str]) -> VerifyErrorKind {
    parse(text).expect("the text must parse; the error is semantic");
    match parse_and_verify(text, None) {
        Err(TextError::Invalid(errs)) => {
            let all: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
            assert_eq!(errs.len(), count, "errors: {all:#?}");
            let first = &errs[0];
            assert_eq!(
                first.span.start, pos,
                "wrong position for {all:#?} in\n{text}"
            );
            let msg = first.to_string();
            for w in words {
                assert!(msg.contains(w), "`{msg}` does not mention `{w}`");
            }
            first.error.kind.clone()
        }
        other => panic!("expected verifier errors, got {other:?}"),
    }
}

#[test]
fn the_base_text_is_valid() {
    let (g, _) = parse_and_verify(BASE, None).unwrap();
    assert_eq!(kiln_ir::print(&g), BASE);
}

#[test]
fn an_unknown_op_is_named_and_the_valid_mnemonics_are_listed() {
    let t = with("embedding %0", "embed %0");
    let k = syntax_error(
        &t,
        at(&t, "embed"),
        &[
            "unknown op `embed`",
            "embedding",
            "rms_norm",
            "accept_greedy",
        ],
    );
    assert!(matches!(k, ParseErrorKind::UnknownOp { .. }));
}

#[test]
fn a_wrong_argument_count_is_reported_at_the_op() {
    let t = with("embedding %0, %2", "embedding %0");
    let k = semantic_error(
        &t,
        1,
        at(&t, "embedding"),
        &["`embedding` takes 2 argument(s), got 1"],
    );
    assert!(matches!(k, VerifyErrorKind::Arity { got: 1, .. }));
}

#[test]
fn a_shape_mismatch_is_reported_at_the_op_that_rejects_it() {
    let t = with("bf16[8]", "bf16[9]");
    let k = semantic_error(
        &t,
        1,
        at(&t, "rms_norm"),
        &["weight length 9 must equal the row length 8"],
    );
    assert!(matches!(k, VerifyErrorKind::Type(_)));
}

#[test]
fn a_dtype_mismatch_is_reported_at_the_op_that_rejects_it() {
    let t = with("\"norm\" : bf16[8]", "\"norm\" : f16[8]");
    semantic_error(
        &t,
        1,
        at(&t, "rms_norm"),
        &["must share a dtype", "bf16[2,8]", "f16[8]"],
    );
}

#[test]
fn a_wrong_recorded_result_type_points_at_the_type() {
    let t = with("%2 : bf16[2,8]", "%2 : bf16[3,8]");
    let k = semantic_error(
        &t,
        2, // and rms_norm, reading 3 rows, now gives bf16[3,8] too
        at(&t, "bf16[3,8]"),
        &["result 0 of `embedding` is declared bf16[3,8], but the op gives bf16[2,8]"],
    );
    assert!(matches!(k, VerifyErrorKind::ResultType { index: 0, .. }));
}

#[test]
fn a_dangling_value_points_at_the_use() {
    let t = with("%5, %1 :", "%5, %99 :");
    let k = semantic_error(&t, 1, at(&t, "%99"), &["%99 does not exist", "7 values"]);
    assert!(matches!(k, VerifyErrorKind::DanglingValue { .. }));
}

#[test]
fn a_hole_in_the_value_ids_is_reported_at_its_first_use() {
    // %1 is used by rope but its definition now says %7.
    let t = with("%1 = input positions", "%7 = input positions");
    let k = syntax_error(&t, at(&t, "%1 :"), &["%1 is used but never defined"]);
    assert_eq!(k, ParseErrorKind::UsedButUndefined(1));
    // An unused hole is reported at the next defined id.
    let t = with("  output", "  %8 = add %6, %6 : bf16[2,8]\n  output");
    syntax_error(
        &t,
        at(&t, "%8"),
        &["%7 is never defined but %8 is", "without gaps"],
    );
}

#[test]
fn a_duplicate_definition_is_reported_at_the_second_one() {
    let t = with("  output", "  %5 = input slot_mapping : i32[2]\n  output");
    let k = semantic_error(
        &t,
        1,
        at_nth(&t, "%5 = ", 1),
        &["%5 is defined more than once", "result 0 of node1"],
    );
    assert!(matches!(k, VerifyErrorKind::DuplicateDefinition { .. }));
    // Also between two nodes.
    let t = with("%6 = rope", "%5 = rope");
    let t = t.replace("output \"x\" = %6", "output \"x\" = %5");
    semantic_error(
        &t,
        1,
        at_nth(&t, "%5 = ", 1),
        &["%5 is defined more than once", "result 0 of node1"],
    );
}

#[test]
fn a_use_before_its_definition_is_reported_at_the_use() {
    // Swap the rms_norm and rope lines: rope reads %5 before rms_norm makes it.
    let lines: Vec<&str> = BASE.lines().collect();
    let mut swapped = lines.clone();
    swapped.swap(8, 9);
    let t = swapped.join("\n") + "\n";
    let k = semantic_error(
        &t,
        1,
        at(&t, "%5, %1"),
        &["%5 is used here before node2 defines it"],
    );
    assert!(matches!(k, VerifyErrorKind::UseBeforeDef { .. }));
}

#[test]
fn a_dependency_cycle_names_its_nodes() {
    // rms_norm now reads rope's result, and rope reads rms_norm's.
    let t = with("} %4, %3", "} %6, %3");
    let k = semantic_error(
        &t,
        1,
        at(&t, "rms_norm"),
        &["dependency cycle: node1 -> node2 -> node1"],
    );
    assert_eq!(
        k,
        VerifyErrorKind::Cycle(vec![kiln_ir::NodeId(1), kiln_ir::NodeId(2)])
    );
    // A node reading its own result is a cycle of one.
    let t = with("} %4, %3", "} %5, %3");
    semantic_error(
        &t,
        1,
        at(&t, "rms_norm"),
        &["dependency cycle: node1 -> node1"],
    );
}

#[test]
fn bad_numbers_are_named_with_the_reason() {
    let t = with("bf16[16,8]", "bf16[16.5,8]");
    syntax_error(
        &t,
        at(&t, "16.5"),
        &["bad number `16.5`", "unsigned integer"],
    );
    let t = with("bf16[16,8]", "bf16[4294967296,8]");
    syntax_error(&t, at(&t, "4294967296"), &["does not fit in 32 bits"]);
    let t = with("eps = 1e-5", "eps = 1e-5x");
    syntax_error(&t, at(&t, "1e-5x"), &["bad number `1e-5x`"]);
    let t = with("theta = 1e4", "theta = 1e999");
    syntax_error(&t, at(&t, "1e999"), &["out of the f32 range"]);
    let t = with("heads = 2", "heads = -2");
    syntax_error(&t, at(&t, "-2"), &["bad number `-2`", "unsigned integer"]);
    let t = with("eps = 1e-5", "eps = 1.");
    syntax_error(&t, at(&t, "1."), &["digits must follow the decimal point"]);
}

#[test]
fn truncated_input_is_reported_where_it_ends() {
    let cut = BASE.find("  output").unwrap();
    let t = &BASE[..cut];
    syntax_error(t, at(BASE, "  output"), &["end of input", "cut short"]);
    let cut = BASE.find("head_dim").unwrap() + 4;
    let t = &BASE[..cut];
    let p = at(BASE, "head_dim");
    let end = Pos {
        line: p.line,
        column: p.column + 4,
    };
    syntax_error(
        t,
        end,
        &["expected `=` after the attribute name", "end of input"],
    );
}

#[test]
fn an_unknown_input_role_lists_the_valid_ones() {
    let t = with("input positions", "input position");
    let k = syntax_error(
        &t,
        at(&t, "position "),
        &[
            "unknown input role `position`",
            "positions",
            "k_cache.<layer>",
        ],
    );
    assert!(matches!(k, ParseErrorKind::UnknownRole { .. }));
    let t = with("input positions", "input k_cache.x");
    syntax_error(&t, at(&t, "k_cache.x"), &["unknown input role `k_cache.x`"]);
}

#[test]
fn an_unterminated_string_points_at_its_opening_quote() {
    let t = with("\"emb\"", "\"emb");
    let k = syntax_error(&t, at(&t, "\"emb"), &["unterminated string"]);
    assert_eq!(k, ParseErrorKind::UnterminatedString);
    let t = with("\"emb\"", "\"e\\qmb\"");
    syntax_error(&t, at(&t, "\\q"), &["unknown escape `\\q`"]);
    let t = with("\"emb\"", "\"e\\u{110000}\"");
    syntax_error(&t, at(&t, "\\u"), &["unknown escape `\\u{110000}`"]);
}

#[test]
fn a_missing_type_is_reported_after_the_last_argument() {
    let t = with("%0, %2 : bf16[2,8]", "%0, %2");
    let p = at(&t, "%2\n");
    syntax_error(
        &t,
        Pos {
            line: p.line,
            column: p.column + 2,
        },
        &["`:` and the result type(s)", "found `%5`"],
    );
    // A type with no shape.
    let t = with("%0, %2 : bf16[2,8]", "%0, %2 : bf16");
    let p = at(&t, "bf16\n");
    syntax_error(
        &t,
        Pos {
            line: p.line,
            column: p.column + 4,
        },
        &["`[` and the dimensions"],
    );
}

#[test]
fn an_unknown_dtype_lists_the_valid_ones() {
    let t = with("bf16[16,8]", "bf61[16,8]");
    syntax_error(
        &t,
        at(&t, "bf61"),
        &["unknown dtype `bf61`", "bf16, f16, f32, i32"],
    );
}

#[test]
fn attribute_problems_name_the_op_and_the_attribute() {
    let t = with("eps = 1e-5", "epss = 1e-5");
    let k = syntax_error(
        &t,
        at(&t, "epss"),
        &["`rms_norm` has no attribute `epss`", "eps, unit_offset"],
    );
    assert!(matches!(k, ParseErrorKind::UnknownAttr { .. }));
    let t = with("eps = 1e-5, unit_offset = false", "eps = 1e-5");
    syntax_error(
        &t,
        at(&t, "} %4"),
        &["`rms_norm` needs attribute `unit_offset` (true or false)"],
    );
    let t = with("unit_offset = false", "unit_offset = false, eps = 1");
    syntax_error(
        &t,
        at(&t, "eps = 1}"),
        &["attribute `eps` of `rms_norm` is given twice"],
    );
    let t = with("unit_offset = false", "unit_offset = 0");
    syntax_error(
        &t,
        at(&t, "0}"),
        &["attribute `unit_offset` of `rms_norm` must be true or false, got `0`"],
    );
    let t = with("scaling = none", "scaling = yarn(factor = 2)");
    syntax_error(
        &t,
        at(&t, "yarn"),
        &["unknown rope scaling `yarn`", "llama3("],
    );
    let t = with("scaling = none", "scaling = linear()");
    syntax_error(
        &t,
        at(&t, ")"),
        &["`rope.scaling(linear)` needs attribute `factor`"],
    );
    let t = with(
        "scaling = none",
        "scaling = linear(factor = linear(factor = 2))",
    );
    syntax_error(
        &t,
        at(&t, "(factor = 2"),
        &["calls like linear(...) do not nest"],
    );
    let deep = format!("scaling = linear(factor = {}", "a(".repeat(100_000));
    let t = with("scaling = none", &deep);
    syntax_error(&t, at(&t, "(a("), &["do not nest"]);
    let t = with("embedding %0", "embedding {eps = 1} %0");
    syntax_error(
        &t,
        at(&t, "eps = 1}"),
        &[
            "`embedding` has no attribute `eps`",
            "it takes no attributes",
        ],
    );
    let t = with(
        "%5 = rms_norm {eps = 1e-5, unit_offset = false}",
        "%5 = rms_norm",
    );
    syntax_error(
        &t,
        at(&t, "rms_norm"),
        &["`rms_norm` needs attribute `eps` (a float)"],
    );
}

#[test]
fn result_and_type_counts_must_agree() {
    let t = with("%2 : bf16[2,8]", "%2 : bf16[2,8], bf16[2,8]");
    syntax_error(
        &t,
        at(&t, "bf16[2,8], bf16"),
        &["1 result(s) on the left of `=` but 2 type(s)"],
    );
    let t = with("%1 = input positions", "%1, %7 = input positions");
    syntax_error(
        &t,
        at(&t, "%7"),
        &["an input defines exactly one value, not 2"],
    );
}

#[test]
fn outputs_and_inputs_are_checked_for_duplicates() {
    let t = with(
        "  output \"x\" = %6",
        "  output \"x\" = %6\n  output \"x\" = %5",
    );
    semantic_error(
        &t,
        1,
        at_nth(&t, "output", 1),
        &["output name \"x\" is used twice"],
    );
    let t = with("  output \"x\" = %6\n", "");
    semantic_error(
        &t,
        1,
        Pos { line: 1, column: 1 },
        &["the graph has no outputs"],
    );
    let t = with("%1 = input positions", "%1 = input token_ids");
    let k = semantic_error(
        &t,
        1,
        at_nth(&t, "%1 = input", 0),
        &["input role `token_ids` is declared twice"],
    );
    assert!(matches!(k, VerifyErrorKind::DuplicateRole { .. }));
    let t = with("\"norm\"", "\"emb\"");
    semantic_error(
        &t,
        1,
        at(&t, "%3 = weight"),
        &["weight \"emb\" is declared twice"],
    );
}

#[test]
fn text_after_the_graph_and_stray_characters_are_rejected() {
    let t = format!("{BASE}extra");
    syntax_error(
        &t,
        at(&t, "extra"),
        &["end of input after the closing `}`", "`extra`"],
    );
    let t = with("%4 = embedding", "%4 = embedding @");
    syntax_error(&t, at(&t, "@"), &["unexpected character `@`"]);
    let t = with("%4 = embedding %0", "%4 = embedding %x0");
    syntax_error(&t, at(&t, "%x0"), &["digits after `%`"]);
    syntax_error(
        "",
        Pos { line: 1, column: 1 },
        &["`graph \"<name>\" {`", "end of input"],
    );
    syntax_error(
        "graph t {}",
        Pos { line: 1, column: 7 },
        &["the graph name as a string"],
    );
}

#[test]
fn all_semantic_errors_are_collected_in_one_pass() {
    // Three independent problems: a dangling use, a wrong result type, a
    // duplicate output.
    let t = with("%5, %1 :", "%5, %99 :")
        .replace("%2 : bf16[2,8]", "%2 : bf16[2,9]")
        .replace(
            "  output \"x\" = %6",
            "  output \"x\" = %6\n  output \"x\" = %4",
        );
    let Err(TextError::Invalid(errs)) = parse_and_verify(&t, None) else {
        panic!("expected verifier errors");
    };
    let lines: Vec<u32> = errs.iter().map(|e| e.span.start.line).collect();
    let msgs: Vec<String> = errs.iter().map(|e| e.error.kind.to_string()).collect();
    assert!(
        msgs.iter().any(|m| m.contains("%99 does not exist")),
        "{msgs:#?}"
    );
    assert!(
        msgs.iter().any(|m| m.contains("declared bf16[2,9]")),
        "{msgs:#?}"
    );
    assert!(msgs.iter().any(|m| m.contains("used twice")), "{msgs:#?}");
    assert!(
        lines.contains(&8) && lines.contains(&10) && lines.contains(&13),
        "{lines:?}"
    );
}

#[test]
fn huge_attributes_are_type_errors_not_arithmetic_overflows() {
    // heads * head_dim overflows u32; typing must reject it, not wrap or panic.
    let t = with(
        "heads = 2, head_dim = 4",
        "heads = 4294967295, head_dim = 4",
    );
    semantic_error(
        &t,
        1,
        at(&t, "rope"),
        &["x row length 8 must be heads*head_dim = 4294967295*4"],
    );
    let text = r#"graph "big" {
  %0 = input token_ids : i32[4294967295]
  %1 = input draft_tokens : i32[1]
  %2 = accept_greedy {spec = 4294967295} %0, %1 : i32[1]
  %3 = input block_tables : i32[65536,1]
  %4 = input context_lens : i32[65536]
  %5 = input k_cache.0 : f32[4,8]
  %6 = input v_cache.0 : f32[4,8]
  %7 = weight "q" : f32[0,8]
  %8 = paged_attention {heads = 1, kv_heads = 1, head_dim = 8, query = 65536, block_size = 1, scale = 1, window = none, softcap = none} %7, %5, %6, %3, %4 : f32[0,8]
  %9, %10, %11 = qkv_rope_kv_write {heads = 4294967295, kv_heads = 4294967295, head_dim = 2, theta = 1e4, scaling = none, qk_norm = none, unit_offset = false} %7, %0, %0, %5, %6 : f32[0,8], f32[4,8], f32[4,8]
  output "a" = %2
}
"#;
    let Err(TextError::Invalid(errs)) = parse_and_verify(text, None) else {
        panic!(
            "expected verifier errors, got {:?}",
            parse_and_verify(text, None)
        );
    };
    let msgs: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
    assert_eq!(errs.len(), 3, "{msgs:#?}");
    assert!(
        msgs[0].starts_with("4:8: node0 (`accept_greedy`)"),
        "{msgs:#?}"
    );
    assert!(
        msgs[0].contains("pred length 4294967295 must be a multiple of spec+1 = 4294967296"),
        "{msgs:#?}"
    );
    assert!(
        msgs[1].contains("q rows 0 must be batch*query = 65536*65536"),
        "{msgs:#?}"
    );
    assert!(
        msgs[2].contains("(4294967295 + 2*4294967295)*2"),
        "{msgs:#?}"
    );
}
