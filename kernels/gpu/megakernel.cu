// The megakernel interpreter (skeleton): one persistent kernel per decode
// step whose thread blocks each walk one queue of the plan's task tape
// (kiln_ir::schedule::Tape), waiting on u32 counters in global memory
// instead of kernel boundaries.
//
// Status: written and compiled under NVRTC only; it has never run on a GPU
// and no backend launches it yet. It implements the control path (queue
// walk, acquire waits, release bumps) and one task kind, a GEMV tile; every
// other kind traps. See kernels/src/megakernel.rs for the device records.
//
// Memory model. A task's writes become visible to a waiter as follows: every
// thread of the block stores its results, the block synchronizes, thread 0
// issues a device-scope fence and then bumps the task's counter. A waiter's
// thread 0 spins on the counter with acquire loads, then the block
// synchronizes. Data another block wrote during this launch is read with
// L1-bypassing loads (ld.global.cg), because an SM's L1 is not coherent and
// the arena reuses addresses within a step. Weights are read plainly.
//
// Deadlock freedom is the tape's (verified at load): a task waits only on
// tasks earlier on the tape, each queue is in tape order, and every block of
// the grid (one per queue) is co-resident (occupancy is checked at load
// against the plan's blocks_per_sm).
#include "kiln_port.h"

#define KILN_MK_THREADS 256
#define KILN_MK_WARPS (KILN_MK_THREADS / KILN_WARP)

// Task kinds (kiln_kernels::megakernel::TaskKind).
#define KILN_MK_GEMV_BF16 1
#define KILN_MK_GEMV_BF16_F32 2

// One task, 80 bytes (kiln_kernels::megakernel::DeviceTask).
struct MkTask {
  unsigned int kind;
  unsigned int counter;     // bumped by one when the task is done
  unsigned int wait_begin;  // first wait in the waits array
  unsigned int wait_count;
  unsigned int tile_begin;  // GEMV: output columns [tile_begin, tile_end)
  unsigned int tile_end;
  unsigned int tokens;      // GEMV: rows of x and of out (at most 8)
  unsigned int k;           // GEMV: reduction length (a multiple of 8)
  unsigned int n;           // GEMV: columns of out (its row stride)
  unsigned int pad[3];
  const void* x;
  const void* w;
  const void* bias;  // may be null
  void* out;
};

struct MkWait {
  unsigned int counter;
  unsigned int target;
};

KILN_DEV unsigned int mk_load_acquire(const unsigned int* p) {
#if defined(KILN_CUDA)
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

KILN_DEV void mk_pause() {
#if defined(KILN_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 700)
  __nanosleep(64);
#endif
}

KILN_DEV uint4 mk_ld_cg(const uint4* p) {
#if defined(KILN_CUDA)
  return __ldcg(p);
#else
  return *p;
#endif
}

// One GEMV tile: out[t, j] = sum_k x[t, k] * w[j, k] (+ bias[j]) for the
// tile's columns j, one warp per column. Each lane accumulates the 8-element
// vectors lane, lane + 32, ... in order and the warp sums the lanes: the
// order of gemv.cu's gemv_rows, so a tile's bits are meant to equal the
// graph schedule's GEMV (to be proven on the device).
template <typename O>
KILN_DEV void mk_gemv_tile(const MkTask& t) {
  const int lane = threadIdx.x % KILN_WARP;
  const int warp = threadIdx.x / KILN_WARP;
  const kbf16* x = reinterpret_cast<const kbf16*>(t.x);
  const kbf16* w = reinterpret_cast<const kbf16*>(t.w);
  const kbf16* bias = reinterpret_cast<const kbf16*>(t.bias);
  O* out = reinterpret_cast<O*>(t.out);
  const int kv = (int)(t.k / 8);
  const int tokens = (int)t.tokens;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  for (unsigned int j = t.tile_begin + warp; j < t.tile_end; j += KILN_MK_WARPS) {
    const uint4* wv = reinterpret_cast<const uint4*>(w + (i64)j * t.k);
    float acc[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) acc[r] = 0.0f;
    for (int c = lane; c < kv; c += KILN_WARP) {
      float wf[8];
      unpack8(wv[c], w, wf);
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        if (r < tokens) {
          float xf[8];
          unpack8(mk_ld_cg(&xv[(i64)r * kv + c]), x, xf);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r] += xf[e] * wf[e];
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) acc[r] = warp_sum(acc[r]);
    if (lane == 0) {
      const float b = bias ? ld(bias[j]) : 0.0f;
      for (int r = 0; r < tokens; ++r) out[(i64)r * t.n + j] = st<O>(acc[r] + b);
    }
  }
}

// grid = one block per queue; queue q's tasks are
// queue_tasks[queue_start[q] .. queue_start[q + 1]).
KILN_GLOBAL void __launch_bounds__(KILN_MK_THREADS)
    megakernel_run(const MkTask* __restrict__ tasks, const unsigned int* __restrict__ queue_start,
                   const unsigned int* __restrict__ queue_tasks, const MkWait* __restrict__ waits,
                   unsigned int* counters) {
  const unsigned int q = blockIdx.x;
  const unsigned int end = queue_start[q + 1];
  for (unsigned int i = queue_start[q]; i < end; ++i) {
    const MkTask t = tasks[queue_tasks[i]];
    if (threadIdx.x == 0) {
      for (unsigned int n = 0; n < t.wait_count; ++n) {
        const MkWait wt = waits[t.wait_begin + n];
        while (mk_load_acquire(&counters[wt.counter]) < wt.target) mk_pause();
      }
    }
    __syncthreads();
    switch (t.kind) {
      case KILN_MK_GEMV_BF16:
        mk_gemv_tile<kbf16>(t);
        break;
      case KILN_MK_GEMV_BF16_F32:
        mk_gemv_tile<float>(t);
        break;
      default:
        // A kind this build does not run: the loader refuses such tapes
        // before launch; trap rather than let waiters hang.
        __trap();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(&counters[t.counter], 1u);
    }
  }
}
