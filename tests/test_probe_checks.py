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
    sets = [tuple(ffn._weights(rng, n, k) for n, k in ((48, 32), (48, 32), (32, 48))) for _ in range(2)]
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


def test_layer_probe_check_passes_float32_and_fails_a_wrong_or_nan_layer(probes, monkeypatch):
    """layer_probe.check at small shapes (its module's dimensions patched): each layer's two residual
    increments from the float32 forward pass; a wrong down output in one layer, a wrong attention in another
    (through x2), or a NaN fail it."""
    _, lp = probes
    for name, value in {"K": 32, "NQKV": 64, "Q": 32, "HD": 8, "HEADS": 4, "KV_HEADS": 2, "FF": 48}.items():
        monkeypatch.setattr(lp, name, value)
    rng = np.random.default_rng(2)
    keys, layers = 5, 4
    sets = [lp.dense(lp.weight_set(rng, keys)) for _ in range(lp.SETS)]
    assert sets[0]["qkv"].shape == (64, 32) and sets[0]["kc"].shape == (2, keys, 8)
    xs = [rng.standard_normal(32).astype(np.float32).astype(np.float64)]
    x2s = []
    for layer in range(layers):
        w = sets[layer % lp.SETS]
        first, _ = lp.layer_increments(xs[-1], xs[-1], w)
        x2s.append((xs[-1] + first).astype(np.float32).astype(np.float64))
        _, second = lp.layer_increments(xs[-1], x2s[-1], w)
        xs.append((x2s[-1] + second).astype(np.float32).astype(np.float64))
    xs, x2s = np.array(xs), np.array(x2s)
    err, finite = lp.check(xs, x2s, sets)
    assert finite and err < lp.TOLERANCE, err
    for arr, layer in ((xs, 3), (x2s, 1)):
        bad_xs, bad_x2s = xs.copy(), x2s.copy()
        (bad_xs if arr is xs else bad_x2s)[layer, 7] += 0.05
        assert lp.check(bad_xs, bad_x2s, sets)[0] > lp.TOLERANCE
    bad = xs.copy()
    bad[2, 0] = np.nan
    assert lp.check(bad, x2s, sets)[1] is False
