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


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory):
    """The ``ffn.sliced`` kernel case's fused kernel (f32) compiled for the host emulation, and a runner of it on
    numpy buffers: (run(x, w_gu, consts, w_down) -> out, the case's arrays)."""
    import ctypes

    import numpy as np

    from lum.builder.kernels import program_dyn_vars
    from lum.format.dtypes import DType
    from tests import cuda_emulation as emu
    from tests.kernel_cases import template_cases

    if emu.CXX is None:
        pytest.skip("no host C++ compiler for the CUDA emulation")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LUM_FFN_SLICED", "1")
        prog, arrays, _ = template_cases(DType.f32)
        dv = program_dyn_vars([prog])
        (k,) = [x for x in group_kernel_sources(prog, dv, default_max_dyn(dv, 16)).values()
                if x is not None and "ffn_sliced" in x.tuning]
    lib = ctypes.CDLL(str(emu.kernel_library([k], tmp_path_factory.mktemp("ffn"))))
    fn = getattr(lib, f"run_{k.name}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    (launch,) = k.launches

    def run(x, wgu, cs, wd, grid=launch.grid[0].value):
        h, out = np.full(1120, np.nan, np.float32), np.full(1030, np.nan, np.float32)
        bufs = {"out": h, "in0": x, "in1": wgu, "in2": cs, "in3": cs, "dyn": np.zeros(1, np.int64), "t0_out": out,
                "t0_in0": h, "t0_in1": wd}
        ptrs = [ctypes.c_void_p(bufs[p.name].ctypes.data) for p in k.params]
        fn((ctypes.c_void_p * len(ptrs))(*[ctypes.cast(ctypes.pointer(q), ctypes.c_void_p) for q in ptrs]), grid,
           launch.block[0])
        return out

    return run, {n.split(".")[-1]: a.astype(np.float32) for n, a in arrays.items() if n.startswith("ffn.sliced.")}


def test_sliced_ffn_is_exact_deterministic_and_keeps_nan(host_kernel):
    """The fused kernel on the host emulation, on the ``ffn.sliced`` case (f32): out as float64's to 1e-5 at 132
    blocks and at 5 (blocks walking slices); the same bits on every run (the fixed-point sums, zeroed by each
    run's last block); a NaN in x makes every output NaN, a NaN in one of down's rows only that output, and an
    infinite weight its output NaN too (a partial past the sums' range is not added as a wrong finite value)."""
    import numpy as np

    run, a = host_kernel
    x, wgu, cs, wd = a["x0"], a["x1"], a["x2"], a["x3"]
    c = wgu.astype(np.float64).reshape(2240, 72) @ x.astype(np.float64)
    h = c[:1120] / (1.0 + 2.0 ** (c[:1120] * float(cs[1]))) * c[1120:]
    want = wd.astype(np.float64).reshape(1030, 1120) @ h
    first = run(x, wgu, cs, wd)
    assert np.max(np.abs(first - want)) <= 1e-5 * np.max(np.abs(want))
    assert np.array_equal(run(x, wgu, cs, wd), first) and np.array_equal(run(x, wgu, cs, wd, grid=5), first)
    bad_x = x.copy()
    bad_x[3] = np.nan
    assert np.isnan(run(bad_x, wgu, cs, wd)).all()
    for poison in (np.nan, np.inf):
        bad_w = wd.copy()
        bad_w[7 * 1120 + 500] = poison
        got = run(x, wgu, cs, bad_w)
        assert np.isnan(got[7]) and np.isfinite(np.delete(got, 7)).all()
        assert np.array_equal(np.delete(got, 7), np.delete(first, 7))
