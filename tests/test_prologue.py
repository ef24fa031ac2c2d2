"""GEMV prologues (builder/prologue.py): a decode GEMV computes its input vector (the RMSNorm before
qkv / gate-up / the LM head) instead of reading a buffer another kernel wrote, as LLIR version 3
``params["expr"]`` on the gemm.

Checked here: on tiny models' decode groups each fused input is one kernel fewer and the program
computes bit for bit what the unfused one computes (reference backend, random inputs); prefill GEMMs
(cuBLASLt), inputs another op also reads, inputs without a row reduction and GEMVs wider than
PROLOGUE_MAX_COLS are left alone; the LLIR round trip, version and validation; the reference
semantics against float64 numpy; ``LUM_GEMV_PROLOGUE=0``; and that NVRTC compiles the kernels. The kernels' numbers are checked against the reference by the emulated driver
and on the GPU (tests/kernel_cases.py ``gemv.prologue.*``, decode of whole models).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("egglog")

from lum.builder import prologue  # noqa: E402
from lum.builder.compile import compile_group  # noqa: E402
from lum.builder.models import load_spec  # noqa: E402
from lum.builder.models.transformer import ENV_NORMS_AHEAD  # noqa: E402
from lum.builder.partition import chunk_graph, group_chunks, partition  # noqa: E402
from lum.format.dtypes import DType  # noqa: E402
from lum.format.expr import as_expr  # noqa: E402
from lum.format.llir import Arg, LOp, Program  # noqa: E402
from lum.format.shapetracker import ShapeTracker  # noqa: E402
from lum.loader.reference_backend import BackendError, execute  # noqa: E402
from tests.kernel_cases import DYN, gemv_cases  # noqa: E402

RNG = np.random.default_rng(5)


def _groups(model: str, entry: str, dtype: DType = DType.bf16):
    spec = load_spec(random_name=model, dtype=dtype.value, max_seq=64)
    g = spec.graphs[entry]
    return [chunk_graph(g, grp.representative) for grp in group_chunks(g, partition(g))]


def _random_inputs(prog: Program, dyn: dict[str, int]) -> dict[str, np.ndarray]:
    out = {}
    for o in prog.inputs():
        shape = tuple(d.evaluate(dyn) for d in o.shape)
        if o.dtype.is_int:
            out[o.params["name"]] = RNG.integers(0, 4, shape).astype(o.dtype.np)
        else:
            out[o.params["name"]] = RNG.uniform(0.5, 1.5, shape).astype(o.dtype.np)
    return out


def _prologue_gemms(prog: Program) -> list[LOp]:
    return [o for o in prog.ops if o.kind == "gemm" and "expr" in o.params]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
def test_decode_gemvs_compute_their_inputs_bit_for_bit(model, monkeypatch):
    """Each layer's qkv and gate-up GEMVs take their input's kernel (the input norm; the residual add and
    the pre-FFN norm) and the LM head the final norm, while down keeps its gated activation (no row
    reduction); the fused program's outputs equal the unfused program's exactly (the prologue rounds
    every node as the dropped kernel did). Gemma's input norms stay in their layers here (decode puts them
    at the end of the layer before by default: tests/test_models.py ``test_norms_ahead_…``)."""
    monkeypatch.setenv(ENV_NORMS_AHEAD, "0")
    per_layer = 2
    dyn = {"p": 5}
    fused_total = 0
    for cg in _groups(model, "decode"):
        monkeypatch.setenv(prologue.ENV_GEMV_PROLOGUE, "0")
        plain = compile_group(cg)[0]
        monkeypatch.delenv(prologue.ENV_GEMV_PROLOGUE)
        fused = compile_group(cg)[0]
        got = len(_prologue_gemms(fused))
        assert len(fused.kernels()) == len(plain.kernels()) - got
        assert fused.version() == (3 if got else plain.version())
        fused_total += got
        if got:
            assert Program.loads(fused.dumps()).dumps() == fused.dumps()
        inputs = _random_inputs(plain, dyn)
        want, have = execute(plain, inputs, dyn), execute(fused, inputs, dyn)
        assert want.keys() == have.keys()
        for k in want:
            assert np.array_equal(want[k], have[k], equal_nan=False), k
    layers = load_spec(random_name=model, dtype="bf16", max_seq=64).config.num_layers
    assert layers and fused_total == per_layer + 1       # the layer group (once for all layers), the LM head


def test_prefill_gemms_stay_library_calls():
    """Prefill GEMMs have a dynamic m (cuBLASLt): nothing fuses into them."""
    for cg in _groups("tiny-llama", "prefill"):
        assert _prologue_gemms(compile_group(cg)[0]) == []


def _norm_then_gemv(extra_reader: str | None = None, layout: str = "RmCm", k: int = 64, n: int = 16,
                    rows: bool = True) -> Program:
    """x [1, k] f32 → Fused x·Σx² (one row kernel; ``rows=False``: x·x) → gemv against W [n, k]; optionally
    a second reader of the Fused op's buffer."""
    xs = LOp(0, "input", "Input", (), (as_expr(k),), DType.f32, {"name": "x", "role": "input"})
    ws = LOp(1, "input", "Input", (), (as_expr(n * k),), DType.f32, {"name": "w", "role": "weight"})
    row = ShapeTracker.contiguous((as_expr(1), as_expr(k)))
    sq_x = ["Mul", "f32", ["arg", 0], ["arg", 1]]
    expr = ["Mul", "f32", ["arg", 0], ["RowSum", "f32", sq_x]] if rows else sq_x
    sq = LOp(2, "elementwise", "Fused", (Arg(0, row), Arg(0, row)), (as_expr(1), as_expr(k)), DType.f32,
             {"expr": expr})
    flat = ShapeTracker.contiguous((as_expr(k),))
    params = {"layout": layout, "m": as_expr(1), "n": as_expr(n), "k": as_expr(k), "lda": as_expr(k),
              "ldb": as_expr(k), "ldc": as_expr(n), "batch": as_expr(1)}
    gemm = LOp(3, "gemm", "Gemm", (Arg(2, flat), Arg(1, ShapeTracker.contiguous((as_expr(n * k),)))),
               (as_expr(1), as_expr(1), as_expr(n)), DType.f32, params)
    ops = [xs, ws, sq, gemm]
    if extra_reader == "kernel":
        ops.append(LOp(4, "elementwise", "Recip", (Arg(2, row),), (as_expr(1), as_expr(k)), DType.f32))
    outs = [(3, "y", gemm.shape)] + ([(2, "sq", sq.shape)] if extra_reader == "output" else [])
    if extra_reader == "kernel":
        outs.append((4, "r", sq.shape))
    for src, name, shape in outs:
        ops.append(LOp(len(ops), "output", "Output", (Arg(src, ShapeTracker.contiguous(shape)),), shape,
                       DType.f32, {"name": name, "role": "output"}))
    return Program("p", ops)


@pytest.mark.parametrize("case", ["kernel", "output", "layout", "too_big", "no_rows", "wide"])
def test_inputs_that_another_op_reads_or_the_kernel_cannot_compute_stay(case):
    prog = {"kernel": lambda: _norm_then_gemv("kernel"), "output": lambda: _norm_then_gemv("output"),
            "layout": lambda: _norm_then_gemv(layout="RmRm"), "too_big": lambda: _norm_then_gemv(k=16384),
            "no_rows": lambda: _norm_then_gemv(rows=False),
            "wide": lambda: _norm_then_gemv(n=prologue.PROLOGUE_MAX_COLS + 8, k=8)}[case]()
    assert prologue.fuse_gemv_prologues(prog) is prog


def test_the_column_limit_follows_the_environment(monkeypatch):
    wide = _norm_then_gemv(n=prologue.PROLOGUE_MAX_COLS + 8, k=8)
    assert prologue.fuse_gemv_prologues(wide) is wide
    monkeypatch.setenv(prologue.ENV_PROLOGUE_MAX_COLS, str(2 * prologue.PROLOGUE_MAX_COLS))
    assert prologue.prologue_max_cols() == 2 * prologue.PROLOGUE_MAX_COLS
    assert [o.kind for o in prologue.fuse_gemv_prologues(wide).ops] == ["input", "input", "gemm", "output"]
    monkeypatch.setenv(prologue.ENV_PROLOGUE_MAX_COLS, "wide")
    with pytest.raises(ValueError, match="LUM_GEMV_PROLOGUE_MAX_COLS"):
        prologue.prologue_max_cols()


def test_a_fused_input_runs_and_renumbers():
    prog = _norm_then_gemv()
    out = prologue.fuse_gemv_prologues(prog)
    assert [o.kind for o in out.ops] == ["input", "input", "gemm", "output"]
    g = out.ops[2]
    assert [a.src for a in g.args] == [0, 0, 1] and g.params["expr"][0] == "Mul"
    assert g.bytes.evaluate({}) == (2 * 64 + 16 * 64 + 16) * 4   # each leaf view (as a Fused op counts), W, y
    x = RNG.uniform(0.5, 1.5, 64).astype(np.float32)
    w = RNG.uniform(0.5, 1.5, 16 * 64).astype(np.float32)
    x64 = x.astype(np.float64)
    want = (x64 * np.float32((x64 * x64).sum())) @ w.astype(np.float64).reshape(16, 64).T
    got = execute(out, {"x": x, "w": w})["y"].reshape(-1)
    assert np.allclose(got, want, rtol=1e-6)
    assert np.array_equal(got, execute(prog, {"x": x, "w": w})["y"].reshape(-1))


def test_llir_validation_of_a_gemm_prologue():
    out = prologue.fuse_gemv_prologues(_norm_then_gemv())
    data = out.to_json()
    assert data["version"] == 3
    data["version"] = 2
    with pytest.raises(ValueError, match="needs LLIR version 3"):
        Program.from_json(data)
    data["version"] = 3
    data["ops"][2]["params"]["expr"] = ["Mul", "f32", ["arg", 0], ["arg", 2]]     # arg 2 is B, not a leaf
    with pytest.raises(ValueError, match="arg"):
        Program.from_json(data)
    bad = prologue.fuse_gemv_prologues(_norm_then_gemv())
    bad.ops[2].args = (bad.ops[2].args[0], Arg(0, ShapeTracker.contiguous((as_expr(64),))), bad.ops[2].args[2])
    with pytest.raises(BackendError, match="one view shape"):
        execute(bad, {"x": np.ones(64, np.float32), "w": np.ones(16 * 64, np.float32)})


def test_reference_semantics_of_the_kernel_cases_match_float64():
    """The gemv.prologue.* kernel cases (what the emulated driver and the GPU check the kernels against)
    by the reference backend, against numpy float64 of the same formulas."""
    for dt, tol in ((DType.f32, 1e-6), (DType.bf16, 1e-2)):
        prog, arrays, _ = gemv_cases(dt)
        out = execute(Program.loads(prog.dumps()), arrays, DYN)
        seen = 0
        for name, y in out.items():
            if ".prologue." not in name:
                continue
            case = name[:-2]
            m, k = int(case.split(".m")[1].split(".")[0]), int(case.split(".k")[1].split(".")[0])
            x, w = (arrays[f"{case}.x{j}"].astype(np.float64) for j in (0, 1))
            b = arrays[f"{case}.x3"].astype(np.float64).reshape(-1, k)
            if ".rmsnorm." in case:
                xr = x.reshape(m, k)
                a = xr / np.sqrt((xr * xr).mean(axis=1, keepdims=True) + 1e-6) * w
            else:
                a = x[m * k:].reshape(m, k) / (1 + np.exp(-x[:m * k].reshape(m, k)))
            want = a @ b.T
            err = np.abs(y.reshape(m, -1).astype(np.float64) - want).max() / np.abs(want).max()
            assert err < tol, (name, err)
            seen += 1
        assert seen == (8 if dt == DType.f32 else 16)   # (3 shapes x 2 kinds + 2 static n) per result dtype


def _nvrtc_or_skip():
    nvrtc = pytest.importorskip("lum.builder.nvrtc")
    try:
        nvrtc.nvrtc_version()
    except nvrtc.NvrtcNotFound as e:  # pragma: no cover - CI installs the [build] extra
        pytest.skip(str(e))
    return nvrtc


def _prologue_kernels(models, dtype):
    """(op, kernel) of every prologue GEMV in the models' decode groups, under the environment as it is."""
    from lum.builder.codegen import generate_program

    out = []
    for model in models:
        for cg in _groups(model, "decode", dtype):
            prog = compile_group(cg)[0]
            ks = generate_program(prog)
            out += [(o, ks[o.id]) for o in _prologue_gemms(prog)]
    return out


def _by_mode(monkeypatch, var, modes, fn):
    """``fn()`` with ``$var`` set to each of ``modes`` (None: unset, the default)."""
    out = {}
    for mode in modes:
        if mode is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, mode)
        out[mode] = fn()
    return out


def test_nvrtc_compiles_decode_prologue_gemvs(tmp_path):
    nvrtc = _nvrtc_or_skip()
    from lum.builder.codegen import generate_program, module_source

    kernels = []
    for cg in _groups("tiny-gemma3", "decode"):
        prog = compile_group(cg)[0]
        ks = generate_program(prog)
        for o in _prologue_gemms(prog):
            assert ks[o.id].tuning["prologue"] and ks[o.id].tuning["group"] <= 32
        kernels += [k for k in ks.values() if k is not None]
    nvrtc.compile_cuda(module_source(kernels), "sm_90", ptx=False, cache_dir=tmp_path)


def test_narrow_a_switch_keeps_a_in_its_dtype(monkeypatch, tmp_path):
    """``$LUM_GEMV_PROLOGUE_NARROW_A``: a prologue GEMV whose A is bf16 keeps A so in shared memory (half the
    bytes the dot reads; the values are the rounded floats ``0`` stores, so the sums are the same: the emulated
    driver's bit-equality test), one whose A is f32 keeps floats. ``1``: every such GEMV; the default
    (``shared``): exactly those whose weights preload into shared memory too; ``0``: none. Gemma's qkv keeps
    its input norm (``LUM_NORMS_AHEAD=0``), so tiny-gemma3 has prologue GEMVs of both kinds."""
    monkeypatch.setenv(ENV_NORMS_AHEAD, "0")
    nvrtc = _nvrtc_or_skip()
    from lum.builder.codegen import CodegenError, module_source

    def prologue_kernels(dtype):
        return [k for _, k in _prologue_kernels(("tiny-gemma3",), dtype)]

    def narrowed(k):
        return bool(k.tuning.get("narrow_a")) or "lum_bf16* const lum_as" in k.source

    kernels = _by_mode(monkeypatch, "LUM_GEMV_PROLOGUE_NARROW_A", ("0", "1", None),
                       lambda: {dt: prologue_kernels(dt) for dt in (DType.bf16, DType.f32)})
    plain, narrow, default = kernels["0"], kernels["1"], kernels[None]
    assert plain[DType.bf16] and all(k.tuning.get("narrow_a") for k in narrow[DType.bf16])
    assert all("lum_bf16* const lum_as" in k.source and "float* const lum_as" not in k.source
               for k in narrow[DType.bf16])
    assert [k.name for k in narrow[DType.f32]] == [k.name for k in plain[DType.f32]]
    assert not any(narrowed(k) for k in plain[DType.bf16] + plain[DType.f32])
    shared = [k.tuning.get("preload_shared", False) for k in default[DType.bf16]]
    assert any(shared) and not all(shared)      # tiny-gemma3 has both kinds, so the rule is seen to choose
    assert [narrowed(k) for k in default[DType.bf16]] == shared
    assert [k.name for k in default[DType.f32]] == [k.name for k in plain[DType.f32]]
    monkeypatch.setenv("LUM_GEMV_PROLOGUE_NARROW_A", "yes")
    with pytest.raises(CodegenError, match="NARROW_A must be 0, shared or 1"):
        prologue_kernels(DType.bf16)
    nvrtc.compile_cuda(module_source(narrow[DType.bf16]), "sm_90", ptx=False, cache_dir=tmp_path)


def test_pairs_switch_halves_the_warps_of_prologue_gemvs(monkeypatch, tmp_path):
    """``$LUM_GEMV_PROLOGUE_PAIRS``: a prologue GEMV without an epilogue computes columns j and j + n/2 in each
    warp (two product columns, the same columns a block in half the threads): by default (``1``) every one,
    with ``shared`` those whose weights preload into shared memory, with ``0`` none; the others keep their
    kernels. All compile for sm_90; the sums are checked bit-equal in tests/test_cuda_emulated.py."""
    nvrtc = _nvrtc_or_skip()
    from lum.builder.codegen import CodegenError, module_source

    monkeypatch.setenv("LUM_NORMS_AHEAD", "0")     # the qkv GEMVs compute their input norm

    def prologue_kernels():           # llama's qkv follows down: no shared preload
        return _prologue_kernels(("tiny-gemma3", "tiny-llama"), DType.bf16)

    kernels = _by_mode(monkeypatch, "LUM_GEMV_PROLOGUE_PAIRS", ("0", "shared", None), prologue_kernels)
    plain = kernels["0"]
    assert not any(k.tuning.get("pairs") for _, k in plain)
    for mode, picks in (("shared", lambda o, k: k.tuning.get("preload_shared")), (None, lambda o, k: True)):
        chosen = 0
        assert len(kernels[mode]) == len(plain)
        for (o, p), (_, q) in zip(plain, kernels[mode]):
            if picks(o, p) and "epilogue" not in o.params:
                chosen += 1
                assert q.tuning.get("pairs") and q.block[0] * 2 == p.block[0] and q.grid == p.grid, (p.tuning, q.tuning)
                assert q.tuning["cols"] == p.tuning["cols"] and "ACC_COLS[lum_t]" in q.source
            else:
                assert q.name == p.name
        assert chosen > 0
    assert sum(bool(k.tuning.get("pairs")) for _, k in kernels[None]) > sum(
        bool(k.tuning.get("pairs")) for _, k in kernels["shared"])
    nvrtc.compile_cuda(module_source([k for _, k in kernels[None]]), "sm_90", ptx=False, cache_dir=tmp_path)
    monkeypatch.setenv("LUM_GEMV_PROLOGUE_PAIRS", "2")
    with pytest.raises(CodegenError, match="PAIRS must be 0, shared or 1"):
        prologue_kernels()
