"""Codegen without a GPU: the C index expressions kernels contain, evaluated here by a tiny C-subset
interpreter, must address exactly the elements numpy's strided views do; generated sources must be
complete (no placeholders), stable, and describe their launches and dyn slots correctly."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from lum.builder import codegen
from lum.builder.codegen import CodegenError, access_plan, coalesce, generate, generate_program, render
from lum.format.dtypes import DType
from lum.format.expr import Var, as_expr, parse
from lum.format.llir import ELEMENTWISE_ARITY, Arg, LOp, Program
from lum.format.numerics import view_of
from lum.format.shapetracker import ShapeTracker, numel

S, P = Var("s"), Var("p")


# ============================================================================ a tiny C evaluator
_TOK = re.compile(r"\s*(?:(\d+)(?:LL|ll|L)?|([A-Za-z_]\w*)|(<=|>=|==|!=|&&|\|\||/=|[-+*/%<>()?:,!=;]))")


def _c_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _c_mod(a: int, b: int) -> int:
    return a - b * _c_div(a, b)


_FUNCS = {
    "lum_floordiv": lambda a, b: a // b,
    "lum_ceildiv": lambda a, b: -((-a) // b),
    "lum_mod": lambda a, b: a % b,
    "lum_min": min,
    "lum_max": max,
}
_TYPES = {"idx_t", "int", "long", "bool"}


class CExpr:
    """Recursive-descent evaluator for the C subset codegen prints (integers, casts as no-ops)."""

    def __init__(self, text: str, env: dict[str, int]):
        self.toks = []
        pos = 0
        text = text.strip()
        while pos < len(text):
            m = _TOK.match(text, pos)
            assert m and m.end() > pos, f"cannot tokenise {text[pos:]!r}"
            self.toks.append(m.group(1) or m.group(2) or m.group(3))
            pos = m.end()
        self.i = 0
        self.env = env

    def peek(self, k: int = 0):
        return self.toks[self.i + k] if self.i + k < len(self.toks) else None

    def take(self, want: str | None = None) -> str:
        t = self.toks[self.i]
        assert want is None or t == want, (t, want, self.toks)
        self.i += 1
        return t

    def run(self) -> int:
        v = self.ternary()
        assert self.i == len(self.toks), self.toks[self.i:]
        return v

    def ternary(self) -> int:
        c = self.lor()
        if self.peek() == "?":
            self.take()
            a = self.ternary()
            self.take(":")
            b = self.ternary()
            return a if c else b
        return c

    def lor(self) -> int:
        v = self.land()
        while self.peek() == "||":
            self.take()
            r = self.land()
            v = int(bool(v) or bool(r))
        return v

    def land(self) -> int:
        v = self.eq()
        while self.peek() == "&&":
            self.take()
            r = self.eq()
            v = int(bool(v) and bool(r))
        return v

    def eq(self) -> int:
        v = self.rel()
        while self.peek() in ("==", "!="):
            op = self.take()
            r = self.rel()
            v = int(v == r) if op == "==" else int(v != r)
        return v

    def rel(self) -> int:
        v = self.add()
        while self.peek() in ("<", "<=", ">", ">="):
            op = self.take()
            r = self.add()
            v = int({"<": v < r, "<=": v <= r, ">": v > r, ">=": v >= r}[op])
        return v

    def add(self) -> int:
        v = self.mul()
        while self.peek() in ("+", "-"):
            op = self.take()
            r = self.mul()
            v = v + r if op == "+" else v - r
        return v

    def mul(self) -> int:
        v = self.unary()
        while self.peek() in ("*", "/", "%"):
            op = self.take()
            r = self.unary()
            v = v * r if op == "*" else _c_div(v, r) if op == "/" else _c_mod(v, r)
        return v

    def unary(self) -> int:
        t = self.peek()
        if t == "-":
            self.take()
            return -self.unary()
        if t == "!":
            self.take()
            return int(not self.unary())
        if t == "(" and self.peek(1) in _TYPES:      # a cast: (idx_t)x, (long long)x
            self.take("(")
            while self.peek() != ")":
                assert self.take() in _TYPES
            self.take(")")
            return self.unary()
        return self.primary()

    def primary(self) -> int:
        t = self.take()
        if t == "(":
            v = self.ternary()
            self.take(")")
            return v
        if t.isdigit():
            return int(t)
        if t in ("true", "false"):
            return int(t == "true")
        if t in _FUNCS:
            self.take("(")
            args = [self.ternary()]
            while self.peek() == ",":
                self.take()
                args.append(self.ternary())
            self.take(")")
            return _FUNCS[t](*args)
        return self.env[t]


def c_eval(text: str, env: dict[str, int]) -> int:
    return CExpr(text, env).run()


def c_exec(stmts: str, env: dict[str, int]) -> dict[str, int]:
    """Run the unravel statements (`[const] idx_t x = e;`, `x /= e;`)."""
    env = dict(env)
    for st in stmts.split(";"):
        st = st.strip()
        if not st or st.startswith("(void)"):
            continue
        m = re.fullmatch(r"(?:const\s+)?(?:idx_t\s+)?(\w+)\s*(/=|=)\s*(.+)", st, re.S)
        assert m, st
        name, op, e = m.groups()
        v = c_eval(e, env)
        env[name] = _c_div(env[name], v) if op == "/=" else v
    return env


# ============================================================================ the tiny evaluator itself
def test_c_eval_semantics():
    assert c_eval("lum_floordiv(-7, 2)", {}) == -4
    assert c_eval("-7 / 2", {}) == -3 and c_eval("-7 % 2", {}) == -1
    assert c_eval("lum_mod(-7, 3) + lum_ceildiv(7, 2)", {}) == 2 + 4
    assert c_eval("(1 <= x) && (x < 13) ? 5 : 6", {"x": 1}) == 5
    assert c_eval("(idx_t)(x % 16) * 4", {"x": 35}) == 12
    e = parse("cdiv(s, 4) + s // 3 * 2 + min(s, 5) % 3")
    for s in range(0, 20):
        assert c_eval(e.to_c().replace("s", "lum_d_s"), {"lum_d_s": s}) == e.evaluate({"s": s})


# ============================================================================ view index expressions
def _random_view(rng: random.Random, dyn: dict[str, int]) -> tuple[ShapeTracker, tuple[int, ...]]:
    """A random view (permute / broadcast / pad / slice, possibly symbolic dims) of a contiguous buffer;
    returns it and the buffer shape (evaluated)."""
    nd = rng.randint(1, 3)
    dims = [rng.choice([1, 2, 3, 5, S, P + 1]) for _ in range(nd)]
    v = ShapeTracker.contiguous(dims)
    base_shape = tuple(as_expr(d).evaluate(dyn) for d in dims)
    for _ in range(rng.randint(0, 4)):
        c = rng.randrange(5)
        if c == 0 and v.ndim > 1:
            order = list(range(v.ndim))
            rng.shuffle(order)
            v = v.permute(order)
        elif c == 1 and v.ndim < 4:
            v = v.expand_dim(rng.randint(0, v.ndim), rng.choice([1, 3, S]))
        elif c == 2:
            ax = rng.randrange(v.ndim)
            v = v.pad(ax, rng.choice([0, 1, 2, P]), rng.choice([0, 1, 3]))
        elif c == 3:
            ax = rng.randrange(v.ndim)
            d = v.shape[ax].evaluate(dyn)
            if d >= 2:
                v = v.slice(ax, 1, d)
    return v, base_shape


@pytest.mark.parametrize("seed", range(60))
def test_access_plan_matches_numpy_views(seed):
    rng = random.Random(seed)
    dyn = {"s": rng.randint(1, 4), "p": rng.randint(0, 3)}
    v, base = _random_view(rng, dyn)
    buf = np.arange(1, 1 + int(np.prod(base)), dtype=np.int64)       # never 0, so padding (0) is visible
    expect = view_of(buf, v, dyn)
    out = ShapeTracker.contiguous(v.shape)
    plan = access_plan(v.shape, [out, v], ["p", "s"])
    env0 = {f"lum_d_{k}": dyn[k] for k in plan.dyn_slots}
    assert plan.dyn_slots == {k: ["p", "s"].index(k) for k in plan.dyn_slots}
    n = numel(v.shape).evaluate(dyn)
    assert numel(plan.shape).evaluate(dyn) == n
    (ophys, ovalid), (phys, valid) = plan.access
    assert ovalid is None
    got = np.empty(n, dtype=np.int64)
    for w in range(n):
        env = c_exec(plan.unravel, {**env0, "lum_w": w})
        assert c_eval(ophys, env) == w                                 # the output is contiguous
        ok = True if valid is None else bool(c_eval(valid, env))
        got[w] = buf[c_eval(phys, env)] if ok else 0
        # and the Exprs behind the C text agree with ShapeTracker's own validity
        idx = [env[f"lum_i{k}"] for k in range(len(plan.shape))]
        assert plan.views[1].validity(idx).evaluate(dyn) == int(ok)
    np.testing.assert_array_equal(got, expect.reshape(-1))


def test_coalesce_merges_contiguous_and_keeps_masks():
    v = ShapeTracker.contiguous((S, 8, 16))
    shape, (cv,) = coalesce(v.shape, [v])
    assert shape == (S * 128,) and cv.strides == (as_expr(1),)
    b = ShapeTracker.contiguous((16,)).expand_dim(0, S).expand_dim(1, 8)     # [s, 8, 16] broadcast rows
    shape, (cv, cb) = coalesce(v.shape, [v, b])
    assert shape == (S * 8, as_expr(16)) and cb.strides == (as_expr(0), as_expr(1))
    pad = ShapeTracker.contiguous((S, 8, 12)).pad(2, 1, 3)
    shape, (cv, cp) = coalesce(pad.shape, [v, pad])
    assert shape == (S * 8, as_expr(16)) and cp.mask is not None
    one = ShapeTracker.contiguous((1, S, 1))
    shape, _ = coalesce(one.shape, [one])
    assert shape == (S,)


def test_unravel_vectorised_groups():
    plan = access_plan((S, 32), [ShapeTracker.contiguous((S, 32))], ["s"], vec=4)
    seen = []
    for w in range(3 * 32 // 4):
        env = c_exec(plan.unravel, {"lum_d_s": 3, "lum_w": w})
        seen.append(c_eval(plan.access[0][0], env))
    assert seen == list(range(0, 96, 4))


# ============================================================================ generated sources
def _ew(op: str, views, shape, dtype=DType.f32, **kw) -> LOp:
    return LOp(1, "elementwise", op, tuple(Arg(0, v) for v in views), tuple(as_expr(d) for d in shape), dtype, **kw)


def _all_kernel_ops() -> list[tuple[LOp, list[DType]]]:
    x = ShapeTracker.contiguous((S, 8, 16))
    xp = ShapeTracker.contiguous((S, 16, 8)).permute((0, 2, 1))
    xpad = ShapeTracker.contiguous((S, 8, 12)).pad(2, 1, 3)
    shape = (S, 8, 16)
    ops = []
    for name, ar in ELEMENTWISE_ARITY.items():
        views = [x, xp, xpad][:ar]
        out = DType.bool if name == "LessThan" else DType.bf16
        dts = [DType.bf16] * ar
        if name == "Where":
            dts[0] = DType.bool
        ops.append((_ew(name, views, shape, out), dts))
    ops.append((LOp(1, "reduce", "Sum", (Arg(0, xpad),), (S, as_expr(8)), DType.f16, {"axis": 2}), [DType.f16]))
    ops.append((LOp(1, "reduce", "Max", (Arg(0, x),), (as_expr(8), as_expr(16)), DType.f32, {"axis": 0}), [DType.f32]))
    table, idx = ShapeTracker.contiguous((100, 64)), ShapeTracker.contiguous((S,))
    ops.append((LOp(2, "gather", "", (Arg(0, table), Arg(1, idx)), (S, as_expr(64)), DType.bf16),
                [DType.bf16, DType.i32]))
    cache, src = ShapeTracker.contiguous((P + S, 64)), ShapeTracker.contiguous((S, 64))
    ops.append((LOp(3, "scatter", "", (Arg(0, cache), Arg(1, src), Arg(2, idx)), (P + S, as_expr(64)), DType.f32),
                [DType.f32, DType.f32, DType.i64]))
    ops.append((LOp(3, "scatter_nocopy", "", (Arg(0, cache), Arg(1, src), Arg(2, idx)), (P + S, as_expr(64)),
                    DType.f32, alias=0), [DType.f32, DType.f32, DType.i64]))
    ops.append((LOp(4, "iota", "", (), (S,), DType.i64, {"n": S}), []))
    return ops


@pytest.mark.parametrize("case", range(len(_all_kernel_ops())))
def test_generated_source_is_complete_and_stable(case):
    op, dts = _all_kernel_ops()[case]
    ks = generate(op, ["s", "p"], arg_dtypes=dts)
    assert ks is not None
    assert not re.search(r"\{\{\w+\}\}", ks.source) and "//!" not in ks.source
    assert "@IDX_T@" not in ks.source and "@DYN_LOADS@" not in ks.source and codegen.ENTRY_PLACEHOLDER not in ks.source
    assert ks.source.startswith(codegen.common_header())
    for lc in ks.launches:
        assert re.search(rf'extern "C" __global__ void __launch_bounds__\(\d+\) {lc.kernel}\(', ks.body)
        g = [x.evaluate({"s": 5, "p": 7}) for x in lc.grid]
        assert g[0] >= 1 and g[1:] == [1, 1]
        assert [x.evaluate({"s": 0, "p": 0}) for x in lc.grid][0] >= 1   # a launch is never empty
        assert lc.block[0] == ks.tuning["threads"]
    # parameters: out, in0.., dyn, in the signature's order
    names = [p.name for p in ks.params]
    assert names == ["out"] + [f"in{k}" for k in range(len(op.args))] + ["dyn"]
    sig = re.search(rf"{ks.launches[0].kernel}\((.*?)\) \{{", ks.body).group(1)
    assert sig == ", ".join(p.ctype for p in ks.params)
    # the dyn vars it reads come from their slots
    for v, k in ks.dyn_slots.items():
        assert f"lum_d_{v} = (idx_t)dyn[{k}]" in ks.body
    assert set(ks.dyn_slots) <= {"s", "p"}
    # stable: the same op gives the same name and text; a different dtype a different name
    again = generate(op, ["s", "p"], arg_dtypes=dts)
    assert again.name == ks.name and again.source == ks.source
    ks.to_json()   # serialisable


def test_names_differ_by_dtype_shape_and_tuning():
    x = ShapeTracker.contiguous((S, 64))
    a = generate(_ew("Exp2", [x], (S, 64), DType.f32), ["s"])
    b = generate(_ew("Exp2", [x], (S, 64), DType.f16), ["s"])
    c = generate(_ew("Exp2", [ShapeTracker.contiguous((S, 32))], (S, 32), DType.f32), ["s"])
    d = generate(_ew("Exp2", [x], (S, 64), DType.f32), ["s"], threads=128)
    assert len({a.name, b.name, c.name, d.name}) == 4
    assert a.name.startswith("lum_elementwise_exp2_")


def test_dyn_slots_follow_the_given_order():
    v = ShapeTracker.contiguous((S, P))
    ks = generate(_ew("Sqrt", [v], (S, P)), ["a", "p", "s"])
    assert ks.dyn_slots == {"p": 1, "s": 2}
    with pytest.raises(CodegenError, match="not in dyn_vars"):
        generate(_ew("Sqrt", [v], (S, P)), ["s"])


def test_index_width():
    small = ShapeTracker.contiguous((64, 128))
    assert generate(_ew("Sqrt", [small], (64, 128)), []).tuning["index_bits"] == 32
    dyn = ShapeTracker.contiguous((S, 128))
    assert generate(_ew("Sqrt", [dyn], (S, 128)), ["s"]).tuning["index_bits"] == 64
    assert generate(_ew("Sqrt", [dyn], (S, 128)), ["s"], max_dyn={"s": 8192}).tuning["index_bits"] == 32
    huge = ShapeTracker.contiguous((2**20, 4096))
    ks = generate(_ew("Sqrt", [huge], (2**20, 4096)), [])
    assert ks.tuning["index_bits"] == 64 and "typedef long long idx_t;" in ks.body
    assert "typedef int idx_t;" in generate(_ew("Sqrt", [small], (64, 128)), [], index_bits=32).body


def test_vector_width_choice():
    x = ShapeTracker.contiguous((S, 64))
    assert generate(_ew("Add", [x, x], (S, 64), DType.bf16), ["s"]).tuning["vec"] == 8
    assert generate(_ew("Add", [x, x], (S, 64), DType.f32), ["s"]).tuning["vec"] == 4
    assert generate(_ew("Add", [x, x], (S, 64), DType.f32), ["s"], vec=2).tuning["vec"] == 2
    assert generate(_ew("Add", [x, x], (S, 64), DType.f32), ["s"], vec=1).tuning["vec"] == 1
    xt = ShapeTracker.contiguous((64, S)).permute((1, 0))
    assert generate(_ew("Add", [x, xt], (S, 64), DType.f32), ["s"]).tuning["vec"] == 1
    off = ShapeTracker.contiguous((S, 65)).slice(1, 1, 65)              # offset 1, row stride 65
    assert generate(_ew("Add", [x, off], (S, 64), DType.f32), ["s"]).tuning["vec"] == 1
    bc = ShapeTracker.contiguous((64,)).expand_dim(0, S)
    ks = generate(_ew("Mul", [x, bc], (S, 64), DType.f32), ["s"])
    assert ks.tuning["vec"] == 4 and "lum_vec<float, 4>" in ks.body
    cast = generate(_ew("Cast", [x], (S, 64), DType.bf16), ["s"], arg_dtypes=[DType.f32])
    assert cast.tuning["vec"] == 4                                       # 4 x f32 = 16 bytes


def test_same_dtype_copy_moves_raw_bits():
    x = ShapeTracker.contiguous((64, S)).permute((1, 0))
    ks = generate(_ew("Contiguous", [x], (S, 64), DType.bf16), ["s"])
    assert "lum_bf16_to_f32" not in ks.body and "lum_f32_to_bf16" not in ks.body


def test_library_and_non_kernel_ops_give_none():
    gemm = LOp(2, "gemm", "", (Arg(0, ShapeTracker.contiguous((64,))), Arg(1, ShapeTracker.contiguous((64,)))),
               (S, as_expr(8)), DType.f32, {"layout": "RmRm", "m": S, "n": 8, "k": 8, "lda": 8, "ldb": 8})
    assert generate(gemm, ["s"]) is None                  # m = s: cuBLASLt (a small static m: tests/test_gemv.py)
    assert generate(LOp(0, "input", "", (), (S,), DType.f32, {"name": "x"}), ["s"]) is None


def test_arg_dtypes_required_where_not_implied():
    x = ShapeTracker.contiguous((8,))
    with pytest.raises(CodegenError, match="arg_dtypes"):
        generate(_ew("Cast", [x], (8,), DType.f16), [])
    with pytest.raises(CodegenError, match="arg_dtypes"):
        generate(_ew("LessThan", [x, x], (8,), DType.bool), [])
    with pytest.raises(CodegenError, match="integer"):
        generate(LOp(2, "gather", "", (Arg(0, ShapeTracker.contiguous((4, 8))), Arg(1, x)), (8, 8), DType.f32), [],
                 arg_dtypes=[DType.f32, DType.f32])


def test_generate_program_infers_arg_dtypes():
    x = ShapeTracker.contiguous((S, 16))
    ops = [
        LOp(0, "input", "", (), (S, as_expr(16)), DType.bf16, {"name": "x"}),
        LOp(1, "elementwise", "Cast", (Arg(0, x),), (S, as_expr(16)), DType.f32),
        LOp(2, "elementwise", "LessThan", (Arg(1, x), Arg(1, x)), (S, as_expr(16)), DType.bool),
        LOp(3, "reduce", "Sum", (Arg(1, x),), (S,), DType.f32, {"axis": 1}),
        LOp(4, "output", "", (Arg(3, ShapeTracker.contiguous((S,))),), (S,), DType.f32, {"name": "y"}),
    ]
    res = generate_program(Program("g", ops))
    assert res[0] is None and res[4] is None
    assert res[1].params[1].dtype == DType.bf16 and res[2].params[1].dtype == DType.f32
    assert res[1].dyn_vars == ("s",)


def test_render_is_strict():
    assert render("//! doc {{X}}\na {{A}} b\n", {"A": 1}) == "a 1 b\n"
    with pytest.raises(CodegenError, match="without a value"):
        render("{{A}} {{B}}", {"A": 1})
    with pytest.raises(CodegenError, match="lacks"):
        render("{{A}}", {"A": 1, "C": 2})


def test_every_template_has_only_known_placeholders():
    for name in ("elementwise.cu", "reduce.cu", "gather.cu", "scatter.cu", "iota.cu"):
        text = codegen.load_template(name)
        body = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("//!"))
        assert set(re.findall(r"\{\{(\w+)\}\}", body)) >= {"KERNEL", "THREADS", "IDX_T", "PARAMS", "DYN_LOADS"}
    assert "{{" not in codegen.common_header()


def test_unsafe_in_place_is_rejected():
    x = ShapeTracker.contiguous((8, 8))
    with pytest.raises(CodegenError, match="race"):
        generate(LOp(1, "elementwise", "Add", (Arg(0, x), Arg(0, x.permute((1, 0)))), (8, 8), DType.f32, alias=0), [])
    assert generate(LOp(1, "elementwise", "Mul", (Arg(0, x), Arg(0, x)), (8, 8), DType.f32, alias=0), []) is not None


def test_reduce_tuning_and_padding_fixup():
    xpad = ShapeTracker.contiguous((S, 12)).pad(1, 2, 2)
    mx = generate(LOp(1, "reduce", "Max", (Arg(0, xpad),), (S,), DType.f32, {"axis": 1}), ["s"], group=64)
    assert mx.tuning["group"] == 64 and "LumMax::apply(lum_acc, (acc_t)0)" in mx.body
    sm = generate(LOp(1, "reduce", "Sum", (Arg(0, xpad),), (S,), DType.bf16, {"axis": -1}), ["s"], acc="f64")
    assert "typedef double acc_t;" in sm.body and "LumMax::apply(lum_acc, (acc_t)0)" not in sm.body
    # reducing an outer axis defaults to one thread per output row (coalesced across rows)
    col = generate(LOp(1, "reduce", "Sum", (Arg(0, ShapeTracker.contiguous((512, 4096))),), (as_expr(4096),),
                       DType.f32, {"axis": 0}), [])
    assert col.tuning["group"] == 1
    with pytest.raises(CodegenError, match="power of two"):
        generate(LOp(1, "reduce", "Sum", (Arg(0, xpad),), (S,), DType.f32, {"axis": 1}), ["s"], group=48)


# ============================================================================ host emulation
# The generated kernels, compiled for the CPU with a tiny CUDA shim (one OS thread per CUDA thread,
# barriers for __syncthreads and warp shuffles) and run against the numpy reference backend. This
# checks their semantics (views, masks, conversions, reductions, gather/scatter) before any GPU run.
import ctypes  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402

import ml_dtypes  # noqa: E402

from lum.loader.reference_backend import execute  # noqa: E402

CXX = shutil.which("g++") or shutil.which("clang++")

_SHIM = r"""
#include <cmath>
#include <cstring>
#include <cstdint>
#include <thread>
#include <mutex>
#include <condition_variable>
#include <vector>
#include <functional>
struct lum_dim3 { unsigned x = 0, y = 0, z = 0; };
static thread_local lum_dim3 threadIdx, blockIdx;
static lum_dim3 blockDim, gridDim;
struct lum_emu_barrier {
  std::mutex m; std::condition_variable cv; int n, count = 0; long gen = 0;
  explicit lum_emu_barrier(int n_) : n(n_) {}
  void wait() {
    std::unique_lock<std::mutex> lk(m); long g = gen;
    if (++count == n) { count = 0; ++gen; cv.notify_all(); } else cv.wait(lk, [&] { return gen != g; });
  }
};
static lum_emu_barrier* lum_emu_block_bar = nullptr;
static std::vector<lum_emu_barrier*> lum_emu_warp_bar;
static std::vector<uint64_t> lum_emu_slots;
static void __syncthreads() { lum_emu_block_bar->wait(); }
static std::mutex lum_emu_atomic;
static void __threadfence() { std::lock_guard<std::mutex> lk(lum_emu_atomic); }
static unsigned atomicAdd(unsigned* p, unsigned v) {
  std::lock_guard<std::mutex> lk(lum_emu_atomic); const unsigned old = *p; *p = old + v; return old;
}
template <typename T> static T __shfl_xor_sync(unsigned, T v, int lane_mask, int width) {
  const int tid = (int)threadIdx.x, warp = tid / 32, lane = tid % 32;
  uint64_t bits = 0; std::memcpy(&bits, &v, sizeof(T));
  lum_emu_slots[tid] = bits;
  lum_emu_warp_bar[warp]->wait();
  int src = lane ^ lane_mask;
  if (src / width != lane / width) src = lane;
  uint64_t got = lum_emu_slots[warp * 32 + src];
  lum_emu_warp_bar[warp]->wait();
  T out; std::memcpy(&out, &got, sizeof(T)); return out;
}
static void lum_emu_run(unsigned grid, unsigned block, const std::function<void()>& fn) {
  gridDim.x = grid; blockDim.x = block;
  lum_emu_slots.assign(block, 0);
  for (unsigned b = 0; b < grid; ++b) {
    lum_emu_barrier bar(block); lum_emu_block_bar = &bar;
    std::vector<lum_emu_barrier*> wb; for (unsigned w = 0; w < block / 32; ++w) wb.push_back(new lum_emu_barrier(32));
    lum_emu_warp_bar = wb;
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < block; ++t) ts.emplace_back([=] { threadIdx.x = t; blockIdx.x = b; fn(); });
    for (auto& t : ts) t.join();
    for (auto* w : wb) delete w;
  }
}
#define __CUDACC__ 1
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
"""


def _ptype(ctype: str) -> str:
    return re.sub(r"\b__restrict__\b", "", ctype.rsplit(" ", 1)[0]).strip()


class _Emu:
    def __init__(self, kernels, tmp_path):
        src = [_SHIM, codegen.module_source(kernels)]
        for k in kernels:
            for lc in k.launches:
                casts = ", ".join(f"({_ptype(p.ctype)})a[{i}]" for i, p in enumerate(k.params))
                src.append(f'extern "C" void run_{lc.kernel}(void** a, unsigned grid, unsigned block) '
                           f'{{ lum_emu_run(grid, block, [&] {{ {lc.kernel}({casts}); }}); }}')
        (tmp_path / "emu.cpp").write_text("\n".join(src))
        so = tmp_path / "emu.so"
        r = subprocess.run([CXX, "-std=c++17", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas",
                            "-o", str(so), str(tmp_path / "emu.cpp")], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[:5000]
        self.lib = ctypes.CDLL(str(so))

    def launch(self, ks, buffers, dyn_map, max_grid=2):
        dyn = np.array([dyn_map[v] for v in ks.dyn_vars] or [0], dtype=np.int64)
        ptrs = [b.ctypes.data for b in buffers] + [dyn.ctypes.data]
        arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
        for lc in ks.launches:
            (g, _, _), (blk, _, _), _ = lc.evaluate(dyn_map)
            getattr(self.lib, f"run_{lc.kernel}")(arr, ctypes.c_uint(min(g, max_grid)), ctypes.c_uint(blk))


def _rand(dt: DType, n: int, rng, positive=False) -> np.ndarray:
    if dt.is_float:
        x = rng.uniform(0.25, 4.0, n) * (1 if positive else rng.choice([-1, 1], n))
        return x.astype(dt.np)
    if dt.is_int:
        x = rng.integers(1, 50, n) * (1 if positive else rng.choice([-1, 1], n))
        return x.astype(dt.np)
    return rng.integers(0, 2, n).astype(np.bool_)


def _case_list():
    """(op, arg buffer sizes, arg dtypes, generate kwargs) with views over flat 1-D input buffers."""
    s = S
    x = ShapeTracker.contiguous((s, 4, 16))
    xp = ShapeTracker.contiguous((s, 16, 4)).permute((0, 2, 1))
    xpad = ShapeTracker.contiguous((s, 4, 12)).pad(2, 1, 3)
    bc = ShapeTracker.contiguous((16,)).expand_dim(0, 4).expand_dim(0, s)
    win = ShapeTracker.contiguous((P + s, 4, 16)).slice(0, P, P + s)
    shape = (s, as_expr(4), as_expr(16))
    size = {id(x): 64 * s, id(xp): 64 * s, id(xpad): 48 * s, id(bc): as_expr(16), id(win): 64 * (P + s)}
    cases = []
    for dt in DType:
        for name, ar in ELEMENTWISE_ARITY.items():
            for variant, vs in enumerate(([x, xp, xpad][:ar], [xpad, bc, win][:ar], [win, x, bc][:ar])):
                dts = [dt] * ar
                res = DType.bool if name == "LessThan" else dt
                if name == "Where":
                    dts[0] = DType.bool
                if name == "Cast":
                    res = list(DType)[(list(DType).index(dt) + 1 + variant) % 6]
                kw = {"vec": 1} if variant == 2 else {}
                cases.append((LOp(1, "elementwise", name, tuple(Arg(0, v) for v in vs), shape, res),
                              [size[id(v)] for v in vs], dts, kw))
    # Fused: one tree with 16-bit, int and bool intermediates and repeated leaves / subtrees
    for dt in (DType.f32, DType.bf16, DType.f16):
        t = ["Add", "f32", ["Mul", "f32", ["Cast", "f32", ["arg", 0]], ["arg", 2]], ["Cast", "f32", ["arg", 1]]]
        h = ["Cast", "f32", ["Cast", "bf16" if dt != DType.bf16 else "f16", t]]
        c = ["LessThan", "bool", ["arg", 2], h]
        m = ["Cast", "f32", ["Mod", "i64", ["Cast", "i64", t], ["Cast", "i64", ["arg", 3]]]]
        expr = ["Cast", dt.value, ["Where", "f32", c, ["Exp2", "f32", ["Mul", "f32", h, ["arg", 2]]],
                                   ["Add", "f32", m, ["Sqrt", "f32", ["Mul", "f32", h, h]]]]]
        for vs, kw in (((x, x, bc, x), {}), ((xp, xpad, win, bc), {}), ((win, x, xp, x), {"vec": 1, "math": "f64"})):
            cases.append((LOp(1, "elementwise", "Fused", tuple(Arg(0, v) for v in vs), shape, dt, {"expr": expr}),
                          [size[id(v)] for v in vs], [dt, dt, DType.f32, DType.i32], kw))
    for dt in DType:
        for red in ("Sum", "Max"):
            for view, axis, group in ((x, 2, None), (xpad, -1, 64), (xp, 0, 1), (x, 1, 32), (xpad, 2, 8),
                                      (xp, 2, 256), (win, 0, None)):
                oshape = tuple(d for k, d in enumerate(view.shape) if k != axis % 3)
                cases.append((LOp(1, "reduce", red, (Arg(0, view),), oshape, dt, {"axis": axis}),
                              [size[id(view)]], [dt], {"group": group}))
    # reductions with a fused prologue: per-leaf strides and padding along and across the reduced axis
    # (padded leaves read 0 and the expression still runs there), 16-bit / int / bool roots
    pro = ["Mul", "f32", ["Add", "f32", ["Cast", "f32", ["arg", 0]], ["arg", 1]], ["Cast", "f32", ["arg", 2]]]
    for dt in (DType.f32, DType.bf16, DType.f16):
        for red, root in (("Sum", ["Sin", dt.value, pro]), ("Max", ["Cast", dt.value, pro])):
            f64 = {"acc": "f64", "math": "f64"}
            for vs, axis, kw in (((x, bc, x), 2, {}), ((xpad, x, xp), -1, {"group": 64}),
                                 ((xp, xpad, win), 0, {"group": 1}), ((win, bc, xpad), 1, f64)):
                oshape = tuple(d for k, d in enumerate(shape) if k != axis % 3)
                cases.append((LOp(1, "reduce", red, tuple(Arg(0, v) for v in vs), oshape, dt,
                                  {"axis": axis, "expr": root}), [size[id(v)] for v in vs], [dt, DType.f32, dt], kw))
    for red, dt, root in (("Sum", DType.i32, ["Mul", "i32", ["Cast", "i32", ["arg", 0]], ["arg", 1]]),
                          ("Max", DType.bool, ["LessThan", "bool", ["arg", 0], ["Cast", "f32", ["arg", 1]]]),
                          ("Max", DType.i64, ["Add", "i64", ["arg", 1], ["Cast", "i64", ["arg", 0]]])):
        for vs, axis in (((xpad, x), 2), ((xp, win), 1)):
            oshape = tuple(d for k, d in enumerate(shape) if k != axis)
            cases.append((LOp(1, "reduce", red, tuple(Arg(0, v) for v in vs), oshape, dt,
                              {"axis": axis, "expr": root}), [size[id(v)] for v in vs], [DType.f32, DType.i32], {}))
    table, table_t = ShapeTracker.contiguous((10, 24)), ShapeTracker.contiguous((24, 10)).permute((1, 0))
    table_pad = ShapeTracker.contiguous((8, 24)).pad(0, 1, 1)
    idx, idx2 = ShapeTracker.contiguous((s,)), ShapeTracker.contiguous((2, s))
    for dt in DType:
        for it in (DType.i32, DType.i64):
            cases.append((LOp(2, "gather", "", (Arg(0, table), Arg(1, idx)), (s, as_expr(24)), dt),
                          [240, s], [dt, it], {}))
            cases.append((LOp(2, "gather", "", (Arg(0, table_t), Arg(1, idx2)), (as_expr(2), s, as_expr(24)), dt),
                          [240, 2 * s], [DType.f32 if dt != DType.f32 else DType.bf16, it], {}))
            cases.append((LOp(2, "gather", "", (Arg(0, table_pad), Arg(1, idx)), (s, as_expr(24)), dt),
                          [192, s], [dt, it], {}))
    cache = ShapeTracker.contiguous((12, 4, 8))
    src, src_p = ShapeTracker.contiguous((s, 4, 8)), ShapeTracker.contiguous((4, s, 8)).permute((1, 0, 2))
    for dt in DType:
        it = DType.i64 if dt.value < "g" else DType.i32
        cases.append((LOp(3, "scatter", "", (Arg(0, cache), Arg(1, src), Arg(2, idx)), cache.shape, dt),
                      [384, 32 * s, s], [dt, dt, it], {}))
        cases.append((LOp(3, "scatter", "", (Arg(0, cache), Arg(1, src_p), Arg(2, idx)), cache.shape, dt),
                      [384, 32 * s, s], [DType.f32, DType.bf16 if dt != DType.bf16 else DType.f16, it], {}))
        cases.append((LOp(3, "scatter_nocopy", "", (Arg(0, cache), Arg(1, src), Arg(2, idx)), cache.shape, dt,
                          alias=0), [384, 32 * s, s], [dt, dt, it], {}))
        cases.append((LOp(4, "iota", "", (), (s + P,), dt, {"n": s + P}), [], [], {}))
    cases.append((LOp(1, "elementwise", "Add", (Arg(0, win), Arg(1, bc)), shape, DType.bf16, alias=0),
                  [64 * (P + s), as_expr(16)], [DType.bf16, DType.bf16], {}))
    # scalars, long rows, many rows (several grid-stride iterations with grid <= 2), f64 modes
    v1 = ShapeTracker.contiguous((700 * s,))
    cases.append((LOp(1, "reduce", "Sum", (Arg(0, v1),), (), DType.f32, {"axis": 0}), [700 * s], [DType.f32], {}))
    cases.append((LOp(1, "reduce", "Max", (Arg(0, v1),), (), DType.bf16, {"axis": 0}), [700 * s], [DType.bf16],
                  {"group": 256}))
    cases.append((LOp(1, "reduce", "Sum", (Arg(0, v1),), (), DType.f16, {"axis": 0}), [700 * s], [DType.f16],
                  {"group": 1024, "threads": 1024, "acc": "f64"}))
    many = ShapeTracker.contiguous((300 * s, 9))
    for g in (1, 8, 64):
        cases.append((LOp(1, "reduce", "Max", (Arg(0, many),), (300 * s,), DType.f32, {"axis": 1}), [2700 * s],
                      [DType.f32], {"group": g, "threads": 64}))
    sc = ShapeTracker((), (), as_expr(5), None)
    cases.append((LOp(1, "elementwise", "Sqrt", (Arg(0, sc),), (), DType.f32), [as_expr(8)], [DType.f32],
                  {"math": "f64"}))
    big = ShapeTracker.contiguous((s, 1000))
    for kw in ({"threads": 32}, {"threads": 32, "vec": 1, "ept": 3}, {"threads": 64, "index_bits": 32}):
        cases.append((LOp(1, "elementwise", "Exp2", (Arg(0, big),), big.shape, DType.bf16), [1000 * s],
                      [DType.bf16], kw))
        cases.append((LOp(2, "gather", "", (Arg(0, table), Arg(1, idx)), (s, as_expr(24)), DType.f32), [240, s],
                      [DType.f32, DType.i64], kw))
    return cases


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    if CXX is None:
        pytest.skip("no host C++ compiler for the kernel emulation")
    cases = _case_list()
    kernels = [generate(op, ["s", "p"], arg_dtypes=dts, **kw) for op, _, dts, kw in cases]
    return cases, kernels, _Emu(kernels, tmp_path_factory.mktemp("emu"))


_TOL = {DType.f32: 2e-6, DType.f16: 2**-10, DType.bf16: 2**-7}


@pytest.mark.parametrize("case", range(len(_case_list())))
def test_kernels_match_reference_backend_on_host(emulated, case):
    cases, kernels, emu = emulated
    op, sizes, dts, _ = cases[case]
    ks = kernels[case]
    dyn_map = {"s": 3, "p": 2}
    rng = np.random.default_rng(case)
    positive = op.op in ("Log2", "Sqrt")
    bufs, ops = [], []
    for k, (n, dt) in enumerate(zip(sizes, dts)):
        n = as_expr(n).evaluate(dyn_map)
        if op.kind in ("gather", "scatter", "scatter_nocopy") and k == len(dts) - 1:
            rows = (op.args[0].view.shape[0]).evaluate(dyn_map)
            b = rng.permutation(rows)[:n].astype(dt.np) if op.kind != "gather" else rng.integers(0, rows, n).astype(dt.np)
        else:
            b = _rand(dt, n, rng, positive)
        bufs.append(b)
        ops.append(LOp(k, "input", "", (), (as_expr(n),), dt, {"name": f"in{k}", "role": "state"}))
    kop = LOp(len(ops), op.kind, op.op, tuple(Arg(k, a.view) for k, a in enumerate(op.args)), op.shape,
              op.dtype, op.params, op.alias)
    oshape = tuple(d.evaluate(dyn_map) for d in op.shape)
    alias = 0 if op.kind == "scatter_nocopy" else op.alias
    if alias is not None:   # the output is the whole aliased buffer
        out_view = ShapeTracker.contiguous((bufs[alias].size,))
        want_shape = (bufs[alias].size,)
    else:
        out_view = ShapeTracker.contiguous(op.shape)
        want_shape = oshape
    prog = Program("t", ops + [kop, LOp(len(ops) + 1, "output", "", (Arg(len(ops), out_view),),
                                        tuple(as_expr(d) for d in want_shape), op.dtype, {"name": "y"})])
    ref = execute(prog, {f"in{k}": b for k, b in enumerate(bufs)}, dyn_map)["y"]
    if alias is not None:
        out = bufs[alias].copy()
        call = [out] + [out if k == alias else b for k, b in enumerate(bufs)]
    else:
        out = np.zeros(int(np.prod(oshape)), dtype=op.dtype.np)
        call = [out] + bufs
    emu.launch(ks, call, dyn_map)
    got = out.reshape(want_shape)
    if op.dtype.is_float:
        g, r = got.astype(np.float64), ref.astype(np.float64)
        tol = _TOL[op.dtype] * (4 if op.op in ("Exp2", "Sin", "Log2", "Fused") else 1)
        if op.kind == "reduce" and op.op == "Sum":
            tol *= 8
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol, err_msg=ks.body)
    else:
        np.testing.assert_array_equal(got, ref, err_msg=ks.body)
