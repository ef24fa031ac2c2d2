"""The residual link by linearity (builder/resnorm.py, off unless ``LUM_RESNORM_SUMS=1``): where it fires, what the
rewritten program computes against the one it replaces (reference backend), and the kernels it becomes: the four
slot sums as tails of o's cluster kernel (templates/gemv_combine.cu), gate-up computing its input as a light
prologue over its whole grid. The kernels' results are checked on the emulated driver (tests/test_cuda_emulated.py,
variant ``resnorm-sums``: the tiny models' greedy tokens) and on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest

from lum.builder import nvrtc
from lum.builder.gemv_policy import LIGHT_ROW_VALUES, light_prologue
from lum.builder.kernels import default_max_dyn, group_kernel_sources
from lum.builder.resnorm import ENV_RESNORM_SUMS, FORMS, residual_norm, resnorm_by_sums, resnorm_sums_form
from lum.format.llir import Arg, LOp, Program, has_row_ops
from lum.format.shapetracker import ShapeTracker
from lum.loader.reference_backend import execute
from tests.test_o_combine import _layer

RNG = np.random.default_rng(7)


def test_the_switch_is_off_by_default_and_refuses_other_values(monkeypatch):
    monkeypatch.delenv(ENV_RESNORM_SUMS, raising=False)
    assert resnorm_sums_form() is None
    for value, form in (("1", "ab"), ("raw", "raw"), ("0", None)):
        monkeypatch.setenv(ENV_RESNORM_SUMS, value)
        assert resnorm_sums_form() == form
    monkeypatch.setenv(ENV_RESNORM_SUMS, "yes")
    with pytest.raises(ValueError, match=ENV_RESNORM_SUMS):
        resnorm_sums_form()


def _sums(prog: Program) -> list:
    return [o for o in prog.ops if o.kind == "reduce" and [str(d) for d in o.shape] == ["40", "8"]]


@pytest.mark.parametrize("value,vectors", [("1", 2), ("raw", 0)])
def test_gemma_decode_layer_takes_its_norms_from_o_slots(monkeypatch, value, vectors):
    """gemma3-4b's layer at max_seq 512: four [40, 8] slot sums (o's 40 column groups × 8 ranks), in the ``ab``
    form two bf16 vectors A and B, and the residual norm gone into gate-up as a light prologue reading them (or,
    ``raw``, x, o and the weights); o's cluster kernel runs the sums and the vectors as tails, gate-up keeps the
    grid of a GEMV without a prologue (5,120 blocks), and both compile."""
    monkeypatch.setenv(ENV_RESNORM_SUMS, value)
    prog, dv = _layer("gemma3-4b", 512)
    sums = _sums(prog)
    assert len(sums) == 4
    ab = [o for o in prog.ops if o.kind == "elementwise" and o.id > sums[-1].id and o.dtype.name == "bf16"
          and not has_row_ops(o.params["expr"])]
    assert len(ab) == vectors
    (gate_up,) = [o for o in prog.ops if o.kind == "gemm" and "expr" in o.params and "epilogue" in o.params]
    assert {a.src for a in gate_up.args} >= {s.id for s in sums + ab}
    assert not any(residual_norm(o) for o in prog.ops)
    ks = group_kernel_sources(prog, dv, default_max_dyn(dv, 512))
    (oc,) = [k for k in ks.values() if "o_combine" in k.tuning]
    assert oc.tails[1:] == tuple(s.id for s in sums + ab)
    assert ks[gate_up.id].tuning.get("light_prologue") and "prologue" not in ks[gate_up.id].tuning
    assert ks[gate_up.id].grid[0].value == 5120
    for k in (oc, ks[gate_up.id]):
        assert nvrtc.compile_cuda(k.source, "sm_90", ptx=False, cache_dir=False).cubin


def test_near_misses_keep_the_residual_kernel(monkeypatch):
    """No rewrite where o is not split by head in one cluster kernel (``LUM_O_COMBINE=0``; max_seq 2,048: past the
    chunks it takes) nor in llama's layer (its FFN norm has no norm of o inside); nothing changes with the switch off."""
    monkeypatch.setenv(ENV_RESNORM_SUMS, "1")
    for model, max_seq, env in (("gemma3-4b", 2048, "1"), ("gemma3-4b", 512, "0"), ("llama3-1b", 512, "1")):
        monkeypatch.setenv("LUM_O_COMBINE", env)
        prog, _ = _layer(model, max_seq)
        assert not _sums(prog) and resnorm_by_sums(prog) is prog, (model, max_seq, env)
    monkeypatch.setenv("LUM_O_COMBINE", "1")
    monkeypatch.delenv(ENV_RESNORM_SUMS)
    prog, _ = _layer("gemma3-4b", 512)
    assert any(residual_norm(o) for o in prog.ops) and not _sums(prog)


def _inputs(prog: Program, dyn: dict, scale: dict | None = None) -> dict:
    out = {}
    for o in prog.inputs():
        shape = tuple(d.evaluate(dyn) for d in o.shape)
        name = o.params["name"]
        if o.dtype.is_int:
            out[name] = RNG.integers(0, dyn["p"] + 1, shape).astype(o.dtype.np)
        elif o.dtype.np == np.bool_:
            out[name] = np.ones(shape, bool)
        else:
            out[name] = (RNG.standard_normal(shape) * (scale or {}).get(name, 1.0)).astype(o.dtype.np)
    return out


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("residual_rms", [1.0, 900.0])
def test_rewritten_layer_matches_the_residual_kernel(monkeypatch, residual_rms, form):
    """The rewritten gemma3-4b layer against the one it replaces, on the reference backend: the same outputs but
    for the order of Σ h² (float64 there and here; the kernels round the slots to f32) and, in the ``ab`` form, A's
    and B's rounding to bf16 (as u's own). At a residual stream of RMS 900 (Σ x² ≈ 2·10⁹, past where a 32-bit fixed
    point of 2⁻³² would overflow) the sums keep the same accuracy."""
    monkeypatch.setenv(ENV_RESNORM_SUMS, "0")
    plain, _ = _layer("gemma3-4b", 512)
    new = resnorm_by_sums(plain, form)
    assert new is not plain and Program.loads(new.dumps()).dumps() == new.dumps()
    dyn = {"p": 37}
    inputs = _inputs(plain, dyn, {"ext5": residual_rms})
    want, got = execute(plain, inputs, dyn), execute(new, inputs, dyn)
    assert want.keys() == got.keys()
    for k in want:
        w, g = want[k].astype(np.float64), got[k].astype(np.float64)
        assert not np.isnan(g).any()
        assert np.linalg.norm(g - w) <= (1e-3 if form == "raw" else 1e-2) * np.linalg.norm(w), k


def test_slot_sums_are_the_sums_over_o_owners_columns():
    """Each slot (g, r) of the four sums is the sum over columns g·64 + 8·i + r (i < 8) of o², x², x·o·(1 + w_p)
    and (o·(1 + w_p))², against float64 sums of the same x, o and w_p (the program cut after the sums, they and o
    its outputs)."""
    plain, _ = _layer("gemma3-4b", 512)
    new = resnorm_by_sums(plain)
    sums = _sums(new)
    (oid,) = {a.src for a in sums[0].args}
    o = new.ops[oid]
    cut = new.ops[:sums[-1].id + 1]
    outs = [LOp(len(cut) + j, "output", "Output", (Arg(v.id, ShapeTracker.contiguous(v.shape)),), v.shape, v.dtype,
                {"name": f"v{j}", "role": "output"}) for j, v in enumerate([o, *sums])]
    dyn = {"p": 37}
    inputs = _inputs(plain, dyn)
    got = execute(Program("cut", cut + outs), inputs, dyn)
    x = inputs["ext5"].astype(np.float64).reshape(-1)
    ov = got["v0"].astype(np.float64).reshape(-1)
    ow = ov * (1.0 + inputs["model.layers.0.post_attention_layernorm.weight"].astype(np.float64))
    cols = 64 * np.arange(40)[:, None, None] + np.arange(8)[None, :, None] + 8 * np.arange(8)[None, None, :]
    want = [(ov * ov)[cols].sum(-1), (x * x)[cols].sum(-1), (x * ow)[cols].sum(-1), (ow * ow)[cols].sum(-1)]
    for j, w in enumerate(want):
        assert np.allclose(got[f"v{j + 1}"].astype(np.float64), w, rtol=1e-5, atol=1e-5 * np.abs(w).max()), j


def test_light_prologue_counts_only_slot_row_sums():
    """A tree whose row reductions read a masked view of at most LIGHT_ROW_VALUES values (or a broadcast) is light;
    one over a full row of 2,560, or with no row reduction, is not."""
    full = ShapeTracker.contiguous((1, 2560))
    slots = ShapeTracker((1, 2560), (0, 1), 0, ((0, 1), (0, 320)))
    wide = ShapeTracker((1, 2560), (0, 1), 0, ((0, 1), (0, LIGHT_ROW_VALUES + 1)))
    tree = ["Mul", "f32", ["arg", 0], ["RowSum", "f32", ["arg", 1]]]
    assert light_prologue(tree, [full, slots])
    assert not light_prologue(tree, [full, full]) and not light_prologue(tree, [full, wide])
    assert not light_prologue(["Mul", "f32", ["arg", 0], ["arg", 1]], [full, slots])
