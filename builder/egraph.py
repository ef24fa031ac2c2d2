"""HLIR group → egglog e-graph → saturation with the rule files → a Python-side saturated e-graph.

One group (a standalone HLIR graph, see :func:`lum.builder.partition.chunk_graph`) becomes one egglog
program. The term language and the rules are data: ``rules/*.egg`` in the ``lum.rules`` package,
parsed once per process and loaded once into a base e-graph; each group runs between ``(push)`` and
``(pop)`` of it (≈1 ms instead of ≈35 ms to re-run the rule definitions). Loading follows the fast
path the egglog prototype measured (``scratch/egglog_proto/NOTES.md``): dims, dim lists, masks and
views are hash-consed in Python, written as primitive-only TSV rows, bulk-loaded with
``(input Rel "file")`` and turned into terms by the ``build`` ruleset; the schedule in
``rules/schedule.egg`` runs the staged rulesets; the e-graph is read back with ``freeze()``.
Every view is normalised first: unit dims get stride 0 (so broadcast checks in the rules accept them).

Semantics (see ``rules/terms.egg``): every Op e-class is the flat contiguous buffer a node writes;
consumers read it through ``(Ld op view)``. Only kernel ops (``K*``, ``KAttention`` of
rules/attention.egg among them), ``Gemm``, ``Ld`` and the inline values ``X*`` (in Ld classes that an
elementwise, reduce or scatter kernel op may recompute, rules/fuse.egg and rules/rows.egg) are
executable; HLIR constructors and fuse.egg's helper terms (``Thru``, ``ZeroStrides``) are not.
:class:`SaturatedGroup` keeps, per Op e-class, its feasible executable e-nodes (``options``; checks
the rules cannot make drop some here: row values where no row kernel reads them, in-place scatters
that would race with their own inline src, attentions whose views are not one); classes with more
than one are the extraction's decision points.

    sat = saturate(graph)          # SaturatedGroup
    sat.decisions                  # [class id, ...] with > 1 option
    sat.stats                      # e-classes, e-nodes, seconds, rule matches
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Iterable

from lum.builder.attention_policy import ATTENTION_MAX_GROUP, flash_attention_enabled, flash_features_fit
from lum.builder.hlir import BINARY_OPS, REDUCE_OPS, UNARY_OPS, Graph
from lum.format.expr import Expr, as_expr, parse
from lum.format.llir import ELEMENTWISE_ARITY
from lum.format.shapetracker import ShapeTracker, contiguous_strides, numel

__all__ = ["RULE_FILES", "SCHEDULE_FILE", "ENode", "EClass", "SaturatedGroup", "saturate", "encode_rows",
           "EXECUTABLE", "KERNEL_OPS", "INLINE_OPS", "ROW_INLINE_OPS", "ELEMENTWISE_KERNELS",
           "FUSING_CONSUMERS",
           "fused_args", "attention_views", "AttentionViews", "ATTENTION_MAX_GROUP",
           "rule_text"]

RULE_FILES = ("terms.egg", "build.egg", "dtype.egg", "lower.egg", "fuse.egg", "rows.egg", "attention.egg",
              "flatten.egg", "gemm.egg", "inplace.egg")
SCHEDULE_FILE = "schedule.egg"

# Executable constructors: what extraction may pick for an Op e-class.
KERNEL_OPS = frozenset({
    "KInput", "KConstant", "KIota", "KCast", "KExp2", "KLog2", "KSin", "KSqrt", "KRecip", "KAdd", "KMul",
    "KMod", "KLessThan", "KWhere", "KSumReduce", "KMaxReduce", "KGather", "KScatter", "KScatterNoCopy",
    "KContiguous", "KAttention", "Gemm",
})
ELEMENTWISE_KERNELS = frozenset({"KCast", "KExp2", "KLog2", "KSin", "KSqrt", "KRecip", "KAdd", "KMul", "KMod",
                                 "KLessThan", "KWhere", "KContiguous"})
# Kernel ops that may recompute an inline value instead of reading its buffer (builder/extract.py), and
# which of their arguments: every operand of an elementwise op, a reduction's input, a scatter's src rows
# (the KV-cache write computes RoPE and the cast to the cache dtype; never its destination or indices).
FUSING_CONSUMERS = ELEMENTWISE_KERNELS | {"KSumReduce", "KMaxReduce", "KScatter", "KScatterNoCopy"}


def fused_args(node: ENode) -> tuple[int, ...]:
    """The e-class arguments of a fusing consumer that it may recompute inline (none for other ops)."""
    if node.op in ELEMENTWISE_KERNELS:
        return tuple(node.args[:ELEMENTWISE_ARITY[node.op[1:]]])
    if node.op in ("KSumReduce", "KMaxReduce"):
        return (node.args[0],)
    if node.op in ("KScatter", "KScatterNoCopy"):
        return (node.args[1],)
    return ()


# Inline values (rules/fuse.egg): in Ld classes, the alternative to reading the producer's buffer.
ROW_INLINE_OPS = frozenset({"XRowSum", "XRowMax"})   # row reductions (rules/rows.egg): row kernels only
INLINE_OPS = frozenset({"XCast", "XExp2", "XLog2", "XSin", "XSqrt", "XRecip", "XAdd", "XMul", "XMod",
                        "XLessThan", "XWhere"}) | ROW_INLINE_OPS
EXECUTABLE = KERNEL_OPS | INLINE_OPS | {"Ld"}
# Id constructors of the bulk load (rules/terms.egg): never e-nodes of the program.
_ID_CTORS = frozenset({"N", "Ai", "Di", "Li", "Mi", "Vi"})
_PRIM = {"i64": "value_to_i64", "f64": "value_to_f64", "String": "value_to_string", "bool": "value_to_bool"}


# ====================================================================== rules (parsed once)
def rule_text(name: str) -> str:
    """The text of one rule file of the ``lum.rules`` package."""
    return resources.files("lum.rules").joinpath(name).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def _parsed() -> tuple[list, list]:
    from egglog import bindings as b

    eg = b.EGraph()
    rules: list = []
    for name in RULE_FILES:  # one parse per file: parse_program's cost grows with text length squared
        rules += eg.parse_program(rule_text(name), filename=name)
    schedule = eg.parse_program(rule_text(SCHEDULE_FILE), filename=SCHEDULE_FILE)
    return rules, schedule


_BASE: dict[str, Any] = {}
_LOCK = threading.Lock()


def _base_egraph():
    """One e-graph per process with the rules loaded (~35 ms); each group runs between (push)/(pop)."""
    eg = _BASE.get("eg")
    if eg is None:
        from egglog import bindings as b

        rules, _ = _parsed()
        eg = b.EGraph()
        eg.run_program(*rules)
        _BASE["eg"] = eg
        _BASE["push"] = eg.parse_program("(push)")
        _BASE["pop"] = eg.parse_program("(pop)")
    return eg


# ====================================================================== Python-side e-graph
_BUSY = object()


class _Cycle(Exception):
    pass


@dataclass(frozen=True)
class ENode:
    """One e-node: constructor name and arguments. ``args`` holds Python literals (int, str, float)
    for primitive-sorted arguments and e-class ids (int) for the rest; ``kids`` lists the e-class
    arguments' positions."""

    op: str
    args: tuple
    kids: tuple[int, ...]  # positions in args that are e-class ids

    def children(self) -> tuple[int, ...]:
        return tuple(self.args[i] for i in self.kids)


@dataclass
class EClass:
    id: int
    sort: str
    nodes: list[ENode] = field(default_factory=list)


@dataclass
class SaturatedGroup:
    """A saturated e-graph of one group, read back into Python.

    ``node_class[i]``: the e-class of HLIR node ``i`` (every node but Outputs); ``edge_class[(i, k)]``:
    the Ld e-class of input edge ``k`` of node ``i``; ``roots``: (Output node id, Ld class) pairs;
    ``options[c]``: the feasible executable e-nodes of Op class ``c`` in a fixed order (choices index
    into it); ``decisions``: reachable Op classes with more than one option, ascending.
    """

    graph: Graph
    classes: list[EClass]
    node_class: dict[int, int]
    edge_class: dict[tuple[int, int], int]
    roots: list[tuple[int, int]]
    dtype: dict[int, str]
    options: dict[int, list[ENode]]
    decisions: list[int]
    reachable: set[int]
    matches: dict[str, int]
    stats: dict[str, Any]
    _memo: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ queries
    @property
    def num_eclasses(self) -> int:
        return len(self.classes)

    @property
    def num_enodes(self) -> int:
        return sum(len(c.nodes) for c in self.classes)

    def enodes(self, op: str | None = None) -> Iterable[tuple[int, ENode]]:
        """(class, e-node) pairs, optionally only of constructor ``op``."""
        for c in self.classes:
            for n in c.nodes:
                if op is None or n.op == op:
                    yield c.id, n

    def fired(self, rule: str) -> int:
        """How often rule ``rule`` (its :name) matched during saturation."""
        return self.matches.get(rule, 0)

    def class_of(self, node_id: int) -> int:
        return self.node_class[node_id]

    # ------------------------------------------------------------------ decoding data classes
    def dim(self, c: int) -> Expr:
        """The symbolic value of a Dim e-class (DC, then DE, then a DMul product)."""
        key = ("dim", c)
        memo = self._memo
        if key in memo:
            v = memo[key]
            if v is _BUSY:
                raise _Cycle
            return v
        memo[key] = _BUSY  # (DMul (DC 1) x) is in x's own class
        out = None
        try:
            for n in sorted(self.classes[c].nodes, key=lambda n: {"DC": 0, "DE": 1}.get(n.op, 2)):
                if n.op == "DC":
                    out = as_expr(n.args[0])
                elif n.op == "DE":
                    out = parse(n.args[0])
                elif n.op == "DMul":
                    try:
                        out = self.dim(n.args[0]) * self.dim(n.args[1])
                    except _Cycle:
                        continue
                if out is not None:
                    break
        finally:
            if out is None:
                del memo[key]
        if out is None:
            raise _Cycle if any(v is _BUSY for v in memo.values()) else ValueError(
                f"Dim e-class {c} has no decodable e-node")
        memo[key] = out
        return out

    def dlist(self, c: int) -> tuple[Expr, ...]:
        key = ("dlist", c)
        if key not in self._memo:
            out: list[Expr] = []
            cur = c
            while True:
                node = next((n for n in self.classes[cur].nodes if n.op in ("DNil", "DCons")), None)
                if node is None:
                    raise ValueError(f"DList e-class {cur} has no list e-node")
                if node.op == "DNil":
                    break
                out.append(self.dim(node.args[0]))
                cur = node.args[1]
            self._memo[key] = tuple(out)
        return self._memo[key]

    def view(self, c: int) -> ShapeTracker:
        key = ("view", c)
        if key not in self._memo:
            node = next(n for n in self.classes[c].nodes if n.op == "V")
            sh, st, off, mk = node.args
            mnode = next(n for n in self.classes[mk].nodes if n.op in ("NoMask", "MaskLH"))
            mask = None
            if mnode.op == "MaskLH":
                mask = tuple(zip(self.dlist(mnode.args[0]), self.dlist(mnode.args[1])))
            self._memo[key] = ShapeTracker(self.dlist(sh), self.dlist(st), self.dim(off), mask)
        return self._memo[key]


# ====================================================================== encoding
def _normalise(view: ShapeTracker) -> ShapeTracker:
    """Unit dims get stride 0 (their stride is never used), so broadcast checks accept them."""
    one = as_expr(1)
    if not any(d == one for d in view.shape):
        return view
    strides = tuple(as_expr(0) if d == one else s for d, s in zip(view.shape, view.strides))
    return ShapeTracker(view.shape, strides, view.offset, view.mask)


def _full_view(view: ShapeTracker, producer_shape: tuple[Expr, ...]) -> bool:
    """The view reads the producer's whole buffer contiguously, in order (a unit dim's stride is
    never used, so it may be anything)."""
    one = as_expr(1)
    return (view.mask is None and view.offset == as_expr(0)
            and all(d == one or s == c for d, s, c in zip(view.shape, view.strides, contiguous_strides(view.shape)))
            and numel(view.shape) == numel(producer_shape))


def _row_broadcast(view: ShapeTracker) -> bool:
    """The (normalised) view reads a reduce over the last axis of its own shape, broadcast along that axis:
    offset 0, no mask, the reduce output's row-major strides (unit dims 0) and 0 for the last dim."""
    if view.ndim == 0 or view.mask is not None or view.offset != as_expr(0):
        return False
    one, zero = as_expr(1), as_expr(0)
    rows = contiguous_strides(view.shape[:-1])
    want = tuple(zero if d == one else s for d, s in zip(view.shape[:-1], rows)) + (zero,)
    return tuple(view.strides) == want


class _Rows:
    """Hash-consed rows of the bulk-load relations (rules/build.egg)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[tuple]] = defaultdict(list)
        self.dims: dict[Expr, int] = {}
        self.lists: dict[tuple, int] = {}
        self.masks: dict[Any, int] = {}
        self.views: dict[ShapeTracker, int] = {}
        self.prods: set[tuple[int, int]] = set()

    def dim(self, e: Expr) -> int:
        e = as_expr(e)
        i = self.dims.get(e)
        if i is None:
            i = self.dims[e] = len(self.dims)
            if e.is_const:
                self.rows["RDC"].append((i, e.value))
            else:
                text = str(e)
                if "\t" in text or "\n" in text:  # pragma: no cover - Expr text never has them
                    raise ValueError(f"expression text {text!r} cannot go into a TSV row")
                self.rows["RDE"].append((i, text))
        return i

    def dlist(self, xs: tuple[Expr, ...]) -> int:
        xs = tuple(as_expr(x) for x in xs)
        i = self.lists.get(xs)
        if i is None:
            if xs:
                head, tail = self.dim(xs[0]), self.dlist(xs[1:])
                i = self.lists[xs] = len(self.lists)
                self.rows["RLCons"].append((i, head, tail))
            else:
                i = self.lists[xs] = len(self.lists)
                self.rows["RLNil"].append((i,))
        return i

    def mask(self, m) -> int:
        i = self.masks.get(m)
        if i is None:
            if m is None:
                i = self.masks[m] = len(self.masks)
                self.rows["RNoMask"].append((i,))
            else:
                lo, hi = self.dlist(tuple(x for x, _ in m)), self.dlist(tuple(y for _, y in m))
                i = self.masks[m] = len(self.masks)
                self.rows["RMask"].append((i, lo, hi))
        return i

    def view(self, v: ShapeTracker) -> int:
        i = self.views.get(v)
        if i is None:
            sh, st, off, mk = self.dlist(v.shape), self.dlist(v.strides), self.dim(v.offset), self.mask(v.mask)
            # every stride*size product a flatten rule may compare with an outer stride
            for d, s in zip(v.shape, v.strides):
                key = (self.dim(s), self.dim(d))
                if key not in self.prods:
                    self.prods.add(key)
                    self.rows["RDProd"].append((key[0], key[1], self.dim(s * d)))
            i = self.views[v] = len(self.views)
            self.rows["RView"].append((i, sh, st, off, mk))
            if _row_broadcast(v):
                self.rows["RRowBcast"].append((i, sh, v.ndim - 1))
        return i


def encode_rows(graph: Graph) -> tuple[dict[str, list[tuple]], dict[tuple[int, int], int]]:
    """The bulk-load rows of a standalone group graph, and the operand id of every input edge."""
    r = _Rows()
    rows = r.rows
    operands: dict[tuple[int, int], int] = {}  # (producer, view id) -> operand id
    edge_operand: dict[tuple[int, int], int] = {}
    nodes = graph.nodes
    for n in nodes:
        args = []
        for k, e in enumerate(n.inputs):
            prod = nodes[e.src]
            if prod.op == "Output":
                raise ValueError(f"node %{n.id} reads Output node %{e.src}")
            vid = r.view(_normalise(e.view))
            key = (e.src, vid)
            o = operands.get(key)
            if o is None:
                o = operands[key] = len(operands)
                rows["RLd"].append((o, e.src, vid))
                if _full_view(e.view, prod.shape):
                    rows["RFull"].append((e.src, vid))
            edge_operand[(n.id, k)] = o
            args.append(o)
            if n.op == "Output":
                rows["ROut"].append((e.src,))
            else:
                rows["RReads"].append((n.id, e.src))
        op, i = n.op, n.id
        if op == "Input":
            rows["RInput"].append((i, r.dlist(n.shape), n.dtype.value))
            if n.attrs.get("role") == "state":
                rows["RWritable"].append((i,))
            continue
        if op == "Output":
            continue
        if op == "Constant":
            rows["RConstant"].append((i, r.dlist(n.shape), n.dtype.value))
            value = n.attrs.get("value")
            if not n.shape and n.dtype.is_float and isinstance(value, (int, float)) and not isinstance(value, bool):
                rows["RScalar"].append((i, repr(float(value))))   # rules/attention.egg matches -1, log2 e, -inf
            continue
        rows["RWritable"].append((i,))  # a buffer this group produces
        if op == "Iota":
            rows["RIota"].append((i, r.dim(n.attrs["n"])))
        elif op == "Cast":
            rows["RCast"].append((i, args[0], n.dtype.value))
        elif op in UNARY_OPS or op == "Contiguous":
            rows["RUn"].append((i, op, args[0]))
        elif op in BINARY_OPS:
            rows["RBin"].append((i, op, args[0], args[1]))
        elif op == "Where":
            rows["RWhere"].append((i, *args))
        elif op in REDUCE_OPS:
            rows["RRed"].append((i, op, args[0], int(n.attrs["axis"])))
        elif op == "Gather":
            rows["RGather"].append((i, *args))
        elif op == "Scatter":
            rows["RScatter"].append((i, *args))
        else:
            raise ValueError(f"no e-graph encoding for primop {op!r}")
    return dict(rows), edge_operand


def _tsv_field(x: Any) -> str:
    s = str(x)
    if "\t" in s or "\n" in s:
        raise ValueError(f"value {s!r} cannot go into a TSV row")
    return s


# ====================================================================== saturation
def saturate(graph: Graph) -> SaturatedGroup:
    """Encode ``graph`` (a standalone group), saturate it with the rule files and read it back."""
    t0 = time.perf_counter()
    _, schedule = _parsed()
    rows, edge_operand = encode_rows(graph)
    with _LOCK:
        eg = _base_egraph()
        eg.run_program(*_BASE["push"])
        try:
            with tempfile.TemporaryDirectory(prefix="lum-egraph-") as tmp:
                cmds = []
                for rel, rs in rows.items():
                    if not rs:
                        continue
                    path = os.path.join(tmp, rel + ".tsv")
                    with open(path, "w", encoding="utf-8") as f:
                        f.write("".join("\t".join(_tsv_field(x) for x in row) + "\n" for row in rs))
                    cmds.append(f'(input {rel} "{path}")')
                eg.run_program(*eg.parse_program("\n".join(cmds)))
            t1 = time.perf_counter()
            outs = eg.run_program(*schedule)
            t2 = time.perf_counter()
            matches: dict[str, int] = defaultdict(int)
            for o in outs:
                rep = getattr(o, "report", None)
                if rep is not None:
                    for k, v in rep.num_matches_per_rule.items():
                        matches[k] += v
            sat = _read_back(eg, graph, edge_operand, dict(matches))
        except BaseException:
            _BASE.clear()  # do not trust a half-run e-graph: the next group starts a fresh one
            raise
        else:
            eg.run_program(*_BASE["pop"])
    t3 = time.perf_counter()
    sat.stats.update({
        "hlir_nodes": len(graph),
        "eclasses": sat.num_eclasses,
        "enodes": sat.num_enodes,
        "decisions": len(sat.decisions),
        "fuse_decisions": sum(1 for c in sat.decisions if any(n.op in INLINE_OPS for n in sat.options[c])),
        "seconds_load": t1 - t0,
        "seconds_run": t2 - t1,
        "seconds_readback": t3 - t2,
        "seconds_saturate": t3 - t0,
    })
    return sat


def _read_back(eg, graph: Graph, edge_operand: dict[tuple[int, int], int], matches: dict[str, int]) -> SaturatedGroup:
    fr = eg.freeze()
    ids: dict[tuple[str, Any], int] = {}
    classes: list[EClass] = []

    def cls(sort: str, value) -> int:
        key = (sort, value)
        i = ids.get(key)
        if i is None:
            i = ids[key] = len(classes)
            classes.append(EClass(i, sort))
        return i

    node_of_n: dict[int, int] = {}
    operand_class: dict[int, int] = {}
    dtype_rows = []
    for name, fn in fr.functions.items():
        if fn.is_let_binding or fn.output_sort.startswith("@"):
            continue  # lets and relations
        sorts = fn.input_sorts
        if name in _ID_CTORS:
            if name in ("N", "Ai"):
                target = node_of_n if name == "N" else operand_class
                for row in fn.rows:
                    target[eg.value_to_i64(row.inputs[0])] = cls(fn.output_sort, row.output)
            continue
        if name == "DT":
            dtype_rows = [(r.inputs[0], eg.value_to_string(r.output)) for r in fn.rows]
            continue
        convs = [getattr(eg, _PRIM[s]) if s in _PRIM else None for s in sorts]
        kids = tuple(k for k, s in enumerate(sorts) if s not in _PRIM)
        for row in fn.rows:
            if row.subsumed:
                continue
            args = tuple(conv(v) if conv else cls(s, v) for conv, s, v in zip(convs, sorts, row.inputs))
            classes[cls(fn.output_sort, row.output)].nodes.append(ENode(name, args, kids))
    dtype = {ids[("Op", v)]: dt for v, dt in dtype_rows if ("Op", v) in ids}
    for c in classes:  # a stable order inside each class: options are indexed by position
        c.nodes.sort(key=lambda n: (n.op, repr(n.args)))
    edge_class = {k: operand_class[o] for k, o in edge_operand.items()}
    roots = [(n.id, edge_class[(n.id, 0)]) for n in graph.nodes if n.op == "Output"]
    sat = SaturatedGroup(graph, classes, node_of_n, edge_class, roots, dtype, {}, [], set(), matches, {})
    _analyse(sat)
    return sat


def _no_row_reads(sat: SaturatedGroup) -> set[int]:
    """Ld classes whose inline value a consumer that is not a row kernel could recompute: the input of a
    reduce over an axis other than the last and the src of a scatter into a 1-D dest, and the classes
    their inline values read, transitively. A row reduction (XRowSum / XRowMax) is dropped from them, so
    every selection is one that row kernels can run."""
    classes = sat.classes
    stack = []
    for c in classes:
        for n in c.nodes:
            if n.op in ("KSumReduce", "KMaxReduce") and int(n.args[1]) != len(sat.dlist(n.args[2])) - 1:
                stack.append(n.args[0])
            elif n.op in ("KScatter", "KScatterNoCopy") and len(sat.dlist(n.args[3])) < 2:
                stack.append(n.args[1])     # src rows along an index axis: not rows of dest
    out: set[int] = set()
    while stack:
        k = stack.pop()
        if k not in out:
            out.add(k)
            stack.extend(x for n in classes[k].nodes if n.op in INLINE_OPS for x in n.children())
    return out


def _racy_in_place(sat: SaturatedGroup) -> set[ENode]:
    """KScatterNoCopy nodes whose src rows, recomputed inline, could read the destination's own buffer:
    rows written by one thread would be read by another (rules/inplace.egg drops the direct case)."""
    classes = sat.classes

    def producer(k: int) -> int | None:
        return next((n.args[0] for n in classes[k].nodes if n.op == "Ld"), None)

    out: set[ENode] = set()
    for c in classes:
        for n in c.nodes:
            if n.op != "KScatterNoCopy":
                continue
            dest = producer(n.args[0])
            seen: set[int] = set()
            stack = [n.args[1]]
            while stack:
                k = stack.pop()
                if k in seen:
                    continue
                seen.add(k)
                if producer(k) == dest:
                    out.add(n)
                    break
                stack.extend(x for m in classes[k].nodes if m.op in INLINE_OPS for x in m.children())
    return out


@dataclass(frozen=True)
class AttentionViews:
    """What a KAttention e-node means, in the views an attention LLIR op reads (format/llir.py): q [R…, D],
    k [R…, T, D], v [R…, T, Dv], mask [R…, T]; ``group``: the R dims along which k and v do not move (the
    query heads of a GQA group; in prefill also the prompt's positions). ``flash``: their sizes do not
    multiply to a static number of at most :data:`ATTENTION_MAX_GROUP` (decode's kernel holds those rows in
    registers), so the op runs as flash attention (attention_policy.flash_attention)."""

    q: ShapeTracker
    k: ShapeTracker
    v: ShapeTracker
    mask: ShapeTracker
    group: tuple[int, ...]
    flash: bool = False


def attention_views(sat: SaturatedGroup, node: ENode) -> AttentionViews | None:
    """The views of a KAttention node (rules/attention.egg), or None when they do not make the node an
    attention over the keys: q read broadcast along the keys, the probabilities read by p·v in their own
    row-major layout broadcast along V's feature axis, static feature sizes, no padded q / k / v reads,
    float operands; the rows sharing a K / V row a static few, or else (flash attention: prefill) features
    that :func:`~lum.builder.attention_policy.flash_features_fit` and an unpadded mask. Memoised per node: extraction
    asks again for every lowering."""
    key = ("attention", node)
    if key not in sat._memo:
        sat._memo[key] = _attention_views(sat, node)
    return sat._memo[key]


def _attention_views(sat: SaturatedGroup, node: ENode) -> AttentionViews | None:
    q_ld, k_ld, v_ld, m_ld, _cs, pdt, _dt, vp_id = node.args
    views = []
    for c in (q_ld, k_ld, v_ld, m_ld):
        ld = next((n for n in sat.classes[c].nodes if n.op == "Ld"), None)
        if ld is None:
            return None
        views.append(sat.view(ld.args[1]))
    vq, vk, vv, vm = views
    vp = sat.view(vp_id)
    zero, one = as_expr(0), as_expr(1)
    if vq.ndim < 2 or tuple(vk.shape) != tuple(vq.shape) or vv.ndim != vq.ndim:
        return None
    if tuple(vp.shape) != tuple(vv.shape):
        return None
    r, t, d = tuple(vq.shape[:-2]), vq.shape[-2], vq.shape[-1]
    if tuple(vv.shape[:-2]) != r or vv.shape[-1] != t or tuple(vm.shape) != r + (t,):
        return None
    dv = vv.shape[-2]
    if not (d.is_const and dv.is_const) or any(x.mask is not None for x in (vq, vk, vv, vp)):
        return None
    if vq.strides[-2] != zero and t != one:
        return None
    rows = contiguous_strides(r + (t,))
    want = tuple(zero if n == one else st for n, st in zip(r, rows[:-1])) + (zero, zero if t == one else rows[-1])
    if vp.offset != zero or tuple(vp.strides) != want:
        return None
    for c in (q_ld, k_ld, v_ld):
        dt = sat.dtype.get(c)
        if dt not in ("f32", "bf16", "f16"):
            return None
    if sat.dtype.get(m_ld) != "bool" or pdt not in ("f32", "bf16", "f16"):
        return None
    group = tuple(i for i in range(len(r)) if vk.strides[i] == zero and vv.strides[i] == zero)
    size = numel(tuple(r[i] for i in group))
    flash = not (size.is_const and size.value <= ATTENTION_MAX_GROUP)
    if flash and (not flash_features_fit(d, dv) or vm.mask is not None or not flash_attention_enabled()):
        return None
    q = ShapeTracker(r + (d,), tuple(vq.strides[:-2]) + (vq.strides[-1],), vq.offset, None)
    v = ShapeTracker(r + (t, dv), tuple(vv.strides[:-2]) + (vv.strides[-1], vv.strides[-2]), vv.offset, None)
    return AttentionViews(q, vk, v, vm, group, flash)


def _analyse(sat: SaturatedGroup) -> None:
    """Feasible executable options per Op class, reachability from the roots, decision points."""
    classes = sat.classes
    # X nodes only matter in Ld classes a fusing consumer (fused_args: elementwise, reduce, scatter src) reads,
    # directly or through other X nodes: everywhere else they are dropped, so they make no decision points
    inline_read: set[int] = set()
    stack = [k for c in classes if c.sort == "Op" for n in c.nodes for k in fused_args(n)]
    while stack:
        k = stack.pop()
        if k not in inline_read:
            inline_read.add(k)
            stack.extend(x for n in classes[k].nodes if n.op in INLINE_OPS for x in n.children())
    no_rows = _no_row_reads(sat)
    racy = _racy_in_place(sat)
    exe: dict[int, list[ENode]] = {}
    for c in classes:
        if c.sort == "Op":
            exe[c.id] = [n for n in c.nodes
                         if n.op in EXECUTABLE and (n.op not in INLINE_OPS or c.id in inline_read)
                         and not (n.op in ROW_INLINE_OPS and c.id in no_rows)
                         and not (n.op == "KScatterNoCopy" and n in racy)
                         and not (n.op == "KAttention" and attention_views(sat, n) is None)]
    # feasibility: a node is feasible when every Op child class is (bottom-up worklist)
    feasible: set[int] = set()
    waiting: dict[int, list[tuple[int, ENode]]] = defaultdict(list)
    pending: dict[tuple[int, int], int] = {}
    queue: deque[int] = deque()
    for cid, nodes in exe.items():
        for j, n in enumerate(nodes):
            op_kids = {k for k in n.children() if classes[k].sort == "Op"}
            pending[(cid, j)] = len(op_kids)
            for k in op_kids:
                waiting[k].append((cid, j))
            if not op_kids and cid not in feasible:
                feasible.add(cid)
                queue.append(cid)
    while queue:
        k = queue.popleft()
        for cid, j in waiting.pop(k, ()):
            pending[(cid, j)] -= 1
            if pending[(cid, j)] == 0 and cid not in feasible:
                feasible.add(cid)
                queue.append(cid)
    options: dict[int, list[ENode]] = {}
    for cid, nodes in exe.items():
        ok = [n for n in nodes if all(classes[k].sort != "Op" or k in feasible for k in n.children())]
        if ok:
            options[cid] = ok
    # reachability from the outputs and the inputs (inputs are always part of a program)
    start = [c for _, c in sat.roots] + [sat.node_class[n.id] for n in sat.graph.nodes if n.op == "Input"]
    missing = [c for c in start if c not in options]
    if missing:
        raise ValueError(f"graph {sat.graph.name!r}: e-classes {missing} needed by the program have no "
                         "executable e-node (a primop without a lowering rule?)")
    reach: set[int] = set()
    stack = list(start)
    while stack:
        c = stack.pop()
        if c in reach:
            continue
        reach.add(c)
        for n in options[c]:
            stack.extend(k for k in n.children() if classes[k].sort == "Op" and k not in reach)
    sat.options = options
    sat.reachable = reach
    sat.decisions = sorted(c for c in reach if len(options[c]) > 1)
