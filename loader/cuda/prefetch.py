"""L2 prefetch steps: the memory bus works while a decode step's small kernels run.

A batch-1 decode step alternates weight GEMVs, which stream megabytes at the copy rate, with stretches
of small latency-bound kernels (gemma: RoPE, the KV-cache writes, attention and its combine between the
qkv and o projections; a residual norm before gate-up and before the next layer's qkv) during which the
bus is nearly idle. Each GEMV then starts cold and pays its ramp. Here, at the start of each such
stretch, a prefetch step (``templates/l2_prefetch.cu``: bulk L2 prefetch hints, no data read or
written) asks for the first bytes of the weight of the GEMV that ends the stretch, so that they are in
L2 by the time it starts: gemma's o projection (10.5 MB) whole, the first part of gate-up and of the
next layer's qkv.

The step follows the stretch's first producer (the GEMV before) and precedes nothing: the schedule
puts every such step on a stream of its own (branches.py's ``hints``), beside the stretch's kernels,
so no kernel waits behind one. It needs a branched graph: on one stream it would sit on the critical
path. Bytes per prefetch: the weight's, at most ``budget`` (half of L2, so the stretch's own data and the
GEMV's output stay) and at most :data:`BYTES_PER_STEP` for each step of the stretch (what the bus
streams while one small kernel runs: ~2.5 µs at ~3.5 TB/s). A GEMV right after the previous one
(gemma's down after gate-up) has no stretch and gets none. Prefetches are hints: a result never
depends on them.

Off by default (``l2_prefetch=True`` or ``LUM_CUDA_PREFETCH=1`` turn it on): on the H200 it measured
within noise (gemma3-4b bf16 +0.6% / −0.3%, f32 −1.0%, llama3-1b −0.2% / −0.1%; ad85663 and 113b728,
benchmarks/NOTES.md): the profiled o projection ran faster (4.37 → 3.82 µs), the step as a whole did not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from lum.format.manifest import L2_PREFETCH_CHUNK

__all__ = ["Prefetch", "plan_prefetches", "MIN_WEIGHT_BYTES", "BYTES_PER_STEP", "CHUNK", "THREADS", "grid_blocks"]

MIN_WEIGHT_BYTES = 4 << 20       # a kernel reading fewer weight bytes is not worth a launch
BYTES_PER_STEP = 8 << 20         # streamed while one small kernel of the stretch runs
CHUNK = L2_PREFETCH_CHUNK        # bytes per prefetch instruction (the package's prefetch entry's)
THREADS = 32                     # per block: each thread issues one chunk; blocks spread over SMs
# An SM's bulk prefetches ran at ~0.2 TB/s (ad85663: 64 KB chunks, 2 MB a block, 10 µs a launch),
# so 512 KB a block spreads 10 MB over 20 SMs.


@dataclass(frozen=True)
class Prefetch:
    after: int                   # index of the step it follows (the GEMV before the stretch)
    target: int                  # index of the step whose weight it warms
    ptr: int                     # first byte
    nbytes: int                  # a multiple of 16


def _largest(ranges: Sequence[tuple[int, int]]) -> tuple[int, int]:
    return max(ranges, key=lambda r: r[1] - r[0])


def plan_prefetches(steps: Sequence[Any], budget: int) -> list[Prefetch]:
    """The prefetches for a segment's ``steps``: objects with ``weights`` (the [lo, hi) device bytes of
    the weights they read; absent or empty for non-kernel steps) and ``prefetcher`` (the group's prefetch
    kernel, or None where the package has none). ``budget``: the most bytes one prefetch asks for."""
    heavy = [i for i, st in enumerate(steps)
             if getattr(st, "prefetcher", None) is not None
             and sum(hi - lo for lo, hi in getattr(st, "weights", ())) >= MIN_WEIGHT_BYTES]
    out: list[Prefetch] = []
    for prev, i in zip(heavy, heavy[1:]):
        stretch = i - prev - 1
        if stretch < 1:
            continue
        lo, hi = _largest(steps[i].weights)
        n = min(hi - lo, budget, stretch * BYTES_PER_STEP) & ~15
        if n > 0:
            out.append(Prefetch(prev, i, lo, n))
    return out


def grid_blocks(nbytes: int) -> int:
    """Blocks of :data:`THREADS` threads that issue ``nbytes`` in one pass (one chunk per thread)."""
    chunks = -(-nbytes // CHUNK)
    return max(1, -(-chunks // THREADS))
