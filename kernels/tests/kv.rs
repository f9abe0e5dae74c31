//! `kv_write` and the fused `qkv_rope_kv_write`: rows land in the right
//! slots and nowhere else, bad slots are refused before any write, and the
//! fused op equals `head_rms_norm -> rope -> kv_write` bit for bit.

mod common;

use common::*;
use kiln_ir::{AttnAttrs, DType, Op, Rope, RopeScaling, TensorType};
use kiln_kernels::cpu::KernelError;

/// Random k, v, distinct scattered slots and random caches.
fn kv_case(
    dtype: DType,
    t: usize,
    width: usize,
    slots: usize,
    seed: u64,
) -> (Arg, Arg, Vec<i32>, Arg, Arg) {
    let mut rng = Rng::new(seed);
    let k = float(
        dtype,
        &[t as u32, width as u32],
        &rng.vec(t * width, -2.0, 2.0),
    );
    let v = float(
        dtype,
        &[t as u32, width as u32],
        &rng.vec(t * width, -2.0, 2.0),
    );
    let mut all: Vec<i32> = (0..slots as i32).collect();
    rng.shuffle(&mut all);
    let chosen = all[..t].to_vec();
    let kc = float(
        dtype,
        &[slots as u32, width as u32],
        &rng.vec(slots * width, -2.0, 2.0),
    );
    let vc = float(
        dtype,
        &[slots as u32, width as u32],
        &rng.vec(slots * width, -2.0, 2.0),
    );
    (k, v, chosen, kc, vc)
}

#[test]
fn kv_write_puts_each_row_in_its_slot_and_leaves_the_rest() {
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let (t, width, slots) = (7, 2 * 16, 40);
        let (k, v, chosen, kc, vc) = kv_case(dtype, t, width, slots, 50);
        let got = run(
            &Op::KvWrite,
            &[
                k.clone(),
                v.clone(),
                ints(&[t as u32], &chosen),
                kc.clone(),
                vc.clone(),
            ],
        );
        let es = dtype.size() * width;
        for (src, cache, out) in [(&k, &kc, &got[0]), (&v, &vc, &got[1])] {
            for s in 0..slots {
                let row = &out[s * es..(s + 1) * es];
                match chosen.iter().position(|&c| c as usize == s) {
                    Some(t) => assert_eq!(row, &src.1[t * es..(t + 1) * es], "slot {s}"),
                    None => assert_eq!(row, &cache.1[s * es..(s + 1) * es], "untouched slot {s}"),
                }
            }
        }
    }
}

#[test]
fn kv_write_in_place_updates_the_cache_buffers_themselves() {
    let (t, width, slots) = (3, 8, 16);
    let (k, v, chosen, kc, vc) = kv_case(DType::BF16, t, width, slots, 51);
    let expected = run(
        &Op::KvWrite,
        &[
            k.clone(),
            v.clone(),
            ints(&[t as u32], &chosen),
            kc.clone(),
            vc.clone(),
        ],
    );
    let (kb, vb, sb, kcb, vcb) = (
        Owned::new(&k),
        Owned::new(&v),
        Owned::new(&ints(&[t as u32], &chosen)),
        Owned::new(&kc),
        Owned::new(&vc),
    );
    exec(
        &Op::KvWrite,
        &[kb.raw(), vb.raw(), sb.raw(), kcb.raw(), vcb.raw()],
        &[kcb.raw(), vcb.raw()],
    )
    .unwrap();
    assert_eq!(kcb.bytes(), expected[0]);
    assert_eq!(vcb.bytes(), expected[1]);
}

#[test]
fn kv_write_refuses_out_of_range_slots_and_writes_nothing() {
    let (t, width, slots) = (4, 8, 16);
    let (k, v, _, kc, vc) = kv_case(DType::F32, t, width, slots, 52);
    for bad in [
        vec![0, 3, 16, 5],
        vec![1, -1, 2, 3],
        vec![2, 3, 4, i32::MAX],
    ] {
        let (kb, vb, sb, kcb, vcb) = (
            Owned::new(&k),
            Owned::new(&v),
            Owned::new(&ints(&[t as u32], &bad)),
            Owned::new(&kc),
            Owned::new(&vc),
        );
        let err = exec(
            &Op::KvWrite,
            &[kb.raw(), vb.raw(), sb.raw(), kcb.raw(), vcb.raw()],
            &[kcb.raw(), vcb.raw()],
        )
        .unwrap_err();
        assert!(matches!(err, KernelError::Index { .. }), "{err}");
        assert!(err.to_string().contains("slot"), "{err}");
        assert_eq!(kcb.bytes(), kc.1, "k cache modified despite the error");
        assert_eq!(vcb.bytes(), vc.1, "v cache modified despite the error");
    }
}

struct Fused {
    heads: u32,
    kv_heads: u32,
    hd: u32,
    qk_norm: Option<f32>,
    unit_offset: bool,
}

fn rope() -> Rope {
    Rope {
        theta: 1_000_000.0,
        scaling: RopeScaling::None,
    }
}

/// Runs the fused op and the unfused sequence on the same inputs.
fn fused_vs_unfused(dtype: DType, f: &Fused, t: u32, slots: u32, seed: u64) {
    let mut rng = Rng::new(seed);
    let (qw, kw) = (f.heads * f.hd, f.kv_heads * f.hd);
    let width = qw + 2 * kw;
    let qkv_vals = rng.vec((t * width) as usize, -3.0, 3.0);
    let qkv = float(dtype, &[t, width], &qkv_vals);
    let positions: Vec<i32> = (0..t).map(|_| rng.below(5000) as i32).collect();
    let mut all: Vec<i32> = (0..slots as i32).collect();
    rng.shuffle(&mut all);
    let chosen = all[..t as usize].to_vec();
    let kc = float(
        dtype,
        &[slots, kw],
        &rng.vec((slots * kw) as usize, -1.0, 1.0),
    );
    let vc = float(
        dtype,
        &[slots, kw],
        &rng.vec((slots * kw) as usize, -1.0, 1.0),
    );
    let qn = float(dtype, &[f.hd], &rng.vec(f.hd as usize, -1.0, 1.0));
    let kn = float(dtype, &[f.hd], &rng.vec(f.hd as usize, -1.0, 1.0));
    let pos = ints(&[t], &positions);
    let sl = ints(&[t], &chosen);

    let op = Op::QkvRopeKvWrite {
        heads: f.heads,
        kv_heads: f.kv_heads,
        head_dim: f.hd,
        rope: rope(),
        qk_norm: f.qk_norm,
        unit_offset: f.unit_offset,
    };
    let mut args = vec![qkv.clone(), pos.clone(), sl.clone(), kc.clone(), vc.clone()];
    if f.qk_norm.is_some() {
        args.push(qn.clone());
        args.push(kn.clone());
    }
    let fused = run(&op, &args);

    // Unfused: split the packed rows (bit copies), then the plain ops.
    let es = dtype.size();
    let split = |lo: u32, w: u32| -> Arg {
        let mut bytes = Vec::new();
        for r in 0..t {
            let start = ((r * width + lo) as usize) * es;
            bytes.extend_from_slice(&qkv.1[start..start + w as usize * es]);
        }
        (TensorType::new(dtype, vec![t, w]), bytes)
    };
    let (mut q, mut k, v) = (split(0, qw), split(qw, kw), split(qw + kw, kw));
    if let Some(eps) = f.qk_norm {
        for (x, w, heads) in [(&mut q, &qn, f.heads), (&mut k, &kn, f.kv_heads)] {
            let hn = Op::HeadRmsNorm {
                heads,
                head_dim: f.hd,
                eps,
                unit_offset: f.unit_offset,
            };
            x.1 = run(&hn, &[x.clone(), w.clone()]).remove(0);
        }
    }
    for (x, heads) in [(&mut q, f.heads), (&mut k, f.kv_heads)] {
        let r = Op::Rope {
            heads,
            head_dim: f.hd,
            rope: rope(),
        };
        x.1 = run(&r, &[x.clone(), pos.clone()]).remove(0);
    }
    let caches = run(&Op::KvWrite, &[k, v, sl, kc.clone(), vc]);
    let what = format!(
        "{dtype} heads {}/{} norm {:?}",
        f.heads, f.kv_heads, f.qk_norm
    );
    assert_eq!(fused[0], q.1, "q: {what}");
    assert_eq!(fused[1], caches[0], "k cache: {what}");
    assert_eq!(fused[2], caches[1], "v cache: {what}");
    assert_ne!(fused[1], kc.1, "the fused op wrote nothing: {what}");
}

#[test]
fn fused_qkv_rope_kv_write_equals_norm_rope_kv_write_bit_for_bit() {
    let mut seed = 60;
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for qk_norm in [None, Some(1e-6)] {
            for unit_offset in [false, true] {
                for &(heads, kv_heads, hd, t) in &[(6, 2, 16, 3), (9, 3, 64, 1), (4, 4, 8, 7)] {
                    seed += 1;
                    let f = Fused {
                        heads,
                        kv_heads,
                        hd,
                        qk_norm,
                        unit_offset,
                    };
                    fused_vs_unfused(dtype, &f, t, 32, seed);
                }
            }
        }
    }
}

#[test]
fn fused_qkv_rope_kv_write_refuses_bad_slots_before_writing() {
    let (t, heads, kvh, hd, slots) = (3u32, 2u32, 1u32, 8u32, 8u32);
    let mut rng = Rng::new(70);
    let qkv = float(
        DType::BF16,
        &[t, (heads + 2 * kvh) * hd],
        &rng.vec(((heads + 2 * kvh) * hd * t) as usize, -1.0, 1.0),
    );
    let kc = float(
        DType::BF16,
        &[slots, kvh * hd],
        &rng.vec((slots * kvh * hd) as usize, -1.0, 1.0),
    );
    let vc = kc.clone();
    let op = Op::QkvRopeKvWrite {
        heads,
        kv_heads: kvh,
        head_dim: hd,
        rope: rope(),
        qk_norm: None,
        unit_offset: false,
    };
    let bufs: Vec<Owned> = [
        qkv,
        ints(&[t], &[0, 1, 2]),
        ints(&[t], &[0, 8, 1]),
        kc.clone(),
        vc.clone(),
    ]
    .iter()
    .map(Owned::new)
    .collect();
    let q = Owned::zeroed(TensorType::new(DType::BF16, vec![t, heads * hd]));
    let args: Vec<_> = bufs.iter().map(|b| b.raw()).collect();
    let err = exec(&op, &args, &[q.raw(), bufs[3].raw(), bufs[4].raw()]).unwrap_err();
    assert!(matches!(err, KernelError::Index { .. }), "{err}");
    assert!(err.to_string().contains("slot 8 of token 1"), "{err}");
    assert_eq!(bufs[3].bytes(), kc.1);
    assert_eq!(bufs[4].bytes(), vc.1);
}

/// One paged decode step of `rope_attention`: `b` sequences of `q` new
/// tokens each, contexts `lens`, blocks of `bs` slots dealt out shuffled.
struct PagedCase {
    qkv: Arg,
    pos: Arg,
    slots: Arg,
    kc: Arg,
    vc: Arg,
    tables: Arg,
    lens: Arg,
    qn: Arg,
    kn: Arg,
}

fn paged_case(dtype: DType, f: &Fused, q: u32, bs: u32, lens: &[i32], seed: u64) -> PagedCase {
    let mut rng = Rng::new(seed);
    let b = lens.len() as u32;
    let m = lens
        .iter()
        .map(|&l| (l as u32).div_ceil(bs))
        .max()
        .unwrap_or(1)
        + 1;
    let nslots = b * m * bs;
    let kw = f.kv_heads * f.hd;
    let width = (f.heads + 2 * f.kv_heads) * f.hd;
    let t = b * q;
    let mut blocks: Vec<i32> = (0..(b * m) as i32).collect();
    rng.shuffle(&mut blocks);
    let (mut positions, mut slots) = (vec![], vec![]);
    for (s, &len) in lens.iter().enumerate() {
        for qi in 0..q as i32 {
            let p = len - q as i32 + qi;
            positions.push(p);
            let blk = blocks[s * m as usize + (p as u32 / bs) as usize];
            slots.push(blk * bs as i32 + p % bs as i32);
        }
    }
    PagedCase {
        qkv: float(
            dtype,
            &[t, width],
            &rng.vec((t * width) as usize, -3.0, 3.0),
        ),
        pos: ints(&[t], &positions),
        slots: ints(&[t], &slots),
        kc: float(
            dtype,
            &[nslots, kw],
            &rng.vec((nslots * kw) as usize, -1.0, 1.0),
        ),
        vc: float(
            dtype,
            &[nslots, kw],
            &rng.vec((nslots * kw) as usize, -1.0, 1.0),
        ),
        tables: ints(&[b, m], &blocks),
        lens: ints(&[b], lens),
        qn: float(dtype, &[f.hd], &rng.vec(f.hd as usize, -1.0, 1.0)),
        kn: float(dtype, &[f.hd], &rng.vec(f.hd as usize, -1.0, 1.0)),
    }
}

fn rope_attention_op(f: &Fused, q: u32, bs: u32, window: Option<u32>, softcap: Option<f32>) -> Op {
    Op::RopeAttention {
        attn: AttnAttrs {
            heads: f.heads,
            kv_heads: f.kv_heads,
            head_dim: f.hd,
            query: q,
            block_size: bs,
            scale: 1.0 / (f.hd as f32).sqrt(),
            window,
            softcap,
        },
        rope: rope(),
        qk_norm: f.qk_norm,
        unit_offset: f.unit_offset,
    }
}

#[test]
fn rope_attention_equals_qkv_rope_kv_write_then_paged_attention_bit_for_bit() {
    let mut seed = 900;
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for qk_norm in [None, Some(1e-6)] {
            for &(heads, kv_heads, hd, q, window, softcap) in &[
                (4u32, 2u32, 16u32, 1u32, None, None),
                (6, 2, 8, 3, Some(4u32), Some(30.0f32)),
                (3, 3, 32, 2, None, None),
            ] {
                seed += 1;
                let f = Fused {
                    heads,
                    kv_heads,
                    hd,
                    qk_norm,
                    unit_offset: seed % 2 == 0,
                };
                let bs = 4;
                let c = paged_case(dtype, &f, q, bs, &[q as i32 + 2, 11], seed);
                let op = rope_attention_op(&f, q, bs, window, softcap);
                let mut args = vec![
                    c.qkv.clone(),
                    c.pos.clone(),
                    c.slots.clone(),
                    c.kc.clone(),
                    c.vc.clone(),
                    c.tables.clone(),
                    c.lens.clone(),
                ];
                if qk_norm.is_some() {
                    args.push(c.qn.clone());
                    args.push(c.kn.clone());
                }
                let fused = run(&op, &args);
                let (rope_op, attn_op) = op.split_rope_attention().unwrap();
                let mut rargs = vec![c.qkv.clone(), c.pos.clone(), c.slots.clone(), c.kc.clone()];
                rargs.push(c.vc.clone());
                if qk_norm.is_some() {
                    rargs.push(c.qn.clone());
                    rargs.push(c.kn.clone());
                }
                let r = run(&rope_op, &rargs);
                let t = c.qkv.0.shape.dims()[0];
                let q_arg = (TensorType::new(dtype, vec![t, heads * hd]), r[0].clone());
                let kc2 = (c.kc.0.clone(), r[1].clone());
                let vc2 = (c.vc.0.clone(), r[2].clone());
                let a = run(
                    &attn_op,
                    &[q_arg, kc2, vc2, c.tables.clone(), c.lens.clone()],
                );
                let what = format!("{dtype} {heads}/{kv_heads}x{hd} q {q} norm {qk_norm:?}");
                assert_eq!(fused[0], a[0], "output: {what}");
                assert_eq!(fused[1], r[1], "k cache: {what}");
                assert_eq!(fused[2], r[2], "v cache: {what}");
                assert_ne!(fused[1], c.kc.1, "the new keys were not written: {what}");
                assert!(fused[0].iter().any(|&x| x != 0), "zero output: {what}");
            }
        }
    }
}

#[test]
fn rope_attention_refuses_a_bad_slot_before_writing_a_cache() {
    let f = Fused {
        heads: 2,
        kv_heads: 1,
        hd: 8,
        qk_norm: None,
        unit_offset: false,
    };
    let c = paged_case(DType::BF16, &f, 1, 4, &[3, 6], 950);
    let nslots = c.kc.0.shape.dims()[0] as i32;
    let op = rope_attention_op(&f, 1, 4, None, None);
    let bad = ints(&[2], &[0, nslots]);
    let err = run_err(
        &op,
        &[
            c.qkv,
            c.pos,
            bad,
            c.kc.clone(),
            c.vc.clone(),
            c.tables,
            c.lens,
        ],
    );
    assert!(matches!(err, KernelError::Index { .. }), "{err}");
    assert!(err.to_string().contains("of token 1"), "{err}");
}
