"""Row reads: a row kernel that reads another row kernel's output within the same rows recomputes it.

Gemma's q and k norms are row kernels (``x·rsqrt(mean(x²) + eps)·(1 + w)`` over each head's 256
values), and RoPE reads their output twice more through shifted, masked views (``rotate_half``: the
row's element j ± 128 where that lies in the row, 0 elsewhere). The e-graph inlines the norm into RoPE
for the plain read but not through those views: a shifted read of a row sum is the sum over the
shifted, half-padded row, not the row's (rules/rows.egg). So each norm stayed a kernel of its own
(the k norm on the critical path) only for the two shifted reads.

Here, after extraction: when every reader of such a producer P (a Fused tree with a row reduction)
is itself a row kernel (a Fused elementwise op, or a scatter with a fused prologue) and reads P only
through views that take, for its row r and column j, P's row r at column j + off (its leading dims
P's in some order — the heads-major read of a prefill's [s, heads, d] — unit dims aside; off = 0
without a mask, else a mask on the last axis only that keeps j + off inside the row), P's tree is
substituted at each read: its leaves re-read through the same dims, shift and mask, except inside
its row reductions, which read the unshifted row (a row's sum is the same at every column of it).
A masked read is wrapped in ``Where(guard, tree, guard)`` with ``guard`` a nonzero scalar constant
read through the mask, so a padded element is exactly 0 as the buffer read gave (the tree there
could be 0·∞). Leaves equal to the reader's own args are shared,
so the row reductions it already had are computed once (codegen dedupes equal row phases). P is
dropped. Exact with respect to the reference: every node rounds as before. ``LUM_ROW_READS=0``
turns it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lum.builder.rewrite import readers, rewritten
from lum.format.expr import as_expr
from lum.format.llir import ROW_OPS, Arg, LOp, Program, has_row_ops
from lum.format.shapetracker import ShapeTracker, contiguous_strides

__all__ = ["ENV_ROW_READS", "row_reads_enabled", "inline_row_reads"]

ENV_ROW_READS = "LUM_ROW_READS"


def row_reads_enabled() -> bool:
    """On unless ``$LUM_ROW_READS`` is ``0``."""
    return os.environ.get(ENV_ROW_READS, "1") != "0"


def _row_tree(op: LOp) -> list | None:
    """The Fused tree of a row-kernel producer, else None."""
    if op.kind == "elementwise" and op.op == "Fused" and op.alias is None and has_row_ops(op.params["expr"]):
        return op.params["expr"]
    return None


def _leaves(op: LOp) -> range | None:
    """The arg indices a reader's Fused tree reads (leaf k is ``args[first + k]``), None for other ops."""
    if op.kind == "elementwise" and op.op == "Fused":
        return range(len(op.args))
    if op.kind in ("scatter", "scatter_nocopy") and "expr" in op.params:
        return range(1, len(op.args) - 1)
    return None


@dataclass(frozen=True)
class _RowMap:
    """How a reader's view takes P's rows: its dim k is P's dim ``lead[k]`` (None: a unit dim), its
    column j is P's column j + ``off``, and only ``mask`` (a last-axis [lo, hi), or None) is read."""

    lead: tuple[int | None, ...]
    off: int
    mask: tuple | None


def _row_map(view: ShapeTracker, producer: LOp) -> _RowMap | None:
    """The :class:`_RowMap` of a reader's view of ``producer``'s buffer, or None when the view does not
    read whole rows of it in some order of its leading dims (see the module docstring)."""
    shape, pshape = tuple(view.shape), tuple(as_expr(d) for d in producer.shape)
    one, zero = as_expr(1), as_expr(0)
    if not shape or not pshape or shape[-1] != pshape[-1] or view.strides[-1] != one or not view.offset.is_const:
        return None
    strides = contiguous_strides(pshape)
    free = {q for q in range(len(pshape) - 1) if pshape[q] != one}
    lead: list[int | None] = []
    for d, st in zip(shape[:-1], view.strides[:-1]):
        if d == one:
            lead.append(None)
            continue
        q = next((q for q in free if strides[q] == st and pshape[q] == d), None)
        if q is None:
            return None
        free.discard(q)
        lead.append(q)
    if free:
        return None
    n, off = pshape[-1], view.offset.value
    if view.mask is None:
        return _RowMap(tuple(lead), 0, None) if off == 0 else None
    if any(m != (zero, d) for m, d in zip(view.mask[:-1], shape[:-1]) if d != one):
        return None
    lo, hi = view.mask[-1]
    if not (lo.is_const and hi.is_const and n.is_const) or not (0 <= lo.value + off and hi.value + off <= n.value):
        return None
    return _RowMap(tuple(lead), off, (lo, hi))


def _row_constant(view: ShapeTracker) -> bool:
    """The view reads one value per row (stride 0 along the row, no mask there): the same at column j + off."""
    if not view.shape or view.strides[-1] != as_expr(0):
        return False
    return view.mask is None or view.mask[-1] == (as_expr(0), as_expr(view.shape[-1]))


def _moved(leaf: ShapeTracker, shape: tuple, rows: _RowMap, shifted: bool) -> ShapeTracker | None:
    """A producer leaf's view in the reader's domain ``shape`` (its dims taken as ``rows.lead`` says),
    shifted by ``rows.off`` along the row and masked to ``rows.mask`` when ``shifted``; None when its
    mask cannot follow."""
    zero = as_expr(0)
    lm = leaf.mask
    strides = tuple(zero if q is None else leaf.strides[q] for q in rows.lead) + (leaf.strides[-1],)
    mask = None if lm is None else tuple((zero, as_expr(1)) if q is None else lm[q] for q in rows.lead) + (lm[-1],)
    offset = leaf.offset
    if shifted and rows.mask is not None:
        lo, hi = rows.mask
        m = list(mask or tuple((zero, d) for d in shape))
        a, b = m[-1]
        if not (a.is_const and b.is_const):
            return None
        m[-1] = (as_expr(max(lo.value, a.value - rows.off)), as_expr(min(hi.value, b.value - rows.off)))
        mask, offset = tuple(m), offset + leaf.strides[-1] * rows.off
    return ShapeTracker(shape, strides, offset, mask)


class _Reader:
    """A reader being rewritten: its kept args and the leaves appended to them (shared where equal)."""

    def __init__(self, op: LOp, producer: int):
        self.op, self.first = op, _leaves(op).start
        self.args: list[Arg] = []
        self.index: dict[int, int] = {}       # old leaf index -> new leaf index, for leaves not reading P
        for k in _leaves(op):
            if op.args[k].src != producer:
                self.index[k - self.first] = self.leaf(op.args[k])

    def leaf(self, arg: Arg) -> int:
        if arg not in self.args:
            self.args.append(arg)
        return self.args.index(arg)


def _substitute(tree: Any, fn) -> Any:
    if tree[0] == "arg":
        return fn(tree[1])
    return [tree[0], tree[1], *(_substitute(t, fn) for t in tree[2:])]


def _inline(reader: _Reader, producer: LOp, tree: list, view: ShapeTracker, guard: LOp | None) -> list | None:
    """``producer``'s tree read through ``view`` in ``reader``'s domain, over the reader's new leaves; None
    when it cannot be (a masked read needs a ``guard`` constant)."""
    rows = _row_map(view, producer)
    if rows is None or (rows.mask is not None and guard is None):
        return None
    shape = tuple(view.shape)
    failed = False

    def walk(t: list, shifted: bool) -> list:
        nonlocal failed
        if t[0] == "arg":
            a = producer.args[t[1]]
            v = _moved(a.view, shape, rows, shifted and not _row_constant(a.view))
            if v is None:
                failed = True
                return t
            return ["arg", reader.leaf(Arg(a.src, v))]
        inner = shifted and t[0] not in ROW_OPS       # a row's reduction reads the unshifted row
        return [t[0], t[1], *(walk(x, inner) for x in t[2:])]

    out = walk(tree, True)
    if failed:
        return None
    if rows.mask is None:
        return out
    g = ["arg", reader.leaf(Arg(guard.id, ShapeTracker(shape, tuple(as_expr(0) for _ in shape), as_expr(0),
                                                       tuple((as_expr(0), d) for d in shape[:-1]) + (rows.mask,))))]
    return ["Where", producer.dtype.value, ["Cast", "bool", g], out, g]


def _guard(program: Program, before: int) -> LOp | None:
    """A scalar float constant of the program, not 0, ahead of op ``before`` (the masked reads' guard)."""
    for o in program.ops[:before]:
        if (o.kind == "constant" and not o.shape and o.dtype.is_float and "value" in o.params
                and isinstance(o.params["value"], (int, float)) and o.params["value"] != 0):
            return o
    return None


def inline_row_reads(program: Program) -> Program:
    """``program`` with each row kernel that only row kernels read within its rows recomputed in them
    (a new Program, op ids renumbered); ``program`` itself when nothing changes."""
    users_of = readers(program)
    drop: set[int] = set()
    replace: dict[int, LOp] = {}
    for p in program.ops:
        tree = _row_tree(p) if p.id not in replace else None
        users = users_of.get(p.id, [])
        if tree is None or not users or any(_leaves(u) is None or u.id in replace or u.id in drop for u in users):
            continue
        if any(a.src == p.id for u in users for k, a in enumerate(u.args) if k not in _leaves(u)):
            continue                                  # read as a scatter's dest or index: a buffer
        new: dict[int, LOp] = {}
        for u in {u.id: u for u in users}.values():
            r, guard = _Reader(u, p.id), _guard(program, u.id)
            subs: dict[int, list] = {}
            for k in _leaves(u):
                if u.args[k].src == p.id:
                    t = _inline(r, p, tree, u.args[k].view, guard)
                    if t is None:
                        break
                    subs[k - r.first] = t
            else:
                expr = _substitute(u.params["expr"], lambda i: subs[i] if i in subs else ["arg", r.index[i]])
                lead, tail = u.args[:r.first], u.args[_leaves(u).stop:]
                new[u.id] = LOp(u.id, u.kind, u.op, (*lead, *r.args, *tail), u.shape, u.dtype,
                                {**u.params, "expr": expr}, u.alias)
                continue
            break
        else:
            drop.add(p.id)
            replace.update(new)
    if not drop:
        return program
    return rewritten(program, drop, replace)
