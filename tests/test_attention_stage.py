"""Attention stages (builder/attention_stage.py, templates/attention.cu STAGE, codegen.stage_row): which decode
attentions compute the q rows and kv-cache writes before them, the row maps, the launch table, the NVRTC
compile. Results are checked on the emulated driver (tests/test_cuda_emulated.py: the tiny models' greedy
tokens, grids capped at two blocks so that a block runs several work items) and on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lum.builder.attention_policy import attention_stage_block
from lum.builder.attention_stage import attention_stage_enabled, fuse_attention_stages, stage_ops
from lum.builder.codegen import AttentionStage, generate_program
from lum.builder.intmath import is_pow2
from lum.builder.kernels import _waits, default_max_dyn, group_kernel_sources, launch_table, program_dyn_vars
from lum.format.dtypes import DType
from lum.format.expr import as_expr
from lum.format.llir import Arg, LOp, Program, attention_dims
from lum.format.shapetracker import ShapeTracker

MAX_SEQ = 64


def _layer(model: str, dtype: DType = DType.f32) -> tuple[Program, list[str]]:
    """The decode layer group of a named model (the group with the kv-cache writes) and the dyn slots."""
    from lum.builder.compile import compile_graph
    from lum.builder.models.config import named_config
    from lum.builder.models.transformer import build_entry

    cgs = compile_graph(build_entry(named_config(model), "decode", MAX_SEQ, dtype))
    dv = program_dyn_vars([cg.program for cg in cgs])
    return max(cgs, key=lambda cg: sum(o.kind == "scatter_nocopy" for o in cg.program.ops)).program, dv


def _attention(prog: Program) -> LOp:
    (att,) = [o for o in prog.ops if o.kind == "attention"]
    return att


@pytest.mark.parametrize("model,group", [("tiny-gemma3", 2), ("tiny-llama", 2), ("gemma3-4b", 2), ("llama3-1b", 4)])
def test_decode_attention_runs_its_stage(monkeypatch, model, group):
    """By default the q op (norm + RoPE, or RoPE) and both cache writes have no kernel: the attention's runs
    them, under the first of the three (table version 2, the attention its last tail), launched as the
    attention's grid and programmatic; with ``LUM_ATTENTION_STAGE=0`` they are the sibling kernel before it."""
    prog, dv = _layer(model)
    max_dyn = default_max_dyn(dv, MAX_SEQ)
    att = _attention(prog)
    q, k, v = stage_ops(prog, att)
    assert (q.kind, k.kind, v.kind) == ("elementwise", "scatter_nocopy", "scatter_nocopy")
    assert attention_stage_enabled()
    fused = group_kernel_sources(prog, dv, max_dyn)
    run = sorted((q.id, k.id, v.id))
    ks = fused[run[0]]
    assert ks.tails == (*run[1:], att.id) and not ({q.id, k.id, v.id, att.id} - {run[0]}) & set(fused)
    assert ks.tuning["stage"] == run and ks.tuning["group_rows"] == group
    plain = generate_program(prog, dv, max_dyn=max_dyn)
    stage_block = attention_stage_block(att)       # llama3-1b's six stage rows: 8 warps, one round
    assert ks.grid == plain[att.id].grid
    assert ks.block == ((stage_block[0], 1, 1) if stage_block else plain[att.id].block)
    table = launch_table(prog, fused, arch="sm_90", dyn_vars=dv, max_dyn=max_dyn)
    (entry,) = [e for e in table["ops"] if e.get("tail") and e["tail"][-1] == att.id]
    clusters = any("cluster" in lc for e in table["ops"] for lc in e["launches"])   # the combine inside o
    assert table["version"] == (3 if clusters else 2) and table["programmatic"] and entry["tail"] == [*run[1:], att.id]
    assert f"out@{att.id}" in entry["params"] and entry["params"][-1] == f"in3@{att.id}"
    body = ks.body
    assert body.count('extern "C" __global__') == 1 and body.count("lum_pdl_wait();") == 1
    d = attention_dims(att)[2].value               # the query rows come back from shared memory as vectors
    vectorq = d % 32 == 0 and is_pow2(d // 32)      # where each lane's slice is a whole power of two of floats
    assert ("lum_load_raw<DPL>(&lum_qs[lum_m][lum_lane * DPL], lum_q[lum_m]);" in body) == vectorq
    assert ("lum_qs[lum_m][lum_d]" in body) != vectorq
    assert "__restrict__" not in body.split("_attn(")[-2].rsplit("\n", 2)[-1]
    monkeypatch.setenv("LUM_ATTENTION_STAGE", "0")
    off = group_kernel_sources(prog, dv, max_dyn)
    assert att.id in off and not off[att.id].tails and off[run[0]].tails == tuple(run[1:])    # the siblings
    assert len(off) == len(fused) + 1


def test_row_maps():
    """gemma3-4b's stage: query row m of kv row h is the q op's row 2h + m, stored at 512h + 256m; kv row h is
    each cache write's row h."""
    from lum.builder.attention_stage import _stage
    from lum.builder.codegen import stage_row

    prog, dv = _layer("gemma3-4b", DType.bf16)
    att = _attention(prog)
    ops = stage_ops(prog, att)
    rows = {r: stage_row(o, dv, f"f_{r}", arg_dtypes=[prog.ops[a.src].dtype for a in o.args]) for r, o in zip("qkv", ops)}
    assert rows["q"].rows == 8 and rows["q"].bases == tuple(256 * i for i in range(8)) and rows["q"].row_step is None
    assert rows["k"].rows == 4 and rows["k"].bases == (0, 256, 512, 768) and rows["k"].row_step == 1024
    assert _stage(att, rows) == AttentionStage(q=(0, 2, 1), qb=(0, 512, 256), k=(0, 1), v=(0, 1))
    assert "lum_wfirst && lum_dr >= lum_wT" in rows["k"].function and "lum_sink[" in rows["q"].function


def test_near_misses_keep_their_kernels():
    """No stage where the q op has another reader, a cache write copies its rows (a scatter), a kernel runs between, or
    the attention reads its query rows where the q op stores none of them."""
    prog, dv = _layer("tiny-llama")
    max_dyn = default_max_dyn(dv, MAX_SEQ)
    att = _attention(prog)
    q, k, v = stage_ops(prog, att)
    n = len(prog.ops)

    def fused(p: Program) -> bool:
        out = fuse_attention_stages(p, generate_program(p, dv, max_dyn=max_dyn), dv, max_dyn, {})
        return any(ks is not None and att.id in ks.tails for ks in out.values())

    assert fused(prog)
    extra = LOp(n, "output", "Output", (Arg(q.id, ShapeTracker.contiguous(q.shape)),), q.shape, q.dtype,
                {"name": "q_too", "role": "output"})
    read_twice = Program(prog.name, [*prog.ops, extra])
    assert stage_ops(read_twice, att) is None and not fused(read_twice)
    copying = Program(prog.name, [replace(o, kind="scatter", alias=None) if o.id == v.id else o for o in prog.ops])
    assert stage_ops(copying, att) is None
    shifted = replace(att, args=(Arg(q.id, replace(att.args[0].view, offset=att.args[0].view.offset + as_expr(1))),
                                 *att.args[1:]))
    off_by_one = Program(prog.name, [shifted if o.id == att.id else o for o in prog.ops])
    assert stage_ops(off_by_one, att) is not None and not fused(off_by_one)
    first = min(q.id, k.id, v.id)
    between = [o for o in prog.ops if first < o.id < att.id and o.kind == "constant"]
    if between:                                    # a kernel where a constant was: the four are not in a row
        c = between[0]
        work = LOp(c.id, "elementwise", "Exp2", (Arg(q.id, ShapeTracker.contiguous(q.shape)),), q.shape,
                   q.dtype, {})
        assert stage_ops(Program(prog.name, [work if o.id == c.id else o for o in prog.ops]), att) is None


@pytest.mark.parametrize("arch", ["sm_90", "sm_75"])
def test_stage_kernels_compile(nvrtc, tmp_path, arch):
    """NVRTC compiles the stage kernels of gemma3-4b's and llama3-1b's bf16 decode layers (no GPU needed)."""
    from lum.builder.kernels import compile_group_kernels
    for model in ("gemma3-4b", "llama3-1b"):
        prog, dv = _layer(model, DType.bf16)
        gk = compile_group_kernels(prog, arch=arch, dyn_vars=dv, max_dyn=default_max_dyn(dv, MAX_SEQ), ptx=False,
                                   cache_dir=tmp_path)
        assert gk.cubin and any("_stage_" in k["name"] for k in gk.table["ops"])


def test_lane_slices_move_through_shared_memory_as_vectors(nvrtc, tmp_path):
    """gemma3-4b's decode attention reads its stage's query rows and stores its warps' partials in 16-byte
    shared-memory accesses (a lane's 8 floats: two, not eight, so 2-way rather than 8-way bank conflicts, as
    before 1d5fc3e), the partial rows padded to whole vectors; the PTX says which accesses are vectors."""
    from lum.builder.nvrtc import compile_cuda

    prog, dv = _layer("gemma3-4b", DType.bf16)
    att = _attention(prog)
    (k,) = [k for k in group_kernel_sources(prog, dv, default_max_dyn(dv, MAX_SEQ)).values()
            if k is not None and att.id in k.tails]
    ptx = compile_cuda(k.source, "sm_90", name="att.cu", ptx=True, cache_dir=tmp_path).ptx
    assert "constexpr bool SMEM_VECTORS = true;" in k.body and "lum_load_raw<DPL>(&lum_qs" in k.body
    assert "lum_qs[lum_m][lum_d]" not in k.body
    assert ptx.count("ld.shared.v4.f32") == 4 and ptx.count("st.shared.v4.f32") == 4   # 2 rows x 2 vectors


@pytest.mark.parametrize("model,block", [("llama3-1b", (256, 2)), ("gemma3-4b", None), ("tiny-llama", None)])
def test_one_round_stage_takes_warps_for_every_stage_row(model, block):
    """By default a stage of more than four rows (llama3-1b: 4 query rows, k, v) gets a
    power of two of warps, all its rows in one round, and UNROLL so that WARPS · UNROLL stays the chunk (16);
    a stage that fits four warps (gemma3-4b: 2 query rows) keeps 4 warps of 4 keys."""
    prog, dv = _layer(model, DType.bf16)
    att = _attention(prog)
    assert attention_stage_block(att) == block
    ks = [k for k in group_kernel_sources(prog, dv, default_max_dyn(dv, MAX_SEQ)).values()
          if k is not None and att.id in k.tails]
    threads, unroll = block or (128, 4)
    assert len(ks) == 1 and ks[0].block[0] == threads and ks[0].tuning["unroll"] == unroll
    if block is not None:                  # one round of stage rows
        assert "for (int lum_r = 0; lum_r < 1; ++lum_r)" in ks[0].body


def test_trigger_after_stage():
    """Of gemma3-4b's decode layer kernels only the fused attention lets the next kernel launch after its
    stage's barrier: no trigger in its preamble (a start stamp instead), one after the barrier, once a block;
    it still waits first, so the table stays programmatic. Every other kernel triggers first."""
    prog, dv = _layer("gemma3-4b", DType.bf16)
    after = group_kernel_sources(prog, dv, default_max_dyn(dv, MAX_SEQ))
    fused = [i for i, k in after.items() if k is not None and k.tuning.get("stage_trigger")]
    assert len(fused) == 1 and after[fused[0]].tuning["stage"] and "_attn(LumQ" in after[fused[0]].body
    for i, k in after.items():
        if k is not None and i not in fused:
            assert k.body.count("lum_pdl_trigger();") >= 1 and "(lum_pdl_trigger)();" not in k.body, k.name
    body = after[fused[0]].body.split("_attn(LumQ")[1]
    assert "lum_pdl_trigger();" not in body and body.count("(lum_pdl_trigger)();") == 1
    order = ["LUM_STAMP_AT(0);", "lum_pdl_wait();", "__syncthreads();   // the query", "(lum_pdl_trigger)();",
             "LUM_STAMP_AT(2);"]
    assert [body.index(x) for x in order] == sorted(body.index(x) for x in order)
    assert _waits(after[fused[0]])


def test_a_kernel_that_does_not_wait_warns_at_the_table():
    """A launch table is programmatic only if every kernel waits first (``_waits``). gemma3-4b's decode layer is;
    with the fused attention's wait removed (as the first build of a since removed stage prefetch did, by
    placing its prefetches before the body's call), the table says not programmatic and the build warns, naming
    that kernel, where before it silently launched the whole layer plainly (−5.4% at 0c7bc11)."""
    import warnings

    prog, dv = _layer("gemma3-4b", DType.bf16)
    max_dyn = default_max_dyn(dv, MAX_SEQ)
    sources = group_kernel_sources(prog, dv, max_dyn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # the default layer: no warning
        assert launch_table(prog, sources, arch="sm_90", dyn_vars=dv, max_dyn=max_dyn)["programmatic"]
    i, ks = next((i, k) for i, k in sources.items() if k is not None and k.tails)
    broken = {**sources, i: replace(ks, body=ks.body.replace("lum_pdl_wait();", "", 1))}
    with pytest.warns(UserWarning, match=f"{ks.name} access memory before waiting"):
        table = launch_table(prog, broken, arch="sm_90", dyn_vars=dv, max_dyn=max_dyn)
    assert not table["programmatic"]
