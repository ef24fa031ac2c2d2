"""Element types shared by the builder, the package and the loader (numpy types via ml_dtypes for bf16)."""

from __future__ import annotations

from enum import Enum

import ml_dtypes
import numpy as np


class DType(str, Enum):
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    i32 = "i32"
    i64 = "i64"
    bool = "bool"

    @property
    def np(self) -> np.dtype:
        return _NUMPY[self]

    @property
    def itemsize(self) -> int:
        return _NUMPY[self].itemsize

    @property
    def is_float(self) -> bool:
        return self in (DType.f32, DType.f16, DType.bf16)

    @property
    def is_int(self) -> bool:
        return self in (DType.i32, DType.i64)

    @property
    def compute_np(self) -> np.dtype:
        """The numpy type the reference backends compute in: float64 for floats, int64 for ints."""
        if self.is_float:
            return np.dtype(np.float64)
        if self.is_int:
            return np.dtype(np.int64)
        return np.dtype(np.bool_)

    @staticmethod
    def parse(name: str) -> "DType":
        try:
            return DType(_ALIASES.get(name, name))
        except ValueError:
            raise ValueError(f"unknown dtype {name!r}; expected one of {[d.value for d in DType]}") from None

    def __str__(self) -> str:
        return self.value


_NUMPY = {
    DType.f32: np.dtype(np.float32),
    DType.f16: np.dtype(np.float16),
    DType.bf16: np.dtype(ml_dtypes.bfloat16),
    DType.i32: np.dtype(np.int32),
    DType.i64: np.dtype(np.int64),
    DType.bool: np.dtype(np.bool_),
}

_ALIASES = {
    "float32": "f32", "float": "f32", "fp32": "f32",
    "float16": "f16", "half": "f16", "fp16": "f16",
    "bfloat16": "bf16",
    "int32": "i32", "int64": "i64",
}


def from_numpy(dt: np.dtype) -> DType:
    for k, v in _NUMPY.items():
        if v == np.dtype(dt):
            return k
    raise ValueError(f"no lum dtype for numpy dtype {dt}")
