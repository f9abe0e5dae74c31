// Elementwise and data-movement ops: embedding, silu_mul, gelu_tanh_mul,
// add, gather_last, scale.
//
// Each result element is computed in f32 from its inputs and rounded to T
// once. silu(g) = g / (1 + exp(-g)); gelu_tanh(g) = 0.5 g (1 + tanh(
// sqrt(2/pi) (g + 0.044715 g^3))).
#include "kiln_port.h"

// Row gather: out[t] = table[ids[t]]; an id outside [0, vocab) yields a zero
// row instead of an out-of-bounds read.
template <typename T>
KILN_DEV void embedding_rows(const int* __restrict__ ids, const T* __restrict__ table,
                             T* __restrict__ out, int h, int vocab) {
  KILN_PROLOGUE();
  const i64 t = blockIdx.x;
  const int id = ids[t];
  T* orow = out + t * h;
  if (id < 0 || id >= vocab) {
    for (int i = threadIdx.x; i < h; i += blockDim.x) orow[i] = st<T>(0.0f);
    return;
  }
  const T* src = table + (i64)id * h;
  for (int i = threadIdx.x; i < h; i += blockDim.x) orow[i] = src[i];
}

KILN_DEV float silu(float g) { return g / (1.0f + expf(-g)); }
KILN_DEV float gelu_tanh(float g) {
  const float k0 = 0.7978845608028654f;  // sqrt(2/pi)
  return 0.5f * g * (1.0f + tanhf(k0 * (g + 0.044715f * g * g * g)));
}

// out[t, i] = act(gate[t, i]) * up[t, i] over `tokens` rows of `inter`.
// Packed (`up` null): gate_up rows hold [gate | up], 2*inter wide. When the
// result overwrites a packed gate_up (in place), rows would race across
// blocks, so the caller launches one block and `serial_rows` walks the rows
// in order with a barrier between them.
template <typename T, int GELU>
KILN_DEV void act_mul(const T* gate, const T* up, T* out, int tokens, int inter, int serial_rows) {
  KILN_PROLOGUE();
  const int packed = up == nullptr;
  const i64 gstride = packed ? 2 * (i64)inter : inter;
  if (serial_rows) {
    for (int t = 0; t < tokens; ++t) {
      const T* g = gate + t * gstride;
      const T* u = packed ? g + inter : up + (i64)t * inter;
      // Read the whole row before any thread writes (rows shrink in place).
      for (int i0 = 0; i0 < inter; i0 += blockDim.x) {
        const int i = i0 + threadIdx.x;
        float r = 0.0f;
        if (i < inter) {
          const float gv = ld(g[i]);
          r = (GELU ? gelu_tanh(gv) : silu(gv)) * ld(u[i]);
        }
        __syncthreads();
        if (i < inter) out[(i64)t * inter + i] = st<T>(r);
        __syncthreads();
      }
    }
    return;
  }
  const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (i64)tokens * inter) return;
  const i64 t = idx / inter;
  const int i = (int)(idx % inter);
  const float gv = ld(gate[t * gstride + i]);
  const float uv = packed ? ld(gate[t * gstride + inter + i]) : ld(up[t * inter + i]);
  out[idx] = st<T>((GELU ? gelu_tanh(gv) : silu(gv)) * uv);
}

template <typename T>
KILN_DEV void add_elems(const T* a, const T* b, T* out, i64 n) {
  KILN_PROLOGUE();
  const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx < n) out[idx] = st<T>(ld(a[idx]) + ld(b[idx]));
}

// out = x * factor, then cap * tanh(out / cap) when has_cap (Gemma's
// embedding scale and final logit softcap). Plain multiply and divide, no
// contraction, as the CPU reference evaluates them.
template <typename T>
KILN_DEV void scale_elems(const T* x, T* out, i64 n, float factor, float cap, int has_cap) {
  KILN_PROLOGUE();
  const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= n) return;
  float y = __fmul_rn(ld(x[idx]), factor);
  if (has_cap) y = __fmul_rn(cap, tanhf(__fdiv_rn(y, cap)));
  out[idx] = st<T>(y);
}

// out[r] = x[r * group + group - 1]; rows of `width` elements, copied as is.
template <typename E>
KILN_DEV void gather_last_rows(const E* __restrict__ x, E* __restrict__ out, int group, int width) {
  KILN_PROLOGUE();
  const i64 r = blockIdx.x;
  const E* src = x + (r * group + group - 1) * width;
  for (int i = threadIdx.x; i < width; i += blockDim.x) out[r * width + i] = src[i];
}

#define KILN_ELEMENTWISE_ENTRIES(T, S)                                                         \
  KILN_GLOBAL void embedding_##S(const int* ids, const T* table, T* out, int h, int vocab) {  \
    embedding_rows<T>(ids, table, out, h, vocab);                                             \
  }                                                                                           \
  KILN_GLOBAL void silu_mul_##S(const T* gate, const T* up, T* out, int tokens, int inter,    \
                                int serial_rows) {                                            \
    act_mul<T, 0>(gate, up, out, tokens, inter, serial_rows);                                 \
  }                                                                                           \
  KILN_GLOBAL void gelu_tanh_mul_##S(const T* gate, const T* up, T* out, int tokens,          \
                                     int inter, int serial_rows) {                            \
    act_mul<T, 1>(gate, up, out, tokens, inter, serial_rows);                                 \
  }                                                                                           \
  KILN_GLOBAL void add_##S(const T* a, const T* b, T* out, i64 n) { add_elems<T>(a, b, out, n); } \
  KILN_GLOBAL void gather_last_##S(const T* x, T* out, int group, int width) {                 \
    gather_last_rows<T>(x, out, group, width);                                                \
  }                                                                                           \
  KILN_GLOBAL void scale_##S(const T* x, T* out, i64 n, float factor, float cap, int has_cap) { \
    scale_elems<T>(x, out, n, factor, cap, has_cap);                                          \
  }
KILN_FOR_FLOATS(KILN_ELEMENTWISE_ENTRIES)

KILN_GLOBAL void gather_last_i32(const int* x, int* out, int group, int width) {
  gather_last_rows<int>(x, out, group, width);
}
