"""A pytest plugin for benchmarks/gpu_tests.py: each test's outcome as one JSON line the moment it is known.

A junit XML is written only when pytest ends, so a run stopped by a device call's time limit left no record of
the hundreds of tests it had already run. With ``-p gpu_tests_stream`` and ``$GPU_TESTS_STREAM`` naming a file,
the collected test ids go out first (``{"collected": [...]}``), then a line a finished test (its outcome,
seconds over setup, call and teardown, the failure's first line, its ``record_property`` figures).

Under pytest-xdist each worker writes its collected ids (the same list) and the controller, which gets every
worker's reports, writes the outcomes, each with the worker that ran it.
"""

from __future__ import annotations

import json
import os

_state: dict[str, dict] = {}
_worker = False      # a pytest-xdist worker: the controller writes its outcomes


def pytest_configure(config) -> None:
    global _worker
    _worker = hasattr(config, "workerinput")


def _write(line: dict) -> None:
    path = os.environ.get("GPU_TESTS_STREAM")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line, default=str) + "\n")


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):      # (file, line, "Skipped: why")
        return str(report.longrepr[2]).removeprefix("Skipped: ")[:300]
    text = getattr(report, "longreprtext", "") or ""
    lines = [x for x in text.splitlines() if x.startswith("E ")]
    return (lines[0][1:].strip() if lines else text.strip().splitlines()[-1] if text.strip() else "")[:300]


def pytest_collection_finish(session) -> None:
    _write({"collected": [item.nodeid for item in session.items]})


def pytest_runtest_logreport(report) -> None:
    if _worker:                                    # the controller writes it, with every worker's
        return
    t = _state.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0, "message": ""})
    t["seconds"] += report.duration
    if report.failed and t["outcome"] == "passed":
        t["outcome"] = "failed" if report.when == "call" else "error"
        t["message"] = _message(report)
    elif report.skipped and t["outcome"] == "passed":
        t["outcome"], t["message"] = "skipped", _message(report)
    if report.when == "call" or (report.when == "setup" and not report.passed):
        t["properties"] = dict(report.user_properties)
    if report.when == "teardown":
        _state.pop(report.nodeid)
        worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None)
        _write({"test": report.nodeid, **t, **({"worker": worker} if worker else {})})
