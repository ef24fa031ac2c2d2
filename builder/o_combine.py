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
                                     convert_kind, entry_named, load_conv, load_template, render, store_conv, tree_c,
                                     unravel_index, value_kind)
from lum.builder.rewrite import readers
from lum.builder.row_codegen import online_softmax_sum
from lum.format.dtypes import DType
from lum.format.expr import Expr, Var, as_expr
from lum.format.llir import LOp, Program, has_row_ops
from lum.format.shapetracker import ShapeTracker, numel

__all__ = ["ENV_O_COMBINE", "o_combine_enabled", "o_combine_grouped", "fuse_o_combines", "CombineLeaves",
           "combine_leaves", "owner_slots", "MAX_CHUNKS", "MAX_RANKS", "MAX_BLOCK_INPUTS", "heads_a_block"]

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


def owner_slots(program: Program, o: LOp) -> tuple[int, int, int] | None:
    """(column groups, ranks, columns a group) of the cluster kernel ``o`` runs in (column g·COLS + i·ranks + r
    is summed by the block of rank r), where the switch splits it and the ranks divide a group evenly; else None.
    The dyn bounds are not known here: a combine bounded only by them does not count."""
    s = _split(program, o, readers(program)) if o_combine_enabled() else None
    if s is None or not s.n % COLS == 0 or COLS % (s.heads // s.hpb):
        return None
    return s.n // COLS, s.heads // s.hpb, COLS


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
        tails = [t for t in _slot_tails(program, s) if sources.get(t.id) is not None and not sources[t.id].tails]
        try:
            out[s.combine.id] = _fused(program, s, sources[s.combine.id], sources[o.id], dyn_vars, max_dyn,
                                       [(t, sources[t.id]) for t in tails])
        except CodegenError:
            continue
        for i in (o.id, *(t.id for t in tails)):
            out.pop(i, None)
    return out


def _slot_tails(program: Program, split: _Split) -> list[LOp]:
    """The ops after o that its kernel can run as tails, reading o only at the columns its owner blocks hold and
    otherwise only what is written before the combine runs (inputs, constants, earlier ops): a reduce over o's
    columns grouped by owner (:func:`owner_slots`' slots: a Sum over the last axis of a [groups, ranks, COLS / ranks]
    domain, element (g, r, i) column g·COLS + i·ranks + r, without row reductions), or an elementwise tree over
    o's row (one [1, n] row, without row reductions)."""
    o, ranks = split.o, split.heads // split.hpb
    groups, own = split.n // COLS, COLS // ranks
    if split.n % COLS or COLS % ranks:
        return []
    slot_dom = (as_expr(groups), as_expr(ranks), as_expr(own))
    row_dom = (as_expr(1), as_expr(split.n))
    o_views = {slot_dom: ShapeTracker(slot_dom, (as_expr(COLS), as_expr(1), as_expr(ranks)), as_expr(0), None),
               row_dom: ShapeTracker(row_dom, (as_expr(0), as_expr(1)), as_expr(0), None)}
    out = []
    for t in program.ops[o.id + 1:]:
        if "expr" not in t.params or has_row_ops(t.params["expr"]) or not t.dtype.is_float or t.alias is not None:
            continue
        if t.kind == "reduce" and t.op == "Sum" and int(t.params["axis"]) == 2 and tuple(t.shape) == slot_dom[:2]:
            dom = slot_dom
        elif t.kind == "elementwise" and t.op == "Fused" and tuple(t.shape) == row_dom:
            dom = row_dom
        else:
            continue
        if all(a.view == o_views[dom] if a.src == o.id else
               (a.src < split.combine.id or program.ops[a.src].kind in ("input", "constant"))
               and tuple(a.view.shape) == dom for a in t.args):
            out.append(t)
    return out


def _tail_code(program: Program, ctx: KernelContext, o: LOp, tails: Sequence[LOp], names: Sequence[str],
               ranks: int) -> tuple[str, str]:
    """gemv_combine.cu's TAIL_ADD and TAIL_STORE for ``tails`` (tail j's parameters ``t<j+1>_…``, after o's), at
    slot (lum_tg, lum_tq), slot column lum_ti, o's leaves the column's value lum_o: a slot reduce's tree added to
    lum_t[j] (stored by TAIL_STORE), an elementwise tree stored at the column."""
    slot = (Var("lum_tg"), Var("lum_tq"), Var("lum_ti"))
    for v, d in zip(("lum_tg", "lum_tq", "lum_ti"), (program.ops[o.id].shape[-1] // COLS, ranks, COLS // ranks)):
        ctx.bound_var(v, as_expr(d))
    column = slot[0] * COLS + slot[2] * ranks + slot[1]
    add, store = [], []
    for j, t in enumerate(tails):
        pre = f"t{j + 1}_"
        if f"{pre}out" not in names:
            raise CodegenError("a tail's kernel parameters are not (out, in…)")
        idx = slot if t.kind == "reduce" else (as_expr(0), column)

        def leaf(node: list, key: str, t: LOp = t, pre: str = pre, idx: tuple = idx) -> tuple[str, str] | None:
            if node[0] != "arg":
                return None
            a = t.args[int(node[1])]
            if a.src == o.id:
                return "lum_o", "f"
            e = a.view.physical_index(idx)
            ctx.exprs.append(e)
            dt = program.ops[a.src].dtype
            return load_conv(dt, f"{pre}in{int(node[1])}[{ctx.c(e)}]"), value_kind(dt)

        lines: list[str] = []
        val, kind = tree_c(t.params["expr"], {}, lines, " " * 6, True, leaf, "f32")
        if t.kind == "reduce":
            done = f"      lum_t[{j}] += {convert_kind(kind, 'f', val)};"
            store.append(f"    {pre}out[lum_tg * {ranks} + lum_tq] = {store_conv('f', f'lum_t[{j}]', t.dtype)};")
        else:
            ctx.exprs.append(column)
            done = f"      {pre}out[{ctx.c(column)}] = {store_conv(kind, val, t.dtype)};"
        add.append("    {\n" + "".join(f"{ln}\n" for ln in lines) + done + "\n    }")
    return "\n".join(add), "\n".join(store)


def _fused(program: Program, split: _Split, ks_c: KernelSource, ks_o: KernelSource,
           dyn_vars: Sequence[str], max_dyn: Mapping[str, int] | None,
           tails: Sequence[tuple[LOp, KernelSource]] = ()) -> KernelSource:
    """The kernel of a combine and the o split by head after it (templates/gemv_combine.cu), with ``tails``
    (:func:`_slot_tails`' reduces and their kernels) summed by o's owner blocks; ``split`` is :func:`_split`'s,
    which checked the weights' placement."""
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
    params, _ = joined_params([ks_c.params, ks_o.params, *(ks.params for _, ks in tails)])
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
    tail_add, tail_store = _tail_code(program, ctx, o, [t for t, _ in tails], names, ranks)
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
        "B_AT": ctx.c(b_at), "OUT_AT": ctx.c(out_at), "TAILS": len(tails), "TAIL_ADD": tail_add,
        "TAIL_STORE": tail_store, "OUT_VALUE": load_conv(p_dt, store_conv("f", "lum_v0", p_dt))})
    idx_t = "int" if ctx.fits_i32(COLS) else "long long"
    nowait, slots = ctx.dyn_loads(wait=False)
    body, name = entry_named(body.replace("@IDX_T@", idx_t).replace("@DYN_LOADS_NOWAIT@", nowait), "o_combine",
                             "lum_reduce_sum_o_")
    smem = COLS * db * w_dt.itemsize
    tuning = {"threads": threads, "cols": COLS, "round": ROUND, "heads_a_block": hpb,
              "o_combine": [combine.id, o.id, *(t.id for t, _ in tails)], "index_bits": 32 if idx_t == "int" else 64}
    grid = (as_expr(ranks * groups), as_expr(1), as_expr(1))
    return KernelSource(name=name, kind=combine.kind, op=combine.op, source=common_header() + "\n" + body,
                        body=body, launches=(Launch(name, grid, (threads, 1, 1), smem, ranks),),
                        params=tuple(params), dyn_vars=tuple(dyn_vars), dyn_slots=slots, tuning=tuning,
                        tails=(o.id, *(t.id for t, _ in tails)), early=(w_p,))
