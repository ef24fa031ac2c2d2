"""Decode attention's combine inside o, split by head (builder/o_combine.py, templates/gemv_combine.cu): which ops
split, the rewritten LLIR (a GEMV batched over the heads, its readers summing them), the same outputs on the
reference backend, the fused kernel's launch and NVRTC compile. The kernel's results are checked on the emulated
driver (tests/test_cuda_emulated.py, variant ``o-combine``: the tiny models' greedy tokens) and on the GPU
(tests/test_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest

from lum.builder import nvrtc
from lum.builder.kernels import default_max_dyn, group_kernel_sources, program_dyn_vars
from lum.builder.o_combine import (MAX_CHUNKS, combine_leaves, fuse_o_combines, o_combine_enabled,
                                   split_o_by_head)
from lum.format.dtypes import DType
from lum.format.expr import as_expr


def _layer(model: str, max_seq: int, dtype: DType = DType.bf16):
    """The decode layer group of a named model, split or not by ``$LUM_O_COMBINE`` as the build does."""
    from lum.builder.compile import compile_graph
    from lum.builder.models.config import named_config
    from lum.builder.models.transformer import build_entry

    cgs = compile_graph(build_entry(named_config(model), "decode", max_seq, dtype))
    dv = program_dyn_vars([cg.program for cg in cgs])
    prog = max(cgs, key=lambda cg: sum(o.kind == "scatter_nocopy" for o in cg.program.ops)).program
    return prog, dv


def _combine(prog):
    (c,) = [o for o in prog.ops if combine_leaves(o) is not None]
    return c


def test_the_switch_is_off_by_default_and_refuses_other_values(monkeypatch):
    monkeypatch.delenv("LUM_O_COMBINE", raising=False)
    assert not o_combine_enabled()
    monkeypatch.setenv("LUM_O_COMBINE", "yes")
    with pytest.raises(ValueError, match="LUM_O_COMBINE"):
        o_combine_enabled()


def test_gemma_o_splits_by_head_and_its_reader_sums_the_heads(monkeypatch):
    """gemma3-4b bf16 at max_seq 512 (32 chunks): o becomes a GEMV batched over the 8 heads (k 256, A's and B's
    batch stride 256, output [8, 1, 2560] f32); each of its readers (the residual kernel, and the later one that
    recomputes the residual) reads the 8 heads' rows where it read o's output, at offsets h · 2560, and sums
    them in head order; nothing else changes."""
    monkeypatch.setenv("LUM_O_COMBINE", "0")
    plain, _ = _layer("gemma3-4b", 512)
    split = split_o_by_head(plain)
    comb = _combine(split)
    assert combine_leaves(comb) is not None and (combine_leaves(comb).x, combine_leaves(comb).k) == (1, 3)
    (o,) = [u for u in split.ops if any(a.src == comb.id for a in u.args)]
    assert o.kind == "gemm" and o.dtype == DType.f32 and tuple(o.shape) == tuple(as_expr(x) for x in (8, 1, 2560))
    assert {k: int(as_expr(o.params[k]).value) for k in ("batch", "k", "stride_a", "stride_b", "ldb")} == {
        "batch": 8, "k": 256, "stride_a": 256, "stride_b": 256, "ldb": 2048}
    users = [u for u in split.ops if any(a.src == o.id for a in u.args)]
    assert users and all(u.kind == "elementwise" and u.op == "Fused" for u in users)
    for res in users:
        (old,) = [u for u in plain.ops if u.id == res.id]
        reads = sum(a.src == o.id for a in old.args)
        offsets = sorted(int(a.view.offset.value) for a in res.args if a.src == o.id)
        assert offsets == sorted(2560 * h for h in range(8) for _ in range(reads))
        assert len(res.args) == len(old.args) + 7 * reads
        assert str(res.params["expr"]).count("['Add', 'f32', ['Add', 'f32'") >= 6 * reads
    assert [(u.kind, u.op) for u in split.ops] == [(u.kind, u.op) for u in plain.ops]


def test_no_split_past_the_chunks_a_round_takes_or_without_a_combine(monkeypatch):
    """At max_seq 2,048 (128 chunks of 16 keys, past MAX_CHUNKS) the two kernels stay; so does a program without
    decode attention (prefill)."""
    monkeypatch.setenv("LUM_O_COMBINE", "0")
    long, _ = _layer("gemma3-4b", 2048)
    assert 2048 // 16 > MAX_CHUNKS and split_o_by_head(long) is long
    from lum.builder.compile import compile_graph
    from lum.builder.models.config import named_config
    from lum.builder.models.transformer import build_entry
    for cg in compile_graph(build_entry(named_config("tiny-gemma3"), "prefill", 16, DType.f32)):
        assert split_o_by_head(cg.program) is cg.program


def test_the_fused_kernel_replaces_the_combine_and_o(monkeypatch):
    """With the switch on, gemma3-4b's combine and its split o are one kernel under the combine, o its tail: 8
    heads × 40 column groups of 64 blocks of 256 threads, its weights (32 KB a block) read before its wait, and
    the module compiles with NVRTC (no GPU needed); without the rewrite nothing fuses."""
    monkeypatch.setenv("LUM_O_COMBINE", "1")
    prog, dv = _layer("gemma3-4b", 512)
    ks = group_kernel_sources(prog, dv, default_max_dyn(dv, 512))
    (fused,) = [k for k in ks.values() if "o_combine" in k.tuning]
    comb = _combine(prog)
    o_id = fused.tuning["o_combine"][1]
    assert fused.tails == (o_id,) and o_id not in ks and comb.id in ks and ks[comb.id] is fused
    launch = fused.launches[0]
    assert launch.grid[0].value == 320 and launch.block == (256, 1, 1) and launch.shared_mem == 64 * 256 * 2
    assert fused.early == ("t0_in1",)
    body = fused.body
    assert body.index("lum_copy16_async") < body.index("lum_pdl_wait();") < body.index("exp2f")
    res = nvrtc.compile_cuda(fused.source, "sm_90", name="o_combine.cu")
    assert res.cubin[:4] == b"\x7fELF" and res.ptx.count(".entry") == 1
    monkeypatch.setenv("LUM_O_COMBINE", "0")
    plain, dv = _layer("gemma3-4b", 512)
    ks = group_kernel_sources(plain, dv, default_max_dyn(dv, 512))
    assert not any("o_combine" in k.tuning for k in ks.values())
    assert fuse_o_combines(plain, ks, dv) == ks


@pytest.mark.parametrize("model", ["tiny-gemma3", "tiny-llama"])
def test_the_split_computes_what_the_two_kernels_did_on_the_reference(tmp_path, monkeypatch, model):
    """The tiny models built with and without the split generate the same tokens on the reference backend, and
    their decode logits agree to f32 rounding (the heads' sum is in another order than o's own)."""
    from lum.builder.models import load_spec
    from lum.builder.package_builder import build_package
    import lum.loader as L

    pkgs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("LUM_O_COMBINE", on)
        pkgs[on] = L.open(build_package(load_spec(random_name=model, max_seq=16), tmp_path / f"{model}.{on}.lumpkg"))
    fused = [op for g in pkgs["1"].manifest.groups if g.table is not None for op in g.table.ops
             if op.kind == "reduce" and op.tail]
    assert fused, "the tiny model's combine and o did not fuse"
    prompt = [1, 5, 9, 3, 17]
    toks = {on: p.session(backend="reference").generate(prompt, 6) for on, p in pkgs.items()}
    assert toks["0"] == toks["1"]
    logits = {}
    for on, p in pkgs.items():
        s = p.session(backend="reference")
        s.run("prefill", {"tokens": np.asarray(prompt, np.int32)}, {"s": len(prompt)})
        logits[on] = s.run("decode", {"tokens": np.asarray([7], np.int32)}, {"p": len(prompt)})["logits"]
    a, b = (np.asarray(logits[k], np.float64) for k in ("0", "1"))
    assert np.isfinite(b).all() and np.max(np.abs(a - b)) <= 1e-4 * np.max(np.abs(a))
