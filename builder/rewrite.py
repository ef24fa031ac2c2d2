"""Rewriting a lowered LLIR program after extraction (the GEMV prologue and epilogue passes): who reads
each op, a program with some ops dropped and others replaced, ids renumbered in order, and the ops
only the group's outputs read moved last."""

from __future__ import annotations

from lum.builder import costmodel
from lum.format.llir import Arg, LOp, Program

__all__ = ["readers", "rewritten", "outputs_last"]


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
    out, new_id = _renumbered(program.name, [(o.id, replace.get(o.id, o)) for o in program.ops if o.id not in drop])
    for old in replace:
        o = out.ops[new_id[old]]
        o.bytes, o.flops = costmodel.op_bytes(o, out), costmodel.op_flops(o)
    return out


def outputs_last(program: Program) -> Program:
    """``program`` with the ops that only Output ops read moved after the other ops (renumbered), or
    ``program`` itself when nothing moves.

    Why: the loader runs a group's kernels in program order, and its branch scheduler
    (loader/cuda/branches.py) keeps a step on the stream of the step before it only when it depends on
    that step. An op nothing in the group reads (a residual that only the next layer needs) emitted
    between two ops of the group's chain pushes the rest of the chain onto a side stream behind an
    event; emitted after the chain, it is the one that goes beside it. The moved ops go in the order of
    their latest input, latest first, so the one that continues the chain stays next to it. Ops before
    the last one that writes in place (``alias``) stay where they are: it could overwrite what they read."""
    users = readers(program)
    body = [o for o in program.ops if o.kind != "output"]
    start = 1 + max((i for i, o in enumerate(body) if o.alias is not None), default=-1)
    at = {o.id: i for i, o in enumerate(program.ops)}

    def only_outputs(o: LOp) -> bool:
        return o.kind not in ("input", "constant") and bool(users.get(o.id)) and all(
            u.kind == "output" for u in users[o.id])

    late = sorted((o for o in body[start:] if only_outputs(o)),
                  key=lambda o: (-max((at[a.src] for a in o.args), default=-1), at[o.id]))
    order = body[:start] + [o for o in body[start:] if not only_outputs(o)] + late
    if [o.id for o in order] == [o.id for o in body]:
        return program
    order += [o for o in program.ops if o.kind == "output"]
    return _renumbered(program.name, [(o.id, o) for o in order])[0]


def _renumbered(name: str, ordered: list[tuple[int, LOp]]) -> tuple[Program, dict[int, int]]:
    """A program of these ops in this order, each (old id, op whose args name old ids) numbered by its
    place, and the map from old ids to new."""
    new_id = {old: i for i, (old, _) in enumerate(ordered)}
    ops = [LOp(i, o.kind, o.op, tuple(Arg(new_id[a.src], a.view) for a in o.args), o.shape, o.dtype, o.params,
               o.alias, o.bytes, o.flops) for i, (_, o) in enumerate(ordered)]
    return Program(name, ops), new_id
