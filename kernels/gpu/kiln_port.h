// kiln_port.h: the one portability header of kiln's GPU kernels.
//
// Every .cu file in kernels/gpu is compiled unchanged by NVRTC (CUDA) and by
// hiprtc (HIP). This header is inlined in front of each module by the kernel
// catalog (kernels/src/gpu.rs), so the sources need no include path and no
// toolkit headers: bf16 and f16 are stored as raw 16-bit words and converted
// here (bf16 with bit shifts and round-to-nearest-even, f16 with one
// conversion instruction), which keeps the modules self-contained.
//
// Deliberately not here: anything op-specific, and any use of cuda_bf16.h /
// hip_bf16.h (neither compiler ships them in the runtime-compiler packages).
#pragma once

#if defined(__HIPCC__) || defined(__HIPCC_RTC__) || defined(__HIP_DEVICE_COMPILE__)
#define KILN_HIP 1
#else
#define KILN_CUDA 1
#endif

#define KILN_DEV __device__ __forceinline__
#define KILN_GLOBAL extern "C" __global__

// Warp width the kernels are written for. HIP targets run wave32 (RDNA);
// the reductions below only ever use 32 lanes.
#define KILN_WARP 32

typedef long long i64;

#define KILN_INF __int_as_float(0x7f800000)

// bf16 and f16 storage: raw 16-bit words wrapped in distinct types so the
// conversion overloads pick the right rule.
struct kbf16 {
  unsigned short bits;
};
struct kf16 {
  unsigned short bits;
};

KILN_DEV unsigned int kiln_f2u(float f) { return __float_as_uint(f); }
KILN_DEV float kiln_u2f(unsigned int u) { return __uint_as_float(u); }

// Programmatic dependent launch (sm_90+): every kernel starts with
// KILN_PROLOGUE(), which first waits until the grids it depends on have
// completed and flushed their memory (so it may read their results and
// overwrite what they read), then lets the next kernel in the stream begin
// launching, which overlaps its launch with this kernel's run. Elsewhere
// (sm_80, HIP) both are no-ops and launches serialize as usual.
KILN_DEV void kiln_prologue() {
#if defined(KILN_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#define KILN_PROLOGUE() kiln_prologue()

// Asynchronous global-to-shared copies (cp.async, sm_80+; every CUDA target
// kiln compiles for): 16-, 8- and 4-byte copies that hold no register while
// the bytes travel, committed in groups and waited for by the count of
// groups still allowed in flight. HIP has none; its kernels take other paths.
#if defined(KILN_CUDA)
KILN_DEV void kiln_cp_async16(void* smem, const void* gmem) {
  const unsigned int s = (unsigned int)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
KILN_DEV void kiln_cp_async8(void* smem, const void* gmem) {
  const unsigned int s = (unsigned int)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(s), "l"(gmem) : "memory");
}
KILN_DEV void kiln_cp_async4(void* smem, const void* gmem) {
  const unsigned int s = (unsigned int)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(gmem) : "memory");
}
KILN_DEV void kiln_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> KILN_DEV void kiln_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#endif

// Thread-block clusters (sm_90+): the blocks of one cluster run at once on
// one GPC and can store into each other's shared memory and arrive on each
// other's mbarriers (attention's cluster combine uses only that direction).
// KILN_CLUSTERS is defined where a kernel may be launched with a cluster
// dimension; elsewhere (sm_80, HIP) no kernel uses these, and the plans
// never ask for a cluster.
#if defined(KILN_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define KILN_CLUSTERS 1
// Split arrive / wait of the same cluster barrier (the non-aligned forms:
// threads may reach them at different points). A block arrives early and
// waits only before its first access to another block's shared memory, so
// the barrier's latency hides behind the work in between.
KILN_DEV void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
}
KILN_DEV void cluster_wait() { asm volatile("barrier.cluster.wait;" ::: "memory"); }
// The shared::cluster address of `p` (this block's shared memory, the same
// layout in every block of the kernel) in cluster block `rank`.
KILN_DEV unsigned int kiln_mapa(const void* p, unsigned int rank) {
  const unsigned int a = (unsigned int)__cvta_generic_to_shared(p);
  unsigned int r;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
// A store into another block's shared memory (an address from kiln_mapa).
KILN_DEV void st_cluster(unsigned int addr, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}
// An mbarrier in this block's shared memory expecting `count` arrivals,
// made visible to the cluster's blocks (they arrive on it after a
// cluster_wait that follows this block's cluster_arrive_relaxed).
KILN_DEV void mbar_init_cluster(unsigned long long* bar, unsigned int count) {
  const unsigned int a = (unsigned int)__cvta_generic_to_shared(bar);
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(a), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Arrive on an mbarrier of another block (address from kiln_mapa),
// releasing this thread's earlier stores to the cluster.
KILN_DEV void mbar_arrive_remote(unsigned int addr) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(addr)
               : "memory");
}
// Wait for phase `parity` of this block's mbarrier to complete, acquiring
// what the arriving threads released.
KILN_DEV void mbar_wait_cluster(unsigned long long* bar, unsigned int parity) {
  const unsigned int a = (unsigned int)__cvta_generic_to_shared(bar);
  unsigned int done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
  }
}
#endif

// A load that bypasses L1 (data another block wrote during this launch).
KILN_DEV float ld_cg(const float* p) {
#if defined(KILN_CUDA)
  return __ldcg(p);
#else
  return __builtin_nontemporal_load(p);
#endif
}

// Division by a divisor known only at run time. Every head_dim, block size
// and query count kiln plans in practice is a power of two, and a shift and
// a mask replace the ~25-instruction division sequence then; decode kernels
// whose whole work is a few hundred instructions per warp feel the
// difference. x >= 0.
struct KilnDiv {
  int d, shift;  // shift < 0: not a power of two
};
KILN_DEV KilnDiv kiln_div(int d) {
  KilnDiv f;
  f.d = d;
  f.shift = d > 0 && (d & (d - 1)) == 0 ? __ffs(d) - 1 : -1;
  return f;
}
KILN_DEV int operator/(int x, KilnDiv f) { return f.shift >= 0 ? x >> f.shift : x / f.d; }
KILN_DEV int operator%(int x, KilnDiv f) { return f.shift >= 0 ? x & (f.d - 1) : x % f.d; }

// Loads: storage -> f32.
KILN_DEV float ld(float v) { return v; }
KILN_DEV float ld(kbf16 v) { return kiln_u2f(((unsigned int)v.bits) << 16); }
KILN_DEV float ld(kf16 v) {
#if defined(KILN_CUDA)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
#else
  _Float16 h;
  __builtin_memcpy(&h, &v.bits, 2);
  return (float)h;
#endif
}

// Stores: f32 -> storage, rounded to nearest even (NaN stays a quiet NaN).
template <typename T> KILN_DEV T st(float f);
template <> KILN_DEV float st<float>(float f) { return f; }
template <> KILN_DEV kbf16 st<kbf16>(float f) {
  unsigned int u = kiln_f2u(f);
  kbf16 r;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    r.bits = (unsigned short)((u >> 16) | 0x0040u);
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = (unsigned short)(u >> 16);
  }
  return r;
}
template <> KILN_DEV kf16 st<kf16>(float f) {
  kf16 r;
#if defined(KILN_CUDA)
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
#else
  _Float16 h = (_Float16)f;
  __builtin_memcpy(&r.bits, &h, 2);
#endif
  return r;
}

// Eight packed 16-bit values (one 16-byte load) as f32. The pointer
// argument only picks the storage type.
KILN_DEV void unpack8(uint4 u, const kbf16*, float* o) {
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    o[2 * k] = kiln_u2f(w[k] << 16);
    o[2 * k + 1] = kiln_u2f(w[k] & 0xffff0000u);
  }
}
KILN_DEV void unpack8(uint4 u, const kf16*, float* o) {
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    kf16 lo, hi;
    lo.bits = (unsigned short)(w[k] & 0xffffu);
    hi.bits = (unsigned short)(w[k] >> 16);
    o[2 * k] = ld(lo);
    o[2 * k + 1] = ld(hi);
  }
}

// Rounds an f32 to the storage type and back (the value a stored result has).
template <typename T> KILN_DEV float round_to(float f) { return ld(st<T>(f)); }

// Warp and block reductions (f32).
KILN_DEV float shfl_xor(float v, int mask) {
#if defined(KILN_CUDA)
  return __shfl_xor_sync(0xffffffffu, v, mask, KILN_WARP);
#else
  return __shfl_xor(v, mask, KILN_WARP);
#endif
}
KILN_DEV int shfl_xor_int(int v, int mask) {
#if defined(KILN_CUDA)
  return __shfl_xor_sync(0xffffffffu, v, mask, KILN_WARP);
#else
  return __shfl_xor(v, mask, KILN_WARP);
#endif
}

KILN_DEV float warp_sum(float v) {
#pragma unroll
  for (int m = KILN_WARP / 2; m > 0; m >>= 1) v += shfl_xor(v, m);
  return v;
}
KILN_DEV float warp_max(float v) {
#pragma unroll
  for (int m = KILN_WARP / 2; m > 0; m >>= 1) v = fmaxf(v, shfl_xor(v, m));
  return v;
}

// Sum over the whole block; every thread gets the result. `scratch` holds at
// least 32 floats; the call contains two barriers.
KILN_DEV float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % KILN_WARP;
  const int warp = threadIdx.x / KILN_WARP;
  const int nwarps = (blockDim.x + KILN_WARP - 1) / KILN_WARP;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? scratch[lane] : 0.0f;
  t = warp_sum(t);
  __syncthreads();
  return t;
}

// Max over the whole block; every thread gets the result. Same contract as
// block_sum.
KILN_DEV float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % KILN_WARP;
  const int warp = threadIdx.x / KILN_WARP;
  const int nwarps = (blockDim.x + KILN_WARP - 1) / KILN_WARP;
  v = warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? scratch[lane] : -KILN_INF;
  t = warp_max(t);
  __syncthreads();
  return t;
}

// Instantiates `NAME_bf16`, `NAME_f16` and `NAME_f32` entry points from a
// macro `BODY(T, SUFFIX)` that defines one of them.
#define KILN_FOR_FLOATS(BODY) BODY(kbf16, bf16) BODY(kf16, f16) BODY(float, f32)

// ---- Shared by the fused GEMM epilogues and prologues (qgemv.cu, qskinny.cu) ----

// silu(g) = g / (1 + exp(-g)) and gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi)
// (g + 0.044715 g^3))), in f32, as elementwise.cu's silu_mul and
// gelu_tanh_mul compute them.
KILN_DEV float kiln_silu(float g) { return g / (1.0f + expf(-g)); }
KILN_DEV float kiln_gelu_tanh(float g) {
  const float k0 = 0.7978845608028654f;  // sqrt(2/pi)
  return 0.5f * g * (1.0f + tanhf(k0 * (g + 0.044715f * g * g * g)));
}

// The inverse RMS 1 / sqrt(mean(x^2) + eps) of each of the `tokens` bf16
// rows of x ([tokens, k], 16-byte aligned, k % 8 == 0), into inv[0, tokens):
// warp w of the block takes rows w, w + warps, ..., its lanes 8-element
// chunks, f32 sums (deterministic). The caller synchronizes the block
// before reading inv.
KILN_DEV void kiln_inv_rms_rows(const kbf16* __restrict__ x, int tokens, int k, float eps,
                                float* inv) {
  const int lane = threadIdx.x % KILN_WARP;
  const int warps = blockDim.x / KILN_WARP;
  const int kv = k / 8;
  for (int t = threadIdx.x / KILN_WARP; t < tokens; t += warps) {
    const uint4* xv = reinterpret_cast<const uint4*>(x + (i64)t * k);
    float ss = 0.0f;
    for (int c = lane; c < kv; c += KILN_WARP) {
      float f[8];
      unpack8(xv[c], x, f);
#pragma unroll
      for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
    }
    ss = warp_sum(ss);
    if (lane == 0) inv[t] = 1.0f / sqrtf(ss / (float)k + eps);
  }
}

// kiln_inv_rms_rows for one row, shared by the whole block (the one-token
// integer-dot GEMV, qgemv.cu): thread i sums 8-element chunks i, i +
// blockDim, ..., the loads of up to KILN_RMS_BATCH chunks issued before any
// is used, one partial per warp through shared memory, added by thread 0
// in warp order (deterministic). One warp alone waited for each of its
// loads in turn: 16 L2 round trips at K = 4096 (Llama-3-8B b1 Q4_K 2.750
// -> 2.662 ms with this form, bench/results/gpu-2026-12-04-s18/). Every
// thread of the block must call it; the caller synchronizes the block
// before reading inv[0].
#define KILN_RMS_BATCH 8
KILN_DEV void kiln_inv_rms_row_block(const kbf16* __restrict__ x, int k, float eps, float* inv) {
  __shared__ float part[32];
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const int kv = k / 8;
  const int stride = blockDim.x;
  float ss = 0.0f;
  for (int c0 = threadIdx.x; c0 < kv; c0 += KILN_RMS_BATCH * stride) {
    uint4 v[KILN_RMS_BATCH];
#pragma unroll
    for (int b = 0; b < KILN_RMS_BATCH; ++b) {
      const int c = c0 + b * stride;
      if (c < kv) v[b] = xv[c];
    }
#pragma unroll
    for (int b = 0; b < KILN_RMS_BATCH; ++b) {
      if (c0 + b * stride < kv) {
        float f[8];
        unpack8(v[b], x, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
      }
    }
  }
  ss = warp_sum(ss);
  if (threadIdx.x % KILN_WARP == 0) part[threadIdx.x / KILN_WARP] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
    for (int w = 0; w < (int)(blockDim.x / KILN_WARP); ++w) t += part[w];
    inv[0] = 1.0f / sqrtf(t / (float)k + eps);
  }
}

// ---- The per-head q/k RMSNorm + RoPE (qkv_rope_kv_write, rope_attention) ----
//
// One source for the arithmetic both rope.cu's qkv_rope_kv_write and
// attention.cu's rope_attention prologue run, so the fused attention ropes
// its query rows and the step's new keys bit for bit as the unfused op
// stores them. Rotate-half over the full head: for i < hd/2,
//   out[i] = x[i] cos(a) - x[i + hd/2] sin(a), out[i + hd/2] = x[i + hd/2] cos(a) + x[i] sin(a)
// with a = pos * inv_freq[i] (inv_freq rounded to f32 from the plan's f64
// table, passed by value); accurate sinf/cosf, not intrinsics.
#define KILN_ROPE_MAX_HALF 128  // head_dim <= 256
struct RopeFreqs {
  float f[KILN_ROPE_MAX_HALF];
};

// The pieces of a rotate-half rope every kernel that ropes runs, so their
// results agree bit for bit: the angle's cos/sin, the q/k norm's weight
// and its rounded product, and the rotation of one pair (x_i, x_{i+hd/2}),
// each result rounded to T once.
KILN_DEV void kiln_rope_cs(float p, const RopeFreqs& fr, int i, float& c, float& s) {
  const float ang = p * fr.f[i];
  c = cosf(ang);
  s = sinf(ang);
}
template <typename T> KILN_DEV float kiln_rope_nw(const T* nw, int i, int unit_offset) {
  float w = ld(nw[i]);
  if (unit_offset) w += 1.0f;
  return w;
}
template <typename T> KILN_DEV float kiln_rope_normed(float x, float inv, float w) {
  return round_to<T>(x * inv * w);
}
// The products and sums are rounded one by one (no contraction into an
// FMA): the compiler contracts `a * c - b * s` differently in different
// kernels, and the fused GEMVs must give the unfused pair's bits (an H100
// run found one element a bf16 ulp apart before this).
template <typename T> KILN_DEV void kiln_rope_rot(float a, float b, float c, float s, T& o1, T& o2) {
  o1 = st<T>(__fadd_rn(__fmul_rn(a, c), -__fmul_rn(b, s)));
  o2 = st<T>(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
}

// One warp ropes the head at `src` (hd elements, hd even, <= 256): lane l
// holds the pairs (i, i + hd/2) for i = l, l + 32, ..., so the optional
// RMSNorm (weights nw, +1 with unit_offset; its result rounded to T, as the
// unfused head_rms_norm stores it) needs one warp sum. Every element's
// final value, rounded to T once, goes to store(i, value). Every lane of
// the warp must call it (the norm's warp sum).
template <typename T, typename Load, typename Wts, typename Cs, typename Store>
KILN_DEV void kiln_rope_head_core(Load load, int hd, int has_norm, float eps, Wts wts, Cs cs,
                                  Store store) {
  const int lane = threadIdx.x % KILN_WARP;
  const int half = hd / 2;
  constexpr int PER = KILN_ROPE_MAX_HALF / KILN_WARP;
  float a[PER], b[PER];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int i = lane + j * KILN_WARP;
    a[j] = i < half ? load(i) : 0.0f;
    b[j] = i < half ? load(i + half) : 0.0f;
    ss = __fadd_rn(ss, __fadd_rn(__fmul_rn(a[j], a[j]), __fmul_rn(b[j], b[j])));  // as kiln_rope_rot
  }
  if (has_norm) {
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)hd + eps);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = lane + j * KILN_WARP;
      if (i < half) {
        float w1, w2;
        wts(j, i, w1, w2);
        a[j] = kiln_rope_normed<T>(a[j], inv, w1);
        b[j] = kiln_rope_normed<T>(b[j], inv, w2);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int i = lane + j * KILN_WARP;
    if (i < half) {
      float c, s;
      cs(j, i, c, s);
      T o1, o2;
      kiln_rope_rot<T>(a[j], b[j], c, s, o1, o2);
      store(i, o1);
      store(i + half, o2);
    }
  }
}
// kiln_rope_head_core with the norm weights and the angles read and
// computed where they are used (rope.cu, attention.cu's prologue).
template <typename T, typename Load, typename Store>
KILN_DEV void kiln_rope_head_with(Load load, int hd, const T* nw, int has_norm, float eps,
                                  int unit_offset, float p, const RopeFreqs& fr, Store store) {
  const int half = hd / 2;
  kiln_rope_head_core<T>(
      load, hd, has_norm, eps,
      [&](int, int i, float& w1, float& w2) {
        w1 = kiln_rope_nw(nw, i, unit_offset);
        w2 = kiln_rope_nw(nw, i + half, unit_offset);
      },
      [&](int, int i, float& c, float& s) { kiln_rope_cs(p, fr, i, c, s); }, store);
}
template <typename T, typename Store>
KILN_DEV void kiln_rope_head(const T* src, int hd, const T* nw, int has_norm, float eps,
                             int unit_offset, float p, const RopeFreqs& fr, Store store) {
  kiln_rope_head_with<T>([&](int i) { return ld(src[i]); }, hd, nw, has_norm, eps, unit_offset, p,
                         fr, store);
}

// ---- The rope pair epilogue of the packed q/k/v GEMV (matmul_qkv_rope without q/k norm) ----
//
// Without a q/k RMSNorm no value of a head depends on more of the head than
// its rotate-half partner: element i pairs with i + hd/2 and nothing else.
// So the rope GEMV entries (gemv.cu, qgemv.cu) order the rows their warps
// own in pairs: logical rows 2p and 2p + 1 are the physical rows u*hd + i
// and u*hd + i + hd/2 of the packed q/k/v weight, with p = u*hd/2 + i. The
// lane that holds a warp's results then holds whole pairs; it rounds them
// to T (the values the unfused GEMV stores), ropes a q or k pair as
// qkv_rope_kv_write does (kiln_rope_cs / kiln_rope_rot), and stores it to
// q or to the K cache row at the slot, or copies a v pair to the V cache:
// no completion counter, no fence, no read back, and the packed row never
// goes to memory. `pos` and `slot` are read once per thread, right after
// the dependency wait (the GEMV body's KILN_PROLOGUE() calls after_wait()).
struct KilnRows {  // the identity order: row l is physical row l
  static constexpr bool may_pair = false;
  KILN_DEV bool on() const { return false; }
  KILN_DEV void after_wait() {}
  KILN_DEV i64 row(i64 l) const { return l; }
  KILN_DEV void store(i64, float, float) const {}
};
// One instantiation of the GEMV body serves both forms of a rope entry
// (the staged GEMV's static shared memory is per instantiation and a
// second copy would not fit): `pairs` is the launch's choice, false with a
// q/k norm (rows in order, the counted tail after the body).
template <typename T> struct KilnRopePairs {
  static constexpr bool may_pair = true;
  bool pairs;
  T* kc;
  T* vc;
  T* q_out;
  const RopeFreqs& fr;
  const int* pos;
  const int* slots;
  i64 num_slots;
  int heads, kvh, hd;
  float pos0 = 0.0f;  // pos[0] and slots[0], read by after_wait()
  i64 slot = -1;
  KILN_DEV bool on() const { return pairs; }
  // Right after the GEMV body's dependency wait: the position and slot are
  // in registers by the time the results are (their round trip hides
  // behind the weight loop instead of following it).
  KILN_DEV void after_wait() {
    if (pairs) {
      pos0 = (float)pos[0];
      slot = slots[0];
    }
  }
  KILN_DEV i64 row(i64 l) const {
    if (!pairs) return l;
    const int half = hd / 2;
    const i64 pr = l >> 1;
    const i64 u = pr / half;
    return u * hd + (pr - u * half) + (l & 1) * half;
  }
  // Logical rows l0 (even) and l0 + 1: y0, y1 already rounded to T.
  KILN_DEV void store(i64 l0, float y0, float y1) const {
    const int half = hd / 2;
    const i64 pr = l0 >> 1;
    const i64 u = pr / half;
    const int i = (int)(pr - u * half);
    const i64 kvrow = (i64)kvh * hd;
    if (u >= heads + kvh) {  // v head: copied into the cache
      if (slot < 0 || slot >= num_slots) return;
      T* dst = vc + slot * kvrow + (u - heads - kvh) * hd;
      dst[i] = st<T>(y0);
      dst[i + half] = st<T>(y1);
      return;
    }
    const bool is_q = u < heads;
    T* dst;
    if (is_q) {
      dst = q_out + u * hd;
    } else {
      if (slot < 0 || slot >= num_slots) return;
      dst = kc + slot * kvrow + (u - heads) * hd;
    }
    float c, s;
    kiln_rope_cs(pos0, fr, i, c, s);
    kiln_rope_rot<T>(y0, y1, c, s, dst[i], dst[i + half]);
  }
};

// ---- The rope tail of the packed q/k/v GEMV (matmul_qkv_rope) ----
//
// What qkv_rope_kv_write does for one token, done by the GEMV's own blocks
// (qgemv.cu's integer-dot entries and gemv.cu's dense ones). Every thread
// of a block calls it after the GEMV has stored the block's rows
// [rpb * b, rpb * (b + 1)) of the packed row `qkv` (the op's scratch). Unit
// u of that row (the q heads, then the k heads, then the v heads, hd rows
// each) is finished by the last block to store any of its rows: the block
// meets at a barrier, the units its rows touch are dealt to its warps, and
// a warp's lane 0 counts the block in on the unit's completion counter
// with one acquire-release add (kiln_count_in). While the count travels,
// every lane computes its pairs' angles and loads its norm weights. The
// warp that brings a counter to the number of blocks over that unit resets
// it to zero for the next launch and finishes the unit: its elements read
// back through L2 (other blocks stored them during this launch; an SM's L1
// is not coherent) straight into the lanes that need them, then
// qkv_rope_kv_write_units' arithmetic (kiln_rope_head_core for a q or k
// head, a copy for a v head, the same slot check), so the results are that
// kernel's bit for bit. No shared memory (the staged GEMV uses all of the
// static 48 KiB) and no barrier after the first. The GPU lowering reaches
// it only for heads with a q/k norm: without one the entries take the pair
// epilogue above instead. The finishing warp's chain after its block's
// stores is the add's round trip (its release waits for those stores),
// one L2 read and the arithmetic; the position and slot are read before
// the barrier.
KILN_DEV unsigned short kiln_ld_cg16(const unsigned short* p) {
#if defined(KILN_CUDA)
  return __ldcg(p);
#else
  return __builtin_nontemporal_load(p);
#endif
}

KILN_DEV int kiln_shfl_int(int v, int src) {
#if defined(KILN_CUDA)
  return __shfl_sync(0xffffffffu, v, src, KILN_WARP);
#else
  return __shfl(v, src, KILN_WARP);
#endif
}

// Lane 0 counts its block in on a unit: an acquire-release add at device
// scope. The release half publishes the block's stores (the barrier before
// it made them this thread's, and release is cumulative), the acquire half
// orders the finishing warp's reads after every other block's. It replaces
// a full fence (membar.gl, sequentially consistent) before the add and
// another after it.
KILN_DEV unsigned int kiln_count_in(unsigned int* p) {
#if defined(KILN_CUDA)
  unsigned int old;
  asm volatile("atom.acq_rel.gpu.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
  return old;
#else
  __threadfence();
  const unsigned int old = atomicAdd(p, 1u);
  __threadfence();
  return old;
#endif
}

// After lane 0's kiln_count_in: the other lanes' reads ordered after its
// acquire (a warp barrier orders memory among its lanes on CUDA; HIP
// fences each lane).
KILN_DEV void kiln_warp_acquire() {
#if defined(KILN_CUDA)
  __syncwarp();
#else
  __threadfence();
#endif
}

template <typename T>
KILN_DEV void kiln_rope_tail(const T* qkv, int n, int rpb, const int* __restrict__ pos,
                             const int* __restrict__ slots, T* kc, T* vc,
                             const T* __restrict__ qn, const T* __restrict__ kn,
                             T* __restrict__ q_out, unsigned int* counters, int heads, int kvh,
                             int hd, float eps, int has_norm, int unit_offset, i64 num_slots,
                             const RopeFreqs& fr) {
  static_assert(sizeof(T) == 2, "the rope tail reads 16-bit activations");
  constexpr int PER = KILN_ROPE_MAX_HALF / KILN_WARP;
  // Read before the barrier: their round trip overlaps the stores'.
  const float p = (float)pos[0];
  const i64 slot = slots[0];
  __syncthreads();
  const i64 r0 = (i64)blockIdx.x * rpb;
  const i64 r1 = r0 + rpb < (i64)n ? r0 + rpb : (i64)n;
  if (r0 >= r1) return;
  const int lane = threadIdx.x % KILN_WARP;
  const int warp = threadIdx.x / KILN_WARP;
  const int warps = (int)(blockDim.x / KILN_WARP);
  const int half = hd / 2;
  const i64 kvrow = (i64)kvh * hd;
  const bool slot_ok = slot >= 0 && slot < num_slots;
  // Warp-uniform loop: every lane of a warp takes the same units.
  for (i64 u = r0 / hd + warp; u <= (r1 - 1) / hd; u += warps) {
    const i64 b0 = u * hd / rpb, b1 = ((u + 1) * hd - 1) / rpb;
    unsigned int old = 0u;
    if (lane == 0) old = kiln_count_in(&counters[u]);
    // While the count travels: this lane's angles and norm weights.
    const bool is_q = u < heads;
    const bool rot = u < heads + kvh && (is_q || slot_ok);
    float c[PER], s[PER], w1[PER], w2[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int i = lane + j * KILN_WARP;
      c[j] = s[j] = w1[j] = w2[j] = 0.0f;
      if (rot && i < half) {
        kiln_rope_cs(p, fr, i, c[j], s[j]);
        if (has_norm) {
          w1[j] = kiln_rope_nw(is_q ? qn : kn, i, unit_offset);
          w2[j] = kiln_rope_nw(is_q ? qn : kn, i + half, unit_offset);
        }
      }
    }
    const int last =
        kiln_shfl_int(lane == 0 && old + 1u == (unsigned int)(b1 - b0 + 1) ? 1 : 0, 0);
    if (!last) continue;
    if (lane == 0) counters[u] = 0u;  // ready for the next launch
    kiln_warp_acquire();
    const unsigned short* src = reinterpret_cast<const unsigned short*>(qkv + u * hd);
    if (u >= heads + kvh) {  // v head: plain copy into the cache
      if (slot_ok) {
        T* dst = vc + slot * kvrow + (u - heads - kvh) * hd;
        for (int e = lane; e < hd; e += KILN_WARP) dst[e].bits = kiln_ld_cg16(src + e);
      }
    } else if (rot) {
      T* dst = is_q ? q_out + u * hd : kc + slot * kvrow + (u - heads) * hd;
      kiln_rope_head_core<T>(
          [&](int e) {
            T v;
            v.bits = kiln_ld_cg16(src + e);
            return ld(v);
          },
          hd, has_norm, eps,
          [&](int j, int, float& x1, float& x2) {
            x1 = w1[j];
            x2 = w2[j];
          },
          [&](int j, int, float& cc, float& sn) {
            cc = c[j];
            sn = s[j];
          },
          [&](int e, T v) { dst[e] = v; });
    }
  }
}
