"""The decode GEMV generator (``templates/gemv.cu``, a ``gemm`` with a small static m, and its fused prologue
``templates/gemv_prologue.cuh``). :class:`GemvKernels` is a mixin of :mod:`lum.builder.codegen`'s ``_Gen``, whose
``self`` its methods use; which gemms run it, and its default sizes and ``$LUM_GEMV_*`` knobs, are policy, in
:mod:`lum.builder.gemv_policy`."""

from __future__ import annotations

from lum.builder.env_switches import CodegenError
from lum.builder.gemv_policy import (GEMV_MAX_ACC, GEMV_MAX_INFLIGHT, GEMV_PRELOAD_VECTORS, GEMV_SHARED_PRELOAD_BYTES,
                                     GEMV_SHARED_PRELOAD_VECTORS, SMS, gemv_evict_first, gemv_inflight_for,
                                     gemv_prologue_fits, gemv_prologue_narrow_a, gemv_prologue_pairs, gemv_rows)
from lum.builder.intmath import pow2ceil
from lum.builder.kernel_text import (ENTRY_PLACEHOLDER, KIND_C, STORAGE_C, index_vars, load_conv, load_template, render,
                                     store_conv, unravel_index, value_kind)
from lum.format.dtypes import DType
from lum.format.expr import Expr, as_expr, cdiv, smax, smin
from lum.format.llir import GEMM_DEFAULTS, LOp, gemm_parts
from lum.format.manifest import MAX_SHARED_MEM


_GEMV_FILL_THREADS = SMS * 2048                 # the resident threads of the SMS SMs (2,048 an SM)


def _lane_vectors(k: Expr, group: int, vec: int) -> int | None:
    """Vectors of one column a lane of a dot-scheme GEMV walks (``group`` lanes, ``vec`` elements a vector), known
    where k is static; else None."""
    return -(-k.value // (vec * group)) if k.is_const else None


class GemvKernels:
    """The GEMV methods of ``_Gen`` (:mod:`lum.builder.codegen`)."""

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
        asked = self.inflight if self.inflight is not None else \
            gemv_inflight_for(bool(epilogue), _lane_vectors(k, group, vec), bool(prologue))
        inflight = self._gemv_vectors("inflight", asked, GEMV_MAX_INFLIGHT, k, group, vec) if b_kc else 0
        shared = 0           # bytes a block's shared preload may take: 16-byte copies only, beside the static
        if self.preload_shared and b_kc and vec * dtb.itemsize == 16:     # arrays (the prologue's A, the sums)
            static = (m * k.value * dta.itemsize if prologue and k.is_const else 0) + 4096
            shared = max(0, min(GEMV_SHARED_PRELOAD_BYTES, MAX_SHARED_MEM - static))
        preload = self._gemv_preload(k, group, vec, len(acc_cols), inflight, shared) if b_kc else 0
        shared = shared if preload > 0 else 0
        # the first step's loads asked of L2 before the wait (gemv_policy.gemv_ahead_after_gemv): of a weight, with
        # no prologue
        ahead_early = self.ahead_early > 0 and b_kc and not prologue and not preload \
            and jb in self.weight_args
        self.early = (b_ptr,) if preload or ahead_early else ()   # B, loaded before the wait
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
        if ahead_early:
            tuning["ahead_early"] = True
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
        if ahead_early and not min_blocks and self.ahead_early > 1:    # the blocks an SM it held without
            min_blocks = f", {self.ahead_early}"
        src = render(load_template("gemv.cu"), {
            "KERNEL": ENTRY_PLACEHOLDER, "THREADS": self.threads, "MIN_BLOCKS": min_blocks, "IDX_T": "@IDX_T@",
            "PARAMS": self.params_c(), "DYN_LOADS": "@DYN_LOADS_NOWAIT@", "M": m, "GROUP": group, "VEC": vec,
            "UNROLL": unroll,
            "INFLIGHT": inflight, "PRELOAD": preload, "A_EARLY": "true" if a_early else "false",
            "AHEAD_EARLY": "true" if ahead_early else "false",
            "PRELOAD_SHARED": "true" if shared else "false",
            "B_STREAM": "true" if b_stream else "false",
            "A_PTR": a_ptr, "B_PTR": b_ptr, "PROLOGUE": code, "NACC": len(acc_cols),
            "ACC_COLS": ", ".join(map(str, acc_cols)), "N_OUT": ctx.c(n_out),
            "HAS_EPILOGUE": "true" if epi else "false", "EPILOGUE": epi,
            "A_KCONTIG": "true" if a_kc else "false", "B_KCONTIG": "true" if b_kc else "false",
            "A_T": STORAGE_C[dta], "B_T": STORAGE_C[dtb], "A_LOAD": load_conv(dta, "lum_x"),
            "B_LOAD": load_conv(dtb, "lum_x"), "STORE": store_conv("f", "lum_v", op.dtype),
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
        lines += unravel_index(ctx, "lum_f", shape, ind).rstrip("\n").split("\n")
        idx = index_vars(len(shape))
        names: dict[str, tuple[str, str]] = {}

        def leaf(t: list, key: str) -> tuple[str, str] | None:
            if t[0] == "acc":
                return load_conv(acc_dt, store_conv("f", f"lum_acc[{int(t[1])} * M + lum_ei]", acc_dt)), "f"
            if t[0] != "arg":
                return None
            if key not in names:
                k = jb + 1 + t[1]
                view = op.args[k].view
                ctx.exprs.append(view.physical_index(idx))
                names[key] = (f"lum_e{t[1]}", value_kind(self.dts[k]))
                lines.append(f"{ind}const {KIND_C[names[key][1]]} lum_e{t[1]} = {self.load(k, view, idx)};")
            return names[key]

        x, kd = self._tree(op.params["epilogue"], {}, lines, ind, False, leaf)
        lines += [f"{ind}out[lum_f] = {store_conv(kd, x, op.dtype)};", f"{ind[:-2]}}}"]
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
        sub = type(self)(tree, self.dts[:jb], self.ctx, threads=self.threads, ept=None, vec=None, group=self.threads,
                         unroll=None, inflight=0, max_blocks=1, acc=self.acc, math=self.math)
        rp = sub._row_parts(sink="lum_as", sink_stored=dta != DType.f32)
        return render(load_template("gemv_prologue.cuh"), {
            "ACC_T": KIND_C[rp.acc_kind], "A_ELEMS": m * p["k"].value, "A_FLOAT": int(dta == DType.f32),
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
        return min(asked, _lane_vectors(k, group, vec)) if k.is_const else asked

    @staticmethod
    def _gemv_vectors(name: str, asked: int, hi: int, k: Expr, group: int, vec: int) -> int:
        """Weight vectors per lane for ``inflight`` (loads issued ahead), dot scheme: ``asked``, in [0, ``hi``],
        down to the vectors a lane has when k is static (no registers for loads that never happen)."""
        if not 0 <= asked <= hi:
            raise CodegenError(f"{name} must be in [0, {hi}], got {asked}")
        if asked and k.is_const:
            return max(1, min(asked, _lane_vectors(k, group, vec)))
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
