"""Decode attention's combine inside o, split by head (on unless ``$LUM_O_COMBINE`` is ``0``; sm_90 and newer).

Decode attention leaves per query head and chunk of keys the partials [acc, c, l]; a reduce (the combine,
:func:`~lum.builder.row_codegen.online_softmax_sum`'s form) merges them into the head's output, and o (a decode
GEMV over all heads' outputs) reads that: two kernels and a link between them, ≈ 2.9 µs of a gemma3-4b layer in
benchmarks/o_combine_probe.py on an H100, where o with its input computed before took 10.4 µs of the 13.3 a link.
Each of o's blocks could combine the partials itself if it read only one head's, so here o is split over k by
head inside one kernel (``templates/gemv_combine.cu``): a thread block cluster per group of 64 output columns, a
block per head (with ``$LUM_O_COMBINE=grouped`` also a block per group of consecutive heads, where the heads are
more than a cluster's blocks: llama3-1b's 32 heads of 64 as 8 blocks of 4), which combines its heads' partials
and dots them with their weights (copied into shared memory before its wait); the blocks then push their columns
into the shared memory of the block that owns them, and after one cluster barrier each owner sums its columns
over the blocks in rank order. The LLIR keeps both ops, the launch table names the combine the kernel and o its
tail (the combine's output is never stored), and the sum over the heads is in a fixed order.

The other ways the probe measured lost more: the readers of o summing the heads' rows themselves (built first:
gemma's one-block residual kernels then read 8 × 10 KB, −1.6% on an H100), the cluster reading the heads' rows
back (two barriers), atomics (an order that varies). Only where the chunks fit two rounds of the kernel's loads
(:data:`MAX_CHUNKS`, by the kv cache's rows; past them the probe had the fused kernel slower, each round a
dependent round of loads and every column group re-reading every head's partials), and a block's inputs of o
(the heads it takes times their features) at most :data:`MAX_BLOCK_INPUTS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from lum.builder.env_switches import CodegenError, env_choice
from lum.builder.fused import joined_params
from lum.builder.gemv_policy import gemv_rows
from lum.builder.kernel_text import (ENTRY_PLACEHOLDER, STORAGE_C, KernelContext, KernelSource, Launch, common_header,
                                     entry_named, load_conv, load_template, render, store_conv, unravel_index)
from lum.builder.rewrite import readers
from lum.builder.row_codegen import online_softmax_sum
from lum.format.dtypes import DType
from lum.format.expr import Expr, Var, as_expr
from lum.format.llir import LOp, Program
from lum.format.shapetracker import ShapeTracker, numel

__all__ = ["ENV_O_COMBINE", "o_combine_enabled", "o_combine_grouped", "fuse_o_combines", "CombineLeaves",
           "combine_leaves", "MAX_CHUNKS", "MAX_RANKS", "MAX_BLOCK_INPUTS", "heads_a_block"]

ENV_O_COMBINE = "LUM_O_COMBINE"
ROUND = 16              # chunks a thread loads before it uses any (gemv_combine.cu ROUND)
MAX_CHUNKS = 2 * ROUND  # the most chunks a past may have for the split (probe: a win at 24 chunks, a loss at 55)
MAX_RANKS = 8           # blocks a cluster at most (the portable cluster size)
MAX_BLOCK_INPUTS = 512  # a block's inputs of o (heads a block × a head's features) at most: its threads
COLS = 64               # output columns a block
_VEC_DTYPES = (DType.bf16, DType.f16, DType.f32)


def _mode() -> str | None:
    return env_choice(ENV_O_COMBINE, {"0": None, "1": "heads", "grouped": "grouped"}, "1")


def o_combine_enabled() -> bool:
    """``$LUM_O_COMBINE``: ``1`` (the default) splits o by head with the combine inside it where the heads are a
    cluster's blocks at most, ``grouped`` also where they are more (consecutive heads a block), ``0`` keeps both
    kernels. Measured on an H100 (benchmarks/NOTES.md, same-run pairs, tokens equal): gemma3-4b bf16 +0.4%, +0.3%
    and −0.3%; llama3-1b ``grouped`` −0.2% twice, so llama's 32 heads keep two kernels by default."""
    return _mode() is not None


def o_combine_grouped() -> bool:
    """Whether ``$LUM_O_COMBINE`` is ``grouped``: heads past a cluster's blocks grouped into its blocks."""
    return _mode() == "grouped"


@dataclass(frozen=True)
class CombineLeaves:
    """The arg indices of a combine's leaves: X (the chunks' offsets), L (their sums), A (their accumulators),
    K (the scale of the maximum, one value)."""

    x: int
    l: int
    a: int
    k: int


def combine_leaves(op: LOp) -> CombineLeaves | None:
    """The leaves of a reduce whose prologue is the combine with every part a plain leaf, over its last axis."""
    if op.kind != "reduce" or op.op != "Sum" or "expr" not in op.params or int(op.params["axis"]) != len(op.shape):
        return None
    on = online_softmax_sum(op.params["expr"])
    if on is None:
        return None

    def other(mul: list) -> list | None:
        if mul[0] != "Mul" or len(mul) != 4:
            return None
        for p, q in ((mul[2], mul[3]), (mul[3], mul[2])):
            if p[0] == "Exp2" and p[2][0] == "Add":
                return q
        return None

    parts = [on.x, other(on.el), other(on.ea), on.k]
    if any(t is None or t[0] != "arg" for t in parts):
        return None
    k = op.args[int(on.k[1])].view
    if any(not as_expr(st).is_const or as_expr(st).value != 0 for st in k.strides[-2:]):
        return None                      # K one value a head (the kernel reads it at feature 0, chunk 0)
    return CombineLeaves(*(int(t[1]) for t in parts))


@dataclass(frozen=True)
class _Split:
    combine: LOp
    o: LOp
    leaves: CombineLeaves
    heads: int
    hpb: int
    d: int
    n: int


def heads_a_block(heads: int, d: int) -> int | None:
    """The heads each block of the fused kernel takes: the fewest that divide ``heads`` into at most
    :data:`MAX_RANKS` blocks a cluster, a whole number of 16-byte vectors' worth of features being the caller's
    check; None where that is more than :data:`MAX_BLOCK_INPUTS` inputs a block."""
    for hpb in range(1, heads + 1):
        if heads % hpb == 0 and heads // hpb <= MAX_RANKS:
            return hpb if hpb * d <= MAX_BLOCK_INPUTS else None
    return None


def _static(e: Any) -> int | None:
    e = as_expr(e)
    return e.value if e.is_const else None


def _max_chunks(program: Program, combine: LOp, max_dyn: Mapping[str, int] | None) -> int | None:
    """The most chunks ``combine`` can reduce: the attention feeding it has its kv cache's rows over its chunk;
    otherwise the chunk axis's bound under ``max_dyn``; None where neither bounds it."""
    att = program.ops[combine.args[0].src]
    if att.kind == "attention" and "chunk" in att.params:
        view = att.args[1].view
        step, cache = _static(view.strides[-2]), _static(numel(program.ops[att.args[1].src].shape))
        if step and cache is not None:
            return -(-(cache // step) // int(att.params["chunk"]))
    ns = as_expr(combine.args[0].view.shape[-1])
    if any(v not in (max_dyn or {}) for v in ns.vars()):
        return None
    return int(ns.bounds({v: (0, int(hi)) for v, hi in (max_dyn or {}).items()})[1])


def _split(program: Program, o: LOp, users: Mapping[int, list[LOp]],
           max_dyn: Mapping[str, int] | None = None) -> _Split | None:
    """The combine and o of a split (the module docstring), or None."""
    if o.kind != "gemm" or gemv_rows(o) != 1 or "expr" in o.params or "epilogue" in o.params \
            or o.params.get("layout") != "RmCm" or len(o.args) != 2:
        return None
    combine = program.ops[o.args[0].src]
    leaves = combine_leaves(combine)
    if leaves is None or [u.id for u in users.get(combine.id, [])] != [o.id]:
        return None
    d, total = _static(combine.shape[-1]), _static(numel(combine.shape))
    p = {k: _static(o.params.get(k, v)) for k, v in (("batch", 1), ("k", None), ("n", None), ("offset_a", 0),
                                                     ("offset_b", 0), ("ldb", None), ("m", 1))}
    if None in (d, total, *p.values()) or p["batch"] != 1 or p["m"] != 1 or p["offset_a"] != 0 or p["k"] != total:
        return None
    if o.args[0].view != ShapeTracker.contiguous((total,)) or total // d < 2:
        return None
    b_dt, a_dt = program.ops[o.args[1].src].dtype, combine.dtype
    if b_dt not in _VEC_DTYPES or a_dt not in _VEC_DTYPES or o.dtype not in _VEC_DTYPES:
        return None
    hpb = heads_a_block(total // d, d)
    if hpb is None or (hpb > 1 and not o_combine_grouped()):
        return None
    vec = 16 // b_dt.itemsize
    vectors = hpb * d // vec
    if d % vec or vectors & (vectors - 1) or p["ldb"] % vec or p["offset_b"] % vec:
        return None
    if program.ops[o.args[1].src].kind != "input" or o.args[1].view.mask is not None:
        return None
    chunks = _max_chunks(program, combine, max_dyn)
    if chunks is None or chunks > MAX_CHUNKS:
        return None
    return _Split(combine, o, leaves, total // d, hpb, d, p["n"])


def fuse_o_combines(program: Program, sources: Mapping[int, KernelSource | None], dyn_vars: Sequence[str],
                    max_dyn: Mapping[str, int] | None = None, arch: str = "sm_90") -> dict[int, KernelSource | None]:
    """``sources`` with each combine and the o that reads it as one kernel under the combine, o's entry dropped
    (:attr:`KernelSource.tails` names it); unchanged for an ``arch`` before sm_90 (no thread block clusters)."""
    out = dict(sources)
    if int(arch.removeprefix("sm_")) < 90:
        return out
    users = readers(program)
    for o in program.ops:
        s = _split(program, o, users, max_dyn)
        if s is None or any(sources.get(i) is None or sources[i].tails for i in (s.combine.id, o.id)):
            continue
        try:
            out[s.combine.id] = _fused(program, s, sources[s.combine.id], sources[o.id], dyn_vars, max_dyn)
        except CodegenError:
            continue
        out.pop(o.id, None)
    return out


def _fused(program: Program, split: _Split, ks_c: KernelSource, ks_o: KernelSource,
           dyn_vars: Sequence[str], max_dyn: Mapping[str, int] | None) -> KernelSource:
    """The kernel of a combine and the o split by head after it (templates/gemv_combine.cu); ``split`` is
    :func:`_split`'s, which checked the weights' placement."""
    combine, o, leaves, d, heads, n = split.combine, split.o, split.leaves, split.d, split.heads, as_expr(split.n)
    hpb = split.hpb
    ranks, db = heads // hpb, hpb * d
    ctx = KernelContext(tuple(dyn_vars), max_dyn=dict(max_dyn) if max_dyn else None)
    w_dt, r_dt, p_dt = program.ops[o.args[1].src].dtype, combine.dtype, o.dtype
    vec = 16 // w_dt.itemsize
    vectors = db // vec
    lpc, nv = min(32, vectors), max(1, vectors // 32)
    threads = max(64, -(-max(db, 2 * ROUND * hpb) // 32) * 32)
    segs, warps = 32 // lpc, threads // 32
    if COLS % (warps * segs):
        raise CodegenError(f"{COLS} columns do not split over {warps} warps of {segs} segments")
    cps = COLS // (warps * segs)
    if cps & (cps - 1):
        raise CodegenError("a segment's columns must be a power of two")
    params, _ = joined_params([ks_c.params, ks_o.params])
    names = [p.name for p in params]
    out_p, w_p = "t0_out", "t0_in1"
    if out_p not in names or w_p not in names:
        raise CodegenError("a split o's kernel parameters are not (out, in0, in1)")
    # the combine's domain: its output dims (heads' dims, then the feature) and the chunk axis last
    head_shape = tuple(combine.shape[:-1])
    setup = unravel_index(ctx, "lum_h", head_shape, " " * 4).rstrip("\n")
    hidx = [Var(f"lum_i{i}") for i in range(len(head_shape))]
    lum_d, lum_j = Var("lum_d"), Var("lum_j")
    ctx.bound_var("lum_d", as_expr(d))
    ns = as_expr(combine.args[0].view.shape[-1])         # the chunks
    ctx.bound_var("lum_j", ns + ROUND)
    ctx.var_bounds["lum_h"] = (0, heads - 1)
    ctx.var_bounds["lum_r"] = (0, ranks - 1)

    def at(k: int, feature: Expr) -> str:
        view = combine.args[k].view
        if view.mask is not None:
            raise CodegenError("a split o's combine reads its partials unpadded")
        e = view.physical_index(tuple(hidx) + (feature, lum_j))
        ctx.exprs.append(e)
        return ctx.c(e)

    dts = [program.ops[a.src].dtype for a in combine.args]
    kview = combine.args[leaves.k].view
    k_val = load_conv(dts[leaves.k], f"in{leaves.k}[{ctx.c(kview.physical_index(tuple(hidx) + (as_expr(0),) * 2))}]")
    p = {k: as_expr(o.params.get(k, v)) for k, v in (("ldb", None), ("offset_b", 0))}
    lum_c, lum_k = Var("lum_c"), Var("lum_k")
    ctx.bound_var("lum_c", n + COLS)
    ctx.bound_var("lum_k", as_expr(db))
    b_at = p["offset_b"] + lum_c * p["ldb"] + Var("lum_r") * db + lum_k       # B(r·DB + k, column c)
    out_at = lum_c
    ctx.exprs += [b_at, out_at]
    groups = -(-n.value // COLS)
    body = render(load_template("gemv_combine.cu"), {
        "KERNEL": ENTRY_PLACEHOLDER, "THREADS": threads, "MIN_BLOCKS": ", 3" if 3 * threads <= 2048 else "",
        "IDX_T": "@IDX_T@", "PARAMS": ", ".join(pp.ctype for pp in params), "DYN_LOADS": "@DYN_LOADS_NOWAIT@",
        "D": d, "COLS": COLS, "ROUND": ROUND, "VEC": vec, "LPC": lpc, "NV": nv, "CPS": cps, "HPB": hpb,
        "RANKS": ranks, "GROUPS": groups,
        "W_T": STORAGE_C[w_dt], "W_PTR": w_p, "W_LOAD": load_conv(w_dt, "lum_wv[e]"),
        "R_ROUND": load_conv(r_dt, store_conv("f", "lum_y", r_dt)), "OUT": out_p,
        "OUT_STORE": store_conv("f", "lum_v0", p_dt),
        "NS": ctx.c(ns), "N": ctx.c(n), "SETUP": setup, "K_VAL": k_val,
        "X_AT": at(leaves.x, as_expr(0)), "L_AT": at(leaves.l, as_expr(0)), "A_AT": at(leaves.a, lum_d),
        "X_LOAD": load_conv(dts[leaves.x], f"in{leaves.x}[lum_q]"),
        "L_LOAD": load_conv(dts[leaves.l], f"in{leaves.l}[lum_q]"),
        "A_LOAD": load_conv(dts[leaves.a], f"in{leaves.a}[lum_q]"),
        "B_AT": ctx.c(b_at), "OUT_AT": ctx.c(out_at)})
    idx_t = "int" if ctx.fits_i32(COLS) else "long long"
    nowait, slots = ctx.dyn_loads(wait=False)
    body, name = entry_named(body.replace("@IDX_T@", idx_t).replace("@DYN_LOADS_NOWAIT@", nowait), "o_combine",
                             "lum_reduce_sum_o_")
    smem = COLS * db * w_dt.itemsize
    tuning = {"threads": threads, "cols": COLS, "round": ROUND, "heads_a_block": hpb,
              "o_combine": [combine.id, o.id], "index_bits": 32 if idx_t == "int" else 64}
    grid = (as_expr(ranks * groups), as_expr(1), as_expr(1))
    return KernelSource(name=name, kind=combine.kind, op=combine.op, source=common_header() + "\n" + body,
                        body=body, launches=(Launch(name, grid, (threads, 1, 1), smem, ranks),),
                        params=tuple(params), dyn_vars=tuple(dyn_vars), dyn_slots=slots, tuning=tuning,
                        tails=(o.id,), early=(w_p,))
