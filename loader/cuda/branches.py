"""Parallel branches of a captured CUDA graph: which stream each step of a segment goes on.

A decode step is hundreds of small kernels, and some of them do not depend on each other (gemma's k
norm, v-cache write and q norm all read only the qkv projection). Captured from one stream they run one
after another, each paying its own launch and ramp; captured from several streams, with an event for
every cross-stream dependency, the graph holds the true dependencies and the GPU runs such kernels
side by side.

Dependencies come from the buffers: a step depends on an earlier one when it writes bytes the earlier
one reads or writes, or reads bytes it writes (address ranges, so arena reuse is covered). Steps
other than kernels (library GEMMs, copies) are barriers: they wait for everything before them and
everything after waits for them.

The schedule is greedy and static (one per plan): a step goes on the stream whose last step it
depends on (the latest such), else, when it depends on something, on the stream that has been idle
longest, else on stream 0; it waits for the latest step it depends on of every other stream that is
not already ordered before it (vector clocks keep the graph's edges few). A step
with no dependency never starts a side stream, so every side stream joins the capture through an
event. At the end of the segment stream 0 waits for every side stream's last step.

The arena reuses a dead buffer's bytes at once, and each reuse is a write-after-read dependency; so with
branches on, the runner plans the arena with ``BRANCH_SLACK`` steps of slack after each last use
(gemma's q norm and RoPE would otherwise wait for the k-cache write whose input buffer they reuse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

Range = tuple[int, int]          # [lo, hi) bytes
BRANCH_SLACK = 8                 # steps an arena buffer stays reserved after its last use (arena.plan_arena)
EVERYTHING: tuple[Range, ...] = ((0, (1 << 64) - 1),)


@dataclass(frozen=True)
class Placement:
    stream: int                  # 0: the capturing stream
    waits: tuple[int, ...]       # earlier steps (indices) on other streams to wait for first


@dataclass(frozen=True)
class Schedule:
    placements: tuple[Placement, ...]
    signals: frozenset[int]      # steps after which an event is recorded (someone waits for them)
    tails: tuple[int, ...]       # the last step of each side stream used, joined into stream 0 at the end

    @property
    def streams(self) -> int:
        return 1 + max((p.stream for p in self.placements), default=0)


def _overlap(a: Sequence[Range], b: Sequence[Range]) -> bool:
    return any(lo < bhi and blo < hi for lo, hi in a for blo, bhi in b)


def conflicts(reads: Sequence[Sequence[Range]], writes: Sequence[Sequence[Range]], j: int, i: int) -> bool:
    """Step ``i`` (later) must follow step ``j``: write-after-read, read-after-write or write-after-write
    (the plain definition :func:`schedule` computes in bulk; for checks)."""
    return _overlap(writes[i], writes[j]) or _overlap(writes[i], reads[j]) or _overlap(reads[i], writes[j])


def _table(ranges: Sequence[Sequence[Range]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step, lo, hi) columns of every range of every step."""
    rows = [(i, lo, hi) for i, rs in enumerate(ranges) for lo, hi in rs if lo < hi]
    a = np.array(rows, dtype=object).reshape(-1, 3)
    return a[:, 0].astype(np.int64), a[:, 1].astype(np.uint64), a[:, 2].astype(np.uint64)


def _hits(table: tuple[np.ndarray, np.ndarray, np.ndarray], ranges: Sequence[Range], i: int) -> np.ndarray:
    step, lo, hi = table
    m = np.zeros(len(step), dtype=bool)
    for a, b in ranges:
        m |= (lo < np.uint64(b)) & (np.uint64(a) < hi)
    return step[m & (step < i)]


def schedule(reads: Sequence[Sequence[Range]], writes: Sequence[Sequence[Range]], max_streams: int = 4) -> Schedule:
    """Place steps given their read and write ranges (``EVERYTHING`` for a barrier) on up to
    ``max_streams`` streams; see the module docstring. Step ``i`` depends on an earlier ``j`` when
    ``i`` writes what ``j`` reads or writes, or reads what ``j`` writes."""
    n = len(reads)
    rt, wt = _table(reads), _table(writes)
    stream_of = np.zeros(n, dtype=np.int64)
    tails: list[int | None] = [None] * max(1, max_streams)
    placements: list[Placement] = []
    signals: set[int] = set()
    clocks: list[list[int]] = []
    for i in range(n):
        deps = np.concatenate([_hits(wt, writes[i], i), _hits(rt, writes[i], i), _hits(wt, reads[i], i)])
        latest: dict[int, int] = {}          # stream -> its latest step that i depends on
        for j in deps.tolist():
            k = int(stream_of[j])
            if j > latest.get(k, -1):
                latest[k] = j
        own = [k for k, j in latest.items() if tails[k] == j]
        if own:
            k = max(own, key=lambda s: latest[s])
        elif latest:
            k = min(range(len(tails)), key=lambda s: -1 if tails[s] is None else tails[s])
        else:
            k = 0
        # vector clocks: clock[s] = the latest step of stream s ordered before; a dependency that the
        # stream's order or an earlier wait already covers needs no wait of its own
        clock = list(clocks[tails[k]]) if tails[k] is not None else [-1] * len(tails)
        waits = []
        for j in sorted((j for s, j in latest.items() if s != k), reverse=True):
            if clock[int(stream_of[j])] < j:
                waits.append(j)
                clock = [max(a, b) for a, b in zip(clock, clocks[j])]
        clock[k] = i
        clocks.append(clock)
        waits.sort()
        signals.update(waits)
        stream_of[i] = k
        tails[k] = i
        placements.append(Placement(k, tuple(waits)))
    side = tuple(t for s, t in enumerate(tails) if s and t is not None)
    return Schedule(tuple(placements), frozenset(signals | set(side)), side)


def happens_before(sched: Schedule) -> list[set[int]]:
    """For each step, every step ordered before it by stream order and the schedule's waits (for tests
    and checks: O(n^2))."""
    before: list[set[int]] = []
    last: dict[int, int] = {}
    for i, p in enumerate(sched.placements):
        s: set[int] = set()
        for j in ([last[p.stream]] if p.stream in last else []) + list(p.waits):
            s |= before[j] | {j}
        before.append(s)
        last[p.stream] = i
    return before
