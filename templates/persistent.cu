//! lum/templates/persistent.cu — a run of a group's kernels (a decoder layer's GEMVs and the small kernels
//! between them) as one persistent launch: one block an SM, every block resident, the kernels' bodies
//! called one after another as items, each item's blocks waiting until every block has finished the item
//! before (a counter in global memory) instead of a kernel boundary; and the GEMVs' weights streamed
//! through a ring of shared-memory stages (common.cuh "weights through a ring") that thread 0 refills, in
//! the order the block will use them, as soon as a stage is read. So while a block waits for the item
//! before (a norm, the attention, a residual) its next tiles of weights are already on their way: the bus
//! does not idle across the dependency the way it does across a kernel boundary (builder/persistent.py).
//!
//! An item is a kernel's body as a device function whose blockIdx and gridDim are the item's (common.cuh
//! lum_run_item; builder/persistent.py _item_function), every pointer without __restrict__ (what it reads
//! another block wrote in this launch), its waits and triggers for programmatic launch removed (the item
//! counters order it instead). A GEMV item
//! (gemv.cu RING) runs once on each block with the launch's grid: it walks its tiles grid-stride, as the
//! ring issues them. Any other item runs its own grid (an expression of the dyn vars) grid-stride over the
//! launch's blocks, a __syncthreads between two of its blocks on one SM.
//!
//! The counters: {{KERNEL}}_done[i] counts the blocks that finished item i (an acquire-release add after a
//! __syncthreads, common.cuh lum_count_done); an item's blocks wait until the one before counts gridDim.x
//! (lum_wait_count: thread 0 polls with acquire loads, then a __syncthreads), so every block has finished
//! every earlier item. The block that counts last at the end, when every block is past every wait, zeroes the
//! counters for the next launch (the next layer's, which waits for this grid to complete first).
//!
//! Register-fed (`reg`): no ring (N_RING and STAGES 0): each GEMV item is its kernel's body run grid-stride like
//! any other item, its weights loaded into registers by its own code, and the launch is MIN_BLOCKS blocks an SM.
//! Each item's first virtual block waits inside its body, where its kernel waited for the one before
//! (common.cuh lum_item_wait), so that its preload is on its way across the wait; the run's first item waits
//! there for the previous launch (WAIT empty). A block with no virtual block of an item does not wait for it.
//! `reg-shared`: the same, each GEMV's first weights copied into shared memory after the header (lum_item_smem).
//!
//! Placeholders: KERNEL THREADS MIN_BLOCKS (blocks an SM the registers must allow) PARAMS; WAIT (the wait for
//!   the previous launch before the items, empty where the first item waits itself); FUNCTIONS (the items'
//!   bodies as device functions); DYN_LOADS (the dyn vars the grids use); RING_ITEMS (thread 0 filling
//!   lum_ring()->items) N_RING STAGES STAGE_BYTES ASYNC (1: warp 0 copies the tiles in 16-byte cp.async, 0:
//!   thread 0 in bulk copies); ITEMS (their count); BODY (each item: its wait, its calls, its count).
{{FUNCTIONS}}
__device__ unsigned int {{KERNEL}}_done[{{ITEMS}} + 1];   // blocks that finished item i; the last: every item

extern "C" __global__ void __launch_bounds__({{THREADS}}, {{MIN_BLOCKS}}) {{KERNEL}}({{PARAMS}}) {
  typedef long long idx_t;
  lum_pdl_trigger();          // the next layer's blocks take each SM as this launch's block leaves it
  if (threadIdx.x < ({{ASYNC}} ? 32u : 1u)) {   // the weights' first tiles on their way before the wait
    LumRing* lum_r = lum_ring();
    if (threadIdx.x == 0) {
{{RING_ITEMS}}
    }
    lum_ring_start(lum_r, {{N_RING}}u, {{STAGES}}u, {{STAGE_BYTES}}u, {{ASYNC}}u);
  }
  __syncthreads();
{{DYN_LOADS}}
{{WAIT}}
{{BODY}}
  __syncthreads();
  if (threadIdx.x == 0 && lum_count_done(&{{KERNEL}}_done[{{ITEMS}}]) == gridDim.x - 1u) {
    for (int i = 0; i <= {{ITEMS}}; ++i) {{KERNEL}}_done[i] = 0u;
  }
}
