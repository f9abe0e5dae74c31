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
