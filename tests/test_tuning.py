"""Measured search and the tuning database (lum.builder.tuning) without a GPU: a fake timer (or the
timer's own path on the numpy reference backend) stands in for the CUDA runtime."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lum.builder import tuning as T
from lum.builder.package_builder import BuildOptions, build_package
from lum.builder.search import CandidateRejected
from lum.format.dtypes import DType

FAKE = T.DeviceIdentity("Fake GPU", "13000", "sm_90")
MAX_SEQ = 32


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv(T.ENV_CACHE_DIR, str(d))
    return d


@pytest.fixture(scope="module")
def spec():
    from lum.builder.models import load_spec

    return load_spec(random_name="tiny-llama", max_seq=MAX_SEQ)


@pytest.fixture(scope="module")
def groups(spec) -> int:
    """tiny-llama's groups by the partitioner, prefill's and decode's (6; 7 with the decode input norms ahead)."""
    from lum.builder.partition import group_chunks

    return sum(len(group_chunks(g)) for g in spec.graphs.values())


class FakeTimer:
    """Deterministic times from the genome; genomes whose last gene is 3 are rejected."""

    calls: list = []

    def __init__(self, setup):
        self.setup = setup
        self.closed = False

    def __call__(self, genome):
        FakeTimer.calls.append((self.setup.info.hash, tuple(genome)))
        if genome and genome[-1] == 3:
            raise CandidateRejected("fake: wrong result")
        return 1e-3 * (1 + sum((i + 1) * x for i, x in enumerate(genome)))

    def close(self):
        self.closed = True


def _build(spec, out, budget=6, factory=FakeTimer, **kw):
    opts = BuildOptions(budget=budget)
    comp = T.measured_compiler(spec, opts, None, timer_factory=factory, device=FAKE, **kw)
    path = build_package(spec, out, comp, opts)
    return comp, path


def test_the_db_key_follows_each_codegen_switch(spec, monkeypatch):
    """A search measured under one codegen is not reused under another: each switch that changes kernels is in
    the key, and the off-by-default ones only when on (so turning one on does not orphan the default's
    records)."""
    comp = T.measured_compiler(spec, BuildOptions(budget=2), None, timer_factory=FakeTimer, device=FAKE)
    base = comp.key_options({"p": 3})
    assert base["gemv_preload_after_gemv"] == 4                      # the default since 51edf84
    assert base["gemv_preload_shared"] == "after_small"              # the default since 2026-12-04
    for env, raw, key, value in (("LUM_ATTENTION_CHUNK", "32", "attention_chunk", 32),
                                 ("LUM_GEMV_TUNING", "3.inflight=4", "gemv_tuning", {"3": {"inflight": 4}}),
                                 ("LUM_GEMV_PRELOAD_SHARED", "all", "gemv_preload_shared", "all")):
        monkeypatch.setenv(env, raw)
        assert comp.key_options({"p": 3}) == {**base, key: value}
        monkeypatch.delenv(env)
    monkeypatch.setenv("LUM_GEMV_PRELOAD_SHARED", "0")               # off: named by its absence
    assert comp.key_options({"p": 3}) == {k: v for k, v in base.items() if k != "gemv_preload_shared"}
    monkeypatch.delenv("LUM_GEMV_PRELOAD_SHARED")
    monkeypatch.setenv("LUM_GEMV_EVICT_FIRST", "1")                  # a switch at its default: the same key
    assert comp.key_options({"p": 3}) == base
    monkeypatch.setenv("LUM_GEMV_EVICT_FIRST", "0")                  # ... set the other way: named
    monkeypatch.setenv("LUM_ATTENTION_STAGE", "0")
    assert comp.key_options({"p": 3}) == {**base, "switches": {"LUM_GEMV_EVICT_FIRST": False,
                                                               "LUM_ATTENTION_STAGE": False}}
    monkeypatch.delenv("LUM_GEMV_EVICT_FIRST")
    monkeypatch.delenv("LUM_ATTENTION_STAGE")
    monkeypatch.setenv("LUM_GEMV_PRELOAD_AFTER_GEMV", "0")
    assert "gemv_preload_after_gemv" not in comp.key_options({"p": 3})


# ---------------------------------------------------------------- database
def test_cache_dir_follows_env(cache):
    assert T.cache_dir() == cache
    assert T.TuningDB().root == cache / "tuning"


def test_db_miss_put_hit_and_atomic(cache):
    db = T.TuningDB()
    key = db.key("g" * 64, "Fake GPU", "13000", "0.1.0", {"dtype": "f32"})
    assert db.get(key) is None
    rec = {"genome": [1, 0], "decisions": [["a", ["x", "y"]], ["b", ["x"]]], "trials": [], "time": 1e-3, "budget": 4}
    db.put(key, rec)
    got = db.get(key)
    assert got["genome"] == [1, 0] and got["key"] == key and got["version"] == T.DB_VERSION
    assert [p.name for p in db.root.iterdir()] == [f"{key}.json"]     # no temp file left behind


def test_db_key_separates_every_field():
    base = dict(group_hash="a" * 64, gpu="H200", driver="13000", lum_version="0.1.0", options={"dtype": "f32"})
    keys = {T.TuningDB.key(**base)}
    for field, other in (("group_hash", "b" * 64), ("gpu", "H100"), ("driver", "12080"), ("lum_version", "0.2.0"),
                         ("options", {"dtype": "bf16"})):
        keys.add(T.TuningDB.key(**{**base, field: other}))
    assert len(keys) == 6
    assert T.TuningDB.key(**base) == T.TuningDB.key(**base)


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[]", b'{"version": 1}',
                                     b'{"version": 1, "key": "other", "genome": [0]}'])
def test_db_corrupt_record_is_ignored_with_a_warning(cache, content):
    db = T.TuningDB()
    key = db.key("c" * 64, "g", "d")
    db.root.mkdir(parents=True)
    db.path(key).write_bytes(content)
    with pytest.warns(UserWarning, match="corrupt tuning record"):
        assert db.get(key) is None


# ---------------------------------------------------------------- inputs and checks
def test_random_arrays_are_seeded_and_never_zero():
    a = T.random_array("w", (1000,), DType.f32)
    assert np.array_equal(a, T.random_array("w", (1000,), DType.f32))
    assert not np.array_equal(a, T.random_array("v", (1000,), DType.f32))
    assert (np.abs(a) >= 0.5).all() and (np.abs(a) < 1.5).all() and (a < 0).any() and (a > 0).any()
    b = T.random_array("w", (64,), DType.bf16)
    assert b.dtype == DType.bf16.np and (np.abs(b.astype(np.float32)) >= 0.5).all()
    i = T.random_array("rows", (20,), DType.i64, int_range=(0, 19), distinct=True)
    assert sorted(i.tolist()) == list(range(20))


def test_compare_outputs_rejects_nan_and_error():
    want = {"y": np.ones(8, np.float32)}
    assert T.compare_outputs({"y": np.ones(8, np.float32) * (1 + 1e-6)}, want, 1e-4) is None
    assert "relative error" in T.compare_outputs({"y": np.ones(8, np.float32) * 1.01}, want, 1e-4)
    bad = np.ones(8, np.float32)
    bad[3] = np.nan
    assert "NaN" in T.compare_outputs({"y": bad}, want, 1e-4)
    assert "NaN" in T.compare_outputs({"y": bad}, {"y": bad.copy()}, 1e-4)     # NaN never passes
    assert "missing" in T.compare_outputs({}, want, 1e-4)
    assert "integer" in T.compare_outputs({"i": np.arange(4)}, {"i": np.arange(4)[::-1]}, 1e-4)


def test_compare_outputs_chunk_by_chunk_is_the_max_norm_error_of_the_whole(monkeypatch):
    """Large outputs (an embedding table a group passes through) are compared a chunk at a time: the error is
    still the largest difference over the largest reference value, wherever each falls; NaN in any chunk fails."""
    import ml_dtypes

    monkeypatch.setattr(T, "COMPARE_CHUNK", 4)
    want = np.full(10, 0.01, np.float32)
    want[1] = 100.0                                  # the scale, in the first chunk
    got = want.copy()
    got[9] += 1.5                                    # the difference, in the last (partial) chunk: 1.5e-2
    assert T.compare_outputs({"y": got}, {"y": want}, 2e-2) is None
    assert "relative error 0.015" in T.compare_outputs({"y": got}, {"y": want}, 1e-2)
    bf = want.astype(ml_dtypes.bfloat16)
    assert T.compare_outputs({"y": bf.copy()}, {"y": bf}, 1e-4) is None
    bad = bf.copy()
    bad[6] = np.nan
    assert "1 NaN/inf" in T.compare_outputs({"y": bad}, {"y": bf}, 1e-4)


def test_group_inputs_are_valid_for_every_tiny_llama_group(spec, groups):
    """Real positions from the entry graph (distinct cache rows, no fully masked row), tokens in the
    vocabulary, and a finite reference result for every group at the timing and check maps."""
    from lum.builder.egraph import saturate
    from lum.builder.extract import choose_by_cost, lower
    from lum.loader.reference_backend import execute

    infos = T.model_groups(spec)
    assert len(infos) == groups >= 6
    for info in infos.values():
        prog = lower(saturate(info.graph), choose_by_cost(saturate(info.graph)), name=info.graph.name)
        maker = T.InputMaker(info)
        for dyn in ({"s": MAX_SEQ, "p": MAX_SEQ // 2}, {"s": 5, "p": 7}):
            dyn = {k: v for k, v in dyn.items() if k in info.graph.dyn_vars}
            ins = maker.inputs(dyn)
            if "tokens" in ins:
                assert ins["tokens"].min() >= 0 and ins["tokens"].max() < spec.config.vocab_size
            for name, arr in ins.items():
                if arr.dtype.kind == "f":
                    assert (arr != 0).all(), name
            if "ext3" in ins:       # positions: arange(s) in prefill; decode slices its table of max_seq indices
                want = np.arange(dyn["s"]) if "s" in dyn else np.arange(spec.max_seq)
                assert ins["ext3"].tolist() == want.tolist()
            out = execute(prog, ins, dyn)
            assert all(np.isfinite(v.astype(np.float64)).all() for v in out.values()), (info.entry, dyn)


# ---------------------------------------------------------------- the measured compiler
def test_search_is_seeded_with_the_cost_model_choice(spec, groups, cache, tmp_path):
    from lum.builder.costmodel import op_cost
    from lum.builder.egraph import saturate
    from lum.builder.extract import choice_to_genome, choose_by_cost
    from lum.builder.package_builder import typical_dyn

    FakeTimer.calls = []
    comp, _ = _build(spec, tmp_path / "a.lumpkg")
    dyn = typical_dyn(spec)
    from lum.builder.attention_policy import flash_attention
    from lum.builder.gemv_policy import gemv_kernel_ops
    from lum.builder.extract import lower

    firsts, flash_groups, split_k_groups = {}, 0, 0
    for h, g in FakeTimer.calls:
        firsts.setdefault(h, g)
    assert len(firsts) == groups
    per_gemv = 0
    for info in T.model_groups(spec).values():
        sat = saturate(info.graph)
        choice = choose_by_cost(sat, lambda op: op_cost(op, dyn))
        # the group-wide template decisions, then the per-GEMV ones of the cost model's program
        program = lower(sat, choice)
        n_gemv = len(gemv_kernel_ops(program))
        per_gemv += n_gemv
        flash = any(o.kind == "attention" and flash_attention(o) for o in program.ops)     # prefill's attention
        split_k = any(o.kind == "attention" and not flash_attention(o) for o in program.ops)   # decode's
        flash_groups += flash
        split_k_groups += split_k
        n_tune = (len(T.TUNING_DECISIONS) + len(T.FLASH_TUNING_DECISIONS) * flash
                  + len(T.ATTENTION_TUNING_DECISIONS) * split_k + len(T.GEMV_TUNING_DECISIONS) * n_gemv)
        assert firsts[info.hash] == choice_to_genome(sat, choice) + (0,) * n_tune
    # decode groups have GEMVs to tune per shape and their attention's split, prefill flash tiles
    assert per_gemv > 0 and flash_groups > 0 and split_k_groups > 0
    for rec in comp.records:
        assert rec["seed_genome"] == list(firsts[rec["group"]])
        assert rec["trials"][0]["genome"] == rec["seed_genome"]
        assert len(rec["trials"]) == 6 and rec["chosen_by"] == "measured"
        ok = [t for t in rec["trials"] if t["time"] is not None]
        assert rec["time"] == min(t["time"] for t in ok)
        assert all(t["reason"] == "fake: wrong result" for t in rec["trials"] if t["time"] is None)


def test_second_build_hits_the_db_without_timing_and_writes_the_same_bytes(spec, groups, cache, tmp_path):
    import lum.loader

    FakeTimer.calls = []
    c1, p1 = _build(spec, tmp_path / "a.lumpkg")
    n = len(FakeTimer.calls)
    assert n == groups * 6 and c1.stats["misses"] == groups and c1.stats["hits"] == 0     # a budget of 6
    assert len(list((cache / "tuning").glob("*.json"))) == groups

    def no_timer(setup):
        raise AssertionError("the second build must not measure")

    c2, p2 = _build(spec, tmp_path / "b.lumpkg", factory=no_timer)
    assert len(FakeTimer.calls) == n and c2.stats["hits"] == groups and c2.stats["misses"] == 0
    assert p1.read_bytes() == p2.read_bytes()

    pkg = lum.loader.open(p2)
    prov = pkg.manifest.provenance
    assert prov["extraction"] == "measured" and prov["gpu"] == "Fake GPU" and prov["driver"] == "13000"
    log = json.loads(pkg.reader.section_bytes("tuning"))
    assert [g["index"] for g in log["groups"]] == list(range(groups))
    assert all(len(g["trials"]) == 6 and "genome_hash" in g["trials"][0] for g in log["groups"])
    # the chosen template parameters are the ones the kernels were built with
    for k, g in enumerate(log["groups"]):
        table = pkg.manifest.groups[k].table
        for op in (table.ops if table is not None else ()):
            for key, val in g["tuning"].items():
                if key in op.tuning and key == "threads":
                    assert op.tuning[key] == val


def test_budget_increase_or_stale_record_measures_again(spec, groups, cache, tmp_path):
    FakeTimer.calls = []
    _build(spec, tmp_path / "a.lumpkg", budget=2)
    c, _ = _build(spec, tmp_path / "b.lumpkg", budget=4)           # bigger budget: search again
    assert c.stats["misses"] == groups
    c, _ = _build(spec, tmp_path / "c.lumpkg", budget=3)           # smaller budget: the record serves
    assert c.stats["hits"] == groups
    f = sorted((cache / "tuning").glob("*.json"))[0]
    rec = json.loads(f.read_text())
    rec["decisions"] = rec["decisions"] + [["new", ["a", "b"]]]
    rec["genome"] = rec["genome"] + [0]
    f.write_text(json.dumps(rec))
    with pytest.warns(UserWarning, match="no longer match"):
        c, _ = _build(spec, tmp_path / "d.lumpkg", budget=3)
    assert c.stats["misses"] == 1 and c.stats["hits"] == groups - 1


def test_corrupt_record_is_measured_again(spec, groups, cache, tmp_path):
    _build(spec, tmp_path / "a.lumpkg", budget=2)
    f = sorted((cache / "tuning").glob("*.json"))[0]
    f.write_bytes(b"\0garbage")
    with pytest.warns(UserWarning, match="corrupt"):
        c, _ = _build(spec, tmp_path / "b.lumpkg", budget=2)
    assert c.stats["misses"] == 1 and c.stats["hits"] == groups - 1
    assert json.loads(f.read_text())["genome"]        # rewritten


def test_every_candidate_rejected_falls_back_to_the_cost_model(spec, cache, tmp_path):
    def rejecting(setup):
        def timer(genome):
            raise CandidateRejected("fake: NaN")
        return timer

    with pytest.warns(UserWarning, match="every candidate"):
        c, p = _build(spec, tmp_path / "a.lumpkg", budget=2, factory=rejecting)
    assert all(r["genome"] == r["seed_genome"] and r["time"] is None for r in c.records)


def test_timer_path_on_the_reference_backend(spec, groups, cache, tmp_path, monkeypatch):
    """GpuTimer's own path (lower, NVRTC, one-program package, session, poison, check, time) with the
    numpy backend standing in for CUDA; the package it picks decodes like the cost model's. The check compares
    every output a kernel computes, not the embedding table the first group passes through to the LM head."""
    import lum.loader

    compared = []
    real_compare = T.compare_outputs
    monkeypatch.setattr(T, "compare_outputs", lambda got, want, tol: compared.append(set(want)) or
                        real_compare(got, want, tol))
    c, p = _build(spec, tmp_path / "m.lumpkg", budget=2,
                  factory=lambda s: T.GpuTimer(s, backend="reference"), repeats=1, warmup=0)
    assert c.stats["timer_calls"] == 2 * groups                    # a budget of 2
    assert all(r["chosen_by"] == "measured" for r in c.records), [r["trials"] for r in c.records]
    for r in c.records:         # where each group's search spent its time, every phase of GpuTimer's path
        phases = r["seconds_by_phase"]
        assert set(phases) == set(T.TIMER_PHASES) and all(v >= 0 for v in phases.values()), phases
        assert phases["compile"] > 0 and phases["check"] > 0 and phases["time"] > 0, phases
        assert sum(phases.values()) <= c.stats["seconds_measuring"]
    names = set().union(*compared)
    assert {"logits", "next_token", "k_cache.0", "out1"} <= names and "out0" not in names, names
    ref = build_package(spec, tmp_path / "ref.lumpkg")
    want = lum.loader.open(ref).session(backend="reference").generate([1, 5, 9], 4)
    assert lum.loader.open(p).session(backend="reference").generate([1, 5, 9], 4) == want


def test_build_package_without_gpu_uses_the_cost_model(spec, tmp_path, monkeypatch):
    import lum.loader

    monkeypatch.setattr(T, "gpu_unavailable_reason", lambda target=None: "no usable GPU (test)")
    with pytest.warns(UserWarning, match="measured search skipped"):
        p = build_package(spec, tmp_path / "a.lumpkg", options=BuildOptions(budget=4))
    pkg = lum.loader.open(p)
    assert pkg.manifest.provenance["extraction"] == "cost-model" and "tuning" not in pkg.reader


def test_cli_budget_without_gpu_prints_one_note(tmp_path, monkeypatch, capsys):
    from lum.loader.cli import main

    monkeypatch.setattr(T, "gpu_unavailable_reason", lambda target=None: "no usable GPU (test)")
    with pytest.raises(SystemExit) as info:
        main(["build", "--random", "tiny-llama", "--max-seq", "16", "--budget", "4", "-o", str(tmp_path / "t.lumpkg")])
    err = capsys.readouterr().err
    assert (info.value.code or 0) == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert notes == ["note: --budget ignored: no usable GPU (test); extracting with the cost model"]


# ---------------------------------------------------------------- per-GEMV template decisions
def favouring(key: str, value):
    """A fake timer class faster by half where the tuning sets ``key`` to ``value`` (a little slower for every
    other gene off its default), so the search's choice of that one parameter is visible in the package."""

    class Favouring(FakeTimer):
        def __call__(self, genome):
            FakeTimer.calls.append((self.setup.info.hash, tuple(genome)))
            _, tuning = self.setup.decode(genome)
            return (1e-3 if tuning.get(key) == value else 2e-3) + 1e-6 * sum(1 for g in genome if g)

    return Favouring


def test_the_search_picks_threads_per_gemv_and_the_package_has_them(spec, cache, tmp_path):
    import lum.loader
    from lum.builder.gemv_policy import gemv_kernel_ops

    comp, path = _build(spec, tmp_path / "g.lumpkg", budget=64, factory=favouring("gemv0.threads", 128))
    tuned = [rec for rec in comp.records if any(name.startswith("tune:gemv0.") for name, _ in rec["decisions"])]
    assert tuned
    with lum.loader.open(path) as pkg:
        for rec in tuned:
            assert rec["tuning"].get("gemv0.threads") == 128, rec["tuning"]
            k = next(i for i, ref in enumerate(pkg.manifest.groups) if ref.hash == rec["group"])
            gemvs = gemv_kernel_ops(pkg.programs[k])
            blocks = {kop.op: kop.launches[0].block[0] for kop in pkg.manifest.groups[k].table.ops}
            assert blocks[gemvs[0].id] == 128                       # the first GEMV: the chosen block size
            for i, g in enumerate(gemvs[1:], 1):                    # the others: their own choice or default
                want = rec["tuning"].get(f"gemv{i}.threads", rec["tuning"].get("threads"))
                assert want is None or blocks[g.id] == want


def test_the_search_picks_flash_attention_tiles_and_the_package_has_them(spec, cache, tmp_path):
    """Prefill's groups with flash attention search its key tile; decode's (split-K attention) do not."""
    import lum.loader

    comp, path = _build(spec, tmp_path / "f.lumpkg", budget=24, factory=favouring("tile_keys", 32))
    flash = [rec for rec in comp.records if any(name == "tune:tile_keys" for name, _ in rec["decisions"])]
    assert flash and all(rec["tuning"].get("tile_keys") == 32 for rec in flash), [r["tuning"] for r in flash]
    with lum.loader.open(path) as pkg:
        tiles = {}
        for k, ref in enumerate(pkg.manifest.groups):
            for o in ref.table.ops:
                if o.kind == "attention":
                    tiles.setdefault(ref.hash in {r["group"] for r in flash}, set()).add(o.tuning.get("tile_keys"))
    assert tiles[True] == {32}                      # the chosen tile, in the package's launch table
    assert tiles.get(False, {None}) == {None}       # decode's attention kernel has no key tile


def test_the_search_picks_decode_attentions_split_and_the_package_has_it(spec, cache, tmp_path):
    """Decode's groups (split-K attention) search its chunk, prefill's (flash attention) do not; the chosen
    chunk is lowered into the package's LLIR (the attention op's ``chunk`` and the partials' chunk axis), no
    kernel's tuning carries it, and the package decodes the default package's greedy tokens (reference backend)."""
    import lum.loader
    from lum.builder.extract import ATTENTION_CHUNK

    comp, path = _build(spec, tmp_path / "c.lumpkg", budget=64, factory=favouring("attention_chunk", 32))
    split = [rec for rec in comp.records if any(name == "tune:attention_chunk" for name, _ in rec["decisions"])]
    assert split and all(rec["tuning"].get("attention_chunk") == 32 for rec in split), [r["tuning"] for r in split]
    assert all(rec["entry"] == "decode" for rec in split)
    with lum.loader.open(path) as pkg:
        chunks = {}
        for k, ref in enumerate(pkg.manifest.groups):
            for o in pkg.programs[k].ops:
                if o.kind == "attention":
                    chunks.setdefault(ref.hash in {r["group"] for r in split}, set()).add(o.params["chunk"])
            assert all("attention_chunk" not in o.tuning for o in ref.table.ops)     # lowering's, not codegen's
        assert chunks[True] == {32} and ATTENTION_CHUNK not in chunks.get(False, set())
        want = pkg.session(backend="reference").generate([1, 5, 9], 6)
        assert want == lum.loader.open(build_package(spec, tmp_path / "d.lumpkg")).session(
            backend="reference").generate([1, 5, 9], 6)


def test_generate_program_applies_gemv_keys_by_rank():
    from lum.builder.codegen import generate_program
    from lum.builder.gemv_policy import gemv_kernel_ops, split_gemv_tuning
    from lum.builder.compile import compile_group
    from tests.test_prologue import _groups

    assert split_gemv_tuning({"threads": 256, "gemv2.group": 64, "gemv0.threads": 128}) == (
        {"threads": 256}, {2: {"group": 64}, 0: {"threads": 128}})
    prog = next(p for p in (compile_group(cg)[0] for cg in _groups("tiny-llama", "decode"))
                if len(gemv_kernel_ops(p)) >= 2)
    gemvs = gemv_kernel_ops(prog)
    base = generate_program(prog, sorted(prog.dyn_vars()))
    got = generate_program(prog, sorted(prog.dyn_vars()), **{"gemv1.threads": 128, "gemv1.group": 32})
    assert got[gemvs[1].id].block[0] == 128 and got[gemvs[1].id].tuning["group"] == 32
    for o in prog.ops:                               # every other kernel is what the defaults give
        if o.id != gemvs[1].id and base[o.id] is not None:
            assert got[o.id].name == base[o.id].name


# ---------------------------------------------------------------- what the search measures, and in which order
def test_tune_entries_measure_only_those_groups(spec, cache, tmp_path):
    """``BuildOptions.tune_entries``: decode's groups are measured and recorded; prefill's take the cost
    model's program with nothing timed, and the package still decodes like the cost model's."""
    import lum.loader

    FakeTimer.calls = []
    opts = BuildOptions(budget=4, tune_entries=("decode",))
    comp = T.measured_compiler(spec, opts, None, timer_factory=FakeTimer, device=FAKE)
    path = build_package(spec, tmp_path / "d.lumpkg", comp, opts)
    entries = {i.hash: i.entry for i in T.model_groups(spec).values()}
    assert {entries[h] for h, _ in FakeTimer.calls} == {"decode"}
    assert comp.records and {r["entry"] for r in comp.records} == {"decode"}
    want = lum.loader.open(build_package(spec, tmp_path / "ref.lumpkg")).session(backend="reference").generate([1, 5], 3)
    assert lum.loader.open(path).session(backend="reference").generate([1, 5], 3) == want


def test_sweep_times_block_sizes_and_splits_first():
    tuned = [("threads", ()), ("ept", ()), ("unroll", ()), ("gemv0.threads", ()), ("gemv0.preload", ()),
             ("gemv0.group", ()), ("gemv1.threads", ()), ("gemv1.inflight", ()), ("gemv1.group", ())]
    names = [tuned[i - 10][0] for i in T.sweep_order(tuned, 10)]
    assert names == ["threads", "gemv0.threads", "gemv1.threads", "gemv0.group", "gemv1.group", "unroll", "ept",
                     "gemv1.inflight", "gemv0.preload"]


@pytest.mark.parametrize("args,match", [(["--tune", "decode"], "--tune needs --budget"),
                                        (["--budget", "4", "--tune", "decode,train"], "--tune takes entries")])
def test_cli_tune_is_checked(tmp_path, capsys, args, match):
    from lum.loader.cli import main

    out = tmp_path / "t.lumpkg"
    with pytest.raises(SystemExit) as info:
        main(["build", "--random", "tiny-llama", "--max-seq", "16", *args, "-o", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and match in err[0], err
    assert not out.exists()


def test_replay_times_warm_up_then_time_batches():
    """A replay of 50 µs: warm-up in doubling batches until 20 ms of device time, then each sample a batch
    of 10 replays (≈ 0.5 ms), reported per replay; an early slow replay (idle clocks) is warm-up only."""
    calls = []

    def batch(n):
        calls.append(n)
        return n * (90e-6 if len(calls) == 1 else 50e-6)

    times = T.replay_times(batch, warmup=3, repeats=5)
    warm = calls[:-5]
    assert warm == [1, 2, 4, 8, 16, 32, 64, 128, 256][:len(warm)] and sum(warm) * 50e-6 >= T.WARM_S - 40e-6
    assert calls[-5:] == [10] * 5 and times == pytest.approx([50e-6] * 5)
    calls.clear()
    assert T.replay_times(batch, warmup=0, repeats=2, warm_s=0.0) == pytest.approx([50e-6] * 2)
    assert calls == [1, math.ceil(T.BATCH_S / 90e-6), math.ceil(T.BATCH_S / 90e-6)]   # sized by the one warm-up


def test_replay_times_of_a_slow_replay_batch_one():
    times = T.replay_times(lambda n: n * 0.01, warmup=1, repeats=3)     # 10 ms a replay
    assert times == pytest.approx([0.01] * 3)


def test_candidates_are_compiled_without_ptx(spec, cache, tmp_path, monkeypatch):
    """Every measured-search candidate is written with ``BuildOptions(ptx=False)``: cubins only, no PTX
    section, and such a package still opens and runs."""
    import lum.loader
    from lum.builder import package_builder as PB

    seen, write = [], PB.write_program_package
    monkeypatch.setattr(PB, "write_program_package", lambda *a, **kw: seen.append(kw["options"].ptx) or write(*a, **kw))
    _build(spec, tmp_path / "m.lumpkg", budget=1, factory=lambda s: T.GpuTimer(s, backend="reference"),
           repeats=1, warmup=0)
    assert seen and not any(seen)
    pkg = lum.loader.open(build_package(spec, tmp_path / "np.lumpkg", options=BuildOptions(ptx=False)))
    tables = [g.table for g in pkg.manifest.groups if g.table is not None and g.table.ops]
    assert tables and all(t.cubin and t.ptx is None for t in tables)
    assert not any(name.startswith("ptx/") for name in pkg.reader.names())
    assert pkg.session(backend="reference").generate([1, 5], 2)
