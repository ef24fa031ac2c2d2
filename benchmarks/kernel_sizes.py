"""The code size of each decode kernel, and what fetching it costs a launch: a CPU measurement.

    python benchmarks/kernel_sizes.py [--model gemma3-4b] [--dtype bf16] [--max-seq 512] [--stamps] [--out DIR]
                                      [--commit SHA]

Why: an SM that has not run a kernel lately runs its straight-line code at the instruction-fetch rate, ≈ 77 ns a
KB of SASS on the H200 against 32 cached, and its instruction cache holds between 32 and 64 KB
(benchmarks/icache_probe.py, benchmarks/NOTES.md 2026-12-07). The latency-bound kernels between a decode layer's
qkv and its FFN are unrolled straight lines run once a layer, so their code size is time on the chain. NVRTC
compiles every kernel of the model's decode groups (the cost model's programs, as ``lum build`` starts from)
for sm_90; the cubin's ``.text`` section gives the bytes, ptxas the registers and spills.

Printed and saved (``<out>/kernel-sizes-<model>-<dtype>-<date>.json``): per kernel its op, grid and block, SASS
KB, registers, spill bytes, the blocks an SM holds at once (by threads, registers and shared memory:
``kernels.resident_blocks``) and the fetch time of all of its code at :data:`FETCH_NS_PER_KB` (an upper bound on
what one launch pays: a warp runs only its own path); and per group the total. ``--stamps`` compiles each kernel
as a stamps build does (``LUM_STAMPS=1``, ``profile_decode.py --stamps``; ``-stamps`` in the record's name): where
the stamps' code moves a kernel's blocks an SM, its stamped timing is not the default's (inlined stamps took
gemma3-4b's gate-up from 96 to 117 registers, 5 to 4 blocks; called, as they are now, none moves).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import (add_record_args, entry_kernel_sources, log, record_head, set_log_tag, text_sizes,  # noqa: E402
                     write_record)

set_log_tag("kernel-sizes")
FETCH_NS_PER_KB = 77.0     # straight-line code fetched, not cached (icache-probe-2026-12-07-2ea84da-h200.json)


def kernel_sizes(model: str, dtype: str, max_seq: int, entry: str = "decode", stamps: bool = False) -> list[dict]:
    """A row per kernel of ``model``'s ``entry`` groups (group, op id, kind, op, grid, block, SASS bytes,
    registers, spill bytes, shared memory bytes, blocks an SM, fetch µs); ``stamps``: compiled as a stamps build."""
    from lum.builder.codegen import module_source
    from lum.builder.kernels import resident_blocks
    from lum.builder.nvrtc import compile_cuda, ptxas_registers, ptxas_shared_bytes, ptxas_spills

    rows = []
    for gi, (_, sources) in enumerate(entry_kernel_sources(model, entry, max_seq, dtype)[0]):
        for op_id, ks in sources.items():
            if ks is None:
                continue
            res = compile_cuda(module_source([ks], stamps=stamps), "sm_90", name=f"{ks.name}.cu", ptx=False,
                               extra_options=["--ptxas-options=-v"])
            size = text_sizes(res.cubin)[ks.name]
            regs = ptxas_registers(res.log)[ks.name]
            shared = ptxas_shared_bytes(res.log)[ks.name] + ks.shared_mem
            rows.append({"group": gi, "op": op_id, "kernel": ks.name, "kind": ks.kind,
                         "what": ks.op + (f"+tail({len(ks.tails)})" if ks.tails else ""),
                         "grid": str(ks.grid[0]), "block": ks.block[0], "sass_bytes": size,
                         "registers": regs, "spill_bytes": ptxas_spills(res.log).get(ks.name, 0),
                         "shared_bytes": shared, "blocks_per_sm": resident_blocks(ks.block[0], regs, shared),
                         "fetch_us": round(size / 1024 * FETCH_NS_PER_KB / 1e3, 2)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-4b")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "f16", "f32"))
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--stamps", action="store_true", help="compile the kernels as a stamps build (LUM_STAMPS=1)")
    add_record_args(ap)
    args = ap.parse_args(argv)
    rows = kernel_sizes(args.model, args.dtype, args.max_seq, stamps=args.stamps)
    totals: dict[int, int] = {}
    print(f"{'group':>5} {'op':>4}  {'SASS KB':>7} {'regs':>4} {'spill':>5} {'blk/SM':>6} {'fetch µs':>8}  kernel")
    for r in rows:
        totals[r["group"]] = totals.get(r["group"], 0) + r["sass_bytes"]
        print(f"{r['group']:>5} {r['op']:>4}  {r['sass_bytes'] / 1024:7.1f} {r['registers']:>4} {r['spill_bytes']:>5} "
              f"{r['blocks_per_sm']:>6} {r['fetch_us']:8.2f}  {r['kind']}/{r['what']} grid {r['grid']} × {r['block']}")
    for g, total in totals.items():
        print(f"group {g}: {total / 1024:.1f} KB of SASS, {total / 1024 * FETCH_NS_PER_KB / 1e3:.2f} µs to fetch once")
    record = {**record_head("kernel-sizes", args.commit, None), "model": args.model, "dtype": args.dtype,
              "max_seq": args.max_seq, "stamps": args.stamps, "fetch_ns_per_KB": FETCH_NS_PER_KB, "rows": rows,
              "group_sass_bytes": {str(g): t for g, t in totals.items()}}
    tag = "-stamps" if args.stamps else ""
    log(f"wrote {write_record(record, args.out, f'kernel-sizes-{args.model}-{args.dtype}{tag}')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
