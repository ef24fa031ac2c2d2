//! lum/templates/scatter.cu — LLIR scatter / scatter_nocopy, the row-writing half:
//!   out[idx[j..], r..] = src[j.., r..]   (dest = args[0], src = args[1], idx = args[2])
//!
//! scatter: the module also holds an elementwise copy kernel (elementwise.cu) that first writes
//! out = dest (converted); the loader launches the copy, then this kernel, in order on one stream.
//! scatter_nocopy: only this kernel runs; `out` is dest's own buffer (args[0]'s pointer is not read)
//! and rows land at dest's view, so rows that are not indexed are never touched.
//!
//! Grid-stride loop over src's flat index (correct for any grid >= 1), EPT items per thread per tile.
//! An index outside [0, ROWS) writes nothing. With duplicate indices the surviving row is unspecified.
//!
//! With a fused prologue (LLIR params expr) the src element is computed from the leaves args[1:-1]
//! (RoPE and the rounding to the cache dtype of a KV-cache write) and idx is the last argument.
//!
//! Placeholders: KERNEL THREADS EPT IDX_T PARAMS DYN_LOADS, NUM_ITEMS (src elements), ROWS (dest
//!   rows), UNRAVEL (defines lum_i0..: the j.. dims, then r..), ROW (long long row number of the item),
//!   PROLOGUE (statements computing the src element from the leaves, or nothing), VALUE (the src
//!   element, converted to the output's storage type), DEST (physical index into out of element
//!   (lum_row, r..)).
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
        if (lum_row >= 0 && lum_row < lum_rows) {
{{PROLOGUE}}
          out[{{DEST}}] = {{VALUE}};
        }
      }
    }
  }
}
