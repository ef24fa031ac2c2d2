"""What a kernel pays to fetch its instructions on an SM that has not run it lately (the instruction caches).

    python benchmarks/icache_probe.py [--reps 20] [--out DIR] [--commit SHA]

Why: the latency-bound kernels between a decode layer's qkv and its FFN take two to three times what their loads
and instructions count: gemma3-4b's attention stage 1.8 µs from its wait for one L2 round trip and a warp's
reduction, its merge 1.1 µs with no global load (benchmarks/NOTES.md, the stamps of 2026-12-07). Those kernels
are straight-line code, unrolled by codegen (decode attention with its stage: 50 KB of SASS, the combine inside o
22 KB), run once a layer on few SMs, with ≈ 130 KB of other kernels' code between two runs. If each
instruction-cache miss waits for L2, code size is time on the chain.

The probe (benchmarks/icache_probe.cu): kernels of 8, 16, 32 and 64 KB of independent FFMAs in a straight line,
one warp a block, a block an SM; each block's thread 0 reads %globaltimer around the straight line. Three states
before the timed launch, each in one stream: ``warm`` (the same kernel just ran on every SM), ``cold-small`` (a
33 KB kernel of other code ran in between) and ``cold-large`` (225 KB of other code, more than a gemma3-4b
layer's seven kernels). Printed and saved (``<out>/icache-probe-<date>.json``): per size and state the median and the
90th percentile over blocks and repetitions of the straight line's ns, and the ns a KB; the outputs are checked
against float64 (finite, relative error under 1e-4), and each kernel's .text size is read from the cubin.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import ProbeDevice, log, probe_parser, record_head, set_log_tag, text_sizes, write_record  # noqa: E402

set_log_tag("icache-probe")
PROBES = {"8k": 64, "16k": 128, "32k": 256, "64k": 512}         # name -> STEPS (icache_probe.cu)
EVICTORS = {"small": (256, 1009), "large": (1280, 2003)}       # name -> (STEPS, SALT): 33 and 225 KB of code
STATES = ("warm", "cold-small", "cold-large")
THREADS = 32


def expected_sums(steps: int, salt: int, threads: int) -> np.ndarray:
    """float64 of what each thread of icache_run<steps, salt> stores (the 8 chains' sum)."""
    x = 0.25 + 0.001 * (np.arange(threads)[:, None] + 32 * np.arange(8)[None, :]).astype(np.float64)
    x = x.astype(np.float32).astype(np.float64)
    for i in range(steps):
        c = 0.5 + ((i * 8 + np.arange(8) + salt) % 4093) / 8192.0
        x = x * c + 0.0009765625
    return x.sum(axis=1)


def main(argv: list[str] | None = None) -> int:
    ap = probe_parser(__doc__)
    args = ap.parse_args(argv)
    dev = ProbeDevice("icache_probe.cu")
    cu, stream, info = dev.cu, dev.stream, dev.info
    try:
        sizes = text_sizes(dev.cubin)
        blocks = info.multiprocessors
        out = dev.buffer(blocks * THREADS * 4)
        times = dev.buffer(blocks * 3 * 8)
        fns = {f"icache_probe_{k}": dev.module.function(f"icache_probe_{k}") for k in PROBES}
        fns.update({f"icache_evict_{k}": dev.module.function(f"icache_evict_{k}") for k in EVICTORS})
        params = dev.pack([out.ptr, times.ptr])

        def launch(name: str) -> None:
            cu.launch_kernel(fns[name], (blocks, 1, 1), (THREADS, 1, 1), 0, stream, params)

        rows = []
        ok = True
        for probe, steps in PROBES.items():
            want = np.tile(expected_sums(steps, 0, THREADS), blocks)
            for state in STATES:
                spans, sms = [], set()
                for _ in range(args.reps):
                    launch(f"icache_probe_{probe}" if state == "warm" else "icache_evict_" + state[len("cold-"):])
                    cu.memset(out.ptr, 0xFF, blocks * THREADS * 4, stream)     # NaN: a block that did not run fails
                    launch(f"icache_probe_{probe}")
                    stream.synchronize()
                    t = dev.read(times, blocks * 3, "uint64").reshape(blocks, 3)
                    spans.extend((t[:, 1] - t[:, 0]).tolist())
                    sms.update(t[:, 2].tolist())
                    got = dev.read(out, blocks * THREADS).astype(np.float64)
                    err = float(np.max(np.abs(got - want) / np.abs(want))) if np.isfinite(got).all() else float("inf")
                    ok = ok and err < 1e-4
                kb = steps * 8 * 16 / 1024
                med, p90 = float(np.median(spans)), float(np.percentile(spans, 90))
                row = {"probe": probe, "state": state, "code_KB": kb, "median_ns": round(med, 1),
                       "p90_ns": round(p90, 1), "ns_per_KB": round(med / kb, 1), "sms": len(sms)}
                rows.append(row)
                log(f"{probe:>4} {state:>9}: median {med:8.0f} ns, p90 {p90:8.0f} ns ({med / kb:6.1f} ns a KB; "
                    f"{len(sms)} SMs)")
    finally:
        dev.close()
    record = {**record_head("icache-probe", args.commit, info.name), "sms": info.multiprocessors,
              "threads": THREADS, "reps": args.reps, "text_bytes": sizes, "checked": ok, "rows": rows}
    log(f"outputs against float64: {'ok' if ok else 'FAILED'}; wrote {write_record(record, args.out, 'icache-probe')}")
    print(json.dumps(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
