//! KV cache writes: `kv_write` and the fused `qkv_rope_kv_write`.
//!
//! Both write rows into the caches in place (the results are the cache
//! buffers). Every slot is validated before the first write, so a bad slot
//! leaves the caches untouched. Rows are written in token order; two tokens
//! naming one slot leave the later token's row there on the CPU, but GPU
//! kernels write rows concurrently, so plans must never depend on it.
//!
//! The fused op splits each packed row `[q (heads*hd) | k (kvh*hd) | v
//! (kvh*hd)]` and performs, in f32 scratch with the same functions and the
//! same roundings as the unfused ops, so the results are bit-identical to
//! `head_rms_norm` (optional, rounded to D) -> `rope` (rounded to D) ->
//! `kv_write`. `v` is copied bit for bit.

use super::buf::{round_slice, Buf};
use super::norm::{load_weight, normalize};
use super::rope::RopeTable;
use super::{index_error, Result};
use kiln_ir::Op;

/// Checks every slot against the cache size before anything is written.
fn check_slots(op: &Op, slots: &[i32], cache_slots: usize) -> Result<()> {
    for (t, &s) in slots.iter().enumerate() {
        if s < 0 || s as usize >= cache_slots {
            return Err(index_error(
                op,
                format!(
                    "slot {s} of token {t} is outside the KV cache's {cache_slots} slots; every slot must be in 0..{cache_slots} (padding rows write to the reserved null slot)"
                ),
            ));
        }
    }
    Ok(())
}

/// `kv_write(k, v, slots, kc, vc) -> (kc', vc')`; `kc`/`vc` are the results.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn kv_write(
    op: &Op,
    k: Buf,
    v: Buf,
    slots: Buf,
    (_t, row): (usize, usize),
    kc: Buf,
    vc: Buf,
    cache_slots: usize,
) -> Result<()> {
    let slots = slots.ints();
    check_slots(op, slots, cache_slots)?;
    for (t, &s) in slots.iter().enumerate() {
        Buf::copy(k, t * row, kc, s as usize * row, row);
        Buf::copy(v, t * row, vc, s as usize * row, row);
    }
    Ok(())
}

/// The fused q/k norm + RoPE + KV write.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn qkv_rope_kv_write(
    op: &Op,
    qkv: Buf,
    pos: Buf,
    slots: Buf,
    norms: Option<(Buf, Buf)>,
    q_out: Buf,
    kc: Buf,
    vc: Buf,
    cache_slots: usize,
) -> Result<()> {
    let Op::QkvRopeKvWrite {
        heads,
        kv_heads,
        head_dim,
        rope,
        qk_norm,
        unit_offset,
    } = op
    else {
        unreachable!("dispatched by execute")
    };
    let slots = slots.ints();
    check_slots(op, slots, cache_slots)?;
    let positions = pos.ints();
    let hd = *head_dim as usize;
    let (qw, kw) = (*heads as usize * hd, *kv_heads as usize * hd);
    let width = qw + 2 * kw;
    let norm = match (qk_norm, norms) {
        (Some(eps), Some((qn, kn))) => Some((
            *eps,
            load_weight(qn, *unit_offset),
            load_weight(kn, *unit_offset),
        )),
        _ => None,
    };
    let mut table = RopeTable::reused(rope, *head_dim);
    let mut row = vec![0f32; qw + kw];
    for (t, (&p, &s)) in positions.iter().zip(slots).enumerate() {
        qkv.load(t * width, &mut row);
        let (q, k) = row.split_at_mut(qw);
        if let Some((eps, qn, kn)) = &norm {
            for head in q.chunks_exact_mut(hd) {
                normalize(head, qn, *eps);
            }
            for head in k.chunks_exact_mut(hd) {
                normalize(head, kn, *eps);
            }
            round_slice(qkv.dtype, &mut row);
        }
        table.at(p);
        table.rotate_heads(&mut row, hd);
        let (q, k) = row.split_at(qw);
        q_out.store(t * qw, q);
        kc.store(s as usize * kw, k);
        Buf::copy(qkv, t * width + qw + kw, vc, s as usize * kw, kw);
    }
    table.keep();
    Ok(())
}
