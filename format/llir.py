"""LLIR: the chosen program of one group — an ordered list of kernel launches and library calls.

The builder's extraction produces it; the package stores it as JSON; the loader's backends run it.
Each :class:`LOp` writes one buffer (``out``); its ``args`` read earlier buffers through views
(ShapeTracker), so the reference backend can execute it without knowing how it was derived.

Op kinds (``kind`` · ``op`` · params):

============== =================================================================================
input          a program input; params ``name``, ``role`` (input | weight | state | ext)
output         marks ``args[0]`` as program output; params ``name``, ``role``
constant       scalar ``value`` or 1-D ``data``
iota           ``out[i] = i``, params ``n``
elementwise    ``op`` ∈ Cast Exp2 Log2 Sin Sqrt Recip Add Mul Mod LessThan Where Contiguous, or
               ``Fused``: an expression tree of those ops over the args, params ``expr``
reduce         ``op`` ∈ Sum Max over ``axis`` of ``args[0]``, or (params ``expr``) of an expression tree
               over the args
gather         rows of ``args[0]`` picked by ``args[1]``
scatter        copy of ``args[0]`` with rows ``args[2]`` set to ``args[1]``
scatter_nocopy the same, writing into ``args[0]``'s buffer in place (``alias == 0``)
attention      the per-chunk partials of decode attention (split-K flash decoding), params ``scale``,
               ``chunk``, ``p_dtype``; a reduce with row reductions combines the chunks (version 2)
gemm           cuBLASLt-style batched matmul on raw buffers, params: layout (RmRm RmCm CmRm CmCm:
               the majorness of A and B), ``m n k``, ``lda ldb ldc``, ``batch``, ``stride_a stride_b
               stride_c`` and element ``offset_a offset_b``; C is row-major [batch, m, n] with ldc = n.
============== =================================================================================

Precise semantics (what :mod:`lum.loader.reference_backend` executes):

* Buffers. Each op writes one row-major contiguous buffer of ``shape`` (evaluated with the dyn_map)
  in ``dtype``; an argument reads its producer's flat buffer through ``view`` (padding reads 0).
  Every op computes in float64 (int64 for integers) and rounds once when storing its result:
  floats round to nearest even, float→int truncates toward zero, anything→bool is ``x != 0``.
* ``alias = j`` (in place). The op's buffer *is* ``args[j]``'s buffer: the result is written through
  ``args[j].view`` (unmasked, no broadcast dims, same dtype as the op) and later ops read the whole
  shared buffer. The producer of ``args[j]`` is consumed: no later op may read it (only the aliasing
  op's id). The op reads all its arguments before it writes.
* input: an array of exactly ``shape``, converted to ``dtype``. output: ``args[0]``'s view (shape
  ``shape``) converted to the output's ``dtype``.
* constant: ``value`` fills ``shape`` (usually ``()``); ``data`` holds ``numel(shape)`` values.
  iota: ``n`` (int or Expr); ``shape == (n,)``.
* elementwise: arity 1 (Cast, Contiguous, the unary math ops), 2 (Add Mul Mod LessThan) or 3
  (Where: cond, a, b); every argument's view has the op's shape (broadcast is a stride-0 view).
  Mod is floored (the result takes the divisor's sign, as numpy/Python); LessThan gives bool.
* Fused (elementwise): several elementwise ops in one kernel. ``params["expr"]`` is a JSON tree: a
  leaf ``["arg", k]`` reads ``args[k]`` (a leaf may repeat; every arg view has the op's shape), a
  node ``[op, dtype, child…]`` applies elementwise ``op`` (not Fused) with its arity to its
  children and rounds the result to ``dtype`` (as if stored in a buffer of that dtype); the root
  node's dtype is the op's dtype. So a Fused op computes exactly what the unfused ops compute.
* Row reductions (LLIR version 2). A Fused tree may hold ``["RowSum", dtype, child]`` and
  ``["RowMax", dtype, child]`` nodes: over the op's loop domain D (its shape), the node's value at
  index ``(i…, j)`` is the Sum / Max over ``k < D[-1]`` of ``child`` at ``(i…, k)``, accumulated
  exactly and rounded to ``dtype`` — a reduce over the last axis whose result is read broadcast
  along it, computed inside the consumer's kernel (RMSNorm's ``x·rsqrt(mean(x²))``, softmax's
  ``exp(x − max)/Σ`` in one kernel). Row nodes may nest (softmax's Σ holds its max) and appear in a
  reduce's prologue when that reduce is over the last axis (the same D). Max of an empty row is −inf.
* reduce: ``params['axis']`` of ``args[0]``'s view (negative counts from the end); the output drops
  that axis. An empty axis gives the identity (Sum 0; Max −inf, or an integer dtype's minimum).
  With ``params["expr"]`` (a fused prologue) the reduced input is that Fused expression tree over the
  args instead (every arg view has the reduced input's shape; padding of a leaf reads 0), evaluated
  per element with the same per-node rounding, the root rounded to its own dtype (the dtype of the
  buffer the unfused reduce would have read; not necessarily the op's). Without it: one arg.
* gather: ``out[j…, r…] = table[idx[j…], r…]`` for ``table = args[0]``, integer ``idx = args[1]``.
* scatter / scatter_nocopy: ``out = dest; out[idx[j…], r…] = src[j…, r…]`` for ``dest = args[0]``,
  ``src = args[1]`` (shape ``idx.shape + dest.shape[1:]``), integer ``idx = args[2]``; scatter_nocopy
  touches only the indexed rows of dest's buffer. Indices must lie in ``[0, dest.shape[0])``; with
  duplicate indices the written row is unspecified (the reference backend keeps the last).
  With ``params["expr"]`` (a fused prologue, LLIR version 2) the rows are computed, not read: ``src``
  is that Fused expression tree (row reductions over src's last axis, a dest axis) over the leaves
  ``args[1:-1]`` (every leaf view of
  the src shape; padding reads 0), its root rounded to its own dtype and then converted to the op's,
  and ``idx = args[-1]`` — the KV cache write computes RoPE and the rounding to the cache dtype.
* attention (LLIR version 2): ``q = args[0]`` viewed [R…, D], ``k = args[1]`` [R…, T, D], ``v = args[2]``
  [R…, T, Dv], ``mask = args[3]`` (bool) [R…, T]; the op's shape is [R…, NS, Dv + 2] (f32) with
  ``NS = cdiv(T, chunk)``. Per query row r: ``L[t] = where(mask[t], f32(f32(Σ_d q[d]·k[t, d]) · scale),
  −inf)`` and ``x[t] = f32(L[t] · log2 e)``; chunk j holds the keys ``j·chunk ≤ t < (j+1)·chunk``, and
  its partials are ``c = ceil(max_t x[t])``, ``l = Σ_t 2^(x[t] − c)`` and
  ``acc[d] = Σ_t round_p(2^(x[t] − c)) · v[t, d]`` (``round_p``: rounding to ``p_dtype``), stored as
  ``[acc[0…Dv), c, l]``; a chunk without a finite logit stores ``c = −inf``, ``l = 0``, ``acc = 0``. The
  combined ``Σ_j 2^(c_j − c*) acc_j / Σ_j 2^(c_j − c*) l_j`` (``c* = max_j c_j``) is softmax(L)·v with the
  probabilities rounded to ``p_dtype`` before ·v (up to where f32 rounds, the unfused computation's
  value; a row without a finite logit is NaN there and here). The offsets are integers, so scaling by
  ``2^(c_j − c*)`` is exact and the result does not depend on ``chunk``.
* gemm: ``A = args[0]``, ``B = args[1]`` are addressed in their producers' raw flat buffers by the
  params alone (the args' views are not applied; by convention they are the 1-D contiguous view
  of the buffer). For batch ``b``, ``A[b,i,l] = bufA[offset_a + b*stride_a + i*lda + l]`` when A is
  row-major (``Rm..``), ``… + i + l*lda`` when column-major (``Cm..``); ``B[b,l,j] =
  bufB[offset_b + b*stride_b + l*ldb + j]`` row-major (``..Rm``), ``… + l + j*ldb`` column-major.
  ``C[b] = A[b] @ B[b]`` (accumulated in float64, rounded once) fills the op's buffer row-major:
  ``numel(shape) == batch*m*n``. Defaults: ``batch`` 1, ``offset_*`` 0, ``stride_*`` 0 when batch is 1
  (a stride of 0 broadcasts that operand over the batch); ``ldc``, if given, must be ``n`` and
  ``stride_c`` ``m*n``. Any param may be an int or an Expr over dyn vars.
  With ``params["expr"]`` (a fused prologue, LLIR version 3) A is computed, not read: A's buffer is that
  Fused expression tree over the leaves before B (``args[:-1]`` without an epilogue; every leaf view of one shape D; row reductions
  over D's last axis), laid out row-major over D, every node rounded and the root rounded to its own
  dtype (A's dtype); the params address that buffer as they would address A's producer, and B is the
  arg after the leaves. A decode GEMV recomputes its input's RMSNorm this way, in each block.
  With ``params["epilogue"]`` (a fused epilogue, LLIR version 3) the op's buffer is not C but that
  Fused tree over C: its last ``params["epilogue_leaves"]`` (L) args are ordinary leaves (``["arg",
  k]`` reads ``args[len(args) - L + k]``, a view of the op's shape), and ``["acc", t]`` reads ``C[b, i,
  c + acc_cols[t]]`` rounded to ``params["acc_dtype"]`` at the output element whose row-major index over
  the op's shape is ``(b·m + i)·n_out + c`` (``c < params["n_out"]``, every ``c + acc_cols[t] < n``); B
  is then ``args[len(args) - L - 1]``. The gate-up GEMV stores gelu(gate)·up this way, one value per
  pair of product columns ``c`` and ``c + n_out``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from lum.format.dtypes import DType
from lum.format.expr import Expr, as_expr, cdiv, parse
from lum.format.shapetracker import ShapeTracker

ELEMENTWISE_ARITY = {"Cast": 1, "Contiguous": 1, "Exp2": 1, "Log2": 1, "Sin": 1, "Sqrt": 1, "Recip": 1,
                     "Add": 2, "Mul": 2, "Mod": 2, "LessThan": 2, "Where": 3}
KINDS = ("input", "output", "constant", "iota", "elementwise", "reduce", "gather", "scatter",
         "scatter_nocopy", "attention", "gemm")
GEMM_LAYOUTS = ("RmRm", "RmCm", "CmRm", "CmCm")
GEMM_DEFAULTS = {"batch": 1, "stride_a": 0, "stride_b": 0, "offset_a": 0, "offset_b": 0}   # absent gemm params
ROW_OPS = {"RowSum": "Sum", "RowMax": "Max"}     # row reductions in Fused trees (LLIR version 2)
LLIR_VERSION = 3                                   # the newest version this code reads and writes
LLIR_VERSIONS = (1, 2, 3)                           # readable; a program is written at the lowest that holds it


@dataclass(frozen=True)
class Arg:
    """An input of an op: the producing op's id and the view of its buffer that this op reads."""

    src: int
    view: ShapeTracker


@dataclass
class LOp:
    id: int
    kind: str
    op: str
    args: tuple[Arg, ...]
    shape: tuple[Expr, ...]
    dtype: DType
    params: dict[str, Any] = field(default_factory=dict)
    alias: int | None = None          # output shares the buffer of args[alias]
    bytes: Expr = field(default_factory=lambda: as_expr(0))
    flops: Expr = field(default_factory=lambda: as_expr(0))

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown LLIR op kind {self.kind!r}")


@dataclass
class Program:
    """One group's program. ``ops`` are in execution order; inputs/outputs are ops of those kinds."""

    name: str
    ops: list[LOp]

    def inputs(self) -> list[LOp]:
        return [o for o in self.ops if o.kind == "input"]

    def outputs(self) -> list[LOp]:
        return [o for o in self.ops if o.kind == "output"]

    def kernels(self) -> list[LOp]:
        return [o for o in self.ops if o.kind not in ("input", "output", "constant")]

    def dyn_vars(self) -> frozenset[str]:
        """Every dyn var the program mentions: op shapes, argument views and Expr parameters."""
        names: set[str] = set()
        for o in self.ops:
            for d in o.shape:
                names |= d.vars()
            for a in o.args:
                v = a.view
                for x in (*v.shape, *v.strides, v.offset, *(b for lh in (v.mask or ()) for b in lh)):
                    names |= x.vars()
            for val in o.params.values():
                if isinstance(val, Expr):
                    names |= val.vars()
        return frozenset(names)

    def total_bytes(self) -> Expr:
        out = as_expr(0)
        for o in self.ops:
            out = out + o.bytes
        return out

    def total_flops(self) -> Expr:
        out = as_expr(0)
        for o in self.ops:
            out = out + o.flops
        return out

    # ------------------------------------------------------------------ JSON
    def version(self) -> int:
        """The lowest LLIR version that holds this program: 3 when a gemm has a fused prologue or epilogue; 2 when a
        Fused tree has row reductions, a scatter has a fused prologue or an attention op is there; else 1,
        so a loader that reads only an older version still opens every program that needs nothing newer."""
        if any(gemm_fused(o) for o in self.ops):
            return 3
        return 2 if any(o.kind == "attention" or ("expr" in o.params and (
            o.kind in ("scatter", "scatter_nocopy") or has_row_ops(o.params["expr"]))) for o in self.ops) else 1

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version(), "name": self.name, "ops": [_op_to_json(o) for o in self.ops]}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(data: dict[str, Any]) -> Program:
        version = data.get("version") if isinstance(data, dict) else None
        if isinstance(version, bool) or version not in LLIR_VERSIONS:
            raise ValueError(f"unsupported LLIR version {version!r} (this lum reads {list(LLIR_VERSIONS)})")
        ops = [_op_from_json(o) for o in data["ops"]]
        for i, o in enumerate(ops):
            if o.id != i:
                raise ValueError(f"LLIR op {i} has id {o.id}")
            for a in o.args:
                if not 0 <= a.src < i:
                    raise ValueError(f"LLIR op {i} reads op {a.src}, which does not precede it")
            if o.alias is not None and not 0 <= o.alias < len(o.args):
                raise ValueError(f"LLIR op {i} aliases a missing argument {o.alias}")
            check_params(o, version, f"LLIR op {i} ({o.kind} {o.op})" if o.op else f"LLIR op {i} ({o.kind})")
        return Program(str(data["name"]), ops)

    @staticmethod
    def loads(text: str) -> Program:
        return Program.from_json(json.loads(text))


def check_expr(expr: Any, nargs: int, dtype: DType | None, where: str = "Fused op", rows: bool = True,
               accs: int = 0) -> None:
    """Raise ValueError unless ``expr`` is a valid Fused expression over ``nargs`` args whose root has
    ``dtype`` (any dtype when None: a reduce's prologue; see the module docstring); row reductions
    only when ``rows`` (LLIR version 2); ``["acc", t]`` leaves with ``t < accs`` (a gemm epilogue)."""

    def walk(t: Any, path: str) -> None:
        if not isinstance(t, (list, tuple)) or not t:
            raise ValueError(f"{where}: expr node {path} is not a non-empty list: {t!r}")
        if t[0] == "acc" and accs:
            if len(t) != 2 or isinstance(t[1], bool) or not isinstance(t[1], int) or not 0 <= t[1] < accs:
                raise ValueError(f"{where}: expr leaf {path} {t!r} must be ['acc', t] with 0 <= t < {accs}")
            return
        if t[0] == "arg":
            if len(t) != 2 or isinstance(t[1], bool) or not isinstance(t[1], int) or not 0 <= t[1] < nargs:
                raise ValueError(f"{where}: expr leaf {path} {t!r} must be ['arg', k] with 0 <= k < {nargs}")
            return
        want = ELEMENTWISE_ARITY.get(t[0]) if isinstance(t[0], str) else None
        if rows and isinstance(t[0], str) and t[0] in ROW_OPS:
            want = 1
        if want is None:
            raise ValueError(f"{where}: unknown elementwise op {t[0]!r} in expr node {path}")
        if len(t) != 2 + want:
            raise ValueError(f"{where}: {t[0]} in expr node {path} takes {want} argument(s), got {len(t) - 2}")
        try:
            DType.parse(t[1] if isinstance(t[1], str) else repr(t[1]))
        except ValueError as e:
            raise ValueError(f"{where}: expr node {path}: {e}") from None
        for j, kid in enumerate(t[2:]):
            walk(kid, f"{path}.{j}")

    walk(expr, "root")
    if expr[0] in ("arg", "acc"):
        raise ValueError(f"{where}: the expr root must be an op node, not a leaf")
    if dtype is not None and DType.parse(expr[1]) != dtype:
        raise ValueError(f"{where}: the expr root has dtype {expr[1]}, the op {dtype}")


def has_row_ops(expr: Any) -> bool:
    """Whether a Fused expression tree holds a row reduction (RowSum / RowMax); False for a malformed one."""
    if not isinstance(expr, (list, tuple)) or not expr or expr[0] in ("arg", "acc"):
        return False
    return (isinstance(expr[0], str) and expr[0] in ROW_OPS) or any(has_row_ops(k) for k in expr[2:])


def has_expr_params(op: LOp) -> bool:
    """Whether :func:`check_params` has something to check for ``op``; its args then are the expr's leaves
    (and, for a scatter, dest and idx around them) rather than a fixed arity."""
    return (op.kind == "elementwise" and op.op == "Fused") or op.kind == "attention" or gemm_fused(op) or \
        (op.kind in ("reduce", "scatter", "scatter_nocopy") and "expr" in op.params)


def check_params(op: LOp, version: int, where: str) -> None:
    """Raise ValueError unless the params of ``op`` that go beyond a plain kernel are valid at ``version``:
    a Fused tree, a reduce's prologue (row reductions over the last axis only), a scatter's prologue and
    an attention op's views and params (the module docstring). Every reader of LLIR checks with this."""
    rows = version >= 2
    if op.kind == "elementwise" and op.op == "Fused":
        check_expr(op.params.get("expr"), len(op.args), op.dtype, where, rows)
    elif op.kind == "reduce" and "expr" in op.params:
        check_expr(op.params["expr"], len(op.args), None, where, rows)
        check_row_reduce(op, where)
    elif op.kind in ("scatter", "scatter_nocopy") and "expr" in op.params:
        check_scatter_prologue(op, version, where)
    elif gemm_fused(op):
        check_gemm_fusion(op, version, where)
    elif op.kind == "attention":
        if version < 2:
            raise ValueError(f"{where} needs LLIR version 2")
        check_attention(op, where)


def check_scatter_prologue(op: LOp, version: int, where: str) -> None:
    """A scatter's fused prologue: version 2, at least one leaf between dest and idx; row reductions only
    over a row of dest (a dest of at least 2 dims: the src domain's last axis is dest's)."""
    if version < 2:
        raise ValueError(f"{where}: a scatter prologue needs LLIR version 2")
    if len(op.args) < 3:
        raise ValueError(f"{where}: a scatter with a prologue takes (dest, leaves…, idx)")
    check_expr(op.params["expr"], len(op.args) - 2, None, where)
    if has_row_ops(op.params["expr"]) and len(op.shape) < 2:
        raise ValueError(f"{where}: row reductions in a scatter prologue need a dest of at least 2 dims")


def gemm_fused(op: LOp) -> bool:
    """A gemm with a fused prologue or epilogue (version 3): only lum's GEMV kernel runs it, never a library."""
    return op.kind == "gemm" and ("expr" in op.params or "epilogue" in op.params)


def gemm_parts(op: LOp) -> tuple[int, int]:
    """(index of B, number of epilogue leaves) of a gemm's args: ``(A | prologue leaves…, B, epilogue
    leaves…)``."""
    leaves = op.params.get("epilogue_leaves", 0) if "epilogue" in op.params else 0
    return len(op.args) - 1 - leaves, leaves


def check_gemm_fusion(op: LOp, version: int, where: str) -> None:
    """A gemm's fused prologue and epilogue (version 3). Prologue: at least one leaf before B, leaves of one
    shape of at least one dim (the domain D whose last axis row reductions reduce), a float root.
    Epilogue: no row reductions, ``acc_cols`` of ints >= 0, a float ``acc_dtype``, ``n_out``, a root
    of the op's dtype, leaves viewed in the op's shape."""
    if version < 3:
        raise ValueError(f"{where}: a gemm prologue or epilogue needs LLIR version 3")
    leaves = op.params.get("epilogue_leaves", 0) if "epilogue" in op.params else 0
    if isinstance(leaves, bool) or not isinstance(leaves, int) or not 0 <= leaves <= len(op.args) - 2:
        raise ValueError(f"{where}: epilogue_leaves must be an int in [0, {len(op.args) - 2}], got {leaves!r}")
    b, _ = gemm_parts(op)
    if "expr" in op.params:
        expr = op.params["expr"]
        check_expr(expr, b, None, where)
        if not DType.parse(expr[1]).is_float:
            raise ValueError(f"{where}: a gemm prologue must compute float values, not {expr[1]}")
        dom = op.args[0].view.shape
        if not dom or any(tuple(a.view.shape) != tuple(dom) for a in op.args[:b]):
            raise ValueError(f"{where}: a gemm prologue's leaves must share one view shape of at least one dim")
    elif b != 1:
        raise ValueError(f"{where}: a gemm takes (A, B) before its epilogue leaves")
    if "epilogue" in op.params:
        cols, acc_dt = op.params.get("acc_cols"), op.params.get("acc_dtype")
        if not isinstance(cols, list) or not cols or any(isinstance(c, bool) or not isinstance(c, int) or c < 0
                                                         for c in cols):
            raise ValueError(f"{where}: acc_cols must be a non-empty list of ints >= 0, got {cols!r}")
        if not isinstance(acc_dt, str) or not DType.parse(acc_dt).is_float or "n_out" not in op.params:
            raise ValueError(f"{where}: a gemm epilogue needs a float acc_dtype and n_out")
        check_expr(op.params["epilogue"], leaves, op.dtype, where, rows=False, accs=len(cols))
        if any(tuple(a.view.shape) != tuple(op.shape) for a in op.args[b + 1:]):
            raise ValueError(f"{where}: a gemm epilogue's leaves must be viewed in the op's shape")


def attention_dims(op: LOp) -> tuple[tuple[Expr, ...], Expr, Expr, Expr]:
    """(R, T, D, Dv) of an attention op (see the module docstring); ValueError when its views disagree."""
    if len(op.args) != 4:
        raise ValueError(f"attention takes (q, k, v, mask), got {len(op.args)} arguments")
    q, k, v, m = (a.view for a in op.args)
    if q.ndim < 1 or k.ndim != q.ndim + 1 or v.ndim != k.ndim or m.ndim != q.ndim:
        raise ValueError("attention views must be q [R…, D], k [R…, T, D], v [R…, T, Dv], mask [R…, T]")
    r, t, d = tuple(q.shape[:-1]), k.shape[-2], q.shape[-1]
    if tuple(k.shape) != r + (t, d) or tuple(v.shape[:-1]) != r + (t,) or tuple(m.shape) != r + (t,):
        raise ValueError("attention views must be q [R…, D], k [R…, T, D], v [R…, T, Dv], mask [R…, T]")
    return r, t, d, v.shape[-1]


def check_attention(op: LOp, where: str) -> None:
    """An attention op's views, params and partials shape (the module docstring)."""
    try:
        r, t, _, dv = attention_dims(op)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    chunk, scale, p_dtype = op.params.get("chunk"), op.params.get("scale"), op.params.get("p_dtype")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"{where}: chunk must be a positive int, got {chunk!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"{where}: scale must be a number, got {scale!r}")
    if not isinstance(p_dtype, str) or not DType.parse(p_dtype).is_float:
        raise ValueError(f"{where}: p_dtype must be a float dtype, got {p_dtype!r}")
    if op.dtype != DType.f32 or tuple(op.shape) != r + (cdiv(t, chunk), dv + 2):
        raise ValueError(f"{where}: the partials are f32 [R…, cdiv(T, chunk), Dv + 2]")


def check_row_reduce(op: LOp, where: str) -> None:
    """A reduce whose prologue has row reductions must reduce the last axis (the rows' own axis)."""
    if not has_row_ops(op.params["expr"]):
        return
    axis, nd = op.params.get("axis"), (op.args[0].view.ndim if op.args else 0)
    if isinstance(axis, bool) or not isinstance(axis, int) or nd == 0 or axis % nd != nd - 1:
        raise ValueError(f"{where}: a prologue with row reductions needs the last axis reduced, got axis {axis!r}")


def expr_nodes(expr: Any) -> int:
    """Op nodes (not leaves) of a Fused expression tree."""
    return 0 if expr[0] in ("arg", "acc") else 1 + sum(expr_nodes(k) for k in expr[2:])


# ---------------------------------------------------------------------- (de)serialisation
def view_to_json(v: ShapeTracker) -> dict[str, Any]:
    out: dict[str, Any] = {"shape": [str(d) for d in v.shape], "strides": [str(s) for s in v.strides],
                           "offset": str(v.offset)}
    if v.mask is not None:
        out["mask"] = [[str(lo), str(hi)] for lo, hi in v.mask]
    return out


def view_from_json(d: dict[str, Any]) -> ShapeTracker:
    shape = tuple(parse(x) for x in d["shape"])
    strides = tuple(parse(x) for x in d["strides"])
    if len(shape) != len(strides):
        raise ValueError("view shape and strides differ in length")
    mask = None
    if d.get("mask") is not None:
        mask = tuple((parse(lo), parse(hi)) for lo, hi in d["mask"])
        if len(mask) != len(shape):
            raise ValueError("view mask and shape differ in length")
    return ShapeTracker(shape, strides, parse(d["offset"]), mask)


def _param_to_json(v: Any) -> Any:
    if isinstance(v, Expr):
        return {"expr": str(v)}
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return {"float": repr(v)}
    if isinstance(v, (list, tuple)):
        return [_param_to_json(x) for x in v]
    return v


def _param_from_json(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) == {"expr"}:
            return parse(v["expr"])
        if set(v) == {"float"}:
            if v["float"] not in ("nan", "inf", "-inf"):
                raise ValueError(f"bad float literal {v['float']!r}")
            return float(v["float"])
        raise ValueError(f"unknown LLIR parameter encoding {sorted(v)}")
    if isinstance(v, list):
        return [_param_from_json(x) for x in v]
    return v


def _op_to_json(o: LOp) -> dict[str, Any]:
    d: dict[str, Any] = {
        "id": o.id, "kind": o.kind, "op": o.op, "dtype": o.dtype.value,
        "args": [{"src": a.src, "view": view_to_json(a.view)} for a in o.args],
        "shape": [str(x) for x in o.shape],
        "params": {k: _param_to_json(v) for k, v in sorted(o.params.items())},
        "bytes": str(o.bytes), "flops": str(o.flops),
    }
    if o.alias is not None:
        d["alias"] = o.alias
    return d


def _op_from_json(d: dict[str, Any]) -> LOp:
    return LOp(
        id=int(d["id"]), kind=str(d["kind"]), op=str(d["op"]),
        args=tuple(Arg(int(a["src"]), view_from_json(a["view"])) for a in d["args"]),
        shape=tuple(parse(x) for x in d["shape"]), dtype=DType.parse(d["dtype"]),
        params={k: _param_from_json(v) for k, v in d.get("params", {}).items()},
        alias=d.get("alias"), bytes=parse(d.get("bytes", "0")), flops=parse(d.get("flops", "0")),
    )
