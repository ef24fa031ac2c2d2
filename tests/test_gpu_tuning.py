"""Measured search on the GPU (issue 5, deliverable 4): `lum build --budget` measures every group's
candidates with CUDA events, stores the results in the tuning DB, and a second build of the same
model hits the DB: ≥ 10× faster and byte-identical, and the package decodes like the reference."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

BUDGET = 8


@pytest.mark.serial
def test_measured_build_twice_hits_the_tuning_db(cuda_device, tmp_path, monkeypatch):
    import lum.loader
    from lum.builder import tuning as T
    from lum.builder.models import load_spec
    from lum.builder.package_builder import BuildOptions, build_package

    monkeypatch.setenv(T.ENV_CACHE_DIR, str(tmp_path / "cache"))
    assert T.gpu_unavailable_reason(cuda_device.sm) is None
    spec = load_spec(random_name="tiny-llama", dtype="f32", max_seq=64)
    # a fresh NVRTC cache: the first build compiles its candidates' kernels as on a fresh machine
    # (the second build then finds the chosen ones in that cache, as a rebuild would)
    opts = BuildOptions(target=cuda_device.sm, budget=BUDGET, nvrtc_cache=str(tmp_path / "nvrtc"))
    stages: list[tuple[str, int, int]] = []

    t0 = time.perf_counter()
    p1 = build_package(spec, tmp_path / "a.lumpkg", options=opts, progress=lambda *a: stages.append(a))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    p2 = build_package(spec, tmp_path / "b.lumpkg", options=opts)
    second = time.perf_counter() - t0

    assert any(s.startswith("tuning") and d == t and t > 0 for s, d, t in stages), stages[:20]
    records = [json.loads(p.read_text()) for p in (tmp_path / "cache" / "tuning").glob("*.json")]
    groups = [r for r in records if r.get("decisions") != ["gemm candidate"]]   # the rest: timed cuBLASLt algos
    assert len(groups) == 6, [r.get("decisions") for r in records]
    assert first >= 10 * second, f"first build {first:.2f} s, second (DB hit) {second:.2f} s: not >= 10x"
    assert p1.read_bytes() == p2.read_bytes(), "the DB-hit rebuild wrote different package bytes"

    pkg = lum.loader.open(p2)
    prov = pkg.manifest.provenance
    assert prov["extraction"] == "measured" and prov["gpu"] == cuda_device.name
    assert prov["driver"] == str(cuda_device.driver_version)
    log = json.loads(pkg.reader.section_bytes("tuning"))
    assert len(log["groups"]) == len(pkg.manifest.groups) == 6
    for g in log["groups"]:
        ok = [t for t in g["trials"] if t["time"] is not None]
        # math.prod: the space's size overflows int64 (np.prod wrapped a 2^64-sized space to 0)
        assert len(g["trials"]) == min(BUDGET, math.prod(len(d[1]) for d in g["decisions"]))
        assert ok and g["chosen_by"] == "measured", g["trials"]
        assert g["time"] == min(t["time"] for t in ok) and 0 < g["time"] < 1.0
    print(f"first build {first:.2f} s, second {second:.2f} s ({first / second:.1f}x); trials per group "
          f"{[len(g['trials']) for g in log['groups']]}, rejected "
          f"{[sum(t['time'] is None for t in g['trials']) for g in log['groups']]}")

    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, spec.config.vocab_size, 12)]
    want = pkg.session(backend="reference").generate(prompt, 16)
    with pkg.session(backend="cuda") as sess:
        got = sess.generate(prompt, 16)
    assert got == want, f"cuda {got} vs reference {want}"


def test_timer_rejects_a_wrong_candidate_and_times_with_events(cuda_device, tmp_path, monkeypatch):
    """One group through GpuTimer directly: the cost-model genome times > 0 with CUDA events; the
    same candidate whose check is poisoned by a wrong reference is rejected, never timed."""
    from lum.builder import tuning as T
    from lum.builder.egraph import saturate
    from lum.builder.extract import choice_to_genome, choose_by_cost, decision_points
    from lum.builder.models import load_spec
    from lum.builder.search import CandidateRejected, Decision, SearchSpace

    spec = load_spec(random_name="tiny-llama", dtype="f32", max_seq=64)
    info = next(i for i in T.model_groups(spec).values() if len(i.graph) > 50 and i.entry == "prefill")
    sat = saturate(info.graph)
    space = SearchSpace([Decision(n, l) for n, l in decision_points(sat)]
                        + [Decision(f"tune:{k}", tuple(map(str, v))) for k, v in T.TUNING_DECISIONS])
    setup = T.TimerSetup(info, sat, space, T.TUNING_DECISIONS, {"s": 64}, {"s": 64}, 64, cuda_device.sm,
                         nvrtc_cache=str(tmp_path / "nvrtc"), repeats=5, warmup=2)
    timer = T.GpuTimer(setup)
    try:
        genome = choice_to_genome(sat, choose_by_cost(sat)) + (0,) * len(T.TUNING_DECISIONS)
        t = timer(genome)
        assert 0 < t < 0.1
        monkeypatch.setattr(T, "tolerance", lambda program: -1.0)    # nothing can pass now
        with pytest.raises(CandidateRejected, match="relative error"):
            timer(genome)
    finally:
        timer.close()
