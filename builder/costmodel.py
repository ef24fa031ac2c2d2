"""Roofline cost model: what extraction uses to pick among candidates when no GPU is there to measure.

Each LLIR op moves bytes and does flops; its time is ``max(bytes / bandwidth, flops / peak)`` plus a
fixed launch overhead when it is a kernel (reduce kernels get ``reduce_efficiency`` of the bandwidth).
Bytes and flops are symbolic :class:`~lum.format.expr.Expr` (functions of the dyn vars), so one
extraction decision can be costed for several dyn_maps (e.g. a prefill bucket and decode), and they
are what the builder records in ``LOp.bytes`` / ``LOp.flops``.

Bytes read through a view count the *distinct* elements it reads: a broadcast (stride-0) dim reads
the same elements again and costs nothing extra (the reuse is served from registers, shared memory or
L2), and padding reads nothing. Overlapping windows are not detected (counted as distinct), so the
figure is an upper bound there.

    spec = H200
    t = estimate_program(program, {"s": 512}, spec)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from lum.builder.attention_policy import flash_attention
from lum.format.dtypes import DType
from lum.format.expr import Expr, as_expr, smax, smin
from lum.format.llir import LOp, Program, expr_nodes, gemm_parts
from lum.format.shapetracker import ShapeTracker, numel

__all__ = ["GpuSpec", "H200", "CPU_REFERENCE", "view_elements", "op_bytes", "op_flops", "estimate_op",
           "estimate_program", "estimate_many", "op_cost", "annotate"]

NON_KERNEL_KINDS = ("input", "output", "constant")


@dataclass(frozen=True)
class GpuSpec:
    """What the roofline needs to know about a device. All rates are *achievable*, not datasheet."""

    name: str
    mem_bandwidth: float       # bytes/s, sustained device-memory copy bandwidth
    fp32_flops: float          # FLOP/s on the CUDA cores (fp32 FMA = 2 flops); elementwise, reductions, fp32 gemm
    tensor_flops: float        # FLOP/s of dense bf16/f16 tensor-core gemm (fp32 accumulate)
    launch_overhead: float     # seconds of fixed cost per kernel (launch + ramp-up/tail), inside a CUDA graph
    l2_bytes: int              # last-level cache size
    # fraction of mem_bandwidth a reduce kernel reaches: reduce.cu loads one element at a time, the GEMM
    # kernels (gemv.cu, cuBLASLt) vectorise, so a sum of products that is also a GEMM (the same bytes and
    # flops on the roofline, e.g. a decode GEMV as a reduce with a fused x*W prologue) stays a GEMM.
    # An estimate, not a measurement.
    reduce_efficiency: float = 0.9

    def peak_flops(self, dtype: DType, tensor_core: bool = False) -> float:
        """The compute roof for an op: tensor cores for a bf16/f16 gemm, CUDA cores otherwise."""
        if tensor_core and dtype in (DType.bf16, DType.f16):
            return self.tensor_flops
        return self.fp32_flops


# NVIDIA H200 SXM (141 GB HBM3e). Datasheet: 4.8 TB/s, 67 TFLOP/s fp32, 989 TFLOP/s dense bf16, 50 MB L2.
# We use achievable figures: ~4.25e12 B/s measured by a device-to-device copy (≈ 89 % of the
# datasheet, as on H100), ~790e12 FLOP/s for large bf16 cuBLASLt GEMMs (≈ 80 % of peak), the full
# fp32 rate (elementwise/reduce kernels are bandwidth-bound long before it matters), and 3 µs per
# kernel: the usual launch-to-launch cost of small kernels (≈ 2 µs when replayed in a CUDA graph,
# ≈ 4-5 µs launched one by one), which is what makes fusing many tiny ops worth it.
H200 = GpuSpec(name="NVIDIA H200", mem_bandwidth=4.25e12, fp32_flops=67e12, tensor_flops=790e12,
               launch_overhead=3e-6, l2_bytes=50 * 2**20)

# The numpy reference backend on one CPU core-ish: ~10 GB/s effective (float64 temporaries double the
# traffic), ~20 GFLOP/s (BLAS matmul does better, elementwise numpy worse), ~20 µs of Python per op.
# Only meant to make "which program is cheaper on the reference backend" questions answerable.
CPU_REFERENCE = GpuSpec(name="cpu-numpy-reference", mem_bandwidth=10e9, fp32_flops=20e9, tensor_flops=20e9,
                        launch_overhead=20e-6, l2_bytes=32 * 2**20)


# ====================================================================== bytes and flops
def view_elements(view: ShapeTracker) -> Expr:
    """Distinct buffer elements a view reads: broadcast (stride-0) dims count once, padding not at all."""
    out = as_expr(1)
    zero = as_expr(0)
    mask = view.mask
    for k, (d, s) in enumerate(zip(view.shape, view.strides)):
        if mask is not None:
            lo, hi = mask[k]
            ext = smax(smin(hi, d) - smax(lo, 0), 0)
            if lo == zero and hi == d:
                ext = d
        else:
            ext = d
        if s == zero:
            # a broadcast dim reads one element; kept as 1 (not min(ext, 1)) so recorded byte counts stay
            # readable — an empty broadcast dim is costed as one element
            ext = as_expr(1) if mask is None else smin(ext, 1)
        out = out * ext
    return out


def _arg_dtype(op: LOp, k: int, program: Program | None) -> DType:
    if program is not None:
        return program.ops[op.args[k].src].dtype
    # Without the program the producers' dtypes are unknown: guess from the op.
    if (op.kind == "gather" and k == 1) or (op.kind in ("scatter", "scatter_nocopy") and k == len(op.args) - 1):
        return DType.i64
    if op.kind == "elementwise" and op.op == "Where" and k == 0:
        return DType.bool
    if op.kind == "elementwise" and op.op in ("LessThan", "Cast"):
        return DType.f32
    return op.dtype


def _p(op: LOp, key: str, default: int | None = None) -> Expr:
    v = op.params.get(key, default)
    if v is None:
        raise ValueError(f"LLIR op {op.id} ({op.kind}) lacks parameter {key!r}")
    return as_expr(v)


def _batch_reads(stride: Expr, batch: Expr) -> Expr:
    """How many distinct batch slices an operand with this batch stride reads."""
    return as_expr(1) if stride == as_expr(0) else batch


def op_bytes(op: LOp, program: Program | None = None) -> Expr:
    """Bytes the op reads (distinct elements of each argument's view) plus bytes it writes (a Fused
    op or a reduce with a fused prologue reads only its leaves: its args).

    Pass the ``program`` so each argument's element size comes from its producer's dtype; without it
    the op's own dtype is assumed (with index tensors taken as i64).
    """
    kind = op.kind
    if kind in NON_KERNEL_KINDS:
        return as_expr(0)
    out_elems = numel(op.shape)
    written = out_elems * op.dtype.itemsize

    def read(k: int) -> Expr:
        return view_elements(op.args[k].view) * _arg_dtype(op, k, program).itemsize

    if kind == "iota":
        return written
    if kind in ("elementwise", "reduce"):
        total = written
        for k in range(len(op.args)):
            total = total + read(k)
        return total
    if kind == "attention":     # q, k, v and the mask once each, the chunk partials written
        total = written
        for k in range(len(op.args)):
            total = total + read(k)
        return total
    if kind == "gather":
        # only the picked rows of the table are read (at most the whole table)
        rows_read = smin(out_elems, view_elements(op.args[0].view))
        return written + read(1) + rows_read * _arg_dtype(op, 0, program).itemsize
    if kind in ("scatter", "scatter_nocopy"):
        # the src rows (args[1], or a fused prologue's leaves args[1:-1]) and the indices (args[-1])
        rows = as_expr(0)
        for k in range(1, len(op.args)):
            rows = rows + read(k)
        if kind == "scatter":
            return written + read(0) + rows
        # in place: only the scattered rows are written, dest is not read
        return rows + numel(op.args[1].view.shape) * op.dtype.itemsize
    if kind == "gemm":
        m, n, k, batch = _p(op, "m"), _p(op, "n"), _p(op, "k"), _p(op, "batch", 1)
        jb, _ = gemm_parts(op)
        if "expr" in op.params:          # a fused prologue reads its leaves (once: every block's rereads hit L2)
            a = as_expr(0)
            for j in range(jb):
                a = a + read(j)
        else:
            a = _batch_reads(_p(op, "stride_a", 0), batch) * m * k * _arg_dtype(op, 0, program).itemsize
        b = _batch_reads(_p(op, "stride_b", 0), batch) * k * n * _arg_dtype(op, jb, program).itemsize
        for j in range(jb + 1, len(op.args)):    # a fused epilogue's leaves
            b = b + read(j)
        return a + b + written
    raise ValueError(f"no cost model for LLIR op kind {kind!r}")


def op_flops(op: LOp) -> Expr:
    """Arithmetic: elementwise numel(out) (times the expression's op nodes when Fused); reduce numel(in)
    (plus numel(in) per op node of a fused prologue ``expr``); gemm 2·batch·m·n·k; a scatter's prologue
    numel(src) per op node; data movement 0."""
    kind = op.kind
    if kind == "elementwise":
        return numel(op.shape) * expr_nodes(op.params["expr"]) if op.op == "Fused" else numel(op.shape)
    if kind == "reduce":
        return numel(op.args[0].view.shape) * (1 + expr_nodes(op.params["expr"]) if "expr" in op.params else 1)
    if kind == "gemm":
        flops = 2 * _p(op, "batch", 1) * _p(op, "m") * _p(op, "n") * _p(op, "k")
        if "expr" in op.params:
            flops = flops + numel(op.args[0].view.shape) * expr_nodes(op.params["expr"])
        if "epilogue" in op.params:
            flops = flops + numel(op.shape) * expr_nodes(op.params["epilogue"])
        return flops
    if kind == "attention":     # q·k and p·v over every (row, key) pair
        q, k, v = (a.view.shape for a in op.args[:3])
        return 2 * numel(q[:-1]) * k[-2] * (q[-1] + v[-1])
    if kind in ("scatter", "scatter_nocopy") and "expr" in op.params:
        return numel(op.args[1].view.shape) * expr_nodes(op.params["expr"])
    return as_expr(0)


# ====================================================================== time
def _bandwidth(op: LOp, spec: GpuSpec) -> float:
    return spec.mem_bandwidth * (spec.reduce_efficiency if op.kind == "reduce" else 1.0)


def _peak(op: LOp, spec: GpuSpec, program: Program | None) -> float:
    if op.kind == "gemm" and "expr" not in op.params:
        dts = {_arg_dtype(op, 0, program), _arg_dtype(op, 1, program)}
        if dts <= {DType.bf16, DType.f16}:
            return spec.tensor_flops
    if op.kind == "attention" and flash_attention(op):
        # flash attention runs both products on tensor cores where q, k, v and the probabilities share one
        # 16-bit dtype (without the program: where the probabilities are 16-bit, as in 16-bit models)
        pdt = DType.parse(op.params["p_dtype"])
        dts = {_arg_dtype(op, k, program) for k in range(3)} if program is not None else {pdt}
        if pdt in (DType.bf16, DType.f16) and dts == {pdt}:
            return spec.tensor_flops
    return spec.fp32_flops


def estimate_op(op: LOp, dyn_map: Mapping[str, int], spec: GpuSpec = H200,
                program: Program | None = None) -> float:
    """Seconds: ``max(bytes / bandwidth, flops / peak) + launch overhead`` (0 for input/output/constant)."""
    if op.kind in NON_KERNEL_KINDS:
        return 0.0
    nbytes = op_bytes(op, program).evaluate(dyn_map)
    flops = op_flops(op).evaluate(dyn_map)
    return max(nbytes / _bandwidth(op, spec), flops / _peak(op, spec, program)) + spec.launch_overhead


def op_cost(op: LOp, dyn_map: Mapping[str, int] | None = None, spec: GpuSpec = H200,
            program: Program | None = None, default_dim: int = 512) -> float:
    """Seconds for one op as extraction's cost function (``Callable[[LOp], float]``).

    Unlike :func:`estimate_op` it needs no program and no full dyn_map: with no ``program``, the op's
    recorded ``bytes``/``flops`` are used when set (the lowering computed them knowing the producers'
    dtypes), else :func:`op_bytes` / :func:`op_flops`; dyn vars missing from ``dyn_map`` take
    ``default_dim`` (a representative size, so a choice is made for typical rather than empty shapes).
    """
    if op.kind in NON_KERNEL_KINDS:
        return 0.0
    zero = as_expr(0)
    if program is None and not (op.bytes == zero and op.flops == zero):
        nbytes_e, flops_e = op.bytes, op.flops
    else:
        nbytes_e, flops_e = op_bytes(op, program), op_flops(op)
    env = {v: default_dim for v in nbytes_e.vars() | flops_e.vars()}
    env.update(dyn_map or {})
    nbytes, flops = nbytes_e.evaluate(env), flops_e.evaluate(env)
    return max(nbytes / _bandwidth(op, spec), flops / _peak(op, spec, program)) + spec.launch_overhead


def estimate_program(program: Program, dyn_map: Mapping[str, int], spec: GpuSpec = H200) -> float:
    """Seconds for the whole program: the sum of its ops (they run one after another)."""
    return sum(estimate_op(o, dyn_map, spec, program) for o in program.ops)


def annotate(program: Program) -> Program:
    """Fill every op's ``bytes`` and ``flops`` from this model (in place); returns the program."""
    for o in program.ops:
        o.bytes = op_bytes(o, program)
        o.flops = op_flops(o)
    return program


def estimate_many(program: Program, dyn_maps: Sequence[Mapping[str, int]], spec: GpuSpec = H200) -> list[float]:
    """:func:`estimate_program` for several dyn_maps (e.g. prefill buckets and a decode step)."""
    return [estimate_program(program, d, spec) for d in dyn_maps]
