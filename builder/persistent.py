"""Persistent kernels: a run of a group's kernels (a decoder layer) as one launch whose GEMVs stream their
weights through a ring of shared-memory stages across the dependencies between the run's ops (or, ``reg``,
load them into registers, each GEMV's first across the wait before it).

A decode layer's bus idles along its chain of dependent kernels: from down's end to gate-up's start the
H200 moved 31.5 MB in ≈ 19 µs where it could move ≈ 80 MB (benchmarks/NOTES.md, the block stamps), because
no kernel issues a load of the next GEMV's weights before its inputs are ready, and a preload reaches only
what one kernel's registers or shared memory hold before its own wait. Here the run is one launch of one
block an SM (``templates/persistent.cu``): its items are the kernels' bodies, called one after another, a
counter in global memory between two items instead of a kernel boundary; each block's thread 0 keeps the
next tiles of its GEMVs' weights on their way through a ring of :data:`RING_STAGES` stages of
:data:`RING_STAGE_BYTES` (``cp.async.bulk``), refilling a stage as soon as the block has read it, whatever
item the block is waiting for (``templates/common.cuh`` "weights through a ring").

:func:`fuse_persistent` takes, in program order, each maximal run of at least two kernel ops with at least
one GEMV among them that follow one another with no library call between (inputs, constants and outputs do
no work) and whose kernels, generated with :data:`PERSISTENT_THREADS` threads, each

* are a GEMV whose B streams through the ring (:func:`~lum.builder.codegen.gemv_ring_tile`: the dot scheme,
  batch 1, static n and k, B dense from its start), regenerated with ``ring`` (templates/gemv.cu RING); or
* have one launch of a one-dimensional grid of :data:`PERSISTENT_THREADS` threads, no cluster and no
  dynamic shared memory (the ring owns it): any small kernel, an attention kernel with its stage, siblings.

The caller passes the group's kernels generated at :data:`PERSISTENT_THREADS` threads
(:func:`lum.builder.kernels.group_kernel_sources` does). The LLIR is unchanged (the reference backend and
the buffer plan see the same ops); the launch table names the run's first op the kernel and every other op
of the run its tails (table version 2), so the loader keeps every buffer the run reads alive until its end
and no two ops of the run share memory. The grid is :data:`~lum.builder.codegen.SMS` blocks, all resident
(over 113 KB of shared memory a block: one an SM); a wait that never ends traps instead of hanging.

Register-fed (``reg``): no ring. Every kernel of the run is an item of the second kind, the GEMVs too, as
lum's own register GEMVs (each lane's first :data:`REG_PRELOAD` weight vectors loaded before its wait, none
in shared memory), and the launch is :data:`~lum.builder.codegen.SMS` × ``blocks`` blocks of
:data:`PERSISTENT_THREADS` threads, ``blocks`` (:func:`persistent_blocks`) as many an SM as the registers
allow spilling at most :data:`REG_MAX_SPILL` bytes a thread (4 on gemma3-4b and llama3-1b, 64 registers),
so that as many threads an SM keep weight loads in flight as lum's GEMV kernels do. Each item waits inside
its body where its kernel waited for the one before (common.cuh lum_item_wait), so its preload crosses the
wait, as it crosses a kernel boundary; the run's first item waits there for the previous launch. Why: the
layer probe's waits cost a persistent layer 4.3–7.5% where kernel boundaries cost lum ≈ 28%, and the ring
lost only because one block an SM could not stream through shared memory (benchmarks/NOTES.md, 2026-12-05).
``reg-shared``: the same with each GEMV's first :data:`REG_SHARED_PRELOAD` vectors a lane copied into shared
memory (gemv.cu's shared preload, its buffer moved past the item header: common.cuh lum_item_smem), more
bytes on their way across each wait than registers hold, fewer blocks an SM where they do not fit.

Off unless ``$LUM_PERSISTENT`` is ``1``, ``async``, ``reg`` or ``reg-shared`` (:func:`persistent_mode`). The
ring is correct on the H200 but 37% slower than the kernels it replaces, since it streams weights at only ≈
2.1–3.3 TB/s (benchmarks/NOTES.md, 2026-12-05); the register-fed modes are not yet measured on a GPU.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from lum.builder.codegen import (GEMV_PRELOAD_VECTORS, SMS, CodegenError, KernelSource, Launch, Param,
                                 _Ctx, _env_choice, _env_count, common_header, gemm_parts, gemv_ring_tile, generate,
                                 load_template, render, split_gemv_tuning)
from lum.builder.tail import _ENTRY_RE, _NO_WORK, _renamed
from lum.format.llir import LOp, Program

__all__ = ["ENV_PERSISTENT", "ENV_PERSISTENT_BLOCKS", "ENV_PERSISTENT_PRELOAD", "PERSISTENT_MODES",
           "PERSISTENT_THREADS", "REG_BLOCKS", "REG_MAX_SPILL", "REG_MODES", "REG_PRELOAD", "REG_SHARED_PRELOAD",
           "RING_STAGES", "RING_STAGE_BYTES", "persistent_blocks", "reg_preload", "persistent_mode",
           "fuse_persistent"]

ENV_PERSISTENT = "LUM_PERSISTENT"
PERSISTENT_THREADS = 256
RING_STAGE_BYTES = 40 * 1024          # a gemma3-4b qkv tile: 8 rows of 2,560 bf16
RING_STAGES = 4                       # 160 KB in flight an SM (21 MB over 132 SMs), 66 KB left for the items'
#                                       static shared memory (29 KB on gemma3-4b); fewer where they take more
RING_HEADER = 1024                    # common.cuh LUM_RING_HEADER
RING_MAX_ITEMS = 16                   # common.cuh LUM_RING_MAX_ITEMS
_ENTRY = "lum_persistent_entry"
_PDL = re.compile(r"\blum_pdl_(?:wait|trigger)\(\)")
_PDL_WAIT = re.compile(r"\blum_pdl_wait\(\)")
_GEMV_SHARED = re.compile(   # gemv.cu's shared preload buffer, whose start an item moves past its header
    r"#if defined\(__CUDA_ARCH__\)\n\s*extern __shared__ lum_vec<unsigned, 4> lum_pre_s"
    r"\[\];[^\n]*\n#else\n\s*static lum_vec<unsigned, 4> lum_pre_s\[[^\n]*\n#endif\n")


PERSISTENT_MODES = {"0": None, "1": "bulk", "async": "async", "reg": "reg", "reg-shared": "reg-shared"}
REG_MODES = ("reg", "reg-shared")
REG_BLOCKS = (4, 3, 2, 1)             # `reg`: blocks an SM to try, the most whose registers spill at most ...
REG_MAX_SPILL = 32                    # ... these bytes a thread (gemma3-4b's layer at 64 registers: 28)
REG_PRELOAD = 1                       # `reg`: vectors a GEMV lane loads into registers before its item's wait
REG_SHARED_PRELOAD = 4                # `reg-shared`: ... into shared memory ($LUM_PERSISTENT_PRELOAD: reg_preload)
ENV_PERSISTENT_BLOCKS = "LUM_PERSISTENT_BLOCKS"
ENV_PERSISTENT_PRELOAD = "LUM_PERSISTENT_PRELOAD"


def persistent_mode() -> str | None:
    """``$LUM_PERSISTENT``: ``1`` runs each decoder layer's run of kernels as one persistent launch whose ring
    thread 0 fills with bulk copies (``bulk``), ``async`` the same filled by warp 0's 16-byte cp.async copies
    (the layer probe's ``-async`` modes), ``reg`` with no ring, each GEMV loading its weights into registers
    by its own code, its first across the wait before it (the layer probe's ``-reg`` modes), ``reg-shared``
    the same with those first weights copied into shared memory, ``0`` (the default) keeps them kernels of
    their own (None)."""
    return _env_choice(ENV_PERSISTENT, PERSISTENT_MODES, "0")


def reg_preload(mode: str = "reg") -> int:
    """Weight vectors a `reg` (`reg-shared`) kernel's GEMV lanes load into registers (shared memory) before
    their item's wait: ``$LUM_PERSISTENT_PRELOAD`` (0–32), else :data:`REG_PRELOAD` (:data:`REG_SHARED_PRELOAD`).
    Its own switch, not ``$LUM_GEMV_PRELOAD``, which would change the GEMVs outside the persistent kernels too
    (the LM head)."""
    default = REG_SHARED_PRELOAD if mode == "reg-shared" else REG_PRELOAD
    return _env_count(ENV_PERSISTENT_PRELOAD, GEMV_PRELOAD_VECTORS, default)


def persistent_blocks() -> tuple[int, ...]:
    """``$LUM_PERSISTENT_BLOCKS`` (1–8: `reg` kernels of that many blocks an SM, whatever they spill), else
    (``auto``) :data:`REG_BLOCKS`, of which the build takes the first that spills at most :data:`REG_MAX_SPILL`."""
    return _env_choice(ENV_PERSISTENT_BLOCKS, {"auto": REG_BLOCKS, **{str(b): (b,) for b in range(1, 9)}}, "auto")


@dataclass(frozen=True)
class _Item:
    op: LOp
    ks: KernelSource
    ring: bool                        # a GEMV of the ring: one call a block, the launch's grid
    waits: bool = False               # its body waits where its kernel did (lum_pdl_wait): `reg` mode


def _member(op: LOp, ks: KernelSource | None, program: Program, dyn_vars: Sequence[str],
            max_dyn: Mapping[str, int] | None, tuning: Mapping[str, Any], weights: frozenset[int],
            mode: str = "bulk") -> _Item | None:
    """Op ``op`` as an item of a persistent kernel (its kernel ``ks`` at PERSISTENT_THREADS) in ``mode``, or
    None."""
    if ks is None or len(ks.launches) != 1:
        return None
    if mode not in REG_MODES and op.kind == "gemm" and not ks.tails:
        jb = gemm_parts(op)[0]
        dtb = program.ops[op.args[jb].src].dtype
        if op.args[jb].src in weights:
            nacc = len(op.params.get("acc_cols", [0]))
            if gemv_ring_tile(op, dtb, RING_STAGE_BYTES, nacc) is not None:
                dts = [program.ops[a.src].dtype for a in op.args]
                wargs = frozenset(k for k, a in enumerate(op.args) if a.src in weights)
                try:
                    rk = generate(op, dyn_vars, arg_dtypes=dts, weight_args=wargs, max_dyn=dict(max_dyn or {}) or None,
                                  **{**tuning, "threads": PERSISTENT_THREADS, "ring": RING_STAGE_BYTES})
                except CodegenError:
                    rk = None
                if rk is not None and rk.tuning.get("ring"):
                    return _Item(op, rk, True)
    lc = ks.launches[0]
    shared_ok = mode == "reg-shared" and len(_GEMV_SHARED.findall(ks.body)) == 1   # a GEMV's shared preload
    if lc.block != (PERSISTENT_THREADS, 1, 1) or lc.cluster > 1 or (lc.shared_mem and not shared_ok) or any(
            str(g) != "1" for g in lc.grid[1:]):
        return None
    return _Item(op, ks, False, mode in REG_MODES and len(_PDL_WAIT.findall(ks.body)) == 1)


def fuse_persistent(program: Program, sources: Mapping[int, KernelSource | None], dyn_vars: Sequence[str],
                    max_dyn: Mapping[str, int] | None = None, tuning: Mapping[str, Any] | None = None,
                    weights: frozenset[int] = frozenset(), stages: int = RING_STAGES, mode: str = "bulk",
                    blocks: int = 1) -> dict[int, KernelSource | None]:
    """``sources`` (op id -> kernel, generated at PERSISTENT_THREADS) with each run (module docstring) as one
    persistent kernel of a ring of ``stages`` stages filled in ``mode`` (:func:`persistent_mode`), or in
    ``reg`` mode of ``blocks`` blocks an SM and no ring, named by its first op, the others its tails."""
    common = {k: v for k, v in split_gemv_tuning(tuning or {})[0].items() if k not in ("threads", "max_dyn")}
    covered = {t for ks in sources.values() if ks is not None for t in ks.tails}
    out: dict[int, KernelSource | None] = dict(sources)
    runs: list[list[_Item]] = []
    run: list[_Item] = []
    for op in program.ops:
        if op.kind in _NO_WORK or op.id in covered:
            continue
        item = _member(op, sources.get(op.id), program, dyn_vars, max_dyn, common, weights, mode)
        if item is None:
            runs.append(run)
            run = []
        else:
            run.append(item)
    runs.append(run)
    for run in runs:
        while run and sum(i.ring for i in run) > RING_MAX_ITEMS:
            run = run[:-1]
        if len(run) < 2 or not any(i.ring or (mode in REG_MODES and i.op.kind == "gemm") for i in run):
            continue
        ks = persistent_kernel(program, run, dyn_vars, max_dyn, stages, mode, blocks)
        out[run[0].op.id] = ks
        for item in run[1:]:
            out.pop(item.op.id, None)
    return out


def persistent_kernel(program: Program, items: Sequence[_Item], dyn_vars: Sequence[str],
                      max_dyn: Mapping[str, int] | None = None, stages: int = RING_STAGES,
                      mode: str = "bulk", blocks: int = 1) -> KernelSource:
    """One kernel running ``items`` in order (templates/persistent.cu), ``blocks`` blocks an SM (``reg``: no
    ring, so ``stages`` is ignored). Parameters: the first item's op's (``out, in0…, dyn``), then per other op
    of the run (an item's own op, then the ops its kernel runs as tails) ``t<j>_out, t<j>_in0…``."""
    reg = mode in REG_MODES
    stages = 0 if reg else stages
    head = items[0]
    ops = [op_id for it in items for op_id in (it.op.id, *it.ks.tails)]
    index = {op_id: j - 1 for j, op_id in enumerate(ops)}      # -1: the head op
    params: list[Param] = []
    funcs: dict[str, str] = {}
    body: list[str] = []
    ring_lines: list[str] = []
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
                params.append(_renamed(p, name))
            names.append(name)
        slots.update(ks.dyn_slots)
        args = ", ".join(names)
        lines = [f"  // item {n}: op {it.op.id} ({it.op.kind}{', ring' if it.ring else ''})",
                 f"  LUM_STAMP_ITEM({n}, 0);"]
        wait = f"&{_ENTRY}_done[{n - 1}]" if n else None
        if it.waits:       # reg: the body waits itself (the first item for the previous launch), once a block
            early += [own(it, e) for e in ks.early if own(it, e) not in early]
        elif n:
            lines.append(f"  lum_wait_count({wait}, gridDim.x);")
        elif reg:
            lines.append("  lum_pdl_wait();")
        lines.append(f"  LUM_STAMP_ITEM({n}, 1);" + ("  // reg: the call, not the wait's return" if it.waits else ""))
        if it.ring:
            lines += ["  lum_run_item(blockIdx.x, gridDim.x);", f"  {fn}({args});"]
            ring_lines.append(_ring_item(len(ring_lines), it, pname))
            early.append(pname(it.op.id, f"in{_b_arg(it.op)}"))
        else:
            first = "lum_vb == blockIdx.x"
            run = (f"lum_run_item(lum_vb, lum_g, {f'{first} ? {wait} : nullptr' if n else 'nullptr'}, "
                   f"gridDim.x, {'0u' if n else first});" if it.waits else "lum_run_item(lum_vb, lum_g);")
            lines += [f"  {{ const unsigned lum_g = (unsigned)({ctx.c(ks.grid[0])});",
                      "    for (unsigned lum_vb = blockIdx.x; lum_vb < lum_g; lum_vb += gridDim.x) {",
                      f"      {run}", f"      {fn}({args});", "      __syncthreads();", "    }"]
            if it.waits and not n:
                lines.append("    if (blockIdx.x >= lum_g) (lum_pdl_wait)();   // none of it here: wait all the same")
            lines.append("  }")
        lines += [f"  LUM_STAMP_ITEM({n}, 2);", f"  lum_count_block(&{_ENTRY}_done[{n}]);"]
        body += lines
    dyn_param = next(p for p in head.ks.params if p.role == "dyn")
    ordered = _ordered([*params, _renamed(dyn_param, "dyn")], ops, index, program)
    dyn_loads, used = ctx.dyn_loads(wait=False, trigger="template")
    slots.update(used)
    src = render(load_template("persistent.cu"), {
        "KERNEL": _ENTRY, "THREADS": PERSISTENT_THREADS, "MIN_BLOCKS": blocks,
        "WAIT": "" if reg else "  lum_pdl_wait();", "PARAMS": ", ".join(p.ctype for p in ordered),
        "FUNCTIONS": "\n".join(funcs.values()), "DYN_LOADS": dyn_loads, "RING_ITEMS": "\n".join(ring_lines),
        "N_RING": len(ring_lines), "STAGES": stages, "ASYNC": int(mode == "async"), "STAGE_BYTES": RING_STAGE_BYTES,
        "ITEMS": len(items), "BODY": "\n".join(body)})
    digest = hashlib.sha256(f"persistent/{head.op.kind}\n{src}".encode()).hexdigest()[:16]
    name = f"lum_persistent_{digest}"
    src = src.replace(_ENTRY, name)
    smem = RING_HEADER + (max(it.ks.launches[0].shared_mem for it in items) if reg else stages * RING_STAGE_BYTES)
    return KernelSource(name=name, kind=head.op.kind, op=head.op.op, source=common_header() + "\n" + src, body=src,
                        launches=(Launch(name, (SMS * blocks, 1, 1), (PERSISTENT_THREADS, 1, 1), smem),),
                        params=tuple(ordered), dyn_vars=tuple(dyn_vars),
                        dyn_slots=dict(sorted(slots.items(), key=lambda kv: kv[1])),
                        tuning={"persistent": [{"op": it.op.id, **it.ks.tuning} for it in items],
                                "ring": {"stages": stages, "stage_bytes": 0 if reg else RING_STAGE_BYTES,
                                         "fill": mode}, "blocks_per_sm": blocks},
                        tails=tuple(ops[1:]), early=tuple(early))


def _item_function(ks: KernelSource, name: str, waits: bool = False) -> str:
    """Kernel ``ks``'s body as ``__device__`` function ``name`` of its parameters, blockIdx and gridDim the
    item's (common.cuh lum_virtual_block, set by lum_run_item) in its text and in every function the body
    defines; no pointer ``__restrict__`` (another block of the launch wrote what it reads), no programmatic
    launch trigger, its wait the item's (``waits``: common.cuh lum_item_wait, where the kernel waited) or none
    (the item counters order it before the call), and a GEMV's shared preload after the item header
    (common.cuh lum_item_smem), not at the dynamic shared memory's start."""
    found = _ENTRY_RE.findall(ks.body)
    if found != [ks.launches[0].kernel]:
        raise CodegenError(f"kernel {ks.name}: an item needs a body of exactly one kernel, found {found}")
    body = _ENTRY_RE.sub(f"__device__ __noinline__ void {ks.name}(", ks.body, count=1).replace("__restrict__ ", "")
    body = body.replace(ks.name, name)      # the functions and globals the body defines: named after the item
    if waits:
        body = _PDL_WAIT.sub("lum_item_wait()", body)
    body = _GEMV_SHARED.sub("  lum_vec<unsigned, 4>* const lum_pre_s =   // after the item header (reg-shared)\n"
                            "      reinterpret_cast<lum_vec<unsigned, 4>*>(lum_item_smem());\n", body)
    body = _PDL.sub("((void)0)", body)
    return ("#define blockIdx lum_virtual_block()\n#define gridDim lum_virtual_grid()\n"
            f"{body.rstrip()}\n#undef blockIdx\n#undef gridDim\n")


def _b_arg(op: LOp) -> int:
    """The index of a gemm's B among its args (after a prologue's leaves)."""
    return gemm_parts(op)[0]


def _ring_item(k: int, it: _Item, pname) -> str:
    """Thread 0's line that describes GEMV item ``it``'s weights to the ring (common.cuh LumRingGemv), as its
    kernel's codegen laid them out (its ``ring`` tuning)."""
    ring = it.ks.tuning["ring"]
    rows = ", ".join(f"{c}u" for c in ring["acc_rows"])
    weights = f"reinterpret_cast<const unsigned char*>({pname(it.op.id, f'in{_b_arg(it.op)}')})"
    return (f"      lum_r->items[{k}] = LumRingGemv{{{weights}, {ring['row_bytes']}u, {ring['rows']}u, "
            f"{ring['n_out']}u, {len(ring['acc_rows'])}u, {{{rows}}}}};")


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
