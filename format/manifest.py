"""The model manifest: what a ``.lumpkg`` holds and how its entry points run (schema ``lum.model/1``).

The container (:mod:`lum.format.package`) stores named sections; this module gives them meaning:
the model's identity, the compile target, provenance, the weights and KV-cache state, the compiled
groups (one LLIR program each, section ``llir/<k>``) and, per entry point, the ordered group calls that
compute it with the names of the values each call reads and writes. Parsing is strict: every field is
type-checked and every cross-reference resolved, and a violation raises :class:`PackageFormatError`
with one line, so a corrupt or hostile manifest never reaches the runtime.

``target`` is ``{"sm": "sm_90", "nvrtc": "13.0"}``: the architecture the cubins were compiled for
(``sm_<digits>`` with an optional ``a``/``f`` feature suffix) and, when kernels were compiled, the
NVRTC version that compiled them (a driver older than its major version cannot load them).

**Kernel tables** (``groups[k].kernels``, schema version 1, 2 when a kernel has tails, 3 when a launch
runs in thread block clusters). An empty
object means the group's kernels were not compiled (``BuildOptions.compile_kernels=False``); the CUDA
backend then refuses the package and the reference backend runs it. Otherwise::

    {"version": 1,
     "arch": "sm_90",                 # == target.sm
     "cubin": "cubin/3",              # raw section with the group's module (null iff ops is empty)
     "ptx": "ptx/3",                  # optional zstd section: the same module as PTX (or null)
     "dyn_vars": ["p", "s"],          # slot order of the int64 device buffer the kernels read
     "max_dyn": {"p": 64, "s": 64},   # the kernels' index arithmetic assumes var <= bound
     "ops": [{"op": 12,               # LLIR op id, one entry per kernel op (kinds of TABLE_OP_KINDS)
              "kind": "elementwise",  # its LLIR kind, checked against the program
              "name": "lum_elementwise_add_…",
              "launches": [{"kernel": "lum_elementwise_add_…",    # entry point in the cubin
                            "grid": ["max(1, min(cdiv(64 * s, 1024), 65536))", "1", "1"],
                            "block": [256, 1, 1], "shared_mem": 0}],
              "params": ["out", "in0", "in1", "dyn"],             # out, one per op.args, dyn
              "dyn_slots": {"s": 1},  # the vars this kernel reads
              "tuning": {…},          # informational: the template parameters used
              "early": ["in1"]}],     # optional: parameters read before the wait (see below)
     "programmatic": true}            # optional (default false), see below

A launch's grid is three expressions over ``dyn_vars`` (each evaluates to ≥ 1); launches of one op
run in order on one stream with the same parameters. Parameter ``out`` is the op's buffer (for an
in-place op, the aliased argument's buffer), ``inK`` the raw buffer of ``op.args[K]``'s producer,
``dyn`` the device buffer of int64 values in ``dyn_vars`` order. Version 2 adds **kernel tails**
(:mod:`lum.builder.fused`): an op entry with ``"tail": [14, 16]`` is a kernel that also runs LLIR ops
14 and 16 (for :mod:`lum.builder.siblings`, which reads none of the others' outputs, by blocks of their own
beside it; for :mod:`lum.builder.attention_stage`, the stage's ops first, then the attention after a block
barrier), so they have no entry of their own; its ``params`` go on with ``"out@14", "in0@14", …, "out@16", …``,
the tails' buffers by the same rules. A tail op must follow its head in the program with no kernel op or
library call between them, and what the head reads stays live (is not reused by the arena) until its last
tail. Version 3 adds **clusters**: a launch with ``"cluster": 8`` runs its grid in thread block clusters of
that many blocks along x (sm_90+; 2 to :data:`MAX_CLUSTER`, the portable size; the grid's x must be a
multiple of it), which the kernel's blocks synchronise within. The loader runs them; lum's builder emits
none since its one user, an attention combine in clusters, measured slower and was removed. Every op
of a KERNEL_OP_KINDS kind has an entry or is a tail; a ``gemm`` op has one when lum's own kernel runs
it (a small static m, see :func:`lum.builder.gemv_policy.gemv_rows`) and none when it is a cuBLASLt call
described by the LLIR alone. For the latter, a table built on a GPU may add the cuBLASLt algorithm timed fastest at build
time (``lum.builder.gemm_algos``)::

     "gemms": [{"op": 7,                            # LLIR id of a gemm op
                "algo": "<128 hex digits>",         # the 64 bytes of its cublasLtMatmulAlgo_t
                "algo_dims": {"m": 512, "n": 256, "k": 256, "batch": 1}}]   # where it was timed

with ``target.cublaslt_version`` (an int, ``cublasLtGetVersion()``) naming the library they are valid
for: the loader passes them only to that version. Modules of packages built before the L2 prefetch was
removed may carry an unused ``lum_l2_prefetch`` entry, which the loader ignores. The parser checks
everything above that a loader relies on (names, expressions and their vars, block limits, the parameter
convention); the loader checks the table against the LLIR (every kernel op covered, kinds and arities equal).

``programmatic: true`` says that every kernel of the table lets the next kernel of its stream launch
early (``griddepcontrol.launch_dependents``) and waits on the device for the kernel before it
(``griddepcontrol.wait``) before it touches global memory, with two exceptions: the dyn buffer (host
copies fill it before a graph runs) and the buffers its op entry names in ``early`` (a GEMV's weights,
which it starts copying into shared memory while its predecessor runs; its own ``in<k>`` or a tail's
``in<k>@T``). A CUDA loader may then launch
the table's kernels with programmatic stream serialization (sm_90+), each only where every ``early``
buffer is a weight (nothing in the package writes one); tables without the flag (older builds) launch
plainly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from lum.format.dtypes import DType
from lum.format.errors import PackageFormatError
from lum.format.expr import Expr, ExprParseError, parse

SCHEMA = "lum.model"
SCHEMA_VERSION = 1
KERNEL_TABLE_VERSION = 1
TAIL_TABLE_VERSION = 2              # adds kernel tails (an op entry's ``tail``)
CLUSTER_TABLE_VERSION = 3           # adds thread block clusters (a launch's ``cluster``)
TABLE_VERSIONS = (KERNEL_TABLE_VERSION, TAIL_TABLE_VERSION, CLUSTER_TABLE_VERSION)
MAX_CLUSTER = 8                     # blocks a cluster, at most (the portable cluster size)
# kinds that are always kernels
KERNEL_OP_KINDS = ("elementwise", "reduce", "gather", "scatter", "scatter_nocopy", "iota", "attention")
TABLE_OP_KINDS = KERNEL_OP_KINDS + ("gemm",)   # kinds a launch table may hold (a gemm: when not cuBLASLt)
SM_RE = re.compile(r"sm_(\d{2,3})([af]?)")
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")
_VERSION_RE = re.compile(r"\d{1,4}\.\d{1,4}")
_ALGO_RE = re.compile(r"[0-9a-fA-F]{128}")
GEMM_ALGO_DIMS = ("m", "n", "k", "batch")
MAX_BLOCK_THREADS = 1024
MAX_SHARED_MEM = 227 * 1024
MAX_GRID = (2**31 - 1, 65535, 65535)


def parse_sm(arch: str) -> tuple[int, int, str]:
    """An architecture name that :data:`SM_RE` matches as (major, minor, suffix): ``"sm_90"`` → (9, 0, ""),
    ``"sm_90a"`` → (9, 0, "a"), ``"sm_120"`` → (12, 0, "")."""
    m = SM_RE.fullmatch(arch or "")
    if m is None:
        raise ValueError(f"expected an architecture like 'sm_90', found {arch!r}")
    digits = m.group(1)
    return int(digits[:-1]), int(digits[-1]), m.group(2)


def sm_version(arch: str) -> int:
    """The compute capability of an architecture name as an int (``sm_90a`` → 90)."""
    major, minor, _ = parse_sm(arch)
    return 10 * major + minor


def _tail_inputs(params: tuple[str, ...], t: int) -> int:
    """How many ``in<k>@<t>`` parameters (tail op ``t``'s buffers) ``params`` holds."""
    return sum(1 for p in params if p.startswith("in") and p.partition("@")[2] == str(t))


def _kernel_params(params: tuple[str, ...], tail: tuple[int, ...]) -> tuple[str, ...]:
    """The parameter list a kernel with these tails must have, its arities read from ``params``
    (a malformed list gives one that differs from it)."""
    n_in = params.index("dyn") - 1 if "dyn" in params else 0
    want = ("out",) + tuple(f"in{k}" for k in range(n_in)) + ("dyn",)
    for t in tail:
        want += (f"out@{t}",) + tuple(f"in{k}@{t}" for k in range(_tail_inputs(params, t)))
    return want


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
class KernelLaunch:
    kernel: str                              # entry point in the group's cubin
    grid: tuple[Expr, Expr, Expr]            # over the table's dyn_vars
    block: tuple[int, int, int]
    shared_mem: int = 0
    cluster: int = 1                         # blocks a thread block cluster along x (version 3)


@dataclass(frozen=True)
class KernelOp:
    op: int                                  # LLIR op id
    kind: str
    name: str
    launches: tuple[KernelLaunch, ...]
    params: tuple[str, ...]                  # "out", "in0" …, "dyn", then "out@T", "in0@T" … per tail T
    dyn_slots: dict[str, int] = field(default_factory=dict, compare=False)
    tuning: dict[str, Any] = field(default_factory=dict, compare=False)
    tail: tuple[int, ...] = ()               # LLIR ops it runs too, in program order (version 2)
    early: tuple[str, ...] = ()              # its parameters read before it waits (programmatic tables)

    def tail_arities(self) -> tuple[int, ...]:
        """Buffers each tail op takes (its ``in@T`` parameters)."""
        return tuple(_tail_inputs(self.params, t) for t in self.tail)

    @property
    def head_params(self) -> tuple[str, ...]:
        return self.params[:self.params.index("dyn") + 1]


@dataclass(frozen=True)
class GemmAlgo:
    """A cuBLASLt algorithm chosen at build time for one gemm op (``gemms`` of a kernel table)."""

    op: int
    algo: bytes                              # 64 bytes
    dims: tuple[int, int, int, int]          # m, n, k, batch it was timed at


@dataclass(frozen=True)
class KernelTable:
    """A group's compiled kernels and how to launch them (parsed ``groups[k].kernels``)."""

    arch: str
    cubin: str | None
    ptx: str | None
    dyn_vars: tuple[str, ...]
    max_dyn: dict[str, int]
    ops: tuple[KernelOp, ...]
    gemms: tuple[GemmAlgo, ...] = ()
    programmatic: bool = False      # every kernel waits for its predecessor itself (see the module doc)

    def by_op(self) -> dict[int, KernelOp]:
        return {k.op: k for k in self.ops}


@dataclass(frozen=True)
class GroupRef:
    hash: str
    llir: str                       # section holding the LLIR JSON
    chunks: int                     # how many chunks of the model run this group
    kernels: dict[str, Any] = field(default_factory=dict)   # the launch table as stored (see above)
    table: KernelTable | None = field(default=None, compare=False)   # parsed ``kernels`` (None if empty)

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
        self.target_(target)
        groups = []
        for i, g in enumerate(self.lst(d.get("groups"), "groups")):
            g = self.obj(g, f"groups[{i}]")
            kernels = self.obj(g.get("kernels", {}), f"groups[{i}].kernels")
            table = self.kernel_table(kernels, f"groups[{i}].kernels", target) if kernels else None
            groups.append(GroupRef(self.string(g.get("hash"), f"groups[{i}].hash"),
                                   self.section(g.get("llir"), f"groups[{i}].llir"),
                                   self.integer(g.get("chunks"), f"groups[{i}].chunks", 1),
                                   kernels, table))
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

    def target_(self, t: dict) -> None:
        sm = t.get("sm")
        if sm is not None and (not isinstance(sm, str) or not SM_RE.fullmatch(sm)):
            raise self.fail("target.sm", f"expected an architecture like 'sm_90', found {sm!r}")
        nv = t.get("nvrtc")
        if nv is not None and (not isinstance(nv, str) or not _VERSION_RE.fullmatch(nv)):
            raise self.fail("target.nvrtc", f"expected a version like '13.0', found {nv!r}")
        if "cublaslt_version" in t:
            self.integer(t["cublaslt_version"], "target.cublaslt_version", 1)

    def kernel_table(self, d: dict, where: str, target: dict) -> KernelTable:
        version = d.get("version")
        if version not in TABLE_VERSIONS:
            raise self.fail(where + ".version", f"unsupported kernel table version {version!r} "
                                                f"(this loader reads {', '.join(map(str, TABLE_VERSIONS))})")
        arch = self.string(d.get("arch"), where + ".arch")
        if not SM_RE.fullmatch(arch):
            raise self.fail(where + ".arch", f"expected an architecture like 'sm_90', found {arch!r}")
        if target.get("sm") != arch:
            raise self.fail(where + ".arch", f"kernels compiled for {arch} but the package targets "
                                             f"{target.get('sm')!r}")
        cubin = None if d.get("cubin") is None else self.section(d.get("cubin"), where + ".cubin")
        ptx = None if d.get("ptx") is None else self.section(d.get("ptx"), where + ".ptx")
        dyn_vars = tuple(self.ident(x, where + ".dyn_vars") for x in self.lst(d.get("dyn_vars"), where + ".dyn_vars"))
        if len(set(dyn_vars)) != len(dyn_vars):
            raise self.fail(where + ".dyn_vars", f"duplicate names in {list(dyn_vars)}")
        max_dyn = {}
        for k, v in self.obj(d.get("max_dyn", {}), where + ".max_dyn").items():
            if k not in dyn_vars:
                raise self.fail(where + ".max_dyn", f"bound for {k!r}, which is not in dyn_vars")
            max_dyn[k] = self.integer(v, f"{where}.max_dyn[{k!r}]")
        ops: list[KernelOp] = []
        tails_seen: set[int] = set()
        for j, o in enumerate(self.lst(d.get("ops"), where + ".ops")):
            ow = f"{where}.ops[{j}]"
            o = self.obj(o, ow)
            op_id = self.integer(o.get("op"), ow + ".op")
            if ops and op_id <= ops[-1].op:
                raise self.fail(ow + ".op", "ops must be sorted by op id without duplicates")
            kind = self.string(o.get("kind"), ow + ".kind")
            if kind not in TABLE_OP_KINDS:
                raise self.fail(ow + ".kind", f"{kind!r} is not a kernel op kind {TABLE_OP_KINDS}")
            launches = []
            raw = self.lst(o.get("launches"), ow + ".launches")
            if not 1 <= len(raw) <= 4:
                raise self.fail(ow + ".launches", f"expected 1 to 4 launches, found {len(raw)}")
            for li, lc in enumerate(raw):
                lw = f"{ow}.launches[{li}]"
                lc = self.obj(lc, lw)
                grid = tuple(self.expr(x, lw + ".grid") for x in self.lst(lc.get("grid"), lw + ".grid"))
                block = tuple(self.integer(x, lw + ".block", 1, MAX_BLOCK_THREADS)
                              for x in self.lst(lc.get("block"), lw + ".block"))
                if len(grid) != 3 or len(block) != 3:
                    raise self.fail(lw, "grid and block need 3 dimensions each")
                if block[0] * block[1] * block[2] > MAX_BLOCK_THREADS:
                    raise self.fail(lw + ".block", f"{list(block)} exceeds {MAX_BLOCK_THREADS} threads")
                for g in grid:
                    extra = g.vars() - set(dyn_vars)
                    if extra:
                        raise self.fail(lw + ".grid", f"uses {sorted(extra)}, which are not in dyn_vars")
                shared = self.integer(lc.get("shared_mem", 0), lw + ".shared_mem", 0, MAX_SHARED_MEM)
                name = self.ident(lc.get("kernel"), lw + ".kernel")
                cluster = self.cluster(lc, lw, version, arch)
                launches.append(KernelLaunch(name, grid, block, shared, cluster))  # type: ignore[arg-type]
            params = tuple(self.string(x, ow + ".params") for x in self.lst(o.get("params"), ow + ".params"))
            tail = self.tail(o, ow, op_id, version, tails_seen)
            if params != _kernel_params(params, tail):
                raise self.fail(ow + ".params", "expected ['out', 'in0', …, 'dyn'] then ['out@T', 'in0@T', …] per "
                                                f"tail op T, found {list(params)}"[:300])
            slots = {}
            for k, v in self.obj(o.get("dyn_slots", {}), ow + ".dyn_slots").items():
                if k not in dyn_vars or v != dyn_vars.index(k):
                    raise self.fail(ow + ".dyn_slots", f"slot of {k!r} disagrees with dyn_vars {list(dyn_vars)}")
                slots[k] = v
            early = tuple(self.string(x, ow + ".early") for x in self.lst(o.get("early", []), ow + ".early"))
            if not set(early) <= {p for p in params if p.startswith("in")}:     # its own inputs or its tails
                raise self.fail(ow + ".early", f"names {list(early)}, not input parameters of the kernel")
            ops.append(KernelOp(op_id, kind, self.string(o.get("name"), ow + ".name"), tuple(launches), params,
                                slots, self.obj(o.get("tuning", {}), ow + ".tuning"), tail, early))
        clash = tails_seen & {k.op for k in ops}
        if clash:
            raise self.fail(where + ".ops", f"op {min(clash)} is both a kernel of its own and another's tail")
        if ops and cubin is None:
            raise self.fail(where + ".cubin", "the table has kernels but names no cubin section")
        gemms = self.gemm_algos(d["gemms"], where + ".gemms", target) if "gemms" in d else ()
        programmatic = d.get("programmatic", False)
        if not isinstance(programmatic, bool):
            raise self.fail(where + ".programmatic", f"expected true or false, found {programmatic!r}")
        return KernelTable(arch, cubin, ptx, dyn_vars, max_dyn, tuple(ops), gemms, programmatic)

    def cluster(self, lc: dict, where: str, version: Any, arch: str) -> int:
        if "cluster" not in lc:
            return 1
        if version != CLUSTER_TABLE_VERSION:
            raise self.fail(where + ".cluster", f"clusters need table version {CLUSTER_TABLE_VERSION}")
        n = self.integer(lc["cluster"], where + ".cluster", 2, MAX_CLUSTER)
        if sm_version(arch) < 90:
            raise self.fail(where + ".cluster", f"thread block clusters need sm_90 or newer, not {arch}")
        return n

    def tail(self, o: dict, where: str, op_id: int, version: Any, seen: set[int]) -> tuple[int, ...]:
        if "tail" not in o:
            return ()
        if version not in (TAIL_TABLE_VERSION, CLUSTER_TABLE_VERSION):
            raise self.fail(where + ".tail",
                            f"kernel tails need table version {TAIL_TABLE_VERSION} or {CLUSTER_TABLE_VERSION}")
        ids = tuple(self.integer(x, where + ".tail") for x in self.lst(o["tail"], where + ".tail"))
        if not ids or any(b <= a for a, b in zip((op_id,) + ids, ids)):
            raise self.fail(where + ".tail", f"expected op ids after {op_id}, increasing, found {list(ids)}"[:200])
        if seen & set(ids):
            raise self.fail(where + ".tail", f"op {min(seen & set(ids))} is the tail of two kernels")
        seen.update(ids)
        return ids

    def gemm_algos(self, v: Any, where: str, target: dict) -> tuple[GemmAlgo, ...]:
        if "cublaslt_version" not in target:
            raise self.fail(where, "gemm algorithms without target.cublaslt_version")
        out: list[GemmAlgo] = []
        for j, g in enumerate(self.lst(v, where)):
            gw = f"{where}[{j}]"
            g = self.obj(g, gw)
            op_id = self.integer(g.get("op"), gw + ".op")
            if out and op_id <= out[-1].op:
                raise self.fail(gw + ".op", "gemms must be sorted by op id without duplicates")
            algo = g.get("algo")
            if not isinstance(algo, str) or not _ALGO_RE.fullmatch(algo):
                raise self.fail(gw + ".algo", "expected 128 hex digits (a 64-byte cuBLASLt algorithm)")
            dims = self.obj(g.get("algo_dims"), gw + ".algo_dims")
            if set(dims) != set(GEMM_ALGO_DIMS):
                raise self.fail(gw + ".algo_dims", f"expected exactly the keys {list(GEMM_ALGO_DIMS)}")
            out.append(GemmAlgo(op_id, bytes.fromhex(algo),
                                tuple(self.integer(dims[k], f"{gw}.algo_dims.{k}") for k in GEMM_ALGO_DIMS)))  # type: ignore[arg-type]
        return tuple(out)

    def ident(self, v: Any, where: str) -> str:
        if not isinstance(v, str) or not _IDENT_RE.fullmatch(v):
            raise self.fail(where, f"expected a C identifier, found {v!r}"[:200])
        return v

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
