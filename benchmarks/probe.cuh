//! lum/benchmarks/probe.cuh — helpers shared by the GPU probes' kernels (benchmarks/pdl_probe.cu,
//! phase_probe.cu, stream_probe.cu), pasted after templates/common.cuh and before the probe's own file.

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

// RMSNorm of one row of `n` <= 4,096 floats by a block of 256 threads: y = x · rsqrt(mean(x²) + 1e-6) · w.
__device__ __forceinline__ void probe_norm_row(const float* __restrict__ x, const float* __restrict__ w,
                                               float* __restrict__ y, int n) {
  __shared__ float part[8];
  float v[16];   // n <= 16 * 256
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int c = (int)threadIdx.x + i * 256;
    v[i] = c < n ? x[c] : 0.0f;
    s += v[i] * v[i];
  }
  const float r = rsqrtf(probe_block_sum(s, part) / (float)n + 1e-6f);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int c = (int)threadIdx.x + i * 256;
    if (c < n) y[c] = v[i] * r * w[c];
  }
}

// 8 bf16 weights (one 16-byte vector, raw bits) against ys[0..8), added to acc in order (the probes' GEMVs).
__device__ __forceinline__ float probe_dot8(float acc, const uint4 raw, const float* ys) {
  const unsigned r[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    acc += ys[2 * e] * __uint_as_float(r[e] << 16);
    acc += ys[2 * e + 1] * __uint_as_float(r[e] & 0xffff0000u);
  }
  return acc;
}

// The dot of VECS 16-byte vectors of bf16 weights a lane (vector lane + 32 i of w) against ys, then the
// warp's sum (a shuffle tree): every lane gets the row's dot.
template <int VECS>
__device__ __forceinline__ float probe_dot(const unsigned short* w, const float* ys) {
  const int lane = (int)threadIdx.x % 32;
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < VECS; ++i) {
    const int k = (lane + 32 * i) * 8;
    acc = probe_dot8(acc, *reinterpret_cast<const uint4*>(w + k), ys + k);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return acc;
}
