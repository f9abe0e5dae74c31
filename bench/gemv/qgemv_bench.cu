// Standalone timing harness for kiln's quantized decode GEMMs
// (kernels/gpu/qgemv.cu, kernels/gpu/qskinny.cu), built here with nvcc and
// run on the GPU machine:
//
//   nvcc -O3 -arch=sm_90 -lineinfo -I kernels/gpu bench/gemv/qgemv_bench.cu -o qgemv_bench
//   ./qgemv_bench                  # table: types x shapes x kernels at T = 1 and 8
//   ./qgemv_bench once E TYPE N K T  # one warm launch (for ncu)
//
// Why it exists: to compare kernel variants for one token at the shapes of
// Llama-3-8B and Qwen3-4B without a whole plan. The weights are random bytes
// in the repacked layout (kernels/src/quant_gpu.rs; scales are small f16
// values so every result is finite); each variant's output is compared with
// qgemv's (the tested kernel) within a relative bound, since the variants
// sum in another order. Times: a CUDA graph of 20 launches (PDL on) cycling
// through enough weight copies to exceed L2, median of 15 replays.
#include "qgemv.cu"
#ifndef QB_NO_SKINNY
#include "qskinny.cu"
#endif

#include <cuda_runtime.h>

// Geometry variants of the integer-dot GEMV (qdot_rows' R, U, KS, PIPE and
// the blocks-per-SM bound), one token, bf16 out: kind 3 of the table below.
#define QDV1(NAME, S, Q, R, U, KS, PIPE, MINB)                                                  \
  KILN_GLOBAL void __launch_bounds__(KILN_QWARPS * KILN_WARP, MINB)                             \
      NAME##_##S(const kbf16* x, const unsigned char* w, const float* scale, const kbf16* bias, \
                 const kbf16* res, kbf16* out, int tokens, int n, int k, int w_const, i64 off1, \
                 i64 off2, i64 off3) {                                                          \
    qdot_rows<Q, kbf16, 0, 0, R, U, KS, PIPE>(x, w, bias, nullptr, res, out, n, k, w_const,    \
                                              off1, off2, off3, 0.0f, 0, KQ_FUSED_NONE);       \
  }
#define QDV(NAME, R, U, KS, PIPE, MINB)           \
  QDV1(NAME, q4k, KQ_Q4K, R, U, KS, PIPE, MINB)   \
  QDV1(NAME, q6k, KQ_Q6K, R, U, KS, PIPE, MINB)
#define QDV_LIST(X)                  \
  X(i8_r4u2k2, 4, 2, 2, 0, 2)        \
  X(i8_r4u2k4, 4, 2, 4, 0, 2)        \
  X(i8_r2u2k1, 2, 2, 1, 0, 2)        \
  X(i8_r2u2k2, 2, 2, 2, 0, 2)        \
  X(i8_r2u4k1, 2, 4, 1, 0, 2)        \
  X(i8_r4u2k1p, 4, 2, 1, 1, 1)       \
  X(i8_r4u2k1p2, 4, 2, 1, 1, 2)      \
  X(i8_r4u2k2p2, 4, 2, 2, 1, 2)      \
  X(i8_r2u2k1p, 2, 2, 1, 1, 2)       \
  X(i8_r2u2k2p, 2, 2, 2, 1, 2)       \
  X(i8_r4u1k1p, 4, 1, 1, 1, 2)       \
  X(i8_r4u1k2p, 4, 1, 2, 1, 2)        \
  X(i8_r4u1k1, 4, 1, 1, 0, 2)         \
  X(i8_r4u2k1m2, 4, 2, 1, 0, 2)
QDV_LIST(QDV)

// Diagnostic, not a GEMV: only the x preparation every integer-dot block
// does before its first product (the plain geometry's grid), so its share
// of a launch can be read off against the whole kernel's time. Its output
// is one value per block (the "max rel" column is meaningless for it).
#define QDV_PREP1(S)                                                                           \
  KILN_GLOBAL void __launch_bounds__(KILN_QWARPS * KILN_WARP)                                  \
      i8_preponly_##S(const kbf16* x, const unsigned char*, const float*, const kbf16*,        \
                      const kbf16*, kbf16* out, int, int n, int k, int, i64, i64, i64) {       \
    __shared__ __align__(16) signed char xq[KILN_QD_MAXK];                                     \
    __shared__ float xd[KILN_QD_MAXK / 32];                                                    \
    __shared__ int xi[KILN_QD_MAXK / 16];                                                      \
    KILN_PROLOGUE();                                                                           \
    qd_prep_x<0>(x, nullptr, k, 1.0f, 0, xq, xd, xi);                                          \
    __syncthreads();                                                                           \
    if (threadIdx.x == 0 && blockIdx.x < n) out[blockIdx.x] = st<kbf16>(xd[0] + (float)xi[0]); \
  }
QDV_PREP1(q4k)
QDV_PREP1(q6k)

#include <algorithm>
#include <cmath>
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

typedef void (*QFn)(const kbf16*, const unsigned char*, const float*, const kbf16*,
                    const kbf16*, kbf16*, int, int, int, int, i64, i64, i64);

struct QType {
  const char* name;
  int q;
};
static const QType TYPES[] = {{"q4k", KQ_Q4K}, {"q6k", KQ_Q6K}, {"q8_0", KQ_Q8_0}, {"fp8", KQ_FP8}};

static size_t al16(size_t v) { return (v + 15) / 16 * 16; }

// Region sizes of the repacked layout (qgemv.cu's header).
static void layout(int q, size_t n, size_t k, size_t off[4], size_t& total) {
  size_t r[4] = {0, 0, 0, 0};
  if (q == KQ_Q4K) {
    r[0] = n * k / 2;
    r[1] = n * (k / 256) * 4;
    r[2] = n * (k / 64) * 4;
  } else if (q == KQ_Q6K) {
    r[0] = n * k / 2;
    r[1] = n * (k / 256) * 2;
    r[2] = n * (k / 32) * 2;
    r[3] = n * (k / 32) * 8;
  } else if (q == KQ_Q8_0) {
    r[0] = n * k;
    r[1] = n * (k / 32) * 2;
  } else {
    r[0] = n * k;
  }
  size_t at = 0;
  for (int i = 0; i < 4; ++i) {
    off[i] = at;
    at = al16(at + r[i]);
  }
  total = at;
}

// Random bytes; f16 scale fields of the metadata as small positive values.
KILN_GLOBAL void qfill(unsigned char* w, size_t total, size_t f16_from, size_t f16_to,
                       int fp8, unsigned int seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total / 2;
       i += (size_t)gridDim.x * blockDim.x) {
    unsigned int h = (unsigned int)i * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    unsigned short v = (unsigned short)h;
    const size_t b = 2 * i;
    if (b >= f16_from && b < f16_to) v = 0x2400u | (v & 0x3ffu);
    if (fp8 && b < f16_from) v &= 0x7777u;  // no e4m3 NaN codes
    reinterpret_cast<unsigned short*>(w)[i] = v;
  }
}
KILN_GLOBAL void xfill(kbf16* d, size_t n, unsigned int seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    unsigned int h = (unsigned int)i * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    d[i] = st<kbf16>(((h & 0xffffu) / 65535.0f - 0.5f));
  }
}

struct Kern {
  const char* name;
  int kind;  // 0 qgemv, 1 qskinny, 2 qgemv_i8 (T = 1 only), 3 an i8 variant (T = 1 only)
  int tp, mt;
  int rows_per_block;  // kind 3
  QFn q4k, q6k, q8_0;  // kind 3
};

static QFn pick(const Kern& kk, int q, int T) {
  if (kk.kind == 3) {
    if (T != 1) return nullptr;
    return q == KQ_Q4K ? kk.q4k : q == KQ_Q6K ? kk.q6k : q == KQ_Q8_0 ? kk.q8_0 : nullptr;
  }
#define QG(S, TT) (QFn) qgemv_##S##_t##TT##_bf16_bf16
#define QD(S) (T == 1 ? (QFn) qgemv_i8_##S##_t1_bf16_bf16 : nullptr)
#define QS(S, TP, MT) (QFn) qskinny_##S##_t##TP##_r##MT##_bf16_bf16
#ifdef QB_NO_SKINNY
#define QSK(S) return nullptr;
#else
#define QSK(S) return kk.mt == 1 ? QS(S, 8, 1) : QS(S, 8, 2);
#endif
#define PICK(S)                                                                 \
  if (kk.kind == 0) return T == 1 ? QG(S, 1) : QG(S, 8);                          \
  if (kk.kind == 2) return QD(S);                                                \
  QSK(S)
  switch (q) {
    case KQ_Q4K: { PICK(q4k) }
    case KQ_Q6K: { PICK(q6k) }
    case KQ_Q8_0: { PICK(q8_0) }
    default: {
      if (kk.kind == 2) return nullptr;
      if (kk.kind == 0) return T == 1 ? QG(fp8, 1) : QG(fp8, 8);
      QSK(fp8)
    }
  }
}

static int unit_elems(int q) { return q == KQ_FP8 ? 16 : (q == KQ_Q8_0 ? 32 : 64); }

static void launch(const Kern& kk, int q, cudaStream_t s, const kbf16* x, const unsigned char* w,
                   const float* scale, kbf16* out, int T, int n, int k, const size_t off[4]) {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  cfg.stream = s;
  if (kk.kind == 3) {
    cfg.gridDim = dim3((n + kk.rows_per_block - 1) / kk.rows_per_block);
    cfg.blockDim = dim3(KILN_QWARPS * KILN_WARP);
  } else if (kk.kind == 2) {
    cfg.gridDim = dim3((n + KILN_QWARPS * KILN_QD_ROWS - 1) / (KILN_QWARPS * KILN_QD_ROWS));
    cfg.blockDim = dim3(KILN_QWARPS * KILN_WARP);
  } else if (kk.kind == 0) {
    cfg.gridDim = dim3((n + 15) / 16);
    cfg.blockDim = dim3(KILN_QWARPS * KILN_WARP);
  } else {
    // lower_qskinny's geometry
    const int units = k / unit_elems(q);
    int warps = 16 / kk.mt;
    while (warps > 1 && 2 * warps > units) warps /= 2;
    cfg.gridDim = dim3((n + 16 * kk.mt - 1) / (16 * kk.mt));
    cfg.blockDim = dim3(32 * warps);
    cfg.dynamicSmemBytes = warps * kk.mt * (kk.tp / 8) * 4 * 32 * 4;
  }
  CK(cudaLaunchKernelEx(&cfg, pick(kk, q, T), x, w, q == KQ_FP8 ? scale : nullptr,
                        (const kbf16*)nullptr, (const kbf16*)nullptr, out, T, n, k, 1,
                        (i64)off[1], (i64)off[2], (i64)off[3]));
}

static const Kern KERNS[] = {
    {"qgemv", 0, 0, 0},
#ifndef QB_NO_SKINNY
    {"qskinny_r1", 1, 8, 1},
    {"qskinny_r2", 1, 8, 2},
#endif
    {"qgemv_i8", 2, 0, 0},
#define QDV_KERN(NAME, R, U, KS, PIPE, MINB) \
  {#NAME, 3, 0, 0, (KILN_QWARPS / KS) * R, (QFn)NAME##_q4k, (QFn)NAME##_q6k, nullptr},
    QDV_LIST(QDV_KERN)
    {"i8_preponly", 3, 0, 0, KILN_QWARPS * KILN_QD_ROWS, (QFn)i8_preponly_q4k,
     (QFn)i8_preponly_q6k, nullptr},
};

struct Shape {
  const char* model;
  const char* what;
  int n, k;
};
static const Shape SHAPES[] = {
    {"llama-3-8b", "qkv", 6144, 4096},   {"llama-3-8b", "o", 4096, 4096},
    {"llama-3-8b", "gate_up", 28672, 4096}, {"llama-3-8b", "down", 4096, 14336},
    {"llama-3-8b", "lm_head", 128256, 4096}, {"qwen3-4b", "qkv", 6144, 2560},
    {"qwen3-4b", "o", 2560, 4096},       {"qwen3-4b", "gate_up", 19456, 2560},
    {"qwen3-4b", "down", 2560, 9728},    {"qwen3-0.6b", "qkv", 4096, 1024},
    {"qwen3-0.6b", "o", 1024, 2048},     {"qwen3-0.6b", "gate_up", 6144, 1024},
    {"qwen3-0.6b", "down", 1024, 3072},
};

static float bf(unsigned short b) {
  unsigned int u = (unsigned int)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

int main(int argc, char** argv) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const char* only_type = getenv("Q_TYPE");
  const char* only_model = getenv("Q_MODEL");
  const bool once = argc >= 7 && std::string(argv[1]) == "once";
  printf("%-11s %-8s %-5s %6s %6s %2s %-12s %9s %9s %10s\n", "model", "op", "type", "n", "k", "T",
         "kernel", "us", "GB/s", "max rel");
  for (const QType& qt : TYPES) {
    if (once && std::string(argv[3]) != qt.name) continue;
    if (!once && only_type && std::string(only_type) != qt.name) continue;
    for (const Shape& sh : SHAPES) {
      int n = sh.n, k = sh.k;
      if (once) {
        n = atoi(argv[4]);
        k = atoi(argv[5]);
      } else if (only_model && std::string(only_model) != sh.model) {
        continue;
      }
      size_t off[4], total;
      layout(qt.q, n, k, off, total);
      const size_t f16_from = off[1];
      size_t f16_to = off[1];
      if (qt.q == KQ_Q4K || qt.q == KQ_Q6K || qt.q == KQ_Q8_0) f16_to = off[2] ? off[2] : total;
      if (qt.q == KQ_Q8_0) f16_to = total;
      const size_t copies = once ? 1 : std::min<size_t>((size_t)(320u << 20) / total + 1, 20);
      std::vector<unsigned char*> ws(copies);
      for (size_t i = 0; i < copies; ++i) {
        CK(cudaMalloc(&ws[i], total));
        qfill<<<1024, 256, 0, s>>>(ws[i], total, f16_from, f16_to, qt.q == KQ_FP8, 11 + i);
      }
      float* scale;
      CK(cudaMalloc(&scale, (size_t)n * 4));
      {
        std::vector<float> hs(n, 1.0f / 64);
        CK(cudaMemcpy(scale, hs.data(), (size_t)n * 4, cudaMemcpyHostToDevice));
      }
      kbf16 *x, *ref, *got;
      CK(cudaMalloc(&x, (size_t)8 * k * 2));
      CK(cudaMalloc(&ref, (size_t)8 * n * 2));
      CK(cudaMalloc(&got, (size_t)8 * n * 2));
      xfill<<<64, 256, 0, s>>>(x, (size_t)8 * k, 5);
      for (int T : {1, 8}) {
        if (once && T != atoi(argv[6])) continue;
        launch(KERNS[0], qt.q, s, x, ws[0], scale, ref, T, n, k, off);
        std::vector<unsigned short> hr((size_t)T * n), hg((size_t)T * n);
        CK(cudaMemcpyAsync(hr.data(), ref, hr.size() * 2, cudaMemcpyDeviceToHost, s));
        CK(cudaStreamSynchronize(s));
        for (const Kern& kk : KERNS) {
          if (once && std::string(argv[2]) != kk.name) continue;
          if (!pick(kk, qt.q, T)) continue;
          if (once) {
            for (int i = 0; i < 3; ++i) launch(kk, qt.q, s, x, ws[0], scale, got, T, n, k, off);
            CK(cudaStreamSynchronize(s));
            continue;
          }
          CK(cudaMemsetAsync(got, 0xff, (size_t)T * n * 2, s));
          launch(kk, qt.q, s, x, ws[0], scale, got, T, n, k, off);
          CK(cudaMemcpyAsync(hg.data(), got, hg.size() * 2, cudaMemcpyDeviceToHost, s));
          CK(cudaStreamSynchronize(s));
          double worst = 0, mag = 0;
          for (size_t i = 0; i < hr.size(); ++i) mag = std::max(mag, (double)fabsf(bf(hr[i])));
          for (size_t i = 0; i < hr.size(); ++i)
            worst = std::max(worst, (double)fabsf(bf(hr[i]) - bf(hg[i])) / (mag + 1e-30));
          cudaGraph_t g;
          cudaGraphExec_t ge;
          CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
          for (int i = 0; i < 20; ++i) launch(kk, qt.q, s, x, ws[i % copies], scale, got, T, n, k, off);
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
            ts.push_back(ms * 1000.0f / 20);
          }
          std::sort(ts.begin(), ts.end());
          CK(cudaGraphExecDestroy(ge));
          CK(cudaGraphDestroy(g));
          const float us = ts[7];
          printf("%-11s %-8s %-5s %6d %6d %2d %-12s %9.2f %9.0f %10.2e\n", sh.model, sh.what, qt.name,
                 n, k, T, kk.name, us, total / (us * 1e-6) / 1e9, worst);
          fflush(stdout);
        }
      }
      for (unsigned char* p : ws) CK(cudaFree(p));
      CK(cudaFree(scale));
      CK(cudaFree(x));
      CK(cudaFree(ref));
      CK(cudaFree(got));
      if (once) return 0;
    }
  }
  return 0;
}
