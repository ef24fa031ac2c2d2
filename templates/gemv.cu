//! lum/templates/gemv.cu — LLIR gemm with a small static m (M <= 8 rows: decode GEMV), run by lum's own
//! kernel instead of cuBLASLt: n, k, batch, leading dims, batch strides and offsets are read from the dyn
//! buffer, so a captured CUDA graph stays valid as they follow the past length (decode attention: p + 1).
//!
//! C[b, i, j] = sum_k A(b, i, k) * B(b, k, j), accumulated in float, stored row-major [batch, M, n]:
//!   A(b, i, k) = in0[OFF_A + b * STRIDE_A + (A_KCONTIG ? i * LDA + k : i + k * LDA)]   (A Rm / Cm)
//!   B(b, k, j) = in1[OFF_B + b * STRIDE_B + (B_KCONTIG ? k + j * LDB : k * LDB + j)]   (B Cm / Rm)
//! Two schemes, picked by B's majorness:
//!  * dot (B_KCONTIG: x @ W^T with W [n, k] row-major — every Linear layer in decode): GROUP threads own
//!    one column j of the flattened (batch, n) range and walk its k in VEC-element (16-byte) vector
//!    loads of B (and of A when A is row-major), each thread keeping M partial sums. With INFLIGHT > 0 a
//!    lane issues INFLIGHT vector loads of B (A_EARLY: of A too) before it uses any, so that many are in
//!    flight whatever the compiler schedules (left to it, the UNROLL-times unrolled loop of 0 keeps
//!    about two: ptxas interleaves each load with the previous vector's multiply-adds); the group
//!    combines them with warp shuffles and, for GROUP > 32 (split-K across warps),
//!    through shared memory. A block tile is THREADS / GROUP columns, walked grid-stride.
//!  * cols (B row-major, n contiguous — probs @ V): a thread owns VEC consecutive columns (one vector
//!    load of B per k), THREADS / GROUP threads span a tile of columns and GROUP k-slices split k; the
//!    slices' partial sums meet in shared memory, one output row at a time. Tiles are walked grid-stride.
//! With a fused prologue (dot scheme only) A is not read from a buffer: every block first computes it
//! into shared memory (PROLOGUE: all threads walk A's rows, a row kernel's phases included — the input's
//! RMSNorm), then runs the dot product on it. With a fused epilogue (dot scheme only) a group computes
//! NACC product columns j + ACC_COLS[t] at once (A read once for all) and EPILOGUE stores a function of
//! them for output column j < N_OUT — gelu(gate)·up from the stacked gate/up weight.
//! VEC_OK is the part of the alignment condition codegen could not decide (offsets, strides, leading
//! dims divisible by the vector width); the pointers are checked here. When it fails, scalar loads do
//! the same work; the k tail beyond whole vectors (dot) and the n tail (cols) are scalar too. All loops
//! are uniform per block (shuffles, __syncthreads), so any grid >= 1 is correct; n, k or batch = 0 are
//! fine (k = 0 writes zeros). With PRELOAD > 0 (dot scheme, the plain loop) each lane loads the first
//! PRELOAD vectors of its column of the block's first tile into registers before it waits for the previous
//! kernel (lum_pdl_wait, common.cuh) and before any prologue: under programmatic launch those loads are in
//! flight while that kernel still runs, and they overlap the prologue's row either way; the loop then
//! starts after them. With PRELOAD_SHARED the preload goes to dynamic shared memory instead (per-thread
//! asynchronous copies, common.cuh lum_copy16_async: no register holds them, so PRELOAD may be every vector
//! of the lane's first column), slot [u][t][thread] of 16 bytes; each thread reads back only its own slots,
//! after lum_copy_wait_all, so no barrier orders them. The sums are the plain loop's, in its order. (Weight
//! prefetch hints, per-thread cp.async staging of every tile and a bulk-copy preload into shared memory were
//! tried here and measured slower: benchmarks/NOTES.md.)
//!
//! Placeholders: KERNEL THREADS MIN_BLOCKS (empty, or ", b": blocks an SM must hold) IDX_T PARAMS DYN_LOADS;
//!   A_PTR B_PTR (the operands: in0 / in1, or the prologue's shared array and the last input), PROLOGUE
//!   (empty, or the code that fills lum_as); NACC ACC_COLS N_OUT HAS_EPILOGUE (1, 0, N, false without an
//!   epilogue), EPILOGUE (empty, or the code that stores output column lum_j of every row from lum_acc);
//!   M (rows, 1..8), GROUP (threads reducing one output, a power of two <= THREADS), VEC (elements per
//!   vector access of B, VEC * sizeof(B_T) <= 16), UNROLL (k-loop unroll), INFLIGHT (vector loads of B a
//!   lane issues ahead; 0: the unrolled loop), PRELOAD (dot scheme, plain loop: vectors of B per lane of
//!   its first column that it loads into registers before the wait; 0: none), PRELOAD_SHARED (true: into
//!   the launch's dynamic shared memory, THREADS * PRELOAD * NACC * 16 bytes), B_STREAM (dot scheme: B's
//!   vectors loaded with an L2 evict-first policy, common.cuh lum_load_stream; B must be read-only), A_EARLY
//!   (true: INFLIGHT loads of A too), AHEAD_EARLY (true: B a weight, no PRELOAD: the lines of the first step of
//!   the block's first tile, INFLIGHT vectors a lane or the plain loop's UNROLL, are asked of L2 before the wait,
//!   builder/gemv_policy.py gemv_ahead_after_gemv),
//!   A_KCONTIG B_KCONTIG (true | false), A_T B_T (storage types), A_LOAD
//!   B_LOAD (float value of storage `lum_x`), STORE (output storage value of the float `lum_v`), N K BATCH
//!   LDA LDB STRIDE_A STRIDE_B OFF_A OFF_B (C expressions of the dyn vars), VEC_OK (C bool expression).
extern "C" __global__ void __launch_bounds__({{THREADS}}{{MIN_BLOCKS}}) {{KERNEL}}({{PARAMS}}) {
  typedef {{IDX_T}} idx_t;
  typedef {{A_T}} a_t;
  typedef {{B_T}} b_t;
  constexpr int THREADS = {{THREADS}};
  constexpr int M = {{M}};
  constexpr int GROUP = {{GROUP}};
  constexpr int VEC = {{VEC}};
  constexpr bool A_KCONTIG = {{A_KCONTIG}};
  constexpr bool B_KCONTIG = {{B_KCONTIG}};
  constexpr int SPAN = THREADS / GROUP;  // dot: columns per block tile; cols: threads along n
  constexpr int WARP_W = GROUP < 32 ? GROUP : 32;
  constexpr int A_PIECE = (int)(16 / sizeof(a_t)) < VEC ? (int)(16 / sizeof(a_t)) : VEC;  // A elements per access
  constexpr int NACC = {{NACC}};                 // product columns per output column (dot scheme)
  constexpr int ACC_COLS[NACC] = {{{ACC_COLS}}};
  constexpr bool HAS_EPILOGUE = {{HAS_EPILOGUE}};
  constexpr int INFLIGHT = {{INFLIGHT}};         // dot scheme: 0 = one vector a step, unrolled by the compiler
  constexpr int UNROLL = {{UNROLL}};             // ... that many times
  constexpr bool B_STREAM = {{B_STREAM}};        // dot scheme: B is a weight, read once: lum_load_stream
  constexpr int U = INFLIGHT > 0 ? INFLIGHT : 1;
  constexpr int PRELOAD = {{PRELOAD}};           // dot scheme: first-tile vectors of B a lane loads before the wait
  constexpr bool PRELOAD_SHARED = {{PRELOAD_SHARED}};   // ... into shared memory (16-byte vectors), not registers
  constexpr bool A_EARLY = {{A_EARLY}};           // INFLIGHT > 0: A's vectors too are loaded ahead (M = 1, A_KCONTIG)
  constexpr bool AHEAD_EARLY = {{AHEAD_EARLY}};   // the first step's B asked of L2 before the wait
  static_assert(!A_EARLY || (M == 1 && A_KCONTIG), "A_EARLY loads one k-contiguous row of A");
  static_assert(PRELOAD == 0 || (INFLIGHT == 0 && B_KCONTIG), "PRELOAD feeds the plain dot loop");
  static_assert(!AHEAD_EARLY || (B_KCONTIG && PRELOAD == 0), "AHEAD_EARLY starts the dot loop's first loads");
  constexpr int AHEAD = INFLIGHT > 0 ? INFLIGHT : UNROLL;   // AHEAD_EARLY: vectors a lane asks of L2 before the wait
  static_assert(!PRELOAD_SHARED || (PRELOAD > 0 && VEC * sizeof(b_t) == 16), "a shared preload moves 16-byte vectors");
  static_assert((NACC == 1 && !HAS_EPILOGUE) || B_KCONTIG, "an epilogue needs the dot scheme");
  static_assert(M >= 1 && M <= 8, "M must be in [1, 8]");
  static_assert(GROUP >= 1 && GROUP <= THREADS && (GROUP & (GROUP - 1)) == 0 && THREADS % 32 == 0,
                "GROUP must be a power of two <= THREADS, THREADS a multiple of 32");
  static_assert(VEC >= 1 && (VEC & (VEC - 1)) == 0 && VEC * sizeof(b_t) <= 16, "VEC: a power of two, <= 16 bytes");
  __shared__ float lum_part[B_KCONTIG ? (GROUP > 32 ? THREADS / 32 * M * NACC : 1) : (GROUP > 1 ? THREADS * VEC : 1)];
{{DYN_LOADS}}
  const idx_t lum_n = {{N}};
  const idx_t lum_k = {{K}};
  const idx_t lum_batch = {{BATCH}};
  const idx_t lum_lda = {{LDA}};
  const idx_t lum_ldb = {{LDB}};
  const idx_t lum_sa = {{STRIDE_A}};
  const idx_t lum_sb = {{STRIDE_B}};
  const idx_t lum_oa = {{OFF_A}};
  const idx_t lum_ob = {{OFF_B}};
  const idx_t lum_nout = {{N_OUT}};  // output columns (per batch and row)
  const idx_t lum_ars = A_KCONTIG ? lum_lda : (idx_t)1;  // A's stride along i, then along k
  const idx_t lum_aks = A_KCONTIG ? (idx_t)1 : lum_lda;
  auto lum_ca = [](a_t lum_x) -> float { return {{A_LOAD}}; };
  auto lum_cb = [](b_t lum_x) -> float { return {{B_LOAD}}; };
  auto lum_store = [&](idx_t lum_o, float lum_v) { out[lum_o] = {{STORE}}; };
  const int lum_g = (int)threadIdx.x / GROUP;
  const int lum_lane = (int)threadIdx.x % GROUP;
  const idx_t lum_kvec = lum_k / VEC * VEC;   // k covered by whole vectors
  const bool lum_b_vec = VEC > 1 && ({{VEC_OK}}) && lum_aligned({{B_PTR}}, VEC * sizeof(b_t));   // B in vectors
  auto lum_b_raw = [](const b_t* lum_p, b_t (&lum_raw)[VEC]) {   // one vector of B, as stored
    if constexpr (B_STREAM) lum_load_stream<VEC>(lum_p, lum_raw); else lum_load_raw<VEC>(lum_p, lum_raw);
  };
  auto lum_b_f32 = [&](const b_t* lum_p, float (&lum_bv)[VEC]) {   // one vector of B, as floats
    b_t lum_raw[VEC];
    lum_b_raw(lum_p, lum_raw);
#pragma unroll
    for (int e = 0; e < VEC; ++e) lum_bv[e] = lum_cb(lum_raw[e]);
  };
  // The preload: B (weights, where codegen sets PRELOAD; the launch table names it `early`) does not
  // depend on the kernels before this one, so each lane issues the loads of its first PRELOAD vectors of
  // its column of the first tile now, into registers that nothing reads until after the wait.
  const bool lum_pre_ok = PRELOAD > 0 && B_KCONTIG && lum_b_vec;
  b_t lum_pre[PRELOAD > 0 && !PRELOAD_SHARED ? PRELOAD : 1][NACC][VEC];
#if defined(__CUDA_ARCH__)
  extern __shared__ lum_vec<unsigned, 4> lum_pre_s[];    // [PRELOAD][NACC][THREADS] with PRELOAD_SHARED
#else
  static lum_vec<unsigned, 4> lum_pre_s[PRELOAD_SHARED ? PRELOAD * NACC * THREADS : 1];
#endif
  auto lum_pre_slot = [&](int u, int t) -> lum_vec<unsigned, 4>* { return &lum_pre_s[(u * NACC + t) * THREADS + threadIdx.x]; };
  if (lum_pre_ok) {
    const idx_t lum_pc = (idx_t)blockIdx.x * SPAN + lum_g;   // this group's first column
    if (lum_pc < lum_batch * lum_nout) {
      const idx_t lum_pb = lum_pc / lum_nout;
      const b_t* lum_pp = {{B_PTR}} + (lum_ob + lum_pb * lum_sb + (lum_pc - lum_pb * lum_nout) * lum_ldb);
#pragma unroll
      for (int u = 0; u < PRELOAD; ++u) {
        const idx_t lum_q = (idx_t)lum_lane * VEC + (idx_t)u * GROUP * VEC;
        if (lum_q < lum_kvec) {
#pragma unroll
          for (int t = 0; t < NACC; ++t) {
            if constexpr (PRELOAD_SHARED) lum_copy16_async(lum_pre_slot(u, t), lum_pp + ACC_COLS[t] * lum_ldb + lum_q);
            else lum_b_raw(lum_pp + ACC_COLS[t] * lum_ldb + lum_q, lum_pre[u][t]);
          }
        }
      }
    }
  }
  // AHEAD_EARLY: the lines of B the first step of this lane's column of the block's first tile loads (INFLIGHT
  // vectors, or the plain loop's first UNROLL), asked of L2 now (common.cuh lum_prefetch_l2: no register), so that
  // they stream while the kernel before finishes and the loads after the wait find them there. B is a weight: no
  // kernel before writes it.
  if constexpr (AHEAD_EARLY) {
    const idx_t lum_pc = (idx_t)blockIdx.x * SPAN + lum_g;   // this group's first column
    if (lum_b_vec && lum_pc < lum_batch * lum_nout) {
      const idx_t lum_pb = lum_pc / lum_nout;
      const b_t* lum_pp = {{B_PTR}} + (lum_ob + lum_pb * lum_sb + (lum_pc - lum_pb * lum_nout) * lum_ldb);
#pragma unroll
      for (int u = 0; u < AHEAD; ++u) {
        const idx_t lum_q = (idx_t)lum_lane * VEC + (idx_t)u * GROUP * VEC;
        if (lum_q < lum_kvec && lum_q % (128 / (idx_t)sizeof(b_t)) < VEC) {   // one lane a 128-byte line
#pragma unroll
          for (int t = 0; t < NACC; ++t) lum_prefetch_l2(lum_pp + ACC_COLS[t] * lum_ldb + lum_q);
        }
      }
    }
  }
  lum_pdl_wait();   // common.cuh: what earlier kernels wrote (A, the prologue's inputs) is visible from here
{{PROLOGUE}}  const bool lum_vec_ok = lum_b_vec && (!(A_KCONTIG && B_KCONTIG) || lum_aligned({{A_PTR}}, A_PIECE * sizeof(a_t)));
  auto lum_a_vec = [&](const a_t* lum_ap, int i, idx_t lum_q, float (&lum_av)[VEC]) {  // A(i, q .. q + VEC)
    if (A_KCONTIG) {
      lum_load_f32<VEC>(lum_ap + i * lum_lda + lum_q, lum_av, lum_ca);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) lum_av[e] = lum_ca(lum_ap[i + (lum_q + e) * lum_lda]);
    }
  };

  if (B_KCONTIG) {  // ---------------------------------------------------------------- dot
    const idx_t lum_cols = lum_batch * lum_nout;
    for (idx_t lum_c0 = (idx_t)blockIdx.x * SPAN; lum_c0 < lum_cols; lum_c0 += (idx_t)gridDim.x * SPAN) {
      const idx_t lum_c = lum_c0 + lum_g;
      const idx_t lum_b = lum_c < lum_cols ? lum_c / lum_nout : (idx_t)0;
      const idx_t lum_j = lum_c - lum_b * lum_nout;
      float lum_acc[NACC * M];  // [t * M + i]: row i of product column j + ACC_COLS[t]
#pragma unroll
      for (int r = 0; r < NACC * M; ++r) lum_acc[r] = 0.0f;
      if (lum_c < lum_cols) {
        const b_t* lum_bp = {{B_PTR}} + (lum_ob + lum_b * lum_sb + lum_j * lum_ldb);  // column j: k contiguous
        const a_t* lum_ap = {{A_PTR}} + (lum_oa + lum_b * lum_sa);
        idx_t lum_kv = 0;  // k covered by whole vectors
        auto lum_fma = [&](idx_t lum_q, const float (&lum_bv)[NACC][VEC]) {   // += A(i, q .. q + VEC) · the vectors
#pragma unroll
          for (int i = 0; i < M; ++i) {
            float lum_av[VEC];
            lum_a_vec(lum_ap, i, lum_q, lum_av);
#pragma unroll
            for (int t = 0; t < NACC; ++t) {
#pragma unroll
              for (int e = 0; e < VEC; ++e) lum_acc[t * M + i] += lum_av[e] * lum_bv[t][e];
            }
          }
        };
        if (lum_vec_ok && INFLIGHT > 0) {  // INFLIGHT vectors of B (and of A when A_EARLY) per lane, loaded
          lum_kv = lum_kvec;                 // before any is used, then accumulated in the order of k
          const idx_t lum_step = (idx_t)GROUP * VEC;
          for (idx_t lum_q0 = (idx_t)lum_lane * VEC; lum_q0 < lum_kv; lum_q0 += lum_step * U) {
            b_t lum_braw[U][NACC][VEC];
            a_t lum_araw[A_EARLY ? U : 1][VEC];
#pragma unroll
            for (int u = 0; u < U; ++u) {
              if (lum_q0 + u * lum_step < lum_kv) {
#pragma unroll
                for (int t = 0; t < NACC; ++t) lum_b_raw(lum_bp + ACC_COLS[t] * lum_ldb + lum_q0 + u * lum_step, lum_braw[u][t]);
              }
            }
            if (A_EARLY) {
#pragma unroll
              for (int u = 0; u < U; ++u) {
                if (lum_q0 + u * lum_step < lum_kv) lum_load_raw<VEC>(lum_ap + lum_q0 + u * lum_step, lum_araw[A_EARLY ? u : 0]);
              }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const idx_t lum_q = lum_q0 + u * lum_step;
              if (lum_q < lum_kv) {
#pragma unroll
                for (int i = 0; i < M; ++i) {
                  float lum_av[VEC];
                  if (A_EARLY) {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) lum_av[e] = lum_ca(lum_araw[A_EARLY ? u : 0][e]);
                  } else {
                    lum_a_vec(lum_ap, i, lum_q, lum_av);
                  }
#pragma unroll
                  for (int t = 0; t < NACC; ++t) {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) lum_acc[t * M + i] += lum_av[e] * lum_cb(lum_braw[u][t][e]);
                  }
                }
              }
            }
          }
        } else if (lum_vec_ok) {
          lum_kv = lum_kvec;
          // the loop over this lane's vectors from lum_q0: a start of the form lane * VEC + constant keeps
          // its trip count known to the compiler (static k), which unrolls it and issues loads early
          auto lum_plain = [&](idx_t lum_q0) {
#pragma unroll {{UNROLL}}
            for (idx_t lum_q = lum_q0; lum_q < lum_kv; lum_q += (idx_t)GROUP * VEC) {
              float lum_bv[NACC][VEC];
#pragma unroll
              for (int t = 0; t < NACC; ++t) lum_b_f32(lum_bp + ACC_COLS[t] * lum_ldb + lum_q, lum_bv[t]);
              lum_fma(lum_q, lum_bv);
            }
          };
          if (PRELOAD > 0 && lum_pre_ok && lum_c0 == (idx_t)blockIdx.x * SPAN) {   // the preloaded ones first
            if (PRELOAD_SHARED) lum_copy_wait_all();
#pragma unroll
            for (int u = 0; u < PRELOAD; ++u) {
              const idx_t lum_q = (idx_t)lum_lane * VEC + (idx_t)u * GROUP * VEC;
              if (lum_q < lum_kv) {
                float lum_bv[NACC][VEC];
#pragma unroll
                for (int t = 0; t < NACC; ++t) {
                  if constexpr (PRELOAD_SHARED) {
                    const lum_vec<b_t, VEC> lum_w = *reinterpret_cast<const lum_vec<b_t, VEC>*>(lum_pre_slot(u, t));
#pragma unroll
                    for (int e = 0; e < VEC; ++e) lum_bv[t][e] = lum_cb(lum_w.v[e]);
                  } else {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) lum_bv[t][e] = lum_cb(lum_pre[u][t][e]);
                  }
                }
                lum_fma(lum_q, lum_bv);
              }
            }
            lum_plain((idx_t)lum_lane * VEC + (idx_t)PRELOAD * GROUP * VEC);
          } else {
            lum_plain((idx_t)lum_lane * VEC);
          }
        }
        for (idx_t lum_kk = lum_kv + lum_lane; lum_kk < lum_k; lum_kk += GROUP) {
#pragma unroll
          for (int t = 0; t < NACC; ++t) {
            const float lum_bs = lum_cb(lum_bp[ACC_COLS[t] * lum_ldb + lum_kk]);
#pragma unroll
            for (int i = 0; i < M; ++i) lum_acc[t * M + i] += lum_ca(lum_ap[i * lum_ars + lum_kk * lum_aks]) * lum_bs;
          }
        }
      }
#pragma unroll
      for (int r = 0; r < NACC * M; ++r) lum_acc[r] = lum_warp_reduce<LumSum, WARP_W>(lum_acc[r]);
      if (GROUP > 32) {  // split-K across the warps of a group: combine through shared memory
        const int lum_warp = (int)threadIdx.x / 32;
        if ((threadIdx.x & 31) == 0) {
#pragma unroll
          for (int r = 0; r < NACC * M; ++r) lum_part[lum_warp * NACC * M + r] = lum_acc[r];
        }
        __syncthreads();
        if (lum_lane == 0) {
          for (int w = 1; w < GROUP / 32; ++w) {
#pragma unroll
            for (int r = 0; r < NACC * M; ++r) lum_acc[r] += lum_part[(lum_warp + w) * NACC * M + r];
          }
        }
        __syncthreads();
      }
      if (lum_c < lum_cols && lum_lane == 0) {
        if (!HAS_EPILOGUE) {
#pragma unroll
          for (int i = 0; i < M; ++i) lum_store((lum_b * M + i) * lum_nout + lum_j, lum_acc[i]);
        }
{{EPILOGUE}}
      }
    }
    if constexpr (PRELOAD_SHARED) lum_copy_wait_all();   // copies no tile read (A misaligned: the scalar loop)
  } else {  // ------------------------------------------------------------------------ cols
    constexpr int TILE = SPAN * VEC;  // columns per block tile
    const idx_t lum_tiles_b = (lum_n + TILE - 1) / TILE;
    const idx_t lum_tiles = lum_batch * lum_tiles_b;
    const int lum_ct = (int)threadIdx.x % SPAN;
    const int lum_ks = (int)threadIdx.x / SPAN;  // this thread's k slice
    for (idx_t lum_t = (idx_t)blockIdx.x; lum_t < lum_tiles; lum_t += (idx_t)gridDim.x) {
      const idx_t lum_b = lum_t / lum_tiles_b;
      const idx_t lum_jt = (lum_t - lum_b * lum_tiles_b) * TILE;  // the tile's first column
      const idx_t lum_j = lum_jt + (idx_t)lum_ct * VEC;              // this thread's first column
      const b_t* lum_bp = {{B_PTR}} + (lum_ob + lum_b * lum_sb);
      const a_t* lum_ap = {{A_PTR}} + (lum_oa + lum_b * lum_sa);
      float lum_acc[M][VEC];
#pragma unroll
      for (int i = 0; i < M; ++i) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) lum_acc[i][e] = 0.0f;
      }
      if (lum_vec_ok && lum_j + VEC <= lum_n) {
#pragma unroll {{UNROLL}}
        for (idx_t lum_kk = lum_ks; lum_kk < lum_k; lum_kk += GROUP) {
          float lum_bv[VEC];
          lum_load_f32<VEC>(lum_bp + (lum_kk * lum_ldb + lum_j), lum_bv, lum_cb);
#pragma unroll
          for (int i = 0; i < M; ++i) {
            const float lum_a = lum_ca(lum_ap[i * lum_ars + lum_kk * lum_aks]);
#pragma unroll
            for (int e = 0; e < VEC; ++e) lum_acc[i][e] += lum_a * lum_bv[e];
          }
        }
      } else if (lum_j < lum_n) {
        for (idx_t lum_kk = lum_ks; lum_kk < lum_k; lum_kk += GROUP) {
          float lum_bv[VEC];
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            lum_bv[e] = lum_j + e < lum_n ? lum_cb(lum_bp[lum_kk * lum_ldb + lum_j + e]) : 0.0f;
          }
#pragma unroll
          for (int i = 0; i < M; ++i) {
            const float lum_a = lum_ca(lum_ap[i * lum_ars + lum_kk * lum_aks]);
#pragma unroll
            for (int e = 0; e < VEC; ++e) lum_acc[i][e] += lum_a * lum_bv[e];
          }
        }
      }
      if (GROUP == 1) {
#pragma unroll
        for (int i = 0; i < M; ++i) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            if (lum_j + e < lum_n) lum_store((lum_b * M + i) * lum_n + lum_j + e, lum_acc[i][e]);
          }
        }
      } else {  // sum the k slices through shared memory, laid out [slice][e][ct] (no bank conflicts)
#pragma unroll
        for (int i = 0; i < M; ++i) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) lum_part[(lum_ks * VEC + e) * SPAN + lum_ct] = lum_acc[i][e];
          __syncthreads();
          for (int lum_col = (int)threadIdx.x; lum_col < TILE; lum_col += THREADS) {
            const int e = lum_col / SPAN, ct = lum_col % SPAN;
            float lum_s = 0.0f;
            for (int q = 0; q < GROUP; ++q) lum_s += lum_part[(q * VEC + e) * SPAN + ct];
            const idx_t lum_jo = lum_jt + (idx_t)ct * VEC + e;
            if (lum_jo < lum_n) lum_store((lum_b * M + i) * lum_n + lum_jo, lum_s);
          }
          __syncthreads();
        }
      }
    }
  }
}
