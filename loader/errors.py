"""The loader's own expected errors (one-line :class:`~lum.format.errors.LumError` subclasses).

Kept apart from :mod:`lum.loader.model` so the CUDA backend can raise them without importing the
session machinery (and the session machinery can import the backend lazily)."""

from __future__ import annotations

from lum.format.errors import LumError

__all__ = ["SessionError", "BackendUnavailableError"]


class SessionError(LumError):
    """A session was asked for something its package cannot do (unknown entry, bad input, full cache)."""


class BackendUnavailableError(LumError):
    """The requested backend cannot run here (no GPU, no driver, no cuBLASLt, no compiled kernels)."""
