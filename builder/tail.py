"""Kernel tails: the last block of a kernel runs the small kernel ops that follow it (``templates/tail.cu``).

A decode step is a chain of launches, and many of them are tiny: the one-row RMSNorm and residual
after the o and down projections, the q/k norms, RoPE and KV-cache writes after the qkv projection.
Each is a launch on the critical path whose own work (a few KB through L2) is less than what a kernel
boundary costs (the grid's drain, the next launch, its ramp). Here such ops run at the end of the
kernel before them instead: every block of that kernel (the *head*) counts itself done, and the last
one runs the consumers (the *tails*), in program order, as one block.

:func:`fuse_tails` picks, in a group's program order, for each head its maximal run of following
kernel ops that each

* read the head's output or an earlier tail's;
* follow it with no other kernel op or library call in between (inputs, constants and group outputs
  do no device work), so moving their launch to the head's end reorders nothing;
* have one launch and a grid of at most :data:`TAIL_MAX_BLOCKS` blocks at the package's dyn bounds
  when generated with the head's block size and without register rows (one block then does the work
  a few blocks did within the head's registers; an op of more blocks, such as the attention combine
  over every head's rows, or whose grid follows an unbounded dyn var, stays a kernel);
* under the ``exclusive`` policy, come before every other kernel reading the head or its tails, so
  that no op a parallel graph branch ran beside it waits for it (the v-cache write and the q path
  beside the k path after the qkv GEMV).

The LLIR is unchanged (the reference backend and the buffer plan see the same ops); the launch table
says which ops run in which head (``tail``, table version 2: see :mod:`lum.format.manifest`), and the
loader passes the tails' buffers after the head's. Each fused kernel keeps its head's register count
(``__launch_bounds__`` with the blocks per SM the head gets alone; the tails are not inlined).

**Off by default: measured slower.** On the H200 (``benchmarks/decode.py``, a package with tails beside
one without in the same run), gemma3-4b bf16 decode ran 292–299 tok/s with tails against 340–341
without, llama3-1b 965–988 against 1,006, in three forms: tails inlined (the GEMVs' registers rose,
o 38 → 82, and their resident blocks fell); kept to the head's registers (the tails' row kernels
then spilled up to 300 bytes a thread); with one acquire-release count instead of SC fences. Those
runs took tails that read only the head as well (the ``all`` policy, and a "chain" policy since
removed), which runs ops after the qkv GEMV's tails that had run beside them; ``exclusive`` and tails
without register rows are what the next measurement compares (``decode.py --systems
lum,lum-tails``, benchmarks/NOTES.md). ``LUM_KERNEL_TAILS`` (:func:`kernel_tails_policy`) turns them on.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from lum.builder.codegen import (_ENTRY, CodegenError, KernelSource, Launch, Param, common_header, generate,
                                 load_template, render, split_gemv_tuning)
from lum.format.llir import LOp, Program

__all__ = ["ENV_KERNEL_TAILS", "TAIL_POLICIES", "TAIL_MAX_BLOCKS", "TAIL_MAX_OPS", "TAIL_KINDS", "kernel_tails_policy",
           "kernel_tails_enabled", "fuse_tails", "fuse_kernels", "min_blocks"]

ENV_KERNEL_TAILS = "LUM_KERNEL_TAILS"
TAIL_MAX_BLOCKS = 4       # a tail's grid with the head's block size, at most (its one block walks them)
TAIL_MAX_OPS = 8          # tails per head, at most (they run one after another in one block)
TAIL_KINDS = ("elementwise", "reduce", "scatter_nocopy", "scatter", "gather", "iota")
_NO_WORK = ("input", "constant", "output")
_ENTRY_RE = re.compile(r'extern "C" __global__ void __launch_bounds__\(\d+(?:, \d+)?\) (\w+)\(')


TAIL_POLICIES = ("0", "exclusive", "all")


def kernel_tails_policy() -> str:
    """``$LUM_KERNEL_TAILS``: ``0`` (default: no tails; they measured slower, see the module docstring),
    ``exclusive`` (an op becomes a tail only when every other kernel reading the head or its tails comes
    after it, so no op a parallel graph branch would run beside it is delayed), ``all`` (any op reading
    the head or a tail)."""
    v = os.environ.get(ENV_KERNEL_TAILS, "0")
    if v not in TAIL_POLICIES:
        raise ValueError(f"${ENV_KERNEL_TAILS} must be one of {list(TAIL_POLICIES)}, got {v!r}")
    return v


def kernel_tails_enabled() -> bool:
    """On unless ``$LUM_KERNEL_TAILS`` is ``0``."""
    return kernel_tails_policy() != "0"


def _grid_blocks(ks: KernelSource, max_dyn: Mapping[str, int]) -> int | None:
    """Blocks of the kernel's one launch at the dyn bounds; None when a var of its grid is unbounded."""
    total = 1
    for g in ks.grid:
        if not g.vars() <= set(max_dyn):
            return None
        total *= int(g.evaluate(max_dyn))
    return total


def _as_tail(op: LOp, program: Program, head: KernelSource, dyn_vars: Sequence[str],
             max_dyn: Mapping[str, int], tuning: Mapping[str, Any]) -> KernelSource | None:
    """The op's kernel generated with the head's block size, when it may run as one of its tails."""
    if op.kind not in TAIL_KINDS:
        return None
    dts = [program.ops[a.src].dtype for a in op.args]
    try:
        ks = generate(op, dyn_vars, arg_dtypes=dts, **{**tuning, "threads": head.block[0], "row_regs": False},
                      max_dyn=dict(max_dyn) or None)     # no register rows: within the head's registers
    except CodegenError:
        return None
    if ks is None or len(ks.launches) != 1 or ks.block != head.block:
        return None
    blocks = _grid_blocks(ks, max_dyn)
    return ks if blocks is not None and blocks <= TAIL_MAX_BLOCKS else None


def fuse_tails(program: Program, sources: Mapping[int, KernelSource | None], dyn_vars: Sequence[str],
               max_dyn: Mapping[str, int] | None = None, tuning: Mapping[str, Any] | None = None,
               registers: Callable[[list[KernelSource]], Mapping[str, int]] | None = None
               ) -> dict[int, KernelSource | None]:
    """``sources`` (op id -> kernel, as :func:`~lum.builder.codegen.generate_program` gives them) with each
    head's kernel replaced by its fused kernel (:attr:`KernelSource.tails` names the ops it runs) and its
    tails' entries dropped. See the module docstring for which ops become tails. ``registers``: the
    registers per thread of the heads' own kernels (by name; NVRTC's ``ptxas -v``), so that each fused
    kernel keeps its head's occupancy; without it a head's register count is not capped."""
    max_dyn = dict(max_dyn or {})
    policy = kernel_tails_policy()
    after = _descendants(program) if policy == "exclusive" else {}
    tuning = {k: v for k, v in split_gemv_tuning(tuning or {})[0].items()
              if k not in ("threads", "max_dyn", "row_regs")}     # the tails' own: the head's block, no register rows
    out: dict[int, KernelSource | None] = dict(sources)
    head: KernelSource | None = None
    head_id = -1
    chain: list[tuple[LOp, KernelSource]] = []
    produced: set[int] = set()

    chains: list[tuple[int, KernelSource, list[tuple[LOp, KernelSource]]]] = []

    def close() -> None:
        if head is not None and chain:
            chains.append((head_id, head, chain))

    for op in program.ops:
        if op.kind in _NO_WORK:
            continue
        ks = sources.get(op.id)
        if head is not None and ks is not None and not ks.tails and len(chain) < TAIL_MAX_OPS \
                and any(a.src in produced for a in op.args) \
                and (policy != "exclusive" or _exclusive(program, op, produced, after)):
            tail = _as_tail(op, program, head, dyn_vars, max_dyn, tuning)
            if tail is not None:
                chain.append((op, tail))
                produced.add(op.id)
                continue
        close()
        head, head_id, chain, produced = None, -1, [], set()
        if ks is not None and len(ks.launches) == 1 and not ks.tails:    # not a kernel that runs others already
            head, head_id, produced = ks, op.id, {op.id}
    close()
    regs = registers([h for _, h, _ in chains]) if registers is not None and chains else {}
    for head_id, head, chain in chains:
        blocks = min_blocks(head.block[0], regs[head.name]) if head.name in regs else 1
        out[head_id] = fuse_kernels(head, chain, blocks)
        for op, _ in chain:
            out.pop(op.id, None)
    return out


def min_blocks(threads: int, registers: int) -> int:
    """Resident blocks per SM of a kernel of ``threads`` threads using ``registers`` each (H100 / H200:
    65,536 registers, 2,048 threads, 32 blocks an SM; registers are allocated in multiples of 8)."""
    regs = max(8, -(-int(registers) // 8) * 8)
    return max(1, min(32, 2048 // threads, 65536 // (regs * threads)))


def _descendants(program: Program) -> dict[int, set[int]]:
    """Op id -> the ids of every op that reads it, directly or through others."""
    out: dict[int, set[int]] = {o.id: set() for o in program.ops}
    for o in reversed(program.ops):
        for a in o.args:
            out[a.src] |= {o.id} | out[o.id]
    return out


def _exclusive(program: Program, op: LOp, chain: set[int], after: Mapping[int, set[int]]) -> bool:
    """Whether every other kernel op reading the chain's values comes after ``op`` (reads it, maybe
    through others): then running ``op`` in the head's last block delays nothing that could run beside it."""
    return all(o.id in after[op.id] for o in program.ops
               if o.id != op.id and o.id not in chain and o.kind not in _NO_WORK
               and any(a.src in chain for a in o.args))


def _device_function(ks: KernelSource, name: str, one_block: bool, at: tuple[str, str] | None = None) -> str:
    """The kernel's body as ``__device__`` function ``name``; ``one_block``: as a grid of one block
    (blockIdx.x 0, gridDim.x 1) whose pointers carry no ``__restrict__`` (the head wrote what it reads
    in this same launch, so the read-only cache path must not be used); ``at``: as blocks of a grid of
    its own within a larger one, its block index and grid size the function's two leading parameters
    of these names (builder/siblings.py)."""
    if _ENTRY_RE.findall(ks.body) != [ks.launches[0].kernel]:
        raise CodegenError(f"kernel {ks.name}: a fused kernel needs a body of exactly one kernel")
    inline = "__noinline__" if one_block else "__forceinline__"
    lead = f"unsigned int {at[0]}, unsigned int {at[1]}, " if at else ""
    body = _ENTRY_RE.sub(f"__device__ {inline} void {name}({lead}", ks.body, count=1)
    if one_block or at:
        body = re.sub(r"\bblockIdx\.x\b", at[0] if at else "0u", body)
        body = re.sub(r"\bgridDim\.x\b", at[1] if at else "1u", body)
        if re.search(r"\b(blockIdx|gridDim)\b", body):
            raise CodegenError(f"kernel {ks.name}: a fused body may use blockIdx.x and gridDim.x only")
    if one_block:
        body = body.replace("__restrict__ ", "")
    return body


def fuse_kernels(head: KernelSource, tails: Sequence[tuple[LOp, KernelSource]], blocks: int = 1) -> KernelSource:
    """One kernel: ``head``'s launch whose last block runs each tail's kernel (``templates/tail.cu``).
    Parameters: the head's (``out, in0…, dyn``), then per tail ``t<j>_out, t<j>_in0…`` (its dyn is the
    head's). ``blocks``: the resident blocks per SM the head has alone (:func:`min_blocks`), kept."""
    if len(head.launches) != 1:
        raise CodegenError(f"kernel {head.name}: a head needs exactly one launch")
    params: list[Param] = list(head.params)
    funcs = [_device_function(head, f"{_ENTRY}_head", False)]
    calls = []
    slots = dict(head.dyn_slots)
    for j, (op, ks) in enumerate(tails):
        if ks.block != head.block or tuple(ks.dyn_vars) != tuple(head.dyn_vars):
            raise CodegenError(f"op {op.id}: a tail needs the head's block size and dyn slots")
        funcs.append(_device_function(ks, f"{_ENTRY}_t{j}", True))
        names = []
        for p in ks.params:
            if p.role == "dyn":
                names.append("dyn")
                continue
            c_name = f"t{j}_{p.name}"
            params.append(_renamed(p, c_name))
            names.append(c_name)
        calls.append(f"  {_ENTRY}_t{j}({', '.join(names)});")
        slots.update(ks.dyn_slots)
    head_args = ", ".join(p.name for p in head.params)
    body = render(load_template("tail.cu"), {
        "KERNEL": _ENTRY, "THREADS": head.block[0], "MIN_BLOCKS": int(blocks),
        "PARAMS": ", ".join(p.ctype for p in params),
        "FUNCTIONS": "\n".join(funcs), "HEAD_CALL": f"{_ENTRY}_head({head_args});",
        "TAIL_CALLS": "\n  __syncthreads();\n".join(calls)})
    digest = hashlib.sha256(f"tail/{head.kind}/{head.op}\n{body}".encode()).hexdigest()[:16]
    name = f"lum_{head.kind}_{(head.op or head.kind).lower()}_tail_{digest}"
    body = body.replace(_ENTRY, name)
    tail_ids = tuple(op.id for op, _ in tails)
    return replace(head, name=name, source=common_header() + "\n" + body, body=body,
                   launches=(Launch(name, head.grid, head.block, head.shared_mem),), params=tuple(params),
                   dyn_slots=dict(sorted(slots.items(), key=lambda kv: kv[1])),
                   tuning={**head.tuning, "tail": [{"op": op.id, **ks.tuning} for op, ks in tails]},
                   tails=tail_ids)


def _joined_params(params_of: Sequence[Sequence[Param]]) -> tuple[list[Param], list[str]]:
    """The parameters of one kernel that runs several ops' bodies side by side (builder/siblings.py,
    builder/attention_stage.py): the first op's (``out, in…, dyn``), then each other op's as a tail's
    (``t<j>_out, t<j>_in…``; the one ``dyn`` serves all), none ``__restrict__``; and per op the arguments
    its body is called with, comma-separated."""
    params: list[Param] = []
    calls = []
    for j, own in enumerate(params_of):
        names = []
        for p in own:
            name = p.name if j == 0 or p.role == "dyn" else f"t{j - 1}_{p.name}"
            if j == 0 or p.role != "dyn":
                params.append(_renamed(p, name))
            names.append(name)
        calls.append(", ".join(names))
    return params, calls


def _renamed(p: Param, name: str) -> Param:
    """``p`` named ``name``, without ``__restrict__``: in a fused kernel two of its pointers may name one buffer
    (the head's output a tail reads; two siblings reading one input)."""
    decl = p.ctype.replace("__restrict__ ", "").rsplit(" ", 1)[0]
    return Param(name, p.role, p.index, p.dtype, f"{decl} {name}")
