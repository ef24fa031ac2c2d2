"""Sibling kernels: independent small kernels that follow one another run as one launch.

After gemma's qkv projection come three kernels that read only its output: the k norm + RoPE + cache
write, the v-cache write and the q norm + RoPE (llama: k RoPE + write, v write, q RoPE). The loader
captures them on parallel graph branches (loader/cuda/branches.py), which joins them back through
events: the edges into and out of a side branch are full dependencies, so neither they nor attention,
which waits for all three, overlap the kernel before them under programmatic launch. As one kernel
(``templates/siblings.cu``) whose block ranges run the three bodies, the stage is one launch between
two programmatic edges, as long as its longest sibling.

:func:`fuse_siblings` takes, in program order, each maximal run of at least two kernel ops that

* follow one another with no other kernel op or library call between (inputs and constants do no work);
* read nothing another op of the run writes, and write (in place, too) nothing another reads or writes;
* are of the small kinds (elementwise, reduce, scatters, gather, iota) with one launch each and a grid
  of at most :data:`SIBLING_MAX_BLOCKS` blocks at the package's dyn bounds.

Each is regenerated with the run's smallest block size (a row kernel of one warp a row keeps its
rows spread over blocks). The LLIR is unchanged; the launch table names the run's first op the
kernel and the others its tails (table version 2), and the loader keeps every buffer the kernel reads
alive until it has run. On unless ``$LUM_SIBLING_KERNELS`` is ``0``: measured on the H200 (f7bd059 and
a4989c4, same runs), llama3-1b bf16 +1.6% / +1.5%, gemma3-4b bf16 354.8 tok/s against 354.9
(benchmarks/NOTES.md).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Mapping, Sequence

from lum.builder.codegen import CodegenError, generate
from lum.builder.env_switches import env_switch
from lum.builder.gemv_policy import split_gemv_tuning
from lum.builder.kernel_text import (ENTRY_PLACEHOLDER, KernelContext, KernelSource, Launch, common_header,
                                     entry_named, load_template, render)
from lum.builder.fused import ENTRY_RE, NO_WORK, joined_params
from lum.format.expr import as_expr
from lum.format.llir import LOp, Program

__all__ = ["ENV_SIBLING_KERNELS", "SIBLING_KINDS", "SIBLING_MAX_BLOCKS", "SIBLING_MAX_OPS", "sibling_kernels_enabled",
           "fuse_siblings"]

ENV_SIBLING_KERNELS = "LUM_SIBLING_KERNELS"
SIBLING_KINDS = ("elementwise", "reduce", "scatter_nocopy", "scatter", "gather", "iota")
SIBLING_MAX_BLOCKS = 256    # a sibling's grid at the dyn bounds, at most: small kernels, not a GEMV's stream
#                             (gemma3-4b's argmax: its two chunk reductions of 68 and 136 blocks are one launch)
SIBLING_MAX_OPS = 8


def sibling_kernels_enabled() -> bool:
    """``$LUM_SIBLING_KERNELS``: ``1`` (the default) runs independent small kernels that follow one another as
    one launch, ``0`` keeps them kernels of their own."""
    return env_switch(ENV_SIBLING_KERNELS, default=True)


def _root(program: Program, src: int) -> int:
    """The op whose buffer op ``src``'s value lives in (in-place ops share their aliased argument's)."""
    while True:
        op = program.ops[src]
        a = 0 if op.kind == "scatter_nocopy" else op.alias
        if a is None:
            return src
        src = op.args[a].src


def _independent(program: Program, run: Sequence[LOp], op: LOp) -> bool:
    """Whether ``op`` may run beside every op of ``run``: neither reads or writes what the other writes."""
    def writes(o: LOp) -> int:
        return _root(program, o.id)

    def reads(o: LOp) -> set[int]:
        return {_root(program, a.src) for a in o.args}

    return all(writes(o) not in reads(op) | {writes(op)} and writes(op) not in reads(o) for o in run)


def _small(op: LOp, ks: KernelSource | None, max_dyn: Mapping[str, int]) -> bool:
    if ks is None or op.kind not in SIBLING_KINDS or len(ks.launches) != 1 or ks.tails:
        return False
    blocks = _grid_blocks(ks, max_dyn)
    return blocks is not None and blocks <= SIBLING_MAX_BLOCKS


def fuse_siblings(program: Program, sources: Mapping[int, KernelSource | None], dyn_vars: Sequence[str],
                  max_dyn: Mapping[str, int] | None = None, tuning: Mapping[str, Any] | None = None
                  ) -> dict[int, KernelSource | None]:
    """``sources`` with each run of sibling kernels (the module docstring) as one kernel under the run's
    first op, its other ops' entries dropped (:attr:`KernelSource.tails` names them)."""
    max_dyn = dict(max_dyn or {})
    common = {k: v for k, v in split_gemv_tuning(tuning or {})[0].items() if k not in ("threads", "max_dyn")}
    out: dict[int, KernelSource | None] = dict(sources)
    runs: list[list[LOp]] = []
    run: list[LOp] = []
    for op in program.ops:
        if op.kind in NO_WORK:
            continue
        ks = sources.get(op.id)
        small = _small(op, ks, max_dyn)
        if small and run and len(run) < SIBLING_MAX_OPS and _independent(program, run, op):
            run.append(op)
            continue
        runs.append(run)
        run = [op] if small else []
    runs.append(run)
    for run in (r for r in runs if len(r) >= 2):
        fused = _fuse(program, run, sources, dyn_vars, max_dyn, common)
        if fused is not None:
            out[run[0].id] = fused
            for op in run[1:]:
                out.pop(op.id, None)
    return out


def _fuse(program: Program, run: Sequence[LOp], sources: Mapping[int, KernelSource | None], dyn_vars: Sequence[str],
          max_dyn: Mapping[str, int], common: Mapping[str, Any]) -> KernelSource | None:
    """The run as one kernel (``templates/siblings.cu``), or None when a sibling does not regenerate with the
    run's block size."""
    threads = min(sources[op.id].block[0] for op in run)
    kernels: list[KernelSource] = []
    for op in run:
        ks = sources[op.id]
        if ks.block[0] != threads:
            dts = [program.ops[a.src].dtype for a in op.args]
            try:
                ks = generate(op, dyn_vars, arg_dtypes=dts, max_dyn=max_dyn or None, **{**common, "threads": threads})
            except CodegenError:
                return None
            if ks is None or len(ks.launches) != 1 or ks.block != (threads, 1, 1):
                return None
        kernels.append(ks)
    ctx = KernelContext(tuple(dyn_vars), max_dyn=max_dyn or None)
    params, args = joined_params([ks.params for ks in kernels])   # the first's, then each other's as a tail's
    funcs, grids, dispatch = [], [], []
    total = as_expr(0)
    for j, ks in enumerate(kernels):
        fname = f"{ENTRY_PLACEHOLDER}_s{j}"
        body = ks.body.replace(ks.name, f"{ks.name}_s{j}")     # two siblings may be the same kernel
        entry = replace(ks.launches[0], kernel=f"{ks.name}_s{j}")
        funcs.append(_device_function(replace(ks, body=body, launches=(entry,)), fname, ("lum_bx", "lum_gx")))
        grid = ks.grid[0] * ks.grid[1] * ks.grid[2]
        total = total + grid
        grids.append(f"  const unsigned int lum_g{j} = (unsigned int)({ctx.c(grid)});")
        call = f"{fname}(lum_b, lum_g{j}, {args[j]});"
        dispatch.append(f"    {call}" if j + 1 == len(kernels) else
                        f"    if (lum_b < lum_g{j}) {{ {call} continue; }}\n    lum_b -= lum_g{j};")
    preamble, slots = ctx.dyn_loads()
    body = render(load_template("siblings.cu"), {
        "KERNEL": ENTRY_PLACEHOLDER, "THREADS": threads, "PARAMS": ", ".join(p.ctype for p in params),
        "FUNCTIONS": "\n".join(funcs), "DYN_LOADS": preamble, "GRIDS": "\n".join(grids),
        "TOTAL": " + ".join(f"lum_g{j}" for j in range(len(kernels))), "DISPATCH": "\n".join(dispatch)})
    head = kernels[0]
    body, name = entry_named(body, f"siblings/{head.kind}/{head.op}",
                             f"lum_{head.kind}_{(head.op or head.kind).lower()}_siblings_")
    for ks in kernels:
        slots.update(ks.dyn_slots)
    return replace(head, name=name, source=common_header() + "\n" + body, body=body,
                   launches=(Launch(name, (total, as_expr(1), as_expr(1)), (threads, 1, 1), 0),), params=tuple(params),
                   dyn_slots=dict(sorted(slots.items(), key=lambda kv: kv[1])),
                   tuning={**head.tuning, "siblings": [{"op": op.id, **ks.tuning} for op, ks in zip(run[1:], kernels[1:])]},
                   tails=tuple(op.id for op in run[1:]), early=())


def _grid_blocks(ks: KernelSource, max_dyn: Mapping[str, int]) -> int | None:
    """Blocks of the kernel's one launch at the dyn bounds; None when a var of its grid is unbounded."""
    total = 1
    for g in ks.grid:
        if not g.vars() <= set(max_dyn):
            return None
        total *= int(g.evaluate(max_dyn))
    return total


def _device_function(ks: KernelSource, name: str, at: tuple[str, str]) -> str:
    """The kernel's body as inlined ``__device__`` function ``name``, as blocks of a grid of its own within a
    larger one: its block index and grid size the function's two leading parameters, named ``at``."""
    if ENTRY_RE.findall(ks.body) != [ks.launches[0].kernel]:
        raise CodegenError(f"kernel {ks.name}: a fused kernel needs a body of exactly one kernel")
    body = ENTRY_RE.sub(f"__device__ __forceinline__ void {name}(unsigned int {at[0]}, unsigned int {at[1]}, ",
                        ks.body, count=1)
    body = re.sub(r"\bblockIdx\.x\b", at[0], body)
    body = re.sub(r"\bgridDim\.x\b", at[1], body)
    if re.search(r"\b(blockIdx|gridDim)\b", body):
        raise CodegenError(f"kernel {ks.name}: a fused body may use blockIdx.x and gridDim.x only")
    return body
