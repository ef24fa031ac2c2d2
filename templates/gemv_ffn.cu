//! lum/templates/gemv_ffn.cu — a decode FFN as one kernel sliced over h (builder/ffn_sliced.py): the gate-up GEMV
//! with its epilogue (h = f(gate, up), from NACC product columns of a stacked weight) and the down GEMV reading h,
//! out[c] = Σ_i h[i] · Wd(i, c). Lum's two GEMV launches each pay a ramp and a tail beside their streams; here
//! one block an SM takes its own rows of h and nothing waits for another block:
//!  * slice s of SLICES (a block each: one an SM) owns h rows [r0, r1), whole 16-byte vectors of down's weight
//!    rows, the rows split evenly; blocks walk the slices grid-stride, so any grid >= 1 is correct;
//!  * after its wait it stages A in shared memory, computes its h rows (a warp a row: a lane's vectors of each
//!    product column loaded before any is used, a warp-shuffle sum, the epilogue rounding h to its dtype) into
//!    shared memory;
//!  * then its partial of every output over its rows: a thread an output column at a time, one run of (r1 − r0)
//!    weights of its row (10 vectors at a time at most), the first loaded before the barrier that waits for h;
//!  * the partials are added as 64-bit fixed point (SCALE a unit) into a module-global sum: integer additions,
//!    so the result is the same in any order of the blocks. A partial that is not finite, or past the range the
//!    sum holds, marks its column, which comes out NaN. The last block to count itself done converts the sums
//!    into out, in out's dtype, and zeroes them and the count for the next launch (module globals are zero when
//!    the module loads). One kernel of the same name runs at a time (a launch waits for the one before: lum_pdl_wait).
//!
//! Placeholders: KERNEL THREADS IDX_T PARAMS DYN_LOADS (trigger and dyn reads, no wait); K1 (A's elements) H (h's)
//!   N2 (out's) NACC ACC_COLS (the product columns of output column j: j + ACC_COLS[t]) SLICES MAX_RV (down
//!   vectors of a slice's rows, at most) SCALE; A_T A_LOAD (float of lum_x) A_PTR (A, contiguous from its start);
//!   W_T W_LOAD W_PTR LDW OFFW (gate-up's weight: product column j at OFFW + j · LDW); D_T D_LOAD D_PTR LDD OFFD
//!   (down's: output column c's weights at OFFD + c · LDD); H_T H_LOAD (h's storage and its float of lum_x);
//!   EPILOGUE (the code that stores h row lum_j from lum_acc into lum_hs[lum_f - lum_r0]); OUT OUT_STORE (out's
//!   parameter and its storage of the float lum_v).
__device__ unsigned long long {{KERNEL}}_sum[{{N2}}];   // the fixed-point sums (zero between launches)
__device__ unsigned {{KERNEL}}_bad[{{N2}}];             // columns a non-finite or too large partial reached
__device__ unsigned {{KERNEL}}_done;                    // blocks counted done

extern "C" __global__ void __launch_bounds__({{THREADS}}, 1) {{KERNEL}}({{PARAMS}}) {
  typedef {{IDX_T}} idx_t;
  typedef {{A_T}} a_t;
  typedef {{W_T}} w_t;
  typedef {{D_T}} d_t;
  typedef {{H_T}} h_t;
  constexpr int THREADS = {{THREADS}}, WARPS = THREADS / 32;
  constexpr int M = 1;                           // the epilogue's rows
  constexpr int K1 = {{K1}}, H = {{H}}, N2 = {{N2}};
  constexpr int NACC = {{NACC}};
  constexpr int ACC_COLS[NACC] = {{{ACC_COLS}}};
  constexpr int VW = 16 / (int)sizeof(w_t), VD = 16 / (int)sizeof(d_t);
  constexpr int NV1 = (K1 / VW + 31) / 32;      // vectors a lane of a gate-up row
  constexpr int NB = NV1 < 10 ? NV1 : 10;       // ... loaded at once (registers: 4 a vector)
  constexpr int SLICES = {{SLICES}}, MAX_RV = {{MAX_RV}};
  constexpr int DB = MAX_RV < 10 ? MAX_RV : 10;   // down vectors a thread loads at once
  constexpr float SCALE = {{SCALE}};
  constexpr float LIMIT = 2147483648.0f;        // a partial's bound: 133 of them · LIMIT · SCALE < 2^63
  static_assert(K1 % VW == 0 && H % VD == 0 && THREADS % 32 == 0, "whole 16-byte vectors, whole warps");
  __shared__ float lum_xs[K1];
  __shared__ h_t lum_hs[MAX_RV * VD];
  __shared__ bool lum_last;
{{DYN_LOADS}}
  const idx_t lum_nout = H, lum_b = 0;
  const int lum_tx = (int)threadIdx.x, lum_warp = lum_tx / 32, lum_lane = lum_tx % 32;
  auto lum_ca = [](a_t lum_x) -> float { return {{A_LOAD}}; };
  auto lum_cw = [](w_t lum_x) -> float { return {{W_LOAD}}; };
  auto lum_cd = [](d_t lum_x) -> float { return {{D_LOAD}}; };
  auto lum_ch = [](h_t lum_x) -> float { return {{H_LOAD}}; };
  lum_pdl_wait();   // common.cuh: A is written and visible from here
  for (int k = lum_tx; k < K1; k += THREADS) lum_xs[k] = lum_ca({{A_PTR}}[k]);
  for (int lum_sl = (int)blockIdx.x; lum_sl < SLICES; lum_sl += (int)gridDim.x) {
    const int lum_v0 = (int)((long long)lum_sl * (H / VD) / SLICES);
    const int lum_v1 = (int)((long long)(lum_sl + 1) * (H / VD) / SLICES);
    const int lum_nv = lum_v1 - lum_v0, lum_r0 = lum_v0 * VD;
    __syncthreads();                                // A staged; the slice before done with lum_hs
    // gate-up: a warp a row of h, its product columns one after another
    for (int lum_i = lum_warp; lum_i < lum_nv * VD; lum_i += WARPS) {
      const idx_t lum_j = lum_r0 + lum_i;
      float lum_acc[NACC];
#pragma unroll 1
      for (int t = 0; t < NACC; ++t) {          // one product column's loads in flight at a time: registers
        const w_t* lum_wp = {{W_PTR}} + ({{OFFW}} + (lum_j + ACC_COLS[t]) * {{LDW}});
        float lum_s = 0.0f;
        for (int u0 = 0; u0 < NV1; u0 += NB) {
          unsigned lum_raw[NB][4];                // 16-byte vectors as four words: four registers each
#pragma unroll
          for (int u = 0; u < NB; ++u) {
            const int q = (lum_lane + 32 * (u0 + u)) * VW;
            if (u0 + u < NV1 && q < K1) lum_load_stream<4>(reinterpret_cast<const unsigned*>(lum_wp + q), lum_raw[u]);
          }
#pragma unroll
          for (int u = 0; u < NB; ++u) {
            const int q = (lum_lane + 32 * (u0 + u)) * VW;
            if (u0 + u < NV1 && q < K1) {
#pragma unroll
              for (int e = 0; e < VW; ++e) lum_s += lum_xs[q + e] * lum_cw(reinterpret_cast<const w_t*>(lum_raw[u])[e]);
            }
          }
        }
        lum_s = lum_warp_reduce<LumSum, 32>(lum_s);
#pragma unroll
        for (int q = 0; q < NACC; ++q) {          // lum_acc[t] with static indexes: registers, not local memory
          if (q == t) lum_acc[q] = lum_s;
        }
      }
      if (lum_lane == 0) {
  {{EPILOGUE}}
      }
    }
    // down: an output column a thread at a time, its row's run over the slice's h rows in batches of DB vectors;
    // the first column's first batch is loaded before the barrier that waits for h (it does not depend on it)
    unsigned lum_draw[DB][4];
    auto lum_dload = [&](int lum_c, int lum_u0) {
#pragma unroll
      for (int u = 0; u < DB; ++u) {
        if (lum_c < N2 && lum_u0 + u < lum_nv)
          lum_load_stream<4>(reinterpret_cast<const unsigned*>(
              {{D_PTR}} + ({{OFFD}} + (idx_t)lum_c * {{LDD}} + lum_r0 + (lum_u0 + u) * VD)), lum_draw[u]);
      }
    };
    lum_dload(lum_tx, 0);
    __syncthreads();                              // the slice's h rows are in lum_hs
    for (int lum_c = lum_tx; lum_c < N2; lum_c += THREADS) {
      float lum_s = 0.0f;
      for (int lum_u0 = 0; lum_u0 < lum_nv; lum_u0 += DB) {
        if (lum_c != lum_tx || lum_u0 != 0) lum_dload(lum_c, lum_u0);
#pragma unroll
        for (int u = 0; u < DB; ++u) {
          if (lum_u0 + u < lum_nv) {
#pragma unroll
            for (int e = 0; e < VD; ++e)
              lum_s += lum_ch(lum_hs[(lum_u0 + u) * VD + e]) * lum_cd(reinterpret_cast<const d_t*>(lum_draw[u])[e]);
          }
        }
      }
      if (fabsf(lum_s) < LIMIT) atomicAdd(&{{KERNEL}}_sum[lum_c], (unsigned long long)__float2ll_rn(lum_s * SCALE));
      else atomicOr(&{{KERNEL}}_bad[lum_c], 1u);   // NaN, inf or past the range: the column comes out NaN
    }
  }
  // the last block to count itself done converts the sums into out and zeroes them for the next launch
  __syncthreads();
  if (lum_tx == 0) {
    __threadfence();
    lum_last = atomicAdd(&{{KERNEL}}_done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (lum_last) {
    __threadfence();
    for (int lum_c = lum_tx; lum_c < N2; lum_c += THREADS) {
      const long long lum_q = (long long)atomicExch(&{{KERNEL}}_sum[lum_c], 0ull);
      const bool lum_nan = atomicExch(&{{KERNEL}}_bad[lum_c], 0u) != 0u;
      const float lum_v = lum_nan ? lum_bits_f32(0x7fc00000u) : (float)lum_q * (1.0f / SCALE);
      {{OUT}}[lum_c] = {{OUT_STORE}};
    }
    if (lum_tx == 0) {{KERNEL}}_done = 0u;
  }
}
