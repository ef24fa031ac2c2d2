"""Whether gemma3-4b's decode FFN streams faster as one persistent kernel than as two GEMV launches.

    python benchmarks/ffn_probe.py [--out DIR] [--stretches 34] [--reps 15]

A stretch is the FFN of a decode layer without its norms, at gemma3-4b's shapes: gate-up (two [10240, 2560]
bf16 GEMVs and h = g · 2σ(u)) then down ([2560, 10240]); ``--stretches`` of them form a chain (each reads the
one before's output) in one CUDA graph, the weights alternating between two copies so that none is in L2
(157 MB a stretch; benchmarks/ffn_probe.cu). Modes:

* ``two``: gate-up then down, two kernels launched programmatically (as lum's GEMVs: a block an item, each
  kernel triggering as it starts and waiting before its reads); ``two-plain``: the same launched plainly;
* ``fused1`` / ``fused2`` / ``fused4``: one persistent kernel (the blocks the SMs hold at once) walking the
  gate-up items then the down items, down's K split in S = 1 / 2 / 4 slices: a down item starts as soon
  as the gate-up items of its h slice are counted done, so down's weights stream while gate-up's last
  items finish (no kernel boundary, no drain between them);
* ``sliced`` / ``sliced128``: one kernel of one block an SM (132 / 128 blocks) with no wait between blocks:
  block b computes h over its own rows (H / blocks of them) and adds its partial of down over those rows into
  out with float atomics, from down's weight stored transposed (its rows contiguous); out is zeroed by a memset
  node at the chain's start. Gate-up's and down's weights stream as one pass, with one ramp and one tail;
* ``sliced-fixed``: the same (132 blocks) adding its partials as 64-bit fixed point (integer sums: the same in
  any order), the last block to finish converting them into out and zeroing them for the next stretch;
* ``sliced-rm``: ``sliced`` over down's weight as stored ([N2, H] row-major, as lum's GEMVs read it), 128 blocks
  of 80 rows: each output's part of a block a 160-byte run of its row.

Why: lum's gate-up and down each stream at ≈ 3.9 TB/s (26.4 and 14.0 µs isolated, 27.0 and 13.6 in the
step), where the LM head, the same GEMV code over 1.3 GB, streams at 4.5 TB/s. The sweep's two gate-up
sizes say each launch pays ≈ 3.2 µs beside a 4.5 TB/s stream (NOTES.md). If ``fused2`` beats ``two`` by
about one such launch (≈ 3 µs a stretch), a fused FFN kernel is the lever for gemma3-4b's 80%.

Printed and saved (``<out>/ffn-probe-<date>.json``): µs a stretch, the rate over the weight bytes, each mode
against ``two``, each mode's error against float64 (each stretch from the GPU's previous output; < 1e-4;
outputs poisoned with NaN before every mode, so an unwritten output cannot pass) and whether a down item's
wait ever gave up (a bug if so).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import ProbeDevice, add_record_args, log, record_head, set_log_tag, write_record  # noqa: E402
from ring_probe import bf16_bits  # noqa: E402

set_log_tag("ffn-probe")

THREADS, ROWS_AN_ITEM = 128, 4
K1, H, N2 = 2560, 10240, 2560                 # ffn_probe.cu FP_K1, FP_H, FP_N2
MODES = ("two", "two-plain", "fused1", "fused2", "fused4", "sliced", "sliced128", "sliced-fixed", "sliced-rm")
SLICED_THREADS = 640                          # ffn_probe.cu FS_T
COPIES = 2
TOLERANCE = 1e-4


def unit_weights(rng, n: int, k: int) -> np.ndarray:
    """bf16 bits of uniform weights scaled so that a row's dot keeps a unit vector's scale."""
    return bf16_bits(rng.uniform(-1.0, 1.0, (n, k)).astype(np.float32) * np.float32(np.sqrt(3.0 / k)))


def dense_sets(sets) -> list[tuple[np.ndarray, ...]]:
    """The weights as float64 from their bfloat16 bits."""
    return [tuple((w.astype(np.uint32) << 16).view(np.float32).astype(np.float64) for w in s) for s in sets]


def stretch(x: np.ndarray, wg: np.ndarray, wu: np.ndarray, wd: np.ndarray) -> np.ndarray:
    """One stretch in float64: out = Wd · (g · 2σ(u)), g = Wg · x, u = Wu · x."""
    g, u = wg @ x, wu @ x
    return wd @ (2.0 * g / (1.0 + np.exp(-np.clip(u, -80.0, 80.0))))


def check(outs: list[np.ndarray], x0: np.ndarray, dense, order) -> tuple[float, bool]:
    """(the largest error of a stretch's out relative to its largest value, all finite), each stretch's
    reference computed in float64 from the GPU's own previous out: the chain grows and its gates (σ of
    large u) amplify a rounding difference stretch by stretch, so a reference of the whole chain from x0
    drifts from any float32 run (a first run here had every mode 1.5–2 off by stretch 34)."""
    errs, x = [], x0.astype(np.float64)
    for got, i in zip(outs, order):
        want = stretch(x, *dense[i])
        errs.append(float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
        x = got
    return float(np.max(errs)), all(np.isfinite(o).all() for o in outs)     # NaN stays NaN (fails)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_record_args(ap)
    ap.add_argument("--stretches", type=int, default=34)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    if args.stretches < 2:
        ap.error("--stretches must be >= 2")
    dev = ProbeDevice("ffn_probe.cu")
    cu, drv, n = dev.cu, dev.drv, args.stretches
    rng = np.random.default_rng(0)
    sets = [tuple(unit_weights(rng, n, k) for n, k in ((H, K1), (H, K1), (N2, H))) for _ in range(COPIES)]
    order = [s % COPIES for s in range(n)]
    x0 = rng.standard_normal(K1).astype(np.float32)
    dense = dense_sets(sets)
    bufs = [tuple(dev.upload(w) for w in s) for s in sets]
    wdt_bufs = [dev.upload(np.ascontiguousarray(s[2].T)) for s in sets]     # down's weight transposed [H, N2]
    x_buf = dev.upload(x0)
    h_bufs = [dev.buffer(H * 4) for _ in range(n)]
    out_bufs = [dev.buffer(N2 * 4) for _ in range(n)]
    err_buf = dev.buffer(4)
    f_gu, f_dn = dev.module.function("fp_gateup"), dev.module.function("fp_down")
    f_sl, f_sf = dev.module.function("fp_sliced"), dev.module.function("fp_sliced_fixed")
    f_rm = dev.module.function("fp_sliced_rm")
    fix_buf = dev.buffer(N2 * 8)                # sliced-fixed's sums (zeroed once; the kernel re-zeroes them)
    sms = dev.info.multiprocessors
    wbytes = (2 * H * K1 + N2 * H) * 2
    results = {}
    for mode in MODES:
        fused, sliced = mode.startswith("fused"), mode.startswith("sliced")
        slices = int(mode[5:]) if fused else 1
        ctr = dev.buffer(n * 16)
        cu.memset(ctr.ptr, 0, n * 16, dev.stream)
        cu.memset(err_buf.ptr, 0, 4, dev.stream)
        f = dev.module.function(f"fp_fused_{slices}") if fused else None
        per_sm = [cu.call(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor, g, t, 0)
                  for g, t in (((f_sl, SLICED_THREADS),) if sliced else ((f, THREADS),) if fused
                               else ((f_gu, THREADS), (f_dn, THREADS)))]
        grid = sms * per_sm[0] if fused else (int(mode[6:]) if mode[6:].isdigit() else sms) if sliced else 0
        if mode == "sliced-rm":
            grid = H // 80                          # ffn_probe.cu FS_RM_R rows a block
        fixed = mode == "sliced-fixed"
        if fixed:
            cu.memset(fix_buf.ptr, 0, N2 * 8, dev.stream)
        pdl = mode != "two-plain"

        def rec(st, fused=fused, sliced=sliced, fixed=fixed, f=f, grid=grid, pdl=pdl, ctr=ctr) -> None:
            if sliced and not fixed:
                for b in out_bufs:
                    cu.memset(b.ptr, 0, N2 * 4, st)
            for s in range(n):
                x = x_buf.ptr if s == 0 else out_bufs[s - 1].ptr
                wg, wu, wd = (b.ptr for b in bufs[order[s]])
                if fixed:
                    cu.launch_kernel(f_sf, (grid, 1, 1), (SLICED_THREADS, 1, 1), 0, st,
                                     dev.pack([x, wg, wu, wdt_bufs[order[s]].ptr, out_bufs[s].ptr, fix_buf.ptr,
                                               ctr.ptr]), programmatic=s > 0)
                    continue
                if mode == "sliced-rm":
                    cu.launch_kernel(f_rm, (grid, 1, 1), (SLICED_THREADS, 1, 1), 0, st,
                                     dev.pack([x, wg, wu, wd, out_bufs[s].ptr]), programmatic=s > 0)
                    continue
                if sliced:
                    cu.launch_kernel(f_sl, (grid, 1, 1), (SLICED_THREADS, 1, 1), 0, st,
                                     dev.pack([x, wg, wu, wdt_bufs[order[s]].ptr, out_bufs[s].ptr]),
                                     programmatic=s > 0)
                    continue
                if fused:
                    cu.launch_kernel(f, (grid, 1, 1), (THREADS, 1, 1), 0, st,
                                     dev.pack([x, wg, wu, h_bufs[s].ptr, wd, out_bufs[s].ptr, ctr.ptr + 16 * s,
                                               ctr.ptr + 16 * ((s + 1) % n), err_buf.ptr]),
                                     programmatic=s > 0)
                    continue
                cu.launch_kernel(f_gu, (H // ROWS_AN_ITEM, 1, 1), (THREADS, 1, 1), 0, st,
                                 dev.pack([x, wg, wu, h_bufs[s].ptr]), programmatic=pdl and s > 0)
                cu.launch_kernel(f_dn, (N2 // ROWS_AN_ITEM, 1, 1), (THREADS, 1, 1), 0, st,
                                 dev.pack([h_bufs[s].ptr, wd, out_bufs[s].ptr]), programmatic=pdl)

        t, err, finite = dev.chain(rec, ((h_bufs, H * 4), (out_bufs, N2 * 4)), out_bufs, N2, None, args.reps,
                                   check=lambda got: check(got, x0, dense, order))
        dev.stream.synchronize()
        gave_up = bool(dev.read(err_buf, 1, "uint32")[0])
        us = t / n * 1e6
        results[mode] = {"stretch_us": round(us, 3), "weight_TBps": round(wbytes / (us * 1e-6) / 1e12, 3),
                         "grid": grid or None, "blocks_an_sm": per_sm, "rel_err": err, "finite": finite,
                         "wait_gave_up": gave_up, "ok": finite and err < TOLERANCE and not gave_up}
    base = results["two"]["stretch_us"]
    for mode, r in results.items():
        r["vs_two"] = round(r["stretch_us"] / base, 4)
        log(f"{mode:9s} {r['stretch_us']:8.2f} us a stretch ({r['weight_TBps']:.2f} TB/s of weights, "
            f"{r['vs_two']:.3f}x)  grid {r['grid']}  blocks an SM {r['blocks_an_sm']}  rel err {r['rel_err']:.2e}  "
            f"ok={r['ok']}")
    record = {**record_head("ffn-probe", args.commit, dev.info.name), "stretches": n, "weight_bytes": wbytes,
              "modes": results}
    log(f"wrote {write_record(record, args.out, 'ffn-probe')}")
    dev.close()
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
