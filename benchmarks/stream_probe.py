"""Whether a GEMV's weights, streamed into shared memory while a one-block kernel runs, beat two launches.

    python benchmarks/stream_probe.py [--out DIR] [--stretches 34] [--n 4096] [--reps 15] [--commit SHA]

The persistent kernel that benchmarks/NOTES.md points at rests on one claim: the SMs a small kernel leaves
idle can stream the next GEMV's weights into shared memory while it runs, so that the GEMV, once its input
is ready, runs from there. This probe measures that claim before anything is built on it
(benchmarks/stream_probe.cu). A stretch is gemma3-4b's residual norm (one block, 2,560 floats) and the
GEMV that reads it (W [n, 2560] bf16; n = 4,096 is the qkv projection, 21 MB). ``--stretches`` of them
form a chain (stretch s + 1 normalises stretch s's first 2,560 outputs), each with its own W, so that no
weight is in L2 from the stretch before, in one CUDA graph, three ways:

* ``launches``: the norm kernel, then a GEMV kernel (a warp a column, ten 16-byte loads a lane unrolled);
* ``fused``: one launch of n / 32 blocks, one an SM. Each block asks for its 32 rows of W
  (``cp.async.bulk`` into 160 KB of shared memory) at once, while block 0 runs the norm. It then waits for
  block 0's flag and for its rows, and runs the same dot from shared memory;
* ``fused-late``: the same kernel, with the rows asked for only after the flag (the control: what the
  overlap, not the one launch, gives).

Printed and saved (``<out>/stream-probe-<date>.json``): µs a stretch, its rate over the weight bytes, each
mode against ``launches``, and each mode's relative error against a float64 numpy chain (< 1e-4; NaN never
passes: outputs are poisoned before every mode).
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

set_log_tag("stream-probe")

K = 2560            # stream_probe.cu SP_K
COLS = 32           # SP_COLS: rows of W a fused block holds
THREADS = 256
MODES = ("launches", "fused", "fused-late")
TOLERANCE = 1e-4


def reference_chain(x0: np.ndarray, w: np.ndarray, weight_bits: list[np.ndarray]) -> list[np.ndarray]:
    """Each stretch's GEMV output in float64: y = x · rsqrt(mean(x²) + 1e-6) · w, out = W · y (W from its
    bfloat16 bits), and the next stretch's x is out[:K]."""
    outs, x, w = [], x0.astype(np.float64), w.astype(np.float64)
    for bits in weight_bits:
        y = x / np.sqrt(np.mean(x * x) + 1e-6) * w
        out = bf16_float(bits) @ y
        outs.append(out)
        x = out[:K]
    return outs


def main(argv=None) -> int:
    ap = probe_parser(__doc__)
    ap.add_argument("--n", type=int, default=4096, help="the GEMV's output columns, a multiple of 32 "
                    "(at most 132 × 32: one fused block an SM)")
    args = ap.parse_args(argv)
    n, s_count = args.n, args.stretches
    if s_count < 1 or n < K or n % COLS or n // COLS > 132:
        ap.error(f"--stretches must be >= 1 and --n a multiple of {COLS} in [{K}, {132 * COLS}]")

    dev = ProbeDevice("stream_probe.cu")
    cu, info = dev.cu, dev.info
    smem = COLS * K * 2 + K * 4 + 16
    f_norm, f_gemv = dev.module.function("sp_norm"), dev.module.function("sp_gemv")
    f_fused = dev.module.function("sp_fused", smem)
    rng = np.random.default_rng(0)

    norm_w = (1.0 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    x0 = rng.standard_normal(K).astype(np.float32)
    bits = [bf16_bits(rng.uniform(-1, 1, (n, K)).astype(np.float32) / np.sqrt(K)) for _ in range(s_count)]
    want = reference_chain(x0, norm_w, bits)

    w_buf, x_buf = dev.upload(norm_w), dev.upload(x0)
    W_bufs = [dev.upload(b) for b in bits]
    y_bufs = [dev.buffer(K * 4) for _ in range(s_count)]
    out_bufs = [dev.buffer(n * 4) for _ in range(s_count)]
    flags = dev.buffer(4 * s_count)

    def capture(mode: str):
        def rec(st) -> None:
            cu.memset(flags.ptr, 0, 4 * s_count, st)
            for s in range(s_count):
                x = x_buf.ptr if s == 0 else out_bufs[s - 1].ptr
                if mode == "launches":
                    cu.launch_kernel(f_norm, (1, 1, 1), (THREADS, 1, 1), 0, st, dev.pack([x, w_buf.ptr, y_bufs[s].ptr]))
                    cu.launch_kernel(f_gemv, (n // (THREADS // 32), 1, 1), (THREADS, 1, 1), 0, st,
                                     dev.pack([y_bufs[s].ptr, W_bufs[s].ptr, out_bufs[s].ptr, n]))
                else:
                    cu.launch_kernel(f_fused, (n // COLS, 1, 1), (THREADS, 1, 1), smem, st,
                                     dev.pack([x, w_buf.ptr, y_bufs[s].ptr, W_bufs[s].ptr, out_bufs[s].ptr,
                                               flags.ptr + 4 * s, int(mode == "fused")]))
        return rec

    weight_bytes = n * K * 2
    results = {}
    for mode in MODES:
        t, err, finite = dev.chain(capture(mode), ((y_bufs, K * 4), (out_bufs, n * 4)), out_bufs, n, want, args.reps)
        results[mode] = stretch_result(t, s_count, weight_bytes, err, finite, TOLERANCE)
    base = results["launches"]["stretch_us"]
    for mode, r in results.items():
        r["vs_launches"] = round(r["stretch_us"] / base, 4)
        log(f"n {n}  {mode:10s} {r['stretch_us']:8.2f} us a stretch ({r['weight_TBps']:.2f} TB/s of weights, "
            f"{r['vs_launches']:.3f}x)  rel err {r['rel_err']:.2e}  ok={r['ok']}")
    record = {**record_head("stream-probe", args.commit, info.name), "stretches": s_count, "n": n, "k": K,
               "weight_bytes_per_stretch": weight_bytes, "modes": results}
    log(f"wrote {write_record(record, args.out, 'stream-probe')}")
    dev.close()
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
