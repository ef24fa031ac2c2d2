"""Shared fixtures. ``cuda_device``: the GPU tests' gate — a usable CUDA device, or a skip saying why.
``nvrtc``: :mod:`lum.builder.nvrtc` where NVRTC is installed (it needs no GPU), else a skip."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cuda_device():
    """:class:`lum.loader.cuda.driver.DeviceInfo` of device 0 after a successful ``cuInit``; skips the
    test (with the reason: no cuda-python, no driver, no device) where there is none."""
    try:
        from lum.loader.cuda import driver as cu

        return cu.device_info(0)
    except Exception as exc:  # noqa: BLE001 - any failure means: no GPU tests here
        pytest.skip(f"no usable CUDA device: {' '.join(str(exc).split())[:200]}")


@pytest.fixture
def nvrtc():
    """:mod:`lum.builder.nvrtc` once ``nvrtc_version()`` answers; skips the test (with the reason) where the
    NVRTC library (nvidia-cuda-nvrtc) is not installed."""
    mod = pytest.importorskip("lum.builder.nvrtc")
    try:
        mod.nvrtc_version()
    except Exception as exc:  # noqa: BLE001 - any failure means: no NVRTC here
        pytest.skip(f"NVRTC is not installed: {exc}")
    return mod
