"""``lum build``: compile a model's entry graphs group by group and write one ``.lumpkg``.

Per entry graph the HLIR is partitioned; groups are deduplicated across entries by structural hash
and compiled once each (e-graph saturation + extraction, see :mod:`lum.builder.compile`). Each chunk
of an entry becomes one *call* of its group's program, binding the program's inputs and outputs to
value names: graph inputs and weights by name, state by name, values crossing chunks as ``%<node>``.
Weights are streamed into raw, page-aligned sections (one per tensor) so the loader maps them in place.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from lum.builder.hlir import Graph
from lum.builder.models import ModelSpec
from lum.builder.partition import Chunk, chunk_graph, group_chunks, partition
from lum.format import __version__ as LUM_VERSION
from lum.format.dtypes import from_numpy
from lum.format.llir import Program
from lum.format.manifest import Call, Entry, GroupRef, Manifest, TensorSpec, WeightRef
from lum.format.package import PackageWriter

ProgressFn = Callable[[str, int, int], None]   # (stage, done, total)


@dataclass
class BuildOptions:
    target: str = "sm_90"
    budget: int = 0                   # measured-search evaluations per group (0: cost model only)
    tune_entries: tuple[str, ...] | None = None   # the entries whose groups are measured (None: all; others: cost model)
    compile_kernels: bool = True      # NVRTC cubins for the target (needs no GPU)
    provenance: dict = field(default_factory=dict)
    max_dyn: dict | None = None       # dyn bounds the kernels may assume (None: from max_seq, see kernels.py)
    kernel_tuning: dict = field(default_factory=dict)   # codegen keyword arguments for every kernel
    nvrtc_cache: Any = None           # NVRTC cache dir (None: the default on-disk cache, False: none)
    gemm_algos: bool = True           # time cuBLASLt's candidates per gemm when a GPU is here (gemm_algos.py)
    ptx: bool = True                  # PTX beside the cubins, for newer GPUs (a measured-search candidate runs
                                      # here only: without it NVRTC runs once a candidate, not twice)


@dataclass
class BuildReport:
    path: Path
    groups: int
    calls: dict[str, int]
    seconds: dict[str, float]
    bytes: int


def _value_name(graph: Graph, node: int) -> str:
    n = graph.nodes[node]
    return n.attrs["name"] if n.op == "Input" else f"%{node}"


def _io_nodes(g: Graph) -> tuple[list, list]:
    return [n for n in g.nodes if n.op == "Input"], [n for n in g.nodes if n.op == "Output"]


def _bind(graph: Graph, chunk: Chunk, cg: Graph, rep_cg: Graph, program: Program) -> Call:
    """The call of ``program`` (compiled from ``rep_cg``) for ``chunk`` (standalone graph ``cg``)."""
    rep_in, rep_out = _io_nodes(rep_cg)
    my_in, my_out = _io_nodes(cg)
    pos_in = {n.attrs["name"]: k for k, n in enumerate(rep_in)}
    pos_out = {n.attrs["name"]: k for k, n in enumerate(rep_out)}
    inputs = []
    for op in program.inputs():
        node = my_in[pos_in[op.params["name"]]]
        name = node.attrs["name"]
        if node.attrs["role"] == "ext":
            name = _value_name(graph, chunk.input_nodes[int(name[3:])])
        inputs.append(name)
    outputs = []
    for op in program.outputs():
        node = my_out[pos_out[op.params["name"]]]
        name = node.attrs["name"]
        if node.attrs["role"] == "output" and name.startswith("out") and name[3:].isdigit():
            name = _value_name(graph, chunk.outputs[int(name[3:])])
        outputs.append(name)
    return Call(-1, tuple(inputs), tuple(outputs))


def plan_model(spec: ModelSpec, compile_group: Callable[[Graph], Program],
               progress: ProgressFn | None = None) -> tuple[list[str], list[Program], dict[str, Entry]]:
    """Compile every distinct group once; return group hashes, their programs and the entry plans."""
    hashes: list[str] = []
    programs: list[Program] = []
    counts: list[int] = []
    entries: dict[str, Entry] = {}
    work = []
    for ename, graph in spec.graphs.items():
        chunks = partition(graph)
        work.append((ename, graph, chunks, group_chunks(graph, chunks)))
    total = len({g.hash for _, _, _, groups in work for g in groups})
    for ename, graph, chunks, groups in work:
        calls: list[Call | None] = [None] * len(chunks)
        for grp in groups:
            rep_cg = chunk_graph(graph, grp.representative)
            if grp.hash not in hashes:
                if progress:
                    progress("compile", len(hashes), total)
                hashes.append(grp.hash)
                programs.append(compile_group(rep_cg))
                counts.append(0)
            gi = hashes.index(grp.hash)
            for ci in grp.chunks:
                cg = rep_cg if ci == grp.representative.index else chunk_graph(graph, chunks[ci])
                call = _bind(graph, chunks[ci], cg, rep_cg, programs[gi])
                calls[ci] = Call(gi, call.inputs, call.outputs)
                counts[gi] += 1
        inputs = tuple(TensorSpec(n.attrs["name"], n.shape, n.dtype) for n in graph.inputs("input"))
        outputs = tuple(TensorSpec(n.attrs["name"], n.shape, n.dtype) for n in graph.outputs("output"))
        entries[ename] = Entry(ename, tuple(sorted(graph.dyn_vars)), inputs, outputs, tuple(calls))
    if progress:
        progress("compile", total, total)
    return hashes, programs, entries


def typical_dyn(spec: ModelSpec) -> dict[str, int]:
    """Dyn values the cost model plans for: a 512-token prompt and a half-full cache (within max_seq)."""
    return {"s": max(1, min(512, spec.max_seq)), "p": max(0, spec.max_seq // 2)}


def cost_model_compiler(spec: ModelSpec) -> Callable[[Graph], Program]:
    """Compile each group by the roofline cost model at :func:`typical_dyn` sizes (no GPU needed)."""
    from lum.builder.compile import compile_group
    from lum.builder.costmodel import op_cost

    dyn = typical_dyn(spec)
    return lambda g: compile_group(g, cost_fn=lambda op: op_cost(op, dyn))[0]


def _default_compiler(spec: ModelSpec, options: BuildOptions,
                      progress: ProgressFn | None) -> Callable[[Graph], Program]:
    """Measured search (:mod:`lum.builder.tuning`) when ``options.budget`` > 0 and a GPU of the target
    is here; otherwise the cost model (with a warning when a budget was asked for)."""
    if options.budget > 0:
        from lum.builder.tuning import gpu_unavailable_reason, measured_compiler

        reason = gpu_unavailable_reason(options.target)
        if reason is None:
            return measured_compiler(spec, options, progress)
        import warnings

        warnings.warn(f"lum: measured search skipped: {reason}; extracting with the cost model", stacklevel=3)
    return cost_model_compiler(spec)


def build_package(spec: ModelSpec, out: str | Path, compile_group: Callable[[Graph], Program] | None = None,
                  options: BuildOptions | None = None, tokenizer_json: str | None = None,
                  progress: ProgressFn | None = None) -> Path:
    """Compile ``spec`` and write the package atomically to ``out``."""
    options = options or BuildOptions()
    compiler = compile_group or _default_compiler(spec, options, progress)
    hashes, programs, entries = plan_model(spec, compiler, progress)
    # measured search (lum.builder.tuning): per-group template parameters, the tuning log, provenance
    measured = getattr(compiler, "tuning_section", None) is not None
    measured_prov = dict(compiler.provenance) if measured else {}
    group_tuning = [compiler.kernel_tuning_for(p) for p in programs] if measured else None
    extraction = "measured" if options.budget and (measured or compile_group is not None) else "cost-model"
    w = PackageWriter()
    groups = []
    kernel_info: dict[str, str] = {}
    if options.compile_kernels:
        tables, kernel_info = _compile_kernels(w, programs, entries, spec.max_seq, options, progress, group_tuning,
                                               set(spec.weights.names()))
    lt_version = None
    if options.compile_kernels and options.gemm_algos:
        from lum.builder.gemm_algos import tune_gemm_algos

        lt_version = tune_gemm_algos(programs, tables, typical_dyn(spec), options.target)
    if measured:
        w.add_section("tuning", compiler.tuning_section(programs), kind="tuning", required=False)
    for k, (h, prog) in enumerate(zip(hashes, programs)):
        section = f"llir/{k}"
        w.add_section(section, prog.dumps().encode(), kind="llir")
        n_calls = sum(1 for e in entries.values() for c in e.calls if c.group == k)
        groups.append(GroupRef(h, section, n_calls, tables[k] if options.compile_kernels else {}))
    weights = {}
    names = list(spec.weights.names())
    shapes = spec.config.graph_weight_shapes()
    for i, name in enumerate(names):
        shape = shapes[name]
        section = f"weight/{name}"
        nbytes = int(np.prod(shape)) * spec.dtype.itemsize
        w.add_section(section, _weight_chunks(spec, name), codec="none", length=nbytes, kind="weight")
        weights[name] = WeightRef(name, section, tuple(shape), spec.dtype)
    if tokenizer_json is not None:
        w.add_section("tokenizer", tokenizer_json.encode(), kind="tokenizer")
    state = {}
    for g in spec.graphs.values():
        for n in g.inputs("state"):
            state[n.attrs["name"]] = TensorSpec(n.attrs["name"], n.shape, n.dtype)
    cfg = spec.config
    manifest = Manifest(
        model={"name": spec.name, "arch": cfg.arch, "dtype": spec.dtype.value, "max_seq": spec.max_seq,
               "vocab_size": cfg.vocab_size, "param_count": spec.param_count, "config": cfg.to_hf_dict()},
        target={"sm": options.target, **({"nvrtc": kernel_info["nvrtc"]} if kernel_info else {}),
                **({"cublaslt_version": lt_version} if lt_version is not None else {})},
        provenance={"lum": LUM_VERSION, "python": platform.python_version(), "numpy": np.__version__,
                    "source": spec.source, "extraction": extraction,
                    **_tool_versions(), **kernel_info, **measured_prov, **_build_switches(), **options.provenance},
        groups=groups, entries=entries, state=state, weights=weights,
        tokenizer="tokenizer" if tokenizer_json is not None else None,
        generation={"bos_token_id": cfg.bos_token_id, "eos_token_ids": list(cfg.eos_token_id)},
    )
    w.set_manifest(manifest.to_json())
    return w.write(out, (lambda done, total: progress("write", 100 * done // max(total, 1), 100)) if progress else None)


def _compile_kernels(w: PackageWriter, programs: list[Program], entries: dict[str, Entry], max_seq: int,
                     options: BuildOptions, progress: ProgressFn | None,
                     group_tuning: list[dict] | None = None, weight_names: set[str] | None = None
                     ) -> tuple[list[dict], dict[str, str]]:
    """NVRTC-compile every group's kernels (one module each) into sections ``cubin/<k>`` (raw, so the
    loader hands the mapped bytes to the driver) and ``ptx/<k>`` (zstd, optional: only a newer GPU
    needs it); returns each group's launch table and the provenance entries. ``weight_names``: the
    package's weights, so that kernels know which inputs every call binds to a weight."""
    from lum.builder.kernels import compile_group_kernels, default_max_dyn, program_dyn_vars

    # one slot order for the whole package: every group's kernels read the same device dyn buffer
    dyn_vars = sorted(set(program_dyn_vars(programs)) | {d for e in entries.values() for d in e.dyn})
    max_dyn = options.max_dyn if options.max_dyn is not None else default_max_dyn(dyn_vars, max_seq)
    tables = []
    version = ""
    for k, prog in enumerate(programs):
        if progress:
            progress("kernels", k, len(programs))
        gk = compile_group_kernels(prog, arch=options.target, dyn_vars=dyn_vars, max_dyn=max_dyn,
                                   tuning=options.kernel_tuning if group_tuning is None else group_tuning[k],
                                   ptx=options.ptx, cache_dir=options.nvrtc_cache,
                                   weights=_weight_inputs(prog, k, entries, weight_names or set()))
        version = gk.nvrtc
        table = dict(gk.table)
        table["cubin"] = table["ptx"] = None
        if gk.cubin is not None:
            table["cubin"] = f"cubin/{k}"
            w.add_section(table["cubin"], gk.cubin, codec="none", kind="cubin")
            if gk.ptx:
                table["ptx"] = f"ptx/{k}"
                w.add_section(table["ptx"], gk.ptx.encode(), kind="ptx", required=False)
        tables.append(table)
    if progress:
        progress("kernels", len(programs), len(programs))
    return tables, ({"nvrtc": version} if version else {})


def _weight_chunks(spec: ModelSpec, name: str):
    def gen():
        arr = np.asarray(spec.weights.get(name))
        yield np.ascontiguousarray(arr.astype(spec.dtype.np, copy=False))
    return gen


def _tool_versions() -> dict[str, str]:
    out = {}
    for mod in ("egglog",):
        m = sys.modules.get(mod)
        try:
            from importlib.metadata import version
            out[mod] = version(mod)
        except Exception:  # noqa: BLE001 - provenance is best effort
            if m is not None:
                out[mod] = getattr(m, "__version__", "unknown")
    return out


def _build_switches() -> dict[str, str]:
    """The ``LUM_*`` environment the build ran under (codegen's kernel switches, a stamped probe build's
    ``LUM_STAMPS``), as one provenance entry that ``lum inspect`` prints; none when nothing is set. Paths
    (``LUM_CACHE_DIR``) are left out: they do not change what is built."""
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("LUM_") and k != "LUM_CACHE_DIR")
    return {"switches": " ".join(f"{k}={v}" for k, v in env)} if env else {}


def _weight_inputs(prog: Program, group: int, entries: dict[str, Entry], weight_names: set[str]) -> frozenset[int]:
    """The op ids of ``prog``'s inputs that every call of ``group`` binds to a weight."""
    calls = [c for e in entries.values() for c in e.calls if c.group == group]
    ins = prog.inputs()
    return frozenset(op.id for j, op in enumerate(ins)
                     if calls and all(j < len(c.inputs) and c.inputs[j] in weight_names for c in calls))


def write_program_package(out: str | Path, programs: list[Program], entries: dict[str, Entry], *,
                          weights: dict[str, np.ndarray] | None = None, state: dict[str, TensorSpec] | None = None,
                          model: dict | None = None, options: BuildOptions | None = None) -> Path:
    """A package from hand-made LLIR programs (no frontend, no e-graph): kernel tests and tools that
    want to run a specific program through the loaders. ``entries`` call ``programs`` by index;
    ``weights`` become raw weight sections; ``state`` declares state tensors; ``model`` (e.g.
    ``{"max_seq": 64}``) bounds the kernels' dyn vars as for a model."""
    options = options or BuildOptions()
    model = dict(model or {})
    w = PackageWriter()
    tables: list[dict] = [{} for _ in programs]
    kernel_info: dict[str, str] = {}
    if options.compile_kernels:
        tables, kernel_info = _compile_kernels(w, programs, entries, int(model.get("max_seq", 0) or 0), options, None)
    groups = []
    for k, prog in enumerate(programs):
        w.add_section(f"llir/{k}", prog.dumps().encode(), kind="llir")
        n_calls = sum(1 for e in entries.values() for c in e.calls if c.group == k)
        groups.append(GroupRef(f"program-{k}", f"llir/{k}", max(n_calls, 1), tables[k]))
    wrefs = {}
    for name, arr in (weights or {}).items():
        arr = np.ascontiguousarray(arr)
        w.add_section(f"weight/{name}", arr.tobytes(), codec="none", kind="weight")
        wrefs[name] = WeightRef(name, f"weight/{name}", tuple(arr.shape), from_numpy(arr.dtype))
    manifest = Manifest(
        model={"name": "programs", **model},
        target={"sm": options.target, **({"nvrtc": kernel_info["nvrtc"]} if kernel_info else {})},
        provenance={"lum": LUM_VERSION, "source": "programs", **kernel_info, **_build_switches(),
                    **options.provenance},
        groups=groups, entries=entries, state=dict(state or {}), weights=wrefs)
    w.set_manifest(manifest.to_json())
    return w.write(out)
