"""Reference interpreter: runs any HLIR graph with numpy.

Every node computes in float64 (int64 for integers) and its result is rounded to the node's dtype, so
the interpreter models storage precision while accumulating exactly enough to be the yardstick the
compiled kernels are checked against. Dyn dims are bound by a ``dyn_map``.
"""

from __future__ import annotations

import string
from typing import Mapping

import numpy as np

from lum.builder.hlir import Graph, Node
from lum.format.numerics import NumericsError, round_to, view_of
from lum.format.shapetracker import ShapeTracker

__all__ = ["ReferenceError", "NumericsError", "round_to", "view_of", "run_graph"]


# round_to / view_of live in lum.format.numerics so the loader's LLIR backend shares them; the
# interpreter's error type is the shared NumericsError under its historical name.
ReferenceError = NumericsError


def _einsum_sum_of_product(a: np.ndarray, b: np.ndarray, axis: int) -> np.ndarray:
    """Σ_axis a*b for broadcast views, dropping stride-0 dims so einsum can use BLAS."""
    letters = string.ascii_letters
    nd = a.ndim
    subs_out = "".join(letters[i] for i in range(nd) if i != axis)
    ops, subs = [], []
    keeps = [[i for i in range(nd) if not (x.strides[i] == 0 and x.shape[i] > 1)] for x in (a, b)]
    # a dim broadcast in both operands must stay in one of them: it is an output dim, or a reduced
    # dim whose extent multiplies the sum
    keeps[0] = [i for i in range(nd) if i in keeps[0] or i not in keeps[1]]
    for x, keep in zip((a, b), keeps):
        idx = tuple(slice(None) if i in keep else 0 for i in range(nd))
        ops.append(x[idx])
        subs.append("".join(letters[i] for i in keep))
    return np.einsum(f"{subs[0]},{subs[1]}->{subs_out}", *ops, optimize=True)


_UNARY = {
    "Exp2": np.exp2,
    "Log2": np.log2,
    "Sin": np.sin,
    "Sqrt": np.sqrt,
    "Recip": lambda x: 1.0 / x,
}


def run_graph(graph: Graph, inputs: Mapping[str, np.ndarray], dyn_map: Mapping[str, int] | None = None,
              ) -> dict[str, np.ndarray]:
    """Run ``graph``; returns every Output by name, as arrays of the output's dtype."""
    dyn_map = dict(dyn_map or {})
    needed = set(graph.dyn_vars)
    for n in graph.nodes:  # views can use dyn vars their shapes lack (e.g. a slice at offset p)
        for e in n.inputs:
            v = e.view
            for x in (*v.shape, *v.strides, v.offset, *(b for lh in (v.mask or ()) for b in lh)):
                needed |= x.vars()
    missing = sorted(needed - set(dyn_map))
    if missing:
        raise ReferenceError(f"dyn_map lacks {missing} for graph {graph.name!r}")
    consumers = graph.consumers()
    remaining = [len(c) for c in consumers]
    values: dict[int, np.ndarray] = {}
    deferred: dict[int, Node] = {}  # Mul nodes folded into their single SumReduce consumer
    results: dict[str, np.ndarray] = {}

    def arg(node: Node, k: int) -> np.ndarray:
        e = node.inputs[k]
        return view_of(values[e.src].reshape(-1), e.view, dyn_map)

    def release(node: Node) -> None:
        for e in node.inputs:
            remaining[e.src] -= 1
            if remaining[e.src] == 0:
                values.pop(e.src, None)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for node in graph.nodes:
            op = node.op
            if op == "Mul" and len(consumers[node.id]) == 1:
                user = graph.nodes[consumers[node.id][0]]
                if user.op == "SumReduce" and user.inputs[0].view == ShapeTracker.contiguous(node.shape):
                    deferred[node.id] = node
                    continue
            if op == "Output":
                results[node.attrs["name"]] = round_to(arg(node, 0), node.dtype).astype(node.dtype.np)
                release(node)
                continue
            if op == "SumReduce" and node.inputs[0].src in deferred:
                mul = deferred.pop(node.inputs[0].src)
                out = _einsum_sum_of_product(arg(mul, 0), arg(mul, 1), node.attrs["axis"])
                release(mul)
            else:
                out = _eval(node, arg, inputs, dyn_map)
                release(node)
            values[node.id] = np.ascontiguousarray(round_to(np.asarray(out), node.dtype))
    return results


def _eval(node: Node, arg, inputs: Mapping[str, np.ndarray], dyn_map: Mapping[str, int]) -> np.ndarray:
    op = node.op
    if op == "Input":
        name = node.attrs["name"]
        if name not in inputs:
            raise ReferenceError(f"missing input {name!r}")
        x = np.asarray(inputs[name])
        want = tuple(d.evaluate(dyn_map) for d in node.shape)
        if x.shape != want:
            raise ReferenceError(f"input {name!r} has shape {x.shape}, expected {want}")
        return x.astype(node.dtype.compute_np) if x.dtype != np.bool_ else x
    if op == "Constant":
        if "data" in node.attrs:
            return np.asarray(node.attrs["data"], dtype=np.float64)
        return np.asarray(node.attrs["value"], dtype=node.dtype.compute_np)
    if op == "Iota":
        return np.arange(node.attrs["n"].evaluate(dyn_map), dtype=np.int64)
    if op == "Cast":
        return arg(node, 0)  # round_to() applies the conversion
    if op in _UNARY:
        return _UNARY[op](arg(node, 0))
    if op == "Add":
        return arg(node, 0) + arg(node, 1)
    if op == "Mul":
        return arg(node, 0) * arg(node, 1)
    if op == "Mod":
        return np.mod(arg(node, 0), arg(node, 1))
    if op == "LessThan":
        return arg(node, 0) < arg(node, 1)
    if op == "Where":
        return np.where(arg(node, 0), arg(node, 1), arg(node, 2))
    if op == "SumReduce":
        return arg(node, 0).sum(axis=node.attrs["axis"])
    if op == "MaxReduce":
        return arg(node, 0).max(axis=node.attrs["axis"])
    if op == "Contiguous":
        return arg(node, 0)
    if op == "Gather":
        table, idx = arg(node, 0), arg(node, 1)
        if idx.size and (idx.min() < 0 or idx.max() >= table.shape[0]):
            raise ReferenceError(f"gather index out of range [0, {table.shape[0]})")
        return table[idx]
    if op == "Scatter":
        dest, src, idx = arg(node, 0), arg(node, 1), arg(node, 2)
        if idx.size and (idx.min() < 0 or idx.max() >= dest.shape[0]):
            raise ReferenceError(f"scatter index out of range [0, {dest.shape[0]})")
        out = np.array(dest, copy=True)
        out[idx] = src
        return out
    raise ReferenceError(f"no reference semantics for op {op!r}")
