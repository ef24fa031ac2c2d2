//! lum/templates/tail.cu — one kernel op (the head) whose last block to finish then runs the ops that
//! follow it (its tails): small consumers of the head's output, such as the one-row norm after a decode
//! GEMV or the RoPE and KV-cache writes after the qkv projection, each a launch of its own otherwise.
//!
//! Every block runs the head's kernel body (a device function here, blockIdx and gridDim its own), then
//! counts itself done: its threads' stores are ordered before the count by __syncthreads and the
//! count's release (the pattern of a grid barrier's arrival). The block that counts last acquires every
//! other block's stores and runs each tail's body in order as a grid of one block (the tails
//! were generated with the head's block size and read blockIdx 0, gridDim 1; they loop grid-stride, so
//! one block does all their work). A __syncthreads between tails makes one tail's stores visible to the
//! next. The last block resets the counter, so the next launch of this kernel (a later layer, a graph
//! replay) starts from zero; launches of one kernel never overlap (each reads what the one before it
//! wrote, through the layer's residual stream), so one counter per kernel suffices.
//!
//! Registers: the head keeps the count it has alone (MIN_BLOCKS resident blocks per SM, what that count
//! allows), so its occupancy and its memory stream do not change; the tails are not inlined, so the
//! spills their larger bodies need under that cap stay in the one block that runs them.
//!
//! Placeholders: KERNEL THREADS MIN_BLOCKS PARAMS (the head's parameters, then each tail's out and in buffers);
//!   FUNCTIONS (the head's and the tails' bodies as device functions); HEAD_CALL (the head's call);
//!   TAIL_CALLS (the tails' calls, a __syncthreads between two).
#ifndef LUM_COUNT_DONE
#define LUM_COUNT_DONE
// One block's arrival: an acquire-release add at GPU scope, so the stores this block's threads made
// before the __syncthreads are visible to whichever block counts last, and the last one sees all of
// them (no separate fences: a fence.sc is the slow way to the same order).
__device__ __forceinline__ unsigned int lum_count_done(unsigned int* lum_c) {
#if defined(__CUDA_ARCH__)
  unsigned int lum_old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(lum_old) : "l"(lum_c) : "memory");
  return lum_old;
#else
  __threadfence();
  return atomicAdd(lum_c, 1u);
#endif
}
#endif
{{FUNCTIONS}}
__device__ unsigned int {{KERNEL}}_count;  // blocks of the running launch that finished the head

extern "C" __global__ void __launch_bounds__({{THREADS}}, {{MIN_BLOCKS}}) {{KERNEL}}({{PARAMS}}) {
  {{HEAD_CALL}}
  __shared__ unsigned int lum_tail_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int lum_blocks = gridDim.x * gridDim.y * gridDim.z;
    lum_tail_last = lum_count_done(&{{KERNEL}}_count) == lum_blocks - 1u ? 1u : 0u;
  }
  __syncthreads();
  if (lum_tail_last == 0u) return;
{{TAIL_CALLS}}
  if (threadIdx.x == 0) {{KERNEL}}_count = 0u;
}
