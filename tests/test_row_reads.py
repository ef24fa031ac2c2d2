"""Row reads (builder/row_reads.py): a row kernel read by row kernels within its rows — gemma's q and k
norms, read by RoPE plainly and through the shifted, masked views of rotate_half — is recomputed in
them and dropped.

Checked here: tiny-gemma3's decode and prefill layers lose both norms (two kernels a layer) and compute
bit for bit what they computed before (reference backend, random inputs); llama (no such norms) is
unchanged; a padded element stays exactly 0 where the inlined tree there is 0·∞ (the guard); reads the
rewrite cannot express, readers that are not row kernels and programs without a nonzero scalar
constant are left alone; ``LUM_ROW_READS=0``. The kernels' numbers run through the emulated driver in
tests/test_cuda_emulated.py (whole tiny models against the reference).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("egglog")

from lum.builder import row_reads  # noqa: E402
from lum.builder.compile import compile_group  # noqa: E402
from lum.format.dtypes import DType  # noqa: E402
from lum.format.expr import as_expr  # noqa: E402
from lum.format.llir import Arg, LOp, Program  # noqa: E402
from lum.format.shapetracker import ShapeTracker  # noqa: E402
from lum.loader.reference_backend import execute  # noqa: E402
from tests.test_prologue import _groups, _random_inputs  # noqa: E402


def _norm_readers(prog: Program) -> int:
    """Row-kernel producers (Fused with a row reduction) that only row kernels read."""
    users: dict[int, list[LOp]] = {}
    for o in prog.ops:
        for a in o.args:
            users.setdefault(a.src, []).append(o)
    return sum(1 for o in prog.ops if row_reads._row_tree(o) is not None and users.get(o.id)
               and all(row_reads._leaves(u) is not None for u in users[o.id]))


# tiny-gemma3's decode layer: the q and k norms, and the next layer's input norm (norms_ahead)
@pytest.mark.parametrize("model,entry,dyn,per_layer", [("tiny-gemma3", "decode", {"p": 5}, 3),
                                                       ("tiny-gemma3", "prefill", {"s": 6}, 2),
                                                       ("tiny-llama", "decode", {"p": 5}, 0)])
def test_norms_read_by_rope_are_recomputed_bit_for_bit(model, entry, dyn, per_layer, monkeypatch):
    layer_drop = 0
    for cg in _groups(model, entry):
        monkeypatch.setenv(row_reads.ENV_ROW_READS, "0")
        plain = compile_group(cg)[0]
        monkeypatch.delenv(row_reads.ENV_ROW_READS)
        fused = compile_group(cg)[0]
        dropped = len(plain.kernels()) - len(fused.kernels())
        layer_drop = max(layer_drop, dropped)
        assert dropped >= 0 and _norm_readers(fused) == 0
        assert Program.loads(fused.dumps()).dumps() == fused.dumps()
        inputs = _random_inputs(plain, {k: v for k, v in dyn.items()})
        want, have = execute(plain, inputs, dyn), execute(fused, inputs, dyn)
        assert want.keys() == have.keys()
        for k in want:
            assert np.array_equal(want[k], have[k]), k
            assert not np.isnan(have[k]).any(), k
    assert layer_drop == per_layer


def _shifted(k: int = 8, eps: float = 0.0, guard: bool = True, shift: int | None = None,
             reader: str = "row") -> Program:
    """x [2, k] → P = x·rsqrt(Σx²·c + eps) (a row kernel) → C = P + P shifted by k/2 (masked) + ΣP over the
    row (a row kernel; ``reader="plain"``: without the sum, a plain elementwise op; ``"masked"``: twice the
    shifted read alone; ``"gemm"``: 1 / P)."""
    half = k // 2 if shift is None else shift
    ops = [LOp(0, "input", "Input", (), (as_expr(2), as_expr(k)), DType.f32, {"name": "x", "role": "input"}),
           LOp(1, "constant", "Constant", (), (), DType.f32, {"value": 1.0 / k if guard else 0.0}),
           LOp(2, "constant", "Constant", (), (), DType.f32, {"value": eps})]
    row = ShapeTracker.contiguous((as_expr(2), as_expr(k)))
    scalar = ShapeTracker(row.shape, (as_expr(0), as_expr(0)), as_expr(0), None)
    inv = ["Recip", "f32", ["Sqrt", "f32", ["Add", "f32", ["Mul", "f32", ["RowSum", "f32", ["Mul", "f32", ["arg", 0],
                                                                                           ["arg", 0]]],
                                                          ["arg", 1]], ["arg", 2]]]]
    ops.append(LOp(3, "elementwise", "Fused", (Arg(0, row), Arg(1, scalar), Arg(2, scalar)), row.shape, DType.f32,
                   {"expr": ["Mul", "f32", ["arg", 0], inv]}))
    moved = ShapeTracker(row.shape, row.strides, as_expr(half), ((as_expr(0), as_expr(2)), (as_expr(0), as_expr(k - half))))
    body = ["Add", "f32", ["arg", 0], ["arg", 1]]
    if reader == "masked":                    # the shifted read alone: its padding shows in the output
        body = ["Add", "f32", ["arg", 1], ["arg", 1]]
    if reader == "row":
        body = ["Add", "f32", body, ["RowSum", "f32", ["arg", 0]]]
    ops.append(LOp(4, "elementwise", "Fused", (Arg(3, row), Arg(3, moved)), row.shape, DType.f32, {"expr": body}))
    if reader == "gemm":                      # a reader that is not a row kernel: P stays a buffer
        ops[-1] = LOp(4, "elementwise", "Recip", (Arg(3, row),), row.shape, DType.f32)
    ops.append(LOp(5, "output", "Output", (Arg(4, row),), row.shape, DType.f32, {"name": "y", "role": "output"}))
    return Program("p", ops)


def test_a_shifted_masked_read_is_recomputed_exactly():
    prog = _shifted()
    out = row_reads.inline_row_reads(prog)
    assert [o.kind for o in out.ops] == ["input", "constant", "constant", "elementwise", "output"]
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.5, (2, 8)).astype(np.float32)
    want, got = execute(prog, {"x": x})["y"], execute(out, {"x": x})["y"]
    assert np.array_equal(want, got)
    x64 = x.astype(np.float64)
    p = x64 / np.sqrt((x64 * x64).sum(1, keepdims=True) / 8)
    shifted = np.zeros_like(p)
    shifted[:, :4] = p[:, 4:]
    ref = p + shifted + p.sum(1, keepdims=True)
    assert np.allclose(got, ref, rtol=1e-5)


def test_padding_stays_zero_where_the_tree_is_zero_times_infinity():
    """eps = 0 and a zero row: P's row is 0·∞ = NaN, but its padded elements read 0, as from the buffer."""
    prog = _shifted(eps=0.0, reader="masked")
    out = row_reads.inline_row_reads(prog)
    assert out is not prog
    x = np.zeros((2, 8), np.float32)
    x[1] = 1.0
    want, got = execute(prog, {"x": x})["y"], execute(out, {"x": x})["y"]
    assert np.array_equal(want, got, equal_nan=True)
    assert np.isnan(got[0, :4]).all() and (got[0, 4:] == 0).all() and not np.isnan(got[1]).any()


@pytest.mark.parametrize("case", ["no_guard", "out_of_row", "not_a_row_kernel"])
def test_reads_it_cannot_express_stay(case):
    prog = {"no_guard": lambda: _shifted(guard=False), "out_of_row": lambda: _shifted(shift=6),
            "not_a_row_kernel": lambda: _shifted(reader="gemm")}[case]()
    if case == "out_of_row":    # mask [0, 2) shifted by 6: columns 6, 7 — inside; shift so they leave the row
        prog = Program("p", [*prog.ops[:4], LOp(4, "elementwise", "Fused",
                       (prog.ops[4].args[0], Arg(3, ShapeTracker(prog.ops[4].args[1].view.shape,
                                                                 prog.ops[4].args[1].view.strides, as_expr(6),
                                                                 ((as_expr(0), as_expr(2)), (as_expr(0), as_expr(4)))))),
                       prog.ops[4].shape, DType.f32, prog.ops[4].params), prog.ops[5]])
    assert row_reads.inline_row_reads(prog) is prog


def test_a_plain_reader_becomes_a_row_kernel(monkeypatch):
    prog = _shifted(reader="plain")
    out = row_reads.inline_row_reads(prog)
    assert len(out.ops) == len(prog.ops) - 1
    x = np.random.default_rng(1).uniform(0.5, 1.5, (2, 8)).astype(np.float32)
    assert np.array_equal(execute(prog, {"x": x})["y"], execute(out, {"x": x})["y"])
    monkeypatch.setenv(row_reads.ENV_ROW_READS, "0")
    assert not row_reads.row_reads_enabled()
