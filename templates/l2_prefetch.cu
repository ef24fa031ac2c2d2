//! lum/templates/l2_prefetch.cu — warm L2 with the first bytes of a weight before the kernel that reads it.
//! A decode step's memory bus idles while its small kernels (RoPE, cache writes, attention, norms) run
//! one after another; the loader launches this kernel on a side branch of the CUDA graph at the start of
//! such a stretch, for the weight of the GEMV that ends it (loader/cuda/prefetch.py). It only issues
//! hints and returns: on sm_90+ each thread asks the TMA unit for whole CHUNK-byte ranges
//! (cp.async.bulk.prefetch.L2), before that each thread prefetches 128-byte lines. No value is read or
//! written, so it can neither fault on a hint's timing nor change a result. `p` must be 16-byte aligned
//! (every lum buffer is 256-byte aligned); a tail below 16 bytes is left out. Every group module holds
//! it once, as entry `lum_l2_prefetch`. Placeholder: CHUNK (format.manifest.L2_PREFETCH_CHUNK, which
//! the loader sizes its grids by).
extern "C" __global__ void __launch_bounds__(256) lum_l2_prefetch(const char* __restrict__ p, unsigned long long nbytes) {
  const unsigned long long lum_t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned long long lum_step = (unsigned long long)gridDim.x * blockDim.x;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr unsigned long long CHUNK = {{CHUNK}}ull;
  for (unsigned long long lum_off = lum_t * CHUNK; lum_off < nbytes; lum_off += lum_step * CHUNK) {
    const unsigned lum_size = (unsigned)((nbytes - lum_off < CHUNK ? nbytes - lum_off : CHUNK) & ~15ull);
    if (lum_size)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p + lum_off), "r"(lum_size) : "memory");
  }
#elif defined(__CUDA_ARCH__)
  for (unsigned long long lum_off = lum_t * 128; lum_off < nbytes; lum_off += lum_step * 128)
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p + lum_off));
#else
  (void)p; (void)nbytes; (void)lum_t; (void)lum_step;   // host emulation (tests): nothing to warm
#endif
}
