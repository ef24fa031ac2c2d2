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
:mod:`lum.builder.env_switches`. The generator of one op is ``_Gen`` here (elementwise, iota, reduce, gather,
scatter); its row-kernel, attention and GEMV methods are mixins in :mod:`lum.builder.row_codegen`,
:mod:`lum.builder.attention_codegen` and :mod:`lum.builder.gemv_codegen`, and what they all share (the
:class:`KernelSource` data, templates, index plans, dtype conversions) is in :mod:`lum.builder.kernel_text`,
re-exported here.

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
the schedule to the compiler's unrolled loop; default ``$LUM_GEMV_INFLIGHT``, else
:func:`~lum.builder.gemv_policy.gemv_inflight_for`: all of a lane's few vectors in an epilogue GEMV, else 0),
``preload`` (gemv,
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
``GemvKernels._gemv_group`` in :mod:`lum.builder.gemv_codegen`); its tuning also reports ``scheme`` (dot |
cols) and ``cols`` per block tile.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from lum.builder.attention_codegen import AttentionKernels
from lum.builder.attention_policy import attention_stage_block
from lum.builder.env_switches import CodegenError, env_switch
from lum.builder.gemv_codegen import GemvKernels
from lum.builder.gemv_policy import (GEMV_DTYPES, GEMV_LARGE, GEMV_SHARED_PRELOAD_VECTORS, blocks_unbalanced,
                                     gemv_ahead_after_gemv, gemv_balance, gemv_inflight_default,
                                     gemv_kernel_ops, gemv_preload_after_gemv, gemv_preload_default,
                                     gemv_preload_shared, gemv_prologue_threads, gemv_rows, gemv_tuning_override,
                                     prologue_walks_tiles, split_gemv_tuning)
from lum.builder.intmath import pow2_floor
from lum.builder.kernel_text import (ENTRY_PLACEHOLDER, KIND_C, STORAGE_C, ZERO_C, AccessPlan, KernelContext,
                                     KernelSource, Launch, Param, access_plan, coalesce, common_header, compute_node,
                                     convert_kind, entry_named, index_vars, load_conv, load_template, mask_trivial, render,
                                     store_conv, unravel_index, validity_terms, value_kind, view_access)
from lum.builder.row_codegen import RowKernels
from lum.format.dtypes import DType
from lum.format.expr import Expr, Var, as_expr, cdiv, smax, smin
from lum.format.llir import (ELEMENTWISE_ARITY, LOp, Program, check_expr, check_scatter_prologue, gemm_fused,
                             gemm_parts, has_row_ops)
from lum.format.shapetracker import ShapeTracker, numel

__all__ = ["Launch", "Param", "KernelSource", "CodegenError", "generate", "generate_program", "module_source",
           "render", "load_template", "common_header", "coalesce", "view_access", "access_plan", "AccessPlan", "STORAGE_C",
           "ELEMENTWISE_OPS", "KERNEL_KINDS", "gemv_after_small",
           "AttentionStage", "StageRow", "stage_row"]

ELEMENTWISE_OPS = ("Cast", "Contiguous", "Exp2", "Log2", "Sin", "Sqrt", "Recip", "Add", "Mul", "Mod",
                   "LessThan", "Where")
KERNEL_KINDS = ("elementwise", "reduce", "gather", "scatter", "scatter_nocopy", "iota", "attention", "gemm")


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


# ============================================================================ default block sizes
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
             stage: AttentionStage | None = None, tile_keys: int | None = None,
             ahead_early: int = 0) -> KernelSource | None:
    """CUDA source and launch description for one LLIR op; ``None`` for a gemm that stays a cuBLASLt call
    (see :func:`~lum.builder.gemv_policy.gemv_rows`) and for input / output / constant (no kernel).
    ``dyn_vars``: the slot order of the runtime dyn buffer. ``arg_dtypes``: storage dtypes of ``op.args``
    (their producers' dtypes) where the op's own dtype does not imply them. ``stage``: the rows of the ops
    before it an attention kernel computes (:class:`AttentionStage`). ``ahead_early`` (a GEMV; > 0: on, keeping
    that many blocks an SM): :func:`~lum.builder.gemv_policy.gemv_ahead_after_gemv`. See the module docstring for
    the tuning parameters."""
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
    ctx = KernelContext(dyn_vars, max_dyn=max_dyn)
    gen = _Gen(op, dts, ctx, threads=threads, ept=ept, vec=vec, group=group, unroll=unroll,
               inflight=gemv_inflight_default() if inflight is None else inflight,
               preload=gemv_preload_default() if preload is None else preload, preload_shared=preload_shared,
               max_blocks=max_blocks,
               acc=acc, math=math, threads_given=threads_given, row_regs=row_regs,
               weight_args=frozenset(weight_args), stage=stage, tile_keys=tile_keys, ahead_early=ahead_early)
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
    body, name = entry_named(body, f"{op.kind}/{op.op}",
                             f"lum_{op.kind}_{op.op.lower() or op.kind}_" if op.op else f"lum_{op.kind}_")
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
    ctx = KernelContext(tuple(dyn_vars), max_dyn=max_dyn)
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
        f"  typedef {KIND_C[rp.acc_kind]} acc_t;",
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
                     weights: frozenset[int] = frozenset(),
                     resident: Callable[[KernelSource], int | None] | None = None,
                     **tuning: Any) -> dict[int, KernelSource | None]:
    """:func:`generate` for every op of a program, with arg dtypes taken from the producers.
    ``dyn_vars`` defaults to every dyn var the program mentions, sorted. ``weights``: op ids of the
    program's inputs that are weights (an op's arguments read from them are its ``weight_args``).
    ``tuning``: keyword arguments of :func:`generate` for every op, and ``gemv<i>.<name>`` ones for the
    i-th GEMV (:func:`~lum.builder.gemv_policy.split_gemv_tuning`). ``resident``: the blocks an SM a kernel
    holds (ptxas; builder/kernels.py), which a GEMV changed by ``$LUM_GEMV_AHEAD_AFTER_GEMV`` keeps."""
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
        dts, wargs = _arg_kinds(program, o, weights)
        r = rank.get(o.id, -1)
        ks = generate(o, dyn_vars, arg_dtypes=dts, weight_args=wargs, **{**common, **per.get(r, {})})
        if r in in_registers and shared != "all" and ks is not None and prologue_walks_tiles(o, ks):
            ks = generate(o, dyn_vars, arg_dtypes=dts, weight_args=wargs, **{**common, **in_registers[r]})
        out[o.id] = ks
    if gemv_ahead_after_gemv():
        _ask_l2_early_behind_gemvs(program, dyn_vars, out, weights, common, per, rank, resident)
    return out


def _arg_kinds(program: Program, op: LOp, weights: frozenset[int]) -> tuple[list[DType], frozenset[int]]:
    """(``op``'s argument dtypes, the indices of its arguments read from weights) in ``program``."""
    return ([program.ops[a.src].dtype for a in op.args],
            frozenset(k for k, a in enumerate(op.args) if a.src in weights))


def _ask_l2_early_behind_gemvs(program: Program, dyn_vars: Sequence[str], out: dict[int, KernelSource | None],
                               weights: frozenset[int], common: dict[str, Any], per: dict[int, dict[str, Any]],
                               rank: dict[int, int], resident: Callable[[KernelSource], int | None] | None) -> None:
    """Under :func:`~lum.builder.gemv_policy.gemv_ahead_after_gemv`: each GEMV without a prologue or a preload
    that reads a weight as B and follows another GEMV of this program, regenerated in ``out`` to ask L2 for its
    first lines before its wait, holding the blocks an SM it held (``resident``: unbounded, ptxas can take more
    registers for the requests' addresses, as it took gemma3-4b's gate-up from 96 to 117 when it asked so)."""
    ks = [o for o in program.ops if o.kind in KERNEL_KINDS and not (o.kind == "gemm" and gemv_rows(o) is None)]
    for i, o in enumerate(ks[1:], start=1):
        src, before = out.get(o.id), ks[i - 1]
        if (src is None or out.get(before.id) is None or before.kind != "gemm" or o.id not in rank
                or src.tuning.get("prologue") or src.tuning.get("preload")):
            continue
        dts, wargs = _arg_kinds(program, o, weights)
        blocks = (resident(src) if resident is not None else None) or 1
        early = generate(o, dyn_vars, arg_dtypes=dts, weight_args=wargs, ahead_early=blocks,
                         **{**common, **per.get(rank[o.id], {})})
        if early is not None and early.tuning.get("ahead_early"):
            out[o.id] = early


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
STAMP_FIELDS = 10          # a sampled block's record: tag, block, SM, start ns, waited ns, 5 marks (LUM_STAMP_AT)


def stamp_tag(name: str) -> int:
    """The number a stamped kernel records as its own (60 bits of its name's SHA-256), which the reader maps
    back to the kernel's name."""
    return int(hashlib.sha256(name.encode()).hexdigest()[:15], 16)


# ============================================================================ generators
class _Gen(GemvKernels, AttentionKernels, RowKernels):
    """One op → one kernel. The elementwise, iota, reduce, gather and scatter generators are here; the row
    kernels, attention and GEMV ones are the mixins' (:mod:`lum.builder.row_codegen`,
    :mod:`lum.builder.attention_codegen`, :mod:`lum.builder.gemv_codegen`)."""

    def __init__(self, op: LOp, dts: list[DType], ctx: KernelContext, *, threads: int, ept: int | None, vec: int | None,
                 group: int | None, unroll: int | None, inflight: int | None, max_blocks: int, acc: str, math: str,
                 preload: int = 0, preload_shared: bool = False, threads_given: bool = True,
                 row_regs: bool = True, weight_args: frozenset[int] = frozenset(),
                 stage: AttentionStage | None = None, tile_keys: int | None = None, ahead_early: int = 0):
        self.op, self.dts, self.ctx = op, dts, ctx
        self.ahead_early = ahead_early             # gemv: > 0, its first lines asked of L2 before the wait, that
                                                   # many blocks an SM kept (gemv_ahead_after_gemv)
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
        if v.mask is not None and any(not mask_trivial(v, k) for k in range(v.ndim)):
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
            return ZERO_C[value_kind(dt)]
        val = load_conv(dt, f"in{k}[{base} + {phys}]" if base else f"in{k}[{phys}]")
        return f"(({' && '.join(conds)}) ? {val} : {ZERO_C[value_kind(dt)]})" if conds else val

    def common_values(self, ept: int) -> dict[str, Any]:
        return {"KERNEL": ENTRY_PLACEHOLDER, "THREADS": self.threads, "EPT": ept, "IDX_T": "@IDX_T@",
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
        lines = [unravel_index(self.ctx, "lum_w", cshape, ind, vec).rstrip("\n")]
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
                lines.append(f"{ind}const {KIND_C[value_kind(self.dts[k])]} lum_a{j} = {self.load(k, v, idx)};")
                args.append((f"lum_a{j}", value_kind(self.dts[k])))
            expr, kind = self._apply(op_name, args, lines, ind)
            if contiguous_out:
                self.ctx.c(as_expr(0))
                dest = "lum_w"
            else:
                dest, _ = view_access(self.ctx, wview, idx)
            lines.append(f"{ind}out[{dest}] = {store_conv(kind, expr, self.op.dtype)};")
        else:
            args = []
            for j, (k, v) in enumerate(zip(arg_ids, aviews)):
                dt, kk = self.dts[k], value_kind(self.dts[k])
                if v.strides[-1] == as_expr(0):          # broadcast along the vector: one scalar
                    lines.append(f"{ind}const {KIND_C[kk]} lum_s{j} = {self.load(k, v, idx)};")
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
                args.append((load_conv(dt, f"lum_v{j}.v[lum_k]"), kk))
            ot = f"lum_vec<{STORAGE_C[self.op.dtype]}, {vec}>"
            lines.append(f"{ind}{ot} lum_o;")
            lines.append(f"{ind}#pragma unroll")
            lines.append(f"{ind}for (int lum_k = 0; lum_k < {vec}; ++lum_k) {{")
            named = []
            for j, (c_expr, kk) in enumerate(args):
                lines.append(f"{ind}  const {KIND_C[kk]} lum_a{j} = {c_expr};")
                named.append((f"lum_a{j}", kk))
            expr, kind = self._apply(op_name, named, lines, ind + "  ")
            lines.append(f"{ind}  lum_o.v[lum_k] = {store_conv(kind, expr, self.op.dtype)};")
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
            return compute_node(op_name, args, self.math)
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
            expr, kind = compute_node(t[0], [node(k) for k in t[2:]], self.math)
            if root and not round_root:
                return expr, kind
            dt = DType.parse(t[1])
            names[key] = (f"lum_u{len(names)}", value_kind(dt))
            val = convert_kind(kind, value_kind(dt), expr) if dt in (DType.i64, DType.bool) else \
                load_conv(dt, store_conv(kind, expr, dt))           # round through the storage type
            lines.append(f"{ind}const {KIND_C[value_kind(dt)]} {names[key][0]} = {val};")
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
            if v.strides[-1] not in (as_expr(0), as_expr(1)) or not mask_trivial(v, v.ndim - 1):
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
            "KERNEL": ENTRY_PLACEHOLDER, "THREADS": self.threads, "IDX_T": "@IDX_T@", "PARAMS": self.params_c(),
            "DYN_LOADS": "@DYN_LOADS@", "N": self.ctx.c(n),
            "STORE": f"out[lum_w] = {store_conv('i', 'lum_v', op.dtype)};"})
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
        acc_t = KIND_C[acc_kind]
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
        setup = [unravel_index(ctx, "lum_row", cshape, ind).rstrip("\n")]
        ctx.bound_var("lum_r", red)
        for rv, (_, ax) in zip(rviews, splits):   # the full physical indices, for the index-width decision
            ctx.exprs.append(rv.physical_index(idx) + lum_r * ax.strides[0])
        fixup = ""
        if expr is None:
            ax_mask = None if inv.mask is None or mask_trivial(inv, axis) else inv.mask[axis]
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
                    f"{ind2}const {KIND_C[value_kind(dt_in)]} lum_x = {load_conv(dt_in, 'in0[lum_p]')};"]
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
                kind = value_kind(self.dts[k])
                val = self.load(k, ax, (lum_r,), base=f"lum_b{k}", guard=f"lum_v{k}" if valid else None)
                load.append(f"{ind2}const {KIND_C[kind]} lum_a{k} = {val};")
                leaves.append((f"lum_a{k}", kind))
            x, kind = self._apply("Fused", leaves, load, ind2, round_root=True)
            load.append(f"{ind2}const {KIND_C[kind]} lum_x = {x};")
        if op.op == "Sum":
            identity = "(acc_t)0"
        else:
            identity = ("(acc_t)(-LUM_INF_F32)" if acc_kind in ("f", "d") else
                        "(acc_t)0" if dt_in == DType.bool else "LUM_LLONG_MIN")
        if self.alias() is None:
            dest = "lum_row"
        else:
            dest, _ = view_access(ctx, wview, idx)
        store = f"{ind}  out[{dest}] = {store_conv(acc_kind, 'lum_acc', op.dtype)};"
        src = render(load_template("reduce.cu"), {
            "KERNEL": ENTRY_PLACEHOLDER, "THREADS": self.threads, "GROUP": group, "IDX_T": "@IDX_T@",
            "PARAMS": self.params_c(), "DYN_LOADS": "@DYN_LOADS@", "ACC_T": acc_t, "OP": f"Lum{op.op}",
            "IDENTITY": identity, "ROWS": ctx.c(rows), "RED": ctx.c(red), "ROW_SETUP": "\n".join(s for s in setup if s),
            "LOAD": "\n".join(load), "PAD_FIXUP": fixup or f"{ind}  (void)0;", "STORE": store})
        per_block = self.threads // group
        tuning = {"threads": self.threads, "group": group, "max_blocks": self.max_blocks, "acc": self.acc}
        return [src], [("", self.grid(rows, per_block), (self.threads, 1, 1))], tuning, self.max_blocks * per_block

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
        if tv.mask is None or mask_trivial(tv, 0):
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
        unravel = unravel_index(ctx, "lum_w", cshape, ind).rstrip("\n")
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
            store_val = store_conv(value_kind(self.dts[0]), "lum_v", op.dtype)
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
        unravel = unravel_index(ctx, "lum_w", cshape, ind).rstrip("\n")
        idx = index_vars(len(cshape))
        ctx.bound_var("lum_row", shape[0])
        row = f"(long long)({self.load(last, iview, idx)})"
        dest, _ = view_access(ctx, dview, idx, Var("lum_row") * write.strides[0])
        prologue: list[str] = []
        if expr is not None:
            leaves = []
            for j, sv in enumerate(sviews):
                kind = value_kind(self.dts[1 + j])
                prologue.append(f"{ind}const {KIND_C[kind]} lum_a{j} = {self.load(1 + j, sv, idx)};")
                leaves.append((f"lum_a{j}", kind))
            x, kind = self._apply("Fused", leaves, prologue, ind, round_root=True)
            value = store_conv(kind, x, op.dtype)
        elif self.dts[1] == op.dtype and sviews[0].mask is None:
            value = f"in1[{view_access(ctx, sviews[0], idx)[0]}]"
        else:
            value = store_conv(value_kind(self.dts[1]), self.load(1, sviews[0], idx), op.dtype)
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
        copy = copy.replace(ENTRY_PLACEHOLDER, ENTRY_PLACEHOLDER + "_copy", 1)
        rows, grid, threads, margin, rtun = self._scatter_launch(ept)
        rows = rows.replace(ENTRY_PLACEHOLDER, ENTRY_PLACEHOLDER + "_rows", 1)
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
