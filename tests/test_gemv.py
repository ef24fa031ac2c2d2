"""lum's gemv kernel (templates/gemv.cu) on the CPU: which gemms codegen turns into it and with what
scheme, vector width and split, and — compiled for the host with the CUDA emulation shim
(tests/cuda_emulation.py) — its numbers against a float64 numpy reference for every layout, dtype mix,
tuning variant, grid (any grid ≥ 1 is correct) and edge case (k, n or batch = 0; misaligned pointers).
NVRTC compiles it in tests/test_templates_compile.py; tests/test_gpu.py runs it on a GPU."""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from lum.builder.codegen import CodegenError, generate
from lum.builder.gemv_policy import GEMV_MAX_M, gemv_rows
from lum.format.dtypes import DType
from lum.format.expr import Var, as_expr
from lum.format.llir import GEMM_LAYOUTS, Arg, LOp
from lum.format.shapetracker import ShapeTracker
from tests import cuda_emulation as emu
from tests.kernel_cases import TOL, gemm_reference

P = Var("p")


@pytest.fixture(autouse=True)
def _o_as_a_gemv(monkeypatch):
    """The decode layers' GEMV policies are tested with o a GEMV of its own (``LUM_O_COMBINE=0``); the combine
    inside o is tests/test_o_combine.py's."""
    monkeypatch.setenv("LUM_O_COMBINE", "0")
BF16, F16, F32 = DType.bf16, DType.f16, DType.f32


def gemm_op(layout: str, m, n, k, out: DType = F32, *, batch=1, lda=None, ldb=None, sa=0, sb=0, oa=0, ob=0,
            **extra) -> LOp:
    """A gemm op with natural leading dims unless given (the args' views are not used by a gemm)."""
    a_rm, b_rm = layout[:2] == "Rm", layout[2:] == "Rm"
    params = {"layout": layout, "m": m, "n": n, "k": k, "lda": lda if lda is not None else (k if a_rm else m),
              "ldb": ldb if ldb is not None else (n if b_rm else k), "batch": batch, "stride_a": sa,
              "stride_b": sb, "offset_a": oa, "offset_b": ob, **extra}
    flat = ShapeTracker.contiguous((1 << 20,))
    return LOp(2, "gemm", "Gemm", (Arg(0, flat), Arg(1, flat)), (as_expr(batch), as_expr(m), as_expr(n)), out,
               {key: as_expr(v) if key != "layout" else v for key, v in params.items()})


# ============================================================================ which gemms, how
def test_small_static_m_is_a_kernel_and_the_rest_stay_library_calls():
    for m in range(1, GEMV_MAX_M + 1):
        op = gemm_op("RmCm", m, 64, 32)
        ks = generate(op, ["p"], arg_dtypes=[BF16, BF16])
        assert gemv_rows(op) == m and ks is not None and ks.kind == "gemm"
        assert [p.name for p in ks.params] == ["out", "in0", "in1", "dyn"]
        assert [p.dtype for p in ks.params] == [F32, BF16, BF16, None]
    assert generate(gemm_op("RmCm", GEMV_MAX_M + 1, 64, 32), []) is None
    assert generate(gemm_op("RmCm", P, 64, 32), ["p"]) is None                    # prefill: m = s
    assert generate(gemm_op("RmCm", 0, 64, 32), []) is None
    assert generate(gemm_op("RmCm", 1, 64, 32, ldc=65), []) is None              # C not dense: the library checks
    assert generate(gemm_op("RmCm", 2, 64, 32, batch=2, stride_c=200), []) is None
    assert generate(gemm_op("RmCm", 2, P + 1, 32, batch=2, stride_c=2 * P + 2, ldc=P + 1), ["p"],
                    arg_dtypes=[F32, F32]) is not None
    assert generate(gemm_op("RmCm", 1, 64, 32, out=DType.i32), [], arg_dtypes=[DType.i32] * 2) is None
    with pytest.raises(CodegenError, match="arg_dtypes"):
        generate(gemm_op("RmCm", 1, 64, 32), [])


def test_scheme_vector_width_and_alignment_condition():
    dot = generate(gemm_op("RmCm", 1, 2560, 2560, BF16), [], arg_dtypes=[BF16, BF16])
    assert dot.tuning["scheme"] == "dot" and dot.tuning["vec"] == 8 and "(true)" in dot.body
    f32 = generate(gemm_op("RmCm", 1, 2560, 2560), [], arg_dtypes=[F32, F32])
    assert f32.tuning["vec"] == 4
    mixed = generate(gemm_op("RmCm", 1, 2560, 2560), [], arg_dtypes=[F32, BF16])     # A f32 in 16-byte pieces
    assert mixed.tuning["vec"] == 8
    odd = generate(gemm_op("RmCm", 1, 64, 2561), [], arg_dtypes=[BF16, BF16])         # ldb = 2561: no vectors
    assert odd.tuning["vec"] == 1 and "(false)" in odd.body
    assert generate(gemm_op("RmCm", 1, 64, 2562), [], arg_dtypes=[BF16, BF16]).tuning["vec"] == 2
    attn = generate(gemm_op("RmRm", 4, 128, P + 1, BF16, lda=P + 1, ldb=1024, batch=8, sa=4 * P + 4, sb=128),
                    ["p"], arg_dtypes=[BF16, BF16])                                  # probs @ V
    assert attn.tuning["scheme"] == "cols" and attn.tuning["vec"] == 8 and attn.dyn_slots == {"p": 0}
    run_time = generate(gemm_op("RmCm", 2, 16, 64, ldb=P + 1), ["p"], arg_dtypes=[F32, F32])
    assert run_time.tuning["vec"] == 4 and "((lum_d_p + 1)) % 4 == 0" in run_time.body
    assert generate(gemm_op("RmCm", 1, 64, 64), [], arg_dtypes=[F32, F32], vec=1).tuning["vec"] == 1
    with pytest.raises(CodegenError, match="vec"):
        generate(gemm_op("RmCm", 1, 64, 64), [], arg_dtypes=[F32, F32], vec=3)


def test_default_split_and_grid():
    few = generate(gemm_op("RmCm", 1, 2560, 2560, BF16), [], arg_dtypes=[BF16, BF16])      # few columns: split k
    many = generate(gemm_op("RmCm", 1, 10240, 2560, BF16), [], arg_dtypes=[BF16, BF16])
    short = generate(gemm_op("RmCm", 4, P + 1, 128, BF16, batch=8, ldb=1024, sb=128, sa=512), ["p"],
                     arg_dtypes=[BF16, BF16])                                              # q @ K^T: k = head dim
    # long k: two warps per output; block size by column count (benchmarks/gemv_sweep.py)
    assert (few.tuning["group"], few.tuning["threads"]) == (64, 512)
    assert (many.tuning["group"], many.tuning["threads"]) == (64, 128)
    assert short.tuning["group"] == 16 and short.tuning["threads"] == 512
    cols = 512 // short.tuning["group"]
    assert short.tuning["cols"] == cols
    for p in (0, 7, 100):
        assert short.grid[0].evaluate({"p": p}) == max(1, -(-8 * (p + 1) // cols))
    assert many.grid[0].evaluate({}) == 10240 * 64 // 128
    ks = generate(gemm_op("RmCm", 1, 64, 64), [], arg_dtypes=[F32, F32], group=64, threads=128, unroll=2)
    assert (ks.tuning["group"], ks.tuning["threads"], ks.tuning["unroll"], ks.tuning["cols"]) == (64, 128, 2, 2)
    for bad in ({"group": 3}, {"group": 512, "threads": 256}, {"unroll": 0}):
        with pytest.raises(CodegenError):
            generate(gemm_op("RmCm", 1, 64, 64), [], arg_dtypes=[F32, F32], **bad)


# ============================================================================ numbers, on the host
def _host_kernels_available() -> str | None:
    return None if emu.CXX is not None else "no host C++ compiler for the CUDA emulation shim"


# (name, op, arg dtypes, dyn, tuning): every layout and dtype mix, both schemes, the tuning corners
def _cases() -> list[tuple[str, LOp, list[DType], dict[str, int], dict]]:
    out = []
    for layout in GEMM_LAYOUTS:
        for a, b, c in ((F32, F32, F32), (BF16, BF16, BF16), (BF16, BF16, F32), (F16, F16, F16), (F32, BF16, F32)):
            name = f"{layout}.{a.value}x{b.value}-{c.value}"
            out.append((name + ".batched", gemm_op(layout, 3, P + 1, 75, c, batch=2, lda=80, ldb=80, sa=704, sb=0,
                                                   oa=8, ob=16), [a, b], {"p": 20}, {}))   # vectors, a k tail
            out.append((name + ".strided", gemm_op(layout, 8, 24, P + 2, c, batch=3, lda=P + 13, ldb=P + 29,
                                                   sa=401, sb=1203, oa=3, ob=5), [a, b], {"p": 7}, {}))  # scalar
        out.append((layout + ".group1", gemm_op(layout, 2, 40, 33, lda=40, ldb=40), [F32, F32], {}, {"group": 1}))
        out.append((layout + ".split", gemm_op(layout, 5, 6, 3000), [BF16, BF16], {}, {"group": 256}))
        out.append((layout + ".small_block", gemm_op(layout, 1, 70, 90), [BF16, BF16], {}, {"threads": 32, "unroll": 1}))
        out.append((layout + ".k0", gemm_op(layout, 3, 17, P, lda=17, ldb=17), [F32, F32], {"p": 0}, {}))  # zeros
        # loads issued ahead: partial batches and a k tail (static k), dynamic k, several rows of A
        out.append((layout + ".inflight3", gemm_op(layout, 1, 40, 300), [BF16, BF16], {}, {"inflight": 3}))
        out.append((layout + ".inflight_dynk", gemm_op(layout, 1, 24, P + 2, lda=P + 2, ldb=P + 2), [F32, F32],
                    {"p": 97}, {"inflight": 4, "group": 8}))
        out.append((layout + ".inflight_rows", gemm_op(layout, 3, 33, 200, BF16), [BF16, BF16], {},
                    {"inflight": 2}))
        out.append((layout + ".inflight_k0", gemm_op(layout, 1, 17, P, lda=17, ldb=17), [F32, F32], {"p": 0},
                    {"inflight": 4}))
        out.append((layout + ".n0", gemm_op(layout, 3, P, 17, lda=17, ldb=17, batch=2), [F32, F32], {"p": 0}, {}))
        # first-tile weight vectors preloaded into registers before the wait: several tiles a block, batches
        # sharing B, a k tail; f32; a prefix of k; 4-byte vectors
        out.append((layout + ".preload", gemm_op(layout, 2, 130, 300, BF16, batch=2, lda=304, ldb=304, sa=608,
                                                 sb=0), [BF16, BF16], {}, {"preload": 2, "threads": 64}))
        out.append((layout + ".preload_f32", gemm_op(layout, 3, 33, 200, F32), [F32, F32], {}, {"preload": 8}))
        out.append((layout + ".preload_part", gemm_op(layout, 1, 40, 4096, BF16), [BF16, BF16], {},  # a prefix of k
                    {"preload": 1, "threads": 64}))
        out.append((layout + ".preload_vec2", gemm_op(layout, 1, 24, 200, BF16, lda=202, ldb=202), [BF16, BF16],
                    {}, {"preload": 1}))
        # loads ahead whose first lines are asked of L2 before the wait (B a weight): a tile a block, then several
        out.append((layout + ".ahead_early", gemm_op(layout, 1, 40, 300, BF16), [BF16, BF16], {},
                    {"inflight": 3, "ahead_early": 2, "weight_args": frozenset({1})}))
        out.append((layout + ".ahead_early_tiles", gemm_op(layout, 2, 130, 300, BF16, batch=2, lda=304, ldb=304,
                                                           sa=608, sb=0), [BF16, BF16], {},
                    {"inflight": 2, "ahead_early": 1, "weight_args": frozenset({1}), "max_blocks": 3}))
        # ... and the plain loop's first UNROLL vectors a lane (a GEMV behind a GEMV: gemma3-4b's down)
        out.append((layout + ".ahead_early_plain", gemm_op(layout, 2, 130, 1100, BF16, batch=2, lda=1104, ldb=1104,
                                                           sa=2208, sb=0), [BF16, BF16], {},
                    {"inflight": 0, "unroll": 2, "ahead_early": 1, "weight_args": frozenset({1}), "max_blocks": 3,
                     "threads": 64}))
    return out


CASES = _cases()


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    why = _host_kernels_available()
    if why:
        pytest.skip(why)
    kernels = {name: generate(op, ["p"], arg_dtypes=dts, **tun) for name, op, dts, _, tun in CASES}
    lib = ctypes.CDLL(str(emu.kernel_library(kernels.values(), tmp_path_factory.mktemp("gemv"))))
    return lib, kernels


def _aligned(nbytes: int, shift: int = 0) -> np.ndarray:
    """A byte buffer whose data starts 64-byte aligned plus ``shift`` bytes."""
    raw = np.zeros(nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + shift
    return raw[start:start + nbytes]


def _storage(x: np.ndarray, dt: DType, shift: int = 0) -> np.ndarray:
    buf = _aligned(x.size * dt.itemsize, shift)
    buf.view(dt.np)[:] = x.astype(dt.np)
    return buf


def _params(op: LOp, dyn: dict[str, int]) -> dict:
    return {k: (v if k == "layout" else v.evaluate(dyn)) for k, v in op.params.items()}


def _operand_size(op: LOp, dyn: dict[str, int], which: str) -> int:
    p = _params(op, dyn)
    rm = p["layout"][:2] == "Rm" if which == "a" else p["layout"][2:] == "Rm"
    rows, cols, ld = (p["m"], p["k"], p["lda"]) if which == "a" else (p["k"], p["n"], p["ldb"])
    s0, s1 = (ld, 1) if rm else (1, ld)
    return p[f"offset_{which}"] + (p["batch"] - 1) * p[f"stride_{which}"] + (rows - 1) * s0 + (cols - 1) * s1 + 1


def _run(lib, ks, op: LOp, dts: list[DType], dyn: dict[str, int], grid: int, shift: int = 0, seed: int = 0
         ) -> tuple[np.ndarray, np.ndarray]:
    """(kernel result as float64, reference) with random non-zero operands and a NaN-poisoned output."""
    rng = np.random.default_rng(seed)
    vals = []
    for which, dt in zip("ab", dts):
        x = rng.uniform(0.25, 2.0, max(_operand_size(op, dyn, which), 1)) * rng.choice([-1.0, 1.0])
        vals.append(x.astype(dt.np).astype(np.float64))                  # what the kernel sees, exactly
    p = _params(op, dyn)
    shape = (p["batch"], p["m"], p["n"])
    out = _storage(np.full(int(np.prod(shape)), np.nan), op.dtype)
    bufs = [out, _storage(vals[0], dts[0]), _storage(vals[1], dts[1], shift)]
    dyn_buf = np.array([dyn.get(v, 0) for v in ks.dyn_vars], np.int64)
    ptrs = (ctypes.c_uint64 * 4)(*[x.ctypes.data for x in bufs], dyn_buf.ctypes.data)
    params = (ctypes.c_void_p * 4)(*(ctypes.addressof(ptrs) + 8 * i for i in range(4)))
    fn = getattr(lib, f"run_{ks.launches[0].kernel}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    fn(params, grid, ks.block[0])
    got = out.view(op.dtype.np).astype(np.float64).reshape(shape)
    return got, gemm_reference(op.params, dyn, vals[0], vals[1])


def _assert_same_bits(lib, ks, plain, op: LOp, dts: list[DType], dyn: dict[str, int], libdir, grids) -> None:
    """``ks`` (in ``lib``) and ``plain`` (compiled into a library of its own under ``libdir``) give finite,
    bit-equal results at each grid: a variant that changes when loads happen, not the sums."""
    other = ctypes.CDLL(str(emu.kernel_library([plain], libdir)))
    for grid in grids:
        got, _ = _run(lib, ks, op, dts, dyn, grid, seed=grid)
        want, _ = _run(other, plain, op, dts, dyn, grid, seed=grid)
        assert np.isfinite(got).all() and np.array_equal(got, want), (ks.tuning, grid)


def _assert_close(got: np.ndarray, want: np.ndarray, dt: DType, what: str) -> None:
    assert not np.isnan(got).any(), f"{what}: NaN in the result (an unwritten output?)"
    err = np.abs(got - want).max(initial=0.0) / max(np.abs(want).max(initial=0.0), 1e-30)
    assert err < TOL[dt], f"{what}: relative error {err:.3g}"


@pytest.mark.parametrize("name,op,dts,dyn,tun", CASES, ids=[c[0] for c in CASES])
def test_host_kernel_matches_float64_reference(host_lib, name, op, dts, dyn, tun):
    lib, kernels = host_lib
    ks = kernels[name]
    full = ks.grid[0].evaluate(dyn)
    for grid in sorted({1, 3, full}):                        # any grid >= 1 is correct
        got, want = _run(lib, ks, op, dts, dyn, grid)
        _assert_close(got, want, op.dtype, f"{name} ({ks.tuning}) grid {grid}")


def test_host_kernel_edge_cases(host_lib):
    lib, kernels = host_lib
    for name in ("RmCm.bf16xbf16-f32.batched", "RmRm.bf16xbf16-f32.batched"):
        op, dts, ks = next(c[1] for c in CASES if c[0] == name), [BF16, BF16], kernels[name]
        got, want = _run(lib, ks, op, dts, {"p": 20}, 5, shift=2)        # B 2 bytes off 16: scalar loads
        _assert_close(got, want, op.dtype, name + " misaligned B")
        got, _ = _run(lib, ks, op, dts, {"p": 0}, 2)                       # n = 1
        assert got.shape == (2, 3, 1) and not np.isnan(got).any()
    for name in ("CmCm.k0", "RmRm.k0"):
        op, ks = next(c[1] for c in CASES if c[0] == name), kernels[name]
        got, _ = _run(lib, ks, op, [F32, F32], {"p": 0}, 2)                # k = 0 writes zeros
        assert got.shape == (1, 3, 17) and (got == 0).all()


def test_loads_ahead_sum_in_the_same_order(host_lib, tmp_path):
    """Issuing a lane's loads ahead changes when they happen, not the order of the sums: bit-equal results."""
    lib, kernels = host_lib
    for layout in GEMM_LAYOUTS:
        op = next(c[1] for c in CASES if c[0] == layout + ".inflight3")
        plain = generate(op, ["p"], arg_dtypes=[BF16, BF16])
        ahead = kernels[layout + ".inflight3"]
        if layout[2:] == "Cm":                   # the dot scheme takes it; the cols scheme has no such loop
            assert ahead.tuning["inflight"] == 3 and plain.tuning["inflight"] == 0
            assert ahead.tuning["group"] == plain.tuning["group"] and ahead.body != plain.body
        else:
            assert ahead.tuning["inflight"] == 0
    op = next(c[1] for c in CASES if c[0] == "RmCm.inflight3")
    _assert_same_bits(lib, kernels["RmCm.inflight3"], generate(op, ["p"], arg_dtypes=[BF16, BF16]), op,
                      [BF16, BF16], {}, tmp_path, grids=(1, 2, 5))


def test_preload_changes_no_bit(host_lib, tmp_path):
    """A GEMV lane's first weight vectors loaded into registers before the wait (templates/gemv.cu
    PRELOAD) are summed first, in the order of k: bit-equal to the plain loop, for grids of one to several
    tiles a block, bf16 and f32, vectors of 16 and 4 bytes. The kernel names B as read early (its launch
    table's ``early``); the count is the asked vectors down to a lane's of its first column and to
    GEMV_PRELOAD_VECTORS across the product columns, 0 beside loads ahead; ``$LUM_GEMV_PRELOAD`` sets the
    default."""
    lib, kernels = host_lib
    for layout in GEMM_LAYOUTS:
        for case, dts, tun in ((".preload", [BF16, BF16], {"threads": 64}), (".preload_f32", [F32, F32], {}),
                               (".preload_part", [BF16, BF16], {"threads": 64}), (".preload_vec2", [BF16, BF16], {})):
            op = next(c[1] for c in CASES if c[0] == layout + case)
            pre, plain = kernels[layout + case], generate(op, ["p"], arg_dtypes=dts, **tun)
            dot = layout[2:] == "Cm"
            assert (pre.tuning["preload"] > 0) == dot and plain.tuning["preload"] == 0
            assert pre.early == (("in1",) if dot else ()) and plain.early == ()
            assert "lum_pdl_wait();" in pre.body and "lum_pdl_trigger();" in pre.body
            if dot:
                _assert_same_bits(lib, pre, plain, op, dts, {}, tmp_path / (layout + case), grids=(1, 3, 40))
    # gemma3-4b's shapes at their default block sizes: a lane's vectors of its column, at most 8
    shapes = {"o": (2560, 2048, 4), "qkv": (4096, 2560, 5), "down": (2560, 10240, 8)}
    for name, (n, k, want) in shapes.items():
        assert generate(gemm_op("RmCm", 1, n, k, BF16), [], arg_dtypes=[BF16, BF16], preload=8).tuning["preload"] \
            == want, name
    o_proj = gemm_op("RmCm", 1, 2560, 2048, BF16)
    # only B keeps __restrict__ (ld.global.nc, which ptxas may schedule above the wait): A, written by the
    # kernel before, is read with coherent loads after it
    pre, plain = (generate(o_proj, [], arg_dtypes=[BF16, BF16], preload=p) for p in (1, 0))
    assert "const lum_bf16* __restrict__ in1" in pre.body and "const lum_bf16* in0" in pre.body
    assert "const lum_bf16* __restrict__ in0" in plain.body
    assert generate(o_proj, [], arg_dtypes=[BF16, BF16], preload=1, inflight=2).tuning["preload"] == 0
    assert generate(o_proj, [], arg_dtypes=[BF16, BF16], preload=1).tuning["preload"] == 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LUM_GEMV_PRELOAD", "2")
        assert generate(o_proj, [], arg_dtypes=[BF16, BF16]).tuning["preload"] == 2
        mp.setenv("LUM_GEMV_PRELOAD", "9")
        with pytest.raises(CodegenError, match="LUM_GEMV_PRELOAD must be an integer"):
            generate(o_proj, [], arg_dtypes=[BF16, BF16])
    with pytest.raises(CodegenError, match="preload must be in"):
        generate(o_proj, [], arg_dtypes=[BF16, BF16], preload=9)


def test_shared_preload_changes_no_bit(tmp_path):
    """``preload_shared``: a lane's first weight vectors copied into shared memory before the wait (templates/gemv.cu
    PRELOAD_SHARED, common.cuh lum_copy16_async), each thread reading back only its own slots, are summed first
    in the order of k: bit-equal to the plain loop, for grids of one to several tiles a block, bf16 and f32.
    It takes up to GEMV_SHARED_PRELOAD_VECTORS (a lane's whole first column where registers held 8), and the
    launch's dynamic shared memory is their bytes; vectors under 16 bytes keep the plain loop."""
    from lum.builder.gemv_policy import GEMV_SHARED_PRELOAD_VECTORS

    for case, dts, tun in ((".preload", [BF16, BF16], {"threads": 64}), (".preload_f32", [F32, F32], {}),
                           (".preload_part", [BF16, BF16], {"threads": 64})):
        op = next(c[1] for c in CASES if c[0] == "RmCm" + case)
        shared = generate(op, ["p"], arg_dtypes=dts, preload=GEMV_SHARED_PRELOAD_VECTORS, preload_shared=True, **tun)
        plain = generate(op, ["p"], arg_dtypes=dts, **tun)
        t = shared.tuning
        assert t["preload_shared"] and t["preload"] > 0 and shared.early == ("in1",), (case, t)
        assert shared.shared_mem == shared.block[0] * t["preload"] * 16 and plain.shared_mem == 0
        lib = ctypes.CDLL(str(emu.kernel_library([shared], tmp_path / case)))
        _assert_same_bits(lib, shared, plain, op, dts, {}, tmp_path / (case + ".plain"), grids=(1, 3, 40))
    part = generate(next(c[1] for c in CASES if c[0] == "RmCm.preload_part"), ["p"], arg_dtypes=[BF16, BF16],
                    threads=64, preload=GEMV_SHARED_PRELOAD_VECTORS, preload_shared=True)
    assert part.tuning["preload"] == min(GEMV_SHARED_PRELOAD_VECTORS, 4096 // (8 * part.tuning["group"]))
    vec2 = generate(next(c[1] for c in CASES if c[0] == "RmCm.preload_vec2"), ["p"], arg_dtypes=[BF16, BF16],
                    preload=4, preload_shared=True)
    assert "preload_shared" not in vec2.tuning and vec2.shared_mem == 0
    qkv = generate(gemm_op("RmCm", 1, 4096, 2560, BF16), [], arg_dtypes=[BF16, BF16], threads=1024, group=32,
                   preload=GEMV_SHARED_PRELOAD_VECTORS, preload_shared=True)       # gemma3-4b's qkv: all 10
    assert qkv.tuning["preload"] == 10 and qkv.shared_mem == 10 * 16 * 1024


def test_shared_preload_switch_takes_the_gemvs_after_small_kernels(nvrtc, monkeypatch):
    """``$LUM_GEMV_PRELOAD_SHARED``. ``small``, the default: every GEMV whose kernel before is not a GEMV and whose
    grid the SMs hold at once preloads into shared memory: gemma3-4b's qkv (after the layer's last residual row
    kernel; 512 threads, two columns a warp) its lanes' whole first columns, 10 vectors, 160 KB a block, no
    spills (ptxas), and o (after the attention combine) its lanes' 4; not gate-up's 5,120 blocks; llama3-1b's o. ``all``: every GEMV; ``0``: none."""
    from lum.builder import kernels
    from tests.test_attention_stage import _layer

    monkeypatch.setenv("LUM_NORMS_AHEAD", "0")       # gemma's qkv with its input norm as a prologue, as below

    def taken(ks_list):
        return [bool(ks.tuning.get("preload_shared")) for ks in ks_list]

    llama, gemma = _llama_layer(), _layer("gemma3-4b", BF16)
    monkeypatch.delenv("LUM_GEMV_PRELOAD_SHARED", raising=False)
    default = {m: _layer_gemvs(*pd) for m, pd in (("llama", llama), ("gemma", gemma))}
    monkeypatch.setenv("LUM_GEMV_PRELOAD_SHARED", "0")
    plain = {m: _layer_gemvs(*pd) for m, pd in (("llama", llama), ("gemma", gemma))}
    assert not any(ks.tuning.get("preload_shared") or ks.shared_mem for v in plain.values() for ks in v)
    monkeypatch.setenv("LUM_GEMV_PRELOAD_SHARED", "small")      # the default: llama's o ...
    small = {m: _layer_gemvs(*pd) for m, pd in (("llama", llama), ("gemma", gemma))}
    assert {m: [ks.name for ks in v] for m, v in default.items()} == {m: [ks.name for ks in v] for m, v in small.items()}
    assert taken(small["llama"]) == [False, True, False, False]
    got = small["gemma"]       # ... and gemma's qkv and o; gate-up's 5,120 blocks are past one wave: no preload
    assert taken(got) == [True, True, False, False]
    qkv = (got[0].block[0], got[0].tuning["preload"], got[0].shared_mem)
    assert qkv == (512, 10, 10 * 2 * 16 * 512), qkv             # column pairs: two columns a warp, 512 threads
    assert got[1].shared_mem == 4 * 16 * 512, got[1].shared_mem
    assert [ks.name for ks in got[2:]] == [ks.name for ks in plain["gemma"][2:]]
    assert got[2].grid[0].value == 5120 and not got[2].tuning.get("preload"), got[2].tuning
    log = nvrtc.compile_cuda(kernels.module_source(got + small["llama"]), ptx=False,
                             extra_options=["--ptxas-options=-v"]).log
    assert nvrtc.ptxas_spills(log) == {}, log
    monkeypatch.setenv("LUM_GEMV_PRELOAD_SHARED", "all")                 # every GEMV (the tests' mode)
    assert sum(bool(ks.tuning.get("preload_shared")) for ks in _layer_gemvs(*llama)) == 4
    monkeypatch.setenv("LUM_GEMV_PRELOAD_SHARED", "2")
    with pytest.raises(CodegenError, match="must be 0, small or all"):
        _layer_gemvs(*llama)


def test_prologue_threads_switch(monkeypatch):
    """``$LUM_GEMV_PROLOGUE_THREADS=512``: llama3-1b's prologue GEMVs in blocks of half the default's 1,024
    threads (its qkv, two columns a warp, 512 → 256; gate-up 1,024 → 512), its qkv in twice the blocks, the
    other GEMVs unchanged; values other than 128, 256, 512 and
    1,024 (``fit``, since removed) are refused with the choices named."""
    llama = _llama_layer()
    monkeypatch.delenv("LUM_GEMV_PROLOGUE_THREADS", raising=False)
    before = _layer_gemvs(*llama)
    monkeypatch.setenv("LUM_GEMV_PROLOGUE_THREADS", "512")
    after = _layer_gemvs(*llama)
    assert [(before[i].block[0], after[i].block[0]) for i in (0, 2)] == [(512, 256), (1024, 512)]
    assert after[0].grid[0].value == 2 * before[0].grid[0].value, (before[0].grid, after[0].grid)
    assert [after[i].name for i in (1, 3)] == [before[i].name for i in (1, 3)]
    for bad in ("fit", "384"):
        monkeypatch.setenv("LUM_GEMV_PROLOGUE_THREADS", bad)
        with pytest.raises(CodegenError, match="128, 256, 512 or 1024"):
            _layer_gemvs(*llama)


def test_one_gemv_tuned_from_the_environment(monkeypatch):
    """``$LUM_GEMV_TUNING=3.inflight=4``: gemma3-4b's down projection (the layer's fourth GEMV) loads 4 vectors a
    lane ahead, the other GEMVs are the default's kernels, and a group's own tuning wins; a malformed entry or an
    unknown key is a one-line error naming the keys."""
    from lum.builder import kernels
    from tests.test_attention_stage import _layer

    prog, dv = _layer("gemma3-4b", BF16)
    monkeypatch.delenv("LUM_GEMV_TUNING", raising=False)
    before = _layer_gemvs(prog, dv)
    monkeypatch.setenv("LUM_GEMV_TUNING", "3.inflight=4, 7.unroll=2")      # no eighth GEMV: ignored
    after = _layer_gemvs(prog, dv)
    assert before[3].tuning["inflight"] == 0 and after[3].tuning["inflight"] == 4, after[3].tuning
    assert [k.name for k in after[:3]] == [k.name for k in before[:3]]
    own = kernels.group_kernel_sources(prog, dv, None, {"gemv3.inflight": 2})
    assert [k for k in own.values() if k is not None and k.kind == "gemm"][3].tuning["inflight"] == 2
    for bad in ("3.inflight", "down.inflight=4", "3.vec_ok=1"):
        monkeypatch.setenv("LUM_GEMV_TUNING", bad)
        with pytest.raises(CodegenError, match="LUM_GEMV_TUNING takes <gemv>.<key>=<int>"):
            _layer_gemvs(prog, dv)


def test_loads_ahead_defaults_registers_and_environment(monkeypatch):
    """``inflight`` is capped by the vectors a lane has; a static grid of one wave bounds the registers
    (``__launch_bounds__`` with the blocks an SM must hold) and then keeps A's loads where they are used;
    ``$LUM_GEMV_INFLIGHT`` sets the default and a bad value is a one-line error."""
    o_proj = gemm_op("RmCm", 1, 2560, 2048, BF16)                  # gemma3-4b's o: 320 blocks of 512
    gate_up = gemm_op("RmCm", 1, 20480, 2560, BF16)                # many waves: no bound
    ks = generate(o_proj, [], arg_dtypes=[BF16, BF16], inflight=8)
    assert ks.tuning["inflight"] == 4                              # 2048 / 8 / 64 vectors a lane
    assert "__launch_bounds__(512, 3)" in ks.body and "constexpr bool A_EARLY = false;" in ks.body
    ks = generate(gate_up, [], arg_dtypes=[BF16, BF16], inflight=4)
    assert "__launch_bounds__(128)" in ks.body and "constexpr bool A_EARLY = true;" in ks.body
    assert generate(gate_up, [], arg_dtypes=[BF16, BF16]).tuning["inflight"] == 0
    monkeypatch.setenv("LUM_GEMV_INFLIGHT", "4")
    assert generate(gate_up, [], arg_dtypes=[BF16, BF16]).tuning["inflight"] == 4
    for bad in ("four", "17", "-1"):
        monkeypatch.setenv("LUM_GEMV_INFLIGHT", bad)
        with pytest.raises(CodegenError, match="LUM_GEMV_INFLIGHT must be an integer"):
            generate(gate_up, [], arg_dtypes=[BF16, BF16])
    monkeypatch.delenv("LUM_GEMV_INFLIGHT")
    with pytest.raises(CodegenError, match="inflight must be in"):
        generate(gate_up, [], arg_dtypes=[BF16, BF16], inflight=17)


def test_epilogue_gemv_loads_its_few_vectors_ahead(monkeypatch):
    """By default only a GEMV with a fused epilogue and no prologue whose lanes walk a few vectors a column loads
    them all ahead (gemv_policy.gemv_inflight_for): gemma3-4b's gate-up, 5 vectors a lane in each of its two
    columns (2,560 / 8 / 64), with A's vectors ahead too; its other GEMVs keep the compiler's loop, as gemma3-4b
    in float32 does (10 vectors a lane). ``$LUM_GEMV_TUNING`` and ``$LUM_GEMV_INFLIGHT`` still set it."""
    from lum.builder.gemv_policy import GEMV_EPILOGUE_AHEAD, gemv_inflight_for
    from tests.test_attention_stage import _layer

    for var in ("LUM_GEMV_TUNING", "LUM_GEMV_INFLIGHT"):
        monkeypatch.delenv(var, raising=False)
    prog, dv = _layer("gemma3-4b", BF16)
    gemvs = _layer_gemvs(prog, dv)
    assert [k.tuning["inflight"] for k in gemvs] == [0, 0, 5, 0], [k.tuning for k in gemvs]
    assert gemvs[2].tuning["epilogue"] == 2 and "constexpr bool A_EARLY = true;" in gemvs[2].body
    f32 = _layer_gemvs(*_layer("gemma3-4b", DType.f32))
    assert f32[2].tuning.get("epilogue") == 2 and f32[2].tuning["inflight"] == 0, f32[2].tuning
    monkeypatch.setenv("LUM_GEMV_TUNING", "2.inflight=0")
    assert _layer_gemvs(prog, dv)[2].tuning["inflight"] == 0
    monkeypatch.delenv("LUM_GEMV_TUNING")
    monkeypatch.setenv("LUM_GEMV_INFLIGHT", "0")
    assert [k.tuning["inflight"] for k in _layer_gemvs(prog, dv)] == [0, 0, 0, 0]
    assert gemv_inflight_for(True, GEMV_EPILOGUE_AHEAD) == GEMV_EPILOGUE_AHEAD
    assert gemv_inflight_for(True, GEMV_EPILOGUE_AHEAD + 1) == gemv_inflight_for(False, 2) == 0
    assert gemv_inflight_for(True, None) == 0


def test_loads_ahead_asked_of_l2_before_the_wait_change_no_bit(host_lib, tmp_path):
    """``ahead_early`` (gemv.cu ``AHEAD_EARLY``, under ``$LUM_GEMV_AHEAD_AFTER_GEMV``): a GEMV asks L2 for its
    first tile's first lines of B (a weight) before its wait (its loads ahead, or the plain loop's first ``UNROLL``
    vectors a lane), with no register for them, so its sums are the same kernel's without the requests bit for
    bit, for grids of one to several tiles a block. B is named
    as read early (its launch table's ``early``, so A keeps coherent loads); ``ahead_early`` > 1 keeps that many
    blocks an SM (``__launch_bounds__``); a GEMV whose B is not a weight or with a preload is unchanged."""
    lib, kernels = host_lib
    for layout in GEMM_LAYOUTS:
        dot = layout[2:] == "Cm"
        for case, tun in ((".ahead_early", {"inflight": 3}), (".ahead_early_tiles", {"inflight": 2, "max_blocks": 3}),
                          (".ahead_early_plain", {"inflight": 0, "unroll": 2, "max_blocks": 3, "threads": 64})):
            op = next(c[1] for c in CASES if c[0] == layout + case)
            early = kernels[layout + case]
            plain = generate(op, ["p"], arg_dtypes=[BF16, BF16], weight_args=frozenset({1}), **tun)
            assert bool(early.tuning.get("ahead_early")) == dot and not plain.tuning.get("ahead_early")
            assert early.early == (("in1",) if dot else ()) and plain.early == ()
            if dot:
                body = early.body
                assert body.index("lum_prefetch_l2(lum_pp") < body.index("  lum_pdl_wait();")
                assert "constexpr bool AHEAD_EARLY = true;" in body and "const lum_bf16* in0" in body
                _assert_same_bits(lib, early, plain, op, [BF16, BF16], {}, tmp_path / (layout + case),
                                  grids=(1, 3, 40))
    o_proj, wide = gemm_op("RmCm", 1, 2560, 2048, BF16), gemm_op("RmCm", 1, 20480, 2560, BF16)   # wide: many waves
    w = frozenset({1})
    assert "__launch_bounds__(128, 5)" in generate(wide, [], arg_dtypes=[BF16, BF16], weight_args=w, inflight=5,
                                                   ahead_early=5, threads=128).body
    for tun in ({"weight_args": frozenset()}, {"weight_args": w, "preload": 1}):
        assert not generate(o_proj, [], arg_dtypes=[BF16, BF16], ahead_early=2, **tun).tuning.get("ahead_early"), tun
    plain_loop = generate(o_proj, [], arg_dtypes=[BF16, BF16], weight_args=w, inflight=0, unroll=4, ahead_early=12)
    assert plain_loop.tuning.get("ahead_early") and plain_loop.tuning["inflight"] == 0
    assert f"__launch_bounds__({plain_loop.tuning['threads']}, 12)" in plain_loop.body


@pytest.mark.parametrize("model", ["gemma3-4b", "llama3-1b"])
def test_ahead_after_gemv_switch_takes_gemma_down_only(monkeypatch, model):
    """``$LUM_GEMV_AHEAD_AFTER_GEMV`` (on by default; ``0`` off): in gemma3-4b's decode layer only down (the plain
    loop, no prologue, behind gate-up) asks L2 for its first lines before its wait, at the 12 blocks an SM it
    holds, and gate-up keeps its trigger at its start; llama3-1b's down preloads (the preload after GEMVs), so no
    kernel of its layer changes."""
    from lum.builder import kernels
    from lum.builder.compile import weight_inputs
    from lum.builder.gemv_policy import ENV_GEMV_AHEAD_AFTER_GEMV, gemv_kernel_ops
    from lum.builder.models.config import named_config
    from lum.builder.models.transformer import build_entry
    from tests.test_attention_stage import MAX_SEQ, _layer

    for var in ("LUM_GEMV_TUNING", "LUM_GEMV_INFLIGHT", ENV_GEMV_AHEAD_AFTER_GEMV, "LUM_GEMV_AHEAD_PLAIN"):
        monkeypatch.delenv(var, raising=False)
    prog, dv = _layer(model, BF16)
    weights = weight_inputs(build_entry(named_config(model), "decode", MAX_SEQ, BF16), prog)
    early = kernels.group_kernel_sources(prog, dv, weights=weights)
    monkeypatch.setenv(ENV_GEMV_AHEAD_AFTER_GEMV, "0")
    plain = kernels.group_kernel_sources(prog, dv, weights=weights)
    changed = {i for i in early if early[i].name != plain[i].name}
    if model == "llama3-1b":
        assert not changed
        return
    down = gemv_kernel_ops(prog)[3]
    assert changed == {down.id}, changed
    ks = early[down.id]
    assert ks.tuning.get("ahead_early") and ks.tuning["inflight"] == 0 and ks.early == ("in1",)
    assert "__launch_bounds__(128, 12)" in ks.body
    assert ks.body.index("lum_prefetch_l2(lum_pp") < ks.body.index("  lum_pdl_wait();")


def test_plain_gemv_loads_ahead_under_its_switch(monkeypatch):
    """``$LUM_GEMV_AHEAD_PLAIN=1`` (to measure): a GEMV without an epilogue or a prologue loads its few vectors a
    lane ahead too: in gemma3-4b's layer o's 4 (qkv's 10 and down's 20 are too many; in the built model o runs
    inside the combine's kernel, whose code stays the same, so only the LM head changes there:
    benchmarks/kernel_sizes.py), and a plain GEMV such as an LM head's; a prologue GEMV never by this rule."""
    from lum.builder.gemv_policy import ENV_GEMV_AHEAD_PLAIN, GEMV_EPILOGUE_AHEAD, gemv_inflight_for
    from tests.test_attention_stage import _layer

    for var in ("LUM_GEMV_TUNING", "LUM_GEMV_INFLIGHT", ENV_GEMV_AHEAD_PLAIN):
        monkeypatch.delenv(var, raising=False)
    assert gemv_inflight_for(False, 2) == 0
    prog, dv = _layer("gemma3-4b", BF16)
    monkeypatch.setenv(ENV_GEMV_AHEAD_PLAIN, "1")
    assert gemv_inflight_for(False, 2) == 2 and gemv_inflight_for(False, GEMV_EPILOGUE_AHEAD + 1) == 0
    assert gemv_inflight_for(True, 2, prologue=True) == gemv_inflight_for(False, 2, prologue=True) == 0
    assert [k.tuning["inflight"] for k in _layer_gemvs(prog, dv)] == [0, 4, 5, 0]
    head = generate(gemm_op("RmCm", 1, 4096, 2560, BF16), [], arg_dtypes=[BF16, BF16])
    assert head.tuning["inflight"] == 2560 // 8 // head.tuning["group"], head.tuning


def test_bf16_rounding_of_the_float_sum(host_lib):
    """A bf16 result is the f32 sum rounded once (to nearest even), as the reference rounds float64."""
    lib, kernels = host_lib
    name = "RmCm.bf16xbf16-bf16.batched"
    op, ks = next(c[1] for c in CASES if c[0] == name), kernels[name]
    got, want = _run(lib, ks, op, [BF16, BF16], {"p": 20}, 4, seed=3)
    rounded = want.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    assert np.abs(got - rounded).max() <= np.abs(rounded).max() * 2.0 ** -7



def test_loads_ahead_that_would_spill_are_halved(monkeypatch):
    """A group's GEMVs whose loads ahead spill (``ptxas -v`` through NVRTC) are rebuilt with half as many
    until they do not (here: a fake compile that reports a spill for more than one load ahead)."""
    import re
    from types import SimpleNamespace

    from lum.builder import kernels, nvrtc
    from lum.builder.gemv_policy import gemv_kernel_ops
    from lum.builder.compile import compile_group
    from tests.test_prologue import _groups

    prog = next(p for p in (compile_group(cg)[0] for cg in _groups("tiny-llama", "decode"))
                if len(gemv_kernel_ops(p)) >= 2)
    dyn_vars = sorted(prog.dyn_vars())
    compiled: list[dict[str, int]] = []

    def fake_compile(source, arch, **kw):
        found = dict(re.findall(r"__launch_bounds__\([^)]*\) (\w+)\(.*?constexpr int INFLIGHT = (\d+);", source, re.S))
        compiled.append({k: int(v) for k, v in found.items()})
        log = "".join(f"ptxas info    : Compiling entry function '{k}' for 'sm_90'\n"
                      f"ptxas         .     0 bytes stack frame, {64 if int(v) > 1 else 0} bytes spill stores, "
                      f"{64 if int(v) > 1 else 0} bytes spill loads\n" for k, v in found.items())
        return SimpleNamespace(log=log)

    monkeypatch.setattr(nvrtc, "compile_cuda", fake_compile)
    tuning = {"inflight": 8, **{f"gemv{i}.group": 1 for i in range(len(gemv_kernel_ops(prog)))}}  # long lanes
    got = kernels.group_kernel_sources(prog, dyn_vars, tuning=tuning, cache_dir=False)
    ahead = [got[o.id].tuning["inflight"] for o in gemv_kernel_ops(prog)]
    assert ahead and all(v == 1 for v in ahead), ahead
    assert max(compiled[0].values()) > 1 and max(compiled[-1].values()) == 1      # 8 -> 4 -> 2 -> 1
    monkeypatch.setattr(nvrtc, "compile_cuda", lambda source, arch, **kw: SimpleNamespace(log=""))
    got = kernels.group_kernel_sources(prog, dyn_vars, tuning=tuning, cache_dir=False)
    assert all(got[o.id].tuning["inflight"] > 1 for o in gemv_kernel_ops(prog))     # no spill: kept


def test_resident_blocks():
    """Blocks an SM holds: 2,048 threads and 65,536 registers an SM, 8 registers a thread at a time."""
    from lum.builder.kernels import resident_blocks

    assert resident_blocks(1024, 32) == 2 and resident_blocks(1024, 33) == 1 and resident_blocks(1024, 200) == 1
    assert resident_blocks(512, 64) == 2 and resident_blocks(512, 40) == 3 and resident_blocks(128, 32) == 16
    # a shared preload's bytes bound them too (228 KB an SM, 1 KB reserved a block)
    assert resident_blocks(128, 32, 20 * 1024) == 10 and resident_blocks(1024, 32, 160 * 1024) == 1


def _layer_gemvs(prog, dv) -> list:
    """A decode layer's GEMV kernels as the package builder makes them (group_kernel_sources), in program order."""
    from lum.builder import kernels
    from lum.builder.gemv_policy import gemv_kernel_ops

    got = kernels.group_kernel_sources(prog, dv)
    return [got[o.id] for o in gemv_kernel_ops(prog)]


def _llama_layer():
    """llama3-1b's decode layer program (its qkv GEMV has the input norm as prologue, the norms behind whatever
    the default, and its gate-up the post-attention norm) and dyn slots."""
    from tests.test_attention_stage import _layer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LUM_NORMS_AHEAD", "0")
        return _layer("llama3-1b", BF16)


def test_prologue_gemvs_in_one_wave_by_their_registers(monkeypatch):
    """A prologue GEMV (each block computes all of A) gets at most the blocks its registers let the SMs hold:
    llama3-1b's gate-up (1,024 threads, 256 blocks by codegen's 2,048 threads an SM) keeps 256 at 32 registers
    (two blocks an SM), drops to 132 at 33; an explicit cap, ``$LUM_GEMV_PROLOGUE_ONE_WAVE=0`` or a log
    without the kernel keep codegen's grid; the GEMVs without a prologue keep theirs. (No preloads here: a
    preloading GEMV is capped too, whatever ``$LUM_GEMV_PROLOGUE_ONE_WAVE`` says.)"""
    import re
    from types import SimpleNamespace

    from lum.builder import kernels, nvrtc
    from lum.builder.gemv_policy import gemv_kernel_ops

    monkeypatch.setenv("LUM_GEMV_PRELOAD_AFTER_GEMV", "0")
    prog, dv = _llama_layer()
    gemvs = gemv_kernel_ops(prog)
    ranks = {o.id: i for i, o in enumerate(gemvs)}
    monkeypatch.setenv("LUM_GEMV_PROLOGUE_ONE_WAVE", "0")
    plain = kernels.group_kernel_sources(prog, dv, cache_dir=False)                 # codegen's grids
    monkeypatch.delenv("LUM_GEMV_PROLOGUE_ONE_WAVE")
    (gate_up,) = [o for o in gemvs if plain[o.id].tuning.get("epilogue") == 2]
    assert plain[gate_up.id].tuning.get("prologue") and plain[gate_up.id].block[0] == 1024
    regs = {"n": 0}

    def fake_compile(source, arch, **kw):
        names = re.findall(r'extern "C" __global__ void __launch_bounds__\([^)]*\) (\w+)\(', source)
        return SimpleNamespace(log="".join(f"ptxas info    : Compiling entry function '{k}' for 'sm_90'\n"
                                           f"ptxas info    : Used {regs['n']} registers, used 0 barriers\n"
                                           for k in names))

    monkeypatch.setattr(nvrtc, "compile_cuda", fake_compile)

    def grids(tuning=None):
        got = kernels.group_kernel_sources(prog, dv, tuning=tuning, cache_dir=False)
        return {o.id: got[o.id].grid[0].value for o in gemvs}

    regs["n"] = 32
    with_32 = grids()
    assert with_32 == {o.id: plain[o.id].grid[0].value for o in gemvs} and with_32[gate_up.id] == 256
    regs["n"] = 33
    capped = grids()
    assert capped[gate_up.id] == 132
    assert all(capped[o.id] == with_32[o.id] for o in gemvs if o is not gate_up)
    assert grids({f"gemv{ranks[gate_up.id]}.max_blocks": 264})[gate_up.id] == 256
    monkeypatch.setenv("LUM_GEMV_PROLOGUE_ONE_WAVE", "0")
    assert grids()[gate_up.id] == 256
    monkeypatch.delenv("LUM_GEMV_PROLOGUE_ONE_WAVE")
    monkeypatch.setattr(nvrtc, "compile_cuda", lambda source, arch, **kw: SimpleNamespace(log=""))
    assert grids()[gate_up.id] == 256


def test_llama_gate_up_runs_in_one_wave(nvrtc):
    """With ptxas's real count, llama3-1b's gate-up prologue GEMV takes more than 32 registers at 1,024 threads
    (one block an SM), so its grid is the 132 SMs, one wave."""
    from lum.builder import kernels
    from lum.builder.gemv_policy import SMS, gemv_kernel_ops

    prog, dv = _llama_layer()
    got = kernels.group_kernel_sources(prog, dv)
    heads = [got[o.id] for o in gemv_kernel_ops(prog) if got[o.id].tuning.get("prologue")]
    regs = nvrtc.ptxas_registers(nvrtc.compile_cuda(kernels.module_source(heads), ptx=False,
                                                    extra_options=["--ptxas-options=-v"]).log)
    for ks in heads:
        resident = SMS * kernels.resident_blocks(ks.block[0], regs[ks.name])
        assert ks.grid[0].value <= resident, (ks.name, regs[ks.name], ks.grid)
    gate_up = next(ks for ks in heads if ks.tuning.get("epilogue") == 2)
    assert regs[gate_up.name] > 32 and gate_up.grid[0].value == SMS


def test_large_gemvs_take_blocks_that_load_the_sms_evenly(monkeypatch):
    """``$LUM_GEMV_BALANCE`` (on): a decode GEMV of at least 2^24 weights whose 512-thread blocks (eight columns
    each) would put a block more on some SMs than on others by over a tenth takes 128 threads: gemma3-4b's down
    projection (2,560 columns: 320 blocks, three on some SMs and two on most) 1,280 blocks of 128; llama3-1b's
    (2,048 columns: 256 blocks, two an SM but eight) and gemma3-4b's o (small: its latency, not its bytes)
    keep 512; many columns take 128 anyway. Off: 512 as before."""
    def threads(n: int, k: int) -> int:
        return generate(gemm_op("RmCm", 1, n, k, BF16), [], arg_dtypes=[BF16, BF16]).block[0]

    assert (threads(2560, 10240), threads(2048, 8192), threads(2560, 2048), threads(20480, 2560)) == (128, 512, 512, 128)
    monkeypatch.setenv("LUM_GEMV_BALANCE", "0")
    assert threads(2560, 10240) == 512


def test_preloading_gemvs_in_one_wave_without_spills(nvrtc):
    """A preload of 8 weight vectors a lane in llama3-1b's decode layer: no GEMV spills (ptxas), each keeps the
    registers ptxas gives it (no ``__launch_bounds__`` minimum: capped at one wave they spilled), so that an SM
    still holds at least PRELOAD_MIN_THREADS of its threads, its grid is at most the blocks those registers let
    the SMs hold (every block's first tile is preloaded while the kernel before runs), and the GEMVs whose
    preload would spill or crowd the SM preload less: the 1,024-thread ones (64 registers at most) 2 vectors at
    most, where the 512-thread o GEMV takes its first tile's 4 (the qkv, two columns a warp, 512 threads: as
    many vectors a lane as a 1,024-thread block's)."""
    from lum.builder import kernels
    from lum.builder.gemv_policy import SMS, gemv_kernel_ops

    prog, dv = _llama_layer()
    got = kernels.group_kernel_sources(prog, dv, tuning={"preload": 8})
    gemvs = [got[o.id] for o in gemv_kernel_ops(prog)]
    log = nvrtc.compile_cuda(kernels.module_source(gemvs), ptx=False, extra_options=["--ptxas-options=-v"]).log
    regs = nvrtc.ptxas_registers(log)
    assert nvrtc.ptxas_spills(log) == {} and all(ks.tuning["preload"] >= 1 for ks in gemvs)
    for ks in gemvs:
        assert "__launch_bounds__(%d)" % ks.block[0] in ks.body
        resident = kernels.resident_blocks(ks.block[0], regs[ks.name])
        assert resident * ks.block[0] >= kernels.PRELOAD_MIN_THREADS, (ks.name, regs[ks.name])
        assert ks.grid[0].value <= SMS * resident, (ks.name, ks.grid)
    by_threads = {t: [ks.tuning["preload"] for ks in gemvs if ks.block[0] == t] for t in (512, 1024)}
    assert len(by_threads[512]) == 3 and len(by_threads[1024]) == 1     # qkv in column pairs: 512 threads
    assert max(by_threads[1024]) <= 2 and max(by_threads[512]) == 4     # o: its whole first tile
    assert gemvs[0].tuning["pairs"] and gemvs[0].tuning["preload"] <= 2  # two columns: 2 vectors each at most


@pytest.mark.parametrize("ahead", [{}, {"preload": 1}, {"inflight": 4}], ids=["plain", "preload", "inflight"])
def test_weights_stream_with_evict_first(nvrtc, monkeypatch, ahead):
    """``$LUM_GEMV_EVICT_FIRST`` (on by default): a GEMV whose B is a weight loads every vector of it with an L2 evict-first
    policy (PTX ``ld.global.nc.L1::no_allocate.L2::cache_hint``, as many as the plain kernel's loads of B);
    a B that is not a weight, or the switch off, keeps the plain loads and the tuning without ``stream``."""
    import re

    from lum.builder.codegen import module_source

    op = gemm_op("RmCm", 1, 2560, 2048, BF16)                        # gemma3-4b's o projection

    def ptx(ks):
        out = nvrtc.compile_cuda(module_source([ks]), "sm_90", ptx=True, cache_dir=False).ptx
        return out.decode() if isinstance(out, bytes) else out

    hinted = re.compile(r"ld\.global\.nc\.L1::no_allocate\.L2::cache_hint\.v4\.u32")
    monkeypatch.setenv("LUM_GEMV_EVICT_FIRST", "0")
    plain = generate(op, [], arg_dtypes=[BF16, BF16], weight_args=frozenset({1}), **ahead)
    assert "stream" not in plain.tuning and not hinted.search(ptx(plain))
    monkeypatch.setenv("LUM_GEMV_EVICT_FIRST", "1")
    ks = generate(op, [], arg_dtypes=[BF16, BF16], weight_args=frozenset({1}), **ahead)
    code = ptx(ks)
    loads_b = len(re.findall(r"ld\.global(?:\.nc)?\.v4", ptx(plain))) - len(re.findall(r"ld\.global(?:\.nc)?\.v4", code))
    assert ks.tuning["stream"] and code.count("createpolicy.fractional.L2::evict_first") >= 1
    assert len(hinted.findall(code)) == loads_b > 0
    not_weight = generate(op, [], arg_dtypes=[BF16, BF16], weight_args=frozenset({0}), **ahead)
    assert "stream" not in not_weight.tuning and not hinted.search(ptx(not_weight))


def test_preload_after_gemv_kernels(monkeypatch):
    """``$LUM_GEMV_PRELOAD_AFTER_GEMV``: in llama3-1b's decode layer the GEMVs whose kernel before is a GEMV
    (qkv after down across the layer boundary, gate-up after o, down after gate-up) preload N vectors a lane,
    4 by default, less what would spill or crowd the SMs; o (after the attention reduce) and the LM head (after
    the argmax) none. 0 turns it off; a ``preload`` in the tuning wins over the rule, less what would spill."""
    from lum.builder.compile import compile_graph
    from lum.builder.kernels import group_kernel_sources, program_dyn_vars
    from lum.builder.models.config import named_config
    from lum.builder.models.transformer import build_entry

    monkeypatch.setenv("LUM_NORMS_AHEAD", "0")             # qkv after down across the layer boundary
    cgs = compile_graph(build_entry(named_config("llama3-1b"), "decode", 4096, BF16))
    dv = program_dyn_vars([cg.program for cg in cgs])
    monkeypatch.setenv("LUM_GEMV_PRELOAD_SHARED", "0")     # register preloads only (o's shared one by default)
    monkeypatch.setenv("LUM_GEMV_PROLOGUE_PAIRS", "0")     # one column a warp (the pairs' preloads: test_prologue.py)

    def preloads(**tuning) -> list[tuple[str, int]]:
        out = []
        for cg in cgs:
            gen = group_kernel_sources(cg.program, dv, {"p": 4096}, tuning)
            out += [(str(cg.program.ops[i].shape[-1]), k.tuning["preload"]) for i, k in gen.items()
                    if k is not None and k.kind == "gemm"]
        return out

    default = preloads()
    monkeypatch.setenv("LUM_GEMV_PRELOAD_AFTER_GEMV", "0")
    assert all(p == 0 for _, p in preloads())
    # a preload of 2 everywhere, but the gate-up GEMV (1,024 threads, so 64 registers at most) spills at 2:
    # halved to 1 (builder/kernels.py _loads_ahead_without_spills)
    assert preloads(preload=2) == [("3072", 2), ("2048", 2), ("8192", 1), ("2048", 2), ("128256", 2)]
    # 4 (gate-up halved to 1, as at LUM_GEMV_PRELOAD=4; qkv and down to 2, for registers): the default
    monkeypatch.setenv("LUM_GEMV_PRELOAD_AFTER_GEMV", "4")
    assert preloads() == default
    assert default == [("3072", 2), ("2048", 0), ("8192", 1), ("2048", 2), ("128256", 0)], default
    monkeypatch.setenv("LUM_GEMV_PRELOAD_AFTER_GEMV", "9")
    with pytest.raises(ValueError):
        preloads()


def test_a_shared_preload_past_one_wave_narrows_its_columns_first(nvrtc):
    """gemma3-4b's decode qkv without a prologue (its input norm ends the layer before: ``norms_ahead``) is
    sized as 512 blocks of 512 threads, two warps a column, 5 vectors a lane; at its registers the SMs hold
    396, so its shared preload would be halved away. Its column group halves first (builder/kernels.py
    ``_narrow_to_one_wave``): 256 blocks, a warp a column, all 10 vectors of a lane preloaded (80 KB a block,
    two blocks an SM), no spills. o (320 blocks, within one wave) and gate-up (5,120 blocks, past two) keep
    their sizes."""
    from tests.test_attention_stage import _layer

    layer, dv = _layer("gemma3-4b", BF16)
    qkv, o, gate_up, _ = _layer_gemvs(layer, dv)
    assert (qkv.grid[0].value, qkv.block[0], qkv.tuning["group"]) == (256, 512, 32), (qkv.grid, qkv.tuning)
    assert qkv.tuning["preload_shared"] and qkv.tuning["preload"] == 10 and qkv.shared_mem == 10 * 16 * 512
    assert (o.grid[0].value, o.tuning["group"], o.tuning["preload"]) == (320, 64, 4), (o.grid, o.tuning)
    assert gate_up.grid[0].value == 5120 and not gate_up.tuning.get("preload")
    log = nvrtc.compile_cuda(qkv.source, ptx=False, extra_options=["--ptxas-options=-v"]).log
    assert nvrtc.ptxas_spills(log) == {}, log


def test_a_preload_that_would_unbalance_the_grid_is_dropped(monkeypatch):
    """gemma3-4b's down GEMV: 1,280 blocks of 128 threads (two columns each), all resident at once without a
    preload; a preload's registers let the SMs hold 1,056, and capped there 224 blocks would walk two tiles
    (profiled 21.3 µs against 14.2). So its preload halves down to none and it keeps its grid; so does o's
    (320 blocks of 512 threads, 264 resident at a preload); the qkv GEMV (a prologue GEMV, its grid one
    wave anyway) and gate-up (5,120 blocks, capped at 1,056: under five tiles a block, evenly enough) keep
    theirs (builder/kernels.py _waves_unbalanced)."""
    from lum.builder.compile import compile_graph
    from lum.builder.kernels import group_kernel_sources, program_dyn_vars
    from lum.builder.models.config import named_config
    from lum.builder.models.transformer import build_entry

    monkeypatch.setenv("LUM_NORMS_AHEAD", "0")       # the qkv with its prologue, as below
    cgs = compile_graph(build_entry(named_config("gemma3-4b"), "decode", 512, BF16))
    dv = program_dyn_vars([cg.program for cg in cgs])
    layer = max(cgs, key=lambda cg: cg.stats.get("chunks", 1)).program
    monkeypatch.setenv("LUM_GEMV_PRELOAD_SHARED", "0")     # register preloads only (qkv's shared one: below)
    monkeypatch.setenv("LUM_GEMV_PROLOGUE_PAIRS", "0")     # one column a warp, as the counts below
    monkeypatch.setenv("LUM_GEMV_INFLIGHT", "0")           # gate-up's loads ahead off: a preload is none beside them

    def preloads() -> list[tuple[int, int, int]]:   # (n, preload, grid) a GEMV
        gen = group_kernel_sources(layer, dv, {"p": 512}, {})
        return [(int(layer.ops[i].shape[-1]), k.tuning["preload"], k.grid[0].value) for i, k in gen.items()
                if k is not None and k.kind == "gemm"]

    plain = preloads()
    assert [n for n, _, _ in plain] == [4096, 2560, 10240, 2560] and plain[3] == (2560, 0, 1280), plain
    monkeypatch.setenv("LUM_GEMV_PRELOAD", "2")
    pre = preloads()
    assert pre[3] == (2560, 0, 1280) and pre[1] == (2560, 0, 320), pre     # down and o: no preload, grids whole
    assert pre[0][1] == 2 and pre[2][1] >= 1, pre
