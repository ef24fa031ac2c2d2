"""Hand-made LLIR programs covering every kernel template (and the gemm layouts), with random inputs,
for the backend-vs-reference tests: tests/test_gpu.py on a GPU, tests/test_cuda_emulated.py on the
host emulation.

Each dtype gets one program holding every case (one NVRTC module, one session): case ``c`` reads
entry inputs ``c.x0``, ``c.x1`` … (flat 1-D buffers that the ops read through strided, broadcast,
sliced and padded views) and writes entry output ``c.y``. Shapes use the dyn var ``s`` so the kernels
read sizes from the device dyn buffer. Inputs are never zero (and positive where an op needs it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lum.format.dtypes import DType
from lum.format.expr import Var, as_expr, cdiv
from lum.format.llir import Arg, LOp, Program
from lum.format.manifest import Call, Entry, TensorSpec
from lum.format.shapetracker import ShapeTracker, numel

S = Var("s")
P = Var("p")
DYN = {"s": 5}           # the run
BOUNDS = {"s": 8}        # the session's bound (the arena is planned for it)
MAX_SEQ = 64             # what the kernels' index math may assume
TOL = {DType.f32: 1e-5, DType.bf16: 1e-2, DType.f16: 2e-3}
ELEMENTWISE = {"Cast": 1, "Contiguous": 1, "Exp2": 1, "Log2": 1, "Sin": 1, "Sqrt": 1, "Recip": 1, "Add": 2,
               "Mul": 2, "Mod": 2, "LessThan": 2, "Where": 3}
POSITIVE = {"Log2", "Sqrt"}


@dataclass
class _Builder:
    """Accumulates one program: inputs first (in order of creation), then ops, outputs last."""

    inputs: list[tuple[str, tuple, DType, str]] = field(default_factory=list)   # name, shape, dtype, role
    body: list[tuple] = field(default_factory=list)
    outputs: list[tuple[str, int, DType]] = field(default_factory=list)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    state: dict[str, TensorSpec] = field(default_factory=dict)
    state_init: dict[str, np.ndarray] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    tol: dict[str, float] = field(default_factory=dict)

    def input(self, name: str, size: Any, dtype: DType, role: str = "input") -> str:
        shape = tuple(map(as_expr, size)) if isinstance(size, tuple) else (as_expr(size),)
        self.inputs.append((name, shape, dtype, role))
        return name

    def program(self, name: str) -> Program:
        ops: list[LOp] = []
        ids: dict[str, int] = {}
        for nm, shape, dt, role in self.inputs:
            ids[nm] = len(ops)
            ops.append(LOp(len(ops), "input", "Input", (), shape, dt, {"name": nm, "role": role}))
        out_ops = []
        for key, kind, op, args, shape, dtype, params, alias in self.body:
            ids[key] = len(ops)
            ops.append(LOp(len(ops), kind, op, tuple(Arg(ids[src], v) for src, v in args), tuple(map(as_expr, shape)),
                           dtype, dict(params), alias))
        for key, out_name, role in [(k, n, r) for k, n, r in self._outs]:
            src = ops[ids[key]]
            out_ops.append(LOp(len(ops) + len(out_ops), "output", "Output",
                               (Arg(src.id, ShapeTracker.contiguous(src.shape)),), src.shape, src.dtype,
                               {"name": out_name, "role": role}))
        return Program(name, ops + out_ops)

    _outs: list[tuple[str, str, str]] = field(default_factory=list)

    def op(self, key: str, kind: str, op: str, args: list[tuple[str, ShapeTracker]], shape: tuple, dtype: DType,
           params: dict | None = None, alias: int | None = None, output: str | None = None, role: str = "output",
           case_kind: str = "", tol: float = 0.0) -> None:
        self.body.append((key, kind, op, args, shape, dtype, params or {}, alias))
        if output is not None:
            self._outs.append((key, output, role))
            self.kinds[output] = case_kind or kind
            self.tol[output] = tol


def _rand(rng: np.random.Generator, dt: DType, n: int, positive: bool = False) -> np.ndarray:
    if dt.is_float:
        x = rng.uniform(0.25, 4.0, n) * (1 if positive else rng.choice([-1.0, 1.0], n))
        return x.astype(dt.np)
    if dt.is_int:
        return (rng.integers(1, 50, n) * (1 if positive else rng.choice([-1, 1], n))).astype(dt.np)
    return rng.integers(0, 2, n).astype(np.bool_)


def _views(s: Any) -> dict[str, tuple[ShapeTracker, Any]]:
    """Views of shape (s, 4, 16) over flat buffers, with the buffers' sizes."""
    return {
        "contig": (ShapeTracker.contiguous((s, 4, 16)), 64 * s),
        "permuted": (ShapeTracker.contiguous((s, 16, 4)).permute((0, 2, 1)), 64 * s),
        "broadcast": (ShapeTracker.contiguous((16,)).expand_dim(0, 4).expand_dim(0, s), as_expr(16)),
        "padded": (ShapeTracker.contiguous((s, 4, 12)).pad(2, 1, 3), 48 * s),
        "window": (ShapeTracker.contiguous((s + 2, 4, 16)).slice(0, 2, s + 2), 64 * (s + 2)),
    }


def template_cases(dt: DType, seed: int = 0) -> tuple[Program, dict[str, np.ndarray], _Builder]:
    """Every template kind in ``dt``: (program, entry inputs at :data:`DYN`, builder with kinds/tolerances)."""
    rng = np.random.default_rng(seed)
    b = _Builder()
    s = S
    views = _views(s)
    order = list(views)
    shape = (s, 4, 16)
    tol = TOL[dt]
    n_of = lambda size: as_expr(size).evaluate(DYN)  # noqa: E731

    def inp(case: str, k: int, size: Any, idt: DType, positive: bool = False, data: np.ndarray | None = None,
            role: str = "input") -> str:
        name = b.input(f"{case}.x{k}", size, idt, role)
        b.arrays[name] = data if data is not None else _rand(rng, idt, n_of(size), positive)
        return name

    # elementwise: every op, over contiguous / permuted / broadcast / padded / windowed views
    for i, (name, arity) in enumerate(ELEMENTWISE.items()):
        case = f"ew.{name}"
        args = []
        for k in range(arity):
            vname = order[(i + k) % len(order)]
            view, size = views[vname]
            adt = DType.bool if (name == "Where" and k == 0) else dt
            pos = name in POSITIVE or (name == "Mod" and k == 1)
            args.append((inp(case, k, size, adt, pos), view))
        out_dt = DType.bool if name == "LessThan" else (DType.f32 if dt != DType.f32 else DType.bf16) \
            if name == "Cast" else dt
        b.op(case, "elementwise", name, args, shape, out_dt, output=f"{case}.y", case_kind="elementwise",
             tol=TOL.get(out_dt, 0.0) if out_dt.is_float else 0.0)
    # cast to every other dtype (float -> int truncates, -> bool is x != 0)
    for odt in DType:
        if odt == dt:
            continue
        case = f"cast.{odt.value}"
        view, size = views["permuted"]
        b.op(case, "elementwise", "Cast", [(inp(case, 0, size, dt), view)], shape, odt, output=f"{case}.y",
             case_kind="cast", tol=TOL.get(odt, 0.0) if odt.is_float else 0.0)
    # in place: out = window + broadcast, written through the window of x0's buffer
    case = "ew.inplace"
    win, wsize = views["window"]
    x0 = inp(case, 0, wsize, dt)
    b.op(case, "elementwise", "Add", [(x0, win), (inp(case, 1, 16, dt), views["broadcast"][0])], shape, dt,
         alias=0, output=f"{case}.y", case_kind="elementwise", tol=tol)
    # reduce Sum / Max over the last, a padded and the outer axis
    for red in ("Sum", "Max"):
        for vname, axis in (("contig", 2), ("padded", 2), ("permuted", 1), ("permuted", 0)):
            case = f"reduce.{red}.{vname}.{axis}"
            view, size = views[vname]
            oshape = tuple(d for k, d in enumerate(shape) if k != axis)
            b.op(case, "reduce", red, [(inp(case, 0, size, dt), view)], oshape, dt, {"axis": axis},
                 output=f"{case}.y", case_kind="reduce", tol=tol)
    # row kernels (templates/row.cu): RMSNorm (a RowSum read back along the row), softmax (a RowMax nested
    # in a RowSum) and a reduce over the last axis of a row-normalised value, over several views
    f32 = DType.f32

    def xf(k: int) -> list:
        return ["Cast", "f32", ["arg", k]]

    for vname in ("contig", "permuted", "padded", "window"):
        view, size = views[vname]
        case = f"row.rmsnorm.{vname}"
        ms = ["RowSum", "f32", ["Mul", "f32", xf(0), xf(0)]]
        rs = ["Recip", "f32", ["Sqrt", "f32", ["Add", "f32", ms, xf(1)]]]
        expr = ["Cast", dt.value, ["Mul", "f32", ["Mul", "f32", xf(0), rs], xf(1)]]
        w = views["broadcast"][0]
        b.op(case, "elementwise", "Fused", [(inp(case, 0, size, dt), view), (inp(case, 1, 16, dt, True), w)],
             shape, dt, {"expr": expr}, output=f"{case}.y", case_kind="row", tol=tol)
        case = f"row.softmax.{vname}"
        m = ["RowMax", "f32", xf(0)]
        e = ["Exp2", "f32", ["Add", "f32", xf(0), ["Mul", "f32", m, xf(1)]]]
        expr = ["Cast", dt.value, ["Mul", "f32", e, ["Recip", "f32", ["RowSum", "f32", e]]]]
        neg = inp(case, 1, 16, dt, data=np.full(16, -1.0, dt.np))
        b.op(case, "elementwise", "Fused", [(inp(case, 0, size, dt), view), (neg, views["broadcast"][0])],
             shape, dt, {"expr": expr}, output=f"{case}.y", case_kind="row", tol=tol)
        case = f"row.reduce.{vname}"
        rms = ["Recip", "f32", ["Sqrt", "f32", ["RowSum", "f32", ["Mul", "f32", xf(0), xf(0)]]]]
        normed = ["Mul", "f32", xf(0), rms]
        b.op(case, "reduce", "Max", [(inp(case, 0, size, dt), view)], (s, 4), f32,
             {"axis": 2, "expr": ["Mul", "f32", normed, normed]}, output=f"{case}.y", case_kind="row",
             tol=TOL[f32])
    # gather rows of a [10, 24] table (contiguous and transposed) by i32 / i64 indices
    for it in (DType.i32, DType.i64):
        for tname, tview in (("rows", ShapeTracker.contiguous((10, 24))),
                             ("transposed", ShapeTracker.contiguous((24, 10)).permute((1, 0)))):
            case = f"gather.{tname}.{it.value}"
            idx = rng.integers(0, 10, n_of(s)).astype(it.np)
            b.op(case, "gather", "Gather", [(inp(case, 0, 240, dt), tview),
                                            (inp(case, 1, s, it, data=idx), ShapeTracker.contiguous((s,)))],
                 (s, 24), dt, output=f"{case}.y", case_kind="gather", tol=tol)
    # scatter rows into a [12, 4, 8] cache (a copy), and scatter_nocopy into a state cache (in place)
    cache = ShapeTracker.contiguous((12, 4, 8))
    for vname, src_view in (("contig", ShapeTracker.contiguous((s, 4, 8))),
                            ("permuted", ShapeTracker.contiguous((4, s, 8)).permute((1, 0, 2)))):
        case = f"scatter.{vname}"
        rows = rng.permutation(12)[:n_of(s)].astype(np.int64)
        b.op(case, "scatter", "Scatter", [(inp(case, 0, 384, dt), cache), (inp(case, 1, 32 * s, dt), src_view),
                                          (inp(case, 2, s, DType.i64, data=rows), ShapeTracker.contiguous((s,)))],
             (12, 4, 8), dt, output=f"{case}.y", case_kind="scatter", tol=tol)
    case = "scatter_nocopy"
    rows = rng.permutation(12)[:n_of(s)].astype(np.int32)
    sname = b.input(f"{case}.cache", (12, 4, 8), dt, "state")
    b.state[sname] = TensorSpec(sname, tuple(map(as_expr, (12, 4, 8))), dt)
    b.state_init[sname] = _rand(rng, dt, 384).reshape(12, 4, 8)
    b.op(case, "scatter_nocopy", "ScatterNoCopy",
         [(sname, cache), (inp(case, 1, 32 * s, dt), ShapeTracker.contiguous((s, 4, 8))),
          (inp(case, 2, s, DType.i32, data=rows), ShapeTracker.contiguous((s,)))],
         (12, 4, 8), dt, alias=0, output=sname, role="state", case_kind="scatter_nocopy", tol=tol)
    # long rows: several warps per row combine through shared memory (lum_group_reduce with GROUP > 32)
    case = "row.softmax.long"
    m = ["RowMax", "f32", xf(0)]
    e = ["Exp2", "f32", ["Add", "f32", xf(0), ["Mul", "f32", m, xf(1)]]]
    expr = ["Cast", dt.value, ["Mul", "f32", e, ["Recip", "f32", ["RowSum", "f32", e]]]]
    neg = inp(case, 1, 1, dt, data=np.full(1, -1.0, dt.np))
    b.op(case, "elementwise", "Fused", [(inp(case, 0, 300 * s, dt), ShapeTracker.contiguous((s, 300))),
                                        (neg, ShapeTracker((s, as_expr(300)), (as_expr(0), as_expr(0)), as_expr(0)))],
         (s, 300), dt, {"expr": expr}, output=f"{case}.y", case_kind="row", tol=tol)
    # several reductions of long rows: two norms and a maximum, then the norm of the normed rows' sum, which
    # reads both norms (gemma's residual sum before the next layer)
    case = "row.norms.long"

    def rsqrt_sum(x: list) -> list:
        return ["Recip", "f32", ["Sqrt", "f32", ["RowSum", "f32", ["Mul", "f32", x, x]]]]

    h = ["Add", "f32", ["Mul", "f32", xf(0), rsqrt_sum(xf(0))], ["Mul", "f32", xf(1), rsqrt_sum(xf(1))]]
    expr = ["Cast", dt.value, ["Add", "f32", ["Mul", "f32", h, rsqrt_sum(h)], ["RowMax", "f32", xf(0)]]]
    b.op(case, "elementwise", "Fused", [(inp(case, 0, 300 * s, dt), ShapeTracker.contiguous((s, 300))),
                                        (inp(case, 1, 300 * s, dt), ShapeTracker.contiguous((s, 300)))],
         (s, 300), dt, {"expr": expr}, output=f"{case}.y", case_kind="row", tol=tol)
    # scatters that compute their rows (a fused prologue over leaves args[1:-1]): a rotation-like expression
    # of a permuted and a padded read (copy and in place), and an RMSNorm of each row (a row kernel)
    for kind, with_rows in (("scatter", False), ("scatter_nocopy", False), ("scatter_nocopy", True)):
        case = f"{kind}.prologue" + (".rows" if with_rows else "")
        rows = rng.permutation(12)[:n_of(s)].astype(np.int64)
        srcs = [ShapeTracker.contiguous((4, s, 8)).permute((1, 0, 2)), ShapeTracker.contiguous((s, 4, 6)).pad(2, 1, 1)]
        leaves = [(inp(case, 1, 32 * s, dt), srcs[0]), (inp(case, 2, 24 * s, dt), srcs[1])]
        val = ["Add", "f32", ["Mul", "f32", xf(0), xf(1)], xf(1)]
        if with_rows:
            val = ["Mul", "f32", val, ["Recip", "f32", ["Sqrt", "f32", ["RowSum", "f32", ["Mul", "f32", val, val]]]]]
        expr = ["Cast", dt.value, val]
        idx = (inp(case, 3, s, DType.i64, data=rows), ShapeTracker.contiguous((s,)))
        if kind == "scatter":
            dest = (inp(case, 0, 384, dt), cache)
            b.op(case, kind, "Scatter", [dest, *leaves, idx], (12, 4, 8), dt, {"expr": expr}, output=f"{case}.y",
                 case_kind=kind, tol=tol)
        else:
            sname = b.input(f"{case}.cache", (12, 4, 8), dt, "state")
            b.state[sname] = TensorSpec(sname, tuple(map(as_expr, (12, 4, 8))), dt)
            b.state_init[sname] = _rand(rng, dt, 384).reshape(12, 4, 8)
            b.op(case, kind, "ScatterNoCopy", [(sname, cache), *leaves, idx], (12, 4, 8), dt, {"expr": expr},
                 alias=0, output=sname, role="state", case_kind=kind, tol=tol)
    # decode attention (the split-K partials and their combine, builder/extract.attention_ops): GQA groups
    # of 3 query rows over 2 kv heads reading a [12 + s, 2, D] cache through slice / permute / broadcast
    # views, T = s + 19 keys (two chunks), a mask with holes; D = 32 / Dv = 64 (vector loads) and
    # D = 24 / Dv = 40 (per-feature loads), p rounded to the dtype; and D = 32 in chunks of 32 keys (the
    # measured search's split: one chunk, its keys in two steps of a block)
    from lum.builder.extract import ATTENTION_CHUNK, attention_ops

    for d_qk, d_v, chunk in ((32, 64, ATTENTION_CHUNK), (24, 40, ATTENTION_CHUNK), (32, 64, 32)):
        case = f"attention.d{d_qk}" + ("" if chunk == ATTENTION_CHUNK else f".c{chunk}")
        tk = s + 19
        rows = (2, 3, 1)
        qv = ShapeTracker.contiguous(rows + (d_qk,))
        cache_k = ShapeTracker.contiguous((s + 24, 2, d_qk))
        cache_v = ShapeTracker.contiguous((s + 24, 2, d_v))

        def heads(c: ShapeTracker) -> ShapeTracker:   # rows [0, T) as [2, 3, 1, T, d]
            return c.slice(0, 0, tk).permute((1, 0, 2)).expand_dim(1, 3).expand_dim(2, 1)

        mrow = (rng.random(n_of(tk)) < 0.8) | (np.arange(n_of(tk)) == 0)
        mask = ShapeTracker.contiguous((tk,)).expand_dim(0, 1).expand_dim(0, 3).expand_dim(0, 2)
        args = [(inp(case, 0, numel(rows) * d_qk, dt), qv), (inp(case, 1, (s + 24) * 2 * d_qk, dt), heads(cache_k)),
                (inp(case, 2, (s + 24) * 2 * d_v, dt), heads(cache_v)),
                (inp(case, 3, tk, DType.bool, data=mrow), mask)]
        part, _neg, comb = attention_ops(tuple(Arg(0, v) for _, v in args), 0.25, dt, dt, chunk=chunk)
        b.op(f"{case}.part", "attention", "Attention", args, part.shape, DType.f32, part.params)
        b.op(f"{case}.neg", "constant", "Constant", [], (), f32, {"value": -1.0})
        cargs = [(f"{case}.part", a.view) for a in comb.args[:3]] + [(f"{case}.neg", comb.args[3].view)]
        b.op(case, "reduce", "Sum", cargs, comb.shape, dt, comb.params, output=f"{case}.y", case_kind="attention",
             tol=tol if dt == f32 else 2e-2)
    e = ["Exp2", "f32", ["Add", "f32", ["arg", 1], ["Mul", "f32", ["RowMax", "f32", ["arg", 1]], ["arg", 3]]]]
    expr = ["Mul", "f32", ["Mul", "f32", e, ["arg", 0]],
            ["Recip", "f32", ["RowSum", "f32", ["Mul", "f32", e, ["arg", 2]]]]]

    def combine(case: str, key: str, ns: Any, dv: int, far: tuple[int, int], rows: tuple[int, int] = (2, 3),
                **out: Any) -> None:
        """Decode attention's combine of ``rows`` rows (heads) of ``ns`` chunk partials [acc[0..dv), c, l] as op
        ``key``: integer offsets c with whole chunks masked (c = -inf, the first one among them) and chunk ns / 2
        of row ``far`` far above the rest."""
        nsv, (r0, r1) = n_of(ns), rows
        part = rng.uniform(0.25, 4.0, (r0, r1, nsv, dv + 2)) * rng.choice([-1.0, 1.0], (r0, r1, nsv, dv + 2))
        part[..., dv] = rng.integers(-8, 9, (r0, r1, nsv))
        part[..., dv][rng.random((r0, r1, nsv)) < 0.2] = -np.inf
        part[:, :, 0, dv] = -np.inf
        part[far + (nsv // 2, dv)] = 40.0
        part[..., dv + 1] = np.abs(part[..., dv + 1])
        xp = inp(case, 0, r0 * r1 * ns * (dv + 2), f32, data=part.astype(np.float32).ravel())
        row = ShapeTracker((as_expr(r0), as_expr(r1), as_expr(dv), ns),
                           (r1 * ns * (dv + 2), ns * (dv + 2), as_expr(1), as_expr(dv + 2)), as_expr(0))

        def col(off: int) -> ShapeTracker:
            return ShapeTracker(row.shape, row.strides[:2] + (as_expr(0), row.strides[3]), as_expr(off))

        b.op(f"{case}.neg", "constant", "Constant", [], (), f32, {"value": -1.0})
        b.op(key, "reduce", "Sum", [(xp, row), (xp, col(dv)), (xp, col(dv + 1)),
                                    (f"{case}.neg", ShapeTracker(row.shape, (as_expr(0),) * 4, as_expr(0)))],
             (r0, r1, dv), dt, {"axis": 3, "expr": expr}, **out)

    # the combine alone over s + 40 chunks (more than a warp's lanes: each lane meets a new maximum and
    # rescales): the one-visit row (row_codegen.online_softmax_sum) against the reference
    combine("row.combine", "row.combine", s + 40, 8, (0, 1), output="row.combine.y", case_kind="row", tol=tol)
    # decode attention's combine and o after it (builder/o_combine.py): 6 heads of 16 over ⌈(s + 60) / 4⌉
    # chunks (two rounds of the fused kernel's loads at the run's s = 5, at most 31 at MAX_SEQ: it fuses), o
    # over 96 columns (a second column group, part full). By default the combine and o run as one kernel split
    # by head (templates/gemv_combine.cu, a cluster of 6 blocks); tests/test_cuda_emulated.py's two-kernels
    # variant keeps two. ``o.combine.grouped``: 12 heads (3 × 4 rows), more than a cluster's 8 blocks, so with
    # LUM_O_COMBINE=grouped each of its 6 blocks takes two heads (o_combine.heads_a_block), else two kernels
    for case, rows in (("o.combine", (2, 3)), ("o.combine.grouped", (3, 4))):
        hd, heads_n, ncol = 16, rows[0] * rows[1], 96
        combine(case, f"{case}.comb", cdiv(s + 60, 4), hd, (1, 0), rows)
        w = inp(case, 1, ncol * heads_n * hd, dt)
        b.arrays[w] = (b.arrays[w].astype(np.float32) / 8).astype(dt.np)
        params = {"layout": "RmCm", "m": 1, "n": ncol, "k": heads_n * hd, "lda": heads_n * hd, "ldb": heads_n * hd,
                  "ldc": ncol, "batch": 1, "stride_a": 0, "stride_b": 0, "stride_c": ncol, "offset_a": 0,
                  "offset_b": 0}
        b.op(case, "gemm", "Gemm", [(f"{case}.comb", ShapeTracker.contiguous((heads_n * hd,))),
                                    (w, ShapeTracker.contiguous((ncol * heads_n * hd,)))],
             (1, 1, ncol), f32, {k: as_expr(v) if not isinstance(v, str) else v for k, v in params.items()},
             output=f"{case}.y", case_kind="row", tol=tol if dt == f32 else 2e-2)
    # iota in the dtype and in i64
    for odt in (dt, DType.i64):
        case = f"iota.{odt.value}"
        b.op(case, "iota", "Iota", [], (s + 3,), odt, {"n": s + 3}, output=f"{case}.y", case_kind="iota",
             tol=TOL.get(odt, 0.0) if odt.is_float else 0.0)
    return b.program(f"templates.{dt.value}"), b.arrays, b


def _gemm_case(b: _Builder, rng: np.random.Generator, case: str, layout: str, dts: tuple[DType, DType, DType],
               m: Any, n: Any, k: Any, batch: int, *, sa: Any = None, sb: Any = None, oa: int = 0, ob: int = 0,
               ld: Any = lambda x: x, spad: int = 0, n_cap: Any = None) -> None:
    """One gemm case: A and B as flat entry inputs ``case.x0`` / ``case.x1`` addressed by the gemm params,
    C as output ``case.y``. ``ld`` maps each operand's natural leading dim to the one used; batch strides
    default to the matrix sizes (+ ``spad``), 0 broadcasts; ``dts`` = (A, B, C). ``n_cap``: the n that
    sizes B (leading dim, batch stride, buffer) when n itself varies (default n)."""
    a_rm, b_rm = layout[:2] == "Rm", layout[2:] == "Rm"
    nc = n if n_cap is None else n_cap
    lda, ldb = as_expr(ld(k if a_rm else m)), as_expr(ld(nc if b_rm else k))
    a_mat = (m * lda) if a_rm else (k * lda)
    b_mat = (k * ldb) if b_rm else (nc * ldb)
    sa_ = a_mat + spad if sa is None else sa
    sb_ = b_mat + spad if sb is None else sb
    a_size = oa + (batch - 1) * sa_ + a_mat if batch > 1 else oa + a_mat
    b_size = ob + (batch - 1) * sb_ + b_mat if batch > 1 else ob + b_mat
    n_of = lambda size: as_expr(size).evaluate(DYN)  # noqa: E731
    xa = b.input(f"{case}.x0", a_size, dts[0])
    xb = b.input(f"{case}.x1", b_size, dts[1])
    b.arrays[xa] = _rand(rng, dts[0], n_of(a_size))
    b.arrays[xb] = _rand(rng, dts[1], n_of(b_size))
    params = {"layout": layout, "m": m, "n": n, "k": k, "lda": lda, "ldb": ldb, "ldc": n, "batch": batch,
              "stride_a": sa_ if batch > 1 else 0, "stride_b": sb_ if batch > 1 else 0,
              "stride_c": m * n, "offset_a": oa, "offset_b": ob}
    params = {key: as_expr(v) if not isinstance(v, str) else v for key, v in params.items()}
    args = [(xa, ShapeTracker.contiguous((a_size,))), (xb, ShapeTracker.contiguous((b_size,)))]
    b.op(case, "gemm", "Gemm", args, (batch, m, n), dts[2], params, output=f"{case}.y", case_kind="gemm",
         tol=TOL[dts[2]])


def gemm_cases(dt: DType, seed: int = 0) -> tuple[Program, dict[str, np.ndarray], _Builder]:
    """Every gemm layout, plain and batched (strided, broadcast, with offsets), with ``s`` in m (cuBLASLt)."""
    rng = np.random.default_rng(seed)
    b = _Builder()
    for layout in ("RmRm", "RmCm", "CmRm", "CmCm"):
        for variant, batch, sb, oa, ob, pad in (("plain", 1, None, 0, 0, 0), ("batched", 3, None, 0, 0, 0),
                                                ("broadcast_b", 3, 0, 0, 0, 0), ("offset_padded", 2, None, 8, 16, 4)):
            _gemm_case(b, rng, f"gemm.{layout}.{variant}", layout, (dt, dt, dt), S, 40, 24, batch, sb=sb, oa=oa,
                       ob=ob, ld=lambda x, pad=pad: x + pad)
    return b.program(f"gemm.{dt.value}"), b.arrays, b


def gemv_cases(dt: DType, seed: int = 0) -> tuple[Program, dict[str, np.ndarray], _Builder]:
    """Gemms with a static m (lum's gemv kernel, templates/gemv.cu): every layout, m in (1, 3, 8), results
    in ``dt`` and (16-bit ``dt``) in f32. Variants: ``plain`` (n = s + 35: vector loads, aligned at run
    time where n is a leading dim), ``batched`` (k = s + 19, odd leading dims and batch strides,
    offsets: scalar loads) and ``broadcast`` (B shared over the batch, leading dims and offsets
    multiples of 8: vector loads, k = 75 leaves a scalar tail); ``static`` (n and k static, as every decode
    projection: the grid and split come from the shape at build time)."""
    rng = np.random.default_rng(seed)
    b = _Builder()
    results = [dt] if dt == DType.f32 else [dt, DType.f32]
    for layout in ("RmRm", "RmCm", "CmRm", "CmCm"):
        for m in (1, 3, 8):
            for out in results:
                tag = f"gemv.{layout}.m{m}" + ("" if out == dt else f".to_{out.value}")
                _gemm_case(b, rng, f"{tag}.plain", layout, (dt, dt, out), m, S + 35, 64, 1)
                _gemm_case(b, rng, f"{tag}.batched", layout, (dt, dt, out), m, 24, S + 19, 3, oa=5, ob=3,
                           ld=lambda x: x + 3, spad=5)
                _gemm_case(b, rng, f"{tag}.broadcast", layout, (dt, dt, out), m, 40, 75, 2, sb=0, oa=8, ob=16,
                           ld=lambda x: (x + 15) // 8 * 8)
    for out in results:        # a static n and k, W's rows 16-byte multiples (the decode projections' form)
        to = "" if out == dt else f".to_{out.value}"
        for m in (1, 3):
            _gemm_case(b, rng, f"gemv.RmCm.m{m}.static{to}", "RmCm", (dt, dt, out), m, 300, 264, 1)
        _gemv_prologue_case(b, rng, f"gemv.prologue.rmsnorm.m1.k256.static{to}", "rmsnorm", dt, out, 1, 300, 256)
        # 600 columns: 3 warps a block under $LUM_GEMV_PROLOGUE_THREADS=fit (two columns a warp, 132 SMs)
        _gemv_prologue_case(b, rng, f"gemv.prologue.rmsnorm.m1.k256.n600.static{to}", "rmsnorm", dt, out, 1, 600, 256)
    for m, k in ((1, 256), (3, 75), (1, 4104)):
        for kind in ("rmsnorm", "gated"):
            for out in results:
                tag = f"gemv.prologue.{kind}.m{m}.k{k}" + ("" if out == dt else f".to_{out.value}")
                _gemv_prologue_case(b, rng, tag, kind, dt, out, m, S + 35, k)
    for kind in ("gated", "residual", "normed_gated"):
        for n_out in (40, 4104):
            _gemv_epilogue_case(b, rng, f"gemv.epilogue.{kind}.n{n_out}", kind, dt, n_out, 72)
    # gemma3-4b's gate-up k: two warps a column, each lane's 5 (bf16) or 10 (f32) vectors a column loaded ahead
    # by default where they are at most 8 (gemv_policy.gemv_inflight_for), else by the compiler's loop
    _gemv_epilogue_case(b, rng, "gemv.epilogue.gated.n40.k2560", "gated", dt, 40, 2560)
    return b.program(f"gemv.{dt.value}"), b.arrays, b


def _gemv_epilogue_case(b: _Builder, rng: np.random.Generator, case: str, kind: str, dt: DType, n_out: int,
                        k: int) -> None:
    """A gemv (m = 1, RmCm, B in ``dt``) with a fused epilogue (LLIR version 3) storing ``dt``: ``gated``
    (C = x·Bᵀ over 2·n_out columns, out[c] = C[c] / (1 + 2^(−C[c]·log2 e)) · C[c + n_out]), ``residual``
    (out[c] = r[c] + C[c], r an f32 leaf) and ``normed_gated`` (gated, A an RMSNorm prologue of x)."""
    pairs = kind != "residual"
    n = 2 * n_out if pairs else n_out
    xs = b.input(f"{case}.x0", k, DType.f32 if kind == "normed_gated" else dt)
    bs = b.input(f"{case}.x1", n * k, dt)
    cs = b.input(f"{case}.x2", 4, DType.f32)
    rs = b.input(f"{case}.x3", n_out, DType.f32)
    b.arrays[xs] = _rand(rng, b.inputs[-4][2], k)
    b.arrays[bs] = (_rand(rng, dt, n * k).astype(np.float64) / 8).astype(dt.np)     # keep 2^(−C) finite
    b.arrays[cs] = np.array([1.0, -1.4426950408889634, 1.0 / k, 1e-6], np.float32)
    b.arrays[rs] = _rand(rng, DType.f32, n_out)
    out_shape = (as_expr(1), as_expr(n_out))
    const = [ShapeTracker(out_shape, (as_expr(0), as_expr(0)), as_expr(j), None) for j in (0, 1)]
    params = {"layout": "RmCm", "m": as_expr(1), "n": as_expr(n), "k": as_expr(k), "lda": as_expr(k),
              "ldb": as_expr(k), "ldc": as_expr(n), "batch": as_expr(1), "acc_dtype": "f32",
              "n_out": as_expr(n_out)}
    if pairs:
        sig = ["Recip", "f32", ["Add", "f32", ["arg", 0], ["Exp2", "f32", ["Mul", "f32", ["acc", 0], ["arg", 1]]]]]
        params.update(epilogue=["Cast", dt.value, ["Mul", "f32", ["Mul", "f32", ["acc", 0], sig], ["acc", 1]]],
                      acc_cols=[0, n_out], epilogue_leaves=2)
        leaves = [(cs, const[0]), (cs, const[1])]
    else:
        params.update(epilogue=["Cast", dt.value, ["Add", "f32", ["arg", 0], ["acc", 0]]], acc_cols=[0],
                      epilogue_leaves=1)
        leaves = [(rs, ShapeTracker.contiguous(out_shape))]
    head = [(xs, ShapeTracker.contiguous((as_expr(k),)))]
    if kind == "normed_gated":
        row = ShapeTracker.contiguous((as_expr(1), as_expr(k)))
        c = [ShapeTracker(row.shape, (as_expr(0), as_expr(0)), as_expr(j), None) for j in (2, 3)]
        head = [(xs, row), (cs, c[0]), (cs, c[1])]
        params["expr"] = ["Cast", dt.value, ["Mul", "f32", ["arg", 0], ["Recip", "f32", ["Sqrt", "f32", [
            "Add", "f32", ["Mul", "f32", ["RowSum", "f32", ["Mul", "f32", ["arg", 0], ["arg", 0]]], ["arg", 1]],
            ["arg", 2]]]]]]
    args = head + [(bs, ShapeTracker.contiguous((as_expr(n * k),)))] + leaves
    b.op(case, "gemm", "Gemm", args, out_shape, dt, params, output=f"{case}.y", case_kind="gemm", tol=TOL[dt])


def _gemv_prologue_case(b: _Builder, rng: np.random.Generator, case: str, kind: str, dt: DType, out: DType,
                        m: int, n: Any, k: int) -> None:
    """A gemv whose A is a fused prologue (LLIR version 3) over [m, k]: ``rmsnorm`` (x·rsqrt(Σx²/k + eps)·w,
    x in f32, a row reduction per row of A) or ``gated`` (u / (1 + 2^(−g·log2 e)), g and u two views of
    one buffer, no row reduction), rounded to ``dt``; B [n, k] in ``dt`` (RmCm), C in ``out``."""
    two = 2 * m * k if kind == "gated" else m * k
    xs = b.input(f"{case}.x0", two, DType.f32 if kind == "rmsnorm" else dt)
    ws = b.input(f"{case}.x1", k, dt)
    cs = b.input(f"{case}.x2", 2, DType.f32)
    bs = b.input(f"{case}.x3", n * k, dt)
    b.arrays[xs] = _rand(rng, b.inputs[-4][2], two)
    b.arrays[ws] = _rand(rng, dt, k)
    b.arrays[bs] = _rand(rng, dt, as_expr(n * k).evaluate(DYN))
    dom = (m, k)

    def const(j: int) -> ShapeTracker:
        return ShapeTracker(tuple(map(as_expr, dom)), (as_expr(0), as_expr(0)), as_expr(j), None)

    rows = ShapeTracker.contiguous(tuple(map(as_expr, dom)))
    if kind == "rmsnorm":
        b.arrays[cs] = np.array([1.0 / k, 1e-6], np.float32)
        w = ShapeTracker.contiguous((as_expr(k),)).expand_dim(0, as_expr(m))
        leaves = [(xs, rows), (ws, w), (cs, const(0)), (cs, const(1))]
        inv = ["Recip", "f32", ["Sqrt", "f32", ["Add", "f32", ["Mul", "f32", ["RowSum", "f32", ["Mul", "f32", ["arg", 0],
                                                                                              ["arg", 0]]],
                                                              ["arg", 2]], ["arg", 3]]]]
        expr = ["Cast", dt.value, ["Mul", "f32", ["Mul", "f32", ["arg", 0], inv], ["Cast", "f32", ["arg", 1]]]]
    else:
        b.arrays[cs] = np.array([1.0, -1.4426950408889634], np.float32)
        up = ShapeTracker(rows.shape, rows.strides, as_expr(m * k), None)
        leaves = [(xs, rows), (xs, up), (cs, const(0)), (cs, const(1))]
        sig = ["Recip", "f32", ["Add", "f32", ["arg", 2], ["Exp2", "f32", ["Mul", "f32", ["Cast", "f32", ["arg", 0]],
                                                                          ["arg", 3]]]]]
        expr = ["Cast", dt.value, ["Mul", "f32", sig, ["Cast", "f32", ["arg", 1]]]]
    params = {"layout": "RmCm", "m": as_expr(m), "n": as_expr(n), "k": as_expr(k), "lda": as_expr(k),
              "ldb": as_expr(k), "ldc": as_expr(n), "batch": as_expr(1), "stride_a": as_expr(0),
              "stride_b": as_expr(0), "stride_c": as_expr(m * n), "offset_a": as_expr(0), "offset_b": as_expr(0),
              "expr": expr}
    args = leaves + [(bs, ShapeTracker.contiguous((as_expr(n * k),)))]
    b.op(case, "gemm", "Gemm", args, (1, m, n), out, params, output=f"{case}.y", case_kind="gemm", tol=TOL[out])


REPLAY_P = (5, 6, 40)     # p values of one session, bound REPLAY_BOUND: 5 and 6 share every grid bucket
REPLAY_BOUND = {"p": 47}


def gemv_replay_cases(dt: DType, seed: int = 0) -> tuple[Program, dict[str, np.ndarray], _Builder]:
    """Decode attention's shape for lum's gemv kernel: n = p + 1 (read from the dyn buffer, so one captured
    graph serves every p of a grid bucket), every layout, m in (1, 3, 8), batch 2 with batch strides and
    offsets, results in ``dt`` and (16-bit ``dt``) in f32. Operands have fixed sizes (B sized for n = 48),
    so one set of inputs serves every p; run the entry ``main`` with dyn ``p`` (see :func:`entry_for`)."""
    rng = np.random.default_rng(seed)
    b = _Builder()
    for layout in ("RmRm", "RmCm", "CmRm", "CmCm"):
        for m in (1, 3, 8):
            for out in [dt] if dt == DType.f32 else [dt, DType.f32]:
                case = f"replay.{layout}.m{m}" + ("" if out == dt else f".to_{out.value}")
                _gemm_case(b, rng, case, layout, (dt, dt, out), m, P + 1, 40, 2, oa=8, ob=16, n_cap=48, spad=8)
    return b.program(f"gemv_replay.{dt.value}"), b.arrays, b


def check_gemv_replay(path: Path, dt: DType, **session: Any) -> dict[str, Any]:
    """Run :func:`gemv_replay_cases` ``dt``'s package at every :data:`REPLAY_P` in one CUDA session (arena
    poisoned with NaN before each run) against :func:`gemm_reference`: ``errors`` (case@p -> message),
    ``checked``, ``captures`` (the session's graph captures after each run), ``graph_error`` and
    ``cublaslt`` (whether the session loaded it: it should not, every gemm being a kernel)."""
    import lum.loader

    prog, arrays, b = gemv_replay_cases(dt)
    gemms = {o.params["name"]: prog.ops[o.args[0].src] for o in prog.outputs()}
    errors: dict[str, str] = {}
    captures = []
    with lum.loader.open(path) as pkg, pkg.session(dyn=REPLAY_BOUND, backend="cuda", **session) as sess:
        for p in REPLAY_P:
            sess.runner.fill_arena(0xFF)
            got = sess.run("main", arrays, {"p": p})
            captures.append(sess.runner.captures)
            for name, op in gemms.items():
                a, bm = (arrays[prog.ops[x.src].params["name"]] for x in op.args)
                err = compare(got[name], gemm_reference(op.params, {"p": p}, a, bm), b.tol[name])
                if err:
                    errors[f"{name}@p={p}"] = err
        graph_error, lt = sess.runner.graph_error, sess.runner.lt is not None
    return {"errors": errors, "checked": len(REPLAY_P) * len(gemms), "captures": captures,
            "graph_error": graph_error, "cublaslt": lt}


def gemm_reference(params: dict[str, Any], dyn: dict[str, int], a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """C[batch, m, n] = A @ B by the LLIR gemm semantics, in float64, from the operands' flat buffers."""
    p = {key: v if key == "layout" else as_expr(v).evaluate(dyn) for key, v in params.items()}
    a_rm, b_rm = p["layout"][:2] == "Rm", p["layout"][2:] == "Rm"
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    out = np.zeros((p.get("batch", 1), p["m"], p["n"]))
    i, ka = np.meshgrid(np.arange(p["m"]), np.arange(p["k"]), indexing="ij")
    kb, j = np.meshgrid(np.arange(p["k"]), np.arange(p["n"]), indexing="ij")
    for z in range(out.shape[0]):
        am = a[p.get("offset_a", 0) + z * p.get("stride_a", 0) + (i * p["lda"] + ka if a_rm else i + ka * p["lda"])]
        bm = b[p.get("offset_b", 0) + z * p.get("stride_b", 0) + (kb * p["ldb"] + j if b_rm else kb + j * p["ldb"])]
        out[z] = am @ bm
    return out


def entry_for(program: Program, b: _Builder, dyn: tuple[str, ...] = ("s",)) -> Entry:
    ins = tuple(TensorSpec(o.params["name"], o.shape, o.dtype) for o in program.inputs() if o.params["role"] != "state")
    outs = tuple(TensorSpec(o.params["name"], o.shape, o.dtype) for o in program.outputs())
    call = Call(0, tuple(o.params["name"] for o in program.inputs()),
                tuple(o.params["name"] for o in program.outputs()))
    return Entry("main", dyn, ins, outs, (call,))


def write_case_package(path: Path, program: Program, b: _Builder, dyn: tuple[str, ...] = ("s",),
                       **options: Any) -> Path:
    from lum.builder.package_builder import BuildOptions, write_program_package

    return write_program_package(path, [program], {"main": entry_for(program, b, dyn)}, state=b.state,
                                 model={"max_seq": MAX_SEQ}, options=BuildOptions(**options))


def compare(got: np.ndarray, want: np.ndarray, tol: float) -> str | None:
    """None when ``got`` matches ``want`` (normwise relative error < tol; exact for ints/bools; NaN
    never passes), else a one-line description."""
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    g, w = np.asarray(got), np.asarray(want)
    if not g.dtype.kind in "fcV" and w.dtype.kind not in "fcV":
        bad = np.flatnonzero(g.reshape(-1) != w.reshape(-1))
        if not bad.size:
            return None
        return f"{bad.size} elements differ, first at {bad[0]}: {g.reshape(-1)[bad[0]]} != {w.reshape(-1)[bad[0]]}"
    g64, w64 = g.astype(np.float64), w.astype(np.float64)
    if np.isnan(g64).any():
        return f"{int(np.isnan(g64).sum())} NaN(s) in the result (poisoned or unwritten output?)"
    if not np.isfinite(w64).all():
        same = (g64 == w64) | (np.isnan(w64) & np.isnan(g64))
        if not same[~np.isfinite(w64)].all():
            return "non-finite reference values differ"
        g64, w64 = np.where(np.isfinite(w64), g64, 0.0), np.where(np.isfinite(w64), w64, 0.0)
    scale = max(float(np.abs(w64).max(initial=0.0)), 1e-30)
    err = float(np.abs(g64 - w64).max(initial=0.0)) / scale
    return None if err < tol or (err == 0.0) else f"relative error {err:.3g} >= {tol}"


def numel_at(shape: Any, dyn: dict[str, int]) -> int:
    return numel(shape).evaluate(dyn)
