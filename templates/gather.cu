//! lum/templates/gather.cu — LLIR gather: out[j.., r..] = table[idx[j..], r..] (embedding rows).
//!
//! Grid-stride loop over the output's flat index (correct for any grid >= 1); EPT items per thread
//! per tile as in elementwise.cu. Each item unravels into lum_i0.. (the j.. dims, then the r.. dims),
//! reads its row number through the index view (cached: neighbouring threads share it), and reads
//! the table element through the table's view with dim 0 = that row. A row outside [0, ROWS) yields 0
//! (never an out-of-bounds read); the reference backend rejects such indices.
//!
//! Placeholders: KERNEL THREADS EPT IDX_T PARAMS DYN_LOADS, NUM_ITEMS (output elements), ROWS
//!   (table rows, dim 0 of its view), UNRAVEL (defines lum_i0..), ROW (long long row number of the
//!   item), VALUE (the table element as the output's value type; may use lum_row and lum_ok),
//!   STORE (statement writing `lum_v` to the output element of item lum_w).
extern "C" __global__ void __launch_bounds__({{THREADS}}) {{KERNEL}}({{PARAMS}}) {
  typedef {{IDX_T}} idx_t;
{{DYN_LOADS}}
  const idx_t lum_n = {{NUM_ITEMS}};
  const long long lum_rows = (long long)({{ROWS}});
  const idx_t lum_tile = (idx_t)({{THREADS}} * {{EPT}});
  for (idx_t lum_base = (idx_t)blockIdx.x * lum_tile; lum_base < lum_n; lum_base += (idx_t)gridDim.x * lum_tile) {
#pragma unroll
    for (int lum_e = 0; lum_e < {{EPT}}; ++lum_e) {
      const idx_t lum_w = lum_base + (idx_t)(lum_e * {{THREADS}} + (int)threadIdx.x);
      if (lum_w < lum_n) {
{{UNRAVEL}}
        const long long lum_row = {{ROW}};
        const bool lum_ok = lum_row >= 0 && lum_row < lum_rows;
        const auto lum_v = {{VALUE}};
        {{STORE}}
      }
    }
  }
}
