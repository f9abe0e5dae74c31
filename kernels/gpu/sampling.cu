// On-device sampling: argmax (greedy next token) and accept_greedy
// (speculative verification), so the host reads back a few integers.
#include "kiln_port.h"

#define KILN_ARGMAX_THREADS 256
#define KILN_ARGMAX_CHUNK 4096

// Keeps (v, i) over (best, bi): larger value, then smaller index. NaN never
// wins over a number (it compares false).
KILN_DEV void argmax_merge(float& best, int& bi, float v, int i) {
  if (v > best || (v == best && i < bi)) {
    best = v;
    bi = i;
  }
}

// Block-wide merge; thread 0 gets the result.
KILN_DEV void argmax_block(float& best, int& bi) {
  __shared__ float sv[KILN_WARP];
  __shared__ int si[KILN_WARP];
#pragma unroll
  for (int m = KILN_WARP / 2; m > 0; m >>= 1)
    argmax_merge(best, bi, shfl_xor(best, m), shfl_xor_int(bi, m));
  const int lane = threadIdx.x % KILN_WARP, warp = threadIdx.x / KILN_WARP;
  if (lane == 0) {
    sv[warp] = best;
    si[warp] = bi;
  }
  __syncthreads();
  if (warp == 0) {
    const int nw = (blockDim.x + KILN_WARP - 1) / KILN_WARP;
    best = lane < nw ? sv[lane] : -KILN_INF;
    bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int m = KILN_WARP / 2; m > 0; m >>= 1)
      argmax_merge(best, bi, shfl_xor(best, m), shfl_xor_int(bi, m));
  }
}

// Stage 1: block (chunk, row) finds the first maximum of its chunk of the
// row and writes (value, index) to scratch. Index 0x7fffffff marks a chunk
// holding no number (all NaN).
template <typename T>
KILN_DEV void argmax_chunk(const T* __restrict__ x, float* __restrict__ pv, int* __restrict__ pi,
                           int vocab, int nchunks) {
  KILN_PROLOGUE();
  const int row = blockIdx.y, chunk = blockIdx.x;
  const T* r = x + (i64)row * vocab;
  const int start = chunk * KILN_ARGMAX_CHUNK;
  const int end = min(start + KILN_ARGMAX_CHUNK, vocab);
  float best = -KILN_INF;
  int bi = 0x7fffffff;
#pragma unroll 4
  for (int i = start + threadIdx.x; i < end; i += blockDim.x) {
    const float v = ld(r[i]);
    if (v > best || (bi == 0x7fffffff && v == best)) {
      best = v;
      bi = i;
    }
  }
  argmax_block(best, bi);
  if (threadIdx.x == 0) {
    pv[(i64)row * nchunks + chunk] = best;
    pi[(i64)row * nchunks + chunk] = bi;
  }
}

// Stage 2: one block per row merges its chunks (a row of NaNs yields 0).
KILN_GLOBAL void argmax_final(const float* __restrict__ pv, const int* __restrict__ pi,
                              int* __restrict__ out, int nchunks) {
  KILN_PROLOGUE();
  const int row = blockIdx.x;
  float best = -KILN_INF;
  int bi = 0x7fffffff;
  for (int c = threadIdx.x; c < nchunks; c += blockDim.x) {
    const int i = pi[(i64)row * nchunks + c];
    if (i != 0x7fffffff) argmax_merge(best, bi, pv[(i64)row * nchunks + c], i);
  }
  argmax_block(best, bi);
  if (threadIdx.x == 0) out[row] = bi == 0x7fffffff ? 0 : bi;
}

#define KILN_ARGMAX_ENTRIES(T, S)                                                              \
  KILN_GLOBAL void __launch_bounds__(KILN_ARGMAX_THREADS)                                      \
      argmax_chunk_##S(const T* x, float* pv, int* pi, int vocab, int nchunks) {              \
    argmax_chunk<T>(x, pv, pi, vocab, nchunks);                                               \
  }
KILN_FOR_FLOATS(KILN_ARGMAX_ENTRIES)

// accepted[b] = number of leading j < spec with drafts[b*spec + j] ==
// pred[b*(spec+1) + j]. One thread per sequence.
KILN_GLOBAL void accept_greedy(const int* __restrict__ pred, const int* __restrict__ drafts,
                               int* __restrict__ accepted, int batch, int spec) {
  KILN_PROLOGUE();
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  int n = 0;
  while (n < spec && drafts[(i64)b * spec + n] == pred[(i64)b * (spec + 1) + n]) ++n;
  accepted[b] = n;
}

// ---------------------------------------------------------------------------
// sample: the in-graph sampler. One block per row. The normative algorithm is
// kiln-kernels' cpu::sample module docs; this is that algorithm step by step:
// (1) max and argmax (greedy rows stop here, bit-identical to argmax);
// (2) p = prob((x - m) / T) and integer weights w = trunc(p * 2^40);
// (3) top-k and top-p thresholds by a 4-pass radix select over the bits of
//     p (8 bits per pass, counts or u64 masses per bin; integer sums, so the
//     result does not depend on the order of the atomics), min-p directly;
// (4) the draw: a Philox4x32-10 uniform, target = floor(Z * r / 2^24), and a
//     prefix walk in index order (per-thread contiguous segments, a block
//     scan of their sums, then one thread walks its segment).
// Every float step uses _rn intrinsics and explicit fma, so the bits of p
// match the CPU reference.

#define KILN_SAMPLE_THREADS 1024

typedef unsigned long long u64;

KILN_DEV float sample_exp(float z) {
  if (!(z >= -87.0f)) return 0.0f;
  const float y = __fmul_rn(z, 1.44269504088896340736f);
  const float n = floorf(y);
  const float f = __fsub_rn(y, n);
  float p = 1.3215487e-6f;
  p = fmaf(p, f, 1.5252734e-5f);
  p = fmaf(p, f, 0.0001540353f);
  p = fmaf(p, f, 0.0013333558f);
  p = fmaf(p, f, 0.009618129f);
  p = fmaf(p, f, 0.05550411f);
  p = fmaf(p, f, 0.2402265f);
  p = fmaf(p, f, 0.6931472f);
  p = fmaf(p, f, 1.0f);
  const float scale = __uint_as_float((unsigned)((int)n + 127) << 23);
  return fminf(__fmul_rn(p, scale), 1.0f);
}

KILN_DEV float sample_prob(float x, float m, float t) {
  if (isnan(x)) return 0.0f;
  return sample_exp(__fdiv_rn(__fsub_rn(x, m), t));
}

KILN_DEV u64 sample_weight(float p) { return (u64)__fmul_rn(p, 1099511627776.0f); }

KILN_DEV void philox4x32_10(unsigned c[4], unsigned k0, unsigned k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const unsigned hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
    const unsigned hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
    const unsigned n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
  }
}

KILN_DEV u64 warp_sum_u64(u64 v) {
#pragma unroll
  for (int m = KILN_WARP / 2; m > 0; m >>= 1) {
    const unsigned lo = (unsigned)shfl_xor_int((int)(unsigned)v, m);
    const unsigned hi = (unsigned)shfl_xor_int((int)(unsigned)(v >> 32), m);
    v += ((u64)hi << 32) | lo;
  }
  return v;
}

// Sum over the block; every thread gets it. Two barriers.
KILN_DEV u64 block_sum_u64(u64 v, u64* cell) {
  if (threadIdx.x == 0) *cell = 0;
  __syncthreads();
  v = warp_sum_u64(v);
  if (threadIdx.x % KILN_WARP == 0) atomicAdd(cell, v);
  __syncthreads();
  const u64 t = *cell;
  __syncthreads();
  return t;
}

// (0) penalties: a row's (token, count) list, sorted by token, in shared
// memory (n = 0: no penalties, every value is the logit as loaded).
struct SamplePen {
  const int* tok;
  const int* cnt;
  int n;
  float presence, frequency;
};

// The row's value at index i after penalties: (x - presence) -
// frequency * count for a listed token with count > 0 (rounded after each
// operation, no fma, as the CPU reference).
template <typename T>
KILN_DEV float sample_ld(const T* __restrict__ r, int i, const SamplePen& pen) {
  const float v = ld(r[i]);
  if (pen.n == 0) return v;
  int lo = 0, hi = pen.n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (pen.tok[mid] < i)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo < pen.n && pen.tok[lo] == i && pen.cnt[lo] > 0)
    return __fsub_rn(__fsub_rn(v, pen.presence), __fmul_rn(pen.frequency, (float)pen.cnt[lo]));
  return v;
}

// The largest bit pattern b of p among tokens with bits >= lo such that the
// tokens with bits >= b weigh at least `target` (weights: 1 each, or w).
template <typename T>
KILN_DEV unsigned sample_select(const T* __restrict__ r, const SamplePen& pen, int vocab, float m,
                                float t, unsigned lo, bool by_mass, u64 target, u64* hist,
                                unsigned* sh_prefix, u64* sh_above) {
  unsigned prefix = 0;
  u64 above = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    const unsigned hi_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
      const float p = sample_prob(sample_ld(r, i, pen), m, t);
      const unsigned bits = __float_as_uint(p);
      if (bits >= lo && (bits & hi_mask) == prefix)
        atomicAdd(&hist[(bits >> shift) & 255u], by_mass ? sample_weight(p) : (u64)1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int b = 255;
      u64 cum = above;
      for (; b > 0; --b) {
        if (cum + hist[b] >= target) break;
        cum += hist[b];
      }
      *sh_prefix = prefix | ((unsigned)b << shift);
      *sh_above = cum;
    }
    __syncthreads();
    prefix = *sh_prefix;
    above = *sh_above;
    __syncthreads();
  }
  return prefix;
}

template <typename T>
KILN_DEV void sample_rows(const T* __restrict__ x, const float* __restrict__ params,
                          const int* __restrict__ seeds, const int* __restrict__ pens,
                          int pen_width, int* __restrict__ ptok, int* __restrict__ pcnt,
                          int* __restrict__ out, int vocab) {
  KILN_PROLOGUE();
  __shared__ u64 hist[256];
  __shared__ u64 scan[KILN_SAMPLE_THREADS];
  __shared__ u64 cell;
  __shared__ unsigned sh_prefix;
  __shared__ u64 sh_above;
  __shared__ float sh_max;
  __shared__ int sh_arg;
  const int row = blockIdx.x;
  const T* r = x + (i64)row * vocab;
  const float t = params[row * 4], top_p = params[row * 4 + 1], min_p = params[row * 4 + 2];
  const int top_k = seeds[row * 4];

  // (0) the penalty list: pairs up to the first one out of range or order.
  SamplePen pen = {ptok, pcnt, 0, 0.0f, 0.0f};
  if (pens != nullptr) {
    __shared__ int sh_n;
    const int* pr = pens + (i64)row * pen_width;
    const int slots = (pen_width - 2) / 2;
    pen.presence = __int_as_float(pr[0]);
    pen.frequency = __int_as_float(pr[1]);
    if (threadIdx.x == 0) sh_n = slots;
    __syncthreads();
    for (int j = threadIdx.x; j < slots; j += blockDim.x) {
      const int tj = pr[2 + 2 * j];
      ptok[j] = tj;
      pcnt[j] = pr[3 + 2 * j];
      if (tj < 0 || tj >= vocab || (j > 0 && tj <= pr[2 * j])) atomicMin(&sh_n, j);
    }
    __syncthreads();
    if (!(pen.presence == 0.0f && pen.frequency == 0.0f)) pen.n = sh_n;
  }

  // (1) max and argmax under argmax's NaN rule.
  float best = -KILN_INF;
  int bi = 0x7fffffff;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = sample_ld(r, i, pen);
    if (v > best || (bi == 0x7fffffff && v == best)) {
      best = v;
      bi = i;
    }
  }
  argmax_block(best, bi);
  if (threadIdx.x == 0) {
    sh_max = best;
    sh_arg = bi == 0x7fffffff ? 0 : bi;
  }
  __syncthreads();
  const float m = sh_max;
  if (!(t > 0.0f) || isinf(m) || isnan(m)) {
    if (threadIdx.x == 0) out[row] = sh_arg;
    return;
  }

  // (3) thresholds on the bits of p.
  unsigned tk = 0;
  if (top_k > 0 && top_k < vocab)
    tk = sample_select(r, pen, vocab, m, t, 0u, false, (u64)top_k, hist, &sh_prefix, &sh_above);
  unsigned tp = 0;
  if (top_p < 1.0f) {
    u64 local = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
      const float p = sample_prob(sample_ld(r, i, pen), m, t);
      if (__float_as_uint(p) >= tk) local += sample_weight(p);
    }
    const u64 zk = block_sum_u64(local, &cell);
    u64 target = (u64)__dmul_rn((double)fmaxf(top_p, 0.0f), __ull2double_rn(zk));
    if (target < 1) target = 1;
    tp = sample_select(r, pen, vocab, m, t, tk, true, target, hist, &sh_prefix, &sh_above);
  }
  const unsigned tm = min_p > 0.0f ? __float_as_uint(fminf(min_p, 1.0f)) : 0u;
  const unsigned thr = max(tk, max(tp, tm));

  // (4) the draw: contiguous segments, a block scan, one thread walks.
  const int per = (vocab + blockDim.x - 1) / blockDim.x;
  const int begin = min(vocab, (int)threadIdx.x * per), end = min(vocab, begin + per);
  u64 seg = 0;
  for (int i = begin; i < end; ++i) {
    const float p = sample_prob(sample_ld(r, i, pen), m, t);
    if (__float_as_uint(p) >= thr) seg += sample_weight(p);
  }
  scan[threadIdx.x] = seg;
  __syncthreads();
  for (int off = 1; off < (int)blockDim.x; off <<= 1) {
    const u64 add = threadIdx.x >= (unsigned)off ? scan[threadIdx.x - off] : 0;
    __syncthreads();
    scan[threadIdx.x] += add;
    __syncthreads();
  }
  const u64 z = scan[blockDim.x - 1];
  unsigned c[4] = {(unsigned)seeds[row * 4 + 3], 0u, 0x6b696c6eu, 0u};
  philox4x32_10(c, (unsigned)seeds[row * 4 + 1], (unsigned)seeds[row * 4 + 2]);
  const u64 r24 = c[0] >> 8;
  const u64 target = (z >> 24) * r24 + (((z & 0xFFFFFFull) * r24) >> 24);
  const u64 incl = scan[threadIdx.x], excl = incl - seg;
  if (excl <= target && target < incl) {
    u64 cum = excl;
    for (int i = begin; i < end; ++i) {
      const float p = sample_prob(sample_ld(r, i, pen), m, t);
      if (__float_as_uint(p) >= thr) cum += sample_weight(p);
      if (cum > target) {
        out[row] = i;
        break;
      }
    }
  }
}

// The penalised variant (sample_pen_*) takes the i32[R, pen_width]
// penalties operand; its row's list lives in shared memory (at most
// KILN_MAX_PENALTY_SLOTS pairs, kiln_ir::op::MAX_PENALTY_SLOTS).
#define KILN_MAX_PENALTY_SLOTS 1024
#define KILN_SAMPLE_ENTRIES(T, S)                                                              \
  KILN_GLOBAL void __launch_bounds__(KILN_SAMPLE_THREADS)                                      \
      sample_##S(const T* x, const float* params, const int* seeds, int* out, int vocab) {      \
    sample_rows<T>(x, params, seeds, nullptr, 0, nullptr, nullptr, out, vocab);                \
  }                                                                                            \
  KILN_GLOBAL void __launch_bounds__(KILN_SAMPLE_THREADS)                                      \
      sample_pen_##S(const T* x, const float* params, const int* seeds, const int* pens,       \
                     int pen_width, int* out, int vocab) {                                     \
    __shared__ int ptok[KILN_MAX_PENALTY_SLOTS];                                               \
    __shared__ int pcnt[KILN_MAX_PENALTY_SLOTS];                                               \
    sample_rows<T>(x, params, seeds, pens, pen_width, ptok, pcnt, out, vocab);                 \
  }
KILN_FOR_FLOATS(KILN_SAMPLE_ENTRIES)
