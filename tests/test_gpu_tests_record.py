"""benchmarks/gpu_tests.py records each test's outcome and the figures it reports with record_property."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_record_keeps_outcomes_and_properties(tmp_path):
    (tmp_path / "test_figures.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.gpu\n"
        "def test_measures(record_property):\n"
        "    record_property('gemv_GBps', 3456)\n"
        "    record_property('note', 'warm')\n\n"
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
    assert tests["test_measures"]["properties"] == {"gemv_GBps": 3456.0, "note": "warm"}
    assert tests["test_fails"]["outcome"] == "failed" and "properties" not in tests["test_fails"]
