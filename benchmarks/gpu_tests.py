"""Run the `gpu`-marked tests on this machine's GPU and record the outcome as JSON.

    python benchmarks/gpu_tests.py [pytest args…] --out benchmarks/results [--time-limit S] [--workers N] [-m EXPR]

The record (``gpu-tests-<date>.json``) holds the commit, GPU, driver, date, the LUM_* settings and every test's
outcome, duration and recorded properties (figures a test measures and reports with ``record_property``), so a
GPU feature's "its tests passed there, on the committed code" is a committed fact. Outcomes stream to a file as
each test ends (``gpu_tests_stream.py``): a run stopped by ``--time-limit`` or by a signal (a device call's
own limit) still writes its record, with the tests it did not finish as ``not run`` and ``stopped`` saying why.

Most of the suite's time is the host's: each test builds packages (saturation, NVRTC) and runs them for a few
milliseconds of GPU time. ``--workers N`` runs the tests not marked ``serial`` in N processes (pytest-xdist, the
cases of one package on one worker: their ``xdist_group``), then the ``serial`` ones alone: those measure time,
bandwidth or the device's free memory, which other processes on the GPU would disturb. ``-m EXPR`` is and-ed
with ``gpu`` (and with the phase's ``serial`` test).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import git, git_dirty  # noqa: E402


def _gpu() -> tuple[str, str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        name, driver = (x.strip() for x in out.split(","))
        return name, driver
    except (OSError, IndexError, ValueError, subprocess.TimeoutExpired):
        return "none", "none"


class _Stopped(Exception):
    pass


def _on_signal(signum, frame):  # noqa: ARG001
    raise _Stopped(f"stopped by signal {signal.Signals(signum).name}")


def _run_pytest(cmd: list[str], env: dict[str, str], time_limit: float | None,
                deadline: float | None) -> tuple[int | None, str | None]:
    """pytest's exit code, or None and why it was stopped (``time_limit``'s ``deadline`` on the monotonic
    clock, SIGTERM / SIGINT): then its whole process group is killed, so nothing it started outlives the
    record."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic())), None
    except subprocess.TimeoutExpired:
        stopped = f"stopped at the {time_limit:g} s time limit"
    except _Stopped as exc:
        stopped = str(exc)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return None, stopped


def _read_stream(path: Path) -> list[dict]:
    """The tests in collection order: each finished one's line, the others ``not run``."""
    collected, done = {}, {}                       # (a dict keeps the order of first appearance)
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                d = json.loads(line)
            except json.JSONDecodeError:            # a line cut by the kill
                continue
            if "collected" in d:                    # one a run, or one a parallel run's worker: the same ids
                collected.update(dict.fromkeys(d["collected"]))
            else:
                done[d.pop("test")] = d
    tests = []
    for nodeid in [*collected, *(n for n in done if n not in collected)]:
        d = done.get(nodeid, {"outcome": "not run", "seconds": 0.0, "message": ""})
        module, _, name = nodeid.partition("::")
        tests.append({"test": f"{module.removesuffix('.py').replace('/', '.')}::{name}", "outcome": d["outcome"],
                      "seconds": round(d["seconds"], 3), **({"message": d["message"]} if d["message"] else {}),
                      **({"properties": d["properties"]} if d.get("properties") else {}),
                      **({"worker": d["worker"]} if d.get("worker") else {})})
    return tests


def _commands(marks: str | None, workers: int, pytest_args: list[str], scratch: Path) -> list[list[str]]:
    """The pytest runs, in order: one of every selected test, or with ``workers`` > 1 the parallel part then
    the ``serial`` tests. Each run's ``tmp_path`` folders go under ``scratch`` (``--basetemp``), which the caller
    deletes: the suite builds packages of real models, and pytest's own temp root keeps its last three runs, tens
    of GB that a device's disk then lacks for ``decode.py``'s packages."""
    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "gpu_tests_stream"]
    selected = "gpu" + (f" and ({marks})" if marks else "")
    rest = pytest_args or ["tests"]
    if workers <= 1:
        runs = [["-m", selected]]
    else:
        runs = [["-m", f"{selected} and not serial", "-n", str(workers), "--dist", "loadgroup"],
                ["-m", f"{selected} and serial"]]
    return [[*base, *run, f"--basetemp={scratch / f'run{i}'}", *rest] for i, run in enumerate(runs)]


PYTEST_NO_TESTS = 5     # pytest's exit code when no test was selected


def _exit_code(codes: list[int]) -> int:
    """One exit code for the runs: the first failing one's; a run that selected no test fails nothing
    unless no run selected any."""
    ran = [c for c in codes if c != PYTEST_NO_TESTS]
    return next((c for c in ran if c != 0), 0) if ran else PYTEST_NO_TESTS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--commit", default=None, help="commit hash (default: git rev-parse HEAD)")
    ap.add_argument("--time-limit", type=float, default=None, metavar="S",
                    help="stop pytest after S seconds and record what finished (default: no limit)")
    ap.add_argument("--workers", type=int, default=1, metavar="N",
                    help="run the tests not marked serial in N processes (pytest-xdist), then the serial ones "
                         "alone (default 1: every test in one process)")
    ap.add_argument("-m", dest="marks", default=None, metavar="EXPR", help="a marker expression, and-ed with gpu")
    args, pytest_args = ap.parse_known_args(argv)
    if args.workers < 1:
        ap.error("--workers must be at least 1")
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    codes: list[int] = []
    stopped = None
    with tempfile.TemporaryDirectory() as tmp:
        cmds = _commands(args.marks, args.workers, pytest_args, Path(tmp))
        stream = Path(tmp) / "tests.jsonl"
        env = {**os.environ, "GPU_TESTS_STREAM": str(stream),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")]))}
        for i, cmd in enumerate(cmds):
            code, stopped = _run_pytest(cmd, env, args.time_limit, deadline)
            if stopped:
                if i + 1 < len(cmds):
                    stopped += "; the serial tests did not start"
                break
            codes.append(code)
        tests = _read_stream(stream)
    code = None if stopped else _exit_code(codes)
    gpu, driver = _gpu()
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped", "not run")}
    now = dt.datetime.now(dt.timezone.utc)
    record = {"benchmark": "gpu-tests", "commit": args.commit or git("rev-parse", "HEAD"),
              "dirty": git_dirty(untracked=False), "gpu": gpu, "driver": driver,
              "date": now.isoformat(timespec="seconds"),
              "command": " ; ".join(" ".join(a for a in c[1:] if not a.startswith("--basetemp=")) for c in cmds),
              "exit_code": code,
              **({"stopped": stopped} if stopped else {}),
              "workers": args.workers,
              "lum_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("LUM_")},
              **counts, "tests": tests}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-tests-{now:%Y-%m-%d-%H%M%S}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{counts}{' (' + stopped + ')' if stopped else ''} -> {path}")
    return 1 if code is None else code


if __name__ == "__main__":
    sys.exit(main())
