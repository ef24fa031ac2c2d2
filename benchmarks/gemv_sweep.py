"""Decode GEMV (m = 1, x @ W^T, W [n, k] row-major) over lum's gemv.cu tuning space, on the real shapes.

    python benchmarks/gemv_sweep.py [--dtype bf16] [--out DIR] [--shapes gemma3-4b,llama3-1b]
        [--projs qkv,o,down] [--threads default,256,512] [--groups default,64] [--loads 4:0,4:4,4:0:1]
        [--max-blocks default,16032,8016]

For every (n, k) of a model's decode projections (and their fused QKV / gate-up forms), every
combination of threads, group (threads per output, split-K) and loads (``unroll:inflight[:preload]``:
the compiler-unrolled loop, or ``inflight`` vector loads a lane issues ahead; ``preload`` N: each lane's
first N weight vectors loaded into registers before the wait, templates/gemv.cu PRELOAD, here without a
kernel before it) is compiled with NVRTC and
timed as a CUDA graph of back-to-back launches over weight copies that together exceed the L2 cache
(so each launch reads its weight from HBM, as in decode). Reports GB/s (weight + x + y bytes over the
median launch time) beside a device-to-device copy measured in the same run, the codegen default's
rate and the best configuration's; the JSON record goes to ``<out>/gemv-sweep-<dtype>-<date>.json``.
This is what codegen's default GEMV choice (``GemvKernels._gemv_group``, builder/gemv_codegen.py) is calibrated against.

``--mode prologue`` times GEMV prologues instead (builder/prologue.py): per decode shape, the pair a
decode step runs without them (the one-row kernel that computes the GEMV's input, an RMSNorm of an f32
row for the qkv / gate-up shapes, the gated activation of gate-up's output for down, then the GEMV)
against one GEMV computing that input itself, over threads × group × grid cap; the record is
``gemv-prologue-sweep-<dtype>-<date>.json``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import EventTimer, add_record_args, log, record_head, set_log_tag, write_record  # noqa: E402

set_log_tag("gemv-sweep")

SHAPES = {   # (n, k) of each decode projection, then the fused forms and the LM head
    "gemma3-4b": {"q": (2048, 2560), "kv": (1024, 2560), "o": (2560, 2048), "gate/up": (10240, 2560),
                  "down": (2560, 10240), "qkv": (4096, 2560), "gate+up": (20480, 2560),
                  "lm_head": (262144, 2560)},
    "llama3-1b": {"q": (2048, 2048), "kv": (512, 2048), "o": (2048, 2048), "gate/up": (8192, 2048),
                  "down": (2048, 8192), "qkv": (3072, 2048), "gate+up": (16384, 2048),
                  "lm_head": (128256, 2048)},
}
THREADS = (None, 128, 256, 512)   # None: codegen's default (_default_threads)
GROUPS = (None, 32, 64, 128, 256)
LOADS = ((4, 0, 0), (8, 0, 0), (4, 4, 0), (4, 8, 0), (4, 0, 1))   # (unroll, inflight, preload); (4, 0, 0): default
PROLOGUE_SHAPES = {"gemma3-4b": {"qkv": ("norm", 4096, 2560), "gate+up": ("norm", 20480, 2560),
                                 "down": ("gated", 2560, 10240)},
                   "llama3-1b": {"qkv": ("norm", 3072, 2048), "gate+up": ("norm", 16384, 2048),
                                 "down": ("gated", 2048, 8192)}}
PROLOGUE_SPACE = {"threads": (None, 256, 512), "group": (None, 64), "max_blocks": (132, 264, 65536),
                  "inflight": (0, 4), "preload": (0, 1)}


def prologue_ops(kind: str, n: int, k: int, dt):
    """(producer, gemv, fused gemv) LLIR ops of one decode shape. Inputs: op 0 the row (x f32 [k], or
    gate-up's f32 output [2k]), op 1 the norm weight, op 2 two f32 constants, op 3 the weight [n, k]."""
    from lum.format.dtypes import DType
    from lum.format.expr import as_expr
    from lum.format.llir import Arg, LOp
    from lum.format.shapetracker import ShapeTracker

    row = ShapeTracker.contiguous((as_expr(1), as_expr(k)))
    const = [ShapeTracker(row.shape, (as_expr(0), as_expr(0)), as_expr(j), None) for j in (0, 1)]
    if kind == "norm":
        leaves = (Arg(0, row), Arg(1, row), Arg(2, const[0]), Arg(2, const[1]))
        inv = ["Recip", "f32", ["Sqrt", "f32", ["Add", "f32", ["Mul", "f32", ["RowSum", "f32", ["Mul", "f32", ["arg", 0],
                                                                                              ["arg", 0]]],
                                                              ["arg", 2]], ["arg", 3]]]]
        expr = ["Cast", dt.value, ["Mul", "f32", ["Mul", "f32", ["arg", 0], inv], ["Cast", "f32", ["arg", 1]]]]
    else:
        up = ShapeTracker(row.shape, row.strides, as_expr(k), None)
        leaves = (Arg(0, row), Arg(0, up), Arg(2, const[0]), Arg(2, const[1]))
        sig = ["Recip", "f32", ["Add", "f32", ["arg", 2], ["Exp2", "f32", ["Mul", "f32", ["arg", 0], ["arg", 3]]]]]
        expr = ["Cast", dt.value, ["Mul", "f32", ["Mul", "f32", sig, ["arg", 0]], ["arg", 1]]]
    producer = LOp(4, "elementwise", "Fused", leaves, row.shape, dt, {"expr": expr})
    params = {"layout": "RmCm", "m": as_expr(1), "n": as_expr(n), "k": as_expr(k), "lda": as_expr(k),
              "ldb": as_expr(k)}
    w = Arg(3, ShapeTracker.contiguous((as_expr(n * k),)))
    gemv = LOp(5, "gemm", "Gemm", (Arg(4, ShapeTracker.contiguous((as_expr(k),))), w),
               (as_expr(1), as_expr(1), as_expr(n)), DType.f32, params)
    fused = LOp(5, "gemm", "Gemm", (*leaves, w), gemv.shape, DType.f32, {**params, "expr": expr})
    return producer, gemv, fused


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--shapes", default="gemma3-4b,llama3-1b")
    add_record_args(ap)
    ap.add_argument("--mode", choices=("plain", "prologue"), default="plain",
                    help="plain: gemv.cu's tuning space; prologue: GEMV prologues against their unfused pair")
    ap.add_argument("--projs", default=None,
                    help="plain: only these projections (e.g. qkv,o,down,gate+up,lm_head)")
    ap.add_argument("--threads", default=None, help="plain: block sizes, 'default' for codegen's (default: %s)"
                    % ",".join("default" if t is None else str(t) for t in THREADS))
    ap.add_argument("--groups", default=None, help="plain: splits, 'default' for codegen's (default: %s)"
                    % ",".join("default" if g is None else str(g) for g in GROUPS))
    ap.add_argument("--loads", default=None, help="plain: unroll:inflight[:preload] (default: %s)"
                    % ",".join(":".join(map(str, v)) for v in LOADS))
    ap.add_argument("--max-blocks", default=None,
                    help="plain: grid caps, 'default' for codegen's (default: default only); a capped grid's blocks "
                         "walk several column tiles, e.g. an LM head's 64,128 one-tile blocks as 8,016 of eight")
    args = ap.parse_args(argv)

    def choices(text, default, what):
        if text is None:
            return default
        try:
            return tuple(None if v == "default" else int(v) for v in text.split(","))
        except ValueError:
            ap.error(f"--{what}: comma-separated integers or 'default', got {text!r}")

    threads_space, groups_space = choices(args.threads, THREADS, "threads"), choices(args.groups, GROUPS, "groups")
    caps_space = choices(args.max_blocks, (None,), "max-blocks")
    try:
        loads_space = LOADS if args.loads is None else tuple((*t, 0)[:3] for t in (
            tuple(int(x) for x in v.split(":")) for v in args.loads.split(",")) if len(t) in (2, 3))
        assert args.loads is None or len(loads_space) == len(args.loads.split(","))
    except (ValueError, AssertionError):
        ap.error(f"--loads: comma-separated unroll:inflight[:preload], got {args.loads!r}")
    projs = None if args.projs is None else set(args.projs.split(","))

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
    timed = EventTimer(cu, stream)
    owned: list = []

    def buf(nbytes: int) -> cu.DeviceBuffer:
        b = cu.DeviceBuffer(nbytes, "gemv sweep")
        owned.append(b)
        cu.memset(b.ptr, 0x3F, nbytes, stream)
        return b

    record = {**record_head("gemv-sweep", args.commit, info.name), "dtype": dt.value, "rows": []}
    try:
        big = buf(1 << 30)
        half = 1 << 29
        record["copy_GBps"] = round(2 * half / timed(lambda: cu.memcpy_dtod(big.ptr + half, big.ptr, half, stream), 10) / 1e9)
        log(f"{info.name}: copy {record['copy_GBps']} GB/s")
        for model in args.shapes.split(",") if args.mode == "prologue" else ():
            for proj, (kind, n, k) in PROLOGUE_SHAPES[model].items():
                producer, gemv, fused = prologue_ops(kind, n, k, dt)
                wbytes = n * k * dt.itemsize
                copies = max(2, -(-(256 << 20) // wbytes))
                ws = [buf(wbytes) for _ in range(copies)]
                x, nw, c = buf(2 * k * 4), buf(k * dt.itemsize), buf(8)
                a, y, dyn = buf(k * dt.itemsize), buf(n * 4), buf(8)
                cu.memset(c.ptr, 0x3C, 8, stream)      # ~0.011: Σx²·c + c stays a normal float
                reps = 4 * copies

                def timed_graph(launches: list, what: str) -> float:
                    """Seconds per rep of ``launches`` ((kernel source, packs per copy)), as one CUDA graph."""
                    mods = [cu.Module(nvrtc.compile_cuda(src.source, info.sm).cubin, what) for src, _ in launches]
                    fns = [m.function(src.launches[0].kernel) for m, (src, _) in zip(mods, launches)]

                    def record(st):
                        for i in range(reps):
                            for fn, (src, packs) in zip(fns, launches):
                                grid = tuple(g.evaluate({}) for g in src.grid)
                                cu.launch_kernel(fn, grid, src.block, 0, st, packs[i % copies].address)

                    graph = cu.Graph(stream, record)
                    t = timed(lambda: graph.launch(stream), 7) / reps
                    graph.close()
                    for m in mods:
                        m.close()
                    return t

                leaf_ptrs = [x.ptr, x.ptr if kind == "gated" else nw.ptr, c.ptr, c.ptr]
                pk = generate(producer, [], arg_dtypes=[DType.f32, DType.f32 if kind == "gated" else dt,
                                                        DType.f32, DType.f32])
                gk = generate(gemv, [], arg_dtypes=[dt, dt])
                t_pair = timed_graph([(pk, [ParamPack([a.ptr, *leaf_ptrs, dyn.ptr])] * copies),
                                      (gk, [ParamPack([y.ptr, a.ptr, w.ptr, dyn.ptr]) for w in ws])], "pair")
                results = []
                fused_dts = [DType.f32, DType.f32 if kind == "gated" else dt, DType.f32, DType.f32, dt]
                for threads, group, cap, inflight, preload in itertools.product(*PROLOGUE_SPACE.values()):
                    try:
                        fk = generate(fused, [], arg_dtypes=fused_dts, threads=threads, group=group, max_blocks=cap,
                                      inflight=inflight, preload=preload)
                    except CodegenError:
                        continue
                    t = timed_graph([(fk, [ParamPack([y.ptr, *leaf_ptrs, w.ptr, dyn.ptr]) for w in ws])], "fused")
                    results.append({"threads": fk.tuning["threads"], "group": fk.tuning["group"], "max_blocks": cap,
                                    "inflight": fk.tuning["inflight"], "preload": fk.tuning["preload"],
                                    "default": threads is None and group is None and cap == 65536 and not inflight
                                    and not preload,
                                    "grid": fk.grid[0].evaluate({}),
                                    "us": round(t * 1e6, 2), "vs_pair": round(t / t_pair, 3)})
                for b in ws:
                    b.close()
                    owned.remove(b)
                best = min(results, key=lambda r: r["us"])
                default = next(r for r in results if r["default"])
                record["rows"].append({"model": model, "proj": proj, "kind": kind, "n": n, "k": k,
                                       "pair_us": round(t_pair * 1e6, 2), "best": best, "default": default,
                                       "all": results})
                log(f"{model:10s} {proj:8s} n={n:6d} k={k:6d}  norm+gemv {t_pair * 1e6:6.2f} us  fused default "
                    f"{default['us']:6.2f} us ({default['vs_pair']:.3f}x), best {best['us']:6.2f} us "
                    f"({best['vs_pair']:.3f}x: threads {best['threads']} group {best['group']} grid {best['grid']} "
                    f"inflight {best['inflight']} preload {best['preload']})")
        for model in args.shapes.split(",") if args.mode == "plain" else ():
            for proj, (n, k) in SHAPES[model].items():
                if projs is not None and proj not in projs:
                    continue
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
                for threads, group, (unroll, inflight, preload), cap in itertools.product(
                        threads_space, groups_space, loads_space, caps_space):
                    try:
                        ks = generate(op, [], arg_dtypes=[dt, dt], threads=threads, group=group, unroll=unroll,
                                      inflight=inflight, preload=preload,
                                      **({} if cap is None else {"max_blocks": cap}))
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
                    results.append({"threads": threads, "group": group, "unroll": unroll, "inflight": inflight,
                                    "preload": preload, "max_blocks": cap, "grid": grid[0],
                                    "chosen_threads": ks.tuning["threads"], "chosen_preload": ks.tuning["preload"],
                                    "chosen_group": ks.tuning["group"], "chosen_inflight": ks.tuning["inflight"],
                                    "us": round(t * 1e6, 2),
                                    "GBps": round(gbps)})
                for b in ws:
                    b.close()
                    owned.remove(b)
                best = max(results, key=lambda r: r["GBps"])
                default = next((r for r in results if r["threads"] is None and r["group"] is None
                                and r["unroll"] == 4 and r["inflight"] == 0 and r["preload"] == 0
                                and r["max_blocks"] is None), None)
                ahead = [r for r in results if r["inflight"] or r["preload"]]
                best_ahead = max(ahead, key=lambda r: r["GBps"]) if ahead else None
                record["rows"].append({"model": model, "proj": proj, "n": n, "k": k, "best": best,
                                       "default": default, "best_inflight": best_ahead, "all": results})

                def show(r):
                    return (f"{r['GBps']:5d} GB/s ({r['us']:6.2f} us: threads {r['chosen_threads']} group "
                            f"{r['chosen_group']} unroll {r['unroll']} inflight {r['chosen_inflight']} preload "
                            f"{r['chosen_preload']})")
                log(f"{model:10s} {proj:8s} n={n:6d} k={k:6d}  default {show(default) if default else '-'}  "
                    f"best {show(best)}  best ahead {show(best_ahead) if best_ahead else '-'}")
    finally:
        stream.synchronize()
        for o in reversed(owned):
            o.close()
        timed.close()
        stream.close()
        ctx.close()
    stem = "gemv-sweep" if args.mode == "plain" else "gemv-prologue-sweep"
    log(f"wrote {write_record(record, args.out, f'{stem}-{dt.value}')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
