"""The measured-search engine with fake timers: finding a known optimum, rejections, tiny and
exhausted spaces, budgets, determinism, dedupe by stable hash, seeds and progress reporting."""

from __future__ import annotations

import hashlib
import math
import random

import pytest

from lum.builder.search import (CandidateRejected, Decision, SearchProgress, SearchSpace, genome_hash,
                                search)


def separable(sizes, seed=1):
    """A cost Σ_i c_i[g_i] with random positive tables: its optimum is the argmin of each table."""
    r = random.Random(seed)
    tables = [[r.uniform(1.0, 10.0) for _ in range(n)] for n in sizes]
    best = tuple(min(range(n), key=t.__getitem__) for n, t in zip(sizes, tables))
    return (lambda g: sum(t[x] for t, x in zip(tables, g))), best


class Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, g):
        self.calls.append(g)
        return self.fn(g)


@pytest.mark.parametrize("seed", range(4))
def test_finds_the_optimum_of_a_separable_cost(seed):
    sizes = [4, 3, 5, 2, 4, 3]                       # 1440 genomes
    cost, best = separable(sizes, seed=seed + 10)
    timer = Counting(cost)
    res = search(SearchSpace.from_sizes(sizes), timer, budget=250, seed=seed)
    assert res.best_genome == best
    assert math.isclose(res.best_time, cost(best))
    assert len(timer.calls) == len(res.evaluated) <= 250
    assert not res.exhausted


def test_search_beats_random_sampling_on_a_large_space():
    sizes = [6] * 12                                 # 2e9 genomes
    cost, best = separable(sizes, seed=3)
    res = search(SearchSpace.from_sizes(sizes), cost, budget=400, seed=0)
    r = random.Random(0)
    rand_best = min(cost(tuple(r.randrange(6) for _ in sizes)) for _ in range(400))
    assert res.best_time < rand_best
    assert res.best_time - cost(best) < 0.1 * cost(best)


def test_no_genome_is_timed_twice_and_hashes_are_stable():
    space = SearchSpace.from_sizes([3, 3, 2])
    timer = Counting(lambda g: 1.0 + sum(g))
    res = search(space, timer, budget=1000, seed=5)
    assert len(set(timer.calls)) == len(timer.calls) == space.size == 18
    assert res.exhausted and res.best_genome == (0, 0, 0)
    hashes = [t.genome_hash for t in res.evaluated]
    assert len(set(hashes)) == len(hashes)
    t = res.evaluated[0]
    assert t.genome_hash == hashlib.sha256(",".join(map(str, t.genome)).encode()).hexdigest()
    assert genome_hash((1, 20, 3)) != genome_hash((12, 0, 3))
    assert genome_hash([1, 2]) == genome_hash((1, 2))


def test_budget_is_respected_and_counts_timer_calls():
    timer = Counting(lambda g: float(sum(g)))
    res = search(SearchSpace.from_sizes([10] * 5), timer, budget=37, seed=1, initial=8)
    assert len(timer.calls) == len(res.evaluated) == 37
    assert {t.generation for t in res.evaluated} >= {0, 1, 2}
    assert search(SearchSpace.from_sizes([3]), timer, budget=0).best_genome is None


def test_deterministic_for_a_seed():
    sizes = [5, 4, 6, 3]
    cost, _ = separable(sizes)
    a = search(SearchSpace.from_sizes(sizes), cost, budget=60, seed=7)
    b = search(SearchSpace.from_sizes(sizes), cost, budget=60, seed=7)
    c = search(SearchSpace.from_sizes(sizes), cost, budget=60, seed=8)
    assert [t.genome for t in a.evaluated] == [t.genome for t in b.evaluated]
    assert [t.genome for t in a.evaluated] != [t.genome for t in c.evaluated]


def test_rejected_candidates_are_recorded_never_chosen():
    sizes = [4, 4, 4]
    cost, best = separable(sizes, seed=2)

    def timer(g):
        if g[0] == best[0]:                          # the would-be optimum's row fails to compile
            raise CandidateRejected(f"compile error for {g}")
        if g[1] == 3:
            return float("nan")                      # a timer reporting garbage
        return cost(g)

    res = search(SearchSpace.from_sizes(sizes), timer, budget=64, seed=0)
    assert res.exhausted and len(res.evaluated) == 64
    assert res.best_genome[0] != best[0] and res.best_genome[1] != 3
    assert res.best_time == min(cost(g) for g in SearchSpace.from_sizes(sizes).all()
                                if g[0] != best[0] and g[1] != 3)
    reasons = {t.reason for t in res.rejected}
    assert any(r.startswith("compile error") for r in reasons) and "timer returned nan" in reasons
    assert all(t.time is None for t in res.rejected) and all(t.reason is None for t in res.evaluated if t.ok)


def test_everything_rejected():
    def timer(g):
        raise CandidateRejected("wrong result")
    res = search(SearchSpace.from_sizes([2, 2]), timer, budget=10)
    assert res.best_genome is None and res.best_time is None
    assert len(res.evaluated) == 4 and res.exhausted


def test_other_timer_errors_propagate():
    def timer(g):
        raise RuntimeError("bug")
    with pytest.raises(RuntimeError, match="bug"):
        search(SearchSpace.from_sizes([2]), timer, budget=3)


def test_single_option_and_empty_spaces():
    timer = Counting(lambda g: 1.0)
    res = search(SearchSpace.from_sizes([1, 1, 1]), timer, budget=50)
    assert timer.calls == [(0, 0, 0)] and res.exhausted and res.best_genome == (0, 0, 0)
    res = search(SearchSpace([]), lambda g: 2.0, budget=5)
    assert res.best_genome == () and res.best_time == 2.0 and res.exhausted
    # decisions with one option are never "mutated"
    timer = Counting(lambda g: float(g[1]))
    res = search(SearchSpace.from_sizes([1, 7, 1]), timer, budget=100)
    assert sorted(timer.calls) == [(0, x, 0) for x in range(7)]


def test_seed_genomes_go_first_and_count():
    sizes = [8, 8, 8]
    cost, best = separable(sizes, seed=4)
    timer = Counting(cost)
    res = search(SearchSpace.from_sizes(sizes), timer, budget=5, seed_genomes=[best, (1, 2, 3), best], initial=4)
    assert timer.calls[:2] == [best, (1, 2, 3)]
    assert len(timer.calls) == 5 and res.best_genome == best
    with pytest.raises(ValueError, match="not in"):
        search(SearchSpace.from_sizes(sizes), cost, budget=5, seed_genomes=[(8, 0, 0)])
    with pytest.raises(ValueError, match="3 decisions"):
        search(SearchSpace.from_sizes(sizes), cost, budget=5, seed_genomes=[(0, 0)])


def test_sweep_finds_a_separable_optimum_in_one_pass_around_the_seed():
    """Swept decisions: every one-decision change of the seed, then the seed with each at its best option —
    for a separable cost that is the optimum after 1 + sum(n - 1) + 1 timings; the others stay at the seed."""
    sizes = [5, 4, 3, 6, 2, 7]                       # 5,040 genomes; decisions 2..5 swept
    cost, best = separable(sizes, seed=7)
    seed = (best[0], best[1], 0, 0, 0, 0)
    sweep = [2, 3, 4, 5]
    n = 1 + sum(sizes[k] - 1 for k in sweep) + 1
    timer = Counting(cost)
    res = search(SearchSpace.from_sizes(sizes), timer, budget=n, seed_genomes=[seed], sweep=sweep)
    assert res.best_genome == best and len(timer.calls) == n
    assert timer.calls[0] == seed and timer.calls[-1] == best
    assert all(sum(a != b for a, b in zip(g, seed)) == 1 for g in timer.calls[1:-1])   # one change each
    assert {k for g in timer.calls[1:-1] for k in range(6) if g[k] != seed[k]} == set(sweep)


def test_sweep_skips_rejected_options_and_needs_a_seed():
    sizes = [4, 4]
    cost, best = separable(sizes, seed=2)

    def timer(g):
        if g[0] == best[0] and g != (best[0], 0):     # the best option of decision 0 is rejected off decision 1's 0
            raise CandidateRejected("no")
        return cost(g)

    res = search(SearchSpace.from_sizes(sizes), timer, budget=9, seed_genomes=[(0, 0)], sweep=[0, 1], initial=1)
    assert res.best_genome is not None and all(t.ok or t.reason == "no" for t in res.evaluated)
    timer2 = Counting(cost)
    search(SearchSpace.from_sizes(sizes), timer2, budget=3, sweep=[0, 1], initial=3)   # no seed: no sweep
    assert len(timer2.calls) == 3
    with pytest.raises(ValueError, match="sweep decision 2"):
        search(SearchSpace.from_sizes(sizes), cost, budget=9, seed_genomes=[(0, 0)], sweep=[2])


def test_progress_callback():
    events: list[SearchProgress] = []
    res = search(SearchSpace.from_sizes([3, 4]), lambda g: 10.0 - g[0] - g[1], budget=9, progress=events.append)
    assert [e.done for e in events] == list(range(1, 10))
    assert all(e.total == 9 for e in events)
    assert [e.trial for e in events] == res.evaluated
    assert events[-1].best_time == res.best_time and events[-1].best_genome == res.best_genome
    assert all(a.best_time >= b.best_time for a, b in zip(events, events[1:]))
    events.clear()
    search(SearchSpace.from_sizes([2]), lambda g: 1.0, budget=9, progress=events.append)
    assert [e.total for e in events] == [2, 2]


def test_space_labels_and_validation():
    space = SearchSpace([Decision("matmul", ("gemm", "fused", "naive")), Decision("tile", ["64", "128"]), 2])
    assert space.sizes == (3, 2, 2) and space.size == 12 and len(space) == 3
    assert space.describe((1, 0, 1)) == {"matmul": "fused", "tile": "64", "d2": "1"}
    with pytest.raises(ValueError, match="no options"):
        Decision("x", 0)
    with pytest.raises(ValueError, match="unique"):
        SearchSpace([Decision("a", 2), Decision("a", 3)])
    with pytest.raises(ValueError, match="budget"):
        search(space, lambda g: 1.0, budget=-1)
    with pytest.raises(ValueError, match="mutation_rate"):
        search(space, lambda g: 1.0, budget=3, mutation_rate=2.0)
