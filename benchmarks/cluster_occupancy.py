"""How many thread block clusters of a qkv-sized kernel the GPU holds at once (``cuOccupancyMaxActiveClusters``).

    python benchmarks/cluster_occupancy.py [--out DIR] [--commit SHA]

Why: the one round-trip cut of gemma3-4b's decode chain not yet built (benchmarks/NOTES.md, "Decode attention's
keys and blocks, two more ways") has the qkv GEMV compute the q / k head norms and RoPE itself, a head's 16
blocks of 16 columns exchanging their sums through distributed shared memory, so they must run as clusters of 16
(non-portable: 8 is the portable limit). The qkv today is 256 blocks of 512 threads, each with 80 KB of weights
preloaded into shared memory: 16 clusters of 16 must be resident at once, or the GEMV runs in two waves. The
driver answers that from the block shape, the shared memory and the cluster size alone; a stand-in kernel with
the same block and shared memory (benchmarks/cluster_occupancy.cu; few registers: the qkv's 54 a thread allow
two such blocks an SM too) asks it.

Printed and saved (``<out>/cluster-occupancy-<date>.json``): for 512- and 256-thread blocks, 80 and 40 KB of
shared memory and clusters of 8 and 16, the clusters that fit at once and the blocks they hold.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import add_record_args, log, record_head, set_log_tag, write_record  # noqa: E402

set_log_tag("cluster-occupancy")
SOURCE = (HERE / "cluster_occupancy.cu").read_text()   # the stand-in kernel
SHAPES = [(threads, kb, cluster) for threads in (512, 256) for kb in (80, 40) for cluster in (8, 16)]


def max_clusters(function, threads: int, shared: int, cluster: int) -> int:
    """``cuOccupancyMaxActiveClusters`` of ``function`` launched in blocks of ``threads`` with ``shared`` bytes of
    dynamic shared memory, in clusters of ``cluster`` along x."""
    from cuda.bindings import driver as drv

    from lum.loader.cuda import driver as cu

    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = 64 * cluster, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
    cfg.sharedMemBytes = shared
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    return int(cu.call(drv.cuOccupancyMaxActiveClusters, function, cfg))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_record_args(ap)
    args = ap.parse_args(argv)
    from cuda.bindings import driver as drv

    from lum.builder.nvrtc import compile_cuda
    from lum.loader.cuda import driver as cu

    dev = cu.device_info(0)
    ctx = cu.Context(dev.ordinal)
    try:
        mod = cu.Module(compile_cuda(SOURCE, "sm_90", ptx=False, cache_dir=False).cubin, "the cluster stand-in")
        rows = []
        for threads, kb, cluster in SHAPES:
            f = mod.function("lum_cluster_standin", kb * 1024)
            cu.call(drv.cuFuncSetAttribute, f,
                    drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            n = max_clusters(f, threads, kb * 1024, cluster)
            rows.append({"threads": threads, "shared_KB": kb, "cluster": cluster, "clusters": n, "blocks": n * cluster})
            log(f"{threads} threads, {kb} KB, clusters of {cluster}: {n} at once ({n * cluster} blocks)")
        mod.close()
    finally:
        ctx.close()
    record = {**record_head("cluster-occupancy", args.commit, dev.name), "sms": dev.multiprocessors, "rows": rows}
    log(f"wrote {write_record(record, args.out, 'cluster-occupancy')}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
