"""What the kernels that run several ops' bodies in one launch share (builder/siblings.py,
builder/attention_stage.py): an op's kernel body as a device function, the joined
launch's parameters, and which ops do no device work.

Such a kernel keeps the LLIR unchanged: its launch table entry names the first op the kernel and the others
its tails (table version 2, :mod:`lum.format.manifest`), their parameters ``t<j>_out, t<j>_in…`` after the
first op's ``out, in…, dyn``."""

from __future__ import annotations

import re
from typing import Mapping, Sequence

from lum.builder.codegen import CodegenError, KernelSource, Param

__all__ = ["NO_WORK", "ENTRY_RE", "grid_blocks", "device_function", "joined_params", "renamed"]

NO_WORK = ("input", "constant", "output")      # op kinds with no device work
ENTRY_RE = re.compile(r'extern "C" __global__ void __launch_bounds__\(\d+(?:, \d+)?\) (\w+)\(')


def grid_blocks(ks: KernelSource, max_dyn: Mapping[str, int]) -> int | None:
    """Blocks of the kernel's one launch at the dyn bounds; None when a var of its grid is unbounded."""
    total = 1
    for g in ks.grid:
        if not g.vars() <= set(max_dyn):
            return None
        total *= int(g.evaluate(max_dyn))
    return total


def device_function(ks: KernelSource, name: str, at: tuple[str, str]) -> str:
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


def joined_params(params_of: Sequence[Sequence[Param]]) -> tuple[list[Param], list[str]]:
    """The parameters of one kernel that runs several ops' bodies: the first op's (``out, in…, dyn``), then
    each other op's as a tail's (``t<j>_out, t<j>_in…``; the one ``dyn`` serves all), none ``__restrict__``;
    and per op the arguments its body is called with, comma-separated."""
    params: list[Param] = []
    calls = []
    for j, own in enumerate(params_of):
        names = []
        for p in own:
            name = p.name if j == 0 or p.role == "dyn" else f"t{j - 1}_{p.name}"
            if j == 0 or p.role != "dyn":
                params.append(renamed(p, name))
            names.append(name)
        calls.append(", ".join(names))
    return params, calls


def renamed(p: Param, name: str) -> Param:
    """``p`` named ``name``, without ``__restrict__``: in a fused kernel two of its pointers may name one buffer
    (one op's output another reads; two siblings reading one input)."""
    decl = p.ctype.replace("__restrict__ ", "").rsplit(" ", 1)[0]
    return Param(name, p.role, p.index, p.dtype, f"{decl} {name}")
