//! `paged_attention` against an f64 reference on scattered block tables:
//! GQA, multi-token causal queries, sliding window, softcap, several
//! sequences of different lengths; the megakernel's split form
//! (`attention_partials` then `attention_combine`) at every run count; and
//! refusals of bad lengths and blocks.
//!
//! Tolerance: the output is a convex combination of v rows, so f32 error is
//! tiny: one ulp of the result dtype plus `2e-5` absolute.

mod common;

use common::reference::{self, Attn};
use common::*;
use kiln_ir::{AttnAttrs, DType, Op};
use kiln_kernels::cpu::KernelError;

struct Case {
    a: Attn,
    dtype: DType,
    lens: Vec<i32>,
    /// Block table columns.
    m: usize,
    /// Cache blocks.
    blocks: usize,
}

impl Case {
    fn op(&self) -> Op {
        Op::PagedAttention(AttnAttrs {
            heads: self.a.heads as u32,
            kv_heads: self.a.kv_heads as u32,
            head_dim: self.a.hd as u32,
            query: self.a.query as u32,
            block_size: self.a.block_size as u32,
            scale: self.a.scale as f32,
            window: self.a.window.map(|w| w as u32),
            softcap: self.a.softcap.map(|c| c as f32),
        })
    }

    /// Random q and caches; each sequence gets distinct blocks scattered
    /// over the cache; unused table entries are -1.
    fn args(&self, rng: &mut Rng) -> (Vec<Arg>, Vec<i32>) {
        let a = &self.a;
        let batch = self.lens.len();
        let slots = self.blocks * a.block_size;
        let (qw, kw) = (a.heads * a.hd, a.kv_heads * a.hd);
        let rows = batch * a.query;
        let q = float(
            self.dtype,
            &[rows as u32, qw as u32],
            &rng.vec(rows * qw, -1.5, 1.5),
        );
        let kc = float(
            self.dtype,
            &[slots as u32, kw as u32],
            &rng.vec(slots * kw, -1.5, 1.5),
        );
        let vc = float(
            self.dtype,
            &[slots as u32, kw as u32],
            &rng.vec(slots * kw, -2.0, 2.0),
        );
        let mut free: Vec<i32> = (0..self.blocks as i32).collect();
        rng.shuffle(&mut free);
        let mut tables = vec![-1i32; batch * self.m];
        for (b, &ctx) in self.lens.iter().enumerate() {
            for j in 0..(ctx as usize).div_ceil(a.block_size) {
                tables[b * self.m + j] = free.pop().expect("test bug: not enough blocks");
            }
        }
        let bt = ints(&[batch as u32, self.m as u32], &tables);
        let cl = ints(&[batch as u32], &self.lens);
        (vec![q, kc, vc, bt, cl], tables)
    }

    fn check(&self, seed: u64) {
        self.check_runs(seed, None);
    }

    /// With `runs`, the megakernel's split form instead of the op:
    /// `attention_combine(attention_partials(...))`, held to the same bound.
    fn check_runs(&self, seed: u64, runs: Option<u32>) {
        let mut rng = Rng::new(seed);
        let (args, tables) = self.args(&mut rng);
        let got = match (runs, self.op()) {
            (Some(parts), Op::PagedAttention(attn)) => {
                let partials = run(&Op::AttentionPartials { attn, parts }, &args);
                let rows = args[0].0.shape.dims()[0];
                let width = attn.heads * parts * (attn.head_dim + 2);
                let pt = kiln_ir::TensorType::new(DType::F32, kiln_ir::Shape(vec![rows, width]));
                assert_eq!(partials[0].len() as u64, pt.size_bytes());
                run(
                    &Op::AttentionCombine {
                        heads: attn.heads,
                        head_dim: attn.head_dim,
                        parts,
                        out: self.dtype,
                    },
                    &[(pt, partials[0].clone())],
                )
            }
            (_, op) => run(&op, &args),
        };
        let want = reference::paged_attention(
            &self.a,
            &stored(&args[0]),
            &stored(&args[1]),
            &stored(&args[2]),
            &tables,
            self.m,
            &self.lens,
        );
        assert_close(
            &format!(
                "{:?} {} lens {:?} runs {runs:?}",
                self.a, self.dtype, self.lens
            ),
            self.dtype,
            &got[0],
            &want,
            1.0,
            2e-5,
        );
    }
}

fn attn(heads: usize, kv_heads: usize, hd: usize, query: usize) -> Attn {
    Attn {
        heads,
        kv_heads,
        hd,
        query,
        block_size: 16,
        scale: 1.0 / (hd as f64).sqrt(),
        window: None,
        softcap: None,
    }
}

#[test]
fn decode_attention_with_gqa_matches_reference() {
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        Case {
            a: attn(6, 2, 16, 1),
            dtype,
            lens: vec![1, 37, 16, 100],
            m: 8,
            blocks: 40,
        }
        .check(80);
        Case {
            a: attn(9, 3, 64, 1),
            dtype,
            lens: vec![300],
            m: 20,
            blocks: 25,
        }
        .check(81);
        // A head dim that is not a multiple of the 16 dot lanes.
        Case {
            a: attn(6, 2, 24, 2),
            dtype,
            lens: vec![5, 33],
            m: 3,
            blocks: 6,
        }
        .check(79);
    }
}

#[test]
fn multi_token_queries_are_causal_inside_the_window() {
    for dtype in [DType::BF16, DType::F32] {
        Case {
            a: attn(6, 2, 16, 3),
            dtype,
            lens: vec![3, 20, 47],
            m: 4,
            blocks: 12,
        }
        .check(82);
        Case {
            a: attn(4, 1, 32, 7),
            dtype,
            lens: vec![7, 64],
            m: 5,
            blocks: 10,
        }
        .check(83);
    }
}

#[test]
fn attention_split_into_runs_and_combined_matches_the_reference() {
    // Every run count from one to more runs than a sequence has positions
    // (empty runs), with GQA, multi-token causal queries, a sliding window
    // and a softcap.
    let mut windowed = attn(4, 2, 16, 3);
    windowed.window = Some(9);
    windowed.softcap = Some(20.0);
    let cases = [
        Case {
            a: attn(6, 2, 16, 1),
            dtype: DType::BF16,
            lens: vec![1, 37, 16, 100],
            m: 8,
            blocks: 40,
        },
        Case {
            a: attn(6, 2, 24, 2),
            dtype: DType::F32,
            lens: vec![5, 33],
            m: 3,
            blocks: 6,
        },
        Case {
            a: windowed,
            dtype: DType::BF16,
            lens: vec![3, 20, 47],
            m: 4,
            blocks: 12,
        },
    ];
    for (i, case) in cases.iter().enumerate() {
        for runs in [1, 2, 3, 8, 16, 64] {
            case.check_runs(90 + i as u64, Some(runs));
        }
    }
}

#[test]
fn causal_masking_is_not_a_no_op() {
    // The first query token of a 3-token window must not see the next two:
    // compare against a reference that lets it (positions up to ctx-1).
    let case = Case {
        a: attn(2, 1, 16, 3),
        dtype: DType::F32,
        lens: vec![5],
        m: 1,
        blocks: 2,
    };
    let mut rng = Rng::new(84);
    let (args, tables) = case.args(&mut rng);
    let got = kiln_kernels::cpu::to_f32(DType::F32, &run(&case.op(), &args)[0]);
    let mut peek = case.a.clone();
    peek.query = 1;
    // With query 1 and ctx 5, the single query row sees all 5 positions.
    let q0: Vec<f64> = stored(&args[0])[..32].to_vec();
    let all = reference::paged_attention(
        &peek,
        &q0,
        &stored(&args[1]),
        &stored(&args[2]),
        &tables,
        1,
        &[5],
    );
    let diff: f64 = got[..32]
        .iter()
        .zip(&all)
        .map(|(g, w)| (*g as f64 - w).abs())
        .sum();
    assert!(
        diff > 1e-3,
        "first query token attended to future positions"
    );
}

#[test]
fn sliding_window_limits_the_attended_positions() {
    for dtype in [DType::BF16, DType::F32] {
        for window in [1, 5, 16, 33] {
            let mut a = attn(6, 2, 16, 3);
            a.window = Some(window);
            Case {
                a,
                dtype,
                lens: vec![3, 40, 70],
                m: 5,
                blocks: 16,
            }
            .check(85 + window as u64);
        }
    }
}

#[test]
fn sliding_window_never_reads_blocks_before_the_window() {
    // Blocks wholly before the window may already be freed (-1).
    let mut a = attn(2, 1, 16, 1);
    a.window = Some(8);
    let case = Case {
        a,
        dtype: DType::F32,
        lens: vec![40],
        m: 3,
        blocks: 4,
    };
    let mut rng = Rng::new(90);
    let (mut args, mut tables) = case.args(&mut rng);
    tables[0] = -1; // positions 0..16: before the window [32, 40)
    args[3] = ints(&[1, 3], &tables);
    let got = run(&case.op(), &args);
    let want = reference::paged_attention(
        &case.a,
        &stored(&args[0]),
        &stored(&args[1]),
        &stored(&args[2]),
        &tables,
        3,
        &[40],
    );
    assert_close(
        "window with freed block",
        DType::F32,
        &got[0],
        &want,
        1.0,
        2e-5,
    );
}

#[test]
fn softcapped_scores_match_reference() {
    for dtype in [DType::BF16, DType::F32] {
        let mut a = attn(4, 2, 32, 2);
        a.softcap = Some(2.0);
        a.scale = 1.0; // large raw scores so the cap matters
        Case {
            a,
            dtype,
            lens: vec![2, 50],
            m: 4,
            blocks: 8,
        }
        .check(91);
        let mut a = attn(4, 2, 32, 1);
        a.softcap = Some(50.0);
        a.window = Some(10);
        Case {
            a,
            dtype,
            lens: vec![30],
            m: 2,
            blocks: 4,
        }
        .check(92);
    }
}

#[test]
fn large_context_runs_in_parallel_and_matches_reference() {
    Case {
        a: attn(8, 2, 64, 2),
        dtype: DType::BF16,
        lens: vec![700, 513, 2],
        m: 48,
        blocks: 100,
    }
    .check(93);
}

fn expect_index_error(case: &Case, args: &[Arg], needle: &str) {
    let err = run_err(&case.op(), args);
    assert!(matches!(err, KernelError::Index { .. }), "{err}");
    assert!(err.to_string().contains(needle), "{err}");
}

#[test]
fn context_shorter_than_the_query_is_refused() {
    let case = Case {
        a: attn(2, 1, 16, 4),
        dtype: DType::F32,
        lens: vec![8, 8],
        m: 1,
        blocks: 2,
    };
    let (mut args, _) = case.args(&mut Rng::new(94));
    args[4] = ints(&[2], &[8, 3]);
    expect_index_error(
        &case,
        &args,
        "context length 3 of sequence 1 is shorter than the query length 4",
    );
}

#[test]
fn context_beyond_the_block_table_is_refused() {
    let case = Case {
        a: attn(2, 1, 16, 1),
        dtype: DType::F32,
        lens: vec![32],
        m: 2,
        blocks: 4,
    };
    let (mut args, _) = case.args(&mut Rng::new(95));
    args[4] = ints(&[1], &[33]);
    expect_index_error(&case, &args, "needs 3 blocks");
}

#[test]
fn block_table_entries_outside_the_cache_are_refused() {
    let case = Case {
        a: attn(2, 1, 16, 1),
        dtype: DType::F32,
        lens: vec![20],
        m: 2,
        blocks: 3,
    };
    for bad in [3, -1, 1000] {
        let (mut args, mut tables) = case.args(&mut Rng::new(96));
        tables[1] = bad;
        args[3] = ints(&[1, 2], &tables);
        expect_index_error(
            &case,
            &args,
            &format!("block table entry {bad} (sequence 0, block 1)"),
        );
    }
}

#[test]
fn table_entries_past_the_context_are_ignored() {
    let case = Case {
        a: attn(2, 1, 16, 1),
        dtype: DType::F32,
        lens: vec![17],
        m: 4,
        blocks: 3,
    };
    let (mut args, mut tables) = case.args(&mut Rng::new(97));
    tables[2] = 999;
    tables[3] = -7;
    args[3] = ints(&[1, 4], &tables);
    run(&case.op(), &args);
}

#[test]
fn zero_window_is_refused() {
    let mut a = attn(2, 1, 16, 1);
    a.window = Some(0);
    let case = Case {
        a,
        dtype: DType::F32,
        lens: vec![4],
        m: 1,
        blocks: 1,
    };
    let (args, _) = case.args(&mut Rng::new(98));
    let err = run_err(&case.op(), &args);
    assert!(err.to_string().contains("window 0"), "{err}");
}
