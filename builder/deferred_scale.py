"""A GEMV prologue's row scale, applied after the dot product instead of before it.

An RMSNorm before a projection is ``A[i, k] = x[i, k] · s_i · w[k]`` with ``s_i = rsqrt(Σ_k x[i, k]² / n +
eps)``: one scalar per row of A. Then ``Σ_k A[i, k] · W[j, k] = s_i · Σ_k x[i, k] · w[k] · W[j, k]``, and
``Σ_k x[i, k]²`` runs over the same k as the dot product. So the GEMV needs no block-wide prologue: each
lane multiplies its weights by ``x · w`` read where it reads them, adds ``x²`` to a sum of its own, and the
group that reduces a column's products reduces those sums with them; the column's value is then scaled by
``s_i``. Without the prologue (one round trip for the row, a block-wide reduction and its barriers before
the first multiply-add) the GEMV is a plain one: any grid, the plain GEMV's block sizes.

What it gives up: A's rounding to its storage dtype (a bf16 model rounds the normed row to bf16 before
the projection); the deferred form multiplies unrounded f32 values, which is nearer the float64 value.

:func:`split_row_scale` finds the split in a prologue tree: under an optional root cast, a product of
factors each of which either has no row reduction (the per-element part) or is a function of row
reductions and of leaves constant along the row only (the scale), every reduction's own tree free of
reductions. ``$LUM_GEMV_DEFER_SCALE=0`` keeps every prologue as a block-wide one (to measure it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from lum.format.llir import ROW_OPS, has_row_ops

__all__ = ["ENV_DEFER_SCALE", "ScaleSplit", "defer_scale_enabled", "split_row_scale"]

ENV_DEFER_SCALE = "LUM_GEMV_DEFER_SCALE"


def defer_scale_enabled() -> bool:
    """On unless ``$LUM_GEMV_DEFER_SCALE`` is ``0``."""
    v = os.environ.get(ENV_DEFER_SCALE, "1")
    if v not in ("0", "1"):
        raise ValueError(f"${ENV_DEFER_SCALE} must be 0 or 1, got {v!r}")
    return v == "1"


@dataclass(frozen=True)
class ScaleSplit:
    """A prologue tree as ``elem · scale``: ``elem`` has no row reduction (a value per element of A),
    ``scale`` reads the ``reductions`` (RowSum / RowMax nodes, each over a tree without reductions) and
    leaves constant along the row."""

    elem: list
    scale: list
    reductions: tuple[list, ...]


def _leaves_outside_rows(t: list, out: set[int]) -> None:
    if t[0] == "arg":
        out.add(int(t[1]))
    elif t[0] not in ROW_OPS:
        for x in t[2:]:
            _leaves_outside_rows(x, out)


def _reductions(t: list, out: list[list]) -> bool:
    """Collect ``t``'s row reductions in evaluation order; False where one nests another."""
    if t[0] == "arg":
        return True
    if t[0] in ROW_OPS:
        if has_row_ops(t[2]):
            return False
        if t not in out:
            out.append(t)
        return True
    return all(_reductions(x, out) for x in t[2:])


def _factors(t: list, out: list[list]) -> None:
    """The factors of a product tree of f32 Mul nodes (no rounding between them)."""
    if t[0] == "Mul" and t[1] == "f32":
        _factors(t[2], out)
        _factors(t[3], out)
    else:
        out.append(t)


def _product(factors: list[list]) -> list:
    t = factors[0]
    for f in factors[1:]:
        t = ["Mul", "f32", t, f]
    return t


def split_row_scale(expr: Any, row_constant: Callable[[int], bool]) -> ScaleSplit | None:
    """``expr`` (a GEMV prologue's Fused tree) as per-element part times row scale, or None where it is
    not one. ``row_constant(k)``: whether leaf ``k`` has one value along a row (a broadcast scalar)."""
    if not isinstance(expr, list) or not has_row_ops(expr):
        return None
    root = expr[2] if expr[0] == "Cast" else expr
    factors: list[list] = []
    _factors(root, factors)
    elem, scale = [], []
    for f in factors:
        if not has_row_ops(f):
            elem.append(f)
            continue
        leaves: set[int] = set()
        _leaves_outside_rows(f, leaves)
        if not all(row_constant(k) for k in leaves):
            return None
        scale.append(f)
    if not elem or not scale:
        return None
    reductions: list[list] = []
    if not all(_reductions(f, reductions) for f in scale):
        return None
    return ScaleSplit(_product(elem), _product(scale), tuple(reductions))
