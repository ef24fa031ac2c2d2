//! lum/templates/gemv_combine.cu — decode attention's combine and o, split by head, as one kernel
//! (builder/o_combine.py). The LLIR keeps both ops: the combine R (a reduce over the chunks whose prologue is
//! Σ_j E·A · Recip(Σ_j E·L), E = Exp2(X + RowMax(X)·K): X the chunks' offsets c, L their sums l, A their
//! accumulators) and o, a GEMV over R's HEADS · D values, out[j] = Σ_h Σ_d R[h·D + d] · B(h·D + d, j). This
//! kernel computes out from the partials without storing R.
//!
//! A block takes HPB consecutive heads (a head group: DB = HPB · D of o's inputs, contiguous in B's k), a cluster
//! RANKS blocks, RANKS · HPB = the heads. Work item w = (column group g, head group r) = (w / RANKS, w % RANKS),
//! walked grid-stride in whole clusters of RANKS blocks (launched so; the block of rank r takes head group r).
//! Before its wait a block copies its group's DB weights of each of its COLS columns into shared memory (16-byte
//! asynchronous copies: B is a weight). After it, thread t < DB (head s = t / D of the group, feature t % D)
//! loads its A of ROUND chunks (and threads < 2 ROUND HPB the chunks' c and l of each head, through shared
//! memory) before it uses any: one round of loads for up to ROUND chunks. The sums are kept at a running maximum
//! m of the head's X and multiplied by Exp2((m' − m)·K) when it grows to m' (exact for the combine's integer
//! offsets), as builder/row_codegen.py's one-visit row; the quotient is taken once and rounded to R's dtype, the
//! value o reads. Then the block's dot over its DB inputs: lane l of a warp owns 16-byte vector l % LPC of a
//! column (NV of them when a column has more than 32), the warp's 32 / LPC segments each a column at a time, CPS
//! columns a segment, reduced by halving shuffles (a lane keeps half of its columns at each step while there are
//! two or more) and plain ones after. Each column's value goes into the shared memory of the cluster block that
//! owns it (rank c % RANKS, distributed shared memory), and after one cluster barrier each owner adds its
//! columns' RANKS values in group order: o's output, the same sum on every run.
//!
//! Placeholders: KERNEL THREADS MIN_BLOCKS IDX_T PARAMS DYN_LOADS (trigger and dyn reads, no wait); D COLS ROUND
//!   VEC LPC NV CPS HPB RANKS GROUPS (column groups);
//!   W_T (B's storage) W_PTR (B's parameter) W_LOAD (float of lum_wv[e]) R_ROUND (the float lum_y rounded to
//!   R's dtype) OUT (o's output parameter) OUT_STORE (its storage of the float lum_v0); NS N (C expressions of the dyn vars); SETUP (unravel head lum_h into R's head dims:
//!   lum_i*); X_AT, L_AT (physical index of X, L at head lum_h, chunk lum_j), A_AT (of A at chunk lum_j, feature
//!   lum_d), K_VAL (the float K of head lum_h), X_LOAD L_LOAD A_LOAD (float value of the leaf at index lum_q),
//!   B_AT (physical index of B's vector at head group lum_r, column lum_c, inputs lum_k ..), OUT_AT (out's index
//!   of column lum_c).
extern "C" __global__ void __launch_bounds__({{THREADS}}{{MIN_BLOCKS}}) {{KERNEL}}({{PARAMS}}) {
  typedef {{IDX_T}} idx_t;
  typedef {{W_T}} w_t;
  constexpr int THREADS = {{THREADS}}, WARPS = THREADS / 32;
  constexpr int D = {{D}};             // a head's features
  constexpr int HPB = {{HPB}};         // heads a block
  constexpr int DB = HPB * D;          // a block's inputs of o
  constexpr int COLS = {{COLS}};       // output columns a block
  constexpr int ROUND = {{ROUND}};     // chunks a round of loads
  constexpr int VEC = {{VEC}};         // weights a 16-byte vector
  constexpr int LPC = {{LPC}};         // lanes a column (its DB / VEC vectors, at most 32)
  constexpr int NV = {{NV}};           // vectors a lane of a column
  constexpr int CPS = {{CPS}};         // columns a warp's segment of LPC lanes takes
  constexpr int RANKS = {{RANKS}};     // blocks a cluster: head groups
  constexpr int SEGS = 32 / LPC;
  static_assert(THREADS % 32 == 0 && THREADS >= DB && THREADS >= 2 * ROUND * HPB,
                "threads: a warp multiple, >= DB, >= 2 ROUND HPB");
  static_assert(LPC * NV * VEC == DB && (LPC & (LPC - 1)) == 0 && LPC <= 32, "a column is LPC lanes of NV vectors");
  static_assert(COLS == WARPS * SEGS * CPS && (CPS & (CPS - 1)) == 0, "a block's columns: warps x segments x CPS");
  static_assert(VEC * sizeof(w_t) == 16, "weights move in 16-byte vectors");
#if defined(__CUDA_ARCH__)
  extern __shared__ lum_vec<unsigned, 4> lum_ws[];       // [COLS][DB / VEC]: the group's weights of each column
#else
  static lum_vec<unsigned, 4> lum_ws[COLS * (DB / VEC)];
#endif
  constexpr int OWN = (COLS + RANKS - 1) / RANKS;   // columns a block owns: c % RANKS == its rank
  constexpr int GROUPS = {{GROUPS}};                  // column groups (host emulation's sums)
  // a lane reads its VEC inputs of lum_as and its weights as 16-byte vectors, once for all its columns (float
  // reads, VEC apart across the lanes, were VEC-way bank conflicts: benchmarks/NOTES.md, 1d5fc3e)
  alignas(16) __shared__ float lum_as[DB];
  __shared__ float lum_cl[2][HPB][ROUND];
  __shared__ float lum_push[RANKS][OWN];             // the head groups' sums of the columns this block owns
{{DYN_LOADS}}
  const idx_t lum_ns = {{NS}};
  const idx_t lum_n = {{N}};
  const idx_t lum_groups = (lum_n + COLS - 1) / COLS;
  const int lum_tx = (int)threadIdx.x, lum_warp = lum_tx / 32, lum_lane = lum_tx % 32;
  auto lum_w_copy = [&](idx_t lum_w) {   // the weights of work item lum_w into lum_ws (copies in flight)
    const idx_t lum_r = lum_w % RANKS, lum_c0 = lum_w / RANKS * COLS;
    for (int lum_i = lum_tx; lum_i < COLS * (DB / VEC); lum_i += THREADS) {
      const idx_t lum_c = lum_c0 + lum_i / (DB / VEC);
      const idx_t lum_k = (idx_t)(lum_i % (DB / VEC)) * VEC;
      if (lum_c < lum_n) lum_copy16_async(&lum_ws[lum_i], {{W_PTR}} + ({{B_AT}}));
    }
  };
  // the leaves' physical indexes at head lum_h (R's head dims unravelled), chunk lum_j, feature lum_d
  auto lum_x_at = [&](idx_t lum_h, idx_t lum_j) -> idx_t {
{{SETUP}}
    return {{X_AT}};
  };
  auto lum_l_at = [&](idx_t lum_h, idx_t lum_j) -> idx_t {
{{SETUP}}
    return {{L_AT}};
  };
  auto lum_a_at = [&](idx_t lum_h, idx_t lum_j, int lum_d) -> idx_t {
{{SETUP}}
    return {{A_AT}};
  };
  auto lum_k_of = [&](idx_t lum_h) -> float {
{{SETUP}}
    return {{K_VAL}};
  };
  if ((idx_t)blockIdx.x < RANKS * lum_groups) lum_w_copy((idx_t)blockIdx.x);
  lum_pdl_wait();   // common.cuh: the partials are written and visible from here
  for (idx_t lum_w = (idx_t)blockIdx.x; lum_w < RANKS * lum_groups; lum_w += (idx_t)gridDim.x) {
    if (lum_w != (idx_t)blockIdx.x) {    // a later item: its weights now (the block's earlier reads are done)
      __syncthreads();
      lum_w_copy(lum_w);
    }
    const idx_t lum_r = lum_w % RANKS, lum_c0 = lum_w / RANKS * COLS;
    const int lum_s = lum_tx / D, lum_d = lum_tx % D;     // this thread's head of the group, its feature
    const idx_t lum_h = lum_r * HPB + (lum_s < HPB ? lum_s : 0);
    const float lum_kf = lum_k_of(lum_h);
    float lum_m = -LUM_INF_F32, lum_sl = 0.0f, lum_sa = 0.0f;
    for (idx_t lum_j0 = 0; lum_j0 < lum_ns; lum_j0 += ROUND) {
      float lum_a[ROUND];
#pragma unroll
      for (int u = 0; u < ROUND; ++u) {
        const idx_t lum_j = lum_j0 + u;
        float lum_x = 0.0f;
        if (lum_tx < DB && lum_j < lum_ns) {
          const idx_t lum_q = lum_a_at(lum_h, lum_j, lum_d);
          lum_x = {{A_LOAD}};
        }
        lum_a[u] = lum_x;
      }
      if (lum_tx < 2 * ROUND * HPB) {    // thread (leaf, head s of the group, chunk u): c for leaf 0, l for 1
        const int lum_lf = lum_tx / (ROUND * HPB), lum_ls = lum_tx / ROUND % HPB, lum_u = lum_tx % ROUND;
        const idx_t lum_j = lum_j0 + lum_u, lum_lh = lum_r * HPB + lum_ls;
        float lum_x = lum_lf == 0 ? -LUM_INF_F32 : 0.0f;
        if (lum_j < lum_ns) {
          if (lum_lf == 0) {
            const idx_t lum_q = lum_x_at(lum_lh, lum_j);
            lum_x = {{X_LOAD}};
          } else {
            const idx_t lum_q = lum_l_at(lum_lh, lum_j);
            lum_x = {{L_LOAD}};
          }
        }
        lum_cl[lum_lf][lum_ls][lum_u] = lum_x;
      }
      __syncthreads();
      const int lum_cs = lum_s < HPB ? lum_s : 0;   // threads past DB follow head 0 (their sums are unused)
      float lum_mr = lum_m;
#pragma unroll
      for (int u = 0; u < ROUND; ++u) lum_mr = fmaxf(lum_mr, lum_cl[0][lum_cs][u]);
      if (lum_mr > lum_m) {              // the sums so far, to the new maximum
        const float lum_f = lum_m == -LUM_INF_F32 ? 0.0f : exp2f((lum_mr - lum_m) * lum_kf);
        lum_sl *= lum_f;
        lum_sa *= lum_f;
        lum_m = lum_mr;
      }
#pragma unroll
      for (int u = 0; u < ROUND; ++u) {
        const float lum_x = lum_cl[0][lum_cs][u];
        if (lum_x != -LUM_INF_F32) {     // a masked chunk (no finite logit) or one past the chunks adds nothing
          const float lum_e = exp2f(lum_x + lum_m * lum_kf);
          lum_sl += lum_e * lum_cl[1][lum_cs][u];
          lum_sa += lum_e * lum_a[u];
        }
      }
      __syncthreads();                   // lum_cl is read by every thread before the next round writes it
    }
    if (lum_tx < DB) {
      const float lum_y = lum_sa * (1.0f / lum_sl);
      lum_as[lum_tx] = {{R_ROUND}};
    }
    lum_copy_wait_all();
    __syncthreads();
    // the dot: segment s of a warp takes columns (warp · SEGS + s) · CPS + c, c < CPS
    const int lum_seg = lum_lane / LPC, lum_sl_lane = lum_lane % LPC;
    float lum_v[CPS];
    float lum_ar[NV][VEC];               // this lane's inputs, read once for all its columns
#pragma unroll
    for (int i = 0; i < NV; ++i) lum_load_raw<VEC>(&lum_as[(lum_sl_lane + i * LPC) * VEC], lum_ar[i]);
#pragma unroll
    for (int c = 0; c < CPS; ++c) {
      const int lum_col = (lum_warp * SEGS + lum_seg) * CPS + c;
      float lum_acc = 0.0f;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        w_t lum_wv[VEC];
        lum_load_raw<VEC>(reinterpret_cast<const w_t*>(&lum_ws[lum_col * (DB / VEC) + lum_sl_lane + i * LPC]),
                          lum_wv);
#pragma unroll
        for (int e = 0; e < VEC; ++e) lum_acc += lum_ar[i][e] * {{W_LOAD}};
      }
      lum_v[c] = lum_acc;
    }
    // halving: at offset o (LPC / 2 down to 1) a lane with bit o keeps the upper half of its k columns
    int lum_cb = 0;                      // this lane's first column, among the segment's CPS
#pragma unroll
    for (int o = LPC / 2, k = CPS / 2; o >= 1; o >>= 1, k = k > 1 ? k / 2 : 0) {
      if (k >= 1) {
        const bool lum_hi = lum_sl_lane & o;
#pragma unroll
        for (int c = 0; c < k; ++c) {
          const float lum_send = lum_hi ? lum_v[c] : lum_v[c + k], lum_keep = lum_hi ? lum_v[c + k] : lum_v[c];
          lum_v[c] = lum_keep + __shfl_xor_sync(0xffffffffu, lum_send, o);
        }
        lum_cb += lum_hi ? k : 0;
      } else {
        lum_v[0] += __shfl_xor_sync(0xffffffffu, lum_v[0], o);
      }
    }
    // the block's columns go to their owners: column c of the group to block c % RANKS of the cluster, slot
    // [r][c / RANKS] there; after one cluster barrier each block sums its own over the head groups, in order
    constexpr int HELD = CPS > LPC ? CPS / LPC : 1;   // columns a lane holds now (lanes hold one if CPS <= LPC)
    const bool lum_holds = CPS >= LPC || lum_sl_lane % (LPC / CPS) == 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (lum_holds) {
#pragma unroll
      for (int c = 0; c < HELD; ++c) {
        const int lum_col = (lum_warp * SEGS + lum_seg) * CPS + lum_cb + c;
        lum_push_to(&lum_push[lum_r][lum_col / RANKS], (unsigned)(lum_col % RANKS), lum_v[c]);
      }
    }
    lum_cluster_sync();                  // every group's columns are in their owners' lum_push
    for (int lum_i = lum_tx; lum_i < OWN; lum_i += THREADS) {
      const idx_t lum_c = lum_c0 + lum_i * RANKS + (int)lum_r;
      if (lum_i * RANKS + (int)lum_r < COLS && lum_c < lum_n) {
        float lum_v0 = 0.0f;
#pragma unroll
        for (int r = 0; r < RANKS; ++r) lum_v0 += lum_push[r][lum_i];
        {{OUT}}[{{OUT_AT}}] = {{OUT_STORE}};
      }
    }
    if (lum_w + (idx_t)gridDim.x < RANKS * lum_groups) lum_cluster_sync();   // the owners have read lum_push
#elif defined(__CUDA_ARCH__)
#error "a combine inside o runs in thread block clusters: sm_90 or newer (builder/o_combine.py)"
#else
    // host emulation: blocks run one after another, a cluster's in rank order, so the last rank sums the group
    static float lum_host_push[GROUPS][RANKS][COLS];
    const idx_t lum_g = lum_w / RANKS;
    if (lum_holds) {
      for (int c = 0; c < HELD; ++c)
        lum_host_push[lum_g][lum_r][(lum_warp * SEGS + lum_seg) * CPS + lum_cb + c] = lum_v[c];
    }
    __syncthreads();
    if (lum_r == RANKS - 1) {
      for (int lum_col = lum_tx; lum_col < COLS; lum_col += THREADS) {
        const idx_t lum_c = lum_c0 + lum_col;
        if (lum_c < lum_n) {
          float lum_v0 = 0.0f;
          for (int r = 0; r < RANKS; ++r) lum_v0 += lum_host_push[lum_g][r][lum_col];
          {{OUT}}[{{OUT_AT}}] = {{OUT_STORE}};
        }
      }
    }
#endif
  }
}
