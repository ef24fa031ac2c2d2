"""cuBLASLt for LLIR gemm: the row-major → column-major mapping on the CPU, the ctypes plumbing on a GPU.

The CPU tests run the column-major cuBLAS call that :func:`lt_problem` describes on numpy (operands read
from flat buffers with the given leading dims, transposes, batch strides, C written with ldc) and compare
it with the LLIR's semantics (the reference backend and a direct formula): all four layouts, batched,
broadcast (stride 0), offsets, padded leading dims, unit dims. The GPU tests (marked ``gpu``; skipped with
no GPU, no cuda-python or no libcublasLt) run real cuBLASLt on random inputs into poisoned outputs.
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from lum.format.dtypes import DType
from lum.format.expr import as_expr
from lum.format.llir import Arg, LOp, Program
from lum.format.shapetracker import ShapeTracker
from lum.loader import cublaslt as L
from lum.loader.cublaslt import CUBLAS_OP_N, CublasLt, CublasLtError, CublasLtUnavailable, lt_problem
from lum.loader.reference_backend import execute

LAYOUTS = ("RmRm", "RmCm", "CmRm", "CmCm")


# ====================================================================== helpers
def _addr(major: str, ld: int, rows: int, cols: int, batch: int, stride: int, offset: int) -> np.ndarray:
    """LLIR addresses [batch, rows, cols] of a logical operand (llir.py's gemm formulas)."""
    b = np.arange(batch)[:, None, None]
    i = np.arange(rows)[None, :, None]
    j = np.arange(cols)[None, None, :]
    return offset + b * stride + (i * ld + j if major == "Rm" else i + j * ld)


def make_case(layout, batch, m, n, k, sa, sb, oa, ob, pad, *, unit_ld=None):
    """Concrete gemm params and buffer sizes. sa/sb None: packed per-batch with a gap; pad: ld padding."""
    am, bm = layout[:2], layout[2:]
    lda = (k if am == "Rm" else m) + pad
    ldb = (n if bm == "Rm" else k) + pad
    if unit_ld is not None:   # a unit operand line: any ld addresses it (the builder may emit a small one)
        lda = unit_ld if ((am == "Rm" and m == 1) or (am == "Cm" and k == 1)) else lda
        ldb = unit_ld if ((bm == "Rm" and k == 1) or (bm == "Cm" and n == 1)) else ldb
    a_elems = max(lda * ((m if am == "Rm" else k) - 1) + (k if am == "Rm" else m), 0)
    b_elems = max(ldb * ((k if bm == "Rm" else n) - 1) + (n if bm == "Rm" else k), 0)
    if batch == 1:
        sa = 0 if sa is None else sa
        sb = 0 if sb is None else sb
    sa = a_elems + 1 if sa is None else sa
    sb = b_elems + 2 if sb is None else sb
    size_a = oa + (batch - 1) * sa + a_elems + 3
    size_b = ob + (batch - 1) * sb + b_elems + 1
    params = dict(layout=layout, m=m, n=n, k=k, lda=lda, ldb=ldb, ldc=n, batch=batch, stride_a=sa, stride_b=sb,
                  stride_c=m * n, offset_a=oa, offset_b=ob)
    return params, size_a, size_b


def llir_reference(p, bufa, bufb) -> np.ndarray:
    """C [batch, m, n] in float64 from the LLIR formulas."""
    ia = _addr(p["layout"][:2], p["lda"], p["m"], p["k"], p["batch"], p["stride_a"], p["offset_a"])
    ib = _addr(p["layout"][2:], p["ldb"], p["k"], p["n"], p["batch"], p["stride_b"], p["offset_b"])
    A, B = bufa.astype(np.float64)[ia], bufb.astype(np.float64)[ib]
    return np.matmul(A, B)


def simulate_lt(p, bufa, bufb) -> np.ndarray:
    """Run the column-major BLAS call lt_problem describes on numpy; returns C's flat buffer (float64)."""
    prob = lt_problem(p["layout"], p["m"], p["n"], p["k"], p["lda"], p["ldb"], p["ldc"])
    assert prob.swap
    x_buf, x_off, x_stride = bufb.astype(np.float64), p["offset_b"], p["stride_b"]
    y_buf, y_off, y_stride = bufa.astype(np.float64), p["offset_a"], p["stride_a"]
    out = np.full(p["batch"] * prob.m * prob.n, np.nan)

    def colmajor(buf, off, rows, cols, ld):
        r = np.arange(rows)[:, None]
        c = np.arange(cols)[None, :]
        return buf[off + r + c * ld]   # raises IndexError when the layout leaves the buffer

    for b in range(p["batch"]):
        X = colmajor(x_buf, x_off + b * x_stride, prob.a_rows, prob.a_cols, prob.lda)
        Y = colmajor(y_buf, y_off + b * y_stride, prob.b_rows, prob.b_cols, prob.ldb)
        opx = X if prob.transa == CUBLAS_OP_N else X.T
        opy = Y if prob.transb == CUBLAS_OP_N else Y.T
        assert opx.shape == (prob.m, prob.k) and opy.shape == (prob.k, prob.n)
        D = opx @ opy
        r = np.arange(prob.m)[:, None]
        c = np.arange(prob.n)[None, :]
        out[b * prob.m * prob.n + r + c * prob.ldc] = D
        # cuBLAS's own rules: ld >= rows of every stored matrix
        assert prob.lda >= max(prob.a_rows, 1) and prob.ldb >= max(prob.b_rows, 1) and prob.ldc >= max(prob.m, 1)
    return out


def reference_backend(p, bufa, bufb) -> np.ndarray:
    C = ShapeTracker.contiguous
    ops = [LOp(0, "input", "", (), (as_expr(bufa.size),), DType.f32, {"name": "a", "role": "input"}),
           LOp(1, "input", "", (), (as_expr(bufb.size),), DType.f32, {"name": "b", "role": "input"})]
    shape = tuple(as_expr(d) for d in (p["batch"], p["m"], p["n"]))
    ops.append(LOp(2, "gemm", p["layout"], (Arg(0, C((bufa.size,))), Arg(1, C((bufb.size,)))), shape, DType.f32,
                   dict(p)))
    ops.append(LOp(3, "output", "", (Arg(2, C(shape)),), shape, DType.f32, {"name": "c", "role": "output"}))
    return execute(Program("g", ops), {"a": bufa, "b": bufb})["c"]


def nonzero(r, n):
    return (r.uniform(0.1, 1.0, n) * r.choice([-1.0, 1.0], n)).astype(np.float32)


CASES = [
    # (layout-independent) batch, m, n, k, stride_a, stride_b, offset_a, offset_b, pad
    (1, 3, 4, 5, 0, 0, 0, 0, 0),
    (1, 3, 4, 5, 0, 0, 2, 7, 3),          # offsets and padded leading dims
    (3, 2, 5, 4, None, None, 0, 0, 0),    # batched, gaps between batch matrices
    (3, 2, 5, 4, 0, None, 4, 1, 1),       # A broadcast over the batch
    (2, 4, 3, 6, None, 0, 0, 5, 2),       # B broadcast over the batch
    (3, 2, 2, 3, 0, 0, 0, 0, 0),          # both broadcast
    (4, 3, 3, 2, None, None, 3, 3, 3),
    (1, 1, 7, 5, 0, 0, 0, 0, 0),          # decode: m = 1
    (2, 1, 6, 4, None, 0, 1, 0, 1),       # batched m = 1 (attention-like)
    (1, 5, 1, 3, 0, 0, 0, 0, 0),          # n = 1
    (1, 4, 3, 1, 0, 0, 0, 0, 2),          # k = 1
    (1, 1, 1, 1, 0, 0, 0, 0, 0),
]


# ====================================================================== CPU: the mapping
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mapping_matches_llir_semantics(layout, case):
    p, size_a, size_b = make_case(layout, *case)
    r = np.random.default_rng(hash((layout, case)) % 2**32)
    bufa, bufb = nonzero(r, size_a), nonzero(r, size_b)
    want = llir_reference(p, bufa, bufb)
    got = simulate_lt(p, bufa, bufb)
    assert not np.isnan(got).any(), "the column-major call left part of C unwritten"
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-12, atol=1e-12)
    ref = reference_backend(p, bufa, bufb)
    np.testing.assert_allclose(got.reshape(ref.shape), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mapping_random_cases(layout):
    r = np.random.default_rng(LAYOUTS.index(layout))
    for _ in range(60):
        batch = int(r.integers(1, 4))
        m, n, k = (int(x) for x in r.integers(1, 7, 3))
        sa = None if r.random() < 0.6 else 0
        sb = None if r.random() < 0.6 else 0
        oa, ob, pad = (int(x) for x in r.integers(0, 4, 3))
        p, size_a, size_b = make_case(layout, batch, m, n, k, sa, sb, oa, ob, pad)
        bufa, bufb = nonzero(r, size_a), nonzero(r, size_b)
        got = simulate_lt(p, bufa, bufb)
        np.testing.assert_allclose(got.reshape(batch, m, n), llir_reference(p, bufa, bufb), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mapping_transposes_and_swap(layout):
    prob = lt_problem(layout, 3, 4, 5, 7, 9)
    assert prob.swap and (prob.m, prob.n, prob.k, prob.ldc) == (4, 3, 5, 4)
    assert prob.transa == (CUBLAS_OP_N if layout[2:] == "Rm" else L.CUBLAS_OP_T)   # X = our B
    assert prob.transb == (CUBLAS_OP_N if layout[:2] == "Rm" else L.CUBLAS_OP_T)   # Y = our A
    assert (prob.lda, prob.ldb) == (9, 7)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unit_lines_take_any_ld(layout):
    # m = 1 / n = 1 / k = 1 operands whose single line the builder addresses with a small ld
    for m, n, k in ((1, 6, 5), (4, 1, 3), (3, 4, 1)):
        p, size_a, size_b = make_case(layout, 1, m, n, k, 0, 0, 0, 0, 0, unit_ld=1)
        r = np.random.default_rng(m * 100 + n * 10 + k)
        bufa, bufb = nonzero(r, size_a), nonzero(r, size_b)
        got = simulate_lt(p, bufa, bufb)
        np.testing.assert_allclose(got.reshape(1, m, n), llir_reference(p, bufa, bufb), rtol=1e-12)


def test_mapping_rejects_what_cublas_cannot_express():
    with pytest.raises(ValueError, match="overlapping"):
        lt_problem("RmRm", 3, 4, 5, 2, 4)           # A rows of 5 elements 2 apart
    with pytest.raises(ValueError, match="overlapping"):
        lt_problem("RmCm", 3, 4, 5, 5, 3)           # B columns of 5 elements 3 apart
    with pytest.raises(ValueError, match="layout"):
        lt_problem("RmXm", 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="ldc"):
        lt_problem("RmRm", 2, 3, 4, 4, 3, ldc=4)
    with pytest.raises(TypeError, match="int"):
        lt_problem("RmRm", 2.5, 3, 4, 4, 3)


def test_header_values_and_struct_sizes():
    # cublas_api.h / library_types.h / cublasLt.h (CUDA 13.0)
    assert (L.CUBLAS_COMPUTE_32F, L.CUDA_R_32F, L.CUDA_R_16F, L.CUDA_R_16BF) == (68, 0, 2, 14)
    assert (L.CUBLASLT_MATMUL_DESC_TRANSA, L.CUBLASLT_MATMUL_DESC_TRANSB) == (3, 4)
    assert (L.CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, L.CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET) == (5, 6)
    assert L.CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES == 1
    assert ctypes.sizeof(L._Algo) == 64 and ctypes.sizeof(L._HeuristicResult) == 96


def test_load_reports_paths_tried(monkeypatch):
    monkeypatch.setattr(L, "_LIB", None)
    monkeypatch.setattr(L, "_already_loaded", lambda: None)
    monkeypatch.setattr(L, "_library_candidates", lambda: ["/nonexistent/libcublasLt.so.13", "libnope-cublasLt.so.99"])
    with pytest.raises(CublasLtUnavailable) as ei:
        CublasLt.load()
    msg = str(ei.value)
    assert "\n" not in msg and "/nonexistent/libcublasLt.so.13" in msg and "libnope-cublasLt.so.99" in msg
    assert "LUM_CUBLASLT" in msg


def test_candidates_cover_pip_and_toolkit(monkeypatch):
    monkeypatch.setenv("LUM_CUBLASLT", "/x/libcublasLt.so.13")
    c = L._library_candidates()
    assert c[0] == "/x/libcublasLt.so.13"
    assert any(p.endswith("nvidia/cu13/lib/libcublasLt.so.13") for p in c)
    assert any(p.endswith("nvidia/cublas/lib/libcublasLt.so.12") for p in c)
    assert "/usr/local/cuda/lib64/libcublasLt.so.13" in c
    assert "libcublasLt.so.13" in c


# ====================================================================== CPU: the ctypes plumbing, on a fake library
# tests/fake_cublaslt.c implements the same entry points on host memory (checking attribute ids and byte
# sizes, problem consistency), so every ctypes call of the module runs here; only real kernels are missing.
@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    import shutil
    import subprocess
    from pathlib import Path

    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler for the fake cuBLASLt")
    out = tmp_path_factory.mktemp("fakelt") / "libfakecublasLt.so"
    src = Path(__file__).with_name("fake_cublaslt.c")
    res = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(src)], capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot build the fake cuBLASLt: {res.stderr[-300:]}")
    lib = ctypes.CDLL(str(out))
    lib.fake_last_stream.restype = ctypes.c_size_t
    lib.fake_last_workspace.restype = ctypes.c_size_t
    lib.fake_matmul_calls.restype = ctypes.c_long
    lib.fake_last_align.restype = ctypes.c_uint32
    lt = CublasLt.load(str(out))
    yield lt, lib
    lt.close()


def _host(nbytes: int, fill: int | None = None, align: int = 256) -> tuple[np.ndarray, int]:
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    view = raw[start:start + nbytes]
    if fill is not None:
        view[...] = fill
    return view, view.ctypes.data


def _fake_run(fake, p, dtype, seed, *, plan=None, stream=0, ws_bytes=1 << 20, algo=None, in_dtype=None):
    lt, lib = fake
    r = np.random.default_rng(seed)
    bufa = r.uniform(-1, 1, p["_size_a"]).astype((in_dtype or dtype).np)
    bufb = r.uniform(-1, 1, p["_size_b"]).astype((in_dtype or dtype).np)
    params = {k: v for k, v in p.items() if not k.startswith("_")}
    ha, pa = _host(bufa.nbytes)
    hb, pb = _host(bufb.nbytes)
    ha[...] = bufa.view(np.uint8)
    hb[...] = bufb.view(np.uint8)
    n_out = params["batch"] * params["m"] * params["n"]
    hc, pc = _host((n_out + GUARD) * dtype.itemsize, POISON)
    hw, pw = _host(ws_bytes)
    if plan is None:
        plan = lt.matmul_plan(params["layout"], params["m"], params["n"], params["k"], params["lda"], params["ldb"],
                              params["ldc"], params["batch"], params["stride_a"], params["stride_b"],
                              params["stride_c"], dtype, algo, offset_a=params["offset_a"], offset_b=params["offset_b"],
                              in_dtype=in_dtype)
    plan.run(stream, pa, pb, pc, pw, ws_bytes)
    assert (hc[n_out * dtype.itemsize:] == POISON).all(), "wrote past C"
    got = hc[:n_out * dtype.itemsize].view(dtype.np).astype(np.float64)
    want = llir_reference(params, bufa, bufb).reshape(-1)
    assert np.isfinite(got).all(), "unwritten outputs"
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err < TOL[dtype], f"relative error {err:.3g} for {plan.describe_problem()}"
    return plan, pw


@pytest.mark.parametrize("dtype", [DType.f32, DType.bf16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fake_library_runs_every_layout(fake, layout, case, dtype):
    _fake_run(fake, _params(layout, case), dtype, seed=hash((layout, case)) % 2**32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fake_library_mixed_bf16_to_f32(fake, layout, case):
    """bf16 A and B with an f32 C: layouts typed per operand, offsets scaled by the 2-byte operands,
    the result held to f32's tolerance."""
    plan, _ = _fake_run(fake, _params(layout, case), DType.f32, seed=hash((layout, case, "mixed")) % 2**32,
                        in_dtype=DType.bf16)
    assert plan.in_dtype == DType.bf16 and plan.dtype == DType.f32


def test_mixed_gemm_must_store_f32(fake):
    lt, _ = fake
    with pytest.raises(ValueError, match="stores f32"):
        lt.matmul_plan("RmCm", 2, 3, 4, 4, 4, 3, dtype=DType.bf16, in_dtype=DType.f32)


def test_fake_library_stream_workspace_alignment(fake):
    lt, lib = fake
    p = _params("RmCm", (1, 3, 4, 5, 0, 0, 3, 6, 1))   # offsets: 12 and 24 bytes into their buffers (f32)
    plan, pw = _fake_run(fake, p, DType.f32, seed=1, stream=0x1234)
    assert lib.fake_last_stream() == 0x1234
    assert lt.version() == 130099
    # cuBLAS "A" is our B (offset 24 bytes → 8-byte aligned), "B" our A (12 → 4), C and D the base 256
    assert [lib.fake_last_align(i) for i in range(4)] == [8, 4, 256, 256]
    assert plan.workspace_size == 0 and plan.algo_source == "heuristic"
    # a candidate needing workspace gets the caller's workspace pointer
    need = [c for c in plan.candidates() if c.workspace_size > 0][0]
    plan2, pw2 = _fake_run(fake, p, DType.f32, seed=2, plan=plan.with_algo(need.algo))
    assert plan2.workspace_size == need.workspace_size and lib.fake_last_workspace() == pw2
    with pytest.raises(ValueError, match="workspace"):
        plan2.run(0, 0, 0, 0, 0, 0)


def test_fake_library_algo_roundtrip_and_rejection(fake):
    lt, lib = fake
    p = _params("CmRm", (2, 4, 3, 6, None, 0, 0, 5, 2))
    plan, _ = _fake_run(fake, p, DType.bf16, seed=3)
    blob = plan.algo_bytes()
    assert len(blob) == 64 and [c.algo for c in plan.candidates()][0] == blob and len(plan.candidates()) == 3
    again, _ = _fake_run(fake, p, DType.bf16, seed=3, algo=plan.candidates()[2].algo)
    assert again.algo_source == "given" and again.algo_bytes() == plan.candidates()[2].algo
    junk, _ = _fake_run(fake, p, DType.bf16, seed=3, algo=b"\x01" * 64)
    assert junk.algo_source.startswith("heuristic (stored algorithm rejected: CUBLAS_STATUS_INVALID_VALUE")
    with pytest.raises(CublasLtError, match="not usable"):
        plan.with_algo(b"\x01" * 64)
    with pytest.raises(ValueError, match="64 bytes"):
        plan.with_algo(b"\x01" * 8)
    d = plan.describe()
    assert d["algo"] == blob.hex() and d["cublaslt_version"] == 130099


def test_fake_library_batch_loop_fallback(fake):
    lt, lib = fake
    lib.fake_set_no_batched(1)
    try:
        p = _params("RmRm", (3, 2, 5, 4, 0, None, 4, 1, 1))
        before = lib.fake_matmul_calls()
        plan, _ = _fake_run(fake, p, DType.f32, seed=4)
        assert plan.loops == 3 and lib.fake_matmul_calls() - before == 3
    finally:
        lib.fake_set_no_batched(0)
    plan, _ = _fake_run(fake, p, DType.f32, seed=4)
    assert plan.loops == 1


def test_fake_library_refuses_misaligned_and_closed(fake):
    lt, lib = fake
    plan = lt.matmul_plan("RmRm", 4, 4, 4, 4, 4, 4, 1, 0, 0, 16, DType.f32)
    _, base = _host(4096)
    with pytest.raises(ValueError, match="aligned"):
        plan.run(0, base + 4, base, base + 1024)
    plan.close()
    with pytest.raises(CublasLtError, match="closed"):
        plan.run(0, base, base, base + 1024)


# ====================================================================== GPU: the ctypes plumbing
class _Dev:
    """Just enough of the driver API (cuda-python) for the tests."""

    def __init__(self):
        from cuda.bindings import driver as cu

        self.cu = cu
        self._check(cu.cuInit(0), "cuInit")
        n = self._check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if n < 1:
            raise RuntimeError("no CUDA device")
        dev = self._check(cu.cuDeviceGet(0), "cuDeviceGet")
        self.ctx = self._check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self._check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.ptrs: list[int] = []

    def _check(self, res, what):
        err, *rest = res if isinstance(res, tuple) else (res,)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what}: {err}")
        return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)

    def alloc(self, nbytes: int) -> int:
        p = int(self._check(self.cu.cuMemAlloc(max(nbytes, 1)), "cuMemAlloc"))
        self.ptrs.append(p)
        return p

    def upload(self, arr: np.ndarray) -> int:
        arr = np.ascontiguousarray(arr)
        p = self.alloc(arr.nbytes)
        self._check(self.cu.cuMemcpyHtoD(p, arr.ctypes.data, arr.nbytes), "cuMemcpyHtoD")
        return p

    def download(self, ptr: int, count: int, dtype) -> np.ndarray:
        out = np.empty(count, dtype)
        self.sync()
        self._check(self.cu.cuMemcpyDtoH(out.ctypes.data, ptr, out.nbytes), "cuMemcpyDtoH")
        return out

    def sync(self):
        self._check(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def free_all(self):
        while self.ptrs:
            self.cu.cuMemFree(self.ptrs.pop())


@pytest.fixture(scope="module")
def gpu():
    try:
        dev = _Dev()
    except Exception as exc:  # noqa: BLE001 - no cuda-python, no driver, no device
        pytest.skip(f"no usable GPU: {exc}")
    try:
        lt = CublasLt.load()
    except CublasLtUnavailable as exc:
        pytest.skip(str(exc))
    ws_bytes = L.DEFAULT_WORKSPACE_BYTES
    ws = dev.alloc(ws_bytes)
    yield dev, lt, ws, ws_bytes
    dev.sync()
    lt.close()
    dev.free_all()


POISON = 0xFF   # every byte: NaN in f32, bf16 and f16
GUARD = 64      # elements after C that must stay poisoned
TOL = {DType.f32: 1e-5, DType.bf16: 1e-2, DType.f16: 2e-3}


def _run_case(gpu, p, dtype: DType, seed: int, algo=None, plan=None, check=True, in_dtype: DType | None = None):
    """``dtype``: C's; ``in_dtype``: A's and B's (default ``dtype``; bf16 under an f32 C: mixed precision)."""
    dev, lt, ws, ws_bytes = gpu
    r = np.random.default_rng(seed)
    size_a = p["_size_a"]
    size_b = p["_size_b"]
    in_np = (in_dtype or dtype).np
    bufa = r.uniform(-1, 1, size_a).astype(in_np)
    bufb = r.uniform(-1, 1, size_b).astype(in_np)
    params = {k: v for k, v in p.items() if not k.startswith("_")}
    want = llir_reference(params, bufa, bufb)     # float64 from the rounded inputs
    a, b = dev.upload(bufa), dev.upload(bufb)
    n_out = params["batch"] * params["m"] * params["n"]
    c = dev.upload(np.full((n_out + GUARD) * dtype.itemsize, POISON, np.uint8))
    if plan is None:
        plan = lt.matmul_plan(params["layout"], params["m"], params["n"], params["k"], params["lda"], params["ldb"],
                              params["ldc"], params["batch"], params["stride_a"], params["stride_b"],
                              params["stride_c"], dtype, algo, offset_a=params["offset_a"], offset_b=params["offset_b"],
                              in_dtype=in_dtype)
    plan.run(0, a, b, c, ws, ws_bytes)
    raw = dev.download(c, (n_out + GUARD) * dtype.itemsize, np.uint8)
    assert (raw[n_out * dtype.itemsize:] == POISON).all(), "cuBLASLt wrote past C"
    got = raw[:n_out * dtype.itemsize].view(dtype.np).astype(np.float64).reshape(want.shape)
    if check:
        assert np.isfinite(got).all(), f"unwritten or non-finite outputs: {np.isnan(got).sum()} NaN"
        err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
        assert err < TOL[dtype], f"relative error {err:.3g} ({plan.describe_problem()}, algo {plan.algo_source})"
    return plan, got


def _params(layout, case):
    p, size_a, size_b = make_case(layout, *case)
    p["_size_a"], p["_size_b"] = size_a, size_b
    return p


GPU_CASES = [
    (1, 64, 48, 40, 0, 0, 0, 0, 0),
    (1, 33, 17, 29, 0, 0, 3, 5, 7),        # odd sizes, offsets (less aligned pointers), padded ld
    (4, 16, 24, 32, None, None, 0, 0, 8),  # batched with gaps
    (3, 8, 16, 24, 0, None, 0, 0, 0),      # A broadcast
    (3, 8, 16, 24, None, 0, 0, 0, 0),      # B broadcast
    (1, 1, 320, 256, 0, 0, 0, 0, 0),       # decode GEMV
    (8, 1, 40, 64, None, 0, 0, 0, 0),      # batched m = 1 (heads × past)
    (1, 7, 1, 13, 0, 0, 0, 0, 0),          # n = 1
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [DType.f32, DType.bf16], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_layouts_against_numpy(gpu, layout, case, dtype):
    _run_case(gpu, _params(layout, case), dtype, seed=hash((layout, case, dtype.value)) % 2**32)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_f16(gpu, layout):
    _run_case(gpu, _params(layout, (2, 24, 40, 56, None, None, 0, 0, 8)), DType.f16, seed=11)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_mixed_bf16_inputs_f32_output(gpu, layout, case):
    """bf16 A and B, f32 C: exact products summed in f32, never rounded to bf16 (f32's tolerance)."""
    plan, _ = _run_case(gpu, _params(layout, case), DType.f32, seed=hash((layout, case, "mixed")) % 2**32,
                        in_dtype=DType.bf16)
    assert "bf16→f32" in plan.describe_problem()


@pytest.mark.gpu
def test_gpu_model_shapes_bf16(gpu):
    # Gemma 3 4B decode: x[1, 2560] @ W_up[10240, 2560]ᵀ, and the lm head slice; q·Kᵀ over 8 heads
    _run_case(gpu, _params("RmCm", (1, 1, 10240, 2560, 0, 0, 0, 0, 0)), DType.bf16, seed=1)
    _run_case(gpu, _params("RmCm", (1, 1, 8192, 2560, 0, 0, 0, 0, 0)), DType.bf16, seed=2)
    _run_case(gpu, _params("RmCm", (8, 1, 300, 256, 256, 300 * 256, 0, 0, 0)), DType.bf16, seed=3)
    _run_case(gpu, _params("RmRm", (8, 1, 256, 300, 300, 300 * 256, 0, 0, 0)), DType.bf16, seed=4)


@pytest.mark.gpu
def test_gpu_algo_roundtrip_and_candidates(gpu):
    dev, lt, ws, ws_bytes = gpu
    assert lt.version() >= 110000
    p = _params("RmCm", (2, 96, 128, 64, None, None, 0, 0, 0))
    plan, first = _run_case(gpu, p, DType.bf16, seed=5)
    blob = plan.algo_bytes()
    assert len(blob) == 64 and plan.algo_source == "heuristic"
    again, second = _run_case(gpu, p, DType.bf16, seed=5, algo=blob)
    assert again.algo_source == "given" and again.algo_bytes() == blob
    np.testing.assert_array_equal(first, second)   # same algorithm, same inputs: same bits
    cands = plan.candidates()
    assert cands and all(len(c.algo) == 64 and c.workspace_size <= ws_bytes for c in cands)
    for c in cands:
        _run_case(gpu, p, DType.bf16, seed=6, plan=plan.with_algo(c.algo))
    assert plan.describe()["algo"] == blob.hex()


@pytest.mark.gpu
def test_gpu_rejected_algo_falls_back_or_raises(gpu):
    dev, lt, ws, ws_bytes = gpu
    p = _params("RmRm", (1, 32, 32, 32, 0, 0, 0, 0, 0))
    junk = b"\xab" * 64
    plan, _ = _run_case(gpu, p, DType.f32, seed=7, algo=junk)
    assert plan.algo_source.startswith("heuristic (stored algorithm rejected")
    with pytest.raises(CublasLtError):
        lt.matmul_plan("RmRm", 32, 32, 32, 32, 32, 32, 1, 0, 0, 1024, DType.f32, junk, strict_algo=True)


@pytest.mark.gpu
def test_gpu_k_zero_writes_zeros_and_empty_is_noop(gpu):
    dev, lt, ws, ws_bytes = gpu
    plan = lt.matmul_plan("RmRm", 3, 4, 0, 1, 4, 4, 2, 3, 0, 12, DType.f32)
    c = dev.upload(np.full(24 * 4, POISON, np.uint8))
    plan.run(0, dev.alloc(64), dev.alloc(64), c, ws, ws_bytes)
    assert (dev.download(c, 24, np.float32) == 0).all()
    empty = lt.matmul_plan("RmRm", 0, 4, 3, 3, 4, 4, 1, 0, 0, 0, DType.f32)
    empty.run(0, 0, 0, 0)


@pytest.mark.gpu
def test_gpu_misaligned_pointer_is_refused(gpu):
    dev, lt, ws, ws_bytes = gpu
    plan = lt.matmul_plan("RmRm", 16, 16, 16, 16, 16, 16, 1, 0, 0, 256, DType.f32)
    a = dev.alloc(4096)
    with pytest.raises(ValueError, match="aligned"):
        plan.run(0, a + 4, a, a + 2048, ws, ws_bytes)


@pytest.mark.gpu
def test_gpu_runs_inside_a_captured_graph(gpu):
    dev, lt, ws, ws_bytes = gpu
    cu = dev.cu
    layout, case, dtype = "RmCm", (1, 1, 512, 384, 0, 0, 0, 0, 0), DType.bf16
    p = _params(layout, case)
    params = {k: v for k, v in p.items() if not k.startswith("_")}
    r = np.random.default_rng(9)
    bufa = r.uniform(-1, 1, p["_size_a"]).astype(dtype.np)
    bufb = r.uniform(-1, 1, p["_size_b"]).astype(dtype.np)
    a, b = dev.upload(bufa), dev.upload(bufb)
    n_out = params["m"] * params["n"]
    c = dev.upload(np.full(n_out * dtype.itemsize, POISON, np.uint8))
    plan = lt.matmul_plan(layout, params["m"], params["n"], params["k"], params["lda"], params["ldb"], params["n"],
                          1, 0, 0, n_out, dtype)
    stream = dev._check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    dev._check(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
               "cuStreamBeginCapture")
    plan.run(int(stream), a, b, c, ws, ws_bytes)
    graph = dev._check(cu.cuStreamEndCapture(stream), "cuStreamEndCapture")
    exe = dev._check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    dev._check(cu.cuGraphLaunch(exe, stream), "cuGraphLaunch")
    dev._check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
    got = dev.download(c, n_out, dtype.np).astype(np.float64)
    want = llir_reference(params, bufa, bufb).reshape(-1)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < TOL[dtype]
    cu.cuGraphExecDestroy(exe)
    cu.cuGraphDestroy(graph)
    cu.cuStreamDestroy(stream)


def test_bf16_numpy_roundtrip_helper():
    # the GPU tests read bf16 results through a uint8 view; make sure that view is what numpy expects
    x = np.array([1.5, -2.25], ml_dtypes.bfloat16)
    assert x.view(np.uint8).view(ml_dtypes.bfloat16).astype(np.float64).tolist() == [1.5, -2.25]
