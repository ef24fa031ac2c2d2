"""cuBLASLt through its shared library (ctypes): the loader's GEMM for LLIR ``gemm`` ops.

cuda-python has no cuBLASLt binding, so this module declares the few entry points it needs itself.
It imports only the standard library (``cuda.bindings`` lazily, for the k == 0 memset).

    lt = CublasLt.load()                                   # finds libcublasLt, creates a handle
    plan = lt.matmul_plan("RmCm", m, n, k, lda, ldb, n, batch, stride_a, stride_b, m * n, DType.bf16)
    plan.run(stream, a_ptr, b_ptr, c_ptr, workspace_ptr, workspace_bytes)
    plan.algo_bytes()                                      # 64 bytes, storable in a package
    plan.candidates()                                      # the heuristic's top-N, for build-time timing

**The mapping.** An LLIR gemm computes, per batch ``b``, the row-major ``C[b] = A[b] @ B[b]`` ([m, n],
ldc = n) where A is row-major ``A[i, l] = a[i*lda + l]`` (``Rm..``) or column-major ``a[i + l*lda]``
(``Cm..``) and B likewise (``..Rm`` / ``..Cm``). cuBLAS is column-major, and a row-major [m, n] matrix
with ld n *is* the column-major [n, m] matrix Cᵀ with ld n. So the plan asks cuBLAS for

    Cᵀ (n × m, ld n) = op(X) · op(Y),   X = our B, Y = our A (operands swapped), m' = n, n' = m, k' = k

* our B row-major: its memory read column-major with ld = ldb is the [n, k] matrix Bᵀ → transa = N;
  our B column-major: read with ld = ldb it is the [k, n] matrix B → transa = T (op(X) = Bᵀ).
* our A row-major: read column-major with ld = lda it is the [k, m] matrix Aᵀ → transb = N;
  our A column-major: it is the [m, k] matrix A → transb = T (op(Y) = Aᵀ).

Batch strides follow their operands (X gets stride_b, Y stride_a; 0 broadcasts), C's is m·n.
:func:`lt_problem` is that mapping as pure Python, unit-tested against numpy without a GPU.

**Numerics.** f32: ``CUBLAS_COMPUTE_32F`` (no TF32). bf16/f16: inputs and C/D in that type, compute and
scale types 32F (accumulate in float32, round once); mixed: bf16/f16 inputs with f32 C/D (no rounding of
the result). alpha = 1, beta = 0, C = D.

**CUDA context.** cuBLASLt uses the CUDA runtime it links statically, which runs on the context current on
the calling thread (or the device's primary context). Make the loader's context current before
:meth:`CublasLt.load` and before every plan call; a plan's ``run`` is capturable in a CUDA graph (it
allocates nothing: the workspace is the caller's).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import operator
import os
import site
import sys
from typing import NamedTuple

from lum.format.dtypes import DType
from lum.format.errors import LumError

__all__ = [
    "CublasLt", "MatmulPlan", "LtProblem", "LtAlgo", "CublasLtUnavailable", "CublasLtError", "lt_problem",
    "DEFAULT_WORKSPACE_BYTES", "ALGO_BYTES",
]

# ---------------------------------------------------------------------- header values (cublas_api.h,
# cublasLt.h, library_types.h of CUDA 13.0; the values are ABI and have not changed since CUDA 11)
CUBLAS_STATUS_SUCCESS = 0
CUBLAS_STATUS_NAMES = {0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
                       7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH",
                       11: "CUBLAS_STATUS_MAPPING_ERROR", 13: "CUBLAS_STATUS_EXECUTION_FAILED",
                       14: "CUBLAS_STATUS_INTERNAL_ERROR", 15: "CUBLAS_STATUS_NOT_SUPPORTED",
                       16: "CUBLAS_STATUS_LICENSE_ERROR"}
CUBLAS_STATUS_NOT_SUPPORTED = 15

CUBLAS_OP_N = 0
CUBLAS_OP_T = 1

CUBLAS_COMPUTE_32F = 68            # float, default: no TF32 (that is CUBLAS_COMPUTE_32F_FAST_TF32 = 77)

CUDA_R_32F = 0
CUDA_R_16F = 2
CUDA_R_16BF = 14

# cublasLtMatmulDescAttributes_t
CUBLASLT_MATMUL_DESC_COMPUTE_TYPE = 0   # int32
CUBLASLT_MATMUL_DESC_SCALE_TYPE = 1     # int32
CUBLASLT_MATMUL_DESC_POINTER_MODE = 2   # int32
CUBLASLT_MATMUL_DESC_TRANSA = 3         # int32 (cublasOperation_t)
CUBLASLT_MATMUL_DESC_TRANSB = 4         # int32

# cublasLtMatrixLayoutAttribute_t
CUBLASLT_MATRIX_LAYOUT_TYPE = 0                  # uint32
CUBLASLT_MATRIX_LAYOUT_ORDER = 1                 # int32 (cublasLtOrder_t; COL = 0, ROW = 1)
CUBLASLT_MATRIX_LAYOUT_ROWS = 2                  # uint64
CUBLASLT_MATRIX_LAYOUT_COLS = 3                  # uint64
CUBLASLT_MATRIX_LAYOUT_LD = 4                    # int64
CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5           # int32
CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6  # int64, in elements
CUBLASLT_ORDER_COL = 0

# cublasLtMatmulPreferenceAttributes_t
CUBLASLT_MATMUL_PREF_SEARCH_MODE = 0             # uint32
CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1     # uint64
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5   # uint32
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6   # uint32
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7   # uint32
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8   # uint32

DEFAULT_WORKSPACE_BYTES = 32 * 2**20
DEFAULT_ALIGNMENT = 256              # bytes the caller guarantees for buffer base pointers (lum.loader.arena.ALIGN)
ALGO_BYTES = 64
GEMM_LAYOUTS = ("RmRm", "RmCm", "CmRm", "CmCm")

_DATA_TYPE = {DType.f32: CUDA_R_32F, DType.bf16: CUDA_R_16BF, DType.f16: CUDA_R_16F}


class CublasLtUnavailable(LumError):
    """cuBLASLt cannot be used here: the library is missing, or its handle cannot be created (no GPU)."""


class CublasLtError(LumError):
    """A cuBLASLt call failed (its status name is in the message), or a problem has no algorithm."""


# ====================================================================== the mapping (pure Python)
class LtProblem(NamedTuple):
    """The column-major cuBLAS problem for one LLIR gemm (see the module docstring).

    cuBLAS computes ``D (m × n, ld ldc) = op(X) · op(Y)`` with X stored column-major as ``a_rows × a_cols``
    (ld ``lda``) and Y as ``b_rows × b_cols`` (ld ``ldb``). ``swap``: X is the LLIR's B and Y its A.
    """

    transa: int
    transb: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    swap: bool

    @property
    def a_rows(self) -> int:
        return self.m if self.transa == CUBLAS_OP_N else self.k

    @property
    def a_cols(self) -> int:
        return self.k if self.transa == CUBLAS_OP_N else self.m

    @property
    def b_rows(self) -> int:
        return self.k if self.transb == CUBLAS_OP_N else self.n

    @property
    def b_cols(self) -> int:
        return self.n if self.transb == CUBLAS_OP_N else self.k


def _int(name: str, v) -> int:
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"gemm {name} must be an int (evaluate symbolic parameters first), got {v!r}") from None


def _fit_ld(what: str, ld: int, rows: int, cols: int) -> int:
    """cuBLAS wants ld >= rows of the stored column-major matrix. A single column never steps by ld, so
    any ld addresses it: raise it to rows. Overlapping columns (ld < rows, cols > 1) have no cuBLAS form."""
    if cols <= 1:
        return max(ld, rows, 1)
    if ld < max(rows, 1):
        raise ValueError(f"gemm {what}: leading dimension {ld} is smaller than the {rows} contiguous elements of "
                         f"each of its {cols} lines (overlapping lines have no cuBLAS layout)")
    return ld


def lt_problem(layout: str, m: int, n: int, k: int, lda: int, ldb: int, ldc: int | None = None) -> LtProblem:
    """The cuBLAS column-major call computing the row-major LLIR gemm ``C = A @ B`` (module docstring).

    Returns ``(transa, transb, m', n', k', lda', ldb', ldc', swap)``: operand X of the cuBLAS call is the
    LLIR's B (``swap`` is always True: the transpose trick), Y is A, m' = n, n' = m, k' = k, ldc' = n.
    Leading dims of single-column operands are raised to their row count (cuBLAS checks ld >= rows).
    """
    if layout not in GEMM_LAYOUTS:
        raise ValueError(f"gemm layout {layout!r} is not one of {GEMM_LAYOUTS}")
    m, n, k, lda, ldb = (_int(x, v) for x, v in zip(("m", "n", "k", "lda", "ldb"), (m, n, k, lda, ldb)))
    if min(m, n, k) < 0 or min(lda, ldb) < 1:
        raise ValueError(f"gemm sizes must be non-negative and lda/ldb positive: m={m} n={n} k={k} lda={lda} ldb={ldb}")
    if ldc is not None and _int("ldc", ldc) != n:
        raise ValueError(f"gemm ldc must equal n ({n}): C is row-major [batch, m, n]")
    a_rm, b_rm = layout[:2] == "Rm", layout[2:] == "Rm"
    # X = our B.  Row-major B read column-major is Bᵀ [n, k] (no transpose); column-major B is B [k, n] (T).
    transa = CUBLAS_OP_N if b_rm else CUBLAS_OP_T
    xr, xc = (n, k) if b_rm else (k, n)
    # Y = our A.  Row-major A read column-major is Aᵀ [k, m] (no transpose); column-major A is A [m, k] (T).
    transb = CUBLAS_OP_N if a_rm else CUBLAS_OP_T
    yr, yc = (k, m) if a_rm else (m, k)
    ld_x = _fit_ld("B (ldb)", ldb, xr, xc)
    ld_y = _fit_ld("A (lda)", lda, yr, yc)
    return LtProblem(transa, transb, n, m, k, ld_x, ld_y, max(n, 1), True)


# ====================================================================== ctypes plumbing
class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


assert ctypes.sizeof(_Algo) == ALGO_BYTES
assert ctypes.sizeof(_HeuristicResult) == 96

_vp = ctypes.c_void_p
_pvp = ctypes.POINTER(ctypes.c_void_p)
_SIGNATURES = {
    "cublasLtCreate": (ctypes.c_int, [_pvp]),
    "cublasLtDestroy": (ctypes.c_int, [_vp]),
    "cublasLtGetVersion": (ctypes.c_size_t, []),
    "cublasLtGetStatusName": (ctypes.c_char_p, [ctypes.c_int]),
    "cublasLtMatmulDescCreate": (ctypes.c_int, [_pvp, ctypes.c_int, ctypes.c_int]),
    "cublasLtMatmulDescDestroy": (ctypes.c_int, [_vp]),
    "cublasLtMatmulDescSetAttribute": (ctypes.c_int, [_vp, ctypes.c_int, _vp, ctypes.c_size_t]),
    "cublasLtMatrixLayoutCreate": (ctypes.c_int, [_pvp, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                                  ctypes.c_int64]),
    "cublasLtMatrixLayoutDestroy": (ctypes.c_int, [_vp]),
    "cublasLtMatrixLayoutSetAttribute": (ctypes.c_int, [_vp, ctypes.c_int, _vp, ctypes.c_size_t]),
    "cublasLtMatmulPreferenceCreate": (ctypes.c_int, [_pvp]),
    "cublasLtMatmulPreferenceDestroy": (ctypes.c_int, [_vp]),
    "cublasLtMatmulPreferenceSetAttribute": (ctypes.c_int, [_vp, ctypes.c_int, _vp, ctypes.c_size_t]),
    "cublasLtMatmulAlgoGetHeuristic": (ctypes.c_int, [_vp, _vp, _vp, _vp, _vp, _vp, _vp, ctypes.c_int,
                                                      ctypes.POINTER(_HeuristicResult),
                                                      ctypes.POINTER(ctypes.c_int)]),
    "cublasLtMatmulAlgoCheck": (ctypes.c_int, [_vp, _vp, _vp, _vp, _vp, _vp, ctypes.POINTER(_Algo),
                                               ctypes.POINTER(_HeuristicResult)]),
    "cublasLtMatmul": (ctypes.c_int, [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp,
                                      ctypes.POINTER(_Algo), _vp, ctypes.c_size_t, _vp]),
}

_SONAMES = ("libcublasLt.so.13", "libcublasLt.so.12")


def _library_candidates() -> list[str]:
    """Paths and names to try, in order (see :meth:`CublasLt.load`)."""
    out: list[str] = []
    env = os.environ.get("LUM_CUBLASLT")
    if env:
        out.append(env)
    roots: list[str] = []
    try:
        roots += site.getsitepackages()
    except AttributeError:  # some virtualenvs
        pass
    try:
        roots.append(site.getusersitepackages())
    except AttributeError:
        pass
    roots += [p for p in sys.path if p and p.endswith(("site-packages", "dist-packages"))]
    seen: set[str] = set()
    for r in roots:
        if r in seen:
            continue
        seen.add(r)
        for sub, name in (("nvidia/cu13/lib", "libcublasLt.so.13"), ("nvidia/cublas/lib", "libcublasLt.so.13"),
                          ("nvidia/cublas/lib", "libcublasLt.so.12")):
            out.append(os.path.join(r, sub, name))
    homes = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    homes += sorted(glob.glob("/usr/local/cuda-1[0-9]*"), reverse=True)
    for h in homes:
        if h:
            for name in _SONAMES + ("libcublasLt.so",):
                out.append(os.path.join(h, "lib64", name))
    found = ctypes.util.find_library("cublasLt")
    if found:
        out.append(found)
    out += list(_SONAMES) + ["libcublasLt.so"]
    dedup: list[str] = []
    for p in out:
        if p not in dedup:
            dedup.append(p)
    return dedup


_LIB: tuple[ctypes.CDLL, str] | None = None


def _already_loaded() -> tuple[ctypes.CDLL, str] | None:
    nl = getattr(os, "RTLD_NOLOAD", 0)
    if not nl:
        return None
    for so in _SONAMES:
        try:
            return ctypes.CDLL(so, mode=nl | getattr(os, "RTLD_GLOBAL", 0)), f"{so} (already loaded)"
        except OSError:
            pass
    return None


def _open_library(path: str | None = None) -> tuple[ctypes.CDLL, str]:
    global _LIB
    if path is None and _LIB is not None:
        return _LIB
    tried: list[str] = []
    lib = None
    where = ""
    if path is not None:
        candidates = [path]
    else:
        # a copy already in the process (e.g. PyTorch's) first: one cuBLASLt, one heuristics cache
        found = _already_loaded()
        if found is not None:
            lib, where = found
        candidates = _library_candidates() if lib is None else []
    for cand in candidates:
        if os.sep in cand and not os.path.exists(cand):
            tried.append(cand)
            continue
        try:
            lib = ctypes.CDLL(cand)
            where = cand
            break
        except OSError as exc:
            tried.append(f"{cand} ({' '.join(str(exc).split())[:80]})" if os.sep in cand else cand)
    if lib is None:
        raise CublasLtUnavailable("cuBLASLt library not found (set LUM_CUBLASLT to its path); tried: "
                                  + ", ".join(tried))
    try:
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
    except AttributeError as exc:
        raise CublasLtUnavailable(f"{where} lacks a cuBLASLt entry point ({exc})") from None
    if path is None:
        _LIB = (lib, where)
    return lib, where


def _status_name(lib, status: int) -> str:
    try:
        s = lib.cublasLtGetStatusName(status)
        if s:
            return s.decode()
    except Exception:  # noqa: BLE001 - a name is a nicety
        pass
    return CUBLAS_STATUS_NAMES.get(status, "CUBLAS_STATUS_?")


def _pow2_align(nbytes: int, cap: int) -> int:
    """The largest power of two dividing ``nbytes`` (``cap`` for 0), at most ``cap``."""
    if nbytes == 0:
        return cap
    return min(cap, nbytes & -nbytes)


class LtAlgo(NamedTuple):
    """One heuristic result: the 64 algorithm bytes, the workspace it needs and its waves count."""

    algo: bytes
    workspace_size: int
    waves: float


class CublasLt:
    """A cuBLASLt handle. ``CublasLt.load()`` finds the library and creates the handle."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self._lib = lib
        self.path = path
        h = ctypes.c_void_p()
        st = lib.cublasLtCreate(ctypes.byref(h))
        if st != CUBLAS_STATUS_SUCCESS:
            raise CublasLtUnavailable(f"cublasLtCreate failed with {_status_name(lib, st)} ({st}) using {path}")
        self._handle = h

    @classmethod
    def load(cls, path: str | None = None) -> CublasLt:
        """Find libcublasLt and create a handle. Order: ``path``; a copy already loaded in the process;
        ``$LUM_CUBLASLT``; ``nvidia/cu13/lib`` and ``nvidia/cublas/lib`` under every site-packages (the pip
        wheels PyTorch uses); ``$CUDA_HOME``, ``$CUDA_PATH``, ``/usr/local/cuda*/lib64``;
        ``ctypes.util.find_library``; the plain sonames (``LD_LIBRARY_PATH``, ldconfig)."""
        lib, where = _open_library(path)
        return cls(lib, where)

    def version(self) -> int:
        """``cublasLtGetVersion()``: major·10000 + minor·100 + patch (e.g. 130000 for 13.0.0)."""
        return int(self._lib.cublasLtGetVersion())

    def _check(self, st: int, what: str) -> None:
        if st != CUBLAS_STATUS_SUCCESS:
            raise CublasLtError(f"{what} failed with {_status_name(self._lib, st)} ({st})")

    def matmul_plan(self, layout: str, m: int, n: int, k: int, lda: int, ldb: int, ldc: int | None = None,
                    batch: int = 1, stride_a: int = 0, stride_b: int = 0, stride_c: int | None = None,
                    dtype: DType = DType.f32, algo: bytes | None = None, *, offset_a: int = 0, offset_b: int = 0,
                    workspace_limit: int = DEFAULT_WORKSPACE_BYTES, alignment: int = DEFAULT_ALIGNMENT,
                    heuristics: int = 8, strict_algo: bool = False, in_dtype: DType | None = None) -> MatmulPlan:
        """A ready-to-run GEMM for one LLIR gemm's concrete parameters (module docstring for the mapping).

        ``dtype`` is the element type of C, and of A and B unless ``in_dtype`` gives theirs (bf16 or f16
        operands with an f32 C: a mixed-precision GEMM). ``offset_a``/``offset_b`` (elements)
        are added to the pointers given to :meth:`MatmulPlan.run`, which are the bases of the operands'
        buffers, assumed ``alignment``-byte aligned (the arena's 256). ``algo``: 64 bytes from
        :meth:`MatmulPlan.algo_bytes` of an earlier plan; checked with cublasLtMatmulAlgoCheck, and when
        the library rejects it (another cuBLASLt version) the heuristic's choice replaces it (``strict_algo``
        raises instead); ``plan.algo_source`` says which.
        """
        return MatmulPlan(self, layout, m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c, dtype, algo,
                          offset_a, offset_b, workspace_limit, alignment, heuristics, strict_algo, in_dtype)

    def close(self) -> None:
        if getattr(self, "_handle", None) is not None and self._handle.value:
            self._lib.cublasLtDestroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __enter__(self) -> CublasLt:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MatmulPlan:
    """Descriptors, layouts and the chosen algorithm of one GEMM; :meth:`run` launches it on a stream."""

    def __init__(self, lt: CublasLt, layout, m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c,
                 dtype, algo, offset_a, offset_b, workspace_limit, alignment, heuristics, strict_algo, in_dtype=None):
        self.lt = lt
        self._lib = lt._lib
        self._descs: list[tuple[str, ctypes.c_void_p]] = []
        dtype = DType.parse(dtype) if isinstance(dtype, str) else dtype
        in_dtype = dtype if in_dtype is None else (DType.parse(in_dtype) if isinstance(in_dtype, str) else in_dtype)
        if dtype not in _DATA_TYPE or in_dtype not in _DATA_TYPE:
            raise ValueError(f"cuBLASLt gemm supports f32, bf16 and f16, not {in_dtype} → {dtype}")
        if in_dtype != dtype and dtype != DType.f32:
            raise ValueError(f"a mixed-precision gemm stores f32, not {dtype} (operands {in_dtype})")
        batch, stride_a, stride_b = _int("batch", batch), _int("stride_a", stride_a), _int("stride_b", stride_b)
        offset_a, offset_b = _int("offset_a", offset_a), _int("offset_b", offset_b)
        self.problem = prob = lt_problem(layout, m, n, k, lda, ldb, ldc)
        m, n, k = prob.n, prob.m, prob.k            # the LLIR's m, n, k
        if batch < 0 or min(stride_a, stride_b, offset_a, offset_b) < 0:
            raise ValueError(f"gemm batch, strides and offsets must be non-negative: batch={batch} "
                             f"stride_a={stride_a} stride_b={stride_b} offset_a={offset_a} offset_b={offset_b}")
        if stride_c is not None and batch > 1 and _int("stride_c", stride_c) != m * n:
            raise ValueError(f"gemm stride_c must equal m*n ({m * n}): C is row-major [batch, m, n]")
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.params = dict(layout=layout, m=m, n=n, k=k, lda=_int("lda", lda), ldb=_int("ldb", ldb), ldc=n,
                           batch=batch, stride_a=stride_a, stride_b=stride_b, stride_c=m * n, dtype=dtype,
                           in_dtype=in_dtype)
        self.dtype, self.in_dtype = dtype, in_dtype
        self.itemsize, self.in_itemsize = dtype.itemsize, in_dtype.itemsize
        self.batch = batch
        self.offset_a, self.offset_b = offset_a, offset_b
        self.workspace_limit = int(workspace_limit)
        self.output_bytes = batch * m * n * self.itemsize
        # X (cuBLAS "A") is our B, Y (cuBLAS "B") our A
        self._stride_x, self._stride_y, self._stride_c = stride_b, stride_a, m * n
        self._align = {"A": _pow2_align(offset_b * self.in_itemsize, alignment),
                       "B": _pow2_align(offset_a * self.in_itemsize, alignment),
                       "C": alignment}
        self.loops = 1                   # > 1: the batch runs as that many single GEMMs (no batched algo)
        self.workspace_size = 0
        self.algo_source = "none"
        self._algo = _Algo()
        self._results: list[LtAlgo] = []
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.kind = "noop" if batch * m * n == 0 else ("zero" if k == 0 else "matmul")
        if self.kind != "matmul":
            return
        try:
            self._build(batch, heuristics)
            if not self._results and batch > 1:
                # no batched algorithm (e.g. a broadcast operand the library refuses): loop over the batch
                self._destroy()
                self._build(1, heuristics)
                self.loops = batch
            if not self._results:
                raise CublasLtError(f"cuBLASLt has no algorithm for {self.describe_problem()}")
            self._choose(algo, strict_algo)
        except BaseException:
            self._destroy()
            raise

    # ------------------------------------------------------------------ construction
    def describe_problem(self) -> str:
        p = self.params
        return (f"gemm {p['layout']} m={p['m']} n={p['n']} k={p['k']} lda={p['lda']} ldb={p['ldb']} "
                f"batch={p['batch']} stride_a={p['stride_a']} stride_b={p['stride_b']} "
                + (f"{p['dtype']}" if p["in_dtype"] == p["dtype"] else f"{p['in_dtype']}→{p['dtype']}"))

    def _create(self, kind: str, fn, *args) -> ctypes.c_void_p:
        h = ctypes.c_void_p()
        self.lt._check(fn(ctypes.byref(h), *args), fn.__name__)
        self._descs.append((kind, h))
        return h

    def _set(self, fn, h, attr: int, value) -> None:
        self.lt._check(fn(h, attr, ctypes.byref(value), ctypes.sizeof(value)), f"{fn.__name__}({attr})")

    def _layout(self, rows: int, cols: int, ld: int, batch: int, stride: int, dtype: DType) -> ctypes.c_void_p:
        lib = self._lib
        h = self._create("layout", lib.cublasLtMatrixLayoutCreate, _DATA_TYPE[dtype], rows, cols, ld)
        if batch > 1:
            setl = lib.cublasLtMatrixLayoutSetAttribute
            self._set(setl, h, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, ctypes.c_int32(batch))
            self._set(setl, h, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, ctypes.c_int64(stride))
        return h

    def _build(self, batch: int, heuristics: int) -> None:
        lib, p = self._lib, self.problem
        self._desc = self._create("desc", lib.cublasLtMatmulDescCreate, CUBLAS_COMPUTE_32F, CUDA_R_32F)
        setd = lib.cublasLtMatmulDescSetAttribute
        self._set(setd, self._desc, CUBLASLT_MATMUL_DESC_TRANSA, ctypes.c_int32(p.transa))
        self._set(setd, self._desc, CUBLASLT_MATMUL_DESC_TRANSB, ctypes.c_int32(p.transb))
        self._a = self._layout(p.a_rows, p.a_cols, p.lda, batch, self._stride_x, self.in_dtype)
        self._b = self._layout(p.b_rows, p.b_cols, p.ldb, batch, self._stride_y, self.in_dtype)
        self._c = self._layout(p.m, p.n, p.ldc, batch, self._stride_c, self.dtype)
        pref = self._create("pref", lib.cublasLtMatmulPreferenceCreate)
        setp = lib.cublasLtMatmulPreferenceSetAttribute
        self._set(setp, pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(self.workspace_limit))
        for attr, key in ((CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, "A"),
                          (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, "B"),
                          (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, "C"),
                          (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, "C")):
            self._set(setp, pref, attr, ctypes.c_uint32(self._align[key]))
        n_req = max(1, int(heuristics))
        results = (_HeuristicResult * n_req)()
        count = ctypes.c_int(0)
        st = lib.cublasLtMatmulAlgoGetHeuristic(self.lt._handle, self._desc, self._a, self._b, self._c, self._c, pref,
                                                n_req, results, ctypes.byref(count))
        if st == CUBLAS_STATUS_NOT_SUPPORTED:
            self._results = []
            return
        self.lt._check(st, "cublasLtMatmulAlgoGetHeuristic")
        self._results = [LtAlgo(bytes(results[i].algo), int(results[i].workspaceSize), float(results[i].wavesCount))
                         for i in range(count.value) if results[i].state == CUBLAS_STATUS_SUCCESS]

    def _choose(self, algo: bytes | None, strict: bool) -> None:
        if algo is not None:
            algo = bytes(algo)
            if len(algo) != ALGO_BYTES:
                raise ValueError(f"a cuBLASLt algorithm is {ALGO_BYTES} bytes, got {len(algo)}")
            cand = _Algo.from_buffer_copy(algo)
            res = _HeuristicResult()
            st = self._lib.cublasLtMatmulAlgoCheck(self.lt._handle, self._desc, self._a, self._b, self._c, self._c,
                                                   ctypes.byref(cand), ctypes.byref(res))
            if st == CUBLAS_STATUS_SUCCESS and res.workspaceSize <= self.workspace_limit:
                self._algo, self.workspace_size, self.algo_source = cand, int(res.workspaceSize), "given"
                return
            why = (f"{_status_name(self._lib, st)} ({st})" if st != CUBLAS_STATUS_SUCCESS else
                   f"needs {res.workspaceSize} bytes of workspace, over the limit {self.workspace_limit}")
            if strict:
                raise CublasLtError(f"the stored cuBLASLt algorithm is not usable for {self.describe_problem()}: {why}")
            self.algo_source = f"heuristic (stored algorithm rejected: {why})"
        else:
            self.algo_source = "heuristic"
        best = self._results[0]
        self._algo = _Algo.from_buffer_copy(best.algo)
        self.workspace_size = best.workspace_size

    # ------------------------------------------------------------------ use
    def algo_bytes(self) -> bytes:
        """The chosen ``cublasLtMatmulAlgo_t`` (64 bytes), valid for the same cuBLASLt version and problem."""
        return bytes(self._algo)

    def candidates(self, n: int | None = None) -> list[LtAlgo]:
        """The heuristic's results, best first (at most ``heuristics`` of them), for timing at build time:
        ``lt.matmul_plan(..., algo=c.algo)`` (or :meth:`with_algo`) runs one."""
        return list(self._results[:n] if n is not None else self._results)

    def with_algo(self, algo: bytes, strict: bool = True) -> MatmulPlan:
        """The same problem with another algorithm (e.g. one of :meth:`candidates`)."""
        p = dict(self.params)
        return self.lt.matmul_plan(p.pop("layout"), p.pop("m"), p.pop("n"), p.pop("k"), p.pop("lda"), p.pop("ldb"),
                                   p.pop("ldc"), p.pop("batch"), p.pop("stride_a"), p.pop("stride_b"),
                                   p.pop("stride_c"), p.pop("dtype"), algo, offset_a=self.offset_a,
                                   offset_b=self.offset_b, workspace_limit=self.workspace_limit,
                                   alignment=self._align["C"], strict_algo=strict, in_dtype=p.pop("in_dtype"))

    def describe(self) -> dict:
        """What a package's manifest records about this GEMM."""
        return {"problem": self.describe_problem(), "algo": self.algo_bytes().hex(), "algo_source": self.algo_source,
                "workspace_bytes": self.workspace_size, "loops": self.loops, "kind": self.kind,
                "cublaslt_version": self.lt.version()}

    def run(self, stream: int, a_ptr: int, b_ptr: int, c_ptr: int, workspace_ptr: int = 0,
            workspace_bytes: int = 0) -> None:
        """Enqueue ``C = A @ B`` on ``stream`` (a CUstream / cudaStream_t handle as an int; 0 = legacy default).

        ``a_ptr``/``b_ptr`` are the bases of A's and B's buffers (the plan adds ``offset_a``/``offset_b``);
        ``c_ptr`` the output buffer (``batch·m·n`` elements); the workspace must hold ``workspace_size`` bytes.
        """
        if self.kind == "noop":
            return
        if self.kind == "closed":
            raise CublasLtError(f"this plan was closed: {self.describe_problem()}")
        if self.kind == "zero":
            self._memset_zero(stream, c_ptr)
            return
        isz, osz = self.in_itemsize, self.itemsize
        a = int(a_ptr) + self.offset_a * isz
        b = int(b_ptr) + self.offset_b * isz
        c = int(c_ptr)
        x, y = (b, a) if self.problem.swap else (a, b)
        for name, ptr, need in (("B", x, self._align["A"]), ("A", y, self._align["B"]), ("C", c, self._align["C"])):
            if ptr % need:
                raise ValueError(f"gemm operand {name} at {ptr:#x} is not {need}-byte aligned as this plan assumes "
                                 f"(pass buffer bases and let the plan add the offsets)")
        if self.workspace_size and (workspace_bytes < self.workspace_size or not int(workspace_ptr or 0)):
            raise ValueError(f"this gemm needs {self.workspace_size} bytes of workspace, got {workspace_bytes}")
        ws, strm = int(workspace_ptr or 0), int(stream or 0)
        lib, h = self._lib, self.lt._handle
        alpha, beta = ctypes.byref(self._alpha), ctypes.byref(self._beta)
        algo = ctypes.byref(self._algo)
        for i in range(self.loops):
            xi = x + i * self._stride_x * isz
            yi = y + i * self._stride_y * isz
            ci = c + i * self._stride_c * osz
            st = lib.cublasLtMatmul(h, self._desc, alpha, xi, self._a, yi, self._b, beta, ci, self._c, ci, self._c,
                                    algo, ws or None, workspace_bytes if ws else 0, strm or None)
            if st != CUBLAS_STATUS_SUCCESS:
                raise CublasLtError(f"cublasLtMatmul failed with {_status_name(lib, st)} ({st}) for "
                                    f"{self.describe_problem()}")

    def _memset_zero(self, stream: int, c_ptr: int) -> None:
        from cuda.bindings import driver as cu  # the loader's CUDA dependency; only k == 0 needs it

        (err,) = cu.cuMemsetD8Async(int(c_ptr), 0, self.output_bytes, int(stream or 0))
        if err != cu.CUresult.CUDA_SUCCESS:
            raise CublasLtError(f"cuMemsetD8Async for a k = 0 gemm failed with {err}")

    # ------------------------------------------------------------------ teardown
    def _destroy(self) -> None:
        lib = self._lib
        fns = {"desc": lib.cublasLtMatmulDescDestroy, "layout": lib.cublasLtMatrixLayoutDestroy,
               "pref": lib.cublasLtMatmulPreferenceDestroy}
        while self._descs:
            kind, h = self._descs.pop()
            if h.value:
                fns[kind](h)

    def close(self) -> None:
        self._destroy()
        self.kind = "closed" if self.kind == "matmul" else self.kind

    def __del__(self) -> None:
        try:
            self._destroy()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

