//! lum/benchmarks/o_combine_probe.cu — the kernels of benchmarks/o_combine_probe.py (pasted after
//! templates/common.cuh and benchmarks/probe.cuh; lum's own combine and o kernels come after them).
//!
//! Decode attention leaves, per query head h (8) and chunk j (ns), the partials [acc[0..256), c, l] (f32,
//! [heads][ns][258]); lum combines them in a kernel of their own (a reduce, 2,048 rows) whose bf16 output A
//! is o's input (a GEMV over W [2,560][2,048] bf16). probe_o_combine does both in one launch, split by head:
//! a thread block cluster of 8 blocks (block rank h) owns 64 output columns; block h copies its head's
//! 64 × 256 weights into shared memory before its wait, then loads head h's partials (a round of loads for up
//! to 16 chunks), combines its 256 values of A, dots them with its weights, and the cluster sums the 8 heads'
//! column partials through distributed shared memory in a fixed order (or, ``variant`` 3, adds them into the
//! output with fire-and-forget atomics).

// %globaltimer in ns (the stand-ins' clock).
__device__ __forceinline__ unsigned long long probe_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// What the attention kernel is to the chain, without its work: it waits for the kernel before, lets the
// next launch after `stage_ns` (lum's attention triggers after its stage) and ends after `total_ns`; its
// first block zeroes `zero[0 .. nz)` (the fused kernel's atomic mode adds into it).
extern "C" __global__ void probe_attention_standin(long long stage_ns, long long total_ns, float* zero, int nz) {
  lum_pdl_wait();
  if (blockIdx.x == 0)
    for (int i = (int)threadIdx.x; i < nz; i += (int)blockDim.x) zero[i] = 0.0f;
  const unsigned long long t0 = probe_ns();
  while (probe_ns() - t0 < (unsigned long long)stage_ns) {
  }
  lum_pdl_trigger();
  while (probe_ns() - t0 < (unsigned long long)total_ns) {
  }
}

// The residual kernel's stand-in: one block of 256 threads, y = RMSNorm(x) over n <= 4,096 floats.
extern "C" __global__ void __launch_bounds__(256) probe_consumer(const float* x, const float* w, float* y, int n) {
  lum_pdl_trigger();
  lum_pdl_wait();
  probe_norm_row(x, w, y, n);
}

constexpr int OC_HEADS = 8;       // query heads = blocks a cluster
constexpr int OC_D = 256;         // a head's features = threads a block
constexpr int OC_COLS = 64;       // output columns a cluster
constexpr int OC_K = OC_HEADS * OC_D;

__device__ __forceinline__ unsigned probe_cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// The float at `p` (this block's shared memory) in the shared memory of cluster block `rank`.
__device__ __forceinline__ float probe_dsmem_load(const float* p, unsigned rank) {
  unsigned local = lum_shared_addr(p), remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// out[j] = Σ_k A[k] · W[j][k], A[h·256 + d] = bf16(Σ_j 2^(c_j − m) acc_j[d] / Σ_j 2^(c_j − m) l_j) over head h's
// chunks (m their largest c). Grid: 8 blocks a cluster (launched with a cluster dimension of 8), n / 64
// clusters; 256 threads, three blocks an SM (so the 320 blocks are resident at once). Thread d loads acc_j[d]
// of 16 chunks before it uses any (one round of loads up to 16 chunks, the offset kept across rounds), and
// the first threads the rounds' c and l into shared memory beside them.
// `variant`: 0 sums the heads in the cluster (barrier, distributed shared memory reads, barrier); 4 the same
// by pushing: each block stores its columns into the shared memory of the block that owns them, one barrier,
// then each sums its own; 3 adds each head's columns into `out` (red.global.add, fire and forget; out zeroed
// by the kernel before: the sum's order then varies).
// Timing only, the output wrong: 1 skips the partials (A = 1), 2 skips the sum (head 0's block stores its own).
extern "C" __global__ void __launch_bounds__(OC_D, 3) probe_o_combine(float* out, const float* part,
                                                                      const lum_bf16* w, int ns, int n,
                                                                      int variant) {
  lum_pdl_trigger();
  constexpr int R = 16;
  __shared__ lum_vec<unsigned, 4> ws[OC_COLS][OC_D / 8];   // head h's 256 weights of each column, 32 KB
  __shared__ float as[OC_D], ps[OC_COLS], cl[2][R], pushed[OC_HEADS][OC_COLS / OC_HEADS];
  const unsigned h = probe_cluster_rank();
  const int c0 = (int)(blockIdx.x / OC_HEADS) * OC_COLS, d = (int)threadIdx.x;
  for (int i = d; i < OC_COLS * (OC_D / 8); i += OC_D) {
    const int col = i / (OC_D / 8), v = i % (OC_D / 8);
    if (c0 + col < n) lum_copy16_async(&ws[col][v], w + (size_t)(c0 + col) * OC_K + h * OC_D + v * 8);
  }
  lum_pdl_wait();
  const float* ph = part + (size_t)h * ns * (OC_D + 2);
  const int chunks = variant == 1 ? 0 : ns;
  float m = -LUM_INF_F32, sl = 0.0f, sa = 0.0f;
  for (int j0 = 0; j0 < chunks; j0 += R) {
    float a[R];
#pragma unroll
    for (int u = 0; u < R; ++u) a[u] = j0 + u < chunks ? ph[(j0 + u) * (OC_D + 2) + d] : 0.0f;
    if (d < 2 * R) {
      const int u = d % R, j = j0 + u;
      cl[d / R][u] = j < chunks ? ph[j * (OC_D + 2) + OC_D + d / R] : (d < R ? -LUM_INF_F32 : 0.0f);
    }
    __syncthreads();
    float mr = m;
#pragma unroll
    for (int u = 0; u < R; ++u) mr = fmaxf(mr, cl[0][u]);
    if (mr > m) {
      const float f = m == -LUM_INF_F32 ? 0.0f : exp2f(m - mr);
      sl *= f;
      sa *= f;
      m = mr;
    }
#pragma unroll
    for (int u = 0; u < R; ++u) {
      const float e = cl[0][u] == -LUM_INF_F32 ? 0.0f : exp2f(cl[0][u] - m);
      sl += e * cl[1][u];
      sa += e * a[u];
    }
    __syncthreads();                       // cl is read by all before the next round writes it
  }
  as[d] = variant == 1 ? 1.0f : lum_bf16_to_f32(lum_f32_to_bf16(sa * (1.0f / sl)));
  lum_copy_wait_all();
  __syncthreads();
  const int warp = d / 32, lane = d % 32;
  float ys[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) ys[e] = as[lane * 8 + e];
  float v[8];                              // this warp's 8 columns, then halved across the lanes
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const lum_vec<unsigned, 4> raw = ws[warp * 8 + q][lane];
    v[q] = probe_dot8(0.0f, make_uint4(raw.v[0], raw.v[1], raw.v[2], raw.v[3]), ys);
  }
#pragma unroll
  for (int s = 16, k = 4; s >= 4; s >>= 1, k >>= 1) {   // lanes with bit s keep the upper half of the columns
    const bool hi = lane & s;
#pragma unroll
    for (int q = 0; q < k; ++q) {
      const float send = hi ? v[q] : v[q + k], keep = hi ? v[q + k] : v[q];
      v[q] = keep + __shfl_xor_sync(0xffffffffu, send, s);
    }
  }
#pragma unroll
  for (int o = 2; o > 0; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
  if ((lane & 3) == 0) ps[warp * 8 + ((lane >> 4) & 1) * 4 + ((lane >> 3) & 1) * 2 + ((lane >> 2) & 1)] = v[0];
  if (variant == 4) {
    __syncthreads();
    if (d < OC_COLS) {                     // column d belongs to block d / 8, slot h there
      const unsigned owner = (unsigned)d / (OC_COLS / OC_HEADS);
      lum_push_to(&pushed[h][d % (OC_COLS / OC_HEADS)], owner, ps[d]);
    }
    lum_cluster_sync();                  // every push has landed; nothing remote is read after it
    if (d < OC_COLS / OC_HEADS) {
      const int col = (int)h * (OC_COLS / OC_HEADS) + d;
      float s = 0.0f;
#pragma unroll
      for (int r = 0; r < OC_HEADS; ++r) s += pushed[r][d];
      if (c0 + col < n) out[c0 + col] = s;
    }
    return;
  }
  if (variant >= 2) {
    __syncthreads();
    if (d < OC_COLS && c0 + d < n) {
      if (variant == 3) asm volatile("red.global.add.f32 [%0], %1;" :: "l"(out + c0 + d), "f"(ps[d]) : "memory");
      else if (h == 0) out[c0 + d] = ps[d];
    }
    return;
  }
  lum_cluster_sync();                    // every head's column partials are in its block's ps
  if (d < OC_COLS / OC_HEADS) {
    const int col = (int)h * (OC_COLS / OC_HEADS) + d;
    float s = 0.0f;
#pragma unroll
    for (unsigned r = 0; r < OC_HEADS; ++r) s += probe_dsmem_load(&ps[col], r);
    if (c0 + col < n) out[c0 + col] = s;
  }
  lum_cluster_sync();                    // no block leaves while another still reads its ps
}
