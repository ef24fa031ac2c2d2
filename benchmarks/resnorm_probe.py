"""Whether gemma3-4b's residual kernel after o can leave the chain: both norms from per-block sums of o's kernel.

    python benchmarks/resnorm_probe.py [--out DIR] [--stretches 34] [--reps 15]

A stretch is a decode layer from o to gate-up at gemma3-4b's shapes (benchmarks/resnorm_probe.cu): o = Wo · a
([2560, 2560] bf16; gemma3-4b's o is 2,048 wide), the residual h = x + o ⊙ wp · r_o, gate-up's input
u = h ⊙ wf · r_h (both RMS norms over the 2,560 features), then gate-up ([2 × 10240, 2560] bf16, h = g · 2σ(u)
as in ffn_probe.py). The next stretch's x is this one's h, so the stretches form a chain, in one CUDA graph,
launched programmatically as lum launches its kernels; the weights alternate between two copies, so that none
is in L2. Modes:

* ``three``: o, then a one-block kernel computing both norms (lum's layout today: 2.30 µs of link in the
  1bdef08 stamps, no weight bytes), then gate-up;
* ``sums``: o's blocks also add Σ o², Σ x · o ⊙ wp, Σ (o ⊙ wp)² and Σ x² into four 64-bit fixed-point sums
  and write A = x ⊙ wf, B = o ⊙ wp ⊙ wf; gate-up's blocks take r_o from Σ o² and
  Σ h² = Σ x² + 2 r_o Σ x · o ⊙ wp + r_o² Σ (o ⊙ wp)², form u = (A + B r_o) r_h themselves and read one more
  vector than in ``three``. No kernel between o and gate-up.
* ``sums-bf16``: the same with A and B stored in bf16, as lum would store them (the model's dtype): what each
  gate-up block reads for them halves;
* ``raw``: o's blocks add only the four sums; gate-up's blocks form u = (x + o ⊙ wp · r_o) ⊙ wf · r_h from x, o
  (float) and the norms' bf16 weights: no vector is written for gate-up, and each of its blocks reads four.

The question (benchmarks/NOTES.md, "A candidate for the next session"): is ``sums`` shorter a stretch by
about the residual kernel's link, or does gate-up's prologue, paid in each of its waves, take it back (as the
norm computed in gate-up's prologue did at de0e5f3)?

Printed and saved (``<out>/resnorm-probe-<date>.json``): µs a stretch, each mode against ``three``, and each
mode's error against float64 (each stretch from the GPU's own x; gate-up's output and the next x; outputs
poisoned with NaN before every mode, so an unwritten output cannot pass).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import (ProbeDevice, bf16_bits, bf16_round, log, probe_parser, record_head, set_log_tag,  # noqa: E402
                     stretch_result, write_record)
from ffn_probe import ROWS_AN_ITEM, THREADS, dense_sets, unit_weights  # noqa: E402

set_log_tag("resnorm-probe")

N, K, H = 2560, 2560, 10240                  # resnorm_probe.cu RN_N, RN_K; ffn_probe.cu FP_H
EPS = 1e-6
MODES = ("three", "sums", "sums-bf16", "raw")
COPIES = 2
TOLERANCE = 1e-4
BF16_TOLERANCE = 2e-2             # sums-bf16: gate-up's input from A and B rounded to bf16 (2^-8 each)


def stretch(x: np.ndarray, a: np.ndarray, wp: np.ndarray, wf: np.ndarray, wo: np.ndarray, wg: np.ndarray,
            wu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One stretch in float64: (gate-up's output, the residual h: the next stretch's x)."""
    o = wo @ a
    h = x + o * wp / np.sqrt(np.mean(o * o) + EPS)
    u = h * wf / np.sqrt(np.mean(h * h) + EPS)
    g, v = wg @ u, wu @ u
    return 2.0 * g / (1.0 + np.exp(-np.clip(v, -80.0, 80.0))), h


def sum_of_h_squares(x: np.ndarray, o: np.ndarray, wp: np.ndarray) -> float:
    """Σ h² of h = x + o ⊙ wp · r_o from the four sums ``sums`` adds up (resnorm_probe.cu rn_gateup_sums)."""
    ro = 1.0 / np.sqrt(np.sum(o * o) / len(o) + EPS)
    op = o * wp
    return float(np.sum(x * x) + 2.0 * ro * np.sum(x * op) + ro * ro * np.sum(op * op))


def check(acts: list[np.ndarray], xs: list[np.ndarray], x0: np.ndarray, a: np.ndarray, norms, dense,
          order) -> tuple[float, bool]:
    """(the largest error of a stretch's output or next x relative to its largest value, all finite), each
    stretch's reference computed in float64 from the GPU's own x (the chain's gates amplify rounding stretch by
    stretch: see ffn_probe.check)."""
    errs, x = [], x0.astype(np.float64)
    for got_act, got_x, i in zip(acts, xs, order):
        want_act, want_h = stretch(x, a, *norms, *dense[i])
        errs += [float(np.max(np.abs(got_act - want_act)) / np.max(np.abs(want_act))),
                 float(np.max(np.abs(got_x - want_h)) / np.max(np.abs(want_h)))]
        x = got_x
    finite = all(np.isfinite(v).all() for v in (*acts, *xs))     # NaN stays NaN (fails)
    return float(np.max(errs)), finite


def main(argv=None) -> int:
    ap = probe_parser(__doc__)
    args = ap.parse_args(argv)
    if args.stretches < 2:
        ap.error("--stretches must be >= 2")
    dev = ProbeDevice("ffn_probe.cu", extra=(HERE / "resnorm_probe.cu").read_text())
    cu, n = dev.cu, args.stretches
    rng = np.random.default_rng(0)
    sets = [tuple(unit_weights(rng, r, k) for r, k in ((N, K), (H, N), (H, N))) for _ in range(COPIES)]
    order = [s % COPIES for s in range(n)]
    dense = dense_sets(sets)
    a = rng.standard_normal(K).astype(np.float32)
    x0 = rng.standard_normal(N).astype(np.float32)
    norms = tuple(bf16_round(rng.uniform(0.5, 1.5, N)) for _ in range(2))    # (1 + w) of both norms, bf16 values
    bufs = [tuple(dev.upload(w) for w in s) for s in sets]
    a_buf, wp_buf, wf_buf = dev.upload(a), dev.upload(norms[0]), dev.upload(norms[1])
    wpb_buf, wfb_buf = (dev.upload(bf16_bits(v)) for v in norms)                   # the same values in bf16 (raw)
    x_bufs = [dev.upload(x0)] + [dev.buffer(N * 4) for _ in range(n)]       # x of each stretch, then the last h
    act_bufs = [dev.buffer(H * 4) for _ in range(n)]
    o_buf, u_buf, A_buf, B_buf, C_buf = (dev.buffer(N * 4) for _ in range(5))
    sums = dev.buffer(n * 32)                    # four 64-bit sums a stretch, zeroed at the graph's start
    f = {name: dev.module.function(name) for name in ("rn_o", "rn_resnorm", "fp_gateup", "rn_o_sums",
                                                      "rn_gateup_sums", "rn_o_sums_bf16", "rn_gateup_sums_bf16",
                                                      "rn_o_raw", "rn_gateup_raw")}
    blocks = ((N // ROWS_AN_ITEM, 1, 1), (THREADS, 1, 1))
    items = ((H // ROWS_AN_ITEM, 1, 1), (THREADS, 1, 1))
    wbytes = (N * K + 2 * H * N) * 2
    results = {}
    for mode in MODES:
        def rec(st, mode=mode) -> None:
            if mode != "three":
                cu.memset(sums.ptr, 0, n * 32, st)
            for s in range(n):
                wo, wg, wu = (b.ptr for b in bufs[order[s]])
                x, h = x_bufs[s].ptr, x_bufs[s + 1].ptr
                if mode == "three":
                    cu.launch_kernel(f["rn_o"], *blocks, 0, st, dev.pack([a_buf.ptr, wo, o_buf.ptr]), programmatic=s > 0)
                    cu.launch_kernel(f["rn_resnorm"], (1, 1, 1), (256, 1, 1), 0, st,
                                     dev.pack([x, o_buf.ptr, wp_buf.ptr, wf_buf.ptr, h, u_buf.ptr]), programmatic=True)
                    cu.launch_kernel(f["fp_gateup"], *items, 0, st, dev.pack([u_buf.ptr, wg, wu, act_bufs[s].ptr]),
                                     programmatic=True)
                elif mode == "raw":
                    sm = sums.ptr + 32 * s
                    cu.launch_kernel(f["rn_o_raw"], *blocks, 0, st,
                                     dev.pack([a_buf.ptr, wo, x, wp_buf.ptr, o_buf.ptr, sm]), programmatic=s > 0)
                    cu.launch_kernel(f["rn_gateup_raw"], *items, 0, st,
                                     dev.pack([sm, x, o_buf.ptr, wpb_buf.ptr, wfb_buf.ptr, wg, wu, act_bufs[s].ptr,
                                               h]), programmatic=True)
                else:
                    sm, suffix = sums.ptr + 32 * s, "_bf16" if mode == "sums-bf16" else ""
                    cu.launch_kernel(f["rn_o_sums" + suffix], *blocks, 0, st,
                                     dev.pack([a_buf.ptr, wo, x, wp_buf.ptr, wf_buf.ptr, A_buf.ptr, B_buf.ptr,
                                               C_buf.ptr, sm]), programmatic=s > 0)
                    cu.launch_kernel(f["rn_gateup_sums" + suffix], *items, 0, st,
                                     dev.pack([sm, A_buf.ptr, B_buf.ptr, x, C_buf.ptr, wg, wu, act_bufs[s].ptr, h]),
                                     programmatic=True)

        def checked(acts):
            xs = [dev.read(b, N).astype(np.float64) for b in x_bufs[1:]]
            return check(acts, xs, x0, a.astype(np.float64), tuple(v.astype(np.float64) for v in norms), dense, order)

        t, err, finite = dev.chain(rec, ((act_bufs, H * 4), (x_bufs[1:], N * 4)), act_bufs, H, None, args.reps,
                                   check=checked)
        tolerance = BF16_TOLERANCE if mode == "sums-bf16" else TOLERANCE
        results[mode] = stretch_result(t, n, wbytes, err, finite, tolerance)
    base = results["three"]["stretch_us"]
    for mode, r in results.items():
        r["vs_three"] = round(r["stretch_us"] / base, 4)
        r["saved_us"] = round(base - r["stretch_us"], 3)
        log(f"{mode:9s} {r['stretch_us']:8.2f} us a stretch ({r['weight_TBps']:.2f} TB/s of weights, "
            f"{r['vs_three']:.3f}x, {r['saved_us']:+.2f} us saved)  rel err {r['rel_err']:.2e}  ok={r['ok']}")
    record = {**record_head("resnorm-probe", args.commit, dev.info.name), "stretches": n, "weight_bytes": wbytes,
              "modes": results}
    log(f"wrote {write_record(record, args.out, 'resnorm-probe')}")
    dev.close()
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
