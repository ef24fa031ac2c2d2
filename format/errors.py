"""The errors lum raises for expected failures (a bad package, an incompatible target …).

Every one derives from :class:`LumError`, whose message is a single line. Errors about a file begin with
its path (``model.lumpkg: section 'weights' hash mismatch``), so the ``lum`` CLI can print ``str(exc)``
as is. Programming errors (a wrong argument type, a misuse of the writer) stay ``TypeError`` /
``ValueError``; I/O failures of the operating system (missing file, permission) stay ``OSError``.
"""

from __future__ import annotations

import os
from typing import Optional, Union

__all__ = [
    "LumError",
    "PackageFormatError",
    "UnsupportedVersionError",
    "UnknownFeatureError",
    "IntegrityError",
    "IncompatibleTargetError",
    "MissingSectionError",
]

PathLike = Union[str, "os.PathLike[str]"]


class LumError(Exception):
    """Base of lum's expected errors. ``str(exc)`` is one line: ``"<path>: <reason>"`` or ``"<reason>"``.

    Attributes: ``path`` (the file concerned, or None) and ``reason`` (the message without the path).
    """

    def __init__(self, message: object = "", *, path: Optional[PathLike] = None) -> None:
        self.reason = " ".join(str(message).split())
        self.path = os.fspath(path) if path is not None else None
        text = f"{self.path}: {self.reason}" if self.path else self.reason
        super().__init__(text)


class PackageFormatError(LumError):
    """The file is not a well-formed package: bad magic, truncated, out-of-bounds or overlapping sections,
    undecodable zstd data or manifest, a section too small for the array asked of it."""


class UnsupportedVersionError(PackageFormatError):
    """The package's format major version is one this reader does not implement (newer, or unknown)."""


class UnknownFeatureError(PackageFormatError):
    """The package needs a feature (a required feature string, codec or section kind) this reader lacks."""


class IntegrityError(PackageFormatError):
    """A hash does not match: the file was corrupted after it was written."""


class MissingSectionError(PackageFormatError):
    """A section that was asked for (or that every package must have) is absent."""


class IncompatibleTargetError(LumError):
    """The package was built for another GPU architecture, driver or CUDA version than the one present."""
