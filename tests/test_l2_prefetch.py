"""The L2 prefetch plan (loader/cuda/prefetch.py): which GEMVs get a prefetch, of how many bytes, and
where the step goes in a decode plan (after the stretch's first producer, ordering nothing after it)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from lum.loader.cuda import prefetch as pf
from lum.loader.cuda.prefetch import BYTES_PER_STEP, CHUNK, THREADS, Prefetch, grid_blocks, plan_prefetches

MB = 1 << 20


@dataclass
class _Step:
    weights: tuple = ()
    prefetcher: object = None


def _gemv(lo: int, nbytes: int, fn: object = "pf") -> _Step:
    return _Step(((lo, lo + nbytes),), fn)


def test_each_gemv_after_a_stretch_gets_its_weights_first_bytes():
    qkv, o, gate_up, down = _gemv(0, 21 * MB), _gemv(100 * MB, 10 * MB + 8), _gemv(200 * MB, 105 * MB), \
        _gemv(400 * MB, 52 * MB)
    small = _Step()
    steps = [qkv, small, small, small, small, o, small, gate_up, down, small, qkv]
    got = plan_prefetches(steps, budget=25 * MB)
    assert got == [Prefetch(0, 5, 100 * MB, 10 * MB),            # o whole (4 steps allow 32 MB), 16-byte multiple
                   Prefetch(5, 7, 200 * MB, BYTES_PER_STEP),     # one step before gate-up: its first bytes
                   Prefetch(8, 10, 0, BYTES_PER_STEP)]           # down is right after gate-up: none for it
    assert all(p.nbytes % 16 == 0 for p in got)
    assert plan_prefetches(steps, budget=4 * MB)[0].nbytes == 4 * MB       # the budget caps each


def test_no_prefetch_without_a_kernel_small_weights_or_a_previous_gemv():
    small = _Step()
    assert plan_prefetches([small, _gemv(0, 50 * MB)], 25 * MB) == []                 # nothing before it
    assert plan_prefetches([_gemv(0, 50 * MB), small, _gemv(MB, 50 * MB, None)], 25 * MB) == []   # no kernel
    tiny = _gemv(0, pf.MIN_WEIGHT_BYTES - 16)
    assert plan_prefetches([_gemv(0, 50 * MB), small, tiny], 25 * MB) == []           # not worth a launch
    # the largest weight of a kernel is the one warmed (a gemv's bias or norm weight is small)
    two = _Step(((0, 64), (MB, MB + 8 * MB)), "pf")
    assert plan_prefetches([_gemv(64 * MB, 8 * MB), small, two], 25 * MB) == [Prefetch(0, 2, MB, 8 * MB)]


@pytest.mark.parametrize("nbytes,blocks", [(16, 1), (CHUNK * THREADS, 1), (CHUNK * THREADS + 16, 2), (10 * MB, 10 * MB // (CHUNK * THREADS))])
def test_grid_issues_every_chunk_once(nbytes, blocks):
    assert grid_blocks(nbytes) == blocks and blocks * THREADS * CHUNK >= nbytes


def test_a_hint_follows_its_step_on_a_stream_of_its_own_and_precedes_nothing():
    from lum.loader.cuda.branches import happens_before, schedule

    a, b = [(0, 64)], [(64, 128)]
    reads = [[], [], a, a, []]              # 0 writes a; 1: a hint after 0; 2, 3 read a; 4 writes b
    writes = [a, [], b, [(128, 192)], b]
    sched = schedule(reads, writes, max_streams=2, hints={1: 0})
    before = happens_before(sched)
    assert sched.placements[1].stream == sched.streams - 1 == 2 and 0 in before[1]
    assert all(1 not in before[i] for i in (2, 3, 4)) and all(p.stream < 2 for j, p in enumerate(sched.placements) if j != 1)
    assert 1 in sched.signals and 1 in sched.tails          # joined back into stream 0 at the end
