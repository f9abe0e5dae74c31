// Skinny GEMM on tensor cores: out[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n])
// for 2..32 tokens (the batched-decode and small-window shapes), reading
// each weight byte exactly once per launch.
//
// Why: gemv.cu streams weights through FMA units and re-reads x per row
// pair; past a few tokens it is compute-bound on the FMA pipe. Here the
// multiply is `mma.sync.aligned.m16n8k16` (bf16 or f16 in, f32 accumulate,
// sm_80+), with the weights as the 16-row A operand and x^T (tokens padded
// to a multiple of 8) as the 8-column B operand, so the kernel stays a pass
// over the weights at every T up to 32.
//
// Work split (the catalog, kernels/src/gpu.rs `skinny_call`, picks the
// geometry and documents it):
//   * block b owns output rows [16*MT*b, 16*MT*(b+1)): MT row tiles of 16;
//   * the block's W warps split K: warp w takes the 32-element k-chunks
//     w, w+W, w+2W, ... (two per iteration, the next two prefetched), so
//     neighbouring warps stream neighbouring bytes of the same rows;
//   * each warp keeps every token: NT tiles of 8 tokens (T <= 8*NT);
//   * the W per-warp partial sums meet in dynamic shared memory
//     ([W][MT*NT*4][32] f32) and are summed in warp order (deterministic);
//     the bias is added and the result rounded once.
//
// The 16-byte-load trick (the only index math worth reading twice). A lane
// is (g, t) = (lane / 4, lane % 4). For one 32-wide k-chunk starting at k0
// it loads, with three 16-byte loads:
//     wa = w[row0 + g    ][k0 + 8t .. k0 + 8t + 8)     (uint4: words x y z w)
//     wb = w[row0 + g + 8][k0 + 8t .. k0 + 8t + 8)
//     xb = x[tok0 + g    ][k0 + 8t .. k0 + 8t + 8)
// and issues two m16n8k16 steps s = 0, 1 with
//     A = {wa[2s], wb[2s], wa[2s+1], wb[2s+1]}    B = {xb[2s], xb[2s+1]}
// (word j of a uint4 holds elements 2j (low half) and 2j+1 (high half)).
// PTX's fragment layout puts, in lane (g, t), A rows g / g+8 at logical
// columns {2t, 2t+1} (regs 0, 1) and {2t+8, 2t+9} (regs 2, 3), and B column
// (token) g at logical rows {2t, 2t+1} (reg 0) and {2t+8, 2t+9} (reg 1). So
// logical k column 2t+e maps to physical k0 + 8t + 4s + e and 2t+8+e to
// k0 + 8t + 4s + 2 + e, the SAME map for A and B: each product pairs w and
// x at the same physical k, and the two steps cover the chunk's 32 k once.
// The accumulator layout is PTX's: c[i] is row g + 8*(i/2), token
// 2t + (i%2) of the 16x8 tile.
//
// Edges: rows past n and tokens past `tokens` load a clamped (valid) row
// and their results are dropped (an MMA never mixes rows or tokens); k
// past the end loads zeros in both operands. Requires K % 8 == 0 and
// 16-byte aligned rows (the catalog checks).
//
// PDL: the first weight chunks are loaded before KILN_PROLOGUE() only when
// w_const (the weights never change while a plan is loaded); x, bias and
// the output are touched only after it.
//
// Portable path: HIP and CUDA before sm_80 compile the same entry points
// (same parameters, geometry and shared memory) as a plain FMA loop, one
// warp per output row and token; correct, not tuned.
#include "kiln_port.h"

#if defined(KILN_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
#define KILN_SKINNY_MMA 1
#endif

KILN_DEV uint4 skinny_zero4() {
  uint4 z;
  z.x = 0u;
  z.y = 0u;
  z.z = 0u;
  z.w = 0u;
  return z;
}

#if defined(KILN_SKINNY_MMA)
// d += A(16x16, row-major fragment) * B(16x8, column-major fragment).
KILN_DEV void skinny_mma(float* d, unsigned int a0, unsigned int a1, unsigned int a2,
                         unsigned int a3, unsigned int b0, unsigned int b1, const kbf16*) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
KILN_DEV void skinny_mma(float* d, unsigned int a0, unsigned int a1, unsigned int a2,
                         unsigned int a3, unsigned int b0, unsigned int b1, const kf16*) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The weight vectors of the two chunks c and c + warps this lane multiplies:
// wv[u][mt][h] is row 16*mt + 8*h + g of the block's tile at element
// 32*(c + u*warps) + 8t, zero past the end of k.
template <typename T, int MT>
KILN_DEV void skinny_load_w(uint4 (&wv)[2][MT][2], const T* const (&wrow)[MT][2], int c, int warps,
                            int k, int t) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int off = (c + u * warps) * 32 + 8 * t;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        wv[u][mt][h] =
            off < k ? *reinterpret_cast<const uint4*>(wrow[mt][h] + off) : skinny_zero4();
  }
}
#endif

// Writes reduced accumulator `i` (PTX layout, see the top) of lane `ln`.
template <typename T, typename O, int NT>
KILN_DEV void skinny_store(int i, int ln, float s, i64 row0, const T* bias, O* out, int tokens,
                           int n) {
  const int c = i & 3;
  const int nt = (i >> 2) % NT;
  const int mt = (i >> 2) / NT;
  const i64 row = row0 + 16 * mt + (ln >> 2) + 8 * (c >> 1);
  const int tok = 8 * nt + 2 * (ln & 3) + (c & 1);
  if (row < n && tok < tokens) {
    const float b = bias ? ld(bias[row]) : 0.0f;
    out[(i64)tok * n + row] = st<O>(s + b);
  }
}

template <typename T, typename O, int NT, int MT>
KILN_DEV void skinny_gemm(const T* __restrict__ x, const T* __restrict__ w,
                          const T* __restrict__ bias, O* __restrict__ out, int tokens, int n,
                          int k, int w_const) {
  const int lane = threadIdx.x % KILN_WARP;
  const int warp = threadIdx.x / KILN_WARP;
  const int warps = blockDim.x / KILN_WARP;
  const i64 row0 = (i64)blockIdx.x * (16 * MT);
#if defined(KILN_SKINNY_MMA)
  extern __shared__ float skinny_red[];  // [warps][R][32]
  constexpr int R = MT * NT * 4;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int chunks = (k + 31) / 32;
  const T* wrow[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      i64 r = row0 + 16 * mt + 8 * h + g;
      if (r >= n) r = n - 1;
      wrow[mt][h] = w + r * k;
    }
  const T* xrow[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    int tk = 8 * nt + g;
    if (tk >= tokens) tk = tokens - 1;
    xrow[nt] = x + (i64)tk * k;
  }
  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

  int c = warp;
  uint4 wv[2][MT][2];
  if (w_const) skinny_load_w<T, MT>(wv, wrow, c, warps, k, t);
  KILN_PROLOGUE();
  if (!w_const) skinny_load_w<T, MT>(wv, wrow, c, warps, k, t);
  const int step = 2 * warps;
  for (; c < chunks; c += step) {
    uint4 xv[2][NT];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int off = (c + u * warps) * 32 + 8 * t;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        xv[u][nt] = off < k ? *reinterpret_cast<const uint4*>(xrow[nt] + off) : skinny_zero4();
    }
    // The next iteration's weights, in flight during this one's MMAs.
    uint4 wn[2][MT][2];
    skinny_load_w<T, MT>(wn, wrow, c + step, warps, k, t);
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint4 wa = wv[u][mt][0];
        const uint4 wb = wv[u][mt][1];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const uint4 xb = xv[u][nt];
          skinny_mma(acc[mt][nt], wa.x, wb.x, wa.y, wb.y, xb.x, xb.y, x);
          skinny_mma(acc[mt][nt], wa.z, wb.z, wa.w, wb.w, xb.z, xb.w, x);
        }
      }
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) wv[u][mt][h] = wn[u][mt][h];
  }
  // Split-K reduction: every warp's partials to shared memory, then each
  // thread sums one (register, lane) slot over the warps in warp order.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        skinny_red[(warp * R + (mt * NT + nt) * 4 + i) * KILN_WARP + lane] = acc[mt][nt][i];
  __syncthreads();
  for (int v = threadIdx.x; v < R * KILN_WARP; v += blockDim.x) {
    float s = 0.0f;
    for (int q = 0; q < warps; ++q) s += skinny_red[q * R * KILN_WARP + v];
    skinny_store<T, O, NT>(v / KILN_WARP, v % KILN_WARP, s, row0, bias, out, tokens, n);
  }
#else
  // Portable path: one warp per (row, token), lanes over 8-element vectors.
  KILN_PROLOGUE();
  const int kv = k / 8;
  for (int r = warp; r < 16 * MT; r += warps) {
    const i64 row = row0 + r;
    if (row >= n) break;
    const uint4* wr = reinterpret_cast<const uint4*>(w + row * k);
    const float b = bias ? ld(bias[row]) : 0.0f;
    for (int tk = 0; tk < tokens; ++tk) {
      const uint4* xr = reinterpret_cast<const uint4*>(x + (i64)tk * k);
      float a = 0.0f;
      for (int cc = lane; cc < kv; cc += KILN_WARP) {
        float wf[8];
        float xf[8];
        unpack8(wr[cc], w, wf);
        unpack8(xr[cc], x, xf);
#pragma unroll
        for (int e = 0; e < 8; ++e) a += xf[e] * wf[e];
      }
      a = warp_sum(a);
      if (lane == 0) out[(i64)tk * n + row] = st<O>(a + b);
    }
  }
#endif
}

// Entry points: skinny_t<8*NT>_r<MT>_<in>_<out>.
#define KILN_SKINNY(T, S, O, OS, TP, MT)                                                        \
  KILN_GLOBAL void __launch_bounds__(512 / MT)                                                     \
      skinny_t##TP##_r##MT##_##S##_##OS(const T* x, const T* w, const T* bias, O* out,         \
                                         int tokens, int n, int k, int w_const) {               \
    skinny_gemm<T, O, TP / 8, MT>(x, w, bias, out, tokens, n, k, w_const);                      \
  }
#define KILN_SKINNY_TILES(T, S, O, OS)                                                          \
  KILN_SKINNY(T, S, O, OS, 8, 1) KILN_SKINNY(T, S, O, OS, 16, 1)                              \
  KILN_SKINNY(T, S, O, OS, 24, 1) KILN_SKINNY(T, S, O, OS, 32, 1)                             \
  KILN_SKINNY(T, S, O, OS, 8, 2) KILN_SKINNY(T, S, O, OS, 16, 2)                              \
  KILN_SKINNY(T, S, O, OS, 24, 2) KILN_SKINNY(T, S, O, OS, 32, 2)
KILN_SKINNY_TILES(kbf16, bf16, kbf16, bf16)
KILN_SKINNY_TILES(kbf16, bf16, float, f32)
KILN_SKINNY_TILES(kf16, f16, kf16, f16)
KILN_SKINNY_TILES(kf16, f16, float, f32)
