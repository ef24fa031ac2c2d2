"""Build-time cuBLASLt algorithms (lum.builder.gemm_algos) on the CPU: choice by a given timer on the fake
cuBLASLt (tests/fake_cublaslt.c), the manifest's validation of ``gemms`` / ``target.cublaslt_version``, and
the loader's version rule. The GPU half is in tests/test_gpu.py; the emulated session in test_cuda_emulated.py."""

from __future__ import annotations

import copy

import pytest

from lum.builder.gemm_algos import choose_gemm_algos, gemm_problem
from lum.builder.tuning import TuningDB
from lum.format.dtypes import DType
from lum.format.errors import PackageFormatError
from lum.format.manifest import Manifest
from lum.loader.cuda.runner import stored_gemm_algos
from tests.kernel_cases import DYN, gemm_cases
from tests.test_cublaslt import fake  # noqa: F401 - the fake cuBLASLt fixture


def _slowest_first(plan, p) -> float:
    return 1.0 / plan.algo_bytes()[0]          # the fake's candidates are numbered 1..3: 3 is "fastest"


def _tables(prog):
    return [{"version": 1, "arch": "sm_90", "cubin": None, "ptx": None, "dyn_vars": ["s"], "max_dyn": {}, "ops": []}]


def test_choice_is_the_fastest_candidate_per_gemm(fake, tmp_path):
    lt, _ = fake
    prog, _, _ = gemm_cases(DType.f32)
    tables = _tables(prog)
    calls = []

    def timer(plan, p):
        calls.append(plan.algo_bytes()[0])
        return _slowest_first(plan, p)

    db = TuningDB(tmp_path / "db")
    n = choose_gemm_algos([prog], tables, DYN, lt, timer, db, {"gpu": "fake", "driver": "1"})
    gemm_ids = [o.id for o in prog.ops if o.kind == "gemm" and gemm_problem(o, DYN) is not None]
    assert n == len(gemm_ids) > 0
    assert [g["op"] for g in tables[0]["gemms"]] == gemm_ids
    for g in tables[0]["gemms"]:
        algo = bytes.fromhex(g["algo"])
        assert len(g["algo"]) == 128 and algo[0] == 3
        assert set(g["algo_dims"]) == {"m", "n", "k", "batch"}
    assert set(calls) == {1, 2, 3}
    # a second build hits the DB: no timing, same table
    calls.clear()
    again = _tables(prog)
    choose_gemm_algos([prog], again, DYN, lt, timer, db, {"gpu": "fake", "driver": "1"})
    assert calls == [] and again == tables
    # groups without a table (built without kernels) get nothing
    none: list[dict] = [{}]
    assert choose_gemm_algos([prog], none, DYN, lt, timer) == 0 and none == [{}]


def _manifest_json(tables, version=130099):
    prog, _, _ = gemm_cases(DType.f32)
    return {"schema": "lum.model", "schema_version": 1, "model": {}, "provenance": {},
            "target": {"sm": "sm_90", **({"cublaslt_version": version} if version is not None else {})},
            "groups": [{"hash": "g", "llir": "llir/0", "chunks": 1, "kernels": tables[0]}],
            "entries": {}, "state": {}, "weights": {}}


def test_manifest_validates_gemm_algos(fake):
    lt, _ = fake
    prog, _, _ = gemm_cases(DType.f32)
    tables = _tables(prog)
    choose_gemm_algos([prog], tables, DYN, lt, _slowest_first)
    good = _manifest_json(tables)
    m = Manifest.from_json(good)
    gemms = m.groups[0].table.gemms
    assert gemms and gemms[0].algo == bytes.fromhex(tables[0]["gemms"][0]["algo"]) and len(gemms[0].dims) == 4

    def bad(mut, match):
        d = copy.deepcopy(good)
        mut(d)
        with pytest.raises(PackageFormatError, match=match):
            Manifest.from_json(d)

    g0 = lambda d: d["groups"][0]["kernels"]["gemms"][0]  # noqa: E731
    bad(lambda d: g0(d).update(algo=g0(d)["algo"][:-2]), "128 hex")
    bad(lambda d: g0(d).update(algo="zz" + g0(d)["algo"][2:]), "128 hex")
    bad(lambda d: g0(d).update(algo=list(range(64))), "128 hex")
    bad(lambda d: g0(d)["algo_dims"].update(m="4"), "algo_dims.m")
    bad(lambda d: g0(d)["algo_dims"].pop("batch"), "algo_dims")
    bad(lambda d: g0(d).update(op=True), r"\.op")
    bad(lambda d: d["target"].update(cublaslt_version="13.0"), "cublaslt_version")
    bad(lambda d: d["target"].pop("cublaslt_version"), "without target.cublaslt_version")
    if len(good["groups"][0]["kernels"]["gemms"]) > 1:
        bad(lambda d: d["groups"][0]["kernels"]["gemms"].reverse(), "sorted")


def test_loader_uses_stored_algos_only_for_the_same_version(fake):
    lt, _ = fake
    prog, _, _ = gemm_cases(DType.f32)
    tables = _tables(prog)
    choose_gemm_algos([prog], tables, DYN, lt, _slowest_first)
    m = Manifest.from_json(_manifest_json(tables, lt.version()))
    algos = stored_gemm_algos(m, lt.version())
    assert set(algos) == {(0, g["op"]) for g in tables[0]["gemms"]}
    assert stored_gemm_algos(m, lt.version() + 1) == {} and stored_gemm_algos(m, None) == {}
    # passed through non-strictly: the stored algo is used, junk falls back to the heuristic
    p = gemm_problem(next(o for o in prog.ops if o.id == tables[0]["gemms"][0]["op"]), DYN)
    args = (p["layout"], p["m"], p["n"], p["k"], p["lda"], p["ldb"], p["n"], p["batch"], p["stride_a"],
            p["stride_b"], p["m"] * p["n"], p["dtype"])
    kw = dict(offset_a=p["offset_a"], offset_b=p["offset_b"])
    plan = lt.matmul_plan(*args, algos[(0, tables[0]["gemms"][0]["op"])], **kw)
    assert plan.algo_source == "given" and plan.algo_bytes()[0] == 3
    junk = lt.matmul_plan(*args, b"\x07" * 64, **kw)
    assert junk.algo_source.startswith("heuristic") and junk.algo_bytes()[0] == 1
