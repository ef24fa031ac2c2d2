"""Compile HLIR to LLIR per group: partition → group → e-graph saturation → extraction → lowering.

:func:`compile_group` compiles one standalone group graph (see
:func:`lum.builder.partition.chunk_graph`); :func:`compile_graph` partitions a whole entry graph,
groups structurally identical chunks and compiles each group once (its representative chunk). On a
machine with no GPU the selection is made by a cost model; the measured search
(:mod:`lum.builder.search`) works on the same :class:`~lum.builder.egraph.SaturatedGroup` decision
points through :func:`lum.builder.extract.random_choice` / :func:`lum.builder.extract.lower`.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from lum.builder.egraph import SaturatedGroup, saturate
from lum.builder.extract import Choice, choose_by_cost, lower
from lum.builder.hlir import Graph
from lum.builder.partition import Group, chunk_graph, group_chunks, partition
from lum.format.llir import LOp, Program

__all__ = ["CompiledGroup", "compile_group", "compile_graph", "group_stats", "weight_inputs"]

CostFn = Callable[[LOp], float]


@dataclass
class CompiledGroup:
    """One group's result: its standalone graph, the chosen LLIR program and the compile stats."""

    group: Group
    graph: Graph
    program: Program
    stats: dict[str, Any] = field(default_factory=dict)


def compile_group(group_graph: Graph, cost_fn: CostFn | None = None, choice: Choice | None = None,
                  sat: SaturatedGroup | None = None) -> tuple[Program, dict[str, Any]]:
    """Saturate, extract (by ``choice`` if given, else the cheapest under ``cost_fn``) and lower one group."""
    t0 = time.perf_counter()
    if sat is None:
        sat = saturate(group_graph)
    t1 = time.perf_counter()
    if choice is None:
        choice = choose_by_cost(sat, cost_fn)
    program = lower(sat, choice, name=group_graph.name)
    t2 = time.perf_counter()
    stats = group_stats(sat, program)
    stats["seconds_extract"] = t2 - t1
    stats["seconds"] = stats["seconds_saturate"] + stats["seconds_extract"]
    stats["seconds_wall"] = t2 - t0
    return program, stats


def group_stats(sat: SaturatedGroup, program: Program | None = None) -> dict[str, Any]:
    """E-graph size and timings of a saturated group, and what its program uses."""
    out = {k: v for k, v in sat.stats.items()}
    out["rules_fired"] = {k: v for k, v in sorted(sat.matches.items())
                          if v and not k.startswith(("build-", "dt-", "lower-"))}
    if program is not None:
        kinds = Counter(o.kind for o in program.ops)
        out["llir_ops"] = len(program.ops)
        out["kernels"] = len(program.kernels())
        out["gemms"] = kinds.get("gemm", 0)
        out["in_place"] = sum(1 for o in program.ops if o.alias is not None)
    return out


def weight_inputs(graph: Graph, program: Program) -> frozenset[int]:
    """The op ids of ``program``'s inputs named as ``graph``'s weights (a model graph and one of its compiled
    groups): what ``lum build`` passes kernel generation as weights, for tools and tests that compile a model's
    groups without building a package."""
    names = {n.attrs["name"] for n in graph.nodes if n.attrs.get("role") == "weight"}
    return frozenset(op.id for op in program.inputs() if op.params.get("name") in names)


def compile_graph(graph: Graph, cost_fn: CostFn | None = None) -> list[CompiledGroup]:
    """Every group of ``graph`` compiled once (its representative chunk), in group order."""
    chunks = partition(graph)
    out = []
    for grp in group_chunks(graph, chunks):
        cg = chunk_graph(graph, grp.representative)
        program, stats = compile_group(cg, cost_fn)
        stats["chunks"] = len(grp)
        out.append(CompiledGroup(grp, cg, program, stats))
    return out
