"""Row kernels (``templates/row.cu``): trees with row reductions — an elementwise op, a reduce over the last
axis, a scatter whose prologue normalises rows. :class:`RowKernels` holds the generator's row methods
(a mixin of :mod:`lum.builder.codegen`'s ``_Gen``, whose ``self`` they use); their row loop
(:meth:`RowKernels._row_parts`) is also what attention stages, flash attention's combine and a GEMV's
prologue run, which is why it is a concept of its own. The row is visited once per row reduction (row.cu's
PHASES), except a softmax-weighted sum (decode attention's combine): once, with a running maximum
(:func:`online_softmax_sum`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lum.builder.env_switches import CodegenError, env_switch
from lum.builder.gemv_policy import SMS
from lum.builder.intmath import pow2_floor, pow2ceil
from lum.builder.kernel_text import (ENTRY_PLACEHOLDER, KIND_C, ZERO_C, coalesce, index_vars, load_conv, load_template,
                                     render, store_conv, unravel_index, value_kind, view_access)
from lum.format.dtypes import DType
from lum.format.expr import INF, Expr, Var, as_expr
from lum.format.llir import ROW_OPS, check_row_reduce
from lum.format.shapetracker import ShapeTracker, numel


ROW_REGS = 8                                     # row kernels keep a static row in registers up to this per lane
ENV_ROW_ONLINE = "LUM_ROW_ONLINE"                # 0: a softmax-weighted row sum visits its row once per reduction


def row_online_enabled() -> bool:
    """``$LUM_ROW_ONLINE`` (default on): a reduce whose prologue is a softmax-weighted sum (decode attention's
    combine of its chunks) visits its row once, with a running maximum (:func:`online_softmax_sum`)."""
    return env_switch(ENV_ROW_ONLINE, default=True)


def _pairs(t: list, op: str) -> list[tuple[list, list]]:
    """A binary node ``op``'s operands in both orders (none if ``t`` is another node)."""
    return [(t[2], t[3]), (t[3], t[2])] if t[0] == op and len(t) == 4 else []


def _holds(t: list, sub: list) -> bool:
    return t == sub or (t[0] != "arg" and any(_holds(c, sub) for c in t[2:]))


@dataclass(frozen=True)
class OnlineSum:
    """A softmax-weighted row sum ``Σ E·A · Recip(Σ E·L)``, ``E = Exp2(X + RowMax(X)·K)`` (Fused trees)."""

    x: list
    k: list        # an arg leaf
    el: list       # E·L
    ea: list       # E·A
    rmax: list     # RowMax(X)
    rsum: list     # RowSum(E·L)


def online_softmax_sum(expr: list) -> OnlineSum | None:
    """The parts of a reduce's prologue ``expr`` when it is ``E·A · Recip(RowSum(E·L))`` with ``E = Exp2(X +
    RowMax(X)·K)``, K a leaf, every node f32 and no other row reduction; else None.

    Decode attention's combine is this sum over the chunks (X their offsets c, L their sums l, A their
    accumulators, K = −1). One visit of the row computes it: a running maximum m, and Σ E·L and Σ E·A at m,
    both scaled by ``Exp2((m' − m)·K)`` when m grows to m' (exact for integer offsets), then merged across the
    group at the group's maximum: one round of loads and three group reductions, where the phases take three
    of each. The quotient is taken once (``Σ E·A · Recip``, not ``Σ (E·A · Recip)``: a rounding apart)."""
    stack, rows = [expr], []
    while stack:
        t = stack.pop()
        if t[0] != "arg":
            if t[1] != "f32":
                return None
            rows += [t] if t[0] in ROW_OPS else []
            stack.extend(t[2:])
    for ea, r in _pairs(expr, "Mul"):
        if r[0] != "Recip" or r[2][0] != "RowSum":
            continue
        rsum = r[2]
        for e, ell in _pairs(rsum[2], "Mul"):
            add = e[2] if e[0] == "Exp2" else ["none", ""]
            for x, mk in _pairs(add, "Add"):
                for rmax, k in _pairs(mk, "Mul"):
                    if rmax != ["RowMax", "f32", x] or k[0] != "arg" or any(t not in (rmax, rsum) for t in rows):
                        continue
                    for e2, a in _pairs(ea, "Mul"):
                        if e2 == e and not _holds(a, rmax) and not _holds(a, rsum) and not _holds(ell, rmax):
                            return OnlineSum(x, k, rsum[2], ea, rmax, rsum)
    return None


@dataclass(frozen=True)
class _RowParts:
    """A row loop's generated pieces and shape (see :meth:`RowKernels._row_parts`)."""

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
    online: bool = False                   # a softmax-weighted sum visiting its row once (online_softmax_sum)


class RowKernels:
    """The row-kernel methods of ``_Gen`` (:mod:`lum.builder.codegen`)."""

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
            "KERNEL": ENTRY_PLACEHOLDER, "THREADS": rp.threads, "GROUP": rp.group, "IDX_T": "@IDX_T@",
            "PARAMS": self.params_c(), "DYN_LOADS": "@DYN_LOADS@", "ACC_T": KIND_C[rp.acc_kind],
            "ROWS": self.ctx.c(rp.rows), "N": self.ctx.c(rp.n),
            "ROW_SETUP": rp.setup, "PHASES": rp.phases, "FINAL": rp.final})
        per_block = rp.threads // rp.group
        tuning = {"threads": rp.threads, "group": rp.group, "max_blocks": self.max_blocks, "acc": self.acc,
                  "math": self.math, "scheme": "row", "regs": rp.regs, **({"online": True} if rp.online else {})}
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
        setup = [unravel_index(ctx, "lum_row", cshape, ind).rstrip("\n")]
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
                kd = value_kind(self.dts[k])
                val = self.load(k, splits[k][1], (col,), base=f"lum_b{k}", guard=guards[k])
                col_view = splits[k][1]
                if (guards[k] is None and col_view.mask is None and as_expr(col_view.strides[0]) == as_expr(0)
                        and "lum_c" not in val):  # one value for the whole row (a broadcast scalar)
                    setup.append(f"{ind}const {KIND_C[kd]} lum_a{k} = lum_live ? {val} : {ZERO_C[kd]};")
                    scalars.add(k)
                    continue
                setup += [f"{ind}{KIND_C[kd]} lum_a{k}[{regs}];", f"{ind}#pragma unroll",
                          f"{ind}for (int lum_kk = 0; lum_kk < {regs}; ++lum_kk) {{",
                          f"{ind}  const idx_t lum_c = lum_lane + (idx_t)lum_kk * GROUP;",
                          f"{ind}  lum_a{k}[lum_kk] = (lum_live && lum_c < lum_n) ? {val} : {ZERO_C[kd]};", f"{ind}}}"]
        else:
            loop = [f"{ind}#pragma unroll 4", f"{ind}  for (idx_t lum_c = lum_lane; lum_c < lum_n; lum_c += GROUP) {{"]
            close = [f"{ind}  }}", f"{ind}}}"]
        rownames: dict[str, tuple[str, str]] = {}

        def emit(t: list, lines: list[str], round_root: bool,
                 names: dict[str, tuple[str, str]] | None = None) -> tuple[str, str]:
            """C lines computing tree ``t`` at column lum_c (leaves loaded on first use, once per ``names``);
            its (value, kind)."""
            names = {} if names is None else names

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
                kd = value_kind(self.dts[k])
                if regs:
                    return (f"lum_a{k}", kd) if k in scalars else (f"lum_a{k}[lum_kk]", kd)
                val = self.load(k, splits[k][1], (col,), base=f"lum_b{k}", guard=guards[k])
                names[key] = (f"lum_a{k}", kd)
                lines.append(f"{ind3}const {KIND_C[kd]} lum_a{k} = {val};")
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
        online = online_softmax_sum(expr) if (kind == "reduce" and op.op == "Sum" and acc_kind == "f"
                                              and self.math == "f32") else None
        if online is not None:
            col_k = splits[first + online.k[1]][1]      # K must be one value a row: the rescale reads it
            if not (col_k.mask is None and as_expr(col_k.strides[0]) == as_expr(0)) or not row_online_enabled():
                online = None
        phases: list[str] = []
        if online is not None:
            phases, final = self._online_row(online, expr, emit, rownames, loop, close, ind, ind3)
        else:
            for j, t in enumerate(order):
                dt = DType.parse(t[1])
                if not dt.is_float:
                    raise CodegenError(f"{t[0]} of {dt}: row reductions are generated for float dtypes only")
                phases += accumulate(j, ROW_OPS[t[0]], t[2])
                phases.append(f"{ind}const float lum_rv{j} = "
                              f"{load_conv(dt, store_conv(acc_kind, f'lum_r{j}', dt))};")
                rownames[repr(t)] = (f"lum_rv{j}", "f")
        wbase, _ = view_access(ctx, cviews[0], idx)
        if online is not None:
            final.append(f"{ind}if (lum_live && lum_lane == 0) out[{wbase}] = {store_conv('f', 'lum_y', op.dtype)};")
        elif kind == "reduce":
            j = len(order)
            final = accumulate(j, op.op, expr)
            final += [f"{ind}if (lum_live && lum_lane == 0) out[{wbase}] = "
                      f"{store_conv(acc_kind, f'lum_r{j}', op.dtype)};"]
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
                final.append(f"{ind3}out[{dest}] = {store_conv(kd, x, op.dtype)};")
            else:
                stored = store_conv(kd, x, op.dtype)
                final.append(f"{ind3}{sink}[{dest}] = {stored if sink_stored else load_conv(op.dtype, stored)};")
            final += close
        return _RowParts("\n".join(x for x in setup if x), "\n".join(phases), "\n".join(final), rows, n,
                         group, threads, regs, acc_kind, tuple(cshape),
                         cviews[0], None if wcol is None else wcol.strides[0],
                         write.strides[0] if kind == "scatter" else None, online is not None)

    @staticmethod
    def _online_row(parts: OnlineSum, expr: list, emit: Any,
                    rownames: dict[str, tuple[str, str]], loop: list[str], close: list[str], ind: str, ind3: str
                    ) -> tuple[list[str], list[str]]:
        """The one-visit row of :func:`online_softmax_sum` (f32 accumulation and math): its loop and group merge
        (PHASES) and the row's value ``lum_y`` (FINAL, before the store)."""
        x, k, el, ea, rmax, rsum = parts.x, parts.k, parts.el, parts.ea, parts.rmax, parts.rsum
        names: dict[str, tuple[str, str]] = {}
        lines = [f"{ind}float lum_m = -LUM_INF_F32, lum_k = 0.0f;   // the running maximum of X, K",
                 f"{ind}acc_t lum_sl = (acc_t)0, lum_sa = (acc_t)0;   // sums of E·L and E·A at lum_m",
                 f"{ind}if (lum_live) {{", *loop]
        xv, _ = emit(x, lines, True, names)
        kv, _ = emit(k, lines, True, names)
        lines += [f"{ind3}lum_k = {kv};",
                  f"{ind3}if ({xv} > lum_m) {{   // a new maximum: the sums so far move to it",
                  f"{ind3}  if (lum_m != -LUM_INF_F32) {{",
                  f"{ind3}    const float lum_up = exp2f(({xv} - lum_m) * lum_k);",
                  f"{ind3}    lum_sl *= lum_up;", f"{ind3}    lum_sa *= lum_up;", f"{ind3}  }}",
                  f"{ind3}  lum_m = {xv};", f"{ind3}}}"]
        rownames[repr(rmax)] = ("lum_m", "f")
        sv, _ = emit(el, lines, True, names)         # loaded whatever X is, so that the loads overlap
        tv, _ = emit(ea, lines, True, names)
        lines += [f"{ind3}if ({xv} != -LUM_INF_F32) {{   // E = 0 at a finite maximum, NaN at -inf: skipped",
                  f"{ind3}  lum_sl += {sv};", f"{ind3}  lum_sa += {tv};", f"{ind3}}}", *close,
                  f"{ind}const float lum_mx = lum_group_reduce<LumMax, GROUP>(lum_m, lum_smem);",
                  f"{ind}const float lum_to = lum_m == lum_mx ? 1.0f : lum_m == -LUM_INF_F32 ? 0.0f "
                  f": exp2f((lum_mx - lum_m) * lum_k);",
                  f"{ind}lum_sl = lum_group_reduce<LumSum, GROUP>(lum_sl * lum_to, lum_smem);",
                  f"{ind}lum_sa = lum_group_reduce<LumSum, GROUP>(lum_sa * lum_to, lum_smem);"]
        rownames[repr(rsum)] = ("lum_sl", "f")
        rownames[repr(ea)] = ("lum_sa", "f")
        final: list[str] = []
        y, _ = emit(expr, final, True)
        final.append(f"{ind}const float lum_y = lum_n > 0 ? {y} : 0.0f;   // an empty row sums to 0")
        return lines, final

    @staticmethod
    def _row_identity(red: str) -> str:
        return "(acc_t)0" if red == "Sum" else "(acc_t)(-LUM_INF_F32)"
