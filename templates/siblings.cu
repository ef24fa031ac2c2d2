//! lum/templates/siblings.cu — sibling kernels as one launch: kernel ops that follow one another in a
//! program and do not depend on each other (gemma's k norm + RoPE + cache write, v-cache write and q norm
//! + RoPE, all reading only the qkv projection) run as disjoint block ranges of one grid
//! (builder/siblings.py). Each sibling's body is a device function of its own block index and grid size;
//! every template loops grid-stride over its work, so any grid is correct for it. The siblings' grids
//! laid end to end are the kernel's virtual blocks; block b runs virtual blocks b, b + gridDim.x, …, each
//! as a block of the sibling whose range holds it, so any grid >= 1 is correct here too (the launched
//! one holds every virtual block: one each).
//!
//! The launch order (common.cuh): the kernel triggers its successor and waits for its predecessor before
//! it dispatches, so the launch table may mark it programmatic; each body's own trigger and wait are then
//! no-ops. So nothing is read before the wait here (a sibling's early reads come after it).
//!
//! Placeholders: KERNEL THREADS PARAMS (every sibling's parameters, the first's as a kernel's, the others'
//!   renamed t<j>_…); FUNCTIONS (the siblings' bodies as device functions); DYN_LOADS (the preamble: the
//!   dyn vars the grids use, the wait); GRIDS (const unsigned int lum_g<j>: sibling j's grid), TOTAL (their
//!   sum); DISPATCH (per sibling: the call when virtual block lum_b is in its range).
{{FUNCTIONS}}
extern "C" __global__ void __launch_bounds__({{THREADS}}) {{KERNEL}}({{PARAMS}}) {
  typedef long long idx_t;
{{DYN_LOADS}}
{{GRIDS}}
  for (unsigned int lum_v = blockIdx.x; lum_v < {{TOTAL}}; lum_v += gridDim.x) {   // uniform per block
    unsigned int lum_b = lum_v;
{{DISPATCH}}
  }
}
