"""The pieces every kernel generator shares: what a generated kernel is (:class:`Launch`, :class:`Param`,
:class:`KernelSource`), the templates (:func:`load_template`, :func:`render`, :func:`common_header`), index
plans (:func:`coalesce`, :class:`KernelContext`, :func:`view_access`, :func:`access_plan`) and the dtype / value
conversions of the C text (:data:`STORAGE_C`, ``load_conv``, ``store_conv``, ``compute_node`` …).

It exists so that :mod:`lum.builder.codegen` and the per-kind generators beside it
(:mod:`lum.builder.row_codegen`, :mod:`lum.builder.attention_codegen`, :mod:`lum.builder.gemv_codegen`) can all
import these without importing each other; :mod:`lum.builder.codegen` re-exports the public names.
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping, Sequence

from lum.builder.env_switches import CodegenError
from lum.builder.intmath import is_one
from lum.format.dtypes import DType
from lum.format.expr import INF, Expr, Var, as_expr
from lum.format.shapetracker import ShapeTracker


STORAGE_C = {DType.f32: "float", DType.f16: "lum_f16", DType.bf16: "lum_bf16", DType.i32: "int",
             DType.i64: "long long", DType.bool: "lum_bool"}
KIND_C = {"f": "float", "d": "double", "i": "long long", "b": "bool"}
ZERO_C = {"f": "0.0f", "d": "0.0", "i": "0LL", "b": "false"}
_I32_MAX = 2**31 - 1
ENTRY_PLACEHOLDER = "LUM_ENTRY_NAME"  # stands for the entry name while the source is hashed


# ============================================================================ data
@dataclass(frozen=True)
class Launch:
    kernel: str                                  # entry name in the module
    grid: tuple[Expr, Expr, Expr]                # over the dyn vars, each >= 1
    block: tuple[int, int, int]
    shared_mem: int = 0                          # dynamic shared memory bytes
    cluster: int = 1                             # blocks a thread block cluster along x (1: none)

    def evaluate(self, dyn_map: Mapping[str, int]) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
        return tuple(g.evaluate(dyn_map) for g in self.grid), self.block, self.shared_mem  # type: ignore[return-value]

    def to_json(self) -> dict[str, Any]:
        """As a launch table stores it (format/manifest.py): ``cluster`` only where the grid runs in clusters."""
        return {"kernel": self.kernel, "grid": [str(g) for g in self.grid], "block": list(self.block),
                "shared_mem": int(self.shared_mem), **({"cluster": self.cluster} if self.cluster > 1 else {})}


@dataclass(frozen=True)
class Param:
    name: str                                    # C parameter name: out, in0…, dyn
    role: str                                    # "out" | "arg" | "dyn"
    index: int | None                            # args index for role "arg"
    dtype: DType | None                          # storage dtype (None for dyn: int64)
    ctype: str                                   # C declaration


@dataclass(frozen=True)
class KernelSource:
    name: str                                    # stable: derived from a hash of the source
    kind: str
    op: str
    source: str                                  # complete module: common.cuh + body
    body: str                                    # the kernels alone (see module_source)
    launches: tuple[Launch, ...]
    params: tuple[Param, ...]
    dyn_vars: tuple[str, ...]                    # the slot order of the dyn buffer
    dyn_slots: dict[str, int]                    # vars this kernel reads -> slot
    tuning: dict[str, Any] = field(default_factory=dict)
    tails: tuple[int, ...] = ()                  # op ids it runs too (builder/fused.py), in program order
    early: tuple[str, ...] = ()                  # parameters it reads before waiting for its predecessor (weights)

    @property
    def grid(self) -> tuple[Expr, Expr, Expr]:
        return self.launches[0].grid

    @property
    def block(self) -> tuple[int, int, int]:
        return self.launches[0].block

    @property
    def shared_mem(self) -> int:
        return self.launches[0].shared_mem

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return tuple(launch.kernel for launch in self.launches)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "kind": self.kind, "op": self.op,
            "launches": [lc.to_json() for lc in self.launches],
            "params": [{"name": p.name, "role": p.role, "index": p.index,
                        "dtype": None if p.dtype is None else p.dtype.value} for p in self.params],
            "dyn_vars": list(self.dyn_vars), "dyn_slots": dict(self.dyn_slots), "tuning": dict(self.tuning),
            **({"tails": list(self.tails)} if self.tails else {}),
        }


# ============================================================================ templates
_PLACEHOLDER = re.compile(r"\{\{([A-Z][A-Z0-9_]*)\}\}")


@lru_cache(maxsize=None)
def load_template(name: str) -> str:
    """The text of ``templates/<name>`` (via importlib.resources, so installed and editable both work)."""
    return resources.files("lum.templates").joinpath(name).read_text(encoding="utf-8")


def common_header() -> str:
    return load_template("common.cuh")


def render(template: str, values: Mapping[str, Any]) -> str:
    """Fill ``{{NAME}}`` placeholders. Every placeholder must have a value and every value must be used;
    lines starting with ``//!`` (template documentation) are dropped, and so is every section ``#if 0`` …
    ``#endif`` (a placeholder that chose 0 or 1: ``#if 1`` keeps its lines, less the two directives), so a
    disabled section leaves no text. No other evaluation of any kind."""
    lines = [ln for ln in template.splitlines() if not ln.lstrip().startswith("//!")]
    text = "\n".join(lines) + "\n"
    names = set(_PLACEHOLDER.findall(text))
    missing = names - set(values)
    if missing:
        raise CodegenError(f"template placeholders without a value: {sorted(missing)}")
    unused = set(values) - names
    if unused:
        raise CodegenError(f"values for placeholders the template lacks: {sorted(unused)}")
    out = _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), text)   # one pass: values are not re-scanned
    if _PLACEHOLDER.search(out):
        raise CodegenError("a substituted value contains a placeholder marker")
    return _static_sections(out)


def _static_sections(text: str) -> str:
    """``text`` without its ``#if 0`` sections and the ``#if 1`` / ``#endif`` lines around its others
    (nested preprocessor conditionals are kept as they are; ``#else`` in a static section is refused)."""
    out: list[str] = []
    stack: list[str] = []            # per open #if: "0", "1" (static) or "" (left to the compiler)
    for ln in text.splitlines():
        s = ln.strip()
        dropped = "0" in stack
        if s.startswith("#if"):
            stack.append(s[-1] if s in ("#if 0", "#if 1") else "")
            if stack[-1]:
                continue
        elif s.startswith(("#else", "#elif")) and stack and stack[-1]:
            raise CodegenError("a static #if 0 / #if 1 section takes no #else")
        elif s.startswith("#endif") and stack:
            if stack.pop():
                continue
        if not dropped:
            out.append(ln)
    return "\n".join(out) + "\n"


# ============================================================================ index plans
def mask_trivial(v: ShapeTracker, k: int) -> bool:
    if v.mask is None:
        return True
    lo, hi = v.mask[k]
    return lo == as_expr(0) and hi == v.shape[k]


def coalesce(shape: Sequence[Expr], views: Sequence[ShapeTracker]) -> tuple[tuple[Expr, ...], list[ShapeTracker]]:
    """Drop unit dims and merge adjacent dims wherever every view allows it (row-major order of the
    iteration space is kept, so flat index f means the same element before and after).

    Two dims k, k+1 merge when, in every view, ``stride[k] == stride[k+1] * dim[k+1]`` and neither dim
    is masked. Fewer dims = fewer div/mod per element and longer contiguous runs for vectorisation.
    """
    shape = [as_expr(d) for d in shape]
    for v in views:
        if v.ndim != len(shape) or tuple(v.shape) != tuple(shape):
            raise CodegenError(f"view shape {[str(x) for x in v.shape]} does not match the iteration shape "
                               f"{[str(x) for x in shape]}")
    dims = list(range(len(shape)))
    # per view, per dim: (stride, mask or None)
    cols = [[(v.strides[k], None if mask_trivial(v, k) else v.mask[k])  # type: ignore[index]
             for k in dims] for v in views]
    keep = [k for k in dims if not (is_one(shape[k]) and all(c[k][1] is None for c in cols))]
    shp = [shape[k] for k in keep]
    cols = [[c[k] for k in keep] for c in cols]
    k = len(shp) - 2
    while k >= 0:
        if all(c[k][1] is None and c[k + 1][1] is None and c[k][0] == c[k + 1][0] * shp[k + 1] for c in cols):
            shp[k] = shp[k] * shp[k + 1]
            del shp[k + 1]
            for c in cols:
                c[k] = (c[k + 1][0], None)
                del c[k + 1]
        k -= 1
    out_views = []
    for v, c in zip(views, cols):
        masked = any(m is not None for _, m in c)
        mask = tuple(m if m is not None else (as_expr(0), d) for (_, m), d in zip(c, shp)) if masked else None
        out_views.append(ShapeTracker(tuple(shp), tuple(s for s, _ in c), v.offset, mask))
    return tuple(shp), out_views


def index_vars(n: int) -> tuple[Expr, ...]:
    return tuple(Var(f"lum_i{k}") for k in range(n))


def validity_terms(view: ShapeTracker, idx: Sequence[Expr]) -> list[tuple[Expr, str, Expr]]:
    """The mask as a conjunction of ``(a, "<=" | "<", b)`` terms: ``lo <= i`` and ``i < hi`` for each
    constrained dim — the same rule as :meth:`ShapeTracker.validity`, which multiplies lt() factors."""
    terms: list[tuple[Expr, str, Expr]] = []
    if view.mask is None:
        return terms
    for i, (lo, hi), d in zip(idx, view.mask, view.shape):
        if lo != as_expr(0):
            terms.append((lo, "<=", i))
        if hi != d:
            terms.append((i, "<", hi))
    return terms


@dataclass
class KernelContext:
    """Collects what the printed C needs: dyn var renaming/slots and every index expression (for the
    32/64-bit decision)."""

    dyn_vars: tuple[str, ...]
    used: set[str] = field(default_factory=set)
    exprs: list[Expr] = field(default_factory=list)
    var_bounds: dict[str, tuple[int, float]] = field(default_factory=dict)

    def c(self, e: Expr | int) -> str:
        e = as_expr(e)
        self.exprs.append(e)
        ren = {}
        for v in e.vars():
            if v.startswith("lum_"):
                continue
            if v not in self.dyn_vars:
                raise CodegenError(f"dyn var {v!r} is used by the op but not in dyn_vars {list(self.dyn_vars)}")
            self.used.add(v)
            ren[v] = Var(f"lum_d_{v}")
        return e.substitute(ren).to_c() if ren else e.to_c()

    def bound_var(self, name: str, size: Expr) -> None:
        """Index variable ``name`` ranges over [0, size)."""
        self.exprs.append(size)
        hi = size.bounds(self._dyn_bounds())[1]
        self.var_bounds[name] = (0, max(0, hi - 1) if hi != INF else INF)

    max_dyn: Mapping[str, int] | None = None

    def _dyn_bounds(self) -> dict[str, tuple[int, float]]:
        out: dict[str, tuple[int, float]] = {}
        for v in self.dyn_vars:
            hi = self.max_dyn.get(v) if self.max_dyn else None
            out[v] = (0, INF if hi is None else int(hi))
        return out

    def fits_i32(self, extra: int = 0) -> bool:
        b = {**self._dyn_bounds(), **self.var_bounds}

        def ok(e: Expr) -> bool:
            lo, hi = e.bounds(b)
            if lo < -_I32_MAX or hi + extra > _I32_MAX:
                return False
            return all(ok(a) for a in e.args) if e.op not in ("const", "var") else True

        return all(ok(e) for e in self.exprs)

    def dyn_loads(self, wait: bool = True, trigger: str = "start") -> tuple[str, dict[str, int]]:
        """A kernel's preamble: let the next kernel launch (``lum_pdl_trigger``), read the dyn vars it uses,
        then wait for the previous kernel (``lum_pdl_wait``; templates/common.cuh), unless ``wait`` is False
        because the template waits itself once it has issued its early reads (gemv.cu's preload). ``trigger``:
        ``start`` (first) or ``template`` (none here, the template triggers itself: an attention stage's
        ``trigger``). (A trigger after the wait, so that a GEMV behind asked L2 for its weights beside this
        kernel alone, measured −1.0% on an H100 and was removed: benchmarks/NOTES.md 2026-12-07.)"""
        if trigger not in ("start", "template"):
            raise CodegenError(f"trigger is 'start' or 'template', got {trigger!r}")
        slots = {v: self.dyn_vars.index(v) for v in sorted(self.used, key=self.dyn_vars.index)}
        start = "  LUM_STAMP_AT(0);  // stamps builds: the block's start (the trigger comes later)"
        lines = [start if trigger != "start" else "  lum_pdl_trigger();  // common.cuh: launch order"]
        lines += [f"  const idx_t lum_d_{v} = (idx_t)dyn[{k}]; (void)lum_d_{v};" for v, k in slots.items()]
        lines += [] if slots else ["  (void)dyn;"]
        lines += ["  lum_pdl_wait();"] if wait else []
        return "\n".join(lines), slots


def view_access(ctx: KernelContext, view: ShapeTracker, idx: Sequence[Expr], extra_phys: Expr | None = None,
                extra_terms: Sequence[tuple[Expr, str, Expr]] = ()) -> tuple[str, str | None]:
    """(physical index C, validity C or None when always valid) of ``view`` at logical index ``idx``."""
    phys = view.physical_index(idx)
    if extra_phys is not None:
        phys = phys + extra_phys
    terms = list(validity_terms(view, idx)) + list(extra_terms)
    conds = []
    for a, rel, b in terms:
        lo, hi = (a - b).bounds(ctx._dyn_bounds() | ctx.var_bounds)
        if hi < 0 or (rel == "<=" and hi <= 0):
            continue                      # always true
        if lo > 0 or (rel == "<" and lo >= 0):
            return ctx.c(phys), "false"   # never valid
        conds.append(f"({ctx.c(a)} {rel} {ctx.c(b)})")
    return ctx.c(phys), (" && ".join(conds) if conds else None)


def entry_named(body: str, tag: str, prefix: str) -> tuple[str, str]:
    """``body`` with its entry (``ENTRY_PLACEHOLDER``) named ``prefix`` + 16 hex digits of the SHA-256 of ``tag``
    and the body, and that name: the same text always gets the same name, different text a different one."""
    name = prefix + hashlib.sha256(f"{tag}\n{body}".encode()).hexdigest()[:16]
    return body.replace(ENTRY_PLACEHOLDER, name), name


def unravel_index(ctx: KernelContext, flat: str, shape: Sequence[Expr], indent: str, last_vec: int = 1) -> str:
    """C statements defining lum_i0.. (idx_t) from the non-negative flat index ``flat`` (row-major over
    ``shape``; with ``last_vec`` > 1 the flat index counts groups of that many innermost elements)."""
    n = len(shape)
    for k in range(n):
        ctx.bound_var(f"lum_i{k}", shape[k])
    if n == 0:
        return ""
    lines = []
    if n == 1:
        expr = f"{flat} * {last_vec}" if last_vec > 1 else flat
        return f"{indent}const idx_t lum_i0 = {expr}; (void)lum_i0;\n"
    lines.append(f"{indent}idx_t lum_t = {flat};")
    for k in range(n - 1, 0, -1):
        d = shape[k]
        if k == n - 1 and last_vec > 1:
            dc = ctx.c(d // last_vec)
            lines.append(f"{indent}const idx_t lum_i{k} = (idx_t)(lum_t % {dc}) * {last_vec}; lum_t /= {dc}; (void)lum_i{k};")
        else:
            dc = ctx.c(d)
            lines.append(f"{indent}const idx_t lum_i{k} = (idx_t)(lum_t % {dc}); lum_t /= {dc}; (void)lum_i{k};")
    lines.append(f"{indent}const idx_t lum_i0 = lum_t; (void)lum_i0;")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class AccessPlan:
    """What codegen substitutes into a template for a set of views over one iteration space (exposed so
    tests can evaluate the very C text that kernels contain)."""

    shape: tuple[Expr, ...]                      # coalesced iteration shape
    views: tuple[ShapeTracker, ...]              # coalesced views
    unravel: str                                 # C statements: flat index `lum_w` -> lum_i0..
    access: tuple[tuple[str, str | None], ...]   # per view: (physical index C, validity C or None)
    dyn_slots: dict[str, int]                    # dyn var -> slot; the C names are lum_d_<var>


def access_plan(shape: Sequence[Expr], views: Sequence[ShapeTracker], dyn_vars: Sequence[str] = (),
                vec: int = 1) -> AccessPlan:
    """Coalesce ``views`` over ``shape`` and print the unravel code and each view's index / validity."""
    ctx = KernelContext(tuple(dyn_vars))
    cshape, cviews = coalesce([as_expr(d) for d in shape], views)
    unravel = unravel_index(ctx, "lum_w", cshape, "", vec)
    idx = index_vars(len(cshape))
    acc = tuple(view_access(ctx, v, idx) for v in cviews)
    return AccessPlan(cshape, tuple(cviews), unravel, acc, ctx.dyn_loads()[1])


# ============================================================================ values and conversions
def value_kind(dt: DType) -> str:
    return "f" if dt.is_float else "i" if dt.is_int else "b"


def load_conv(dt: DType, raw: str) -> str:
    if dt == DType.f32:
        return raw
    if dt == DType.f16:
        return f"lum_f16_to_f32({raw})"
    if dt == DType.bf16:
        return f"lum_bf16_to_f32({raw})"
    if dt.is_int:
        return f"(long long)({raw})"
    return f"(({raw}) != 0)"


def convert_kind(kind_from: str, kind_to: str, x: str) -> str:
    if kind_from == kind_to:
        return x
    if kind_to == "b":
        return f"(({x}) != 0)"
    return f"({KIND_C[kind_to]})({x})"


def store_conv(kind: str, x: str, dt: DType) -> str:
    if dt == DType.f32:
        return convert_kind(kind, "f", x) if kind != "b" else f"(({x}) ? 1.0f : 0.0f)"
    if dt in (DType.f16, DType.bf16):
        f = convert_kind(kind, "f", x) if kind != "b" else f"(({x}) ? 1.0f : 0.0f)"
        return f"lum_f32_to_{dt.value}({f})"
    if dt.is_int:
        return f"({STORAGE_C[dt]})({x})"
    return f"(lum_bool)(({x}) != 0)"


def _promote(*kinds: str) -> str:
    for k in ("d", "f", "i"):
        if k in kinds:
            return k
    return "b"


_UNARY_F = {"Exp2": "exp2f({})", "Log2": "log2f({})", "Sin": "sinf({})", "Sqrt": "sqrtf({})",
            "Recip": "(1.0f / {})"}
_UNARY_D = {"Exp2": "exp2({})", "Log2": "log2({})", "Sin": "sin({})", "Sqrt": "sqrt({})",
            "Recip": "(1.0 / {})"}


def compute_node(op: str, args: Sequence[tuple[str, str]], math: str) -> tuple[str, str]:
    """(C expression, value kind) of an elementwise op on (C name, kind) arguments."""
    if op in ("Cast", "Contiguous"):
        return args[0]
    if op in _UNARY_F:
        a, k = args[0]
        if k == "f" and math == "f32":
            return _UNARY_F[op].format(a), "f"
        return _UNARY_D[op].format(convert_kind(k, "d", a) if k != "b" else f"({a} ? 1.0 : 0.0)"), "d"
    if op in ("Add", "Mul", "Mod", "LessThan"):
        (a, ka), (b, kb) = args
        k = _promote(ka, kb)
        a, b = convert_kind(ka, k, a), convert_kind(kb, k, b)
        if op == "LessThan":
            return f"({a} < {b})", "b"
        if k == "b":
            return {"Add": f"({a} || {b})", "Mul": f"({a} && {b})", "Mod": f"((void){a}, (void){b}, false)"}[op], "b"
        if op == "Add":
            return f"({a} + {b})", k
        if op == "Mul":
            return f"({a} * {b})", k
        return (f"lum_imod_floor({a}, {b})" if k == "i" else f"lum_fmod_floor({a}, {b})"), k
    if op == "Where":
        (c, kc), (a, ka), (b, kb) = args
        k = _promote(ka, kb)
        cond = c if kc == "b" else f"({c} != 0)"
        return f"({cond} ? {convert_kind(ka, k, a)} : {convert_kind(kb, k, b)})", k
    raise CodegenError(f"unknown elementwise op {op!r}")


# ============================================================================ literals
def f32_literal(x: float) -> str:
    """``x`` rounded to f32 as an exact C++ hex-float literal (what an f32 constant buffer would hold)."""
    return struct.unpack("<f", struct.pack("<f", x))[0].hex() + "f"
