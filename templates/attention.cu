//! lum/templates/attention.cu — LLIR attention: the per-chunk partials of decode attention (split-K flash
//! decoding; format/llir.py gives the exact semantics). A reduce over the chunk axis combines them.
//!
//! Work item w = (kv row h, chunk j), walked grid-stride (correct for any grid >= 1). The M query rows that
//! share kv row h (a GQA group: k and v do not move along their dims) are handled by the same block, so
//! K and V are read once per group. Lane `lane` of every warp owns features [lane*DPL, lane*DPL + DPL) of
//! q·k and [lane*VPL, lane*VPL + VPL) of v; warp `warp` takes keys t0 + warp*UNROLL + u of each step of
//! WARPS*UNROLL keys (loads of UNROLL keys in flight, then their math). Per query row and warp an online
//! softmax in the log2 domain keeps an integer offset c (raised to ceil(x) when a logit x exceeds it: the
//! rescale 2^(c_old - c_new) is exact), l = sum 2^(x - c) and acc = sum round_p(2^(x - c)) * v. The warps'
//! partials are combined through shared memory, MERGE_ROWS query rows after one barrier pair (all M
//! where they fit), and stored as [acc[0..DV), c, l]. Every warp runs the same
//! number of steps, so every thread reaches each warp shuffle and __syncthreads.
//!
//! Placeholders: KERNEL THREADS IDX_T PARAMS DYN_LOADS; M DPL VPL DV UNROLL CHUNK MERGE_ROWS SMEM_VECTORS (true where
//!   VPL is a power of two: lanes move their slices of the partials to / from shared memory as 16-byte vectors,
//!   2-way bank conflicts rather than VPL-way; builder/attention_codegen.py); T (keys), NS
//!   (chunks), HEADS (kv rows), SETUP (unravel lum_h, bases of k / v / q / out), LOAD_Q (lum_q[m][i]), LOAD_KV
//!   (lum_k[u][i], lum_v[u][i] of key lum_t, zeros past lum_t1), KEY (the softmax update of every query
//!   row for key lum_t of slot u; or, batched, only its logits, with KEYS_BEFORE declaring them and
//!   KEYS_AFTER updating each query row once for the step's UNROLL keys: one maximum, one rescale), STORE
//!   (the out offset of query row lum_m's chunk lum_j). STAGE_DECL, STAGE_PRE, STAGE: empty, or an attention
//!   stage (builder/attention_stage.py):
//!   the shared query rows, the kv-cache writes when there is no chunk, and per work item the stage itself
//!   (kv row lum_h's query rows computed into shared memory, which LOAD_Q then reads, and its k / v rows
//!   written into the cache by the block whose chunk holds the new row; a __syncthreads after).
extern "C" __global__ void __launch_bounds__({{THREADS}}) {{KERNEL}}({{PARAMS}}) {
  typedef {{IDX_T}} idx_t;
  constexpr int THREADS = {{THREADS}};
  constexpr int WARPS = THREADS / 32;
  constexpr int M = {{M}};
  constexpr int DPL = {{DPL}};
  constexpr int VPL = {{VPL}};
  constexpr int DV = {{DV}};
  constexpr int UNROLL = {{UNROLL}};
  constexpr int CHUNK = {{CHUNK}};
  static_assert(THREADS % 32 == 0 && M >= 1, "THREADS must be a multiple of 32");
  constexpr int MR = {{MERGE_ROWS}};     // query rows whose warps' partials are merged at once (M, or 1)
  // a warp's partials of a query row: VPL * 32 values, c and l; with SMEM_VECTORS (VPL a power of two) each lane
  // stores its VPL values as 16-byte vectors (2-way bank conflicts, not VPL-way), so rows start 16-byte aligned
  constexpr bool SMEM_VECTORS = {{SMEM_VECTORS}};
  constexpr int PART = SMEM_VECTORS ? VPL * 32 + 4 : VPL * 32 + 2;
  alignas(SMEM_VECTORS ? 16 : 4) __shared__ float lum_part[MR][WARPS][PART];
{{STAGE_DECL}}
{{DYN_LOADS}}
  const idx_t lum_T = {{T}};
  const idx_t lum_ns = {{NS}};
  const idx_t lum_work = (idx_t)({{HEADS}}) * lum_ns;
  const int lum_lane = (int)threadIdx.x & 31;
  const int lum_warp = (int)threadIdx.x >> 5;
{{STAGE_PRE}}
  for (idx_t lum_w = (idx_t)blockIdx.x; lum_w < lum_work; lum_w += (idx_t)gridDim.x) {
    const idx_t lum_h = lum_w / lum_ns;
    const idx_t lum_j = lum_w - lum_h * lum_ns;
{{SETUP}}
{{STAGE}}
    LUM_STAMP_AT(2);                       // stamps builds: the stage done (templates/common.cuh)
    float lum_q[M][DPL];
{{LOAD_Q}}
    float lum_c[M], lum_l[M], lum_acc[M][VPL];
#pragma unroll
    for (int lum_m = 0; lum_m < M; ++lum_m) {
      lum_c[lum_m] = -LUM_INF_F32;
      lum_l[lum_m] = 0.0f;
#pragma unroll
      for (int i = 0; i < VPL; ++i) lum_acc[lum_m][i] = 0.0f;
    }
    const idx_t lum_t0 = lum_j * CHUNK;
    const idx_t lum_t1 = lum_min(lum_T, lum_t0 + (idx_t)CHUNK);
    for (idx_t lum_tb = lum_t0; lum_tb < lum_t1; lum_tb += (idx_t)(WARPS * UNROLL)) {
      float lum_k[UNROLL][DPL], lum_v[UNROLL][VPL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const idx_t lum_t = lum_tb + (idx_t)(lum_warp * UNROLL + u);
        const bool lum_in = lum_t < lum_t1;
{{LOAD_KV}}
      }
{{KEYS_BEFORE}}
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const idx_t lum_t = lum_tb + (idx_t)(lum_warp * UNROLL + u);
        const bool lum_in = lum_t < lum_t1;
{{KEY}}
      }
{{KEYS_AFTER}}
    }
    LUM_STAMP_AT(3);                       // ... the chunk's keys done (thread 0's warp)
    // the warps' partials of the query rows, merged through shared memory MR rows at a time (one barrier
    // pair for them), each warp's factor 2^(c_w - c*) once a row
#pragma unroll
    for (int lum_m0 = 0; lum_m0 < M; lum_m0 += MR) {
      __syncthreads();
#pragma unroll
      for (int r = 0; r < MR && lum_m0 + r < M; ++r) {
        if constexpr (SMEM_VECTORS) {
          lum_store_raw<VPL>(&lum_part[r][lum_warp][lum_lane * VPL], lum_acc[lum_m0 + r]);
        } else {
#pragma unroll
          for (int i = 0; i < VPL; ++i) lum_part[r][lum_warp][lum_lane * VPL + i] = lum_acc[lum_m0 + r][i];
        }
        if (lum_lane == 0) {
          lum_part[r][lum_warp][VPL * 32] = lum_c[lum_m0 + r];
          lum_part[r][lum_warp][VPL * 32 + 1] = lum_l[lum_m0 + r];
        }
      }
      __syncthreads();
#pragma unroll
      for (int r = 0; r < MR && lum_m0 + r < M; ++r) {
        const int lum_m = lum_m0 + r;
        float lum_cs = -LUM_INF_F32;
        for (int w = 0; w < WARPS; ++w) lum_cs = fmaxf(lum_cs, lum_part[r][w][VPL * 32]);
        float lum_f[WARPS];
#pragma unroll
        for (int w = 0; w < WARPS; ++w) lum_f[w] = exp2f(lum_part[r][w][VPL * 32] - lum_cs);
        const idx_t lum_ob = {{STORE}};
        for (int d = (int)threadIdx.x; d < DV + 2; d += THREADS) {
          float lum_val = d == DV ? lum_cs : 0.0f;
          if (lum_cs != -LUM_INF_F32 && d != DV) {
            const int col = d < DV ? d : VPL * 32 + 1;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) lum_val += lum_f[w] * lum_part[r][w][col];
          }
          out[lum_ob + (idx_t)d] = lum_val;
        }
      }
    }
    LUM_STAMP_AT(4);                       // ... the partials stored
  }
}
