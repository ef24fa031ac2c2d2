"""benchmarks/profile_decode.py's map from kernel names (what CUPTI reports) back to LLIR ops, on a
CPU-built package: the GPU part of the script only adds the measured times."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("lum.builder.nvrtc")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from profile_decode import critical_advance, idle_gaps, kernel_ops  # noqa: E402

import lum.loader  # noqa: E402
from lum.builder.models import load_spec  # noqa: E402
from lum.builder.package_builder import build_package  # noqa: E402


def test_every_decode_kernel_maps_to_its_op(tmp_path):
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
    assert "Gemm" in labels and any("+prologue" in x for x in labels), labels
    assert any(x.endswith("+epilogue") for x in labels), labels
    # a kernel that runs other ops too (decode attention with its stage: builder/fused.py) names them
    assert any("+tail(" in i["op"] and "Attention" in i["op"] for i in ops.values()), ops


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


def test_idle_gaps_sum_the_time_nothing_runs_by_the_pair_around_it():
    """A gap is charged to the span that ended last and the one that starts after it; a span inside
    another's leaves no gap; the gaps sum to the timeline less its busy time; largest first."""
    spans = [("gemv", 0.0, 10.0), ("hint", 2.0, 3.0), ("copy", 12.0, 13.0), ("gemv", 16.0, 20.0),
             ("copy", 22.0, 23.0), ("gemv", 26.5, 30.0)]
    gaps = idle_gaps(spans)
    assert gaps == [{"after": "copy", "before": "gemv", "us": 6.5, "count": 2},
                    {"after": "gemv", "before": "copy", "us": 4.0, "count": 2}]
    assert sum(g["us"] for g in gaps) == 30.0 - sum(critical_advance(spans).values())


def test_a_stamped_build_keeps_the_plain_kernels_and_the_timeline_orders_them(tmp_path, monkeypatch):
    """``$LUM_STAMPS=1`` (``profile_decode.py --stamps``): the package's modules define ``lum_stamps`` and stamp
    each kernel's start and wait (two calls of the stamp, which reads ``%globaltimer``, an entry, PTX; decode
    attention five marks more, LUM_STAMP_AT), and nothing else changes: the launch tables (kernel names, grids, tuning) are the plain
    build's, and a module built without it has no stamp.
    :func:`stamp_timeline` maps the records back to kernel names, in start order, times from the earliest."""
    import numpy as np

    from profile_decode import stamp_timeline

    from lum.builder.codegen import STAMP_BLOCKS, STAMP_FIELDS, stamp_tag

    spec = load_spec(random_name="tiny-llama", dtype="bf16", max_seq=32)
    monkeypatch.delenv("LUM_STAMPS", raising=False)
    plain = lum.loader.open(build_package(spec, tmp_path / "plain.lumpkg"))
    monkeypatch.setenv("LUM_STAMPS", "1")
    stamped = lum.loader.open(build_package(spec, tmp_path / "stamped.lumpkg"))

    def tables(pkg):
        return [[(k.name, [(lc.kernel, lc.grid, lc.block) for lc in k.launches], k.tuning) for k in g.table.ops]
                for g in pkg.manifest.groups if g.table is not None]

    assert tables(plain) == tables(stamped)
    # the package says it is a probe build (lum inspect prints its provenance)
    assert "LUM_STAMPS=1" in stamped.manifest.provenance["switches"]
    assert "LUM_STAMPS" not in plain.manifest.provenance.get("switches", "")

    def ptx(pkg):
        return [pkg.reader.section_bytes(g.table.ptx).decode() for g in pkg.manifest.groups
                if g.table is not None and g.table.ptx]

    plain_ptx, stamped_ptx = ptx(plain), ptx(stamped)
    assert plain_ptx and not any("globaltimer" in p or "lum_stamps" in p for p in plain_ptx)
    for p in stamped_ptx:
        entries = p.count(".entry lum_")
        calls = re.findall(r"call\.uni\s+\w*lum_stamp\w*,", p)        # the stamp is a call (not inlined)
        assert "lum_stamps" in p and "%globaltimer" in p and len(calls) >= 2 * entries > 0, (len(calls), entries)

    # two modules' records: kernel B starts 1 µs after A, waits 3 µs in; A never stamped its wait
    names = {stamp_tag(n): n for n in ("lum_a", "lum_b")}
    a = np.zeros(2 * STAMP_BLOCKS * STAMP_FIELDS, np.uint64)
    a[:STAMP_FIELDS] = [stamp_tag("lum_a"), 0, 5, 1_000_000, 0, 0, 0, 0, 0, 0]
    a[STAMP_FIELDS:2 * STAMP_FIELDS] = [stamp_tag("lum_a"), 4, 6, 1_000_500, 0, 0, 0, 0, 0, 0]
    b = np.zeros(STAMP_BLOCKS * STAMP_FIELDS, np.uint64)
    b[:STAMP_FIELDS] = [stamp_tag("lum_b"), 0, 7, 1_001_000, 1_003_000, 0, 1_004_250, 0, 0, 0]   # B's own mark 3
    rows = stamp_timeline([b, a], names)
    assert "marks_us" not in rows[0] and rows[1]["marks_us"] == [None, [4.25, 4.25, 4.25], None, None, None]
    assert [r["kernel"] for r in rows] == ["lum_a", "lum_b"]
    assert rows[0]["start_us"] == [0.0, 0.5, 0.5] and rows[0]["waited_us"] is None and rows[0]["sms"] == 2
    assert rows[1]["start_us"] == [1.0, 1.0, 1.0] and rows[1]["waited_us"] == [3.0, 3.0, 3.0]
    assert rows[0]["link_us"] is None and rows[1]["link_us"] is None       # no wait / the chain's last
    c = np.zeros(STAMP_BLOCKS * STAMP_FIELDS, np.uint64)                   # a kernel waiting 2.5 µs after B's wait
    names[stamp_tag("lum_c")] = "lum_c"
    c[:STAMP_FIELDS] = [stamp_tag("lum_c"), 0, 8, 1_000_200, 1_005_500, 0, 0, 0, 0, 0]
    rows = stamp_timeline([b, a, c], names)
    assert [(r["kernel"], r["link_us"]) for r in rows] == [("lum_a", None), ("lum_c", None), ("lum_b", 2.5)]
    assert stamp_timeline([np.zeros(STAMP_FIELDS, np.uint64)], names) == []


def test_stamp_blocks_says_which_blocks_trail_over_the_steps():
    """:func:`stamp_blocks` (``--stamp-steps``): a row a (module, block) of the kernels with marks, its phases
    as medians over the steps from the module's first wait, how far it trails the first block to finish, and in
    how many steps it finished last; kernels without marks, and blocks that never waited, have no row."""
    import numpy as np

    from profile_decode import stamp_blocks

    from lum.builder.codegen import STAMP_FIELDS, stamp_tag

    att, gemv = stamp_tag("lum_att"), stamp_tag("lum_gemv")
    names = {att: "lum_att", gemv: "lum_gemv"}

    def module(recs):
        arr = np.zeros(len(recs) * STAMP_FIELDS, np.uint64)
        for i, r in enumerate(recs):
            arr[i * STAMP_FIELDS:(i + 1) * STAMP_FIELDS] = r
        return arr

    us = 1_000
    steps = []
    for s, slow in enumerate((3, 4, 3)):           # block 2 trails by 2, 3 and 2 µs; block 0 waits 0.5 µs late
        t = 10_000_000 * (s + 1)
        steps.append([module([
            [att, 0, 10, t, t + 1_500, t + 2_500, t + 3_500, t + 4 * us, 0, 0],
            [att, 2, 11, t, t + 1_000, t + 2 * us, t + 3 * us, t + (4 + slow - 2) * us, 0, 0],
            [att, 5, 12 + s, t, t + 1_000, t + 2 * us, t + 3 * us, t + 4 * us, 0, 0],
            [gemv, 0, 1, t, t + 9 * us, 0, 0, 0, 0, 0],          # no marks: no row
            [att, 7, 13, t, 0, 0, 0, 0, 0, 0]]),                  # never waited: no row
            module([[att, 1, 20, t, t + 2 * us, t + 3 * us, 0, 0, 0, 0]])])   # a second module: its own layer
    rows = stamp_blocks(steps, names)
    assert list(rows) == ["lum_att"]
    by = {(r["module"], r["block"]): r for r in rows["lum_att"]}
    assert sorted(by) == [(0, 0), (0, 2), (0, 5), (1, 1)]
    assert by[(0, 2)]["behind_us"] == 1.0 and by[(0, 2)]["last"] == 3          # 1, 2, 1 µs: median 1
    assert by[(0, 0)]["behind_us"] == 0.0 and by[(0, 0)]["waited_us"] == 0.5
    assert by[(0, 0)]["marks_us"] == [1.5, 2.5, 3.0, None, None]
    assert by[(0, 5)]["sms"] == [12, 13, 14] and by[(0, 5)]["last"] == 0
    assert by[(1, 1)]["marks_us"] == [1.0, None, None, None, None] and by[(1, 1)]["behind_us"] == 0.0
