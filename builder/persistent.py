"""Persistent kernels: a run of a group's kernels (a decoder layer) as one launch whose items are the kernels'
bodies, a counter in global memory between two items instead of a kernel boundary, each GEMV loading its
first weights across the wait before it.

A decode layer's bus idles along its chain of dependent kernels: each boundary costs lum ≈ 1–2 µs of launch,
ramp and drain, ≈ 28% of a gemma3-4b layer, where the layer probe's waits between the items of one launch
cost 4.3–7.5% (benchmarks/NOTES.md, 2026-12-05). Here the run is one launch (``templates/persistent.cu``) of
:data:`~lum.builder.codegen.SMS` × ``blocks`` blocks of :data:`PERSISTENT_THREADS` threads, ``blocks``
(:func:`persistent_blocks`) as many an SM as the registers allow spilling at most :data:`REG_MAX_SPILL` bytes
a thread (4 on gemma3-4b and llama3-1b, 64 registers), so that as many threads an SM keep weight loads in
flight as lum's GEMV kernels do. Every kernel of the run is an item, the GEMVs as lum's own register GEMVs
(each lane's first :data:`REG_PRELOAD` weight vectors loaded before its wait). Each item waits inside its body
where its kernel waited for the one before (common.cuh lum_item_wait), so its preload crosses the wait, as it
crosses a kernel boundary; the run's first item waits there for the previous launch. ``reg-shared``: the same
with each GEMV's first :data:`REG_SHARED_PRELOAD` vectors a lane copied into shared memory (gemv.cu's shared
preload, its buffer moved past the item header: common.cuh lum_item_smem), more bytes on their way across
each wait than registers hold, fewer blocks an SM where they do not fit.

:func:`fuse_persistent` takes, in program order, each maximal run of kernel ops with at least two GEMVs among
them (a decoder layer's four; not the LM head's group, whose one GEMV keeps its own tuned launch: a persistent
kernel there would remove only the few boundaries around it) that follow one another with no library call
between (inputs, constants and outputs do no work) and whose kernels, generated with :data:`PERSISTENT_THREADS` threads, each have one launch of a
one-dimensional grid of :data:`PERSISTENT_THREADS` threads and no cluster (any small kernel, an attention
kernel with its stage, siblings, a GEMV), no dynamic shared memory but a ``reg-shared`` GEMV's preload.

The caller passes the group's kernels generated at :data:`PERSISTENT_THREADS` threads
(:func:`lum.builder.kernels.group_kernel_sources` does). The LLIR is unchanged (the reference backend and
the buffer plan see the same ops); the launch table names the run's first op the kernel and every other op
of the run its tails (table version 2), so the loader keeps every buffer the run reads alive until its end
and no two ops of the run share memory. Every block must be resident (the loader checks ``blocks_per_sm``);
a wait that never ends traps instead of hanging.

Off unless ``$LUM_PERSISTENT`` is ``reg`` or ``reg-shared`` (:func:`persistent_mode`); not yet measured on a
GPU. An earlier mode streamed the GEMVs' weights through a ring of shared-memory stages at one block an SM:
correct on the H200 but 37% slower, since one block an SM streamed at only ≈ 2.1–3.3 TB/s (benchmarks/NOTES.md,
2026-12-05); it was removed.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from lum.builder.codegen import (GEMV_PRELOAD_VECTORS, SMS, CodegenError, KernelSource, Launch, Param, _Ctx,
                                 _env_choice, _env_count, common_header, load_template, render)
from lum.builder.fused import ENTRY_RE, NO_WORK, renamed
from lum.format.llir import LOp, Program

__all__ = ["ENV_PERSISTENT", "ENV_PERSISTENT_BLOCKS", "ENV_PERSISTENT_PRELOAD", "PERSISTENT_MODES",
           "PERSISTENT_THREADS", "REG_BLOCKS", "REG_MAX_SPILL", "REG_PRELOAD", "REG_SHARED_PRELOAD",
           "persistent_blocks", "reg_preload", "persistent_mode", "fuse_persistent"]

ENV_PERSISTENT = "LUM_PERSISTENT"
PERSISTENT_THREADS = 256
ITEM_HEADER = 128                     # common.cuh LUM_ITEM_HEADER
_ENTRY = "lum_persistent_entry"
_PDL = re.compile(r"\blum_pdl_(?:wait|trigger)\(\)")
_PDL_WAIT = re.compile(r"\blum_pdl_wait\(\)")
_GEMV_SHARED = re.compile(   # gemv.cu's shared preload buffer, whose start an item moves past its header
    r"#if defined\(__CUDA_ARCH__\)\n\s*extern __shared__ lum_vec<unsigned, 4> lum_pre_s"
    r"\[\];[^\n]*\n#else\n\s*static lum_vec<unsigned, 4> lum_pre_s\[[^\n]*\n#endif\n")


PERSISTENT_MODES = {"0": None, "reg": "reg", "reg-shared": "reg-shared"}
REG_BLOCKS = (4, 3, 2, 1)             # blocks an SM to try, the most whose registers spill at most ...
REG_MAX_SPILL = 32                    # ... these bytes a thread (gemma3-4b's layer at 64 registers: 28)
REG_PRELOAD = 1                       # `reg`: vectors a GEMV lane loads into registers before its item's wait
REG_SHARED_PRELOAD = 4                # `reg-shared`: ... into shared memory ($LUM_PERSISTENT_PRELOAD: reg_preload)
ENV_PERSISTENT_BLOCKS = "LUM_PERSISTENT_BLOCKS"
ENV_PERSISTENT_PRELOAD = "LUM_PERSISTENT_PRELOAD"


def persistent_mode() -> str | None:
    """``$LUM_PERSISTENT``: ``reg`` runs each decoder layer's run of kernels as one persistent launch, each
    GEMV loading its weights into registers by its own code, its first across the wait before it (the layer
    probe's ``-reg`` modes), ``reg-shared`` the same with those first weights copied into shared memory, ``0``
    (the default) keeps them kernels of their own (None)."""
    return _env_choice(ENV_PERSISTENT, PERSISTENT_MODES, "0")


def reg_preload(mode: str = "reg") -> int:
    """Weight vectors a `reg` (`reg-shared`) kernel's GEMV lanes load into registers (shared memory) before
    their item's wait: ``$LUM_PERSISTENT_PRELOAD`` (0–32), else :data:`REG_PRELOAD` (:data:`REG_SHARED_PRELOAD`).
    Its own switch, not ``$LUM_GEMV_PRELOAD``, which would change the GEMVs outside the persistent kernels too
    (the LM head)."""
    default = REG_SHARED_PRELOAD if mode == "reg-shared" else REG_PRELOAD
    return _env_count(ENV_PERSISTENT_PRELOAD, GEMV_PRELOAD_VECTORS, default)


def persistent_blocks() -> tuple[int, ...]:
    """``$LUM_PERSISTENT_BLOCKS`` (1–8: kernels of that many blocks an SM, whatever they spill), else
    (``auto``) :data:`REG_BLOCKS`, of which the build takes the first that spills at most :data:`REG_MAX_SPILL`."""
    return _env_choice(ENV_PERSISTENT_BLOCKS, {"auto": REG_BLOCKS, **{str(b): (b,) for b in range(1, 9)}}, "auto")


@dataclass(frozen=True)
class _Item:
    op: LOp
    ks: KernelSource
    waits: bool = False               # its body waits where its kernel did (lum_pdl_wait, once)


def _member(op: LOp, ks: KernelSource | None, mode: str) -> _Item | None:
    """Op ``op`` as an item of a persistent kernel (its kernel ``ks`` at PERSISTENT_THREADS), or None."""
    if ks is None or len(ks.launches) != 1:
        return None
    lc = ks.launches[0]
    shared_ok = mode == "reg-shared" and len(_GEMV_SHARED.findall(ks.body)) == 1   # a GEMV's shared preload
    if lc.block != (PERSISTENT_THREADS, 1, 1) or lc.cluster > 1 or (lc.shared_mem and not shared_ok) or any(
            str(g) != "1" for g in lc.grid[1:]):
        return None
    return _Item(op, ks, len(_PDL_WAIT.findall(ks.body)) == 1)


def fuse_persistent(program: Program, sources: Mapping[int, KernelSource | None], dyn_vars: Sequence[str],
                    max_dyn: Mapping[str, int] | None = None, mode: str = "reg",
                    blocks: int = 1) -> dict[int, KernelSource | None]:
    """``sources`` (op id -> kernel, generated at PERSISTENT_THREADS) with each run (module docstring) as one
    persistent kernel of ``blocks`` blocks an SM in ``mode`` (:func:`persistent_mode`), named by its first op,
    the others its tails."""
    covered = {t for ks in sources.values() if ks is not None for t in ks.tails}
    out: dict[int, KernelSource | None] = dict(sources)
    runs: list[list[_Item]] = []
    run: list[_Item] = []
    for op in program.ops:
        if op.kind in NO_WORK or op.id in covered:
            continue
        item = _member(op, sources.get(op.id), mode)
        if item is None:
            runs.append(run)
            run = []
        else:
            run.append(item)
    runs.append(run)
    for run in runs:
        if sum(i.op.kind == "gemm" for i in run) < 2:
            continue
        ks = persistent_kernel(program, run, dyn_vars, max_dyn, mode, blocks)
        out[run[0].op.id] = ks
        for item in run[1:]:
            out.pop(item.op.id, None)
    return out


def persistent_kernel(program: Program, items: Sequence[_Item], dyn_vars: Sequence[str],
                      max_dyn: Mapping[str, int] | None = None, mode: str = "reg", blocks: int = 1) -> KernelSource:
    """One kernel running ``items`` in order (templates/persistent.cu), ``blocks`` blocks an SM. Parameters:
    the first item's op's (``out, in0…, dyn``), then per other op of the run (an item's own op, then the ops its
    kernel runs as tails) ``t<j>_out, t<j>_in0…``."""
    head = items[0]
    ops = [op_id for it in items for op_id in (it.op.id, *it.ks.tails)]
    index = {op_id: j - 1 for j, op_id in enumerate(ops)}      # -1: the head op
    params: list[Param] = []
    funcs: dict[str, str] = {}
    body: list[str] = []
    early: list[str] = []
    ctx = _Ctx(tuple(dyn_vars), max_dyn=max_dyn)
    slots: dict[str, int] = {}

    def pname(op_id: int, name: str) -> str:
        return name if index[op_id] < 0 else f"t{index[op_id]}_{name}"

    def own(it: _Item, name: str) -> str:       # a parameter of item ``it``'s kernel, as the run names it
        m = re.fullmatch(r"t(\d+)_(\w+)", name)
        return pname(it.ks.tails[int(m.group(1))], m.group(2)) if m else pname(it.op.id, name)

    for n, it in enumerate(items):
        ks = it.ks
        fn = f"{_ENTRY}_{ks.name}"
        if fn not in funcs:
            funcs[fn] = _item_function(ks, fn, it.waits)
        names = []
        for p in ks.params:
            if p.role == "dyn":
                names.append("dyn")
                continue
            name = own(it, p.name)
            if not any(q.name == name for q in params):
                params.append(renamed(p, name))
            names.append(name)
        slots.update(ks.dyn_slots)
        args = ", ".join(names)
        lines = [f"  // item {n}: op {it.op.id} ({it.op.kind})", f"  LUM_STAMP_ITEM({n}, 0);"]
        wait = f"&{_ENTRY}_done[{n - 1}]" if n else None
        if it.waits:       # the body waits itself (the first item for the previous launch), once a block
            early += [own(it, e) for e in ks.early if own(it, e) not in early]
        elif n:
            lines.append(f"  lum_wait_count({wait}, gridDim.x);")
        else:
            lines.append("  lum_pdl_wait();")
        lines.append(f"  LUM_STAMP_ITEM({n}, 1);" + ("  // the call, not the wait's return" if it.waits else ""))
        first = "lum_vb == blockIdx.x"
        run = (f"lum_run_item(lum_vb, lum_g, {f'{first} ? {wait} : nullptr' if n else 'nullptr'}, "
               f"gridDim.x, {'0u' if n else first});" if it.waits else "lum_run_item(lum_vb, lum_g);")
        lines += [f"  {{ const unsigned lum_g = (unsigned)({ctx.c(ks.grid[0])});",
                  "    for (unsigned lum_vb = blockIdx.x; lum_vb < lum_g; lum_vb += gridDim.x) {",
                  f"      {run}", f"      {fn}({args});", "      __syncthreads();", "    }"]
        if it.waits and not n:
            lines.append("    if (blockIdx.x >= lum_g) (lum_pdl_wait)();   // none of it here: wait all the same")
        lines += ["  }", f"  LUM_STAMP_ITEM({n}, 2);", f"  lum_count_block(&{_ENTRY}_done[{n}]);"]
        body += lines
    dyn_param = next(p for p in head.ks.params if p.role == "dyn")
    ordered = _ordered([*params, renamed(dyn_param, "dyn")], ops, index, program)
    dyn_loads, used = ctx.dyn_loads(wait=False, trigger="template")
    slots.update(used)
    src = render(load_template("persistent.cu"), {
        "KERNEL": _ENTRY, "THREADS": PERSISTENT_THREADS, "MIN_BLOCKS": blocks,
        "PARAMS": ", ".join(p.ctype for p in ordered), "FUNCTIONS": "\n".join(funcs.values()),
        "DYN_LOADS": dyn_loads, "ITEMS": len(items), "BODY": "\n".join(body)})
    digest = hashlib.sha256(f"persistent/{head.op.kind}\n{src}".encode()).hexdigest()[:16]
    name = f"lum_persistent_{digest}"
    src = src.replace(_ENTRY, name)
    smem = ITEM_HEADER + max(it.ks.launches[0].shared_mem for it in items)
    return KernelSource(name=name, kind=head.op.kind, op=head.op.op, source=common_header() + "\n" + src, body=src,
                        launches=(Launch(name, (SMS * blocks, 1, 1), (PERSISTENT_THREADS, 1, 1), smem),),
                        params=tuple(ordered), dyn_vars=tuple(dyn_vars),
                        dyn_slots=dict(sorted(slots.items(), key=lambda kv: kv[1])),
                        tuning={"persistent": [{"op": it.op.id, **it.ks.tuning} for it in items],
                                "persistent_mode": mode, "blocks_per_sm": blocks},
                        tails=tuple(ops[1:]), early=tuple(early))


def _item_function(ks: KernelSource, name: str, waits: bool = False) -> str:
    """Kernel ``ks``'s body as ``__device__`` function ``name`` of its parameters, blockIdx and gridDim the
    item's (common.cuh lum_virtual_block, set by lum_run_item) in its text and in every function the body
    defines; no pointer ``__restrict__`` (another block of the launch wrote what it reads), no programmatic
    launch trigger, its wait the item's (``waits``: common.cuh lum_item_wait, where the kernel waited) or none
    (the item counters order it before the call), and a GEMV's shared preload after the item header
    (common.cuh lum_item_smem), not at the dynamic shared memory's start."""
    found = ENTRY_RE.findall(ks.body)
    if found != [ks.launches[0].kernel]:
        raise CodegenError(f"kernel {ks.name}: an item needs a body of exactly one kernel, found {found}")
    body = ENTRY_RE.sub(f"__device__ __noinline__ void {ks.name}(", ks.body, count=1).replace("__restrict__ ", "")
    body = body.replace(ks.name, name)      # the functions and globals the body defines: named after the item
    if waits:
        body = _PDL_WAIT.sub("lum_item_wait()", body)
    body = _GEMV_SHARED.sub("  lum_vec<unsigned, 4>* const lum_pre_s =   // after the item header (reg-shared)\n"
                            "      reinterpret_cast<lum_vec<unsigned, 4>*>(lum_item_smem());\n", body)
    body = _PDL.sub("((void)0)", body)
    return ("#define blockIdx lum_virtual_block()\n#define gridDim lum_virtual_grid()\n"
            f"{body.rstrip()}\n#undef blockIdx\n#undef gridDim\n")


def _ordered(params: list[Param], ops: Sequence[int], index: Mapping[int, int], program: Program) -> list[Param]:
    """The launch table's order: the head op's ``out, in0…, dyn``, then per tail op ``t<j>_out, t<j>_in0…``."""
    by_name = {p.name: p for p in params}
    want: list[str] = []
    for op_id in ops:
        n_args = len(program.ops[op_id].args)
        pre = "" if index[op_id] < 0 else f"t{index[op_id]}_"
        want += [f"{pre}out"] + [f"{pre}in{k}" for k in range(n_args)] + (["dyn"] if index[op_id] < 0 else [])
    missing = [w for w in want if w not in by_name]
    if missing:
        raise CodegenError(f"persistent kernel: no parameter for {missing[:4]}")
    return [by_name[w] for w in want]
