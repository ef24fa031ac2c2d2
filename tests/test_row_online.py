"""The one-visit softmax-weighted row sum (builder/row_codegen.py ``online_softmax_sum``): the reduce prologues
it takes (decode attention's combine) and the near misses it leaves to the phases, and the combine kernel it
gives by default and with ``LUM_ROW_ONLINE=0``. Its results are checked against the reference backend on the
emulated driver (tests/kernel_cases.py ``row.combine`` and the attention cases; tests/test_cuda_emulated.py,
also built with ``LUM_ROW_ONLINE=0``) and on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from lum.builder.codegen import generate
from lum.builder.env_switches import CodegenError
from lum.builder.extract import attention_ops
from lum.builder.row_codegen import ENV_ROW_ONLINE, online_softmax_sum
from lum.format.dtypes import DType
from lum.format.expr import Var, as_expr
from lum.format.llir import Arg
from lum.format.shapetracker import ShapeTracker

P = Var("p")


def _combine(out_dtype: DType = DType.bf16):
    """The combine reduce of a GQA decode attention (2 kv rows x 3 query rows, D = Dv = 64, T = p + 1 keys)."""
    t = P + 1
    q = ShapeTracker.contiguous((2, 3, 64))
    k = ShapeTracker.contiguous((2, t, 64)).expand_dim(1, 3)
    m = ShapeTracker.contiguous((t,)).expand_dim(0, 3).expand_dim(0, 2)
    return attention_ops((Arg(0, q), Arg(1, k), Arg(2, k), Arg(3, m)), 0.125, out_dtype, out_dtype)[-1]


def _e(x=("arg", 1), k=("arg", 3), max_of=None) -> list:
    x = list(x)
    return ["Exp2", "f32", ["Add", "f32", x, ["Mul", "f32", ["RowMax", "f32", list(max_of or x)], list(k)]]]


def _sum(e=None, a=("arg", 0), ell=("arg", 2), norm="Recip", e_num=None) -> list:
    e = e or _e()
    return ["Mul", "f32", ["Mul", "f32", e_num or e, list(a)],
            [norm, "f32", ["RowSum", "f32", ["Mul", "f32", e, list(ell)]]]]


def test_the_combine_is_taken_in_any_operand_order():
    expr = _combine().params["expr"]
    got = online_softmax_sum(expr)
    assert got is not None and got.x == ["arg", 1] and got.k == ["arg", 3]
    assert got.rmax == ["RowMax", "f32", ["arg", 1]] and got.rsum[0] == "RowSum"
    assert got.el == got.rsum[2] and got.ea == expr[2]
    swapped = copy.deepcopy(expr)                   # every Mul and the Add with their operands swapped

    def flip(t):
        if t[0] in ("Mul", "Add") and len(t) == 4:
            t[2], t[3] = t[3], t[2]
        for c in t[2:] if t[0] != "arg" else ():
            flip(c)
    flip(swapped)
    assert swapped != expr and online_softmax_sum(swapped) is not None


@pytest.mark.parametrize("variant", ["other-max", "k-not-a-leaf", "bf16-node", "max-in-numerator",
                                     "another-weight", "no-recip", "extra-row-op", "not-exp2"])
def test_near_misses_keep_the_phases(variant):
    expr = {
        "other-max": _sum(e=_e(max_of=("arg", 2))),                            # RowMax of another leaf
        "k-not-a-leaf": _sum(e=_e(k=("Recip", "f32", ["arg", 3]))),            # the rescale needs K's value
        "bf16-node": _sum(a=("Cast", "bf16", ["arg", 0])),
        "max-in-numerator": _sum(a=("Mul", "f32", ["arg", 0], ["RowMax", "f32", ["arg", 1]])),
        "another-weight": _sum(e_num=_e(k=("arg", 2))),                        # E·A's E is not E·L's
        "no-recip": _sum(norm="Sqrt"),
        "extra-row-op": _sum(a=("RowSum", "f32", ["arg", 0])),
        "not-exp2": _sum(e=["Sqrt", "f32", _e()[2]]),
    }[variant]
    assert online_softmax_sum(_sum()) is not None   # the unchanged tree is taken: each variant misses by its change
    assert online_softmax_sum(expr) is None


def _source(monkeypatch, online: bool) -> str:
    monkeypatch.setenv(ENV_ROW_ONLINE, "1" if online else "0")
    op = _combine()
    ks = generate(op, ("p",), arg_dtypes=[DType.f32] * 4, max_dyn={"p": 4096})
    return ks.source


def test_the_combine_kernel_visits_its_row_once(monkeypatch):
    """By default one loop over the chunks reads c, l and acc and keeps the running maximum; three group
    reductions merge it. With ``LUM_ROW_ONLINE=0`` the phases: three loops (max, Σ E·l, Σ E·acc / Σ)."""
    one, phases = _source(monkeypatch, True), _source(monkeypatch, False)
    loop = "for (idx_t lum_c = lum_lane; lum_c < lum_n; lum_c += GROUP)"
    assert one.count(loop) == 1 and "lum_m = " in one and one.count("lum_group_reduce<") == 3
    assert phases.count(loop) == 3 and "lum_m = " not in phases and phases.count("lum_group_reduce<") == 3
    assert one != phases


def test_the_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv(ENV_ROW_ONLINE, "yes")
    with pytest.raises((ValueError, CodegenError), match=ENV_ROW_ONLINE):
        generate(_combine(), ("p",), arg_dtypes=[DType.f32] * 4)


def test_a_k_that_varies_along_the_row_keeps_the_phases(monkeypatch):
    """K read at each chunk (not one value a row): the rescale could not use it, so the phases run."""
    monkeypatch.setenv(ENV_ROW_ONLINE, "1")
    op = _combine()
    varying = Arg(op.args[3].src, ShapeTracker(op.args[3].view.shape, (as_expr(0),) * 3 + (as_expr(1),),
                                               as_expr(0)))
    op2 = replace(op, args=op.args[:3] + (varying,))
    src = generate(op2, ("p",), arg_dtypes=[DType.f32] * 4, max_dyn={"p": 4096}).source
    assert "lum_m = " not in src


@pytest.mark.parametrize("acc,math", [("f64", "f32"), ("f32", "f64")])
def test_f64_accumulation_or_math_keeps_the_phases(monkeypatch, acc, math):
    """The one visit rescales in f32: a kernel asked to accumulate or compute in f64 keeps the phases."""
    monkeypatch.setenv(ENV_ROW_ONLINE, "1")
    src = generate(_combine(), ("p",), arg_dtypes=[DType.f32] * 4, max_dyn={"p": 4096}, acc=acc, math=math).source
    assert "lum_m = " not in src and "lum_rv0" in src
