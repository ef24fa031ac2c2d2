//! lum/benchmarks/stream_probe.cu — the kernels of benchmarks/stream_probe.py (templates/common.cuh and
//! benchmarks/probe.cuh are pasted before this file). One stretch of a decode layer: a one-block RMSNorm
//! (x → y, K floats) and the GEMV that reads it (out = W · y, W [n, K] bf16 row-major), done two ways:
//!   sp_norm + sp_gemv: two launches, as lum runs them; the GEMV is a warp a column, each lane's ten
//!                      16-byte loads of W unrolled (K is static), y staged in shared memory per block;
//!   sp_fused:          one launch of n / SP_COLS blocks, one an SM (its shared memory holds SP_COLS rows
//!                      of W); with `early` each block asks the copy engine for its rows (cp.async.bulk) at
//!                      once, while block 0 computes the norm; the others wait for block 0's flag, stage y,
//!                      wait for their rows and run the same dot from shared memory. Without `early` the
//!                      rows are asked for after the flag (a control: what the streaming alone gives).
//! Every dot sums in the same order (lanes, then the warp's shuffle tree), so all modes give equal values.

constexpr int SP_K = 2560;          // gemma3-4b's hidden size
constexpr int SP_COLS = 32;         // rows of W a fused block holds (32 × 2560 × 2 bytes = 160 KB)
constexpr int SP_THREADS = 256;

__device__ __forceinline__ float sp_dot(const unsigned short* w, const float* ys) {
  return probe_dot<SP_K / 256>(w, ys);             // ten 16-byte vectors of 8 weights a lane
}

__device__ __forceinline__ void sp_stage_y(const float* y, float* ys) {
  for (int k = (int)threadIdx.x; k < SP_K; k += SP_THREADS) ys[k] = __ldcg(y + k);   // L2: another block wrote it
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(SP_THREADS) sp_norm(const float* __restrict__ x, const float* __restrict__ w,
                                                                 float* __restrict__ y) {
  probe_norm_row(x, w, y, SP_K);
}

extern "C" __global__ void __launch_bounds__(SP_THREADS) sp_gemv(const float* __restrict__ y, const unsigned short* __restrict__ W,
                                                                 float* __restrict__ out, int n) {
  __shared__ float ys[SP_K];
  sp_stage_y(y, ys);
  const int j = (int)blockIdx.x * (SP_THREADS / 32) + (int)threadIdx.x / 32;
  if (j < n) {
    const float v = sp_dot(W + (size_t)j * SP_K, ys);
    if (threadIdx.x % 32 == 0) out[j] = v;
  }
}

__device__ __forceinline__ void sp_ask_rows(unsigned short* ws, const unsigned short* W, int j0, unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned bar_s = (unsigned)__cvta_generic_to_shared(bar);
  constexpr unsigned PART = SP_COLS / 4 * SP_K * 2;     // four copies of 40 KB
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar_s), "r"(4 * PART) : "memory");
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"((unsigned)__cvta_generic_to_shared(ws + c * (SP_COLS / 4) * SP_K)),
                    "l"(W + ((size_t)j0 + c * (SP_COLS / 4)) * SP_K), "r"(PART), "r"(bar_s) : "memory");
  }
#endif
}

extern "C" __global__ void __launch_bounds__(SP_THREADS, 1) sp_fused(const float* __restrict__ x, const float* __restrict__ w,
                                                                     float* __restrict__ y, const unsigned short* __restrict__ W,
                                                                     float* __restrict__ out, unsigned* __restrict__ flag,
                                                                     int early) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char sp_smem[];
  unsigned short* ws = reinterpret_cast<unsigned short*>(sp_smem);
  float* ys = reinterpret_cast<float*>(sp_smem + SP_COLS * SP_K * 2);
  unsigned long long* bar = reinterpret_cast<unsigned long long*>(ys + SP_K);
  const int j0 = (int)blockIdx.x * SP_COLS;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"((unsigned)__cvta_generic_to_shared(bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    if (early) sp_ask_rows(ws, W, j0, bar);
  }
  if (blockIdx.x == 0) {            // the small kernel: the norm, by one block, then the flag
    probe_norm_row(x, w, y, SP_K);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(flag), "r"(1u) : "memory");
    }
  }
  if (threadIdx.x == 0) {
    unsigned seen = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(flag) : "memory");
    } while (seen == 0u);
    if (!early) sp_ask_rows(ws, W, j0, bar);
  }
  __syncthreads();
  sp_stage_y(y, ys);
  unsigned done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"((unsigned)__cvta_generic_to_shared(bar)) : "memory");
  }
  const int warp = (int)threadIdx.x / 32;
#pragma unroll
  for (int c = 0; c < SP_COLS / (SP_THREADS / 32); ++c) {
    const int col = warp * (SP_COLS / (SP_THREADS / 32)) + c;
    const float v = sp_dot(ws + col * SP_K, ys);
    if (threadIdx.x % 32 == 0) out[j0 + col] = v;
  }
#else
  (void)x; (void)w; (void)y; (void)W; (void)out; (void)flag; (void)early;
#endif
}
