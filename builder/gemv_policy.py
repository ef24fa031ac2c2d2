"""Decode-GEMV policy: which gemm ops lum's own GEMV kernel (``templates/gemv.cu``) runs, and how it is sized and
tuned where the caller leaves it open: the ``$LUM_GEMV_*`` knobs and their defaults (block sizes, balance over
the SMs, loads ahead, preloads into registers or shared memory, a prologue's A), and the per-GEMV tuning keys.
Plain functions of an op, a program or the environment; the kernel generator (lum.builder.codegen) and the
builder's modules around it (prologue, epilogue, kernels, tuning) read them."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from lum.builder.env_switches import CodegenError, env_choice, env_count, env_switch
from lum.format.dtypes import DType
from lum.format.expr import Expr, as_expr
from lum.format.llir import GEMM_LAYOUTS, LOp, Program
from lum.format.shapetracker import numel

if TYPE_CHECKING:     # annotations only: codegen imports this module, never the other way
    from lum.builder.codegen import KernelSource

__all__ = ["GEMV_MAX_M", "PROLOGUE_SMEM_BYTES", "GEMV_DTYPES", "GEMV_MAX_ACC", "GEMV_MAX_INFLIGHT",
           "ENV_GEMV_INFLIGHT", "GEMV_PRELOAD_VECTORS", "GEMV_SHARED_PRELOAD_VECTORS", "GEMV_SHARED_PRELOAD_BYTES",
           "ENV_GEMV_PRELOAD_SHARED", "ENV_GEMV_PROLOGUE_NARROW_A", "ENV_GEMV_PROLOGUE_THREADS",
           "ENV_GEMV_PROLOGUE_PAIRS", "ENV_GEMV_PRELOAD", "ENV_GEMV_PRELOAD_AFTER_GEMV", "ENV_GEMV_TUNING",
           "GEMV_OVERRIDE_KEYS", "ENV_GEMV_EVICT_FIRST", "ENV_GEMV_BALANCE", "SMS", "GEMV_LARGE", "gemv_rows",
           "gemv_prologue_fits", "gemv_prologue_pairs", "gemv_prologue_threads", "gemv_balance", "blocks_unbalanced",
           "gemv_preload_default", "gemv_evict_first", "gemv_prologue_narrow_a", "gemv_inflight_default",
           "gemv_inflight_for", "GEMV_EPILOGUE_AHEAD", "ENV_GEMV_AHEAD_PLAIN", "gemv_ahead_plain",
           "ENV_GEMV_AHEAD_AFTER_GEMV", "gemv_ahead_after_gemv",
           "split_gemv_tuning", "gemv_tuning_override", "gemv_kernel_ops",
           "GEMV_PRELOAD_AFTER_GEMV", "gemv_preload_after_gemv", "gemv_preload_shared", "gemv_tile_a_block",
           "prologue_walks_tiles"]

GEMV_MAX_M = 8                                   # gemms with a static m up to this run lum's gemv.cu
PROLOGUE_SMEM_BYTES = 40 * 1024                 # a gemv prologue's A (floats) in static shared memory, at most
GEMV_DTYPES = (DType.f32, DType.bf16, DType.f16)
GEMV_MAX_ACC = 4                                 # product columns a gemv epilogue may combine per output column
GEMV_MAX_INFLIGHT = 16                           # vector loads a gemv lane may issue ahead
GEMV_EPILOGUE_AHEAD = 8         # an epilogue GEMV whose lanes walk at most this many vectors a column loads all ahead
ENV_GEMV_INFLIGHT = "LUM_GEMV_INFLIGHT"
ENV_GEMV_AHEAD_PLAIN = "LUM_GEMV_AHEAD_PLAIN"   # 1: a plain GEMV (no epilogue) loads its few vectors ahead too
ENV_GEMV_AHEAD_AFTER_GEMV = "LUM_GEMV_AHEAD_AFTER_GEMV"   # 0: a GEMV behind a GEMV asks L2 for nothing early
GEMV_PRELOAD_VECTORS = 8                         # weight vectors (all product columns) a gemv lane preloads
GEMV_SHARED_PRELOAD_VECTORS = 32                 # ... into shared memory (preload_shared; its bytes bound it first)
GEMV_SHARED_PRELOAD_BYTES = 192 << 10            # a block's shared preload at most, beside its static shared memory
ENV_GEMV_PRELOAD_SHARED = "LUM_GEMV_PRELOAD_SHARED"
ENV_GEMV_PROLOGUE_NARROW_A = "LUM_GEMV_PROLOGUE_NARROW_A"
ENV_GEMV_PROLOGUE_THREADS = "LUM_GEMV_PROLOGUE_THREADS"
ENV_GEMV_PROLOGUE_PAIRS = "LUM_GEMV_PROLOGUE_PAIRS"
ENV_GEMV_PRELOAD = "LUM_GEMV_PRELOAD"
ENV_GEMV_PRELOAD_AFTER_GEMV = "LUM_GEMV_PRELOAD_AFTER_GEMV"
ENV_GEMV_TUNING = "LUM_GEMV_TUNING"
GEMV_OVERRIDE_KEYS = ("threads", "group", "unroll", "inflight", "preload", "max_blocks")
ENV_GEMV_EVICT_FIRST = "LUM_GEMV_EVICT_FIRST"
ENV_GEMV_BALANCE = "LUM_GEMV_BALANCE"           # 0: large GEMVs keep 512 threads however their blocks fall
SMS = 132                                       # SMs of an H100 / H200
GEMV_LARGE = 1 << 24      # weights of a decode GEMV (elements) whose time is its bytes, not its latency


def gemv_rows(op: LOp) -> int | None:
    """M when lum's own kernel (``templates/gemv.cu``) runs this gemm op: ``m`` a constant in [1,
    GEMV_MAX_M] (decode: one token per sequence, or a few query heads sharing a KV head), C dense
    (``ldc`` = n and ``stride_c`` = m*n where given), not in place. Else None: a cuBLASLt call, whose
    plan checks such parameters at run time. (Operand and result dtypes are checked by
    :func:`~lum.builder.codegen.generate`.)"""
    p = op.params
    if op.kind != "gemm" or op.alias is not None or p.get("layout") not in GEMM_LAYOUTS:
        return None
    if any(name not in p for name in ("m", "n", "k", "lda", "ldb")):
        return None
    m, n = as_expr(p["m"]), as_expr(p["n"])
    if not m.is_const or not 1 <= m.value <= GEMV_MAX_M:
        return None
    if "ldc" in p and as_expr(p["ldc"]) != n:
        return None
    if "stride_c" in p and as_expr(p.get("batch", 1)) != as_expr(1) and as_expr(p["stride_c"]) != m * n:
        return None
    return m.value


def gemv_prologue_fits(m: int, p: Mapping[str, Any], layout: str, dom: Sequence[Expr]) -> str | None:
    """Why lum's GEMV cannot compute its A operand as a fused prologue over domain ``dom`` (None: it can):
    the dot scheme (``RmCm``), no batch, A's buffer read from its start row-major, a static A of
    ``m × k`` = numel(dom) floats that fits :data:`PROLOGUE_SMEM_BYTES` of shared memory."""
    k = as_expr(p["k"])
    if layout != "RmCm":
        return f"needs layout RmCm (A row-major, B column-major), not {layout}"
    if as_expr(p.get("batch", 1)) != as_expr(1) or as_expr(p.get("offset_a", 0)) != as_expr(0):
        return "needs batch 1 and offset_a 0"
    if not k.is_const or not dom or not all(as_expr(d).is_const for d in dom):
        return "needs static k and a static domain"
    if m > 1 and as_expr(p["lda"]) != k:
        return "needs lda = k"
    if numel(tuple(dom)) != as_expr(m * k.value):
        return f"has a domain of {numel(tuple(dom))} elements for an A of {m} x {k.value}"
    if m * k.value * 4 > PROLOGUE_SMEM_BYTES:
        return f"A of {m} x {k.value} floats exceeds {PROLOGUE_SMEM_BYTES} bytes of shared memory"
    return None


def gemv_prologue_pairs() -> str | None:
    """``$LUM_GEMV_PROLOGUE_PAIRS``: which prologue GEMVs (no epilogue, static even n) have each warp compute two
    output columns, j and j + n/2, reading A from shared memory once for both, in half the threads a block
    (the same columns a block). Every warp of such a block reads all of A, one column a warp, so this halves
    those reads (gemma3-4b's qkv: A 32 × 5 KB → 16 × 5 KB an SM beside its 160 KB of weights, after
    :func:`gemv_prologue_narrow_a`). ``1``, the default: every one (gemma3-4b's qkv, llama3-1b's qkv);
    ``shared``: those whose weights preload into shared memory; ``0``: none. Measured at cd3818a (same runs,
    tokens equal): gemma3-4b ``shared`` 403.4 → 404.9 tok/s (+0.4%), llama3-1b ``1`` 1,178.0 → 1,182.5 (+0.4%).
    Returns ``"all"``, ``"shared"`` or ``None``."""
    return env_choice(ENV_GEMV_PROLOGUE_PAIRS, {"0": None, "shared": "shared", "1": "all"}, "1")


def gemv_prologue_threads() -> int:
    """``$LUM_GEMV_PROLOGUE_THREADS`` (128, 256, 512 or 1,024, the default): the block size of a
    prologue GEMV the tuning leaves open. One column a warp, so 1,024 threads give llama3-1b's qkv (3,072
    columns) 96 blocks, one an SM on 96 of the 132 SMs; smaller blocks spread its weights over more SMs, each
    block computing the prologue again. Measured (a431934, same runs): 512 −0.4% on gemma3-4b and −0.5% on
    llama3-1b, 256 −4.6% on llama3-1b: 192 and 384 blocks, two or three on some SMs and fewer on others. The
    fewest warps whose blocks still fit the SMs in one wave (llama3-1b's qkv 128 blocks of 384 threads, two
    columns a warp) measured −2.1% on llama3-1b (8bb5e81) and is gone."""
    return env_choice(ENV_GEMV_PROLOGUE_THREADS, {str(t): t for t in (128, 256, 512, 1024)}, "1024")


def gemv_balance() -> bool:
    """``$LUM_GEMV_BALANCE`` (1, the default: a large decode GEMV whose 512-thread blocks would load the SMs
    unevenly takes 128 threads, :func:`blocks_unbalanced`), else off."""
    return env_switch(ENV_GEMV_BALANCE, default=True)


def blocks_unbalanced(blocks: int, slots: int = SMS) -> bool:
    """``blocks`` equal blocks over ``slots`` places that run at once (the SMs; or the blocks a wave holds,
    builder/kernels.py) leave some places a block more than others by more than a tenth of their work: a
    large GEMV at 512 threads (eight columns a block) then takes 128 (two), e.g. gemma3-4b's down projection,
    whose 320 blocks put three on some SMs and two on the others, 15.56 µs at 512 threads against 14.02 at 128
    (1,280 blocks; benchmarks/gemv_sweep.py at 893d4ba); llama3-1b's (256 blocks) stays at 512."""
    return -(-blocks // slots) * slots > 1.1 * blocks


def gemv_preload_default() -> int:
    """``$LUM_GEMV_PRELOAD`` (N: GEMV lanes load their first N weight vectors into registers before waiting for
    their predecessor), else 0."""
    return env_count(ENV_GEMV_PRELOAD, GEMV_PRELOAD_VECTORS)


def gemv_evict_first() -> bool:
    """``$LUM_GEMV_EVICT_FIRST`` (1, the default: a GEMV whose B is a weight loads it with an L2 evict-first
    policy, templates/common.cuh lum_load_stream; gemma3-4b bf16 decode +3.2%, llama3-1b −0.2%, 5f9afe5)."""
    return env_switch(ENV_GEMV_EVICT_FIRST, default=True)


def gemv_prologue_narrow_a() -> str | None:
    """``$LUM_GEMV_PROLOGUE_NARROW_A``: which prologue GEMVs whose A is bf16 or f16 keep it so in shared memory,
    rather than as floats. The prologue rounds A to its dtype before storing it, so the values, and the sums,
    are the same; what changes is the shared memory the dot reads: each warp reads all of A, one column a warp
    (gemma3-4b's qkv: 32 warps × 10 KB = 320 KB an SM beside its 160 KB of weights, ≈ 1.9 µs at 128 bytes a
    clock in a 5.5 µs link, benchmarks/NOTES.md 2026-12-04), halved in bf16, against a conversion per element.
    ``shared``, the default: those whose weights preload into shared memory too (gemma3-4b's qkv), where the
    dot reads both from shared memory; ``1``: every one; ``0``: none. Measured at 87f41af (same runs, tokens
    equal): every one (``1``) +1.9% on gemma3-4b (its qkv only), −1.3% on llama3-1b (qkv and gate-up, weights
    streamed from memory: the reads of A were hidden there, the conversions are not). Returns ``"shared"``,
    ``"all"`` or ``None``."""
    return env_choice(ENV_GEMV_PROLOGUE_NARROW_A, {"0": None, "shared": "shared", "1": "all"}, "shared")


def gemv_inflight_default() -> int | None:
    """``$LUM_GEMV_INFLIGHT`` (vector loads every GEMV lane issues ahead; 0: the compiler's unrolled loop), else
    None: each GEMV's own default (:func:`gemv_inflight_for`)."""
    return env_count(ENV_GEMV_INFLIGHT, GEMV_MAX_INFLIGHT) if os.environ.get(ENV_GEMV_INFLIGHT) else None


def gemv_ahead_plain() -> bool:
    """``$LUM_GEMV_AHEAD_PLAIN`` (default off, to measure): :func:`gemv_inflight_for` loads all of a lane's few
    vectors ahead in a GEMV without an epilogue too (no prologue either), such as the LM heads of gemma3-4b (5
    vectors a lane a column, 1.34 GB a step) and llama3-1b, whose compiler loops take three dependent round trips
    a lane for them, as gate-up's loop took five before its loads went ahead (+2.4% a step on the H200, f74fe96)."""
    return env_switch(ENV_GEMV_AHEAD_PLAIN, default=False)


def gemv_ahead_after_gemv() -> bool:
    """``$LUM_GEMV_AHEAD_AFTER_GEMV`` (default on; ``0``: off): a GEMV without a prologue or a preload that reads a
    weight as B, behind another GEMV of its program, asks L2 for the lines of its first step before its wait
    (gemv.cu ``AHEAD_EARLY``; the plain loop's first ``UNROLL`` vectors a lane), at the blocks an SM it holds.
    Its blocks become resident as the GEMV before retires its last wave (every kernel triggers the next launch at
    its start), while fewer and fewer of that GEMV's loads are in flight, so its first bytes move in that tail and
    in the wait's release instead of after it. gemma3-4b's down: one wave of 1,280 blocks of 128 threads, 8 KB a
    block asked early, ≈ 10.5 MB, ≈ 2.3 µs of the H200's bus behind gate-up (llama3-1b's down preloads registers
    instead, :func:`gemv_preload_after_gemv`, and is unchanged). The kernel before keeps its trigger: a GEMV's own
    stream is what the requests run beside, not the chain. Measured on an H100 (b5930dc, tokens equal): +0.45%
    on gemma3-4b (332.0 against 330.5 tok/s in the same run; benchmarks/NOTES.md 2026-12-07)."""
    return env_switch(ENV_GEMV_AHEAD_AFTER_GEMV, default=True)


def gemv_inflight_for(fused_epilogue: bool, lane_vectors: int | None, prologue: bool = False) -> int:
    """The loads ahead of a GEMV that neither its tuning nor ``$LUM_GEMV_INFLIGHT`` sets: all of a lane's vectors
    of each column (``lane_vectors``, known where k is static) for a GEMV with a fused epilogue (or any, under
    :func:`gemv_ahead_plain`) and no prologue when they are at most :data:`GEMV_EPILOGUE_AHEAD`, else 0 (the
    compiler's loop). That is gemma3-4b's gate-up: 5 vectors a lane in each of its two columns, which the
    compiler's loop loaded one step at a time (one weight vector a column in flight, a bounds branch between
    steps). All 10 ahead, tokens equal to the loop's: on an H100 (1aa2a35, two runs) +1.0% and +1.0% a decode
    step (330.5 / 330.3 against 327.2 / 327.0 tok/s), 2 ahead +0.6%, 4 ahead −1.1% (a second pass for the fifth);
    on the H200 (f74fe96) **+2.4%** (429.7 against 419.6 tok/s, 78.8% of the roofline). Every other GEMV keeps the
    loop: loads ahead in all of them measured −2.7% on gemma3-4b and −2.6% on llama3-1b (0c79be2)."""
    if prologue or lane_vectors is None or lane_vectors > GEMV_EPILOGUE_AHEAD:
        return 0
    if fused_epilogue or gemv_ahead_plain():
        return lane_vectors
    return 0


_GEMV_KEY = re.compile(r"gemv(\d+)\.(\w+)")


def split_gemv_tuning(tuning: Mapping[str, Any]) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """``tuning`` as (the parameters of every kernel, rank -> the parameters of the rank-th GEMV kernel in
    program order): a key ``gemv<i>.<name>`` (the measured search's per-shape choice) sets ``name`` for
    GEMV ``i`` only, over the group-wide value."""
    common: dict[str, Any] = {}
    per: dict[int, dict[str, Any]] = {}
    for k, v in tuning.items():
        m = _GEMV_KEY.fullmatch(k)
        if m:
            per.setdefault(int(m.group(1)), {})[m.group(2)] = v
        else:
            common[k] = v
    return common, per


def gemv_tuning_override() -> dict[int, dict[str, int]]:
    """``$LUM_GEMV_TUNING`` (e.g. ``3.inflight=4,1.preload=2``: the i-th GEMV kernel of every group, in program
    order, takes that value unless the group's tuning sets it), else {}: one GEMV's parameter measured in a
    whole decode step (``decode.py``), which the measured search reaches only at large budgets. Keys:
    :data:`GEMV_OVERRIDE_KEYS`."""
    raw = os.environ.get(ENV_GEMV_TUNING, "").strip()
    out: dict[int, dict[str, int]] = {}
    for item in filter(None, (x.strip() for x in raw.split(","))):
        m = re.fullmatch(r"(\d+)\.(\w+)=(\d+)", item)
        if not m or m.group(2) not in GEMV_OVERRIDE_KEYS:
            raise CodegenError(f"${ENV_GEMV_TUNING} takes <gemv>.<key>=<int> entries, key one of "
                               f"{', '.join(GEMV_OVERRIDE_KEYS)}; got {item!r}")
        out.setdefault(int(m.group(1)), {})[m.group(2)] = int(m.group(3))
    return out


def gemv_kernel_ops(program: Program) -> list[LOp]:
    """The program's gemm ops that lum's GEMV kernel runs, in program order (the ranks of ``gemv<i>.``)."""
    return [o for o in program.ops if o.kind == "gemm" and gemv_rows(o) is not None]


GEMV_PRELOAD_AFTER_GEMV = 4      # the default of $LUM_GEMV_PRELOAD_AFTER_GEMV


def gemv_preload_after_gemv() -> int:
    """``$LUM_GEMV_PRELOAD_AFTER_GEMV`` (N: a GEMV whose kernel before is a GEMV, the complement of
    :func:`~lum.builder.codegen.gemv_after_small`, preloads N vectors a lane unless its tuning sets ``preload``; 0:
    off), else :data:`GEMV_PRELOAD_AFTER_GEMV`. Measured on llama3-1b at 4, same runs, tokens equal: +2.9%
    (c9dfe46), as much as every GEMV preloading (+3.0%), and +2.9% again (e35cef7: 1,126.8 against 1,095.0 tok/s).
    In gemma3-4b only its down GEMV follows a GEMV, and its preload is dropped (builder/kernels.py
    ``_waves_unbalanced``; kept, it cost the step 7.4% at e827744), so gemma's kernels are unchanged."""
    return env_count(ENV_GEMV_PRELOAD_AFTER_GEMV, GEMV_PRELOAD_VECTORS, GEMV_PRELOAD_AFTER_GEMV)


def gemv_preload_shared() -> str | None:
    """``$LUM_GEMV_PRELOAD_SHARED``: which decode GEMVs copy every weight vector of their lanes' first columns
    into shared memory before their wait (:data:`GEMV_SHARED_PRELOAD_VECTORS` at most, or the ``preload`` their
    tuning sets) rather than up to a few into registers. ``small``, the default: every GEMV whose kernel before
    is not a GEMV (:func:`~lum.builder.codegen.gemv_after_small`) and whose grid the SMs hold at once
    (builder/kernels.py drops the rest): gemma3-4b's qkv and o, llama3-1b's o. Behind a small kernel such a GEMV's
    blocks are resident and waiting under programmatic launch while the bus idles, so its weights can stream then.
    gemma3-4b's qkv (128 blocks of 1,024 threads, 10 vectors a lane, one block an SM, its input norm computed before
    it could issue a load) holds only 2 of its 10 vectors in registers (a preload of 8 spilled 604 bytes a thread);
    shared memory holds all 160 KB a block. Against the modes it replaced (benchmarks/NOTES.md, same runs, tokens
    equal): only such GEMVs with a prologue (gemma3-4b's qkv) +0.5% on gemma3-4b and +0.6% on llama3-1b (48ddaa6);
    every prologue GEMV whatever runs before it −4.2% on llama3-1b (5bfcf52); llama3-1b's qkv behind down beside
    ``small``'s −1.7% (816af36); the down projections behind gate-up beside ``small``'s −0.5% on gemma3-4b and −1.9%
    on llama3-1b (235217b); gemma3-4b's gate-up too (its grid capped from 5,120 blocks to 1,320) −4.2%. ``all``:
    every GEMV (tests: the mechanism on every shape and layout). ``0``: none. A prologue GEMV whose blocks walk more
    than one tile keeps its register preload in ``small``: only a block's first tile would be copied, as with the
    grids past one wave that builder/kernels.py drops. Returns ``"after_small"``, ``"all"`` or ``None``."""
    return env_choice(ENV_GEMV_PRELOAD_SHARED, {"0": None, "small": "after_small", "all": "all"}, "small")


def gemv_tile_a_block(op: LOp, ks: KernelSource) -> bool | None:
    """Whether a dot-scheme GEMV's static grid has a block for each tile of its output columns (``cols`` of
    them a tile), so no block walks a second one; None where the grid or the columns are dynamic."""
    cols = as_expr(op.params.get("batch", 1)) * as_expr(op.params.get("n_out", op.params["n"]))
    if not (ks.grid[0].is_const and cols.is_const):
        return None
    return ks.grid[0].value * ks.tuning["cols"] >= cols.value


def prologue_walks_tiles(op: LOp, ks: KernelSource) -> bool:
    """A prologue GEMV with a shared preload whose static grid is fewer blocks than its tiles, so that its
    blocks walk tiles and only each one's first is preloaded."""
    return bool(ks.tuning.get("preload_shared") and ks.tuning.get("prologue")) and gemv_tile_a_block(op, ks) is False
