// lum/benchmarks/icache_probe.cu — the kernels of benchmarks/icache_probe.py: straight-line code of a known size,
// timed by each block, to measure what fetching a kernel's instructions costs on an SM that has not run it lately.
//
// icache_run<STEPS, SALT>: every thread keeps 8 independent floats and applies STEPS steps of one FFMA to each
// (x = x * c + 1/1024, c distinct a step and a lane of the 8), all unrolled: STEPS * 8 FFMA instructions of 16 bytes,
// no loop, no memory access between the two clock reads, so once fetched the warp issues them back to back (8
// chains of FMA latency 4). SALT makes the constants, so the code, of two instantiations differ. Thread 0 of each
// block stores %globaltimer (ns) before and after the straight line (each behind a __syncthreads) and its SM; every
// thread stores the sum of its 8 floats, which the host checks against float64.
template <int STEPS, int SALT>
__device__ __forceinline__ void icache_run(float* __restrict__ out, unsigned long long* __restrict__ times) {
  float x[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] = 0.25f + 0.001f * (float)(threadIdx.x + 32 * j);
  unsigned long long t0, t1;
  unsigned sm;
  __syncthreads();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0) :: "memory");
#pragma unroll
  for (int i = 0; i < STEPS; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = fmaf(x[j], 0.5f + (float)((i * 8 + j + SALT) % 4093) * (1.0f / 8192.0f), 0.0009765625f);
  }
  __syncthreads();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1) :: "memory");
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) s += x[j];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) {
    times[3 * blockIdx.x] = t0;
    times[3 * blockIdx.x + 1] = t1;
    times[3 * blockIdx.x + 2] = sm;
  }
}

#define ICACHE_KERNEL(NAME, STEPS, SALT)                                                                   \
  extern "C" __global__ void __launch_bounds__(32) NAME(float* out, unsigned long long* times) {         \
    icache_run<STEPS, SALT>(out, times);                                                                 \
  }
// the probes: 8, 16, 32 and 64 KB of FFMAs (STEPS * 8 * 16 bytes)
ICACHE_KERNEL(icache_probe_8k, 64, 0)
ICACHE_KERNEL(icache_probe_16k, 128, 0)
ICACHE_KERNEL(icache_probe_32k, 256, 0)
ICACHE_KERNEL(icache_probe_64k, 512, 0)
// the evictors, with other constants (other code): 33 KB, as much as a decode layer's GEMV and norm kernels, and
// 225 KB, more than a layer's seven kernels together (131 KB for gemma3-4b)
ICACHE_KERNEL(icache_evict_small, 256, 1009)
ICACHE_KERNEL(icache_evict_large, 1280, 2003)
