"""HLIR: the graph of primitive ops every model is lowered to.

A :class:`Graph` is an append-only list of :class:`Node`; a node's inputs always precede it, so list
order is a topological order. Each input edge freezes the consumer's view of the producer as a
:class:`ShapeTracker` (views add no node). Every node writes a fresh contiguous buffer of ``shape``.

The primops (semantics as the reference interpreter in :mod:`lum.builder.reference` runs them):

========== ====================================================================================
Input      a named graph input; ``attrs``: ``name``, ``role`` (input | weight | state; ``ext`` in a
           standalone chunk graph: a value produced by another chunk)
Output     marks ``inputs[0]`` as a named output; ``attrs``: ``name``, ``role`` (output | state)
Constant   a scalar (``attrs['value']``), shape ``()``; or a small 1-D table (``attrs['data']``)
Iota       ``out[i] = i`` for ``i < attrs['n']`` (i64)
Cast       convert to ``dtype``
Exp2 Log2 Sin Sqrt Recip          unary elementwise
Add Mul Mod LessThan              binary elementwise on equal shapes (LessThan gives bool)
Where      ``cond ? a : b`` elementwise.  Added beyond the DESIGN list: a select written as
           ``c*a + (1-c)*b`` turns the ``-inf`` of attention masks into NaN (0·inf), so masking
           needs its own op.
SumReduce MaxReduce               reduce ``attrs['axis']`` of the input; output drops that axis
Gather     ``out[j…, r…] = table[idx[j…], r…]`` (embedding lookup): inputs (table, idx)
Scatter    ``out = dest; out[idx[n], r…] = src[n, r…]`` (KV-cache write): inputs (dest, src, idx)
Contiguous materialise the input view into a contiguous buffer
========== ====================================================================================
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

from lum.format.dtypes import DType
from lum.format.shapetracker import Shape, ShapeTracker

UNARY_OPS = ("Exp2", "Log2", "Sin", "Sqrt", "Recip")
BINARY_OPS = ("Add", "Mul", "Mod", "LessThan")
REDUCE_OPS = ("SumReduce", "MaxReduce")
PRIMOPS = ("Input", "Output", "Constant", "Iota", "Cast", *UNARY_OPS, *BINARY_OPS, "Where",
           *REDUCE_OPS, "Gather", "Scatter", "Contiguous")

INPUT_ROLES = ("input", "weight", "state", "ext")
OUTPUT_ROLES = ("output", "state")


@dataclass(frozen=True)
class Edge:
    """One input of a node: the producer and the view of its buffer that the consumer reads."""

    src: int
    view: ShapeTracker


@dataclass
class Node:
    id: int
    op: str
    inputs: tuple[Edge, ...]
    shape: Shape
    dtype: DType
    attrs: dict[str, Any] = field(default_factory=dict)
    chunk: int = 0

    def __repr__(self) -> str:
        ins = ", ".join(f"%{e.src}" for e in self.inputs)
        shape = ",".join(str(d) for d in self.shape)
        extra = "".join(f" {k}={v}" for k, v in self.attrs.items() if k != "data")
        return f"%{self.id} = {self.op}({ins}) : {self.dtype}[{shape}]{extra}"


class Graph:
    """An HLIR program: nodes in topological order, named inputs and outputs, chunk boundaries."""

    def __init__(self, name: str = "graph"):
        self.name = name
        self.nodes: list[Node] = []
        self._chunk = 0
        self.dyn_vars: set[str] = set()

    # ------------------------------------------------------------------ building
    def add(self, op: str, inputs: tuple[Edge, ...], shape: Shape, dtype: DType, **attrs: Any) -> Node:
        if op not in PRIMOPS:
            raise ValueError(f"unknown primop {op!r}")
        for e in inputs:
            if not 0 <= e.src < len(self.nodes):
                raise ValueError(f"input %{e.src} does not exist yet")
        node = Node(len(self.nodes), op, tuple(inputs), tuple(shape), dtype, dict(attrs), self._chunk)
        for d in node.shape:
            self.dyn_vars |= d.vars()
        self.nodes.append(node)
        return node

    def graph_break(self) -> None:
        """Start a new chunk: nodes created from now on belong to it (layer boundaries, cache writes)."""
        if self.nodes and self.nodes[-1].chunk == self._chunk:
            self._chunk += 1

    # ------------------------------------------------------------------ queries
    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, i: int) -> Node:
        return self.nodes[i]

    def inputs(self, role: str | None = None) -> list[Node]:
        return [n for n in self.nodes if n.op == "Input" and (role is None or n.attrs["role"] == role)]

    def outputs(self, role: str | None = None) -> list[Node]:
        return [n for n in self.nodes if n.op == "Output" and (role is None or n.attrs["role"] == role)]

    def input_named(self, name: str) -> Node:
        for n in self.inputs():
            if n.attrs["name"] == name:
                return n
        raise KeyError(f"graph {self.name!r} has no input {name!r}")

    def op_counts(self) -> Counter:
        return Counter(n.op for n in self.nodes)

    def consumers(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for n in self.nodes:
            for e in n.inputs:
                out[e.src].append(n.id)
        return out

    def dump(self) -> str:
        return "\n".join(repr(n) for n in self.nodes)
