//! lum/benchmarks/pdl_probe.cu — the two kernels of benchmarks/pdl_probe.py (templates/common.cuh and
//! benchmarks/probe.cuh are pasted before this file). A decode layer's shape in miniature: weight GEMVs (bf16 W [n, k] row-major,
//! f32 x, f32 y) separated by one-block row kernels (an RMSNorm), to measure what programmatic dependent
//! launch gives when each kernel does its predecessor-independent work before it waits:
//!   mode & 1  PDL: launch_dependents first, griddepcontrol.wait before reading what the stream wrote;
//!   mode & 2  preload: the GEMV copies the first rows of its block's share of W into shared memory
//!             (cp.async.bulk, one mbarrier) and the row kernel loads its weight, before that wait;
//!   mode & 4  L2 prefetch: the GEMV asks L2 for the same bytes (cp.async.bulk.prefetch) instead.
//! Each GEMV block owns a contiguous range of rows (so its share of W is one contiguous range); a warp
//! takes one row at a time, its lanes 16-byte vectors strided by the warp.

__device__ __forceinline__ void probe_pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" :::); }
__device__ __forceinline__ void probe_pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__device__ __forceinline__ unsigned probe_smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

extern "C" __global__ void __launch_bounds__(256) probe_gemv(const lum_bf16* __restrict__ W, const float* __restrict__ x,
                                                             float* __restrict__ y, int n, int k, int mode, int pre_rows_max) {
  extern __shared__ __align__(128) unsigned char probe_smem[];
  __shared__ __align__(8) unsigned long long probe_bar;
  const int r0 = (int)((long long)blockIdx.x * n / gridDim.x);
  const int r1 = (int)((long long)(blockIdx.x + 1) * n / gridDim.x);
  const int pre_rows = (mode & 6) ? min(r1 - r0, pre_rows_max) : 0;
  const unsigned pre_bytes = (unsigned)pre_rows * (unsigned)k * 2u;
  const lum_bf16* const Wb = W + (size_t)r0 * k;
  if (mode & 1) probe_pdl_trigger();
  if ((mode & 2) && pre_rows > 0 && threadIdx.x == 0) {
    const unsigned bar = probe_smem_addr(&probe_bar);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(pre_bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(probe_smem_addr(probe_smem)), "l"(Wb), "r"(pre_bytes), "r"(bar) : "memory");
  }
  if ((mode & 4) && pre_rows > 0 && threadIdx.x == 0) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(Wb), "r"(pre_bytes) : "memory");
  }
  if (mode & 1) probe_pdl_wait();
  __syncthreads();  // the mbarrier's init is visible to every thread
  const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
  bool ready = !((mode & 2) && pre_rows > 0);
  for (int row = r0 + warp; row < r1; row += 8) {
    const bool from_smem = (mode & 2) && row - r0 < pre_rows;
    if (from_smem && !ready) {
      const unsigned bar = probe_smem_addr(&probe_bar);
      unsigned done = 0;
      while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar) : "memory");
      }
      ready = true;
    }
    const lum_bf16* p = from_smem ? (const lum_bf16*)probe_smem + (size_t)(row - r0) * k : W + (size_t)row * k;
    float acc = 0.0f;
#pragma unroll 4
    for (int q = lane * 8; q < k; q += 256) {
      const uint4 v = *reinterpret_cast<const uint4*>(p + q);
      const float4 xa = *reinterpret_cast<const float4*>(x + q);
      const float4 xb = *reinterpret_cast<const float4*>(x + q + 4);
      const unsigned w[4] = {v.x, v.y, v.z, v.w};
      acc += xa.x * lum_bits_f32(w[0] << 16) + xa.y * lum_bits_f32(w[0] & 0xffff0000u);
      acc += xa.z * lum_bits_f32(w[1] << 16) + xa.w * lum_bits_f32(w[1] & 0xffff0000u);
      acc += xb.x * lum_bits_f32(w[2] << 16) + xb.y * lum_bits_f32(w[2] & 0xffff0000u);
      acc += xb.z * lum_bits_f32(w[3] << 16) + xb.w * lum_bits_f32(w[3] & 0xffff0000u);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) y[row] = acc;
  }
}

// y = x * rsqrt(mean(x²) + eps) * w over one row of n (one block of 256 threads, n <= 256 * 16).
extern "C" __global__ void __launch_bounds__(256) probe_norm(const float* __restrict__ x, const float* __restrict__ w,
                                                             float* __restrict__ y, int n, int mode) {
  __shared__ float part[8];
  float wv[16], xv[16];
  if (mode & 1) probe_pdl_trigger();
  const bool early = (mode & 2) != 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int c = (int)threadIdx.x + i * 256;
    wv[i] = (early && c < n) ? w[c] : 0.0f;
  }
  if (mode & 1) probe_pdl_wait();
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int c = (int)threadIdx.x + i * 256;
    xv[i] = c < n ? x[c] : 0.0f;
    if (!early) wv[i] = c < n ? w[c] : 0.0f;
    s += xv[i] * xv[i];
  }
  const float r = rsqrtf(probe_block_sum(s, part) / (float)n + 1e-6f);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int c = (int)threadIdx.x + i * 256;
    if (c < n) y[c] = xv[i] * r * wv[i];
  }
}
