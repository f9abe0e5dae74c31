//! `fused_matmul` on the CPU: it is defined as the unfused sequence
//! (`rms_norm` -> `matmul` -> `silu_mul` / `gelu_tanh_mul` / `add` /
//! `argmax`), so it
//! must give the very bytes the unfused ops give, at awkward sizes and for
//! every combination of bias, prologue and epilogue; and it must agree with
//! an f64 reference of its typing rule written from `kiln_ir::op` alone.
//!
//! Tolerance of the f64 comparison: each stored intermediate (the normed
//! rows, the product) carries half an ulp of D, which the dot product
//! spreads over `sum |x_n * w|`, plus f32 accumulation (`k * 2^-24` of that
//! sum) and the final rounding (one ulp).

mod common;

use common::reference;
use common::*;
use kiln_ir::{DType, Epilogue, Op, PreNorm, TensorType};

type Arg = (TensorType, Vec<u8>);

struct Case {
    dtype: DType,
    t: u32,
    k: u32,
    n: u32,
    bias: bool,
    pre: Option<PreNorm>,
    post: Epilogue,
}

struct Inputs {
    x: Arg,
    w: Arg,
    bias: Option<Arg>,
    norm: Option<Arg>,
    residual: Option<Arg>,
}

fn inputs(rng: &mut Rng, c: &Case) -> Inputs {
    let d = c.dtype;
    let (t, k, n) = (c.t, c.k, c.n);
    Inputs {
        x: float(d, &[t, k], &rng.vec((t * k) as usize, -2.0, 2.0)),
        w: float(d, &[n, k], &rng.vec((n * k) as usize, -0.3, 0.3)),
        bias: c
            .bias
            .then(|| float(d, &[n], &rng.vec(n as usize, -0.5, 0.5))),
        norm: c
            .pre
            .map(|_| float(d, &[k], &rng.vec(k as usize, -1.5, 1.5))),
        residual: (c.post == Epilogue::Residual)
            .then(|| float(d, &[t, n], &rng.vec((t * n) as usize, -4.0, 4.0))),
    }
}

/// The result dtype of the product: f32 logits for the argmax epilogue
/// (the lm_head's), the activations' otherwise.
fn out_of(c: &Case) -> DType {
    if c.post == Epilogue::Argmax {
        DType::F32
    } else {
        c.dtype
    }
}

fn op_of(c: &Case) -> Op {
    Op::FusedMatMul {
        bias: c.bias,
        out: out_of(c),
        pre: c.pre,
        post: c.post,
    }
}

fn fused_args(i: &Inputs) -> Vec<Arg> {
    let mut a = vec![i.x.clone(), i.w.clone()];
    a.extend(i.bias.iter().cloned());
    a.extend(i.norm.iter().cloned());
    a.extend(i.residual.iter().cloned());
    a
}

/// The unfused ops, one `execute` each.
fn unfused(c: &Case, i: &Inputs) -> Vec<u8> {
    let (t, n) = (c.t, c.n);
    let x = match (c.pre, &i.norm) {
        (Some(p), Some(w)) => {
            let op = Op::RmsNorm {
                eps: p.eps,
                unit_offset: p.unit_offset,
            };
            let y = run(&op, &[i.x.clone(), w.clone()]).remove(0);
            (i.x.0.clone(), y)
        }
        _ => i.x.clone(),
    };
    let mut margs = vec![x, i.w.clone()];
    margs.extend(i.bias.iter().cloned());
    let mm = Op::MatMul {
        bias: c.bias,
        out: out_of(c),
    };
    let y = (
        TensorType::new(out_of(c), vec![t, n]),
        run(&mm, &margs).remove(0),
    );
    match c.post {
        Epilogue::None => y.1,
        Epilogue::SiluMul => run(&Op::SiluMul, &[y]).remove(0),
        Epilogue::GeluTanhMul => run(&Op::GeluTanhMul, &[y]).remove(0),
        Epilogue::Residual => {
            let r = i.residual.clone().expect("a residual case has a residual");
            run(&Op::Add, &[y, r]).remove(0)
        }
        Epilogue::Argmax => run(&Op::Argmax, &[y]).remove(0),
    }
}

fn cases(rng: &mut Rng) -> Vec<Case> {
    let mut v = Vec::new();
    // Awkward sizes: K not a multiple of 8 or 16, N odd or just past a
    // block, T from 1 to past the GPU's fused limit.
    let shapes = [
        (1, 72, 10),
        (3, 136, 34),
        (5, 1000, 6),
        (8, 40, 130),
        (11, 24, 2),
    ];
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (si, &(t, k, n)) in shapes.iter().enumerate() {
            for post in Epilogue::ALL {
                for pre in [false, true] {
                    v.push(Case {
                        dtype,
                        t,
                        k,
                        n,
                        bias: (si + pre as usize).is_multiple_of(2),
                        pre: pre.then(|| PreNorm {
                            eps: [1e-6, 1e-5, 0.1][rng.below(3)],
                            unit_offset: rng.below(2) == 1,
                        }),
                        post,
                    });
                }
            }
        }
    }
    v
}

#[test]
fn fused_matmul_gives_the_bytes_of_the_unfused_ops_in_sequence() {
    let mut rng = Rng::new(1500);
    let all = cases(&mut rng);
    assert_eq!(all.len(), 3 * 5 * 5 * 2);
    for c in &all {
        let i = inputs(&mut rng, c);
        let got = run(&op_of(c), &fused_args(&i)).remove(0);
        let want = unfused(c, &i);
        assert_eq!(
            got,
            want,
            "{} t{} k{} n{} bias {} pre {:?} {}",
            c.dtype,
            c.t,
            c.k,
            c.n,
            c.bias,
            c.pre,
            c.post.name()
        );
    }
}

#[test]
fn fused_matmul_agrees_with_an_f64_reference_of_its_typing_rule() {
    let mut rng = Rng::new(1501);
    for c in cases(&mut rng) {
        let i = inputs(&mut rng, &c);
        let got = run(&op_of(&c), &fused_args(&i)).remove(0);
        let (t, k, n) = (c.t as usize, c.k as usize, c.n as usize);
        let d = c.dtype;
        let od = out_of(&c);
        let half_ulp = ulp(d, 1.0) / 2.0;
        let mut x = stored(&i.x);
        if let (Some(p), Some(w)) = (c.pre, &i.norm) {
            let w = stored(w);
            x = x
                .chunks(k)
                .flat_map(|row| reference::rms_norm(row, &w, p.eps as f64, p.unit_offset))
                .collect();
        }
        let bias = i.bias.as_ref().map(stored);
        let (y, mag) = reference::matmul(&x, &stored(&i.w), bias.as_deref(), t, k, n);
        // Error of one product element as the fused op stores it.
        let ytol: Vec<f64> = y
            .iter()
            .zip(&mag)
            .map(|(v, m)| {
                let pre = if c.pre.is_some() { 2.0 * half_ulp } else { 0.0 };
                m * (pre + k as f64 * F32_U) + ulp(od, *v) + 1e-30
            })
            .collect();
        let what = format!(
            "{d} t{t} k{k} n{n} bias {} pre {:?} {}",
            c.bias,
            c.pre,
            c.post.name()
        );
        match c.post {
            Epilogue::None => assert_close_each(&what, d, &got, &y, 0.0, &ytol),
            Epilogue::Residual => {
                let r = stored(i.residual.as_ref().unwrap());
                let want: Vec<f64> = y.iter().zip(&r).map(|(a, b)| a + b).collect();
                let tol: Vec<f64> = ytol
                    .iter()
                    .zip(&want)
                    .map(|(e, w)| e + ulp(d, *w))
                    .collect();
                assert_close_each(&what, d, &got, &want, 1.0, &tol);
            }
            Epilogue::SiluMul | Epilogue::GeluTanhMul => {
                let f = if c.post == Epilogue::SiluMul {
                    reference::silu
                } else {
                    reference::gelu_tanh
                };
                let h = n / 2;
                let mut want = Vec::with_capacity(t * h);
                let mut tol = Vec::with_capacity(t * h);
                for r in 0..t {
                    for j in 0..h {
                        let (g, u) = (y[r * n + j], y[r * n + h + j]);
                        let (eg, eu) = (ytol[r * n + j], ytol[r * n + h + j]);
                        let v = f(g) * u;
                        want.push(v);
                        // |d(act(g) u)| <= 1.2 |u| dg + |act(g)| du (act' <= 1.13).
                        tol.push(1.2 * u.abs() * eg + f(g).abs() * eu + 2.0 * ulp(d, v) + 1e-30);
                    }
                }
                assert_close_each(&what, d, &got, &want, 1.0, &tol);
            }
            Epilogue::Argmax => {
                // The pick is a maximum of the exact products up to the
                // error of the two stored logits compared.
                for r in 0..t {
                    let at = i32::from_le_bytes(got[4 * r..4 * r + 4].try_into().unwrap());
                    assert!((0..n as i32).contains(&at), "{what}: index {at}");
                    let row = &y[r * n..(r + 1) * n];
                    let (best, _) =
                        row.iter()
                            .enumerate()
                            .fold(
                                (f64::NEG_INFINITY, 0),
                                |(b, bi), (j, &v)| {
                                    if v > b {
                                        (v, j)
                                    } else {
                                        (b, bi)
                                    }
                                },
                            );
                    let j = at as usize;
                    let slack = 2.0
                        * ytol
                            .iter()
                            .skip(r * n)
                            .take(n)
                            .fold(0.0f64, |a, &e| a.max(e));
                    assert!(
                        row[j] >= best - slack,
                        "{what}: row {r} picks {j} ({} < {best} - {slack})",
                        row[j]
                    );
                }
            }
        }
    }
}

/// `fused_matmul{argmax}` with ties and NaN logits: duplicated weight rows
/// tie, and the first of them wins; a NaN bias makes that logit NaN, which
/// never wins; a row of only NaN logits gives 0; all as `argmax` of the
/// stored logits, and as the f32 products say independently.
#[test]
fn the_argmax_epilogue_picks_the_first_maximum_and_skips_nan_logits() {
    let mut rng = Rng::new(1502);
    let d = DType::BF16;
    let (t, k, n) = (3u32, 24u32, 40u32);
    for trial in 0..6 {
        // x > 0.2 and rows a < b equal and > 0.5, every other weight
        // below 0.05 in magnitude: rows a and b tie at every token's
        // maximum (>= 2.4 against at most 1.2).
        let xv = rng.vec((t * k) as usize, 0.2, 1.0);
        let mut wv = rng.vec((n * k) as usize, -0.05, 0.05);
        let a = rng.below(n as usize / 2);
        let b = a + 1 + rng.below(n as usize / 2);
        let row_a = rng.vec(k as usize, 0.5, 1.0);
        wv[a * k as usize..(a + 1) * k as usize].copy_from_slice(&row_a);
        wv[b * k as usize..(b + 1) * k as usize].copy_from_slice(&row_a);
        let mut bias = vec![0.0f32; n as usize];
        // A NaN logit at a random row (not a or b), every other trial all NaN.
        let all_nan = trial % 3 == 2;
        let nan_at = rng.below(n as usize);
        if all_nan {
            bias.iter_mut().for_each(|v| *v = f32::NAN);
        } else if nan_at != a && nan_at != b {
            bias[nan_at] = f32::NAN;
        }
        let args = vec![
            float(d, &[t, k], &xv),
            float(d, &[n, k], &wv),
            float(d, &[n], &bias),
        ];
        let op = Op::FusedMatMul {
            bias: true,
            out: DType::F32,
            pre: None,
            post: Epilogue::Argmax,
        };
        let got = run(&op, &args).remove(0);
        let picks: Vec<i32> = got
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        // Independently: the f32 logits from the stored bf16 operands.
        let (xs, ws) = (stored(&args[0]), stored(&args[1]));
        for r in 0..t as usize {
            let logits: Vec<f64> = (0..n as usize)
                .map(|j| {
                    let dot: f64 = (0..k as usize)
                        .map(|e| xs[r * k as usize + e] * ws[j * k as usize + e])
                        .sum();
                    dot + bias[j] as f64
                })
                .collect();
            let want = logits
                .iter()
                .enumerate()
                .filter(|(_, v)| !v.is_nan())
                .fold(None::<(usize, f64)>, |best, (j, &v)| match best {
                    Some((_, bv)) if v <= bv => best,
                    _ => Some((j, v)),
                })
                .map_or(0, |(j, _)| j);
            if all_nan {
                assert_eq!(picks[r], 0, "trial {trial} row {r}: a row of NaN gives 0");
                continue;
            }
            // Rows a and b tie exactly at the maximum; the first wins.
            assert_eq!(want, a, "trial {trial} row {r}: the construction");
            assert_eq!(picks[r] as usize, a, "trial {trial} row {r} (tie with {b})");
        }
    }
}

#[test]
fn fused_matmul_refuses_operands_outside_its_typing_rule() {
    let d = DType::BF16;
    let x = float(d, &[2, 16], &[0.5; 32]);
    let w = float(d, &[6, 16], &[0.25; 96]);
    let res = |rows, cols| float(d, &[rows, cols], &vec![1.0; (rows * cols) as usize]);
    let op = |out, post| Op::FusedMatMul {
        bias: false,
        out,
        pre: None,
        post,
    };
    // A residual of the wrong shape.
    let e = run_err(
        &op(d, Epilogue::Residual),
        &[x.clone(), w.clone(), res(2, 5)],
    );
    assert!(e.to_string().contains("residual"), "{e}");
    // An epilogue with a result dtype other than the activations'.
    let e = run_err(&op(DType::F32, Epilogue::SiluMul), &[x.clone(), w.clone()]);
    assert!(e.to_string().contains("epilogue"), "{e}");
    // A packed gate/up weight with an odd row count.
    let w5 = float(d, &[5, 16], &[0.25; 80]);
    let e = run_err(&op(d, Epilogue::GeluTanhMul), &[x.clone(), w5]);
    assert!(e.to_string().contains("even"), "{e}");
    // A missing residual operand is an arity error, not a crash.
    let e = run_err(&op(d, Epilogue::Residual), &[x, w]);
    assert!(e.to_string().contains("argument"), "{e}");
}
