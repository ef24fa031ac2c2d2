"""The model manifest: what a ``.lumpkg`` holds and how its entry points run (schema ``lum.model/1``).

The container (:mod:`lum.format.package`) stores named sections; this module gives them meaning:
the model's identity, the compile target, provenance, the weights and KV-cache state, the compiled
groups (one LLIR program each, section ``llir/<k>``) and, per entry point, the ordered group calls that
compute it with the names of the values each call reads and writes. Parsing is strict: every field is
type-checked and every cross-reference resolved, and a violation raises :class:`PackageFormatError`
with one line, so a corrupt or hostile manifest never reaches the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lum.format.dtypes import DType
from lum.format.errors import PackageFormatError
from lum.format.expr import Expr, ExprParseError, parse

SCHEMA = "lum.model"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[Expr, ...]
    dtype: DType

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": [str(d) for d in self.shape], "dtype": self.dtype.value}

    def concrete_shape(self, dyn_map: dict[str, int]) -> tuple[int, ...]:
        return tuple(d.evaluate(dyn_map) for d in self.shape)


@dataclass(frozen=True)
class Call:
    """Run group ``group`` binding its program inputs/outputs, in order, to these value names."""

    group: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "inputs": list(self.inputs), "outputs": list(self.outputs)}


@dataclass(frozen=True)
class Entry:
    name: str
    dyn: tuple[str, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    calls: tuple[Call, ...]

    def to_json(self) -> dict[str, Any]:
        return {"dyn": list(self.dyn), "inputs": [t.to_json() for t in self.inputs],
                "outputs": [t.to_json() for t in self.outputs], "calls": [c.to_json() for c in self.calls]}


@dataclass(frozen=True)
class WeightRef:
    name: str
    section: str
    shape: tuple[int, ...]
    dtype: DType

    def to_json(self) -> dict[str, Any]:
        return {"section": self.section, "shape": list(self.shape), "dtype": self.dtype.value}


@dataclass(frozen=True)
class GroupRef:
    hash: str
    llir: str                       # section holding the LLIR JSON
    chunks: int                     # how many chunks of the model run this group
    kernels: dict[str, Any] = field(default_factory=dict)   # filled by the CUDA backend issue

    def to_json(self) -> dict[str, Any]:
        return {"hash": self.hash, "llir": self.llir, "chunks": self.chunks, "kernels": self.kernels}


@dataclass
class Manifest:
    model: dict[str, Any]
    target: dict[str, Any]
    provenance: dict[str, Any]
    groups: list[GroupRef]
    entries: dict[str, Entry]
    state: dict[str, TensorSpec]
    weights: dict[str, WeightRef]
    tokenizer: str | None = None
    generation: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
            "model": self.model, "target": self.target, "provenance": self.provenance,
            "groups": [g.to_json() for g in self.groups],
            "entries": {k: e.to_json() for k, e in self.entries.items()},
            "state": {k: {"shape": [str(d) for d in t.shape], "dtype": t.dtype.value} for k, t in self.state.items()},
            "weights": {k: w.to_json() for k, w in self.weights.items()},
            "tokenizer": self.tokenizer, "generation": self.generation,
        }

    @staticmethod
    def from_json(d: Any, sections: set[str] | None = None) -> Manifest:
        """Validate and parse; ``sections`` (the container's names) lets references be checked."""
        return _Parser(sections).manifest(d)


# ====================================================================== strict parsing
class _Parser:
    def __init__(self, sections: set[str] | None):
        self.sections = sections

    def fail(self, where: str, what: str) -> PackageFormatError:
        return PackageFormatError(f"manifest: {where}: {what}")

    def obj(self, v: Any, where: str) -> dict:
        if not isinstance(v, dict):
            raise self.fail(where, "expected an object")
        return v

    def lst(self, v: Any, where: str) -> list:
        if not isinstance(v, list):
            raise self.fail(where, "expected a list")
        return v

    def string(self, v: Any, where: str) -> str:
        if not isinstance(v, str) or not v or len(v) > 4096:
            raise self.fail(where, "expected a non-empty string")
        return v

    def integer(self, v: Any, where: str, lo: int = 0, hi: int = 1 << 62) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self.fail(where, f"expected an integer in [{lo}, {hi}]")
        return v

    def expr(self, v: Any, where: str) -> Expr:
        try:
            return parse(self.string(v, where))
        except ExprParseError as exc:
            raise self.fail(where, f"bad expression ({exc})") from None

    def dtype(self, v: Any, where: str) -> DType:
        try:
            return DType(self.string(v, where))
        except ValueError:
            raise self.fail(where, f"unknown dtype {v!r}") from None

    def section(self, v: Any, where: str) -> str:
        name = self.string(v, where)
        if self.sections is not None and name not in self.sections:
            raise self.fail(where, f"refers to missing section {name!r}")
        return name

    def tensor(self, d: Any, where: str, name: str | None = None) -> TensorSpec:
        d = self.obj(d, where)
        name = name if name is not None else self.string(d.get("name"), where + ".name")
        shape = tuple(self.expr(x, f"{where}.shape") for x in self.lst(d.get("shape"), where + ".shape"))
        return TensorSpec(name, shape, self.dtype(d.get("dtype"), where + ".dtype"))

    def manifest(self, d: Any) -> Manifest:
        d = self.obj(d, "top level")
        if d.get("schema") != SCHEMA:
            raise self.fail("schema", f"expected {SCHEMA!r}, found {d.get('schema')!r}")
        version = self.integer(d.get("schema_version"), "schema_version", 1)
        if version > SCHEMA_VERSION:
            raise self.fail("schema_version", f"{version} is newer than this loader understands ({SCHEMA_VERSION})")
        model = self.obj(d.get("model"), "model")
        target = self.obj(d.get("target"), "target")
        provenance = self.obj(d.get("provenance"), "provenance")
        groups = []
        for i, g in enumerate(self.lst(d.get("groups"), "groups")):
            g = self.obj(g, f"groups[{i}]")
            groups.append(GroupRef(self.string(g.get("hash"), f"groups[{i}].hash"),
                                   self.section(g.get("llir"), f"groups[{i}].llir"),
                                   self.integer(g.get("chunks"), f"groups[{i}].chunks", 1),
                                   self.obj(g.get("kernels", {}), f"groups[{i}].kernels")))
        weights = {}
        for name, w in self.obj(d.get("weights"), "weights").items():
            w = self.obj(w, f"weights[{name!r}]")
            shape = tuple(self.integer(x, f"weights[{name!r}].shape") for x in self.lst(w.get("shape"), "shape"))
            weights[name] = WeightRef(name, self.section(w.get("section"), f"weights[{name!r}].section"), shape,
                                      self.dtype(w.get("dtype"), f"weights[{name!r}].dtype"))
        state = {name: self.tensor(t, f"state[{name!r}]", name)
                 for name, t in self.obj(d.get("state"), "state").items()}
        entries = {}
        for name, e in self.obj(d.get("entries"), "entries").items():
            entries[name] = self.entry(name, e, len(groups), set(weights) | set(state))
        tok = d.get("tokenizer")
        tokenizer = None if tok is None else self.section(tok, "tokenizer")
        return Manifest(model, target, provenance, groups, entries, state, weights, tokenizer,
                        self.obj(d.get("generation", {}), "generation"))

    def entry(self, name: str, d: Any, n_groups: int, globals_: set[str]) -> Entry:
        where = f"entries[{name!r}]"
        d = self.obj(d, where)
        dyn = tuple(self.string(x, where + ".dyn") for x in self.lst(d.get("dyn"), where + ".dyn"))
        inputs = tuple(self.tensor(t, f"{where}.inputs[{i}]") for i, t in enumerate(self.lst(d.get("inputs"), "inputs")))
        outputs = tuple(self.tensor(t, f"{where}.outputs[{i}]") for i, t in enumerate(self.lst(d.get("outputs"), "outputs")))
        known = set(globals_) | {t.name for t in inputs}
        calls = []
        for i, c in enumerate(self.lst(d.get("calls"), where + ".calls")):
            cw = f"{where}.calls[{i}]"
            c = self.obj(c, cw)
            group = self.integer(c.get("group"), cw + ".group", 0, max(n_groups - 1, 0))
            if not n_groups:
                raise self.fail(cw, "no groups to call")
            ins = tuple(self.string(x, cw + ".inputs") for x in self.lst(c.get("inputs"), cw + ".inputs"))
            outs = tuple(self.string(x, cw + ".outputs") for x in self.lst(c.get("outputs"), cw + ".outputs"))
            for x in ins:
                if x not in known:
                    raise self.fail(cw, f"reads {x!r} before anything writes it")
            known |= set(outs)
            calls.append(Call(group, ins, outs))
        for t in outputs:
            if t.name not in known:
                raise self.fail(where, f"output {t.name!r} is never written")
        declared = set(dyn)
        for t in inputs + outputs:
            for dim in t.shape:
                missing = dim.vars() - declared
                if missing:
                    raise self.fail(where, f"{t.name!r} uses undeclared dyn vars {sorted(missing)}")
        return Entry(name, dyn, inputs, outputs, tuple(calls))
