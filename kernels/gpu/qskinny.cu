// Quantized skinny GEMM on tensor cores: y[t, n] = sum_k x[t, k] * W[n, k]
// (+ bias[n]) (+ residual[t, n]) for 1..32 tokens per launch, with W kept
// compressed in device memory in the repacked layout of qgemv.cu (written by
// kiln_kernels::quant_gpu::repack; its header there documents the regions)
// and dequantized in registers; x bf16 [T, K], y bf16 or f32.
//
// Why: qgemv.cu decodes each weight vector to f32 and multiplies it by every
// token on the FMA pipe, so past one token it is ALU bound (on the H200 a b8
// step costs 3.2-5.4x a b1 step on Q4_K models). Here the multiply is
// `mma.sync.aligned.m16n8k16` (bf16 in, f32 accumulate, sm_80+), with the
// weight CODES as the 16-row A operand and x^T (tokens padded to a multiple
// of 8) as the 8-column B operand, so every weight byte is read and decoded
// once per launch at every T <= 32 and the decode is shared by the tokens.
//
// Numerics. Every code is an exact bf16 (Q4 0..15, Q5 0..31, Q6 0..63 with
// the type's offset removed, Q8_0 -128..127, e4m3 values: 3 mantissa bits,
// exponents inside bf16's range). One MMA step covers 16 k that lie in one
// scale group (Q8_0, Q4_0, Q4_1, Q5_0: the 32-block; Q4_K, Q5_K: the
// 32-element sub-block; Q6_K: the 16-element sub-block); a group's steps
// accumulate in f32 from zero, then the group's scale is applied in f32,
// acc += (d*sc) * group_acc, and a min as acc += (-dmin*m) * sum(x over the
// group) (Q4_1: +m * sum(x)), the sums of x formed by one more MMA step with
// an all-ones A operand (exact products, f32 accumulation, in the
// accumulator layout, shared by the block's row tiles). FP8 has one per-row
// scale: the steps accumulate straight into the row's sum, scaled once at
// the end. So the result differs from "dequantize, then multiply" by f32
// reordering (and the tensor core's f32 accumulation) only, like qgemv; the
// scale products d*sc and dmin*m are formed as the reference forms them.
// The result is rounded once, after the bias; with a residual, the rounded
// product plus the residual is rounded again (qgemv's rounding points).
//
// The k map. A lane is (g, t) = (lane / 4, lane % 4). A warp walks "units"
// of a row (Q8_0: a 32-block, two 16-byte vectors of i8; FP8: 16 elements,
// one vector; Q4_0, Q4_1, Q5_0: a 32-block, one vector of nibbles; the
// K-quants: a 64-element chunk, two vectors of nibbles) and lane t loads
// the 32-bit word t of each of the unit's vectors for rows g and g+8 of
// each row tile. Step s of a unit covers the unit's elements
// [16s, 16s + 16): word t of vector s (8-bit types), or the low (s even,
// Q4_0..Q5_0) / high (s odd) nibbles of the one vector, or for the K-quants
// the low (s < 2) / high (s >= 2) nibbles of vector s % 2 (qgemv's A_i / B_i
// halves: A_i = 64c + 16(v%2) + i, B_i = A_i + 32, so the four halves of a
// chunk are its elements 0-15, 16-31, 32-47, 48-63). Lane t's four codes of
// a step are the step's elements 4t..4t+3; the A register pair {a0, a2}
// (row g) holds elements {4t, 4t+1} and {4t+2, 4t+3}, logical k {2t, 2t+1}
// and {2t+8, 2t+9} in PTX's fragment layout, and the B pair {b0, b1} holds
// x[token g] at the same elements (one 8-byte load): the same map for A and
// B, each k of the step once. The accumulator layout is PTX's: c[i] is row
// g + 8*(i/2), token 2t + (i%2) of the 16x8 tile.
//
// Codes to bf16 without conversions: a byte c < 128 placed under the bf16
// exponent byte 0x43 is the bf16 128 + c (one byte permute makes two such
// halves), and one bf16x2 FMA subtracts 128 plus the type's offset. FP8 on
// sm_89+ converts in hardware and moves the f16 bits under a bf16 exponent
// the same way (qsk_e4m3x2). Q8_0, and FP8 before sm_89, go through f32 and
// one cvt.rn.bf16x2.f32 (exact).
//
// Work split (kernels/src/quant_gpu.rs `lower_qskinny` picks the geometry):
//   * block b owns rows [16*MT*b, 16*MT*(b+1)): MT row tiles of 16;
//   * its W warps split K: warp w takes the units w, w+W, w+2W, ..., with
//     the next unit's weight words and metadata in flight during this one
//     (the `_pf<d>` entries keep d - 1 or d ahead: FP8 in registers, the
//     others in shared memory through cp.async, see QskSlot);
//   * each warp keeps every token: NT tiles of 8 (T <= 8*NT);
//   * the per-warp partial sums meet in dynamic shared memory
//     ([W][MT*NT*4][32] f32) and are summed in warp order (deterministic).
// Edges: rows past n and tokens past `tokens` use a clamped (valid) row and
// their results are dropped. Requires what qgemv requires (K a multiple of
// the type's block, 16-byte aligned x and W; the lowering checks).
//
// Entry points: qskinny_S_tTP_rMT_bf16_OS, TP in 8, 16, 24, 32, MT in 1, 2,
// OS in bf16, f32, with S one of qskinny_q8_0_, qskinny_q4_0_,
// qskinny_q4_1_, qskinny_q5_0_, qskinny_q4k_, qskinny_q5k_, qskinny_q6k_,
// qskinny_fp8_, and the ring variants qskinny_S_t8_r1_pfPF_bf16_OS (see the
// end of the file). Parameters are qgemv's (x, w, scale, bias, res, out,
// tokens, n, k, w_const, off1, off2, off3).
//
// Fused entries (fused_matmul over a quantized weight):
// qskinny_fused_norm_S_tTP_rMT_bf16_{bf16,f32} (the RMSNorm prologue) and
// qskinny_fused_S_tTP_r2_bf16_bf16 (an activation epilogue without it),
// taking (x, w, scale, bias, norm_w, res, out, tokens, n, k, w_const, off1,
// off2, off3, eps, unit_offset, mode) with qgemv.cu's fused modes.
//   * Prologue: every block computes each token row's inverse RMS itself
//     after KILN_PROLOGUE() (kiln_inv_rms_rows; a warp per token, x
//     L2-resident), and the B fragments are normalized as they are loaded:
//     the lane's four elements of a step times its token's inverse RMS and
//     the norm weight, rounded to bf16 (the value the unfused rms_norm
//     stores) before they enter the MMA. The normalization costs a few
//     FMULs per MMA step and shares the one x load; the weights' decode is
//     untouched. Because the all-ones MMA step sums the same normalized
//     fragments, the min types' sum(x) is the sum of the normalized x.
//   * Activation epilogue (mode 1 silu, 2 gelu_tanh; MT = 2 required): a
//     block's tile 0 is gate rows [16b, 16b + 16) and tile 1 the up rows n/2
//     further, so the thread that sums a gate slot over the split-K warps
//     sums the same slot of the up tile too, and writes act(g) * u with g
//     and u rounded to bf16 first. Residual (mode 3) as the plain entries.
// The plain entries are the same template with the prologue and the mode
// compiled out. The portable path does the same per weight.
// Their stems:
// qskinny_fused_q8_0_, qskinny_fused_q4_0_, qskinny_fused_q4_1_,
// qskinny_fused_q5_0_, qskinny_fused_q4k_, qskinny_fused_q5k_,
// qskinny_fused_q6k_, qskinny_fused_fp8_, qskinny_fused_norm_q8_0_,
// qskinny_fused_norm_q4_0_, qskinny_fused_norm_q4_1_, qskinny_fused_norm_q5_0_,
// qskinny_fused_norm_q4k_, qskinny_fused_norm_q5k_, qskinny_fused_norm_q6k_,
// qskinny_fused_norm_fp8_.
//
// PDL: the first unit's weight words and metadata (never written by another
// kernel) are loaded before KILN_PROLOGUE() only when w_const; x, bias, the
// norm weight, residual, scale and out are touched only after it.
//
// Portable path: HIP and CUDA before sm_80 compile the same entry points
// (same parameters, geometry and shared memory) as a plain loop, one warp
// per output row and token, each weight decoded by itself; correct, not
// tuned (the lowering picks qgemv there).
#include "kiln_port.h"

#if defined(KILN_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
#define KILN_QSK_MMA 1
#endif

#define KQ_Q8_0 0
#define KQ_Q4_0 1
#define KQ_Q4_1 2
#define KQ_Q5_0 3
#define KQ_Q4K 4
#define KQ_Q5K 5
#define KQ_Q6K 6
#define KQ_FP8 7

// Per-type unit geometry.
template <int Q> struct Qsk {
  static constexpr bool kquant = Q == KQ_Q4K || Q == KQ_Q5K || Q == KQ_Q6K;
  static constexpr bool bytes8 = Q == KQ_Q8_0 || Q == KQ_FP8;
  // 16-byte vectors per unit and elements per unit.
  static constexpr int uv = (Q == KQ_Q8_0 || kquant) ? 2 : 1;
  static constexpr int epu = Q == KQ_FP8 ? 16 : kquant ? 64 : 32;
  static constexpr int steps = epu / 16;
  // Steps per scale group.
  static constexpr int gsteps = Q == KQ_Q6K ? 1 : Q == KQ_FP8 ? 1 : 2;
  static constexpr bool has_min = Q == KQ_Q4_1 || Q == KQ_Q4K || Q == KQ_Q5K;
  // The offset the codes carry (w = d*(q - off)).
  static constexpr unsigned int off = Q == KQ_Q4_0 ? 8u : Q == KQ_Q5_0 ? 16u : Q == KQ_Q6K ? 32u : 0u;
};

KILN_DEV float qsk_f16(unsigned int bits) {
  kf16 h;
  h.bits = (unsigned short)(bits & 0xffffu);
  return ld(h);
}

// e4m3 as f32 (qgemv.cu's q_e4m3: the bits moved into place, times 2^120).
KILN_DEV float qsk_e4m3(unsigned int b) {
  const unsigned int u = ((b & 0x7fu) << 20) | ((b & 0x80u) << 24);
  return __uint_as_float(u) * 1.329227995784916e36f;  // 2^120
}

// The weight words and metadata of one unit of one row.
struct QskUnit {
  unsigned int w[2];
  unsigned int m[6];
};

template <int Q>
KILN_DEV void qsk_load(QskUnit& d, const unsigned char* __restrict__ w, i64 row, int u, int k,
                       int t, i64 off1, i64 off2, i64 off3) {
  const i64 row_bytes = Qsk<Q>::bytes8 ? (i64)k : (i64)k / 2;
  const unsigned char* base = w + row * row_bytes + (i64)u * Qsk<Q>::uv * 16 + 4 * t;
#pragma unroll
  for (int v = 0; v < 2; ++v)
    d.w[v] = v < Qsk<Q>::uv ? *reinterpret_cast<const unsigned int*>(base + 16 * v) : 0u;
#pragma unroll
  for (int i = 0; i < 6; ++i) d.m[i] = 0u;
  const i64 nv = k / 32;
  if (Q == KQ_Q8_0) {
    d.m[0] = reinterpret_cast<const unsigned short*>(w + off1)[row * nv + u];
  } else if (Q == KQ_Q4_0) {
    d.m[0] = reinterpret_cast<const unsigned short*>(w + off1)[row * nv + u];
  } else if (Q == KQ_Q4_1) {
    d.m[0] = reinterpret_cast<const unsigned int*>(w + off1)[row * nv + u];
  } else if (Q == KQ_Q5_0) {
    d.m[0] = reinterpret_cast<const unsigned short*>(w + off1)[row * nv + u];
    d.m[2] = reinterpret_cast<const unsigned int*>(w + off2)[row * nv + u];
  } else if (Q == KQ_Q4K || Q == KQ_Q5K) {
    d.m[0] = reinterpret_cast<const unsigned int*>(w + off1)[row * (k / 256) + u / 4];
    d.m[1] = reinterpret_cast<const unsigned int*>(w + off2)[row * (k / 64) + u];
    if (Q == KQ_Q5K) {
      const uint2 h = reinterpret_cast<const uint2*>(w + off3)[(row * nv) / 2 + u];
      d.m[2] = h.x;
      d.m[3] = h.y;
    }
  } else if (Q == KQ_Q6K) {
    d.m[0] = reinterpret_cast<const unsigned short*>(w + off1)[row * (k / 256) + u / 4];
    // Two i8 scales per vector: (A, B) of vector 2u, then of 2u+1.
    d.m[1] = reinterpret_cast<const unsigned int*>(w + off2)[(row * nv) / 2 + u];
    // Two u32 of high bit pairs per vector: (A, B) of 2u, then of 2u+1.
    const uint4 h = reinterpret_cast<const uint4*>(w + off3)[(row * nv) / 2 + u];
    d.m[2] = h.x;
    d.m[3] = h.y;
    d.m[4] = h.z;
    d.m[5] = h.w;
  }
}

// Spreads 4 bits (bit j -> bit 4 of byte j).
KILN_DEV unsigned int qsk_bit4(unsigned int b) {
  return (((b & 0xfu) * 0x00204081u) & 0x01010101u) << 4;
}
// Spreads 4 2-bit pairs (pair j -> bits 4, 5 of byte j).
KILN_DEV unsigned int qsk_bit45(unsigned int va) {
  return ((va & 0x03u) | ((va & 0x0cu) << 6) | ((va & 0x30u) << 12) | ((va & 0xc0u) << 18)) << 4;
}

#if defined(KILN_QSK_MMA)
KILN_DEV unsigned int qsk_fma_bf16x2(unsigned int a, unsigned int b, unsigned int c) {
  unsigned int d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
// Two e4m3 codes (the low and high byte of `pair`) as bf16x2, exactly, on
// sm_89+: the hardware conversion to f16x2 (exact; every e4m3 value, the
// subnormals included, is a normal f16 or zero), then each f16 half's
// exponent and top 7 mantissa bits shifted into bf16's (sign in place),
// which is the bf16 2^-112 times the value (zero stays zero; no bf16
// subnormal arises), and one bf16x2 FMA by 2^112 (0x7780), adding -0 so a
// zero keeps its sign. Four instructions a pair instead of two qsk_e4m3
// and a conversion; the same bits.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
#define KILN_QSK_E4M3_HW 1
KILN_DEV unsigned int qsk_e4m3x2(unsigned int pair) {
  unsigned int h;
  asm("{\n\t.reg .b16 l;\n\tcvt.u16.u32 l, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\t}"
      : "=r"(h)
      : "r"(pair));
  const unsigned int y = ((h >> 3) & 0x0fff0fffu) | (h & 0x80008000u);
  return qsk_fma_bf16x2(y, 0x77807780u, 0x80008000u);
}
#endif
// (lo, hi) f32 -> bf16x2 (exact for the values used here).
KILN_DEV unsigned int qsk_pack_bf16(float lo, float hi) {
  unsigned int d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
KILN_DEV void qsk_mma(float* d, unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
                      unsigned int b0, unsigned int b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Step s's four codes of lane t (elements 4t..4t+3 of the step) as the two
// bf16x2 registers {4t, 4t+1} and {4t+2, 4t+3}.
template <int Q>
KILN_DEV void qsk_codes(const QskUnit& d, int s, int t, unsigned int& p01, unsigned int& p23) {
#if defined(KILN_QSK_E4M3_HW)
  if (Q == KQ_FP8) {
    p01 = qsk_e4m3x2(d.w[0]);
    p23 = qsk_e4m3x2(d.w[0] >> 16);
    return;
  }
#endif
  if (Qsk<Q>::bytes8) {
    const unsigned int wd = d.w[Q == KQ_FP8 ? 0 : s];
    float f[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (Q == KQ_Q8_0) {
        // 2^23 + (byte ^ 0x80), minus 2^23 + 128: the signed code.
        f[e] = __uint_as_float(
                   __byte_perm(wd ^ 0x80808080u, 0x4B000000u, 0x7440u | (unsigned int)e)) -
               8388736.0f;
      } else {
        f[e] = qsk_e4m3((wd >> (8 * e)) & 0xffu);
      }
    }
    p01 = qsk_pack_bf16(f[0], f[1]);
    p23 = qsk_pack_bf16(f[2], f[3]);
    return;
  }
  const int v = Qsk<Q>::kquant ? (s & 1) : 0;
  const bool hi = Qsk<Q>::kquant ? (s >= 2) : (s & 1);
  const unsigned int wd = d.w[v];
  unsigned int c = hi ? ((wd >> 4) & 0x0f0f0f0fu) : (wd & 0x0f0f0f0fu);
  const int hs = hi ? 16 : 0;
  if (Q == KQ_Q5_0) c |= qsk_bit4(d.m[2] >> (4 * t + hs));
  if (Q == KQ_Q5K) c |= qsk_bit4(d.m[2 + v] >> (4 * t + hs));
  if (Q == KQ_Q6K) c |= qsk_bit45((d.m[2 + 2 * v + (hi ? 1 : 0)] >> (8 * t)) & 0xffu);
  // bf16 halves 0x43cc = 128 + c, then * 1 - (128 + off).
  const unsigned int one = 0x3f803f80u;
  const unsigned int neg = (0xc300u | Qsk<Q>::off) * 0x00010001u;
  p01 = qsk_fma_bf16x2(__byte_perm(c, 0x43434343u, 0x4140u), one, neg);
  p23 = qsk_fma_bf16x2(__byte_perm(c, 0x43434343u, 0x4342u), one, neg);
}

// Group j's (scale, min) factors of one row: w = da*code + ma.
template <int Q>
KILN_DEV void qsk_scales(const QskUnit& d, int j, float& da, float& ma) {
  ma = 0.0f;
  if (Q == KQ_FP8) {
    da = 1.0f;
  } else if (Q == KQ_Q8_0 || Q == KQ_Q4_0 || Q == KQ_Q5_0) {
    da = qsk_f16(d.m[0]);
  } else if (Q == KQ_Q4_1) {
    da = qsk_f16(d.m[0]);
    ma = qsk_f16(d.m[0] >> 16);
  } else if (Q == KQ_Q4K || Q == KQ_Q5K) {
    const float dd = qsk_f16(d.m[0]), dmin = qsk_f16(d.m[0] >> 16);
    da = __fmul_rn(dd, (float)((d.m[1] >> (16 * j)) & 0xffu));
    ma = -__fmul_rn(dmin, (float)((d.m[1] >> (16 * j + 8)) & 0xffu));
  } else if (Q == KQ_Q6K) {
    // Group j is step j: vector j % 2, half j / 2 -> byte 2*(j%2) + j/2.
    const int byte = 2 * (j & 1) + (j >> 1);
    da = __fmul_rn(qsk_f16(d.m[0]), (float)(signed char)((d.m[1] >> (8 * byte)) & 0xffu));
  }
}
#endif

// One weight decoded by itself (the portable path): element e of `row`.
template <int Q>
KILN_DEV float qsk_weight(const unsigned char* __restrict__ w, i64 row, int e, int k, i64 off1,
                          i64 off2, i64 off3) {
  const i64 nv = k / 32;
  if (Q == KQ_Q8_0) {
    const float d = qsk_f16(reinterpret_cast<const unsigned short*>(w + off1)[row * nv + e / 32]);
    return __fmul_rn((float)(signed char)w[row * k + e], d);
  }
  if (Q == KQ_FP8) return qsk_e4m3(w[row * k + e]);
  int v, i;
  bool hi;
  if (Qsk<Q>::kquant) {
    const int r = e % 64, rr = r % 32;
    hi = r >= 32;
    v = 2 * (e / 64) + rr / 16;
    i = rr % 16;
  } else {
    const int r = e % 32;
    hi = r >= 16;
    v = e / 32;
    i = r % 16;
  }
  const i64 gv = row * nv + v;
  const unsigned int byte = w[gv * 16 + i];
  unsigned int c = hi ? byte >> 4 : byte & 0xfu;
  if (Q == KQ_Q5_0 || Q == KQ_Q5K) {
    const unsigned int qh = reinterpret_cast<const unsigned int*>(w + (Q == KQ_Q5_0 ? off2 : off3))[gv];
    c |= ((qh >> (i + (hi ? 16 : 0))) & 1u) << 4;
  }
  if (Q == KQ_Q6K) {
    const unsigned int hb = reinterpret_cast<const unsigned int*>(w + off3)[2 * gv + (hi ? 1 : 0)];
    c |= ((hb >> (2 * i)) & 3u) << 4;
  }
  if (Q == KQ_Q4_0 || Q == KQ_Q5_0) {
    const float d = qsk_f16(reinterpret_cast<const unsigned short*>(w + off1)[gv]);
    return __fmul_rn(d, (float)((int)c - (int)Qsk<Q>::off));
  }
  if (Q == KQ_Q4_1) {
    const unsigned int dm = reinterpret_cast<const unsigned int*>(w + off1)[gv];
    return __fadd_rn(__fmul_rn(qsk_f16(dm), (float)c), qsk_f16(dm >> 16));
  }
  if (Q == KQ_Q4K || Q == KQ_Q5K) {
    const unsigned int dm = reinterpret_cast<const unsigned int*>(w + off1)[row * (k / 256) + e / 256];
    const unsigned int sm = reinterpret_cast<const unsigned int*>(w + off2)[row * (k / 64) + e / 64];
    const int sh = hi ? 16 : 0;
    const float da = __fmul_rn(qsk_f16(dm), (float)((sm >> sh) & 0xffu));
    const float ma = __fmul_rn(qsk_f16(dm >> 16), (float)((sm >> (sh + 8)) & 0xffu));
    return __fadd_rn(__fmul_rn(da, (float)c), -ma);
  }
  // Q6_K
  const float d = qsk_f16(reinterpret_cast<const unsigned short*>(w + off1)[row * (k / 256) + e / 256]);
  const float sc = (float)(signed char)w[off2 + gv * 2 + (hi ? 1 : 0)];
  return __fmul_rn(__fmul_rn(d, sc), (float)((int)c - 32));
}

// Writes one output: the f32 sum times FP8's row scale, plus the bias, rounded;
// with a residual, rounded again after adding it.
template <int Q, typename O>
KILN_DEV void qsk_store(float s, i64 row, int tok, const float* __restrict__ scale,
                        const kbf16* __restrict__ bias, const kbf16* __restrict__ res,
                        O* __restrict__ out, int n) {
  const float sc = Q == KQ_FP8 ? scale[row] : 1.0f;
  const float bv = bias ? ld(bias[row]) : 0.0f;
  float y = s * sc + bv;
  if (res) y = round_to<kbf16>(y) + ld(res[(i64)tok * n + row]);
  out[(i64)tok * n + row] = st<O>(y);
}

// Epilogue modes of the fused entries (uniform per launch), as gemv.cu's.
#define KQSK_FUSED_NONE 0
#define KQSK_FUSED_SILU 1
#define KQSK_FUSED_GELU 2
#define KQSK_FUSED_RESIDUAL 3

// The activation epilogue's output j of token tok from the gate row's sum
// sg (row j) and the up row's su (row j + outs): g and u rounded as the
// unfused matmul stores them, then act(g) * u rounded once.
template <int Q, typename O>
KILN_DEV void qsk_store_act(float sg, float su, i64 j, int tok, int outs,
                            const float* __restrict__ scale, const kbf16* __restrict__ bias,
                            O* __restrict__ out, int mode) {
  const i64 ju = j + outs;
  const float g = round_to<kbf16>(sg * (Q == KQ_FP8 ? scale[j] : 1.0f) +
                                  (bias ? ld(bias[j]) : 0.0f));
  const float u = round_to<kbf16>(su * (Q == KQ_FP8 ? scale[ju] : 1.0f) +
                                  (bias ? ld(bias[ju]) : 0.0f));
  const float a = mode == KQSK_FUSED_SILU ? kiln_silu(g) : kiln_gelu_tanh(g);
  out[(i64)tok * outs + j] = st<O>(a * u);
}

// x[tok][col] as the product reads it: as stored, or under the prologue
// (PRE) round(x * inv * w) with w the norm weight (1 + w under unit_offset),
// the value the unfused rms_norm stores.
template <int PRE>
KILN_DEV float qsk_xn(const kbf16* __restrict__ xr, const kbf16* __restrict__ norm_w, int col,
                      float inv, int unit_offset) {
  const float v = ld(xr[col]);
  if (!PRE) return v;
  const float g = ld(norm_w[col]);
  return round_to<kbf16>(v * inv * (unit_offset ? 1.0f + g : g));
}

#if defined(KILN_QSK_MMA)
// Slots 1..P-1 of a warp's unit ring: the units u + i * warps that exist.
template <int Q, int MT, int P>
KILN_DEV void qsk_ring_fill(QskUnit (&ring)[P][MT][2], const unsigned char* __restrict__ w,
                            const i64 (&rows)[MT][2], int u, int warps, int units, int k, int t,
                            i64 off1, i64 off2, i64 off3) {
#pragma unroll
  for (int i = 1; i < P; ++i) {
    if (u + i * warps < units) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          qsk_load<Q>(ring[i][mt][h], w, rows[mt][h], u + i * warps, k, t, off1, off2, off3);
    }
  }
}
#endif

#if defined(KILN_QSK_MMA)
// The unit ring in shared memory (the `_pf<d>` entries of every type but
// FP8): a ring of registers helps FP8 (one vector, no metadata) but lost on
// Q4_K, whose plain loop already sits at the 64 registers that allow two
// 512-thread blocks per SM, so the units in flight go to shared memory
// through cp.async, which holds no register while the bytes travel. A slot
// is one unit of the warp's 16 * MT rows: [rows][uv vectors][16 B] of codes
// (with two vectors, those of rows whose bit 2 is set swapped, so the eight
// rows g of one read and their lanes t hit 32 distinct banks; with one, the
// 16-byte row stride does that already), then the metadata words qsk_load
// reads, field by field, [field][rows][words]: f0 the first scale word (a
// 16-bit scale is copied as the aligned word holding it and picked at the
// read), f1 the second (Q5_0: its fifth bits; the K-quants: the chunk's
// scales), f2 Q5_K's two / Q6_K's four words of high bits.
template <int Q> struct QskMeta {
  // Words per row of fields f1 and f2, and whether f0 is a 16-bit scale.
  static constexpr int f1 = (Q == KQ_Q5_0 || Qsk<Q>::kquant) ? 1 : 0;
  static constexpr int f2 = Q == KQ_Q5K ? 2 : Q == KQ_Q6K ? 4 : 0;
  static constexpr bool half0 = Q == KQ_Q8_0 || Q == KQ_Q4_0 || Q == KQ_Q5_0 || Q == KQ_Q6K;
};
template <int Q, int MT> struct QskSlot {
  static constexpr int rows = 16 * MT;
  static constexpr int codes = rows * Qsk<Q>::uv * 16;
  static constexpr int m1 = codes + rows * 4;
  static constexpr int m2 = m1 + rows * 4 * QskMeta<Q>::f1;
  static constexpr int bytes = m2 + rows * 4 * QskMeta<Q>::f2;
};
// Row `row`'s unit-u index into f0's array (one scale per 32-block, or per
// 256-element super-block for the K-quants) and the byte address of f0.
template <int Q>
KILN_DEV const unsigned char* qsk_f0(const unsigned char* __restrict__ w, i64 row, int u, int k,
                                     i64 off1) {
  const i64 i = Qsk<Q>::kquant ? row * (k / 256) + u / 4 : row * (k / 32) + u;
  return w + off1 + (QskMeta<Q>::half0 ? 2 : 4) * i;
}
// The weight row of slot row r (the kernel's rows[r / 16][(r / 8) % 2] for
// lane g = r % 8): row0 + r clamped to n - 1, or under an activation
// epilogue (act_outs = n / 2 > 0) gate row row0 + r % 16 clamped to
// act_outs - 1, plus act_outs for the up tile (r >= 16).
KILN_DEV i64 qsk_row_of(i64 row0, int r, int n, int act_outs) {
  if (act_outs > 0) {
    const i64 j = row0 + (r & 15);
    return (j < act_outs ? j : act_outs - 1) + (i64)(r >> 4) * act_outs;
  }
  return row0 + r < n ? row0 + r : n - 1;
}
// Issues one unit of the block's 16 * MT rows (qsk_row_of) into `slot`,
// the copies spread over the warp's lanes.
template <int Q, int MT>
KILN_DEV void qsk_cp_unit(unsigned char* slot, const unsigned char* __restrict__ w, i64 row0, int n,
                          int act_outs, int u, int k, int lane, i64 off1, i64 off2, i64 off3) {
  using S = QskSlot<Q, MT>;
  constexpr int uv = Qsk<Q>::uv;
  const i64 row_bytes = Qsk<Q>::bytes8 ? (i64)k : (i64)k / 2;
  const i64 nv = k / 32;
#pragma unroll
  for (int j = 0; j < (S::rows * uv + 31) / 32; ++j) {
    const int c = lane + 32 * j;
    if (c < S::rows * uv) {
      const int r = c / uv, v = c % uv;
      const i64 gr = qsk_row_of(row0, r, n, act_outs);
      const int dv = uv == 2 ? (v ^ ((r >> 2) & 1)) : 0;
      kiln_cp_async16(slot + (r * uv + dv) * 16, w + gr * row_bytes + (i64)u * uv * 16 + 16 * v);
    }
  }
  // The metadata: f0 and f1 one word a row, f2 one copy a row.
  constexpr int nf = 1 + (QskMeta<Q>::f1 ? 1 : 0);
#pragma unroll
  for (int j = 0; j < (S::rows * nf + 31) / 32; ++j) {
    const int c = lane + 32 * j;
    if (c < S::rows * nf) {
      const int f = c / S::rows, r = c % S::rows;
      const i64 gr = qsk_row_of(row0, r, n, act_outs);
      const unsigned char* src;
      if (f == 0) {
        const unsigned char* p = qsk_f0<Q>(w, gr, u, k, off1);
        src = reinterpret_cast<const unsigned char*>(reinterpret_cast<size_t>(p) & ~(size_t)3);
      } else if (Q == KQ_Q5_0) {
        src = w + off2 + 4 * (gr * nv + u);
      } else if (Q == KQ_Q6K) {
        // Two i8 scales per vector, (A, B) of 2u then of 2u + 1: one word.
        src = w + off2 + 4 * ((gr * nv) / 2 + u);
      } else {
        src = w + off2 + 4 * (gr * (k / 64) + u);
      }
      kiln_cp_async4(slot + (f == 0 ? S::codes : S::m1) + 4 * r, src);
    }
  }
  if (QskMeta<Q>::f2) {
#pragma unroll
    for (int j = 0; j < (S::rows + 31) / 32; ++j) {
      const int r = lane + 32 * j;
      if (r < S::rows) {
        const i64 gr = qsk_row_of(row0, r, n, act_outs);
        if (Q == KQ_Q5K)
          kiln_cp_async8(slot + S::m2 + 8 * r, w + off3 + 8 * ((gr * nv) / 2 + u));
        else
          kiln_cp_async16(slot + S::m2 + 16 * r, w + off3 + 16 * ((gr * nv) / 2 + u));
      }
    }
  }
}
// Lane (g, t)'s words of a landed slot: what qsk_load reads from memory
// (rows: the lane's rows, as the plain loop clamps them).
template <int Q, int MT>
KILN_DEV void qsk_slot_read(QskUnit (&cur)[MT][2], const unsigned char* slot,
                            const i64 (&rows)[MT][2], const unsigned char* __restrict__ w, int u,
                            int k, i64 off1, int g, int t) {
  using S = QskSlot<Q, MT>;
  constexpr int uv = Qsk<Q>::uv;
  const unsigned int* meta = reinterpret_cast<const unsigned int*>(slot + S::codes);
  const int sw = uv == 2 ? (g >> 2) & 1 : 0;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * mt + 8 * h + g;
      QskUnit& d = cur[mt][h];
#pragma unroll
      for (int v = 0; v < 2; ++v)
        d.w[v] = v < uv ? *reinterpret_cast<const unsigned int*>(slot + (r * uv + (v ^ sw)) * 16 + 4 * t)
                        : 0u;
#pragma unroll
      for (int i = 0; i < 6; ++i) d.m[i] = 0u;
      unsigned int m0 = meta[r];
      if (QskMeta<Q>::half0)
        m0 = (reinterpret_cast<size_t>(qsk_f0<Q>(w, rows[mt][h], u, k, off1)) & 2) ? m0 >> 16
                                                                                    : m0 & 0xffffu;
      d.m[0] = m0;
      if (QskMeta<Q>::f1) {
        const unsigned int m1 = *reinterpret_cast<const unsigned int*>(slot + S::m1 + 4 * r);
        if (Q == KQ_Q5_0)
          d.m[2] = m1;
        else
          d.m[1] = m1;
      }
      if (Q == KQ_Q5K) {
        const uint2 hb = *reinterpret_cast<const uint2*>(slot + S::m2 + 8 * r);
        d.m[2] = hb.x;
        d.m[3] = hb.y;
      } else if (Q == KQ_Q6K) {
        const uint4 hb = *reinterpret_cast<const uint4*>(slot + S::m2 + 16 * r);
        d.m[2] = hb.x;
        d.m[3] = hb.y;
        d.m[4] = hb.z;
        d.m[5] = hb.w;
      }
    }
}
#endif

// PRE: the RMSNorm prologue (norm_w, eps, unit_offset); FUSED: the entry
// takes an epilogue `mode`. Plain entries are <.., 0, 0> (norm_w null,
// mode 0): the same code as before the fused entries existed. An
// activation epilogue needs MT == 2 (the lowering checks): the block's
// tile 0 is gate rows [16b, 16b + 16), tile 1 the up rows n/2 + the same.
template <int Q, typename O, int NT, int MT, int PRE, int FUSED, int PF = 0>
KILN_DEV void qskinny_gemm(const kbf16* __restrict__ x, const unsigned char* __restrict__ w,
                           const float* __restrict__ scale, const kbf16* __restrict__ bias,
                           const kbf16* __restrict__ norm_w, const kbf16* __restrict__ res,
                           O* __restrict__ out, int tokens, int n, int k, int w_const, i64 off1,
                           i64 off2, i64 off3, float eps, int unit_offset, int mode) {
  const int lane = threadIdx.x % KILN_WARP;
  const int warp = threadIdx.x / KILN_WARP;
  const int warps = blockDim.x / KILN_WARP;
  const bool act = FUSED && MT == 2 && (mode == KQSK_FUSED_SILU || mode == KQSK_FUSED_GELU);
  const int outs = act ? n / 2 : n;
  // Tile mt's first row: consecutive tiles, or gate and up under act.
  const i64 row0 = act ? (i64)blockIdx.x * 16 : (i64)blockIdx.x * (16 * MT);
  __shared__ float qsk_inv[PRE ? 32 : 1];
#if defined(KILN_QSK_MMA)
  // [warps][R][32] for the split-K partials; under CPA first the warps'
  // unit rings ([warps][P] slots), which the partials overwrite after a
  // block barrier.
  extern __shared__ __align__(16) float qsk_red[];
  constexpr int R = MT * NT * 4;
  constexpr int S = Qsk<Q>::steps;
  constexpr int GS = Qsk<Q>::gsteps;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int units = k / Qsk<Q>::epu;
  i64 rows[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (act) {
        const i64 j = row0 + 8 * h + g;
        rows[mt][h] = (j < outs ? j : outs - 1) + (i64)mt * outs;
      } else {
        const i64 r = row0 + 16 * mt + 8 * h + g;
        rows[mt][h] = r < n ? r : n - 1;
      }
    }
  const kbf16* xrow[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int tk = 8 * nt + g;
    xrow[nt] = x + (i64)(tk < tokens ? tk : tokens - 1) * k + 4 * t;
  }
  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

  int u = warp;
  QskUnit cur[MT][2];
  // The shared-memory ring (the ring entries of every type but FP8, plain
  // and fused): P - 1 units per warp in flight through cp.async; see
  // QskSlot. The prologue runs while the first units travel.
  constexpr bool CPA = PF > 0 && Q != KQ_FP8;
  unsigned char* cring = reinterpret_cast<unsigned char*>(qsk_red) +
                         (size_t)warp * (PF > 0 ? PF : 1) * QskSlot<Q, MT>::bytes;
  if (CPA && w_const) {
#pragma unroll
    for (int i = 0; i < (PF > 0 ? PF : 1) - 1; ++i) {
      if (u + i * warps < units)
        qsk_cp_unit<Q, MT>(cring + i * QskSlot<Q, MT>::bytes, w, row0, n, act ? outs : 0, u + i * warps, k, lane, off1, off2, off3);
      kiln_cp_async_commit();
    }
  }
  if (!CPA && w_const && u < units) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) qsk_load<Q>(cur[mt][h], w, rows[mt][h], u, k, t, off1, off2, off3);
  }
  // FP8's ring (see the loop): its further slots, before the wait too.
  constexpr int P = PF > 0 ? PF : 1;
  QskUnit ring[P][MT][2];
  if (PF > 0 && Q == KQ_FP8 && !PRE && w_const)
    qsk_ring_fill<Q, MT, P>(ring, w, rows, u, warps, units, k, t, off1, off2, off3);
  KILN_PROLOGUE();
  // The prologue: every block computes each token row's inverse RMS itself
  // (x is L2-resident); each lane keeps its B rows' values.
  float inv[NT];
  if (PRE) {
    kiln_inv_rms_rows(x, tokens, k, eps, qsk_inv);
    __syncthreads();
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int tk = 8 * nt + g;
      inv[nt] = qsk_inv[tk < tokens ? tk : tokens - 1];
    }
  }
  const kbf16* nrow = norm_w + 4 * t;
  if (CPA && !w_const) {
#pragma unroll
    for (int i = 0; i < (PF > 0 ? PF : 1) - 1; ++i) {
      if (u + i * warps < units)
        qsk_cp_unit<Q, MT>(cring + i * QskSlot<Q, MT>::bytes, w, row0, n, act ? outs : 0, u + i * warps, k, lane, off1, off2, off3);
      kiln_cp_async_commit();
    }
  }
  if (!CPA && !w_const && u < units) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) qsk_load<Q>(cur[mt][h], w, rows[mt][h], u, k, t, off1, off2, off3);
  }
  if (PF > 0 && Q == KQ_FP8 && !PRE) {
    // FP8 (the plain entries): a ring of PF units per warp instead of one
    // in flight, unrolled so every slot is a fixed register set (slot i is
    // multiplied, then refilled with the unit PF * warps on; PF - 1 units'
    // loads stay in flight during each unit's MMA and no register copy
    // waits on a load). An FP8 unit is one step straight into acc, so the
    // sums are the plain loop's, in its order. An earlier form of this ring
    // measured on the H100 (bench/results/gpu-2026-12-06-s25/): Qwen3-4B
    // FP8 b8 5.221 -> 4.355 ms at PF 3; on Q4_K a ring of registers lost
    // (4.9 -> 5.2-5.4 ms), so the other types keep theirs in shared
    // memory (CPA above).
    if (!w_const) qsk_ring_fill<Q, MT, P>(ring, w, rows, u, warps, units, k, t, off1, off2, off3);
    // Slot 0 takes the unit already loaded (a copy that waits for it)
    // after slots 1.. are in flight.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) ring[0][mt][h] = cur[mt][h];
    for (int u0 = u; u0 < units; u0 += P * warps) {
#pragma unroll
      for (int i = 0; i < P; ++i) {
        const int uu = u0 + i * warps;
        if (uu >= units) break;  // uniform over the warp
        uint2 xb[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          xb[nt] = *reinterpret_cast<const uint2*>(xrow[nt] + (i64)uu * Qsk<Q>::epu);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          unsigned int a0, a1, a2, a3;
          qsk_codes<Q>(ring[i][mt][0], 0, t, a0, a2);
          qsk_codes<Q>(ring[i][mt][1], 0, t, a1, a3);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) qsk_mma(acc[mt][nt], a0, a1, a2, a3, xb[nt].x, xb[nt].y);
        }
        const int un = uu + P * warps;
        if (un < units) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              qsk_load<Q>(ring[i][mt][h], w, rows[mt][h], un, k, t, off1, off2, off3);
        }
      }
    }
    u = units;  // the plain loop below has nothing left
  }
  for (int it = 0; u < units; u += warps, ++it) {
    // The next unit's words and metadata, in flight during this one's MMAs.
    const int un = u + warps;
    QskUnit nxt[MT][2];
    if (CPA) {
      // This unit's slot has landed (at most P - 2 later groups pending);
      // after the warp barrier every lane is done with the slot read last
      // iteration, which takes the unit P - 1 on.
      constexpr int P2 = PF > 1 ? PF - 2 : 0;
      kiln_cp_async_wait<P2>();
      __syncwarp();
      const int uf = u + ((PF > 0 ? PF : 1) - 1) * warps;
      if (uf < units)
        qsk_cp_unit<Q, MT>(cring + ((it + (PF > 0 ? PF : 1) - 1) % (PF > 0 ? PF : 1)) * QskSlot<Q, MT>::bytes,
                        w, row0, n, act ? outs : 0, uf, k, lane, off1, off2, off3);
      kiln_cp_async_commit();
      qsk_slot_read<Q, MT>(cur, cring + (it % (PF > 0 ? PF : 1)) * QskSlot<Q, MT>::bytes, rows, w,
                           u, k, off1, g, t);
    } else if (un < units) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          qsk_load<Q>(nxt[mt][h], w, rows[mt][h], un, k, t, off1, off2, off3);
    }
    const i64 ubase = (i64)u * Qsk<Q>::epu;
#pragma unroll
    for (int j = 0; j < S / GS; ++j) {
      float ga[MT][NT][4];
      float gs[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          gs[nt][i] = 0.0f;
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) ga[mt][nt][i] = 0.0f;
        }
#pragma unroll
      for (int ss = 0; ss < GS; ++ss) {
        const int s = j * GS + ss;
        uint2 xb[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          xb[nt] = *reinterpret_cast<const uint2*>(xrow[nt] + ubase + 16 * s);
        if (PRE) {
          // The B fragments normalized as they are loaded: the lane's four
          // elements of the step times its token's inverse RMS and the
          // norm weight, rounded to bf16 (so the all-ones MMA below sums
          // the normalized x, as the min terms need).
          const uint2 nb = *reinterpret_cast<const uint2*>(nrow + ubase + 16 * s);
          const unsigned int nw[2] = {nb.x, nb.y};
          float wn[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float gv = __uint_as_float((nw[e / 2] >> (16 * (e % 2))) << 16);
            wn[e] = unit_offset ? 1.0f + gv : gv;
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const unsigned int xw[2] = {xb[nt].x, xb[nt].y};
            float f[4];
#pragma unroll
            for (int e = 0; e < 4; ++e)
              f[e] = __uint_as_float((xw[e / 2] >> (16 * (e % 2))) << 16) * inv[nt] * wn[e];
            xb[nt].x = qsk_pack_bf16(f[0], f[1]);
            xb[nt].y = qsk_pack_bf16(f[2], f[3]);
          }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          unsigned int a0, a1, a2, a3;
          qsk_codes<Q>(cur[mt][0], s, t, a0, a2);
          qsk_codes<Q>(cur[mt][1], s, t, a1, a3);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            float* dst = Q == KQ_FP8 ? acc[mt][nt] : ga[mt][nt];
            qsk_mma(dst, a0, a1, a2, a3, xb[nt].x, xb[nt].y);
          }
        }
        if (Qsk<Q>::has_min) {
          const unsigned int one = 0x3f803f80u;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) qsk_mma(gs[nt], one, one, one, one, xb[nt].x, xb[nt].y);
        }
      }
      if (Q != KQ_FP8) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float da, ma;
            qsk_scales<Q>(cur[mt][h], j, da, ma);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                float& a = acc[mt][nt][2 * h + e];
                a = fmaf(da, ga[mt][nt][2 * h + e], a);
                if (Qsk<Q>::has_min) a = fmaf(ma, gs[nt][2 * h + e], a);
              }
          }
      }
    }
    if (!CPA && un < units) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) cur[mt][h] = nxt[mt][h];
    }
  }
  if (CPA) {
    // The partials overwrite other warps' rings.
    kiln_cp_async_wait<0>();
    __syncthreads();
  }
  // Split-K reduction: every warp's partials to shared memory, then each
  // thread sums one (register, lane) slot over the warps in warp order.
  // Under act a thread takes a gate slot of tile 0 and the same slot of
  // tile 1 (the up row of the same output): both meet here.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        qsk_red[(warp * R + (mt * NT + nt) * 4 + i) * KILN_WARP + lane] = acc[mt][nt][i];
  __syncthreads();
  const int slots = act ? (R / 2) * KILN_WARP : R * KILN_WARP;
  for (int v = threadIdx.x; v < slots; v += blockDim.x) {
    float s = 0.0f;
    for (int q = 0; q < warps; ++q) s += qsk_red[q * R * KILN_WARP + v];
    const int i = v / KILN_WARP, ln = v % KILN_WARP;
    const int c = i & 3, nt = (i >> 2) % NT, mt = (i >> 2) / NT;
    const i64 row = row0 + 16 * mt + (ln >> 2) + 8 * (c >> 1);
    const int tok = 8 * nt + 2 * (ln & 3) + (c & 1);
    if (act) {
      float su = 0.0f;
      for (int q = 0; q < warps; ++q) su += qsk_red[q * R * KILN_WARP + (R / 2) * KILN_WARP + v];
      if (row < outs && tok < tokens)
        qsk_store_act<Q, O>(s, su, row, tok, outs, scale, bias, out, mode);
    } else if (row < n && tok < tokens) {
      qsk_store<Q, O>(s, row, tok, scale, bias, res, out, n);
    }
  }
#else
  // Portable path: one warp per (output row, token), lanes over the
  // elements; the prologue and the epilogues as on the MMA path.
  KILN_PROLOGUE();
  if (PRE) {
    kiln_inv_rms_rows(x, tokens, k, eps, qsk_inv);
    __syncthreads();
  }
  const int rows_here = act ? 16 : 16 * MT;
  for (int r = warp; r < rows_here; r += warps) {
    const i64 row = row0 + r;
    if (row >= outs) break;
    for (int tk = 0; tk < tokens; ++tk) {
      const kbf16* xr = x + (i64)tk * k;
      const float iv = PRE ? qsk_inv[tk] : 1.0f;
      float a = 0.0f, au = 0.0f;
      for (int e = lane; e < k; e += KILN_WARP) {
        const float xv = qsk_xn<PRE>(xr, norm_w, e, iv, unit_offset);
        a += xv * qsk_weight<Q>(w, row, e, k, off1, off2, off3);
        if (act) au += xv * qsk_weight<Q>(w, row + outs, e, k, off1, off2, off3);
      }
      a = warp_sum(a);
      if (act) au = warp_sum(au);
      if (lane == 0) {
        if (act) {
          qsk_store_act<Q, O>(a, au, row, tk, outs, scale, bias, out, mode);
        } else {
          qsk_store<Q, O>(a, row, tk, scale, bias, res, out, n);
        }
      }
    }
  }
#endif
}

#define KILN_QSKINNY(S, Q, O, OS, TP, MT)                                                      \
  KILN_GLOBAL void __launch_bounds__(512 / MT)                                                 \
      qskinny_##S##_t##TP##_r##MT##_bf16_##OS(                                                 \
          const kbf16* x, const unsigned char* w, const float* scale, const kbf16* bias,       \
          const kbf16* res, O* out, int tokens, int n, int k, int w_const, i64 off1, i64 off2, \
          i64 off3) {                                                                          \
    qskinny_gemm<Q, O, TP / 8, MT, 0, 0>(x, w, scale, bias, nullptr, res, out, tokens, n, k,   \
                                         w_const, off1, off2, off3, 0.0f, 0, KQSK_FUSED_NONE); \
  }
// The fused entries (fused_matmul): qskinny_fused_S_tTP_r2_bf16_bf16 (an
// activation epilogue without the prologue) and
// qskinny_fused_norm_S_tTP_rMT_bf16_OS (the RMSNorm prologue, any epilogue
// for bf16; f32 results only without one, which the lowering checks).
#define KILN_QSKINNY_FUSED(S, Q, O, OS, TP, MT, PRE, NAME)                                     \
  KILN_GLOBAL void __launch_bounds__(512 / MT)                                                 \
      NAME(const kbf16* x, const unsigned char* w, const float* scale, const kbf16* bias,      \
           const kbf16* norm_w, const kbf16* res, O* out, int tokens, int n, int k, int w_const, \
           i64 off1, i64 off2, i64 off3, float eps, int unit_offset, int mode) {               \
    qskinny_gemm<Q, O, TP / 8, MT, PRE, 1>(x, w, scale, bias, norm_w, res, out, tokens, n, k,  \
                                           w_const, off1, off2, off3, eps, unit_offset, mode);  \
  }
#define KILN_QSKINNY_FUSED_TP(S, Q, TP)                                                        \
  KILN_QSKINNY_FUSED(S, Q, kbf16, bf16, TP, 2, 0, qskinny_fused_##S##_t##TP##_r2_bf16_bf16)    \
  KILN_QSKINNY_FUSED(S, Q, kbf16, bf16, TP, 1, 1, qskinny_fused_norm_##S##_t##TP##_r1_bf16_bf16) \
  KILN_QSKINNY_FUSED(S, Q, kbf16, bf16, TP, 2, 1, qskinny_fused_norm_##S##_t##TP##_r2_bf16_bf16) \
  KILN_QSKINNY_FUSED(S, Q, float, f32, TP, 1, 1, qskinny_fused_norm_##S##_t##TP##_r1_bf16_f32) \
  KILN_QSKINNY_FUSED(S, Q, float, f32, TP, 2, 1, qskinny_fused_norm_##S##_t##TP##_r2_bf16_f32)
// Ring-prefetch variants of every type's eight-token, one-tile entries
// (FP8: a ring of registers; the others a ring in shared memory, QskSlot):
// PF units per warp in flight, qskinny_S_t8_r1_pfPF_bf16_OS, PF in 2, 3, 4
// (kiln_kernels::quant_gpu::skinny_prefetch picks the default depths).
#define KILN_QSKINNY_PF(S, Q, O, OS, PF)                                                       \
  KILN_GLOBAL void __launch_bounds__(512) qskinny_##S##_t8_r1_pf##PF##_bf16_##OS(              \
      const kbf16* x, const unsigned char* w, const float* scale, const kbf16* bias,           \
      const kbf16* res, O* out, int tokens, int n, int k, int w_const, i64 off1, i64 off2,     \
      i64 off3) {                                                                              \
    qskinny_gemm<Q, O, 1, 1, 0, 0, PF>(x, w, scale, bias, nullptr, res, out, tokens, n, k,     \
                                       w_const, off1, off2, off3, 0.0f, 0, KQSK_FUSED_NONE);   \
  }
// Ring variants of the fused entries an eight-token launch takes (the
// norm prologue's one-tile entries, the activation epilogue's two-tile
// ones), at the one depth kiln_kernels::quant_gpu::skinny_ring_depth gives
// the type's default (D: 3 for Q5_K and Q6_K, else 4): every type but FP8.
#define KILN_QSKINNY_FUSED_PF(S, Q, O, OS, MT, PRE, D, NAME)                                   \
  KILN_GLOBAL void __launch_bounds__(512 / MT)                                                 \
      NAME(const kbf16* x, const unsigned char* w, const float* scale, const kbf16* bias,      \
           const kbf16* norm_w, const kbf16* res, O* out, int tokens, int n, int k, int w_const, \
           i64 off1, i64 off2, i64 off3, float eps, int unit_offset, int mode) {               \
    qskinny_gemm<Q, O, 1, MT, PRE, 1, D>(x, w, scale, bias, norm_w, res, out, tokens, n, k,    \
                                         w_const, off1, off2, off3, eps, unit_offset, mode);    \
  }
#define KILN_QSKINNY_FUSED_PFS(S, Q, D)                                                        \
  KILN_QSKINNY_FUSED_PF(S, Q, kbf16, bf16, 2, 0, D, qskinny_fused_##S##_t8_r2_pf##D##_bf16_bf16) \
  KILN_QSKINNY_FUSED_PF(S, Q, kbf16, bf16, 1, 1, D,                                            \
                        qskinny_fused_norm_##S##_t8_r1_pf##D##_bf16_bf16)                      \
  KILN_QSKINNY_FUSED_PF(S, Q, kbf16, bf16, 2, 1, D,                                            \
                        qskinny_fused_norm_##S##_t8_r2_pf##D##_bf16_bf16)                      \
  KILN_QSKINNY_FUSED_PF(S, Q, float, f32, 1, 1, D, qskinny_fused_norm_##S##_t8_r1_pf##D##_bf16_f32)
#define KILN_QSKINNY_PFS(S, Q)                                                                 \
  KILN_QSKINNY_PF(S, Q, kbf16, bf16, 2) KILN_QSKINNY_PF(S, Q, kbf16, bf16, 3)                  \
  KILN_QSKINNY_PF(S, Q, kbf16, bf16, 4) KILN_QSKINNY_PF(S, Q, float, f32, 2)                   \
  KILN_QSKINNY_PF(S, Q, float, f32, 3) KILN_QSKINNY_PF(S, Q, float, f32, 4)
#define KILN_QSKINNY_TILES(S, Q, O, OS)                                                        \
  KILN_QSKINNY(S, Q, O, OS, 8, 1) KILN_QSKINNY(S, Q, O, OS, 16, 1)                             \
  KILN_QSKINNY(S, Q, O, OS, 24, 1) KILN_QSKINNY(S, Q, O, OS, 32, 1)                            \
  KILN_QSKINNY(S, Q, O, OS, 8, 2) KILN_QSKINNY(S, Q, O, OS, 16, 2)                             \
  KILN_QSKINNY(S, Q, O, OS, 24, 2) KILN_QSKINNY(S, Q, O, OS, 32, 2)
#define KILN_QSKINNY_TYPE(S, Q)                                                                \
  KILN_QSKINNY_TILES(S, Q, kbf16, bf16)                                                        \
  KILN_QSKINNY_TILES(S, Q, float, f32)                                                         \
  KILN_QSKINNY_FUSED_TP(S, Q, 8)                                                               \
  KILN_QSKINNY_FUSED_TP(S, Q, 16)                                                              \
  KILN_QSKINNY_FUSED_TP(S, Q, 24)                                                              \
  KILN_QSKINNY_FUSED_TP(S, Q, 32)                                                              \
  KILN_QSKINNY_PFS(S, Q)
KILN_QSKINNY_TYPE(q8_0, KQ_Q8_0)
KILN_QSKINNY_TYPE(q4_0, KQ_Q4_0)
KILN_QSKINNY_TYPE(q4_1, KQ_Q4_1)
KILN_QSKINNY_TYPE(q5_0, KQ_Q5_0)
KILN_QSKINNY_TYPE(q4k, KQ_Q4K)
KILN_QSKINNY_TYPE(q5k, KQ_Q5K)
KILN_QSKINNY_TYPE(q6k, KQ_Q6K)
KILN_QSKINNY_TYPE(fp8, KQ_FP8)
KILN_QSKINNY_FUSED_PFS(q8_0, KQ_Q8_0, 4)
KILN_QSKINNY_FUSED_PFS(q4_0, KQ_Q4_0, 4)
KILN_QSKINNY_FUSED_PFS(q4_1, KQ_Q4_1, 4)
KILN_QSKINNY_FUSED_PFS(q5_0, KQ_Q5_0, 4)
KILN_QSKINNY_FUSED_PFS(q4k, KQ_Q4K, 4)
KILN_QSKINNY_FUSED_PFS(q5k, KQ_Q5K, 3)
KILN_QSKINNY_FUSED_PFS(q6k, KQ_Q6K, 3)
