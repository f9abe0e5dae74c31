//! `fused_matmul` on the CPU: it is defined as the unfused sequence
//! (`rms_norm` -> `matmul` -> `silu_mul` / `gelu_tanh_mul` / `add`), so it
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

fn op_of(c: &Case) -> Op {
    Op::FusedMatMul {
        bias: c.bias,
        out: c.dtype,
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
    let d = c.dtype;
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
        out: d,
    };
    let y = (TensorType::new(d, vec![t, n]), run(&mm, &margs).remove(0));
    match c.post {
        Epilogue::None => y.1,
        Epilogue::SiluMul => run(&Op::SiluMul, &[y]).remove(0),
        Epilogue::GeluTanhMul => run(&Op::GeluTanhMul, &[y]).remove(0),
        Epilogue::Residual => {
            let r = i.residual.clone().expect("a residual case has a residual");
            run(&Op::Add, &[y, r]).remove(0)
        }
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
    assert_eq!(all.len(), 3 * 5 * 4 * 2);
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
                m * (pre + k as f64 * F32_U) + ulp(d, *v) + 1e-30
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
