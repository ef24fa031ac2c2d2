"""The CUDA backend of a :class:`~lum.loader.model.Session`: allocations, modules, graphs, runs.

Created once per session, in this order (each step fails with one line and frees what came before):

1. **Target check** — device compute capability and driver against the manifest target
   (:mod:`lum.loader.cuda.target`) before any allocation: :class:`IncompatibleTargetError`.
2. **Modules** — each group's cubin from its raw section (or its PTX, JIT-compiled, on a newer GPU).
3. **Weights** — one allocation, uploaded from the mmap (:mod:`lum.loader.cuda.upload`); the achieved
   rate is :attr:`CudaRunner.upload` (bytes, seconds, GB/s, method).
4. **Constants** (one small allocation, uploaded once), **state** (one allocation, zeroed), the
   **arena** (one allocation: the largest :meth:`Package.plan` over the entries at the session's
   dyn bounds, followed by staging slots for the entry inputs), the **dyn buffer** (int64 slots in
   the kernel tables' ``dyn_vars`` order) and the cuBLASLt workspace.
5. **Plans** — every entry flattened with fixed pointers (:mod:`lum.loader.cuda.plan`).

A run writes the dyn values and inputs from a pinned staging slot (``cuMemcpyHtoDAsync`` on the
session's stream; an event per slot guards its reuse, so nothing is overwritten while a copy is in
flight), then replays the entry's CUDA graph for the key of the dyn map (bucketed grids, and the exact sizes of
library calls that depend on dyn values) — or captures one first (LRU cache of ``graph_cache`` graphs
per entry; an evicted graph is destroyed, so memory stays flat); see :mod:`lum.loader.cuda.plan`. If a capture fails (a library that refuses stream capture)
the session warns once and runs eagerly. A graph is captured from several streams where the plan's
kernels do not depend on each other (``graph_branches``, default on; ``LUM_CUDA_BRANCHES=0`` turns it
off; :mod:`lum.loader.cuda.branches`), so such kernels run side by side.
``programmatic_launch`` (sm_90+; on by default, ``LUM_CUDA_PDL=0`` turns it off: measured +2.6-3.0% a decode
step) launches the kernels of tables marked programmatic with programmatic stream serialization: each is
scheduled while the kernel before it still runs and waits for it on the device, so its launch and ramp
overlap that kernel's tail, and a GEMV built with preloads copies its first weights into shared memory
meanwhile (templates/common.cuh, gemv.cu; lum.format.manifest says when it is safe).
``graphs=False`` launches
everything eagerly, on one stream;
``debug_sync=True`` (or ``LUM_CUDA_DEBUG_SYNC=1``) also
synchronizes after every step and names the failing op. Outputs come back to numpy through pinned
memory, or stay on the device as :class:`~lum.loader.cuda.arrays.DeviceArray`.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from typing import Any, Callable, Mapping

import numpy as np

from lum.format.dtypes import DType
from lum.format.errors import IncompatibleTargetError, LumError, PackageFormatError
from lum.format.expr import as_expr
from lum.format.llir import LOp
from lum.format.manifest import KERNEL_OP_KINDS
from lum.format.numerics import store_as
from lum.loader.cuda import driver as cu
from lum.loader.cuda.arrays import DeviceArray
from lum.loader.cuda.branches import BRANCH_SLACK, Schedule
from lum.loader.cuda.plan import EntryPlan, GemmSpec, Layout, build_entry_plan
from lum.loader.cuda.target import check_target
from lum.loader.cuda.upload import ALIGN, HostBytes, UploadStats, pack, upload
from lum.loader.errors import BackendUnavailableError, SessionError

__all__ = ["CudaRunner", "session_bounds", "stored_gemm_algos"]

WORKSPACE_BYTES = 32 << 20      # cuBLASLt's recommended workspace on Hopper
STEPS_PER_GRAPH = 8             # greedy decode steps a CUDA graph holds (lum.loader.cuda.chain)
GEMM_PLAN_CACHE = 4096


def _align(n: int, a: int = ALIGN) -> int:
    return (int(n) + a - 1) // a * a


def session_bounds(pkg: Any, dyn: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """Per entry, the largest dyn map the session must handle: ``dyn`` where given, else ``s`` =
    max_seq (prefill) and ``p`` = max_seq - 1 (decode). Other vars must be given."""
    max_seq = int(pkg.manifest.model.get("max_seq", 0) or 0)
    defaults = {"s": max_seq, "p": max_seq - 1} if max_seq > 0 else {}
    out: dict[str, dict[str, int]] = {}
    for name, e in pkg.manifest.entries.items():
        m = {}
        for v in e.dyn:
            if v in dyn:
                m[v] = int(dyn[v])
            elif v in defaults:
                m[v] = defaults[v]
            else:
                raise SessionError(f"entry {name!r} has dyn var {v!r} with no default bound; open the session "
                                   f"with dyn={{{v!r}: <max>}}")
            if m[v] < 0:
                raise SessionError(f"dyn bound {v}={m[v]} is negative")
        out[name] = m
    return out


def _constant_bytes(op: LOp, dyn: Mapping[str, int]) -> bytes:
    """A constant's storage bytes, exactly as the reference backend builds it."""
    shape = tuple(as_expr(d).evaluate(dyn) for d in op.shape)
    if "data" in op.params:
        data = np.asarray(op.params["data"], dtype=op.dtype.compute_np)
        if data.ndim != 1 or data.size != int(np.prod(shape, dtype=np.int64)):
            raise PackageFormatError(f"constant op {op.id}: data of {data.size} values for shape {shape}")
        arr = data.reshape(shape)
    elif "value" in op.params:
        arr = np.full(shape, op.params["value"], dtype=op.dtype.compute_np)
    else:
        raise PackageFormatError(f"constant op {op.id} needs a 'value' or 'data' parameter")
    return np.ascontiguousarray(store_as(arr, op.dtype)).tobytes()


class _Slot:
    """A pinned staging buffer and the event recorded after the copies that read it."""

    def __init__(self, nbytes: int):
        self.buf = cu.PinnedBuffer(nbytes)
        self.event = cu.Event()

    def close(self) -> None:
        self.event.close()
        self.buf.close()


class CudaRunner:
    """See the module docstring. ``bounds``: :func:`session_bounds` of the session's dyn."""

    name = "cuda"

    def __init__(self, pkg: Any, dyn: Mapping[str, int], *, device: int = 0, graphs: bool = True,
                 graph_cache: int = 1024, upload_method: str = "staged", allow_ptx: bool = True,
                 workspace_bytes: int = WORKSPACE_BYTES, debug_sync: bool | None = None,
                 graph_branches: bool | None = None, programmatic_launch: bool | None = None,
                 steps_per_graph: int | None = None):
        self.pkg = pkg
        self._closers: list[Callable[[], None]] = []
        self.closed = False
        if debug_sync is None:
            debug_sync = os.environ.get("LUM_CUDA_DEBUG_SYNC", "") not in ("", "0")
        self.debug_sync = bool(debug_sync)
        self.graphs = bool(graphs) and not self.debug_sync
        self.graph_error: str | None = None
        self.graph_cache_size = max(1, int(graph_cache))
        if graph_branches is None:
            graph_branches = os.environ.get("LUM_CUDA_BRANCHES", "1") != "0"
        self.graph_branches = bool(graph_branches)
        self.captures = 0
        self.bounds = session_bounds(pkg, dyn)
        m = pkg.manifest
        used = sorted({c.group for e in m.entries.values() for c in e.calls})
        self._check_kernels(used)
        self.device = cu.device_info(device)
        if programmatic_launch is None:
            programmatic_launch = os.environ.get("LUM_CUDA_PDL", "1") != "0"
        self.programmatic = bool(programmatic_launch) and self.device.cc >= (9, 0)
        if steps_per_graph is None:
            raw = os.environ.get("LUM_CUDA_STEPS_PER_GRAPH", str(STEPS_PER_GRAPH))
            if not raw.isdigit() or int(raw) < 1:
                raise SessionError(f"LUM_CUDA_STEPS_PER_GRAPH must be a positive integer, got {raw!r}")
            steps_per_graph = int(raw)
        self.steps_per_graph = max(1, int(steps_per_graph))
        has_ptx = all(m.groups[g].table is None or not m.groups[g].table.ops or m.groups[g].table.ptx for g in used)
        compat = check_target(str(m.target.get("sm", "")), m.target.get("nvrtc"), self.device.cc,
                              self.device.driver_version, has_ptx, self.device.name, allow_ptx)
        if not compat.ok:
            raise IncompatibleTargetError(compat.reason, path=pkg.path)
        self.reason = compat.reason
        self.use_ptx = compat.use_ptx
        try:
            self.ctx = self._own(cu.Context(self.device.ordinal))   # cuBLASLt runs on the current context
            self.lt = self._load_cublaslt(used)
            self._setup(used, upload_method, workspace_bytes)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ setup
    def _check_kernels(self, used: list[int]) -> None:
        m = self.pkg.manifest
        missing = [g for g in used if m.groups[g].table is None
                   and any(o.kind in KERNEL_OP_KINDS for o in self.pkg.programs[g].ops)]
        if missing:
            raise BackendUnavailableError(f"the package has no compiled kernels for group(s) {missing} (built "
                                          "without kernels); rebuild it, or use the reference backend")
        limits: dict[str, int] = {}
        for g in used:
            t = m.groups[g].table
            for v, b in (t.max_dyn.items() if t is not None else ()):
                limits[v] = min(b, limits.get(v, b))
        for entry, bounds in self.bounds.items():
            for v, b in bounds.items():
                if v in limits and b > limits[v]:
                    raise SessionError(f"dyn bound {v}={b} (entry {entry!r}) exceeds {limits[v]}, the largest value "
                                       "the package's kernels were compiled for")
        self.kernel_limits = limits

    def _load_cublaslt(self, used: list[int]) -> Any:
        """cuBLASLt, when a gemm of the used groups is a library call (no kernel in its launch table)."""
        m = self.pkg.manifest
        kernels = {g: (m.groups[g].table.by_op() if m.groups[g].table is not None else {}) for g in used}
        if not any(o.kind == "gemm" and o.id not in kernels[g] for g in used for o in self.pkg.programs[g].ops):
            return None
        try:
            from lum.loader.cublaslt import CublasLt, CublasLtUnavailable
        except ImportError as exc:
            raise BackendUnavailableError(f"the package has gemms but lum.loader.cublaslt is unavailable: "
                                          f"{exc}") from None
        try:
            lt = CublasLt.load()
        except CublasLtUnavailable as exc:
            raise BackendUnavailableError(f"cuBLASLt is unavailable: {exc}") from None
        self._closers.append(lt.close)
        return lt

    def _own(self, obj: Any) -> Any:
        self._closers.append(obj.close)
        return obj

    def _setup(self, used: list[int], upload_method: str, workspace_bytes: int) -> None:
        pkg, m = self.pkg, self.pkg.manifest
        self.stream = self._own(cu.Stream())
        self._side: list[cu.Stream] = []     # streams a capture forks into (branches.py), made on first use
        self._events: list[cu.Event] = []    # their cross-stream dependencies, reused by every capture
        # modules
        self.modules: dict[int, cu.Module] = {}
        for g in used:
            t = m.groups[g].table
            if t is None or t.cubin is None:
                continue
            if self.use_ptx:
                image, what = pkg.reader.section_bytes(t.ptx) + b"\0", f"group {g} PTX ({t.ptx})"
            else:
                image, what = bytes(pkg.reader.section_view(t.cubin)), f"group {g} cubin ({t.cubin})"
            self.modules[g] = self._own(cu.Module(image, what))
            for kop in t.ops:                  # kernels whose shared memory passes the default: their opt-in
                for lc in kop.launches:
                    if lc.shared_mem:
                        self.modules[g].function(lc.kernel, lc.shared_mem)
        # weights
        wsizes = {n: int(np.prod(w.shape, dtype=np.int64)) * w.dtype.itemsize for n, w in m.weights.items()}
        wl = pack(wsizes)
        self.weights = self._own(cu.DeviceBuffer(wl.total, "weights"))
        self.weight_ptrs = {n: self.weights.ptr + wl.offsets[n] for n in wsizes}
        pieces = [(HostBytes(pkg.reader.section_view(w.section)[:wsizes[n]], pkg.path,
                             pkg.reader.section(w.section).offset), self.weight_ptrs[n])
                  for n, w in m.weights.items()]
        self.upload: UploadStats = upload(pieces, self.stream, upload_method, self.device.read_only_host_register)
        # constants
        union = {}
        for b in self.bounds.values():
            for v, x in b.items():
                union[v] = max(x, union.get(v, 0))
        blobs: dict[tuple[int, int], bytes] = {}
        for g in used:
            for op in pkg.programs[g].ops:
                if op.kind == "constant":
                    blobs[(g, op.id)] = _constant_bytes(op, union)
        unique = {b: i for i, b in enumerate(dict.fromkeys(blobs.values()))}
        cl = pack({str(i): len(b) for b, i in unique.items()})
        self.consts = self._own(cu.DeviceBuffer(cl.total, "constants"))
        host = np.zeros(max(cl.total, 1), dtype=np.uint8)
        for b, i in unique.items():
            host[cl.offsets[str(i)]:cl.offsets[str(i)] + len(b)] = np.frombuffer(b, dtype=np.uint8)
        if cl.total:
            cu.call(cu.drv.cuMemcpyHtoD, self.consts.ptr, host.ctypes.data, cl.total)
        self.const_ptrs = {k: self.consts.ptr + cl.offsets[str(unique[b])] for k, b in blobs.items()}
        self.const_bytes = {k: len(b) for k, b in blobs.items()}
        # state
        ssizes = {n: int(np.prod(t.concrete_shape({}), dtype=np.int64)) * t.dtype.itemsize for n, t in m.state.items()}
        sl = pack(ssizes)
        self.state_buf = self._own(cu.DeviceBuffer(sl.total, "KV-cache state"))
        self.state_ptrs = {n: self.state_buf.ptr + sl.offsets[n] for n in ssizes}
        self.state_sizes = ssizes
        cu.memset(self.state_buf.ptr, 0, sl.total, self.stream)
        # arena: the buffer plan at the bounds, then the entry inputs' slots
        slack = BRANCH_SLACK if self.graph_branches else 0     # fewer false dependencies between branches
        self.arena_plans = {e: pkg.plan(e, b, slack) for e, b in self.bounds.items()}
        io: dict[str, dict[str, tuple[int, int]]] = {}
        arena_size = 0
        for e, ap in self.arena_plans.items():
            pos = _align(ap.size)
            io[e] = {}
            for t in m.entries[e].inputs:
                n = int(np.prod(t.concrete_shape(self.bounds[e]), dtype=np.int64)) * t.dtype.itemsize
                io[e][t.name] = (pos, n)
                pos += _align(max(n, 1))
            arena_size = max(arena_size, pos)
        self.arena = self._own(cu.DeviceBuffer(arena_size, "arena"))
        # dyn slots: one int64 per var, per distinct slot order of the kernel tables
        orders = sorted({m.groups[g].table.dyn_vars for g in used if m.groups[g].table is not None})
        dl = pack({str(i): 8 * max(len(o), 1) for i, o in enumerate(orders)})
        self.dyn_buf = self._own(cu.DeviceBuffer(dl.total, "dyn values"))
        self.dyn_ptrs = {o: self.dyn_buf.ptr + dl.offsets[str(i)] for i, o in enumerate(orders)}
        cu.memset(self.dyn_buf.ptr, 0, dl.total, self.stream)
        self.workspace = self._own(cu.DeviceBuffer(workspace_bytes if self.lt is not None else 0, "cuBLASLt workspace"))
        self.gemm_algos = stored_gemm_algos(m, self.lt.version() if self.lt is not None else None, used)
        self.gemm_algo_counts = {"stored": 0, "heuristic": 0}   # library plans made, by whose algorithm
        # plans
        self.plans: dict[str, EntryPlan] = {}
        self.layouts: dict[str, Layout] = {}
        self._chains: dict[tuple[str, int], Any] = {}
        for e in m.entries:
            layout = Layout(self.arena.ptr, self.arena_plans[e].offsets, self.arena_plans[e].sizes,
                            self.weight_ptrs, wsizes, self.state_ptrs, ssizes,
                            {n: self.arena.ptr + off for n, (off, _) in io[e].items()},
                            {n: size for n, (_, size) in io[e].items()},
                            self.const_ptrs, self.const_bytes, self.dyn_ptrs)
            self.layouts[e] = layout
            self.plans[e] = build_entry_plan(pkg, e, layout, self._function, self.bounds[e], self.gemm_algos,
                                             self.programmatic)
        # pinned staging: two slots for dyn values + inputs, one for outputs
        stage = max((sum(_align(n) for _, n in io[e].values()) for e in io), default=0)
        self._dyn_stage = _align(8 * sum(max(len(o), 1) for o in orders))
        self._slots = [self._own(_Slot(self._dyn_stage + stage)) for _ in range(2)]
        self._slot = 0
        out_stage = max((sum(_align(o.capacity) for o in p.outputs) for p in self.plans.values()), default=0)
        self._out = self._own(cu.PinnedBuffer(out_stage))
        self._graphs: dict[str, OrderedDict] = {e: OrderedDict() for e in m.entries}
        self._gemm_plans: OrderedDict = OrderedDict()
        self.stream.synchronize()

    def _function(self, group: int, name: str) -> Any:
        return self.modules[group].function(name)

    # ------------------------------------------------------------------ resources
    @property
    def device_bytes(self) -> dict[str, int]:
        """Bytes of each device allocation the session owns."""
        return {"weights": self.weights.nbytes, "constants": self.consts.nbytes, "state": self.state_buf.nbytes,
                "arena": self.arena.nbytes, "dyn": self.dyn_buf.nbytes, "workspace": self.workspace.nbytes}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if hasattr(self, "ctx"):
                self.ctx.make_current()
                if hasattr(self, "stream"):       # not when the setup failed before it made one
                    self.stream.synchronize()
        except LumError:
            pass
        for cache in getattr(self, "_graphs", {}).values():
            for g in cache.values():
                g.close()
            cache.clear()
        if hasattr(self, "_gemm_plans"):
            self._gemm_plans.clear()
        errors = []
        for closer in reversed(self._closers):
            try:
                closer()
            except LumError as exc:
                errors.append(exc)
        self._closers.clear()
        if errors:
            raise errors[0]

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        self.ctx.make_current()
        cu.memset(self.state_buf.ptr, 0, self.state_buf.nbytes, self.stream)
        self.stream.synchronize()

    def fill_arena(self, byte: int = 0xFF) -> None:
        """Fill every intermediate and input slot with ``byte`` (0xFF: a NaN pattern in every float
        dtype), so a test sees any output a kernel failed to write."""
        self.ctx.make_current()
        cu.memset(self.arena.ptr, byte, self.arena.nbytes, self.stream)
        self.stream.synchronize()

    def load_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Overwrite state tensors with host arrays (tests; a saved KV cache)."""
        self.ctx.make_current()
        self.stream.synchronize()
        for n, arr in arrays.items():
            t = self.pkg.manifest.state[n]
            a = np.ascontiguousarray(arr, dtype=t.dtype.np)
            if a.nbytes != self.state_sizes[n]:
                raise SessionError(f"state {n!r} holds {self.state_sizes[n]} bytes, not {a.nbytes}")
            cu.call(cu.drv.cuMemcpyHtoD, self.state_ptrs[n], a.ctypes.data, a.nbytes)

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Host copies of the state tensors (a snapshot; writing to them changes nothing)."""
        self.ctx.make_current()
        out = {}
        for n, t in self.pkg.manifest.state.items():
            arr = np.empty(t.concrete_shape({}), dtype=t.dtype.np)
            self.stream.synchronize()
            cu.call(cu.drv.cuMemcpyDtoH, arr.ctypes.data, self.state_ptrs[n], self.state_sizes[n])
            out[n] = arr
        return out

    # ------------------------------------------------------------------ running
    def run(self, entry: str, inputs: Mapping[str, np.ndarray], dyn: Mapping[str, int]) -> dict[str, np.ndarray]:
        plan = self._launch(entry, inputs, dyn)
        pos = 0
        pending = []
        for o in plan.outputs:
            shape = tuple(as_expr(d).evaluate(dyn) for d in o.shape)
            n = int(np.prod(shape, dtype=np.int64)) * o.dtype.itemsize
            cu.memcpy_dtoh(self._out.ptr + pos, o.ptr, n, self.stream)
            pending.append((o, shape, pos, n))
            pos += _align(max(n, 1))
        self.stream.synchronize()
        return {o.name: self._out.array[p:p + n].view(o.dtype.np).reshape(shape).copy() for o, shape, p, n in pending}

    def run_device(self, entry: str, inputs: Mapping[str, np.ndarray],
                   dyn: Mapping[str, int]) -> dict[str, DeviceArray]:
        plan = self._launch(entry, inputs, dyn)
        out = {}
        for o in plan.outputs:
            shape = tuple(as_expr(d).evaluate(dyn) for d in o.shape)
            out[o.name] = DeviceArray(o.ptr, shape, o.dtype, self.device.ordinal, self.stream.ptr, self,
                                      self._synchronize, self._to_host)
        return out

    def step_chain(self, entry: str, count: int) -> Any:
        """``count`` steps of ``entry`` as one CUDA graph (:class:`~lum.loader.cuda.chain.StepChain`), made on
        first use; None where the entry cannot chain or graphs are off."""
        from lum.loader.cuda.chain import StepChain, chainable

        if not self.graphs or count < 2 or not chainable(self.plans[entry]):
            return None
        chain = self._chains.get((entry, count))
        if chain is None:
            chain = self._chains[(entry, count)] = self._own(StepChain(self, entry, count))
        return chain

    def collector(self, count: int, dtype: DType) -> "Collector":
        """Pinned room for ``count`` small device values, copied back in stream order without waiting
        (a greedy loop's tokens: see Session.generate)."""
        return Collector(self, count, dtype)

    def _synchronize(self) -> None:
        self.ctx.make_current()
        self.stream.synchronize()

    def _to_host(self, a: DeviceArray) -> np.ndarray:
        """Through the pinned output staging when it fits (a pageable copy is several times slower: the
        host loop of Session.generate copies a logits row every step), else straight to pageable memory."""
        if a.nbytes <= self._out.nbytes:
            cu.memcpy_dtoh(self._out.ptr, a.ptr, a.nbytes, self.stream)
            self._synchronize()
            return self._out.array[:a.nbytes].view(a.dtype.np).reshape(a.shape).copy()
        self._synchronize()
        arr = np.empty(a.shape, dtype=a.dtype.np)
        cu.call(cu.drv.cuMemcpyDtoH, arr.ctypes.data, a.ptr, a.nbytes)
        return arr

    def _launch(self, entry: str, inputs: Mapping[str, np.ndarray], dyn: Mapping[str, int]) -> EntryPlan:
        self._begin(entry, dyn)
        plan = self.plans[entry]
        plan.check(dyn)
        self._stage_inputs(plan, inputs, dyn)
        key = plan.values(dyn)
        for seg in plan.segments:
            if self.graphs:
                try:
                    graph = self._graph(plan, seg, key)
                except cu.CudaError as exc:   # e.g. a library call that refuses stream capture
                    self.graphs = False
                    self.graph_error = str(exc)
                    warnings.warn(f"lum: CUDA graph capture failed ({exc}); running eagerly from now on",
                                  stacklevel=3)
                else:
                    graph.launch(self.stream)
                    continue
            self._enqueue(plan.concrete(key, self._gemm_plan, seg.steps), self.stream)
        return plan

    def _begin(self, entry: str, dyn: Mapping[str, int]) -> None:
        """Before a run of ``entry`` at ``dyn`` (a step chain: at its last step's): the session is open, its
        context current, ``dyn`` within the session's bounds."""
        if self.closed:
            raise SessionError("the session is closed")
        self.ctx.make_current()
        for v, b in self.bounds[entry].items():
            if dyn[v] > b:
                raise SessionError(f"dyn {v}={dyn[v]} exceeds this session's bound {b}; open the session with "
                                   f"dyn={{{v!r}: {dyn[v]}}} or more")

    def _stage_inputs(self, plan: EntryPlan, inputs: Mapping[str, np.ndarray], dyn: Mapping[str, int]) -> None:
        slot = self._slots[self._slot]
        self._slot = (self._slot + 1) % len(self._slots)
        slot.event.synchronize()                 # the copies that last read this slot are done
        pos = 0
        for order, ptr in self.dyn_ptrs.items():
            vals = slot.buf.view(np.int64, len(order), pos)
            vals[:] = [int(dyn.get(v, 0)) for v in order]
            cu.memcpy_htod(ptr, slot.buf.ptr + pos, 8 * len(order), self.stream)
            pos += 8 * max(len(order), 1)
        pos = self._dyn_stage
        for ref in plan.inputs:
            value = inputs[ref.name]
            if isinstance(value, DeviceArray):       # already on the device (a previous run's output)
                if value.dtype != ref.dtype or value.nbytes > ref.capacity:
                    raise SessionError(f"device input {ref.name!r} is {value.dtype} of {value.nbytes} bytes; the "
                                       f"entry takes {ref.dtype} in at most {ref.capacity}")
                if value.ptr != ref.ptr:        # else the last run wrote it there (plan.FEEDBACK)
                    cu.memcpy_dtod(ref.ptr, value.ptr, value.nbytes, self.stream)
                continue
            arr = np.ascontiguousarray(value, dtype=ref.dtype.np)
            n = arr.nbytes
            if n > ref.capacity:
                raise SessionError(f"input {ref.name!r} of {n} bytes exceeds its slot ({ref.capacity})")
            slot.buf.array[pos:pos + n] = arr.reshape(-1).view(np.uint8)
            cu.memcpy_htod(ref.ptr, slot.buf.ptr + pos, n, self.stream)
            pos += _align(max(n, 1))
        slot.event.record(self.stream)

    def _graph(self, plan: EntryPlan, seg: Any, key: tuple) -> cu.Graph:
        g, captured = self._cached_graph(self._graphs[plan.entry], seg.key(key), [(plan, seg, key)])
        self.captures += captured
        return g

    def _cached_graph(self, cache: OrderedDict, gkey: tuple, parts: list[tuple[EntryPlan, Any, tuple]]
                      ) -> tuple[cu.Graph, bool]:
        """(the graph of ``cache[gkey]``, whether it was captured now): on a miss, one capture of each
        ``(plan, segment, values)`` of ``parts`` in turn (a step chain's are its steps), the least recently
        used graph past ``graph_cache`` closed."""
        g = cache.get(gkey)
        if g is not None:
            cache.move_to_end(gkey)
            return g, False
        concrete = []                           # library plans: before the capture
        for plan, seg, key in parts:
            owners: list[int] = []
            concrete.append((plan.concrete(key, self._gemm_plan, seg.steps, owners), owners, seg.schedule))

        def enqueue(s: cu.Stream) -> None:
            for ops, owners, sched in concrete:
                if self.graph_branches and sched is not None and sched.streams > 1:
                    self._enqueue_branches(ops, owners, sched, s)
                else:
                    self._enqueue(ops, s)

        g = cache[gkey] = cu.Graph(self.stream, enqueue)
        while len(cache) > self.graph_cache_size:
            _, old = cache.popitem(last=False)
            old.close()
        return g, True

    def _gemm_plan(self, spec: GemmSpec) -> Any:
        p = self._gemm_plans.get(spec)
        if p is None:
            p = self.lt.matmul_plan(spec.layout, spec.m, spec.n, spec.k, spec.lda, spec.ldb, spec.ldc, spec.batch,
                                    spec.stride_a, spec.stride_b, spec.stride_c, spec.dtype, spec.algo,
                                    offset_a=spec.offset_a, offset_b=spec.offset_b,
                                    workspace_limit=self.workspace.nbytes, in_dtype=spec.in_dtype)
            self._gemm_plans[spec] = p
            self.gemm_algo_counts["stored" if p.algo_source == "given" else "heuristic"] += 1
            while len(self._gemm_plans) > GEMM_PLAN_CACHE:
                self._gemm_plans.popitem(last=False)
        else:
            self._gemm_plans.move_to_end(spec)
        return p

    def _enqueue_branches(self, ops: list[tuple], owners: list[int], sched: Schedule, stream: cu.Stream) -> None:
        """Capture ``ops`` from several streams as ``sched`` places their steps: a step first waits for
        the events of the steps it depends on in other streams, its ops go on its stream, and an event
        is recorded after it when someone waits for it; stream 0 is ``stream`` (the capturing one),
        which waits for every side stream at the end, so the graph joins back into it."""
        while len(self._side) < sched.streams - 1:
            self._side.append(self._own(cu.Stream()))
        while len(self._events) < len(sched.signals):
            self._events.append(self._own(cu.Event()))
        streams = [stream] + self._side[:sched.streams - 1]
        events = dict(zip(sorted(sched.signals), self._events))
        by_step: dict[int, list[tuple]] = {}
        for op, j in zip(ops, owners):
            by_step.setdefault(j, []).append(op)
        for j, place in enumerate(sched.placements):
            s = streams[place.stream]
            for w in place.waits:
                cu.stream_wait(s, events[w])
            self._enqueue(by_step.get(j, []), s)
            if j in events:
                events[j].record(s)
        for t in sched.tails:
            cu.stream_wait(stream, events[t])

    def _enqueue(self, ops: list[tuple], stream: cu.Stream) -> None:
        ws, wsn = self.workspace.ptr, self.workspace.nbytes
        for op in ops:
            kind = op[0]
            try:
                if kind == "kernel":
                    cu.launch_kernel(op[1], op[2], op[3], op[4], stream, op[5], op[6], op[7])
                elif kind == "gemm":
                    op[1].run(stream.ptr, op[2], op[3], op[4], ws, wsn)
                elif kind == "copy":
                    cu.memcpy_dtod(op[1], op[2], op[3], stream)
                elif kind == "memset":
                    cu.memset(op[1], 0, op[2], stream)
                else:  # pragma: no cover - plan.concrete makes only these
                    raise AssertionError(kind)
                if self.debug_sync:
                    stream.synchronize()
            except cu.CudaError as exc:
                raise cu.CudaError(exc.func, exc.code, exc.name, f"{op[-1]}") from None


class Collector:
    """Values copied device → pinned host memory asynchronously, one :meth:`push` at a time; :meth:`read`
    synchronises and returns those pushed so far."""

    def __init__(self, runner: CudaRunner, count: int, dtype: DType):
        self.runner, self.dtype, self.count = runner, dtype, int(count)
        self.buf = cu.PinnedBuffer(max(1, self.count) * dtype.itemsize)
        self.n = 0

    def push(self, a: DeviceArray) -> None:
        """Copy ``a``'s values (one, or a chain's tokens) after those pushed before."""
        n = a.nbytes // self.dtype.itemsize
        if a.dtype != self.dtype or n < 1 or len(a.shape) > 1 or self.n + n > self.count:
            raise SessionError(f"collector holds {self.count} scalars of {self.dtype}, {self.n} pushed; got "
                               f"{a.dtype} {a.shape}")
        cu.memcpy_dtoh(self.buf.ptr + self.n * self.dtype.itemsize, a.ptr, a.nbytes, self.runner.stream)
        self.n += n

    def read(self) -> np.ndarray:
        self.runner._synchronize()
        return self.buf.view(self.dtype.np, self.n).copy()

    def close(self) -> None:
        """Free the pinned memory once no copy into it is in flight (also after a failed push or run)."""
        try:
            self.runner._synchronize()
        finally:
            self.buf.close()


def stored_gemm_algos(manifest: Any, lt_version: int | None, groups: Any = None) -> dict[tuple[int, int], bytes]:
    """(group, op id) -> the cuBLASLt algorithm the build chose, when the package's
    ``target.cublaslt_version`` is ``lt_version`` (the loaded library's); else empty: the heuristic chooses.
    Stored algorithms are passed non-strictly (cublasLtMatmulAlgoCheck falls back to the heuristic)."""
    if lt_version is None or manifest.target.get("cublaslt_version") != lt_version:
        return {}
    out: dict[tuple[int, int], bytes] = {}
    for g, ref in enumerate(manifest.groups):
        if ref.table is not None and (groups is None or g in groups):
            for ga in ref.table.gemms:
                out[(g, ga.op)] = ga.algo
    return out
