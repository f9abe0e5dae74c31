//! Property tests of the text form: random well-formed graphs print, parse
//! back to the same graph and the same bytes, and verify; mutated and random
//! texts never panic the parser, verifier, printer or DOT writer.

mod common;

use common::{random_graph, Rng};
use kiln_ir::{
    parse, parse_and_verify, parse_with_map, print, print_with_map, to_dot, verify, AttnAttrs,
    Graph, NodeId, Op, RopeScaling, ValueId,
};
use proptest::prelude::*;
use std::collections::BTreeSet;

/// Characters that stress quoting: quotes, backslashes, control characters,
/// the grammar's punctuation, non-ASCII; plus any char at all.
fn name_char() -> impl Strategy<Value = char> {
    prop_oneof![
        3 => prop::sample::select(vec![
            '"', '\\', '\n', '\r', '\t', '\u{0}', '\u{1b}', '\u{7f}', '\u{85}', '{', '}', '%',
            '=', ',', ':', '/', ' ', 'é', '✓', 'a', 'Z', '0', '.', '_',
        ]),
        1 => any::<char>(),
    ]
}

fn names() -> impl Strategy<Value = Vec<String>> {
    prop::collection::vec(
        prop::collection::vec(name_char(), 0..10).prop_map(|cs| cs.into_iter().collect()),
        1..8,
    )
}

/// Any f32 but NaN (NaN is not equal to itself; it has its own test).
fn floats() -> impl Strategy<Value = Vec<f32>> {
    use prop::num::f32 as f;
    prop::collection::vec(
        f::POSITIVE | f::NEGATIVE | f::NORMAL | f::SUBNORMAL | f::ZERO | f::INFINITE,
        1..16,
    )
}

/// Users of each value, recomputed the slow way.
fn users_by_scan(g: &Graph, v: ValueId) -> Vec<NodeId> {
    (0..g.nodes.len())
        .filter(|&n| g.nodes[n].args.contains(&v))
        .map(|n| NodeId(n as u32))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_graphs_print_parse_and_print_to_the_same_bytes(
        seed in any::<u64>(), fl in floats(), nm in names()
    ) {
        let g = random_graph(seed, &fl, &nm);
        let info = verify(&g, None);
        prop_assert!(info.is_ok(), "generator built an invalid graph:\n{}", info.unwrap_err().render(&g));
        let info = info.unwrap();

        let (text, printed_map) = print_with_map(&g);
        let (back, parsed_map) = parse_with_map(&text)
            .map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        prop_assert_eq!(&back, &g, "parse(print(g)) != g\n{}", text);
        prop_assert_eq!(print(&back), text.clone());
        prop_assert_eq!(&parsed_map, &printed_map, "spans differ between printer and parser");
        prop_assert_eq!(to_dot(&back), to_dot(&g));

        // The info agrees with a brute-force scan of the graph.
        for v in 0..g.values.len() {
            let v = ValueId(v as u32);
            let scanned = users_by_scan(&g, v);
            prop_assert_eq!(info.users(v), scanned.as_slice());
            let reads = g.nodes.iter().flat_map(|n| &n.args).filter(|&&a| a == v).count()
                + g.outputs.iter().filter(|o| o.1 == v).count();
            prop_assert_eq!(info.use_count(v), reads);
            prop_assert_eq!(info.last_use(v), users_by_scan(&g, v).last().copied());
            let def = g.nodes.iter().position(|n| n.results.contains(&v)).map(|n| NodeId(n as u32));
            prop_assert_eq!(info.def_node(v), def);
        }
        prop_assert!(info.matches(&g));
        prop_assert_eq!(info.order().len(), g.nodes.len());
    }

    #[test]
    fn mutated_texts_never_panic_and_accepted_ones_round_trip(
        seed in any::<u64>(), fl in floats(), nm in names(),
        edits in prop::collection::vec((0u8..7, any::<u32>(), any::<u32>()), 1..4),
    ) {
        let g = random_graph(seed, &fl, &nm);
        let mut text: Vec<char> = print(&g).chars().collect();
        for (kind, a, b) in edits {
            mutate(&mut text, kind, a, b);
        }
        let text: String = text.into_iter().collect();
        check_total(&text)?;
    }

    #[test]
    fn random_strings_never_panic_the_parser(s in "\\PC{0,200}") {
        check_total(&s)?;
    }

    #[test]
    fn random_token_soup_never_panics_the_parser(
        toks in prop::collection::vec(prop::sample::select(vec![
            "graph", "\"g\"", "{", "}", "%0", "%1", "%2", "%4294967295", "%99999999999", "=", ",", ":",
            "input", "weight", "output", "token_ids", "k_cache.4294967295", "embedding", "rope",
            "matmul", "paged_attention", "qkv_rope_kv_write", "rope_attention", "accept_greedy", "gather_last",
            "bf16", "i32", "[", "]", "(", ")", "2", "0", "4294967295", "-inf", "1e-5", "nan",
            "heads", "head_dim", "group", "spec", "scaling", "llama3", "linear", "none", "true",
            "\n", "//c\n", "\"unterminated", "\\", "-", "1.", "1e",
        ]), 0..60)
    ) {
        check_total(&toks.join(" "))?;
    }
}

/// One random edit of a text: delete, insert a grammar character, duplicate
/// or swap or delete a line, truncate, or change a digit.
fn mutate(text: &mut Vec<char>, kind: u8, a: u32, b: u32) {
    const INSERT: &[char] = &[
        '%', '"', '{', '}', ',', ':', '=', '[', ']', '(', ')', '0', '7', '9', 'x', '\n', '\\', '-',
        '.', 'e', ' ', '/',
    ];
    let n = text.len().max(1);
    let i = a as usize % n;
    match kind {
        0 => {
            let len = (b as usize % 8).min(text.len().saturating_sub(i));
            text.drain(i..i + len);
        }
        1 => text.insert(i.min(text.len()), INSERT[b as usize % INSERT.len()]),
        2..=4 => {
            let s: String = text.iter().collect();
            let mut lines: Vec<String> = s.split('\n').map(String::from).collect();
            let (x, y) = (a as usize % lines.len(), b as usize % lines.len());
            match kind {
                2 => {
                    let l = lines[x].clone();
                    lines.insert(y, l)
                }
                3 => lines.swap(x, y),
                _ => {
                    lines.remove(x);
                }
            }
            *text = lines.join("\n").chars().collect();
        }
        5 => text.truncate(i),
        _ => {
            // Change a digit: ids, dims and attributes shift.
            let digits: Vec<usize> = (0..text.len())
                .filter(|&k| text[k].is_ascii_digit())
                .collect();
            if !digits.is_empty() {
                let k = digits[i % digits.len()];
                text[k] = char::from(b'0' + (b % 10) as u8);
            }
        }
    }
}

/// Everything that takes a text or a parsed graph must answer without a
/// panic; a text that parses and verifies must round-trip.
fn check_total(text: &str) -> Result<(), TestCaseError> {
    let parsed = parse_with_map(text);
    let _ = parse_and_verify(text, None).map_err(|e| e.to_string());
    if let Ok((g, _)) = parsed {
        let printed = print(&g);
        let _ = to_dot(&g);
        match verify(&g, None) {
            Ok(_) => {
                let back =
                    parse(&printed).map_err(|e| TestCaseError::fail(format!("{e}\n{printed}")))?;
                prop_assert_eq!(back, g);
            }
            Err(errs) => {
                let r = errs.render(&g);
                prop_assert!(r.contains("error:"));
                let _ = errs.to_string();
            }
        }
    } else if let Err(e) = parsed {
        let _ = e.to_string();
    }
    Ok(())
}

#[test]
fn the_generator_covers_every_op_scaling_and_option() {
    let mut seen: BTreeSet<String> = BTreeSet::new();
    let fl = [1e-5, 0.5, 10000.0, -2.0];
    let nm = ["a\"b".to_string(), "c\\d\n".to_string()];
    for seed in 0..300 {
        let g = random_graph(seed, &fl, &nm);
        for n in &g.nodes {
            seen.insert(n.op.mnemonic().to_string());
            let tag = match &n.op {
                Op::Rope { rope, .. }
                | Op::QkvRopeKvWrite { rope, .. }
                | Op::RopeAttention { rope, .. } => match rope.scaling {
                    RopeScaling::None => "scaling none",
                    RopeScaling::Linear { .. } => "scaling linear",
                    RopeScaling::Llama3 { .. } => "scaling llama3",
                },
                _ => "",
            };
            seen.insert(tag.to_string());
            match &n.op {
                Op::PagedAttention(AttnAttrs {
                    window, softcap, ..
                }) => {
                    seen.insert(format!("window {}", window.is_some()));
                    seen.insert(format!("softcap {}", softcap.is_some()));
                }
                Op::QkvRopeKvWrite { qk_norm, .. } => {
                    seen.insert(format!("qk_norm {}", qk_norm.is_some()));
                }
                Op::RopeAttention { attn, qk_norm, .. } => {
                    seen.insert(format!("rope_attention qk_norm {}", qk_norm.is_some()));
                    seen.insert(format!("rope_attention window {}", attn.window.is_some()));
                }
                Op::MatMul { bias, .. } => {
                    seen.insert(format!("bias {bias}"));
                }
                Op::SiluMul | Op::GeluTanhMul => {
                    seen.insert(format!("{} arity {}", n.op.mnemonic(), n.args.len()));
                }
                Op::FusedMatMul { pre, post, .. } => {
                    seen.insert(format!("fused norm {}", pre.is_some()));
                    seen.insert(format!("fused epilogue {}", post.name()));
                }
                _ => {}
            }
        }
    }
    for m in Op::MNEMONICS {
        assert!(seen.contains(m), "generator never emits `{m}`");
    }
    for tag in [
        "rope_attention qk_norm true",
        "rope_attention qk_norm false",
        "rope_attention window true",
        "rope_attention window false",
        "scaling none",
        "scaling linear",
        "scaling llama3",
        "window true",
        "window false",
        "softcap true",
        "softcap false",
        "qk_norm true",
        "qk_norm false",
        "bias true",
        "bias false",
        "silu_mul arity 1",
        "silu_mul arity 2",
        "gelu_tanh_mul arity 1",
        "gelu_tanh_mul arity 2",
        "fused norm true",
        "fused norm false",
        "fused epilogue none",
        "fused epilogue silu_mul",
        "fused epilogue gelu_tanh_mul",
        "fused epilogue residual",
        "fused epilogue argmax",
    ] {
        assert!(seen.contains(tag), "generator never emits {tag}");
    }
}

#[test]
fn nan_attributes_print_as_nan_and_parse_back_to_nan() {
    let mut g = common::decode_step();
    if let Op::RmsNorm { eps, .. } = &mut g.nodes[1].op {
        *eps = f32::NAN;
    } else {
        panic!("node 1 of the decode step is its first rms_norm");
    }
    let text = print(&g);
    assert!(
        text.contains("rms_norm {eps = nan, unit_offset = false}"),
        "{text}"
    );
    let back = parse(&text).unwrap();
    assert!(matches!(back.nodes[1].op, Op::RmsNorm { eps, .. } if eps.is_nan()));
    assert_eq!(print(&back), text);
}

#[test]
fn printing_is_deterministic_across_clones_and_calls() {
    let mut rng = Rng::new(7);
    for _ in 0..20 {
        let g = random_graph(rng.next_u64(), &[0.1, 3.0], &["n".into()]);
        assert_eq!(print(&g), print(&g.clone()));
        assert_eq!(to_dot(&g), to_dot(&g.clone()));
    }
}

#[test]
fn rope_attention_joins_back_from_its_split_and_refuses_parts_that_disagree() {
    let fl = [1e-5, 0.5, 10000.0, -2.0];
    let nm = ["a".to_string(), "b".to_string()];
    let mut joined = 0;
    for seed in 0..300 {
        for n in &random_graph(seed, &fl, &nm).nodes {
            let Some((rope, attn)) = n.op.split_rope_attention() else {
                continue;
            };
            // Compared as text: NaN attributes print (and so compare) alike.
            let back = Op::join_rope_attention(&rope, &attn).expect("its own parts join");
            assert_eq!(format!("{back:?}"), format!("{:?}", n.op));
            joined += 1;
            // Parts in the wrong order, or of another op, do not join.
            assert!(Op::join_rope_attention(&attn, &rope).is_none());
            assert!(Op::join_rope_attention(&rope, &Op::SiluMul).is_none());
            // Neither do parts whose heads disagree.
            let Op::PagedAttention(AttnAttrs { heads, .. }) = &attn else {
                panic!("the second part is the attention: {attn:?}");
            };
            let mut other = attn.clone();
            if let Op::PagedAttention(AttnAttrs { heads: h, .. }) = &mut other {
                *h = heads + 1;
            }
            assert!(Op::join_rope_attention(&rope, &other).is_none());
        }
    }
    assert!(joined > 0, "the generator made no rope_attention");
}
