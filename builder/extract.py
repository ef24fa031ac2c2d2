"""Extraction: pick one executable e-node per e-class of a saturated group, and lower it to LLIR.

A *choice* maps decision points (``sat.decisions``: reachable Op e-classes with more than one
feasible option) to an index into ``sat.options[class]``; classes with one option need no entry.
:func:`random_choice` draws one uniformly (for search genomes and property tests),
:func:`choose_by_cost` takes the cheapest under a per-op cost function (bottom-up, tree cost), and
:func:`lower` turns a choice into a :class:`lum.format.llir.Program`: ops in a valid topological
order (inputs first, outputs last), argument views decoded from the e-graph's ``Ld`` terms,
``alias`` for ScatterNoCopy, GEMM parameters as :class:`~lum.format.expr.Expr`, and ``bytes`` /
``flops`` per op.

Fusion. An Ld class may also hold an inline value (``XAdd`` …, rules/fuse.egg); choosing it means
that *fusing* consumers (elementwise ops, Sum / Max reductions and a scatter's src rows) recompute the
producer inside their own kernel: an elementwise consumer lowers to one ``Fused`` op whose
``params["expr"]`` is the expression tree over the reads that stay reads, a reduction to a reduce op
with the tree of its input in ``params["expr"]`` (a reduction with a fused prologue: ``sum(x*x)`` is
one kernel), a scatter to one with a prologue; row reductions (``XRowSum`` / ``XRowMax``) become
``RowSum`` / ``RowMax`` nodes of the tree (a row kernel). At most :data:`FUSE_MAX_NODES` nodes per
inlined read; a bigger one is read from the buffer. Every other consumer (gather, GEMMs, attention,
program outputs, a scatter's dest and indices) reads the producer's buffer, which is then emitted even
though its class chose the inline value. A ``KAttention`` node lowers to three ops (see
:func:`lower_attention`).

Choices are checked for acyclicity: :func:`random_choice` and :func:`choose_by_cost` only return
acyclic selections, and :func:`lower` raises :class:`ValueError` on a cyclic one.
"""

from __future__ import annotations

import heapq
import math
import random
from types import SimpleNamespace
from typing import Any, Callable, Mapping

from lum.builder import costmodel, epilogue, prologue, row_reads
from lum.builder.env_switches import env_choice
from lum.builder.egraph import FUSING_CONSUMERS, INLINE_OPS, ENode, SaturatedGroup, attention_views, fused_args
from lum.builder.rewrite import outputs_last
from lum.format.dtypes import DType
from lum.format.expr import Expr, as_expr, cdiv, smax
from lum.format.llir import Arg, LOp, Program
from lum.format.shapetracker import ShapeTracker, numel

__all__ = ["Choice", "random_choice", "choose_by_cost", "row_broadcast_reads", "lower", "lower_enode",
           "check_acyclic", "chosen", "describe_choice", "decision_points", "genome_to_choice",
           "choice_to_genome", "FUSE_MAX_NODES", "lower_attention", "attention_ops", "ATTENTION_CHUNK",
           "ATTENTION_CHUNKS", "FLASH_ATTENTION_CHUNK", "ENV_ATTENTION_CHUNK", "attention_chunk_default"]

Choice = dict  # class id -> option index

_ELEMENTWISE = {
    "KCast": "Cast", "KExp2": "Exp2", "KLog2": "Log2", "KSin": "Sin", "KSqrt": "Sqrt", "KRecip": "Recip",
    "KAdd": "Add", "KMul": "Mul", "KMod": "Mod", "KLessThan": "LessThan", "KWhere": "Where",
    "KContiguous": "Contiguous",
}
_INLINE = {"XCast": "Cast", "XExp2": "Exp2", "XLog2": "Log2", "XSin": "Sin", "XSqrt": "Sqrt", "XRecip": "Recip",
           "XAdd": "Add", "XMul": "Mul", "XMod": "Mod", "XLessThan": "LessThan", "XWhere": "Where",
           "XRowSum": "RowSum", "XRowMax": "RowMax"}
FUSE_MAX_NODES = 64   # the largest expression one inlined read may add to a consumer's kernel
ATTENTION_CHUNK = 16  # keys per split of decode attention (4 warps x 4 keys: short contexts still fill several
#                       blocks per KV head; 4,096 keys are 256 splits)
ATTENTION_CHUNKS = (ATTENTION_CHUNK, 32, 64)   # the splits the measured search chooses among
ENV_ATTENTION_CHUNK = "LUM_ATTENTION_CHUNK"


def attention_chunk_default() -> int:
    """``$LUM_ATTENTION_CHUNK`` (one of :data:`ATTENTION_CHUNKS`), else :data:`ATTENTION_CHUNK`: decode
    attention's split where the tuning does not set it, to measure a split by itself."""
    return env_choice(ENV_ATTENTION_CHUNK, {str(c): c for c in ATTENTION_CHUNKS}, str(ATTENTION_CHUNK))


FLASH_ATTENTION_CHUNK = 4096   # keys per split of flash attention (prefill): one chunk up to 4,096 keys, so the
#                       partials it stores for the combine are one row per query row (its row tiles fill the GPU)
_REDUCE = {"KSumReduce": "Sum", "KMaxReduce": "Max"}
_ARITY = {"KCast": 1, "KExp2": 1, "KLog2": 1, "KSin": 1, "KSqrt": 1, "KRecip": 1, "KContiguous": 1,
          "KAdd": 2, "KMul": 2, "KMod": 2, "KLessThan": 2, "KWhere": 3, "KSumReduce": 1, "KMaxReduce": 1,
          "KGather": 2, "KScatter": 3, "KScatterNoCopy": 3}


# ====================================================================== choices
def row_broadcast_reads(sat: SaturatedGroup) -> set[int]:
    """Ld classes that a reduction's prologue would read repeated along one of its kept (output) dims.

    Inlining such a read recomputes its producer once per output row: ``sum(rmsnorm(x) * W)`` over a
    weight's rows is a matvec that would re-normalise ``x`` for every row, and attention's ``q·k``
    would redo RoPE per key. Those stay reads of a buffer the producer writes once (and the matvec
    stays a GEMM, which loads its operands 16 bytes at a time). A reduction whose kept dims are all 1
    (RMSNorm's Σx²) or whose broadcast runs along the reduced axis (softmax's max) is not affected.
    """
    out: set[int] = set()
    one, zero = as_expr(1), as_expr(0)
    seen: set[tuple[int, int]] = set()
    for c in sat.reachable:
        for node in sat.options[c]:
            if node.op not in _REDUCE:
                continue
            axis = int(node.args[1])
            stack = [node.args[0]]
            while stack:
                k = stack.pop()
                if (k, axis) in seen:
                    continue
                seen.add((k, axis))
                v = sat.view(_ld(sat, k).args[1])
                if any(st == zero and d != one for i, (d, st) in enumerate(zip(v.shape, v.strides)) if i != axis):
                    out.add(k)
                    continue
                for x in sat.options[k]:
                    if x.op in INLINE_OPS:
                        stack.extend(_op_kids(sat, x))
    return out


def chosen(sat: SaturatedGroup, choice: Mapping[int, int], cls: int) -> ENode:
    """The e-node a choice selects for Op class ``cls``."""
    opts = sat.options[cls]
    if len(opts) == 1:
        return opts[0]
    return opts[choice.get(cls, 0)]


def _op_kids(sat: SaturatedGroup, node: ENode) -> list[int]:
    return [k for k in node.children() if sat.classes[k].sort == "Op"]


def _ld(sat: SaturatedGroup, cls: int) -> ENode:
    """The read node of an Ld class (the buffer read, whether or not the class chose an inline value)."""
    return next(n for n in sat.options[cls] if n.op == "Ld")


def _deps(sat: SaturatedGroup, choice: Mapping[int, int], cls: int) -> list[int]:
    """The classes the chosen node of ``cls`` depends on; for an inline value also the producer's buffer
    (a non-fusing consumer reads it), so an acyclic selection has a valid order either way."""
    node = chosen(sat, choice, cls)
    kids = _op_kids(sat, node)
    return kids + [_ld(sat, cls).args[0]] if node.op in INLINE_OPS else kids


class _Reads:
    """How a selection reads each Ld class: inline (its X node, in fusing consumers) or the buffer."""

    def __init__(self, sat: SaturatedGroup, choice: Mapping[int, int]):
        self.sat, self.choice = sat, choice
        self.size: dict[int, int] = {}  # Ld class -> expression nodes it adds when inlined (0: a leaf)

    def inline(self, cls: int) -> ENode | None:
        """The X node a fusing consumer recomputes for Ld class ``cls``, or None (it reads the buffer)."""
        if cls not in self.size:
            stack = [cls]
            while stack:  # sizes bottom-up, without recursion (chains can be long)
                c = stack[-1]
                node = chosen(self.sat, self.choice, c)
                if node.op not in INLINE_OPS:
                    self.size[stack.pop()] = 0
                    continue
                todo = [k for k in _op_kids(self.sat, node) if k not in self.size]
                if todo:
                    stack.extend(todo)
                    continue
                n = 1 + sum(self.size[k] for k in _op_kids(self.sat, node))
                self.size[stack.pop()] = n if n <= FUSE_MAX_NODES else 0
        return chosen(self.sat, self.choice, cls) if self.size[cls] else None

    def leaves(self, cls: int) -> list[int]:
        """The Ld classes a fusing consumer reads from buffers for its argument ``cls``."""
        x = self.inline(cls)
        if x is None:
            return [cls]
        return [leaf for k in _op_kids(self.sat, x) for leaf in self.leaves(k)]

    def buffer(self, cls: int) -> int:
        """The class whose buffer a read of ``cls`` needs: the producer of an Ld class, else ``cls``."""
        node = chosen(self.sat, self.choice, cls)
        return _ld(self.sat, cls).args[0] if node.op == "Ld" or node.op in INLINE_OPS else cls

    def deps(self, cls: int) -> list[int]:
        """The classes whose buffers the emitted op of ``cls`` reads."""
        node = chosen(self.sat, self.choice, cls)
        if node.op in FUSING_CONSUMERS:
            fused = fused_args(node)
            return [self.buffer(leaf) for k in node.args[:_ARITY[node.op]]
                    for leaf in (self.leaves(k) if k in fused else [k])]
        return [self.buffer(k) for k in _op_kids(self.sat, node)]


def _starts(sat: SaturatedGroup) -> list[int]:
    return [sat.node_class[n.id] for n in sat.graph.nodes if n.op == "Input"] + [c for _, c in sat.roots]


def check_acyclic(sat: SaturatedGroup, choice: Mapping[int, int]) -> list[int] | None:
    """None when the selection reachable from the program's inputs and outputs is acyclic, else a cycle."""
    state: dict[int, int] = {}  # 1 = on stack, 2 = done
    for start in _starts(sat):
        if state.get(start) == 2:
            continue
        stack: list[tuple[int, int]] = [(start, 0)]
        path: list[int] = [start]
        state[start] = 1
        while stack:
            c, i = stack[-1]
            kids = _deps(sat, choice, c)
            if i < len(kids):
                stack[-1] = (c, i + 1)
                k = kids[i]
                s = state.get(k)
                if s == 1:
                    return path[path.index(k):] + [k]
                if s is None:
                    state[k] = 1
                    stack.append((k, 0))
                    path.append(k)
            else:
                state[c] = 2
                stack.pop()
                path.pop()
    return None


def random_choice(sat: SaturatedGroup, rng: random.Random | int | None = None) -> Choice:
    """A uniformly random option at every decision point, redrawn until the selection is acyclic."""
    rng = rng if isinstance(rng, random.Random) else random.Random(rng)
    for _ in range(100):
        choice = {c: rng.randrange(len(sat.options[c])) for c in sat.decisions}
        cycle = check_acyclic(sat, choice)
        if cycle is None:
            return choice
        # redraw only the classes on the cycle, a few times, before starting over
        for _ in range(20):
            for c in cycle:
                if c in choice:
                    choice[c] = rng.randrange(len(sat.options[c]))
            cycle = check_acyclic(sat, choice)
            if cycle is None:
                return choice
    raise ValueError(f"no acyclic random selection found for graph {sat.graph.name!r}")


def decision_points(sat: SaturatedGroup) -> list[tuple[str, tuple[str, ...]]]:
    """The decision points for a measured search: (name, option labels) per ``sat.decisions`` entry.

    The name is the e-class id and the HLIR node it came from (``c17:%42``) when there is one; labels
    are the options' constructors (``Gemm:RmCm``, ``KSumReduce``, ``KScatterNoCopy`` …). Feed them
    to :class:`lum.builder.search.Decision`; a genome maps back with :func:`genome_to_choice`.
    """
    node_of = {}
    for nid, c in sat.node_class.items():
        node_of.setdefault(c, nid)
    out = []
    for c in sat.decisions:
        labels = tuple(f"Gemm:{n.args[0]}" if n.op == "Gemm" else n.op for n in sat.options[c])
        name = f"c{c}:%{node_of[c]}" if c in node_of else f"c{c}"
        out.append((name, labels))
    return out


def genome_to_choice(sat: SaturatedGroup, genome) -> Choice:
    """A genome (one option index per decision point, in ``sat.decisions`` order) as a choice."""
    if len(genome) != len(sat.decisions):
        raise ValueError(f"genome has {len(genome)} entries for {len(sat.decisions)} decision points")
    return {c: int(x) for c, x in zip(sat.decisions, genome)}


def choice_to_genome(sat: SaturatedGroup, choice: Mapping[int, int]) -> tuple[int, ...]:
    return tuple(int(choice.get(c, 0)) for c in sat.decisions)


def describe_choice(sat: SaturatedGroup, choice: Mapping[int, int]) -> dict[int, str]:
    """Decision point -> the chosen e-node's constructor (for logs and tests)."""
    return {c: chosen(sat, choice, c).op for c in sat.decisions}


# ====================================================================== cost-based choice
def choose_by_cost(sat: SaturatedGroup, cost_fn: Callable[[LOp], float] | None = None) -> Choice:
    """The cheapest selection under ``cost_fn(lop) -> float`` (default: :func:`lum.builder.costmodel.op_cost`).

    Bottom-up min-cost over the reachable classes: cost(class) = min over its options of
    cost_fn(option lowered on its own) + the cost of its Op children (tree cost: a class shared by
    two consumers counts twice, which favours options that read fewer intermediate buffers).
    """
    if cost_fn is None:
        cost_fn = costmodel.op_cost
    classes = sat.reachable
    repeated = row_broadcast_reads(sat)
    local: dict[tuple[int, int], float] = {}
    for c in classes:
        for j, node in enumerate(sat.options[c]):
            if node.op in INLINE_OPS and c in repeated:
                local[(c, j)] = math.inf                 # never chosen: see row_broadcast_reads
            elif node.op == "Ld" or node.op in INLINE_OPS:  # a read or an inline value: no kernel of its own
                local[(c, j)] = 0.0
            elif node.op == "KAttention":                 # the chunk partials and their combine
                parts = lower_attention(sat, node, lambda k: k)
                local[(c, j)] = float(sum(cost_fn(o) for o in parts if o.kind != "constant"))
            else:
                # lowered on its own: producers are named by their class ids
                local[(c, j)] = float(cost_fn(lower_enode(sat, c, node, lambda k: k)))
    # Knuth's generalisation of Dijkstra: an option is costed once all its Op children are final, and
    # the cheapest costed option of a not yet final class makes it final
    kids = {(c, j): _op_kids(sat, node) for c in classes for j, node in enumerate(sat.options[c])}
    waiting = {key: len(set(ks)) for key, ks in kids.items()}
    parents: dict[int, list[tuple[int, int]]] = {}
    for key, ks in kids.items():
        for k in set(ks):
            parents.setdefault(k, []).append(key)
    heap = [(local[key], key) for key, n in waiting.items() if n == 0 and local[key] < math.inf]
    heapq.heapify(heap)
    pick: dict[int, int] = {}
    best: dict[int, float] = {}
    while heap:
        tot, (c, j) = heapq.heappop(heap)
        if c in best:
            continue
        best[c], pick[c] = tot, j
        for key in parents.get(c, ()):
            waiting[key] -= 1
            if waiting[key] == 0 and key[0] not in best and local[key] < math.inf:
                heapq.heappush(heap, (local[key] + sum(best[k] for k in kids[key]), key))
    choice = {c: pick.get(c, 0) for c in sat.decisions}
    if check_acyclic(sat, choice) is not None:  # zero-cost ties can close a loop; break it randomly
        return random_choice(sat, 0)
    return choice


# ====================================================================== lowering
def _dlist(sat: SaturatedGroup, c: int) -> tuple[Expr, ...]:
    return sat.dlist(c)


def _gemm_params(sat: SaturatedGroup, node: ENode) -> dict[str, Any]:
    layout, _a, _b, m, n, k, lda, ldb, batch, sa, sb, oa, ob, _dt = node.args
    m, n, k, lda, ldb, batch, sa, sb, oa, ob = (sat.dim(x) for x in (m, n, k, lda, ldb, batch, sa, sb, oa, ob))
    one = as_expr(1)
    a_rm, b_rm = layout[:2] == "Rm", layout[2:] == "Rm"
    # a unit dim's stride is 0 in the e-graph (any value addresses it); use the smallest legal ld
    if a_rm and m == one:
        lda = smax(k, 1)
    if not a_rm and k == one:
        lda = smax(m, 1)
    if b_rm and k == one:
        ldb = smax(n, 1)
    if not b_rm and n == one:
        ldb = smax(k, 1)
    if batch == one:
        sa = sb = as_expr(0)
    return {"layout": layout, "m": m, "n": n, "k": k, "lda": lda, "ldb": ldb, "ldc": n, "batch": batch,
            "stride_a": sa, "stride_b": sb, "stride_c": m * n, "offset_a": oa, "offset_b": ob}


def lower_enode(sat: SaturatedGroup, cls: int, node: ENode, src_of: Callable[[int], int],
                shape_of: Callable[[int], tuple[Expr, ...]] | None = None, op_id: int = 0,
                inline: Callable[[int], ENode | None] | None = None) -> LOp:
    """One executable e-node as an LLIR op. ``src_of(class)`` gives the op id of a producer class;
    ``shape_of(class)`` its buffer shape (needed for GEMM operands' flat views); ``inline(ld class)``
    the X node a fusing op recomputes instead of reading that argument (then an elementwise op is
    ``Fused``, a reduce op gets ``params["expr"]``)."""
    g = sat.graph
    op = node.op
    a = node.args

    arg_dtypes: list[DType | None] = []

    def note(c: int) -> None:
        dt = sat.dtype.get(c)
        arg_dtypes.append(DType.parse(dt) if dt else None)

    def arg(c: int) -> Arg:
        ld = _ld(sat, c)
        note(c)
        return Arg(src_of(ld.args[0]), sat.view(ld.args[1]))

    leaves: list[int] = []  # the Ld classes a fused op reads from buffers: its args, first use first

    def tree(c: int) -> list:
        """The expression of argument ``c`` over ``leaves`` (the LLIR ``expr`` format)."""
        x = inline(c) if inline is not None else None
        if x is None:
            if c not in leaves:
                leaves.append(c)
            return ["arg", leaves.index(c)]
        return [_INLINE[x.op], x.args[-1], *(tree(kid) for kid in x.args[:-1])]

    if op in ("KInput", "KConstant"):
        hn = g.nodes[a[0]]
        shape, dtype = _dlist(sat, a[1]), DType.parse(a[2])
        if op == "KInput":
            lop = LOp(op_id, "input", "Input", (), shape, dtype,
                      {"name": hn.attrs["name"], "role": hn.attrs.get("role", "input")})
        elif "data" in hn.attrs:
            lop = LOp(op_id, "constant", "Constant", (), shape, dtype, {"data": list(hn.attrs["data"])})
        else:
            lop = LOp(op_id, "constant", "Constant", (), shape, dtype, {"value": hn.attrs["value"]})
    elif op == "KIota":
        nexpr = sat.dim(a[0])
        lop = LOp(op_id, "iota", "Iota", (), (nexpr,), DType.parse(a[1]), {"n": nexpr})
    elif op in _ELEMENTWISE and inline is not None and any(inline(c) for c in a[:_ARITY[op]]):
        k = _ARITY[op]
        expr = [_ELEMENTWISE[op], a[k + 1], *(tree(c) for c in a[:k])]
        lop = LOp(op_id, "elementwise", "Fused", tuple(arg(c) for c in leaves), _dlist(sat, a[k]),
                  DType.parse(a[k + 1]), {"expr": expr})
    elif op in _ELEMENTWISE:
        k = _ARITY[op]
        lop = LOp(op_id, "elementwise", _ELEMENTWISE[op], tuple(arg(c) for c in a[:k]), _dlist(sat, a[k]),
                  DType.parse(a[k + 1]))
    elif op in _REDUCE:
        x, axis, sh, dt = a
        sh = _dlist(sat, sh)
        params: dict[str, Any] = {"axis": int(axis)}
        if inline is not None and inline(x) is not None:  # a fused prologue: reduce the tree's values
            params["expr"] = tree(x)
        args = tuple(arg(c) for c in leaves) if "expr" in params else (arg(x),)
        lop = LOp(op_id, "reduce", _REDUCE[op], args, sh[:axis] + sh[axis + 1:], DType.parse(dt), params)
    elif op == "KGather":
        t, i, sh, dt = a
        ai = arg(i)
        lop = LOp(op_id, "gather", "Gather", (arg(t), ai), ai.view.shape + _dlist(sat, sh)[1:], DType.parse(dt))
    elif op in ("KScatter", "KScatterNoCopy"):
        d, s, i, sh, dt = a
        nocopy = op == "KScatterNoCopy"
        params = {}
        if inline is not None and inline(s) is not None:   # a fused prologue computes the rows
            params["expr"] = tree(s)
            args = (arg(d), *(arg(c) for c in leaves), arg(i))
        else:
            args = (arg(d), arg(s), arg(i))
        lop = LOp(op_id, "scatter_nocopy" if nocopy else "scatter", "ScatterNoCopy" if nocopy else "Scatter",
                  args, _dlist(sat, sh), DType.parse(dt), params, 0 if nocopy else None)
    elif op == "KAttention":
        raise ValueError("a KAttention e-node lowers to several ops: use lower_attention")
    elif op == "Gemm":
        params = _gemm_params(sat, node)
        args = []
        for c in (a[1], a[2]):
            shp = shape_of(c) if shape_of is not None else (as_expr(1),)
            note(c)
            args.append(Arg(src_of(c), ShapeTracker.contiguous((numel(shp),))))
        lop = LOp(op_id, "gemm", "Gemm", tuple(args), (params["batch"], params["m"], params["n"]),
                  DType.parse(a[13]), params)
    else:
        raise ValueError(f"e-node {op} is not executable")
    _set_bytes_flops(lop, arg_dtypes)
    return lop


def lower_attention(sat: SaturatedGroup, node: ENode, src_of: Callable[[int], int], op_id: int = 0,
                    chunk: int | None = None) -> list[LOp]:
    """A KAttention e-node as LLIR: the attention op (per-chunk partials, f32 [R…, NS, Dv + 2]), a −1
    constant and the reduce that combines the chunks, Σ_j 2^(c_j − max c)·acc_j / Σ_j 2^(c_j − max c)·l_j
    (a row kernel over the chunk axis), in that order from ``op_id``; the last op is the attention's value.
    Chunks of ``chunk`` keys for decode (default :data:`ATTENTION_CHUNK`: the split count, a decision of the
    measured search), of :data:`FLASH_ATTENTION_CHUNK` for flash attention (many query rows a K / V row: their
    row tiles, not the keys, spread the work)."""
    av = attention_views(sat, node)
    if av is None:
        raise ValueError("a KAttention e-node whose views are not an attention (builder/egraph.py)")
    q_ld, k_ld, v_ld, m_ld, cs, pdt, dt, _vp = node.args
    const = next(n for n in sat.options[cs] if n.op == "KConstant")
    scale = float(sat.graph.nodes[const.args[0]].attrs["value"])
    reads = zip((q_ld, k_ld, v_ld, m_ld), (av.q, av.k, av.v, av.mask))
    args = tuple(Arg(src_of(_ld(sat, c).args[0]), v) for c, v in reads)
    ops = attention_ops(args, scale, DType.parse(pdt), DType.parse(dt), op_id,
                        FLASH_ATTENTION_CHUNK if av.flash else chunk or attention_chunk_default())
    _set_bytes_flops(ops[0], [DType.parse(sat.dtype[c]) for c in (q_ld, k_ld, v_ld, m_ld)])
    _set_bytes_flops(ops[2], [DType.f32] * 4)
    return ops


def attention_ops(args: tuple[Arg, Arg, Arg, Arg], scale: float, p_dtype: DType, out_dtype: DType, op_id: int = 0,
                  chunk: int = ATTENTION_CHUNK) -> list[LOp]:
    """The LLIR of decode attention over reads (q [R…, D], k [R…, T, D], v [R…, T, Dv], mask [R…, T]): the
    attention op (chunk partials), a −1 constant and the combine reduce (ids from ``op_id``; see
    :func:`lower_attention`). Bytes and flops are left to the caller."""
    q, k, v = (a.view for a in args[:3])
    r, t, dv = tuple(q.shape[:-1]), k.shape[-2], v.shape[-1]
    ns = cdiv(t, chunk)
    part = LOp(op_id, "attention", "Attention", tuple(args), r + (ns, dv + 2), DType.f32,
               {"scale": float(scale), "chunk": int(chunk), "p_dtype": p_dtype.value})
    neg = LOp(op_id + 1, "constant", "Constant", (), (), DType.f32, {"value": -1.0})
    rstr = ShapeTracker.contiguous(r + (ns, dv + 2)).strides[:len(r)]
    dom, zero, width = r + (dv, ns), as_expr(0), dv + 2

    def over(d_stride: Expr, offset: Expr) -> Arg:
        return Arg(part.id, ShapeTracker(dom, rstr + (d_stride, width), offset, None))

    w = ["Exp2", "f32", ["Add", "f32", ["arg", 1], ["Mul", "f32", ["RowMax", "f32", ["arg", 1]], ["arg", 3]]]]
    norm = ["Recip", "f32", ["RowSum", "f32", ["Mul", "f32", w, ["arg", 2]]]]
    expr = ["Mul", "f32", ["Mul", "f32", w, ["arg", 0]], norm]
    comb = LOp(op_id + 2, "reduce", "Sum",
               (over(as_expr(1), zero), over(zero, dv), over(zero, dv + 1),
                Arg(neg.id, ShapeTracker(dom, (zero,) * len(dom), zero, None))),
               r + (dv,), out_dtype, {"axis": len(dom) - 1, "expr": expr})
    return [part, neg, comb]


def _set_bytes_flops(lop: LOp, arg_dtypes: list[DType | None]) -> None:
    """``bytes``/``flops`` from the cost model, with the producers' dtypes taken from the e-graph."""
    stub = SimpleNamespace(ops={a.src: SimpleNamespace(dtype=d or lop.dtype) for a, d in zip(lop.args, arg_dtypes)})
    lop.bytes, lop.flops = costmodel.op_bytes(lop, stub), costmodel.op_flops(lop)


def lower(sat: SaturatedGroup, choice: Mapping[int, int] | None = None, name: str | None = None,
          attention_chunk: int | None = None) -> Program:
    """The LLIR program of a selection (``choice`` defaults to option 0 everywhere), decode attention in
    chunks of ``attention_chunk`` keys (default :data:`ATTENTION_CHUNK`). Unless ``$LUM_GEMV_PROLOGUE`` is 0,
    decode GEMVs compute their input norms (:mod:`lum.builder.prologue`); unless ``$LUM_GEMV_EPILOGUE`` is 0,
    a GEMV stores its one elementwise reader's value, gate-up the gated activation (:mod:`lum.builder.epilogue`)."""
    choice = choice or {}
    cycle = check_acyclic(sat, choice)
    if cycle is not None:
        raise ValueError(f"the selection is cyclic through e-classes {cycle}")
    g = sat.graph
    reads = _Reads(sat, choice)
    ops: list[LOp] = []
    op_of: dict[int, int] = {}      # Op class -> LLIR op id
    shape_of: dict[int, tuple[Expr, ...]] = {}

    def emit(c: int) -> None:
        node = chosen(sat, choice, c)
        if node.op == "KAttention":
            *head, lop = lower_attention(sat, node, op_of.__getitem__, len(ops), attention_chunk)
            ops.extend(head)
        else:
            lop = lower_enode(sat, c, node, op_of.__getitem__, shape_of.__getitem__, len(ops), reads.inline)
        op_of[c] = lop.id
        shape_of[c] = lop.shape
        ops.append(lop)

    def visit(start: int) -> None:  # emit a buffer class after the buffers it reads
        stack: list[tuple[int, bool]] = [(start, False)]
        while stack:
            c, expanded = stack.pop()
            if c in op_of:
                continue
            if expanded:
                emit(c)
                continue
            stack.append((c, True))
            for k in reversed(reads.deps(c)):
                if k not in op_of:
                    stack.append((k, False))

    for n in g.nodes:  # every program input, in graph order, first
        if n.op == "Input":
            visit(sat.node_class[n.id])
    for _, c in sat.roots:  # outputs read buffers
        visit(reads.buffer(c))
    for nid, c in sat.roots:
        hn = g.nodes[nid]
        ld = _ld(sat, c)
        src = op_of[ld.args[0]]
        lop = LOp(len(ops), "output", "Output", (Arg(src, sat.view(ld.args[1])),), tuple(hn.shape), hn.dtype,
                  {"name": hn.attrs["name"], "role": hn.attrs.get("role", "output")})
        ops.append(lop)
    program = Program(name or g.name, ops)
    if row_reads.row_reads_enabled():
        program = row_reads.inline_row_reads(program)
    if prologue.gemv_prologues_enabled():
        program = prologue.fuse_gemv_prologues(program)
    if epilogue.gemv_epilogues_enabled():
        program = epilogue.fuse_gemv_epilogues(program)
    return outputs_last(program)
