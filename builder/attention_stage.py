"""Attention stages: decode attention computes the small ops before it, which then have no kernel.

Between a decode layer's qkv projection and its attention come q's norm and RoPE, k's norm and RoPE with
its kv-cache write, and v's cache write (llama: RoPE and the writes). As sibling kernels
(:mod:`lum.builder.siblings`) they are one launch, but still a dependent kernel of their own on the
critical path, ≈ 4.6 µs of gemma3-4b's layer in the ad85663 profile, while each of them reads a few KB.
Here the attention kernel runs them (``templates/attention.cu`` STAGE):

* every work item's block computes the query rows of its kv row (a warp a row, into shared memory: its
  ``LOAD_Q`` reads them there), so q is never stored;
* the block whose chunk holds the new row's position (or chunk 0, for a position past the keys) computes
  the k and v rows of its kv row and writes them into the cache, and, after a ``__syncthreads``, reads its
  chunk as before: its own stores are visible to it, and no other block reads that row.

Each op's row is :func:`~lum.builder.codegen.stage_row`'s device function, the very row code of its own
kernel, so the values stored are the unfused ones. :func:`fuse_attention_stages` takes each attention op
whose

* q is an elementwise Fused op that only this attention reads, every query row of kv row h, m at the
  physical index of one of its rows, contiguous;
* k and v are scatter_nocopy ops (the cache writes, with a prologue or plain copies) read by nothing before the attention,
  whose rows are, one to one, the kv rows the attention reads, at the attention's strides;
* and these four are kernel ops in a row (only inputs and constants between them),

with every row map affine in h and m. The LLIR is unchanged; the launch table names the first of the
three ops the kernel and the others its tails, the attention last (table version 2), as for siblings.

On unless ``$LUM_ATTENTION_STAGE`` is ``0``. Measured on the H200 (27c5c45, same runs, tokens equal):
gemma3-4b bf16 357.6 tok/s against 353.7 without (+1.1%), llama3-1b bf16 1,059.6 against 1,046.4 (+1.3%).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping, Sequence

import numpy as np

from lum.builder.attention_policy import attention_row_dims
from lum.builder.codegen import AttentionStage, CodegenError, StageRow, generate, stage_row
from lum.builder.env_switches import env_switch
from lum.builder.gemv_policy import split_gemv_tuning
from lum.builder.kernel_text import ENTRY_PLACEHOLDER, KernelSource, common_header, entry_named
from lum.builder.rewrite import readers
from lum.builder.fused import ENTRY_RE, NO_WORK, joined_params
from lum.format.expr import as_expr
from lum.format.llir import LOp, Program, attention_dims

__all__ = ["ENV_ATTENTION_STAGE", "attention_stage_enabled", "stage_ops",
           "fuse_attention_stages"]

ENV_ATTENTION_STAGE = "LUM_ATTENTION_STAGE"


def attention_stage_enabled() -> bool:
    """``$LUM_ATTENTION_STAGE``: ``1`` (the default) has decode attention compute its q rows and kv-cache writes,
    ``0`` keeps them kernels of their own."""
    return env_switch(ENV_ATTENTION_STAGE, default=True)


def stage_ops(program: Program, att: LOp) -> tuple[LOp, LOp, LOp] | None:
    """(q, k, v): the ops attention ``att`` may compute (the module docstring's structure; the row maps are
    :func:`_stage`'s to check), or None."""
    if att.kind != "attention" or len(att.args) != 4:
        return None
    q, k, v = (program.ops[a.src] for a in att.args[:3])
    if q.kind != "elementwise" or q.op != "Fused" or "expr" not in q.params or q.alias is not None:
        return None
    if any(o.kind != "scatter_nocopy" or ("expr" not in o.params and len(o.args) != 3) for o in (k, v)) \
            or len({q.id, k.id, v.id}) < 3:
        return None
    users = readers(program)
    if [u.id for u in users.get(q.id, [])] != [att.id]:
        return None
    if any(u.id < att.id for o in (k, v) for u in users.get(o.id, []) if u.id != att.id):
        return None
    first = min(q.id, k.id, v.id)
    between = [o for o in program.ops[first:att.id] if o.kind not in NO_WORK]
    if sorted(o.id for o in between) != sorted((q.id, k.id, v.id)):
        return None
    return q, k, v


def _affine(values: Mapping[tuple[int, ...], int]) -> tuple[int, ...] | None:
    """(c0, c1, …) with value = c0 + Σ c_i · key_i for every key of ``values``, or None."""
    keys = list(values)
    zero = tuple(0 for _ in keys[0])
    if zero not in values:
        return None
    coef = [values[zero]]
    for i in range(len(zero)):
        unit = tuple(1 if j == i else 0 for j in range(len(zero)))
        coef.append(values[unit] - values[zero] if unit in values else 0)
    ok = all(values[key] == coef[0] + sum(c * x for c, x in zip(coef[1:], key)) for key in keys)
    return tuple(coef) if ok else None


def _stage(att: LOp, rows: Mapping[str, StageRow]) -> AttentionStage:
    """The row maps of ``att``'s stage (:class:`AttentionStage`); CodegenError where a row is not where the
    attention reads it."""
    r, t, d, dv = attention_dims(att)
    vq, vk, vv = (a.view for a in att.args[:3])
    zero = as_expr(0)
    group, heads = attention_row_dims(att)
    if not all(r[i].is_const for i in range(len(r))) or not (d.is_const and dv.is_const):
        raise CodegenError("an attention stage needs static kv rows, query rows and features")
    h_dims, m_dims = tuple(r[i].value for i in heads), tuple(r[i].value for i in group)
    n_h, n_m = math.prod(h_dims), math.prod(m_dims)

    def index(h: int, m: int) -> tuple:
        """The row index of kv row h, query row m (row-major over the heads' and the group's dims)."""
        idx = [zero] * len(r)
        for dims, flat, pos in ((h_dims, h, heads), (m_dims, m, group)):
            for i, x in zip(pos, np.unravel_index(flat, dims) if dims else ()):
                idx[i] = as_expr(int(x))
        return tuple(idx)

    def const(e) -> int:
        e = as_expr(e).simplify()
        if not e.is_const:
            raise CodegenError("an attention stage's rows must be at static places")
        return e.value

    qrow = rows["q"]
    if qrow.n != d.value or qrow.col_stride != 1 or const(vq.strides[-1]) != 1:
        raise CodegenError("the q op's rows are not the attention's contiguous query rows")
    where = {b: i for i, b in enumerate(qrow.bases)}
    q_of, qb_of = {}, {}
    for h in range(n_h):
        for m in range(n_m):
            b = const(vq.physical_index(index(h, m) + (zero,)))
            if b not in where:
                raise CodegenError("a query row the attention reads is no row of the q op")
            q_of[(h, m)], qb_of[(h, m)] = where[b], b
    maps = {"q": _affine(q_of), "qb": _affine(qb_of)}
    for role, view, width in (("k", vk, d.value), ("v", vv, dv.value)):
        row = rows[role]
        if row.n != width or row.col_stride != const(view.strides[-1]) or row.row_step != const(view.strides[-2]) \
                or row.rows != n_h:
            raise CodegenError(f"the {role} cache write's rows are not the attention's kv rows")
        where = {b: i for i, b in enumerate(row.bases)}
        of = {}
        for h in range(n_h):
            kv = tuple(zero if i in group else x for i, x in enumerate(index(h, 0)))
            b = const(view.physical_index(kv + (zero, zero)))
            if b not in where:
                raise CodegenError(f"a {role} row the attention reads is no row of its cache write")
            of[(h,)] = where[b]
        if sorted(of.values()) != list(range(row.rows)):
            raise CodegenError(f"the {role} cache write has rows the attention does not read")
        maps[role] = _affine(of)
    if any(x is None for x in maps.values()):
        raise CodegenError("an attention stage's row maps must be affine in the kv row and the query row")
    return AttentionStage(maps["q"], maps["qb"], maps["k"], maps["v"])


def fuse_attention_stages(program: Program, sources: Mapping[int, KernelSource | None], dyn_vars: Sequence[str],
                          max_dyn: Mapping[str, int] | None = None, tuning: Mapping[str, Any] | None = None
                          ) -> dict[int, KernelSource | None]:
    """``sources`` with each attention whose stage fuses (the module docstring) as one kernel under the first
    of its q / k / v ops, whose other entries are dropped (:attr:`KernelSource.tails` names them)."""
    common = {k: v for k, v in split_gemv_tuning(tuning or {})[0].items() if k != "max_dyn"}
    out = dict(sources)
    for att in program.ops:
        ks = sources.get(att.id)
        ops = stage_ops(program, att) if ks is not None and not ks.tails else None
        if ops is None or any(sources.get(o.id) is None or sources[o.id].tails for o in ops):
            continue
        try:
            fused = _fuse(program, att, ops, dyn_vars, max_dyn, common)
        except CodegenError:
            continue
        run = sorted(ops, key=lambda o: o.id)
        out[run[0].id] = fused
        for o in (*run[1:], att):
            out.pop(o.id, None)
    return out


def _dts(program: Program, op: LOp) -> list:
    return [program.ops[a.src].dtype for a in op.args]


def _fuse(program: Program, att: LOp, ops: tuple[LOp, LOp, LOp], dyn_vars: Sequence[str],
          max_dyn: Mapping[str, int] | None, common: Mapping[str, Any]) -> KernelSource:
    """The attention kernel running its stage's rows (``templates/attention.cu`` STAGE); CodegenError where it
    cannot. Each block lets the next kernel launch after its stage's barrier, not as it starts: under
    programmatic launch o's blocks (behind the combine) copy their weights into shared memory once resident,
    and those copies shared the bus with the stage's reads (gemma3-4b's stage 2.72 → 1.76 µs; llama3-1b +0.6%
    in three same-run pairs, gemma3-4b ±0: 2d7e1fb, 67ad255)."""
    md = dict(max_dyn or {}) or None
    rows = {role: stage_row(op, dyn_vars, f"{ENTRY_PLACEHOLDER}_{role}", arg_dtypes=_dts(program, op), max_dyn=md)
            for role, op in zip("qkv", ops)}
    ks = generate(att, dyn_vars, arg_dtypes=_dts(program, att), max_dyn=md,
                  stage=_stage(att, rows), **common)
    body = ks.body.replace(ks.name, f"{ENTRY_PLACEHOLDER}_attn")
    if len(ENTRY_RE.findall(body)) != 1:
        raise CodegenError("an attention stage needs an attention body of exactly one kernel")   # pragma: no cover
    body = ENTRY_RE.sub(f"template <class LumQ, class LumK, class LumV>\n__device__ __forceinline__ void "
                         f"{ENTRY_PLACEHOLDER}_attn(LumQ lum_qrow, LumK lum_krow, LumV lum_vrow, ", body, count=1)
    body = body.replace("__restrict__ ", "")    # it reads the cache rows its own stage writes
    run = sorted((*ops, att), key=lambda o: o.id)
    role_of = {op.id: role for role, op in zip("qkv", ops)}
    joined = [ks.params if op.id == att.id else rows[role_of[op.id]].params for op in run]
    params, calls = joined_params(joined)
    args = {op.id: call for op, call in zip(run, calls)}
    q, k, v = (args[o.id] for o in ops)
    window, wargs = "long long w0, long long w1, long long wT, bool wf", "w0, w1, wT, wf"
    entry = "\n".join([
        f'extern "C" __global__ void __launch_bounds__({ks.block[0]}) '
        f'{ENTRY_PLACEHOLDER}({", ".join(p.ctype for p in params)}) {{',
        f"  {ENTRY_PLACEHOLDER}_attn(",
        f"      [&](long long r, bool live, LumSink s) {{ {ENTRY_PLACEHOLDER}_q(r, live, s, {q}); }},",
        f"      [&](long long r, bool live, {window}) {{ {ENTRY_PLACEHOLDER}_k(r, live, {wargs}, {k}); }},",
        f"      [&](long long r, bool live, {window}) {{ {ENTRY_PLACEHOLDER}_v(r, live, {wargs}, {v}); }},",
        f"      {args[att.id]});",
        "}"])
    body = "\n".join([rows["q"].function, rows["k"].function, rows["v"].function, body, entry])
    head = run[0]
    body, name = entry_named(body, f"stage/{head.kind}/{head.op}",
                             f"lum_{head.kind}_{(head.op or head.kind).lower()}_stage_")
    slots = dict(ks.dyn_slots)
    for row in rows.values():
        slots.update(row.dyn_slots)
    return KernelSource(name=name, kind=head.kind, op=head.op, source=common_header() + "\n" + body, body=body,
                        launches=(replace(ks.launches[0], kernel=name),), params=tuple(params), dyn_vars=ks.dyn_vars,
                        dyn_slots=dict(sorted(slots.items(), key=lambda kv: kv[1])),
                        tuning={**ks.tuning, "stage": [o.id for o in run[:-1]],
                                "stage_trigger": True},
                        tails=tuple(o.id for o in run[1:]))
