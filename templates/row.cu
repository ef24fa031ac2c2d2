//! lum/templates/row.cu — an elementwise op whose expression holds row reductions (RowSum / RowMax over
//! the last axis of its loop domain), or a reduce over the last axis whose prologue holds them: RMSNorm
//! (Σx², then x·rsqrt(mean + eps)·w), softmax (max, Σexp(x − max), then the quotient), chained norms.
//!
//! GROUP threads (a power of two, 1..THREADS) own one row of N elements; a block holds THREADS/GROUP
//! rows and walks all rows in a grid-stride loop (uniform per block, so __syncthreads is safe; correct
//! for any grid >= 1). The row is visited once per row reduction, innermost first (PHASES): the lanes
//! stride over the row (coalesced when the last axis is contiguous), accumulate in ACC_T, and
//! lum_group_reduce gives every lane of the group the row's value, rounded to the node's dtype; later
//! phases read it as a local. FINAL visits the row once more: an elementwise op computes and stores
//! every element; a reduce accumulates its prologue and its group leader stores the row's value. Leaves
//! read 0 where their view is padding, as everywhere in LLIR. Repeated visits hit L1 / L2, not HBM.
//!
//! Placeholders: KERNEL THREADS GROUP IDX_T PARAMS DYN_LOADS ACC_T;
//!   ROWS (number of rows), N (row length),
//!   ROW_SETUP  unravel lum_row into lum_i0.. and define each read's row base index and validity
//!   PHASES     per row reduction: its accumulation loop, lum_group_reduce and the rounded row value
//!   FINAL      the store loop (elementwise) or the prologue reduction and its store (reduce)
extern "C" __global__ void __launch_bounds__({{THREADS}}) {{KERNEL}}({{PARAMS}}) {
  typedef {{IDX_T}} idx_t;
  typedef {{ACC_T}} acc_t;
  constexpr int THREADS = {{THREADS}};
  constexpr int GROUP = {{GROUP}};
  constexpr int GROUPS = THREADS / GROUP;
  static_assert(GROUP >= 1 && GROUP <= THREADS && (GROUP & (GROUP - 1)) == 0 && THREADS % 32 == 0,
                "GROUP must be a power of two <= THREADS, THREADS a multiple of 32");
  __shared__ acc_t lum_smem[GROUP > 32 ? THREADS / 32 : 1];
{{DYN_LOADS}}
  const idx_t lum_rows = {{ROWS}};
  const idx_t lum_n = {{N}};
  const int lum_lane = (int)threadIdx.x % GROUP;
  for (idx_t lum_row0 = (idx_t)blockIdx.x * GROUPS; lum_row0 < lum_rows; lum_row0 += (idx_t)gridDim.x * GROUPS) {
    const idx_t lum_row = lum_row0 + (idx_t)((int)threadIdx.x / GROUP);
    const bool lum_live = lum_row < lum_rows;
{{ROW_SETUP}}
{{PHASES}}
{{FINAL}}
  }
}
