//! lum/templates/elementwise.cu — one LLIR elementwise op (Cast Exp2 Log2 Sin Sqrt Recip Add Mul Mod
//! LessThan Where Contiguous, or a Fused tree of them); also the copy half of scatter. Lines starting
//! with //! are dropped on render.
//!
//! Grid-stride loop over work items: item `lum_w` is output element `lum_w` (VEC == 1) or the VEC
//! consecutive innermost output elements starting at `lum_w * VEC` (vector loads/stores; codegen only
//! picks VEC > 1 when every view is contiguous and aligned along the innermost dim). Each thread
//! handles EPT items per block tile (tile = THREADS * EPT items, item e of the tile at e*THREADS + tid,
//! so warps stay coalesced). Correct for any grid >= 1: a replayed CUDA graph may keep an old grid.
//!
//! Placeholders (filled by lum.builder.codegen):
//!   KERNEL      entry name                    THREADS  threads per block (== blockDim.x)
//!   EPT         items per thread per tile     IDX_T    index type (int or long long)
//!   PARAMS      pointer parameters: out, in0.., then `const long long* __restrict__ dyn`
//!   DYN_LOADS   `const IDX_T lum_d_<var> = (IDX_T)dyn[<slot>];` for each dyn var the kernel uses
//!   NUM_ITEMS   number of work items (C expression of the dyn vars)
//!   BODY        per item: unravel lum_w into lum_i0.., load arguments through their views
//!               (physical index + validity), compute in float / long long / bool, convert, store
extern "C" __global__ void __launch_bounds__({{THREADS}}) {{KERNEL}}({{PARAMS}}) {
  typedef {{IDX_T}} idx_t;
{{DYN_LOADS}}
  const idx_t lum_n = {{NUM_ITEMS}};
  const idx_t lum_tile = (idx_t)({{THREADS}} * {{EPT}});
  for (idx_t lum_base = (idx_t)blockIdx.x * lum_tile; lum_base < lum_n; lum_base += (idx_t)gridDim.x * lum_tile) {
#pragma unroll
    for (int lum_e = 0; lum_e < {{EPT}}; ++lum_e) {
      const idx_t lum_w = lum_base + (idx_t)(lum_e * {{THREADS}} + (int)threadIdx.x);
      if (lum_w < lum_n) {
{{BODY}}
      }
    }
  }
}
