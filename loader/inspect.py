"""``lum inspect``: a package described as plain data (and printed as tables)."""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping

from lum.loader.model import Package


def _default_dyn(pkg: Package, entry: str) -> dict[str, int]:
    """Dyn values used when the user gives none: a 1-token prefill, decode at position 0."""
    return {d: (1 if d == "s" else 0) for d in pkg.entry(entry).dyn}


def describe(pkg: Package, dyn: Mapping[str, int] | None = None) -> dict[str, Any]:
    m = pkg.manifest
    sections: Counter = Counter()
    for s in pkg.reader.sections:
        sections[s.kind or s.name] += s.stored_length
    groups = []
    kernels: Counter = Counter()
    for k, (ref, prog) in enumerate(zip(m.groups, pkg.programs)):
        kinds = Counter(f"{o.kind}:{o.op}" if o.kind in ("elementwise", "reduce", "gemm") else o.kind
                        for o in prog.kernels())
        for kind, n in kinds.items():
            kernels[kind] += n * ref.chunks
        aliases = [{"op": o.id, "kind": o.kind, "writes_into": prog.ops[o.args[o.alias].src].params.get("name",
                                                                                                     f"op{o.args[o.alias].src}")}
                   for o in prog.ops if o.alias is not None]
        groups.append({"index": k, "hash": ref.hash[:16], "calls": ref.chunks, "ops": len(prog.ops),
                       "kernels": dict(sorted(kinds.items())), "aliases": aliases})
    entries = {}
    for name, e in m.entries.items():
        d = {**_default_dyn(pkg, name), **{k: v for k, v in (dyn or {}).items() if k in e.dyn}}
        plan = pkg.plan(name, d)
        buffers = pkg.buffers(name)
        entries[name] = {
            "dyn": list(e.dyn), "dyn_values": d, "calls": len(e.calls),
            "inputs": [t.to_json() for t in e.inputs], "outputs": [t.to_json() for t in e.outputs],
            "buffer_plan": {
                "buffers": len(buffers), "aliases": {a: r for a, r in plan.roots.items()},
                "arena_bytes": plan.size, "unshared_bytes": plan.unshared_size,
            },
        }
    state_bytes = sum(_prod(t.concrete_shape({})) * t.dtype.itemsize for t in m.state.values())
    return {
        "path": pkg.path, "format": ".".join(map(str, pkg.reader.version)), "file_bytes": pkg.reader.file_size,
        "model": {k: v for k, v in m.model.items() if k != "config"}, "target": m.target,
        "provenance": m.provenance, "entries": entries, "groups": groups,
        "kernels_by_kind": dict(sorted(kernels.items())), "state_bytes": state_bytes,
        "weights": {"tensors": len(m.weights), "bytes": sections.get("weight", 0)},
        "sections_by_kind": dict(sorted(sections.items())),
    }


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def print_description(info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    model = info["model"]
    c.print(f"[bold]{info['path']}[/bold]  format {info['format']}  ·  {info['file_bytes'] / 2**20:.1f} MiB")
    c.print(f"model {model.get('name')} ({model.get('arch')}, {model.get('dtype')}, {model.get('param_count'):,} "
            f"parameters, max_seq {model.get('max_seq')})  ·  target {info['target'].get('sm')}")
    prov = info["provenance"]
    c.print("built with " + ", ".join(f"{k} {v}" for k, v in prov.items() if k not in ("source",)))
    t = Table(title="Entries")
    for col in ("entry", "dyn", "calls", "buffers", "in-place aliases", "arena", "unshared"):
        t.add_column(col)
    for name, e in info["entries"].items():
        bp = e["buffer_plan"]
        t.add_row(name, ", ".join(f"{k}={v}" for k, v in e["dyn_values"].items()), str(e["calls"]),
                  str(bp["buffers"]), str(len(bp["aliases"])), _size(bp["arena_bytes"]), _size(bp["unshared_bytes"]))
    c.print(t)
    t = Table(title="Groups")
    for col in ("#", "hash", "calls", "ops", "kernels", "in place"):
        t.add_column(col)
    for g in info["groups"]:
        t.add_row(str(g["index"]), g["hash"], str(g["calls"]), str(g["ops"]),
                  " ".join(f"{k}×{v}" for k, v in g["kernels"].items()),
                  ", ".join(f"{a['kind']}→{a['writes_into']}" for a in g["aliases"]) or "-")
    c.print(t)
    t = Table(title="Sections by kind")
    t.add_column("kind")
    t.add_column("bytes", justify="right")
    for k, v in info["sections_by_kind"].items():
        t.add_row(k, _size(v))
    c.print(t)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
