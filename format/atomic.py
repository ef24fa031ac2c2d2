"""Atomic file writes: a reader (or a crash) sees the old file or the whole new one, never a half.

Data goes to a temporary file in the target's folder (``.<name>.<random>.tmp``), is flushed and
fsynced, then renamed over the target, and the folder is fsynced so the rename itself survives a
crash. On any failure the temporary file is removed and the target is left untouched.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, buffering: int = -1) -> Iterator[BinaryIO]:
    """``with atomic_file(p) as f: f.write(...)`` — ``p`` appears only if the block completes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb", buffering=buffering) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_file(path) as f:
        f.write(data)
    return Path(path)


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where folders cannot be fsynced)."""
    if os.name != "posix":
        return
    try:
        dfd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
