"""The roofline cost model: bytes/flops per LLIR op kind (symbolic), broadcast and padding not
counted as traffic, the roofline + launch estimate, and the H200 / CPU specs."""

from __future__ import annotations

import math

import pytest

from lum.builder.costmodel import (CPU_REFERENCE, H200, GpuSpec, annotate, estimate_many, estimate_op, op_cost,
                                   estimate_program, op_bytes, op_flops, view_elements)
from lum.format.dtypes import DType
from lum.format.expr import Var, as_expr
from lum.format.llir import Arg, LOp, Program
from lum.format.shapetracker import ShapeTracker

C = ShapeTracker.contiguous
F32, BF16, I64, BOOL = DType.f32, DType.bf16, DType.i64, DType.bool
s = Var("s")


def op(i, kind, o, args, shape, dtype, **params) -> LOp:
    return LOp(i, kind, o, tuple(args), tuple(as_expr(d) for d in shape), dtype, params)


def inp(i, name, shape, dtype=F32):
    return op(i, "input", "", (), shape, dtype, name=name, role="input")


def test_specs_are_sensible():
    assert 4.0e12 <= H200.mem_bandwidth <= 4.8e12
    assert 60e12 <= H200.fp32_flops <= 70e12
    assert 700e12 <= H200.tensor_flops <= 989e12
    assert 1e-6 <= H200.launch_overhead <= 5e-6
    assert H200.l2_bytes == 50 * 2**20
    assert H200.peak_flops(BF16, tensor_core=True) == H200.tensor_flops
    assert H200.peak_flops(F32, tensor_core=True) == H200.fp32_flops
    assert H200.peak_flops(BF16) == H200.fp32_flops
    assert CPU_REFERENCE.mem_bandwidth < H200.mem_bandwidth / 100
    assert isinstance(H200, GpuSpec)


def test_view_elements_counts_distinct_reads():
    assert view_elements(C((s, 4))) == 4 * s
    assert view_elements(C((s, 4)).expand_dim(1, 64)) == 4 * s          # broadcast: no extra traffic
    assert view_elements(C((3, 5)).permute((1, 0))) == as_expr(15)
    assert view_elements(C((2, 3)).pad(1, 1, 2)) == as_expr(6)          # padding reads nothing
    assert view_elements(C((2, 3)).pad(1, 1, 2).slice(1, 0, 1)) == as_expr(0)
    assert view_elements(C((10, 4)).slice(0, 2, 5)) == as_expr(12)
    assert view_elements(C(())) == as_expr(1)
    assert view_elements(C(()).expand_dim(0, s)).evaluate({"s": 7}) == 1
    assert view_elements(C(()).expand_dim(0, s)) == as_expr(1)


def test_elementwise_and_reduce():
    x = inp(0, "x", (s, 64), BF16)
    b = inp(1, "b", (64,), F32)
    add = op(2, "elementwise", "Add", (Arg(0, C((s, 64))), Arg(1, C((64,)).expand_dim(0, s))), (s, 64), F32)
    prog = Program("p", [x, b, add])
    assert op_bytes(add, prog) == s * 64 * 2 + 64 * 4 + s * 64 * 4
    assert op_flops(add) == 64 * s
    red = op(3, "reduce", "Sum", (Arg(2, C((s, 64))),), (s,), F32, axis=1)
    assert op_bytes(red) == s * 64 * 4 + s * 4
    assert op_flops(red) == 64 * s
    # a reduce over a broadcast dim reads each element once but adds over all of them
    red_b = op(4, "reduce", "Sum", (Arg(1, C((64,)).expand_dim(0, s)),), (64,), F32, axis=0)
    assert op_bytes(red_b) == as_expr(64 * 4 + 64 * 4)
    assert op_flops(red_b) == 64 * s


def test_non_kernels_cost_nothing():
    x = inp(0, "x", (s, 8))
    c = op(1, "constant", "", (), (), F32, value=1.0)
    o = op(2, "output", "", (Arg(0, C((s, 8))),), (s, 8), F32, name="y", role="output")
    for k in (x, c, o):
        assert op_bytes(k) == as_expr(0) and op_flops(k) == as_expr(0)
        assert estimate_op(k, {"s": 4}, H200) == 0.0
    io = op(3, "iota", "", (), (s,), I64, n=s)
    assert op_bytes(io) == 8 * s and op_flops(io) == as_expr(0)


def test_gather_scatter_bytes():
    table = inp(0, "emb", (1000, 64), BF16)
    idx = inp(1, "tok", (s,), I64)
    g = op(2, "gather", "", (Arg(0, C((1000, 64))), Arg(1, C((s,)))), (s, 64), BF16)
    prog = Program("p", [table, idx, g])
    b = op_bytes(g, prog)
    assert b.evaluate({"s": 3}) == 3 * 64 * 2 * 2 + 3 * 8       # rows read + rows written + indices
    assert b.evaluate({"s": 5000}) == 1000 * 64 * 2 + 5000 * 64 * 2 + 5000 * 8   # never more than the table
    assert op_flops(g) == as_expr(0)
    cache = inp(3, "cache", (128, 8), F32)
    src = inp(4, "new", (s, 8), F32)
    args = (Arg(3, C((128, 8))), Arg(4, C((s, 8))), Arg(1, C((s,))))
    sc = op(5, "scatter", "", args, (128, 8), F32)
    nc = op(6, "scatter_nocopy", "", args, (128, 8), F32)
    nc.alias = 0
    prog = Program("p", [table, idx, g, cache, src, sc, nc])
    assert op_bytes(sc, prog) == 2 * 128 * 8 * 4 + s * 8 * 4 + s * 8
    assert op_bytes(nc, prog) == 2 * s * 8 * 4 + s * 8                # only the written rows
    assert op_flops(sc) == as_expr(0)


def test_gemm_bytes_and_flops():
    a = inp(0, "a", (4096,), BF16)
    b = inp(1, "b", (4096,), BF16)
    g = op(2, "gemm", "RmCm", (Arg(0, C((4096,))), Arg(1, C((4096,)))), (8, s, 32), F32, layout="RmCm",
           m=s, n=32, k=16, lda=16, ldb=16, batch=8, stride_a=s * 16, stride_b=0)
    prog = Program("p", [a, b, g])
    assert op_flops(g) == 2 * 8 * 32 * 16 * s
    # A read per batch, B broadcast (stride 0) read once, C written
    assert op_bytes(g, prog) == 8 * s * 16 * 2 + 16 * 32 * 2 + 8 * s * 32 * 4


def test_estimate_roofline_memory_and_compute_bound():
    spec = GpuSpec("toy", mem_bandwidth=1e9, fp32_flops=1e9, tensor_flops=1e12, launch_overhead=1e-6, l2_bytes=0)
    x = inp(0, "x", (s,))
    e = op(1, "elementwise", "Exp2", (Arg(0, C((s,))),), (s,), F32)
    # memory bound: 8 bytes per element at 1e9 B/s vs 1 flop per element at 1e9 FLOP/s
    assert math.isclose(estimate_op(e, {"s": 1000}, spec), 8000 / 1e9 + 1e-6)
    a, b = inp(2, "a", (1 << 20,), BF16), inp(3, "b", (1 << 20,), BF16)
    n = 512
    g = op(4, "gemm", "RmRm", (Arg(2, C((1 << 20,))), Arg(3, C((1 << 20,)))), (n, n), F32, layout="RmRm",
           m=n, n=n, k=n, lda=n, ldb=n)
    prog = Program("p", [x, e, a, b, g])
    t = estimate_op(g, {}, spec, prog)
    flops, nbytes = 2 * n ** 3, 2 * n * n * 2 + n * n * 4
    assert math.isclose(t, max(flops / 1e12, nbytes / 1e9) + 1e-6)
    # f32 operands run on the CUDA cores
    g32 = op(4, "gemm", "RmRm", g.args, (n, n), F32, **g.params)
    prog32 = Program("p", [x, e, inp(2, "a", (1 << 20,), F32), inp(3, "b", (1 << 20,), F32), g32])
    assert math.isclose(estimate_op(g32, {}, spec, prog32), flops / 1e9 + 1e-6)
    total = estimate_program(prog, {"s": 1000}, spec)
    assert math.isclose(total, estimate_op(e, {"s": 1000}, spec) + t)
    assert estimate_many(prog, [{"s": 1000}, {"s": 10}], spec)[1] < total


def test_fusion_is_cheaper_and_h200_decode_is_bandwidth_bound():
    # two separate elementwise kernels vs one doing the same (launch + intermediate traffic)
    x = inp(0, "x", (s, 4096), BF16)
    e1 = op(1, "elementwise", "Exp2", (Arg(0, C((s, 4096))),), (s, 4096), BF16)
    e2 = op(2, "elementwise", "Sqrt", (Arg(1, C((s, 4096))),), (s, 4096), BF16)
    two = Program("two", [x, e1, e2])
    one = Program("one", [x, op(1, "elementwise", "Sqrt", (Arg(0, C((s, 4096))),), (s, 4096), BF16)])
    assert estimate_program(one, {"s": 1}, H200) < estimate_program(two, {"s": 1}, H200)
    # a decode matvec with a 4096x4096 bf16 weight: ~32 MiB over ~4.25 TB/s ≈ 8 µs
    w, v = inp(0, "w", (4096 * 4096,), BF16), inp(1, "v", (4096,), BF16)
    g = op(2, "gemm", "RmCm", (Arg(1, C((4096,))), Arg(0, C((4096 * 4096,)))), (1, 4096), BF16, layout="RmCm",
           m=1, n=4096, k=4096, lda=4096, ldb=4096)
    t = estimate_op(g, {}, H200, Program("mv", [w, v, g]))
    assert 7e-6 < t < 12e-6


def test_annotate_fills_program_fields():
    x = inp(0, "x", (s, 8))
    e = op(1, "elementwise", "Recip", (Arg(0, C((s, 8))),), (s, 8), F32)
    prog = annotate(Program("p", [x, e]))
    assert prog.ops[1].bytes == 64 * s and prog.ops[1].flops == 8 * s
    assert prog.total_bytes() == 64 * s
    back = Program.loads(prog.dumps())
    assert back.ops[1].bytes == 64 * s


def test_missing_gemm_param_is_clear():
    g = op(0, "gemm", "RmRm", (), (2, 2), F32, layout="RmRm", n=2, k=2)
    with pytest.raises(ValueError, match="lacks parameter 'm'"):
        op_flops(g)


def test_op_cost_for_extraction():
    x = inp(0, "x", (s, 8))
    e = op(1, "elementwise", "Recip", (Arg(0, C((s, 8))),), (s, 8), F32)
    assert op_cost(x) == 0.0
    # dyn vars default to a representative 512; recorded bytes win when there is no program
    assert math.isclose(op_cost(e), max(512 * 64 / H200.mem_bandwidth, 512 * 8 / H200.fp32_flops)
                        + H200.launch_overhead)
    assert math.isclose(op_cost(e, {"s": 3}), estimate_op(e, {"s": 3}))
    e.bytes = 1000 * s
    assert math.isclose(op_cost(e, {"s": 3}), 3000 / H200.mem_bandwidth + H200.launch_overhead)
    prog = Program("p", [x, e])
    assert math.isclose(op_cost(e, {"s": 3}, program=prog), estimate_op(e, {"s": 3}, H200, prog))
