// On-device sampling: argmax (greedy next token) and accept_greedy
// (speculative verification), so the host reads back a few integers.
#include "kiln_port.h"

#define KILN_ARGMAX_THREADS 1024

// One block per row of `vocab` values: the index of the first maximum.
// NaN never compares greater, so it is never picked over a number; a row of
// NaNs yields index 0. Ties go to the smaller index.
template <typename T>
KILN_DEV void argmax_row(const T* __restrict__ x, int* __restrict__ out, int vocab) {
  __shared__ float sv[KILN_ARGMAX_THREADS / KILN_WARP];
  __shared__ int si[KILN_ARGMAX_THREADS / KILN_WARP];
  const T* row = x + (i64)blockIdx.x * vocab;
  float best = -KILN_INF;
  int bi = 0x7fffffff;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float v = ld(row[i]);
    if (v > best || (bi == 0x7fffffff && v == best)) {  // first finite-or-inf candidate wins
      best = v;
      bi = i;
    }
  }
  // Warp then block reduction of (value, index): larger value, then smaller index.
#pragma unroll
  for (int m = KILN_WARP / 2; m > 0; m >>= 1) {
    const float ov = shfl_xor(best, m);
    const int oi = shfl_xor_int(bi, m);
    if (ov > best || (ov == best && oi < bi)) {
      best = ov;
      bi = oi;
    }
  }
  const int lane = threadIdx.x % KILN_WARP, warp = threadIdx.x / KILN_WARP;
  if (lane == 0) {
    sv[warp] = best;
    si[warp] = bi;
  }
  __syncthreads();
  if (warp == 0) {
    const int nw = blockDim.x / KILN_WARP;
    best = lane < nw ? sv[lane] : -KILN_INF;
    bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int m = KILN_WARP / 2; m > 0; m >>= 1) {
      const float ov = shfl_xor(best, m);
      const int oi = shfl_xor_int(bi, m);
      if (ov > best || (ov == best && oi < bi)) {
        best = ov;
        bi = oi;
      }
    }
    if (lane == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
  }
}

#define KILN_ARGMAX_ENTRIES(T, S)                                                              \
  KILN_GLOBAL void __launch_bounds__(KILN_ARGMAX_THREADS)                                      \
      argmax_##S(const T* x, int* out, int vocab) {                                           \
    argmax_row<T>(x, out, vocab);                                                             \
  }
KILN_FOR_FLOATS(KILN_ARGMAX_ENTRIES)

// accepted[b] = number of leading j < spec with drafts[b*spec + j] ==
// pred[b*(spec+1) + j]. One thread per sequence.
KILN_GLOBAL void accept_greedy(const int* __restrict__ pred, const int* __restrict__ drafts,
                               int* __restrict__ accepted, int batch, int spec) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  int n = 0;
  while (n < spec && drafts[(i64)b * spec + n] == pred[(i64)b * (spec + 1) + n]) ++n;
  accepted[b] = n;
}
