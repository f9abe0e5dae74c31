//! `embedding`, `gather_last`, `argmax` (ties, NaN, -inf) and
//! `accept_greedy`.

mod common;

use common::*;
use kiln_ir::{DType, Op};
use kiln_kernels::cpu::{to_i32, KernelError};

#[test]
fn embedding_copies_the_rows_of_the_ids() {
    let mut rng = Rng::new(110);
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let (v, h) = (50u32, 72u32);
        let table = float(dtype, &[v, h], &rng.vec((v * h) as usize, -1.0, 1.0));
        let ids = vec![3, 49, 0, 3, 17];
        let got = run(&Op::Embedding, &[ints(&[5], &ids), table.clone()]);
        let es = dtype.size() * h as usize;
        for (t, &id) in ids.iter().enumerate() {
            assert_eq!(
                &got[0][t * es..(t + 1) * es],
                &table.1[id as usize * es..(id as usize + 1) * es]
            );
        }
    }
}

#[test]
fn embedding_refuses_ids_outside_the_table() {
    let table = float(DType::F32, &[10, 4], &Rng::new(111).vec(40, -1.0, 1.0));
    for bad in [10, -1] {
        let err = run_err(&Op::Embedding, &[ints(&[3], &[1, bad, 2]), table.clone()]);
        assert!(matches!(err, KernelError::Index { .. }), "{err}");
        assert!(
            err.to_string()
                .contains(&format!("token id {bad} at row 1")),
            "{err}"
        );
    }
}

#[test]
fn gather_last_takes_the_last_row_of_each_group() {
    let mut rng = Rng::new(112);
    let (b, group, h) = (3usize, 4usize, 7usize);
    let x = float(
        DType::BF16,
        &[(b * group) as u32, h as u32],
        &rng.vec(b * group * h, -1.0, 1.0),
    );
    let got = run(
        &Op::GatherLast {
            group: group as u32,
        },
        std::slice::from_ref(&x),
    );
    let es = 2 * h;
    for i in 0..b {
        let src = (i * group + group - 1) * es;
        assert_eq!(&got[0][i * es..(i + 1) * es], &x.1[src..src + es]);
    }
    // Works on integer tensors too (bit copy).
    let t = ints(&[4, 2], &[1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(
        to_i32(&run(&Op::GatherLast { group: 2 }, &[t])[0]),
        vec![3, 4, 7, 8]
    );
}

fn argmax(dtype: DType, rows: &[Vec<f32>]) -> Vec<i32> {
    let v = rows[0].len() as u32;
    let flat: Vec<f32> = rows.concat();
    to_i32(&run(&Op::Argmax, &[float(dtype, &[rows.len() as u32, v], &flat)])[0])
}

#[test]
fn argmax_finds_the_first_maximum_of_each_row() {
    let mut rng = Rng::new(113);
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let rows: Vec<Vec<f32>> = (0..5).map(|_| rng.vec(49152, -30.0, 30.0)).collect();
        let want: Vec<i32> = rows
            .iter()
            .map(|r| {
                let vals = kiln_kernels::cpu::to_f32(dtype, &kiln_kernels::cpu::from_f32(dtype, r));
                let m = vals.iter().cloned().fold(f32::MIN, f32::max);
                vals.iter().position(|&v| v == m).unwrap() as i32
            })
            .collect();
        assert_eq!(argmax(dtype, &rows), want, "{dtype}");
    }
    // Ties: the first index wins.
    assert_eq!(argmax(DType::F32, &[vec![1.0, 5.0, 2.0, 5.0]]), vec![1]);
}

#[test]
fn argmax_skips_nan_and_handles_infinities() {
    let nan = f32::NAN;
    let inf = f32::INFINITY;
    let rows = vec![
        vec![nan, 1.0, 3.0, nan],
        vec![nan, nan, nan, nan],
        vec![-inf, -inf, -inf, -inf],
        vec![1.0, inf, nan, inf],
        vec![-inf, nan, -5.0, -inf],
    ];
    assert_eq!(argmax(DType::F32, &rows), vec![2, 0, 0, 1, 2]);
    assert_eq!(argmax(DType::BF16, &rows), vec![2, 0, 0, 1, 2]);
}

#[test]
fn accept_greedy_counts_leading_drafts_that_match_the_prediction() {
    let spec = 3;
    // pred rows have spec+1 entries; drafts rows spec entries.
    let pred = [
        10, 11, 12, 13, // all three drafts match
        20, 21, 22, 23, // first matches, second not
        30, 31, 32, 33, // none
        40, 41, 42, 43, // the third differs only
    ];
    let drafts = [10, 11, 12, 20, 99, 22, 31, 31, 32, 40, 41, 0];
    let got = run(
        &Op::AcceptGreedy { spec },
        &[ints(&[16], &pred), ints(&[12], &drafts)],
    );
    assert_eq!(to_i32(&got[0]), vec![3, 1, 0, 2]);
}
