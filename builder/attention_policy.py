"""Attention policy: how an attention op's query rows group over its K / V rows, which kernel runs it (decode's
``templates/attention.cu``, or flash attention, ``templates/flash_attention.cu``, where many query rows share a
K / V row) and whether flash attention is on (``$LUM_FLASH_ATTENTION``) and takes its features, and the block of
a decode attention kernel that runs an attention stage."""

from __future__ import annotations

from lum.builder.env_switches import env_switch
from lum.builder.intmath import is_one, pow2ceil
from lum.format.expr import Expr, as_expr
from lum.format.llir import LOp, attention_dims
from lum.format.shapetracker import numel

__all__ = ["ATTENTION_MAX_GROUP", "ATTENTION_MERGE_SMEM", "FLASH_MAX_D", "FLASH_TILE_KEYS", "ENV_FLASH_ATTENTION",
           "attention_row_dims", "attention_group_rows", "attention_stage_block", "flash_attention",
           "flash_attention_enabled", "flash_features_fit"]

ATTENTION_MAX_GROUP = 8                          # query rows sharing a K / V row that one attention block holds
ATTENTION_MERGE_SMEM = 40 * 1024                 # static shared memory for decode attention's merged partials
FLASH_MAX_D = 256                                # flash attention (many rows a K / V row): features, at most
FLASH_TILE_KEYS = (16, 32, 64, 128)              # the key tiles it takes (tile_keys)
ENV_FLASH_ATTENTION = "LUM_FLASH_ATTENTION"     # 0: prefill attention as GEMMs, not flash attention


def attention_row_dims(op: LOp) -> tuple[list[int], list[int]]:
    """(group, heads): the dims of an attention op's rows ``R…`` along which K and V do not move (size 1, or
    stride 0 in both: the query rows of one GQA group, one block's), and the kv-row dims the blocks split."""
    r = attention_dims(op)[0]
    vk, vv, zero = op.args[1].view, op.args[2].view, as_expr(0)
    group = [i for i in range(len(r)) if is_one(r[i]) or (vk.strides[i] == zero and vv.strides[i] == zero)]
    return group, [i for i in range(len(r)) if i not in group]


def attention_group_rows(op: LOp) -> Expr:
    """The query rows of an attention op that share one K / V row: the product of its group dims."""
    r = attention_dims(op)[0]
    return numel(tuple(r[i] for i in attention_row_dims(op)[0]))


def attention_stage_block(op: LOp) -> tuple[int, int] | None:
    """(threads, unroll) of a decode attention kernel that runs its stage: enough warps (a power of two, at least
    4) for the stage's M query rows and its k and v rows to take one round, and UNROLL keys a warp so that
    WARPS · UNROLL is still the chunk. With 4 warps llama3-1b's stage (M = 4: six rows) ran in two rounds,
    warps 0 and 1 a query row and then the k or v row: two dependent L2 round trips (one round measured
    +1.2% on llama3-1b, 935f585). ``None`` (4 warps of 4 keys) where they already take one round or where the
    chunk cannot be split so. (gemma3-4b's in 8 warps of 2 keys measured even on the H200, 2ea84da.)"""
    rows, chunk = attention_group_rows(op), int(op.params["chunk"])
    if not rows.is_const or rows.value + 2 <= 4:
        return None
    warps = pow2ceil(rows.value + 2)
    if warps > chunk or chunk % warps or warps > 32:
        return None
    return 32 * warps, chunk // warps


def flash_attention(op: LOp) -> bool:
    """Whether an attention op runs as flash attention (templates/flash_attention.cu): its query rows sharing a
    K / V row are not a static few (prefill: the GQA group times the prompt), so no block holds them in
    registers as decode's kernel (templates/attention.cu) does."""
    rows = attention_group_rows(op)
    return not (rows.is_const and rows.value <= ATTENTION_MAX_GROUP)


def flash_attention_enabled() -> bool:
    """``$LUM_FLASH_ATTENTION`` (on by default: prefill's attention runs as flash attention where it fits,
    builder/egraph.py; 0: q·k and p·v stay GEMMs with the scores in memory, the path measured against it)."""
    return env_switch(ENV_FLASH_ATTENTION, default=True)


def flash_features_fit(d: Expr, dv: Expr) -> bool:
    """Whether flash attention takes q·k features ``d`` and v features ``dv``: static multiples of 16 (the mma
    tile's k and two n-tiles), at most :data:`FLASH_MAX_D`."""
    return all(x.is_const and x.value % 16 == 0 and 16 <= x.value <= FLASH_MAX_D for x in (d, dv))
