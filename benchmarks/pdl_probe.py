"""What programmatic dependent launch gives a decode step when kernels preload their weights before they wait.

    python benchmarks/pdl_probe.py [--out DIR] [--layers 34] [--commit SHA]

A gemma3-4b decode layer in miniature (benchmarks/pdl_probe.cu): the four weight GEMVs at their real
shapes (qkv 4,096 × 2,560, o 2,560 × 2,048, gate-up 20,480 × 2,560, down 2,560 × 10,240, bf16) with
one-block RMSNorm row kernels between them where the layer has its small kernels (three after qkv,
one after o, one after down), each layer with weights of its own (6.4 GB over 34 layers, so every
GEMV reads HBM). The whole stack is one CUDA graph, launched in five modes:

* ``plain``: ordinary launches (what lum does today);
* ``pdl``: programmatic stream serialization; every kernel triggers its dependents first and waits
  (``griddepcontrol.wait``) before its first read of the stream's data;
* ``pdl+preload``: as ``pdl``, and before the wait each GEMV block copies the first rows of its share
  of W into shared memory (``cp.async.bulk``) and the row kernel loads its weight;
* ``pdl+l2``: as ``pdl``, the GEMV asking L2 for the same bytes (``cp.async.bulk.prefetch``) instead;
* ``preload``: the shared-memory copy without PDL (what the copy itself costs or gives).

Printed and saved (``<out>/pdl-probe-<date>.json``): per mode the step time (median of the graph's
replays ÷ layers), its ratio to ``plain``, the weight floor (bytes ÷ the copy bandwidth measured in the
same run), and for each mode whether its outputs equal ``plain``'s bit for bit (they must: the same
sums in the same order).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import ProbeDevice, add_record_args, log, record_head, set_log_tag, write_record  # noqa: E402

set_log_tag("pdl-probe")

# (name, n, k, blocks, preload rows per block): blocks × preload rows × k × 2 bytes is the shared
# memory the GEMV asks for before it waits (a block's share rounded up fits in 227 KB per SM).
GEMVS = (("qkv", 4096, 2560, 396, 11), ("o", 2560, 2048, 264, 10),
         ("gate_up", 20480, 2560, 264, 12), ("down", 2560, 10240, 264, 3))
NORMS_AFTER = {"qkv": 3, "o": 1, "gate_up": 0, "down": 1}   # one-block row kernels after each GEMV
MODES = {"plain": 0, "pdl": 1, "pdl+preload": 3, "pdl+l2": 5, "preload": 2}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_record_args(ap)
    ap.add_argument("--layers", type=int, default=34)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)

    dev = ProbeDevice("pdl_probe.cu")
    cu, drv, stream, info, timed = dev.cu, dev.drv, dev.stream, dev.info, dev.timed
    f_gemv, f_norm = dev.module.function("probe_gemv"), dev.module.function("probe_norm")
    smem_max = max(r * k * 2 for _, n, k, _, r in GEMVS)
    cu.call(drv.cuFuncSetAttribute, f_gemv,
            drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_max)

    rng = np.random.default_rng(0)
    big = dev.buffer(1 << 30)
    half = 1 << 29
    copy_bps = 2 * half / timed(lambda: cu.memcpy_dtod(big.ptr + half, big.ptr, half, stream), 10)
    log(f"{info.name}: copy {copy_bps / 1e9:.0f} GB/s")

    # one random bf16 matrix per shape, copied to every layer's weight (random bits, finite values)
    weight_bytes = 0
    weights: dict[str, list] = {}
    for name, n, k, _, _ in GEMVS:
        w = (rng.standard_normal(n * k, dtype=np.float32) * 0.05).view(np.uint32) >> 16
        src = dev.upload(w.astype(np.uint16))
        weights[name] = []
        for _ in range(args.layers):
            b = dev.buffer(n * k * 2)
            cu.call(drv.cuMemcpyDtoD, b.ptr, src.ptr, n * k * 2)
            weights[name].append(b)
        weight_bytes += n * k * 2 * args.layers
    kmax = max(max(n, k) for _, n, k, _, _ in GEMVS)
    acts = [dev.upload(rng.standard_normal(kmax, dtype=np.float32)) for _ in range(8)]
    norm_w = dev.upload((1.0 + 0.1 * rng.standard_normal(2560)).astype(np.float32))

    def launch(fn, grid: int, smem: int, params: int, pdl: bool) -> None:
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = 256, 1, 1
        cfg.sharedMemBytes = smem
        cfg.hStream = stream.handle
        if pdl:
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg.attrs = [attr]
            cfg.numAttrs = 1
        else:
            cfg.numAttrs = 0
        cu.call(drv.cuLaunchKernelEx, cfg, fn, params, 0)

    def record_stack(mode: int):
        def record(st) -> None:
            x = 0
            for layer in range(args.layers):
                for name, n, k, blocks, rows in GEMVS:
                    y = (x + 1) % len(acts)
                    smem = rows * k * 2 if mode & 2 else 0
                    launch(f_gemv, blocks, smem, dev.pack([weights[name][layer].ptr, acts[x].ptr, acts[y].ptr,
                                                           n, k, mode, rows]), bool(mode & 1))
                    x = y
                    for _ in range(NORMS_AFTER[name]):
                        y = (x + 1) % len(acts)
                        launch(f_norm, 1, 0, dev.pack([acts[x].ptr, norm_w.ptr, acts[y].ptr, 2560, mode]),
                               bool(mode & 1))
                        x = y
        return record

    init = [rng.standard_normal(kmax, dtype=np.float32) for _ in acts]
    rows = []
    reference = None
    kernels = args.layers * sum(1 + NORMS_AFTER[g[0]] for g in GEMVS)
    for label, mode in MODES.items():
        for a, h in zip(acts, init):
            dev.write(a, h)
        graph = cu.Graph(stream, record_stack(mode))
        graph.launch(stream)
        stream.synchronize()
        outs = [dev.read(a, kmax) for a in acts]
        if reference is None:
            reference = outs
        equal = all(np.array_equal(a, b, equal_nan=False) for a, b in zip(outs, reference))
        finite = all(np.isfinite(a).all() for a in outs)
        t = timed(lambda: graph.launch(stream), args.reps)
        graph.close()
        row = {"mode": label, "step_ms": round(t * 1e3, 4), "per_layer_us": round(t / args.layers * 1e6, 2),
               "equal_to_plain": bool(equal), "finite": bool(finite)}
        rows.append(row)
        log(f"{label:12s} {row['step_ms']:.3f} ms a stack ({row['per_layer_us']:.1f} µs a layer) "
            f"equal={equal} finite={finite}")
    base = rows[0]["step_ms"]
    for r in rows:
        r["vs_plain"] = round(r["step_ms"] / base, 4)
    floor_ms = weight_bytes / copy_bps * 1e3
    record = {**record_head("pdl-probe", args.commit, info.name),
              "copy_GBps": round(copy_bps / 1e9), "layers": args.layers, "kernels": kernels,
              "weight_bytes": weight_bytes, "floor_ms": round(floor_ms, 4),
              "gemvs": [dict(zip(("name", "n", "k", "blocks", "preload_rows"), g)) for g in GEMVS],
              "rows": rows}
    print(json.dumps(record, indent=1))
    log(f"floor {floor_ms:.3f} ms; wrote {write_record(record, args.out, 'pdl-probe')}")
    dev.close()
    return 0 if all(r["equal_to_plain"] and r["finite"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
