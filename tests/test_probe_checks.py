"""The GPU probes' float64 checks (benchmarks/ffn_probe.py, layer_probe.py), on the CPU: outputs computed
as a GPU would (in float32, from its own previous outputs) pass, and a wrong value or a NaN anywhere fails.
The probes run only on a GPU, so this is where their checks are shown able to fail."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def probes(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import ffn_probe
    import layer_probe
    yield ffn_probe, layer_probe
    for name in ("ffn_probe", "layer_probe", "ring_probe", "_common"):
        sys.modules.pop(name, None)


def test_ffn_probe_check_passes_float32_and_fails_a_wrong_or_nan_output(probes):
    ffn, _ = probes
    rng = np.random.default_rng(1)
    sets = [tuple(ffn.unit_weights(rng, n, k) for n, k in ((48, 32), (48, 32), (32, 48))) for _ in range(2)]
    dense = ffn.dense_sets(sets)
    order = [0, 1, 0, 1]
    x0 = rng.standard_normal(32).astype(np.float32)
    outs, x = [], x0.astype(np.float64)
    for i in order:
        x = ffn.stretch(x, *dense[i]).astype(np.float32).astype(np.float64)
        outs.append(x)
    err, finite = ffn.check(outs, x0, dense, order)
    assert finite and err < ffn.TOLERANCE
    bad = [o.copy() for o in outs]
    bad[2][3] += 0.05 * np.max(np.abs(bad[2]))
    assert ffn.check(bad, x0, dense, order)[0] > ffn.TOLERANCE
    bad[2][3] = np.nan
    assert not ffn.check(bad, x0, dense, order)[1]


def test_ffn_probe_lum_reference_is_torchs_gelu_tanh_with_h_in_bf16(probes):
    """The ``lum`` mode's float64 reference (lum's gate-up epilogue, gelu_tanh(gate) · up, h rounded to bf16, then
    down) against torch's tanh-approximated GELU on the same weights."""
    torch = pytest.importorskip("torch")
    ffn, _ = probes
    rng = np.random.default_rng(3)
    wg, wu, wd = (rng.uniform(-1, 1, s) * np.sqrt(3.0 / s[1]) for s in ((64, 32), (64, 32), (16, 64)))
    x = rng.standard_normal(32)
    t = {k: torch.tensor(v) for k, v in (("wg", wg), ("wu", wu), ("wd", wd), ("x", x))}
    h = torch.nn.functional.gelu(t["wg"] @ t["x"], approximate="tanh") * (t["wu"] @ t["x"])
    want = (t["wd"] @ h.to(torch.bfloat16).to(torch.float64)).numpy()
    got = ffn.lum_reference(x, wg, wu, wd)
    assert np.max(np.abs(got - want)) <= 1e-3 * np.max(np.abs(want))   # a product on a bf16 step's other side


def test_layer_probe_check_passes_float32_and_fails_a_wrong_or_nan_layer(probes):
    """layer_probe.check at small shapes (a Dims of its own, grouped query heads): each layer's two residual
    increments from the float32 forward pass; a wrong down output in one layer, a wrong attention in another
    (through x2), or a NaN fail it."""
    _, lp = probes
    m = lp.Dims("small", k=32, nqkv=64, q=32, hd=8, heads=4, kv_heads=2, ff=48, layers=4)
    rng = np.random.default_rng(2)
    keys = 5
    sets = [lp.dense(lp.weight_set(rng, m, keys)) for _ in range(lp.SETS)]
    assert sets[0]["qkv"].shape == (64, 32) and sets[0]["kc"].shape == (2, keys, 8)
    xs = [rng.standard_normal(32).astype(np.float32).astype(np.float64)]
    x2s = []
    for layer in range(m.layers):
        w = sets[layer % lp.SETS]
        first, _ = lp.layer_increments(xs[-1], xs[-1], w, m)
        x2s.append((xs[-1] + first).astype(np.float32).astype(np.float64))
        _, second = lp.layer_increments(xs[-1], x2s[-1], w, m)
        xs.append((x2s[-1] + second).astype(np.float32).astype(np.float64))
    xs, x2s = np.array(xs), np.array(x2s)
    err, finite = lp.check(xs, x2s, sets, m)
    assert finite and err < lp.TOLERANCE, err
    for arr, layer in ((xs, 3), (x2s, 1)):
        bad_xs, bad_x2s = xs.copy(), x2s.copy()
        (bad_xs if arr is xs else bad_x2s)[layer, 7] += 0.05
        assert lp.check(bad_xs, bad_x2s, sets, m)[0] > lp.TOLERANCE
    bad = xs.copy()
    bad[2, 0] = np.nan
    assert lp.check(bad, x2s, sets, m)[1] is False


PROBE_PARAMS = ["const unsigned long long*", "const float*", "float*", "float*", "float*", "unsigned*", "unsigned*",
                "int", "int", "int"]


@pytest.fixture(scope="module")
def layer_probe_run(tmp_path_factory):
    """layer_probe.cu's kernels compiled for the host (every block resident at once, tests/cuda_emulation.py)
    and a function running one (model, kernel, mode) over 2 layers on 16 blocks with 8 cached keys, one
    weight set at the model's shapes used by both layers: (x of each layer and the output, x2 of each layer,
    the counters, the give-up flag), every output NaN beforehand; and the model's check."""
    import ctypes

    from tests import cuda_emulation as emu
    if emu.CXX is None:
        pytest.skip("no C++ compiler for the emulated kernels")
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import layer_probe as lp
    finally:
        sys.path.remove(str(BENCHMARKS))
    root = BENCHMARKS.parent
    src = "".join(p.read_text() for p in (root / "templates" / "common.cuh", BENCHMARKS / "probe.cuh",
                                          BENCHMARKS / "layer_probe.cu"))
    entries = {lp.kernel_name(kind, m): PROBE_PARAMS for kind, _ in lp.MODES.values() for m in lp.MODELS.values()}
    lib = ctypes.CDLL(str(emu.resident_library(src, entries, tmp_path_factory.mktemp("layer_probe"))))
    keys, layers, grid = 8, 2, 16
    made = {}

    def weights(model: str):
        if model not in made:
            m = lp.MODELS[model]
            rng = np.random.default_rng(0)
            ws = lp.weight_set(rng, m, keys)
            x0 = rng.standard_normal(m.k).astype(np.float32)
            dense32 = {k: (v.astype(np.uint32) << 16).view(np.float32) for k, v in ws.items()}   # bf16 exactly
            made.clear()                     # one model's weights at a time
            made[model] = (m, ws, x0, dense32)
        return made[model]

    def run(model: str, kind: str, code: int):
        m, ws, x0, dense32 = weights(model)
        wp = np.array([ws[k].ctypes.data for k in ("qkv", "o", "g", "u", "d", "kc", "vc")] * lp.SETS, np.uint64)
        act = np.full(layers * m.act, np.nan, np.float32)
        xout, x2out = (np.full((layers + 1) * m.k, np.nan, np.float32) for _ in range(2))
        cnt, err = np.zeros(layers * lp.COUNTERS, np.uint32), np.zeros(1, np.uint32)
        vals = [ctypes.c_void_p(a.ctypes.data) for a in (wp, x0, act, xout, x2out, cnt, err)]
        vals += [ctypes.c_int(v) for v in (layers, keys, code)]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        getattr(lib, f"run_{lp.kernel_name(kind, m)}")(params, grid, lp.threads_of(kind),
                                                         lp.smem_bytes(lp.stages_of(kind), m))
        xs = xout.reshape(layers + 1, m.k).astype(np.float64)
        x2s = x2out.reshape(layers + 1, m.k)[:layers].astype(np.float64)
        return m, cnt.reshape(layers, lp.COUNTERS), int(err[0]), lp.check(xs, x2s, [dense32] * lp.SETS, m)

    yield lp, run


@pytest.mark.parametrize("model", ["gemma3-4b", "llama3-1b"])
@pytest.mark.parametrize("mode", ["ahead", "ahead-2", "gated", "ahead-async", "gated-async", "stream",
                                  "ahead-reg", "gated-reg"])
def test_layer_probe_kernel_emulated(layer_probe_run, model, mode):
    """The persistent layer probe's kernel on the host at either model's shapes (llama3-1b: 32 query heads
    of 64 on 16 blocks, two a block), blocks waiting for each other's counters and consumers for the
    producer's ring stages (``-reg``: 16 warps loading their pieces of each chunk into registers, no ring;
    two pieces in flight a lane): with its dependencies kept two layers match float64 (each from its own
    input), every counter at its full count and no wait given up. Without them (stream) it still runs to the end;
    at gemma3-4b's shapes the emulator's round-robin schedule then has a consumer read an input before it is
    written (NaN), which the check catches (at llama3-1b's, that schedule happens to keep the order)."""
    lp, run = layer_probe_run
    kind, code = lp.MODES[mode]
    m, cnt, gave_up, (err, finite) = run(model, kind, code)
    assert gave_up == 0
    assert cnt.tolist() == [m.counters()] * 2
    if mode == "stream":
        assert not finite or model != "gemma3-4b"
    else:
        assert finite and err < lp.TOLERANCE, err


@pytest.fixture
def o_combine(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import o_combine_probe
    yield o_combine_probe
    for name in ("o_combine_probe", "_common"):
        sys.modules.pop(name, None)


def _fused_in_float32(p: np.ndarray, w: np.ndarray, ocp) -> np.ndarray:
    """What probe_o_combine computes, in float32 (its order of summation aside): each head's combine over its
    chunks, rounded to bf16, dotted with that head's weights; the heads' column partials summed in order."""
    heads, ns, _ = p.shape
    out = np.zeros(w.shape[0], np.float32)
    for h in range(heads):
        m, sl, sa = np.float32(-np.inf), np.float32(0), np.zeros(ocp.D, np.float32)
        for j in range(ns):
            c = p[h, j, ocp.D]
            if c > m:
                f = np.float32(0) if m == -np.inf else np.exp2(m - c, dtype=np.float32)
                sl, sa, m = sl * f, sa * f, c
            e = np.exp2(c - m, dtype=np.float32)
            sl = sl + e * p[h, j, ocp.D + 1]
            sa = sa + e * p[h, j, :ocp.D]
        a = ocp.bf16_round(sa * (np.float32(1) / sl))
        out += w[:, h * ocp.D:(h + 1) * ocp.D] @ a
    return out


def test_o_combine_probe_check_passes_the_fused_math_and_fails_a_wrong_or_nan_link(o_combine):
    """o_combine_probe's float64 reference (the combine rounded to bf16, then o) against the fused kernel's
    arithmetic in float32 on its own partials: within the tolerance; a wrong column or a NaN is not."""
    ocp = o_combine
    rng = np.random.default_rng(3)
    w = ocp.bf16_round((0.02 * rng.standard_normal((96, ocp.K))).astype(np.float32))
    outs, wants = [], []
    for ns in (1, 7, 40):
        p = ocp.partials(rng, ns)
        outs.append(_fused_in_float32(p, w, ocp).astype(np.float64))
        wants.append(w.astype(np.float64) @ ocp.combine_ref(p))
    err, finite = ocp.check(outs, wants)
    assert finite and err < ocp.TOLERANCE / 10
    bad = [o.copy() for o in outs]
    bad[1][5] += 0.05 * np.max(np.abs(bad[1]))
    assert ocp.check(bad, wants)[0] > ocp.TOLERANCE
    bad[1][5] = np.nan
    assert not ocp.check(bad, wants)[1]


def test_o_combine_probe_kernels_compile_with_lums_own(o_combine):
    """The probe's module (its kernels, then lum's combine and o kernels of gemma3-4b, generated by the builder)
    compiles for sm_90 with NVRTC, no GPU needed; lum's kernels take the parameters the probe passes them."""
    from lum.builder import nvrtc
    ocp = o_combine
    combine, o, dyn_vars = ocp.lum_kernels(max_seq=ocp.CHUNK * 55)
    assert [p.name for p in combine.params] == ["out", "in0", "in1", "in2", "in3", "dyn"]
    assert [p.name for p in o.params] == ["out", "in0", "in1", "dyn"] and dyn_vars == ["p"]
    src = "".join((BENCHMARKS.parent / f).read_text() for f in ("templates/common.cuh", "benchmarks/probe.cuh",
                                                                "benchmarks/o_combine_probe.cu"))
    assert nvrtc.compile_cuda(src + combine.body + "\n" + o.body, 90, name="o_combine_probe.cu").cubin


@pytest.fixture
def resnorm(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import resnorm_probe
    yield resnorm_probe
    for name in ("resnorm_probe", "ffn_probe", "ring_probe", "_common"):
        sys.modules.pop(name, None)


def test_resnorm_probe_sums_give_the_residuals_norm(resnorm):
    """The identity ``sums`` rests on: with r_o known, Σ h² of h = x + o ⊙ wp · r_o is Σ x² + 2 r_o Σ x · o ⊙ wp +
    r_o² Σ (o ⊙ wp)², sums that o's blocks can add up slice by slice; it holds to float64 rounding for random
    data, and for a residual that nearly cancels o (the form's weak case) to a relative 1e-9 of Σ x²."""
    rp = resnorm
    rng = np.random.default_rng(5)
    for _ in range(3):
        x, o, wp = rng.standard_normal(rp.N), rng.standard_normal(rp.N), rng.uniform(0.5, 1.5, rp.N)
        ro = 1.0 / np.sqrt(np.mean(o * o) + rp.EPS)
        h = x + o * wp * ro
        assert abs(rp.sum_of_h_squares(x, o, wp) - float(np.sum(h * h))) < 1e-10 * float(np.sum(h * h))
    x = -o * wp * ro + 1e-3 * rng.standard_normal(rp.N)
    h = x + o * wp * ro
    assert abs(rp.sum_of_h_squares(x, o, wp) - float(np.sum(h * h))) < 1e-9 * float(np.sum(x * x))


def test_resnorm_probe_norm_weights_are_bf16_values(resnorm):
    """``raw`` reads the norms' weights in bf16 and the other modes in float32: bf16_round gives values both hold
    alike (bf16's bits widen back to the same float32), near the values it was given."""
    rp = resnorm
    v = np.random.default_rng(3).uniform(0.5, 1.5, 1000)
    exact = rp.bf16_round(v)
    assert exact.dtype == np.float32
    assert np.array_equal((rp.bf16_bits(exact).astype(np.uint32) << 16).view(np.float32), exact)
    assert np.max(np.abs(exact - v) / v) <= 2.0 ** -8 and not np.array_equal(exact, v.astype(np.float32))


def test_resnorm_probe_check_passes_float32_and_fails_a_wrong_or_nan_output(resnorm):
    """resnorm_probe's float64 check at small shapes: a chain computed in float32 from its own x passes; a wrong
    gate-up output, a wrong next x or a NaN fails."""
    rp = resnorm
    rng = np.random.default_rng(2)
    n, k, hid = 64, 64, 96
    dense = [tuple(rng.uniform(-1, 1, shape) * np.sqrt(3.0 / shape[1]) for shape in ((n, k), (hid, n), (hid, n)))
             for _ in range(2)]
    order = [0, 1, 0]
    a, x0 = rng.standard_normal(k), rng.standard_normal(n).astype(np.float32)
    norms = tuple(rng.uniform(0.5, 1.5, n) for _ in range(2))
    acts, xs, x = [], [], x0.astype(np.float64)
    for i in order:
        act, h = rp.stretch(x, a, *norms, *dense[i])
        acts.append(act.astype(np.float32).astype(np.float64))
        x = h.astype(np.float32).astype(np.float64)
        xs.append(x)
    err, finite = rp.check(acts, xs, x0, a, norms, dense, order)
    assert finite and err < rp.TOLERANCE
    for target, j in ((acts, 1), (xs, 0)):
        bad = [v.copy() for v in target]
        bad[j][3] += 0.05 * np.max(np.abs(bad[j]))
        args = (bad, xs) if target is acts else (acts, bad)
        assert rp.check(*args, x0, a, norms, dense, order)[0] > rp.TOLERANCE
    bad = [v.copy() for v in acts]
    bad[2][0] = np.nan
    assert not rp.check(bad, xs, x0, a, norms, dense, order)[1]


def test_resnorm_probe_kernels_compile(resnorm):
    """The probe's module (ffn_probe.cu's kernels, then its own) compiles for sm_90 with NVRTC, no GPU needed."""
    from lum.builder import nvrtc
    src = "".join((BENCHMARKS.parent / f).read_text() for f in ("templates/common.cuh", "benchmarks/probe.cuh",
                                                                "benchmarks/ffn_probe.cu", "benchmarks/resnorm_probe.cu"))
    assert nvrtc.compile_cuda(src, 90, name="resnorm_probe.cu").cubin


def test_probe_bf16_helpers_round_to_nearest_even_and_widen_exactly(probes):
    """_common's bf16 helpers (every probe's weights and references) against the integer rounding they replaced:
    add 0x7FFF and the kept bit's parity, drop 16 bits; ties (exactly half a step) go to the even bits."""
    import _common as c
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(4000).astype(np.float32),
                        np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 0.0], np.float32)])
    u = x.view(np.uint32).astype(np.uint64)
    want = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    assert np.array_equal(c.bf16_bits(x), want)
    assert c.bf16_bits(x)[-4:].tolist() == [0x3F80, 0x3F82, 0xBF80, 0]    # ties: down to even, up to even
    assert np.array_equal(c.bf16_float(want), (want.astype(np.uint32) << 16).view(np.float32))
    assert np.array_equal(c.bf16_round(x), c.bf16_float(want))
