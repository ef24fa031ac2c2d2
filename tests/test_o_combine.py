"""Decode attention's combine inside o, split by head (builder/o_combine.py, templates/gemv_combine.cu): which ops
fuse, the fused kernel's launch (a thread block cluster a column group), its table and NVRTC compile. Its results
are checked on the emulated driver (tests/test_cuda_emulated.py, variant ``o-combine``: the ``o.combine`` kernel
case and the tiny models' greedy tokens) and on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

import pytest

from lum.builder import nvrtc
from lum.builder.kernels import default_max_dyn, group_kernel_sources, launch_table, program_dyn_vars
from lum.builder.o_combine import (MAX_CHUNKS, CombineLeaves, combine_leaves, heads_a_block, o_combine_enabled,
                                   o_combine_grouped)
from lum.format.dtypes import DType


def _layer(model: str, max_seq: int, dtype: DType = DType.bf16):
    """The decode layer group of a named model and the dyn vars."""
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


def test_the_switch_is_on_by_default_and_refuses_other_values(monkeypatch):
    monkeypatch.delenv("LUM_O_COMBINE", raising=False)
    assert o_combine_enabled()
    assert not o_combine_grouped()
    monkeypatch.setenv("LUM_O_COMBINE", "grouped")
    assert o_combine_enabled() and o_combine_grouped()
    monkeypatch.setenv("LUM_O_COMBINE", "yes")
    with pytest.raises(ValueError, match="LUM_O_COMBINE"):
        o_combine_enabled()


def test_no_fusion_past_the_chunks_two_rounds_take_or_without_a_combine(monkeypatch):
    """At max_seq 2,048 (128 chunks of 16 keys, past MAX_CHUNKS) the two kernels stay, for gemma3-4b and llama3-1b
    (grouped); so do prefill's kernels (no decode attention), and llama3-1b's 32 heads unless grouped."""
    monkeypatch.setenv("LUM_O_COMBINE", "1")
    prog, dv = _layer("llama3-1b", 512)
    ks = group_kernel_sources(prog, dv, default_max_dyn(dv, 512))
    assert not any("o_combine" in k.tuning for k in ks.values())
    monkeypatch.setenv("LUM_O_COMBINE", "grouped")
    for model, max_seq in (("gemma3-4b", 2048), ("llama3-1b", 2048)):
        prog, dv = _layer(model, max_seq)
        ks = group_kernel_sources(prog, dv, default_max_dyn(dv, max_seq))
        assert not any("o_combine" in k.tuning for k in ks.values()), model
    assert 2048 // 16 > MAX_CHUNKS
    from lum.builder.compile import compile_graph
    from lum.builder.models.config import named_config
    from lum.builder.models.transformer import build_entry
    for cg in compile_graph(build_entry(named_config("tiny-gemma3"), "prefill", 16, DType.f32)):
        dv = program_dyn_vars([cg.program])
        ks = group_kernel_sources(cg.program, dv, default_max_dyn(dv, 16))
        assert not any("o_combine" in k.tuning for k in ks.values())


def test_the_fused_kernel_replaces_the_combine_and_o(monkeypatch):
    """With the switch on, gemma3-4b's combine and o are one kernel under the combine, o its tail: 40 column
    groups of 64 in clusters of 8 blocks (a head each) of 256 threads, its weights (32 KB a block) read before its
    wait, the table a cluster table (version 3), and the module compiles with NVRTC (no GPU needed); the LLIR is
    unchanged, and with the switch off, or for sm_80, nothing fuses."""
    monkeypatch.setenv("LUM_O_COMBINE", "1")
    prog, dv = _layer("gemma3-4b", 512)
    ks = group_kernel_sources(prog, dv, default_max_dyn(dv, 512))
    (fused,) = [k for k in ks.values() if "o_combine" in k.tuning]
    comb = _combine(prog)
    o_id = fused.tuning["o_combine"][1]
    assert fused.tails == (o_id,) and o_id not in ks and comb.id in ks and ks[comb.id] is fused
    launch = fused.launches[0]
    assert launch.grid[0].value == 320 and launch.block == (256, 1, 1) and launch.shared_mem == 64 * 256 * 2
    assert launch.cluster == 8
    table = launch_table(prog, ks, arch="sm_90", dyn_vars=dv, max_dyn=default_max_dyn(dv, 512))
    (entry,) = [e for e in table["ops"] if e["name"] == fused.name]
    assert table["version"] == 3 and entry["launches"][0]["cluster"] == 8 and entry["tail"] == [o_id]
    assert table["programmatic"]
    assert fused.early == ("t0_in1",)
    body = fused.body
    assert body.index("lum_copy16_async") < body.index("lum_pdl_wait();") < body.index("exp2f")
    res = nvrtc.compile_cuda(fused.source, "sm_90", name="o_combine.cu")
    assert res.cubin[:4] == b"\x7fELF" and res.ptx.count(".entry") == 1
    assert "barrier.cluster.arrive.release" in res.ptx and "st.shared::cluster" in res.ptx
    monkeypatch.setenv("LUM_O_COMBINE", "0")
    plain, dv = _layer("gemma3-4b", 512)
    ks = group_kernel_sources(plain, dv, default_max_dyn(dv, 512))
    assert not any("o_combine" in k.tuning for k in ks.values())
    monkeypatch.setenv("LUM_O_COMBINE", "1")           # no thread block clusters before sm_90
    ks = group_kernel_sources(plain, dv, default_max_dyn(dv, 512), arch="sm_80")
    assert not any("o_combine" in k.tuning for k in ks.values())
    assert [(o.kind, o.op, o.shape) for o in plain.ops] == [(o.kind, o.op, o.shape) for o in prog.ops]


def test_the_dot_reads_shared_memory_in_vectors():
    """gemma3-4b's combine inside o reads a lane's 8 combined inputs as two 16-byte vectors, once for its 8
    columns, and each column's weights as one vector (PTX: no float or 2-byte reloads of them, which were 8-way
    and 4-way bank conflicts before 1d5fc3e)."""
    prog, dv = _layer("gemma3-4b", 512)
    ks = group_kernel_sources(prog, dv, default_max_dyn(dv, 512))
    (fused,) = [k for k in ks.values() if "o_combine" in k.tuning]
    ptx = nvrtc.compile_cuda(fused.source, "sm_90", name="o_combine.cu").ptx
    assert ptx.count("ld.shared.v4.f32") == 2 and ptx.count("ld.shared.v4.u32") == 8 and "ld.shared.u16" not in ptx


def test_llama_groups_four_heads_a_block(monkeypatch):
    """With ``LUM_O_COMBINE=grouped`` llama3-1b's 32 heads of 64, more than a cluster's 8 blocks, fuse with each
    block taking 4 consecutive heads (256 of o's inputs, 32 KB of weights a block), 32 column groups in clusters
    of 8, and the module compiles."""
    monkeypatch.setenv("LUM_O_COMBINE", "grouped")
    prog, dv = _layer("llama3-1b", 512)
    ks = group_kernel_sources(prog, dv, default_max_dyn(dv, 512))
    (fused,) = [k for k in ks.values() if "o_combine" in k.tuning]
    assert fused.tuning["heads_a_block"] == 4
    launch = fused.launches[0]
    assert launch.grid[0].value == 8 * 32 and launch.cluster == 8 and launch.shared_mem == 64 * 256 * 2
    assert launch.block == (256, 1, 1)
    res = nvrtc.compile_cuda(fused.source, "sm_90", name="o_combine.cu")
    assert res.ptx.count(".entry") == 1 and "st.shared::cluster" in res.ptx


def test_heads_a_block_is_the_fewest_that_fit_a_cluster():
    """Heads a block: 1 up to a cluster's 8 blocks, then the fewest dividing the heads into at most 8 (12 → 2,
    32 → 4, 40 → 5, a prime 11 → all 11 in one block); none where a block's inputs would pass 512 (its
    threads)."""
    assert [heads_a_block(h, 64) for h in (1, 6, 8, 12, 32, 40)] == [1, 1, 1, 2, 4, 5]
    assert heads_a_block(8, 256) == 1 and heads_a_block(16, 256) == 2
    assert heads_a_block(11, 16) == 11
    assert heads_a_block(32, 256) is None and heads_a_block(11, 64) is None   # 4 × 256 and 11 × 64 inputs


def test_combine_leaves_and_their_near_misses(monkeypatch):
    """gemma3-4b's combine: X the offsets (arg 1), L the sums (2), A the accumulators (0), K the −1 constant (3).
    Not a combine for the fused kernel: a K that varies along the features, a reduce that is not a Sum, a Sum
    over another axis, a prologue whose accumulators are a tree rather than a leaf."""
    import ast
    from dataclasses import replace

    from lum.format.expr import as_expr
    from lum.format.llir import Arg

    prog, _ = _layer("gemma3-4b", 512)
    comb = _combine(prog)
    assert combine_leaves(comb) == CombineLeaves(x=1, l=2, a=0, k=3)
    kview = comb.args[3].view
    varying = replace(kview, strides=kview.strides[:-2] + (as_expr(1), as_expr(0)))
    args = comb.args[:3] + (Arg(comb.args[3].src, varying),)
    assert combine_leaves(replace(comb, args=args)) is None
    assert combine_leaves(replace(comb, op="Max")) is None
    assert combine_leaves(replace(comb, params={**comb.params, "axis": 2})) is None
    tree = str(comb.params["expr"]).replace("['arg', 0]", "['Neg', 'f32', ['arg', 0]]")
    assert combine_leaves(replace(comb, params={**comb.params, "expr": ast.literal_eval(tree)})) is None
