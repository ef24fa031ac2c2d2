"""GEMV prologues: a decode GEMV computes its input vector itself instead of reading a buffer.

In a decode step the input of most weight GEMVs is a one-row kernel: the RMSNorm before the qkv and
gate/up projections (with the residual add before it), the gated activation before the down
projection, the final norm before the LM head. Each is a launch of its own on the critical path
(≈ 2–4 µs with its gap on the H200) that reads a few KB and writes a vector the GEMV then reads. When
the GEMV's kernel (``templates/gemv.cu``) computes that vector per block into shared memory, the
launch is gone, and the block's first weight loads are issued before the vector is computed, so HBM
keeps streaming meanwhile.

:func:`fuse_gemv_prologues` rewrites a lowered program: an elementwise op (a Fused tree, row
reductions included) whose every reader is a GEMV of lum's kernel reading it as A becomes those GEMVs'
``params["expr"]`` (LLIR version 3, see :mod:`lum.format.llir`) and is dropped. Prefill GEMMs (a
dynamic m, cuBLASLt) and A operands the kernel cannot compute (:func:`~lum.builder.codegen.gemv_prologue_fits`)
are left alone. ``LUM_GEMV_PROLOGUE=0`` turns it off (to measure what it gives).
"""

from __future__ import annotations

import os

from lum.builder import costmodel
from lum.builder.codegen import gemv_prologue_fits, gemv_rows
from lum.format.expr import as_expr
from lum.format.llir import ELEMENTWISE_ARITY, GEMM_DEFAULTS, Arg, LOp, Program

__all__ = ["ENV_GEMV_PROLOGUE", "gemv_prologues_enabled", "fuse_gemv_prologues"]

ENV_GEMV_PROLOGUE = "LUM_GEMV_PROLOGUE"


def gemv_prologues_enabled() -> bool:
    """On unless ``$LUM_GEMV_PROLOGUE`` is ``0``."""
    return os.environ.get(ENV_GEMV_PROLOGUE, "1") != "0"


def _tree(op: LOp) -> list | None:
    """The expression tree an elementwise op computes (its own for Fused), or None when it is not one."""
    if op.kind != "elementwise" or op.alias is not None or not op.dtype.is_float:
        return None
    if op.op == "Fused":
        return op.params["expr"]
    if op.op == "Contiguous" or op.op not in ELEMENTWISE_ARITY:
        return None
    return [op.op, op.dtype.value, *(["arg", k] for k in range(len(op.args)))]


def _takes(gemm: LOp, producer: LOp) -> bool:
    """Whether ``gemm`` can compute ``producer`` (its A) as a prologue."""
    if gemm.kind != "gemm" or "expr" in gemm.params or gemm.args[0].src != producer.id:
        return False
    if gemm.args[1].src == producer.id:
        return False
    m = gemv_rows(gemm)
    if m is None:
        return False
    p = {k: gemm.params.get(k, GEMM_DEFAULTS.get(k)) for k in ("k", "lda", "batch", "offset_a")}
    return gemv_prologue_fits(m, p, gemm.params["layout"], tuple(as_expr(d) for d in producer.shape)) is None


def fuse_gemv_prologues(program: Program) -> Program:
    """``program`` with each GEMV input that only GEMVs read computed in those GEMVs (a new Program;
    op ids renumbered). Returns ``program`` itself when nothing fuses."""
    readers: dict[int, list[LOp]] = {}
    for o in program.ops:
        for a in o.args:
            readers.setdefault(a.src, []).append(o)
    fused: dict[int, LOp] = {}                  # producer id -> the op (its tree goes into its readers)
    for o in program.ops:
        users = readers.get(o.id, [])
        if users and _tree(o) is not None and all(_takes(u, o) for u in users):
            fused[o.id] = o
    if not fused:
        return program
    new_id: dict[int, int] = {}
    ops: list[LOp] = []
    for o in program.ops:
        if o.id in fused:
            continue
        new_id[o.id] = len(ops)
        args, params = o.args, o.params
        if o.kind == "gemm" and o.args[0].src in fused:
            f = fused[o.args[0].src]
            args, params = (*f.args, o.args[1]), {**o.params, "expr": _tree(f)}
        ops.append(LOp(len(ops), o.kind, o.op, tuple(Arg(new_id[a.src], a.view) for a in args), o.shape, o.dtype,
                       params, o.alias, o.bytes, o.flops))
    out = Program(program.name, ops)
    for o in out.ops:
        if o.kind == "gemm" and "expr" in o.params:
            o.bytes, o.flops = costmodel.op_bytes(o, out), costmodel.op_flops(o)
    return out
