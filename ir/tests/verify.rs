//! The verifier on graphs built in code: what `GraphInfo` says, each broken
//! invariant caught at the right location, all errors collected, the inline
//! rendering, the manifest check, and random corruptions of random graphs.

mod common;

use common::{decode_step, random_graph, Rng};
use kiln_ir::{
    verify, DType, Graph, InputRole, Location, NodeId, Op, TensorRef, TensorType, ValueData,
    ValueDef, ValueId, VerifyErrorKind, VerifyErrors, WeightEntry, WeightManifest, WeightSource,
};
use proptest::prelude::*;

fn errors(g: &Graph) -> VerifyErrors {
    match verify(g, None) {
        Ok(_) => panic!("graph verified but should not:\n{}", kiln_ir::print(g)),
        Err(e) => e,
    }
}

fn manifest_of(g: &Graph) -> WeightManifest {
    WeightManifest {
        entries: g
            .weights
            .iter()
            .map(|&w| {
                let ValueDef::Weight(name) = &g.value(w).def else {
                    unreachable!()
                };
                let ty = g.ty(w);
                WeightEntry {
                    name: name.clone(),
                    dtype: ty.dtype,
                    shape: ty.shape.clone(),
                    storage: None,
                    source: WeightSource::Tensor(TensorRef {
                        file: "model.safetensors".into(),
                        tensor: name.clone(),
                        dtype: ty.dtype,
                        shape: ty.shape.clone(),
                    }),
                }
            })
            .collect(),
    }
}

#[test]
fn graph_info_knows_users_definitions_and_last_uses_of_the_decode_step() {
    let g = decode_step();
    let info = verify(&g, Some(&manifest_of(&g))).unwrap();
    let v = |i| ValueId(i);
    let n = |i| NodeId(i);
    // %10 (the first rms_norm) feeds the q, k and v projections.
    assert_eq!(info.users(v(10)), &[n(2), n(3), n(4)]);
    assert_eq!(info.def_node(v(10)), Some(n(1)));
    // The embedding output is the residual, last read by add_rms_norm.
    assert_eq!(info.last_use(v(8)), Some(n(10)));
    // Positions feed both ropes; weights and inputs have no defining node.
    assert_eq!(info.use_count(v(1)), 2);
    assert_eq!(info.def_node(v(1)), None);
    assert_eq!(info.def_node(v(7)), None);
    // The argmax result is the output and is read by no node.
    assert!(info.is_output(v(39)));
    assert_eq!(info.use_count(v(39)), 1);
    assert_eq!(info.last_use(v(39)), None);
    assert!(!info.is_output(v(38)));
    assert_eq!(
        info.order(),
        (0..19).map(NodeId).collect::<Vec<_>>().as_slice()
    );
    assert!(info.matches(&g));
    let mut other = g.clone();
    other.push1(Op::Argmax, &[ValueId(38)]);
    assert!(!info.matches(&other));
}

#[test]
fn a_node_reading_a_value_twice_is_one_user_but_two_uses() {
    let mut g = decode_step();
    let x = ValueId(8);
    let y = g.push1(Op::Add, &[x, x]);
    g.add_output("y", y);
    let info = verify(&g, None).unwrap();
    assert_eq!(info.users(x).last(), Some(&NodeId(19)));
    assert_eq!(
        info.users(x).iter().filter(|&&u| u == NodeId(19)).count(),
        1
    );
    assert_eq!(info.use_count(x), 2 + 2); // rms_norm, add_rms_norm, add twice
}

#[test]
fn a_dangling_argument_is_reported_at_that_argument() {
    let mut g = decode_step();
    g.nodes[5].args[1] = ValueId(1000);
    let e = errors(&g);
    assert_eq!(e.errors.len(), 1, "{e}");
    assert_eq!(
        e.errors[0].location,
        Location::Arg {
            node: NodeId(5),
            arg: 1
        }
    );
    assert_eq!(
        e.errors[0].kind,
        VerifyErrorKind::DanglingValue {
            value: ValueId(1000),
            count: 40
        }
    );
    assert!(e.errors[0].context.contains("node5 (`rope`), argument 1"));
}

#[test]
fn dangling_ids_in_every_list_are_reported() {
    let mut g = decode_step();
    g.inputs.push(ValueId(500));
    g.weights.push(ValueId(501));
    g.nodes[0].results.push(ValueId(502));
    g.outputs.push(("ghost".into(), ValueId(503)));
    let e = errors(&g);
    let locs: Vec<Location> = e.errors.iter().map(|e| e.location).collect();
    assert!(locs.contains(&Location::Input(7)), "{e}");
    assert!(locs.contains(&Location::Weight(12)), "{e}");
    assert!(locs.contains(&Location::Result {
        node: NodeId(0),
        result: 1
    }));
    assert!(locs.contains(&Location::Output(1)), "{e}");
    // The embedding now declares two results but gives one.
    assert!(e.errors.iter().any(|e| matches!(
        e.kind,
        VerifyErrorKind::ResultCount {
            want: 1,
            got: 2,
            ..
        }
    )));
}

#[test]
fn a_value_whose_table_entry_names_another_node_is_a_mismatch() {
    let mut g = decode_step();
    // %12 is result 0 of node2; say it is node3's.
    g.values[12].def = ValueDef::Node {
        node: NodeId(3),
        index: 0,
    };
    let e = errors(&g);
    assert!(e.errors.iter().any(|x| x.location
        == Location::Result {
            node: NodeId(2),
            result: 0
        }
        && matches!(x.kind, VerifyErrorKind::DefMismatch { .. })));
    assert!(
        e.to_string().contains("says it is result 0 of node3"),
        "{e}"
    );
}

#[test]
fn a_value_no_statement_declares_is_reported_and_rendered_under_the_graph_line() {
    let mut g = decode_step();
    g.values.push(ValueData {
        ty: TensorType::new(DType::F32, [3]),
        def: ValueDef::Input(InputRole::DraftTokens),
    });
    let e = errors(&g);
    assert_eq!(e.errors.len(), 1, "{e}");
    assert_eq!(e.errors[0].location, Location::Value(ValueId(40)));
    let r = e.render(&g);
    let lines: Vec<&str> = r.lines().collect();
    assert_eq!(lines[0], "graph \"llama b2q1s0\" {");
    assert!(
        lines[1].starts_with("^^^^^ error: value %40 (input `draft_tokens`) is not declared"),
        "{r}"
    );
}

#[test]
fn a_wrongly_typed_input_names_the_role_and_the_expected_type() {
    let mut g = decode_step();
    g.add_input(InputRole::DraftTokens, TensorType::new(DType::I32, [2, 2]));
    g.add_input(InputRole::KCache(1), TensorType::new(DType::I32, [64, 32]));
    let e = errors(&g);
    let msgs: Vec<String> = e.errors.iter().map(|e| e.to_string()).collect();
    assert_eq!(
        msgs,
        [
            "input 7 (`draft_tokens`): input `draft_tokens` must be i32 of rank 1, got i32[2,2]",
            "input 8 (`k_cache.1`): input `k_cache.1` must be a float tensor of rank 2, got i32[64,32]",
        ]
    );
}

#[test]
fn a_use_before_definition_without_a_cycle_is_not_called_a_cycle() {
    let mut g = decode_step();
    // node3 (k_proj) now reads %16, the result of node4 (v_proj), which
    // comes later but does not depend on node3: out of order, not a cycle.
    g.nodes[3].args[0] = ValueId(16);
    let e = errors(&g);
    let kinds: Vec<&VerifyErrorKind> = e.errors.iter().map(|e| &e.kind).collect();
    assert!(kinds.contains(&&VerifyErrorKind::UseBeforeDef {
        value: ValueId(16),
        def: NodeId(4)
    }));
    assert!(!kinds.iter().any(|k| matches!(k, VerifyErrorKind::Cycle(_))));
}

#[test]
fn every_error_is_collected_not_just_the_first() {
    let mut g = decode_step();
    g.nodes[0].args[1] = ValueId(999); // dangling
    g.values[12].ty = TensorType::new(DType::BF16, [2, 65]); // wrong recorded type
    g.outputs.push(("next_tokens".into(), ValueId(39))); // duplicate output
    let e = errors(&g);
    let s = e.to_string();
    assert!(
        s.starts_with("graph \"llama b2q1s0\" is malformed ("),
        "{s}"
    );
    assert!(s.contains("%999 does not exist"), "{s}");
    assert!(
        s.contains("declared bf16[2,65], but the op gives bf16[2,64]"),
        "{s}"
    );
    assert!(
        s.contains("output name \"next_tokens\" is used twice"),
        "{s}"
    );
    // and the rope reading the mistyped %12 rejects it.
    assert!(s.contains("node5 (`rope`)"), "{s}");
}

#[test]
fn weights_are_checked_against_the_manifest_when_one_is_given() {
    let g = decode_step();
    let mut m = manifest_of(&g);
    verify(&g, Some(&m)).unwrap();
    m.entries.retain(|e| e.name != "model.norm.weight");
    m.entries[0].dtype = DType::F16;
    let e = verify(&g, Some(&m)).unwrap_err();
    let msgs: Vec<String> = e.errors.iter().map(|e| e.kind.to_string()).collect();
    assert_eq!(
        msgs,
        [
            "weight \"model.embed_tokens.weight\" is bf16[256,64] in the graph but f16[256,64] in the manifest",
            "weight \"model.norm.weight\" is not in the weight manifest; add it there or fix the name",
        ]
    );
    // Without a manifest the same graph is fine.
    verify(&g, None).unwrap();
}

#[test]
fn render_puts_carets_under_the_offending_token() {
    let mut g = decode_step();
    g.nodes[5].args[1] = ValueId(77);
    let e = errors(&g);
    let r = e.render(&g);
    let lines: Vec<&str> = r.lines().collect();
    let i = lines
        .iter()
        .position(|l| l.contains("%17 = rope"))
        .expect("rope line");
    let col = lines[i].find("%77").unwrap();
    assert_eq!(
        lines[i + 1],
        format!(
            "{}^^^ error: %77 does not exist (the graph has 40 values); define it or refer to an existing value",
            " ".repeat(col)
        )
    );
    // Everything else is the printed graph, unchanged.
    let without: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| !l.contains("error:"))
        .collect();
    assert_eq!(without.join("\n") + "\n", kiln_ir::print(&g));
}

/// How a random corruption should be reported.
#[derive(Debug)]
enum Expect {
    Kind(fn(&VerifyErrorKind) -> bool),
}

fn corrupt(g: &mut Graph, rng: &mut Rng) -> (&'static str, Expect) {
    loop {
        match rng.range(0, 7) {
            0 => {
                let n = rng.range(0, g.nodes.len() as u32 - 1) as usize;
                let a = rng.range(0, g.nodes[n].args.len() as u32 - 1) as usize;
                g.nodes[n].args[a] = ValueId(g.values.len() as u32 + rng.range(0, 100));
                return (
                    "dangling argument",
                    Expect::Kind(|k| matches!(k, VerifyErrorKind::DanglingValue { .. })),
                );
            }
            1 => {
                let n = rng.range(0, g.nodes.len() as u32 - 1) as usize;
                let r = g.nodes[n].results[0];
                let ty = &mut g.values[r.index()].ty;
                match ty.shape.0.first_mut() {
                    Some(d) => *d += 1 + rng.range(0, 5),
                    None => ty.shape.0.push(1),
                }
                return (
                    "wrong recorded type",
                    Expect::Kind(|k| matches!(k, VerifyErrorKind::ResultType { .. })),
                );
            }
            2 => {
                let candidates: Vec<usize> = (0..g.nodes.len())
                    .filter(|&n| {
                        let len = g.nodes[n].args.len();
                        !g.nodes[n].op.arity().contains(&(len - 1))
                    })
                    .collect();
                if candidates.is_empty() {
                    continue;
                }
                let n = rng.pick(&candidates);
                g.nodes[n].args.pop();
                return (
                    "missing argument",
                    Expect::Kind(|k| matches!(k, VerifyErrorKind::Arity { .. })),
                );
            }
            3 => {
                let i = rng.range(0, g.inputs.len() as u32 - 1) as usize;
                let v = g.inputs[i];
                g.inputs.push(v);
                return (
                    "input listed twice",
                    Expect::Kind(|k| matches!(k, VerifyErrorKind::DuplicateDefinition { .. })),
                );
            }
            4 => {
                g.outputs.clear();
                return (
                    "no outputs",
                    Expect::Kind(|k| matches!(k, VerifyErrorKind::NoOutputs)),
                );
            }
            5 => {
                // The first node that reads another node's result now reads
                // the last node's result instead: a later definition.
                let last = g.nodes.len() - 1;
                if last == 0 {
                    continue;
                }
                let r = g.nodes[last].results[0];
                let n = rng.range(0, last as u32 - 1) as usize;
                g.nodes[n].args[0] = r;
                return (
                    "use of a later result",
                    Expect::Kind(|k| {
                        matches!(
                            k,
                            VerifyErrorKind::UseBeforeDef { .. } | VerifyErrorKind::Cycle(_)
                        )
                    }),
                );
            }
            6 => {
                let name = g.outputs[0].0.clone();
                let v = g.outputs[0].1;
                g.outputs.push((name, v));
                return (
                    "duplicate output",
                    Expect::Kind(|k| matches!(k, VerifyErrorKind::DuplicateOutput(_))),
                );
            }
            _ => {
                let n = rng.range(0, g.nodes.len() as u32 - 1) as usize;
                let r = g.nodes[n].results[0];
                g.values[r.index()].def = ValueDef::Weight("stray".into());
                return (
                    "result whose table entry says weight",
                    Expect::Kind(|k| matches!(k, VerifyErrorKind::DefMismatch { .. })),
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_random_corruption_is_caught_with_the_right_kind(seed in any::<u64>(), how in any::<u64>()) {
        let mut g = random_graph(seed, &[1e-6, 2.5, 1e4], &["w".into(), "o\"ut".into()]);
        prop_assert!(verify(&g, None).is_ok());
        let mut rng = Rng::new(how);
        let (what, Expect::Kind(want)) = corrupt(&mut g, &mut rng);
        let e = verify(&g, None).expect_err(what);
        prop_assert!(
            e.errors.iter().any(|x| want(&x.kind)),
            "{what} not reported as expected: {e}"
        );
        // Rendering a broken graph never panics and shows every error.
        let r = e.render(&g);
        prop_assert_eq!(r.matches(" error: ").count(), e.errors.len());
        let _ = kiln_ir::to_dot(&g);
    }
}

/// The greedy lm_head as one op: `fused_matmul {epilogue = argmax}` reads
/// the final norm's input and weight and gives the tokens; its text form
/// reads back to the same graph, and a recorded result type other than
/// `i32[T]` (the logits' type, say) or an `out` that is not float is caught.
#[test]
fn an_argmax_epilogue_types_as_one_token_per_row_and_round_trips() {
    let text = r#"graph "lm_head" {
  %0 = input token_ids : i32[3]

  %1 = weight "model.embed_tokens.weight" : bf16[1001,64]
  %3 = weight "model.norm.weight" : bf16[64]
  %4 = weight "lm_head.weight" : bf16[1001,64]

  %2 = embedding %0, %1 : bf16[3,64]
  %5 = fused_matmul {bias = false, out = f32, norm = 1e-6, unit_offset = false, epilogue = argmax} %2, %4, %3 : i32[3]

  output "next_tokens" = %5
}
"#;
    let (g, _) = kiln_ir::parse_and_verify(text, None).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(kiln_ir::print(&g), text);
    let Op::FusedMatMul { post, out, .. } = &g.nodes[1].op else {
        panic!("one fused matmul")
    };
    assert_eq!((*post, *out), (kiln_ir::Epilogue::Argmax, DType::F32));
    assert_eq!(
        g.ty(g.nodes[1].results[0]),
        &TensorType::new(DType::I32, [3])
    );
    // The logits' type recorded as the result is a type mismatch.
    let wrong = text.replace(": i32[3]", ": f32[3,1001]");
    assert!(kiln_ir::parse_and_verify(&wrong, None).is_err());
    // An integer `out` has no logits to compare.
    let e = Op::FusedMatMul {
        bias: false,
        out: DType::I32,
        pre: None,
        post: kiln_ir::Epilogue::Argmax,
    }
    .infer(&[
        TensorType::new(DType::BF16, [3, 64]),
        TensorType::new(DType::BF16, [1001, 64]),
    ])
    .unwrap_err();
    assert!(e.contains("float"), "{e}");
}
