"""Whether a persistent GEMV that streams its weights through a shared-memory ring beats lum's register dot.

    python benchmarks/ring_probe.py [--out DIR] [--stretches 34] [--reps 15] [--shapes o,qkv,gate-up,down]

A stretch is a one-block RMSNorm (the small kernel between a decode layer's GEMVs) and the GEMV that reads
it, at gemma3-4b's four decode shapes; ``--stretches`` of them form a chain (each norm reads the previous
GEMV's output) in one CUDA graph, the weights rotating among enough copies that none is in L2 from the last
use (benchmarks/ring_probe.cu). Four modes:

* ``reg``: the register GEMV (a warp a row, all of a lane's 16-byte loads unrolled), plain launches;
* ``reg-pdl``: the same launched programmatically (each kernel waits first, as lum's do);
* ``reg-pre``: ``reg-pdl`` whose lanes load their first weight vectors (the whole row but for down: 16 of
  40) into registers before the wait, so that those bytes stream while the norm runs;
* ``ring``: the persistent ring GEMV (one block an SM; a producer warp's cp.async.bulk copies into S
  stages, eight consumer warps), plain launches;
* ``ring-pdl``: the ring launched programmatically: its producer streams the first stages while the norm
  runs; only the consumers wait for it.

Printed and saved (``<out>/ring-probe-<date>.json``): µs a stretch, the rate over the weight bytes, each mode
against ``reg-pdl``, and each mode's error against a float64 chain (< 1e-4; NaN never passes: outputs are
poisoned before every mode). The question it answers: what the persistent-kernel route of NOTES.md can gain
per GEMV before anything is built on it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import (ProbeDevice, bf16_bits, bf16_float, log, probe_parser, record_head, set_log_tag, stretch_result,  # noqa: E402
                     write_record)

set_log_tag("ring-probe")

THREADS = 256
SHAPES = {"o": (2560, 2048), "qkv": (4096, 2560), "gate-up": (20480, 2560), "down": (2560, 10240)}   # (n, K)
RING = {2048: (8, 5), 2560: (8, 4), 10240: (2, 4)}      # K -> (rows a stage, stages): ring_probe.cu RP_SHAPE
MODES = ("reg", "reg-pdl", "reg-pre", "ring", "ring-pdl")
L2_BYTES = 60 << 20
TOLERANCE = 1e-4


def reference_chain(x0, norm_w, weights, order) -> list[np.ndarray]:
    """Each stretch's GEMV output in float64: y[k] = x[k % len(x)] · rsqrt(mean(...²) + 1e-6) · w[k],
    out = W · y (W from its bfloat16 bits), and the next stretch's x is out."""
    outs, x, w = [], x0.astype(np.float64), norm_w.astype(np.float64)
    dense = [bf16_float(b) for b in weights]
    k = len(norm_w)
    for i in order:
        xk = x[np.arange(k) % len(x)]
        y = xk / np.sqrt(np.mean(xk * xk) + 1e-6) * w
        x = dense[i] @ y
        outs.append(x)
    return outs


def run_shape(dev, name: str, stretches: int, reps: int, rng) -> dict:
    cu, sms = dev.cu, dev.info.multiprocessors
    n, k = SHAPES[name]
    rows, stages = RING[k]
    smem = stages * rows * k * 2 + k * 4 + stages * 8 * 4 + 2 * stages * 8
    f_norm, f_ring = dev.module.function("rp_norm"), dev.module.function(f"rp_ring_{k}", smem)
    f_regs = {False: dev.module.function(f"rp_reg_{k}"), True: dev.module.function(f"rp_regpre_{k}")}
    wbytes = n * k * 2
    copies = max(2, -(-2 * L2_BYTES // wbytes))
    order = [s % copies for s in range(stretches)]
    norm_w = (1.0 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    x0 = rng.standard_normal(k).astype(np.float32)
    weights = [bf16_bits(rng.uniform(-1, 1, (n, k)).astype(np.float32) / np.sqrt(k)) for _ in range(copies)]
    want = reference_chain(x0, norm_w, weights, order)
    w_buf, x_buf = dev.upload(norm_w), dev.upload(x0)
    W_bufs = [dev.upload(b) for b in weights]
    y_bufs = [dev.buffer(k * 4) for _ in range(stretches)]
    out_bufs = [dev.buffer(n * 4) for _ in range(stretches)]

    def capture(mode: str):
        pdl, ring, pre = mode.endswith(("-pdl", "-pre")), mode.startswith("ring"), mode == "reg-pre"

        def rec(st) -> None:
            for s in range(stretches):
                x, xn = (x_buf.ptr, k) if s == 0 else (out_bufs[s - 1].ptr, n)
                cu.launch_kernel(f_norm, (1, 1, 1), (THREADS, 1, 1), 0, st,
                                 dev.pack([x, xn, w_buf.ptr, y_bufs[s].ptr, k, int(pdl)]), programmatic=pdl and s > 0)
                args = dev.pack([y_bufs[s].ptr, W_bufs[order[s]].ptr, out_bufs[s].ptr, n, int(pdl)])
                if ring:
                    cu.launch_kernel(f_ring, (min(sms, n // rows), 1, 1), (THREADS + 32, 1, 1), smem, st, args,
                                     programmatic=pdl)
                else:
                    cu.launch_kernel(f_regs[pre], (n // (THREADS // 32), 1, 1), (THREADS, 1, 1), 0, st, args,
                                     programmatic=pdl)
        return rec

    results = {}
    for mode in MODES:
        t, err, finite = dev.chain(capture(mode), ((y_bufs, k * 4), (out_bufs, n * 4)), out_bufs, n, want, reps)
        results[mode] = stretch_result(t, stretches, wbytes, err, finite, TOLERANCE)
    base = results["reg-pdl"]["stretch_us"]
    for mode, r in results.items():
        r["vs_reg_pdl"] = round(r["stretch_us"] / base, 4)
        log(f"{name:8s} {mode:9s} {r['stretch_us']:8.2f} us a stretch ({r['weight_TBps']:.2f} TB/s of weights, "
            f"{r['vs_reg_pdl']:.3f}x)  rel err {r['rel_err']:.2e}  ok={r['ok']}")
    return {"n": n, "k": k, "rows_a_stage": rows, "stages": stages, "smem": smem, "weight_bytes": wbytes,
            "weight_copies": copies, "modes": results}


def main(argv=None) -> int:
    ap = probe_parser(__doc__)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    args = ap.parse_args(argv)
    names = [s for s in args.shapes.split(",") if s]
    if args.stretches < 2 or any(s not in SHAPES for s in names):
        ap.error(f"--stretches must be >= 2 and --shapes of {', '.join(SHAPES)}")
    dev = ProbeDevice("ring_probe.cu")
    rng = np.random.default_rng(0)
    shapes = {name: run_shape(dev, name, args.stretches, args.reps, rng) for name in names}
    record = {**record_head("ring-probe", args.commit, dev.info.name), "stretches": args.stretches, "shapes": shapes}
    log(f"wrote {write_record(record, args.out, 'ring-probe')}")
    dev.close()
    return 0 if all(r["ok"] for s in shapes.values() for r in s["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
