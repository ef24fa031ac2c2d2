"""Device outputs that PyTorch, CuPy or JAX can take without a copy.

:class:`DeviceArray` points into a session's device memory and offers both interop protocols:

* ``__cuda_array_interface__`` (version 3) — shape, typestr, data pointer and the session's stream
  (consumers make their work wait on it). numpy has no standard typestr for bfloat16 (it is
  ``<V2``), so bf16 arrays are better taken through DLPack.
* ``__dlpack__`` / ``__dlpack_device__`` — a legacy (unversioned) ``DLManagedTensor`` capsule built
  with ctypes; bf16 is DLPack's ``kDLBfloat``. ``torch.from_dlpack(arr)`` works for every dtype.

The memory belongs to the session: a device output stays valid until the session's next run (which
may reuse the arena) or its ``close()``; copy it (``torch.from_dlpack(a).clone()``) to keep it.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np

from lum.format.dtypes import DType

__all__ = ["DeviceArray", "dlpack_capsule", "KDL_CPU", "KDL_CUDA"]

KDL_CPU, KDL_CUDA = 1, 2
_DL_CODE = {DType.f32: (2, 32), DType.f16: (2, 16), DType.bf16: (4, 16), DType.i32: (0, 32),
            DType.i64: (0, 64), DType.bool: (6, 8)}   # kDLInt 0, kDLFloat 2, kDLBfloat 4, kDLBool 6


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_CAPSULE_NAME = b"dltensor"
_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_PyCapsule_IsValid = ctypes.pythonapi.PyCapsule_IsValid
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

_LIVE: dict[int, tuple] = {}      # address of a DLManagedTensor -> what keeps it (and its owner) alive


@_DELETER
def _deleter(managed) -> None:  # called by the consumer (or by the capsule destructor if never consumed)
    _LIVE.pop(ctypes.addressof(managed.contents), None)


_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@_CAPSULE_DESTRUCTOR
def _capsule_destructor(capsule: int) -> None:
    if _PyCapsule_IsValid(capsule, _CAPSULE_NAME):     # never consumed: we still own the tensor
        ptr = _PyCapsule_GetPointer(capsule, _CAPSULE_NAME)
        _LIVE.pop(ptr, None)


def dlpack_capsule(ptr: int, shape: tuple[int, ...], dtype: DType, device_type: int, device_id: int,
                   owner: Any) -> Any:
    """A ``dltensor`` capsule viewing ``ptr`` (row-major ``shape`` of ``dtype``), keeping ``owner``
    alive until the consumer calls the deleter."""
    code, bits = _DL_CODE[dtype]
    managed = _DLManagedTensor()
    shape_arr = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    t = managed.dl_tensor
    t.data = ptr
    t.device = _DLDevice(device_type, device_id)
    t.ndim = len(shape)
    t.dtype = _DLDataType(code, bits, 1)
    t.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
    t.strides = None                                      # compact row-major
    t.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _deleter
    addr = ctypes.addressof(managed)
    _LIVE[addr] = (managed, shape_arr, owner)
    return _PyCapsule_New(addr, _CAPSULE_NAME, ctypes.cast(_capsule_destructor, ctypes.c_void_p))


class DeviceArray:
    """A row-major array in device memory (see the module docstring)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: DType, device_id: int = 0, stream: int = 0,
                 owner: Any = None, synchronize: Callable[[], None] | None = None,
                 to_host: Callable[[DeviceArray], np.ndarray] | None = None):
        self.ptr = int(ptr)
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.device_id = device_id
        self.stream = int(stream)
        self._owner = owner
        self._synchronize = synchronize
        self._to_host = to_host

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.shape, "typestr": self.dtype.np.str, "data": (self.ptr, False), "version": 3,
                "strides": None, "stream": self.stream or None}

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self.device_id)

    def __dlpack__(self, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        if copy:
            raise BufferError("DeviceArray exports its memory without copying (copy=True is not supported)")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"DeviceArray lives on {self.__dlpack_device__()}, not {tuple(dl_device)}")
        if stream is not None and stream != self.stream and self._synchronize is not None:
            self._synchronize()   # the consumer's stream must see the finished result
        return dlpack_capsule(self.ptr, self.shape, self.dtype, KDL_CUDA, self.device_id, self)

    def row(self, i: int) -> DeviceArray:
        """``self[i]`` along the first axis, as a view (no copy): e.g. the last row of prefill logits."""
        if not self.shape:
            raise IndexError("a 0-d DeviceArray has no rows")
        n = self.shape[0]
        if not -n <= i < n:
            raise IndexError(f"row {i} of {n}")
        i %= n
        step = self.nbytes // n if n else 0
        return DeviceArray(self.ptr + i * step, self.shape[1:], self.dtype, self.device_id, self.stream, self._owner,
                           self._synchronize, self._to_host)

    def numpy(self) -> np.ndarray:
        """A host copy."""
        if self._to_host is None:
            raise RuntimeError("this DeviceArray has no host copy function")
        return self._to_host(self)

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, ptr=0x{self.ptr:x})"
