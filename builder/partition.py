"""Partition an HLIR graph into chunks at its graph breaks, and group structurally identical chunks.

The frontend calls :meth:`Graph.graph_break` at layer boundaries (and around KV-cache writes); every
node records the chunk it was created in. :func:`partition` turns those indices into :class:`Chunk`
records with their interface (external input edges, outputs). :func:`structural_hash` names a chunk
by its structure alone — ops, dtypes, shapes, views, attributes, constant values — and not by the
names of its inputs, so the 32 decoder layers of a model, which differ only in their weights, get one
hash. :func:`group_chunks` collects chunks by hash; every later stage (e-graph saturation, search,
codegen, the tuning database) works once per group.

The hash is a sha256 over a canonical text (:func:`canonical_text`) built only from strings that are
the same in every process and on every machine: ``str(Expr)`` (canonical after simplification),
``ShapeTracker.key()``, dtype names, ``repr`` of floats and ints, and attribute dicts sorted by key.
It never uses Python's ``hash()``, ``id()`` or dict insertion order. Bump :data:`HASH_VERSION` when
the canonical text changes, so that tuning results recorded under old hashes are not reused.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence

import numpy as np

from lum.builder.hlir import Edge, Graph
from lum.format.dtypes import DType
from lum.format.expr import Expr
from lum.format.shapetracker import ShapeTracker

__all__ = ["Chunk", "Group", "partition", "canonical_text", "structural_hash", "group_chunks", "chunk_graph",
           "HASH_VERSION"]

HASH_VERSION = "lum-chunk-v1"

# Attributes that name things rather than describe structure; they never enter the hash.
_NAME_ATTRS = frozenset({"name"})


@dataclass(frozen=True)
class Chunk:
    """One piece of a partitioned graph.

    ``nodes``: ids of the chunk's nodes in graph (topological) order.
    ``inputs``: the distinct edges ``(src, view)`` from nodes of other chunks that the chunk's nodes
    read, in order of first use.
    ``outputs``: ids of the chunk's nodes read by a later chunk or by an Output node, ascending.
    """

    index: int
    nodes: tuple[int, ...]
    inputs: tuple[Edge, ...]
    outputs: tuple[int, ...]

    @property
    def input_nodes(self) -> tuple[int, ...]:
        """Distinct external producers, in order of first use (the ``ext k`` numbering of the hash)."""
        seen: dict[int, None] = {}
        for e in self.inputs:
            seen.setdefault(e.src, None)
        return tuple(seen)

    def __len__(self) -> int:
        return len(self.nodes)


@dataclass(frozen=True)
class Group:
    """Chunks with the same structural hash; ``representative`` (the first of them) is compiled once."""

    hash: str
    chunks: tuple[int, ...]
    representative: Chunk

    def __len__(self) -> int:
        return len(self.chunks)


# ====================================================================== partition
def partition(graph: Graph) -> list[Chunk]:
    """The graph's chunks in order; empty chunk indices (none in graphs built by the frontend) are skipped."""
    nodes = graph.nodes
    chunk_of = [n.chunk for n in nodes]
    for prev, cur in zip(nodes, nodes[1:]):
        if cur.chunk < prev.chunk:
            raise ValueError(f"graph {graph.name!r}: node %{cur.id} is in chunk {cur.chunk} after node "
                             f"%{prev.id} of chunk {prev.chunk}; chunk indices must not decrease")

    members: dict[int, list[int]] = {}
    ext_inputs: dict[int, dict[Edge, None]] = {}
    is_output: set[int] = set()
    for n in nodes:
        members.setdefault(n.chunk, []).append(n.id)
        ins = ext_inputs.setdefault(n.chunk, {})
        for e in n.inputs:
            if chunk_of[e.src] != n.chunk:
                ins.setdefault(e, None)
                is_output.add(e.src)
            elif n.op == "Output":
                is_output.add(e.src)

    out: list[Chunk] = []
    for index in sorted(members):
        ids = members[index]
        outs = tuple(i for i in ids if i in is_output)
        out.append(Chunk(index, tuple(ids), tuple(ext_inputs[index]), outs))
    return out


# ====================================================================== canonical text and hash
def canonical_text(graph: Graph, chunk: Chunk) -> str:
    """The text :func:`structural_hash` digests; one line per node, then one line for the outputs.

    Nodes of the chunk are numbered by position (``%0``, ``%1`` …). An edge from outside the chunk
    becomes ``ext k <dtype>[<shape>]`` where k numbers the distinct external producers in order of
    first use, followed like every edge by the view it reads. Input nodes print their role, shape and
    dtype but not their name.
    """
    local = {nid: k for k, nid in enumerate(chunk.nodes)}
    ext: dict[int, int] = {}
    lines = [HASH_VERSION]
    for nid in chunk.nodes:
        node = graph.nodes[nid]
        args = []
        for e in node.inputs:
            if e.src in local:
                ref = f"%{local[e.src]}"
            else:
                k = ext.setdefault(e.src, len(ext))
                prod = graph.nodes[e.src]
                ref = f"ext {k} {prod.dtype}[{_shape(prod.shape)}]"
            args.append(f"{ref} {e.view.key()}")
        attrs = ",".join(f"{k}={_canon(v)}" for k, v in sorted(node.attrs.items()) if k not in _NAME_ATTRS)
        lines.append(f"%{local[nid]} = {node.op}({'; '.join(args)}) : {node.dtype}[{_shape(node.shape)}] "
                     f"{{{attrs}}}")
    lines.append("out " + ",".join(f"%{local[i]}" for i in chunk.outputs))
    return "\n".join(lines) + "\n"


def structural_hash(graph: Graph, chunk: Chunk) -> str:
    """sha256 hex digest of :func:`canonical_text`: equal for chunks that differ only in input names."""
    return hashlib.sha256(canonical_text(graph, chunk).encode("utf-8")).hexdigest()


def group_chunks(graph: Graph, chunks: Sequence[Chunk] | None = None) -> list[Group]:
    """Chunks grouped by structural hash; groups ordered by their first chunk, chunks ascending."""
    chunks = partition(graph) if chunks is None else list(chunks)
    by_hash: dict[str, list[Chunk]] = {}
    for c in chunks:
        by_hash.setdefault(structural_hash(graph, c), []).append(c)
    groups = [Group(h, tuple(c.index for c in cs), cs[0]) for h, cs in by_hash.items()]
    groups.sort(key=lambda g: g.chunks[0])
    return groups


# ====================================================================== standalone chunk graphs
def chunk_graph(graph: Graph, chunk: Chunk) -> Graph:
    """A standalone HLIR graph for one chunk: what a group's e-graph is built from.

    Each external producer (``chunk.input_nodes``, in that order) becomes an Input node ``ext{k}``
    (role ``"ext"``) with the producer's shape and dtype, placed first; the chunk's nodes follow in
    order, reading through the same views. Output nodes of the chunk are kept (name and role); every
    other chunk output (``chunk.outputs``: read by a later chunk or by an Output elsewhere) gets an
    Output ``out{j}`` (role ``"output"``, j its index in ``chunk.outputs``) reading its whole buffer.
    Two chunks of one group give graphs that differ only in input names.
    """
    g = Graph(f"{graph.name}.chunk{chunk.index}")
    remap: dict[int, int] = {}
    for k, src in enumerate(chunk.input_nodes):
        prod = graph.nodes[src]
        remap[src] = g.add("Input", (), prod.shape, prod.dtype, name=f"ext{k}", role="ext").id
    kept_outputs: set[int] = set()
    for nid in chunk.nodes:
        n = graph.nodes[nid]
        inputs = tuple(Edge(remap[e.src], e.view) for e in n.inputs)
        remap[nid] = g.add(n.op, inputs, n.shape, n.dtype, **n.attrs).id
        if n.op == "Output":
            kept_outputs.add(n.inputs[0].src)
    read_later = _read_outside(graph, chunk)
    for j, nid in enumerate(chunk.outputs):
        if nid in read_later or nid not in kept_outputs:
            n = graph.nodes[nid]
            g.add("Output", (Edge(remap[nid], ShapeTracker.contiguous(n.shape)),), n.shape, n.dtype,
                  name=f"out{j}", role="output")
    return g


def _read_outside(graph: Graph, chunk: Chunk) -> set[int]:
    """Nodes of ``chunk`` read by a node of another chunk."""
    members = set(chunk.nodes)
    out: set[int] = set()
    for n in graph.nodes:
        if n.chunk != chunk.index:
            for e in n.inputs:
                if e.src in members:
                    out.add(e.src)
    return out


# ====================================================================== helpers
def _shape(shape: Sequence[Expr]) -> str:
    return ",".join(str(d) for d in shape)


def _canon(v: Any) -> str:
    """A type-tagged canonical text for an attribute value; refuses types without a stable form."""
    if v is None:
        return "none"
    if isinstance(v, (bool, np.bool_)):
        return "b:1" if v else "b:0"
    if isinstance(v, DType):
        return f"t:{v.value}"
    if isinstance(v, Enum):
        return f"e:{type(v).__name__}.{v.name}"
    if isinstance(v, (int, np.integer)):
        return f"i:{int(v)}"
    if isinstance(v, (float, np.floating)):
        x = float(v)
        if math.isnan(x):
            return "f:nan"
        return f"f:{x!r}"  # shortest round-trip repr: identical everywhere, keeps -0.0 and inf
    if isinstance(v, str):
        return f"s:{len(v)}:{v}"
    if isinstance(v, Expr):
        return f"x:{v}"
    if isinstance(v, ShapeTracker):
        return f"v:{v.key()}"
    if isinstance(v, np.ndarray):
        arr = np.ascontiguousarray(v)
        digest = hashlib.sha256(arr.tobytes()).hexdigest()
        return f"a:{arr.dtype.str}:{'x'.join(map(str, arr.shape))}:{digest}"
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_canon(x) for x in v) + ")"
    if isinstance(v, (set, frozenset)):
        return "{" + ",".join(sorted(_canon(x) for x in v)) + "}"
    if isinstance(v, dict):
        items = sorted((_canon(k), _canon(x)) for k, x in v.items())
        return "{" + ",".join(f"{k}:{x}" for k, x in items) + "}"
    raise TypeError(f"attribute value of type {type(v).__name__} has no canonical form for hashing")
