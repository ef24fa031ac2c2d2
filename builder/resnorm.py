"""The residual link by linearity: gemma's norm after the residual add takes its sums from o's column groups
(off unless ``$LUM_RESNORM_SUMS`` is ``1`` or ``raw``, until measured in lum; benchmarks/NOTES.md "The residual link by
linearity").

Gemma's decode layer forms gate-up's input in a one-block kernel after o:

    u = (h · r(h)) · w_f,   h = x + (o · r(o)) · w_p,   r(v) = 1 / √(Σ v² · c + e)

Both norms need sums over every feature, so the kernel waits for all of o and gate-up waits for it: a link on the
chain with no weight bytes (2.3 µs of a layer). By linearity Σ h² = Σ x² + 2 r(o) Σ x·(o·w_p) + r(o)² Σ (o·w_p)²,
so four sums of products of x, o and w_p give both norms, and each of o's column groups can add its share as it
finishes: here four reduce ops P (Σ o², Σ x², Σ x·o·w_p, Σ (o·w_p)²) over o's columns grouped as o's cluster kernel
owns them (:func:`~lum.builder.o_combine.owner_slots`: column g·COLS + i·R + r in slot (g, r)), and u's row sums
replaced by row sums over those slots (a view of P padded with zeros to u's row). In the form ``ab`` (the switch's
``1``) u is also rewritten as (A + B·r(o))·r(h) over two bf16 vectors A = x·w_f and B = o·w_p·w_f, so that gate-up
reads 10 KB of them rather than x and o in f32 and both weights (``raw``, 30 KB a block). u then has no
reduction over a full row, so gate-up computes it as a light prologue keeping its grid
(:func:`~lum.builder.gemv_policy.light_prologue`), and P (with A and B) runs as tails of o's kernel
(``templates/gemv_combine.cu``): the link is gone from the chain. Measured as a probe first
(benchmarks/resnorm_probe.py: 2.1 µs a layer shorter on an H100 with A and B in f32).

Not exact against the reference: Σ h² is the same sum in another order and grouping (float64 there, f32 slots
here), so u differs where the f32 rounding of Σ h² does, and in the form ``ab`` by A's and B's rounding to bf16;
where the attention's output nearly cancels the residual (‖h‖ ≪ ‖x‖) the three terms cancel and lose digits. The rewrite fires only on that tree, with x and o plain
f32 leaves of one row and o split by head in one cluster kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from lum.builder.env_switches import env_choice
from lum.builder.o_combine import owner_slots
from lum.builder.rewrite import rewritten
from lum.format.dtypes import DType
from lum.format.expr import as_expr
from lum.format.llir import Arg, LOp, Program
from lum.format.shapetracker import ShapeTracker

__all__ = ["ENV_RESNORM_SUMS", "FORMS", "resnorm_sums_form", "resnorm_by_sums", "ResidualNorm", "residual_norm"]

ENV_RESNORM_SUMS = "LUM_RESNORM_SUMS"
FORMS = ("ab", "raw")
_F32 = DType.f32.name


def resnorm_sums_form() -> str | None:
    """``$LUM_RESNORM_SUMS``: ``1`` rewrites gemma's norm after the residual (the module docstring) in the form
    ``ab``, ``raw`` in the form ``raw`` (:func:`resnorm_by_sums`); ``0``, the default, not at all."""
    return env_choice(ENV_RESNORM_SUMS, {"0": None, "1": "ab", "raw": "raw"}, "0")


def _is(t: Any, op: str, arity: int) -> bool:
    return isinstance(t, list) and len(t) == 2 + arity and t[0] == op and t[1] == _F32


def _rms(t: Any) -> tuple[list, list] | None:
    """(v, the RowSum node) of ``Recip(Sqrt(Add(Mul(RowSum(Mul(v, v)), c), e)))``, all f32."""
    if not (_is(t, "Recip", 1) and _is(t[2], "Sqrt", 1) and _is(t[2][2], "Add", 2) and _is(t[2][2][2], "Mul", 2)):
        return None
    rs = t[2][2][2][2]
    if not (_is(rs, "RowSum", 1) and _is(rs[2], "Mul", 2) and rs[2][2] == rs[2][3]):
        return None
    return rs[2][2], rs


def _normed(t: Any) -> tuple[list, list, list, list] | None:
    """(v, r(v), its RowSum node, w) of ``Mul(Mul(v, r(v)), w)``."""
    if not (_is(t, "Mul", 2) and _is(t[2], "Mul", 2)):
        return None
    v, r = t[2][2], t[2][3]
    rv = _rms(r)
    if rv is None or rv[0] != v:
        return None
    return v, r, rv[1], t[3]


def _leaf(t: Any) -> int | None:
    return int(t[1]) if isinstance(t, list) and len(t) == 2 and t[0] == "arg" else None


@dataclass(frozen=True)
class ResidualNorm:
    """The parts of ``Cast(·, Mul(Mul(h, r(h)), w_f))`` with ``h = Add(x, Mul(Mul(o, r(o)), w_p))``: the leaves
    x and o (arg indices), the subtrees r(o), o·w_p's node, the two RowSum nodes, r(h) and w_f."""

    x: int
    o: int
    r_o: list
    ow: list
    sum_o: list
    sum_h: list
    r_h: list
    wf: list


def residual_norm(op: LOp) -> ResidualNorm | None:
    """The residual norm tree of an elementwise op (the module docstring), or None."""
    if op.kind != "elementwise" or op.op != "Fused" or op.alias is not None:
        return None
    t = op.params["expr"]
    if isinstance(t, list) and len(t) == 3 and t[0] == "Cast":
        t = t[2]
    outer = _normed(t)
    if outer is None or not _is(outer[0], "Add", 2):
        return None
    x, rest = outer[0][2], outer[0][3]
    inner = _normed(rest)
    if inner is None or _leaf(x) is None or _leaf(inner[0]) is None:
        return None
    ow = ["Mul", _F32, inner[0], inner[3]]
    return ResidualNorm(_leaf(x), _leaf(inner[0]), inner[1], ow, inner[2], outer[2], outer[1], outer[3])


def _replaced(t: Any, old: list, new: list) -> Any:
    if t == old:
        return new
    if isinstance(t, list) and t and t[0] not in ("arg", "acc"):
        return [t[0], t[1], *(_replaced(k, old, new) for k in t[2:])]
    return t


def _leaves(t: Any) -> list[int]:
    if _leaf(t) is not None:
        return [_leaf(t)]
    return [k for c in (t[2:] if isinstance(t, list) else []) for k in _leaves(c)]


def _renamed(t: Any, index: dict[int, int]) -> Any:
    if _leaf(t) is not None:
        return ["arg", index[_leaf(t)]]
    return [t[0], t[1], *(_renamed(k, index) for k in t[2:])]


def _grouped(view: ShapeTracker, groups: int, ranks: int, cols: int) -> ShapeTracker | None:
    """``view`` (of one row of n = groups·cols features) read as [groups, ranks, cols / ranks]: element (g, r, i)
    is feature g·cols + i·ranks + r, the slot of o's cluster kernel that owns it; None where it is masked."""
    if view.mask is not None or len(view.shape) != 2 or view.shape[0] != as_expr(1):
        return None
    s = view.strides[1]
    return ShapeTracker((as_expr(groups), as_expr(ranks), as_expr(cols // ranks)),
                        (s * cols, s, s * ranks), view.offset, None)


def _slot_row(slots: int, n: int) -> ShapeTracker:
    """P's ``slots`` values read as u's row of n features, zeros past them: its row sum is P's sum."""
    return ShapeTracker((as_expr(1), as_expr(n)), (as_expr(0), as_expr(1)), as_expr(0),
                        ((as_expr(0), as_expr(1)), (as_expr(0), as_expr(slots))))


def _compact(tree: list, args: Sequence[Arg]) -> tuple[list, tuple[Arg, ...]]:
    """``tree`` over only the args it reads, renumbered in order."""
    used = sorted(set(_leaves(tree)))
    return _renamed(tree, {k: j for j, k in enumerate(used)}), tuple(args[k] for k in used)


def resnorm_by_sums(program: Program, form: str = "ab") -> Program:
    """``program`` with each residual norm over an o split by head (the module docstring) taking its row sums from
    four reduces over o's column slots; in ``form`` ``ab`` it reads x·w_f and o·w_p·w_f (A and B, two bf16 vectors
    o's kernel writes too) instead of x, o and the weights (``raw``). The new ops go right before the norm;
    ``program`` itself where none fires."""
    if form not in FORMS:
        raise ValueError(f"resnorm form must be one of {FORMS}, got {form!r}")
    replace: dict[int, LOp] = {}
    insert: dict[int, list[LOp]] = {}
    fresh = len(program.ops)
    for op in program.ops:
        rn = residual_norm(op)
        if rn is None:
            continue
        xa, oa = op.args[rn.x], op.args[rn.o]
        o = program.ops[oa.src]
        n = as_expr(op.shape[-1])
        slots = owner_slots(program, o)
        if slots is None or not n.is_const or len(op.shape) != 2 or as_expr(op.shape[0]) != as_expr(1):
            continue
        groups, ranks, cols = slots
        if groups * cols != n.value or program.ops[xa.src].dtype != DType.f32 or o.dtype != DType.f32:
            continue
        if any(_grouped(op.args[k].view, groups, ranks, cols) is None for k in _leaves(rn.ow) + [rn.x]):
            continue
        x, ow = ["arg", rn.x], rn.ow
        sums = [rn.sum_o[2], ["Mul", _F32, x, x], ["Mul", _F32, x, ow], ["Mul", _F32, ow, ow]]
        new_ops: list[LOp] = []
        for tree in sums:
            tree, args = _compact(tree, op.args)
            args = tuple(Arg(a.src, _grouped(a.view, groups, ranks, cols)) for a in args)
            new_ops.append(LOp(fresh, "reduce", "Sum", args, (as_expr(groups), as_expr(ranks)), DType.f32,
                               {"axis": 2, "expr": tree}))
            fresh += 1
        new_ops.append(LOp(fresh, "constant", "Constant", (), (), DType.f32, {"value": 2.0}))
        fresh += 1
        pool = list(op.args) + [Arg(p.id, _slot_row(groups * ranks, n.value)) for p in new_ops[:4]] + [
            Arg(new_ops[4].id, ShapeTracker((as_expr(1), n), (as_expr(0), as_expr(0)), as_expr(0)))]
        base = len(op.args)
        slot_sum = [["RowSum", _F32, ["arg", base + q]] for q in range(4)]
        r_o = _replaced(rn.r_o, rn.sum_o, slot_sum[0])
        sum_h = ["Add", _F32,
                 ["Add", _F32, slot_sum[1], ["Mul", _F32, ["Mul", _F32, r_o, ["arg", base + 4]], slot_sum[2]]],
                 ["Mul", _F32, ["Mul", _F32, r_o, r_o], slot_sum[3]]]
        if form == "raw":
            tree = _replaced(_replaced(op.params["expr"], rn.sum_h, sum_h), rn.sum_o, slot_sum[0])
        else:                             # u = (A + B r(o)) r(h), A = x w_f and B = o w_p w_f rounded to bf16
            for q, t in enumerate((["Mul", _F32, x, rn.wf], ["Mul", _F32, ow, rn.wf])):
                t, args = _compact(["Cast", DType.bf16.name, t], op.args)
                new_ops.append(LOp(fresh, "elementwise", "Fused", args, op.shape, DType.bf16, {"expr": t}))
                pool.append(Arg(fresh, ShapeTracker.contiguous(op.shape)))
                fresh += 1
            a, b = (["Cast", _F32, ["arg", len(pool) - 2]], ["Cast", _F32, ["arg", len(pool) - 1]])
            r_h = _replaced(rn.r_h, rn.sum_h, sum_h)
            tree = ["Mul", _F32, ["Add", _F32, a, ["Mul", _F32, b, r_o]], r_h]
            root = op.params["expr"]
            tree = [root[0], root[1], tree] if root[0] == "Cast" else tree
        tree, args = _compact(tree, pool)
        replace[op.id] = LOp(op.id, op.kind, op.op, args, op.shape, op.dtype, {**op.params, "expr": tree})
        insert[op.id] = new_ops
    if not replace:
        return program
    return rewritten(program, set(), replace, insert)
