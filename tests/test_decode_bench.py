"""benchmarks/decode.py end to end on the CPU (its smoke-test mode): a tiny HF model made and saved, built
with ``lum build``, decoded by lum (reference backend) and HF eager, the JSON written with every field; and
a lum backend that cannot run becomes that row's error instead of a crash."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "decode.py"


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--model", "tiny-llama", "--dtype", "f32", "--steps", "6", "--warmup", "2",
           "--prompt-len", "4", "--max-seq", "32", "--device", "cpu", "--out", str(out), "--commit", "test", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (path,) = out.glob("decode-tiny-llama-f32-*.json")
    return json.loads(path.read_text())


@pytest.mark.slow
def test_decode_benchmark_smoke(tmp_path):
    d = _run(tmp_path, "--systems", "lum,lum-noprologue,hf-eager", "--lum-backend", "reference", "--budget", "2")
    for key in ("commit", "gpu", "driver", "date", "copy_GBps", "rows"):
        assert key in d
    assert d["commit"] == "test" and d["copy_GBps"] > 0
    assert d["copy_GBps"] == max(d["copy_GBps_first"], d["copy_GBps_last"])    # measured before and after
    assert d["config"]["budget"] == 2          # passed to lum build (no GPU here: it notes the cost model)
    rows = {r["system"]: r for r in d["rows"]}
    assert set(rows) == {"lum", "lum-noprologue", "hf-eager"}
    for r in rows.values():
        assert r["error"] is None, r["error"]
        assert r["model"] == "tiny-llama" and r["dtype"] == "f32"
        assert r["tok_per_s"] > 0 and r["weight_bytes"] > 0 and r["roofline_tok_per_s"] > 0
        assert 0 < r["roofline_with_kv_tok_per_s"] < r["roofline_tok_per_s"]     # K/V rows read too
        assert abs(r["fraction_of_roofline"] - r["tok_per_s"] / r["roofline_tok_per_s"]) <= 1e-3
    assert d["kv_bytes_per_step"] > 0
    assert rows["lum"]["open_to_first_token_s"] > 0
    # the same weights and greedy decoding: lum's reference backend reproduces HF's tokens
    assert rows["lum"]["tokens_match_hf_eager"] == rows["lum"]["tokens_compared"] == 9
    # a second package built with LUM_GEMV_PROLOGUE=0 (decode GEMVs read their inputs): the same tokens
    assert rows["lum-noprologue"]["tokens_match_hf_eager"] == 9
    assert d["timings_s"]["lum_build"] > 0 and d["timings_s"]["lum_build_lum_gemv_prologue0"] > 0


@pytest.mark.slow
def test_decode_benchmark_records_an_unavailable_backend(tmp_path):
    d = _run(tmp_path, "--systems", "lum", "--lum-backend", "no-such-backend")
    (row,) = d["rows"]
    assert row["tok_per_s"] is None and "no-such-backend" in row["error"]


def test_a_package_the_disk_cannot_hold_is_not_built(tmp_path, monkeypatch):
    """Every lum package stays until the systems have run, so a build that would not fit on the disk (free bytes
    below the model's weights plus a margin) is skipped with the reason in its row, not left to fail half-way."""
    import shutil
    from collections import namedtuple

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import decode

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, 10 << 30, 1 << 30))
    out = tmp_path / "out"
    assert decode.main(["--model", "tiny-llama", "--dtype", "f32", "--steps", "2", "--warmup", "1", "--prompt-len", "4",
                        "--max-seq", "32", "--device", "cpu", "--out", str(out), "--commit", "test",
                        "--workdir", str(tmp_path / "work"), "--systems", "lum,lum-noprologue",
                        "--lum-backend", "reference"]) == 0
    (path,) = out.glob("decode-tiny-llama-f32-*.json")
    rows = {r["system"]: r for r in json.loads(path.read_text())["rows"]}
    for r in rows.values():
        assert r["tok_per_s"] is None and r["error"].startswith("not built: 1.1 GB free on the disk"), r["error"]
    assert (tmp_path / "work").is_dir() and not list((tmp_path / "work").rglob("*.lumpkg"))


def test_every_system_has_a_worker_and_a_time_cap(monkeypatch):
    """A system named on --systems runs in a worker of its own: each has one, a cap, and (lum's) options."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import decode

    assert set(decode.WORKERS) == set(decode.CAP_S) == set(decode.SYSTEMS)
    assert set(decode.LUM_BUILD_ENV) < set(decode.LUM_OPTIONS) < set(decode.SYSTEMS)
    assert set(decode.DEFAULT_SYSTEMS) == set(decode.SYSTEMS) - set(decode.LUM_BUILD_ENV) - set(decode.TUNED_SYSTEMS)


def test_event_timer_times_stream_work_on_the_fake_driver(tmp_path):
    """benchmarks/_common.EventTimer (gemv_sweep.py, pdl_probe.py): one untimed call, then the median of
    the timed ones between two CUDA events; its events are destroyed on close (fake driver)."""
    from tests import cuda_emulation as emu

    if emu.CC is None:
        pytest.skip("no C compiler for the fake driver")
    res = emu.run_emulated(r'''
import sys, time
sys.path.insert(0, "benchmarks")
from _common import EventTimer
from lum.loader.cuda import driver as cu
ctx = cu.Context(0)
stream = cu.Stream()
timer = EventTimer(cu, stream)
calls = []
sec = timer(lambda: (calls.append(1), time.sleep(0.004)), 5)
live = fake_stats()["live"][3]
timer.close()
print(json.dumps({"sec": sec, "calls": len(calls), "live": live, "after": fake_stats()["live"][3]}))
''', driver_dir=emu.fake_driver(tmp_path / "driver"), kernels=None, cublaslt=None)
    assert res["calls"] == 6 and 0.003 < res["sec"] < 0.5
    assert res["live"] - res["after"] == 2


def test_probe_device_on_the_fake_driver(tmp_path):
    """benchmarks/_common.ProbeDevice: reads a probe's sources and loads the module, owns its buffers
    (upload, write, read back), packs launch parameters and frees everything on close (fake driver; NVRTC
    stands in by a stub there, the probes' compile is test_templates_compile's)."""
    from tests import cuda_emulation as emu

    if emu.CC is None:
        pytest.skip("no C compiler for the fake driver")
    res = emu.run_emulated(r'''
import sys
sys.path.insert(0, "benchmarks")
from lum.builder import nvrtc
sources = []
class _Compiled:
    cubin = b"\x7fELF" + bytes(60)
def _compile(source, arch, **kw):
    sources.append(source)
    return _Compiled()
nvrtc.compile_cuda = _compile
from _common import ProbeDevice
dev = ProbeDevice("phase_probe.cu")
assert "probe_block_sum" in sources[0] and "probe_phases" in sources[0] and "lum_f32_to_bf16" in sources[0]
a = dev.upload(np.arange(6, dtype=np.float32))
b = dev.buffer(24)
dev.write(b, np.arange(6, dtype=np.float32)[::-1].copy())
got = [dev.read(a, 6).tolist(), dev.read(b, 6).tolist()]
addr = dev.pack([a.ptr, 3, 7])
live = fake_stats()["live"]
dev.close()
print(json.dumps({"got": got, "addr": addr, "live": live, "after": fake_stats()["live"]}))
''', driver_dir=emu.fake_driver(tmp_path / "driver"), kernels=None, cublaslt=None)
    assert res["got"] == [[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0]] and res["addr"] != 0
    assert all(after <= before for before, after in zip(res["live"], res["after"]))
    assert sum(res["after"]) < sum(res["live"])


def test_kernel_benchmarks_record_head_and_file(tmp_path, monkeypatch):
    """benchmarks/_common's record helpers (gemv_sweep.py, pdl_probe.py, phase_probe.py): ``--out`` and
    ``--commit``, a head naming the benchmark, commit, GPU, driver and date, a file a day and stem, and a second
    and third run that day beside it (``-2``, ``-3``), not over it."""
    import argparse

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from _common import add_record_args, record_head, write_record

    ap = argparse.ArgumentParser()
    add_record_args(ap)
    args = ap.parse_args(["--out", str(tmp_path / "results"), "--commit", "abc1234"])
    record = {**record_head("gemv-sweep", args.commit, "NVIDIA H200"), "rows": [1]}
    path = write_record(record, args.out, "gemv-sweep-bf16")
    assert path.parent == tmp_path / "results" and path.name.startswith("gemv-sweep-bf16-20")
    back = json.loads(path.read_text())
    assert back == record and {"benchmark", "commit", "gpu", "driver", "date"} <= back.keys()
    assert back["commit"] == "abc1234" and back["gpu"] == "NVIDIA H200"
    again = [write_record({**record, "rows": [k]}, args.out, "gemv-sweep-bf16") for k in (2, 3)]
    assert [p.name for p in again] == [path.name.replace(".json", f"-{k}.json") for k in (2, 3)]
    assert [json.loads(p.read_text())["rows"] for p in (path, *again)] == [[1], [2], [3]]
