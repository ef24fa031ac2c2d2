"""Attention kernels: decode's split-K chunk partials (``templates/attention.cu``, with the stage rows of the
ops before it, :meth:`AttentionKernels._attention_stage`) and flash attention (``templates/flash_attention.cu``).
:class:`AttentionKernels` is a mixin of :mod:`lum.builder.codegen`'s ``_Gen``, whose ``self`` its methods use;
which attention ops run flash attention is policy, in :mod:`lum.builder.attention_policy`."""

from __future__ import annotations

from lum.builder.attention_policy import (ATTENTION_MAX_GROUP, ATTENTION_MERGE_SMEM, FLASH_MAX_D, FLASH_TILE_KEYS,
                                          attention_group_rows, attention_row_dims,
                                          flash_attention, flash_features_fit)
from lum.builder.env_switches import CodegenError
from lum.builder.intmath import is_one, is_pow2
from lum.builder.kernel_text import (ENTRY_PLACEHOLDER, STORAGE_C, f32_literal, load_conv, load_template, render,
                                     store_conv, unravel_index, view_access)
from lum.format.dtypes import DType
from lum.format.expr import Expr, Var, as_expr, cdiv
from lum.format.llir import attention_dims, check_attention
from lum.format.manifest import MAX_SHARED_MEM
from lum.format.shapetracker import ShapeTracker, numel


class AttentionKernels:
    """The attention methods of ``_Gen`` (:mod:`lum.builder.codegen`)."""

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
        setup = [unravel_index(ctx, "lum_h", hshape, ind).rstrip("\n")]
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
                  f"{load_conv(self.dts[0], f'in0[lum_qb + (idx_t)lum_d * ({ctx.c(qd)})]')} : 0.0f;",
                  f"{ind}  }}", f"{ind}}}"]
        ctx.exprs.append(vq.physical_index(tuple(idx) + (lum_d,)))
        heads_n = numel(hshape)
        stage = self._attention_stage(m_size, D, qd, heads_n)
        # lanes move their slices to / from shared memory as 16-byte vectors where a slice is a power of two of
        # floats: float accesses 8 apart are 8-way bank conflicts (gemma3-4b; +0.8% measured, 1d5fc3e)
        if self.stage is not None and is_pow2(dpl) and D == 32 * dpl:
            load_q = [*load_q[:2], f"{ind}  lum_load_raw<DPL>(&lum_qs[lum_m][lum_lane * DPL], lum_q[lum_m]);",
                      load_q[-1]]
        elif self.stage is not None:           # the query rows the stage computed into shared memory
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
                cvt = f"[](const {STORAGE_C[dt]} x) {{ return {load_conv(dt, 'x')}; }}"
                return [f"{ind4}if (lum_in) lum_load_f32<{per_lane}>({src} + lum_lane * {per_lane}, {dest}[u], {cvt});",
                        f"{ind4}else {{", f"{ind4}#pragma unroll",
                        f"{ind4}  for (int i = 0; i < {per_lane}; ++i) {dest}[u][i] = 0.0f;", f"{ind4}}}"]
            return [f"{ind4}#pragma unroll", f"{ind4}for (int i = 0; i < {per_lane}; ++i) {{",
                    f"{ind4}  const int lum_d = lum_lane * {per_lane} + i;",
                    f"{ind4}  {dest}[u][i] = (lum_in && lum_d < {width}) ? "
                    f"{load_conv(dt, f'({src})[(idx_t)lum_d * ({ctx.c(sd)})]')} : 0.0f;",
                    f"{ind4}}}"]

        load_kv = row_load(1, vk, D, dpl, "lum_k", "lum_kb") + row_load(2, vv, DV, vpl, "lum_v", "lum_vb")
        mphys, mvalid = view_access(ctx, vm, tuple(idx) + (lum_t,))
        mval = load_conv(DType.bool, f"in3[{mphys}]")
        mval = "false" if mvalid == "false" else f"(({mvalid}) && {mval})" if mvalid else mval
        p_dt = DType.parse(op.params["p_dtype"])
        rnd = "lum_e" if p_dt == DType.f32 else load_conv(p_dt, store_conv("f", "lum_e", p_dt))
        scale = float(op.params["scale"])
        logit = f"(lum_s * {f32_literal(scale)}) * {f32_literal(1.4426950408889634)}"
        key, keys_before, keys_after = self._attention_key_batch(ind4, mval, logit, rnd)
        out_idx = ShapeTracker.contiguous(op.shape).physical_index(tuple(idx) + (Var("lum_j"), zero))
        ctx.bound_var("lum_j", ns)
        ctx.exprs.append(ShapeTracker.contiguous(op.shape).physical_index(tuple(idx) + (Var("lum_j"), as_expr(DV + 2))))
        # the warps' partials of all M query rows merged after one barrier pair where they and the stage's rows
        # fit in ATTENTION_MERGE_SMEM (of the 48 KB of static shared memory a block has), else a row at a time
        # (a row at a time, two barriers each, measured even: benchmarks/NOTES.md)
        other = 4 * 32 * m_size * dpl if self.stage is not None else 0
        part_vectors = is_pow2(vpl)
        fits = other + 4 * m_size * (self.threads // 32) * (vpl * 32 + (4 if part_vectors else 2)) \
            <= ATTENTION_MERGE_SMEM
        merge_rows = m_size if fits else 1
        src = render(load_template("attention.cu"), {**stage,
            "KERNEL": ENTRY_PLACEHOLDER, "THREADS": self.threads, "IDX_T": "@IDX_T@", "PARAMS": self.params_c(),
            "DYN_LOADS": "@DYN_LOADS@", "M": m_size, "DPL": dpl, "VPL": vpl, "DV": DV, "UNROLL": unroll,
            "MERGE_ROWS": merge_rows, "SMEM_VECTORS": "true" if part_vectors else "false",
            "CHUNK": chunk, "T": ctx.c(t), "NS": ctx.c(ns), "HEADS": ctx.c(heads_n),
            "SETUP": "\n".join(x for x in setup if x), "LOAD_Q": "\n".join(load_q), "LOAD_KV": "\n".join(load_kv),
            "KEY": "\n".join(key), "KEYS_BEFORE": keys_before, "KEYS_AFTER": keys_after, "STORE": ctx.c(out_idx)})
        tuning = {"threads": self.threads, "unroll": unroll, "max_blocks": self.max_blocks, "group_rows": m_size,
                  "merge_rows": merge_rows, **({"smem_vectors": True} if part_vectors else {})}
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
        setup = [unravel_index(ctx, "lum_h", hshape, " " * 4).rstrip("\n")]
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
        rnd = "lum_e" if p_dt == DType.f32 else load_conv(p_dt, store_conv("f", "lum_e", p_dt))
        src = render(load_template("flash_attention.cu"), {
            "KERNEL": ENTRY_PLACEHOLDER, "THREADS": self.threads, "IDX_T": "@IDX_T@", "PARAMS": self.params_c(),
            "DYN_LOADS": "@DYN_LOADS@", "Q_T": STORAGE_C[dq], "K_T": STORAGE_C[dk], "V_T": STORAGE_C[dvt],
            "CVT_Q": load_conv(dq, "x"), "CVT_K": load_conv(dk, "x"), "CVT_V": load_conv(dvt, "x"),
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
            "SCALE": f32_literal(float(op.params["scale"])), "ROUND": rnd})
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
        :class:`~lum.builder.codegen.AttentionStage`): in each round, task ``t = round · WARPS + warp`` is query row
        ``t`` (t < M), the k row (t = M) or the v row (t = M + 1), and a warp calls only its task's row function (a
        stage row reduces with warp shuffles only: its group is a warp). Every warp calling every row function, the
        others' predicated off, issued all three rows' instructions in each warp (the compiler cannot tell the condition
        is warp-uniform; Nsight Compute on gemma3-4b: 823 instructions a warp before the barrier, 175 of them loads) and
        measured 1.7% slower on gemma3-4b. Each block lets the next kernel launch after its stage's barrier
        (:mod:`lum.builder.attention_stage`)."""
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
                 f"{ind}  LUM_STAMP_AT(5);   // stamps builds: the stage's start",
                 f"{ind}#pragma unroll 1",
                 f"{ind}  for (int lum_r = 0; lum_r < {-(-(m_size + 2) // warps)}; ++lum_r) {{",
                 f"{ind3}const int lum_task = lum_r * WARPS + lum_warp;",
                 f"{ind3}const int lum_mq = lum_task < M ? lum_task : 0;",
                 call(ind3, "lum_task < M", f"lum_qrow((long long)({q0} + {qh} * (long long)lum_h + {qm} * lum_mq), "
                      f"{{live}}, LumSink{{{{&lum_qs[lum_mq][0], (long long)({b0} + {bh} * (long long)lum_h + {bm} * lum_mq)}}}});"),
                 *kv(ind3, "lum_task == M", "lum_task == M + 1",
                     "(long long)lum_w0, (long long)lum_w1, (long long)lum_T, lum_j == 0"),
                 f"{ind}  }}", f"{ind}  LUM_STAMP_AT(6);   // ... thread 0's warp's rows done (query row 0)",
                 f"{ind}  __syncthreads();   // the query rows are in lum_qs, the kv rows in the cache",
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
        decl = (f"  alignas(16) __shared__ float lum_qs[M][DPL * 32];   // the stage's query rows (d = {d}), "
                "LOAD_Q's vectors")
        # the next kernel launches once every block has passed its first stage (or exited)
        decl += "\n  bool lum_untriggered = true;"
        return {"STAGE_DECL": decl,
                "STAGE_PRE": "\n".join(pre), "STAGE": "\n".join(stage)}
