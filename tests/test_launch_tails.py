"""The launch table's kernel tails (table version 2, lum.format.manifest): an op entry that runs other ops too
(builder/fused.py: by default decode attention with its k / v / q stage, and siblings) names them and their
buffers, and the manifest parser and the loader refuse an entry that breaks the convention."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("egglog")

from lum.format.errors import PackageFormatError  # noqa: E402
from lum.format.manifest import Manifest  # noqa: E402


@pytest.fixture(scope="module")
def tail_pkg(tmp_path_factory):
    pytest.importorskip("lum.builder.nvrtc")
    import lum.loader
    from lum.builder.models import load_spec
    from lum.builder.package_builder import build_package

    path = build_package(load_spec(random_name="tiny-llama", max_seq=32), tmp_path_factory.mktemp("tp") / "t.lumpkg")
    pkg = lum.loader.open(path)
    yield pkg
    pkg.close()


def _layer_table(d: dict) -> dict:
    return next(g["kernels"] for g in d["groups"] if any("tail" in o for o in g["kernels"].get("ops", ())))


def _head_entry(t: dict) -> dict:
    return max((o for o in t["ops"] if "tail" in o), key=lambda o: len(o["tail"]))   # the stage's: three tails


def test_the_default_package_has_a_kernel_with_several_tails(tail_pkg):
    head = _head_entry(_layer_table(tail_pkg.manifest.to_json()))
    assert len(head["tail"]) >= 2
    assert all(f"out@{t}" in head["params"] for t in head["tail"])


@pytest.mark.parametrize("mutate,match", [
    (lambda t: t.update(version=1), "need table version 2"),
    (lambda t: _head_entry(t).update(tail=[]), "increasing"),
    (lambda t: _head_entry(t).update(tail=list(reversed(_head_entry(t)["tail"]))), "increasing"),
    (lambda t: _head_entry(t)["params"].remove(f"out@{_head_entry(t)['tail'][0]}"), "per tail op"),
    (lambda t: _head_entry(t)["params"].append("in9@1"), "per tail op"),
])
def test_manifest_checks_tails(tail_pkg, mutate, match):
    d = copy.deepcopy(tail_pkg.manifest.to_json())
    mutate(_layer_table(d))
    with pytest.raises(PackageFormatError, match=match):
        Manifest.from_json(d, set(tail_pkg.reader.names()))


def test_manifest_rejects_an_op_that_is_a_tail_and_a_kernel(tail_pkg):
    d = copy.deepcopy(tail_pkg.manifest.to_json())
    t = _layer_table(d)
    head = _head_entry(t)
    t["ops"].append({**copy.deepcopy(head), "op": head["tail"][0], "tail": [head["tail"][0] + 1000]})
    t["ops"].sort(key=lambda o: o["op"])
    with pytest.raises(PackageFormatError, match="tail"):
        Manifest.from_json(d, set(tail_pkg.reader.names()))


def test_loader_checks_tails_against_the_llir(tail_pkg, tmp_path):
    import lum.loader
    from tests.test_cuda_backend import _repacked

    def reopen(mutate, name):
        d = copy.deepcopy(tail_pkg.manifest.to_json())
        mutate(_layer_table(d))
        return lum.loader.open(_repacked(tail_pkg, d, tmp_path / name))

    def drop_last_tail(t):              # its op then has no kernel at all
        h = _head_entry(t)
        last = h["tail"].pop()
        h["params"] = [p for p in h["params"] if not p.endswith(f"@{last}")]

    with pytest.raises(PackageFormatError, match="has no kernel"):
        reopen(drop_last_tail, "dropped.lumpkg")

    def wrong_arity(t):                 # one buffer more for the first tail than its op has arguments
        h = _head_entry(t)
        first = h["tail"][0]
        ins = [p for p in h["params"] if p.startswith("in") and p.partition("@")[2] == str(first)]
        h["params"].insert(h["params"].index(ins[-1]) + 1, f"in{len(ins)}@{first}")

    with pytest.raises(PackageFormatError, match="wrong number of buffers"):
        reopen(wrong_arity, "arity.lumpkg")

    def skip_one(t):                    # name a later op as the first tail: the real one is left without a kernel
        h = _head_entry(t)
        first = h["tail"][0]
        h["tail"] = h["tail"][1:]
        h["params"] = [p for p in h["params"] if not p.endswith(f"@{first}")]

    with pytest.raises(PackageFormatError, match="right after its head"):
        reopen(skip_one, "skip.lumpkg")
    reopen(lambda t: None, "same.lumpkg").close()
