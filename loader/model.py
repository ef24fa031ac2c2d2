"""Open a ``.lumpkg`` and run it: validation first, then sessions that carry the KV cache.

    pkg = lum.loader.open("model.lumpkg")              # validates; touches no GPU
    sess = pkg.session(dyn={"s": 128}, backend="reference")
    logits = sess.run("prefill", {"tokens": ids}, dyn={"s": len(ids)})["logits"]
    tokens = sess.generate(ids, max_new_tokens=32)

A session runs an entry point as its manifest says: an ordered list of group calls, each binding the
group's LLIR program inputs and outputs (in program order) to named values — weights (zero-copy from
the package's memory map), the caller's inputs, the session's state (KV caches) and intermediates.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from lum.format.errors import LumError, PackageFormatError
from lum.format.expr import Expr
from lum.format.llir import Program
from lum.format.manifest import Entry, Manifest
from lum.format.package import PackageReader, open_package
from lum.format.shapetracker import numel
from lum.loader.arena import ArenaPlan, BufferRequest, plan_arena
from lum.loader.errors import BackendUnavailableError, SessionError

BACKENDS = ("auto", "reference", "cuda")


@dataclass(frozen=True)
class BufferInfo:
    """One buffer of an entry's run: symbolic size, live steps, and the buffer it aliases (in place)."""

    name: str
    size: Expr
    first: int
    last: int
    alias_of: str | None
    kind: str   # "intermediate" | "value" (crosses group calls)


class Package:
    """A validated package. Metadata is parsed and hashed on open; weights stay in the memory map."""

    def __init__(self, path: str | os.PathLike, verify: str = "metadata"):
        self.path = os.fspath(path)
        self.reader: PackageReader = open_package(self.path, verify=verify)
        try:
            self.manifest = Manifest.from_json(self.reader.manifest, set(self.reader.names()))
            self.programs = [self._program(i) for i in range(len(self.manifest.groups))]
            self._check_calls()
        except LumError as exc:
            self.reader.close()
            if exc.path is None:
                raise type(exc)(exc.reason, path=self.path) from None
            raise
        except BaseException:
            self.reader.close()
            raise

    # ------------------------------------------------------------------ validation
    def _program(self, i: int) -> Program:
        ref = self.manifest.groups[i]
        try:
            return Program.loads(self.reader.section_bytes(ref.llir).decode("utf-8"))
        except LumError:
            raise
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise PackageFormatError(f"group {i}: invalid LLIR in section {ref.llir!r} ({_one_line(exc)})") from None

    def _check_calls(self) -> None:
        for entry in self.manifest.entries.values():
            for k, call in enumerate(entry.calls):
                prog = self.programs[call.group]
                n_in, n_out = len(prog.inputs()), len(prog.outputs())
                if (n_in, n_out) != (len(call.inputs), len(call.outputs)):
                    raise PackageFormatError(
                        f"entry {entry.name!r} call {k}: group {call.group} takes {n_in} inputs and gives {n_out} "
                        f"outputs, the call binds {len(call.inputs)} and {len(call.outputs)}")

    # ------------------------------------------------------------------ access
    @property
    def entries(self) -> dict[str, Entry]:
        return self.manifest.entries

    def entry(self, name: str) -> Entry:
        try:
            return self.manifest.entries[name]
        except KeyError:
            raise SessionError(f"package has no entry {name!r}; it has {sorted(self.manifest.entries)}") from None

    def weight(self, name: str) -> np.ndarray:
        w = self.manifest.weights[name]
        return self.reader.array(w.section, w.dtype.np, w.shape)

    def tokenizer_json(self) -> str | None:
        if self.manifest.tokenizer is None:
            return None
        return self.reader.section_bytes(self.manifest.tokenizer).decode("utf-8")

    def verify(self) -> None:
        """Hash every section (weights and cubins included)."""
        self.reader.verify()

    def session(self, dyn: Mapping[str, int] | None = None, backend: str = "auto") -> Session:
        return Session(self, dict(dyn or {}), backend)

    # ------------------------------------------------------------------ buffer plan
    def buffers(self, entry: str) -> list[BufferInfo]:
        """Every buffer an entry's run writes, with symbolic sizes, live steps and in-place aliases."""
        e = self.entry(entry)
        external = set(self.manifest.weights) | set(self.manifest.state) | {t.name for t in e.inputs}
        out: dict[str, BufferInfo] = {}
        last_use: dict[str, int] = {}
        step = 0
        for c, call in enumerate(e.calls):
            prog = self.programs[call.group]
            names: dict[int, str] = {}
            in_ops = prog.inputs()
            for op, value in zip(in_ops, call.inputs):
                names[op.id] = value
                last_use[value] = step
            out_ops = {o.id: v for o, v in zip(prog.outputs(), call.outputs)}
            for op in prog.ops:
                step += 1
                for a in op.args:
                    if a.src in names:
                        last_use[names[a.src]] = step
                if op.kind in ("input", "constant"):
                    if op.kind == "constant":
                        names[op.id] = f"c{c}.{op.id}"
                    continue
                if op.kind == "output":
                    src = names[op.args[0].src]
                    value = out_ops[op.id]
                    if value not in external and src in out:
                        # the named value is the producing buffer itself
                        out[value] = BufferInfo(value, out[src].size, out[src].first, step, src, "value")
                    last_use[src] = step
                    names[op.id] = value
                    continue
                name = f"c{c}.{op.id}"
                names[op.id] = name
                alias = None
                if op.alias is not None:
                    target = names[op.args[op.alias].src]
                    alias = target if target in out else None
                size = numel(op.shape) * op.dtype.itemsize
                out[name] = BufferInfo(name, size, step, step, alias, "intermediate")
        return [BufferInfo(b.name, b.size, b.first, max(b.last, last_use.get(b.name, b.last)), b.alias_of, b.kind)
                for b in out.values()]

    def plan(self, entry: str, dyn_map: Mapping[str, int]) -> ArenaPlan:
        reqs = [BufferRequest(b.name, b.size.evaluate(dyn_map), b.first, b.last, b.alias_of)
                for b in self.buffers(entry)]
        return plan_arena(reqs)

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> Package:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def open(path: str | os.PathLike, verify: str = "metadata") -> Package:  # noqa: A001 - mirrors io.open
    """Open and validate a package (see :class:`Package`)."""
    return Package(path, verify)


class Session:
    """Runs a package's entry points, carrying its state (KV caches) between calls."""

    def __init__(self, pkg: Package, dyn: dict[str, int], backend: str):
        if backend not in BACKENDS:
            raise SessionError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
        if backend == "cuda":
            raise BackendUnavailableError("the CUDA backend is not available in this build of lum")
        self.backend = "reference"
        self.pkg = pkg
        self.dyn = dyn
        self._weights: dict[str, np.ndarray] = {}
        self.state = {n: np.zeros(t.concrete_shape({}), dtype=t.dtype.np) for n, t in pkg.manifest.state.items()}
        self.position = 0

    def reset(self) -> None:
        for arr in self.state.values():
            arr[...] = 0
        self.position = 0

    def _value(self, name: str, values: dict[str, np.ndarray]) -> np.ndarray:
        if name in values:
            return values[name]
        if name in self.state:
            return self.state[name]
        if name in self.pkg.manifest.weights:
            w = self._weights.get(name)
            if w is None:
                w = self._weights[name] = self.pkg.weight(name)
            return w
        raise SessionError(f"value {name!r} is not available")

    def run(self, entry: str, inputs: Mapping[str, np.ndarray], dyn: Mapping[str, int]) -> dict[str, np.ndarray]:
        from lum.loader.reference_backend import execute

        e = self.pkg.entry(entry)
        dyn = {k: int(v) for k, v in dyn.items()}
        missing = [d for d in e.dyn if d not in dyn]
        if missing:
            raise SessionError(f"entry {entry!r} needs dyn values for {missing}")
        values: dict[str, np.ndarray] = {}
        for spec in e.inputs:
            if spec.name not in inputs:
                raise SessionError(f"entry {entry!r} needs input {spec.name!r}")
            arr = np.asarray(inputs[spec.name])
            want = spec.concrete_shape(dyn)
            if arr.shape != want:
                raise SessionError(f"input {spec.name!r} has shape {arr.shape}, entry {entry!r} expects {want}")
            values[spec.name] = arr.astype(spec.dtype.np, copy=False)
        for call in e.calls:
            prog = self.pkg.programs[call.group]
            bound = {op.params["name"]: self._value(v, values) for op, v in zip(prog.inputs(), call.inputs)}
            result = execute(prog, bound, dyn, inplace_state=True)
            for op, v in zip(prog.outputs(), call.outputs):
                arr = result[op.params["name"]]
                if v in self.state:
                    self.state[v][...] = arr
                else:
                    values[v] = arr
        return {t.name: values[t.name] if t.name in values else self.state[t.name] for t in e.outputs}

    # ------------------------------------------------------------------ LLM convenience
    def generate(self, token_ids: list[int], max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
        """Greedy decoding: prefill the prompt, then decode one token at a time with the KV cache."""
        if not token_ids:
            raise SessionError("generate needs at least one prompt token")
        if max_new_tokens < 0:
            raise SessionError("max_new_tokens must be non-negative")
        max_seq = int(self.pkg.manifest.model.get("max_seq", 0))
        vocab = int(self.pkg.manifest.model.get("vocab_size", 0))
        if any(not 0 <= t < vocab for t in token_ids):
            raise SessionError(f"prompt token ids must lie in [0, {vocab})")
        if len(token_ids) + max_new_tokens > max_seq:
            raise SessionError(f"prompt ({len(token_ids)}) + new tokens ({max_new_tokens}) exceed the package's "
                               f"max_seq {max_seq}")
        eos = set(self.pkg.manifest.generation.get("eos_token_ids", [])) if stop_at_eos else set()
        self.reset()
        ids = np.asarray(token_ids, dtype=np.int32)
        logits = self.run("prefill", {"tokens": ids}, {"s": len(ids)})["logits"]
        self.position = len(ids)
        out: list[int] = []
        while len(out) < max_new_tokens:
            nxt = int(np.argmax(logits[-1]))
            out.append(nxt)
            if nxt in eos or len(out) == max_new_tokens:
                break
            logits = self.run("decode", {"tokens": np.asarray([nxt], np.int32)}, {"p": self.position})["logits"]
            self.position += 1
        return out
