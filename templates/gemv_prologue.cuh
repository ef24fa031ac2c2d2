//! lum/templates/gemv_prologue.cuh — pasted into gemv.cu at PROLOGUE when a decode GEMV computes its A
//! operand itself (a fused prologue): A = a Fused tree over the leaves, row-major over its domain D
//! (ROWS rows of N), rounded to A's dtype and kept in shared memory for the dot product, as floats or
//! (A_T, codegen gemv_prologue_narrow_a) as that dtype's storage: the same values in half the bytes.
//! All threads of the block work on one row at a time, so a row reduction (an RMSNorm's Σx²) is one
//! block-wide reduction; ROW_SETUP / PHASES / FINAL are the row kernel's (templates/row.cu), with FINAL
//! storing into lum_as. Every block computes the whole of A (its leaves are a few KB, read from L2).
//!
//! Placeholders: ACC_T A_ELEMS (M * K) ROWS N ROW_SETUP PHASES FINAL; A_FLOAT, A_NARROW (1 | 0: which
//! lum_as), A_T (A's storage type), A_BYTES (A_ELEMS of it).
#if {{A_FLOAT}}
  __shared__ lum_vec<float, 4> lum_as_v[({{A_ELEMS}} + 3) / 4];  // 16-byte aligned: A is vector-loaded
  float* const lum_as = lum_as_v[0].v;
#endif
#if {{A_NARROW}}
  __shared__ lum_vec<float, 4> lum_as_v[({{A_BYTES}} + 15) / 16];  // A's storage type, 16-byte aligned
  {{A_T}}* const lum_as = reinterpret_cast<{{A_T}}*>(lum_as_v[0].v);
#endif
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
