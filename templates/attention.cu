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
//!
//! With COMBINE the kernel also runs the reduce that combines the chunks (builder/attention_combine.py:
//! the launch table names it a tail, its output is t0_out), out = Σ_j 2^(c_j − c*) acc_j / Σ_j 2^(c_j − c*)
//! l_j (lum_combine: c* first, the offsets strided over the threads, then every thread its outputs with all
//! chunks' loads independent), once every chunk of a kv row has stored its partials:
//! * COUNTED: each work item's block counts itself done on its kv row's counter (lum_count_done,
//!   common.cuh); the block that counts last for kv row h combines h's query rows and resets the counter
//!   for the next launch (a kv row of one chunk counts nothing).
//! * CLUSTERED, a cluster per kv row (sm_90, launched with clusters of CLUSTER blocks): block `rank` of
//!   kv row h's cluster takes h's chunks j = rank (mod CLUSTER); after the cluster's barrier
//!   (lum_cluster_sync, common.cuh: a hardware barrier, release / acquire at cluster scope) the cluster's
//!   last SHARE blocks each combine a part of h's query rows (SHARE = CLUSTER on the GPU; 1 in host
//!   emulation, which runs blocks one after another). No counter, no atomic, no kernel of its own.
//!
//! Placeholders: KERNEL THREADS IDX_T PARAMS DYN_LOADS; M DPL VPL DV UNROLL CHUNK MERGE_ROWS; T (keys), NS (chunks),
//!   HEADS (kv rows), SETUP (unravel lum_h, bases of k / v / q / out), LOAD_Q (lum_q[m][i]), LOAD_KV
//!   (lum_k[u][i], lum_v[u][i] of key lum_t, zeros past lum_t1), KEY (the softmax update of every query
//!   row for key lum_t of slot u; or, batched, only its logits, with KEYS_BEFORE declaring them and
//!   KEYS_AFTER updating each query row once for the step's UNROLL keys: one maximum, one rescale), STORE (the out offset of query row lum_m's chunk lum_j); COMBINE (0 | 1),
//!   COUNTED, CLUSTERED (0 | 1: which combine), UNCLUSTERED (1 - CLUSTERED), CLUSTER (blocks a cluster when
//!   CLUSTERED, else 1), COUNTERS (kv rows: the counters' length, 1 unless COUNTED), PART0 (the out offset of query row
//!   lum_m's chunk 0), COMBINED (the t0_out offset of query row lum_m), COMBINE_STORE (the storage value of
//!   the float lum_v in t0_out), COMBINED_N (t0_out's elements), COMBINE_ZERO (0 in its storage); all 0
//!   without COMBINE. STAGE_DECL, STAGE_PRE, STAGE: empty, or an attention stage (builder/attention_stage.py):
//!   the shared query rows, the kv-cache writes when there is no chunk, and per work item the stage itself
//!   (kv row lum_h's query rows computed into shared memory, which LOAD_Q then reads, and its k / v rows
//!   written into the cache by the block whose chunk holds the new row; a __syncthreads after). KV_DECL:
//!   the step's lum_k / lum_v, or empty where KV_AHEAD (the stage's ahead form) declares them and loads the
//!   first step's keys before the stage (LOAD_KV then skips that step; the stage puts the row it wrote in).
#if {{CLUSTERED}}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "an attention kernel that combines in clusters needs sm_90"
#endif
#endif
#if {{COUNTED}}
__device__ unsigned int {{KERNEL}}_count[{{COUNTERS}}];   // per kv row: chunks of the running launch done
#endif
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
  __shared__ float lum_part[MR][WARPS][VPL * 32 + 2];
{{STAGE_DECL}}
#if {{COUNTED}}
  __shared__ unsigned int lum_last;      // this block counted last for its kv row
  constexpr int SHARE = 1;               // one block combines a kv row
#endif
#if {{CLUSTERED}}
  constexpr int CL = {{CLUSTER}};        // blocks a cluster: one kv row's
  constexpr int SHARE = LUM_CLUSTER_SHARE(CL);   // of them, the last SHARE combine its rows, each a part
#endif
{{DYN_LOADS}}
  const idx_t lum_T = {{T}};
  const idx_t lum_ns = {{NS}};
  const idx_t lum_work = (idx_t)({{HEADS}}) * lum_ns;
  const int lum_lane = (int)threadIdx.x & 31;
  const int lum_warp = (int)threadIdx.x >> 5;
{{STAGE_PRE}}
#if {{COMBINE}}
  if (lum_ns == 0) {   // no chunk: the combine of no partials is 0 (a reduce over an empty axis)
    for (idx_t i = (idx_t)blockIdx.x * THREADS + threadIdx.x; i < (idx_t)({{COMBINED_N}}); i += (idx_t)gridDim.x * THREADS)
      t0_out[i] = {{COMBINE_ZERO}};
  }
#endif
#if {{COMBINE}}
  // The combine of kv row lum_h's query rows from its chunks' partials (stored by now, made visible by the
  // caller's acquire): part lum_si of SHARE, each thread its outputs e = (lum_si * THREADS + threadIdx.x)
  // + k * SHARE * THREADS of the M x DV, all chunks' loads independent: Σ_j 2^(c_j − c*) acc_j /
  // Σ_j 2^(c_j − c*) l_j (a chunk without a finite logit weighs 2^(−inf) = 0; a row without one has
  // c* = −inf and is NaN, as unfused). c* of each query row first: the chunks' offsets, strided over the
  // threads, then across the warps through lum_part.
  auto lum_combine = [&](const idx_t lum_h, const int lum_si) {
{{SETUP}}
    float lum_mx[M];
#pragma unroll
    for (int lum_m = 0; lum_m < M; ++lum_m) {
      const idx_t lum_pb = {{PART0}};
      lum_mx[lum_m] = -LUM_INF_F32;
      for (idx_t j = threadIdx.x; j < lum_ns; j += THREADS)
        lum_mx[lum_m] = fmaxf(lum_mx[lum_m], lum_load_cg(out + lum_pb + j * (idx_t)(DV + 2) + DV));
      lum_mx[lum_m] = lum_warp_reduce<LumMax, 32>(lum_mx[lum_m]);
    }
    __syncthreads();                     // lum_part is free: every warp has combined its rows
    if (lum_lane == 0) {
#pragma unroll
      for (int lum_m = 0; lum_m < M; ++lum_m) lum_part[0][lum_warp][lum_m] = lum_mx[lum_m];
    }
    __syncthreads();
#pragma unroll
    for (int lum_m = 0; lum_m < M; ++lum_m) {
      for (int w = 0; w < WARPS; ++w) lum_mx[lum_m] = fmaxf(lum_mx[lum_m], lum_part[0][w][lum_m]);
    }
    constexpr int E = (M * DV + SHARE * THREADS - 1) / (SHARE * THREADS);
    const int lum_e0 = lum_si * THREADS + (int)threadIdx.x;
    float lum_sl[E], lum_sa[E];
#pragma unroll
    for (int k = 0; k < E; ++k) { lum_sl[k] = 0.0f; lum_sa[k] = 0.0f; }
#pragma unroll 4
    for (idx_t j = 0; j < lum_ns; ++j) {
#pragma unroll
      for (int k = 0; k < E; ++k) {
        const int e = lum_e0 + k * SHARE * THREADS, lum_m = e / DV, d = e - lum_m * DV;
        if (e < M * DV) {
          const idx_t lum_pb = {{PART0}};
          const float* lum_pj = out + lum_pb + j * (idx_t)(DV + 2);
          float lum_cs = lum_mx[0];
#pragma unroll
          for (int q = 1; q < M; ++q) lum_cs = q == lum_m ? lum_mx[q] : lum_cs;
          const float lum_w = exp2f(lum_load_cg(lum_pj + DV) - lum_cs);
          lum_sl[k] += lum_w * lum_load_cg(lum_pj + DV + 1);
          lum_sa[k] += lum_w * lum_load_cg(lum_pj + d);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const int e = lum_e0 + k * SHARE * THREADS, lum_m = e / DV, d = e - lum_m * DV;
      if (e < M * DV) {
        const idx_t lum_cb = {{COMBINED}};
        const float lum_v = lum_sa[k] * (1.0f / lum_sl[k]);
        t0_out[lum_cb + (idx_t)d] = {{COMBINE_STORE}};
      }
    }
  };
#endif
#if {{CLUSTERED}}
  // a cluster of CL blocks per kv row: block r = blockIdx.x % CL takes the row's chunks j = r (mod CL)
  for (idx_t lum_hc = (idx_t)blockIdx.x / CL; lum_hc < (idx_t)({{HEADS}}); lum_hc += (idx_t)gridDim.x / CL) {
  for (idx_t lum_w = lum_hc * lum_ns + (idx_t)(blockIdx.x % CL); lum_w < (lum_hc + 1) * lum_ns; lum_w += CL) {
#endif
#if {{UNCLUSTERED}}
  for (idx_t lum_w = (idx_t)blockIdx.x; lum_w < lum_work; lum_w += (idx_t)gridDim.x) {
#endif
    const idx_t lum_h = lum_w / lum_ns;
    const idx_t lum_j = lum_w - lum_h * lum_ns;
{{SETUP}}
{{KV_AHEAD}}
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
{{KV_DECL}}
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
#pragma unroll
        for (int i = 0; i < VPL; ++i) lum_part[r][lum_warp][lum_lane * VPL + i] = lum_acc[lum_m0 + r][i];
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
#if {{COUNTED}}
    __syncthreads();                       // this block's partials are stored
    if (threadIdx.x == 0) {
      if (lum_ns == 1) {
        lum_last = 1u;                     // the only chunk: no count
      } else {
        lum_last = lum_count_done(&{{KERNEL}}_count[lum_h]) == (unsigned int)(lum_ns - 1) ? 1u : 0u;
        if (lum_last) {{KERNEL}}_count[lum_h] = 0u;   // every chunk of h counted: ready for the next launch
      }
    }
    __syncthreads();
    if (lum_last) lum_combine(lum_h, 0);
#endif
  }
#if {{CLUSTERED}}
  lum_cluster_sync();                      // every chunk of kv row lum_hc has stored its partials
  if (lum_ns > 0 && (int)(blockIdx.x % CL) >= CL - SHARE) lum_combine(lum_hc, (int)(blockIdx.x % CL) - (CL - SHARE));
  }
#endif
}
