"""Nsight Compute's hardware counters for the kernels of one lum decode step, as a JSON record.

    python benchmarks/ncu_decode.py --model gemma3-4b [--dtype bf16] [--kernels 20] [--match ^lum_]
                                    [--warmup 4] [--pkg FILE] [--out DIR] [--commit SHA] [--keep-report]

Runs ``profile_decode.py --ncu`` (the package built as decode.py builds it, or ``--pkg``; the prompt and
``--warmup`` decode steps, then one step between cudaProfilerStart / Stop) under ``ncu --profile-from-start
off``, which profiles the first ``--kernels`` kernels of that step whose names match ``--match``, each
graph node on its own: no programmatic overlap, the caches as the step left them (``--cache-control
none``), the clocks left alone (``--clock-control none``). Per kernel the record keeps what says where a
small kernel's time goes: its duration, the active cycles of an SM that ran a block, the DRAM share of
peak, achieved occupancy, eligible warps and cycles per issued instruction of a scheduler, registers,
L1 / L2 hit rates, grid and block. ``ncu-decode-<model>-<dtype>-<date>.json`` goes to ``--out`` (one file:
the device tool returns few); ``--keep-report`` keeps the .ncu-rep beside it for ``ncu -i``. Needs a GPU
whose counters ncu can read (the H200 lent here: benchmarks/NOTES.md "Nsight Compute on a decode step").
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import log, record_head, set_log_tag, write_record  # noqa: E402

set_log_tag("ncu-decode")

SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats", "SchedulerStats", "MemoryWorkloadAnalysis")
# record field <- the details page's metric name
METRICS = {"us": "Duration", "elapsed_cycles": "Elapsed Cycles", "sm_active_cycles_avg": "SM Active Cycles",
           "dram_pct": "DRAM Throughput", "achieved_occupancy_pct": "Achieved Occupancy",
           "eligible_warps": "Eligible Warps Per Scheduler", "cycles_per_issue": "Warp Cycles Per Issued Instruction",
           "registers": "Registers Per Thread", "l1_hit_pct": "L1/TEX Hit Rate", "l2_hit_pct": "L2 Hit Rate",
           "grid": "Grid Size", "block": "Block Size"}
SMS = 132
NCU_DIRS = (Path("/usr/local/cuda/bin"),)      # where the device image has it when PATH does not


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def kernels_from_details(text: str, sms: int = SMS) -> list[dict]:
    """The rows of ``ncu -i REP --page details --csv`` as one dict a profiled kernel, in launch order:
    :data:`METRICS`, and ``sm_cycles`` (an SM's active cycles where it ran a block: the average over all SMs
    scaled by SMs / blocks, for grids smaller than the GPU)."""
    rows = csv.reader(io.StringIO(text))
    head = next(rows, None)
    if not head or "Metric Name" not in head:
        raise ValueError("not an ncu details CSV (no 'Metric Name' column)")
    col = {h: i for i, h in enumerate(head)}
    by_id: dict[int, dict] = {}
    for r in rows:
        if len(r) <= col["Metric Value"] or not r[col["Metric Name"]]:
            continue                                   # a rule's row: advice, not a metric
        k = by_id.setdefault(int(r[col["ID"]]), {"kernel": r[col["Kernel Name"]]})
        k.setdefault("_m", {})[r[col["Metric Name"]]] = r[col["Metric Value"]]
    out = []
    for kid in sorted(by_id):
        k = by_id[kid]
        m = k.pop("_m")
        k.update({field: _number(m[name]) for field, name in METRICS.items() if name in m})
        grid = k.get("grid")
        if k.get("sm_active_cycles_avg") is not None and grid:
            k["sm_cycles"] = round(k["sm_active_cycles_avg"] * sms / min(grid, sms))
        out.append({"id": kid, **k})
    return out


def _ncu() -> str:
    """ncu's path: on PATH, else in :data:`NCU_DIRS`."""
    found = shutil.which("ncu") or next((str(d / "ncu") for d in NCU_DIRS if (d / "ncu").is_file()), None)
    if not found:
        raise SystemExit(f"error: ncu (Nsight Compute) not found on PATH or in {', '.join(map(str, NCU_DIRS))}")
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-4b")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--kernels", type=int, default=20, help="kernels of the step to profile, in launch order")
    ap.add_argument("--match", default="^lum_", help="regex their names must match (ncu -k regex:…)")
    ap.add_argument("--warmup", type=int, default=4, help="decode steps before the profiled one")
    ap.add_argument("--pkg", default=None, help="profile this package instead of building one")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--keep-report", action="store_true", help="keep the .ncu-rep beside the record")
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds for the profiled run")
    args = ap.parse_args(argv)
    if args.kernels < 1:
        raise SystemExit("error: --kernels must be at least 1")
    ncu = _ncu()
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="lum-ncu-") as tmp:
        rep = Path(tmp) / "step"
        cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--cache-control", "none",
               "-k", f"regex:{args.match}", "-c", str(args.kernels), *(x for s in SECTIONS for x in ("--section", s)),
               "-o", str(rep), "-f", sys.executable, str(HERE / "profile_decode.py"), "--model", args.model,
               "--dtype", args.dtype, "--ncu", "--warmup", str(args.warmup), "--out", tmp,
               *(["--pkg", args.pkg] if args.pkg else [])]
        log("running " + " ".join(cmd[:3]) + " … " + " ".join(cmd[-8:]))
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"error: the profiled run took more than --timeout {args.timeout:g} s") from None
        if run.returncode != 0 or not rep.with_suffix(".ncu-rep").exists():
            tail = (run.stdout + run.stderr).strip().splitlines()[-5:]
            raise SystemExit(f"error: ncu exited with {run.returncode}: " + " | ".join(tail))
        details = subprocess.run([ncu, "-i", str(rep.with_suffix(".ncu-rep")), "--page", "details", "--csv"],
                                 capture_output=True, text=True, timeout=120)
        kernels = kernels_from_details(details.stdout)
        record = {**record_head("ncu-decode", args.commit, None),
                  "config": {"model": args.model, "dtype": args.dtype, "warmup": args.warmup,
                             "kernels": args.kernels, "match": args.match, "sections": list(SECTIONS),
                             "cache_control": "none", "clock_control": "none"},
                  "rows": kernels}
        path = write_record(record, out, f"ncu-decode-{args.model}-{args.dtype}")
        if args.keep_report:
            shutil.copy(rep.with_suffix(".ncu-rep"), path.with_suffix(".ncu-rep"))
    print(f"{'id':>3} {'kernel':40s} {'grid':>6} {'block':>5} {'us':>7} {'SM cycles':>9} {'DRAM%':>6} {'occ%':>5} {'cpi':>5}")
    for k in kernels:
        print(f"{k['id']:>3} {k['kernel'][:40]:40s} {k.get('grid') or 0:6.0f} {k.get('block') or 0:5.0f} "
              f"{k.get('us') or 0:7.2f} {k.get('sm_cycles') or 0:9.0f} {k.get('dram_pct') or 0:6.1f} "
              f"{k.get('achieved_occupancy_pct') or 0:5.1f} {k.get('cycles_per_issue') or 0:5.1f}")
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
