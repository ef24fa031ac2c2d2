"""Persistent kernels (builder/persistent.py, templates/persistent.cu): a decoder layer's kernels as one launch
whose GEMVs load their weights into registers (``reg``; ``reg-shared``: their first into shared memory). What
they are at real shapes (CPU, NVRTC) and that the tiny models built with them generate the reference
backend's tokens on the emulated driver."""

from __future__ import annotations

import pytest

import lum.loader
from lum.format.dtypes import DType
from tests import cuda_emulation as emu

MODELS = ["tiny-llama", "tiny-qwen3", "tiny-gemma3"]
MODES = ["reg", "reg-shared"]
MAX_SEQ = 16


def _layer_group(model: str):
    from lum.builder.compile import compile_graph
    from lum.builder.kernels import program_dyn_vars
    from lum.builder.models.config import named_config
    from lum.builder.models.transformer import build_entry

    cgs = compile_graph(build_entry(named_config(model), "decode", 512, DType.bf16))
    return cgs, program_dyn_vars([cg.program for cg in cgs])


@pytest.mark.parametrize("model,mode,blocks", [("gemma3-4b", "reg", 4), ("llama3-1b", "reg", 4),
                                               ("gemma3-4b", "reg-shared", 4), ("llama3-1b", "reg-shared", 4)])
def test_a_register_fed_layer_is_one_persistent_kernel(model, mode, blocks, monkeypatch):
    """``LUM_PERSISTENT=reg``: the layer's kernel ops in one persistent kernel (its dynamic shared
    memory the item header), as many blocks an SM as fit and spill at most REG_MAX_SPILL bytes a thread (4 on
    both models at 64 registers), every GEMV item preloading REG_PRELOAD vectors a lane into registers; each
    item's body waits where its kernel did (lum_item_wait), the first item's for the previous launch (every
    block, even one with none of its grid); every weight its items read before a wait is named early.
    ``reg-shared``: the GEMVs preload up to REG_SHARED_PRELOAD vectors a lane into shared memory after the
    header (lum_item_smem; gemma3-4b's gate-up 32 KB a block: four blocks an SM beside its static shared memory).
    The LM head's group, one GEMV, keeps its kernels. ``LUM_PERSISTENT_BLOCKS=2`` asks for two blocks an SM,
    and a count out of range is an error."""
    from lum.builder import nvrtc
    from lum.builder.kernels import group_kernel_sources, launch_table
    from lum.builder.persistent import ITEM_HEADER, REG_MAX_SPILL, REG_PRELOAD, REG_SHARED_PRELOAD, persistent_blocks

    monkeypatch.setenv("LUM_PERSISTENT", mode)
    cgs, dv = _layer_group(model)
    prog = cgs[1].program
    weights = frozenset(o.id for o in prog.ops if o.kind == "input")
    gen = group_kernel_sources(prog, dv, {"p": 512}, {}, weights=weights)
    (ks,) = gen.values()
    work = [o.id for o in prog.ops if o.kind not in ("input", "constant", "output")]
    assert [next(iter(gen))] + list(ks.tails) == work          # every op of the layer, in program order
    assert ks.tuning["blocks_per_sm"] == blocks and ks.launches[0].grid == (blocks * 132, 1, 1)
    assert f"__launch_bounds__(256, {blocks})" in ks.body and ks.tuning["persistent_mode"] == mode
    items = ks.tuning["persistent"]
    gemvs = [t for t in items if t.get("scheme") == "dot"]
    assert len(gemvs) == sum(o.kind == "gemm" for o in prog.ops) >= 3
    if mode == "reg":
        assert ks.launches[0].shared_mem == ITEM_HEADER
        assert all(t["preload"] == REG_PRELOAD and not t.get("preload_shared") for t in gemvs)
    else:
        assert ITEM_HEADER < ks.launches[0].shared_mem <= ITEM_HEADER + REG_SHARED_PRELOAD * 16 * 256 * 2  # ≤ 2 segments
        assert all(1 <= t["preload"] <= REG_SHARED_PRELOAD and t["preload_shared"] for t in gemvs)
    assert "extern __shared__ lum_vec" not in ks.body      # every GEMV's preload buffer after the item header
    assert ks.body.count("lum_item_wait()") == len(items)
    assert ks.body.count("gridDim.x, lum_vb == blockIdx.x);") == 1             # the first item: the launch's wait
    assert "if (blockIdx.x >= lum_g) (lum_pdl_wait)();" in ks.body
    assert len(ks.early) >= len(gemvs) and not set(ks.early) & {"out", "dyn"}
    table = launch_table(prog, gen, arch="sm_90", dyn_vars=dv, max_dyn={"p": 512})
    assert table["programmatic"]
    log = nvrtc.compile_cuda(ks.source, "sm_90", ptx=False, extra_options=["--ptxas-options=-v"],
                             cache_dir=False).log
    assert nvrtc.ptxas_registers(log)[ks.name] <= 65536 // (256 * blocks)
    assert all(v <= REG_MAX_SPILL for v in nvrtc.ptxas_spills(log).values()), log
    head = cgs[-1].program            # the LM head's group: one GEMV, so its kernels stay
    assert not any(k.tuning.get("persistent") for k in group_kernel_sources(
        head, dv, {"p": 512}, {}, weights=frozenset(o.id for o in head.ops if o.kind == "input")).values())
    monkeypatch.setenv("LUM_PERSISTENT_BLOCKS", "2")
    (two,) = group_kernel_sources(prog, dv, {"p": 512}, {}, weights=weights).values()
    assert two.tuning["blocks_per_sm"] == 2 and two.launches[0].grid == (264, 1, 1)
    monkeypatch.setenv("LUM_PERSISTENT_BLOCKS", "9")
    with pytest.raises(ValueError, match="LUM_PERSISTENT_BLOCKS"):
        persistent_blocks()


def test_off_by_default():
    """Without ``LUM_PERSISTENT`` the layer keeps its kernels, and a mode it does not know is an error."""
    from lum.builder.kernels import group_kernel_sources
    from lum.builder.persistent import persistent_mode

    cgs, dv = _layer_group("gemma3-4b")
    prog = cgs[1].program
    gen = group_kernel_sources(prog, dv, {"p": 512}, {}, weights=frozenset(o.id for o in prog.ops
                                                                             if o.kind == "input"))
    assert len(gen) > 1 and not any(ks.tuning.get("persistent") for ks in gen.values())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LUM_PERSISTENT", "1")
        with pytest.raises(ValueError, match="LUM_PERSISTENT"):
            persistent_mode()


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    if emu.CC is None or emu.CXX is None:
        pytest.skip("no host C/C++ compiler for the CUDA emulation")
    pytest.importorskip("cuda.bindings.driver")
    from lum.builder.models import load_spec
    from lum.builder.package_builder import build_package

    root = tmp_path_factory.mktemp("persistent")
    pkgs, sources = {}, []
    for mode in MODES:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LUM_PERSISTENT", mode)
            for name in MODELS:
                path = root / f"{name}.{mode}.lumpkg"
                pkgs[f"{name}.{mode}"] = str(build_package(load_spec(random_name=name, max_seq=MAX_SEQ), path))
                with lum.loader.open(path) as p:
                    sources += emu.package_kernel_sources(p)
    return {"pkgs": pkgs, "driver": emu.fake_driver(root / "driver"),
            "kernels": emu.kernel_library(sources, root / "kernels"), "cublaslt": emu.fake_cublaslt(root / "lt")}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", MODELS)
def test_tiny_models_generate_the_reference_tokens(emulated, model, mode):
    """Built with ``LUM_PERSISTENT`` (``reg``: the items waiting inside their bodies, their GEMVs' first weights
    in registers; ``reg-shared``: in shared memory), each tiny model's decode layers are
    persistent kernels (two emulated blocks, as the fake driver caps a grid), and its greedy tokens are the
    reference backend's, with and without graphs, session after session (the counters start each launch at
    zero)."""
    res = emu.run_emulated(f"PKGS = {emulated['pkgs']!r}\n" + r'''
import lum.loader as L
from tests.kernel_cases import compare
pkg = L.open(PKGS[MODEL])
prompt = [1, 5, 9, 3, 17]
want = pkg.session(backend="reference").generate(prompt, 6)
out = {"want": want, "persistent": sum(bool(op.tuning.get("persistent")) for g in pkg.manifest.groups
                                       if g.table is not None for op in g.table.ops)}
for mode in ({}, {"graphs": False}, {}):
    with pkg.session(backend="cuda", **mode) as sess:
        out.setdefault("got", []).append(sess.generate(prompt, 6))
print(json.dumps(out))
'''.replace("PKGS[MODEL]", f"PKGS[{model + '.' + mode!r}]"), driver_dir=emulated["driver"], kernels=emulated["kernels"],
                           cublaslt=emulated["cublaslt"])
    assert res["persistent"] >= 1, res
    assert all(got == res["want"] for got in res["got"]), res


def test_a_stamped_persistent_kernel_stamps_each_item(monkeypatch):
    """With ``LUM_STAMPS=1`` (``profile_decode.py --stamps``) a persistent kernel's items stamp as kernels of their
    own: the module reserves a record slot for the kernel and one for each item, the items' tags follow the
    kernel's, and NVRTC compiles it, each item's three stamps in the PTX; the kernel's name is the plain build's."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace as NS

    from lum.builder import nvrtc
    from lum.builder.codegen import STAMP_BLOCKS, STAMP_FIELDS, module_source, stamp_tag
    from lum.builder.kernels import group_kernel_sources

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    monkeypatch.setenv("LUM_PERSISTENT", "reg")
    cgs, dv = _layer_group("llama3-1b")
    prog = cgs[1].program
    (ks,) = group_kernel_sources(prog, dv, {"p": 512}, {}, weights=frozenset(o.id for o in prog.ops
                                                                            if o.kind == "input")).values()
    items = len(ks.tuning["persistent"])
    src = module_source([ks], stamps=True)
    assert f"lum_stamps[{(1 + items) * STAMP_BLOCKS * STAMP_FIELDS}]" in src
    ptx = nvrtc.compile_cuda(src, "sm_90", cache_dir=False).ptx
    assert ptx.count("%globaltimer") >= 3 * items + 2
    assert ks.body in src and "LUM_STAMP_ITEM(0, 1);" in ks.body
    from profile_decode import item_names     # noqa: E402  (benchmarks/ on the path above)

    pkg = NS(manifest=NS(groups=[NS(table=NS(ops=[NS(name=ks.name, tuning=ks.tuning)]))]),   # what item_names
             entry=lambda name: NS(calls=[NS(group=0)]), _program=lambda group: prog)        # reads of a package
    names = item_names(pkg, "decode")
    assert sorted(names) == [stamp_tag(ks.name) + 1 + n for n in range(items)]
    assert names[stamp_tag(ks.name) + 1].endswith(f"item 0: op {ks.tuning['persistent'][0]['op']} gemm")


def test_the_loader_needs_every_block_of_a_persistent_kernel_resident():
    """A persistent kernel's blocks wait for each other, so the loader refuses a grid larger than the GPU holds
    at once: its SMs times the kernel's ``blocks_per_sm`` (one where it records none)."""
    from types import SimpleNamespace as NS

    from lum.format.expr import Var, as_expr
    from lum.loader.cuda.runner import _check_resident
    from lum.loader.errors import BackendUnavailableError

    def launch(blocks):
        return NS(kernel="k", grid=(as_expr(blocks), as_expr(1), as_expr(1)))

    reg = NS(tuning={"persistent": [{}], "blocks_per_sm": 4})
    one = NS(tuning={"persistent": [{}]})
    _check_resident(reg, launch(528), 132)
    _check_resident(one, launch(132), 132)
    _check_resident(NS(tuning={}), launch(10_000), 132)          # not persistent: any grid
    with pytest.raises(BackendUnavailableError, match="528 blocks, 4 an SM, and this GPU has 114 SMs"):
        _check_resident(reg, launch(528), 114)
    with pytest.raises(BackendUnavailableError, match="133 blocks, 1 an SM"):
        _check_resident(one, launch(133), 132)
    with pytest.raises(BackendUnavailableError, match="must be static"):
        _check_resident(one, NS(kernel="k", grid=(Var("p"), as_expr(1), as_expr(1))), 132)
