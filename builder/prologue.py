"""GEMV prologues: a decode GEMV computes its input vector itself instead of reading a buffer.

In a decode step the input of most weight GEMVs is a one-row kernel: the RMSNorm before the qkv and
gate/up projections (with the residual add before it), the final norm before the LM head, the gated
activation before the down projection. Each is a launch of its own on the critical path that reads a
few KB and writes a vector the GEMV then reads. When the GEMV's kernel (``templates/gemv.cu``)
computes that vector per block into shared memory, the launch and its gap are gone; what it costs is
the prologue in every block and a GEMV of few, large blocks (each block computes all of A once).

Measured on the H200 (``benchmarks/gemv_sweep.py --mode prologue``, norm + GEMV pair against the fused
GEMV, each in a CUDA graph): an RMSNorm fused into gemma3-4b's qkv GEMV takes 0.87× the pair's time,
llama3-1b's qkv 0.93×, llama3-1b's gate-up (16,384 columns) 0.95×, but gemma3-4b's gate-up (20,480
columns) 1.01×: past ~16K columns the few-block GEMV streams slower than the many-block one. The
gated activation before down (2·k floats read per block, k = 8,192–10,240, no row reduction to save
a round trip for) takes 1.04–1.23×. So only inputs with a row reduction (a norm) fuse, into GEMVs of
at most :data:`PROLOGUE_MAX_COLS` columns (``$LUM_GEMV_PROLOGUE_MAX_COLS`` to measure others).

:func:`fuse_gemv_prologues` rewrites a lowered program: such an elementwise op whose every reader is
a GEMV of lum's kernel reading it as A becomes those GEMVs' ``params["expr"]`` (LLIR version 3, see
:mod:`lum.format.llir`) and is dropped. Prefill GEMMs (a dynamic m, cuBLASLt) and A operands the kernel
cannot compute (:func:`~lum.builder.gemv_policy.gemv_prologue_fits`) are left alone. ``LUM_GEMV_PROLOGUE=0``
turns it off (to measure what it gives).
"""

from __future__ import annotations

import os

from lum.builder.gemv_policy import gemv_prologue_fits, gemv_rows
from lum.builder.rewrite import readers, rewritten
from lum.format.expr import as_expr
from lum.format.llir import GEMM_DEFAULTS, LOp, Program, has_row_ops

__all__ = ["ENV_GEMV_PROLOGUE", "ENV_PROLOGUE_MAX_COLS", "PROLOGUE_MAX_COLS", "gemv_prologues_enabled",
           "prologue_max_cols", "fuse_gemv_prologues"]

ENV_GEMV_PROLOGUE = "LUM_GEMV_PROLOGUE"
PROLOGUE_MAX_COLS = 16384      # the widest GEMV (batch · n) a prologue measured faster for (see above)
ENV_PROLOGUE_MAX_COLS = "LUM_GEMV_PROLOGUE_MAX_COLS"


def gemv_prologues_enabled() -> bool:
    """On unless ``$LUM_GEMV_PROLOGUE`` is ``0``."""
    return os.environ.get(ENV_GEMV_PROLOGUE, "1") != "0"


def prologue_max_cols() -> int:
    """``$LUM_GEMV_PROLOGUE_MAX_COLS``, else :data:`PROLOGUE_MAX_COLS`: to measure wider prologue GEMVs
    (gemma3-4b's gate-up, 20,480 columns) as their loads change."""
    raw = os.environ.get(ENV_PROLOGUE_MAX_COLS)
    if raw is None:
        return PROLOGUE_MAX_COLS
    if not raw.isdigit():
        raise ValueError(f"${ENV_PROLOGUE_MAX_COLS} must be a non-negative integer, got {raw!r}")
    return int(raw)


def _tree(op: LOp) -> list | None:
    """The tree a GEMV may compute for this op: a Fused tree with a row reduction, else None."""
    if op.kind != "elementwise" or op.alias is not None or not op.dtype.is_float:
        return None
    if op.op == "Fused" and has_row_ops(op.params["expr"]):     # a norm: see the module docstring
        return op.params["expr"]
    return None


def _takes(gemm: LOp, producer: LOp) -> bool:
    """Whether ``gemm`` can compute ``producer`` (its A) as a prologue."""
    if gemm.kind != "gemm" or "expr" in gemm.params or gemm.args[0].src != producer.id:
        return False
    if gemm.args[1].src == producer.id:
        return False
    m = gemv_rows(gemm)
    cols = as_expr(gemm.params.get("batch", 1)) * as_expr(gemm.params["n"])
    if m is None or not cols.is_const or cols.value > prologue_max_cols():
        return False
    p = {k: gemm.params.get(k, GEMM_DEFAULTS.get(k)) for k in ("k", "lda", "batch", "offset_a")}
    return gemv_prologue_fits(m, p, gemm.params["layout"], tuple(as_expr(d) for d in producer.shape)) is None


def fuse_gemv_prologues(program: Program) -> Program:
    """``program`` with each GEMV input that only GEMVs read computed in those GEMVs (a new Program;
    op ids renumbered). Returns ``program`` itself when nothing fuses."""
    users_of = readers(program)
    fused: dict[int, LOp] = {}                  # producer id -> the op (its tree goes into its readers)
    for o in program.ops:
        users = users_of.get(o.id, [])
        if users and _tree(o) is not None and all(_takes(u, o) for u in users):
            fused[o.id] = o
    if not fused:
        return program
    replace = {}
    for o in program.ops:
        if o.kind == "gemm" and o.args[0].src in fused:
            f = fused[o.args[0].src]
            replace[o.id] = LOp(o.id, o.kind, o.op, (*f.args, o.args[1]), o.shape, o.dtype,
                                {**o.params, "expr": _tree(f)}, o.alias)
    return rewritten(program, set(fused), replace)
