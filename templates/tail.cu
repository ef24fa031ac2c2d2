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
//!   TAIL_CALLS (the tails' calls, a __syncthreads between two). The arrival: lum_count_done (common.cuh).
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
