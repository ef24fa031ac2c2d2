"""Compile time of the e-graph stage: saturate + extract every group of real model configs.

    python benchmarks/compile_time.py [--models gemma3-4b llama3-8b] [--out benchmarks/results]

For each model (``load_spec(random_name=...)``: the real config, random weights that are never read)
and each entry graph (prefill, decode), every group is saturated with the rule files and extracted
by the cost model (``lum.builder.compile.compile_graph``). Prints a table and writes
``<out>/compile_time-<date>.json`` with the commit, machine, date, per-group e-classes / e-nodes /
seconds and per-model totals. The target is < 30 s per model on a CPU.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import git, git_dirty  # noqa: E402

TARGET_SECONDS = 30.0


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def bench_model(name: str) -> dict:
    from lum.builder.compile import compile_graph
    from lum.builder.models import load_spec

    t0 = time.perf_counter()
    spec = load_spec(random_name=name)
    t_graphs = time.perf_counter() - t0
    entries = {}
    total = 0.0
    for entry, graph in spec.graphs.items():
        t = time.perf_counter()
        compiled = compile_graph(graph)
        wall = time.perf_counter() - t
        total += wall
        groups = []
        for cg in compiled:
            s = cg.stats
            groups.append({
                "hash": cg.group.hash[:16], "chunks": len(cg.group), "hlir_nodes": s["hlir_nodes"],
                "eclasses": s["eclasses"], "enodes": s["enodes"], "decisions": s["decisions"],
                "seconds_saturate": round(s["seconds_saturate"], 4),
                "seconds_extract": round(s["seconds_extract"], 4),
                "seconds": round(s["seconds"], 4),
                "llir_ops": s["llir_ops"], "gemms": s["gemms"], "in_place": s["in_place"],
            })
        entries[entry] = {"hlir_nodes": len(graph), "groups": groups, "seconds": round(wall, 4),
                          "eclasses": sum(g["eclasses"] for g in groups),
                          "enodes": sum(g["enodes"] for g in groups)}
    return {"model": name, "seconds_build_graphs": round(t_graphs, 3), "entries": entries,
            "seconds_saturate_extract": round(total, 4), "target_seconds": TARGET_SECONDS,
            "within_target": total < TARGET_SECONDS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gemma3-4b", "llama3-8b"])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--no-save", action="store_true", help="print only")
    args = ap.parse_args(argv)

    import egglog  # noqa: F401  (fail early without the [build] extra)

    from lum.builder.egraph import saturate  # noqa: F401
    from lum.builder.hlir import Graph

    # one-time cost (parse the rule files, load them into the base e-graph), reported separately
    t = time.perf_counter()
    from lum.builder import frontend as F
    from lum.builder.compile import compile_group

    g = Graph("warmup")
    F.output(F.input_tensor(g, "x", [2], "f32") * 2.0, "y")
    compile_group(g)
    setup = time.perf_counter() - t

    date = _dt.datetime.now(_dt.timezone.utc)
    result = {"benchmark": "compile_time", "commit": git("rev-parse", "HEAD") or "unknown", "dirty": git_dirty(),
              "date": date.isoformat(),
              "machine": _machine(), "seconds_setup": round(setup, 4), "models": []}
    ok = True
    print(f"setup (parse rules, base e-graph): {setup:.3f} s")
    for name in args.models:
        r = bench_model(name)
        result["models"].append(r)
        ok &= r["within_target"]
        print(f"\n{name}: saturate + extract every group: {r['seconds_saturate_extract']:.3f} s "
              f"(target < {TARGET_SECONDS:.0f} s) {'OK' if r['within_target'] else 'TOO SLOW'}")
        print(f"  {'entry':8s} {'group':>5s} {'chunks':>6s} {'nodes':>6s} {'e-classes':>9s} {'e-nodes':>8s} "
              f"{'choices':>7s} {'saturate s':>10s} {'extract s':>9s} {'gemms':>5s} {'in-place':>8s}")
        for entry, e in r["entries"].items():
            for i, grp in enumerate(e["groups"]):
                print(f"  {entry:8s} {i:5d} {grp['chunks']:6d} {grp['hlir_nodes']:6d} {grp['eclasses']:9d} "
                      f"{grp['enodes']:8d} {grp['decisions']:7d} {grp['seconds_saturate']:10.3f} "
                      f"{grp['seconds_extract']:9.3f} {grp['gemms']:5d} {grp['in_place']:8d}")
            print(f"  {entry:8s} total: {e['eclasses']} e-classes, {e['enodes']} e-nodes, {e['seconds']:.3f} s")
    if not args.no_save:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"compile_time-{date.strftime('%Y-%m-%d')}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
