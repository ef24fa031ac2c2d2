"""Kernel tails (builder/tail.py): a kernel's last block runs the small kernel ops that read its output.

Checked here: which ops become tails on the decode layers of tiny and real models (the qkv GEMV runs
the q/k norms, RoPE and KV-cache writes; gemma's o and down GEMVs run their one-row norms), and which
stay kernels of their own on programs built for it (an op not reading the head, a grid of more than
TAIL_MAX_BLOCKS blocks or one that follows an unbounded dyn var, a library call in between, the cap
on tails per head); the fused kernels compile with NVRTC and keep their heads' registers; the launch
table's form and its checks in the manifest parser and the loader; whole tiny models with tails on the
emulated driver against the reference backend (tests/cuda_emulation.py). Tails are off by default
(builder/tail.py says why); the tests here turn them on.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

pytest.importorskip("egglog")

from lum.builder import tail  # noqa: E402
from lum.builder.compile import compile_graph, compile_group  # noqa: E402
from lum.builder.kernels import (TAIL_TABLE_VERSION, default_max_dyn, group_kernel_sources, launch_table,  # noqa: E402
                                 program_dyn_vars)
from lum.format.dtypes import DType  # noqa: E402
from lum.format.errors import PackageFormatError  # noqa: E402
from lum.format.expr import Var, as_expr  # noqa: E402
from lum.format.llir import Arg, LOp, Program  # noqa: E402
from lum.format.manifest import Manifest  # noqa: E402
from lum.format.shapetracker import ShapeTracker  # noqa: E402
from tests.test_prologue import _groups  # noqa: E402


@pytest.fixture(autouse=True)
def _all_tails(monkeypatch):
    """Tails are off by default (measured slower, builder/tail.py); these tests turn them on."""
    monkeypatch.setenv(tail.ENV_KERNEL_TAILS, "all")


def test_off_by_default(monkeypatch):
    monkeypatch.delenv(tail.ENV_KERNEL_TAILS)
    monkeypatch.setenv("LUM_SIBLING_KERNELS", "0")     # the default's other fusions of small kernels
    monkeypatch.setenv("LUM_ATTENTION_STAGE", "0")
    assert tail.kernel_tails_policy() == "0" and not tail.kernel_tails_enabled()
    prog, sources = _layer_kernels("tiny-gemma3")
    assert len(sources) == len(prog.kernels()) and not any(ks.tails for ks in sources.values())


def _layer_kernels(model: str) -> tuple[Program, dict]:
    """The decode layer group's program (the one with attention) and its kernels, tails applied."""
    for cg in _groups(model, "decode"):
        prog = compile_group(cg)[0]
        if any(o.kind == "attention" for o in prog.ops):
            dv = program_dyn_vars([prog])
            return prog, group_kernel_sources(prog, dv, default_max_dyn(dv, 64))
    raise AssertionError("no attention group")


def _tails(prog: Program, sources: dict) -> dict[int, list[LOp]]:
    by_id = {o.id: o for o in prog.ops}
    return {i: [by_id[t] for t in ks.tails] for i, ks in sources.items() if ks.tails}


def _head(prog: Program, tails: dict, pred) -> list[LOp]:
    by_id = {o.id: o for o in prog.ops}
    heads = [i for i in tails if pred(by_id[i])]
    assert len(heads) == 1, heads
    return tails[heads[0]]


def test_qkv_gemv_runs_rope_and_cache_writes_llama():
    """``all``: the qkv GEMV's last block runs the k RoPE + cache write, the v write and the q RoPE."""
    prog, sources = _layer_kernels("tiny-llama")
    tails = _tails(prog, sources)
    qkv = _head(prog, tails, lambda o: o.kind == "gemm" and "expr" in o.params)
    assert sorted(o.kind for o in qkv) == ["elementwise", "scatter_nocopy", "scatter_nocopy"]
    covered = {t.id for ts in tails.values() for t in ts}
    assert len(sources) == len(prog.kernels()) - len(covered)
    assert all(o.kind != "gemm" for ts in tails.values() for o in ts)        # a GEMV is never a tail


def test_bad_policy_is_refused(monkeypatch):
    monkeypatch.setenv(tail.ENV_KERNEL_TAILS, "some")
    with pytest.raises(ValueError, match="LUM_KERNEL_TAILS"):
        _layer_kernels("tiny-llama")


def test_gemma_layer_tails():
    """``all``: qkv runs the k RoPE + cache write, the v write and the q RoPE (each with its head norm
    inside: builder/row_reads.py); down the residual's one-row norm (the post-attention one is gate-up's
    prologue in the tiny model: its gate-up is narrow)."""
    prog, sources = _layer_kernels("tiny-gemma3")
    tails = _tails(prog, sources)
    qkv = _head(prog, tails, lambda o: o.kind == "gemm" and "expr" in o.params)
    assert sorted(o.kind for o in qkv) == ["elementwise"] + ["scatter_nocopy"] * 2
    gemv_rows = [ts for i, ts in tails.items()
                 if prog.ops[i].kind == "gemm" and "expr" not in prog.ops[i].params]
    assert len(gemv_rows) == 1 and all(len(ts) == 1 and ts[0].kind == "elementwise" for ts in gemv_rows)


def test_a_head_keeps_its_registers():
    """The fused kernel's launch bounds keep the head's resident blocks (what its own register count
    allows); the tails are not inlined into it and read their rows each phase (no register rows), so
    they fit in the head's registers without spilling much."""
    pytest.importorskip("lum.builder.nvrtc")
    from lum.builder import nvrtc
    from lum.builder.codegen import generate_program, module_source

    prog, sources = _layer_kernels("tiny-gemma3")
    dv = program_dyn_vars([prog])
    plain = generate_program(prog, dv, max_dyn=default_max_dyn(dv, 64))
    fused = [(i, ks) for i, ks in sources.items() if ks.tails]
    alone = nvrtc.ptxas_registers(nvrtc.compile_cuda(module_source([plain[i] for i, _ in fused]), ptx=False,
                                                     extra_options=["--ptxas-options=-v"]).log)
    together = nvrtc.ptxas_registers(nvrtc.compile_cuda(module_source([ks for _, ks in fused]), ptx=False,
                                                        extra_options=["--ptxas-options=-v"]).log)
    for i, ks in fused:
        t = ks.block[0]
        want = tail.min_blocks(t, alone[plain[i].name])
        assert f"__launch_bounds__({t}, {want})" in ks.body and "__noinline__" in ks.body
        assert all(d.get("regs", 0) == 0 for d in ks.tuning["tail"])        # row tails keep no register rows
        assert tail.min_blocks(t, together[ks.name]) >= want
    assert tail.min_blocks(256, 32) == 8 and tail.min_blocks(512, 38) == 3 and tail.min_blocks(1024, 200) == 1


@pytest.mark.parametrize("model", ["tiny-gemma3", "tiny-llama"])
def test_exclusive_policy_delays_no_parallel_branch(model, monkeypatch):
    """``exclusive``: a tail only where every other kernel reading the head (or its tails) comes after
    it. The qkv GEMV then keeps no tail (the v write and the q path read it beside the k path); gemma's
    down GEMV runs the residual norm (its head norms are inside RoPE: builder/row_reads.py)."""
    monkeypatch.setenv(tail.ENV_KERNEL_TAILS, "exclusive")
    prog, sources = _layer_kernels(model)
    tails = _tails(prog, sources)
    by_id = {o.id: o for o in prog.ops}
    assert not any(by_id[i].kind == "gemm" and "expr" in by_id[i].params for i in tails)
    after = tail._descendants(prog)
    for h, ts in tails.items():
        chain = {h} | {t.id for t in ts}
        for o in prog.kernels():
            if o.id not in chain and any(a.src in chain for a in o.args):
                assert all(o.id in after[t.id] for t in ts), (h, o.id)
    if model == "tiny-gemma3":
        assert sorted((by_id[h].kind, [t.kind for t in ts]) for h, ts in tails.items()) == [("gemm", ["elementwise"])]
    else:
        assert tails == {}


@pytest.mark.parametrize("model,policy,per_layer", [("gemma3-4b", "all", 6), ("gemma3-4b", "exclusive", 9),
                                                    ("llama3-1b", "all", 6), ("llama3-1b", "exclusive", 9)])
def test_real_decode_layers_launch_fewer_kernels(model, policy, per_layer, monkeypatch):
    """gemma3-4b: 11 kernel ops a layer in 6 launches (all) or 9 (exclusive); llama3-1b: 9 in 6 or 9 (its
    qkv GEMV's readers run beside each other). The attention combine stays a kernel (its rows need more
    than TAIL_MAX_BLOCKS blocks)."""
    monkeypatch.setenv(tail.ENV_KERNEL_TAILS, policy)
    from lum.builder.models.config import named_config
    from lum.builder.models.transformer import build_entry

    cgs = compile_graph(build_entry(named_config(model), "decode", 4096, DType.bf16))
    layer = max(cgs, key=lambda cg: len(cg.group))
    dv = program_dyn_vars([cg.program for cg in cgs])
    sources = group_kernel_sources(layer.program, dv, default_max_dyn(dv, 4096))
    assert len(sources) == per_layer
    by_id = {o.id: o for o in layer.program.ops}
    combine = [o for o in layer.program.ops if o.kind == "reduce" and by_id[o.args[0].src].kind == "attention"]
    assert combine and all(o.id in sources for o in combine)


def test_tails_off(monkeypatch):
    monkeypatch.setenv(tail.ENV_KERNEL_TAILS, "0")
    monkeypatch.setenv("LUM_SIBLING_KERNELS", "0")     # the default's other fusions of small kernels
    monkeypatch.setenv("LUM_ATTENTION_STAGE", "0")
    prog, sources = _layer_kernels("tiny-gemma3")
    assert len(sources) == len(prog.kernels()) and not any(ks.tails for ks in sources.values())


# ---------------------------------------------------------------------------- near misses, by hand
def _inp(i: int, n, name: str) -> LOp:
    return LOp(i, "input", "Input", (), (as_expr(n),), DType.f32, {"name": name, "role": "input"})


def _ew(i: int, op: str, srcs, n) -> LOp:
    shape = (as_expr(n),)
    return LOp(i, "elementwise", op, tuple(Arg(s, ShapeTracker.contiguous(shape)) for s in srcs), shape, DType.f32)


def _sum(i: int, src: int, n) -> LOp:
    return LOp(i, "reduce", "Sum", (Arg(src, ShapeTracker.contiguous((as_expr(1), as_expr(n)))),), (as_expr(1),),
               DType.f32, {"axis": 1})


def _program(body: list[LOp]) -> Program:
    outs = [LOp(len(body) + j, "output", "Output", (Arg(o.id, ShapeTracker.contiguous(o.shape)),), o.shape, o.dtype,
                {"name": f"y{j}", "role": "output"}) for j, o in enumerate(b for b in body if b.kind != "input")]
    return Program("t", body + outs)


def _fused(prog: Program, max_dyn=None) -> dict[int, tuple[int, ...]]:
    dv = sorted(prog.dyn_vars())
    return {i: ks.tails for i, ks in group_kernel_sources(prog, dv, max_dyn or {}).items()}


BIG = 1 << 16


def test_a_reader_of_the_head_becomes_its_tail(monkeypatch):
    prog = _program([_inp(0, BIG, "x"), _ew(1, "Exp2", [0], BIG), _sum(2, 1, BIG), _ew(3, "Sqrt", [2], 1)])
    assert _fused(prog) == {1: (2, 3)}          # the sum reads the head, the sqrt reads the sum
    monkeypatch.setenv(tail.ENV_KERNEL_TAILS, "exclusive")
    assert _fused(prog) == {1: (2, 3)}          # nothing else reads them
    # two readers of the head: "all" takes both; "exclusive" neither (each could run beside the other)
    prog = _program([_inp(0, BIG, "x"), _ew(1, "Exp2", [0], BIG), _sum(2, 1, BIG), _sum(3, 1, BIG)])
    assert _fused(prog) == {1: (), 2: (), 3: ()}
    monkeypatch.setenv(tail.ENV_KERNEL_TAILS, "all")
    assert _fused(prog) == {1: (2, 3)}


def test_near_misses_stay_kernels():
    # an op that reads neither the head nor its tails (a parallel branch may run it beside the head)
    prog = _program([_inp(0, BIG, "x"), _inp(1, 8, "y"), _ew(2, "Exp2", [0], BIG), _ew(3, "Exp2", [1], 8)])
    assert _fused(prog) == {2: (), 3: ()}
    # a reader of many blocks
    prog = _program([_inp(0, BIG, "x"), _ew(1, "Exp2", [0], BIG), _ew(2, "Sqrt", [1], BIG)])
    assert _fused(prog) == {1: (), 2: ()}
    # a reader whose grid follows a dyn var without a bound
    s = Var("s")
    prog = _program([_inp(0, BIG, "x"), _inp(1, s, "y"), _ew(2, "Exp2", [0], BIG),
                     LOp(3, "elementwise", "Add", (Arg(2, ShapeTracker((s,), (as_expr(0),), as_expr(0), None)),
                                                  Arg(1, ShapeTracker.contiguous((s,)))), (s,), DType.f32)])
    assert _fused(prog) == {2: (), 3: ()}
    assert _fused(prog, {"s": 64}) == {2: (3,)}        # bounded small: a tail
    # at most TAIL_MAX_OPS tails per head
    chain = [_inp(0, BIG, "x"), _ew(1, "Exp2", [0], BIG), _sum(2, 1, BIG)]
    chain += [_ew(3 + j, "Sqrt", [2 + j], 1) for j in range(tail.TAIL_MAX_OPS + 2)]
    got = _fused(_program(chain))
    assert got[1] == tuple(range(2, 2 + tail.TAIL_MAX_OPS)) and len(got) == 2


def test_a_library_call_between_breaks_the_chain():
    s = Var("s")
    k = 16
    ops = [_inp(0, BIG, "x"), LOp(1, "input", "Input", (), (s * k,), DType.f32, {"name": "a", "role": "input"}),
           _inp(2, k * k, "w"), _ew(3, "Exp2", [0], BIG)]
    params = {"layout": "RmCm", "m": s, "n": as_expr(k), "k": as_expr(k), "lda": as_expr(k), "ldb": as_expr(k),
              "ldc": as_expr(k), "batch": as_expr(1)}
    ops.append(LOp(4, "gemm", "Gemm", (Arg(1, ShapeTracker.contiguous((s * k,))),
                                       Arg(2, ShapeTracker.contiguous((as_expr(k * k),)))),
                   (as_expr(1), s, as_expr(k)), DType.f32, params))         # m = s: a cuBLASLt call
    ops.append(_sum(5, 3, BIG))
    assert _fused(_program(ops), {"s": 8}) == {3: (), 5: ()}


def test_fused_kernels_compile_with_nvrtc():
    pytest.importorskip("lum.builder.nvrtc")
    from lum.builder.kernels import compile_group_kernels

    prog, sources = _layer_kernels("tiny-gemma3")
    dv = program_dyn_vars([prog])
    gk = compile_group_kernels(prog, arch="sm_90", dyn_vars=dv, max_dyn=default_max_dyn(dv, 64), ptx=True)
    assert gk.table["version"] == TAIL_TABLE_VERSION and gk.cubin[:4] == b"\x7fELF"
    for entry in gk.table["ops"]:
        for t in entry.get("tail", ()):
            assert f"out@{t}" in entry["params"]
        assert f".entry {entry['launches'][0]['kernel']}(" in gk.ptx


def test_launch_table_names_the_tails_buffers():
    prog = _program([_inp(0, BIG, "x"), _ew(1, "Exp2", [0], BIG), _sum(2, 1, BIG), _ew(3, "Sqrt", [2], 1)])
    sources = group_kernel_sources(prog, [], {})
    t = launch_table(prog, sources, arch="sm_90", dyn_vars=[])
    assert t["version"] == TAIL_TABLE_VERSION and [o["op"] for o in t["ops"]] == [1]
    assert t["ops"][0]["tail"] == [2, 3]
    assert t["ops"][0]["params"] == ["out", "in0", "dyn", "out@2", "in0@2", "out@3", "in0@3"]
    assert [d["op"] for d in t["ops"][0]["tuning"]["tail"]] == [2, 3]
    # the head's body waits for the kernel before it, first thing: the table may be launched programmatically
    assert t["programmatic"] and "lum_pdl_wait();" not in sources[1].body.split('extern "C" __global__')[1]


# ---------------------------------------------------------------------------- format checks
@pytest.fixture(scope="module")
def tail_pkg(tmp_path_factory):
    pytest.importorskip("lum.builder.nvrtc")
    import lum.loader
    from lum.builder.models import load_spec
    from lum.builder.package_builder import build_package

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(tail.ENV_KERNEL_TAILS, "all")
        path = build_package(load_spec(random_name="tiny-llama", max_seq=32),
                             tmp_path_factory.mktemp("tp") / "t.lumpkg")
    pkg = lum.loader.open(path)
    yield pkg
    pkg.close()


def _layer_table(d: dict) -> dict:
    return next(g["kernels"] for g in d["groups"] if any("tail" in o for o in g["kernels"].get("ops", ())))


def _head_entry(t: dict) -> dict:
    return next(o for o in t["ops"] if "tail" in o)


@pytest.mark.parametrize("mutate,match", [
    (lambda t: t.update(version=1), "need table version 2"),
    (lambda t: _head_entry(t).update(tail=[]), "increasing"),
    (lambda t: _head_entry(t).update(tail=list(reversed(_head_entry(t)["tail"]))), "increasing"),
    (lambda t: _head_entry(t)["params"].remove(f"out@{_head_entry(t)['tail'][0]}"), "per tail op"),
    (lambda t: _head_entry(t)["params"].append("in9@1"), "per tail op"),
])
def test_manifest_checks_tails(tail_pkg, mutate, match):
    d = copy.deepcopy(tail_pkg.manifest.to_json())
    mutate(_layer_table(d))
    with pytest.raises(PackageFormatError, match=match):
        Manifest.from_json(d, set(tail_pkg.reader.names()))


def test_manifest_rejects_an_op_that_is_a_tail_and_a_kernel(tail_pkg):
    d = copy.deepcopy(tail_pkg.manifest.to_json())
    t = _layer_table(d)
    head = _head_entry(t)
    t["ops"].append({**copy.deepcopy(head), "op": head["tail"][0], "tail": [head["tail"][0] + 1000]})
    t["ops"].sort(key=lambda o: o["op"])
    with pytest.raises(PackageFormatError, match="tail"):
        Manifest.from_json(d, set(tail_pkg.reader.names()))


def test_loader_checks_tails_against_the_llir(tail_pkg, tmp_path):
    import lum.loader
    from tests.test_cuda_backend import _repacked

    def reopen(mutate, name):
        d = copy.deepcopy(tail_pkg.manifest.to_json())
        mutate(_layer_table(d))
        return lum.loader.open(_repacked(tail_pkg, d, tmp_path / name))

    def drop_last_tail(t):              # its op then has no kernel at all
        h = _head_entry(t)
        last = h["tail"].pop()
        h["params"] = [p for p in h["params"] if not p.endswith(f"@{last}")]

    with pytest.raises(PackageFormatError, match="has no kernel"):
        reopen(drop_last_tail, "dropped.lumpkg")

    def wrong_arity(t):                 # one buffer more for the first tail than its op has arguments
        h = _head_entry(t)
        first = h["tail"][0]
        ins = [p for p in h["params"] if p.startswith("in") and p.partition("@")[2] == str(first)]
        h["params"].insert(h["params"].index(ins[-1]) + 1, f"in{len(ins)}@{first}")

    with pytest.raises(PackageFormatError, match="wrong number of buffers"):
        reopen(wrong_arity, "arity.lumpkg")

    def skip_one(t):                    # name a later op as the first tail: the real one is left without a kernel
        h = _head_entry(t)
        first = h["tail"][0]
        h["tail"] = h["tail"][1:]
        h["params"] = [p for p in h["params"] if not p.endswith(f"@{first}")]

    with pytest.raises(PackageFormatError, match="right after its head"):
        reopen(skip_one, "skip.lumpkg")
    reopen(lambda t: None, "same.lumpkg").close()


@pytest.mark.parametrize("model,policy", [("tiny-llama", "all"), ("tiny-gemma3", "all"), ("tiny-gemma3", "exclusive")])
def test_tiny_models_with_tails_match_the_reference_on_the_emulated_driver(model, policy, tmp_path, monkeypatch):
    """Prefill and decode logits of a package built with tails, on the fake driver with lum's kernels
    compiled for the host (each fused kernel's blocks counted, its last block running the tails)."""
    pytest.importorskip("cuda.bindings.driver")
    from tests import cuda_emulation as emu

    if emu.CC is None or emu.CXX is None:
        pytest.skip("no host C/C++ compiler for the CUDA emulation")
    import lum.loader
    from lum.builder.models import load_spec
    from lum.builder.package_builder import build_package

    monkeypatch.setenv(tail.ENV_KERNEL_TAILS, policy)
    path = build_package(load_spec(random_name=model, max_seq=16), tmp_path / "m.lumpkg")
    with lum.loader.open(path) as p:
        assert any(k.tail for ref in p.manifest.groups if ref.table for k in ref.table.ops)
        sources = emu.package_kernel_sources(p)
    res = emu.run_emulated(f"""
import lum.loader as L
pkg = L.open({str(path)!r})
ids = np.asarray([3, 1, 4, 1, 5], np.int32)
ref = pkg.session(backend="reference")
want = [ref.run("prefill", {{"tokens": ids}}, {{"s": 5}})["logits"],
        ref.run("decode", {{"tokens": np.asarray([7], np.int32)}}, {{"p": 5}})["logits"]]
with pkg.session(backend="cuda") as sess:
    sess.runner.fill_arena(0xFF)                       # poisoned: NaN where a tail failed to write
    got = [sess.run("prefill", {{"tokens": ids}}, {{"s": 5}})["logits"],
           sess.run("decode", {{"tokens": np.asarray([7], np.int32)}}, {{"p": 5}})["logits"]]
print(json.dumps([float(np.max(np.abs(g.astype(np.float64) - w)) / np.max(np.abs(w))) for g, w in zip(got, want)]))
""", driver_dir=emu.fake_driver(tmp_path / "driver"), kernels=emu.kernel_library(sources, tmp_path / "kernels"),
        cublaslt=emu.fake_cublaslt(tmp_path / "lt"))
    assert all(np.isfinite(e) and e < 1e-5 for e in res), res     # relative to the largest logit
