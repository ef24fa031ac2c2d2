"""Every kernel template compiles with NVRTC for sm_90 (no GPU needed), in every dtype it supports,
through codegen on hand-built LLIR ops (broadcast / permuted / padded views, symbolic dims).

Kernels of one family are batched into one module (one NVRTC call each for cubin and PTX) and compiled
into a fresh temporary cache, so the test really compiles. Also checked here: the cache, error
reporting, and — with a host C++ compiler, if one is installed — that common.cuh's f16/bf16
conversions are bit-exact against numpy / ml_dtypes.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from lum.builder import codegen, nvrtc
from lum.builder.codegen import KernelSource, generate, module_source
from lum.format.dtypes import DType
from lum.format.expr import Var, as_expr
from lum.format.llir import ELEMENTWISE_ARITY, Arg, LOp
from lum.format.shapetracker import ShapeTracker

try:
    NVRTC_VERSION = nvrtc.nvrtc_version()
except nvrtc.NvrtcNotFound as e:  # pragma: no cover - CI installs the [build] extra
    pytest.skip(f"NVRTC not available: {e}", allow_module_level=True)

S, P = Var("s"), Var("p")
DYN = ["s", "p"]
ALL = list(DType)
FLOATS = [DType.f32, DType.f16, DType.bf16]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nvrtc_cache")


# ============================================================================ representative ops
def _views():
    x = ShapeTracker.contiguous((S, 8, 16))                               # contiguous (vectorisable)
    xp = ShapeTracker.contiguous((S, 16, 8)).permute((0, 2, 1))           # permuted
    xpad = ShapeTracker.contiguous((S, 8, 12)).pad(2, 1, 3)               # padded (mask)
    bc = ShapeTracker.contiguous((16,)).expand_dim(0, 8).expand_dim(0, S)  # broadcast rows
    win = ShapeTracker.contiguous((P + S, 8, 16)).slice(0, P, P + S)      # a window at a dyn offset
    return [x, xp, xpad, bc, win]


def elementwise_ops() -> list[tuple[LOp, list[DType]]]:
    out = []
    views = _views()
    shape = (S, as_expr(8), as_expr(16))
    for di, dt in enumerate(ALL):
        for oi, (name, ar) in enumerate(ELEMENTWISE_ARITY.items()):
            vs = [views[(di + oi + k) % len(views)] for k in range(ar)]
            dts = [dt] * ar
            res = dt
            if name == "Cast":
                res = ALL[(di + 1) % len(ALL)]
            if name == "LessThan":
                res = DType.bool
            if name == "Where":
                dts[0] = DType.bool
            out.append((LOp(1, "elementwise", name, tuple(Arg(0, v) for v in vs), shape, res), dts))
    # every dtype pair through Cast, vectorised (contiguous) and not (permuted)
    x, xp = views[0], views[1]
    for a in ALL:
        for b in ALL:
            if a != b:
                out.append((LOp(1, "elementwise", "Cast", (Arg(0, x if (a.value < b.value) else xp),), shape, b), [a]))
    # in place (alias) through a window of a bigger buffer
    out.append((LOp(2, "elementwise", "Add", (Arg(0, views[4]), Arg(1, views[3])), shape, DType.bf16, alias=0),
                [DType.bf16, DType.bf16]))
    return out


def reduce_ops() -> list[tuple[LOp, dict]]:
    out = []
    x = ShapeTracker.contiguous((S, 8, 16))
    xpad = ShapeTracker.contiguous((S, 8, 12)).pad(2, 1, 3)
    xp = ShapeTracker.contiguous((S, 16, 8)).permute((0, 2, 1))
    for dt in ALL:
        for red in ("Sum", "Max"):
            for view, axis, group in ((x, 2, None), (xpad, -1, 64), (xp, 0, 1), (x, 1, 32), (xpad, 2, 8)):
                shape = tuple(d for k, d in enumerate(view.shape) if k != axis % 3)
                out.append((LOp(1, "reduce", red, (Arg(0, view),), shape, dt, {"axis": axis}), {"group": group}))
        out.append((LOp(1, "reduce", "Sum", (Arg(0, x),), (S, as_expr(8)), dt, {"axis": 2}),
                    {"group": 256, "acc": "f64"}))
    return out


def row_ops() -> list[tuple[LOp, list[DType]]]:
    out = []
    table = ShapeTracker.contiguous((1000, 64))
    table_t = ShapeTracker.contiguous((64, 1000)).permute((1, 0))
    idx = ShapeTracker.contiguous((S,))
    idx2 = ShapeTracker.contiguous((2, S))
    cache = ShapeTracker.contiguous((4096, 8, 64))
    for dt in ALL:
        for it in (DType.i32, DType.i64):
            out.append((LOp(2, "gather", "", (Arg(0, table), Arg(1, idx)), (S, as_expr(64)), dt), [dt, it]))
            out.append((LOp(2, "gather", "", (Arg(0, table_t), Arg(1, idx2)), (as_expr(2), S, as_expr(64)), dt),
                        [DType.f32 if dt != DType.f32 else DType.bf16, it]))
            src = ShapeTracker.contiguous((S, 8, 64))
            src_p = ShapeTracker.contiguous((8, S, 64)).permute((1, 0, 2))
            out.append((LOp(3, "scatter", "", (Arg(0, cache), Arg(1, src), Arg(2, idx)), cache.shape, dt),
                        [dt, dt, it]))
            out.append((LOp(3, "scatter", "", (Arg(0, cache), Arg(1, src_p), Arg(2, idx)), cache.shape, dt),
                        [DType.f32, DType.bf16 if dt != DType.bf16 else DType.f16, it]))
            out.append((LOp(3, "scatter_nocopy", "", (Arg(0, cache), Arg(1, src), Arg(2, idx)), cache.shape, dt,
                            alias=0), [dt, dt, it]))
        out.append((LOp(4, "iota", "", (), (S + P,), dt, {"n": S + P}), []))
    return out


def gemv_ops(layout: str) -> list[tuple[LOp, list[DType], dict]]:
    """Gemms that become templates/gemv.cu: every operand/result dtype mix (incl. bf16 x bf16 -> f32), m in
    1, 2, 4, 8, static and symbolic n / k, batched with offsets; tuning corners cycled over them."""
    out = []
    mixes = [(dt, dt, dt) for dt in FLOATS] + [(DType.bf16, DType.bf16, DType.f32)]
    tunings = [{}, {"group": 1}, {"group": 256}, {"vec": 1, "unroll": 1}, {"threads": 1024}, {"threads": 64}]
    a_rm, b_rm = layout[:2] == "Rm", layout[2:] == "Rm"
    for da, db, dc in mixes:
        for m in (1, 2, 4, 8):
            for n, k in ((as_expr(96), as_expr(64)), (P + 1, S + 64)):
                params = {"layout": layout, "m": m, "n": n, "k": k, "lda": k if a_rm else as_expr(m),
                          "ldb": n if b_rm else k, "batch": 2, "stride_a": 8 * k, "stride_b": k * n,
                          "offset_a": 8, "offset_b": S}
                op = LOp(2, "gemm", "Gemm", (Arg(0, ShapeTracker.contiguous((1 << 16,))),
                                             Arg(1, ShapeTracker.contiguous((1 << 20,)))), (2, m, n), dc, params)
                out.append((op, [da, db], tunings[len(out) % len(tunings)]))
    return out


def _check(res: nvrtc.CompileResult, kernels: list[KernelSource]) -> None:
    assert res.cubin[:4] == b"\x7fELF"
    assert ".target sm_90" in res.ptx
    for k in kernels:
        for name in k.kernel_names:
            assert f".entry {name}(" in res.ptx
            assert name.encode() in res.cubin


def _compile_family(kernels: list[KernelSource], cache_dir, **kw) -> nvrtc.CompileResult:
    src = module_source(kernels)
    t0 = time.perf_counter()
    res = nvrtc.compile_cuda(src, "sm_90", cache_dir=cache_dir, **kw)
    assert not res.cached                                   # fresh temporary cache: a real compile
    assert "warning" not in res.log.lower(), res.log[:3000]
    print(f"{len(kernels)} kernels, {len(src)} chars: {time.perf_counter() - t0:.2f} s")
    _check(res, kernels)
    return res


# ============================================================================ the families
def test_elementwise_all_ops_all_dtypes(cache_dir):
    ks = [generate(op, DYN, arg_dtypes=dts) for op, dts in elementwise_ops()]
    assert {k.tuning["vec"] for k in ks} >= {1, 4, 8}
    _compile_family(ks, cache_dir)


def test_elementwise_tuning_variants(cache_dir):
    x = ShapeTracker.contiguous((S, 8, 16))
    xp = ShapeTracker.contiguous((S, 16, 8)).permute((0, 2, 1))
    ks = []
    for dt in FLOATS:
        for tun in ({"threads": 128, "ept": 1}, {"threads": 1024, "ept": 8, "vec": 2}, {"math": "f64"},
                    {"index_bits": 32}, {"max_dyn": {"s": 4096, "p": 4096}}):
            ks.append(generate(LOp(1, "elementwise", "Exp2", (Arg(0, x),), x.shape, dt), DYN, **tun))
            ks.append(generate(LOp(1, "elementwise", "Mul", (Arg(0, x), Arg(0, xp)), x.shape, dt), DYN, **tun))
    assert {k.tuning["index_bits"] for k in ks} == {32, 64}
    _compile_family(ks, cache_dir)


def test_reduce_all_dtypes(cache_dir):
    ks = [generate(op, DYN, **tun) for op, tun in reduce_ops()]
    assert {k.tuning["group"] for k in ks} >= {1, 8, 32, 64, 256}
    _compile_family(ks, cache_dir)


def test_gather_scatter_iota_all_dtypes(cache_dir):
    ks = [generate(op, DYN, arg_dtypes=dts) for op, dts in row_ops()]
    kinds = {k.kind for k in ks}
    assert kinds == {"gather", "scatter", "scatter_nocopy", "iota"}
    assert all(len(k.launches) == 2 for k in ks if k.kind == "scatter")
    _compile_family(ks, cache_dir)


@pytest.mark.parametrize("layout", ["RmRm", "RmCm", "CmRm", "CmCm"])
def test_gemv_all_dtypes_and_rows(cache_dir, layout):
    ks = [generate(op, DYN, arg_dtypes=dts, **tun) for op, dts, tun in gemv_ops(layout)]
    assert all(k is not None and k.kind == "gemm" for k in ks)
    assert {k.tuning["scheme"] for k in ks} == {"cols" if layout[2:] == "Rm" else "dot"}
    _compile_family(ks, cache_dir)


@pytest.mark.parametrize("arch", ["sm_90", "sm_75"])
def test_gemv_preload_and_launch_order_compile(cache_dir, arch):
    """Every gemv case with its first weight vectors preloaded (templates/gemv.cu PRELOAD, loads into
    registers before the wait: prologues and epilogues included) and every kernel's launch-order preamble
    (common.cuh: griddepcontrol from sm_90, nothing before it)."""
    from lum.builder.codegen import generate_program
    from tests.kernel_cases import gemv_cases, template_cases

    for dt in (DType.f32, DType.bf16):
        ks = [k for k in generate_program(gemv_cases(dt)[0], preload=1).values() if k is not None]
        ks += [k for k in generate_program(template_cases(dt)[0]).values() if k is not None]
        assert any(k.tuning.get("preload") and k.tuning.get("prologue") for k in ks)
        assert any(k.tuning.get("preload") and k.tuning.get("epilogue") for k in ks)
        res = nvrtc.compile_cuda(module_source(ks), arch, cache_dir=cache_dir)
        assert res.cubin[:4] == b"\x7fELF" and ("griddepcontrol.wait" in res.ptx) == (arch == "sm_90")
        assert ("griddepcontrol.launch_dependents" in res.ptx) == (arch == "sm_90")
        if arch == "sm_90":       # the preloads: global loads before some kernel's wait
            assert any("ld.global" in entry.split("griddepcontrol.wait")[0]
                       for entry in res.ptx.split(".entry")[1:] if "griddepcontrol.wait" in entry)


def _benchmark_module(name: str):
    """benchmarks/<name>.py as a module (the scripts put benchmarks/ on sys.path for their _common)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("probe,entries", [("pdl_probe.cu", 2), ("phase_probe.cu", 2), ("stream_probe.cu", 3),
                                           ("ring_probe.cu", 10), ("ffn_probe.cu", 9), ("layer_probe.cu", 8),
                                           ("o_combine_probe.cu", 3)])
def test_benchmark_probe_kernels_compile(cache_dir, probe, entries):
    """The GPU probes' kernels (benchmarks/pdl_probe.py, phase_probe.py, stream_probe.py, ring_probe.py,
    ffn_probe.py, layer_probe.py, o_combine_probe.py: common.cuh, probe.cuh, the probe)."""
    src = _benchmark_module("_common").probe_source(probe)
    res = nvrtc.compile_cuda(src, "sm_90", name=probe, cache_dir=cache_dir)
    assert res.cubin[:4] == b"\x7fELF" and res.ptx.count(".entry") == entries
    if probe in ("stream_probe.cu", "ring_probe.cu", "layer_probe.cu"):   # rows streamed by the copy engine
        assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in res.ptx


def test_cluster_occupancy_standin_compiles(cache_dir):
    """benchmarks/cluster_occupancy.py's stand-in kernel (cluster_occupancy.cu: a qkv-sized block of 512 threads with dynamic shared memory)
    compiles, and the script's shapes are the qkv's and half its shared memory, in clusters of 8 and 16."""
    mod = _benchmark_module("cluster_occupancy")
    res = nvrtc.compile_cuda(mod.SOURCE, "sm_90", name="cluster_occupancy.cu", cache_dir=cache_dir)
    assert res.cubin[:4] == b"\x7fELF" and res.ptx.count(".entry") == 1 and "lum_cluster_standin" in res.ptx
    assert (512, 80, 16) in mod.SHAPES and {c for _, _, c in mod.SHAPES} == {8, 16}


def test_icache_probe_kernels_have_their_sizes(cache_dir):
    """benchmarks/icache_probe.py's kernels compile to straight lines of the code sizes it reports (its .text reader),
    and its float64 reference of a kernel's sums is the float32 FMA chain's to 1e-6."""
    mod = _benchmark_module("icache_probe")
    source = _benchmark_module("_common").probe_source("icache_probe.cu")
    res = nvrtc.compile_cuda(source, "sm_90", name="icache_probe.cu", ptx=False, cache_dir=cache_dir)
    sizes = mod.text_sizes(res.cubin)
    for name, steps in mod.PROBES.items():
        assert abs(sizes[f"icache_probe_{name}"] - steps * 8 * 16) < 2048, (name, sizes)
    assert sizes["icache_evict_large"] > 160 * 1024 and sizes["icache_evict_small"] > 32 * 1024
    x = (0.25 + 0.001 * (np.arange(32)[:, None] + 32 * np.arange(8)[None, :])).astype(np.float32)
    for i in range(64):   # float32 FMAs: the product exact in float64, one rounding
        x = (x.astype(np.float64) * np.float32(0.5 + ((i * 8 + np.arange(8)) % 4093) / 8192.0)
             + 0.0009765625).astype(np.float32)
    want = mod.expected_sums(64, 0, 32)
    assert np.max(np.abs(x.astype(np.float64).sum(axis=1) - want) / np.abs(want)) < 1e-6


def test_kernel_sizes_reads_every_decode_kernels_code(tmp_path):
    """benchmarks/kernel_sizes.py compiles every kernel of a model's decode groups and reports its SASS bytes (the
    cubin's .text), registers, the blocks an SM holds and the fetch time of that code; its record lands in --out.
    ``--stamps`` compiles them as a stamps build: the same kernels with more code (the stamps' calls), holding as
    many blocks an SM as without (templates/common.cuh: lum_stamp is not inlined)."""
    import json

    mod = _benchmark_module("kernel_sizes")
    rows = mod.kernel_sizes("tiny-llama", "f32", 64)
    assert rows and {"gemm", "scatter_nocopy"} <= {r["kind"] for r in rows}
    for r in rows:
        assert r["sass_bytes"] > 0 and r["sass_bytes"] % 128 == 0 and r["registers"] > 0
        assert r["fetch_us"] == round(r["sass_bytes"] / 1024 * mod.FETCH_NS_PER_KB / 1e3, 2)
        assert 1 <= r["blocks_per_sm"] <= 2048 // r["block"] and r["shared_bytes"] >= 0
    stamped = mod.kernel_sizes("tiny-llama", "f32", 64, stamps=True)
    assert [r["kernel"] for r in stamped] == [r["kernel"] for r in rows]
    assert sum(s["sass_bytes"] for s in stamped) > sum(r["sass_bytes"] for r in rows)
    assert [s["blocks_per_sm"] for s in stamped] == [r["blocks_per_sm"] for r in rows]    # the stamps' own call
    assert mod.main(["--model", "tiny-llama", "--dtype", "f32", "--max-seq", "64", "--out", str(tmp_path),
                     "--commit", "0" * 40]) == 0
    (path,) = tmp_path.glob("kernel-sizes-tiny-llama-f32-*.json")
    record = json.loads(path.read_text())
    assert record["commit"] == "0" * 40 and len(record["rows"]) == len(rows) and record["stamps"] is False
    assert sum(record["group_sass_bytes"].values()) == sum(r["sass_bytes"] for r in rows)


def test_single_kernel_source_compiles_alone(cache_dir):
    """KernelSource.source is a complete module by itself."""
    op, dts = elementwise_ops()[3]
    ks = generate(op, DYN, arg_dtypes=dts)
    res = nvrtc.compile_cuda(ks.source, "sm_90", cache_dir=cache_dir)
    _check(res, [ks])


def test_soft_conversions_and_older_arch_compile(cache_dir):
    """The portable f16/bf16 conversions (LUM_SOFT_CVT, and sm_75 where cvt.bf16 does not exist)."""
    ks = [generate(LOp(1, "elementwise", "Cast", (Arg(0, ShapeTracker.contiguous((S,))),), (S,), b), DYN,
                   arg_dtypes=[a]) for a in FLOATS for b in FLOATS if a != b]
    _compile_family(ks, cache_dir, extra_options=["-DLUM_SOFT_CVT"])
    res = nvrtc.compile_cuda(module_source(ks), "sm_75", cache_dir=cache_dir)
    assert res.cubin[:4] == b"\x7fELF" and ".target sm_75" in res.ptx


# ============================================================================ nvrtc module
def test_cache_hit_is_identical_and_keyed_by_options(tmp_path):
    ks = generate(LOp(1, "elementwise", "Sqrt", (Arg(0, ShapeTracker.contiguous((64,))),), (as_expr(64),),
                      DType.f32), [])
    a = nvrtc.compile_cuda(ks.source, cache_dir=tmp_path)
    b = nvrtc.compile_cuda(ks.source, cache_dir=tmp_path)
    assert not a.cached and b.cached and a.cubin == b.cubin and a.ptx == b.ptx and a.key == b.key
    entry = tmp_path / a.key
    assert sorted(p.name for p in entry.iterdir()) == ["kernel.cubin", "kernel.ptx", "meta.json"]
    c = nvrtc.compile_cuda(ks.source, cache_dir=tmp_path, fast_math=True)
    assert not c.cached and c.key != a.key and "--use_fast_math" in c.options
    assert "--use_fast_math" not in a.options
    # a damaged entry is ignored and rewritten, never returned
    (entry / "kernel.cubin").write_bytes(b"junk")
    d = nvrtc.compile_cuda(ks.source, cache_dir=tmp_path)
    assert not d.cached and d.cubin == a.cubin
    assert not any(p.name.endswith(".tmp") for p in entry.iterdir())
    # no cache at all
    assert not nvrtc.compile_cuda(ks.source, cache_dir=False).cached


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LUM_NVRTC_CACHE", str(tmp_path / "c"))
    assert nvrtc.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("LUM_NVRTC_CACHE")
    assert nvrtc.default_cache_dir().parts[-2:] == ("lum", "nvrtc")


def test_compile_error_has_log_and_source_head(tmp_path):
    src = "// line one\nextern \"C\" __global__ void broken(float* x) { x[0] = undefined_name; }\n"
    with pytest.raises(nvrtc.CompileError) as ei:
        nvrtc.compile_cuda(src, cache_dir=tmp_path)
    err = ei.value
    assert "undefined_name" in err.log and "undefined_name" in str(err)
    assert "   1| // line one" in err.source_head and "--gpu-architecture=sm_90" in str(err)
    assert not any(tmp_path.iterdir())                      # failures are not cached


def test_nvrtc_version_and_archs():
    major, minor = nvrtc.nvrtc_version()
    assert major >= 12
    assert 90 in nvrtc.supported_archs()
    assert os.path.exists(nvrtc.nvrtc_library_path()) or "libnvrtc" in nvrtc.nvrtc_library_path()


def test_missing_library_message(monkeypatch):
    monkeypatch.setattr(nvrtc, "_lib", None)
    monkeypatch.setattr(nvrtc, "_candidate_paths", lambda: ["/nonexistent/libnvrtc.so*"])
    monkeypatch.setattr(nvrtc.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(name)))
    with pytest.raises(nvrtc.NvrtcNotFound, match="/nonexistent/libnvrtc.so"):
        nvrtc.nvrtc_version()


# ============================================================================ conversions (host C++)
CXX = shutil.which("g++") or shutil.which("clang++") or shutil.which("c++")


@pytest.fixture(scope="module")
def conv_lib(tmp_path_factory):
    if CXX is None:
        pytest.skip("no host C++ compiler to check common.cuh's conversions")
    d = tmp_path_factory.mktemp("conv")
    (d / "common.cuh").write_text(codegen.common_header())
    (d / "conv.cpp").write_text(
        '#include "common.cuh"\nextern "C" {\n'
        "void f32_to_f16(const float* x, unsigned short* y, long n) { for (long i = 0; i < n; ++i) y[i] = lum_f32_to_f16(x[i]); }\n"
        "void f32_to_bf16(const float* x, unsigned short* y, long n) { for (long i = 0; i < n; ++i) y[i] = lum_f32_to_bf16(x[i]); }\n"
        "void f16_to_f32(const unsigned short* x, float* y, long n) { for (long i = 0; i < n; ++i) y[i] = lum_f16_to_f32(x[i]); }\n"
        "void bf16_to_f32(const unsigned short* x, float* y, long n) { for (long i = 0; i < n; ++i) y[i] = lum_bf16_to_f32(x[i]); }\n"
        "}\n")
    subprocess.run([CXX, "-O2", "-shared", "-fPIC", "-o", str(d / "conv.so"), str(d / "conv.cpp")], check=True)
    return ctypes.CDLL(str(d / "conv.so"))


def _call(lib, fn: str, x: np.ndarray, out_dtype) -> np.ndarray:
    x = np.ascontiguousarray(x)
    y = np.empty(x.shape, out_dtype)
    getattr(lib, fn)(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(y.ctypes.data), ctypes.c_long(x.size))
    return y


def _tricky_f32() -> np.ndarray:
    """Every rounding boundary of f16 and bf16 (exact ties and their f32 neighbours), plus random bits."""
    h = np.arange(0, 0x7c00, dtype=np.uint32)                        # finite non-negative f16
    f16 = h.astype(np.uint16).view(np.float16).astype(np.float64)
    mids16 = ((f16[:-1] + f16[1:]) / 2).astype(np.float32)          # exact in f32
    b = np.arange(0, 0x7f80, dtype=np.uint32)
    bf = (b << 16).view(np.float32).astype(np.float64)
    midsb = ((bf[:-1] + bf[1:]) / 2).astype(np.float32)
    mids = np.concatenate([mids16, midsb, np.float32([65504, 65519.996, 65520, 2.0**-25, 2.0**-24 * 1.5])])
    bits = mids.view(np.uint32)
    near = np.concatenate([bits, bits + 1, bits - 1])
    rng = np.random.default_rng(0)
    rnd = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    special = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38, -3.4e38]).view(np.uint32)
    allbits = np.concatenate([near, near | 0x80000000, rnd, special])
    return allbits.view(np.float32)


def test_f32_to_16bit_conversions_are_bit_exact(conv_lib):
    x = _tricky_f32()
    nan = np.isnan(x)
    with np.errstate(over="ignore", invalid="ignore"):
        ref16 = x.astype(np.float16).view(np.uint16)
        refb = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    h = _call(conv_lib, "f32_to_f16", x, np.uint16)
    b = _call(conv_lib, "f32_to_bf16", x, np.uint16)
    bad = np.flatnonzero(h[~nan] != ref16[~nan])
    assert bad.size == 0, [(float(v), hex(int(g)), hex(int(r))) for v, g, r in
                           zip(x[~nan][bad[:5]], h[~nan][bad[:5]], ref16[~nan][bad[:5]])]
    bad = np.flatnonzero(b[~nan] != refb[~nan])
    assert bad.size == 0, [(float(v), hex(int(g)), hex(int(r))) for v, g, r in
                           zip(x[~nan][bad[:5]], b[~nan][bad[:5]], refb[~nan][bad[:5]])]
    assert np.isnan(h[nan].view(np.float16)).all()
    assert np.isnan(b[nan].view(ml_dtypes.bfloat16).astype(np.float32)).all()


def test_16bit_to_f32_conversions_are_exact(conv_lib):
    allh = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = _call(conv_lib, "f16_to_f32", allh, np.float32)
    ref = allh.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(got.view(np.uint32)[~nan], ref.view(np.uint32)[~nan]) and np.isnan(got[nan]).all()
    got = _call(conv_lib, "bf16_to_f32", allh, np.float32)
    ref = allh.view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_kernel_cases_compile(cache_dir):
    """Every kernel of tests/kernel_cases.template_cases (row kernels, scatter prologues, attention and its
    combine among them) in every float dtype, as the GPU tests run them: one module, no warnings."""
    from lum.builder.codegen import generate_program
    from tests.kernel_cases import MAX_SEQ, template_cases

    ks = []
    for dt in FLOATS:
        prog, _, _ = template_cases(dt)
        ks += [k for k in generate_program(prog, ["s"], max_dyn={"s": MAX_SEQ}).values() if k is not None]
    kinds = {k.kind for k in ks}
    assert {"attention", "scatter_nocopy", "reduce", "elementwise"} <= kinds
    assert any(k.tuning.get("scheme") == "row" for k in ks)
    _compile_family(ks, cache_dir)


def test_ptxas_shared_bytes_per_kernel():
    """nvrtc.ptxas_shared_bytes reads each kernel's static shared memory from a ``ptxas -v`` log, 0 where its line
    names none; a kernel compiled here with a shared array reports at least that array."""
    log = ("ptxas info    : Compiling entry function 'a' for 'sm_90'\n"
           "ptxas info    : Used 149 registers, used 1 barriers, 10368 bytes smem\n"
           "ptxas info    : Compiling entry function 'b' for 'sm_90'\n"
           "ptxas info    : Used 40 registers, used 0 barriers\n")
    assert nvrtc.ptxas_shared_bytes(log) == {"a": 10368, "b": 0}
    src = ('extern "C" __global__ void lum_smem_probe(float* out) {\n'
           '  __shared__ float s[300];\n  s[threadIdx.x] = out[threadIdx.x];\n  __syncthreads();\n'
           '  out[threadIdx.x] = s[(threadIdx.x + 1) % 300];\n}\n')
    res = nvrtc.compile_cuda(src, "sm_90", ptx=False, extra_options=["--ptxas-options=-v"])
    assert nvrtc.ptxas_shared_bytes(res.log)["lum_smem_probe"] >= 1200, res.log
