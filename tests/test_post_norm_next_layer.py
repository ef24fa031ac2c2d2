"""A Gemma layer's FFN post-norm residual in the next layer's chunk (``$LUM_POST_NORM_NEXT_LAYER=1``,
builder/models/transformer.py), and the pass that moves ops only the outputs read last
(builder/rewrite.py ``outputs_last``).

Checked here: the model is the same model (the reference backend's logits over a prefill and decode
steps equal the default graph's, and stay within 1e-4 of transformers); the chunks regroup as the
first layer, the other layers, the final norm; in the repeated layer the qkv GEMV's prologue reads the
previous layer's FFN output and post-norm weight, nothing else in the layer but the residual kernel
reads them, and that kernel, which only the outputs read, comes last; llama is unchanged. The emulated
driver runs the kernels (tests/test_cuda_emulated.py variant ``postnorm-next``), the GPU decode too
(benchmarks/decode.py ``lum-postnorm-next``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("egglog")

from lum.builder.compile import compile_group  # noqa: E402
from lum.builder.models import load_spec  # noqa: E402
from lum.builder.models.generate import ReferenceModel  # noqa: E402
from lum.builder.models.transformer import ENV_POST_NORM_NEXT_LAYER  # noqa: E402
from lum.builder.partition import chunk_graph, group_chunks, partition  # noqa: E402
from lum.builder.rewrite import outputs_last, readers  # noqa: E402
from lum.format.dtypes import DType  # noqa: E402
from lum.format.expr import as_expr  # noqa: E402
from lum.format.llir import Arg, LOp, Program  # noqa: E402
from lum.format.shapetracker import ShapeTracker  # noqa: E402
from tests.hf_checkpoints import save_hf_model  # noqa: E402

PROMPT = [1, 5, 9, 3, 17, 100, 7]     # longer than tiny-gemma3's sliding window (4)
STEPS = [4, 7, 2, 11]


def _logits(spec) -> np.ndarray:
    ref = ReferenceModel(spec)
    rows = [ref.prefill(PROMPT)[-1]]
    rows += [ref.decode(t)[-1] for t in STEPS]
    return np.asarray(rows, np.float64)


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_the_same_model_as_the_default_graph_and_transformers(tmp_path, monkeypatch):
    model = save_hf_model("tiny-gemma3", tmp_path)
    want = _logits(load_spec(src=tmp_path, max_seq=32))
    monkeypatch.setenv(ENV_POST_NORM_NEXT_LAYER, "1")
    got = _logits(load_spec(src=tmp_path, max_seq=32))
    assert np.isfinite(got).all()
    assert _rel(got, want) < 1e-6
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=1, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    assert _rel(got[0], out.logits[0][0].double().numpy()) < 1e-4


def _layer_groups(model: str):
    spec = load_spec(random_name=model, dtype="bf16", max_seq=64)
    g = spec.graphs["decode"]
    return spec.config.num_layers, [(len(grp), chunk_graph(g, grp.representative)) for grp in group_chunks(g, partition(g))]


def test_the_qkv_prologue_computes_the_residual_and_its_kernel_runs_last(monkeypatch):
    monkeypatch.setenv(ENV_POST_NORM_NEXT_LAYER, "1")
    layers, groups = _layer_groups("tiny-gemma3")
    assert [n for n, _ in groups] == [1, 1, layers - 1, 1]     # embedding, first layer, the others, the head
    first = compile_group(groups[1][1])[0]
    assert not [o for o in first.inputs() if "post_feedforward" in o.params["name"]]
    prog = compile_group(groups[2][1])[0]
    users = readers(prog)
    post = [o for o in prog.inputs() if "post_feedforward" in o.params["name"]]
    assert [o.params["name"] for o in post] == ["model.layers.0.post_feedforward_layernorm.weight"]
    gemms = [o for o in prog.ops if o.kind == "gemm"]
    qkv, down = gemms[0], gemms[-1]
    assert "expr" in qkv.params and post[0].id in {a.src for a in qkv.args}
    body = [o for o in prog.ops if o.kind not in ("input", "constant", "output")]
    residual = body[-1]
    assert residual.kind == "elementwise" and {u.kind for u in users[residual.id]} == {"output"}
    assert {u.kind for u in users[down.id]} == {"output"}
    carried = [o for o in prog.inputs() if o.params["name"].startswith("ext") and o.id in {a.src for a in qkv.args}]
    assert len(carried) == 2            # the residual and the FFN output of the layer before
    for o in (post[0], *carried):       # read only in GEMV prologues and by the residual kernel
        assert {u.id for u in users[o.id]} <= {residual.id} | {g.id for g in gemms if "expr" in g.params}


def test_llama_is_unchanged(monkeypatch):
    _, plain = _layer_groups("tiny-llama")
    monkeypatch.setenv(ENV_POST_NORM_NEXT_LAYER, "1")
    _, switched = _layer_groups("tiny-llama")
    assert [compile_group(cg)[0].dumps() for _, cg in switched] == [compile_group(cg)[0].dumps() for _, cg in plain]


def _row(k: int) -> ShapeTracker:
    return ShapeTracker.contiguous((as_expr(1), as_expr(k)))


def _program(alias_after: bool) -> Program:
    """x → a = x+x (only an output reads it), b = x·x → c = b+b (an output); ``alias_after``: c writes in place."""
    k = 8
    x = LOp(0, "input", "Input", (), (as_expr(1), as_expr(k)), DType.f32, {"name": "x", "role": "input"})
    a = LOp(1, "elementwise", "Add", (Arg(0, _row(k)), Arg(0, _row(k))), x.shape, DType.f32)
    b = LOp(2, "elementwise", "Mul", (Arg(0, _row(k)), Arg(0, _row(k))), x.shape, DType.f32)
    c = LOp(3, "elementwise", "Add", (Arg(2, _row(k)), Arg(2, _row(k))), x.shape, DType.f32, {},
            0 if alias_after else None)
    outs = [LOp(4, "output", "Output", (Arg(1, _row(k)),), x.shape, DType.f32, {"name": "a", "role": "output"}),
            LOp(5, "output", "Output", (Arg(3, _row(k)),), x.shape, DType.f32, {"name": "c", "role": "output"})]
    return Program("p", [x, a, b, c, *outs])


def test_outputs_last_keeps_the_chain_together_and_nothing_in_place_moves():
    """``a`` (read by an output only) moves after ``b → c``; ``c``, which continues the chain from ``b``,
    stays right after it; a second pass moves nothing; with ``c`` writing in place nothing moves."""
    prog = _program(alias_after=False)
    moved = outputs_last(prog)
    assert [(o.op, [a.src for a in o.args]) for o in moved.ops] == [
        ("Input", []), ("Mul", [0, 0]), ("Add", [1, 1]), ("Add", [0, 0]), ("Output", [3]), ("Output", [2])]
    assert outputs_last(moved) is moved
    kept = _program(alias_after=True)
    assert outputs_last(kept) is kept
