"""Decode GEMV (m = 1, x @ W^T, W [n, k] row-major) over lum's gemv.cu tuning space, on the real shapes.

    python benchmarks/gemv_sweep.py [--dtype bf16] [--out DIR] [--shapes gemma3-4b,llama3-1b]

For every (n, k) of a model's decode projections (and their fused QKV / gate-up forms), every
combination of threads, group (threads per output, split-K) and unroll is compiled with NVRTC and
timed as a CUDA graph of back-to-back launches over weight copies that together exceed the L2 cache
(so each launch reads its weight from HBM, as in decode). Reports GB/s (weight + x + y bytes over the
median launch time) beside a device-to-device copy measured in the same run, the codegen default's
rate and the best configuration's; the JSON record goes to ``<out>/gemv-sweep-<dtype>-<date>.json``.
This is what codegen's default GEMV choice (``_Gen._gemv_group``) is calibrated against.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import _commit, _driver, log, set_log_tag  # noqa: E402

set_log_tag("gemv-sweep")

SHAPES = {   # (n, k) of each decode projection, then the fused forms
    "gemma3-4b": {"q": (2048, 2560), "kv": (1024, 2560), "o": (2560, 2048), "gate/up": (10240, 2560),
                  "down": (2560, 10240), "qkv": (4096, 2560), "gate+up": (20480, 2560)},
    "llama3-1b": {"q": (2048, 2048), "kv": (512, 2048), "o": (2048, 2048), "gate/up": (8192, 2048),
                  "down": (2048, 8192), "qkv": (3072, 2048), "gate+up": (16384, 2048)},
}
THREADS = (None, 128, 256, 512)   # None: codegen's default (_default_threads)
GROUPS = (None, 32, 64, 128, 256)
UNROLLS = (4, 8)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--shapes", default="gemma3-4b,llama3-1b")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--commit", default=None)
    args = ap.parse_args(argv)

    from lum.builder import nvrtc
    from lum.builder.codegen import CodegenError, generate
    from lum.format.dtypes import DType
    from lum.format.expr import as_expr
    from lum.format.llir import Arg, LOp
    from lum.format.shapetracker import ShapeTracker
    from lum.loader.cuda import driver as cu
    from lum.loader.cuda.plan import ParamPack

    dt = DType.parse(args.dtype)
    info = cu.device_info(0)
    ctx = cu.Context(0)
    stream = cu.Stream()
    drv = cu.drv
    ev = [cu.call(drv.cuEventCreate, int(drv.CUevent_flags.CU_EVENT_DEFAULT)) for _ in range(2)]
    owned: list = []

    def timed(fn, reps: int) -> float:
        fn()
        stream.synchronize()
        times = []
        for _ in range(reps):
            cu.call(drv.cuEventRecord, ev[0], stream.handle)
            fn()
            cu.call(drv.cuEventRecord, ev[1], stream.handle)
            cu.call(drv.cuEventSynchronize, ev[1])
            times.append(float(cu.call(drv.cuEventElapsedTime, ev[0], ev[1])) * 1e-3)
        return sorted(times)[len(times) // 2]

    def buf(nbytes: int) -> cu.DeviceBuffer:
        b = cu.DeviceBuffer(nbytes, "gemv sweep")
        owned.append(b)
        cu.memset(b.ptr, 0x3F, nbytes, stream)
        return b

    record = {"benchmark": "gemv-sweep", "commit": args.commit or _commit(), "gpu": info.name, "driver": _driver(),
              "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "dtype": dt.value,
              "rows": []}
    try:
        big = buf(1 << 30)
        half = 1 << 29
        record["copy_GBps"] = round(2 * half / timed(lambda: cu.memcpy_dtod(big.ptr + half, big.ptr, half, stream), 10) / 1e9)
        log(f"{info.name}: copy {record['copy_GBps']} GB/s")
        for model in args.shapes.split(","):
            for proj, (n, k) in SHAPES[model].items():
                flat = ShapeTracker.contiguous((n * k,))
                op = LOp(2, "gemm", "Gemm", (Arg(0, flat), Arg(1, flat)), (as_expr(1), as_expr(1), as_expr(n)), dt,
                         {"layout": "RmCm", "m": as_expr(1), "n": as_expr(n), "k": as_expr(k), "lda": as_expr(k),
                          "ldb": as_expr(k)})
                wbytes = n * k * dt.itemsize
                copies = max(2, -(-(256 << 20) // wbytes))
                ws = [buf(wbytes) for _ in range(copies)]
                x, y, dyn = buf(k * dt.itemsize), buf(n * 4), buf(8)
                packs = [ParamPack([y.ptr, x.ptr, w.ptr, dyn.ptr]) for w in ws]
                results = []
                for threads, group, unroll in itertools.product(THREADS, GROUPS, UNROLLS):
                    try:
                        ks = generate(op, [], arg_dtypes=[dt, dt], threads=threads, group=group, unroll=unroll)
                    except CodegenError:
                        continue
                    mod = cu.Module(nvrtc.compile_cuda(ks.source, info.sm).cubin, "gemv sweep")
                    fn = mod.function(ks.launches[0].kernel)
                    grid = tuple(g.evaluate({}) for g in ks.grid)
                    reps = 4 * copies

                    def record_launches(s, fn=fn, grid=grid, ks=ks):
                        for i in range(reps):
                            cu.launch_kernel(fn, grid, ks.block, 0, s, packs[i % copies].address)

                    graph = cu.Graph(stream, record_launches)
                    t = timed(lambda: graph.launch(stream), 7) / reps
                    graph.close()
                    mod.close()
                    gbps = (wbytes + (k + n) * dt.itemsize) / t / 1e9
                    results.append({"threads": threads, "group": group, "unroll": unroll,
                                    "chosen_threads": ks.tuning["threads"], "chosen_group": ks.tuning["group"],
                                    "us": round(t * 1e6, 2),
                                    "GBps": round(gbps)})
                for b in ws:
                    b.close()
                    owned.remove(b)
                best = max(results, key=lambda r: r["GBps"])
                default = next(r for r in results if r["threads"] is None and r["group"] is None and r["unroll"] == 4)
                record["rows"].append({"model": model, "proj": proj, "n": n, "k": k, "best": best,
                                       "default": default, "all": results})
                log(f"{model:10s} {proj:8s} n={n:6d} k={k:6d}  default {default['GBps']:5d} GB/s "
                    f"({default['us']:6.2f} us, threads {default['chosen_threads']} group {default['chosen_group']})  best {best['GBps']:5d} GB/s "
                    f"({best['us']:6.2f} us: threads {best['chosen_threads']} group {best['chosen_group']} unroll {best['unroll']})")
    finally:
        stream.synchronize()
        for o in reversed(owned):
            o.close()
        for e in ev:
            cu.call(drv.cuEventDestroy, e)
        stream.close()
        ctx.close()
    out = Path(args.out) / f"gemv-sweep-{dt.value}-{_dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
