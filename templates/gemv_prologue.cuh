//! lum/templates/gemv_prologue.cuh — pasted into gemv.cu at PROLOGUE when a decode GEMV computes its A
//! operand itself (a fused prologue): A = a Fused tree over the leaves, row-major over its domain D
//! (ROWS rows of N), rounded to A's dtype and kept as floats in shared memory for the dot product.
//! All threads of the block work on one row at a time, so a row reduction (an RMSNorm's Σx²) is one
//! block-wide reduction; ROW_SETUP / PHASES / FINAL are the row kernel's (templates/row.cu), with FINAL
//! storing into lum_as. Every block computes the whole of A (its leaves are a few KB, read from L2).
//!
//! Placeholders: ACC_T A_ELEMS (M * K) ROWS N ROW_SETUP PHASES FINAL.
  __shared__ lum_vec<float, 4> lum_as_v[({{A_ELEMS}} + 3) / 4];  // 16-byte aligned: A is vector-loaded
  float* const lum_as = lum_as_v[0].v;
  {
    typedef {{ACC_T}} acc_t;
    constexpr int GROUP = THREADS;
    __shared__ acc_t lum_smem[THREADS / 32];
    const idx_t lum_rows = {{ROWS}};
    const idx_t lum_n = {{N}};
    const int lum_lane = (int)threadIdx.x;
    for (idx_t lum_row = 0; lum_row < lum_rows; ++lum_row) {
      const bool lum_live = true;
{{ROW_SETUP}}
{{PHASES}}
{{FINAL}}
    }
  }
  __syncthreads();
