"""Run lum's CUDA backend without a GPU: a fake libcuda (tests/fake_cuda.c: host memory, graph capture
and replay, misuse checks), lum's generated kernels compiled for the host (CUDA threads as coroutines
where a kernel synchronises, a plain loop where it does not), and the host-memory cuBLASLt of
tests/fake_cublaslt.c routed through the fake stream so graph capture records it.

Everything the CUDA backend does in Python — driver calls and their argument types, pointers,
arena/state/weight layouts, parameter packing, graph capture, replay and eviction, dyn buffer
updates, in-place KV-cache writes, output copies — then runs for real; only the GPU itself is
missing. :func:`run_emulated` executes a script in a subprocess whose dynamic loader finds the fake
libcuda first (cuda-bindings loads the driver once per process).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from lum.builder.codegen import KernelSource, module_source

CC = shutil.which("cc") or shutil.which("gcc")
CXX = shutil.which("g++") or shutil.which("clang++")
HERE = Path(__file__).resolve().parent

_SHIM = r"""
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <vector>
#include <functional>
#include <csetjmp>
#include <ucontext.h>
// CUDA threads of a block as coroutines on one OS thread: a barrier yields to the scheduler, which
// resumes a thread only once every live thread its barrier spans has reached it: the block's for
// __syncthreads (and the vote), the warp's for a shuffle or __syncwarp. So warps may call different row
// functions with different numbers of shuffles (the attention stage's branch), as on the GPU, and a
// warp cannot pass a __syncthreads before the others reach it; threads stuck at different barriers are a
// deadlock on the GPU, and abort here.
// A coroutine starts on its own stack through setcontext (makecontext's entry) and then switches with
// _setjmp / _longjmp, which leave the signal mask alone: swapcontext's system call per switch made
// kernels with many barriers (flash attention) spend most of their emulated time in the kernel.
// lum_emu_run_resident runs every block of a grid at once (their threads as coroutines of one scheduler),
// for kernels whose blocks wait for each other (a probe's: every block resident, as on the GPU when the
// grid fits the SMs once); there a thread may also wait at a named barrier (bar.sync id, count:
// `lum_named_barrier`) or spin (`lum_spin_yield`: runnable, but the others run first), and a grid whose
// every live thread only spins is a deadlock.
struct lum_dim3 { unsigned x = 0, y = 0, z = 0; };
static lum_dim3 threadIdx, blockIdx, blockDim, gridDim;
struct lum_jmp { jmp_buf b; };
static ucontext_t lum_sched;
static jmp_buf lum_sched_jb;
static std::vector<ucontext_t> lum_ctx;
static std::vector<lum_jmp> lum_jb;
static std::vector<char*> lum_stacks;
static std::vector<uint64_t> lum_slots;
static std::vector<char> lum_done, lum_started;
static std::vector<char> lum_wait;   // 0: may run; 1: at a block barrier; 2: at a warp barrier; 3: at a named
                                      // barrier; 4: spinning (may run)
static std::vector<unsigned> lum_bar;  // a thread's named barrier: id << 16 | count
static unsigned lum_base = 0;         // the current block's first thread in the arrays (resident runs)
static unsigned char* lum_dyn = nullptr;   // the current block's dynamic shared memory (resident runs)
static const std::function<void()>* lum_fn = nullptr;
static unsigned lum_cur = 0;
static void lum_yield_at(char kind) { lum_wait[lum_cur] = kind; if (!_setjmp(lum_jb[lum_cur].b)) _longjmp(lum_sched_jb, 1); }
static void lum_yield() { lum_yield_at(1); }
static void lum_warp_yield() { lum_yield_at(2); }
static void __syncthreads() { lum_yield(); }
static void lum_spin_yield() { lum_yield_at(4); }
static void lum_named_barrier(unsigned id, unsigned count) {
  lum_bar[lum_cur] = id << 16 | count;
  lum_yield_at(3);
}
static unsigned char* lum_emu_dyn_smem() { return lum_dyn; }
// A block-wide vote: every thread posts its predicate, then reads everyone's (two rounds, as a shuffle).
static int __syncthreads_or(int pred) {
  lum_slots[lum_base + threadIdx.x] = pred != 0;
  lum_yield();
  int any = 0;
  for (unsigned t = 0; t < blockDim.x; ++t) any |= lum_slots[lum_base + t] != 0;
  lum_yield();
  return any;
}
// A warp's barrier: the warp's stores before it are seen by its lanes after it.
static void __syncwarp(unsigned mask = 0xffffffffu) { if (mask == 0xffffffffu) lum_warp_yield(); }   // else: one lane
static void __threadfence() {}   // one OS thread runs every block: every store is already visible
static unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned old = *p; *p = old + v; return old; }
static unsigned atomicExch(unsigned* p, unsigned v) { const unsigned old = *p; *p = v; return old; }
template <typename T> static T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
  const int tid = (int)threadIdx.x, warp = tid / 32, lane = tid % 32;
  uint64_t bits = 0; std::memcpy(&bits, &v, sizeof(T));
  lum_slots[lum_base + tid] = bits;
  lum_warp_yield();
  int src = lane ^ lane_mask;
  if (src / width != lane / width) src = lane;
  uint64_t got = lum_slots[lum_base + warp * 32 + src];
  lum_warp_yield();
  T out; std::memcpy(&out, &got, sizeof(T)); return out;
}
static void lum_entry() { (*lum_fn)(); lum_done[lum_cur] = 1; _longjmp(lum_sched_jb, 1); }   // never returns
// Thread i's coroutine, to start at lum_entry on its own stack.
static void lum_new_thread(unsigned i, char* stack, size_t size) {
  getcontext(&lum_ctx[i]);
  lum_ctx[i].uc_stack.ss_sp = stack;
  lum_ctx[i].uc_stack.ss_size = size;
  lum_ctx[i].uc_link = &lum_sched;
  makecontext(&lum_ctx[i], lum_entry, 0);
}
// Release the barriers of the block whose threads are base .. base + block - 1 that every live thread they
// span has reached: the block's (__syncthreads), each warp's, each named barrier once its count is there.
static void lum_release(unsigned base, unsigned block) {
  bool all_at_block = true;
  for (unsigned t = base; t < base + block; ++t) all_at_block &= lum_done[t] || lum_wait[t] == 1;
  for (unsigned w = base; w < base + block; w += 32) {
    bool all_at_warp = true;
    for (unsigned t = w; t < base + block && t < w + 32; ++t) all_at_warp &= lum_done[t] || lum_wait[t] == 2;
    for (unsigned t = w; t < base + block && t < w + 32; ++t)
      if ((all_at_warp && lum_wait[t] == 2) || (all_at_block && lum_wait[t] == 1)) lum_wait[t] = 0;
  }
  for (unsigned t = base; t < base + block; ++t) {
    if (lum_wait[t] != 3) continue;
    unsigned at = 0;
    for (unsigned u = base; u < base + block; ++u) at += lum_wait[u] == 3 && lum_bar[u] == lum_bar[t];
    if (at >= (lum_bar[t] & 0xffffu)) {
      const unsigned id = lum_bar[t];
      for (unsigned u = base; u < base + block; ++u) if (lum_wait[u] == 3 && lum_bar[u] == id) lum_wait[u] = 0;
    }
  }
}
// Run thread i (lum_cur, threadIdx and the block's state set by the caller) up to its next wait or its end.
static void lum_resume(unsigned i) {
  if (!_setjmp(lum_sched_jb)) {          // back here when thread i yields or finishes
    if (lum_started[i]) _longjmp(lum_jb[i].b, 1);
    lum_started[i] = 1;
    setcontext(&lum_ctx[i]);
  }
}
static void lum_emu_run(unsigned grid, unsigned block, bool threaded, const std::function<void()>& fn) {
  gridDim.x = grid; gridDim.y = gridDim.z = 1; blockDim.x = block; blockDim.y = blockDim.z = 1;
  if (!threaded) {   // no barriers or shuffles: the threads of a block can run one after another
    for (unsigned b = 0; b < grid; ++b)
      for (unsigned t = 0; t < block; ++t) { threadIdx.x = t; blockIdx.x = b; fn(); }
    return;
  }
  const size_t stack = 256 * 1024;
  while (lum_stacks.size() < block) lum_stacks.push_back((char*)std::malloc(stack));
  lum_ctx.resize(block > lum_ctx.size() ? block : lum_ctx.size());
  lum_jb.resize(block > lum_jb.size() ? block : lum_jb.size());
  lum_slots.assign(block, 0);
  lum_bar.assign(block, 0);
  lum_fn = &fn;
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx.x = b;
    lum_done.assign(block, 0);
    lum_started.assign(block, 0);
    lum_wait.assign(block, 0);
    for (unsigned t = 0; t < block; ++t) lum_new_thread(t, lum_stacks[t], stack);
    for (;;) {
      lum_release(0, block);
      bool left = false, ran = false;
      for (unsigned t = 0; t < block; ++t) {
        if (lum_done[t]) continue;
        left = true;
        if (lum_wait[t]) continue;
        ran = true;
        lum_cur = t; threadIdx.x = t;
        lum_resume(t);
      }
      if (!left) break;
      if (!ran) {
        std::fprintf(stderr, "emulated block %u: its threads wait at different barriers (a deadlock on a GPU)\n", b);
        std::abort();
      }
    }
  }
}
// Every block of the grid at once: a scheduler round first releases each block's barriers (lum_release),
// then runs each thread that may run up to its next wait. `smem` bytes of dynamic shared memory a block (zeroed).
static void lum_emu_run_resident(unsigned grid, unsigned block, unsigned smem, const std::function<void()>& fn) {
  gridDim.x = grid; gridDim.y = gridDim.z = 1; blockDim.x = block; blockDim.y = blockDim.z = 1;
  const unsigned n = grid * block;
  const size_t stack = 64 * 1024;
  std::vector<char*> stacks(n);
  for (auto& st : stacks) st = (char*)std::malloc(stack);
  std::vector<unsigned char*> shared(grid);
  for (auto& sm : shared) sm = (unsigned char*)std::calloc(smem + 128, 1);
  lum_ctx.resize(n > lum_ctx.size() ? n : lum_ctx.size());
  lum_jb.resize(n > lum_jb.size() ? n : lum_jb.size());
  lum_slots.assign(n, 0); lum_done.assign(n, 0); lum_started.assign(n, 0); lum_wait.assign(n, 0); lum_bar.assign(n, 0);
  lum_fn = &fn;
  for (unsigned i = 0; i < n; ++i) lum_new_thread(i, stacks[i], stack);
  long idle = 0;                         // rounds in which every thread that ran only spun again
  for (;;) {
    bool left = false, progress = false;
    for (unsigned b = 0; b < grid; ++b) lum_release(b * block, block);
    for (unsigned i = 0; i < n; ++i) {
      if (lum_done[i]) continue;
      left = true;
      if (lum_wait[i] != 0 && lum_wait[i] != 4) continue;
      const bool spun = lum_wait[i] == 4;
      lum_wait[i] = 0;
      lum_cur = i; threadIdx.x = i % block; blockIdx.x = i / block; lum_base = i - i % block;
      lum_dyn = shared[i / block] + (128 - (uintptr_t)shared[i / block] % 128) % 128;
      lum_resume(i);
      progress |= !(spun && lum_wait[i] == 4);
    }
    if (!left) break;
    idle = progress ? 0 : idle + 1;
    if (idle > 1000) {
      std::fprintf(stderr, "emulated grid: every live thread spins (a deadlock on a GPU)\n");
      std::abort();
    }
  }
  for (auto st : stacks) std::free(st);
  for (auto sm : shared) std::free(sm);
  lum_base = 0; lum_dyn = nullptr;
}
// What the kernels of probes use of CUDA's vector types and intrinsics, for the host.
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
template <typename T> static T __ldg(const T* p) { return *p; }
template <typename T> static T __ldcg(const T* p) { return *p; }
static float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
static float lum_host_expf(float x) { return std::exp(x); }
#define __expf lum_host_expf   // glibc declares an __expf it does not export
#define __CUDACC__ 1
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __noinline__
#define __shared__ static
"""


def _ptype(ctype: str) -> str:
    return re.sub(r"\b__restrict__\b", "", ctype.rsplit(" ", 1)[0]).strip()


def kernel_library(kernels: Iterable[KernelSource], out_dir: Path) -> Path:
    """Compile ``kernels`` for the host; each launch kernel ``K`` gets ``run_K(void** params, grid, block)``
    taking ``cuLaunchKernel``-style parameters (an array of pointers to the values)."""
    uniq: dict[str, KernelSource] = {}
    for k in kernels:
        uniq.setdefault(k.name, k)
    src = [_SHIM, module_source(list(uniq.values()))]
    for k in uniq.values():
        threaded = any(x in k.body for x in ("__syncthreads", "__shfl", "lum_warp_reduce", "lum_group_reduce"))
        for lc in k.launches:
            args = ", ".join(f"*({_ptype(p.ctype)}*)p[{i}]" for i, p in enumerate(k.params))
            sync = "true" if threaded else "false"
            run = f"lum_emu_run(grid, block, {sync}, [&] {{ {lc.kernel}({args}); }})"
            src.append(f'extern "C" void run_{lc.kernel}(void** p, unsigned grid, unsigned block) {{ {run}; }}')
    out_dir.mkdir(parents=True, exist_ok=True)
    cpp = out_dir / "kernels.cpp"
    cpp.write_text("\n".join(src))
    so = out_dir / "libkernels.so"
    r = subprocess.run([CXX, "-std=c++17", "-O1", "-U_FORTIFY_SOURCE", "-shared", "-fPIC", "-pthread",   # _longjmp
                        "-Wno-unknown-pragmas", "-o", str(so), str(cpp)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[:5000])
    return so


def resident_library(source: str, entries: dict[str, Sequence[str]], out_dir: Path) -> Path:
    """Compile CUDA ``source`` (whose kernels' blocks wait for each other: a probe's) for
    the host; each entry ``K`` (its parameters' C types) gets ``run_K(void** params, grid, block, smem)``, which
    runs every block of the grid at once with ``smem`` bytes of dynamic shared memory a block
    (``lum_emu_run_resident``)."""
    src = [_SHIM, source]
    for name, ctypes_ in entries.items():
        args = ", ".join(f"*({t}*)p[{i}]" for i, t in enumerate(ctypes_))
        src.append(f'extern "C" void run_{name}(void** p, unsigned grid, unsigned block, unsigned smem) '
                   f'{{ lum_emu_run_resident(grid, block, smem, [&] {{ {name}({args}); }}); }}')
    out_dir.mkdir(parents=True, exist_ok=True)
    cpp = out_dir / "resident.cpp"
    cpp.write_text("\n".join(src))
    so = out_dir / "libresident.so"
    r = subprocess.run([CXX, "-std=c++17", "-O2", "-U_FORTIFY_SOURCE", "-shared", "-fPIC", "-Wno-unknown-pragmas",
                        "-o", str(so), str(cpp)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[:5000])
    return so


def package_kernel_sources(pkg: Any, tuning: dict[str, Any] | None = None) -> list[KernelSource]:
    """Regenerate a package's kernels from its LLIR and launch tables (same sources, so same names);
    ``tuning``: the build's ``kernel_tuning``, if it had one."""
    from lum.builder.kernels import group_kernel_sources
    from lum.builder.package_builder import _weight_inputs

    out = []
    m = pkg.manifest
    for g, (ref, prog) in enumerate(zip(m.groups, pkg.programs)):
        t = ref.table
        if t is None or not t.ops:
            continue
        gen = group_kernel_sources(prog, list(t.dyn_vars), dict(t.max_dyn), tuning,   # the build's env
                                   weights=_weight_inputs(prog, g, m.entries, set(m.weights)))
        for k in t.ops:
            ks = gen.get(k.op)
            if ks is None or [lc.kernel for lc in ks.launches] != [lc.kernel for lc in k.launches]:
                raise RuntimeError(f"op {k.op}: regenerated kernel differs from the package's ({k.name})")
            out.append(ks)
    return out


def fake_driver(out_dir: Path) -> Path:
    """Build tests/fake_cuda.c as ``out_dir/libcuda.so.1``; returns the folder."""
    out_dir.mkdir(parents=True, exist_ok=True)
    so = out_dir / "libcuda.so.1"
    r = subprocess.run([CC, "-shared", "-fPIC", "-O1", "-o", str(so), "-Wl,-soname,libcuda.so.1",
                        str(HERE / "fake_cuda.c"), "-ldl"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[:5000])
    return out_dir


def fake_cublaslt(out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    so = out_dir / "libfakecublasLt.so"
    r = subprocess.run([CC, "-shared", "-fPIC", "-O1", "-o", str(so), str(HERE / "fake_cublaslt.c")],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[:5000])
    return so


# The prelude of every emulated script: route the fake cuBLASLt's matmuls through the fake stream (so
# a graph capture records them) and load it instead of the real library.
PRELUDE = r'''
import ctypes, json, os, sys
import numpy as np
from lum.loader import cublaslt as _lt
_FAKE = ctypes.CDLL("libcuda.so.1")
_FAKE.fake_enqueue_host.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
for _n in ("fake_live", "fake_launches", "fake_graph_launches", "fake_captures", "fake_joins",
           "fake_programmatic_launches", "fake_clustered_launches", "fake_shared_optins"):
    getattr(_FAKE, _n).restype = ctypes.c_long
_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_PENDING = {}
_NEXT = [1]

@_HOST_FN
def _host_call(arg):
    _PENDING[arg]()

class _Plan:
    def __init__(self, plan): self._p = plan
    def __getattr__(self, k): return getattr(self._p, k)
    def run(self, stream, a, b, c, ws=0, wsn=0):
        key = _NEXT[0]; _NEXT[0] += 1
        _PENDING[key] = lambda: self._p.run(0, a, b, c, ws, wsn)
        assert _FAKE.fake_enqueue_host(stream, _host_call, key) == 0

_orig_plan = _lt.CublasLt.matmul_plan
_lt.CublasLt.matmul_plan = lambda self, *a, **k: _Plan(_orig_plan(self, *a, **k))
_orig_load = _lt.CublasLt.load.__func__
_lt.CublasLt.load = classmethod(lambda cls, path=None: _orig_load(cls, os.environ["LUM_FAKE_CUBLASLT"]))

def fake_stats():
    return {"live": [_FAKE.fake_live(i) for i in range(7)], "launches": _FAKE.fake_launches(),
            "graph_launches": _FAKE.fake_graph_launches(), "captures": _FAKE.fake_captures(),
            "joins": _FAKE.fake_joins(), "programmatic_launches": _FAKE.fake_programmatic_launches(),
            "clustered_launches": _FAKE.fake_clustered_launches(),
            "shared_optins": _FAKE.fake_shared_optins(),
            "bad_guards": _FAKE.fake_check_guards()}
'''


def run_emulated(script: str, *, driver_dir: Path, kernels: Path | None, cublaslt: Path | None,
                 env: dict[str, str] | None = None, timeout: int = 600) -> Any:
    """Run ``PRELUDE + script`` in a fresh interpreter on the fake driver; the script prints one JSON
    line last, which is returned."""
    e = dict(os.environ)
    e["LD_LIBRARY_PATH"] = f"{driver_dir}:{e.get('LD_LIBRARY_PATH', '')}"
    if kernels is not None:
        e["LUM_FAKE_CUDA_KERNELS"] = str(kernels)
    if cublaslt is not None:
        e["LUM_FAKE_CUBLASLT"] = str(cublaslt)
    e.update(env or {})
    r = subprocess.run([sys.executable, "-c", PRELUDE + script], capture_output=True, text=True, env=e,
                       timeout=timeout, cwd=str(HERE.parent))
    if r.returncode != 0:
        raise AssertionError(f"emulated run failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])
