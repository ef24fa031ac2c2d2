"""GEMV epilogues (builder/epilogue.py): the decode gate-up GEMV stores gelu(gate)·up (or silu) itself,
and a GEMV whose one reader adds it to the residual stores the sum, as LLIR version 3
``params["epilogue"]`` on the gemm.

Checked here: on tiny models' decode groups each fused reader is one kernel fewer and the program
computes bit for bit what the unfused one computes (reference backend, random inputs); GEMVs with
another reader, masked or row-reducing readers are left alone; the LLIR validation. The kernels'
numbers are checked against the reference by the emulated driver and on the GPU
(tests/kernel_cases.py ``gemv.epilogue.*``, decode of whole models).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("egglog")

from lum.builder import epilogue  # noqa: E402
from lum.builder.compile import compile_group  # noqa: E402
from lum.format.dtypes import DType  # noqa: E402
from lum.format.expr import as_expr  # noqa: E402
from lum.format.llir import Arg, LOp, Program  # noqa: E402
from lum.format.shapetracker import ShapeTracker  # noqa: E402
from lum.loader.reference_backend import execute  # noqa: E402
from tests.test_prologue import _groups, _random_inputs  # noqa: E402


def _epilogue_gemms(prog: Program) -> list[LOp]:
    return [o for o in prog.ops if o.kind == "gemm" and "epilogue" in o.params]


@pytest.mark.parametrize("model,per_layer", [("tiny-llama", 2), ("tiny-gemma3", 1)])
def test_decode_gemvs_store_their_readers_bit_for_bit(model, per_layer, monkeypatch):
    """gate-up stores the gated activation (both models); llama's down GEMV also stores the residual sum
    (gemma's residual normalises the GEMV's row first: a row reduction, left alone). Llama's only while the
    layer ends there: with the next input norm ahead, a row kernel sums the residual."""
    if model == "tiny-llama":
        monkeypatch.setenv("LUM_NORMS_AHEAD", "0")
    dyn = {"p": 5}
    layer_fused = []
    for cg in _groups(model, "decode"):
        monkeypatch.setenv(epilogue.ENV_GEMV_EPILOGUE, "0")
        plain = compile_group(cg)[0]
        monkeypatch.delenv(epilogue.ENV_GEMV_EPILOGUE)
        fused = compile_group(cg)[0]
        got = _epilogue_gemms(fused)
        assert len(fused.kernels()) == len(plain.kernels()) - len(got)
        if got:
            assert fused.version() == 3 and Program.loads(fused.dumps()).dumps() == fused.dumps()
            layer_fused.append(len(got))
        inputs = _random_inputs(plain, dyn)
        want, have = execute(plain, inputs, dyn), execute(fused, inputs, dyn)
        for k in want:
            assert np.array_equal(want[k], have[k]), k
    assert layer_fused and set(layer_fused) == {per_layer}     # each layer group (norms_ahead: two in gemma)
    gate_up = next(o for cg in _groups(model, "decode") for o in _epilogue_gemms(compile_group(cg)[0])
                   if len(o.params["acc_cols"]) == 2)
    n_out = gate_up.params["n_out"].evaluate({})
    assert gate_up.params["acc_cols"] == [0, n_out] and gate_up.params["n"].evaluate({}) == 2 * n_out


def _gemv_then(reader: str) -> Program:
    """x [k] · W [2h, k]ᵀ → C [1, 1, 2h] f32, then a Fused reader of C's halves (``pair``), the same with a
    second reader (``two``), a masked read (``masked``) or a row reduction (``rows``)."""
    k, h = 16, 8
    ops = [LOp(0, "input", "Input", (), (as_expr(k),), DType.f32, {"name": "x", "role": "input"}),
           LOp(1, "input", "Input", (), (as_expr(2 * h * k),), DType.f32, {"name": "w", "role": "weight"})]
    params = {"layout": "RmCm", "m": as_expr(1), "n": as_expr(2 * h), "k": as_expr(k), "lda": as_expr(k),
              "ldb": as_expr(k), "ldc": as_expr(2 * h), "batch": as_expr(1)}
    ops.append(LOp(2, "gemm", "Gemm", (Arg(0, ShapeTracker.contiguous((as_expr(k),))),
                                       Arg(1, ShapeTracker.contiguous((as_expr(2 * h * k),)))),
                   (as_expr(1), as_expr(1), as_expr(2 * h)), DType.f32, params))
    shape = (as_expr(1), as_expr(h))
    half = [ShapeTracker(shape, (as_expr(0), as_expr(1)), as_expr(o), None) for o in (0, h)]
    if reader == "masked":
        half[1] = ShapeTracker(shape, (as_expr(0), as_expr(1)), as_expr(h), ((as_expr(0), as_expr(1)),
                                                                            (as_expr(0), as_expr(4))))
    expr = ["Mul", "f32", ["arg", 0], ["arg", 1]]
    if reader == "rows":
        expr = ["Mul", "f32", ["arg", 0], ["RowSum", "f32", ["arg", 1]]]
    ops.append(LOp(3, "elementwise", "Fused", (Arg(2, half[0]), Arg(2, half[1])), shape, DType.f32, {"expr": expr}))
    outs = [(3, shape)] + ([(2, ops[2].shape)] if reader == "two" else [])
    for j, (src, shp) in enumerate(outs):
        ops.append(LOp(len(ops), "output", "Output", (Arg(src, ShapeTracker.contiguous(shp)),), shp, DType.f32,
                       {"name": f"y{j}", "role": "output"}))
    return Program("p", ops)


def test_a_pair_reader_becomes_the_gemv_epilogue():
    prog = _gemv_then("pair")
    out = epilogue.fuse_gemv_epilogues(prog)
    assert [o.kind for o in out.ops] == ["input", "input", "gemm", "output"]
    g = out.ops[2]
    assert g.params["epilogue"] == ["Mul", "f32", ["acc", 0], ["acc", 1]] and g.params["acc_cols"] == [0, 8]
    assert g.dtype == DType.f32 and [str(d) for d in g.shape] == ["1", "8"]
    rng = np.random.default_rng(3)
    x, w = rng.uniform(0.5, 1.5, 16).astype(np.float32), rng.uniform(0.5, 1.5, 256).astype(np.float32)
    c = w.astype(np.float64).reshape(16, 16) @ x.astype(np.float64)
    got = execute(out, {"x": x, "w": w})["y0"].reshape(-1)
    assert np.allclose(got, c[:8] * c[8:], rtol=1e-6)
    assert np.array_equal(got, execute(prog, {"x": x, "w": w})["y0"].reshape(-1))


@pytest.mark.parametrize("reader", ["two", "masked", "rows"])
def test_gemvs_with_other_readers_stay(reader):
    prog = _gemv_then(reader)
    assert epilogue.fuse_gemv_epilogues(prog) is prog


def test_llir_validation_of_a_gemm_epilogue():
    data = epilogue.fuse_gemv_epilogues(_gemv_then("pair")).to_json()
    assert data["version"] == 3
    for key, bad, msg in (("epilogue", ["Mul", "f32", ["acc", 0], ["acc", 2]], "acc"),
                          ("acc_cols", [0, -8], "acc_cols"), ("epilogue_leaves", 5, "epilogue_leaves")):
        broken = {**data, "ops": [dict(o) for o in data["ops"]]}
        broken["ops"][2] = {**broken["ops"][2], "params": {**broken["ops"][2]["params"], key: bad}}
        with pytest.raises(ValueError, match=msg):
            Program.from_json(broken)
