"""Weights, constants and state onto the device: one allocation each, filled from the package's mmap.

**Layout** (:func:`pack`): tensors are placed back to back at 256-byte alignment (cuBLASLt's and the
kernels' vector loads want ≥ 16), so one ``cuMemAlloc`` holds all weights and a session owns a handful
of allocations, not thousands.

**Upload paths.** The weights are raw, page-aligned sections of the memory-mapped package.

* ``"staged"`` (default): a few CPU threads fill page-locked staging buffers (64 MiB, two of them)
  while the DMA engine drains the other one (``cuMemcpyHtoDAsync``; an event per buffer guards its
  reuse). A weight section is read with ``pread`` from the package file straight into the staging
  buffer — the same page-cache pages the mmap shows, copied once by the kernel without a page fault
  per 4 KiB of mapping, which is what limits a memcpy from a fresh mapping; other sources are copied
  from memory. Works everywhere.
* ``"register"``: ``cuMemHostRegister(…, READ_ONLY)`` pins the mapped pages themselves and the DMA
  reads them directly (no CPU copy). Needs the driver's read-only registration support; on any
  failure it falls back to ``"staged"``.

Either way the achieved rate is measured (bytes / wall seconds, including page-cache misses) and
reported as :attr:`UploadStats.gbps`.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from lum.loader.cuda import driver as cu

__all__ = ["ALIGN", "PackedLayout", "pack", "HostBytes", "UploadStats", "upload", "upload_staged", "upload_registered"]

ALIGN = 256
CHUNK = 64 << 20
PAGE = 4096


@dataclass(frozen=True)
class PackedLayout:
    offsets: dict[str, int]
    sizes: dict[str, int]
    total: int


def pack(sizes: Mapping[str, int], align: int = ALIGN) -> PackedLayout:
    """Back-to-back offsets (in the given order) at ``align``; zero-size tensors get distinct slots too."""
    offsets: dict[str, int] = {}
    pos = 0
    for name, n in sizes.items():
        offsets[name] = pos
        pos += (max(int(n), 1) + align - 1) // align * align
    return PackedLayout(offsets, {k: int(v) for k, v in sizes.items()}, pos)


@dataclass(frozen=True)
class HostBytes:
    """Bytes to upload: ``view`` (e.g. a section of the package's mmap) and, when they are a range of
    a file, where (``path``, ``offset``), so the staged path can ``pread`` them."""

    view: object
    path: str | None = None
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return memoryview(self.view).nbytes if not isinstance(self.view, np.ndarray) else self.view.nbytes


@dataclass(frozen=True)
class UploadStats:
    bytes: int
    seconds: float
    method: str

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _as_bytes(src) -> np.ndarray:
    if isinstance(src, HostBytes):
        src = src.view
    return np.frombuffer(src, dtype=np.uint8) if not isinstance(src, np.ndarray) else src.reshape(-1).view(np.uint8)


def _pread_into(fd: int, dst: np.ndarray, offset: int) -> None:
    mv = memoryview(dst)
    done = 0
    while done < dst.size:
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file reading {dst.size} bytes at offset {offset}")
        done += n


def upload_staged(pieces: Sequence[tuple[object, int]], stream: cu.Stream, chunk: int = CHUNK, buffers: int = 2,
                  threads: int | None = None) -> UploadStats:
    """Copy each ``(host bytes, device address)`` through pinned double buffers (see the module doc);
    a :class:`HostBytes` with a ``path`` is read from its file."""
    t0 = time.perf_counter()
    threads = threads or min(8, os.cpu_count() or 4)
    srcs = [(_as_bytes(s), int(d), s if isinstance(s, HostBytes) and s.path else None) for s, d in pieces]
    total = sum(s.size for s, _, _ in srcs)
    if not total:
        return UploadStats(0, 0.0, "staged")
    fds = {f.path: os.open(f.path, os.O_RDONLY) for _, _, f in srcs if f is not None}
    chunk = min(chunk, (total + PAGE - 1) // PAGE * PAGE)
    bufs = [cu.PinnedBuffer(chunk) for _ in range(buffers)]
    events = [cu.Event() for _ in range(buffers)]
    pool = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None
    try:
        cur, fill = 0, 0
        pending: list[tuple[int, int, int]] = []          # (device address, offset in buffer, bytes)

        def copy_part(dst: np.ndarray, src: np.ndarray, file: HostBytes | None, pos: int) -> None:
            if file is None:
                np.copyto(dst, src)
            else:
                _pread_into(fds[file.path], dst, file.offset + pos)

        def copy_in(dst: np.ndarray, src: np.ndarray, file: HostBytes | None, pos: int) -> None:
            n = src.size
            if pool is None or n < (8 << 20):
                copy_part(dst, src, file, pos)
                return
            step = (n + threads - 1) // threads
            list(pool.map(lambda i: copy_part(dst[i:i + step], src[i:i + step], file, pos + i), range(0, n, step)))

        def flush() -> None:
            nonlocal cur, fill, pending
            for dev, off, n in pending:
                cu.memcpy_htod(dev, bufs[cur].ptr + off, n, stream)
            events[cur].record(stream)
            cur = (cur + 1) % buffers
            events[cur].synchronize()                       # its previous copies are done: refill it
            fill, pending = 0, []

        for src, dev, file in srcs:
            pos = 0
            while pos < src.size:
                n = min(src.size - pos, chunk - fill)
                copy_in(bufs[cur].array[fill:fill + n], src[pos:pos + n], file, pos)
                pending.append((dev + pos, fill, n))
                fill += n
                pos += n
                if fill == chunk:
                    flush()
        if pending:
            flush()
        stream.synchronize()
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        for fd in fds.values():
            os.close(fd)
        for e in events:
            e.close()
        for b in bufs:
            b.close()
    return UploadStats(total, time.perf_counter() - t0, "staged")


def upload_registered(pieces: Sequence[tuple[object, int]], stream: cu.Stream) -> UploadStats:
    """Pin the mapped pages in place (read-only registration) and DMA straight from them."""
    t0 = time.perf_counter()
    srcs = [(_as_bytes(s), int(d)) for s, d in pieces]
    srcs = [(s, d) for s, d in srcs if s.size]
    total = sum(s.size for s, _ in srcs)
    if not total:
        return UploadStats(0, 0.0, "register")
    lo = min(s.ctypes.data for s, _ in srcs) // PAGE * PAGE
    hi = (max(s.ctypes.data + s.size for s, _ in srcs) + PAGE - 1) // PAGE * PAGE
    cu.call(cu.drv.cuMemHostRegister, lo, hi - lo, cu.drv.CU_MEMHOSTREGISTER_READ_ONLY,
            detail="read-only registration of the package's mapped weights")
    try:
        for s, d in srcs:
            cu.memcpy_htod(d, s.ctypes.data, s.size, stream)
        stream.synchronize()
    finally:
        cu.call(cu.drv.cuMemHostUnregister, lo)
    return UploadStats(total, time.perf_counter() - t0, "register")


def upload(pieces: Sequence[tuple[object, int]], stream: cu.Stream, method: str = "staged",
           read_only_register: bool = False) -> UploadStats:
    """Upload with ``method`` (``"staged"`` or ``"register"``, which falls back to staged on failure)."""
    if method not in ("staged", "register"):
        raise ValueError(f"upload method must be 'staged' or 'register', not {method!r}")
    if method == "register" and read_only_register:
        try:
            return upload_registered(pieces, stream)
        except cu.CudaError as exc:
            stats = upload_staged(pieces, stream)
            return UploadStats(stats.bytes, stats.seconds, f"staged (register failed: {exc.name})")
    return upload_staged(pieces, stream)
