// Paged decode attention (GQA, causal query window, sliding window, softcap).
//
// Split-context ("flash decoding") in one launch:
//  1. paged_attn_part: grid (partition, (b*kvh + g)*tiles + tile). A block
//     takes P consecutive context positions of sequence b, one kv head g, and
//     a tile of RT query rows that read g (r = hi*Q + qi over the group's
//     heads hi and the Q query tokens), so each K/V row is read once for all
//     of them. It writes, per row, the partition's running max m, its sum of
//     exp l and its unnormalized sum of exp * V (f32) to scratch.
//  2. The last block of each (b, g, tile) to finish (a counter per
//     (b, g, tile), bumped after a memory fence) rescales the partitions to
//     the global max and writes the normalized output, rounded to T once,
//     then resets its counter to zero for the next launch.
//     On sm_90 with a cluster size (AttnShape::cluster) the partitions of
//     one cluster merge first, without scratch: a reduce-scatter through
//     distributed shared memory (attn_push and the cluster step in
//     attn_part). Each member stores each other member the slice of its
//     state that member merges, then arrives on that member's mbarrier;
//     each member waits for its own slices only. (The first form pulled
//     every member's slice with remote loads between two barriers over the
//     whole cluster; that cost about 3 us of a 8-10 us launch at batch 1,
//     bench/attn/ablate.sh.) Only when one context spans several clusters
//     do the merged slices go to scratch for the counter combine.
// Context lengths and block tables are read from device memory, so the grid
// is sized for the widest context (M * block_size) and blocks past a
// sequence's context return at once. Softmax is f32 throughout.
//
// Step 1 has two forms. paged_attn_stream_* (head_dim a multiple of 8, at
// most 256: every model kiln traces) streams K and V together with an
// online softmax in registers, and issues the loads the previous kernel
// cannot affect before its programmatic-dependent-launch wait (see
// attn_stream). paged_attn_part_* (any head_dim up to 1024) works in
// phases: scores to shared memory, softmax, then V.
#include "kiln_port.h"

#define KILN_ATTN_THREADS 128
// The most partitions one thread-block cluster combines (a non-portable
// cluster size beyond 8 on sm_90).
#define KILN_ATTN_MAX_CLUSTER 16
#define KILN_ATTN_WARPS (KILN_ATTN_THREADS / KILN_WARP)

// VEC consecutive elements of T as f32 (VEC = 8 needs 16-byte alignment).
template <int VEC>
KILN_DEV void load_vec(const kbf16* p, float* o) {
  if (VEC == 8) {
    unpack8(*reinterpret_cast<const uint4*>(p), p, o);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) o[k] = ld(p[k]);
  }
}
template <int VEC>
KILN_DEV void load_vec(const kf16* p, float* o) {
  if (VEC == 8) {
    unpack8(*reinterpret_cast<const uint4*>(p), p, o);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) o[k] = ld(p[k]);
  }
}
template <int VEC>
KILN_DEV void load_vec(const float* p, float* o) {
  if (VEC == 8) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
    o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) o[k] = p[k];
  }
}

// The tile's query rows into shared memory as f32 (zeros past the group).
template <typename T, int RT>
KILN_DEV void load_q_rows(const T* __restrict__ q, const int* rid, KilnDiv hd, float* qs) {
  for (int i = threadIdx.x; i < RT * hd.d; i += KILN_ATTN_THREADS) {
    const int j = i / hd, d = i % hd;
    qs[i] = rid[j] >= 0 ? ld(q[(i64)rid[j] * hd.d + d]) : 0.0f;
  }
}

// The cache slot of each of the partition's np positions from p0, read
// through the sequence's block table `bt`.
KILN_DEV void fill_slots(const int* __restrict__ bt, int p0, int np, KilnDiv block_size,
                         int* slot_of) {
  for (int x = threadIdx.x; x < np; x += KILN_ATTN_THREADS) {
    const int p = p0 + x;
    slot_of[x] = bt[p / block_size] * block_size.d + p % block_size;
  }
}

struct AttnShape {
  int batch, query, heads, kv_heads, head_dim, block_size, max_blocks;
  int window;     // 0: no sliding window
  float scale;
  float softcap;  // 0: no softcap
  int part_len;   // P: context positions per partition
  int num_parts;  // partitions the grid spans (ceil(M * block_size / P))
  int tiles;      // row tiles per (b, kv head)
  int tg;         // lanes that share one key in the q.k phase (power of two <= 32)
  int want_parts; // partitions a step's actual context is spread over (0: part_len fixed)
  int cluster;    // partitions per thread-block cluster (sm_90, streaming form); <= 1: none
};

// rope_attention: the query rows and the step's new K/V rows come from the
// packed qkv projection (per-head RMSNorm and RoPE applied here, exactly as
// qkv_rope_kv_write does, see kiln_rope_head), and the new K/V rows are
// written to their cache slots by this kernel.
// The by-value constants of a rope_attention launch (kiln_kernels::gpu
// writes this layout: num_slots, eps, has_norm, unit_offset, then the
// frequency table).
struct AttnRopeCfg {
  i64 num_slots;
  float eps;
  int has_norm, unit_offset;
  RopeFreqs fr;
};
template <typename T>
struct AttnRope {
  const T* qkv;     // [T][(heads + 2 kvh) hd]
  const int* pos;   // [T]
  const int* slots; // [T]
  const T* qn;      // [hd], or null without the q/k norm
  const T* kn;
  T* kc;            // the caches, written (the memory the kernel's kc/vc read)
  T* vc;
  const AttnRopeCfg* cfg;
};

template <typename T, int RT, int VEC>
KILN_DEV void attn_partition(const T* __restrict__ q, const T* __restrict__ kc,
                             const T* __restrict__ vc, const int* __restrict__ block_tables,
                             float* __restrict__ part_acc, float* __restrict__ part_ml,
                             const AttnShape& a, int b, int g, int part, int p0, int p1,
                             const int* rid, const int* qpos, i64 slot_stride, T* direct_out);

template <typename T, int RT, int KU>
KILN_DEV void attn_stream(const T* __restrict__ q, const T* __restrict__ kc,
                          const T* __restrict__ vc, const int* __restrict__ block_tables,
                          float* __restrict__ part_acc, float* __restrict__ part_ml,
                          const AttnShape& a, int b, int g, int part, int p0, int p1,
                          const int* rid, const int* qpos, i64 slot_stride, int new_from,
                          T* direct_out, float* cres, unsigned long long* cbar, int cmembers,
                          const AttnRope<T>* ar);

// The output row id of tile row r (< the group's rows) of sequence b and
// kv head g: ((b*Q + qi)*heads + h) with h = g*group + r/Q, qi = r%Q.
KILN_DEV i64 attn_row_id(const AttnShape& a, int b, int g, int r) {
  const KilnDiv qd = kiln_div(a.query);
  const int group = a.heads / kiln_div(a.kv_heads);
  return ((i64)b * a.query + r % qd) * a.heads + g * group + r / qd;
}

// The cluster combine's gather region, in every member's shared memory:
// [cm][per] floats of accumulator slices (per = ceil(RT*hd / cm): member t
// of the cm members holding context merges elements [t*per, (t+1)*per) of
// the tile's RT*hd outputs), then at RT*hd + KILN_ATTN_MAX_CLUSTER the (max,
// sum) pairs [cm][RT][2] of every member (kiln_kernels::gpu sizes it as
// RT*hd + MAX_CLUSTER*(1 + 2*RT) floats).
KILN_DEV int attn_gather_per(int elems, int cm) { return (elems + cm - 1) / cm; }

#if defined(KILN_CLUSTERS)
// A member's push (reduce-scatter): the threads are dealt out over the cm
// targets, tpb = threads / cm of them per target; they store the target's
// slice of this member's accumulators, value(i) for element i, and (one
// thread) this member's (max, sum) per row, row(j, 0) and row(j, 1), into
// the target's gather region as slot `crank`, then each arrives once on the
// target's mbarrier (release: its own stores are what it signals), so a
// target expects cm * tpb arrivals.
template <int RT, typename V, typename R>
KILN_DEV void attn_push(float* cres, unsigned long long* cbar, int crank, int cm, int elems,
                        V value, R row) {
  const int tpb = KILN_ATTN_THREADS / cm;
  const int tid = threadIdx.x;
  if (tid >= cm * tpb) return;
  const int t = tid / tpb, lt = tid - t * tpb;
  const int per = attn_gather_per(elems, cm);
  const int lo = t * per, hi = min(elems, lo + per);
  for (int i = lo + lt; i < hi; i += tpb)
    st_cluster(kiln_mapa(cres + crank * per + (i - lo), t), value(i));
  if (lt == 0) {
    float* ml = cres + elems + KILN_ATTN_MAX_CLUSTER + crank * RT * 2;
#pragma unroll
    for (int j = 0; j < RT; ++j) {
      st_cluster(kiln_mapa(ml + 2 * j, t), row(j, 0));
      st_cluster(kiln_mapa(ml + 2 * j + 1, t), row(j, 1));
    }
  }
  mbar_arrive_remote(kiln_mapa(cbar, t));
}
#endif

template <typename T, int RT, int VEC, bool STREAM, int KU = (RT <= 2 ? 8 : 4)>
KILN_DEV void attn_part(const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
                        const int* __restrict__ block_tables, const int* __restrict__ context_lens,
                        float* __restrict__ part_acc, float* __restrict__ part_ml,
                        unsigned int* __restrict__ counters, T* __restrict__ out,
                        const AttnShape& a, const AttnRope<T>* ar = nullptr) {
  // The streaming kernel waits for the kernel before it later, inside
  // attn_stream, after issuing the loads that kernel cannot affect.
  if (!STREAM) KILN_PROLOGUE();
  extern __shared__ float smem[];
  __shared__ int last_block;
  // This cluster member's mbarrier: the arrivals of every member's push
  // into its gather region (attn_push).
  __shared__ __align__(8) unsigned long long cbar;
  const int tid = threadIdx.x;
  const int part = blockIdx.x;
  const int tile = a.tiles == 1 ? 0 : blockIdx.y % a.tiles;
  const int bg = a.tiles == 1 ? blockIdx.y : blockIdx.y / a.tiles;
  const int b = bg / kiln_div(a.kv_heads);
  const int g = bg - b * a.kv_heads;
  const int group = a.heads / kiln_div(a.kv_heads);
  const int rows = group * a.query;  // query rows reading kv head g
  const int hd = a.head_dim;
  const KilnDiv hdd = kiln_div(hd);
  const int max_ctx = a.max_blocks * a.block_size;
  int ctx = context_lens[b];
  ctx = ctx < max_ctx ? ctx : max_ctx;
  // This step's partition length: the grid spans the widest context, but a
  // step's actual context is spread over want_parts partitions (the blocks
  // the chip needs), each at least one pass of the key loop (so no block
  // waits on a second round of K/V loads) and at most part_len (what the
  // shared memory and the scratch are sized for).
  int plen = a.part_len;
  if (a.want_parts > 0) {
    const int one_pass = KU * KILN_ATTN_WARPS * (KILN_WARP / a.tg);
    int dyn = (ctx + a.want_parts - 1) / a.want_parts;
    dyn = dyn > one_pass ? dyn : one_pass;
    dyn = (dyn + 15) & ~15;
    plen = dyn < plen ? dyn : plen;
  }
  const int p0 = part * plen;
  // Partitions per cluster: the partitions of one cluster combine through
  // distributed shared memory (see the cluster step below).
  int csize = 1;
#if defined(KILN_CLUSTERS)
  if (STREAM && a.cluster > 1) csize = a.cluster;
#endif
  // Partitions holding context positions; with one, the block normalizes
  // and writes the output itself (no scratch round trip, no combine).
  int nact = (ctx + plen - 1) / plen;
  // The cluster's members holding context (all of them but the last
  // cluster's tail) and this block's rank in it.
  const int crank = part & (csize - 1);
  const int cfirst = part & ~(csize - 1);  // csize: a power of two
  const int cmembers = min(csize, nact - cfirst);
  if (csize > 1) {
    // A whole cluster past the context leaves (the same test in all its
    // blocks). The others arrive on the cluster barrier first thing (a
    // member holding context after setting up its mbarrier) and wait on it
    // only before their first store into another member's shared memory.
    if (cfirst * plen >= ctx) return;
#if defined(KILN_CLUSTERS)
    if (p0 < ctx && tid == 0)
      mbar_init_cluster(&cbar, cmembers * (KILN_ATTN_THREADS / cmembers));
    cluster_arrive_relaxed();
#endif
    if (p0 >= ctx) return;  // an empty member: no one pushes to it or counts it
  } else if (p0 >= ctx) {
    return;  // the combine never reads this partition
  }
  const int p1 = min(p0 + plen, ctx);
  // The cluster combine's gather region (attn_gather_per), at the same
  // offset in every block.
  float* cres = csize > 1 ? smem + (RT * a.head_dim + a.part_len +
                                    KILN_ATTN_WARPS * RT * (a.head_dim + 2))
                          : nullptr;

  // Row j of this tile: r = tile*RT + j, head h = g*group + r/Q, query qi = r%Q.
  int rid[RT];    // output row id ((b*Q + qi)*heads + h), or -1 when past the group
  int qpos[RT];   // position of the query token
#pragma unroll
  for (int j = 0; j < RT; ++j) {
    const int r = tile * RT + j;
    if (r < rows) {
      const KilnDiv qd = kiln_div(a.query);
      const int qi = r % qd, h = g * group + r / qd;
      rid[j] = (b * a.query + qi) * a.heads + h;
      qpos[j] = ctx - a.query + qi;
    } else {
      rid[j] = -1;
      qpos[j] = -1;
    }
  }
  const i64 slot_stride = (i64)a.kv_heads * hd;

  // A partition wholly before every row's sliding window contributes
  // nothing; neither does an empty cluster member.
  bool skip = p1 <= p0;
  if (a.window > 0) {
    int lo = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < RT; ++j)
      if (rid[j] >= 0) lo = min(lo, qpos[j] - a.window + 1);
    skip = skip || p1 <= lo;
  }
  if (skip && cres != nullptr) {
    // Before every row's sliding window: an empty state (sum 0, zero
    // accumulators; the merging members give it weight 0).
    KILN_PROLOGUE();
#if defined(KILN_CLUSTERS)
    cluster_wait();
    attn_push<RT>(cres, &cbar, crank, cmembers, RT * hd, [](int) { return 0.0f; },
                  [](int, int k) { return k == 0 ? -KILN_INF : 0.0f; });
#endif
  } else if (skip) {
    if (STREAM) KILN_PROLOGUE();
    if (tid == 0) {
#pragma unroll
      for (int j = 0; j < RT; ++j) {
        if (rid[j] < 0) continue;
        float* ml = part_ml + ((i64)rid[j] * a.num_parts + part) * 2;
        ml[0] = -KILN_INF;
        ml[1] = 0.0f;
      }
    }
  } else {
    if (STREAM) {
      attn_stream<T, RT, KU>(q, kc, vc, block_tables, part_acc, part_ml, a, b, g, part, p0, p1, rid,
                         qpos, slot_stride, ctx - a.query,
                         nact == 1 && cres == nullptr ? out : nullptr, cres, &cbar, cmembers, ar);
    } else {
      attn_partition<T, RT, VEC>(q, kc, vc, block_tables, part_acc, part_ml, a, b, g, part, p0,
                                 p1, rid, qpos, slot_stride, nact == 1 ? out : nullptr);
    }
  }
  int ncount = nact;  // the blocks the completion count below waits for
#if defined(KILN_CLUSTERS)
  if (cres != nullptr) {
    // The cluster step (a reduce-scatter): every member holding context has
    // pushed each member its slice of its partition's state and its (max,
    // sum) per row (attn_push, at attn_stream's end or in the skip path
    // above). Each member waits for its own slices only (no barrier over the
    // whole cluster, no loads from another block), merges its slice of the
    // outputs from its own shared memory and writes it normalized when the
    // cluster holds the whole context; otherwise the merged slice goes to
    // scratch as partition `cidx` and the last block to finish combines the
    // clusters as below.
    mbar_wait_cluster(&cbar, 0);
    const int cidx = part / kiln_div(csize);
    const int ncl = (nact + csize - 1) / kiln_div(csize);
    const int elems = RT * hd, cm = cmembers;
    const int per = attn_gather_per(elems, cm);
    const float* cml = cres + elems + KILN_ATTN_MAX_CLUSTER;  // [cm][RT][2]
    // Per row, once: the members' weights exp(m_r - M) (0 for a member
    // that saw no visible position) and 1 / sum of weighted l; a warp per
    // row, a lane per member.
    float* cw = smem;                                  // [RT][KILN_ATTN_MAX_CLUSTER]
    float* crow = cw + RT * KILN_ATTN_MAX_CLUSTER;      // [RT]: (M, L)
    {
      const int lane = tid % KILN_WARP, warp = tid / KILN_WARP;
      for (int j = warp; j < RT; j += KILN_ATTN_WARPS) {
        float mr = -KILN_INF, lr = 0.0f;
        if (lane < cm) {
          mr = cml[(lane * RT + j) * 2];
          lr = cml[(lane * RT + j) * 2 + 1];
        }
        const float mm = warp_max(lr > 0.0f ? mr : -KILN_INF);
        const float w = lr > 0.0f ? expf(mr - mm) : 0.0f;
        const float ls = warp_sum(w * lr);
        if (lane < KILN_ATTN_MAX_CLUSTER) cw[j * KILN_ATTN_MAX_CLUSTER + lane] = w;
        if (lane == 0) {
          crow[2 * j] = mm;
          crow[2 * j + 1] = ls;
        }
      }
    }
    __syncthreads();
    const int lo = crank * per, hi = min(elems, lo + per);
    for (int i = lo + tid; i < hi; i += KILN_ATTN_THREADS) {
      const int j = i / hdd, d = i % hdd;
      if (tile * RT + j >= rows) continue;  // rid[j] < 0, without indexing rid at run time
      float sacc = 0.0f;
#pragma unroll
      for (int r = 0; r < KILN_ATTN_MAX_CLUSTER; ++r) {
        if (r < cm) {
          const float w = cw[j * KILN_ATTN_MAX_CLUSTER + r];
          sacc += w > 0.0f ? cres[r * per + (i - lo)] * w : 0.0f;
        }
      }
      const float mm = crow[2 * j], ls = crow[2 * j + 1];
      const i64 row = attn_row_id(a, b, g, tile * RT + j);
      if (ncl == 1) {
        out[row * hd + d] = st<T>(sacc * (ls > 0.0f ? 1.0f / ls : 0.0f));
      } else {
        part_acc[(row * a.num_parts + cidx) * hd + d] = sacc;
        if (d == 0) {
          float* ml = part_ml + (row * a.num_parts + cidx) * 2;
          ml[0] = mm;
          ml[1] = ls;
        }
      }
    }
    if (ncl == 1) return;
    nact = ncl;  // the cross-cluster combine below, over cluster states,
                 // once every member block (ncount of them) has written its slice
  } else
#endif
  if (nact == 1) return;  // written directly (a window-skipped lone partition is impossible:
                          // the last position is always visible to the last row)

  // Completion count: the last block of this (b, g, tile) combines.
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const unsigned int done = atomicAdd(&counters[blockIdx.y], 1u);
    last_block = done + 1 == (unsigned int)ncount;
  }
  __syncthreads();
  if (!last_block) return;
  if (tid == 0) counters[blockIdx.y] = 0;  // ready for the next launch
  // Combine: per row, partition weights w_p = exp(m_p - M) (0 where a
  // partition saw no visible position) into shared memory, then each output
  // element sums its partitions' accumulators (loads issued back to back).
  float* wts = smem;                // [RT][nact]
  float* inv_l = smem + RT * nact;  // [RT]
  const int lane = tid % KILN_WARP, warp = tid / KILN_WARP;
  for (int j = warp; j < RT; j += KILN_ATTN_WARPS) {
    if (rid[j] < 0) continue;
    const float* ml = part_ml + (i64)rid[j] * a.num_parts * 2;
    float m = -KILN_INF;
    for (int p = lane; p < nact; p += KILN_WARP)
      if (ld_cg(ml + 2 * p + 1) > 0.0f) m = fmaxf(m, ld_cg(ml + 2 * p));
    m = warp_max(m);
    float lsum = 0.0f;
    for (int p = lane; p < nact; p += KILN_WARP) {
      const float l = ld_cg(ml + 2 * p + 1);
      const float w = l > 0.0f ? expf(ld_cg(ml + 2 * p) - m) : 0.0f;
      wts[j * nact + p] = w;
      lsum += w * l;
    }
    lsum = warp_sum(lsum);
    if (lane == 0) inv_l[j] = lsum > 0.0f ? 1.0f / lsum : 0.0f;
  }
  __syncthreads();
  for (int i = tid; i < RT * hd; i += KILN_ATTN_THREADS) {
    const int j = i / hdd, d = i % hdd;
    if (rid[j] < 0) continue;
    const float* acc = part_acc + (i64)rid[j] * a.num_parts * hd + d;
    const float* wr = wts + j * nact;
    float sacc = 0.0f;
#pragma unroll 4
    for (int p = 0; p < nact; ++p) {
      const float v = ld_cg(acc + (i64)p * hd);  // unconditional: keeps loads in flight
      const float w = wr[p];
      sacc += w > 0.0f ? v * w : 0.0f;
    }
    out[(i64)rid[j] * hd + d] = st<T>(sacc * inv_l[j]);
  }
}

// The work of one partition (scores, softmax, weighted V) for the rows of
// one tile; writes the partition's (max, sum) and accumulator per row.
template <typename T, int RT, int VEC>
KILN_DEV void attn_partition(const T* __restrict__ q, const T* __restrict__ kc,
                             const T* __restrict__ vc, const int* __restrict__ block_tables,
                             float* __restrict__ part_acc, float* __restrict__ part_ml,
                             const AttnShape& a, int b, int g, int part, int p0, int p1,
                             const int* rid, const int* qpos, i64 slot_stride, T* direct_out) {
  extern __shared__ float smem[];
  __shared__ float row_l[RT];  // each row's sum of exp, for the direct write
  const int tid = threadIdx.x;
  const int hd = a.head_dim;
  const int np = p1 - p0;
  float* qs = smem;                       // [RT][hd]
  float* sc = smem + RT * hd;             // [RT][P]
  int* slot_of = (int*)(sc + RT * a.part_len);  // [P]: cache slot of each position
  const int* bt = block_tables + (i64)b * a.max_blocks;
  load_q_rows<T, RT>(q, rid, kiln_div(hd), qs);
  fill_slots(bt, p0, np, kiln_div(a.block_size), slot_of);
  __syncthreads();

  // Scores. tg lanes share a key (each lane VEC elements of the chunks it
  // owns); a lane group takes KU keys per iteration and issues all their
  // loads before using any, so enough bytes are in flight per SM.
  constexpr int KU = RT <= 2 ? 8 : 4;
  const int lane = tid % KILN_WARP, warp = tid / KILN_WARP;
  const int tg = a.tg, lig = lane % tg, kslot = lane / tg, kpw = KILN_WARP / tg;
  const int nch = hd / VEC;
  const T* kbase = kc + (i64)g * hd;
  for (int pb = p0 + warp * kpw * KU; pb < p1; pb += KILN_ATTN_WARPS * kpw * KU) {
    float dot[KU][RT];
#pragma unroll
    for (int u = 0; u < KU; ++u)
#pragma unroll
      for (int j = 0; j < RT; ++j) dot[u][j] = 0.0f;
    for (int c = lig; c < nch; c += tg) {
      float kv[KU][VEC];
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        const int p = pb + u * kpw + kslot;
        if (p < p1) {
          load_vec<VEC>(kbase + (i64)slot_of[p - p0] * slot_stride + c * VEC, kv[u]);
        } else {
#pragma unroll
          for (int k = 0; k < VEC; ++k) kv[u][k] = 0.0f;
        }
      }
#pragma unroll
      for (int j = 0; j < RT; ++j) {
        const float* qr = qs + j * hd + c * VEC;
        float qv[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) qv[k] = qr[k];
#pragma unroll
        for (int u = 0; u < KU; ++u)
#pragma unroll
          for (int k = 0; k < VEC; ++k) dot[u][j] += qv[k] * kv[u][k];
      }
    }
#pragma unroll
    for (int u = 0; u < KU; ++u)
#pragma unroll
      for (int j = 0; j < RT; ++j)
        for (int m = tg / 2; m > 0; m >>= 1) dot[u][j] += shfl_xor(dot[u][j], m);
    if (lig == 0) {
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        const int p = pb + u * kpw + kslot;
        if (p >= p1) continue;
#pragma unroll
        for (int j = 0; j < RT; ++j) {
          float s = dot[u][j] * a.scale;
          if (a.softcap > 0.0f) s = a.softcap * tanhf(s / a.softcap);
          const bool vis =
              rid[j] >= 0 && p <= qpos[j] && (a.window <= 0 || p > qpos[j] - a.window);
          sc[j * a.part_len + (p - p0)] = vis ? s : -KILN_INF;
        }
      }
    }
  }
  __syncthreads();

  // Softmax over the partition, one warp per row.
  for (int j = warp; j < RT; j += KILN_ATTN_WARPS) {
    float* sr = sc + j * a.part_len;
    float m = -KILN_INF;
    for (int x = lane; x < np; x += KILN_WARP) m = fmaxf(m, sr[x]);
    m = warp_max(m);
    float l = 0.0f;
    for (int x = lane; x < np; x += KILN_WARP) {
      const float e = m == -KILN_INF ? 0.0f : expf(sr[x] - m);
      sr[x] = e;
      l += e;
    }
    l = warp_sum(l);
    if (lane == 0) row_l[j] = l;
    if (lane == 0 && rid[j] >= 0) {
      float* ml = part_ml + ((i64)rid[j] * a.num_parts + part) * 2;
      ml[0] = m;
      ml[1] = l;
    }
  }
  __syncthreads();

  // Weighted sum of V: thread = (chunk c, position lane pl); VU positions
  // per iteration, loads first.
  constexpr int VU = RT <= 2 ? 8 : 4;
  const int c = tid % nch, pl = tid / nch, npl = KILN_ATTN_THREADS / nch;
  float acc[RT][VEC];
#pragma unroll
  for (int j = 0; j < RT; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[j][k] = 0.0f;
  const T* vbase = vc + (i64)g * hd + c * VEC;
  if (pl < npl) {
    for (int x0 = pl; x0 < np; x0 += npl * VU) {
      float vv[VU][VEC];
#pragma unroll
      for (int u = 0; u < VU; ++u) {
        const int x = x0 + u * npl;
        if (x < np) {
          load_vec<VEC>(vbase + (i64)slot_of[x] * slot_stride, vv[u]);
        } else {
#pragma unroll
          for (int k = 0; k < VEC; ++k) vv[u][k] = 0.0f;
        }
      }
#pragma unroll
      for (int u = 0; u < VU; ++u) {
        const int x = x0 + u * npl;
        if (x >= np) continue;
#pragma unroll
        for (int j = 0; j < RT; ++j) {
          const float e = sc[j * a.part_len + x];
#pragma unroll
          for (int k = 0; k < VEC; ++k) acc[j][k] += e * vv[u][k];
        }
      }
    }
  }
  __syncthreads();  // scores are dead; reuse shared memory for the reduction
  float* red = smem;  // [npl][RT][hd]
  if (pl < npl) {
#pragma unroll
    for (int j = 0; j < RT; ++j)
#pragma unroll
      for (int k = 0; k < VEC; ++k) red[((i64)pl * RT + j) * hd + c * VEC + k] = acc[j][k];
  }
  __syncthreads();
  for (int i = tid; i < RT * hd; i += KILN_ATTN_THREADS) {
    const int j = i / kiln_div(hd), d = i % kiln_div(hd);
    if (rid[j] < 0) continue;
    float s = 0.0f;
    for (int x = 0; x < npl; ++x) s += red[((i64)x * RT + j) * hd + d];
    if (direct_out != nullptr) {
      // The combine's arithmetic for one partition (weight exp(0) = 1), so
      // both paths round the same.
      const float l = row_l[j];
      direct_out[(i64)rid[j] * hd + d] = st<T>(s * (l > 0.0f ? 1.0f / l : 0.0f));
    } else {
      part_acc[((i64)rid[j] * a.num_parts + part) * hd + d] = s;
    }
  }
}

// Eight consecutive elements of T as loaded (16 bytes for bf16/f16, 32 for
// f32), kept packed in registers until used.
template <typename T>
struct Raw8 {
  uint4 u[sizeof(T) / 2];
};
template <typename T>
KILN_DEV Raw8<T> load_raw8(const T* p) {
  Raw8<T> r;
  const uint4* s = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < (int)(sizeof(T) / 2); ++i) r.u[i] = s[i];
  return r;
}
template <typename T>
KILN_DEV Raw8<T> zero_raw8() {
  Raw8<T> r;
#pragma unroll
  for (int i = 0; i < (int)(sizeof(T) / 2); ++i) r.u[i] = make_uint4(0u, 0u, 0u, 0u);
  return r;
}
KILN_DEV void unraw8(const Raw8<kbf16>& r, float* o) {
  unpack8(r.u[0], (const kbf16*)nullptr, o);
}
KILN_DEV void unraw8(const Raw8<kf16>& r, float* o) { unpack8(r.u[0], (const kf16*)nullptr, o); }
KILN_DEV void unraw8(const Raw8<float>& r, float* o) {
  const unsigned int w[8] = {r.u[0].x, r.u[0].y, r.u[0].z, r.u[0].w,
                             r.u[1].x, r.u[1].y, r.u[1].z, r.u[1].w};
#pragma unroll
  for (int k = 0; k < 8; ++k) o[k] = kiln_u2f(w[k]);
}

// One key's K and V chunks (same slot offset), loads issued together.
template <typename T>
KILN_DEV void load_kv(const T* kbase, const T* vbase, i64 off, Raw8<T>& k, Raw8<T>& v) {
  k = load_raw8(kbase + off);
  v = load_raw8(vbase + off);
}

// rope_attention's prologue (after the dependency wait): the block's RT
// query rows, normed and roped, into qs as f32 (each rounded to T, as the
// unfused op stores q; rows past the group are zeros, as load_q_rows
// leaves them), and its partition's nnew new positions (nfirst.., the
// sequence's tokens from old_end) of kv head g: K normed and roped, V as
// projected, into nks/nvs ([nnew][hd] of T) and to the cache slot
// slots[t] of their token (skipped outside [0, num_slots), as
// qkv_rope_kv_write does). A warp per row; each item is one head.
template <typename T, int RT>
KILN_DEV void attn_rope_rows(const AttnRope<T>& r, const AttnShape& a, int b, int g,
                             const int* rid, float* qs, int nfirst, int nnew, int old_end,
                             T* nks, T* nvs) {
  const int hd = a.head_dim;
  const int units = a.heads + 2 * a.kv_heads;
  const KilnDiv heads = kiln_div(a.heads);
  const int lane = threadIdx.x % KILN_WARP, warp = threadIdx.x / KILN_WARP;
  nnew = max(nnew, 0);
  const int items = RT + 2 * nnew;
  const i64 kvrow = (i64)a.kv_heads * hd;
  for (int it = warp; it < items; it += KILN_ATTN_WARPS) {
    if (it < RT) {
      float* dst = qs + it * hd;
      const int id = rid[it];
      if (id < 0) {
        for (int i = lane; i < hd; i += KILN_WARP) dst[i] = 0.0f;
        continue;
      }
      const int t = id / heads, h = id % heads;
      const T* src = r.qkv + ((i64)t * units + h) * hd;
      kiln_rope_head<T>(src, hd, r.qn, r.cfg->has_norm, r.cfg->eps, r.cfg->unit_offset, (float)r.pos[t], r.cfg->fr,
                        [&](int i, T v) { dst[i] = ld(v); });
      continue;
    }
    const int k = it - RT;
    const bool is_v = k >= nnew;
    const int n = is_v ? k - nnew : k;
    const int t = b * a.query + (nfirst + n - old_end);
    const i64 slot = r.slots[t];
    const bool keep = slot >= 0 && slot < r.cfg->num_slots;
    if (is_v) {
      const T* src = r.qkv + ((i64)t * units + a.heads + a.kv_heads + g) * hd;
      T* sv = nvs + n * hd;
      T* cv = r.vc + slot * kvrow + (i64)g * hd;
      for (int i = lane; i < hd; i += KILN_WARP) {
        const T v = src[i];
        sv[i] = v;
        if (keep) cv[i] = v;
      }
    } else {
      const T* src = r.qkv + ((i64)t * units + a.heads + g) * hd;
      T* sk = nks + n * hd;
      T* ck = r.kc + slot * kvrow + (i64)g * hd;
      kiln_rope_head<T>(src, hd, r.kn, r.cfg->has_norm, r.cfg->eps, r.cfg->unit_offset, (float)r.pos[t], r.cfg->fr,
                        [&](int i, T v) {
                          sk[i] = v;
                          if (keep) ck[i] = v;
                        });
    }
  }
}

// The streaming form of one partition, for head_dim a multiple of 8 and at
// most 256 (one 8-element chunk per lane; the catalog picks it then).
// Groups of tg lanes own one key each; every lane issues the K and the V
// loads of its KU keys together (one DRAM round trip per KU keys, not one
// for K and another for V), and keeps an online softmax (running max m,
// sum l, unnormalized accumulator) per row in registers. Keys are dealt
// out interleaved (key = base + u * keys_per_pass + group), so a short
// partition still keeps every warp busy. At the end the lane groups of a
// warp merge by shuffles and the warps through shared memory.
template <typename T, int RT, int KU>
KILN_DEV void attn_stream(const T* __restrict__ q, const T* __restrict__ kc,
                          const T* __restrict__ vc, const int* __restrict__ block_tables,
                          float* __restrict__ part_acc, float* __restrict__ part_ml,
                          const AttnShape& a, int b, int g, int part, int p0, int p1,
                          const int* rid, const int* qpos, i64 slot_stride, int new_from,
                          T* direct_out, float* cres, unsigned long long* cbar, int cmembers,
                          const AttnRope<T>* ar) {
  extern __shared__ float smem[];
  const int tid = threadIdx.x;
  const int hd = a.head_dim;
  const int np = p1 - p0;
  float* qs = smem;                                   // [RT][hd]
  int* slot_of = (int*)(qs + RT * hd);                // [part_len]
  float* wacc = (float*)(slot_of + a.part_len);       // [warps][RT][hd]
  float* wml = wacc + KILN_ATTN_WARPS * RT * hd;      // [warps][RT][2]
  const int* bt = block_tables + (i64)b * a.max_blocks;
  // Before the dependency wait (programmatic dependent launch, sm_90): only
  // what the kernel before this one cannot have written. Block tables and
  // context lengths are step inputs, staged before the step's first
  // kernel; K/V rows of positions before this step's tokens (p < ctx -
  // query) were written by earlier steps. The kernel before attention
  // writes q and the new tokens' K/V, so those are loaded after the wait.
  // Nothing is written before it.
  fill_slots(bt, p0, np, kiln_div(a.block_size), slot_of);
  __syncthreads();

  // KU: keys per lane group per pass (a template parameter, so shorter
  // partitions can use fewer and leave more blocks to the chip).
  const int lane = tid % KILN_WARP, warp = tid / KILN_WARP;
  const int tg = a.tg, lig = lane % tg, kslot = lane / tg, kpw = KILN_WARP / tg;
  const int nch = hd / 8;
  const bool active = lig < nch;
  const int c = active ? lig : 0;
  const int per_pass = KILN_ATTN_WARPS * kpw;  // keys one unrolled step covers per u
  const int me = warp * kpw + kslot;
  const int old_end = new_from;  // positions >= this one are written by this step
  const T* kbase = kc + (i64)g * hd + c * 8;
  const T* vbase = vc + (i64)g * hd + c * 8;
  float m[RT], l[RT], acc[RT][8];
#pragma unroll
  for (int j = 0; j < RT; ++j) {
    m[j] = -KILN_INF;
    l[j] = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[j][k] = 0.0f;
  }
  Raw8<T> kr[KU], vr[KU];
#pragma unroll
  for (int u = 0; u < KU; ++u) {
    const int p = p0 + u * per_pass + me;
    if (active && p < p1 && p < old_end) {
      load_kv(kbase, vbase, (i64)slot_of[p - p0] * slot_stride, kr[u], vr[u]);
    } else {
      kr[u] = zero_raw8<T>();
      vr[u] = zero_raw8<T>();
    }
  }
  KILN_PROLOGUE();
  // rope_attention: this partition's new positions [nfirst, p1) as computed
  // here, in shared memory after the cluster state region ([query][hd] K,
  // then V, in T), so the block never reads back what it wrote to the cache.
  const bool roped = ar != nullptr;
  const int nfirst = max(p0, old_end);
  // (kiln_kernels::gpu::rope_attention_shared_bytes sizes it the same way.)
  int roff = RT * hd + a.part_len + KILN_ATTN_WARPS * RT * (hd + 2) +
             (a.cluster > 1 ? RT * hd + KILN_ATTN_MAX_CLUSTER * (1 + 2 * RT) : 0);
  roff = (roff + 7) & ~7;  // 32-byte aligned rows
  T* nks = reinterpret_cast<T*>(smem + roff);
  T* nvs = nks + a.query * hd;
  if (roped) {
    attn_rope_rows<T, RT>(*ar, a, b, g, rid, qs, nfirst, p1 - nfirst, old_end, nks, nvs);
    __syncthreads();
  } else {
    load_q_rows<T, RT>(q, rid, kiln_div(hd), qs);
  }
#pragma unroll
  for (int u = 0; u < KU; ++u) {
    const int p = p0 + u * per_pass + me;
    if (active && p < p1 && p >= old_end) {
      if (roped) {
        load_kv(nks + c * 8, nvs + c * 8, (i64)(p - nfirst) * hd, kr[u], vr[u]);
      } else {
        load_kv(kbase, vbase, (i64)slot_of[p - p0] * slot_stride, kr[u], vr[u]);
      }
    }
  }
  __syncthreads();

  for (int pb = p0; pb < p1; pb += per_pass * KU) {
    if (pb != p0) {
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        const int p = pb + u * per_pass + me;
        if (active && p < p1 && roped && p >= old_end) {
          load_kv(nks + c * 8, nvs + c * 8, (i64)(p - nfirst) * hd, kr[u], vr[u]);
        } else if (active && p < p1) {
          load_kv(kbase, vbase, (i64)slot_of[p - p0] * slot_stride, kr[u], vr[u]);
        } else {
          kr[u] = zero_raw8<T>();
          vr[u] = zero_raw8<T>();
        }
      }
    }
    float s[KU][RT];
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      float kf[8];
      unraw8(kr[u], kf);
#pragma unroll
      for (int j = 0; j < RT; ++j) {
        const float* qr = qs + j * hd + c * 8;
        float d = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; ++k) d += qr[k] * kf[k];
        s[u][j] = active ? d : 0.0f;
      }
    }
    // Sum each key's dot product over its lane group: the steps unrolled
    // with every (key, row) inside, so the shuffles of different keys
    // overlap. Keys past the partition (the same for the whole warp) are
    // skipped.
#pragma unroll
    for (int mk = KILN_WARP / 2; mk > 0; mk >>= 1) {
      if (mk < tg) {
#pragma unroll
        for (int u = 0; u < KU; ++u) {
          if (pb + u * per_pass < p1) {
#pragma unroll
            for (int j = 0; j < RT; ++j) s[u][j] += shfl_xor(s[u][j], mk);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < KU; ++u) {
      const int p = pb + u * per_pass + me;
#pragma unroll
      for (int j = 0; j < RT; ++j) {
        float x = s[u][j] * a.scale;
        if (a.softcap > 0.0f) x = a.softcap * tanhf(x / a.softcap);
        const bool vis = p < p1 && rid[j] >= 0 && p <= qpos[j] &&
                         (a.window <= 0 || p > qpos[j] - a.window);
        s[u][j] = vis ? x : -KILN_INF;
      }
    }
    float vf[KU][8];
#pragma unroll
    for (int u = 0; u < KU; ++u) unraw8(vr[u], vf[u]);
#pragma unroll
    for (int j = 0; j < RT; ++j) {
      float mx = m[j];
#pragma unroll
      for (int u = 0; u < KU; ++u) mx = fmaxf(mx, s[u][j]);
      if (mx != -KILN_INF) {
        const float corr = m[j] == -KILN_INF ? 0.0f : expf(m[j] - mx);
        l[j] *= corr;
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[j][k] *= corr;
#pragma unroll
        for (int u = 0; u < KU; ++u) {
          if (pb + u * per_pass >= p1) continue;  // past the partition, whole warp
          const float e = expf(s[u][j] - mx);     // exp(-inf) = 0: invisible keys add nothing
          l[j] += e;
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[j][k] += e * vf[u][k];
        }
        m[j] = mx;
      }
    }
  }
  // Lane groups of a warp: each rescales its state to the warp's max (one
  // exp per row), then the states add up by shuffles (every lane takes
  // part).
  if (tg < KILN_WARP) {
#pragma unroll
    for (int j = 0; j < RT; ++j) {
      float mw = m[j];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
        if (off >= tg) mw = fmaxf(mw, shfl_xor(mw, off));
      const float corr = m[j] == -KILN_INF ? 0.0f : expf(m[j] - mw);
      l[j] *= corr;
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[j][k] *= corr;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        if (off >= tg) {
          l[j] += shfl_xor(l[j], off);
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[j][k] += shfl_xor(acc[j][k], off);
        }
      }
      m[j] = mw;
    }
  }
  if (kslot == 0) {
#pragma unroll
    for (int j = 0; j < RT; ++j) {
      if (lig < nch) {
#pragma unroll
        for (int k = 0; k < 8; ++k) wacc[(warp * RT + j) * hd + c * 8 + k] = acc[j][k];
      }
      if (lane == 0) {
        wml[(warp * RT + j) * 2] = m[j];
        wml[(warp * RT + j) * 2 + 1] = l[j];
      }
    }
  }
  __syncthreads();
  // Warps: per row, once, the warps' weights exp(m_w - M) and the sum of
  // weighted l (in the dead q rows); then one output element per thread.
  float* wwt = qs;                            // [RT][warps]
  float* wrow = qs + RT * KILN_ATTN_WARPS;    // [RT]: (M, L)
  if (tid < RT) {
    const int j = tid;
    float mm = -KILN_INF;
#pragma unroll
    for (int w = 0; w < KILN_ATTN_WARPS; ++w) mm = fmaxf(mm, wml[(w * RT + j) * 2]);
    float ls = 0.0f;
#pragma unroll
    for (int w = 0; w < KILN_ATTN_WARPS; ++w) {
      const float mw = wml[(w * RT + j) * 2];
      const float e = mw == -KILN_INF ? 0.0f : expf(mw - mm);
      wwt[j * KILN_ATTN_WARPS + w] = e;
      ls += wml[(w * RT + j) * 2 + 1] * e;
    }
    wrow[2 * j] = mm;
    wrow[2 * j + 1] = ls;
  }
  __syncthreads();
  const KilnDiv hdd = kiln_div(hd);
#if defined(KILN_CLUSTERS)
  if (cres != nullptr) {
    // A cluster member pushes its state's slices to the members (see
    // attn_push) once every block of the cluster has arrived on the
    // cluster barrier (so every member's mbarrier is set up).
    cluster_wait();
    const int crank = part & (a.cluster - 1);
    attn_push<RT>(
        cres, cbar, crank, cmembers, RT * hd,
        [&](int i) {
          const int j = i / hdd, d = i % hdd;
          float s = 0.0f;
#pragma unroll
          for (int w = 0; w < KILN_ATTN_WARPS; ++w)
            s += wacc[(w * RT + j) * hd + d] * wwt[j * KILN_ATTN_WARPS + w];
          return s;
        },
        [&](int j, int k) { return wrow[2 * j + k]; });
    return;
  }
#endif
  for (int i = tid; i < RT * hd; i += KILN_ATTN_THREADS) {
    const int j = i / hdd, d = i % hdd;
    if (rid[j] < 0) continue;
    const float mm = wrow[2 * j], ls = wrow[2 * j + 1];
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < KILN_ATTN_WARPS; ++w)
      s += wacc[(w * RT + j) * hd + d] * wwt[j * KILN_ATTN_WARPS + w];
    if (direct_out != nullptr) {
      // The combine's arithmetic for one partition (weight exp(0) = 1).
      direct_out[(i64)rid[j] * hd + d] = st<T>(s * (ls > 0.0f ? 1.0f / ls : 0.0f));
    } else {
      part_acc[((i64)rid[j] * a.num_parts + part) * hd + d] = s;
      if (d == 0) {
        float* ml = part_ml + ((i64)rid[j] * a.num_parts + part) * 2;
        ml[0] = mm;
        ml[1] = ls;
      }
    }
  }
}

#define KILN_ATTN_PART(T, S, RT, VEC)                                                          \
  KILN_GLOBAL void __launch_bounds__(KILN_ATTN_THREADS)                                        \
      paged_attn_part_r##RT##_v##VEC##_##S(const T* q, const T* kc, const T* vc,               \
                                           const int* block_tables, const int* context_lens,   \
                                           float* part_acc, float* part_ml,                    \
                                           unsigned int* counters, T* out, AttnShape a) {      \
    attn_part<T, RT, VEC, false>(q, kc, vc, block_tables, context_lens, part_acc, part_ml,    \
                                 counters, out, a);                                            \
  }
#define KILN_ATTN_STREAM(T, S, RT)                                                             \
  KILN_GLOBAL void __launch_bounds__(KILN_ATTN_THREADS)                                        \
      paged_attn_stream_r##RT##_##S(const T* q, const T* kc, const T* vc,                      \
                                    const int* block_tables, const int* context_lens,          \
                                    float* part_acc, float* part_ml, unsigned int* counters,   \
                                    T* out, AttnShape a) {                                     \
    attn_part<T, RT, 8, true>(q, kc, vc, block_tables, context_lens, part_acc, part_ml,        \
                              counters, out, a);                                               \
  }
#define KILN_ATTN_ROPE_STREAM(T, S, RT)                                                        \
  KILN_GLOBAL void __launch_bounds__(KILN_ATTN_THREADS) paged_attn_rope_stream_r##RT##_##S(      \
      const T* qkv, const int* pos, const int* slots, T* kc, T* vc, const int* block_tables,    \
      const int* context_lens, const T* qn, const T* kn, float* part_acc, float* part_ml,       \
      unsigned int* counters, T* out, AttnShape a, AttnRopeCfg cfg) {                           \
    const AttnRope<T> ar = {qkv, pos, slots, qn, kn, kc, vc, &cfg};                             \
    attn_part<T, RT, 8, true>(nullptr, kc, vc, block_tables, context_lens, part_acc, part_ml,   \
                              counters, out, a, &ar);                                           \
  }
#define KILN_ATTN_ENTRIES(T, S)                                                                \
  KILN_ATTN_PART(T, S, 1, 8)                                                                   \
  KILN_ATTN_PART(T, S, 2, 8)                                                                   \
  KILN_ATTN_PART(T, S, 4, 8)                                                                   \
  KILN_ATTN_PART(T, S, 8, 8)                                                                   \
  KILN_ATTN_PART(T, S, 1, 1)                                                                   \
  KILN_ATTN_PART(T, S, 2, 1)                                                                   \
  KILN_ATTN_PART(T, S, 4, 1)                                                                   \
  KILN_ATTN_PART(T, S, 8, 1)                                                                   \
  KILN_ATTN_STREAM(T, S, 1)                                                                    \
  KILN_ATTN_STREAM(T, S, 2)                                                                    \
  KILN_ATTN_STREAM(T, S, 4)                                                                    \
  KILN_ATTN_STREAM(T, S, 8)                                                                    \
  KILN_ATTN_ROPE_STREAM(T, S, 1)                                                               \
  KILN_ATTN_ROPE_STREAM(T, S, 2)                                                               \
  KILN_ATTN_ROPE_STREAM(T, S, 4)                                                               \
  KILN_ATTN_ROPE_STREAM(T, S, 8)
KILN_FOR_FLOATS(KILN_ATTN_ENTRIES)
