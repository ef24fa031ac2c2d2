"""Codegen: one LLIR kernel op → CUDA C++ source (from ``templates/*.cu``) plus how to launch it.

    ks = generate(op, dyn_vars=["s", "p"], arg_dtypes=[DType.bf16, DType.bf16])
    ks.name, ks.source                     # entry name (stable: a hash of the source), full module text
    ks.launches                            # [Launch(kernel, grid=(Expr,1,1), block=(256,1,1), shared_mem=0)]
    module_source([ks1, ks2, ...])         # several kernels in one NVRTC module (one compile)

Every non-library op kind has a template: ``elementwise.cu`` (Cast … Contiguous, Fused expression
trees, and the copy half of scatter), ``reduce.cu`` (Sum / Max over an axis, of one read or of a
fused prologue's expression tree), ``row.cu`` (trees with row reductions: an elementwise op, a reduce
over the last axis or a scatter whose prologue normalises rows), ``gather.cu``, ``scatter.cu``
(scatter rows and scatter_nocopy, with or without a fused prologue), ``iota.cu``, ``attention.cu``
(the chunk partials of decode attention), ``flash_attention.cu`` (the same op where many query rows share
a K / V row, as in prefill: tiled flash attention, see :func:`~lum.builder.attention_policy.flash_attention`),
``gemv.cu`` (a ``gemm`` with a static m ≤ :data:`~lum.builder.gemv_policy.GEMV_MAX_M`: decode GEMV, see
:func:`~lum.builder.gemv_policy.gemv_rows`); ``common.cuh`` (f16/bf16 conversions, floor-div helpers, warp
reductions, vector loads) is pasted at the top of each module. Any other ``gemm`` is a cuBLASLt call:
:func:`generate` returns ``None`` for it (and for input / output / constant, which are not kernels). The
policy that needs no kernel generator lives beside this module: which gemms run ``gemv.cu`` and the GEMV's
default sizes and ``$LUM_GEMV_*`` knobs in :mod:`lum.builder.gemv_policy`, which attention ops run flash
attention in :mod:`lum.builder.attention_policy`, the ``$LUM_…`` switch readers in
:mod:`lum.builder.env_switches`.

**Kernel signature convention.** Every entry point is ``extern "C"`` and takes, in this order::

    (OutT* out, const In0T* in0, …, const In{n-1}T* in{n-1}, const long long* dyn)

``out`` is the op's buffer, ``inK`` the buffer of ``op.args[K]`` (its producer's flat buffer; the view is
compiled into the kernel), all as raw device pointers to *storage* types: ``float``, ``unsigned short``
(f16 and bf16 bits), ``int``, ``long long``, ``unsigned char`` (bool). For an in-place op (``alias = j``,
and always for scatter_nocopy) ``out`` and ``in{j}`` are the same pointer; scatter_nocopy never reads
``in0``. :attr:`KernelSource.params` lists the parameters. Buffers must be aligned to 16 bytes (vector
loads are only generated when offsets allow, assuming that alignment).

**Dyn values.** Shapes, strides, offsets and masks are compiled in as C expressions; each dyn var
(``s``, ``p`` …) is read at kernel start from the small device buffer ``dyn``: the var ``dyn_vars[k]``
is ``dyn[k]`` (one int64 slot per name, in the order the caller passes — the same order for every
kernel of a program; :attr:`KernelSource.dyn_slots` lists the slots a kernel reads). The runtime writes
new values into that buffer (e.g. the past length before each decode step) and replays a captured CUDA
graph without re-capture. **Every kernel is correct for any grid ≥ 1**: all loop over their work with
grid-stride loops bounded by sizes read from ``dyn``. The grid only affects speed, so a graph captured
with the grid of an earlier (e.g. bucket-maximum) dyn_map stays correct; re-capture is needed only for
speed, or when work can outgrow what the old grid covers efficiently.

**Launches.** :attr:`KernelSource.launches` is an ordered list (one entry, or two for ``scatter``: a
copy ``…_copy`` then ``…_rows``, on one stream). ``grid`` is three :class:`~lum.format.expr.Expr` over
the dyn vars (evaluate them with the dyn_map: ``[g.evaluate(dyn_map) for g in launch.grid]``; always
≥ 1), ``block`` three ints, ``shared_mem`` the dynamic shared memory in bytes (0 for the templates that use
static shared memory only; flash attention's tiles are dynamic, above 48 KB for large heads, which the loader
opts the kernel in to). All launches of one KernelSource take the same parameter list.

**Numerics.** f16/bf16 load as float, compute in float and store rounded to nearest even; f32 computes
in float (``math="f64"``: unary math in double); integers compute in int64, bool as bool; conversions
follow the LLIR rules (float→int truncates, anything→bool is ``x != 0``); Max propagates NaN;
reductions accumulate in float (``acc="f64"``: double) or int64.

**Index width.** Index arithmetic is 32-bit when every index expression provably fits (all sizes static,
or ``max_dyn`` bounds the dyn vars), else 64-bit (``index_bits`` forces either).

**Tuning parameters** (keyword arguments with defaults; the effective values are in
:attr:`KernelSource.tuning`): ``threads`` (block size; 256, or see ``_default_threads`` for gemv),
``ept`` (work items per thread per block tile), ``vec`` (elements per vector access, elementwise and
gemv's B operand; ``None`` picks the widest legal one), ``group`` (threads per output row, reduce;
threads reducing one output column, gemv — above 32 a split-K across warps), ``unroll`` (gemv k-loop unroll, default 4),
``inflight`` (gemv, dot scheme: vector loads of the weights a lane issues before it uses any; 0 leaves
the schedule to the compiler's unrolled loop; default ``$LUM_GEMV_INFLIGHT``, else 0), ``preload`` (gemv,
dot scheme: vectors of the weights, per product column, that each lane loads from its column of the
block's first tile into registers before the kernel waits for its predecessor, together at most
:data:`~lum.builder.gemv_policy.GEMV_PRELOAD_VECTORS`; default ``$LUM_GEMV_PRELOAD``, else 0; see also
:func:`gemv_after_small`), ``preload_shared`` (gemv: the preload goes to shared memory, up to
:data:`~lum.builder.gemv_policy.GEMV_SHARED_PRELOAD_VECTORS`, so it may hold every vector of a lane's first
column; see :func:`~lum.builder.gemv_policy.gemv_preload_shared`), ``tile_keys`` (flash attention: keys a
tile, one of :data:`~lum.builder.attention_policy.FLASH_TILE_KEYS`; 64 on tensor cores, 32 with
FMAs; its query rows a block are 16 a warp of ``threads``, default 128), ``max_blocks`` (grid cap),
``index_bits``, ``acc``, ``math``, ``row_regs`` (row kernels keep a static row in registers; False: they
read it each phase, for fewer registers). Gemv's defaults size ``group`` from the static n and k (see
``_Gen._gemv_group``); its tuning also reports ``scheme`` (dot | cols) and ``cols`` per block tile.
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from lum.builder.attention_policy import (ATTENTION_MAX_GROUP, ATTENTION_MERGE_SMEM, FLASH_MAX_D, FLASH_TILE_KEYS,
                                          attention_group_rows, attention_row_dims, attention_stage_block,
                                          flash_attention, flash_features_fit)
from lum.builder.env_switches import CodegenError, env_switch
from lum.builder.gemv_policy import (GEMV_DTYPES, GEMV_LARGE, GEMV_MAX_ACC, GEMV_MAX_INFLIGHT, GEMV_PRELOAD_VECTORS,
                                     GEMV_SHARED_PRELOAD_BYTES, GEMV_SHARED_PRELOAD_VECTORS, SMS, blocks_unbalanced,
                                     gemv_balance, gemv_evict_first, gemv_inflight_default, gemv_kernel_ops,
                                     gemv_preload_after_gemv, gemv_preload_default, gemv_preload_shared,
                                     gemv_prologue_fits, gemv_prologue_narrow_a, gemv_prologue_pairs,
                                     gemv_prologue_threads, gemv_rows, gemv_tuning_override, prologue_walks_tiles,
                                     split_gemv_tuning)
from lum.builder.intmath import is_one, pow2_floor, pow2ceil
from lum.format.dtypes import DType
from lum.format.expr import INF, Expr, Var, as_expr, cdiv, smax, smin
from lum.format.llir import (ELEMENTWISE_ARITY, GEMM_DEFAULTS, ROW_OPS, LOp, Program, check_expr,
                             attention_dims, check_attention, check_row_reduce, check_scatter_prologue, gemm_fused,
                             gemm_parts, has_row_ops)
from lum.format.manifest import MAX_SHARED_MEM
from lum.format.shapetracker import ShapeTracker, numel

__all__ = ["Launch", "Param", "KernelSource", "CodegenError", "generate", "generate_program", "module_source",
           "render", "load_template", "common_header", "coalesce", "view_access", "access_plan", "AccessPlan", "STORAGE_C",
           "ELEMENTWISE_OPS", "KERNEL_KINDS", "gemv_after_small",
           "AttentionStage", "StageRow", "stage_row"]

ELEMENTWISE_OPS = ("Cast", "Contiguous", "Exp2", "Log2", "Sin", "Sqrt", "Recip", "Add", "Mul", "Mod",
                   "LessThan", "Where")
KERNEL_KINDS = ("elementwise", "reduce", "gather", "scatter", "scatter_nocopy", "iota", "attention", "gemm")
ROW_REGS = 8                                     # row kernels keep a static row in registers up to this per lane
_GEMV_FILL_THREADS = SMS * 2048                 # the resident threads of the SMS SMs (2,048 an SM)

STORAGE_C = {DType.f32: "float", DType.f16: "lum_f16", DType.bf16: "lum_bf16", DType.i32: "int",
             DType.i64: "long long", DType.bool: "lum_bool"}
_KIND_C = {"f": "float", "d": "double", "i": "long long", "b": "bool"}
_ZERO = {"f": "0.0f", "d": "0.0", "i": "0LL", "b": "false"}
_I32_MAX = 2**31 - 1
_ENTRY = "LUM_ENTRY_NAME"  # stands for the entry name while the source is hashed


# ============================================================================ data
@dataclass(frozen=True)
class Launch:
    kernel: str                                  # entry name in the module
    grid: tuple[Expr, Expr, Expr]                # over the dyn vars, each >= 1
    block: tuple[int, int, int]
    shared_mem: int = 0                          # dynamic shared memory bytes

    def evaluate(self, dyn_map: Mapping[str, int]) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
        return tuple(g.evaluate(dyn_map) for g in self.grid), self.block, self.shared_mem  # type: ignore[return-value]


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
            "launches": [{"kernel": lc.kernel, "grid": [str(g) for g in lc.grid], "block": list(lc.block),
                          "shared_mem": lc.shared_mem} for lc in self.launches],
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
def _mask_trivial(v: ShapeTracker, k: int) -> bool:
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
    cols = [[(v.strides[k], None if _mask_trivial(v, k) else v.mask[k]) for k in dims] for v in views]  # type: ignore[index]
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
class _Ctx:
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
        ``trigger``)."""
        if trigger not in ("start", "template"):
            raise CodegenError(f"trigger is 'start' or 'template', got {trigger!r}")
        slots = {v: self.dyn_vars.index(v) for v in sorted(self.used, key=self.dyn_vars.index)}
        first = {"start": ["  lum_pdl_trigger();  // common.cuh: launch order"],
                 "template": ["  LUM_STAMP_AT(0);  // stamps builds: the block's start (the template triggers later)"]}
        lines = list(first[trigger])
        lines += [f"  const idx_t lum_d_{v} = (idx_t)dyn[{k}]; (void)lum_d_{v};" for v, k in slots.items()]
        lines += [] if slots else ["  (void)dyn;"]
        lines += ["  lum_pdl_wait();"] if wait else []
        return "\n".join(lines), slots


def view_access(ctx: _Ctx, view: ShapeTracker, idx: Sequence[Expr], extra_phys: Expr | None = None,
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


def _unravel(ctx: _Ctx, flat: str, shape: Sequence[Expr], indent: str, last_vec: int = 1) -> str:
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
    ctx = _Ctx(tuple(dyn_vars))
    cshape, cviews = coalesce([as_expr(d) for d in shape], views)
    unravel = _unravel(ctx, "lum_w", cshape, "", vec)
    idx = index_vars(len(cshape))
    acc = tuple(view_access(ctx, v, idx) for v in cviews)
    return AccessPlan(cshape, tuple(cviews), unravel, acc, ctx.dyn_loads()[1])


# ============================================================================ values and conversions
def _kind(dt: DType) -> str:
    return "f" if dt.is_float else "i" if dt.is_int else "b"


def _load_conv(dt: DType, raw: str) -> str:
    if dt == DType.f32:
        return raw
    if dt == DType.f16:
        return f"lum_f16_to_f32({raw})"
    if dt == DType.bf16:
        return f"lum_bf16_to_f32({raw})"
    if dt.is_int:
        return f"(long long)({raw})"
    return f"(({raw}) != 0)"


def _to_kind(kind_from: str, kind_to: str, x: str) -> str:
    if kind_from == kind_to:
        return x
    if kind_to == "b":
        return f"(({x}) != 0)"
    return f"({_KIND_C[kind_to]})({x})"


def _store_conv(kind: str, x: str, dt: DType) -> str:
    if dt == DType.f32:
        return _to_kind(kind, "f", x) if kind != "b" else f"(({x}) ? 1.0f : 0.0f)"
    if dt in (DType.f16, DType.bf16):
        f = _to_kind(kind, "f", x) if kind != "b" else f"(({x}) ? 1.0f : 0.0f)"
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


def _compute(op: str, args: Sequence[tuple[str, str]], math: str) -> tuple[str, str]:
    """(C expression, value kind) of an elementwise op on (C name, kind) arguments."""
    if op in ("Cast", "Contiguous"):
        return args[0]
    if op in _UNARY_F:
        a, k = args[0]
        if k == "f" and math == "f32":
            return _UNARY_F[op].format(a), "f"
        return _UNARY_D[op].format(_to_kind(k, "d", a) if k != "b" else f"({a} ? 1.0 : 0.0)"), "d"
    if op in ("Add", "Mul", "Mod", "LessThan"):
        (a, ka), (b, kb) = args
        k = _promote(ka, kb)
        a, b = _to_kind(ka, k, a), _to_kind(kb, k, b)
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
        return f"({cond} ? {_to_kind(ka, k, a)} : {_to_kind(kb, k, b)})", k
    raise CodegenError(f"unknown elementwise op {op!r}")


# ============================================================================ dtypes of arguments
def _arg_dtypes(op: LOp, given: Sequence[DType | str] | None) -> list[DType]:
    n = len(op.args)
    if given is None and "arg_dtypes" in op.params:
        given = op.params["arg_dtypes"]
    if given is not None:
        dts = [d if isinstance(d, DType) else DType.parse(str(d)) for d in given]
        if len(dts) != n:
            raise CodegenError(f"{len(dts)} arg dtypes for {n} arguments of {op.kind} {op.op}")
        return dts
    # What the dtype rules (rules/dtype.egg) imply; anything else must be passed.
    same = op.dtype
    if op.kind == "elementwise" and op.op in ("Contiguous", "Exp2", "Log2", "Sin", "Sqrt", "Recip", "Add",
                                              "Mul", "Mod"):
        return [same] * n
    if op.kind == "reduce" and "expr" not in op.params:
        return [same] * n
    if op.kind == "iota":
        return []
    raise CodegenError(f"{op.kind} {op.op}: pass arg_dtypes (the producers' dtypes); they are not implied by "
                       f"the op's dtype (use generate_program to infer them from the program)")


# ============================================================================ literals and default block sizes
def _f32_literal(x: float) -> str:
    """``x`` rounded to f32 as an exact C++ hex-float literal (what an f32 constant buffer would hold)."""
    return struct.unpack("<f", struct.pack("<f", x))[0].hex() + "f"


def _default_threads(op: LOp) -> int:
    """Block size when the caller leaves it open: 256, except lum's decode GEMV (dot scheme), where
    benchmarks/gemv_sweep.py measured small blocks best for many columns (>= 8,192: 128 threads, e.g.
    3.54 vs 3.15 TB/s on gemma3-4b's gate projection) and large ones for few (512: 2.40 vs 2.15 TB/s on
    its q projection), unless a large one's blocks would load the SMs unevenly
    (:func:`~lum.builder.gemv_policy.blocks_unbalanced`)."""
    if op.kind == "attention":       # 4 warps x 4 keys in flight per block (extract.ATTENTION_CHUNK = 16)
        return 128
    if op.kind == "gemm" and "expr" in op.params:   # a prologue per block wants few, large blocks (gemv_sweep.py
        return gemv_prologue_threads()                # --mode prologue: 1,024 or 512 threads, warp groups, best)
    if op.kind == "gemm" and gemv_rows(op) is not None and op.params["layout"][2:] == "Cm":
        cols = as_expr(op.params.get("batch", 1)) * as_expr(op.params["n"])
        if cols.is_const and cols.value >= 8192:
            return 128
        k = as_expr(op.params["k"])
        if (cols.is_const and k.is_const and cols.value * k.value >= GEMV_LARGE and blocks_unbalanced(cols.value // 8)
                and gemv_balance()):
            return 128
        return 512
    return 256


# ============================================================================ public entry points
def generate(op: LOp, dyn_vars: Sequence[str] = (), *, arg_dtypes: Sequence[DType | str] | None = None,
             threads: int | None = None, ept: int | None = None, vec: int | None = None, group: int | None = None,
             unroll: int | None = None, inflight: int | None = None, preload: int | None = None,
             preload_shared: bool = False, max_blocks: int = 65536,
             index_bits: int | None = None, max_dyn: Mapping[str, int] | None = None, acc: str = "f32",
             math: str = "f32", row_regs: bool = True, weight_args: frozenset[int] = frozenset(),
             stage: AttentionStage | None = None, tile_keys: int | None = None) -> KernelSource | None:
    """CUDA source and launch description for one LLIR op; ``None`` for a gemm that stays a cuBLASLt call
    (see :func:`~lum.builder.gemv_policy.gemv_rows`) and for input / output / constant (no kernel).
    ``dyn_vars``: the slot order of the runtime dyn buffer. ``arg_dtypes``: storage dtypes of ``op.args``
    (their producers' dtypes) where the op's own dtype does not imply them. ``stage``: the rows of the ops
    before it an attention kernel computes (:class:`AttentionStage`). See the module docstring for the tuning
    parameters."""
    if op.kind in ("input", "output", "constant") or (op.kind == "gemm" and gemv_rows(op) is None):
        return None
    if op.kind not in KERNEL_KINDS:
        raise CodegenError(f"no template for LLIR op kind {op.kind!r}")
    dyn_vars = tuple(dyn_vars)
    for v in dyn_vars:
        if v.startswith("lum_"):
            raise CodegenError(f"dyn var name {v!r} is reserved (prefix lum_)")
    if len(set(dyn_vars)) != len(dyn_vars):
        raise CodegenError(f"duplicate names in dyn_vars {list(dyn_vars)}")
    threads_given = threads is not None
    if op.kind == "attention" and stage is not None and not threads_given and unroll is None:
        threads, unroll = attention_stage_block(op) or (None, None)
    if threads is None:
        threads = _default_threads(op)
    if threads % 32 or not 32 <= threads <= 1024:
        raise CodegenError(f"threads must be a multiple of 32 in [32, 1024], got {threads}")
    if acc not in ("f32", "f64") or math not in ("f32", "f64"):
        raise CodegenError(f"acc and math are 'f32' or 'f64', got acc={acc!r} math={math!r}")
    if index_bits not in (None, 32, 64):
        raise CodegenError(f"index_bits is None (auto), 32 or 64, got {index_bits!r}")
    dts = _arg_dtypes(op, arg_dtypes)
    if gemm_fused(op):                                 # no library fallback
        if any(d not in GEMV_DTYPES for d in (dts[gemm_parts(op)[0]], op.dtype)):
            raise CodegenError(f"a fused gemm's B and output must be one of {[d.value for d in GEMV_DTYPES]}")
    elif op.kind == "gemm" and any(d not in GEMV_DTYPES for d in (*dts, op.dtype)):
        return None
    ctx = _Ctx(dyn_vars, max_dyn=max_dyn)
    gen = _Gen(op, dts, ctx, threads=threads, ept=ept, vec=vec, group=group, unroll=unroll,
               inflight=gemv_inflight_default() if inflight is None else inflight,
               preload=gemv_preload_default() if preload is None else preload, preload_shared=preload_shared,
               max_blocks=max_blocks,
               acc=acc, math=math, threads_given=threads_given, row_regs=row_regs,
               weight_args=frozenset(weight_args), stage=stage, tile_keys=tile_keys)
    if stage is not None and op.kind != "attention":
        raise CodegenError(f"only an attention kernel runs a stage, not a {op.kind} kernel")
    bodies, launches_raw, tuning, margin = getattr(gen, "k_" + op.kind)()
    if index_bits is None:
        index_bits = 32 if ctx.fits_i32(margin) else 64
    idx_t = "int" if index_bits == 32 else "long long"
    dyn_loads, slots = ctx.dyn_loads(trigger="start" if stage is None else "template")
    nowait, _ = ctx.dyn_loads(wait=False)          # for templates that wait themselves, after their early reads
    body = "\n".join(bodies).replace("@IDX_T@", idx_t).replace("@DYN_LOADS_NOWAIT@", nowait)
    body = body.replace("@DYN_LOADS@", dyn_loads)
    tuning = {**tuning, "index_bits": index_bits}
    digest = hashlib.sha256(f"{op.kind}/{op.op}\n{body}".encode()).hexdigest()[:16]
    name = f"lum_{op.kind}_{op.op.lower() or op.kind}_{digest}" if op.op else f"lum_{op.kind}_{digest}"
    body = body.replace(_ENTRY, name)
    launches = tuple(Launch(name + suffix, grid, block, *smem) for suffix, grid, block, *smem in launches_raw)
    params = gen.params()
    return KernelSource(name=name, kind=op.kind, op=op.op, source=common_header() + "\n" + body, body=body,
                        launches=launches, params=params, dyn_vars=dyn_vars, dyn_slots=slots, tuning=tuning,
                        early=gen.early)


@dataclass(frozen=True)
class AttentionStage:
    """Which rows of the ops before it an attention kernel computes itself (:mod:`lum.builder.attention_stage`),
    as affine maps of its kv row h and query row m: the q op's row ``q[0] + q[1]·h + q[2]·m``, stored at
    physical index ``qb[0] + qb[1]·h + qb[2]·m`` of the q op's output; the k and v cache writes' rows
    ``k[0] + k[1]·h`` and ``v[0] + v[1]·h``. The kernel then takes three callables (:class:`StageRow`
    functions bound to their buffers) before its own parameters."""

    q: tuple[int, int, int]
    qb: tuple[int, int, int]
    k: tuple[int, int]
    v: tuple[int, int]


@dataclass(frozen=True)
class StageRow:
    """A small op (a norm, RoPE, a kv-cache write) as a device function in which one warp computes one of
    its rows: what an attention kernel runs of the ops before it (:mod:`lum.builder.attention_stage`).

    ``function``'s parameters: ``(long long lum_row_, bool lum_live, <extra>, <the op's kernel
    parameters>)``, where ``<extra>`` is ``LumSink lum_sink`` for an elementwise op (it stores row
    ``lum_row_`` there, not in ``out``) and ``long long lum_w0, long long lum_w1, long long lum_wT, bool
    lum_wfirst`` for a scatter (it writes its row only where the dest row ``lum_dr`` is in ``[lum_w0,
    lum_w1)``, or ``lum_wfirst`` and ``lum_dr >= lum_wT``). Every warp of the block must call it (its row
    reductions are warp shuffles); a warp with ``lum_live`` false loads and stores nothing."""

    function: str
    rows: int
    n: int
    bases: tuple[int, ...]           # per row: the physical index its element 0 is stored at (a scatter: dest row 0)
    col_stride: int                  # the store's stride along a row
    row_step: int | None             # a scatter's dest stride along its rows (the cache's time axis)
    params: tuple[Param, ...]
    dyn_slots: dict[str, int]


def stage_row(op: LOp, dyn_vars: Sequence[str], name: str, *, arg_dtypes: Sequence[DType | str] | None = None,
              threads: int = 128, max_dyn: Mapping[str, int] | None = None) -> StageRow:
    """``op`` (an elementwise Fused tree or a scatter_nocopy, with or without a fused prologue, over rows of a
    static length) as :class:`StageRow` function ``name`` for blocks of ``threads``; CodegenError where it is not
    such an op or its rows' stores are not at static places."""
    scatter = op.kind == "scatter_nocopy"
    if scatter and "expr" not in op.params and len(op.args) == 3:     # a plain copy: the identity prologue
        op = LOp(op.id, op.kind, op.op, op.args, op.shape, op.dtype, {**op.params, "expr": ["arg", 0]}, op.alias)
    if op.kind not in ("elementwise", "scatter_nocopy") or "expr" not in op.params or \
            (op.kind == "elementwise" and (op.op != "Fused" or op.alias is not None)):
        raise CodegenError(f"a stage row is an elementwise Fused op or a scatter_nocopy, not {op.kind} {op.op}")
    ctx = _Ctx(tuple(dyn_vars), max_dyn=max_dyn)
    gen = _Gen(op, _arg_dtypes(op, arg_dtypes), ctx, threads=threads, ept=None, vec=None, group=32, unroll=None,
               inflight=0, max_blocks=1, acc="f32", math="f32")
    rp = gen._row_parts(sink=None if scatter else "lum_sink",
                        writer="(lum_dr >= lum_w0 && lum_dr < lum_w1) || (lum_wfirst && lum_dr >= lum_wT)"
                        if scatter else None)
    if rp.group != 32 or not (rp.rows.is_const and rp.n.is_const) or rp.write_col is None \
            or not rp.write_col.is_const or (scatter and not (rp.write_step is not None and rp.write_step.is_const)):
        raise CodegenError("a stage row needs warp-sized rows of a static count and length, stored at static strides")
    bases = []
    for r in range(rp.rows.value):
        idx = np.unravel_index(r, tuple(d.value for d in rp.row_shape)) if rp.row_shape else ()
        b = rp.write_row.physical_index(tuple(as_expr(int(x)) for x in idx)).simplify()
        if not b.is_const:
            raise CodegenError("a stage row's store must be at a static place")
        bases.append(b.value)
    dyn, slots = ctx.dyn_loads(wait=False)
    dyn = "\n".join(x for x in dyn.splitlines() if "lum_pdl_" not in x)   # the kernel it runs in waits itself
    extra = ("long long lum_w0, long long lum_w1, long long lum_wT, bool lum_wfirst" if scatter
             else "LumSink lum_sink")
    params = gen.params()
    fn = "\n".join([
        f"__device__ __forceinline__ void {name}(long long lum_row_, bool lum_live, {extra}, "
        f"{', '.join(p.ctype for p in params)}) {{",
        f"  typedef {'int' if ctx.fits_i32(0) else 'long long'} idx_t;",
        f"  typedef {_KIND_C[rp.acc_kind]} acc_t;",
        "  constexpr int GROUP = 32;",
        "  __shared__ acc_t lum_smem[1];          // a warp's reduction needs none",
        dyn,
        f"  const idx_t lum_n = {ctx.c(rp.n)};",
        "  const int lum_lane = (int)threadIdx.x % GROUP;",
        "  const idx_t lum_row = (idx_t)lum_row_;",
        rp.setup, rp.phases, rp.final, "}"])
    return StageRow(fn, rp.rows.value, rp.n.value, tuple(bases), rp.write_col.value,
                    rp.write_step.value if scatter else None, params, slots)


def gemv_after_small(program: Program) -> set[int]:
    """Ids of the GEMV ops whose kernel before, in program order, is not a GEMV; for the first kernel, the
    program's last (a decoder layer's group follows itself). Only there can a preload's blocks become
    resident while the kernel before runs (:func:`~lum.builder.gemv_policy.gemv_preload_shared`). A register
    preload of one vector a lane there measured −3.1% on llama3-1b (its o GEMV and LM head), against −4.5%
    with every GEMV preloading (benchmarks/NOTES.md), and is gone."""
    ks = [o for o in program.ops if o.kind in KERNEL_KINDS and not (o.kind == "gemm" and gemv_rows(o) is None)]
    return {o.id for i, o in enumerate(ks) if o.kind == "gemm" and ks[i - 1].kind != "gemm"}


def generate_program(program: Program, dyn_vars: Sequence[str] | None = None, *,
                     weights: frozenset[int] = frozenset(), **tuning: Any) -> dict[int, KernelSource | None]:
    """:func:`generate` for every op of a program, with arg dtypes taken from the producers.
    ``dyn_vars`` defaults to every dyn var the program mentions, sorted. ``weights``: op ids of the
    program's inputs that are weights (an op's arguments read from them are its ``weight_args``).
    ``tuning``: keyword arguments of :func:`generate` for every op, and ``gemv<i>.<name>`` ones for the
    i-th GEMV (:func:`~lum.builder.gemv_policy.split_gemv_tuning`)."""
    if dyn_vars is None:
        dyn_vars = sorted(program.dyn_vars())
    common, per = split_gemv_tuning(tuning)
    rank = {o.id: i for i, o in enumerate(gemv_kernel_ops(program))}
    for r, given in gemv_tuning_override().items():
        if r in rank.values():
            for k, v in given.items():
                per.setdefault(r, {}).setdefault(k, v)
    after_gemv = gemv_preload_after_gemv()
    shared = None if common.get("preload_shared") is False else gemv_preload_shared()   # False: in registers
    in_registers: dict[int, dict[str, Any]] = {}     # rank -> its tuning with the preload in registers instead
    if (after_gemv or shared) and "preload" not in common:
        small = gemv_after_small(program)
        for oid, r in rank.items():
            n = 0 if oid in small else after_gemv
            if shared == "all" or (shared == "after_small" and oid in small):
                mine = per.setdefault(r, {})   # a preload the tuning sets (or kernels.py halves) stays shared
                in_registers[r] = dict(mine)   # read in ``small`` mode only, where n = 0 (no register preload)
                mine.setdefault("preload", GEMV_SHARED_PRELOAD_VECTORS)
                mine["preload_shared"] = True
            if n:
                per.setdefault(r, {}).setdefault("preload", n)
    out: dict[int, KernelSource | None] = {}
    for o in program.ops:
        dts = [program.ops[a.src].dtype for a in o.args]
        wargs = frozenset(k for k, a in enumerate(o.args) if a.src in weights)
        r = rank.get(o.id, -1)
        ks = generate(o, dyn_vars, arg_dtypes=dts, weight_args=wargs, **{**common, **per.get(r, {})})
        if r in in_registers and shared != "all" and ks is not None and prologue_walks_tiles(o, ks):
            ks = generate(o, dyn_vars, arg_dtypes=dts, weight_args=wargs, **{**common, **in_registers[r]})
        out[o.id] = ks
    return out


def module_source(kernels: Sequence[KernelSource], stamps: bool | None = None) -> str:
    """One NVRTC module holding several kernels (common.cuh once; identical kernels once).
    With ``stamps`` (default ``$LUM_STAMPS`` is ``1``) the module also records when each kernel's sampled
    blocks start and finish waiting (templates/common.cuh "stamps"; read by benchmarks/profile_decode.py
    --stamps): a probe build, never a default one. The kernels' own text, and so their names, stay the same."""
    if stamps is None:
        stamps = env_switch(ENV_STAMPS, default=False)
    unique: dict[str, KernelSource] = {}
    for k in kernels:
        unique.setdefault(k.name, k)
    if not stamps:
        return "\n".join([common_header(), *(k.body for k in unique.values())])
    parts, slot = [], 0
    for k in unique.values():
        parts += [f"#define LUM_STAMP_KERNEL {slot}\n#define LUM_STAMP_TAG {stamp_tag(k.name)}ull", k.body,
                  "#undef LUM_STAMP_KERNEL\n#undef LUM_STAMP_TAG"]
        slot += 1
    head = [f"#define LUM_STAMPS 1\n#define LUM_STAMP_BLOCKS {STAMP_BLOCKS}\n#define LUM_STAMP_FIELDS {STAMP_FIELDS}",
            f"__device__ unsigned long long lum_stamps[{max(1, slot) * STAMP_BLOCKS * STAMP_FIELDS}];"]
    return "\n".join([*head, common_header(), *parts])


ENV_STAMPS = "LUM_STAMPS"
STAMP_BLOCKS = 32          # blocks sampled a kernel, evenly spaced over its grid
STAMP_FIELDS = 8           # a sampled block's record: tag, block, SM, start ns, waited ns, 3 marks (LUM_STAMP_AT)


def stamp_tag(name: str) -> int:
    """The number a stamped kernel records as its own (60 bits of its name's SHA-256), which the reader maps
    back to the kernel's name."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:15], 16)


# ============================================================================ generators
@dataclass(frozen=True)
class _RowParts:
    """A row loop's generated pieces and shape (see :meth:`_Gen._row_parts`)."""

    setup: str
    phases: str
    final: str
    rows: Expr
    n: Expr
    group: int
    threads: int
    regs: int
    acc_kind: str
    row_shape: tuple[Expr, ...] = ()       # the rows' (coalesced) shape: lum_row unravels over it
    write_row: ShapeTracker | None = None  # the write's row part: element 0 of a row (a scatter's at dest row 0)
    write_col: Expr | None = None          # the write's stride along a row
    write_step: Expr | None = None         # a scatter's: the dest's stride along its rows


class _Gen:
    def __init__(self, op: LOp, dts: list[DType], ctx: _Ctx, *, threads: int, ept: int | None, vec: int | None,
                 group: int | None, unroll: int | None, inflight: int, max_blocks: int, acc: str, math: str,
                 preload: int = 0, preload_shared: bool = False, threads_given: bool = True,
                 row_regs: bool = True, weight_args: frozenset[int] = frozenset(),
                 stage: AttentionStage | None = None, tile_keys: int | None = None):
        self.op, self.dts, self.ctx = op, dts, ctx
        self.tile_keys = tile_keys                 # flash attention: keys a tile (None: its default)
        self.stage = stage                         # the rows of the ops before it an attention computes
        self.threads, self.ept, self.vec, self.group, self.unroll = threads, ept, vec, group, unroll
        self.inflight = inflight
        self.preload = preload
        self.preload_shared = preload_shared       # gemv: the preload into shared memory
        self.weight_args = weight_args             # the op's arguments that are weights (generate_program)
        self.early: tuple[str, ...] = ()           # parameters read before the wait (KernelSource.early)
        self.max_blocks, self.acc, self.math = max_blocks, acc, math
        self.row_regs = row_regs                   # False: row kernels read their rows each phase (no register copy)
        self.threads_given = threads_given         # False: threads is generate()'s default, row kernels pick theirs
        if max_blocks < 1:
            raise CodegenError(f"max_blocks must be >= 1, got {max_blocks}")

    # ------------------------------------------------------------------ common pieces
    def out_shape(self) -> tuple[Expr, ...]:
        return tuple(as_expr(d) for d in self.op.shape)

    def alias(self) -> int | None:
        return 0 if self.op.kind == "scatter_nocopy" else self.op.alias

    def write_view(self) -> ShapeTracker:
        """Where the op's logical output element lands in ``out``."""
        a = self.alias()
        if a is None:
            return ShapeTracker.contiguous(self.out_shape())
        v = self.op.args[a].view
        src = self.op.args[a].src
        for k, other in enumerate(self.op.args):
            if k != a and other.src == src and (other.view != v or self.op.kind != "elementwise"):
                raise CodegenError(f"in place (alias {a}): argument {k} also reads the aliased buffer through "
                                   "another view, which threads would race on")
        if v.mask is not None and any(not _mask_trivial(v, k) for k in range(v.ndim)):
            raise CodegenError("an in-place op cannot write through a padded (masked) view")
        if tuple(v.shape) != self.out_shape() and self.op.kind != "scatter_nocopy":
            raise CodegenError("the aliased argument's view must have the op's shape")
        return ShapeTracker(v.shape, v.strides, v.offset, None)

    def params(self) -> tuple[Param, ...]:
        a = self.alias()
        out_t = STORAGE_C[self.op.dtype]
        ps = [Param("out", "out", None, self.op.dtype,
                    f"{out_t}* {'' if a is not None else '__restrict__ '}out")]
        for k, dt in enumerate(self.dts):
            if self.op.kind == "scatter_nocopy" and k == 0:
                ps.append(Param("in0", "arg", 0, dt, "const void* in0"))
            elif a == k or (self.early and f"in{k}" not in self.early):
                # in place, or read after the wait of a kernel that reads before it: not __restrict__, so
                # that its loads are coherent ld.global, never ld.global.nc, which ptxas treats as
                # read-only for the kernel's lifetime and schedules above the wait (griddepcontrol.wait)
                # while the kernel before still writes it (seen: a GEMV prologue's loads above its preload)
                ps.append(Param(f"in{k}", "arg", k, dt, f"const {STORAGE_C[dt]}* in{k}"))
            else:
                ps.append(Param(f"in{k}", "arg", k, dt, f"const {STORAGE_C[dt]}* __restrict__ in{k}"))
        ps.append(Param("dyn", "dyn", None, None, "const long long* __restrict__ dyn"))
        return tuple(ps)

    def params_c(self) -> str:
        return ", ".join(p.ctype for p in self.params())

    def grid(self, items: Expr, per_block: int) -> tuple[Expr, Expr, Expr]:
        g = smax(1, smin(cdiv(items, per_block), self.max_blocks))
        return (g, as_expr(1), as_expr(1))

    def load(self, k: int, view: ShapeTracker, idx: Sequence[Expr], extra_phys: Expr | None = None,
             extra_terms: Sequence[tuple[Expr, Expr]] = (), guard: str | None = None, base: str | None = None) -> str:
        """Value (in the arg's kind) of args[k] read through ``view`` at ``idx``; 0 where padded or where the C
        condition ``guard`` is false. ``base``: a C index added to the view's physical index."""
        dt = self.dts[k]
        phys, valid = view_access(self.ctx, view, idx, extra_phys, extra_terms)
        conds = [c for c in (guard, valid) if c]
        if valid == "false":
            return _ZERO[_kind(dt)]
        val = _load_conv(dt, f"in{k}[{base} + {phys}]" if base else f"in{k}[{phys}]")
        return f"(({' && '.join(conds)}) ? {val} : {_ZERO[_kind(dt)]})" if conds else val

    def common_values(self, ept: int) -> dict[str, Any]:
        return {"KERNEL": _ENTRY, "THREADS": self.threads, "EPT": ept, "IDX_T": "@IDX_T@",
                "PARAMS": self.params_c(), "DYN_LOADS": "@DYN_LOADS@"}

    # ------------------------------------------------------------------ elementwise
    def _elementwise_body(self, op_name: str, arg_ids: Sequence[int], shape: tuple[Expr, ...],
                          write: ShapeTracker, contiguous_out: bool) -> tuple[str, Expr, dict[str, Any], int]:
        """BODY, number of work items, effective (vec, ept) and per-block tile for an elementwise op."""
        views = [write] + [self.op.args[k].view for k in arg_ids]
        for k, v in zip(arg_ids, views[1:]):
            if tuple(v.shape) != shape:
                raise CodegenError(f"argument {k}'s view has shape {[str(x) for x in v.shape]}, the op "
                                   f"{[str(x) for x in shape]}")
        cshape, cviews = coalesce(shape, views)
        dts = [self.op.dtype] + [self.dts[k] for k in arg_ids]
        vec = self._pick_vec(cshape, cviews, dts)
        ept = self.ept if self.ept is not None else (4 if vec == 1 else 2)
        if ept < 1 or ept > 16:
            raise CodegenError(f"ept must be in [1, 16], got {ept}")
        ind = " " * 8
        n = numel(cshape)
        items = n if vec == 1 else n // vec
        self.ctx.c(items)
        self.ctx.c(n)
        lines = [_unravel(self.ctx, "lum_w", cshape, ind, vec).rstrip("\n")]
        idx = index_vars(len(cshape))
        wview, aviews = cviews[0], cviews[1:]
        raw = op_name in ("Cast", "Contiguous") and self.dts[arg_ids[0]] == self.op.dtype
        st = STORAGE_C[self.op.dtype]
        if raw:   # same storage type: move the bits, no conversion round trip
            k, v = arg_ids[0], aviews[0]
            if vec == 1:
                phys, valid = view_access(self.ctx, v, idx)
                val = f"({st})0" if valid == "false" else f"(({valid}) ? in{k}[{phys}] : ({st})0)" if valid \
                    else f"in{k}[{phys}]"
                dest = "lum_w" if contiguous_out else view_access(self.ctx, wview, idx)[0]
                lines.append(f"{ind}out[{dest}] = {val};")
            else:
                vt = f"lum_vec<{st}, {vec}>"
                if v.strides[-1] == as_expr(0):
                    phys, valid = view_access(self.ctx, v, idx)
                    val = f"({st})0" if valid == "false" else f"(({valid}) ? in{k}[{phys}] : ({st})0)" if valid \
                        else f"in{k}[{phys}]"
                    lines.append(f"{ind}const {st} lum_s0 = {val};")
                    lines.append(f"{ind}{vt} lum_o;")
                    lines.append(f"{ind}#pragma unroll")
                    lines.append(f"{ind}for (int lum_k = 0; lum_k < {vec}; ++lum_k) lum_o.v[lum_k] = lum_s0;")
                else:
                    phys, valid = view_access(self.ctx, v, idx)
                    ld = f"*reinterpret_cast<const {vt}*>(in{k} + ({phys}))"
                    ld = f"{vt}{{}}" if valid == "false" else f"(({valid}) ? {ld} : {vt}{{}})" if valid else ld
                    lines.append(f"{ind}const {vt} lum_o = {ld};")
                dest = f"lum_w * {vec}" if contiguous_out else view_access(self.ctx, wview, idx)[0]
                lines.append(f"{ind}*reinterpret_cast<{vt}*>(out + ({dest})) = lum_o;")
        elif vec == 1:
            args = []
            for j, (k, v) in enumerate(zip(arg_ids, aviews)):
                lines.append(f"{ind}const {_KIND_C[_kind(self.dts[k])]} lum_a{j} = {self.load(k, v, idx)};")
                args.append((f"lum_a{j}", _kind(self.dts[k])))
            expr, kind = self._apply(op_name, args, lines, ind)
            if contiguous_out:
                self.ctx.c(as_expr(0))
                dest = "lum_w"
            else:
                dest, _ = view_access(self.ctx, wview, idx)
            lines.append(f"{ind}out[{dest}] = {_store_conv(kind, expr, self.op.dtype)};")
        else:
            args = []
            for j, (k, v) in enumerate(zip(arg_ids, aviews)):
                dt, kk = self.dts[k], _kind(self.dts[k])
                if v.strides[-1] == as_expr(0):          # broadcast along the vector: one scalar
                    lines.append(f"{ind}const {_KIND_C[kk]} lum_s{j} = {self.load(k, v, idx)};")
                    args.append((f"lum_s{j}", kk))
                    continue
                phys, valid = view_access(self.ctx, v, idx)
                vt = f"lum_vec<{STORAGE_C[dt]}, {vec}>"
                ld = f"*reinterpret_cast<const {vt}*>(in{k} + ({phys}))"
                if valid == "false":
                    ld = f"{vt}{{}}"
                elif valid:
                    ld = f"(({valid}) ? {ld} : {vt}{{}})"
                lines.append(f"{ind}const {vt} lum_v{j} = {ld};")
                args.append((_load_conv(dt, f"lum_v{j}.v[lum_k]"), kk))
            ot = f"lum_vec<{STORAGE_C[self.op.dtype]}, {vec}>"
            lines.append(f"{ind}{ot} lum_o;")
            lines.append(f"{ind}#pragma unroll")
            lines.append(f"{ind}for (int lum_k = 0; lum_k < {vec}; ++lum_k) {{")
            named = []
            for j, (c_expr, kk) in enumerate(args):
                lines.append(f"{ind}  const {_KIND_C[kk]} lum_a{j} = {c_expr};")
                named.append((f"lum_a{j}", kk))
            expr, kind = self._apply(op_name, named, lines, ind + "  ")
            lines.append(f"{ind}  lum_o.v[lum_k] = {_store_conv(kind, expr, self.op.dtype)};")
            lines.append(f"{ind}}}")
            dest = "lum_w * " + str(vec) if contiguous_out else view_access(self.ctx, wview, idx)[0]
            lines.append(f"{ind}*reinterpret_cast<{ot}*>(out + ({dest})) = lum_o;")
        body = "\n".join(ln for ln in lines if ln)
        return body, items, {"vec": vec, "ept": ept}, self.threads * ept

    def _apply(self, op_name: str, args: list[tuple[str, str]], lines: list[str], ind: str,
               round_root: bool = False) -> tuple[str, str]:
        """(C expression, kind) of the op on loaded (C name, kind) args; for Fused, of ``params["expr"]``,
        whose inner nodes become locals rounded to their dtype (a repeated subtree is computed once), the
        root too with ``round_root`` (a reduce's prologue: no store rounds it)."""
        if op_name != "Fused":
            return _compute(op_name, args, self.math)
        return self._tree(self.op.params["expr"], {}, lines, ind, round_root,
                          lambda t, key: args[t[1]] if t[0] == "arg" else None)

    def _tree(self, t: list, names: dict[str, tuple[str, str]], lines: list[str], ind: str, round_root: bool,
              leaf: Callable[[list, str], tuple[str, str] | None]) -> tuple[str, str]:
        """(C expression, kind) of a Fused tree: ``leaf(node, key)`` gives the value of a node it knows (the
        args; a row kernel's loaded leaves and row values), every other inner node becomes a local
        ``lum_u<k>`` rounded through its storage type (a repeated subtree is computed once), the root too
        with ``round_root``. ``names`` holds the locals so far (``leaf`` may add its own to it)."""
        def node(t: list, root: bool = False) -> tuple[str, str]:
            key = repr(t)
            known = leaf(t, key)
            if known is not None:
                return known
            if key in names:
                return names[key]
            expr, kind = _compute(t[0], [node(k) for k in t[2:]], self.math)
            if root and not round_root:
                return expr, kind
            dt = DType.parse(t[1])
            names[key] = (f"lum_u{len(names)}", _kind(dt))
            val = _to_kind(kind, _kind(dt), expr) if dt in (DType.i64, DType.bool) else \
                _load_conv(dt, _store_conv(kind, expr, dt))           # round through the storage type
            lines.append(f"{ind}const {_KIND_C[_kind(dt)]} {names[key][0]} = {val};")
            return names[key]

        return node(t, True)

    def _pick_vec(self, shape: tuple[Expr, ...], views: list[ShapeTracker], dts: list[DType]) -> int:
        if self.vec is not None and self.vec not in (1, 2, 4, 8):
            raise CodegenError(f"vec must be 1, 2, 4 or 8, got {self.vec}")
        if self.vec == 1 or not shape:
            return 1
        last = shape[-1]
        # itemsizes of the views read/written contiguously along the vector
        sizes = [dt.itemsize for v, dt in zip(views, dts) if v.strides[-1] == as_expr(1)]
        if views[0].strides[-1] != as_expr(1):
            return 1
        for v in views:
            if v.strides[-1] not in (as_expr(0), as_expr(1)) or not _mask_trivial(v, v.ndim - 1):
                return 1
        cands = [self.vec] if self.vec is not None else [8, 4, 2]
        for w in cands:
            if last % w != as_expr(0) or w * max(sizes) > 16:
                continue
            aligned = True
            for v in views:
                if v.strides[-1] != as_expr(1):
                    continue
                for e in (v.offset, *v.strides[:-1]):
                    if e % w != as_expr(0):
                        aligned = False
            if aligned:
                return w
        return 1

    def k_elementwise(self):
        op = self.op
        if op.op == "Fused":
            try:
                check_expr(op.params.get("expr"), len(op.args), op.dtype)
            except ValueError as e:
                raise CodegenError(str(e)) from None
            if has_row_ops(op.params["expr"]):
                return self.k_row()
        elif op.op not in ELEMENTWISE_ARITY:
            raise CodegenError(f"unknown elementwise op {op.op!r}")
        elif len(op.args) != ELEMENTWISE_ARITY[op.op]:
            raise CodegenError(f"{op.op} takes {ELEMENTWISE_ARITY[op.op]} argument(s), got {len(op.args)}")
        shape = self.out_shape()
        write = self.write_view()
        body, items, tun, tile = self._elementwise_body(op.op, range(len(op.args)), shape, write,
                                                        self.alias() is None)
        src = render(load_template("elementwise.cu"),
                     {**self.common_values(tun["ept"]), "NUM_ITEMS": self.ctx.c(items), "BODY": body})
        tuning = {"threads": self.threads, **tun, "max_blocks": self.max_blocks, "math": self.math}
        return [src], [("", self.grid(items, tile), (self.threads, 1, 1))], tuning, self.max_blocks * tile

    # ------------------------------------------------------------------ iota
    def k_iota(self):
        op = self.op
        if len(op.args) != 0 or len(op.shape) != 1:
            raise CodegenError("iota takes no arguments and has a 1-D shape")
        n = as_expr(op.params.get("n", op.shape[0]))
        self.ctx.c(n)
        src = render(load_template("iota.cu"), {
            "KERNEL": _ENTRY, "THREADS": self.threads, "IDX_T": "@IDX_T@", "PARAMS": self.params_c(),
            "DYN_LOADS": "@DYN_LOADS@", "N": self.ctx.c(n),
            "STORE": f"out[lum_w] = {_store_conv('i', 'lum_v', op.dtype)};"})
        tuning = {"threads": self.threads, "max_blocks": self.max_blocks}
        return [src], [("", self.grid(n, self.threads), (self.threads, 1, 1))], tuning, self.max_blocks * self.threads

    # ------------------------------------------------------------------ reduce
    def k_reduce(self):
        op = self.op
        if op.op not in ("Sum", "Max"):
            raise CodegenError(f"unknown reduce op {op.op!r}; expected Sum or Max")
        expr = op.params.get("expr")     # a fused prologue: reduce this tree over the args
        if expr is None and len(op.args) != 1:
            raise CodegenError("reduce takes one argument (several only with a fused prologue, params expr)")
        if expr is not None:
            try:
                check_expr(expr, len(op.args), None, f"reduce {op.op}")
            except ValueError as e:
                raise CodegenError(str(e)) from None
            if has_row_ops(expr):
                return self.k_row()
        inv = op.args[0].view
        axis = op.params.get("axis")
        if isinstance(axis, bool) or not isinstance(axis, int) or not -inv.ndim <= axis < inv.ndim:
            raise CodegenError(f"reduce axis {axis!r} out of range for {inv.ndim} dims")
        axis %= inv.ndim
        for k, a in enumerate(op.args):
            if tuple(a.view.shape) != tuple(inv.shape):
                raise CodegenError(f"argument {k}'s view has shape {[str(x) for x in a.view.shape]}, argument "
                                   f"0's {[str(x) for x in inv.shape]}")
        shape = self.out_shape()
        rest = [k for k in range(inv.ndim) if k != axis]
        if tuple(inv.shape[k] for k in rest) != shape:
            raise CodegenError("the reduced input's shape without the axis differs from the op's shape")
        red = inv.shape[axis]

        def split(v: ShapeTracker) -> tuple[ShapeTracker, ShapeTracker]:
            """A view as (its row part: the other dims, its axis part: a 1-D view from offset 0)."""
            m = v.mask
            return (ShapeTracker(shape, tuple(v.strides[k] for k in rest), v.offset,
                                 None if m is None else tuple(m[k] for k in rest)),
                    ShapeTracker((red,), (v.strides[axis],), as_expr(0), None if m is None else (m[axis],)))

        splits = [split(a.view) for a in op.args]
        write = self.write_view()
        cshape, (wview, *rviews) = coalesce(shape, [write] + [r for r, _ in splits])
        rows = numel(cshape)
        dt_in = self.dts[0] if expr is None else DType.parse(expr[1])   # the values reduced
        acc_kind = ("d" if self.acc == "f64" else "f") if dt_in.is_float else "i"
        acc_t = _KIND_C[acc_kind]
        # group: threads per output row
        group = self.group
        if group is None:
            bounds = self.ctx._dyn_bounds()
            rows_hi, red_hi = rows.bounds(bounds)[1], red.bounds(bounds)[1]
            if any(ax.strides[0] == as_expr(1) for _, ax in splits):
                # a warp per row fills the GPU only with many rows; few long rows (RMSNorm's one row of
                # 2,560) get wider groups, about 8 elements per thread, or one warp's loop is
                # latency-bound (measured: 15 us for a single row)
                group = 32 if rows_hi >= 4096 and red_hi <= 4096 else max(32, pow2_floor(max(1, red_hi // 8)))
            else:
                group = 1 if rows_hi >= 1024 else 32
            group = min(group, self.threads)
        if group < 1 or group > self.threads or group & (group - 1):
            raise CodegenError(f"group must be a power of two in [1, threads], got {group}")
        ind, ind2 = " " * 6, " " * 10
        ctx = self.ctx
        idx = index_vars(len(cshape))
        lum_r = Var("lum_r")
        setup = [_unravel(ctx, "lum_row", cshape, ind).rstrip("\n")]
        ctx.bound_var("lum_r", red)
        for rv, (_, ax) in zip(rviews, splits):   # the full physical indices, for the index-width decision
            ctx.exprs.append(rv.physical_index(idx) + lum_r * ax.strides[0])
        fixup = ""
        if expr is None:
            ax_mask = None if inv.mask is None or _mask_trivial(inv, axis) else inv.mask[axis]
            base, valid = view_access(ctx, rviews[0], idx)
            setup.append(f"{ind}const bool lum_valid = {valid or 'true'};")
            setup.append(f"{ind}const idx_t lum_base = {base};")
            setup.append(f"{ind}const idx_t lum_rstride = {ctx.c(inv.strides[axis])};")
            if ax_mask is None:
                setup.append(f"{ind}const idx_t lum_rlo = 0;")
                setup.append(f"{ind}const idx_t lum_rhi = lum_red;")
            else:
                setup.append(f"{ind}const idx_t lum_rlo = lum_max((idx_t)0, (idx_t)({ctx.c(ax_mask[0])}));")
                setup.append(f"{ind}const idx_t lum_rhi = lum_min(lum_red, (idx_t)({ctx.c(ax_mask[1])}));")
            load = [f"{ind2}const idx_t lum_p = lum_base + lum_r * lum_rstride;",
                    f"{ind2}const {_KIND_C[_kind(dt_in)]} lum_x = {_load_conv(dt_in, 'in0[lum_p]')};"]
            if op.op == "Max" and inv.mask is not None:
                fixup = (f"{ind}  if (lum_red > 0 && (!lum_valid || lum_rlo > 0 || lum_rhi < lum_red)) "
                         f"lum_acc = LumMax::apply(lum_acc, (acc_t)0);")
        else:
            # the reduced input itself is unpadded: visit the whole axis; each leaf reads 0 where padded
            setup += [f"{ind}const bool lum_valid = true;", f"{ind}const idx_t lum_rlo = 0;",
                      f"{ind}const idx_t lum_rhi = lum_red;"]
            load, leaves = [], []
            for k, (rv, (_, ax)) in enumerate(zip(rviews, splits)):
                base, valid = view_access(ctx, rv, idx)
                setup.append(f"{ind}const idx_t lum_b{k} = {base}; (void)lum_b{k};")
                if valid:
                    setup.append(f"{ind}const bool lum_v{k} = {valid};")
                kind = _kind(self.dts[k])
                val = self.load(k, ax, (lum_r,), base=f"lum_b{k}", guard=f"lum_v{k}" if valid else None)
                load.append(f"{ind2}const {_KIND_C[kind]} lum_a{k} = {val};")
                leaves.append((f"lum_a{k}", kind))
            x, kind = self._apply("Fused", leaves, load, ind2, round_root=True)
            load.append(f"{ind2}const {_KIND_C[kind]} lum_x = {x};")
        if op.op == "Sum":
            identity = "(acc_t)0"
        else:
            identity = ("(acc_t)(-LUM_INF_F32)" if acc_kind in ("f", "d") else
                        "(acc_t)0" if dt_in == DType.bool else "LUM_LLONG_MIN")
        if self.alias() is None:
            dest = "lum_row"
        else:
            dest, _ = view_access(ctx, wview, idx)
        store = f"{ind}  out[{dest}] = {_store_conv(acc_kind, 'lum_acc', op.dtype)};"
        src = render(load_template("reduce.cu"), {
            "KERNEL": _ENTRY, "THREADS": self.threads, "GROUP": group, "IDX_T": "@IDX_T@",
            "PARAMS": self.params_c(), "DYN_LOADS": "@DYN_LOADS@", "ACC_T": acc_t, "OP": f"Lum{op.op}",
            "IDENTITY": identity, "ROWS": ctx.c(rows), "RED": ctx.c(red), "ROW_SETUP": "\n".join(s for s in setup if s),
            "LOAD": "\n".join(load), "PAD_FIXUP": fixup or f"{ind}  (void)0;", "STORE": store})
        per_block = self.threads // group
        tuning = {"threads": self.threads, "group": group, "max_blocks": self.max_blocks, "acc": self.acc}
        return [src], [("", self.grid(rows, per_block), (self.threads, 1, 1))], tuning, self.max_blocks * per_block

    # ------------------------------------------------------------------ row kernels
    def _row_group(self, rows: Expr, n: Expr) -> int:
        """Threads per row: a warp when there are many rows (fewer for rows shorter than a warp at most:
        flash attention's combine of one chunk, a row of one element a thread); else, for a static row
        length, enough that the row fits in registers (:data:`ROW_REGS` per lane), or about four elements
        per thread (one block per row of RMSNorm's 2,560: few long rows are latency-bound in one warp)."""
        if self.group is not None:
            return self.group
        bounds = self.ctx._dyn_bounds()
        rows_hi, n_hi = rows.bounds(bounds)[1], n.bounds(bounds)[1]
        n_hi = 4096 if n_hi == INF else n_hi
        if rows_hi >= 1024:
            return 32 if n_hi >= 32 else pow2ceil(max(1, int(n_hi)))
        if n.is_const:                   # the row in registers: at most ROW_REGS elements per lane
            return max(32, min(1024, pow2ceil(-(-n.value // ROW_REGS))))
        return max(32, min(1024, pow2_floor(max(1, int(n_hi) // 4))))

    def _row_threads(self, rows: Expr, group: int) -> int:
        """Threads per block of a row kernel: a whole row group of at least 256 threads, else as many
        rows as spread them over every SM, at most 256 threads' worth. A block of 256 would hold all of
        decode's 8 query-head rows (gemma's q norm and RoPE) and run them on one SM: measured 5.6 µs,
        against 2.3 + 2.3 µs for the norm and an elementwise RoPE spread over 8 blocks (de0e5f3)."""
        if group >= 256:
            return min(1024, group)
        rows_hi = rows.bounds(self.ctx._dyn_bounds())[1]
        per_block = 256 // group if rows_hi == INF else min(256 // group, pow2_floor(max(1, int(rows_hi) // SMS)))
        return max(32, group * per_block)            # a warp at least (rows shorter than a warp take fewer threads)

    def k_row(self):
        """An elementwise Fused op whose tree has row reductions, a reduce over the last axis whose prologue
        has them, or a scatter whose fused prologue has them: one kernel per row (templates/row.cu)."""
        src, grid, threads, margin, tuning = self._row_kernel()
        return [src], [("", grid, (threads, 1, 1))], tuning, margin

    def _row_kernel(self) -> tuple[str, tuple[Expr, Expr, Expr], int, int, dict[str, Any]]:
        """The row kernel's source, grid, threads, index margin and tuning (see :meth:`k_row`)."""
        rp = self._row_parts()
        src = render(load_template("row.cu"), {
            "KERNEL": _ENTRY, "THREADS": rp.threads, "GROUP": rp.group, "IDX_T": "@IDX_T@", "PARAMS": self.params_c(),
            "DYN_LOADS": "@DYN_LOADS@", "ACC_T": _KIND_C[rp.acc_kind],
            "ROWS": self.ctx.c(rp.rows), "N": self.ctx.c(rp.n),
            "ROW_SETUP": rp.setup, "PHASES": rp.phases, "FINAL": rp.final})
        per_block = rp.threads // rp.group
        tuning = {"threads": rp.threads, "group": rp.group, "max_blocks": self.max_blocks, "acc": self.acc,
                  "math": self.math, "scheme": "row", "regs": rp.regs}
        return src, self.grid(rp.rows, per_block), rp.threads, self.max_blocks * per_block, tuning

    def _row_parts(self, sink: str | None = None, writer: str | None = None, sink_stored: bool = False) -> _RowParts:
        """The row loop's pieces (templates/row.cu's placeholders) for this op. ``sink``: an elementwise op
        stores each element, as a float of the op's dtype (``sink_stored``: as the dtype's storage), into that
        C array (a gemm prologue's shared memory) at the element's physical index in ``out``, instead of into
        ``out``. ``writer``: a C condition on the scatter's dest row ``lum_dr`` a row must also meet to be
        written (an attention stage writes a kv row from the one block that reads it)."""
        op = self.op
        expr = op.params["expr"]
        kind = "scatter" if op.kind in ("scatter", "scatter_nocopy") else op.kind
        first, last = (1, len(op.args) - 1) if kind == "scatter" else (0, len(op.args))   # the leaves
        if kind == "scatter":
            self._check_index_dtype(last)
            iv, shape = op.args[last].view, self.out_shape()
            dom = tuple(iv.shape) + tuple(shape[1:])
            if len(shape) < 2 or tuple(op.args[0].view.shape) != shape:
                raise CodegenError("a scatter with row reductions needs a dest of >= 2 dims viewed in the op's shape")
        else:
            dom = tuple(as_expr(d) for d in (op.args[0].view.shape if kind == "reduce" else op.shape))
        if not dom:
            raise CodegenError("row reductions need a loop domain of at least one dim")
        for k in range(first, last):
            if tuple(op.args[k].view.shape) != dom:
                raise CodegenError(f"argument {k}'s view has shape {[str(x) for x in op.args[k].view.shape]}, "
                                   f"the loop domain {[str(x) for x in dom]}")
        n, rshape = dom[-1], dom[:-1]
        if kind == "reduce":
            try:
                check_row_reduce(op, f"reduce {op.op}")
            except ValueError as e:
                raise CodegenError(str(e)) from None
            if self.out_shape() != rshape:
                raise CodegenError("the reduced input's shape without the last axis differs from the op's shape")
            if not DType.parse(expr[1]).is_float:
                raise CodegenError("a reduce with row reductions in its prologue must reduce float values")

        def split(v: ShapeTracker) -> tuple[ShapeTracker, ShapeTracker]:
            """A view over the domain as (its row part over rshape, its 1-D column part from offset 0)."""
            m = v.mask
            return (ShapeTracker(rshape, v.strides[:-1], v.offset, None if m is None else m[:-1]),
                    ShapeTracker((n,), (v.strides[-1],), as_expr(0), None if m is None else (m[-1],)))

        splits = {k: split(op.args[k].view) for k in range(first, last)}
        write = self.write_view()
        extra: list[ShapeTracker] = []           # row parts of the write (and a scatter's index) views
        if kind == "reduce":
            extra, wcol = [write], None
        elif kind == "scatter":
            lead = tuple(op.args[last].view.shape)
            irow, _ = split(self._ext_index_view(op.args[last].view, shape[1:]))
            wrow, wcol = split(self._ext_row_view(write, lead))
            extra = [wrow, irow]
        else:
            wrow, wcol = split(write)
            extra = [wrow]
        cshape, cviews = coalesce(rshape, extra + [splits[k][0] for k in range(first, last)])
        crows = dict(zip(range(first, last), cviews[len(extra):]))
        rows = numel(cshape)
        group = self._row_group(rows, n)
        threads = self.threads if self.threads_given else self._row_threads(rows, group)
        group = min(group, threads)
        whole = group == threads and group % 32 == 0      # the block as one group (lum_group_reduce: any warps)
        if group < 1 or group > threads or (group & (group - 1) and not whole):
            raise CodegenError(f"group must be a power of two in [1, threads], or the whole block, got {group}")
        acc_kind = "d" if self.acc == "f64" else "f"
        ctx = self.ctx
        ind, ind3 = " " * 4, " " * 8
        idx = index_vars(len(cshape))
        col = Var("lum_c")
        setup = [_unravel(ctx, "lum_row", cshape, ind).rstrip("\n")]
        ctx.bound_var("lum_c", n)
        guards: dict[int, str | None] = {}
        for k, rv in crows.items():
            ctx.exprs.append(rv.physical_index(idx) + col * splits[k][1].strides[0])   # for the index width
            base, valid = view_access(ctx, rv, idx)
            setup.append(f"{ind}const idx_t lum_b{k} = {base}; (void)lum_b{k};")
            if valid:
                setup.append(f"{ind}const bool lum_v{k} = {valid};")
            guards[k] = f"lum_v{k}" if valid else None
        # a static row of at most ROW_REGS elements per lane is loaded once, into registers; every phase then
        # reads registers (one round of memory latency per row instead of one per phase). (A dynamic row sized
        # by its bound, decode attention's combine, measured +0.05% / +0.28% and was removed, 0858e76.)
        per_lane = -(-n.value // group) if n.is_const and n.value > 0 else 0
        regs = per_lane if self.row_regs and per_lane <= ROW_REGS else 0
        scalars: set[int] = set()                # leaves with one value a row: loaded once, not once a slot
        if regs:
            loop = [f"{ind}#pragma unroll", f"{ind}  for (int lum_kk = 0; lum_kk < {regs}; ++lum_kk) {{",
                    f"{ind}  const idx_t lum_c = lum_lane + (idx_t)lum_kk * GROUP;", f"{ind}  if (lum_c < lum_n) {{"]
            close = [f"{ind}  }}}}", f"{ind}}}"]
            for k in crows:
                kd = _kind(self.dts[k])
                val = self.load(k, splits[k][1], (col,), base=f"lum_b{k}", guard=guards[k])
                col_view = splits[k][1]
                if (guards[k] is None and col_view.mask is None and as_expr(col_view.strides[0]) == as_expr(0)
                        and "lum_c" not in val):  # one value for the whole row (a broadcast scalar)
                    setup.append(f"{ind}const {_KIND_C[kd]} lum_a{k} = lum_live ? {val} : {_ZERO[kd]};")
                    scalars.add(k)
                    continue
                setup += [f"{ind}{_KIND_C[kd]} lum_a{k}[{regs}];", f"{ind}#pragma unroll",
                          f"{ind}for (int lum_kk = 0; lum_kk < {regs}; ++lum_kk) {{",
                          f"{ind}  const idx_t lum_c = lum_lane + (idx_t)lum_kk * GROUP;",
                          f"{ind}  lum_a{k}[lum_kk] = (lum_live && lum_c < lum_n) ? {val} : {_ZERO[kd]};", f"{ind}}}"]
        else:
            loop = [f"{ind}#pragma unroll 4", f"{ind}  for (idx_t lum_c = lum_lane; lum_c < lum_n; lum_c += GROUP) {{"]
            close = [f"{ind}  }}", f"{ind}}}"]
        rownames: dict[str, tuple[str, str]] = {}

        def emit(t: list, lines: list[str], round_root: bool) -> tuple[str, str]:
            """C lines computing tree ``t`` at column lum_c (leaves loaded on first use); its (value, kind)."""
            names: dict[str, tuple[str, str]] = {}

            def leaf(t: list, key: str) -> tuple[str, str] | None:
                if key in rownames:                  # a row value of an earlier phase
                    return rownames[key]
                if t[0] in ROW_OPS:
                    raise CodegenError("internal: a row reduction used before its phase")  # pragma: no cover
                if t[0] != "arg":
                    return None
                if key in names:
                    return names[key]
                k = first + t[1]
                kd = _kind(self.dts[k])
                if regs:
                    return (f"lum_a{k}", kd) if k in scalars else (f"lum_a{k}[lum_kk]", kd)
                val = self.load(k, splits[k][1], (col,), base=f"lum_b{k}", guard=guards[k])
                names[key] = (f"lum_a{k}", kd)
                lines.append(f"{ind3}const {_KIND_C[kd]} lum_a{k} = {val};")
                return names[key]

            return self._tree(t, names, lines, ind3, round_root, leaf)

        def accumulate(j: int, red: str, t: list) -> list[str]:
            """A phase: lum_r<j> = the group's Sum / Max of tree ``t`` over the row, in every lane."""
            lines = [f"{ind}acc_t lum_r{j} = {self._row_identity(red)};", f"{ind}if (lum_live) {{", *loop]
            x, _ = emit(t, lines, True)
            lines += [f"{ind3}lum_r{j} = Lum{red}::apply(lum_r{j}, (acc_t)({x}));", *close,
                      f"{ind}lum_r{j} = lum_group_reduce<Lum{red}, GROUP>(lum_r{j}, lum_smem);"]
            return lines

        order: list[list] = []
        seen: set[str] = set()

        def collect(t: list) -> None:
            if t[0] == "arg":
                return
            for x in t[2:]:
                collect(x)
            if t[0] in ROW_OPS and repr(t) not in seen:
                seen.add(repr(t))
                order.append(t)

        collect(expr)
        phases: list[str] = []
        for j, t in enumerate(order):
            dt = DType.parse(t[1])
            if not dt.is_float:
                raise CodegenError(f"{t[0]} of {dt}: row reductions are generated for float dtypes only")
            phases += accumulate(j, ROW_OPS[t[0]], t[2])
            phases.append(f"{ind}const float lum_rv{j} = {_load_conv(dt, _store_conv(acc_kind, f'lum_r{j}', dt))};")
            rownames[repr(t)] = (f"lum_rv{j}", "f")
        wbase, _ = view_access(ctx, cviews[0], idx)
        if kind == "reduce":
            j = len(order)
            final = accumulate(j, op.op, expr)
            final += [f"{ind}if (lum_live && lum_lane == 0) out[{wbase}] = "
                      f"{_store_conv(acc_kind, f'lum_r{j}', op.dtype)};"]
        else:
            cond = "lum_live"
            dest = f"({wbase}) + lum_c * ({ctx.c(wcol.strides[0])})"
            ctx.exprs.append(cviews[0].physical_index(idx) + col * wcol.strides[0])
            final = []
            if kind == "scatter":            # the row lands at dest row idx[j..] (rows outside write nothing)
                ctx.bound_var("lum_row", shape[0])
                final.append(f"{ind}const long long lum_dr = lum_live ? "
                             f"(long long)({self.load(last, cviews[1], idx)}) : -1LL;")
                cond = f"lum_dr >= 0 && lum_dr < (long long)({ctx.c(shape[0])})"
                if writer is not None:
                    cond = f"{cond} && ({writer})"
                dest = f"({wbase}) + (idx_t)lum_dr * ({ctx.c(write.strides[0])}) + lum_c * ({ctx.c(wcol.strides[0])})"
                ctx.exprs.append(Var("lum_row") * write.strides[0] + cviews[0].physical_index(idx)
                                 + col * wcol.strides[0])
            final += [f"{ind}if ({cond}) {{", *loop]
            x, kd = emit(expr, final, kind == "scatter")
            if sink is None:
                final.append(f"{ind3}out[{dest}] = {_store_conv(kd, x, op.dtype)};")
            else:
                stored = _store_conv(kd, x, op.dtype)
                final.append(f"{ind3}{sink}[{dest}] = {stored if sink_stored else _load_conv(op.dtype, stored)};")
            final += close
        return _RowParts("\n".join(x for x in setup if x), "\n".join(phases), "\n".join(final), rows, n,
                         group, threads, regs, acc_kind, tuple(cshape),
                         cviews[0], None if wcol is None else wcol.strides[0],
                         write.strides[0] if kind == "scatter" else None)

    @staticmethod
    def _row_identity(red: str) -> str:
        return "(acc_t)0" if red == "Sum" else "(acc_t)(-LUM_INF_F32)"

    # ------------------------------------------------------------------ attention (decode, split-K)
    def k_attention(self):
        """The per-chunk partials of attention (semantics in format/llir.py): decode's split-K kernel
        (templates/attention.cu), or flash attention where many query rows share a K / V row
        (:func:`~lum.builder.attention_policy.flash_attention`: :meth:`_flash_attention`)."""
        op, ctx = self.op, self.ctx
        try:
            check_attention(op, "attention")
            r, t, d, dv = attention_dims(op)
        except ValueError as e:
            raise CodegenError(str(e)) from None
        vq, vk, vv, vm = (a.view for a in op.args)
        if any(x.mask is not None for x in (vq, vk, vv)):
            raise CodegenError("attention reads q, k and v unpadded")
        if not (d.is_const and dv.is_const):
            raise CodegenError("attention needs static feature sizes")
        if any(not self.dts[k].is_float for k in range(3)) or self.dts[3] != DType.bool:
            raise CodegenError("attention reads float q, k, v and a bool mask")
        if flash_attention(op):
            return self._flash_attention()
        zero, nr = as_expr(0), len(r)
        group, heads = attention_row_dims(op)
        m_size = 1
        for i in group:
            if not r[i].is_const:
                raise CodegenError("the query rows sharing a K / V row must be a static number")
            m_size *= r[i].value
        if m_size > ATTENTION_MAX_GROUP:
            raise CodegenError(f"{m_size} query rows share a K / V row; at most {ATTENTION_MAX_GROUP} fit one "
                               "attention block")
        unroll = 4 if self.unroll is None else self.unroll
        if not 1 <= unroll <= 16:
            raise CodegenError(f"unroll must be in [1, 16], got {unroll}")
        D, DV = d.value, dv.value
        dpl, vpl = -(-D // 32), -(-DV // 32)
        chunk = int(op.params["chunk"])
        ns = cdiv(t, chunk)
        ind, ind4 = " " * 4, " " * 8
        # row indices: the kv-row dims from lum_h, the group dims from the unrolled query row lum_m
        hshape = tuple(r[i] for i in heads)
        setup = [_unravel(ctx, "lum_h", hshape, ind).rstrip("\n")]
        idx: list[Expr] = [as_expr(0)] * nr
        for pos, i in enumerate(heads):
            idx[i] = Var(f"lum_i{pos}")
        lum_m, rest = Var("lum_m"), 1
        for i in reversed(group):
            idx[i] = (lum_m // rest) % r[i] if r[i].value > 1 else as_expr(0)
            rest *= r[i].value
        ctx.var_bounds["lum_m"] = (0, m_size - 1)
        lum_t, lum_d = Var("lum_t"), Var("lum_d")
        ctx.bound_var("lum_t", t + chunk)
        ctx.bound_var("lum_d", as_expr(max(D, DV)))
        kv_idx = [as_expr(0) if i in group else idx[i] for i in range(nr)]
        setup.append(f"{ind}const idx_t lum_kb = {ctx.c(vk.physical_index(tuple(kv_idx) + (zero, zero)))};")
        setup.append(f"{ind}const idx_t lum_vb = {ctx.c(vv.physical_index(tuple(kv_idx) + (zero, zero)))};")
        ctx.exprs += [x.physical_index(tuple(kv_idx) + (lum_t, lum_d)) for x in (vk, vv)]
        # q: lane slice of every query row, as float
        qd = vq.strides[-1]
        load_q = [f"{ind}#pragma unroll", f"{ind}for (int lum_m = 0; lum_m < M; ++lum_m) {{",
                  f"{ind}  const idx_t lum_qb = {ctx.c(vq.physical_index(tuple(idx) + (zero,)))};",
                  f"{ind}#pragma unroll", f"{ind}  for (int i = 0; i < DPL; ++i) {{",
                  f"{ind}    const int lum_d = lum_lane * DPL + i;",
                  f"{ind}    lum_q[lum_m][i] = lum_d < {D} ? "
                  f"{_load_conv(self.dts[0], f'in0[lum_qb + (idx_t)lum_d * ({ctx.c(qd)})]')} : 0.0f;",
                  f"{ind}  }}", f"{ind}}}"]
        ctx.exprs.append(vq.physical_index(tuple(idx) + (lum_d,)))
        heads_n = numel(hshape)
        stage = self._attention_stage(m_size, D, qd, heads_n)
        if self.stage is not None:             # the query rows the stage computed into shared memory
            load_q = [*load_q[:2], *load_q[3:6], f"{ind}    lum_q[lum_m][i] = lum_d < {D} ? lum_qs[lum_m][lum_d] : 0.0f;",
                      *load_q[-2:]]

        def row_load(k: int, view: ShapeTracker, width: int, per_lane: int, dest: str, base: str) -> list[str]:
            """Lane slice of row lum_t of k / v into dest[u][i]: one vector access when the features are
            contiguous and aligned, else one guarded load per feature; zeros past the chunk."""
            dt, st, sd = self.dts[k], view.strides[-2], view.strides[-1]
            vec_ok = (sd == as_expr(1) and width % 32 == 0 and per_lane * dt.itemsize <= 16
                      and all(e % per_lane == zero for e in (view.offset, *view.strides[:-1])))
            src = f"in{k} + {base} + lum_t * ({ctx.c(st)})"
            if vec_ok:
                cvt = f"[](const {STORAGE_C[dt]} x) {{ return {_load_conv(dt, 'x')}; }}"
                return [f"{ind4}if (lum_in) lum_load_f32<{per_lane}>({src} + lum_lane * {per_lane}, {dest}[u], {cvt});",
                        f"{ind4}else {{", f"{ind4}#pragma unroll",
                        f"{ind4}  for (int i = 0; i < {per_lane}; ++i) {dest}[u][i] = 0.0f;", f"{ind4}}}"]
            return [f"{ind4}#pragma unroll", f"{ind4}for (int i = 0; i < {per_lane}; ++i) {{",
                    f"{ind4}  const int lum_d = lum_lane * {per_lane} + i;",
                    f"{ind4}  {dest}[u][i] = (lum_in && lum_d < {width}) ? "
                    f"{_load_conv(dt, f'({src})[(idx_t)lum_d * ({ctx.c(sd)})]')} : 0.0f;",
                    f"{ind4}}}"]

        load_kv = row_load(1, vk, D, dpl, "lum_k", "lum_kb") + row_load(2, vv, DV, vpl, "lum_v", "lum_vb")
        mphys, mvalid = view_access(ctx, vm, tuple(idx) + (lum_t,))
        mval = _load_conv(DType.bool, f"in3[{mphys}]")
        mval = "false" if mvalid == "false" else f"(({mvalid}) && {mval})" if mvalid else mval
        p_dt = DType.parse(op.params["p_dtype"])
        rnd = "lum_e" if p_dt == DType.f32 else _load_conv(p_dt, _store_conv("f", "lum_e", p_dt))
        scale = float(op.params["scale"])
        logit = f"(lum_s * {_f32_literal(scale)}) * {_f32_literal(1.4426950408889634)}"
        key, keys_before, keys_after = self._attention_key_batch(ind4, mval, logit, rnd)
        out_idx = ShapeTracker.contiguous(op.shape).physical_index(tuple(idx) + (Var("lum_j"), zero))
        ctx.bound_var("lum_j", ns)
        ctx.exprs.append(ShapeTracker.contiguous(op.shape).physical_index(tuple(idx) + (Var("lum_j"), as_expr(DV + 2))))
        # the warps' partials of all M query rows merged after one barrier pair where they and the stage's rows
        # fit in ATTENTION_MERGE_SMEM (of the 48 KB of static shared memory a block has), else a row at a time
        # (a row at a time, two barriers each, measured even: benchmarks/NOTES.md)
        other = 4 * 32 * m_size * dpl if self.stage is not None else 0
        fits = other + 4 * m_size * (self.threads // 32) * (vpl * 32 + 2) <= ATTENTION_MERGE_SMEM
        merge_rows = m_size if fits else 1
        src = render(load_template("attention.cu"), {**stage,
            "KERNEL": _ENTRY, "THREADS": self.threads, "IDX_T": "@IDX_T@", "PARAMS": self.params_c(),
            "DYN_LOADS": "@DYN_LOADS@", "M": m_size, "DPL": dpl, "VPL": vpl, "DV": DV, "UNROLL": unroll,
            "MERGE_ROWS": merge_rows,
            "CHUNK": chunk, "T": ctx.c(t), "NS": ctx.c(ns), "HEADS": ctx.c(heads_n),
            "SETUP": "\n".join(x for x in setup if x), "LOAD_Q": "\n".join(load_q), "LOAD_KV": "\n".join(load_kv),
            "KEY": "\n".join(key), "KEYS_BEFORE": keys_before, "KEYS_AFTER": keys_after, "STORE": ctx.c(out_idx)})
        tuning = {"threads": self.threads, "unroll": unroll, "max_blocks": self.max_blocks, "group_rows": m_size,
                  "merge_rows": merge_rows}
        return [src], [("", self.grid(heads_n * ns, 1), (self.threads, 1, 1))], tuning, self.max_blocks

    def _flash_attention(self):
        """templates/flash_attention.cu: a block per (tile of 16 * warps query rows, kv row, chunk), key tiles
        of ``tile_keys`` staged in shared memory, S and O in mma.m16n8k16's accumulator layout; tensor cores
        where q, k, v and the probabilities are all bf16 or all f16, FMAs otherwise (f32 models)."""
        op, ctx = self.op, self.ctx
        if self.stage is not None:
            raise CodegenError("a flash attention kernel runs no attention stage")
        r, t, d, dv = attention_dims(op)
        if not flash_features_fit(d, dv):
            raise CodegenError(f"flash attention takes features that are multiples of 16 up to {FLASH_MAX_D}, "
                               f"not q·k {d} and v {dv}")
        vq, vk, vv, vm = (a.view for a in op.args)
        if vm.mask is not None:
            raise CodegenError("flash attention reads an unpadded mask")
        D, DV = d.value, dv.value
        p_dt = DType.parse(op.params["p_dtype"])
        dq, dk, dvt = self.dts[:3]
        mma = dq == dk == dvt == p_dt and p_dt in (DType.bf16, DType.f16)
        bc = self.tile_keys if self.tile_keys is not None else 64 if mma else 32
        if bc not in FLASH_TILE_KEYS:
            raise CodegenError(f"tile_keys must be one of {FLASH_TILE_KEYS}, got {bc}")
        warps = self.threads // 32
        br = 16 * warps
        smem = sum(rows * (width + 16 // dt.itemsize) * dt.itemsize
                   for rows, width, dt in ((br, D, dq), (bc, D, dk), (bc, DV, dvt)))
        if not mma:
            smem += warps * 16 * (bc + 4) * 4             # the probabilities, a warp's 16 rows
        if smem > MAX_SHARED_MEM:
            raise CodegenError(f"flash attention tiles of {br} rows x {bc} keys (d {D}, dv {DV}) need {smem} bytes "
                               f"of shared memory, above {MAX_SHARED_MEM}")
        zero, chunk = as_expr(0), int(op.params["chunk"])
        ns = cdiv(t, chunk)
        group, heads = attention_row_dims(op)
        hshape = tuple(r[i] for i in heads)
        setup = [_unravel(ctx, "lum_h", hshape, " " * 4).rstrip("\n")]
        # query row lum_m of kv row lum_h: the group dims unravelled with the mask's own (moving) dims outer,
        # so that a row tile's rows share mask rows (prefill: a position's GQA heads side by side)
        idx: list[Expr] = [zero] * len(r)
        for pos, i in enumerate(heads):
            idx[i] = Var(f"lum_i{pos}")
        lum_m, rest = Var("lum_m"), as_expr(1)
        inner = [i for i in sorted(reversed(group), key=lambda i: vm.strides[i] != zero) if not is_one(r[i])]
        for k, i in enumerate(inner):
            idx[i] = lum_m // rest if k == len(inner) - 1 else (lum_m // rest) % r[i]
            rest = rest * r[i]
        m_rows = attention_group_rows(op)
        ctx.bound_var("lum_m", m_rows)
        ctx.bound_var("lum_t", t + chunk + bc)
        ctx.bound_var("lum_d", as_expr(max(D, DV)))
        ctx.bound_var("lum_j", ns)
        lum_t, lum_d = Var("lum_t"), Var("lum_d")
        kv_idx = tuple(zero if i in group else idx[i] for i in range(len(r)))
        setup.append(f"    const idx_t lum_kb = {ctx.c(vk.physical_index(kv_idx + (zero, zero)))};")
        setup.append(f"    const idx_t lum_vb = {ctx.c(vv.physical_index(kv_idx + (zero, zero)))};")
        out = ShapeTracker.contiguous(op.shape)
        ctx.exprs += [vk.physical_index(kv_idx + (lum_t, lum_d)), vv.physical_index(kv_idx + (lum_t, lum_d)),
                      vq.physical_index(tuple(idx) + (lum_d,)), vm.physical_index(tuple(idx) + (lum_t,)),
                      out.physical_index(tuple(idx) + (Var("lum_j"), as_expr(DV + 2)))]

        def vec(view: ShapeTracker, dt: DType) -> int:
            """1 when the view's rows are contiguous and 16-byte aligned (buffers are: codegen's convention)."""
            per = 16 // dt.itemsize
            rows = (view.offset, *view.strides[:-1])
            return int(view.strides[-1] == as_expr(1) and all(e % per == zero for e in rows))

        qv, kv, vvec = vec(vq, dq), vec(vk, dk), vec(vv, dvt)
        rnd = "lum_e" if p_dt == DType.f32 else _load_conv(p_dt, _store_conv("f", "lum_e", p_dt))
        src = render(load_template("flash_attention.cu"), {
            "KERNEL": _ENTRY, "THREADS": self.threads, "IDX_T": "@IDX_T@", "PARAMS": self.params_c(),
            "DYN_LOADS": "@DYN_LOADS@", "Q_T": STORAGE_C[dq], "K_T": STORAGE_C[dk], "V_T": STORAGE_C[dvt],
            "CVT_Q": _load_conv(dq, "x"), "CVT_K": _load_conv(dk, "x"), "CVT_V": _load_conv(dvt, "x"),
            "D": D, "DV": DV, "BC": bc, "CHUNK": chunk, "SMEM": smem, "MMA": int(mma), "FMA": int(not mma),
            "BF16": int(p_dt == DType.bf16),
            **{f"{x}_VEC": "true" if ok else "false" for x, ok in (("Q", qv), ("K", kv), ("V", vvec))},
            "T": ctx.c(t), "M": ctx.c(m_rows), "NS": ctx.c(ns),
            "HEADS": ctx.c(numel(hshape)), "SETUP": "\n".join(x for x in setup if x),
            "QROW": ctx.c(vq.physical_index(tuple(idx) + (zero,))),
            "MROW": ctx.c(vm.physical_index(tuple(idx) + (zero,))),
            "OROW": ctx.c(out.physical_index(tuple(idx) + (Var("lum_j"), zero))),
            "QD": ctx.c(vq.strides[-1]), "KT": ctx.c(vk.strides[-2]), "KD": ctx.c(vk.strides[-1]),
            "VT": ctx.c(vv.strides[-2]), "VD": ctx.c(vv.strides[-1]), "MT": ctx.c(vm.strides[-1]),
            "SCALE": _f32_literal(float(op.params["scale"])), "ROUND": rnd})
        work = numel(hshape) * ns * cdiv(m_rows, br)
        tuning = {"threads": self.threads, "tile_rows": br, "tile_keys": bc, "max_blocks": self.max_blocks,
                  "flash": "mma" if mma else "fma"}
        return [src], [("", self.grid(work, 1), (self.threads, 1, 1), smem)], tuning, self.max_blocks

    @staticmethod
    def _attention_logit(ind: str, mval: str, logit: str, keep: str, x: str) -> list[str]:
        """The loop over query rows lum_m, left open: each row's logit (log2 domain) of key lum_t of slot u
        into the lvalue ``x``, whether it counts into the lvalue ``keep``."""
        return [f"{ind}#pragma unroll", f"{ind}for (int lum_m = 0; lum_m < M; ++lum_m) {{",
                f"{ind}  float lum_s = 0.0f;", f"{ind}#pragma unroll",
                f"{ind}  for (int i = 0; i < DPL; ++i) lum_s += lum_q[lum_m][i] * lum_k[u][i];",
                f"{ind}  lum_s = lum_warp_reduce<LumSum, 32>(lum_s);",
                f"{ind}  {keep} = lum_in && {mval};",
                f"{ind}  {x} = {keep} ? {logit} : -LUM_INF_F32;"]

    @staticmethod
    def _attention_rescale(ind: str, pind: str, xmax: str) -> list[str]:
        """Query row lum_m's offset raised to ceil(``xmax``) when that exceeds it, its sums rescaled by the
        exact power of two (``pind``: the pragmas' indent)."""
        return [f"{ind}if ({xmax} > lum_c[lum_m]) {{",
                f"{ind}  const float lum_cn = ceilf({xmax}), lum_f = exp2f(lum_c[lum_m] - lum_cn);",
                f"{ind}  lum_l[lum_m] *= lum_f;", f"{pind}#pragma unroll",
                f"{ind}  for (int i = 0; i < VPL; ++i) lum_acc[lum_m][i] *= lum_f;",
                f"{ind}  lum_c[lum_m] = lum_cn;", f"{ind}}}"]

    @staticmethod
    def _attention_term(ind: str, pind: str, keep: str, x: str, rnd: str) -> list[str]:
        """Key slot u's term (logit ``x``) in query row lum_m's sums when ``keep``."""
        return [f"{ind}if ({keep}) {{",
                f"{ind}  const float lum_e = exp2f({x} - lum_c[lum_m]);",
                f"{ind}  const float lum_p = {rnd};",
                f"{ind}  lum_l[lum_m] += lum_e;", f"{pind}#pragma unroll",
                f"{ind}  for (int i = 0; i < VPL; ++i) lum_acc[lum_m][i] += lum_p * lum_v[u][i];",
                f"{ind}}}"]

    def _attention_key_batch(self, ind: str, mval: str, logit: str, rnd: str) -> tuple[list[str], str, str]:
        """attention.cu's KEY, KEYS_BEFORE and KEYS_AFTER: the step's UNROLL logits of every query row first
        (their warp reductions independent of each other), then per row one maximum, one rescale and the
        UNROLL keys' terms in key order. The offsets are integers, so 2^(x − c) · 2^(c − c') = 2^(x − c') and
        rounding commutes with the rescale: the same partials as an update after every key (outside subnormal
        results), which it replaced (2026-12-03)."""
        key = [*self._attention_logit(ind, mval, logit, "lum_kp[u][lum_m]", "lum_xs[u][lum_m]"), f"{ind}}}"]
        i6 = ind[:-2]
        before = f"{i6}float lum_xs[UNROLL][M];   // the step's logits (log2 domain), and which keys count\n" \
                 f"{i6}bool lum_kp[UNROLL][M];"
        after = "\n".join([
            f"{i6}#pragma unroll", f"{i6}for (int lum_m = 0; lum_m < M; ++lum_m) {{",
            f"{i6}  float lum_xm = lum_xs[0][lum_m];", f"{i6}#pragma unroll",
            f"{i6}  for (int u = 1; u < UNROLL; ++u) lum_xm = lum_xs[u][lum_m] > lum_xm ? lum_xs[u][lum_m] : lum_xm;",
            *self._attention_rescale(i6 + "  ", i6, "lum_xm"),
            f"{i6}#pragma unroll", f"{i6}  for (int u = 0; u < UNROLL; ++u) {{",
            *self._attention_term(i6 + "    ", i6, "lum_kp[u][lum_m]", "lum_xs[u][lum_m]", rnd), f"{i6}  }}", f"{i6}}}"])
        return key, before, after

    def _attention_stage(self, m_size: int, d: int, qd: Expr, heads_n: Expr) -> dict[str, str]:
        """attention.cu's STAGE placeholders: empty, or the calls of ``self.stage``'s rows (see
        :class:`AttentionStage`): in each round, task ``t = round · WARPS + warp`` is query row ``t`` (t < M),
        the k row (t = M) or the v row (t = M + 1), and a warp calls only its task's row function (a stage
        row reduces with warp shuffles only: its group is a warp). Every warp calling every row function,
        the others' predicated off, issued all three rows' instructions in each warp (the compiler cannot tell
        the condition is warp-uniform; Nsight Compute on gemma3-4b: 823 instructions a warp before the
        barrier, 175 of them loads) and measured 1.7% slower on gemma3-4b. Each block lets the next kernel
        launch after its stage's barrier (:mod:`lum.builder.attention_stage`)."""
        st = self.stage
        if st is None:
            return {"STAGE_DECL": "", "STAGE_PRE": "", "STAGE": ""}
        if qd != as_expr(1) or not heads_n.is_const:
            raise CodegenError("an attention stage needs q's features contiguous and a static number of kv rows")
        warps = self.threads // 32
        q0, qh, qm = st.q
        b0, bh, bm = st.qb

        def call(ind: str, live: str, fn: str) -> str:
            """Row function call ``fn(…, live, …)``, only in the warps whose task it is."""
            return f"{ind}if ({live}) {fn.format(live='true')}"

        def kv(ind: str, k_live: str, v_live: str, window: str) -> list[str]:
            return [call(ind, k_live, f"lum_krow((long long)({st.k[0]} + {st.k[1]} * (long long)lum_h), {{live}}, "
                                      f"{window});"),
                    call(ind, v_live, f"lum_vrow((long long)({st.v[0]} + {st.v[1]} * (long long)lum_h), {{live}}, "
                                      f"{window});")]

        ind, ind3 = " " * 4, " " * 8
        stage = [f"{ind}{{   // the stage (builder/attention_stage.py): kv row lum_h's query rows, its k / v rows",
                 f"{ind}  const idx_t lum_w0 = lum_j * (idx_t)CHUNK;",
                 f"{ind}  const idx_t lum_w1 = lum_min(lum_T, lum_w0 + (idx_t)CHUNK);",
                 f"{ind}#pragma unroll 1",
                 f"{ind}  for (int lum_r = 0; lum_r < {-(-(m_size + 2) // warps)}; ++lum_r) {{",
                 f"{ind3}const int lum_task = lum_r * WARPS + lum_warp;",
                 f"{ind3}const int lum_mq = lum_task < M ? lum_task : 0;",
                 call(ind3, "lum_task < M", f"lum_qrow((long long)({q0} + {qh} * (long long)lum_h + {qm} * lum_mq), "
                      f"{{live}}, LumSink{{{{&lum_qs[lum_mq][0], (long long)({b0} + {bh} * (long long)lum_h + {bm} * lum_mq)}}}});"),
                 *kv(ind3, "lum_task == M", "lum_task == M + 1",
                     "(long long)lum_w0, (long long)lum_w1, (long long)lum_T, lum_j == 0"),
                 f"{ind}  }}", f"{ind}  __syncthreads();   // the query rows are in lum_qs, the kv rows in the cache",
                 # the parenthesised name calls the function, not the stamps builds' macro (its start stamp)
                 f"{ind}  if (lum_untriggered) {{ lum_untriggered = false; (lum_pdl_trigger)(); }}",
                 f"{ind}}}"]
        pre = ["  if (lum_ns == 0) {   // no chunk reads the cache: the stage still writes the kv rows",
               f"    for (idx_t lum_h = (idx_t)blockIdx.x; lum_h < (idx_t)({self.ctx.c(heads_n)}); "
               "lum_h += (idx_t)gridDim.x) {",
               "#pragma unroll 1",
               f"      for (int lum_r = 0; lum_r < {-(-2 // warps)}; ++lum_r) {{",
               "        const int lum_task = lum_r * WARPS + lum_warp;",
               *kv(" " * 8, "lum_task == 0", "lum_task == 1", "0LL, 0LL, 0LL, true"),
               "      }", "    }", "  }"]
        decl = f"  __shared__ float lum_qs[M][DPL * 32];   // the stage's query rows (d = {d})"
        # the next kernel launches once every block has passed its first stage (or exited)
        decl += "\n  bool lum_untriggered = true;"
        return {"STAGE_DECL": decl,
                "STAGE_PRE": "\n".join(pre), "STAGE": "\n".join(stage)}

    # ------------------------------------------------------------------ gather
    @staticmethod
    def _ext_index_view(iv: ShapeTracker, rest: Sequence[Expr]) -> ShapeTracker:
        """An index view [J…] broadcast over trailing row dims [R…]."""
        r = len(rest)
        mask = None if iv.mask is None else tuple(iv.mask) + tuple((as_expr(0), d) for d in rest)
        return ShapeTracker(tuple(iv.shape) + tuple(rest), tuple(iv.strides) + (as_expr(0),) * r, iv.offset, mask)

    @staticmethod
    def _ext_row_view(tv: ShapeTracker, lead: Sequence[Expr]) -> ShapeTracker:
        """A [rows, R…] view without its dim 0, broadcast over leading dims [J…]."""
        j = len(lead)
        mask = None if tv.mask is None else tuple((as_expr(0), d) for d in lead) + tuple(tv.mask[1:])
        return ShapeTracker(tuple(lead) + tuple(tv.shape[1:]), (as_expr(0),) * j + tuple(tv.strides[1:]),
                            tv.offset, mask)

    def _check_index_dtype(self, k: int) -> None:
        if not self.dts[k].is_int:
            raise CodegenError(f"index argument {k} must be an integer tensor, got {self.dts[k]}")

    def _row_terms(self, tv: ShapeTracker) -> list[tuple[Expr, str, Expr]]:
        if tv.mask is None or _mask_trivial(tv, 0):
            return []
        lo, hi = tv.mask[0]
        return validity_terms(ShapeTracker((tv.shape[0],), (as_expr(1),), as_expr(0), ((lo, hi),)), [Var("lum_row")])

    def k_gather(self):
        op = self.op
        if len(op.args) != 2:
            raise CodegenError("gather takes (table, idx)")
        self._check_index_dtype(1)
        tv, iv = op.args[0].view, op.args[1].view
        if tv.ndim < 1:
            raise CodegenError("gather needs a table of at least 1 dim")
        shape = self.out_shape()
        if tuple(iv.shape) + tuple(tv.shape[1:]) != shape:
            raise CodegenError("gather: the op's shape is not idx.shape + table.shape[1:]")
        lead = tuple(iv.shape)
        write = self.write_view()
        views = [write, self._ext_index_view(iv, tv.shape[1:]), self._ext_row_view(tv, lead)]
        cshape, (wview, iview, tview) = coalesce(shape, views)
        ctx = self.ctx
        ept = self.ept or 2
        ind = " " * 8
        unravel = _unravel(ctx, "lum_w", cshape, ind).rstrip("\n")
        idx = index_vars(len(cshape))
        ctx.bound_var("lum_row", tv.shape[0])
        row = f"(long long)({self.load(1, iview, idx)})"
        row_phys, row_terms = Var("lum_row") * tv.strides[0], self._row_terms(tv)
        if self.dts[0] == op.dtype:   # same storage type: move the raw bits (no conversion round trip)
            st = STORAGE_C[op.dtype]
            phys, valid = view_access(ctx, tview, idx, row_phys, row_terms)
            conds = " && ".join(c for c in ("lum_ok", valid) if c)
            value = f"({st})0" if valid == "false" else f"(({conds}) ? ({st})in0[{phys}] : ({st})0)"
            store_val = "lum_v"
        else:
            value = self.load(0, tview, idx, extra_phys=row_phys, extra_terms=row_terms, guard="lum_ok")
            store_val = _store_conv(_kind(self.dts[0]), "lum_v", op.dtype)
        dest = "lum_w" if self.alias() is None else view_access(ctx, wview, idx)[0]
        n = numel(cshape)
        src = render(load_template("gather.cu"), {
            **self.common_values(ept), "NUM_ITEMS": ctx.c(n), "ROWS": ctx.c(tv.shape[0]), "UNRAVEL": unravel,
            "ROW": row, "VALUE": value, "STORE": f"out[{dest}] = {store_val};"})
        tile = self.threads * ept
        tuning = {"threads": self.threads, "ept": ept, "max_blocks": self.max_blocks}
        return [src], [("", self.grid(n, tile), (self.threads, 1, 1))], tuning, self.max_blocks * tile

    # ------------------------------------------------------------------ scatter
    def _scatter_rows(self, ept: int) -> tuple[str, Expr]:
        op = self.op
        expr = op.params.get("expr")      # a fused prologue: the rows are this tree over args[1:-1]
        if expr is None and len(op.args) != 3:
            raise CodegenError(f"{op.kind} takes (dest, src, idx)")
        if expr is not None:
            try:
                check_scatter_prologue(op, 2, op.kind)
            except ValueError as e:
                raise CodegenError(str(e)) from None
        last = len(op.args) - 1
        self._check_index_dtype(last)
        dv, iv = op.args[0].view, op.args[last].view
        svs = [a.view for a in op.args[1:last]]
        shape = self.out_shape()
        if tuple(dv.shape) != shape or len(shape) < 1:
            raise CodegenError("scatter: dest's view must have the op's shape (at least 1 dim)")
        sshape = tuple(iv.shape) + tuple(shape[1:])
        if any(tuple(sv.shape) != sshape for sv in svs):
            raise CodegenError("scatter: src's shape is not idx.shape + dest.shape[1:]")
        write = self.write_view()                   # contiguous (scatter) or dest's view (nocopy)
        lead = tuple(iv.shape)
        views = [*svs, self._ext_index_view(iv, shape[1:]), self._ext_row_view(write, lead)]
        cshape, cviews = coalesce(sshape, views)
        *sviews, iview, dview = cviews
        ctx = self.ctx
        ind = " " * 8
        unravel = _unravel(ctx, "lum_w", cshape, ind).rstrip("\n")
        idx = index_vars(len(cshape))
        ctx.bound_var("lum_row", shape[0])
        row = f"(long long)({self.load(last, iview, idx)})"
        dest, _ = view_access(ctx, dview, idx, Var("lum_row") * write.strides[0])
        prologue: list[str] = []
        if expr is not None:
            leaves = []
            for j, sv in enumerate(sviews):
                kind = _kind(self.dts[1 + j])
                prologue.append(f"{ind}const {_KIND_C[kind]} lum_a{j} = {self.load(1 + j, sv, idx)};")
                leaves.append((f"lum_a{j}", kind))
            x, kind = self._apply("Fused", leaves, prologue, ind, round_root=True)
            value = _store_conv(kind, x, op.dtype)
        elif self.dts[1] == op.dtype and sviews[0].mask is None:
            value = f"in1[{view_access(ctx, sviews[0], idx)[0]}]"
        else:
            value = _store_conv(_kind(self.dts[1]), self.load(1, sviews[0], idx), op.dtype)
        n = numel(cshape)
        src = render(load_template("scatter.cu"), {
            **self.common_values(ept), "NUM_ITEMS": ctx.c(n), "ROWS": ctx.c(shape[0]), "UNRAVEL": unravel,
            "ROW": row, "PROLOGUE": "\n".join(prologue) or f"{ind}(void)0;", "VALUE": value, "DEST": dest})
        return src, n

    def _scatter_launch(self, ept: int) -> tuple[str, tuple[Expr, Expr, Expr], int, int, dict[str, Any]]:
        """The row-writing kernel of a scatter: source, grid, threads, index margin, tuning. A prologue with
        row reductions (a norm computed in the cache write) makes it a row kernel."""
        if has_row_ops(self.op.params.get("expr")):
            return self._row_kernel()
        tile = self.threads * ept
        src, n = self._scatter_rows(ept)
        return src, self.grid(n, tile), self.threads, self.max_blocks * tile, {"ept": ept}

    def k_scatter(self):
        ept = self.ept or 2
        # launch 1: out = dest (converted), an elementwise copy through dest's view
        body, items, tun, ctile = self._elementwise_body("Contiguous", [0], self.out_shape(),
                                                         ShapeTracker.contiguous(self.out_shape()), True)
        copy = render(load_template("elementwise.cu"),
                      {**self.common_values(tun["ept"]), "NUM_ITEMS": self.ctx.c(items), "BODY": body})
        copy = copy.replace(_ENTRY, _ENTRY + "_copy", 1)
        rows, grid, threads, margin, rtun = self._scatter_launch(ept)
        rows = rows.replace(_ENTRY, _ENTRY + "_rows", 1)
        tuning = {"threads": self.threads, "ept": ept, **rtun, "copy_vec": tun["vec"], "copy_ept": tun["ept"],
                  "max_blocks": self.max_blocks}
        launches = [("_copy", self.grid(items, ctile), (self.threads, 1, 1)), ("_rows", grid, (threads, 1, 1))]
        return [copy, rows], launches, tuning, max(margin, self.max_blocks * ctile)

    def k_scatter_nocopy(self):
        if self.op.alias not in (None, 0):
            raise CodegenError("scatter_nocopy must alias argument 0")
        ept = self.ept or 2
        src, grid, threads, margin, rtun = self._scatter_launch(ept)
        tuning = {"threads": self.threads, "ept": ept, "max_blocks": self.max_blocks, **rtun}
        return [src], [("", grid, (threads, 1, 1))], tuning, margin

    # ------------------------------------------------------------------ gemm (small m: gemv.cu)
    def k_gemm(self):
        op, ctx = self.op, self.ctx
        m = gemv_rows(op)
        assert m is not None                     # generate() sends only these here
        prologue, epilogue = "expr" in op.params, "epilogue" in op.params
        jb, _ = gemm_parts(op)                  # B's arg index: (A | prologue leaves…, B, epilogue leaves…)
        if jb != 1 and not prologue:
            raise CodegenError("gemm takes (A, B)")
        p = {name: as_expr(op.params.get(name, GEMM_DEFAULTS.get(name)))
             for name in ("n", "k", "batch", "lda", "ldb", "stride_a", "stride_b", "offset_a", "offset_b")}
        layout = op.params["layout"]
        a_kc, b_kc = layout[:2] == "Rm", layout[2:] == "Cm"        # k contiguous in A / in B
        a_dt = DType.parse(op.params["expr"][1]) if prologue else None    # the prologue's A, as it rounds it
        narrow_mode = gemv_prologue_narrow_a() if prologue and a_dt in (DType.bf16, DType.f16) else None
        narrow = narrow_mode == "all" or (narrow_mode == "shared" and self.preload_shared and b_kc)
        pair_mode = gemv_prologue_pairs() if prologue and not epilogue and b_kc else None
        pair = (p["n"].is_const and p["n"].value % 2 == 0
                and (pair_mode == "all" or (pair_mode == "shared" and self.preload_shared)))
        if pair and not self.threads_given:       # the block's columns stay as many, half the warps each two
            self.threads = max(32, self.threads // 2)
        dta, dtb = (a_dt if narrow else DType.f32) if prologue else self.dts[0], self.dts[jb]
        code, a_ptr, b_ptr = "", "in0", f"in{jb}"
        if prologue:                              # A computed per block into shared memory (lum_as)
            code = self._gemv_prologue(m, p, layout, jb, dta)
            a_ptr = "lum_as"
            p.update(lda=p["k"], offset_a=as_expr(0), stride_a=as_expr(0))
        n, k, batch = p["n"], p["k"], p["batch"]
        n_out, acc_cols, epi = n, [0], ""
        if epilogue:                              # NACC product columns per output column, then the tree
            if not b_kc:
                raise CodegenError("a gemm epilogue needs B column-major (the dot scheme)")
            n_out, acc_cols = as_expr(op.params["n_out"]), [int(c) for c in op.params["acc_cols"]]
            if not 1 <= len(acc_cols) <= GEMV_MAX_ACC:
                raise CodegenError(f"a gemm epilogue reads 1..{GEMV_MAX_ACC} product columns, got {len(acc_cols)}")
            epi = self._gemv_epilogue(m, jb, n_out)
            ctx.exprs.append(as_expr(max(acc_cols)) * p["ldb"] + n * p["ldb"])
        elif pair:                                # column j and j + n/2 in one group, A read once for both
            n_out, acc_cols = as_expr(n.value // 2), [0, n.value // 2]
            epi = load_template("gemv_pairs.cuh")
        vec, vec_ok = self._gemv_vec(p, a_kc, b_kc, dta, dtb)
        group = self._gemv_group(p, b_kc, vec)
        unroll = 4 if self.unroll is None else self.unroll
        if not 1 <= unroll <= 16:
            raise CodegenError(f"unroll must be in [1, 16], got {unroll}")
        inflight = self._gemv_vectors("inflight", self.inflight, GEMV_MAX_INFLIGHT, k, group, vec) if b_kc else 0
        shared = 0           # bytes a block's shared preload may take: 16-byte copies only, beside the static
        if self.preload_shared and b_kc and vec * dtb.itemsize == 16:     # arrays (the prologue's A, the sums)
            static = (m * k.value * dta.itemsize if prologue and k.is_const else 0) + 4096
            shared = max(0, min(GEMV_SHARED_PRELOAD_BYTES, MAX_SHARED_MEM - static))
        preload = self._gemv_preload(k, group, vec, len(acc_cols), inflight, shared) if b_kc else 0
        shared = shared if preload > 0 else 0
        self.early = (b_ptr,) if preload else ()                   # B, loaded before the wait
        b_stream = b_kc and jb in self.weight_args and gemv_evict_first()
        span = self.threads // group
        tile = span if b_kc else span * vec      # output columns per block tile
        # every index the kernel forms, for the 32/64-bit decision
        a_ext = p["offset_a"] + batch * p["stride_a"] + (m * p["lda"] + k if a_kc else k * p["lda"] + m)
        b_ext = p["offset_b"] + batch * p["stride_b"] + (n * p["ldb"] + k if b_kc else k * p["ldb"] + n)
        ctx.exprs.extend([a_ext, b_ext, batch * m * n + n + tile])
        if b_kc:
            items, per_block, margin = batch * n_out, span, self.max_blocks * span
        else:
            items, per_block, margin = batch * cdiv(n, tile), 1, self.max_blocks
        tuning = {"scheme": "dot" if b_kc else "cols", "threads": self.threads, "group": group, "vec": vec,
                  "unroll": unroll, "inflight": inflight, "preload": preload, "cols": tile,
                  "max_blocks": self.max_blocks}
        if shared:
            tuning["preload_shared"] = True
        if epilogue:
            tuning["epilogue"] = len(acc_cols)
        if pair:
            tuning["pairs"] = True
            tuning["cols"] = tile * 2
        if b_stream:
            tuning["stream"] = True
        if narrow:
            tuning["narrow_a"] = True
        grid = self.grid(items, per_block)
        if prologue:    # each block computes all of A: about one resident wave of blocks, walking the columns
            cap = max(1, min(self.max_blocks, _GEMV_FILL_THREADS // self.threads))
            grid = (smax(1, smin(cdiv(items, per_block), cap)), as_expr(1), as_expr(1))
            tuning["prologue"] = True
        # loads ahead: registers capped so that a static grid runs in one wave; a preload keeps the registers
        # ptxas gives it (capped, gemma3-4b's o and down spilled 224-488 bytes a thread at 4-8 vectors) and
        # its grid is capped at one wave by them instead (builder/kernels.py _grids_in_one_wave)
        min_blocks = self._gemv_min_blocks(inflight, grid[0]) if inflight else ""
        # A's vectors ahead too (one row of A in global memory) unless the registers are capped: there
        # they spill (ptxas, gemma3-4b's o and down projections: 184 bytes a thread at 40 registers)
        a_early = bool(inflight) and m == 1 and a_kc and not prologue and not min_blocks
        src = render(load_template("gemv.cu"), {
            "KERNEL": _ENTRY, "THREADS": self.threads, "MIN_BLOCKS": min_blocks, "IDX_T": "@IDX_T@",
            "PARAMS": self.params_c(), "DYN_LOADS": "@DYN_LOADS_NOWAIT@", "M": m, "GROUP": group, "VEC": vec,
            "UNROLL": unroll,
            "INFLIGHT": inflight, "PRELOAD": preload, "A_EARLY": "true" if a_early else "false",
            "PRELOAD_SHARED": "true" if shared else "false",
            "B_STREAM": "true" if b_stream else "false",
            "A_PTR": a_ptr, "B_PTR": b_ptr, "PROLOGUE": code, "NACC": len(acc_cols),
            "ACC_COLS": ", ".join(map(str, acc_cols)), "N_OUT": ctx.c(n_out),
            "HAS_EPILOGUE": "true" if epi else "false", "EPILOGUE": epi,
            "A_KCONTIG": "true" if a_kc else "false", "B_KCONTIG": "true" if b_kc else "false",
            "A_T": STORAGE_C[dta], "B_T": STORAGE_C[dtb], "A_LOAD": _load_conv(dta, "lum_x"),
            "B_LOAD": _load_conv(dtb, "lum_x"), "STORE": _store_conv("f", "lum_v", op.dtype),
            "N": ctx.c(n), "K": ctx.c(k), "BATCH": ctx.c(batch), "LDA": ctx.c(p["lda"]), "LDB": ctx.c(p["ldb"]),
            "STRIDE_A": ctx.c(p["stride_a"]), "STRIDE_B": ctx.c(p["stride_b"]), "OFF_A": ctx.c(p["offset_a"]),
            "OFF_B": ctx.c(p["offset_b"]), "VEC_OK": vec_ok})
        smem = self.threads * preload * len(acc_cols) * 16 if shared else 0      # within ``shared``
        return [src], [("", grid, (self.threads, 1, 1), smem)], tuning, margin

    def _gemv_min_blocks(self, ahead: int, blocks: Expr) -> str:
        """``__launch_bounds__``' second argument for a GEMV whose lanes load ahead (``ahead``; ``, b``, else
        empty): the blocks an SM must hold for a static grid to run in one wave, so that the registers those
        loads take never split the grid into a second wave (none when it cannot be one wave anyway)."""
        if not ahead or not blocks.is_const:
            return ""
        per_sm = -(-blocks.value // SMS)
        return f", {per_sm}" if 1 < per_sm <= 2048 // self.threads else ""

    def _gemv_epilogue(self, m: int, jb: int, n_out: Expr) -> str:
        """The code (templates/gemv.cu's EPILOGUE) that stores output column ``lum_j`` of each of the ``m``
        rows: the epilogue tree at that element, ``["acc", t]`` being ``lum_acc[t * M + i]`` rounded to
        ``acc_dtype``, ``["arg", k]`` a load of ``in{jb + 1 + k}`` through its view."""
        op, ctx = self.op, self.ctx
        shape = self.out_shape()
        acc_dt = DType.parse(op.params["acc_dtype"])
        ind = " " * 10
        lines = [f"{ind[:-2]}#pragma unroll", f"{ind[:-2]}for (int lum_ei = 0; lum_ei < M; ++lum_ei) {{",
                 f"{ind}const idx_t lum_f = (lum_b * M + lum_ei) * lum_nout + lum_j;"]
        lines += _unravel(ctx, "lum_f", shape, ind).rstrip("\n").split("\n")
        idx = index_vars(len(shape))
        names: dict[str, tuple[str, str]] = {}

        def leaf(t: list, key: str) -> tuple[str, str] | None:
            if t[0] == "acc":
                return _load_conv(acc_dt, _store_conv("f", f"lum_acc[{int(t[1])} * M + lum_ei]", acc_dt)), "f"
            if t[0] != "arg":
                return None
            if key not in names:
                k = jb + 1 + t[1]
                view = op.args[k].view
                ctx.exprs.append(view.physical_index(idx))
                names[key] = (f"lum_e{t[1]}", _kind(self.dts[k]))
                lines.append(f"{ind}const {_KIND_C[names[key][1]]} lum_e{t[1]} = {self.load(k, view, idx)};")
            return names[key]

        x, kd = self._tree(op.params["epilogue"], {}, lines, ind, False, leaf)
        lines += [f"{ind}out[lum_f] = {_store_conv(kd, x, op.dtype)};", f"{ind[:-2]}}}"]
        ctx.exprs.append(as_expr(m) * n_out * as_expr(op.params.get("batch", 1)))
        return "\n".join(ln for ln in lines if ln)

    def _gemv_prologue(self, m: int, p: dict[str, Expr], layout: str, jb: int, dta: DType = DType.f32) -> str:
        """The code that computes a gemm's A (its fused prologue tree, ``params["expr"]``) into the shared
        array ``lum_as`` (templates/gemv_prologue.cuh), of floats or (``dta``, the tree's own dtype) of its
        storage; CodegenError where the kernel cannot (see :func:`~lum.builder.gemv_policy.gemv_prologue_fits`)."""
        op = self.op
        expr = op.params["expr"]
        dom = tuple(as_expr(d) for d in op.args[0].view.shape)
        why = gemv_prologue_fits(m, p, layout, dom)
        if why:
            raise CodegenError(f"a gemm prologue {why}")
        if any(tuple(a.view.shape) != dom for a in op.args[:jb]):
            raise CodegenError("a gemm prologue's leaves must share one view shape")
        a_dt = DType.parse(expr[1])
        tree = LOp(0, "elementwise", "Fused", op.args[:jb], dom, a_dt, {"expr": expr})
        sub = _Gen(tree, self.dts[:jb], self.ctx, threads=self.threads, ept=None, vec=None, group=self.threads,
                   unroll=None, inflight=0, max_blocks=1, acc=self.acc, math=self.math)
        rp = sub._row_parts(sink="lum_as", sink_stored=dta != DType.f32)
        return render(load_template("gemv_prologue.cuh"), {
            "ACC_T": _KIND_C[rp.acc_kind], "A_ELEMS": m * p["k"].value, "A_FLOAT": int(dta == DType.f32),
            "A_NARROW": int(dta != DType.f32), "A_T": STORAGE_C[dta], "A_BYTES": m * p["k"].value * dta.itemsize,
            "ROWS": self.ctx.c(rp.rows),
            "N": self.ctx.c(rp.n), "ROW_SETUP": rp.setup, "PHASES": rp.phases, "FINAL": rp.final})

    def _gemv_vec(self, p: dict[str, Expr], a_kc: bool, b_kc: bool, dta: DType, dtb: DType) -> tuple[int, str]:
        """Elements per vector access of B (the widest of at most 16 bytes that no static offset, stride
        or leading dim rules out; ``vec`` caps it) and the C condition for what only run time can tell."""
        if self.vec is not None and self.vec not in (1, 2, 4, 8):
            raise CodegenError(f"vec must be 1, 2, 4 or 8, got {self.vec}")
        widest = min(16 // dtb.itemsize, self.vec or 8)
        batched = p["batch"] != as_expr(1)
        for w in (8, 4, 2):
            if w > widest:
                continue
            need = [(p["offset_b"], w), (p["ldb"], w)] + ([(p["stride_b"], w)] if batched else [])
            if a_kc and b_kc:                    # A is vector-loaded too, in pieces of <= 16 bytes
                pa = min(w, 16 // dta.itemsize)
                need += [(p["offset_a"], pa), (p["lda"], pa)] + ([(p["stride_a"], pa)] if batched else [])
            terms: list[str] = []
            for e, d in need:
                r = e % d
                if r == as_expr(0):
                    continue
                if r.is_const:
                    break
                terms.append(f"(({self.ctx.c(e)}) % {d} == 0)")
            else:
                return w, " && ".join(terms) or "true"
        return 1, "false"

    def _gemv_preload(self, k: Expr, group: int, vec: int, nacc: int, inflight: int, shared: int = 0) -> int:
        """Weight vectors per lane and product column that it loads into registers before the wait
        (``preload``; dot scheme, plain loop, vector loads): at most those of its first column, and
        :data:`~lum.builder.gemv_policy.GEMV_PRELOAD_VECTORS` across the ``nacc`` product columns (``shared`` > 0:
        into shared memory, :data:`~lum.builder.gemv_policy.GEMV_SHARED_PRELOAD_VECTORS` and ``shared`` bytes a
        block); 0 beside loads ahead (``inflight``)."""
        hi = GEMV_SHARED_PRELOAD_VECTORS if self.preload_shared else GEMV_PRELOAD_VECTORS
        if not 0 <= self.preload <= hi:
            raise CodegenError(f"preload must be in [0, {hi}], got {self.preload}")
        if not self.preload or inflight or vec == 1:
            return 0
        # asked for shared memory where it cannot be (vectors under 16 bytes): registers, as many as they take
        hi = min(hi, shared // (16 * self.threads)) if shared else GEMV_PRELOAD_VECTORS
        if hi < nacc:
            return 0
        asked = max(1, min(self.preload, hi // nacc))
        return min(asked, -(-k.value // (vec * group))) if k.is_const else asked

    @staticmethod
    def _gemv_vectors(name: str, asked: int, hi: int, k: Expr, group: int, vec: int) -> int:
        """Weight vectors per lane for ``inflight`` (loads issued ahead), dot scheme: ``asked``, in [0, ``hi``],
        down to the vectors a lane has when k is static (no registers for loads that never happen)."""
        if not 0 <= asked <= hi:
            raise CodegenError(f"{name} must be in [0, {hi}], got {asked}")
        if asked and k.is_const:
            return max(1, min(asked, -(-k.value // (vec * group))))
        return asked

    def _gemv_group(self, p: dict[str, Expr], b_kc: bool, vec: int) -> int:
        """Threads reducing one output (``group``). Default, dot scheme: two warps when k has at least
        128 vectors (measured best or near it on the decode projections); for a shorter k, enough lanes
        for its vectors (up to a warp), then split-K across warps while the GPU is not yet full and
        every thread keeps at least two vectors. Cols scheme: threads along n cover n (up to a warp), fewer while the
        tiles are too few to fill the GPU (down to 64-byte row segments); the rest split k."""
        t = self.threads
        if self.group is not None:
            if self.group < 1 or self.group > t or self.group & (self.group - 1):
                raise CodegenError(f"group must be a power of two in [1, threads], got {self.group}")
            return self.group
        n, k, batch = p["n"], p["k"], p["batch"]
        sized = n.is_const and batch.is_const
        if "expr" in self.op.params:         # a prologue gemv: one warp per column (split-K across warps measured
            return min(32, t)                # 1.1-1.7x slower there: each column tile then waits on shared memory)
        if b_kc:
            if not k.is_const:
                return min(32, t)
            kv = max(1, -(-k.value // vec))
            if kv >= 128:      # two warps per output, >= 2 vectors per thread: best or within 7% of
                return min(64, t)   # it on every decode projection of gemma3-4b / llama3-1b (gemv_sweep)
            g = min(32, pow2ceil(kv), t)
            while sized and g < t and batch.value * n.value * g < _GEMV_FILL_THREADS and kv >= 4 * g:
                g *= 2
            return g
        span = min(32, t) if not n.is_const else min(32, t, pow2ceil(max(1, -(-n.value // vec))))
        while (sized and span > 1 and span * vec * self.dts[-1].itemsize > 64
               and batch.value * -(-n.value // (span * vec)) * t < _GEMV_FILL_THREADS):
            span //= 2
        return t // span
