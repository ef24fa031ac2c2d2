"""Loads above the programmatic-launch wait, in the PTX of real decode groups (tests/pdl_order.py).

Every kernel of llama3-1b's decode groups, as built by default and with GEMV preloads, of gemma3-4b's with
down's first lines asked of L2 before its wait (``LUM_GEMV_AHEAD_AFTER_GEMV``, on by default), and every gemv
case with a preload: above ``griddepcontrol.wait`` only the dyn buffer
and, in kernels that read early, read-only loads. (ptxas's part, the SASS, is test_gpu.py's.)"""

from __future__ import annotations

import pytest

from lum.builder.codegen import generate_program, module_source
from lum.format.dtypes import DType
from tests.pdl_order import bad_ptx_loads, dyn_param_index, ptx_loads_above_wait

@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nvrtc_cache")


VARIANTS = {"default": {}, "preload": {"LUM_GEMV_PRELOAD": "1"}, "ahead-after-gemv": {"LUM_GEMV_AHEAD_AFTER_GEMV": "1"}}
VARIANT_MODEL = {"ahead-after-gemv": "gemma3-4b"}    # the model a variant changes (else llama3-1b)


def decode_kernels(model: str) -> list:
    """Every kernel of ``model``'s bf16 decode groups (lum.builder.kernels.group_kernel_sources), the inputs
    bound to the model's weights marked as weights, as ``lum build`` does."""
    from lum.builder.compile import compile_graph, weight_inputs
    from lum.builder.kernels import group_kernel_sources, program_dyn_vars
    from lum.builder.models.config import named_config
    from lum.builder.models.transformer import build_entry

    graph = build_entry(named_config(model), "decode", 4096, DType.bf16)
    cgs = compile_graph(graph)
    dv = program_dyn_vars([cg.program for cg in cgs])
    return [k for cg in cgs for k in group_kernel_sources(cg.program, dv, {"p": 4096},
                                                          weights=weight_inputs(graph, cg.program)).values()
            if k is not None]


def ptx_violations(nvrtc, kernels: list, cache_dir) -> tuple[dict, int]:
    """(the loads that break the rule, the number of loads above a wait), over ``kernels``' PTX."""
    res = nvrtc.compile_cuda(module_source(kernels), "sm_90", cache_dir=cache_dir)
    loads = ptx_loads_above_wait(res.ptx)
    dyn = {k.name: dyn_param_index(k.body, k.name) for k in kernels}
    return bad_ptx_loads(loads, dyn, {k.name: bool(k.early) for k in kernels}), sum(map(len, loads.values()))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_kernels_read_only_dyn_and_early_weights_before_the_wait(nvrtc, cache_dir, monkeypatch, variant):
    for k, v in VARIANTS[variant].items():
        monkeypatch.setenv(k, v)
    kernels = decode_kernels(VARIANT_MODEL.get(variant, "llama3-1b"))
    bad, n = ptx_violations(nvrtc, kernels, cache_dir)
    assert bad == {} and n > 0
    if variant != "default":
        assert any(k.early for k in kernels)


@pytest.mark.parametrize("shared", [False, True], ids=["registers", "shared"])
def test_gemv_preload_cases_read_only_weights_before_the_wait(nvrtc, cache_dir, shared):
    """The GEMVs' preloads above the wait, into registers or copied into shared memory (cp.async), read
    only their weights."""
    from tests.kernel_cases import gemv_cases

    for dt in (DType.f32, DType.bf16):
        ks = [k for k in generate_program(gemv_cases(dt)[0], preload=8 if shared else 1,
                                          preload_shared=shared).values() if k is not None]
        assert any(k.early and k.tuning.get("prologue") for k in ks)
        assert any(k.tuning.get("preload_shared") for k in ks) == shared
        bad, _ = ptx_violations(nvrtc, ks, cache_dir)
        assert bad == {}
        above = ptx_loads_above_wait(nvrtc.compile_cuda(module_source(ks), "sm_90", cache_dir=cache_dir).ptx)
        assert any(ln.startswith("cp.async") for lds in above.values() for ln, _ in lds) == shared


def test_the_rule_fails_on_a_read_above_the_wait():
    """A coherent load of an input above the wait, and a read-only one or a copy to shared memory in a kernel
    that reads nothing early, are reported; the dyn buffer's load is not."""
    ptx = """.visible .entry k(
    .param .u64 k_param_0, .param .u64 k_param_1, .param .u64 k_param_2)
    ld.param.u64 %rd1, [k_param_1];
    ld.param.u64 %rd2, [k_param_2];
    cvta.to.global.u64 %rd3, %rd2;
    ld.global.nc.u64 %rd4, [%rd3+8];
    cvta.to.global.u64 %rd5, %rd1;
    ld.global.f32 %f1, [%rd5];
    ld.global.nc.f32 %f2, [%rd6];
    cp.async.cg.shared.global.L2::cache_hint [%r1], [%rd7], 16, %rd8;
    griddepcontrol.wait;
    ld.global.f32 %f3, [%rd5];
}"""
    loads = ptx_loads_above_wait(ptx)
    assert [p for _, p in loads["k"]] == [2, 1, None, None]          # the copy to shared memory too
    assert bad_ptx_loads(loads, {"k": 2}, {"k": False}) == {"k": [ln for ln, _ in loads["k"][1:]]}
    assert bad_ptx_loads(loads, {"k": 2}, {"k": True}) == {"k": [loads["k"][1][0]]}
