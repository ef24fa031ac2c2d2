"""The whole CUDA backend on a host-emulated driver (tests/cuda_emulation.py): no GPU needed, but every
driver call, pointer, graph capture/replay and kernel launch of a session really happens, with lum's
own kernels compiled for the host and a host cuBLASLt. Checked against the numpy reference backend.

What this cannot check: the GPU's own behaviour (real asynchrony, the NVRTC cubins themselves, the
real cuBLASLt) — tests/test_gpu.py does, on the GPU.
"""

from __future__ import annotations

import itertools


import pytest

import lum.loader
from lum.format.dtypes import DType
from tests import cuda_emulation as emu
from tests.kernel_cases import (REPLAY_P, gemm_cases, gemv_cases, gemv_replay_cases, template_cases,
                                write_case_package)

if emu.CC is None or emu.CXX is None:
    pytest.skip("no host C/C++ compiler for the CUDA emulation", allow_module_level=True)
try:
    from lum.builder import nvrtc

    nvrtc.nvrtc_version()
except Exception as _exc:  # noqa: BLE001
    pytest.skip(f"NVRTC is not installed: {_exc}", allow_module_level=True)
try:
    import cuda.bindings.driver  # noqa: F401
except ImportError:
    pytest.skip("cuda-python is not installed", allow_module_level=True)

MODELS = ["tiny-llama", "tiny-qwen3", "tiny-gemma3"]
MAX_SEQ = 16
# prologue GEMV variants whose sums are the default's bit for bit: their build environment, their tuning flag
GEMV_VARIANTS = {"narrow-a": ({"LUM_GEMV_PROLOGUE_NARROW_A": "1"}, "narrow_a"),    # A kept as bf16 (bf16 only)
                 "unpaired": ({"LUM_GEMV_PROLOGUE_PAIRS": "0"}, "pairs")}          # one column a warp
FUSED = {"stage": {},     # kernel fusions: their build environment (none: the default)
         "siblings": {"LUM_ATTENTION_STAGE": "0"},
         "preload-shared": {"LUM_GEMV_PRELOAD_SHARED": "all"},
         "norms-ahead": {"LUM_NORMS_AHEAD": "1"},
         "row-multipass": {"LUM_ROW_ONLINE": "0"},
         "two-kernels": {"LUM_O_COMBINE": "0"},
         "o-grouped": {"LUM_O_COMBINE": "grouped"}}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Packages (kernel cases, tiny models), the fake driver, the emulated kernels, the fake cuBLASLt."""
    from lum.builder.models import load_spec
    from lum.builder.package_builder import build_package

    root = tmp_path_factory.mktemp("emulated")
    pkgs = {}
    for fn in (template_cases, gemm_cases, gemv_cases):
        for dt in (DType.f32, DType.bf16):
            prog, _, b = fn(dt)
            pkgs[f"{fn.__name__}.{dt.value}"] = write_case_package(root / f"{fn.__name__}.{dt.value}.lumpkg", prog, b)
    for (variant, var_env), dt in itertools.product(FUSED.items(), (DType.f32, DType.bf16)):
        if not var_env:
            pkgs[f"template_cases.{dt.value}.{variant}"] = pkgs[f"template_cases.{dt.value}"]
            continue
        prog, _, b = template_cases(dt)
        with pytest.MonkeyPatch.context() as mp:
            for k, v in var_env.items():
                mp.setenv(k, v)
            pkgs[f"template_cases.{dt.value}.{variant}"] = write_case_package(
                root / f"template_cases.{dt.value}.{variant}.lumpkg", prog, b)
    for (variant, (var_env, _)), dt in itertools.product(GEMV_VARIANTS.items(), (DType.f32, DType.bf16)):
        with pytest.MonkeyPatch.context() as mp:      # every prologue GEMV varied from the default
            for k, v in var_env.items():
                mp.setenv(k, v)
            prog, _, b = gemv_cases(dt)
            name = f"gemv_cases.{dt.value}.{variant}"
            pkgs[name] = write_case_package(root / f"{name}.lumpkg", prog, b)
    for dt in (DType.f32, DType.bf16):
        prog, _, b = gemv_replay_cases(dt)
        pkgs[f"gemv_replay.{dt.value}"] = write_case_package(root / f"gemv_replay.{dt.value}.lumpkg", prog, b, ("p",))
    for name in MODELS:
        pkgs[name] = build_package(load_spec(random_name=name, max_seq=MAX_SEQ), root / f"{name}.lumpkg")
        with pytest.MonkeyPatch.context() as mp:       # the off-by-default preload of every GEMV before its wait
            mp.setenv("LUM_GEMV_PRELOAD", "1")
            pkgs[name + ".early"] = build_package(load_spec(random_name=name, max_seq=MAX_SEQ),
                                                  root / f"{name}.early.lumpkg")
        for variant, var_env in FUSED.items():
            if not var_env:
                pkgs[f"{name}.{variant}"] = pkgs[name]
                continue
            with pytest.MonkeyPatch.context() as mp:
                for k, v in var_env.items():
                    mp.setenv(k, v)
                pkgs[f"{name}.{variant}"] = build_package(load_spec(random_name=name, max_seq=MAX_SEQ),
                                                          root / f"{name}.{variant}.lumpkg")
    lt_so = emu.fake_cublaslt(root / "lt")
    for tag, version in (("algos", None), ("algos-old", 1)):    # build-time gemm algos, timed on the fake
        pkgs[f"tiny-llama.{tag}"] = _build_with_fake_gemm_timing(root, tag, lt_so, version)
    sources = []
    for name, path in pkgs.items():
        with lum.loader.open(path) as p, pytest.MonkeyPatch.context() as mp:
            if name.endswith(".early"):
                mp.setenv("LUM_GEMV_PRELOAD", "1")
            for variant, (var_env, _) in GEMV_VARIANTS.items():
                if name.startswith("gemv_cases.") and name.endswith("." + variant):
                    for k, v in var_env.items():
                        mp.setenv(k, v)
            for variant, var_env in FUSED.items():
                if name.endswith("." + variant):
                    for k, v in var_env.items():
                        mp.setenv(k, v)
            sources += emu.package_kernel_sources(p)
    return {"pkgs": {k: str(v) for k, v in pkgs.items()}, "driver": emu.fake_driver(root / "driver"),
            "kernels": emu.kernel_library(sources, root / "kernels"), "cublaslt": lt_so}


def _build_with_fake_gemm_timing(root, tag: str, lt_so, version: int | None):
    """tiny-llama built as on a GPU (lum.builder.gemm_algos), with the fake cuBLASLt and a timer that
    prefers the fake's third candidate; ``version``: what the fake library claims at build time."""
    from lum.builder import gemm_algos
    from lum.builder.models import load_spec
    from lum.builder.package_builder import build_package
    from lum.loader.cublaslt import CublasLt

    def open_gpu():
        lt = CublasLt.load(str(lt_so))
        if version is not None:
            lt.version = lambda: version
        return lt, (lambda plan, p: 1.0 / plan.algo_bytes()[0]), {"gpu": "fake", "driver": "1"}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("lum.builder.tuning.gpu_unavailable_reason", lambda target=None: None)
        mp.setattr(gemm_algos, "_open_gpu", open_gpu)
        mp.setenv("LUM_CACHE_DIR", str(root / f"cache-{tag}"))
        return build_package(load_spec(random_name="tiny-llama", max_seq=MAX_SEQ), root / f"tiny-llama.{tag}.lumpkg")


def run(env, script: str, **extra_env: str):
    head = f"PKGS = {env['pkgs']!r}\nMAX_SEQ = {MAX_SEQ}\n"
    return emu.run_emulated(head + script, driver_dir=env["driver"], kernels=env["kernels"], cublaslt=env["cublaslt"],
                            env=extra_env)


def test_every_template_and_gemm_matches_reference(env):
    res = run(env, r'''
import lum.loader as L
from lum.format.dtypes import DType
from tests.kernel_cases import BOUNDS, DYN, compare, gemm_cases, gemv_cases, template_cases
errors, checked = {}, 0
for fn in (template_cases, gemm_cases, gemv_cases):
    for dt in (DType.f32, DType.bf16):
        pkg = L.open(PKGS[f"{fn.__name__}.{dt.value}"])
        prog, arrays, b = fn(dt)
        ref = pkg.session(dyn=BOUNDS, backend="reference"); ref.load_state(b.state_init)
        want = ref.run("main", arrays, DYN); want.update(ref.state)
        for graphs in (True, False):
            with pkg.session(dyn=BOUNDS, backend="cuda", graphs=graphs) as sess:
                sess.load_state(b.state_init)
                sess.runner.fill_arena(0xFF)
                got = sess.run("main", arrays, DYN); got.update(sess.state)
            for k in want:
                checked += 1
                err = compare(got[k], want[k], b.tol.get(k) or 1e-2)
                if err:
                    errors[f"{fn.__name__}.{dt.value}:{graphs}:{k}"] = err
print(json.dumps({"errors": errors, "checked": checked, "stats": fake_stats()}))
''')
    assert res["errors"] == {}
    assert res["checked"] >= 200
    assert res["stats"]["live"] == [0] * 7 and res["stats"]["bad_guards"] == 0   # close() freed everything


def test_gemv_graph_replays_as_p_grows(env):
    """The gpu test of the same name, emulated: gemms with n = p + 1 in one graph, replayed for a new p."""
    res = run(env, r'''
from lum.format.dtypes import DType
from tests.kernel_cases import check_gemv_replay
print(json.dumps({dt.value: check_gemv_replay(PKGS["gemv_replay." + dt.value], dt) for dt in (DType.f32, DType.bf16)}))
''')
    for dt, r in res.items():
        assert r["errors"] == {} and r["checked"] == len(REPLAY_P) * (12 if dt == "f32" else 24), (dt, r)
        assert r["graph_error"] is None and r["captures"][0] >= 1 and r["captures"][1] == r["captures"][0], (dt, r)
        assert not r["cublaslt"]                # no library gemm: cuBLASLt is not even loaded


@pytest.mark.parametrize("model", MODELS)
def test_tiny_model_generates_reference_tokens(env, model):
    res = run(env, r'''
import lum.loader as L
from tests.kernel_cases import compare
pkg = L.open(PKGS[MODEL])
prompt = [1, 5, 9, 3, 17]
ref = pkg.session(backend="reference")
want = ref.generate(prompt, 6)
out = {"want": want}
for mode in ({}, {"graphs": False}, {"debug_sync": True}, {"graph_branches": False}, {"programmatic_launch": False},
             {"steps_per_graph": 2}, {"steps_per_graph": 1}):
    with pkg.session(backend="cuda", **mode) as sess:
        out[str(mode)] = sess.generate(prompt, 6)
        out["chains" + str(mode)] = sorted((k[1], c.captures) for k, c in sess.runner._chains.items())
        out["captures" + str(mode)] = sess.runner.captures
        out["host" + str(mode)] = sess.generate(prompt, 6, device_loop=False)
        out["pipelined" + str(mode)] = sess._pipelined()
with pkg.session(backend="cuda") as sess:   # each step's next_token lands in the next step's input slot
    from lum.loader.cuda import driver as cu
    copies, dtod = [], cu.memcpy_dtod
    cu.memcpy_dtod = lambda *a: copies.append(a[2]) or dtod(*a)
    out["fed"] = [sess.generate(prompt, 6), len(copies)]
    cu.memcpy_dtod = dtod
# stopping at EOS: the device loop looks every EOS_CHECK steps and drops what came after the EOS
pkg.manifest.generation["eos_token_ids"] = [want[3]]
ref_eos = ref.generate(prompt, 10, stop_at_eos=True)
out["eos_want"] = [ref_eos, ref.position]
with pkg.session(backend="cuda") as sess:
    out["eos_device"] = [sess.generate(prompt, 10, stop_at_eos=True), sess.position]
    out["eos_host"] = [sess.generate(prompt, 10, stop_at_eos=True, device_loop=False), sess.position]
    out["eos_then_decode"] = [sess.generate(prompt, 10, stop_at_eos=True), sess.run("decode", {"tokens": np.asarray(
        [ref_eos[-1]], np.int32)}, {"p": sess.position})["next_token"].tolist()]
ref.generate(prompt, 10, stop_at_eos=True)
out["eos_then_decode_want"] = ref.run("decode", {"tokens": np.asarray([ref_eos[-1]], np.int32)},
                                      {"p": ref.position})["next_token"].tolist()
ids = np.asarray(prompt, np.int32)
ref.reset()
w = ref.run("prefill", {"tokens": ids}, {"s": 5})["logits"]
with pkg.session(backend="cuda") as sess:
    g = sess.run("prefill", {"tokens": ids}, {"s": 5})["logits"]
    sess.reset()
    dev = sess.run_device("prefill", {"tokens": ids}, {"s": 5})["logits"]
    cai = dev.__cuda_array_interface__
    out["cai"] = [list(cai["shape"]), cai["typestr"], cai["version"], cai["data"][0] == dev.ptr,
                  cai["stream"] == sess.runner.stream.ptr]
    out["dlpack_device"] = list(dev.__dlpack_device__())
    try:                                  # a device input of the wrong dtype / shape is refused in one line
        sess.run_device("decode", {"tokens": dev}, {"p": 5})
    except L.SessionError as exc:
        out["bad_device_input"] = str(exc)
    cap = dev.__dlpack__()
    out["dev_equal"] = bool((dev.numpy() == g).all())
    out["reason"] = sess.backend_reason
    out["upload"] = [sess.runner.upload.bytes, sess.runner.upload.method, sess.upload_gbps > 0]
out["logits_err"] = compare(g, w, 1e-5)
out["stats"] = fake_stats()
print(json.dumps(out))
'''.replace("PKGS[MODEL]", f"PKGS[{model!r}]"))
    assert res["{}"] == res["{'graphs': False}"] == res["{'debug_sync': True}"] == res["want"]
    assert res["{'graph_branches': False}"] == res["{'programmatic_launch': False}"] == res["want"]
    # two steps a graph: prefill, two chains of two, one step alone; a chain's graph replays (same key)
    assert res["{'steps_per_graph': 2}"] == res["{'steps_per_graph': 1}"] == res["want"]
    assert res["chains{'steps_per_graph': 2}"] == [[2, 1]] and res["chains{'steps_per_graph': 1}"] == []
    assert res["chains{}"] == []                          # 6 tokens: fewer than a chain of 8 and one more
    # the device loop (next_token fed back on the device) and the host loop give the same tokens
    assert all(res[k] for k in res if k.startswith("pipelined"))
    assert all(res[k] == res["want"] for k in res if k.startswith("host"))
    want = res["want"]
    assert res["fed"] == [want, 1]      # prefill's token copied into decode's slot; decode's need no copy
    assert res["eos_want"][0] == want[:want.index(want[3]) + 1]            # up to the first EOS, included
    assert res["eos_device"] == res["eos_host"] == res["eos_want"]
    # the KV cache past the EOS holds the dropped steps' rows; the next decode at the session's position
    # overwrites them and sees what the reference sees
    assert res["eos_then_decode"][1] == res["eos_then_decode_want"]
    assert res["captures{'graphs': False}"] == res["captures{'debug_sync': True}"] == 0 < res["captures{}"]
    assert res["logits_err"] is None
    assert res["cai"] == [[5, 256], "<f4", 3, True, True] and res["dlpack_device"] == [2, 0]
    assert res["dev_equal"] and "matches the package target sm_90" in res["reason"]
    assert "device input 'tokens' is f32 (5, 256)" in res["bad_device_input"]
    assert res["upload"][0] > 0 and res["upload"][1] == "staged" and res["upload"][2]
    assert res["stats"]["bad_guards"] == 0
    # no side streams here: the default packages' independent small kernels in a row are one sibling
    # launch, and the ops only the outputs read come last (builder/rewrite.py outputs_last)
    assert res["stats"]["joins"] == 0
    # programmatic launch (the default): the kernels of the (programmatic) tables went through cuLaunchKernelEx
    assert res["stats"]["programmatic_launches"] > 0


@pytest.mark.parametrize("model", MODELS)
def test_reads_before_the_wait_change_no_token(env, model):
    """Built with every GEMV preloading weights before it waits for the kernel before it
    (``LUM_GEMV_PRELOAD``): the tables name those reads
    (``early``), the runner launches those kernels programmatically (their early buffers are weights), and
    the tokens are the reference backend's, launched both ways."""
    res = run(env, r'''
import lum.loader as L
pkg = L.open(PKGS[MODEL + ".early"])
ops = [op for g in pkg.manifest.groups if g.table is not None for op in g.table.ops]
out = {"early_kinds": sorted({op.kind for op in ops if op.early})}
prompt = [1, 5, 9, 3, 17]
out["want"] = pkg.session(backend="reference").generate(prompt, 6)
for on in (True, False):
    with pkg.session(backend="cuda", programmatic_launch=on) as sess:
        out[str(on)] = sess.generate(prompt, 6)
        out["steps" + str(on)] = sum(getattr(st, "programmatic", False) for st in sess.runner.plans["decode"].steps)
print(json.dumps(out))
'''.replace("MODEL", repr(model)))
    assert res["early_kinds"] == ["gemm", "reduce"], res["early_kinds"]   # the GEMVs, the combine inside o
    assert res["True"] == res["False"] == res["want"]
    assert res["stepsTrue"] > 0 == res["stepsFalse"]


BIT_EQUAL = ("preload-shared",)   # the default's arithmetic


def test_variants_that_reorder_no_arithmetic_are_bit_equal(env):
    """The variants that change only how the work is scheduled (every GEMV's first weights preloaded into shared
    memory, summed in the same order) give every kernel case's outputs bit for bit as the default package
    does."""
    res = run(env, r'''
import numpy as np
import lum.loader as L
from lum.format.dtypes import DType
from tests.kernel_cases import BOUNDS, DYN, template_cases
out = {}
for dt in (DType.f32, DType.bf16):
    prog, arrays, b = template_cases(dt)
    got = {}
    for v in ("stage",) + tuple(BITEQ):
        with L.open(PKGS[f"template_cases.{dt.value}.{v}"]).session(dyn=BOUNDS, backend="cuda") as sess:
            sess.load_state(b.state_init)
            r = sess.run("main", arrays, DYN); r.update(sess.state)
            got[v] = {k: np.asarray(x).tobytes() for k, x in r.items()}
    for v in BITEQ:
        out[f"{dt.value}.{v}"] = [k for k in got["stage"] if got[v][k] != got["stage"][k]]
print(json.dumps(out))
'''.replace("BITEQ", repr(BIT_EQUAL)))
    assert len(res) == 2 * len(BIT_EQUAL) and all(not diff for diff in res.values()), res


@pytest.mark.parametrize("variant,dtype", [("narrow-a", "bf16"), ("unpaired", "f32"), ("unpaired", "bf16")])
def test_prologue_gemv_variants_are_bit_equal(env, variant, dtype):
    """Variants of the gemv cases' prologue GEMVs whose sums are the default's in the same order, so every case's
    output is the default package's bit for bit (the flag counted over both packages: one of them varies):
    ``narrow-a`` (``LUM_GEMV_PROLOGUE_NARROW_A=1``: A kept as bf16 in shared memory, the values the default
    rounds and stores as floats) and ``unpaired`` (``LUM_GEMV_PROLOGUE_PAIRS=0``: one column a warp, where the
    default has each warp compute columns j and j + n/2 in blocks of half the threads)."""
    flag = GEMV_VARIANTS[variant][1]
    res = run(env, r'''
import numpy as np
import lum.loader as L
from tests.kernel_cases import BOUNDS, DYN, gemv_cases
from lum.format.dtypes import DType
prog, arrays, b = gemv_cases(DType("@DT@"))
got, flagged = {}, 0
for v in ("gemv_cases.@DT@", "gemv_cases.@DT@.@VARIANT@"):
    pkg = L.open(PKGS[v])
    flagged += sum(bool(op.tuning.get("@FLAG@")) for g in pkg.manifest.groups if g.table is not None
                   for op in g.table.ops)
    with pkg.session(dyn=BOUNDS, backend="cuda") as sess:
        sess.load_state(b.state_init)
        sess.runner.fill_arena(0xFF)
        got[v] = {k: np.asarray(x).tobytes() for k, x in sess.run("main", arrays, DYN).items()}
plain, varied = got["gemv_cases.@DT@"], got["gemv_cases.@DT@.@VARIANT@"]
print(json.dumps({"flagged": flagged, "outputs": len(plain), "diff": [k for k in plain if plain[k] != varied[k]]}))
'''.replace("@DT@", dtype).replace("@VARIANT@", variant).replace("@FLAG@", flag))
    assert res["flagged"] > 0 and res["outputs"] > 0 and res["diff"] == [], res


@pytest.mark.parametrize("variant", list(FUSED))
def test_fused_kernel_variants_match_reference(env, variant):
    """Built with a kernel fusion: ``stage`` (the default package: the tiny models' decode attention computes its q
    rows and kv-cache writes, builder/attention_stage.py; the kernel cases' independent kernels in a row run as
    one launch each), ``siblings``
    (``LUM_ATTENTION_STAGE=0``: the q / k / v ops before attention are one sibling launch), ``preload-shared``
    (``LUM_GEMV_PRELOAD_SHARED=all``: every GEMV copies its lanes' first weights into shared memory before it
    waits, where by default only those behind small kernels do: builder/gemv_policy.py gemv_preload_shared),
    ``norms-ahead`` (``LUM_NORMS_AHEAD=1``: every tiny model's decode layer ends with the next layer's input norm,
    as only Gemma's does by default, so its qkv is a plain GEMV; the kernel cases are unchanged) or
    ``row-multipass`` (``LUM_ROW_ONLINE=0``: decode attention's combine, and the ``row.combine`` case, visit their
    rows once per row reduction, not once with a running maximum: builder/row_codegen.py) or ``two-kernels``
    (``LUM_O_COMBINE=0``: decode attention's combine and o as two kernels, where by default they are one, o split
    by head in a thread block cluster: builder/o_combine.py) or ``o-grouped`` (``LUM_O_COMBINE=grouped``: that kernel
    also where the heads are more than a cluster's blocks, the ``o.combine.grouped`` case's 12 heads two a block).
    Every
    kernel case matches the reference backend, run three times in one session, with and without graphs; the tiny
    models' greedy tokens are the reference backend's, and their decode layers hold such a kernel."""
    res = run(env, r'''
import lum.loader as L
from lum.format.dtypes import DType
from tests.kernel_cases import BOUNDS, DYN, compare, template_cases
out = {"errors": {}, "checked": 0, "fused": {}, "tails": {}, "shared_preloads": 0,
       "shared_preloads_default": 0, "prologues": {}, "o_combines": {}}
def tuned(pkg, key="preload_shared"):    # the package's kernels whose tuning sets ``key``
    return sum(bool(op.tuning.get(key)) for g in pkg.manifest.groups if g.table is not None
               for op in g.table.ops)
for dt in (DType.f32, DType.bf16):
    pkg = L.open(PKGS[f"template_cases.{dt.value}.VARIANT"])
    out["shared_preloads"] += tuned(pkg)
    out["shared_preloads_default"] += tuned(L.open(PKGS[f"template_cases.{dt.value}"]))
    out["o_combines"][dt.value] = tuned(pkg, "o_combine")
    out["fused"][dt.value] = [[op.kind, len(op.tail)] for g in pkg.manifest.groups if g.table is not None
                              for op in g.table.ops if op.tail]
    prog, arrays, b = template_cases(dt)
    ref = pkg.session(dyn=BOUNDS, backend="reference"); ref.load_state(b.state_init)
    want = ref.run("main", arrays, DYN); want.update(ref.state)
    for graphs in (True, False):
        with pkg.session(dyn=BOUNDS, backend="cuda", graphs=graphs) as sess:
            for rep in range(3):
                sess.load_state(b.state_init)
                sess.runner.fill_arena(0xFF)
                got = sess.run("main", arrays, DYN); got.update(sess.state)
                for k in want:
                    out["checked"] += 1
                    err = compare(got[k], want[k], b.tol.get(k) or 1e-2)
                    if err:
                        out["errors"][f"{dt.value}.{k}.{graphs}.{rep}"] = err
prompt = [1, 5, 9, 3, 17]
for name in MODELS:
    pkg = L.open(PKGS[name + ".VARIANT"])
    out["fused"][name] = sorted({op.kind for g in pkg.manifest.groups if g.table is not None for op in g.table.ops
                                 if op.tail})
    out["shared_preloads"] += tuned(pkg)
    out["shared_preloads_default"] += tuned(L.open(PKGS[name]))
    out["prologues"][name] = [tuned(pkg, "prologue"), tuned(L.open(PKGS[name]), "prologue")]
    out["o_combines"][name] = tuned(pkg, "o_combine")
    out["tails"][name] = sorted({len(op.tail) for g in pkg.manifest.groups if g.table is not None
                                 for op in g.table.ops if op.kind == "scatter_nocopy" and op.tail})
    with pkg.session(backend="cuda") as sess:
        out[name] = sess.generate(prompt, 8)
    out[name + ".want"] = pkg.session(backend="reference").generate(prompt, 8)
print(json.dumps(out))
'''.replace("MODELS", repr(MODELS)).replace("VARIANT", variant))
    assert res["checked"] > 0 and not res["errors"], res["errors"]
    for dt in ("f32", "bf16"):
        fused = res["fused"][dt]       # many runs of independent kernels, of several kinds
        assert len(fused) >= 5 and len({k for k, _ in fused}) >= 3, fused
    # the combine and o as one kernel (the o.combine case's, one a decode layer's) but in the two-kernels variant
    assert all((n > 0) == (variant != "two-kernels") for n in res["o_combines"].values()), res["o_combines"]
    if variant == "o-grouped":         # the o.combine.grouped case fuses too: two such kernels a dtype
        assert res["o_combines"]["f32"] == res["o_combines"]["bf16"] == 2, res["o_combines"]
    # the default preloads some GEMVs into shared memory (those behind small kernels); ``all`` every one
    assert res["shared_preloads_default"] > 0, res
    if variant == "preload-shared":
        assert res["shared_preloads"] > res["shared_preloads_default"], res
    if variant == "norms-ahead":       # the qkv's input norm gone from llama's and qwen3's decode, as from gemma's
        assert {n: v < d for n, (v, d) in res["prologues"].items()} == {
            "tiny-llama": True, "tiny-qwen3": True, "tiny-gemma3": False}, res["prologues"]
    for name in MODELS:
        want = ["scatter_nocopy"]      # the k / v / q stage after qkv
        assert [k for k in res["fused"][name] if k in want] == want, res["fused"]
        if variant == "siblings":      # q, k and v: one sibling kernel
            assert 2 in res["tails"][name] and 3 not in res["tails"][name], res["tails"]
        else:                          # q, k, v and the attention: one kernel
            assert 3 in res["tails"][name], res["tails"]
        assert res[name] == res[name + ".want"], name


def test_decode_loop_replays_graphs_with_flat_memory(env):
    res = run(env, r'''
import lum.loader as L
from lum.loader.cuda import driver as cu
pkg = L.open(PKGS["tiny-llama"])
sess = pkg.session(backend="cuda")
r = sess.runner
sess.run("prefill", {"tokens": np.asarray([1, 2, 3], np.int32)}, {"s": 3})
p, tok, marks = 3, 1, []
for step in range(4 * MAX_SEQ):
    if p == MAX_SEQ:
        sess.reset(); p = 0
    logits = sess.run("decode", {"tokens": np.asarray([tok], np.int32)}, {"p": p})["logits"]
    tok = int(np.argmax(logits[-1])) % 200
    p += 1
    if step in (2 * MAX_SEQ, 4 * MAX_SEQ - 1):
        marks.append([cu.mem_info()[0], r.captures, fake_stats()["live"]])
n_graphs = sum(len(c) for c in r._graphs.values())
segments = {e: len(p.segments) for e, p in r.plans.items()}
sess.close()
print(json.dumps({"marks": marks, "graphs": n_graphs, "segments": segments, "after_close": fake_stats()["live"],
                  "finite": bool(np.isfinite(logits).all())}))
''')
    (free0, cap0, live0), (free1, cap1, live1) = res["marks"]
    assert free0 == free1 and cap0 == cap1 and live0 == live1, res
    assert res["finite"] and res["after_close"] == [0] * 7
    assert res["segments"]["decode"] == 1   # one graph: decode's gemms (n = p + 1 too) are kernels


def test_tuning_replay_reuses_the_runners_graph(env):
    """The measured search times a candidate by replaying its entry (lum.builder.tuning._replay) through the
    runner's plan: it must keep up with that API (a removed Segment field once made every candidate fail,
    which only the GPU showed)."""
    res = run(env, r'''
import lum.loader as L
from lum.builder import tuning as T
pkg = L.open(PKGS["tiny-llama"])
sess = pkg.session(backend="cuda")
sess.run("prefill", {"tokens": np.asarray([1, 2, 3], np.int32)}, {"s": 3})
sess.run("decode", {"tokens": np.asarray([5], np.int32)}, {"p": 3})
before = [sess.runner.captures, fake_stats()["graph_launches"]]
T._replay(sess.runner, "decode", {"p": 3})
sess.runner.stream.synchronize()
after = [sess.runner.captures, fake_stats()["graph_launches"]]
sess.close()
print(json.dumps({"before": before, "after": after}))
''')
    assert res["after"] == [res["before"][0], res["before"][1] + 1], res   # the captured graph, launched once


def test_two_sessions_with_different_bounds(env):
    res = run(env, r'''
import lum.loader as L
from tests.kernel_cases import compare
pkg = L.open(PKGS["tiny-qwen3"])
small = pkg.session(dyn={"s": 6, "p": 9}, backend="cuda")
big = pkg.session(backend="cuda")
ref = pkg.session(backend="reference")
errs = []
for s in (3, 6):
    ids = (np.arange(1, s + 1, dtype=np.int32) * 7) % 200
    outs = []
    for sess in (small, big, ref):
        sess.reset()
        outs.append(sess.run("prefill", {"tokens": ids}, {"s": s})["logits"])
    for p in range(s, s + 3):
        for sess in (small, big, ref):
            outs.append(sess.run("decode", {"tokens": np.asarray([p], np.int32)}, {"p": p})["logits"])
    for k in range(0, len(outs), 3):
        errs += [compare(outs[k], outs[k + 2], 1e-5), compare(outs[k + 1], outs[k + 2], 1e-5)]
try:
    small.run("prefill", {"tokens": np.ones(8, np.int32)}, {"s": 8}); refused = None
except L.SessionError as e:
    refused = str(e)
print(json.dumps({"errs": [e for e in errs if e], "refused": refused,
                  "arenas": [small.runner.arena.nbytes, big.runner.arena.nbytes]}))
''')
    assert res["errs"] == [] and "bound" in res["refused"]
    assert res["arenas"][0] < res["arenas"][1]


def test_target_and_driver_checks(env):
    script = r'''
import lum.loader as L
from lum.format.errors import IncompatibleTargetError
pkg = L.open(PKGS["tiny-llama"])
out = {}
try:
    s = pkg.session(backend="cuda"); out["cuda"] = [s.backend, s.runner.use_ptx, s.backend_reason]; s.close()
except (IncompatibleTargetError, L.BackendUnavailableError) as e:
    out["cuda"] = ["error", type(e).__name__, str(e)]
s = pkg.session(backend="auto"); out["auto"] = [s.backend, s.backend_reason]
if s.backend == "cuda":
    out["tokens"] = s.generate([1, 2, 3], 3) == pkg.session(backend="reference").generate([1, 2, 3], 3)
s.close()
print(json.dumps(out))
'''
    older = run(env, script, LUM_FAKE_CUDA_CC="80")
    assert older["cuda"][:2] == ["error", "IncompatibleTargetError"] and "older" in older["cuda"][2]
    assert older["auto"][0] == "reference" and "older" in older["auto"][1]
    newer = run(env, script, LUM_FAKE_CUDA_CC="100")
    assert newer["cuda"][:2] == ["cuda", True] and "JIT" in newer["cuda"][2]
    assert newer["auto"][0] == "reference" and "rebuild" in newer["auto"][1]
    old_driver = run(env, script, LUM_FAKE_CUDA_DRIVER="12080")
    assert old_driver["cuda"][1] == "IncompatibleTargetError" and "CUDA 13 driver" in old_driver["cuda"][2]
    same = run(env, script)
    assert same["auto"][0] == "cuda" and same["tokens"] is True


def test_a_setup_that_fails_early_reports_its_own_error(env):
    """A session whose setup fails before it has made its stream (here cuBLASLt fails to load) raises that
    failure, not an error of the cleanup that follows it."""
    res = run(env, r'''
import lum.loader as L
try:
    L.open(PKGS["tiny-llama"]).session(backend="cuda")
    out = {"error": None}
except Exception as exc:
    out = {"error": type(exc).__name__, "message": str(exc)}
print(json.dumps(out))
''', LUM_FAKE_CUBLASLT="/nonexistent/libcublasLt.so")
    assert res["error"] is not None and "stream" not in res["message"] and res["error"] != "AttributeError", res
    assert "nonexistent" in res["message"], res


def test_upload_paths(env):
    script = r'''
import lum.loader as L
pkg = L.open(PKGS["tiny-gemma3"])
ids = np.asarray([1, 2, 3], np.int32)
want = pkg.session(backend="reference").run("prefill", {"tokens": ids}, {"s": 3})["logits"]
with pkg.session(backend="cuda", upload_method="register") as s:
    got = s.run("prefill", {"tokens": ids}, {"s": 3})["logits"]
    same = bool(np.abs(got - want).max() <= 1e-5 * np.abs(want).max())
    print(json.dumps({"method": s.runner.upload.method, "same": same}))
'''
    assert run(env, script) == {"method": "register", "same": True}
    res = run(env, script, LUM_FAKE_CUDA_NO_REGISTER="1")
    assert res["same"] and res["method"].startswith("staged (register failed: CUDA_ERROR_NOT_SUPPORTED")


def test_a_refused_capture_falls_back_to_eager_steps(env):
    """Where no graph can be captured (a library that refuses stream capture; here the fake driver's
    LUM_FAKE_CUDA_NO_CAPTURE), generate's step chain gives up without running anything and the steps run
    eagerly, a step at a time, with the runner's one warning: the tokens are the reference's."""
    res = run(env, r'''
import warnings
import lum.loader as L
pkg = L.open(PKGS["tiny-llama"])
prompt = [1, 5, 9, 3, 17]
want = pkg.session(backend="reference").generate(prompt, 10)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with pkg.session(backend="cuda") as sess:
        got = sess.generate(prompt, 10)
        errors = [c.error for c in sess.runner._chains.values()]
        graphs = sess.runner.graphs
print(json.dumps({"same": got == want, "errors": errors, "graphs": graphs,
                  "warned": sum("capture failed" in str(w.message) for w in caught)}))
''', LUM_FAKE_CUDA_NO_CAPTURE="1")
    assert res["same"] and res["graphs"] is False and res["warned"] == 1
    assert len(res["errors"]) == 1 and res["errors"][0]


def test_staged_upload_of_large_pieces_is_exact(env, tmp_path):
    """Pieces larger than the staging chunk, split across threads, read from a file and from memory."""
    blob = tmp_path / "blob.bin"
    data = __import__("numpy").random.default_rng(0).integers(0, 256, 45 << 20, dtype="uint8")
    blob.write_bytes(data.tobytes())
    res = run(env, rf'''
from lum.loader.cuda import driver as cu
from lum.loader.cuda.upload import HostBytes, upload_staged
ctx = cu.Context(0); stream = cu.Stream()
data = np.fromfile({str(blob)!r}, dtype=np.uint8)
dev = cu.DeviceBuffer(data.size + 4096)
pieces = [(HostBytes(data[:30 << 20], {str(blob)!r}, 0), dev.ptr),                  # from the file
          (data[30 << 20:], dev.ptr + (30 << 20) + 4096),                          # from memory
          (HostBytes(data[5:1000], {str(blob)!r}, 5), dev.ptr + (30 << 20))]       # small, unaligned
st = upload_staged(pieces, stream, chunk=16 << 20, threads=3)
back = np.empty(data.size + 4096, np.uint8)
cu.call(cu.drv.cuMemcpyDtoH, back.ctypes.data, dev.ptr, back.size)
ok = bool((back[:30 << 20] == data[:30 << 20]).all() and (back[(30 << 20) + 4096:] == data[30 << 20:]).all()
          and (back[30 << 20:(30 << 20) + 995] == data[5:1000]).all())
dev.close(); stream.close(); ctx.close()
print(json.dumps({{"ok": ok, "bytes": st.bytes, "live": fake_stats()["live"]}}))
''')
    assert res == {"ok": True, "bytes": (45 << 20) + 995, "live": [0] * 7}


def test_stored_gemm_algos_are_used_only_for_the_same_cublaslt_version(env):
    res = run(env, r'''
import lum.loader as L
prompt = [1, 5, 9, 3, 17]
out = {}
for tag in ("algos", "algos-old"):
    pkg = L.open(PKGS["tiny-llama." + tag])
    m = pkg.manifest
    gemms = [g for ref in m.groups if ref.table is not None for g in ref.table.gemms]
    n_gemm = sum(1 for ref, p in zip(m.groups, pkg.programs) for o in p.ops   # cuBLASLt calls (no kernel)
                 if o.kind == "gemm" and o.id not in ref.table.by_op())
    want = pkg.session(backend="reference").generate(prompt, 6)
    with pkg.session(backend="cuda") as sess:
        got = sess.generate(prompt, 6)
        out[tag] = {"version": m.target.get("cublaslt_version"), "gemms": len(gemms), "n_gemm": n_gemm,
                    "first_bytes": sorted({g.algo[0] for g in gemms}), "equal": got == want,
                    "counts": dict(sess.runner.gemm_algo_counts)}
print(json.dumps(out))
''')
    cur, old = res["algos"], res["algos-old"]
    assert cur["version"] == 130099 and old["version"] == 1
    assert cur["gemms"] == cur["n_gemm"] == old["gemms"] > 0 and cur["first_bytes"] == [3]
    assert cur["equal"] and old["equal"]
    assert cur["counts"]["stored"] > 0 and cur["counts"]["heuristic"] == 0
    assert old["counts"]["stored"] == 0 and old["counts"]["heuristic"] > 0
