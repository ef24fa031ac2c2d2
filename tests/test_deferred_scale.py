"""Deferred GEMV norms (builder/deferred_scale.py): a prologue that only scales A's rows is applied after the
dot product. The split fires on the RMSNorms of llama, gemma (1 + w) and a residual add before the norm, and
not on near misses; codegen then builds the GEMV as a plain one. Its values are checked in the emulated
(tests/test_cuda_emulated.py, the ``gemv.prologue.rmsnorm.*`` cases and the tiny models) and GPU runs."""

from __future__ import annotations

import pytest

from lum.builder.deferred_scale import ENV_DEFER_SCALE, defer_scale_enabled, split_row_scale

X, W, INV_N, EPS, R = (["arg", k] for k in range(5))


def _rsqrt_mean_sq(x: list) -> list:
    return ["Recip", "f32", ["Sqrt", "f32", ["Add", "f32", ["Mul", "f32", ["RowSum", "f32", ["Mul", "f32", x, x]], INV_N],
                                              EPS]]]


def _row_constant(k: int) -> bool:
    return k in (2, 3)               # 1/n and eps: broadcast along the row


def test_llama_rmsnorm_splits_into_x_times_w_and_the_row_scale():
    expr = ["Cast", "bf16", ["Mul", "f32", ["Mul", "f32", X, _rsqrt_mean_sq(X)], ["Cast", "f32", W]]]
    split = split_row_scale(expr, _row_constant)
    assert split is not None
    assert split.elem == ["Mul", "f32", X, ["Cast", "f32", W]]
    assert split.scale == _rsqrt_mean_sq(X)
    assert split.reductions == (["RowSum", "f32", ["Mul", "f32", X, X]],)


def test_gemma_norm_and_a_residual_add_split():
    gemma = ["Cast", "bf16", ["Mul", "f32", ["Mul", "f32", X, _rsqrt_mean_sq(X)], ["Add", "f32", ["Cast", "f32", W], R]]]
    split = split_row_scale(gemma, _row_constant)
    assert split is not None and split.elem == ["Mul", "f32", X, ["Add", "f32", ["Cast", "f32", W], R]]
    h = ["Add", "f32", X, R]                               # llama's gate-up: the residual sum, then its norm
    res = ["Cast", "bf16", ["Mul", "f32", ["Mul", "f32", h, _rsqrt_mean_sq(h)], ["Cast", "f32", W]]]
    split = split_row_scale(res, _row_constant)
    assert split is not None and split.elem == ["Mul", "f32", h, ["Cast", "f32", W]]
    assert split.reductions == (["RowSum", "f32", ["Mul", "f32", h, h]],)


@pytest.mark.parametrize("case", ["centred", "scale_reads_the_row", "nested", "no_elem", "no_rows", "rounded"])
def test_near_misses_do_not_split(case):
    """A LayerNorm's centring (x − mean: the reduction inside a per-element factor), a scale reading a leaf
    that varies along the row, a norm of a normed row (reductions nested), a tree that is all scale, one
    without reductions, and factors with a bf16 rounding between them."""
    mean = ["Mul", "f32", ["RowSum", "f32", X], INV_N]
    expr = {
        "centred": ["Mul", "f32", ["Add", "f32", X, ["Mul", "f32", mean, EPS]], _rsqrt_mean_sq(X)],
        "scale_reads_the_row": ["Mul", "f32", X, ["Add", "f32", _rsqrt_mean_sq(X), W]],
        "nested": ["Mul", "f32", X, _rsqrt_mean_sq(["Mul", "f32", X, _rsqrt_mean_sq(X)])],
        "no_elem": ["Cast", "bf16", _rsqrt_mean_sq(X)],
        "no_rows": ["Mul", "f32", X, W],
        "rounded": ["Mul", "bf16", X, _rsqrt_mean_sq(X)],
    }[case]
    assert split_row_scale(expr, _row_constant) is None


def test_the_switch(monkeypatch):
    assert defer_scale_enabled()
    monkeypatch.setenv(ENV_DEFER_SCALE, "0")
    assert not defer_scale_enabled()
    monkeypatch.setenv(ENV_DEFER_SCALE, "yes")
    with pytest.raises(ValueError, match=ENV_DEFER_SCALE):
        defer_scale_enabled()


def test_llama_decode_gemvs_with_norms_run_as_plain_gemvs(monkeypatch):
    """llama3-1b's qkv and gate-up GEMVs and the LM head read an RMSNorm of their input: deferred, each is a
    plain GEMV (the plain GEMV's threads and split, its grid not capped at one wave, no loads ahead) with one
    reduction; block-wide (``$LUM_GEMV_DEFER_SCALE=0``) the qkv and gate-up keep their prologue's 1,024-thread
    one-wave blocks of one warp a column, and the LM head (262,208 columns, past the prologue's limit) reads
    its norm from a kernel before it."""
    from lum.builder.compile import compile_graph
    from lum.builder.kernels import group_kernel_sources, program_dyn_vars
    from lum.builder.models.config import named_config
    from lum.builder.models.transformer import build_entry
    from lum.format.dtypes import DType

    def gemvs() -> list[dict]:
        cgs = compile_graph(build_entry(named_config("llama3-1b"), "decode", 512, DType.bf16))
        dv = program_dyn_vars([cg.program for cg in cgs])
        out = []
        for cg in cgs:
            gen = group_kernel_sources(cg.program, dv, {"p": 512}, {"inflight": 4})
            out += [{"n": int(cg.program.ops[i].shape[-1]), "grid": k.grid[0].value, "threads": k.block[0], **k.tuning}
                    for i, k in gen.items() if k is not None and k.kind == "gemm"]
        return out

    deferred = gemvs()
    assert [g["n"] for g in deferred] == [3072, 2048, 8192, 2048, 128256]
    normed = [deferred[i] for i in (0, 2, 4)]
    assert all(g.get("deferred") == 1 and "prologue" not in g and g["inflight"] == 0 for g in normed), normed
    assert [(g["threads"], g["group"]) for g in normed] == [(512, 64), (128, 64), (128, 64)], normed
    assert normed[0]["grid"] == 3072 // 8 and normed[1]["grid"] == 8192 // 2, normed
    assert all("deferred" not in deferred[i] for i in (1, 3))
    monkeypatch.setenv(ENV_DEFER_SCALE, "0")
    block = gemvs()
    assert [g["n"] for g in block] == [3072, 2048, 8192, 2048, 128256]
    assert all(block[i].get("prologue") and block[i]["threads"] == 1024 and block[i]["group"] == 32 for i in (0, 2))
    assert not any("deferred" in g or "prologue" in g for g in (block[1], block[3], block[4]))
