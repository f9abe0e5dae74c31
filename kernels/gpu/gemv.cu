// Skinny GEMM for decode: out[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n])
// for T <= 8 tokens, the shape of every decode-step projection.
//
// Such a GEMM is a pass over the weights; what matters is keeping enough
// 16-byte loads in flight across the whole chip. One warp owns ROWS output
// features and streams their weight rows in 8-element vectors (four
// vectors in flight per lane), multiplying each by the TT token rows of x
// (small, cache resident). f32 accumulation; one warp reduction per output;
// the result is rounded to the output dtype once, after the bias.
// Requires K % 8 == 0 and 16-byte aligned rows (the catalog checks).
#include "kiln_port.h"

#define KILN_GEMV_WARPS 8
#define KILN_GEMV_ROWS 2

template <typename T, typename O, int TT>
KILN_DEV void gemv_rows(const T* __restrict__ x, const T* __restrict__ w,
                        const T* __restrict__ bias, O* __restrict__ out, int tokens, int n, int k,
                        int w_const) {
  const int lane = threadIdx.x % KILN_WARP;
  const int warp = threadIdx.x / KILN_WARP;
  const i64 row0 = ((i64)blockIdx.x * KILN_GEMV_WARPS + warp) * KILN_GEMV_ROWS;
  const int kv = k / 8;  // 8-element vectors per row
  float acc[KILN_GEMV_ROWS][TT];
#pragma unroll
  for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[r][t] = 0.0f;
  const uint4* wv[KILN_GEMV_ROWS];
#pragma unroll
  for (int r = 0; r < KILN_GEMV_ROWS; ++r) {
    // A warp past the last row re-reads row 0 (its results are dropped), so
    // every warp reaches the dependency wait below.
    const i64 row = row0 + r < n ? row0 + r : (row0 < n ? row0 : 0);
    wv[r] = reinterpret_cast<const uint4*>(w + row * k);
  }
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  constexpr int UNROLL = 4;
  int c = lane;
  // When w is a weight (w_const: its bytes never change while the engine
  // lives), the first weight vectors are loaded BEFORE the dependency wait,
  // so under programmatic dependent launch this GEMV streams its first
  // bytes while the kernel before it (which produced x) is still finishing.
  // Nothing another kernel writes is read, and nothing is written, before
  // KILN_PROLOGUE().
  uint4 wr[KILN_GEMV_ROWS][UNROLL];
  bool full = c + (UNROLL - 1) * KILN_WARP < kv;
  if (full && w_const) {
#pragma unroll
    for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) wr[r][u] = wv[r][c + u * KILN_WARP];
  }
  KILN_PROLOGUE();
  if (row0 >= n) return;
  if (full && !w_const) {
#pragma unroll
    for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) wr[r][u] = wv[r][c + u * KILN_WARP];
  }
  while (full) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int cc = c + u * KILN_WARP;
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        if (t < tokens) {
          float xf[8];
          unpack8(xv[(i64)t * kv + cc], x, xf);
#pragma unroll
          for (int r = 0; r < KILN_GEMV_ROWS; ++r) {
            float wf[8];
            unpack8(wr[r][u], w, wf);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r][t] += xf[e] * wf[e];
          }
        }
      }
    }
    c += UNROLL * KILN_WARP;
    full = c + (UNROLL - 1) * KILN_WARP < kv;
    if (full) {
#pragma unroll
      for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) wr[r][u] = wv[r][c + u * KILN_WARP];
    }
  }
  for (; c < kv; c += KILN_WARP) {
#pragma unroll
    for (int r = 0; r < KILN_GEMV_ROWS; ++r) {
      float wf[8];
      unpack8(wv[r][c], w, wf);
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        if (t < tokens) {
          float xf[8];
          unpack8(xv[(i64)t * kv + c], x, xf);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r][t] += xf[e] * wf[e];
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[r][t] = warp_sum(acc[r][t]);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < KILN_GEMV_ROWS; ++r) {
      const i64 row = row0 + r;
      if (row >= n) continue;
      const float b = bias ? ld(bias[row]) : 0.0f;
#pragma unroll
      for (int t = 0; t < TT; ++t)
        if (t < tokens) out[(i64)t * n + row] = st<O>(acc[r][t] + b);
    }
  }
}

#define KILN_GEMV(T, S, O, OS, TT)                                                              \
  KILN_GLOBAL void __launch_bounds__(KILN_GEMV_WARPS * KILN_WARP)                               \
      gemv_t##TT##_##S##_##OS(const T* x, const T* w, const T* bias, O* out, int tokens, int n,  \
                              int k, int w_const) {                                             \
    gemv_rows<T, O, TT>(x, w, bias, out, tokens, n, k, w_const);                                \
  }
#define KILN_GEMV_TOKENS(T, S, O, OS)                                                           \
  KILN_GEMV(T, S, O, OS, 1) KILN_GEMV(T, S, O, OS, 2) KILN_GEMV(T, S, O, OS, 4)               \
      KILN_GEMV(T, S, O, OS, 8)
KILN_GEMV_TOKENS(kbf16, bf16, kbf16, bf16)
KILN_GEMV_TOKENS(kbf16, bf16, float, f32)
KILN_GEMV_TOKENS(kf16, f16, kf16, f16)
KILN_GEMV_TOKENS(kf16, f16, float, f32)
