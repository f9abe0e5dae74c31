//! Weights kept quantized in the graph: the text form carries the storage,
//! the verifier refuses it where no kernel reads it and where rows are not
//! whole blocks, and sizes are the stored bytes.

use kiln_ir::{
    parse, print, verify, DType, Graph, InputRole, Op, QuantType, TensorType, VerifyErrorKind,
};

fn graph(q: QuantType, k: u32, on_norm: bool) -> Graph {
    let mut g = Graph::new("quant");
    let ids = g.add_input(InputRole::TokenIds, TensorType::new(DType::I32, [2]));
    let table = g.add_weight("embed", TensorType::new(DType::BF16, [10, k]).stored(q));
    let x = g.push1(Op::Embedding, &[ids, table]);
    let nw = if on_norm {
        // A rank-1 norm weight may never be stored quantized.
        g.add_weight("norm", TensorType::new(DType::BF16, [k]).stored(q))
    } else {
        g.add_weight("norm", TensorType::new(DType::BF16, [k]))
    };
    let x = g.push1(
        Op::RmsNorm {
            eps: 1e-5,
            unit_offset: false,
        },
        &[x, nw],
    );
    let w = g.add_weight("proj", TensorType::new(DType::BF16, [6, k]).stored(q));
    let y = g.push1(
        Op::MatMul {
            bias: false,
            out: DType::F32,
        },
        &[x, w],
    );
    let t = g.push1(Op::Argmax, &[y]);
    g.add_output("next_tokens", t);
    g
}

#[test]
fn a_quantized_weight_round_trips_through_the_text_form() {
    for q in QuantType::ALL {
        let k = q.block_elems().max(32) as u32 * 2;
        let g = graph(q, k, false);
        verify(&g, None).unwrap_or_else(|e| panic!("{q}: {e}"));
        let text = print(&g);
        assert!(text.contains(&format!("stored {}", q.name())), "{text}");
        let back = parse(&text).unwrap_or_else(|e| panic!("{q}: {e}"));
        assert_eq!(back, g, "{q}");
    }
}

#[test]
fn the_verifier_refuses_storage_on_an_operand_that_cannot_read_it() {
    let g = graph(QuantType::Q4K, 256, true);
    let e = verify(&g, None).unwrap_err();
    assert!(
        e.errors
            .iter()
            .any(|e| matches!(e.kind, VerifyErrorKind::StorageNotWeight { .. })),
        "{e}"
    );
    assert!(
        e.errors.iter().any(|e| matches!(
            e.kind,
            VerifyErrorKind::StorageOperand { op: "rms_norm", .. }
        )),
        "{e}"
    );
}

#[test]
fn the_verifier_refuses_rows_that_are_not_whole_blocks() {
    let g = graph(QuantType::Q4_0, 48, false);
    let e = verify(&g, None).unwrap_err();
    assert!(
        e.errors.iter().any(|e| matches!(
            e.kind,
            VerifyErrorKind::StorageBlocks {
                k: 48,
                block: 32,
                ..
            }
        )),
        "{e}"
    );
}

#[test]
fn stored_bytes_are_the_block_bytes() {
    for q in QuantType::ALL {
        let k = q.block_elems() * 3;
        let t = TensorType::new(DType::BF16, [7, k as u32]).stored(q);
        let want = 7 * (k / q.block_elems() * q.block_bytes())
            + if q == QuantType::Fp8E4M3 { 7 * 4 } else { 0 };
        assert_eq!(t.stored_bytes(), want as u64, "{q}");
        // The buffer kiln allocates holds the stored and the GPU layout.
        let gpu = q.gpu_bytes(7, k as u64).unwrap_or(0);
        assert_eq!(t.size_bytes(), (want as u64).max(gpu), "{q}");
        assert_eq!(q.row_bytes(k + 1).is_none(), q.block_elems() > 1, "{q}");
    }
    assert_eq!(QuantType::Q4K.row_bytes(2048), Some(8 * 144));
    assert_eq!(QuantType::Q8_0.row_bytes(576), Some(18 * 34));
}
