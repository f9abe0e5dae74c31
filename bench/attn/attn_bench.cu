// Standalone timing harness for kiln's paged decode attention kernel
// (kernels/gpu/attention.cu), built with nvcc on the GPU machine:
//
//   nvcc -O3 -arch=sm_90 -lineinfo -I kernels/gpu bench/attn/attn_bench.cu -o attn_bench
//   ./attn_bench              # table: every model shape x batch x target blocks
//   ./attn_bench once M B     # one warm launch of model M at batch B (for ncu)
//
// Why it exists: inside a decode step attention is one of ~150-260 kernels
// and `kiln bench --profile` serializes them, so neither shows what the
// kernel itself costs in a graph. This harness replays a CUDA graph of many
// layers' attention launches (programmatic dependent launch on, as the
// runtime launches them) over KV caches that do not fit in L2, checks one
// output against a host reference, and prints the median time per launch
// next to an empty kernel's, the floor a launch in a graph cannot go under.
//
// The geometry mirrors `attention_geometry_for` in kernels/src/gpu.rs; the
// kernel is the one the plans use, included unchanged. Deliberately not
// here: the other kernels of a step (kiln bench times the whole step).
#include "attention.cu"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define CK(x)                                                                     \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                    \
    }                                                                             \
  } while (0)

typedef void (*AttnFn)(const kbf16*, const kbf16*, const kbf16*, const int*, const int*, float*,
                       float*, unsigned int*, kbf16*, AttnShape);

// The streaming kernel at other keys-per-pass (KU) than the catalog's.
#define KU_ENTRY(RT, KU)                                                                      \
  KILN_GLOBAL void __launch_bounds__(KILN_ATTN_THREADS)                                       \
      attn_ku_r##RT##_k##KU(const kbf16* q, const kbf16* kc, const kbf16* vc, const int* bt,  \
                            const int* cl, float* acc, float* ml, unsigned int* counters,     \
                            kbf16* out, AttnShape a) {                                        \
    attn_part<kbf16, RT, 8, true, KU>(q, kc, vc, bt, cl, acc, ml, counters, out, a);          \
  }
KU_ENTRY(1, 2) KU_ENTRY(1, 4) KU_ENTRY(2, 2) KU_ENTRY(2, 4) KU_ENTRY(4, 2) KU_ENTRY(4, 1)
KU_ENTRY(8, 2) KU_ENTRY(8, 1)

KILN_GLOBAL void null_kernel(int* p) {
  KILN_PROLOGUE();
  if (p != nullptr && threadIdx.x == 1000) p[0] = 1;
}

struct Geo {
  int rt, tiles, tg, part_len, num_parts, want_parts, shared, cluster, ku;
};

static Geo geometry(int batch, int query, int heads, int kvh, int hd, int bs, int max_blocks,
                    long target, int max_cluster, int ku = 0) {
  Geo g{};
  const int group = heads / kvh, rows = group * query;
  int rt = 8;
  for (int c : {1, 2, 4, 8})
    if (c >= rows) {
      rt = c;
      break;
    }
  g.rt = rt;
  g.tiles = (rows + rt - 1) / rt;
  const int nch = hd / 8;
  int tg = 1;
  while (tg < nch) tg <<= 1;
  g.tg = std::min(tg, 32);
  const long max_ctx = (long)max_blocks * bs;
  const long base = (long)batch * kvh * g.tiles;
  long pl = 512;
  while (pl > 32 && base * ((max_ctx + pl - 1) / pl) < target) pl /= 2;
  if ((max_ctx + pl - 1) / pl > 256) pl = ((max_ctx + 255) / 256 + 31) / 32 * 32;
  g.part_len = (int)pl;
  g.num_parts = (int)std::max(1L, (max_ctx + pl - 1) / pl);
  g.want_parts = (int)std::min<long>(std::max(1L, (target + base - 1) / base), g.num_parts);
  g.cluster = 1;
  while (g.cluster * 2 <= std::min(max_cluster, g.want_parts)) g.cluster *= 2;
  g.ku = ku;
  // The cluster gather region (kiln_kernels::gpu::attention_gather_floats);
  // the plain combine where it does not fit.
  const long warps = 4;
  const long stream = (long)rt * hd + pl + warps * rt * (hd + 2);
  auto bytes = [&](int c) {
    const long part = stream + (c > 1 ? (long)rt * hd + 16L * (1 + 2 * rt) : 0);
    return std::max(part, (long)rt * (g.num_parts + 1)) * 4;
  };
  if (g.cluster < 4 || bytes(g.cluster) > 48 * 1024) g.cluster = 1;
  g.num_parts = (g.num_parts + g.cluster - 1) / g.cluster * g.cluster;
  g.shared = (int)bytes(g.cluster);
  return g;
}

static AttnFn stream_fn(int rt, int ku = 0) {
  if (ku == 2) return rt == 1 ? attn_ku_r1_k2 : rt == 2 ? attn_ku_r2_k2 : rt == 4 ? attn_ku_r4_k2 : attn_ku_r8_k2;
  if (ku == 1) return rt == 4 ? attn_ku_r4_k1 : attn_ku_r8_k1;
  if (ku == 4 && rt <= 2) return rt == 1 ? attn_ku_r1_k4 : attn_ku_r2_k4;
  switch (rt) {
    case 1: return paged_attn_stream_r1_bf16;
    case 2: return paged_attn_stream_r2_bf16;
    case 4: return paged_attn_stream_r4_bf16;
    default: return paged_attn_stream_r8_bf16;
  }
}

static float bf2f(unsigned short b) {
  unsigned int u = (unsigned int)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

struct Model {
  const char* name;
  int heads, kvh, hd, layers;
};

struct Layer {
  kbf16 *q, *k, *v, *out;
  int* bt;
};

struct Setup {
  int batch, query, heads, kvh, hd, bs, max_blocks, ctx;
  std::vector<Layer> layers;
  int* ctx_lens;
  float *acc, *ml;
  unsigned int* counters;
  std::vector<unsigned short> hq, hk, hv;  // layer 0, for the reference
  std::vector<int> hbt;
};

KILN_GLOBAL void fill_kernel(kbf16* d, size_t n, unsigned int seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    unsigned int h = (unsigned int)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float f = (float)(h & 0xffffu) / 32768.0f - 1.0f;  // [-1, 1)
    d[i] = st<kbf16>(f);
  }
}

// Pseudo-random values in [-1, 1) on the device; `keep` receives a copy.
static void fill_random(kbf16* d, size_t n, unsigned int seed, std::vector<unsigned short>* keep) {
  fill_kernel<<<1024, 256>>>(d, n, seed);
  CK(cudaGetLastError());
  if (keep) {
    keep->resize(n);
    CK(cudaMemcpy(keep->data(), d, n * 2, cudaMemcpyDeviceToHost));
  }
}

static Setup make_setup(const Model& m, int batch, int ctx, int nlayers) {
  Setup s{};
  s.batch = batch;
  s.query = 1;
  s.heads = m.heads;
  s.kvh = m.kvh;
  s.hd = m.hd;
  s.bs = 16;
  s.max_blocks = 256;
  s.ctx = ctx;
  std::mt19937 rng(1234);  // block-table permutation
  const int used = (ctx + s.bs - 1) / s.bs;
  const int pool = batch * used;
  const size_t kv_elems = (size_t)pool * s.bs * m.kvh * m.hd;
  for (int l = 0; l < nlayers; ++l) {
    Layer L{};
    CK(cudaMalloc(&L.q, (size_t)batch * m.heads * m.hd * 2));
    CK(cudaMalloc(&L.out, (size_t)batch * m.heads * m.hd * 2));
    CK(cudaMalloc(&L.k, kv_elems * 2));
    CK(cudaMalloc(&L.v, kv_elems * 2));
    CK(cudaMalloc(&L.bt, (size_t)batch * s.max_blocks * 4));
    fill_random(L.q, (size_t)batch * m.heads * m.hd, 3 * l + 1, l == 0 ? &s.hq : nullptr);
    fill_random(L.k, kv_elems, 3 * l + 2, l == 0 ? &s.hk : nullptr);
    fill_random(L.v, kv_elems, 3 * l + 3, l == 0 ? &s.hv : nullptr);
    std::vector<int> perm(pool);
    for (int i = 0; i < pool; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<int> bt((size_t)batch * s.max_blocks, 0);
    for (int b = 0; b < batch; ++b)
      for (int i = 0; i < used; ++i) bt[(size_t)b * s.max_blocks + i] = perm[b * used + i];
    CK(cudaMemcpy(L.bt, bt.data(), bt.size() * 4, cudaMemcpyHostToDevice));
    if (l == 0) s.hbt = bt;
    s.layers.push_back(L);
  }
  std::vector<int> cl(batch, ctx);
  CK(cudaMalloc(&s.ctx_lens, batch * 4));
  CK(cudaMemcpy(s.ctx_lens, cl.data(), batch * 4, cudaMemcpyHostToDevice));
  // Scratch and counters for the widest geometry any target gives.
  const size_t rp = (size_t)batch * m.heads * 256;
  CK(cudaMalloc(&s.acc, rp * m.hd * 4));
  CK(cudaMalloc(&s.ml, rp * 2 * 4));
  const size_t ncount = (size_t)batch * m.heads;
  CK(cudaMalloc(&s.counters, ncount * 4));
  CK(cudaMemset(s.counters, 0, ncount * 4));
  return s;
}

static void free_setup(Setup& s) {
  for (auto& L : s.layers) {
    cudaFree(L.q);
    cudaFree(L.out);
    cudaFree(L.k);
    cudaFree(L.v);
    cudaFree(L.bt);
  }
  cudaFree(s.ctx_lens);
  cudaFree(s.acc);
  cudaFree(s.ml);
  cudaFree(s.counters);
}

static AttnShape shape_of(const Setup& s, const Geo& g) {
  AttnShape a{};
  a.batch = s.batch;
  a.query = s.query;
  a.heads = s.heads;
  a.kv_heads = s.kvh;
  a.head_dim = s.hd;
  a.block_size = s.bs;
  a.max_blocks = s.max_blocks;
  a.window = 0;
  a.scale = 1.0f / sqrtf((float)s.hd);
  a.softcap = 0.0f;
  a.part_len = g.part_len;
  a.num_parts = g.num_parts;
  a.tiles = g.tiles;
  a.tg = g.tg;
  a.want_parts = g.want_parts;
  a.cluster = g.cluster;
  return a;
}

static void launch(cudaStream_t st, AttnFn fn, const Setup& s, const Layer& L, const Geo& g,
                   const AttnShape& a) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(g.num_parts, s.batch * s.kvh * g.tiles, 1);
  cfg.blockDim = dim3(KILN_ATTN_THREADS, 1, 1);
  cfg.dynamicSmemBytes = g.shared;
  cfg.stream = st;
  cudaLaunchAttribute at[2];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  at[1].id = cudaLaunchAttributeClusterDimension;
  at[1].val.clusterDim.x = g.cluster;
  at[1].val.clusterDim.y = 1;
  at[1].val.clusterDim.z = 1;
  cfg.attrs = at;
  cfg.numAttrs = g.cluster > 1 ? 2 : 1;
  if (g.cluster > 8) CK(cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  CK(cudaLaunchKernelEx(&cfg, fn, (const kbf16*)L.q, (const kbf16*)L.k, (const kbf16*)L.v,
                        (const int*)L.bt, (const int*)s.ctx_lens, s.acc, s.ml, s.counters, L.out,
                        a));
}

static void launch_null(cudaStream_t st) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(64, 1, 1);
  cfg.blockDim = dim3(128, 1, 1);
  cfg.stream = st;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  CK(cudaLaunchKernelEx(&cfg, null_kernel, (int*)nullptr));
}

// Max |kernel - reference| over layer 0's output (f32 reference from the
// same bf16 inputs).
static double check(const Setup& s) {
  const int hd = s.hd, group = s.heads / s.kvh;
  std::vector<unsigned short> out((size_t)s.batch * s.heads * hd);
  CK(cudaMemcpy(out.data(), s.layers[0].out, out.size() * 2, cudaMemcpyDeviceToHost));
  double worst = 0.0;
  const float scale = 1.0f / sqrtf((float)hd);
  for (int b = 0; b < s.batch; ++b)
    for (int h = 0; h < s.heads; ++h) {
      const int g = h / group;
      std::vector<double> sc(s.ctx);
      double mx = -1e30;
      for (int p = 0; p < s.ctx; ++p) {
        const int slot = s.hbt[(size_t)b * s.max_blocks + p / s.bs] * s.bs + p % s.bs;
        double d = 0;
        for (int x = 0; x < hd; ++x)
          d += bf2f(s.hq[((size_t)b * s.heads + h) * hd + x]) *
               bf2f(s.hk[((size_t)slot * s.kvh + g) * hd + x]);
        sc[p] = d * scale;
        mx = std::max(mx, sc[p]);
      }
      double l = 0;
      for (int p = 0; p < s.ctx; ++p) l += (sc[p] = exp(sc[p] - mx));
      for (int x = 0; x < hd; ++x) {
        double o = 0;
        for (int p = 0; p < s.ctx; ++p) {
          const int slot = s.hbt[(size_t)b * s.max_blocks + p / s.bs] * s.bs + p % s.bs;
          o += sc[p] * bf2f(s.hv[((size_t)slot * s.kvh + g) * hd + x]);
        }
        o /= l;
        worst = std::max(worst, fabs(o - bf2f(out[((size_t)b * s.heads + h) * hd + x])));
      }
    }
  return worst;
}

// Median microseconds per launch over `reps` replays of a graph holding
// `passes` passes over every layer.
static double time_graph(cudaStream_t st, const Setup& s, AttnFn fn, const Geo& g, bool null_only,
                         int passes, int reps) {
  const AttnShape a = shape_of(s, g);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  int n = 0;
  for (int p = 0; p < passes; ++p)
    for (const Layer& L : s.layers) {
      if (null_only) {
        launch_null(st);
      } else {
        launch(st, fn, s, L, g, a);
      }
      ++n;
    }
  CK(cudaStreamEndCapture(st, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaGraphLaunch(exec, st));
  CK(cudaStreamSynchronize(st));
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(e0, st));
    CK(cudaGraphLaunch(exec, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms * 1000.0 / n);
  }
  std::sort(t.begin(), t.end());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return t[t.size() / 2];
}

static const Model MODELS[] = {
    {"smollm2-135m", 9, 3, 64, 30},
    {"qwen3-0.6b", 16, 8, 128, 28},
    {"llama-3.2-1b", 32, 8, 64, 16},
    {"llama-3-8b", 32, 8, 128, 32},
};

int main(int argc, char** argv) {
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const int ctx = getenv("ATTN_CTX") ? atoi(getenv("ATTN_CTX")) : 512;
  if (argc >= 4 && std::string(argv[1]) == "once") {
    const Model* m = nullptr;
    for (const Model& x : MODELS)
      if (x.name == std::string(argv[2])) m = &x;
    if (!m) {
      fprintf(stderr, "unknown model %s\n", argv[2]);
      return 2;
    }
    const int batch = atoi(argv[3]);
    const long target = argc >= 5 ? atol(argv[4]) : 256;
    const int cl = argc >= 6 ? atoi(argv[5]) : 8;
    const int ku = argc >= 7 ? atoi(argv[6]) : 0;
    const Geo g = geometry(batch, 1, m->heads, m->kvh, m->hd, 16, 256, target, cl, ku);
    Setup s = make_setup(*m, batch, ctx, 1);
    const AttnShape a = shape_of(s, g);
    for (int i = 0; i < 3; ++i) launch(st, stream_fn(g.rt, g.ku), s, s.layers[0], g, a);
    CK(cudaStreamSynchronize(st));
    printf("%s b%d ctx %d target %ld cluster %d: err %.2e\n", m->name, batch, ctx, target,
           g.cluster, check(s));
    free_setup(s);
    return 0;
  }
  printf("ctx %d; us per launch, median of 20 graph replays; KV bytes read per launch; GB/s\n",
         ctx);
  printf("%-14s %5s %6s %3s %2s %5s %5s %6s %9s %9s %8s %8s %9s\n", "model", "batch", "target", "cl", "ku",
         "parts", "plen", "grid", "us", "null_us", "KV_MB", "GB/s", "err");
  for (const Model& m : MODELS) {
    std::vector<int> batches = {1, 8, 32};
    if (getenv("ATTN_BATCHES")) {
      batches.clear();
      std::string list = getenv("ATTN_BATCHES");
      for (char* t = strtok(&list[0], ","); t; t = strtok(nullptr, ",")) batches.push_back(atoi(t));
    }
    for (int batch : batches) {
      const double kv_mb = 2.0 * batch * ctx * m.kvh * m.hd * 2 / 1e6;
      // Enough distinct layers that their KV does not stay in the 50 MB L2.
      int nl = std::max(m.layers, (int)std::ceil(200.0 / kv_mb));
      nl = std::min(nl, 256);
      Setup s = make_setup(m, batch, ctx, nl);
      // (target blocks, largest cluster, KU; 0 = the catalog's KU)
      // {256, 1, 0}: the plain combine (sm_80, HIP, --no-attn-clusters);
      // {256, 16, 0}: what kiln compile lowers for sm_90.
      const int variants[][3] = {{256, 1, 0}, {256, 16, 0}, {256, 8, 0}, {512, 16, 0}, {512, 16, 4}};
      for (const auto& vt : variants) {
        const long target = vt[0];
        int ku = vt[2];
        const int rt0 = geometry(batch, 1, m.heads, m.kvh, m.hd, 16, 256, 256, 1).rt;
        if (ku == 1 && rt0 < 4) ku = 2;
        if (ku == 4 && rt0 > 2) ku = 0;
        const Geo g = geometry(batch, 1, m.heads, m.kvh, m.hd, 16, 256, target, vt[1], ku);
        const AttnFn fn = stream_fn(g.rt, g.ku);
        const int passes = std::max(1, 512 / nl);
        const double us = time_graph(st, s, fn, g, false, passes, 20);
        const double nus = time_graph(st, s, fn, g, true, passes, 20);
        CK(cudaStreamSynchronize(st));
        const double err = check(s);
        const int kuv = g.ku ? g.ku : (g.rt <= 2 ? 8 : 4);
        const int dyn = std::max((ctx + g.want_parts - 1) / g.want_parts, kuv * 4 * (32 / g.tg));
        const int plen = std::min(((dyn + 15) & ~15), g.part_len);
        printf("%-14s %5d %6ld %3d %2d %5d %5d %6d %9.2f %9.2f %8.2f %8.0f %9.2e\n", m.name, batch,
               target, g.cluster, kuv, (ctx + plen - 1) / plen, plen,
               g.num_parts * batch * m.kvh * g.tiles, us, nus, kv_mb, kv_mb * 1e3 / us, err);
        fflush(stdout);
      }
      free_setup(s);
    }
  }
  return 0;
}
