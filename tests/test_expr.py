"""Property and unit tests for lum.format.expr (symbolic integer expressions).

Random expression trees are described by small tuples (``("add", t1, t2)``, ``("var", "s")`` …) and
interpreted three ways: plain Python integers (the oracle), the simplifying operators of ``Expr``, and
the raw, unsimplified ``Expr(op, args)`` constructor.
"""

from __future__ import annotations

import builtins
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lum.format.expr import (
    Const, Expr, ExprParseError, UnboundVariableError, Var, cdiv, lt, parse, smax, smin,
)

VARS = ("s", "p", "a", "b")
s, p, a, b = (Var(n) for n in VARS)

# LUM_HYPOTHESIS_SCALE=20 runs 20x more examples (for a deeper hunt than the CI budget allows).
SCALE = float(os.environ.get("LUM_HYPOTHESIS_SCALE", "1"))
FAST = settings(max_examples=int(250 * SCALE), deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------- tree strategies
# Var semantics: variables are non-negative (the simplifier relies on it), so values are drawn >= 0.
# Divisors must never evaluate to 0 (division by zero has no value to compare); they are built as
# non-zero constants (of either sign), `x + k` with x >= 0 (a variable or max(tree, 0)) and k >= 1,
# `max(tree, k)` with k >= 1, or the negation of one of these.

consts = st.integers(-8, 8).map(lambda c: ("const", c))
var_leaves = st.sampled_from(VARS).map(lambda n: ("var", n))
# k*v + c: the shape of index arithmetic, so that divisibility/modulo rewrites get exercised often
affine = st.tuples(st.sampled_from((-4, -2, -1, 2, 3, 4, 6, 8)), var_leaves, st.integers(-9, 9)).map(
    lambda kvc: ("add", ("mul", ("const", kvc[0]), kvc[1]), ("const", kvc[2])))
leaves = st.one_of(consts, var_leaves, affine)


def _extend(children):
    two = st.tuples(children, children)
    nary = st.lists(children, min_size=2, max_size=3).map(tuple)
    divisor = _divisors(children)
    return st.one_of(
        nary.map(lambda xs: ("add",) + xs),
        two.map(lambda xs: ("sub",) + xs),
        nary.map(lambda xs: ("mul",) + xs),
        children.map(lambda x: ("neg", x)),
        st.tuples(children, divisor).map(lambda xs: ("div",) + xs),
        st.tuples(children, divisor).map(lambda xs: ("mod",) + xs),
        st.tuples(children, divisor).map(lambda xs: ("cdiv",) + xs),
        nary.map(lambda xs: ("min",) + xs),
        nary.map(lambda xs: ("max",) + xs),
        two.map(lambda xs: ("lt",) + xs),
    )


def _divisors(children):
    pos_const = st.sampled_from((1, 2, 2, 3, 4, 4, 5, 6, 8)).map(lambda c: ("const", c))
    nonneg = st.one_of(st.sampled_from(VARS).map(lambda n: ("var", n)),
                       children.map(lambda t: ("max", t, ("const", 0))))
    positive = st.one_of(
        pos_const,
        st.tuples(nonneg, st.integers(1, 3)).map(lambda xk: ("add", xk[0], ("const", xk[1]))),
        st.tuples(children, st.integers(1, 3)).map(lambda tk: ("max", tk[0], ("const", tk[1]))),
    )
    return st.one_of(positive, positive.map(lambda t: ("neg", t)))


trees = st.recursive(leaves, _extend, max_leaves=10)
envs = st.fixed_dictionaries({n: st.integers(0, 12) for n in VARS})
# sub-expressions used for substitution: non-negative valued (variables are non-negative by contract)
nonneg_trees = trees.map(lambda t: ("max", t, ("const", 0)))


def py_eval(t, env) -> int:
    """Oracle: plain Python integer semantics (// and % floor, like Expr)."""
    op = t[0]
    if op == "const":
        return t[1]
    if op == "var":
        return env[t[1]]
    v = [py_eval(c, env) for c in t[1:]]
    if op == "add":
        return sum(v)
    if op == "sub":
        return v[0] - v[1]
    if op == "mul":
        out = 1
        for x in v:
            out *= x
        return out
    if op == "neg":
        return -v[0]
    if op == "div":
        return v[0] // v[1]
    if op == "mod":
        return v[0] % v[1]
    if op == "cdiv":
        return -((-v[0]) // v[1])
    if op == "min":
        return min(v)
    if op == "max":
        return max(v)
    if op == "lt":
        return int(v[0] < v[1])
    raise AssertionError(op)


def build(t) -> Expr:
    """The tree built through Expr's simplifying operators and helpers."""
    op = t[0]
    if op == "const":
        return Const(t[1])
    if op == "var":
        return Var(t[1])
    c = [build(x) for x in t[1:]]
    if op == "add":
        out = c[0]
        for x in c[1:]:
            out = out + x
        return out
    if op == "sub":
        return c[0] - c[1]
    if op == "mul":
        out = c[0]
        for x in c[1:]:
            out = out * x
        return out
    if op == "neg":
        return -c[0]
    if op == "div":
        return c[0] // c[1]
    if op == "mod":
        return c[0] % c[1]
    if op == "cdiv":
        return cdiv(c[0], c[1])
    if op == "min":
        return smin(*c)
    if op == "max":
        return smax(*c)
    if op == "lt":
        return lt(c[0], c[1])
    raise AssertionError(op)


def raw(t) -> Expr:
    """The same tree with the raw constructor: no simplification at all.

    n-ary nodes always get >= 2 operands: a raw add/mul/min/max of one operand prints as that operand
    (or as ``min(x)``, which parse rejects) and so cannot round-trip; the simplifier never makes one.
    Constants stay far below the parser's 40-digit literal limit.
    """
    op = t[0]
    if op == "const":
        return Expr("const", (t[1],))
    if op == "var":
        return Expr("var", (t[1],))
    c = tuple(raw(x) for x in t[1:])
    if op == "sub":
        return Expr("add", (c[0], Expr("mul", (Expr("const", (-1,)), c[1]))))
    if op == "neg":
        return Expr("mul", (Expr("const", (-1,)), c[0]))
    return Expr(op, c)


# --------------------------------------------------------------------------- properties
@FAST
@given(trees, envs)
def test_simplified_value_matches_python(t, env):
    want = py_eval(t, env)
    r = raw(t)
    assert r.evaluate(env) == want  # the evaluator itself
    e = build(t)
    assert e.evaluate(env) == want, (t, str(e))
    assert r.simplify().evaluate(env) == want, (t, str(r.simplify()))


@FAST
@given(trees, envs)
def test_bounds_contain_value(t, env):
    e = build(t)
    lo, hi = e.bounds()
    assert lo <= e.evaluate(env) <= hi, (str(e), lo, hi)
    # user bounds that contain the actual values keep simplification sound
    bounds = {n: (max(0, v - 2), v + 3) for n, v in env.items()}
    lo, hi = raw(t).bounds(bounds)
    assert lo <= py_eval(t, env) <= hi
    assert raw(t).simplify(bounds).evaluate(env) == py_eval(t, env)


@FAST
@given(trees)
def test_operators_and_simplify_agree_and_are_idempotent(t):
    e = build(t)
    assert e.simplify() == e, (str(e), str(e.simplify()))
    r = raw(t).simplify()
    assert r == e, (str(r), str(e))
    assert r.simplify() == r
    # canonical form is a hash/equality key: rebuilding gives an equal, equally hashed object
    assert hash(build(t)) == hash(e)


@FAST
@given(trees)
def test_parse_roundtrip(t):
    e = build(t)
    assert parse(str(e)) == e, str(e)
    r = raw(t)
    assert parse(str(r)) == r, str(r)
    assert parse(repr(e)[6:-2]) == e  # repr is Expr('<text>')


@FAST
@given(trees, st.dictionaries(st.sampled_from(VARS), nonneg_trees, max_size=3), envs)
def test_substitute_then_evaluate(t, mapping, env):
    e = build(t)
    sub = {n: build(x) for n, x in mapping.items()}
    extended = dict(env)
    extended.update({n: x.evaluate(env) for n, x in sub.items()})
    assert e.substitute(sub).evaluate(env) == e.evaluate(extended)
    # substituting ints works as well and folds to the value when everything is bound
    ints = {n: v for n, v in env.items()}
    assert e.substitute(ints).is_const
    assert e.substitute(ints).value == e.evaluate(env)


@FAST
@given(trees)
def test_to_c_is_well_formed(t):
    c = build(t).to_c()
    depth = 0
    for ch in c:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        assert depth >= 0
    assert depth == 0
    assert "//" not in c and "%" not in c  # floor division/modulo go through helpers
    assert "min(" not in c.replace("lum_min(", "") and "max(" not in c.replace("lum_max(", "")


# --------------------------------------------------------------------------- unit tests
def test_constant_folding():
    assert Const(2) + 3 == Const(5)
    assert (Const(7) // 2) == Const(3)
    assert (Const(-7) // 2) == Const(-4)
    assert (Const(-7) % 3) == Const(2)
    assert cdiv(7, 2) == Const(4)
    assert cdiv(-7, 2) == Const(-3)
    assert smin(3, 1, 2) == Const(1) and smax(3, 1, 2) == Const(3)
    assert lt(2, 3) == Const(1) and lt(3, 3) == Const(0)
    assert (Const(6) * 7).value == 42
    assert (s * 2 * 3) == 6 * s


def test_identities():
    assert s + 0 == s and 0 + s == s
    assert s * 1 == s and 1 * s == s
    assert s * 0 == Const(0) and 0 * s == Const(0)
    assert s // 1 == s
    assert s % 1 == Const(0)
    assert s - s == Const(0)
    assert s // s == Const(1)  # divisors are assumed non-zero (s // s has no value at s = 0)
    assert s % s == Const(0)
    assert cdiv(s, 1) == s
    assert -(-s) == s
    assert smin(s, s) == s and smax(s, s) == s


def test_like_terms():
    assert 2 * s + 3 * s == 5 * s
    assert (s + p) + (p + s) == 2 * s + 2 * p
    assert s * p + p * s == 2 * (p * s)
    assert (s + 1) * (s + 1) == s * s + 2 * s + 1
    assert (s + p) - p == s
    assert str(2 * s + 3 * s) == "5 * s"


def test_division_and_modulo_of_products():
    assert (a * b) // b == a
    assert (a * b) % b == Const(0)
    assert (a + b * s) % s == a % s
    assert (a + b * s) // s == a // s + b
    assert (a + b * 4) % 4 == a % 4
    assert (a + b * 4) // 4 == a // 4 + b
    assert (6 * a + 3) // 3 == 2 * a + 1
    assert (2 * a + 5) // 2 == a + 2
    assert (4 * a + 2 * b) // 2 == 2 * a + b
    assert (4 * a + 2 * b) // 8 == (2 * a + b) // 4
    assert (7 * a + 3) % 7 == Const(3)
    assert (9 * a + b) % 4 == (a + b) % 4  # coefficients reduced modulo a constant
    # exact division by a polynomial divisor (as reshape needs for dims like 2*s - 2 = (s - 1) * 2)
    assert (a * (s + 1)) // (s + 1) == a
    assert (2 * s - 2) // (s - 1) == Const(2)
    assert (a * (s + 1)) % (s + 1) == Const(0)
    assert cdiv(a * s + a, s + 1) == a
    assert ((s + 1) // (s + 1)) == Const(1)
    assert 0 // s == Const(0) and 0 % (s + 1) == Const(0)
    assert str((s + 2) // (s + 1)) == "(s + 2) // (s + 1)"  # not a multiple: kept


def test_nested_div_mod_with_constants():
    assert (s // 4) // 2 == s // 8
    assert (s // 2) // 3 == s // 6
    assert (s % 8) % 4 == s % 4
    assert (s % 4) % 8 == s % 4  # already below 8
    assert (s % 4) // 4 == Const(0)
    assert (s % 4) // 2 != Const(0)
    assert (2 * s + s // 3) // 2 == s + s // 6
    # idempotent after the rewrites
    for e in ((s // 4) // 2, (2 * s + s // 3) // 2, (s % 8) % 4):
        assert e.simplify() == e


def test_min_max_use_nonnegativity():
    assert smax(s, 0) == s
    assert smin(s, 0) == Const(0)
    assert smin(0, s) == Const(0)
    assert smin(s, s + 1) == s and smin(s + 1, s) == s
    assert smax(s, s + 1) == s + 1
    assert smin(s + p, s) == s and smin(s, s + p) == s
    assert smax(s + p, s) == s + p and smax(s, s + p) == s + p
    assert smax(s * p, 0) == s * p
    assert smin(s, p) == smin(p, s)  # canonical operand order
    assert smin(smin(s, p), 3) == smin(s, p, 3)
    assert smin(s, -1) == Const(-1)
    assert smax(s - 1, 0) != s - 1  # s - 1 may be negative


def test_lt_and_bounds():
    assert lt(s, 0) == Const(0)
    assert lt(-1, s) == Const(1)
    assert lt(s, s + 1) == Const(1)
    assert lt(s % 4, 4) == Const(1)
    assert lt(s, p).evaluate({"s": 1, "p": 2}) == 1
    assert (s % 4).bounds() == (0, 3)
    assert (s // 4).bounds({"s": (0, 17)}) == (0, 4)
    assert (s // 4).simplify({"s": (0, 3)}) == Const(0)
    assert (s % 8).simplify({"s": (0, 7)}) == s


def test_to_c_strings():
    assert (s + 2 * p).to_c() == "((2 * p) + s)"
    assert (s // 4).to_c() == "lum_floordiv(s, 4)"
    assert (s % 4).to_c() == "lum_mod(s, 4)"
    assert cdiv(s, 4).to_c() == "lum_ceildiv(s, 4)"
    assert smin(s, p, 4).to_c() == "lum_min(lum_min(4, p), s)"
    assert lt(s, 4).to_c() == "((s) < (4))"
    assert Const(2 ** 40).to_c() == f"{2 ** 40}LL"
    assert (s - 3).to_c() == "(s + -3)"


def test_text_form_examples():
    assert str(s - p) == "(-1) * p + s"
    assert str((s + 1) // (p + 2)) == "(s + 1) // (p + 2)"
    for e in (s - p, (s + 1) // (p + 2), cdiv(s, 4) * 2, smin(s, p - 3), lt(s, p) * 3, Const(-5),
              (-3) * s, (s % 4) - 7, (s // 4) // (p + 1)):
        assert parse(str(e)) == e, str(e)
    assert parse("s - p").simplify() == s - p  # parser accepts binary minus (read as + -1 * x)
    assert parse("  s+p ").simplify() == s + p
    assert parse("min(s, 3)") == Expr("min", (s, Const(3)))


def test_evaluate_unbound_variable():
    with pytest.raises(UnboundVariableError) as ei:
        (s + p).evaluate({"s": 1})
    msg = str(ei.value)
    assert "'p'" in msg and "dyn" in msg
    assert isinstance(ei.value, KeyError)
    with pytest.raises(UnboundVariableError, match="'s'"):
        s.evaluate()


def test_division_by_zero_is_reported():
    with pytest.raises(ZeroDivisionError):
        (s // 0).evaluate({"s": 1})
    with pytest.raises(ZeroDivisionError):
        (s % p).evaluate({"s": 1, "p": 0})


MALFORMED = [
    "s +", "(s", "s)", "__import__('os')", "s ; p", "1.5", "", "   ", "s p", "2s", "min(s)", "cdiv(s)",
    "cdiv(s, p, a)", "min", "s < p < a", "s / p", "s ** 2", "lambda: 0", "s.__class__", "os.system('x')",
    "(" * 5000 + "s" + ")" * 5000, "-" * 5000 + "s", "min(" * 3000 + "s" + ", 1)" * 3000, "s" * 70000,
    "1" * 60, "\u0661", "s\x00", "s,", "()", "min(s,)",
]


@pytest.mark.parametrize("text", MALFORMED, ids=[f"m{k}" for k in range(len(MALFORMED))])
def test_parse_rejects_malformed(text):
    with pytest.raises(ExprParseError):
        parse(text)


def test_parse_rejects_non_strings():
    with pytest.raises(ExprParseError):
        parse(b"s")  # type: ignore[arg-type]


def test_parse_accepts_reasonable_nesting():
    e = parse("(" * 50 + "s" + ")" * 50)
    assert e == s
    deep = s
    for k in range(30):
        deep = (deep + k) // (p + 1)
    assert parse(str(deep)) == deep


def test_parse_never_uses_eval(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("parse must not use eval/exec/compile")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    monkeypatch.setattr(builtins, "compile", forbidden)
    assert parse("cdiv(s + 1, 4) * min(p, 3) // 2 % 5 < s") is not None
    with pytest.raises(ExprParseError):
        parse("__import__('os').system('true')")


def test_invalid_names_and_constants():
    for bad in ("min", "cdiv", "1s", "s-p", "", "s p"):
        with pytest.raises(ValueError):
            Var(bad)
    with pytest.raises(TypeError):
        Const(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Const(True)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        bool(s)
    with pytest.raises(ValueError):
        smin()


def test_vars_and_substitute():
    e = (s + p * 2) // (a + 1)
    assert e.vars() == {"s", "p", "a"}
    assert e.substitute({"a": 0}) == s + 2 * p
    assert e.substitute({"s": 1, "p": 2, "a": 1}) == Const(2)
    assert (s * 4).substitute({"s": p + 1}) == 4 * p + 4
