"""What ``lum graph`` reports about a model: HLIR size per entry graph, its chunks and groups, parameters.

:func:`summarize` returns plain JSON-able data (the ``--json`` output); :func:`print_summary` renders
the same data as rich tables. With ``egraph=True`` every group is also saturated and extracted
(:mod:`lum.builder.compile`), and its group entry gains an ``egraph`` record: e-classes, e-nodes,
decision points, seconds to saturate and to extract, GEMM calls and in-place ops in the chosen program.
"""

from __future__ import annotations

import dataclasses
import math
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

from lum.builder.hlir import Graph
from lum.builder.partition import group_chunks, partition
from lum.format.expr import Expr

__all__ = ["summarize", "summarize_graph", "print_summary"]


def summarize_graph(graph: Graph, egraph: bool = False) -> dict[str, Any]:
    """Node counts, chunks, groups and dyn vars of one HLIR graph (and per-group e-graph stats)."""
    chunks = partition(graph)
    groups = group_chunks(graph, chunks)
    size = {c.index: len(c) for c in chunks}
    out = {
        "nodes": len(graph),
        "ops": dict(sorted(graph.op_counts().items(), key=lambda kv: (-kv[1], kv[0]))),
        "inputs": {role: len(graph.inputs(role)) for role in ("input", "weight", "state")},
        "outputs": {role: len(graph.outputs(role)) for role in ("output", "state")},
        "dyn_vars": sorted(graph.dyn_vars),
        "chunks": len(chunks),
        "groups": [
            {"hash": g.hash, "chunks": list(g.chunks), "nodes_per_chunk": size[g.chunks[0]]}
            for g in groups
        ],
    }
    if egraph:
        for entry, g in zip(out["groups"], groups):
            entry["egraph"] = egraph_stats(graph, g)
    return out


def egraph_stats(graph: Graph, group: Any) -> dict[str, Any]:
    """Saturate and extract one group (its representative chunk) and report sizes and seconds."""
    from lum.builder.compile import compile_group
    from lum.builder.partition import chunk_graph

    _, st = compile_group(chunk_graph(graph, group.representative))
    return {
        "eclasses": st["eclasses"],
        "enodes": st["enodes"],
        "decisions": st["decisions"],
        "seconds_saturate": round(st["seconds_saturate"], 4),
        "seconds_extract": round(st["seconds_extract"], 4),
        "gemms": st["gemms"],
        "in_place": st["in_place"],
        "rules_fired": st["rules_fired"],
    }


def summarize(spec: Any, egraph: bool = False) -> dict[str, Any]:
    """Summary of a model spec (``.name``, ``.config``, ``.graphs``, ``.param_count``, ``.param_bytes``).

    ``egraph``: also saturate and extract every group and report the e-graph per group."""
    graphs: Mapping[str, Graph] = spec.graphs
    return {
        "model": spec.name,
        "param_count": int(spec.param_count),
        "param_bytes": int(spec.param_bytes),
        "config": _jsonable(getattr(spec, "config", None)),
        "graphs": {name: summarize_graph(g, egraph=egraph) for name, g in graphs.items()},
    }


# ====================================================================== printing
def print_summary(summary: Mapping[str, Any], console: Any = None) -> None:
    """Render :func:`summarize`'s result as rich tables (to stdout unless a console is given)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    console.print(f"[bold]{summary['model']}[/bold]  ·  {_count(summary['param_count'])} parameters  ·  "
                  f"{_bytes(summary['param_bytes'])}")
    graphs = summary["graphs"]
    names = list(graphs)

    overview = Table(title="Entry graphs", title_justify="left")
    overview.add_column("")
    for name in names:
        overview.add_column(name, justify="right")
    rows = [
        ("HLIR nodes", lambda g: str(g["nodes"])),
        ("chunks", lambda g: str(g["chunks"])),
        ("groups", lambda g: str(len(g["groups"]))),
        ("chunks per group", lambda g: " ".join(str(len(x["chunks"])) for x in g["groups"])),
        ("dyn vars", lambda g: ", ".join(g["dyn_vars"]) or "-"),
        ("inputs / weights / state", lambda g: "{input} / {weight} / {state}".format(**g["inputs"])),
    ]
    for label, fn in rows:
        overview.add_row(label, *(fn(graphs[n]) for n in names))
    console.print(overview)

    ops = Table(title="HLIR nodes by op", title_justify="left")
    ops.add_column("op")
    for name in names:
        ops.add_column(name, justify="right")
    all_ops: dict[str, int] = {}
    for g in graphs.values():
        for op, n in g["ops"].items():
            all_ops[op] = all_ops.get(op, 0) + n
    for op in sorted(all_ops, key=lambda o: (-all_ops[o], o)):
        ops.add_row(op, *(str(graphs[n]["ops"].get(op, "")) for n in names))
    ops.add_row("[bold]total[/bold]", *(f"[bold]{graphs[n]['nodes']}[/bold]" for n in names))
    console.print(ops)

    for name in names:
        groups = Table(title=f"Groups of {name!r}", title_justify="left")
        groups.add_column("group", justify="right")
        groups.add_column("hash")
        groups.add_column("chunks", justify="right")
        groups.add_column("nodes/chunk", justify="right")
        groups.add_column("chunk indices")
        for i, g in enumerate(graphs[name]["groups"]):
            groups.add_row(str(i), g["hash"][:12], str(len(g["chunks"])), str(g["nodes_per_chunk"]),
                           _ranges(g["chunks"]))
        console.print(groups)
        if any("egraph" in g for g in graphs[name]["groups"]):
            eg = Table(title=f"E-graph per group of {name!r}", title_justify="left")
            for col in ("group", "e-classes", "e-nodes", "choices", "sat s", "extract s", "GEMM", "in-place"):
                eg.add_column(col, justify="right")
            for i, g in enumerate(graphs[name]["groups"]):
                e = g.get("egraph")
                if e is None:
                    continue
                eg.add_row(str(i), str(e["eclasses"]), str(e["enodes"]), str(e["decisions"]),
                           f"{e['seconds_saturate']:.3f}", f"{e['seconds_extract']:.3f}", str(e["gemms"]),
                           str(e["in_place"]))
            console.print(eg)


# ====================================================================== helpers
def _jsonable(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, Enum):
        return x.value if isinstance(x.value, (str, int)) else x.name
    if isinstance(x, (Expr, Path)):
        return str(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        items = [_jsonable(v) for v in x]
        return sorted(items, key=str) if isinstance(x, (set, frozenset)) else items
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        try:
            return _jsonable(x.item())
        except (TypeError, ValueError):
            pass
    if hasattr(x, "to_dict") and callable(x.to_dict):  # e.g. a transformers PretrainedConfig
        return _jsonable(x.to_dict())
    return str(x)


def _ranges(xs: list[int]) -> str:
    """[0,1,2,3,5,7,8] -> '0-3, 5, 7-8'."""
    out: list[str] = []
    start = prev = None
    for x in xs:
        if prev is not None and x == prev + 1:
            prev = x
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = x
    if start is not None:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(out)


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit} ({n:,})"
    return str(n)


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
