"""The loader's numpy reference backend: runs an LLIR :class:`~lum.format.llir.Program` on the CPU.

It executes every op kind exactly as :mod:`lum.format.llir` documents, with the numerics of the
builder's HLIR interpreter (:mod:`lum.format.numerics`): each op reads its arguments through their
views, computes in float64 (int64 for integers, bool for bool) and rounds its result to its dtype.
Buffers are kept in their storage dtype (``DType.np``, e.g. bfloat16), flat, one per op — except ops
with an in-place ``alias``, whose buffer *is* the aliased argument's buffer (the same ndarray object,
mutated), exactly as the GPU runtime shares storage. A buffer is dropped after its last reader.

Only the standard library, numpy, ml_dtypes and :mod:`lum.format` are imported (never the builder).

    outputs = execute(program, {"x": x, "w": w}, {"s": 7})

Inputs are looked up by the name of each ``input`` op (extra entries are ignored). An input array
must have the op's shape and the same kind of dtype (any float for a float input, any integer for an
integer input, bool for bool); it is converted (rounded) to the op's dtype. ``state`` inputs that the
program writes in place (the destination of a ``scatter_nocopy`` or another aliasing op) are copied
first, so the caller's arrays are never modified — unless ``inplace_state=True``, in which case such
an input array is itself the working buffer and is mutated (it must then be C-contiguous, writeable
and of exactly the op's storage dtype). Inputs of any other role are never mutated.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np

from lum.format.dtypes import DType
from lum.format.expr import Expr, UnboundVariableError
from lum.format.llir import (ELEMENTWISE_ARITY, GEMM_LAYOUTS, LLIR_VERSION, ROW_OPS, LOp, Program, attention_dims,
                             check_params, gemm_parts, has_expr_params)
from lum.format.numerics import NumericsError, round_to, store_as, view_of
from lum.format.shapetracker import ShapeTracker

__all__ = ["BackendError", "execute", "ELEMENTWISE_ARITY"]


class BackendError(NumericsError):
    """The program cannot be run as given: a missing or malformed input, an unbound dyn var, an index
    or address out of range, or an op the LLIR schema does not allow."""


_ARITY = {"input": 0, "output": 1, "constant": 0, "iota": 0, "reduce": 1, "gather": 2, "scatter": 3,
          "scatter_nocopy": 3, "attention": 4, "gemm": 2}
_LOG2E_F32 = float(np.float32(1.4426950408889634))   # log2 e as the f32 constant kernels multiply by
_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Exp2": np.exp2, "Log2": np.log2, "Sin": np.sin, "Sqrt": np.sqrt, "Recip": lambda x: 1.0 / x,
}


def _eval_tree(t: list, args: list[np.ndarray], accs: list[np.ndarray] | None = None) -> np.ndarray:
    """A Fused expression tree on compute-type args (each of the op's loop shape); every node rounds to its
    dtype, as a store would. A row reduction reduces its child over the last axis and is read broadcast.
    ``accs``: the values of a gemm epilogue's ``["acc", t]`` leaves."""
    if t[0] == "arg":
        return args[t[1]]
    if t[0] == "acc":
        return accs[t[1]]
    kids = [_eval_tree(k, args, accs) for k in t[2:]]
    if t[0] in ROW_OPS:
        return round_to(np.broadcast_to(_reduce_rows(t[0], kids[0]), kids[0].shape), DType.parse(t[1]))
    return round_to(_elementwise(t[0], kids), DType.parse(t[1]))


def _reduce_rows(op: str, x: np.ndarray) -> np.ndarray:
    """RowSum / RowMax of a compute-type array over its last axis, kept as a unit axis."""
    if x.ndim == 0:
        raise BackendError(f"{op} needs a loop domain of at least one dim")
    if op == "RowSum":
        return x.sum(axis=-1, keepdims=True)
    if x.dtype == np.bool_:
        return x.any(axis=-1, keepdims=True)
    ident = -np.inf if x.dtype.kind == "f" else np.iinfo(np.int64).min
    return x.max(axis=-1, keepdims=True, initial=ident)


def _elementwise(op: str, args: list[np.ndarray]) -> np.ndarray:
    """One elementwise op on compute-type arrays (the caller rounds the result to the op's dtype)."""
    if op in ("Cast", "Contiguous"):
        out = args[0]                                # the rounding does the conversion
    elif op in _UNARY:
        out = _UNARY[op](args[0].astype(np.float64) if args[0].dtype == np.bool_ else args[0])
    elif op == "Add":
        out = args[0] + args[1]
    elif op == "Mul":
        out = args[0] * args[1]
    elif op == "Mod":
        out = np.mod(args[0], args[1])
    elif op == "LessThan":
        out = args[0] < args[1]
    else:  # Where
        out = np.where(args[0].astype(np.bool_), args[1], args[2])
    return np.asarray(out)


def execute(program: Program, inputs: Mapping[str, np.ndarray], dyn_map: Mapping[str, int] | None = None,
            *, inplace_state: bool = False) -> dict[str, np.ndarray]:
    """Run ``program``; returns every ``output`` op's value by name (fresh arrays of the op's dtype).

    ``dyn_map`` binds every dyn var used by shapes, views and parameters. ``inplace_state``: let
    in-place ops write straight into the caller's ``state`` input arrays (see the module docstring).
    Raises :class:`BackendError` for anything that makes the program unrunnable.
    """
    return _Executor(program, inputs, dyn_map or {}, inplace_state).run()


# ====================================================================== implementation
def _is_float_np(dt: np.dtype) -> bool:
    if dt.kind == "f":
        return True
    if dt.kind == "V":  # ml_dtypes types (bfloat16, float8 …) are numpy void-kind
        try:
            ml_dtypes.finfo(dt)
            return True
        except (ValueError, TypeError):
            return False
    return False


def _describe(o: LOp) -> str:
    return f"{o.kind} {o.op}" if o.op else o.kind


def _param_vars(v: Any) -> frozenset[str]:
    if isinstance(v, Expr):
        return v.vars()
    if isinstance(v, (list, tuple)):
        out: frozenset[str] = frozenset()
        for x in v:
            out |= _param_vars(x)
        return out
    return frozenset()


def _view_vars(v: ShapeTracker) -> frozenset[str]:
    out: frozenset[str] = v.offset.vars()
    for x in (*v.shape, *v.strides, *(b for lh in (v.mask or ()) for b in lh)):
        out |= x.vars()
    return out


class _Executor:
    def __init__(self, program: Program, inputs: Mapping[str, np.ndarray], dyn_map: Mapping[str, int],
                 inplace_state: bool):
        self.p = program
        self.inputs = inputs
        self.inplace_state = inplace_state
        self.dyn: dict[str, int] = {}
        for k, v in dyn_map.items():
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise BackendError(f"dyn var {k!r} must be an integer, got {v!r}")
            if v < 0:
                raise BackendError(f"dyn var {k!r} must be non-negative, got {v}")
            self.dyn[k] = int(v)
        self.ops = program.ops
        self._check_structure()
        self.values: dict[int, np.ndarray] = {}     # op id -> flat buffer (storage dtype)
        self.dtypes: dict[int, DType] = {}          # op id -> dtype of its buffer
        self.consumed: dict[int, int] = {}          # op id -> op that wrote its buffer in place
        self.results: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ validation
    def _check_structure(self) -> None:
        ops = self.ops
        needed: set[str] = set()
        names: set[str] = set()
        self.last_use: dict[int, int] = {}
        self.root: list[int] = []                   # the op whose buffer an op's buffer is
        for i, o in enumerate(ops):
            where = f"LLIR op {i} ({_describe(o)})"
            if o.id != i:
                raise BackendError(f"{where} has id {o.id}; ops must be numbered in order")
            want = ELEMENTWISE_ARITY.get(o.op) if o.kind == "elementwise" else _ARITY[o.kind]
            if has_expr_params(o):
                try:
                    check_params(o, LLIR_VERSION, where)
                except ValueError as e:
                    raise BackendError(str(e)) from None
                if o.kind != "attention":
                    want = len(o.args)
            if want is None:
                raise BackendError(f"{where}: unknown elementwise op {o.op!r}")
            if len(o.args) != want:
                raise BackendError(f"{where} takes {want} argument(s), got {len(o.args)}")
            for a in o.args:
                if not 0 <= a.src < i:
                    raise BackendError(f"{where} reads op {a.src}, which does not precede it")
                if ops[a.src].kind == "output":
                    raise BackendError(f"{where} reads output op {a.src}, which has no buffer")
                self.last_use[a.src] = i
                needed |= _view_vars(a.view)
            for d in o.shape:
                needed |= d.vars()
            needed |= _param_vars(list(o.params.values()))
            alias = o.alias
            if o.kind == "scatter_nocopy":
                if alias not in (None, 0):
                    raise BackendError(f"{where} must alias argument 0, not {alias}")
                alias = 0
            if alias is not None and o.kind in ("input", "output", "constant", "iota"):
                raise BackendError(f"{where} cannot alias an argument")
            if alias is not None and not 0 <= alias < len(o.args):
                raise BackendError(f"{where} aliases a missing argument {alias}")
            self.root.append(i if alias is None else self.root[o.args[alias].src])
            if o.kind in ("input", "output"):
                name = o.params.get("name")
                if not isinstance(name, str):
                    raise BackendError(f"{where} has no name")
                if (o.kind, name) in names:
                    raise BackendError(f"program {self.p.name!r} has two {o.kind}s named {name!r}")
                names.add((o.kind, name))
        missing = sorted(needed - set(self.dyn))
        if missing:
            raise BackendError(f"dyn_map lacks {missing} for program {self.p.name!r}")
        self.written_roots = {self.root[i] for i, o in enumerate(ops)
                              if o.alias is not None or o.kind == "scatter_nocopy"}

    # ------------------------------------------------------------------ helpers
    def ev(self, x: Any, what: str = "parameter") -> int:
        if isinstance(x, Expr):
            try:
                return x.evaluate(self.dyn)
            except UnboundVariableError as e:  # pragma: no cover - caught by the up-front check
                raise BackendError(str(e)) from None
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            raise BackendError(f"{what} must be an integer or expression, got {x!r}")
        return int(x)

    def shape_of(self, o: LOp) -> tuple[int, ...]:
        shape = tuple(d.evaluate(self.dyn) for d in o.shape)
        if any(d < 0 for d in shape):
            raise BackendError(f"negative dim in shape {shape}")
        return shape

    def read(self, o: LOp, k: int) -> np.ndarray:
        """Argument ``k`` through its view, in its storage dtype (may alias the buffer, read-only)."""
        a = o.args[k]
        if a.src in self.consumed:
            raise BackendError(f"reads the buffer of op {a.src} after op {self.consumed[a.src]} wrote into "
                               "it in place")
        try:
            return view_of(self.values[a.src], a.view, self.dyn)
        except NumericsError as e:
            raise BackendError(f"argument {k}: {e}") from None

    def readc(self, o: LOp, k: int) -> np.ndarray:
        """Argument ``k`` in the compute type (float64 / int64 / bool)."""
        return self.read(o, k).astype(self.dtypes[o.args[k].src].compute_np)

    def arg_dtype(self, o: LOp, k: int) -> DType:
        return self.dtypes[o.args[k].src]

    def check_shape(self, got: tuple[int, ...], want: tuple[int, ...], what: str) -> None:
        if tuple(got) != tuple(want):
            raise BackendError(f"{what} has shape {tuple(got)}, expected {tuple(want)}")

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, np.ndarray]:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
            for i, o in enumerate(self.ops):
                try:
                    self.step(i, o)
                except BackendError as e:
                    raise BackendError(f"LLIR op {i} ({_describe(o)}) of {self.p.name!r}: {e}") from None
                for a in o.args:                     # free buffers after their last reader
                    if self.last_use.get(a.src) == i:
                        self.values.pop(a.src, None)
                if o.kind != "output" and i not in self.last_use:
                    self.values.pop(i, None)         # never read
        return self.results

    def step(self, i: int, o: LOp) -> None:
        kind = o.kind
        if kind == "output":
            name = o.params["name"]
            x = self.read(o, 0)
            self.check_shape(x.shape, self.shape_of(o), "the output view")
            if self.arg_dtype(o, 0) == o.dtype:
                res = np.array(x, dtype=o.dtype.np, order="C", copy=True)
            else:
                res = np.asarray(store_as(x.astype(self.arg_dtype(o, 0).compute_np), o.dtype), order="C")
            self.results[name] = res
            return
        if kind == "input":
            self.values[i] = self.input(i, o)
            self.dtypes[i] = o.dtype
            return
        alias = 0 if kind == "scatter_nocopy" else o.alias
        if alias is not None:
            self.in_place(i, o, alias)
            return
        out = getattr(self, "k_" + kind)(o)
        shape = self.shape_of(o)
        if out.size != int(np.prod(shape, dtype=np.int64)):
            raise BackendError(f"result has {out.size} elements, the op's shape {shape} needs "
                               f"{int(np.prod(shape, dtype=np.int64))}")
        self.values[i] = np.ascontiguousarray(store_as(out, o.dtype)).reshape(-1)
        self.dtypes[i] = o.dtype

    # ------------------------------------------------------------------ input
    def input(self, i: int, o: LOp) -> np.ndarray:
        name, role = o.params["name"], o.params.get("role", "input")
        if name not in self.inputs:
            raise BackendError(f"missing input {name!r} (role {role})")
        x = self.inputs[name]
        if not isinstance(x, np.ndarray):
            x = np.asarray(x)
        self.check_shape(x.shape, self.shape_of(o), f"input {name!r}")
        dt, want = x.dtype, o.dtype
        ok = (_is_float_np(dt) if want.is_float else dt.kind in "iu" if want.is_int else dt.kind == "b")
        if not ok:
            raise BackendError(f"input {name!r} has dtype {dt}, expected {want} "
                               f"({'a float' if want.is_float else 'an integer' if want.is_int else 'a bool'} array)")
        if want.is_int and x.size and dt != want.np:
            info = np.iinfo(want.np)
            lo, hi = int(x.min()), int(x.max())
            if lo < info.min or hi > info.max:
                raise BackendError(f"input {name!r} has values {lo}..{hi} outside {want}")
        written = i in self.written_roots
        if written and role == "state" and self.inplace_state:
            if dt != want.np or not x.flags.c_contiguous or not x.flags.writeable:
                raise BackendError(f"state input {name!r} is written in place (inplace_state=True), so it must be "
                                   f"a C-contiguous writeable {want} array; got {dt}, "
                                   f"contiguous={x.flags.c_contiguous}, writeable={x.flags.writeable}")
            return x.reshape(-1)                     # a view: writes reach the caller's array
        if dt == want.np:
            buf = np.ascontiguousarray(x).reshape(-1)
            if written and np.shares_memory(buf, x):
                buf = buf.copy()
            return buf
        if _is_float_np(dt) and dt.itemsize < 8:    # e.g. bf16 -> f32: round from float64
            x = x.astype(np.float64)
        return np.ascontiguousarray(store_as(x, want)).reshape(-1)

    # ------------------------------------------------------------------ kernels
    def k_constant(self, o: LOp) -> np.ndarray:
        shape = self.shape_of(o)
        if "data" in o.params:
            data = np.asarray(o.params["data"], dtype=o.dtype.compute_np)
            if data.ndim != 1:
                raise BackendError("constant data must be 1-D")
            if data.size != int(np.prod(shape, dtype=np.int64)):
                raise BackendError(f"constant data has {data.size} values for shape {shape}")
            return data.reshape(shape)
        if "value" not in o.params:
            raise BackendError("constant needs a 'value' or 'data' parameter")
        return np.full(shape, o.params["value"], dtype=o.dtype.compute_np)

    def k_iota(self, o: LOp) -> np.ndarray:
        if "n" not in o.params:
            raise BackendError("iota needs parameter 'n'")
        n = self.ev(o.params["n"], "iota n")
        self.check_shape(self.shape_of(o), (n,), "iota")
        return np.arange(n, dtype=np.int64)

    def k_elementwise(self, o: LOp) -> np.ndarray:
        shape = self.shape_of(o)
        args = [self.readc(o, k) for k in range(len(o.args))]
        for k, a in enumerate(args):
            self.check_shape(a.shape, shape, f"argument {k}'s view")
        if o.op != "Fused":
            return _elementwise(o.op, args)
        expr = o.params["expr"]
        if expr[0] in ROW_OPS:
            return _eval_tree(expr, args)
        return _elementwise(expr[0], [_eval_tree(k, args) for k in expr[2:]])   # the root is rounded when stored

    def k_reduce(self, o: LOp) -> np.ndarray:
        if "expr" in o.params:                       # a fused prologue: the tree's values, root rounded
            args = [self.readc(o, k) for k in range(len(o.args))]
            for k, a in enumerate(args[1:], 1):
                self.check_shape(a.shape, args[0].shape, f"argument {k}'s view")
            x = _eval_tree(o.params["expr"], args)
        else:
            x = self.readc(o, 0)
        axis = o.params.get("axis")
        if isinstance(axis, bool) or not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
            raise BackendError(f"reduce axis {axis!r} out of range for {x.ndim} dims")
        axis %= x.ndim
        self.check_shape(x.shape[:axis] + x.shape[axis + 1:], self.shape_of(o), "the reduced input")
        if o.op == "Sum":
            out = x.sum(axis=axis)
        elif o.op == "Max":
            if x.dtype == np.bool_:
                out = x.any(axis=axis)
            else:
                ident = -np.inf if x.dtype.kind == "f" else np.iinfo(o.dtype.np if o.dtype.is_int else np.int64).min
                out = x.max(axis=axis, initial=ident)
        else:
            raise BackendError(f"unknown reduce op {o.op!r}; expected Sum or Max")
        return np.asarray(out)

    def _index(self, o: LOp, k: int, rows: int) -> np.ndarray:
        if not self.arg_dtype(o, k).is_int:
            raise BackendError(f"index argument {k} must be an integer tensor, got {self.arg_dtype(o, k)}")
        idx = self.read(o, k).astype(np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= rows):
            raise BackendError(f"index out of range: values {idx.min()}..{idx.max()} for {rows} rows")
        return idx

    def _convert(self, x: np.ndarray, src: DType, dst: DType) -> np.ndarray:
        """Values of dtype ``src`` (storage) as dtype ``dst`` (storage), rounding like a Cast."""
        if src == dst:
            return x
        return store_as(x.astype(src.compute_np), dst)

    def k_gather(self, o: LOp) -> np.ndarray:
        table = self.read(o, 0)
        if table.ndim < 1:
            raise BackendError("gather needs a table of at least 1 dim")
        idx = self._index(o, 1, table.shape[0])
        out = table[idx]                             # rows in storage dtype: no float64 copy of the table
        self.check_shape(out.shape, self.shape_of(o), "the gathered rows")
        return self._convert(out, self.arg_dtype(o, 0), o.dtype)

    def _scatter_parts(self, o: LOp, dest_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        if len(dest_shape) < 1:
            raise BackendError("scatter needs a destination of at least 1 dim")
        last = len(o.args) - 1
        idx = self._index(o, last, dest_shape[0])
        want = idx.shape + tuple(dest_shape[1:])
        if "expr" in o.params:                       # a fused prologue: the rows are the tree's values
            leaves = [self.readc(o, k) for k in range(1, last)]
            for k, a in enumerate(leaves, 1):
                self.check_shape(a.shape, want, f"argument {k}'s view")
            return store_as(_eval_tree(o.params["expr"], leaves), o.dtype), idx
        src = self.read(o, 1)
        self.check_shape(src.shape, want, "the scattered rows (args[1])")
        return self._convert(src, self.arg_dtype(o, 1), o.dtype), idx

    def k_scatter(self, o: LOp) -> np.ndarray:
        dest = self.read(o, 0)
        self.check_shape(dest.shape, self.shape_of(o), "the destination view")
        out = self._convert(dest, self.arg_dtype(o, 0), o.dtype).copy()
        src, idx = self._scatter_parts(o, dest.shape)
        out[idx] = src                               # duplicate indices: the last one wins
        return out

    def k_attention(self, o: LOp) -> np.ndarray:
        """The per-chunk partials of decode attention, exactly as lum.format.llir defines them."""
        rows, keys, _, width = attention_dims(o)
        r, t, dv = tuple(self.ev(x) for x in rows), self.ev(keys), self.ev(width)
        q, k, v = (self.readc(o, j).astype(np.float64) for j in range(3))
        mask = self.readc(o, 3).astype(np.bool_)
        self.check_shape(mask.shape, r + (t,), "the mask view")
        scores = round_to(np.einsum("...d,...td->...t", q, k), DType.f32)
        logits = np.where(mask, round_to(scores * float(o.params["scale"]), DType.f32), -np.inf)
        with np.errstate(invalid="ignore"):
            x = np.where(np.isfinite(logits), round_to(logits * _LOG2E_F32, DType.f32), -np.inf)
        chunk, p_dtype = int(o.params["chunk"]), DType.parse(o.params["p_dtype"])
        ns = -(-t // chunk)
        out = np.zeros(tuple(r) + (ns, dv + 2))
        for j in range(ns):
            xs, vs = x[..., j * chunk:(j + 1) * chunk], v[..., j * chunk:(j + 1) * chunk, :]
            c = np.ceil(xs.max(axis=-1, initial=-np.inf))
            finite = np.isfinite(c)
            e = np.exp2(xs - np.where(finite, c, 0.0)[..., None])   # exp2(-inf) = 0 for masked keys
            out[..., j, :dv] = np.einsum("...t,...td->...d", round_to(e, p_dtype), vs)
            out[..., j, dv] = np.where(finite, c, -np.inf)
            out[..., j, dv + 1] = e.sum(axis=-1)
        return out

    def k_gemm(self, o: LOp) -> np.ndarray:
        p = o.params
        layout = p.get("layout")
        if layout not in GEMM_LAYOUTS:
            raise BackendError(f"gemm layout {layout!r} is not one of {GEMM_LAYOUTS}")
        for key in ("m", "n", "k", "lda", "ldb"):
            if key not in p:
                raise BackendError(f"gemm needs parameter {key!r}")
        m, n, k = (self.ev(p[x], f"gemm {x}") for x in ("m", "n", "k"))
        lda, ldb = self.ev(p["lda"], "gemm lda"), self.ev(p["ldb"], "gemm ldb")
        batch = self.ev(p.get("batch", 1), "gemm batch")
        if batch > 1 and not ("stride_a" in p and "stride_b" in p):
            raise BackendError("a batched gemm needs stride_a and stride_b")
        sa, sb = self.ev(p.get("stride_a", 0), "gemm stride_a"), self.ev(p.get("stride_b", 0), "gemm stride_b")
        oa, ob = self.ev(p.get("offset_a", 0), "gemm offset_a"), self.ev(p.get("offset_b", 0), "gemm offset_b")
        if min(m, n, k, batch) < 0 or min(sa, sb, oa, ob) < 0 or min(lda, ldb) < 1:
            raise BackendError(f"gemm sizes must be non-negative and lda/ldb positive: m={m} n={n} k={k} "
                               f"batch={batch} lda={lda} ldb={ldb} stride_a={sa} stride_b={sb} "
                               f"offset_a={oa} offset_b={ob}")
        if "ldc" in p and self.ev(p["ldc"], "gemm ldc") != n:
            raise BackendError(f"gemm ldc must equal n ({n}): C is row-major [batch, m, n]")
        if "stride_c" in p and batch > 1 and self.ev(p["stride_c"], "gemm stride_c") != m * n:
            raise BackendError(f"gemm stride_c must equal m*n ({m * n}): C is row-major [batch, m, n]")
        shape = self.shape_of(o)
        n_c = self.ev(p["n_out"], "gemm n_out") if "epilogue" in p else n   # the columns the buffer holds
        if int(np.prod(shape, dtype=np.int64)) != batch * m * n_c:
            raise BackendError(f"gemm output shape {shape} does not hold batch*m*n = {batch}*{m}*{n_c}")
        a_rm, b_rm = layout[:2] == "Rm", layout[2:] == "Rm"
        jb, _ = gemm_parts(o)
        if batch * m * n == 0 or k == 0:
            c = np.zeros((batch, m, n))
        else:
            a_buf = None
            if "expr" in p:                          # a fused prologue: A's buffer is the tree's values
                leaves = [self.readc(o, j) for j in range(jb)]
                for j, x in enumerate(leaves[1:], 1):
                    self.check_shape(x.shape, leaves[0].shape, f"argument {j}'s view")
                a_dt = DType.parse(p["expr"][1])
                a_buf = (store_as(_eval_tree(p["expr"], leaves), a_dt).ravel(), a_dt)
            a = self._matrix(o, 0, batch, m, k, sa, (lda, 1) if a_rm else (1, lda), oa, "A", a_buf)
            b = self._matrix(o, jb, batch, k, n, sb, (ldb, 1) if b_rm else (1, ldb), ob, "B")
            c = np.matmul(a, b)
            if c.shape[0] != batch:
                c = np.broadcast_to(c, (batch, m, n))
        if "epilogue" not in p:
            return c.reshape(shape)
        # a fused epilogue: the tree over C's columns c + acc_cols[t] (rounded to acc_dtype) and its leaves
        n_out = self.ev(p["n_out"], "gemm n_out")
        cols = [int(x) for x in p["acc_cols"]]
        if n_out < 0 or any(x + n_out > n for x in cols):
            raise BackendError(f"gemm epilogue columns {cols} + n_out {n_out} exceed n = {n}")
        cr = round_to(c, DType.parse(p["acc_dtype"]))
        accs = [cr[:, :, x:x + n_out].reshape(shape) for x in cols]
        leaves = [self.readc(o, j) for j in range(jb + 1, len(o.args))]
        for j, x in enumerate(leaves):
            self.check_shape(x.shape, shape, f"epilogue leaf {j}'s view")
        return _eval_tree(p["epilogue"], leaves, accs)

    def _matrix(self, o: LOp, j: int, batch: int, rows: int, cols: int, bstride: int,
                strides: tuple[int, int], offset: int, name: str,
                computed: tuple[np.ndarray, DType] | None = None) -> np.ndarray:
        """Operand ``name`` as a float64 [batch|1, rows, cols] array addressed in the raw buffer of args[j]
        (or in ``computed``: a prologue's flat values and their dtype)."""
        if computed is not None:
            buf, dt = computed
        else:
            src = o.args[j].src
            if src in self.consumed:
                raise BackendError(f"reads the buffer of op {src} after op {self.consumed[src]} wrote into it in place")
            buf, dt = self.values[src], self.dtypes[src]
        nb = batch if bstride else 1
        last = offset + (nb - 1) * bstride + (rows - 1) * strides[0] + (cols - 1) * strides[1]
        if last >= buf.size:
            raise BackendError(f"gemm operand {name} reads elements {offset}..{last} of a buffer of {buf.size}")
        item = buf.itemsize
        x = np.lib.stride_tricks.as_strided(buf[offset:], shape=(nb, rows, cols),
                                            strides=(bstride * item, strides[0] * item, strides[1] * item),
                                            writeable=False)
        return x.astype(np.float64 if dt.is_float or dt == DType.bool else np.int64)

    # ------------------------------------------------------------------ in place
    def in_place(self, i: int, o: LOp, alias: int) -> None:
        """Ops whose output shares args[alias]'s buffer: compute, then write through that arg's view."""
        target = o.args[alias]
        if target.src in self.consumed:
            raise BackendError(f"writes the buffer of op {target.src} after op {self.consumed[target.src]} "
                               "already wrote into it in place")
        buf = self.values[target.src]
        if self.dtypes[target.src] != o.dtype:
            raise BackendError(f"an in-place op of dtype {o.dtype} cannot write a {self.dtypes[target.src]} buffer")
        shape = self.shape_of(o)
        if o.kind == "scatter_nocopy":
            dest = self.read(o, 0)
            self.check_shape(dest.shape, shape, "the destination view")
            src, idx = self._scatter_parts(o, dest.shape)
            w = self._writable(buf, target.view)
            w[idx] = src                             # only the scattered rows are touched
        else:
            out = getattr(self, "k_" + o.kind)(o)
            w = self._writable(buf, target.view)
            self.check_shape(w.shape, shape, f"the aliased argument {alias}'s view")
            w[...] = store_as(np.asarray(out).reshape(shape), o.dtype)
        self.consumed[target.src] = i
        self.values[i] = buf                         # the same ndarray object: the output aliases it
        self.dtypes[i] = o.dtype

    def _writable(self, buf: np.ndarray, view: ShapeTracker) -> np.ndarray:
        shape, strides, offset, mask = view.evaluate(self.dyn)
        if mask is not None and any(lo != 0 or hi != d for (lo, hi), d in zip(mask, shape)):
            raise BackendError("an in-place write cannot go through a padded (masked) view")
        if any(s == 0 and d > 1 for s, d in zip(strides, shape)):
            raise BackendError("an in-place write cannot go through a broadcast (stride-0) view")
        if any(d < 0 for d in shape):
            raise BackendError(f"negative dim in view shape {shape}")
        if 0 in shape:
            return np.zeros(shape, dtype=buf.dtype)
        hi = offset + sum((d - 1) * s for d, s in zip(shape, strides) if s > 0)
        lo = offset + sum((d - 1) * s for d, s in zip(shape, strides) if s < 0)
        if lo < 0 or hi >= buf.size:
            raise BackendError(f"in-place view writes elements {lo}..{hi} of a buffer of {buf.size}")
        if not buf.flags.writeable:
            raise BackendError("the in-place destination buffer is read-only")
        item = buf.itemsize
        return np.lib.stride_tricks.as_strided(buf[offset:], shape=shape, strides=[s * item for s in strides])
