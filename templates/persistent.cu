//! lum/templates/persistent.cu — a run of a group's kernels (a decoder layer's GEMVs and the small kernels
//! between them) as one persistent launch: MIN_BLOCKS blocks an SM, every block resident, the kernels' bodies
//! called one after another as items, each item's blocks waiting until every block has finished the item
//! before (a counter in global memory) instead of a kernel boundary (builder/persistent.py).
//!
//! An item is a kernel's body as a device function whose blockIdx and gridDim are the item's (common.cuh
//! lum_run_item; builder/persistent.py _item_function), every pointer without __restrict__ (what it reads
//! another block wrote in this launch), its programmatic launch trigger removed. It runs its own grid (an
//! expression of the dyn vars) grid-stride over the launch's blocks, a __syncthreads between two of its blocks
//! on one SM; a GEMV's weights go into registers by its own code (gemv.cu), or its first ones into shared
//! memory after the item header (`reg-shared`, common.cuh lum_item_smem).
//!
//! Each item's first virtual block on a block waits inside its body, where its kernel waited for the one
//! before (common.cuh lum_item_wait), so that its preload is on its way across the wait; the run's first item
//! waits there for the previous launch. A block with no virtual block of an item does not wait for it, but
//! every block waits for the previous launch. An item whose kernel has no wait of its own waits before it.
//!
//! The counters: {{KERNEL}}_done[i] counts the blocks that finished item i (an acquire-release add after a
//! __syncthreads, common.cuh lum_count_done); an item's blocks wait until the one before counts gridDim.x
//! (lum_wait_count: thread 0 polls with acquire loads, then a __syncthreads), so every block has finished
//! every earlier item. The block that counts last at the end, when every block is past every wait, zeroes the
//! counters for the next launch (the next layer's, which waits for this grid to complete first).
//!
//! Placeholders: KERNEL THREADS MIN_BLOCKS (blocks an SM the registers must allow) PARAMS; FUNCTIONS (the
//!   items' bodies as device functions); DYN_LOADS (the dyn vars the grids use); ITEMS (their count); BODY
//!   (each item: its wait, its calls, its count).
{{FUNCTIONS}}
__device__ unsigned int {{KERNEL}}_done[{{ITEMS}} + 1];   // blocks that finished item i; the last: every item

extern "C" __global__ void __launch_bounds__({{THREADS}}, {{MIN_BLOCKS}}) {{KERNEL}}({{PARAMS}}) {
  typedef long long idx_t;
  lum_pdl_trigger();          // the next layer's blocks take each SM as this launch's block leaves it
{{DYN_LOADS}}
{{BODY}}
  __syncthreads();
  if (threadIdx.x == 0 && lum_count_done(&{{KERNEL}}_done[{{ITEMS}}]) == gridDim.x - 1u) {
    for (int i = 0; i <= {{ITEMS}}; ++i) {{KERNEL}}_done[i] = 0u;
  }
}
