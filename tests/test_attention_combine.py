"""The attention combine inside the attention kernel (builder/attention_combine.py, templates/attention.cu
COMBINE): which combines fuse, what the kernel and its launch table look like, the buffer lifetimes the
loader gives a kernel with tails, and the NVRTC compile, counted and in thread block clusters. Its results are checked on the emulated driver
(tests/test_cuda_emulated.py) and on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lum.builder.attention_combine import attention_combine_mode, combine_of, fuse_attention_combines
from lum.builder.codegen import generate, generate_program
from lum.builder.extract import attention_ops
from lum.builder.kernels import group_kernel_sources, launch_table
from lum.format.dtypes import DType
from lum.format.expr import Var, as_expr
from lum.format.llir import Arg, LOp, Program
from lum.format.shapetracker import ShapeTracker

MAX_T, D, GROUP = 64, 32, 2


def _program(dt: DType = DType.bf16, neg: float = -1.0, second_reader: bool = False) -> Program:
    """q = Contiguous(q_in) [2 kv heads, GROUP, 1, D] (an intermediate, so the arena holds it), a [MAX_T, 2, D]
    cache read [0, p + 1) as K and V, a mask; then attention (op 5), the −1 (6), the combine (7), output 8."""
    t = Var("p") + 1
    rows = tuple(as_expr(x) for x in (2, GROUP, 1))
    cache = ShapeTracker.contiguous((MAX_T, 2, D)).slice(0, 0, t).permute((1, 0, 2))
    kv = cache.expand_dim(1, GROUP).expand_dim(2, 1)
    mask = ShapeTracker.contiguous((MAX_T,)).slice(0, 0, t).expand_dim(0, 1).expand_dim(0, GROUP).expand_dim(0, 2)
    qv = ShapeTracker.contiguous(rows + (as_expr(D),))
    ins = [LOp(0, "input", "Input", (), rows + (as_expr(D),), dt, {"name": "q", "role": "input"}),
           LOp(1, "input", "Input", (), (as_expr(MAX_T), as_expr(2), as_expr(D)), dt, {"name": "k", "role": "input"}),
           LOp(2, "input", "Input", (), (as_expr(MAX_T), as_expr(2), as_expr(D)), dt, {"name": "v", "role": "input"}),
           LOp(3, "input", "Input", (), (as_expr(MAX_T),), DType.bool, {"name": "mask", "role": "input"}),
           LOp(4, "elementwise", "Contiguous", (Arg(0, qv),), rows + (as_expr(D),), dt, {})]
    part, c, comb = attention_ops((Arg(4, qv), Arg(1, kv), Arg(2, kv), Arg(3, mask)), D ** -0.5, dt, dt, 5)
    c = replace(c, params={"value": neg})
    outs = [LOp(8, "output", "Output", (Arg(7, ShapeTracker.contiguous(comb.shape)),), comb.shape, dt,
                {"name": "y", "role": "output"})]
    if second_reader:
        outs.append(LOp(9, "output", "Output", (Arg(5, ShapeTracker.contiguous(part.shape)),), part.shape, DType.f32,
                        {"name": "partials", "role": "output"}))
    return Program("attention", ins + [part, c, comb] + outs)


def test_the_combine_attention_ops_builds_fuses_and_near_misses_do_not():
    prog = _program()
    assert combine_of(prog, prog.ops[5]) is prog.ops[7]
    assert combine_of(prog, prog.ops[4]) is None                          # not an attention op
    assert combine_of(_program(neg=-2.0), _program(neg=-2.0).ops[5]) is None    # another constant
    two = _program(second_reader=True)
    assert combine_of(two, two.ops[5]) is None                            # the partials read elsewhere too
    other = replace(prog.ops[7], params={**prog.ops[7].params, "expr": ["Mul", "f32", ["arg", 0], ["arg", 3]]})
    changed = Program("attention", [*prog.ops[:7], other, *prog.ops[8:]])
    assert combine_of(changed, changed.ops[5]) is None                    # another tree over the partials


def test_the_attention_kernel_runs_its_combine_as_its_tail(monkeypatch):
    prog = _program()
    plain = generate_program(prog, ["p"], max_dyn={"p": MAX_T})
    fused = fuse_attention_combines(prog, plain, ["p"], {"p": MAX_T})
    ks = fused[5]
    assert 7 not in fused and ks.tails == (7,) and ks.tuning["combine"] is True
    assert [p.name for p in ks.params] == ["out", "in0", "in1", "in2", "in3", "dyn",
                                           "t0_out", "t0_in0", "t0_in1", "t0_in2", "t0_in3"]
    assert "lum_count_done(&" in ks.body and f"{ks.name}_count[2]" in ks.body     # one counter a kv row
    assert "lum_count_done" not in plain[5].body and plain[7] is not None
    table = launch_table(prog, fused, arch="sm_90", dyn_vars=["p"])
    att = next(o for o in table["ops"] if o["kind"] == "attention")
    assert table["version"] == 2 and att["tail"] == [7] and att["params"][6:] == [
        "out@7", "in0@7", "in1@7", "in2@7", "in3@7"] and table["programmatic"]
    # off (the default): the group's kernels are the plain ones
    monkeypatch.delenv("LUM_ATTENTION_COMBINE", raising=False)
    assert attention_combine_mode() is None
    assert {i: k.name for i, k in group_kernel_sources(prog, ["p"], {"p": MAX_T}).items()} == \
        {i: k.name for i, k in plain.items() if k is not None}
    monkeypatch.setenv("LUM_ATTENTION_COMBINE", "1")
    on = group_kernel_sources(prog, ["p"], {"p": MAX_T})
    assert on[5].name == ks.name and 7 not in on
    monkeypatch.setenv("LUM_ATTENTION_COMBINE", "yes")
    with pytest.raises(ValueError, match="LUM_ATTENTION_COMBINE must be one of 0, 1, cluster"):
        attention_combine_mode()


def test_the_attention_kernel_combines_in_clusters(monkeypatch):
    """``cluster``: a cluster per kv row (2 here), of a block per chunk in a power of two up to 8 (p <= 20: 21
    keys, two chunks of 16), the grid whole clusters, the table version 3 naming the cluster; no counter.
    For sm_75 the combine keeps its kernel."""
    prog = _program()
    plain = generate_program(prog, ["p"], max_dyn={"p": 20})
    fused = fuse_attention_combines(prog, plain, ["p"], {"p": 20}, cluster=True)
    ks = fused[5]
    assert 7 not in fused and ks.tails == (7,) and ks.tuning["cluster"] == 2
    (lc,) = ks.launches
    assert lc.cluster == 2 and [str(g) for g in lc.grid] == ["4", "1", "1"]
    assert "lum_count_done" not in ks.body and "lum_cluster_sync();" in ks.body
    table = launch_table(prog, fused, arch="sm_90", dyn_vars=["p"])
    att = next(o for o in table["ops"] if o["kind"] == "attention")
    assert table["version"] == 3 and att["launches"][0]["cluster"] == 2 and att["tail"] == [7]
    for bound, size in (({"p": MAX_T}, 8), (None, 8)):                # 5 chunks; no bound: the portable size
        assert fuse_attention_combines(prog, plain, ["p"], bound, cluster=True)[5].launches[0].cluster == size
    capped = fuse_attention_combines(prog, plain, ["p"], {"p": 20}, tuning={"max_blocks": 3}, cluster=True)[5]
    assert [str(g) for g in capped.launches[0].grid] == ["2", "1", "1"]     # one cluster takes both kv rows
    monkeypatch.setenv("LUM_ATTENTION_COMBINE", "cluster")
    assert attention_combine_mode() == "cluster"
    assert group_kernel_sources(prog, ["p"], {"p": 20})[5].name == ks.name
    old = group_kernel_sources(prog, ["p"], {"p": 20}, arch="sm_75")
    assert 7 in old and old[5].name == plain[5].name


def test_only_an_attention_kernel_runs_a_combine():
    from lum.builder.codegen import CodegenError

    prog = _program()
    with pytest.raises(CodegenError, match="only an attention kernel runs a combine"):
        generate(prog.ops[4], ["p"], arg_dtypes=[DType.bf16], combine=prog.ops[7])


@pytest.mark.parametrize("arch,cluster", [("sm_90", False), ("sm_75", False), ("sm_90", True)],
                         ids=["counted-sm_90", "counted-sm_75", "cluster-sm_90"])
@pytest.mark.parametrize("dt", [DType.f32, DType.bf16])
def test_the_combining_attention_kernel_compiles(nvrtc, tmp_path, arch, cluster, dt):
    from lum.builder.codegen import module_source
    prog = _program(dt)
    fused = fuse_attention_combines(prog, generate_program(prog, ["p"]), ["p"], {"p": MAX_T}, cluster=cluster)
    src = module_source([k for k in fused.values() if k is not None])
    res = nvrtc.compile_cuda(src, arch, cache_dir=tmp_path)
    assert res.cubin[:4] == b"\x7fELF" and "ld.global.cg.f32" in res.ptx
    assert ("atom.acq_rel.gpu.global.add.u32" in res.ptx) != cluster
    assert ("barrier.cluster.arrive.release.aligned" in res.ptx and "barrier.cluster.wait.acquire.aligned" in res.ptx) \
        == cluster
    if cluster:                                  # no cluster barrier before sm_90: the kernel refuses to compile
        with pytest.raises(Exception, match="needs sm_90"):
            nvrtc.compile_cuda(src, "sm_75", cache_dir=tmp_path)


@pytest.mark.usefixtures("nvrtc")          # it builds packages
def test_what_a_kernel_with_tails_reads_stays_live_until_its_last_tail(tmp_path, monkeypatch):
    """The combine runs while other blocks of the attention kernel still read q: q's buffer must not be
    the combine's (the arena may reuse a buffer only after its last reader, counted at the last tail)."""
    import lum.loader
    from lum.builder.package_builder import BuildOptions, write_program_package
    from tests.kernel_cases import entry_for

    prog = _program()
    last = {}
    for on in ("0", "1", "cluster"):
        monkeypatch.setenv("LUM_ATTENTION_COMBINE", on)
        path = write_program_package(tmp_path / f"att{on}.lumpkg", [prog], {"main": entry_for(prog, None, ("p",))},
                                     model={"max_seq": MAX_T}, options=BuildOptions())
        with lum.loader.open(path) as pkg:
            bufs = {b.name: b for b in pkg.buffers("main")}
            last[on] = (bufs["c0.4"].last, bufs["c0.7"].first)
    q_last, comb_first = last["0"]
    assert q_last < comb_first                   # two kernels: q is dead once attention has run
    for on in ("1", "cluster"):
        q_last, comb_first = last[on]
        assert q_last >= comb_first              # one kernel: q lives until its combine has run


@pytest.mark.parametrize("mode", ["1", "cluster"])
@pytest.mark.parametrize("model", ["gemma3-4b", "llama3-1b"])
def test_the_real_models_combining_attention_kernels_do_not_spill(nvrtc, model, mode, monkeypatch, tmp_path):
    """ptxas -v of the decode attention kernel with its stage and its combine (counted, or in clusters), at the
    real models' shapes (gemma3-4b: 2 query rows of 256 features a kv row, llama3-1b: 4 of 64): no spill (an
    unrolled combine over the query rows spilled llama's)."""
    from lum.builder.compile import compile_graph
    from lum.builder.kernels import _ptxas_log, default_max_dyn, program_dyn_vars
    from lum.builder.models.config import named_config
    from lum.builder.models.transformer import build_entry

    monkeypatch.setenv("LUM_ATTENTION_COMBINE", mode)
    cgs = compile_graph(build_entry(named_config(model), "decode", 4096, DType.bf16))
    dv = program_dyn_vars([cg.program for cg in cgs])
    (layer,) = [cg.program for cg in cgs if any(o.kind == "attention" for o in cg.program.ops)]
    ks = [k for k in group_kernel_sources(layer, dv, default_max_dyn(dv, 4096)).values()
          if any(layer.ops[t].kind == "attention" for t in k.tails)]        # it runs its stage too, then its combine
    assert len(ks) == 1 and ("cluster" in ks[0].tuning) == (mode == "cluster") and ks[0].tuning["combine"]
    assert [layer.ops[t].kind for t in ks[0].tails[-2:]] == ["attention", "reduce"]
    log = _ptxas_log(ks, "sm_90", tmp_path)
    assert ks[0].name in nvrtc.ptxas_registers(log) and not nvrtc.ptxas_spills(log), log
