// Standalone timing harness for kiln's dense decode GEMV (kernels/gpu/gemv.cu),
// built here with nvcc and run on the GPU machine:
//
//   nvcc -O3 -arch=sm_90 -lineinfo -I kernels/gpu bench/gemv/gemv_bench.cu -o gemv_bench
//   ./gemv_bench                 # table: every model projection, both kernels, KS 1/2/4
//   ./gemv_bench once E N K      # one warm launch of entry E (for ncu)
//
// Why it exists: inside a decode step a GEMV is one of 150-260 kernels, and
// the step's time does not say what one GEMV costs in a graph. This harness
// replays a CUDA graph of 20 launches of one entry (programmatic dependent
// launch on, as the runtime launches them), cycling through enough copies
// of the weight that they do not stay in L2, checks that the staged kernel's
// output equals the register kernel's bit for bit (same arithmetic, see
// gemv.cu), and prints the median time per launch as GB/s of weight bytes.
// Deliberately not here: the other kernels of a step (kiln bench times it).
#include "gemv.cu"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));    \
      exit(1);                                                                              \
    }                                                                                       \
  } while (0)

KILN_GLOBAL void null_kernel(int* p) {
  KILN_PROLOGUE();
  if (p != nullptr && threadIdx.x == 1000) p[0] = 1;
}

typedef void (*GemvB)(const kbf16*, const kbf16*, const kbf16*, kbf16*, int, int, int, int);
typedef void (*GemvF)(const kbf16*, const kbf16*, const kbf16*, float*, int, int, int, int);

struct Entry {
  const char* name;
  void* fn;
  int ks, tt, f32;
};
static const Entry ENTRIES[] = {
    {"gemv_t1_bf16_bf16", (void*)gemv_t1_bf16_bf16, 1, 1, 0},
    {"gemv_k2_t1_bf16_bf16", (void*)gemv_k2_t1_bf16_bf16, 2, 1, 0},
    {"gemv_k4_t1_bf16_bf16", (void*)gemv_k4_t1_bf16_bf16, 4, 1, 0},
    {"gemv_t1_bf16_f32", (void*)gemv_t1_bf16_f32, 1, 1, 1},
    {"gemv_t8_bf16_bf16", (void*)gemv_t8_bf16_bf16, 1, 8, 0},
    {"gemv_k2_t8_bf16_bf16", (void*)gemv_k2_t8_bf16_bf16, 2, 8, 0},
    {"gemv_staged_t1_bf16_bf16", (void*)gemv_staged_t1_bf16_bf16, 1, 1, 0},
    {"gemv_staged_k2_t1_bf16_bf16", (void*)gemv_staged_k2_t1_bf16_bf16, 2, 1, 0},
    {"gemv_staged_k4_t1_bf16_bf16", (void*)gemv_staged_k4_t1_bf16_bf16, 4, 1, 0},
    {"gemv_staged_t1_bf16_f32", (void*)gemv_staged_t1_bf16_f32, 1, 1, 1},
};

static const Entry* find(const std::string& n) {
  for (const Entry& e : ENTRIES)
    if (n == e.name) return &e;
  fprintf(stderr, "unknown entry %s\n", n.c_str());
  exit(2);
}

KILN_GLOBAL void fill_kernel(kbf16* d, size_t n, unsigned int seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    unsigned int h = (unsigned int)i * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    const float f = ((h & 0xffffu) / 65535.0f - 0.5f) * 0.25f;
    d[i] = st<kbf16>(f);
  }
}

static void launch(const Entry& e, cudaStream_t s, const kbf16* x, const kbf16* w, void* out,
                   int tokens, int n, int k) {
  const int rows_per_block = 16 / e.ks;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((n + rows_per_block - 1) / rows_per_block);
  cfg.blockDim = dim3(KILN_GEMV_WARPS * KILN_WARP);
  cfg.stream = s;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  const kbf16* nb = nullptr;
  if (e.f32)
    CK(cudaLaunchKernelEx(&cfg, (GemvF)e.fn, x, w, nb, (float*)out, tokens, n, k, 1));
  else
    CK(cudaLaunchKernelEx(&cfg, (GemvB)e.fn, x, w, nb, (kbf16*)out, tokens, n, k, 1));
}

struct Shape {
  const char* model;
  const char* what;
  int n, k, f32;
};
static const Shape SHAPES[] = {
    {"smollm2-135m", "qkv", 960, 576, 0},       {"smollm2-135m", "o", 576, 576, 0},
    {"smollm2-135m", "gate_up", 3072, 576, 0},  {"smollm2-135m", "down", 576, 1536, 0},
    {"smollm2-135m", "lm_head", 49152, 576, 1}, {"qwen3-0.6b", "qkv", 4096, 1024, 0},
    {"qwen3-0.6b", "o", 1024, 2048, 0},         {"qwen3-0.6b", "gate_up", 6144, 1024, 0},
    {"qwen3-0.6b", "down", 1024, 3072, 0},      {"qwen3-0.6b", "lm_head", 151936, 1024, 1},
    {"llama-3.2-1b", "qkv", 3072, 2048, 0},     {"llama-3.2-1b", "o", 2048, 2048, 0},
    {"llama-3.2-1b", "gate_up", 16384, 2048, 0}, {"llama-3.2-1b", "down", 2048, 8192, 0},
    {"llama-3.2-1b", "lm_head", 128256, 2048, 1}, {"qwen3-4b", "qkv", 6144, 2560, 0},
    {"qwen3-4b", "o", 2560, 4096, 0},           {"qwen3-4b", "gate_up", 19456, 2560, 0},
    {"qwen3-4b", "down", 2560, 9728, 0},        {"llama-3-8b", "qkv", 6144, 4096, 0},
    {"llama-3-8b", "o", 4096, 4096, 0},         {"llama-3-8b", "gate_up", 28672, 4096, 0},
    {"llama-3-8b", "down", 4096, 14336, 0},
};

static float time_graph(const Entry& e, cudaStream_t s, std::vector<kbf16*>& ws, kbf16* x,
                        void* out, int tokens, int n, int k) {
  const int per_graph = 20;
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < per_graph; ++i) launch(e, s, x, ws[i % ws.size()], out, tokens, n, k);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, s));
  CK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ts;
  for (int r = 0; r < 15; ++r) {
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1000.0f / per_graph);
  }
  std::sort(ts.begin(), ts.end());
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return ts[ts.size() / 2];
}

int main(int argc, char** argv) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  if (argc >= 5 && std::string(argv[1]) == "once") {
    const Entry* e = find(argv[2]);
    const int n = atoi(argv[3]), k = atoi(argv[4]);
    kbf16 *w, *x;
    void* out;
    CK(cudaMalloc(&w, (size_t)n * k * 2));
    CK(cudaMalloc(&x, (size_t)8 * k * 2));
    CK(cudaMalloc(&out, (size_t)8 * n * 4));
    fill_kernel<<<1024, 256, 0, s>>>(w, (size_t)n * k, 1);
    fill_kernel<<<64, 256, 0, s>>>(x, (size_t)8 * k, 2);
    for (int i = 0; i < 3; ++i) launch(*e, s, x, w, out, e->tt, n, k);
    CK(cudaStreamSynchronize(s));
    return 0;
  }
  // The empty kernel's time per launch in a graph: the floor.
  {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < 20; ++i) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(132);
      cfg.blockDim = dim3(256);
      cfg.stream = s;
      cudaLaunchAttribute at[1];
      at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      at[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = at;
      cfg.numAttrs = 1;
      CK(cudaLaunchKernelEx(&cfg, null_kernel, (int*)nullptr));
    }
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> ts;
    for (int r = 0; r < 15; ++r) {
      CK(cudaEventRecord(a, s));
      CK(cudaGraphLaunch(ge, s));
      CK(cudaEventRecord(b, s));
      CK(cudaEventSynchronize(b));
      float ms;
      CK(cudaEventElapsedTime(&ms, a, b));
      ts.push_back(ms * 1000.0f / 20);
    }
    std::sort(ts.begin(), ts.end());
    printf("empty kernel in a graph: %.2f us per launch\n", ts[7]);
  }
  const char* only = getenv("GEMV_ONLY");  // a model name
  const int tt_list[2] = {1, 8};
  printf("%-13s %-8s %7s %6s %2s %-28s %9s %9s %6s\n", "model", "op", "n", "k", "T", "entry",
         "us", "GB/s", "same");
  for (const Shape& sh : SHAPES) {
    if (only && std::string(only) != sh.model) continue;
    const size_t wbytes = (size_t)sh.n * sh.k * 2;
    const size_t copies = (size_t)(320u << 20) / wbytes + 1;
    std::vector<kbf16*> ws(std::min<size_t>(copies, 20));
    for (size_t i = 0; i < ws.size(); ++i) {
      CK(cudaMalloc(&ws[i], wbytes));
      fill_kernel<<<1024, 256, 0, s>>>(ws[i], (size_t)sh.n * sh.k, 7 + (unsigned)i);
    }
    kbf16* x;
    CK(cudaMalloc(&x, (size_t)8 * sh.k * 2));
    fill_kernel<<<64, 256, 0, s>>>(x, (size_t)8 * sh.k, 99);
    void *ref, *got;
    CK(cudaMalloc(&ref, (size_t)8 * sh.n * 4));
    CK(cudaMalloc(&got, (size_t)8 * sh.n * 4));
    for (int tt : tt_list) {
      if (tt == 8 && sh.f32) continue;
      // The register kernel of the same KS is the reference.
      for (const Entry& e : ENTRIES) {
        if (e.tt != tt || e.f32 != sh.f32) continue;
        const bool staged = strstr(e.name, "staged") != nullptr;
        const size_t ob = (size_t)tt * sh.n * (sh.f32 ? 4 : 2);
        std::string same = "-";
        if (staged) {
          std::string rn = e.name;
          rn.erase(rn.find("staged_"), 7);
          const Entry* r = find(rn);
          CK(cudaMemsetAsync(ref, 0xff, ob, s));
          CK(cudaMemsetAsync(got, 0xee, ob, s));
          launch(*r, s, x, ws[0], ref, tt, sh.n, sh.k);
          launch(e, s, x, ws[0], got, tt, sh.n, sh.k);
          std::vector<unsigned char> a(ob), b(ob);
          CK(cudaMemcpyAsync(a.data(), ref, ob, cudaMemcpyDeviceToHost, s));
          CK(cudaMemcpyAsync(b.data(), got, ob, cudaMemcpyDeviceToHost, s));
          CK(cudaStreamSynchronize(s));
          same = memcmp(a.data(), b.data(), ob) == 0 ? "yes" : "NO";
        }
        const float us = time_graph(e, s, ws, x, got, tt, sh.n, sh.k);
        printf("%-13s %-8s %7d %6d %2d %-28s %9.2f %9.0f %6s\n", sh.model, sh.what, sh.n, sh.k, tt,
               e.name, us, wbytes / (us * 1e-6) / 1e9, same.c_str());
        fflush(stdout);
      }
    }
    for (kbf16* p : ws) CK(cudaFree(p));
    CK(cudaFree(x));
    CK(cudaFree(ref));
    CK(cudaFree(got));
  }
  return 0;
}
