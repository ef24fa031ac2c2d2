//! lum/templates/flash_attention.cu — LLIR attention with many query rows per K / V row (prefill): the chunk
//! partials [acc[0..DV), c, l] of format/llir.py, computed as tiled flash attention (an online softmax over
//! tiles of keys staged in shared memory). builder/codegen.py (_Gen._flash_attention) fills it; the reduce
//! that combines the chunks is the same as decode's (templates/attention.cu is the decode kernel).
//!
//! Work item w = (row tile, kv row h, chunk j), walked grid-stride, the last row tiles first (a causal mask
//! gives them the most keys). A block owns BR = 16 * WARPS query rows of kv row h (rows lum_m0 + r of the M
//! rows sharing h) and the keys [lum_t0, lum_t1) of chunk j; warp w owns rows 16w .. 16w + 15. Q is copied
//! into shared memory once, then the keys are walked in tiles of BC: K's tile, then V's, each in a buffer of
//! its own (16-byte copies, cp.async on sm_80+: V's tile loads while S = Q·Kᵀ is computed, the next K's
//! while P·V is). Every lane holds its part of S and O in the accumulator layout of mma.m16n8k16: lane
//! (g, t) = (lane / 4, lane % 4) has rows g and g + 8 of its warp, columns 8n + 2t and 8n + 2t + 1 of
//! n-tile n, as elements [n][0..1] (row g) and [n][2..3] (row g + 8). With MMA (q, k, v and the
//! probabilities all bf16 or all f16) both products run on tensor cores, the probabilities passed from the
//! S accumulators to P·V in registers (their layout is mma's A operand); without (FMA: f32 models, mixed
//! dtypes) each lane computes the same elements with FMAs from shared memory, the probabilities through a
//! per-warp shared tile.
//!
//! Masking: the mask is a bool view [R…, T], read for each lane's elements of a key tile (bit 4n + e of the
//! lane's word). A tile whose bits are all zero in every lane of the block (a block-wide vote,
//! __syncthreads_or) is skipped: its K / V are never loaded. So a causal mask skips the tiles past a row
//! tile's last query and a sliding window those before its first query's window, whatever formula built
//! the mask. The next tile's bits load while the current one computes.
//!
//! Online softmax, per query row, in the log2 domain with an integer offset c, exactly as attention.cu:
//! x = f32(f32(s · scale) · log2 e) for a visible key, −inf otherwise; a tile whose row max exceeds c raises c
//! to ceil(max) and rescales l and acc by 2^(c_old − c_new), exact; then l += 2^(x − c) and acc += round_p(2^(x −
//! c)) · v. The offsets are powers of two, so rounding p to p_dtype commutes with every rescale.
//!
//! Every barrier (__syncthreads, the vote, the warp shuffles, and __syncwarp in the FMA path and the mma
//! fallback) is reached alike by every thread of the block: all warps run every tile, rows past M included.
//!
//! Placeholders: KERNEL THREADS IDX_T PARAMS DYN_LOADS; Q_T K_T V_T (storage types), CVT_Q CVT_K CVT_V
//!   (float of a stored x), D DV BC CHUNK SMEM (dynamic shared memory bytes), MMA FMA (1 / 0, one of
//!   them), BF16 (MMA: 1 bf16, 0 f16), Q_VEC K_VEC V_VEC (true: rows copied in 16-byte pieces; false:
//!   element by element), T M NS HEADS (keys, query rows per kv row, chunks, kv rows), SETUP (lum_i… of
//!   kv row lum_h; lum_kb, lum_vb: K / V at (lum_h, key 0, feature 0)),
//!   QROW MROW OROW (q at query row lum_m feature 0; the mask at row lum_m key 0; out at row lum_m, chunk
//!   lum_j, element 0), QD KT KD VT VD MT (strides: q's features; K's keys, features; V's keys, features;
//!   the mask's keys), SCALE (f32 literal), ROUND (the FMA path's round_p(lum_e) as float).
#ifndef LUM_FLASH_ATTENTION_HELPERS
#define LUM_FLASH_ATTENTION_HELPERS
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define LUM_FA_TC 1     // tensor cores (mma.sync, ldmatrix) and cp.async
#else
#define LUM_FA_TC 0     // the host emulation (tests/cuda_emulation.py) and GPUs before sm_80: the same
#endif                  // fragments computed by plain loads and stores, the mma through shared memory

LUM_D unsigned lum_fa_pack(unsigned short lo, unsigned short hi) { return (unsigned)lo | ((unsigned)hi << 16); }

// 16 bytes from global src to shared dst, or zeros where !valid (src is then not read). cp.async on sm_80+:
// complete once the lum_fa_wait after its lum_fa_commit has returned.
LUM_D void lum_fa_cp16(void* dst, const void* src, bool valid) {
#if LUM_FA_TC
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(lum_shared_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0) : "memory");
#else
  lum_vec<unsigned, 4> v = {};
  if (valid) v = *reinterpret_cast<const lum_vec<unsigned, 4>*>(src);
  *reinterpret_cast<lum_vec<unsigned, 4>*>(dst) = v;
#endif
}
LUM_D void lum_fa_commit() {
#if LUM_FA_TC
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
LUM_D void lum_fa_wait() {   // at most N of the last committed groups still pending
#if LUM_FA_TC
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#endif
}

// A tile of ROWS rows of W elements into shared memory s (LD elements a row) by the block's THREADS threads:
// row r read from src + base (and its element d at + d * step) where row(r, ok) gives base and sets ok, zeros
// where !ok (src is then not read); in 16-byte pieces (VEC: step 1, base and s aligned) or element by element.
template <int ROWS, int W, int LD, bool VEC, int THREADS, typename T, typename I, typename Row>
LUM_D void lum_fa_tile(T* s, const T* src, const Row& row, const I step) {
  constexpr int P = 16 / (int)sizeof(T);
  if constexpr (VEC) {
    for (int c = (int)threadIdx.x; c < ROWS * (W / P); c += THREADS) {
      const int r = c / (W / P), col = (c - r * (W / P)) * P;
      bool ok;
      const I base = row(r, ok);
      lum_fa_cp16(s + r * LD + col, src + (ok ? base + (I)col : (I)0), ok);
    }
  } else {
    for (int c = (int)threadIdx.x; c < ROWS * W; c += THREADS) {
      const int r = c / W, d = c - r * W;
      bool ok;
      const I base = row(r, ok);
      s[r * LD + d] = ok ? src[base + (I)d * step] : (T)0;
    }
  }
}

// mma's A operand: the 16 x 16 block at (r0, c0) of a row-major shared tile s (ld elements a row):
// a[0] (row g, cols 2t, 2t + 1), a[1] (row g + 8), a[2] (cols + 8), a[3] (both).
LUM_D void lum_fa_lda(unsigned (&a)[4], const unsigned short* s, int ld, int r0, int c0) {
  const int lane = (int)threadIdx.x & 31;
#if LUM_FA_TC
  const unsigned short* p = s + (r0 + (lane & 15)) * ld + c0 + (lane >> 4) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(lum_shared_addr(p)));
#else
  const unsigned short* p = s + (r0 + (lane >> 2)) * ld + c0 + 2 * (lane & 3);
  a[0] = lum_fa_pack(p[0], p[1]);
  a[1] = lum_fa_pack(p[8 * ld], p[8 * ld + 1]);
  a[2] = lum_fa_pack(p[8], p[9]);
  a[3] = lum_fa_pack(p[8 * ld + 8], p[8 * ld + 9]);
#endif
}

// mma's B operand (k x n, "col": k contiguous) of two n-tiles from a row-major [n][k] shared tile (K: keys x
// features): n rows n0 .. n0 + 7 in b[0] (k = c0 + 2t, + 1) and b[1] (k + 8), rows n0 + 8 .. n0 + 15 in b[2], b[3].
LUM_D void lum_fa_ldb(unsigned (&b)[4], const unsigned short* s, int ld, int n0, int c0) {
  const int lane = (int)threadIdx.x & 31;
#if LUM_FA_TC
  const unsigned short* p = s + (n0 + (lane >> 4) * 8 + (lane & 7)) * ld + c0 + ((lane >> 3) & 1) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(lum_shared_addr(p)));
#else
  const unsigned short* p = s + (n0 + (lane >> 2)) * ld + c0 + 2 * (lane & 3);
  b[0] = lum_fa_pack(p[0], p[1]);
  b[1] = lum_fa_pack(p[8], p[9]);
  b[2] = lum_fa_pack(p[8 * ld], p[8 * ld + 1]);
  b[3] = lum_fa_pack(p[8 * ld + 8], p[8 * ld + 9]);
#endif
}

// The same from a row-major [k][n] shared tile (V: keys x features, read transposed): k rows k0 .. k0 + 15,
// n-tile n0 .. n0 + 7 in b[0] (k = k0 + 2t, + 1; n = n0 + g) and b[1] (k + 8), n-tile n0 + 8 in b[2], b[3].
LUM_D void lum_fa_ldbt(unsigned (&b)[4], const unsigned short* s, int ld, int k0, int n0) {
  const int lane = (int)threadIdx.x & 31;
#if LUM_FA_TC
  const unsigned short* p = s + (k0 + ((lane >> 3) & 1) * 8 + (lane & 7)) * ld + n0 + (lane >> 4) * 8;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(lum_shared_addr(p)));
#else
  const unsigned short* p = s + (k0 + 2 * (lane & 3)) * ld + n0 + (lane >> 2);
  b[0] = lum_fa_pack(p[0], p[ld]);
  b[1] = lum_fa_pack(p[8 * ld], p[9 * ld]);
  b[2] = lum_fa_pack(p[8], p[ld + 8]);
  b[3] = lum_fa_pack(p[8 * ld + 8], p[9 * ld + 8]);
#endif
}

template <bool BF16>
LUM_D float lum_fa_half(unsigned u, int hi) {
  const unsigned short h = (unsigned short)(hi ? u >> 16 : u & 0xffffu);
  return BF16 ? lum_bf16_to_f32(h) : lum_f16_to_f32(h);
}

// d += a · b (mma.m16n8k16: A 16 x 16 row-major, B 16 x 8 "col", bf16 or f16, f32 accumulators). Without
// tensor cores the warp's lanes trade their fragments through x (a block's THREADS x 6 words of shared
// memory) between two __syncwarp, and each lane sums its four elements: every warp of the block calls it alike.
template <bool BF16>
LUM_D void lum_fa_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1, unsigned (*x)[6]) {
#if LUM_FA_TC
  (void)x;
  if (BF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  const int tid = (int)threadIdx.x, lane = tid & 31, w0 = tid - lane, g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) x[tid][i] = a[i];
  x[tid][4] = b0;
  x[tid][5] = b1;
  __syncwarp();
#pragma unroll 1
  for (int e = 0; e < 4; ++e) {      // (a fallback: compact code rather than fast)
    const int row = g + (e >> 1) * 8, col = 2 * t + (e & 1);
    float acc = 0.0f;
#pragma unroll 1
    for (int k = 0; k < 16; ++k) {
      // A(row, k): lane (row % 8) * 4 + (k % 8) / 2, register (row / 8) + 2 (k / 8); B(k, col): lane col * 4 +
      // (k % 8) / 2, register k / 8; the element's half: k % 2
      const float av = lum_fa_half<BF16>(x[w0 + (row & 7) * 4 + ((k & 7) >> 1)][(row >> 3) + 2 * (k >> 3)], k & 1);
      const float bv = lum_fa_half<BF16>(x[w0 + col * 4 + ((k & 7) >> 1)][4 + (k >> 3)], k & 1);
      acc += av * bv;
    }
    d[e] += acc;
  }
  __syncwarp();
#endif
}
#endif  // LUM_FLASH_ATTENTION_HELPERS

extern "C" __global__ void __launch_bounds__({{THREADS}}) {{KERNEL}}({{PARAMS}}) {
  typedef {{IDX_T}} idx_t;
  typedef {{Q_T}} q_t;
  typedef {{K_T}} k_t;
  typedef {{V_T}} v_t;
  constexpr int THREADS = {{THREADS}};
  constexpr int WARPS = THREADS / 32;
  constexpr int BR = WARPS * 16;                 // query rows a block
  constexpr int BC = {{BC}};                     // keys a tile
  constexpr int D = {{D}};
  constexpr int DV = {{DV}};
  constexpr int CHUNK = {{CHUNK}};
  constexpr int NT = BC / 8;                     // n-tiles of S
  constexpr int NV = DV / 8;                     // n-tiles of O
  constexpr int QV = 16 / (int)sizeof(q_t), KV = 16 / (int)sizeof(k_t), VV = 16 / (int)sizeof(v_t);
  // shared row strides: 16 bytes of padding put the 8 rows an ldmatrix reads on distinct banks
  constexpr int QS = D + QV, KS = D + KV, VS = DV + VV;
  static_assert(THREADS % 32 == 0 && BC % 16 == 0 && BC <= 128 && D % 16 == 0 && DV % 16 == 0, "tile shapes");
  constexpr int Q_BYTES = BR * QS * (int)sizeof(q_t), K_BYTES = BC * KS * (int)sizeof(k_t);
  constexpr int V_BYTES = BC * VS * (int)sizeof(v_t);
  static_assert(Q_BYTES + K_BYTES + V_BYTES <= {{SMEM}}, "shared memory");
#if defined(__CUDA_ARCH__)
  extern __shared__ lum_vec<unsigned, 4> lum_fa_smem[];
#else
  static lum_vec<unsigned, 4> lum_fa_smem[{{SMEM}} / 16];    // the host emulation runs one block at a time
#endif
  unsigned char* const lum_sm = reinterpret_cast<unsigned char*>(lum_fa_smem);
  q_t* const lum_qs = reinterpret_cast<q_t*>(lum_sm);
  k_t* const lum_ks = reinterpret_cast<k_t*>(lum_sm + Q_BYTES);
  v_t* const lum_vs = reinterpret_cast<v_t*>(lum_sm + Q_BYTES + K_BYTES);
#if {{MMA}}
  constexpr bool BF16 = {{BF16}};
#if LUM_FA_TC
  unsigned (*const lum_fa_x)[6] = nullptr;
#else
  __shared__ unsigned lum_fa_x[THREADS][6];     // the mma fallback's fragments
#endif
#endif
#if {{FMA}}
  constexpr int PS = BC + 4;                     // a warp's probabilities: 16 rows of PS floats (distinct banks)
  float* const lum_ps = reinterpret_cast<float*>(lum_sm + Q_BYTES + K_BYTES + V_BYTES);
  static_assert(Q_BYTES + K_BYTES + V_BYTES + WARPS * 16 * PS * 4 <= {{SMEM}}, "shared memory");
  const auto lum_cq = [](const q_t x) -> float { return {{CVT_Q}}; };
  const auto lum_ck = [](const k_t x) -> float { return {{CVT_K}}; };
  const auto lum_cv = [](const v_t x) -> float { return {{CVT_V}}; };
#endif
{{DYN_LOADS}}
  const idx_t lum_T = {{T}};
  const idx_t lum_M = {{M}};
  const idx_t lum_ns = {{NS}};
  const idx_t lum_hn = (idx_t)({{HEADS}}) * lum_ns;
  const idx_t lum_rt = (lum_M + (idx_t)(BR - 1)) / (idx_t)BR;
  const idx_t lum_work = lum_hn * lum_rt;
  const int lum_lane = (int)threadIdx.x & 31, lum_warp = (int)threadIdx.x >> 5;
  const int lum_g = lum_lane >> 2, lum_t4 = lum_lane & 3;
  for (idx_t lum_w = (idx_t)blockIdx.x; lum_w < lum_work; lum_w += (idx_t)gridDim.x) {
    const idx_t lum_r = lum_rt - 1 - lum_w / lum_hn;
    const idx_t lum_h = (lum_w % lum_hn) / lum_ns;
    const idx_t lum_j = lum_w % lum_ns;
    (void)lum_h;
{{SETUP}}
    const auto lum_qrow = [&](const idx_t lum_m) -> idx_t { return {{QROW}}; };
    const auto lum_mrow = [&](const idx_t lum_m) -> idx_t { return {{MROW}}; };
    const auto lum_orow = [&](const idx_t lum_m) -> idx_t { return {{OROW}}; };
    const idx_t lum_m0 = lum_r * (idx_t)BR;
    const idx_t lum_t0 = lum_j * (idx_t)CHUNK;
    const idx_t lum_t1 = lum_min(lum_T, lum_t0 + (idx_t)CHUNK);
    // this lane's two query rows (g and g + 8 of its warp's 16) and where their mask rows start
    idx_t lum_row[2];
    bool lum_live[2];
    idx_t lum_mb[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      lum_row[i] = lum_m0 + (idx_t)(lum_warp * 16 + lum_g + 8 * i);
      lum_live[i] = lum_row[i] < lum_M;
      lum_mb[i] = lum_live[i] ? lum_mrow(lum_row[i]) : (idx_t)0;
    }
    // the lane's bits of key tile tb: bit 4n + e is element [n][e]'s key visible to its row
    const auto lum_bits = [&](const idx_t lum_tb) -> unsigned long long {
      unsigned long long lum_b = 0ull;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const idx_t lum_t = lum_tb + (idx_t)(n * 8 + 2 * lum_t4 + (e & 1));
          const bool lum_keep = lum_live[e >> 1] && lum_t < lum_t1 && (in3[lum_mb[e >> 1] + lum_t * ({{MT}})] != 0);
          lum_b |= (unsigned long long)lum_keep << (n * 4 + e);
        }
      }
      return lum_b;
    };
    // K / V tile of keys tb .. tb + BC - 1 into shared memory (zeros past the chunk: 0 · v stays finite)
    const auto lum_load_k = [&](const idx_t lum_tb) {
      lum_fa_tile<BC, D, KS, {{K_VEC}}, THREADS>(lum_ks, in1, [&](int r, bool& ok) {
        const idx_t lum_t = lum_tb + (idx_t)r;
        ok = lum_t < lum_t1;
        return lum_kb + lum_t * ({{KT}});
      }, (idx_t)({{KD}}));
    };
    const auto lum_load_v = [&](const idx_t lum_tb) {
      lum_fa_tile<BC, DV, VS, {{V_VEC}}, THREADS>(lum_vs, in2, [&](int r, bool& ok) {
        const idx_t lum_t = lum_tb + (idx_t)r;
        ok = lum_t < lum_t1;
        return lum_vb + lum_t * ({{VT}});
      }, (idx_t)({{VD}}));
    };

    lum_fa_wait<0>();
    __syncthreads();                       // the block's last work item is done with shared memory
    lum_fa_tile<BR, D, QS, {{Q_VEC}}, THREADS>(lum_qs, in0, [&](int r, bool& ok) {
      const idx_t lum_m = lum_m0 + (idx_t)r;
      ok = lum_m < lum_M;
      return ok ? lum_qrow(lum_m) : (idx_t)0;
    }, (idx_t)({{QD}}));
    // the first tile the mask shows any key of
    idx_t lum_tb = lum_t0;
    unsigned long long lum_b = 0ull;
    bool lum_vis = false;
    for (; lum_tb < lum_t1; lum_tb += (idx_t)BC) {
      lum_b = lum_bits(lum_tb);
      if (__syncthreads_or(lum_b != 0ull)) {
        lum_vis = true;
        break;
      }
    }
    if (lum_vis) lum_load_k(lum_tb);
    lum_fa_commit();

    float lum_c[2] = {-LUM_INF_F32, -LUM_INF_F32}, lum_l[2] = {0.0f, 0.0f};
    float lum_o[NV][4];
#pragma unroll
    for (int n = 0; n < NV; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) lum_o[n][e] = 0.0f;
    }
    while (lum_vis) {
      idx_t lum_nb = lum_tb + (idx_t)BC;
      unsigned long long lum_nbits = lum_nb < lum_t1 ? lum_bits(lum_nb) : 0ull;   // loads while S computes
      lum_fa_wait<0>();
      __syncthreads();                     // Q and K's tile are in shared memory; V's buffer is free
      lum_load_v(lum_tb);
      lum_fa_commit();
      // S = Q · Kᵀ for the warp's 16 rows
      float lum_s[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) lum_s[n][e] = 0.0f;
      }
#if {{MMA}}
#pragma unroll 1
      for (int kk = 0; kk < D / 16; ++kk) {
        unsigned lum_a[4];
        lum_fa_lda(lum_a, lum_qs, QS, lum_warp * 16, kk * 16);
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
          unsigned lum_bk[4];
          lum_fa_ldb(lum_bk, lum_ks, KS, n * 8, kk * 16);
          lum_fa_mma<BF16>(lum_s[n], lum_a, lum_bk[0], lum_bk[1], lum_fa_x);
          lum_fa_mma<BF16>(lum_s[n + 1], lum_a, lum_bk[2], lum_bk[3], lum_fa_x);
        }
      }
#endif
#if {{FMA}}
      {
        const q_t* lum_qa = lum_qs + (lum_warp * 16 + lum_g) * QS;
#pragma unroll 2
        for (int d0 = 0; d0 < D; d0 += 4) {
          float qa[4], qb[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            qa[i] = lum_cq(lum_qa[d0 + i]);
            qb[i] = lum_cq(lum_qa[8 * QS + d0 + i]);
          }
#pragma unroll
          for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const k_t* lum_kp = lum_ks + (n * 8 + 2 * lum_t4 + e) * KS + d0;
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const float kv = lum_ck(lum_kp[i]);
                lum_s[n][e] += qa[i] * kv;
                lum_s[n][2 + e] += qb[i] * kv;
              }
            }
          }
        }
      }
#endif
      // the online softmax: logits in the log2 domain, the rows' offsets raised to ceil(max) (exact rescales)
      float lum_mx[2] = {-LUM_INF_F32, -LUM_INF_F32};
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool lum_keep = (lum_b >> (n * 4 + e)) & 1ull;
          const float lum_x = lum_keep ? (lum_s[n][e] * {{SCALE}}) * 0x1.715476p+0f : -LUM_INF_F32;
          lum_s[n][e] = lum_x;
          lum_mx[e >> 1] = fmaxf(lum_mx[e >> 1], lum_x);
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        lum_mx[i] = lum_warp_reduce<LumMax, 4>(lum_mx[i]);    // over the 4 lanes of the row
        if (lum_mx[i] > lum_c[i]) {
          const float lum_cn = ceilf(lum_mx[i]), lum_f = exp2f(lum_c[i] - lum_cn);
          lum_l[i] *= lum_f;
#pragma unroll
          for (int n = 0; n < NV; ++n) {
            lum_o[n][2 * i] *= lum_f;
            lum_o[n][2 * i + 1] *= lum_f;
          }
          lum_c[i] = lum_cn;
        }
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float lum_x = lum_s[n][e];
          const float lum_e = lum_x == -LUM_INF_F32 ? 0.0f : exp2f(lum_x - lum_c[e >> 1]);
          lum_l[e >> 1] += lum_e;
          lum_s[n][e] = lum_e;
        }
      }
      // the next tile the mask shows any key of (each vote a barrier: every warp is done with K's tile)
      bool lum_nvis = false;
      while (lum_nb < lum_t1) {
        if (__syncthreads_or(lum_nbits != 0ull)) {
          lum_nvis = true;
          break;
        }
        lum_nb += (idx_t)BC;
        lum_nbits = lum_nb < lum_t1 ? lum_bits(lum_nb) : 0ull;
      }
      if (lum_nvis) {
        lum_load_k(lum_nb);
        lum_fa_commit();
        lum_fa_wait<1>();
      } else {
        lum_fa_wait<0>();
      }
      __syncthreads();                     // V's tile is in shared memory
      // O += P · V
#if {{MMA}}
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) {
        // the S accumulators of n-tiles 2kk and 2kk + 1, rounded to 16 bits, are mma's A operand
        unsigned lum_a[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float* lum_p = &lum_s[2 * kk + (i >> 1)][2 * (i & 1)];
          lum_a[i] = BF16 ? lum_fa_pack(lum_f32_to_bf16(lum_p[0]), lum_f32_to_bf16(lum_p[1]))
                          : lum_fa_pack(lum_f32_to_f16(lum_p[0]), lum_f32_to_f16(lum_p[1]));
        }
#pragma unroll
        for (int n = 0; n < NV; n += 2) {
          unsigned lum_bv[4];
          lum_fa_ldbt(lum_bv, lum_vs, VS, kk * 16, n * 8);
          lum_fa_mma<BF16>(lum_o[n], lum_a, lum_bv[0], lum_bv[1], lum_fa_x);
          lum_fa_mma<BF16>(lum_o[n + 1], lum_a, lum_bv[2], lum_bv[3], lum_fa_x);
        }
      }
#endif
#if {{FMA}}
      {
        float* const lum_pw = lum_ps + lum_warp * 16 * PS;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float lum_e = lum_s[n][e];
            lum_pw[(lum_g + 8 * (e >> 1)) * PS + n * 8 + 2 * lum_t4 + (e & 1)] = {{ROUND}};
          }
        }
        __syncwarp();
#pragma unroll 4
        for (int k = 0; k < BC; ++k) {
          const float pa = lum_pw[lum_g * PS + k], pb = lum_pw[(lum_g + 8) * PS + k];
          const v_t* lum_vp = lum_vs + k * VS + 2 * lum_t4;
#pragma unroll
          for (int n = 0; n < NV; ++n) {
            const float v0 = lum_cv(lum_vp[n * 8]), v1 = lum_cv(lum_vp[n * 8 + 1]);
            lum_o[n][0] += pa * v0;
            lum_o[n][1] += pa * v1;
            lum_o[n][2] += pb * v0;
            lum_o[n][3] += pb * v1;
          }
        }
        __syncwarp();
      }
#endif
      lum_tb = lum_nb;
      lum_b = lum_nbits;
      lum_vis = lum_nvis;
    }
    // the partials of the lane's rows: acc, then (lane t = 0) c and l summed over the row's 4 lanes
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float lum_li = lum_warp_reduce<LumSum, 4>(lum_l[i]);
      if (lum_live[i]) {
        float* const lum_out = out + lum_orow(lum_row[i]);
#pragma unroll
        for (int n = 0; n < NV; ++n) {
          lum_vec<float, 2> lum_v2;
          lum_v2.v[0] = lum_o[n][2 * i];
          lum_v2.v[1] = lum_o[n][2 * i + 1];
          *reinterpret_cast<lum_vec<float, 2>*>(lum_out + n * 8 + 2 * lum_t4) = lum_v2;
        }
        if (lum_t4 == 0) {
          lum_out[DV] = lum_c[i];
          lum_out[DV + 1] = lum_li;
        }
      }
    }
  }
}
