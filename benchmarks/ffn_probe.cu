//! lum/benchmarks/ffn_probe.cu — the kernels of benchmarks/ffn_probe.py (templates/common.cuh and
//! benchmarks/probe.cuh are pasted before this file). A stretch is gemma3-4b's decode FFN without its norms:
//! h = g · 2σ(u), g = Wg · x, u = Wu · x (Wg, Wu [H, K1] bf16), out = Wd · h (Wd [N2, K2 = H] bf16), x the
//! previous stretch's out. Two ways to run it:
//!   fp_gateup + fp_down: two kernels, a block an item of four rows (a warp a row), launched programmatically
//!                (each triggers as it starts and waits before its first read), as lum's GEMVs are;
//!   fp_fused_<S>: one persistent kernel (as many blocks as the SMs hold at once) walking the gate-up items,
//!                then the down items, grid-stride. down's K is split in S slices; a gate-up item counts
//!                itself done on its h slice's counter (after a fence), and a down item of slice s waits
//!                (thread 0 spinning on acquire loads) until slices 0..s are counted full, then adds its
//!                partial dot into out (zeroed by the gate-up items of slice 0). So down's weights stream
//!                while gate-up's last items finish, with no kernel boundary between them. With S ≤ 2 the
//!                sum is deterministic (0 + a + b in either order). Each kernel resets the next stretch's
//!                counters after its wait (that stretch's kernel waits for this one before it counts).
//! Rows are summed in the same order in both (a lane's vectors in order, then the warp's shuffle tree), so
//! only down's slices change the rounding.

constexpr int FP_T = 128;                  // threads a block: four warps
constexpr int FP_W = FP_T / 32;            // rows an item
constexpr int FP_K1 = 2560, FP_H = 10240, FP_N2 = 2560, FP_K2 = FP_H;
constexpr int FP_NG = FP_H / FP_W;         // gate-up items
constexpr int FP_ND = FP_N2 / FP_W;        // down items a slice
constexpr int FP_BATCH = 10;               // 16-byte weight loads a lane keeps in flight

// A warp's dot of a bf16 row of VECS·32 vectors (8 weights each; evict-first, as lum's GEMVs) with v (f32, in
// shared memory, staged as lum's GEMVs stage their A), FP_BATCH vectors a lane in flight.
__device__ __forceinline__ uint4 fp_load_stream(const unsigned short* p, unsigned long long policy) {
  uint4 w;      // volatile: issued in program order, so a batch's weight loads all leave before its uses
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w) : "l"(p), "l"(policy));
  return w;
}

// n floats of src (through L2: this kernel's other blocks may have written them) into shared dst, then a barrier.
__device__ __forceinline__ void fp_stage(float* dst, const float* src, int n) {
  for (int k = (int)threadIdx.x * 4; k < n; k += FP_T * 4)
    *reinterpret_cast<float4*>(dst + k) = __ldcg(reinterpret_cast<const float4*>(src + k));
  __syncthreads();
}

template <int VECS>
__device__ __forceinline__ float fp_dot(const unsigned short* w, const float* v) {
  static_assert(VECS % FP_BATCH == 0, "whole batches");
  const int lane = (int)threadIdx.x % 32;
  const unsigned long long policy = lum_evict_first_policy();
  float acc = 0.0f;
#pragma unroll 1
  for (int b = 0; b < VECS; b += FP_BATCH) {
    uint4 raw[FP_BATCH];
#pragma unroll
    for (int i = 0; i < FP_BATCH; ++i) raw[i] = fp_load_stream(w + (lane + 32 * (b + i)) * 8, policy);
#pragma unroll
    for (int i = 0; i < FP_BATCH; ++i) {
      acc = probe_dot8(acc, raw[i], v + (lane + 32 * (b + i)) * 8);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return acc;
}

__device__ __forceinline__ void fp_gateup_item(int i, const float* xs, const unsigned short* Wg,
                                               const unsigned short* Wu, float* h) {
  const int c = i * FP_W + (int)threadIdx.x / 32;
  const float g = fp_dot<FP_K1 / 256>(Wg + (size_t)c * FP_K1, xs);
  const float u = fp_dot<FP_K1 / 256>(Wu + (size_t)c * FP_K1, xs);
  if (threadIdx.x % 32 == 0) h[c] = 2.0f * g / (1.0f + __expf(-u));
}

// Row r of down item d over h slice s (hs: that slice, staged).
template <int S>
__device__ __forceinline__ float fp_down_item(int d, const float* hs, const unsigned short* Wd, int* row) {
  const int s = d / FP_ND, r = (d % FP_ND) * FP_W + (int)threadIdx.x / 32;
  *row = r;
  constexpr int KS = FP_K2 / S;
  return fp_dot<KS / 256>(Wd + (size_t)r * FP_K2 + (size_t)s * KS, hs);
}

extern "C" __global__ void __launch_bounds__(FP_T, 6) fp_gateup(const float* x, const unsigned short* Wg,
                                                             const unsigned short* Wu, float* h) {
  __shared__ __align__(16) float xs[FP_K1];
  lum_pdl_trigger();
  lum_pdl_wait();
  fp_stage(xs, x, FP_K1);
  fp_gateup_item((int)blockIdx.x, xs, Wg, Wu, h);
}

extern "C" __global__ void __launch_bounds__(FP_T, 6) fp_down(const float* h, const unsigned short* Wd, float* out) {
  __shared__ __align__(16) float hs[FP_K2];
  lum_pdl_trigger();
  lum_pdl_wait();
  fp_stage(hs, h, FP_K2);
  int r;
  const float v = fp_down_item<1>((int)blockIdx.x, hs, Wd, &r);
  if (threadIdx.x % 32 == 0) out[r] = v;
}

__device__ __forceinline__ unsigned fp_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

template <int S>
__device__ __forceinline__ void fp_fused(const float* x, const unsigned short* Wg, const unsigned short* Wu,
                                         float* h, const unsigned short* Wd, float* out, unsigned* ctr,
                                         unsigned* ctr_next, unsigned* err) {
  constexpr int KS = FP_K2 / S;
  __shared__ __align__(16) float vs[KS > FP_K1 ? KS : FP_K1];    // x, then the h slice of the block's down item
  lum_pdl_trigger();
  lum_pdl_wait();
  if (blockIdx.x == 0 && threadIdx.x < S) ctr_next[threadIdx.x] = 0u;
  constexpr int PER = FP_NG / S;           // gate-up items a slice
  int staged = -1;                         // the h slice in vs (-1: x)
  if ((int)blockIdx.x < FP_NG) fp_stage(vs, x, FP_K1);
  for (int it = (int)blockIdx.x; it < FP_NG + S * FP_ND; it += (int)gridDim.x) {
    if (it < FP_NG) {
      fp_gateup_item(it, vs, Wg, Wu, h);
      if (it < FP_ND && threadIdx.x % 32 == 0) out[it * FP_W + (int)threadIdx.x / 32] = 0.0f;
      __syncthreads();                     // the item's h (and zeros) stored by every warp
      if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(ctr + it / PER, 1u);
      }
    } else {
      const int d = it - FP_NG, s = d / FP_ND;
      if (threadIdx.x == 0) {
        for (int t = 0; t <= s; ++t) {
          long long n = 0;
          while (fp_acquire(ctr + t) < (unsigned)PER) {
            if (++n > (1ll << 26)) { atomicExch(err, 1u); break; }     // a hang would be a bug: say so
          }
        }
      }
      __syncthreads();
      if (staged != s) {
        __syncthreads();                   // every warp is done with vs
        fp_stage(vs, h + s * KS, KS);
        staged = s;
      }
      int r;
      const float v = fp_down_item<S>(d, vs, Wd, &r);
      if (threadIdx.x % 32 == 0) atomicAdd(out + r, v);
    }
  }
}

#define FP_FUSED(S)                                                                                              \
  extern "C" __global__ void __launch_bounds__(FP_T, 6) fp_fused_##S(const float* x, const unsigned short* Wg,     \
      const unsigned short* Wu, float* h, const unsigned short* Wd, float* out, unsigned* ctr,                  \
      unsigned* ctr_next, unsigned* err) {                                                                      \
    fp_fused<S>(x, Wg, Wu, h, Wd, out, ctr, ctr_next, err);                                                     \
  }
FP_FUSED(1)
FP_FUSED(2)
FP_FUSED(4)

// fp_sliced: one block an SM, no dependency between blocks. Block b takes h rows [r0, r1) (H / gridDim.x of
// them): their gate and up dots (a warp a row, as above), h into shared memory, then its partial of out over
// those rows, from down's weight stored transposed (WdT [H, N2] row-major: the block's rows are contiguous), and
// adds that partial into out with float atomics (zeroed before the stretch: a memset node). So gate-up's and
// down's weights stream through one kernel with no boundary and no wait between them; only the atomics' order
// varies from run to run.
constexpr int FS_T = 640;                  // threads: 20 warps; in the down part, 2 halves of 320 threads
constexpr int FS_NV = FP_N2 / 8;           // 16-byte vectors a WdT row
constexpr int FS_MAX_R = 96;               // h rows a block at most (H / 107 blocks)
constexpr int FS_BATCH = 8;                // WdT vectors a thread keeps in flight

constexpr float FS_SCALE = 16777216.0f;    // fp_sliced_fixed: 2^24 a unit
// The sliced kernels' first part: x staged, then h over rows [r0, r1) (a warp a row) into hs.
__device__ __forceinline__ void fs_gate_up(const float* x, const unsigned short* Wg, const unsigned short* Wu,
                                           int r0, int r1, float* xs, float* hs) {
  for (int k = (int)threadIdx.x * 4; k < FP_K1; k += FS_T * 4)
    *reinterpret_cast<float4*>(xs + k) = __ldcg(reinterpret_cast<const float4*>(x + k));
  __syncthreads();
  const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
  for (int i = warp; i < r1 - r0; i += FS_T / 32) {
    const int c = r0 + i;
    const float g = fp_dot<FP_K1 / 256>(Wg + (size_t)c * FP_K1, xs);
    const float u = fp_dot<FP_K1 / 256>(Wu + (size_t)c * FP_K1, xs);
    if (lane == 0) hs[i] = 2.0f * g / (1.0f + __expf(-u));
  }
}

// One partial of output j: a float atomic, or with FIXED a 64-bit fixed-point one (integer sums: any order).
template <bool FIXED>
__device__ __forceinline__ void fs_add(float* out, unsigned long long* fix, int j, float t) {
  if (FIXED) atomicAdd(fix + j, (unsigned long long)__float2ll_rn(t * FS_SCALE));
  else atomicAdd(out + j, t);
}

// FIXED's end: the last block to count itself done converts the sums into out and zeroes them again.
__device__ __forceinline__ void fs_convert_if_last(float* out, unsigned long long* fix, unsigned* ctr) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(ctr, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (last) {
    __threadfence();
    for (int j = (int)threadIdx.x; j < FP_N2; j += FS_T)
      out[j] = (float)(long long)atomicExch(fix + j, 0ull) * (1.0f / FS_SCALE);
    if (threadIdx.x == 0) *ctr = 0u;
  }
}

template <bool FIXED>
__device__ __forceinline__ void fp_sliced_body(const float* x, const unsigned short* Wg, const unsigned short* Wu,
    const unsigned short* WdT, float* out, unsigned long long* fix, unsigned* ctr) {
  static_assert(FS_T == 2 * FS_NV, "two halves of one thread a WdT vector");
  __shared__ __align__(16) float xs[FP_K1];
  __shared__ float hs[FS_MAX_R];
  __shared__ __align__(16) float part[FS_NV * 8];
  lum_pdl_trigger();
  lum_pdl_wait();
  const int r0 = (int)((long long)blockIdx.x * FP_H / gridDim.x);
  const int r1 = (int)((long long)(blockIdx.x + 1) * FP_H / gridDim.x);
  fs_gate_up(x, Wg, Wu, r0, r1, xs, hs);
  // down's first batch of weights is loaded before the barrier that waits for the block's h (they do not
  // depend on it), so the bus sees no gap between the block's two parts
  const int v = (int)threadIdx.x % FS_NV, half = (int)threadIdx.x / FS_NV;
  const unsigned long long policy = lum_evict_first_policy();
  float acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
  uint4 raw[FS_BATCH];
  auto load_batch = [&](int i0) {
#pragma unroll
    for (int b = 0; b < FS_BATCH; ++b) {
      const int i = i0 + 2 * b;
      if (i < r1) raw[b] = fp_load_stream(WdT + (size_t)i * FP_N2 + v * 8, policy);
    }
  };
  load_batch(r0 + half);
  __syncthreads();
  for (int i0 = r0 + half; i0 < r1; i0 += 2 * FS_BATCH) {
    if (i0 != r0 + half) load_batch(i0);
#pragma unroll
    for (int b = 0; b < FS_BATCH; ++b) {
      const int i = i0 + 2 * b;
      if (i < r1) {
        const float hv = hs[i - r0];
        const unsigned r[4] = {raw[b].x, raw[b].y, raw[b].z, raw[b].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc[2 * e] += hv * __uint_as_float(r[e] << 16);
          acc[2 * e + 1] += hv * __uint_as_float(r[e] & 0xffff0000u);
        }
      }
    }
  }
  if (half == 1) {
#pragma unroll
    for (int e = 0; e < 8; ++e) part[v * 8 + e] = acc[e];
  }
  __syncthreads();
  if (half == 0) {
#pragma unroll
    for (int e = 0; e < 8; ++e) fs_add<FIXED>(out, fix, v * 8 + e, acc[e] + part[v * 8 + e]);
  }
  if (FIXED) fs_convert_if_last(out, fix, ctr);
}

extern "C" __global__ void __launch_bounds__(FS_T, 1) fp_sliced(const float* x, const unsigned short* Wg,
    const unsigned short* Wu, const unsigned short* WdT, float* out) {
  fp_sliced_body<false>(x, Wg, Wu, WdT, out, nullptr, nullptr);
}

// The same with the partials added as 64-bit fixed point (2^24 a unit: integer sums, the same in any order), the
// last block converting them into out: deterministic, and out needs no zeroing before the kernel.
extern "C" __global__ void __launch_bounds__(FS_T, 1) fp_sliced_fixed(const float* x, const unsigned short* Wg,
    const unsigned short* Wu, const unsigned short* WdT, float* out, unsigned long long* fix, unsigned* ctr) {
  fp_sliced_body<true>(x, Wg, Wu, WdT, out, fix, ctr);
}

// fp_sliced_rm: fp_sliced over down's weight as stored ([N2, H] row-major, as lum's decode GEMV reads it): 128
// blocks of 80 h rows, so each output's part of a block is one 160-byte run (10 vectors) of its row; a thread
// takes two outputs at a time, their 20 vectors in flight, and adds its dots into out (float atomics, or with
// FIXED as fp_sliced_fixed does: the form lum would build if the stored layout streams as fast).
constexpr int FS_RM_R = 80;
template <bool FIXED>
__device__ __forceinline__ void fp_sliced_rm_body(const float* x, const unsigned short* Wg, const unsigned short* Wu,
    const unsigned short* Wd, float* out, unsigned long long* fix, unsigned* ctr) {
  __shared__ __align__(16) float xs[FP_K1];
  __shared__ __align__(16) float hs[FS_RM_R];
  lum_pdl_trigger();
  lum_pdl_wait();
  const int r0 = (int)blockIdx.x * FS_RM_R;
  fs_gate_up(x, Wg, Wu, r0, r0 + FS_RM_R, xs, hs);
  const unsigned long long policy = lum_evict_first_policy();
  constexpr int V = FS_RM_R / 8;
  uint4 raw[2][V];
  auto load = [&](int j0) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int j = j0 + t * FS_T;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        if (j < FP_N2) raw[t][i] = fp_load_stream(Wd + (size_t)j * FP_K2 + r0 + 8 * i, policy);
      }
    }
  };
  load((int)threadIdx.x);
  __syncthreads();
  for (int j0 = (int)threadIdx.x; j0 < FP_N2; j0 += 2 * FS_T) {
    if (j0 != (int)threadIdx.x) load(j0);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int j = j0 + t * FS_T;
      float acc = 0.0f;
#pragma unroll
      for (int i = 0; i < V; ++i) acc = probe_dot8(acc, raw[t][i], hs + 8 * i);
      if (j < FP_N2) fs_add<FIXED>(out, fix, j, acc);
    }
  }
  if (FIXED) fs_convert_if_last(out, fix, ctr);
}

extern "C" __global__ void __launch_bounds__(FS_T, 1) fp_sliced_rm(const float* x, const unsigned short* Wg,
    const unsigned short* Wu, const unsigned short* Wd, float* out) {
  fp_sliced_rm_body<false>(x, Wg, Wu, Wd, out, nullptr, nullptr);
}

extern "C" __global__ void __launch_bounds__(FS_T, 1) fp_sliced_rm_fixed(const float* x, const unsigned short* Wg,
    const unsigned short* Wu, const unsigned short* Wd, float* out, unsigned long long* fix, unsigned* ctr) {
  fp_sliced_rm_body<true>(x, Wg, Wu, Wd, out, fix, ctr);
}
