"""A small, checked layer over the CUDA driver API (``cuda.bindings.driver``, cuda-python ≥ 12.4).

cuda-bindings returns ``(CUresult, value…)`` tuples and never raises on a driver error; :func:`call`
checks the result and raises :class:`CudaError` (a one-line :class:`LumError`) naming the function
and the driver's error name, so a failure deep in a run reads ``cuLaunchKernel failed:
CUDA_ERROR_ILLEGAL_ADDRESS (…)``. Handles stay cuda-bindings objects; device and host pointers are
plain ``int`` (every binding accepts an int where it takes a ``CUdeviceptr`` or ``void*``).

The wrapper classes own exactly one driver resource each and free it in ``close()`` (idempotent,
also called from ``__del__`` as a last resort) so a session that is closed, or dropped, returns
its memory: that is what keeps 10,000 decode steps, or many sessions, flat in device memory.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from lum.format.errors import LumError
from lum.loader.errors import BackendUnavailableError

try:
    from cuda.bindings import driver as drv
except ImportError as _exc:  # pragma: no cover - the backend is only imported when asked for
    raise BackendUnavailableError(f"the CUDA backend needs cuda-python (pip install 'lum[cuda]'): {_exc}") from None

__all__ = ["drv", "CudaError", "CudaUnavailable", "call", "init", "DeviceInfo", "device_info", "Context",
           "DeviceBuffer", "PinnedBuffer", "Stream", "Event", "Module", "DEFAULT_SHARED_MEM", "Graph", "mem_info"]


class CudaError(LumError):
    """A CUDA driver call failed. ``func`` is the call, ``code`` the CUresult, ``name`` its name."""

    def __init__(self, func: str, code: int, name: str, detail: str = ""):
        self.func, self.code, self.name = func, int(code), name
        super().__init__(f"{func} failed: {name}" + (f" ({detail})" if detail else ""))


class CudaUnavailable(BackendUnavailableError):
    """No usable CUDA driver or device here (the ``auto`` backend falls back to the reference one)."""


def error_name(code: Any) -> str:
    try:
        err, name = drv.cuGetErrorName(code)
        if int(err) == 0 and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - naming an error must never raise another
        pass
    return f"CUresult {int(code)}"


def call(fn: Callable[..., Any], *args: Any, detail: str = "") -> Any:
    """``fn(*args)`` with its CUresult checked; returns None, the one value, or a tuple of values."""
    res = fn(*args)
    if isinstance(res, tuple):
        err, vals = res[0], res[1:]
    else:
        err, vals = res, ()
    if int(err) != 0:
        raise CudaError(getattr(fn, "__name__", str(fn)), int(err), error_name(err), detail)
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else vals


_initialised = False


def init() -> None:
    """``cuInit`` once; :class:`CudaUnavailable` when there is no driver library or no device."""
    global _initialised
    if _initialised:
        return
    try:
        res = drv.cuInit(0)
    except Exception as exc:  # noqa: BLE001 - cuda-bindings raises its own types when libcuda is absent
        raise CudaUnavailable(f"no CUDA driver: {' '.join(str(exc).split())[:200]}") from None
    err = res[0] if isinstance(res, tuple) else res
    if int(err) != 0:
        raise CudaUnavailable(f"cuInit failed: {error_name(err)}")
    n = call(drv.cuDeviceGetCount)
    if not n:
        raise CudaUnavailable("the CUDA driver reports no device")
    _initialised = True


# ============================================================================ device
@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    cc: tuple[int, int]                  # compute capability (9, 0) on Hopper
    driver_version: int                  # CUDA version the driver supports, e.g. 13000
    total_memory: int
    multiprocessors: int
    read_only_host_register: bool        # cuMemHostRegister(READ_ONLY) of a read-only mapping works

    @property
    def sm(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"

    @property
    def driver_cuda(self) -> tuple[int, int]:
        return self.driver_version // 1000, (self.driver_version % 1000) // 10


def device_info(ordinal: int = 0) -> DeviceInfo:
    init()
    count = call(drv.cuDeviceGetCount)
    if not 0 <= ordinal < count:
        raise CudaUnavailable(f"no CUDA device {ordinal} (the driver reports {count})")
    dev = call(drv.cuDeviceGet, ordinal)
    A = drv.CUdevice_attribute

    def attr(a: Any) -> int:
        return int(call(drv.cuDeviceGetAttribute, a, dev))

    raw = call(drv.cuDeviceGetName, 256, dev)
    name = raw.split(b"\0", 1)[0].decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    return DeviceInfo(ordinal, name,
                      (attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                       attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
                      int(call(drv.cuDriverGetVersion)), int(call(drv.cuDeviceTotalMem, dev)),
                      attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
                      bool(attr(A.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED)))


def mem_info() -> tuple[int, int]:
    """(free, total) bytes of the current context's device."""
    free, total = call(drv.cuMemGetInfo)
    return int(free), int(total)


class Context:
    """The device's primary context (the one PyTorch, CuPy and JAX use too, so pointers interoperate),
    retained for the session's lifetime and made current on every entry into the backend."""

    def __init__(self, ordinal: int = 0):
        init()
        self.device = call(drv.cuDeviceGet, ordinal)
        self.handle = call(drv.cuDevicePrimaryCtxRetain, self.device)
        self._live = True
        self.make_current()

    def make_current(self) -> None:
        call(drv.cuCtxSetCurrent, self.handle)

    def close(self) -> None:
        if self._live:
            self._live = False
            call(drv.cuDevicePrimaryCtxRelease, self.device)


# ============================================================================ memory
class DeviceBuffer:
    """``nbytes`` of device memory (cuMemAlloc: 256-byte aligned, never managed memory)."""

    def __init__(self, nbytes: int, what: str = "buffer"):
        self.nbytes = int(nbytes)
        try:
            self.ptr = int(call(drv.cuMemAlloc, max(self.nbytes, 1)))
        except CudaError as exc:
            raise CudaError(exc.func, exc.code, exc.name, f"allocating {self.nbytes} bytes for the {what}") from None

    def close(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            call(drv.cuMemFree, ptr)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class PinnedBuffer:
    """Page-locked host memory (DMA-able at full PCIe speed, required for truly async copies), with a
    writable numpy uint8 view ``array``."""

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        self.ptr = int(call(drv.cuMemHostAlloc, max(self.nbytes, 1), 0))
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * max(self.nbytes, 1)).from_address(self.ptr))

    def view(self, dtype: Any, count: int, offset: int = 0) -> np.ndarray:
        dt = np.dtype(dtype)
        return self.array[offset:offset + count * dt.itemsize].view(dt)

    def close(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            self.array = None  # type: ignore[assignment]
            call(drv.cuMemFreeHost, ptr)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


# ============================================================================ streams, events
class Stream:
    """A non-blocking stream (the legacy default stream cannot be captured into a graph)."""

    def __init__(self) -> None:
        self.handle = call(drv.cuStreamCreate, int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING))

    @property
    def ptr(self) -> int:
        return int(self.handle)

    def synchronize(self) -> None:
        call(drv.cuStreamSynchronize, self.handle)

    def close(self) -> None:
        if self.handle is not None:
            h, self.handle = self.handle, None
            call(drv.cuStreamDestroy, h)


class Event:
    """A stream event; ``timing=True`` for one that :meth:`elapsed_ms` can measure from (cheaper without)."""

    def __init__(self, timing: bool = False) -> None:
        flag = drv.CUevent_flags.CU_EVENT_DEFAULT if timing else drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = call(drv.cuEventCreate, int(flag))
        self.recorded = False

    def elapsed_ms(self, start: "Event") -> float:
        """Milliseconds from ``start``'s record to this event's (both timing events, both completed)."""
        return float(call(drv.cuEventElapsedTime, start.handle, self.handle))

    def record(self, stream: Stream) -> None:
        call(drv.cuEventRecord, self.handle, stream.handle)
        self.recorded = True

    def synchronize(self) -> None:
        if self.recorded:
            call(drv.cuEventSynchronize, self.handle)

    def close(self) -> None:
        if self.handle is not None:
            h, self.handle = self.handle, None
            call(drv.cuEventDestroy, h)


def stream_wait(stream: Stream, event: Event) -> None:
    """Work enqueued on ``stream`` from now on waits for ``event``'s last record (in a capture: a graph
    edge, and the way a second stream joins the capture)."""
    call(drv.cuStreamWaitEvent, stream.handle, event.handle, 0)


# ============================================================================ modules
DEFAULT_SHARED_MEM = 48 * 1024      # dynamic shared memory a kernel may take without opting in


class Module:
    """A loaded cubin (or PTX, JIT-compiled by the driver) and its kernel handles by name."""

    def __init__(self, image: bytes, what: str):
        self.what = what
        self.handle = call(drv.cuModuleLoadData, image, detail=f"loading {what}")
        self._functions: dict[str, Any] = {}
        self._shared: dict[str, int] = {}

    def function(self, name: str, shared_mem: int = 0) -> Any:
        """The kernel ``name``; with ``shared_mem`` bytes of dynamic shared memory that pass
        :data:`DEFAULT_SHARED_MEM` alone or beside the kernel's static shared memory, its limit of dynamic
        shared memory raised to at least that (``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``: without it
        a launch fails that asks more than 48 KB less the static part)."""
        f = self._functions.get(name)
        if f is None:
            f = self._functions[name] = call(drv.cuModuleGetFunction, self.handle, name.encode(),
                                             detail=f"kernel {name!r} in {self.what}")
        if shared_mem <= self._shared.get(name, 0):
            return f
        if shared_mem <= DEFAULT_SHARED_MEM:      # within the default, unless the static part takes it past
            static = call(drv.cuFuncGetAttribute, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, f,
                          detail=f"kernel {name!r} in {self.what}: its static shared memory")
            if int(static) + shared_mem <= DEFAULT_SHARED_MEM:
                return f
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        call(drv.cuFuncSetAttribute, f, attr, int(shared_mem),
             detail=f"kernel {name!r} in {self.what}: {shared_mem} bytes of dynamic shared memory")
        self._shared[name] = int(shared_mem)
        return f

    def close(self) -> None:
        if self.handle is not None:
            h, self.handle = self.handle, None
            self._functions.clear()
            call(drv.cuModuleUnload, h)


# ============================================================================ graphs
class Graph:
    """An instantiated CUDA graph captured from everything ``record(stream)`` enqueues."""

    def __init__(self, stream: Stream, record: Callable[[Stream], None]):
        call(drv.cuStreamBeginCapture, stream.handle,
             drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        try:
            record(stream)
        except BaseException:
            try:  # end the capture so the stream stays usable; the partial graph is discarded
                g = drv.cuStreamEndCapture(stream.handle)
                if isinstance(g, tuple) and len(g) > 1 and int(g[0]) == 0:
                    drv.cuGraphDestroy(g[1])
            except Exception:  # noqa: BLE001
                pass
            raise
        graph = call(drv.cuStreamEndCapture, stream.handle)
        try:
            self.exec = call(drv.cuGraphInstantiate, graph, 0)
        finally:
            call(drv.cuGraphDestroy, graph)     # the executable graph keeps its own copy

    def launch(self, stream: Stream) -> None:
        call(drv.cuGraphLaunch, self.exec, stream.handle)

    def close(self) -> None:
        if self.exec is not None:
            e, self.exec = self.exec, None
            call(drv.cuGraphExecDestroy, e)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


# ============================================================================ copies
def memcpy_htod(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    if nbytes:
        call(drv.cuMemcpyHtoDAsync, dst, src, nbytes, stream.handle)


def memcpy_dtoh(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    if nbytes:
        call(drv.cuMemcpyDtoHAsync, dst, src, nbytes, stream.handle)


def memcpy_dtod(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    if nbytes:
        call(drv.cuMemcpyDtoDAsync, dst, src, nbytes, stream.handle)


def memset(dst: int, value: int, nbytes: int, stream: Stream) -> None:
    if nbytes:
        call(drv.cuMemsetD8Async, dst, value, nbytes, stream.handle)


def launch_kernel(function: Any, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int,
                  stream: Stream, params_addr: int, programmatic: bool = False, cluster: int = 1) -> None:
    """``cuLaunchKernel`` with a pre-packed ``void**`` parameter array (see :class:`ParamPack`).

    ``programmatic``: ``cuLaunchKernelEx`` with programmatic stream serialization (sm_90+): the kernel may
    be scheduled once every block of the kernel before it has run ``griddepcontrol.launch_dependents``,
    and waits for that kernel itself (``lum_pdl_wait``, templates/common.cuh). Stream capture turns this
    into a programmatic edge of the CUDA graph. ``cluster`` > 1: the grid runs in thread block clusters of that
    many blocks along x (sm_90+; ``cuLaunchKernelEx`` with a cluster dimension)."""
    if not programmatic and cluster == 1:
        call(drv.cuLaunchKernel, function, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared_mem,
             stream.handle, params_addr, 0)
        return
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
    cfg.sharedMemBytes = shared_mem
    cfg.hStream = stream.handle
    attrs = []
    if programmatic:
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    if cluster > 1:
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
        attrs.append(attr)
    cfg.attrs = attrs
    cfg.numAttrs = len(attrs)
    call(drv.cuLaunchKernelEx, cfg, function, params_addr, 0)
