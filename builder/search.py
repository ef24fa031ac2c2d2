"""Measured search: pick the fastest candidate of a discrete space by timing candidates.

Generic over what a candidate is. A :class:`SearchSpace` is a list of decision points (which e-node
of an e-class, a tile size, a vector width …), each with a number of options; a *genome* is a tuple
with one option index per decision. A :class:`Timer` turns a genome into seconds — on a GPU: lower,
compile, run on random inputs, check against the reference, time with CUDA events — or raises
:class:`CandidateRejected` when the candidate fails (compile error, wrong result, NaN).

:func:`search` evaluates the seed genomes (e.g. the cost model's choice), then (``sweep``) every change
of one swept decision from the first seed and the genome that takes each swept decision's best option,
then random genomes up to ``initial``, then generations of mutations (and crossovers) of the best few, never timing a genome
twice (genomes are identified by :func:`genome_hash`, a sha256 of their text, stable across processes
so a tuning database can key on it), until ``budget`` timer calls or the whole space is evaluated.
All randomness comes from ``random.Random(seed)``: the same space, timer results and seed give the
same trials in the same order.

    space = SearchSpace([Decision("matmul", 3), Decision("tile", ("64", "128", "256"))])
    result = search(space, timer, budget=64, seed_genomes=[cost_model_choice])
    result.best_genome, result.best_time, result.evaluated
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Protocol, Sequence, Union

__all__ = ["Genome", "Decision", "SearchSpace", "CandidateRejected", "Timer", "Trial", "SearchProgress",
           "SearchResult", "genome_hash", "search"]

Genome = tuple[int, ...]

_ENUMERATE_LIMIT = 1 << 20   # spaces up to this size are enumerated when random draws keep colliding


class CandidateRejected(Exception):
    """Raised by a timer for a candidate that must not be chosen (compile failure, wrong result, NaN…)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Timer(Protocol):
    def __call__(self, genome: Genome) -> float:
        """Seconds the candidate takes (lower is better); raise CandidateRejected to reject it."""
        ...


@dataclass(frozen=True)
class Decision:
    """One decision point: ``options`` is a count or the options' labels (for display and logs)."""

    name: str
    options: Union[int, tuple[str, ...]]

    def __post_init__(self) -> None:
        if isinstance(self.options, bool) or not isinstance(self.options, (int, tuple, list)):
            raise TypeError(f"decision {self.name!r}: options must be a count or a sequence of labels")
        if isinstance(self.options, list):
            object.__setattr__(self, "options", tuple(str(o) for o in self.options))
        if self.count < 1:
            raise ValueError(f"decision {self.name!r} has no options")

    @property
    def count(self) -> int:
        return self.options if isinstance(self.options, int) else len(self.options)

    def label(self, i: int) -> str:
        return str(i) if isinstance(self.options, int) else self.options[i]


class SearchSpace:
    """Decision points; a genome picks one option index for each."""

    def __init__(self, decisions: Iterable[Decision | int]):
        self.decisions: tuple[Decision, ...] = tuple(
            d if isinstance(d, Decision) else Decision(f"d{k}", d) for k, d in enumerate(decisions))
        names = [d.name for d in self.decisions]
        if len(set(names)) != len(names):
            raise ValueError("decision names must be unique")
        self.sizes: tuple[int, ...] = tuple(d.count for d in self.decisions)
        self.size: int = math.prod(self.sizes)      # number of distinct genomes (1 for no decisions)

    @classmethod
    def from_sizes(cls, sizes: Sequence[int]) -> SearchSpace:
        return cls(list(sizes))

    def __len__(self) -> int:
        return len(self.decisions)

    def __repr__(self) -> str:
        return f"SearchSpace({', '.join(f'{d.name}:{d.count}' for d in self.decisions)}; {self.size} genomes)"

    def validate(self, genome: Sequence[int]) -> Genome:
        g = tuple(genome)
        if len(g) != len(self.sizes):
            raise ValueError(f"genome has {len(g)} choices, the space has {len(self.sizes)} decisions")
        for k, (x, n) in enumerate(zip(g, self.sizes)):
            if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < n:
                raise ValueError(f"choice {x!r} for decision {self.decisions[k].name!r} is not in [0, {n})")
        return g

    def random(self, rng: random.Random) -> Genome:
        return tuple(rng.randrange(n) for n in self.sizes)

    def describe(self, genome: Genome) -> dict[str, str]:
        """``{decision name: option label}`` for logs."""
        return {d.name: d.label(x) for d, x in zip(self.decisions, genome)}

    def all(self) -> Iterator[Genome]:
        """Every genome, in lexicographic order."""
        return itertools.product(*(range(n) for n in self.sizes))


def genome_hash(genome: Sequence[int]) -> str:
    """Stable identity of a genome: sha256 of its text (``"3,0,1"``), hex."""
    return hashlib.sha256(",".join(str(int(x)) for x in genome).encode()).hexdigest()


@dataclass(frozen=True)
class Trial:
    genome_hash: str
    genome: Genome
    time: float | None          # seconds; None when rejected
    reason: str | None = None   # why it was rejected
    generation: int = 0         # 0 = seeds and random initial genomes

    @property
    def ok(self) -> bool:
        return self.time is not None


@dataclass(frozen=True)
class SearchProgress:
    """What the ``progress`` callback gets after each timed candidate."""

    done: int                   # timer calls so far
    total: int                  # min(budget, space size): the most there can be
    trial: Trial
    best_time: float | None
    best_genome: Genome | None
    generation: int


@dataclass
class SearchResult:
    best_genome: Genome | None  # None when every candidate was rejected
    best_time: float | None
    evaluated: list[Trial] = field(default_factory=list)
    exhausted: bool = False     # every genome of the space was evaluated

    @property
    def rejected(self) -> list[Trial]:
        return [t for t in self.evaluated if not t.ok]


class _Search:
    def __init__(self, space: SearchSpace, timer: Timer, budget: int, rng: random.Random,
                 progress: Callable[[SearchProgress], None] | None):
        self.space, self.timer, self.budget, self.rng, self.progress = space, timer, budget, rng, progress
        self.seen: set[Genome] = set()
        self.trials: list[Trial] = []
        self.best: Trial | None = None
        self.generation = 0
        self._unseen_iter: Iterator[Genome] | None = None

    @property
    def done(self) -> bool:
        return len(self.trials) >= self.budget or len(self.seen) >= self.space.size

    def evaluate(self, g: Genome) -> None:
        if g in self.seen or self.done:
            return
        self.seen.add(g)
        try:
            t = self.timer(g)
        except CandidateRejected as e:
            trial = Trial(genome_hash(g), g, None, e.reason or "rejected", self.generation)
        else:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
                trial = Trial(genome_hash(g), g, None, f"timer returned {t!r}", self.generation)
            else:
                trial = Trial(genome_hash(g), g, float(t), None, self.generation)
        self.trials.append(trial)
        if trial.ok and (self.best is None or trial.time < self.best.time):
            self.best = trial
        if self.progress is not None:
            self.progress(SearchProgress(len(self.trials), min(self.budget, self.space.size), trial,
                                         self.best.time if self.best else None,
                                         self.best.genome if self.best else None, self.generation))

    def fresh(self) -> Genome | None:
        """A not-yet-evaluated genome: random draws, then (small spaces) the next unseen one in order."""
        for _ in range(32):
            g = self.space.random(self.rng)
            if g not in self.seen:
                return g
        if self.space.size > _ENUMERATE_LIMIT:
            return None
        if self._unseen_iter is None:
            self._unseen_iter = self.space.all()
        for g in self._unseen_iter:
            if g not in self.seen:
                return g
        return None

    def mutate(self, parent: Genome, rate: float) -> Genome:
        sizes = self.space.sizes
        mutable = [k for k, n in enumerate(sizes) if n > 1]
        child = list(parent)
        picked = [k for k in mutable if self.rng.random() < rate]
        if not picked and mutable:
            picked = [self.rng.choice(mutable)]
        for k in picked:
            x = self.rng.randrange(sizes[k] - 1)     # uniform over the *other* options
            child[k] = x + (x >= parent[k])
        return tuple(child)

    def crossover(self, a: Genome, b: Genome) -> Genome:
        return tuple(x if self.rng.random() < 0.5 else y for x, y in zip(a, b))


def _sweep(s: _Search, base: Genome, decisions: Sequence[int]) -> None:
    """Time every one-decision change of ``base`` along ``decisions``, then ``base`` with each decision
    at the option that timed fastest (where it beat ``base``)."""
    base_time = next((t.time for t in s.trials if t.genome == base and t.ok), None)
    best = list(base)
    for k in decisions:
        if not 0 <= k < len(base):
            raise ValueError(f"sweep decision {k} is not in a space of {len(base)} decisions")
        fastest = base_time
        for x in range(s.space.sizes[k]):
            if x == base[k]:
                continue
            timed = len(s.trials)
            s.evaluate(base[:k] + (x,) + base[k + 1:])
            t = s.trials[-1].time if len(s.trials) > timed else None      # None: rejected, or not timed
            if t is not None and (fastest is None or t < fastest):
                fastest, best[k] = t, x
    s.evaluate(tuple(best))


def search(space: SearchSpace, timer: Timer, budget: int, seed: int = 0, initial: int = 8,
           mutation_rate: float | None = None, progress: Callable[[SearchProgress], None] | None = None,
           seed_genomes: Iterable[Sequence[int]] = (), elite: int = 4, population: int | None = None,
           crossover_rate: float = 0.25, sweep: Sequence[int] = ()) -> SearchResult:
    """Search ``space`` for the genome with the lowest ``timer`` time, within ``budget`` timer calls.

    * ``seed_genomes`` are timed first (e.g. the cost model's pick, or the previous best), then random
      genomes until ``initial`` have been timed.
    * ``sweep`` (decision indices; needs a seed): right after the seeds, each other option of each swept
      decision is timed on the first seed, one change at a time, then the seed with every swept decision
      at its fastest option. Where decisions act nearly independently (one kernel's block size and
      another's split), that finds the best combination in ``1 + sum(options - 1)`` timings, where random
      draws in a space of their product would rarely meet it.
    * Each later generation makes ``population`` (default ``initial``) children: a parent drawn from
      the ``elite`` fastest so far (faster ones more often), optionally crossed with a second one
      (``crossover_rate``), then mutated: each decision changes with probability ``mutation_rate``
      (default ``1 / number of decisions``), and at least one always does. A child already timed is
      redrawn; if that keeps failing a fresh random (or, in small spaces, the next unseen) genome is
      timed instead, so the search stops only at ``budget`` or when the space is exhausted.
    * A timer's :class:`CandidateRejected` (and a non-finite or negative time) records the trial with a
      reason and time ``None``; any other exception propagates.
    * ``progress(SearchProgress)`` is called after every timed candidate.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be a non-negative integer, got {budget!r}")
    if initial < 1 or elite < 1:
        raise ValueError("initial and elite must be at least 1")
    rate = (1.0 / max(len(space), 1)) if mutation_rate is None else float(mutation_rate)
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"mutation_rate must be in [0, 1], got {mutation_rate!r}")
    population = initial if population is None else population
    if population < 1:
        raise ValueError("population must be at least 1")
    seeds = [space.validate(g) for g in seed_genomes]

    s = _Search(space, timer, budget, random.Random(seed), progress)
    for g in seeds:
        s.evaluate(g)
    if sweep and seeds:
        _sweep(s, seeds[0], sweep)
    while not s.done and len(s.trials) < initial:
        g = s.fresh()
        if g is None:
            break
        s.evaluate(g)

    while not s.done:
        s.generation += 1
        ranked = sorted((t for t in s.trials if t.ok), key=lambda t: t.time)[:elite]
        weights = [1.0 / (r + 1) for r in range(len(ranked))]
        made = 0
        stalled = False
        while made < population and not s.done:
            child = None
            if ranked:
                for _ in range(16):
                    parent = s.rng.choices(ranked, weights)[0].genome
                    if len(ranked) > 1 and s.rng.random() < crossover_rate:
                        other = s.rng.choices(ranked, weights)[0].genome
                        parent = s.crossover(parent, other)
                    cand = s.mutate(parent, rate)
                    if cand not in s.seen:
                        child = cand
                        break
            if child is None:
                child = s.fresh()
            if child is None:               # a huge space whose random draws all collide: give up
                stalled = True
                break
            s.evaluate(child)
            made += 1
        if stalled:
            break

    best = s.best
    return SearchResult(best.genome if best else None, best.time if best else None, s.trials,
                        exhausted=len(s.seen) >= space.size)
