"""Execution plans: an entry point flattened into device steps with every pointer fixed, cut into
segments, and the bucket keys that say whether a captured CUDA graph can be replayed for a new dyn map.

Pure Python (no driver calls): the runner hands in the session's addresses and a function lookup,
so everything here is unit-tested on the CPU.

**Pointers.** A session allocates everything once, for its largest dyn map, so every buffer has one
device address for the session's lifetime: an intermediate at ``arena + offset`` (from
:meth:`Package.plan` at the max dyn map), a weight, a state tensor, an entry input's staging slot,
a constant. An entry's ``next_token`` output is written into its own ``tokens`` input's slot
(:data:`FEEDBACK`), so a greedy loop feeds each step's token to the next without a copy. An in-place
op (``alias = j``, always for ``scatter_nocopy``) writes at the address of ``args[j]``'s buffer, so a
KV-cache write lands in the state allocation itself. A group output that
is a state value and is not already there is copied into the state at the end of its call (as the
reference backend updates state after a call). Kernel parameters are therefore constant per step
and are packed once (:class:`ParamPack`).

**Segments and keys.** What a captured graph bakes in is launch grids, library-call problems (m, n,
k, leading dims, strides, offsets) and copy sizes. Kernels read shapes from the device dyn buffer
and loop grid-stride (correct for any grid ≥ 1), so a grid need not be exact: it is *bucketed* up
to the next power of two (capped at its value for the session's max dyn map). Library calls and
copies whose sizes depend on dyn values (prefill's ``m = s``) are *volatile*: their exact values
join the key. An entry is one :class:`Segment`, captured as one CUDA graph per key — so a decode
step, whose GEMMs with a small static m are lum's own kernels reading ``p`` from the dyn buffer,
replays the same graph as ``p`` grows and re-captures only when a grid crosses a bucket, and a
prefill replays for a prompt length it has seen. Per run, the entry's distinct expressions are
evaluated once (tens, not thousands, of evaluations).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from lum.format.dtypes import DType
from lum.format.errors import PackageFormatError
from lum.format.expr import Expr, as_expr
from lum.format.llir import GEMM_DEFAULTS, LOp, gemm_parts
from lum.format.shapetracker import ShapeTracker
from lum.loader.cuda.branches import EVERYTHING, Schedule
from lum.loader.cuda.branches import schedule as branch_schedule
from lum.loader.errors import BackendUnavailableError, SessionError

__all__ = ["ParamPack", "Layout", "GemmSpec", "KernelStep", "GemmStep", "CopyStep", "Segment", "EntryPlan", "bucket",
           "build_entry_plan", "is_flat_prefix"]

GEMM_EXPRS = ("m", "n", "k", "lda", "ldb", "batch", "stride_a", "stride_b", "offset_a", "offset_b")


class ParamPack:
    """A kernel's pointer parameters packed once for ``cuLaunchKernel``: ``void* args[n]``, each
    pointing at its ``uint64`` value. ``address`` is what ``kernelParams`` takes; the ctypes arrays
    live as long as this object (the step that owns it)."""

    def __init__(self, values: Sequence[int]):
        self.values = tuple(int(v) for v in values)
        n = len(self.values)
        self._values = (ctypes.c_uint64 * n)(*self.values)
        base = ctypes.addressof(self._values)
        self._ptrs = (ctypes.c_void_p * n)(*(base + 8 * i for i in range(n)))
        self.address = ctypes.addressof(self._ptrs)

    def read_back(self) -> tuple[int, ...]:
        """The values as the driver will read them (through the pointer array); for tests."""
        ptrs = (ctypes.c_void_p * len(self.values)).from_address(self.address)
        return tuple(ctypes.c_uint64.from_address(p).value for p in ptrs)


def bucket(grid: int, cap: int) -> int:
    """The grid actually launched: ``grid`` rounded up to a power of two, but never above
    ``max(grid, cap)`` (``cap``: the grid at the session's max dyn map)."""
    if grid <= 1:
        return 1
    p = 1 << (grid - 1).bit_length()
    return min(p, max(grid, cap))


FEEDBACK = ("next_token", "tokens")   # an entry output written into the entry input a greedy loop feeds it to


@dataclass
class Layout:
    """Device addresses of everything a session allocated (see the module docstring)."""

    arena: int
    offsets: Mapping[str, int]                 # Package.plan names -> offset in the arena
    sizes: Mapping[str, int]                   # Package.plan names -> bytes at the max dyn map
    weights: Mapping[str, int]
    weight_bytes: Mapping[str, int]
    state: Mapping[str, int]
    state_bytes: Mapping[str, int]
    inputs: Mapping[str, int]                  # this entry's inputs -> staging slot
    input_bytes: Mapping[str, int]
    constants: Mapping[tuple[int, int], int]   # (group, op id) -> address
    constant_bytes: Mapping[tuple[int, int], int]
    dyn: Mapping[tuple[str, ...], int]         # slot order -> device address of its int64 slots


@dataclass(frozen=True)
class GemmSpec:
    """One cuBLASLt problem, concrete (the plan-cache key)."""

    layout: str
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    batch: int
    stride_a: int
    stride_b: int
    stride_c: int
    dtype: DType               # C's; A's and B's is ``in_dtype`` (a 16-bit one under an f32 C: mixed precision)
    offset_a: int = 0          # elements; the library plan adds them to the operands' base pointers
    offset_b: int = 0
    algo: bytes | None = None  # the package's build-time cuBLASLt algorithm (None: the heuristic's)
    in_dtype: DType | None = None   # None: ``dtype``


@dataclass
class KernelStep:
    where: str
    function: Any
    grid: tuple[int, int, int]                 # indices into EntryPlan.grid_exprs
    block: tuple[int, int, int]
    shared_mem: int
    params: ParamPack
    reads: tuple[tuple[int, int], ...] = ()    # [lo, hi) device bytes of its arguments' buffers
    writes: tuple[tuple[int, int], ...] = ()   # ... and of its output's (branches.schedule)
    programmatic: bool = False                 # launched with programmatic stream serialization (it waits itself)
    cluster: int = 1                           # blocks a thread block cluster along x


@dataclass
class GemmStep:
    where: str
    layout: str
    dtype: DType
    exprs: dict[str, int]                      # GEMM_EXPRS name -> index into EntryPlan.exact_exprs
    ldc: int | None                            # index of the ldc expression, when given
    stride_c: int | None
    numel: int                                 # index of numel(op.shape)
    a: int
    b: int
    c: int
    a_cap: int                                 # elements the operand's buffer holds
    b_cap: int
    c_cap: int
    algo: bytes | None = None                  # stored cuBLASLt algorithm (see build_entry_plan)
    in_dtype: DType | None = None              # A's and B's dtype when it is not C's (mixed precision)


@dataclass
class CopyStep:
    where: str
    dst: int
    src: int
    nbytes: int                                # index into EntryPlan.exact_exprs


@dataclass(frozen=True)
class ValueRef:
    ptr: int
    dtype: DType
    capacity: int                              # bytes of its allocation
    shape: tuple[Expr, ...] | None = None


@dataclass(frozen=True)
class IORef:
    name: str
    ptr: int
    shape: tuple[Expr, ...]
    dtype: DType
    capacity: int


@dataclass
class Segment:
    """Steps launched together, captured as one CUDA graph per key: the bucketed grids of its
    kernels (``grid_ids`` index ``EntryPlan.grid_exprs``) and the exact values its volatile steps'
    sizes depend on (``exact_ids`` index ``EntryPlan.exact_exprs``)."""

    index: int
    steps: list[Any]
    grid_ids: tuple[int, ...]
    exact_ids: tuple[int, ...] = ()
    schedule: Schedule | None = None           # the streams its steps are captured from (branches.py)

    def key(self, values: tuple[Sequence[int], Sequence[int]]) -> tuple:
        """``values``: :meth:`EntryPlan.values` of the run's dyn map."""
        exact, grids = values
        return self.index, tuple(grids[i] for i in self.grid_ids), tuple(exact[i] for i in self.exact_ids)


@dataclass
class EntryPlan:
    entry: str
    steps: list[Any] = field(default_factory=list)
    exact_exprs: list[Expr] = field(default_factory=list)
    grid_exprs: list[Expr] = field(default_factory=list)
    grid_caps: list[int] = field(default_factory=list)
    size_checks: list[tuple[Expr, int, str]] = field(default_factory=list)   # (bytes, capacity, buffer)
    inputs: list[IORef] = field(default_factory=list)
    outputs: list[IORef] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    _exact: dict[Expr, int] = field(default_factory=dict, repr=False)
    _grid: dict[Expr, int] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ building
    def exact(self, e: Any) -> int:
        e = as_expr(e)
        i = self._exact.get(e)
        if i is None:
            i = self._exact[e] = len(self.exact_exprs)
            self.exact_exprs.append(e)
        return i

    def grid(self, e: Expr, max_dyn: Mapping[str, int]) -> int:
        e = as_expr(e)
        i = self._grid.get(e)
        if i is None:
            i = self._grid[e] = len(self.grid_exprs)
            self.grid_exprs.append(e)
            self.grid_caps.append(e.evaluate(max_dyn))
        return i

    # ------------------------------------------------------------------ per run
    def check(self, dyn: Mapping[str, int]) -> None:
        """Every buffer fits the allocation planned at the session's max dyn map."""
        for size, cap, name in self.size_checks:
            got = size.evaluate(dyn)
            if got > cap:
                raise SessionError(f"entry {self.entry!r}: buffer {name} needs {got} bytes for dyn {dict(dyn)}, "
                                   f"more than the {cap} planned for the session's bounds; open the session "
                                   f"with larger dyn bounds")

    def values(self, dyn: Mapping[str, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The exact values and the bucketed grids of the entry's distinct expressions under ``dyn``."""
        exact = tuple(e.evaluate(dyn) for e in self.exact_exprs)
        grids = tuple(bucket(e.evaluate(dyn), cap) for e, cap in zip(self.grid_exprs, self.grid_caps))
        return exact, grids

    def finish(self) -> None:
        """Make the entry's segment (see :class:`Segment`); called once the steps are complete."""
        grid_ids = sorted({i for st in self.steps if isinstance(st, KernelStep) for i in st.grid})
        exact_ids = sorted({i for st in self.steps for i in self.volatile_exprs(st)})
        if not self.steps:
            self.segments = []
            return
        reads = [st.reads if isinstance(st, KernelStep) else EVERYTHING for st in self.steps]
        writes = [st.writes if isinstance(st, KernelStep) else EVERYTHING for st in self.steps]
        self.segments = [Segment(0, list(self.steps), tuple(grid_ids), tuple(exact_ids),
                                 branch_schedule(reads, writes))]

    def volatile_exprs(self, st: Any) -> list[int]:
        """The dyn-dependent expressions (indices into ``exact_exprs``) that a captured graph bakes
        into a library call or copy: a graph holding the step is only valid for their values."""
        if isinstance(st, GemmStep):
            idx = list(st.exprs.values()) + [i for i in (st.ldc, st.stride_c, st.numel) if i is not None]
        elif isinstance(st, CopyStep):
            idx = [st.nbytes]
        else:
            return []
        return [i for i in idx if self.exact_exprs[i].vars()]

    def volatile(self, st: Any) -> bool:
        """A library call or copy whose sizes depend on dyn values (its graph is keyed by them)."""
        return bool(self.volatile_exprs(st))

    def concrete(self, key: tuple, gemm_plan: Callable[[GemmSpec], Any], steps: Sequence[Any] | None = None,
                 owners: list[int] | None = None) -> list[tuple]:
        """The device operations for ``key``: ``("kernel", function, grid, block, shared_mem, params,
        programmatic, cluster)``,
        ``("gemm", plan, a, b, c)`` (a, b: the operands' buffer bases; the plan adds the offsets),
        ``("memset", ptr, nbytes)``, ``("copy", dst, src, nbytes)``, each
        with the step's description appended (for errors). ``gemm_plan`` makes (or fetches) the
        library plan of a :class:`GemmSpec`; call this outside stream capture. ``owners``, when given,
        receives the index (in ``steps``) of the step each op comes from."""
        exact, grids = key
        ops: list[tuple] = []
        for j, st in enumerate(self.steps if steps is None else steps):
            if isinstance(st, KernelStep):
                g = tuple(grids[i] for i in st.grid)
                if g[0] % st.cluster:
                    raise BackendUnavailableError(f"{st.where}: grid {g[0]} is not a multiple of its clusters of "
                                                  f"{st.cluster} blocks")
                ops.append(("kernel", st.function, g, st.block, st.shared_mem, st.params.address, st.programmatic,
                            st.cluster,
                            st.where))
            elif isinstance(st, GemmStep):
                ops.extend(_gemm_ops(st, exact, gemm_plan))
            else:
                n = exact[st.nbytes]
                if n:
                    ops.append(("copy", st.dst, st.src, n, st.where))
            if owners is not None:
                owners.extend([j] * (len(ops) - len(owners)))
        return ops


def _gemm_ops(st: GemmStep, exact: Sequence[int], gemm_plan: Callable[[GemmSpec], Any]) -> list[tuple]:
    v = {name: exact[i] for name, i in st.exprs.items()}
    m, n, k, lda, ldb, batch = v["m"], v["n"], v["k"], v["lda"], v["ldb"], v["batch"]
    sa, sb, oa, ob = v["stride_a"], v["stride_b"], v["offset_a"], v["offset_b"]

    def fail(msg: str) -> SessionError:
        return SessionError(f"{st.where}: {msg}")

    if min(m, n, k, batch) < 0 or min(sa, sb, oa, ob) < 0 or min(lda, ldb) < 1:
        raise fail(f"gemm sizes must be non-negative and lda/ldb positive: m={m} n={n} k={k} batch={batch} "
                   f"lda={lda} ldb={ldb} stride_a={sa} stride_b={sb} offset_a={oa} offset_b={ob}")
    if st.ldc is not None and exact[st.ldc] != n:
        raise fail(f"gemm ldc must equal n ({n}): C is row-major [batch, m, n]")
    if st.stride_c is not None and batch > 1 and exact[st.stride_c] != m * n:
        raise fail(f"gemm stride_c must equal m*n ({m * n})")
    if exact[st.numel] != batch * m * n:
        raise fail(f"gemm output holds {exact[st.numel]} elements, not batch*m*n = {batch * m * n}")
    if batch * m * n == 0:
        return []
    if batch * m * n > st.c_cap:
        raise fail(f"gemm output of {batch * m * n} elements exceeds its buffer ({st.c_cap})")
    if k == 0:
        return [("memset", st.c, batch * m * n * st.dtype.itemsize, st.where)]
    a_rm, b_rm = st.layout[:2] == "Rm", st.layout[2:] == "Rm"
    for name, rows, cols, ld, bstride, off, cap, rm in (("A", m, k, lda, sa, oa, st.a_cap, a_rm),
                                                         ("B", k, n, ldb, sb, ob, st.b_cap, b_rm)):
        s0, s1 = (ld, 1) if rm else (1, ld)
        nb = batch if bstride else 1
        last = off + (nb - 1) * bstride + (rows - 1) * s0 + (cols - 1) * s1
        if last >= cap:
            raise fail(f"gemm operand {name} reads elements {off}..{last} of a buffer of {cap}")
    spec = GemmSpec(st.layout, m, n, k, lda, ldb, n, batch, sa, sb, m * n, st.dtype, oa, ob, st.algo, st.in_dtype)
    try:
        lib_plan = gemm_plan(spec)
    except SessionError:
        raise
    except Exception as exc:  # noqa: BLE001 - the library's own error, with the op it belongs to
        raise fail(f"cuBLASLt has no plan for {spec}: {' '.join(str(exc).split())[:300]}") from None
    return [("gemm", lib_plan, st.a, st.b, st.c, st.where)]


def is_flat_prefix(view: ShapeTracker) -> bool:
    """The view reads its producer's buffer as a plain row-major prefix (no mask, offset 0, the
    contiguous strides on every non-unit dim): the value can share the buffer without a copy."""
    if view.mask is not None and any(not (lo == as_expr(0) and hi == d) for (lo, hi), d in zip(view.mask, view.shape)):
        return False
    if view.offset != as_expr(0):
        return False
    want = ShapeTracker.contiguous(view.shape).strides
    return all(d == as_expr(1) or s == w for d, s, w in zip(view.shape, view.strides, want))


def _numel(shape: Sequence[Expr]) -> Expr:
    out = as_expr(1)
    for d in shape:
        out = out * d
    return out


def _describe(entry: str, c: int, group: int, op: LOp) -> str:
    kind = f"{op.kind} {op.op}" if op.op else op.kind
    return f"entry {entry!r} call {c} (group {group}) op {op.id} ({kind})"


def build_entry_plan(pkg: Any, entry_name: str, layout: Layout, function: Callable[[int, str], Any],
                     max_dyn: Mapping[str, int], gemm_algos: Mapping[tuple[int, int], bytes] | None = None,
                     programmatic: bool = False, feedback_to: int | None = None) -> EntryPlan:
    """Flatten ``entry_name`` of ``pkg`` (a :class:`lum.loader.model.Package`) into device steps.

    ``function(group, kernel_name)`` returns the loaded kernel handle. Raises
    :class:`BackendUnavailableError` for LLIR this backend cannot run (a dtype-converting or strided
    group output, a dtype mismatch at a call boundary, a group without compiled kernels). A gemm op with
    an entry in its group's launch table (lum's gemv kernel, small static m) becomes a kernel step like
    any other; one without is a library call (:class:`GemmStep`). ``gemm_algos``: (group, op id) -> the
    package's stored cuBLASLt algorithm, carried by the gemm's steps (the runner passes them only for the
    same cuBLASLt version).
    ``programmatic``: kernels of tables marked programmatic launch with programmatic stream serialization
    where every buffer they read before their wait (``early``) is a weight (see lum.format.manifest).
    ``feedback_to``: where the :data:`FEEDBACK` output goes (a chained step's next step's input,
    lum.loader.cuda.chain), else its own input's slot."""
    e = pkg.entry(entry_name)
    m = pkg.manifest
    plan = EntryPlan(entry_name)
    values: dict[str, ValueRef] = {}
    for name, w in m.weights.items():
        values[name] = ValueRef(layout.weights[name], w.dtype, layout.weight_bytes[name])
    for name, t in m.state.items():
        values[name] = ValueRef(layout.state[name], t.dtype, layout.state_bytes[name])
    for t in e.inputs:
        cap = layout.input_bytes[t.name]
        values[t.name] = ValueRef(layout.inputs[t.name], t.dtype, cap, t.shape)
        plan.inputs.append(IORef(t.name, layout.inputs[t.name], t.shape, t.dtype, cap))
        plan.size_checks.append((_numel(t.shape) * t.dtype.itemsize, cap, f"input {t.name!r}"))
    for b in pkg.buffers(entry_name):
        plan.size_checks.append((b.size, layout.sizes[b.name], b.name))
    readonly = set(layout.weights.values())
    feedback = _feedback_producer(pkg, e)

    for c, call in enumerate(e.calls):
        prog = pkg.programs[call.group]
        ref = m.groups[call.group]
        table = ref.table
        kops = table.by_op() if table is not None else {}
        dyn_ptr = layout.dyn[table.dyn_vars] if table is not None else 0
        pdl = programmatic and table is not None and table.programmatic
        ptr: dict[int, int] = {}
        cap: dict[int, int] = {}
        dtypes: dict[int, DType] = {}
        state_copies: list[CopyStep] = []
        head: _Launch | None = None          # a kernel op with tails, awaiting its tails' buffers
        for op, vname in zip(prog.inputs(), call.inputs):
            v = values[vname]
            if v.dtype != op.dtype:
                raise BackendUnavailableError(
                    f"{_describe(entry_name, c, call.group, op)}: input {op.params.get('name')!r} is {op.dtype} but "
                    f"value {vname!r} is {v.dtype}; the CUDA backend does not convert at call boundaries")
            ptr[op.id], cap[op.id], dtypes[op.id] = v.ptr, v.capacity, v.dtype
        out_values = {o.id: v for o, v in zip(prog.outputs(), call.outputs)}
        for op in prog.ops:
            where = _describe(entry_name, c, call.group, op)
            if op.kind == "input":
                continue
            if op.kind == "constant":
                key = (call.group, op.id)
                ptr[op.id], cap[op.id], dtypes[op.id] = layout.constants[key], layout.constant_bytes[key], op.dtype
                continue
            if op.kind == "output":
                src = op.args[0].src
                if dtypes[src] != op.dtype or not is_flat_prefix(op.args[0].view):
                    raise BackendUnavailableError(f"{where}: a group output that converts or restrides its value "
                                                  "is not supported by the CUDA backend")
                vname = out_values[op.id]
                if vname in m.state:
                    if ptr[src] != layout.state[vname]:
                        nbytes = _numel(op.shape) * op.dtype.itemsize
                        state_copies.append(CopyStep(where, layout.state[vname], ptr[src], plan.exact(nbytes)))
                        plan.size_checks.append((nbytes, layout.state_bytes[vname], f"state {vname!r}"))
                else:
                    values[vname] = ValueRef(ptr[src], op.dtype, cap[src], op.shape)
                continue
            alias = 0 if op.kind == "scatter_nocopy" else op.alias
            if alias is not None:
                tgt = op.args[alias].src
                if prog.ops[tgt].kind == "constant" or ptr[tgt] in readonly:
                    raise BackendUnavailableError(f"{where}: writes in place into a weight or constant, which the "
                                                  "CUDA backend shares across runs")
                ptr[op.id], cap[op.id] = ptr[tgt], cap[tgt]
            elif feedback == (c, op.id):        # the next step's input, written where that input is read
                ptr[op.id] = layout.inputs[FEEDBACK[1]] if feedback_to is None else feedback_to
                cap[op.id] = layout.input_bytes[FEEDBACK[1]]
            else:
                name = f"c{c}.{op.id}"
                ptr[op.id], cap[op.id] = layout.arena + layout.offsets[name], layout.sizes[name]
            dtypes[op.id] = op.dtype
            in_head = head is not None and op.id in head.kop.tail     # an op a kernel before runs (its tail)
            if op.kind == "gemm" and op.id not in kops and not in_head:
                gs = _gemm_step(plan, where, op, ptr, cap, dtypes)
                gs.algo = (gemm_algos or {}).get((call.group, op.id))
                plan.steps.append(gs)
                continue
            kop = kops.get(op.id)
            if in_head and kop is None:        # its buffers join the head's launch
                if op.kind == "gemm":
                    plan.size_checks.extend(_gemm_kernel_checks(where, op, cap, dtypes))
                head.add(op, ptr, cap, readonly)
                if op.id == head.kop.tail[-1]:
                    _kernel_steps(plan, head, function, call.group, max_dyn, pdl)
                    head = None
                continue
            if kop is None:
                raise BackendUnavailableError(f"{where}: the package has no compiled kernel for this op "
                                              "(built without kernels?)")
            if len(kop.head_params) != len(op.args) + 2:
                raise PackageFormatError(f"{where}: the kernel takes {len(kop.head_params) - 2} buffers, the op "
                                         f"has {len(op.args)} arguments")
            if op.kind == "gemm":
                plan.size_checks.extend(_gemm_kernel_checks(where, op, cap, dtypes))
            step = _Launch(kop, where, [], [], [])
            step.add(op, ptr, cap, readonly)
            step.values.append(dyn_ptr)                # the head's buffers, then dyn, then each tail's
            if kop.tail:
                head = step                     # launched once its tails' buffers are known
            else:
                _kernel_steps(plan, step, function, call.group, max_dyn, pdl)
        plan.steps.extend(state_copies)

    for t in e.outputs:
        v = values.get(t.name)
        if v is None:
            v = ValueRef(layout.state[t.name], m.state[t.name].dtype, layout.state_bytes[t.name])
        if v.dtype != t.dtype:
            raise BackendUnavailableError(f"entry {entry_name!r}: output {t.name!r} is {t.dtype} but its value is "
                                          f"{v.dtype}")
        plan.outputs.append(IORef(t.name, v.ptr, t.shape, t.dtype, v.capacity))
        plan.size_checks.append((_numel(t.shape) * t.dtype.itemsize, v.capacity, f"output {t.name!r}"))
    plan.size_checks = _dedupe_checks(plan.size_checks, max_dyn)
    plan.finish()
    return plan


def _feedback_producer(pkg: Any, e: Any) -> tuple[int, int] | None:
    """(call index, op id) of the op whose value is the entry's :data:`FEEDBACK` output, when it may be
    written into the staging slot of the entry's :data:`FEEDBACK` input: same dtype, at most its size,
    a plain op of a later call than every call that reads the input (so every reader has run: the
    calls' steps are ordered by the bytes they share, loader/cuda/branches.py). Else None."""
    out_name, in_name = FEEDBACK
    ins = {t.name: t for t in e.inputs}
    outs = {t.name: t for t in e.outputs}
    if out_name not in outs or in_name not in ins or outs[out_name].dtype != ins[in_name].dtype:
        return None
    if [str(d) for d in outs[out_name].shape] != ["1"]:
        return None
    readers = [c for c, call in enumerate(e.calls) if in_name in call.inputs]
    for c, call in enumerate(e.calls):
        if out_name not in call.outputs:
            continue
        prog = pkg.programs[call.group]
        out_op = prog.outputs()[call.outputs.index(out_name)]
        src = prog.ops[out_op.args[0].src]
        if readers and c <= max(readers) or src.kind in ("input", "constant", "scatter_nocopy") \
                or src.alias is not None or not is_flat_prefix(out_op.args[0].view):
            return None
        return c, src.id
    return None


@dataclass
class _Launch:
    """One launch-table op's kernel parameters (and, for a kernel with tails, its tails' after them) and the
    device bytes they read and write (for branches.schedule)."""

    kop: Any
    where: str
    values: list[int]
    reads: list[tuple[int, int]]
    writes: list[tuple[int, int]]
    weights: list[tuple[int, int]] = field(default_factory=list)

    def add(self, op: LOp, ptr: dict[int, int], cap: dict[int, int], readonly: set[int]) -> None:
        """``op``'s buffers: its output, then its arguments (weights are never written: they order nothing,
        and are kept apart for the programmatic launch's check of ``early``)."""
        self.values += [ptr[op.id]] + [ptr[a.src] for a in op.args]
        self.reads += [(ptr[a.src], ptr[a.src] + cap[a.src]) for a in op.args if ptr[a.src] not in readonly]
        self.weights += [(ptr[a.src], ptr[a.src] + cap[a.src]) for a in op.args if ptr[a.src] in readonly]
        self.writes.append((ptr[op.id], ptr[op.id] + cap[op.id]))


def _kernel_steps(plan: EntryPlan, launch: _Launch, function: Callable[[int, str], Any], group: int,
                  max_dyn: Mapping[str, int], pdl: bool) -> None:
    """The kernel steps of one launch-table op (with its tails' buffers, when it has tails); ``pdl``: its
    table is programmatic and the session launches such tables so."""
    params = ParamPack(launch.values)
    early = {launch.values[launch.kop.params.index(p)] for p in launch.kop.early}
    programmatic = pdl and all(any(lo == v for lo, _ in launch.weights) for v in early)
    for lc in launch.kop.launches:
        grid = tuple(plan.grid(g, max_dyn) for g in lc.grid)
        plan.steps.append(KernelStep(f"{launch.where} kernel {lc.kernel}", function(group, lc.kernel), grid,
                                     lc.block, lc.shared_mem, params, tuple(launch.reads),  # type: ignore[arg-type]
                                     tuple(launch.writes), programmatic=programmatic, cluster=lc.cluster))


def _dedupe_checks(checks: list[tuple[Expr, int, str]], max_dyn: Mapping[str, int]) -> list[tuple[Expr, int, str]]:
    """One check per distinct size expression (the tightest capacity); static sizes are checked now."""
    best: dict[Expr, tuple[int, str]] = {}
    for size, cap, name in checks:
        if not size.vars():
            if size.evaluate({}) > cap:
                raise PackageFormatError(f"buffer {name} needs {size} bytes but has {cap}")
            continue
        cur = best.get(size)
        if cur is None or cap < cur[0]:
            best[size] = (cap, name)
    return [(size, cap, name) for size, (cap, name) in best.items()]


def _gemm_kernel_checks(where: str, op: LOp, cap: dict[int, int], dtypes: dict[int, DType]
                        ) -> list[tuple[Expr, int, str]]:
    """Size checks (bytes, capacity, what) for a gemm run by lum's kernel: the library plan's bounds
    checks (:func:`_gemm_ops`) as expressions, evaluated per run: C's batch*m*n elements fit the op's
    buffer, and the last element each operand reads lies within its producer's buffer."""
    p = op.params
    v = {name: as_expr(p.get(name, GEMM_DEFAULTS.get(name))) for name in GEMM_EXPRS}
    layout = p["layout"]
    jb, _ = gemm_parts(op)
    n_c = as_expr(p["n_out"]) if "epilogue" in p else v["n"]          # the columns the output holds
    checks = [(v["batch"] * v["m"] * n_c * op.dtype.itemsize, cap[op.id], f"{where}: output")]
    operands = [("B", op.args[jb].src, v["k"], v["n"], v["ldb"], v["stride_b"], v["offset_b"], layout[2:] == "Rm")]
    if "expr" not in p:                  # a fused prologue computes A inside the kernel: no buffer to check
        operands.insert(0, ("A", op.args[0].src, v["m"], v["k"], v["lda"], v["stride_a"], v["offset_a"],
                            layout[:2] == "Rm"))
    for name, arg, rows, cols, ld, stride, off, rm in operands:
        s0, s1 = (ld, 1) if rm else (1, ld)
        last = off + (v["batch"] - 1) * stride + (rows - 1) * s0 + (cols - 1) * s1
        checks.append(((last + 1) * dtypes[arg].itemsize, cap[arg], f"{where}: operand {name}"))
    return checks


def _gemm_step(plan: EntryPlan, where: str, op: LOp, ptr: dict[int, int], cap: dict[int, int],
               dtypes: dict[int, DType]) -> GemmStep:
    p = op.params
    a, b = op.args[0].src, op.args[1].src
    mixed = dtypes[a] == dtypes[b] in (DType.bf16, DType.f16) and op.dtype == DType.f32
    if not (dtypes[a] == dtypes[b] == op.dtype or mixed):
        raise BackendUnavailableError(f"{where}: a gemm of {dtypes[a]} × {dtypes[b]} → {op.dtype}; the CUDA "
                                      "backend runs same-dtype gemms and 16-bit × 16-bit → f32 ones only")
    if p.get("layout") not in ("RmRm", "RmCm", "CmRm", "CmCm"):
        raise PackageFormatError(f"{where}: gemm layout {p.get('layout')!r}")
    for key in ("m", "n", "k", "lda", "ldb"):
        if key not in p:
            raise PackageFormatError(f"{where}: gemm needs parameter {key!r}")
    exprs = {name: plan.exact(p.get(name, GEMM_DEFAULTS.get(name))) for name in GEMM_EXPRS}
    item, in_item = op.dtype.itemsize, dtypes[a].itemsize
    return GemmStep(where, p["layout"], op.dtype, exprs,
                    plan.exact(p["ldc"]) if "ldc" in p else None,
                    plan.exact(p["stride_c"]) if "stride_c" in p else None,
                    plan.exact(_numel(op.shape)),
                    ptr[a], ptr[b], ptr[op.id], cap[a] // in_item, cap[b] // in_item, cap[op.id] // item,
                    in_dtype=dtypes[a] if mixed else None)
