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
//     or, in the half-tile entries (`r<MT>h`, eight tokens, H = 1 in
//     skinny_body), MT tiles of 8: the A operand's rows g + 8 are zeros,
//     so a lane loads one weight vector per chunk instead of two and keeps
//     accumulators 0 and 1 only. They double the grid where 16-row tiles
//     would leave SMs idle (kiln_kernels::gpu::SKINNY_HALF_BELOW);
//   * the block's W warps split K: warp w takes the 32-element k-chunks
//     w, w+W, w+2W, ... (two per iteration, the next iteration's two in
//     flight while they are multiplied), so
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
// PDL: the first two iterations' weights are loaded before KILN_PROLOGUE()
// only when w_const (the weights never change while a plan is loaded); x,
// bias and the output are touched only after it.
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
// wv[u][mt][h] is row 16*mt + 8*h + g of the block's tile (8*mt + g of a
// half tile, H = 1) at element 32*(c + u*warps) + 8t, zero past the end of
// k.
template <typename T, int MT, int H>
KILN_DEV void skinny_load_w(uint4 (&wv)[2][MT][H], const T* const (&wrow)[MT][H], int c, int warps,
                            int k, int t) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int off = (c + u * warps) * 32 + 8 * t;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < H; ++h)
        wv[u][mt][h] =
            off < k ? *reinterpret_cast<const uint4*>(wrow[mt][h] + off) : skinny_zero4();
  }
}
#endif

// The output of reduced slot `i` of lane `ln` (PTX's accumulator layout,
// see the top): its row offset in the block's rows and its token. A slot
// index is (mt * NT + nt) * 2H + c over a tile's 2H kept registers c: all
// four of a 16-row tile (H = 2), the first two of a half tile (H = 1),
// whose registers 2 and 3 are the zero rows g + 8 and are never kept.
template <int NT, int H>
KILN_DEV void skinny_slot(int i, int ln, int& roff, int& tok) {
  const int c = i % (2 * H);
  const int nt = (i / (2 * H)) % NT;
  const int mt = (i / (2 * H)) / NT;
  roff = 8 * H * mt + (ln >> 2) + 8 * (c >> 1);
  tok = 8 * nt + 2 * (ln & 3) + (c & 1);
}

// Writes reduced slot `i` of lane `ln` (skinny_slot).
template <typename T, typename O, int NT, int H>
KILN_DEV void skinny_store(int i, int ln, float s, i64 row0, const T* bias, O* out, int tokens,
                           int n) {
  int roff, tok;
  skinny_slot<NT, H>(i, ln, roff, tok);
  const i64 row = row0 + roff;
  if (row < n && tok < tokens) {
    const float b = bias ? ld(bias[row]) : 0.0f;
    out[(i64)tok * n + row] = st<O>(s + b);
  }
}

// The fused epilogue modes (fused_matmul; the same numbers as gemv.cu's).
#define KILN_SKINNY_NONE 0
#define KILN_SKINNY_SILU 1
#define KILN_SKINNY_GELU 2
#define KILN_SKINNY_RESIDUAL 3

// Every token row's inverse RMS for the fused RMSNorm prologue (x is
// T x K, T <= 8, L2-resident): the whole block sums, thread i taking the
// 8-element chunks i, i + blockDim, ... of every row, one chunk of each
// row in flight per pass, so up to K = 8 * blockDim elements take one L2
// round trip (a warp per row took K / 256 of them in turn; two chunks a
// row cost 32 more registers, live beside the weights loaded before the
// wait, for one round trip saved only past K = 2048); then one warp
// reduction per row and the warps' partials added in warp order by thread
// t (deterministic). Every thread must call it; it synchronizes the block
// before and after, so inv is ready when it returns.
template <typename T>
KILN_DEV void skinny_inv_rms_rows(const T* __restrict__ x, int tokens, int k, float eps,
                                  float* inv, float* part) {
  const int lane = threadIdx.x % KILN_WARP;
  const int warp = threadIdx.x / KILN_WARP;
  const int warps = blockDim.x / KILN_WARP;
  const int kv = k / 8;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float ss[8];
#pragma unroll
  for (int t = 0; t < 8; ++t) ss[t] = 0.0f;
  for (int c = threadIdx.x; c < kv; c += blockDim.x) {
    uint4 v[8];
#pragma unroll
    for (int t = 0; t < 8; ++t)
      if (t < tokens) v[t] = xv[(i64)t * kv + c];
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      if (t < tokens) {
        float f[8];
        unpack8(v[t], x, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss[t] += f[e] * f[e];
      }
    }
  }
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const float w = warp_sum(ss[t]);
    if (lane == 0 && t < tokens) part[warp * 8 + t] = w;
  }
  __syncthreads();
  if (threadIdx.x < tokens) {
    float s2 = 0.0f;
    for (int q = 0; q < warps; ++q) s2 += part[q * 8 + threadIdx.x];
    inv[threadIdx.x] = 1.0f / sqrtf(s2 / (float)k + eps);
  }
  __syncthreads();
}

// Eight elements of x normalized as rms_norm stores them: x * inv * (w +
// offset), rounded to T, repacked (word j holds elements 2j and 2j + 1).
template <typename T>
KILN_DEV uint4 skinny_norm8(uint4 xv, uint4 nv, float inv, int unit_offset) {
  float xf[8], nf[8];
  unpack8(xv, (const T*)nullptr, xf);
  unpack8(nv, (const T*)nullptr, nf);
  unsigned int wd[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float off = unit_offset ? 1.0f : 0.0f;
    const unsigned int lo = st<T>(xf[2 * j] * inv * (nf[2 * j] + off)).bits;
    const unsigned int hi = st<T>(xf[2 * j + 1] * inv * (nf[2 * j + 1] + off)).bits;
    wd[j] = lo | (hi << 16);
  }
  uint4 r;
  r.x = wd[0];
  r.y = wd[1];
  r.z = wd[2];
  r.w = wd[3];
  return r;
}

// The product and, when FUSED, fused_matmul's prologue and epilogues:
//   PRE   the RMSNorm prologue: every block computes each token row's
//         inverse RMS after the dependency wait (skinny_inv_rms_rows, one
//         block barrier), and each x vector is normalized and rounded to T
//         as it is loaded (the value the unfused rms_norm stores), so the
//         MMA multiplies exactly what the unfused pair would;
//   mode  1 silu / 2 gelu_tanh: w stacks gate rows over up rows ([2I, K]);
//         with MT = 2 (required) a block's tile 0 is gate rows [16b, 16b +
//         16) and tile 1 the up rows I further, so the thread that sums a
//         gate slot over the split-K warps sums the same slot of the up
//         tile and writes act(g) * u, g and u rounded to T first;
//         3 residual: out = round(acc + bias) + res, rounded again, the
//         residual loaded right after the wait (its latency hides behind
//         the weight loop).
// consts: bit 0 the weight, bit 1 the norm weight never change while the
// engine lives. Nothing another kernel writes (x, residual) is read, and
// nothing is written, before KILN_PROLOGUE().
template <typename T, typename O, int NT, int MT, int PRE, bool FUSED, int H = 2>
KILN_DEV void skinny_body(const T* __restrict__ x, const T* __restrict__ w,
                          const T* __restrict__ bias, const T* __restrict__ norm_w,
                          const T* __restrict__ res, O* __restrict__ out, int tokens, int n, int k,
                          int consts, float eps, int unit_offset, int mode) {
  static_assert(!PRE || NT == 1, "the RMSNorm prologue takes at most 8 tokens");
  static_assert(H == 1 || H == 2, "a tile is 16 rows (H = 2) or 8 (H = 1)");
  constexpr int TR = 8 * H;  // rows of one tile
  const int lane = threadIdx.x % KILN_WARP;
  const int warp = threadIdx.x / KILN_WARP;
  const int warps = blockDim.x / KILN_WARP;
  const int w_const = consts & 1;
  const bool act = FUSED && (mode == KILN_SKINNY_SILU || mode == KILN_SKINNY_GELU);
  // Under an activation tile mt is rows [mt * n/2 + TR*b, ... + TR) of the
  // stacked weight; otherwise the block's MT consecutive tiles.
  const i64 half = act ? (i64)(n / 2) : 0;
  const i64 row0 = act ? (i64)blockIdx.x * TR : (i64)blockIdx.x * (TR * MT);
  const i64 tile_rows = act ? half : (i64)n;  // rows of the output space
#if defined(KILN_SKINNY_MMA)
  extern __shared__ float skinny_red[];  // [warps][R][32]
  __shared__ float inv_rms[PRE ? 8 : 1];
  __shared__ float rms_part[PRE ? 16 * 8 : 1];  // [warps][8 tokens]
  constexpr int R = MT * NT * 2 * H;  // kept accumulator slots per lane
  const int g = lane >> 2;
  const int t = lane & 3;
  const int chunks = (k + 31) / 32;
  const T* wrow[MT][H];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < H; ++h) {
      i64 r = act ? row0 + 8 * h + g : row0 + TR * mt + 8 * h + g;
      if (r >= tile_rows) r = tile_rows - 1;
      wrow[mt][h] = w + (r + (act ? mt * half : 0)) * k;
    }
  const T* xrow[NT];
  int xtok[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    int tk = 8 * nt + g;
    if (tk >= tokens) tk = tokens - 1;
    xtok[nt] = tk;
    xrow[nt] = x + (i64)tk * k;
  }
  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

  // Two iterations of weights in flight (wv this one's, wn the next's):
  // each iteration issues the one after next as soon as its own are
  // multiplied, so the weight stream never waits behind the x loads (a
  // lookahead of one iteration issued after the x loads left session 40's
  // 64-block o_proj at a fifth of DRAM peak). Constant weights go out
  // before the dependency wait; under the RMSNorm prologue the second
  // iteration's only after it, so its row loads and these never hold
  // registers together (168 registers, one block per SM, otherwise).
  int c = warp;
  const int step = 2 * warps;
  uint4 wv[2][MT][H];
  uint4 wn[2][MT][H];
  if (w_const) {
    skinny_load_w<T, MT, H>(wv, wrow, c, warps, k, t);
    if (!PRE) skinny_load_w<T, MT, H>(wn, wrow, c + step, warps, k, t);
  }
  KILN_PROLOGUE();
  if (!w_const) {
    skinny_load_w<T, MT, H>(wv, wrow, c, warps, k, t);
    if (!PRE) skinny_load_w<T, MT, H>(wn, wrow, c + step, warps, k, t);
  }
  // The residual of the slots this thread stores (see the store loop).
  constexpr int RES_SLOTS = 4;
  float rres[RES_SLOTS] = {};
  if (FUSED && mode == KILN_SKINNY_RESIDUAL) {
#pragma unroll
    for (int j = 0; j < RES_SLOTS; ++j) {
      const int v = threadIdx.x + j * blockDim.x;
      if (v < R * KILN_WARP) {
        int roff, tok;
        skinny_slot<NT, H>(v / KILN_WARP, v % KILN_WARP, roff, tok);
        const i64 row = row0 + roff;
        if (row < n && tok < tokens) rres[j] = ld(res[(i64)tok * n + row]);
      }
    }
  }
  float inv[NT];
  if (PRE) {
    skinny_inv_rms_rows<T>(x, tokens, k, eps, inv_rms, rms_part);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) inv[nt] = inv_rms[xtok[nt]];
    skinny_load_w<T, MT, H>(wn, wrow, c + step, warps, k, t);
  }
  for (; c < chunks; c += step) {
    uint4 xv[2][NT];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int off = (c + u * warps) * 32 + 8 * t;
      uint4 nv = skinny_zero4();
      if (PRE && off < k) nv = *reinterpret_cast<const uint4*>(norm_w + off);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        xv[u][nt] = off < k ? *reinterpret_cast<const uint4*>(xrow[nt] + off) : skinny_zero4();
        if (PRE && off < k) xv[u][nt] = skinny_norm8<T>(xv[u][nt], nv, inv[nt], unit_offset);
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint4 wa = wv[u][mt][0];
        // A half tile's rows g + 8 are zeros: the MMA's lower half is idle
        // (tensor-core time is not what a skinny product waits for).
        const uint4 wb = H == 2 ? wv[u][mt][H - 1] : skinny_zero4();
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
        for (int h = 0; h < H; ++h) wv[u][mt][h] = wn[u][mt][h];
    skinny_load_w<T, MT, H>(wn, wrow, c + 2 * step, warps, k, t);
  }
  // Split-K reduction: every warp's partials to shared memory, then each
  // thread sums one (register, lane) slot over the warps in warp order.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 2 * H; ++i)
        skinny_red[(warp * R + (mt * NT + nt) * 2 * H + i) * KILN_WARP + lane] = acc[mt][nt][i];
  __syncthreads();
  // Under an activation only tile 0's slots are walked; each also sums
  // the same slot of tile 1 (its up rows).
  const int slots = (act ? R / 2 : R) * KILN_WARP;
  for (int v = threadIdx.x, j = 0; v < slots; v += blockDim.x, ++j) {
    float s = 0.0f;
    for (int q = 0; q < warps; ++q) s += skinny_red[q * R * KILN_WARP + v];
    if (!FUSED) {
      skinny_store<T, O, NT, H>(v / KILN_WARP, v % KILN_WARP, s, row0, bias, out, tokens, n);
      continue;
    }
    int roff, tok;
    skinny_slot<NT, H>(v / KILN_WARP, v % KILN_WARP, roff, tok);
    const i64 row = row0 + roff;
    if (act) {
      float su = 0.0f;
      const int vu = v + (R / 2) * KILN_WARP;
      for (int q = 0; q < warps; ++q) su += skinny_red[q * R * KILN_WARP + vu];
      if (row < half && tok < tokens) {
        const float bg = bias ? ld(bias[row]) : 0.0f;
        const float bu = bias ? ld(bias[row + half]) : 0.0f;
        const float gg = round_to<T>(s + bg);
        const float uu = round_to<T>(su + bu);
        const float a = mode == KILN_SKINNY_SILU ? kiln_silu(gg) : kiln_gelu_tanh(gg);
        out[(i64)tok * half + row] = st<O>(a * uu);
      }
    } else if (row < n && tok < tokens) {
      float r = s + (bias ? ld(bias[row]) : 0.0f);
      if (mode == KILN_SKINNY_RESIDUAL) {
        const float rv = j < RES_SLOTS ? rres[j] : ld(res[(i64)tok * n + row]);
        r = round_to<T>(r) + rv;
      }
      out[(i64)tok * n + row] = st<O>(r);
    }
  }
#else
  // Portable path: one warp per (row, token), lanes over 8-element vectors;
  // the prologue and epilogues as above, per element.
  KILN_PROLOGUE();
  const int kv = k / 8;
  const int outs = TR * MT;  // output rows of the block (act: TR of them used)
  for (int r = warp; r < (act ? TR : outs); r += warps) {
    const i64 row = row0 + r;
    if (row >= tile_rows) break;
    for (int tk = 0; tk < tokens; ++tk) {
      const uint4* xr = reinterpret_cast<const uint4*>(x + (i64)tk * k);
      float inv = 1.0f;
      if (PRE) {
        float ss = 0.0f;
        for (int cc = lane; cc < kv; cc += KILN_WARP) {
          float xf[8];
          unpack8(xr[cc], x, xf);
#pragma unroll
          for (int e = 0; e < 8; ++e) ss += xf[e] * xf[e];
        }
        inv = 1.0f / sqrtf(warp_sum(ss) / (float)k + eps);
      }
      float a2[2] = {0.0f, 0.0f};
      for (int h = 0; h < (act ? 2 : 1); ++h) {
        const uint4* wr = reinterpret_cast<const uint4*>(w + (row + h * half) * k);
        float a = 0.0f;
        for (int cc = lane; cc < kv; cc += KILN_WARP) {
          uint4 xq = xr[cc];
          if (PRE) xq = skinny_norm8<T>(xq, reinterpret_cast<const uint4*>(norm_w)[cc], inv, unit_offset);
          float wf[8];
          float xf[8];
          unpack8(wr[cc], w, wf);
          unpack8(xq, x, xf);
#pragma unroll
          for (int e = 0; e < 8; ++e) a += xf[e] * wf[e];
        }
        a2[h] = warp_sum(a);
      }
      if (lane != 0) continue;
      if (act) {
        const float bg = bias ? ld(bias[row]) : 0.0f;
        const float bu = bias ? ld(bias[row + half]) : 0.0f;
        const float gg = round_to<T>(a2[0] + bg);
        const float uu = round_to<T>(a2[1] + bu);
        const float a = mode == KILN_SKINNY_SILU ? kiln_silu(gg) : kiln_gelu_tanh(gg);
        out[(i64)tk * half + row] = st<O>(a * uu);
      } else {
        float r2 = a2[0] + (bias ? ld(bias[row]) : 0.0f);
        if (FUSED && mode == KILN_SKINNY_RESIDUAL) r2 = round_to<T>(r2) + ld(res[(i64)tk * n + row]);
        out[(i64)tk * n + row] = st<O>(r2);
      }
    }
  }
#endif
}

template <typename T, typename O, int NT, int MT, int H = 2>
KILN_DEV void skinny_gemm(const T* __restrict__ x, const T* __restrict__ w,
                          const T* __restrict__ bias, O* __restrict__ out, int tokens, int n,
                          int k, int w_const) {
  skinny_body<T, O, NT, MT, 0, false, H>(x, w, bias, nullptr, nullptr, out, tokens, n, k, w_const,
                                         0.0f, 0, KILN_SKINNY_NONE);
}

// Launch bounds: 512 / MT threads, and on CUDA MT blocks per SM, so a
// two-tile block keeps to 128 registers and two of its eight-warp blocks
// share an SM (sixteen warps of loads in flight, as one block of the
// one-tile entries has); HIP's second bound means warps per execution
// unit, so it keeps the thread bound only.
// (A minimum of one block for MT = 1 is not the same hint as none: it
// let ptxas take 92 registers for the fused one-tile entry instead of 58.)
#define KILN_SKINNY_BOUNDS_1 __launch_bounds__(512)
#if defined(KILN_CUDA)
#define KILN_SKINNY_BOUNDS_2 __launch_bounds__(256, 2)
#else
#define KILN_SKINNY_BOUNDS_2 __launch_bounds__(256)
#endif
#define KILN_SKINNY_BOUNDS(MT) KILN_SKINNY_BOUNDS_##MT

// Entry points: skinny_t<8*NT>_r<MT>_<in>_<out>, and the half-tile
// skinny_t8_r1h_<in>_<out> (one tile of 8 rows a block: twice the grid of
// r1, for weights whose 16-row grid would leave SMs idle).
#define KILN_SKINNY(T, S, O, OS, TP, MT)                                                        \
  KILN_GLOBAL void KILN_SKINNY_BOUNDS(MT)                                                     \
      skinny_t##TP##_r##MT##_##S##_##OS(const T* x, const T* w, const T* bias, O* out,         \
                                         int tokens, int n, int k, int w_const) {               \
    skinny_gemm<T, O, TP / 8, MT>(x, w, bias, out, tokens, n, k, w_const);                      \
  }
#define KILN_SKINNY_HALF(T, S, O, OS)                                                           \
  KILN_GLOBAL void KILN_SKINNY_BOUNDS(1)                                                      \
      skinny_t8_r1h_##S##_##OS(const T* x, const T* w, const T* bias, O* out, int tokens,      \
                               int n, int k, int w_const) {                                     \
    skinny_gemm<T, O, 1, 1, 1>(x, w, bias, out, tokens, n, k, w_const);                         \
  }
#define KILN_SKINNY_TILES(T, S, O, OS)                                                          \
  KILN_SKINNY(T, S, O, OS, 8, 1) KILN_SKINNY(T, S, O, OS, 16, 1)                              \
  KILN_SKINNY(T, S, O, OS, 24, 1) KILN_SKINNY(T, S, O, OS, 32, 1)                             \
  KILN_SKINNY(T, S, O, OS, 8, 2) KILN_SKINNY(T, S, O, OS, 16, 2)                              \
  KILN_SKINNY(T, S, O, OS, 24, 2) KILN_SKINNY(T, S, O, OS, 32, 2)                             \
  KILN_SKINNY_HALF(T, S, O, OS)
KILN_SKINNY_TILES(kbf16, bf16, kbf16, bf16)
KILN_SKINNY_TILES(kbf16, bf16, float, f32)
KILN_SKINNY_TILES(kf16, f16, kf16, f16)
KILN_SKINNY_TILES(kf16, f16, float, f32)

// Fused entries (fused_matmul over a dense weight, 2..8 tokens):
// skinny_fused_[norm_]t8_rMT_<in>_<out>, with gemv_fused_*'s parameters
// (x, w, bias, norm_w, res, out, tokens, n, k, consts, eps, unit_offset,
// mode). An activation epilogue takes MT = 2 (its gate and up tiles) and a
// grid over the n / 2 outputs; the others MT = 1. The `h` entries
// (skinny_fused_[norm_]t8_r<MT>h_*) take half tiles of 8 rows, H = 1.
#define KILN_SKINNY_FUSED(T, S, O, OS, MT, HS, H)                                               \
  KILN_GLOBAL void KILN_SKINNY_BOUNDS(MT) skinny_fused_t8_r##MT##HS##_##S##_##OS(         \
      const T* x, const T* w, const T* bias, const T* norm_w, const T* res, O* out, int tokens,  \
      int n, int k, int consts, float eps, int unit_offset, int mode) {                         \
    skinny_body<T, O, 1, MT, 0, true, H>(x, w, bias, norm_w, res, out, tokens, n, k, consts,    \
                                         eps, unit_offset, mode);                               \
  }                                                                                             \
  KILN_GLOBAL void KILN_SKINNY_BOUNDS(MT) skinny_fused_norm_t8_r##MT##HS##_##S##_##OS(    \
      const T* x, const T* w, const T* bias, const T* norm_w, const T* res, O* out, int tokens,  \
      int n, int k, int consts, float eps, int unit_offset, int mode) {                         \
    skinny_body<T, O, 1, MT, 1, true, H>(x, w, bias, norm_w, res, out, tokens, n, k, consts,    \
                                         eps, unit_offset, mode);                               \
  }
#define KILN_SKINNY_FUSED_TILES(T, S, O, OS)                                                    \
  KILN_SKINNY_FUSED(T, S, O, OS, 1, , 2) KILN_SKINNY_FUSED(T, S, O, OS, 2, , 2)               \
  KILN_SKINNY_FUSED(T, S, O, OS, 1, h, 1) KILN_SKINNY_FUSED(T, S, O, OS, 2, h, 1)
KILN_SKINNY_FUSED_TILES(kbf16, bf16, kbf16, bf16)
KILN_SKINNY_FUSED_TILES(kbf16, bf16, float, f32)
KILN_SKINNY_FUSED_TILES(kf16, f16, kf16, f16)
KILN_SKINNY_FUSED_TILES(kf16, f16, float, f32)
