// Quantized GEMV for decode: y[t, n] = sum_k x[t, k] * W[n, k] (+ bias[n])
// (+ residual[t, n]) for T <= 8 tokens, with W kept compressed in device
// memory (GGUF Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K, or FP8 e4m3 with a
// per-row f32 scale) and dequantized in registers; x bf16 [T, K], y bf16 or
// f32, f32 accumulation. Plus the quantized row gather (embedding lookup).
//
// At batch 1 a GEMV is a pass over the weight bytes, so the kernel streams
// them once, in 16-byte loads, with several loads in flight per lane: one
// warp owns QROWS weight rows, each lane takes every 32nd 16-byte "vector"
// of a row (QUNROLL vectors per row in flight), decodes it to f32 codes
// once and multiplies it by the T token rows of x (small, cache resident).
//
// ---- Repacked weight layout (written by kiln_kernels::quant_gpu::repack) ----
//
// The buffer holds up to four planar regions, each row-major over the N
// rows and starting 16-byte aligned; region 0 starts at byte 0, the others
// at the byte offsets off1, off2, off3 the launch passes (the Rust layout
// is the only place that computes them). V = K/32 vectors per row for the
// 4/5/6-bit types; a vector is 16 bytes of nibbles: byte i holds element
// A_i in its low nibble and B_i in its high nibble, where
//   Q4_0, Q4_1, Q5_0 (group v):   A_i = 32v + i,              B_i = A_i + 16
//   Q4_K, Q5_K, Q6_K:             A_i = 64(v/2) + 16(v%2) + i, B_i = A_i + 32
// (for Q4_K / Q5_K this is ggml's own byte order of qs). Per type:
//   Q8_0  R0 i8 [N][K]; R1 f16 d [N][K/32].         w = d*q   (16 elements a vector)
//   Q4_0  R0 nibbles [N][V][16]; R1 f16 d [N][V].    w = d*(q-8)
//   Q4_1  R0 nibbles; R1 (f16 d, f16 m) [N][V].      w = d*q + m
//   Q5_0  R0 nibbles; R1 f16 d [N][V]; R2 u32 qh [N][V] (bit i: 5th bit of
//         A_i, bit 16+i: of B_i, ggml's qh as is).    w = d*(q-16)
//   Q4_K  R0 nibbles; R1 (f16 d, f16 dmin) [N][K/256]; R2 [N][K/64] u32 of
//         bytes (sc_A, m_A, sc_B, m_B): the 6-bit scales and mins unpacked,
//         sub-blocks 2j and 2j+1 of chunk j = v/2.   w = d*sc*q - dmin*m
//   Q5_K  as Q4_K, plus R3 u32 qh [N][V] (bit i: 5th bit of A_i, bit 16+i:
//         of B_i).                                   w = d*sc*q - dmin*m
//   Q6_K  R0 nibbles (low 4 bits of the 6-bit codes); R1 f16 d [N][K/256];
//         R2 [N][V] two i8 scales (of A's and B's 16-element sub-block);
//         R3 [N][V] two u32: bits 2i..2i+1 the high 2 bits of A_i (word 0)
//         and of B_i (word 1).                       w = d*sc*(q-32)
//   FP8   R0 e4m3 [N][K] (16 elements a vector); the f32 per-row scale is a
//         separate [N] buffer (`scale`).              w = scale[n]*e4m3
// Requires K % 32 == 0 (Q8_0 and the 32-blocks), K % 256 == 0 (K-quants),
// K % 16 == 0 (FP8), 16-byte aligned x and W (the lowering checks).
//
// Entry points (one per type S, token tile TT in 1, 2, 4, 8 and output OS in
// bf16, f32): qgemv_S_tTT_bf16_OS and qgather_S_bf16, with S one of
// qgemv_q8_0_, qgemv_q4_0_, qgemv_q4_1_, qgemv_q5_0_, qgemv_q4k_, qgemv_q5k_,
// qgemv_q6k_, qgemv_fp8_ (and qgather_q8_0_, qgather_q4_0_, qgather_q4_1_,
// qgather_q5_0_, qgather_q4k_, qgather_q5k_, qgather_q6k_, qgather_fp8_).
//
// Fused entries (fused_matmul over a quantized weight): per type S and TT,
// qgemv_fused_norm_S_tTT_bf16_{bf16,f32} (the RMSNorm prologue) and
// qgemv_fused_S_tTT_bf16_bf16 (an activation epilogue without it), taking
// (x, w, scale, bias, norm_w, res, out, tokens, n, k, w_const, off1, off2,
// off3, eps, unit_offset, mode). Prologue: every block computes each token
// row's inverse RMS itself (kiln_inv_rms_rows: x is a few KiB and
// L2-resident) into shared memory after KILN_PROLOGUE(), and x is
// normalized as it is unpacked, round(x * inv * w) (1 + w under
// unit_offset): the bf16 value the unfused rms_norm stores, so the normed
// rows never go to memory; the min types' sum(x) is the sum of those
// normalized values. Epilogues (mode, uniform per launch): 0 none, 3
// residual (as the plain entries), 1 silu / 2 gelu_tanh: w stacks gate rows
// over up rows ([2I, K]), a warp's two rows are j and j + I, and out[t, j]
// = act(g) * u with g and u rounded to bf16 as the unfused matmul stores
// them. f32 results only with mode 0 (the lowering checks). The plain
// entries are the same template with the prologue and the mode compiled
// out, so they pay nothing for the fused ones.
// Their stems:
// qgemv_fused_q8_0_, qgemv_fused_q4_0_, qgemv_fused_q4_1_, qgemv_fused_q5_0_,
// qgemv_fused_q4k_, qgemv_fused_q5k_, qgemv_fused_q6k_, qgemv_fused_fp8_,
// qgemv_fused_norm_q8_0_, qgemv_fused_norm_q4_0_, qgemv_fused_norm_q4_1_,
// qgemv_fused_norm_q5_0_, qgemv_fused_norm_q4k_, qgemv_fused_norm_q5k_,
// qgemv_fused_norm_q6k_, qgemv_fused_norm_fp8_.
//
// Numerics: every weight value is formed as the reference dequantizer forms
// it only in the gather (bitwise, no contraction); the GEMV factors the
// scales out of each vector's dot product (d * sum(x q) + m * sum(x)), so it
// differs from "dequantize, then multiply" by f32 reordering only. The result
// is rounded once, after the bias; with a residual, the rounded product plus
// the residual is rounded again (the unfused sequence's rounding points).
//
// PDL: the first weight vectors (never written by another kernel) may be
// loaded before KILN_PROLOGUE() when w_const; x, bias, the norm weight,
// residual, scale, ids and out are touched only after it.
#include "kiln_port.h"

#define KILN_QWARPS 8
#define KILN_QROWS 2
// 16-byte vectors in flight per lane and row, and the blocks per SM the
// register budget is sized for. H200 (bench_quantized_gemv_on_llama3_8b_shapes,
// T = 1): 2 and 2 beat 4 and 1 by 5-15% on most types and shapes; (2, 3)
// spills at T = 8.
#ifndef KILN_QUNROLL
#define KILN_QUNROLL 2
#endif
#ifndef KILN_QMINBLOCKS
#define KILN_QMINBLOCKS 2
#endif

#define KQ_Q8_0 0
#define KQ_Q4_0 1
#define KQ_Q4_1 2
#define KQ_Q5_0 3
#define KQ_Q4K 4
#define KQ_Q5K 5
#define KQ_Q6K 6
#define KQ_FP8 7

// Elements per 16-byte vector.
template <int Q> struct QElems {
  static constexpr int n = (Q == KQ_Q8_0 || Q == KQ_FP8) ? 16 : 32;
};
// The type's weights have a min (w = d*q + m): the dot product then needs
// sum(x) per vector half.
template <int Q> struct QHasMin {
  static constexpr bool v = Q == KQ_Q4_1 || Q == KQ_Q4K || Q == KQ_Q5K;
};

// The small per-vector metadata words (scales, fifth/sixth bits).
struct QMeta {
  unsigned int m0, m1, m2, m3;
};

KILN_DEV float q_f16(unsigned int bits) {
  kf16 h;
  h.bits = (unsigned short)(bits & 0xffffu);
  return ld(h);
}

// A small integer as f32 minus `off`, without an int->float conversion:
// 0x4B000000 | c is the float 2^23 + c (c < 2^23).
KILN_DEV float q_code(unsigned int c, float off) {
  return __uint_as_float(0x4B000000u | c) - (8388608.0f + off);
}

// Byte e (0..3) of w as f32 minus `off`: one permute puts it under the
// 0x4B exponent byte (2^23 + byte), one subtraction removes 2^23 + off.
KILN_DEV float q_byte_code(unsigned int w, int e, float off) {
  return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | (unsigned int)e)) -
         (8388608.0f + off);
}

// e4m3 (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinity)
// as f32: the bits moved into an f32's place, times 2^120 to rebias, which
// also gets the subnormals right. NaN codes are refused at repack.
KILN_DEV float q_e4m3(unsigned int b) {
  const unsigned int u = ((b & 0x7fu) << 20) | ((b & 0x80u) << 24);
  return __uint_as_float(u) * 1.329227995784916e36f;  // 2^120
}

// Four e4m3 codes of a word (byte e is a[e]) as f32. On sm_89 and later
// the hardware converts two codes to two f16 in one instruction (every
// e4m3 value, subnormals included, is an f16 value, and every f16 an f32,
// so both conversions are exact and a[] is bit for bit q_e4m3's): about a
// quarter of the software form's instructions, which at one token bound
// an FP8 GEMV, not its bytes. Elsewhere (sm_80, HIP) the software form.
KILN_DEV void q_e4m3x4(unsigned int w, float* a) {
#if defined(KILN_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
  unsigned int h01, h23;
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
      : "=r"(h01), "=r"(h23)
      : "r"(w));
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\t"
      "cvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
      : "=f"(a[0]), "=f"(a[1])
      : "r"(h01));
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\t"
      "cvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
      : "=f"(a[2]), "=f"(a[3])
      : "r"(h23));
#else
#pragma unroll
  for (int e = 0; e < 4; ++e) a[e] = q_e4m3((w >> (8 * e)) & 0xffu);
#endif
}

template <int Q>
KILN_DEV QMeta q_meta(const unsigned char* __restrict__ w, i64 row, int v, int k, i64 off1,
                      i64 off2, i64 off3) {
  QMeta m = {0u, 0u, 0u, 0u};
  const i64 nv = k / 32;  // 32-element vectors / groups per row
  const i64 gv = row * nv + v;
  if (Q == KQ_Q8_0) {
    m.m0 = reinterpret_cast<const unsigned short*>(w + off1)[row * nv + v / 2];
  } else if (Q == KQ_Q4_0) {
    m.m0 = reinterpret_cast<const unsigned short*>(w + off1)[gv];
  } else if (Q == KQ_Q4_1) {
    m.m0 = reinterpret_cast<const unsigned int*>(w + off1)[gv];
  } else if (Q == KQ_Q5_0) {
    m.m0 = reinterpret_cast<const unsigned short*>(w + off1)[gv];
    m.m2 = reinterpret_cast<const unsigned int*>(w + off2)[gv];
  } else if (Q == KQ_Q4K || Q == KQ_Q5K) {
    m.m0 = reinterpret_cast<const unsigned int*>(w + off1)[row * (k / 256) + v / 8];
    m.m1 = reinterpret_cast<const unsigned int*>(w + off2)[row * (k / 64) + v / 2];
    if (Q == KQ_Q5K) m.m2 = reinterpret_cast<const unsigned int*>(w + off3)[gv];
  } else if (Q == KQ_Q6K) {
    m.m0 = reinterpret_cast<const unsigned short*>(w + off1)[row * (k / 256) + v / 8];
    m.m1 = reinterpret_cast<const unsigned short*>(w + off2)[gv];
    const uint2 h = reinterpret_cast<const uint2*>(w + off3)[gv];
    m.m2 = h.x;
    m.m3 = h.y;
  }
  return m;
}

// Decodes one vector: a[i] (and b[i] for the 32-element types) are the codes
// with the type's offset removed; the weight is da*a[i] + ma (db*b[i] + mb).
template <int Q>
KILN_DEV void q_decode(uint4 q, QMeta m, float* a, float* b, float& da, float& ma, float& db,
                       float& mb) {
  const unsigned int wd[4] = {q.x, q.y, q.z, q.w};
  if (Q == KQ_Q8_0 || Q == KQ_FP8) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if (Q == KQ_Q8_0) a[i] = q_byte_code(wd[i / 4] ^ 0x80808080u, i % 4, 128.0f);
    }
    if (Q == KQ_FP8) {
#pragma unroll
      for (int j = 0; j < 4; ++j) q_e4m3x4(wd[j], a + 4 * j);
    }
    da = Q == KQ_Q8_0 ? q_f16(m.m0) : 1.0f;
    ma = 0.0f;
    db = 0.0f;
    mb = 0.0f;
    return;
  }
  const float off = (Q == KQ_Q4_0) ? 8.0f : (Q == KQ_Q5_0) ? 16.0f : (Q == KQ_Q6K) ? 32.0f : 0.0f;
  // Four codes a word: the nibbles masked in place, the high bits spread
  // into bit 4.. of each byte, then each byte moved under the 2^23 magic
  // exponent with one byte permute (no per-element shifts).
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    unsigned int lo = wd[j] & 0x0f0f0f0fu;
    unsigned int hi = (wd[j] >> 4) & 0x0f0f0f0fu;
    if (Q == KQ_Q5_0 || Q == KQ_Q5K) {
      lo |= ((((m.m2 >> (4 * j)) & 0xfu) * 0x00204081u) & 0x01010101u) << 4;
      hi |= ((((m.m2 >> (16 + 4 * j)) & 0xfu) * 0x00204081u) & 0x01010101u) << 4;
    } else if (Q == KQ_Q6K) {
      const unsigned int va = (m.m2 >> (8 * j)) & 0xffu, vb = (m.m3 >> (8 * j)) & 0xffu;
      lo |= ((va & 0x03u) | ((va & 0x0cu) << 6) | ((va & 0x30u) << 12) | ((va & 0xc0u) << 18))
            << 4;
      hi |= ((vb & 0x03u) | ((vb & 0x0cu) << 6) | ((vb & 0x30u) << 12) | ((vb & 0xc0u) << 18))
            << 4;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      a[4 * j + e] = q_byte_code(lo, e, off);
      b[4 * j + e] = q_byte_code(hi, e, off);
    }
  }
  if (Q == KQ_Q4_0 || Q == KQ_Q5_0) {
    da = db = q_f16(m.m0);
    ma = mb = 0.0f;
  } else if (Q == KQ_Q4_1) {
    da = db = q_f16(m.m0);
    ma = mb = q_f16(m.m0 >> 16);
  } else if (Q == KQ_Q4K || Q == KQ_Q5K) {
    const float d = q_f16(m.m0), dmin = q_f16(m.m0 >> 16);
    da = __fmul_rn(d, (float)(m.m1 & 0xffu));
    ma = -__fmul_rn(dmin, (float)((m.m1 >> 8) & 0xffu));
    db = __fmul_rn(d, (float)((m.m1 >> 16) & 0xffu));
    mb = -__fmul_rn(dmin, (float)(m.m1 >> 24));
  } else if (Q == KQ_Q6K) {
    const float d = q_f16(m.m0);
    da = __fmul_rn(d, (float)(signed char)(m.m1 & 0xffu));
    db = __fmul_rn(d, (float)(signed char)((m.m1 >> 8) & 0xffu));
    ma = mb = 0.0f;
  }
}

// First x element of vector v's A and B halves.
template <int Q> KILN_DEV int q_xa(int v) {
  if (QElems<Q>::n == 16) return 16 * v;
  if (Q == KQ_Q4K || Q == KQ_Q5K || Q == KQ_Q6K) return 64 * (v / 2) + 16 * (v % 2);
  return 32 * v;
}
template <int Q> KILN_DEV int q_xb_gap() {
  return (Q == KQ_Q4K || Q == KQ_Q5K || Q == KQ_Q6K) ? 32 : 16;
}

// 16 bf16 values of x (two 16-byte loads) as f32.
KILN_DEV void q_x16(const kbf16* __restrict__ x, i64 at, float* o) {
  const uint4* p = reinterpret_cast<const uint4*>(x + at);
  unpack8(p[0], x, o);
  unpack8(p[1], x, o + 8);
}

// 16 values of token row x (`at` its first element, `col` that element's
// column) as the GEMV multiplies them: as stored, or under the prologue
// (PRE) normalized as the unfused rms_norm stores them, round(x * inv * w)
// with w the norm weight (1 + w under unit_offset).
template <int PRE>
KILN_DEV void q_xn16(const kbf16* __restrict__ x, i64 at, const kbf16* __restrict__ norm_w,
                     int col, float inv, int unit_offset, float* o) {
  q_x16(x, at, o);
  if (PRE) {
    float g[16];
    q_x16(norm_w, col, g);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float wv = unit_offset ? 1.0f + g[i] : g[i];
      o[i] = round_to<kbf16>(o[i] * inv * wv);
    }
  }
}

// Epilogue modes of the fused entries (uniform per launch), as gemv.cu's.
#define KQ_FUSED_NONE 0
#define KQ_FUSED_SILU 1
#define KQ_FUSED_GELU 2
#define KQ_FUSED_RESIDUAL 3

// PRE: the RMSNorm prologue (norm_w, eps, unit_offset); FUSED: the entry
// takes an epilogue `mode`. Plain entries are <.., 0, 0>: the same code as
// before the fused entries existed (norm_w null, mode 0).
template <int Q, typename O, int TT, int PRE, int FUSED>
KILN_DEV void qgemv_rows(const kbf16* __restrict__ x, const unsigned char* __restrict__ w,
                         const float* __restrict__ scale, const kbf16* __restrict__ bias,
                         const kbf16* __restrict__ norm_w, const kbf16* __restrict__ res,
                         O* __restrict__ out, int tokens, int n, int k, int w_const, i64 off1,
                         i64 off2, i64 off3, float eps, int unit_offset, int mode) {
  constexpr int EPV = QElems<Q>::n;
  __shared__ float inv_rms[PRE ? TT : 1];
  const int lane = threadIdx.x % KILN_WARP;
  const int warp = threadIdx.x / KILN_WARP;
  // Under an activation epilogue the warp's two rows are gate row j and up
  // row j + n/2 (one output j), else two consecutive rows.
  const bool act = FUSED && (mode == KQ_FUSED_SILU || mode == KQ_FUSED_GELU);
  const int outs = act ? n / 2 : n;
  const i64 row0 = act ? (i64)blockIdx.x * KILN_QWARPS + warp
                       : ((i64)blockIdx.x * KILN_QWARPS + warp) * KILN_QROWS;
  const bool live = row0 < outs;
  const int nv = k / EPV;  // 16-byte vectors per row
  i64 rows[KILN_QROWS];
  const uint4* wv[KILN_QROWS];
#pragma unroll
  for (int r = 0; r < KILN_QROWS; ++r) {
    const i64 want = act ? row0 + r * (i64)outs : row0 + r;
    // A warp past the last row re-reads a live row (its results are
    // dropped), so every warp reaches the dependency wait (and the
    // prologue's barrier).
    rows[r] = live && want < n ? want : (live ? row0 : 0);
    wv[r] = reinterpret_cast<const uint4*>(w) + rows[r] * nv;
  }
  float acc[KILN_QROWS][TT];
#pragma unroll
  for (int r = 0; r < KILN_QROWS; ++r)
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[r][t] = 0.0f;

  uint4 qr[KILN_QROWS][KILN_QUNROLL];
  QMeta mr[KILN_QROWS][KILN_QUNROLL];
  int c = lane;
  // Weight vectors only (never written by another kernel) before the wait.
  if (w_const) {
#pragma unroll
    for (int r = 0; r < KILN_QROWS; ++r)
#pragma unroll
      for (int u = 0; u < KILN_QUNROLL; ++u) {
        const int cc = c + u * KILN_WARP;
        if (cc < nv) qr[r][u] = wv[r][cc];
      }
  }
  KILN_PROLOGUE();
  if (PRE) {
    // Every block computes each token row's inverse RMS itself (x is a few
    // KiB, L2-resident): the normed rows never go to memory.
    kiln_inv_rms_rows(x, tokens, k, eps, inv_rms);
    __syncthreads();
  }
  if (!live) return;
  bool first = true;
  for (; c < nv; c += KILN_QUNROLL * KILN_WARP) {
    if (!first || !w_const) {
#pragma unroll
      for (int r = 0; r < KILN_QROWS; ++r)
#pragma unroll
        for (int u = 0; u < KILN_QUNROLL; ++u) {
          const int cc = c + u * KILN_WARP;
          if (cc < nv) qr[r][u] = wv[r][cc];
        }
    }
    first = false;
#pragma unroll
    for (int r = 0; r < KILN_QROWS; ++r)
#pragma unroll
      for (int u = 0; u < KILN_QUNROLL; ++u) {
        const int cc = c + u * KILN_WARP;
        if (cc < nv) mr[r][u] = q_meta<Q>(w, rows[r], cc, k, off1, off2, off3);
      }
#pragma unroll
    for (int u = 0; u < KILN_QUNROLL; ++u) {
      const int cc = c + u * KILN_WARP;
      if (cc >= nv) break;
      const int xa = q_xa<Q>(cc);
      if (TT == 1) {
        // One token: x's 32 values are unpacked (and normalized) once and
        // shared by the rows, each row decoded in turn. sum(x) is over the
        // values multiplied: the normalized ones under the prologue.
        float xfa[16], xfb[16], sxa = 0.0f, sxb = 0.0f;
        const float inv = PRE ? inv_rms[0] : 1.0f;
        q_xn16<PRE>(x, xa, norm_w, xa, inv, unit_offset, xfa);
        if (EPV == 32)
          q_xn16<PRE>(x, xa + q_xb_gap<Q>(), norm_w, xa + q_xb_gap<Q>(), inv, unit_offset, xfb);
        if (QHasMin<Q>::v) {
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            sxa += xfa[i];
            sxb += xfb[i];
          }
        }
#pragma unroll
        for (int r = 0; r < KILN_QROWS; ++r) {
          float a[16], b[16], da, ma, db, mb;
          q_decode<Q>(qr[r][u], mr[r][u], a, b, da, ma, db, mb);
          float s = 0.0f, s2 = 0.0f;
#pragma unroll
          for (int i = 0; i < 16; ++i) s += xfa[i] * a[i];
          float yv = da * s + ma * sxa;
          if (EPV == 32) {
#pragma unroll
            for (int i = 0; i < 16; ++i) s2 += xfb[i] * b[i];
            yv += db * s2 + mb * sxb;
          }
          acc[r][0] += yv;
        }
      } else {
        // One row's decoded vector is live at a time (x is re-read per row
        // from L1): fewer registers, more warps per SM.
#pragma unroll
        for (int r = 0; r < KILN_QROWS; ++r) {
          float a[16], b[16], da, ma, db, mb;
          q_decode<Q>(qr[r][u], mr[r][u], a, b, da, ma, db, mb);
#pragma unroll
          for (int t = 0; t < TT; ++t) {
            if (t < tokens) {
              const float inv = PRE ? inv_rms[t] : 1.0f;
              float xf[16];
              q_xn16<PRE>(x, (i64)t * k + xa, norm_w, xa, inv, unit_offset, xf);
              float s = 0.0f, sx = 0.0f;
#pragma unroll
              for (int i = 0; i < 16; ++i) s += xf[i] * a[i];
              if (QHasMin<Q>::v) {
#pragma unroll
                for (int i = 0; i < 16; ++i) sx += xf[i];
              }
              float yv = da * s + ma * sx;
              if (EPV == 32) {
                q_xn16<PRE>(x, (i64)t * k + xa + q_xb_gap<Q>(), norm_w, xa + q_xb_gap<Q>(), inv,
                            unit_offset, xf);
                float s2 = 0.0f, sy = 0.0f;
#pragma unroll
                for (int i = 0; i < 16; ++i) s2 += xf[i] * b[i];
                if (QHasMin<Q>::v) {
#pragma unroll
                  for (int i = 0; i < 16; ++i) sy += xf[i];
                }
                yv += db * s2 + mb * sy;
              }
              acc[r][t] += yv;
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < KILN_QROWS; ++r)
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[r][t] = warp_sum(acc[r][t]);
  if (lane != 0) return;
  if (act) {
    // g and u rounded as the unfused matmul stores them, then act(g) * u
    // rounded once (the unfused silu_mul / gelu_tanh_mul).
    const float sg = Q == KQ_FP8 ? scale[rows[0]] : 1.0f;
    const float su = Q == KQ_FP8 ? scale[rows[1]] : 1.0f;
    const float bg = bias ? ld(bias[rows[0]]) : 0.0f;
    const float bu = bias ? ld(bias[rows[1]]) : 0.0f;
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      if (t < tokens) {
        const float g = round_to<kbf16>(acc[0][t] * sg + bg);
        const float u = round_to<kbf16>(acc[1][t] * su + bu);
        const float a = mode == KQ_FUSED_SILU ? kiln_silu(g) : kiln_gelu_tanh(g);
        out[(i64)t * outs + row0] = st<O>(a * u);
      }
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < KILN_QROWS; ++r) {
    const i64 row = row0 + r;
    if (row >= n) continue;
    const float sc = Q == KQ_FP8 ? scale[row] : 1.0f;
    const float bv = bias ? ld(bias[row]) : 0.0f;
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      if (t < tokens) {
        float y = acc[r][t] * sc + bv;
        if (res) y = round_to<kbf16>(y) + ld(res[(i64)t * n + row]);
        out[(i64)t * n + row] = st<O>(y);
      }
    }
  }
}

// ---- One token through 8-bit integer dot products (Q4_K, Q6_K, Q8_0) ----
//
// qgemv_rows turns every weight code into an f32 (two instructions) and
// multiplies it (one more): at one token that instruction stream, not the
// bytes, bounds a Q4_K GEMV (H200: 1.8-2.0 TB/s at Llama-3-8B shapes,
// DRAM 26% busy). qdot_rows instead quantizes the token row once per block
// into shared memory as the CPU backend's quantized matmul does (int8
// codes, one f32 scale dx per 32 elements) and multiplies four weight codes
// by four x codes in one dp4a, in exact integer arithmetic; the scales are
// applied per 16-element half vector, y += dx * (d*sc * dot(q, xq) -
// dmin*m * sum(xq)). The product is exact for the quantized x (up to f32
// reordering), and each x element is off by at most dx/2, so |y - y_exact|
// <= sum over the 32-groups g of (max_g|x| / 254) * sum_{i in g} |w_i|
// plus the f32 reordering (the bound the tests check). Q6_K's codes carry
// an offset of 32: dot(q - 32, xq) = dot(q, xq) - 32 * sum(xq). Under the
// RMSNorm prologue the normalized values (round(x * inv * w), as
// qgemv_rows forms them) are what gets quantized.
// Entries: qgemv_i8_S_t1_bf16_{bf16,f32}, qgemv_i8_fused_S_t1_bf16_bf16,
// qgemv_i8_fused_norm_S_t1_bf16_{bf16,f32} for S in q4k, q6k, q8_0
// (qgemv_i8_q4k_, qgemv_i8_q6k_, qgemv_i8_q8_0_, qgemv_i8_fused_q4k_,
// qgemv_i8_fused_q6k_, qgemv_i8_fused_q8_0_, qgemv_i8_fused_norm_q4k_,
// qgemv_i8_fused_norm_q6k_, qgemv_i8_fused_norm_q8_0_), with qgemv's
// parameters, and the rope entries of matmul_qkv_rope
// (qgemv_i8_rope_S_t1_bf16_bf16, qgemv_i8_rope_norm_S_t1_bf16_bf16: see
// kiln_rope_tail in kiln_port.h; stems qgemv_i8_rope_q4k_, qgemv_i8_rope_q6k_,
// qgemv_i8_rope_q8_0_, qgemv_i8_rope_norm_q4k_, qgemv_i8_rope_norm_q6k_,
// qgemv_i8_rope_norm_q8_0_); a warp owns KILN_QD_ROWS rows (KILN_QD_ROWS / 2 gate and as
// many up rows under an activation), K <= KILN_QD_MAXK.
#define KILN_QD_MAXK 16384
#ifndef KILN_QD_ROWS
#define KILN_QD_ROWS 4
#endif
#ifndef KILN_QD_UNROLL
#define KILN_QD_UNROLL 2
#endif

// Four signed 8-bit products summed onto c.
KILN_DEV int kiln_dp4a(unsigned int a, unsigned int b, int c) {
#if defined(KILN_CUDA)
  return __dp4a((int)a, (int)b, c);
#else
#pragma unroll
  for (int e = 0; e < 4; ++e)
    c += (int)(signed char)((a >> (8 * e)) & 0xffu) * (int)(signed char)((b >> (8 * e)) & 0xffu);
  return c;
#endif
}

// The block's token row, quantized as the CPU backend quantizes it
// (kiln_kernels::cpu::qmatmul): per 32-group d = max|x| / 127, code =
// rint(x * (1 / d)) (0 for a zero group), into xq int8 [k], xd f32 [k/32]
// (the d) and xi int [k/16] (the sums of the codes of each 16). Thread i
// takes 8 consecutive elements, four threads a 32-group; every thread runs
// every round (the shuffles need the whole warp). qd_quant8 is one round's
// work for one thread's 8 values f of elements [i, i + 8).
KILN_DEV void qd_quant8(const float* f, int i, bool valid, signed char* xq, float* xd, int* xi) {
  float am = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) am = fmaxf(am, fabsf(f[e]));
  am = fmaxf(am, shfl_xor(am, 1));
  am = fmaxf(am, shfl_xor(am, 2));
  const float d = __fdiv_rn(am, 127.0f);
  const float id = d > 0.0f ? __frcp_rn(d) : 0.0f;
  unsigned int p0 = 0u, p1 = 0u;
  int qs = 0;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const int q = max(-127, min(127, __float2int_rn(__fmul_rn(f[e], id))));
    qs += q;
    if (e < 4) {
      p0 |= ((unsigned int)q & 0xffu) << (8 * e);
    } else {
      p1 |= ((unsigned int)q & 0xffu) << (8 * (e - 4));
    }
  }
  qs += shfl_xor_int(qs, 1);
  if (valid) {
    *reinterpret_cast<uint2*>(xq + i) = make_uint2(p0, p1);
    if ((threadIdx.x & 3) == 0) xd[i / 32] = d;
    if ((threadIdx.x & 1) == 0) xi[i / 16] = qs;
  }
}

// Up to QD_QB rounds' loads are issued before any is used (one L2 round
// trip per QD_QB rounds, not per round: 7 rounds at K = 14336).
#define QD_QB 4

template <int PRE>
KILN_DEV void qd_prep_x(const kbf16* __restrict__ x, const kbf16* __restrict__ norm_w, int k,
                        float inv, int unit_offset, signed char* xq, float* xd, int* xi) {
  const int step = blockDim.x * 8;
  for (int base0 = 0; base0 < k; base0 += QD_QB * step) {
    uint4 xr[QD_QB], nr[QD_QB];
#pragma unroll
    for (int b = 0; b < QD_QB; ++b) {
      const int i = base0 + b * step + threadIdx.x * 8;
      if (i < k) {
        xr[b] = *reinterpret_cast<const uint4*>(x + i);
        if (PRE) nr[b] = *reinterpret_cast<const uint4*>(norm_w + i);
      }
    }
#pragma unroll
    for (int b = 0; b < QD_QB; ++b) {
      if (base0 + b * step >= k) break;  // uniform over the block
      const int i = base0 + b * step + threadIdx.x * 8;
      const bool valid = i < k;
      float f[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = 0.0f;
      if (valid) {
        unpack8(xr[b], x, f);
        if (PRE) {
          float g[8];
          unpack8(nr[b], norm_w, g);
#pragma unroll
          for (int e = 0; e < 8; ++e)
            f[e] = round_to<kbf16>(f[e] * inv * (unit_offset ? 1.0f + g[e] : g[e]));
        }
      }
      qd_quant8(f, i, valid, xq, xd, xi);
    }
  }
}

// The RMSNorm prologue and the quantization in one pass over x, for rows
// of at most QD_QB * 8 * blockDim.x elements (every model's hidden size
// kiln traces; qd_one_pass): the row stays in registers between the sum
// of squares and the codes, so x is read from L2 once and the block meets
// at one barrier, not two reads and two barriers (kiln_inv_rms_row_block,
// then qd_prep_x). The sum of squares runs in kiln_inv_rms_row_block's
// order (thread i: vectors i, i + blockDim.x, ..., each element in turn;
// then the warps' sums in warp order), so inv is the same f32 and the
// codes are bit for bit the two-pass ones.
KILN_DEV bool qd_one_pass(int k) { return k <= QD_QB * 8 * (int)blockDim.x; }
KILN_DEV void qd_prep_x_normed(const kbf16* __restrict__ x, const kbf16* __restrict__ norm_w,
                               int k, float eps, int unit_offset, signed char* xq, float* xd,
                               int* xi) {
  __shared__ float part[32];
  const int step = blockDim.x * 8;
  uint4 xr[QD_QB], nr[QD_QB];
#pragma unroll
  for (int b = 0; b < QD_QB; ++b) {
    const int i = b * step + threadIdx.x * 8;
    if (i < k) {
      xr[b] = *reinterpret_cast<const uint4*>(x + i);
      nr[b] = *reinterpret_cast<const uint4*>(norm_w + i);
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int b = 0; b < QD_QB; ++b) {
    if (b * step + threadIdx.x * 8 < k) {
      float f[8];
      unpack8(xr[b], x, f);
#pragma unroll
      for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
    }
  }
  ss = warp_sum(ss);
  if (threadIdx.x % KILN_WARP == 0) part[threadIdx.x / KILN_WARP] = ss;
  __syncthreads();
  float t = 0.0f;
  for (int w = 0; w < (int)(blockDim.x / KILN_WARP); ++w) t += part[w];
  const float inv = 1.0f / sqrtf(t / (float)k + eps);
#pragma unroll
  for (int b = 0; b < QD_QB; ++b) {
    if (b * step >= k) break;  // uniform over the block
    const int i = b * step + threadIdx.x * 8;
    const bool valid = i < k;
    float f[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = 0.0f;
    if (valid) {
      float g[8];
      unpack8(xr[b], x, f);
      unpack8(nr[b], norm_w, g);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        f[e] = round_to<kbf16>(f[e] * inv * (unit_offset ? 1.0f + g[e] : g[e]));
    }
    qd_quant8(f, i, valid, xq, xd, xi);
  }
}

// The geometry is a template (R rows per warp, U vectors per row in flight
// per lane, KS warps splitting each row's vectors, PIPE: the next vectors'
// loads issued before the current ones are multiplied) so the lowering can
// pick one per shape; the plain entries are R = KILN_QD_ROWS, U =
// KILN_QD_UNROLL, KS = 1, PIPE = 0. With KS > 1 warp s of a row group takes
// the vectors of the "virtual lane" 32 s + lane of a KS*32-lane warp, and
// the KS partial sums meet in shared memory, added in slice order
// (deterministic; a different f32 order from KS = 1, inside the same bound).
// With PIPE the first round's metadata is loaded with its codes before the
// dependency wait; without it each round's metadata is loaded after that
// round's codes into an array of its own, as the kernel was first written.
// Every geometry is bounded to two blocks per SM (128 registers): the
// RMSNorm prologue took the plain entry to 152 registers unbounded, one
// block per SM.
// Map (kiln_port.h): KilnRows, or the rope entries' KilnRopePairs (rows in
// rotate-half pairs, roped and stored by the lane holding the results).
template <int Q, typename O, int PRE, int FUSED, int R = KILN_QD_ROWS, int U = KILN_QD_UNROLL,
          int KS = 1, int PIPE = 0, typename Map = KilnRows>
KILN_DEV void qdot_rows(const kbf16* __restrict__ x, const unsigned char* __restrict__ w,
                        const kbf16* __restrict__ bias, const kbf16* __restrict__ norm_w,
                        const kbf16* __restrict__ res, O* __restrict__ out, int n, int k,
                        int w_const, i64 off1, i64 off2, i64 off3, float eps, int unit_offset,
                        int mode, Map map = Map{}) {
  static_assert(!Map::may_pair || R % 2 == 0, "a warp's rows are whole pairs");
  constexpr int EPV = QElems<Q>::n;
  constexpr int WPB = KILN_QWARPS / KS;  // row groups per block
  constexpr int STRIDE = U * KILN_WARP * KS;
  __shared__ __align__(16) signed char xq[KILN_QD_MAXK];
  __shared__ float xd[KILN_QD_MAXK / 32];
  __shared__ int xi[KILN_QD_MAXK / 16];
  __shared__ float inv_rms[1];
  __shared__ float red[KS > 1 ? KILN_QWARPS * R : 1];
  const int lane = threadIdx.x % KILN_WARP;
  const int warp = threadIdx.x / KILN_WARP;
  const int slice = KS > 1 ? warp % KS : 0;
  const int grp = KS > 1 ? warp / KS : warp;
  const int vl = slice * KILN_WARP + lane;  // this lane's first vector of a row
  const bool act = FUSED && (mode == KQ_FUSED_SILU || mode == KQ_FUSED_GELU);
  // Outputs a row group owns: R rows, or R/2 gate rows and their R/2 up rows.
  const int P = act ? R / 2 : R;
  const int outs = act ? n / 2 : n;
  const i64 out0 = ((i64)blockIdx.x * WPB + grp) * P;
  const bool live = out0 < outs;
  const int nv = k / EPV;
  i64 rows[R];
  const uint4* wv[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const i64 o = r < P ? out0 + r : out0 + (r - P);
    const i64 base = r < P ? 0 : outs;
    // Rows past the end re-read the group's first row (results dropped).
    rows[r] = live ? map.row(base + (o < outs ? o : out0)) : 0;
    wv[r] = reinterpret_cast<const uint4*>(w) + rows[r] * nv;
  }
  uint4 qr[R][U];
  QMeta mr[R][U];
  const bool pre = w_const && live;
  if (pre) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int cc = vl + u * KILN_WARP * KS;
        if (cc < nv) {
          qr[r][u] = wv[r][cc];
          if (PIPE) mr[r][u] = q_meta<Q>(w, rows[r], cc, k, off1, off2, off3);
        }
      }
  }
  KILN_PROLOGUE();
  map.after_wait();
  if (PRE && qd_one_pass(k)) {
    qd_prep_x_normed(x, norm_w, k, eps, unit_offset, xq, xd, xi);
  } else {
    if (PRE) {
      kiln_inv_rms_row_block(x, k, eps, inv_rms);
      __syncthreads();
    }
    qd_prep_x<PRE>(x, norm_w, k, PRE ? inv_rms[0] : 1.0f, unit_offset, xq, xd, xi);
  }
  __syncthreads();
  if (KS == 1 && !live) return;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  if (live) {
    if (PIPE && !pre) {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int cc = vl + u * KILN_WARP * KS;
          if (cc < nv) {
            qr[r][u] = wv[r][cc];
            mr[r][u] = q_meta<Q>(w, rows[r], cc, k, off1, off2, off3);
          }
        }
    }
    bool first = true;
    for (int c = vl; c < nv; c += STRIDE) {
      // Without PIPE this round's codes are loaded here (the first round's
      // before the dependency wait when pre). With PIPE, qr / mr hold this
      // round (loaded during the last) and the next is loaded before this
      // one is used.
      if (!PIPE) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int cc = c + u * KILN_WARP * KS;
            if (cc < nv && (!first || !pre)) qr[r][u] = wv[r][cc];
          }
        first = false;
      }
      // Without PIPE, this round's metadata (a fresh array: nothing of it
      // lives across rounds).
      QMeta ml[R][U];
      if (!PIPE) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int cc = c + u * KILN_WARP * KS;
            if (cc < nv) ml[r][u] = q_meta<Q>(w, rows[r], cc, k, off1, off2, off3);
          }
      }
      uint4 qn[R][U];
      QMeta mn[R][U];
      if (PIPE) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int cc = c + STRIDE + u * KILN_WARP * KS;
            if (cc < nv) {
              qn[r][u] = wv[r][cc];
              mn[r][u] = q_meta<Q>(w, rows[r], cc, k, off1, off2, off3);
            }
          }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int cc = c + u * KILN_WARP * KS;
        if (cc >= nv) break;
        const int xa = q_xa<Q>(cc);
        const int xb = xa + q_xb_gap<Q>();
        const uint4 va = *reinterpret_cast<const uint4*>(xq + xa);
        const float dxa = xd[xa / 32];
        uint4 vb = make_uint4(0u, 0u, 0u, 0u);
        float dxb = 0.0f;
        // Sums of the x codes of the two 16-element halves: the min's
        // (Q4_K) and the code offset's (Q6_K) share of the dot product.
        int sa16 = 0, sb16 = 0;
        if (EPV == 32) {
          vb = *reinterpret_cast<const uint4*>(xq + xb);
          dxb = xd[xb / 32];
          sa16 = xi[xa / 16];
          sb16 = xi[xb / 16];
        }
        const int ia0 = Q == KQ_Q6K ? -32 * sa16 : 0, ib0 = Q == KQ_Q6K ? -32 * sb16 : 0;
        const unsigned int xav[4] = {va.x, va.y, va.z, va.w};
        const unsigned int xbv[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint4 q = qr[r][u];
          const QMeta m = PIPE ? mr[r][u] : ml[r][u];
          const unsigned int wd[4] = {q.x, q.y, q.z, q.w};
          int ia = ia0, ib = ib0;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if (Q == KQ_Q8_0) {
              ia = kiln_dp4a(wd[j], xav[j], ia);
            } else {
              unsigned int lo = wd[j] & 0x0f0f0f0fu;
              unsigned int hi = (wd[j] >> 4) & 0x0f0f0f0fu;
              if (Q == KQ_Q6K) {
                const unsigned int a6 = (m.m2 >> (8 * j)) & 0xffu, b6 = (m.m3 >> (8 * j)) & 0xffu;
                lo |= ((a6 & 0x03u) | ((a6 & 0x0cu) << 6) | ((a6 & 0x30u) << 12) |
                       ((a6 & 0xc0u) << 18))
                      << 4;
                hi |= ((b6 & 0x03u) | ((b6 & 0x0cu) << 6) | ((b6 & 0x30u) << 12) |
                       ((b6 & 0xc0u) << 18))
                      << 4;
              }
              ia = kiln_dp4a(lo, xav[j], ia);
              ib = kiln_dp4a(hi, xbv[j], ib);
            }
          }
          if (Q == KQ_Q8_0) {
            acc[r] += q_f16(m.m0) * (dxa * (float)ia);
          } else if (Q == KQ_Q4K) {
            const float d = q_f16(m.m0), dmin = q_f16(m.m0 >> 16);
            const float sa = q_byte_code(m.m1, 0, 0.0f), ma = q_byte_code(m.m1, 1, 0.0f);
            const float sb = q_byte_code(m.m1, 2, 0.0f), mb = q_byte_code(m.m1, 3, 0.0f);
            acc[r] += dxa * (d * sa * (float)ia - dmin * ma * (float)sa16) +
                      dxb * (d * sb * (float)ib - dmin * mb * (float)sb16);
          } else {  // Q6_K
            const float d = q_f16(m.m0);
            const float sa = (float)(signed char)(m.m1 & 0xffu);
            const float sb = (float)(signed char)((m.m1 >> 8) & 0xffu);
            acc[r] += d * (sa * (dxa * (float)ia) + sb * (dxb * (float)ib));
          }
        }
      }
      if (PIPE) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (c + STRIDE + u * KILN_WARP * KS < nv) {
              qr[r][u] = qn[r][u];
              mr[r][u] = mn[r][u];
            }
          }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
  }
  if (KS > 1) {
    // The slices' sums meet in shared memory; slice 0 adds them in order.
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) red[warp * R + r] = acc[r];
    }
    __syncthreads();
    if (slice != 0) return;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float s = red[warp * R + r];
#pragma unroll
      for (int z = 1; z < KS; ++z) s += red[(warp + z) * R + r];
      acc[r] = s;
    }
  }
  // The pair epilogue spreads a warp's pairs over its first lanes (every
  // lane holds every sum: warp_sum is a butterfly, the split's merge runs
  // in every lane of slice 0).
  if (!live || lane >= ((Map::may_pair && map.on()) ? R / 2 : 1)) return;
  if (act) {
#pragma unroll
    for (int o = 0; o < R / 2; ++o) {
      const i64 j = out0 + o;
      if (j >= outs) continue;
      const float bg = bias ? ld(bias[j]) : 0.0f;
      const float bu = bias ? ld(bias[j + outs]) : 0.0f;
      const float g = round_to<kbf16>(acc[o] + bg);
      const float u = round_to<kbf16>(acc[o + R / 2] + bu);
      const float a = mode == KQ_FUSED_SILU ? kiln_silu(g) : kiln_gelu_tanh(g);
      out[j] = st<O>(a * u);
    }
    return;
  }
  if (Map::may_pair && map.on()) {
#pragma unroll
    for (int r = 0; r < R; r += 2) {
      const i64 row = out0 + r;
      if (r != 2 * lane || row >= n) continue;
      float y[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const i64 pr = rows[r + h];
        y[h] = acc[r + h] + (bias ? ld(bias[pr]) : 0.0f);
        if (res) y[h] = round_to<kbf16>(y[h]) + ld(res[pr]);
        y[h] = round_to<O>(y[h]);
      }
      map.store(row, y[0], y[1]);
    }
    return;
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const i64 row = out0 + r;
    if (row >= n) continue;
    float y = acc[r] + (bias ? ld(bias[row]) : 0.0f);
    if (res) y = round_to<kbf16>(y) + ld(res[row]);
    out[row] = st<O>(y);
  }
}

// Entries of one geometry G (a tag: empty for the plain geometry, else
// _r<R>u<U>k<KS>[p], kiln_kernels::quant_gpu::QdotGeom::tag): MINB is the
// blocks per SM the register budget is bounded for (0: no bound).
#define KILN_QDOT_LB(MINB) __launch_bounds__(KILN_QWARPS * KILN_WARP, (MINB) > 0 ? (MINB) : 1)
#define KILN_QDOT_G(S, Q, G, R, U, KS, PIPE, MINB)                                             \
  KILN_GLOBAL void KILN_QDOT_LB(MINB)                                                          \
      qgemv_i8##G##_##S##_t1_bf16_bf16(const kbf16* x, const unsigned char* w,                 \
                                       const float* scale, const kbf16* bias, const kbf16* res, \
                                       kbf16* out, int tokens, int n, int k, int w_const,      \
                                       i64 off1, i64 off2, i64 off3) {                         \
    qdot_rows<Q, kbf16, 0, 0, R, U, KS, PIPE>(x, w, bias, nullptr, res, out, n, k, w_const,    \
                                              off1, off2, off3, 0.0f, 0, KQ_FUSED_NONE);       \
  }                                                                                            \
  KILN_GLOBAL void KILN_QDOT_LB(MINB)                                                          \
      qgemv_i8##G##_##S##_t1_bf16_f32(const kbf16* x, const unsigned char* w,                  \
                                      const float* scale, const kbf16* bias, const kbf16* res,  \
                                      float* out, int tokens, int n, int k, int w_const,       \
                                      i64 off1, i64 off2, i64 off3) {                          \
    qdot_rows<Q, float, 0, 0, R, U, KS, PIPE>(x, w, bias, nullptr, res, out, n, k, w_const,    \
                                              off1, off2, off3, 0.0f, 0, KQ_FUSED_NONE);       \
  }                                                                                            \
  KILN_QDOT_FUSED(S, Q, kbf16, 0, qgemv_i8##G##_fused_##S##_t1_bf16_bf16, R, U, KS, PIPE, MINB) \
  KILN_QDOT_FUSED(S, Q, kbf16, 1, qgemv_i8##G##_fused_norm_##S##_t1_bf16_bf16, R, U, KS, PIPE, \
                  MINB)                                                                        \
  KILN_QDOT_FUSED(S, Q, float, 1, qgemv_i8##G##_fused_norm_##S##_t1_bf16_f32, R, U, KS, PIPE,  \
                  MINB)
#define KILN_QDOT_FUSED(S, Q, O, PRE, NAME, R, U, KS, PIPE, MINB)                              \
  KILN_GLOBAL void KILN_QDOT_LB(MINB)                                                          \
      NAME(const kbf16* x, const unsigned char* w, const float* scale, const kbf16* bias,      \
           const kbf16* norm_w, const kbf16* res, O* out, int tokens, int n, int k, int w_const, \
           i64 off1, i64 off2, i64 off3, float eps, int unit_offset, int mode) {               \
    qdot_rows<Q, O, PRE, 1, R, U, KS, PIPE>(x, w, bias, norm_w, res, out, n, k, w_const, off1,  \
                                            off2, off3, eps, unit_offset, mode);               \
  }
// The rope entries below end in kiln_port.h's kiln_rope_tail (the GEMV's
// last block over each head runs qkv_rope_kv_write's arithmetic on it)
// when the heads have a q/k norm; without one their warps own the rows in
// rotate-half pairs and rope them as they store them (KilnRopePairs).
// The rope entries (matmul_qkv_rope): qgemv_i8<G>_rope_S_t1_bf16_bf16 (no
// prologue) and qgemv_i8<G>_rope_norm_S_t1_bf16_bf16 (the RMSNorm
// prologue): the fused entries' parameters (mode 0; out is the packed qkv
// row in scratch), then qkv_rope_kv_write's (pos, slots, kc, vc, q_norm,
// k_norm, q_out), the units' completion counters, heads, kvh, hd, the q/k
// norm's eps, has_norm and unit_offset, the caches' slot count and the
// frequencies.
#define KILN_QDOT_ROPE(S, Q, PRE, NAME, R, U, KS, PIPE, MINB)                                  \
  KILN_GLOBAL void KILN_QDOT_LB(MINB)                                                          \
      NAME(const kbf16* x, const unsigned char* w, const float* scale, const kbf16* bias,      \
           const kbf16* norm_w, const kbf16* res, kbf16* out, int tokens, int n, int k,        \
           int w_const, i64 off1, i64 off2, i64 off3, float eps, int unit_offset, int mode,    \
           const int* pos, const int* slots, kbf16* kc, kbf16* vc, const kbf16* qn,            \
           const kbf16* kn, kbf16* q_out, unsigned int* counters, int heads, int kvh, int hd,  \
           float qk_eps, int has_norm, int qk_unit_offset, i64 num_slots, RopeFreqs fr) {      \
    const KilnRopePairs<kbf16> map{!has_norm, kc,    vc,   q_out, fr, pos,                     \
                                   slots,     num_slots, heads, kvh, hd};                       \
    qdot_rows<Q, kbf16, PRE, 1, R, U, KS, PIPE>(x, w, bias, norm_w, res, out, n, k, w_const,   \
                                                off1, off2, off3, eps, unit_offset, mode, map); \
    if (!has_norm) return;                                                                     \
    kiln_rope_tail<kbf16>(out, n, (KILN_QWARPS / KS) * R, pos, slots, kc, vc, qn, kn, q_out,     \
                          counters, heads, kvh, hd, qk_eps, has_norm, qk_unit_offset, num_slots, \
                          fr);                                                                 \
  }
#define KILN_QDOT_ROPE_G(S, Q, G, R, U, KS, PIPE, MINB)                                        \
  KILN_QDOT_ROPE(S, Q, 0, qgemv_i8##G##_rope_##S##_t1_bf16_bf16, R, U, KS, PIPE, MINB)         \
  KILN_QDOT_ROPE(S, Q, 1, qgemv_i8##G##_rope_norm_##S##_t1_bf16_bf16, R, U, KS, PIPE, MINB)

// The geometries the lowering may pick (kiln_kernels::quant_gpu::QDOT_GEOMS,
// the same list in the same order).
#define KILN_QDOT_GEOMS(M, S, Q)                                           \
  M(S, Q, , KILN_QD_ROWS, KILN_QD_UNROLL, 1, 0, 2)                         \
  M(S, Q, _r4u2k2, 4, 2, 2, 0, 2)                                          \
  M(S, Q, _r2u2k1p, 2, 2, 1, 1, 2)                                         \
  M(S, Q, _r2u2k2p, 2, 2, 2, 1, 2)                                         \
  M(S, Q, _r4u1k1p, 4, 1, 1, 1, 2)
#define KILN_QDOT(S, Q) KILN_QDOT_GEOMS(KILN_QDOT_G, S, Q) KILN_QDOT_GEOMS(KILN_QDOT_ROPE_G, S, Q)
KILN_QDOT(q4k, KQ_Q4K)
KILN_QDOT(q6k, KQ_Q6K)
KILN_QDOT(q8_0, KQ_Q8_0)

// One thread per 16-byte vector of token t's row ids[t]; an id outside
// [0, n) gives a zero row (as the bf16 embedding kernel does). Each weight is
// formed exactly as the reference dequantizer forms it (no contraction),
// then rounded to bf16 once.
template <int Q>
KILN_DEV void qgather_row(const int* __restrict__ ids, const unsigned char* __restrict__ w,
                          const float* __restrict__ scale, kbf16* __restrict__ out, int n, int k,
                          i64 off1, i64 off2, i64 off3) {
  constexpr int EPV = QElems<Q>::n;
  KILN_PROLOGUE();
  const int t = blockIdx.y;
  const int nv = k / EPV;
  const int v = blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= nv) return;
  const int id = ids[t];
  const int xa = q_xa<Q>(v);
  kbf16* o = out + (i64)t * k;
  if (id < 0 || id >= n) {
#pragma unroll
    for (int i = 0; i < 16; ++i) o[xa + i] = st<kbf16>(0.0f);
    if (EPV == 32) {
#pragma unroll
      for (int i = 0; i < 16; ++i) o[xa + q_xb_gap<Q>() + i] = st<kbf16>(0.0f);
    }
    return;
  }
  const uint4 q = (reinterpret_cast<const uint4*>(w) + (i64)id * nv)[v];
  const QMeta m = q_meta<Q>(w, id, v, k, off1, off2, off3);
  float a[16], b[16], da, ma, db, mb;
  q_decode<Q>(q, m, a, b, da, ma, db, mb);
  const float sc = Q == KQ_FP8 ? scale[id] : 1.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    float y = Q == KQ_FP8 ? __fmul_rn(a[i], sc) : __fadd_rn(__fmul_rn(da, a[i]), ma);
    o[xa + i] = st<kbf16>(y);
  }
  if (EPV == 32) {
#pragma unroll
    for (int i = 0; i < 16; ++i)
      o[xa + q_xb_gap<Q>() + i] = st<kbf16>(__fadd_rn(__fmul_rn(db, b[i]), mb));
  }
}

#define KILN_QGEMV(S, Q, O, OS, TT)                                                            \
  KILN_GLOBAL void __launch_bounds__(KILN_QWARPS * KILN_WARP, KILN_QMINBLOCKS)                 \
      qgemv_##S##_t##TT##_bf16_##OS(const kbf16* x, const unsigned char* w, const float* scale, \
                                    const kbf16* bias, const kbf16* res, O* out, int tokens,    \
                                    int n, int k, int w_const, i64 off1, i64 off2, i64 off3) {  \
    qgemv_rows<Q, O, TT, 0, 0>(x, w, scale, bias, nullptr, res, out, tokens, n, k, w_const,     \
                               off1, off2, off3, 0.0f, 0, KQ_FUSED_NONE);                       \
  }
// The fused entries (fused_matmul): qgemv_fused_S_tTT_bf16_bf16 (epilogue
// only) and qgemv_fused_norm_S_tTT_bf16_OS (RMSNorm prologue; f32 results
// only without an epilogue, which the lowering checks).
#define KILN_QGEMV_FUSED(S, Q, O, OS, TT, PRE, NAME)                                           \
  KILN_GLOBAL void __launch_bounds__(KILN_QWARPS * KILN_WARP, KILN_QMINBLOCKS)                 \
      NAME(const kbf16* x, const unsigned char* w, const float* scale, const kbf16* bias,      \
           const kbf16* norm_w, const kbf16* res, O* out, int tokens, int n, int k, int w_const, \
           i64 off1, i64 off2, i64 off3, float eps, int unit_offset, int mode) {               \
    qgemv_rows<Q, O, TT, PRE, 1>(x, w, scale, bias, norm_w, res, out, tokens, n, k, w_const,   \
                                 off1, off2, off3, eps, unit_offset, mode);                    \
  }
#define KILN_QGEMV_FUSED_TT(S, Q, TT)                                                          \
  KILN_QGEMV_FUSED(S, Q, kbf16, bf16, TT, 0, qgemv_fused_##S##_t##TT##_bf16_bf16)              \
  KILN_QGEMV_FUSED(S, Q, kbf16, bf16, TT, 1, qgemv_fused_norm_##S##_t##TT##_bf16_bf16)         \
  KILN_QGEMV_FUSED(S, Q, float, f32, TT, 1, qgemv_fused_norm_##S##_t##TT##_bf16_f32)
#define KILN_QGEMV_TOKENS(S, Q, O, OS)                                                         \
  KILN_QGEMV(S, Q, O, OS, 1) KILN_QGEMV(S, Q, O, OS, 2) KILN_QGEMV(S, Q, O, OS, 4)            \
      KILN_QGEMV(S, Q, O, OS, 8)
#define KILN_QTYPE(S, Q)                                                                       \
  KILN_QGEMV_TOKENS(S, Q, kbf16, bf16)                                                         \
  KILN_QGEMV_TOKENS(S, Q, float, f32)                                                          \
  KILN_QGEMV_FUSED_TT(S, Q, 1)                                                                 \
  KILN_QGEMV_FUSED_TT(S, Q, 2)                                                                 \
  KILN_QGEMV_FUSED_TT(S, Q, 4)                                                                 \
  KILN_QGEMV_FUSED_TT(S, Q, 8)                                                                 \
  KILN_GLOBAL void qgather_##S##_bf16(const int* ids, const unsigned char* w, const float* scale, \
                                      kbf16* out, int n, int k, i64 off1, i64 off2, i64 off3) { \
    qgather_row<Q>(ids, w, scale, out, n, k, off1, off2, off3);                                \
  }
KILN_QTYPE(q8_0, KQ_Q8_0)
KILN_QTYPE(q4_0, KQ_Q4_0)
KILN_QTYPE(q4_1, KQ_Q4_1)
KILN_QTYPE(q5_0, KQ_Q5_0)
KILN_QTYPE(q4k, KQ_Q4K)
KILN_QTYPE(q5k, KQ_Q5K)
KILN_QTYPE(q6k, KQ_Q6K)
KILN_QTYPE(fp8, KQ_FP8)
