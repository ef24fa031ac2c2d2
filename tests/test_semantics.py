"""Semantics of the e-graph compiler: every extraction computes what the HLIR computes.

For random HLIR graphs (hypothesis: elementwise chains, broadcasts, reductions, matmuls with random
transposes and batches, softmax, gather, scatter, where, views incl. pad/slice/permute/reshape, a
symbolic dim) and for every group of the tiny model configs, the group is saturated, 20 random
extractions are lowered to LLIR and run by the loader's reference backend, and each result is
compared with the HLIR reference interpreter (relative error < 1e-5 in f32, max-norm). Random
extractions pick fuse / no-fuse per fusable read (rules/fuse.egg), so Fused ops and reductions with a
fused prologue (reduce ops with ``params["expr"]``) are covered too, and so are producers inlined
through a broadcast / permute / slice / reshape of their buffer (the fuse-view-* rules) or through a
padded one when they map zeros to zero (fuse-masked-*), row reductions
recomputed in their consumer's row kernel (rules/rows.egg) and scatters that compute their rows (a
fused prologue); each is counted.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

pytest.importorskip("egglog")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lum.builder import frontend as F  # noqa: E402
from lum.builder.compile import compile_group  # noqa: E402
from lum.builder.egraph import (ELEMENTWISE_KERNELS, FUSING_CONSUMERS, INLINE_OPS, ROW_INLINE_OPS,  # noqa: E402
                                fused_args, saturate)
from lum.builder.extract import _ld, _Reads, chosen, lower, random_choice  # noqa: E402
from lum.builder.hlir import Edge, Graph  # noqa: E402
from lum.builder.partition import chunk_graph, group_chunks, partition  # noqa: E402
from lum.builder.reference import run_graph  # noqa: E402
from lum.format.dtypes import DType  # noqa: E402
from lum.format.expr import Var, as_expr  # noqa: E402
from lum.format.llir import has_row_ops  # noqa: E402
from lum.format.shapetracker import ShapeTracker  # noqa: E402
from lum.loader.reference_backend import execute  # noqa: E402

EXTRACTIONS = 20
TOL = 1e-5


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    assert got.shape == want.shape
    if want.size == 0:
        return 0.0
    scale = max(float(np.abs(want).max()), 1e-6)
    return float(np.abs(got - want).max()) / scale


FUSED = {"programs": 0, "reduce": 0, "lifted": 0, "masked": 0, "rows": 0, "scatter": 0}   # programs run that hold
# a Fused op / a reduce with a fused prologue / an inline value read through a view other than the producer's
# identity (fuse-view-*, fuse-masked-*) / one through a padded view (fuse-masked-*) / a row reduction inside a
# kernel / a scatter with a fused prologue


def _lifted(sat, choice) -> set[str]:
    """How the selection recomputes producers through non-identity views: ``lifted`` for any (rules/fuse.egg's
    fuse-view-* rules: a broadcast, permute, slice or reshape of a producer whose operands read its own layout),
    ``masked`` too for a padded one (fuse-masked-*: a producer that maps zeros to zero)."""
    kinds: set[str] = set()
    reads = _Reads(sat, choice)
    for c in sat.reachable:
        node = chosen(sat, choice, c)
        if node.op not in FUSING_CONSUMERS:
            continue
        stack = list(fused_args(node))
        while stack:
            k = stack.pop()
            x = reads.inline(k)
            if x is None:
                continue
            if x.op in ROW_INLINE_OPS:            # a reduce recomputed in a row kernel, not an elementwise op
                stack.extend(kid for kid in x.children() if sat.classes[kid].sort == "Op")
                continue
            ld = _ld(sat, k)
            prod = next(n for n in sat.options[ld.args[0]] if n.op in ELEMENTWISE_KERNELS)
            v, shape = sat.view(ld.args[1]), sat.dlist(prod.args[-2])
            ident = ShapeTracker.contiguous(shape)
            if not (v.shape == shape and v.offset == as_expr(0) and v.mask is None
                    and all(a == b or d == as_expr(1) for a, b, d in zip(v.strides, ident.strides, shape))):
                kinds |= {"lifted", "masked"} if v.mask is not None else {"lifted"}
            stack.extend(kid for kid in x.children() if sat.classes[kid].sort == "Op")
    return kinds


def check_extractions(graph: Graph, inputs: dict, dyn: dict | None, seed: int = 0,
                      n: int = EXTRACTIONS) -> tuple[int, int]:
    """Saturate, draw ``n`` random extractions, run each distinct one; returns (decisions other than
    fuse / no-fuse, programs run)."""
    ref = run_graph(graph, inputs, dyn)
    sat = saturate(graph)
    seen = set()
    for k in range(n):
        choice = random_choice(sat, seed * 1000 + k)
        key = tuple(sorted(choice.items()))
        if key in seen:
            continue
        seen.add(key)
        prog = lower(sat, choice)
        FUSED["programs"] += any(o.op == "Fused" for o in prog.ops)
        FUSED["reduce"] += any(o.kind == "reduce" and "expr" in o.params for o in prog.ops)
        lifted = _lifted(sat, choice)
        FUSED["lifted"] += "lifted" in lifted
        FUSED["masked"] += "masked" in lifted
        FUSED["rows"] += any("expr" in o.params and has_row_ops(o.params["expr"]) for o in prog.ops)
        FUSED["scatter"] += any(o.kind in ("scatter", "scatter_nocopy") and "expr" in o.params for o in prog.ops)
        out = execute(prog, inputs, dyn)
        assert set(out) == set(ref)
        for name, want in ref.items():
            err = rel_err(out[name], want)
            assert err < TOL, (name, err, {c: sat.options[c][i].op for c, i in choice.items()})
    # the cost model's choice too
    prog, _ = compile_group(graph, sat=sat)
    out = execute(prog, inputs, dyn)
    for name, want in ref.items():
        assert rel_err(out[name], want) < TOL, name
    return sum(not any(o.op in INLINE_OPS for o in sat.options[c]) for c in sat.decisions), len(seen)


# ====================================================================== random graphs
class Builder:
    """Draws a random graph step by step from a hypothesis ``data`` object."""

    def __init__(self, data, rng: np.random.Generator):
        self.d = data
        self.rng = rng
        self.g = Graph("random")
        self.pool: list[F.GraphTensor] = []
        self.inputs: dict[str, np.ndarray] = {}
        self.dyn: dict[str, int] = {}
        self.n_inputs = 0

    # ------------------------------------------------------------------ draws
    def draw(self, strategy, label: str | None = None):
        return self.d.draw(strategy, label=label)

    def int(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def dim(self) -> int:
        return self.draw(st.sampled_from([3, 2, 4, 1, 5]))  # hypothesis favours the first

    def shape(self, rank: int | None = None) -> list:
        rank = self.int(1, 3) if rank is None else rank
        return [self.dim() for _ in range(rank)]

    def sym(self, shape: list) -> list:
        """Maybe replace one dim by the dyn var s."""
        if shape and self.draw(st.booleans()) and self.draw(st.booleans()):
            i = self.int(0, len(shape) - 1)
            if "s" not in self.dyn:
                self.dyn["s"] = self.int(1, 4)
            shape = list(shape)
            shape[i] = Var("s")
        return shape

    def concrete(self, shape) -> tuple[int, ...]:
        return tuple(as_expr(d).evaluate(self.dyn) for d in shape)

    # ------------------------------------------------------------------ tensors
    def new_input(self, shape, dtype: str = "f32", role: str | None = None, values=None) -> F.GraphTensor:
        name = f"in{self.n_inputs}"
        self.n_inputs += 1
        role = role or self.draw(st.sampled_from(["input", "weight", "state"]))
        t = F.input_tensor(self.g, name, shape, dtype, role=role)
        conc = self.concrete(shape)
        if values is None:
            values = self.rng.uniform(-1.0, 1.0, size=conc).astype(np.float32)
        self.inputs[name] = values
        return t

    def pick(self, min_rank: int = 0) -> F.GraphTensor | None:
        cands = [t for t in self.pool if t.ndim >= min_rank and t.dtype == DType.f32]
        if not cands:
            return None
        return cands[self.int(0, len(cands) - 1)]

    def bshape(self, shape) -> list:
        """A shape that broadcasts to ``shape``: some dims set to 1, maybe fewer leading dims."""
        out = [d if self.draw(st.booleans()) else 1 for d in shape]
        drop = self.int(0, len(out))
        return out[drop:] or [1]

    # ------------------------------------------------------------------ steps
    def step(self) -> None:
        kind = self.draw(st.sampled_from(["matmul", "view", "binary", "unary", "scatter", "reduce", "softmax",
                                          "matmul", "view", "where", "gather", "binary", "concat", "intpath"]),
                         label="step")
        t = self.pick()
        if t is None:
            kind = "input"
        getattr(self, "s_" + kind)(t)

    def s_input(self, t) -> None:
        self.pool.append(self.new_input(self.sym(self.shape())))

    def s_unary(self, t) -> None:
        f = self.draw(st.sampled_from(["sin", "exp2sin", "sqrt", "recip", "log2", "neg", "contig", "silu"]))
        if f == "sin":
            r = t.sin()
        elif f == "exp2sin":
            r = t.sin().exp2()
        elif f == "sqrt":
            r = (t * t + 1.0).sqrt()
        elif f == "recip":
            r = (t * t + 1.0).recip()
        elif f == "log2":
            r = (t * t + 1.0).log2()
        elif f == "neg":
            r = -t
        elif f == "contig":
            r = t.contiguous()
        else:
            r = t.silu()
        self.pool.append(r)

    def s_binary(self, t) -> None:
        if self.draw(st.booleans()):
            other = self.new_input(self.bshape(list(t.shape)))
        else:
            cands = [u for u in self.pool if u.dtype == DType.f32 and _broadcastable(u.shape, t.shape)]
            other = cands[self.int(0, len(cands) - 1)]
        op = self.draw(st.sampled_from(["add", "mul", "sub", "div"]))
        if self.draw(st.booleans()):
            t, other = other, t
        try:
            if op == "add":
                r = t + other
            elif op == "mul":
                r = t * other
            elif op == "sub":
                r = t - other
            else:
                r = t / (other * other + 1.0)
        except ValueError:  # shapes that do not broadcast after the swap
            return
        self.pool.append(r)

    def s_reduce(self, t) -> None:
        if t.ndim == 0:
            return
        axis = self.int(0, t.ndim - 1)
        keep = self.draw(st.booleans())
        r = t.sum(axis, keep) if self.draw(st.booleans()) else t.max(axis, keep)
        self.pool.append(r)

    def s_softmax(self, t) -> None:
        if t.ndim == 0:
            return
        self.pool.append(t.softmax(self.int(0, t.ndim - 1)))

    def s_matmul(self, t) -> None:
        """a @ b with random storage layouts (transposed or not) and batch dims (shared or broadcast)."""
        use_pool = t.ndim >= 2 and self.draw(st.booleans())
        if use_pool:
            a = t
            batch = list(a.shape[:-2])
            k = a.shape[-1]
        else:
            m, k = self.dim(), self.dim()
            batch = [self.dim() for _ in range(self.int(0, 2))]
            m = self.sym([m])[0] if not batch else m
            if self.draw(st.booleans()):   # stored [.., k, m], read transposed
                a = self.new_input(batch + [k, m]).transpose(-2, -1)
            else:
                a = self.new_input(batch + [m, k])
        n = self.dim()
        b_batch = batch if (batch and self.draw(st.booleans())) else []
        if b_batch and self.draw(st.booleans()):
            b_batch = [1] * (len(batch) - 1) + [batch[-1]] if len(batch) > 1 else b_batch
        if self.draw(st.booleans()):       # stored [.., n, k] (an HF weight), read transposed
            b = self.new_input(b_batch + [n, k]).transpose(-2, -1)
        else:
            b = self.new_input(b_batch + [k, n])
        if self.draw(st.booleans()) and a.ndim == 2 and b.ndim == 2:
            self.pool.append(F.linear(a, b.transpose(-2, -1)))
        else:
            self.pool.append(F.matmul(a, b))

    def s_view(self, t) -> None:
        if t.ndim == 0:
            self.pool.append(t.reshape(1, 1).broadcast_to((self.dim(), 1)))
            return
        v = self.draw(st.sampled_from(["permute", "slice", "pad", "reshape", "expand", "unsqueeze"]))
        if v == "permute":
            order = self.draw(st.permutations(list(range(t.ndim))))
            self.pool.append(t.permute(order))
        elif v == "slice":
            ax = self.int(0, t.ndim - 1)
            d = t.shape[ax]
            if not d.is_const or d.value < 2:
                return
            lo = self.int(0, d.value - 1)
            hi = self.int(lo + 1, d.value)
            self.pool.append(t.slice(ax, lo, hi))
        elif v == "pad":
            ax = self.int(0, t.ndim - 1)
            self.pool.append(t.pad(ax, self.int(0, 2), self.int(0, 2)))
        elif v == "reshape":
            if t.ndim >= 2 and self.draw(st.booleans()):
                new = list(t.shape[:-2]) + [t.shape[-2] * t.shape[-1]]
            else:
                d = t.shape[-1]
                if not d.is_const or d.value not in (4, 6):
                    return
                new = list(t.shape[:-1]) + [2, d.value // 2]
            self.pool.append(t.reshape(new))
        elif v == "expand":
            if t.ndim >= 3:
                return
            self.pool.append(t.expand_dim(self.int(0, t.ndim), self.dim()))
        else:
            self.pool.append(t.unsqueeze(self.int(0, t.ndim)))

    def s_where(self, t) -> None:
        other = self.new_input(self.bshape(list(t.shape)))
        cond = t < other
        self.pool.append(F.where(cond, t, other * 2.0) if self.draw(st.booleans()) else F.maximum(t, other))

    def s_gather(self, t) -> None:
        if t.ndim >= 2 and t.shape[0].is_const and self.draw(st.booleans()):
            table = t
        else:
            table = self.new_input([self.dim(), self.dim()], role="weight")
        rows = table.shape[0].value
        nidx = self.dim()
        if self.draw(st.booleans()):
            idx = self.new_input([nidx], "i32", role="input",
                                 values=self.rng.integers(0, rows, size=nidx).astype(np.int32))
        else:   # indices computed in the graph: iota % rows
            idx = F.arange(self.g, nidx, DType.i64) % F.constant(self.g, rows, DType.i64)
        self.pool.append(F.gather(table, idx))

    def s_scatter(self, t) -> None:
        if t.ndim >= 2 and t.shape[0].is_const and t.shape[0].value >= 2 and self.draw(st.booleans()):
            dest = t                                   # a buffer made in the graph (or a view of it)
        else:
            dest = self.new_input([self.int(2, 6)] + [self.dim() for _ in range(self.int(1, 2))],
                                  role=self.draw(st.sampled_from(["state", "state", "weight"])))
        rows = dest.shape[0].value
        n = self.int(1, rows)
        src = self.new_input([n] + list(dest.shape[1:]))
        if self.draw(st.booleans()):
            src = src.sin()
        idx = self.new_input([n], "i64", role="input",
                             values=self.rng.permutation(rows)[:n].astype(np.int64))
        out = F.scatter(dest, src, idx)
        self.pool.append(out)
        if self.draw(st.booleans()):                   # sometimes the old contents are read too
            self.pool.append(dest * 1.5)

    def s_concat(self, t) -> None:
        if t.ndim == 0:
            return
        ax = self.int(0, t.ndim - 1)
        other = t.sin() if self.draw(st.booleans()) else self.new_input(list(t.shape))
        self.pool.append(F.concat([t, other], ax))

    def s_intpath(self, t) -> None:
        n = self.dim()
        i = F.arange(self.g, n, DType.i64)
        j = (i * F.constant(self.g, 3, DType.i64)) % F.constant(self.g, 4, DType.i64)
        self.pool.append(j.cast(DType.f32).unsqueeze(0) * 0.25)


def _broadcastable(src, dst) -> bool:
    if len(src) > len(dst):
        return False
    for a, b in zip(reversed(src), reversed(dst)):
        if a != b and a != as_expr(1):
            return False
    return True


@st.composite
def random_graphs(draw):
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    b = Builder(_Drawer(draw), np.random.default_rng(seed))
    b.s_input(None)
    if draw(st.booleans()):
        b.s_input(None)
    # an anchor op that gives the e-graph something to choose (a GEMM, an in-place write) ...
    anchor = draw(st.sampled_from(["matmul", "scatter", "matmul", "gather", "softmax"]), label="anchor")
    getattr(b, "s_" + anchor)(b.pick())
    # ... then a random chain around it
    for _ in range(draw(st.integers(1, 8), label="steps")):
        b.step()
    # outputs: the last tensor, every tensor nothing else reads (so no step is dead code), and maybe
    # an intermediate one (a buffer read by an output and by later ops)
    consumers = b.g.consumers()
    outs = [b.pool[-1]] + [t for t in b.pool[:-1] if not consumers[t.node]][:4]
    outs += [b.pool[i] for i in draw(st.lists(st.integers(0, len(b.pool) - 1), max_size=1))]
    for k, t in enumerate(outs):
        F.output(t, f"out{k}")
    return b.g, b.inputs, b.dyn or None


class _Drawer:
    def __init__(self, draw):
        self._draw = draw

    def draw(self, strategy, label=None):
        return self._draw(strategy, label=label)


STATS = {"graphs": 0, "with_decisions": 0, "programs": 0}


@settings(max_examples=200, deadline=None, derandomize=True, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(random_graphs())
def test_random_graphs_every_extraction_matches_the_reference(case):
    graph, inputs, dyn = case
    decisions, runs = check_extractions(graph, inputs, dyn)
    STATS["graphs"] += 1
    STATS["with_decisions"] += decisions > 0
    STATS["programs"] += runs


def test_random_graphs_cover_decisions():
    """The random-graph test ran its 200 graphs and many of them had real choices (GEMMs, in place)."""
    if STATS["graphs"] == 0:
        pytest.skip("runs after test_random_graphs_every_extraction_matches_the_reference")
    assert STATS["graphs"] >= 200
    assert STATS["with_decisions"] >= 100, STATS
    assert FUSED["programs"] >= STATS["programs"] // 2, (FUSED, STATS)   # most hold a Fused op
    assert FUSED["reduce"] >= STATS["programs"] // 4, (FUSED, STATS)     # many a fused reduce
    print(FUSED, STATS)
    assert FUSED["lifted"] >= STATS["programs"] // 5, (FUSED, STATS)     # many inline a broadcast / permute ...
    assert FUSED["masked"] >= STATS["programs"] // 50, (FUSED, STATS)    # some through a pad / concat
    assert FUSED["rows"] >= STATS["programs"] // 20, (FUSED, STATS)      # softmax / norm-like rows
    assert FUSED["scatter"] >= 1, (FUSED, STATS)


# ====================================================================== tiny models
def _values_of(graph: Graph, inputs: dict, dyn: dict, nodes) -> dict[int, np.ndarray]:
    """Values of ``nodes`` in a reference run of the whole graph (extra Outputs on a copy)."""
    g2 = copy.copy(graph)
    g2.nodes = list(graph.nodes)
    for nid in nodes:
        n = graph.nodes[nid]
        g2.add("Output", (Edge(nid, ShapeTracker.contiguous(n.shape)),), n.shape, n.dtype,
               name=f"__value{nid}", role="output")
    out = run_graph(g2, inputs, dyn)
    return {nid: out[f"__value{nid}"] for nid in nodes}


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3", "tiny-gemma3"])
def test_tiny_model_groups_every_extraction_matches_the_reference(model):
    from lum.builder.models import load_spec

    spec = load_spec(random_name=model, max_seq=32)
    cfg = spec.config
    rng = np.random.default_rng(7)
    weights = {n: np.asarray(spec.weights.get(n)) for n in spec.weights.names()}
    state = {n: rng.standard_normal((spec.max_seq, cfg.num_kv_heads, cfg.head_dim)).astype(np.float32)
             for n in spec.state_names}
    lifted, masked, rows, scatter = FUSED["lifted"], FUSED["masked"], FUSED["rows"], FUSED["scatter"]
    for entry, dyn in (("prefill", {"s": 5}), ("decode", {"p": 9})):
        g = spec.graphs[entry]
        chunks = partition(g)
        tokens = rng.integers(0, cfg.vocab_size, size=dyn.get("s", 1)).astype(np.int32)
        inputs = {"tokens": tokens, **weights, **state}
        needed = sorted({s for c in chunks for s in c.input_nodes})
        values = _values_of(g, inputs, dyn, needed)
        groups = group_chunks(g, chunks)
        assert len(groups) >= 3
        for grp in groups:
            for ci in (grp.chunks[0], grp.chunks[-1]):  # the representative, and another member
                chunk = chunks[ci]
                cg = chunk_graph(g, chunk)
                cin = {}
                for n in cg.inputs():
                    name = n.attrs["name"]
                    if n.attrs["role"] == "ext":
                        cin[name] = values[chunk.input_nodes[int(name[3:])]]
                    else:
                        cin[name] = inputs[name]
                decisions, runs = check_extractions(cg, cin, dyn, seed=ci)
                layer = any(n.attrs["role"] == "state" for n in cg.inputs())     # it reads the kv caches
                if layer:  # decoder layers: 6 GEMMs (q/k/v and gate/up stacked), 2 cache writes
                    assert decisions == 8 and runs > 1
                if ci == grp.chunks[-1] == grp.chunks[0]:
                    break
    assert FUSED["lifted"] > lifted       # norms' rsqrt, softmax's 1/sum, rope tables inline through broadcasts
    assert FUSED["masked"] > masked       # rotate_half's two padded reads of the rope angles
    assert FUSED["rows"] > rows           # norms and softmax as row kernels
    assert FUSED["scatter"] > scatter     # KV-cache writes that compute RoPE and the cast
