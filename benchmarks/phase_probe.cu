//! lum/benchmarks/phase_probe.cu — the kernels of benchmarks/phase_probe.py (templates/common.cuh and
//! benchmarks/probe.cuh are pasted before this file). A stretch of small dependent kernels, as a decode
//! layer runs between two GEMVs (q norm + RoPE → attention → combine → residual norm), done two ways:
//!   probe_row:    one phase as its own launch: block b < rows normalises row b of x (RMSNorm of `n` floats,
//!                 one block a row) into y;
//!   probe_phases: every phase of the stretch in one launch of `gridDim.x` co-resident blocks, a grid-wide
//!                 barrier between phases (an arrival counter in global memory, zeroed before the graph
//!                 runs, `phases` arrivals a block); in each phase blocks b < rows do what probe_row does.
//! Both compute the same values in the same order (bit-equal outputs).

extern "C" __global__ void __launch_bounds__(256) probe_row(const float* __restrict__ x, const float* __restrict__ w,
                                                            float* __restrict__ y, int rows, int n) {
  for (int b = (int)blockIdx.x; b < rows; b += (int)gridDim.x) probe_norm_row(x + (size_t)b * n, w, y + (size_t)b * n, n);
}

// Phase p reads buffer p and writes buffer p + 1 (bufs: phases + 1 pointers to rows × n floats each).
extern "C" __global__ void __launch_bounds__(256) probe_phases(float* const* __restrict__ bufs, const float* __restrict__ w,
                                                               unsigned* __restrict__ arrivals, int phases, int rows, int n) {
  for (int p = 0; p < phases; ++p) {
    if (p > 0) {   // grid-wide barrier: every block has finished phase p - 1 and its writes are visible
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(arrivals, 1u);
        const unsigned target = (unsigned)p * gridDim.x;
        unsigned seen = 0;
        do {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(arrivals) : "memory");
        } while (seen < target);
      }
      __syncthreads();
    }
    for (int b = (int)blockIdx.x; b < rows; b += (int)gridDim.x) {
      probe_norm_row(bufs[p] + (size_t)b * n, w, bufs[p + 1] + (size_t)b * n, n);
    }
  }
}
