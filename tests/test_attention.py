"""Decode attention derived from the HLIR pattern (rules/attention.egg): the rule fires on the decoders'
softmax(where(mask, q·k·scale, -inf))·v and on nothing that is not exactly that, the split-K LLIR
(attention partials + combine, format/llir.py) computes softmax attention whatever the chunk size, and
every extraction of a decode layer still matches the HLIR interpreter (tests/test_semantics.py runs the
random selections; here the cost model's, which picks the attention kernel)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("egglog")

from lum.builder import frontend as F  # noqa: E402
from lum.builder.compile import compile_group  # noqa: E402
from lum.builder.egraph import attention_views, saturate  # noqa: E402
from lum.builder.extract import attention_ops  # noqa: E402
from lum.builder.hlir import Graph  # noqa: E402
from lum.builder.reference import run_graph  # noqa: E402
from lum.format.dtypes import DType  # noqa: E402
from lum.format.expr import Var, as_expr  # noqa: E402
from lum.format.llir import Arg, LOp, Program  # noqa: E402
from lum.format.shapetracker import ShapeTracker  # noqa: E402
from lum.loader.reference_backend import execute  # noqa: E402

RNG = np.random.default_rng(11)


# ====================================================================== the LLIR semantics
def _program(r, t, d, dv, chunk, p_dtype, out_dtype=DType.f32) -> Program:
    q = ShapeTracker.contiguous(r + (d,))
    k = ShapeTracker.contiguous(r[:1] + (t, d)).expand_dim(1, r[1])
    v = ShapeTracker.contiguous(r[:1] + (t, dv)).expand_dim(1, r[1])
    m = ShapeTracker.contiguous((t,)).expand_dim(0, r[1]).expand_dim(0, r[0])
    ins = [LOp(0, "input", "Input", (), r + (d,), DType.f32, {"name": "q"}),
           LOp(1, "input", "Input", (), r[:1] + (t, d), DType.f32, {"name": "k"}),
           LOp(2, "input", "Input", (), r[:1] + (t, dv), DType.f32, {"name": "v"}),
           LOp(3, "input", "Input", (), (t,), DType.bool, {"name": "mask"})]
    ops = attention_ops((Arg(0, q), Arg(1, k), Arg(2, v), Arg(3, m)), 0.125, p_dtype, out_dtype, 4, chunk)
    out = LOp(7, "output", "Output", (Arg(6, ShapeTracker.contiguous(ops[-1].shape)),), ops[-1].shape, out_dtype,
              {"name": "y"})
    return Program("attention", ins + ops + [out])


def _softmax_attention(q, k, v, mask, scale, p_dtype=None):
    s = np.einsum("hgd,htd->hgt", q, k) * scale
    s = np.where(mask[None, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    if p_dtype is not None:                     # rounded before the normalisation, as the kernel does
        l = p.sum(-1, keepdims=True)
        return np.einsum("hgt,htd->hgd", p.astype(p_dtype).astype(np.float64), v) / l
    return np.einsum("hgt,htd->hgd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("chunk", [1, 3, 16, 1000])
def test_split_k_partials_combine_to_softmax_attention(chunk):
    r, t, d, dv = (as_expr(2), as_expr(3)), Var("T"), 8, 5
    prog = Program.loads(_program(r, t, as_expr(d), as_expr(dv), chunk, DType.f32).dumps())
    assert prog.version() == 2 and prog.ops[4].kind == "attention"
    for n in (1, 7, 40):
        q, k, v = RNG.normal(size=(2, 3, d)), RNG.normal(size=(2, n, d)) * 3, RNG.normal(size=(2, n, dv))
        mask = RNG.random(n) < 0.7
        mask[n // 2] = True
        args = {"q": q.astype(np.float32), "k": k.astype(np.float32), "v": v.astype(np.float32), "mask": mask}
        got = execute(prog, args, {"T": n})["y"]
        want = _softmax_attention(*(a.astype(np.float32).astype(np.float64) for a in (q, k, v)), mask, 0.125)
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_probabilities_round_before_the_normalisation_and_a_masked_row_is_nan():
    r = (as_expr(1), as_expr(2))
    prog = _program(r, as_expr(33), as_expr(4), as_expr(4), 16, DType.bf16)
    q, k, v = RNG.normal(size=(1, 2, 4)), RNG.normal(size=(1, 33, 4)), RNG.normal(size=(1, 33, 4))
    mask = np.ones(33, bool)
    args = {"q": q.astype(np.float32), "k": k.astype(np.float32), "v": v.astype(np.float32), "mask": mask}
    got = execute(prog, args)["y"]
    f = [a.astype(np.float32).astype(np.float64) for a in (q, k, v)]
    want = _softmax_attention(*f, mask, 0.125, ml_dtypes.bfloat16)
    exact = _softmax_attention(*f, mask, 0.125)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-2         # rounding offsets may differ by 2^k
    assert 1e-5 < np.abs(got - exact).max() / np.abs(exact).max() < 2e-2   # bf16 probabilities, not exact
    assert np.isnan(execute(prog, {**args, "mask": np.zeros(33, bool)})["y"]).all()


def test_attention_validation():
    good = _program((as_expr(1), as_expr(2)), as_expr(5), as_expr(4), as_expr(4), 2, DType.f32)
    bad = Program(good.name, list(good.ops))
    bad.ops[4] = LOp(4, "attention", "Attention", good.ops[4].args, good.ops[4].shape, DType.f32,
                     {**good.ops[4].params, "chunk": 0})
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        Program.loads(bad.dumps())
    wrong = LOp(4, "attention", "Attention", good.ops[4].args[:3], good.ops[4].shape, DType.f32, good.ops[4].params)
    bad.ops[4] = wrong
    with pytest.raises(ValueError, match="attention takes"):
        Program.loads(bad.dumps())


# ====================================================================== the rule
def _attention_graph(variant: str = "decode", dtype: str = "f32") -> tuple[Graph, dict]:
    """A decode-attention layer as the decoders write it (GQA 2 kv heads x 3, a [16, 2, 8] cache read
    [0, p + 1)), and near misses of it."""
    g = Graph(variant)
    p = Var("p")
    t = p + 1
    q = F.input_tensor(g, "q", [2, 3, 1, 8], dtype)
    kc = F.input_tensor(g, "k", [16, 2, 8], dtype)
    vc = F.input_tensor(g, "v", [16, 2, 8], dtype)
    mask = F.input_tensor(g, "mask", [1, t], "bool")

    def heads(c):
        return c.slice(0, 0, t).permute(1, 0, 2).expand_dim(1, 3)

    f32 = DType.f32
    scores = F.matmul(q.cast(f32), heads(kc.cast(f32)).transpose(-2, -1))
    if variant == "scale-after-mask":
        logits = F.where(mask, scores, float("-inf")) * 0.25
    else:
        scores = scores * 0.25
        logits = scores if variant == "no-mask" else F.where(mask, scores, float("-inf"))
    if variant == "softmax-over-rows":          # over a GQA group's query rows, not over the keys
        probs = F.where(mask, scores, -30.0).softmax(1)
    elif variant == "exp-base-e":               # exp(x - max) written with a different constant: not a softmax
        e = ((logits - logits.max(-1, keepdim=True)) * 1.5).exp2()
        probs = e / e.sum(-1, keepdim=True)
    else:
        probs = logits.softmax(-1)
    F.output(F.matmul(probs.cast(dtype), heads(vc)), "out")
    return g, {"p": 9}


def _inputs(g: Graph, dyn: dict) -> dict:
    out = {}
    for n in g.inputs():
        shape = tuple(x.evaluate(dyn) for x in n.shape)
        if n.dtype == DType.bool:
            a = RNG.random(shape) < 0.8
            a[..., 0] = True
        else:
            a = RNG.normal(size=shape).astype(n.dtype.np)
        out[n.attrs["name"]] = a
    return out


def attention_options(sat) -> list:
    """The KAttention e-nodes among the reachable options of a saturated group."""
    return [n for c in sat.reachable for n in sat.options[c] if n.op == "KAttention"]


def attention_rule_program(g: Graph, dtype: str) -> tuple[list, Program]:
    """The attention rule on ``g`` (``dtype``: the model's, "f32" or 16-bit): it fired once (the rounded form
    for 16-bit), the views of each KAttention option (at least one), and the cost model's program, whose
    kernels are one attention and no GEMM and which survives its text form."""
    sat = saturate(g)
    assert sat.fired("attention" if dtype == "f32" else "attention-rounded") == 1
    views = [attention_views(sat, n) for n in attention_options(sat)]
    assert views
    prog, _ = compile_group(g, sat=sat)
    kinds = [o.kind for o in prog.kernels()]
    assert kinds.count("attention") == 1 and "gemm" not in kinds
    assert Program.loads(prog.dumps()).ops == prog.ops
    return views, prog


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_the_rule_fires_on_decode_attention_and_the_cost_model_takes_it(dtype):
    g, dyn = _attention_graph("decode", dtype)
    views, prog = attention_rule_program(g, dtype)
    assert all(v.group == (1, 2) for v in views)
    inputs = _inputs(g, dyn)
    want = run_graph(g, inputs, dyn)["out"].astype(np.float64)
    got = execute(prog, inputs, dyn)["out"].astype(np.float64)
    assert np.abs(got - want).max() / np.abs(want).max() < (1e-5 if dtype == "f32" else 2e-2)


@pytest.mark.parametrize("variant", ["no-mask", "scale-after-mask", "softmax-over-rows", "exp-base-e"])
def test_the_rule_does_not_fire_on_near_misses(variant):
    g, dyn = _attention_graph(variant)
    sat = saturate(g)
    assert not attention_options(sat)
    prog, _ = compile_group(g, sat=sat)
    inputs = _inputs(g, dyn)
    want = run_graph(g, inputs, dyn)["out"]
    assert np.abs(execute(prog, inputs, dyn)["out"] - want).max() / np.abs(want).max() < 1e-5


@pytest.mark.parametrize("flash_on", [True, False], ids=["default", "noflash"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
def test_decoders_use_one_attention_kernel_per_layer(model, flash_on, monkeypatch):
    """Decode's attention is the split-K kernel (a GQA group of static rows, chunks of 16 keys). Prefill's, whose
    rows sharing a K / V row are the group times the prompt, is flash attention (chunks of 4,096 keys); with
    ``$LUM_FLASH_ATTENTION=0`` its q·k and p·v stay GEMMs."""
    from lum.builder.attention_policy import flash_attention
    from lum.builder.extract import ATTENTION_CHUNK, FLASH_ATTENTION_CHUNK
    from lum.builder.models import load_spec
    from lum.builder.partition import chunk_graph
    from tests.model_layers import layer_groups

    monkeypatch.setenv("LUM_FLASH_ATTENTION", "1" if flash_on else "0")
    spec = load_spec(random_name=model, dtype="bf16", max_seq=64)
    for entry, flash, chunk in (("decode", False, ATTENTION_CHUNK), ("prefill", True, FLASH_ATTENTION_CHUNK)):
        g = spec.graphs[entry]
        layers = layer_groups(g)
        assert layers
        prog = compile_group(chunk_graph(g, layers[0].representative))[0]
        att = [o for o in prog.ops if o.kind == "attention"]
        if flash and not flash_on:      # q·k and p·v as GEMMs beside the projections
            assert not att and sum(o.kind == "gemm" for o in prog.ops) == 6, entry
            continue
        # q·k and p·v are no GEMMs: the layer's are its projections, qkv, o, gate-up and down
        assert len(att) == 1 and sum(o.kind == "gemm" for o in prog.ops) == 4, entry
        assert flash_attention(att[0]) == flash and att[0].params["chunk"] == chunk, entry


def test_attention_chunk_from_the_environment(monkeypatch):
    """``$LUM_ATTENTION_CHUNK`` sets decode attention's split where the tuning does not (32: the decode LLIR's
    attention op and its partials' chunk axis follow; prefill's flash attention keeps its own); a value
    outside the search's choices is a one-line error."""
    from lum.builder.extract import FLASH_ATTENTION_CHUNK
    from lum.builder.models import load_spec
    from lum.builder.partition import chunk_graph
    from tests.model_layers import layer_groups

    monkeypatch.setenv("LUM_ATTENTION_CHUNK", "32")
    spec = load_spec(random_name="tiny-llama", dtype="bf16", max_seq=64)
    for entry, chunk in (("decode", 32), ("prefill", FLASH_ATTENTION_CHUNK)):
        g = spec.graphs[entry]
        layers = layer_groups(g)
        prog = compile_group(chunk_graph(g, layers[0].representative))[0]
        att = next(o for o in prog.ops if o.kind == "attention")
        assert att.params["chunk"] == chunk, entry
        if entry == "decode":
            assert str(att.shape[-2]) == "cdiv(p + 1, 32)", att.shape
    monkeypatch.setenv("LUM_ATTENTION_CHUNK", "48")
    g = spec.graphs["decode"]
    layers = layer_groups(g)
    with pytest.raises(ValueError, match="LUM_ATTENTION_CHUNK must be 16, 32 or 64"):
        compile_group(chunk_graph(g, layers[0].representative))
