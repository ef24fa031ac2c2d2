"""A decode FFN as one kernel sliced over h (``$LUM_FFN_SLICED=1``; off by default: not yet measured on a GPU).

gemma3-4b's gate-up (a GEMV with its gelu(gate)·up epilogue) and down GEMVs stream at ≈ 3.8 TB/s on an H200 where
the LM head, the same GEMV code over 1.3 GB, streams at 4.5: each launch pays a ramp and a tail beside its stream,
≈ 6 µs of a layer (benchmarks/NOTES.md, "a sliced FFN"). Here the two are one kernel of one block an SM, each
block computing its own rows of h and its partial of down over those rows, so nothing waits for another block
and the weights stream as one pass (``templates/gemv_ffn.cu``). The partials are summed as 64-bit fixed point,
so the sum is the same in any order; the last block converts it into down's output. The LLIR keeps both ops; the
launch table names the gate-up the kernel and down its tail (h is never stored).

Fused where a GEMV with an epilogue (m = 1, no prologue, A a contiguous row) has one reader, a plain decode GEMV
(m = 1, no prologue or epilogue) reading all of its output as its A, both weights inputs in whole 16-byte vectors,
the shapes static, A's floats within a prologue's shared memory (``PROLOGUE_SMEM_BYTES``).
``benchmarks/ffn_probe.py`` (modes ``sliced-rm-fixed`` against ``lum``) measures the form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from lum.builder.env_switches import CodegenError, env_switch
from lum.builder.fused import fuse_head_and_tail, joined_params, static_int, static_params
from lum.builder.gemv_policy import PROLOGUE_SMEM_BYTES, SMS, gemv_rows
from lum.builder.kernel_text import (ENTRY_PLACEHOLDER, STORAGE_C, KernelContext, KernelSource, Launch, common_header,
                                     finish_fused_body, load_conv, load_template, render, store_conv)
from lum.format.dtypes import DType
from lum.format.expr import as_expr
from lum.format.llir import LOp, Program, gemm_parts
from lum.format.shapetracker import ShapeTracker, numel

__all__ = ["ENV_FFN_SLICED", "ffn_sliced_enabled", "fuse_ffn_sliced", "THREADS", "SCALE"]

ENV_FFN_SLICED = "LUM_FFN_SLICED"
THREADS = 384              # a block's threads, one block an SM: no spills at 168 registers a thread (f32 161)
SCALE = 1 << 24            # the fixed-point sums' unit (a partial's bound 2^31: 133 blocks' sum within 2^63)
_DTYPES = (DType.bf16, DType.f16, DType.f32)


def ffn_sliced_enabled() -> bool:
    """``$LUM_FFN_SLICED``: ``1`` runs each decode FFN as one sliced kernel, ``0`` (the default) as its two GEMVs."""
    return env_switch(ENV_FFN_SLICED, default=False)


@dataclass(frozen=True)
class _Pair:
    gate_up: LOp
    down: LOp
    k1: int                # A's elements
    h: int                 # h's
    n2: int                # down's outputs


def _plain_row(view: ShapeTracker, n: int) -> bool:
    """``view`` reads ``n`` elements contiguously from its buffer's start."""
    return view.mask is None and numel(tuple(view.shape)) == as_expr(n) \
        and view == ShapeTracker.contiguous(tuple(view.shape))


def _params(op: LOp) -> dict[str, int | None]:
    return static_params(op, {"batch": 1, "n": None, "k": None, "ldb": None, "offset_a": 0, "offset_b": 0})


def _weight_ok(program: Program, op: LOp, ldb: int | None, off: int | None, k: int) -> bool:
    """``op``'s B (its second argument) an input in whole 16-byte vectors along k."""
    src = program.ops[op.args[1].src]
    if src.kind != "input" or src.dtype not in _DTYPES or op.args[1].view.mask is not None:
        return False
    vec = 16 // src.dtype.itemsize
    return None not in (ldb, off) and ldb % vec == 0 and off % vec == 0 and k % vec == 0


def _pair(program: Program, down: LOp, users: Mapping[int, list[LOp]]) -> _Pair | None:
    """The gate-up GEMV and ``down`` of a sliced FFN (the module docstring), or None."""
    if down.kind != "gemm" or gemv_rows(down) != 1 or "expr" in down.params or "epilogue" in down.params \
            or down.params.get("layout") != "RmCm" or len(down.args) != 2:
        return None
    gu = program.ops[down.args[0].src]
    if gu.kind != "gemm" or gemv_rows(gu) != 1 or "epilogue" not in gu.params or "expr" in gu.params \
            or gu.params.get("layout") != "RmCm" or [u.id for u in users.get(gu.id, [])] != [down.id]:
        return None
    pd, pg = _params(down), _params(gu)
    h, n2, k1 = static_int(gu.params["n_out"]), pd["n"], pg["k"]
    if None in (h, n2, k1) or k1 * 4 > PROLOGUE_SMEM_BYTES or pd["k"] != h or pd["batch"] != 1 or pg["batch"] != 1:
        return None
    if pd["offset_a"] != 0 or pg["offset_a"] != 0 or not _plain_row(down.args[0].view, h) \
            or not _plain_row(gu.args[0].view, k1):
        return None
    jb, _ = gemm_parts(gu)
    if jb != 1 or not _weight_ok(program, gu, pg["ldb"], pg["offset_b"], k1) \
            or not _weight_ok(program, down, pd["ldb"], pd["offset_b"], h):
        return None
    if gu.dtype not in _DTYPES or down.dtype not in _DTYPES or program.ops[gu.args[0].src].dtype not in _DTYPES:
        return None
    return _Pair(gu, down, k1, h, n2)


def fuse_ffn_sliced(program: Program, sources: Mapping[int, KernelSource | None], dyn_vars: Sequence[str],
                    max_dyn: Mapping[str, int] | None = None) -> dict[int, KernelSource | None]:
    """``sources`` with each gate-up GEMV and the down GEMV reading it as one kernel under the gate-up, down's
    entry dropped (:attr:`KernelSource.tails` names it)."""

    def match(down: LOp, users: Mapping[int, list[LOp]]) -> tuple[LOp, _Pair] | None:
        pair = _pair(program, down, users)
        return None if pair is None else (pair.gate_up, pair)

    return fuse_head_and_tail(program, sources, match,
                              lambda pair, ks_g, ks_d: _fused(program, pair, ks_g, ks_d, dyn_vars, max_dyn))


def _fused(program: Program, pair: _Pair, ks_g: KernelSource, ks_d: KernelSource, dyn_vars: Sequence[str],
           max_dyn: Mapping[str, int] | None) -> KernelSource:
    """The kernel of a sliced FFN (templates/gemv_ffn.cu); ``pair`` is :func:`_pair`'s, which checked its
    operands."""
    from lum.builder.codegen import _Gen        # the epilogue's code is the GEMV generator's own

    gu, down = pair.gate_up, pair.down
    ctx = KernelContext(tuple(dyn_vars), max_dyn=dict(max_dyn) if max_dyn else None)
    dts = [program.ops[a.src].dtype for a in gu.args]
    a_dt, w_dt, d_dt = dts[0], dts[1], program.ops[down.args[1].src].dtype
    vd = 16 // d_dt.itemsize
    blocks = min(SMS, pair.h // vd)
    max_rv = -(-(pair.h // vd) // blocks)
    params, _ = joined_params([ks_g.params, ks_d.params])
    names = [p.name for p in params]
    if "t0_out" not in names or "t0_in1" not in names:
        raise CodegenError("a sliced FFN's down kernel parameters are not (out, in0, in1)")
    gen = _Gen(gu, dts, ctx, threads=THREADS, ept=None, vec=None, group=None, unroll=None, inflight=0,
               max_blocks=1, acc="f32", math="f32")
    epilogue = gen._gemv_epilogue(1, 1, as_expr(pair.h), sink="lum_hs[lum_f - lum_r0]")
    pg, pd = _params(gu), _params(down)
    body = render(load_template("gemv_ffn.cu"), {
        "KERNEL": ENTRY_PLACEHOLDER, "THREADS": THREADS, "IDX_T": "@IDX_T@",
        "PARAMS": ", ".join(p.ctype for p in params), "DYN_LOADS": "@DYN_LOADS_NOWAIT@",
        "K1": pair.k1, "H": pair.h, "N2": pair.n2, "NACC": len(gu.params["acc_cols"]),
        "ACC_COLS": ", ".join(str(int(c)) for c in gu.params["acc_cols"]), "SLICES": blocks, "MAX_RV": max_rv,
        "SCALE": f"{float(SCALE)!r}f",
        "A_T": STORAGE_C[a_dt], "A_LOAD": load_conv(a_dt, "lum_x"), "A_PTR": "in0",
        "W_T": STORAGE_C[w_dt], "W_LOAD": load_conv(w_dt, "lum_x"), "W_PTR": "in1", "LDW": pg["ldb"],
        "OFFW": pg["offset_b"],
        "D_T": STORAGE_C[d_dt], "D_LOAD": load_conv(d_dt, "lum_x"), "D_PTR": "t0_in1", "LDD": pd["ldb"],
        "OFFD": pd["offset_b"],
        "H_T": STORAGE_C[gu.dtype], "H_LOAD": load_conv(gu.dtype, "lum_x"), "EPILOGUE": epilogue,
        "OUT": "t0_out", "OUT_STORE": store_conv("f", "lum_v", down.dtype)})
    reach = max(pg["offset_b"] + (pair.h + max(int(c) for c in gu.params["acc_cols"])) * pg["ldb"],
                pd["offset_b"] + pair.n2 * pd["ldb"])           # past the last weight either reads
    body, name, idx_t, slots = finish_fused_body(body, ctx, "ffn_sliced", "lum_gemm_ffn_", reach)
    tuning = {"threads": THREADS, "blocks": blocks, "ffn_sliced": [gu.id, down.id],
              "index_bits": 32 if idx_t == "int" else 64}
    grid = (as_expr(blocks), as_expr(1), as_expr(1))
    return KernelSource(name=name, kind=gu.kind, op=gu.op, source=common_header() + "\n" + body, body=body,
                        launches=(Launch(name, grid, (THREADS, 1, 1), 0, 1),), params=tuple(params),
                        dyn_vars=tuple(dyn_vars), dyn_slots=slots, tuning=tuning, tails=(down.id,))
