"""Elementwise fusion: rules/fuse.egg → extraction → ``Fused`` LLIR ops (and reductions with a fused
prologue) → reference backend and codegen.

An identity read of an elementwise producer gets an inline value (``XAdd`` …) in its Ld class, and so
does a read through any unmasked view (broadcast, permute, slice, reshape) of a producer whose operands
all read its own layout or a scalar (the fuse-view-* rules); an elementwise or Sum / Max consumer that
chooses it recomputes the producer in its own kernel. Checked here: each rule fires on its pattern and
not on near misses (a padded read, a producer with a broadcast or permuted operand read through a
non-identity view, a reduce or Contiguous producer); reductions fuse their prologue (``sum(x*x)``,
softmax's ``sum(exp2(x - max))``) through the same reads; RMSNorm is a Σ and one Fused kernel, softmax a
max, a Σ and one Fused kernel; scatters and outputs read buffers; fused programs compute what the HLIR computes (mixed dtypes and padded leaves included);
the expression size cap; the LLIR validation of ``expr``; NVRTC compiles Fused and fused-reduce
kernels; and decode kernel counts of tiny models before and after fusion.
"""

from __future__ import annotations

import re
import time

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("egglog")

from lum.builder import costmodel, extract  # noqa: E402
from lum.builder import frontend as F  # noqa: E402
from lum.builder.compile import compile_group  # noqa: E402
from lum.builder.egraph import INLINE_OPS, SaturatedGroup, saturate  # noqa: E402
from lum.builder.extract import choose_by_cost, lower, random_choice, row_broadcast_reads  # noqa: E402
from lum.builder.hlir import Graph  # noqa: E402
from lum.builder.reference import run_graph  # noqa: E402
from lum.format.dtypes import DType  # noqa: E402
from lum.format.expr import Var, as_expr  # noqa: E402
from lum.format.llir import Arg, LOp, Program, expr_nodes  # noqa: E402
from lum.format.shapetracker import ShapeTracker  # noqa: E402
from lum.loader.reference_backend import BackendError, execute  # noqa: E402

RNG = np.random.default_rng(11)
FUSE_RULES = ("fuse-cast", "fuse-exp2", "fuse-log2", "fuse-sin", "fuse-sqrt", "fuse-recip", "fuse-add", "fuse-mul",
              "fuse-mod", "fuse-lessthan", "fuse-where")
FUSE_VIEW_RULES = tuple(r.replace("fuse-", "fuse-view-") for r in FUSE_RULES)


# ====================================================================== helpers
def _inputs(g: Graph) -> dict[str, np.ndarray]:
    out = {}
    for n in g.inputs():
        shape = tuple(d.evaluate({}) for d in n.shape)
        if n.dtype.is_int:
            out[n.attrs["name"]] = RNG.permutation(6)[:shape[0]].astype(n.dtype.np)
        else:
            out[n.attrs["name"]] = RNG.uniform(0.5, 2.0, shape).astype(n.dtype.np)
    return out


def _need_nvrtc() -> None:
    from lum.builder import nvrtc

    try:
        nvrtc.nvrtc_version()
    except nvrtc.NvrtcNotFound as e:
        pytest.skip(f"NVRTC not available: {e}")


def _compiles_cleanly(kernels: list, tmp_path) -> None:
    """The kernels, as one module, compile with NVRTC without a warning, every entry point in the PTX."""
    from lum.builder import nvrtc
    from lum.builder.codegen import module_source

    res = nvrtc.compile_cuda(module_source(kernels), "sm_90", cache_dir=tmp_path)
    assert "warning" not in res.log.lower(), res.log[:3000]
    for k in kernels:
        assert f".entry {k.name}(" in res.ptx


def _check(g: Graph, prog: Program, inputs: dict | None = None, tol: float = 1e-6) -> None:
    inputs = inputs if inputs is not None else _inputs(g)
    ref = run_graph(g, inputs)
    got = execute(prog, inputs)
    assert set(got) == set(ref)
    for k, want in ref.items():
        w, o = want.astype(np.float64), got[k].astype(np.float64)
        scale = max(float(np.abs(w).max()), 1e-30)
        assert float(np.abs(o - w).max()) / scale <= tol, k


def _kernels(prog: Program) -> list[LOp]:
    return prog.kernels()


def _inline_ops(sat: SaturatedGroup, cls: int, raw: bool = False) -> set[str]:
    """Inline ops of an Ld class: its feasible options, or (raw) every e-node the rules put there."""
    nodes = sat.classes[cls].nodes if raw else sat.options.get(cls, ())
    return {n.op for n in nodes if n.op in INLINE_OPS}


def _edge_reading(sat: SaturatedGroup, producer: F.GraphTensor, consumer_op: str) -> int:
    """The Ld class of the (first) edge by which a node of ``consumer_op`` reads ``producer``."""
    for n in sat.graph.nodes:
        if n.op == consumer_op:
            for k, e in enumerate(n.inputs):
                if e.src == producer.node:
                    return sat.edge_class[(n.id, k)]
    raise AssertionError(f"no {consumer_op} reads node {producer.node}")


def _inline_choice(sat: SaturatedGroup, cls: int, base: dict | None = None) -> dict:
    choice = dict(base or {})
    choice[cls] = next(i for i, n in enumerate(sat.options[cls]) if n.op in INLINE_OPS)
    return choice


def _unfused(sat: SaturatedGroup, choice: dict) -> dict:
    """The same choice with every fusable read reading its buffer (option 0 of an Ld class is its Ld)."""
    return {c: 0 if any(n.op in INLINE_OPS for n in sat.options[c]) else i for c, i in choice.items()}


# ====================================================================== the rules fire
def test_chain_becomes_one_fused_kernel():
    g = Graph("chain")
    x = F.input_tensor(g, "x", [4, 8], "f32")
    y = F.input_tensor(g, "y", [4, 8], "f32")
    z = F.input_tensor(g, "z", [8], "f32")
    F.output(((x * y) + z).exp2(), "out")
    sat = saturate(g)
    assert sat.fired("fuse-mul") == 1 and sat.fired("fuse-add") == 1
    prog, _ = compile_group(g, sat=sat)
    (k,) = _kernels(prog)
    assert k.op == "Fused"
    assert k.params["expr"] == ["Exp2", "f32", ["Add", "f32", ["Mul", "f32", ["arg", 0], ["arg", 1]], ["arg", 2]]]
    assert [prog.ops[a.src].params["name"] for a in k.args] == ["x", "y", "z"]
    assert k.args[2].view.strides == (as_expr(0), as_expr(1))      # z is read through its broadcast view
    assert k.bytes == as_expr(4 * (32 + 32 + 8 + 32)) and k.flops == as_expr(3 * 32)
    _check(g, prog)
    # the unfused selection of the same e-graph: three kernels, same values
    prog0 = lower(sat, _unfused(sat, choose_by_cost(sat)))
    assert [o.op for o in _kernels(prog0)] == ["Mul", "Add", "Exp2"]
    _check(g, prog0)


def test_every_elementwise_op_inlines():
    g = Graph("ops")
    x = F.input_tensor(g, "x", [4, 8], "bf16")
    a = x.cast("f32")
    b = ((a * a + 1.0).sqrt().log2().sin().exp2()).recip()
    c = b % 0.75
    F.output(F.where(b < c, b, c), "out")
    sat = saturate(g)
    assert all(sat.fired(r) >= 1 for r in FUSE_RULES), {r: sat.fired(r) for r in FUSE_RULES}
    prog, _ = compile_group(g, sat=sat)
    (k,) = _kernels(prog)
    ops = set()

    def walk(t):
        if t[0] != "arg":
            ops.add(t[0])
            for kid in t[2:]:
                walk(kid)

    walk(k.params["expr"])
    assert ops == {"Cast", "Mul", "Add", "Sqrt", "Log2", "Sin", "Exp2", "Recip", "Mod", "LessThan", "Where"}
    _check(g, prog)


def test_mixed_dtype_and_integer_chains_keep_every_rounding():
    g = Graph("mixed")
    x = F.input_tensor(g, "x", [4, 8], "bf16")
    w = F.input_tensor(g, "w", [8], "bf16")
    h = (x.cast("f32") * w.cast("f32")).cast("bf16").cast("f32")   # a 16-bit intermediate
    i = (F.arange(g, 8, DType.i64) * F.constant(g, 3, DType.i64)) % F.constant(g, 5, DType.i64)
    F.output(((h + i.cast("f32")) * 1.7).sqrt().cast("bf16"), "out")
    sat = saturate(g)
    prog, _ = compile_group(g, sat=sat)
    fused = [o for o in prog.ops if o.op == "Fused"]
    assert fused and any("bf16" in str(o.params["expr"][2:]) for o in fused)
    _check(g, prog, tol=0.0)                    # the same roundings as the HLIR interpreter, bit for bit


@pytest.mark.parametrize("case", ["broadcast", "permuted", "sliced", "reshaped", "scalar"])
def test_a_producer_of_identity_reads_inlines_through_any_unmasked_view(case):
    """p's operands read its own layout (or a scalar), so any unmasked view of p's buffer applies to its
    operands' buffers: the Add recomputes p through the view, and p is no kernel of its own."""
    g = Graph(case)
    x = F.input_tensor(g, "x", [4, 8], "f32")
    y = F.input_tensor(g, "y", [4, 8], "f32")
    if case == "broadcast":
        p = x.sum(0) * y.sum(0)                 # [8], read as [4, 8]
        view = p.expand_dim(0, 4)
    elif case == "scalar":                      # a per-row value times a scalar constant, read as [4, 8]
        p = x.sum(1, keepdim=True) * 0.125
        view = p.broadcast_to([4, 8])
    else:
        p = x * y
        view = {"permuted": lambda t: t.permute(1, 0), "sliced": lambda t: t.slice(1, 1, 5),
                "reshaped": lambda t: t.reshape(2, 16)}[case](p)
    out = view + F.input_tensor(g, "w", [int(d.value) for d in view.shape], "f32")
    F.output(out, "out")
    sat = saturate(g)
    cls = _edge_reading(sat, p, "Add")
    assert _inline_ops(sat, cls) == {"XMul"} and cls in sat.decisions
    assert sat.fired("fuse-mul") == 0 and sat.fired("fuse-view-mul") >= 1
    prog, _ = compile_group(g, sat=sat)
    assert [o.op for o in _kernels(prog) if o.kind == "elementwise"] == ["Fused"]   # p is recomputed
    (k,) = [o for o in _kernels(prog) if o.op == "Fused"]
    if case == "scalar":                        # the row sum itself is recomputed in the row kernel
        assert k.params["expr"] == ["Add", "f32", ["Mul", "f32", ["RowSum", "f32", ["arg", 0]], ["arg", 1]], ["arg", 2]]
        assert prog.ops[k.args[0].src].kind == "input" and k.args[0].view == ShapeTracker.contiguous((4, 8))
        assert not any(o.kind == "reduce" for o in prog.ops)
    else:
        assert k.params["expr"] == ["Add", "f32", ["Mul", "f32", ["arg", 0], ["arg", 1]], ["arg", 2]]
    if case == "scalar":                        # the constant is read through an all-zero view
        assert k.args[1].view.strides == (as_expr(0), as_expr(0)) and prog.ops[k.args[1].src].kind == "constant"
    else:                                       # p's operands are read through the consumer's own view
        assert k.args[0].view.strides == view.view.strides
    _check(g, prog)
    prog0 = lower(sat, _unfused(sat, choose_by_cost(sat)))
    assert any(o.op == "Mul" for o in prog0.ops)
    _check(g, prog0)


ZERO_PRESERVING = {"cast": lambda x, y: x.cast("bf16"), "sin": lambda x, y: x.sin(), "sqrt": lambda x, y: x.sqrt(),
                   "add": lambda x, y: x + y, "mul": lambda x, y: x * y, "lessthan": lambda x, y: x < y,
                   "where": lambda x, y: F.where(x < y, x, y)}
NOT_ZERO_PRESERVING = {"exp2": lambda x, y: x.exp2(), "log2": lambda x, y: x.log2(), "recip": lambda x, y: x.recip(),
                       "mod": lambda x, y: x % y}


@pytest.mark.parametrize("op", sorted(ZERO_PRESERVING))
def test_a_zero_preserving_producer_inlines_through_a_padded_view(op):
    """A padded element reads 0; a producer that maps zeros to zero (fuse-masked-*) recomputes 0 there from
    its operands read through the same padded view, so it inlines into the consumer and is no kernel of its
    own (RoPE's rotate_half reads its angle table through two masks)."""
    g = Graph(op)
    x = F.input_tensor(g, "x", [4, 8], "f32")
    y = F.input_tensor(g, "y", [4, 8], "f32")
    p = ZERO_PRESERVING[op](x, y)
    view = p.pad(1, 1, 2)
    out = view.cast("f32") + F.input_tensor(g, "w", [4, 11], "f32")
    F.output(out, "out")
    sat = saturate(g)
    assert sat.fired(f"fuse-masked-{op}") >= 1 and not sat.fired(f"fuse-view-{op}")
    prog, _ = compile_group(g, sat=sat)
    assert [o.op for o in _kernels(prog) if o.kind == "elementwise"] == ["Fused"]   # p is recomputed
    (k,) = _kernels(prog)
    xy = [a for a in k.args if prog.ops[a.src].params.get("name") in ("x", "y")]
    assert xy and all(a.view.mask is not None for a in xy)             # p's operands read through the pad
    _check(g, prog, tol=1e-2 if op == "cast" else 1e-6)


@pytest.mark.parametrize("case", ["padded-" + op for op in sorted(NOT_ZERO_PRESERVING)]
                         + ["permuted-operand", "broadcast-operand", "padded-operand"])
def test_no_inline_value_through_a_view_near_misses(case):
    """Not inlined through a non-identity view: a masked (padded) consumer view of a producer that does not
    map zeros to zero (a padded element reads 0, not exp2 / log2 / recip / mod of 0s), and a producer with
    an operand read that is neither its own layout nor a scalar (its index map would have to be composed
    with the consumer's view)."""
    g = Graph(case)
    x = F.input_tensor(g, "x", [4, 8], "f32")
    y = F.input_tensor(g, "y", [4, 8], "f32")
    if case.startswith("padded-") and case != "padded-operand":
        p = NOT_ZERO_PRESERVING[case.removeprefix("padded-")](x, y)
        view = p.pad(1, 1, 1)
    elif case == "permuted-operand":
        p = x * F.input_tensor(g, "yt", [8, 4], "f32").permute(1, 0)
        view = p.permute(1, 0)
    elif case == "broadcast-operand":           # w [8] read as [4, 8] is no scalar
        p = x * F.input_tensor(g, "w8", [8], "f32").expand_dim(0, 4)
        view = p.slice(1, 1, 5)
    else:
        p = x.slice(1, 0, 6).pad(1, 1, 1) * y
        view = p.reshape(2, 16)
    out = view + F.input_tensor(g, "w", [int(d.value) for d in view.shape], "f32")
    F.output(out, "out")
    sat = saturate(g)
    cls = _edge_reading(sat, p, "Add")
    assert _inline_ops(sat, cls, raw=True) == set()
    name = g.nodes[p.node].op.lower()
    assert not any(sat.fired(f"fuse-{form}{name}") for form in ("", "view-", "masked-"))
    prog, _ = compile_group(g, sat=sat)
    assert any(o.op == g.nodes[p.node].op for o in prog.ops)     # the producer is its own kernel
    _check(g, prog)


@pytest.mark.parametrize("producer", ["sum", "max", "contiguous"])
def test_no_inline_value_for_a_reduce_or_contiguous_producer(producer):
    g = Graph(producer)
    x = F.input_tensor(g, "x", [4, 8], "f32")
    p = {"sum": lambda: x.sum(1), "max": lambda: x.max(1),
         "contiguous": lambda: x.permute(1, 0).contiguous()}[producer]()
    F.output(p + F.input_tensor(g, "w", [int(d.value) for d in p.shape], "f32"), "out")
    sat = saturate(g)
    assert _inline_ops(sat, _edge_reading(sat, p, "Add"), raw=True) == set()
    assert sat.fired("fuse-add") == 1 and sum(sat.fired(r) for r in FUSE_RULES) == 1   # the output's read
    _check(g, compile_group(g, sat=sat)[0])


@pytest.mark.parametrize("case", ["whole", "slice", "shared"])
def test_a_cast_of_a_gather_is_a_gather_of_its_dtype(case):
    """fuse-gather-cast: a cast reading a gather's whole output in order becomes a gather that stores the cast's
    dtype (one kernel: the embedding's bf16 rows copied as f32). Near misses: a cast of a slice of the gather
    keeps both kernels; a gather that another op reads too is still emitted for it."""
    g = Graph(case)
    table = F.input_tensor(g, "table", [6, 8], "bf16")
    rows = F.gather(table, F.input_tensor(g, "idx", [3], "i32"))
    F.output((rows.slice(1, 0, 4) if case == "slice" else rows).cast(DType.f32), "out")
    if case == "shared":
        F.output(rows * rows, "square")
    sat = saturate(g)
    assert sat.fired("fuse-gather-cast") == (0 if case == "slice" else 1)
    prog, _ = compile_group(g, sat=sat)
    gathers = [o for o in _kernels(prog) if o.kind == "gather"]
    want = {"whole": [DType.f32], "slice": [DType.bf16], "shared": [DType.f32, DType.bf16]}[case]
    assert sorted(o.dtype.value for o in gathers) == sorted(d.value for d in want), _kernels(prog)
    assert len(_kernels(prog)) == {"whole": 1, "slice": 2, "shared": 3}[case], _kernels(prog)
    _check(g, prog, tol=0.0)


def _reduces(prog: Program) -> list[LOp]:
    return [o for o in prog.ops if o.kind == "reduce"]


@pytest.mark.parametrize("case", ["rmsnorm", "softmax", "max"])
def test_a_reduction_fuses_its_prologue(case):
    g = Graph(case)
    x = F.input_tensor(g, "x", [4, 8], "f32")
    if case == "rmsnorm":                       # sum(x*x): one reduce kernel, no Mul
        p = x * x
        F.output(p.sum(-1), "out")
        want = [("reduce", "Sum")]
        expr = ["Mul", "f32", ["arg", 0], ["arg", 0]]
    elif case == "softmax":                     # sum(exp2(x - max)): one reduce; its prologue recomputes the
        e = (x - x.max(-1, keepdim=True)).exp2()   # max as a row reduction (x - max is x + max * -1)
        p = e
        F.output(e.sum(-1), "out")
        want = [("reduce", "Sum")]
        expr = ["Exp2", "f32", ["Add", "f32", ["arg", 0], ["Mul", "f32", ["RowMax", "f32", ["arg", 0]], ["arg", 1]]]]
    else:
        y = F.input_tensor(g, "y", [8], "f32")
        p = (x * y).sin()
        F.output(p.max(-1), "out")
        want = [("reduce", "Max")]
        expr = ["Sin", "f32", ["Mul", "f32", ["arg", 0], ["arg", 1]]]
    sat = saturate(g)
    cls = _edge_reading(sat, p, "SumReduce" if case != "max" else "MaxReduce")
    assert cls in sat.decisions and _inline_ops(sat, cls)
    prog, _ = compile_group(g, sat=sat)
    fused = [o for o in _reduces(prog) if "expr" in o.params]
    assert len(fused) == 1 and fused[0].params["expr"] == expr
    assert [(o.kind, o.op) for o in _kernels(prog)] == want
    k = fused[0]
    n_in = 32
    assert k.flops == as_expr(n_in * (1 + expr_nodes(expr)))
    assert k.bytes == as_expr(sum(4 * int(str(costmodel.view_elements(a.view))) for a in k.args) + 4 * 4)
    _check(g, prog)
    # the unfused selection: the producer is its own kernel and the reduce has no expr
    prog0 = lower(sat, _unfused(sat, choose_by_cost(sat)))
    assert len(_kernels(prog0)) > len(_kernels(prog)) and all("expr" not in o.params for o in _reduces(prog0))
    _check(g, prog0)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_a_sum_of_products_that_is_a_gemm_stays_a_gemm(dtype):
    """A decode GEMV could also be a reduce with a fused x*W prologue (the same bytes and flops); the cost
    model keeps the GEMM (reduce_efficiency), but the fused reduce is a valid choice that computes the same."""
    g = Graph("gemv")
    x = F.input_tensor(g, "x", [1, 64], dtype)
    w = F.input_tensor(g, "w", [32, 64], dtype)
    F.output(F.linear(x, w), "out")
    sat = saturate(g)
    prog, _ = compile_group(g, sat=sat)
    assert [o.kind for o in _kernels(prog)] == ["gemm"]
    fused = [p for p in (lower(sat, random_choice(sat, seed)) for seed in range(12))
             if any("expr" in o.params for o in _reduces(p))]
    assert fused
    for p in fused[:2]:
        _check(g, p, tol=1e-5 if dtype == "f32" else 1e-2)


@pytest.mark.parametrize("case", ["permuted", "sliced", "reshaped", "broadcast"])
def test_a_reduction_fuses_a_producer_through_a_view(case):
    g = Graph(case)
    x = F.input_tensor(g, "x", [4, 8], "f32")
    y = F.input_tensor(g, "y", [4, 8], "f32")
    p = x * y
    view = {"permuted": lambda t: t.permute(1, 0), "sliced": lambda t: t.slice(1, 1, 5),
            "reshaped": lambda t: t.reshape(2, 16), "broadcast": lambda t: t.expand_dim(2, 3)}[case](p)
    F.output(view.sum(-1), "s")
    F.output(view.max(0), "m")
    sat = saturate(g)
    assert sat.fired("fuse-mul") == 0 and sat.fired("fuse-view-mul") >= 1
    prog, _ = compile_group(g, sat=sat)
    if case == "broadcast":
        # max(0) keeps the broadcast dim: inlining would compute x*y three times per value, so that
        # read (the same Ld class as sum(-1)'s) stays a read of x*y's buffer
        assert [o.kind for o in _kernels(prog)] == ["elementwise", "reduce", "reduce"]
        assert [o.params.get("expr") for o in _reduces(prog)] == [None, None]
    else:
        assert [o.kind for o in _kernels(prog)] == ["reduce", "reduce"]      # x*y is recomputed in both
        assert all(o.params.get("expr") == ["Mul", "f32", ["arg", 0], ["arg", 1]] for o in _reduces(prog))
    _check(g, prog)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_a_matvec_does_not_recompute_its_normalised_input_per_row(dtype):
    """``rmsnorm(x) @ W`` for two weights: as reduces with the norm as prologue, every one of W's rows would
    re-normalise x (row_broadcast_reads); the norm is one kernel and both products stay GEMMs."""
    g = Graph("norm-matvec")
    x = F.input_tensor(g, "x", [1, 64], dtype)
    h = F.rms_norm(x, F.input_tensor(g, "g", [64], dtype), 1e-6)
    for k, rows in enumerate((32, 16)):
        F.output(F.linear(h, F.input_tensor(g, f"w{k}", [rows, 64], dtype)), f"out{k}")
    sat = saturate(g)
    assert row_broadcast_reads(sat)
    prog, _ = compile_group(g, sat=sat)
    kinds = [o.kind for o in _kernels(prog)]
    assert kinds.count("gemm") == 2 and all("expr" not in o.params or len(o.args) == 1 for o in _reduces(prog))
    _check(g, prog, tol=1e-5 if dtype == "f32" else 2e-2)


@pytest.mark.parametrize("case", ["padded-exp2", "permuted-operand"])
def test_a_reduction_reads_a_padded_view_or_a_non_lifting_producer_from_the_buffer(case):
    g = Graph(case)
    x = F.input_tensor(g, "x", [4, 8], "f32")
    if case == "padded-exp2":                   # exp2 of a padded 0 is 1: no inline value through the mask
        p = x.exp2()
        view = p.pad(1, 1, 1)
    else:
        p = x * F.input_tensor(g, "yt", [8, 4], "f32").permute(1, 0)
        view = p.permute(1, 0)
    F.output(view.sum(-1), "s")
    F.output(view.max(0), "m")
    sat = saturate(g)
    name = g.nodes[p.node].op
    assert not any(sat.fired(f"fuse-{form}{name.lower()}") for form in ("", "view-", "masked-"))
    prog, _ = compile_group(g, sat=sat)
    assert [o.op for o in _kernels(prog) if o.kind == "elementwise"] == [name]   # the producer runs once
    assert all("expr" not in o.params for o in _reduces(prog))
    _check(g, prog)


def test_a_reduction_recomputes_a_zero_preserving_producer_through_a_padded_view():
    """sum / max over a padded x·y: the product of the padded reads is the padded product (0), so both
    reductions compute it in their own kernels (fuse-masked-mul) and it is no kernel of its own."""
    g = Graph("padded-mul")
    x = F.input_tensor(g, "x", [4, 8], "f32")
    view = (x * F.input_tensor(g, "y", [4, 8], "f32")).pad(1, 1, 1)
    F.output(view.sum(-1), "s")
    F.output(view.max(0), "m")
    sat = saturate(g)
    assert sat.fired("fuse-masked-mul") >= 1
    prog, _ = compile_group(g, sat=sat)
    assert not [o for o in _kernels(prog) if o.kind == "elementwise"]
    assert len(_reduces(prog)) == 2 and all(o.params["expr"][0] == "Mul" for o in _reduces(prog))
    _check(g, prog)


# ====================================================================== norms and softmax
def _rmsnorm_graph(rows: int, dtype: str, add_one: bool) -> Graph:
    g = Graph("rmsnorm")
    x = F.input_tensor(g, "x", [rows, 16], dtype)
    w = F.input_tensor(g, "w", [16], dtype)
    F.output(F.rms_norm(x, w, 1e-6, add_one=add_one), "out")
    return g


@pytest.mark.parametrize("rows, dtype, add_one", [(4, "f32", False), (1, "bf16", False), (3, "bf16", True),
                                                  (1, "f32", True)])
def test_rmsnorm_is_one_row_kernel(rows, dtype, add_one):
    """x * rsqrt(mean(x²) + eps) * w: ONE row kernel. The per-row rsqrt(Σ/n + eps) is lifted through its
    broadcast read to the Σ (the fuse-view-* rules), and the Σ(x·x) read broadcast along its own axis
    is a row reduction (rules/rows.egg) that the normalising kernel computes first."""
    g = _rmsnorm_graph(rows, dtype, add_one)
    sat = saturate(g)
    assert sat.fired("fuse-view-recip") >= 1 and sat.fired("fuse-view-sqrt") >= 1
    assert sat.fired("fuse-row-sum") >= 1
    prog, _ = compile_group(g, sat=sat)
    ks = _kernels(prog)
    assert [(o.kind, o.op) for o in ks] == [("elementwise", "Fused")]
    assert "['Recip', 'f32', ['Sqrt', 'f32'" in str(ks[0].params["expr"])
    assert "['RowSum', 'f32', ['Mul', 'f32', ['arg', 0], ['arg', 0]]]" in str(ks[0].params["expr"]) or \
        "['RowSum', 'f32', ['Mul', 'f32', ['Cast', 'f32', ['arg', 0]], ['Cast', 'f32', ['arg', 0]]]]" in \
        str(ks[0].params["expr"])
    assert prog.version() == 2 and Program.loads(prog.dumps()).ops == prog.ops
    _check(g, prog, tol=1e-6 if dtype == "f32" else 0.0)
    for seed in range(8):                       # every selection computes the same
        _check(g, lower(sat, random_choice(sat, seed)), tol=1e-6 if dtype == "f32" else 1e-2)


def test_a_row_kernel_loads_a_scalar_leaf_once_a_row():
    """The RMSNorm row kernel keeps its row in registers (a slot a lane per GROUP columns); a leaf with one
    value for the whole row (the scalar eps and 1/n, read through all-zero strides) is loaded once into a
    scalar, not once per slot, and the kernel computes what the HLIR does."""
    from lum.builder.codegen import generate_program

    g = _rmsnorm_graph(2, "f32", False)
    prog, _ = compile_group(g)
    (k,) = _kernels(prog)
    src = generate_program(prog)[k.id].source
    scalar = [j for j, a in enumerate(k.args) if all(st == as_expr(0) for st in a.view.strides)]
    assert scalar and all(f"const float lum_a{j} = lum_live ? in{j}[" in src and f"lum_a{j}[" not in src
                          for j in scalar)
    assert "float lum_a0[" in src           # x: a slot a lane
    _check(g, prog)


def _softmax_graph(dtype: str = "f32") -> Graph:
    g = Graph("softmax")
    x = F.input_tensor(g, "x", [4, 8], dtype)
    F.output(x.softmax(-1), "out")
    return g


def test_softmax_is_one_row_kernel():
    """max, Σexp(x − max) and the quotient: one kernel whose Σ row holds the max row (nested rows)."""
    g = _softmax_graph()
    sat = saturate(g)
    assert sat.fired("fuse-row-max") >= 1 and sat.fired("fuse-row-sum") >= 1
    prog, _ = compile_group(g, sat=sat)
    ks = _kernels(prog)
    assert [(o.kind, o.op) for o in ks] == [("elementwise", "Fused")]
    text = str(ks[0].params["expr"])
    assert "['Recip', 'f32', ['RowSum', 'f32', ['Exp2'" in text and "['RowMax', 'f32', ['arg', 0]]" in text
    _check(g, prog)
    for seed in range(8):
        _check(g, lower(sat, random_choice(sat, seed)))


def test_nvrtc_compiles_kernels_with_lifted_reads(tmp_path):
    """The norm, softmax and view-lifted programs' kernels (generated from the programs, arg dtypes from
    their producers) compile with NVRTC."""
    from lum.builder.kernels import compile_group_kernels

    _need_nvrtc()
    g = Graph("lifted")
    x = F.input_tensor(g, "x", [4, 8], "bf16")
    y = F.input_tensor(g, "y", [8, 4], "f32")
    p = x.cast("f32").sum(0) * 0.5
    q = x.cast("f32") * 2.0
    F.output(p.expand_dim(1, 4) + q.permute(1, 0) + y, "out")    # a broadcast [8] and a permute
    graphs = [_rmsnorm_graph(3, "bf16", True), _rmsnorm_graph(1, "f32", False), _softmax_graph("bf16"), g]
    for gr in graphs:
        prog, _ = compile_group(gr)
        assert any(o.op == "Fused" for o in prog.ops)
        res = compile_group_kernels(prog, cache_dir=tmp_path)
        assert res.ptx is not None
        for ks in res.sources.values():
            assert f".entry {ks.name}(" in res.ptx


def test_fused_reduce_with_padded_leaves_and_mixed_dtypes_is_exact():
    """Padded leaves read 0 and the expression still runs there (max(x_pad * 2 + 1) sees the 1s), every
    intermediate keeps its rounding (a bf16 product summed in bf16): bit for bit the HLIR interpreter."""
    g = Graph("mixed")
    x = F.input_tensor(g, "x", [4, 6], "bf16")
    w = F.input_tensor(g, "w", [8], "bf16")
    xp = x.pad(1, 1, 1).cast("f32")
    h = (xp * w.cast("f32")).cast("bf16")
    F.output(h.sum(-1), "s")
    F.output((xp * 2.0 + 1.0).max(-1), "m")
    F.output(((xp * -3.0).cast("i32") % F.constant(g, 5, DType.i32)).sum(-1), "i")
    inputs = {"x": RNG.uniform(-2.0, -0.5, (4, 6)).astype(ml_dtypes.bfloat16),
              "w": RNG.uniform(0.5, 2.0, (8,)).astype(ml_dtypes.bfloat16)}
    sat = saturate(g)
    prog, _ = compile_group(g, sat=sat)
    fused = [o for o in _reduces(prog) if "expr" in o.params]
    assert len(fused) == 3 and all(o.args[0].view.mask is not None for o in fused)
    assert any("bf16" in str(o.params["expr"]) for o in fused)
    _check(g, prog, inputs, tol=0.0)
    for seed in range(6):
        _check(g, lower(sat, random_choice(sat, seed)), inputs, tol=0.0)


def test_a_scatter_computes_its_rows():
    """A scatter's src rows may be recomputed inline (a fused prologue; never its dest or indices): the KV
    cache write computes RoPE and the cast to the cache dtype. Every selection computes the same."""
    g = Graph("scatter")
    cache = F.input_tensor(g, "cache", [6, 8], "f32", role="state")
    new = F.input_tensor(g, "new", [2, 8], "f32")
    pos = F.input_tensor(g, "pos", [2], "i64")
    src = (new * 2.0).sin()
    F.output(F.scatter(cache, src, pos), "cache", role="state")
    sat = saturate(g)
    assert _inline_ops(sat, _edge_reading(sat, src, "Scatter")) == {"XSin"}
    prog, _ = compile_group(g, sat=sat)
    (k,) = _kernels(prog)
    assert k.kind == "scatter_nocopy" and k.params["expr"] == ["Sin", "f32", ["Mul", "f32", ["arg", 0], ["arg", 1]]]
    assert len(k.args) == 4 and prog.ops[k.args[-1].src].params["name"] == "pos" and prog.version() == 2
    assert Program.loads(prog.dumps()).ops == prog.ops
    _check(g, prog)
    kinds = set()
    for seed in range(8):
        p = lower(sat, random_choice(sat, seed))
        kinds.add(tuple(o.kind for o in _kernels(p)))
        _check(g, p)
    assert (("elementwise", "scatter_nocopy") in kinds or ("elementwise", "scatter") in kinds) and len(kinds) > 1


def test_an_in_place_scatter_never_recomputes_rows_from_its_destination():
    """src rows computed from the destination's own buffer would race with the rows being written: the
    in-place option is dropped (a copying scatter stays), as rules/inplace.egg does for a direct read."""
    g = Graph("scatter-self")
    cache = F.input_tensor(g, "cache", [6, 8], "f32", role="state")
    pos = F.input_tensor(g, "pos", [2], "i64")
    src = cache.slice(0, 0, 2) * 2.0
    F.output(F.scatter(cache, src, pos), "cache", role="state")
    sat = saturate(g)
    assert not any(n.op == "KScatterNoCopy" for c in sat.reachable for n in sat.options[c])
    for seed in range(4):
        _check(g, lower(sat, random_choice(sat, seed)))


def test_a_class_inlined_for_one_consumer_is_still_emitted_for_the_others():
    """m is read through one Ld class by a reduce, an Add and an Output: choosing the inline value fuses
    the Add and the reduce; the Mul kernel still runs for the output."""
    g = Graph("shared")
    x = F.input_tensor(g, "x", [4, 8], "f32")
    z = F.input_tensor(g, "z", [4, 8], "f32")
    m = x * z
    F.output(m.sum(1), "s")
    F.output(m + z, "a")
    F.output(m, "m")
    sat = saturate(g)
    cls = _edge_reading(sat, m, "Add")
    assert cls == _edge_reading(sat, m, "SumReduce") and cls in sat.decisions
    prog = lower(sat, _inline_choice(sat, cls))
    ops = {(o.kind, o.op) for o in _kernels(prog)}
    assert ops == {("elementwise", "Mul"), ("reduce", "Sum"), ("elementwise", "Fused")}
    assert _reduces(prog)[0].params["expr"] == ["Mul", "f32", ["arg", 0], ["arg", 1]]
    _check(g, prog)
    # a program output alone also keeps the buffer
    g2 = Graph("out")
    x2 = F.input_tensor(g2, "x", [4, 8], "f32")
    m2 = x2 * x2
    F.output(m2, "m")
    F.output(m2 + x2, "a")
    sat2 = saturate(g2)
    prog2 = lower(sat2, _inline_choice(sat2, _edge_reading(sat2, m2, "Add")))
    assert sorted(o.op for o in _kernels(prog2)) == ["Fused", "Mul"]
    _check(g2, prog2)


def test_random_choices_of_fusable_classes_all_compute_the_same():
    g = Graph("rand")
    x = F.input_tensor(g, "x", [3, 5], "f32")
    y = F.input_tensor(g, "y", [5], "f32")
    a = (x * y + 1.0).sqrt()
    b = a * a.sum(1, keepdim=True).recip()
    F.output((b.exp2() + a).sin(), "out")
    sat = saturate(g)
    assert sum(bool(_inline_ops(sat, c)) for c in sat.decisions) >= 4
    counts = set()
    for seed in range(20):
        prog = lower(sat, random_choice(sat, seed))
        counts.add(len(_kernels(prog)))
        _check(g, prog)
    assert len(counts) > 2                       # fuse / no-fuse really varies the program


def test_the_expression_size_cap_keeps_shared_subtrees_from_blowing_up(monkeypatch):
    g = Graph("dag")
    t = F.input_tensor(g, "x", [4, 8], "f32")
    for _ in range(24):                          # each step reads t twice: the tree doubles every step
        t = (t * t).sin() * 0.5 + t * 0.25
    F.output(t, "out")
    sat = saturate(g)
    t0 = time.perf_counter()
    prog, _ = compile_group(g, sat=sat)
    assert time.perf_counter() - t0 < 5
    fused = [o for o in prog.ops if o.op == "Fused"]
    assert len(fused) > 1

    def size(e):
        return 1 if e[0] == "arg" else 1 + sum(size(k) for k in e[2:])

    assert max(size(o.params["expr"]) for o in fused) <= 3 * extract.FUSE_MAX_NODES + 1
    _check(g, prog, tol=1e-5)
    monkeypatch.setattr(extract, "FUSE_MAX_NODES", 2)
    small = compile_group(g, sat=sat)[0]
    assert len(_kernels(small)) > len(_kernels(prog))
    _check(g, small, tol=1e-5)


# ====================================================================== LLIR
def _fused_program(expr, nargs: int = 2, dtype: DType = DType.f32) -> Program:
    shape = (as_expr(2), as_expr(3))
    v = ShapeTracker.contiguous(shape)
    ops = [LOp(k, "input", "Input", (), shape, DType.f32, {"name": f"in{k}"}) for k in range(nargs)]
    ops.append(LOp(nargs, "elementwise", "Fused", tuple(Arg(k, v) for k in range(nargs)), shape, dtype,
                   {"expr": expr}))
    ops.append(LOp(nargs + 1, "output", "Output", (Arg(nargs, v),), shape, dtype, {"name": "y"}))
    return Program("f", ops)


def test_fused_llir_round_trips_and_runs():
    expr = ["Add", "f32", ["Mul", "bf16", ["arg", 0], ["arg", 1]], ["Cast", "i32", ["arg", 0]]]
    prog = _fused_program(expr)
    again = Program.loads(prog.dumps())
    assert again.ops[2].params["expr"] == expr
    a = np.array([[1.5, -2.7, 3.3], [0.1, 9.9, -0.5]], np.float32)
    b = np.array([[1.01, 3.0, -7.0], [2.0, 0.3, 1.1]], np.float32)
    prod = (a.astype(np.float64) * b).astype(ml_dtypes.bfloat16).astype(np.float64)
    want = (prod + np.trunc(a)).astype(np.float32)
    np.testing.assert_array_equal(execute(again, {"in0": a, "in1": b})["y"], want)


@pytest.mark.parametrize("expr, msg", [
    (["Foo", "f32", ["arg", 0]], "unknown elementwise op 'Foo'"),
    (["Fused", "f32", ["arg", 0]], "unknown elementwise op 'Fused'"),
    (["Add", "f32", ["arg", 0]], "Add in expr node root takes 2 argument"),
    (["Exp2", "f32", ["arg", 0], ["arg", 1]], "Exp2 in expr node root takes 1 argument"),
    (["Exp2", "f32", ["arg", 2]], "must be ['arg', k] with 0 <= k < 2"),
    (["Exp2", "f32", ["arg", -1]], "must be ['arg', k]"),
    (["Exp2", "f32", ["Sqrt", "f8", ["arg", 0]]], "unknown dtype 'f8'"),
    (["Exp2", 3, ["arg", 0]], "unknown dtype '3'"),
    (["Exp2", "bf16", ["arg", 0]], "the expr root has dtype bf16, the op f32"),
    (["arg", 0], "the expr root must be an op node"),
    ([], "is not a non-empty list"),
    (None, "is not a non-empty list"),
])
def test_fused_expr_validation(expr, msg):
    prog = _fused_program(expr)
    with pytest.raises(ValueError) as e1:
        Program.loads(prog.dumps())
    assert msg in str(e1.value)
    with pytest.raises(BackendError) as e2:
        execute(prog, {"in0": np.ones((2, 3), np.float32), "in1": np.ones((2, 3), np.float32)})
    assert msg in str(e2.value)


def _reduce_program(expr, op: str = "Sum", dtype: DType = DType.f32) -> Program:
    shape = (as_expr(2), as_expr(3))
    v = ShapeTracker.contiguous(shape)
    ops = [LOp(k, "input", "Input", (), shape, DType.f32, {"name": f"in{k}"}) for k in range(2)]
    ops.append(LOp(2, "reduce", op, (Arg(0, v), Arg(1, v)), (as_expr(2),), dtype, {"axis": 1, "expr": expr}))
    ops.append(LOp(3, "output", "Output", (Arg(2, ShapeTracker.contiguous((2,))),), (as_expr(2),), dtype,
                   {"name": "y"}))
    return Program("r", ops)


def test_fused_reduce_llir_round_trips_runs_and_validates():
    a = np.array([[1.5, -2.7, 3.3], [0.1, 9.9, -0.5]], np.float32)
    b = np.array([[1.01, 3.0, -7.0], [2.0, 0.3, 1.1]], np.float32)
    expr = ["Mul", "bf16", ["arg", 0], ["Add", "f32", ["arg", 1], ["arg", 0]]]   # the root's dtype is its own
    for op, fn in (("Sum", np.sum), ("Max", np.max)):
        again = Program.loads(_reduce_program(expr, op).dumps())
        assert again.ops[2].params["expr"] == expr
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        x = (a64 * (b64 + a64).astype(np.float32)).astype(ml_dtypes.bfloat16).astype(np.float64)
        want = fn(x, axis=1).astype(np.float32)
        np.testing.assert_array_equal(execute(again, {"in0": a, "in1": b})["y"], want)
    for bad, msg in ((["Exp2", "f32", ["arg", 2]], "must be ['arg', k] with 0 <= k < 2"),
                     (["arg", 0], "the expr root must be an op node"), (None, "is not a non-empty list")):
        prog = _reduce_program(bad)
        with pytest.raises(ValueError, match=re.escape(msg)):
            Program.loads(prog.dumps())
        with pytest.raises(BackendError, match=re.escape(msg)):
            execute(prog, {"in0": a, "in1": b})
    two = _reduce_program(["Exp2", "f32", ["arg", 0]])
    del two.ops[2].params["expr"]                   # two args need an expr
    with pytest.raises(BackendError, match="takes 1 argument"):
        execute(two, {"in0": a, "in1": b})


# ====================================================================== codegen
def _fused_ops() -> list[tuple[LOp, list[DType], dict]]:
    """Fused kernels over f32 / bf16 / f16 leaves with mixed intermediate dtypes (16-bit, int, bool),
    vectorised (contiguous) and scalar (permuted, padded, broadcast) reads."""
    s = Var("s")
    shape = (s, as_expr(8), as_expr(16))
    x = ShapeTracker.contiguous(shape)
    xp = ShapeTracker.contiguous((s, 16, 8)).permute((0, 2, 1))
    xpad = ShapeTracker.contiguous((s, 8, 12)).pad(2, 1, 3)
    bc = ShapeTracker.contiguous((16,)).expand_dim(0, 8).expand_dim(0, s)
    out = []
    for dt in (DType.f32, DType.bf16, DType.f16):
        d = dt.value
        t = ["Add", "f32", ["Mul", "f32", ["Cast", "f32", ["arg", 0]], ["arg", 2]], ["Cast", "f32", ["arg", 1]]]
        half = ["Cast", "f32", ["Cast", "bf16" if dt != DType.bf16 else "f16", t]]
        cond = ["LessThan", "bool", ["arg", 2], half]
        mod = ["Cast", "f32", ["Mod", "i64", ["Cast", "i64", t], ["Cast", "i64", ["arg", 2]]]]
        expr = ["Cast", d, ["Where", "f32", cond, ["Exp2", "f32", half],
                            ["Add", "f32", mod, ["Sqrt", "f32", ["Mul", "f32", half, half]]]]]
        for views, kw in (((x, x, bc), {}), ((xp, xpad, bc), {}), ((x, xpad, x), {"math": "f64"})):
            out.append((LOp(3, "elementwise", "Fused", tuple(Arg(k, v) for k, v in enumerate(views)), shape, dt,
                            {"expr": expr}), [dt, dt, DType.f32], kw))
    return out


def test_fused_body_computes_each_subtree_once():
    from lum.builder.codegen import generate

    op, dts, _ = _fused_ops()[0]
    ks = generate(op, ["s"], arg_dtypes=dts)
    assert ks.name.startswith("lum_elementwise_fused_")
    body = ks.body
    assert body.count("lum_bf16_to_f32(lum_f32_to_bf16(") == 1     # the 16-bit intermediate, rounded once
    assert body.count("exp2f(") == 1 and body.count("lum_imod_floor(") == 1
    assert "lum_vec<" in body                                      # the vectorised path
    other = generate(_fused_ops()[4][0], ["s"], arg_dtypes=_fused_ops()[4][1])
    assert other.name != ks.name


def test_nvrtc_compiles_fused_kernels(tmp_path):
    from lum.builder.codegen import generate

    _need_nvrtc()
    kernels = [generate(op, ["s"], arg_dtypes=dts, **kw) for op, dts, kw in _fused_ops()]
    assert len({k.name for k in kernels}) == len(kernels)
    _compiles_cleanly(kernels, tmp_path)


def _fused_reduce_ops() -> list[tuple[LOp, list[DType], dict]]:
    """Sum / Max with a fused prologue over f32 / bf16 leaves: contiguous, permuted, broadcast and padded
    (along the reduced axis and across it) reads, the axis innermost, in the middle and outermost."""
    s = Var("s")
    shape = (s, as_expr(8), as_expr(16))
    x = ShapeTracker.contiguous(shape)
    xp = ShapeTracker.contiguous((s, 16, 8)).permute((0, 2, 1))
    xpad = ShapeTracker.contiguous((s, 8, 12)).pad(2, 1, 3)
    rpad = ShapeTracker.contiguous((s, 6, 16)).pad(1, 2, 0)
    bc = ShapeTracker.contiguous((16,)).expand_dim(0, 8).expand_dim(0, s)
    out = []
    for dt in (DType.f32, DType.bf16):
        d = dt.value
        h = ["Add", "f32", ["Cast", "f32", ["arg", 0]], ["Mul", "f32", ["arg", 1], ["arg", 2]]]
        sq = ["Mul", "f32", h, h]
        soft = ["Exp2", d, ["Add", "f32", ["Cast", "f32", ["arg", 0]], ["Mul", "f32", ["arg", 1], ["arg", 2]]]]
        for red, expr in (("Sum", ["Cast", d, sq]), ("Sum", soft), ("Max", soft)):
            for views, axis, kw in (((x, bc, x), 2, {}), ((xpad, bc, xp), 2, {"group": 64}),
                                    ((rpad, xp, bc), 1, {}), ((xp, xpad, rpad), 0, {"acc": "f64"})):
                oshape = tuple(e for k, e in enumerate(shape) if k != axis)
                out.append((LOp(3, "reduce", red, tuple(Arg(k, v) for k, v in enumerate(views)), oshape, dt,
                                {"axis": axis, "expr": expr}), [dt, DType.f32, DType.f32], kw))
    return out


def test_nvrtc_compiles_fused_reduce_kernels(tmp_path):
    from lum.builder.codegen import generate

    _need_nvrtc()
    kernels = [generate(op, ["s"], arg_dtypes=dts, **kw) for op, dts, kw in _fused_reduce_ops()]
    assert len({k.name for k in kernels}) == len(kernels)
    assert all(k.name.startswith("lum_reduce_") for k in kernels)
    assert "const bool lum_v2 = " in kernels[3].body     # rpad padded across the axis: a row guard per leaf
    _compiles_cleanly(kernels, tmp_path)


# ====================================================================== model-level kernel counts
def _decode_counts(model: str) -> tuple[dict[str, int], dict[str, int], dict[str, int], dict[str, int]]:
    """(kernels, elementwise kernels, Sums that read a materialised Mul through its identity view: the
    norms' sum(x*x) and decode attention's q·k, reduce kernels) of one decode step, unfused and fused,
    by the cost model's choice."""
    from lum.builder.models import load_spec
    from lum.builder.partition import chunk_graph, group_chunks, partition

    spec = load_spec(random_name=model, dtype="bf16", max_seq=64)
    g = spec.graphs["decode"]
    chunks = partition(g)
    kernels = {"unfused": 0, "fused": 0}
    elementwise = {"unfused": 0, "fused": 0}
    mul_sums = {"unfused": 0, "fused": 0}
    reduces = {"unfused": 0, "fused": 0}
    for grp in group_chunks(g, chunks):
        sat = saturate(chunk_graph(g, grp.representative))
        choice = choose_by_cost(sat)
        for key, ch in (("unfused", _unfused(sat, choice)), ("fused", choice)):
            prog = lower(sat, ch)
            ks = prog.kernels()
            kernels[key] += len(grp) * len(ks)
            elementwise[key] += len(grp) * sum(o.kind == "elementwise" for o in ks)
            mul_sums[key] += len(grp) * sum(o.op == "Sum" and prog.ops[a.src].op == "Mul"
                                            and _identity(a.view, prog.ops[a.src].shape) for o in ks for a in o.args)
            argmax = _only_for(prog, "next_token")
            reduces[key] += len(grp) * sum(o.kind == "reduce" and not _combines_attention(prog, o)
                                           and o.id not in argmax for o in ks)
    return kernels, elementwise, mul_sums, reduces


def _only_for(prog: Program, name: str) -> set[int]:
    """Ops that only the program output ``name`` needs (greedy decoding's argmax: its max and first-index
    reductions are not norms or softmax)."""
    def upstream(roots: list[int]) -> set[int]:
        seen: set[int] = set()
        while roots:
            i = roots.pop()
            if i not in seen:
                seen.add(i)
                roots.extend(a.src for a in prog.ops[i].args)
        return seen
    outs = prog.outputs()
    mine = upstream([o.id for o in outs if o.params.get("name") == name])
    return mine - upstream([o.id for o in outs if o.params.get("name") != name])


def _combines_attention(prog: Program, o: LOp) -> bool:
    """The reduce that combines an attention op's chunk partials (builder/extract.attention_ops)."""
    return o.kind == "reduce" and any(prog.ops[a.src].kind == "attention" for a in o.args)


def _identity(v: ShapeTracker, shape) -> bool:
    """``v`` reads a buffer of ``shape`` whole and in order (unit dims may have any stride)."""
    c = ShapeTracker.contiguous(shape)
    return (v.shape == c.shape and v.offset == c.offset and v.mask is None
            and all(a == b or d == as_expr(1) for a, b, d in zip(v.strides, c.strides, c.shape)))


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
def test_decode_kernel_counts_drop(model):
    """Elementwise chains fuse, reductions fuse their prologues, per-row values read through broadcasts
    (rsqrt, 1/Σ) are recomputed by their consumers, norms and softmax are row kernels, and the KV-cache
    writes compute RoPE and the cast, decode attention is one kernel and its combine (tiny-llama 135 -> 40
    decode kernels, tiny-gemma3 355 -> 63, both with greedy decoding's argmax; 61 / 107 before row kernels
    and scatter prologues). "Unfused" keeps the fused selection's other choices."""
    kernels, elementwise, mul_sums, reduces = _decode_counts(model)
    print(f"{model} decode: kernels {kernels['unfused']} -> {kernels['fused']}, "
          f"elementwise {elementwise['unfused']} -> {elementwise['fused']}, "
          f"reduces {reduces['unfused']} -> {reduces['fused']}, "
          f"Sums of a materialised Mul {mul_sums['unfused']} -> {mul_sums['fused']}")
    assert elementwise["fused"] * 2 <= elementwise["unfused"]
    assert reduces["fused"] == 0 < reduces["unfused"]        # every norm and softmax is a row kernel
    # (the reduce combining decode attention's chunks is not counted: it replaces q·k, softmax and p·v)
    assert kernels["fused"] * 3 <= kernels["unfused"]
    assert mul_sums["unfused"] > 0 and mul_sums["fused"] == 0


def _square(expr) -> bool:
    return isinstance(expr, list) and expr[0] == "Mul" and expr[2] == expr[3]


def _row_squares(expr) -> list:
    """The RowSum(x·x) nodes of a Fused tree (the Σx² of an RMSNorm computed in its consumer's kernel)."""
    if not isinstance(expr, list) or expr[0] == "arg":
        return []
    here = [expr] if expr[0] == "RowSum" and _square(expr[2]) else []
    return here + [x for k in expr[2:] for x in _row_squares(k)]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
def test_decode_norms_are_row_kernels(model):
    """Every RMSNorm of a decode step is computed inside the kernel that consumes the normalised x (a row
    kernel: its Σ(x·x) is a row reduction), so a decode step has no reduce kernel but greedy decoding's
    argmax, and no kernel materialises a per-row rsqrt or softmax's 1/Σ. Each norm's Σ(x·x) appears in at
    least one kernel."""
    from lum.builder.models import load_spec
    from lum.builder.partition import chunk_graph, group_chunks, partition

    spec = load_spec(random_name=model, dtype="bf16", max_seq=64)
    cfg = spec.config
    g = spec.graphs["decode"]
    norms = 0
    for grp in group_chunks(g, partition(g)):
        cg = chunk_graph(g, grp.representative)
        prog = compile_group(cg)[0]
        ks = _kernels(prog)
        argmax = _only_for(prog, "next_token")
        assert not any(o.kind == "reduce" and not _combines_attention(prog, o) and o.id not in argmax
                       for o in ks), [o.op for o in ks]
        for o in ks:
            root = o.params["expr"][0] if o.op == "Fused" else o.op
            assert not (o.kind == "elementwise" and root in ("Recip", "Sqrt")), (o.op, o.params)
        in_kernels = sum(len(_row_squares(o.params.get("expr"))) for o in ks)
        hlir_norms = sum(1 for n in cg.nodes if n.op == "SumReduce" and cg.nodes[n.inputs[0].src].op == "Mul"
                         and cg.nodes[n.inputs[0].src].inputs[0] == cg.nodes[n.inputs[0].src].inputs[1])
        assert in_kernels >= hlir_norms
        norms += len(grp) * hlir_norms
    per_layer = 6 if model == "tiny-gemma3" else 2   # gemma3: pre/post attention and FFN norms, q and k norms
    assert norms == per_layer * cfg.num_layers + 1         # and the final norm