"""What decode attention's combine costs between attention and o, and what o split by head would save.

    python benchmarks/o_combine_probe.py [--out DIR] [--commit SHA] [--ns 10,55] [--layers 34] [--reps 15]

Why: in a gemma3-4b decode layer the combine of attention's chunk partials is a kernel of its own between
attention and o (2.0 µs of link at the benchmark's past on the H200, 4.4 µs at p ≈ 870 on the H100,
benchmarks/NOTES.md). Taking it into o as o's prologue makes each of o's blocks read every head's partials
unless o is split over k by head; split so, the heads' column partials must then be summed. This probe
measures that kernel (benchmarks/o_combine_probe.cu ``probe_o_combine``: a thread block cluster of 8 blocks
a group of 64 columns, block h combining head h and dotting it with its weights, copied into shared memory
before its wait; the cluster sums the heads through distributed shared memory) against lum's own combine and
o kernels, generated here by lum's builder for gemma3-4b bf16, in a chain that stands for the layer around
them. ``--layers`` links, one CUDA graph, every launch programmatic as in lum's decode step:

* ``kernels``: attention's stand-in → lum's combine → lum's o → a one-block RMSNorm (the residual kernel's
  stand-in), what lum runs today;
* ``fused``: the stand-in → ``probe_o_combine`` → the norm;
* ``o-alone``: the stand-in → lum's o on a combined input computed before → the norm: o with no combine
  before it, the floor the fused kernel is measured against; ``o-alone-cluster``: the same o launched in
  clusters of 8 blocks (it uses nothing of them): what a cluster launch itself costs in the chain;
* ``fused-push``: the same, each block storing its columns into the shared memory of the block that sums
  them, one cluster barrier, each block summing its own;
* ``fused-atomic``: the fused kernel adding each head's columns into o's output (``red.global.add``, fire and
  forget; the stand-in zeroes it first), no cluster barrier: the heads' sum in an order that varies;
* ``fused-no-partials`` and ``fused-no-sum``: the fused kernel without reading the partials (A = 1), or
  without the heads' sum (head 0's block stores its own columns): where its time goes (timing only, their
  outputs are wrong and not checked).

The stand-in waits, lets the next kernel launch after ``--stage-ns`` (lum's attention triggers after its
stage) and ends after ``--attention-ns``, touching no memory, on lum's attention grid (4 kv rows × the chunks).
Weights: 8 sets of o's 10.5 MB, taken in turn, so none stays in L2. Each ``--ns`` is a number of chunks of
16 keys (the past p = 16·ns − 1). Every o output is checked against float64 (the combine rounded to bf16, as
lum's combine stores it), all outputs poisoned with NaN first. Printed and saved
(``<out>/o-combine-probe-<date>.json``): µs a link, each mode against ``kernels``, the largest error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import (ProbeDevice, add_record_args, bf16_bits, bf16_round, decode_layer_kernels, log,  # noqa: E402
                     record_head, set_log_tag, write_record)

set_log_tag("o-combine-probe")

HEADS, D, N, CHUNK = 8, 256, 2560, 16      # gemma3-4b: query heads, head dim, o's output columns, keys a chunk
K = HEADS * D
COLS = 64                                   # output columns a cluster (o_combine_probe.cu OC_COLS)
SETS = 8
TOLERANCE = 1e-2                           # of the largest |o|: A is bf16, so a rounding tie may fall either way
MODES = ("kernels", "fused", "fused-push", "fused-atomic", "o-alone", "o-alone-cluster", "fused-no-partials",
         "fused-no-sum")
FUSED_VARIANT = {"fused": 0, "fused-no-partials": 1, "fused-no-sum": 2, "fused-atomic": 3, "fused-push": 4}
TIMING_ONLY = ("fused-no-partials", "fused-no-sum")     # their outputs are wrong


def partials(rng: np.random.Generator, ns: int) -> np.ndarray:
    """Chunk partials as decode attention leaves them: [heads][ns][acc[0..256), c, l], c an integer offset (the
    log2 domain), l in [1, 16) the chunk's sum at that offset, acc its weighted values."""
    p = np.empty((HEADS, ns, D + 2), np.float32)
    p[..., D] = rng.integers(-6, 7, (HEADS, ns))
    p[..., D + 1] = rng.uniform(1.0, 16.0, (HEADS, ns))
    p[..., :D] = rng.standard_normal((HEADS, ns, D)) * p[..., D + 1:D + 2]
    return p


def combine_ref(p: np.ndarray) -> np.ndarray:
    """The combined attention output [heads · 256] in float64, rounded to bf16 (lum's combine stores bf16)."""
    p = p.astype(np.float64)
    c = p[..., D]
    e = np.exp2(c - c.max(axis=1, keepdims=True))
    a = (e[..., None] * p[..., :D]).sum(axis=1) / (e * p[..., D + 1]).sum(axis=1)[:, None]
    return bf16_round(a.reshape(-1).astype(np.float32)).astype(np.float64)


def check(outs: list[np.ndarray], wants: list[np.ndarray]) -> tuple[float, bool]:
    """(largest error of a link's o relative to its largest |o|, every output finite)."""
    err = max(float(np.max(np.abs(g - w)) / np.max(np.abs(w))) for g, w in zip(outs, wants))
    return err, all(bool(np.isfinite(g).all()) for g in outs)


def lum_kernels(max_seq: int):
    """lum's combine and o kernels (KernelSource) of gemma3-4b's bf16 decode layer, and the dyn vars."""
    prog, ks, dv = decode_layer_kernels("gemma3-4b", max_seq)
    (cid,) = [i for i, k in ks.items() if k is not None and k.kind == "reduce" and k.tuning.get("online")]
    (oid,) = [o.id for o in prog.ops if o.kind == "gemm" and o.args[0].src == cid]
    return ks[cid], ks[oid], dv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_record_args(ap)
    ap.add_argument("--ns", default="10,55", help="chunks of 16 keys, comma-separated (p = 16·ns − 1)")
    ap.add_argument("--layers", type=int, default=34)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--stage-ns", type=int, default=1700)
    ap.add_argument("--attention-ns", type=int, default=4500)
    args = ap.parse_args(argv)
    try:
        counts = [int(x) for x in args.ns.split(",")]
    except ValueError:
        ap.error("--ns takes integers, comma-separated")
    if args.layers < 1 or not counts or min(counts) < 1 or max(counts) > 256:
        ap.error("--layers must be >= 1 and each --ns in [1, 256]")

    combine, o, dyn_vars = lum_kernels(max_seq=CHUNK * max(counts))
    dev = ProbeDevice("o_combine_probe.cu", extra=combine.body + "\n" + o.body)
    cu, info = dev.cu, dev.info
    f_att, f_norm = dev.module.function("probe_attention_standin"), dev.module.function("probe_consumer")
    f_fused = dev.module.function("probe_o_combine")
    f_comb, f_o = dev.module.function(combine.name), dev.module.function(o.name)
    regs = {name: int(cu.call(dev.drv.cuFuncGetAttribute,
                              dev.drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, f))
            for name, f in (("fused", f_fused), ("combine", f_comb), ("o", f_o))}
    log(f"registers a thread: {regs}")
    rng = np.random.default_rng(0)
    wsets = [(0.02 * rng.standard_normal((N, K))).astype(np.float32) for _ in range(SETS)]
    w_dev = [dev.upload(bf16_bits(w)) for w in wsets]
    w64 = [bf16_round(w).astype(np.float64) for w in wsets]
    norm_w = dev.upload((1.0 + 0.1 * rng.standard_normal(N)).astype(np.float32))
    minus_one = dev.upload(np.array([-1.0], np.float32))
    layers = args.layers

    rows = []
    for ns in counts:
        p = CHUNK * ns - 1
        dyn = np.zeros(max(1, len(dyn_vars)), np.int64)
        dyn[dyn_vars.index("p")] = p
        dyn_dev = dev.upload(dyn)
        parts = [partials(rng, ns) for _ in range(layers)]
        part_dev = [dev.upload(x) for x in parts]
        wants = [w64[i % SETS] @ combine_ref(parts[i]) for i in range(layers)]
        a_dev = [dev.buffer(K * 2) for _ in range(layers)]
        o_dev = [dev.buffer(N * 4) for _ in range(layers)]
        y_dev = [dev.buffer(N * 4) for _ in range(layers)]
        att_grid = (4 * ns, 1, 1)
        c_grid, c_block, c_smem = combine.launches[0].evaluate({"p": p})
        o_grid, o_block, o_smem = o.launches[0].evaluate({"p": p})

        def record(mode: str):
            def rec(st) -> None:
                for i in range(layers):
                    cu.launch_kernel(f_att, att_grid, (128, 1, 1), 0, st,
                                     dev.pack([args.stage_ns, args.attention_ns, o_dev[i].ptr,
                                               N if mode == "fused-atomic" else 0]), programmatic=True)
                    if mode.startswith("fused"):
                        cu.launch_kernel(f_fused, (HEADS * N // COLS, 1, 1), (D, 1, 1), 0, st,
                                         dev.pack([o_dev[i].ptr, part_dev[i].ptr, w_dev[i % SETS].ptr, ns, N,
                                                   FUSED_VARIANT[mode]]),
                                         programmatic=True, cluster=HEADS)
                    else:
                        if mode == "kernels":
                            cu.launch_kernel(f_comb, c_grid, c_block, c_smem, st,
                                             dev.pack([a_dev[i].ptr, part_dev[i].ptr, part_dev[i].ptr,
                                                       part_dev[i].ptr, minus_one.ptr, dyn_dev.ptr]),
                                             programmatic=True)
                        cu.launch_kernel(f_o, o_grid, o_block, o_smem, st,
                                         dev.pack([o_dev[i].ptr, a_dev[i].ptr, w_dev[i % SETS].ptr, dyn_dev.ptr]),
                                         programmatic=True, cluster=HEADS if mode.endswith("-cluster") else 1)
                    cu.launch_kernel(f_norm, (1, 1, 1), (256, 1, 1), 0, st,
                                     dev.pack([o_dev[i].ptr, norm_w.ptr, y_dev[i].ptr, N]), programmatic=True)
            return rec

        modes = {}
        for mode in MODES:            # o-alone reads the combined inputs the kernels mode left in a_dev
            t, err, finite = dev.chain(record(mode), [(o_dev, N * 4)], o_dev, N, None, args.reps,
                                       check=lambda got: check(got, wants))
            modes[mode] = {"us_per_link": round(t / layers * 1e6, 3), "err": err, "finite": finite}
        base = modes["kernels"]["us_per_link"]
        for mode, r in modes.items():
            r["minus_kernels_us"] = round(r["us_per_link"] - base, 3)
            log(f"ns {ns:3d} (p = {p:4d})  {mode:8s} {r['us_per_link']:7.2f} us a link  "
                f"({r['minus_kernels_us']:+.2f} against kernels)  err {r['err']:.2e}  finite={r['finite']}")
        rows.append({"ns": ns, "p": p, "modes": modes})
    rec = {**record_head("o-combine-probe", args.commit, info.name), "layers": layers,
           "stage_ns": args.stage_ns, "attention_ns": args.attention_ns,
           "lum_kernels": {"combine": combine.name, "o": o.name, "o_tuning": o.tuning}, "registers": regs,
           "rows": rows}
    log(f"wrote {write_record(rec, args.out, 'o-combine-probe')}")
    dev.close()
    ok = all(r["finite"] and r["err"] < TOLERANCE for row in rows for m, r in row["modes"].items()
             if m not in TIMING_ONLY)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
