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

// KS > 1 (split-K, for GEMVs with too few rows to fill the chip: a
// 1024-row o_proj is 64 blocks on a 132-SM H200): KS warps share a row
// pair, warp s of them taking the vectors of the "virtual lane" 32 s +
// lane of a KS*32-lane warp, so each lane still keeps the same loads in
// flight; a block covers 16 / KS rows and the KS partial sums meet in
// shared memory, added in slice order (deterministic).
// Map (kiln_port.h): KilnRows, or the rope entries' KilnRopePairs (rows in
// rotate-half pairs, each warp's two results roped and stored by it).
template <typename T, typename O, int TT, int KS, typename Map = KilnRows>
KILN_DEV void gemv_rows(const T* __restrict__ x, const T* __restrict__ w,
                        const T* __restrict__ bias, O* __restrict__ out, int tokens, int n, int k,
                        int w_const, Map map = Map{}) {
  static_assert(!Map::may_pair || (TT == 1 && KILN_GEMV_ROWS == 2), "a warp's rows are one pair");
  const int lane = threadIdx.x % KILN_WARP;
  const int warp = threadIdx.x / KILN_WARP;
  const int pair = warp / KS, slice = warp % KS;
  const i64 row0 = ((i64)blockIdx.x * (KILN_GEMV_WARPS / KS) + pair) * KILN_GEMV_ROWS;
  const int kv = k / 8;  // 8-element vectors per row
  constexpr int STRIDE = KILN_WARP * KS;  // vectors one pass of the lanes covers
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
    wv[r] = reinterpret_cast<const uint4*>(w + map.row(row) * k);
  }
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  constexpr int UNROLL = 4;
  int c = slice * KILN_WARP + lane;
  // When w is a weight (w_const: its bytes never change while the engine
  // lives), the first weight vectors are loaded BEFORE the dependency wait,
  // so under programmatic dependent launch this GEMV streams its first
  // bytes while the kernel before it (which produced x) is still finishing.
  // Nothing another kernel writes is read, and nothing is written, before
  // KILN_PROLOGUE().
  uint4 wr[KILN_GEMV_ROWS][UNROLL];
  bool full = c + (UNROLL - 1) * STRIDE < kv;
  if (full && w_const) {
#pragma unroll
    for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) wr[r][u] = wv[r][c + u * STRIDE];
  }
  KILN_PROLOGUE();
  map.after_wait();
  // Without a split no barrier follows: a warp past the last row leaves.
  if (KS == 1 && row0 >= n) return;
  if (full && !w_const) {
#pragma unroll
    for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) wr[r][u] = wv[r][c + u * STRIDE];
  }
  while (full) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int cc = c + u * STRIDE;
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
    c += UNROLL * STRIDE;
    full = c + (UNROLL - 1) * STRIDE < kv;
    if (full) {
#pragma unroll
      for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) wr[r][u] = wv[r][c + u * STRIDE];
    }
  }
  for (; c < kv; c += STRIDE) {
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
  if (KS > 1) {
    __shared__ float part[KILN_GEMV_WARPS][KILN_GEMV_ROWS][TT];
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < TT; ++t) part[warp][r][t] = acc[r][t];
    }
    __syncthreads();
    if (slice != 0 || row0 >= n) return;
#pragma unroll
    for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        float s2 = 0.0f;
#pragma unroll
        for (int q = 0; q < KS; ++q) s2 += part[warp + q][r][t];
        acc[r][t] = s2;
      }
  }
  if (lane == 0 && Map::may_pair && map.on()) {
    if (row0 < n) {
      const float b0 = bias ? ld(bias[map.row(row0)]) : 0.0f;
      const float b1 = bias ? ld(bias[map.row(row0 + 1)]) : 0.0f;
      map.store(row0, round_to<O>(acc[0][0] + b0), round_to<O>(acc[1][0] + b1));
    }
  } else if (lane == 0) {
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

// fused_matmul's epilogues (see the fused_matmul section below).
#define KILN_FUSED_NONE 0
#define KILN_FUSED_SILU 1
#define KILN_FUSED_GELU 2
#define KILN_FUSED_RESIDUAL 3

KILN_DEV float fused_silu(float g) { return g / (1.0f + expf(-g)); }
KILN_DEV float fused_gelu_tanh(float g) {
  const float k0 = 0.7978845608028654f;  // sqrt(2/pi)
  return 0.5f * g * (1.0f + tanhf(k0 * (g + 0.044715f * g * g * g)));
}

// What the staged GEMV does besides the plain product (its `Fuse`
// parameter): GemvPlain nothing; GemvFuse the fused_matmul prologue and
// epilogues of gemv_fused_rows (below), with the same rounding points and
// the same per-warp statistic, so a fused matmul keeps the staged weight
// stream and the split-K of the plain GEMV it replaces (without them the
// o_proj / down of a 1024-wide model ran 64 blocks on 132 SMs).
// One warp's inverse RMS of each token row of x (T x K, kv 8-element
// vectors per row): its lanes sum the squares over the whole row, one warp
// reduction. The fused GEMVs' RMSNorm prologue, register and staged alike
// (the same order, so the same bits).
template <typename T, int TT>
KILN_DEV void gemv_warp_inv_rms(const T* __restrict__ x, int tokens, int kv, int k, float eps,
                                float (&inv_rms)[TT]) {
  const int lane = threadIdx.x % KILN_WARP;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float ss[TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) ss[t] = 0.0f;
  for (int cc = lane; cc < kv; cc += KILN_WARP) {
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      if (t < tokens) {
        float xf[8];
        unpack8(xv[(i64)t * kv + cc], x, xf);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss[t] += xf[e] * xf[e];
      }
    }
  }
#pragma unroll
  for (int t = 0; t < TT; ++t) inv_rms[t] = 1.0f / sqrtf(warp_sum(ss[t]) / (float)k + eps);
}

// The fused epilogues of one warp's two sums per token (the caller's
// lane holding them). Under an activation (mode 1, 2) `rows` are the gate
// and up rows j and j + n/2 and out[t, j] = act(g) * u, g and u rounded as
// the unfused matmul stores them; otherwise `rows` are two output rows (a
// row >= n is skipped) and out[t, row] = acc + bias, with the residual
// (mode 3) added to the rounded sum.
template <typename T, typename O, int TT>
KILN_DEV void gemv_fused_store(int mode, const i64 (&rows)[2], i64 n, const float (&acc)[2][TT],
                               const float (&rv)[2][TT], const T* __restrict__ bias,
                               O* __restrict__ out, int tokens) {
  if (mode == KILN_FUSED_SILU || mode == KILN_FUSED_GELU) {
    const i64 outs = n / 2;
    const float bg = bias ? ld(bias[rows[0]]) : 0.0f;
    const float bu = bias ? ld(bias[rows[1]]) : 0.0f;
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      if (t < tokens) {
        const float g = round_to<T>(acc[0][t] + bg);
        const float u = round_to<T>(acc[1][t] + bu);
        const float a = mode == KILN_FUSED_SILU ? fused_silu(g) : fused_gelu_tanh(g);
        out[(i64)t * outs + rows[0]] = st<O>(a * u);
      }
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const i64 row = rows[r];
    if (row >= n) continue;
    const float b = bias ? ld(bias[row]) : 0.0f;
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      if (t < tokens) {
        float v = acc[r][t] + b;
        if (mode == KILN_FUSED_RESIDUAL) v = round_to<T>(v) + rv[r][t];
        out[(i64)t * n + row] = st<O>(v);
      }
    }
  }
}

struct GemvPlain {
  static constexpr bool on = false;
  template <typename T>
  KILN_DEV void after_wait(const T*, int, int, int, i64, i64, bool) {}
  KILN_DEV void xform(int, int, float*) const {}
};
// Virtual rows of a fused GEMV's tile: under an activation epilogue (outs
// > 0) row 2j is gate row j and row 2j + 1 up row j + outs, so a warp's
// row pair is one output; otherwise the identity.
struct GemvFusedRows {
  static constexpr bool may_pair = false;
  i64 outs;
  KILN_DEV bool on() const { return false; }
  KILN_DEV void after_wait() {}
  KILN_DEV i64 row(i64 l) const { return outs > 0 ? (l >> 1) + (l & 1) * outs : l; }
  KILN_DEV void store(i64, float, float) const {}
};
template <typename T, int TT, int PRE>
struct GemvFuse {
  static constexpr bool on = true;
  const T* norm_w;
  const T* res;
  float eps;
  int unit_offset, mode;
  float inv_rms[TT];
  float rv[2][TT];
  // Right after the dependency wait: the residual this thread stores
  // against (the row pair's holder only), then the warp's inverse RMS of
  // each token row, summed exactly as gemv_fused_dot sums it.
  KILN_DEV void after_wait(const T* x, int tokens, int kv, int k, i64 row0, i64 n, bool holder) {
    if (mode == KILN_FUSED_RESIDUAL && holder) {
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int t = 0; t < TT; ++t)
          rv[r][t] = row0 + r < n && t < tokens ? ld(res[(i64)t * n + row0 + r]) : 0.0f;
    }
    if (PRE) gemv_warp_inv_rms<T, TT>(x, tokens, kv, k, eps, inv_rms);
  }
  // Vector c of token t's x, normalized and rounded to T as rms_norm stores it.
  KILN_DEV void xform(int t, int c, float* xf) const {
    if (PRE) {
      float nf[8];
      unpack8(reinterpret_cast<const uint4*>(norm_w)[c], norm_w, nf);
      const float s = inv_rms[t];
#pragma unroll
      for (int e = 0; e < 8; ++e) xf[e] = round_to<T>(xf[e] * s * (nf[e] + (unit_offset ? 1.0f : 0.0f)));
    }
  }
  // The row pair's results (virtual rows row0, row0 + 1 of n), as
  // gemv_fused_rows stores them.
  template <typename O>
  KILN_DEV void store(i64 row0, const float (&acc)[2][TT], const T* bias, O* out, int tokens,
                      i64 n) const {
    const bool act = mode == KILN_FUSED_SILU || mode == KILN_FUSED_GELU;
    const i64 rows[2] = {act ? row0 >> 1 : row0, act ? (row0 >> 1) + n / 2 : row0 + 1};
    gemv_fused_store<T, O, TT>(mode, rows, n, acc, rv, bias, out, tokens);
  }
};

// ---- The staged GEMV (CUDA sm_80+): weights through shared memory ----
//
// Why: in gemv_rows a lane keeps UNROLL vectors per row in registers and
// issues the next ones only after multiplying these, so a warp has one
// batch of loads in flight and waits a DRAM round trip per batch. A large
// GEMV hides that behind many resident blocks; a small one (a few MB over
// fewer than two blocks per SM, the o_proj / down / qkv of 135M-1B models)
// does not. Here a block streams its rows into a ring of KILN_GEMV_STAGES
// shared-memory stages with cp.async (16-byte copies that hold no
// registers), so while the warps multiply one stage the next STAGES-1 are
// in flight; with a weight (w_const) the first ones are requested before
// the dependency wait, so under programmatic dependent launch they stream
// while the previous kernel finishes. Measured in a graph on the H200
// (bench/gemv/gemv_bench.cu, bench/results/gpu-2026-12-02-s15/): 15-25%
// faster on such GEMVs with split-K 2 or 4 (Llama-3.2-1B o_proj 3.98 ->
// 3.16 us, down 10.85 -> 9.95 us), 5-30% slower on GEMVs with enough blocks
// of their own, so kiln_kernels::gpu::gemv_call picks it only for the
// former (gemv_staged_applies).
//
// Same arithmetic as gemv_rows, bit for bit: the warp (pair, slice) owns
// the same two rows, lane l of slice s multiplies the same vectors c = 32 s
// + l + i * 32 KS in the same (ascending) order, the KS partial sums meet in
// the same order. Only where the weight bytes come from differs.
// Stage geometry: a stage holds the block's RB = 16 / KS rows times
// KILN_GEMV_STAGE_VECS / RB vectors of each (16 KiB), a multiple of 32 KS,
// so each lane's vectors of a stage are at a fixed stride. 48 KiB of static
// shared memory per block (the split-K partials reuse stage 0).
#ifndef KILN_GEMV_STAGES
#define KILN_GEMV_STAGES 3
#endif
#define KILN_GEMV_STAGE_VECS 1024

// CUDA targets are sm_80 and sm_90 (kernels/src/nvrtc.rs), all with cp.async.
#if defined(KILN_CUDA)
#define KILN_GEMV_STAGED 1

template <typename T, typename O, int TT, int KS, typename Map = KilnRows,
          typename Fuse = GemvPlain>
KILN_DEV void gemv_staged_rows(const T* __restrict__ x, const T* __restrict__ w,
                               const T* __restrict__ bias, O* __restrict__ out, int tokens, int n,
                               int k, int w_const, Map map = Map{}, Fuse fuse = Fuse{}) {
  static_assert(!Map::may_pair || (TT == 1 && KILN_GEMV_ROWS == 2), "a warp's rows are one pair");
  constexpr int RB = 16 / KS;                       // rows per block
  constexpr int CV = KILN_GEMV_STAGE_VECS / RB;     // vectors per row per stage
  constexpr int STRIDE = KILN_WARP * KS;            // as gemv_rows
  constexpr int PER = CV / STRIDE;                  // a lane's vectors per row per stage
  constexpr int THREADS = KILN_GEMV_WARPS * KILN_WARP;
  constexpr int COPIES = KILN_GEMV_STAGE_VECS / THREADS;
  static_assert(CV % STRIDE == 0, "stage rows must be a multiple of the lane stride");
  __shared__ uint4 stage[KILN_GEMV_STAGES][KILN_GEMV_STAGE_VECS];
  const int lane = threadIdx.x % KILN_WARP;
  const int warp = threadIdx.x / KILN_WARP;
  const int pair = warp / KS, slice = warp % KS;
  const i64 tile0 = (i64)blockIdx.x * RB;
  const i64 row0 = tile0 + pair * KILN_GEMV_ROWS;
  const int kv = k / 8;
  const int chunks = (kv + CV - 1) / CV;
  // This thread's copies: stage vector i = threadIdx.x + j * THREADS is row
  // i / CV of the tile (clamped to a valid row; its results are dropped),
  // vector ch * CV + i % CV of it.
  const uint4* src[COPIES];
  int col[COPIES];
#pragma unroll
  for (int j = 0; j < COPIES; ++j) {
    const int i = threadIdx.x + j * THREADS;
    const i64 r = tile0 + i / CV;
    src[j] = reinterpret_cast<const uint4*>(w + map.row(r < n ? r : n - 1) * (i64)k);
    col[j] = i % CV;
  }
  auto issue = [&](int ch) {
    if (ch < chunks) {
      uint4* dst = stage[ch % KILN_GEMV_STAGES];
#pragma unroll
      for (int j = 0; j < COPIES; ++j) {
        const int c = ch * CV + col[j];
        if (c < kv) kiln_cp_async16(dst + threadIdx.x + j * THREADS, src[j] + c);
      }
    }
    kiln_cp_async_commit();  // empty groups keep the count uniform
  };
  if (w_const) {
#pragma unroll
    for (int s = 0; s < KILN_GEMV_STAGES - 1; ++s) issue(s);
  }
  KILN_PROLOGUE();
  map.after_wait();
  if (!w_const) {
#pragma unroll
    for (int s = 0; s < KILN_GEMV_STAGES - 1; ++s) issue(s);
  }
  fuse.after_wait(x, tokens, kv, k, row0, n, lane == 0 && slice == 0);
  float acc[KILN_GEMV_ROWS][TT];
#pragma unroll
  for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[r][t] = 0.0f;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const int lrow = pair * KILN_GEMV_ROWS;  // the warp's first row in the tile
  for (int ch = 0; ch < chunks; ++ch) {
    kiln_cp_async_wait<KILN_GEMV_STAGES - 2>();
    __syncthreads();  // every thread's copies of ch landed; ch - 1's stage is free
    issue(ch + KILN_GEMV_STAGES - 1);
    const uint4* sv = stage[ch % KILN_GEMV_STAGES];
#pragma unroll
    for (int p = 0; p < PER; ++p) {
      const int j = slice * KILN_WARP + lane + p * STRIDE;  // vector of the stage row
      const int c = ch * CV + j;
      if (c < kv) {
#pragma unroll
        for (int t = 0; t < TT; ++t) {
          if (t < tokens) {
            float xf[8];
            unpack8(xv[(i64)t * kv + c], x, xf);
            fuse.xform(t, c, xf);
#pragma unroll
            for (int r = 0; r < KILN_GEMV_ROWS; ++r) {
              float wf[8];
              unpack8(sv[(lrow + r) * CV + j], w, wf);
#pragma unroll
              for (int e = 0; e < 8; ++e) acc[r][t] += xf[e] * wf[e];
            }
          }
        }
      }
    }
  }
  kiln_cp_async_wait<0>();
#pragma unroll
  for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[r][t] = warp_sum(acc[r][t]);
  if (KS > 1) {
    // The partial sums meet in stage 0 (free: every copy landed and was read).
    __syncthreads();
    float* part = reinterpret_cast<float*>(stage[0]);  // [warps][ROWS][TT]
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < TT; ++t) part[(warp * KILN_GEMV_ROWS + r) * TT + t] = acc[r][t];
    }
    __syncthreads();
    if (slice != 0 || row0 >= n) return;
#pragma unroll
    for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        float s2 = 0.0f;
#pragma unroll
        for (int q = 0; q < KS; ++q) s2 += part[((warp + q) * KILN_GEMV_ROWS + r) * TT + t];
        acc[r][t] = s2;
      }
  }
  if constexpr (Fuse::on) {
    if (lane == 0 && row0 < n) fuse.store(row0, acc, bias, out, tokens, n);
  } else if (lane == 0 && row0 < n && Map::may_pair && map.on()) {
    const float b0 = bias ? ld(bias[map.row(row0)]) : 0.0f;
    const float b1 = bias ? ld(bias[map.row(row0 + 1)]) : 0.0f;
    map.store(row0, round_to<O>(acc[0][0] + b0), round_to<O>(acc[1][0] + b1));
  } else if (lane == 0 && row0 < n) {
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
#endif

#define KILN_GEMV_KS(T, S, O, OS, TT, KS, PFX)                                                  \
  KILN_GLOBAL void __launch_bounds__(KILN_GEMV_WARPS * KILN_WARP)                               \
      gemv_##PFX##t##TT##_##S##_##OS(const T* x, const T* w, const T* bias, O* out, int tokens,   \
                                     int n, int k, int w_const) {                               \
    gemv_rows<T, O, TT, KS>(x, w, bias, out, tokens, n, k, w_const);                            \
  }
#define KILN_GEMV(T, S, O, OS, TT)                                                              \
  KILN_GEMV_KS(T, S, O, OS, TT, 1, ) KILN_GEMV_KS(T, S, O, OS, TT, 2, k2_)                      \
      KILN_GEMV_KS(T, S, O, OS, TT, 4, k4_)
#define KILN_GEMV_TOKENS(T, S, O, OS)                                                           \
  KILN_GEMV(T, S, O, OS, 1) KILN_GEMV(T, S, O, OS, 2) KILN_GEMV(T, S, O, OS, 4)               \
      KILN_GEMV(T, S, O, OS, 8)
KILN_GEMV_TOKENS(kbf16, bf16, kbf16, bf16)
KILN_GEMV_TOKENS(kbf16, bf16, float, f32)
KILN_GEMV_TOKENS(kf16, f16, kf16, f16)
KILN_GEMV_TOKENS(kf16, f16, float, f32)
// The staged GEMV's entries (one token): gemv_staged_[k2_|k4_]t1_S_OS. Where
// cp.async is missing (HIP) they run gemv_rows, so every target defines the
// same entry points and a plan's choice of them is valid everywhere.
#if defined(KILN_GEMV_STAGED)
#define KILN_GEMV_STAGED_BODY(T, O, KS) \
  gemv_staged_rows<T, O, 1, KS>(x, w, bias, out, tokens, n, k, w_const);
#else
#define KILN_GEMV_STAGED_BODY(T, O, KS) gemv_rows<T, O, 1, KS>(x, w, bias, out, tokens, n, k, w_const);
#endif
#define KILN_GEMV_STAGED_KS(T, S, O, OS, KS, PFX)                                               \
  KILN_GLOBAL void __launch_bounds__(KILN_GEMV_WARPS * KILN_WARP)                               \
      gemv_staged_##PFX##t1_##S##_##OS(const T* x, const T* w, const T* bias, O* out,            \
                                       int tokens, int n, int k, int w_const) {                 \
    KILN_GEMV_STAGED_BODY(T, O, KS)                                                             \
  }
#define KILN_GEMV_STAGED_ALL(T, S, O, OS)                                                       \
  KILN_GEMV_STAGED_KS(T, S, O, OS, 1, ) KILN_GEMV_STAGED_KS(T, S, O, OS, 2, k2_)                \
      KILN_GEMV_STAGED_KS(T, S, O, OS, 4, k4_)
KILN_GEMV_STAGED_ALL(kbf16, bf16, kbf16, bf16)
KILN_GEMV_STAGED_ALL(kbf16, bf16, float, f32)
KILN_GEMV_STAGED_ALL(kf16, f16, kf16, f16)
KILN_GEMV_STAGED_ALL(kf16, f16, float, f32)

// The rope entries (matmul_qkv_rope over a dense weight, one token):
// gemv_[staged_][k2_|k4_]rope_t1_S_S, the GEMV above (register or staged,
// the split the lowering picks as for the plain matmul). With a q/k norm it
// writes the packed qkv row to `out` (the op's scratch), then kiln_port.h's
// kiln_rope_tail runs on the block's 16 / KS rows; without one its warps
// take the rows in rotate-half pairs and rope and store them themselves
// (KilnRopePairs, no tail, `out` untouched). qkv_rope_kv_write's parameters
// after the GEMV's (stems gemv_rope_, gemv_staged_rope_).
#define KILN_GEMV_ROPE_KS(T, S, KS, PFX, BODY)                                                  \
  KILN_GLOBAL void __launch_bounds__(KILN_GEMV_WARPS * KILN_WARP) gemv_##PFX##rope_t1_##S##_##S( \
      const T* x, const T* w, const T* bias, T* out, int tokens, int n, int k, int w_const,     \
      const int* pos, const int* slots, T* kc, T* vc, const T* qn, const T* kn, T* q_out,       \
      unsigned int* counters, int heads, int kvh, int hd, float qk_eps, int has_norm,           \
      int unit_offset, i64 num_slots, RopeFreqs fr) {                                           \
    const KilnRopePairs<T> map{!has_norm, kc,    vc,   q_out, fr, pos,                         \
                               slots,     num_slots, heads, kvh, hd};                           \
    BODY<T, T, 1, KS>(x, w, bias, out, tokens, n, k, w_const, map);                             \
    if (!has_norm) return;                                                                      \
    kiln_rope_tail<T>(out, n, KILN_GEMV_WARPS * KILN_GEMV_ROWS / KS, pos, slots, kc, vc, qn, kn,   \
                      q_out, counters, heads, kvh, hd, qk_eps, has_norm, unit_offset, num_slots, \
                      fr);                                                                      \
  }
#if defined(KILN_GEMV_STAGED)
#define KILN_GEMV_ROPE_STAGED_BODY gemv_staged_rows
#else
#define KILN_GEMV_ROPE_STAGED_BODY gemv_rows
#endif
#define KILN_GEMV_ROPE_ALL(T, S)                                                                \
  KILN_GEMV_ROPE_KS(T, S, 1, , gemv_rows)                                                       \
  KILN_GEMV_ROPE_KS(T, S, 2, k2_, gemv_rows)                                                    \
  KILN_GEMV_ROPE_KS(T, S, 4, k4_, gemv_rows)                                                    \
  KILN_GEMV_ROPE_KS(T, S, 1, staged_, KILN_GEMV_ROPE_STAGED_BODY)                               \
  KILN_GEMV_ROPE_KS(T, S, 2, staged_k2_, KILN_GEMV_ROPE_STAGED_BODY)                            \
  KILN_GEMV_ROPE_KS(T, S, 4, staged_k4_, KILN_GEMV_ROPE_STAGED_BODY)
KILN_GEMV_ROPE_ALL(kbf16, bf16)
KILN_GEMV_ROPE_ALL(kf16, f16)

// ---- fused_matmul: the GEMV above with an RMSNorm prologue and an epilogue ----
//
// Same weight stream as gemv_rows (one warp, two weight rows, 16-byte loads,
// the first loads issued before the dependency wait when w is a weight).
// Prologue (PRE): every WARP computes the inverse RMS of each token row of x
// itself (x is T x K, a few KiB, L2-resident): a warp reads all of x anyway,
// so its lanes sum the squares of the very vectors they multiply later, and
// one warp reduction gives the statistic. No block barrier and no shared
// memory sit between the dependency wait and the weight loop (an earlier
// form reduced over the block and cost 2.7-3.3 us per launch on the H200,
// more than the rms_norm launch it replaced). Each x element is then
// normalized as it is unpacked and rounded to T, the value the unfused
// rms_norm would have stored, so the normed rows never go to memory. The
// norm weight's first vectors are loaded before the wait with the weight's
// when they never change (consts bit 1), and the next ones with the next
// weight vectors. Epilogues (mode, uniform per launch):
//   0 none      out[t, n] = acc + bias, rounded to O
//   1 silu_mul  w stacks gate rows over up rows ([2I, K]); the warp's two
//   2 gelu_mul  rows are j and j + I, out[t, j] = act(g) * u with g and u
//               the rounded products (as the unfused matmul stores them)
//   3 residual  out[t, n] = round(acc + bias) + residual[t, n], rounded;
//               the residual is loaded right after the wait, so its latency
//               hides behind the weight loop instead of following it
// Every rounding point is the unfused sequence's; only the order of the
// sums (dot products, the norm's sum of squares) differs from the CPU
// reference. Nothing another kernel writes (x, residual) is read before
// KILN_PROLOGUE(); out never aliases an input (the op allows no reuse).
// consts: bit 0 the weight, bit 1 the norm weight never change while the
// engine lives (they may be read before the wait).
// The product part shared by gemv_fused_rows and gemv_argmax_rows (one
// source, so an argmax GEMV's logits are the f32 sums the fused GEMV would
// store): this warp's two weight rows `rows` (clamped to valid rows when
// past the end) times the token rows of x, normalized first when PRE; acc
// ends warp-reduced in every lane. `after_wait` runs right after the
// dependency wait (a caller's early loads). A warp that is not `live`
// returns right after it with acc zero; no block barrier is inside.
template <typename T, int TT, int PRE, typename AfterWait>
KILN_DEV void gemv_fused_dot(const T* __restrict__ x, const T* __restrict__ w,
                             const T* __restrict__ norm_w, const i64* rows, bool live, int tokens,
                             int n, int k, int consts, float eps, int unit_offset,
                             float (&acc)[KILN_GEMV_ROWS][TT], AfterWait after_wait) {
  const int lane = threadIdx.x % KILN_WARP;
  const int w_const = consts & 1;
  const int n_const = consts & 2;
  const int kv = k / 8;
  const uint4* wv[KILN_GEMV_ROWS];
#pragma unroll
  for (int r = 0; r < KILN_GEMV_ROWS; ++r) {
    // A row past the end re-reads row 0 (its result is dropped), so every
    // warp reaches the dependency wait.
    const i64 row = live && rows[r] < n ? rows[r] : 0;
    wv[r] = reinterpret_cast<const uint4*>(w + row * k);
  }
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const uint4* nv = reinterpret_cast<const uint4*>(norm_w);
#pragma unroll
  for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[r][t] = 0.0f;
  constexpr int UNROLL = 4;
  int c = lane;
  uint4 wr[KILN_GEMV_ROWS][UNROLL];
  uint4 nr[UNROLL];  // the norm weight's vectors of the current step (PRE)
  bool full = c + (UNROLL - 1) * KILN_WARP < kv;
  if (full && w_const) {
#pragma unroll
    for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) wr[r][u] = wv[r][c + u * KILN_WARP];
  }
  if (PRE && full && n_const) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) nr[u] = nv[c + u * KILN_WARP];
  }
  KILN_PROLOGUE();
  after_wait();
  if (!live) return;
  if (full && !w_const) {
#pragma unroll
    for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) wr[r][u] = wv[r][c + u * KILN_WARP];
  }
  if (PRE && full && !n_const) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) nr[u] = nv[c + u * KILN_WARP];
  }
  float inv_rms[TT];
  // Per-token inverse RMS over the whole row, by this warp alone.
  if (PRE) gemv_warp_inv_rms<T, TT>(x, tokens, kv, k, eps, inv_rms);
  // One 8-element chunk of token t's (normalized) x.
  auto x_chunk = [&](int t, int cc, const float* nf, float* xf) {
    unpack8(xv[(i64)t * kv + cc], x, xf);
    if (PRE) {
      const float s = inv_rms[t];
#pragma unroll
      for (int e = 0; e < 8; ++e) xf[e] = round_to<T>(xf[e] * s * nf[e]);
    }
  };
  auto norm_unpack = [&](uint4 raw, float* nf) {
    if (PRE) {
      unpack8(raw, norm_w, nf);
      if (unit_offset) {
#pragma unroll
        for (int e = 0; e < 8; ++e) nf[e] += 1.0f;
      }
    }
  };
  while (full) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int cc = c + u * KILN_WARP;
      float nf[8];
      norm_unpack(nr[u], nf);
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        if (t < tokens) {
          float xf[8];
          x_chunk(t, cc, nf, xf);
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
      if (PRE) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) nr[u] = nv[c + u * KILN_WARP];
      }
    }
  }
  for (; c < kv; c += KILN_WARP) {
    float nf[8];
    if (PRE) norm_unpack(nv[c], nf);
#pragma unroll
    for (int r = 0; r < KILN_GEMV_ROWS; ++r) {
      float wf[8];
      unpack8(wv[r][c], w, wf);
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        if (t < tokens) {
          float xf[8];
          x_chunk(t, c, nf, xf);
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
}

template <typename T, typename O, int TT, int PRE>
KILN_DEV void gemv_fused_rows(const T* __restrict__ x, const T* __restrict__ w,
                              const T* __restrict__ bias, const T* __restrict__ norm_w,
                              const T* __restrict__ res, O* __restrict__ out, int tokens, int n,
                              int k, int consts, float eps, int unit_offset, int mode) {
  const int lane = threadIdx.x % KILN_WARP;
  const int warp = threadIdx.x / KILN_WARP;
  const int act = mode == KILN_FUSED_SILU || mode == KILN_FUSED_GELU;
  const int outs = act ? n / 2 : n;  // output features
  // The weight rows this warp streams: (j, j + outs) for one output j under
  // an activation epilogue, else two consecutive rows.
  const i64 first = act ? (i64)blockIdx.x * KILN_GEMV_WARPS + warp
                        : ((i64)blockIdx.x * KILN_GEMV_WARPS + warp) * KILN_GEMV_ROWS;
  const bool live = first < outs;
  i64 rows[KILN_GEMV_ROWS];
#pragma unroll
  for (int r = 0; r < KILN_GEMV_ROWS; ++r) rows[r] = act ? first + r * (i64)outs : first + r;
  // The residual this lane stores against (lane 0 only), loaded right
  // after the wait.
  float rv[KILN_GEMV_ROWS][TT] = {};
  auto load_residual = [&]() {
    if (mode == KILN_FUSED_RESIDUAL && lane == 0 && live) {
#pragma unroll
      for (int r = 0; r < KILN_GEMV_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < TT; ++t)
          rv[r][t] = rows[r] < n && t < tokens ? ld(res[(i64)t * n + rows[r]]) : 0.0f;
    }
  };
  float acc[KILN_GEMV_ROWS][TT];
  gemv_fused_dot<T, TT, PRE>(x, w, norm_w, rows, live, tokens, n, k, consts, eps, unit_offset,
                             acc, load_residual);
  if (!live || lane != 0) return;
  gemv_fused_store<T, O, TT>(mode, rows, n, acc, rv, bias, out, tokens);
}

#define KILN_GEMV_FUSED(T, S, O, OS, TT)                                                        \
  KILN_GLOBAL void __launch_bounds__(KILN_GEMV_WARPS * KILN_WARP) gemv_fused_t##TT##_##S##_##OS( \
      const T* x, const T* w, const T* bias, const T* norm_w, const T* res, O* out, int tokens,  \
      int n, int k, int consts, float eps, int unit_offset, int mode) {                         \
    gemv_fused_rows<T, O, TT, 0>(x, w, bias, norm_w, res, out, tokens, n, k, consts, eps,       \
                                 unit_offset, mode);                                            \
  }                                                                                             \
  KILN_GLOBAL void __launch_bounds__(KILN_GEMV_WARPS * KILN_WARP)                               \
      gemv_fused_norm_t##TT##_##S##_##OS(const T* x, const T* w, const T* bias,                \
                                         const T* norm_w, const T* res, O* out, int tokens,    \
                                         int n, int k, int consts, float eps, int unit_offset,  \
                                         int mode) {                                            \
    gemv_fused_rows<T, O, TT, 1>(x, w, bias, norm_w, res, out, tokens, n, k, consts, eps,       \
                                 unit_offset, mode);                                            \
  }
#define KILN_GEMV_FUSED_TOKENS(T, S, O, OS)                                                     \
  KILN_GEMV_FUSED(T, S, O, OS, 1) KILN_GEMV_FUSED(T, S, O, OS, 2)                               \
      KILN_GEMV_FUSED(T, S, O, OS, 4) KILN_GEMV_FUSED(T, S, O, OS, 8)
KILN_GEMV_FUSED_TOKENS(kbf16, bf16, kbf16, bf16)
KILN_GEMV_FUSED_TOKENS(kbf16, bf16, float, f32)
KILN_GEMV_FUSED_TOKENS(kf16, f16, kf16, f16)
KILN_GEMV_FUSED_TOKENS(kf16, f16, float, f32)

// The staged fused entries (one token): gemv_staged_fused_[norm_][k2_|k4_]t1_S_OS,
// fused_matmul over the staged GEMV with the split the plain matmul of
// the same shape gets (kiln_kernels::gpu::fused_matmul_launch picks them
// where gemv_staged_applies). The grid counts 16 / KS virtual rows per
// block (GemvFusedRows: an activation epilogue's outputs count twice).
// Same parameters as gemv_fused_*. Where cp.async is missing (HIP) they run
// gemv_fused_rows, whose blocks past its own grid find no live row.
#if defined(KILN_GEMV_STAGED)
#define KILN_GEMV_STAGED_FUSED_BODY(T, O, KS, PRE)                                              \
  const int act = mode == KILN_FUSED_SILU || mode == KILN_FUSED_GELU;                           \
  GemvFuse<T, 1, PRE> f{norm_w, res, eps, unit_offset, mode, {}, {}};                          \
  gemv_staged_rows<T, O, 1, KS, GemvFusedRows, GemvFuse<T, 1, PRE>>(                            \
      x, w, bias, out, tokens, n, k, consts & 1, GemvFusedRows{act ? (i64)(n / 2) : 0}, f);
#else
#define KILN_GEMV_STAGED_FUSED_BODY(T, O, KS, PRE)                                              \
  gemv_fused_rows<T, O, 1, PRE>(x, w, bias, norm_w, res, out, tokens, n, k, consts, eps,        \
                                unit_offset, mode);
#endif
#define KILN_GEMV_STAGED_FUSED_KS(T, S, O, OS, KS, PFX)                                         \
  KILN_GLOBAL void __launch_bounds__(KILN_GEMV_WARPS * KILN_WARP)                               \
      gemv_staged_fused_##PFX##t1_##S##_##OS(const T* x, const T* w, const T* bias,            \
                                             const T* norm_w, const T* res, O* out, int tokens, \
                                             int n, int k, int consts, float eps,               \
                                             int unit_offset, int mode) {                       \
    KILN_GEMV_STAGED_FUSED_BODY(T, O, KS, 0)                                                    \
  }                                                                                             \
  KILN_GLOBAL void __launch_bounds__(KILN_GEMV_WARPS * KILN_WARP)                               \
      gemv_staged_fused_norm_##PFX##t1_##S##_##OS(                                              \
          const T* x, const T* w, const T* bias, const T* norm_w, const T* res, O* out,         \
          int tokens, int n, int k, int consts, float eps, int unit_offset, int mode) {         \
    KILN_GEMV_STAGED_FUSED_BODY(T, O, KS, 1)                                                    \
  }
#define KILN_GEMV_STAGED_FUSED_ALL(T, S, O, OS)                                                 \
  KILN_GEMV_STAGED_FUSED_KS(T, S, O, OS, 1, )                                                   \
  KILN_GEMV_STAGED_FUSED_KS(T, S, O, OS, 2, k2_)                                                \
  KILN_GEMV_STAGED_FUSED_KS(T, S, O, OS, 4, k4_)
KILN_GEMV_STAGED_FUSED_ALL(kbf16, bf16, kbf16, bf16)
KILN_GEMV_STAGED_FUSED_ALL(kf16, f16, kf16, f16)

// ---- fused_matmul{argmax}: the lm_head GEMV reducing its rows' argmax ----
//
// The rows of gemv_fused_rows without an epilogue (mode 0: the same warps
// and rows, and the very same gemv_fused_dot, so each logit is the same f32
// sum the fused GEMV stores, rounded to O as it would be stored), but no logit
// goes to memory. Each block reduces its 16 rows to one (max, first index)
// pair per token and writes it to planned scratch (part_v / part_i,
// [tokens][gridDim.x]); the last block to finish (a planned completion
// counter, as attention.cu's combine) merges every block's pair per token,
// writes out[t] and resets the counter to 0 for the next launch. The order
// is argmax's NaN rule (kernels/src/cpu/reduce.rs): NaN never wins, a larger
// value wins, equal values (-0 == +0) go to the smaller index, -inf counts
// as a value; a row without a number gives 0. It is a total order, so the
// merge order (warps, blocks) cannot change the pick: the index is the one
// argmax_chunk + argmax_final pick over the stored logits, bit for bit.
#define KILN_NO_INDEX 0x7fffffff

// Merges (v, i) into (best, bi); i == KILN_NO_INDEX or NaN v carry nothing.
KILN_DEV void gemv_argmax_take(float& best, int& bi, float v, int i) {
  if (i == KILN_NO_INDEX || v != v) return;
  if (bi == KILN_NO_INDEX || v > best || (v == best && i < bi)) {
    best = v;
    bi = i;
  }
}

// Warp-wide merge: every lane ends with the warp's pair.
KILN_DEV void gemv_argmax_warp(float& best, int& bi) {
#pragma unroll
  for (int m = KILN_WARP / 2; m > 0; m >>= 1) {
    const float v = shfl_xor(best, m);
    const int i = shfl_xor_int(bi, m);
    gemv_argmax_take(best, bi, v, i);
  }
}

template <typename T, typename O, int TT, int PRE>
KILN_DEV void gemv_argmax_rows(const T* __restrict__ x, const T* __restrict__ w,
                               const T* __restrict__ bias, const T* __restrict__ norm_w,
                               float* __restrict__ part_v, int* __restrict__ part_i,
                               unsigned int* __restrict__ counter, int* __restrict__ out,
                               int tokens, int n, int k, int consts, float eps, int unit_offset) {
  __shared__ float wbest[KILN_GEMV_WARPS][TT];
  __shared__ int widx[KILN_GEMV_WARPS][TT];
  __shared__ int last_block;
  const int lane = threadIdx.x % KILN_WARP;
  const int warp = threadIdx.x / KILN_WARP;
  const i64 first = ((i64)blockIdx.x * KILN_GEMV_WARPS + warp) * KILN_GEMV_ROWS;
  const bool live = first < n;
  i64 rows[KILN_GEMV_ROWS];
#pragma unroll
  for (int r = 0; r < KILN_GEMV_ROWS; ++r) rows[r] = first + r;
  float acc[KILN_GEMV_ROWS][TT];
  gemv_fused_dot<T, TT, PRE>(x, w, norm_w, rows, live, tokens, n, k, consts, eps, unit_offset,
                             acc, [] {});
  // The warp's pair per token: its rows in order, each logit as stored.
  if (lane == 0) {
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      float best = 0.0f;
      int bi = KILN_NO_INDEX;
      if (live) {
#pragma unroll
        for (int r = 0; r < KILN_GEMV_ROWS; ++r) {
          const i64 row = first + r;
          if (row < n) {
            const float b = bias ? ld(bias[row]) : 0.0f;
            gemv_argmax_take(best, bi, ld(st<O>(acc[r][t] + b)), (int)row);
          }
        }
      }
      wbest[warp][t] = best;
      widx[warp][t] = bi;
    }
  }
  __syncthreads();
  // The block's pair per token, to scratch.
  if (threadIdx.x < tokens) {
    const int t = threadIdx.x;
    float best = 0.0f;
    int bi = KILN_NO_INDEX;
    for (int q = 0; q < KILN_GEMV_WARPS; ++q) gemv_argmax_take(best, bi, wbest[q][t], widx[q][t]);
    part_v[(i64)t * gridDim.x + blockIdx.x] = best;
    part_i[(i64)t * gridDim.x + blockIdx.x] = bi;
  }
  // Completion count: the last block merges every block's pairs.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int done = atomicAdd(counter, 1u);
    last_block = done + 1 == gridDim.x;
  }
  __syncthreads();
  if (!last_block) return;
  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch
  for (int t = 0; t < tokens; ++t) {
    float best = 0.0f;
    int bi = KILN_NO_INDEX;
    for (int b = threadIdx.x; b < (int)gridDim.x; b += blockDim.x) {
      const i64 at = (i64)t * gridDim.x + b;
      // L2 loads: other blocks wrote these during this launch.
      const float v = ld_cg(part_v + at);
      const int i = (int)kiln_f2u(ld_cg(reinterpret_cast<const float*>(part_i + at)));
      gemv_argmax_take(best, bi, v, i);
    }
    gemv_argmax_warp(best, bi);
    if (lane == 0) {
      wbest[warp][0] = best;
      widx[warp][0] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float b2 = 0.0f;
      int i2 = KILN_NO_INDEX;
      for (int q = 0; q < KILN_GEMV_WARPS; ++q) gemv_argmax_take(b2, i2, wbest[q][0], widx[q][0]);
      out[t] = i2 == KILN_NO_INDEX ? 0 : i2;
    }
    __syncthreads();
  }
}

#define KILN_GEMV_ARGMAX(T, S, O, OS, TT)                                                       \
  KILN_GLOBAL void __launch_bounds__(KILN_GEMV_WARPS * KILN_WARP)                               \
      gemv_argmax_t##TT##_##S##_##OS(const T* x, const T* w, const T* bias, const T* norm_w,    \
                                     float* part_v, int* part_i, unsigned int* counter,        \
                                     int* out, int tokens, int n, int k, int consts,           \
                                     float eps, int unit_offset) {                              \
    gemv_argmax_rows<T, O, TT, 0>(x, w, bias, norm_w, part_v, part_i, counter, out, tokens, n,  \
                                  k, consts, eps, unit_offset);                                 \
  }                                                                                             \
  KILN_GLOBAL void __launch_bounds__(KILN_GEMV_WARPS * KILN_WARP)                               \
      gemv_argmax_norm_t##TT##_##S##_##OS(const T* x, const T* w, const T* bias,               \
                                          const T* norm_w, float* part_v, int* part_i,         \
                                          unsigned int* counter, int* out, int tokens, int n,  \
                                          int k, int consts, float eps, int unit_offset) {     \
    gemv_argmax_rows<T, O, TT, 1>(x, w, bias, norm_w, part_v, part_i, counter, out, tokens, n,  \
                                  k, consts, eps, unit_offset);                                 \
  }
#define KILN_GEMV_ARGMAX_TOKENS(T, S, O, OS)                                                    \
  KILN_GEMV_ARGMAX(T, S, O, OS, 1) KILN_GEMV_ARGMAX(T, S, O, OS, 2)                             \
      KILN_GEMV_ARGMAX(T, S, O, OS, 4) KILN_GEMV_ARGMAX(T, S, O, OS, 8)
KILN_GEMV_ARGMAX_TOKENS(kbf16, bf16, kbf16, bf16)
KILN_GEMV_ARGMAX_TOKENS(kbf16, bf16, float, f32)
KILN_GEMV_ARGMAX_TOKENS(kf16, f16, kf16, f16)
KILN_GEMV_ARGMAX_TOKENS(kf16, f16, float, f32)
