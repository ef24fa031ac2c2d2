"""The attention combine inside the attention kernel: one launch less on every layer's critical path.

Decode attention is two LLIR ops (:func:`~lum.builder.extract.attention_ops`): the attention op stores
each chunk's partials, and a reduce over the chunk axis combines them. As two kernels, the combine is a
launch of its own between attention and the o projection, whose work (a few KB through L2) is less than
a kernel boundary costs. Here the attention kernel runs it (``templates/attention.cu`` COMBINE), once a
kv row's chunks have all stored their partials, in one of two ways (``$LUM_ATTENTION_COMBINE``):

* ``1``, counted: the block that finishes a kv row's last chunk, counted on a per-kv-row counter (an
  acquire-release atomic at GPU scope), combines that row's query rows;
* ``cluster`` (sm_90): a thread block cluster per kv row (up to 8 blocks, the portable size), its blocks
  taking the row's chunks in turn; after the cluster's hardware barrier its blocks each combine a part of
  the row's query rows. No atomic, no block that runs after all the others, every block of the row busy.

A combine here runs while other kv rows' chunks are still being computed (not by the last block of the
whole grid); the LLIR is unchanged (the reference backend and the buffer plan see the same two ops). The
launch table names the combine a tail of the attention op (table version 2), and the loader keeps every
buffer a kernel with tails reads alive until its last tail (:meth:`lum.loader.model.Package.buffers`), so
the combine's output never takes the place of an input the other blocks still read.

Only the combine :func:`~lum.builder.extract.attention_ops` builds is fused: the reduce right after its
attention op (nothing but constants between), its one reader, with exactly that tree over the partials
and a constant −1. An attention kernel that also runs its stage (:mod:`lum.builder.attention_stage`) keeps
its combine. Off unless ``$LUM_ATTENTION_COMBINE`` says otherwise: both forms **measured slower** on the H200
than the two kernels under programmatic launch (benchmarks/NOTES.md). Counted: a4989c4, gemma3-4b bf16 339.3
tok/s against 355.4, llama3-1b 992.0 against 1,033.3; with the stage, b39abf7, 362.8 against 381.9 and 1,052.3
against 1,097.4. In clusters (b39abf7, same runs): 375.9 (−1.6%) and 1,056.7 (−3.7%), tokens equal.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from lum.builder.codegen import CodegenError, KernelSource, generate, split_gemv_tuning
from lum.builder.extract import attention_ops
from lum.builder.rewrite import readers
from lum.format.dtypes import DType
from lum.format.llir import LOp, Program

__all__ = ["ENV_ATTENTION_COMBINE", "COMBINE_MODES", "attention_combine_mode", "combine_of",
           "fuse_attention_combines"]

ENV_ATTENTION_COMBINE = "LUM_ATTENTION_COMBINE"
COMBINE_MODES = {"0": None, "1": "counted", "cluster": "cluster"}


def attention_combine_mode() -> str | None:
    """``$LUM_ATTENTION_COMBINE``: ``1`` fuses each decode attention's combine into its kernel, counted;
    ``cluster`` in a thread block cluster per kv row (sm_90; elsewhere the combine keeps its kernel); ``0``
    (the default) keeps it a kernel of its own. Returns None, ``"counted"`` or ``"cluster"``."""
    v = os.environ.get(ENV_ATTENTION_COMBINE, "0")
    if v not in COMBINE_MODES:
        raise ValueError(f"${ENV_ATTENTION_COMBINE} must be one of {', '.join(COMBINE_MODES)}, got {v!r}")
    return COMBINE_MODES[v]


def combine_of(program: Program, att: LOp) -> LOp | None:
    """The combine reduce of attention op ``att`` that its kernel may run (see the module docstring), or None."""
    if att.kind != "attention":
        return None
    users = {u.id: u for u in readers(program).get(att.id, [])}
    if len(users) != 1:
        return None
    (comb,) = users.values()
    between = program.ops[att.id + 1:comb.id]
    if comb.id <= att.id or any(o.kind != "constant" for o in between):
        return None
    neg = program.ops[comb.args[-1].src]
    if neg.kind != "constant" or float(neg.params.get("value", 0.0)) != -1.0:
        return None
    want = attention_ops(att.args, att.params["scale"], DType.parse(att.params["p_dtype"]), comb.dtype, att.id,
                         att.params["chunk"])[2]
    same_reads = [a.src for a in comb.args[:3]] == [att.id] * 3 and \
        [a.view for a in comb.args] == [a.view for a in want.args]
    if comb.kind != want.kind or comb.op != want.op or comb.params != want.params or not same_reads \
            or tuple(comb.shape) != tuple(want.shape):
        return None
    return comb


def fuse_attention_combines(program: Program, sources: Mapping[int, KernelSource | None], dyn_vars: Sequence[str],
                            max_dyn: Mapping[str, int] | None = None, tuning: Mapping[str, Any] | None = None,
                            cluster: bool = False) -> dict[int, KernelSource | None]:
    """``sources`` with each attention kernel whose combine fuses (:func:`combine_of`) regenerated to run it
    (``cluster``: in a cluster per kv row, else counted), and the combine's own entry dropped. ``tuning``: the
    group's (the attention kernel's own parameters)."""
    common = {k: v for k, v in split_gemv_tuning(tuning or {})[0].items() if k != "max_dyn"}
    out = dict(sources)
    for op in program.ops:
        comb = combine_of(program, op) if sources.get(op.id) is not None else None
        if comb is None or sources.get(comb.id) is None:
            continue
        dts = [program.ops[a.src].dtype for a in op.args]
        try:
            ks = generate(op, dyn_vars, arg_dtypes=dts, max_dyn=dict(max_dyn or {}) or None, combine=comb,
                          combine_cluster=cluster, **common)
        except CodegenError:
            continue
        out[op.id] = ks
        out.pop(comb.id)
    return out
