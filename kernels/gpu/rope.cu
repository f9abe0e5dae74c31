// Rotary embedding, KV-cache writes, and the fused qkv_rope_kv_write.
//
// RoPE is the rotate-half convention over the full head: for i < hd/2,
//   out[i]        = x[i] * cos(a) - x[i + hd/2] * sin(a)
//   out[i + hd/2] = x[i + hd/2] * cos(a) + x[i] * sin(a)
// with a = (float)pos * inv_freq[i], inv_freq rounded to f32 from the plan's
// f64 table and passed by value (a constant of the captured launch, not a
// per-step value). sin/cos are the accurate f32 functions, not intrinsics.
// Positions, slots and caches are read from device memory.
#include "kiln_port.h"

// RopeFreqs and the per-head norm + RoPE (kiln_rope_head) are in
// kiln_port.h: attention.cu's rope_attention runs the same arithmetic.

// One thread per (token, head, pair). In place is safe: a thread reads both
// elements of its pair before writing them.
template <typename T>
KILN_DEV void rope_pairs(const T* x, const int* __restrict__ pos, T* out, int tokens, int heads,
                         int hd, const RopeFreqs& fr) {
  KILN_PROLOGUE();
  const int half = hd / 2;
  const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const i64 total = (i64)tokens * heads * half;
  if (idx >= total) return;
  const int i = (int)(idx % half);
  const i64 th = idx / half;  // token * heads + head
  const int t = (int)(th / heads);
  const float a = (float)pos[t] * fr.f[i];
  const float c = cosf(a), s = sinf(a);
  const i64 base = th * hd;
  const float x1 = ld(x[base + i]), x2 = ld(x[base + i + half]);
  out[base + i] = st<T>(x1 * c - x2 * s);
  out[base + i + half] = st<T>(x2 * c + x1 * s);
}

// Row t of k/v goes to slot slots[t] of the caches (row = kvh*hd elements).
// Slots outside [0, num_slots) are skipped rather than written out of bounds.
template <typename T>
KILN_DEV void kv_write_rows(const T* __restrict__ k, const T* __restrict__ v,
                            const int* __restrict__ slots, T* kc, T* vc, int row, i64 num_slots) {
  KILN_PROLOGUE();
  const i64 t = blockIdx.x;
  const i64 slot = slots[t];
  if (slot < 0 || slot >= num_slots) return;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    kc[slot * row + i] = k[t * row + i];
    vc[slot * row + i] = v[t * row + i];
  }
}

// One warp per (token, unit): units [0, heads) are q heads, [heads, heads+kvh)
// k heads, [heads+kvh, heads+2kvh) v heads. Lane l holds the pairs
// (i, i + hd/2) for i = l, l+32, ... so RMSNorm and RoPE need no exchange but
// one warp sum. q/k: optional per-head RMSNorm (rounded to T) then RoPE,
// rounded once; v: copied. q goes to q_out, k/v to their cache slot.
template <typename T>
KILN_DEV void qkv_rope_kv_write_units(const T* __restrict__ qkv, const int* __restrict__ pos,
                                      const int* __restrict__ slots, T* kc, T* vc,
                                      const T* __restrict__ qn, const T* __restrict__ kn,
                                      T* __restrict__ q_out, int tokens, int heads, int kvh, int hd,
                                      float eps, int has_norm, int unit_offset, i64 num_slots,
                                      const RopeFreqs& fr) {
  KILN_PROLOGUE();
  const int lane = threadIdx.x % KILN_WARP;
  const int units = heads + 2 * kvh;
  const i64 w = (i64)blockIdx.x * (blockDim.x / KILN_WARP) + threadIdx.x / KILN_WARP;
  if (w >= (i64)tokens * units) return;
  const int t = (int)(w / units);
  const int u = (int)(w % units);
  const T* src = qkv + (i64)t * units * hd + (i64)u * hd;
  const i64 kvrow = (i64)kvh * hd;
  if (u >= heads + kvh) {  // v head: plain copy into the cache
    const i64 slot = slots[t];
    if (slot < 0 || slot >= num_slots) return;
    T* dst = vc + slot * kvrow + (i64)(u - heads - kvh) * hd;
    for (int i = lane; i < hd; i += KILN_WARP) dst[i] = src[i];
    return;
  }
  const bool is_q = u < heads;
  T* dst;
  if (is_q) {
    dst = q_out + (i64)t * heads * hd + (i64)u * hd;
  } else {
    const i64 slot = slots[t];
    if (slot < 0 || slot >= num_slots) return;
    dst = kc + slot * kvrow + (i64)(u - heads) * hd;
  }
  kiln_rope_head<T>(src, hd, is_q ? qn : kn, has_norm, eps, unit_offset, (float)pos[t], fr,
                    [&](int i, T v) { dst[i] = v; });
}

#define KILN_ROPE_ENTRIES(T, S)                                                                \
  KILN_GLOBAL void rope_##S(const T* x, const int* pos, T* out, int tokens, int heads, int hd, \
                            RopeFreqs fr) {                                                   \
    rope_pairs<T>(x, pos, out, tokens, heads, hd, fr);                                        \
  }                                                                                           \
  KILN_GLOBAL void kv_write_##S(const T* k, const T* v, const int* slots, T* kc, T* vc,       \
                                int row, i64 num_slots) {                                     \
    kv_write_rows<T>(k, v, slots, kc, vc, row, num_slots);                                    \
  }                                                                                           \
  KILN_GLOBAL void qkv_rope_kv_write_##S(                                                     \
      const T* qkv, const int* pos, const int* slots, T* kc, T* vc, const T* qn, const T* kn, \
      T* q_out, int tokens, int heads, int kvh, int hd, float eps, int has_norm,              \
      int unit_offset, i64 num_slots, RopeFreqs fr) {                                         \
    qkv_rope_kv_write_units<T>(qkv, pos, slots, kc, vc, qn, kn, q_out, tokens, heads, kvh,    \
                               hd, eps, has_norm, unit_offset, num_slots, fr);               \
  }
KILN_FOR_FLOATS(KILN_ROPE_ENTRIES)
