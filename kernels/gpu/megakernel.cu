// The megakernel interpreter: one persistent kernel per decode step whose
// thread blocks each walk one queue of the plan's task tape
// (kiln_ir::schedule::Tape), waiting on u32 counters in global memory
// instead of kernel boundaries. Each task is a tile of one planned op (see
// kiln_ir::schedule::footprint for what a tile reads and writes); the
// records are encoded by kernels/src/megakernel.rs (encode_tape).
//
// Status: every op of a default bf16 llama / qwen3 / gemma-family decode
// plan has a task kind here. Every kind has run once on an H200 against the
// CPU reference over hand-built tapes (kernels/tests/megakernel_gpu.rs), and
// whole compiled plans' tapes give the graph schedule's tokens
// (tests/tests/cuda_serve.rs). Semantics are the CPU reference kernels'
// (kiln_kernels::cpu)
// with the graph kernels' rounding points; where the graph kernels depart
// from the reference on bad integer inputs (an out-of-range slot is
// skipped, an out-of-range token id gives a zero row) this does the same.
//
// Memory model. A task's writes become visible to a waiter as follows: every
// thread of the block stores its results, the block synchronizes, thread 0
// bumps the task's counter with a device-scope release add. A waiter's
// threads spin on the task's counters with acquire loads (each thread its
// share of the waits, so a task waiting on a hundred tiles pays about one
// round trip, not a hundred), then the block synchronizes. Data another block may have written during this launch
// (activations, the KV cache, token ids and the other per-step inputs) is
// read with L1-bypassing loads (ld.global.cg), because an SM's L1 is not
// coherent and the arena reuses addresses within a step. Weights, norm
// weights, biases, the RoPE tables and the block tables are read plainly.
// A GEMV tile copies the first of its weight rows that fit the launch's
// dynamic shared memory there with cp.async (mk_stage_w), and it does so
// one task early: when a block starts a task it issues the copies for the
// next task on its queue into the bytes the current task's stage leaves
// free (mk_stage_next: a two-ended ring, consecutive stages at opposite
// ends), so those weights arrive while the current task waits and
// computes; a tile the look-ahead could not place stages itself when it
// starts, with the whole buffer. Weights never depend on a wait, so either
// is correct; after the waits only the activations and any rows beyond the
// stage are loaded. The rest of a tile, and any other task's weights, L2
// is asked to prefetch. Once the waits are met, the block asks L2 for what
// the next task's stage does not hold (its first KILN_MK_PREFETCH_NEXT
// bytes), which then stream in while this task computes.
//
// Deadlock freedom is the tape's (verified at load): a task waits only on
// tasks earlier on the tape, each queue is in tape order, and every block of
// the grid (one per queue) is co-resident (occupancy is checked at load
// against the plan's blocks_per_sm). Static shared memory holds
// KILN_MK_SMEM_FLOATS floats of scratch, the GEMV's staged activations and
// the current task's record; the dynamic shared memory the launch grants
// (%dynamic_smem_size, 0 or kiln_kernels::megakernel::WEIGHT_STAGE_BYTES at
// most, decided at load by the backend) is the GEMV weight stage.
#include "kiln_port.h"

#define KILN_MK_THREADS 256
#define KILN_MK_WARPS (KILN_MK_THREADS / KILN_WARP)
#define KILN_MK_SMEM_FLOATS 1344
#define KILN_MK_NORM_MAX 8192
#define KILN_MK_MAX_HEAD_DIM 256
#define KILN_MK_PREFETCH_MAX (4u << 20)
// The look-ahead prefetch's cap per block: 132 queues x 256 KB stays under
// an H200's 50 MB L2.
#define KILN_MK_PREFETCH_NEXT (256u << 10)
// A/B knobs of that look-ahead (off by default): KILN_MK_PREFETCH_EARLY 1
// issues it when the task starts, before its waits, instead of after them;
// KILN_MK_PREFETCH_AHEAD 2 also asks for the task after the next one. On an
// H100 (bench/results/gpu-2026-12-07-s36, one call) EARLY took SmolLM2-135M
// / Qwen3-0.6B / Llama-3.2-1B from 1.159 / 1.611 / 1.816 to 1.134 / 1.591
// / 1.818 ms (faster tiles, slower hops: the polls wait behind the
// prefetches), AHEAD 2 to 1.378 / 1.865 / 2.099.
#ifndef KILN_MK_PREFETCH_EARLY
#define KILN_MK_PREFETCH_EARLY 0
#endif
#ifndef KILN_MK_PREFETCH_AHEAD
#define KILN_MK_PREFETCH_AHEAD 1
#endif

// Task kinds (kiln_kernels::megakernel::TaskKind).
#define KILN_MK_GEMV_BF16 1
#define KILN_MK_GEMV_BF16_F32 2
#define KILN_MK_GEMV_ARGMAX 3
#define KILN_MK_EMBEDDING 4
#define KILN_MK_RMS_NORM 5
#define KILN_MK_ADD_RMS_NORM 6
#define KILN_MK_QKV_ROPE_KV_WRITE 7
#define KILN_MK_PAGED_ATTENTION 8
#define KILN_MK_ATTENTION_COMBINE 15
#define KILN_MK_SILU_MUL 9
#define KILN_MK_GELU_TANH_MUL 10
#define KILN_MK_ADD 11
#define KILN_MK_SCALE 12
#define KILN_MK_ARGMAX 13
#define KILN_MK_GATHER_LAST 14

// One task, 192 bytes (kiln_kernels::megakernel::DeviceTask). The meaning
// of i[], f[] and p[] per kind is documented on TaskKind and at each
// task's function below.
struct MkTask {
  unsigned int kind;
  unsigned int counter;     // bumped by one when the task is done
  unsigned int wait_begin;  // first wait in the waits array
  unsigned int wait_count;
  unsigned int tile_begin;  // the tile: a range of the op's units
  unsigned int tile_end;
  unsigned int reserved[2];
  int i[16];                    // byte 32
  float f[4];                   // byte 96
  unsigned long long p[10];     // byte 112: device addresses, 0 = null
};
static_assert(sizeof(MkTask) == 192, "MkTask is 192 bytes");

struct MkWait {
  unsigned int counter;
  unsigned int target;
};

#define KILN_MK_NO_INDEX 0x7fffffff

KILN_DEV unsigned int mk_load_acquire(const unsigned int* p) {
#if defined(KILN_CUDA)
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

// The task's completion: a release add at device scope. The block's
// barrier before it orders every thread's stores before thread 0's release
// (causality is transitive through bar.sync), so a waiter whose acquire load
// sees the new count sees the task's results; no full fence is needed.
KILN_DEV void mk_release_add(unsigned int* p) {
#if defined(KILN_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 700)
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
#else
  __threadfence();
  atomicAdd(p, 1u);
#endif
}

// The device's global timer, ns (0 off CUDA): the trace's clock.
KILN_DEV unsigned long long mk_now() {
#if defined(KILN_CUDA)
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  return 0;
#endif
}

// Between two polls of a counter: a short sleep, so 256 polling threads
// leave the SM's issue slots and load pipeline to the block's other work.
// KILN_MK_PAUSE_NS 0 spins instead (an A/B knob, not yet measured).
#ifndef KILN_MK_PAUSE_NS
#define KILN_MK_PAUSE_NS 64
#endif

KILN_DEV void mk_pause() {
#if defined(KILN_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 700)
  if (KILN_MK_PAUSE_NS > 0) __nanosleep(KILN_MK_PAUSE_NS);
#endif
}

// ---- L1-bypassing loads (data written during this launch) ----
KILN_DEV uint4 mk_ld_cg(const uint4* p) {
#if defined(KILN_CUDA)
  return __ldcg(p);
#else
  return *p;
#endif
}
KILN_DEV uint2 mk_ld_cg2(const uint2* p) {
#if defined(KILN_CUDA)
  return __ldcg(p);
#else
  return *p;
#endif
}
KILN_DEV float4 mk_ld_cg4(const float4* p) {
#if defined(KILN_CUDA)
  return __ldcg(p);
#else
  return *p;
#endif
}
KILN_DEV int mk_ld_cg_int(const int* p) {
#if defined(KILN_CUDA)
  return __ldcg(p);
#else
  return *p;
#endif
}
KILN_DEV float mk_ld_cg_f32(const float* p) {
#if defined(KILN_CUDA)
  return __ldcg(p);
#else
  return *p;
#endif
}
KILN_DEV unsigned short mk_ld_cg_u16(const unsigned short* p) {
#if defined(KILN_CUDA)
  return __ldcg(p);
#else
  return *p;
#endif
}
KILN_DEV float mk_ld_bf(const kbf16* p) {
  kbf16 v;
  v.bits = mk_ld_cg_u16(&p->bits);
  return ld(v);
}

// Eight consecutive bf16 (16-byte aligned) as f32, through L2.
KILN_DEV void mk_load8(const kbf16* p, float* o) {
  unpack8(mk_ld_cg(reinterpret_cast<const uint4*>(p)), p, o);
}
// Eight consecutive f32 (16-byte aligned), through L2.
KILN_DEV void mk_load8(const float* p, float* o) {
  const float4 a = mk_ld_cg4(reinterpret_cast<const float4*>(p));
  const float4 b = mk_ld_cg4(reinterpret_cast<const float4*>(p) + 1);
  o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
  o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
// Eight bf16 of a weight (plain load).
KILN_DEV void mk_load8_w(const kbf16* p, float* o) {
  unpack8(*reinterpret_cast<const uint4*>(p), p, o);
}
// Eight values rounded to bf16 (round to nearest even), one 16-byte store.
KILN_DEV void mk_store8(kbf16* p, const float* v) {
  unsigned int w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    w[k] = (unsigned int)st<kbf16>(v[2 * k]).bits |
           ((unsigned int)st<kbf16>(v[2 * k + 1]).bits << 16);
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}
KILN_DEV void mk_store8(float* p, const float* v) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Asks L2 to fetch `bytes` (a multiple of 16) at `p` (16-byte aligned),
// capped at KILN_MK_PREFETCH_MAX; every thread of the block takes a share.
// A hint: no effect on results.
KILN_DEV void mk_prefetch_l2(const void* p, unsigned long long bytes,
                             unsigned long long cap = KILN_MK_PREFETCH_MAX) {
#if defined(KILN_CUDA)
  if (p == nullptr) return;
  if (bytes > cap) bytes = cap;
  const char* c = reinterpret_cast<const char*>(p);
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  for (unsigned long long off = (unsigned long long)threadIdx.x * 4096; off < bytes;
       off += (unsigned long long)KILN_MK_THREADS * 4096) {
    unsigned long long left = bytes - off;
    const unsigned int size = (unsigned int)(left < 4096 ? left : 4096) & ~15u;
    if (size != 0)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(c + off), "r"(size)
                   : "memory");
  }
#else
  for (unsigned long long off = (unsigned long long)threadIdx.x * 128; off < bytes;
       off += (unsigned long long)KILN_MK_THREADS * 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));
#endif
#endif
}

// The weight bytes a GEMV task's tile reads: rows [tile_begin, tile_end)
// (and the matching up rows of a gated epilogue); the whole weight (capped)
// for the argmax GEMV.
KILN_DEV void mk_prefetch_attention(const MkTask& t);

KILN_DEV void mk_prefetch(const MkTask& t, unsigned long long cap = KILN_MK_PREFETCH_MAX) {
  const unsigned int kind = t.kind;
  if (kind == KILN_MK_PAGED_ATTENTION) {
    mk_prefetch_attention(t);
    return;
  }
  if (kind != KILN_MK_GEMV_BF16 && kind != KILN_MK_GEMV_BF16_F32 && kind != KILN_MK_GEMV_ARGMAX)
    return;
  const char* w = reinterpret_cast<const char*>(t.p[1]);
  const unsigned long long row = (unsigned long long)t.i[1] * 2;
  if (kind == KILN_MK_GEMV_ARGMAX) {
    mk_prefetch_l2(w, row * (unsigned long long)t.i[2], cap);
    return;
  }
  const unsigned long long rows = t.tile_end - t.tile_begin;
  const bool gated = t.i[6] != 0;
  if (gated) cap /= 2;
  mk_prefetch_l2(w + row * t.tile_begin, row * rows, cap);
  if (gated) mk_prefetch_l2(w + row * (t.tile_begin + (unsigned long long)t.i[6]), row * rows, cap);
}

// ---- GEMV weight staging ----
//
// The launch's dynamic shared memory: one GEMV tile's weight rows, [rows][k]
// bf16 (gated epilogues: the gate rows, then the up rows).
extern __shared__ uint4 mk_ws[];

// Bytes of dynamic shared memory this launch has (0: no staging).
KILN_DEV unsigned int mk_ws_bytes() {
  unsigned int n = 0;
#if defined(KILN_CUDA)
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
#endif
  return n;
}

// How many of GEMV tile t's weight rows (row pairs under a gated epilogue:
// gate row j and up row j + up) the stage of `cap` bytes takes: the first
// ones, as many as fit, an even number unless it is all of them (a warp's
// row pair j, j + 1 is then staged both or neither). 0: none (not a GEMV
// tile, its weight is not constant within the step, i[7] = 0, or not one
// row fits).
KILN_DEV int mk_stage_rows(const MkTask& t, unsigned int cap) {
  if (t.kind != KILN_MK_GEMV_BF16 && t.kind != KILN_MK_GEMV_BF16_F32) return 0;
  if (t.i[7] == 0) return 0;
  const bool gated = t.i[3] == 1 || t.i[3] == 2;
  const int rows = (int)(t.tile_end - t.tile_begin);
  const unsigned long long per = (unsigned long long)t.i[1] * 2ull * (gated ? 2ull : 1ull);
  const unsigned long long fit = per == 0 ? 0 : cap / per;
  if (fit >= (unsigned long long)rows) return rows;
  return gated ? (int)fit : (int)fit & ~1;
}

// The bytes of the stage mk_stage_rows' `srows` rows of tile t fill.
KILN_DEV unsigned int mk_stage_bytes(const MkTask& t, int srows) {
  const bool gated = t.i[3] == 1 || t.i[3] == 2;
  return (unsigned int)srows * (unsigned int)t.i[1] * 2u * (gated ? 2u : 1u);
}

// How the stage's copies travel. On sm_80 and sm_90 every thread issues
// cp.async when the tile starts, waited for by commit group. With
// KILN_MK_USE_TMA defined (sm_90 only) thread 0 issues one bulk copy
// (cp.async.bulk, the TMA engine) per contiguous block of rows instead,
// the block waits on an mbarrier per end of the ring, and the next task's
// tile is staged while the current one runs (KILN_MK_LOOKAHEAD,
// mk_stage_next). That form is kept as an A/B knob, not the default: on an
// H100 (bench/results/gpu-2026-12-07-s35, two calls, b1 step with / without)
// Llama-3.2-1B 1.780 / 1.695 and 1.781 / 1.694 ms, SmolLM2-135M 1.181 /
// 1.152 and 1.184 / 1.157, Qwen3-0.6B 1.508 / 1.499 and 1.476 / 1.519 (a
// wash); session 33 had the look-ahead +0.17 ms on Qwen3-0.6B. Elsewhere
// (HIP) nothing is staged.
#if defined(KILN_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(KILN_MK_USE_TMA)
#define KILN_MK_TMA 1
#else
#define KILN_MK_TMA 0
#endif
#ifndef KILN_MK_LOOKAHEAD
#define KILN_MK_LOOKAHEAD KILN_MK_TMA
#endif

// Where a staged tile sits in mk_ws. The stage is a two-ended ring: a
// tile staged while the block's previous stage (if any) is still being
// read goes at the other end of the buffer, in the bytes that stage left
// free, so the next GEMV tile's weights stream in while the current one
// computes (mk_stage_next). `top` places the rows against the buffer's
// end, `off` is their first 16-byte vector. Each end has its own mbarrier
// (TMA): two stages in flight are never at the same end.
struct MkStage {
  int rows;          // rows (row pairs, gated) staged; 0: none
  unsigned int off;  // first uint4 of mk_ws they occupy
  unsigned int bytes;
  bool top;
};

// The two ends' mbarriers and the parity each one's next completion has
// (bit e for end e): every thread keeps the same copy.
struct MkRing {
  unsigned long long* bar;  // [2] in shared memory
  unsigned int parity;
};

#if KILN_MK_TMA
KILN_DEV unsigned int mk_smem_addr(const void* p) {
  return (unsigned int)__cvta_generic_to_shared(p);
}
KILN_DEV bool mk_bar_try(unsigned int bar, unsigned int parity) {
  unsigned int ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}
// One bulk copy of `bytes` (a multiple of 16) global -> shared, completing
// on `bar`'s transaction count.
KILN_DEV void mk_bulk(void* dst, const void* src, unsigned int bytes, unsigned int bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          mk_smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
#endif

// Sets up the ring's mbarriers (thread 0; the caller's barrier publishes
// them). A no-op without TMA.
KILN_DEV void mk_ring_init(const MkRing& ring) {
#if KILN_MK_TMA
  if (threadIdx.x == 0) {
    for (int e = 0; e < 2; ++e)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(mk_smem_addr(&ring.bar[e]))
                   : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
#else
  (void)ring;
#endif
}

// Issues the copies of the first rows of tile t's weight (see
// mk_stage_rows) into mk_ws, `cap` bytes at most, from the buffer's start
// (top = false) or against its end at `end` bytes (top = true), and says
// where they went (rows 0: none, nothing issued). Weights never change
// within a step, so this may run before the task's waits and even before
// the previous task has computed; the stage is then waited for with
// mk_stage_wait. Every thread calls it (the placement is computed by all).
KILN_DEV MkStage mk_stage_w(const MkTask& t, unsigned int cap, bool top, unsigned int end,
                            const MkRing& ring) {
  MkStage st0{0, 0u, 0u, top};
#if KILN_MK_TMA || (defined(KILN_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800))
  const int srows = mk_stage_rows(t, cap);
  if (srows == 0) return st0;
  const unsigned int bytes = mk_stage_bytes(t, srows);
  st0.rows = srows;
  st0.bytes = bytes;
  st0.off = top ? (end - bytes) / 16u : 0u;
  const i64 rowv = t.i[1] / 8;  // 16-byte vectors per weight row
  const i64 n = (i64)srows * rowv;
  const bool gated = t.i[3] == 1 || t.i[3] == 2;
  const uint4* w = reinterpret_cast<const uint4*>(t.p[1]);
  const uint4* g0 = w + (i64)t.tile_begin * rowv;
  const uint4* u0 = w + ((i64)t.tile_begin + t.i[6]) * rowv;
  uint4* base = mk_ws + st0.off;
#if KILN_MK_TMA
  if (threadIdx.x == 0) {
    const unsigned int bar = mk_smem_addr(&ring.bar[top ? 1 : 0]);
    // Earlier generic-proxy reads of these bytes come before the copy's
    // writes.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    unsigned long long state;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;"
                 : "=l"(state)
                 : "r"(bar), "r"(bytes)
                 : "memory");
    (void)state;
    const unsigned int part = (unsigned int)(n * 16);
    mk_bulk(base, g0, part, bar);
    if (gated) mk_bulk(base + n, u0, part, bar);
  }
#else
  (void)ring;
  for (i64 c = threadIdx.x; c < n; c += KILN_MK_THREADS) {
    const unsigned int s0 = (unsigned int)__cvta_generic_to_shared(&base[c]);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s0), "l"(g0 + c) : "memory");
    if (gated) {
      const unsigned int s1 = (unsigned int)__cvta_generic_to_shared(&base[n + c]);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s1), "l"(u0 + c) : "memory");
    }
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
#else
  (void)t;
  (void)cap;
  (void)end;
  (void)ring;
#endif
  return st0;
}

// Stages the next task's tile (`next`, read from the tape in global
// memory) while the current stage `cur` is still in use: into the bytes
// of the `ws` buffer `cur` leaves free, at the other end from it. Returns
// the next task's stage (rows 0: it did not fit, or is no staged GEMV;
// the next task then stages itself when it starts, with the whole buffer).
KILN_DEV MkStage mk_stage_next(const MkTask& next, const MkStage& cur, unsigned int ws,
                               const MkRing& ring) {
  if (cur.rows == 0) return mk_stage_w(next, ws, false, ws, ring);
  if (cur.top) return mk_stage_w(next, cur.off * 16u, false, ws, ring);
  return mk_stage_w(next, ws - cur.bytes, true, ws, ring);
}

// The stage `st` has landed for this thread (a barrier then makes every
// thread's copies visible to the block; with TMA every thread waits on the
// end's mbarrier itself). `later`: a look-ahead stage was issued after it
// and may still be in flight (cp.async groups complete in order, so
// waiting for all but the newest group suffices).
KILN_DEV void mk_stage_wait(const MkStage& stg, const MkRing& ring, bool later) {
#if KILN_MK_TMA
  (void)later;
  const int e = stg.top ? 1 : 0;
  const unsigned int bar = mk_smem_addr(&ring.bar[e]);
  while (!mk_bar_try(bar, (ring.parity >> e) & 1u)) {
  }
#elif defined(KILN_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
  (void)stg;
  (void)ring;
  if (later)
    asm volatile("cp.async.wait_group 1;" ::: "memory");
  else
    asm volatile("cp.async.wait_all;" ::: "memory");
#else
  (void)stg;
  (void)ring;
  (void)later;
#endif
}

// ---- GEMV tiles ----
//
// A GEMV task first stages its tokens' activations in shared memory
// (mk_stage_x), normalized there once when it has the RMSNorm prologue;
// then each warp takes two weight rows at a time (mk_dot2) and reads x
// from shared memory. One body serves the three GEMV kinds (bf16 or f32
// products, the argmax lm_head), instantiated twice: for one token (TT 1,
// decode at batch 1) and for up to eight (TT 8, predicated). Code size is
// time here: every task runs its kind's code cold out of L2 (the whole
// interpreter is one kernel and no two consecutive tasks of a queue share
// much code), so the GEMV keeps its unrolled paths few and short.

// bf16 elements of staged activations (32 KB): K <= this.
#define KILN_MK_X_STAGE 16384

// Eight f32 rounded to bf16 (round to nearest even) in one uint4.
KILN_DEV uint4 mk_pack8(const float* v) {
  unsigned int w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    w[k] = (unsigned int)st<kbf16>(v[2 * k]).bits |
           ((unsigned int)st<kbf16>(v[2 * k + 1]).bits << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Stages tokens [t0, t0 + tc) of x ([T, k], bf16) into xs ([tc][k / 8]
// vectors). With pre, each token's inverse RMS goes to inv[q] (warp q's
// lanes summing vectors lane, lane + 32, ... then across the warp:
// gemv_fused_dot's order, so the statistic is the graph fused GEMV's) and
// each element becomes round(x * inv * nw) (nw + 1 under unit_offset), as
// rms_norm would store it. Ends with a barrier.
KILN_DEV void mk_stage_x(const kbf16* __restrict__ x, const kbf16* __restrict__ nw, int pre,
                         int unit, float eps, int t0, int tc, int k, uint4* xs, float* inv) {
  const int lane = threadIdx.x % KILN_WARP, warp = threadIdx.x / KILN_WARP;
  const int kv = k / 8;
  const uint4* xv = reinterpret_cast<const uint4*>(x) + (i64)t0 * kv;
  for (int c = threadIdx.x; c < tc * kv; c += KILN_MK_THREADS) xs[c] = mk_ld_cg(&xv[c]);
  __syncthreads();
  if (!pre) return;
  for (int q = warp; q < tc; q += KILN_MK_WARPS) {
    float ss = 0.0f;
    for (int c = lane; c < kv; c += KILN_WARP) {
      float f[8];
      unpack8(xs[q * kv + c], x, f);
#pragma unroll
      for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
    }
    ss = warp_sum(ss);
    if (lane == 0) inv[q] = 1.0f / sqrtf(ss / (float)k + eps);
  }
  __syncthreads();
  const uint4* nv = reinterpret_cast<const uint4*>(nw);
  for (int c = threadIdx.x; c < tc * kv; c += KILN_MK_THREADS) {
    const int q = c / kv, cc = c - q * kv;
    float f[8], nf[8];
    unpack8(xs[c], x, f);
    unpack8(nv[cc], nw, nf);
    const float s = inv[q];
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = f[e] * s * (unit ? nf[e] + 1.0f : nf[e]);
    xs[c] = mk_pack8(f);
  }
  __syncthreads();
}

// This warp's two weight rows r0, r1 times the tc (<= TT) staged tokens.
// Each lane accumulates the 8-element vectors lane, lane + 32, ... in
// order (U of each row in flight, the tail predicated) and the warp sums
// the lanes: gemv.cu's order (gemv_rows with KS = 1, gemv_fused_dot), so
// a tile's sums are the graph GEMV's. acc ends warp-reduced in every lane.
template <int TT, int U>
KILN_DEV void mk_dot2(const uint4* xs, const kbf16* __restrict__ w, i64 r0, i64 r1, int tc,
                      int k, float (&acc)[2][TT]) {
  const int lane = threadIdx.x % KILN_WARP;
  const int kv = k / 8;
  const uint4* wv0 = reinterpret_cast<const uint4*>(w + r0 * k);
  const uint4* wv1 = reinterpret_cast<const uint4*>(w + r1 * k);
#pragma unroll
  for (int q = 0; q < TT; ++q) acc[0][q] = acc[1][q] = 0.0f;
  for (int c = lane; c < kv; c += U * KILN_WARP) {
    uint4 wr[2][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int cc = c + u * KILN_WARP;
      const bool in = cc < kv;
      wr[0][u] = in ? wv0[cc] : make_uint4(0, 0, 0, 0);
      wr[1][u] = in ? wv1[cc] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int cc = c + u * KILN_WARP;
      if (cc < kv) {
        float w0[8], w1[8];
        unpack8(wr[0][u], w, w0);
        unpack8(wr[1][u], w, w1);
#pragma unroll
        for (int q = 0; q < TT; ++q) {
          if (q < tc) {
            float xf[8];
            unpack8(xs[q * kv + cc], w, xf);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[0][q] += xf[e] * w0[e];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[1][q] += xf[e] * w1[e];
          }
        }
      }
    }
  }
#pragma unroll
  for (int q = 0; q < TT; ++q) {
    acc[0][q] = warp_sum(acc[0][q]);
    acc[1][q] = warp_sum(acc[1][q]);
  }
}

// argmax's order (kernels/src/cpu/reduce.rs): NaN never wins, a larger
// value wins, equal values go to the smaller index; KILN_MK_NO_INDEX
// carries nothing.
KILN_DEV void mk_take(float& best, int& bi, float v, int i) {
  if (i == KILN_MK_NO_INDEX || v != v) return;
  if (bi == KILN_MK_NO_INDEX || v > best || (v == best && i < bi)) {
    best = v;
    bi = i;
  }
}

// The block's pair from every thread's (best, bi); thread 0 gets it. Uses
// 2 * KILN_MK_WARPS words of smem; contains two barriers.
KILN_DEV void mk_argmax_block(float& best, int& bi, float* smem) {
  const int lane = threadIdx.x % KILN_WARP, warp = threadIdx.x / KILN_WARP;
#pragma unroll
  for (int m = KILN_WARP / 2; m > 0; m >>= 1) {
    const float v = shfl_xor(best, m);
    const int i = shfl_xor_int(bi, m);
    mk_take(best, bi, v, i);
  }
  int* si = reinterpret_cast<int*>(smem + KILN_MK_WARPS);
  if (lane == 0) {
    smem[warp] = best;
    si[warp] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int q = 1; q < KILN_MK_WARPS; ++q) mk_take(best, bi, smem[q], si[q]);
  }
  __syncthreads();
}

// When the current task's inputs were in shared memory (thread 0 writes
// and reads it): the trace's fourth stamp, no effect on results. A GEMV
// notes it after its first chunk's activations and staged weights landed;
// a traced loop sets it to the waits-met time before every task. It is 0
// for the whole of an untraced run, and the GEMV then reads no timer.
__shared__ unsigned long long mk_ready_at;

// The GEMV kinds. KILN_MK_GEMV_BF16 / _F32: output columns [tile_begin,
// tile_end) of out[T, cols]. i: 0 T, 1 K, 2 cols, 3 epilogue (0 none,
// 1 silu_mul, 2 gelu_tanh_mul, 3 residual), 4 prologue, 5 unit_offset,
// 6 up-row offset (gated), 7 the weight is constant within a step (may be
// staged before the waits). f: 0 eps. p: 0 x, 1 w, 2 bias, 3 norm weight,
// 4 residual, 5 out. Epilogues round where gemv_fused_rows does: gated g
// and u to bf16 before act(g) * u; residual round(acc + bias) + residual.
//
// KILN_MK_GEMV_ARGMAX, fused_matmul{argmax} as a whole op: out[t] = the
// first maximum over the N logits of token t, each rounded to the logit
// dtype as the unfused matmul would store it. i: 0 T, 1 K, 2 N, 3 logit
// dtype (0 bf16, 1 f32), 4 prologue, 5 unit_offset. f: 0 eps. p: 0 x,
// 1 w, 2 bias, 3 norm weight, 5 out (i32).
//
// Lane q of a warp owns token q's outputs (stores, argmax candidates).
// The first `staged` rows (row pairs, gated) of the tile are at `wsb` in
// mk_ws (mk_stage_w issued their copies before the waits, or during the
// previous task: mk_stage_next; `later`: another stage was committed after
// this one and may still be landing): their products read
// them from there, in the same order, so the results are the unstaged ones
// bit for bit; the rest stream from global memory as before.

template <int TT>
KILN_DEV void mk_gemv(const MkTask& t, float* smem, uint4* xs, const MkStage& stg,
                      const MkRing& ring, bool later) {
  const int staged = stg.rows;
  const uint4* wsv = mk_ws + stg.off;
  constexpr int U = TT == 1 ? 8 : 4;
  const int lane = threadIdx.x % KILN_WARP, warp = threadIdx.x / KILN_WARP;
  const unsigned int kind = t.kind;
  const bool am = kind == KILN_MK_GEMV_ARGMAX;
  const int T = t.i[0], k = t.i[1], pre = t.i[4], unit = t.i[5];
  const int cols = t.i[2], mode = am ? 0 : t.i[3], up = am ? 0 : t.i[6];
  const bool f32 = am ? t.i[3] != 0 : kind == KILN_MK_GEMV_BF16_F32;
  const float eps = t.f[0];
  const kbf16* x = reinterpret_cast<const kbf16*>(t.p[0]);
  const kbf16* w = reinterpret_cast<const kbf16*>(t.p[1]);
  const kbf16* bias = reinterpret_cast<const kbf16*>(t.p[2]);
  const kbf16* nw = reinterpret_cast<const kbf16*>(t.p[3]);
  const kbf16* res = reinterpret_cast<const kbf16*>(t.p[4]);
  void* out = reinterpret_cast<void*>(t.p[5]);
  const int j0 = am ? 0 : (int)t.tile_begin, j1 = am ? cols : (int)t.tile_end;
  const bool gated = mode == 1 || mode == 2;
  int tcap = KILN_MK_X_STAGE / k;
  tcap = tcap < TT ? tcap : TT;
  float* wbest = smem + 8;                                           // [warps][8]
  int* widx = reinterpret_cast<int*>(smem + 8 + 8 * KILN_MK_WARPS);  // [warps][8]
  const int rstep = gated ? 1 : 2;
  const kbf16* wsb = reinterpret_cast<const kbf16*>(wsv);
#if defined(KILN_CUDA)
  // Ask L1 for this warp's first two weight rows (already prefetched into
  // L2 while the block waited) so they stream in while the block stages x.
  // After the waits: the acquire polls invalidate L1. A hint only.
  if (j0 + rstep * warp >= j0 + staged && j0 + rstep * warp < j1) {
    const int ja = j0 + rstep * warp;
    const int jb = gated ? ja + up : (ja + 1 < j1 ? ja + 1 : ja);
    const char* wa = reinterpret_cast<const char*>(w + (i64)ja * k);
    const char* wb = reinterpret_cast<const char*>(w + (i64)jb * k);
    for (int off = lane * 128; off < 2 * k; off += KILN_WARP * 128) {
      asm volatile("prefetch.global.L1 [%0];" ::"l"(wa + off));
      asm volatile("prefetch.global.L1 [%0];" ::"l"(wb + off));
    }
  }
#endif
  for (int t0 = 0; t0 < T; t0 += tcap) {
    const int tc = T - t0 < tcap ? T - t0 : tcap;
    mk_stage_x(x, nw, pre, unit, eps, t0, tc, k, xs, smem);
    if (staged > 0 && t0 == 0) {
      mk_stage_wait(stg, ring, later);
      __syncthreads();
    }
    // Only a traced run stamps (mk_ready_at stays 0 untraced: no timer read).
    if (t0 == 0 && threadIdx.x == 0 && mk_ready_at != 0) mk_ready_at = mk_now();
    float best = 0.0f;
    int bi = KILN_MK_NO_INDEX;
    for (int j = j0 + rstep * warp; j < j1; j += rstep * KILN_MK_WARPS) {
      const int jb = gated ? j + up : (j + 1 < j1 ? j + 1 : j);
      float acc[2][TT];
      if (j - j0 < staged)
        mk_dot2<TT, U>(xs, wsb, j - j0, gated ? staged + (j - j0) : jb - j0, tc, k, acc);
      else
        mk_dot2<TT, U>(xs, w, j, jb, tc, k, acc);
      float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
      for (int q = 0; q < TT; ++q)
        if (lane == q) {
          a0 = acc[0][q];
          a1 = acc[1][q];
        }
      const i64 orow = (i64)(t0 + lane) * cols;
      if (lane < tc && gated) {
        const float g = round_to<kbf16>(a0 + (bias ? ld(bias[j]) : 0.0f));
        const float u = round_to<kbf16>(a1 + (bias ? ld(bias[j + up]) : 0.0f));
        const float a = mode == 1 ? kiln_silu(g) : kiln_gelu_tanh(g);
        reinterpret_cast<kbf16*>(out)[orow + j] = st<kbf16>(a * u);
      } else if (lane < tc) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = j + r;
          if (row < j1) {
            float v = (r == 0 ? a0 : a1) + (bias ? ld(bias[row]) : 0.0f);
            if (am) {
              mk_take(best, bi, f32 ? v : round_to<kbf16>(v), row);
            } else {
              if (mode == 3) v = round_to<kbf16>(v) + mk_ld_bf(res + orow + row);
              if (f32)
                reinterpret_cast<float*>(out)[orow + row] = v;
              else
                reinterpret_cast<kbf16*>(out)[orow + row] = st<kbf16>(v);
            }
          }
        }
      }
    }
    if (am) {
      if (lane < 8) {
        wbest[warp * 8 + lane] = best;
        widx[warp * 8 + lane] = bi;
      }
      __syncthreads();
      if (threadIdx.x < tc) {
        const int q = threadIdx.x;
        float b2 = 0.0f;
        int i2 = KILN_MK_NO_INDEX;
        for (int v = 0; v < KILN_MK_WARPS; ++v)
          mk_take(b2, i2, wbest[v * 8 + q], widx[v * 8 + q]);
        reinterpret_cast<int*>(out)[t0 + q] = i2 == KILN_MK_NO_INDEX ? 0 : i2;
      }
    }
    __syncthreads();  // xs, inv and the argmax scratch are reused by the next chunk
  }
}

// ---- Whole-op tasks ----

// embedding: out[t] = table[ids[t]], a zero row for an id outside [0,
// vocab) (as elementwise.cu's embedding_rows). i: 0 T, 1 H, 2 vocab.
// p: 0 ids, 1 table, 2 out.
KILN_DEV void mk_embedding(const MkTask& t) {
  const int T = t.i[0], h8 = t.i[1] / 8, vocab = t.i[2];
  const int* ids = reinterpret_cast<const int*>(t.p[0]);
  const uint4* table = reinterpret_cast<const uint4*>(t.p[1]);
  uint4* out = reinterpret_cast<uint4*>(t.p[2]);
  for (int r = 0; r < T; ++r) {
    const int id = mk_ld_cg_int(ids + r);
    const bool ok = id >= 0 && id < vocab;
    for (int c = threadIdx.x; c < h8; c += KILN_MK_THREADS)
      out[(i64)r * h8 + c] = ok ? table[(i64)id * h8 + c] : make_uint4(0, 0, 0, 0);
  }
}

// rms_norm (KILN_MK_RMS_NORM) and add_rms_norm (KILN_MK_ADD_RMS_NORM), row
// by row over the block, each thread keeping its 8-element chunks c = tid,
// tid + 256, ... in registers (rows up to KILN_MK_NORM_MAX). y = x * inv *
// w (w + 1 under unit_offset), rounded once; add_rms_norm rounds the sum
// first and normalizes the rounded sum (norm.cu's rule). i: 0 T, 1 H,
// 2 unit_offset. f: 0 eps. p (rms_norm): 0 x, 1 w, 2 out; (add_rms_norm):
// 0 x, 1 residual, 2 w, 3 normed, 4 sum.
template <int ADD>
KILN_DEV void mk_rms_norm(const MkTask& t, float* smem) {
  constexpr int PER = KILN_MK_NORM_MAX / 8 / KILN_MK_THREADS;
  const int T = t.i[0], h = t.i[1], unit = t.i[2];
  const int h8 = h / 8;
  const float eps = t.f[0];
  const kbf16* x = reinterpret_cast<const kbf16*>(t.p[0]);
  const kbf16* res = ADD ? reinterpret_cast<const kbf16*>(t.p[1]) : nullptr;
  const kbf16* w = reinterpret_cast<const kbf16*>(ADD ? t.p[2] : t.p[1]);
  kbf16* out = reinterpret_cast<kbf16*>(ADD ? t.p[3] : t.p[2]);
  kbf16* sum = ADD ? reinterpret_cast<kbf16*>(t.p[4]) : nullptr;
  for (int r = 0; r < T; ++r) {
    const i64 base = (i64)r * h;
    float v[PER][8];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int c = threadIdx.x + j * KILN_MK_THREADS;
      if (c < h8) {
        mk_load8(x + base + c * 8, v[j]);
        if (ADD) {
          float rv[8];
          mk_load8(res + base + c * 8, rv);
#pragma unroll
          for (int e = 0; e < 8; ++e) v[j][e] = round_to<kbf16>(v[j][e] + rv[e]);
          mk_store8(sum + base + c * 8, v[j]);
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += v[j][e] * v[j][e];
      }
    }
    ss = block_sum(ss, smem);
    const float inv = 1.0f / sqrtf(ss / (float)h + eps);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int c = threadIdx.x + j * KILN_MK_THREADS;
      if (c < h8) {
        float wf[8];
        mk_load8_w(w + c * 8, wf);
        float y[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) y[e] = v[j][e] * inv * (unit ? 1.0f + wf[e] : wf[e]);
        mk_store8(out + base + c * 8, y);
      }
    }
  }
}

// qkv_rope_kv_write (KILN_MK_QKV_ROPE_KV_WRITE): rope.cu's
// qkv_rope_kv_write_units with a warp per (token, head) looping over the
// task's heads: heads [0, heads) are q heads, then kv_heads k heads, then
// kv_heads v heads. The tile [tile_begin, tile_end) is a range of the op's
// heads + 2 tape units (kiln_ir::schedule::rope_kv_parts): q heads one
// unit each, then all k heads as unit `heads`, all v heads as unit
// `heads + 1`; since that map is monotone the task's heads are one
// contiguous range [h0, h1). q/k: optional per-head RMSNorm (rounded to bf16), then RoPE at the
// token's position, rounded once; v copied; q to q_out, k/v to the token's
// cache slot (a slot outside [0, slots) is skipped). i: 0 T, 1 heads,
// 2 kv_heads, 3 head_dim, 4 q/k norm, 5 unit_offset, 6 slots. f: 0 eps.
// p: 0 qkv, 1 positions, 2 slots, 3 K cache, 4 V cache, 5 q_norm,
// 6 k_norm, 7 q_out, 8 inverse frequencies (f32[head_dim / 2]).
KILN_DEV void mk_qkv_rope_kv_write(const MkTask& t) {
  const int lane = threadIdx.x % KILN_WARP, warp = threadIdx.x / KILN_WARP;
  const int T = t.i[0], heads = t.i[1], kvh = t.i[2], hd = t.i[3], has_norm = t.i[4];
  const int unit_offset = t.i[5];
  const i64 num_slots = t.i[6];
  const float eps = t.f[0];
  const kbf16* qkv = reinterpret_cast<const kbf16*>(t.p[0]);
  const int* pos = reinterpret_cast<const int*>(t.p[1]);
  const int* slots = reinterpret_cast<const int*>(t.p[2]);
  kbf16* kc = reinterpret_cast<kbf16*>(t.p[3]);
  kbf16* vc = reinterpret_cast<kbf16*>(t.p[4]);
  const kbf16* qn = reinterpret_cast<const kbf16*>(t.p[5]);
  const kbf16* kn = reinterpret_cast<const kbf16*>(t.p[6]);
  kbf16* q_out = reinterpret_cast<kbf16*>(t.p[7]);
  const float* fr = reinterpret_cast<const float*>(t.p[8]);
  const int units = heads + 2 * kvh;
  const int tb = (int)t.tile_begin, te = (int)t.tile_end;
  // First and one-past-last head of the tile (see above).
  const int h0 = tb <= heads ? tb : heads + kvh;
  const int h1 = te <= heads ? te : (te == heads + 1 ? heads + kvh : units);
  const int nh = h1 - h0;
  const int half = hd / 2;
  const i64 kvrow = (i64)kvh * hd;
  constexpr int PER = KILN_MK_MAX_HEAD_DIM / 2 / KILN_WARP;
  for (int wu = warp; wu < T * nh; wu += KILN_MK_WARPS) {
    const int tok = wu / nh, u = h0 + wu % nh;
    const kbf16* src = qkv + (i64)tok * units * hd + (i64)u * hd;
    const i64 slot = mk_ld_cg_int(slots + tok);
    const bool slot_ok = slot >= 0 && slot < num_slots;
    if (u >= heads + kvh) {  // v head: copied bit for bit
      if (!slot_ok) continue;
      kbf16* dst = vc + slot * kvrow + (i64)(u - heads - kvh) * hd;
      for (int i = lane; i < hd; i += KILN_WARP) dst[i].bits = mk_ld_cg_u16(&src[i].bits);
      continue;
    }
    // Every load the head needs is issued before any is used (the
    // position, the norm weights and the frequencies do not depend on the
    // head's values): one round trip to L2 instead of one per kind.
    const bool is_q = u < heads;
    const kbf16* nwp = is_q ? qn : kn;
    const float p = (float)mk_ld_cg_int(pos + tok);
    float a[PER], b[PER], w1[PER], w2[PER], fq[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = lane + j * KILN_WARP;
      const bool in = i < half;
      a[j] = in ? mk_ld_bf(src + i) : 0.0f;
      b[j] = in ? mk_ld_bf(src + i + half) : 0.0f;
      w1[j] = in && has_norm ? ld(nwp[i]) : 0.0f;
      w2[j] = in && has_norm ? ld(nwp[i + half]) : 0.0f;
      fq[j] = in ? fr[i] : 0.0f;
    }
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < PER; ++j) ss += a[j] * a[j] + b[j] * b[j];
    if (has_norm) {
      ss = warp_sum(ss);
      const float inv = 1.0f / sqrtf(ss / (float)hd + eps);
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int i = lane + j * KILN_WARP;
        if (i < half) {
          float x1 = w1[j], x2 = w2[j];
          if (unit_offset) {
            x1 += 1.0f;
            x2 += 1.0f;
          }
          a[j] = round_to<kbf16>(a[j] * inv * x1);
          b[j] = round_to<kbf16>(b[j] * inv * x2);
        }
      }
    }
    kbf16* dst;
    if (is_q) {
      dst = q_out + (i64)tok * heads * hd + (i64)u * hd;
    } else {
      if (!slot_ok) continue;
      dst = kc + slot * kvrow + (i64)(u - heads) * hd;
    }
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = lane + j * KILN_WARP;
      if (i < half) {
        const float ang = p * fq[j];
        const float c = cosf(ang), s = sinf(ang);
        dst[i] = st<kbf16>(a[j] * c - b[j] * s);
        dst[i + half] = st<kbf16>(b[j] * c + a[j] * s);
      }
    }
  }
}

// paged_attention (KILN_MK_PAGED_ATTENTION), units [tile_begin, tile_end)
// of batch x heads (unit u: sequence u / heads, query head u % heads, which
// reads KV head (u % heads) / (heads / kv_heads)). A unit's query rows (its
// head at each of the Q query tokens) go in tiles of RT rows: RT 1 for
// decode (Q = 1), KILN_MK_ATTN_RT otherwise.
// The block streams the positions the tile's rows see: a sub-group of tg
// lanes (tg = head_dim / 8 rounded up to a power of two, each lane 8
// elements) takes one position at a time, KILN_MK_ATTN_KU in flight, with
// an online softmax per row in registers (f32); the sub-groups of a warp
// merge by shuffles, the warps through shared memory in warp order
// (deterministic). Masking is the CPU reference's: query token qi of a
// sequence of ctx tokens sits at ctx - Q + qi and sees positions p <= that
// and, with a window, p > pos - window; position p lives in slot
// block_tables[b][p / bs] * bs + p % bs; scores q.k * scale, then softcap
// * tanh(s / softcap). A row that sees nothing is written as zeros. ctx is
// clamped to the block table's capacity (as attention.cu does).
// i: 0 batch, 1 query, 2 heads, 3 kv_heads, 4 head_dim, 5 block_size,
// 6 block table columns, 7 window (0 none). f: 0 scale, 1 softcap (0 none).
// p: 0 q, 1 K cache, 2 V cache, 3 block tables, 4 context lengths, 5 out.
//
// attention_partials is the same task with i: 8 its runs (0: plain
// paged_attention): unit u is run u % runs of (sequence, head) u / runs,
// whose positions are the run's share of [lo, ctx) (lo: the first position
// the sequence's first query token sees; runs of ceil((ctx - lo) / runs)),
// and instead of the normalized row it writes the run's entry of
// p[5] (f32 [rows][heads][runs][head_dim + 2]): the unnormalized sum
// sum e * v relative to the run's maximum score m, then m and l = sum e
// (m = -inf, l = 0, zeros for a run the row sees nothing of), the
// definition of kiln_ir::Op::AttentionPartials.
#define KILN_MK_ATTN_RT 4
#define KILN_MK_ATTN_KU 4
// The warps' rescaled accumulators ([warps][RT][head_dim] f32) go in the
// GEMV's activation stage.
static_assert(KILN_MK_WARPS * KILN_MK_ATTN_RT * KILN_MK_MAX_HEAD_DIM * 4 <= KILN_MK_X_STAGE * 2,
              "the attention merge scratch must fit the activation stage");

// Asks L2 for the K and V rows a paged_attention task's units will read:
// each position the unit's rows can see (the last window positions with a
// window), its KV head's head_dim elements in K and in V. Run before the
// task waits: the block tables and context lengths are step inputs (the
// host wrote them before launch), the cache rows of earlier positions were
// written by earlier steps, and the one row this step writes is a stale
// line at worst, which the writer's store replaces in L2. A hint: no
// effect on results.
KILN_DEV void mk_prefetch_attention(const MkTask& t) {
#if defined(KILN_CUDA)
  const int Q = t.i[1], heads = t.i[2], kvh = t.i[3], hd = t.i[4];
  const int bs = t.i[5], M = t.i[6], window = t.i[7];
  const char* kc = reinterpret_cast<const char*>(t.p[1]);
  const char* vc = reinterpret_cast<const char*>(t.p[2]);
  const int* bt = reinterpret_cast<const int*>(t.p[3]);
  const int* lens = reinterpret_cast<const int*>(t.p[4]);
  if (heads <= 0 || kvh <= 0 || bs <= 0) return;
  const int group = heads / kvh;
  const int runs = t.i[8] > 0 ? t.i[8] : 1;
  const i64 kvrow = (i64)kvh * hd * 2;
  for (int unit = (int)t.tile_begin; unit < (int)t.tile_end; ++unit) {
    const int hu = unit / runs, run = unit % runs;
    const int b = hu / heads, g = (hu % heads) / group;
    int ctx = mk_ld_cg_int(lens + b);
    ctx = ctx < M * bs ? ctx : M * bs;
    int lo = window > 0 ? ctx - Q - window + 1 : 0;
    lo = lo > 0 ? lo : 0;
    const int len = (ctx - lo + runs - 1) / runs;
    const int r0 = lo + run * len;
    const int r1 = r0 + len < ctx ? r0 + len : ctx;
    const int* table = bt + (i64)b * M;
    for (int p = r0 + (int)threadIdx.x; p < r1; p += KILN_MK_THREADS) {
      const i64 slot = (i64)table[p / bs] * bs + p % bs;
      const i64 at = slot * kvrow + (i64)g * hd * 2;
      for (int off = 0; off < hd * 2; off += 128) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(kc + at + off));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(vc + at + off));
      }
    }
  }
#endif
}
template <int RT, int KU>
KILN_DEV void mk_attention(const MkTask& t, float* smem, float* wred) {
  const int lane = threadIdx.x % KILN_WARP, warp = threadIdx.x / KILN_WARP;
  const int batch = t.i[0], Q = t.i[1], heads = t.i[2], kvh = t.i[3], hd = t.i[4];
  const int bs = t.i[5], M = t.i[6], window = t.i[7];
  const float scale = t.f[0], cap = t.f[1];
  const kbf16* q = reinterpret_cast<const kbf16*>(t.p[0]);
  const kbf16* kc = reinterpret_cast<const kbf16*>(t.p[1]);
  const kbf16* vc = reinterpret_cast<const kbf16*>(t.p[2]);
  const int* bt = reinterpret_cast<const int*>(t.p[3]);
  const int* lens = reinterpret_cast<const int*>(t.p[4]);
  kbf16* out = reinterpret_cast<kbf16*>(t.p[5]);
  const int group = heads / kvh;
  const int rows = Q;
  const int nch = hd / 8;
  int tg = 1;
  while (tg < nch) tg <<= 1;
  const int kpw = KILN_WARP / tg, sub = lane / tg, lig = lane % tg;
  const bool has = lig < nch;
  const KilnDiv bsd = kiln_div(bs), hdd = kiln_div(hd);
  const i64 kvrow = (i64)kvh * hd;
  // wred ([warps][RT][hd] f32) is the GEMV's activation stage, unused here.
  float* ml = smem;                                        // [warps][RT][2]
  float* fin = ml + KILN_MK_WARPS * RT * 2;                // [RT][2]: max, 1 / sum
  float* fsum = fin + RT * 2;                              // [RT]: sum
  const int step = KILN_MK_WARPS * kpw * KU;
  const bool partial = t.i[8] > 0;
  const int runs = partial ? t.i[8] : 1;
  float* part_out = reinterpret_cast<float*>(t.p[5]);
  (void)batch;
  for (int unit = (int)t.tile_begin; unit < (int)t.tile_end; ++unit) {
    const int hu = unit / runs, run = unit % runs;
    const int b = hu / heads, h = hu % heads, g = h / group;
    int ctx = mk_ld_cg_int(lens + b);
    ctx = ctx < M * bs ? ctx : M * bs;
    const int* table = bt + (i64)b * M;
    // The run's positions (all of them for plain attention).
    int run_lo = 0, run_hi = ctx;
    if (partial) {
      int lo = window > 0 ? ctx - Q - window + 1 : 0;
      lo = lo > 0 ? lo : 0;
      int len = (ctx - lo + runs - 1) / runs;
      len = len > 1 ? len : 1;
      run_lo = lo + run * len;
      run_hi = run_lo + len < ctx ? run_lo + len : ctx;
    }
    {
      for (int r0 = 0; r0 < rows; r0 += RT) {
        int rid[RT], qpos[RT];
        float qv[RT][8];
        int hi_p = 0, lo_p = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < RT; ++j) {
          const int r = r0 + j;
          if (r < rows) {
            const int qi = r;
            rid[j] = (b * Q + qi) * heads + h;
            qpos[j] = ctx - Q + qi;
            hi_p = max(hi_p, qpos[j] + 1);
            lo_p = min(lo_p, window > 0 ? qpos[j] - window + 1 : 0);
          } else {
            rid[j] = -1;
            qpos[j] = -1;
          }
          if (has && rid[j] >= 0) {
            mk_load8(q + (i64)rid[j] * hd + lig * 8, qv[j]);
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) qv[j][e] = 0.0f;
          }
        }
        lo_p = max(lo_p, run_lo);
        hi_p = min(hi_p, run_hi);
        float m[RT], l[RT], acc[RT][8];
#pragma unroll
        for (int j = 0; j < RT; ++j) {
          m[j] = -KILN_INF;
          l[j] = 0.0f;
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[j][e] = 0.0f;
        }
        // Warp-uniform trip count: every lane reaches every shuffle.
        for (int pb = lo_p + warp * kpw * KU; pb < hi_p; pb += step) {
          uint4 kr[KU], vr[KU];
          int pp[KU];
#pragma unroll
          for (int u = 0; u < KU; ++u) {
            pp[u] = pb + u * kpw + sub;
            if (pp[u] < hi_p && has) {
              const i64 slot = (i64)table[pp[u] / bsd] * bs + pp[u] % bsd;
              const i64 at = slot * kvrow + (i64)g * hd + lig * 8;
              kr[u] = mk_ld_cg(reinterpret_cast<const uint4*>(kc + at));
              vr[u] = mk_ld_cg(reinterpret_cast<const uint4*>(vc + at));
            } else {
              kr[u] = make_uint4(0, 0, 0, 0);
              vr[u] = make_uint4(0, 0, 0, 0);
            }
          }
#pragma unroll
          for (int u = 0; u < KU; ++u) {
            float kf[8], vf[8];
            unpack8(kr[u], kc, kf);
            unpack8(vr[u], vc, vf);
#pragma unroll
            for (int j = 0; j < RT; ++j) {
              float d = 0.0f;
#pragma unroll
              for (int e = 0; e < 8; ++e) d += qv[j][e] * kf[e];
              for (int msk = tg / 2; msk > 0; msk >>= 1) d += shfl_xor(d, msk);
              float s = d * scale;
              if (cap > 0.0f) s = cap * tanhf(s / cap);
              const int p = pp[u];
              const bool vis = p < hi_p && rid[j] >= 0 && p <= qpos[j] &&
                               (window <= 0 || p > qpos[j] - window);
              if (vis) {
                const float mn = fmaxf(m[j], s);
                const float c = expf(m[j] - mn);
                const float ev = expf(s - mn);
                l[j] = l[j] * c + ev;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[j][e] = acc[j][e] * c + ev * vf[e];
                m[j] = mn;
              }
            }
          }
        }
        // Merge the warp's sub-groups (lanes lig, lig + tg, ...).
        for (int msk = tg; msk < KILN_WARP; msk <<= 1) {
#pragma unroll
          for (int j = 0; j < RT; ++j) {
            const float mo = shfl_xor(m[j], msk), lo = shfl_xor(l[j], msk);
            const float mm = fmaxf(m[j], mo);
            const float wa = l[j] > 0.0f ? expf(m[j] - mm) : 0.0f;
            const float wb = lo > 0.0f ? expf(mo - mm) : 0.0f;
            l[j] = l[j] * wa + lo * wb;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              const float ao = shfl_xor(acc[j][e], msk);
              acc[j][e] = acc[j][e] * wa + ao * wb;
            }
            m[j] = mm;
          }
        }
        if (lane == 0) {
#pragma unroll
          for (int j = 0; j < RT; ++j) {
            ml[(warp * RT + j) * 2] = m[j];
            ml[(warp * RT + j) * 2 + 1] = l[j];
          }
        }
        __syncthreads();
        // Every thread takes the rows' maximum and sum over the warps
        // itself (the same loops, so every thread gets the same values),
        // each warp stores its rescaled accumulators in its own slice of
        // wred, and one barrier later each output element is the warps'
        // slices added in warp order: two barriers, not one per warp.
#pragma unroll
        for (int j = 0; j < RT; ++j) {
          float mx = -KILN_INF;
          for (int v = 0; v < KILN_MK_WARPS; ++v)
            if (ml[(v * RT + j) * 2 + 1] > 0.0f) mx = fmaxf(mx, ml[(v * RT + j) * 2]);
          if (lane < nch) {
            const float wv = l[j] > 0.0f ? expf(m[j] - mx) : 0.0f;
            float* o = wred + ((i64)warp * RT + j) * hd + lane * 8;
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = acc[j][e] * wv;
          }
          if (threadIdx.x == 0) {
            float ls = 0.0f;
            for (int v = 0; v < KILN_MK_WARPS; ++v) {
              const float lv = ml[(v * RT + j) * 2 + 1];
              ls += lv > 0.0f ? expf(ml[(v * RT + j) * 2] - mx) * lv : 0.0f;
            }
            fin[2 * j] = mx;
            fin[2 * j + 1] = ls > 0.0f ? 1.0f / ls : 0.0f;
            fsum[j] = ls;
          }
        }
        __syncthreads();
        for (int x = threadIdx.x; x < RT * hd; x += KILN_MK_THREADS) {
          const int j = x / hdd, d = x % hdd;
          const int r = r0 + j;
          if (r >= rows) continue;
          float sum = 0.0f;
#pragma unroll
          for (int v = 0; v < KILN_MK_WARPS; ++v) sum += wred[(i64)v * RT * hd + x];
          const int row = (b * Q + r) * heads + h;
          if (partial) {
            float* e = part_out + ((i64)row * runs + run) * (hd + 2);
            e[d] = sum;
            if (d == 0) {
              e[hd] = fin[2 * j];
              e[hd + 1] = fsum[j];
            }
          } else {
            out[(i64)row * hd + d] = st<kbf16>(sum * fin[2 * j + 1]);
          }
        }
        __syncthreads();  // wred, ml and fin are reused by the next tile
      }
    }
  }
}

// attention_combine (KILN_MK_ATTENTION_COMBINE), units [tile_begin,
// tile_end) of rows x heads (unit u: head u % heads of row u / heads): a
// warp per unit, each lane 8 of the head's elements; M = the largest run
// maximum among runs with l > 0, w = exp(m - M), out = (sum w * o) /
// (sum w * l) over the runs in order, rounded once (0 where no run saw a
// position). The partials were written by other blocks during this launch:
// L1-bypassing loads. i: 0 rows, 1 heads, 2 head_dim, 3 runs. p: 0 partials
// (f32), 1 out (bf16).
//
// Latency, not bytes, is this task's cost (a few KiB from L2), so no load
// waits on another: lane r reads run r's (m, l) (runs 32 at a time), the
// warp takes the maximum and each lane its run's weight, and the lanes
// then add the runs in order with every run's elements loaded before the
// first is added (the first form read the runs one after the other, two
// dependent L2 round trips per run: 9-13 us per task on an H200's critical
// path at 8-14 runs). The sums keep that form's order and expressions.
#define KILN_MK_COMBINE_UNROLL 4
KILN_DEV float mk_shfl(float v, int src) {
  return __int_as_float(kiln_shfl_int(__float_as_int(v), src));
}
KILN_DEV void mk_attention_combine(const MkTask& t) {
  const int lane = threadIdx.x % KILN_WARP, warp = threadIdx.x / KILN_WARP;
  const int heads = t.i[1], hd = t.i[2], runs = t.i[3];
  const float* part = reinterpret_cast<const float*>(t.p[0]);
  kbf16* out = reinterpret_cast<kbf16*>(t.p[1]);
  constexpr int PER = KILN_MK_MAX_HEAD_DIM / KILN_WARP;
  const i64 stride = hd + 2;
  for (int unit = (int)t.tile_begin + warp; unit < (int)t.tile_end; unit += KILN_MK_WARPS) {
    const int row = unit / heads, h = unit % heads;
    const float* e0 = part + ((i64)row * heads + h) * runs * stride;
    float mx = -KILN_INF;
    for (int r = lane; r < runs; r += KILN_WARP) {
      const float mr = mk_ld_cg_f32(e0 + r * stride + hd);
      const float lr = mk_ld_cg_f32(e0 + r * stride + hd + 1);
      if (lr > 0.0f) mx = fmaxf(mx, mr);
    }
    mx = warp_max(mx);
    float acc[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) acc[j] = 0.0f;
    float l = 0.0f;
    for (int r0 = 0; r0 < runs; r0 += KILN_WARP) {
      // This lane's run r0 + lane: its weight, its l, and whether it counts.
      float w = 0.0f, lr = 0.0f;
      int use = 0;
      if (r0 + lane < runs) {
        const float* e = e0 + (r0 + lane) * stride;
        lr = mk_ld_cg_f32(e + hd + 1);
        if (lr > 0.0f) {
          w = expf(mk_ld_cg_f32(e + hd) - mx);
          use = 1;
        }
      }
      const int n = runs - r0 < KILN_WARP ? runs - r0 : KILN_WARP;
      for (int k0 = 0; k0 < n; k0 += KILN_MK_COMBINE_UNROLL) {
        float v[KILN_MK_COMBINE_UNROLL][PER];
#pragma unroll
        for (int u = 0; u < KILN_MK_COMBINE_UNROLL; ++u) {
          const float* e = e0 + (r0 + k0 + u) * stride;
#pragma unroll
          for (int j = 0; j < PER; ++j) {
            const int d = lane + j * KILN_WARP;
            v[u][j] = k0 + u < n && d < hd ? mk_ld_cg_f32(e + d) : 0.0f;
          }
        }
#pragma unroll
        for (int u = 0; u < KILN_MK_COMBINE_UNROLL; ++u) {
          const int src = (k0 + u) % KILN_WARP;
          const float wk = mk_shfl(w, src), lk = mk_shfl(lr, src);
          if (k0 + u < n && kiln_shfl_int(use, src)) {
            l += wk * lk;
#pragma unroll
            for (int j = 0; j < PER; ++j) acc[j] += wk * v[u][j];
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int d = lane + j * KILN_WARP;
      if (d < hd) out[((i64)row * heads + h) * hd + d] = st<kbf16>(l > 0.0f ? acc[j] / l : 0.0f);
    }
  }
}

// silu_mul / gelu_tanh_mul: out[t, i] = act(gate[t, i]) * up[t, i], in f32,
// rounded once; packed (p1 null): row t of gate_up is [gate | up]. Rows go
// in order with a barrier between them: a packed result written over its
// input (in place) only lands on input rows already read. i: 0 T, 1 I,
// 2 packed. p: 0 gate, 1 up, 2 out.
template <int GELU>
KILN_DEV void mk_act_mul(const MkTask& t) {
  const int T = t.i[0], inter = t.i[1], packed = t.i[2];
  const int n8 = inter / 8;
  const kbf16* gate = reinterpret_cast<const kbf16*>(t.p[0]);
  const kbf16* up = reinterpret_cast<const kbf16*>(t.p[1]);
  kbf16* out = reinterpret_cast<kbf16*>(t.p[2]);
  for (int r = 0; r < T; ++r) {
    const kbf16* g = gate + (i64)r * (packed ? 2 * inter : inter);
    const kbf16* u = packed ? g + inter : up + (i64)r * inter;
    for (int c = threadIdx.x; c < n8; c += KILN_MK_THREADS) {
      float gv[8], uv[8], y[8];
      mk_load8(g + c * 8, gv);
      mk_load8(u + c * 8, uv);
#pragma unroll
      for (int e = 0; e < 8; ++e) y[e] = (GELU ? kiln_gelu_tanh(gv[e]) : kiln_silu(gv[e])) * uv[e];
      mk_store8(out + (i64)r * inter + c * 8, y);
    }
    if (packed) __syncthreads();
  }
}

// add: out = a + b, rounded once (in place is safe: each thread reads its
// elements before writing them). i: 0 elements. p: 0 a, 1 b, 2 out.
KILN_DEV void mk_add(const MkTask& t) {
  const int n8 = t.i[0] / 8;
  const kbf16* a = reinterpret_cast<const kbf16*>(t.p[0]);
  const kbf16* b = reinterpret_cast<const kbf16*>(t.p[1]);
  kbf16* out = reinterpret_cast<kbf16*>(t.p[2]);
#pragma unroll 2
  for (int c = threadIdx.x; c < n8; c += KILN_MK_THREADS) {
    float x[8], y[8];
    mk_load8(a + (i64)c * 8, x);
    mk_load8(b + (i64)c * 8, y);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = x[e] + y[e];
    mk_store8(out + (i64)c * 8, x);
  }
}

// scale: y = x * factor, then cap * tanh(y / cap), no contraction
// (elementwise.cu's scale_elems). i: 0 elements, 1 dtype (0 bf16, 1 f32),
// 2 softcap. f: 0 factor, 1 cap. p: 0 x, 1 out.
template <typename T>
KILN_DEV void mk_scale_t(const MkTask& t) {
  const int n8 = t.i[0] / 8, has_cap = t.i[2];
  const float factor = t.f[0], cap = t.f[1];
  const T* x = reinterpret_cast<const T*>(t.p[0]);
  T* out = reinterpret_cast<T*>(t.p[1]);
#pragma unroll 2
  for (int c = threadIdx.x; c < n8; c += KILN_MK_THREADS) {
    float v[8];
    mk_load8(x + (i64)c * 8, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float y = __fmul_rn(v[e], factor);
      if (has_cap) y = __fmul_rn(cap, tanhf(__fdiv_rn(y, cap)));
      v[e] = y;
    }
    mk_store8(out + (i64)c * 8, v);
  }
}

// argmax: out[r] = the first maximum of row r (NaN skipped, -inf a value, a
// row without a number gives 0). i: 0 rows, 1 vocab (a multiple of 4),
// 2 dtype (0 bf16, 1 f32). p: 0 x, 1 out (i32).
//
// Rows [tile_begin, tile_end) (the tape cuts argmax by rows). Each thread
// issues KILN_MK_ARGMAX_BATCH vector loads before it compares any (one
// block alone reads a whole vocabulary row, 600 KB in f32: 32 KB in flight
// per round trip instead of whatever the compiler kept in flight of an
// unrolled loop), then compares them in index order, so the first maximum
// is the one the unbatched loop found. 8, not 16: 16 raised the whole
// interpreter to 254 registers with spills (ptxas, sm_90), 8 keeps it at
// 234 without.
#define KILN_MK_ARGMAX_BATCH 8
KILN_DEV void mk_argmax(const MkTask& t, float* smem) {
  const int vocab = t.i[1], f32 = t.i[2];
  const int n4 = vocab / 4;
  int* out = reinterpret_cast<int*>(t.p[1]);
  for (int r = (int)t.tile_begin; r < (int)t.tile_end; ++r) {
    float best = -KILN_INF;
    int bi = KILN_MK_NO_INDEX;
    const float4* xf = reinterpret_cast<const float4*>(t.p[0]) + (i64)r * n4;
    const uint2* xb = reinterpret_cast<const uint2*>(t.p[0]) + (i64)r * n4;
    for (int c0 = threadIdx.x; c0 < n4; c0 += KILN_MK_ARGMAX_BATCH * KILN_MK_THREADS) {
      float4 a[KILN_MK_ARGMAX_BATCH];
#pragma unroll
      for (int u = 0; u < KILN_MK_ARGMAX_BATCH; ++u) {
        const int c = c0 + u * KILN_MK_THREADS;
        if (c < n4) {
          if (f32) {
            a[u] = mk_ld_cg4(xf + c);
          } else {
            const uint2 h = mk_ld_cg2(xb + c);
            a[u] = make_float4(kiln_u2f(h.x << 16), kiln_u2f(h.x & 0xffff0000u),
                               kiln_u2f(h.y << 16), kiln_u2f(h.y & 0xffff0000u));
          }
        }
      }
#pragma unroll
      for (int u = 0; u < KILN_MK_ARGMAX_BATCH; ++u) {
        const int c = c0 + u * KILN_MK_THREADS;
        if (c < n4) {
          const float v[4] = {a[u].x, a[u].y, a[u].z, a[u].w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (v[e] > best || (bi == KILN_MK_NO_INDEX && v[e] == best)) {
              best = v[e];
              bi = 4 * c + e;
            }
          }
        }
      }
    }
    mk_argmax_block(best, bi, smem);
    if (threadIdx.x == 0) out[r] = bi == KILN_MK_NO_INDEX ? 0 : bi;
  }
}

// gather_last: out[r] = x[r * group + group - 1], copied as 16-bit units.
// i: 0 result rows, 1 group, 2 row width in 16-bit units. p: 0 x, 1 out.
KILN_DEV void mk_gather_last(const MkTask& t) {
  const int rows = t.i[0], group = t.i[1], units = t.i[2];
  const unsigned short* x = reinterpret_cast<const unsigned short*>(t.p[0]);
  unsigned short* out = reinterpret_cast<unsigned short*>(t.p[1]);
  for (int r = 0; r < rows; ++r) {
    const unsigned short* src = x + ((i64)r * group + group - 1) * units;
#pragma unroll 4
    for (int c = threadIdx.x; c < units; c += KILN_MK_THREADS)
      out[(i64)r * units + c] = mk_ld_cg_u16(src + c);
  }
}

// grid = one block per queue; queue q's tasks are
// queue_tasks[queue_start[q] .. queue_start[q + 1]).
// trace: null, or 4 u64 per task for `kiln bench --profile`, the device's
// global timer in ns, written by thread 0, no effect on results: at
// trace[3 ti ..] when the block reached task ti, when its waits were met,
// when its counter was bumped; then, after the n = queue_start[gridDim.x]
// tasks' triples, at trace[3 n + ti] when its inputs were in shared memory
// (a GEMV's activations and staged weights; the waits-met time for the
// other kinds). The fourth stamp sits apart so that a runtime reading an
// older interpreter's trace (three stamps) finds zeros there, not garbage.

KILN_GLOBAL void __launch_bounds__(KILN_MK_THREADS)
    megakernel_run(const MkTask* __restrict__ tasks, const unsigned int* __restrict__ queue_start,
                   const unsigned int* __restrict__ queue_tasks, const MkWait* __restrict__ waits,
                   unsigned int* counters, unsigned long long* trace) {
  __shared__ float smem[KILN_MK_SMEM_FLOATS];
  __shared__ uint4 xs[KILN_MK_X_STAGE / 8];
  // The current task's record, copied once: its fields are then read from
  // shared memory, not re-fetched from global memory after every barrier
  // and acquire (which the compiler may not move loads across).
  __shared__ MkTask cur;
  __shared__ unsigned long long bars[2];
  const unsigned int ws_bytes = mk_ws_bytes();
  const unsigned int q = blockIdx.x;
  const unsigned int begin = queue_start[q], end = queue_start[q + 1];
  MkRing ring{bars, 0u};
  mk_ring_init(ring);
  if (threadIdx.x == 0) mk_ready_at = 0;
  // The current task's weight stage when the previous task issued it
  // (mk_stage_next; rows 0: it did not, and the task stages itself).
  MkStage ahead{0, 0u, 0u, false};
  // The next record's words (threads < 48 hold one each), loaded while
  // the current task runs, so starting a task costs no L2 round trip.
  constexpr unsigned int kWords = sizeof(MkTask) / 4;
  unsigned int ti = begin < end ? queue_tasks[begin] : 0u;
  unsigned int word = begin < end && threadIdx.x < kWords
                          ? reinterpret_cast<const unsigned int*>(tasks + ti)[threadIdx.x]
                          : 0u;
  for (unsigned int i = begin; i < end; ++i) {
    if (threadIdx.x < kWords) reinterpret_cast<unsigned int*>(&cur)[threadIdx.x] = word;
    __syncthreads();
    const MkTask& t = cur;
    const unsigned int counter = t.counter;
    const unsigned int this_ti = ti;
    if (trace != nullptr && threadIdx.x == 0) trace[3 * (unsigned long long)this_ti] = mk_now();
    const MkTask* next = nullptr;
    if (i + 1 < end) {
      ti = queue_tasks[i + 1];
      next = tasks + ti;
      if (threadIdx.x < kWords) word = reinterpret_cast<const unsigned int*>(next)[threadIdx.x];
    }
    // Every earlier stage has been read (the previous task's barrier), so
    // a task the look-ahead could not stage gets the whole buffer.
    const MkStage stage = ahead.rows != 0
                              ? ahead
                              : (ws_bytes != 0 ? mk_stage_w(t, ws_bytes, false, ws_bytes, ring)
                                               : ahead);
    ahead = MkStage{0, 0u, 0u, false};
#if KILN_MK_LOOKAHEAD
    // The next task's weights into what this stage leaves free, so they
    // land while this task waits and computes.
    if (next != nullptr && ws_bytes != 0) ahead = mk_stage_next(*next, stage, ws_bytes, ring);
#endif
    // L2 prefetch of what the stage does not hold (all of it when nothing
    // is staged; the whole tile when part is: a hint).
    if (stage.rows < (int)(t.tile_end - t.tile_begin)) mk_prefetch(t);
    if (KILN_MK_PREFETCH_EARLY && next != nullptr &&
        ahead.rows < (int)(next->tile_end - next->tile_begin))
      mk_prefetch(*next, KILN_MK_PREFETCH_NEXT);
    for (unsigned int n = threadIdx.x; n < t.wait_count; n += KILN_MK_THREADS) {
      const MkWait wt = waits[t.wait_begin + n];
      while (mk_load_acquire(&counters[wt.counter]) < wt.target) mk_pause();
    }
    __syncthreads();
    if (trace != nullptr && threadIdx.x == 0) {
      mk_ready_at = mk_now();
      trace[3 * (unsigned long long)this_ti + 1] = mk_ready_at;
    }
    if (!KILN_MK_PREFETCH_EARLY && next != nullptr &&
        ahead.rows < (int)(next->tile_end - next->tile_begin))
      mk_prefetch(*next, KILN_MK_PREFETCH_NEXT);
    if (KILN_MK_PREFETCH_AHEAD > 1 && i + 2 < end)
      mk_prefetch(tasks[queue_tasks[i + 2]], KILN_MK_PREFETCH_NEXT);
    switch (t.kind) {
      case KILN_MK_GEMV_BF16:
      case KILN_MK_GEMV_BF16_F32:
      case KILN_MK_GEMV_ARGMAX:
        if (t.i[0] == 1)
          mk_gemv<1>(t, smem, xs, stage, ring, ahead.rows != 0);
        else
          mk_gemv<8>(t, smem, xs, stage, ring, ahead.rows != 0);
        break;
      case KILN_MK_EMBEDDING:
        mk_embedding(t);
        break;
      case KILN_MK_RMS_NORM:
        mk_rms_norm<0>(t, smem);
        break;
      case KILN_MK_ADD_RMS_NORM:
        mk_rms_norm<1>(t, smem);
        break;
      case KILN_MK_QKV_ROPE_KV_WRITE:
        mk_qkv_rope_kv_write(t);
        break;
      case KILN_MK_PAGED_ATTENTION:
        // Decode (one row per unit): KU 4, so a run of 64 positions
        // (ctx 512 in 8 runs) keeps all eight warps busy (KU 8 left half
        // of them idle).
        if (t.i[1] == 1)
          mk_attention<1, KILN_MK_ATTN_KU>(t, smem, reinterpret_cast<float*>(xs));
        else
          mk_attention<KILN_MK_ATTN_RT, KILN_MK_ATTN_KU>(t, smem, reinterpret_cast<float*>(xs));
        break;
      case KILN_MK_SILU_MUL:
        mk_act_mul<0>(t);
        break;
      case KILN_MK_GELU_TANH_MUL:
        mk_act_mul<1>(t);
        break;
      case KILN_MK_ADD:
        mk_add(t);
        break;
      case KILN_MK_SCALE:
        if (t.i[1])
          mk_scale_t<float>(t);
        else
          mk_scale_t<kbf16>(t);
        break;
      case KILN_MK_ARGMAX:
        mk_argmax(t, smem);
        break;
      case KILN_MK_GATHER_LAST:
        mk_gather_last(t);
        break;
      case KILN_MK_ATTENTION_COMBINE:
        mk_attention_combine(t);
        break;
      default:
        // A kind this build does not run: the encoder refuses such tapes
        // before launch; trap rather than let waiters hang.
        __trap();
    }
    // Every thread's results are stored (and `cur` is no longer read)
    // before thread 0 publishes them and the next record overwrites `cur`.
    __syncthreads();
    if (threadIdx.x == 0) {
      mk_release_add(&counters[counter]);
      if (trace != nullptr) {
        trace[3 * (unsigned long long)this_ti + 2] = mk_now();
        trace[3 * (unsigned long long)queue_start[gridDim.x] + this_ti] = mk_ready_at;
      }
    }
    // mk_gemv waited for this stage's end once: its next completion has
    // the other parity.
    if (stage.rows != 0) ring.parity ^= stage.top ? 2u : 1u;
  }
}

// Zeroes the tape's n counters (grid-stride); launched right before
// megakernel_run in the same graph.
KILN_GLOBAL void megakernel_reset(unsigned int* counters, unsigned int n) {
  for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    counters[i] = 0;
}
