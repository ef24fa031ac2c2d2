"""GraphTensor: the tensor API models are written in; every method lowers to HLIR primops.

View methods (``permute``, ``reshape``, ``slice``, ``pad``, ``expand_dim``, ``broadcast_to``) only
change the tensor's :class:`ShapeTracker`; compute methods append a node that freezes the current
views of its inputs. Composites (softmax, norms, matmul, rope, …) are plain functions of primops
so that the e-graph sees, and can fuse, everything.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import numpy as np

from lum.builder.hlir import Edge, Graph
from lum.format.dtypes import DType
from lum.format.expr import Expr, ExprLike, as_expr
from lum.format.shapetracker import Shape, ShapeTracker

Scalar = Union[int, float]
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


class GraphTensor:
    """A view of one HLIR node's output."""

    __slots__ = ("graph", "node", "view", "dtype")
    __array_priority__ = 1000  # so numpy scalars defer to our operators

    def __init__(self, graph: Graph, node: int, view: ShapeTracker, dtype: DType):
        self.graph = graph
        self.node = node
        self.view = view
        self.dtype = dtype

    # ------------------------------------------------------------------ basics
    @property
    def shape(self) -> Shape:
        return self.view.shape

    @property
    def ndim(self) -> int:
        return self.view.ndim

    def __repr__(self) -> str:
        return f"GraphTensor(%{self.node}, {self.dtype}[{','.join(map(str, self.shape))}])"

    def __bool__(self) -> bool:  # else `0 < x < 1` silently drops its first comparison
        raise TypeError("a GraphTensor has no truth value at build time; use where / logical_and")

    def _with(self, view: ShapeTracker) -> GraphTensor:
        return GraphTensor(self.graph, self.node, view, self.dtype)

    def _edge(self) -> Edge:
        return Edge(self.node, self.view)

    def _axis(self, axis: int) -> int:
        if not -self.ndim <= axis < self.ndim:
            raise IndexError(f"axis {axis} out of range for a {self.ndim}-d tensor")
        return axis % self.ndim

    # ------------------------------------------------------------------ view ops (no node)
    def permute(self, *order: int) -> GraphTensor:
        if len(order) == 1 and isinstance(order[0], (tuple, list)):
            order = tuple(order[0])
        return self._with(self.view.permute(order))

    def transpose(self, a: int = -2, b: int = -1) -> GraphTensor:
        order = list(range(self.ndim))
        a, b = self._axis(a), self._axis(b)
        order[a], order[b] = order[b], order[a]
        return self.permute(order)

    @property
    def T(self) -> GraphTensor:
        return self.transpose(-2, -1)

    def expand_dim(self, axis: int, size: ExprLike) -> GraphTensor:
        return self._with(self.view.expand_dim(axis, size))

    def unsqueeze(self, axis: int) -> GraphTensor:
        return self.expand_dim(axis, 1)

    def broadcast_to(self, shape: Sequence[ExprLike]) -> GraphTensor:
        return self._with(self.view.broadcast_to(shape))

    def reshape(self, *shape: ExprLike) -> GraphTensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        new = self.view.reshape(shape)
        if new is not None:
            return self._with(new)
        return self.contiguous()._with(ShapeTracker.contiguous(shape))

    def slice(self, axis: int, start: ExprLike, stop: ExprLike) -> GraphTensor:
        return self._with(self.view.slice(self._axis(axis), start, stop))

    def pad(self, axis: int, before: ExprLike, after: ExprLike) -> GraphTensor:
        return self._with(self.view.pad(self._axis(axis), before, after))

    def squeeze(self, axis: int) -> GraphTensor:
        axis = self._axis(axis)
        if self.shape[axis] != as_expr(1):
            raise ValueError(f"cannot squeeze axis {axis} of size {self.shape[axis]}")
        return self.reshape(self.shape[:axis] + self.shape[axis + 1:])

    # ------------------------------------------------------------------ node-creating helpers
    def contiguous(self) -> GraphTensor:
        node = self.graph.add("Contiguous", (self._edge(),), self.shape, self.dtype)
        return _out(self.graph, node.id, self.shape, self.dtype)

    def _unary(self, op: str) -> GraphTensor:
        if not self.dtype.is_float:
            raise TypeError(f"{op} needs a float tensor, got {self.dtype}")
        node = self.graph.add(op, (self._edge(),), self.shape, self.dtype)
        return _out(self.graph, node.id, self.shape, self.dtype)

    def cast(self, dtype: DType | str) -> GraphTensor:
        dtype = DType.parse(dtype) if isinstance(dtype, str) else dtype
        if dtype == self.dtype:
            return self
        node = self.graph.add("Cast", (self._edge(),), self.shape, dtype)
        return _out(self.graph, node.id, self.shape, dtype)

    def exp2(self) -> GraphTensor:
        return self._unary("Exp2")

    def log2(self) -> GraphTensor:
        return self._unary("Log2")

    def sin(self) -> GraphTensor:
        return self._unary("Sin")

    def sqrt(self) -> GraphTensor:
        return self._unary("Sqrt")

    def recip(self) -> GraphTensor:
        return self._unary("Recip")

    # composites of unary primops
    def exp(self) -> GraphTensor:
        return (self * LOG2E).exp2()

    def log(self) -> GraphTensor:
        return self.log2() * LN2

    def cos(self) -> GraphTensor:
        return (self + math.pi / 2).sin()

    def rsqrt(self) -> GraphTensor:
        return self.sqrt().recip()

    def sigmoid(self) -> GraphTensor:
        return _in_f32(self, lambda x: ((-x).exp() + 1.0).recip())

    def tanh(self) -> GraphTensor:
        return tanh(self)

    def silu(self) -> GraphTensor:
        return _in_f32(self, lambda x: x * x.sigmoid())

    def gelu(self) -> GraphTensor:
        """GELU, tanh approximation (as in Gemma's ``gelu_pytorch_tanh``)."""
        def f(x: GraphTensor) -> GraphTensor:
            inner = (x + x * x * x * 0.044715) * math.sqrt(2.0 / math.pi)
            return x * 0.5 * (tanh(inner) + 1.0)
        return _in_f32(self, f)

    def relu(self) -> GraphTensor:
        return maximum(self, 0.0)

    # ------------------------------------------------------------------ binary
    def _binary(self, op: str, other: GraphTensor | Scalar, reverse: bool = False) -> GraphTensor:
        a, b = self, _lift(self, other)
        if reverse:
            a, b = b, a
        a, b = broadcast(a, b)
        if a.dtype != b.dtype:
            raise TypeError(f"{op} of {a.dtype} and {b.dtype}: cast one side first")
        out_dtype = DType.bool if op == "LessThan" else a.dtype
        node = self.graph.add(op, (a._edge(), b._edge()), a.shape, out_dtype)
        return _out(self.graph, node.id, a.shape, out_dtype)

    def __add__(self, o):
        return self._binary("Add", o)

    def __radd__(self, o):
        return self._binary("Add", o, reverse=True)

    def __mul__(self, o):
        return self._binary("Mul", o)

    def __rmul__(self, o):
        return self._binary("Mul", o, reverse=True)

    def __neg__(self):
        return self * -1

    def __sub__(self, o):
        return self + (-o if isinstance(o, GraphTensor) else -o)

    def __rsub__(self, o):
        return (-self) + o

    def __truediv__(self, o):
        if isinstance(o, GraphTensor):
            return self * o.recip()
        return self * (1.0 / o)

    def __rtruediv__(self, o):
        return self.recip() * o

    def __mod__(self, o):
        return self._binary("Mod", o)

    def __rmod__(self, o):
        return self._binary("Mod", o, reverse=True)

    def __lt__(self, o):
        return self._binary("LessThan", o)

    def __gt__(self, o):
        return self._binary("LessThan", o, reverse=True)

    def __ge__(self, o):
        return logical_not(self < o)

    def __le__(self, o):
        return logical_not(self > o)

    # ------------------------------------------------------------------ reductions
    def _reduce(self, op: str, axis: int, keepdim: bool) -> GraphTensor:
        axis = self._axis(axis)
        shape = self.shape[:axis] + self.shape[axis + 1:]
        node = self.graph.add(op, (self._edge(),), shape, self.dtype, axis=axis)
        out = _out(self.graph, node.id, shape, self.dtype)
        return out.unsqueeze(axis) if keepdim else out

    def sum(self, axis: int = -1, keepdim: bool = False) -> GraphTensor:
        return self._reduce("SumReduce", axis, keepdim)

    def max(self, axis: int = -1, keepdim: bool = False) -> GraphTensor:
        return self._reduce("MaxReduce", axis, keepdim)

    def min(self, axis: int = -1, keepdim: bool = False) -> GraphTensor:
        return -((-self).max(axis, keepdim))

    def mean(self, axis: int = -1, keepdim: bool = False) -> GraphTensor:
        n = self.shape[self._axis(axis)]
        return self.sum(axis, keepdim) * _inv_dim(self, n)

    def var(self, axis: int = -1, keepdim: bool = False) -> GraphTensor:
        """Population variance (divides by n), as layer norms use."""
        centered = self - self.mean(axis, keepdim=True)
        return (centered * centered).mean(axis, keepdim)

    def softmax(self, axis: int = -1) -> GraphTensor:
        shifted = self - self.max(axis, keepdim=True)
        e = shifted.exp()
        return e / e.sum(axis, keepdim=True)

    def matmul(self, other: GraphTensor) -> GraphTensor:
        return matmul(self, other)

    __matmul__ = matmul


# ====================================================================== construction helpers
def _out(graph: Graph, node: int, shape: Shape, dtype: DType) -> GraphTensor:
    return GraphTensor(graph, node, ShapeTracker.contiguous(shape), dtype)


def _lift(like: GraphTensor, x: GraphTensor | Scalar) -> GraphTensor:
    if isinstance(x, GraphTensor):
        if x.graph is not like.graph:
            raise ValueError("tensors belong to different graphs")
        return x
    if isinstance(x, (bool, np.bool_)):
        x = int(x)
    if not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"cannot combine a GraphTensor with {type(x).__name__}")
    if not like.dtype.is_float and isinstance(x, (float, np.floating)) and not float(x).is_integer():
        raise TypeError(f"scalar {x} would be truncated to combine with a {like.dtype} tensor: cast first")
    return constant(like.graph, float(x) if like.dtype.is_float else int(x), like.dtype)


def _inv_dim(t: GraphTensor, n: Expr) -> GraphTensor | float:
    if n.is_const:
        return 1.0 / n.value
    # symbolic length: 1 / cast(n) through an Iota-free path: build n as a float tensor
    return dim_value(t.graph, n, t.dtype).recip()


def broadcast(a: GraphTensor, b: GraphTensor) -> tuple[GraphTensor, GraphTensor]:
    """numpy broadcasting of two tensors' views."""
    if a.shape == b.shape:
        return a, b
    n = max(a.ndim, b.ndim)
    sa = (as_expr(1),) * (n - a.ndim) + a.shape
    sb = (as_expr(1),) * (n - b.ndim) + b.shape
    out = []
    for x, y in zip(sa, sb):
        if x == y or y == as_expr(1):
            out.append(x)
        elif x == as_expr(1):
            out.append(y)
        else:
            raise ValueError(f"shapes [{','.join(map(str, a.shape))}] and [{','.join(map(str, b.shape))}] "
                             "do not broadcast")
    return a.broadcast_to(out), b.broadcast_to(out)


def input_tensor(graph: Graph, name: str, shape: Sequence[ExprLike], dtype: DType | str,
                 role: str = "input") -> GraphTensor:
    dtype = DType.parse(dtype) if isinstance(dtype, str) else dtype
    if role not in ("input", "weight", "state"):
        raise ValueError(f"unknown input role {role!r}")
    for n in graph.inputs():
        if n.attrs["name"] == name:
            raise ValueError(f"graph already has an input named {name!r}")
    shape = tuple(as_expr(d) for d in shape)
    node = graph.add("Input", (), shape, dtype, name=name, role=role)
    return _out(graph, node.id, shape, dtype)


def output(t: GraphTensor, name: str, role: str = "output") -> None:
    if role not in ("output", "state"):
        raise ValueError(f"unknown output role {role!r}")
    t.graph.add("Output", (t._edge(),), t.shape, t.dtype, name=name, role=role)


def constant(graph: Graph, value: Scalar, dtype: DType = DType.f32) -> GraphTensor:
    """A scalar constant (shape ``()``), broadcast by the ops that use it."""
    node = graph.add("Constant", (), (), dtype, value=value)
    return _out(graph, node.id, (), dtype)


def constant_table(graph: Graph, data: np.ndarray, dtype: DType = DType.f32) -> GraphTensor:
    """A small 1-D constant table (e.g. RoPE inverse frequencies), stored in the graph itself."""
    data = np.asarray(data, dtype=np.float64).reshape(-1)
    node = graph.add("Constant", (), (as_expr(len(data)),), dtype, data=tuple(float(x) for x in data))
    return _out(graph, node.id, (as_expr(len(data)),), dtype)


def arange(graph: Graph, n: ExprLike, dtype: DType = DType.i64) -> GraphTensor:
    n = as_expr(n)
    node = graph.add("Iota", (), (n,), DType.i64, n=n)
    return _out(graph, node.id, (n,), DType.i64).cast(dtype)


def dim_value(graph: Graph, n: ExprLike, dtype: DType = DType.f32) -> GraphTensor:
    """A symbolic dim as a scalar tensor: the last element of ``arange(n + 1)``."""
    n = as_expr(n)
    return arange(graph, n + 1, dtype).slice(0, n, n + 1).reshape(())


# ====================================================================== composites
def tanh(x: GraphTensor) -> GraphTensor:
    """tanh(x) = 2·σ(2x) − 1."""
    return _in_f32(x, lambda x: (x * 2.0).sigmoid() * 2.0 - 1.0)


def _in_f32(x: GraphTensor, fn) -> GraphTensor:
    """``fn(x)`` computed in f32 and rounded once for 16-bit floats, as PyTorch's activation kernels do:
    a composite of several primops would otherwise round after every one of them."""
    if x.dtype in (DType.bf16, DType.f16):
        return fn(x.cast(DType.f32)).cast(x.dtype)
    return fn(x)


def where(cond: GraphTensor, a: GraphTensor | Scalar, b: GraphTensor | Scalar) -> GraphTensor:
    if cond.dtype != DType.bool:
        raise TypeError(f"where needs a bool condition, got {cond.dtype}")
    like = a if isinstance(a, GraphTensor) else b
    if not isinstance(like, GraphTensor):
        raise TypeError("where needs at least one tensor branch")
    a, b = _lift(like, a), _lift(like, b)
    if a.dtype != b.dtype:
        raise TypeError(f"where branches differ in dtype: {a.dtype} and {b.dtype}")
    cond, a = broadcast(cond, a)
    cond, b = broadcast(cond, b)
    a, b = broadcast(a, b)
    node = cond.graph.add("Where", (cond._edge(), a._edge(), b._edge()), a.shape, a.dtype)
    return _out(cond.graph, node.id, a.shape, a.dtype)


def logical_not(x: GraphTensor) -> GraphTensor:
    return where(x, constant(x.graph, 0, DType.i32), constant(x.graph, 1, DType.i32)) > 0


def logical_and(a: GraphTensor, b: GraphTensor) -> GraphTensor:
    return where(a, b, constant(a.graph, 0, DType.i32) > 0)


ARGMAX_CHUNK = 1024      # a long row's argmax runs as chunks of at most this many, then over the chunks


def argmax(x: GraphTensor) -> GraphTensor:
    """Index (i32) of the first maximum along the last axis of a float ``x`` [..., n] with static n, as
    ``np.argmax`` (NaNs are never chosen). The index math runs in f32 (exact up to 2^24), so it stays in
    float reductions, and the indices are constant tables (no iota kernel per run). A row longer than
    ARGMAX_CHUNK is split into chunks so that many blocks share it (chunk length: the largest divisor of
    n in [ARGMAX_CHUNK / 4, ARGMAX_CHUNK], else ARGMAX_CHUNK with the row padded by −inf): the first index
    of each chunk's maximum, then the first among the chunks that hold the row's maximum."""
    n = x.shape[-1]
    if not n.is_const or n.value < 1:
        raise ValueError("argmax needs a static, non-empty last axis")
    g, n, lead = x.graph, n.value, x.shape[:-1]
    big = float(2 ** 24)

    def first_max(v: GraphTensor, idx: GraphTensor) -> tuple[GraphTensor, GraphTensor]:
        m = v.max(-1, keepdim=True)
        return m.squeeze(-1), where(v >= m, idx, big).min(-1)

    x = x.cast(DType.f32)
    if n <= ARGMAX_CHUNK:
        return first_max(x, constant_table(g, np.arange(n)))[1].cast(DType.i32)
    size = next((c for c in range(ARGMAX_CHUNK, ARGMAX_CHUNK // 4 - 1, -1) if n % c == 0), ARGMAX_CHUNK)
    chunks = -(-n // size)
    ones = [1] * len(lead)      # the index table in the rows' own rank, so that the reads of it are identities
    idx = (constant_table(g, np.arange(chunks) * size).reshape(*ones, chunks, 1)   # and it fuses into them
           + constant_table(g, np.arange(size)).reshape(*ones, 1, size))
    rows = x.pad(-1, 0, chunks * size - n).reshape(*lead, chunks, size)
    if chunks * size > n:
        rows = where(idx < float(n), rows, float("-inf"))
    m1, i1 = first_max(rows, idx)
    return first_max(m1, i1)[1].cast(DType.i32)


def maximum(a: GraphTensor, b: GraphTensor | Scalar) -> GraphTensor:
    b = _lift(a, b)
    return where(a < b, b, a)


def minimum(a: GraphTensor, b: GraphTensor | Scalar) -> GraphTensor:
    b = _lift(a, b)
    return where(b < a, b, a)


def matmul(a: GraphTensor, b: GraphTensor) -> GraphTensor:
    """Batched matmul ``a[..., m, k] @ b[..., k, n]`` as ``(a.expand(n) * bᵀ.expand(m)).sum(k)``."""
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError("matmul needs tensors of at least 2 dims")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul inner dims differ: {a.shape[-1]} and {b.shape[-2]}")
    m, n = a.shape[-2], b.shape[-1]
    batch_a, batch_b = a.shape[:-2], b.shape[:-2]
    nb = max(len(batch_a), len(batch_b))
    ba = (as_expr(1),) * (nb - len(batch_a)) + batch_a
    bb = (as_expr(1),) * (nb - len(batch_b)) + batch_b
    batch = tuple(x if y == as_expr(1) else y for x, y in zip(ba, bb))
    av = a.expand_dim(-2, n).broadcast_to(batch + (m, n, a.shape[-1]))      # [..., m, n, k]
    bv = b.transpose(-2, -1).expand_dim(-3, m).broadcast_to(batch + (m, n, a.shape[-1]))
    return (av * bv).sum(-1)


def linear(x: GraphTensor, weight: GraphTensor, bias: GraphTensor | None = None,
           out_dtype: DType | None = None) -> GraphTensor:
    """``x @ weightᵀ`` for a weight stored [out, in] (the Hugging Face layout).

    ``out_dtype`` (f32 for 16-bit ``x`` and ``weight``): the products are summed and returned in f32
    instead of being rounded to the 16-bit dtype — written as a matmul of widened operands, which
    rules/flatten.egg turns into a mixed-precision GEMM reading the 16-bit buffers."""
    if out_dtype is not None:
        x, weight = x.cast(out_dtype), weight.cast(out_dtype)
    y = matmul(x, weight.T)
    return y + bias.cast(y.dtype) if bias is not None else y


def rms_norm(x: GraphTensor, weight: GraphTensor | None, eps: float, add_one: bool = False,
             compute_dtype: DType = DType.f32, out_dtype: DType | None = None) -> GraphTensor:
    """RMSNorm over the last axis, normalised in ``compute_dtype``, returned in ``out_dtype`` (default:
    ``x``'s dtype).

    Llama style (default): ``w · cast(x̂)``; Gemma style (``add_one``): ``cast(x̂ · (1 + w))`` — the two
    round at different points, which matters in bf16. A compute-dtype ``x`` rounds once, at the end.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    xd = x.cast(compute_dtype)
    normed = xd * ((xd * xd).mean(-1, keepdim=True) + eps).rsqrt()
    if weight is None:
        return normed.cast(out_dtype)
    if add_one:
        return (normed * (weight.cast(compute_dtype) + 1.0)).cast(out_dtype)
    if x.dtype == compute_dtype:
        return (normed * weight.cast(compute_dtype)).cast(out_dtype)
    return (normed.cast(x.dtype) * weight.cast(x.dtype)).cast(out_dtype)


def layer_norm(x: GraphTensor, weight: GraphTensor | None, bias: GraphTensor | None, eps: float,
               compute_dtype: DType = DType.f32) -> GraphTensor:
    """LayerNorm over the last axis, computed in ``compute_dtype`` and rounded once (as torch does for bf16)."""
    xd = x.cast(compute_dtype)
    centered = xd - xd.mean(-1, keepdim=True)
    out = centered * ((centered * centered).mean(-1, keepdim=True) + eps).rsqrt()
    if weight is not None:
        out = out * weight.cast(compute_dtype)
    if bias is not None:
        out = out + bias.cast(compute_dtype)
    return out.cast(x.dtype)


def concat(tensors: Sequence[GraphTensor], axis: int) -> GraphTensor:
    """Concatenate along ``axis`` by padding each part to the full length and adding."""
    if not tensors:
        raise ValueError("concat of no tensors")
    axis = tensors[0]._axis(axis)
    total = as_expr(0)
    for t in tensors:
        total = total + t.shape[axis]
    out = None
    before = as_expr(0)
    for t in tensors:
        after = total - before - t.shape[axis]
        part = t.pad(axis, before, after)
        out = part if out is None else out + part
        before = before + t.shape[axis]
    return out


def gather(table: GraphTensor, idx: GraphTensor) -> GraphTensor:
    """Rows of ``table`` picked by integer ``idx`` (embedding lookup)."""
    if not idx.dtype.is_int:
        raise TypeError(f"gather indices must be integers, got {idx.dtype}")
    shape = idx.shape + table.shape[1:]
    node = table.graph.add("Gather", (table._edge(), idx._edge()), shape, table.dtype)
    return _out(table.graph, node.id, shape, table.dtype)


embedding = gather


def scatter(dest: GraphTensor, src: GraphTensor, idx: GraphTensor) -> GraphTensor:
    """A copy of ``dest`` whose rows ``idx[n]`` are replaced by ``src[n]`` (KV-cache write)."""
    if not idx.dtype.is_int:
        raise TypeError(f"scatter indices must be integers, got {idx.dtype}")
    if src.shape[1:] != dest.shape[1:] or idx.shape != src.shape[:1]:
        raise ValueError("scatter needs src [n, …rows of dest] and idx [n]")
    src = src.cast(dest.dtype)
    node = dest.graph.add("Scatter", (dest._edge(), src._edge(), idx._edge()), dest.shape, dest.dtype)
    return _out(dest.graph, node.id, dest.shape, dest.dtype)


def rope(x: GraphTensor, cos: GraphTensor, sin: GraphTensor) -> GraphTensor:
    """Rotary embedding, half-split layout (``rotate_half``): x·cos + rotate_half(x)·sin.

    ``x`` is [..., head_dim]; ``cos``/``sin`` (e.g. [seq, head_dim], or [seq, 1, head_dim] for x in
    [seq, heads, head_dim]) broadcast against it. rotate_half(x) = [−x2, x1] is written as
    [x2, x1]·[−1…, 1…] (a constant sign table): both halves are then reads of x's own buffer, so the
    rotation fuses into one kernel, and the values are the same (only signs flip)."""
    d = x.shape[-1]
    if not d.is_const or d.value % 2:
        raise ValueError("rope needs an even, static head dim")
    half = d.value // 2
    x1 = x.slice(-1, 0, half)
    x2 = x.slice(-1, half, d)
    sign = constant_table(x.graph, np.concatenate([-np.ones(half), np.ones(half)]), x.dtype)
    rotated = concat([x2, x1], axis=-1) * sign
    return x * cos + rotated * sin


def rope_tables(graph: Graph, positions: GraphTensor, inv_freq: np.ndarray,
                dtype: DType = DType.f32) -> tuple[GraphTensor, GraphTensor]:
    """cos/sin tables [seq, head_dim] for integer ``positions`` [seq] and ``inv_freq`` [head_dim/2]."""
    freqs = constant_table(graph, inv_freq, DType.f32)
    angles = positions.cast(DType.f32).unsqueeze(-1) * freqs.unsqueeze(0)  # [seq, half]
    emb = concat([angles, angles], axis=-1)
    return emb.cos().cast(dtype), emb.sin().cast(dtype)
