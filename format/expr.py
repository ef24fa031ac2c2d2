"""Symbolic integer expressions: shapes, strides, offsets, buffer sizes and launch grids.

One small immutable type serves the builder, the package and the loader. Expressions built through
the operators (``a + b``, ``a * 2``, ``a // b``, :func:`cdiv`, :func:`smin` …) are simplified to a
canonical form as they are built, so structurally equal means "equal after simplification" and
``hash``/``==`` work as a cache key. Variables are non-negative integers (dims, past lengths, indices);
the simplifier uses that, and optional integer bounds, to drop needless ``%`` and ``//``.

Text form (``str(e)`` / :func:`parse`) is a small infix language read by a hand-written parser; no
``eval`` is ever used, so a package cannot smuggle code through its size expressions.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Union

__all__ = [
    "Expr", "Const", "Var", "ExprLike", "as_expr", "cdiv", "smin", "smax", "lt", "parse",
    "UnboundVariableError", "ExprParseError", "INF",
]

INF = math.inf

# Operators kept in the tree. 'add' and 'mul' are n-ary and canonically ordered.
_NARY = ("add", "mul", "min", "max")
_BINARY = ("div", "cdiv", "mod", "lt")


class UnboundVariableError(KeyError):
    """A variable has no value in the dyn_map given to :meth:`Expr.evaluate`."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it a plain sentence
        return str(self.args[0])


class ExprParseError(ValueError):
    """The text form of an expression is malformed."""


@dataclass(frozen=True, eq=True, repr=False)
class Expr:
    """A node of a symbolic integer expression.

    ``op`` is one of ``const`` (``args == (value,)``), ``var`` (``args == (name,)``) or an operator
    whose ``args`` are child expressions. Build with the operators; the raw constructor does not
    simplify (the parser uses it so that ``parse(str(e)) == e`` holds exactly).
    """

    op: str
    args: tuple

    # ----------------------------------------------------------------- leaves and inspection
    @property
    def is_const(self) -> bool:
        return self.op == "const"

    @property
    def value(self) -> int:
        if self.op != "const":
            raise TypeError(f"expression {self} is not a constant")
        return self.args[0]

    def vars(self) -> frozenset[str]:
        """Names of all variables in the expression."""
        if self.op == "var":
            return frozenset((self.args[0],))
        if self.op == "const":
            return frozenset()
        out: frozenset[str] = frozenset()
        for a in self.args:
            out |= a.vars()
        return out

    # ----------------------------------------------------------------- arithmetic operators
    def __add__(self, other: ExprLike) -> Expr:
        return _simplify(Expr("add", (self, as_expr(other))))

    def __radd__(self, other: ExprLike) -> Expr:
        return _simplify(Expr("add", (as_expr(other), self)))

    def __sub__(self, other: ExprLike) -> Expr:
        return self + (-1) * as_expr(other)

    def __rsub__(self, other: ExprLike) -> Expr:
        return as_expr(other) + (-1) * self

    def __neg__(self) -> Expr:
        return (-1) * self

    def __mul__(self, other: ExprLike) -> Expr:
        return _simplify(Expr("mul", (self, as_expr(other))))

    def __rmul__(self, other: ExprLike) -> Expr:
        return _simplify(Expr("mul", (as_expr(other), self)))

    def __floordiv__(self, other: ExprLike) -> Expr:
        return _simplify(Expr("div", (self, as_expr(other))))

    def __rfloordiv__(self, other: ExprLike) -> Expr:
        return _simplify(Expr("div", (as_expr(other), self)))

    def __mod__(self, other: ExprLike) -> Expr:
        return _simplify(Expr("mod", (self, as_expr(other))))

    def __rmod__(self, other: ExprLike) -> Expr:
        return _simplify(Expr("mod", (as_expr(other), self)))

    # ----------------------------------------------------------------- evaluation
    def evaluate(self, dyn_map: Mapping[str, int] | None = None) -> int:
        """The integer value with variables bound by ``dyn_map``."""
        return _evaluate(self, dyn_map or {})

    def substitute(self, mapping: Mapping[str, ExprLike]) -> Expr:
        """Replace variables by expressions (or ints) and simplify."""
        if self.op == "var":
            name = self.args[0]
            return as_expr(mapping[name]) if name in mapping else self
        if self.op == "const":
            return self
        return _simplify(Expr(self.op, tuple(a.substitute(mapping) for a in self.args)))

    def simplify(self, bounds: Mapping[str, tuple[int, float]] | None = None) -> Expr:
        """Canonical form, optionally using extra ``{var: (lo, hi_inclusive)}`` bounds."""
        return _simplify_tree(self, bounds or {})

    def bounds(self, bounds: Mapping[str, tuple[int, float]] | None = None) -> tuple[float, float]:
        """Inclusive (lo, hi) interval of the value; variables default to [0, inf)."""
        return _bounds(self, bounds or {})

    def __int__(self) -> int:
        return self.value

    def __index__(self) -> int:
        return self.value

    def __bool__(self) -> bool:
        raise TypeError("a symbolic expression has no truth value; compare with == or use .is_const")

    # ----------------------------------------------------------------- printing
    def __str__(self) -> str:
        return _to_text(self, 0)

    def __repr__(self) -> str:
        return f"Expr({_to_text(self, 0)!r})"

    def to_c(self) -> str:
        """C expression (64-bit); floor-div and mod use helpers that round toward -inf."""
        return _to_c(self)

    def sort_key(self) -> tuple:
        """A total order used for canonical operand ordering (stable across processes)."""
        return _sort_key(self)


ExprLike = Union[Expr, int]


def Const(value: int) -> Expr:
    if isinstance(value, bool) or not isinstance(value, int):
        is_bool = isinstance(value, bool) or type(value).__name__ in ("bool", "bool_")  # incl. numpy bools
        if hasattr(value, "__index__") and not is_bool:
            value = int(value)  # numpy integers
        else:
            raise TypeError(f"expression constants are integers, got {value!r}")
    return Expr("const", (int(value),))


_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_KEYWORDS = {"min", "max", "cdiv"}


def Var(name: str) -> Expr:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in _KEYWORDS:
        raise ValueError(f"invalid variable name {name!r}")
    return Expr("var", (name,))


def as_expr(x: ExprLike) -> Expr:
    if isinstance(x, Expr):
        return x
    return Const(x)


def cdiv(a: ExprLike, b: ExprLike) -> Expr:
    """Ceiling division."""
    return _simplify(Expr("cdiv", (as_expr(a), as_expr(b))))


def smin(*xs: ExprLike) -> Expr:
    return _simplify(Expr("min", tuple(as_expr(x) for x in xs)))


def smax(*xs: ExprLike) -> Expr:
    return _simplify(Expr("max", tuple(as_expr(x) for x in xs)))


def lt(a: ExprLike, b: ExprLike) -> Expr:
    """1 if a < b else 0 (used for validity masks)."""
    return _simplify(Expr("lt", (as_expr(a), as_expr(b))))


ZERO = Const(0)
ONE = Const(1)


# ===================================================================== evaluation
def _floordiv(a: int, b: int) -> int:
    if b == 0:
        raise ZeroDivisionError("division by zero in a symbolic expression")
    return a // b


def _evaluate(e: Expr, env: Mapping[str, int]) -> int:
    op = e.op
    if op == "const":
        return e.args[0]
    if op == "var":
        name = e.args[0]
        try:
            return int(env[name])
        except KeyError:
            raise UnboundVariableError(f"no value for dyn variable '{name}' (dyn_map has {sorted(env)})") from None
    vals = [_evaluate(a, env) for a in e.args]
    if op == "add":
        return sum(vals)
    if op == "mul":
        out = 1
        for v in vals:
            out *= v
        return out
    if op == "div":
        return _floordiv(vals[0], vals[1])
    if op == "cdiv":
        return -_floordiv(-vals[0], vals[1])
    if op == "mod":
        if vals[1] == 0:
            raise ZeroDivisionError("modulo by zero in a symbolic expression")
        return vals[0] % vals[1]
    if op == "min":
        return min(vals)
    if op == "max":
        return max(vals)
    if op == "lt":
        return int(vals[0] < vals[1])
    raise ValueError(f"unknown expression op {op!r}")


# ===================================================================== ordering
_OP_RANK = {"const": 0, "var": 1, "mul": 2, "add": 3, "div": 4, "cdiv": 5, "mod": 6, "min": 7, "max": 8, "lt": 9}


def _sort_key(e: Expr) -> tuple:
    if e.op == "const":
        return (0, e.args[0])
    if e.op == "var":
        return (1, e.args[0])
    return (_OP_RANK[e.op], len(e.args), tuple(_sort_key(a) for a in e.args))


# ===================================================================== bounds
def _bounds(e: Expr, extra: Mapping[str, tuple[int, float]]) -> tuple[float, float]:
    op = e.op
    if op == "const":
        v = e.args[0]
        return (v, v)
    if op == "var":
        return extra.get(e.args[0], (0, INF))
    bs = [_bounds(a, extra) for a in e.args]
    if op == "add":
        return (sum(b[0] for b in bs), sum(b[1] for b in bs))
    if op == "mul":
        lo, hi = 1, 1
        for blo, bhi in bs:
            cands = [_mul_inf(x, y) for x in (lo, hi) for y in (blo, bhi)]
            lo, hi = min(cands), max(cands)
        return (lo, hi)
    if op in ("div", "cdiv"):
        (alo, ahi), (blo, bhi) = bs
        if blo > 0 and alo >= 0:  # non-negative over positive
            lo = alo // bhi if bhi != INF else 0
            hi = ahi if ahi == INF else (ahi // blo if op == "div" else -(-ahi // blo))
            if op == "cdiv" and bhi != INF:
                lo = -(-alo // bhi)
            return (lo, hi)
        return (-INF, INF)
    if op == "mod":
        (alo, ahi), (blo, bhi) = bs
        if blo > 0:
            if alo >= 0 and ahi < blo:
                return (alo, ahi)
            return (0, bhi - 1 if bhi != INF else INF)
        return (-INF, INF)
    if op == "min":
        return (min(b[0] for b in bs), min(b[1] for b in bs))
    if op == "max":
        return (max(b[0] for b in bs), max(b[1] for b in bs))
    if op == "lt":
        (alo, ahi), (blo, bhi) = bs
        if ahi < blo:
            return (1, 1)
        if alo >= bhi:
            return (0, 0)
        return (0, 1)
    raise ValueError(op)


def _mul_inf(x: float, y: float) -> float:
    if x == 0 or y == 0:
        return 0
    return x * y


# ===================================================================== simplification
# Canonical form: a polynomial (sum of coefficient * monomial) over atoms; atoms are variables and
# div/cdiv/mod/min/max/lt nodes whose children are canonical. Products of atoms are kept sorted.

Poly = dict  # monomial (tuple of atoms, sorted) -> int coefficient; () is the constant term


def _poly_of(e: Expr) -> Poly:
    if e.op == "const":
        return {(): e.args[0]} if e.args[0] else {}
    if e.op == "add":
        out: Poly = {}
        for a in e.args:
            _poly_add_into(out, _poly_of(a))
        return out
    if e.op == "mul":
        out = {(): 1}
        for a in e.args:
            out = _poly_mul(out, _poly_of(a))
        return out
    return {(e,): 1}


def _poly_add_into(acc: Poly, p: Poly, scale: int = 1) -> None:
    for m, c in p.items():
        v = acc.get(m, 0) + c * scale
        if v:
            acc[m] = v
        else:
            acc.pop(m, None)


def _poly_mul(p: Poly, q: Poly) -> Poly:
    out: Poly = {}
    for m1, c1 in p.items():
        for m2, c2 in q.items():
            m = tuple(sorted(m1 + m2, key=_sort_key))
            v = out.get(m, 0) + c1 * c2
            if v:
                out[m] = v
            else:
                out.pop(m, None)
    return out


def _mono_expr(m: tuple, c: int) -> Expr:
    if not m:
        return Const(c)
    factors = list(m)
    if c != 1:
        factors = [Const(c)] + factors
    return factors[0] if len(factors) == 1 else Expr("mul", tuple(factors))


def _expr_of(p: Poly) -> Expr:
    if not p:
        return ZERO
    terms = sorted(p.items(), key=lambda mc: (len(mc[0]) == 0, tuple(_sort_key(a) for a in mc[0]), mc[1]))
    parts = [_mono_expr(m, c) for m, c in terms]
    return parts[0] if len(parts) == 1 else Expr("add", tuple(parts))


def _poly_const(p: Poly) -> int | None:
    if not p:
        return 0
    if len(p) == 1 and () in p:
        return p[()]
    return None


def _simplify(e: Expr) -> Expr:
    """Simplify a node whose children are already canonical (operator entry point)."""
    return _canon(e, {})


def _simplify_tree(e: Expr, bounds: Mapping[str, tuple[int, float]]) -> Expr:
    if e.op in ("const", "var"):
        return e
    return _canon(Expr(e.op, tuple(_simplify_tree(a, bounds) for a in e.args)), bounds)


def _canon(e: Expr, bounds: Mapping[str, tuple[int, float]]) -> Expr:
    op = e.op
    if op in ("const", "var"):
        return e
    if op in ("add", "mul"):
        return _expr_of(_poly_of(e))
    if op == "div":
        return _canon_div(e.args[0], e.args[1], bounds)
    if op == "cdiv":
        return _canon_cdiv(e.args[0], e.args[1], bounds)
    if op == "mod":
        return _canon_mod(e.args[0], e.args[1], bounds)
    if op in ("min", "max"):
        return _canon_minmax(op, e.args, bounds)
    if op == "lt":
        a, b = e.args
        diff = _expr_of(_poly_of(Expr("add", (a, Expr("mul", (Const(-1), b))))))
        lo, hi = _bounds(diff, bounds)
        if hi < 0:
            return ONE
        if lo >= 0:
            return ZERO
        # canonical: (a - b) < 0 written as lt(x, c) with constants moved right
        p = _poly_of(diff)
        c = p.pop((), 0)
        return Expr("lt", (_expr_of(p), Const(-c)))
    raise ValueError(f"unknown expression op {op!r}")


def _split_divisible(p: Poly, d: Poly) -> tuple[Poly, Poly]:
    """Split p into (quotient q, remainder r) with p = d*q + r, taking only exactly-divisible terms.

    d is a single monomial c*m. A term t of p moves to q when its monomial contains m and its
    coefficient is a multiple of c.
    """
    (dm, dc), = d.items()
    q: Poly = {}
    r: Poly = {}
    for m, c in p.items():
        rest = _mono_divide(m, dm)
        if rest is not None and c % dc == 0:
            q[rest] = q.get(rest, 0) + c // dc
        else:
            r[m] = c
    return q, r


def _poly_monomial_quotient(p: Poly, d: Poly) -> Poly | None:
    """The single-term q with p == q*d exactly (d a non-zero polynomial), or None.

    Handles e.g. (2*s - 2) // (s - 1) and (a*s + a) // (s + 1). If q exists it is unique, and its
    monomial is (some term of p) / (the first term of d), so trying each term of p finds it.
    """
    if not p or not d:
        return None
    mb, cb = min(d.items(), key=lambda mc: tuple(_sort_key(x) for x in mc[0]))
    for ma, ca in p.items():
        rest = _mono_divide(ma, mb)
        if rest is None or ca % cb:
            continue
        q = {tuple(sorted(rest, key=_sort_key)): ca // cb}
        if _poly_mul(q, d) == p:
            return q
    return None


def _mono_divide(m: tuple, dm: tuple) -> tuple | None:
    rest = list(m)
    for a in dm:
        try:
            rest.remove(a)
        except ValueError:
            return None
    return tuple(rest)


def _is_monomial(p: Poly) -> bool:
    return len(p) == 1


def _nonneg(e: Expr, bounds) -> bool:
    return _bounds(e, bounds)[0] >= 0


def _canon_div(a: Expr, b: Expr, bounds) -> Expr:
    pa, pb = _poly_of(a), _poly_of(b)
    ca, cb = _poly_const(pa), _poly_const(pb)
    if cb == 0:
        return Expr("div", (a, b))  # left for evaluation to report
    if ca is not None and cb is not None:
        return Const(ca // cb)
    if ca == 0:  # 0 divided by a (non-zero) divisor
        return ZERO
    if cb == 1:
        return a
    if cb == -1:
        return _expr_of({m: -c for m, c in pa.items()})
    if not _is_monomial(pb):
        q = _poly_monomial_quotient(pa, pb)
        if q is not None:  # (q*b) // b == q
            return _expr_of(q)
        return Expr("div", (a, b))
    b_pos = _bounds(b, bounds)[0] > 0
    # (x // c1) // c2 -> x // (c1*c2) for positive constants
    if a.op == "div" and cb is not None and cb > 0:
        inner_c = _poly_const(_poly_of(a.args[1]))
        if inner_c is not None and inner_c > 0:
            return _canon_div(a.args[0], Const(inner_c * cb), bounds)
    q, r = _split_divisible(pa, pb)
    if q:
        # floor((d*q + r) / d) = q + floor(r / d), exact for integers. The remainder is simplified as
        # a division of its own (it may fold to a constant or meet the nested-division rule), so the
        # result is already canonical and simplify() stays idempotent.
        rest = _canon_div(_expr_of(r), b, bounds) if r else ZERO
        return _expr_of(_poly_add_copy(q, _poly_of(rest)))
    lo, hi = _bounds(a, bounds)
    blo, _ = _bounds(b, bounds)
    if b_pos and lo >= 0 and hi < blo:
        return ZERO
    if cb is not None and cb > 0:
        # pull a constant g dividing all coefficients of a and the divisor: (g*x)//(g*k) = x//k
        g = math.gcd(cb, *pa.values())
        if g > 1:
            return _canon_div(_expr_of({m: c // g for m, c in pa.items()}), Const(cb // g), bounds)
    return Expr("div", (a, b))


def _poly_add_copy(p: Poly, q: Poly) -> Poly:
    out = dict(p)
    _poly_add_into(out, q)
    return out


def _canon_cdiv(a: Expr, b: Expr, bounds) -> Expr:
    pa, pb = _poly_of(a), _poly_of(b)
    ca, cb = _poly_const(pa), _poly_const(pb)
    if cb == 0:
        return Expr("cdiv", (a, b))
    if ca is not None and cb is not None:
        return Const(-((-ca) // cb))
    if ca == 0:  # 0 divided by a (non-zero) divisor
        return ZERO
    if cb == 1:
        return a
    if not _is_monomial(pb):
        q = _poly_monomial_quotient(pa, pb)
        if q is not None:  # ceil((q*b) / b) == q
            return _expr_of(q)
    else:
        q, r = _split_divisible(pa, pb)
        if not r:
            return _expr_of(q)
        if q:  # ceil((d*q + r)/d) = q + ceil(r/d)
            return _expr_of(_poly_add_copy(q, _poly_of(_canon_cdiv(_expr_of(r), b, bounds))))
        lo, hi = _bounds(a, bounds)
        blo, _ = _bounds(b, bounds)
        if blo > 0 and lo >= 1 and hi <= blo:
            return ONE
    return Expr("cdiv", (a, b))


def _canon_mod(a: Expr, b: Expr, bounds) -> Expr:
    pa, pb = _poly_of(a), _poly_of(b)
    ca, cb = _poly_const(pa), _poly_const(pb)
    if cb == 0:
        return Expr("mod", (a, b))
    if ca is not None and cb is not None:
        return Const(ca % cb)
    if ca == 0:  # 0 divided by a (non-zero) divisor
        return ZERO
    if cb is not None and abs(cb) == 1:
        return ZERO
    if not _is_monomial(pb):
        if _poly_monomial_quotient(pa, pb) is not None:  # (q*b) % b == 0
            return ZERO
        return Expr("mod", (a, b))
    # (d*q + r) % d == r % d
    _, r = _split_divisible(pa, pb)
    if cb is not None and cb > 0:
        # reduce constant coefficients modulo cb
        r = {m: c % cb for m, c in r.items() if c % cb}
    if not r:
        return ZERO
    cr = _poly_const(r)
    if cr is not None and cb is not None:
        return Const(cr % cb)
    r_expr = _expr_of(r)
    lo, hi = _bounds(r_expr, bounds)
    blo, _ = _bounds(b, bounds)
    if blo > 0 and lo >= 0 and hi < blo:
        return r_expr
    # (x % c1) % c2 -> x % c2 when c2 divides c1
    if r_expr.op == "mod" and cb is not None and cb > 0:
        inner_c = _poly_const(_poly_of(r_expr.args[1]))
        if inner_c is not None and inner_c > 0 and inner_c % cb == 0:
            return _canon_mod(r_expr.args[0], b, bounds)
    return Expr("mod", (r_expr, b))


def _canon_minmax(op: str, args: Iterable[Expr], bounds) -> Expr:
    args = tuple(args)
    if not args:
        raise ValueError(f"{op} of no operands")
    flat: list[Expr] = []
    for a in args:
        if a.op == op:
            flat.extend(a.args)
        else:
            flat.append(a)
    # fold constants
    consts = [a.value for a in flat if a.is_const]
    others = []
    seen = set()
    for a in flat:
        if not a.is_const and a not in seen:
            seen.add(a)
            others.append(a)
    if consts:
        others.append(Const(min(consts) if op == "min" else max(consts)))
    # drop dominated operands using bounds of pairwise differences
    keep: list[Expr] = []
    for i, x in enumerate(others):
        dominated = False
        for j, y in enumerate(others):
            if i == j:
                continue
            dlo, dhi = _bounds(_expr_of(_poly_add_copy(_poly_of(x), {m: -c for m, c in _poly_of(y).items()})), bounds)
            # for min: x is redundant when x >= y always. When also x <= y always (provably equal),
            # each would make the other redundant: keep the earlier one (ties broken by index).
            if op == "min" and dlo >= 0 and (dhi > 0 or j < i):
                dominated = True
            if op == "max" and dhi <= 0 and (dlo < 0 or j < i):
                dominated = True
            if dominated:
                break
        if not dominated:
            keep.append(x)
    keep.sort(key=_sort_key)
    if len(keep) == 1:
        return keep[0]
    return Expr(op, tuple(keep))


# ===================================================================== text form
# Grammar (precedence low -> high):
#   expr   := cmp
#   cmp    := sum ('<' sum)?
#   sum    := term (('+'|'-') term)*
#   term   := unary (('*'|'//'|'%') unary)*
#   unary  := '-' unary | atom
#   atom   := INT | NAME | NAME '(' expr (',' expr)* ')' | '(' expr ')'
# Printing is faithful to the tree: add and mul children are printed in order and re-parsed as
# the same n-ary nodes; subtraction is printed as '+ -x' only through a negative constant factor.

_PREC = {"lt": 1, "add": 2, "mul": 3, "div": 3, "mod": 3}


def _to_text(e: Expr, parent_prec: int) -> str:
    op = e.op
    if op == "const":
        v = e.args[0]
        s = str(v)
        return f"({s})" if v < 0 and parent_prec > 0 else s
    if op == "var":
        return e.args[0]
    if op in ("cdiv", "min", "max"):
        return f"{op}({', '.join(_to_text(a, 0) for a in e.args)})"
    prec = _PREC[op]
    if op == "add":
        s = " + ".join(_to_text(a, prec + 1) for a in e.args)
    elif op == "mul":
        s = " * ".join(_to_text(a, prec + 1) for a in e.args)
    elif op == "div":
        s = f"{_to_text(e.args[0], prec + 1)} // {_to_text(e.args[1], prec + 1)}"
    elif op == "mod":
        s = f"{_to_text(e.args[0], prec + 1)} % {_to_text(e.args[1], prec + 1)}"
    elif op == "lt":
        s = f"{_to_text(e.args[0], prec + 1)} < {_to_text(e.args[1], prec + 1)}"
    else:
        raise ValueError(op)
    return f"({s})" if prec < parent_prec else s


_TOKEN_RE = re.compile(r"\s*(?:([0-9]+)|([A-Za-z_][A-Za-z0-9_]*)|(//|[-+*%<(),]))")
_MAX_TEXT = 1 << 16
_MAX_DEPTH = 100  # nesting levels; each costs ~5 Python frames, well inside the recursion limit


def parse(text: str) -> Expr:
    """Parse the text form (as printed by ``str``) without ``eval``; raises :class:`ExprParseError`."""
    if not isinstance(text, str):
        raise ExprParseError(f"expression text must be a string, got {type(text).__name__}")
    if len(text) > _MAX_TEXT:
        raise ExprParseError(f"expression text too long ({len(text)} characters)")
    tokens: list[tuple[str, str]] = []
    pos = 0
    stripped_end = len(text.rstrip())
    while pos < stripped_end:
        m = _TOKEN_RE.match(text, pos)
        if not m or m.end() == pos:
            raise ExprParseError(f"unexpected character {text[pos:pos + 1]!r} at {pos} in {text!r}")
        if m.group(1) is not None:
            tokens.append(("int", m.group(1)))
        elif m.group(2) is not None:
            tokens.append(("name", m.group(2)))
        else:
            tokens.append(("op", m.group(3)))
        pos = m.end()
    p = _Parser(tokens, text)
    try:
        e = p.expr(0)
    except RecursionError:  # only reachable when the caller is already deep in the stack
        raise ExprParseError("expression nested too deeply") from None
    if p.i != len(tokens):
        raise ExprParseError(f"unexpected {tokens[p.i][1]!r} in {text!r}")
    return e


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]], text: str):
        self.t = tokens
        self.i = 0
        self.text = text

    def peek(self) -> tuple[str, str] | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise ExprParseError(f"unexpected end of {self.text!r}")
        if value is not None and tok[1] != value:
            raise ExprParseError(f"expected {value!r}, found {tok[1]!r} in {self.text!r}")
        self.i += 1
        return tok

    def _depth(self, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise ExprParseError("expression nested too deeply")

    def expr(self, depth: int) -> Expr:
        self._depth(depth)
        left = self.sum(depth)
        if self.peek() == ("op", "<"):
            self.take()
            right = self.sum(depth)
            return Expr("lt", (left, right))
        return left

    def sum(self, depth: int) -> Expr:
        items = [self.term(depth)]
        while self.peek() in (("op", "+"), ("op", "-")):
            sign = self.take()[1]
            t = self.term(depth)
            if sign == "-":
                t = Expr("mul", (Const(-1), t))
            items.append(t)
        return items[0] if len(items) == 1 else Expr("add", tuple(items))

    def term(self, depth: int) -> Expr:
        left = self.unary(depth)
        factors = [left]
        while self.peek() in (("op", "*"), ("op", "//"), ("op", "%")):
            op = self.take()[1]
            right = self.unary(depth)
            if op == "*":
                factors.append(right)
                continue
            cur = factors[0] if len(factors) == 1 else Expr("mul", tuple(factors))
            factors = [Expr("div" if op == "//" else "mod", (cur, right))]
        return factors[0] if len(factors) == 1 else Expr("mul", tuple(factors))

    def unary(self, depth: int) -> Expr:
        tok = self.peek()
        if tok == ("op", "-"):
            self._depth(depth)
            self.take()
            nxt = self.peek()
            if nxt is not None and nxt[0] == "int":
                self.take()
                return Const(-int(nxt[1]))
            return Expr("mul", (Const(-1), self.unary(depth + 1)))
        return self.atom(depth)

    def atom(self, depth: int) -> Expr:
        kind, val = self.take()
        if kind == "int":
            if len(val) > 40:
                raise ExprParseError(f"integer literal too long in {self.text!r}")
            return Const(int(val))
        if kind == "name":
            if val in _KEYWORDS:
                self.take("(")
                args = [self.expr(depth + 1)]
                while self.peek() == ("op", ","):
                    self.take()
                    args.append(self.expr(depth + 1))
                self.take(")")
                if val == "cdiv" and len(args) != 2:
                    raise ExprParseError(f"cdiv takes two arguments in {self.text!r}")
                if len(args) < 2 and val != "cdiv":
                    raise ExprParseError(f"{val} takes at least two arguments in {self.text!r}")
                return Expr(val, tuple(args))
            return Var(val)
        if val == "(":
            e = self.expr(depth + 1)
            self.take(")")
            return e
        raise ExprParseError(f"unexpected {val!r} in {self.text!r}")


# ===================================================================== C printing
def _to_c(e: Expr) -> str:
    op = e.op
    if op == "const":
        return f"{e.args[0]}LL" if abs(e.args[0]) > 2**31 - 1 else f"{e.args[0]}"
    if op == "var":
        return e.args[0]
    a = [_to_c(x) for x in e.args]
    if op == "add":
        return "(" + " + ".join(a) + ")"
    if op == "mul":
        return "(" + " * ".join(a) + ")"
    if op == "div":
        return f"lum_floordiv({a[0]}, {a[1]})"
    if op == "cdiv":
        return f"lum_ceildiv({a[0]}, {a[1]})"
    if op == "mod":
        return f"lum_mod({a[0]}, {a[1]})"
    if op in ("min", "max"):
        out = a[0]
        for x in a[1:]:
            out = f"lum_{op}({out}, {x})"
        return out
    if op == "lt":
        return f"(({a[0]}) < ({a[1]}))"
    raise ValueError(op)
