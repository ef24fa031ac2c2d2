"""A decode FFN as one kernel sliced over h (builder/ffn_sliced.py, templates/gemv_ffn.cu): the switch, which pairs
fuse, the fused kernel's launch and text, its table and NVRTC compile. Its results are checked on the emulated
driver (tests/test_cuda_emulated.py, variant ``ffn-sliced``: the ``ffn.sliced`` kernel case and tiny-gemma3's
greedy tokens) and on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lum.builder import nvrtc
from lum.builder.ffn_sliced import THREADS, _pair, ffn_sliced_enabled
from lum.builder.kernels import default_max_dyn, group_kernel_sources, launch_table
from lum.builder.rewrite import readers
from tests.test_o_combine import _layer


def test_the_switch_is_off_by_default_and_refuses_other_values(monkeypatch):
    monkeypatch.delenv("LUM_FFN_SLICED", raising=False)
    assert not ffn_sliced_enabled()
    monkeypatch.setenv("LUM_FFN_SLICED", "1")
    assert ffn_sliced_enabled()
    monkeypatch.setenv("LUM_FFN_SLICED", "yes")
    with pytest.raises(ValueError, match="LUM_FFN_SLICED"):
        ffn_sliced_enabled()


def test_gemma_ffn_is_one_kernel_of_a_block_an_sm(monkeypatch):
    """gemma3-4b's decode FFN: the gate-up GEMV (its gelu·up epilogue, no prologue at 20,480 columns) and down
    are one kernel under the gate-up, down its tail: 132 blocks of 512 threads (the 10,240 rows of h in slices of
    9–10 vectors), no weights read before its wait, the fixed-point sums and the block count module globals, the
    table programmatic, and the module compiles with NVRTC (its partials added as 64-bit integers); the LLIR is
    unchanged, and off, nothing fuses."""
    monkeypatch.setenv("LUM_FFN_SLICED", "1")
    prog, dv = _layer("gemma3-4b", 512)
    ks = group_kernel_sources(prog, dv, default_max_dyn(dv, 512))
    (fused,) = [k for k in ks.values() if "ffn_sliced" in k.tuning]
    gu, down = fused.tuning["ffn_sliced"]
    assert fused.tails == (down,) and down not in ks and ks[gu] is fused
    assert "epilogue" in prog.ops[gu].params and prog.ops[down].args[0].src == gu
    (launch,) = fused.launches
    assert launch.grid[0].value == 132 and launch.block == (THREADS, 1, 1) and launch.cluster == 1
    assert fused.early == ()
    body = fused.body
    for name in ("_sum[2560]", "_bad[2560]", "_done;"):
        assert f"__device__ unsigned {'long long ' if 'sum' in name else ''}{fused.name}{name}" in body
    assert body.index("lum_pdl_wait();") < body.index("lum_load_stream<4>")
    table = launch_table(prog, ks, arch="sm_90", dyn_vars=dv, max_dyn=default_max_dyn(dv, 512))
    (entry,) = [e for e in table["ops"] if e["name"] == fused.name]
    assert entry["tail"] == [down] and table["programmatic"]
    res = nvrtc.compile_cuda(fused.source, "sm_90", name="ffn.cu")
    assert res.cubin[:4] == b"\x7fELF" and res.ptx.count(".entry") == 1
    assert "atom.global.add.u64" in res.ptx or "red.global.add.u64" in res.ptx
    monkeypatch.setenv("LUM_FFN_SLICED", "0")
    plain, dv = _layer("gemma3-4b", 512)
    ks = group_kernel_sources(plain, dv, default_max_dyn(dv, 512))
    assert not any("ffn_sliced" in k.tuning for k in ks.values())
    assert [(o.kind, o.op, o.shape) for o in plain.ops] == [(o.kind, o.op, o.shape) for o in prog.ops]


def test_what_does_not_fuse(monkeypatch):
    """llama3-1b's FFN (its gate-up computes the input norm in a prologue, its down adds the residual in an
    epilogue); and near misses of gemma3-4b's: a gate-up with a second reader, a down with an epilogue, a down
    weight that is not an input, a gate-up without an epilogue."""
    monkeypatch.setenv("LUM_FFN_SLICED", "1")
    prog, dv = _layer("llama3-1b", 512)
    ks = group_kernel_sources(prog, dv, default_max_dyn(dv, 512))
    assert not any("ffn_sliced" in k.tuning for k in ks.values())
    prog, _ = _layer("gemma3-4b", 512)
    users = readers(prog)
    (down,) = [o for o in prog.ops if o.kind == "gemm" and prog.ops[o.args[0].src].params.get("epilogue")]
    gu = prog.ops[down.args[0].src]
    assert _pair(prog, down, users) is not None
    assert _pair(prog, down, {**users, gu.id: [down, down]}) is None
    assert _pair(prog, replace(down, params={**down.params, "epilogue": ["acc", 0]}), users) is None
    assert _pair(prog, replace(down, args=(down.args[0], replace(down.args[1], src=gu.args[0].src))), users) is None
    ops = list(prog.ops)
    ops[gu.id] = replace(gu, params={k: v for k, v in gu.params.items() if k != "epilogue"})
    assert _pair(replace(prog, ops=tuple(ops)), down, users) is None
