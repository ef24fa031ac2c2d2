"""NVRTC through ctypes: CUDA C++ source → cubin (for ``sm_XX``) + PTX (for ``compute_XX``), cached on disk.

NVRTC needs no GPU and no CUDA toolkit: the ``nvidia-cuda-nvrtc`` wheel (a dependency of the
``[build]`` extra) ships ``libnvrtc.so.*`` and ``libnvrtc-builtins.so.*``, whose built-in headers
include ``cuda_fp16.h`` and ``cuda_bf16.h`` (no ``-I`` path needed). The library is looked up, in
order, in ``$LUM_NVRTC_LIB`` (a file), the wheel's package dirs (``site-packages/nvidia/cu13/lib``,
``nvidia/cu12/lib``, ``nvidia/cuda_nvrtc/lib``), ``$CUDA_HOME``/``$CUDA_PATH``/``/usr/local/cuda*``
``/lib64``, then the dynamic loader's default search; a failure names every place searched.

    res = compile_cuda(source, arch="sm_90")       # -> CompileResult(cubin=b"\\x7fELF…", ptx="…", log, …)
    nvrtc_version()                                # -> (13, 5)

Each call runs NVRTC twice on the same source: ``--gpu-architecture=sm_90`` → ``nvrtcGetCUBIN`` and
``--gpu-architecture=compute_90`` → ``nvrtcGetPTX`` (forward compatibility: a newer driver can JIT the
PTX). Defaults are ``-std=c++17`` and accuracy first (no ``--use_fast_math``; ``fast_math=True`` turns
it on). A failing compile raises :class:`CompileError` carrying the log and the first lines of the
source. Results are cached under ``platformdirs.user_cache_dir("lum")/nvrtc/<key>`` (override the root
with ``$LUM_NVRTC_CACHE`` or ``cache_dir=``; ``cache_dir=False`` disables it), ``<key>`` being the
sha256 of (source, options, NVRTC version); files are written to a temp name and renamed (atomic),
so concurrent builders and interrupted writes never leave a torn entry.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from lum.format.atomic import atomic_write_bytes

__all__ = ["CompileError", "NvrtcNotFound", "CompileResult", "compile_cuda", "nvrtc_version",
           "nvrtc_library_path", "supported_archs", "default_cache_dir", "ptxas_registers", "ptxas_spills",
           "ptxas_shared_bytes"]

_ENV_LIB = "LUM_NVRTC_LIB"
_ENV_CACHE = "LUM_NVRTC_CACHE"
_CACHE_FORMAT = 1


class NvrtcNotFound(RuntimeError):
    """libnvrtc could not be loaded; the message lists every place searched."""


class CompileError(RuntimeError):
    """NVRTC rejected a source. ``log`` is NVRTC's program log, ``source_head`` the source's first lines."""

    def __init__(self, message: str, log: str = "", source: str = "", options: Sequence[str] = ()):
        self.log = log
        self.options = list(options)
        lines = source.splitlines()
        self.source_head = "\n".join(f"{i + 1:4d}| {ln}" for i, ln in enumerate(lines[:40]))
        more = f"\n     … ({len(lines) - 40} more lines)" if len(lines) > 40 else ""
        super().__init__(f"{message}\noptions: {' '.join(self.options)}\n--- NVRTC log ---\n{log.strip()}\n"
                         f"--- source (first lines) ---\n{self.source_head}{more}")


@dataclass
class CompileResult:
    cubin: bytes
    ptx: str
    arch: str
    options: list[str]
    log: str = ""
    key: str = ""
    cached: bool = False
    seconds: float = 0.0                     # NVRTC wall time (0 for a cache hit)
    meta: dict = field(default_factory=dict)


# ============================================================================ library discovery
def _candidate_paths() -> list[str]:
    out: list[str] = []
    env = os.environ.get(_ENV_LIB)
    if env:
        out.append(env)
    roots: list[str] = []
    try:
        import nvidia  # namespace package of the NVIDIA wheels

        roots.extend(list(getattr(nvidia, "__path__", [])))
    except ImportError:
        pass
    for p in sys.path:
        cand = os.path.join(p, "nvidia")
        if os.path.isdir(cand) and cand not in roots:
            roots.append(cand)
    for r in roots:
        for sub in ("cu13/lib", "cu12/lib", "cuda_nvrtc/lib"):
            out.append(os.path.join(r, sub, "libnvrtc.so*"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            out.append(os.path.join(os.environ[var], "lib64", "libnvrtc.so*"))
            out.append(os.path.join(os.environ[var], "lib", "libnvrtc.so*"))
    out.append("/usr/local/cuda/lib64/libnvrtc.so*")
    out.append("/usr/local/cuda-*/lib64/libnvrtc.so*")
    out.append("/usr/lib/x86_64-linux-gnu/libnvrtc.so*")
    return out


def _version_key(path: str) -> tuple:
    # prefer the newest toolkit dir, then the shortest soname (libnvrtc.so.13 over libnvrtc.so.13.5.37)
    parts = [int(x) for x in "".join(c if c.isdigit() else " " for c in path).split()]
    return (tuple(parts), -len(path))


_lib: ctypes.CDLL | None = None
_lib_path: str | None = None
_lib_lock = threading.Lock()


def _load() -> ctypes.CDLL:
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        searched: list[str] = []
        errors: list[str] = []
        for pattern in _candidate_paths():
            searched.append(pattern)
            hits = sorted(glob.glob(pattern), key=_version_key, reverse=True) if any(
                ch in pattern for ch in "*?[") else ([pattern] if os.path.exists(pattern) else [])
            for path in hits:
                if "builtins" in os.path.basename(path) or ".alt." in os.path.basename(path):
                    continue
                try:
                    _preload_builtins(path)
                    lib = ctypes.CDLL(path)
                except OSError as e:
                    errors.append(f"{path}: {e}")
                    continue
                _setup(lib)
                _lib, _lib_path = lib, path
                return lib
        for name in ("libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"):
            searched.append(f"dlopen({name})")
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                continue
            _setup(lib)
            _lib, _lib_path = lib, name
            return lib
        msg = ("libnvrtc not found. Install the NVRTC wheel (pip install 'lum[build]' or "
               "pip install nvidia-cuda-nvrtc), set $CUDA_HOME, or point $LUM_NVRTC_LIB at libnvrtc.so.\n"
               "Searched:\n  " + "\n  ".join(searched))
        if errors:
            msg += "\nFound but failed to load:\n  " + "\n  ".join(errors)
        raise NvrtcNotFound(msg)


def _preload_builtins(nvrtc_path: str) -> None:
    """libnvrtc dlopen()s ``libnvrtc-builtins.so.<major>.<minor>`` by bare name and some wheels set no
    RPATH, so load the one next to it first (RTLD_GLOBAL: the later dlopen then finds it by soname)."""
    d = os.path.dirname(nvrtc_path)
    if not d:
        return
    for path in sorted(glob.glob(os.path.join(d, "libnvrtc-builtins.so*")), key=_version_key, reverse=True):
        if ".alt." in os.path.basename(path):
            continue
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue


def _setup(lib: ctypes.CDLL) -> None:
    c_int, c_size, c_char_p, c_void_p = ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p
    P = ctypes.POINTER
    sig = {
        "nvrtcVersion": [P(c_int), P(c_int)],
        "nvrtcGetErrorString": [c_int],
        "nvrtcCreateProgram": [P(c_void_p), c_char_p, c_char_p, c_int, P(c_char_p), P(c_char_p)],
        "nvrtcDestroyProgram": [P(c_void_p)],
        "nvrtcCompileProgram": [c_void_p, c_int, P(c_char_p)],
        "nvrtcGetPTXSize": [c_void_p, P(c_size)],
        "nvrtcGetPTX": [c_void_p, c_char_p],
        "nvrtcGetCUBINSize": [c_void_p, P(c_size)],
        "nvrtcGetCUBIN": [c_void_p, c_char_p],
        "nvrtcGetProgramLogSize": [c_void_p, P(c_size)],
        "nvrtcGetProgramLog": [c_void_p, c_char_p],
        "nvrtcGetNumSupportedArchs": [P(c_int)],
        "nvrtcGetSupportedArchs": [P(c_int)],
    }
    for name, args in sig.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = c_char_p if name == "nvrtcGetErrorString" else c_int


def nvrtc_library_path() -> str:
    _load()
    assert _lib_path is not None
    return _lib_path


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the loaded NVRTC."""
    lib = _load()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def supported_archs() -> list[int]:
    """SM versions this NVRTC can target (e.g. [75, 80, …, 90, 100, 120])."""
    lib = _load()
    n = ctypes.c_int()
    _check(lib, lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "nvrtcGetNumSupportedArchs")
    arr = (ctypes.c_int * n.value)()
    _check(lib, lib.nvrtcGetSupportedArchs(arr), "nvrtcGetSupportedArchs")
    return list(arr)


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        err = lib.nvrtcGetErrorString(rc)
        raise RuntimeError(f"{what} failed: {err.decode() if err else rc}")


# ============================================================================ compile
def _arch_number(arch: str | int) -> int:
    s = str(arch)
    for prefix in ("sm_", "compute_"):
        if s.startswith(prefix):
            s = s[len(prefix):]
    digits = s.rstrip("af")  # sm_90a / sm_100f feature suffixes are kept in the option below
    if not digits.isdigit():
        raise ValueError(f"bad target architecture {arch!r}; expected e.g. 'sm_90'")
    return int(digits)


def build_options(arch: str | int = "sm_90", *, std: str = "c++17", fast_math: bool = False,
                  lineinfo: bool = False, extra: Sequence[str] = ()) -> list[str]:
    """The options shared by the cubin and PTX compiles (without ``--gpu-architecture``)."""
    _arch_number(arch)
    opts = [f"-std={std}"]
    if fast_math:
        opts.append("--use_fast_math")
    if lineinfo:
        opts.append("--generate-line-info")
    opts.extend(extra)
    return opts


def _run_nvrtc(lib: ctypes.CDLL, source: str, name: str, options: list[str], want: str) -> tuple[bytes, str]:
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if rc != 0:
            err = lib.nvrtcGetErrorString(rc)
            raise CompileError(f"NVRTC failed to compile {name!r} ({err.decode() if err else rc})",
                               log, source, options)
        if want == "cubin":
            _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            out = ctypes.create_string_buffer(size.value)
            _check(lib, lib.nvrtcGetCUBIN(prog, out), "nvrtcGetCUBIN")
            return out.raw[:size.value], log
        _check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
        out = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetPTX(prog, out), "nvrtcGetPTX")
        return out.raw[:size.value].rstrip(b"\0"), log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def default_cache_dir() -> Path:
    env = os.environ.get(_ENV_CACHE)
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("lum")) / "nvrtc"


def cache_key(source: str, options: Sequence[str], arch: str, ptx: bool) -> str:
    h = hashlib.sha256()
    for part in (f"lum-nvrtc-cache/{_CACHE_FORMAT}", "%d.%d" % nvrtc_version(), str(arch), str(bool(ptx)),
                 "\x1f".join(options), source):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _cache_read(d: Path) -> CompileResult | None:
    try:
        meta = json.loads((d / "meta.json").read_text())
        cubin = (d / "kernel.cubin").read_bytes()
        ptx = (d / "kernel.ptx").read_text() if meta.get("ptx") else ""
    except (OSError, ValueError):
        return None
    if (meta.get("format") != _CACHE_FORMAT or hashlib.sha256(cubin).hexdigest() != meta.get("cubin_sha256")
            or cubin[:4] != b"\x7fELF"):
        return None
    return CompileResult(cubin, ptx, meta["arch"], list(meta["options"]), meta.get("log", ""), d.name,
                         cached=True, meta=meta)


def _cache_write(d: Path, res: CompileResult, want_ptx: bool) -> None:
    # payload files first, meta.json (the commit marker, with the cubin's hash) last
    atomic_write_bytes(d / "kernel.cubin", res.cubin)
    if want_ptx:
        atomic_write_bytes(d / "kernel.ptx", res.ptx.encode())
    meta = {"format": _CACHE_FORMAT, "arch": res.arch, "options": res.options, "log": res.log,
            "ptx": want_ptx, "cubin_sha256": hashlib.sha256(res.cubin).hexdigest(),
            "nvrtc": "%d.%d" % nvrtc_version(), "seconds": round(res.seconds, 4)}
    atomic_write_bytes(d / "meta.json", json.dumps(meta, sort_keys=True).encode())


def compile_cuda(source: str, arch: str | int = "sm_90", *, name: str = "lum_kernels.cu", ptx: bool = True,
                 fast_math: bool = False, lineinfo: bool = False, extra_options: Sequence[str] = (),
                 cache_dir: str | os.PathLike | bool | None = None) -> CompileResult:
    """Compile ``source`` to a cubin for ``arch`` (``sm_90`` by default) and, with ``ptx``, PTX for the
    matching ``compute_XX``. ``cache_dir``: None → the default cache, a path → that cache root, False → none.
    Raises :class:`CompileError` (log + source head) or :class:`NvrtcNotFound`."""
    lib = _load()
    num = _arch_number(arch)
    suffix = str(arch).split(str(num), 1)[1] if str(num) in str(arch) else ""
    sm, compute = f"sm_{num}{suffix}", f"compute_{num}{suffix}"
    opts = build_options(arch, fast_math=fast_math, lineinfo=lineinfo, extra=extra_options)
    key = cache_key(source, opts, sm, ptx)
    cdir: Path | None = None
    if cache_dir is not False:
        cdir = (default_cache_dir() if cache_dir in (None, True) else Path(cache_dir)) / key  # type: ignore[arg-type]
        hit = _cache_read(cdir)
        if hit is not None:
            return hit
    t0 = time.perf_counter()
    cubin, log = _run_nvrtc(lib, source, name, [f"--gpu-architecture={sm}", *opts], "cubin")
    ptx_text = ""
    if ptx:
        ptx_bytes, log2 = _run_nvrtc(lib, source, name, [f"--gpu-architecture={compute}", *opts], "ptx")
        ptx_text = ptx_bytes.decode()
        if log2.strip() and log2.strip() != log.strip():
            log = (log + "\n" + log2).strip()
    res = CompileResult(cubin, ptx_text, sm, opts, log, key, cached=False, seconds=time.perf_counter() - t0)
    if cubin[:4] != b"\x7fELF":
        raise CompileError("NVRTC returned a cubin that is not an ELF image", log, source, opts)
    if cdir is not None:
        try:
            _cache_write(cdir, res, ptx)
        except OSError:
            pass  # a read-only or full cache never fails a build
    return res


_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_SMEM = re.compile(r"Used \d+ registers.*?(?:(\d+) bytes smem|$)")


def _ptxas_per_entry(log: str, pattern: re.Pattern, value: Callable[[re.Match], int]) -> dict[str, int]:
    """``value`` of the first line matching ``pattern`` after each kernel's line in a ``ptxas -v`` log."""
    out: dict[str, int] = {}
    entry = None
    for line in log.splitlines():
        m = _PTXAS_ENTRY.search(line)
        if m:
            entry = m.group(1)
            continue
        m = pattern.search(line)
        if m and entry is not None:
            out[entry] = value(m)
            entry = None
    return out


def ptxas_spills(log: str) -> dict[str, int]:
    """Spilled bytes (stores + loads) per thread of each kernel that spills, from a ``ptxas -v`` log."""
    found = _ptxas_per_entry(log, _PTXAS_SPILLS, lambda m: int(m.group(1)) + int(m.group(2)))
    return {k: v for k, v in found.items() if v}


def ptxas_registers(log: str) -> dict[str, int]:
    """Registers per thread of each kernel, from the log of a compile with ``--ptxas-options=-v``."""
    return _ptxas_per_entry(log, _PTXAS_REGS, lambda m: int(m.group(1)))


def ptxas_shared_bytes(log: str) -> dict[str, int]:
    """Static shared memory bytes of each kernel (0 where ptxas names none), from a ``ptxas -v`` log."""
    return _ptxas_per_entry(log, _PTXAS_SMEM, lambda m: int(m.group(1) or 0))
