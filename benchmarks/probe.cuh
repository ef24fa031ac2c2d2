//! lum/benchmarks/probe.cuh — helpers shared by the GPU probes' kernels (benchmarks/pdl_probe.cu,
//! phase_probe.cu), pasted after templates/common.cuh and before the probe's own file.

// The sum of every thread's `s` over a block of 256 threads (8 warps), in every thread. `part` holds 8
// floats; the trailing __syncthreads lets the caller reuse it at once.
__device__ __forceinline__ float probe_block_sum(float s, float* part) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = s;
  __syncthreads();
  float t = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) t += part[i];
  __syncthreads();
  return t;
}
