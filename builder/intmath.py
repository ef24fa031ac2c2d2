"""Integer helpers on sizes: powers of two (block sizes, warp counts) and the unit-size test, which codegen and
its attention policy share from below both in the import graph."""

from __future__ import annotations

from lum.format.expr import Expr

__all__ = ["is_one", "is_pow2", "pow2_floor", "pow2ceil"]


def is_one(e: Expr) -> bool:
    return e.is_const and e.value == 1


def is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def pow2_floor(x: int) -> int:
    return 1 << (int(x).bit_length() - 1)


def pow2ceil(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()
