"""A group's kernels, built: every kernel op of its LLIR program through codegen, one NVRTC module.

    gk = compile_group_kernels(program, arch="sm_90", dyn_vars=["p", "s"], max_dyn={"p": 64, "s": 64})
    gk.cubin, gk.ptx          # for sections cubin/<k> (raw) and ptx/<k> (zstd)
    gk.table                  # the launch table, stored as the manifest's groups[k].kernels

One module per group (not per kernel) because an NVRTC call costs ~0.25 s whatever its size, and
because a loaded module is the unit the loader keeps per session. NVRTC needs no GPU, so a package
built on a CPU box carries real cubins for its target (plus PTX, which a newer driver can JIT).
Compiles go through :func:`lum.builder.nvrtc.compile_cuda`'s on-disk cache keyed by source hash,
so rebuilding a model (or the test suite) re-runs NVRTC only for groups whose kernels changed.

The launch table (schema in :mod:`lum.format.manifest`) is everything the loader needs to launch a
kernel op without codegen: kernel names, grid expressions as text, block, dynamic shared memory,
the parameter order (``out, in0 … in{n-1}, dyn`` — ``inK`` is the buffer of ``op.args[K]`` — then,
for a kernel that runs other ops' bodies too (siblings, an attention stage: :mod:`lum.builder.fused`),
``out@T, in0@T …`` per such tail op ``T``), the dyn-buffer slot order, the dyn bounds the index arithmetic
assumes, and the tuning parameters used.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from lum.builder.codegen import KernelSource, generate_program, module_source
from lum.builder.env_switches import env_switch
from lum.builder.gemv_policy import SMS, blocks_unbalanced, gemv_kernel_ops, gemv_tile_a_block
from lum.format.expr import as_expr
from lum.format.llir import LOp, Program
from lum.format.manifest import CLUSTER_TABLE_VERSION, KERNEL_TABLE_VERSION, TAIL_TABLE_VERSION

__all__ = ["KERNEL_TABLE_VERSION", "TAIL_TABLE_VERSION",
           "GroupKernels", "launch_table", "group_kernel_sources", "compile_group_kernels", "program_dyn_vars",
           "default_max_dyn"]


@dataclass
class GroupKernels:
    """One group's compiled kernels. ``cubin`` and ``ptx`` are None when the group has no kernel op
    (only library calls and inputs/outputs): it then gets no sections and a table with no ops."""

    table: dict[str, Any]
    cubin: bytes | None
    ptx: str | None
    source: str
    nvrtc: str
    seconds: float = 0.0                 # NVRTC wall time (0 when every compile hit the cache)
    cached: bool = False
    sources: dict[int, KernelSource] = field(default_factory=dict, repr=False)


def program_dyn_vars(programs: Iterable[Program]) -> list[str]:
    """Every dyn var the programs mention (shapes, views, params), sorted: the package-wide slot order."""
    names: set[str] = set()
    for program in programs:
        names |= program.dyn_vars()
    return sorted(names)


def default_max_dyn(dyn_vars: Sequence[str], max_seq: int | None) -> dict[str, int]:
    """Bounds the kernels' index arithmetic may assume (32-bit indexing where they make it fit).

    Only the LLM vars whose meaning lum defines are bounded: ``s`` (prompt length) ≤ max_seq and
    ``p`` (past length) < max_seq. Any other var stays unbounded (64-bit indexing). The loader
    refuses dyn values beyond these bounds, so a bound is a promise, not a hint."""
    if not max_seq:
        return {}
    known = {"s": int(max_seq), "p": int(max_seq)}
    return {v: known[v] for v in dyn_vars if v in known}


def launch_table(program: Program, sources: Mapping[int, KernelSource | None], *, arch: str,
                 dyn_vars: Sequence[str], max_dyn: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The JSON launch table of a program's kernel ops (pure: no NVRTC). Section names (``cubin``,
    ``ptx``) are left for the package builder to fill in."""
    ops = []
    by_id = {op.id: op for op in program.ops}
    for op in program.ops:
        ks = sources.get(op.id)
        if ks is None:
            continue
        if tuple(ks.dyn_vars) != tuple(dyn_vars):
            raise ValueError(f"op {op.id}: kernel compiled for dyn slots {list(ks.dyn_vars)}, not {list(dyn_vars)}")
        params = [p.name for p in ks.params]
        want = ["out"] + [f"in{k}" for k in range(len(op.args))] + ["dyn"]
        for j, t in enumerate(ks.tails):
            want += [f"t{j}_out"] + [f"t{j}_in{k}" for k in range(len(by_id[t].args))]
        if params != want:
            raise ValueError(f"op {op.id}: kernel parameters {params} do not follow the convention {want}")

        def table_name(p: str) -> str:      # a tail op T's parameter t<j>_x as the table names it: x@T
            return re.sub(r"^t(\d+)_(.*)$", lambda m: f"{m.group(2)}@{ks.tails[int(m.group(1))]}", p)

        entry = {
            "op": op.id, "kind": op.kind, "name": ks.name,
            "launches": [lc.to_json() for lc in ks.launches],
            "params": [table_name(p) for p in params],
            "dyn_slots": dict(ks.dyn_slots),
            "tuning": {k: v for k, v in sorted(ks.tuning.items())},
        }
        if ks.tails:
            entry["tail"] = list(ks.tails)
        if ks.early:
            entry["early"] = [table_name(p) for p in ks.early]
        ops.append(entry)
    waiting = {ks.name: _waits(ks) for ks in sources.values() if ks is not None}
    if any(waiting.values()) and not all(waiting.values()):     # one kernel costs the table every overlap
        late = sorted(name for name, w in waiting.items() if not w)
        warnings.warn(f"lum: {', '.join(late)} access memory before waiting for the kernel before them, so this "
                      f"group's {len(waiting)} kernels launch without programmatic dependent launch", stacklevel=2)
    version = (CLUSTER_TABLE_VERSION if any("cluster" in lc for o in ops for lc in o["launches"])
               else TAIL_TABLE_VERSION if any("tail" in o for o in ops) else KERNEL_TABLE_VERSION)
    return {"version": version, "arch": arch, "dyn_vars": list(dyn_vars),
            "max_dyn": {k: int(v) for k, v in sorted((max_dyn or {}).items())}, "ops": ops,
            "programmatic": all(waiting.values())}


_FIRST_CALL = re.compile(r"\)\s*\{\s*(\w+)\(")


def _waits(ks: KernelSource) -> bool:
    """Every kernel entry of ``ks`` waits for its predecessor on the device (codegen's preamble, or gemv.cu's
    own wait after its preload), so the loader may launch it with programmatic stream serialization. An
    entry whose first statement calls a device function of the body that waits counts too: an attention
    kernel with its stage, whose body waits before any global access."""
    parts = ks.body.split('extern "C" __global__')
    entries, before = parts[1:], parts[0]

    def waits(entry: str) -> bool:
        if "lum_pdl_wait();" in entry:
            return True
        m = _FIRST_CALL.search(entry)
        if m is None:
            return False
        fn = re.search(r"__device__[^(]*\b" + re.escape(m.group(1)) + r"\(", before)
        return fn is not None and "lum_pdl_wait();" in before[fn.end():].split("__device__", 1)[0]

    return bool(entries) and len(entries) == len(ks.launches) and all(waits(e) for e in entries)


def group_kernel_sources(program: Program, dyn_vars: Sequence[str], max_dyn: Mapping[str, int] | None = None,
                         tuning: Mapping[str, Any] | None = None, *, arch: str = "sm_90",
                         cache_dir: Any = None, weights: frozenset[int] = frozenset()) -> dict[int, KernelSource]:
    """Every kernel of a group: :func:`~lum.builder.codegen.generate_program` with ``tuning`` and ``weights``
    (the program's input ops that are weights, for kernels that read them early) (less the GEMV loads ahead that
    would spill: :func:`_loads_ahead_without_spills`; prologue and preloading GEMVs in one wave by their
    registers: :func:`_grids_in_one_wave`), with ``$LUM_ATTENTION_STAGE`` each decode attention computing its q
    rows and kv-cache writes (:mod:`lum.builder.attention_stage`), with ``$LUM_O_COMBINE`` each combine and the
    o split by head after it as one (:mod:`lum.builder.o_combine`), with ``$LUM_SIBLING_KERNELS`` independent
    small kernels in a row as one (:mod:`lum.builder.siblings`)."""
    from lum.builder.attention_stage import attention_stage_enabled, fuse_attention_stages
    from lum.builder.o_combine import fuse_o_combines, o_combine_enabled
    from lum.builder.siblings import fuse_siblings, sibling_kernels_enabled

    tuning, gen = _kernels_in_registers(program, dyn_vars, max_dyn, tuning, arch, cache_dir, weights)
    if attention_stage_enabled():
        gen = fuse_attention_stages(program, gen, dyn_vars, max_dyn, tuning)
    if o_combine_enabled():
        gen = fuse_o_combines(program, gen, dyn_vars, max_dyn, arch)
    if sibling_kernels_enabled():
        gen = fuse_siblings(program, gen, dyn_vars, max_dyn, tuning)
    return {i: ks for i, ks in gen.items() if ks is not None}


def _kernels_in_registers(program: Program, dyn_vars: Sequence[str], max_dyn: Mapping[str, int] | None,
                          tuning: Mapping[str, Any] | None, arch: str, cache_dir: Any, weights: frozenset[int]
                          ) -> tuple[dict[str, Any], dict[int, KernelSource | None]]:
    """(``tuning``, the program's kernels): :func:`_loads_ahead_without_spills`, then
    :func:`_grids_in_one_wave`, whose capped prologue GEMVs may walk tiles with their preload in registers,
    which must not spill either (gemv_policy.prologue_walks_tiles)."""
    tuning, gen = _loads_ahead_without_spills(program, dyn_vars, max_dyn, dict(tuning or {}), arch, cache_dir,
                                              weights)
    capped, capped_gen = _grids_in_one_wave(program, dyn_vars, max_dyn, tuning, gen, arch, cache_dir, weights)
    if any(ks is not None and ks.tuning.get("preload_shared") and not capped_gen[i].tuning.get("preload_shared")
           for i, ks in gen.items()):
        return _loads_ahead_without_spills(program, dyn_vars, max_dyn, capped, arch, cache_dir, weights)
    return capped, capped_gen


def _loads_ahead_without_spills(program: Program, dyn_vars: Sequence[str], max_dyn: Mapping[str, int] | None,
                                tuning: dict[str, Any], arch: str, cache_dir: Any, weights: frozenset[int] = frozenset()
                                ) -> tuple[dict[str, Any], dict[int, KernelSource | None]]:
    """(``tuning``, the program's kernels with it), ``gemv<i>.inflight`` or ``gemv<i>.preload`` halved (down
    to 0, the plain loop) for every decode GEMV whose loads issued ahead or preloaded would spill (``ptxas
    -v`` of those GEMVs through NVRTC): a spill costs more than the loads in flight gain, and how many
    registers they take is ptxas's to say, not a formula's (a preload of 8 in gemma3-4b's qkv GEMV, 1,024
    threads and so 64 registers at most, spilled 604 bytes a thread). A preload is halved too where its
    registers leave an SM fewer than :data:`PRELOAD_MIN_THREADS` resident threads: the preload covers the
    first tiles, the occupancy it costs slows every tile (gemma3-4b's gate-up at 4 vectors a lane took 128
    registers, 512 threads an SM, and the step measured 11% slower); and where those registers leave the
    SMs too few blocks for the GEMV's grid to run as evenly as codegen sized it (:func:`_waves_unbalanced`).
    Unchanged without NVRTC."""
    from lum.builder import nvrtc

    ranks = {o.id: i for i, o in enumerate(gemv_kernel_ops(program))}
    while True:                  # ends: each round halves a positive inflight or preload of some GEMV
        gen = generate_program(program, dyn_vars, max_dyn=dict(max_dyn or {}) or None, weights=weights,
                               resident=lambda ks: _resident(ks, arch, cache_dir), **tuning)
        ahead = {ks.name: (ranks[i], knob, ks.tuning[knob]) for i, ks in gen.items() if i in ranks and ks is not None
                 for knob in ("inflight", "preload") if ks.tuning.get(knob)}
        if not ahead:
            return tuning, gen
        log = _ptxas_log([gen[i] for i in ranks if gen[i] is not None and gen[i].name in ahead], arch, cache_dir)
        if log is None:
            return tuning, gen
        regs = nvrtc.ptxas_registers(log)
        by_name = {ks.name: ks for ks in gen.values() if ks is not None and ks.name in ahead}
        resident = {name: resident_blocks(ks.block[0], regs[name], ks.shared_mem) for name, ks in by_name.items()
                    if name in regs}
        whole = {gen[i].name for i in ranks if gen[i] is not None and gen[i].name in resident
                 and _preloads_everything(program.ops[i], gen[i], SMS * resident[gen[i].name])}
        crowded = [name for name, (_, knob, _) in ahead.items() if knob == "preload" and name in resident
                   and ((resident[name] * by_name[name].block[0] < PRELOAD_MIN_THREADS and name not in whole)
                        or _waves_unbalanced(by_name[name], SMS * resident[name])
                        or _shared_preload_past_one_wave(by_name[name], SMS * resident[name]))]
        spilled = [ahead[name] for name in {*nvrtc.ptxas_spills(log), *crowded} if name in ahead]
        if not spilled:
            return tuning, gen
        groups = {name: f"gemv{ahead[name][0]}.group" for name in crowded}
        narrowed = {groups[name]: by_name[name].tuning["group"] // 2 for name in crowded
                    if _narrow_to_one_wave(by_name[name], SMS * resident[name], groups[name] in tuning)}
        if narrowed:             # fewer, longer columns a block first; the preload stays whole
            tuning = {**tuning, **narrowed}
            continue
        tuning = {**tuning, **{f"gemv{rank}.{knob}": count // 2 for rank, knob, count in spilled}}


def _waves_unbalanced(ks: KernelSource, wave: int) -> bool:
    """A GEMV without a prologue whose static grid is more than ``wave`` blocks (what the SMs hold at its
    registers) and would, capped there (:func:`_grids_in_one_wave`), give some blocks a tile more than others
    by over a tenth of the average (:func:`~lum.builder.gemv_policy.blocks_unbalanced` over the wave).
    gemma3-4b's down projection (1,280 blocks of 128 threads, all resident without a preload) held 1,056 at a
    preload of 2: 224 blocks walked two tiles, and the kernel took 21.3 µs against 14.2 (profile, e827744); the
    step lost 7.4%."""
    if ks.tuning.get("prologue") or not ks.grid[0].is_const:
        return False
    blocks = ks.grid[0].value
    return blocks > wave and blocks_unbalanced(blocks, wave)


def _preloads_everything(op: LOp, ks: KernelSource, wave: int) -> bool:
    """A GEMV whose shared preload holds every weight vector its blocks read (each lane's whole column of k,
    one tile a block, the grid within one ``wave``): after its wait it streams nothing, so the few threads
    an SM its shared memory leaves resident cost it no bandwidth (:data:`PRELOAD_MIN_THREADS` does not apply;
    gemma3-4b's qkv in column pairs, 512 threads and 160 KB a block)."""
    t, k = ks.tuning, as_expr(op.params["k"])
    if not (t.get("preload_shared") and ks.grid[0].is_const and k.is_const) or ks.grid[0].value > wave:
        return False
    return t["preload"] * t["group"] * t["vec"] >= k.value and bool(gemv_tile_a_block(op, ks))


def _shared_preload_past_one_wave(ks: KernelSource, wave: int) -> bool:
    """A GEMV without a prologue that preloads into shared memory and whose static grid is more blocks than
    the SMs hold at once (``wave``). Capped to one wave, its blocks would walk the grid's tiles in a loop and
    only the first tile of each is preloaded: gemma3-4b's gate-up (5,120 blocks of 128 threads) went to 1,320
    under ``$LUM_GEMV_PRELOAD_SHARED=small``, which measured −4.2% (6214d7f), and keeping the grid with half
    the tile preloaded (a switch since removed) −4.9% (0b671ce). So such a preload is halved until it is gone."""
    if not ks.tuning.get("preload_shared") or ks.tuning.get("prologue") or not ks.grid[0].is_const:
        return False
    return ks.grid[0].value > wave


def _narrow_to_one_wave(ks: KernelSource, wave: int, group_set: bool) -> bool:
    """A shared-preload GEMV past one ``wave`` (:func:`_shared_preload_past_one_wave`) by less than half, whose
    column group its tuning does not set and can halve (to a warp a column): halved, its grid has half the
    blocks, each a lane's column twice as long, and may then hold its whole preload in one wave, where
    halving the preload would drop it. gemma3-4b's qkv without a prologue (``norms_ahead``): 512 blocks of
    512 threads, 3 resident an SM (396), became 256 blocks preloading all 10 vectors a lane (80 KB)."""
    group = ks.tuning.get("group", 0)
    return (not group_set and group >= 64 and _shared_preload_past_one_wave(ks, wave)
            and ks.grid[0].value <= 2 * wave)


ENV_PROLOGUE_ONE_WAVE = "LUM_GEMV_PROLOGUE_ONE_WAVE"
PRELOAD_MIN_THREADS = 1024     # resident threads an SM a preloading GEMV's registers must leave (of 2,048)


SM_SHARED_MEM = 228 * 1024      # shared memory an SM of sm_90 holds for its blocks, 1 KB of it reserved a block


def resident_blocks(threads: int, registers: int, shared_mem: int = 0) -> int:
    """Blocks of ``threads`` threads taking ``registers`` each and ``shared_mem`` bytes of dynamic shared memory
    (a shared preload's) that one SM of sm_90 holds at once: 2,048 threads, 65,536 registers (allocated 8 a
    thread at a time, 256 a warp) and :data:`SM_SHARED_MEM` an SM."""
    by_smem = SM_SHARED_MEM // (shared_mem + 1024) if shared_mem else 32
    return max(1, min(2048 // threads, 65536 // (-(-registers // 8) * 8 * threads), by_smem))


def _grids_in_one_wave(program: Program, dyn_vars: Sequence[str], max_dyn: Mapping[str, int] | None,
                       tuning: dict[str, Any], gen: dict[int, KernelSource | None], arch: str, cache_dir: Any,
                       weights: frozenset[int] = frozenset()
                       ) -> tuple[dict[str, Any], dict[int, KernelSource | None]]:
    """(``tuning``, the kernels), each GEMV with a prologue (every block computes all of A) or a preload (each
    block's first tile loaded before the wait) capped at the blocks the SMs hold at once by its registers
    (``ptxas -v``), unless the tuning caps it itself.
    codegen sizes a prologue GEMV's grid to one wave of 2,048 threads an SM, which ptxas's register count may
    not allow: llama3-1b's gate-up (1,024 threads, 44 registers) fits one block an SM, so its 256 blocks ran
    in two waves, each block redoing the norm (the measured search's 132 was its decoder layer's largest
    gain, 137a162). A preload pays only in blocks that are resident while the kernel before still runs, and
    the registers it holds lower how many are: in one wave every block's first tile is preloaded, and the
    tiles after it are walked grid-stride. Unchanged without NVRTC; prologue GEMVs unchanged with
    ``$LUM_GEMV_PROLOGUE_ONE_WAVE=0``."""
    from lum.builder import nvrtc

    if "max_blocks" in tuning:
        return tuning, gen
    prologues = env_switch(ENV_PROLOGUE_ONE_WAVE, default=True)
    ranks = {o.id: i for i, o in enumerate(gemv_kernel_ops(program))}
    heads = {i: ks for i, ks in gen.items() if i in ranks and ks is not None
             and ((prologues and ks.tuning.get("prologue")) or ks.tuning.get("preload"))
             and f"gemv{ranks[i]}.max_blocks" not in tuning and ks.grid[0].is_const}
    if not heads:
        return tuning, gen
    log = _ptxas_log(list(heads.values()), arch, cache_dir)
    if log is None:
        return tuning, gen
    regs = nvrtc.ptxas_registers(log)
    caps = {}
    for i, ks in heads.items():
        cap = SMS * resident_blocks(ks.block[0], regs[ks.name], ks.shared_mem) if ks.name in regs else ks.grid[0].value
        if ks.grid[0].value > cap:
            caps[f"gemv{ranks[i]}.max_blocks"] = cap
    if not caps:
        return tuning, gen
    tuning = {**tuning, **caps}
    return tuning, generate_program(program, dyn_vars, max_dyn=dict(max_dyn or {}) or None, weights=weights, **tuning)


def _resident(ks: KernelSource, arch: str, cache_dir: Any) -> int | None:
    """The blocks an SM ``ks`` holds by its registers and shared memory (ptxas); None without NVRTC."""
    from lum.builder import nvrtc

    log = _ptxas_log([ks], arch, cache_dir)
    regs = nvrtc.ptxas_registers(log).get(ks.name) if log is not None else None
    return None if regs is None else resident_blocks(ks.block[0], regs, ks.shared_mem)


def _ptxas_log(kernels: list[KernelSource], arch: str, cache_dir: Any) -> str | None:
    """The ``ptxas -v`` log of these kernels compiled as one module for ``arch``; None without NVRTC. Never
    stamped (``$LUM_STAMPS``): a probe build must choose the kernels a plain build chooses."""
    from lum.builder import nvrtc

    try:
        return nvrtc.compile_cuda(module_source(kernels, stamps=False), arch, name="ptxas.cu", ptx=False,
                                  extra_options=["--ptxas-options=-v"], cache_dir=cache_dir).log
    except nvrtc.NvrtcNotFound:
        return None


def compile_group_kernels(program: Program, *, arch: str = "sm_90", dyn_vars: Sequence[str] | None = None,
                          max_dyn: Mapping[str, int] | None = None, tuning: Mapping[str, Any] | None = None,
                          ptx: bool = True, cache_dir: Any = None, weights: frozenset[int] = frozenset()
                          ) -> GroupKernels:
    """Generate every kernel op of ``program`` and compile them as one NVRTC module for ``arch``.

    ``dyn_vars``: the dyn-buffer slot order (default: the program's own vars, sorted; a package
    passes one order for all its groups so one device buffer serves every launch). ``max_dyn``:
    see :func:`default_max_dyn`. ``tuning``: keyword arguments for :func:`lum.builder.codegen.generate`.
    ``weights``: op ids of the program's inputs that are weights (see :func:`group_kernel_sources`).
    """
    from lum.builder import nvrtc

    if dyn_vars is None:
        dyn_vars = program_dyn_vars([program])
    dyn_vars = list(dyn_vars)
    max_dyn = {k: int(v) for k, v in (max_dyn or {}).items() if k in dyn_vars}
    sources = group_kernel_sources(program, dyn_vars, max_dyn, tuning, arch=arch, cache_dir=cache_dir,
                                   weights=weights)
    table = launch_table(program, sources, arch=arch, dyn_vars=dyn_vars, max_dyn=max_dyn)
    version = "%d.%d" % nvrtc.nvrtc_version()
    if not sources:
        return GroupKernels(table, None, None, "", version, 0.0, True, {})
    src = module_source(list(sources.values()))
    res = nvrtc.compile_cuda(src, arch, name=f"{program.name or 'group'}.cu", ptx=ptx, cache_dir=cache_dir)
    return GroupKernels(table, res.cubin, res.ptx if ptx else None, src, version, res.seconds, res.cached, sources)
