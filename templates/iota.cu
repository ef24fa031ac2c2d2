//! lum/templates/iota.cu — LLIR iota: out[i] = i for i < n (converted to the output dtype).
//! Grid-stride loop; correct for any grid >= 1.
//! Placeholders: KERNEL THREADS IDX_T PARAMS DYN_LOADS, N (the length, a C expression), STORE
//! (statement converting `lum_v`, a long long, to the output dtype and writing out[lum_w]).
extern "C" __global__ void __launch_bounds__({{THREADS}}) {{KERNEL}}({{PARAMS}}) {
  typedef {{IDX_T}} idx_t;
{{DYN_LOADS}}
  const idx_t lum_n = {{N}};
  for (idx_t lum_w = (idx_t)blockIdx.x * {{THREADS}} + threadIdx.x; lum_w < lum_n; lum_w += (idx_t)gridDim.x * {{THREADS}}) {
    const long long lum_v = (long long)lum_w;
    {{STORE}}
  }
}
