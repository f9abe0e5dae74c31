//! llama.cpp's q/k row permutation and kiln's inverse.

use kiln_compiler::gguf::fixture::Rng;
use kiln_compiler::gguf::permute::{permute_rows, unpermute_rows, PermuteError};

#[test]
fn one_head_of_four_rows_interleaves_the_halves() {
    // Hugging Face rows [x0, x1 | y0, y1] pair x_j with y_j (rotate-half);
    // llama.cpp stores the pairs adjacent: [x0, y0, x1, y1].
    let hf = [10, 11, 20, 21];
    assert_eq!(permute_rows(&hf, 4, 1, 1).unwrap(), vec![10, 20, 11, 21]);
    assert_eq!(
        unpermute_rows(&[10, 20, 11, 21], 4, 1, 1).unwrap(),
        hf.to_vec()
    );
}

#[test]
fn permutation_stays_inside_each_head_and_moves_whole_rows() {
    // Two heads of six rows, two columns per row.
    let hf: Vec<u32> = (0..12).flat_map(|r| [r * 100, r * 100 + 1]).collect();
    let gguf = permute_rows(&hf, 12, 2, 2).unwrap();
    let row_order: Vec<u32> = gguf.chunks(2).map(|r| r[0] / 100).collect();
    assert_eq!(row_order, vec![0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11]);
    for r in gguf.chunks(2) {
        assert_eq!(r[1], r[0] + 1, "a row was split");
    }
}

#[test]
fn unpermute_inverts_permute_on_random_matrices() {
    let mut rng = Rng::new(5);
    // (heads, head_dim, cols): SmolLM2's q and k, GQA shapes, odd columns.
    for (heads, hd, cols) in [
        (9, 64, 576),
        (3, 64, 576),
        (4, 16, 33),
        (1, 2, 7),
        (32, 128, 3),
    ] {
        let rows = heads * hd;
        let w = rng.vec(rows * cols, 1.0);
        let p = permute_rows(&w, rows, cols, heads).unwrap();
        if hd > 2 {
            assert_ne!(p, w, "permutation was the identity for hd {hd}");
        }
        assert_eq!(unpermute_rows(&p, rows, cols, heads).unwrap(), w);
        assert_eq!(
            permute_rows(
                &unpermute_rows(&w, rows, cols, heads).unwrap(),
                rows,
                cols,
                heads
            )
            .unwrap(),
            w
        );
    }
}

#[test]
fn unpermuting_with_the_wrong_head_count_does_not_restore_the_rows() {
    // k_proj must use the key/value head count, not the query head count.
    let mut rng = Rng::new(6);
    let (kv_heads, heads, hd, cols) = (3, 6, 64, 8);
    let w = rng.vec(kv_heads * hd * cols, 1.0);
    let p = permute_rows(&w, kv_heads * hd, cols, kv_heads).unwrap();
    let wrong = unpermute_rows(&p, kv_heads * hd, cols, heads).unwrap();
    assert_ne!(wrong, w);
}

#[test]
fn shapes_that_do_not_split_into_even_heads_are_errors() {
    let w = vec![0f32; 60];
    assert_eq!(
        unpermute_rows(&w, 10, 6, 3).unwrap_err(),
        PermuteError::Heads {
            rows: 10,
            n_head: 3
        }
    );
    assert!(
        matches!(
            unpermute_rows(&w, 6, 10, 2),
            Err(PermuteError::Heads { .. })
        ),
        "odd head size"
    );
    assert!(matches!(
        unpermute_rows(&w, 6, 10, 0),
        Err(PermuteError::Heads { .. })
    ));
    assert_eq!(
        unpermute_rows(&w, 8, 8, 2).unwrap_err(),
        PermuteError::Length {
            len: 60,
            rows: 8,
            cols: 8
        }
    );
    let err = unpermute_rows(&w, 10, 6, 3).unwrap_err().to_string();
    assert!(err.contains("10 rows") && err.contains("3 heads"), "{err}");
}
