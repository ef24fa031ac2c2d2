"""What the kernels that run several ops' bodies in one launch share (builder/siblings.py,
builder/attention_stage.py, builder/o_combine.py): the kernel entry they find in a body, the joined launch's
parameters, and which ops do no device work.

Such a kernel keeps the LLIR unchanged: its launch table entry names the first op the kernel and the others
its tails (table version 2, :mod:`lum.format.manifest`), their parameters ``t<j>_out, t<j>_in…`` after the
first op's ``out, in…, dyn``."""

from __future__ import annotations

import re
from typing import Sequence

from lum.builder.codegen import Param

__all__ = ["NO_WORK", "ENTRY_RE", "joined_params"]

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


def _renamed(p: Param, name: str) -> Param:
    """``p`` named ``name``, without ``__restrict__``: in a fused kernel two of its pointers may name one buffer
    (one op's output another reads; two siblings reading one input)."""
    decl = p.ctype.replace("__restrict__ ", "").rsplit(" ", 1)[0]
    return Param(name, p.role, p.index, p.dtype, f"{decl} {name}")
