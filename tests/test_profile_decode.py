"""benchmarks/profile_decode.py's map from kernel names (what CUPTI reports) back to LLIR ops, on a
CPU-built package: the GPU part of the script only adds the measured times."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("lum.builder.nvrtc")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from profile_decode import critical_advance, kernel_ops  # noqa: E402

import lum.loader  # noqa: E402
from lum.builder.models import load_spec  # noqa: E402
from lum.builder.package_builder import build_package  # noqa: E402


@pytest.mark.parametrize("tails", ["0", "exclusive"])
def test_every_decode_kernel_maps_to_its_op(tmp_path, monkeypatch, tails):
    monkeypatch.setenv("LUM_KERNEL_TAILS", tails)
    spec = load_spec(random_name="tiny-gemma3", dtype="bf16", max_seq=32)
    pkg = lum.loader.open(build_package(spec, tmp_path / "m.lumpkg"))
    ops = kernel_ops(pkg, "decode", {"p": 7})
    launched = {lc.kernel for call in pkg.entry("decode").calls
                for k in pkg.manifest.groups[call.group].table.ops for lc in k.launches}
    assert launched and launched <= set(ops)
    for name in launched:
        info = ops[name]
        assert name.startswith(f"lum_{info['kind']}_"), (name, info)
        assert info["calls"] >= 1 and info["bytes"] > 0 and info["dtype"]
    gemvs = [i for i in ops.values() if i["kind"] == "gemm"]
    # the stacked q/k/v and gate/up weights read by one GEMV each, plus o, down, q·k, p·v, lm head
    assert gemvs and max(i["bytes"] for i in gemvs) >= spec.config.vocab_size * spec.config.hidden_size * 2
    # GEMVs computing their input (the norms) or their reader (gelu·up) are labelled as such
    labels = {i["op"] for i in gemvs}
    base = {x.split("+tail(")[0] for x in labels}
    assert {"Gemm", "Gemm+prologue"} <= base and any(x.endswith("+epilogue") for x in base), labels
    # a kernel whose last block runs the ops after it (builder/tail.py) names them
    assert ("Gemm+tail(Fused)" in labels) == (tails == "exclusive"), labels


def test_every_prefill_kernel_maps_to_its_op_flash_attention_included(tmp_path):
    """``--entry prefill``: the prompt's kernels, flash attention's among them (on by default)."""
    spec = load_spec(random_name="tiny-gemma3", dtype="bf16", max_seq=32)
    pkg = lum.loader.open(build_package(spec, tmp_path / "m.lumpkg"))
    ops = kernel_ops(pkg, "prefill", {"s": 9, "p": 0})
    launched = {lc.kernel for call in pkg.entry("prefill").calls
                for k in pkg.manifest.groups[call.group].table.ops for lc in k.launches}
    assert launched and launched <= set(ops)
    attention = [ops[n] for n in launched if ops[n]["kind"] == "attention"]
    assert attention and all(i["bytes"] > 0 for i in attention)
    assert {o["kind"] for o in ops.values()} >= {"attention", "reduce"}      # the partials and their combine


def test_critical_advance_charges_each_kernel_what_it_adds_to_the_timeline():
    """A kernel that starts early and ends 1 after the one before it adds 1, not its duration; one inside
    another's span adds 0; after an idle gap a kernel adds its own duration; the advances sum to the busy time."""
    spans = [("gemv", 0.0, 10.0), ("attn", 4.0, 13.0), ("hint", 5.0, 6.0), ("comb", 12.0, 14.5),
             ("gemv", 20.0, 30.0)]
    adv = critical_advance(spans)
    assert adv == {"gemv": 20.0, "attn": 3.0, "hint": 0.0, "comb": 1.5}
    assert sum(adv.values()) == 14.5 + 10.0
    assert critical_advance(list(reversed(spans))) == adv          # start order, not list order
