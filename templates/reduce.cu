//! lum/templates/reduce.cu — LLIR reduce (Sum / Max over one axis of args[0]'s view).
//!
//! GROUP threads (a power of two, 1..THREADS) own one output row; a block holds THREADS/GROUP rows and
//! walks all rows in a grid-stride loop (uniform per block, so __syncthreads is safe; correct for any
//! grid >= 1). The threads of a group stride over the reduced axis (coalesced when that axis is
//! contiguous; GROUP == 1 makes neighbouring threads read neighbouring rows instead, which suits a
//! reduction over an outer axis), accumulate in ACC_T (float for f32/f16/bf16, double if asked,
//! long long for integers and bool), then combine with warp shuffles and, for GROUP > 32, through
//! shared memory. Padding (view mask) reads 0: the loop covers only the valid range [lum_rlo, lum_rhi)
//! and PAD_FIXUP folds a 0 in when a Max row touches padding (a Sum needs nothing). With a fused
//! prologue (LLIR params expr: the reduced values are an elementwise expression over several reads)
//! the loop covers the whole axis and each read is 0 where its own view is padding.
//!
//! Placeholders: KERNEL THREADS GROUP IDX_T PARAMS DYN_LOADS;
//!   ACC_T, OP (LumSum | LumMax), IDENTITY (ACC_T literal), ROWS (output elements), RED (axis length),
//!   ROW_SETUP  unravel lum_row into lum_i0.. and define lum_valid (bool: the row is not padding on the
//!              other dims), lum_rlo / lum_rhi (the axis range to visit, clamped to [0, RED]) and what
//!              LOAD needs per row (each read's physical index at axis position 0 and row validity)
//!   LOAD       statements defining lum_x, the element at axis position lum_r: one read of in0, or the
//!              fused prologue's reads and expression tree (its root rounded to the root's dtype)
//!   PAD_FIXUP  statement run per row by its group leader after the loop (may update lum_acc)
//!   STORE      statement writing lum_acc (ACC_T) to the output row lum_row
extern "C" __global__ void __launch_bounds__({{THREADS}}) {{KERNEL}}({{PARAMS}}) {
  typedef {{IDX_T}} idx_t;
  typedef {{ACC_T}} acc_t;
  constexpr int THREADS = {{THREADS}};
  constexpr int GROUP = {{GROUP}};
  constexpr int GROUPS = THREADS / GROUP;
  constexpr int WARP_W = GROUP < 32 ? GROUP : 32;
  static_assert(GROUP >= 1 && GROUP <= THREADS && (GROUP & (GROUP - 1)) == 0 && THREADS % 32 == 0,
                "GROUP must be a power of two <= THREADS, THREADS a multiple of 32");
  __shared__ acc_t lum_smem[GROUP > 32 ? THREADS / 32 : 1];
{{DYN_LOADS}}
  const idx_t lum_rows = {{ROWS}};
  const idx_t lum_red = {{RED}};
  const int lum_g = (int)threadIdx.x / GROUP;
  const int lum_lane = (int)threadIdx.x % GROUP;
  for (idx_t lum_row0 = (idx_t)blockIdx.x * GROUPS; lum_row0 < lum_rows; lum_row0 += (idx_t)gridDim.x * GROUPS) {
    const idx_t lum_row = lum_row0 + lum_g;
    acc_t lum_acc = {{IDENTITY}};
    if (lum_row < lum_rows) {
{{ROW_SETUP}}
      if (lum_valid) {
#pragma unroll 4
        for (idx_t lum_r = lum_rlo + lum_lane; lum_r < lum_rhi; lum_r += GROUP) {
{{LOAD}}
          lum_acc = {{OP}}::apply(lum_acc, (acc_t)(lum_x));
        }
      }
      if (lum_lane == 0) {
{{PAD_FIXUP}}
      }
    }
    lum_acc = lum_warp_reduce<{{OP}}, WARP_W>(lum_acc);
    if (GROUP > 32) {  // combine the warps of a group through shared memory
      const int lum_warp = (int)threadIdx.x / 32;
      if ((threadIdx.x & 31) == 0) lum_smem[lum_warp] = lum_acc;
      __syncthreads();
      if (lum_lane == 0) {
        for (int lum_k = 1; lum_k < GROUP / 32; ++lum_k) lum_acc = {{OP}}::apply(lum_acc, lum_smem[lum_warp + lum_k]);
      }
      __syncthreads();
    }
    if (lum_row < lum_rows && lum_lane == 0) {
{{STORE}}
    }
  }
}
