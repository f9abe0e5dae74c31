//! The text form of a [`Graph`]: stable, diffable, and parsed back exactly by
//! [`crate::parse()`].
//!
//! Why it exists: golden files, `kiln inspect` and review diffs all read this
//! text, so the same graph must always print the same bytes, and everything a
//! graph holds must be in it: the name, each input with its role, each weight
//! with its manifest name, every op attribute (including `Option`s and rope
//! scalings), every value id and recorded type, and the outputs.
//!
//! ```
//! let text = r#"graph "tiny b2q1s0" {
//!   %0 = input token_ids : i32[2]
//!
//!   %1 = weight "model.embed_tokens.weight" : bf16[16,8]
//!   %3 = weight "model.norm.weight" : bf16[8]
//!
//!   %2 = embedding %0, %1 : bf16[2,8]
//!   %4, %5 = add_rms_norm {eps = 1e-5, unit_offset = false} %2, %2, %3 : bf16[2,8], bf16[2,8]
//!   %6 = argmax %4 : i32[2]
//!
//!   output "next_tokens" = %6
//! }
//! "#;
//! let (g, _info) = kiln_ir::parse_and_verify(text, None).unwrap();
//! assert_eq!(kiln_ir::print(&g), text);
//! ```
//!
//! Layout: inputs (in [`Graph::inputs`] order), weights, nodes (program
//! order), outputs, separated by blank lines. Value ids are printed as they
//! are (`%N`), never renumbered, so a reviewer's `%17` is the planner's
//! `ValueId(17)`. Attributes are printed in a fixed order per op, all of
//! them, even defaults. Floats print as the shortest text that reads back to
//! the same `f32` (plain or exponent form, whichever is shorter), `inf`,
//! `-inf`, or `nan` (NaN payloads and sign are not kept). Strings are quoted
//! with `\"`, `\\`, `\n`, `\r`, `\t` and `\u{HEX}` (other control characters)
//! escaped; everything else is written as is (UTF-8).
//!
//! Printing is total: a malformed graph (what [`crate::VerifyErrors::render`]
//! shows) prints `?` where its tables have no answer, and such text does not
//! parse back. Not here: parsing ([`crate::parse()`]), DOT ([`crate::to_dot`]).

use crate::graph::{Graph, ValueDef, ValueId};
use crate::op::{AttnAttrs, Op, RopeScaling};
use crate::text::{quote, NodeSpans, Pos, SourceMap, Span};

/// Prints `g` in the text form.
pub fn print(g: &Graph) -> String {
    print_with_map(g).0
}

/// [`print()`], also returning where each statement and token was written
/// (the same map [`crate::parse_with_map`] returns for the printed text).
pub fn print_with_map(g: &Graph) -> (String, SourceMap) {
    let mut p = Printer {
        out: String::new(),
        line: 1,
        column: 1,
        sections: false,
    };
    let graph_start = p.pos();
    p.push("graph");
    let graph = Span {
        start: graph_start,
        end: p.pos(),
    };
    p.push(" ");
    p.push(&quote(&g.name));
    p.push(" {");
    p.newline();

    let ty_of = |v: ValueId| -> String {
        g.values
            .get(v.index())
            .map(|d| d.ty.to_string())
            .unwrap_or_else(|| "?".into())
    };

    let mut inputs = Vec::with_capacity(g.inputs.len());
    p.section_break(!g.inputs.is_empty());
    for &v in &g.inputs {
        p.push("  ");
        let start = p.pos();
        let role = match g.values.get(v.index()).map(|d| &d.def) {
            Some(ValueDef::Input(role)) => role.name(),
            _ => "?".into(),
        };
        p.push(&format!("{v} = input {role} : {}", ty_of(v)));
        inputs.push(Span {
            start,
            end: p.pos(),
        });
        p.newline();
    }

    let mut weights = Vec::with_capacity(g.weights.len());
    p.section_break(!g.weights.is_empty());
    for &v in &g.weights {
        p.push("  ");
        let start = p.pos();
        let name = match g.values.get(v.index()).map(|d| &d.def) {
            Some(ValueDef::Weight(name)) => quote(name),
            _ => "?".into(),
        };
        p.push(&format!("{v} = weight {name} : {}", ty_of(v)));
        weights.push(Span {
            start,
            end: p.pos(),
        });
        p.newline();
    }

    let mut nodes = Vec::with_capacity(g.nodes.len());
    p.section_break(!g.nodes.is_empty());
    for node in &g.nodes {
        p.push("  ");
        let mut spans = NodeSpans {
            op: p.span(""),
            results: vec![],
            args: vec![],
            types: vec![],
        };
        for (i, r) in node.results.iter().enumerate() {
            if i > 0 {
                p.push(", ");
            }
            spans.results.push(p.span(&r.to_string()));
        }
        p.push(" = ");
        spans.op = p.span(node.op.mnemonic());
        let attrs = attrs(&node.op);
        if !attrs.is_empty() {
            p.push(" {");
            p.push(&attrs);
            p.push("}");
        }
        for (i, a) in node.args.iter().enumerate() {
            p.push(if i == 0 { " " } else { ", " });
            spans.args.push(p.span(&a.to_string()));
        }
        p.push(" : ");
        for (i, r) in node.results.iter().enumerate() {
            if i > 0 {
                p.push(", ");
            }
            spans.types.push(p.span(&ty_of(*r)));
        }
        nodes.push(spans);
        p.newline();
    }

    let mut outputs = Vec::with_capacity(g.outputs.len());
    p.section_break(!g.outputs.is_empty());
    for (name, v) in &g.outputs {
        p.push("  ");
        let start = p.pos();
        p.push(&format!("output {} = {v}", quote(name)));
        outputs.push(Span {
            start,
            end: p.pos(),
        });
        p.newline();
    }
    p.push("}");
    p.newline();
    (
        p.out,
        SourceMap {
            graph,
            inputs,
            weights,
            nodes,
            outputs,
        },
    )
}

struct Printer {
    out: String,
    line: u32,
    column: u32,
    /// Whether a section has been written (the next one gets a blank line).
    sections: bool,
}

impl Printer {
    fn pos(&self) -> Pos {
        Pos {
            line: self.line,
            column: self.column,
        }
    }
    /// Appends text that holds no newline.
    fn push(&mut self, s: &str) {
        self.out.push_str(s);
        self.column += s.chars().count() as u32;
    }
    fn span(&mut self, s: &str) -> Span {
        let start = self.pos();
        self.push(s);
        Span {
            start,
            end: self.pos(),
        }
    }
    fn newline(&mut self) {
        self.out.push('\n');
        self.line += 1;
        self.column = 1;
    }
    /// Called before each section: a blank line between non-empty ones.
    fn section_break(&mut self, non_empty: bool) {
        if non_empty {
            if self.sections {
                self.newline();
            }
            self.sections = true;
        }
    }
}

/// The shortest text that parses back to exactly `x`.
pub(crate) fn fmt_f32(x: f32) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    // Both forms use the shortest digits that round-trip; pick the shorter.
    let plain = format!("{x}");
    let exp = format!("{x:e}");
    if exp.len() < plain.len() {
        exp
    } else {
        plain
    }
}

fn fmt_opt_f32(x: Option<f32>) -> String {
    x.map(fmt_f32).unwrap_or_else(|| "none".into())
}

fn fmt_scaling(s: &RopeScaling) -> String {
    match s {
        RopeScaling::None => "none".into(),
        RopeScaling::Linear { factor } => format!("linear(factor = {})", fmt_f32(*factor)),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => format!(
            "llama3(factor = {}, low_freq_factor = {}, high_freq_factor = {}, original_max_position = {original_max_position})",
            fmt_f32(*factor),
            fmt_f32(*low_freq_factor),
            fmt_f32(*high_freq_factor),
        ),
    }
}

/// `name = value` pairs of an op in the fixed order of
/// [`crate::text::attr_names`], joined by `, `; empty for ops without
/// attributes.
pub(crate) fn attrs(op: &Op) -> String {
    attr_pairs(op)
        .into_iter()
        .map(|(k, v)| format!("{k} = {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// [`attrs`]' pairs, in order.
fn attr_pairs(op: &Op) -> Vec<(&'static str, String)> {
    let pairs: Vec<(&'static str, String)> = match op {
        Op::Embedding
        | Op::KvWrite
        | Op::SiluMul
        | Op::GeluTanhMul
        | Op::Add
        | Op::Argmax
        | Op::Sample => {
            vec![]
        }
        Op::RmsNorm { eps, unit_offset } | Op::AddRmsNorm { eps, unit_offset } => vec![
            ("eps", fmt_f32(*eps)),
            ("unit_offset", unit_offset.to_string()),
        ],
        Op::MatMul { bias, out } => vec![("bias", bias.to_string()), ("out", out.to_string())],
        Op::HeadRmsNorm {
            heads,
            head_dim,
            eps,
            unit_offset,
        } => vec![
            ("heads", heads.to_string()),
            ("head_dim", head_dim.to_string()),
            ("eps", fmt_f32(*eps)),
            ("unit_offset", unit_offset.to_string()),
        ],
        Op::Rope {
            heads,
            head_dim,
            rope,
        } => vec![
            ("heads", heads.to_string()),
            ("head_dim", head_dim.to_string()),
            ("theta", fmt_f32(rope.theta)),
            ("scaling", fmt_scaling(&rope.scaling)),
        ],
        Op::PagedAttention(AttnAttrs {
            heads,
            kv_heads,
            head_dim,
            query,
            block_size,
            scale,
            window,
            softcap,
        }) => vec![
            ("heads", heads.to_string()),
            ("kv_heads", kv_heads.to_string()),
            ("head_dim", head_dim.to_string()),
            ("query", query.to_string()),
            ("block_size", block_size.to_string()),
            ("scale", fmt_f32(*scale)),
            (
                "window",
                window
                    .map(|w| w.to_string())
                    .unwrap_or_else(|| "none".into()),
            ),
            ("softcap", fmt_opt_f32(*softcap)),
        ],
        Op::QkvRopeKvWrite {
            heads,
            kv_heads,
            head_dim,
            rope,
            qk_norm,
            unit_offset,
        } => vec![
            ("heads", heads.to_string()),
            ("kv_heads", kv_heads.to_string()),
            ("head_dim", head_dim.to_string()),
            ("theta", fmt_f32(rope.theta)),
            ("scaling", fmt_scaling(&rope.scaling)),
            ("qk_norm", fmt_opt_f32(*qk_norm)),
            ("unit_offset", unit_offset.to_string()),
        ],
        // The attention's attributes, then the rope's it does not repeat.
        Op::RopeAttention { .. } => {
            let (rope, attn) = op
                .split_rope_attention()
                .expect("a rope_attention has two parts");
            let mut v = attr_pairs(&attn);
            let rest: Vec<_> = attr_pairs(&rope)
                .into_iter()
                .filter(|(k, _)| v.iter().all(|(n, _)| n != k))
                .collect();
            v.extend(rest);
            v
        }
        // The projection's attributes (its result dtype is the
        // activations'), then the rope's.
        Op::MatMulQkvRope { bias, pre, .. } => {
            let mut v = vec![
                ("bias", bias.to_string()),
                ("norm", fmt_opt_f32(pre.map(|p| p.eps))),
                (
                    "norm_unit_offset",
                    pre.is_some_and(|p| p.unit_offset).to_string(),
                ),
            ];
            let (_, rope) = op
                .split_matmul_qkv_rope(crate::types::DType::BF16)
                .expect("a matmul_qkv_rope has two parts");
            v.extend(attr_pairs(&rope));
            v
        }
        Op::GatherLast { group } => vec![("group", group.to_string())],
        Op::AcceptGreedy { spec } => vec![("spec", spec.to_string())],
        Op::FusedMatMul {
            bias,
            out,
            pre,
            post,
        } => vec![
            ("bias", bias.to_string()),
            ("out", out.to_string()),
            ("norm", fmt_opt_f32(pre.map(|p| p.eps))),
            (
                "unit_offset",
                pre.is_some_and(|p| p.unit_offset).to_string(),
            ),
            ("epilogue", post.name().to_string()),
        ],
        Op::Scale { factor, softcap } => vec![
            ("factor", fmt_f32(*factor)),
            ("softcap", fmt_opt_f32(*softcap)),
        ],
        Op::AllReduce { ranks, out } => {
            vec![("ranks", ranks.to_string()), ("out", out.to_string())]
        }
        Op::ShardedArgmax { ranks } => vec![("ranks", ranks.to_string())],
        // The attention's attributes, then the split.
        Op::AttentionPartials { attn, parts } => {
            let mut v = attr_pairs(&Op::PagedAttention(*attn));
            v.push(("parts", parts.to_string()));
            v
        }
        Op::AttentionCombine {
            heads,
            head_dim,
            parts,
            out,
        } => vec![
            ("heads", heads.to_string()),
            ("head_dim", head_dim.to_string()),
            ("parts", parts.to_string()),
            ("out", out.to_string()),
        ],
    };
    debug_assert_eq!(
        pairs.iter().map(|p| p.0).collect::<Vec<_>>(),
        crate::text::attr_names(op.mnemonic()),
        "printer and parser disagree on the attributes of `{}`",
        op.mnemonic()
    );
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_in_the_shorter_of_plain_and_exponent_form() {
        assert_eq!(fmt_f32(1e-5), "1e-5");
        assert_eq!(fmt_f32(0.125), "0.125");
        assert_eq!(fmt_f32(10000.0), "1e4");
        assert_eq!(fmt_f32(1.0), "1");
        assert_eq!(fmt_f32(-0.0), "-0");
        assert_eq!(fmt_f32(f32::NEG_INFINITY), "-inf");
        assert_eq!(fmt_f32(f32::NAN), "nan");
        assert_eq!(fmt_f32(f32::from_bits(1)), "1e-45");
    }

    #[test]
    fn control_characters_quotes_and_backslashes_are_escaped() {
        assert_eq!(
            quote("a\"b\\c\nd\te\u{1b}f\u{7f}é"),
            r#""a\"b\\c\nd\te\u{1b}f\u{7f}é""#
        );
    }
}
