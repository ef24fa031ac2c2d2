//! lum/benchmarks/ring_probe.cu — the kernels of benchmarks/ring_probe.py (templates/common.cuh and
//! benchmarks/probe.cuh are pasted before this file). A stretch of a decode layer: a one-block RMSNorm over
//! K floats (x → y) and the GEMV that reads it (out = W · y, W [n, K] bf16 row-major), with two GEMVs:
//!   rp_reg_<K>:  a warp a row of W, each lane's K / 256 16-byte loads unrolled, y staged in shared memory
//!                (the shape of lum's dot scheme); rp_regpre_<K> the same with each lane's first PRE vectors
//!                loaded into registers before the programmatic wait (all of a row for o, qkv, gate-up);
//!   rp_ring_<K>: a persistent GEMV, one block an SM, whose W rows stream through a ring of S shared-memory
//!                stages of R rows each: one producer warp asks the copy engine for each stage
//!                (cp.async.bulk, completing on the stage's `full` mbarrier) as soon as the consumers have
//!                freed it (`empty`); eight consumer warps compute the dots from shared memory. The producer
//!                touches only W, so it never waits for the kernel before: launched programmatically, the
//!                first S stages stream while the norm still runs, and only the consumers wait
//!                (griddepcontrol.wait) before they read y.
//! Both sum a row in the same order (each lane its vectors in order, then the warp's shuffle tree, then, where
//! a row is split over warps, the warps in order), so the outputs are equal.

constexpr int RP_THREADS = 256;    // the norm's and the register GEMV's block; the ring's consumers

// y[k] = x[k % xn] · rsqrt(mean_k x[k % xn]² + 1e-6) · w[k], k < K (x: the previous stretch's output).
extern "C" __global__ void __launch_bounds__(RP_THREADS) rp_norm(const float* x, int xn, const float* __restrict__ w,
                                                                 float* y, int K, int pdl) {
  __shared__ float part[8];
  if (pdl) { lum_pdl_trigger(); lum_pdl_wait(); }
  float s = 0.0f;
  for (int k = (int)threadIdx.x; k < K; k += RP_THREADS) { const float v = x[k % xn]; s += v * v; }
  const float r = rsqrtf(probe_block_sum(s, part) / (float)K + 1e-6f);
  for (int k = (int)threadIdx.x; k < K; k += RP_THREADS) y[k] = x[k % xn] * r * w[k];
}

template <int K>
__device__ __forceinline__ void rp_reg(const float* y, const unsigned short* __restrict__ W, float* out, int n, int pdl) {
  __shared__ float ys[K];
  if (pdl) { lum_pdl_trigger(); lum_pdl_wait(); }
  for (int k = (int)threadIdx.x; k < K; k += RP_THREADS) ys[k] = y[k];
  __syncthreads();
  const int j = (int)blockIdx.x * (RP_THREADS / 32) + (int)threadIdx.x / 32;
  if (j < n) {
    const float v = probe_dot<K / 256>(W + (size_t)j * K, ys);
    if (threadIdx.x % 32 == 0) out[j] = v;
  }
}

// rp_reg whose lanes load their first PRE weight vectors before the programmatic wait (into registers,
// read-only loads of W only), then the rest after it: the whole row in flight while the norm runs where
// PRE = K / 256.
template <int K, int PRE>
__device__ __forceinline__ void rp_regpre(const float* y, const unsigned short* __restrict__ W, float* out, int n, int pdl) {
  constexpr int VECS = K / 256;
  static_assert(PRE <= VECS, "preload at most the row");
  __shared__ float ys[K];
  const int lane = (int)threadIdx.x % 32;
  const int j = (int)blockIdx.x * (RP_THREADS / 32) + (int)threadIdx.x / 32;
  const unsigned short* w = W + (size_t)(j < n ? j : 0) * K;
  uint4 pre[PRE];
  if (pdl) lum_pdl_trigger();
#pragma unroll
  for (int i = 0; i < PRE; ++i) pre[i] = __ldg(reinterpret_cast<const uint4*>(w + (lane + 32 * i) * 8));
  if (pdl) lum_pdl_wait();
  for (int k = (int)threadIdx.x; k < K; k += RP_THREADS) ys[k] = y[k];
  __syncthreads();
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < PRE; ++i) acc = probe_dot8(acc, pre[i], ys + (lane + 32 * i) * 8);
#pragma unroll
  for (int i = PRE; i < VECS; ++i)
    acc = probe_dot8(acc, *reinterpret_cast<const uint4*>(w + (lane + 32 * i) * 8), ys + (lane + 32 * i) * 8);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (j < n && lane == 0) out[j] = acc;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void rp_wait(unsigned bar, unsigned parity) {
  unsigned done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  }
}
#endif

// R rows a stage (8 / R warps a row, each K / (8 / R) consecutive weights of it), S stages.
template <int K, int R, int S>
__device__ __forceinline__ void rp_ring(const float* y, const unsigned short* __restrict__ W, float* out, int n, int pdl) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int WPR = 8 / R;                       // warps a row
  constexpr int STAGE = R * K;                     // weights a stage
  static_assert(8 % R == 0 && (K / WPR) % 256 == 0, "a warp's part of a row: whole vectors of every lane");
  extern __shared__ __align__(128) unsigned char rp_smem[];
  unsigned short* ws = reinterpret_cast<unsigned short*>(rp_smem);
  float* ys = reinterpret_cast<float*>(rp_smem + (size_t)S * STAGE * 2);
  float* red = ys + K;                             // [S][8] partial sums of split rows
  unsigned long long* full = reinterpret_cast<unsigned long long*>(red + S * 8);
  unsigned long long* empty = full + S;
  const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
  if (pdl) lum_pdl_trigger();
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"((unsigned)__cvta_generic_to_shared(full + s)) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 8;" :: "r"((unsigned)__cvta_generic_to_shared(empty + s)) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int chunks = n / R;
  const int mine = chunks > (int)blockIdx.x ? (chunks - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
  if (warp == 8) {                                 // the producer: W only, never waits for the kernel before
    if (lane == 0) {
      for (int i = 0; i < mine; ++i) {
        const int s = i % S;
        if (i >= S) rp_wait((unsigned)__cvta_generic_to_shared(empty + s), (unsigned)((i / S - 1) & 1));
        const unsigned fb = (unsigned)__cvta_generic_to_shared(full + s);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(fb), "r"(STAGE * 2) : "memory");
        const size_t row0 = (size_t)((int)blockIdx.x + i * (int)gridDim.x) * R;
#pragma unroll
        for (int r = 0; r < R; ++r)
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                       :: "r"((unsigned)__cvta_generic_to_shared(ws + (size_t)s * STAGE + r * K)),
                          "l"(W + (row0 + r) * K), "r"(K * 2), "r"(fb) : "memory");
      }
    }
    return;
  }
  if (pdl) lum_pdl_wait();
  for (int k = (int)threadIdx.x; k < K; k += RP_THREADS) ys[k] = y[k];
  asm volatile("bar.sync 1, 256;" ::: "memory");
  const int row = warp / WPR, part = warp % WPR;
  for (int i = 0; i < mine; ++i) {
    const int s = i % S;
    rp_wait((unsigned)__cvta_generic_to_shared(full + s), (unsigned)((i / S) & 1));
    const int k0 = part * (K / WPR);
    const float v = probe_dot<K / WPR / 256>(ws + (size_t)s * STAGE + row * K + k0, ys + k0);
    const int j = ((int)blockIdx.x + i * (int)gridDim.x) * R + row;
    if constexpr (WPR == 1) {
      if (lane == 0) out[j] = v;
    } else {
      if (lane == 0) red[s * 8 + warp] = v;
      asm volatile("bar.sync 1, 256;" ::: "memory");
      if (part == 0 && lane == 0) {
        float t = 0.0f;
#pragma unroll
        for (int p = 0; p < WPR; ++p) t += red[s * 8 + row * WPR + p];
        out[j] = t;
      }
    }
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"((unsigned)__cvta_generic_to_shared(empty + s)) : "memory");
  }
#else
  (void)y; (void)W; (void)out; (void)n; (void)pdl;
#endif
}

#define RP_SHAPE(K, R, S, PRE)                                                                                   \
  extern "C" __global__ void __launch_bounds__(RP_THREADS) rp_reg_##K(const float* y, const unsigned short* __restrict__ W, \
                                                                       float* out, int n, int pdl) {              \
    rp_reg<K>(y, W, out, n, pdl);                                                                                \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(RP_THREADS) rp_regpre_##K(const float* y, const unsigned short* __restrict__ W, \
                                                                          float* out, int n, int pdl) {           \
    rp_regpre<K, PRE>(y, W, out, n, pdl);                                                                        \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(RP_THREADS + 32, 1) rp_ring_##K(const float* y, const unsigned short* __restrict__ W, \
                                                                               float* out, int n, int pdl) {      \
    rp_ring<K, R, S>(y, W, out, n, pdl);                                                                         \
  }

RP_SHAPE(2048, 8, 5, 8)      // gemma3-4b o: 32 KB stages; the whole row preloaded
RP_SHAPE(2560, 8, 4, 10)     // qkv, gate-up: 40 KB stages; the whole row preloaded
RP_SHAPE(10240, 2, 4, 16)    // down: 40 KB stages; 16 of the row's 40 vectors a lane preloaded
