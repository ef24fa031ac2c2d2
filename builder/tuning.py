"""Extraction by measurement (DESIGN.md step 6): per group, a genetic search over the e-graph's
decision points and the kernel templates' tuning parameters (group-wide ones, :data:`TUNING_DECISIONS`,
the block size and split of each decode GEMV, :data:`GEMV_TUNING_DECISIONS`, flash attention's key tile,
:data:`FLASH_TUNING_DECISIONS`, and split-K decode attention's split, :data:`ATTENTION_TUNING_DECISIONS`), every
candidate timed on the GPU, results kept in a persistent tuning database.

* :class:`TuningDB` — one JSON file per key in ``platformdirs.user_cache_dir("lum")/tuning`` (or
  ``$LUM_CACHE_DIR/tuning``). The key is a sha256 over the group's structural hash, the GPU name,
  the driver's CUDA version, NVRTC, the lum version and the build options that change what a
  candidate is or how it is timed (model dtype, target, max_seq, the timing dyn map, fixed kernel
  tuning). A record holds the decision points it was searched over, the chosen genome (+ tuning
  parameters), its measured time and the trial log. Writes are atomic (temp file + ``os.replace``);
  a corrupt or foreign record is ignored with a warning and the group is measured again.
* :class:`GpuTimer` — times one candidate genome of one group: lower the choice
  (:func:`lum.builder.extract.lower`), write it as a one-program package with its kernels compiled
  by NVRTC (:func:`lum.builder.package_builder.write_program_package`; NVRTC's disk cache makes
  repeats cheap), open a CUDA session on it, run it on seeded random inputs with the arena poisoned
  (0xFF: NaN in every float dtype) and compare every output with the numpy reference backend
  (:func:`lum.loader.reference_backend.execute` on the same inputs of the first candidate's program, the
  cost model's seed — what a build without a budget ships — run once: every candidate, its lowering as
  well as its kernels, must compute what the seed computes; max-norm
  relative error < 1e-4 for f32, < 2e-2 when the program holds bf16/f16; NaN/inf never passes),
  then time replays of the captured CUDA graph with CUDA events (:func:`replay_times`: ≥ 20 ms of warm-up,
  then the median of ``repeats`` batches of replays, ≈ 0.5 ms each). Candidates are compiled without PTX.
  It sums the seconds of each part of that path over a group's candidates (:data:`TIMER_PHASES`), kept in
  the group's record as ``seconds_by_phase``: where a search that does not fit a build spends its time.
* :func:`measured_compiler` — the ``compile_group`` callable :func:`~lum.builder.package_builder.build_package`
  uses when ``BuildOptions.budget > 0`` and a usable GPU is present: per group a DB hit lowers the
  stored genome with no measuring at all (after checking the stored decision points still match the
  e-graph); a miss seeds :func:`lum.builder.search.search` with the cost model's choice, runs it
  within ``budget`` timer calls and stores the result. Its ``provenance`` and ``tuning_section``
  feed the package (``extraction: measured``, gpu, driver; section ``tuning`` = the DB records, so
  a rebuild that hits the DB writes identical bytes). ``BuildOptions.tune_entries`` limits the search to
  the groups of some entries (``lum build --tune decode``: a prefill layer took 36 candidates of ~2.5 s
  each on the H200), the others taking the cost model's program.

**Inputs.** Float inputs (weights, activations, KV caches) are uniform in ±[0.5, 1.5) — never zero,
never denormal — drawn from a generator seeded by the input's name and the dyn map, so every
candidate of a group sees the same arrays. Integer inputs must be *valid*, not merely in range:
a decoder layer's positions index the KV cache (scatter rows; duplicates would race) and build the
causal mask (random positions can mask a whole row: softmax of -inf → NaN in every candidate). So an
integer input produced by another chunk of the model (``ext``) takes its real value: the part of the
entry graph it depends on (e.g. ``iota(s) + p``) is run by the HLIR interpreter at the same dyn map.
Integer entry inputs (token ids) are drawn in ``[0, rows)`` of the table they gather from (distinct
rows when they are scatter destinations). Candidates are timed at the cost model's typical dyn map
(:func:`~lum.builder.package_builder.typical_dyn`); they are checked at the same map when the group
is small enough for the numpy reference (≤ :data:`CHECK_FLOPS` flops), else at a small one (each dyn
var ≤ 8), where the reference takes milliseconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from lum.builder.attention_policy import flash_attention, flash_attention_enabled
from lum.builder.attention_stage import ENV_ATTENTION_STAGE
from lum.builder.env_switches import env_switch
from lum.builder.gemv_policy import (ENV_GEMV_AHEAD_AFTER_GEMV, ENV_GEMV_AHEAD_PLAIN,
                                     ENV_GEMV_EVICT_FIRST, gemv_balance, gemv_inflight_default, gemv_kernel_ops,
                                     gemv_preload_after_gemv, gemv_preload_default, gemv_preload_shared,
                                     gemv_prologue_narrow_a, gemv_prologue_pairs, gemv_prologue_threads,
                                     gemv_tuning_override)
from lum.builder.hlir import Edge, Graph
from lum.builder.epilogue import gemv_epilogues_enabled
from lum.builder.extract import ATTENTION_CHUNK, ATTENTION_CHUNKS, attention_chunk_default
from lum.builder.prologue import gemv_prologues_enabled, prologue_max_cols
from lum.builder.o_combine import ENV_O_COMBINE
from lum.builder.row_codegen import ENV_ROW_ONLINE
from lum.builder.row_reads import row_reads_enabled
from lum.builder.siblings import sibling_kernels_enabled
from lum.builder.search import CandidateRejected, Decision, SearchProgress, SearchSpace, genome_hash, search
from lum.format import __version__ as LUM_VERSION
from lum.format.atomic import atomic_write_bytes
from lum.format.dtypes import DType
from lum.format.expr import as_expr
from lum.format.llir import Program
from lum.format.shapetracker import ShapeTracker

__all__ = ["DB_VERSION", "ENV_CACHE_DIR", "TUNING_DECISIONS", "GEMV_TUNING_DECISIONS", "FLASH_TUNING_DECISIONS",
           "ATTENTION_TUNING_DECISIONS",
           "CHECK_FLOPS", "cache_dir",
           "TuningDB", "DeviceIdentity", "device_identity", "gpu_unavailable_reason", "GroupInfo", "GpuTimer",
           "MeasuredCompiler", "measured_compiler", "tolerance", "compare_outputs", "random_array"]

DB_VERSION = 1
# On / off kernel switches with no entry of their own in a search's database key, and their defaults: the key
# names those set the other way (so records measured with the defaults stay valid), as it does the others.
KEY_SWITCHES = {ENV_GEMV_EVICT_FIRST: True, ENV_GEMV_AHEAD_PLAIN: False, ENV_GEMV_AHEAD_AFTER_GEMV: True,
                ENV_ATTENTION_STAGE: True, ENV_ROW_ONLINE: True, ENV_O_COMBINE: True}
ENV_CACHE_DIR = "LUM_CACHE_DIR"
CHECK_FLOPS = 2e8            # groups above this (at the timing dyn map) are checked at a small dyn map
CHECK_DYN_MAX = 8
SEARCH_SEED = 0

# Template tuning parameters searched per group: option 0 is codegen's default, so a genome of
# zeros there is the untuned kernel. Keys the user fixed (BuildOptions.kernel_tuning) are not searched.
# ``group`` is the split count of reductions and of lum's GEMV (threads sharing one output along k);
# ``unroll`` the GEMV's loads in flight. A value a kernel cannot take (a group above its threads) fails
# codegen and rejects the candidate.
TUNING_DECISIONS: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("threads", (None, 128, 256, 512)),
    ("ept", (None, 1, 2, 4)),
    ("group", (None, 64, 128)),
    ("unroll", (None, 8)),
)
# ... and per decode GEMV (lum's kernel, in program order: ``gemv<i>.<name>``, see
# gemv_policy.split_gemv_tuning), for as many as the cost model's program of the group has: the best block
# size, split and unroll differ by shape (benchmarks/gemv_sweep.py at 893d4ba: gemma3-4b's down projection
# 10% faster with 128 threads / split 64, llama3-1b's 8% with 1,024 / 128 / unroll 8, and each one's best
# 11-13% slower on the other), which one group-wide value cannot choose.
GEMV_TUNING_DECISIONS: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("threads", (None, 128, 256, 512, 1024)),
    ("group", (None, 32, 64, 128)),
    ("unroll", (None, 8)),          # k-loop unroll (None: the group-wide value)
    ("inflight", (None, 4, 8)),     # vector loads a lane issues ahead (None: $LUM_GEMV_INFLIGHT, else the
                                    # GEMV's default, gemv_policy.gemv_inflight_for)
    ("preload", (None, 1, 2, 4)),   # first weight vectors into registers before the wait (None: $LUM_GEMV_PRELOAD;
                                    # 4 in every GEMV: llama3-1b +3.0%, gemma3-4b -10.6%, 14a819d)
    ("max_blocks", (None, 132, 264)),   # grid cap: one or two blocks an SM (a prologue GEMV's blocks each
)                                       # compute A; gemv_sweep --mode prologue: 132 best for gemma's gate-up)
MAX_TUNED_GEMVS = 8
# ... and, in a group whose program runs flash attention (prefill), its key tile
# (attention_policy.FLASH_TILE_KEYS; its query rows a block follow the group-wide ``threads``): 64 on tensor
# cores and 32 with FMAs by default, the others trading shared memory and registers against the passes over a
# block's rows
FLASH_TUNING_DECISIONS: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("tile_keys", (None, 32, 64, 128)),
)
# ... and, in a group whose program runs split-K decode attention, its split: keys a chunk (None: extract's
# attention_chunk_default, 16 unless $LUM_ATTENTION_CHUNK says otherwise). Fewer, longer chunks mean fewer
# partials for the combine to read and more keys a block walks in turn; the LLIR's attention op carries it
# (``chunk``), so it is applied when lowering, not in codegen.
ATTENTION_TUNING_DECISIONS: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("attention_chunk", (None, *ATTENTION_CHUNKS[1:])),
)
LOWERING_KEYS = ("attention_chunk",)     # tuning keys lower() takes rather than codegen

ProgressFn = Callable[[str, int, int], None]


# ====================================================================== database
def cache_dir() -> Path:
    """``$LUM_CACHE_DIR`` when set, else ``platformdirs.user_cache_dir("lum")``."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("lum"))


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


class TuningDB:
    """Tuning records, one JSON file per key under ``root`` (default ``cache_dir()/tuning``)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else cache_dir() / "tuning"

    @staticmethod
    def key(group_hash: str, gpu: str, driver: str, lum_version: str = LUM_VERSION,
            options: Mapping[str, Any] | None = None) -> str:
        """sha256 of the key fields (canonical JSON): what a stored result is valid for."""
        fields = {"db": DB_VERSION, "group": group_hash, "gpu": gpu, "driver": str(driver), "lum": lum_version,
                  "options": dict(options or {})}
        return hashlib.sha256(_canonical(fields).encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def get(self, key: str) -> dict | None:
        """The record stored under ``key``; None when there is none, or (with a warning) when it is
        unreadable, corrupt, or not a record for this key."""
        p = self.path(key)
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            warnings.warn(f"lum: tuning record {p} is unreadable ({exc}); measuring again", stacklevel=2)
            return None
        try:
            rec = json.loads(raw.decode("utf-8"))
            problem = _record_problem(rec, key)
        except (UnicodeDecodeError, ValueError) as exc:
            problem = f"not JSON ({' '.join(str(exc).split())[:100]})"
        if problem:
            warnings.warn(f"lum: ignoring corrupt tuning record {p}: {problem}; measuring again", stacklevel=2)
            return None
        return rec

    def put(self, key: str, record: Mapping[str, Any]) -> Path:
        """Store ``record`` under ``key`` atomically (a reader sees the old file or the new one)."""
        rec = dict(record)
        rec["version"], rec["key"] = DB_VERSION, key
        data = json.dumps(rec, sort_keys=True, indent=1, allow_nan=False).encode()
        return atomic_write_bytes(self.path(key), data)


def _record_problem(rec: Any, key: str) -> str | None:
    if not isinstance(rec, dict):
        return "not a JSON object"
    if rec.get("version") != DB_VERSION:
        return f"version {rec.get('version')!r}, expected {DB_VERSION}"
    if rec.get("key") != key:
        return "stored under another key"
    g = rec.get("genome")
    if not isinstance(g, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in g):
        return "no genome"
    dec = rec.get("decisions")
    if not isinstance(dec, list) or len(dec) != len(g):
        return "decision points do not match the genome"
    if not isinstance(rec.get("trials"), list):
        return "no trial log"
    t = rec.get("time")
    if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t)):
        return "bad time"
    if not isinstance(rec.get("budget"), int):
        return "no budget"
    return None


# ====================================================================== device
@dataclass(frozen=True)
class DeviceIdentity:
    gpu: str          # device name, e.g. "NVIDIA H200"
    driver: str       # CUDA version the driver supports, e.g. "13000"
    sm: str           # "sm_90"


def device_identity(ordinal: int = 0) -> DeviceIdentity:
    from lum.loader.cuda import driver as cu

    info = cu.device_info(ordinal)
    return DeviceIdentity(info.name, str(info.driver_version), info.sm)


def gpu_unavailable_reason(target: str | None = None) -> str | None:
    """None when measured search can run here (a CUDA device of ``target``'s sm), else why not (one line)."""
    try:
        ident = device_identity()
    except Exception as exc:  # noqa: BLE001 - no cuda-python, no driver, no device: all mean "no GPU"
        return f"no usable GPU ({' '.join(str(exc).split())[:160]})"
    if target and ident.sm != target:
        return f"the GPU ({ident.gpu}, {ident.sm}) is not the build target {target}"
    return None


# ====================================================================== inputs and checks
def _seed_of(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(_canonical([str(p) for p in parts]).encode()).digest()[:8], "little")


def random_array(name: str, shape: Sequence[int], dtype: DType, seed: int = 0,
                 int_range: tuple[int, int] | None = None, distinct: bool = False) -> np.ndarray:
    """A seeded random array (same name, shape, dtype and seed → same values). Floats are
    ±[0.5, 1.5), never zero; integers uniform in ``int_range`` (default [0, 1]), ``distinct`` draws
    without repetition where the range allows; bool alternates at random."""
    shape = tuple(int(d) for d in shape)
    rng = np.random.default_rng(_seed_of(name, shape, dtype.value, seed))
    n = int(np.prod(shape, dtype=np.int64))
    if dtype.is_float:   # float32 in place, no masks: a model's embedding table is ~10^9 values
        u = rng.random(n, dtype=np.float32)
        u *= 2.0
        u -= 1.0                                     # [-1, 1)
        u += np.copysign(np.float32(0.5), u)         # (-1.5, -0.5] and [0.5, 1.5)
        return u.reshape(shape).astype(dtype.np, copy=False)
    if dtype == DType.bool:
        return (rng.random(n) < 0.5).reshape(shape)
    lo, hi = int_range if int_range is not None else (0, 1)
    hi = max(hi, lo)
    if distinct and hi - lo + 1 >= n:
        vals = lo + rng.permutation(hi - lo + 1)[:n]
    else:
        vals = rng.integers(lo, hi + 1, n)
    return vals.reshape(shape).astype(dtype.np)


def tolerance(program: Program) -> float:
    """Max-norm relative error a candidate may have: 2e-2 when the program holds bf16/f16 values, else 1e-4."""
    low = any(o.dtype in (DType.bf16, DType.f16) for o in program.ops)
    return 2e-2 if low else 1e-4


COMPARE_CHUNK = 1 << 22    # elements compared at a time: float64 copies of a whole embedding table (fresh
                           # GB-sized arrays) took 34 s and 4 GB for llama3-1b on the CPU machine, 3 s a chunk at a time


def compare_outputs(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], tol: float) -> str | None:
    """None when every output matches, else the first problem (one line). NaN/inf in a result never passes."""
    for name, w in want.items():
        if name not in got:
            return f"output {name!r} missing"
        g = np.asarray(got[name])
        w = np.asarray(w)
        if g.shape != w.shape:
            return f"output {name!r}: shape {g.shape} != {w.shape}"
        if w.dtype.kind in "biu" and g.dtype.kind in "biu":
            bad = int(np.count_nonzero(g.astype(np.int64) != w.astype(np.int64)))
            if bad:
                return f"output {name!r}: {bad} integer elements differ"
            continue
        g, w = g.reshape(-1), w.reshape(-1)
        chunks = range(0, g.size, COMPARE_CHUNK)
        diff = scale = 0.0
        for i in chunks:
            g64, w64 = g[i:i + COMPARE_CHUNK].astype(np.float64), w[i:i + COMPARE_CHUNK].astype(np.float64)
            if not np.isfinite(g64).all():
                bad = sum(int((~np.isfinite(g[j:j + COMPARE_CHUNK].astype(np.float64))).sum()) for j in chunks)
                return f"output {name!r}: {bad} NaN/inf values"
            if not np.isfinite(w64).all():
                return f"output {name!r}: the reference result is not finite on these inputs"
            diff = max(diff, float(np.abs(g64 - w64).max(initial=0.0)))
            scale = max(scale, float(np.abs(w64).max(initial=0.0)))
        err = diff / max(scale, 1e-30)
        if not err < tol and err != 0.0:
            return f"output {name!r}: relative error {err:.3g} >= {tol:g}"
    return None


# ====================================================================== groups
@dataclass
class GroupInfo:
    """A group as the model sees it: its hash, and (when known) the entry graph and representative
    chunk it came from (for the real values of integer inputs produced by other chunks)."""

    hash: str
    graph: Graph                       # the standalone group graph (chunk_graph of the representative)
    entry_graph: Graph | None = None
    chunk: Any = None                  # lum.builder.partition.Chunk
    entry: str | None = None


def _graph_key(g: Graph) -> str:
    return g.name + "\n" + g.dump()


def model_groups(spec: Any) -> dict[str, GroupInfo]:
    """Every group of the model's entries, by :func:`_graph_key` of its representative graph
    (exactly the graphs :func:`~lum.builder.package_builder.plan_model` hands to ``compile_group``)."""
    from lum.builder.partition import chunk_graph, group_chunks, partition

    out: dict[str, GroupInfo] = {}
    for ename, graph in spec.graphs.items():
        chunks = partition(graph)
        for grp in group_chunks(graph, chunks):
            cg = chunk_graph(graph, grp.representative)
            out.setdefault(_graph_key(cg), GroupInfo(grp.hash, cg, graph, grp.representative, ename))
    return out


def _standalone_hash(g: Graph) -> str:
    from lum.builder.partition import Chunk, structural_hash

    return structural_hash(g, Chunk(0, tuple(range(len(g))), (), ()))


def _index_range(graph: Graph, nid: int, dyn: Mapping[str, int]) -> tuple[tuple[int, int], bool]:
    """([lo, hi], distinct) for an integer node used as a gather or scatter index in ``graph``."""
    hi, distinct = None, False
    for c in graph.consumers()[nid]:
        node = graph.nodes[c]
        for k, e in enumerate(node.inputs):
            if e.src != nid:
                continue
            if node.op == "Gather" and k == 1 or node.op == "Scatter" and k == 2:
                table = graph.nodes[node.inputs[0].src]
                rows = int(as_expr(table.shape[0]).evaluate(dyn)) if table.shape else 1
                hi = rows - 1 if hi is None else min(hi, rows - 1)
                distinct |= node.op == "Scatter"
    return (0, max(hi if hi is not None else 1, 0)), distinct


class InputMaker:
    """The inputs of one group at a dyn map (see the module docstring), cached per dyn map."""

    def __init__(self, info: GroupInfo, seed: int = 0):
        self.info, self.seed = info, seed
        self._cache: dict[tuple, dict[str, np.ndarray]] = {}
        self._arrays: dict[tuple, np.ndarray] = {}

    def _entry_input(self, graph: Graph, node: Any, dyn: Mapping[str, int]) -> np.ndarray:
        shape = tuple(as_expr(d).evaluate(dyn) for d in node.shape)
        name = node.attrs["name"]
        if node.dtype.is_float:
            key = (name, shape, node.dtype.value)
            if key not in self._arrays:   # weights: one array for every dyn map
                self._arrays[key] = random_array(name, shape, node.dtype, self.seed)
            return self._arrays[key]
        rng, distinct = _index_range(graph, node.id, dyn)
        return random_array(name, shape, node.dtype, self.seed, rng, distinct)

    def _ext_values(self, nodes: Sequence[int], dyn: Mapping[str, int]) -> dict[int, np.ndarray]:
        """Values of entry-graph nodes: the HLIR interpreter on the part of the graph they depend on."""
        from lum.builder.reference import run_graph

        g = self.info.entry_graph
        need: set[int] = set()
        stack = list(nodes)
        while stack:
            n = stack.pop()
            if n not in need:
                need.add(n)
                stack.extend(e.src for e in g.nodes[n].inputs)
        sub = Graph(g.name + ".values")
        remap: dict[int, int] = {}
        back: dict[int, int] = {}
        for nid in sorted(need):
            n = g.nodes[nid]
            new = sub.add(n.op, tuple(Edge(remap[e.src], e.view) for e in n.inputs), n.shape, n.dtype, **n.attrs)
            remap[nid], back[new.id] = new.id, nid
        for nid in nodes:
            n = g.nodes[nid]
            sub.add("Output", (Edge(remap[nid], ShapeTracker.contiguous(n.shape)),), n.shape, n.dtype,
                    name=f"__value{nid}", role="output")
        ins = {n.attrs["name"]: self._entry_input(g, g.nodes[back[n.id]], dyn) for n in sub.inputs()}
        out = run_graph(sub, ins, dyn)
        return {nid: out[f"__value{nid}"] for nid in nodes}

    def inputs(self, dyn: Mapping[str, int]) -> dict[str, np.ndarray]:
        key = tuple(sorted(dyn.items()))
        if key in self._cache:
            return self._cache[key]
        cg = self.info.graph
        out: dict[str, np.ndarray] = {}
        ext_int = []
        for n in cg.inputs():
            name = n.attrs["name"]
            if (n.attrs.get("role") == "ext" and not n.dtype.is_float and self.info.entry_graph is not None
                    and self.info.chunk is not None):
                ext_int.append((name, self.info.chunk.input_nodes[int(name[3:])]))
                continue
            out[name] = self._entry_input(cg, n, dyn)
        if ext_int:
            vals = self._ext_values([nid for _, nid in ext_int], dyn)
            for name, nid in ext_int:
                want = cg.input_named(name).dtype
                out[name] = np.ascontiguousarray(vals[nid]).astype(want.np, copy=False)
        self._cache[key] = out
        return out


# ====================================================================== the GPU timer
def _tuning_of(space_tail: Sequence[tuple[str, tuple[Any, ...]]], genes: Sequence[int]) -> dict[str, Any]:
    return {name: opts[g] for (name, opts), g in zip(space_tail, genes) if opts[g] is not None}


def _lowering(tuning: Mapping[str, Any]) -> dict[str, Any]:
    """The tuning's keys that :func:`~lum.builder.extract.lower` takes (:data:`LOWERING_KEYS`)."""
    return {k: tuning[k] for k in LOWERING_KEYS if k in tuning}


def _codegen_tuning(tuning: Mapping[str, Any]) -> dict[str, Any]:
    """The tuning less the keys applied when lowering: codegen's keyword arguments."""
    return {k: v for k, v in tuning.items() if k not in LOWERING_KEYS}


@dataclass
class TimerSetup:
    """Everything a timer of one group needs; made by :class:`MeasuredCompiler`."""

    info: GroupInfo
    sat: Any                                   # SaturatedGroup
    space: SearchSpace
    tuning_decisions: tuple[tuple[str, tuple[Any, ...]], ...]
    time_dyn: dict[str, int]
    check_dyn: dict[str, int]
    max_seq: int
    target: str
    kernel_tuning: dict[str, Any] = field(default_factory=dict)
    nvrtc_cache: Any = None
    repeats: int = 10
    warmup: int = 3

    def decode(self, genome: Sequence[int]) -> tuple[dict[int, int], dict[str, Any]]:
        from lum.builder.extract import genome_to_choice

        n = len(self.sat.decisions)
        choice = genome_to_choice(self.sat, genome[:n])
        tuning = {**self.kernel_tuning, **_tuning_of(self.tuning_decisions, genome[n:])}
        return choice, tuning


# the parts of one candidate's evaluation GpuTimer times (a record's ``seconds_by_phase``): lowering the
# genome, codegen + NVRTC + writing its package, opening it, its CUDA session (open and close), the check
# against the reference, the timed replays
TIMER_PHASES = ("lower", "compile", "open", "session", "check", "time")


class GpuTimer:
    """Times genomes of one group on the GPU (see the module docstring). Call :meth:`close` when done.
    ``backend="reference"`` runs the same path on the numpy backend with wall-clock times (CPU tests)."""

    def __init__(self, setup: TimerSetup, backend: str = "cuda"):
        self.setup, self.backend = setup, backend
        self.cu = self.ctx = None
        if backend == "cuda":
            from lum.loader.cuda import driver as cu

            self.cu = cu
            self.ctx = cu.Context(0)    # keeps the primary context alive between candidates' sessions
        self.inputs = InputMaker(setup.info)
        self.tmp = tempfile.TemporaryDirectory(prefix="lum-tune-")
        self.count = 0
        self._want: dict[str, np.ndarray] | None = None    # the reference outputs at the check map
        # where a candidate's time goes, summed over this group's candidates (TIMER_PHASES): what to make
        # faster when a search does not fit a build
        self.seconds: dict[str, float] = dict.fromkeys(TIMER_PHASES, 0.0)

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def close(self) -> None:
        self.tmp.cleanup()
        if self.ctx is not None:
            self.ctx.close()
            self.ctx = None

    # ------------------------------------------------------------------ one candidate
    def __call__(self, genome: Sequence[int]) -> float:
        import lum.loader
        from lum.builder.extract import lower

        s = self.setup
        choice, tuning = s.decode(genome)
        try:
            with self._phase("lower"):
                program = lower(s.sat, choice, name=s.info.graph.name, **_lowering(tuning))
        except ValueError as exc:
            raise CandidateRejected(f"lower: {_one_line(exc)}") from None
        self.count += 1
        path = Path(self.tmp.name) / f"c{self.count}.lumpkg"
        try:
            with self._phase("compile"):
                _write_candidate(path, program, s, _codegen_tuning(tuning))
        except Exception as exc:  # noqa: BLE001 - codegen / NVRTC failures reject the candidate
            raise CandidateRejected(f"compile: {_one_line(exc)}") from None
        try:
            with self._phase("open"):
                pkg = lum.loader.open(path)
        except Exception as exc:  # noqa: BLE001
            raise CandidateRejected(f"package: {_one_line(exc)}") from None
        try:
            bounds = {k: max(s.time_dyn.get(k, 0), s.check_dyn.get(k, 0)) for k in (*s.time_dyn, *s.check_dyn)}
            try:
                with self._phase("session"):
                    sess = pkg.session(dyn=bounds, backend=self.backend)
            except Exception as exc:  # noqa: BLE001
                raise CandidateRejected(f"load: {_one_line(exc)}") from None
            try:
                with self._phase("check"):
                    self._check(sess, program)
                with self._phase("time"):
                    return self._time(sess)
            finally:
                with self._phase("session"):
                    sess.close()
        finally:
            pkg.close()
            try:
                path.unlink()
            except OSError:
                pass

    def _split(self, program: Program, values: Mapping[str, np.ndarray]) -> tuple[dict, dict]:
        state = {o.params["name"] for o in program.inputs() if o.params.get("role") == "state"}
        return ({k: v for k, v in values.items() if k not in state}, {k: v for k, v in values.items() if k in state})

    def _check(self, sess: Any, program: Program) -> None:
        from lum.loader.reference_backend import BackendError, execute

        s = self.setup
        values = self.inputs.inputs(s.check_dyn)
        if self._want is None:    # the first candidate's (the seed's) reference serves all: one function of
            try:                  # the group, and the numpy run of a decoder layer takes seconds
                self._want = execute(program, values, s.check_dyn)
            except BackendError as exc:
                raise CandidateRejected(f"reference: {_one_line(exc)}") from None
        want = self._want
        ins, state = self._split(program, values)
        try:
            poison = getattr(sess.runner, "fill_arena", None)    # the reference backend has no arena
            if poison is not None:
                poison(0xFF)
            if state:
                sess.load_state(state)
            got = sess.run("main", ins, s.check_dyn)
        except Exception as exc:  # noqa: BLE001 - a launch failure rejects the candidate
            raise CandidateRejected(f"run: {_one_line(exc)}") from None
        # an output that is an input passed through (the embedding table, for the tied LM head) holds what was
        # uploaded whatever the candidate: comparing it took most of an embedding group's evaluation
        through = {o.params["name"] for o in program.outputs() if program.ops[o.args[0].src].kind == "input"}
        problem = compare_outputs(got, {k: v for k, v in want.items() if k not in through}, tolerance(program))
        if problem:
            raise CandidateRejected(f"wrong result at {s.check_dyn}: {problem}")

    def _time(self, sess: Any) -> float:
        cu, s = self.cu, self.setup
        values = self.inputs.inputs(s.time_dyn)
        program = sess.pkg.programs[0]
        ins, state = self._split(program, values)
        runner = sess.runner
        if self.cu is None:         # a CPU backend (tests): wall time of whole runs
            times = []
            for _ in range(max(s.repeats, 1)):
                t0 = time.perf_counter()
                sess.run("main", ins, s.time_dyn)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        try:
            if state:
                sess.load_state(state)
            sess.run("main", ins, s.time_dyn)          # stages inputs and dyn values, captures the graph
            start = cu.call(cu.drv.cuEventCreate, int(cu.drv.CUevent_flags.CU_EVENT_DEFAULT))
            end = cu.call(cu.drv.cuEventCreate, int(cu.drv.CUevent_flags.CU_EVENT_DEFAULT))

            def batch(n: int) -> float:
                cu.call(cu.drv.cuEventRecord, start, runner.stream.handle)
                for _ in range(n):
                    _replay(runner, "main", s.time_dyn)
                cu.call(cu.drv.cuEventRecord, end, runner.stream.handle)
                cu.call(cu.drv.cuEventSynchronize, end)
                return float(cu.call(cu.drv.cuEventElapsedTime, start, end)) * 1e-3

            try:
                times = replay_times(batch, s.warmup, s.repeats)
            finally:
                cu.call(cu.drv.cuEventDestroy, start)
                cu.call(cu.drv.cuEventDestroy, end)
        except CandidateRejected:
            raise
        except Exception as exc:  # noqa: BLE001
            raise CandidateRejected(f"timing run: {_one_line(exc)}") from None
        return statistics.median(times)


WARM_S = 0.02       # device time of warm-up replays, at least: a candidate's compile leaves the GPU idle for seconds
BATCH_S = 5e-4      # device time of each timed sample, about: a decoder layer's graph replays in tens of µs
MAX_BATCH = 256


def replay_times(batch: Callable[[int], float], warmup: int, repeats: int, warm_s: float = WARM_S,
                 batch_s: float = BATCH_S, max_batch: int = MAX_BATCH) -> list[float]:
    """Seconds per replay of ``repeats`` samples, ``batch(n)`` replaying ``n`` times back to back and returning
    their device seconds. Warm-up runs ``warmup`` replays and at least ``warm_s`` of device time, in doubling
    batches; each sample is then a batch sized to about ``batch_s``. Timed one replay at a time right after
    its compile, llama3-1b's decode groups measured bimodal on the H200 (16–17 or 24–26 µs for the same
    kernels, 6bebe85): idle clocks and one launch's jitter, which a long warm-up and batches average out."""
    n, done, spent, per = 1, 0, 0.0, 0.0
    while done == 0 or ((done < warmup or spent < warm_s) and done < 64 * max_batch):
        t = batch(n)
        done, spent, per = done + n, spent + t, t / n
        n = min(2 * n, max_batch)
    size = max(1, min(max_batch, math.ceil(batch_s / max(per, 1e-9))))
    return [batch(size) / size for _ in range(max(repeats, 1))]


def _replay(runner: Any, entry: str, dyn: Mapping[str, int]) -> None:
    """Enqueue an entry's launches as the CUDA runner's ``run`` does, without staging the inputs again
    (they and the dyn values are in place from the previous run at the same dyn map)."""
    runner.ctx.make_current()
    plan = runner.plans[entry]
    key = plan.values(dyn)
    for seg in plan.segments:
        if runner.graphs:
            runner._graph(plan, seg, key).launch(runner.stream)
        else:
            runner._enqueue(plan.concrete(key, runner._gemm_plan, seg.steps), runner.stream)


def _write_candidate(path: Path, program: Program, s: TimerSetup, tuning: Mapping[str, Any]) -> Path:
    """A one-program package: entry ``main`` calls the program with every non-state input as an entry
    input (weights too: staged once, then replays time only the kernels), state tensors as state."""
    from lum.builder.package_builder import BuildOptions, write_program_package
    from lum.format.manifest import Call, Entry, TensorSpec

    ins = tuple(TensorSpec(o.params["name"], o.shape, o.dtype) for o in program.inputs()
                if o.params.get("role") != "state")
    outs = tuple(TensorSpec(o.params["name"], o.shape, o.dtype) for o in program.outputs())
    state = {o.params["name"]: TensorSpec(o.params["name"], o.shape, o.dtype) for o in program.inputs()
             if o.params.get("role") == "state"}
    dyn = tuple(sorted(set(s.time_dyn) | set(s.check_dyn)))
    call = Call(0, tuple(o.params["name"] for o in program.inputs()), tuple(o.params["name"] for o in program.outputs()))
    entry = Entry("main", dyn, ins, outs, (call,))
    opts = BuildOptions(target=s.target, kernel_tuning=dict(tuning), nvrtc_cache=s.nvrtc_cache, ptx=False)
    return write_program_package(path, [program], {"main": entry}, state=state, model={"max_seq": s.max_seq},
                                 options=opts)


# which template decisions the sweep times first: block sizes and splits (gemv_sweep.py: up to 10% a GEMV;
# decode attention's split), then grid caps and unrolls, then loads ahead and preloads (measured slower on every
# decode shape so far)
SWEEP_PRIORITY = ("threads", "group", "attention_chunk", "max_blocks", "unroll", "ept", "inflight", "preload")


def sweep_order(tuned: Sequence[tuple[str, tuple[Any, ...]]], first: int) -> list[int]:
    """The space indices of the template decisions ``tuned`` (from index ``first``), in the order the sweep
    times them: by :data:`SWEEP_PRIORITY` of their name, every GEMV's block size before any unroll, so that
    a budget smaller than the whole sweep spends itself on the decisions that measured to matter."""
    rank = {name: i for i, name in enumerate(SWEEP_PRIORITY)}
    return [first + i for i, _ in sorted(enumerate(tuned), key=lambda e: (
        rank.get(e[1][0].rsplit(".", 1)[-1], len(rank)), e[0]))]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


# ====================================================================== the measured compiler
TimerFactory = Callable[[TimerSetup], Callable[[Sequence[int]], float]]


class MeasuredCompiler:
    """``compile_group`` for :func:`~lum.builder.package_builder.build_package` (see the module docstring).

    ``timer_factory(setup) -> timer`` (default :class:`GpuTimer`; tests pass a fake) and ``device``
    (default: :func:`device_identity` of GPU 0) are injectable. After the build, :attr:`provenance`
    and :meth:`tuning_section` describe what was chosen; :meth:`kernel_tuning_for` gives a program's
    template parameters; :attr:`stats` counts DB hits, misses and timer calls (not in the package).
    """

    def __init__(self, spec: Any, options: Any, progress: ProgressFn | None = None, *,
                 db: TuningDB | None = None, timer_factory: TimerFactory | None = None,
                 device: DeviceIdentity | None = None, repeats: int = 10, warmup: int = 3):
        from lum.builder.package_builder import typical_dyn

        self.spec, self.options, self.progress = spec, options, progress
        self.db = db if db is not None else TuningDB()
        self.timer_factory = timer_factory or GpuTimer
        self.device = device if device is not None else device_identity()
        self.repeats, self.warmup = repeats, warmup
        self.groups = model_groups(spec)
        self.typical = typical_dyn(spec)
        self.fixed = dict(getattr(options, "kernel_tuning", {}) or {})
        self.tuning_decisions = tuple((k, v) for k, v in TUNING_DECISIONS if k not in self.fixed)
        self.records: list[dict] = []                # in compile order (= package group order)
        self._by_program: dict[int, dict] = {}
        self.stats = {"hits": 0, "misses": 0, "timer_calls": 0, "seconds_measuring": 0.0}
        self.provenance = {"extraction": "measured", "gpu": self.device.gpu, "driver": self.device.driver,
                           "tuning_budget": int(options.budget)}

    def _nvrtc(self) -> str:
        try:
            from lum.builder.nvrtc import nvrtc_version

            return "%d.%d" % nvrtc_version()
        except Exception:  # noqa: BLE001 - no NVRTC: the kernels could not be built anyway
            return "none"

    def group_tuning_decisions(self, n_gemv: int, flash: bool = False, split_k: bool = False
                               ) -> tuple[tuple[str, tuple[Any, ...]], ...]:
        """The template decisions of a group whose program has ``n_gemv`` GEMV kernels (and flash attention,
        and split-K decode attention)."""
        per = tuple((f"gemv{i}.{k}", v) for i in range(min(n_gemv, MAX_TUNED_GEMVS))
                    for k, v in GEMV_TUNING_DECISIONS if f"gemv{i}.{k}" not in self.fixed)
        fa = tuple((k, v) for k, v in FLASH_TUNING_DECISIONS if flash and k not in self.fixed)
        sk = tuple((k, v) for k, v in ATTENTION_TUNING_DECISIONS if split_k and k not in self.fixed)
        return self.tuning_decisions + fa + sk + per

    def key_options(self, time_dyn: Mapping[str, int],
                    decisions: Sequence[tuple[str, tuple[Any, ...]]] | None = None) -> dict[str, Any]:
        o = self.options
        decisions = self.tuning_decisions if decisions is None else decisions
        return {"dtype": self.spec.dtype.value, "target": o.target, "max_seq": int(self.spec.max_seq),
                "dyn": dict(sorted(time_dyn.items())), "kernel_tuning": {k: self.fixed[k] for k in sorted(self.fixed)},
                "tuning_space": [[k, list(v)] for k, v in decisions], "nvrtc": self._nvrtc(),
                "max_dyn": o.max_dyn, "gemv_prologues": gemv_prologues_enabled(),
                "gemv_epilogues": gemv_epilogues_enabled(),
                "gemv_inflight": gemv_inflight_default(), "gemv_preload": gemv_preload_default(),
                "gemv_balance": gemv_balance(),
                **({"gemv_preload_after_gemv": n} if (n := gemv_preload_after_gemv()) else {}),
                **({"gemv_tuning": {str(r): t for r, t in o.items()}} if (o := gemv_tuning_override()) else {}),
                **({"attention_chunk": c} if (c := attention_chunk_default()) != ATTENTION_CHUNK else {}),
                **({"gemv_preload_shared": m} if (m := gemv_preload_shared()) else {}),
                **({"gemv_prologue_narrow_a": m} if (m := gemv_prologue_narrow_a()) != "shared" else {}),
                **({"gemv_prologue_threads": t} if (t := gemv_prologue_threads()) != 1024 else {}),
                **({"gemv_prologue_pairs": m} if (m := gemv_prologue_pairs()) != "all" else {}),
                **({"switches": sw} if (sw := {k: v for k, d in KEY_SWITCHES.items()
                                              if (v := env_switch(k, default=d)) != d}) else {}),
                "flash_attention": flash_attention_enabled(),
                "sibling_kernels": sibling_kernels_enabled(),
                "row_reads": row_reads_enabled(),
                "prologue_max_cols": prologue_max_cols()}

    def __call__(self, graph: Graph) -> Program:
        from lum.builder.costmodel import op_cost
        from lum.builder.egraph import saturate
        from lum.builder.extract import choice_to_genome, choose_by_cost, decision_points, lower

        info = self.groups.get(_graph_key(graph))
        if info is None:     # not one of the spec's groups (a caller's own graph): no entry context
            info = GroupInfo(_standalone_hash(graph), graph)
        tune = getattr(self.options, "tune_entries", None)
        if tune is not None and info.entry not in tune:    # measured elsewhere: the cost model's program, no record
            from lum.builder.package_builder import cost_model_compiler

            return cost_model_compiler(self.spec)(graph)
        sat = saturate(graph)
        points = decision_points(sat)
        cost_choice = choose_by_cost(sat, lambda op: op_cost(op, self.typical))
        cost_program = lower(sat, cost_choice, name=graph.name)
        attention = [o for o in cost_program.ops if o.kind == "attention"]
        tuned = self.group_tuning_decisions(len(gemv_kernel_ops(cost_program)), any(map(flash_attention, attention)),
                                            not all(map(flash_attention, attention)))
        decisions = [Decision(name, labels) for name, labels in points]
        decisions += [Decision(f"tune:{k}", tuple("default" if x is None else str(x) for x in v)) for k, v in tuned]
        space = SearchSpace(decisions)
        described = [[d.name, list(d.options)] for d in space.decisions]
        time_dyn = {v: self.typical[v] for v in sorted(graph.dyn_vars) if v in self.typical}
        key = self.db.key(info.hash, self.device.gpu, self.device.driver, LUM_VERSION,
                          self.key_options(time_dyn, tuned))
        rec = self.db.get(key)
        if rec is not None and not self._usable(rec, space, described):
            rec = None
        if rec is not None:
            self.stats["hits"] += 1
        else:
            self.stats["misses"] += 1
            seed = choice_to_genome(sat, cost_choice) + (0,) * len(tuned)
            rec = self._measure(info, sat, space, described, time_dyn, seed, tuned, cost_program)
            self.db.put(key, rec)
            rec = self.db.get(key) or json.loads(json.dumps({**rec, "version": DB_VERSION, "key": key}))
        genome = tuple(rec["genome"])
        n = len(sat.decisions)
        choice = {c: int(x) for c, x in zip(sat.decisions, genome[:n])}
        program = lower(sat, choice, name=graph.name, **_lowering(rec.get("tuning", {})))
        self.records.append(rec)
        self._by_program[id(program)] = rec
        return program

    def _usable(self, rec: dict, space: SearchSpace, described: list) -> bool:
        if rec.get("decisions") != described:
            warnings.warn("lum: a tuning record's decision points no longer match the e-graph; measuring again",
                          stacklevel=3)
            return False
        if rec["budget"] < int(self.options.budget):
            return False          # searched with a smaller budget: search again (seeded with its best)
        try:
            space.validate(rec["genome"])
        except ValueError:
            return False
        return True

    def _measure(self, info: GroupInfo, sat: Any, space: SearchSpace, described: list,
                 time_dyn: dict[str, int], seed_genome: tuple[int, ...],
                 tuned: tuple[tuple[str, tuple[Any, ...]], ...], seed_program: Program) -> dict:
        """Search the group (``seed_program``: the seed genome's program, lowered already) and its record."""
        check_dyn = dict(time_dyn)
        try:
            if as_expr(seed_program.total_flops()).evaluate(time_dyn) > CHECK_FLOPS:
                check_dyn = {k: min(v, CHECK_DYN_MAX) for k, v in time_dyn.items()}
        except Exception:  # noqa: BLE001 - no estimate: check at the small map
            check_dyn = {k: min(v, CHECK_DYN_MAX) for k, v in time_dyn.items()}
        setup = TimerSetup(info, sat, space, tuned, time_dyn, check_dyn, int(self.spec.max_seq),
                           self.options.target, self.fixed, getattr(self.options, "nvrtc_cache", None),
                           self.repeats, self.warmup)
        budget = int(self.options.budget)
        label = f"tuning {len(self.records) + 1}/{len(self.groups) or '?'}"
        if self.progress:
            self.progress(label, 0, min(budget, space.size))

        def on_trial(p: SearchProgress) -> None:
            self.stats["timer_calls"] += 1
            if self.progress:
                self.progress(label, p.done, p.total)

        t0 = time.perf_counter()
        timer = self.timer_factory(setup)
        try:
            # the template decisions (each kernel's block size, split, loads ahead) first, one at a time
            # around the cost model's pick: they act nearly independently of each other
            result = search(space, timer, budget, seed=SEARCH_SEED, seed_genomes=[seed_genome], progress=on_trial,
                            sweep=sweep_order(tuned, len(space) - len(tuned)))
        finally:
            close = getattr(timer, "close", None)
            if close is not None:
                close()
        self.stats["seconds_measuring"] += time.perf_counter() - t0
        phases = getattr(timer, "seconds", None)       # GpuTimer's split of that time (a test's timer has none)
        trials = [{"genome_hash": t.genome_hash, "genome": list(t.genome), "time": t.time, "reason": t.reason,
                   "generation": t.generation} for t in result.evaluated]
        if result.best_genome is None:
            reasons = sorted({t.reason for t in result.evaluated if t.reason})
            warnings.warn(f"lum: every candidate of group {info.hash[:12]} was rejected ({'; '.join(reasons)[:300]}); "
                          "using the cost model's choice", stacklevel=3)
            genome, best, chosen_by = seed_genome, None, "cost-model (every candidate rejected)"
        else:
            genome, best, chosen_by = result.best_genome, result.best_time, "measured"
        return {"group": info.hash, "entry": info.entry, "decisions": described, "genome": list(genome),
                "genome_hash": genome_hash(genome), "tuning": _tuning_of(tuned, genome[len(sat.decisions):]),
                "time": best, "chosen_by": chosen_by, "budget": budget, "seed_genome": list(seed_genome),
                "time_dyn": time_dyn, "check_dyn": check_dyn, "repeats": self.repeats,
                "gpu": self.device.gpu, "driver": self.device.driver, "lum": LUM_VERSION, "trials": trials,
                "exhausted": result.exhausted,
                **({"seconds_by_phase": {k: round(v, 3) for k, v in phases.items()}} if phases else {})}

    # ------------------------------------------------------------------ what build_package asks
    def kernel_tuning_for(self, program: Program) -> dict[str, Any]:
        """Template parameters of a program this compiler returned (the user's fixed ones included)."""
        rec = self._by_program.get(id(program))
        return _codegen_tuning({**self.fixed, **(rec.get("tuning", {}) if rec else {})})

    def tuning_section(self, programs: Sequence[Program]) -> bytes:
        """The package's ``tuning`` section: the DB record of each group, in package group order."""
        groups = []
        for k, prog in enumerate(programs):
            rec = self._by_program.get(id(prog))
            if rec is not None:
                groups.append({"index": k, **{f: v for f, v in rec.items() if f != "key"}})
        return (_canonical({"version": DB_VERSION, "groups": groups}) + "\n").encode()


def measured_compiler(spec: Any, options: Any, progress: ProgressFn | None = None, **kwargs: Any) -> MeasuredCompiler:
    """The measured-search ``compile_group`` for ``spec`` (see :class:`MeasuredCompiler`)."""
    return MeasuredCompiler(spec, options, progress, **kwargs)
