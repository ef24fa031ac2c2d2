//! lum/templates/gemv_stream.cu — decode GEMV that streams its weights through shared memory (the
//! "stream" scheme; gemv.cu's dot scheme computes the same sums in the same order):
//!   C[i, j] = sum_k A(i, k) * W[j, k] for j < N_OUT (and W's rows j + ACC_COLS[t] for an epilogue),
//!   W row-major with k static and every row 16-byte aligned, batch 1, A row-major (or a prologue's).
//! Why: a lane of the dot scheme holds one or two 16-byte loads in flight in registers, so a GEMV
//! launch ramps up over several DRAM round trips and the small ones never reach the copy rate. Here
//! each warp owns CPW consecutive output columns and SLOTS shared-memory slots of one column each
//! (its NACC weight rows); lane 0 fills a slot with one bulk copy per row (cp.async.bulk, completion
//! on the slot's mbarrier), so a warp has SLOTS columns of weights in flight and no register waits for
//! them. The first copies go out before the prologue computes A, so weights stream during it. The warp
//! then walks k in VEC-element vectors from the slot (lane l takes vectors l, l + 32, …, as the dot
//! scheme with GROUP = 32 does), refills the slot with its column after next, reduces with shuffles and
//! lane 0 stores (or runs the EPILOGUE). Where bulk copies are unavailable (LUM_BULK_COPY 0) or W's
//! pointer is not 16-byte aligned, lanes read W from global memory instead (vectors, or scalars when
//! misaligned): same sums, same order. The grid must cover the columns (codegen's grid or more): no
//! block walks a second range.
//!
//! Placeholders: KERNEL THREADS (32 × warps) IDX_T PARAMS DYN_LOADS A_PTR B_PTR PROLOGUE NACC ACC_COLS
//!   N_OUT HAS_EPILOGUE EPILOGUE M VEC (VEC * sizeof(B_T) == 16) SLOTS CPW A_T B_T A_LOAD B_LOAD STORE
//!   K (a constant) LDA LDB OFF_A OFF_B (C expressions of the dyn vars), as in gemv.cu.
extern "C" __global__ void __launch_bounds__({{THREADS}}) {{KERNEL}}({{PARAMS}}) {
  typedef {{IDX_T}} idx_t;
  typedef {{A_T}} a_t;
  typedef {{B_T}} b_t;
  constexpr int THREADS = {{THREADS}};
  constexpr int WARPS = THREADS / 32;
  constexpr int M = {{M}};
  constexpr int VEC = {{VEC}};
  constexpr int K = {{K}};
  constexpr int NACC = {{NACC}};
  constexpr int ACC_COLS[NACC] = {{{ACC_COLS}}};
  constexpr bool HAS_EPILOGUE = {{HAS_EPILOGUE}};
  constexpr int SLOTS = {{SLOTS}};               // columns of weights a warp has in flight
  constexpr int CPW = {{CPW}};                   // output columns per warp
  constexpr int A_PIECE = (int)(16 / sizeof(a_t)) < VEC ? (int)(16 / sizeof(a_t)) : VEC;
  static_assert(VEC * sizeof(b_t) == 16 && K % VEC == 0 && THREADS % 32 == 0, "16-byte vectors over a static k");
  static_assert(M >= 1 && M <= 8 && SLOTS >= 1 && CPW >= 1, "M in [1, 8], SLOTS and CPW >= 1");
  __shared__ lum_vec<b_t, VEC> lum_ring[WARPS][SLOTS][NACC * K / VEC];
  __shared__ unsigned long long lum_bar[WARPS][SLOTS];
{{DYN_LOADS}}
  const idx_t lum_nout = {{N_OUT}};
  const idx_t lum_lda = {{LDA}};
  const idx_t lum_ldb = {{LDB}};
  const idx_t lum_oa = {{OFF_A}};
  const idx_t lum_ob = {{OFF_B}};
  auto lum_ca = [](a_t lum_x) -> float { return {{A_LOAD}}; };
  auto lum_cb = [](b_t lum_x) -> float { return {{B_LOAD}}; };
  auto lum_store = [&](idx_t lum_o, float lum_v) { out[lum_o] = {{STORE}}; };
  const int lum_w = (int)threadIdx.x / 32;
  const int lum_lane = (int)threadIdx.x % 32;
  const idx_t lum_c_lo = ((idx_t)blockIdx.x * WARPS + lum_w) * CPW;
  const idx_t lum_c_hi = lum_c_lo + CPW < lum_nout ? lum_c_lo + CPW : lum_nout;
  const b_t* const lum_w0 = {{B_PTR}} + lum_ob;   // W's row j is lum_w0 + j * lum_ldb
  const bool lum_w_vec = lum_aligned(lum_w0, 16);  // every row too: codegen checked ldb and the offset
  const bool lum_bulk = LUM_BULK_COPY && lum_w_vec;
  auto lum_fill = [&](idx_t lum_c, int lum_s) {   // lane 0: column lum_c's rows into slot lum_s
    if (lum_lane != 0 || !lum_bulk) return;
    lum_mbar_expect(&lum_bar[lum_w][lum_s], (unsigned)(NACC * K * sizeof(b_t)));
#pragma unroll
    for (int t = 0; t < NACC; ++t) {
      lum_bulk_load(&lum_ring[lum_w][lum_s][t * (K / VEC)], lum_w0 + (lum_c + ACC_COLS[t]) * lum_ldb,
                    (unsigned)(K * sizeof(b_t)), &lum_bar[lum_w][lum_s]);
    }
  };
  if (lum_lane == 0 && lum_bulk) {
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) lum_mbar_init(&lum_bar[lum_w][s]);
  }
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) {
    if (lum_c_lo + s < lum_c_hi) lum_fill(lum_c_lo + s, s);
  }
  __syncwarp();                                    // the barriers are initialised before any lane waits
{{PROLOGUE}}  const a_t* const lum_ap = {{A_PTR}} + lum_oa;
  const bool lum_a_vec = lum_aligned(lum_ap, A_PIECE * sizeof(a_t));
  for (idx_t lum_c = lum_c_lo; lum_c < lum_c_hi; ++lum_c) {
    const int lum_i = (int)(lum_c - lum_c_lo);
    const int lum_s = lum_i % SLOTS;
    if (lum_bulk) lum_mbar_wait(&lum_bar[lum_w][lum_s], (unsigned)((lum_i / SLOTS) & 1));
    float lum_acc[NACC * M];  // [t * M + i]: row i of product column lum_c + ACC_COLS[t]
#pragma unroll
    for (int r = 0; r < NACC * M; ++r) lum_acc[r] = 0.0f;
#pragma unroll 4
    for (int lum_q = lum_lane * VEC; lum_q < K; lum_q += 32 * VEC) {
      float lum_bv[NACC][VEC];
#pragma unroll
      for (int t = 0; t < NACC; ++t) {
        const b_t* lum_bp = lum_bulk ? lum_ring[lum_w][lum_s][t * (K / VEC) + lum_q / VEC].v
                                     : lum_w0 + (lum_c + ACC_COLS[t]) * lum_ldb + lum_q;
        if (lum_w_vec) {
          lum_load_f32<VEC>(lum_bp, lum_bv[t], lum_cb);
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) lum_bv[t][e] = lum_cb(lum_bp[e]);
        }
      }
#pragma unroll
      for (int i = 0; i < M; ++i) {
        float lum_av[VEC];
        if (lum_a_vec) {
          lum_load_f32<VEC>(lum_ap + i * lum_lda + lum_q, lum_av, lum_ca);
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) lum_av[e] = lum_ca(lum_ap[i * lum_lda + lum_q + e]);
        }
#pragma unroll
        for (int t = 0; t < NACC; ++t) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) lum_acc[t * M + i] += lum_av[e] * lum_bv[t][e];
        }
      }
    }
    __syncwarp();                                  // every lane is done with the slot: refill it
    if (lum_c + SLOTS < lum_c_hi) lum_fill(lum_c + SLOTS, lum_s);
#pragma unroll
    for (int r = 0; r < NACC * M; ++r) lum_acc[r] = lum_warp_reduce<LumSum, 32>(lum_acc[r]);
    if (lum_lane == 0) {
      const idx_t lum_b = 0;
      const idx_t lum_j = lum_c;
      if (!HAS_EPILOGUE) {
#pragma unroll
        for (int i = 0; i < M; ++i) lum_store((lum_b * M + i) * lum_nout + lum_j, lum_acc[i]);
      }
{{EPILOGUE}}
    }
  }
}
