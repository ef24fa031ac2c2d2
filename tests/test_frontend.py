"""Every GraphTensor op and composite, run through the reference interpreter, against float64
numpy / torch (CPU) on seeded random inputs that are never all zeros.

Inputs are rounded to the tensor's dtype before the float64 expectation is computed, so the only
differences left are the graph's own intermediate roundings: f32 results must agree to a relative
error below 1e-5 (with an absolute floor of 1e-6 where a result crosses zero), f16/bf16 results to
a few ulps of their dtype.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from lum.builder import frontend as F
from lum.builder.hlir import PRIMOPS, Graph
from lum.builder.reference import ReferenceError, run_graph
from lum.format.dtypes import DType
from lum.format.expr import Var

FLOATS = (DType.f32, DType.f16, DType.bf16)
# (rtol, atol) per dtype: f32 to 1e-5 relative; f16/bf16 a few ulps (2^-11, 2^-8) of chained ops
TOL = {DType.f32: (1e-5, 1e-6), DType.f16: (5e-3, 5e-3), DType.bf16: (3e-2, 2e-2)}


# ====================================================================== helpers
def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def nonzero(r: np.random.Generator, shape, lo: float = 0.1, hi: float = 2.0) -> np.ndarray:
    """Random values with lo <= |x| < hi and random sign (never zero)."""
    return r.uniform(lo, hi, shape) * r.choice([-1.0, 1.0], shape)


def q(x: np.ndarray, dtype: DType) -> np.ndarray:
    """``x`` rounded to ``dtype``, returned as float64 (int64/bool for those dtypes)."""
    return np.asarray(x).astype(dtype.np).astype(dtype.compute_np)


def run(fn, inputs: dict[str, tuple[np.ndarray, DType | str]], dyn=None):
    """Build a graph with one Input per entry (shape from the array, or an explicit symbolic shape
    given as a third element), call ``fn(g, *tensors)`` and run it; returns the output(s) and graph."""
    g = Graph("test")
    ts, feed = [], {}
    for name, spec in inputs.items():
        arr, dtype = spec[0], spec[1]
        shape = spec[2] if len(spec) > 2 else np.shape(arr)
        ts.append(F.input_tensor(g, name, shape, dtype))
        feed[name] = arr
    outs = fn(g, *ts)
    single = isinstance(outs, F.GraphTensor)
    if single:
        outs = {"out": outs}
    for k, t in outs.items():
        F.output(t, k)
    res = run_graph(g, feed, dyn)
    return (res["out"] if single else res), g


def close(got: np.ndarray, want: np.ndarray, dtype: DType, rtol=None, atol=None) -> None:
    r, a = TOL[dtype]
    got = np.asarray(got)
    assert got.dtype == dtype.np, f"result dtype {got.dtype}, expected {dtype.np}"
    assert got.shape == np.shape(want)
    np.testing.assert_allclose(got.astype(np.float64), np.asarray(want, dtype=np.float64),
                               rtol=r if rtol is None else rtol, atol=a if atol is None else atol)


def t64(x) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x, dtype=np.float64))


# ====================================================================== elementwise binary
BINARY = {
    "add": (lambda a, b: a + b, np.add),
    "sub": (lambda a, b: a - b, np.subtract),
    "mul": (lambda a, b: a * b, np.multiply),
    "div": (lambda a, b: a / b, np.divide),
    "mod": (lambda a, b: a % b, np.mod),
}
BROADCAST_SHAPES = [((3, 4), (3, 4)), ((3, 4), (4,)), ((4,), (3, 4)), ((2, 1, 4), (3, 1)),
                    ((1,), (2, 3)), ((), (2, 3)), ((2, 3, 1, 5), (1, 4, 5))]


@pytest.mark.parametrize("op", BINARY)
@pytest.mark.parametrize("sa,sb", BROADCAST_SHAPES)
def test_binary_broadcast_f32(op, sa, sb):
    r = rng(1)
    a, b = nonzero(r, sa, 0.5, 3.0), nonzero(r, sb, 0.5, 3.0)
    lum_op, np_op = BINARY[op]
    got, _ = run(lambda g, x, y: lum_op(x, y), {"a": (a, "f32"), "b": (b, "f32")})
    close(got, np_op(q(a, DType.f32), q(b, DType.f32)), DType.f32)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", BINARY)
def test_binary_dtypes(op, dtype):
    r = rng(2)
    a, b = nonzero(r, (4, 5), 0.5, 3.0), nonzero(r, (5,), 0.5, 3.0)
    lum_op, np_op = BINARY[op]
    got, _ = run(lambda g, x, y: lum_op(x, y), {"a": (a, dtype), "b": (b, dtype)})
    want = np_op(q(a, dtype), q(b, dtype))
    if op == "mod":  # a % b near a multiple of b jumps by |b|: compare only away from the jumps
        ok = np.abs(want - np.round(want / np.abs(q(b, dtype))) * np.abs(q(b, dtype))) > 0.05
        got, want = np.where(ok, got.astype(np.float64), want), want
    close(np.asarray(got).astype(dtype.np), want, dtype)


def test_torch_remainder_semantics():
    """``%`` follows Python/torch.remainder (sign of the divisor), not C fmod."""
    a = np.array([5.5, -5.5, 5.5, -5.5, 7.0, -1.25])
    b = np.array([2.0, 2.0, -2.0, -2.0, 3.0, 0.5])
    got, _ = run(lambda g, x, y: x % y, {"a": (a, "f32"), "b": (b, "f32")})
    np.testing.assert_array_equal(got, torch.remainder(t64(a), t64(b)).numpy().astype(np.float32))


COMPARE = {
    "lt": (lambda a, b: a < b, np.less),
    "gt": (lambda a, b: a > b, np.greater),
    "le": (lambda a, b: a <= b, np.less_equal),
    "ge": (lambda a, b: a >= b, np.greater_equal),
}


@pytest.mark.parametrize("dtype", [DType.f32, DType.bf16, DType.i32, DType.i64])
@pytest.mark.parametrize("op", COMPARE)
@pytest.mark.parametrize("sa,sb", [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 4), (3, 1))])
def test_comparisons(op, sa, sb, dtype):
    r = rng(3)
    if dtype.is_int:
        a, b = r.integers(-3, 4, sa), r.integers(-3, 4, sb)  # many ties
    else:
        a, b = nonzero(r, sa), nonzero(r, sb)
        a.reshape(-1)[: min(a.size, b.size)] = b.reshape(-1)[: min(a.size, b.size)]  # some ties
    lum_op, np_op = COMPARE[op]
    got, _ = run(lambda g, x, y: lum_op(x, y), {"a": (a, dtype), "b": (b, dtype)})
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got, np_op(q(a, dtype), q(b, dtype)))


SCALAR_EXPRS = {
    "x+s": (lambda x: x + 2.5, lambda x: x + 2.5),
    "s+x": (lambda x: 2.5 + x, lambda x: 2.5 + x),
    "x-s": (lambda x: x - 1.5, lambda x: x - 1.5),
    "s-x": (lambda x: 1.5 - x, lambda x: 1.5 - x),
    "x*s": (lambda x: x * 3, lambda x: x * 3),
    "s*x": (lambda x: 3 * x, lambda x: 3 * x),
    "x/s": (lambda x: x / 4.0, lambda x: x / 4.0),
    "s/x": (lambda x: 4.0 / x, lambda x: 4.0 / x),
    "x%s": (lambda x: x % 0.75, lambda x: np.mod(x, 0.75)),
    "s%x": (lambda x: 1.75 % x, lambda x: np.mod(1.75, x)),
    "-x": (lambda x: -x, lambda x: -x),
    "np+x": (lambda x: np.float64(2.0) + x, lambda x: 2.0 + x),
    "np-x": (lambda x: np.float32(2.0) - x, lambda x: 2.0 - x),
    "np*x": (lambda x: np.float64(0.5) * x, lambda x: 0.5 * x),
    "x<s": (lambda x: x < 0.3, lambda x: x < 0.3),
    "s<x": (lambda x: 0.3 < x, lambda x: 0.3 < x),
    "x>=s": (lambda x: x >= -0.3, lambda x: x >= -0.3),
    "s>=x": (lambda x: -0.3 >= x, lambda x: -0.3 >= x),
    "x<=s": (lambda x: x <= 0.5, lambda x: x <= 0.5),
    "x>s": (lambda x: x > 0.5, lambda x: x > 0.5),
}


@pytest.mark.parametrize("expr", SCALAR_EXPRS)
def test_scalar_operands(expr):
    r = rng(4)
    x = nonzero(r, (3, 5), 0.2, 2.0)
    lum_fn, np_fn = SCALAR_EXPRS[expr]
    got, _ = run(lambda g, t: lum_fn(t), {"x": (x, "f32")})
    want = np_fn(q(x, DType.f32))
    if want.dtype == np.bool_:
        np.testing.assert_array_equal(got, want)
    else:
        close(got, want, DType.f32)


@pytest.mark.parametrize("dtype", [DType.i32, DType.i64])
def test_integer_arithmetic(dtype):
    r = rng(5)
    a = r.integers(-50, 50, (4, 6))
    a[a == 0] = 7
    b = r.integers(1, 9, (6,)) * r.choice([-1, 1], 6)
    got, _ = run(lambda g, x, y: {"add": x + y, "sub": x - y, "mul": x * y, "mod": x % y, "smod": x % 3,
                                  "rsub": 10 - x, "smul": 2.0 * x, "lt": x < y, "max": x.max(0), "min": x.min(1),
                                  "sum": x.sum(), "relu": x.relu(), "neg": -x},
                 {"a": (a, dtype), "b": (b, dtype)})
    want = {"add": a + b, "sub": a - b, "mul": a * b, "mod": np.mod(a, b), "smod": np.mod(a, 3), "rsub": 10 - a,
            "smul": 2 * a, "lt": a < b, "max": a.max(0), "min": a.min(1), "sum": a.sum(-1),
            "relu": np.maximum(a, 0), "neg": -a}
    # torch agrees on the integer modulo convention
    np.testing.assert_array_equal(want["mod"], torch.remainder(torch.from_numpy(a), torch.from_numpy(b)).numpy())
    for k, w in want.items():
        assert got[k].dtype == (np.bool_ if k == "lt" else dtype.np), k
        np.testing.assert_array_equal(got[k], w, err_msg=k)


# ====================================================================== unary
def _np_gelu_tanh(x):
    return TF.gelu(t64(x), approximate="tanh").numpy()


UNARY = {  # name: (lum, float64 reference, (lo, hi) of |x|, positive only)
    "exp2": (lambda t: t.exp2(), np.exp2, (0.1, 6.0), False),
    "log2": (lambda t: t.log2(), np.log2, (0.05, 50.0), True),
    "sin": (lambda t: t.sin(), np.sin, (0.1, 6.0), False),
    "cos": (lambda t: t.cos(), np.cos, (0.1, 6.0), False),
    "sqrt": (lambda t: t.sqrt(), np.sqrt, (0.05, 50.0), True),
    "recip": (lambda t: t.recip(), lambda x: 1.0 / x, (0.1, 10.0), False),
    "exp": (lambda t: t.exp(), np.exp, (0.1, 6.0), False),
    "log": (lambda t: t.log(), np.log, (0.05, 50.0), True),
    "rsqrt": (lambda t: t.rsqrt(), lambda x: 1.0 / np.sqrt(x), (0.05, 50.0), True),
    "sigmoid": (lambda t: t.sigmoid(), lambda x: torch.sigmoid(t64(x)).numpy(), (0.05, 8.0), False),
    "tanh": (lambda t: t.tanh(), np.tanh, (0.05, 4.0), False),
    "F.tanh": (lambda t: F.tanh(t), np.tanh, (0.05, 4.0), False),
    "silu": (lambda t: t.silu(), lambda x: TF.silu(t64(x)).numpy(), (0.05, 6.0), False),
    "gelu": (lambda t: t.gelu(), _np_gelu_tanh, (0.05, 4.0), False),
    "relu": (lambda t: t.relu(), lambda x: np.maximum(x, 0.0), (0.05, 4.0), False),
}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", UNARY)
def test_unary(name, dtype):
    lum_fn, ref_fn, (lo, hi), positive = UNARY[name]
    r = rng(6)
    x = nonzero(r, (4, 64), lo, hi)
    if positive:
        x = np.abs(x)
    got, g = run(lambda g, t: lum_fn(t), {"x": (x, dtype)})
    close(got, ref_fn(q(x, dtype)), dtype)
    # Activations of 16-bit tensors compute in f32 and round once (as torch does); all else stays in dtype.
    allowed = {dtype, DType.f32} if name in ("sigmoid", "silu", "gelu", "tanh", "F.tanh") else {dtype}
    assert all(n.dtype in allowed for n in g if n.op not in ("Where", "Output") and n.op != "LessThan")


def test_gelu_is_tanh_approximation_not_erf():
    x = np.linspace(-3, 3, 61) + 0.013
    got, _ = run(lambda g, t: t.gelu(), {"x": (x, "f32")})
    exact = TF.gelu(t64(x)).numpy()
    assert np.abs(got - exact).max() > 1e-4  # distinguishable from erf-GELU …
    close(got, _np_gelu_tanh(q(x, DType.f32)), DType.f32)  # … and equal to the tanh form


def test_sigmoid_and_exp_saturate_without_nan():
    x = np.array([-200.0, -90.0, -20.0, 20.0, 90.0, 200.0])
    got, _ = run(lambda g, t: {"sig": t.sigmoid(), "silu": t.silu(), "tanh": t.tanh(), "exp": t.exp()},
                 {"x": (x, "f32")})
    close(got["sig"], torch.sigmoid(t64(x)).numpy(), DType.f32)
    close(got["silu"], TF.silu(t64(x)).numpy(), DType.f32)
    close(got["tanh"], np.tanh(x), DType.f32)
    assert np.isinf(got["exp"][-2:]).all() and not np.isnan(got["exp"]).any()


def test_unary_needs_float():
    g = Graph()
    x = F.input_tensor(g, "x", (3,), "i32")
    for fn in (lambda t: t.exp2(), lambda t: t.sqrt(), lambda t: t.recip(), lambda t: t.sin()):
        with pytest.raises(TypeError, match="float"):
            fn(x)
    for fn in (lambda t: t.exp(), lambda t: t.log(), lambda t: t.sigmoid(), lambda t: t.gelu()):
        with pytest.raises(TypeError):  # composites fail on their first float scalar or primop
            fn(x)


# ====================================================================== reductions
REDUCE = {
    "sum": (lambda t, a, k: t.sum(a, keepdim=k), lambda x, a, k: torch.sum(x, a, keepdim=k)),
    "max": (lambda t, a, k: t.max(a, keepdim=k), lambda x, a, k: torch.amax(x, a, keepdim=k)),
    "min": (lambda t, a, k: t.min(a, keepdim=k), lambda x, a, k: torch.amin(x, a, keepdim=k)),
    "mean": (lambda t, a, k: t.mean(a, keepdim=k), lambda x, a, k: torch.mean(x, a, keepdim=k)),
    "var": (lambda t, a, k: t.var(a, keepdim=k), lambda x, a, k: torch.var(x, a, keepdim=k, unbiased=False)),
}


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2, -3])
@pytest.mark.parametrize("op", REDUCE)
def test_reductions(op, axis, keepdim):
    x = nonzero(rng(7), (3, 4, 5))
    lum_fn, ref_fn = REDUCE[op]
    got, _ = run(lambda g, t: lum_fn(t, axis, keepdim), {"x": (x, "f32")})
    close(got, ref_fn(t64(q(x, DType.f32)), axis, keepdim).numpy(), DType.f32)


@pytest.mark.parametrize("dtype", [DType.f16, DType.bf16])
@pytest.mark.parametrize("op", REDUCE)
def test_reductions_low_precision(op, dtype):
    x = nonzero(rng(8), (6, 16), 0.5, 2.0) + 3.0  # var of values around 3: cancellation stays bounded
    lum_fn, ref_fn = REDUCE[op]
    got, _ = run(lambda g, t: lum_fn(t, -1, False), {"x": (x, dtype)})
    want = ref_fn(t64(q(x, dtype)), -1, False).numpy()
    close(got, want, dtype, atol=0.05 if op == "var" else None)


def test_default_axis_is_last():
    x = nonzero(rng(9), (3, 4))
    got, _ = run(lambda g, t: {"s": t.sum(), "m": t.max(), "mean": t.mean()}, {"x": (x, "f32")})
    xq = q(x, DType.f32)
    close(got["s"], xq.sum(-1), DType.f32)
    close(got["m"], xq.max(-1), DType.f32)
    close(got["mean"], xq.mean(-1), DType.f32)


def test_reduce_axis_out_of_range():
    g = Graph()
    x = F.input_tensor(g, "x", (3, 4), "f32")
    with pytest.raises(IndexError):
        x.sum(2)
    with pytest.raises(IndexError):
        x.max(-3)


# ====================================================================== softmax
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax(axis, dtype):
    x = nonzero(rng(10), (3, 5, 7), 0.1, 6.0)
    got, _ = run(lambda g, t: t.softmax(axis), {"x": (x, dtype)})
    close(got, torch.softmax(t64(q(x, dtype)), axis).numpy(), dtype)


def test_softmax_large_logits_stable():
    x = nonzero(rng(11), (2, 9), 0.1, 1.0) * 1e4
    got, _ = run(lambda g, t: t.softmax(), {"x": (x, "f32")})
    close(got, torch.softmax(t64(q(x, DType.f32)), -1).numpy(), DType.f32)


@pytest.mark.parametrize("dtype", [DType.f32, DType.bf16])
def test_softmax_with_masked_entries(dtype):
    """Causal mask written with ``where(mask, -inf, x)``: masked entries become exactly 0, no NaN."""
    s = 6
    x = nonzero(rng(12), (2, s, s), 0.1, 4.0)

    def build(g, t):
        i = F.arange(g, s).unsqueeze(1)
        j = F.arange(g, s).unsqueeze(0)
        return F.where(j > i, -math.inf, t).softmax(-1)

    got, _ = run(build, {"x": (x, dtype)})
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    want = torch.softmax(t64(q(x, dtype)).masked_fill(mask, -math.inf), -1).numpy()
    assert not np.isnan(got.astype(np.float64)).any()
    assert (got.astype(np.float64)[:, mask.numpy()] == 0).all()
    close(got, want, dtype)


# ====================================================================== matmul / linear
MATMUL_SHAPES = [((3, 5), (5, 4)), ((1, 5), (5, 1)), ((2, 3, 5), (2, 5, 4)), ((2, 3, 5), (5, 4)),
                 ((3, 5), (2, 5, 4)), ((2, 1, 3, 5), (4, 5, 6)), ((1, 4, 3, 5), (2, 1, 5, 2))]


@pytest.mark.parametrize("sa,sb", MATMUL_SHAPES)
def test_matmul(sa, sb):
    r = rng(13)
    a, b = nonzero(r, sa), nonzero(r, sb)
    got, _ = run(lambda g, x, y: {"fn": F.matmul(x, y), "op": x @ y, "meth": x.matmul(y)},
                 {"a": (a, "f32"), "b": (b, "f32")})
    want = np.matmul(q(a, DType.f32), q(b, DType.f32))
    for k in got:
        close(got[k], want, DType.f32)


@pytest.mark.parametrize("dtype", [DType.f16, DType.bf16])
def test_matmul_low_precision(dtype):
    r = rng(14)
    a, b = nonzero(r, (2, 4, 32)), nonzero(r, (32, 8))
    got, _ = run(lambda g, x, y: x @ y, {"a": (a, dtype), "b": (b, dtype)})
    want = np.matmul(q(a, dtype), q(b, dtype))
    close(got, want, dtype, atol=TOL[dtype][1] * 4)


def test_matmul_of_transposed_and_sliced_views():
    r = rng(15)
    a, b = nonzero(r, (5, 3)), nonzero(r, (2, 4, 7))
    got, _ = run(lambda g, x, y: x.T @ y.slice(-1, 1, 6).transpose(-1, -2).slice(-1, 0, 3),
                 {"a": (a, "f32"), "b": (b, "f32")})
    aq, bq = q(a, DType.f32), q(b, DType.f32)
    close(got, np.matmul(aq.T, np.swapaxes(bq[..., 1:6], -1, -2)[..., 0:3]), DType.f32)


def test_matmul_errors():
    g = Graph()
    a = F.input_tensor(g, "a", (3, 5), "f32")
    b = F.input_tensor(g, "b", (4, 6), "f32")
    v = F.input_tensor(g, "v", (5,), "f32")
    c = F.input_tensor(g, "c", (2, 5, 6), "f32")
    d = F.input_tensor(g, "d", (3, 3, 5), "f32")
    with pytest.raises(ValueError, match="inner"):
        a @ b
    with pytest.raises(ValueError):
        a @ v
    with pytest.raises(ValueError):
        d @ c  # batch 3 vs 2


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("xshape", [(4, 6), (2, 3, 6)])
def test_linear(xshape, bias):
    r = rng(16)
    x, w, bvec = nonzero(r, xshape), nonzero(r, (5, 6)), nonzero(r, (5,))
    ins = {"x": (x, "f32"), "w": (w, "f32")}
    if bias:
        ins["b"] = (bvec, "f32")
    got, _ = run(lambda g, *t: F.linear(*t), ins)
    f = lambda z: t64(q(z, DType.f32))  # noqa: E731
    want = TF.linear(f(x), f(w), f(bvec) if bias else None).numpy()
    close(got, want, DType.f32)


# ====================================================================== norms
def _hf_rms(x: torch.Tensor, w: torch.Tensor | None, eps: float, add_one: bool) -> torch.Tensor:
    """Hugging Face Llama (``w · x̂.to(dtype)``) and Gemma (``(x̂ · (1 + w)).to(dtype)``) RMSNorm."""
    dtype = x.dtype
    xf = x.to(torch.float64)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if w is None:
        return normed.to(dtype)
    if add_one:
        return (normed * (1.0 + w.to(torch.float64))).to(dtype)
    return w * normed.to(dtype)


TORCH = {DType.f32: torch.float32, DType.f16: torch.float16, DType.bf16: torch.bfloat16}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mode", ["none", "llama", "gemma"])
def test_rms_norm(mode, dtype):
    r = rng(17)
    x, w = nonzero(r, (2, 3, 16), 0.1, 3.0), nonzero(r, (16,), 0.1, 1.5)
    eps = 1e-6
    ins = {"x": (x, dtype)}
    if mode != "none":
        ins["w"] = (w, dtype)
    got, _ = run(lambda g, t, *wt: F.rms_norm(t, wt[0] if wt else None, eps, add_one=(mode == "gemma")), ins)
    tx = torch.tensor(x).to(TORCH[dtype])
    tw = torch.tensor(w).to(TORCH[dtype]) if mode != "none" else None
    want = _hf_rms(tx, tw, eps, mode == "gemma").to(torch.float64).numpy()
    # the graph normalises in f32 and rounds at the same points as HF; allow one ulp of the dtype
    close(got, want, dtype, rtol={DType.f32: 1e-5, DType.f16: 2e-3, DType.bf16: 1.6e-2}[dtype])


def test_rms_norm_gemma_differs_from_llama():
    x, w = nonzero(rng(18), (2, 16)), nonzero(rng(19), (16,))
    got, _ = run(lambda g, t, wt: {"llama": F.rms_norm(t, wt, 1e-6), "gemma": F.rms_norm(t, wt, 1e-6, add_one=True)},
                 {"x": (x, "f32"), "w": (w, "f32")})
    xq, wq = q(x, DType.f32), q(w, DType.f32)
    normed = xq / np.sqrt((xq * xq).mean(-1, keepdims=True) + 1e-6)
    close(got["llama"], normed * wq, DType.f32)
    close(got["gemma"], normed * (1.0 + wq), DType.f32)


@pytest.mark.parametrize("dtype", [DType.f32, DType.bf16])
@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_layer_norm(affine, dtype):
    r = rng(20)
    x, w, b = nonzero(r, (3, 4, 12), 0.1, 3.0) + 0.5, nonzero(r, (12,)), nonzero(r, (12,))
    ins = {"x": (x, dtype)}
    if affine != "none":
        ins["w"] = (w, dtype)
    if affine == "both":
        ins["b"] = (b, dtype)
    got, _ = run(lambda g, t, *p: F.layer_norm(t, p[0] if p else None, p[1] if len(p) > 1 else None, 1e-5), ins)
    f = lambda z: t64(q(z, dtype))  # noqa: E731
    want = TF.layer_norm(f(x), (12,), f(w) if affine != "none" else None, f(b) if affine == "both" else None,
                         1e-5).numpy()
    # normalised in f32 and rounded once, as torch does: within one ulp of the dtype
    close(got, want, dtype, rtol=1e-5 if dtype == DType.f32 else 8e-3, atol=1e-6 if dtype == DType.f32 else 8e-3)


@pytest.mark.parametrize("offset", [0.0, 100.0])
def test_layer_norm_bf16_with_large_mean(offset):
    """bf16 input whose mean dwarfs its spread: centring must happen in f32, not in bf16."""
    x = nonzero(rng(21), (4, 256)) + offset
    got, _ = run(lambda g, t: F.layer_norm(t, None, None, 1e-5), {"x": (x, "bf16")})
    want = TF.layer_norm(torch.tensor(x).to(torch.bfloat16).double(), (256,)).numpy()
    close(got, want, DType.bf16, rtol=8e-3, atol=8e-3)


# ====================================================================== where / maximum / minimum
@pytest.mark.parametrize("case", ["tt", "ts", "st", "broadcast"])
def test_where(case):
    r = rng(21)
    c = r.random((3, 4)) < 0.5
    a, b = nonzero(r, (3, 4)), nonzero(r, (4,))

    def build(g, ct, at, bt):
        if case == "tt":
            return F.where(ct, at, at * 2.0)
        if case == "ts":
            return F.where(ct, at, -7.5)
        if case == "st":
            return F.where(ct, 3.25, at)
        return F.where(ct.slice(0, 0, 1), at, bt)  # cond [1,4] and b [4] broadcast to [3,4]

    got, _ = run(build, {"c": (c, "bool"), "a": (a, "f32"), "b": (b, "f32")})
    aq, bq = q(a, DType.f32), q(b, DType.f32)
    want = {"tt": np.where(c, aq, 2 * aq), "ts": np.where(c, aq, -7.5), "st": np.where(c, 3.25, aq),
            "broadcast": np.where(c[0:1], aq, bq)}[case]
    close(got, want, DType.f32, rtol=0, atol=0)


def test_where_errors():
    g = Graph()
    c = F.input_tensor(g, "c", (3,), "bool")
    x = F.input_tensor(g, "x", (3,), "f32")
    y = F.input_tensor(g, "y", (3,), "f16")
    with pytest.raises(TypeError, match="bool"):
        F.where(x, x, x)
    with pytest.raises(TypeError, match="tensor"):
        F.where(c, 1.0, 2.0)
    with pytest.raises(TypeError, match="dtype"):
        F.where(c, x, y)


@pytest.mark.parametrize("other", ["tensor", "broadcast", "scalar"])
def test_maximum_minimum(other):
    r = rng(22)
    a = nonzero(r, (3, 4))
    b = {"tensor": nonzero(r, (3, 4)), "broadcast": nonzero(r, (4,)), "scalar": 0.3}[other]
    if other == "scalar":
        got, _ = run(lambda g, x: {"max": F.maximum(x, 0.3), "min": F.minimum(x, 0.3)}, {"a": (a, "f32")})
        bq = np.float64(np.float32(0.3))
    else:
        got, _ = run(lambda g, x, y: {"max": F.maximum(x, y), "min": F.minimum(x, y)},
                     {"a": (a, "f32"), "b": (b, "f32")})
        bq = q(b, DType.f32)
    close(got["max"], np.maximum(q(a, DType.f32), bq), DType.f32, rtol=0, atol=0)
    close(got["min"], np.minimum(q(a, DType.f32), bq), DType.f32, rtol=0, atol=0)


# ====================================================================== concat
@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2])
def test_concat(axis):
    r = rng(23)
    base = [2, 3, 4]
    parts = []
    for k, n in enumerate((1, 3, 2)):
        shape = list(base)
        shape[axis] = n
        parts.append(nonzero(r, shape))
    got, g = run(lambda g, *ts: F.concat(list(ts), axis), {f"p{i}": (p, "f32") for i, p in enumerate(parts)})
    close(got, np.concatenate([q(p, DType.f32) for p in parts], axis), DType.f32, rtol=0, atol=0)
    assert g.op_counts()["Add"] == 2


def test_concat_keeps_infinities_and_ints():
    a = np.array([[-np.inf, 1.5], [2.0, np.inf]])
    b = np.array([[3.0], [-np.inf]])
    got, _ = run(lambda g, x, y: F.concat([x, y], -1), {"a": (a, "f32"), "b": (b, "f32")})
    np.testing.assert_array_equal(got, np.concatenate([a, b], -1).astype(np.float32))
    ai, bi = np.array([[1, -2]]), np.array([[5, 6], [-7, 8]])
    got, _ = run(lambda g, x, y: F.concat([x, y], 0), {"a": (ai, "i32"), "b": (bi, "i32")})
    np.testing.assert_array_equal(got, np.concatenate([ai, bi], 0))


def test_concat_errors():
    g = Graph()
    a = F.input_tensor(g, "a", (2, 3), "f32")
    b = F.input_tensor(g, "b", (3, 3), "f32")
    with pytest.raises(ValueError):
        F.concat([], 0)
    with pytest.raises(ValueError):
        F.concat([a, b], 1)  # the other dims differ


# ====================================================================== gather / scatter
@pytest.mark.parametrize("idx_dtype", [DType.i32, DType.i64])
@pytest.mark.parametrize("idx_shape", [(5,), (2, 3), ()])
@pytest.mark.parametrize("fn", [F.gather, F.embedding])
def test_gather(fn, idx_shape, idx_dtype):
    r = rng(24)
    table = nonzero(r, (10, 4))
    idx = r.integers(0, 10, idx_shape)
    got, _ = run(lambda g, t, i: fn(t, i), {"t": (table, "bf16"), "i": (idx, idx_dtype)})
    want = TF.embedding(torch.from_numpy(np.asarray(idx)), t64(q(table, DType.bf16))).numpy()
    close(got, want, DType.bf16, rtol=0, atol=0)


def test_gather_1d_table_and_transposed_table():
    r = rng(25)
    t1, t2 = nonzero(r, (7,)), nonzero(r, (4, 6))
    idx = np.array([[5, 0], [3, 3]])
    got, _ = run(lambda g, a, b, i: {"1d": F.gather(a, i), "T": F.gather(b.T, i.slice(0, 0, 1).reshape(2))},
                 {"a": (t1, "f32"), "b": (t2, "f32"), "i": (idx, "i32")})
    np.testing.assert_array_equal(got["1d"], t1.astype(np.float32)[idx])
    np.testing.assert_array_equal(got["T"], t2.astype(np.float32).T[idx[0]])


@pytest.mark.parametrize("bad", [10, -1])
def test_gather_index_out_of_range(bad):
    idx = np.array([1, bad, 2])
    with pytest.raises(ReferenceError, match="out of range"):
        run(lambda g, t, i: F.gather(t, i), {"t": (nonzero(rng(26), (10, 4)), "f32"), "i": (idx, "i32")})


def test_gather_scatter_need_int_indices():
    g = Graph()
    t = F.input_tensor(g, "t", (4, 2), "f32")
    i = F.input_tensor(g, "i", (3,), "f32")
    with pytest.raises(TypeError, match="integers"):
        F.gather(t, i)
    with pytest.raises(TypeError, match="integers"):
        F.scatter(t, F.input_tensor(g, "s", (3, 2), "f32"), i)


MAX_LEN, HEADS, HDIM = 8, 2, 4


def _kv_write(dtype):
    """A KV cache [MAX_LEN, H, D] receiving ``s`` new rows at positions p..p+s (s, p dyn)."""
    g = Graph("kv")
    s, p = Var("s"), Var("p")
    cache = F.input_tensor(g, "cache", (MAX_LEN, HEADS, HDIM), dtype, role="state")
    new = F.input_tensor(g, "new", (s, HEADS, HDIM), "f32")
    pos = F.arange(g, s) + F.dim_value(g, p, DType.i64)
    F.output(F.scatter(cache, new, pos), "cache", role="state")
    return g


@pytest.mark.parametrize("dtype", [DType.f32, DType.bf16])
@pytest.mark.parametrize("s,p", [(1, 0), (3, 2), (1, 7), (8, 0), (4, 4)])
def test_scatter_kv_cache(s, p, dtype):
    r = rng(27)
    cache, new = nonzero(r, (MAX_LEN, HEADS, HDIM)), nonzero(r, (s, HEADS, HDIM))
    g = _kv_write(dtype)
    got = run_graph(g, {"cache": cache, "new": new}, {"s": s, "p": p})["cache"]
    want = q(cache, dtype).copy()
    want[p:p + s] = q(q(new, DType.f32), dtype)
    assert got.dtype == dtype.np
    np.testing.assert_array_equal(got.astype(np.float64), want)


def test_scatter_out_of_range_and_shape_errors():
    g = _kv_write(DType.f32)
    r = rng(28)
    with pytest.raises(ReferenceError, match="out of range"):
        run_graph(g, {"cache": nonzero(r, (MAX_LEN, HEADS, HDIM)), "new": nonzero(r, (3, HEADS, HDIM))},
                  {"s": 3, "p": 6})
    g = Graph()
    dest = F.input_tensor(g, "d", (4, 3), "f32")
    with pytest.raises(ValueError):
        F.scatter(dest, F.input_tensor(g, "s", (2, 5), "f32"), F.arange(g, 2))
    with pytest.raises(ValueError):
        F.scatter(dest, F.input_tensor(g, "s2", (2, 3), "f32"), F.arange(g, 3))


# ====================================================================== arange / dim_value
@pytest.mark.parametrize("dtype", [DType.i64, DType.i32, DType.f32, DType.bf16])
def test_arange_static(dtype):
    g = Graph()
    F.output(F.arange(g, 11, dtype), "out")
    got = run_graph(g, {})["out"]
    assert got.dtype == dtype.np
    np.testing.assert_array_equal(got, np.arange(11).astype(dtype.np))


@pytest.mark.parametrize("n", [1, 4, 9])
def test_arange_and_dim_value_symbolic(n):
    g = Graph()
    s = Var("s")
    F.output(F.arange(g, s), "a")
    F.output(F.arange(g, 2 * s + 1, DType.f32), "b")
    F.output(F.dim_value(g, s), "dv")
    F.output(F.dim_value(g, s * 3 + 2, DType.i32), "dv2")
    got = run_graph(g, {}, {"s": n})
    np.testing.assert_array_equal(got["a"], np.arange(n))
    np.testing.assert_array_equal(got["b"], np.arange(2 * n + 1, dtype=np.float32))
    assert got["dv"].shape == () and got["dv"].dtype == np.float32 and got["dv"] == n
    assert got["dv2"].dtype == np.int32 and got["dv2"] == 3 * n + 2


def test_dim_value_static():
    g = Graph()
    F.output(F.dim_value(g, 5) * 2.0, "out")
    assert run_graph(g, {})["out"] == 10.0


# ====================================================================== cast
ALL_DTYPES = [DType.f32, DType.f16, DType.bf16, DType.i32, DType.i64, DType.bool]
TORCH_ALL = {**TORCH, DType.i32: torch.int32, DType.i64: torch.int64, DType.bool: torch.bool}


def _cast_source(dtype: DType) -> np.ndarray:
    r = rng(29)
    if dtype.is_float:
        x = r.uniform(-300.0, 300.0, 64)
        x[:8] = [0.0, -0.0, 0.5, -0.5, 1.999, -1.999, 2.5, -7.75]  # truncation and ±0 cases
        return x
    if dtype.is_int:
        x = r.integers(-300, 300, 64)
        x[:4] = [0, 1, -1, 255]
        return x
    return r.random(64) < 0.5


@pytest.mark.parametrize("dst", ALL_DTYPES)
@pytest.mark.parametrize("src", ALL_DTYPES)
def test_cast(src, dst):
    x = _cast_source(src)
    got, g = run(lambda g, t: t.cast(dst), {"x": (x, src)})
    assert got.dtype == dst.np
    tsrc = torch.tensor(x).to(TORCH_ALL[src])
    want = tsrc.to(TORCH_ALL[dst]).to(torch.float64).numpy()
    np.testing.assert_array_equal(got.astype(np.float64), want)
    assert g.op_counts()["Cast"] == (0 if src == dst else 1)


def test_cast_accepts_names_and_truncates_toward_zero():
    x = np.array([-2.7, -1.5, -0.4, 0.4, 1.5, 2.7])
    got, _ = run(lambda g, t: {"i32": t.cast("i32"), "i64": t.cast("int64"), "b": t.cast("bool")},
                 {"x": (x, "f32")})
    np.testing.assert_array_equal(got["i32"], [-2, -1, 0, 0, 1, 2])
    np.testing.assert_array_equal(got["i64"], [-2, -1, 0, 0, 1, 2])
    assert got["b"].all()


def test_cast_rounding_f32_to_bf16_and_f16():
    # values exactly between two representable neighbours round to even, as torch does
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11, 70000.0, 1e-8])
    got, _ = run(lambda g, t: {"bf16": t.cast("bf16"), "f16": t.cast("f16")}, {"x": (x, "f32")})
    tx = torch.tensor(x, dtype=torch.float32)
    np.testing.assert_array_equal(got["bf16"].astype(np.float64), tx.to(torch.bfloat16).double().numpy())
    np.testing.assert_array_equal(got["f16"].astype(np.float64), tx.to(torch.float16).double().numpy())


def test_mixed_dtype_binary_raises():
    g = Graph()
    a = F.input_tensor(g, "a", (3,), "f32")
    b = F.input_tensor(g, "b", (3,), "bf16")
    c = F.input_tensor(g, "c", (3,), "i32")
    for x, y in ((a, b), (a, c), (b, c)):
        with pytest.raises(TypeError, match="cast"):
            x + y
        with pytest.raises(TypeError):
            x * y
        with pytest.raises(TypeError):
            x < y
    out, _ = run(lambda g, x, y: x + y.cast("f32"), {"a": (np.ones(3), "f32"), "b": (np.full(3, 2.0), "bf16")})
    np.testing.assert_array_equal(out, np.full(3, 3.0, np.float32))


def test_int_tensor_rejects_fractional_scalar():
    """An i32 tensor combined with 0.5 must not silently truncate the scalar to 0."""
    g = Graph()
    x = F.input_tensor(g, "x", (3,), "i32")
    with pytest.raises(TypeError):
        x / 2
    with pytest.raises(TypeError):
        x * 0.5
    with pytest.raises(TypeError):
        x.mean()
    with pytest.raises(TypeError):
        x + "a"


# ====================================================================== rope
def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], -1)


def _inv_freq(d: int, theta: float = 10000.0) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("xshape", [(5, 8), (3, 5, 8), (2, 3, 5, 8)])
def test_rope(xshape, dtype):
    r = rng(30)
    x = nonzero(r, xshape)
    ang = np.arange(5)[:, None] * np.concatenate([_inv_freq(8)] * 2)[None, :] + 0.3
    cos, sin = np.cos(ang), np.sin(ang)
    got, _ = run(lambda g, t, c, s: F.rope(t, c, s), {"x": (x, dtype), "c": (cos, dtype), "s": (sin, dtype)})
    xq, cq, sq = q(x, dtype), q(cos, dtype), q(sin, dtype)
    close(got, xq * cq + _rotate_half(xq) * sq, dtype)


def test_rope_needs_even_static_head_dim():
    g = Graph()
    for shape in ((4, 7), (4, Var("d"))):
        x = F.input_tensor(g, f"x{len(g)}", shape, "f32")
        with pytest.raises(ValueError, match="even"):
            F.rope(x, x, x)


@pytest.mark.parametrize("dtype", [DType.f32, DType.bf16])
@pytest.mark.parametrize("past", [0, 5, 40])
def test_rope_tables(past, dtype):
    """cos/sin tables as Hugging Face computes them (f32 angles, then cos/sin) for positions past..past+s."""
    s, d = 6, 16
    inv = _inv_freq(d)
    g = Graph()
    pos = F.arange(g, Var("s")) + F.dim_value(g, Var("p"), DType.i64)
    cos, sin = F.rope_tables(g, pos, inv, dtype)
    F.output(cos, "cos")
    F.output(sin, "sin")
    got = run_graph(g, {}, {"s": s, "p": past})
    tpos = torch.arange(past, past + s, dtype=torch.float32)
    freqs = tpos[:, None] * torch.tensor(inv, dtype=torch.float32)[None, :]
    emb = torch.cat([freqs, freqs], -1)
    # cos is computed as sin(x + pi/2) with x + pi/2 rounded to f32: allow that extra ulp of the angle
    close(got["cos"], emb.cos().to(TORCH[dtype]).double().numpy(), dtype, atol=max(TOL[dtype][1], 1e-5))
    close(got["sin"], emb.sin().to(TORCH[dtype]).double().numpy(), dtype)


def test_rope_end_to_end_against_hf_formula():
    """rope(x, *rope_tables(positions)) == x·cos + rotate_half(x)·sin of Hugging Face (float64)."""
    r = rng(31)
    s, d = 4, 8
    x = nonzero(r, (2, s, d))
    positions = np.array([3, 4, 5, 6])
    got, _ = run(lambda g, t, p: F.rope(t, *F.rope_tables(g, p, _inv_freq(d))),
                 {"x": (x, "f32"), "pos": (positions, "i32")})
    ang = positions[:, None] * np.concatenate([_inv_freq(d)] * 2)[None, :]
    xq = q(x, DType.f32)
    close(got, xq * np.cos(ang) + _rotate_half(xq) * np.sin(ang), DType.f32, rtol=1e-5, atol=2e-6)


# ====================================================================== views
X = nonzero(rng(32), (2, 3, 4))
VIEWS = {  # name: (lum view chain, numpy equivalent, Contiguous nodes it may add)
    "permute": (lambda t: t.permute(2, 0, 1), lambda x: x.transpose(2, 0, 1), 0),
    "permute_list": (lambda t: t.permute([1, 2, 0]), lambda x: x.transpose(1, 2, 0), 0),
    "permute_neg": (lambda t: t.permute(-1, -3, -2), lambda x: x.transpose(2, 0, 1), 0),
    "transpose": (lambda t: t.transpose(0, 2), lambda x: np.swapaxes(x, 0, 2), 0),
    "transpose_default": (lambda t: t.transpose(), lambda x: np.swapaxes(x, -1, -2), 0),
    "T": (lambda t: t.T, lambda x: np.swapaxes(x, -1, -2), 0),
    "reshape": (lambda t: t.reshape(6, 4), lambda x: x.reshape(6, 4), 0),
    "reshape_tuple": (lambda t: t.reshape((4, 6)), lambda x: x.reshape(4, 6), 0),
    "reshape_flat": (lambda t: t.reshape(24), lambda x: x.reshape(24), 0),
    "reshape_split_permuted": (lambda t: t.permute(1, 0, 2).reshape(3, 2, 2, 2),
                               lambda x: x.transpose(1, 0, 2).reshape(3, 2, 2, 2), 0),
    "reshape_sliced": (lambda t: t.slice(0, 1, 2).reshape(12), lambda x: x[1:2].reshape(12), 0),
    "reshape_nonviewable": (lambda t: t.permute(1, 0, 2).reshape(3, 8),
                            lambda x: x.transpose(1, 0, 2).reshape(3, 8), 1),
    "reshape_nonviewable2": (lambda t: t.T.reshape(2, 12), lambda x: np.swapaxes(x, -1, -2).reshape(2, 12), 1),
    "reshape_broadcast": (lambda t: t.expand_dim(0, 2).reshape(4, 3, 4),
                          lambda x: np.broadcast_to(x, (2, 2, 3, 4)).reshape(4, 3, 4), 1),
    "slice": (lambda t: t.slice(1, 1, 3), lambda x: x[:, 1:3], 0),
    "slice_neg_axis": (lambda t: t.slice(-1, 2, 4), lambda x: x[..., 2:4], 0),
    "slice_twice": (lambda t: t.slice(2, 1, 4).slice(2, 1, 2), lambda x: x[..., 2:3], 0),
    "pad": (lambda t: t.pad(0, 1, 2), lambda x: np.pad(x, ((1, 2), (0, 0), (0, 0))), 0),
    "pad_neg_axis": (lambda t: t.pad(-1, 2, 0), lambda x: np.pad(x, ((0, 0), (0, 0), (2, 0))), 0),
    "pad_then_slice": (lambda t: t.pad(2, 2, 2).slice(2, 1, 5), lambda x: np.pad(x, ((0, 0),) * 2 + ((2, 2),))[..., 1:5], 0),
    "pad_permute": (lambda t: t.pad(1, 1, 0).permute(2, 1, 0), lambda x: np.pad(x, ((0, 0), (1, 0), (0, 0))).transpose(2, 1, 0), 0),
    "squeeze": (lambda t: t.slice(0, 0, 1).squeeze(0), lambda x: x[0], 0),
    "squeeze_neg": (lambda t: t.slice(-1, 3, 4).squeeze(-1), lambda x: x[..., 3], 0),
    "unsqueeze0": (lambda t: t.unsqueeze(0), lambda x: x[None], 0),
    "unsqueeze_neg": (lambda t: t.unsqueeze(-1), lambda x: x[..., None], 0),
    "unsqueeze_mid": (lambda t: t.unsqueeze(2), lambda x: x[:, :, None], 0),
    "expand_dim": (lambda t: t.expand_dim(1, 5), lambda x: np.broadcast_to(x[:, None], (2, 5, 3, 4)), 0),
    "expand_dim_last": (lambda t: t.expand_dim(-1, 2), lambda x: np.broadcast_to(x[..., None], (2, 3, 4, 2)), 0),
    "broadcast_to": (lambda t: t.slice(1, 0, 1).broadcast_to((5, 2, 3, 4)),
                     lambda x: np.broadcast_to(x[:, 0:1], (5, 2, 3, 4)), 0),
    "chain": (lambda t: t.permute(2, 0, 1).pad(0, 1, 1).slice(0, 1, 5).unsqueeze(0).expand_dim(0, 2),
              lambda x: np.broadcast_to(x.transpose(2, 0, 1)[None, None], (2, 1, 4, 2, 3)), 0),
    "padded_unit_reshape": (lambda t: t.pad(2, 1, 1).unsqueeze(1).reshape(2, 3, 6),
                            lambda x: np.pad(x, ((0, 0), (0, 0), (1, 1))), 0),
}


@pytest.mark.parametrize("name", VIEWS)
def test_views(name):
    lum_fn, np_fn, n_contig = VIEWS[name]
    holder = {}

    def build(g, t):
        before = len(g)
        v = lum_fn(t)
        holder["added"] = len(g) - before
        holder["contig"] = g.op_counts()["Contiguous"]
        return {"view": v, "used": v * 2.0 + 1.0}

    got, _ = run(build, {"x": (X, "f32")})
    assert holder["added"] == n_contig, "view ops must add no node (only a non-viewable reshape adds Contiguous)"
    assert holder["contig"] == n_contig
    want = np_fn(q(X, DType.f32))
    close(got["view"], want, DType.f32, rtol=0, atol=0)
    close(got["used"], want * 2.0 + 1.0, DType.f32)


def test_view_errors():
    g = Graph()
    x = F.input_tensor(g, "x", (2, 3, 4), "f32")
    with pytest.raises(ValueError, match="element counts"):
        x.reshape(5, 5)
    with pytest.raises(ValueError, match="squeeze"):
        x.squeeze(1)
    with pytest.raises(ValueError):
        x.permute(0, 0, 1)
    with pytest.raises(IndexError):
        x.slice(3, 0, 1)
    with pytest.raises(ValueError):
        x.broadcast_to((2, 5, 4))
    assert len(g) == 1


# ====================================================================== broadcasting errors
@pytest.mark.parametrize("sa,sb", [((3, 4), (3,)), ((2, 3), (3, 2)), ((4, 1, 3), (2, 4))])
def test_broadcast_mismatch_raises_value_error(sa, sb):
    g = Graph()
    a = F.input_tensor(g, "a", sa, "f32")
    b = F.input_tensor(g, "b", sb, "f32")
    for fn in (lambda: a + b, lambda: a * b, lambda: a < b, lambda: F.maximum(a, b)):
        with pytest.raises(ValueError, match="broadcast"):
            fn()


def test_symbolic_broadcast_mismatch():
    g = Graph()
    a = F.input_tensor(g, "a", (Var("s"), 4), "f32")
    b = F.input_tensor(g, "b", (Var("p"), 4), "f32")
    with pytest.raises(ValueError, match="broadcast"):
        a + b
    c = F.input_tensor(g, "c", (1, 4), "f32")
    assert (a + c).shape == a.shape


def test_tensors_of_different_graphs():
    a = F.input_tensor(Graph(), "a", (3,), "f32")
    b = F.input_tensor(Graph(), "b", (3,), "f32")
    with pytest.raises(ValueError, match="different graphs"):
        a + b


# ====================================================================== symbolic dims
def _symbolic_program(g, x, w):
    """A little of everything over a dyn sequence length ``s``: x [s, 8], w [8, 8]."""
    s = x.shape[0]
    h = F.rms_norm(x, None, 1e-6)
    scores = (h @ w @ h.T) * (1.0 / math.sqrt(8))                       # [s, s]
    causal = F.arange(g, s).unsqueeze(0) > F.arange(g, s).unsqueeze(1)
    attn = F.where(causal, -math.inf, scores).softmax(-1) @ x             # [s, 8]
    return {
        "attn": attn,
        "mean0": x.mean(0), "var0": x.var(0, keepdim=True), "sum0": x.sum(-2), "max0": x.max(0),
        "softmax0": x.softmax(0),
        "gram": x.T @ x,                                                  # contraction over s
        "concat": F.concat([x, x * 2.0], 0),                              # [2s, 8]
        "tail": x.slice(0, 1, s),                                         # [s-1, 8]
        "padded": x.pad(0, 1, 0).slice(-1, 0, 2),                         # [s+1, 2]
        "flat": x.reshape(s * 8).reshape(s, 2, 4).permute(1, 0, 2),      # [2, s, 4]
        "pos": x + F.arange(g, s, DType.f32).unsqueeze(1),
        "len": F.dim_value(g, s) + 0.0,
    }


@pytest.mark.parametrize("n", [1, 2, 5])
def test_symbolic_dims(n):
    r = rng(40 + n)
    x, w = nonzero(r, (n, 8)), nonzero(r, (8, 8))
    got, g = run(_symbolic_program, {"x": (x, "f32", (Var("s"), 8)), "w": (w, "f32")}, {"s": n})
    assert g.dyn_vars == {"s"}
    xq, wq = q(x, DType.f32), q(w, DType.f32)
    h = xq / np.sqrt((xq * xq).mean(-1, keepdims=True) + 1e-6)
    tq = t64(h @ wq)
    want_attn = TF.scaled_dot_product_attention(tq[None], t64(h)[None], t64(xq)[None], is_causal=True)[0].numpy()
    close(got["attn"], want_attn, DType.f32, rtol=2e-5, atol=2e-6)
    close(got["mean0"], xq.mean(0), DType.f32)
    close(got["var0"], xq.var(0, keepdims=True), DType.f32)
    close(got["sum0"], xq.sum(0), DType.f32)
    close(got["max0"], xq.max(0), DType.f32)
    close(got["softmax0"], torch.softmax(t64(xq), 0).numpy(), DType.f32)
    close(got["gram"], xq.T @ xq, DType.f32)
    close(got["concat"], np.concatenate([xq, 2 * xq], 0), DType.f32)
    close(got["tail"], xq[1:], DType.f32)
    close(got["padded"], np.pad(xq, ((1, 0), (0, 0)))[:, :2], DType.f32)
    close(got["flat"], xq.reshape(n, 2, 4).transpose(1, 0, 2), DType.f32)
    close(got["pos"], xq + np.arange(n)[:, None], DType.f32)
    assert got["len"] == n


def test_symbolic_graph_is_reusable_for_many_lengths():
    g = Graph()
    x = F.input_tensor(g, "x", (Var("s"), 4), "f32")
    F.output(x.softmax(0) * x.mean(0, keepdim=True), "out")
    for n in (1, 3, 16):
        xv = nonzero(rng(n), (n, 4))
        got = run_graph(g, {"x": xv}, {"s": n})["out"]
        xq = q(xv, DType.f32)
        close(got, torch.softmax(t64(xq), 0).numpy() * xq.mean(0, keepdims=True), DType.f32)


def test_missing_dyn_var_raises_reference_error():
    g = Graph()
    x = F.input_tensor(g, "x", (Var("s"), 4), "f32")
    F.output(x.sum(0), "out")
    with pytest.raises(ReferenceError, match="s"):
        run_graph(g, {"x": np.ones((3, 4))})
    with pytest.raises(ReferenceError, match="s"):
        run_graph(g, {"x": np.ones((3, 4))}, {"p": 3})


def test_missing_dyn_var_used_only_by_a_view():
    """A slice at offset ``p`` of a static tensor: no node shape mentions p, yet it must be bound."""
    g = Graph()
    x = F.input_tensor(g, "x", (8,), "f32")
    F.output(x.slice(0, Var("p"), Var("p") + 1) * 2.0, "out")
    with pytest.raises(ReferenceError, match="p"):
        run_graph(g, {"x": np.arange(8.0)})
    assert run_graph(g, {"x": np.arange(8.0)}, {"p": 5})["out"] == [10.0]


# ====================================================================== HLIR uses primops only
def test_hlir_contains_only_primops():
    g = Graph()
    s = Var("s")
    x = F.input_tensor(g, "x", (s, 8), "bf16")
    w = F.input_tensor(g, "w", (16, 8), "bf16", role="weight")
    nw = F.input_tensor(g, "nw", (8,), "bf16", role="weight")
    tok = F.input_tensor(g, "tok", (s,), "i32")
    emb = F.input_tensor(g, "emb", (32, 8), "bf16", role="weight")
    cache = F.input_tensor(g, "cache", (64, 8), "bf16", role="state")
    h = F.gather(emb, tok) + x
    h = F.rms_norm(h, nw, 1e-6, add_one=True)
    h = F.layer_norm(h, nw, nw, 1e-5)
    y = F.linear(h, w)
    a, b = y.slice(-1, 0, 8), y.slice(-1, 8, 16)
    y = a.gelu() * b.silu() + a.tanh() - b.sigmoid() + a.relu() + F.maximum(a, b) + F.minimum(a, 0.5)
    y = y + (y.exp() + y.log() + y.cos() + y.rsqrt() + y.sqrt() + y.exp2() + y.log2() + y.sin() + y.recip()) % 2.0
    y = F.rope(y, *F.rope_tables(g, F.arange(g, s), _inv_freq(8), DType.bf16))
    y = (y @ y.T).softmax(-1) @ y
    y = F.concat([y.var(0, keepdim=True), y.min(0, keepdim=True), y.mean(0, keepdim=True)], 0)
    c = F.scatter(cache, y.cast("f32"), F.arange(g, 3, DType.i32) + 4)
    F.output(y.permute(1, 0).reshape(24).cast("f32"), "out")
    F.output(c, "cache", role="state")
    F.output(F.logical_and(x >= 0.0, F.logical_not(x > 1.0)), "mask")
    ops = set(g.op_counts())
    assert ops <= set(PRIMOPS), ops - set(PRIMOPS)
    assert {"Gather", "Scatter", "Where", "SumReduce", "MaxReduce", "Iota", "Cast", "Mod", "Sin"} <= ops
    for n in g:
        for e in n.inputs:
            assert e.src < n.id  # topological order
    with pytest.raises(ValueError, match="unknown primop"):
        g.add("Tanh", (), (), DType.f32)


def test_chained_comparison_is_an_error_not_a_silent_drop():
    """``0 < x < 1`` is ``(0 < x) and (x < 1)`` in Python; a tensor's truth value must not be taken."""
    g = Graph()
    x = F.input_tensor(g, "x", (3,), "f32")
    with pytest.raises(TypeError, match="truth value"):
        0.0 < x < 1.0
    with pytest.raises(TypeError):
        bool(x)
    inside, _ = run(lambda g, t: F.logical_and(0.0 < t, t < 1.0), {"x": (np.array([-0.5, 0.5, 1.5]), "f32")})
    np.testing.assert_array_equal(inside, [False, True, False])


# ====================================================================== argmax
@pytest.mark.parametrize("shape", [(1, 7), (3, 1024), (1, 1025), (2, 3000), (1, 128256), (1, 262144)])
def test_argmax_first_maximum(shape):
    """np.argmax semantics (the first maximum) for short rows and for chunked long rows, padded or not,
    with ties inside a chunk and across chunks."""
    r = rng(1)
    x = r.standard_normal(shape).astype(np.float32)
    n = shape[-1]
    x[0, n // 3] = x[0, n - 1] = 9.0                    # tie: the earlier one wins
    if shape[0] > 1:
        x[1, :] = -3.0                                  # a row of ties: index 0
    got, g = run(lambda g, t: F.argmax(t), {"x": (x, DType.f32)})
    assert got.dtype == np.int32 and got.shape == shape[:-1]
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    if n in (1024, 3000, 128256, 262144):               # chunks that divide the row: a view, no copy
        assert not any(node.op == "Contiguous" for node in g.nodes)


def test_argmax_of_bf16_and_static_only():
    x = q(rng(2).standard_normal((2, 2100)), DType.bf16).astype(np.float32)
    got, _ = run(lambda g, t: F.argmax(t.cast(DType.bf16)), {"x": (x, DType.f32)})
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    with pytest.raises(ValueError, match="static"):
        run(lambda g, t: F.argmax(t), {"x": (np.ones((1, 4), np.float32), DType.f32, (1, Var("s")))}, {"s": 4})
