"""Rewriting a lowered LLIR program after extraction (the GEMV prologue and epilogue passes): who reads
each op, and a program with some ops dropped and others replaced, ids renumbered in order."""

from __future__ import annotations

from lum.builder import costmodel
from lum.format.llir import Arg, LOp, Program

__all__ = ["readers", "rewritten"]


def readers(program: Program) -> dict[int, list[LOp]]:
    """Op id -> the ops that read its buffer (an op reading it twice is listed twice)."""
    out: dict[int, list[LOp]] = {}
    for o in program.ops:
        for a in o.args:
            out.setdefault(a.src, []).append(o)
    return out


def rewritten(program: Program, drop: set[int], replace: dict[int, LOp]) -> Program:
    """``program`` without the ops in ``drop`` and with ``replace[id]`` in place of op ``id`` (its args
    naming old ids), every op renumbered in order; the replaced ops' bytes and flops are recomputed."""
    new_id: dict[int, int] = {}
    ops: list[LOp] = []
    for o in program.ops:
        if o.id in drop:
            continue
        new_id[o.id] = len(ops)
        o = replace.get(o.id, o)
        ops.append(LOp(len(ops), o.kind, o.op, tuple(Arg(new_id[a.src], a.view) for a in o.args), o.shape, o.dtype,
                       o.params, o.alias, o.bytes, o.flops))
    out = Program(program.name, ops)
    for old in replace:
        o = out.ops[new_id[old]]
        o.bytes, o.flops = costmodel.op_bytes(o, out), costmodel.op_flops(o)
    return out
