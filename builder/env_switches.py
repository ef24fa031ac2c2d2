"""Environment switches: the builder's ``$LUM_…`` knobs read as a count, one of named modes, or on / off, a value
outside those refused rather than read as the default. :class:`CodegenError` is defined here, at the bottom of
the builder's import graph, so that these helpers and the policy modules above them raise the very class that
lum.builder.codegen exports."""

from __future__ import annotations

import os
from typing import Any, Mapping

__all__ = ["CodegenError", "env_count", "env_choice", "env_switch"]


class CodegenError(ValueError):
    """An op cannot be turned into a kernel (malformed, or information such as arg dtypes missing)."""


def env_count(name: str, hi: int, default: int = 0) -> int:
    raw = os.environ.get(name, str(default))
    if not raw.isdigit() or int(raw) > hi:
        raise CodegenError(f"${name} must be an integer in [0, {hi}], got {raw!r}")
    return int(raw)


def env_choice(name: str, modes: Mapping[str, Any], default: str) -> Any:
    """``modes[$name]`` (``default`` when unset); a value not among ``modes`` is refused, naming them."""
    raw = os.environ.get(name, default)
    if raw not in modes:
        *head, last = modes
        raise CodegenError(f"${name} must be {', '.join(head)} or {last}, got {raw!r}")
    return modes[raw]


def env_switch(name: str, default: bool = False) -> bool:
    """``$name`` as an on / off switch: ``1`` or ``0``, else ``default`` when unset; anything else is refused."""
    v = os.environ.get(name, "1" if default else "0")
    if v not in ("0", "1"):
        raise ValueError(f"${name} must be 0 or 1, got {v!r}")
    return v == "1"
