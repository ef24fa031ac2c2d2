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
from typing import Any, Mapping

import numpy as np

from lum.format.dtypes import DType
from lum.format.errors import IncompatibleTargetError, LumError, PackageFormatError
from lum.format.expr import Expr
from lum.format.llir import Program, gemm_fused
from lum.format.manifest import KERNEL_OP_KINDS, TABLE_OP_KINDS, Entry, Manifest
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
            self._check_kernels()
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

    def _check_kernels(self) -> None:
        """Each group's launch table (parsed strictly by the manifest) must match its LLIR exactly:
        one entry per kernel op (a gemm may have one: lum's kernel; or none: cuBLASLt), same kind, one
        ``in`` parameter per argument, ops that exist."""
        for i, (ref, prog) in enumerate(zip(self.manifest.groups, self.programs)):
            if ref.table is None:
                continue
            table = ref.table.by_op()
            pending: list[int] = []            # the tails the last head has still to reach, in order
            arity: dict[int, int] = {}
            for op in prog.ops:
                k = table.pop(op.id, None)
                if op.kind in ("input", "constant", "output"):
                    if k is not None:
                        raise PackageFormatError(f"group {i}: the launch table has a kernel for LLIR op {op.id}, "
                                                 f"a {op.kind} op")
                    continue
                if pending:                    # a head's tails come next, before any other device work
                    if op.id != pending[0] or k is not None or op.kind not in TABLE_OP_KINDS:
                        raise PackageFormatError(f"group {i}: LLIR op {pending[0]}, a kernel tail, must be the "
                                                 f"kernel op right after its head (found op {op.id}, {op.kind})")
                    if arity.pop(op.id) != len(op.args):
                        raise PackageFormatError(f"group {i}: the launch table passes a wrong number of buffers "
                                                 f"to tail op {op.id} ({op.kind}, {len(op.args)} arguments)")
                    pending.pop(0)
                    continue
                if op.kind in KERNEL_OP_KINDS or (op.kind == "gemm" and (k is not None or gemm_fused(op))):
                    if k is None:
                        raise PackageFormatError(f"group {i}: LLIR op {op.id} ({op.kind}) has no kernel in the "
                                                 "launch table")
                    if k.kind != op.kind or len(k.head_params) != len(op.args) + 2:
                        raise PackageFormatError(f"group {i}: the launch table's op {op.id} ({k.kind}, "
                                                 f"{len(k.head_params) - 2} buffers) does not match the LLIR "
                                                 f"({op.kind}, {len(op.args)} arguments)")
                    pending = list(k.tail)
                    arity = dict(zip(k.tail, k.tail_arities()))
                elif k is not None:
                    raise PackageFormatError(f"group {i}: the launch table has a kernel for LLIR op {op.id}, "
                                             f"a {op.kind} op")
            if pending:
                raise PackageFormatError(f"group {i}: the launch table names tail op {pending[0]}, which does not "
                                         "follow its head")
            if table:
                raise PackageFormatError(f"group {i}: the launch table names LLIR ops {sorted(table)[:5]} that "
                                         "do not exist")
            kinds = {op.id: op.kind for op in prog.ops}
            for g in ref.table.gemms:
                if kinds.get(g.op) != "gemm":
                    raise PackageFormatError(f"group {i}: the launch table has a gemm algorithm for LLIR op {g.op}, "
                                             "which is not a gemm op")

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

    def session(self, dyn: Mapping[str, int] | None = None, backend: str = "auto", **options: Any) -> Session:
        """A session: ``dyn`` bounds the dyn values it will run (CUDA sizes its memory for them; default
        ``s`` = max_seq, ``p`` = max_seq - 1); ``options`` go to the CUDA backend (see :class:`Session`)."""
        return Session(self, dict(dyn or {}), backend, **options)

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
            until = self._reads_until(call.group)
            for op in prog.ops:
                step += 1
                for a in op.args:
                    if a.src in names:
                        last_use[names[a.src]] = step + until.get(op.id, 0)
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
                alias = None
                alias_arg = 0 if op.kind == "scatter_nocopy" else op.alias
                if alias_arg is not None:
                    target = names[op.args[alias_arg].src]
                    if target not in out:
                        # in place into a buffer that lives outside the arena (a state input: the
                        # KV cache): the op's buffer *is* that one and takes no arena space
                        names[op.id] = target
                        continue
                    alias = target
                names[op.id] = name
                size = numel(op.shape) * op.dtype.itemsize
                out[name] = BufferInfo(name, size, step, step, alias, "intermediate")
        for t in e.outputs:                 # the entry's results must survive until the run ends
            if t.name in out:
                last_use[t.name] = step
        return [BufferInfo(b.name, b.size, b.first, max(b.last, last_use.get(b.name, b.last)), b.alias_of, b.kind)
                for b in out.values()]

    def _reads_until(self, group: int) -> dict[int, int]:
        """Op id -> steps from it to the last op its kernel runs, for the ops of the group's kernels with
        tails: what such a kernel reads stays live until all of it has run, since a tail may start while
        blocks of the head still read, so no output of the kernel may take the place of a buffer it reads."""
        table = self.manifest.groups[group].table
        if table is None:
            return {}
        pos = {op.id: k for k, op in enumerate(self.programs[group].ops)}
        return {i: pos[k.tail[-1]] - pos[i] for k in table.ops if k.tail for i in (k.op, *k.tail)}

    def plan(self, entry: str, dyn_map: Mapping[str, int], slack: int = 0) -> ArenaPlan:
        """The arena of ``entry`` at ``dyn_map`` (``slack``: see :func:`lum.loader.arena.plan_arena`)."""
        reqs = [BufferRequest(b.name, b.size.evaluate(dyn_map), b.first, b.last, b.alias_of)
                for b in self.buffers(entry)]
        return plan_arena(reqs, slack)

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


class ReferenceRunner:
    """The numpy reference backend: runs each call's LLIR with :func:`lum.loader.reference_backend.execute`,
    weights zero-copy from the memory map, state in numpy arrays updated in place."""

    name = "reference"

    def __init__(self, pkg: Package):
        self.pkg = pkg
        self._weights: dict[str, np.ndarray] = {}
        self.state = {n: np.zeros(t.concrete_shape({}), dtype=t.dtype.np) for n, t in pkg.manifest.state.items()}

    def reset(self) -> None:
        for arr in self.state.values():
            arr[...] = 0

    def state_arrays(self) -> dict[str, np.ndarray]:
        return self.state

    def load_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        for n, arr in arrays.items():
            self.state[n][...] = arr

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
        values = dict(inputs)
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
        return {t.name: values[t.name] if t.name in values else self.state[t.name].copy() for t in e.outputs}

    def close(self) -> None:
        pass


def _make_runner(pkg: Package, dyn: dict[str, int], backend: str, options: dict[str, Any]) -> tuple[Any, str]:
    """(runner, one-line reason). ``auto`` takes CUDA only when the device matches the package's sm
    exactly and everything else is in place; any reason it cannot becomes ``backend_reason``."""
    if backend == "reference":
        return ReferenceRunner(pkg), "the reference backend was asked for"
    try:
        from lum.loader.cuda.runner import CudaRunner   # imports cuda-python: only now

        opts = dict(options)
        if backend == "auto":
            opts["allow_ptx"] = False
        runner = CudaRunner(pkg, dyn, **opts)
        return runner, runner.reason
    except (BackendUnavailableError, IncompatibleTargetError) as exc:
        if backend == "cuda":
            raise
        return ReferenceRunner(pkg), f"reference backend, because {exc.reason}"


EOS_CHECK = 8        # device-loop steps between looks at the tokens when generate stops at EOS


class Session:
    """Runs a package's entry points, carrying its state (KV caches) between calls.

    ``backend``: ``"reference"`` (numpy), ``"cuda"`` (raises :class:`BackendUnavailableError` or
    :class:`IncompatibleTargetError` when it cannot run here) or ``"auto"`` (CUDA when a GPU of the
    package's sm and everything it needs are present, else the reference backend; ``backend_reason``
    says which and why). Both run the same LLIR with the same ``run``/``generate`` semantics.

    ``dyn`` bounds the dyn values later runs may use (the CUDA backend sizes its arena for them).
    CUDA options: ``device`` (ordinal, default 0), ``graphs`` (capture and replay CUDA graphs,
    default True), ``graph_cache`` (graphs kept per entry, LRU, default 1024), ``upload_method``
    (``"staged"`` or ``"register"``), ``debug_sync`` (synchronise after every op, naming a failure),
    ``graph_branches`` (capture independent kernels on parallel streams, default True;
    ``LUM_CUDA_BRANCHES=0``), ``programmatic_launch`` (programmatic dependent launch on sm_90+, default
    True; ``LUM_CUDA_PDL=0``), ``steps_per_graph`` (greedy decode steps :meth:`generate` captures as one
    CUDA graph, default 8; ``LUM_CUDA_STEPS_PER_GRAPH``; 1: a graph a step).
    """

    def __init__(self, pkg: Package, dyn: dict[str, int], backend: str = "auto", **options: Any):
        if backend not in BACKENDS:
            raise SessionError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
        self.pkg = pkg
        self.dyn = dyn
        self.position = 0
        self._runner, self.backend_reason = _make_runner(pkg, dyn, backend, options)
        self.backend: str = self._runner.name

    # ------------------------------------------------------------------ backend-specific views
    @property
    def state(self) -> dict[str, np.ndarray]:
        """The state tensors (KV caches): the live arrays on the reference backend, host copies on CUDA."""
        return self._runner.state_arrays()

    @property
    def upload_gbps(self) -> float | None:
        """Weight upload rate of the CUDA backend (GB/s, mmap → device); None on the reference backend."""
        up = getattr(self._runner, "upload", None)
        return None if up is None else up.gbps

    @property
    def runner(self) -> Any:
        """The backend object (``ReferenceRunner`` or ``lum.loader.cuda.runner.CudaRunner``)."""
        return self._runner

    def reset(self) -> None:
        self._runner.reset()
        self.position = 0

    def load_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Overwrite state tensors (KV caches) by name with host arrays of their shape and dtype."""
        unknown = set(arrays) - set(self.pkg.manifest.state)
        if unknown:
            raise SessionError(f"no state named {sorted(unknown)}")
        self._runner.load_state(arrays)

    def close(self) -> None:
        """Free the backend's resources (device memory, graphs, modules). Idempotent."""
        self._runner.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ running
    def _inputs(self, entry: str, inputs: Mapping[str, np.ndarray], dyn: Mapping[str, int]) -> tuple[dict, dict]:
        e = self.pkg.entry(entry)
        dyn = {k: int(v) for k, v in dyn.items()}
        missing = [d for d in e.dyn if d not in dyn]
        if missing:
            raise SessionError(f"entry {entry!r} needs dyn values for {missing}")
        negative = [f"{k}={v}" for k, v in dyn.items() if v < 0]
        if negative:
            raise SessionError(f"dyn values must be non-negative: {negative}")
        values: dict[str, np.ndarray] = {}
        for spec in e.inputs:
            if spec.name not in inputs:
                raise SessionError(f"entry {entry!r} needs input {spec.name!r}")
            want = spec.concrete_shape(dyn)
            dev = inputs[spec.name]
            if hasattr(dev, "__cuda_array_interface__") and hasattr(dev, "ptr"):   # a DeviceArray (CUDA)
                if tuple(dev.shape) != want or dev.dtype != spec.dtype:
                    raise SessionError(f"device input {spec.name!r} is {dev.dtype} {tuple(dev.shape)}, entry "
                                       f"{entry!r} expects {spec.dtype} {want}")
                values[spec.name] = dev
                continue
            arr = np.asarray(dev)
            if arr.shape != want:
                raise SessionError(f"input {spec.name!r} has shape {arr.shape}, entry {entry!r} expects {want}")
            values[spec.name] = arr.astype(spec.dtype.np, copy=False)
        return values, dyn

    def run(self, entry: str, inputs: Mapping[str, np.ndarray], dyn: Mapping[str, int]) -> dict[str, np.ndarray]:
        """Run ``entry``; returns its outputs as host numpy arrays."""
        values, dyn = self._inputs(entry, inputs, dyn)
        return self._runner.run(entry, values, dyn)

    def run_device(self, entry: str, inputs: Mapping[str, np.ndarray], dyn: Mapping[str, int]) -> dict[str, Any]:
        """CUDA only: run ``entry`` and leave its outputs on the device as ``DeviceArray`` objects
        (``__cuda_array_interface__`` and DLPack), valid until the session's next run."""
        if not hasattr(self._runner, "run_device"):
            raise SessionError(f"run_device needs the CUDA backend; this session uses {self.backend}")
        values, dyn = self._inputs(entry, inputs, dyn)
        return self._runner.run_device(entry, values, dyn)

    # ------------------------------------------------------------------ LLM convenience
    def generate(self, token_ids: list[int], max_new_tokens: int, stop_at_eos: bool = False,
                 device_loop: bool = True) -> list[int]:
        """Greedy decoding: prefill the prompt, then decode one token at a time with the KV cache.

        On CUDA, with packages that output ``next_token``, the loop stays on the device unless
        ``device_loop=False``: no step waits for the one before it to reach the host (with
        ``stop_at_eos``, the host looks at the tokens every EOS_CHECK steps and stops there, so up to that
        many steps, and a chain's, past an EOS are computed and dropped). Otherwise each step's last logits
        row comes back and the host takes its argmax."""
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
        if device_loop and max_new_tokens > 0 and self._pipelined():
            return self._generate_on_device(ids, max_new_tokens, eos)
        logits = self._last_logits("prefill", {"tokens": ids}, {"s": len(ids)})
        self.position = len(ids)
        out: list[int] = []
        while len(out) < max_new_tokens:
            nxt = int(np.argmax(logits))
            out.append(nxt)
            if nxt in eos or len(out) == max_new_tokens:
                break
            logits = self._last_logits("decode", {"tokens": np.asarray([nxt], np.int32)}, {"p": self.position})
            self.position += 1
        return out

    def _pipelined(self) -> bool:
        """The greedy loop can stay on the device: CUDA, and both entries output ``next_token`` ([1] i32,
        the argmax of the last logits row) and take ``tokens`` as it."""
        if not hasattr(self._runner, "collector"):
            return False
        for name in ("prefill", "decode"):
            e = self.pkg.manifest.entries.get(name)
            outs = {o.name: o for o in e.outputs} if e is not None else {}
            tok = outs.get("next_token")
            if tok is None or tok.dtype != DType.i32 or [str(d) for d in tok.shape] != ["1"]:
                return False
        return True

    def _generate_on_device(self, ids: np.ndarray, max_new_tokens: int, eos: set[int]) -> list[int]:
        """Greedy decoding that never waits for the GPU between steps: each step's input token is the
        previous step's ``next_token`` output, which a decode step writes into its own input slot (no copy:
        loader/cuda/plan.py FEEDBACK; prefill's is copied on the device once). Runs of ``steps_per_graph``
        steps go as one CUDA graph each (loader/cuda/chain.py: no graph boundary between them), the rest one
        step at a time. The tokens come back through pinned memory in stream order (the host runs up to two
        launches ahead, as far as the staging slots allow), read at the end, or every EOS_CHECK steps when
        ``eos`` may stop the loop early."""
        sink = self._runner.collector(max_new_tokens, DType.i32)
        k = self._runner.steps_per_graph
        chain = self._runner.step_chain("decode", k) if max_new_tokens > k else None
        try:
            tok = self.run_device("prefill", {"tokens": ids}, {"s": len(ids)})["next_token"]
            sink.push(tok)
            done, look = 1, EOS_CHECK
            while done < max_new_tokens:
                if eos and done >= look:
                    look = done + EOS_CHECK
                    if eos & set(sink.read().tolist()):
                        break
                p = len(ids) + done - 1
                if chain is not None and max_new_tokens - done >= k:     # k steps, one graph
                    toks = chain.run(tok, {"p": p}, "p")
                    if toks is None:           # no graph: a step at a time (the runner warns, runs eagerly)
                        chain = None
                        continue
                    sink.push(toks)
                    tok, done = chain.last_token(), done + k
                    continue
                tok = self.run_device("decode", {"tokens": tok}, {"p": p})["next_token"]
                sink.push(tok)
                done += 1
            out = [int(t) for t in sink.read()]
        finally:
            sink.close()
        if eos:
            stop = next((i for i, t in enumerate(out) if t in eos), None)
            out = out if stop is None else out[:stop + 1]
        self.position = len(ids) + len(out) - 1      # the last token's KV row is not written yet
        return out

    def _last_logits(self, entry: str, inputs: Mapping[str, np.ndarray], dyn: Mapping[str, int]) -> np.ndarray:
        """The last row of ``logits``; on the GPU only that row comes back to the host (a prefill's
        logits are [s, vocab], easily hundreds of MB)."""
        if hasattr(self._runner, "run_device"):
            dev = self.run_device(entry, inputs, dyn)["logits"]
            return dev.row(-1).numpy()
        return self.run(entry, inputs, dyn)["logits"][-1]
