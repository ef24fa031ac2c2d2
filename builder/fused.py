"""What the kernels that run several ops' bodies in one launch share (builder/siblings.py,
builder/attention_stage.py, builder/o_combine.py): the kernel entry they find in a body,
the joined launch's parameters, which ops do no device work, and for a head op fused with the one op after it
that reads it, the pass over the program and the static values of the ops' parameters.

Such a kernel keeps the LLIR unchanged: its launch table entry names the first op the kernel and the others
its tails (table version 2, :mod:`lum.format.manifest`), their parameters ``t<j>_out, t<j>_in…`` after the
first op's ``out, in…, dyn``."""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Sequence

from lum.builder.codegen import KernelSource, Param
from lum.builder.env_switches import CodegenError
from lum.builder.rewrite import readers
from lum.format.expr import as_expr
from lum.format.llir import LOp, Program

__all__ = ["NO_WORK", "ENTRY_RE", "joined_params", "static_int", "static_params", "fuse_head_and_tail"]

NO_WORK = ("input", "constant", "output")      # op kinds with no device work
ENTRY_RE = re.compile(r'extern "C" __global__ void __launch_bounds__\(\d+(?:, \d+)?\) (\w+)\(')


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
                params.append(_renamed(p, name))
            names.append(name)
        calls.append(", ".join(names))
    return params, calls


def static_int(e: Any) -> int | None:
    """``e`` (an expression, an int or None) as an int where it is a constant, else None."""
    if e is None:
        return None
    e = as_expr(e)
    return e.value if e.is_const else None


def static_params(op: LOp, defaults: Mapping[str, Any]) -> dict[str, int | None]:
    """The static value (:func:`static_int`) of each of ``op``'s parameters named in ``defaults``, the default
    where ``op`` does not set it."""
    return {k: static_int(op.params.get(k, v)) for k, v in defaults.items()}


def fuse_head_and_tail(program: Program, sources: Mapping[int, KernelSource | None],
                       match: Callable[[LOp, Mapping[int, list[LOp]]], tuple[LOp, Any] | None],
                       build: Callable[[Any, KernelSource, KernelSource], KernelSource]
                       ) -> dict[int, KernelSource | None]:
    """``sources`` with each pair that ``match(tail, readers)`` finds for an op, as (its head op, what ``build``
    takes), one kernel under the head that ``build(found, head's source, tail's source)`` writes, the tail's
    entry dropped (:attr:`KernelSource.tails` names it). A pair whose sources are missing or already fused, or
    that ``build`` refuses (CodegenError), keeps its two kernels."""
    out = dict(sources)
    users = readers(program)
    for tail in program.ops:
        found = match(tail, users)
        if found is None:
            continue
        head, what = found
        if any(sources.get(i) is None or sources[i].tails for i in (head.id, tail.id)):
            continue
        try:
            out[head.id] = build(what, sources[head.id], sources[tail.id])
        except CodegenError:
            continue
        out.pop(tail.id, None)
    return out


def _renamed(p: Param, name: str) -> Param:
    """``p`` named ``name``, without ``__restrict__``: in a fused kernel two of its pointers may name one buffer
    (one op's output another reads; two siblings reading one input)."""
    decl = p.ctype.replace("__restrict__ ", "").rsplit(" ", 1)[0]
    return Param(name, p.role, p.index, p.dtype, f"{decl} {name}")
