"""Numeric helpers shared by the reference executors (the builder's HLIR interpreter, the loader's LLIR
numpy backend): storage rounding and reading a ShapeTracker view out of a flat buffer.

Both executors compute in float64 (int64 for integers) and round each op's result to the op's dtype,
so they agree with each other exactly and model storage precision the same way.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from lum.format.dtypes import DType
from lum.format.shapetracker import ShapeTracker

__all__ = ["NumericsError", "round_to", "store_as", "view_of"]


class NumericsError(RuntimeError):
    """A program cannot be run as given (missing input, wrong shape, index or view out of range)."""


def round_to(x: np.ndarray, dtype: DType) -> np.ndarray:
    """Round ``x`` to ``dtype``'s precision, returned in the compute type (float64/int64/bool).

    Floats round to nearest even (as a store of the dtype does); float→int truncates toward zero;
    anything → bool is ``x != 0``.
    """
    if dtype.is_float:
        if dtype == DType.f32 and x.dtype == np.float64:
            return x.astype(np.float32).astype(np.float64)
        return np.asarray(x).astype(dtype.np).astype(np.float64)
    if dtype.is_int:
        if np.asarray(x).dtype.kind == "f":
            x = np.trunc(x)
        return np.asarray(x).astype(dtype.np).astype(np.int64)
    return np.asarray(x).astype(np.bool_)


def store_as(x: np.ndarray, dtype: DType) -> np.ndarray:
    """``x`` converted to ``dtype``'s storage type (``dtype.np``), rounding exactly as :func:`round_to`."""
    x = np.asarray(x)
    if x.dtype == dtype.np:
        return x
    if dtype.is_int and x.dtype.kind == "f":
        x = np.trunc(x)
    return x.astype(dtype.np)


def view_of(buf: np.ndarray, view: ShapeTracker, dyn_map: Mapping[str, int]) -> np.ndarray:
    """The logical tensor a ShapeTracker reads from a flat buffer (padding reads 0). May alias ``buf``.

    Raises :class:`NumericsError` when the view has a negative dim or reads outside the buffer.
    """
    shape, strides, offset, mask = view.evaluate(dyn_map)
    if any(d < 0 for d in shape):
        raise NumericsError(f"negative dim in view shape {shape}")
    out_lo = [0] * len(shape)
    out_hi = list(shape)
    if mask is not None:
        out_lo = [lo for lo, _ in mask]
        out_hi = [max(lo, hi) for lo, hi in mask]
    box = [hi - lo for lo, hi in zip(out_lo, out_hi)]
    if any(b == 0 for b in box):
        return np.zeros(shape, dtype=buf.dtype)
    base = offset + sum(lo * st for lo, st in zip(out_lo, strides))
    hi_idx = base + sum((b - 1) * st for b, st in zip(box, strides) if st > 0)
    lo_idx = base + sum((b - 1) * st for b, st in zip(box, strides) if st < 0)
    if lo_idx < 0 or hi_idx >= buf.size:
        raise NumericsError(f"view reads elements {lo_idx}..{hi_idx} of a buffer of {buf.size}")
    item = buf.itemsize
    region = np.lib.stride_tricks.as_strided(buf[base:], shape=box, strides=[s * item for s in strides],
                                             writeable=False)
    if mask is None:
        return region
    out = np.zeros(shape, dtype=buf.dtype)
    out[tuple(slice(lo, hi) for lo, hi in zip(out_lo, out_hi))] = region
    return out
