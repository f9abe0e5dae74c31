// RMSNorm family: rms_norm, add_rms_norm, head_rms_norm.
//
// Storage is T (bf16/f16/f32); every sum is f32. A result is rounded to T
// once. add_rms_norm normalizes the ROUNDED sum (the value it stores), so the
// fused op equals add followed by rms_norm bit for bit in the inputs it sees.
#include "kiln_port.h"

template <typename T>
KILN_DEV float norm_weight(const T* w, int i, int unit_offset) {
  float v = ld(w[i]);
  return unit_offset ? 1.0f + v : v;
}

// Elements a thread keeps in registers in the row kernels; rows wider than
// blockDim.x * KILN_ROW_REGS take the two-pass path (re-reading the row).
#define KILN_ROW_REGS 8

// One block per row of `h` elements.
template <typename T>
KILN_DEV void rms_norm_row(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ out,
                           int h, float eps, int unit_offset) {
  KILN_PROLOGUE();
  __shared__ float scratch[32];
  const i64 row = blockIdx.x;
  const T* xr = x + row * h;
  T* orow = out + row * h;
  const int tid = threadIdx.x, nt = blockDim.x;
  if (h <= nt * KILN_ROW_REGS) {
    float v[KILN_ROW_REGS];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < KILN_ROW_REGS; ++j) {
      const int i = tid + j * nt;
      v[j] = i < h ? ld(xr[i]) : 0.0f;
      ss += v[j] * v[j];
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)h + eps);
#pragma unroll
    for (int j = 0; j < KILN_ROW_REGS; ++j) {
      const int i = tid + j * nt;
      if (i < h) orow[i] = st<T>(v[j] * inv * norm_weight(w, i, unit_offset));
    }
    return;
  }
  float ss = 0.0f;
  for (int i = tid; i < h; i += nt) {
    float v = ld(xr[i]);
    ss += v * v;
  }
  ss = block_sum(ss, scratch);
  const float inv = 1.0f / sqrtf(ss / (float)h + eps);
  for (int i = tid; i < h; i += nt) {
    orow[i] = st<T>(ld(xr[i]) * inv * norm_weight(w, i, unit_offset));
  }
}

// sum = round(x + residual); normed = rms_norm(sum). One block per row.
// Each thread reads, rounds and writes its own elements and only ever reads
// those back, so `sum` may alias `x` or `residual`.
template <typename T>
KILN_DEV void add_rms_norm_row(const T* x, const T* res, const T* __restrict__ w, T* normed, T* sum,
                               int h, float eps, int unit_offset) {
  KILN_PROLOGUE();
  __shared__ float scratch[32];
  const i64 row = blockIdx.x;
  const i64 base = row * h;
  const int tid = threadIdx.x, nt = blockDim.x;
  if (h <= nt * KILN_ROW_REGS) {
    // All loads first: a store to `sum` (which may alias the inputs) would
    // otherwise order every later load behind it.
    float v[KILN_ROW_REGS], r[KILN_ROW_REGS];
#pragma unroll
    for (int j = 0; j < KILN_ROW_REGS; ++j) {
      const int i = tid + j * nt;
      v[j] = i < h ? ld(x[base + i]) : 0.0f;
      r[j] = i < h ? ld(res[base + i]) : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < KILN_ROW_REGS; ++j) {
      const int i = tid + j * nt;
      const T s = st<T>(v[j] + r[j]);
      v[j] = i < h ? ld(s) : 0.0f;
      if (i < h) sum[base + i] = s;
      ss += v[j] * v[j];
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)h + eps);
#pragma unroll
    for (int j = 0; j < KILN_ROW_REGS; ++j) {
      const int i = tid + j * nt;
      if (i < h) normed[base + i] = st<T>(v[j] * inv * norm_weight(w, i, unit_offset));
    }
    return;
  }
  float ss = 0.0f;
  for (int i = tid; i < h; i += nt) {
    T s = st<T>(ld(x[base + i]) + ld(res[base + i]));
    sum[base + i] = s;
    float v = ld(s);
    ss += v * v;
  }
  ss = block_sum(ss, scratch);
  const float inv = 1.0f / sqrtf(ss / (float)h + eps);
  for (int i = tid; i < h; i += nt) {
    normed[base + i] = st<T>(ld(sum[base + i]) * inv * norm_weight(w, i, unit_offset));
  }
}

// One warp per (token, head) row of `hd` elements; `rows` = tokens * heads.
// The warp reads its whole row into registers before writing, so the result
// may alias the input.
#define KILN_HEAD_MAX_PER_LANE 16  // hd <= 512
template <typename T>
KILN_DEV void head_rms_norm_rows(const T* x, const T* __restrict__ w, T* out, int rows, int hd,
                                 float eps, int unit_offset) {
  KILN_PROLOGUE();
  const int lane = threadIdx.x % KILN_WARP;
  const i64 row = (i64)blockIdx.x * (blockDim.x / KILN_WARP) + threadIdx.x / KILN_WARP;
  if (row >= rows) return;
  const T* xr = x + row * hd;
  float v[KILN_HEAD_MAX_PER_LANE];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < KILN_HEAD_MAX_PER_LANE; ++j) {
    const int i = lane + j * KILN_WARP;
    v[j] = i < hd ? ld(xr[i]) : 0.0f;
    ss += v[j] * v[j];
  }
  ss = warp_sum(ss);
  const float inv = 1.0f / sqrtf(ss / (float)hd + eps);
  T* orow = out + row * hd;
#pragma unroll
  for (int j = 0; j < KILN_HEAD_MAX_PER_LANE; ++j) {
    const int i = lane + j * KILN_WARP;
    if (i < hd) orow[i] = st<T>(v[j] * inv * norm_weight(w, i, unit_offset));
  }
}

#define KILN_NORM_ENTRIES(T, S)                                                                 \
  KILN_GLOBAL void rms_norm_##S(const T* x, const T* w, T* out, int h, float eps,              \
                                int unit_offset) {                                             \
    rms_norm_row<T>(x, w, out, h, eps, unit_offset);                                           \
  }                                                                                            \
  KILN_GLOBAL void add_rms_norm_##S(const T* x, const T* res, const T* w, T* normed, T* sum,   \
                                    int h, float eps, int unit_offset) {                       \
    add_rms_norm_row<T>(x, res, w, normed, sum, h, eps, unit_offset);                          \
  }                                                                                            \
  KILN_GLOBAL void head_rms_norm_##S(const T* x, const T* w, T* out, int rows, int hd,         \
                                     float eps, int unit_offset) {                             \
    head_rms_norm_rows<T>(x, w, out, rows, hd, eps, unit_offset);                              \
  }
KILN_FOR_FLOATS(KILN_NORM_ENTRIES)
