//! lum/benchmarks/resnorm_probe.cu — the kernels of benchmarks/resnorm_probe.py, pasted after
//! templates/common.cuh, benchmarks/probe.cuh and benchmarks/ffn_probe.cu (whose fp_stage, fp_dot, fp_gateup and
//! fp_gateup_item it uses). A stretch is gemma3-4b's decode layer from o to gate-up: o = Wo · a, the residual
//! h = x + o ⊙ wp · r_o with r_o = rsqrt(mean(o²) + ε), gate-up's input u = h ⊙ wf · r_h with r_h =
//! rsqrt(mean(h²) + ε), then gate-up (ffn_probe.cu's h = g · 2σ(u)). The next stretch's x is this one's h.
//!   three: rn_o, rn_resnorm (one block: both norms, as lum's residual kernel), fp_gateup;
//!   sums:  rn_o_sums (o, and per block Σ o², Σ x · o ⊙ wp, Σ (o ⊙ wp)², Σ x² added into four 64-bit fixed-point
//!          sums, with A = x ⊙ wf, B = o ⊙ wp ⊙ wf and C = o ⊙ wp), then rn_gateup_sums: r_o from Σ o², and
//!          Σ h² = Σ x² + 2 r_o Σ x · o ⊙ wp + r_o² Σ (o ⊙ wp)² (h is linear in o once r_o is known), so each
//!          block forms u = (A + B r_o) r_h itself, and block 0 writes h = x + C r_o. No kernel between o and
//!          gate-up. Integer sums are the same in any order, so the result does not depend on the schedule.

constexpr int RN_N = FP_K1;                 // the hidden size (gate-up's K)
constexpr int RN_K = FP_K1;                 // o's K (gemma3-4b's is 2,048; fp_dot takes whole batches of 10)
constexpr float RN_EPS = 1e-6f;
constexpr double RN_FIX = 4294967296.0;     // the fixed-point sums' unit: 2^-32

extern "C" __global__ void __launch_bounds__(FP_T) rn_o(const float* a, const unsigned short* Wo, float* o) {
  __shared__ __align__(16) float as[RN_K];
  lum_pdl_trigger();
  lum_pdl_wait();
  fp_stage(as, a, RN_K);
  const int r = (int)blockIdx.x * FP_W + (int)threadIdx.x / 32;
  const float v = fp_dot<RN_K / 256>(Wo + (size_t)r * RN_K, as);
  if (threadIdx.x % 32 == 0) o[r] = v;
}

// One block of 256 threads: both norms over the whole row, as lum's one-block residual kernel.
extern "C" __global__ void __launch_bounds__(256) rn_resnorm(const float* x, const float* o, const float* wp,
                                                            const float* wf, float* h, float* u) {
  __shared__ float part[8];
  constexpr int PER = RN_N / 256;
  lum_pdl_trigger();
  lum_pdl_wait();
  float ov[PER], hv[PER];
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    ov[i] = o[threadIdx.x + 256 * i];
    s += ov[i] * ov[i];
  }
  const float ro = rsqrtf(probe_block_sum(s, part) / (float)RN_N + RN_EPS);
  s = 0.0f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = (int)threadIdx.x + 256 * i;
    hv[i] = x[c] + ov[i] * wp[c] * ro;
    s += hv[i] * hv[i];
  }
  const float rh = rsqrtf(probe_block_sum(s, part) / (float)RN_N + RN_EPS);
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int c = (int)threadIdx.x + 256 * i;
    h[c] = hv[i];
    u[c] = hv[i] * wf[c] * rh;
  }
}

__device__ __forceinline__ void rn_add_fixed(unsigned long long* sum, float v) {
  atomicAdd(sum, (unsigned long long)llrint((double)v * RN_FIX));    // two's complement: signed sums wrap back
}

// The forms of `sums` (RN_*): the probe's first, with A and B in float; lum's likely one, A and B in bf16 (the
// model's dtype: half the bytes each gate-up block reads); and `raw`, where o's blocks add only the sums and
// gate-up forms its input from x, o and the two norms' bf16 weights, with no vectors written for it.
constexpr int RN_F32 = 0, RN_BF16 = 1, RN_RAW = 2;

template <int FORM, typename T>
__device__ __forceinline__ void rn_o_sums_body(const float* a, const unsigned short* Wo, const float* x,
                                               const float* wp, const float* wf, T* A, T* B, float* C,
                                               unsigned long long* sums) {
  __shared__ __align__(16) float as[RN_K];
  __shared__ float terms[FP_W][4];
  lum_pdl_trigger();
  lum_pdl_wait();
  const int warp = (int)threadIdx.x / 32, r = (int)blockIdx.x * FP_W + warp;
  const float xr = x[r], wpr = wp[r], wfr = FORM == RN_RAW ? 0.0f : wf[r];   // issued before the dot
  fp_stage(as, a, RN_K);
  const float v = fp_dot<RN_K / 256>(Wo + (size_t)r * RN_K, as);
  if (threadIdx.x % 32 == 0) {
    const float op = v * wpr;
    if constexpr (FORM == RN_F32) {
      A[r] = xr * wfr;
      B[r] = op * wfr;
    } else if constexpr (FORM == RN_BF16) {
      A[r] = lum_f32_to_bf16(xr * wfr);
      B[r] = lum_f32_to_bf16(op * wfr);
    }
    C[r] = FORM == RN_RAW ? v : op;
    terms[warp][0] = v * v;
    terms[warp][1] = xr * op;
    terms[warp][2] = op * op;
    terms[warp][3] = xr * xr;
  }
  __syncthreads();
  if (threadIdx.x < 4) {
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < FP_W; ++w) t += terms[w][threadIdx.x];
    rn_add_fixed(sums + threadIdx.x, t);
  }
}

extern "C" __global__ void __launch_bounds__(FP_T) rn_o_sums(const float* a, const unsigned short* Wo,
                                                            const float* x, const float* wp, const float* wf,
                                                            float* A, float* B, float* C, unsigned long long* sums) {
  rn_o_sums_body<RN_F32>(a, Wo, x, wp, wf, A, B, C, sums);
}

extern "C" __global__ void __launch_bounds__(FP_T) rn_o_sums_bf16(const float* a, const unsigned short* Wo,
                                                                 const float* x, const float* wp, const float* wf,
                                                                 unsigned short* A, unsigned short* B, float* C,
                                                                 unsigned long long* sums) {
  rn_o_sums_body<RN_BF16>(a, Wo, x, wp, wf, A, B, C, sums);
}

extern "C" __global__ void __launch_bounds__(FP_T) rn_o_raw(const float* a, const unsigned short* Wo, const float* x,
                                                           const float* wp, float* o, unsigned long long* sums) {
  rn_o_sums_body<RN_RAW, float>(a, Wo, x, wp, nullptr, nullptr, nullptr, o, sums);   // no wf: nothing for gate-up
}

// r_o and r_h from the four sums (written by every block of the o kernel before this kernel's wait returns).
__device__ __forceinline__ float2 rn_scales(const unsigned long long* sums) {
  float S[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) S[k] = (float)((double)(long long)__ldcg(sums + k) / RN_FIX);
  const float ro = rsqrtf(S[0] / (float)RN_N + RN_EPS);
  const float hh = S[3] + 2.0f * ro * S[1] + ro * ro * S[2];
  return make_float2(ro, rsqrtf(hh / (float)RN_N + RN_EPS));
}

__device__ __forceinline__ float4 rn_load4(const float* p, int k) {
  return __ldcg(reinterpret_cast<const float4*>(p + k));
}

__device__ __forceinline__ float4 rn_load4(const unsigned short* p, int k) {   // four bf16, widened
  const uint2 raw = __ldcg(reinterpret_cast<const uint2*>(p + k));
  return make_float4(lum_bf16_to_f32((unsigned short)(raw.x & 0xffffu)), lum_bf16_to_f32((unsigned short)(raw.x >> 16)),
                     lum_bf16_to_f32((unsigned short)(raw.y & 0xffffu)), lum_bf16_to_f32((unsigned short)(raw.y >> 16)));
}

// Gate-up forming its input u = (A + B r_o) r_h (FORM F32 / BF16: T is A's and B's storage) or, in RAW,
// u = (x + o wp r_o) wf r_h from x, o and the bf16 weights (A = o, B unused, wpb / wfb the weights); block 0
// also writes the residual h = x + C r_o (C = o wp; in RAW, o wp from o and wpb).
template <int FORM, typename T>
__device__ __forceinline__ void rn_gateup_body(const unsigned long long* sums, const T* A, const T* B,
                                               const float* x, const float* C, const unsigned short* wpb,
                                               const unsigned short* wfb, const unsigned short* Wg,
                                               const unsigned short* Wu, float* act, float* h) {
  __shared__ __align__(16) float us[RN_N];
  lum_pdl_trigger();
  lum_pdl_wait();
  const float2 sc = rn_scales(sums);
  const float ro = sc.x, rh = sc.y;
  for (int k = (int)threadIdx.x * 4; k < RN_N; k += FP_T * 4) {
    float4 u4, c4;
    if constexpr (FORM == RN_RAW) {
      const float4 x4 = rn_load4(x, k), o4 = rn_load4(C, k), p4 = rn_load4(wpb, k), f4 = rn_load4(wfb, k);
      c4 = make_float4(o4.x * p4.x, o4.y * p4.y, o4.z * p4.z, o4.w * p4.w);
      u4 = make_float4((x4.x + c4.x * ro) * f4.x * rh, (x4.y + c4.y * ro) * f4.y * rh,
                       (x4.z + c4.z * ro) * f4.z * rh, (x4.w + c4.w * ro) * f4.w * rh);
    } else {
      const float4 a4 = rn_load4(A, k), b4 = rn_load4(B, k);
      u4 = make_float4((a4.x + b4.x * ro) * rh, (a4.y + b4.y * ro) * rh, (a4.z + b4.z * ro) * rh,
                       (a4.w + b4.w * ro) * rh);
    }
    *reinterpret_cast<float4*>(us + k) = u4;
    if (blockIdx.x == 0) {                 // the residual, for the next stretch (lum: the FFN's residual kernel)
      const float4 x4 = rn_load4(x, k);
      if constexpr (FORM != RN_RAW) c4 = rn_load4(C, k);
      *reinterpret_cast<float4*>(h + k) = make_float4(x4.x + c4.x * ro, x4.y + c4.y * ro, x4.z + c4.z * ro,
                                                      x4.w + c4.w * ro);
    }
  }
  __syncthreads();
  fp_gateup_item((int)blockIdx.x, us, Wg, Wu, act);
}

extern "C" __global__ void __launch_bounds__(FP_T, 6) rn_gateup_sums(const unsigned long long* sums, const float* A,
                                                                    const float* B, const float* x, const float* C,
                                                                    const unsigned short* Wg, const unsigned short* Wu,
                                                                    float* act, float* h) {
  rn_gateup_body<RN_F32>(sums, A, B, x, C, nullptr, nullptr, Wg, Wu, act, h);
}

extern "C" __global__ void __launch_bounds__(FP_T, 6) rn_gateup_sums_bf16(const unsigned long long* sums,
                                                                         const unsigned short* A,
                                                                         const unsigned short* B, const float* x,
                                                                         const float* C, const unsigned short* Wg,
                                                                         const unsigned short* Wu, float* act,
                                                                         float* h) {
  rn_gateup_body<RN_BF16>(sums, A, B, x, C, nullptr, nullptr, Wg, Wu, act, h);
}

extern "C" __global__ void __launch_bounds__(FP_T, 6) rn_gateup_raw(const unsigned long long* sums, const float* x,
                                                                   const float* o, const unsigned short* wpb,
                                                                   const unsigned short* wfb, const unsigned short* Wg,
                                                                   const unsigned short* Wu, float* act, float* h) {
  rn_gateup_body<RN_RAW, float>(sums, nullptr, nullptr, x, o, wpb, wfb, Wg, Wu, act, h);
}
