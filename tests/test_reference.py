"""The numpy reference interpreter on hand-built HLIR: each primop's semantics, storage rounding per
dtype, strided/masked views, the Mul→SumReduce fast path, and its error messages."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from lum.builder import frontend as F
from lum.builder.hlir import PRIMOPS, Edge, Graph, Node
from lum.builder.reference import ReferenceError, round_to, run_graph, view_of
from lum.format.dtypes import DType
from lum.format.expr import Var, as_expr
from lum.format.shapetracker import ShapeTracker

C = ShapeTracker.contiguous


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def nonzero(r, shape, lo=0.1, hi=2.0):
    return r.uniform(lo, hi, shape) * r.choice([-1.0, 1.0], shape)


def inp(g: Graph, name: str, shape, dtype=DType.f32) -> Node:
    return g.add("Input", (), tuple(as_expr(d) for d in shape), dtype, name=name, role="input")


def out(g: Graph, node: Node, name: str = "out", view: ShapeTracker | None = None) -> None:
    view = view or C(node.shape)
    g.add("Output", (Edge(node.id, view),), view.shape, node.dtype, name=name, role="output")


def e(node: Node, view: ShapeTracker | None = None) -> Edge:
    return Edge(node.id, view or C(node.shape))


# ====================================================================== round_to
@pytest.mark.parametrize("dtype", [DType.f32, DType.f16, DType.bf16])
def test_round_to_floats_matches_astype(dtype):
    x = nonzero(rng(1), 1000, 1e-3, 1e3)
    got = round_to(x, dtype)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, x.astype(dtype.np).astype(np.float64))


@pytest.mark.parametrize("dtype", [DType.i32, DType.i64])
def test_round_to_ints_truncates_toward_zero(dtype):
    got = round_to(np.array([-2.9, -2.5, -0.5, 0.5, 2.5, 2.9]), dtype)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, [-2, -2, 0, 0, 2, 2])


def test_round_to_bool_and_overflow():
    np.testing.assert_array_equal(round_to(np.array([0.0, -0.0, 0.1, -3.0]), DType.bool), [False, False, True, True])
    with np.errstate(over="ignore"):
        assert np.isinf(round_to(np.array([1e6]), DType.f16)).all()
    assert round_to(np.array([1e6]), DType.bf16)[0] == float(ml_dtypes.bfloat16(1e6))


# ====================================================================== view_of
def test_view_of_strided_offset_and_broadcast():
    buf = np.arange(24.0)
    st = C((2, 3, 4)).permute((2, 0, 1)).slice(0, 1, 3).expand_dim(1, 5)
    got = view_of(buf, st, {})
    want = np.broadcast_to(np.arange(24.0).reshape(2, 3, 4).transpose(2, 0, 1)[1:3][:, None], (2, 5, 2, 3))
    np.testing.assert_array_equal(got, want)
    assert np.shares_memory(got, buf), "an unmasked view must not copy"


def test_view_of_padding_reads_zero():
    buf = np.arange(1.0, 7.0)
    st = C((2, 3)).pad(1, 1, 2).pad(0, 0, 1)
    np.testing.assert_array_equal(view_of(buf, st, {}), np.pad(np.arange(1.0, 7.0).reshape(2, 3), ((0, 1), (1, 2))))
    # a slice entirely inside the padding is all zeros
    np.testing.assert_array_equal(view_of(buf, st.slice(1, 4, 6), {}), np.zeros((3, 2)))


def test_view_of_symbolic():
    s = Var("s")
    st = C((s, 4)).slice(0, 1, s).pad(0, 0, 1)
    for n in (1, 2, 5):
        buf = np.arange(n * 4.0)
        want = np.pad(buf.reshape(n, 4)[1:], ((0, 1), (0, 0)))
        np.testing.assert_array_equal(view_of(buf, st, {"s": n}), want)


def test_view_of_out_of_bounds_raises():
    st = ShapeTracker(C((3,)).shape, C((3,)).strides, as_expr(2))  # reads elements 2..4 of 4
    with pytest.raises(ReferenceError, match="buffer of 4"):
        view_of(np.arange(4.0), st, {})
    with pytest.raises(ReferenceError, match="negative"):
        view_of(np.arange(4.0), C((Var("s") - 3,)), {"s": 1})


# ====================================================================== primops one by one
def _unary_graph(op, dtype=DType.f32):
    g = Graph(op)
    x = inp(g, "x", (5, 3), dtype)
    out(g, g.add(op, (e(x),), x.shape, dtype))
    return g


@pytest.mark.parametrize("op,fn", [("Exp2", np.exp2), ("Log2", np.log2), ("Sin", np.sin), ("Sqrt", np.sqrt),
                                   ("Recip", lambda v: 1.0 / v)])
@pytest.mark.parametrize("dtype", [DType.f32, DType.f16, DType.bf16])
def test_unary_primops(op, fn, dtype):
    x = np.abs(nonzero(rng(2), (5, 3), 0.1, 5.0))
    got = run_graph(_unary_graph(op, dtype), {"x": x})["out"]
    xq = x.astype(dtype.np).astype(np.float64)
    assert got.dtype == dtype.np
    # exactly one rounding of the float64 result
    np.testing.assert_array_equal(got, fn(xq).astype(dtype.np))


@pytest.mark.parametrize("op,fn", [("Add", np.add), ("Mul", np.multiply), ("Mod", np.mod), ("LessThan", np.less)])
@pytest.mark.parametrize("dtype", [DType.f32, DType.bf16, DType.i32])
def test_binary_primops(op, fn, dtype):
    r = rng(3)
    if dtype.is_int:
        a, b = r.integers(-20, 20, (4, 3)), r.integers(1, 6, (4, 3)) * r.choice([-1, 1], (4, 3))
    else:
        a, b = nonzero(r, (4, 3)), nonzero(r, (4, 3))
    g = Graph()
    x, y = inp(g, "a", (4, 3), dtype), inp(g, "b", (4, 3), dtype)
    res_dtype = DType.bool if op == "LessThan" else dtype
    out(g, g.add(op, (e(x), e(y)), x.shape, res_dtype))
    got = run_graph(g, {"a": a, "b": b})["out"]
    aq, bq = a.astype(dtype.np).astype(dtype.compute_np), b.astype(dtype.np).astype(dtype.compute_np)
    assert got.dtype == res_dtype.np
    np.testing.assert_array_equal(got, fn(aq, bq).astype(res_dtype.np))


def test_constant_iota_where_reduce_contiguous():
    g = Graph()
    s = Var("s")
    k = g.add("Constant", (), (), DType.f32, value=0.1)
    tab = g.add("Constant", (), (as_expr(3),), DType.bf16, data=(1.0, 1.0 + 2**-9, 3.0))
    io = g.add("Iota", (), (s,), DType.i64, n=s)
    x = inp(g, "x", (s, 3))
    cond = g.add("LessThan", (e(io, C((s,)).expand_dim(1, 3)), e(k, C(()).expand_dim(0, s).expand_dim(1, 3))),
                 (s, as_expr(3)), DType.bool)  # i64 < f32 is never built by the frontend; numpy compares values
    w = g.add("Where", (e(cond), e(x), e(tab, C((3,)).expand_dim(0, s))), (s, as_expr(3)), DType.f32)
    sm = g.add("SumReduce", (e(w),), (s,), DType.f32, axis=1)
    mx = g.add("MaxReduce", (e(x),), (as_expr(3),), DType.f32, axis=0)
    ct = g.add("Contiguous", (e(x, C((s, 3)).permute((1, 0))),), (as_expr(3), s), DType.f32)
    for node, name in ((k, "k"), (tab, "tab"), (io, "iota"), (w, "where"), (sm, "sum"), (mx, "max"), (ct, "ct")):
        out(g, node, name)
    x_val = nonzero(rng(4), (4, 3))
    got = run_graph(g, {"x": x_val}, {"s": 4})
    xq = x_val.astype(np.float32)
    assert got["k"] == np.float32(0.1) and got["k"].dtype == np.float32
    np.testing.assert_array_equal(got["tab"], np.array([1.0, 1.0, 3.0], ml_dtypes.bfloat16))  # rounded to bf16
    np.testing.assert_array_equal(got["iota"], np.arange(4))
    want_w = np.where((np.arange(4) < 0.1)[:, None], xq, np.array([1.0, 1.0, 3.0], np.float32))
    np.testing.assert_array_equal(got["where"], want_w)
    np.testing.assert_allclose(got["sum"], want_w.astype(np.float64).sum(1), rtol=1e-6)
    np.testing.assert_array_equal(got["max"], xq.max(0))
    np.testing.assert_array_equal(got["ct"], xq.T)


def test_cast_primop():
    g = Graph()
    x = inp(g, "x", (6,), DType.f32)
    for dt in (DType.i32, DType.bf16, DType.bool):
        out(g, g.add("Cast", (e(x),), x.shape, dt), str(dt))
    v = np.array([-2.5, -1.0, 0.0, 0.75, 3.99, 1.0 + 2**-9])
    got = run_graph(g, {"x": v})
    np.testing.assert_array_equal(got["i32"], [-2, -1, 0, 0, 3, 1])
    np.testing.assert_array_equal(got["bf16"], v.astype(np.float32).astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(got["bool"], v != 0)


def test_gather_and_scatter_primops():
    g = Graph()
    table = inp(g, "t", (5, 2))
    idx = inp(g, "i", (2, 2), DType.i32)
    gat = g.add("Gather", (e(table), e(idx)), (as_expr(2), as_expr(2), as_expr(2)), DType.f32)
    src = inp(g, "src", (2, 2))
    sidx = inp(g, "si", (2,), DType.i64)
    sc = g.add("Scatter", (e(table), e(src), e(sidx)), table.shape, DType.f32)
    out(g, gat, "gather")
    out(g, sc, "scatter")
    t, s = nonzero(rng(5), (5, 2)), nonzero(rng(6), (2, 2))
    t_copy = t.copy()
    got = run_graph(g, {"t": t, "i": np.array([[4, 0], [2, 2]]), "src": s, "si": np.array([3, 0])})
    np.testing.assert_array_equal(got["gather"], t.astype(np.float32)[[[4, 0], [2, 2]]])
    want = t.astype(np.float32).copy()
    want[[3, 0]] = s.astype(np.float32)
    np.testing.assert_array_equal(got["scatter"], want)
    np.testing.assert_array_equal(t, t_copy)  # the caller's array is not written


@pytest.mark.parametrize("op", ["Gather", "Scatter"])
@pytest.mark.parametrize("bad", [5, -1, 100])
def test_index_out_of_range(op, bad):
    g = Graph()
    table = inp(g, "t", (5, 2))
    idx = inp(g, "i", (2,), DType.i64)
    if op == "Gather":
        node = g.add("Gather", (e(table), e(idx)), (as_expr(2), as_expr(2)), DType.f32)
    else:
        src = inp(g, "s", (2, 2))
        node = g.add("Scatter", (e(table), e(src), e(idx)), table.shape, DType.f32)
    out(g, node)
    with pytest.raises(ReferenceError, match="out of range"):
        run_graph(g, {"t": np.ones((5, 2)), "s": np.ones((2, 2)), "i": np.array([0, bad])})


# ====================================================================== storage rounding between nodes
def test_intermediates_round_to_their_dtype():
    g = Graph()
    x = F.input_tensor(g, "x", (3,), "bf16")
    y = F.input_tensor(g, "y", (3,), "f16")
    F.output((x + 2**-9) - 1.0, "bf16")   # 1 + 2^-9 is not representable in bf16: rounds to 1
    F.output((y * 1000.0) * 0.001, "f16")  # overflows f16 in the middle
    got = run_graph(g, {"x": np.ones(3), "y": np.array([1.0, 100.0, 70.0])})
    np.testing.assert_array_equal(got["bf16"].astype(np.float64), [0.0, 0.0, 0.0])
    assert np.isinf(got["f16"][1:]).all() and abs(float(got["f16"][0]) - 1.0) < 1e-3


def test_inputs_are_rounded_and_converted():
    g = Graph()
    for name, dt in (("f", "f32"), ("b", "bf16"), ("i", "i32"), ("m", "bool")):
        x = F.input_tensor(g, name, (2,), dt)
        F.output(x, name)
    got = run_graph(g, {"f": np.array([0.1, 1 / 3]), "b": np.array([1.0, 1.0 + 2**-10], np.float32),
                        "i": np.array([7, -3], np.int8), "m": np.array([True, False])})
    assert got["f"].dtype == np.float32 and (got["f"] == np.float32([0.1, 1 / 3])).all()
    assert got["b"].dtype == ml_dtypes.bfloat16 and (got["b"].astype(np.float64) == [1.0, 1.0]).all()
    assert got["i"].dtype == np.int32 and got["i"].tolist() == [7, -3]
    assert got["m"].dtype == np.bool_ and got["m"].tolist() == [True, False]


def test_bf16_input_array_accepted():
    g = Graph()
    F.output(F.input_tensor(g, "x", (3,), "bf16") * 2.0, "out")
    x = np.array([1.5, -2.25, 3.0], ml_dtypes.bfloat16)
    np.testing.assert_array_equal(run_graph(g, {"x": x})["out"], (x.astype(np.float64) * 2).astype(ml_dtypes.bfloat16))


# ====================================================================== Mul→SumReduce fast path
def _sum_of_product(va: ShapeTracker, vb: ShapeTracker, axis: int, extra_consumer: bool):
    """Σ_axis a*b on views va (of a [4]) and vb (of b [12]); ``extra_consumer`` also outputs the
    product, which disables the interpreter's fast path."""
    g = Graph()
    a, b = inp(g, "a", (4,)), inp(g, "b", (12,))
    mul = g.add("Mul", (Edge(a.id, va), Edge(b.id, vb)), va.shape, DType.f32)
    shape = va.shape[:axis] + va.shape[axis + 1:]
    out(g, g.add("SumReduce", (e(mul),), shape, DType.f32, axis=axis))
    if extra_consumer:
        out(g, mul, "mul")
    return g


V4, V12 = C((4,)), C((12,))
FAST_PATH_CASES = {  # (view of a, view of b, reduced axis)
    "row_both_broadcast": (V4.expand_dim(0, 3), V12.slice(0, 0, 4).expand_dim(0, 3), 1),      # [3,4]
    "reduced_both_broadcast": (V4.expand_dim(1, 3), V12.slice(0, 4, 8).expand_dim(1, 3), 1),  # Σ over a broadcast
    "row_one_side": (V4.expand_dim(0, 3), C((3, 4)), 1),
    "reduced_one_side": (V4.expand_dim(0, 3).permute((1, 0)), C((4, 3)), 1),
    "matmul_like": (V4.reshape((2, 2)).expand_dim(1, 3), C((3, 4)).slice(1, 0, 2).expand_dim(0, 2), 2),
    "plain": (V4, V12.slice(0, 8, 12), 0),
}


@pytest.mark.parametrize("case", FAST_PATH_CASES)
def test_fused_sum_of_product_matches_unfused(case):
    """The interpreter folds Sum(Mul) into one einsum; it must agree with running Mul then Sum, also
    when a dim is broadcast (stride 0) in both operands."""
    va, vb, axis = FAST_PATH_CASES[case]
    a, b = nonzero(rng(7), 4), nonzero(rng(8), 12)
    fused = run_graph(_sum_of_product(va, vb, axis, False), {"a": a, "b": b})["out"]
    unfused = run_graph(_sum_of_product(va, vb, axis, True), {"a": a, "b": b})["out"]
    f32 = lambda z: z.astype(np.float32).astype(np.float64)  # noqa: E731
    want = (view_of(f32(a), va, {}) * view_of(f32(b), vb, {})).sum(axis)
    assert fused.shape == want.shape
    np.testing.assert_allclose(fused, want, rtol=1e-6)
    np.testing.assert_allclose(unfused, want, rtol=1e-6)


def test_fast_path_does_not_leak_into_other_consumers():
    g = Graph()
    x = F.input_tensor(g, "x", (3, 4), "f32")
    y = F.input_tensor(g, "y", (4, 5), "f32")
    p = x @ y
    F.output(p, "p")
    F.output(p.sum(-1), "ps")
    xv, yv = nonzero(rng(9), (3, 4)), nonzero(rng(10), (4, 5))
    got = run_graph(g, {"x": xv, "y": yv})
    want = xv.astype(np.float32).astype(np.float64) @ yv.astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(got["p"], want, rtol=1e-6)
    np.testing.assert_allclose(got["ps"], want.sum(-1), rtol=1e-5)


# ====================================================================== outputs, dyn vars, errors
def test_outputs_by_name_and_role():
    g = Graph()
    x = F.input_tensor(g, "x", (2,), "f32")
    st = F.input_tensor(g, "st", (2,), "bf16", role="state")
    F.output(x * 3.0, "a")
    F.output(x, "b")
    F.output(st + 1.0, "st", role="state")
    got = run_graph(g, {"x": np.array([1.0, 2.0]), "st": np.array([0.5, 0.25])})
    assert set(got) == {"a", "b", "st"}
    assert got["st"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got["a"], [3.0, 6.0])


def test_missing_and_misshaped_inputs():
    g = Graph()
    F.output(F.input_tensor(g, "x", (Var("s"), 2), "f32") + 1.0, "out")
    with pytest.raises(ReferenceError, match="missing input 'x'"):
        run_graph(g, {}, {"s": 2})
    with pytest.raises(ReferenceError, match=r"expected \(3, 2\)"):
        run_graph(g, {"x": np.ones((2, 2))}, {"s": 3})


def test_missing_dyn_vars_listed():
    g = Graph("named")
    s, p = Var("s"), Var("p")
    x = F.input_tensor(g, "x", (s + p, 2), "f32")
    F.output(x.slice(0, p, s + p), "out")
    with pytest.raises(ReferenceError, match=r"\['p', 's'\].*'named'"):
        run_graph(g, {"x": np.ones((3, 2))})
    with pytest.raises(ReferenceError, match=r"\['p'\]"):
        run_graph(g, {"x": np.ones((3, 2))}, {"s": 3})
    got = run_graph(g, {"x": np.arange(10.0).reshape(5, 2)}, {"s": 3, "p": 2, "unused": 9})
    np.testing.assert_array_equal(got["out"], np.arange(4.0, 10.0).reshape(3, 2))


def test_unknown_op_has_no_semantics():
    g = Graph()
    g.nodes.append(Node(0, "Tanh", (), (), DType.f32))  # bypasses Graph.add's primop check on purpose
    g.add("Output", (Edge(0, C(())),), (), DType.f32, name="out", role="output")
    with pytest.raises(ReferenceError, match="Tanh"):
        run_graph(g, {})


def test_every_primop_has_reference_semantics():
    """Each primop in hlir.PRIMOPS runs in one graph (a guard against adding a primop without semantics)."""
    g = Graph()
    x = F.input_tensor(g, "x", (4,), "f32")
    i = F.arange(g, 4) % 3
    y = F.where(x < 0.5, x.exp2().log2().sin().sqrt().recip() * 2.0, x)
    y = F.scatter(F.gather(y.reshape(4, 1), i), y.expand_dim(1, 1).slice(0, 0, 2), F.arange(g, 2))
    y = (y.max(0) + y.sum(0)).cast("f16")
    y = y.expand_dim(0, 2).contiguous()
    F.output(y, "out")
    assert set(g.op_counts()) == set(PRIMOPS)
    got = run_graph(g, {"x": np.array([0.3, 0.7, 1.2, 0.1])})["out"]
    assert got.shape == (2, 1) and np.isfinite(got.astype(np.float64)).all()
