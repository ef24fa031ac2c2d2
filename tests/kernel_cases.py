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
from lum.format.expr import Var, as_expr
from lum.format.llir import Arg, LOp, Program
from lum.format.manifest import Call, Entry, TensorSpec
from lum.format.shapetracker import ShapeTracker, numel

S = Var("s")
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
    # iota in the dtype and in i64
    for odt in (dt, DType.i64):
        case = f"iota.{odt.value}"
        b.op(case, "iota", "Iota", [], (s + 3,), odt, {"n": s + 3}, output=f"{case}.y", case_kind="iota",
             tol=TOL.get(odt, 0.0) if odt.is_float else 0.0)
    return b.program(f"templates.{dt.value}"), b.arrays, b


def gemm_cases(dt: DType, seed: int = 0) -> tuple[Program, dict[str, np.ndarray], _Builder]:
    """Every gemm layout, plain and batched (strided, broadcast, with offsets), with ``s`` in m."""
    rng = np.random.default_rng(seed)
    b = _Builder()
    s = S
    n_of = lambda size: as_expr(size).evaluate(DYN)  # noqa: E731
    k, n = 24, 40
    for layout in ("RmRm", "RmCm", "CmRm", "CmCm"):
        a_rm, b_rm = layout[:2] == "Rm", layout[2:] == "Rm"
        for variant, batch, sa, sb, oa, ob, pad in (("plain", 1, 0, 0, 0, 0, 0), ("batched", 3, None, None, 0, 0, 0),
                                                    ("broadcast_b", 3, None, 0, 0, 0, 0),
                                                    ("offset_padded", 2, None, None, 8, 16, 4)):
            case = f"gemm.{layout}.{variant}"
            m = s
            lda = (k if a_rm else m) + pad
            ldb = (n if b_rm else k) + pad
            a_mat = (m * lda) if a_rm else (k * lda)
            b_mat = (k * ldb) if b_rm else (n * ldb)
            sa_ = a_mat if sa is None else sa
            sb_ = b_mat if sb is None else sb
            a_size = oa + (batch - 1) * sa_ + a_mat if batch > 1 else oa + a_mat
            b_size = ob + (batch - 1) * sb_ + b_mat if batch > 1 else ob + b_mat
            xa = b.input(f"{case}.x0", a_size, dt)
            xb = b.input(f"{case}.x1", b_size, dt)
            b.arrays[xa] = _rand(rng, dt, n_of(a_size))
            b.arrays[xb] = _rand(rng, dt, n_of(b_size))
            params = {"layout": layout, "m": m, "n": n, "k": k, "lda": lda, "ldb": ldb, "ldc": n, "batch": batch,
                      "stride_a": sa_ if batch > 1 else 0, "stride_b": sb_ if batch > 1 else 0,
                      "stride_c": m * n, "offset_a": oa, "offset_b": ob}
            params = {key: as_expr(v) if not isinstance(v, str) else v for key, v in params.items()}
            args = [(xa, ShapeTracker.contiguous((a_size,))), (xb, ShapeTracker.contiguous((b_size,)))]
            b.op(case, "gemm", "Gemm", args, (batch, m, n), dt, params, output=f"{case}.y", case_kind="gemm",
                 tol=TOL[dt])
    return b.program(f"gemm.{dt.value}"), b.arrays, b


def entry_for(program: Program, b: _Builder) -> Entry:
    ins = tuple(TensorSpec(o.params["name"], o.shape, o.dtype) for o in program.inputs() if o.params["role"] != "state")
    outs = tuple(TensorSpec(o.params["name"], o.shape, o.dtype) for o in program.outputs())
    call = Call(0, tuple(o.params["name"] for o in program.inputs()),
                tuple(o.params["name"] for o in program.outputs()))
    return Entry("main", ("s",), ins, outs, (call,))


def write_case_package(path: Path, program: Program, b: _Builder, **options: Any) -> Path:
    from lum.builder.package_builder import BuildOptions, write_program_package

    return write_program_package(path, [program], {"main": entry_for(program, b)}, state=b.state,
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
