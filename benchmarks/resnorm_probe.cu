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

extern "C" __global__ void __launch_bounds__(FP_T) rn_o_sums(const float* a, const unsigned short* Wo,
                                                            const float* x, const float* wp, const float* wf,
                                                            float* A, float* B, float* C, unsigned long long* sums) {
  __shared__ __align__(16) float as[RN_K];
  __shared__ float terms[FP_W][4];
  lum_pdl_trigger();
  lum_pdl_wait();
  const int warp = (int)threadIdx.x / 32, r = (int)blockIdx.x * FP_W + warp;
  const float xr = x[r], wpr = wp[r], wfr = wf[r];           // issued before the dot, used after it
  fp_stage(as, a, RN_K);
  const float v = fp_dot<RN_K / 256>(Wo + (size_t)r * RN_K, as);
  if (threadIdx.x % 32 == 0) {
    const float op = v * wpr;
    A[r] = xr * wfr;
    B[r] = op * wfr;
    C[r] = op;
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

extern "C" __global__ void __launch_bounds__(FP_T, 6) rn_gateup_sums(const unsigned long long* sums, const float* A,
                                                                    const float* B, const float* x, const float* C,
                                                                    const unsigned short* Wg, const unsigned short* Wu,
                                                                    float* act, float* h) {
  __shared__ __align__(16) float us[RN_N];
  lum_pdl_trigger();
  lum_pdl_wait();
  float S[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) S[k] = (float)((double)(long long)__ldcg(sums + k) / RN_FIX);
  const float ro = rsqrtf(S[0] / (float)RN_N + RN_EPS);
  const float hh = S[3] + 2.0f * ro * S[1] + ro * ro * S[2];
  const float rh = rsqrtf(hh / (float)RN_N + RN_EPS);
  for (int k = (int)threadIdx.x * 4; k < RN_N; k += FP_T * 4) {
    const float4 a4 = __ldcg(reinterpret_cast<const float4*>(A + k));
    const float4 b4 = __ldcg(reinterpret_cast<const float4*>(B + k));
    *reinterpret_cast<float4*>(us + k) = make_float4((a4.x + b4.x * ro) * rh, (a4.y + b4.y * ro) * rh,
                                                     (a4.z + b4.z * ro) * rh, (a4.w + b4.w * ro) * rh);
    if (blockIdx.x == 0) {                 // the residual, for the next stretch (lum: the FFN's residual kernel)
      const float4 x4 = __ldcg(reinterpret_cast<const float4*>(x + k));
      const float4 c4 = __ldcg(reinterpret_cast<const float4*>(C + k));
      *reinterpret_cast<float4*>(h + k) = make_float4(x4.x + c4.x * ro, x4.y + c4.y * ro, x4.z + c4.z * ro,
                                                      x4.w + c4.w * ro);
    }
  }
  __syncthreads();
  fp_gateup_item((int)blockIdx.x, us, Wg, Wu, act);
}
