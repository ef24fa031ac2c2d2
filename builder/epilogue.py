"""GEMV epilogues: the gate-up GEMV of a decode step stores gelu(gate)·up itself.

The stacked gate/up projection writes 2·I columns that one elementwise kernel then reads back, in
pairs (column c and c + I), to store the gated activation the down projection reads. When one thread
group of the GEMV (``templates/gemv.cu``) computes both columns of a pair, it can evaluate that
kernel's expression on its two accumulators and store the result: the elementwise launch and its
gap are gone, the GEMV writes I values instead of 2·I, and each A vector it loads serves both columns.

:func:`fuse_gemv_epilogues` rewrites a lowered program: an elementwise Fused op (no row reductions) that
reads a decode GEMV only through unmasked views of its one output row at static column offsets, the
GEMV having no other reader, becomes that GEMV with ``params["epilogue"]`` (LLIR version 3, see
:mod:`lum.format.llir`) at the elementwise op's place. ``LUM_GEMV_EPILOGUE=0`` turns it off (to
measure what it gives).
"""

from __future__ import annotations

import os

from lum.builder.gemv_policy import GEMV_MAX_ACC, gemv_rows
from lum.builder.rewrite import readers, rewritten
from lum.format.expr import as_expr
from lum.format.llir import Arg, LOp, Program, gemm_parts, has_row_ops
from lum.format.shapetracker import numel

__all__ = ["ENV_GEMV_EPILOGUE", "gemv_epilogues_enabled", "fuse_gemv_epilogues"]

ENV_GEMV_EPILOGUE = "LUM_GEMV_EPILOGUE"


def gemv_epilogues_enabled() -> bool:
    """On unless ``$LUM_GEMV_EPILOGUE`` is ``0``."""
    return os.environ.get(ENV_GEMV_EPILOGUE, "1") != "0"


def _column_offset(view, n_out, n) -> int | None:
    """The static column offset at which ``view`` reads one row of a [1, 1, n] product as ``n_out``
    consecutive columns (None when it reads anything else)."""
    shape = tuple(view.shape)
    if view.mask is not None or not shape or shape[-1] != n_out or view.strides[-1] != as_expr(1):
        return None
    if any(d != as_expr(1) for d in shape[:-1]) or not view.offset.is_const:
        return None
    off = view.offset.value
    return off if 0 <= off and off + n_out.value <= n.value else None


def _epilogue(op: LOp, gemm: LOp) -> tuple[list, list[int], list[Arg]] | None:
    """(tree, product column offsets, ordinary leaves) when ``gemm`` can compute ``op`` as its epilogue."""
    if op.kind != "elementwise" or op.op != "Fused" or op.alias is not None or has_row_ops(op.params["expr"]):
        return None
    p = gemm.params
    if gemv_rows(gemm) != 1 or p["layout"][2:] != "Cm" or "epilogue" in p:
        return None
    n, batch, n_out = as_expr(p["n"]), as_expr(p.get("batch", 1)), numel(op.shape)
    if batch != as_expr(1) or not n.is_const or not n_out.is_const:
        return None
    cols: list[int] = []
    leaves: list[Arg] = []
    slot: dict[int, tuple[str, int]] = {}        # op arg k -> ("acc", t) or ("arg", j)
    for k, a in enumerate(op.args):
        if a.src == gemm.id:
            off = _column_offset(a.view, n_out, n)
            if off is None:
                return None
            if off not in cols:
                cols.append(off)
            slot[k] = ("acc", cols.index(off))
        else:
            slot[k] = ("arg", len(leaves))
            leaves.append(a)
    if not cols or len(cols) > GEMV_MAX_ACC:
        return None

    def rename(t: list) -> list:
        if t[0] == "arg":
            return list(slot[t[1]])
        return [t[0], t[1], *(rename(x) for x in t[2:])]

    return rename(op.params["expr"]), cols, leaves


def fuse_gemv_epilogues(program: Program) -> Program:
    """``program`` with each elementwise op that only reads its GEMV's output columns (and other buffers)
    computed by that GEMV (a new Program; op ids renumbered). Returns ``program`` itself when nothing
    fuses."""
    users_of = readers(program)
    replace: dict[int, LOp] = {}                # the reader's id -> the GEMV computing it
    dropped: set[int] = set()
    for g in program.ops:
        users = {o.id: o for o in users_of.get(g.id, [])}
        if g.kind != "gemm" or len(users) != 1:
            continue
        (e,) = users.values()
        fused = _epilogue(e, g)
        if fused is None:
            continue
        tree, cols, leaves = fused
        jb, _ = gemm_parts(g)
        params = {**g.params, "epilogue": tree, "epilogue_leaves": len(leaves), "acc_cols": cols,
                  "acc_dtype": g.dtype.value, "n_out": numel(e.shape)}
        replace[e.id] = LOp(e.id, "gemm", "Gemm", (*g.args[:jb + 1], *leaves), e.shape, e.dtype, params)
        dropped.add(g.id)
    return rewritten(program, dropped, replace) if replace else program
