"""benchmarks/gpu_tests.py records each test's outcome and the figures it reports with record_property."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_record_keeps_outcomes_and_properties(tmp_path):
    (tmp_path / "test_figures.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.gpu\n"
        "def test_measures(record_property, tmp_path):\n"
        "    (tmp_path / 'model.lumpkg').write_bytes(b'x' * 1024)\n"
        "    record_property('gemv_GBps', 3456)\n"
        "    record_property('note', 'warm')\n"
        "    record_property('tmp', str(tmp_path))\n\n"
        "@pytest.mark.gpu\n"
        "def test_fails():\n"
        "    assert 1 == 2\n\n"
        "def test_not_gpu():\n"
        "    pass\n")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_tests.py"), "--out", str(out),
                           "--commit", "abc123", "-q", str(tmp_path / "test_figures.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr          # pytest's exit code: a test failed
    (path,) = out.glob("gpu-tests-*.json")
    rec = json.loads(path.read_text())
    assert rec["commit"] == "abc123" and (rec["passed"], rec["failed"]) == (1, 1)
    tests = {t["test"].split("::")[-1]: t for t in rec["tests"]}
    assert set(tests) == {"test_measures", "test_fails"}            # only gpu-marked tests run
    props = tests["test_measures"]["properties"]
    assert {k: props[k] for k in ("gemv_GBps", "note")} == {"gemv_GBps": 3456.0, "note": "warm"}
    assert not Path(props["tmp"]).exists() and "--basetemp" not in rec["command"]   # what tests built is gone
    assert tests["test_fails"]["outcome"] == "failed" and "properties" not in tests["test_fails"]


def _slow_tests(tmp_path: Path) -> Path:
    path = tmp_path / "test_slow.py"
    path.write_text(
        "import time\nimport pytest\n\n"
        "@pytest.mark.gpu\n"
        "def test_quick(record_property):\n"
        "    record_property('ms', 1.5)\n\n"
        "@pytest.mark.gpu\n"
        "def test_skipped():\n"
        "    pytest.skip('one model is enough')\n\n"
        "@pytest.mark.gpu\n"
        "def test_slow():\n"
        f"    open({str(tmp_path / 'started')!r}, 'w').close()\n"
        "    time.sleep(120)\n\n"
        "@pytest.mark.gpu\n"
        "def test_after():\n"
        "    pass\n")
    return path


def _record(out: Path) -> dict:
    (path,) = out.glob("gpu-tests-*.json")
    return json.loads(path.read_text())


def _check_stopped(rec: dict, why: str) -> None:
    assert why in rec["stopped"] and rec["exit_code"] is None, rec
    tests = {t["test"].split("::")[-1]: t for t in rec["tests"]}
    assert [t["test"].split("::")[-1] for t in rec["tests"]] == ["test_quick", "test_skipped", "test_slow",
                                                                  "test_after"]   # collection order
    assert tests["test_quick"]["outcome"] == "passed" and tests["test_quick"]["properties"] == {"ms": 1.5}
    assert tests["test_skipped"]["outcome"] == "skipped" and tests["test_skipped"]["message"] == "one model is enough"
    assert tests["test_slow"]["outcome"] == tests["test_after"]["outcome"] == "not run"
    assert (rec["passed"], rec["skipped"], rec["not run"]) == (1, 1, 2)


def test_a_run_stopped_by_its_time_limit_still_records_what_finished(tmp_path):
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_tests.py"), "--out", str(out),
                           "--commit", "abc123", "--time-limit", "15", "-q", str(_slow_tests(tmp_path))],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1 and time.monotonic() - t0 < 60, proc.stdout + proc.stderr
    _check_stopped(_record(out), "15 s time limit")


def test_a_run_stopped_by_sigterm_still_records_what_finished(tmp_path):
    """What an outer ``timeout`` (a device call's limit) does: SIGTERM to gpu_tests.py, whose pytest then stops."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "gpu_tests.py"), "--out", str(out),
                             "--commit", "abc123", "-q", str(_slow_tests(tmp_path))],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:   # test_slow is running
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, text
    _check_stopped(_record(out), "SIGTERM")


def _parallel_tests(tmp_path: Path, slow: bool = False) -> Path:
    path = tmp_path / "test_parallel.py"
    path.write_text(
        "import time\nimport pytest\n\n"
        "@pytest.mark.gpu\n"
        "@pytest.mark.parametrize('i', range(4))\n"
        "def test_case(i, record_property, request):\n"
        "    record_property('worker', getattr(request.config, 'workerinput', {}).get('workerid', 'alone'))\n"
        f"    time.sleep({120 if slow else 0})\n\n"
        "@pytest.mark.gpu\n"
        "@pytest.mark.serial\n"
        "def test_timed(record_property, request):\n"
        "    record_property('worker', getattr(request.config, 'workerinput', {}).get('workerid', 'alone'))\n\n"
        "@pytest.mark.gpu\n"
        "def test_fails():\n"
        "    assert 1 == 2\n")
    return path


def test_workers_run_the_serial_tests_alone_after_the_others(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_tests.py"), "--out", str(out),
                           "--commit", "abc123", "--workers", "2", "-q", str(_parallel_tests(tmp_path))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr          # test_fails failed; the serial run passed
    rec = _record(out)
    names = [t["test"].split("::")[-1] for t in rec["tests"]]
    assert names == [f"test_case[{i}]" for i in range(4)] + ["test_fails", "test_timed"]   # each once, serial last
    assert (rec["passed"], rec["failed"], rec["workers"]) == (5, 1, 2)
    tests = {t["test"].split("::")[-1]: t for t in rec["tests"]}
    assert tests["test_timed"]["properties"] == {"worker": "alone"} and "worker" not in tests["test_timed"]
    for i in range(4):
        t = tests[f"test_case[{i}]"]
        assert t["worker"] in ("gw0", "gw1") and t["properties"] == {"worker": t["worker"]}
    assert "-n 2" in rec["command"] and "gpu and serial" in rec["command"]


def test_a_parallel_run_stopped_by_its_time_limit_says_the_serial_tests_did_not_start(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_tests.py"), "--out", str(out),
                           "--commit", "abc123", "--workers", "2", "--time-limit", "15", "-q",
                           str(_parallel_tests(tmp_path, slow=True))],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rec = _record(out)
    assert rec["exit_code"] is None and rec["stopped"] == ("stopped at the 15 s time limit; "
                                                          "the serial tests did not start"), rec
    outcomes = {t["test"].split("::")[-1]: t["outcome"] for t in rec["tests"]}
    assert outcomes["test_fails"] in ("failed", "not run") and "test_timed" not in outcomes
    assert sum(o == "not run" for o in outcomes.values()) >= 2         # the two workers' sleeping cases
