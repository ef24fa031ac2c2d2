"""The e-graph rules (rules/*.egg) fire on the patterns they are meant for and not on near misses.

GEMM: every layout (RmRm, RmCm, CmRm, CmCm), the batched form, flattening of the rank-5 GQA
attention pattern; never on a padded operand, a reduction over a non-last axis, an operand with no
unit stride, a product that feeds no SumReduce, or a broadcast operand (leading dim 0).
In place: a KV-cache Scatter becomes ScatterNoCopy only when its destination is writable and read by
nothing else. Each firing is also checked numerically: the program that uses it, run by the LLIR
reference backend, matches the HLIR reference interpreter.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("egglog")

from lum.builder import frontend as F  # noqa: E402
from lum.builder.egraph import SaturatedGroup, rule_text, saturate  # noqa: E402
from lum.builder.extract import chosen, lower, random_choice  # noqa: E402
from lum.builder.hlir import Graph  # noqa: E402
from lum.builder.partition import chunk_graph, partition  # noqa: E402
from lum.builder.reference import run_graph  # noqa: E402
from lum.format.dtypes import DType  # noqa: E402
from lum.format.expr import Var, as_expr  # noqa: E402
from lum.loader.reference_backend import execute  # noqa: E402

RNG = np.random.default_rng(1234)


# ====================================================================== helpers
def _inputs(g: Graph, dyn: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    out = {}
    for n in g.inputs():
        shape = tuple(d.evaluate(dyn or {}) for d in n.shape)
        if n.dtype.is_int:
            out[n.attrs["name"]] = RNG.integers(0, max(1, shape[0] if shape else 1), size=shape).astype(n.dtype.np)
        else:
            out[n.attrs["name"]] = RNG.standard_normal(shape).astype(n.dtype.np)
    return out


def _result_class(sat: SaturatedGroup, name: str = "out") -> int:
    """The e-class of the buffer the Output ``name`` reads."""
    g = sat.graph
    node = next(n for n in g.nodes if n.op == "Output" and n.attrs["name"] == name)
    return sat.node_class[node.inputs[0].src]


def _gemms(sat: SaturatedGroup, cls: int | None = None) -> list:
    if cls is None:
        return [n for _, n in sat.enodes("Gemm")]
    return [n for n in sat.classes[cls].nodes if n.op == "Gemm"]


def _gemm_params(sat: SaturatedGroup, node) -> dict:
    keys = ("m", "n", "k", "lda", "ldb", "batch", "stride_a", "stride_b", "offset_a", "offset_b")
    return {"layout": node.args[0], **{k: sat.dim(c) for k, c in zip(keys, node.args[3:13])}}


def _choose(sat: SaturatedGroup, cls: int, op: str, base: dict | None = None) -> dict:
    """A choice that picks constructor ``op`` in class ``cls`` (option 0 elsewhere)."""
    choice = dict(base or {})
    choice[cls] = next(i for i, n in enumerate(sat.options[cls]) if n.op == op)
    return choice


def _check_program(sat: SaturatedGroup, choice: dict, dyn: dict[str, int] | None = None,
                   inputs: dict | None = None) -> None:
    g = sat.graph
    inputs = inputs if inputs is not None else _inputs(g, dyn)
    ref = run_graph(g, inputs, dyn)
    got = execute(lower(sat, choice), inputs, dyn)
    for k, want in ref.items():
        scale = max(float(np.abs(want.astype(np.float64)).max()), 1e-30)
        err = float(np.abs(got[k].astype(np.float64) - want.astype(np.float64)).max()) / scale
        assert err < 1e-5, (k, err)


def _matmul_graph(a_shape, b_shape, a_perm=None, b_perm=None, dyn=None):
    """out = a' @ b' where a' / b' are inputs of the stored shapes, permuted by a_perm / b_perm."""
    g = Graph("mm")
    a = F.input_tensor(g, "a", a_shape, "f32")
    b = F.input_tensor(g, "b", b_shape, "f32", role="weight")
    if a_perm:
        a = a.permute(a_perm)
    if b_perm:
        b = b.permute(b_perm)
    F.output(F.matmul(a, b), "out")
    return g


# ====================================================================== GEMM layouts
@pytest.mark.parametrize("case, a_shape, a_perm, b_shape, b_perm, layout, lda, ldb", [
    # x @ W^T for a [n, k] weight (the linear layer): A row-major, B column-major
    ("x@W^T", (5, 8), None, (6, 8), (1, 0), "RmCm", 8, 8),
    # x @ W for a [k, n] weight
    ("x@W", (5, 8), None, (8, 6), None, "RmRm", 8, 6),
    # A stored transposed [k, m]
    ("a^T@W", (8, 5), (1, 0), (8, 6), None, "CmRm", 5, 6),
    ("a^T@W^T", (8, 5), (1, 0), (6, 8), (1, 0), "CmCm", 5, 8),
])
def test_gemm_layouts_fire_on_their_pattern(case, a_shape, a_perm, b_shape, b_perm, layout, lda, ldb):
    g = _matmul_graph(a_shape, b_shape, a_perm, b_perm)
    sat = saturate(g)
    cls = _result_class(sat)
    gemms = _gemms(sat, cls)
    assert [n.args[0] for n in gemms] == [layout], case
    p = _gemm_params(sat, gemms[0])
    assert (p["m"], p["n"], p["k"], p["lda"], p["ldb"]) == tuple(map(as_expr, (5, 6, 8, lda, ldb)))
    assert p["batch"] == as_expr(1)
    assert sat.fired(f"gemm-{layout.lower()}") >= 1
    assert cls in sat.decisions
    _check_program(sat, _choose(sat, cls, "Gemm"))
    _check_program(sat, _choose(sat, cls, "KSumReduce"))


def test_symbolic_m_linear_is_a_gemm():
    g = Graph("lin")
    x = F.input_tensor(g, "x", [Var("s"), 16], "f32")
    w = F.input_tensor(g, "w", [24, 16], "f32", role="weight")
    F.output(F.linear(x, w), "out")
    sat = saturate(g)
    (gemm,) = _gemms(sat, _result_class(sat))
    p = _gemm_params(sat, gemm)
    assert p["layout"] == "RmCm" and p["m"] == Var("s") and p["n"] == as_expr(24) and p["k"] == as_expr(16)
    _check_program(sat, _choose(sat, _result_class(sat), "Gemm"), {"s": 3})


def test_decode_linear_with_unit_m_gets_a_legal_leading_dim():
    g = Graph("lin1")
    x = F.input_tensor(g, "x", [1, 16], "f32")
    w = F.input_tensor(g, "w", [24, 16], "f32", role="weight")
    F.output(F.linear(x, w), "out")
    sat = saturate(g)
    cls = _result_class(sat)
    assert [n.args[0] for n in _gemms(sat, cls)] == ["RmCm"]
    prog = lower(sat, _choose(sat, cls, "Gemm"))
    (op,) = [o for o in prog.ops if o.kind == "gemm"]
    assert op.params["lda"] == as_expr(16) and op.params["m"] == as_expr(1)
    _check_program(sat, _choose(sat, cls, "Gemm"))


@pytest.mark.parametrize("a_t, b_t, layout, lda, ldb", [
    (False, False, "RmRm", 8, 6), (False, True, "RmCm", 8, 8), (True, False, "CmRm", 5, 6), (True, True, "CmCm", 5, 8),
])
def test_batched_gemm_in_every_layout(a_t, b_t, layout, lda, ldb):
    a_shape = (3, 8, 5) if a_t else (3, 5, 8)
    b_shape = (3, 6, 8) if b_t else (3, 8, 6)
    g = _matmul_graph(a_shape, b_shape, (0, 2, 1) if a_t else None, (0, 2, 1) if b_t else None)
    sat = saturate(g)
    cls = _result_class(sat)
    (gemm,) = _gemms(sat, cls)
    p = _gemm_params(sat, gemm)
    assert p["layout"] == layout and sat.fired(f"bgemm-{layout.lower()}") >= 1
    assert (p["batch"], p["m"], p["n"], p["k"], p["lda"], p["ldb"], p["stride_a"], p["stride_b"]) == \
        tuple(map(as_expr, (3, 5, 6, 8, lda, ldb, 40, 48)))
    _check_program(sat, _choose(sat, cls, "Gemm"))


def test_batched_matmul_is_a_batched_gemm():
    g = _matmul_graph((3, 5, 8), (3, 8, 6))
    sat = saturate(g)
    cls = _result_class(sat)
    (gemm,) = _gemms(sat, cls)
    p = _gemm_params(sat, gemm)
    assert p["layout"] == "RmRm"
    assert (p["batch"], p["m"], p["n"], p["k"]) == tuple(map(as_expr, (3, 5, 6, 8)))
    assert (p["stride_a"], p["stride_b"], p["lda"], p["ldb"]) == tuple(map(as_expr, (40, 48, 8, 6)))
    assert sat.fired("bgemm-rmrm") >= 1
    _check_program(sat, _choose(sat, cls, "Gemm"))


def test_batched_matmul_with_broadcast_operand():
    # a [3, 5, 8] @ W [8, 6] broadcast over the batch: stride_b 0 (or merged into M: one plain GEMM)
    g = _matmul_graph((3, 5, 8), (8, 6))
    sat = saturate(g)
    cls = _result_class(sat)
    gemms = [_gemm_params(sat, n) for n in _gemms(sat, cls)]
    assert any(p["batch"] == as_expr(3) and p["stride_b"] == as_expr(0) for p in gemms)
    assert any(p["batch"] == as_expr(1) and p["m"] == as_expr(15) for p in gemms)  # batch merged into M
    for node in _gemms(sat, cls):
        choice = {cls: sat.options[cls].index(node)}
        _check_program(sat, choice)


@pytest.mark.parametrize("s", [as_expr(3), as_expr(1), Var("s")])
def test_gqa_attention_rank5_flattens_to_a_batched_gemm(s):
    """q [kv, group, s, hd] (a view of contiguous [heads, s, hd]) @ k^T with k [kv, T, hd] broadcast over
    the group: merging group into M gives a rank-4 batched GEMM (batch kv, m group*s)."""
    kv, group, hd, T = 2, 3, 4, 5
    g = Graph("gqa")
    q = F.input_tensor(g, "q", [kv * group, s, hd], "f32")
    k = F.input_tensor(g, "k", [T, kv, hd], "f32", role="state")
    qg = q.reshape(kv, group, s, hd)
    kg = k.permute(1, 0, 2).expand_dim(1, group)          # [kv, group, T, hd], stride 0 on group
    F.output(F.matmul(qg, kg.transpose(-2, -1)), "out")    # [kv, group, s, T]
    sat = saturate(g)
    cls = _result_class(sat)
    gemms = [_gemm_params(sat, n) for n in _gemms(sat, cls)]
    want_m = as_expr(group) * s
    assert any(p["layout"] == "RmCm" and p["batch"] == as_expr(kv) and p["m"] == want_m and p["n"] == as_expr(T)
               and p["k"] == as_expr(hd) and p["stride_a"] == as_expr(group) * s * hd
               and p["stride_b"] == as_expr(hd) and p["ldb"] == as_expr(kv * hd) for p in gemms), gemms
    assert sat.fired("merge-1-2") + sat.fired("squeeze-2") >= 1
    dyn = {"s": 2} if not s.is_const else None
    for node in _gemms(sat, cls):
        _check_program(sat, {cls: sat.options[cls].index(node)}, dyn)


def test_attention_probs_times_v_is_a_batched_gemm():
    kv, group, s, hd, T = 2, 2, 3, 4, 5
    g = Graph("pv")
    p = F.input_tensor(g, "p", [kv, group, s, T], "f32")
    v = F.input_tensor(g, "v", [T, kv, hd], "f32", role="state")
    vg = v.permute(1, 0, 2).expand_dim(1, group)           # [kv, group, T, hd]
    F.output(F.matmul(p, vg), "out")
    sat = saturate(g)
    cls = _result_class(sat)
    gemms = [_gemm_params(sat, n) for n in _gemms(sat, cls)]
    assert any(q["layout"] == "RmRm" and q["batch"] == as_expr(kv) and q["m"] == as_expr(group * s)
               and q["ldb"] == as_expr(kv * hd) for q in gemms), gemms
    for node in _gemms(sat, cls):
        _check_program(sat, {cls: sat.options[cls].index(node)})


def test_mul_operand_order_does_not_matter():
    """(b^T.expand * a.expand).sum(-1): the product with its operands swapped is still x @ W^T."""
    g = Graph("swap")
    a = F.input_tensor(g, "a", [5, 8], "f32")
    w = F.input_tensor(g, "w", [6, 8], "f32", role="weight")
    av = a.expand_dim(1, 6)                                 # [5, 6, 8]
    wv = w.expand_dim(0, 5)                                 # [5, 6, 8]
    F.output((wv * av).sum(-1), "out")
    sat = saturate(g)
    assert [n.args[0] for n in _gemms(sat, _result_class(sat))] == ["RmCm"]


# ====================================================================== GEMM near misses
def test_no_gemm_on_a_padded_operand():
    g = Graph("pad")
    x = F.input_tensor(g, "x", [5, 6], "f32")
    w = F.input_tensor(g, "w", [7, 8], "f32", role="weight")
    F.output(F.linear(x.pad(1, 1, 1), w), "out")           # x padded to [5, 8]: a masked view
    sat = saturate(g)
    assert _gemms(sat) == []
    assert sat.fired("sum-of-products") >= 1                # the product was seen, but not matched
    _check_program(sat, random_choice(sat, 0))


def test_no_gemm_when_reducing_a_non_last_axis():
    g = Graph("axis1")
    a = F.input_tensor(g, "a", [5, 8], "f32")
    b = F.input_tensor(g, "b", [8, 6], "f32", role="weight")
    prod = a.expand_dim(2, 6) * b.expand_dim(0, 5)          # [5, 8, 6], a matmul reduced over axis 1
    F.output(prod.sum(1), "out")
    sat = saturate(g)
    assert sat.fired("sum-of-products") >= 1
    assert _gemms(sat) == []
    _check_program(sat, random_choice(sat, 0))


def test_no_gemm_without_a_unit_stride():
    """A read with strides (2k, 2) is neither row- nor column-major (nor is it after swapping operands)."""
    g = Graph("strided")
    a = F.input_tensor(g, "a", [5, 8, 2], "f32")
    w = F.input_tensor(g, "w", [6, 8], "f32", role="weight")
    a0 = a.slice(2, 0, 1).reshape(5, 8)                     # strides (16, 2)
    assert a0.view.strides == (as_expr(16), as_expr(2))
    F.output(F.linear(a0, w), "out")
    sat = saturate(g)
    assert sat.fired("sum-of-products") >= 1
    assert _gemms(sat) == []
    _check_program(sat, random_choice(sat, 0))


def test_no_gemm_for_a_mul_that_feeds_no_sumreduce():
    g = Graph("nomm")
    a = F.input_tensor(g, "a", [5, 8], "f32")
    w = F.input_tensor(g, "w", [6, 8], "f32", role="weight")
    prod = a.expand_dim(1, 6) * w.expand_dim(0, 5)          # the matmul's product ...
    F.output(prod, "prod")                                   # ... used as such
    F.output(prod.max(-1), "mx")                             # ... and max-reduced
    sat = saturate(g)
    assert sat.fired("sum-of-products") == 0
    assert _gemms(sat) == []


def test_no_gemm_when_the_sum_reads_the_product_through_a_view():
    g = Graph("viewed")
    a = F.input_tensor(g, "a", [5, 8], "f32")
    w = F.input_tensor(g, "w", [6, 8], "f32", role="weight")
    prod = a.expand_dim(1, 6) * w.expand_dim(0, 5)          # [5, 6, 8]
    F.output(prod.slice(2, 0, 4).sum(-1), "out")             # sums only half of k
    sat = saturate(g)
    assert _gemms(sat) == []
    _check_program(sat, random_choice(sat, 0))


def test_no_gemm_for_an_operand_broadcast_over_m():
    """x broadcast over m (stride 0, m > 1) would need lda = 0: not a legal cuBLAS matrix."""
    g = Graph("bcast")
    v = F.input_tensor(g, "v", [8], "f32")
    w = F.input_tensor(g, "w", [6, 8], "f32", role="weight")
    F.output(F.linear(v.reshape(1, 8).broadcast_to((5, 8)), w), "out")
    sat = saturate(g)
    assert sat.fired("gemm-rmcm") >= 1 and sat.fired("gemm-illegal-lda-rmcm") >= 1
    assert _gemms(sat) == []
    _check_program(sat, random_choice(sat, 0))


# ====================================================================== in place
def _kv_write(dest_role: str = "state", read_after: str | None = None) -> Graph:
    """A KV-cache write: cache[pos] = new rows, the updated cache is output and read by attention-ish math."""
    g = Graph("kv")
    cache = F.input_tensor(g, "cache", [16, 2, 4], "f32", role=dest_role)
    new = F.input_tensor(g, "new", [3, 2, 4], "f32")
    pos = F.input_tensor(g, "pos", [3], "i64")
    updated = F.scatter(cache, new, pos)
    F.output(updated, "cache", role="state")
    F.output(updated.slice(0, 0, 8).sum(0), "out")
    if read_after == "op":
        F.output((cache * 2.0).sum(0), "old")                 # the old contents are read by another op
    elif read_after == "output":
        F.output(cache, "old")                                 # ... or output as they are
    return g


def _scatter_class(sat: SaturatedGroup) -> int:
    node = next(n for n in sat.graph.nodes if n.op == "Scatter")
    return sat.node_class[node.id]


def _kv_inputs() -> dict:
    return {"cache": RNG.standard_normal((16, 2, 4)).astype(np.float32),
            "new": RNG.standard_normal((3, 2, 4)).astype(np.float32),
            "pos": np.array([5, 0, 11], dtype=np.int64)}


def test_scatter_no_copy_fires_for_a_kv_cache_write():
    sat = saturate(_kv_write())
    cls = _scatter_class(sat)
    assert sorted(n.op for n in sat.options[cls]) == ["KScatter", "KScatterNoCopy"]
    assert sat.fired("scatter-in-place") == 1
    choice = _choose(sat, cls, "KScatterNoCopy")
    prog = lower(sat, choice)
    (op,) = [o for o in prog.ops if o.kind == "scatter_nocopy"]
    assert op.alias == 0 and prog.ops[op.args[0].src].kind == "input"
    inputs = _kv_inputs()
    before = inputs["cache"].copy()
    _check_program(sat, choice, inputs=inputs)
    assert np.array_equal(inputs["cache"], before)         # the backend copies state it writes in place
    _check_program(sat, _choose(sat, cls, "KScatter"), inputs=_kv_inputs())


@pytest.mark.parametrize("read_after", ["op", "output"])
def test_scatter_no_copy_does_not_fire_when_dest_is_read_after(read_after):
    sat = saturate(_kv_write(read_after=read_after))
    cls = _scatter_class(sat)
    assert [n.op for n in sat.options[cls]] == ["KScatter"]
    assert [n.op for n in sat.classes[cls].nodes if n.op.startswith("KScatter")] == ["KScatter"]
    assert sat.fired("scatter-in-place") == 1                # proposed, then removed by cleanup
    rule = "no-in-place-dest-read-later" if read_after == "op" else "no-in-place-dest-is-output"
    assert sat.fired(rule) == 1
    for seed in range(3):
        _check_program(sat, random_choice(sat, seed), inputs=_kv_inputs())


@pytest.mark.parametrize("role", ["weight", "input"])
def test_scatter_no_copy_never_writes_a_weight_or_plain_input(role):
    sat = saturate(_kv_write(dest_role=role))
    cls = _scatter_class(sat)
    assert [n.op for n in sat.options[cls]] == ["KScatter"]
    assert sat.fired("scatter-in-place") == 0


def test_scatter_no_copy_into_a_buffer_made_in_the_group():
    g = Graph("made")
    base = F.input_tensor(g, "base", [16, 2, 4], "f32", role="weight")
    new = F.input_tensor(g, "new", [3, 2, 4], "f32")
    pos = F.input_tensor(g, "pos", [3], "i64")
    F.output(F.scatter(base * 2.0, new, pos), "out")
    sat = saturate(g)
    cls = _scatter_class(sat)
    assert "KScatterNoCopy" in [n.op for n in sat.options[cls]]
    inputs = {"base": RNG.standard_normal((16, 2, 4)).astype(np.float32),
              "new": RNG.standard_normal((3, 2, 4)).astype(np.float32), "pos": np.array([1, 2, 3])}
    _check_program(sat, _choose(sat, cls, "KScatterNoCopy"), inputs=inputs)


def test_scatter_no_copy_not_when_src_reads_dest():
    g = Graph("self")
    cache = F.input_tensor(g, "cache", [16, 2, 4], "f32", role="state")
    pos = F.input_tensor(g, "pos", [3], "i64")
    F.output(F.scatter(cache, cache.slice(0, 0, 3), pos), "out")   # rows 0..2 copied to pos
    sat = saturate(g)
    assert [n.op for n in sat.options[_scatter_class(sat)]] == ["KScatter"]
    assert sat.fired("no-in-place-src-reads-dest") == 1
    inputs = {"cache": RNG.standard_normal((16, 2, 4)).astype(np.float32), "pos": np.array([1, 2, 9])}
    _check_program(sat, random_choice(sat, 0), inputs=inputs)


def test_scatter_no_copy_not_through_a_partial_view_of_dest():
    g = Graph("partial")
    cache = F.input_tensor(g, "cache", [16, 2, 4], "f32", role="state")
    new = F.input_tensor(g, "new", [3, 2, 4], "f32")
    pos = F.input_tensor(g, "pos", [3], "i64")
    F.output(F.scatter(cache.slice(0, 0, 8), new, pos), "out")   # dest is a view of half the buffer
    sat = saturate(g)
    assert [n.op for n in sat.options[_scatter_class(sat)]] == ["KScatter"]


def test_scatter_no_copy_not_on_an_ext_input_of_a_chunk():
    g = Graph("chunks")
    cache = F.input_tensor(g, "cache", [16, 2, 4], "f32", role="state")
    c2 = cache * 1.0
    g.graph_break()
    new = F.input_tensor(g, "new", [3, 2, 4], "f32")
    pos = F.input_tensor(g, "pos", [3], "i64")
    F.output(F.scatter(c2, new, pos), "out")
    cg = chunk_graph(g, partition(g)[1])
    assert [n.attrs["role"] for n in cg.inputs()] == ["ext", "input", "input"]
    sat = saturate(cg)
    assert [n.op for n in sat.options[_scatter_class(sat)]] == ["KScatter"]


def test_model_layer_scatters_are_in_place_and_gemms_fire():
    from lum.builder.models import load_spec

    spec = load_spec(random_name="tiny-llama", max_seq=32)
    for entry in ("prefill", "decode"):
        g = spec.graphs[entry]
        cg = chunk_graph(g, partition(g)[1])
        sat = saturate(cg)
        ops = {}
        for c in sat.decisions:
            ops.setdefault(tuple(sorted(n.op for n in sat.options[c])), []).append(c)
        assert len(ops[("KScatter", "KScatterNoCopy")]) == 2               # k and v cache writes
        # qkv (stacked), o, gate_up (stacked), down, QK^T; PV is also the attention (rules/attention.egg): in
        # prefill too, where it is flash attention (LUM_FLASH_ATTENTION; tests/test_flash_attention.py)
        assert len(ops[("Gemm", "KSumReduce")]) == 5 and len(ops[("Gemm", "KAttention", "KSumReduce")]) == 1
        layouts = sorted(n.args[0] for _, n in sat.enodes("Gemm"))
        assert layouts.count("RmCm") >= 5 and "RmRm" in layouts


# ====================================================================== mixed-precision GEMM
def _widened_linear(x_dtype="bf16", w_dtype="bf16", slice_x=False, cast_x=True):
    """out = x @ Wᵀ in f32, the operands widened from their stored dtypes (F.linear(..., out_dtype=f32))."""
    g = Graph("mixed")
    x = F.input_tensor(g, "x", [Var("s"), 16], "f32").cast(x_dtype) if cast_x else \
        F.input_tensor(g, "x", [Var("s"), 16], x_dtype)
    w = F.input_tensor(g, "w", [24, 16], w_dtype, role="weight")
    if slice_x:
        x = x.slice(1, 0, 8).pad(1, 0, 8)            # a masked view: the cast does not read x whole
    F.output(F.linear(x, w, out_dtype=DType.f32), "out")
    return g


def _gemm_operand_dtypes(sat: SaturatedGroup, cls: int) -> list[tuple[str, str]]:
    dts = []
    for n in _gemms(sat, cls):
        a, b = n.args[1], n.args[2]
        dts.append((sat.dtype[a], sat.dtype[b]))
    return dts


@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_widened_16bit_products_become_a_mixed_gemm(dt):
    g = _widened_linear(dt, dt)
    sat = saturate(g)
    cls = _result_class(sat)
    assert sat.fired(f"sum-of-widened-{dt}-products") >= 1
    assert (dt, dt) in _gemm_operand_dtypes(sat, cls)            # reads the 16-bit buffers themselves
    assert ("f32", "f32") in _gemm_operand_dtypes(sat, cls)      # the plain one over the casts stays an option
    prog = lower(sat, _choose(sat, cls, "Gemm"))
    mixed = [o for o in prog.ops if o.kind == "gemm" and prog.ops[o.args[1].src].kind == "input"]
    assert mixed and all(o.dtype == DType.f32 and prog.ops[o.args[1].src].dtype == DType.parse(dt) for o in mixed)
    inputs = _inputs(g, {"s": 3})
    ref = run_graph(g, inputs, {"s": 3})["out"].astype(np.float64)
    got = execute(prog, inputs, {"s": 3})["out"]
    assert got.dtype == np.float32
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-6


@pytest.mark.parametrize("case", ["dtypes differ", "operand not cast", "cast of a partial view"])
def test_widened_products_near_misses_stay_f32(case):
    g = {"dtypes differ": lambda: _widened_linear("bf16", "f16"),
         "operand not cast": lambda: _widened_linear("f32", "bf16"),
         "cast of a partial view": lambda: _widened_linear("bf16", "bf16", slice_x=True)}[case]()
    sat = saturate(g)
    assert sat.fired("sum-of-widened-bf16-products") == 0 and sat.fired("sum-of-widened-f16-products") == 0
    assert all(a == b == "f32" for a, b in _gemm_operand_dtypes(sat, _result_class(sat)))


# ====================================================================== dtype propagation
def test_dtype_propagation_matches_the_hlir():
    g = Graph("dt")
    x = F.input_tensor(g, "x", [4, 3], "f32")
    i = F.arange(g, 4, DType.i32)
    mask = (i.unsqueeze(1) % 2) < 1                          # bool
    y = F.where(mask.broadcast_to((4, 3)), x, 0.0).cast("bf16")
    F.output((y * 2.0).cast("f32").sum(-1), "out")
    F.output(i.cast("i64"), "idx")
    sat = saturate(g)
    for n in g.nodes:
        if n.op != "Output":
            assert sat.dtype[sat.node_class[n.id]] == n.dtype.value, n
    # kernels carry the dtype
    for c in sat.reachable:
        for node in sat.options[c]:
            if node.op.startswith("K") and node.op not in ("KInput", "KConstant"):
                assert node.args[-1] == sat.dtype[c]


def test_rule_files_are_package_data_with_comments():
    for name in ("terms.egg", "build.egg", "dtype.egg", "lower.egg", "flatten.egg", "gemm.egg", "inplace.egg",
                 "schedule.egg"):
        text = rule_text(name)
        assert text.lstrip().startswith(";"), name
    assert "run-schedule" in rule_text("schedule.egg")


def test_choice_lowering_is_a_valid_topological_program():
    g = _kv_write()
    sat = saturate(g)
    for seed in range(5):
        prog = lower(sat, random_choice(sat, seed))
        assert [o.id for o in prog.ops] == list(range(len(prog.ops)))
        assert all(a.src < o.id for o in prog.ops for a in o.args)
        assert prog.ops[-1].kind == "output" and prog.ops[0].kind == "input"
        type(prog).loads(prog.dumps())                       # JSON round trip validates order too
        for c in sat.decisions:
            assert chosen(sat, random_choice(sat, seed), c) in sat.options[c]


# ====================================================================== plumbing
def test_chunk_graph_is_standalone_and_compiles():
    from lum.builder.compile import compile_graph
    from lum.builder.models import load_spec
    from tests.model_layers import layer_groups

    spec = load_spec(random_name="tiny-llama", max_seq=32)
    g = spec.graphs["decode"]
    chunks = partition(g)
    cg = chunk_graph(g, chunks[1])
    exts = [n for n in cg.inputs() if n.attrs["role"] == "ext"]
    assert [n.attrs["name"] for n in exts] == [f"ext{k}" for k in range(len(chunks[1].input_nodes))]
    for n, src in zip(exts, chunks[1].input_nodes):
        assert n.shape == g.nodes[src].shape and n.dtype == g.nodes[src].dtype
    outs = {n.attrs["name"]: n.attrs["role"] for n in cg.outputs()}
    assert outs["k_cache.0"] == "state" and outs["v_cache.0"] == "state"
    assert any(name.startswith("out") for name in outs)          # the residual stream read by layer 1
    compiled = compile_graph(g)
    assert [len(c.group) for c in compiled] == [1, *map(len, layer_groups(g)), 1]   # layer 1 alone: norms ahead
    assert sum(len(c.group) for c in compiled) == len(chunks) == 4
    layer = compiled[1]
    # 4 matmuls: the stacked qkv, o, the stacked gate_up and down; q·k, softmax and p·v are one attention
    assert layer.stats["gemms"] == 4 and layer.stats["in_place"] == 2
    assert sum(o.kind == "attention" for o in layer.program.ops) == 1
    assert layer.stats["decisions"] - layer.stats["fuse_decisions"] == 8 and layer.stats["fuse_decisions"] > 0
    assert all(o.bytes.vars() <= {"p"} for o in layer.program.ops)


def test_decision_points_and_genomes_round_trip():
    from lum.builder.extract import choice_to_genome, decision_points, genome_to_choice

    sat = saturate(_kv_write())
    points = decision_points(sat)
    assert [labels for _, labels in points] == [("KScatter", "KScatterNoCopy")]
    for seed in range(3):
        ch = random_choice(sat, seed)
        assert genome_to_choice(sat, choice_to_genome(sat, ch)) == ch
    with pytest.raises(ValueError):
        genome_to_choice(sat, (0, 1))


def test_lower_with_an_empty_choice_takes_option_0_everywhere():
    sat = saturate(_matmul_graph((5, 8), (6, 8), None, (1, 0)))
    prog = lower(sat, {})
    assert prog.ops[0].kind == "input" and prog.ops[-1].kind == "output"


def test_lum_graph_egraph_flag(capsys):
    import json

    from lum.loader.cli import main

    with pytest.raises(SystemExit) as info:
        main(["graph", "--random", "tiny-llama", "--egraph", "--json"])
    out, _ = capsys.readouterr()
    assert (info.value.code or 0) == 0
    data = json.loads(out)
    for entry in ("prefill", "decode"):
        groups = data["graphs"][entry]["groups"]
        for grp in groups:
            e = grp["egraph"]
            assert e["eclasses"] > 0 and e["enodes"] >= e["eclasses"] and e["seconds_saturate"] >= 0
            assert e["seconds_extract"] >= 0
        assert groups[1]["egraph"]["gemms"] == 4      # the projections; attention, not q·k / p·v GEMMs
    with pytest.raises(SystemExit):
        main(["graph", "--random", "tiny-llama", "--egraph"])
    out, _ = capsys.readouterr()
    assert "E-graph per group" in out and "e-classes" in out
