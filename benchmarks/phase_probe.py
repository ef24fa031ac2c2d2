"""What a grid-wide barrier costs against a kernel launch, for a stretch of small dependent kernels.

    python benchmarks/phase_probe.py [--out DIR] [--stretches 34] [--phases 4] [--commit SHA]

Between two GEMVs a decode layer runs a chain of small kernels (gemma3-4b: q norm + RoPE → attention →
combine → residual norm), each a launch whose cost is mostly latency. The plan in benchmarks/NOTES.md
runs such a stretch as one launch with grid-wide barriers between its phases. This probe measures that
premise on the GPU (benchmarks/phase_probe.cu): ``--stretches`` stretches of ``--phases`` dependent
RMSNorm phases (one block a row), in one CUDA graph, three ways:

* ``launches``: each phase its own kernel launch (what lum does today);
* ``phases``: one launch a stretch, as many blocks as rows, a barrier (an arrival counter in global
  memory, zeroed once at the start of the graph) between phases;
* ``phases-132``: the same with 132 blocks, one an SM (what a stretch that also holds a GEMV needs).

For two shapes: 8 rows of 256 (gemma's q heads) and 1 row of 2,560 (a residual norm). Printed and saved
(``<out>/phase-probe-<date>.json``): µs a stretch, µs a phase boundary, each mode against ``launches``
and whether the outputs equal ``launches``' bit for bit (they must).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import ProbeDevice, log, probe_parser, record_head, set_log_tag, write_record  # noqa: E402

set_log_tag("phase-probe")

SHAPES = ((8, 256), (1, 2560))      # (rows, n): one block a row
SMS = 132


def main(argv=None) -> int:
    ap = probe_parser(__doc__)
    ap.add_argument("--phases", type=int, default=4)
    args = ap.parse_args(argv)
    if args.stretches < 1 or not 2 <= args.phases <= 16:
        ap.error("--stretches must be >= 1 and --phases in [2, 16]")

    dev = ProbeDevice("phase_probe.cu")
    cu, stream, info = dev.cu, dev.stream, dev.info
    f_row, f_phases = dev.module.function("probe_row"), dev.module.function("probe_phases")
    rng = np.random.default_rng(0)

    rows_out = []
    s_count, phases = args.stretches, args.phases
    for rows, n in SHAPES:
        w = dev.upload((1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))
        bufs = [[dev.buffer(rows * n * 4) for _ in range(phases + 1)] for _ in range(s_count)]
        tables = [dev.upload(np.array([b.ptr for b in st], np.uint64)) for st in bufs]
        counters = dev.buffer(4 * s_count)
        start = rng.standard_normal((s_count, rows * n)).astype(np.float32)

        def record(mode: str):
            def rec(st) -> None:
                cu.memset(counters.ptr, 0, 4 * s_count, st)
                for s in range(s_count):
                    if mode == "launches":
                        for p in range(phases):
                            cu.launch_kernel(f_row, (rows, 1, 1), (256, 1, 1), 0, st,
                                             dev.pack([bufs[s][p].ptr, w.ptr, bufs[s][p + 1].ptr, rows, n]))
                    else:
                        grid = rows if mode == "phases" else SMS
                        cu.launch_kernel(f_phases, (grid, 1, 1), (256, 1, 1), 0, st,
                                         dev.pack([tables[s].ptr, w.ptr, counters.ptr + 4 * s, phases, rows, n]))
            return rec

        results, reference = {}, None
        for mode in ("launches", "phases", "phases-132"):
            for s in range(s_count):
                dev.write(bufs[s][0], start[s])
                for b in bufs[s][1:]:
                    cu.memset(b.ptr, 0xFF, rows * n * 4, stream)      # NaN: an unwritten output cannot pass
            graph = cu.Graph(stream, record(mode))
            graph.launch(stream)
            stream.synchronize()
            outs = [dev.read(bufs[s][phases], rows * n) for s in range(s_count)]
            if reference is None:
                reference = outs
            t = dev.timed(lambda: graph.launch(stream), args.reps)
            graph.close()
            results[mode] = {"stretch_us": round(t / s_count * 1e6, 3),
                             "per_phase_us": round(t / s_count / phases * 1e6, 3),
                             "equal_to_launches": all(np.array_equal(a, b) for a, b in zip(outs, reference)),
                             "finite": all(np.isfinite(a).all() for a in outs)}
        base = results["launches"]["stretch_us"]
        for mode, r in results.items():
            r["vs_launches"] = round(r["stretch_us"] / base, 4)
            log(f"rows {rows:2d} x {n:5d}  {mode:11s} {r['stretch_us']:8.2f} us a stretch of {phases} "
                f"({r['per_phase_us']:.2f} a phase, {r['vs_launches']:.3f}x)  equal={r['equal_to_launches']} "
                f"finite={r['finite']}")
        rows_out.append({"rows": rows, "n": n, "modes": results})
    record = {**record_head("phase-probe", args.commit, info.name), "stretches": s_count, "phases": phases,
              "rows": rows_out}
    log(f"wrote {write_record(record, args.out, 'phase-probe')}")
    dev.close()
    ok = all(r["equal_to_launches"] and r["finite"] for row in rows_out for r in row["modes"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
