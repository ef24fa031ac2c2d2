"""Run the `gpu`-marked tests on this machine's GPU and record the outcome as JSON.

    python benchmarks/gpu_tests.py [pytest args…] --out benchmarks/results

The record (``gpu-tests-<date>.json``) holds the commit, GPU, driver, date and every test's outcome,
duration and recorded properties (figures a test measures and reports with ``record_property``), so a
GPU feature's "its tests passed there, on the committed code" is a committed fact.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def _gpu() -> tuple[str, str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        name, driver = (x.strip() for x in out.split(","))
        return name, driver
    except (OSError, IndexError, ValueError, subprocess.TimeoutExpired):
        return "none", "none"


def _number(text: str | None) -> float | str | None:
    """A recorded property (``record_property`` in a test) as a number when it is one."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--commit", default=None, help="commit hash (default: git rev-parse HEAD)")
    args, pytest_args = ap.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}",
               *(pytest_args or ["tests"])]
        proc = subprocess.run(cmd, cwd=ROOT)
        tests = []
        if xml.exists():
            for case in ET.parse(xml).getroot().iter("testcase"):
                outcome = "passed"
                for tag in ("failure", "error", "skipped"):
                    el = case.find(tag)
                    if el is not None:
                        outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                        message = (el.get("message") or "")[:300]
                        break
                else:
                    message = ""
                props = {p.get("name"): _number(p.get("value")) for p in case.iter("property")}
                tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                              "seconds": float(case.get("time") or 0), **({"message": message} if message else {}),
                              **({"properties": props} if props else {})})
    gpu, driver = _gpu()
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    now = dt.datetime.now(dt.timezone.utc)
    record = {"benchmark": "gpu-tests", "commit": args.commit or _git("rev-parse", "HEAD"),
              "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")), "gpu": gpu, "driver": driver,
              "date": now.isoformat(timespec="seconds"), "command": " ".join(cmd[1:]), "exit_code": proc.returncode,
              "lum_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("LUM_")}, **counts, "tests": tests}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-tests-{now:%Y-%m-%d-%H%M}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{counts} -> {path}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
